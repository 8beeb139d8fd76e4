"""transformers_cb/import_noise.py: torchao's CPU-irrelevant import records are dropped, nothing else."""

from __future__ import annotations

import logging

import pytest
import torch

import transformers_cb  # noqa: F401  (installs the filters)


@pytest.mark.skipif(torch.version.cuda is not None, reason="the filters stay off where torch has CUDA")
def test_only_the_named_records_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("torchao").warning(
            "Failed to load /x/torchao/_C_cutlass_90a.abi3.so: Could not load"
        )
        logging.getLogger("torchao").warning("another torchao warning")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.",
            "E",
        )
        logging.getLogger("torch.utils._pytree").warning("a real pytree warning")
        logging.getLogger("transformers_cb").warning("Failed to load something of ours")
    assert [r.getMessage() for r in caplog.records] == [
        "another torchao warning",
        "a real pytree warning",
        "Failed to load something of ours",
    ]
