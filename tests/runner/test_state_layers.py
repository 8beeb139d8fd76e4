"""runner/states/state_layers.py against transformers' own linear-attention cache layer, and the step's state table
(runner/packing.py `state_table`).

`SlotStateView` must behave as `transformers.cache_utils.LinearAttentionLayer` does for one request (the
layer `generate()` runs against): a first chunk's conv window left-padded with zeros to the kernel, a
continued chunk seeing its previous window then the new inputs, the last kernel-size columns kept; a
recurrent state stored as a copy. What a call leaves is written back at its slots' rows only.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from tests.support.requests import make_request
from transformers_cb.memory.state_cache import CONV, RECURRENT, StateCache, StateSpec
from transformers_cb.runner.packing import state_table
from transformers_cb.runner.states.slot_state_view import SlotStateView, StateRecorder
from transformers_cb.runner.states.state_layers import StateLayers, StateTable
from transformers_cb.scheduler.step_plan import ScheduledRequest

KERNEL = 4
CHANNELS = 3
LAYER = 2
SPECS = (
    StateSpec(LAYER, CONV, 0, (CHANNELS, KERNEL), torch.float32),
    StateSpec(LAYER, RECURRENT, 0, (2, 5), torch.float32),
)


def _conv_chunks(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, CHANNELS, n, generator=generator) for n in lengths]


@pytest.mark.parametrize("lengths", [[2, 3, 1, 1], [6, 1], [1, 1, 1, 1, 1, 1], [4, 2]])
def test_conv_state_follows_transformers_layer(lengths: list[int]) -> None:
    """Chunk after chunk (shorter than the kernel, longer, one token): the window each update returns and
    the state left behind equal `LinearAttentionLayer`'s, the request sitting at slot 1 of 3."""
    theirs = LinearAttentionLayer()
    cache = StateCache(SPECS, 3, torch.device("cpu"))
    slot = torch.tensor([1])
    for i, chunk in enumerate(_conv_chunks(0, lengths)):
        expected = theirs.update_conv_state(chunk, conv_kernel_size=KERNEL)
        view = SlotStateView(cache, slot, fresh=i == 0)
        assert (view.get_conv_state(LAYER) is None) == (i == 0)
        assert view.has_previous_state(LAYER) == (i > 0)
        got = view.update_conv_state(chunk, LAYER, conv_kernel_size=KERNEL)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        view.write_back()
        torch.testing.assert_close(
            cache.tensors[(LAYER, CONV, 0)][1], theirs.conv_states[0][0], rtol=0, atol=0
        )


def test_recurrent_state_is_a_copy_written_at_its_slots_only() -> None:
    cache = StateCache(SPECS, 4, torch.device("cpu"))
    slots = torch.tensor([3, 0])
    state = torch.arange(20, dtype=torch.float32).view(2, 2, 5)
    view = SlotStateView(cache, slots, fresh=True)
    kept = view.update_recurrent_state(state, LAYER)
    state.zero_()  # the layer's own tensor changes afterwards: the cache must not see it
    view.write_back()
    stored = cache.tensors[(LAYER, RECURRENT, 0)]
    expected = torch.arange(20, dtype=torch.float32).view(2, 2, 5)
    torch.testing.assert_close(kept, expected)
    torch.testing.assert_close(stored[3], expected[0])
    torch.testing.assert_close(stored[0], expected[1])
    assert not stored[1].any() and not stored[2].any(), "rows of other slots were written"
    # A later view continues from the rows of its slots, in its slots' order.
    again = SlotStateView(cache, torch.tensor([0, 3]), fresh=False)
    torch.testing.assert_close(again.get_recurrent_state(LAYER), expected.flip(0))


def test_in_place_updates_of_a_read_state_are_written_back() -> None:
    """A layer that updates the state it read in place (a one-token conv update) leaves it in the view's
    rows, which `write_back` stores; without `write_back` the cache is untouched."""
    cache = StateCache(SPECS, 2, torch.device("cpu"))
    cache.tensors[(LAYER, CONV, 0)][1] = 1.0
    view = SlotStateView(cache, torch.tensor([1]), fresh=False)
    view.get_conv_state(LAYER).add_(2.0)
    assert float(cache.tensors[(LAYER, CONV, 0)][1].max()) == 1.0
    view.write_back()
    assert float(cache.tensors[(LAYER, CONV, 0)][1].min()) == 3.0
    assert not cache.tensors[(LAYER, CONV, 0)][0].any()


