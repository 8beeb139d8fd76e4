"""The native CPU paged-attention kernel: loaded when built, optional, never waited on.

The kernel (`native_source.SOURCE`, float32 / bfloat16 / float16, accumulating in float32) is built ahead
of use by `transformers-cb build-kernels` (which `make install` / `run` / `test` run) into a folder keyed by
everything that changes the binary (`native_build.py`). A process only loads that library: when it is not
there yet, the first call starts one background build in a subprocess and returns None, so that step (and
every step until a later engine finds the library) runs the pure-torch kernels; no request waits on a
compile. Without a compiler, or after a failed compile, one warning says why and the torch kernels run:
the package works the same without the kernel, only slower on CPU.

`TRANSFORMERS_CB_NATIVE_KERNEL=0` turns it off (the pure-torch paths then run every step).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import threading
from types import ModuleType

import torch

from ...memory.kv_cache import write_slots
from .native_build import (
    MODULE_NAME,
    KernelFolder,
    KernelUnavailable,
    build,
    kernel_folder,
    start_background_build,
)

logger = logging.getLogger(__name__)

ENV_SWITCH = "TRANSFORMERS_CB_NATIVE_KERNEL"
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
# "module": the loaded library, or None once it is known unavailable in this process; "folder": the
# KernelFolder (computed once); "builder": the background build this process started.
_state: dict[str, object] = {}


def _warn_once(reason: str) -> None:
    if not _state.get("warned"):
        _state["warned"] = True
        logger.warning(
            "transformers_cb: native CPU paged-attention kernel unavailable (%s); using the pure-torch "
            "kernels (slower on CPU). Set %s=0 to skip it.",
            reason,
            ENV_SWITCH,
        )


def _load(folder: KernelFolder) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, folder.library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {folder.library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _folder() -> KernelFolder | None:
    """This environment's kernel folder, computed once; None (with the warning) without a compiler."""
    if "folder" not in _state:
        try:
            _state["folder"] = kernel_folder()
        except KernelUnavailable as error:
            _state["module"] = None
            _warn_once(str(error))
            return None
    return _state["folder"]  # type: ignore[return-value]


def _try_load(folder: KernelFolder) -> ModuleType | None:
    try:
        _state["module"] = _load(folder)
    except Exception as error:  # a library that does not load is not retried in this process
        _state["module"] = None
        _warn_once(f"{folder.library} does not load: {type(error).__name__}: {error}")
    return _state["module"]  # type: ignore[return-value]


def native_module() -> ModuleType | None:
    """The built extension, or None when it is switched off, cannot be built, or is not built yet (then a
    background build starts, once per process). Never waits on a compile."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        folder = _folder()
        if folder is None:
            return None
        if folder.library.exists():
            return _try_load(folder)
        if folder.failure.exists():
            _state["module"] = None
            _warn_once(f"its build failed, see {folder.failure}; `transformers-cb build-kernels` retries")
            return None
        if "builder" not in _state:  # once per process: a later call finds the library when it is there
            logger.warning(
                "transformers_cb: the native CPU paged-attention kernel is not built yet; building it in the "
                "background into %s (the pure-torch kernels run until it is ready; `transformers-cb "
                "build-kernels` builds it ahead of use)",
                folder.path,
            )
            try:
                _state["builder"] = start_background_build(folder)
            except (OSError, subprocess.SubprocessError) as error:
                _state["module"] = None
                _warn_once(f"cannot start its build in {folder.path}: {error}")
        return None


def ensure_native_module(timeout: float | None = None) -> ModuleType | None:
    """The extension, built in this process first if needed (waiting at most `timeout` seconds for another
    builder): for `transformers-cb build-kernels` and the tests, never for a request. None (with the
    warning) when it cannot be built here or is switched off."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    with _lock:
        if _state.get("module") is not None:
            return _state["module"]  # type: ignore[return-value]
        folder = _folder()
        if folder is None:
            return None
        try:
            build(folder, wait=True, timeout=timeout)
        except KernelUnavailable as error:
            _state["module"] = None
            _warn_once(str(error))
            return None
        return _try_load(folder)


def native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps on `device` with a KV cache of `dtype` can use the native kernel now (an int8 cache:
    the kernel reads its pages and scales in place, whatever float dtype the model's queries have)."""
    readable = dtype in NATIVE_DTYPES or dtype == torch.int8
    return device.type == "cpu" and readable and native_module() is not None


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's oneDNN products and SDPA use them in bfloat16 / float16)."""
    probe = getattr(torch._C._cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def vector_kernels() -> bool:
    """Whether the built library has the vector attention kernels (`attend_vec` and its query tiles: AVX-512,
    native_vec_source.py, or AVX2 + FMA, native_vec8_source.py); False without the library."""
    module = native_module()
    return module is not None and bool(module.vector_kernels())


def vector_lanes() -> int:
    """The vector attention kernels' width in the built library: 16 (AVX-512), 8 (AVX2 + FMA), 0 (none, or no
    library)."""
    module = native_module()
    return 0 if module is None else int(module.vector_lanes())


def native_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_row: torch.Tensor,
    token_pos: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    slopes: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write into `out` `[T, H, D]` the attention of `query` `[T, H, D]` over the paged cache.

    Token t is at logical position `token_pos[t]` of block-table row `token_row[t]` (int64) and sees
    that row's keys up to itself, from `token_pos[t] - window + 1` when `window` is positive, from its
    attention chunk's start `token_pos[t] // C * C` when `window` is `-C` (chunked attention);
    `block_table` `[N, P]` int32 maps logical page p of a row to its page id. Query, caches and `out`
    share one dtype (float32, bfloat16 or float16); the kernel accumulates in float32. `slopes` `[H]`: ALiBi,
    `slope_h * (key_pos - query_pos)` added to each scaled logit (attention/families/alibi.py). `scales`: an int8
    cache's key and value scales `[S, Hkv]` float32 (memory/kv_quant.py; the caches are then int8, the
    query and `out` float32, bfloat16 or float16)."""
    module = native_module()
    if module is None:
        raise RuntimeError("the native paged-attention kernel is not available")
    module.paged_attention(
        query,
        key_cache,
        value_cache,
        token_row,
        token_pos,
        block_table,
        page_size,
        scale,
        window or 0,
        softcap or 0.0,
        sinks,
        slopes,
        out,
        None if scales is None else scales[0],
        None if scales is None else scales[1],
    )


def write_pages(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """`memory.kv_cache.write_slots`, an int8 cache's quantization by the native library where it runs (one
    call per stream, the same bits as `memory.kv_quant.quantize`; native_kv_quant_source.py)."""
    module = native_module() if scales is not None and key_cache.device.type == "cpu" else None
    if scales is None or module is None or key.dtype not in NATIVE_DTYPES:
        write_slots(key_cache, value_cache, slot_mapping, key, value, scales)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    for rows, cache, scale in ((key, key_cache, scales[0]), (value, value_cache, scales[1])):
        module.write_int8_rows(rows if rows.stride(-1) == 1 else rows.contiguous(), slots, cache, scale)
