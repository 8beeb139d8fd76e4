"""One step of continuous batching: the `Engine`, its scheduler and policies, the step's plan,
forks, and the checks a submission passes to become a `Request`."""
