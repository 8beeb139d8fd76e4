"""Scripts run as `python script.py` would run them, forked from a process that has made their first imports.

A test that runs a script in a fresh interpreter pays `import torch, transformers` (about 5 s here) per
script; the seed documents' tests run twenty, each tensor-parallel test two at once. A `Zygote` makes the imports once (`preload`, which must
be what every script it serves imports first anyway, so that the import order under test is unchanged) and
forks a child per script. The child is the script's process: its own `__main__`, `sys.argv`, `sys.path[0]`,
environment additions, stdout and stderr, and the interpreter's normal exit (atexit handlers, non-daemon
threads joined), with the script's exit status.

Fork is safe here because the zygote never runs a torch operation, so no thread pool exists yet to fork
(torch's import starts one idle thread, which `fork` leaves behind and torch's own fork handlers expect).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import TAIL
from tests.support.timeouts import hang_guard

# Runs in the zygote: read one request a line, fork, report the child's pid, then its exit status. The child
# leaves the loop and runs the script at the top level, so the interpreter ends it as it ends any script.
_SERVER = r"""
import json, os, sys
exec(sys.argv[1])
ready = sys.stdout
ready.write("ready\n"); ready.flush()
request = None
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    ready.write(json.dumps({"pid": pid}) + "\n"); ready.flush()
    _, status = os.waitpid(pid, 0)
    ready.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n"); ready.flush()
    request = None
if request is None:
    sys.exit(0)
del ready, line, pid
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
output = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(output, 1)
if request["stderr"] != request["stdout"]:
    output = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(output, 2)
sys.stdin = open(os.devnull)
os.environ.update(request["env"])
os.chdir(request["cwd"])
sys.argv = [request["script"], *request["args"]]
sys.path[0] = os.path.dirname(request["script"])
import runpy
del request
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Zygote:
    """A process that ran `preload` (Python source) under `env` and forks a child per `run`."""

    def __init__(self, preload: str, env: Mapping[str, str], timeout: float = 300) -> None:
        self.env = dict(env)
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, preload],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._buffer = b""
        self._child: Child | None = None
        self._children = 0
        line = self._read_line(hang_guard(timeout))
        if line != "ready":
            self.close()
            raise RuntimeError(f"the zygote did not start ({line!r}): {self._stderr()}")

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a script under `env` sees what it would in a fresh interpreter here: the zygote's
        environment, with additions only (read at a script's run, never by the preload)."""
        return self._process.poll() is None and all(env.get(k) == v for k, v in self.env.items())

    def start(
        self,
        script: Path,
        env: Mapping[str, str],
        cwd: Path,
        args: Sequence[str] = (),
        merged: bool = False,
        output: Path | None = None,
    ) -> Child:
        """`python script *args` under `env` in `cwd`, started (one child at a time per zygote); its output in
        `output`.stdout / .stderr (default: beside the script); `merged`: stderr into the stdout file, as
        `stderr=subprocess.STDOUT` would."""
        assert self._child is None or self._child.returncode is not None, "one child at a time"
        out = (output or script).with_suffix(f".{self._children}.stdout")
        err = out if merged else out.with_suffix(".stderr")
        extra = {k: v for k, v in env.items() if self.env.get(k) != v}
        request = {
            "script": str(script),
            "args": list(args),
            "env": extra,
            "cwd": str(cwd),
            "stdout": str(out),
            "stderr": str(err),
        }
        assert self._process.stdin is not None
        self._process.stdin.write((json.dumps(request) + "\n").encode())
        self._process.stdin.flush()
        line = self._read_line(hang_guard(60))
        if line is None:
            raise AssertionError(f"the zygote did not fork {script}")
        self._child = Child(self, json.loads(line)["pid"], out, err)
        self._children += 1
        return self._child

    def run(
        self, script: Path, env: Mapping[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """`python script` under `env` in `cwd`: its exit status and output; killed past the hang guard."""
        child = self.start(script, env, cwd)
        limit = hang_guard(timeout)
        returncode = child.wait(limit)
        if returncode is None:
            child.kill()
            raise AssertionError(
                f"{script} did not end within {limit:g} s (a hang guard); it printed:\n--- stdout:\n"
                f"{child.stdout()[-TAIL:]}\n--- stderr:\n{child.stderr()[-TAIL:]}"
            )
        return subprocess.CompletedProcess(
            [sys.executable, str(script)], returncode, child.stdout(), child.stderr()
        )

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _read_line(self, timeout: float) -> str | None:
        """The zygote's next line, or None after `timeout` seconds (its own buffer: a pipe's buffered reader
        could hold a second line that `select` would then wait for)."""
        stdout = self._process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([stdout], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return None
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the zygote exited: {self._stderr()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _stderr(self) -> str:
        if self._process.poll() is None:
            self._process.kill()
        assert self._process.stderr is not None
        return self._process.stderr.read().decode(errors="replace")[-TAIL:]


def process_env(**changes: str) -> dict[str, str]:
    """This process's environment with `changes`, less pytest's name of the running test (it changes at every
    test, so a zygote made under it would serve no other)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(changes)
    return env


class Zygotes:
    """A test module's zygotes by key, each made on first use (or again where the environment changed);
    `close` ends them all (a module-scoped fixture's teardown)."""

    def __init__(self) -> None:
        self._made: dict[object, Zygote] = {}

    def get(self, key: object, preload: str, env: Mapping[str, str]) -> Zygote:
        zygote = self._made.get(key)
        if zygote is None or not zygote.serves(env):
            if zygote is not None:
                zygote.close()
            zygote = self._made[key] = Zygote(preload, env)
        return zygote

    def close(self) -> None:
        while self._made:
            self._made.popitem()[1].close()

    def closed_after_module(self) -> Callable[[], Iterator[None]]:
        """An autouse module-scoped fixture that closes them when the module's tests are done (assign it to a
        module-level name of the test module)."""

        @pytest.fixture(scope="module", autouse=True)
        def close_zygotes() -> Iterator[None]:
            yield
            self.close()

        return close_zygotes


@dataclass
class Child:
    """One script's process, forked by `zygote`."""

    zygote: Zygote
    pid: int
    out: Path
    err: Path
    returncode: int | None = None

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if the child still runs after `timeout` seconds."""
        if self.returncode is None:
            line = self.zygote._read_line(timeout)
            if line is not None:
                self.returncode = json.loads(line)["returncode"]
        return self.returncode

    def kill(self) -> None:
        """SIGKILL (a stopped child too), then its exit status reaped."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            if self.wait(hang_guard(30)) is None:
                raise AssertionError(f"the zygote did not reap its killed child {self.pid}")

    def stdout(self) -> str:
        return _text(self.out)

    def stderr(self) -> str:
        return _text(self.err)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
