"""What the probe saw each layer attend with overrides the config (`ObservedLayers`): K/V head shapes size the
cache and the KV groups (V's own head size, K/V a layer tiles over its query heads before the call: cached
once); a window applied through the mask alone is the config's; a layer that applies none, V with other
heads than K's, or a bias the layer builds into its mask are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from transformers_cb.engine.settings import resolve_settings
from transformers_cb.kv.layer_groups import ObservedLayers, kv_groups_from_config
from transformers_cb.memory.sizing import ModelShape
from transformers_cb.model_check.attention_probe import ProbeResult, dispatch_problems, observed_layers
from transformers_cb.model_check.attention_recorder import AttentionCall, is_windowed, kv_tiling
from transformers_cb.model_check.model_support import check_model_supported, observed_layers_of

MIN = torch.finfo(torch.float32).min


def _call(layer: int, key=(2, 8), value=None, window=None, bias=False, repeat=1) -> AttentionCall:
    return AttentionCall(
        layer_idx=layer,
        key_shape=key,
        value_shape=value or key,
        query_heads=4,
        layout_ok=True,
        sliding_window=window,
        causal=True,
        mask_bias=bias,
        unsupported=(),
        kv_repeat=repeat,
    )


def _problems(calls: list[AttentionCall], windows, windowed=None, plain_bias=False) -> list[str]:
    result = ProbeResult(calls, True, True, mask_bias=plain_bias, windowed_layers=windowed)
    return dispatch_problems(result, len(calls), [(2, 8)] * len(calls), windows)


def _tiny(model_type: str, **overrides) -> PreTrainedModel:
    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2}
    config = AutoConfig.for_model(model_type, **{**small, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _jetmoe() -> PreTrainedModel:
    return _tiny(
        "jetmoe",
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def test_a_window_is_read_from_the_mask_when_the_layer_passes_none() -> None:
    """The config's window, applied through the mask alone (forward C saw it): its KV group applies it."""
    assert _problems([_call(0), _call(1)], [8, 8], windowed=frozenset({0, 1})) == []


def test_a_layer_applying_no_window_is_refused_naming_generates_mix() -> None:
    (problem,) = _problems([_call(0), _call(1)], [8, 8], windowed=frozenset())
    assert problem.startswith("layer 0 applies no window (a plain causal mask)")
    assert "sliding_window=8" in problem and "while prefilling" in problem
    assert "missing: a KV group kind whose queries inside the prompt attend every earlier key" in problem


def test_without_forward_c_a_missing_window_is_refused_as_before() -> None:
    (problem,) = _problems([_call(0)], [8], windowed=None)
    assert "applies sliding_window=None but the config gives its layer kind window 8" in problem


def test_a_window_other_than_the_configs_is_refused() -> None:
    (problem,) = _problems([_call(0, window=4)], [8], windowed=frozenset({0}))
    assert "applies sliding_window=4" in problem


def test_a_value_head_size_other_than_the_keys_is_observed_not_refused() -> None:
    """V's own head size is cached beside K (`KVGroupSpec.value_dim`); V with other heads than K's is not."""
    assert _problems([_call(0, key=(2, 8), value=(2, 16))], [None]) == []
    result = ProbeResult([_call(0, key=(2, 8), value=(2, 16)), _call(1)], True, True)
    assert observed_layers(result, [(2, 8), (2, 8)]) == ObservedLayers(((2, 8), (2, 8)), (16, 8))
    (problem,) = _problems([_call(0, key=(2, 8), value=(4, 8))], [None])
    assert "attends with V of (heads, dim) (4, 8) but K (2, 8)" in problem


def test_kv_tiled_over_the_query_heads_is_observed_before_the_repeat() -> None:
    result = ProbeResult([_call(0, key=(4, 8), repeat=2), _call(1, key=(4, 8), repeat=2)], True, True)
    assert observed_layers(result, [(2, 8), (2, 8)]) == ObservedLayers(((2, 8), (2, 8)), (), (2, 2))


@pytest.mark.parametrize(
    ("key", "repeat"),
    [
        (torch.arange(16.0).view(1, 2, 1, 8).repeat(1, 3, 1, 1), 3),  # JetMoE's `repeat`: tiled
        (torch.arange(16.0).view(1, 2, 1, 8).repeat_interleave(3, dim=1), 1),  # interleaved: not tiled
        (torch.arange(48.0).view(1, 6, 1, 8), 1),
        (torch.ones(1, 4, 1, 8), 4),
    ],
)
def test_tiling_is_told_from_the_tensors(key: torch.Tensor, repeat: int) -> None:
    assert kv_tiling(key, key.clone()) == repeat


