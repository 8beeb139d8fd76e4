"""State layers in the packed step: each request's recurrent state read and written at its own slot.

A hybrid model's state layers (gated delta rule, Mamba, short convolutions) keep their per-request state
through transformers' linear-attention cache API: `get_conv_state`, `get_recurrent_state`,
`update_conv_state`, `update_recurrent_state`, `is_recording_past`, `has_previous_state`. Their forward,
called with the packed step's `[1, T, hidden]`, would run every request's tokens as one sequence; so,
for the run session (`Engine.session`, through `ModelRunner.session`), each state module's forward is
replaced once (an instance attribute, deleted when the last session using it ends) by one that splits
the step by the step's `StateTable`:

- the decode rows (one token of a request that has a state; the packer puts them first) run as one
  batch `[D, 1, hidden]`, their slots' states gathered, updated by the module's own one-token path, and
  scattered back;
- every other row span (a prefill chunk: fresh, or continuing the request's state across a chunk
  boundary) runs as a batch of one with its slot's state.

The module's own code runs unchanged against `SlotStateView` (runner/states/slot_state_view.py), a view of the
slots in transformers' cache API, so each family's arithmetic is transformers' own (the same code `generate()` runs). How one piece
calls its module is the module's `StateCall`: `CacheApiCall` for the cache API's modules here; the
families that keep their recurrence in a cache of their own (MiniMax, RecurrentGemma, RWKV, xLSTM) have
theirs in runner/states/own_state.py, each reading and keeping its states through the same view
(`SlotStateView.read`, `SlotStateView.keep`). Per step, the
runner only sets the step's `StepStates` (its table and the engine's state tensors) in the `step_states`
context variable for the forward's duration; the installed forward reads it, and runs the module as
transformers wrote it when none is set (a probe, a forward that is not a step). Because the installed
forward is bound to no engine, engines sharing a model install it once between them (counted), each
step reading its own engine's tensors from its own context; a step outside a run session (a test
driving the runner directly) installs the forwards for itself.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from ...invariants import InvariantError
from ...memory.state_cache import StateCache
from ...patches import patched
from .slot_state_view import SlotStateView

# The cache API names a state module's forward calls (any of them marks a state module).
STATE_API = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state")
# The parameter a state module takes transformers' cache through.
CACHE_PARAMETERS = ("cache_params", "past_key_values")


@dataclass
class StateTable:
    """Where each request's rows of the packed step are, and its slot.

    `decode_slots`: the slots of rows `[0, len(decode_slots))`, one token each of requests that have a
    state (None when there are none); `spans`: (first row, rows, slot, fresh) of every other request
    (fresh: the request has no state yet, its first chunk)."""

    decode_slots: torch.Tensor | None
    num_decode_rows: int
    spans: list[tuple[int, int, int, bool]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """The step's rows: the decode batch and every span."""
        return self.num_decode_rows + sum(count for _, count, _, _ in self.spans)


@dataclass(frozen=True)
class StepStates:
    """What the split forwards read during one step: its `table`, the engine's state tensors (`cache`)
    and the layers whose continued chunks run one token at a time (`stepwise`, `run_span`)."""

    table: StateTable
    cache: StateCache
    stepwise: frozenset[int] = frozenset()


_step_states: contextvars.ContextVar[StepStates | None] = contextvars.ContextVar("step_states", default=None)


@contextmanager
def step_states(states: StepStates | None) -> Iterator[None]:
    """Make `states` what the forward run inside splits by (None: the modules as transformers wrote them)."""
    token = _step_states.set(states)
    try:
        yield
    finally:
        _step_states.reset(token)


def is_state_module(module: nn.Module) -> bool:
    """Whether `module`'s forward keeps a state through transformers' linear-attention cache API."""
    forward = type(module).__dict__.get("forward")
    if forward is None or not type(module).__module__.startswith("transformers."):
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(name in source for name in STATE_API)


def cache_parameter(module: nn.Module) -> str | None:
    """The name of the forward's cache parameter (`cache_params` or `past_key_values`), None when the
    forward does not take `(hidden_states, <cache>, attention_mask, ...)`."""
    parameters = list(inspect.signature(type(module).forward).parameters)
    if len(parameters) < 4 or parameters[1] != "hidden_states" or parameters[3] != "attention_mask":
        return None
    return parameters[2] if parameters[2] in CACHE_PARAMETERS else None


