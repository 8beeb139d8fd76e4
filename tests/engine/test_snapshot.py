"""`Engine.snapshot()`: every count `manager.stats()` needs, in one object, copied at the call."""

from __future__ import annotations

from transformers import GenerationConfig

from tests.support.models import tiny_llama
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.selection import paged_backend
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.engine.snapshot import EngineSnapshot


def test_snapshot_counts_pages_prefix_hits_preemptions_and_swaps() -> None:
    model = tiny_llama()
    config = ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=16, cpu_offload_space=1.0)
    engine = build_engine(model, GenerationConfig(max_new_tokens=8, do_sample=False), config)
    idle = EngineSnapshot(
        pages_total=engine.num_total_pages,
        pages_in_use_by_group={"full_attention": 0},
        kv_bytes_per_token=engine.settings.cache.layout.page_bytes()
        // engine.settings.cache.layout.page_size,
    )
    assert engine.snapshot() == idle
    prefix = prompts_of_lengths([12], seed=3)[0]
    for i, suffix in enumerate(prompts_of_lengths([6, 9, 4, 7], seed=4)):
        engine.add(engine.build_request(Submission(prefix + suffix, f"r{i}", max_new_tokens=8)))
    seen_running = False
    with paged_backend(model, "paged|sdpa"):
        while engine.has_work():
            engine.step()
            snapshot = engine.snapshot()
            assert snapshot.running == len(engine.scheduler.running)
            assert snapshot.pages_in_use == engine.num_used_pages > 0 or not snapshot.running
            seen_running |= snapshot.running > 0
    snapshot = engine.snapshot()
    assert seen_running and snapshot.running == snapshot.waiting == snapshot.swapped_out == 0
    assert snapshot.preemptions == engine.scheduler.num_preemptions > 0
    assert snapshot.swap_out_pages == snapshot.swap_in_pages == engine.offload.swap_out_pages > 0
    assert snapshot.recomputed_tokens == 0
    assert snapshot.prefix.hit_tokens == engine.scheduler.pages.prefix_stats.hit_tokens > 0
    assert snapshot.counters.generated_tokens == 4 * 8
    engine.counters.generated_tokens += 1  # a copy, not a view
    assert snapshot.counters.generated_tokens == 4 * 8
