"""One rank of the tensor-parallel tests (run by `tests/distributed/test_tensor_parallel.py` under a launcher
that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT like torchrun does).

Usage: python tests/support/tp_worker.py SCENARIO MODEL_DIR OUT_DIR. Each rank writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DistributedConfig, GenerationConfig

import transformers_cb  # noqa: F401 - installs the plugin
from tests.support.timeouts import hang_guard
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.distributed.cpu_group import CpuGroup, TensorParallelError

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [41, 42], list(range(50, 61)), [70, 71, 72, 73]]
MAX_NEW = 12
# The CPU group's timeout in the scenarios. A lost rank must fail the others after it (the failure tests read
# it back in the errors), and a merely slow step must not: scaled like every hang guard of the suite.
IDLE_TIMEOUT_S = hang_guard(3.0)
FAILURE_TIMEOUT_S = hang_guard(4.0)


def load(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_size=2), dtype=torch.float32
    )


def outputs_json(outputs) -> dict:
    return {
        rid: {"tokens": out.generated_tokens, "status": int(out.status), "error": out.error}
        for rid, out in outputs.items()
    }


def generate_batch(model) -> dict:
    greedy = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    # Small pages, a small step budget and a tight cache: chunked prefill and preemption on every rank.
    tight = ContinuousBatchingConfig(page_size=4, num_blocks=14, max_batch_tokens=16)
    sampled = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, temperature=0.8, top_k=50)
    return {
        "greedy": outputs_json(model.generate_batch(PROMPTS, greedy, tight, progress_bar=False)),
        "sampled": outputs_json(
            model.generate_batch(
                PROMPTS, sampled, ContinuousBatchingConfig(page_size=8, seed=7), progress_bar=False
            )
        ),
        # Prefix hits (PROMPTS[1] twice) and forks, whose page copies every rank runs.
        "forks": outputs_json(
            model.generate_batch(
                [PROMPTS[1], PROMPTS[1] + [3]], greedy, tight, num_return_sequences=2, progress_bar=False
            )
        ),
    }


def manager(model) -> dict:
    greedy = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    # An idle rank 0 for longer than the timeout: its keep-alive messages hold the followers.
    config = ContinuousBatchingConfig(page_size=8, cpu_group_timeout=IDLE_TIMEOUT_S)
    manager = model.init_continuous_batching(greedy, config)
    manager.start()
    result: dict = {}
    if torch.distributed.get_rank() == 0:
        time.sleep(IDLE_TIMEOUT_S + 2)
        ids = manager.add_requests(PROMPTS[:3])
        stream_id = manager.add_request(PROMPTS[3], request_id="stream", streaming=True)
        cancel_id = manager.add_request(PROMPTS[4], request_id="cancel", max_new_tokens=500)
        partials = []
        for output in manager.request_id_iter(stream_id):
            partials.append(list(output.generated_tokens))
        manager.cancel_request(cancel_id)
        finals = {rid: manager.get_result(rid, timeout=hang_guard(60)) for rid in [*ids, cancel_id]}
        finals[stream_id] = None
        result = {
            "finals": {
                rid: {"tokens": out.generated_tokens, "status": int(out.status)}
                for rid, out in finals.items()
                if out is not None
            },
            "stream": partials,
        }
    else:
        try:
            manager.add_request(PROMPTS[0])
        except RuntimeError as error:
            result["follower_submit_error"] = str(error)
    manager.stop(block=True)
    return result


def dies(model) -> dict:
    """Rank 1 is SIGKILLed (`kill`) or SIGSTOPped (`hang`) after a few step messages; rank 0 must
    fail within the timeout with an error naming it, and give every request one final result."""
    scenario = sys.argv[1]
    rank = torch.distributed.get_rank()
    if rank == 1:
        exchange, calls = CpuGroup.exchange, [0]

        def exchange_then_die(self, message=None):
            # kill: before the 6th exchange, so rank 0 waits in the CPU group's collective.
            # hang: after the 4th step with work arrived, so rank 0 waits in the forward's all-reduce.
            if scenario == "kill":
                calls[0] += 1
                if calls[0] == 6:
                    os.kill(os.getpid(), signal.SIGKILL)
                return exchange(self, message)
            message = exchange(self, message)
            calls[0] += bool(message.entries)
            if calls[0] == 4:
                os.kill(os.getpid(), signal.SIGSTOP)
            return message

        CpuGroup.exchange = exchange_then_die
    config = ContinuousBatchingConfig(page_size=8, cpu_group_timeout=FAILURE_TIMEOUT_S)
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=40, do_sample=False), config)
    manager.start()
    if rank != 0:
        manager.stop(block=True)
        return {}
    ids = manager.add_requests(PROMPTS)
    start = time.perf_counter()
    finals: dict[str, list] = {rid: [] for rid in ids}
    error = None
    try:
        for output in manager:
            finals[output.request_id].append({"status": int(output.status), "error": output.error})
    except RuntimeError as exc:  # ManagerDeadError once every result is out
        error = f"{type(exc).__name__}: {exc}"
    return {"finals": finals, "error": error, "seconds": time.perf_counter() - start}


def driver_dies(model) -> dict:
    """Rank 0 is SIGKILLed in the middle of `generate_batch`; rank 1 must raise naming the timeout."""
    if torch.distributed.get_rank() == 0:
        exchange, calls = CpuGroup.exchange, [0]

        def exchange_then_die(self, message=None):
            calls[0] += 1
            if calls[0] == 6:
                os.kill(os.getpid(), signal.SIGKILL)
            return exchange(self, message)

        CpuGroup.exchange = exchange_then_die
    config = ContinuousBatchingConfig(page_size=8, cpu_group_timeout=FAILURE_TIMEOUT_S)
    try:
        model.generate_batch(PROMPTS, GenerationConfig(max_new_tokens=40), config, progress_bar=False)
    except TensorParallelError as error:
        return {"error": str(error)}
    return {"error": None}


def offload(model, kv_cache_dtype: str = "auto") -> dict:
    """CPU offload on every rank, under a device cache of about a quarter of the work (page_size 4: 30
    pages at full length, 12 here, the largest request's 11 + 1): preempted requests swap out and back.
    Each rank reports its outputs and what its runner copied; rank 0 also what was recomputed.
    `kv_cache_dtype="int8"`: each rank's KV shard in int8 pages with their scales (docs/quantization.md)."""
    from unittest import mock

    from transformers_cb.engine.engine import Engine
    from transformers_cb.engine.follower import FollowerEngine

    engines: list[Engine] = []
    originals = {Engine: Engine.step, FollowerEngine: FollowerEngine.step}

    def recording(cls):
        def step(self):
            if self not in engines:
                engines.append(self)
            result = originals[cls](self)
            if not self.is_follower:
                self.check_integrity()  # device pools, host pools, queues, block tables
            return result

        return step

    greedy = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=12, max_batch_tokens=16, cpu_offload_space=None, kv_cache_dtype=kv_cache_dtype
    )
    with (
        mock.patch.object(Engine, "step", recording(Engine)),
        mock.patch.object(FollowerEngine, "step", recording(FollowerEngine)),
    ):
        outputs = model.generate_batch(PROMPTS, greedy, config, progress_bar=False)
    (engine,) = engines
    swapper = engine.runner.swapper
    return {
        "outputs": outputs_json(outputs),
        "host_pages": engine.offload.host.num_pages,
        "pages_out": swapper.pages_out,
        "pages_in": swapper.pages_in,
        "recomputed": engine.scheduler.recomputed.total,
        "preemptions": engine.scheduler.num_preemptions,
        "planned_out": engine.offload.swap_out_pages,
        "kv_dtype": str(engine.cache.group_tensors[0].dtype),
        "host_scales": len(swapper.host_scales),
    }


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "s": {"type": "string", "maxLength": 4},
    },
    "required": ["n", "s"],
    "additionalProperties": False,
}