def state_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The model's state modules by `layer_idx` (a module without one is keyed -1)."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        if is_state_module(module):
            layer_idx = getattr(module, "layer_idx", None)
            found[layer_idx if isinstance(layer_idx, int) else -1] = module
    return found


@dataclass(frozen=True)
class Rows:
    """The rows of the packed step `[1, T, ...]` one call runs: one request's span (`[1, count, ...]`)
    or the decode batch (`decode`: rows `[first, first + count)`, each a request of its own, as
    `[count, 1, ...]`)."""

    first: int
    count: int
    decode: bool = False

    def take(self, packed: torch.Tensor) -> torch.Tensor:
        """These rows of a per-row tensor of the step (hidden states, `position_ids`)."""
        part = packed[:, self.first : self.first + self.count]
        return part.transpose(0, 1) if self.decode else part

    def token(self, i: int) -> Rows:
        """The span's `i`-th token alone."""
        return Rows(self.first + i, 1)


@dataclass(frozen=True)
class StatePiece:
    """One call of a state module on a piece of the step: its forward as it stands (`original`), the
    piece's `rows` and `view` (the slots' states of those rows), and what the model called the module
    with for the whole step (`hidden_states` `[1, T, hidden]`, `args`, `kwargs`: per-row tensors in
    them, such as `position_ids`, are sliced by `rows`)."""

    original: Callable[..., Any]
    view: SlotStateView
    rows: Rows
    hidden_states: torch.Tensor
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def hidden(self) -> torch.Tensor:
        """The piece's hidden states, in `rows.take`'s shape."""
        return self.rows.take(self.hidden_states)

    def at(self, rows: Rows) -> StatePiece:
        """The same call on other rows (a span's single token)."""
        return replace(self, rows=rows)


class StateCall:
    """How a state module's forward runs one `StatePiece` of the step: `run` returns its output hidden
    states `[batch, tokens, hidden]` (`rows.take`'s shape); `packed` gives the whole step's output in the
    module's own return structure."""

    def run(self, piece: StatePiece) -> torch.Tensor:
        raise NotImplementedError

    def packed(self, output: torch.Tensor) -> Any:
        return output

    @property
    def max_step_tokens(self) -> int | None:
        """The most tokens a step may have for the model to call this module on the whole step at once
        (None: no bound; xLSTM splits a longer forward itself)."""
        return None

    def float32_copy(self, module: nn.Module) -> nn.Module:
        """A float32 copy of `module` for the probe's continuation check (model_check/state_probe.py),
        which must tell a rounding from a restart in any dtype."""
        return copy.deepcopy(module).float()


@dataclass(frozen=True)
class CacheApiCall(StateCall):
    """A module of transformers' linear-attention cache API: `(hidden_states, <cache>, attention_mask)`,
    the cache being the view (`name`: `cache_params` or `past_key_values`); it returns one tensor."""

    name: str

    def run(self, piece: StatePiece) -> torch.Tensor:
        return piece.original(piece.hidden(), **{self.name: piece.view, "attention_mask": None})


def run_span(call: StateCall, piece: StatePiece, stepwise: bool) -> torch.Tensor:
    """One request's rows (`piece`) through the module against its view, `[1, n, hidden]`.

    `stepwise`: the module's multi-token path starts from a zero state whatever the cache holds (Mamba's
    and Jamba's full-sequence scan, RecurrentGemma's convolution: transformers' `generate()` never
    continues a state with more than one token), so a continued chunk runs one token at a time through
    its one-token path, which reads and updates the state; a fresh chunk runs whole."""
    rows = piece.rows
    if not stepwise or piece.view.fresh or rows.count == 1:
        return call.run(piece)
    return torch.cat([call.run(piece.at(rows.token(i))) for i in range(rows.count)], dim=1)


