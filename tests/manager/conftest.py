"""Fixtures of the manager tests: `ref` (the `generate()` references, one per module), `model` and a
`manager` on it that is hard-stopped and destroyed after the test."""

from __future__ import annotations

import pytest

from tests.support.manager import References, make_model, new_manager
from tests.support.threads import TIMEOUT


@pytest.fixture(scope="module")
def ref() -> References:
    return References(make_model())


@pytest.fixture
def model():
    return make_model()


@pytest.fixture
def manager(model):
    manager = new_manager(model)
    yield manager
    if manager.engine is not None:
        manager.stop(hard_stop=True, timeout=TIMEOUT)
        manager.destroy()
    assert not manager.is_running()
