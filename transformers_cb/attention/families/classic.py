"""The classic families' attention through the paged cache: one adapter, a small table per family.

Bloom, MPT, Falcon, GPT-J, CodeGen, GPT-Neo, GPT-NeoX-Japanese, XGLM, OpenAI-GPT, GIT and BLIP's text decoder
(and the BART-style decoders of TrOCR and MVP, which the support check then refuses by their own position
numbering) compute attention inside their attention module (their own `_attn`, a cache they `update`
through `layer_past`) instead of calling transformers' attention interface, so a paged backend never sees
their K/V. For the run (`classic_attention`, entered with the paged backend and by the support check's
probe) each such module gets an instance `forward` that runs the module's own projections (and rotary, when
the family has one) from the family's table (attention/families/classic_families.py), hands query/key/value
`[1, H, T, D]` to the attention function it is given (a paged forward, or the probe's recorder) with the
layer's scaling, window and ALiBi slopes (`alibi_slopes`: the kernels add the bias, attention/families/alibi.py;
with `alibi_form` for a family of another form than the relative float32 one, Falcon's),
and finishes as the module does (output projection, Bloom's residual add). Nothing of the attention math
is copied per family: only where the family keeps its projections and how it shapes its heads.

Model-level code that reads what the paged step no longer has is patched too, for the run only (Bloom
builds its ALiBi tensor from a 2D padding mask; the step passes a 4D no-mask; Falcon's `use_alibi` flag):
`ClassicFamily.owner_patches`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

import torch

from ...patches import in_force, patched
from .alibi import RELATIVE
from .classic_families import FAMILIES, ClassicFamily

PATCH_KIND = "classic_attention"  # its counted patches (patches.py)


def _family_key(module: torch.nn.Module) -> str:
    """`modeling_<family>.<Class>` of a module (the table's key: a class name alone is ambiguous)."""
    return f"{type(module).__module__.rsplit('.', 1)[-1]}.{type(module).__qualname__}"


def classic_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ClassicFamily]]:
    """The model's attention modules that an adapter of this table runs, with their family."""
    return [
        (module, FAMILIES[_family_key(module)])
        for module in model.modules()
        if _family_key(module) in FAMILIES
    ]


def has_classic_attention(model: torch.nn.Module) -> bool:
    """Whether some attention module of `model` runs through a classic family's adapter."""
    return bool(classic_modules(model))


def _adapted_forward(
    module: Any, family: ClassicFamily, config: Any, attention: Callable[..., Any]
) -> Callable[..., Any]:
    device = next(module.parameters()).device
    slopes = None if family.slopes is None else family.slopes(module, config)
    scaling = family.scaling(module)
    window = family.window(module, config)
    extra: dict[str, Any] = {}
    if slopes is not None:
        extra["alibi_slopes"] = slopes.to(device)
        if family.alibi_form != RELATIVE:
            extra["alibi_form"] = family.alibi_form
    if window is not None:
        extra["sliding_window"] = window

    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        query, key, value = family.project(module, hidden, kwargs)
        out, _ = attention(module, query, key, value, None, scaling=scaling, dropout=0.0, **extra)
        return family.finish(module, out.reshape(*out.shape[:2], -1), args, kwargs)

    return forward


@contextmanager
def classic_attention(model: torch.nn.Module, attention: Callable[..., Any]) -> Iterator[None]:
    """Inside: each classic family's attention module of `model` attends through `attention` (an
    `AttentionInterface` function), and its owners' patches are set: counted patches (patches.py), shared
    by overlapping runs and removed by the last."""
    config = cast(Any, model).config.get_text_config()
    adapted = classic_modules(model)
    owner_patches = {patch for _, family in adapted for patch in family.owner_patches}
    planned: list[tuple[Any, str, Callable[[], Any]]] = []
    for index, (layer, family) in enumerate(adapted):
        module = cast(Any, layer)
        if getattr(module, "layer_idx", None) is None or in_force(PATCH_KIND, module, "layer_idx"):
            # OpenAI-GPT's modules have no index (GPT-Neo's call it `layer_id`): the paged forward reads
            # `layer_idx`, and the adapted modules come in layer order.
            planned.append((module, "layer_idx", partial(getattr, module, "layer_id", index)))
        planned.append((module, "forward", partial(_adapted_forward, module, family, config, attention)))
    for owner in model.modules():
        for owner_class, attribute, replacement in owner_patches:
            if type(owner).__name__ == owner_class:
                # An instance's own value (Falcon's `use_alibi` flag) comes back on exit; a method
                # shadowed here (Bloom's `build_alibi_tensor`) is unshadowed.
                planned.append((owner, attribute, partial(_same, replacement)))
    with patched(PATCH_KIND, planned):
        yield


def _same(value: Any) -> Any:
    return value
