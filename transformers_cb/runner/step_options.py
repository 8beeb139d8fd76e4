"""How the engine runs each step's forward: backend, decode fast path, compile settings, CUDA graphs.

Resolved once when the engine is built (engine/settings.py), from the model, its device, the
`ContinuousBatchingConfig` (read only) and its `DeviceOptions` (the GPU-only options as they apply on
the device), so a bad combination fails at start with an error naming it, and each step only reads the
result.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..attention.backends.fast_path import resolve_max_blocks_per_request
from ..attention.backends.flash_kernels import FlashKernel, is_flash_backend, load_flash_kernel
from ..attention.native.kernel import ENV_SWITCH as NATIVE_SWITCH
from ..attention.native.kernel import ensure_native_module
from ..attention.selection import FLASH_DEVICES, paged_implementation_for
from ..config.continuous_batching import ContinuousBatchingConfig, DeviceOptions
from ..memory.kept_heap import enabled_by_env as kept_heap_enabled
from ..memory.sizing import CPU_MEMORY_PERCENT, free_memory_bytes
from .forward.compiling import CompileSettings, resolve_compile_settings
from .layer_ops.native_layers import enabled_by_env as native_layers_enabled
from .products.packed_linear import packed_linear_available, rule_from_env, warn_once
from .products.packed_model import pack_bytes
from .products.small_rows import allow_row_packs
from .products.torchao_linear import intx_missing_bytes, prepare_intx_blocks

logger = logging.getLogger(__name__)

# flash-attn 2's paged kernels (its varlen block_table) need pages of a multiple of 256 tokens.
FA2_PAGE_MULTIPLE = 256


@dataclass(frozen=True)
class StepOptions:
    attn_implementation: str
    kernel: FlashKernel | None  # the flash kernel, for flash backends
    max_blocks_per_request: int  # decode fast path table width; 0: off
    compile_settings: CompileSettings
    cuda_graphs: tuple[bool, bool]  # (varlen, decode)
    async_batching: bool
    q_padding_interval_size: int
    kv_padding_interval_size: int
    max_cached_graphs: int
    # The model ignores `logits_to_keep` (the support check's probe saw it): the runner selects the rows.
    select_logit_rows: bool = False
    # Packed oneDNN products for the model's Linears (`runner/products/packed_model.py`): not turned off, the
    # platform passed its self-test, the rule packs at least one weight and the packs fit in memory.
    packed_linear: bool = False
    # The native decoder-layer ops (`runner/layer_ops/native_layers.py`): a CPU model, not turned off by
    # `TRANSFORMERS_CB_NATIVE_LAYERS=0` (the library itself may still be missing: then nothing is replaced).
    native_layers: bool = False
    # torchao weight-only Linears on native products (`runner/products/torchao_linear.py`: int8 on
    # `int8_matmul`, Intx on GGUF blocks written at resolution): a CPU model, packed products not turned off
    # (`packed_linear=False`, `TRANSFORMERS_CB_PACKED_LINEAR=0`), not batch-invariant (beyond a few rows
    # torchao's own product runs, whose kernel depends on the row count).
    torchao_linears: bool = False
    # `ContinuousBatchingConfig.batch_invariant`: every attention token on the native kernel, products and
    # activations in fixed shapes (runner/products/batch_invariant.py); packed products and native layer ops off.
    batch_invariant: bool = False
    # The host heap kept between steps (memory/kept_heap.py): a CPU model, not turned off by
    # `TRANSFORMERS_CB_KEEP_HEAP=0`.
    keep_heap: bool = False

    @property
    def is_flash(self) -> bool:
        return self.kernel is not None


def _check_page_size(kernel: FlashKernel, page_size: int) -> None:
    fa2_api = kernel.varlen_table_arg == "block_table" and "seqused_k" not in kernel.varlen_args
    if fa2_api and page_size % FA2_PAGE_MULTIPLE:
        raise ValueError(
            f"attn_implementation={kernel.name!r} reads the paged cache through flash-attn 2's block table, "
            f"which needs page_size to be a multiple of {FA2_PAGE_MULTIPLE}; got page_size={page_size}"
        )


def _check_sinks(kernel: FlashKernel, model: PreTrainedModel) -> None:
    """Attention sinks (an `s_aux` / `sinks` parameter of the attention modules, GPT-OSS and kin) need a
    kernel that takes them; refuse at start rather than fail every step."""
    takes_sinks = kernel.sinks_arg(kernel.varlen_args) or kernel.sinks_arg(kernel.kvcache_args)
    has_sinks = any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())
    if has_sinks and not takes_sinks:
        raise ValueError(
            f"attn_implementation={kernel.name!r}: this model's attention layers apply attention sinks "
            "(s_aux), which this flash kernel does not take; use 'paged|eager' or 'paged|sdpa'"
        )


def _resolve_graphs(device_options: DeviceOptions, kernel: FlashKernel | None) -> tuple[bool, bool]:
    graphs = device_options.cuda_graphs
    if any(graphs) and kernel is None:
        # The paged sdpa / eager glue loops over each step's request layout in Python: its shapes are not
        # static, so it cannot be replayed from a graph. Flash kernels read static-shape tensors.
        logger.warning(
            "use_cuda_graph=True needs a paged flash-attention backend (static-shape kernels); "
            "CUDA graphs turned off for %r",
            graphs,
        )
        return (False, False)
    return graphs


# Of the memory sizing leaves free (1 - max_memory_percent of what was available), the share packed copies
# may take: the rest stays for activations, the tokenizer, the server.
PACK_MEMORY_SHARE = 0.8


def pack_room(max_memory_percent: float | None) -> int:
    """Bytes the weights' copies (packed products, torchao Intx blocks) may take beside the cache."""
    percent = max_memory_percent or CPU_MEMORY_PERCENT
    return int(free_memory_bytes(torch.device("cpu")) * (1 - percent) * PACK_MEMORY_SHARE)


