"""A CPU test double of flash-attn's Python API, computed by our pure-torch reference kernel.

Same module names, function names, keyword arguments and tensor shapes as the real packages
(Dao-AILab/flash-attention at 2.8.4 / 3.0.0: `flash_attn/flash_attn_interface.py` and
`hopper/flash_attn_interface.py`), so the paged flash glue can be tested without a GPU:

- `flash_attn` (flash-attn 2): `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
  return_attn_probs, block_table)` and `flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos,
  rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
  window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)`;
- `flash_attn_interface` (flash-attn 3): `flash_attn_varlen_func` without a page table (with
  `seqused_q` / `seqused_k`), and `flash_attn_with_kvcache(..., page_table, cu_seqlens_q, cu_seqlens_k_new,
  max_seqlen_q, ...)` whose packed-query form is how a mixed step reads a paged cache on flash-attn 3.

The checks the real kernels make on what the glue passes are made here too (int32 index tensors,
contiguous last dims, paged block size a multiple of 256 on flash-attn 2, a block table wide enough for
`max_seqlen_k`, head dim a multiple of 8); dtype is relaxed (the real kernels take fp16/bf16 only,
CPU tests run fp32). Features the glue never uses (dropout, alibi, rotary, cache_batch_idx, leftpad,
non-causal, a right window) raise instead of being ignored. Every call is recorded in `CALLS`.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch

from transformers_cb.attention.reference import reference_paged_attention

CALLS: list[tuple[str, dict]] = []  # (module.function, the arguments that matter to the glue)


def _capturing() -> bool:
    """Inside a CUDA graph capture: no host syncs (checks, the reference kernel's loop) are allowed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check(condition, message: str) -> None:
    if _capturing():
        return
    if not (condition() if callable(condition) else condition):
        raise RuntimeError(message)  # flash-attn raises RuntimeError from TORCH_CHECK


def _index_tensor(name: str, tensor: torch.Tensor | None) -> None:
    if tensor is not None:
        _check(tensor.dtype == torch.int32, f"{name} must have dtype int32")
        _check(tensor.stride(-1) == 1, f"{name} must have contiguous last dimension")


def _window(window_size: tuple[int, int], causal: bool) -> int | None:
    _check(causal, "the test double implements causal attention only")
    left, right = window_size
    _check(right in (-1, 0), "the test double implements no right window")
    return None if left < 0 else left + 1  # keys (p - (left + 1), p]: left + 1 tokens including p


def _dense_paged_attention(q, key_cache, value_cache, cu_seqlens_q, seqlens_k, table, page_size, scale,
                           window, softcap):  # fmt: skip
    """The same attention with static shapes and no host sync (what a CUDA graph can capture): every
    token reads its row's whole block table and masks. Tokens past `cu_seqlens_q[-1]` get zeros."""
    num_tokens, num_rows = q.shape[0], seqlens_k.shape[0]
    tokens = torch.arange(num_tokens, device=q.device)
    rows = torch.searchsorted(cu_seqlens_q[1:].long(), tokens, right=True)
    valid = rows < num_rows
    rows = rows.clamp(max=num_rows - 1)
    lengths = seqlens_k.long()[rows]
    q_pos = lengths - (cu_seqlens_q.long()[rows + 1] - tokens)  # [T]
    positions = torch.arange(table.shape[1] * page_size, device=q.device)  # [L]
    slots = table.long()[rows][:, positions // page_size] * page_size + positions % page_size  # [T, L]
    group = q.shape[1] // key_cache.shape[1]
    k = key_cache[slots].float().repeat_interleave(group, dim=2)  # [T, L, H, D]
    v = value_cache[slots].float().repeat_interleave(group, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q.float(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = (positions[None, :] <= q_pos[:, None]) & (positions[None, :] < lengths[:, None])
    if window is not None:
        allowed &= positions[None, :] > q_pos[:, None] - window
    allowed &= valid[:, None]
    probs = scores.masked_fill(~allowed[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("thl,tlhd->thd", probs, v).to(q.dtype)


def _paged_attention(q, k_pages, v_pages, cu_seqlens_q, seqlens_k, table, scale, window, softcap, sinks):
    num_pages, page_size = k_pages.shape[:2]
    _check(q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, "head_size must be a multiple of 8, at most 256")
    widths = (seqlens_k.long() + page_size - 1) // page_size
    _check(lambda: bool((widths <= table.shape[1]).all()), "block_table narrower than the KV length")
    _check(
        lambda: bool((table < num_pages).all() and (table >= 0).all()), "block_table holds an unknown page"
    )
    key_cache = k_pages.reshape(num_pages * page_size, *k_pages.shape[2:])
    value_cache = v_pages.reshape(num_pages * page_size, *v_pages.shape[2:])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _capturing():
        _check(sinks is None, "the capturable double implements no sinks")
        return _dense_paged_attention(
            q, key_cache, value_cache, cu_seqlens_q, seqlens_k, table, page_size, scale, window, softcap
        )
    return reference_paged_attention(
        q,
        key_cache,
        value_cache,
        cu_seqlens_q,
        seqlens_k,
        table,
        page_size,
        scale,
        sliding_window=window,
        softcap=softcap if softcap else None,
        sinks=sinks,
    )


def _varlen_output(q: torch.Tensor, cu_seqlens_q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows past `cu_seqlens_q[-1]` belong to no sequence: zeros here (uninitialised on the GPU)."""
    if _capturing():
        return out  # the dense kernel already zeroed them
    full = torch.zeros_like(q)
    total = int(cu_seqlens_q[-1])
    full[:total] = out[:total]
    return full


# -- flash-attn 2 (`flash_attn`) ---------------------------------------------------------------------


def fa2_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    _check(dropout_p == 0.0 and alibi_slopes is None, "the test double implements no dropout / alibi")
    _check(block_table is not None, "the test double implements the paged form only")
    _index_tensor("cu_seqlens_q", cu_seqlens_q)
    _index_tensor("cu_seqlens_k", cu_seqlens_k)
    _index_tensor("block_table", block_table)
    _check(k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    _check(
        lambda: seqlens_k.numel() == 0 or int(seqlens_k.max()) <= max_seqlen_k,
        "max_seqlen_k below a sequence's KV length",
    )
    window = _window(window_size, causal)
    CALLS.append(("flash_attn.flash_attn_varlen_func", {"window": window, "softcap": softcap, "q": q.shape}))
    out = _paged_attention(
        q, k, v, cu_seqlens_q, seqlens_k, block_table, softmax_scale, window, softcap, None
    )
    return _varlen_output(q, cu_seqlens_q, out)


def _with_kvcache(
    q, k_cache, v_cache, k, v, cache_seqlens, table, cu_seqlens_q, max_seqlen_q, scale, causal, window_size,
    softcap, sinks, module,
):  # fmt: skip
    _index_tensor("cache_seqlens", cache_seqlens)
    _index_tensor("block_table", table)
    _check(table is not None, "the test double implements the paged form only")
    window = _window(window_size, causal)
    packed = cu_seqlens_q is not None
    if not packed:  # q: [B, Sq, H, D]
        _check(q.shape[1] == 1 or k is None, "the test double appends one token per sequence")
        cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device) * q.shape[1]
        q = q.reshape(-1, *q.shape[2:])
    seqlens_k = cache_seqlens
    if k is not None:  # write the new token in place, at position cache_seqlens[i] of row i's pages
        page_size = k_cache.shape[1]
        position = cache_seqlens.long()
        rows = torch.arange(k.shape[0], device=k.device)
        slots = table.long()[rows, position // page_size] * page_size + position % page_size
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[:, 0])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[:, 0])
        seqlens_k = seqlens_k + 1
    CALLS.append(
        (f"{module}.flash_attn_with_kvcache", {"window": window, "softcap": softcap, "fused": k is not None})
    )
    out = _paged_attention(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, table, scale, window, softcap, sinks)
    return _varlen_output(q, cu_seqlens_q, out) if packed else out.view(-1, 1, *out.shape[1:])


def fa2_flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    _check(rotary_cos is None and cache_batch_idx is None and cache_leftpad is None, "not in the test double")
    _check(k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    return _with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, None, None, softmax_scale, causal, window_size,
        softcap, None, "flash_attn",
    )  # fmt: skip


# -- flash-attn 3 (`flash_attn_interface`) -----------------------------------------------------------


def fa3_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
    softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
    sm_margin=0, return_attn_probs=False,
):  # fmt: skip
    raise RuntimeError(
        "the test double's flash-attn 3 varlen function reads no paged cache (as the real one)"
    )


def fa3_flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
    max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None,
    softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
    rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
    return_softmax_lse=False,
):  # fmt: skip
    _check(
        cu_seqlens_q is None or max_seqlen_q is not None,
        "max_seqlen_q must be provided if cu_seqlens_q is provided",
    )
    _check(cu_seqlens_k_new is None and rotary_cos is None, "not in the test double")
    return _with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
        window_size, softcap, None, "flash_attn_interface",
    )  # fmt: skip


def _module(name: str, version: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__version__ = version
    module.__dict__.update(functions)
    return module


def fa2_module() -> types.ModuleType:
    return _module(
        "flash_attn",
        "2.8.4",
        flash_attn_varlen_func=fa2_flash_attn_varlen_func,
        flash_attn_with_kvcache=fa2_flash_attn_with_kvcache,
    )


def fa3_module() -> types.ModuleType:
    return _module(
        "flash_attn_interface",
        "3.0.0",
        flash_attn_varlen_func=fa3_flash_attn_varlen_func,
        flash_attn_with_kvcache=fa3_flash_attn_with_kvcache,
    )


@contextmanager
def injected(fa2: bool = True, fa3: bool = False, cpu: bool = True):
    """Make `import flash_attn` / `import flash_attn_interface` find the double (and, with `cpu`, let the
    flash backends run on CPU); undo everything afterwards."""
    from transformers_cb.attention import selection
    from transformers_cb.attention.backends import flash_kernels

    saved = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn_interface")}
    devices = set(selection.FLASH_DEVICES)
    # None in sys.modules makes `import` raise ImportError: a package that is not installed.
    sys.modules["flash_attn"] = fa2_module() if fa2 else None
    sys.modules["flash_attn_interface"] = fa3_module() if fa3 else None
    if cpu:
        selection.FLASH_DEVICES.add("cpu")
    flash_kernels.forget_loaded_kernels()
    CALLS.clear()
    try:
        yield CALLS
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        selection.FLASH_DEVICES.clear()
        selection.FLASH_DEVICES.update(devices)
        flash_kernels.forget_loaded_kernels()
