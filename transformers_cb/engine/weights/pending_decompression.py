"""A compressed-tensors checkpoint's decompression, run before the engine's first look at the model.

transformers 5.23 loads a compressed-tensors checkpoint (W8A16, W4A16: `weight_packed` / `weight_scale`
instead of `weight`) compressed, and compressed-tensors registers a forward pre-hook on the model
(`model.ct_decompress_hook`) that decompresses every Linear into a float `weight` at the model's first
forward, then removes itself: on the CPU it has no kernel that runs compressed weights. The engine calls
`model.forward`, not `model(...)` (the support probe and every step: the user's forward hooks do not see
them), so that hook never fired and the probe failed on a Linear without a `weight`. `decompress_pending`
runs the pending hook itself, once, as the model's first forward would: the model then holds exactly the
float weights `generate()` on it runs, which are its reference (docs/quantization.md).
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)

HOOK_ATTRIBUTE = "ct_decompress_hook"  # compressed-tensors' `ModelCompressor.add_decompress_hook`


def decompress_pending(model: nn.Module) -> bool:
    """Run `model`'s pending compressed-tensors decompression hook (what its first forward would run);
    whether there was one."""
    hook_id = getattr(getattr(model, HOOK_ATTRIBUTE, None), "id", None)  # a RemovableHandle's
    hook = model._forward_pre_hooks.get(hook_id) if isinstance(hook_id, int) else None
    if hook is None:
        return False
    logger.info("compressed-tensors checkpoint: decompressing its weights now, as its first forward would")
    hook(model, ())
    return True
