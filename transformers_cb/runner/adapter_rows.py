"""Requests on different PEFT adapters in one packed step (docs/adapters.md).

The runner sets the step's row groups (`StepAdapters`: which packed rows run on which `AdapterChoice`) in a
context variable for the forward's duration (`adapter_step`); PEFT's LoRA `Linear` runs, from the run session's
first step with requests on adapters to its end (`AdapterRows`, a counted patch of its class's `forward`), a
forward that reads it: the base layer's product
once for every row (a packed product, runner/products/packed_model.py, takes the base layer as it takes any plain
Linear), then each group's `scale * B(A x)` added to its rows, as PEFT's own forward adds it (the input cast to
the adapter's dtype, `result + delta`, cast back): a request's tokens equal `generate()` after
`set_adapter(name)`. A DoRA adapter goes through PEFT's own variant forward on its rows (row-wise too). A
group whose choice is None (a request that runs the model's own forwards) gets the layer's own forward on
its rows. Outside a step (the support check's probes, a draft model's forward, another thread) the variable
is unset and the layer's own forward runs.

The head (the model's output embeddings, when an adapter targets it) sees the kept rows only
(`logits_to_keep`), so its groups are the kept rows'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..invariants import InvariantError
from ..patches import patched
from ..requests import AdapterChoice, Request

PATCH_KIND = "adapter_rows"


@dataclass(frozen=True)
class RowGroup:
    """Rows of the step on one choice: `rows` indices of them (None: every row)."""

    choice: AdapterChoice | None
    rows: torch.Tensor | None


@dataclass
class StepAdapters:
    """The step's row groups: over its packed tokens, and over the rows the head keeps."""

    token_groups: list[RowGroup]
    kept_groups: list[RowGroup]
    num_tokens: int
    num_kept: int
    head: nn.Module | None

    def groups_for(self, layer: nn.Module, rows: int) -> list[RowGroup]:
        """The groups of a layer called on `rows` rows: the head's are the kept rows'."""
        if rows == self.num_kept and layer is self.head:
            return self.kept_groups
        if rows == self.num_tokens:
            return self.token_groups
        if rows == self.num_kept:
            return self.kept_groups
        raise InvariantError(
            f"an adapted layer ({type(layer).__name__}) was called on {rows} rows: neither the step's "
            f"{self.num_tokens} tokens nor its {self.num_kept} kept rows, so its rows' adapters are unknown"
        )


ADAPTER_ROWS: ContextVar[StepAdapters | None] = ContextVar("transformers_cb_adapter_rows", default=None)


def _groups(token_choice: torch.Tensor, choices: list[AdapterChoice | None]) -> list[RowGroup]:
    present = torch.unique(token_choice).tolist()
    if len(present) == 1:
        return [RowGroup(choices[int(present[0])], None)]
    return [RowGroup(choices[int(i)], torch.nonzero(token_choice == i).squeeze(1)) for i in present]


def step_adapters(
    requests: Sequence[Request], num_tokens: Sequence[int], keep: torch.Tensor, head: nn.Module | None
) -> StepAdapters | None:
    """The row groups of a step packing `requests` (in packed order, `num_tokens[i]` contiguous rows each);
    None when every request runs the model's own forwards (nothing to split)."""
    if all(request.adapter is None for request in requests):  # every step of a model without adapters
        return None
    choices: list[AdapterChoice | None] = []
    index: dict[AdapterChoice | None, int] = {}
    per_entry = []
    for request in requests:
        choice = request.adapter
        if choice not in index:
            index[choice] = len(choices)
            choices.append(choice)
        per_entry.append(index[choice])
    counts = torch.tensor(list(num_tokens), dtype=torch.int64)
    token_choice = torch.repeat_interleave(torch.tensor(per_entry, dtype=torch.int64), counts)
    kept_choice = token_choice.index_select(0, keep.to("cpu"))
    device = keep.device
    token_groups = _groups(token_choice, choices)
    kept_groups = _groups(kept_choice, choices)
    moved = [
        [RowGroup(g.choice, None if g.rows is None else g.rows.to(device)) for g in groups]
        for groups in (token_groups, kept_groups)
    ]
    return StepAdapters(moved[0], moved[1], int(token_choice.numel()), int(keep.numel()), head)


