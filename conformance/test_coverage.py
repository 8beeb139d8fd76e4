"""The coverage matrix's fixed subset (`python -m conformance.coverage --subset`): every type ends exact or
refused, never crash or mismatch; the full matrix is its own CI step (.ci/run)."""

from __future__ import annotations

import json
import sys

import pytest

from conformance.coverage.catalog import SUBSET
from tests.support.paths import REPO_ROOT
from tests.support.processes import run_process

# Families the engine runs exactly (full, sliding + softcaps, sinks + MoE, MoE, per-layer head shapes, two vision-language models
# on their text path), and families the support check refuses up front, each by a different rule.
EXPECTED = {
    "llama": "exact",
    "qwen2": "exact",
    "gemma2": "exact",
    "gpt_oss": "exact",
    "mixtral": "exact",
    "llava": "exact",
    "qwen2_vl": "exact",
    "bloom": "exact",  # attention computed in its own module, adapted (attention/classic.py), with ALiBi
    "bert": "refused",  # bidirectional (encoder) attention
    "bart": "refused",  # its decoder numbers the packed row itself (position_ids ignored)
    "qwen3_next": "exact",  # linear-attention hybrid: per-request state slots beside the paged KV
    "mamba2": "exact",  # no attention layer at all: no KV group, state slots only
    "zamba2": "refused",  # one attention block shared by several layers
    "gemma4_text": "exact",  # per-layer head shapes: one KV group per (kind, window, KV heads, head dim)
}


@pytest.mark.slow
def test_subset_is_exact_or_refused(tmp_path) -> None:
    assert set(EXPECTED) == set(SUBSET)
    out = tmp_path / "coverage.json"
    done = run_process(
        [sys.executable, "-m", "conformance.coverage", "--subset", "--jobs", "1", "--json", str(out)],
        timeout=600,
        text=True,
        cwd=REPO_ROOT,
    )
    assert out.exists(), f"no JSON written:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    states = {name: row["ours"]["state"] for name, row in rows.items()}
    reasons = {name: row["ours"]["reason"] for name, row in rows.items() if row["ours"]["reason"]}
    assert states == EXPECTED, f"states {states}\nreasons {reasons}"
    for name in EXPECTED:
        if EXPECTED[name] == "refused":
            assert f"model_type='{rows[name]['model_type']}" in reasons[name] or name in reasons[name]
    assert done.returncode == 0, done.stderr[-3000:]
