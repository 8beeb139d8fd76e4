"""The state layers of a model, learned before anything is allocated: which modules keep a state, and
the shape and dtype of each state (`StateLayout`), or why they cannot run (a refusal).

transformers' layer types say which layers keep a state (`kv/layer_groups.py`: `linear_attention`,
`conv`, `hybrid`); the modules that keep it are those whose forward calls transformers'
linear-attention cache API (`runner/states/state_layers.py`), and the model-owned recurrences with an adapter
(`runner/states/own_state.py`: MiniMax, RecurrentGemma, RWKV, xLSTM). Each is run once on three tokens against a
recorder of that API (its own code, batch one, as `generate()`'s first step), which gives the state
tensors the slots must hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ..invariants import InvariantError
from ..kv.layer_groups import state_layer_indices
from ..memory.state_cache import StateCache, StateSpec, state_bytes_per_slot
from ..runner.states.own_state import state_calls
from ..runner.states.slot_state_view import SlotStateView, StateRecorder
from ..runner.states.state_layers import Rows, StateCall, StateLayers, StatePiece, StateTable, run_span

PROBE_TOKENS = 3
# The continuation check (`stepwise_layers`): a chunk that continues a state must give the module's
# output on the whole sequence within this (relative; float32: a sound continuation is ~1e-6 off, one
# that restarts from a zero state 3e-3 or more).
CONTINUATION_TOLERANCE = 5e-4


@dataclass(frozen=True)
class StateLayout:
    """The state modules by layer and every state tensor's per-request shape (`StateSpec`)."""

    modules: dict[int, nn.Module]
    specs: tuple[StateSpec, ...]
    # Layers whose continued prefill chunks run one token at a time (runner/states/state_layers.py `run_span`).
    stepwise: frozenset[int] = frozenset()
    # How each module runs one piece of a step (runner/states/state_layers.py `StateCall`); None: the cache API's.
    calls: dict[int, StateCall] | None = None

    @property
    def max_step_tokens(self) -> int | None:
        """The most tokens a step may have (`StateCall.max_step_tokens`; None: no bound)."""
        bounds = [c.max_step_tokens for c in (self.calls or {}).values() if c.max_step_tokens is not None]
        return min(bounds) if bounds else None

    @property
    def bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.specs)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.modules))


def probe_kwargs(num_tokens: int, device: torch.device) -> dict[str, object]:
    """What a state module is called with beside its hidden states when it runs alone (the probe): one
    request's positions `0..num_tokens-1`."""
    return {"position_ids": torch.arange(num_tokens, device=device).unsqueeze(0)}


def run_with_recorder(
    module: nn.Module, call: StateCall, hidden: torch.Tensor, recorder: StateRecorder
) -> None:
    """Run `module`'s own forward once on `hidden` `[1, tokens, hidden]` against `recorder`."""
    rows = Rows(0, hidden.shape[1])
    out = call.run(
        StatePiece(module.forward, recorder, rows, hidden, (), probe_kwargs(hidden.shape[1], hidden.device))
    )
    if not isinstance(out, torch.Tensor) or out.shape[:2] != hidden.shape[:2]:
        raise InvariantError(
            f"{type(module).__name__} returns {type(out).__name__} {getattr(out, 'shape', '')}, not one "
            f"tensor of its input's {tuple(hidden.shape[:2])} rows"
        )


def continuation_gap(
    module: nn.Module, call: StateCall, specs: tuple[StateSpec, ...], hidden: torch.Tensor, stepwise: bool
) -> float:
    """How far `module`'s output on `hidden` `[1, n, hidden]` split in two (a fresh first half, then a
    second half continuing its state through a slot, `run_span` with `stepwise`) is from its output on
    the whole at once: the largest difference over the largest magnitude (0: the same)."""
    tokens = hidden.shape[1]
    kwargs = probe_kwargs(tokens, hidden.device)
    slots = torch.zeros(1, dtype=torch.int64, device=hidden.device)
    whole_view = SlotStateView(StateCache(specs, 1, hidden.device), slots, True)
    whole = call.run(StatePiece(module.forward, whole_view, Rows(0, tokens), hidden, (), kwargs))
    cache = StateCache(specs, 1, hidden.device)
    half = tokens // 2
    first_view = SlotStateView(cache, slots, fresh=True)
    first = run_span(
        call, StatePiece(module.forward, first_view, Rows(0, half), hidden, (), kwargs), stepwise
    )
    first_view.write_back()
    second_view = SlotStateView(cache, slots, fresh=False)
    second_piece = StatePiece(module.forward, second_view, Rows(half, tokens - half), hidden, (), kwargs)
    second = run_span(call, second_piece, stepwise)
    split = torch.cat([first, second], dim=1).float()
    whole = whole.float()
    return float((split - whole).abs().max()) / max(float(whole.abs().max()), 1e-6)


