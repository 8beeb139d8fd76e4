"""Fixtures of the Ray tests: one local 2-CPU Ray cluster for the whole session (started on first use,
shut down at the end) and the tiny model saved to a directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.ray_jobs import MISSING, save_tiny_model


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    if MISSING:
        pytest.skip(f"the 'ray' extra is not installed ({', '.join(MISSING)})")
    import ray

    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    # Ray starts its workers (the actors) at nice 15: beside the other xdist worker's tests they got a sliver
    # of the cores (a 20 s test took 60-220 s). The raylet reads its config from RAY_* variables at start.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
