"""The CPU (gloo) group that carries rank 0's step decisions, bounded by `cpu_group_timeout`.

Every collective on it either completes or raises `TensorParallelError` naming the timeout. A step
message costs two collectives: a MAX all-reduce of its size (every rank takes part, so rank 0
learns within the timeout that a rank is gone or hung; a plain broadcast from rank 0 would return
as soon as the bytes are in the socket) and a broadcast of the pickled bytes.

The model's own TP group (the forward's all-reduces) gets the same timeout when it is a gloo group,
so a rank that hangs inside a forward is detected too, not after transformers' 2-hour default.
"""

from __future__ import annotations

import atexit
import logging
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# `cpu_group_timeout=None` means no timeout; gloo needs a finite one, so None maps to a year.
NO_TIMEOUT = timedelta(days=365)

# One group per (member ranks, timeout), shared by every engine of the process: `new_group` is a
# collective of the whole world, so creating one per `generate_batch` call would cost a rendezvous.
_GROUPS: dict[tuple[tuple[int, ...], float | None], dist.ProcessGroup] = {}


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died, hung past `cpu_group_timeout`, or failed a step."""


def as_timedelta(seconds: float | None) -> timedelta:
    return NO_TIMEOUT if seconds is None else timedelta(seconds=seconds)


def describe_timeout(seconds: float | None) -> str:
    return "cpu_group_timeout=None (no timeout)" if seconds is None else f"cpu_group_timeout={seconds:g} s"


class CpuGroup:
    """Args:
    ranks: global ranks of the TP group, in TP order (the first one is the driver).
    timeout: seconds each collective may wait for the other ranks (None: no timeout).
    model_group: the model's TP process group; gets the same timeout when it is gloo.
    """

    def __init__(
        self, ranks: list[int], timeout: float | None, model_group: dist.ProcessGroup | None = None
    ) -> None:
        self.ranks = ranks
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.root = ranks[0]
        key = (tuple(ranks), timeout)
        if not _GROUPS:
            atexit.register(destroy_groups_at_exit)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=as_timedelta(timeout),
                use_local_synchronization=len(ranks) < dist.get_world_size(),
            )
        self.group = _GROUPS[key]
        if model_group is not None and dist.get_backend(model_group) == "gloo":
            bound_model_group(model_group, timeout)
        self.broken: str | None = None  # set by the first failed collective; later calls fail fast
        self._size = torch.zeros(1, dtype=torch.int64)

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    def exchange(self, message: object = None) -> object:
        """Root: send `message` to every rank and return it. Others: return the root's message (unpickled:
        the caller checks what it is)."""
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        payload = pickle.dumps(message) if self.is_root else b""
        try:
            self._size.fill_(len(payload))
            dist.all_reduce(self._size, op=dist.ReduceOp.MAX, group=self.group)
            buffer = torch.empty(int(self._size.item()), dtype=torch.uint8)
            if self.is_root:
                buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(buffer, src=self.root, group=self.group)
        except Exception as error:  # noqa: BLE001 - any collective failure ends the group
            raise self.fail("exchanging the step decision", error) from error
        return message if self.is_root else pickle.loads(buffer.numpy().tobytes())

    def min_ints(self, values: list[int]) -> list[int]:
        """The element-wise minimum of `values` over the group (every rank gets the same list)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        except Exception as error:  # noqa: BLE001
            raise self.fail("agreeing on the cache size", error) from error
        return tensor.tolist()

    def fail(self, what: str, error: BaseException) -> TensorParallelError:
        """Mark the group broken and build the error every later call raises."""
        self.broken = (
            f"tensor parallelism: rank {self.rank} failed while {what} ({describe_timeout(self.timeout)}); "
            f"another rank of {self.ranks} died, hung or failed: {type(error).__name__}: {error}"
        )
        logger.error(self.broken)
        return TensorParallelError(self.broken)


def bound_model_group(group: dist.ProcessGroup, timeout: float | None) -> None:
    """Give the model's gloo TP group the CPU group's timeout (transformers creates it with 2 hours)."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:  # older torch: the model's collectives keep their own timeout
        logger.warning("this torch cannot change the model group's timeout; a hung forward waits for it")
        return
    _set_pg_timeout(as_timedelta(timeout), group)


def destroy_groups_at_exit() -> None:
    """Destroy every process group while the interpreter is still whole (registered with `atexit` when the
    first CPU group is made).

    Why: a script under `torchrun` (the guide's tensor-parallel block) ends without
    `destroy_process_group()`; gloo's worker threads then outlive the interpreter's teardown, and rank 0
    sometimes aborted at exit ("terminate called without an active exception", SIGABRT) after every output
    was right. torch does not do this itself (pytorch/pytorch#179291 proposed it). Destroying is local to
    the process under gloo (no collective), so it cannot wait on a rank that is gone. A script that
    destroyed the groups itself leaves nothing to do here.
    """
    _GROUPS.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - at exit, a failure to clean up is only worth a line
        logger.warning("destroying the process groups at exit failed: %s: %s", type(error).__name__, error)
