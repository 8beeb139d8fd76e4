"""One step of continuous batching: the `Engine` (engine.py) driving the scheduler and the runner, built
once from a frozen plan (build.py), its tensor-parallel follower (follower.py) and rank 0's publisher
(publisher.py), forks, and the checks a submission passes to become a `Request`."""
