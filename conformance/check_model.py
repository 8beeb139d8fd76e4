"""`python -m conformance.check_model --model PATH [--prompts N] [--max-new-tokens M] [--attn paged|sdpa]`

Point it at a local checkpoint to check that continuous batching reproduces plain `generate()` on that
model before trusting it. The command lives in the installed package as
`python -m transformers_cb.conformance_check` (same arguments); this module is its source-checkout alias.
See docs/conformance.md.
"""

from __future__ import annotations

import sys

from transformers_cb.tools.conformance_check import main

if __name__ == "__main__":
    sys.exit(main())
