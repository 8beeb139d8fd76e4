"""Paged attention backends, keyed by the `attn_implementation` names they register."""

from __future__ import annotations

from .eager import eager_paged_attention_forward
from .sdpa import sdpa_paged_attention_forward

PAGED_BACKENDS = {
    "paged|sdpa": sdpa_paged_attention_forward,
    "paged|eager": eager_paged_attention_forward,
}

# The plain implementation each paged backend stands in for (and the mask builder it reuses).
PLAIN_COUNTERPART = {"paged|sdpa": "sdpa", "paged|eager": "eager"}

__all__ = ["PAGED_BACKENDS", "PLAIN_COUNTERPART"]
