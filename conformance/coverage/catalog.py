"""Which model types the matrix covers: transformers' own mappings, read at run time.

An entry is one (model type, model class) pair: every causal-LM type, and every image-text-to-text type
run on its text path. A type registered in both mappings with the same class is covered once; with a
different class (e.g. `llama4`: `Llama4ForCausalLM` and `Llama4ForConditionalGeneration`) the
image-text-to-text class is its own entry, named `<type>:vlm`.
"""

from __future__ import annotations

from dataclasses import dataclass

CAUSAL_LM = "causal-lm"
IMAGE_TEXT_TO_TEXT = "image-text-to-text"
VLM_SUFFIX = ":vlm"

# The fixed subset the test suite runs (`--subset`): exact families (full, sliding / hybrid, MoE,
# soft-caps + sinks, ALiBi in a module of its own: Bloom's adapter), refusals learned from the config and
# classes (an encoder with a causal-LM head, an encoder-decoder's decoder, a shared attention block,
# per-layer head shapes), linear-attention and state-space models (a hybrid, a model without attention),
# and vision-language models on their text path.
SUBSET = (
    "llama",
    "qwen2",
    "gemma2",
    "gpt_oss",
    "mixtral",
    "bloom",
    "bert",
    "bart",
    "qwen3_next",
    "mamba2",
    "zamba2",
    "gemma4_text",
    "llava",
    "qwen2_vl",
)


@dataclass(frozen=True)
class Entry:
    """One row of the matrix."""

    name: str  # the row's key: the model type, or `<type>:vlm`
    model_type: str
    mapping: str  # CAUSAL_LM or IMAGE_TEXT_TO_TEXT
    class_name: str


def all_entries() -> list[Entry]:
    """Every entry of the installed transformers, causal-LM types first, each group sorted by type."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    entries = [Entry(t, t, CAUSAL_LM, c) for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]
    for model_type, class_name in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()):
        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if causal == class_name:
            continue
        name = model_type if causal is None else model_type + VLM_SUFFIX
        entries.append(Entry(name, model_type, IMAGE_TEXT_TO_TEXT, class_name))
    return entries


def select(entries: list[Entry], names: list[str] | None) -> list[Entry]:
    """The entries named (by row name or model type), in the order given; all of them for None."""
    if names is None:
        return entries
    by_name = {e.name: e for e in entries}
    chosen: list[Entry] = []
    for name in names:
        matches = [by_name[name]] if name in by_name else [e for e in entries if e.model_type == name]
        if not matches:
            raise SystemExit(f"unknown model type {name!r} (not in the installed transformers' mappings)")
        chosen.extend(m for m in matches if m not in chosen)
    return chosen
