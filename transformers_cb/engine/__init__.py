"""One step of continuous batching: the `Engine` (engine.py) driving the scheduler and the runner, built
once (build.py) from frozen settings composed of its parts' settings (settings.py), its tensor-parallel follower
(follower.py) and rank 0's publisher (publisher.py); a submission made a `Request` (intake/), the draft
model and whether the engine can speculate (speculation/), the model's weights and adapters (weights/).
Whether a model can run at all is model_check/'s."""
