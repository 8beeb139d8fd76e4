"""Shared helpers for the transformers_cb benchmarks.

Everything here is deterministic given a seed: models are built from configs with random weights (no hub access),
workloads are drawn from seeded RNGs, and every engine adapter returns the generated token ids in input order so that
engines can be compared token for token.

The offline throughput benchmark (`benchmarks/throughput.py`) uses all of it; an online benchmark can reuse the model
builders, workloads, the engine adapters' configuration helpers and the table printer.

Engines (see `docs/benchmarks.md` for the full description):
    static   plain `GenerationMixin.generate()` over left-padded static batches
    builtin  transformers' own continuous batching (`ContinuousBatchingManager`), driven request by request
    ours     `transformers_cb` through the patched `model.generate_batch(...)`
    limit    the model's forward passes alone for the same work (a documented lower bound)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    StaticCache,
)
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.generation.utils import GenerationMixin

# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------

# ~1.54M parameters: forward passes take well under a millisecond of arithmetic, so this model measures the
# per-step overhead of an engine (scheduling, bookkeeping, Python) rather than the model.
_TINY: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
}

#: "tiny"'s size in Qwen3.5's shape (a linear-attention hybrid): three gated-delta-rule layers (a conv window
#: and a recurrent matrix per request instead of a growing KV) then one full-attention layer, Qwen3.5's
#: 3:1 pattern. Built as `Qwen3_5ForCausalLM` (see `build_model`).
_TINY_HYBRID: dict[str, Any] = {
    **_TINY,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
}

#: Configs of the benchmark models (Llama unless `build_model` says otherwise). Weights are random (seeded); the
#: configs alone decide the cost.
#: "tiny"'s size in DeepSeek-V3's shape: multi-latent attention (a 64 + 16-value latent per token and layer in
#: the cache instead of 4 heads x (32 + 16) key and 4 x 32 value values), a query LoRA, MoE after a dense first
#: layer. Built as `DeepseekV3ForCausalLM` (see `build_model`).
_TINY_MLA: dict[str, Any] = {
    **_TINY,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    # DeepSeek-V3's shape at "tiny"'s size: multi-latent attention on latent pages (docs/models.md).
    "tiny-mla": _TINY_MLA,
    # A Qwen3.5-shaped hybrid of "tiny"'s size: 3 linear-attention (gated delta rule) layers + 1 full attention.
    "tiny-hybrid": _TINY_HYBRID,
    # "tiny" with every layer sliding over a 256-token window (Mistral architecture = Llama + sliding window):
    # its KV cache holds at most ceil(256 / page) + 1 pages per request however long the decode.
    "tiny-sliding": {**_TINY, "sliding_window": 256},
    # 4 layers, 256 wide (~3.4M parameters): the model of the many-short workload (evaluation / scoring traffic),
    # where a step holds hundreds of short prompts and the per-request op count decides the speed.
    "mini": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
    },
    # ~56.9M parameters (GQA 8/2, untied 32000-token embeddings): compute-bound on CPU.
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1536,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
}

#: Token id used for padding. Prompts only use ids >= FIRST_PROMPT_TOKEN so that no special token ever appears.
PAD_TOKEN_ID = 0
FIRST_PROMPT_TOKEN = 3


def is_hybrid(config: Any) -> bool:
    """Whether a model's config has linear-attention (per-request state) layers."""
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def is_latent(config: Any) -> bool:
    """Whether a model's config has multi-latent attention (`kv_lora_rank`)."""
    return getattr(config, "kv_lora_rank", None) is not None


def kv_bytes_per_token(config: Any, element_size: int) -> dict[str, int]:
    """One token's KV bytes in every layer: `latent` (what ours' pages hold for a multi-latent model; its
    K + V otherwise) and `decompressed` (the per-head K and V a multi-latent model's attention computes)."""
    layers = config.num_hidden_layers
    if not is_latent(config):
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        size = 2 * layers * heads * head_dim * element_size
        return {"latent": size, "decompressed": size}
    latent = layers * (config.kv_lora_rank + config.qk_rope_head_dim) * element_size
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return {"latent": latent, "decompressed": layers * config.num_attention_heads * per_head * element_size}


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build a benchmark model with seeded random weights, in eval mode, with SDPA attention and EOS disabled.
    A config with `sliding_window` builds the Mistral architecture (Llama with sliding-window attention), one with
    `linear_attention` layers the Qwen3.5 text architecture; the others are Llama."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"Unknown model {name!r}; choose from {sorted(MODEL_CONFIGS)}")
    if "linear_attention" in MODEL_CONFIGS[name].get("layer_types", ()):
        config_class, model_class = Qwen3_5TextConfig, Qwen3_5ForCausalLM
    elif "kv_lora_rank" in MODEL_CONFIGS[name]:
        config_class, model_class = DeepseekV3Config, DeepseekV3ForCausalLM
    elif "sliding_window" in MODEL_CONFIGS[name]:
        config_class, model_class = MistralConfig, MistralForCausalLM
    else:
        config_class, model_class = LlamaConfig, LlamaForCausalLM
    config = config_class(
        **MODEL_CONFIGS[name],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    # No EOS anywhere: every engine must produce exactly `max_new_tokens` tokens per request.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    model.generation_config.bos_token_id = None
    return model


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def restore_attn_implementation(model: torch.nn.Module, attn_implementation: str = "sdpa") -> None:
    """Engines may switch the attention implementation (and should switch it back); make sure the next one starts
    from the same state."""
    if model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)


