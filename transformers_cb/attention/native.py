"""The native CPU paged-attention kernel: built once on first use, optional, never required.

`torch.utils.cpp_extension.load_inline` compiles `native_source.SOURCE` with the system C++
compiler (cached under torch's extension directory, keyed by a hash of the source and flags, so
later processes only load it). When anything about the build fails (no compiler, no ninja, a
read-only cache directory) the reason is logged once and the Python kernels run instead: the
package works the same without it, only slower on CPU.

`TRANSFORMERS_CB_NATIVE_KERNEL=0` turns it off (the pure-torch paths then run every step).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from types import ModuleType

import torch

from .native_source import SOURCE

logger = logging.getLogger(__name__)

ENV_SWITCH = "TRANSFORMERS_CB_NATIVE_KERNEL"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def _build() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load_inline

        digest = hashlib.sha256((SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:12]
        return load_inline(
            name=f"transformers_cb_paged_{digest}",
            cpp_sources=[SOURCE],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # any build or load failure: fall back, say why once
        logger.warning(
            "transformers_cb: native CPU paged-attention kernel unavailable (%s: %s); using the "
            "pure-torch kernels (slower on CPU). Set %s=0 to skip the build.",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
            ENV_SWITCH,
        )
        return None


def native_module() -> ModuleType | None:
    """The built extension, or None when it is switched off or cannot be built (tried once per process)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps on `device` with a KV cache of `dtype` can use the native kernel."""
    return device.type == "cpu" and dtype == torch.float32 and native_module() is not None


def native_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_row: torch.Tensor,
    token_pos: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Write into `out` `[T, H, D]` the attention of `query` `[T, H, D]` over the paged cache.

    Token t is at logical position `token_pos[t]` of block-table row `token_row[t]` (int64) and sees
    that row's keys up to itself, from `token_pos[t] - window + 1` when `window` is set;
    `block_table` `[N, P]` int32 maps logical page p of a row to its page id."""
    module = native_module()
    if module is None:
        raise RuntimeError("the native paged-attention kernel is not available")
    module.paged_attention(
        query,
        key_cache,
        value_cache,
        token_row,
        token_pos,
        block_table,
        page_size,
        scale,
        window or 0,
        softcap or 0.0,
        sinks,
        out,
    )
