"""A compressed-tensors checkpoint's decompression, run before the engine's first look at the model.

transformers 5.23 loads a compressed-tensors checkpoint (W8A16, W4A16: `weight_packed` / `weight_scale`
instead of `weight`) compressed, and compressed-tensors registers a forward pre-hook on the model
(`model.ct_decompress_hook`) that decompresses every Linear into a float `weight` at the model's first
forward, then removes itself: on the CPU it has no kernel that runs compressed weights. The engine calls
`model.forward`, not `model(...)` (the support probe and every step: the user's forward hooks do not see
them), so that hook never fired and the probe failed on a Linear without a `weight`. `decompress_pending`
runs the pending hook itself, once, as the model's first forward would: the model then holds exactly the
float weights `generate()` on it runs, which are its reference (docs/quantization.md). Before that, the
Linears whose values are GGUF blocks' (symmetric int4 / int8 with float16 scales) are kept compressed
(engine/weights/compressed_weights.py: `QuantizedLinear`s over those blocks), and the hook decompresses the rest.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .compressed_weights import keep_pending_compressed

logger = logging.getLogger(__name__)

HOOK_ATTRIBUTE = "ct_decompress_hook"  # compressed-tensors' `ModelCompressor.add_decompress_hook`


def decompress_pending(model: nn.Module) -> bool:
    """Run `model`'s pending compressed-tensors decompression hook (what its first forward would run);
    whether there was one. Then, hook or not (a `generate()` before the engine's first look fired it), undo
    the wrappers compressed-tensors leaves that move nothing (`undo_cpu_dispatch`,
    `unwrap_weight_only_forwards`)."""
    hook_id = getattr(getattr(model, HOOK_ATTRIBUTE, None), "id", None)  # a RemovableHandle's
    hook = model._forward_pre_hooks.get(hook_id) if isinstance(hook_id, int) else None
    if hook is not None:
        keep_pending_compressed(model)  # what can run compressed leaves the hook's reach first
        logger.info("compressed-tensors checkpoint: decompressing the rest now, as its first forward would")
        hook(model, ())
    undone = undo_cpu_dispatch(model)
    unwrapped = unwrap_weight_only_forwards(model)
    if undone or unwrapped:
        logger.info(
            "compressed-tensors checkpoint: its CPU-to-CPU offloading of %d modules and the quantized forwards "
            "of %d weight-only Linears undone",
            undone,
            unwrapped,
        )
    return hook is not None


def undo_cpu_dispatch(model: nn.Module) -> int:
    """Undo compressed-tensors' offloading where it moves nothing; how many modules it undid.

    Its decompression first converts the model to its own offloading (`from_accelerate`), which wraps every
    module, even on a CPU-only model: a `forward` of its own that moves the inputs to the "onload" device, and
    parameters in an `OffloadCache` that "onloads" each one at each access. With both devices the CPU that
    moves nothing but costs every call, and the engine's native paths (packed products, the direct layer
    step) do not take a module with a forward set by someone else. A module offloaded anywhere else (disk,
    another device) keeps it."""
    try:
        from compressed_tensors.offload.module import remove_module_offload
    except ImportError:
        return 0
    undone = 0
    for module in model.modules():
        cache = module._parameters
        if type(cache).__module__.split(".")[0] != "compressed_tensors":
            continue
        devices = (getattr(cache, "onload_device", None), getattr(cache, "offload_device", None))
        if all(device is not None and torch.device(device).type == "cpu" for device in devices):
            remove_module_offload(module, onload_tensors=False)
            # it puts the forward it wrapped back as an instance's: the class's own, mostly
            _drop_own_forward(module, getattr(module.__dict__.get("forward"), "__func__", None))
            undone += 1
    return undone


def unwrap_weight_only_forwards(model: nn.Module) -> int:
    """Drop compressed-tensors' quantized forward from the decompressed weight-only Linears; how many.

    At load it gives every quantized Linear a forward (`set_forward_quantized`) that quantizes activations
    where the scheme says so and fake-quantizes the weight until it is compressed; for a weight-only scheme
    past compression (decompressed) it calls the class's forward with the weight as it is, so dropping it
    changes no value, and lets the engine's packed products take the Linear."""
    try:
        from compressed_tensors.quantization import QuantizationStatus
    except ImportError:
        return 0
    unwrapped = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        scheme = getattr(module, "quantization_scheme", None)
        status = getattr(module, "quantization_status", None)
        if (
            forward is None
            or scheme is None
            or status is None
            or scheme.input_activations is not None
            or scheme.output_activations is not None
            or status < QuantizationStatus.COMPRESSED
        ):
            continue
        if _drop_own_forward(module, getattr(getattr(forward, "__func__", None), "__wrapped__", None)):
            unwrapped += 1
    return unwrapped


def _drop_own_forward(module: nn.Module, function: object) -> bool:
    """Delete `module`'s instance forward where it is its class's forward (`function` being what it wraps or
    is); whether it did."""
    forward = module.__dict__.get("forward")
    if forward is None or function is None or function is not type(module).forward:
        return False
    del module.forward
    return True
