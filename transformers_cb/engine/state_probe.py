"""The state layers of a model, learned before anything is allocated: which modules keep a state, and
the shape and dtype of each state (`StateLayout`), or why they cannot run (a refusal).

transformers' layer types say which layers keep a state (`kv/layer_groups.py`: `linear_attention`,
`conv`, `hybrid`); the modules that keep it are those whose forward calls transformers'
linear-attention cache API (`runner/state_layers.py`). Each is run once on three tokens against a
recorder of that API (its own code, batch one, as `generate()`'s first step), which gives the state
tensors the slots must hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..kv.layer_groups import state_layer_indices
from ..memory.state_cache import StateSpec, state_bytes_per_slot
from ..runner.state_layers import StateRecorder, cache_parameter, run_with_recorder, state_modules

PROBE_TOKENS = 3


@dataclass(frozen=True)
class StateLayout:
    """The state modules by layer and every state tensor's per-request shape (`StateSpec`)."""

    modules: dict[int, nn.Module]
    specs: tuple[StateSpec, ...]

    @property
    def bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.specs)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.modules))


def state_problems(model: nn.Module, config: Any) -> tuple[StateLayout | None, list[str]]:
    """The model's `StateLayout` (None: no state layers) and what keeps them from running (empty: nothing)."""
    typed = state_layer_indices(config)
    modules = state_modules(model)
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
        if cache_parameter(module) is None:
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
                run_with_recorder(module, hidden, recorder)
        except Exception as error:  # noqa: BLE001  (any failure of the module's own forward is the reason)
            return None, [
                f"its state layer {layer} ({type(module).__name__}) fails alone: {type(error).__name__}: {error}"
            ]
        if not recorder.specs:
            return None, [
                f"its state layer {layer} ({type(module).__name__}) stores no state through the cache API"
            ]
        specs.extend(recorder.specs[key] for key in sorted(recorder.specs))
    return StateLayout(modules, tuple(specs)), []
