"""Paged attention backends, keyed by the `attn_implementation` names they register.

One registry for every backend: `paged|sdpa`, `paged|eager` (pure torch, any device) and the paged
flash-attention names (`attention/backends/flash.py`; their kernels are imported only when used).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backends.eager import eager_paged_attention_forward
from .backends.flash import make_flash_forward
from .backends.flash_kernels import flash_backend_names, is_flash_backend
from .backends.sdpa import sdpa_paged_attention_forward


def _compile_boundary(forward: Callable) -> Callable:
    """Keep a flash backend's paged attention out of `torch.compile` graphs: its Python control flow follows
    each step's layout, which would recompile every step; the rest of the model compiles around it. The
    torch backends need no boundary: their native-only steps are one custom op per layer, and the rest of
    their work is a boundary of its own (`mixed_paged.mixed_paged_attention`)."""
    wrapped = torch.compiler.disable(forward)
    wrapped.__name__ = wrapped.__qualname__ = forward.__name__
    return wrapped


PAGED_BACKENDS: dict[str, Callable] = {
    "paged|sdpa": sdpa_paged_attention_forward,
    "paged|eager": eager_paged_attention_forward,
    **{name: _compile_boundary(make_flash_forward(name)) for name in flash_backend_names()},
}

# The plain implementation each paged backend stands in for (validated by transformers when a model is set
# to the paged name; flash names are validated by `selection.check_flash_backend` instead).
PLAIN_COUNTERPART = {"paged|sdpa": "sdpa", "paged|eager": "eager"}


def mask_counterpart(name: str) -> str:
    """Whose mask builder a paged backend reuses: outside continuous batching flash names run SDPA."""
    return PLAIN_COUNTERPART.get(name, "sdpa")


def register_flash_name(name: str) -> Callable:
    """Add a `paged|kernels-community/flash-attn*` name not registered up front (idempotent)."""
    if name not in PAGED_BACKENDS:
        if not is_flash_backend(name):
            raise ValueError(f"{name!r} is not a paged flash-attention backend name")
        PAGED_BACKENDS[name] = _compile_boundary(make_flash_forward(name))
    return PAGED_BACKENDS[name]


__all__ = ["PAGED_BACKENDS", "PLAIN_COUNTERPART", "mask_counterpart", "register_flash_name"]