def greedy_generation_config(max_new_tokens: int) -> GenerationConfig:
    """A fresh greedy config with EOS disabled (fresh because some engines mutate the config they are given)."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=None,
    )


# --------------------------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass
class Workload:
    name: str
    requests: list[Request]
    #: Number of leading prompt tokens shared by *all* requests (0 if none). Used by the `limit` engine, which
    #: computes a shared prefix only once.
    shared_prefix_len: int = 0
    description: str = ""

    @property
    def inputs(self) -> list[list[int]]:
        return [r.prompt for r in self.requests]

    @property
    def max_new_tokens(self) -> list[int]:
        return [r.max_new_tokens for r in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def num_generated_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    @property
    def max_sequence_length(self) -> int:
        return max(len(r.prompt) + r.max_new_tokens for r in self.requests)

    def summary(self) -> dict[str, Any]:
        plens = [len(r.prompt) for r in self.requests]
        mnts = self.max_new_tokens
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": len(self.requests),
            "prompt_tokens": sum(plens),
            "prompt_len_min_mean_max": [min(plens), round(statistics.mean(plens), 1), max(plens)],
            "max_new_tokens_total": sum(mnts),
            "max_new_tokens_min_mean_max": [min(mnts), round(statistics.mean(mnts), 1), max(mnts)],
            "shared_prefix_len": self.shared_prefix_len,
        }


WORKLOAD_NAMES = ("mixed", "shared-prefix", "long-decode", "many-short", "many-short-8")


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(n)]


def make_workload(name: str, vocab_size: int, scale: float = 1.0, seed: int = 0) -> Workload:
    """Seeded workloads. Token ids are uniform in [3, vocab) so that no special token appears; EOS is disabled in
    every engine so each request generates exactly its `max_new_tokens`. `scale` multiplies the request counts."""
    # String seeds are hashed deterministically (sha512) by `random.Random`, independent of PYTHONHASHSEED.
    rng = random.Random(f"{name}/{seed}")
    if name == "mixed":
        n = _scaled(64, scale)
        requests = []
        for _ in range(n):
            plen = rng.randint(16, 512)
            # Long-tailed: lognormal with median 40, clipped to [8, 256] (mean ~58 before clipping).
            mnt = int(min(256, max(8, round(rng.lognormvariate(math.log(40), 0.9)))))
            requests.append(Request(_random_tokens(rng, plen, vocab_size), mnt))
        return Workload(
            name,
            requests,
            description="prompts uniform in [16, 512], max_new_tokens lognormal(median 40, sigma 0.9) clipped to [8, 256]",
        )
    if name == "shared-prefix":
        n = _scaled(64, scale)
        prefix = _random_tokens(rng, 256, vocab_size)
        requests = [
            Request(prefix + _random_tokens(rng, rng.randint(16, 64), vocab_size), 32) for _ in range(n)
        ]
        return Workload(
            name,
            requests,
            shared_prefix_len=256,
            description="256-token shared prefix + unique suffix uniform in [16, 64], max_new_tokens 32",
        )
    if name == "long-decode":
        n = _scaled(16, scale)
        requests = [Request(_random_tokens(rng, rng.randint(16, 32), vocab_size), 512) for _ in range(n)]
        return Workload(name, requests, description="prompts uniform in [16, 32], max_new_tokens 512")
    if name in ("many-short", "many-short-8"):
        n, new_tokens = _scaled(1000, scale), 8 if name == "many-short-8" else 1
        requests = [
            Request(_random_tokens(rng, rng.randint(8, 40), vocab_size), new_tokens) for _ in range(n)
        ]
        return Workload(
            name, requests, description=f"prompts uniform in [8, 40], max_new_tokens {new_tokens}"
        )
    raise ValueError(f"Unknown workload {name!r}; choose from {WORKLOAD_NAMES}")


def make_warmup_workload(vocab_size: int, seed: int = 1) -> Workload:
    """A tiny workload used to warm every engine up (kernels, allocator, lazy imports) before timing. Its requests
    have different `max_new_tokens`, which also lets engines probe per-request `max_new_tokens` support."""
    rng = random.Random(f"warmup/{seed}")
    requests = [
        Request(_random_tokens(rng, plen, vocab_size), mnt)
        for plen, mnt in ((12, 4), (40, 7), (25, 10), (70, 5))
    ]
    return Workload("warmup", requests, description="4 short requests")


# --------------------------------------------------------------------------------------------------------------------
# Engine adapters
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    engine: str
    #: Generated token ids per request, in input order (None where the engine returned nothing for a request).
    outputs: list[list[int] | None]
    wall_s: float
    #: Tokens run through the model (prompt + decode positions, padding included).
    tokens_forwarded: int
    #: True if `tokens_forwarded` was reported/counted by the engine, False if estimated from the workload.
    tokens_forwarded_exact: bool
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Cores kept busy by other processes during the run (set by the benchmark driver; None if unknown).
    other_load: float | None = None
    #: Most KV pages in use at once, per KV layer group (ours only; None if not reported).
    peak_pages: dict[str, int] | None = None
    #: Prompt tokens run through the model (ours: counted; limit: prefix once + suffixes; else None).
    prefill_tokens: int | None = None
    #: One token's KV bytes in ours' pages (`stats().kv_bytes_per_token`; ours only, else None).
    kv_bytes_per_token: int | None = None


def outputs_digest(outputs: list[list[int] | None]) -> str:
    """A short digest of every request's token ids, in order: equal digests mean equal outputs (refactors
    compare the JSON of two commits)."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def cb_engine_settings(
    workload: Workload,
    page_size: int | None = None,
    max_batch_tokens: int | None = None,
    num_blocks: int | None = None,
) -> dict[str, Any]:
    """Settings given identically to every continuous batching engine (builtin and ours).

    `num_blocks` defaults to enough pages to hold every request of the workload at full length at once (plus a few
    spare), so neither engine ever has to evict/preempt and neither pays for allocating a memory-sized cache (the
    built-in's CPU default is 60% of free RAM, which takes seconds to allocate and makes its SDPA mask huge).
    """
    settings: dict[str, Any] = {}
    if page_size is not None:
        settings["page_size"] = page_size
    if max_batch_tokens is not None:
        settings["max_batch_tokens"] = max_batch_tokens
    if num_blocks is None:
        ps = page_size or 256
        num_blocks = sum(math.ceil((len(r.prompt) + r.max_new_tokens) / ps) for r in workload.requests) + 4
    settings["num_blocks"] = num_blocks
    return settings


