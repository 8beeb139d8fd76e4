"""Conformance-suite fixtures."""

from __future__ import annotations

import os

import pytest
import torch

# The parity checks in common.py are plain asserts: have pytest rewrite them like a test module's, so they
# keep checking when CI runs this suite under `python -O` (which strips asserts pytest did not rewrite).
pytest.register_assert_rewrite("conformance.common")

# The models here are tiny: one intra-op thread is as fast as two on an idle machine and many times
# faster on a busy one (OpenMP workers spin-wait for cores held by other processes).
CONFORMANCE_THREADS = int(os.environ.get("CB_CONFORMANCE_THREADS", "1"))


@pytest.fixture(autouse=True, scope="module")
def _torch_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(CONFORMANCE_THREADS)
    yield
    torch.set_num_threads(saved)
