"""Finding a flash-attention kernel for a paged flash backend name, and what its API accepts.

Three sources, each imported only when a flash backend is asked for:
- `paged|flash_attention_2`: the `flash_attn` package (flash-attn 2.x, the `flash` extra);
- `paged|flash_attention_3`: the `flash_attn_interface` module (flash-attn 3, built from
  flash-attention's `hopper/` directory);
- `paged|kernels-community/<repo>`: `kernels.get_kernel("kernels-community/<repo>")` (the
  `kernels` extra), e.g. `flash-attn2`, `flash-attn3`, `vllm-flash-attn3`.

The APIs differ (flash-attn 2's varlen function takes `block_table` and `cu_seqlens_k`; flash-attn 3's
varlen function takes no page table, its `flash_attn_with_kvcache` takes `page_table`, `cu_seqlens_q`
and `cache_seqlens`; vLLM's takes `seqused_k`, `block_table` and `s_aux`), so what each function
accepts is read from its signature once, at load. A name whose package is missing raises
`FlashKernelUnavailable` naming what to install: never a silent fallback.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

FA2 = "paged|flash_attention_2"
FA3 = "paged|flash_attention_3"
HUB_PREFIX = "paged|kernels-community/"
# Hub kernels registered up front (any other `paged|kernels-community/flash-attn*` name is registered on use).
HUB_FLASH_REPOS = ("flash-attn", "flash-attn2", "flash-attn3", "vllm-flash-attn3")

_MODULES = {FA2: "flash_attn", FA3: "flash_attn_interface"}
_INSTALL = {
    FA2: "install the `flash` extra (pip install 'transformers-cb[flash]', i.e. flash-attn 2.x)",
    FA3: "install flash-attn 3 (built from the `hopper/` directory of Dao-AILab/flash-attention), "
    "or use 'paged|kernels-community/flash-attn3' with the `kernels` extra",
}
_KERNELS_INSTALL = "install the `kernels` extra (pip install 'transformers-cb[kernels]')"


class FlashKernelUnavailable(ImportError):
    """A flash backend was asked for but its kernel cannot be imported (the message names the fix)."""


def is_flash_backend(name: str | None) -> TypeGuard[str]:
    return name is not None and (name in (FA2, FA3) or is_hub_flash_name(name))


def is_hub_flash_name(name: str) -> bool:
    return name.startswith(HUB_PREFIX) and name[len(HUB_PREFIX) :].startswith(
        ("flash-attn", "vllm-flash-attn")
    )


def flash_backend_names() -> list[str]:
    return [FA2, FA3, *(HUB_PREFIX + repo for repo in HUB_FLASH_REPOS)]


def _accepts(function: Callable | None) -> frozenset[str]:
    if function is None:
        return frozenset()
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: assume the documented flash-attn 2 API
        return frozenset()


@dataclass(frozen=True)
class FlashKernel:
    """The two entry points of one flash-attention build and the keyword arguments each accepts."""

    name: str
    varlen: Callable
    with_kvcache: Callable | None
    varlen_args: frozenset[str]
    kvcache_args: frozenset[str]

    @property
    def varlen_table_arg(self) -> str | None:
        """The varlen function's page-table keyword (flash-attn 2, vLLM); None: it reads no paged cache."""
        return next((a for a in ("block_table", "page_table") if a in self.varlen_args), None)

    @property
    def kvcache_table_arg(self) -> str | None:
        return next((a for a in ("block_table", "page_table") if a in self.kvcache_args), None)

    @property
    def kvcache_is_varlen(self) -> bool:
        """flash-attn 3's `flash_attn_with_kvcache` takes packed queries with `cu_seqlens_q`."""
        return self.kvcache_table_arg is not None and "cu_seqlens_q" in self.kvcache_args

    def sinks_arg(self, function_args: frozenset[str]) -> str | None:
        return next((a for a in ("s_aux", "learnable_sink") if a in function_args), None)


def _import_module(name: str):
    module_name = _MODULES[name]
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise FlashKernelUnavailable(
            f"attn_implementation={name!r} needs the `{module_name}` module, which cannot be imported "
            f"({error}); {_INSTALL[name]}, or load the model with 'sdpa' / 'paged|sdpa'"
        ) from error


def _import_hub_kernel(name: str):
    repo = name[len("paged|") :]
    try:
        from kernels import get_kernel
    except ImportError as error:
        raise FlashKernelUnavailable(
            f"attn_implementation={name!r} needs the `kernels` package ({error}); {_KERNELS_INSTALL}, "
            "or load the model with 'sdpa' / 'paged|sdpa'"
        ) from error
    try:
        return get_kernel(repo)
    except Exception as error:  # noqa: BLE001 - the hub download or the kernel's own import failed
        raise FlashKernelUnavailable(
            f"attn_implementation={name!r}: kernels.get_kernel({repo!r}) failed: {error}"
        ) from error


_loaded: dict[str, FlashKernel] = {}


def load_flash_kernel(name: str) -> FlashKernel:
    """The kernel behind flash backend `name` (cached). Raises `FlashKernelUnavailable`."""
    if name in _loaded:
        return _loaded[name]
    if not is_flash_backend(name):
        raise ValueError(f"{name!r} is not a paged flash-attention backend name")
    module = _import_hub_kernel(name) if is_hub_flash_name(name) else _import_module(name)
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if varlen is None:
        raise FlashKernelUnavailable(
            f"attn_implementation={name!r}: the kernel has no flash_attn_varlen_func"
        )
    with_kvcache = getattr(module, "flash_attn_with_kvcache", None)
    kernel = FlashKernel(name, varlen, with_kvcache, _accepts(varlen), _accepts(with_kvcache))
    if kernel.varlen_table_arg is None and not kernel.kvcache_is_varlen:
        raise FlashKernelUnavailable(
            f"attn_implementation={name!r}: neither flash_attn_varlen_func nor flash_attn_with_kvcache of this "
            "kernel reads a paged KV cache (no block_table / page_table argument)"
        )
    _loaded[name] = kernel
    return kernel


def flash_available(name: str) -> bool:
    try:
        load_flash_kernel(name)
    except FlashKernelUnavailable:
        return False
    return True


def forget_loaded_kernels() -> None:
    """Drop cached kernels (tests swap the modules behind the names)."""
    _loaded.clear()
