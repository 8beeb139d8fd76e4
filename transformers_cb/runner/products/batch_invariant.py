"""Batch-invariant products and activations for the run (`ContinuousBatchingConfig.batch_invariant`).

A row's result must not depend on which other rows share its step, nor on how its prompt was chunked. The
step's attention already meets that on the native kernel (attention/native/native_source.py: each token's keys
are reduced in an order fixed by its own position, whatever the step holds), where the packer sends every
token in this mode (`BatchPacker.every_chunk_native`). Two parts of a plain forward do not:

- a Linear's (or transformers' `Conv1D`'s) product picks its kernel and blocking by the row count M (MKL's
  sgemv at M = 1, its sgemm panels, oneDNN's bf16 kernels: measured, a row's fp32 output changes with M),
  so here every product runs
  as calls of exactly `INVARIANT_ROWS` rows (the rows copied into a fresh zero-padded buffer, so each call
  sees the same shape and alignment); the kernel, its blocking and a row's reduction order are then the
  same in every step;
- torch's elementwise kernels take their vector loop in steps of two vectors and the scalar lambda for the
  flat tensor's tail (and for the tail of each thread's span), and the two round SiLU / GELU differently
  (measured: 85 of 2000 float32 SiLUs differ by an ulp), so which path an element takes depends on how many
  rows precede it. Here an activation module runs on rows padded to a multiple of `ACTIVATION_WIDTH`
  elements, in blocks under torch's parallel grain: every element takes the vector loop on one thread.

Installed for the run through counted patches (patches.py, kind `batch_invariant`), on
every plain `nn.Linear` and `Conv1D` and every parameter-free activation module of torch's or
transformers'; the rest of a decoder layer is per row already (RMSNorm's row sum is torch's fixed per-row
cascade; rotary and residual adds are exact products and sums). docs/config.md, "Batch-invariant mode",
says what is covered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from ...patches import in_force, patched

PATCH_KIND = "batch_invariant"
# Rows of every product call: measured on this project's CPU the fastest of 16 / 32 / 64 for a prefill
# (16-row calls of a 1536x576 float32 weight: 2.5x one 512-row call; a one-row decode: 3x its sgemv).
INVARIANT_ROWS = 16
# An activation row is padded to a multiple of this many elements: two AVX-512 vectors of bfloat16, the
# widest unroll of torch's vector loop, so no element of a row reaches the scalar tail.
ACTIVATION_WIDTH = 64
# Elements per activation call: torch's parallel grain (`at::internal::GRAIN_SIZE`), under which its
# elementwise kernels stay on one thread (a thread's span could end mid-row).
ACTIVATION_BLOCK = 32768
ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as calls of exactly `INVARIANT_ROWS` rows: each row's output is the same
    bits whatever the other rows are and however many there are."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padded = -(-count // INVARIANT_ROWS) * INVARIANT_ROWS
    buffer = rows.new_zeros(max(padded, INVARIANT_ROWS), rows.shape[1])
    buffer[:count] = rows
    out = torch.cat(
        [
            F.linear(buffer[i : i + INVARIANT_ROWS], weight, bias)
            for i in range(0, buffer.shape[0], INVARIANT_ROWS)
        ]
    )
    return out[:count].reshape(*x.shape[:-1], weight.shape[0])


def invariant_elementwise(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`function(x)` of an elementwise `function`, each last-dimension row padded to a multiple of
    `ACTIVATION_WIDTH` and run in blocks under `ACTIVATION_BLOCK` elements: every element on the vector
    path, on one thread, whatever the rows around it."""
    if x.dim() == 0 or x.numel() == 0:
        return function(x)
    rows = x.reshape(-1, x.shape[-1])
    width = rows.shape[1]
    padded_width = -(-width // ACTIVATION_WIDTH) * ACTIVATION_WIDTH
    per_block = max(1, ACTIVATION_BLOCK // padded_width)
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[0], per_block):
        block = rows[start : start + per_block]
        buffer = block.new_zeros(block.shape[0], padded_width)
        buffer[:, :width] = block
        out[start : start + block.shape[0]] = function(buffer)[:, :width]
    return out.reshape(x.shape)


def _free(module: nn.Module) -> bool:
    """No forward of its own on the instance (an accelerate hook's, another kind of run's), or this kind's
    of an overlapping run (then shared, counted)."""
    return "forward" not in module.__dict__ or in_force(PATCH_KIND, module, "forward")


def is_invariant_linear(module: nn.Module) -> bool:
    """A plain dense `nn.Linear` with an ordinary weight and no forward of its own on the instance."""
    return (
        type(module) is nn.Linear
        and _free(module)
        and not hasattr(module, "_hf_hook")
        and type(module.weight.data) is torch.Tensor
    )


def is_invariant_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2 and kin: a Linear with its weight stored `[in, out]`), not a subclass."""
    return type(module) is Conv1D and _free(module) and type(module.weight.data) is torch.Tensor


def is_activation(module: nn.Module) -> bool:
    """A parameter-free activation module of torch's or transformers' (elementwise by definition)."""
    return (
        type(module).__module__ in ACTIVATION_MODULES
        and _free(module)
        and next(module.parameters(recurse=False), None) is None
        and not list(module.children())
    )


def _linear_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != module.weight.dtype or x.device.type != "cpu":
            return F.linear(x, module.weight, module.bias)  # training, or a cast the module would fail
        return invariant_linear(x, module.weight, module.bias)

    return forward


def _conv1d_forward(module: Conv1D) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != module.weight.dtype or x.device.type != "cpu":
            return plain(x)
        return invariant_linear(x, module.weight.t(), module.bias)

    return forward


def _activation_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return plain(x)
        return invariant_elementwise(plain, x)

    return forward


@contextmanager
def batch_invariant_modules(model: nn.Module, enabled: bool) -> Iterator[int]:
    """Inside (with `enabled`): `model`'s plain Linears run `invariant_linear` and its activation modules
    `invariant_elementwise`. Yields how many modules were patched."""
    if not enabled:
        yield 0
        return
    patches = []
    for module in model.modules():
        if is_invariant_linear(module):
            patches.append((module, "forward", lambda m=module: _linear_forward(m)))
        elif is_invariant_conv1d(module):
            patches.append((module, "forward", lambda m=module: _conv1d_forward(m)))
        elif is_activation(module):
            patches.append((module, "forward", lambda m=module: _activation_forward(m)))
    with patched(PATCH_KIND, patches) as count:
        yield count
