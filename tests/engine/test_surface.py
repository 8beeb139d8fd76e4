"""The engine's surface, what the layers above use instead of its parts: page counts, sharing, the
processor stages (and clearing them), settings, counters, the tensor-parallel questions, and the hooks
rank 0's publisher gets from every step (a no-op without tensor parallelism)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.support.engine import run_prompts
from tests.support.models import build_tiny_model, tiny_llama
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.selection import paged_backend
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.engine.publisher import StepPublisher
from transformers_cb.requests import RequestStatus

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)
SAMPLED = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.2)


def test_page_counts_and_sharing() -> None:
    model = build_tiny_model("qwen2_sliding")
    engine = build_engine(
        model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=12, max_queue_size=7)
    )
    settings = engine.settings
    assert (
        len(settings.cache.kv_groups) == 2 and settings.cache.page_size == 4 and engine.num_total_pages == 24
    )
    assert engine.num_used_pages == 0 and set(engine.snapshot().pages_in_use_by_group.values()) == {0}
    assert settings.cache.sharing and engine.pages.sharing and settings.scheduler.max_queue_size == 7
    requests = [
        engine.build_request(Submission(p, f"r{i}")) for i, p in enumerate(prompts_of_lengths([9, 5], seed=1))
    ]
    seen = 0
    with paged_backend(model, settings.step_options.attn_implementation), torch.inference_mode():
        for request in requests:
            engine.add(request)
        while engine.has_work():
            engine.step()
            snapshot = engine.snapshot()
            assert (
                engine.num_used_pages == snapshot.pages_in_use == sum(snapshot.pages_in_use_by_group.values())
            )
            seen = max(seen, engine.num_used_pages)
    assert seen > 0 and engine.num_used_pages == 0
    off = build_engine(
        model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=12, allow_block_sharing=False)
    )
    assert not off.settings.cache.sharing and not off.pages.sharing


def test_processor_stages_and_clearing_them() -> None:
    engine = build_engine(tiny_llama(), SAMPLED, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    names = engine.processor_stage_names()
    assert names and names == [stage.name for stage in engine.runner.sampler.stages]
    grammars = engine.runner.sampler.grammars
    engine.clear_logits_processors()
    assert engine.processor_stage_names() == [] and engine.runner.sampler.stages == []
    # Only the stages go: sampling stays sampling, guided decoding keeps its masks.
    assert engine.runner.sampler.do_sample is True and engine.runner.sampler.grammars is grammars


def test_the_warmups_plain_greedy_sampler_is_put_back() -> None:
    engine = build_engine(tiny_llama(), SAMPLED, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    sampler = engine.runner.sampler
    with pytest.raises(RuntimeError, match="inside"), engine.runner.plain_greedy_sampler():
        assert engine.runner.sampler is not sampler
        assert engine.runner.sampler.stages == [] and not engine.runner.sampler.do_sample
        raise RuntimeError("inside")
    assert engine.runner.sampler is sampler


def test_counters_reset_and_the_single_process_answers() -> None:
    model = tiny_llama()
    engine = build_engine(model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    assert engine.rank == 0 and not engine.is_follower
    run_prompts(engine, model, prompts_of_lengths([4, 7], seed=3))
    assert engine.counters.generated_tokens == 12
    engine.reset_counters()
    assert engine.snapshot().counters.generated_tokens == 0 and engine.counters.steps == 0


class RecordingPublisher(StepPublisher):
    """Every hook call, in order: what rank 0's publisher would turn into messages."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def step_planned(self, batch) -> None:
        self.calls.append(("planned", len(batch.entries)))

    def step_failed(self, error) -> None:
        self.calls.append(("failed", str(error)))

    def tokens_sampled(self, requests, tokens) -> None:
        assert all(len(run) == 1 for run in tokens)  # one token per request and step: no speculation here
        self.calls.append(("tokens", [r.request_id for r in requests], [run[0].token_id for run in tokens]))

    def requests_finished(self, requests) -> None:
        self.calls.append(("finished", [r.request_id for r in requests]))

    def step_ended(self, finished, has_work) -> None:
        self.calls.append(("ended", [r.request_id for r in finished], has_work()))

    def idle(self) -> None:
        self.calls.append(("idle",))

    def run_ended(self) -> None:
        self.calls.append(("run_ended",))

    def session_ended(self) -> None:
        self.calls.append(("session_ended",))