def state_problems(model: nn.Module, config: PretrainedConfig) -> tuple[StateLayout | None, list[str]]:
    """The model's `StateLayout` (None: no state layers) and what keeps them from running (empty: nothing)."""
    typed = state_layer_indices(config)
    modules, calls = state_calls(model)
    if not typed and not modules:
        return None, []
    problems = []
    if -1 in modules:
        problems.append(f"its state module {type(modules[-1]).__name__} has no `layer_idx`")
    untyped = sorted(set(modules) - set(typed) - {-1})
    if untyped:
        problems.append(f"layers {untyped} keep a state although their layer type says they do not")
    unkept = sorted(set(typed) - set(modules))
    if unkept:
        problems.append(
            f"layers {unkept} are state layers whose modules do not keep their state through transformers' "
            "linear-attention cache API (get_conv_state / update_recurrent_state ...)"
        )
    for layer, module in sorted(modules.items()):
        if layer not in calls:
            problems.append(
                f"{type(module).__name__} (layer {layer}) does not take (hidden_states, cache, attention_mask)"
            )
            break
    if problems:
        return None, problems
    specs: list[StateSpec] = []
    hidden_size = config.get_text_config().hidden_size
    first = next(model.parameters())
    generator = torch.Generator(device="cpu").manual_seed(0)
    for layer, module in sorted(modules.items()):
        hidden = torch.randn(1, PROBE_TOKENS, hidden_size, generator=generator).to(first.device, first.dtype)
        recorder = StateRecorder()
        try:
            with torch.inference_mode():
                run_with_recorder(module, calls[layer], hidden, recorder)
        except Exception as error:  # noqa: BLE001  (any failure of the module's own forward is the reason)
            return None, [
                f"its state layer {layer} ({type(module).__name__}) fails alone: {type(error).__name__}: {error}"
            ]
        if not recorder.specs:
            return None, [
                f"its state layer {layer} ({type(module).__name__}) stores no state through the cache API"
            ]
        specs.extend(recorder.specs[key] for key in sorted(recorder.specs))
    stepwise, problems = stepwise_layers(modules, calls, tuple(specs), hidden_size, generator)
    if problems:
        return None, problems
    return StateLayout(modules, tuple(specs), stepwise, calls), []


def stepwise_layers(
    modules: dict[int, nn.Module],
    calls: dict[int, StateCall],
    specs: tuple[StateSpec, ...],
    hidden_size: int,
    generator: torch.Generator,
) -> tuple[frozenset[int], list[str]]:
    """The layers whose multi-token path ignores the state it is given (continued chunks then run one
    token at a time), and the layers that continue no state either way (problems).

    Chunked prefill continues a request's state with many tokens at once, which `generate()` never does:
    some families' full-sequence scan (Mamba, Falcon-Mamba, Jamba) starts from a zero state whatever the
    cache holds. Each module is checked on 2 x PROBE_TOKENS tokens, split in two halves against run
    whole, in float32 (a copy of the module: the check must tell a rounding from a restart in any dtype).
    """
    stepwise: set[int] = set()
    for layer, module in sorted(modules.items()):
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        exact = calls[layer].float32_copy(module)
        exact_specs = tuple(
            dataclasses.replace(spec, dtype=torch.float32) if spec.dtype.is_floating_point else spec
            for spec in specs
            if spec.layer_idx == layer
        )
        hidden = torch.randn(1, 2 * PROBE_TOKENS, hidden_size, generator=generator).to(device)
        try:
            with torch.inference_mode():
                if (
                    continuation_gap(exact, calls[layer], exact_specs, hidden, stepwise=False)
                    <= CONTINUATION_TOLERANCE
                ):
                    continue
                if (
                    continuation_gap(exact, calls[layer], exact_specs, hidden, stepwise=True)
                    <= CONTINUATION_TOLERANCE
                ):
                    stepwise.add(layer)
                    continue
        except Exception as error:  # noqa: BLE001  (any failure of the module's own forward is the reason)
            return frozenset(), [
                f"its state layer {layer} ({type(module).__name__}) fails to continue a state: "
                f"{type(error).__name__}: {error}"
            ]
        return frozenset(), [
            f"its state layer {layer} ({type(module).__name__}) does not continue a request's state across "
            "prefill chunks (split in two, its output differs from the whole sequence's)"
        ]
    return frozenset(stepwise), []


@contextmanager
def probe_states(layout: StateLayout | None, num_tokens: int, device: torch.device) -> Iterator[None]:
    """Inside: a forward on one fresh request of `num_tokens` tokens runs its state layers as a step
    does (split by request, each at a scratch slot of its own), so that the attention probe sees the
    model as the engine runs it (a state module then gets no attention mask, e.g. Mamba's, which would
    multiply its hidden states by the probe's 4D no-mask). Nothing inside when `layout` is None."""
    if layout is None:
        yield
        return
    layers = StateLayers(
        layout.modules, StateCache(layout.specs, 1, device), stepwise=layout.stepwise, calls=layout.calls
    )
    with layers.step(StateTable(None, 0, [(0, num_tokens, 0, True)])):
        yield
