"""One entry's tiny model, its prompts, and the `generate()` references they are judged by."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from tests.support.hybrids import HYBRIDS, hybrid_config
from tests.support.sharp import sharpen

from .catalog import CAUSAL_LM, Entry
from .shrink import SPECIAL_ID_SUFFIXES, tiny_config

SEED = 0
MAX_NEW_TOKENS = 10
SHARED_PREFIX = 16  # prompt 2 starts with prompt 0's first 16 tokens: whole pages shared
PROMPT_LENGTHS = (20, 9, SHARED_PREFIX + 6, 27)  # longer than the windows, chunks and token budget


@dataclass
class Generated:
    """One request's greedy output: its tokens and, where the engine reports them, their logprobs."""

    tokens: list[int]
    logprobs: list[float] | None = None


class NotBuilt(Exception):
    """The tiny config or the model could not be built offline; the message says which and why."""


@dataclass
class Subject:
    """A built entry: the model, its prompts and their references (None when generate() failed)."""

    model: PreTrainedModel
    prompts: list[list[int]]
    references: list[Generated] | None
    reference_error: str | None
    family: str
    layer_kinds: str


def greedy(max_new_tokens: int = MAX_NEW_TOKENS) -> GenerationConfig:
    """Greedy decoding with eos off, so every request runs `max_new_tokens` steps in every engine."""
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=None)


def entry_config(entry: Entry) -> Any:
    """The entry's tiny config: hand-written for the linear-attention and state-space families
    (tests/support/hybrids.py: shrinking their defaults breaks the state-space widths, e.g. Mamba 2's heads
    against its groups, or keeps no attention layer of a hybrid), else shrunk from the class's defaults."""
    if entry.mapping == CAUSAL_LM and entry.model_type in HYBRIDS:
        return hybrid_config(entry.model_type)
    return tiny_config(entry.model_type)


def build_model(entry: Entry, sharp: float | None = None) -> PreTrainedModel:
    """The entry's class from its tiny config: seeded random weights, float32, CPU, eval mode; `sharp`: its
    query / key projections scaled by that factor after init (tests/support/sharp.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config = entry_config(entry)
    except Exception as exc:  # noqa: BLE001  (any failure of the class is the reason it is not instantiable)
        raise NotBuilt(f"tiny config: {type(exc).__name__}: {exc}") from exc
    auto = AutoModelForCausalLM if entry.mapping == CAUSAL_LM else AutoModelForImageTextToText
    torch.manual_seed(SEED)
    try:
        model = auto.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise NotBuilt(f"model: {type(exc).__name__}: {exc}") from exc
    model.eval()
    if sharp is not None:
        sharpen(model, sharp)
    # A neutral generation config: checkpoint-style defaults (sampling, penalties) stay out of the comparison.
    saved = getattr(model, "generation_config", None)
    if saved is None:
        raise NotBuilt(
            f"model: {type(model).__name__} has no generation_config (it is not a generating model)"
        )
    model.generation_config = GenerationConfig(
        bos_token_id=saved.bos_token_id, pad_token_id=saved.pad_token_id, eos_token_id=None
    )
    return model


def special_ids(config: Any) -> set[int]:
    """Every special token id named anywhere in the config tree (prompts avoid them: an image token
    would ask a vision-language model for an image)."""
    found: set[int] = set()

    def walk(d: dict) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value)
            elif str(key).endswith(SPECIAL_ID_SUFFIXES):
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, int) and not isinstance(v, bool):
                        found.add(v)

    walk(config.to_dict())
    return found


def make_prompts(model: PreTrainedModel) -> list[list[int]]:
    """Seeded random prompts of ordinary tokens; prompt 2 shares prompt 0's first SHARED_PREFIX tokens."""
    # The smaller of the config's vocabulary (what the engine validates against) and the embedding's rows.
    text_vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    vocab = min(v for v in (text_vocab, model.get_input_embeddings().num_embeddings) if v)
    avoid = special_ids(model.config)
    pool = [t for t in range(3, vocab) if t not in avoid]
    rng = random.Random(SEED)
    prompts = [[rng.choice(pool) for _ in range(n)] for n in PROMPT_LENGTHS]
    prompts[2][:SHARED_PREFIX] = prompts[0][:SHARED_PREFIX]
    return prompts


@torch.inference_mode()
def reference(model: PreTrainedModel, prompt: list[int]) -> Generated:
    """`generate()` on one prompt alone: the generated ids and the log-softmax of their raw logits."""
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=greedy(),
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    logprobs = [
        float(step[0].float().log_softmax(-1)[t]) for step, t in zip(out.logits, tokens, strict=False)
    ]
    return Generated(tokens, logprobs)


@torch.inference_mode()
def logit_margin(model: PreTrainedModel, ids: list[int], token: int) -> float | None:
    """max logit - logit(token) after `ids`, from one plain forward; None when it cannot be computed."""
    try:
        input_ids = torch.tensor([ids])
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
        last = logits[0, -1].float()
        return float(last.max() - last[token])
    except Exception:  # noqa: BLE001  (a margin is a diagnosis; without it the difference is a mismatch)
        return None


def family_of_class(model_class: type) -> str:
    """The transformers modeling module that implements the class (`models/<family>/`)."""
    parts = model_class.__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" else model_class.__module__


def family_of(model: PreTrainedModel) -> str:
    return family_of_class(type(model))


def describe_unbuilt(entry: Entry) -> tuple[str, str]:
    """(family, layer kinds) of an entry whose tiny model could not be built: from its class and the
    config class's own defaults, where those build."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = kinds = ""
    try:
        family = family_of_class(getattr(transformers, entry.class_name))
        kinds = layer_kinds_of(CONFIG_MAPPING[entry.model_type]())
    except Exception:  # noqa: BLE001  (a description only: blank where the class cannot say)
        pass
    return family, kinds


def layer_kinds_of(config: Any) -> str:
    """The text decoder's attention layer kinds, plus the features that change how it must be run."""
    text = config.get_text_config(decoder=True)
    d = text.to_dict()
    kinds = set(d.get("layer_types") or [])
    if not kinds:
        window = d.get("sliding_window")
        kinds.add("sliding_attention" if window and d.get("use_sliding_window", True) else "full_attention")
    features = []
    if getattr(config, "is_encoder_decoder", False):
        features.append("encoder-decoder")
    if d.get("is_decoder") is False and not getattr(config, "is_encoder_decoder", False):
        features.append("encoder")
    if any(d.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")):
        features.append("moe")
    if d.get("kv_lora_rank"):
        features.append("mla")
    if d.get("per_layer_config"):
        features.append("per-layer")
    if any(d.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")):
        features.append("softcap")
    if text is not config:
        features.append("composite")
    return ", ".join(sorted(kinds) + features)


def build_subject(entry: Entry, sharp: float | None = None) -> Subject:
    """Build the model (`sharp`: its query / key projections scaled) and its references (raises `NotBuilt`
    when the config or the model cannot be built)."""
    model = build_model(entry, sharp)
    try:
        prompts = make_prompts(model)
    except Exception as exc:  # noqa: BLE001
        raise NotBuilt(
            f"model: no token embeddings to draw prompts from: {type(exc).__name__}: {exc}"
        ) from exc
    references: list[Generated] | None = None
    error = None
    try:
        references = [reference(model, p) for p in prompts]
    except Exception as exc:  # noqa: BLE001  (the class's own generate() failing is recorded, not raised)
        error = f"{type(exc).__name__}: {exc}"
    return Subject(model, prompts, references, error, family_of(model), layer_kinds_of(model.config))
