"""The paged forward finds the step's metadata in the context variable when a layer dropped the kwarg
(StableLM, Nemotron), and falls back to plain attention outside a continuous-batching forward."""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from transformers_cb.attention.metadata import AttentionMetadata
from transformers_cb.attention.paged import METADATA_KWARG, current_step_metadata, make_forward, step_metadata
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec


class _Group:
    sliding_window = None
    latent = None


class FakeMetadata:
    def group_of(self, layer_idx: int) -> _Group:
        return _Group()

    def kv_group_of(self, layer_idx: int) -> KVGroupSpec:
        return KVGroupSpec(FULL_ATTENTION, (layer_idx,))


def recording_forward() -> tuple[Any, list]:
    runs: list = []

    def run(query, key, value, layer_idx, metadata, scale, softcap, sinks) -> torch.Tensor:
        runs.append(("paged", metadata))
        return query.transpose(1, 2)

    def fallback(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
        runs.append(("plain", None))
        return query.transpose(1, 2), None

    return make_forward(run, fallback, "test_paged"), runs


def attend(forward) -> None:
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 2, 3, 4)
    forward(module, q, q, q, None, scaling=0.5)


def test_the_context_variable_stands_in_for_a_dropped_kwarg() -> None:
    forward, runs = recording_forward()
    metadata = cast(AttentionMetadata, FakeMetadata())
    with step_metadata(metadata):
        attend(forward)  # the layer passed no kwargs
    attend(forward)  # outside a step: plain attention
    assert runs == [("paged", metadata), ("plain", None)]


def test_the_kwarg_wins_over_the_context() -> None:
    forward, runs = recording_forward()
    outer, passed = FakeMetadata(), FakeMetadata()
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 2, 3, 4)
    with step_metadata(cast(AttentionMetadata, outer)):
        forward(module, q, q, q, None, **{METADATA_KWARG: passed})
    assert runs == [("paged", passed)]


def test_the_context_is_per_thread() -> None:
    """Another thread (another request's forward, the manager's) never sees this thread's step."""
    seen = []
    with step_metadata(cast(AttentionMetadata, FakeMetadata())):
        thread = threading.Thread(target=lambda: seen.append(current_step_metadata()))
        thread.start()
        thread.join()
    assert seen == [None]