def test_every_step_reaches_the_publisher() -> None:
    model = tiny_llama()
    engine = build_engine(model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=16))
    engine.publisher = publisher = RecordingPublisher()
    prompts = prompts_of_lengths([5, 9, 3], seed=4)
    requests = run_prompts(engine, model, prompts)
    calls = publisher.calls
    kinds = [call[0] for call in calls]
    ended = [call for call in calls if call[0] == "ended"]
    # Per step: the plan, then (when tokens were sampled) the tokens, then the end.
    assert [kind for kind in kinds if kind != "tokens"] == ["planned", "ended"] * engine.counters.steps
    assert all(
        kinds[i - 1] == "planned" and kinds[i + 1] == "ended" for i, k in enumerate(kinds) if k == "tokens"
    )
    # Each token and each end reaches the publisher once; the run's end shows in the last step's has_work.
    tokens = {}
    for call in calls:
        if call[0] == "tokens":
            for request_id, token in zip(call[1], call[2], strict=True):
                tokens.setdefault(request_id, []).append(token)
    assert tokens == {request.request_id: request.generated_ids for request in requests}
    assert sorted(r for call in ended for r in call[1]) == ["r0", "r1", "r2"]
    assert [call[2] for call in ended].count(False) == 1 and ended[-1][2] is False
    # Outside a step: a cancellation, the idle heartbeat, a warmup that cannot run, the session's end.
    publisher.calls.clear()
    extra = engine.build_request(Submission(prompts[0], "cancelled"))
    engine.add(extra)
    assert not engine.warmup()  # not idle
    engine.finish(extra, RequestStatus.CANCELLED)
    engine.heartbeat()
    engine.end_session()
    assert publisher.calls == [("run_ended",), ("finished", ["cancelled"]), ("idle",), ("session_ended",)]


def test_a_failed_step_asks_the_publisher_first(monkeypatch) -> None:
    """The publisher sees the failure before the engine fails the step's requests: rank 0's raises there
    (the ranks cannot be known to agree), the single-process one lets the requests fail."""
    model = tiny_llama()
    engine = build_engine(model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=16))
    engine.publisher = publisher = RecordingPublisher()

    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "run", broken)
    request = engine.build_request(Submission([3, 4, 5], "r0"))
    engine.add(request)
    with paged_backend(model, engine.settings.step_options.attn_implementation):
        result = engine.step()
    assert result.finished == [request] and request.status == RequestStatus.FAILED
    assert [call[0] for call in publisher.calls] == ["planned", "failed", "finished"]

    class Raising(RecordingPublisher):
        def step_failed(self, error) -> None:
            raise ValueError("group broken") from error

    engine.publisher = Raising()
    request = engine.build_request(Submission([3, 4, 5], "r1"))
    engine.add(request)
    with (
        paged_backend(model, engine.settings.step_options.attn_implementation),
        pytest.raises(ValueError, match="group broken"),
    ):
        engine.step()
    assert not request.is_finished


def test_a_cancelled_request_gives_its_rows_back_with_the_next_plan() -> None:
    """`Engine.finish` ends a request through the scheduler's one exit; its block-table rows go back with
    the next plan's `released`, and the engine's integrity holds in between."""
    engine = build_engine(tiny_llama(), GenerationConfig(max_new_tokens=8, do_sample=False), None)
    with engine.session():
        request = engine.build_request(Submission([5, 6, 7, 8], "r"))
        engine.add(request)
        engine.step()
        tables = engine.packer.block_tables[0]
        assert "r" in tables._rows
        engine.finish(request, RequestStatus.CANCELLED)
        assert engine.scheduler.ended == [request]
        engine.check_integrity()  # its row is pending release, not leaked
        engine.step()  # nothing to run: the plan alone releases it
        assert "r" not in tables._rows and engine.scheduler.ended == []
        engine.check_integrity()
