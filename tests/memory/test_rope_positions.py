"""A dynamic rotary embedding (LongRoPE, dynamic NTK) runs past `max_position_embeddings` as `generate()` does:
`ModelShape` bounds no request's length there (memory/sizing.py `native_positions`); other models keep it."""

from __future__ import annotations

from transformers import LlamaConfig

from tests.support.models import LONGROPE_PARAMETERS, TINY_SHAPE
from transformers_cb.memory.sizing import ModelShape

UNBOUNDED = 2**31 - 1


def test_dynamic_rope_types_are_not_bounded_by_the_native_length() -> None:
    dynamic = LlamaConfig(
        **{**TINY_SHAPE, "max_position_embeddings": 32},
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )
    longrope = LlamaConfig(
        **{**TINY_SHAPE, "max_position_embeddings": 64}, rope_parameters=dict(LONGROPE_PARAMETERS)
    )
    assert ModelShape.from_config(dynamic).max_position_embeddings == UNBOUNDED
    assert ModelShape.from_config(longrope).max_position_embeddings == UNBOUNDED


def test_position_only_rope_types_keep_their_bound() -> None:
    for parameters in (
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ):
        config = LlamaConfig(**{**TINY_SHAPE, "max_position_embeddings": 48}, rope_parameters=parameters)
        assert ModelShape.from_config(config).max_position_embeddings == 48
