"""transformers' linear-attention cache API over state slots: what a state module reads and writes when
one piece of the packed step runs (runner/states/state_layers.py), and the probe's recorder of the states'
shapes (model_check/state_probe.py).

`SlotStateView` answers `get_conv_state`, `get_recurrent_state`, `update_conv_state`,
`update_recurrent_state`, `is_recording_past` and `has_previous_state` from the rows of the slots it was
made for, as `transformers.cache_utils.LinearAttentionLayer` does for one request, so a state module's
own code runs unchanged; a model-owned recurrence (runner/states/own_state.py) reads and keeps its states
through `read` / `keep`. Kept apart from the split forwards because the view is the one piece both the
step and the probe use, and the only piece that knows the cache API's semantics (a first chunk's
left-padded window, the copies transformers' cache makes).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ...invariants import InvariantError
from ...memory.state_cache import CONV, RECURRENT, StateCache, StateSpec


def padded_to(conv_states: torch.Tensor, width: int) -> torch.Tensor:
    """A first chunk's convolution window: left-padded with zeros to `width` columns when shorter (as
    transformers' `LinearAttentionLayer.update_conv_state` on a cache with no previous state)."""
    if conv_states.shape[-1] >= width:
        return conv_states
    return torch.nn.functional.pad(conv_states, (width - conv_states.shape[-1], 0), value=0)


class SlotStateView:
    """transformers' linear-attention cache API over slots `slots` of `cache`, for one call of one layer.

    What the layer reads is gathered from the slots' rows and what it leaves (the states it updated in
    place or through `update_*`) is written back by `write_back()` after the call. `fresh`: the rows
    start a request (no previous state, as transformers' cache before its first update)."""

    def __init__(self, cache: StateCache, slots: torch.Tensor, fresh: bool) -> None:
        self.cache = cache
        self.slots = slots
        self.fresh = fresh
        self._held: dict[tuple[int, str, int], torch.Tensor] = {}

    def _rows(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        key = (layer_idx, kind, state_idx)
        if key not in self._held:
            storage = self.cache.tensor(*key)
            if storage is None:
                return None
            self._held[key] = storage.index_select(0, self.slots)
        return self._held[key]

    def read(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        """The rows' state `(layer_idx, kind, state_idx)` (None: the rows start a request, or no such
        state): a model-owned recurrence's way in (runner/states/own_state.py)."""
        return None if self.fresh else self._rows(layer_idx, kind, state_idx)

    def keep(self, layer_idx: int, kind: str, state_idx: int, value: torch.Tensor) -> None:
        """What the rows' state `(layer_idx, kind, state_idx)` is after the call (`[rows, *shape]`),
        stored by `write_back()`."""
        storage = self.cache.tensor(layer_idx, kind, state_idx)
        if storage is None:
            raise InvariantError(f"layer {layer_idx} keeps a {kind} state {state_idx} its probe never saw")
        self._held[(layer_idx, kind, state_idx)] = value.to(storage.dtype, copy=True)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self._rows(layer_idx, CONV, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self._rows(layer_idx, RECURRENT, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """As transformers' `LinearAttentionLayer.update_conv_state`: the window the convolution sees
        (the previous state then the new inputs; a first chunk left-padded with zeros to the kernel),
        of which the last kernel-size columns are the new state."""
        key = (layer_idx, CONV, state_idx)
        storage = self.cache.tensor(*key)
        if storage is None:
            raise InvariantError(f"layer {layer_idx} updates a conv state {state_idx} its probe never saw")
        width = storage.shape[-1]
        previous = None if self.fresh else self._rows(*key)
        if previous is None:
            full = padded_to(conv_states, width)
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self._held[key] = full[..., -width:].to(storage.dtype)
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        key = (layer_idx, RECURRENT, state_idx)
        storage = self.cache.tensor(*key)
        if storage is None:
            raise InvariantError(
                f"layer {layer_idx} updates a recurrent state {state_idx} its probe never saw"
            )
        # A copy, as transformers' cache copies into its own tensor.
        self._held[key] = recurrent_states.to(storage.dtype, copy=True)
        return self._held[key]

    def write_back(self) -> None:
        """Store what the layer left in its slots' rows."""
        for key, rows in self._held.items():
            self.cache.tensors[key].index_copy_(0, self.slots, rows)


class StateRecorder(SlotStateView):
    """The same API during the probe: one fresh request of batch 1 (so nothing is ever read), whose
    states' shapes and dtypes it records (`specs`) instead of storing them."""

    def __init__(self) -> None:
        super().__init__(cast(StateCache, None), torch.zeros(1, dtype=torch.int64), fresh=True)
        self.specs: dict[tuple[int, str, int], StateSpec] = {}

    def keep(self, layer_idx: int, kind: str, state_idx: int, value: torch.Tensor) -> None:
        self.specs[(layer_idx, kind, state_idx)] = StateSpec(
            layer_idx, kind, state_idx, tuple(value.shape[1:]), value.dtype
        )

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        width = conv_kernel_size if conv_kernel_size is not None else conv_states.shape[-1]
        shape = (*conv_states.shape[1:-1], width)
        self.specs[(layer_idx, CONV, state_idx)] = StateSpec(
            layer_idx, CONV, state_idx, shape, conv_states.dtype
        )
        return padded_to(conv_states, width)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        shape = tuple(recurrent_states.shape[1:])
        self.specs[(layer_idx, RECURRENT, state_idx)] = StateSpec(
            layer_idx, RECURRENT, state_idx, shape, recurrent_states.dtype
        )
        return recurrent_states