def resolve_packed_linear(
    model: PreTrainedModel, asked: bool | None, device_type: str, max_memory_percent: float | None
) -> bool:
    """`ContinuousBatchingConfig.packed_linear` (None: where it pays) as it applies to this model: the
    platform has packed products, the rule packs at least one weight, and the copies not built yet fit in
    what sizing leaves free (otherwise one warning and plain products; docs/design.md)."""
    if asked is False:
        return False
    rule = rule_from_env()
    if rule is None:
        return False
    if not packed_linear_available(next(model.parameters()).dtype, device_type, asked=asked is True):
        return False
    allow_row_packs(True)
    total, missing = pack_bytes(model, rule)
    if total == 0:
        return False
    room = pack_room(max_memory_percent)
    if missing > room:
        # the small-row products' own copies first: oneDNN's products alone may still fit
        allow_row_packs(False)
        total, missing = pack_bytes(model, rule)
        if total and missing <= room:
            warn_once(
                f"the small-row products' weight copies do not fit beside the cache ({room / 2**20:.0f} MiB "
                "free for packed copies): oneDNN's packed products alone run"
            )
            return True
        allow_row_packs(True)
    if missing > room:
        warn_once(
            f"the packed weight copies need {missing / 2**20:.0f} MiB and {room / 2**20:.0f} MiB are free "
            "beside the cache: plain products run (set packed_linear=False to silence this)"
        )
        return False
    return True


def prepare_torchao_linears(model: PreTrainedModel, max_memory_percent: float | None) -> None:
    """Write the GGUF blocks of the model's torchao Intx Linears (before the KV cache is sized, which then
    sees them) where they fit in the room weights' copies may take (otherwise one warning: torchao's product
    runs them). The int8 Linears need no copy."""
    missing = intx_missing_bytes(model)
    if missing and missing > (room := pack_room(max_memory_percent)):
        warn_once(
            f"the int4 weights' blocks need {missing / 2**20:.0f} MiB and {room / 2**20:.0f} MiB are free "
            "beside the cache: torchao's own product runs them"
        )
        return
    prepare_intx_blocks(model)


# How long an engine built with `batch_invariant=True` waits for the native kernel's build when this
# environment has none yet (at start, never on a request's path; `transformers-cb build-kernels` builds it
# ahead).
NATIVE_BUILD_TIMEOUT = 600.0


