"""A trainer's loop on one PEFT model (issue 47, items 1-3 with item 7's adapter; docs/rl.md): the manager runs
the LoRA-wrapped model the trainer trains, with no adapter merge and no second weight copy. Each step: the
gradients are computed on that model while the manager is stopped (its run session exited: the model is the
user's again), the manager starts, rollouts are submitted, and the optimizer step is applied inside
`pause(mode="recompute")` while they are in flight. Checked: one new weight version per step, the rollouts
in flight end on it, the rollouts submitted after the update equal `generate()` of the trained model, and the
frozen base weights keep their storage (resident parameter bytes unchanged).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import sharpen_attention, tiny_qwen2
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.conformance_check import greedy_config, reference_greedy

peft = pytest.importorskip("peft", reason="the adapter loop needs peft (the test extra installs it)")

STEPS = 3
MAX_NEW_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 20], [30, 31, 32]]


def _frozen(model) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in model.named_parameters() if not p.requires_grad}


def _collect(manager, ids: list[str]) -> dict[str, object]:
    outputs = {}
    for rid in ids:
        outputs[rid] = manager.get_result(request_id=rid, timeout=60)
    return outputs


def test_pause_update_and_versions_on_the_trained_peft_model_itself() -> None:
    model = peft.get_peft_model(
        sharpen_attention(tiny_qwen2()),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    frozen = _frozen(model)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4),
    )
    seen: list[list[list[int]]] = []
    try:
        for step in range(STEPS):
            batch = torch.tensor([PROMPTS[0]])
            (-model(input_ids=batch, labels=batch).loss).backward()  # the manager is stopped: plain model
            manager.start()
            in_flight = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
            with manager.pause(mode="recompute"), torch.no_grad():
                optimizer.step()  # in place: the version counters move, the change is seen at the exit
            optimizer.zero_grad()
            assert manager.weight_version == step + 1
            after = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
            outputs = _collect(manager, [*in_flight, *after])
            manager.stop()
            for rid in in_flight:  # whatever ran before the update, the last tokens are the new version's
                output = outputs[rid]
                assert output.status == RequestStatus.FINISHED
                assert output.weight_version_last == step + 1 and output.kv_weight_version == step + 1
            expected = [reference_greedy(model, p, greedy_config(MAX_NEW_TOKENS)) for p in PROMPTS]
            got = [outputs[rid].generated_tokens for rid in after]
            assert got == expected, f"step {step}: rollouts after the update differ from generate()"
            assert all(outputs[rid].weight_version_runs == ((0, step + 1),) for rid in after)
            seen.append(got)
    finally:
        manager.stop(hard_stop=True)
    assert len({str(s) for s in seen}) > 1, "training moved no token: the test could not fail"
    assert _frozen(model) == frozen  # no merge: the base weights are the same storage
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == resident


def test_release_train_resume_on_the_peft_model_itself() -> None:
    """docs/rl.md, "Releasing the cache while training": rollouts, `release_cache()`, a training step on the
    same PEFT model, `resume_cache()`: one new version per step, rollouts equal to `generate()`."""
    model = peft.get_peft_model(
        sharpen_attention(tiny_qwen2()),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    frozen = _frozen(model)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4),
    )
    seen = []
    manager.start()
    try:
        for step in range(STEPS):
            ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
            outputs = _collect(manager, ids)
            got = [outputs[rid].generated_tokens for rid in ids]
            assert got == [reference_greedy(model, p, greedy_config(MAX_NEW_TOKENS)) for p in PROMPTS]
            assert all(outputs[rid].weight_version_runs == ((0, step),) for rid in ids)
            seen.append(got)
            manager.release_cache()
            batch = torch.tensor([PROMPTS[0]])
            (-model(input_ids=batch, labels=batch).loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.resume_cache()
            assert manager.weight_version == step + 1
    finally:
        manager.stop(hard_stop=True)
    assert len({str(s) for s in seen}) > 1, "training moved no token: the test could not fail"
    assert _frozen(model) == frozen
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == resident
