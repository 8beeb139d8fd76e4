"""Which modules the native decoder-layer ops can stand in for, recognised by their code, and when a call
may take the native path (runner/layer_ops/native_layers.py attaches them).

Code equality (the compiled bytecode, its constants and names, through any `__wrapped__` chain) recognises
every family that copies Llama's code (Mistral, Qwen2, Qwen3's q/k norms, Phi-3's norms, SmolLM2, ...) and
Gemma's RMSNorm without a per-family table: `norm_form`, `is_silu_mlp`, `is_pre_norm_layer`, and
`references()`'s `apply_rotary_pos_emb` for a modeling file. `native_call` says whether one call may take the
native op (no autograd, not traced, CPU, a layer dtype, last dimension contiguous).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FunctionType
from typing import Any

import torch
from torch import nn

LAYER_DTYPES = (torch.float32, torch.bfloat16)

Forward = Callable[..., Any]


def same_code(a: CodeType, b: CodeType) -> bool:
    """Whether two code objects compile the same source (positions and file names aside)."""
    if a.co_code != b.co_code or a.co_names != b.co_names or a.co_varnames != b.co_varnames:
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts, strict=True):
        if isinstance(x, CodeType) and isinstance(y, CodeType):
            if not same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def unwrapped(function: object) -> list[object]:
    """`function` and every function it wraps (`__wrapped__`: transformers wraps decoder layers' forwards for
    gradient checkpointing, one wrapper's code for every class)."""
    chain = [function]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 8:
        chain.append(chain[-1].__wrapped__)
    return chain


def same_function(a: object, b: object, docstrings: bool = True) -> bool:
    """Whether `a` and `b` compile the same source, wrappers and wrapped alike; with `docstrings=False`, their
    docstrings aside (a causal LM's forward carries its own family's usage example)."""
    chain_a, chain_b = unwrapped(a), unwrapped(b)
    return len(chain_a) == len(chain_b) and all(
        isinstance(x, FunctionType)
        and isinstance(y, FunctionType)
        and same_code(_code_of(x, docstrings), _code_of(y, docstrings))
        for x, y in zip(chain_a, chain_b, strict=True)
    )


def _code_of(function: FunctionType, docstring: bool) -> CodeType:
    code = function.__code__
    # a function's docstring is its code's first constant (Python 3.11-3.13), never read by its bytecode
    if (
        not docstring
        and code.co_consts
        and isinstance(code.co_consts[0], str)
        and code.co_consts[0] == function.__doc__
    ):
        return code.replace(co_consts=code.co_consts[1:])
    return code


@dataclass(frozen=True)
class References:
    """Transformers' own functions the table recognises others by (imported once, lazily)."""

    llama_norm: Forward
    gemma_norm: Forward
    gemma_norm_inner: Forward
    llama_mlp: Forward
    llama_layer: Forward
    llama_attention: Forward
    llama_rotary: Forward
    llama_rotate_half: Forward
    llama_model: Forward
    llama_causal_lm: Forward


_references: list[References] = []


def references() -> References:
    if not _references:
        from transformers.models.gemma import modeling_gemma
        from transformers.models.llama import modeling_llama

        _references.append(
            References(
                llama_norm=modeling_llama.LlamaRMSNorm.forward,
                gemma_norm=modeling_gemma.GemmaRMSNorm.forward,
                gemma_norm_inner=modeling_gemma.GemmaRMSNorm._norm,
                llama_mlp=modeling_llama.LlamaMLP.forward,
                llama_layer=modeling_llama.LlamaDecoderLayer.forward,
                llama_attention=modeling_llama.LlamaAttention.forward,
                llama_rotary=modeling_llama.apply_rotary_pos_emb,
                llama_rotate_half=modeling_llama.rotate_half,
                llama_model=modeling_llama.LlamaModel.forward,
                llama_causal_lm=modeling_llama.LlamaForCausalLM.forward,
            )
        )
    return _references[0]


# -- which form a module has ------------------------------------------------------------


def norm_form(module: nn.Module, patched: bool = False) -> str | None:
    """ "llama" or "gemma" for an RMSNorm the native op computes exactly as its forward does, else None.
    `patched`: the module's instance forward (if any) is the run's native one, not another."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or ("forward" in module.__dict__ and not patched)
    ):
        return None
    ref = references()
    if same_function(cls.forward, ref.llama_norm) and isinstance(
        getattr(module, "variance_epsilon", None), float
    ):
        return "llama"
    if (
        same_function(cls.forward, ref.gemma_norm)
        and same_function(getattr(cls, "_norm", None), ref.gemma_norm_inner)
        and isinstance(getattr(module, "eps", None), float)
    ):
        return "gemma"
    return None


def norm_eps(module: nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return float(eps if eps is not None else getattr(module, "eps"))  # noqa: B009 - typed as Any


def child(module: nn.Module, name: str) -> nn.Module:
    """A submodule by attribute (`gate_proj`, `post_attention_layernorm`, ...), typed."""
    child = getattr(module, name)
    if not isinstance(child, nn.Module):
        raise TypeError(f"{type(module).__name__}.{name} is not a module")
    return child


def weight_of(module: nn.Module) -> torch.Tensor:
    # read at each call (a weight may be reassigned); a parameter's slot first, which is what `module.weight`
    # finds through `nn.Module.__getattr__`, without that call
    weight = module._parameters.get("weight")
    if weight is None:
        weight = getattr(module, "weight")  # noqa: B009
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight


def linear_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a projection computes in: its weight's, or a Linear kept in GGUF blocks' `compute_dtype`
    (runner/products/quantized_linear.py), which has no float weight."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    dtype = getattr(module, "compute_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"{type(module).__name__} has no weight and no compute dtype")


def is_silu_mlp(module: nn.Module) -> bool:
    """A gated MLP whose forward is Llama's and whose activation is SiLU."""
    from transformers.activations import SiLUActivation

    if "forward" in module.__dict__ or not same_function(type(module).forward, references().llama_mlp):
        return False
    act = getattr(module, "act_fn", None)
    return type(act) in (SiLUActivation, nn.SiLU) and not has_hooks(act)


def is_pre_norm_layer(module: nn.Module) -> bool:
    """A decoder layer whose forward is Llama's (norm, attention, add, norm, MLP, add) with a recognised
    second norm."""
    if "forward" in module.__dict__ or not same_function(type(module).forward, references().llama_layer):
        return False
    norm = getattr(module, "post_attention_layernorm", None)
    return isinstance(norm, nn.Module) and norm_form(norm) is not None


def has_hooks(module: nn.Module | None) -> bool:
    # accelerate sets `_hf_hook` as a plain attribute (the instance dict): `getattr` of a missing name would
    # go through `nn.Module.__getattr__` and an exception, at every layer of every step
    return module is not None and bool(
        module._forward_hooks or module._forward_pre_hooks or module.__dict__.get("_hf_hook") is not None
    )


# -- when the native path applies to a call ----------------------------------------------


def plain_tensor(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def native_call(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether this call may take the native op: no autograd, not traced, CPU, a layer dtype, one dtype,
    last dimension contiguous."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if not x.is_cpu or x.dtype not in LAYER_DTYPES or x.dim() == 0 or x.stride(-1) != 1:
        return False
    return all(
        plain_tensor(o) and o.is_cpu and o.dtype == x.dtype and o.stride(-1) == 1 for o in others
    ) and plain_tensor(x)