def test_recorder_learns_the_shapes_a_slot_holds() -> None:
    recorder = StateRecorder()
    (conv,) = _conv_chunks(1, [2])
    padded = recorder.update_conv_state(conv, LAYER, conv_kernel_size=KERNEL)
    recorder.update_recurrent_state(torch.zeros(1, 2, 5, dtype=torch.bfloat16), LAYER)
    assert padded.shape[-1] == KERNEL and not padded[..., :2].any()
    assert recorder.specs[(LAYER, CONV, 0)].shape == (CHANNELS, KERNEL)
    assert recorder.specs[(LAYER, RECURRENT, 0)].shape == (2, 5)
    assert recorder.specs[(LAYER, RECURRENT, 0)].dtype == torch.bfloat16


def _entry(request_id: str, start: int, num_tokens: int, slot: int) -> ScheduledRequest:
    return ScheduledRequest(
        make_request(request_id, start + num_tokens + 1), start, num_tokens, state_slot=slot
    )


def test_state_table_decodes_first_then_spans() -> None:
    """Leading one-token rows of requests with a state are the decode batch; a one-token *prompt* (start
    0: a fresh state) is a span of its own, as is every chunk after it, fresh or continued."""
    ordered = [
        _entry("d0", 7, 1, 2),
        _entry("d1", 3, 1, 0),
        _entry("fresh1", 0, 1, 4),  # a one-token prompt: no state to continue
        _entry("cont", 16, 5, 1),
        _entry("d2", 9, 1, 3),  # after a span: its own span (the decode batch is the leading rows)
    ]
    table = state_table(ordered, torch.device("cpu"))
    assert table.num_decode_rows == 2
    assert table.decode_slots.tolist() == [2, 0]
    assert table.spans == [(2, 1, 4, True), (3, 5, 1, False), (8, 1, 3, False)]


def test_state_table_without_decodes() -> None:
    table = state_table([_entry("a", 0, 6, 1), _entry("b", 4, 3, 0)], torch.device("cpu"))
    assert table.num_decode_rows == 0 and table.decode_slots is None
    assert table.spans == [(0, 6, 1, True), (6, 3, 0, False)]


# -- the split forwards: installed once per run session ------------------------------------------------


class _Doubling(torch.nn.Module):
    """A state module's signature (`hidden_states, cache_params, attention_mask`), doubling its input."""

    def forward(
        self, hidden_states: torch.Tensor, cache_params: object = None, attention_mask: object = None
    ) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return hidden_states * 2


def test_a_session_installs_the_split_forwards_once_and_steps_only_set_their_states() -> None:
    """Inside a session each state module's forward is one installed function, the same object in every
    step (a step sets its `StepStates`, nothing else: the module then runs once per request); nested
    sessions install nothing more, and the class's own forward shows again when the last one ends."""
    modules = {0: _Doubling(), 1: _Doubling()}
    layers = StateLayers(modules, StateCache(SPECS, 2, torch.device("cpu")))
    hidden = torch.ones(1, 3, 2)
    with layers.session():
        installed = [m.__dict__["forward"] for m in modules.values()]
        with layers.step(StateTable(None, 0, [(0, 2, 0, True), (2, 1, 1, True)])):
            assert [m.__dict__["forward"] for m in modules.values()] == installed
            torch.testing.assert_close(modules[0](hidden), hidden * 2)
            assert modules[0].calls == 2  # split by request: one call per span
        with layers.session():  # a nested session (another caller of the same model): nothing more
            assert [m.__dict__["forward"] for m in modules.values()] == installed
        assert [m.__dict__["forward"] for m in modules.values()] == installed
        modules[1](hidden)  # no step's states set: the module as written, one call
        assert modules[1].calls == 1
    assert all("forward" not in m.__dict__ for m in modules.values())
    with layers.step(StateTable(None, 0, [(0, 3, 0, True)])):  # outside a session: installed for the step
        assert all("forward" in m.__dict__ for m in modules.values())
    assert all("forward" not in m.__dict__ for m in modules.values())
