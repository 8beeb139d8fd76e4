"""Model methods that create and cache `ContinuousBatchingManager`s (written next)."""


def init_continuous_batching(self, *a, **k):
    raise NotImplementedError


def continuous_batching_context_manager(self, *a, **k):
    raise NotImplementedError


def destroy_cached_continuous_batching_manager(self):
    raise NotImplementedError
