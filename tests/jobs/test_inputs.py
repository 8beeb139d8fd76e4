"""Reading a batch job's prompts (jobs/inputs.py): text and JSON lines, errors naming the line, the demo prompts."""

from __future__ import annotations

import io

import pytest

from transformers_cb.jobs.inputs import DEMO_PROMPTS, InputError, parse_requests, read_requests


def test_parse_requests_mixed_formats() -> None:
    lines = [
        "plain prompt\n",
        "\n",
        '{"prompt": "json prompt", "id": "a", "max_new_tokens": 3}\n',
        '{"prompt": "no id", "extra": 1}\n',
        "   \n",
        "last plain prompt\n",
    ]
    requests = parse_requests(lines)
    assert [(r.id, r.prompt, r.max_new_tokens, r.line_no) for r in requests] == [
        (0, "plain prompt", None, 1),
        ("a", "json prompt", 3, 3),
        (2, "no id", None, 4),
        (3, "last plain prompt", None, 6),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x",}', "line 2: invalid JSON"),
        ('{"id": 1}', "line 2: missing required key 'prompt'"),
        ('{"prompt": 5}', "line 2: 'prompt' must be a string"),
        ('{"prompt": "x", "max_new_tokens": 0}', "line 2: 'max_new_tokens' must be a positive integer"),
        ('{"prompt": "x", "max_new_tokens": "4"}', "line 2: 'max_new_tokens' must be a positive integer"),
        ('{"prompt": "x", "id": [1]}', "line 2: 'id' must be a string or an integer"),
        ('{"prompt": "x", "id": "first"}', "line 2: duplicate id 'first' (first used on line 1)"),
    ],
)
def test_parse_requests_errors_name_the_line(line: str, message: str) -> None:
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_requests(['{"prompt": "ok", "id": "first"}', line])


def test_read_requests_demo_only_without_input() -> None:
    assert [r.prompt for r in read_requests(None, io.StringIO(""))] == list(DEMO_PROMPTS)
    assert [r.prompt for r in read_requests(None, io.StringIO("hi\n"))] == ["hi"]
    assert read_requests("-", io.StringIO("")) == []