def test_value_dims_size_the_groups_and_shape() -> None:
    config = AutoConfig.for_model(
        "mistral",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    observed = ObservedLayers(((2, 8), (4, 8)), (6, 6))
    groups = kv_groups_from_config(config, observed)
    assert [(g.head_shape, g.value_dim, g.kv_streams) for g in groups] == [((2, 8), 6, 1), ((4, 8), 6, 1)]
    assert ModelShape.from_config(config, observed).kv_bytes_per_token(4) == (2 * 14 + 4 * 14) * 4
    repeated = kv_groups_from_config(config, ObservedLayers(((2, 8), (2, 8)), (), (2, 2)))
    assert [(g.head_shape, g.kv_repeat, g.kv_streams) for g in repeated] == [((2, 8), 2, 2)]


def test_biases_are_told_apart_by_who_made_them() -> None:
    """A bias in the mask the layer passes under the engine's plain mask is the layer's own (Doge); one only
    the model's own mask carries is the model's (ALiBi through the mask)."""
    (own,) = _problems([_call(0, bias=True)], [None])
    assert own.startswith("layers [0] add a bias of their own to the attention mask")
    assert "missing a per-(KV head, key) term from every cached key's states added to the logits" in own
    (model_bias,) = _problems([_call(0)], [None], plain_bias=True)
    assert model_bias.startswith("its attention mask carries a bias")


def test_observed_shapes_only_where_they_differ_from_the_config() -> None:
    result = ProbeResult([_call(0), _call(1, key=(4, 8))], True, True)
    assert observed_layers(result, [(2, 8), (2, 8), (2, 8)]) == ObservedLayers(((2, 8), (4, 8), (2, 8)))
    same = ProbeResult([_call(0), _call(1)], True, True)
    assert observed_layers(same, [(2, 8), (2, 8)]) == ObservedLayers()


@pytest.mark.parametrize(
    ("mask", "windowed"),
    [
        (None, False),
        (torch.ones(1, 1, 5, 5, dtype=torch.bool).tril(), False),
        (torch.ones(1, 1, 5, 5, dtype=torch.bool).tril() & torch.ones(5, 5, dtype=torch.bool).triu(-1), True),
        (torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), MIN), False),
        (torch.zeros(1, 1, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).triu(-1), MIN), True),
    ],
)
def test_a_window_in_a_mask(mask, windowed: bool) -> None:
    assert is_windowed(mask) is windowed


def test_the_groups_and_shape_take_the_observed_head_shapes() -> None:
    config = AutoConfig.for_model(
        "mistral",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    observed = ObservedLayers(((4, 8), (4, 8)))
    assert [g.head_shape for g in kv_groups_from_config(config, observed)] == [(4, 8)]
    assert [g.head_shape for g in kv_groups_from_config(config)] == [None]
    assert ModelShape.from_config(config, observed).kv_bytes_per_token(4) == 2 * 2 * 32 * 4
    assert ModelShape.from_config(config).kv_bytes_per_token(4) == 2 * 2 * 16 * 4


def test_jetmoe_is_accepted_and_sized_before_its_repeat() -> None:
    """JetMoE repeats its 2 KV heads once per routed expert (2) before attending: the cache holds the 2."""
    model = _jetmoe()
    check_model_supported(model)
    observed = observed_layers_of(model)
    assert observed is not None and observed.head_shapes == ((2, 8), (2, 8))
    assert observed.kv_repeats == (2, 2)
    settings, _ = resolve_settings(model, GenerationConfig(max_new_tokens=4, do_sample=False), None, [8])
    assert settings.shape.layer_head_shape(0) == (2, 8)
    assert [(g.head_shape, g.kv_repeat) for g in settings.cache.kv_groups] == [((2, 8), 2)]
    # K and V of 2 heads of 8 in 2 layers, float32: half of what the repeated heads took.
    assert settings.shape.kv_bytes_per_token(4) == 2 * 2 * 2 * 8 * 4


def test_a_draft_model_is_sized_from_its_own_probe() -> None:
    model = _jetmoe()
    settings, _ = resolve_settings(
        model, GenerationConfig(max_new_tokens=4, do_sample=False), None, [8], assistant_model=model
    )
    assert settings.assistant is not None
    assert [(g.head_shape, g.kv_repeat) for g in settings.assistant.kv_groups] == [((2, 8), 2)]


def test_forward_c_leaves_the_window_as_it_found_it() -> None:
    """The shrunk window is the probe's alone: the config's comes back, even when the forward fails."""
    model = _tiny(
        "mistral", num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, sliding_window=8
    )
    check_model_supported(model)
    assert model.config.sliding_window == 8
    calls = []

    def failing(*args, **kwargs):
        calls.append(model.config.sliding_window)
        if model.config.sliding_window != 8:
            raise RuntimeError("the shrunk window's forward fails")
        return original(*args, **kwargs)

    original = model.forward
    model.forward = failing
    model.config.num_hidden_layers = 2  # a config edit: the check probes again
    model.config.rms_norm_eps = 1e-5
    check_model_supported(model)
    assert 2 in calls
    assert model.config.sliding_window == 8
