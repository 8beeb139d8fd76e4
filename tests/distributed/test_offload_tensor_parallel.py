"""CPU offload under tensor parallelism: two gloo ranks on CPU, a cache of about a quarter of the work.

Rank 0 plans the swaps with the rest of each step; its step message carries them and rank 1's runner
replays them on its own KV shard (docs/parallelism.md). Tokens equal `generate()` on every rank, every
rank's runner moved pages both ways (as many as rank 0 planned), and nothing was recomputed.
"""

from __future__ import annotations

from tests.helpers import greedy_reference
from tests.test_tensor_parallel import _save_llama, run_ranks
from tests.tp_worker import MAX_NEW, PROMPTS


def test_offload_swaps_on_every_rank_and_matches_generate(tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = _save_llama(tmp_path / "llama4kv", 4, 4, 64)
    records = run_ranks("offload", model_dir, tmp_path)
    assert set(records) == {0, 1}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = records[0]["outputs"]
    assert list(outputs) == [f"req_{i}" for i in range(len(PROMPTS))]
    for i, prompt in enumerate(PROMPTS):
        out = outputs[f"req_{i}"]
        assert out["error"] is None and out["status"] == 3, i
        assert out["tokens"] == greedy_reference(model, prompt, MAX_NEW), i
    assert records[1]["outputs"] == outputs
    driver = records[0]
    assert driver["preemptions"] > 0 and driver["recomputed"] == 0, driver
    for rank, record in records.items():
        assert record["host_pages"] == driver["host_pages"], rank  # agreed across ranks
        assert record["pages_out"] == driver["planned_out"] > 0, (rank, record)
        assert record["pages_in"] == record["pages_out"], (rank, record)
