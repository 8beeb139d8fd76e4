"""`ContinuousBatchingConfig`: the hardware-side settings (memory, scheduling, kernels).

This room owns the field list, their validation (`validate()`: types and ranges, `ValueError` only)
and `resolve_device_options` (GPU-only options on another device, as a `DeviceOptions`). Everything
that depends on the model and the device (`num_blocks`, `max_batch_tokens`, ...) is resolved into
separate frozen objects (`memory/sizing.py`, `engine/settings.py`'s `EngineSettings`): no config, the user's or
the engine's copy, is ever written after it is validated.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import CompileConfig

logger = logging.getLogger(__name__)

SCHEDULER_TYPES = ("fifo", "prefill_first", "decode_first")
# CUDA graphs kept alive when `max_cached_graphs` is not set (least recently used ones are dropped).
DEFAULT_MAX_CACHED_GRAPHS = 32
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0, "decode_first": 0.15}
MIN_PAGE_SIZE = 4
# `kv_cache_dtype` (ours, named like vLLM's): "auto" stores K/V in the model's dtype; "int8" stores them as
# int8 with a float32 scale per (token, KV head) (memory/kv_quant.py; docs/quantization.md, "int8 KV cache").
KV_CACHE_DTYPES = ("auto", "int8")


def _check_range(name: str, value: object, allowed: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"ContinuousBatchingConfig.{name}={value!r} is invalid: allowed {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_compile_config(value: object) -> bool:
    return isinstance(value, (CompileConfig, dict))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class ContinuousBatchingConfig:
    """Hardware-side settings of continuous batching. See `docs/config.md` for every field.

    Every field's feature is built, with or without tensor parallelism. Creating (or `copy()`-ing) a config runs `validate()`, which raises
    `ValueError` for a value of the wrong type or out of range. Options that need a CUDA device are
    turned off with a warning on other devices (`resolve_device_options`, at engine start); whether the
    model and the rest of the setup can run is checked by the engine when it starts.
    """

    page_size: int = 256
    num_blocks: int | None = None
    max_memory_percent: float | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    allow_block_sharing: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    return_logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    per_request_processors: bool = False
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 64
    kv_padding_interval_size: int = 16384
    use_async_batching: bool | None = False
    default_compile_level: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    max_blocks_per_request: int | None = None
    auto_switch_to_flash: bool = True
    cpu_group_timeout: float | None = 300.0
    seed: int | None = None
    max_queue_size: int = 0
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    # Ours (not transformers'): packed oneDNN products for the model's CPU Linears during the run. None
    # (default): on where they pay (x86 with oneDNN, fp32 / bf16, the weights the measured rule picks,
    # the copies fit in memory); True: the same, warning when the platform has none; False: off.
    packed_linear: bool | None = None
    # Ours: speculative decoding only in steps where at most this many requests run (vLLM's
    # `disable_by_batch_size`); None: 8 on CPU, where a larger batch's step is compute-bound and checked
    # draft tokens cost what decoded ones do (docs/speculative_decoding.md), no limit on CUDA.
    speculation_max_batch_size: int | None = None
    # Ours: a request's tokens and logprobs the same bits whatever else runs in its steps and however its
    # prompt is chunked (CPU only: every attention token on the native kernel, products in fixed-shape
    # calls, activations on the vector path; packed products and native layer ops off). docs/config.md,
    # "Batch-invariant mode": what it covers and what it costs.
    batch_invariant: bool = False
    # Ours (transformers has no such field; named like vLLM's): "auto", K/V pages in the model's dtype;
    # "int8", pages of int8 with a float32 scale per (token, KV head): about 2x (bf16) / 4x (fp32) the
    # pages in the same memory, outputs no longer bitwise generate()'s (docs/quantization.md).
    kv_cache_dtype: str = "auto"
    # Deprecated aliases, as in transformers: each warns and maps onto its replacement.
    use_default_compile_configs: bool | None = field(default=None, repr=False)
    max_cached_graphs: int | None = field(default=None, repr=False)
    block_size: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.use_default_compile_configs is not None:
            warnings.warn(
                "ContinuousBatchingConfig.use_default_compile_configs is deprecated, use default_compile_level "
                "instead (True means level 3, False level 0)",
                FutureWarning,
                stacklevel=3,
            )
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
            self.use_default_compile_configs = None
        if self.max_cached_graphs is not None:
            warnings.warn(
                "ContinuousBatchingConfig.max_cached_graphs is deprecated in transformers (5.13); here it still "
                "bounds the CUDA graph cache (least recently used graphs are dropped)",
                FutureWarning,
                stacklevel=3,
            )
        for name in ("varlen_compile_config", "decode_compile_config"):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, CompileConfig(**getattr(self, name)))
        if self.block_size is not None:
            warnings.warn(
                "ContinuousBatchingConfig.block_size is deprecated, use page_size instead",
                FutureWarning,
                stacklevel=3,
            )
            self.page_size = self.block_size
            self.block_size = None
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the field, the value and the allowed range for the first invalid
        value; nothing else is checked here (combinations are the engine's, at start)."""
        _check_range("page_size", self.page_size, f"an int >= {MIN_PAGE_SIZE}", _is_int(self.page_size))
        _check_range(
            "page_size", self.page_size, f"an int >= {MIN_PAGE_SIZE}", self.page_size >= MIN_PAGE_SIZE
        )
        for name in ("num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            _check_range(
                name, value, "None (auto) or an int >= 1", value is None or (_is_int(value) and value >= 1)
            )
        value = self.max_memory_percent
        _check_range(
            "max_memory_percent",
            value,
            "None (auto) or a number in (0, 1]",
            value is None or (_is_number(value) and 0 < value <= 1),
        )
        _check_range(
            "scheduler_type",
            self.scheduler_type,
            f"one of {SCHEDULER_TYPES}",
            self.scheduler_type in SCHEDULER_TYPES,
        )
        value = self.safety_margin
        _check_range(
            "safety_margin",
            value,
            "None (scheduler default) or a number in [0, 1]",
            value is None or (_is_number(value) and 0 <= value <= 1),
        )
        value = self.cpu_offload_space
        _check_range(
            "cpu_offload_space",
            value,
            "None or a number >= 0 (GiB)",
            value is None or (_is_number(value) and value >= 0),
        )
        value = self.cpu_offload_space_safety_threshold
        _check_range(
            "cpu_offload_space_safety_threshold",
            value,
            "a number in (0, 1]",
            _is_number(value) and 0 < value <= 1,
        )
        for name in ("q_padding_interval_size", "kv_padding_interval_size"):
            value = getattr(self, name)
            _check_range(name, value, "an int >= 0 (0 = the preset)", _is_int(value) and value >= 0)
        value = self.default_compile_level
        _check_range("default_compile_level", value, "an int in 0..3", _is_int(value) and 0 <= value <= 3)
        value = self.max_cached_graphs
        _check_range(
            "max_cached_graphs",
            value,
            "None (default) or an int >= 1",
            value is None or (_is_int(value) and value >= 1),
        )
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            _check_range(
                name, value, "None, a dict or a CompileConfig", value is None or _is_compile_config(value)
            )
        value = self.max_blocks_per_request
        _check_range(
            "max_blocks_per_request",
            value,
            "None (auto) or an int >= 0",
            value is None or (_is_int(value) and value >= 0),
        )
        value = self.cpu_group_timeout
        _check_range(
            "cpu_group_timeout",
            value,
            "None or a number > 0 (seconds)",
            value is None or (_is_number(value) and value > 0),
        )
        _check_range("seed", self.seed, "None or an int", self.seed is None or _is_int(self.seed))
        _check_range("top_logprobs", self.top_logprobs, "an int >= 0", _is_int(self.top_logprobs))
        _check_range("top_logprobs", self.top_logprobs, "an int >= 0", self.top_logprobs >= 0)
        _check_range("max_queue_size", self.max_queue_size, "an int >= 0", _is_int(self.max_queue_size))
        _check_range("max_queue_size", self.max_queue_size, "an int >= 0", self.max_queue_size >= 0)
        limit = self.speculation_max_batch_size
        _check_range(
            "speculation_max_batch_size",
            limit,
            "None or an int >= 1",
            limit is None or (_is_int(limit) and limit >= 1),
        )
        for name in (
            "allow_block_sharing",
            "return_logprobs",
            "prompt_logprobs",
            "per_request_processors",
            "auto_switch_to_flash",
            "drop_unsupported_processors",
            "disable_nccl_graph_mixing",
            "batch_invariant",
        ):
            value = getattr(self, name)
            _check_range(name, value, "a bool", isinstance(value, bool))
        _check_range(
            "packed_linear",
            self.packed_linear,
            "None (auto) or a bool",
            self.packed_linear is None or isinstance(self.packed_linear, bool),
        )
        _check_range(
            "use_async_batching",
            self.use_async_batching,
            "None (auto) or a bool",
            self.use_async_batching is None or isinstance(self.use_async_batching, bool),
        )
        _check_range(
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"one of {KV_CACHE_DTYPES}",
            isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype in KV_CACHE_DTYPES,
        )
        graphs = self.use_cuda_graph
        _check_range(
            "use_cuda_graph",
            graphs,
            "None (auto), a bool, or a (varlen, decode) pair of bools",
            graphs is None
            or isinstance(graphs, bool)
            or (isinstance(graphs, tuple) and len(graphs) == 2 and all(isinstance(g, bool) for g in graphs)),
        )

    @property
    def wants_cuda_graphs(self) -> bool:
        return (
            any(self.use_cuda_graph) if isinstance(self.use_cuda_graph, tuple) else bool(self.use_cuda_graph)
        )

    @property
    def cuda_graph_paths(self) -> tuple[bool, bool]:
        """`use_cuda_graph` as a (varlen, decode) pair."""
        graphs = self.use_cuda_graph
        return graphs if isinstance(graphs, tuple) else (bool(graphs), bool(graphs))

    @property
    def graph_cache_size(self) -> int:
        return self.max_cached_graphs if self.max_cached_graphs is not None else DEFAULT_MAX_CACHED_GRAPHS

    @property
    def resolved_safety_margin(self) -> float:
        if self.safety_margin is not None:
            return float(self.safety_margin)
        return DEFAULT_SAFETY_MARGIN[self.scheduler_type]

    def copy(self, **changes: Any) -> ContinuousBatchingConfig:
        """A validated copy with `changes` applied; the original is untouched."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DeviceOptions:
    """The GPU-only options as they apply on the engine's device (`resolve_device_options`)."""

    cuda_graphs: tuple[bool, bool]  # `use_cuda_graph` as a (varlen, decode) pair; off unless on CUDA
    async_batching: bool  # `use_async_batching`, only with graphs on


