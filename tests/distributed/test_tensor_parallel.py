"""Tensor parallelism on CPU: two ranks over gloo, a tiny Llama with 4 KV heads (2 per rank).

Each scenario runs `tests/support/tp_worker.py` in two processes (forked from a zygote per rank that made
the worker's imports) with the environment torchrun sets (not torchrun itself: its agent kills the surviving rank as soon as one dies, which the failure
tests need to observe). The documents' torchrun example is in conformance/test_seed_documents.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from tests.support.models import tiny_llama
from tests.support.paths import REPO_ROOT, TP_WORKER
from tests.support.reference import greedy_reference
from tests.support.timeouts import hang_guard
from tests.support.tp_worker import FAILURE_TIMEOUT_S, MAX_NEW, PROMPTS, guided_config
from tests.support.zygote import Zygotes, process_env
from transformers_cb.distributed.sharding import DEVICE_MAP_REASON, kv_heads_per_shard, shard_shape
from transformers_cb.memory.sizing import ModelShape

RANK_TIMEOUT_S = hang_guard(240)
TIMEOUT_TEXT = f"cpu_group_timeout={FAILURE_TIMEOUT_S:g} s"


def _save_llama(path: Path, num_key_value_heads: int, num_attention_heads: int, hidden_size: int) -> str:
    model = tiny_llama(
        None,
        num_key_value_heads=num_key_value_heads,
        num_attention_heads=num_attention_heads,
        hidden_size=hidden_size,
    )
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _save_llama(tmp_path_factory.mktemp("tp") / "llama4kv", 4, 4, 64)


@pytest.fixture(scope="module")
def reference(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return lambda prompt, max_new: greedy_reference(model, prompt, max_new)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# One zygote per rank (tests/support/zygote.py: the worker's imports made once per test process, each rank a
# forked child with torchrun's variables added to its environment), so the two ranks run at once.
_zygotes = Zygotes()
_close_zygotes = _zygotes.closed_after_module()


def _rank_env() -> dict[str, str]:
    pythonpath = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return process_env(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)


def run_ranks(
    scenario: str, model_dir: str, out_dir: Path, world_size: int = 2, kill_others: bool = False
) -> dict[int, dict]:
    """Run one scenario on `world_size` ranks; return each rank's JSON record (rank 0's must exist).

    With `kill_others` (a SIGSTOPped rank), the other ranks are killed once rank 0 is done."""
    port = _free_port()
    ranks = []
    for rank in range(world_size):
        env = {
            **_rank_env(),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        args = (scenario, model_dir, str(out_dir))
        output = out_dir / f"rank{rank}_{scenario}"
        zygote = _zygotes.get(rank, "import tests.support.tp_worker", _rank_env())
        ranks.append(zygote.start(TP_WORKER, env, Path.cwd(), args, merged=True, output=output))
    try:
        if ranks[0].wait(RANK_TIMEOUT_S) is None:
            for child in ranks:
                child.kill()
            output = "\n".join(f"--- rank {r}:\n{c.stdout()[-4000:]}" for r, c in enumerate(ranks))
            raise AssertionError(
                f"rank 0 of {scenario!r} did not finish within {RANK_TIMEOUT_S:g} s:\n{output}"
            ) from None
        for child in ranks[1:]:
            if kill_others or child.wait(hang_guard(30)) is None:
                child.kill()
    finally:
        for child in ranks:
            child.kill()
    logs = "".join(child.stdout() for child in ranks)
    records = {}
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            records[rank] = json.loads(path.read_text())
    assert records, f"no rank wrote a result:\n{logs[-6000:]}"
    return records


@pytest.mark.slow  # two rank processes
def test_generate_batch_matches_generate_on_every_rank(model_dir, reference, tmp_path) -> None:
    records = run_ranks("generate_batch", model_dir, tmp_path)
    assert set(records) == {0, 1}
    greedy = records[0]["greedy"]
    assert list(greedy) == [f"req_{i}" for i in range(len(PROMPTS))]
    for i, prompt in enumerate(PROMPTS):
        out = greedy[f"req_{i}"]
        assert out["error"] is None and out["status"] == 3
        assert out["tokens"] == reference(prompt, MAX_NEW), i
    forks = records[0]["forks"]
    assert list(forks) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1"]
    for name, prompt in [("req_0", PROMPTS[1]), ("req_1", PROMPTS[1] + [3])]:
        assert forks[name]["tokens"] == forks[f"{name}__child#0"]["tokens"] == reference(prompt, MAX_NEW)
    # Same dict on every rank, for greedy and for seeded sampling (tokens are sampled on rank 0 only).
    assert records[1] == records[0]
    assert all(len(out["tokens"]) == MAX_NEW for out in records[0]["sampled"].values())


@pytest.mark.slow  # two rank processes
def test_manager_streams_cancels_and_matches_generate(model_dir, reference, tmp_path) -> None:
    """Rank 0 also idles past `cpu_group_timeout` before submitting: the follower must not time out."""
    records = run_ranks("manager", model_dir, tmp_path)
    rank0 = records[0]
    finals = rank0["finals"]
    for i in range(3):
        assert finals[f"req_{i}"]["status"] == 3
        assert finals[f"req_{i}"]["tokens"] == reference(PROMPTS[i], MAX_NEW), i
    expected_stream = reference(PROMPTS[3], MAX_NEW)
    assert rank0["stream"][-1] == expected_stream
    assert rank0["stream"] == [expected_stream[: n + 1] for n in range(len(expected_stream))]
    cancelled = finals["cancel"]
    assert cancelled["status"] == 5  # CANCELLED, with a prefix of what generate() produces
    assert cancelled["tokens"] == reference(PROMPTS[4], len(cancelled["tokens"]))
    # The follower refuses submissions with a message naming its role, and its stop() returned.
    assert "submit requests on rank 0" in records[1]["follower_submit_error"]


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("scenario", ["kill", "hang"])
def test_lost_rank_fails_rank_0_with_the_timeout_and_one_result_each(scenario, model_dir, tmp_path) -> None:
    """kill: rank 1 is SIGKILLed (rank 0 sees the connection drop); hang: rank 1 is SIGSTOPped in the
    middle of a step, so rank 0 waits in the forward's all-reduce until `cpu_group_timeout` (`FAILURE_TIMEOUT_S`)."""
    rank0 = run_ranks(scenario, model_dir, tmp_path, kill_others=scenario == "hang")[0]
    assert "ManagerDeadError" in rank0["error"] and "TensorParallelError" in rank0["error"]
    assert TIMEOUT_TEXT in rank0["error"]
    if scenario == "hang":
        # gloo's own message: the wait ended because the timeout fired, not because a peer vanished.
        assert (
            "running a step's forward" in rank0["error"]
            and f"Timed out waiting {int(FAILURE_TIMEOUT_S * 1000)}ms" in rank0["error"]
        )
    finals = rank0["finals"]
    assert sorted(finals) == [f"req_{i}" for i in range(len(PROMPTS))]
    assert all(len(results) == 1 for results in finals.values()), finals  # exactly one final result each
    failed = [results[0] for results in finals.values() if results[0]["status"] == 4]
    assert failed, "no request was running when the rank was lost"
    assert all(TIMEOUT_TEXT in result["error"] for result in failed)