def guided_config() -> tuple[GenerationConfig, ContinuousBatchingConfig, dict]:
    """The `guided` scenario's settings (also run in one process by the test, as the reference)."""
    greedy = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None)
    tight = ContinuousBatchingConfig(page_size=4, num_blocks=20, max_batch_tokens=16)
    return (
        greedy,
        tight,
        {"guided": [{"json": GUIDED_SCHEMA}, None, {"regex": "[ab]{3}c"}, {"json": GUIDED_SCHEMA}, None]},
    )


def guided(model) -> dict:
    """Guided decoding on rank 0 only (the masks are computed where tokens are sampled); a tight cache."""
    from transformers_cb.models.tiny import build_tiny_tokenizer

    greedy, tight, kwargs = guided_config()
    outputs = model.generate_batch(
        PROMPTS, greedy, tight, progress_bar=False, tokenizer=build_tiny_tokenizer(), **kwargs
    )
    return outputs_json(outputs)


def bad_heads(model) -> dict:
    try:
        model.generate_batch([[5, 6, 7]], GenerationConfig(max_new_tokens=2), progress_bar=False)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


SCENARIOS = {
    "generate_batch": generate_batch,
    "manager": manager,
    "kill": dies,
    "hang": dies,
    "kill_driver": driver_dies,
    "bad_heads": bad_heads,
    "offload": offload,
    "offload_int8": lambda model: offload(model, "int8"),
    "guided": guided,
}

if __name__ == "__main__":
    scenario, model_dir, out_dir = sys.argv[1:4]
    model = load(model_dir)
    assert model.tp_size == 2
    result = SCENARIOS[scenario](model)
    with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as handle:
        json.dump(result, handle)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: a dead peer would make it wait
