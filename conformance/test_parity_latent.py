"""Greedy parity of multi-latent attention models on latent pages (attention/families/latent.py).

Two tiny models of the two MLA shapes: DeepSeek-V3's (MoE, a query LoRA: `q_lora_rank` set) and
DeepSeek-V2-Lite's (`q_lora_rank` None: one query projection). Their pages hold one latent row per token and
layer (`kv_lora_rank` + `qk_rope_head_dim` values), never the decompressed K/V: prefill chunks decompress
it, decodes absorb `W_UK` into the query and apply `W_UV` after the attention. The absorbed decode sums
in another order than `generate()`'s decompressed attention: in float32 every greedy token equals
`generate()`'s (a difference only at a near-tie, logit gap under 1e-4, continued from there) and every
logprob is within 1e-4 of its own.

Each runs with chunked prefill (5 and 16-token steps), under preemption (a cache just big enough for the
largest request), with CPU offload (preempted requests swap their latent pages out and back), with prefix
hits, with forks (`num_return_sequences`) and with a latent draft model, on the native CPU kernel and on the torch path, the engine's
integrity check after every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from conformance.common import (
    ReferenceCache,
    check_parity,
    check_parity_under_eviction,
    count_preemptions,
    greedy_config,
    tight_num_blocks,
)
from conformance.test_parity_offload import engines_checked
from conformance.test_prefix_sharing import check_shared_prefix_parity
from tests.support.prompts import random_prompts
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import ENV_SWITCH, native_module
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission

MAX_NEW_TOKENS = 10
VOCAB = 300
LOGPROB_TOLERANCE = 1e-4
RANK, ROPE, NOPE, V_DIM, HEADS = 24, 4, 8, 6, 4
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "kv_lora_rank": RANK,
    "qk_rope_head_dim": ROPE,
    "qk_nope_head_dim": NOPE,
    "v_head_dim": V_DIM,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _tiny(model_type: str, **overrides) -> PreTrainedModel:
    config = AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    # DeepSeek-V3's shape: MoE after a dense first layer, the query through its own LoRA.
    "deepseek_v3": lambda: _tiny("deepseek_v3", q_lora_rank=16, n_group=1, topk_group=1),
    # DeepSeek-V2-Lite's: no query LoRA (q_proj), MoE after a dense first layer.
    "deepseek_v2": lambda: _tiny("deepseek_v2", q_lora_rank=None, n_group=1, topk_group=1),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def subject(request):
    model = MODELS[request.param]()
    prompts = random_prompts(6, VOCAB, 1, 30, seed=1)
    return request.param, model, prompts, ReferenceCache(model, MAX_NEW_TOKENS)


@torch.inference_mode()
def reference_logprobs(model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """generate()'s log-softmax of each of `tokens` (its own greedy continuation of `prompt`)."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_config=greedy_config(len(tokens)),
        output_logits=True,
        return_dict_in_generate=True,
    )
    return [float(step[0].float().log_softmax(-1)[t]) for step, t in zip(out.logits, tokens, strict=True)]


def check_logprobs(model, prompts, outputs, references: ReferenceCache, context: str) -> None:
    """Each output's logprobs within LOGPROB_TOLERANCE of generate()'s, up to its first token difference."""
    for i, prompt in enumerate(prompts):
        output = outputs[f"req_{i}"]
        expected = references.get(prompt)
        same = 0
        while same < len(expected) and same < len(output.generated_tokens):
            if expected[same] != output.generated_tokens[same]:
                break
            same += 1
        assert output.logprobs is not None, f"{context}: req_{i} has no logprobs"
        ours = list(output.logprobs[:same])
        theirs = reference_logprobs(model, prompt, expected[:same])
        worst = max((abs(a - b) for a, b in zip(ours, theirs, strict=True)), default=0.0)
        assert worst <= LOGPROB_TOLERANCE, (
            f"{context}: req_{i} logprobs differ by {worst:.2e}: {ours} vs {theirs}"
        )


@pytest.fixture(params=["1", "0"], ids=["native", "torch"])
def kernel(request, monkeypatch) -> str:
    if request.param == "1" and native_module() is None:
        pytest.skip("the native CPU kernel is not built here")
    monkeypatch.setenv(ENV_SWITCH, request.param)
    return request.param


