"""The user-facing checker (`python -m transformers_cb.conformance_check`) on a tiny model saved to disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.hybrids import build_hybrid
from tests.support.models import build_tiny_model
from tests.support.processes import run_process
from transformers_cb import conformance_check
from transformers_cb.scheduler.queues import RequestQueues

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model = build_tiny_model("qwen2", seed=3)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    return path


@pytest.mark.slow  # the command in a fresh interpreter
def test_check_model_command_passes(tiny_checkpoint: Path) -> None:
    """The documented command, in a subprocess, on a healthy model: exit 0 and a PASS table."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "transformers_cb.conformance_check", "--model", str(tiny_checkpoint)]
    command += ["--prompts", "4", "--max-new-tokens", "6", "--max-prompt-len", "40", "--attn", "paged|sdpa"]
    result = run_process(command, cwd=REPO_ROOT, env=env, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: generate_batch matches generate()" in result.stdout, result.stdout
    table = result.stdout.split("\n")
    assert any(line.startswith("setting") for line in table), result.stdout
    assert sum("PASS" in line for line in table) >= 4, result.stdout  # one row per setting + verdict
    assert "FAIL" not in result.stdout


def test_check_model_reports_mismatch(tiny_checkpoint: Path, monkeypatch, capsys) -> None:
    """A broken engine (eviction that garbles the last token it will recompute: a generated one, or the
    prompt's own when the victim was still in its prompt, which is what the tight cache's one preemption
    is now) makes the check fail with exit 1 and print both token sequences."""
    original = RequestQueues.preempt

    def broken_preempt(self, request, batch):
        original(self, request, batch)
        request.all_token_ids[-1] = (request.all_token_ids[-1] + 1) % 100 + 3
        if request.generated_ids:
            request.generated_ids[-1] = request.all_token_ids[-1]

    monkeypatch.setattr(RequestQueues, "preempt", broken_preempt)
    argv = ["--model", str(tiny_checkpoint), "--prompts", "6", "--max-new-tokens", "8", "--attn", "sdpa"]
    assert conformance_check.conformance_main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: generate_batch does NOT match generate()" in out, out
    assert "tight cache" in out and "first difference" in out and "generate_batch():" in out, out


def test_check_model_rejects_bad_arguments(tiny_checkpoint: Path) -> None:
    with pytest.raises(SystemExit) as excinfo:
        conformance_check.conformance_main(["--model", str(tiny_checkpoint), "--prompts", "0"])
    assert excinfo.value.code == 2


def test_check_model_with_a_draft_model_and_on_a_hybrid(
    tiny_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    """`--assistant-model` adds a draft-model setting (the model as its own assistant: it passes); on a
    model with state layers the speculation settings are left out with the reason, and the rest pass."""
    argv = [
        "--model",
        str(tiny_checkpoint),
        "--prompts",
        "3",
        "--max-new-tokens",
        "5",
        "--max-prompt-len",
        "20",
    ]
    assert conformance_check.conformance_main([*argv, "--assistant-model", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "draft model (speculation)" in out and "prompt lookup" in out, out
    hybrid = tmp_path / "qwen3_5"
    build_hybrid("qwen3_5").save_pretrained(hybrid)
    assert (
        conformance_check.conformance_main(
            ["--model", str(hybrid), "--prompts", "3", "--max-new-tokens", "5"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "speculation settings left out" in out and "state layers" in out, out
    assert "(speculation)" not in out.split("speculation settings left out")[1].split("\n", 1)[1], out
