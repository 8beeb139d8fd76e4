"""`python -m transformers_cb.conformance_check --model PATH`: the conformance check on your own model.

The command and its public names (`from transformers_cb.conformance_check import run_check`); the check
lives in `parity/check.py`, the token comparison in `parity/compare.py`, and a model given by name
(`--model smollm2`) is fetched through `models/fetch.py`. See docs/conformance.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .models.fetch import FetchError, resolve_model
from .parity import check
from .parity.check import (
    SettingResult,
    default_settings,
    format_table,
    parse_args,
    random_prompts,
    run_check,
)
from .parity.compare import (
    Mismatch,
    compare_tokens,
    first_difference,
    greedy_config,
    near_tie_tolerance,
    next_token_logits,
    plain_generation_config,
    reference_greedy,
)

__all__ = [
    "Mismatch",
    "SettingResult",
    "compare_tokens",
    "conformance_main",
    "default_settings",
    "first_difference",
    "format_table",
    "greedy_config",
    "near_tie_tolerance",
    "next_token_logits",
    "parse_args",
    "plain_generation_config",
    "random_prompts",
    "reference_greedy",
    "run_check",
]


def model_folder(model: str) -> str:
    """`--model` as a folder: a registry name (`smollm2`) fetched and converted once, else the folder given."""
    return resolve_model(model) or model


def conformance_main(argv: Sequence[str] | None = None) -> int:
    """`python -m transformers_cb.conformance_check`: the check (`parity/check.py`) with `--model` also
    taking a model's name; a failed fetch is one line on stderr and exit code 2."""
    try:
        return check.check_command(argv, model_folder=model_folder)
    except FetchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(conformance_main())
