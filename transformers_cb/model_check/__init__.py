"""Whether a model can run under continuous batching, decided before anything is sized or allocated: the
support check (model_support.py) and the probes it reads (attention_probe.py: what the forward does with
its attention; state_probe.py: the model's state layers and their states' shapes). The engine's settings
(`resolve_settings`) ask it once at start; nothing here allocates a cache or keeps a model."""
