"""Choosing the paged backend for a model, and switching to it only for the run.

- a paged name (`paged|sdpa`, `paged|eager`, `paged|flash_attention_2`, ...) runs as given;
- a plain flash name (`flash_attention_2`, `flash_attention_3`, `kernels-community/flash-attn*`) runs
  its paged flash counterpart;
- `sdpa` / `eager` / None: with `auto_switch_to_flash` (the default), on a flash device, for a model that
  supports flash, the first flash kernel that imports: flash-attn 3, then flash-attn 2 (a warning says
  so, as the documents do); otherwise `paged|sdpa` / `paged|eager`.
A flash name whose kernel does not import raises `FlashKernelUnavailable` naming what to install.
Flash kernels have no chunked-attention rule (Llama 4's `attention_chunk_size`): a model with chunked
layers never switches to flash, and a flash name for it raises a `ValueError` naming the reason; so does a
multi-latent attention model (its latent pages are read by attention/families/latent.py). Inside `paged_backend`,
a multi-latent model's modules hand their latent to the paged forward (`latent.latent_pass_through`), and
the classic families' attention modules (Bloom, MPT, ...) attend through it (`classic.classic_attention`:
their classes cannot switch attention implementation, so they are not switched, only adapted).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kv.layer_groups import CHUNKED_ATTENTION, latent_shape_of, layer_types_of
from ..patches import in_force, switched
from . import PAGED_BACKENDS
from .backends.flash_kernels import FA2, FA3, flash_available, is_flash_backend, load_flash_kernel
from .families.classic import classic_attention, has_classic_attention
from .families.latent import latent_pass_through
from .families.sparse_index import indexer_pass_through

logger = logging.getLogger(__name__)

_PAGED_FOR_PLAIN = {None: "paged|sdpa", "sdpa": "paged|sdpa", "eager": "paged|eager"}
# Devices the flash kernels run on (flash-attn: CUDA; kernels-community/flash-attn2 also XPU). Tests that
# inject the CPU test double of flash-attn (tests/support/flash_double.py) add "cpu" here.
SWITCH_KIND = "paged_attention"  # the implementation switch, counted (patches.py)
FLASH_DEVICES = {"cuda", "xpu"}
AUTO_SWITCH_ORDER = (FA3, FA2)


def has_chunked_layers(model: PreTrainedModel) -> bool:
    """Whether some layer of `model` attends in chunks (a rule flash kernels cannot express)."""
    return CHUNKED_ATTENTION in layer_types_of(model.config.get_text_config())


def has_latent_layers(model: PreTrainedModel) -> bool:
    """Whether `model` caches a multi-latent KV (its layers attend through attention/families/latent.py, which the
    flash kernels do not run)."""
    return latent_shape_of(model.config.get_text_config()) is not None


def check_flash_backend(model: PreTrainedModel, name: str) -> None:
    """Raise unless `model` can run flash backend `name` (kernel importable, model supports flash, no
    chunked-attention layers)."""
    load_flash_kernel(name)
    if not getattr(model, "_supports_flash_attn", False):
        raise ValueError(
            f"attn_implementation={name!r}: {type(model).__name__} does not support flash attention; "
            "load it with 'sdpa' or 'paged|sdpa'"
        )
    if has_chunked_layers(model):
        raise ValueError(
            f"attn_implementation={name!r}: {type(model).__name__} has chunked-attention layers "
            "(attention_chunk_size), which the paged flash kernels do not implement; load it with 'sdpa' "
            "or 'paged|sdpa'"
        )
    if has_latent_layers(model):
        raise ValueError(
            f"attn_implementation={name!r}: {type(model).__name__} has multi-latent attention (kv_lora_rank), "
            "whose latent pages the paged flash kernels do not read; load it with 'sdpa' or 'paged|sdpa'"
        )


def _auto_flash(model: PreTrainedModel, device_type: str) -> str | None:
    if device_type not in FLASH_DEVICES or not getattr(model, "_supports_flash_attn", False):
        return None
    if has_chunked_layers(model) or has_latent_layers(model):
        return None
    for name in AUTO_SWITCH_ORDER:
        if flash_available(name):
            return name
    return None


def paged_implementation_for(
    current: str | None,
    model: PreTrainedModel | None = None,
    auto_switch_to_flash: bool = False,
    device_type: str = "cpu",
) -> str:
    """The paged backend that runs a model currently set to `current`."""
    if current is not None and not current.startswith("paged|") and is_flash_backend("paged|" + current):
        current = "paged|" + current
    if is_flash_backend(current):
        if model is not None:
            check_flash_backend(model, current)
        if device_type not in FLASH_DEVICES:
            raise ValueError(
                f"attn_implementation={current!r} runs flash-attention kernels, which need a CUDA device; "
                f"the model is on {device_type!r} (load it with 'sdpa' or 'paged|sdpa')"
            )
        return current
    if current in PAGED_BACKENDS:
        return current
    if current in _PAGED_FOR_PLAIN:
        if auto_switch_to_flash and model is not None:
            flash = _auto_flash(model, device_type)
            if flash is not None:
                log = logger.info if flash == AUTO_SWITCH_ORDER[0] else logger.warning
                log(
                    "continuous batching switches attn_implementation=%r to %r for the run (flash needs no "
                    "attention mask)%s; set auto_switch_to_flash=False to keep %r",
                    current,
                    flash,
                    "" if flash == AUTO_SWITCH_ORDER[0] else " because flash-attn 3 is not installed",
                    current,
                )
                return flash
        return _PAGED_FOR_PLAIN[current]
    if current is not None and "flash" in current:
        raise ValueError(
            f"attn_implementation={current!r} has no paged flash counterpart; use 'paged|flash_attention_2', "
            "'paged|flash_attention_3', 'paged|kernels-community/flash-attn2' or 'paged|sdpa'"
        )
    logger.warning(
        "attn_implementation=%r has no paged counterpart; continuous batching runs 'paged|sdpa'", current
    )
    return "paged|sdpa"


@contextmanager
def paged_backend(model: PreTrainedModel, target: str | None = None) -> Iterator[str]:
    """Switch `model` to `target` (default: its paged backend, without auto-switching) for the block,
    then restore what the user chose."""
    current = model.config._attn_implementation
    if target is None:
        target = paged_implementation_for(current, model, device_type=model.device.type)
    # A counted switch (patches.py): a run overlapping another on the same model shares its switch, and
    # the user's choice comes back when the last one leaves, not under a run still going.
    shared = in_force(SWITCH_KIND, model, "attn_implementation")
    switch = shared or (target != current and not has_classic_attention(model))

    def apply() -> str | None:
        model.set_attn_implementation(target)
        return current

    def undo(previous: str | None) -> None:
        if model.config._attn_implementation == target:
            model.set_attn_implementation(previous if previous is not None else "sdpa")

    # Multi-latent modules hand their latent to the paged forward; indexers select from the paged keys;
    # the classic families' modules call the paged forward through their adapters.
    with (
        switched(SWITCH_KIND, model, "attn_implementation", apply, undo) if switch else nullcontext(),
        latent_pass_through(model),
        indexer_pass_through(model),
        classic_attention(model, ALL_ATTENTION_FUNCTIONS[target]),
    ):
        yield target
