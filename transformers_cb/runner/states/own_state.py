"""Model-owned recurrences in the packed step: the families whose recurrent layers keep their state in a
cache of their own instead of transformers' linear-attention cache API, run at their slots like the
cache API's modules (runner/states/state_layers.py).

Each family is one small `StateCall`: how to hand one piece of the step (the decode batch, or one
request's span) its slots' states in the form the module reads them, and how to take back what the
module leaves. Everything else (the split by request, the slots, chunked prefill, forks, swaps and
preemption, the probe of the states' shapes and of how a continued chunk runs) is the state layers'
own, unchanged:

- MiniMax's lightning attention (`MiniMaxLightningAttention`): one `[heads, head dim, head dim]` K^T V
  state read and set through `get_linear_cache` / `set_linear_cache` of its `MiniMaxCache`, given here
  over the slots (`LinearCacheView`);
- RecurrentGemma's recurrent block (`RecurrentGemmaRecurrentBlock`): its convolution window and RG-LRU
  state live on the module (`conv1d_state`, `rg_lru.recurrent_states`): each call runs on a shallow
  copy of the block holding the slots' states, read back after the call; the block reads each token's
  position (`position_ids`: the RG-LRU resets at 0), taken from the step's rows;
- RWKV (`RwkvBlock`): five per-layer states (the attention's and the feed-forward's token shifts, the
  WKV numerator, denominator and maximum) in the model's `state` list `[batch, hidden, layers]`, given
  as views whose layer axis is this layer's state alone;
- xLSTM (`xLSTMBlock`): the mLSTM's (C, n, m) state passed in and returned by the block.

A family's fresh state is what `generate()` starts from (its cache's zeros; RWKV's maximum at -1e30),
so a request's first chunk computes what `generate()`'s prefill does.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...invariants import InvariantError
from ...memory.state_cache import CONV, RECURRENT
from .slot_state_view import SlotStateView
from .state_layers import CacheApiCall, StateCall, StatePiece, cache_parameter, state_modules

# RWKV's state list: the attention's and the feed-forward's token shifts (the model's dtype), the WKV
# numerator, denominator and maximum (float32), in the order of `RwkvModel`'s `state`.
RWKV_STATES = 5
RWKV_FRESH_MAXIMUM = -1e30  # what `RwkvModel.forward` starts the maximum at


class LinearCacheView:
    """`MiniMaxCache`'s lightning-attention API over a slot view: the K^T V state of a layer."""

    def __init__(self, view: SlotStateView) -> None:
        self.view = view

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.view.read(layer_idx, RECURRENT, 0)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.view.keep(layer_idx, RECURRENT, 0, linear_cache)


@dataclass(frozen=True)
class MiniMaxCall(StateCall):
    """`MiniMaxLightningAttention(hidden_states, position_embeddings, attention_mask, past_key_values)`,
    returning `(output, state)`: its cache is the slots' `LinearCacheView` (a fresh request reads None and
    runs the block path of `generate()`'s prefill, a continued one the token path of its decode)."""

    layer: int

    def run(self, piece: StatePiece) -> torch.Tensor:
        output, _ = piece.original(
            piece.hidden(),
            position_embeddings=None,
            attention_mask=None,
            past_key_values=LinearCacheView(piece.view),
        )
        return output

    def packed(self, output: torch.Tensor) -> Any:
        return output, None

    def float32_copy(self, module: nn.Module) -> nn.Module:
        """With its decay buffers computed again in float32: a bfloat16 model's are rounded each on its
        own, so its block path (the tables) and its token path (`exp(-slope_rate)`) differ by that
        rounding, which the continuation check would take for a restart."""
        exact: Any = super().float32_copy(module)
        slope_rate = exact.get_slope_rate(device=exact.slope_rate.device)
        query_decay, key_decay, diagonal_decay = exact.decay_factors(slope_rate)
        exact.slope_rate.copy_(slope_rate)
        exact.query_decay.copy_(query_decay)
        exact.key_decay.copy_(key_decay)
        exact.diagonal_decay.copy_(diagonal_decay)
        return exact


