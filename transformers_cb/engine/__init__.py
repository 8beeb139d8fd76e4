"""One step of continuous batching: the `Engine` (driving the scheduler and the runner), forks, and
the checks a submission passes to become a `Request`."""