def make_config(
    cls: type, settings: dict[str, Any], extra: dict[str, Any] | None = None
) -> tuple[Any, list[str]]:
    """Instantiate a config class with the subset of `settings` it accepts; returns (config, ignored keys)."""
    accepted = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    if accepted is None:
        import inspect

        params = inspect.signature(cls).parameters
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        accepted = None if has_var_kw else set(params)
    merged = {**settings, **(extra or {})}
    kwargs = {k: v for k, v in merged.items() if accepted is None or k in accepted}
    ignored = sorted(set(merged) - set(kwargs))
    return cls(**kwargs), ignored


class Engine:
    """Base adapter. `run` must only time what a user of the engine would wait for."""

    name = "engine"

    def unsupported(self, model: torch.nn.Module) -> str | None:
        """Why this engine cannot run `model` (it is then skipped with the reason), None when it can."""
        return None

    def warmup(self, model: LlamaForCausalLM, workload: Workload) -> None:
        self.run(model, workload)

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        raise NotImplementedError


class StaticEngine(Engine):
    """`generate()` over static left-padded batches of `batch_size` requests taken in input order. Each batch runs to
    its longest `max_new_tokens`; rows are truncated to their own `max_new_tokens` afterwards."""

    name = "static"

    def __init__(self, batch_size: int = 16):
        self.batch_size = batch_size

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        requests = workload.requests
        outputs: list[list[int] | None] = [None] * len(requests)
        forwarded = 0
        device = model.device
        start = time.perf_counter()
        with torch.inference_mode():
            for b0 in range(0, len(requests), self.batch_size):
                batch = requests[b0 : b0 + self.batch_size]
                width = max(len(r.prompt) for r in batch)
                steps = max(r.max_new_tokens for r in batch)
                ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, r in enumerate(batch):
                    ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
                    mask[row, width - len(r.prompt) :] = 1
                out = GenerationMixin.generate(
                    model,
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=greedy_generation_config(steps),
                )
                generated = out[:, width:].tolist()
                for row, r in enumerate(batch):
                    outputs[b0 + row] = generated[row][: r.max_new_tokens]
                forwarded += len(batch) * width + len(batch) * (len(generated[0]) - 1)
        wall = time.perf_counter() - start
        return RunResult(
            self.name,
            outputs,
            wall,
            forwarded,
            True,
            notes=[f"batch_size={self.batch_size}, input order, left padding"],
        )


class BuiltinEngine(Engine):
    """transformers' built-in continuous batching, called through the unpatched `ContinuousMixin` functions (since
    `import transformers_cb` replaces `PreTrainedModel.generate_batch`). The manager is driven directly so that each
    request gets its own `max_new_tokens` (`generate_batch` only takes one for all requests); otherwise this mirrors
    `ContinuousMixin.generate_batch`: same workload hints, same request order, warmup, start, collect, stop."""

    name = "builtin"

    def __init__(self, settings_fn: Callable[[Workload], dict[str, Any]]):
        self.settings_fn = settings_fn

    def unsupported(self, model: torch.nn.Module) -> str | None:
        if is_hybrid(model.config):
            return (
                "transformers' continuous batching refuses linear-attention layers "
                "(ValueError: Invalid layer type: linear_attention)"
            )
        if is_latent(model.config):
            return "transformers' continuous batching is not run on multi-latent attention (docs/models.md)"
        return None

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        from transformers.generation import ContinuousBatchingConfig as BuiltinCBConfig
        from transformers.generation.continuous_batching.continuous_api import ContinuousMixin
        from transformers.generation.continuous_batching.utils import WorkloadHints

        settings = self.settings_fn(workload)
        # CPU: no CUDA graphs, no compile, no flash switch (none is available anyway).
        cb_config, ignored = make_config(
            BuiltinCBConfig, settings, {"use_cuda_graph": False, "default_compile_level": 0}
        )
        requests = workload.requests
        hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt) for r in requests),
            max_generated_length=max(r.max_new_tokens for r in requests),
            num_requests=len(requests),
        )
        outputs: list[list[int] | None] = [None] * len(requests)
        errors: list[str] = []
        start = time.perf_counter()
        manager = ContinuousMixin.init_continuous_batching(
            model,
            generation_config=greedy_generation_config(hints.max_generated_length),
            continuous_batching_config=cb_config,
            workload_hints=hints,
        )
        try:
            if not manager.warmed_up:
                manager.warmup()
            manager.start()
            ids = [f"req_{i}" for i in range(len(requests))]
            order = list(range(len(requests)))
            if manager._use_prefix_sharing:  # same ordering as `ContinuousBatchingManager.add_requests`
                order.sort(key=lambda i: requests[i].prompt, reverse=True)
            for i in order:
                manager.add_request(
                    input_ids=requests[i].prompt,
                    request_id=ids[i],
                    max_new_tokens=requests[i].max_new_tokens,
                    eos_token_id=-1,
                )
            index = {rid: i for i, rid in enumerate(ids)}
            pending = len(requests)
            while pending:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        errors.append(f"builtin generation thread stopped with {pending} requests pending")
                        break
                    continue
                if not result.is_finished():
                    continue
                i = index[result.request_id]
                if result.error is not None:
                    errors.append(f"{result.request_id}: {result.error}")
                outputs[i] = list(result.generated_tokens)
                pending -= 1
        finally:
            manager.stop(block=True, timeout=5)
            manager.destroy()
        wall = time.perf_counter() - start
        restore_attn_implementation(model)
        forwarded = sum(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in requests)
        notes = [f"config={settings}"]
        if ignored:
            notes.append(f"ignored settings: {ignored}")
        return RunResult(self.name, outputs, wall, forwarded, False, errors, notes)


