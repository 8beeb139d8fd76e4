"""Async batching (`use_async_batching=True`, with CUDA graphs): double-buffered step inputs and events.

Each graph bucket has two sets of static input buffers, used by alternate steps. Step N+1's inputs are
copied into its set on a side stream while step N's graph may still be running on the compute stream
from the other set; events order the two streams so that

- a graph replays only after its inputs are copied (`copied[b]`, waited on by the compute stream), and
- a buffer set is overwritten only after the replay that read it is done (`computed[b]`, waited on by
  the copy stream).

Outputs are unchanged: each step reads exactly its own inputs. What overlaps is the input copy with the
previous step's compute; scheduling step N+1 still needs step N's sampled tokens on the host (the
scheduler is synchronous), so CPU-side packing does not yet run ahead of the GPU (see docs/fast_paths.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


class BufferTurns:
    """Which buffer set a step uses, and the stream/event protocol around it (a no-op when disabled)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.device = device
        self._turn = 0
        if enabled:
            self.copy_stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            self.computed = [torch.cuda.Event(), torch.cuda.Event()]

    @property
    def num_buffers(self) -> int:
        return 2 if self.enabled else 1

    def next_buffer(self) -> int:
        """0, 1, 0, 1, ... when enabled; always 0 otherwise."""
        if not self.enabled:
            return 0
        buffer, self._turn = self._turn, self._turn ^ 1
        return buffer

    @contextmanager
    def filling(self, buffer: int) -> Iterator[None]:
        """Copy into `buffer` on the copy stream, after the last replay that read it."""
        if not self.enabled:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_event(self.computed[buffer])
        self.copy_stream.wait_stream(compute)  # the packed step's tensors were made on the compute stream
        with torch.cuda.stream(self.copy_stream):
            yield
        self.copied[buffer].record(self.copy_stream)

    def computing(self, buffer: int):
        """Replay on the compute stream once `buffer` is copied; mark when the replay is done."""
        if not self.enabled:
            return nullcontext()
        return self._computing(buffer)

    @contextmanager
    def _computing(self, buffer: int) -> Iterator[None]:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.copied[buffer])
        yield
        self.computed[buffer].record(compute)
