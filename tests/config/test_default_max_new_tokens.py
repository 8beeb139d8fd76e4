"""`default_max_new_tokens`: the one rule for a request that gives no `max_new_tokens`."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.config.generation_fields import default_max_new_tokens, resolve_generation_config
from transformers_cb.engine.build import build_engine


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_new_tokens": 7, "max_length": 100}, 7),  # max_new_tokens wins
        ({"max_length": 12}, 2),  # what max_length leaves after a 10-token prompt
        ({"max_length": 8}, -2),  # nothing left: the request is refused at submission
        ({}, None),
    ],
)
def test_the_rule(fields: dict, expected: int | None) -> None:
    config = GenerationConfig()
    config.max_new_tokens, config.max_length = fields.get("max_new_tokens"), fields.get("max_length")
    assert default_max_new_tokens(config, 10) == expected


@pytest.mark.parametrize("fields", [{"max_new_tokens": 5}, {"max_length": 30}, {}])
def test_the_engine_applies_the_same_rule_to_its_resolved_config(fields: dict) -> None:
    model = tiny_llama()
    generation_config = GenerationConfig(do_sample=False, **fields)
    engine = build_engine(model, generation_config, ContinuousBatchingConfig(page_size=16, num_blocks=8))
    resolved = resolve_generation_config(model, generation_config)
    for num_prompt_tokens in (1, 9):
        expected = default_max_new_tokens(resolved, num_prompt_tokens)
        assert (
            default_max_new_tokens(engine.settings.sampling.generation_config, num_prompt_tokens) == expected
        )
