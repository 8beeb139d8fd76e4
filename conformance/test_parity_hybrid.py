"""Greedy parity on linear-attention and state-space models (issue 32): `generate_batch` and the manager
equal `generate()` token for token.

Families: the hand-written tiny configs of tests/support/hybrids.py (hybrids mix attention and state
layers; Mamba, Mamba 2, Falcon-Mamba, RWKV and xLSTM have no attention layer at all: no KV group, their
requests hold no pages), the model-owned recurrences (MiniMax, RecurrentGemma, RWKV, xLSTM: issue 41,
runner/states/own_state.py) among them. Every run has prompts longer than the step's token budget (prefill chunks continue a state),
a one-token prompt, mixed prefill + decode steps (checked on the steps' state tables), and the engine's
integrity check (pages and state slots) after every step. Hybrids run in a cache small enough to preempt;
every family is also preempted on purpose in the middle of its decode (a pure state-space model never
runs out of pages), which recomputes the state. Forks (`num_return_sequences`), streaming through the
manager and bfloat16 (tie-aware) follow. Families that cannot run exactly are refused up front.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from transformers import PreTrainedModel

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from tests.support.hybrids import HYBRIDS, build_hybrid
from tests.support.preemptions import count_preemptions
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.engine.engine import Engine
from transformers_cb.invariants import present
from transformers_cb.memory import state_cache
from transformers_cb.memory.state_cache import StateCache
from transformers_cb.runner import model_runner, packing
from transformers_cb.scheduler.scheduler import Scheduler

# model type -> a phrase of the refusal's reason.
REFUSED = {"zamba2": "shared attention block"}
EXACT = tuple(name for name in HYBRIDS if name not in REFUSED)
# No attention layer: zero KV groups.
PURE_STATE = ("mamba2", "mamba", "falcon_mamba", "rwkv", "xlstm")

MAX_NEW_TOKENS = 10
PAGE_SIZE = 4
BUDGET = 16
SLOTS = 3  # pure state-space models: state slots (one per request that may run at once)
PROMPT_LENGTHS = (37, 9, 21, 1, 5)  # 37, 21 > BUDGET: chunked; 1: a fresh one-token prompt


@dataclass
class Family:
    name: str
    model: PreTrainedModel
    prompts: list[list[int]]
    references: ReferenceCache

    def expected(self) -> list[list[int]]:
        return [self.references.get(p) for p in self.prompts]


@pytest.fixture(scope="module")
def _families() -> dict[str, Family]:
    return {}


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


def _family(name: str, cache: dict[str, Family]) -> Family:
    if name not in cache:
        model = build_hybrid(name)
        cache[name] = Family(name, model, _prompts(), ReferenceCache(model, MAX_NEW_TOKENS))
    return cache[name]


@dataclass
class Observed:
    """What the steps of a run did: the engines, their state tables, the most requests running at once."""

    engines: list[Engine] = field(default_factory=list)
    tables: list[packing.StateTable] = field(default_factory=list)
    max_running: int = 0

    @property
    def mixed(self) -> bool:
        """A step ran decode rows beside a prefill chunk."""
        return any(t.num_decode_rows and t.spans for t in self.tables)

    @property
    def continued(self) -> bool:
        """A prefill chunk continued a request's state (not its first chunk)."""
        return any(not fresh and count > 1 for t in self.tables for _, count, _, fresh in t.spans)


@contextmanager
def observed() -> Iterator[Observed]:
    """Record every step's state table and run `Engine.check_integrity()` (pages and state slots) after
    every step."""
    seen = Observed()
    original_step, original_table = Engine.step, packing.state_table

    def step(self):
        seen.max_running = max(seen.max_running, len(self.scheduler.running))
        result = original_step(self)
        self.check_integrity()
        if self not in seen.engines:
            seen.engines.append(self)
        return result

    def state_table(ordered, device):
        table = original_table(ordered, device)
        seen.tables.append(table)
        return table

    with mock.patch.object(Engine, "step", step), mock.patch.object(packing, "state_table", state_table):
        yield seen


@contextmanager
def preempt_while_decoding(after_tokens: int = 3) -> Iterator[list[str]]:
    """Preempt each request once, when it has generated `after_tokens` tokens (its KV, if any, and its
    state slot are dropped: it recomputes prompt + generated tokens)."""
    victims: list[str] = []
    original = Scheduler._keep_running

    def keep_running(self, request, budget, scheduled, plan, *args):
        if len(request.generated_ids) >= after_tokens and request.request_id not in victims:
            victims.append(request.request_id)
            self.preempt(request, plan)
            return None
        return original(self, request, budget, scheduled, plan, *args)

    with mock.patch.object(Scheduler, "_keep_running", keep_running):
        yield victims


def _check_steps(family: Family, seen: Observed, context: str) -> None:
    assert seen.tables, f"{context}: no step carried a state table"
    assert seen.continued, f"{context}: no prefill chunk continued a state"
    assert seen.mixed, f"{context}: no step mixed decode rows with a prefill chunk"
    (engine,) = seen.engines
    assert (not engine.settings.cache.kv_groups) == (family.name in PURE_STATE), context
    assert present(engine.pages.slots).num_in_use == 0, f"{context}: state slots still held"


