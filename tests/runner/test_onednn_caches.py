"""oneDNN's shape caches bounded for the server (runner/products/onednn_caches.py)."""

from __future__ import annotations

import argparse

import pytest

from transformers_cb.jobs.inputs import InputError
from transformers_cb.runner.products import onednn_caches
from transformers_cb.serve import server


@pytest.fixture
def clean_env(monkeypatch):
    for name in onednn_caches.CAPACITY_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_both_caches_get_the_capacity(clean_env) -> None:
    assert onednn_caches.bound_shape_caches(64) == dict.fromkeys(onednn_caches.CAPACITY_ENVS, "64")


def test_a_capacity_the_user_set_is_kept(clean_env) -> None:
    clean_env.setenv("LRU_CACHE_CAPACITY", "2048")
    in_force = onednn_caches.bound_shape_caches()
    assert in_force == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(onednn_caches.SERVER_CAPACITY),
        "LRU_CACHE_CAPACITY": "2048",
    }


def test_an_empty_cache_is_refused(clean_env) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        onednn_caches.bound_shape_caches(0)


def test_the_server_bounds_them_before_loading_the_model(clean_env) -> None:
    """They are read once, at the first oneDNN product: `run_serve` sets them before `build_state` loads."""
    seen: dict[str, str | None] = {}

    def build_state(args):
        import os

        seen.update({name: os.environ.get(name) for name in onednn_caches.CAPACITY_ENVS})
        raise ValueError("no model here")

    clean_env.setattr(server, "build_state", build_state)
    args = argparse.Namespace(host="127.0.0.1", port=0)
    with pytest.raises(InputError, match="no model here"):
        server.run_serve(args)
    assert seen == {name: str(onednn_caches.SERVER_CAPACITY) for name in onednn_caches.CAPACITY_ENVS}
