"""The paged flash backends, through the CPU test double of flash-attn (tests/support/flash_double.py).

The double computes with the reference kernel and checks what the real kernels check, so these tests
prove the glue: names and errors, the arguments of each call (cu_seqlens, block tables, seqused_k,
windows, softcap), the decode fast path switch and the auto-switch order; outputs equal `generate()`.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from transformers import GenerationConfig

from tests.support import flash_double
from tests.support.models import build_tiny_model, tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.backends.fast_path import prepare_flash_step, resolve_max_blocks_per_request
from transformers_cb.attention.backends.flash import flash_paged_attention
from transformers_cb.attention.backends.flash_kernels import (
    FA2,
    FA3,
    FlashKernel,
    FlashKernelUnavailable,
    load_flash_kernel,
)
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.sampling.sampled_token import SampledToken

GREEDY = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


def _config(**changes) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(**{"page_size": 256, "num_blocks": 8, "max_batch_tokens": 64, **changes})


def _parity(model, prompts, outputs, max_new_tokens: int = 12) -> None:
    for i, prompt in enumerate(prompts):
        out = outputs[f"req_{i}"]
        assert out.error is None, out.error
        assert out.generated_tokens == greedy_reference(model, prompt, max_new_tokens), i


def _names(calls) -> list[str]:
    return [name for name, _ in calls]


# -- names and errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        (FA2, "transformers-cb[flash]"),
        (FA3, "hopper"),
        ("paged|kernels-community/flash-attn2", "transformers-cb[kernels]"),
        ("paged|kernels-community/flash-attn-custom", "transformers-cb[kernels]"),
    ],
)
def test_flash_name_without_its_package_names_what_to_install(name: str, extra: str) -> None:
    model = tiny_llama()
    with (
        flash_double.injected(fa2=False, fa3=False),
        pytest.raises(FlashKernelUnavailable, match=re.escape(extra)),
    ):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == "sdpa"  # never a silent fallback, nothing changed


def test_flash_names_select_the_backend_through_transformers(tmp_path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    with flash_double.injected(fa2=True, fa3=True):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=FA2)
        assert model.config._attn_implementation == FA2
        model.set_attn_implementation(FA3)
        assert model.config._attn_implementation == FA3
        engine = build_engine(model, GREEDY, _config())
        assert engine.settings.step_options.attn_implementation == FA3


def test_flash_backend_refuses_a_page_size_flash_attn_2_cannot_read() -> None:
    model = tiny_llama()
    with flash_double.injected(fa2=True):
        model.set_attn_implementation(FA2)
        with pytest.raises(ValueError, match="multiple of 256"):
            build_engine(model, GREEDY, _config(page_size=64))


def test_flash_backend_off_a_flash_device_is_refused() -> None:
    model = tiny_llama()
    with flash_double.injected(fa2=True, cpu=False):
        model.set_attn_implementation(FA2)
        with pytest.raises(ValueError, match="need a CUDA device"):
            build_engine(model, GREEDY, _config())


# -- parity through the double --------------------------------------------------------------------


@pytest.mark.parametrize("fast_path", [None, 0])
def test_flash_attention_2_matches_generate(fast_path) -> None:
    model = tiny_llama()
    prompts = prompts_of_lengths([5, 40, 17, 3], seed=1)
    with flash_double.injected(fa2=True) as calls:
        model.set_attn_implementation(FA2)
        outputs = model.generate_batch(
            prompts,
            GREEDY,
            _config(max_blocks_per_request=fast_path, max_batch_tokens=32),
            progress_bar=False,
        )
        model.set_attn_implementation("sdpa")
    _parity(model, prompts, outputs)
    names = _names(calls)
    assert "flash_attn.flash_attn_varlen_func" in names  # prefill chunks (and mixed steps)
    fused = [args for name, args in calls if name == "flash_attn.flash_attn_with_kvcache"]
    if fast_path == 0:
        assert not fused  # 0 disables the decode fast path: every step is varlen
    else:
        assert fused and all(args["fused"] for args in fused)  # new K/V written by the kernel


def test_flash_attention_3_reads_pages_through_kvcache_with_packed_queries() -> None:
    """flash-attn 3's varlen function takes no page table: mixed steps go through flash_attn_with_kvcache
    with cu_seqlens_q / cache_seqlens / page_table; small pages give multi-page block tables."""
    model = tiny_llama()
    prompts = prompts_of_lengths([30, 70, 9], seed=2)
    with flash_double.injected(fa2=False, fa3=True) as calls:
        model.set_attn_implementation(FA3)
        outputs = model.generate_batch(
            prompts, GREEDY, _config(page_size=16, num_blocks=32, max_batch_tokens=48), progress_bar=False
        )
        model.set_attn_implementation("sdpa")
    _parity(model, prompts, outputs)
    kinds = {(name, args["fused"]) for name, args in calls}
    assert kinds == {
        ("flash_attn_interface.flash_attn_with_kvcache", False),  # packed varlen
        ("flash_attn_interface.flash_attn_with_kvcache", True),  # decode fast path
    }


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_models_pass_their_window_and_never_take_the_fast_path(family: str, caplog) -> None:
    model = build_tiny_model(family)
    window = model.config.sliding_window
    prompts = prompts_of_lengths([3, 25, 12], seed=3, low=3)
    prompts = [[t % 300 + 3 for t in p] for p in prompts]
    with flash_double.injected(fa2=True) as calls:
        model.set_attn_implementation(FA2)
        with caplog.at_level(logging.WARNING, logger="transformers_cb"):
            outputs = model.generate_batch(prompts, GREEDY, _config(max_batch_tokens=16), progress_bar=False)
        assert "decode fast path" not in caplog.text  # not requested: no warning
        model.set_attn_implementation("sdpa")
    _parity(model, prompts, outputs)
    windows = {args["window"] for _, args in calls}
    assert window in windows
    assert all(name == "flash_attn.flash_attn_varlen_func" for name in _names(calls))


def test_softcap_reaches_the_kernel() -> None:
    model = build_tiny_model("gemma2")
    prompts = [[5, 9, 44, 12], [7] * 20]
    with flash_double.injected(fa2=True) as calls:
        model.set_attn_implementation(FA2)
        outputs = model.generate_batch(prompts, GREEDY, _config(), progress_bar=False)
        model.set_attn_implementation("eager")
    _parity(model, prompts, outputs)
    assert {args["softcap"] for _, args in calls} == {model.config.attn_logit_softcapping}


# -- the arguments of one call --------------------------------------------------------------------


def _vllm_style_varlen(
    q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None, softmax_scale=None,
    causal=False, window_size=None, softcap=0.0, block_table=None, s_aux=None,
):  # fmt: skip
    _vllm_style_varlen.seen = dict(locals())
    return torch.zeros_like(q)


def test_varlen_call_arguments_follow_the_kernels_signature() -> None:
    """A kernel that takes `seqused_k` and `s_aux` (vLLM's API) gets them instead of cu_seqlens_k."""
    model = tiny_llama()
    engine = build_engine(model, GREEDY, _config())
    request = engine.build_request(Submission([5, 6, 7, 8, 9], "r", max_new_tokens=2))
    engine.add(request)
    step = engine.packer.pack(engine.scheduler.schedule())
    prepare_flash_step(step.metadata, 0)
    kernel = FlashKernel(
        "paged|kernels-community/vllm-flash-attn3", _vllm_style_varlen, None, frozenset(_vllm_style_varlen.__code__.co_varnames[:14]), frozenset()
    )  # fmt: skip
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    sinks = torch.zeros(4)
    flash_paged_attention(q, k, k.clone(), 0, step.metadata, 0.25, kernel, softcap=30.0, sinks=sinks)
    seen = _vllm_style_varlen.seen
    assert seen["seqused_k"] is step.metadata.seq_lens_k and seen["cu_seqlens_k"] is None
    assert seen["block_table"] is step.metadata.groups[0].block_table
    assert seen["cu_seqlens_q"].tolist() == [0, 5] and seen["max_seqlen_q"] == 5 and seen["max_seqlen_k"] == 5
    assert seen["causal"] is True and seen["window_size"] == (-1, -1) and seen["softcap"] == 30.0
    assert seen["softmax_scale"] == 0.25 and seen["s_aux"] is sinks


def test_sinks_on_a_kernel_without_them_are_refused() -> None:
    with flash_double.injected(fa2=True):
        kernel = load_flash_kernel(FA2)
        model = tiny_llama()
        engine = build_engine(model, GREEDY, _config())
        engine.add(engine.build_request(Submission([5, 6, 7], "r", max_new_tokens=2)))
        step = engine.packer.pack(engine.scheduler.schedule())
        prepare_flash_step(step.metadata, 0)
        q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
        with pytest.raises(NotImplementedError, match="s_aux"):
            flash_paged_attention(q, k, k, 0, step.metadata, 0.25, kernel, sinks=torch.zeros(4))


# -- the decode fast path switch ------------------------------------------------------------------


def test_fast_path_width_resolution(caplog) -> None:
    with flash_double.injected(fa2=True):
        kernel = load_flash_kernel(FA2)
    with caplog.at_level(logging.WARNING, logger="transformers_cb"):
        assert resolve_max_blocks_per_request(0, False, kernel, True, 256, [4000]) == 0
        assert resolve_max_blocks_per_request(None, False, kernel, True, 256, [1000, 4000]) == 16
        assert resolve_max_blocks_per_request(None, False, kernel, True, 256, None) == 32
        assert resolve_max_blocks_per_request(7, False, kernel, True, 256, [4000]) == 7
        assert resolve_max_blocks_per_request(None, True, kernel, True, 256, None) == 0
        assert resolve_max_blocks_per_request(None, False, None, True, 256, None) == 0
        assert resolve_max_blocks_per_request(None, False, kernel, False, 256, None) == 0
    assert not caplog.records  # nothing was set explicitly: no warning
    for args, why in [
        ((64, True, kernel, True), "sliding-window"),
        ((64, False, None, True), "not a paged flash backend"),
        ((64, False, kernel, False), "CUDA"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="transformers_cb"):
            assert resolve_max_blocks_per_request(*args, 256, None) == 0
        assert why in caplog.text and "max_blocks_per_request" in caplog.text


def test_fast_path_only_for_decode_steps_that_fit_the_table() -> None:
    model = tiny_llama()
    engine = build_engine(model, GREEDY, _config(page_size=16, num_blocks=64))
    for i, n in enumerate([20, 5]):
        engine.add(engine.build_request(Submission(list(range(3, 3 + n)), f"r{i}", max_new_tokens=30)))
    batch = engine.scheduler.schedule()
    mixed = engine.packer.pack(batch)
    prepare_flash_step(mixed.metadata, 4)
    assert mixed.metadata.decode_fast_path is None
    assert mixed.metadata.cu_seqlens_k.tolist() == [0, 20, 25]
    engine.scheduler.update(batch, [[SampledToken(7)]] * 2)
    decode = engine.packer.pack(engine.scheduler.schedule())
    prepare_flash_step(decode.metadata, 4)
    fast = decode.metadata.decode_fast_path
    assert fast is not None and fast.block_table.shape == (2, 4) and fast.block_table.dtype == torch.int32
    assert fast.cache_seqlens.tolist() == [20, 5]  # KV before this step's token
    assert fast.block_table[:, :2].tolist() == decode.metadata.groups[0].block_table.tolist()
    prepare_flash_step(decode.metadata, 1)  # a request spans 2 pages: the table is too narrow
    assert decode.metadata.decode_fast_path is None


# -- auto switch ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loaded", "fa2", "fa3", "auto", "expected"),
    [
        ("sdpa", True, True, True, FA3),  # flash-attn 3 first
        ("sdpa", True, False, True, FA2),  # then flash-attn 2 (with a warning)
        ("eager", True, False, True, FA2),
        ("sdpa", False, False, True, "paged|sdpa"),  # neither imports: unchanged
        ("eager", False, False, True, "paged|eager"),
        ("sdpa", True, True, False, "paged|sdpa"),  # auto_switch_to_flash=False keeps it
        ("eager", True, True, False, "paged|eager"),
        ("paged|sdpa", True, True, True, "paged|sdpa"),  # an explicit paged backend is kept
    ],
)
def test_auto_switch_order(loaded, fa2, fa3, auto, expected, caplog) -> None:
    model = tiny_llama(loaded if loaded != "paged|sdpa" else "sdpa")
    if loaded == "paged|sdpa":
        model.set_attn_implementation("paged|sdpa")
    with flash_double.injected(fa2=fa2, fa3=fa3), caplog.at_level(logging.INFO, logger="transformers_cb"):
        engine = build_engine(model, GREEDY, _config(auto_switch_to_flash=auto))
    assert engine.settings.step_options.attn_implementation == expected
    if expected == FA2:
        assert "flash-attn 3 is not installed" in caplog.text
        assert any(
            r.levelno == logging.WARNING and "auto_switch_to_flash=False" in r.message for r in caplog.records
        )


def test_auto_switch_needs_a_flash_device_and_a_flash_model() -> None:
    with flash_double.injected(fa2=True, fa3=True, cpu=False):
        assert (
            build_engine(tiny_llama(), GREEDY, _config()).settings.step_options.attn_implementation
            == "paged|sdpa"
        )
    model = tiny_llama()
    with flash_double.injected(fa2=True, fa3=True):
        model._supports_flash_attn = False
        assert (
            build_engine(model, GREEDY, _config()).settings.step_options.attn_implementation == "paged|sdpa"
        )


def test_auto_switch_runs_flash_for_the_run_only() -> None:
    model = tiny_llama()
    prompts = prompts_of_lengths([9, 33], seed=4)
    with flash_double.injected(fa2=True, fa3=True) as calls:
        outputs = model.generate_batch(prompts, GREEDY, _config(), progress_bar=False)
    assert model.config._attn_implementation == "sdpa"  # restored after the run
    _parity(model, prompts, outputs)
    assert calls and all(name.startswith("flash_attn_interface.") for name in _names(calls))


def test_capturable_dense_form_of_the_double_matches_the_reference() -> None:
    """The double's no-host-sync form (used inside CUDA graph capture) equals its reference form,
    padded tokens included (zeros), with a window and softcap."""
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 16
    k_pages, v_pages = torch.randn(10, page, kv_heads, dim), torch.randn(10, page, kv_heads, dim)
    cu_seqlens_q = torch.tensor([0, 1, 6, 6, 6], dtype=torch.int32)  # 2 rows of padding, 2 padded tokens
    seqlens_k = torch.tensor([9, 7, 0, 0], dtype=torch.int32)
    table = torch.tensor([[3, 1, 7, 0], [2, 5, 0, 0], [9, 9, 9, 9], [9, 9, 9, 9]], dtype=torch.int32)
    q = torch.randn(8, heads, dim)
    args = (q, k_pages.reshape(40, kv_heads, dim), v_pages.reshape(40, kv_heads, dim))
    dense = flash_double._dense_paged_attention(*args, cu_seqlens_q, seqlens_k, table, page, 0.3, 5, 2.0)
    reference = flash_double._paged_attention(
        q, k_pages, v_pages, cu_seqlens_q, seqlens_k, table, 0.3, 5, 2.0, None
    )
    torch.testing.assert_close(dense[:6], reference[:6])
    assert dense[6:].abs().max() == 0


def test_a_model_with_sinks_is_refused_at_start_by_a_kernel_without_them() -> None:
    model = build_tiny_model("gpt_oss")
    with flash_double.injected(fa2=True):
        model.set_attn_implementation(FA2)
        with pytest.raises(ValueError, match="attention sinks"):
            build_engine(model, GREEDY, _config())
