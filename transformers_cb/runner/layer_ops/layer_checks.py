"""The native decoder-layer ops checked at first sight: each recognised class (and modeling file's rotary) is
run once per dtype on a seeded random input through its own forward and through the native op, and kept on
the native op only when the two are bitwise equal (`Verdicts`, `VERDICTS`); a class that differs keeps
transformers' forward, with one warning (runner/layer_ops/native_layers.py asks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from .layer_forms import Forward, child, norm_eps, norm_form, weight_of

logger = logging.getLogger(__name__)


@dataclass
class Verdicts:
    """Whether each recognised (kind, class or modeling file, dtype) computed bitwise what its own forward computes."""

    results: dict[tuple[str, str, torch.dtype], bool] = field(default_factory=dict)
    warned: set[tuple[str, str]] = field(default_factory=set)

    def check(self, kind: str, name: str, dtype: torch.dtype, trial: Callable[[], bool]) -> bool:
        """`trial()`'s verdict for (kind, name, dtype), tried once; a False one warns once per (kind, name)."""
        key = (kind, name, dtype)
        if key not in self.results:
            try:
                self.results[key] = bool(trial())
            except Exception as error:  # noqa: BLE001 - a failing trial only keeps the module's forward
                logger.debug("native %s check of %s failed: %s", kind, name, error)
                self.results[key] = False
            if not self.results[key] and (kind, name) not in self.warned:
                self.warned.add((kind, name))
                logger.warning(
                    "transformers_cb: the native %s op differs from %s's own forward in %s; that module "
                    "keeps transformers' forward (slower, outputs unchanged)",
                    kind,
                    name,
                    dtype,
                )
        return self.results[key]


VERDICTS = Verdicts()


def _trial_input(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 2).to(dtype)


def norm_agrees(module: nn.Module, ops: ModuleType, dtype: torch.dtype) -> bool:
    width = weight_of(module).shape[0]
    x = _trial_input(5, width, dtype=dtype, seed=0)
    residual = _trial_input(5, width, dtype=dtype, seed=1)
    weight = weight_of(module).detach().contiguous()
    original = type(module).forward.__get__(module)
    gemma = norm_form(module) == "gemma"
    out = torch.empty_like(x)
    ops.rms_norm(x, weight, norm_eps(module), gemma, out)
    summed, normed = torch.empty_like(x), torch.empty_like(x)
    ops.add_rms_norm(residual, x, weight, norm_eps(module), gemma, summed, normed)
    expected_sum = residual + x
    return (
        torch.equal(out, original(x))
        and torch.equal(summed, expected_sum)
        and torch.equal(normed, original(expected_sum))
    )


def silu_agrees(module: nn.Module, ops: ModuleType, dtype: torch.dtype) -> bool:
    for shape in ((3, 37), (2, 4, 64)):
        gate = _trial_input(*shape, dtype=dtype, seed=2)
        up = _trial_input(*shape, dtype=dtype, seed=3)
        out = torch.empty_like(gate)
        ops.silu_mul(gate, up, out)
        if not torch.equal(out, child(module, "act_fn")(gate) * up):
            return False
    return True


def rotary_agrees(original: Forward, ops: ModuleType, dtype: torch.dtype) -> bool:
    q = _trial_input(1, 3, 5, 8, dtype=dtype, seed=4)
    k = _trial_input(1, 1, 5, 8, dtype=dtype, seed=5)
    cos = _trial_input(1, 5, 8, dtype=dtype, seed=6)
    sin = _trial_input(1, 5, 8, dtype=dtype, seed=7)
    expected_q, expected_k = original(q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    ops.rotary(q, cos, sin, q_out)
    ops.rotary(k, cos, sin, k_out)
    return torch.equal(q_out, expected_q) and torch.equal(k_out, expected_k)
