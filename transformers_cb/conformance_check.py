"""`python -m transformers_cb.conformance_check --model PATH`: the public path of the conformance check.

The check itself lives in `tools/conformance_check.py`; this entry point keeps the documented command and
imports (`from transformers_cb.conformance_check import run_check`) working.
"""

from __future__ import annotations

import sys

from .tools.conformance_check import (
    Mismatch,
    SettingResult,
    compare_tokens,
    count_preemptions,
    default_settings,
    first_difference,
    format_table,
    greedy_config,
    main,
    near_tie_tolerance,
    next_token_logits,
    parse_args,
    plain_generation_config,
    random_prompts,
    reference_greedy,
    run_check,
)

__all__ = [
    "Mismatch",
    "SettingResult",
    "compare_tokens",
    "count_preemptions",
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