class OursEngine(Engine):
    """`transformers_cb` through the patched `model.generate_batch`, with per-request `max_new_tokens` passed as a
    list (`max_new_tokens=[...]`). If the installed core does not support the list yet (probed during warmup), the
    requests are grouped by `max_new_tokens` and each group is a separate `generate_batch` call (slower: documented
    in the row's notes)."""

    name = "ours"

    def __init__(self, settings_fn: Callable[[Workload], dict[str, Any]]):
        self.settings_fn = settings_fn
        self.per_request_mnt: bool | None = None  # decided by the warmup probe

    def _config_class(self) -> type:
        import transformers_cb

        return transformers_cb.ContinuousBatchingConfig

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        settings = self.settings_fn(workload)
        cfg, ignored = make_config(self._config_class(), settings)
        return cfg, settings, ignored

    def _call(
        self, model, inputs: list[list[int]], mnts: list[int], cfg, per_request: bool
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if per_request:
            kwargs["max_new_tokens"] = list(mnts)
        return model.generate_batch(
            inputs=inputs,
            generation_config=greedy_generation_config(max(mnts)),
            continuous_batching_config=cfg,
            progress_bar=False,
            **kwargs,
        )

    def warmup(self, model: LlamaForCausalLM, workload: Workload) -> None:
        import transformers_cb  # noqa: F401  (patches PreTrainedModel.generate_batch)

        cfg, _, _ = self._config(workload)
        try:
            with torch.inference_mode():
                out = self._call(model, workload.inputs, workload.max_new_tokens, cfg, per_request=True)
            got = [len(out[f"req_{i}"].generated_tokens) for i in range(len(workload.requests))]
            self.per_request_mnt = got == workload.max_new_tokens
        except (TypeError, ValueError, KeyError):
            self.per_request_mnt = False
        restore_attn_implementation(model)
        self.run(model, workload)

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        cfg, settings, ignored = self._config(workload)
        requests = workload.requests
        per_request = self.per_request_mnt is not False
        if per_request:
            groups = [list(range(len(requests)))]
        else:
            by_mnt: dict[int, list[int]] = {}
            for i, r in enumerate(requests):
                by_mnt.setdefault(r.max_new_tokens, []).append(i)
            groups = list(by_mnt.values())
        outputs: list[list[int] | None] = [None] * len(requests)
        errors: list[str] = []
        start = time.perf_counter()
        with _capture_ours_counters() as recorded, torch.inference_mode():
            for group in groups:
                out = self._call(
                    model,
                    [requests[i].prompt for i in group],
                    [requests[i].max_new_tokens for i in group],
                    cfg,
                    per_request,
                )
                for j, i in enumerate(group):
                    res = out.get(f"req_{j}")
                    if res is None:
                        errors.append(f"req_{i}: missing from the results")
                        continue
                    if getattr(res, "error", None) is not None:
                        errors.append(f"req_{i}: {res.error}")
                    outputs[i] = list(res.generated_tokens)
        wall = time.perf_counter() - start
        restore_attn_implementation(model)
        reported = _forwarded_from_counters(recorded)
        peak_pages = _peak_pages(recorded)
        prefill = sum(engine.counters.prefill_tokens for engine in recorded) if recorded else None
        if reported is not None:
            forwarded, exact = reported, True
        else:
            forwarded = sum(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in requests)
            exact = False
        notes = [f"config={settings}"]
        if ignored:
            notes.append(f"ignored settings: {ignored}")
        if per_request:
            notes.append("per-request max_new_tokens passed as a list")
        else:
            notes.append(
                f"per-request max_new_tokens unsupported: ran {len(groups)} generate_batch calls grouped by max_new_tokens"
            )
        return RunResult(
            self.name,
            outputs,
            wall,
            forwarded,
            exact,
            errors,
            notes,
            peak_pages=peak_pages,
            prefill_tokens=prefill,
            kv_bytes_per_token=recorded[0].snapshot().kv_bytes_per_token if recorded else None,
        )


class OursNoSharingEngine(OursEngine):
    """`OursEngine` with prefix sharing off (`allow_block_sharing=False`): every prompt computed in full."""

    name = "ours-noshare"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, allow_block_sharing=False), settings, ignored


class OursTorchKernelsEngine(OursEngine):
    """`OursEngine` with the native CPU kernel switched off (`TRANSFORMERS_CB_NATIVE_KERNEL=0`): the pure-torch
    paged kernels, which is what ran in bf16 / fp16 before the kernel took those dtypes."""

    name = "ours-torch-kernels"
    env = ("TRANSFORMERS_CB_NATIVE_KERNEL", "0")

    def warmup(self, model: LlamaForCausalLM, workload: Workload) -> None:
        with _env_set(*self.env):
            super().warmup(model, workload)

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        with _env_set(*self.env):
            return super().run(model, workload)


class OursEagerLayersEngine(OursTorchKernelsEngine):
    """`OursEngine` with the native decoder-layer ops off (`TRANSFORMERS_CB_NATIVE_LAYERS=0`): transformers'
    eager RMSNorm, rotary and SiLU·mul between the products, as before issue 46."""

    name = "ours-eager-layers"
    env = ("TRANSFORMERS_CB_NATIVE_LAYERS", "0")


