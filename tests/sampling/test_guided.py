"""Guided decoding (structured outputs): every output matches its own constraint, in any batch, under forks,
prefix sharing, preemption (recompute and offload); refusals at submission; the grammar's end finishes a
request with "stop"; unconstrained rows are left alone. Greedy parity with generate() is in
conformance/test_guided.py. The model is the built-in byte-level tiny one, whose tokens spell any text."""

from __future__ import annotations

import json
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from tests.support.preemptions import count_preemptions
from tests.support.timeouts import hang_guard
from transformers_cb import ContinuousBatchingConfig, GuidedDecoding, RequestStatus
from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer
from transformers_cb.sampling.structured.grammars import EXTRA_HINT

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

GREEDY = GenerationConfig(do_sample=False, max_new_tokens=80)
SAMPLED = GenerationConfig(do_sample=True, temperature=0.8, max_new_tokens=80)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(seed=3, attn_implementation="paged|sdpa", tokenizer=tokenizer)


def _prompts(tokenizer, count: int, offset: int = 0) -> list[list[int]]:
    return [tokenizer.encode(f"record {offset + i}: ") for i in range(count)]


def _run(model, tokenizer, prompts, config=GREEDY, cb: dict | None = None, **kwargs):
    return model.generate_batch(
        prompts,
        config,
        ContinuousBatchingConfig(**(cb or {})),
        progress_bar=False,
        tokenizer=tokenizer,
        **kwargs,
    )


def _text(tokenizer, output) -> str:
    return tokenizer.decode(output.generated_tokens, skip_special_tokens=True)


def _schema_for(i: int) -> dict:
    """A different schema for each i: property names, enums, ranges and array sizes vary."""
    return {
        "type": "object",
        "properties": {
            f"id_{i}": {"type": "integer", "minimum": i, "maximum": i + 9},
            "label": {"enum": [f"a{i}", f"b{i % 7}", "c"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": i % 3},
            "ok": {"type": "boolean"},
        },
        "required": [f"id_{i}", "label", "tags", "ok"],
        "additionalProperties": False,
    }


def _check_all_valid(tokenizer, outputs, schemas) -> None:
    for (request_id, output), schema in zip(outputs.items(), schemas, strict=True):
        assert output.status == RequestStatus.FINISHED and output.finish_reason == "stop", (
            request_id,
            output,
        )
        jsonschema.validate(json.loads(_text(tokenizer, output)), schema)


def test_256_requests_each_with_its_own_schema_all_validate(model, tokenizer) -> None:
    schemas = [_schema_for(i) for i in range(256)]
    outputs = _run(model, tokenizer, _prompts(tokenizer, 256), guided=[{"json": s} for s in schemas])
    _check_all_valid(tokenizer, outputs, schemas)


def test_every_kind_of_constraint(model, tokenizer) -> None:
    guided = [
        GuidedDecoding(json=SCHEMA),
        GuidedDecoding(regex=r"[a-c]{2}-\d{3}"),
        GuidedDecoding(choice=("yes", "no", "maybe")),
        GuidedDecoding(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'),
        GuidedDecoding(json_object=True),
        {"json": json.dumps(SCHEMA)},
        None,  # unconstrained, in the same steps
    ]
    outputs = list(_run(model, tokenizer, _prompts(tokenizer, len(guided)), SAMPLED, guided=guided).values())
    texts = [_text(tokenizer, o) for o in outputs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"[a-c]{2}-\d{3}", texts[1]), texts[1]
    assert texts[2] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\(\d+(\+\d+)?\)", texts[3]), texts[3]
    # Any object: a random model's keys are long strings, so it may run out of tokens inside one.
    assert texts[4].startswith("{") and (
        outputs[4].finish_reason == "length" or isinstance(json.loads(texts[4]), dict)
    )
    jsonschema.validate(json.loads(texts[5]), SCHEMA)
    assert [o.finish_reason for i, o in enumerate(outputs[:6]) if i != 4] == ["stop"] * 5
    assert outputs[6].finish_reason == "length"


def test_grammar_end_finishes_with_stop_without_an_eos(model, tokenizer) -> None:
    """The request ends on the token that completes the grammar; no eos is generated after it."""
    outputs = _run(model, tokenizer, _prompts(tokenizer, 3), guided={"choice": ["alpha", "beta"]})
    for output in outputs.values():
        assert output.finish_reason == "stop"
        assert tokenizer.eos_token_id not in output.generated_tokens
        assert _text(tokenizer, output) in ("alpha", "beta")


def test_unconstrained_rows_are_untouched(model, tokenizer) -> None:
    prompts = _prompts(tokenizer, 6)
    alone = _run(model, tokenizer, prompts[::2], GenerationConfig(do_sample=False, max_new_tokens=20))
    mixed = _run(
        model,
        tokenizer,
        prompts,
        GenerationConfig(do_sample=False, max_new_tokens=20),
        guided=[None, {"json": SCHEMA}] * 3,
    )
    plain = [o.generated_tokens for o in alone.values()]
    assert [o.generated_tokens for o in list(mixed.values())[::2]] == plain


def test_compiled_grammars_are_cached_by_constraint(model, tokenizer, monkeypatch) -> None:
    prompts = _prompts(tokenizer, 4)
    builder_holder = {}
    from transformers_cb.engine.intake.submission import RequestBuilder

    original = RequestBuilder.__call__

    def spy(self, *args, **kwargs):
        builder_holder["builder"] = self  # the engine's request builder: its sampling setup is the engine's
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RequestBuilder, "__call__", spy)
    same = {"json": dict(reversed(list(SCHEMA.items())))}  # the same schema, keys in another order
    _run(model, tokenizer, prompts, guided=[{"json": SCHEMA}, same, {"json": SCHEMA}, {"regex": "a+"}])
    assert builder_holder["builder"].sampling.grammars.compiled == 2


@pytest.mark.parametrize(
    ("guided", "message"),
    [
        ({"regex": "a(b"}, "unclosed group"),
        ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "nope"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"schema": {}}, "unknown key"),
        (42, "guided must be"),
    ],
)
def test_bad_constraint_is_refused_at_submission(model, tokenizer, guided, message) -> None:
    with pytest.raises(ValueError, match=message) as error:
        _run(model, tokenizer, _prompts(tokenizer, 2), guided=[None, guided])
    assert "inputs[1]" in str(error.value)


