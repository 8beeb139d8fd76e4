"""A built-in tiny model and byte-level tokenizer that need no download.

They let ``transformers-cb generate`` run with zero arguments and give tests a
model that is fast on CPU. The model has random weights, so its text is
gibberish; it exercises the whole generation path, not language quality.
"""

from __future__ import annotations

from typing import cast

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

TINY_HIDDEN_SIZE = 64
TINY_NUM_LAYERS = 2
TINY_NUM_HEADS = 4
TINY_NUM_KV_HEADS = 2
TINY_INTERMEDIATE_SIZE = 128
TINY_MAX_POSITIONS = 2048
# A small chat template (ChatML-like) so /v1/chat/completions works on the built-in model.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_level_vocab() -> dict[str, int]:
    """Special tokens first (ids 0, 1, 2), then the 256 byte-level symbols."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    return vocab


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (259 ids) under which any UTF-8 text round-trips exactly.

    It carries a small chat template (``TINY_CHAT_TEMPLATE``). ``encode`` prepends ``<s>``; ``decode(..., skip_special_tokens=True)`` returns the
    original text. Special-token strings inside the text (a literal ``"</s>"``) are
    encoded as plain bytes (``split_special_tokens=True``), so the round trip is exact
    for every string.
    """
    vocab = _byte_level_vocab()
    backend = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        split_special_tokens=True,
        model_max_length=TINY_MAX_POSITIONS,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_llama_config(
    vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        num_key_value_heads=TINY_NUM_KV_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        max_position_embeddings=TINY_MAX_POSITIONS,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_model(
    seed: int = 0,
    vocab_size: int | None = None,
    attn_implementation: str = "sdpa",
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> LlamaForCausalLM:
    """A tiny random Llama (fp32, eval mode) matching :func:`build_tiny_tokenizer`.

    The weights depend only on ``seed``. ``vocab_size`` defaults to the tokenizer's.
    """
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    config = tiny_llama_config(
        vocab_size=vocab_size if vocab_size is not None else len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # In place (`to` and `eval` return the module itself), on the `torch.nn.Module` it is: type checkers read
    # `PreTrainedModel.to` (wrapped with `functools.wraps`) as a plain function that takes `self` again.
    cast(torch.nn.Module, model).to(torch.float32).eval()
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