@contextlib.contextmanager
def _env_set(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


class OursTransformersConfigEngine(OursEngine):
    """`OursEngine` given transformers' own `ContinuousBatchingConfig` (as the documents and TRL build
    it), which the plugin converts: the path users take."""

    name = "ours-hf"

    def _config_class(self) -> type:
        from transformers.generation import ContinuousBatchingConfig

        import transformers_cb  # noqa: F401  (patches PreTrainedModel.generate_batch)

        return ContinuousBatchingConfig


class OursSampledEngine(OursEngine):
    """`transformers_cb` sampling: temperature 0.8, top_p 0.95 (top_k off), one seed per request passed as a
    list (`per_request_processors=True`). Its tokens differ from the greedy engines' by design."""

    name = "ours-sampled"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, per_request_processors=True), settings, ignored

    def _call(
        self, model, inputs: list[list[int]], mnts: list[int], cfg, per_request: bool
    ) -> dict[str, Any]:
        config = greedy_generation_config(max(mnts))
        config.do_sample, config.temperature, config.top_p, config.top_k = True, 0.8, 0.95, 0
        kwargs: dict[str, Any] = {"seed": list(range(len(inputs)))}
        if per_request:
            kwargs["max_new_tokens"] = list(mnts)
        return model.generate_batch(
            inputs=inputs,
            generation_config=config,
            continuous_batching_config=cfg,
            progress_bar=False,
            **kwargs,
        )


class OursCompiledEngine(OursEngine):
    """`OursEngine` with `default_compile_level=1` (torch.compile, mode "default", dynamic shapes; on CPU
    inductor's C++ backend). The warmup pays the compilation; the timed runs reuse the compiled forwards."""

    name = "ours-compiled"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, default_compile_level=1), settings, ignored


class OursPlainEngine(OursEngine):
    """`OursEngine` with `packed_linear=False`: MKL's plain products everywhere (the default before packed
    products were on by default)."""

    name = "ours-plain"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, packed_linear=False), settings, ignored


def model_gguf(model: torch.nn.Module) -> Path | None:
    """The GGUF a real model's folder keeps (`model.benchmark_folder`; a registry model's fetched into it if
    missing), or None (a random model, or a folder without one)."""
    from transformers_cb.models.fetch import fetch_gguf
    from transformers_cb.models.gguf_weights import gguf_of_folder
    from transformers_cb.models.registry_model import REGISTRY

    folder = getattr(model, "benchmark_folder", None)
    if folder is None:
        return None
    found = gguf_of_folder(folder)
    known = [m for m in REGISTRY.values() if Path(folder).name == m.folder_name]
    return found if found is not None or not known else fetch_gguf(known[0], progress=False)


class OursQuantizedEngine(OursEngine):
    """`OursEngine` on a copy of the model whose GGUF weights are kept in their blocks
    (`transformers_cb/models/gguf_weights.py`, docs/quantization.md): the real model's Q4_1 Linears and Q8_0
    embedding / LM head read by the native quantized product. The model's folder must keep its GGUF (a
    registry model's is fetched into it if missing); random models have none and are skipped. The copy
    is made once per model, at the first warmup or run."""

    name = "ours-quantized"

    def __init__(self, settings_fn: Callable[[Workload], dict[str, Any]]):
        super().__init__(settings_fn)
        self._copies: dict[int, torch.nn.Module] = {}

    def unsupported(self, model: torch.nn.Module) -> str | None:
        return (
            None if model_gguf(model) is not None else "the model's folder keeps no GGUF (real models only)"
        )

    def quantized(self, model: torch.nn.Module) -> torch.nn.Module:
        from transformers_cb.models.gguf_weights import keep_gguf_quantized

        if id(model) not in self._copies:
            kept = copy.deepcopy(model)
            keep_gguf_quantized(kept, model_gguf(model))
            self._copies[id(model)] = kept
        return self._copies[id(model)]

    def warmup(self, model: LlamaForCausalLM, workload: Workload) -> None:
        super().warmup(self.quantized(model), workload)

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        return super().run(self.quantized(model), workload)


class OursInt8KVEngine(OursEngine):
    """`OursEngine` with the int8 KV cache (`kv_cache_dtype="int8"`, memory/kv_quant.py, opt-in): half the
    bytes a decode step's attention reads; outputs within the cache's quantization, not `generate()`'s."""

    name = "ours-int8kv"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, kv_cache_dtype="int8"), settings, ignored


class OursQuantizedInt8KVEngine(OursInt8KVEngine, OursQuantizedEngine):
    """`OursQuantizedEngine` (the GGUF's blocks kept) with the int8 KV cache (`OursInt8KVEngine`'s config):
    both opt-in byte savings."""

    name = "ours-quantized-int8kv"


class OursPackedEngine(OursEngine):
    """`OursEngine` with `packed_linear=True`: the default's packed products asked for explicitly (a
    warning when the platform has none; `transformers_cb/runner/products/packed_linear.py`). The warmup builds the
    packs."""

    name = "ours-packed"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, packed_linear=True), settings, ignored


class OursBatchInvariantEngine(OursEngine):
    """`OursEngine` with `batch_invariant=True`: every request's tokens and logprobs the same bits whatever
    shares its steps (every attention token on the native kernel, products in fixed 16-row calls, the
    activations on padded rows; packed products and native layer ops off). Its row is that mode's cost."""

    name = "ours-batch-invariant"

    def _config(self, workload: Workload) -> tuple[Any, dict[str, Any], list[str]]:
        cfg, settings, ignored = super()._config(workload)
        return dataclasses.replace(cfg, batch_invariant=True), settings, ignored