def check_batch_invariant(
    device_type: str, kernel: FlashKernel | None, compile_settings: CompileSettings
) -> None:
    """`batch_invariant=True` runs on the CPU's native attention kernel and eager forwards only: refuse the
    rest at start, naming it, rather than run steps whose rows would depend on each other."""
    problem = None
    if device_type != "cpu":
        problem = f"it runs on the CPU only (the model is on {device_type})"
    elif kernel is not None:
        problem = f"it needs the paged torch backends' native kernel, not {kernel.name!r}"
    elif compile_settings != CompileSettings():
        problem = (
            "a compiled forward may fuse a row's operations differently by step shape: set no compile level"
        )
    elif os.environ.get(NATIVE_SWITCH, "1") == "0":
        problem = f"it needs the native CPU attention kernel, which {NATIVE_SWITCH}=0 turns off"
    elif ensure_native_module(NATIVE_BUILD_TIMEOUT) is None:
        problem = "the native CPU attention kernel cannot be built or loaded here (see the warning above)"
    if problem is not None:
        raise ValueError(f"ContinuousBatchingConfig.batch_invariant=True: {problem}")


def resolve_step_options(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig,
    device_options: DeviceOptions,
    generation_config: GenerationConfig | None,
    device_type: str,
    has_sliding: bool,
    page_size: int,
    workload: list[int] | None,
    select_logit_rows: bool = False,
) -> StepOptions:
    name = paged_implementation_for(
        model.config._attn_implementation, model, config.auto_switch_to_flash, device_type
    )
    kernel = load_flash_kernel(name) if is_flash_backend(name) else None
    if kernel is not None:
        _check_page_size(kernel, page_size)
        _check_sinks(kernel, model)
    graphs = _resolve_graphs(device_options, kernel)
    compile_settings = resolve_compile_settings(config, generation_config, kernel is not None)
    invariant = config.batch_invariant
    if invariant:
        check_batch_invariant(device_type, kernel, compile_settings)
    torchao = (
        not invariant
        and device_type == "cpu"
        and config.packed_linear is not False
        and rule_from_env() is not None
    )
    if torchao:
        prepare_torchao_linears(model, config.max_memory_percent)
    return StepOptions(
        attn_implementation=name,
        kernel=kernel,
        max_blocks_per_request=resolve_max_blocks_per_request(
            config.max_blocks_per_request,
            has_sliding,
            kernel,
            device_type in FLASH_DEVICES,
            page_size,
            workload,
        ),
        compile_settings=compile_settings,
        cuda_graphs=graphs,
        async_batching=device_options.async_batching and any(graphs),
        q_padding_interval_size=config.q_padding_interval_size,
        kv_padding_interval_size=config.kv_padding_interval_size,
        max_cached_graphs=config.graph_cache_size,
        select_logit_rows=select_logit_rows,
        # Batch-invariant: packed products pick their kernel by row count, and the native SiLU·mul splits
        # a step's flat range between threads (a row's tail may take the scalar exp): both off.
        packed_linear=not invariant
        and resolve_packed_linear(model, config.packed_linear, device_type, config.max_memory_percent),
        native_layers=not invariant and device_type == "cpu" and native_layers_enabled(),
        torchao_linears=torchao,
        batch_invariant=invariant,
        keep_heap=device_type == "cpu" and kept_heap_enabled(),
    )


def without_traced_steps(options: StepOptions) -> StepOptions:
    """A state model's step splits its state layers by request in Python (runner/states/state_layers.py), which
    neither `torch.compile` nor a CUDA graph captures: those steps run eagerly."""
    if options.compile_settings != CompileSettings() or any(options.cuda_graphs) or options.async_batching:
        logger.warning(
            "state layers: compiled steps, CUDA graphs and async batching are off for this model (its state "
            "layers run each request's rows at its own slot, eagerly)"
        )
    return dataclasses.replace(
        options, compile_settings=CompileSettings(), cuda_graphs=(False, False), async_batching=False
    )
