"""The direct decoder-layer step (runner/layer_ops/direct_layer.py): taken on the layers it recognises, the same
logits bit for bit as the modules' own forwards at every step (float32 and bfloat16, products packed or
plain, decodes and chunked prefills, sharp attention so that a wrong position or rotary changes tokens),
greedy float32 tokens equal to `generate()`, and left for the modules' forwards where a hook, another
attention form or the switch says so. A GGUF model kept quantized takes it too (its `QuantizedLinear`s' native
product on decode rows), with the same bits."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from transformers import GenerationConfig

from tests.support.models import sharpen_attention, tiny_llama, tiny_qwen2
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.step_logits import assert_same_logits, assert_same_runs
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.runner import model_runner
from transformers_cb.runner.layer_ops import direct_layer, layer_plan, native_layers
from transformers_cb.runner.layer_ops.direct_model import DirectModel
from transformers_cb.runner.products.packed_linear import RULE_ENV

pytestmark = pytest.mark.skipif(
    ensure_native_module() is None, reason="the native library cannot be built here"
)

PROMPTS = prompts_of_lengths([5, 40, 23, 9], seed=11)
MAX_NEW = 10


def run(
    model,
    monkeypatch,
    direct: bool,
    config: ContinuousBatchingConfig | None = None,
    prompts: list[list[int]] = PROMPTS,
) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """(tokens, every step's logits, how many layer calls took the direct step) of one greedy run, each step
    through the model's forward (the direct model step, runner/layer_ops/direct_model.py, off:
    tests/runner/test_direct_model.py compares it with this)."""
    logits: list[torch.Tensor] = []
    taken = [0]
    real_call, real_direct, real_model_step = (
        model_runner.call_model,
        native_layers.direct_step,
        DirectModel.logits,
    )
    monkeypatch.setattr(DirectModel, "logits", lambda self, *args: None)

    def recording_call(*args, **kwargs) -> torch.Tensor:
        out = real_call(*args, **kwargs)
        logits.append(out.clone())
        return out

    def counting_direct(*args):
        if not direct:
            return None
        out = real_direct(*args)
        taken[0] += out is not None
        return out

    monkeypatch.setattr(model_runner, "call_model", recording_call)
    monkeypatch.setattr(native_layers, "direct_step", counting_direct)
    try:
        outputs = model.generate_batch(
            prompts,
            max_new_tokens=MAX_NEW,
            continuous_batching_config=config or ContinuousBatchingConfig(page_size=16, max_batch_tokens=32),
            progress_bar=False,
        )
    finally:
        monkeypatch.setattr(model_runner, "call_model", real_call)
        monkeypatch.setattr(native_layers, "direct_step", real_direct)
        monkeypatch.setattr(DirectModel, "logits", real_model_step)
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))], logits, taken[0]


def assert_same_steps(model, monkeypatch, **kwargs) -> int:
    return assert_same_runs(run(model, monkeypatch, True, **kwargs), run(model, monkeypatch, False, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", ["all", "off"])
def test_direct_steps_give_the_modules_logits_bit_for_bit(
    monkeypatch, dtype: torch.dtype, packed: str
) -> None:
    monkeypatch.setenv(RULE_ENV, "all" if packed == "all" else "0")
    model = sharpen_attention(tiny_llama(seed=3)).to(dtype)
    taken = assert_same_steps(model, monkeypatch)
    assert taken > 0, "no layer took the direct step"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_quantized_layers_take_the_direct_step_bit_for_bit(
    monkeypatch, tmp_path, dtype: torch.dtype, qtype: str
) -> None:
    gguf = pytest.importorskip("gguf", reason="the gguf package writes the test's GGUF file")
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_gguf import write_tiny_gguf
    from transformers_cb.models.gguf_weights import keep_gguf_quantized
    from transformers_cb.runner.products.quantized_linear import QuantizedLinear

    quant = int(getattr(gguf.GGMLQuantizationType, qtype))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=3, quant=quant, qk_scale=6.0)
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=dtype, attn_implementation="paged|sdpa"
    ).eval()
    keep_gguf_quantized(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    vocab = model.config.vocab_size
    prompts = [[token % vocab for token in prompt] for prompt in PROMPTS]
    taken = assert_same_steps(model, monkeypatch, prompts=prompts)
    assert taken > 0, "no quantized layer took the direct step"


def test_torchao_int4_layers_take_the_direct_step_bit_for_bit(monkeypatch) -> None:
    """A bfloat16 model quantized with torchao's `IntxWeightOnlyConfig` (int4): its Linears' GGUF blocks
    (runner/products/torchao_linear.py) are read by the native layer as by the run's forwards."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model = sharpen_attention(tiny_llama(seed=3)).to(torch.bfloat16)
    config = quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=quantization.PerGroup(32))
    quantization.quantize_(
        model, config, filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "layers" in name
    )
    taken = assert_same_steps(model, monkeypatch)
    assert taken > 0, "no int4 layer took the direct step"


