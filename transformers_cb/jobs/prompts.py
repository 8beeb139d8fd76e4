"""A prompt's token ids: the one rendering every path uses, so that each gives the model the same prompt.

Text is either encoded as it is, with the tokenizer's own special tokens (a BOS where the tokenizer adds
one), or, with `PromptFormat.chat`, sent as one user message (after the `system_prompt`, if any) through
the tokenizer's chat template with its generation prompt; a chat template writes its special tokens
itself, so the rendered text is encoded without the tokenizer's (`add_special_tokens=False`, as
transformers' own `apply_chat_template(tokenize=True)` does).

Used by `transformers-cb generate` (`jobs/inputs.py` `tokenize_requests`), its Ray form's actors
(`scale_out/predictor.py` `CBPredictor`) and the OpenAI server (`serve/chat/chat_template.py`, `serve/app.py`,
hence its Ray Serve replicas too); docs/scale_out.md says what this guarantees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template to render a chat with."""


@dataclass(frozen=True)
class PromptFormat:
    """How a text prompt becomes the model's prompt.

    `chat`: as one user message through the chat template (else the text as it is); `system_prompt`: a
    system message before it (chat only); `add_generation_prompt`: end with the template's assistant
    header, so that the model answers (chat only)."""

    chat: bool = False
    system_prompt: str | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if self.system_prompt is not None and not self.chat:
            raise ValueError("a system prompt needs the chat template (chat=True)")

    def messages(self, text: str) -> list[dict[str, str]]:
        """`text` as the chat this format sends: the system message, if any, then one user message."""
        system: list[dict[str, str]] = (
            [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        )
        return [*system, {"role": "user", "content": text}]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """`messages` rendered as text by the tokenizer's chat template (`template_kwargs`: `tools`,
    `enable_thinking`, ... as the template reads them). Raises `NoChatTemplate` when it has none; a
    template's own refusal (e.g. of the roles' order) is raised as the template raised it."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("the tokenizer has no chat template")
    return str(
        tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
    )


def rendered_ids(tokenizer: PreTrainedTokenizerBase, rendered: str) -> list[int]:
    """A rendered chat's ids: the template wrote the special tokens, the tokenizer adds none."""
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Plain text's ids, with the special tokens the tokenizer adds (a BOS, where it adds one)."""
    return list(tokenizer.encode(text))


def chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """A chat's prompt ids: `render_chat`, then `rendered_ids`."""
    return rendered_ids(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, **template_kwargs))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, prompt_format: PromptFormat) -> list[int]:
    """A text prompt's ids under `prompt_format` (see the module docstring)."""
    if prompt_format.chat:
        return chat_ids(tokenizer, prompt_format.messages(text), prompt_format.add_generation_prompt)
    return text_ids(tokenizer, text)
