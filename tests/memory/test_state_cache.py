"""`StateCache`: slot copies (forks) and swaps with the host tier, every source read before any write."""

from __future__ import annotations

import torch

from transformers_cb.memory.state_cache import CONV, RECURRENT, StateCache, StateSpec, swap_states

SPECS = (
    StateSpec(0, CONV, 0, (3, 4), torch.float32),
    StateSpec(0, RECURRENT, 0, (2, 2), torch.float32),
)


def filled(num_slots: int, offset: float) -> StateCache:
    cache = StateCache(SPECS, num_slots, torch.device("cpu"))
    for tensor in cache.tensors.values():
        for slot in range(num_slots):
            tensor[slot] = offset + slot
    return cache


def test_copy_slots_copies_every_state_of_the_source_slot() -> None:
    cache = filled(4, 0.0)
    cache.copy_slots([(1, 3), (0, 2)])
    for tensor in cache.tensors.values():
        assert [float(tensor[s].flatten()[0]) for s in range(4)] == [0.0, 1.0, 0.0, 1.0]


def test_swaps_read_every_source_before_writing() -> None:
    """Device slot 0 goes out to host slot 1 while host slot 1's previous content comes back into device
    slot 0 (a slot freed and taken again in one schedule): each side gets what the other held before."""
    device, host = filled(2, 0.0), filled(2, 10.0)
    swap_states(device, host, out=[(0, 1)], back=[(1, 0)])
    for key, tensor in device.tensors.items():
        assert float(tensor[0].flatten()[0]) == 11.0
        assert float(host.tensors[key][1].flatten()[0]) == 0.0
    assert StateCache(SPECS, 2, torch.device("cpu"), empty=True).nbytes() == device.nbytes()
