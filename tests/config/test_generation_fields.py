"""Refuse what is not done: every `GenerationConfig` field is classified, and a field set away from its
default that the engine neither implements nor can ignore safely raises a `ValueError` naming it."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb.config.generation_fields import (
    HARMLESS,
    IMPLEMENTED,
    REFUSED,
    UnsupportedGenerationOption,
    field_names,
    transformers_defaults,
)
from transformers_cb.sampling.neutral import NEUTRAL_VALUES, check_generation_config, is_default

# A value away from the default for each refused field. (The logits processors issue 14 listed here are
# implemented since issue 10: conformance/test_processors.py checks each against generate().)
NON_DEFAULT = {
    "max_time": 5.0,
    "num_beams": 2,
    "num_beam_groups": 2,
    "diversity_penalty": 0.5,
    "penalty_alpha": 0.6,
    "dola_layers": "low",
    "force_words_ids": [[7]],
    "constraints": ["c"],
    "guidance_scale": 1.5,
    "watermarking_config": {"bias": 2.0},
    "token_healing": True,
    "assistant_early_exit": 2,
    "assistant_ensemble_weight": 0.5,
    "speculation_type": "x",
    "use_mtp": True,
}


def test_every_generation_config_field_is_classified_exactly_once():
    fields = set(field_names())
    tables = {"implemented": IMPLEMENTED, "harmless": set(HARMLESS), "refused": REFUSED}
    unclassified = fields - IMPLEMENTED - set(HARMLESS) - REFUSED
    assert not unclassified, (
        f"GenerationConfig fields new to transformers_cb: {sorted(unclassified)}; classify each in "
        "transformers_cb/config/generation_fields.py (implemented, harmless with a reason, or refused)"
    )
    names = [name for table in tables.values() for name in table]
    assert len(names) == len(set(names)), "a field is in two tables"
    stale = set(names) - fields
    assert not stale, f"fields no longer in GenerationConfig: {sorted(stale)}"


def test_every_refused_field_has_a_test_value_and_defaults_pass():
    assert set(NON_DEFAULT) == REFUSED
    check_generation_config(GenerationConfig())
    check_generation_config(GenerationConfig(**transformers_defaults()))
    for name, value in NEUTRAL_VALUES.items():
        assert is_default(name, value)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_field_away_from_its_default_raises_naming_it(name):
    config = GenerationConfig()
    setattr(config, name, NON_DEFAULT[name])  # set directly: some combinations fail validation
    with pytest.raises(ValueError, match=rf"GenerationConfig\.{name}=") as info:
        check_generation_config(config)
    assert isinstance(info.value, UnsupportedGenerationOption)
    assert isinstance(info.value, NotImplementedError), "earlier releases raised NotImplementedError"


def test_an_unknown_field_away_from_its_default_is_refused(monkeypatch):
    import transformers_cb.config.generation_fields as fields

    monkeypatch.setattr(fields, "field_names", lambda: ["brand_new_option"])
    config = GenerationConfig()
    config.brand_new_option = 3
    with pytest.raises(ValueError, match="brand_new_option=3 is unknown"):
        check_generation_config(config)


@pytest.mark.parametrize("name", ["max_time", "penalty_alpha", "guidance_scale", "num_beams"])
def test_generate_batch_refuses_them_at_submission(name):
    model = tiny_llama()
    config = GenerationConfig(max_new_tokens=2)
    setattr(config, name, NON_DEFAULT[name])
    with pytest.raises(ValueError, match=name):
        model.generate_batch([[5, 6]], config, progress_bar=False)
    with pytest.raises(ValueError, match=name):
        model.init_continuous_batching(generation_config=config)


def test_implemented_and_harmless_fields_are_accepted():
    config = GenerationConfig(
        max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, eos_token_id=2, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True, use_cache=True,
    )  # fmt: skip
    check_generation_config(config)
