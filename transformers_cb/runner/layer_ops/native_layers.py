"""Native decoder-layer ops for the run: RMSNorm, the residual add folded into the next norm, SiLU·mul and
rotary, each one call of the native library (attention/native/native_layer_source.py) instead of transformers'
chain of eager ops.

`native_layers(model, enabled)` is entered by `Engine.session()` beside the packed products. Inside, the
modules whose class the table below recognises get an instance `forward` (the packed products' way: no
module replaced, deleted on exit) and the modeling files whose `apply_rotary_pos_emb` is Llama's get the
native one in their globals, for the run only:

| what | recognised by | replaced by |
|---|---|---|
| RMSNorm, Llama's form (`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`) | `forward`'s code equal to `LlamaRMSNorm.forward`'s | `rms_norm` |
| RMSNorm, Gemma's form (`(x * rsqrt(...)) * (1 + weight)` in float32) | `forward` and `_norm` equal to `GemmaRMSNorm`'s | `rms_norm(gemma=True)` |
| a gated MLP with SiLU (`down(silu(gate(x)) * up(x))`) | `forward` equal to `LlamaMLP.forward`, `act_fn` SiLU | `silu_mul` between the products |
| a pre-norm decoder layer (`LlamaDecoderLayer`'s forward) | `forward` equal to it, its second norm recognised | the residual add and that norm as one `add_rms_norm` |
| `apply_rotary_pos_emb` of a modeling file | code equal to Llama's (and its `rotate_half`) | `rotary` for q and k |

Code equality (the compiled bytecode, its constants and names) recognises every family that copies
Llama's code (Mistral, Qwen2, Qwen3's q/k norms, SmolLM2's Llama, ...) without naming them; anything
else keeps transformers' forward. Each op rounds where the module rounds, and each recognised class is
checked bitwise against its own forward on a random input the first time it is seen per dtype: a class
that differs (another torch's reduction order, say) keeps its forward, with one warning. Each replaced
forward still takes the module's own path where the native one does not apply: autograd recording, a
compiled forward, another device or dtype, a hook on a module the fused call would skip.

Installs are counted per module (and per modeling file for rotary): two sessions on one model (two
managers) share them, and the last to leave restores. `TRANSFORMERS_CB_NATIVE_LAYERS=0` turns them off;
without the native library (not built, no compiler) nothing is replaced.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ...attention.native.kernel import native_module
from ...patches import in_force, patched
from ...patches import restore_all as restore_kind
from .direct_layer import direct_step
from .layer_checks import VERDICTS, norm_agrees, rotary_agrees, silu_agrees
from .layer_forms import (
    LAYER_DTYPES,
    Forward,
    child,
    has_hooks,
    is_pre_norm_layer,
    is_silu_mlp,
    linear_dtype,
    native_call,
    norm_eps,
    norm_form,
    plain_tensor,
    references,
    same_function,
    weight_of,
)
from .layer_plan import LayerParts, layer_parts

ENV_SWITCH = "TRANSFORMERS_CB_NATIVE_LAYERS"
DIRECT_SWITCH = "TRANSFORMERS_CB_DIRECT_LAYERS"
# -- the replaced forwards --------------------------------------------------------------


def _norm_forward(module: nn.Module, ops: ModuleType, gemma: bool) -> Forward:
    original = type(module).forward.__get__(module)
    eps = norm_eps(module)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = weight_of(module)
        if not native_call(hidden_states, weight) or not weight.is_contiguous():
            return original(hidden_states)
        out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype)
        ops.rms_norm(hidden_states, weight, eps, gemma, out)
        return out

    return forward


def _mlp_forward(module: nn.Module, ops: ModuleType) -> Forward:
    original = type(module).forward.__get__(module)
    act_fn = child(module, "act_fn")

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not native_call(x):
            return original(x)
        # Read at each call: an adapter loaded during the run (manager.adapters.load) wraps a projection
        # in a PEFT layer, which must be the one called (the plain Linear seen at install lost its delta).
        gate_proj, up_proj, down_proj = (
            child(module, name) for name in ("gate_proj", "up_proj", "down_proj")
        )
        gate = gate_proj(x)  # gate before up, as the module calls them (a fused pair computes on the first)
        up = up_proj(x)
        if not native_call(gate, up) or gate.shape != up.shape:
            return down_proj(act_fn(gate) * up)
        hidden = torch.empty(gate.shape, dtype=gate.dtype)
        ops.silu_mul(gate, up, hidden)
        return down_proj(hidden)

    return forward


def _layer_forward(layer: nn.Module, ops: ModuleType) -> Forward:
    original = type(layer).forward.__get__(layer)
    input_norm, attention, norm, mlp = (
        child(layer, name) for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    )
    gemma = norm_form(norm) == "gemma"
    eps = norm_eps(norm)
    # The layer's parts for `direct_step`, decided at the first call (every patch of the run is in force by then).
    parts: list[LayerParts | None] = []

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not native_call(hidden_states, weight_of(norm)) or has_hooks(norm):
            return original(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        if not parts:
            parts.append(layer_parts(layer, KIND) if enabled_direct() else None)
        if parts[0] is not None:
            out = direct_step(parts[0], ops, hidden_states, position_embeddings, kwargs)
            if out is not None:
                return out
        residual = hidden_states
        hidden_states = input_norm(hidden_states)
        hidden_states, _ = attention(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if not native_call(hidden_states, residual) or hidden_states.shape != residual.shape:
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = norm(hidden_states)
        else:
            summed = torch.empty(residual.shape, dtype=residual.dtype)
            normed = torch.empty(residual.shape, dtype=residual.dtype)
            ops.add_rms_norm(residual, hidden_states, weight_of(norm), eps, gemma, summed, normed)
            residual, hidden_states = summed, normed
        hidden_states = mlp(hidden_states)
        return residual + hidden_states

    return forward


def _rotary(ops: ModuleType, original: Forward) -> Forward:
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            unsqueeze_dim != 1
            or q.dim() != 4
            or k.dim() != 4
            or cos.dim() != 3
            or sin.dim() != 3
            or not native_call(q, k, cos, sin)
            or cos.shape != sin.shape
            or cos.shape[1:] != (q.shape[2], q.shape[3])
            or k.shape[2:] != q.shape[2:]
            or cos.shape[0] not in (1, q.shape[0])
            or k.shape[0] != q.shape[0]
        ):
            return original(q, k, cos, sin, unsqueeze_dim)
        batch, seq, dim = q.shape[0], q.shape[2], q.shape[3]
        cos = cos.expand(batch, seq, dim)
        sin = sin.expand(batch, seq, dim)
        # torch's `q * cos` keeps q's layout: tokens outer, heads inner (the projections' own order)
        q_out = torch.empty(batch, seq, q.shape[1], dim, dtype=q.dtype).transpose(1, 2)
        k_out = torch.empty(batch, seq, k.shape[1], dim, dtype=k.dtype).transpose(1, 2)
        ops.rotary(q, cos, sin, q_out)
        ops.rotary(k, cos, sin, k_out)
        return q_out, k_out

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


# -- installs, counted ------------------------------------------------------------------


KIND = "native_layers"
# Replacements are listed and taken under it: a listing's "in force" answer holds until its patches are taken.
_lock = threading.Lock()


def _never() -> Any:
    raise AssertionError("a patch in force is counted, never made again")


def restore_native_layers() -> None:
    """Every native layer op still in force undone (`uninstall()`); a run still going finishes on the
    modules' own forwards."""
    restore_kind(KIND)


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def enabled_direct() -> bool:
    """Whether recognised layers take `direct_step` (`TRANSFORMERS_CB_DIRECT_LAYERS=0`: their modules' forwards)."""
    return os.environ.get(DIRECT_SWITCH, "1") != "0"


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _modeling_file(module: nn.Module) -> ModuleType | None:
    return sys.modules.get(type(module).__module__)


