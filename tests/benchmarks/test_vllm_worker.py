"""benchmarks/vllm_worker.py against a stand-in `vllm` package (vLLM itself lives in its own venv): each timed
job starts with vLLM's prefix cache empty, as ours starts each `generate_batch`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.timeouts import hang_guard

WORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_worker.py"

# A stand-in `vllm`: an LLM whose prefix cache remembers every prompt it ran, and which logs each call.
STUB = textwrap.dedent(
    """
    import json, os

    __version__ = "stub"
    LOG = os.environ["STUB_LOG"]

    def _log(event):
        with open(LOG, "a") as handle:
            handle.write(json.dumps(event) + "\\n")

    class SamplingParams:
        def __init__(self, max_tokens, **kwargs):
            self.max_tokens = max_tokens

    class _Output:
        def __init__(self, ids):
            self.token_ids = ids

    class _Result:
        def __init__(self, ids):
            self.outputs = [_Output(ids)]

    class LLM:
        def __init__(self, **kwargs):
            self.cached = set()

        def reset_prefix_cache(self):
            self.cached.clear()
            _log({"reset": True})
            return True

        def get_metrics(self):
            return []

        def generate(self, prompts, params, use_tqdm=False):
            hits = sum(tuple(p["prompt_token_ids"]) in self.cached for p in prompts)
            self.cached.update(tuple(p["prompt_token_ids"]) for p in prompts)
            _log({"generate": len(prompts), "cache_hits": hits})
            return [_Result([7] * p.max_tokens) for p in params]
    """
)
INPUTS = textwrap.dedent(
    """
    def TokensPrompt(prompt_token_ids):
        return {"prompt_token_ids": prompt_token_ids}
    """
)


def _run_worker(tmp_path: Path, jobs: list[dict]) -> tuple[list[dict], list[dict]]:
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STUB)
    (package / "inputs.py").write_text(INPUTS)
    log = tmp_path / "log.jsonl"
    env = {"PYTHONPATH": str(tmp_path / "site"), "STUB_LOG": str(log), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "model")],
        input="".join(json.dumps(job) + "\n" for job in jobs),
        capture_output=True,
        text=True,
        env=env,
        timeout=hang_guard(120),
        check=True,
    )
    replies = [
        json.loads(line.split(" ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith("@@tcb-vllm ")
    ]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return replies, events


def test_every_job_starts_with_an_empty_prefix_cache(tmp_path: Path) -> None:
    job = {"prompts": [[3, 4, 5], [6, 7]], "max_new_tokens": [2, 3]}
    replies, events = _run_worker(tmp_path, [job, job, job])
    assert replies[0]["ready"] is True
    assert [reply["outputs"] for reply in replies[1:]] == [[[7, 7], [7, 7, 7]]] * 3
    generated = [event for event in events if "generate" in event]
    # A repeat of the same prompts (the warm-up's, then each timed run's) finds nothing cached.
    assert [event["cache_hits"] for event in generated] == [0, 0, 0]
    assert sum("reset" in event for event in events) == 3


def test_a_job_may_keep_the_cache(tmp_path: Path) -> None:
    job = {"prompts": [[3, 4, 5]], "max_new_tokens": [1]}
    _, events = _run_worker(tmp_path, [job, {**job, "keep_prefix_cache": True}])
    assert [event["cache_hits"] for event in events if "generate" in event] == [0, 1]