@contextlib.contextmanager
def _capture_ours_counters():
    """Record the token counters of every `transformers_cb` engine created inside the block.

    `transformers_cb.generate_batch` does not return its `Engine`, so the benchmark temporarily wraps the
    builder it calls (`build_engine`) to remember the engines it builds, and wraps each one's `step` to read
    its peak pages (one extra list append per `generate_batch` call, one dict read per step). Yields the list
    of engines; empty if the core's layout differs (then the caller falls back to an estimate)."""
    engines: list[Any] = []
    try:
        import transformers_cb.api.generate_batch as generation_module
    except ImportError:
        yield engines
        return
    original = getattr(generation_module, "build_engine", None)
    if not callable(original):
        yield engines
        return

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        engine = original(*args, **kwargs)
        engine.peak_pages = {}
        step = engine.step
        pages = getattr(engine, "pages", None)
        pages_in_use = getattr(pages, "pages_in_use", None)

        def recorded_step(*step_args: Any, **step_kwargs: Any) -> Any:
            result = step(*step_args, **step_kwargs)
            # Peak KV pages per layer group, read after the step (its pages are still held).
            if pages_in_use is not None:
                for group, used in pages_in_use().items():
                    if used > engine.peak_pages.get(group, 0):
                        engine.peak_pages[group] = used
            return result

        engine.step = recorded_step
        engines.append(engine)
        return engine

    generation_module.build_engine = recording_build
    try:
        yield engines
    finally:
        generation_module.build_engine = original


def _peak_pages(engines: list[Any]) -> dict[str, int] | None:
    """Most KV pages in use at once per layer group, over the recorded engines (None if not reported)."""
    peaks: dict[str, int] = {}
    for engine in engines:
        for group, used in (getattr(engine, "peak_pages", None) or {}).items():
            peaks[group] = max(peaks.get(group, 0), used)
    return peaks or None


def _forwarded_from_counters(engines: list[Any]) -> int | None:
    """Prompt (prefill) + decode tokens run through the model, from the recorded engines' counters."""
    total = 0
    for engine in engines:
        counters = getattr(engine, "counters", None)
        prefill = getattr(counters, "prefill_tokens", None)
        decode = getattr(counters, "decode_tokens", None)
        if prefill is None or decode is None:
            return None
        total += prefill + decode
    return total if engines else None


class LimitEngine(Engine):
    """The forward passes alone, timed one by one (see docs/benchmarks.md, "The limit").

    Prefill: each prompt once, alone (batch 1), with `logits_to_keep=1`; a prefix shared by all requests is computed
    once and every suffix is forwarded on top of a copy of its KV cache (copy not timed).
    Decode: every request starts decoding together; decode step t forwards the requests that still need a token
    (`max_new_tokens - 1 > t`; the first token comes from the prefill) as one batch with q_len=1, over a KV cache of
    length = the mean context length of that batch (same attention FLOPs as the ragged batch), followed by argmax.
    Only the `model(...)` call and argmax are timed; the caches are views of a pre-filled random buffer.
    Each forward is run `repeats` times on a fresh cache and its fastest time is kept, which filters out the noise
    of a shared machine (this is a lower bound, so the minimum is the right statistic).
    """

    name = "limit"

    def __init__(self, repeats: int = 2):
        self.repeats = max(1, repeats)

    def unsupported(self, model: torch.nn.Module) -> str | None:
        if is_latent(model.config):
            return "its pre-filled decode caches are per-head K/V, not multi-latent attention's latents"
        return None

    def run(self, model: LlamaForCausalLM, workload: Workload) -> RunResult:
        requests = workload.requests
        config = model.config
        device, dtype = model.device, model.dtype
        timed = 0.0
        forwarded = 0

        def timed_forward(make_kwargs: Callable[[], dict[str, Any]]) -> None:
            """Run the forward `self.repeats` times, each on fresh kwargs (fresh cache), keep the fastest."""
            nonlocal timed
            best = math.inf
            for _ in range(self.repeats):
                kwargs = make_kwargs()
                t0 = time.perf_counter()
                logits = model(**kwargs).logits
                logits[:, -1].argmax(-1).tolist()  # .tolist() forces completion on any device
                best = min(best, time.perf_counter() - t0)
            timed += best

        with torch.inference_mode():
            # ---- prefill
            prefix_len = workload.shared_prefix_len
            if prefix_len:
                prefix = requests[0].prompt[:prefix_len]
                if any(r.prompt[:prefix_len] != prefix for r in requests):
                    raise ValueError(
                        f"workload {workload.name}: requests do not share a {prefix_len}-token prefix"
                    )
                prefix_ids = torch.tensor([prefix], device=device)
                timed_forward(
                    lambda: {
                        "input_ids": prefix_ids,
                        "past_key_values": transformers.DynamicCache(config=config),
                        "use_cache": True,
                        "logits_to_keep": 1,
                    }
                )
                prefix_cache = model(input_ids=prefix_ids, use_cache=True, logits_to_keep=1).past_key_values
                forwarded += prefix_len
            for r in requests:
                if prefix_len:
                    suffix = torch.tensor([r.prompt[prefix_len:]], device=device)
                    positions = torch.arange(prefix_len, len(r.prompt), device=device)[None]
                    timed_forward(
                        lambda suffix=suffix, positions=positions: {
                            "input_ids": suffix,
                            "position_ids": positions,
                            "past_key_values": copy.deepcopy(prefix_cache),
                            "use_cache": True,
                            "logits_to_keep": 1,
                        }
                    )
                    forwarded += suffix.shape[1]
                else:
                    ids = torch.tensor([r.prompt], device=device)
                    timed_forward(lambda ids=ids: {"input_ids": ids, "use_cache": True, "logits_to_keep": 1})
                    forwarded += len(r.prompt)

            prefill_tokens = forwarded
            # ---- decode
            num_steps = max(r.max_new_tokens for r in requests) - 1
            if num_steps > 0:
                head_dim = (
                    getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                )
                max_batch = sum(r.max_new_tokens > 1 for r in requests)
                shape = (max_batch, config.num_key_value_heads, workload.max_sequence_length, head_dim)
                gen = torch.Generator().manual_seed(0)
                # A hybrid's state layers keep a fixed-size (conv, recurrent) state per row instead of KV: their
                # shapes come from one untimed batch-1 prefill of the model itself.
                states = _state_shapes(model, requests[0].prompt) if is_hybrid(config) else {}
                buffers = [
                    tuple(
                        torch.randn((max_batch, *s), generator=gen, dtype=dtype).to(device)
                        for s in states.get(layer, (shape[1:], shape[1:]))
                    )
                    for layer in range(config.num_hidden_layers)
                ]
                # A sliding-window model attends to its window only: its limit reads at most `window` keys
                # (a full-attention cache of that length; positions stay the real ones for RoPE).
                window = getattr(config, "sliding_window", None)
                cache_config = config
                if window is not None:
                    cache_config = copy.deepcopy(config)
                    cache_config.sliding_window = None
                for t in range(num_steps):
                    active = [r for r in requests if r.max_new_tokens - 1 > t]
                    batch = len(active)
                    past = round(statistics.mean(len(r.prompt) + t for r in active))
                    kv_past = past if window is None else min(past, window - 1)
                    ids = torch.randint(FIRST_PROMPT_TOKEN, config.vocab_size, (batch, 1), generator=gen).to(
                        device
                    )
                    positions = torch.full((batch, 1), past, device=device)
                    cache_position = torch.tensor([kv_past], device=device)
                    timed_forward(
                        lambda ids=ids, positions=positions, cache_position=cache_position, batch=batch, past=kv_past: {
                            "input_ids": ids,
                            "position_ids": positions,
                            "cache_position": cache_position,
                            "past_key_values": _view_static_cache(cache_config, buffers, batch, past),
                            "use_cache": True,
                        }
                    )
                    forwarded += batch
                del buffers
        outputs: list[list[int] | None] = [None] * len(requests)
        return RunResult(
            self.name,
            outputs,
            timed,
            forwarded,
            True,
            notes=[f"forward time only, fastest of {self.repeats} per forward; outputs not produced"],
            prefill_tokens=prefill_tokens,
        )


