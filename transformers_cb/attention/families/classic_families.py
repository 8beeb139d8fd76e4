"""The classic families' tables: for each family whose attention module computes attention itself (Bloom,
MPT, Falcon, GPT-J, CodeGen, GPT-Neo, GPT-NeoX-Japanese, XGLM, TrOCR, MVP, OpenAI-GPT, GIT, BLIP's text
decoder), one `ClassicFamily`: where it keeps its projections and how it shapes its heads (`project`), how it
finishes (`finish`), its scaling, window, ALiBi slopes and their form, and the model-level patches its run
needs. `FAMILIES` keys them by `modeling_<family>.<Class>`.

Apart from attention/families/classic.py, the adapter's mechanism (one adapted forward, installed for the run and
the probe): a new family is a table here, never a change there.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .alibi import FALCON_FORM, RELATIVE, AlibiForm, bloom_slopes, mpt_slopes

# (query, key, value) `[1, H, T, D]` from the module, the hidden states and the call's kwargs.
Project = Callable[[Any, torch.Tensor, dict], tuple[torch.Tensor, ...]]
# The module's return value from the attention output `[1, T, H * D]`, the call's args and kwargs.
Finish = Callable[[Any, torch.Tensor, tuple, dict], Any]


@dataclass(frozen=True)
class ClassicFamily:
    """How one family's attention module runs through the paged attention."""

    # The attention module's class as `modeling_<family>.<Class>` (OpenAI-GPT's is plain `Attention`).
    module_class: str
    project: Project
    finish: Finish
    scaling: Callable[[Any], float]
    # The layer's ALiBi slopes `[H]` from the module and the model's (text) config; None: no ALiBi.
    slopes: Callable[[Any, Any], torch.Tensor | None] | None = None
    alibi_form: AlibiForm = RELATIVE  # how the family adds them (attention/families/alibi.py)
    window: Callable[[Any, Any], int | None] = lambda module, config: None  # the layer's sliding window
    # (owner class name, attribute, replacement) set on each instance of the owner for the run.
    owner_patches: tuple[tuple[str, str, Any], ...] = field(default_factory=tuple)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[B, T, H * D]` as `[B, H, T, D]`."""
    return x.view(*x.shape[:2], heads, -1).transpose(1, 2)


# -- Bloom: fused query_key_value laid out [H, 3, D], ALiBi, the residual added in the module ----------------
def _bloom_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    fused = module.query_key_value(hidden).view(*hidden.shape[:2], module.num_heads, 3, module.head_dim)
    return tuple(fused[..., i, :].transpose(1, 2) for i in range(3))


def _bloom_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    residual = args[1] if len(args) > 1 else kwargs["residual"]
    if module.pretraining_tp > 1 and module.slow_but_exact:
        # Bloom's exact-TP path, as it writes it (no bias added there).
        slices = module.hidden_size / module.pretraining_tp
        output = torch.zeros_like(out)
        for i in range(module.pretraining_tp):
            part = slice(int(i * slices), int((i + 1) * slices))
            output = output + torch.nn.functional.linear(out[:, :, part], module.dense.weight[:, part])
    else:
        output = module.dense(out)
    dropped = torch.nn.functional.dropout(output, p=module.hidden_dropout, training=module.training)
    return residual + dropped, None


def _no_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Bloom's model-level ALiBi tensor, unused by the adapted layers (the kernels add the bias)."""
    return torch.zeros(1, dtype=dtype, device=attention_mask.device)


BLOOM = ClassicFamily(
    module_class="modeling_bloom.BloomAttention",
    project=_bloom_project,
    finish=_bloom_finish,
    scaling=lambda module: module.inv_norm_factor,
    slopes=lambda module, config: bloom_slopes(module.num_heads),
    owner_patches=(("BloomModel", "build_alibi_tensor", _no_alibi_tensor),),
)


# -- MPT: fused Wqkv laid out [3, H, D], its clip_qkv, ALiBi with its own slopes ------------------------------
def _mpt_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    mixed = module.Wqkv(hidden)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    return tuple(_heads(x, module.n_heads) for x in mixed.chunk(3, dim=2))


def _mpt_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return module.out_proj(out), None


def _mpt_slopes(module: Any, config: Any) -> torch.Tensor:
    # MptModel builds its tensor with the default `alibi_bias_max` (8), whatever `attn_config` says, and adds
    # it whether `attn_config.alibi` is set or not: so do the slopes here.
    return mpt_slopes(module.n_heads)


MPT = ClassicFamily(
    module_class="modeling_mpt.MptAttention",
    project=_mpt_project,
    finish=_mpt_finish,
    scaling=lambda module: module.softmax_scale,
    slopes=_mpt_slopes,
)


# -- GPT-J, CodeGen: rotary on the first `rotary_dim` of each head, interleaved pairs, from sin/cos tables -----
def _every_two_rotary(
    module: Any, heads: tuple[torch.Tensor, ...], kwargs: dict, cast: bool
) -> tuple[torch.Tensor, ...]:
    """GPT-J's rotary through the module's own `apply_rotary_pos_emb` (its modeling module's), on query and
    key `[B, T, H, D]`; returns query, key, value as `[B, H, T, D]`."""
    query, key, value = heads
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    position_ids = kwargs["position_ids"]
    sincos = module.embed_positions.to(position_ids.device)[position_ids]
    if cast:  # GPT-J casts the table to the key's dtype, CodeGen keeps it in float32
        sincos = sincos.to(key.dtype)
    sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    dim = module.rotary_dim
    if dim is not None:
        key = torch.cat([rotate(key[..., :dim], sin, cos), key[..., dim:]], dim=-1)
        query = torch.cat([rotate(query[..., :dim], sin, cos), query[..., dim:]], dim=-1)
    else:
        key, query = rotate(key, sin, cos), rotate(query, sin, cos)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _gptj_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    heads, dim = module.num_attention_heads, module.head_dim
    projected = (module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden))
    return _every_two_rotary(module, tuple(x.view(*x.shape[:2], heads, dim) for x in projected), kwargs, True)


def _codegen_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    # Its fused qkv_proj is laid out for 4 model-parallel shards of (query, value, key) each.
    shards = 4
    qkv = module.qkv_proj(hidden)
    split = qkv.reshape(qkv.shape[:-1] + (shards, -1))
    local = module.head_dim * module.num_attention_heads // shards
    query, value, key = torch.split(split, local, dim=-1)
    heads = tuple(
        module._split_heads(x, module.num_attention_heads, module.head_dim, mp_num=shards)
        for x in (query, key, value)
    )
    query, key, value = _every_two_rotary(module, heads, kwargs, False)
    return query, key.to(hidden.dtype), value


def _out_proj_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return module.resid_dropout(module.out_proj(out)), None


GPTJ = ClassicFamily(
    module_class="modeling_gptj.GPTJAttention",
    project=_gptj_project,
    finish=_out_proj_finish,
    scaling=lambda module: 1.0 / module.scale_attn,
)
CODEGEN = ClassicFamily(
    module_class="modeling_codegen.CodeGenAttention",
    project=_codegen_project,
    finish=_out_proj_finish,
    scaling=lambda module: 1.0 / module.scale_attn,
)


# -- Falcon: fused query_key_value in one of three layouts (multi-query, grouped new decoder architecture,
# plain), its own `_split_heads` reads them; rotary, or (`alibi=True`) ALiBi of its own form ---------------
def _falcon_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    query, key, value = (x.transpose(1, 2) for x in module._split_heads(module.query_key_value(hidden)))
    if module.config.alibi:
        return query, key, value
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    cos, sin = kwargs["position_embeddings"]
    query, key = rotate(query, key, cos, sin)
    return query, key, value


def _dense_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return module.dense(out), None


FALCON = ClassicFamily(
    module_class="modeling_falcon.FalconAttention",
    project=_falcon_project,
    finish=_dense_finish,
    scaling=lambda module: module.inv_norm_factor,
    slopes=lambda module, config: bloom_slopes(module.num_heads) if config.alibi else None,
    alibi_form=FALCON_FORM,
    # FalconModel builds its ALiBi tensor from a 2D padding mask and folds it into the causal mask: off for
    # the run (the kernels add the bias; the adapted layers read `config.alibi`, not the model's flag).
    owner_patches=(("FalconModel", "use_alibi", False),),
)


# -- XGLM, TrOCR, MVP (BART-style decoders): separate projections, the query scaled before the product -----
def _xglm_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    if kwargs.get("key_value_states") is not None:
        raise NotImplementedError("cross-attention needs the encoder's states, not a paged cache")
    if kwargs.get("attn_prompt") is not None:
        raise NotImplementedError(
            "MVP's attention prompts (use_prompt) prepend keys and values of their own to every layer's cache"
        )
    query = module.q_proj(hidden) * module.scaling
    return tuple(_heads(x, module.num_heads) for x in (query, module.k_proj(hidden), module.v_proj(hidden)))


def _bare_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """The attention output as is: the output projection is the owner's (BERT's `SelfOutput`)."""
    return out, None


def _out_proj_only(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return module.out_proj(out), None


XGLM = ClassicFamily(
    module_class="modeling_xglm.XGLMAttention",
    project=_xglm_project,
    finish=_out_proj_only,
    scaling=lambda module: 1.0,
)


# -- OpenAI-GPT: a fused Conv1D c_attn, scaled by 1/sqrt(D) only when the block asks (`scale`) ------------------
def _openai_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    return tuple(_heads(x, module.n_head) for x in module.c_attn(hidden).split(module.split_size, dim=2))


def _openai_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return [module.resid_dropout(module.c_proj(out))]


OPENAI_GPT = ClassicFamily(
    module_class="modeling_openai.Attention",
    project=_openai_project,
    finish=_openai_finish,
    scaling=lambda module: 1.0 / math.sqrt(module.split_size // module.n_head) if module.scale else 1.0,
)


# -- GPT-NeoX-Japanese: fused qkv laid out [H, 3, D], rotary on the first rotary_ndims, a bias handed back ----
def _neox_japanese_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    size = module.head_size
    qkv = module.query_key_value(hidden).view(*hidden.shape[:2], module.num_attention_heads, 3 * size)
    query, key, value = (qkv[..., i * size : (i + 1) * size].transpose(1, 2) for i in range(3))
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    cos, sin = kwargs["position_embeddings"]
    dim = module.rotary_ndims
    query_rot, key_rot = rotate(query[..., :dim], key[..., :dim], cos, sin)
    return (
        torch.cat((query_rot, query[..., dim:]), dim=-1),
        torch.cat((key_rot, key[..., dim:]), dim=-1),
        value,
    )


def _neox_japanese_finish(module: Any, out: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return module.dense(out), None, module.dense_bias


GPT_NEOX_JAPANESE = ClassicFamily(
    module_class="modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention",
    project=_neox_japanese_project,
    finish=_neox_japanese_finish,
    scaling=lambda module: 1.0 / module.norm_factor,
)


# -- GPT-Neo: separate projections, no scaling at all, "local" layers a sliding window of `window_size` ---------
def _gpt_neo_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    return tuple(
        _heads(x, module.num_heads)
        for x in (module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden))
    )


GPT_NEO = ClassicFamily(
    module_class="modeling_gpt_neo.GPTNeoSelfAttention",
    project=_gpt_neo_project,
    finish=_out_proj_finish,
    scaling=lambda module: 1.0,
    window=lambda module, config: config.window_size if module.attention_type == "local" else None,
)

TROCR = ClassicFamily(
    module_class="modeling_trocr.TrOCRAttention",
    project=_xglm_project,
    finish=_out_proj_only,
    scaling=lambda module: 1.0,
)
MVP = ClassicFamily(
    module_class="modeling_mvp.MvpAttention",
    project=_xglm_project,
    finish=_out_proj_only,
    scaling=lambda module: 1.0,
)


# -- GIT, BLIP's text decoder (BERT-style self-attention): separate query/key/value, scaled by 1/sqrt(D) ------
def _bert_project(module: Any, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    if kwargs.get("encoder_hidden_states") is not None:
        raise NotImplementedError("cross-attention needs the encoder's states, not a paged cache")
    heads = module.num_attention_heads
    return tuple(_heads(x, heads) for x in (module.query(hidden), module.key(hidden), module.value(hidden)))


GIT = ClassicFamily(
    module_class="modeling_git.GitSelfAttention",
    project=_bert_project,
    finish=_bare_finish,
    scaling=lambda module: 1.0 / math.sqrt(module.attention_head_size),
)
BLIP_TEXT = ClassicFamily(
    module_class="modeling_blip_text.BlipTextSelfAttention",
    project=_bert_project,
    finish=_bare_finish,
    scaling=lambda module: 1.0 / math.sqrt(module.attention_head_size),
)

FAMILIES = {
    family.module_class: family
    for family in (
        BLOOM,
        MPT,
        GPTJ,
        CODEGEN,
        FALCON,
        XGLM,
        OPENAI_GPT,
        GPT_NEOX_JAPANESE,
        GPT_NEO,
        TROCR,
        MVP,
        GIT,
        BLIP_TEXT,
    )
}