@pytest.mark.slow  # two rank processes
def test_lost_driver_fails_the_follower_with_the_timeout(model_dir, tmp_path) -> None:
    records = run_ranks("kill_driver", model_dir, tmp_path)
    assert 0 not in records  # rank 0 was killed before it could answer
    error = records[1]["error"]
    assert error is not None and TIMEOUT_TEXT in error and "rank 1 failed" in error


@pytest.mark.slow  # two rank processes
def test_tp_size_not_dividing_kv_heads_raises_at_start(tmp_path) -> None:
    model_dir = _save_llama(tmp_path / "llama3kv", 3, 6, 96)
    records = run_ranks("bad_heads", model_dir, tmp_path)
    for rank in (0, 1):
        error = records[rank]["error"]
        assert error is not None, rank
        assert "tp_size=2" in error and "num_key_value_heads=3" in error and "[1, 3]" in error


def test_kv_heads_per_shard() -> None:
    assert kv_heads_per_shard(8, 4) == 2
    assert kv_heads_per_shard(4, 1) == 4
    with pytest.raises(
        ValueError, match=r"tp_size=3 does not divide .*num_key_value_heads=8.*\[1, 2, 4, 8\]"
    ):
        kv_heads_per_shard(8, 3)


def _shape(num_kv_heads: int) -> ModelShape:
    return ModelShape(2, num_kv_heads, 16, 64, 128, 300, 512)