def test_the_pages_hold_the_latent_not_decompressed_kv(subject) -> None:
    """One row of kv_lora_rank + qk_rope_head_dim values per token and layer, equal to the module's own
    normalised latent and rotary key: a pool of decompressed K/V (heads x (nope + rope) and heads x v)
    fails both the byte count and the content."""
    _, model, prompts, _ = subject
    engine = build_engine(model, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(page_size=4))
    layout = engine.settings.cache.layout
    (group,) = layout.groups
    assert group.latent == (RANK, ROPE) and layout.head_shape(0) == (1, RANK + ROPE)
    assert layout.group_page_bytes(0) == 2 * 4 * (RANK + ROPE) * 4  # layers x page_size x row x fp32
    assert engine.snapshot().kv_bytes_per_token == 2 * (RANK + ROPE) * 4
    (tensor,) = engine.runner.packer.cache.group_tensors
    assert tensor.shape[0] == 1 and tensor.shape[-2:] == (1, RANK + ROPE)
    prompt = prompts[0]
    latents: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda _m, _i, out, index=index: latents.setdefault(index, out.detach().clone())
        )
        for index, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt]), use_cache=False)
        latents_seen = dict(latents)
        latents.clear()
        request = engine.build_request(Submission(prompt, "req_0", max_new_tokens=3))
        with engine.session():
            engine.add(request)
            engine.step()
            slots = _request_slots(engine, request)
            for index in range(len(model.model.layers)):
                rows = engine.runner.packer.cache.keys[index][slots, 0]  # [len(prompt), RANK + ROPE]
                torch.testing.assert_close(rows[:, :RANK], latents_seen[index][0], rtol=1e-5, atol=1e-5)
    finally:
        for hook in hooks:
            hook.remove()


def _request_slots(engine, request) -> torch.Tensor:
    """The slots of `request`'s prompt tokens in its pages, in order."""
    pages = request.pages[0].page_ids
    page_size = engine.settings.cache.layout.page_size
    slots = [page * page_size + offset for page in pages for offset in range(page_size)]
    return torch.tensor(slots[: len(request.prompt_ids)], dtype=torch.long)


@pytest.mark.parametrize("budget", [5, 16], ids=lambda b: f"budget{b}")
def test_latent_parity_chunked_and_preempted(subject, kernel: str, budget: int) -> None:
    name, model, prompts, references = subject
    context = f"{name} / native={kernel}"
    with engines_checked():
        outputs = check_parity_under_eviction(
            model, prompts, references, context, max_batch_tokens=budget, return_logprobs=True
        )
    check_logprobs(model, prompts, outputs, references, context)


def test_latent_parity_with_offload(subject, kernel: str) -> None:
    """Preempted requests swap their latent pages to the host tier and back: nothing is recomputed."""
    name, model, prompts, references = subject
    context = f"{name} / native={kernel} / offload"
    with engines_checked() as engines:
        outputs = check_parity_under_eviction(
            model, prompts, references, context, cpu_offload_space=None, return_logprobs=True
        )
    (engine,) = engines
    assert engine.offload is not None and engine.offload.swap_out_pages > 0, context
    assert engine.scheduler.recomputed.total == 0, context
    check_logprobs(model, prompts, outputs, references, context)


def test_latent_parity_with_prefix_hits(subject, kernel: str) -> None:
    name, model, _, references = subject
    check_shared_prefix_parity(model, references, f"{name} / native={kernel} / sharing", MAX_NEW_TOKENS)


def test_latent_parity_with_forks(subject, kernel: str) -> None:
    """`num_return_sequences=2` under pressure with offload: the forks copy (or share) latent pages; every
    fork of a greedy request equals generate()."""
    name, model, prompts, references = subject
    prefix = random_prompts(1, VOCAB, 12, 12, seed=3)[0]
    forked = [prefix + suffix for suffix in prompts[:4]]
    config = ContinuousBatchingConfig(
        page_size=4,
        max_batch_tokens=16,
        num_blocks=tight_num_blocks(forked, MAX_NEW_TOKENS, 4) + 4,
        cpu_offload_space=None,
    )
    with engines_checked(), count_preemptions():
        outputs = model.generate_batch(
            forked,
            greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=config,
            num_return_sequences=2,
            progress_bar=False,
        )
    for i, prompt in enumerate(forked):
        expected = references.get(prompt)
        for rid in (f"req_{i}", f"req_{i}__child#0"):
            assert outputs[rid].generated_tokens == expected, f"{name} / native={kernel}: {rid}"


def test_latent_parity_with_a_latent_draft_model(subject, kernel: str) -> None:
    """Speculation with a draft model of the same latent shape (a copy): verification steps run several
    query tokens of one request over its latent pages, and the draft model runs on latent pages of its own."""
    name, model, prompts, references = subject
    outputs = model.generate_batch(
        [list(p) for p in prompts],
        generation_config=greedy_config(MAX_NEW_TOKENS),
        assistant_model=copy.deepcopy(model),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, max_batch_tokens=16),
        progress_bar=False,
    )
    context = f"{name} / native={kernel} / draft model"
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)


def test_plain_generate_during_a_run_decompresses(subject) -> None:
    """Inside the engine's session (the modules' `expand_kv` handed through, the paged backend set), a plain
    `generate()` outside any step still decompresses: its tokens are generate()'s own."""
    name, model, prompts, references = subject
    engine = build_engine(model, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(page_size=4))
    with engine.session():
        inside = [
            model.generate(torch.tensor([list(p)]), generation_config=greedy_config(MAX_NEW_TOKENS))[
                0, len(p) :
            ]
            for p in prompts[:2]
        ]
    assert [t.tolist() for t in inside] == [references.get(p) for p in prompts[:2]], name