@dataclass(frozen=True)
class RecurrentGemmaCall(StateCall):
    """`RecurrentGemmaRecurrentBlock(input_states, position_ids, attention_mask, use_cache)`, returning
    `(output, None)`, its states on the module (`conv1d_state`, `rg_lru.recurrent_states`).

    Each call runs the class's forward on a shallow copy of the block (and of its RG-LRU) holding the
    slots' states (fresh: the zeros of its `_setup_cache`), read back after the call: the block's own
    attributes are never touched, so a `generate()` on the same model (another thread, beside a running
    manager) and the engine's steps never see each other's states. (A wrapper installed on the block's
    `forward`, such as accelerate's device hooks, is not called: the slots live on the model's device.)"""

    layer: int
    module: Any = field(compare=False, repr=False)  # transformers' RecurrentGemmaRecurrentBlock

    def run(self, piece: StatePiece) -> torch.Tensor:
        hidden, view = piece.hidden(), piece.view
        # The block `original` is the forward of (the probe's float32 copy, or the model's own); a
        # wrapper of it: the block this call was made for.
        block = getattr(piece.original, "__self__", None)
        if not isinstance(block, type(self.module)):
            block = self.module
        batch = hidden.shape[0]
        conv = view.read(self.layer, CONV, 0)
        recurrent = view.read(self.layer, RECURRENT, 0)
        if conv is None or recurrent is None:
            width = block.conv1d_width - 1
            conv = hidden.new_zeros(batch, block.hidden_size, width)
            recurrent = torch.zeros(batch, block.lru_width, dtype=torch.float32, device=hidden.device)
        positions = piece.kwargs.get("position_ids", piece.args[0] if piece.args else None)
        if not isinstance(positions, torch.Tensor):
            raise InvariantError("RecurrentGemma's recurrent block was called without its position_ids")
        own = _with_own_state(block)
        own.conv1d_state, own.rg_lru.recurrent_states = conv, recurrent
        output, _ = type(block).forward(
            own, hidden, position_ids=piece.rows.take(positions), attention_mask=None, use_cache=True
        )
        view.keep(self.layer, CONV, 0, own.conv1d_state)
        view.keep(self.layer, RECURRENT, 0, own.rg_lru.recurrent_states)
        return output

    def packed(self, output: torch.Tensor) -> Any:
        return output, None


def _with_own_state(block: nn.Module) -> Any:
    """A shallow copy of RecurrentGemma's recurrent `block` whose state attributes are its own (its
    RG-LRU copied too; the weights and the other submodules shared)."""
    own = copy.copy(block)
    own._modules = dict(block._modules)
    own._modules["rg_lru"] = copy.copy(block._modules["rg_lru"])
    return own


@dataclass(frozen=True)
class RwkvCall(StateCall):
    """`RwkvBlock(hidden, state, use_cache)`, returning `(hidden, state, attentions)`: its `state` is five
    tensors `[batch, hidden, layers]` it reads and writes at its own layer; here each is the slots' state
    `[batch, hidden]` seen through a layer axis of stride 0 (every layer index is this layer's state, no
    copy of the other layers').

    The decode batch runs one request at a time: the block's one-token path mixes `hidden` `[batch, 1,
    hidden]` with the shifted state `[batch, hidden]`, which broadcast to `[batch, batch, hidden]` for
    more than one request (transformers' `generate()` decodes RWKV exactly at batch size 1 only)."""

    layer: int
    hidden_size: int

    def run(self, piece: StatePiece) -> torch.Tensor:
        hidden = piece.hidden()
        states = [self._state(piece.view, i, hidden) for i in range(RWKV_STATES)]
        requests = range(hidden.shape[0]) if piece.rows.decode else [None]
        outputs = [self._one(piece.original, hidden, states, row) for row in requests]
        for i, state in enumerate(states):
            piece.view.keep(self.layer, RECURRENT, i, state)
        return torch.cat(outputs, dim=0)

    def _state(self, view: SlotStateView, i: int, hidden: torch.Tensor) -> torch.Tensor:
        state = view.read(self.layer, RECURRENT, i)
        if state is not None:
            return state.contiguous()
        dtype = hidden.dtype if i <= 1 else torch.float32
        fresh = torch.zeros(hidden.shape[0], self.hidden_size, dtype=dtype, device=hidden.device)
        return fresh.fill_(RWKV_FRESH_MAXIMUM) if i == RWKV_STATES - 1 else fresh

    def _one(
        self, original: Callable[..., Any], hidden: torch.Tensor, states: list[torch.Tensor], row: int | None
    ) -> torch.Tensor:
        """The block on `hidden` (one request's row `row` of the decode batch, or the whole span: None),
        its states updated in place."""
        if row is not None:
            hidden, states = hidden[row : row + 1], [s[row : row + 1] for s in states]
        layered = [
            s.as_strided((s.shape[0], self.hidden_size, self.layer + 1), (s.stride(0), s.stride(1), 0))
            for s in states
        ]
        return original(hidden, state=layered, use_cache=True)[0]

    def packed(self, output: torch.Tensor) -> Any:
        return output, None, None


