"""The real client (issue 47, item 7): TRL's GRPO trainer with `peft_config=LoraConfig(...)` and
`use_transformers_continuous_batching=True`, untouched, generates its rollouts with this engine
(`generate_batch` of the PEFT-wrapped model). On a tiny Qwen2, greedy rollouts equal the PEFT model's
`generate()` at every step, the adapter changes the tokens (against the same model with the adapter
disabled), the adapter trains between steps, and nothing is merged or copied: the base weights keep
their storage and the resident parameter bytes stay the same across steps (docs/rl.md). In fp32 and in TRL's
default bf16, where TRL's trainer writes the trained adapter without bumping its version counters: the packed
copies of its Linears (bf16: every one) were reused stale before the run's start compared their values
(runner/products/packed_linear.py, `PackRegistry.check_sources`). bf16 tokens are compared tie-aware, as everywhere.
"""

from __future__ import annotations

import pytest
import torch

from conformance.common import tie_aware_mismatch
from tests.support.models import tiny_qwen2
from transformers_cb.models.tiny import build_tiny_tokenizer

peft = pytest.importorskip("peft", reason="the TRL test needs peft (the test extra installs it)")
trl = pytest.importorskip("trl", reason="the TRL test needs trl (the test extra installs it)")
datasets = pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset")

STEPS = 3
COMPLETION_TOKENS = 6


def _generate(model, prompt: list[int], generation_config) -> list[int]:
    ids = torch.tensor([prompt])
    output = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=generation_config
    )
    return output[0, len(prompt) :].tolist()


def _resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_grpo_with_lora_generates_on_the_engine_equal_to_generate_at_every_step(tmp_path, bf16: bool) -> None:
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    model = tiny_qwen2(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    dataset = datasets.Dataset.from_dict({"prompt": ["hello world", "abc", "the quick fox", "tiny"]})

    def reward(completions, **_):  # a reward that differs inside each group: non-zero advantages
        return [float(i % 3) for i in range(len(completions))]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=COMPLETION_TOKENS,
        max_steps=STEPS,
        learning_rate=0.05,
        beta=0.0,
        use_transformers_continuous_batching=True,
        generation_kwargs={"do_sample": False},  # greedy rollouts: comparable with generate()
        report_to="none",
        use_cpu=True,
        bf16=bf16,  # True (TRL's default): the model is cast to bf16 for generation
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
        ),
    )
    policy = trainer.model  # the PeftModel TRL trains: its generate_batch is the wrapped model's
    inner = policy.get_base_model()
    engine_generate_batch = inner.generate_batch
    steps: list[dict] = []

    def observed_generate_batch(inputs, **kwargs):
        """TRL's call, passed through untouched; its rollouts compared with generate() of the same model."""
        outputs = engine_generate_batch(inputs, **kwargs)
        config = kwargs["generation_config"]
        rollouts = [output.generated_tokens for output in outputs.values()]
        with torch.no_grad():
            expected = [_generate(policy, list(prompt), config) for prompt in inputs]
            with policy.disable_adapter():
                plain = [_generate(policy, list(prompt), config) for prompt in inputs]
            mismatches = [
                tie_aware_mismatch(policy, str(i), list(p), e, a, COMPLETION_TOKENS)[0]
                for i, (p, e, a) in enumerate(zip(inputs, expected, rollouts, strict=True))
            ]
        adapter = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        frozen = {n: p.data_ptr() for n, p in policy.named_parameters() if not p.requires_grad}
        steps.append(
            {
                "rollouts": rollouts,
                "expected": expected,
                "mismatches": mismatches,
                "plain": plain,
                "adapter": adapter,
                "frozen": frozen,
                "resident": _resident_bytes(policy),
                "n": len(inputs),
            }
        )
        return outputs

    inner.generate_batch = observed_generate_batch  # an instance attribute: PeftModel reaches it by getattr
    try:
        trainer.train()
    finally:
        del inner.generate_batch

    assert len(steps) == STEPS
    for index, step in enumerate(steps):
        assert step["n"] == 8 and all(len(r) == COMPLETION_TOKENS for r in step["rollouts"])
        if bf16:  # a genuine near-tie may part (then checked on, continued from the same prefix)
            real = [m.describe() for m in step["mismatches"] if m is not None]
            assert not real, f"step {index}: " + "\n".join(real)
        else:
            assert step["rollouts"] == step["expected"], f"step {index}: rollouts differ from generate()"
    assert any(s["rollouts"] != s["plain"] for s in steps), "the adapter changes no token"
    first, last = steps[0]["adapter"], steps[-1]["adapter"]
    assert any(not torch.equal(first[n], last[n]) for n in first), "the adapter did not train"
    # No merge, no second copy: the frozen base weights keep their storage, the parameter bytes are the same.
    assert all(s["frozen"] == steps[0]["frozen"] and s["resident"] == steps[0]["resident"] for s in steps)
    assert not any(getattr(m, "merged_adapters", None) for m in policy.modules())
