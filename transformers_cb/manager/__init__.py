"""`ContinuousBatchingManager`: the background thread, submissions, results and their channels, stats."""
