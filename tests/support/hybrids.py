"""Tiny, valid, seeded models of the linear-attention and state-space families (issue 32).

Hand-written rather than shrunk from the classes' defaults (conformance/coverage/shrink.py): the
state-space widths must agree (heads x head size = expand x hidden, heads divisible by groups, ...),
which a generic shrink breaks for several families. Each hybrid mixes attention and state layers (two
of each where the family lets a config say so), hidden 64, a 256-token vocabulary; state-space chunks
are small (8) so that the prompts cross them. Every config here runs `generate()`.

`build_hybrid(name)` returns the eval model on CPU (seeded weights, eos off in its generation config);
`HYBRIDS` names the families built, `UNBUILDABLE` those that cannot be, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

SEED = 0
VOCAB = 256
HIDDEN = 64
INTERMEDIATE = 128
LIN, FULL = "linear_attention", "full_attention"
ALTERNATING = [LIN, FULL, LIN, FULL]
# Stronger than the usual 0.02, so that a tiny random model's layers matter to its logits (a wrong
# state then changes the greedy tokens instead of hiding under near-ties).
INITIALIZER_RANGE = 0.1

_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "initializer_range": INITIALIZER_RANGE,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Untied: with tied embeddings a tiny random model mostly echoes its last input token.
    "tie_word_embeddings": False,
}
_QWEN_LINEAR = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Mamba-2 style mixers: 4 heads of 32 = expand (2) x hidden (64), 2 groups, state 16, chunks of 8.
_MAMBA2 = {
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
}


def _config(name: str) -> tuple[str, str, dict[str, Any]]:
    """(config class, model class, config kwargs) of family `name`."""
    if name == "qwen3_5":
        return (
            "Qwen3_5TextConfig",
            "Qwen3_5ForCausalLM",
            {**_COMMON, **_ATTENTION, **_QWEN_LINEAR, "num_hidden_layers": 4, "layer_types": ALTERNATING},
        )
    if name == "qwen3_5_moe":
        return (
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeForCausalLM",
            {
                **_COMMON,
                **_ATTENTION,
                **_QWEN_LINEAR,
                **_EXPERTS,
                "shared_expert_intermediate_size": 32,
                "num_hidden_layers": 4,
                "layer_types": ALTERNATING,
            },
        )
    if name == "qwen3_next":
        return (
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            {
                **_COMMON,
                **_ATTENTION,
                **_QWEN_LINEAR,
                **_EXPERTS,
                "shared_expert_intermediate_size": 32,
                "num_hidden_layers": 4,
                "layer_types": ALTERNATING,
            },
        )
    if name == "mamba2":
        return (
            "Mamba2Config",
            "Mamba2ForCausalLM",
            {
                **_COMMON,
                "num_hidden_layers": 2,
                "num_heads": 4,
                "head_dim": 32,
                "expand": 2,
                "n_groups": 2,
                "state_size": 16,
                "conv_kernel": 4,
                "chunk_size": 8,
                "time_step_rank": 8,
            },
        )
    if name in ("mamba", "falcon_mamba"):
        return (
            "MambaConfig" if name == "mamba" else "FalconMambaConfig",
            "MambaForCausalLM" if name == "mamba" else "FalconMambaForCausalLM",
            {
                **_COMMON,
                "num_hidden_layers": 2,
                "state_size": 16,
                "expand": 2,
                "conv_kernel": 4,
                "time_step_rank": 8,
            },
        )
    if name == "jamba":
        return (
            "JambaConfig",
            "JambaForCausalLM",
            {
                **_COMMON,
                **_ATTENTION,
                "num_hidden_layers": 4,
                "attn_layer_period": 2,
                "attn_layer_offset": 1,
                "expert_layer_period": 2,
                "expert_layer_offset": 1,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_dt_rank": 8,
                "use_mamba_kernels": False,
            },
        )
    if name == "bamba":
        return (
            "BambaConfig",
            "BambaForCausalLM",
            {**_COMMON, **_ATTENTION, **_MAMBA2, "num_hidden_layers": 4, "attn_layer_indices": [1, 3]},
        )
    if name == "granitemoehybrid":
        return (
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            {
                **_COMMON,
                **_ATTENTION,
                **_MAMBA2,
                "num_hidden_layers": 4,
                "layer_types": ALTERNATING,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "shared_intermediate_size": 32,
            },
        )
    if name == "falcon_h1":
        # Every Falcon-H1 layer runs attention and a Mamba-2 mixer side by side.
        return (
            "FalconH1Config",
            "FalconH1ForCausalLM",
            {**_COMMON, **_ATTENTION, **_MAMBA2, "num_hidden_layers": 2, "mamba_d_ssm": 128},
        )
    if name == "nemotron_h":
        return (
            "NemotronHConfig",
            "NemotronHForCausalLM",
            {
                **_COMMON,
                **_ATTENTION,
                "num_hidden_layers": 6,
                "layers_block_type": [LIN, FULL, "mlp", LIN, FULL, "moe"],
                "mamba_num_heads": 4,
                "mamba_head_dim": 32,
                "n_groups": 2,
                "ssm_state_size": 16,
                "conv_kernel": 4,
                "expand": 2,
                "chunk_size": 8,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "moe_shared_expert_intermediate_size": 32,
                "use_mamba_kernels": False,
            },
        )
    if name == "lfm2":
        return (
            "Lfm2Config",
            "Lfm2ForCausalLM",
            {
                **_COMMON,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 4,
                "layer_types": ["conv", FULL, "conv", FULL],
                "block_auto_adjust_ff_dim": False,
            },
        )
    if name == "lfm2_moe":
        return (
            "Lfm2MoeConfig",
            "Lfm2MoeForCausalLM",
            {
                **_COMMON,
                **_EXPERTS,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 4,
                "num_dense_layers": 1,
                "layer_types": ["conv", FULL, "conv", FULL],
            },
        )
    if name == "zamba2":
        return (
            "Zamba2Config",
            "Zamba2ForCausalLM",
            {
                **_COMMON,
                "num_attention_heads": 4,
                "num_hidden_layers": 4,
                "layers_block_type": [LIN, "hybrid", LIN, "hybrid"],
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_ngroups": 2,
                "n_mamba_heads": 4,
                "chunk_size": 8,
                "use_mamba_kernels": False,
            },
        )
    if name == "olmo_hybrid":
        return (
            "OlmoHybridConfig",
            "OlmoHybridForCausalLM",
            {
                **_COMMON,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 4,
                "layer_types": ALTERNATING,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 32,
                "linear_conv_kernel_dim": 4,
            },
        )
    if name == "kimi_linear":
        return (
            "KimiLinearConfig",
            "KimiLinearForCausalLM",
            {
                **_COMMON,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 4,
                "layer_types": ALTERNATING,
                "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
                "num_experts": 4,
                "num_experts_per_token": 2,
                "moe_intermediate_size": 32,
                "num_shared_experts": 1,
                "kv_lora_rank": 16,
                "q_lora_rank": None,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
                "linear_head_dim": 16,
                "linear_num_heads": 4,
                "linear_conv_kernel_dim": 4,
            },
        )
    if name == "minimax":
        # Lightning attention in blocks of 8 (the prompts cross them), experts as the family has them.
        return (
            "MiniMaxConfig",
            "MiniMaxForCausalLM",
            {
                **_COMMON,
                **_ATTENTION,
                "num_hidden_layers": 4,
                "layer_types": ALTERNATING,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "block_size": 8,
            },
        )
    if name == "recurrent_gemma":
        # Two recurrent blocks then local attention with a 16-token window (the prompts outgrow it).
        return (
            "RecurrentGemmaConfig",
            "RecurrentGemmaForCausalLM",
            {
                **_COMMON,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 3,
                "lru_width": HIDDEN,
                "attention_window_size": 16,
                "conv1d_width": 4,
            },
        )
    if name == "rwkv":
        return (
            "RwkvConfig",
            "RwkvForCausalLM",
            {
                "vocab_size": VOCAB,
                "hidden_size": HIDDEN,
                "attention_hidden_size": HIDDEN,
                "intermediate_size": INTERMEDIATE,
                "num_hidden_layers": 4,
                "context_length": 512,
                "rescale_every": 2,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        )
    if name == "xlstm":
        # Kernel chunks of 8 (the prompts cross them); float32 kernels, as the model's own dtype; q/k as
        # wide as the hidden size (`xLSTMCache` sizes its state by the widths rounded up to 64).
        return (
            "xLSTMConfig",
            "xLSTMForCausalLM",
            {
                "vocab_size": VOCAB,
                "hidden_size": HIDDEN,
                "embedding_dim": HIDDEN,
                "num_hidden_layers": 2,
                "num_heads": 4,
                "qk_dim_factor": 1.0,
                "chunk_size": 8,
                "autocast_kernel_dtype": "float32",
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        )
    raise KeyError(f"no tiny config for {name!r}")


HYBRIDS = (
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "mamba2",
    "mamba",
    "falcon_mamba",
    "jamba",
    "bamba",
    "lfm2",
    "lfm2_moe",
    "granitemoehybrid",
    "falcon_h1",
    "nemotron_h",
    "zamba2",
    "olmo_hybrid",
    "kimi_linear",
    # The model-owned recurrences (runner/states/own_state.py).
    "minimax",
    "recurrent_gemma",
    "rwkv",
    "xlstm",
)


def hybrid_config(name: str) -> Any:
    """The tiny config of family `name`."""
    import transformers

    config_class, _, kwargs = _config(name)
    return getattr(transformers, config_class)(**kwargs)


def build_hybrid(name: str, dtype: torch.dtype = torch.float32, seed: int = SEED) -> PreTrainedModel:
    """Family `name`'s tiny model: seeded random weights in `dtype`, CPU, eval, eos off."""
    import transformers

    _, model_class, _ = _config(name)
    config = hybrid_config(name)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0, eos_token_id=None)
    return model
