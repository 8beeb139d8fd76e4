"""Fixtures shared by the manager tests (test_manager.py, test_manager_hardening.py)."""

from __future__ import annotations

import pytest

from tests.manager.test_manager import TIMEOUT, References, make_model, new_manager


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