def test_float32_direct_run_equals_generate(monkeypatch) -> None:
    model = sharpen_attention(tiny_llama(seed=5))
    tokens, _, taken = run(model, monkeypatch, True)
    assert taken > 0
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        assert got == greedy_reference(model, prompt, MAX_NEW)


def test_hooks_and_other_forms_keep_the_modules_forwards(monkeypatch) -> None:
    model = tiny_llama(seed=1)
    seen: list[int] = []
    handle = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *_: seen.append(1))
    _, _, taken = run(model, monkeypatch, True)
    handle.remove()
    assert seen, "the hook did not run"
    assert taken > 0  # layer 0 has no hook: still direct; layer 1 ran its modules (the hook fired)
    # Qwen2's attention passes its sliding window: not Llama's forward, never direct.
    _, _, taken = run(tiny_qwen2(seed=1), monkeypatch, True)
    assert taken == 0


def test_switch_off(monkeypatch) -> None:
    model = tiny_llama(seed=2)
    monkeypatch.setenv(native_layers.DIRECT_SWITCH, "0")
    parts: list[Callable] = []
    real = native_layers.layer_parts
    monkeypatch.setattr(native_layers, "layer_parts", lambda *a: parts.append(real) or real(*a))
    _, _, taken = run(model, monkeypatch, True)
    assert taken == 0 and not parts


