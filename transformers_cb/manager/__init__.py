"""`ContinuousBatchingManager`: the background thread, submissions, stats; results and their channels
(delivery/), pauses and the cache release (holds/), the thread's torch threads (torch_threads/)."""
