"""`transformers_cb::native_paged_attention`: the custom op a compiled forward keeps in its graph.

Its fake (meta) implementation, schema and mutation must agree with the real kernel (`opcheck`), the op must
write the step's K/V and attend exactly as the eager glue does, and a compiled function calling it must trace
as one graph (no break)."""

from __future__ import annotations

import pytest
import torch

from transformers_cb.attention.native import kernel as native
from transformers_cb.attention.paged import native_layer_attention, native_paged_attention_op
from transformers_cb.attention.reference import reference_paged_attention

pytestmark = pytest.mark.skipif(
    native.native_module() is None,
    reason="the native CPU kernel cannot be built here (see the logged reason)",
)

PAGE, HEADS, KV_HEADS, DIM, LAYERS, PAGES = 4, 4, 2, 8, 2, 6


def decode_step(seed: int = 0):
    """Two decode rows (KV 6 and 3 tokens, the last one new) over a random two-layer cache."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(2, LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    block_table = torch.tensor([[0, 2], [3, 3]], dtype=torch.int32)  # row 1 needs one page
    token_row = torch.tensor([0, 1])
    token_pos = torch.tensor([5, 2])
    slots = torch.tensor([2 * PAGE + 1, 3 * PAGE + 2])  # position 5 of row 0, position 2 of row 1
    query = torch.randn(2, HEADS, DIM, generator=gen)
    new_k = torch.randn(2, KV_HEADS, DIM, generator=gen)
    new_v = torch.randn(2, KV_HEADS, DIM, generator=gen)
    return query, new_k, new_v, storage, slots, token_row, token_pos, block_table


def op_args(layer: int, step, scale: float = 0.5) -> tuple:
    """The op's arguments for `layer` of `step` (no window, softcap or sinks)."""
    query, new_k, new_v, storage, slots, token_row, token_pos, block_table = step
    return (
        query,
        new_k,
        new_v,
        storage,
        layer,
        slots,
        token_row,
        token_pos,
        block_table,
        PAGE,
        scale,
        0,
        0.0,
        None,
    )


def call(layer: int, step, scale: float = 0.5) -> torch.Tensor:
    return native_paged_attention_op(*op_args(layer, step, scale))


def test_op_passes_opcheck() -> None:
    torch.library.opcheck(native_paged_attention_op, op_args(1, decode_step()))


def test_op_writes_the_new_kv_and_attends_like_the_reference() -> None:
    step = decode_step()
    query, new_k, new_v, storage, slots, _, _, block_table = step
    before = storage.clone()
    out = call(1, step)
    keys = storage[0, 1].view(-1, KV_HEADS, DIM)
    values = storage[1, 1].view(-1, KV_HEADS, DIM)
    assert torch.equal(keys[slots], new_k) and torch.equal(values[slots], new_v)
    untouched = torch.ones(PAGES * PAGE, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(keys[untouched], before[0, 1].view(-1, KV_HEADS, DIM)[untouched])
    assert torch.equal(storage[:, 0], before[:, 0])  # the other layer is not written
    expected = reference_paged_attention(
        query, keys, values, torch.tensor([0, 1, 2]), torch.tensor([6, 3]), block_table, PAGE, 0.5
    )
    torch.testing.assert_close(out, expected)


def test_a_compiled_caller_is_one_graph() -> None:
    """The op is opaque to dynamo: a function around it traces without a graph break (aot_eager: no C++)."""

    def layer_step(step):
        return call(0, step) * 2 + 1

    explanation = torch._dynamo.explain(layer_step)(decode_step())
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(layer_step, backend="aot_eager", fullgraph=True)
    eager_step, compiled_step = decode_step(), decode_step()
    torch.testing.assert_close(compiled(compiled_step), layer_step(eager_step))
    assert torch.equal(compiled_step[3], eager_step[3])  # the cache write happened in the graph too


def test_eager_calls_the_function_itself_with_the_ops_results() -> None:
    # An eager forward skips the op's dispatch (~95 us a call) and calls its function: the same writes and
    # the same output, bitwise.
    via_op, direct = decode_step(), decode_step()
    out = call(1, via_op)
    assert torch.equal(native_layer_attention(*op_args(1, direct)), out)
    assert torch.equal(direct[3], via_op[3])


def test_the_eager_glue_does_not_dispatch_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.models import tiny_llama
    from transformers_cb.attention import paged

    calls: list[str] = []
    monkeypatch.setattr(paged, "native_paged_attention_op", lambda *a, **k: calls.append("op"))
    original = paged.native_layer_attention

    def counted(*args, **kwargs):
        calls.append("function")
        return original(*args, **kwargs)

    monkeypatch.setattr(paged, "native_layer_attention", counted)
    # the glue's own path: a Llama layer would otherwise run its whole step natively (direct_layer.py)
    monkeypatch.setenv("TRANSFORMERS_CB_DIRECT_LAYERS", "0")
    model = tiny_llama()
    model.generate_batch([[5, 6, 7, 8]], max_new_tokens=3, progress_bar=False)
    assert calls and set(calls) == {"function"}