@contextmanager
def adapter_step(step: StepAdapters | None) -> Iterator[None]:
    """Inside: the layers read `step`'s row groups (nothing set for None)."""
    if step is None:
        yield
        return
    token = ADAPTER_ROWS.set(step)
    try:
        yield
    finally:
        ADAPTER_ROWS.reset(token)


def add_lora(layer: Any, x: torch.Tensor, result: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """PEFT's LoRA `Linear.forward` past its base product, for the adapters `names` (those the layer holds),
    dropout-free: the same operations in the same dtypes, so the same values."""
    held = layer.lora_A.keys()
    if not any(name in held for name in names):
        return result
    result_dtype = result.dtype
    for name in names:
        if name not in held:
            continue
        lora_a = layer.lora_A[name]
        x = layer._cast_input_dtype(x, lora_a.weight.dtype)
        if name not in layer.lora_variant:
            result = result + layer.lora_B[name](lora_a(x)) * layer.scaling[name]
        else:  # DoRA: PEFT's own variant forward, row-wise
            result = layer.lora_variant[name].forward(layer, active_adapter=name, x=x, result=result)
    return result.to(result_dtype)


def grouped_forward(
    layer: Any, x: torch.Tensor, groups: list[RowGroup], original: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """The layer on a step whose rows run on `groups`: its base product once, then each group's adapters."""
    if len(groups) == 1 and groups[0].rows is None:
        choice = groups[0].choice
        if choice is None:
            return original(layer, x)
        return add_lora(layer, x, layer.base_layer(x), choice.names)
    result = layer.base_layer(x)
    flat_x = x.reshape(-1, x.shape[-1])
    # One copy written group by group (the base product may be a view of a fused product: never written).
    flat = result.reshape(-1, result.shape[-1]).clone()
    for group in groups:
        rows = group.rows
        if rows is None:  # invariant: several groups each name their rows
            raise InvariantError("a row group without rows beside others")
        if group.choice is None:
            part = original(layer, flat_x.index_select(0, rows))
        elif not any(name in layer.lora_A for name in group.choice.names):
            continue
        else:
            part = add_lora(
                layer, flat_x.index_select(0, rows), flat.index_select(0, rows), group.choice.names
            )
        flat.index_copy_(0, rows, part.to(flat.dtype))
    return flat.view(result.shape)


def lora_linear_class() -> type | None:
    """PEFT's LoRA `Linear` (None without PEFT): the one layer class whose rows the runner splits."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # PEFT not installed: no adapter to split
        return None
    return Linear


def _make_forward(cls: type) -> Callable[[], Callable[..., torch.Tensor]]:
    def make() -> Callable[..., torch.Tensor]:
        original = cls.__dict__["forward"]

        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            step = ADAPTER_ROWS.get()
            if step is None or args or kwargs:
                return original(self, x, *args, **kwargs)
            groups = step.groups_for(self, x.numel() // x.shape[-1])
            return grouped_forward(self, x, groups, original)

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return forward

    return make


class AdapterRows:
    """The runner's part: PEFT's LoRA `Linear` splits its rows by adapter inside a step (a patch of the class,
    counted: `patches.patched`), installed at the first step of a run session that has requests on adapters
    (`step`: an adapter may be loaded while the session runs, `manager.adapters.load`) and removed when the
    session ends."""

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self._installed = False

    @contextmanager
    def session(self) -> Iterator[None]:
        with ExitStack() as stack:
            self._stack, self._installed = stack, False
            try:
                yield
            finally:
                self._stack, self._installed = None, False

    @contextmanager
    def step(self) -> Iterator[None]:
        """A step with requests on adapters: the class patch in force for the rest of the session (or, for a
        step outside a session, for the step)."""
        cls = lora_linear_class()
        if cls is None:
            raise InvariantError("a request on an adapter, without PEFT installed")
        if self._stack is None:
            with patched(PATCH_KIND, [(cls, "forward", _make_forward(cls))]):
                yield
            return
        if not self._installed:
            self._stack.enter_context(patched(PATCH_KIND, [(cls, "forward", _make_forward(cls))]))
            self._installed = True
        yield