def _split_forward(original: Callable[..., Any], call: StateCall, layer: int) -> Callable[..., Any]:
    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        states = _step_states.get()
        if states is None:  # not a step of ours (e.g. the support probe): the module as transformers wrote it
            return original(hidden_states, *args, **kwargs)
        table, cache, stepwise = states.table, states.cache, layer in states.stepwise
        if hidden_states.shape[1] != table.num_rows:
            raise InvariantError(
                f"state layer {layer} was called on {hidden_states.shape[1]} rows of a step of "
                f"{table.num_rows}: the model split the step itself (xLSTM does past its "
                "max_inference_chunksize: lower max_batch_tokens below it)"
            )
        pieces: list[tuple[int, torch.Tensor]] = []
        rows = table.num_decode_rows
        if rows:
            view = SlotStateView(cache, table.decode_slots, fresh=False)  # type: ignore[arg-type]
            out = call.run(
                StatePiece(original, view, Rows(0, rows, decode=True), hidden_states, args, kwargs)
            )
            view.write_back()
            pieces.append((0, out[:, 0]))
        for first, count, slot, fresh in table.spans:
            slots = torch.tensor([slot], dtype=torch.int64, device=hidden_states.device)
            view = SlotStateView(cache, slots, fresh=fresh)
            piece = StatePiece(original, view, Rows(first, count), hidden_states, args, kwargs)
            out = run_span(call, piece, stepwise)
            view.write_back()
            pieces.append((first, out[0]))
        pieces.sort(key=lambda piece: piece[0])
        return call.packed(torch.cat([piece for _, piece in pieces], dim=0).unsqueeze(0))

    return forward


def cache_api_calls(modules: dict[int, nn.Module]) -> dict[int, StateCall]:
    """Each cache-API state module's `CacheApiCall` (its cache parameter read once for all steps)."""
    calls: dict[int, StateCall] = {}
    for layer, module in modules.items():
        name = cache_parameter(module)
        if name is None:
            raise InvariantError(f"{type(module).__name__} cannot be split by request")
        calls[layer] = CacheApiCall(name)
    return calls


@contextmanager
def split_state_layers(
    modules: dict[int, nn.Module], calls: dict[int, StateCall] | None = None
) -> Iterator[None]:
    """Inside: every module of `modules` runs each request's rows at its own slot whenever a step's
    `StepStates` is set (see the module docstring). Installed once however many blocks overlap on a
    module; its forward is restored when the last one ends. `calls`: how each module runs a piece
    (`cache_api_calls(modules)` when not given)."""
    calls = calls if calls is not None else cache_api_calls(modules)
    # Whatever runs as its forward now (a wrapper of accelerate's hooks included) is what each piece calls.
    patches = [
        (
            module,
            "forward",
            partial(lambda m, layer: _split_forward(m.forward, calls[layer], layer), module, layer),
        )
        for layer, module in modules.items()
    ]
    with patched("state_layers", patches):
        yield


class NoStateLayers:
    """The state layers of a model without any: nothing installed for a run session or a step. The runner
    holds one in place of None (`ModelRunner.states`), so that no forward asks whether the model has state
    layers. No state tensors: a slot copy or swap planned for it is an invariant broken (`present`)."""

    cache: StateCache | None = None
    host: StateCache | None = None

    def session(self) -> AbstractContextManager[None]:
        return nullcontext()

    def step(self, table: StateTable | None) -> AbstractContextManager[None]:
        return nullcontext()


@dataclass
class StateLayers:
    """A model's state modules (by layer) and the state tensors they read and write through the slots
    (`host`: the CPU offload tier's copy of swapped-out requests' states, None without offload);
    `stepwise`: the layers whose continued chunks run one token at a time (`run_span`); `calls`: how
    each module runs a piece (the probe's `StateLayout.calls`; the cache API's when not given)."""

    modules: dict[int, nn.Module]
    cache: StateCache
    host: StateCache | None = None
    stepwise: frozenset[int] = frozenset()
    calls: dict[int, StateCall] | None = None
    sessions: int = field(init=False, default=0)  # run sessions in force (`session`)

    def __post_init__(self) -> None:
        if self.calls is None:
            self.calls = cache_api_calls(self.modules)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Inside: the state modules' split forwards, installed once for the run session."""
        with split_state_layers(self.modules, self.calls):
            self.sessions += 1
            try:
                yield
            finally:
                self.sessions -= 1

    @contextmanager
    def step(self, table: StateTable | None) -> Iterator[None]:
        """Inside: a forward of the step whose state table is `table`: only the step's states are set
        (the run session installed the forwards; a step outside one installs them for itself)."""
        states = StepStates(table, self.cache, self.stepwise) if table is not None else None
        with step_states(states), self.session() if not self.sessions else nullcontext():
            yield
