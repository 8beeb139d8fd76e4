"""`jobs/prompts.py`: the one rendering of a prompt, as transformers' own `apply_chat_template` tokenizes it,
and the same ids from the local CLI's reader (`tokenize_requests`) and a Ray replica (`CBPredictor`)."""

from __future__ import annotations

import pytest

from transformers_cb.jobs.inputs import CliRequest, InputError, tokenize_requests
from transformers_cb.jobs.prompts import NoChatTemplate, PromptFormat, chat_ids, prompt_ids, render_chat
from transformers_cb.models.tiny import build_tiny_tokenizer
from transformers_cb.scale_out.predictor import CBPredictor

PROMPTS = ("line 0 of the input", "a second, longer line of the input", "é")
FORMATS = (
    PromptFormat(),
    PromptFormat(chat=True),
    PromptFormat(chat=True, system_prompt="Answer briefly."),
    PromptFormat(chat=True, add_generation_prompt=False),
)


@pytest.mark.parametrize("prompt_format", FORMATS, ids=lambda f: repr(f))
def test_the_rendering_is_transformers_own(prompt_format: PromptFormat) -> None:
    tokenizer = build_tiny_tokenizer()  # byte-level, adds a BOS to plain text, carries a chat template
    for text in PROMPTS:
        ids = prompt_ids(tokenizer, text, prompt_format)
        if prompt_format.chat:
            messages = prompt_format.messages(text)
            expected = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=prompt_format.add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
            assert tokenizer.decode(ids) == render_chat(
                tokenizer, messages, prompt_format.add_generation_prompt
            )
        else:
            expected = tokenizer.encode(text)
            assert ids[0] == tokenizer.bos_token_id  # plain text keeps the tokenizer's special tokens
        assert ids == list(expected)


def test_a_system_prompt_comes_first_and_needs_the_chat_template() -> None:
    assert PromptFormat(chat=True, system_prompt="S").messages("U") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
    ]
    with pytest.raises(ValueError, match="system prompt needs the chat template"):
        PromptFormat(system_prompt="S")


def test_no_template_is_named() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(NoChatTemplate):
        chat_ids(tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match="--chat: the model's tokenizer has no chat template"):
        tokenize_requests(tokenizer, [CliRequest(id=0, prompt="hi")], PromptFormat(chat=True))


@pytest.mark.parametrize("chat", [False, True])
def test_the_local_reader_and_a_ray_replica_give_the_same_ids(chat: bool) -> None:
    """`CBPredictor` is what `generate --ray` runs on each actor: its ids must be the local command's."""
    predictor = CBPredictor(None, apply_chat_template=chat)
    requests = [CliRequest(id=i, prompt=p) for i, p in enumerate(PROMPTS)]
    local = tokenize_requests(predictor.tokenizer, requests, PromptFormat(chat=chat))
    columns = {"prompt": list(PROMPTS)}
    replica = [predictor._prompt_ids(columns, row) for row in range(len(PROMPTS))]
    assert replica == local
    assert (local[0][0] == predictor.tokenizer.bos_token_id) is not chat
