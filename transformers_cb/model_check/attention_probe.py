"""What a model's forward really does with its attention, learned from three forwards of five tokens.

The paged backends rely on a contract no config states: every decoder layer calls transformers' attention
interface exactly once per forward, with its own `layer_idx`, causally, with K and V of the shape the
cache is sized for (`ModelShape`), with the window its KV group keeps, and in the forward's thread and
context (the step's metadata reaches the paged glue as a kwarg, or through the context variable the
runner sets for layers that drop the kwargs; the recorder reads its record from the same context, so an
attention call made elsewhere is not recorded and its layer counts as missing); the model numbers positions 0..n-1 as the `position_ids` the engine passes say. A
model that breaks any of it runs "fine" and returns wrong tokens (or fails mid-run), so the support
check runs this probe up front. Whether the forward honours `logits_to_keep` is recorded too: the
runner selects the rows itself when it does not (`ProbeResult.keeps_rows`).

- forward A is the engine's call (`position_ids`, the 4D no-mask, a `logits_to_keep` index tensor, the
  metadata kwarg and context variable) with the model switched to a recording attention function
  (attention_recorder.py) that computes plain causal attention (so the forward continues with real
  values) and records each call;
- forward A' is A with positions spread apart (0, 2, 4, ...): identical logits mean the model ignores
  `position_ids` and numbers the packed row itself (BART's decoder: `arange(row length)`), which is
  wrong for every sequence of a packed step but the first;
- forward B is plain `generate()`'s call (no `position_ids`, the model's own mask, the same
  `logits_to_keep`). It differs from A only in who numbers the positions: different logits mean the
  model's own positions are not 0..n-1 (an offset, learned positions counted from a padding index, ...);
- forward C (only when the config states a window) is B with the config's window shrunk below the
  probe's token count: it tells a layer that windows through its mask alone (no `sliding_window` kwarg:
  the config's window, which its KV group applies) from one that applies none (Moshi: a plain causal
  mask, while generate()'s cache, built from the config, keeps only the window: refused, see
  `dispatch_problems`).

The K/V head shapes the probe saw (`observed_layers`) override the config's where they differ: the cache
is sized for the K/V each layer really passes (`kv/layer_groups.py: ObservedLayers`): V's own head size,
and K/V heads a layer tiles before the call (JetMoE's repeat per routed expert,
`attention_recorder.kv_tiling`) cached once.

Each broken clause is one phrase of `dispatch_problems`; the support check refuses the model with them.
The forwards run through `model.forward` in eval mode under `inference_mode`, and the attention
implementation and training mode are restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from ..attention.paged import METADATA_KWARG, step_metadata
from ..kv.layer_groups import ObservedLayers
from .attention_recorder import ACTIVE_RECORD, PROBE_TOKENS, AttentionCall, ProbeRecord, recording

KEEP_ROWS = (1, PROBE_TOKENS - 1)  # like the runner: an index tensor, not "the last n"
# Forward C's window: below PROBE_TOKENS under any off-by-one convention, so a windowed mask shows.
PROBE_WINDOW = 2


def probe_token_ids(model: PreTrainedModel) -> list[int]:
    """Ordinary token ids: none named by the config (an image token would ask for an image)."""
    text = model.config.get_text_config(decoder=True)
    # The config's vocabulary, else the embedding table's rows (an int either way).
    vocab = int(getattr(text, "vocab_size", None) or cast(Any, model.get_input_embeddings()).num_embeddings)
    special = {
        v
        for config in (model.config, text)
        for k, v in config.to_dict().items()
        if isinstance(v, int) and str(k).endswith(("_token_id", "_token_index"))
    }
    start = max(3, vocab // 3)
    return [t for t in range(start, vocab) if t not in special][:PROBE_TOKENS]


@dataclass
class ProbeResult:
    """What the probe saw: forward A's attention calls, and how A compares with A' and B."""

    calls: list[AttentionCall]
    keeps_rows: bool  # logits_to_keep honoured
    positions_agree: bool  # position_ids 0..n-1 give the model's own logits
    positions_used: bool = True  # other position_ids give other logits
    error: str | None = None
    mask_bias: bool = False  # forward B's attention masks carry a bias
    # Layers whose mask in forward C applies a window (None: forward C did not run, or failed).
    windowed_layers: frozenset[int] | None = None


@torch.inference_mode()
def run_probe(model: PreTrainedModel) -> ProbeResult:
    device = next(model.parameters()).device
    ids = torch.tensor([probe_token_ids(model)], device=device)
    positions = torch.arange(ids.shape[1], device=device)[None]
    keep = torch.tensor(KEEP_ROWS, device=device)
    # `model.forward`, not `model(...)`: the probe is a check, not a generation step, so the user's forward
    # hooks (counters, profilers) do not see it; wrappers that replace `forward` (accelerate's device
    # hooks) still run.
    forward = model.forward
    record = ProbeRecord()
    token = ACTIVE_RECORD.set(record)
    try:
        with recording(model):
            with step_metadata(cast(Any, record)):  # as the runner sets it (runner/forward/model_call.py)
                engine_call = forward(
                    input_ids=ids,
                    position_ids=positions,
                    attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
                    use_cache=False,
                    logits_to_keep=keep,
                    **{METADATA_KWARG: record},
                ).logits
            record.in_plain = True
            spread_call = forward(
                input_ids=ids,
                position_ids=positions * 2,
                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
                use_cache=False,
                logits_to_keep=keep,
            ).logits
            plain_call = _plain_logits(model, forward, ids, keep)
            windowed = _windowed_layers(model, forward, ids, keep, record)
    except Exception as error:  # noqa: BLE001  (any failure of the model's own forward is the reason)
        return ProbeResult(record.calls, True, True, error=f"{type(error).__name__}: {error}")
    finally:
        ACTIVE_RECORD.reset(token)
    keeps = engine_call.shape[1] == len(KEEP_ROWS)
    agree = engine_call.shape == plain_call.shape and torch.allclose(
        engine_call.float(),
        plain_call.float(),
        rtol=1e-3,
        atol=1e-3 * max(1.0, float(plain_call.abs().max())),
    )
    # Ignored position_ids leave every operation and input the same: bitwise equal logits.
    used = not torch.equal(engine_call, spread_call)
    # A bias that only the model's own mask carries (B) is lost all the same under the engine's call.
    bias = any(c.mask_bias for c in record.plain_calls)
    return ProbeResult(record.calls, keeps, agree, used, mask_bias=bias, windowed_layers=windowed)


def _plain_logits(
    model: PreTrainedModel, forward: Callable[..., object], ids: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Forward B: the model's own logits outside continuous batching. A model whose attention modules do
    not read the implementation (MPT's) still builds its mask from it, and SDPA's builder returns no mask
    where `is_causal` would do, which MPT's code cannot take (`create_causal_mask(...).to(torch.bool)`): its
    own forward under `paged|sdpa` fails before any attention runs. Its own logits are then the eager
    mask's, which its attention modules apply as they always do."""
    try:
        return cast(Any, forward(input_ids=ids, use_cache=False, logits_to_keep=keep)).logits
    except AttributeError:
        config = model.config
        saved = config._attn_implementation
        if saved is None or "sdpa" not in saved:
            raise
        config._attn_implementation = "eager"
        try:
            return cast(Any, forward(input_ids=ids, use_cache=False, logits_to_keep=keep)).logits
        finally:
            config._attn_implementation = saved


