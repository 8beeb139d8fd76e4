"""Loading the model a command runs: the device, the model and its tokenizer, their special ids.

Shared by `transformers-cb generate` (cli/main.py) and `transformers-cb serve` (serve/server.py), so
both load a checkpoint (or the built-in tiny model, models/tiny.py) the same way.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .cpu_threads import cpu_threads
from .tiny import build_tiny_model, build_tiny_tokenizer


def resolve_device(device: str | None) -> str:
    """`device` as given, else CUDA when there is one, else the CPU."""
    import torch

    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def special_ids(model: Any, tokenizer: Any) -> tuple[Any, Any]:
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
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local checkpoint directory, a registry model by name (`smollm2`: fetched and converted on
    first use, models/fetch.py), or build the tiny default model when ``path`` is None or `tiny`.
    Raises `OSError` for an unreadable checkpoint (`FetchError`, one line, for a failed fetch)."""
    import transformers_cb  # noqa: F401  (registers the ``paged|...`` attention names)

    from .fetch import resolve_model

    path = resolve_model(path, progress=progress)

    # The models are cast to the `torch.nn.Module`s they are: `PreTrainedModel.to` is wrapped
    # (`functools.wraps`), which type checkers read as a plain function that takes `self` again.
    tokenizer: PreTrainedTokenizerBase
    if path is None:
        tokenizer = build_tiny_tokenizer()
        tiny = build_tiny_model(seed=seed, attn_implementation=attn_implementation, tokenizer=tokenizer)
        model = cast(torch.nn.Module, tiny).to(dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        loaded = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation=attn_implementation, dtype=dtype
        )
        model = cast(torch.nn.Module, loaded)
    # Moved and switched to eval mode, it is still the `PreTrainedModel` it was loaded as.
    return cast(PreTrainedModel, model.to(device).eval()), tokenizer


def load_for_command(args: argparse.Namespace) -> tuple[PreTrainedModel, Any]:
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
