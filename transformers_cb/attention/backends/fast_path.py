"""The decode fast path: decode-only steps through `flash_attn_with_kvcache` with per-request block tables.

`max_blocks_per_request` sizes the table (columns per request): None infers it from the workload (the
longest request's pages) or falls back to 32 pages, 0 disables the path. It is used only with a flash
backend whose kernel has a paged `flash_attn_with_kvcache`, on a flash device, for models without sliding
layers (their recycled ring pages are not a block table the kernel can read); otherwise it is 0, with a
warning only when the user set it explicitly.
"""

from __future__ import annotations

import logging

import torch

from ..metadata import AttentionMetadata, DecodeFastPath
from .flash_kernels import FlashKernel

logger = logging.getLogger(__name__)

FALLBACK_MAX_BLOCKS_PER_REQUEST = 32


def resolve_max_blocks_per_request(
    requested: int | None,
    has_sliding: bool,
    kernel: FlashKernel | None,
    flash_device: bool,
    page_size: int,
    workload: list[int] | None,
) -> int:
    """The table width the fast path uses (0: the path is off)."""
    explicit = requested is not None and requested > 0
    if requested == 0:
        return 0
    if has_sliding:
        if explicit or kernel is not None:
            logger.log(
                logging.WARNING if explicit else logging.INFO,
                "decode fast path off (max_blocks_per_request=%s forced to 0): the model has sliding-window "
                "or chunked-attention layers, whose recycled pages the kernel's block table cannot address",
                requested,
            )
        return 0
    if kernel is None or kernel.kvcache_table_arg is None or not flash_device:
        if explicit:
            why = (
                "the attention backend is not a paged flash backend"
                if kernel is None
                else "the kernel has no paged flash_attn_with_kvcache"
                if kernel.kvcache_table_arg is None
                else "the flash kernels run on CUDA only"
            )
            logger.warning("max_blocks_per_request=%d: decode fast path unavailable (%s)", requested, why)
        return 0
    if explicit and requested is not None:
        return requested
    if workload:
        return -(-max(workload) // page_size)
    return FALLBACK_MAX_BLOCKS_PER_REQUEST


def prepare_flash_step(metadata: AttentionMetadata, max_blocks_per_request: int) -> None:
    """Add what the flash kernels read beyond the shared metadata: `cu_seqlens_k`, and the decode fast
    path when every query is a decode and each request's pages fit `max_blocks_per_request` columns."""
    lengths = metadata.seq_lens_k
    metadata.decode_fast_path = None
    metadata.cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    if max_blocks_per_request <= 0 or metadata.max_seqlen_q != 1 or len(metadata.groups) != 1:
        return
    if metadata.groups[0].sliding_window is not None or metadata.groups[0].chunk_size is not None:
        return
    table = metadata.groups[0].block_table  # [B, pages of the longest request]
    if table.shape[1] > max_blocks_per_request:
        return  # a request outgrew the table: this step takes the varlen path
    block_table = table.new_zeros(lengths.numel(), max_blocks_per_request)
    block_table[:, : table.shape[1]] = table
    metadata.decode_fast_path = DecodeFastPath(block_table=block_table, cache_seqlens=lengths - 1)