def _state_shapes(model: torch.nn.Module, prompt: list[int]) -> dict[int, tuple[torch.Size, torch.Size]]:
    """Per state layer, the per-row shapes of its (conv, recurrent) states after a prefill of `prompt`."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt], device=model.device), past_key_values=cache, logits_to_keep=1)
    return {
        i: (layer.conv_states[0].shape[1:], layer.recurrent_states[0].shape[1:])
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }


def _view_static_cache(
    config: Any, buffers: Sequence[tuple[torch.Tensor, torch.Tensor]], batch: int, past: int
):
    """A `StaticCache` of exactly `past + 1` positions whose first `past` are already 'filled': its layers are views
    of the pre-filled `buffers`, so building it costs no allocation and attention reads exactly `past + 1` keys.
    A hybrid's state layers get views of their (conv, recurrent) state buffers, marked as holding a past state,
    so they take their one-token decode path."""
    cache = StaticCache(config=config, max_cache_len=past + 1)
    for layer, (k, v) in zip(cache.layers, buffers, strict=True):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.conv_states[0], layer.recurrent_states[0] = k[:batch], v[:batch]
            layer.conv_kernel_size[0] = k.shape[-1]
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
            layer.has_previous_state[0] = True
            layer.dtype, layer.device = k.dtype, k.device
            continue
        layer.keys = k[:batch, :, : past + 1]
        layer.values = v[:batch, :, : past + 1]
        layer.dtype, layer.device = k.dtype, k.device
        layer.batch_size, layer.num_heads = batch, k.shape[1]
        layer.k_head_dim = layer.v_head_dim = k.shape[-1]
        layer.cumulative_length = torch.tensor(past, device=k.device)
        layer.is_initialized = True
    return cache


# --------------------------------------------------------------------------------------------------------------------
# Correctness checks
# --------------------------------------------------------------------------------------------------------------------


def reference_outputs(
    model: LlamaForCausalLM, workload: Workload, indices: Sequence[int]
) -> dict[int, list[int]]:
    """Plain single-prompt greedy `generate()` (no padding, no batching) for the given request indices."""
    refs = {}
    with torch.inference_mode():
        for i in indices:
            r = workload.requests[i]
            out = GenerationMixin.generate(
                model,
                input_ids=torch.tensor([r.prompt], device=model.device),
                attention_mask=torch.ones((1, len(r.prompt)), dtype=torch.long, device=model.device),
                generation_config=greedy_generation_config(r.max_new_tokens),
            )
            refs[i] = out[0, len(r.prompt) :].tolist()
    return refs


def reference_indices(num_requests: int, k: int) -> list[int]:
    """k request indices spread evenly over the workload (first and last included)."""
    if k <= 0:
        return []
    if k >= num_requests:
        return list(range(num_requests))
    return sorted({round(j * (num_requests - 1) / (k - 1)) for j in range(k)}) if k > 1 else [0]


@dataclass
class Agreement:
    compared: int
    identical: int
    #: For the requests that differ: [request index, index of the first differing token] (late first differences
    #: are fp32 near-tie flips, early ones point to bugs).
    first_divergence: list[list[int]]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def short(self) -> str:
        return f"{self.identical}/{self.compared}"


def compare_outputs(a: Sequence[list[int] | None], b: Sequence[list[int] | None], indices=None) -> Agreement:
    idx = range(len(a)) if indices is None else indices
    compared = identical = 0
    divergence = []
    for i in idx:
        x, y = a[i], b[i]
        if x is None or y is None:
            continue
        compared += 1
        if x == y:
            identical += 1
        else:
            first = next(
                (j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y))
            )
            divergence.append([i, first])
    return Agreement(compared, identical, divergence)


def length_errors(result: RunResult, workload: Workload) -> list[str]:
    """Requests whose output does not have exactly `max_new_tokens` tokens (EOS is disabled everywhere)."""
    errs = []
    for i, (out, r) in enumerate(zip(result.outputs, workload.requests, strict=True)):
        if out is None:
            errs.append(f"req_{i}: no output")
        elif len(out) != r.max_new_tokens:
            errs.append(f"req_{i}: {len(out)} tokens, expected {r.max_new_tokens}")
    return errs


# --------------------------------------------------------------------------------------------------------------------
# Machine load (the development machine is shared: measure how busy the other processes keep it)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class CpuSnapshot:
    time: float
    busy_s: float | None  # CPU-seconds of all processes (from /proc/stat), None off Linux
    own_s: float  # CPU-seconds of this process (all threads) and of the engine's own helper processes


def helper_cpu_s(pids: Sequence[int]) -> float:
    """CPU-seconds of the processes `pids` (an engine's own workers: vLLM's worker and engine core)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def cpu_snapshot(helper_pids: Sequence[int] = ()) -> CpuSnapshot:
    """`helper_pids`: processes whose CPU time is the engine's own work, not other load (the same list for
    both snapshots of a run)."""
    busy = None
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is already in user
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return CpuSnapshot(time.perf_counter(), busy, t.user + t.system + helper_cpu_s(helper_pids))