def resolve_device_options(config: ContinuousBatchingConfig, device_type: str) -> DeviceOptions:
    """Settle the options that only mean something on a GPU; `config` is read, never written.

    As in transformers, a non-CUDA run logs a warning and turns CUDA graphs and async batching off
    instead of failing, so code written for a GPU box runs here. Async batching needs graphs: asked for
    without them, it is turned off with a warning. Which steps graphs apply to is decided by the engine
    (runner/step_options.py).
    """
    if device_type != "cuda":
        requested = {
            "use_cuda_graph (CUDA graphs)": config.wants_cuda_graphs,
            "use_async_batching (async batching)": bool(config.use_async_batching),
        }
        for feature, wanted in requested.items():
            if wanted:
                logger.warning(
                    "ContinuousBatchingConfig.%s needs a CUDA device; turned off on %s", feature, device_type
                )
        return DeviceOptions(cuda_graphs=(False, False), async_batching=False)
    graphs = config.cuda_graph_paths  # None (auto) means off: graphs are opt-in
    if config.use_async_batching and not any(graphs):
        logger.warning("ContinuousBatchingConfig.use_async_batching needs use_cuda_graph=True; turned off")
    return DeviceOptions(cuda_graphs=graphs, async_batching=bool(config.use_async_batching) and any(graphs))


# Speculation's default batch limit on CPU (`speculation_max_batch_size`): measured on this project's
# benchmark (docs/speculative_decoding.md, "Measured"): lookup pays at 4 requests, breaks even at 8 and
# costs 9-14 % at 16.
CPU_SPECULATION_MAX_BATCH = 8


def resolve_speculation_max_batch(config: ContinuousBatchingConfig, device_type: str) -> int | None:
    """The most running requests a step may speculate with (None: no limit)."""
    if config.speculation_max_batch_size is not None:
        return config.speculation_max_batch_size
    return CPU_SPECULATION_MAX_BATCH if device_type == "cpu" else None