def test_shard_shape_splits_only_sharded_kv_projections() -> None:
    sharded = SimpleNamespace(
        tp_plan={"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise"}
    )
    assert shard_shape(sharded, _shape(4), 2).num_kv_heads == 2
    assert shard_shape(sharded, _shape(4), 1).num_kv_heads == 4
    replicated = SimpleNamespace(tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    assert shard_shape(replicated, _shape(3), 2).num_kv_heads == 3  # KV not split: no divisibility needed


def test_shard_shape_refuses_per_layer_head_shapes_with_sharded_kv() -> None:
    """Per-layer head shapes (Gemma 4) under sharded KV heads are refused with the reason; replicated KV
    heads, or one rank, need no split."""
    shape = dataclasses.replace(_shape(2), layer_head_shapes=((2, 16), (1, 32)))
    sharded = SimpleNamespace(
        tp_plan={"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise"}
    )
    with pytest.raises(NotImplementedError, match=r"tp_size=2.*differ in KV head shape.*\(1, 32\)"):
        shard_shape(sharded, shape, 2)
    assert shard_shape(sharded, shape, 1) is shape
    replicated = SimpleNamespace(tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    assert shard_shape(replicated, shape, 2) is shape


def test_device_map_with_distributed_config_is_refused(model_dir) -> None:
    # transformers refuses it at load, before any process group exists ...
    with pytest.raises(ValueError, match="mutually exclusive"):
        AutoModelForCausalLM.from_pretrained(
            model_dir, device_map="cpu", distributed_config=DistributedConfig(tp_size=2)
        )
    # ... and the engine refuses a sharded model that was dispatched with a device map anyway.
    dispatched = SimpleNamespace(tp_plan={}, hf_device_map={"": "cpu"})
    with pytest.raises(ValueError, match="device_map together with distributed_config") as error:
        shard_shape(dispatched, _shape(4), 2)
    assert DEVICE_MAP_REASON in str(error.value)


@pytest.mark.slow  # two rank processes
def test_offload_swaps_on_every_rank_and_matches_generate(tmp_path) -> None:
    """CPU offload under tensor parallelism, a cache of about a quarter of the work: rank 0 plans the swaps
    with the rest of each step, its step message carries them and rank 1's runner replays them on its own KV
    shard. Tokens equal `generate()` on every rank, every rank moved pages both ways (as many as rank 0
    planned), and nothing was recomputed."""
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


@pytest.mark.slow  # two rank processes
def test_an_int8_kv_cache_under_tensor_parallelism_with_offload(tmp_path) -> None:
    """Each rank holds its KV heads' shard in int8 pages with their scales, swaps both with the pages, and
    every rank returns rank 0's tokens: those of `generate()` attending int8-rounded K/V, but for a
    rounding-boundary flip (each shard's K/V come out of a product of its own shape)."""
    from tests.support.int8_reference import int8_reference_model

    model_dir = _save_llama(tmp_path / "llama4kv", 4, 4, 64)
    records = run_ranks("offload_int8", model_dir, tmp_path)
    assert set(records) == {0, 1} and records[1]["outputs"] == records[0]["outputs"]
    for rank, record in records.items():
        assert record["kv_dtype"] == "torch.int8" and record["host_scales"] == 1, (rank, record)
        assert record["pages_in"] == record["pages_out"] == records[0]["planned_out"] > 0, (rank, record)
    assert records[0]["preemptions"] > 0 and records[0]["recomputed"] == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rounded = int8_reference_model(model)
    outputs = records[0]["outputs"]
    same = sum(
        outputs[f"req_{i}"]["tokens"] == greedy_reference(rounded, prompt, MAX_NEW)
        for i, prompt in enumerate(PROMPTS)
    )
    assert same >= len(PROMPTS) - 1, (same, outputs)


@pytest.mark.slow  # two rank processes
def test_guided_decoding_under_tensor_parallelism(model_dir, tmp_path) -> None:
    """Masks are computed on rank 0, which samples; both ranks return what one process returns, preempted."""
    pytest.importorskip("llguidance")
    from transformers_cb.models.tiny import build_tiny_tokenizer

    records = run_ranks("guided", model_dir, tmp_path)
    assert set(records) == {0, 1}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy, tight, kwargs = guided_config()
    alone = model.generate_batch(
        PROMPTS, greedy, tight, progress_bar=False, tokenizer=build_tiny_tokenizer(), **kwargs
    )
    assert records[0] == records[1]
    assert {rid: out["tokens"] for rid, out in records[0].items()} == {
        rid: out.generated_tokens for rid, out in alone.items()
    }
    tokenizer = build_tiny_tokenizer()
    for i in (0, 3):
        json.loads(tokenizer.decode(records[0][f"req_{i}"]["tokens"], skip_special_tokens=True))


def test_the_process_groups_are_destroyed_at_exit(tmp_path) -> None:
    """The guide's torchrun script never calls `destroy_process_group()`; rank 0 sometimes aborted at exit
    (gloo threads outliving the interpreter, CI's `test_tensor_parallel_block`). The first CPU group
    registers `destroy_groups_at_exit`, which runs before the hooks registered earlier (atexit runs the last
    registered first) and leaves nothing initialized: here a world of one, in a fresh process that exits
    without destroying anything itself."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "from transformers_cb.distributed import cpu_group\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "atexit.register(lambda: print('at exit:', dist.is_initialized(), cpu_group._GROUPS))\n"
        "group = cpu_group.CpuGroup([0], timeout=30.0)\n"
        "assert group.exchange({'step': 1}) == {'step': 1}\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=RANK_TIMEOUT_S, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at exit: False {}" in done.stdout, done.stdout
