"""Structured outputs on the server: OpenAI's `response_format` and vLLM's `guided_*` fields as one `GuidedDecoding`.

`response_format` (both endpoints): `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}}}`; `{"type": "text"}` is no constraint. vLLM's extensions: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one of them per request (a 400 naming them
otherwise); a constraint that does not compile is a 400 with the grammar library's message, at submission
(docs/structured_outputs.md, docs/serve.md).
"""

from __future__ import annotations

from typing import Any

from ..sampling.structured.guided import GuidedDecoding
from .protocol import ApiError

VLLM_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def guided_of(body: Any) -> tuple[GuidedDecoding | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained)."""
    given: list[tuple[str, GuidedDecoding]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given.append(("response_format", GuidedDecoding(json_object=True)))
        else:
            if response_format.json_schema is None:
                raise ApiError(
                    400,
                    "response_format: type json_schema needs json_schema: {name, schema}",
                    param="response_format",
                )
            given.append(("response_format", GuidedDecoding(json=response_format.json_schema.schema_)))
    for name, kind in VLLM_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            # The body's field, as validated by its pydantic model: a schema, a regex, a list of choices, a grammar.
            field: dict[str, Any] = {kind: tuple(value) if kind == "choice" else value}
            given.append((name, GuidedDecoding(**field)))
    if len(given) > 1:
        names = [name for name, _ in given]
        raise ApiError(
            400, f"{', '.join(names)}: give one output constraint, not {len(names)}", param=names[1]
        )
    if not given:
        return None, None
    name, guided = given[0]
    return guided, name
