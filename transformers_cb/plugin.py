"""Installing the plugin into transformers, and undoing it.

`install()` (run by `import transformers_cb`) does exactly this:
- adds `generate_batch`, `init_continuous_batching`, `continuous_batching_context_manager`
  and `destroy_cached_continuous_batching_manager` to `PreTrainedModel`, replacing the built-in ones;
- registers `paged|sdpa`, `paged|eager` and the paged flash names (`paged|flash_attention_2`,
  `paged|flash_attention_3`, `paged|kernels-community/flash-attn*`) in transformers' attention registry
  (and the matching mask builders, so a paged model still runs plain `generate()`);
- makes those names survive transformers 5.23, which strips the `paged|` prefix in
  `PreTrainedModel._check_and_adjust_attn_implementation` and `AttentionInterface.get_interface`.
`uninstall()` restores every patched attribute and registry entry, and undoes every run-scoped patch still in
force (patches.py: packed products, native layer ops, ...). Both are idempotent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from transformers import PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .api import model_methods
from .api.generate_batch import generate_batch
from .attention import PAGED_BACKENDS, PLAIN_COUNTERPART, mask_counterpart, register_flash_name
from .attention.backends.flash_kernels import is_flash_backend
from .attention.selection import check_flash_backend
from .patches import restore_everything

_MISSING = object()
_lock = threading.Lock()
_saved: list[tuple[object, str, object]] = []  # (owner, attribute, original or _MISSING)
_saved_registry: list[tuple[dict, str, object]] = []  # (mapping, key, original or _MISSING)

MODEL_METHODS: dict[str, Callable] = {
    "generate_batch": generate_batch,
    "init_continuous_batching": model_methods.init_continuous_batching,
    "continuous_batching_context_manager": model_methods.continuous_batching_context_manager,
    "destroy_cached_continuous_batching_manager": model_methods.destroy_cached_continuous_batching_manager,
}


def is_installed() -> bool:
    return bool(_saved)


def _patch(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


def _register(mapping: dict, key: str, value: object) -> None:
    _saved_registry.append((mapping, key, mapping.get(key, _MISSING)))
    mapping[key] = value


def _wrap_check_and_adjust(original: Callable) -> Callable:
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str) and is_flash_backend(attn_implementation):
            # The kernel must import (else an error naming the extra) and the model must support flash.
            check_flash_backend(self, attn_implementation)
            _register_backend(attn_implementation)
            return attn_implementation
        if attn_implementation in PAGED_BACKENDS:
            # Validate the plain counterpart (raises if the model cannot run it), keep our name.
            is_init_check = kwargs.get("is_init_check", args[0] if args else False)
            self.get_correct_attn_implementation(PLAIN_COUNTERPART[attn_implementation], is_init_check)
            return attn_implementation
        return original(self, attn_implementation, *args, **kwargs)

    # What `functools.wraps` would set, alone (the function keeps its own name and doc).
    _check_and_adjust_attn_implementation.__dict__["__wrapped__"] = original
    return _check_and_adjust_attn_implementation


def _wrap_get_interface(original: Callable) -> Callable:
    def get_interface(self, attn_implementation, default):
        if attn_implementation in PAGED_BACKENDS:
            return self[attn_implementation]
        return original(self, attn_implementation, default)

    get_interface.__dict__["__wrapped__"] = original
    return get_interface


def install() -> None:
    """Patch transformers (idempotent)."""
    with _lock:
        if _saved:
            return
        for name, method in MODEL_METHODS.items():
            _patch(PreTrainedModel, name, method)
        _patch(
            PreTrainedModel,
            "_check_and_adjust_attn_implementation",
            _wrap_check_and_adjust(PreTrainedModel._check_and_adjust_attn_implementation),
        )
        _patch(AttentionInterface, "get_interface", _wrap_get_interface(AttentionInterface.get_interface))
        for name in list(PAGED_BACKENDS):
            _register_backend(name)


def _register_backend(name: str) -> None:
    """Put one paged backend (and its mask builder) in transformers' registries, once per install."""
    function = register_flash_name(name) if name not in PAGED_BACKENDS else PAGED_BACKENDS[name]
    if AttentionInterface._global_mapping.get(name) is function:
        return
    masks = AttentionMaskInterface._global_mapping
    _register(AttentionInterface._global_mapping, name, function)
    _register(masks, name, masks[mask_counterpart(name)])


def uninstall() -> None:
    """Restore everything `install()` changed (idempotent)."""
    restore_everything()  # every run-scoped patch still in force: a run still going finishes plain
    with _lock:
        while _saved:
            owner, name, original = _saved.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        while _saved_registry:
            mapping, key, original = _saved_registry.pop()
            if original is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = original
