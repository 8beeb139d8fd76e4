"""Honest metadata and a CI that checks what the README promises: declared Python / torch floors match
what the code and transformers need; CI reruns the core under `python -O`, derandomizes Hypothesis,
installs the serve extra and type-checks the package."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

from hypothesis import settings
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.support.paths import REPO_ROOT

PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _declared(name: str) -> SpecifierSet:
    for line in PROJECT["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == name:
            return requirement.specifier
    raise AssertionError(f"{name} is not declared in pyproject.toml")


def _floor(specifier: SpecifierSet) -> Version:
    floors = [Version(s.version) for s in specifier if s.operator == ">="]
    assert floors, f"no lower bound in {specifier}"
    return max(floors)


def _transformers_needs(extra_name: str = "torch") -> tuple[Version, Version]:
    """(python floor, torch floor) of the installed transformers."""
    meta = metadata.metadata("transformers")
    python = _floor(SpecifierSet(meta["Requires-Python"]))
    torch_floor = Version("0")
    for line in meta.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if (
            requirement.name == "torch"
            and requirement.marker
            and requirement.marker.evaluate({"extra": extra_name})
        ):
            torch_floor = max(torch_floor, _floor(requirement.specifier))
    return python, torch_floor


def test_declared_python_and_torch_floors_are_what_transformers_and_the_code_need():
    python_floor, torch_floor = _transformers_needs()
    declared_python = _floor(SpecifierSet(PROJECT["requires-python"]))
    assert declared_python >= python_floor, f"transformers needs Python >= {python_floor}"
    assert _floor(_declared("torch")) >= max(torch_floor, Version("2.5")), (
        f"transformers needs torch >= {torch_floor}; sdpa's enable_gqa needs torch >= 2.5"
    )


def test_serve_extra_brings_what_transformers_serve_needs_and_ci_installs_it():
    serve = PROJECT["optional-dependencies"].get("serve")
    assert serve, "no serve extra in pyproject.toml"
    names = {Requirement(item).name for item in serve}
    meta = metadata.metadata("transformers")
    needed = {
        Requirement(line).name
        for line in meta.get_all("Requires-Dist") or []
        if 'extra == "serving"' in line and Requirement(line).name != "torch"
    }
    assert needed <= names, f"missing from the serve extra: {sorted(needed - names)}"
    assert '".[test,serve]"' in (REPO_ROOT / "Makefile").read_text(), (
        "make install-test must install the serve extra"
    )


def test_ci_reruns_the_core_under_python_O_and_derandomizes_hypothesis():
    run = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"python\"? -O -m pytest", run), ".ci/run has no python -O pass"
    for path in ("tests/scheduler/test_scheduler.py", "tests/kv/test_pool.py", "conformance"):
        assert path in run, f"the -O pass skips {path}"
    assert 'HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"' in run
    profile = settings.get_profile("ci")
    assert profile.derandomize and profile.database is None


def test_lint_and_ci_type_check_the_package():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert config["tool"]["mypy"]["packages"] == ["transformers_cb"]
    assert "mypy" in {Requirement(item).name for item in PROJECT["optional-dependencies"]["test"]}
    lint = (REPO_ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/mypy" in lint, "make lint does not run mypy"
    run = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r'"\$VENV_BIN/mypy" \|\| failed\+=\("mypy"\)', run), (
        ".ci/run has no mypy step of its own"
    )


def test_one_install_serves_run_and_serve_after_install_test(tmp_path):
    # `make run` right after `make install-test` must not install again: the test install is a superset.
    import shlex
    import shutil
    import subprocess

    if shutil.which("make") is None:
        import pytest

        pytest.skip("no make")
    extras = PROJECT["optional-dependencies"]
    test_install = set(extras["test"]) | set(extras["serve"])
    assert set(extras["models"]) <= test_install
    assert set(extras["serve"]) | set(extras["models"]) | set(extras["structured"]) <= test_install
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".installed-torch").touch()

    def dry_run(target: str) -> list[str]:
        command = ["make", "-n", "-C", str(REPO_ROOT), f"VENV={venv}", target]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()

    for line in dry_run("install-test"):  # the install's stamps, as its recipe leaves them
        if line.startswith("touch "):
            subprocess.run(shlex.split(line), check=True)
    for target in ("run", "serve"):
        steps = dry_run(target)
        assert not any("pip install" in s for s in steps), f"make {target} reinstalls: {steps}"


def test_the_lowest_torch_step_takes_its_index_from_pip_args():
    run = (REPO_ROOT / ".ci" / "run").read_text()
    step = run.split("CB_CI_LOWEST_TORCH", 1)[1]
    assert "download.pytorch.org" not in step and "${PIP_ARGS:-}" in step