@dataclass(frozen=True)
class XlstmCall(StateCall):
    """`xLSTMBlock(x, state)`, returning `(x, state)`: the mLSTM's (C, n, m) given from the slots (fresh:
    the zeros of `xLSTMCache`, in the model's dtype, as `generate()`'s cache holds them)."""

    layer: int
    shapes: tuple[tuple[int, ...], ...]  # C, n, m per request
    chunk_limit: int  # `max_inference_chunksize`: `xLSTMModel` splits a longer forward into pieces

    @property
    def max_step_tokens(self) -> int | None:
        return self.chunk_limit

    def run(self, piece: StatePiece) -> torch.Tensor:
        hidden = piece.hidden()
        state = []
        for i, shape in enumerate(self.shapes):
            held = piece.view.read(self.layer, RECURRENT, i)
            state.append(held if held is not None else hidden.new_zeros(hidden.shape[0], *shape))
        output, new_state = piece.original(hidden, tuple(state))
        for i, value in enumerate(new_state):
            piece.view.keep(self.layer, RECURRENT, i, value.to(hidden.dtype))
        return output

    def packed(self, output: torch.Tensor) -> Any:
        return output, None


def _layer_of(name: str) -> int | None:
    """The decoder layer a module belongs to: the first index in its qualified name (`model.layers.3.
    temporal_block`, `rwkv.blocks.2`)."""
    found = re.search(r"\.(\d+)(\.|$)", "." + name)
    return int(found.group(1)) if found else None


def _xlstm_shapes(config: Any) -> tuple[tuple[int, ...], ...]:
    heads, qk, v = config.num_heads, config.qk_head_dim, config.v_head_dim
    return (heads, qk, v), (heads, qk), (heads, 1)


# class name -> its call, from the module and its layer index.
OWN_STATE_CALLS: dict[str, Callable[[Any, int], StateCall]] = {
    "MiniMaxLightningAttention": lambda module, layer: MiniMaxCall(layer),
    "RecurrentGemmaRecurrentBlock": lambda module, layer: RecurrentGemmaCall(layer, module),
    "RwkvBlock": lambda module, layer: RwkvCall(layer, module.config.hidden_size),
    "xLSTMBlock": lambda module, layer: XlstmCall(
        layer, _xlstm_shapes(module.config), module.config.max_inference_chunksize
    ),
}


def own_state_modules(model: nn.Module) -> dict[int, tuple[nn.Module, StateCall]]:
    """The model's modules of a model-owned recurrence family by layer, with their calls (a module whose
    layer cannot be told is keyed -1, for the probe to refuse)."""
    found: dict[int, tuple[nn.Module, StateCall]] = {}
    for name, module in model.named_modules():
        make = OWN_STATE_CALLS.get(type(module).__name__)
        if make is None or not type(module).__module__.startswith("transformers."):
            continue
        layer = _layer_of(name)
        layer = -1 if layer is None else layer
        found[layer] = (module, make(module, layer))
    return found


def state_calls(model: nn.Module) -> tuple[dict[int, nn.Module], dict[int, StateCall]]:
    """The model's state modules by layer (the cache API's and the model-owned recurrences'), and how
    each runs a piece of a step (a module with no call here cannot be split by request: the probe names
    it)."""
    modules = state_modules(model)
    calls: dict[int, StateCall] = {}
    for layer, module in modules.items():
        name = cache_parameter(module)
        if name is not None:
            calls[layer] = CacheApiCall(name)
    for layer, (module, call) in own_state_modules(model).items():
        modules[layer] = module
        calls[layer] = call
    return modules, calls
