"""Unit tests of the server's text handling: incremental detokenization, stop strings, request bodies,
the Prometheus rendering. No HTTP here (see test_http.py and test_command.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.serve import MISSING, requires_serve
from transformers_cb.manager.stats import ManagerStats
from transformers_cb.models.tiny import build_tiny_tokenizer
from transformers_cb.serve.events.text import REPLACEMENT_CHAR, IncrementalDetokenizer, StopScanner
from transformers_cb.serve.metrics import Histogram, ServerMetrics

if MISSING:  # without the extra there is no pydantic for the request bodies
    ApiError = ChatCompletionRequest = CompletionRequest = parse_body = None
else:
    from transformers_cb.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body

TOKENIZER = build_tiny_tokenizer()


def _pieces(token_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.push(t) for t in token_ids]
    return [*pieces, detokenizer.flush()]


@pytest.mark.parametrize(
    "text", ["plain ascii", "héllo wörld", "日本語テキスト", "emoji 🙂🎉 mixed ß", "a</s>b"]
)
def test_detokenizer_never_splits_a_character(text: str) -> None:
    # The byte-level tokenizer gives one token per UTF-8 byte: every multi-byte character spans
    # several tokens, the hardest case for streaming.
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    pieces = _pieces(ids)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 1  # it really streamed, not one piece at the end


def test_detokenizer_skips_special_tokens_like_decode() -> None:
    ids = [*TOKENIZER.encode("ok é", add_special_tokens=False), TOKENIZER.eos_token_id]
    assert "".join(_pieces(ids)) == "ok é"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TOKENIZER) - 1), max_size=40))
def test_detokenizer_pieces_concatenate_to_decode(ids: list[int]) -> None:
    # Arbitrary ids, including invalid UTF-8 byte sequences and special tokens; the bytes of a character
    # the last tokens leave incomplete are dropped.
    expected = TOKENIZER.decode(ids, skip_special_tokens=True).rstrip(REPLACEMENT_CHAR)
    assert "".join(_pieces(ids)) == expected


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_cut_inside_a_character_drops_its_bytes(cut: int) -> None:
    # max_tokens ending inside an emoji (4 bytes, one token each): no stray U+FFFD at the end.
    ids = TOKENIZER.encode("ok 🙂", add_special_tokens=False)
    pieces = _pieces(ids[: len(ids) - 4 + cut])
    assert "".join(pieces) == "ok "


def _scan(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    scanner = StopScanner(stops)
    out = ""
    for chunk in chunks:
        out += scanner.push(chunk)
        if scanner.stopped:
            return out, True
    return out + scanner.flush(), False


def test_stop_string_split_across_chunks() -> None:
    assert _scan(["STOP"], ["abc S", "T", "O", "P tail"]) == ("abc ", True)
    assert _scan(["STOP"], ["abc ST", "x"]) == ("abc STx", False)
    assert _scan(["\n\n", "END"], ["one\n", "two E", "N", "D"]) == ("one\ntwo ", True)


def test_stop_scanner_holds_back_only_possible_prefixes() -> None:
    scanner = StopScanner(["abc"])
    assert scanner.push("xxab") == "xx"
    assert scanner.push("x") == "abx"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=30), st.text(alphabet="abc", min_size=1, max_size=3), st.data())
def test_stop_scanner_matches_str_find(text: str, stop: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    position = text.find(stop)
    expected = (text, False) if position < 0 else (text[:position], True)
    assert _scan([stop], chunks) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "prompt": "x", "max_tokens": -3}', "max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"model": "m", "prompt": "x", "n": 0}', "n"),
        # Unknown fields and the once-refused frequency_penalty / echo are accepted now (below).
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', "stream"),
        (b'{"model": "m", "prompt": "x", "frequency_penalty": 2.5}', "frequency_penalty"),
        (b'{"model": "m", "prompt": "x", "logit_bias": {"a": 1}}', "logit_bias"),
        (b'{"model": "m", "prompt": "x", "suffix": "y"}', "suffix"),
        (b'{"model": "m", "prompt": "x", "logprobs": 21}', "logprobs"),
        (b'{"model": "m", "prompt": "x", "stream_options": {"continuous_usage_stats": 1}}', "stream_options"),
        (b'{"model": "m", "prompt": "x", "stop": [""]}', None),
        (b'{"model": "m"}', "prompt"),
        (b'{"model": "m", "prompt": []}', "prompt"),
    ],
)
@requires_serve
def test_completion_body_errors_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        request = parse_body(body, CompletionRequest)
        request.stop_strings()
        request.prompts()
    assert info.value.status == 400
    if param is not None:
        assert info.value.param is not None and info.value.param.startswith(param)
        assert param in info.value.message


@pytest.mark.parametrize(
    "body", [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"model": "m", "messages": []}', b'{"model": "m"}']
)
@requires_serve
def test_chat_body_errors(body: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(body, ChatCompletionRequest)
    assert info.value.status == 400
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@requires_serve
def test_stream_options_need_stream() -> None:
    request = parse_body(
        b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}', CompletionRequest
    )
    with pytest.raises(ApiError, match="stream_options"):
        request.stream_usage()


@requires_serve
def test_unknown_fields_are_ignored_with_a_warning(caplog: Any) -> None:
    body = b'{"model": "m", "prompt": "x", "bogus": 1, "echo": true, "frequency_penalty": 0.5, "top_k": -1}'
    with caplog.at_level("WARNING", logger="transformers_cb.serve.protocol"):
        request = parse_body(body, CompletionRequest)
    assert "bogus" in caplog.text and "echo" not in caplog.text
    # Only known, non-neutral fields reach the engine (top_k=-1 is vLLM's "off").
    assert request.engine_kwargs() == {"frequency_penalty": 0.5}
    assert request.echo is True


SAMPLE_LINE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? ([-+0-9.eE]+|NaN|\+Inf)$'
)


def test_metrics_render_is_prometheus_text() -> None:
    metrics = ServerMetrics()
    for value in (0.0005, 0.02, 0.02, 7.0, 100.0):
        metrics.ttft.observe(value)
    metrics.count_response("/v1/completions", 200)
    stats = dataclasses.replace(
        ManagerStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0.0, 12.5), weight_version=3, aborted=2
    )
    text = metrics.render(stats)
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            families[name] = kind
        elif not line.startswith("#"):
            assert SAMPLE_LINE.match(line), line
            name = line.split("{")[0].split()[0]
            assert any(name == f or name.startswith(f + "_") for f in families), f"{name} has no TYPE"
    assert families["transformers_cb_queue_depth"] == "gauge"
    assert families["transformers_cb_time_to_first_token_seconds"] == "histogram"
    assert "transformers_cb_queue_depth 1\n" in text
    assert "transformers_cb_kv_pages_in_use 7\n" in text
    assert (
        "transformers_cb_weight_version 3\n" in text and families["transformers_cb_weight_version"] == "gauge"
    )
    assert "transformers_cb_requests_aborted_total 2\n" in text
    assert 'transformers_cb_time_to_first_token_seconds_bucket{le="0.001"} 1\n' in text
    assert 'transformers_cb_time_to_first_token_seconds_bucket{le="0.025"} 3\n' in text
    assert 'transformers_cb_time_to_first_token_seconds_bucket{le="+Inf"} 5\n' in text
    assert "transformers_cb_time_to_first_token_seconds_count 5\n" in text
    assert 'transformers_cb_http_responses_total{endpoint="/v1/completions",status="200"} 1\n' in text


def test_histogram_bucket_bounds_are_inclusive() -> None:
    histogram = Histogram("h", "help", buckets=(1.0, 2.0))
    histogram.observe(1.0)
    histogram.observe(2.5)
    lines = histogram.render()
    assert 'h_bucket{le="1.0"} 1' in lines
    assert 'h_bucket{le="2.0"} 1' in lines
    assert 'h_bucket{le="+Inf"} 2' in lines


@requires_serve
def test_choice_events_read_each_outputs_new_tokens_only() -> None:
    """The server's side of a stream: every output is read through its delta (`new_tokens`, ...), so a
    stream of N tokens costs O(N); the text and logprobs are the whole output's."""
    import asyncio

    from tests.support.counting import CountingList, count_request_reads
    from transformers_cb.requests import Request, RequestStatus
    from transformers_cb.serve.events.choices import ChoiceOptions, ManagerChoices, Submitted

    steps = 600
    request = Request("r", [1], max_new_tokens=steps, streaming=True)
    request.set_status(RequestStatus.DECODING)
    count_request_reads(request)
    ids = [TOKENIZER.encode(f"w{k % 7} ", add_special_tokens=False)[k % 2] for k in range(steps)]

    async def outputs() -> Any:
        for k, token in enumerate(ids):
            request.append_token(token, -0.5 - k, {token: -0.5 - k})
            if k == steps - 1:
                request.finish_reason = "length"
                request.set_status(RequestStatus.FINISHED)
            yield request.to_output()

    class Manager:
        def cancel_request(self, request_id: str) -> None:
            raise AssertionError("a finished choice is not cancelled")

    async def events() -> list[Any]:
        options = ChoiceOptions(sampling={}, max_tokens=steps, want_logprobs=True, top_logprobs=1)
        choice = Submitted("r", 0, outputs(), 0.0)
        choices = ManagerChoices(Manager())
        return [e async for e in choices.events(choice, TOKENIZER, options, ServerMetrics())]

    got = asyncio.run(events())
    assert "".join(e.text for e in got) == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert [t for e in got for t in e.token_ids] == ids
    assert [lp for e in got for lp in e.logprobs] == [-0.5 - k for k in range(steps)]
    assert got[-1].finish_reason == "length"
    assert CountingList.read <= 3 * steps, f"{CountingList.read} items read for {steps} tokens"