def _module_replacement(module: nn.Module, ops: ModuleType) -> Callable[[], Forward] | None:
    """The maker of `module`'s native forward, if the table recognises it and its check passes."""
    params = list(module.parameters(recurse=False))
    if any(not plain_tensor(p) or p.device.type != "cpu" for p in params):
        return None
    form = norm_form(module)
    if form is not None:
        dtype = weight_of(module).dtype
        if dtype in LAYER_DTYPES and VERDICTS.check(
            "RMSNorm", _name(type(module)), dtype, partial(norm_agrees, module, ops, dtype)
        ):
            return partial(_norm_forward, module, ops, form == "gemma")
        return None
    if is_silu_mlp(module):
        dtype = linear_dtype(child(module, "gate_proj"))
        if dtype in LAYER_DTYPES and VERDICTS.check(
            "SiLU·mul", _name(type(module)), dtype, partial(silu_agrees, module, ops, dtype)
        ):
            return partial(_mlp_forward, module, ops)
        return None
    if is_pre_norm_layer(module):
        norm = child(module, "post_attention_layernorm")
        dtype = weight_of(norm).dtype
        if dtype in LAYER_DTYPES and VERDICTS.check(
            "RMSNorm", _name(type(norm)), dtype, partial(norm_agrees, norm, ops, dtype)
        ):
            return partial(_layer_forward, module, ops)
    return None