@pytest.mark.parametrize("name", EXACT)
def test_hybrid_parity_chunked_under_pressure(_families, name: str) -> None:
    """Chunked prefill across the state, mixed steps, and pressure: a cache just big enough for the
    largest request (hybrids: requests are preempted and recompute their KV and state), or three state
    slots (pure state-space models: requests wait for a slot)."""
    family = _family(name, _families)
    pressure = (
        {"max_requests_per_batch": SLOTS}
        if name in PURE_STATE
        else {"num_blocks": tight_num_blocks(family.prompts, MAX_NEW_TOKENS, PAGE_SIZE)}
    )
    context = f"{name} / page_size={PAGE_SIZE}, max_batch_tokens={BUDGET}, {pressure}"
    with observed() as seen:
        outputs, preemptions = run_batch(
            family.model,
            family.prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=PAGE_SIZE,
            max_batch_tokens=BUDGET,
            **pressure,
        )
    _check_steps(family, seen, context)
    if name in PURE_STATE:
        (engine,) = seen.engines
        assert present(engine.pages.slots).num_slots == SLOTS, context
        assert seen.max_running == SLOTS, f"{context}: the slots did not bound the running requests"
    else:
        assert preemptions, f"{context}: nothing was preempted; the test does not exercise recompute"
    check_parity(family.model, family.prompts, outputs, family.expected(), context)


@pytest.mark.parametrize("name", EXACT)
def test_hybrid_parity_preempted_while_decoding(_families, name: str) -> None:
    """Every request is preempted once mid-decode: its state is dropped with its slot and recomputed
    from prompt + generated tokens (chunked), and it still equals `generate()`."""
    family = _family(name, _families)
    context = f"{name} / preempted after 3 tokens"
    with observed() as seen, preempt_while_decoding() as victims, count_preemptions() as preemptions:
        outputs, _ = run_batch(
            family.model,
            family.prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=PAGE_SIZE,
            max_batch_tokens=BUDGET,
        )
    assert sorted(victims) == sorted(f"req_{i}" for i in range(len(family.prompts))), context
    assert len(preemptions) == len(family.prompts), context
    _check_steps(family, seen, context)
    check_parity(family.model, family.prompts, outputs, family.expected(), context)


@pytest.mark.parametrize("name", EXACT)
def test_hybrid_parity_swapped_to_the_host_tier(_families, name: str) -> None:
    """With `cpu_offload_space`, every request preempted mid-decode swaps its pages and its state slot
    out and back in (no recompute), and still equals `generate()`; a pure state-space model has no
    page to swap and recomputes."""
    family = _family(name, _families)
    context = f"{name} / preempted after 3 tokens, cpu_offload_space"
    swapped: list[tuple[list, list]] = []
    original = state_cache.swap_states

    def counted(device, host, out, back):
        swapped.append((list(out), list(back)))
        return original(device, host, out, back)

    with (
        observed() as seen,
        preempt_while_decoding() as victims,
        mock.patch.object(model_runner, "swap_states", counted),
    ):
        outputs, _ = run_batch(
            family.model,
            family.prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=PAGE_SIZE,
            max_batch_tokens=BUDGET,
            cpu_offload_space=0.05,
        )
    assert sorted(victims) == sorted(f"req_{i}" for i in range(len(family.prompts))), context
    (engine,) = seen.engines
    outs = sum(len(out) for out, _ in swapped)
    backs = sum(len(back) for _, back in swapped)
    if name in PURE_STATE:
        assert outs == backs == 0, context
        assert engine.snapshot().recomputed_tokens > 0, context
    else:
        # Requests that had computed something swap out; each comes back once.
        assert outs == backs == len(family.prompts), f"{context}: {swapped}"
        assert engine.snapshot().swap_in_pages > 0, context
        assert present(engine.offload).host.slots.num_in_use == 0, context
    check_parity(family.model, family.prompts, outputs, family.expected(), context)


@pytest.mark.parametrize("name", EXACT)
def test_hybrid_forks_equal_generate(_families, name: str) -> None:
    """`num_return_sequences=2`: once the parent computed its prompt but the last token, each sibling
    gets copies of its pages and state slot (a one-token prompt's sibling runs on its own) and, greedy,
    equals `generate()`."""
    family = _family(name, _families)
    copied: list[tuple[int, int]] = []
    copy_slots = StateCache.copy_slots

    def counted(self, copies):
        copied.extend(copies)
        return copy_slots(self, copies)

    with observed(), mock.patch.object(StateCache, "copy_slots", counted):
        outputs = family.model.generate_batch(
            family.prompts,
            greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=ContinuousBatchingConfig(page_size=PAGE_SIZE, max_batch_tokens=BUDGET),
            num_return_sequences=2,
            progress_bar=False,
        )
    parents = {k: v for k, v in outputs.items() if "__child" not in k}
    check_parity(family.model, family.prompts, parents, family.expected(), f"{name} / forks")
    for i in range(len(family.prompts)):
        child = outputs[f"req_{i}__child#0"]
        assert child.status == RequestStatus.FINISHED, f"{name}: req_{i}__child#0 {child.error}"
        assert child.generated_tokens == outputs[f"req_{i}"].generated_tokens, f"{name}: req_{i}__child#0"
    assert len(copied) == sum(len(p) >= 2 for p in family.prompts), f"{name}: state forks {copied}"