@requires_serve
def test_speculation_fields_and_vllm_speculative_config() -> None:
    request = parse_body(b'{"model": "m", "prompt": "x", "prompt_lookup_num_tokens": 4}', CompletionRequest)
    assert request.engine_kwargs() == {"prompt_lookup_num_tokens": 4}
    body = b'{"model": "m", "prompt": "x", "speculative_config": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}}'
    request = parse_body(body, CompletionRequest)
    assert request.engine_kwargs() == {"prompt_lookup_num_tokens": 5, "max_matching_ngram_size": 3}
    body = b'{"model": "m", "prompt": "x", "speculative_config": {"method": "draft_model", "num_speculative_tokens": 5}}'
    assert parse_body(body, CompletionRequest).engine_kwargs() == {"num_assistant_tokens": 5}
    body = b'{"model": "m", "prompt": "x", "num_assistant_tokens": 3, "num_assistant_tokens_schedule": "heuristic"}'
    assert parse_body(body, CompletionRequest).engine_kwargs() == {
        "num_assistant_tokens": 3,
        "num_assistant_tokens_schedule": "heuristic",
    }
    body = b'{"model": "m", "prompt": "x", "speculative_config": {"method": "eagle", "num_speculative_tokens": 5}}'
    with pytest.raises(ApiError, match="speculative_config"):
        parse_body(body, CompletionRequest).engine_kwargs()


@requires_serve
@given(
    st.text(
        alphabet=st.sampled_from(["a", "é", "\u0085", "\u2028", "\u2029", "\n", "\r", "\x0b"]), max_size=30
    )
)
@settings(max_examples=60, deadline=None)
def test_an_event_is_one_line_for_a_universal_newline_reader_and_decodes_to_the_same_text(text: str) -> None:
    """JSON leaves U+0085, U+2028 and U+2029 raw in a string; `str.splitlines` (httpx's `aiter_lines`) splits
    at them, so `sse` escapes them: the event stays one line however the client splits it."""
    import json

    from transformers_cb.serve.events.completion_bodies import sse

    event = sse({"text": text}).decode()
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: ") : -2]) == {"text": text}
    assert sse("[DONE]") == b"data: [DONE]\n\n"
