"""The run session is entered in one place: `Engine.session()` switches the model to its paged backend and
packed products (and the state layers' split forwards); every caller that steps an engine enters that, never the
parts by hand."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "transformers_cb"


def callers(pattern: str) -> set[str]:
    """The package modules (relative paths) that call `pattern(`, its definition excluded."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for line in text.splitlines():
            code = line.split("#", 1)[0]
            if re.search(rf"(?<![\w.`]){pattern}\(", code) and not code.lstrip().startswith("def "):
                found.add(str(path.relative_to(PACKAGE)))
    return found


def importers(statement: str) -> set[str]:
    """The package modules (relative paths) whose source holds `statement`."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if statement in p.read_text()}


def test_packed_products_and_the_backend_switch_only_in_the_engine_session() -> None:
    assert callers("packed_linears") == {"engine/engine.py"}
    # The backend switch (`attention/selection.py`'s `paged_attention`, not the attention function of the
    # same name in `attention/paged.py`): the engine's session, and the drafter for the draft model (its
    # part of the session, `Engine.assistant_session`).
    assert importers("selection import paged_backend") == {"engine/engine.py", "runner/drafter.py"}


def test_the_state_layers_forwards_are_installed_only_by_the_run_session() -> None:
    """The state modules' split forwards are installed by `StateLayers.session` (a step outside a run
    session installs them for itself there too), which the runner's part of the run session enters, which
    `Engine.session()` alone enters."""
    assert callers("split_state_layers") == {"runner/states/state_layers.py"}
    assert importers("states.session()") == {"runner/model_runner.py"}
    assert importers("runner.session()") == {"engine/engine.py"}
