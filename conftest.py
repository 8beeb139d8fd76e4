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

# The shared helpers (the scheduler's fake model, the manager checks, ...) assert like the tests do: have
# pytest rewrite them as it rewrites test modules, so they keep checking, with its messages, under
# `python -O` (which strips the asserts pytest did not rewrite) and show values on failure.
pytest.register_assert_rewrite("tests.support")

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
