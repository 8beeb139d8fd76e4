"""Building the native kernel ahead of use: a killed build blocks nobody, each environment builds its own
binary once, a machine without a compiler runs and warns once.

Every test runs real processes (so all are `slow`, the tier of fresh interpreters; the venvs one compiles
nothing: its compilers copy the binary this session already built) against a private kernel folder
(`TRANSFORMERS_CB_KERNEL_DIR`): the build, the lock and the warnings are per process, and what matters is what a
*new* process does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.support.paths import REPO_ROOT
from tests.support.processes import run_process
from tests.support.timeouts import hang_guard
from transformers_cb.attention.native import kernel as native
from transformers_cb.attention.native.native_build import (
    KERNEL_DIR_ENV,
    MODULE_NAME,
    KernelFolder,
    kernel_folder,
    lock_owner,
)

# One tiny model, one request, in a fresh process: prints "served <status> <n tokens>" per call.
SERVE_SCRIPT = textwrap.dedent(
    """
    import sys
    from transformers import GenerationConfig
    import transformers_cb
    from tests.support.models import build_tiny_model
    model = build_tiny_model("llama", seed=0)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    for call in range(int(sys.argv[1])):
        out = model.generate_batch([[5, 6, 7, 8]], generation_config=config, progress_bar=False)["req_0"]
        print("served", out.status.name, len(out.generated_tokens), flush=True)
    """
)
WARNING = "native CPU paged-attention kernel unavailable"
pytestmark = pytest.mark.slow  # fresh interpreters, every one


def _env(kernel_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, KERNEL_DIR_ENV: str(kernel_dir), **extra}
    env.pop("TRANSFORMERS_CB_NATIVE_KERNEL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return env


def _build_kernels(env: dict[str, str], python: str = sys.executable) -> subprocess.CompletedProcess:
    command = [python, "-m", "transformers_cb.cli.main", "build-kernels"]
    return run_process(command, timeout=900, env=env, cwd=REPO_ROOT, text=True)


def _serve(env: dict[str, str], calls: int = 1) -> subprocess.CompletedProcess:
    return run_process(
        [sys.executable, "-c", SERVE_SCRIPT, str(calls)], timeout=180, env=env, cwd=REPO_ROOT, text=True
    )


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + hang_guard(seconds)
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it (ninja starts the compiler in a process group of its own)."""
    try:
        process = psutil.Process(pid)
        tree = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGKILL)


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def lock_owner_pid(folder: Path) -> int | None:
    owner = lock_owner(KernelFolder(path=folder, key=folder.name, ingredients={}))
    return None if owner is None else int(owner["pid"])


