"""Image blocks that attend both ways inside a prefill chunk (Gemma 3's images, `RequestMedia.blocks`): which
blocks a chunk holds and its mask widened over them. A rule of its own beside the packer because only a model
whose media declare such blocks reads it; the scheduler keeps every block inside one chunk
(scheduler/media_budget.py, `block_cut`)."""

from __future__ import annotations

import torch

from ...attention.metadata import visible_keys
from ...scheduler.step_plan import ScheduledRequest


def blocks_in(entry: ScheduledRequest) -> list[tuple[int, int]]:
    """The blocks of `entry`'s media (spans attending both ways, `RequestMedia.blocks`) its chunk holds."""
    media = entry.request.media
    if media is None:
        return []
    return [(first, last) for first, last in media.blocks if first < entry.end and last > entry.start]


def widened_mask(
    mask: torch.Tensor | None,
    entry: ScheduledRequest,
    first_key: int,
    blocks: list[tuple[int, int]],
    window: int | None,
    chunk: int | None,
    device: torch.device,
) -> torch.Tensor:
    """A prefill chunk's mask `[1, 1, Q, K]` (None: causal over its own keys) with each block's queries also
    seeing the block's later keys, as generate()'s prefill mask has them (causal OR same block, ANDed with
    the window: a later key is always inside it). Keys run from position `first_key` to the chunk's end;
    the scheduler never ends a chunk inside a block (`block_cut`), so a block's keys are all there."""
    q_positions = torch.arange(entry.start, entry.end, device=device)
    kv_positions = torch.arange(first_key, entry.end, device=device)
    if mask is None:
        base = visible_keys(q_positions, kv_positions, window, chunk)
    else:
        base = mask.view(entry.num_tokens, -1)
    block_of = torch.full((entry.end,), -1, dtype=torch.int64, device=device)
    for index, (first, last) in enumerate(blocks):
        block_of[first:last] = index
    q_block, k_block = block_of[q_positions][:, None], block_of[kv_positions][None, :]
    later_in_block = (kv_positions[None, :] > q_positions[:, None]) & (q_block == k_block) & (q_block >= 0)
    return (base | later_in_block).view(1, 1, entry.num_tokens, -1)
