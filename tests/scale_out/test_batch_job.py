"""The Ray job's driver side without a cluster: prompt files through pyarrow filesystems, and the
predictor's row as the local CLI's JSON line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from transformers_cb.jobs.inputs import CliRequest, InputError
from transformers_cb.scale_out.batch_job import open_output_anywhere, read_requests_anywhere, record_from_row


def test_prompt_files_by_uri_read_and_write(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    uri = (tmp_path / "prompts.jsonl").as_uri()
    with open_output_anywhere(uri) as handle:
        handle.write('{"id": "a", "prompt": "first", "max_new_tokens": 3}\n')
        handle.write("second\n")
    requests = read_requests_anywhere(uri)
    assert [(r.id, r.prompt, r.max_new_tokens) for r in requests] == [("a", "first", 3), (1, "second", None)]
    with pytest.raises(InputError, match="cannot read input file"):
        read_requests_anywhere((tmp_path / "missing.jsonl").as_uri())
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(InputError, match="line 1: 'prompt' must be a string"):
        read_requests_anywhere((tmp_path / "bad.jsonl").as_uri())


def test_a_failed_row_becomes_the_local_line() -> None:
    row = {
        "generated_text": "",
        "generated_token_ids": [],
        "finish_reason": "error",
        "status": "FAILED",
        "error": "prompt too long",
        "num_prompt_tokens": 9,
        "ttft_s": None,
        "latency_s": math.nan,  # Arrow gives NaN for a missing float
    }
    record = record_from_row(CliRequest(id="x", prompt="p"), row)
    assert record == {
        "id": "x",
        "text": "",
        "token_ids": [],
        "finish_reason": "error",
        "status": "FAILED",
        "error": "prompt too long",
        "prompt_tokens": 9,
        "generated_tokens": 0,
        "ttft_s": None,
        "latency_s": None,
    }