def test_a_failing_native_call_falls_back_once(monkeypatch, caplog) -> None:
    model = tiny_llama(seed=4)
    want, _, taken = run(model, monkeypatch, True)
    assert taken > 0
    ops = ensure_native_module()
    calls = []

    def failing(*args):
        calls.append(1)
        raise RuntimeError("a oneDNN op of another signature")

    monkeypatch.setattr(direct_layer, "_failed", [])
    monkeypatch.setattr(ops, "decoder_layer", failing)
    with caplog.at_level(logging.WARNING, logger=direct_layer.__name__):
        got, _, taken = run(model, monkeypatch, True)
    assert got == want and taken == 0
    assert len(calls) == 1  # tried once, then the modules' forwards for the rest of the process
    assert sum("decoder-layer step failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("packed", ["all", "off"])
def test_a_layer_plan_is_made_again_when_what_it_read_changes(monkeypatch, packed: str) -> None:
    """`LayerPlan`: a layer's products decided once per row count and dtype, reused while nothing it read
    changed: a weight written in place or replaced, a pack released, a hook on a projection (no plan: the
    modules' forwards), a norm's weight replaced."""
    from transformers_cb.engine.build import build_engine
    from transformers_cb.runner.products.packed_model import release_packs

    monkeypatch.setenv(RULE_ENV, packed)
    model = sharpen_attention(tiny_llama(seed=3)).to(torch.bfloat16)
    engine = build_engine(model, GenerationConfig(max_new_tokens=4, do_sample=False), None)
    layer = model.model.layers[0]
    with engine.session():
        parts = layer_plan.layer_parts(layer, native_layers.KIND)
        assert parts is not None
        dtype = torch.bfloat16
        first = layer_plan.plan_for(parts, dtype, 1)
        assert first is not None
        plan = first[0]
        assert layer_plan.plan_for(parts, dtype, 1)[0] is plan  # reused
        assert layer_plan.plan_for(parts, dtype, 3)[0] is not plan  # another row count: its own
        q_proj = layer.self_attn.q_proj
        with torch.no_grad():
            q_proj.weight.mul_(1.5)  # in place: a new version
        again = layer_plan.plan_for(parts, dtype, 1)[0]
        assert again is not plan
        assert layer_plan.plan_for(parts, dtype, 1)[0] is again
        q_proj.weight = torch.nn.Parameter(q_proj.weight.detach().clone(), requires_grad=False)
        replaced = layer_plan.plan_for(parts, dtype, 1)[0]
        assert replaced is not again and any(held is q_proj.weight for _, _, held in replaced.slots)
        release_packs(model)  # packs dropped (a weight written through `.data`): the plan reads them again
        released = layer_plan.plan_for(parts, dtype, 1)[0]
        assert (released is not replaced) == (packed == "all")
        layer.post_attention_layernorm.weight = torch.nn.Parameter(
            layer.post_attention_layernorm.weight.detach().clone(), requires_grad=False
        )
        renormed = layer_plan.plan_for(parts, dtype, 1)[0]
        assert renormed is not released and renormed.post_weight is layer.post_attention_layernorm.weight
        handle = layer.mlp.down_proj.register_forward_hook(lambda module, args, output: output)
        assert layer_plan.plan_for(parts, dtype, 1) is None  # the modules' forwards run the hook
        handle.remove()
        assert layer_plan.plan_for(parts, dtype, 1) is not None
        for module in (layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            handle = module.register_forward_pre_hook(lambda module, args: None)
            assert layer_plan.plan_for(parts, dtype, 1) is None, type(module).__name__
            handle.remove()
            assert layer_plan.plan_for(parts, dtype, 1) is not None
        layer.mlp.up_proj._hf_hook = object()  # accelerate's, an attribute
        assert layer_plan.plan_for(parts, dtype, 1) is None
        del layer.mlp.up_proj._hf_hook
        assert layer_plan.plan_for(parts, dtype, 1) is not None


def test_a_layer_plan_keeps_no_released_pack_alive(monkeypatch) -> None:
    """A plan reads its products' packs at each call: it holds none (a released pack's memory is freed)."""
    import gc
    import weakref

    from transformers_cb.engine.build import build_engine
    from transformers_cb.runner.products.packed_model import release_packs

    monkeypatch.setenv(RULE_ENV, "all")
    model = sharpen_attention(tiny_llama(seed=3)).to(torch.bfloat16)
    engine = build_engine(model, GenerationConfig(max_new_tokens=4, do_sample=False), None)
    with engine.session():
        parts = layer_plan.layer_parts(model.model.layers[0], native_layers.KIND)
        planned = layer_plan.plan_for(parts, torch.bfloat16, 1)
        assert planned is not None and any(source is not None for source in planned[0].packs)
        packed = [
            weakref.ref(t)
            for t, kind in zip(planned[1], planned[0].specs.kinds, strict=True)
            if kind in (1, 2)
        ]
        assert packed
        del planned
        release_packs(model)
        gc.collect()
        assert all(reference() is None for reference in packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_tiles_give_the_untiled_logits_bit_for_bit(monkeypatch, dtype: torch.dtype) -> None:
    """A step of many tokens runs the native layer in row tiles (layer_plan.ROW_TILE_BYTES; here a few
    rows' worth, so that a 160-token step takes 4 tiles): each tile attends to the keys the ones before it
    wrote, and every row gets the untiled call's bits."""
    monkeypatch.setenv(RULE_ENV, "all")  # every product oneDNN's: the layers that are tiled
    model = sharpen_attention(tiny_llama(seed=3)).to(dtype)
    prompts = prompts_of_lengths([70, 50, 40], seed=12)
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=256)
    tiles: list[tuple[int, int]] = []  # (rows, rows a tile) of each plan made
    real_make = layer_plan.make_plan

    def recording_make(parts, dtype, tokens):
        plan = real_make(parts, dtype, tokens)
        if plan is not None:
            tiles.append((tokens, plan.tile_rows))
        return plan

    monkeypatch.setattr(layer_plan, "make_plan", recording_make)
    width = 2 * model.config.intermediate_size * dtype.itemsize
    monkeypatch.setattr(layer_plan, "ROW_TILE_BYTES", 40 * width)
    tokens, logits, taken = run(model, monkeypatch, True, config=config, prompts=prompts)
    assert taken > 0 and (160, 40) in tiles, f"no step was tiled: {tiles}"
    monkeypatch.setattr(layer_plan, "ROW_TILE_BYTES", 1 << 40)
    tiles.clear()
    tokens_whole, logits_whole, _ = run(model, monkeypatch, True, config=config, prompts=prompts)
    assert all(tile == rows for rows, tile in tiles)
    assert tokens == tokens_whole
    assert_same_logits(logits, logits_whole)


def test_row_tiles_split_evenly() -> None:
    width, size = 3072, 4
    rows = layer_plan.ROW_TILE_BYTES // (width * size)  # the most rows a tile holds
    assert layer_plan.row_tile(rows, width, size) == rows
    assert layer_plan.row_tile(rows + 1, width, size) == -(-(rows + 1) // 2)
    assert layer_plan.row_tile(8192, width, size) == 2048
    assert layer_plan.row_tile(8192, width, 2) == 4096
