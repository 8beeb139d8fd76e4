"""Building the native CPU kernel ahead of use: one folder per binary, a lock no dead process can hold.

Folder: `<root>/<key>/` with root `$TRANSFORMERS_CB_KERNEL_DIR`, else `$XDG_CACHE_HOME/transformers_cb/kernels`
(`~/.cache/...`). The key hashes everything that changes the binary: the C++ source and flags, torch's
version and git build, its C++ ABI, the Python ABI tag (sysconfig SOABI), the compiler and its version, and
the CPU (the flags hold `-march=native`). Two virtual environments with the same torch share one binary;
any difference gets a folder of its own, so no process ever rebuilds another's kernel or loads a stale one.

A build compiles in a private temporary folder (`torch.utils.cpp_extension.load_inline` with its own
`build_directory`, so torch's lock there is never shared) and moves the library into place with one
`os.replace`: a reader sees no library or a whole one. The folder's `lock` file is held with `flock`, which
the kernel releases when its holder dies, even by SIGKILL; it names the owner's PID and start time. A lock
held longer than the build timeout counts as stale too: the next builder builds anyway (the atomic install
makes two concurrent builds merely wasteful). A compile error is written to `failed.txt` and not retried
until `transformers-cb build-kernels` is run again.

`native_build.run_builder` (run with `python -c`) is the background builder that `kernel.py` starts in a
subprocess at first use; `transformers-cb build-kernels` (cli/) runs the same build in the foreground.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .native_source import SOURCE

KERNEL_DIR_ENV = "TRANSFORMERS_CB_KERNEL_DIR"
BUILD_TIMEOUT_ENV = "TRANSFORMERS_CB_KERNEL_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 1800.0  # a loaded 2-core machine took up to 503 s; beyond this a build is hung
MODULE_NAME = "transformers_cb_paged"
FLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
COMPILER_PROBE_TIMEOUT_S = 30.0


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built here (no compiler, a failed compile); the message says why."""


@dataclass(frozen=True)
class KernelFolder:
    """The build folder of one binary and the files in it."""

    path: Path
    key: str
    ingredients: dict[str, str]

    @property
    def library(self) -> Path:
        return self.path / f"{MODULE_NAME}.so"

    @property
    def lock(self) -> Path:
        return self.path / "lock"

    @property
    def failure(self) -> Path:
        return self.path / "failed.txt"

    @property
    def record(self) -> Path:
        return self.path / "build.json"

    @property
    def log(self) -> Path:
        return self.path / "build.log"


def cache_root() -> Path:
    """Where the kernel folders live (`$TRANSFORMERS_CB_KERNEL_DIR` overrides)."""
    override = os.environ.get(KERNEL_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformers_cb" / "kernels"


def build_timeout() -> float:
    """Seconds a build may hold the lock before another builder ignores it."""
    value = os.environ.get(BUILD_TIMEOUT_ENV)
    try:
        return float(value) if value else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        raise KernelUnavailable(f"{BUILD_TIMEOUT_ENV}={value!r} is not a number of seconds") from None


def compiler() -> str:
    """The C++ compiler torch's cpp_extension uses (`$CXX`, else `c++`)."""
    return os.environ.get("CXX") or "c++"


def compiler_version(cxx: str) -> str:
    """First line of `cxx --version`; KernelUnavailable when there is no such compiler."""
    try:
        probe = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=COMPILER_PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KernelUnavailable(f"no C++ compiler {cxx!r} ({type(error).__name__}: {error})") from None
    if probe.returncode != 0 or not probe.stdout.strip():
        raise KernelUnavailable(f"the C++ compiler {cxx!r} does not run (`{cxx} --version` failed)")
    return probe.stdout.splitlines()[0].strip()


def _cpu_signature() -> str:
    """The CPU features `-march=native` compiles for (the flags line of /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = next((line for line in handle if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def kernel_ingredients() -> dict[str, str]:
    """Everything the binary depends on; raises KernelUnavailable without a working compiler."""
    import torch

    cxx = compiler()
    return {
        "source": hashlib.sha256(SOURCE.encode()).hexdigest(),
        "flags": " ".join(FLAGS) + " | " + " ".join(LDFLAGS),
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "torch_cxx11_abi": str(torch.compiled_with_cxx11_abi()),
        "python_abi": str(sysconfig.get_config_var("SOABI")),
        "compiler": f"{shutil.which(cxx) or cxx}: {compiler_version(cxx)}",
        "cpu": _cpu_signature(),
    }


def kernel_folder(root: Path | None = None, ingredients: dict[str, str] | None = None) -> KernelFolder:
    """The folder of the binary this environment needs."""
    ingredients = kernel_ingredients() if ingredients is None else ingredients
    key = hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()[:16]
    return KernelFolder(path=(root or cache_root()) / key, key=key, ingredients=ingredients)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a lock or partial folder whose owner died can be taken over)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def lock_owner(folder: KernelFolder) -> dict | None:
    """The PID and start time written in the lock file (whether or not anyone still holds it)."""
    try:
        return json.loads(folder.lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class BuildLock:
    """The folder's lock, held through `flock` (released by the kernel when the holder dies)."""

    def __init__(self, folder: KernelFolder) -> None:
        self.folder = folder
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.folder.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.time()}).encode())
        self._fd = fd
        return True

    def held_past(self, timeout: float) -> bool:
        """Whether the current holder has had the lock longer than `timeout` (or left no readable owner)."""
        owner = lock_owner(self.folder)
        if owner is None:
            return False  # being written this instant
        return time.time() - float(owner.get("started", 0.0)) > timeout or not pid_alive(int(owner["pid"]))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays as a record of the last owner
            self._fd = None


