"""`python -m transformers_cb.conformance_check --model PATH`: the conformance check on your own model.

The command and its public names (`from transformers_cb.conformance_check import run_check`); the check
lives in `parity/check.py`, the token comparison in `parity/compare.py`. See docs/conformance.md.
"""

from __future__ import annotations

import sys

from .parity.check import (
    SettingResult,
    default_settings,
    format_table,
    main,
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
    "default_settings",
    "first_difference",
    "format_table",
    "greedy_config",
    "main",
    "near_tie_tolerance",
    "next_token_logits",
    "parse_args",
    "plain_generation_config",
    "random_prompts",
    "reference_greedy",
    "run_check",
]

if __name__ == "__main__":
    sys.exit(main())
