"""The coverage matrix's fixed subset (`python -m conformance.coverage --subset`): every type ends exact or
refused, never crash or mismatch, plain and sharp; the full matrix is its own CI step (.ci/run). The sharp
column (coverage/sharp.py) on a few types at both factors the issue named (x5, x20)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conformance.coverage.catalog import SUBSET, all_entries, select
from conformance.coverage.outcome import EXACT, MISMATCH, REFUSED, Outcome, Row, failing
from conformance.coverage.report import markdown
from conformance.coverage.sharp import sharp_outcome
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
    "bloom": "exact",  # attention computed in its own module, adapted (attention/families/classic.py), with ALiBi
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
    sharp = {name: row["sharp"]["state"] for name, row in rows.items()}
    assert sharp == EXPECTED, f"sharp states {sharp}\n{ {n: r['sharp'] for n, r in rows.items()} }"
    for name in EXPECTED:
        if EXPECTED[name] == "refused":
            assert f"model_type='{rows[name]['model_type']}" in reasons[name] or name in reasons[name]
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("factor", [5.0, 20.0])
@pytest.mark.parametrize("name", ["longcat_flash", "deepseek_v3", "deepseek_v32", "llama", "gpt2", "phi3"])
def test_the_sharp_column_is_exact(name: str, factor: float) -> None:
    """Ours on the entry's model with its query / key projections scaled by `factor` (the sharp column):
    multi-latent attention with LongCat's own latent scales and DeepSeek V3's (V3.2: its indexer too), separate and fused
    projections (GPT-2's `c_attn`, Phi-3's `qkv_proj`) all equal generate() with sharp attention."""
    entry = select(all_entries(), [name])[0]
    plain = Outcome(EXACT)
    outcome = sharp_outcome(entry, plain, factor)
    assert outcome.state == EXACT, outcome
    assert f"x{factor:g}" in outcome.notes, outcome.notes  # the projections were found and scaled


def test_the_sharp_column_keeps_a_refusal_and_counts_in_the_report() -> None:
    entry = select(all_entries(), ["bert"])[0]
    refused = Outcome(REFUSED, "continuous batching cannot run model_type='bert': bidirectional")
    assert sharp_outcome(entry, refused).state == REFUSED
    rows = [
        Row("llama", "llama", "causal-lm", ours=Outcome(EXACT), sharp=Outcome(EXACT)),
        Row("bert", "bert", "causal-lm", ours=refused, sharp=Outcome(MISMATCH, "x")),
    ]
    assert failing(rows[1]) == [("sharp", rows[1].sharp)]
    text = markdown(rows, "", "today", 1.0)
    assert "| state | ours | ours sharp | built-in |" in text
    assert "| mismatch | 0 | 1 | - |" in text
    assert Row.from_dict(rows[1].as_dict()) == rows[1]


def test_models_json_is_in_step_with_models_md() -> None:
    """docs/models.json holds what docs/models.md shows: each column's counts, and every row's states."""
    docs = REPO_ROOT / "docs"
    data = json.loads((docs / "models.json").read_text())
    text = (docs / "models.md").read_text()
    counts = text.split("## Counts", 1)[1].split("##", 1)[0]
    shown: dict[str, dict[str, int]] = {"ours": {}, "sharp": {}, "builtin": {}}
    for line in counts.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[1].isdigit() and cells[0] != "**total**":
            for column, cell in zip(("ours", "sharp", "builtin"), cells[1:], strict=True):
                if cell.isdigit() and int(cell):
                    shown[column][cells[0]] = int(cell)
    assert shown["sharp"], "docs/models.md has no sharp column"
    for column, states in shown.items():
        assert data["counts"][column] == states, (column, data["counts"][column], states)
    rows = {row["name"]: row for row in data["rows"]}
    table = [line for line in text.split("## Per type", 1)[1].splitlines() if line.startswith("|")][2:]
    assert len(table) == len(rows), (len(table), len(rows))
    for line in table:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) > 6:
            name, state, sharp = cells[0], cells[3], cells[6].split(":")[0]
            assert rows[name]["ours"]["state"] == state and rows[name]["sharp"]["state"] == sharp, name
    media = dict(data["counts"]["media"])
    if media:
        table = text.split("## With images", 1)[1].split("##", 1)[0]
        for state, n in media.items():
            assert f"| {state} | {n} |" in table, (state, n)
