"""Zero-filled tensors whose memory costs nothing until it is touched.

`torch.zeros` writes every byte of a tensor when it is made; on CPU that also faults in every page. The KV
cache is sized for all known requests at full length (memory/sizing.py), and a run often touches a fraction
of it (prefix sharing, requests that stop early): zeroing and later freeing all of it was ~50 ms of a
1.3-second `generate_batch` call of the small benchmark model (158 MB). A large CPU tensor is therefore
made over an anonymous memory map: the kernel gives each page zeroed on its first touch, so the tensor reads
zero everywhere (what the padded gathers need: never NaN) and only the pages a run writes are ever paid for.
Small tensors and other devices keep `torch.zeros`.
"""

from __future__ import annotations

import mmap

import torch

# Under this many bytes `torch.zeros` is as cheap (and stays in the allocator's pools).
MAPPED_MIN_BYTES = 2 << 20


def zeroed(
    shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A contiguous tensor of zeros of `shape` and `dtype` on `device` (see the module docstring for how)."""
    size = torch.Size(shape)
    nbytes = size.numel() * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(size, dtype=dtype, device=device)
    # The tensor holds the map (torch.frombuffer keeps its buffer alive); the map is unmapped with it.
    pages = mmap.mmap(-1, nbytes)
    return torch.frombuffer(pages, dtype=dtype).view(size)
