"""The user-facing checker with images (`python -m transformers_cb.conformance_check --inputs FILE` /
`--image FILE`, parity/media_check.py) on a tiny Llava saved to disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.vision_models import build_tiny_llava, llava_image, with_images
from transformers_cb import conformance_check
from transformers_cb.runner.media.media_runner import MediaRunner


@pytest.fixture(scope="module")
def checkpoint_and_inputs(tmp_path_factory) -> tuple[Path, Path]:
    path = tmp_path_factory.mktemp("tiny-llava")
    build_tiny_llava(seed=0).save_pretrained(path)
    inputs = [
        {
            "input_ids": torch.tensor([with_images([[1, 5, 6], 0, [7, 8], 1, [9]])]),
            "pixel_values": llava_image(1, 2),
        },
        {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])},
        {"input_ids": torch.tensor([with_images([[3], 0, [11, 12]])]), "pixel_values": llava_image(2)},
    ]
    torch.save(inputs, path / "inputs.pt")
    return path, path / "inputs.pt"


def test_the_check_passes_with_processor_outputs(checkpoint_and_inputs, capsys) -> None:
    folder, inputs = checkpoint_and_inputs
    code = conformance_check.conformance_main(
        ["--model", str(folder), "--inputs", str(inputs), "--max-new-tokens", "6"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 prompts with their media" in out and "PASS: generate_batch matches generate()" in out


def test_the_check_fails_when_the_images_are_dropped(checkpoint_and_inputs, monkeypatch, capsys) -> None:
    """A broken engine (every image's rows zeroed) fails the check with exit 1 and both token lists."""
    folder, inputs = checkpoint_and_inputs
    original = MediaRunner.encode

    def zeroed(self, requests):
        failures = original(self, requests)
        for request in requests:
            encoded = self.store.get(request.request_id)
            if encoded is not None:
                encoded.rows = {modality: torch.zeros_like(rows) for modality, rows in encoded.rows.items()}
        return failures

    monkeypatch.setattr(MediaRunner, "encode", zeroed)
    code = conformance_check.conformance_main(
        ["--model", str(folder), "--inputs", str(inputs), "--max-new-tokens", "6"]
    )
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "vs generate()'s" in out


def test_images_need_pillow_or_inputs(tmp_path) -> None:
    from transformers_cb.parity.media_check import processor_inputs

    try:
        import PIL  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="needs Pillow"):
            processor_inputs(object(), [str(tmp_path / "x.png")], 2, 0)
    else:
        with pytest.raises(FileNotFoundError):  # Pillow reads the file (none here)
            processor_inputs(object(), [str(tmp_path / "x.png")], 2, 0)


def test_the_check_reads_real_image_files_through_the_folders_processor(tmp_path, capsys) -> None:
    """`--image a.png --image b.jpg`: Pillow reads the files, the folder's `LlavaProcessor` renders them."""
    pytest.importorskip("PIL", reason="--image reads files with Pillow (the test extra)")
    import numpy as np
    from PIL import Image

    from tests.support.vision_models import save_tiny_llava_checkpoint

    save_tiny_llava_checkpoint(tmp_path)
    rng = np.random.default_rng(0)
    files = []
    for name in ("a.png", "b.jpg"):
        Image.fromarray((rng.random((30, 44, 3)) * 255).astype(np.uint8)).save(tmp_path / name)
        files += ["--image", str(tmp_path / name)]
    code = conformance_check.conformance_main(
        ["--model", str(tmp_path), *files, "--prompts", "4", "--max-new-tokens", "5"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 prompts with their media" in out and "PASS: generate_batch matches generate()" in out
