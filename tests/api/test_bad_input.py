"""Bad input to generate_batch: a clear ValueError naming the input before any work; step failures."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import GenerationConfig

from tests.support.models import VOCAB_SIZE, tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.runner.model_runner import ModelRunner

SMALL_CACHE = ContinuousBatchingConfig(page_size=16)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def forward_calls(model):
    """Counts forward passes of the model (there must be none when input is rejected)."""
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield calls
    handle.remove()


GOOD = [5, 6, 7]


def check_rejected(model, forward_calls, inputs, match: str, **kwargs) -> None:
    kwargs.setdefault("generation_config", GenerationConfig(max_new_tokens=4, do_sample=False))
    kwargs.setdefault("continuous_batching_config", SMALL_CACHE)
    attn_before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        model.generate_batch(inputs, progress_bar=False, **kwargs)
    assert forward_calls == [], "the input must be rejected before any forward pass"
    assert model.config._attn_implementation == attn_before


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([], "empty prompt"),
        ([5, -1, 6], "token id -1 at position 1 is outside the vocabulary"),
        (
            [5, VOCAB_SIZE],
            f"token id {VOCAB_SIZE} at position 1 is outside the vocabulary \\[0, {VOCAB_SIZE}\\)",
        ),
        ([10**12], "outside the vocabulary"),
        ("hello", "expected a list of token ids, got str"),
        (b"\x01\x02", "expected a list of token ids, got bytes"),
        ([1.0, 2.0], "token at position 0 is 1.0, not an int"),
        ([5, 6.5], "token at position 1 is 6.5"),
        (None, "expected a list of token ids, got NoneType"),
        (7, "expected a list of token ids, got int"),
        ([[5, 6]], "not an int"),
        ([5, None], "token at position 1 is None"),
        ([True, 5], "token at position 0 is True"),
        (torch.tensor([[5, 6]]), "1D integer tensor"),
        (torch.tensor([5.0, 6.0]), "1D integer tensor"),
    ],
)
def test_bad_prompt_names_its_index(model, forward_calls, bad, message: str) -> None:
    check_rejected(model, forward_calls, [GOOD, GOOD, bad, GOOD], match=rf"inputs\[2\]: .*{message}")


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_max_new_tokens_per_request(model, forward_calls, bad: int) -> None:
    check_rejected(
        model,
        forward_calls,
        [GOOD, GOOD, GOOD],
        match=re.escape(f"inputs[1]: max_new_tokens must be >= 1, got {bad}"),
        max_new_tokens=[3, bad, 2],
    )


def test_non_positive_max_new_tokens_for_all(model, forward_calls) -> None:
    check_rejected(
        model, forward_calls, [GOOD, GOOD], match=re.escape("inputs[0]: max_new_tokens"), max_new_tokens=0
    )


def test_max_new_tokens_of_wrong_type(model, forward_calls) -> None:
    check_rejected(
        model,
        forward_calls,
        [GOOD, GOOD],
        match=re.escape("inputs[1]: max_new_tokens must be an int"),
        max_new_tokens=[2, 2.5],
    )


def test_max_new_tokens_list_of_wrong_length(model, forward_calls) -> None:
    check_rejected(
        model,
        forward_calls,
        [GOOD, GOOD],
        match="max_new_tokens: got 3 values for 2 inputs",
        max_new_tokens=[1, 2, 3],
    )


def test_generation_config_rejects_zero_max_new_tokens() -> None:
    # transformers itself refuses it, so generate_batch never sees it.
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


def test_request_longer_than_the_model_context(model, forward_calls) -> None:
    max_positions = model.config.max_position_embeddings
    long = prompts_of_lengths([max_positions - 10], seed=0)[0]
    check_rejected(
        model,
        forward_calls,
        [GOOD, long],
        match=re.escape(
            f"inputs[1]: prompt ({max_positions - 10} tokens) + max_new_tokens (20) = {max_positions + 10} exceeds"
        ),
        generation_config=GenerationConfig(max_new_tokens=20),
    )
    prompt_too_long = prompts_of_lengths([max_positions + 1], seed=0)[0]
    check_rejected(model, forward_calls, [prompt_too_long], match=r"inputs\[0\]: .*max_position_embeddings")


def test_request_that_can_never_fit_the_cache(model, forward_calls) -> None:
    config = ContinuousBatchingConfig(page_size=4, num_blocks=3)
    check_rejected(
        model,
        forward_calls,
        [GOOD, [5] * 10],
        match=re.escape("inputs[1]: needs 4 KV pages of 4 tokens but the cache has only 3"),
        generation_config=GenerationConfig(max_new_tokens=5),
        continuous_batching_config=config,
    )


@pytest.mark.parametrize("inputs", ["not a list", b"bytes", 5, None, torch.tensor([[5, 6]])])
def test_inputs_must_be_a_list(model, forward_calls, inputs) -> None:
    check_rejected(model, forward_calls, inputs, match="inputs must be a list of token-id lists")


def test_bad_eos_token_id(model, forward_calls) -> None:
    check_rejected(model, forward_calls, [GOOD], match=re.escape("inputs[0]: eos_token_id"), eos_token_id="x")


def test_unknown_keyword_argument(model, forward_calls) -> None:
    with pytest.raises(TypeError, match="temperatur"):
        model.generate_batch([GOOD], temperatur=0.5, progress_bar=False)
    assert forward_calls == []


def test_empty_inputs_return_an_empty_dict(model, forward_calls) -> None:
    assert model.generate_batch([], progress_bar=False) == {}
    assert model.generate_batch([], GenerationConfig(max_new_tokens=3), SMALL_CACHE, progress_bar=False) == {}
    assert forward_calls == []


def test_valid_alternative_prompt_types_are_accepted(model) -> None:
    prompts = [torch.tensor([5, 6, 7]), (5, 6, 7), [torch.tensor(5), 6, 7]]
    outputs = model.generate_batch(
        prompts, GenerationConfig(max_new_tokens=3, do_sample=False), progress_bar=False
    )
    tokens = [outputs[f"req_{i}"].generated_tokens for i in range(3)]
    assert tokens[0] == tokens[1] == tokens[2] == greedy_reference(model, [5, 6, 7], 3)
    assert all(outputs[f"req_{i}"].prompt_ids == [5, 6, 7] for i in range(3))


# -- a failing step fails only its requests --------------------------------------------------------


def test_failing_step_fails_only_its_requests(model, monkeypatch) -> None:
    prompts = prompts_of_lengths([6, 9, 12, 5], seed=11)
    max_new_tokens = 5
    references = [greedy_reference(model, p, max_new_tokens) for p in prompts]
    steps: list[list[str]] = []
    original_run = ModelRunner.run

    def run(self, batch):
        steps.append([entry.request.request_id for entry in batch.entries])
        return original_run(self, batch)

    calls = []

    def fail_on_third_forward(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in layer 1")

    monkeypatch.setattr(ModelRunner, "run", run)
    # Raise in the middle of the model (after layer 0 wrote its KV), on the third step only.
    handle = model.model.layers[1].register_forward_pre_hook(fail_on_third_forward)
    try:
        outputs = model.generate_batch(
            prompts,
            GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False),
            ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2),
            progress_bar=False,
        )
    finally:
        handle.remove()
    failed_ids = set(steps[2])
    assert len(failed_ids) == 2 and "__warmup__" not in failed_ids, steps  # admission order: by prompt
    assert len(outputs) == 4
    for i, reference in enumerate(references):
        output = outputs[f"req_{i}"]
        if output.request_id in failed_ids:
            assert output.status == RequestStatus.FAILED
            assert output.error is not None
            assert "RuntimeError" in output.error and "boom in layer 1" in output.error
            assert output.generated_tokens == reference[: len(output.generated_tokens)]
            assert len(output.generated_tokens) < max_new_tokens
            assert output.finish_time is not None
        else:
            assert output.status == RequestStatus.FINISHED, output.error
            assert output.error is None
            assert output.generated_tokens == reference
    # The model works normally afterwards.
    again = model.generate_batch(
        prompts[:1], GenerationConfig(max_new_tokens=max_new_tokens), progress_bar=False
    )
    assert again["req_0"].generated_tokens == references[0]


@pytest.mark.parametrize(
    "name", ["pixel_values", "image_grid_thw", "images", "video_frames", "input_features"]
)
def test_image_video_and_audio_inputs_are_refused_by_name(model, forward_calls, name) -> None:
    check_rejected(
        model,
        forward_calls,
        [GOOD],
        rf"\['{name}'\]: image, video and audio inputs need a model with feature methods",
        **{name: torch.zeros(1)},
    )


def test_a_manager_refuses_image_inputs_by_name(model) -> None:
    manager = model.init_continuous_batching(continuous_batching_config=SMALL_CACHE)
    manager.start()
    try:
        with pytest.raises(
            ValueError, match=r"\['pixel_values'\]: image, video and audio inputs need a model with"
        ):
            manager.add_request(GOOD, max_new_tokens=2, pixel_values=torch.zeros(1))
        request_id = manager.add_request(GOOD, max_new_tokens=2)  # the manager still serves text
        assert manager.get_result(request_id, timeout=120).status == RequestStatus.FINISHED
    finally:
        manager.stop(block=True)