def _rotary_replacement(file: ModuleType, ops: ModuleType) -> Callable[[], Forward] | None:
    """The maker of a modeling file's native `apply_rotary_pos_emb`, if it is Llama's and its check passes."""
    ref = references()
    rotary = getattr(file, "apply_rotary_pos_emb", None)
    if (
        rotary is None
        or not same_function(rotary, ref.llama_rotary)
        or not same_function(getattr(file, "rotate_half", None), ref.llama_rotate_half)
    ):
        return None
    checks = (
        VERDICTS.check("rotary", file.__name__, dtype, partial(rotary_agrees, rotary, ops, dtype))
        for dtype in LAYER_DTYPES
    )
    return partial(_rotary, ops, rotary) if all(checks) else None


Replacements = list[tuple[Any, str, Callable[[], Any]]]


def _replacements(model: nn.Module, ops: ModuleType) -> Replacements:
    """What this model's run replaces: (owner, attribute, maker of the replacement)."""
    replacements: Replacements = []
    files: dict[int, ModuleType] = {}
    for module in model.modules():
        file = _modeling_file(module)
        if file is not None:
            files.setdefault(id(file), file)
        if in_force(KIND, module, "forward"):  # another session's: counted again, not recognised again
            replacements.append((module, "forward", _never))
        elif not has_hooks(module):
            make = _module_replacement(module, ops)
            if make is not None:
                replacements.append((module, "forward", make))
    for file in files.values():
        if in_force(KIND, file, "apply_rotary_pos_emb"):
            replacements.append((file, "apply_rotary_pos_emb", _never))
        else:
            make_rotary = _rotary_replacement(file, ops)
            if make_rotary is not None:
                replacements.append((file, "apply_rotary_pos_emb", make_rotary))
    return replacements


@contextmanager
def native_layers(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Inside (with `enabled`, the switch on and the native library loaded): the recognised modules of
    `model` and the rotary of their modeling files on the native ops. Yields how many were replaced."""
    ops = native_module() if enabled and enabled_by_env() else None
    if ops is None or not hasattr(ops, "rms_norm"):
        yield 0
        return
    with ExitStack() as stack:
        with _lock, torch.no_grad():
            count = stack.enter_context(patched(KIND, _replacements(model, ops)))
        try:
            yield count
        finally:
            with _lock:
                stack.close()