def test_bad_constraint_never_reaches_the_manager_thread(model, tokenizer) -> None:
    manager = model.init_continuous_batching(
        generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(), tokenizer=tokenizer
    )
    manager.start()
    try:
        with pytest.raises(ValueError, match="unclosed group"):
            manager.add_request(_prompts(tokenizer, 1)[0], request_id="bad", guided={"regex": "a(b"})
        with pytest.raises(ValueError, match="inputs\\[1\\]"):
            manager.add_requests(_prompts(tokenizer, 2), guided=[{"regex": "x"}, {"regex": "("}])
        ids = manager.add_requests(_prompts(tokenizer, 2), guided=[{"choice": ["on", "off"]}, None])
        manager.add_request(_prompts(tokenizer, 1)[0], request_id="one", guided={"regex": "[xyz]{4}"})
        results = {r.request_id: r for r in (manager.get_result(timeout=hang_guard(60)) for _ in range(3))}
    finally:
        manager.stop(block=True)
    assert _text(tokenizer, results[ids[0]]) in ("on", "off")
    assert results[ids[1]].finish_reason == "length"
    assert re.fullmatch("[xyz]{4}", _text(tokenizer, results["one"]))
    assert manager.is_running() is False


def test_needs_a_tokenizer(model, tokenizer) -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        model.generate_batch(_prompts(tokenizer, 1), GREEDY, progress_bar=False, guided={"regex": "a"})


def test_without_the_extra_the_error_names_it(model, tokenizer, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match="structured") as error:
        _run(model, tokenizer, _prompts(tokenizer, 1), guided={"regex": "a"})
    assert EXTRA_HINT in str(error.value)


