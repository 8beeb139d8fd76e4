"""`transformers-cb generate`'s answers as text (its default on stdout): each prompt, then its answer.

The JSON lines (jobs/records.py's schema) are written instead with `--jsonl` or `--output FILE`.
"""

from __future__ import annotations

from .inputs import CliRequest

PROMPT_WIDTH = 100


def format_answer(request: CliRequest, record: dict) -> str:
    """`[id] prompt` (its first line, shortened), the answer below it, then a blank line."""
    first_line = request.prompt.strip().splitlines()[0] if request.prompt.strip() else ""
    if len(first_line) > PROMPT_WIDTH:
        first_line = first_line[: PROMPT_WIDTH - 3] + "..."
    if record["status"] != "FINISHED":
        answer = f"({record['status']}: {record['error']})"
    else:
        answer = record["text"].strip()
    return f"[{record['id']}] {first_line}\n{answer}\n\n"


def writes_jsonl(jsonl_flag: bool, output: str) -> bool:
    """JSON lines when asked for, or when the output is a file (files are for programs); else text."""
    return jsonl_flag or output != "-"