def test_a_build_killed_mid_compile_blocks_no_later_process(tmp_path: Path) -> None:
    """SIGKILL a build while its compiler runs (the lock file stays behind, naming a dead PID): a new
    process serves its first request at once on the torch kernels, and its background build takes over
    the lock instead of waiting on it."""
    env = _env(tmp_path)
    builder = subprocess.Popen(
        [sys.executable, "-m", "transformers_cb.cli.main", "build-kernels"],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # Mid-compile: the lock is taken and torch has written the build file its ninja runs.
        folder = _wait_for(lambda: next(iter(_folders(tmp_path)), None), 120, "the kernel folder")
        _wait_for(lambda: list(folder.glob("tmp-*/build.ninja")), 120, "the compile to start")
        assert builder.poll() is None, builder.stdout.read().decode() if builder.stdout else ""
    finally:
        _kill_tree(builder.pid)
        builder.wait(timeout=hang_guard(30))
    assert builder.returncode == -signal.SIGKILL
    assert (folder / "lock").exists() and lock_owner_pid(folder) == builder.pid
    assert not (folder / f"{MODULE_NAME}.so").exists()

    served = _serve(env)
    try:
        assert served.returncode == 0, served.stderr
        assert served.stdout.split() == ["served", "FINISHED", "4"], served.stdout
        assert "not built yet; building it in the background" in served.stderr, served.stderr
        # The stale lock did not stop the new build: a live process holds it now.
        new_owner = _wait_for(
            lambda: (lock_owner_pid(folder) or builder.pid) != builder.pid and lock_owner_pid(folder),
            60,
            "a new builder to take the lock",
        )
    finally:
        owner = lock_owner_pid(folder)
        if owner and owner != builder.pid:
            _kill_tree(owner)  # the background build needs no finishing here
    assert new_owner != builder.pid


def _second_venv(path: Path) -> str:
    """A second virtual environment with the same torch (its site-packages point at this one's)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=hang_guard(120)
    )
    python = path / "bin" / "python"
    ours = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    import sysconfig

    Path(ours, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    return str(python)


# A compiler for the cache key (its own path, so its own `compiler` ingredient), that builds without
# compiling the kernel again: the compile step compiles an empty file with the build's own arguments (it
# writes the object and the dependency file ninja reads), the link step copies a library built by the real
# compiler, and every other call (`--version`, `-v`: the key, torch's checks) is the real g++'s. What the
# test checks is where each environment's build goes and that nobody rebuilds another's, not g++ itself:
# the real compile is `make install`'s (`build-kernels`), which this session's other tests load (a compile
# of the kernel took 90-130 s of a worker here).
COPYING_COMPILER = """#!{python}
import shutil, subprocess, sys
args = sys.argv[1:]
output = args[args.index("-o") + 1] if "-o" in args else None
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
if output is not None and output.endswith(".so"):
    shutil.copyfile({library!r}, output)
    sys.exit(0)
if output is not None:
    args = [{empty!r} if arg.endswith(".cpp") else arg for arg in args]
sys.exit(subprocess.call(["g++", *args]))
"""


def _copying_compiler(folder: Path, library: Path) -> tuple[Path, Path]:
    """The compiler above, as `folder/g++` (torch accepts a compiler by its name), and its call log."""
    folder.mkdir()
    (folder / "empty.cpp").write_text("", encoding="utf-8")
    log, compiler = folder / "calls.log", folder / "g++"
    source = COPYING_COMPILER.format(
        python=sys.executable, log=str(log), library=str(library), empty=str(folder / "empty.cpp")
    )
    compiler.write_text(source, encoding="utf-8")
    compiler.chmod(0o755)
    return compiler, log


def _session_library() -> Path:
    """The library this session's tests run on (built by `make install`, or here if it is not yet)."""
    assert native.ensure_native_module() is not None, "the native kernel cannot be built here"
    return kernel_folder().library


def _stamp(library: Path) -> tuple[int, int]:
    stat = library.stat()
    return stat.st_ino, stat.st_mtime_ns


def test_environments_build_their_own_kernel_once_and_never_each_others(tmp_path: Path) -> None:
    """Two venvs with the same torch share one binary (the second builds nothing); an environment that
    changes the binary (another compiler) gets its own folder; after all of it, each library is the one
    first built (same inode, same mtime)."""
    root = tmp_path / "kernels"
    compiler, _ = _copying_compiler(tmp_path / "compiler", _session_library())
    env = _env(root, CXX=str(compiler))
    first = _build_kernels(env)
    assert first.returncode == 0 and "native kernel: built in" in first.stdout, first.stdout + first.stderr
    (folder,) = _folders(root)
    library = folder / f"{MODULE_NAME}.so"
    stamp = _stamp(library)

    other_venv = _second_venv(tmp_path / "venv2")
    second = _build_kernels(env, python=other_venv)
    assert second.returncode == 0 and "native kernel: ready" in second.stdout, second.stdout + second.stderr
    assert _folders(root) == [folder] and _stamp(library) == stamp

    other, calls = _copying_compiler(tmp_path / "other-compiler", library)
    other_compiler = _build_kernels(_env(root, CXX=str(other)))
    assert other_compiler.returncode == 0 and "built in" in other_compiler.stdout, other_compiler.stderr
    linked = [line for line in calls.read_text().splitlines() if f"{MODULE_NAME}.so" in line]
    assert linked, f"the build did not run $CXX (calls: {calls.read_text()!r})"
    folders = _folders(root)
    assert len(folders) == 2 and folder in folders
    (other_folder,) = [f for f in folders if f != folder]
    other_stamp = _stamp(other_folder / f"{MODULE_NAME}.so")
    assert (
        json.loads((other_folder / "build.json").read_text())["compiler"]
        != json.loads((folder / "build.json").read_text())["compiler"]
    )

    # The other compiler's environment finds its own library (the first environment's second process is the
    # second venv's build above, its third the serve below; both libraries keep their first inode and mtime).
    again = _build_kernels(_env(root, CXX=str(other)))
    assert "native kernel: ready" in again.stdout, again.stdout + again.stderr
    served = _serve(env)
    assert served.returncode == 0 and "served FINISHED 4" in served.stdout, served.stderr
    assert "not built yet" not in served.stderr and WARNING not in served.stderr, served.stderr
    assert _stamp(library) == stamp and _stamp(other_folder / f"{MODULE_NAME}.so") == other_stamp


def test_without_a_compiler_install_and_generate_batch_run_and_warn_once(tmp_path: Path) -> None:
    """`build-kernels` (what `make install` runs) exits 0 with one warning; generate_batch, twice in one
    process (two engines), serves both on the torch kernels with one warning in all."""
    env = _env(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    built = _build_kernels(env)
    assert built.returncode == 0, built.stderr
    assert built.stderr.count("unavailable") == 1 and "no-such-compiler" in built.stderr, built.stderr

    served = _serve(env, calls=2)
    assert served.returncode == 0, served.stderr
    assert served.stdout.splitlines() == ["served FINISHED 4"] * 2, served.stdout
    assert served.stderr.count(WARNING) == 1 and "no-such-compiler" in served.stderr, served.stderr
    assert _folders(tmp_path) == []  # nothing was built, nothing half-built left behind