def other_load(start: CpuSnapshot, end: CpuSnapshot) -> float | None:
    """Average number of cores kept busy by *other* processes between two snapshots (None if unknown)."""
    if start.busy_s is None or end.busy_s is None or end.time <= start.time:
        return None
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, others / (end.time - start.time))


@contextlib.contextmanager
def busy_core() -> Any:
    """A separate process spinning on one core for the duration (the `--busy-core` condition: another program
    keeps one core busy, so every OpenMP barrier may wait for a descheduled thread)."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it start spinning before the timed run
        yield process
    finally:
        process.kill()
        process.wait()


def wait_for_quiet_cpu(
    max_load: float, timeout_s: float, window_s: float = 0.5
) -> tuple[float, float | None]:
    """Wait (up to `timeout_s`) until other processes use less than `max_load` cores over a `window_s` window.

    Returns (seconds waited, last measured load). Call it while this process is idle."""
    start = time.perf_counter()
    load = None
    while True:
        a = cpu_snapshot()
        time.sleep(window_s)
        load = other_load(a, cpu_snapshot())
        waited = time.perf_counter() - start
        if load is None or load < max_load or waited >= timeout_s:
            return waited, load


# --------------------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------------------


OPENMP_LIBS = ("libiomp5", "libgomp", "libomp")


def openmp_runtimes(pid: int | str = "self") -> list[str]:
    """The OpenMP runtimes loaded in process `pid`, from its memory map (Linux; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/maps") as handle:
            maps = handle.read()
    except OSError:
        return []
    return sorted(lib for lib in OPENMP_LIBS if f"/{lib}" in maps)


def environment_metadata(threads: int) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "cuda": torch.cuda.is_available(),
        "openmp": openmp_runtimes(),
    }


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Render rows as a markdown table. `columns` is a list of (key, header); floats are formatted compactly."""

    def fmt(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if value >= 100:
                return f"{value:.0f}"
            if value >= 10:
                return f"{value:.1f}"
            return f"{value:.2f}"
        return str(value)

    cells = [[fmt(row.get(key)) for key, _ in columns] for row in rows]
    headers = [h for _, h in columns]
    widths = [max(len(h), *(len(c[j]) for c in cells)) if cells else len(h) for j, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    return "\n".join(lines)


def generate_batch_on_paged_sdpa(
    model,
    workload: Workload,
    cb_kwargs: dict[str, Any],
    after_step: Callable[[Any, bool], None] | None = None,
) -> tuple[list[list[int]], float, Any]:
    """`generate_batch` over `workload` on `paged|sdpa` under `ContinuousBatchingConfig(**cb_kwargs)`, the engine
    it ran on watched: `after_step(engine, first)` after each step (`first`: the engine's first step seen).
    Returns each request's tokens in order, the wall seconds and that engine (its counters, cache, offload)."""
    from unittest import mock

    from transformers_cb import ContinuousBatchingConfig
    from transformers_cb.engine.engine import Engine

    engines: list[Engine] = []
    original = Engine.step

    def step(self):
        first = not engines or engines[-1] is not self
        if first:
            engines.append(self)
        result = original(self)
        if after_step is not None:
            after_step(self, first)
        return result

    model.set_attn_implementation("paged|sdpa")
    generation_config = greedy_generation_config(max(workload.max_new_tokens))
    with mock.patch.object(Engine, "step", step):
        t0 = time.perf_counter()
        outputs = model.generate_batch(
            workload.inputs,
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            progress_bar=False,
        )
        wall = time.perf_counter() - t0
    restore_attn_implementation(model)
    ordered = [outputs[f"req_{i}"].generated_tokens for i in range(len(workload.requests))]
    return ordered, wall, engines[-1]
