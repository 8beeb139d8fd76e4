"""The coverage matrix's media column (`python -m conformance.coverage --media`, coverage/media.py): a
class with an image encoder judged with small random images against `generate()`, exact or refused
with the reason; its cell, the table's column and its counts."""

from __future__ import annotations

import pytest

from conformance.coverage.catalog import all_entries
from conformance.coverage.media import NOT_JUDGED, media_outcome, run_media
from conformance.coverage.outcome import EXACT, REFUSED, Outcome, Row
from conformance.coverage.report import markdown

ENTRIES = {entry.name: entry for entry in all_entries()}


@pytest.mark.parametrize(
    ("name", "state"),
    [
        ("llava", EXACT),  # images
        ("llava_next", EXACT),  # tiles with image_sizes
        ("qwen2_vl", EXACT),  # patches with a grid: 3-D positions
        ("idefics3", EXACT),  # one prompt's images with their pixel mask
        ("gemma3", EXACT),  # each image's tokens attend both ways (token_type_ids)
        ("paligemma", REFUSED),  # the whole prompt prefix attends both ways
    ],
)
def test_media_cells(name, state) -> None:
    outcome = run_media(ENTRIES[name])
    assert outcome.state == state, outcome
    if state == REFUSED:
        assert "bidirectionally" in outcome.reason


def test_a_text_path_that_is_not_exact_is_not_judged_and_a_text_model_has_no_cell() -> None:
    from conformance.coverage.media import media_model

    llava = media_model(ENTRIES["llava"])
    assert media_outcome(ENTRIES["llava"], llava, Outcome(REFUSED, "x")) == Outcome(
        NOT_JUDGED, "its text path is refused"
    )
    from tests.support.models import build_tiny_model

    assert media_outcome(ENTRIES["llama"], build_tiny_model("llama", seed=0), Outcome(EXACT)) is None


def test_the_table_gains_a_media_column_and_its_counts() -> None:
    rows = [
        Row("llava", "llava", "image-text-to-text", ours=Outcome(EXACT), media=Outcome(EXACT)),
        Row("llama", "llama", "causal-lm", ours=Outcome(EXACT)),
    ]
    text = markdown(rows, "", "today", 1.0)
    assert "## With images" in text and "| exact | 1 |" in text
    assert "| llava |  |  | exact | 0.0 |  | - | exact |" in text
    assert "| llama |  |  | exact | 0.0 |  | - | - |" in text
