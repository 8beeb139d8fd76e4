"""Per-request rotary frequencies for models whose rotary embedding is dynamic (LongRoPE, dynamic NTK).

transformers' dynamic rotary embeddings (`dynamic_rope_update` in `modeling_rope_utils`) pick their
frequencies from the largest position of the call: in a packed step, that of the whole step, so one
request's length would change another's rotation. For the run, each such module's forward is replaced
(the instance's `forward`, set and restored like runner/states/state_layers.py's) by one that reads the step's
frequency sets (`AttentionMetadata.rope_groups`, built by runner/packing.py from kv/rope_rule.py's
`RopeRule.frequency_key`) and runs the module's own undecorated forward once per set, over that set's
tokens, with the frequencies `generate()` would have for that request alone:

- the original (short) set: the module's `original_inv_freq` and the attention scaling of a fresh
  module;
- LongRoPE's long set: the frequencies transformers computes for `original_max_position_embeddings + 1`
  (as `longrope_frequency_update` does), in the buffer's dtype;
- dynamic NTK's set for length L: the frequencies and scaling transformers computes for L (a tensor, as
  `dynamic_frequency_update` passes it), as a fresh model's `generate()` grows to them.

The module's own state (`inv_freq`, `max_seq_len_cached`, ...) is never read or written by a step:
outside a step (no rope groups: the support check's probe, a `generate()` call) the module's previous
forward runs unchanged. Models whose rope parameters are per layer type are not covered (`layer_type`
calls fall through to the previous forward).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..attention.metadata import STEP_METADATA
from ..invariants import InvariantError
from ..kv.rope_rule import LONGROPE, RopeRule
from ..patches import patched

# Dynamic NTK's frequency sets kept per module (one per effective length seen), at most this many.
MAX_CACHED_SETS = 4096


def dynamic_rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The model's rotary embedding modules whose forward transformers decorates with
    `dynamic_rope_update` and whose one rope type is LongRoPE or dynamic NTK."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        forward = getattr(type(module), "forward", None)
        if not isinstance(rope_type, str) or getattr(forward, "__wrapped__", None) is None:
            continue
        if not hasattr(module, "original_inv_freq") or not hasattr(module, "config"):
            continue
        if rope_type == LONGROPE or "dynamic" in rope_type:
            found.append(module)
    return found


class _Frequencies:
    """The module as its undecorated forward reads it, with one frequency set's `inv_freq` and
    `attention_scaling` instead of the module's own."""

    def __init__(self, module: nn.Module, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        self._module = module
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _ModuleSets:
    """One module's frequency sets by `RopeRule.frequency_key`, computed on first use."""

    def __init__(self, module: nn.Module, rule: RopeRule) -> None:
        self.module = module
        self.rule = rule
        self.init_fn: Callable[..., tuple[torch.Tensor, float]] = ROPE_INIT_FUNCTIONS[str(module.rope_type)]
        self.sets: dict[int, _Frequencies] = {}

    def get(self, key: int, device: torch.device) -> _Frequencies:
        found = self.sets.get(key)
        if found is not None and found.inv_freq.device == device:
            return found
        module: Any = self.module
        config = module.config
        original: torch.Tensor = module.original_inv_freq.to(device)
        if key == 0:
            # A fresh module's: its original frequencies and the scaling computed at its init.
            _, scaling = self.init_fn(config, device)
            inv_freq = original
        elif self.rule.kind == LONGROPE:
            long_inv_freq, _ = self.init_fn(config, device, seq_len=self.rule.threshold + 1)
            # transformers copies the long set into the `inv_freq` buffer (its dtype); the scaling is the
            # module's, fixed at init.
            inv_freq = long_inv_freq.to(device=device, dtype=module.inv_freq.dtype)
            scaling = module.attention_scaling
        else:
            seq_len = torch.tensor(key, dtype=torch.int64, device=device)
            inv_freq, scaling = self.init_fn(config, device, seq_len=seq_len)
        if len(self.sets) >= MAX_CACHED_SETS:
            self.sets.clear()
        frequencies = _Frequencies(module, inv_freq, scaling)
        self.sets[key] = frequencies
        return frequencies


def _per_request_forward(
    previous: Callable[..., Any], raw: Callable[..., Any], sets: _ModuleSets
) -> Callable[..., Any]:
    @torch.compiler.disable
    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None) -> Any:
        metadata = STEP_METADATA.get()
        groups = getattr(metadata, "rope_groups", None)
        if groups is None or layer_type is not None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
            return previous(x, position_ids) if layer_type is None else previous(x, position_ids, layer_type)
        with torch.no_grad():
            if len(groups) == 1 and groups[0][1] is None:
                return raw(sets.get(groups[0][0], x.device), x, position_ids)
            cos_all: torch.Tensor | None = None
            sin_all: torch.Tensor | None = None
            for key, rows in groups:
                cos, sin = raw(sets.get(key, x.device), x, position_ids.index_select(1, rows))
                # The tokens are the second-to-last dimension of cos / sin (`[batch, tokens, dim]`).
                token_dim = cos.dim() - 2
                if token_dim < 0 or cos.shape[token_dim] != rows.numel():
                    raise InvariantError(
                        f"a rotary embedding returned cos of shape {tuple(cos.shape)} for {rows.numel()} positions"
                    )
                if cos_all is None or sin_all is None:
                    shape = list(cos.shape)
                    shape[token_dim] = position_ids.shape[1]
                    cos_all = cos.new_empty(shape)
                    sin_all = sin.new_empty(shape)
                cos_all.index_copy_(token_dim, rows, cos)
                sin_all.index_copy_(token_dim, rows, sin)
            return cos_all, sin_all

    return forward


@contextmanager
def per_request_rotary(modules: list[nn.Module], rule: RopeRule) -> Iterator[None]:
    """Inside: each module of `modules` gives each token of a step the frequencies of its request's
    set (see the module docstring). Installed once however many runs overlap on a module; its forward
    is restored when the last one ends."""
    patches = [
        (
            module,
            "forward",
            partial(
                lambda m: _per_request_forward(
                    m.forward, inspect.unwrap(type(m).forward), _ModuleSets(m, rule)
                ),
                module,
            ),
        )
        for module in modules
    ]
    with patched("request_rotary", patches):
        yield


class NoRotary:
    """The per-request rotary of a model without a dynamic rotary embedding: nothing installed for a run
    session or a step. The runner holds one in place of None (`ModelRunner.rotary`)."""

    def session(self) -> AbstractContextManager[None]:
        return nullcontext()

    def step(self) -> AbstractContextManager[None]:
        return nullcontext()


@dataclass
class RequestRotary:
    """A model's dynamic rotary modules and their rule, installed for a run session (`session`) or, for a
    step outside one, for that step (`step`)."""

    modules: list[nn.Module]
    rule: RopeRule
    sessions: int = 0

    @classmethod
    def of(cls, model: nn.Module, rule: RopeRule | None) -> RequestRotary | None:
        if rule is None:
            return None
        modules = dynamic_rotary_modules(model)
        return cls(modules, rule) if modules else None

    @contextmanager
    def session(self) -> Iterator[None]:
        with per_request_rotary(self.modules, self.rule):
            self.sessions += 1
            try:
                yield
            finally:
                self.sessions -= 1

    @contextmanager
    def step(self) -> Iterator[None]:
        if self.sessions:
            yield
            return
        with self.session():
            yield
