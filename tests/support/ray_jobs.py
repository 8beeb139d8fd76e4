"""What the Ray tests share: skip without the `ray` extra, one local cluster, the tiny model on disk,
text prompts, and a predictor whose actor dies once mid-job.

Ray's workers import this module (the cluster's `PYTHONPATH` holds the repository root), so it stays
importable without Ray itself."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from transformers_cb.scale_out import RAY_INSTALL_HINT, missing_ray_modules
from transformers_cb.scale_out.predictor import CBPredictor

MISSING = missing_ray_modules()
requires_ray = pytest.mark.skipif(
    bool(MISSING), reason=f"the 'ray' extra is not installed ({', '.join(MISSING)}): {RAY_INSTALL_HINT}"
)

# Every test on the Ray cluster belongs in one pytest-xdist worker (`make test` runs `--dist loadgroup`): one
# cluster per session instead of one per worker, a group the scheduler hands out first. xdist 3.8 marks a group
# by rewriting `Item._nodeid`, which pytest 9 no longer reads (it keeps `Item._id`): conftest.py's
# `_name_xdist_groups` writes the group there too. Without xdist (or under another --dist) it changes nothing.
on_the_ray_cluster = pytest.mark.xdist_group("ray_cluster")

# Two actors of one CPU each fit the 2-CPU test cluster.
ACTOR_CPUS = 1.0
CB_CONFIG = {"page_size": 16}


def save_tiny_model(directory: Path) -> Path:
    """The built-in tiny model and its tokenizer, saved in `save_pretrained` layout under `directory`."""
    from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(seed=0, attn_implementation="sdpa", tokenizer=tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def text_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` seeded ASCII prompts of 3 to 60 characters (the tiny tokenizer is byte-level)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     .,"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(3, 60))) for _ in range(count)]


def one_call_reference(
    predictor: CBPredictor, token_lists: list[list[int]], max_new_tokens: list[int]
) -> list[list[int]]:
    """What one `generate_batch` call over every prompt gives, on `predictor`'s model and configs."""
    outputs = predictor.model.generate_batch(
        token_lists,
        generation_config=predictor.generation_config,
        continuous_batching_config=predictor.cb_config,
        progress_bar=False,
        max_new_tokens=max_new_tokens,
    )
    return [output.generated_tokens for output in outputs.values()]


class DyingPredictor(CBPredictor):
    """A `CBPredictor` whose actor exits hard (as if killed) after `exit_after` batches, once per job:
    the first actor to get there creates `marker` and dies; every other actor, and the restarted one,
    runs normally."""

    def __init__(self, *args: Any, marker: str, exit_after: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker, self.exit_after = marker, exit_after

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.batches_done >= self.exit_after:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return super().__call__(batch)