def _windowed_layers(
    model: PreTrainedModel,
    forward: Callable[..., object],
    ids: torch.Tensor,
    keep: torch.Tensor,
    record: ProbeRecord,
) -> frozenset[int] | None:
    """Forward C: the layers whose own mask applies the config's window (shrunk to `PROBE_WINDOW` for the
    call, so five tokens show it). None when the config states no window or the forward fails."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or window <= PROBE_WINDOW:
        return None
    record.in_window = True
    text.sliding_window = PROBE_WINDOW
    try:
        forward(input_ids=ids, use_cache=False, logits_to_keep=keep)
    except Exception:  # noqa: BLE001  (no answer: every layer keeps the config's window)
        return None
    finally:
        text.sliding_window = window
        record.in_window = False
    return frozenset(
        c.layer_idx for c in record.window_calls if isinstance(c.layer_idx, int) and c.mask_windowed
    )


def _masks_window(result: ProbeResult, call: AttentionCall, window: int | None) -> bool:
    """The config gives the call's layer a window that the layer applies through its mask alone (no
    `sliding_window` kwarg, a mask that follows the config's window: forward C)."""
    return (
        window is not None
        and call.sliding_window is None
        and result.windowed_layers is not None
        and call.layer_idx in result.windowed_layers
    )


def observed_layers(result: ProbeResult, kv_shapes: list[tuple[int, int]]) -> ObservedLayers:
    """What the probe saw that overrides the config: each layer's K head shape as the cache holds it (the
    heads before a repeat the layer tiles them by) where any layer's differs from `kv_shapes` (the config's;
    layers without a call keep theirs), V's head sizes where some differs from K's, and the repeats where
    some layer repeats. Read only when `dispatch_problems` found nothing (then V has K's heads)."""
    seen = {
        c.layer_idx: c
        for c in result.calls
        if isinstance(c.layer_idx, int) and 0 <= c.layer_idx < len(kv_shapes)
    }
    shapes, values, repeats = [], [], []
    for i, shape in enumerate(kv_shapes):
        call = seen.get(i)
        if call is None:
            shapes.append(shape)
            values.append(shape[1])
            repeats.append(1)
            continue
        shapes.append((call.key_shape[0] // call.kv_repeat, call.key_shape[1]))
        values.append(call.value_shape[1])
        repeats.append(call.kv_repeat)
    differs = shapes != list(kv_shapes) or values != [d for _, d in shapes] or set(repeats) != {1}
    if not differs:
        return ObservedLayers()
    return ObservedLayers(
        tuple(shapes),
        tuple(values) if values != [d for _, d in shapes] else (),
        tuple(repeats) if set(repeats) != {1} else (),
    )


def dispatch_problems(
    result: ProbeResult,
    num_layers: int,
    kv_shapes: list[tuple[int, int]] | None,
    windows: list[int | None],
    kv_layers: list[int] | None = None,
    has_state: bool = False,
) -> list[str]:
    """Each clause of the contract the probe saw broken, as a phrase for the refusal.

    Args:
        kv_shapes: (KV heads, head dim) the cache is sized for, per layer; None skips the shape clause.
        windows: the sliding window of each layer's KV group (None: full attention).
        kv_layers: the layers that cache K/V (None: every layer); the others must not attend.
        has_state: the model has state layers, which order a request's tokens themselves (runner/
            state_layers.py): a forward that ignores `position_ids` is then no problem.
    """
    if result.error is not None:
        return [f"a forward on token ids alone fails ({result.error})"]
    calls = result.calls
    expected = set(range(num_layers) if kv_layers is None else kv_layers)
    if not calls and expected:
        return ["its attention does not go through transformers' attention interface"]
    problems = []
    per_layer: dict[int | None, list[AttentionCall]] = {}
    for call in calls:
        per_layer.setdefault(call.layer_idx, []).append(call)
    bad_layout = [c.layer_idx for c in calls if not c.layout_ok]
    if bad_layout:
        return [
            f"layer {bad_layout[0]} passes query/key/value that are not [batch, heads, tokens, head_dim] for "
            "its token count (e.g. position embeddings broadcast to an extra axis)"
        ]
    if None in per_layer:
        problems.append("some attention modules have no `layer_idx`")
    shared = sorted(i for i in per_layer if i is not None and i < 0)
    if shared:
        # Zamba's shared transformer block: one module (layer_idx -1) attends for several decoder layers,
        # told which by an argument of its forward that the attention interface never sees.
        return [
            f"one attention module (layer_idx {shared[0]}) serves {len(per_layer[shared[0]])} decoder layers "
            "(a shared attention block), so the paged cache cannot tell which layer's K/V a call is"
        ]
    repeated = sorted(i for i, c in per_layer.items() if i is not None and len(c) > 1)
    if repeated:
        problems.append(
            f"layers {repeated} call attention {len(per_layer[repeated[0]])} times per forward "
            "(e.g. differential attention); the cache holds one K/V write per layer"
        )
    missing = sorted(expected - set(per_layer))
    if missing:
        problems.append(f"layers {missing} do not attend through the attention interface")
    unexpected = sorted(i for i in per_layer if i is not None and i not in expected)
    if unexpected:
        problems.append(f"layers {unexpected} attend although their layer type caches no K/V")
    layer_bias = sorted({c.layer_idx for c in calls if c.mask_bias and c.layer_idx is not None})
    if layer_bias:
        # The engine's call passes a plain mask: a bias there was made by the layer itself (Doge's dynamic
        # mask: a per-key term from every cached key's value states, then a top-k of the keys).
        problems.append(
            f"layers {layer_bias} add a bias of their own to the attention mask, computed from each key's "
            "states (Doge's dynamic mask: exp(A x softplus(dt_proj(V))) per KV head and key, then the top "
            "keep_window_size keys): missing a per-(KV head, key) term from every cached key's states added to "
            "the logits by each paged kernel, and that top-k selection (a layer sees only the step's new keys)"
        )
    elif result.mask_bias or any(c.mask_bias for c in calls):
        problems.append("its attention mask carries a bias (e.g. ALiBi), which the paged kernels do not add")
    if any(not c.causal for c in calls):
        problems.append("its attention is bidirectional (is_causal=False), not causal generation")
    # K/V shapes other than the config's are sized from the probe (`observed_layers`), V's head size too
    # (a row holds K then V); what the cache cannot hold is V with other heads than K's.
    for c in calls:
        if kv_shapes is not None and c.key_shape[0] != c.value_shape[0]:
            problems.append(
                f"layer {c.layer_idx} attends with V of (heads, dim) {c.value_shape} but K {c.key_shape}: V "
                "with another head count than K is not supported (a page row holds K and V of the same heads)"
            )
            break
    for c in calls:
        if c.query_heads % max(1, c.key_shape[0]):
            problems.append(
                f"layer {c.layer_idx} has {c.query_heads} query heads for {c.key_shape[0]} KV heads"
            )
            break
    for c in calls:
        if (
            isinstance(c.layer_idx, int)
            and 0 <= c.layer_idx < len(windows)
            and c.sliding_window != windows[c.layer_idx]
            and not _masks_window(result, c, windows[c.layer_idx])
        ):
            window = windows[c.layer_idx]
            if c.sliding_window is None and result.windowed_layers is not None:
                # Its mask is causal, yet generate()'s DynamicCache (built from the config) keeps only the
                # window: generate() attends fully while prefilling, within the window while decoding.
                problems.append(
                    f"layer {c.layer_idx} applies no window (a plain causal mask) while generate()'s DynamicCache "
                    f"keeps a {window}-token window (sliding_window={window!r}): generate() attends to every key "
                    "while prefilling, to the window while decoding; missing: a KV group kind whose queries "
                    "inside the prompt attend every earlier key and later ones the window, keeping the prompt's "
                    "pages until it is prefilled (each request's prompt length in the masks and kernels)"
                )
                break
            problems.append(
                f"layer {c.layer_idx} applies sliding_window={c.sliding_window!r} but the config gives its layer "
                f"kind window {windows[c.layer_idx]!r}"
            )
            break
    unsupported = sorted({name for c in calls for name in c.unsupported})
    if unsupported:
        problems.append(f"its attention passes {unsupported}, which the paged kernels do not implement")
    # ALiBi layers take positions from the keys the kernels attend (each request's own), not position_ids.
    alibi = bool(calls) and all(c.alibi for c in calls)
    if not result.positions_used and not has_state and not alibi:
        problems.append(
            "its forward ignores `position_ids` (it numbers the tokens of a packed step itself, so every "
            "sequence but the first would get wrong positions; or it has no positional encoding at all)"
        )
    # An ignored `logits_to_keep` is no problem: the runner selects the rows (runner/forward/model_call.py).
    if result.positions_used and not result.positions_agree:
        problems.append(
            "its forward numbers positions its own way: given position_ids 0..n-1 it computes other logits "
            "than generate() (e.g. positions offset by a padding index)"
        )
    return problems
