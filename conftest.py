"""Repository-wide pytest setup: Hypothesis profiles, and assertion rewriting in tests/support/.

- "ci" (set by `.ci/run`, or by `CI=1`): derandomized, no example database, so every CI run explores the
  same examples and a failure reproduces exactly on any machine.
- "dev" (default elsewhere): random exploration, examples remembered in `.hypothesis/`.

Both print a `@reproduce_failure` blob on failure. To replay a random run's failure, use the seed
Hypothesis prints: `HYPOTHESIS_PROFILE=dev python -m pytest tests/scheduler/test_scheduler.py --hypothesis-seed=N`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (`make test`: TEST_WORKERS processes), give each worker its share of the cores:
    two workers with a torch thread per core each oversubscribe the machine and slow each other far more
    than twice. Set before any test imports torch, so child processes inherit it too; an explicit
    OMP_NUM_THREADS is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    import torch

    torch.set_num_threads(share)


_share_cores_between_workers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`), hand out the grouped tests first (the Ray tests, one worker's few
    minutes in a row), then the `slow` tests: the workers take tests one by one (`--dist loadgroup`) in this
    order, so the long ones start while both workers are busy and the last minutes are spent on short tests
    on both workers, not one long test (or the whole Ray group) on one. A stable sort: the order within each
    tier is the collection order. A single process keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    items.sort(
        key=lambda item: (
            item.get_closest_marker("xdist_group") is None,
            item.get_closest_marker("slow") is None,
        )
    )
    if config.getvalue("loadgroup"):
        _name_xdist_groups(items)


def _name_xdist_groups(items: list[pytest.Item]) -> None:
    """`--dist loadgroup` sends every test marked `xdist_group(name)` to one worker by the `@name` that
    pytest-xdist 3.8 appends to `Item._nodeid`, which pytest 9 no longer reads (a node's id is `Item._id`):
    append it there too, so the Ray tests share one worker and one cluster (tests/support/ray_jobs.py)."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest 8: xdist's own suffix is in effect
        return
    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


# The shared helpers (the scheduler's fake model, the manager checks, ...) assert like the tests do: have
# pytest rewrite them as it rewrites test modules, so they keep checking, with its messages, under
# `python -O` (which strips the asserts pytest did not rewrite) and show values on failure.
pytest.register_assert_rewrite("tests.support")

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
