"""Two run sessions on one model that overlap without nesting (two managers, a warm-up beside a run): every
kind of run-scoped patch (patches.py) stays in force until the last session using it leaves, the session
still running after the other left produces `generate()`'s tokens, and the model is as it was at the end."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from conformance.coverage.build import build_model as build_entry
from conformance.coverage.catalog import all_entries
from tests.support.hybrids import build_hybrid
from tests.support.models import build_tiny_model, tiny_phi3_longrope
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig, patches
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission


def _catalog(model_type: str) -> PreTrainedModel:
    (entry,) = [e for e in all_entries() if e.name == model_type]
    return build_entry(entry)


# kind of patch -> (a model that takes it, the config that turns it on)
CASES: dict[str, tuple[Callable[[], PreTrainedModel], dict[str, Any]]] = {
    "packed_linears": (lambda: build_tiny_model("llama"), {}),
    "native_layers": (lambda: build_tiny_model("llama"), {}),
    "request_rotary": (tiny_phi3_longrope, {}),
    "state_layers": (lambda: build_hybrid("bamba"), {}),
    "latent_pass_through": (lambda: _catalog("deepseek_v3"), {}),
    "indexer_pass_through": (lambda: _catalog("deepseek_v32"), {}),
    "classic_attention": (lambda: _catalog("bloom"), {}),
    "batch_invariant": (lambda: build_tiny_model("llama"), {"batch_invariant": True}),
}


def _instance_state(model: PreTrainedModel) -> dict[tuple[int, str], int]:
    """Every module's instance attributes (by identity) and its modeling file's globals."""
    state = {
        (id(m), k): id(v) for m in model.modules() for k, v in m.__dict__.items() if not k.startswith("_")
    }
    modeling = sys.modules[type(model).__module__].__dict__
    state.update({(0, k): id(v) for k, v in modeling.items() if callable(v)})
    return state


def _generate(engine: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    request = engine.build_request(Submission(prompt, "r", max_new_tokens=max_new_tokens, eos_token_id=None))
    engine.add(request)
    while not request.is_finished:
        engine.step()
    return list(request.generated_ids)


@pytest.mark.parametrize("kind", list(CASES))
def test_a_session_left_first_leaves_the_other_s_patches_in_force(kind: str, monkeypatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_CB_PACKED_LINEAR", "all")  # tiny weights packed too
    make_model, settings = CASES[kind]
    model = make_model()
    prompt = [5, 9, 17, 33, 4, 8, 21, 3, 12, 7]
    generation = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = model.generate(torch.tensor([prompt]), generation_config=generation)[0, len(prompt) :].tolist()
    config = ContinuousBatchingConfig(page_size=16, **settings)
    first = build_engine(model, generation, config)
    second = build_engine(model, generation, config)
    before = _instance_state(model)
    a, b = SessionThread(first), SessionThread(second)
    a.enter()
    with_one = _instance_state(model)
    assert any(patches.in_force(kind, *key) for key in _owners(model, with_one, before)), f"no {kind} patch"
    b.enter()
    try:
        assert _instance_state(model) == with_one  # the second session shares the first's patches
        a.leave()
        assert _instance_state(model) == with_one  # still in force for the second
        assert b.run(lambda: _generate(second, prompt, 6)) == expected
    finally:
        a.leave()
        b.leave()
    assert _instance_state(model) == before


class SessionThread:
    """One engine's run session held open on a thread of its own, as a manager's loop holds it: the session's
    thread-local modes (inference mode) stay that thread's, whatever order the sessions end in."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.work: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        with self.engine.session():
            self.done.put(("entered", None))
            while (job := self.work.get()) is not None:
                try:
                    self.done.put(("ok", job()))
                except Exception as error:  # noqa: BLE001  (handed to the test's thread)
                    self.done.put(("error", error))
        self.done.put(("left", None))

    def enter(self) -> None:
        self.thread.start()
        assert self.done.get(timeout=TIMEOUT)[0] == "entered"

    def run(self, job: Callable[[], Any]) -> Any:
        self.work.put(job)
        status, value = self.done.get(timeout=TIMEOUT)
        if status == "error":
            raise value
        return value

    def leave(self) -> None:
        if self.thread.is_alive():
            self.work.put(None)
            assert self.done.get(timeout=TIMEOUT)[0] == "left"
            self.thread.join(timeout=TIMEOUT)


def _owners(model: PreTrainedModel, now: dict, before: dict) -> list[tuple[Any, str]]:
    """(owner, name) of each attribute the session set."""
    by_id: dict[int, Any] = {id(m): m for m in model.modules()}
    by_id[0] = sys.modules[type(model).__module__]
    return [
        (by_id[owner], name) for (owner, name), value in now.items() if before.get((owner, name)) != value
    ]