def test_forks_each_follow_the_constraint(model, tokenizer) -> None:
    """num_return_sequences with prefix sharing: siblings are forked from the parent's pages, and each
    has its own matcher following its own tokens."""
    outputs = _run(
        model,
        tokenizer,
        _prompts(tokenizer, 3),
        SAMPLED,
        cb={"allow_block_sharing": True, "seed": 4},
        guided={"json": SCHEMA},
        num_return_sequences=3,
    )
    assert len(outputs) == 9
    _check_all_valid(tokenizer, outputs, [SCHEMA] * 9)
    assert len({_text(tokenizer, o) for o in outputs.values()}) > 1  # the siblings sampled their own


@pytest.mark.parametrize(
    "cb",
    [
        {"page_size": 4, "num_blocks": 40, "max_batch_tokens": 32},
        {"page_size": 4, "num_blocks": 40, "max_batch_tokens": 32, "cpu_offload_space": 1.0},
        {"page_size": 4, "allow_block_sharing": True},
    ],
    ids=["recompute", "offload", "prefix-sharing"],
)
def test_preemption_and_sharing_keep_the_constraint_state(model, tokenizer, cb) -> None:
    shared = tokenizer.encode("shared prefix: ")
    prompts = [shared + p[1:] for p in _prompts(tokenizer, 8)]
    schemas = [_schema_for(i) for i in range(8)]
    guided = [{"json": s} for s in schemas]
    roomy = _run(model, tokenizer, prompts, guided=guided)
    with count_preemptions() as preempted:
        tight = _run(model, tokenizer, prompts, cb=cb, guided=guided)
    if "num_blocks" in cb:
        assert preempted, "the small cache was meant to preempt"
    _check_all_valid(tokenizer, tight, schemas)
    assert [o.generated_tokens for o in tight.values()] == [o.generated_tokens for o in roomy.values()]


# -- property: schemas from a small grammar of types ------------------------------------------------
_leaves = st.one_of(
    st.builds(
        lambda low, width: {"type": "integer", "minimum": low, "maximum": low + width},
        st.integers(-50, 50),
        st.integers(0, 99),
    ),
    st.builds(lambda low: {"type": "number", "minimum": low, "maximum": low + 10}, st.integers(-20, 20)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.lists(
        st.sampled_from(["x", "yy", "z z", 1, 2.5, True, None]), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
    st.just({"type": "boolean"}),
)
SCHEMAS = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)
        ),
        st.dictionaries(st.text("abcdef_", min_size=1, max_size=4), children, min_size=1, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        ),
    ),
    max_leaves=6,
)


@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schemas=st.lists(SCHEMAS, min_size=4, max_size=4))
def test_sampled_outputs_validate_against_generated_schemas(model, tokenizer, schemas) -> None:
    outputs = _run(
        model,
        tokenizer,
        _prompts(tokenizer, len(schemas)),
        GenerationConfig(do_sample=True, max_new_tokens=200),
        cb={"seed": 0},
        guided=[{"json": schema} for schema in schemas],
    )
    _check_all_valid(tokenizer, outputs, schemas)


def test_speculation_under_a_grammar_equals_plain_and_validates(model, tokenizer) -> None:
    """Prompt lookup drafts the keys the prompt shows; the grammar masks each verified row (a draft token
    it forbids ends the draft), so greedy output equals the plain run's and sampled output validates."""
    example = '{"name": "tom", "age": 7, "kind": "cat"}'
    prompts = [tokenizer.encode(f"record {i}: {example} record {i + 1}: ") for i in range(4)]
    guided = {"json": SCHEMA}
    plain = _run(model, tokenizer, prompts, guided=guided)
    spec = _run(model, tokenizer, prompts, guided=guided, prompt_lookup_num_tokens=6)
    for request_id, output in spec.items():
        assert output.generated_tokens == plain[request_id].generated_tokens, request_id
        jsonschema.validate(json.loads(_text(tokenizer, output)), SCHEMA)
    assert sum(o.accepted_draft_tokens for o in spec.values()) > 0
    sampled = _run(model, tokenizer, prompts, SAMPLED, guided=guided, prompt_lookup_num_tokens=6)
    for output in sampled.values():
        jsonschema.validate(json.loads(_text(tokenizer, output)), SCHEMA)
    assert sum(o.draft_tokens for o in sampled.values()) > 0