def _clear_dead_builds(folder: KernelFolder) -> None:
    """Remove the temporary folders of builders that died (their PID is in the name)."""
    for entry in folder.path.glob("tmp-*"):
        try:
            pid = int(entry.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _compile(folder: KernelFolder) -> float:
    """Compile into a private folder, then move the library into place atomically; returns the seconds."""
    from torch.utils.cpp_extension import load_inline

    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=f"tmp-{os.getpid()}-", dir=folder.path))
    try:
        load_inline(
            name=MODULE_NAME,
            cpp_sources=[SOURCE],
            extra_cflags=list(FLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(scratch),
            verbose=False,
        )
        os.replace(scratch / f"{MODULE_NAME}.so", folder.library)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return time.monotonic() - start


def build(folder: KernelFolder, wait: bool, timeout: float | None = None) -> str:
    """Make sure `folder.library` exists; returns what happened: "ready", "built", or "busy" (another live
    builder holds the lock and `wait` is False).

    With `wait`, waits for another builder at most `timeout` seconds, then builds anyway. A compile error
    is written to `folder.failure` and raised as KernelUnavailable."""
    timeout = build_timeout() if timeout is None else timeout
    folder.path.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    lock = BuildLock(folder)
    while True:
        if folder.library.exists():
            return "ready"
        if lock.try_acquire():
            break
        if lock.held_past(timeout) or time.monotonic() > deadline:
            lock = BuildLock(folder)  # build without the lock: the install is atomic
            break
        if not wait:
            return "busy"
        time.sleep(0.2)
    try:
        if folder.library.exists():  # finished by the previous holder just before we took the lock
            return "ready"
        _clear_dead_builds(folder)
        try:
            seconds = _compile(folder)
        except Exception as error:
            message = f"{type(error).__name__}: {error}".strip()
            folder.failure.write_text(message + "\n", encoding="utf-8")
            raise KernelUnavailable(
                f"the build failed ({message.splitlines()[0]}); see {folder.failure}"
            ) from None
        folder.failure.unlink(missing_ok=True)
        record = {
            "seconds": round(seconds, 1),
            "pid": os.getpid(),
            "finished": time.time(),
            **folder.ingredients,
        }
        folder.record.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        return "built"
    finally:
        lock.release()


def start_background_build(folder: KernelFolder) -> subprocess.Popen:
    """Run `build` in a detached subprocess (its own session: it outlives the caller, which never waits)."""
    folder.path.mkdir(parents=True, exist_ok=True)
    package_parent = str(Path(__file__).resolve().parents[3])  # the folder holding transformers_cb/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    with open(folder.log, "ab") as log:
        return subprocess.Popen(
            # -c, not -m: the package's import of this module precedes runpy's (its RuntimeWarning).
            [sys.executable, "-c", _BUILDER, "--folder", str(folder.path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )


_BUILDER = f"import sys; from {__name__} import run_builder; sys.exit(run_builder(sys.argv[1:]))"


def run_builder(argv: list[str] | None = None) -> int:
    """The background builder: `build` of the folder the parent computed, bounded by the build timeout."""
    parser = argparse.ArgumentParser(description="background build of the native paged-attention kernel")
    parser.add_argument("--folder", required=True, help="the kernel folder the parent computed")
    args = parser.parse_args(argv)
    folder = kernel_folder()
    if folder.path != Path(args.folder):
        print(f"environment differs from the parent's: {folder.path} != {args.folder}", file=sys.stderr)
        return 1
    timeout = build_timeout()
    # The build bounds itself (SIGALRM's default action ends the process, and with it the flock): past
    # the timeout its lock is ignored by others anyway.
    signal.alarm(int(timeout) + 1)
    try:
        outcome = build(folder, wait=False, timeout=timeout)
    except KernelUnavailable as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {outcome} {folder.library}", flush=True)
    return 0