STREAMED = ("qwen3_5", "mamba2", "jamba", "lfm2", "falcon_h1", "minimax", "recurrent_gemma", "rwkv", "xlstm")


@pytest.mark.parametrize("name", STREAMED)
def test_hybrid_manager_streaming(_families, name: str) -> None:
    """The manager, streaming every request (`request_id_iter`): one more token per chunk, the final
    tokens equal `generate()`; hybrids in a cache small enough to preempt."""
    family = _family(name, _families)
    config = {"page_size": PAGE_SIZE, "max_batch_tokens": BUDGET}
    if name not in PURE_STATE:
        config["num_blocks"] = tight_num_blocks(family.prompts, MAX_NEW_TOKENS, PAGE_SIZE)
    manager = family.model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(**config),
    )
    manager.start()
    try:
        ids = [f"s{i}" for i in range(len(family.prompts))]
        for rid, prompt in zip(ids, family.prompts, strict=True):
            manager.add_request(
                input_ids=prompt, request_id=rid, max_new_tokens=MAX_NEW_TOKENS, streaming=True
            )
        for rid, prompt in zip(ids, family.prompts, strict=True):
            lengths, final = [], None
            deadline = time.monotonic() + 60
            for chunk in manager.request_id_iter(request_id=rid):
                assert chunk.error is None, f"{name}: {rid}: {chunk.error}"
                lengths.append(len(chunk.generated_tokens))
                if chunk.status == RequestStatus.FINISHED:
                    final = chunk
                    break
                assert time.monotonic() < deadline, f"{name}: {rid} stalled"
            assert final is not None, f"{name}: {rid} never finished"
            assert len(lengths) > 1 and lengths == sorted(lengths), f"{name}: {rid} streamed {lengths}"
            assert final.generated_tokens == family.references.get(prompt), f"{name}: {rid}"
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()


BF16 = ("qwen3_5", "mamba", "bamba", "lfm2", "minimax", "recurrent_gemma", "rwkv", "xlstm")


@pytest.mark.parametrize("name", BF16)
def test_hybrid_bf16_parity_tie_aware(name: str) -> None:
    """bfloat16 (how checkpoints load), chunked and preempted: equal to `generate()` in bfloat16 except at
    genuine near-ties of its logits (checked tie-aware: the rest continues `generate()` from the tie)."""
    model = build_hybrid(name, dtype=torch.bfloat16)
    prompts = _prompts(seed=2)
    references = [greedy_reference(model, p, MAX_NEW_TOKENS) for p in prompts]
    pressure = (
        {} if name in PURE_STATE else {"num_blocks": tight_num_blocks(prompts, MAX_NEW_TOKENS, PAGE_SIZE)}
    )
    outputs, _ = run_batch(
        model,
        prompts,
        greedy_config(MAX_NEW_TOKENS),
        page_size=PAGE_SIZE,
        max_batch_tokens=BUDGET,
        **pressure,
    )
    check_parity(model, prompts, outputs, references, f"{name} bf16", MAX_NEW_TOKENS)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_hybrid_refused_up_front(name: str) -> None:
    """A family that cannot run exactly is refused before any request runs, naming its type and why."""
    model = build_hybrid(name)
    with pytest.raises(NotImplementedError, match=rf"model_type='{name}'.*{REFUSED[name]}"):
        model.generate_batch([[5, 6, 7]], greedy_config(2), progress_bar=False)


@pytest.mark.parametrize("name", ["qwen3_5", "mamba2"])
def test_a_request_that_can_never_fit_fails_cleanly(_families, name: str) -> None:
    """A hybrid's KV pages bound a request's length: one longer than the whole cache is refused up front
    with the reason. A pure state-space model holds no pages: the same request runs beside the others
    (its state is the same size at any length) and equals `generate()`."""
    family = _family(name, _families)
    huge = [7] * 60
    prompts = [*family.prompts[:2], huge]

    def run():
        return run_batch(
            family.model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=PAGE_SIZE,
            max_batch_tokens=BUDGET,
            num_blocks=12,
        )

    if name not in PURE_STATE:
        with pytest.raises(
            ValueError, match=r"inputs\[2\]: needs 18 KV pages of 4 tokens but the cache has only 12"
        ):
            run()
        return
    outputs, _ = run()
    references = [
        *(family.references.get(p) for p in prompts[:2]),
        greedy_reference(family.model, huge, MAX_NEW_TOKENS),
    ]
    check_parity(
        family.model, prompts, outputs, references, f"{name} / a request longer than num_blocks pages"
    )
