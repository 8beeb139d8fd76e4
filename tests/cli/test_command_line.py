"""The ``transformers-cb generate`` command: arguments, input errors, outputs, the module entry point."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO_ROOT
from tests.support.processes import run_process
from transformers_cb.cli.main import main
from transformers_cb.jobs.inputs import DEMO_PROMPTS
from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

# The built-in tiny model, JSON lines on stdout, and a small cache so that CPU runs allocate little memory
# and stay fast (a later --model overrides the first).
CACHE_ARGS = [
    "--model",
    "tiny",
    "--jsonl",
    "--device",
    "cpu",
    "--page-size",
    "16",
    "--num-blocks",
    "64",
    "--no-progress",
]

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching",
    "A much longer prompt that spans more tokens than the others, to vary the lengths in the batch.",
]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _run_cli(args: list[str]) -> int:
    return main(["generate", *CACHE_ARGS, *args])


# ---------------------------------------------------------------------------
# Input errors through the command
# ---------------------------------------------------------------------------


def test_malformed_json_line_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    input_file = tmp_path / "in.jsonl"
    input_file.write_text('{"prompt": "fine"}\n\n{"prompt": "broken"\n', encoding="utf-8")
    output_file = tmp_path / "out.jsonl"
    code = _run_cli(["--input", str(input_file), "--output", str(output_file)])
    assert code == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "invalid JSON" in err
    assert not output_file.exists()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--max-new-tokens", "0"]) == 2
    assert "positive integer" in capsys.readouterr().err
    assert main(["generate", "--input", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read input file" in capsys.readouterr().err
    assert main(["--help"]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n", encoding="utf-8")
    assert main(["generate", "--page-size", "2", "--input", str(prompts)]) == 2
    assert "page_size" in capsys.readouterr().err


def test_request_rejected_at_submission_fails_alone(tmp_path: Path) -> None:
    input_file = tmp_path / "prompts.txt"
    input_file.write_text("short prompt\n" + "x" * 2100 + "\nanother short prompt\n", encoding="utf-8")
    output_file = tmp_path / "out.jsonl"

    code = _run_cli(["--input", str(input_file), "--output", str(output_file), "--max-new-tokens", "3"])

    assert code == 1  # output written, one request failed
    records = _read_jsonl(output_file)
    assert [r["status"] for r in records] == ["FINISHED", "FAILED", "FINISHED"]
    failed = records[1]
    assert "max_position_embeddings" in failed["error"]
    assert (failed["finish_reason"], failed["token_ids"], failed["prompt_tokens"]) == ("error", [], 2101)
    assert all(1 <= r["generated_tokens"] <= 3 for r in (records[0], records[2]))


# ---------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------


def test_generate_default_model_from_text_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    input_file = tmp_path / "prompts.txt"
    input_file.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    output_file = tmp_path / "out.jsonl"

    code = _run_cli(["--input", str(input_file), "--output", str(output_file), "--max-new-tokens", "6"])

    assert code == 0
    records = _read_jsonl(output_file)
    tokenizer = build_tiny_tokenizer()
    assert [r["id"] for r in records] == list(range(len(PROMPTS)))
    for prompt, record in zip(PROMPTS, records, strict=True):
        assert record["status"] == "FINISHED"
        assert record["error"] is None
        assert record["prompt_tokens"] == len(tokenizer.encode(prompt))
        assert 1 <= record["generated_tokens"] == len(record["token_ids"]) <= 6
        assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
        assert record["finish_reason"] in ("stop", "length")
        assert record["latency_s"] is None or record["latency_s"] >= 0
    out = capsys.readouterr().out  # summary goes to stdout when the JSONL goes to a file
    assert f"requests: {len(PROMPTS)}" in out and "failed: 0" in out


def test_generate_jsonl_ids_and_per_request_limits(tmp_path: Path) -> None:
    rows = [
        {"id": "short", "prompt": PROMPTS[0], "max_new_tokens": 2},
        {"id": 17, "prompt": PROMPTS[1]},
        {"id": "long", "prompt": PROMPTS[2], "max_new_tokens": 9},
        {"id": "short-again", "prompt": PROMPTS[3], "max_new_tokens": 2},
    ]
    input_file = tmp_path / "in.jsonl"
    input_file.write_text(
        "".join(json.dumps(row) + "\n" for row in rows) + "plain text line\n", encoding="utf-8"
    )
    output_file = tmp_path / "out.jsonl"

    code = _run_cli(["--input", str(input_file), "--output", str(output_file), "--max-new-tokens", "5"])

    assert code == 0
    records = _read_jsonl(output_file)
    assert [r["id"] for r in records] == ["short", 17, "long", "short-again", 4]
    limits = [2, 5, 9, 2, 5]
    for record, limit in zip(records, limits, strict=True):
        assert record["status"] == "FINISHED"
        assert 1 <= record["generated_tokens"] <= limit
        if record["finish_reason"] == "length":
            assert record["generated_tokens"] == limit


def test_generate_demo_prompts_when_stdin_is_a_tty(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", FakeTTY())
    assert _run_cli(["--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert len(records) == len(DEMO_PROMPTS) and all(r["status"] == "FINISHED" for r in records)
    assert "requests:" in captured.err  # summary on stderr when the JSONL is on stdout


def _first_divergence_note(model, prompt_ids: list[int], ours: list[int], ref: list[int]) -> str:
    """Describe where two greedy continuations diverge and how close the top-2 logits were."""
    common = next(
        (i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref))
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ref[:common]])).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    return f"diverge at step {common}: ours={ours} ref={ref}; top-2 logit gap there {float(top2[0] - top2[1]):.3e}"


def test_saved_model_matches_plain_generate(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(seed=1, attn_implementation="sdpa", tokenizer=tokenizer)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    input_file = tmp_path / "prompts.txt"
    input_file.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    output_file = tmp_path / "out.jsonl"
    max_new_tokens = 12
    code = _run_cli(
        [
            "--model",
            str(model_dir),
            "--input",
            str(input_file),
            "--output",
            str(output_file),
            "--max-new-tokens",
            str(max_new_tokens),
            "--max-batch-tokens",
            "64",
        ]
    )
    assert code == 0
    records = _read_jsonl(output_file)

    for prompt, record in zip(PROMPTS, records, strict=True):
        prompt_ids = tokenizer.encode(prompt)
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        ref = reference[0, len(prompt_ids) :].tolist()
        ours = record["token_ids"]
        assert ours == ref, _first_divergence_note(model, prompt_ids, ours, ref)
        assert record["finish_reason"] == ("stop" if ref[-1] == tokenizer.eos_token_id else "length")


@pytest.mark.slow  # the command in a fresh interpreter
def test_module_entry_point_reads_stdin() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    completed = run_process(
        [
            sys.executable,
            "-m",
            "transformers_cb.cli.main",
            "generate",
            "--input",
            "-",
            "--max-new-tokens",
            "3",
        ]
        + CACHE_ARGS,
        input='first prompt\n{"id": "x", "prompt": "second prompt"}\n',
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    records = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [r["id"] for r in records] == [0, "x"]
    assert all(1 <= r["generated_tokens"] <= 3 for r in records)
    assert "requests: 2" in completed.stderr


def _run_module(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "transformers_cb.cli.main", *args]
    return run_process(command, timeout=120, text=True, env=env, cwd=REPO_ROOT, **kwargs)


@pytest.mark.slow  # the command in a fresh interpreter
@pytest.mark.parametrize("stdin", ["dev-null", "empty-pipe", "blank-lines"])
def test_generate_without_a_terminal_and_without_input_runs_the_demo_prompts(stdin: str) -> None:
    """`make run < /dev/null`, from a script or CI: stdin is not a terminal but holds no prompt, so the
    main job shows its work on the demo prompts (it used to print `requests: 0`)."""
    feed = {
        "dev-null": {"stdin": subprocess.DEVNULL},
        "empty-pipe": {"input": ""},
        "blank-lines": {"input": "\n \n"},
    }
    completed = _run_module(["generate", "--max-new-tokens", "3", *CACHE_ARGS], **feed[stdin])
    assert completed.returncode == 0, completed.stderr
    records = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [r["id"] for r in records] == list(range(len(DEMO_PROMPTS)))
    assert all(r["status"] == "FINISHED" and r["generated_tokens"] >= 1 for r in records)
    assert f"requests: {len(DEMO_PROMPTS)}" in completed.stderr
    assert "stdin is empty; running the built-in demo prompts" in completed.stderr


@pytest.mark.slow  # the command in a fresh interpreter
def test_generate_input_dash_reads_stdin_even_when_empty() -> None:
    """`--input -` asks for stdin explicitly: an empty one is zero requests, not the demo."""
    completed = _run_module(["generate", "--input", "-", *CACHE_ARGS], stdin=subprocess.DEVNULL)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "" and "requests: 0" in completed.stderr


@pytest.mark.parametrize("speculation", [["--prompt-lookup-num-tokens", "3"], ["--assistant-model", "tiny"]])
def test_generate_with_speculation_writes_the_same_records(tmp_path: Path, speculation: list[str]) -> None:
    """Prompt lookup or a draft model (the built-in model as its own assistant) change the speed, never
    the greedy answers."""
    input_file = tmp_path / "in.txt"
    input_file.write_text("".join(p + " " + p + "\n" for p in PROMPTS), encoding="utf-8")
    plain, speculating = tmp_path / "plain.jsonl", tmp_path / "spec.jsonl"
    common = ["--input", str(input_file), "--max-new-tokens", "8", "--jsonl"]
    assert _run_cli([*common, "--output", str(plain)]) == 0
    assert _run_cli([*common, "--output", str(speculating), *speculation]) == 0
    keys = ("id", "token_ids", "text", "finish_reason")
    expected = [{k: r[k] for k in keys} for r in _read_jsonl(plain)]
    assert all(row["token_ids"] for row in expected)
    assert [{k: r[k] for k in keys} for r in _read_jsonl(speculating)] == expected


def test_generate_with_an_int8_kv_cache(tmp_path: Path) -> None:
    """`--kv-cache-dtype int8` reaches the engine (its pages are int8) and every prompt gets its record."""
    from unittest import mock

    from transformers_cb.engine.engine import Engine

    input_file = tmp_path / "in.txt"
    input_file.write_text("".join(p + "\n" for p in PROMPTS), encoding="utf-8")
    output = tmp_path / "out.jsonl"
    engines: list[Engine] = []
    original = Engine.step

    def step(self):
        engines.append(self)
        return original(self)

    with mock.patch.object(Engine, "step", step):
        code = _run_cli(["--input", str(input_file), "--output", str(output), "--kv-cache-dtype", "int8"])
    assert code == 0
    assert engines and engines[-1].cache.group_tensors[0].dtype == torch.int8
    records = _read_jsonl(output)
    assert len(records) == len(PROMPTS) and all(r["token_ids"] for r in records)


def test_serve_takes_the_kv_cache_dtype_and_refuses_another() -> None:
    from transformers_cb.cli.main import build_parser
    from transformers_cb.serve.server import _config_overrides

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert _config_overrides(args)["kv_cache_dtype"] == "int8"
    assert "kv_cache_dtype" not in _config_overrides(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
