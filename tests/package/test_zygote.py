"""The suite's zygote (tests/support/zygote.py): a forked script behaves as `python script.py` would."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.zygote import Zygote, process_env

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "name", __name__, "path0", sys.path[0] == os.path.dirname(__file__))
print("env", os.environ.get("ZYGOTE_TEST_EXTRA"), "cwd", os.getcwd())
print("preloaded", "json" in sys.modules, file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
# a non-daemon thread: the interpreter joins it before the process ends, as for any script
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
mode = os.environ.get("ZYGOTE_TEST_MODE")
if mode == "exit":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
if mode == "hang":
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.fixture()
def zygote() -> Iterator[Zygote]:
    zygote = Zygote("import json", process_env())
    yield zygote
    zygote.close()


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "script.py"
    path.write_text("import signal\n" + SCRIPT)
    return path


def _env(zygote: Zygote, **extra: str) -> dict[str, str]:
    return {**zygote.env, **extra}


def test_a_forked_script_sees_what_a_fresh_interpreter_would(zygote: Zygote, tmp_path: Path) -> None:
    env = _env(zygote, ZYGOTE_TEST_EXTRA="added")
    assert zygote.serves(env)
    child = zygote.start(_script(tmp_path), env, tmp_path, ("a", "b"))
    assert child.wait(60) == 0
    out = child.stdout().splitlines()
    assert out[0] == "argv ['a', 'b'] name __main__ path0 True"
    assert out[1] == f"env added cwd {tmp_path}"
    assert out[2:] == ["thread joined", "atexit ran"]
    assert child.stderr().strip() == "preloaded True"
    # the zygote itself is untouched by the child's environment and serves the next script
    assert "ZYGOTE_TEST_EXTRA" not in zygote.env
    assert zygote.run(_script(tmp_path), _env(zygote), tmp_path, 60).returncode == 0


@pytest.mark.parametrize(("mode", "returncode"), [("exit", 3), ("raise", 1)])
def test_exit_status_and_traceback(zygote: Zygote, tmp_path: Path, mode: str, returncode: int) -> None:
    result = zygote.run(_script(tmp_path), _env(zygote, ZYGOTE_TEST_MODE=mode), tmp_path, 60)
    assert result.returncode == returncode
    if mode == "raise":
        assert "ValueError: boom" in result.stderr


def test_a_stopped_child_is_killed_past_the_guard(zygote: Zygote, tmp_path: Path) -> None:
    env = _env(zygote, ZYGOTE_TEST_MODE="hang")
    child = zygote.start(_script(tmp_path), env, tmp_path, merged=True)
    assert child.wait(1.0) is None
    child.kill()
    assert child.returncode == -signal.SIGKILL
    assert "preloaded True" in child.stdout()  # stderr merged into stdout
    with pytest.raises(AssertionError, match="did not end within"):
        zygote.run(_script(tmp_path), env, tmp_path, 1.0)


def test_an_environment_that_changes_a_zygote_key_is_not_served(zygote: Zygote) -> None:
    key = next(iter(zygote.env))
    assert not zygote.serves({**zygote.env, key: zygote.env[key] + "-changed"})
    assert not zygote.serves({k: v for k, v in zygote.env.items() if k != key})
