"""Where the repository and the scripts the tests start by file path are, wherever a test module lives."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO_ROOT = SUPPORT.parent.parent
TP_WORKER = SUPPORT / "tp_worker.py"  # one tensor-parallel rank
SERVE_LAUNCHER = SUPPORT / "serve_launcher.py"  # `transformers serve` with the plugin imported first
