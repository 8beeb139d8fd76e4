"""Sharp models: every query and key projection scaled after init, so attention is far from uniform.

A tiny random model attends almost uniformly (its q.k products are near 0), so a wrong position, rotary
frequency, mask or cached key barely moves its output and greedy tokens hide the bug. Scaling the query
and key projections by `SHARP_FACTOR` multiplies every attention logit by its square: each query then
attends a few keys, and any such error changes tokens.

Which projections: each linear layer whose own name is a query or key projection in some family of
transformers 5.23 (`QK_NAMES`, found by listing every causal-LM type's attention linears): separate ones
(`q_proj`, `k_proj`, `query`, `key`, ...), fused ones (`qkv_proj`, `query_key_value`, `c_attn`, `Wqkv`,
`kv_proj`: their value rows are scaled with them, which keeps attention sharp) and multi-latent ones
(`q_a_proj` / `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`: the latent's norm cancels `q_a_proj`'s and
the compressed KV's scale, so the query's and key's up-projections and the rotary key carry it), and
DeepSeek sparse attention's indexer (`wq_b`, `wk`: its selection is sharpened too). Weight
and bias are scaled alike (the whole output). The conformance matrix's sharp column
(conformance/coverage/build.py) and the parity suite use it; docs/models.md names the factor.
"""

from __future__ import annotations

import torch

# The documented factor of the sharp column: attention logits grow by its square (400x).
SHARP_FACTOR = 20.0

QK_NAMES = frozenset(
    {
        # separate query / key projections
        "q_proj",
        "k_proj",
        "query",
        "key",
        "q_lin",
        "k_lin",
        "query_proj",
        "key_proj",
        "project_q",
        "project_k",
        "Wq",
        "Wk",
        "wq",
        "wk",  # also DeepSeek sparse attention's indexer key
        "wq_b",  # its indexer's query (the selection sharpened with the attention)
        # fused projections (their value rows too)
        "qkv_proj",
        "query_key_value",
        "c_attn",
        "Wqkv",
        "qkv",
        "kv_proj",
        # multi-latent attention (DeepSeek V2/V3 and their copies)
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    }
)


def qk_projections(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every (name, module) of `model` named in `QK_NAMES` that holds a weight (Linear, GPT-2's Conv1D)."""
    found = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in QK_NAMES and isinstance(getattr(module, "weight", None), torch.Tensor):
            found.append((name, module))
    return found


def sharpen(model: torch.nn.Module, factor: float = SHARP_FACTOR) -> int:
    """Scale every query / key projection of `model` by `factor` in place; returns how many were scaled."""
    projections = qk_projections(model)
    with torch.no_grad():
        for _, module in projections:
            module.weight.mul_(factor)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.mul_(factor)
    return len(projections)
