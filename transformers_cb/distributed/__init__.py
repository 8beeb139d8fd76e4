"""Tensor parallelism (`DistributedConfig(tp_size=N)` under `torchrun`): see docs/parallelism.md.

- `sharding`: the TP size read from the model, KV heads per shard, refusals at start;
- `cpu_group`: the gloo group that carries the step decisions, bounded by `cpu_group_timeout`;
- `coordinator`: rank 0 publishes each step (scheduled tokens and pages, sampled tokens, finished
  requests), the other ranks replay it with the same forward.
"""

from .coordinator import TensorParallelCoordinator
from .cpu_group import TensorParallelError

__all__ = ["TensorParallelCoordinator", "TensorParallelError"]
