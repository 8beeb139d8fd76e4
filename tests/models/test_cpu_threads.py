"""The commands' CPU thread count: `--threads`, else OMP_NUM_THREADS, else the cores the load leaves idle (at start
for `generate`; `serve` starts with every core and adapts while it runs)."""

from __future__ import annotations

import pytest
import torch

from transformers_cb.cli.main import build_parser
from transformers_cb.models import cpu_threads as threads


@pytest.mark.parametrize(
    ("cores", "load", "expected"),
    [(2, 0.0, 2), (2, 0.6, 1), (2, 4.2, 1), (8, 3.2, 5), (8, 0.4, 8), (1, 0.0, 1)],
)
def test_idle_cores_leaves_the_loaded_ones(cores: int, load: float, expected: int) -> None:
    assert threads.idle_cores(cores, load) == expected


def test_the_choice_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "idle_cores", lambda: 3)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.cpu_threads(5, "cpu") == 5  # --threads wins
    assert threads.cpu_threads(None, "cpu") == 3  # the idle cores
    assert threads.cpu_threads(None, "cuda") is None  # not our business on a GPU
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.cpu_threads(None, "cpu") is None  # torch already took the user's setting


def test_commands_set_it_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers_cb.models import loading

    monkeypatch.setattr(loading, "load_model_and_tokenizer", lambda *a, **k: (None, None))
    saved = torch.get_num_threads()
    try:
        for command in (["generate"], ["serve"]):
            args = build_parser().parse_args(
                [*command, "--model", "tiny", "--device", "cpu", "--threads", "1"]
            )
            loading.load_for_command(args)
            assert torch.get_num_threads() == 1
            torch.set_num_threads(2)
    finally:
        torch.set_num_threads(saved)


def test_a_server_starts_with_every_core_and_adapts_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` never takes a snapshot of the load at start (manager/torch_threads/adaptive_threads.py follows it); `generate`,
    a job that starts and ends, still does."""
    monkeypatch.setattr(threads, "idle_cores", lambda: 1)
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.cpu_threads(None, "cpu", adaptive=True) == 4
    assert threads.cpu_threads(None, "cpu") == 1
    assert threads.adapts(None, "cpu") and not threads.adapts(2, "cpu") and not threads.adapts(None, "cuda")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not threads.adapts(None, "cpu")
    parse = build_parser().parse_args
    assert parse(["serve"]).adaptive_threads is True
    assert getattr(parse(["generate"]), "adaptive_threads", False) is False
