"""Weight updates across a running manager (docs/manager.md, "Weight updates"): no request after an update
reuses KV computed before it (the conformance check: its tokens equal `generate()` under the new weights),
the weight version counts the changes and each output says which versions produced its tokens, and the
pause modes keep, recompute or abort the requests in flight.

The tiny Llama's q/k/v projections are scaled so that attention is sharp: KV computed under the old
weights changes the greedy tokens (every conformance test here fails with the check disabled)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.manager import collect, new_manager
from tests.support.models import tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT, wait_for
from transformers_cb import ContinuousBatchingManager, GenerationOutput, RequestStatus

LONG = prompts_of_lengths([600], seed=3)[0]
SYSTEM = prompts_of_lengths([48], seed=4)[0]  # three full pages of 16: shared by every request below
SUFFIXES = prompts_of_lengths([4] * 100, seed=5)


def sharp_model():
    """The tiny Llama (no eos, 1024 positions) with q/k/v scaled 4x: sharp attention, so stale KV shows."""
    model = tiny_llama_without_eos(max_position_embeddings=1024)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.mul_(4.0)
    return model


@torch.no_grad()
def update(model) -> None:
    """The weight update of the issue: every v_proj changed in place (bumps its version counter)."""
    for layer in model.model.layers:
        layer.self_attn.v_proj.weight.add_(0.5)


@pytest.fixture(scope="module")
def old_model():
    return sharp_model()


@pytest.fixture(scope="module")
def new_model():
    model = sharp_model()
    update(model)
    return model


@pytest.fixture
def model():
    return sharp_model()


def started(manager: ContinuousBatchingManager, min_decode_tokens: int) -> None:
    engine = manager.engine
    wait_for(lambda: engine.counters.decode_tokens >= min_decode_tokens, what="requests decoding")


def finish(manager: ContinuousBatchingManager) -> None:
    manager.stop(timeout=TIMEOUT)
    manager.destroy()


def continues_under_new_weights(
    output: GenerationOutput, prompt: list[int], n: int, old_model, new_model
) -> None:
    """The tokens before the update equal `generate()` under the old weights, the rest `generate()` on
    prompt + those tokens under the new weights (recompute: nothing stale behind them)."""
    tokens = output.generated_tokens
    assert output.status == RequestStatus.FINISHED and len(tokens) == n, (output.status, output.error)
    runs = output.weight_version_runs
    assert runs in (((0, 0),), ((0, 1),)) or (len(runs) == 2 and runs[0] == (0, 0) and runs[1][1] == 1), runs
    changed = 0 if runs[0][1] == 1 else (output.weight_version_changed_at or n)
    assert tokens[:changed] == greedy_reference(old_model, prompt, n)[:changed]
    if changed < n:
        assert tokens[changed:] == greedy_reference(new_model, prompt + tokens[:changed], n - changed)
        assert output.kv_weight_version == 1


def test_a_request_after_the_update_reuses_no_kv_of_the_request_in_flight(model, old_model, new_model):
    """The issue's case: A (600 tokens) decoding across the update, B with the same prompt submitted after
    the block: B computes its prompt under the new weights (it hit 592 stale tokens before the fix)."""
    manager = new_manager(model, num_blocks=128)
    manager.start()
    a = manager.add_request(LONG, max_new_tokens=40)
    started(manager, 3)
    with manager.pause():
        tokens_before = len(manager.engine.running_requests()[0].generated_ids)
        update(model)
    b = manager.add_request(LONG, max_new_tokens=10)
    results = collect(manager, [a, b])
    assert results[b].generated_tokens == greedy_reference(new_model, LONG, 10)
    assert manager.stats().prefix_cache_hit_tokens == 0
    assert manager.weight_version == manager.stats().weight_version == 1
    assert results[b].weight_version_runs == ((0, 1),) and results[b].kv_weight_version == 1
    # keep (the default): A went on on its KV; its tokens say which weights produced them.
    out_a = results[a]
    assert out_a.generated_tokens[:tokens_before] == greedy_reference(old_model, LONG, tokens_before)
    assert out_a.weight_version_runs == ((0, 0), (tokens_before, 1))
    assert (out_a.weight_version_first, out_a.weight_version_last) == (0, 1)
    assert out_a.weight_version_changed_at == tokens_before and out_a.kv_weight_version == 0
    finish(manager)


def test_a_hundred_requests_sharing_a_system_prompt_recompute_across_the_update(model, old_model, new_model):
    """100 requests in flight share a system prompt's pages; `recompute` drops their KV: every token after
    the update equals `generate()` on prompt + tokens so far under the new weights (none reads the shared
    pages computed before), and requests submitted after it equal `generate()` under the new weights."""
    manager = new_manager(model, num_blocks=512, max_batch_tokens=512, max_requests_per_batch=128)
    prompts = [SYSTEM + suffix for suffix in SUFFIXES]
    manager.start()
    ids = manager.add_requests(prompts, max_new_tokens=12)
    started(manager, 150)
    with manager.pause(mode="recompute"):
        in_flight = manager.engine.running_requests()
        assert len(in_flight) > 50
        update(model)
    later = manager.add_requests(prompts[:10], max_new_tokens=6)
    results = collect(manager, ids + later)
    for rid, prompt in zip(ids, prompts, strict=True):
        continues_under_new_weights(results[rid], prompt, 12, old_model, new_model)
    assert sum(results[rid].weight_version_changed_at is not None for rid in ids) > 20
    for rid, prompt in zip(later, prompts[:10], strict=True):
        assert results[rid].generated_tokens == greedy_reference(new_model, prompt, 6)
    finish(manager)


def test_keep_serves_no_stale_prefix_to_requests_after_the_update(model, new_model):
    """`keep`: the requests in flight go on on their KV, but the system prompt's pages they hold are no
    longer keyed: 20 requests submitted after the update equal `generate()` under the new weights."""
    manager = new_manager(model, num_blocks=512, max_batch_tokens=512, max_requests_per_batch=128)
    prompts = [SYSTEM + suffix for suffix in SUFFIXES]
    manager.start()
    ids = manager.add_requests(prompts, max_new_tokens=24)
    started(manager, 150)
    with manager.pause(mode="keep"):
        counts = {r.request_id: len(r.generated_ids) for r in manager.engine.running_requests()}
        update(model)
    later = manager.add_requests([SYSTEM + s for s in prompts_of_lengths([5] * 20, seed=6)], max_new_tokens=6)
    results = collect(manager, ids + later)
    for rid, suffix in zip(later, prompts_of_lengths([5] * 20, seed=6), strict=True):
        assert results[rid].generated_tokens == greedy_reference(new_model, SYSTEM + suffix, 6)
        assert results[rid].weight_version_runs == ((0, 1),)
    for rid, count in counts.items():
        if count:
            assert results[rid].weight_version_changed_at == count
            assert results[rid].kv_weight_version == 0
    finish(manager)


def test_abort_ends_the_requests_in_flight_at_once(model, old_model, new_model):
    manager = new_manager(model, num_blocks=256, max_requests_per_batch=4)
    prompts = [SYSTEM + suffix for suffix in SUFFIXES[:8]]
    manager.start()
    ids = manager.add_requests(prompts, max_new_tokens=30)
    started(manager, 6)
    with manager.pause(mode="abort"):
        in_flight = {r.request_id for r in manager.engine.running_requests()}
        update(model)
    results = collect(manager, ids)
    aborted = {rid for rid, out in results.items() if out.status == RequestStatus.ABORTED}
    assert aborted == in_flight and 0 < len(aborted) < len(ids)
    for rid, prompt in zip(ids, prompts, strict=True):
        out = results[rid]
        if rid in aborted:
            assert out.finish_reason == "aborted" and "weight version 1" in out.error
            n = len(out.generated_tokens)
            assert out.generated_tokens == greedy_reference(old_model, prompt, 30)[:n]
            assert out.weight_version_last in (None, 0)
        else:
            assert out.status == RequestStatus.FINISHED
            continues_under_new_weights(out, prompt, 30, old_model, new_model)
    stats = manager.stats()
    assert stats.aborted == len(aborted) and stats.finished == len(ids) - len(aborted)
    finish(manager)


def test_max_staleness_recomputes_a_request_that_would_lag(model, old_model, new_model):
    manager = new_manager(model, num_blocks=128)
    prompt_a, prompt_b = SYSTEM + SUFFIXES[0], SYSTEM + SUFFIXES[1]
    manager.start()
    strict = manager.add_request(prompt_a, max_new_tokens=30, max_staleness=0)
    lenient = manager.add_request(prompt_b, max_new_tokens=30, max_staleness=1)
    started(manager, 4)
    with manager.pause():
        update(model)
    results = collect(manager, [strict, lenient])
    continues_under_new_weights(results[strict], prompt_a, 30, old_model, new_model)
    assert results[strict].weight_version_changed_at is not None
    assert results[lenient].kv_weight_version == 0 and results[lenient].weight_version_last == 1
    finish(manager)


def test_weights_updated_covers_writes_no_version_counter_sees(model, new_model):
    """A write through `.data` bumps no version counter: the fingerprint sees it by the sampled values when it
    moves the whole tensor (memory/weight_key.py), and `weights_updated()` says it in every case: the request
    after it equals `generate()` under the new weights."""
    manager = new_manager(model, num_blocks=128)
    manager.start()
    a = manager.add_request(LONG, max_new_tokens=40)
    started(manager, 3)
    versions = [layer.self_attn.v_proj.weight._version for layer in model.model.layers]
    with manager.pause(), torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.data.add_(0.5)
    assert [layer.self_attn.v_proj.weight._version for layer in model.model.layers] == versions
    assert manager.weight_version == 1  # seen: the sampled values moved, no version counter did
    with manager.pause():
        manager.weights_updated()
    b = manager.add_request(LONG, max_new_tokens=10)
    results = collect(manager, [a, b])
    assert results[b].generated_tokens == greedy_reference(new_model, LONG, 10)
    assert manager.weight_version == 2
    manager.weights_updated(mode="recompute")  # outside a pause: a pause of its own
    assert manager.weight_version == manager.stats().weight_version == 3
    finish(manager)


def test_bad_input_is_a_value_error_at_the_call(model):
    manager = new_manager(model)
    manager.start()
    with pytest.raises(ValueError, match="mode must be one of 'keep', 'recompute', 'abort'"):
        manager.pause(mode="later")  # at the call, not at the `with`
    with pytest.raises(ValueError, match="mode must be one of"):
        manager.weights_updated(mode="soon")
    for bad in (-1, "1", 1.5, True):
        with pytest.raises(ValueError, match="max_staleness"):
            manager.add_request([5, 6, 7], max_new_tokens=2, max_staleness=bad)
    with pytest.raises(ValueError, match=r"inputs\[0\].*max_staleness must be >= 0"):
        manager.add_requests([[5, 6, 7]], max_new_tokens=2, max_staleness=-2)
    assert manager.is_running() and manager.weight_version == 0
    rid = manager.add_request([5, 6, 7], max_new_tokens=2, max_staleness=0)
    assert manager.get_result(rid, timeout=TIMEOUT).status == RequestStatus.FINISHED
    finish(manager)


def test_a_pause_on_a_manager_not_running_applies_its_update_at_once(model, new_model):
    manager = new_manager(model, num_blocks=128)
    with manager.pause():
        update(model)
    assert manager.weight_version == 1
    manager.start()
    started_at = time.monotonic()
    rid = manager.add_request(LONG, max_new_tokens=5)
    out = manager.get_result(rid, timeout=TIMEOUT)
    assert out.generated_tokens == greedy_reference(new_model, LONG, 5)
    assert out.weight_version_runs == ((0, 1),) and time.monotonic() - started_at < TIMEOUT
    finish(manager)


def test_a_failing_weight_check_fails_the_running_requests_and_the_thread_lives(model, monkeypatch):
    manager = new_manager(model, num_blocks=128)
    manager.start()
    rid = manager.add_request(SYSTEM, max_new_tokens=200)
    started(manager, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("fingerprint exploded")

    monkeypatch.setattr(manager.engine, "check_weights", broken)
    with manager.pause():
        pass
    output = manager.get_result(rid, timeout=TIMEOUT)
    assert output.status == RequestStatus.FAILED and "fingerprint exploded" in output.error
    with manager.pause():
        assert manager.stats().prefix_cache_pages == 0  # none of its pages is kept for later hits
    monkeypatch.undo()
    assert manager.is_running() and manager.background_thread_status.fatal_error is None
    rid = manager.add_request(SYSTEM, max_new_tokens=3)
    assert manager.get_result(rid, timeout=TIMEOUT).status == RequestStatus.FINISHED
    finish(manager)
