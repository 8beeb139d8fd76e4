"""A GGUF file as a plain transformers folder: weights dequantized to float32 safetensors, the tokenizer
with its chat template, a `generation_config.json` that stops at the end-of-turn token.

transformers reads GGUF through the `gguf` package and dequantizes every tensor, but the model it returns
counts as quantized (its config carries a `quantization_config`), so `save_pretrained` refuses it: its
weights are copied into a plain model built from the same config, which saves like any other.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import torch

GGUF_MISSING = (
    "converting the model needs the gguf package: pip install 'transformers-cb[models]' "
    "(make run / make serve / make install-test install it)"
)


def gguf_available() -> bool:
    return importlib.util.find_spec("gguf") is not None


def convert_gguf(gguf_path: Path, out_dir: Path, show_progress: bool = True) -> None:
    """Write the plain model of `gguf_path` into `out_dir` (created). Raises `ImportError` without gguf."""
    if not gguf_available():
        raise ImportError(GGUF_MISSING)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    with _quiet(show_progress):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every weight of the plain model comes from the GGUF (tied embeddings included).
    plain.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else eos
    plain.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=pad
    )
    with _quiet(show_progress):  # save_pretrained's shard bar too
        plain.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


def _quiet(show_progress: bool) -> contextlib.AbstractContextManager:
    """transformers' own bars (dequantization, shard writing) write to stderr unconditionally: silenced when
    progress is off."""
    return contextlib.nullcontext() if show_progress else contextlib.redirect_stderr(io.StringIO())
