"""The import paths and commands users already have keep working after the package's layout changes."""

from __future__ import annotations

import sys

import pytest

import transformers_cb
from tests.support.paths import REPO_ROOT
from tests.support.processes import run_process


def test_public_names_at_the_package_root() -> None:
    from transformers_cb import (
        ContinuousBatchingConfig,
        ContinuousBatchingManager,
        GenerationOutput,
        ManagerDeadError,
        ManagerStats,
        RequestStatus,
        UnknownRequestError,
        install,
        is_installed,
        uninstall,
    )

    assert set(transformers_cb.__all__) >= {
        "ContinuousBatchingConfig",
        "ContinuousBatchingManager",
        "GenerationOutput",
        "ManagerStats",
        "RequestStatus",
    }
    assert callable(install) and callable(uninstall) and is_installed()
    assert ContinuousBatchingManager.__module__.startswith("transformers_cb.")
    for cls in (GenerationOutput, ManagerDeadError, ManagerStats, RequestStatus, UnknownRequestError):
        assert cls.__module__.startswith("transformers_cb.")
    assert ContinuousBatchingConfig().page_size == 256


def test_config_and_requests_modules_keep_their_paths() -> None:
    from transformers_cb.config import ContinuousBatchingConfig
    from transformers_cb.requests import GenerationOutput, RequestStatus

    assert ContinuousBatchingConfig is transformers_cb.ContinuousBatchingConfig
    assert RequestStatus is transformers_cb.RequestStatus
    assert GenerationOutput is transformers_cb.GenerationOutput


@pytest.mark.slow  # a fresh interpreter
def test_conformance_check_module_and_command() -> None:
    from transformers_cb import conformance_check
    from transformers_cb.parity import check

    assert conformance_check.run_check is check.run_check
    # `conformance_main` wraps the check's own: `--model` also takes a registry name (fetched once).
    assert callable(conformance_check.conformance_main)
    assert conformance_check.conformance_main is not check.check_command
    assert not hasattr(conformance_check, "main")  # one public `main`: the console script's (cli/main.py)
    done = run_process(
        [sys.executable, "-m", "transformers_cb.conformance_check", "--help"],
        cwd=REPO_ROOT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "--model" in done.stdout
