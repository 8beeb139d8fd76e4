"""The built-in tiny model and byte-level tokenizer (models/tiny.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world!",
        "  leading and trailing  ",
        "Héllo wörld\n\ttabs",
        "日本語 🙂 emoji",
        "a</s>b<s>c<pad>",
    ],
)
def test_tiny_tokenizer_round_trips(text: str) -> None:
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_tokenizer_special_tokens_and_save_load(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = build_tiny_tokenizer()
    assert len(tokenizer) == 259
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "round trip </s> through disk ✓"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text), skip_special_tokens=True) == text
    assert loaded.eos_token_id == tokenizer.eos_token_id
    assert loaded.pad_token_id == tokenizer.pad_token_id


def test_tiny_model_shape_and_determinism() -> None:
    tokenizer = build_tiny_tokenizer()
    model_a = build_tiny_model(seed=3)
    model_b = build_tiny_model(seed=3)
    model_c = build_tiny_model(seed=4)
    config = model_a.config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tokenizer)
    assert model_a.generation_config.eos_token_id == tokenizer.eos_token_id
    assert not model_a.training
    assert all(p.dtype == torch.float32 for p in model_a.parameters())
    state_a, state_b, state_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)
