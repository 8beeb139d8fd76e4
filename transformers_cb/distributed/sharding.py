"""How a tensor-parallel model is split, read from transformers' own TP state.

`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` shards the weights with the
model's TP plan and records `model._tp_size` and `model._device_mesh`. Under the base plans of the
supported models, `k_proj` / `v_proj` are split column-wise, so each rank computes (and caches)
`num_key_value_heads / tp_size` KV heads; the paged cache of a rank holds only those. Models whose
layers differ in KV head shape (`ModelShape.layer_head_shapes`) are refused under sharded KV heads.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from transformers import PreTrainedModel

from ..memory.sizing import ModelShape

# The documents' reason for refusing `device_map` with `distributed_config` (guide, "Tensor parallelism").
DEVICE_MAP_REASON = (
    "device_map places whole modules on given devices while tensor parallelism splits the same "
    "parameters across all devices, so the two conflict"
)
SHARDED_STYLES = ("colwise", "local_colwise", "colwise_gather_output")


def tp_size_of(model: PreTrainedModel) -> int:
    """The model's tensor-parallel degree (1 when it was not sharded)."""
    return int(getattr(model, "_tp_size", None) or 1)


def tp_process_group(model: PreTrainedModel) -> dist.ProcessGroup:
    """The process group the model's own TP collectives run on (its device mesh's `tp` dimension)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ValueError("the model has tp_size > 1 but no device mesh: load it with distributed_config=")
    names = mesh.mesh_dim_names or ()
    for name in names:
        if name != "tp" and mesh[name].size() > 1:
            raise NotImplementedError(
                f"continuous batching supports tensor parallelism only; the model's mesh has {name}="
                f"{mesh[name].size()}"
            )
    return (mesh["tp"] if "tp" in names else mesh).get_group()


def kv_heads_are_sharded(model: PreTrainedModel) -> bool:
    """True when the model's TP plan splits the key/value projections (so the KV heads)."""
    plan = getattr(model, "tp_plan", None) or {}
    for projection in ("k_proj", "v_proj"):
        styles = [style for name, style in plan.items() if name.endswith(f"self_attn.{projection}")]
        if not any(style in SHARDED_STYLES for style in styles):
            return False
    return True


def kv_heads_per_shard(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds; raises `ValueError` naming both numbers and the sizes that work."""
    if num_kv_heads % tp_size != 0:
        valid = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]
        raise ValueError(
            f"tensor parallelism: tp_size={tp_size} does not divide the model's num_key_value_heads="
            f"{num_kv_heads}; each rank must hold whole KV heads. Valid tp sizes (--nproc-per-node): {valid}"
        )
    return num_kv_heads // tp_size


def check_no_device_map(model: PreTrainedModel) -> None:
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        raise ValueError(f"do not set device_map together with distributed_config: {DEVICE_MAP_REASON}")


def shard_shape(model: PreTrainedModel, shape: ModelShape, tp_size: int) -> ModelShape:
    """The shape one rank's cache is sized for. Raises at start for an impossible split."""
    if tp_size == 1:
        return shape
    check_no_device_map(model)
    if not kv_heads_are_sharded(model):
        return shape
    if shape.latent is not None:
        # Why: a latent row is one head shared by every query head; each rank would hold all of it.
        raise NotImplementedError(
            f"tensor parallelism (tp_size={tp_size}) of a multi-latent attention model (kv_lora_rank) is not "
            "supported yet: its latent pages hold one KV head per token, which no rank split divides; run it "
            "with tp_size=1"
        )
    if shape.layer_head_shapes:
        # Why: each KV group would need its own share of heads (and some, e.g. Gemma 4's single global
        # KV head, cannot be split); not built yet.
        raise NotImplementedError(
            f"tensor parallelism (tp_size={tp_size}) of a model whose layers differ in KV head shape "
            f"(per_layer_config: {sorted(set(shape.layer_head_shapes))} as (KV heads, head dim)) is not "
            "supported yet; run it with tp_size=1"
        )
    return dataclasses.replace(shape, num_kv_heads=kv_heads_per_shard(shape.num_kv_heads, tp_size))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
