"""Loading a vision-language checkpoint folder (models/loading.py): its whole model class and its
processor, read offline; text-only folders, names and the built-in model have no processor."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformers_cb.models.loading import auto_model_class, load_model_and_tokenizer, load_processor

pytest.importorskip("PIL", reason="the image processor needs Pillow (the test extra)")


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.vision_models import save_tiny_llava_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llava")
    save_tiny_llava_checkpoint(folder)
    return folder


def test_a_vision_language_folder_loads_its_model_class_and_processor(vlm_folder: Path) -> None:
    from transformers import AutoModelForImageTextToText, LlavaForConditionalGeneration, LlavaProcessor

    assert auto_model_class(str(vlm_folder)) is AutoModelForImageTextToText
    model, tokenizer = load_model_and_tokenizer(str(vlm_folder), attn_implementation="paged|sdpa")
    assert isinstance(model, LlavaForConditionalGeneration)
    processor = load_processor(str(vlm_folder))
    assert isinstance(processor, LlavaProcessor)
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index
    assert len(tokenizer) == len(processor.tokenizer)


def test_text_only_folders_names_and_the_tiny_model_have_no_processor(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer=tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert auto_model_class(str(tmp_path)) is AutoModelForCausalLM
    assert load_processor(str(tmp_path)) is None
    assert load_processor(None) is None and load_processor("tiny") is None


def test_a_processor_that_cannot_load_is_left_out_with_a_warning(tmp_path: Path, caplog) -> None:
    (tmp_path / "processor_config.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        assert load_processor(str(tmp_path)) is None
    assert "the processor could not be loaded" in caplog.text
