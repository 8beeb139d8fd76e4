"""Loading the model a command runs: the device, the model and its tokenizer (and a vision-language
checkpoint's processor), their special ids.

Shared by `transformers-cb generate` (cli/main.py) and `transformers-cb serve` (serve/server.py), so
both load a checkpoint (or the built-in tiny model, models/tiny.py) the same way.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .cpu_threads import cpu_threads
from .gguf_weights import gguf_of_folder, keep_gguf_quantized
from .tiny import build_tiny_model, build_tiny_tokenizer

if TYPE_CHECKING:
    from transformers import ProcessorMixin

logger = logging.getLogger(__name__)

# The files that say a checkpoint folder has a processor (an image processor or feature extractor beside
# its tokenizer): what `save_pretrained` writes for a processor and for its image processor.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# `quantized_weights=None` (no --quantized-weights / --no-quantized-weights): keep a folder's GGUF in its
# blocks? Off until the quiet sitting of benchmarks/throughput.py measures the real model both ways
# (docs/quantization.md).
QUANTIZED_BY_DEFAULT = False


def resolve_device(device: str | None) -> str:
    """`device` as given, else CUDA when there is one, else the CPU."""
    import torch

    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def special_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> tuple[int | list[int] | None, int | None]:
    """The eos and pad ids generation uses: the model's generation config first, then the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return eos, pad


def load_model_and_tokenizer(
    path: str | None,
    attn_implementation: str = "paged|sdpa",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: bool = True,
    quantized_weights: bool | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local checkpoint directory, a registry model by name (`smollm2`: fetched and converted on
    first use, models/fetch.py), or build the tiny default model when ``path`` is None or `tiny`.
    `quantized_weights` (docs/quantization.md): True keeps the Linears of the folder's GGUF in their blocks
    (a registry model's GGUF fetched if its folder lacks it; a `ValueError` where there is none or the device
    is not the CPU), False loads float weights, None does what `QUANTIZED_BY_DEFAULT` says where a GGUF is at
    hand. Raises `OSError` for an unreadable checkpoint (`FetchError`, one line, for a failed fetch)."""
    import transformers_cb  # noqa: F401  (registers the ``paged|...`` attention names)

    from .fetch import resolve_model

    name = path
    path = resolve_model(path, progress=progress)
    gguf = quantized_source(name, path, quantized_weights, str(device), progress)

    # The models are cast to the `torch.nn.Module`s they are: `PreTrainedModel.to` is wrapped
    # (`functools.wraps`), which type checkers read as a plain function that takes `self` again.
    tokenizer: PreTrainedTokenizerBase
    if path is None:
        tokenizer = build_tiny_tokenizer()
        tiny = build_tiny_model(seed=seed, attn_implementation=attn_implementation, tokenizer=tokenizer)
        model = cast(torch.nn.Module, tiny).to(dtype=dtype)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        loaded = auto_model_class(path).from_pretrained(
            path, attn_implementation=attn_implementation, dtype=dtype
        )
        model = cast(torch.nn.Module, loaded)
        if gguf is not None:
            report = keep_gguf_quantized(model, gguf)
            logger.info(
                "%s: %d modules kept in GGUF blocks (%.0f MB; %.0f MB of float weights dropped)",
                gguf,
                len(report.quantized),
                report.quantized_bytes / 1e6,
                report.float_bytes_dropped / 1e6,
            )
    # Moved and switched to eval mode, it is still the `PreTrainedModel` it was loaded as.
    return cast(PreTrainedModel, model.to(device).eval()), tokenizer


def quantized_source(
    name: str | None, folder: str | None, quantized_weights: bool | None, device: str, progress: bool = True
) -> Path | None:
    """The GGUF whose blocks the model loaded from `folder` keeps (`load_model_and_tokenizer`), or None for
    float weights."""
    from .fetch import fetch_gguf
    from .registry_model import registry_model

    if quantized_weights is False or folder is None:
        if quantized_weights and folder is None:
            raise ValueError("quantized weights need a GGUF model, not the built-in tiny model")
        return None
    if quantized_weights is None and not QUANTIZED_BY_DEFAULT:
        return None
    on_cpu = torch.device(device).type == "cpu"
    if not on_cpu:
        if quantized_weights:
            raise ValueError(f"quantized weights run on the CPU only, not on {device}")
        return None
    gguf = gguf_of_folder(folder)
    known = registry_model(name) if name is not None else None
    if gguf is None and quantized_weights and known is not None:
        gguf = fetch_gguf(known, progress=progress)
    if gguf is None and quantized_weights:
        raise ValueError(f"quantized weights: {folder} keeps no GGUF file (docs/quantization.md)")
    return gguf


def auto_model_class(path: str) -> Any:
    """The auto class that loads the checkpoint at `path` whole: `AutoModelForCausalLM`, or for a
    vision-language checkpoint it does not map (Llava, Qwen2-VL, ...) `AutoModelForImageTextToText`, whose
    class keeps the vision tower and the feature methods the engine encodes images with."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(AutoConfig.from_pretrained(path), "model_type", None)
    if (
        model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_processor(path: str | None) -> ProcessorMixin | None:
    """The processor of a local checkpoint folder that has one (`PROCESSOR_FILES`), read offline with
    `AutoProcessor`; None for a text-only folder, a name, or the built-in model. A processor that cannot be
    loaded is logged and left out (the server still serves text; images get a 400 saying it has none)."""
    if (
        path is None
        or not Path(path).is_dir()
        or not any((Path(path) / f).is_file() for f in PROCESSOR_FILES)
    ):
        return None
    from transformers import AutoProcessor, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure leaves the text path serving
        logger.warning("%s: the processor could not be loaded, images will be refused: %s", path, error)
        return None
    # A folder with only an image processor or feature extractor gives that back: no chat template to render.
    return processor if isinstance(processor, ProcessorMixin) else None


def load_for_command(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of a command's `--model` (a folder, or a name: `tiny`, a registry model fetched
    on first use), `--attn-implementation`, `--dtype`, `--device`, `--threads` (models/cpu_threads.py) and
    `--seed` (which also seeds torch before loading). Raises `OSError` for an unreadable checkpoint."""
    device = resolve_device(args.device)
    threads = cpu_threads(getattr(args, "threads", None), device, getattr(args, "adaptive_threads", False))
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    return load_model_and_tokenizer(
        args.model,
        attn_implementation=args.attn_implementation,
        dtype=getattr(torch, args.dtype),
        device=device,
        seed=args.seed,
        progress=not getattr(args, "no_progress", False),
        quantized_weights=getattr(args, "quantized_weights", None),
    )


def load_assistant_for_command(args: argparse.Namespace) -> PreTrainedModel | None:
    """The command's `--assistant-model` (speculative decoding's draft model: a folder or a registry name,
    as `--model`), loaded like the model (same attention backend, dtype and device); None when not given.
    Its tokenizer must be the model's: the engine checks the vocabularies at start."""
    name = getattr(args, "assistant_model", None)
    if name is None:
        return None
    assistant, _tokenizer = load_model_and_tokenizer(
        name,
        attn_implementation=args.attn_implementation,
        dtype=getattr(torch, args.dtype),
        device=resolve_device(args.device),
        seed=args.seed,
        progress=not getattr(args, "no_progress", False),
    )
    return assistant
