"""Packed oneDNN matrix products on CPU: the `transformers_cb::packed_linear` op and its registry of packs.

Plain `F.linear` on CPU goes through MKL, which takes a generic path without AVX-512 on AMD CPUs; oneDNN
with the weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) runs
the same product 1.3-3x faster (issue 29, vLLM's `dispatch_cpu_unquantized_gemm` does the same).

A packed weight is an opaque oneDNN tensor that cannot be a graph input under `torch.compile`
(inductor's `LoweringException`), so the op takes the plain weight and an integer handle into
`PACKS` (vLLM's design): the graph sees only ordinary tensors, the op looks its pack up at run time.

Never stale: each call compares the weight's `WeightKey` (version counter, data pointer, dtype, shape,
strides) with the one its pack was built from and repacks when they differ, so an optimizer step,
`load_state_dict` or any in-place write under `no_grad` is seen before the next product. A write through
`.data` does not bump the version counter (torch keeps it from autograd on purpose), and a new tensor put
in place may get the freed one's address with the same count: at the start of each run the packs of the
model compare a sample of their weights' values and whether their source storages still live
(`PackRegistry.check_sources`), so such writes between runs are seen too (TRL's GRPO trainer writes the
trained adapter that way). Within a run (a manager's session) callers that write weights that way say so
(`weights_updated()`, which drops the packs: `packed_model.release_packs`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from ...memory.weight_key import WeightKey, spread_indices
from .small_rows import rows_module, rows_product

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its kernel by the row count; one pack serves every row count, the hint only tunes it.
BATCH_SIZE_HINT = 16
X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
# The start-up self-test's tolerance against `F.linear`: fp32 differs by ~5e-6 relative (other
# summation order), bf16 by its rounding at most.
SELF_TEST_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
# `TRANSFORMERS_CB_PACKED_LINEAR`: "auto" (unset: the measured rule below), "all" (every eligible Linear
# at every row count: certification runs of the suite), "0" / "off" (no packed product, whatever the
# config says).
RULE_ENV = "TRANSFORMERS_CB_PACKED_LINEAR"
# `TRANSFORMERS_CB_FUSED_PRODUCTS=0`: packed products stay one per Linear (runner/products/fused_products.py).
FUSED_ENV = "TRANSFORMERS_CB_FUSED_PRODUCTS"
NEVER = 1 << 62  # a row count no product reaches


@dataclass(frozen=True)
class PackRule:
    """From how many rows a product runs packed, by the weight's dtype and size (`min_rows`).

    Measured on an AMD EPYC Zen 4 (2 cores; `docs/design.md`, "Packed products"): one oneDNN call costs
    ~18 us however small the product (its primitive lookup), against ~4 us for MKL's `F.linear` in fp32.
    In bf16 `F.linear` goes through oneDNN too, without the packed layout: the packed call is faster at
    every size and row count measured (1.1-2.4x). In fp32 MKL's small products win below ~16 rows and
    for weights under 2^18 elements (the tiny model's 128x512 layers ran slower packed); above, packing
    wins 1.2-2.5x from 16 rows (from 4 rows for a LM head of 2^22 elements or more). Where the native float32
    small-row product runs (runner/products/small_rows.py: 1.2-1.6x MKL's and oneDNN's at 1-32 rows on these
    sizes) those weights are packed from the first row: up to 32 rows take it, more oneDNN's packed call."""

    every_weight: bool = False  # "all": pack every eligible weight from the first row

    def min_rows(self, weight: torch.Tensor) -> int:
        return self.min_rows_of(weight.dtype, weight.numel())

    def min_rows_of(self, dtype: torch.dtype, numel: int) -> int:
        """For a weight of `numel` elements (a fused group's: its members' together)."""
        if self.every_weight or dtype == torch.bfloat16:
            return 1
        if numel >= 1 << 18 and rows_module(torch.float32) is not None:
            return 1
        if numel >= 1 << 22:
            return 4
        if numel >= 1 << 18:
            return 16
        return NEVER


def fusion_from_env() -> bool:
    """Whether sibling products are fused (`TRANSFORMERS_CB_FUSED_PRODUCTS`, on unless 0 / off)."""
    return os.environ.get(FUSED_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def rule_from_env() -> PackRule | None:
    """The rule `TRANSFORMERS_CB_PACKED_LINEAR` asks for; None when it turns packed products off."""
    value = os.environ.get(RULE_ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return None
    if value == "all":
        return PackRule(every_weight=True)
    if value not in ("", "auto", "1", "on", "true", "yes"):
        logger.warning("%s=%r is not one of auto, all, off: the measured rule applies", RULE_ENV, value)
    return PackRule()


@dataclass
class Pack:
    key: WeightKey | tuple[WeightKey, ...]
    packed: torch.Tensor
    bias: torch.Tensor | None = None  # a fused pack's concatenated bias
    # What `PackRegistry.check_sources` compares at the start of each run (not at each product: no cost per
    # step). Weak references to the storages it was built from: a tensor put in place of the weight
    # (`param.data = t`, `load_state_dict(assign=True)`) may get the freed storage's address and the same
    # version count, so the key alone would match; a freed source storage expires the pack (a weak reference
    # keeps the storage's control block, never its data). And a sample of the values: a write through
    # `.data` (an optimizer or a trainer's wrapper writing that way: TRL's GRPO in bf16) bumps no version.
    sources: tuple[StorageWeakRef, ...] = ()
    sample: tuple[torch.Tensor, ...] = ()
    # The weight in the small-row product's layout, made from `packed` the first time it serves a few bf16
    # rows (runner/products/small_rows.py), and the most rows it serves (None: not decided yet).
    rows_pack: torch.Tensor | None = None
    row_limit: int | None = None

    @property
    def nbytes(self) -> int:
        extra = self.rows_pack
        own = self.packed.numel() * self.packed.element_size()
        return own + (0 if extra is None else extra.numel() * extra.element_size())


def _key_of_many(tensors: tuple[torch.Tensor | None, ...]) -> tuple[WeightKey, ...]:
    return tuple(WeightKey.of(t) for t in tensors if t is not None)


def _sources(tensors: tuple[torch.Tensor | None, ...]) -> tuple[StorageWeakRef, ...]:
    return tuple(StorageWeakRef(t.untyped_storage()) for t in tensors if t is not None)


# Values compared per source tensor at each run's start: spread evenly over the tensor. An optimizer step or a
# dtype round trip moves (nearly) every value; a write to a few values through `.data` may be missed, and is
# to be announced (`weights_updated()`, `release_packs`), as documented.
SAMPLE_SIZE = 64


def content_sample(tensors: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
    """A copy of `SAMPLE_SIZE` values of each tensor (at evenly spaced flat indices; no copy of the tensor)."""
    samples = []
    for tensor in tensors:
        if tensor is None:
            continue
        numel = tensor.numel()
        indices = spread_indices(numel, SAMPLE_SIZE, tensor.device)
        samples.append(torch.take(tensor.detach(), indices).clone())
    return tuple(samples)


class PackRegistry:
    """Handle -> the packed copy of one Linear's weight, built on first use and rebuilt when stale."""

    def __init__(self) -> None:
        self._packs: dict[int, Pack | None] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self.builds = 0  # packs built so far (first use and rebuilds): tests and stats read it

    def new_handle(self) -> int:
        with self._lock:
            handle = next(self._handles)
            self._packs[handle] = None
        return handle

    def drop(self, handle: int) -> None:
        """Forget the handle and free its pack."""
        with self._lock:
            self._packs.pop(handle, None)

    def holds(self, handle: int, pack: Pack) -> bool:
        """Whether `pack` is still the handle's (not rebuilt, released or dropped since)."""
        return self._packs.get(handle) is pack

    def invalidate(self, handle: int) -> None:
        """Free the handle's pack; the next product rebuilds it."""
        with self._lock:
            if handle in self._packs:
                self._packs[handle] = None

    def check_sources(self, handle: int, tensors: tuple[torch.Tensor | None, ...]) -> bool:
        """Free the handle's pack if `tensors` (what it was built from) were replaced or rewritten in a way
        their keys do not show (`Pack.sources`, `Pack.sample`); returns whether it did. At a run's start."""
        pack = self._packs.get(handle)
        if pack is None:
            return False
        replaced = any(source.expired() for source in pack.sources)
        sample = pack.sample
        if replaced or len(sample) != sum(t is not None for t in tensors):
            stale = True
        else:
            stale = not all(torch.equal(a, b) for a, b in zip(sample, content_sample(tensors), strict=True))
        if stale:
            self.invalidate(handle)
        return stale

    def packed_bytes(self, handles: list[int] | None = None) -> int:
        """Bytes of the packs held (of `handles` only, when given)."""
        with self._lock:
            packs = list(self._packs.values()) if handles is None else [self._packs.get(h) for h in handles]
        return sum(p.nbytes for p in packs if p is not None)

    def has_pack(self, handle: int) -> bool:
        return self._packs.get(handle) is not None

    def current(self, handle: int, weight: torch.Tensor) -> Pack:
        """The pack of `weight` under `handle`, rebuilt first if the weight changed since it was built."""
        key = WeightKey.of(weight)
        return self._current(
            handle,
            key,
            lambda: Pack(key, reorder(weight.detach()), None, _sources((weight,)), content_sample((weight,))),
        )

    def current_fused(
        self, handle: int, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
    ) -> Pack:
        """The pack of `weights` concatenated along their outputs (a fused q/k/v or gate/up product,
        `runner/products/fused_products.py`), with the biases concatenated (None when they are); rebuilt when any
        weight or bias changed since it was built."""
        key = _key_of_many(weights + biases)

        def build() -> Pack:
            fused = torch.cat([w.detach() for w in weights])
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
            sources = weights + biases
            return Pack(key, reorder(fused), bias, _sources(sources), content_sample(sources))

        return self._current(handle, key, build)

    def _current(
        self, handle: int, key: WeightKey | tuple[WeightKey, ...], build: Callable[[], Pack]
    ) -> Pack:
        pack = self._packs.get(handle)
        if pack is not None and pack.key == key:
            return pack
        pack = build()
        with self._lock:
            if handle in self._packs:  # a dropped handle stays dropped
                self._packs[handle] = pack
            self.builds += 1
        return pack


@functools.cache
def _onednn_refuses_bf16() -> bool:
    """Whether this CPU's oneDNN refuses bf16 weights ("bf16 path needs the cpu support avx_ne_convert or
    avx512bw, avx512vl and avx512dq": an AVX2-only CPU such as AMD Zen 3)."""
    if unsupported_reason(torch.float32, "cpu") is not None:
        return False
    try:
        with torch.inference_mode(False), torch.no_grad():
            torch.ops.mkldnn._reorder_linear_weight(
                torch.zeros(16, 16, dtype=torch.bfloat16), BATCH_SIZE_HINT
            )
    except RuntimeError as error:
        return cpu_lacks_support(str(error))
    return False


def pack_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of `dtype` is packed in: float32 for bf16 where oneDNN refuses bf16 (its products
    then widen the rows, sum in float32 and round once to bf16, as oneDNN's bf16 product rounds; torch's own
    bf16 product on such a CPU is a generic loop ~7x slower than the float32 one)."""
    return torch.float32 if dtype == torch.bfloat16 and _onednn_refuses_bf16() else dtype


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout (one pack serves every row count), in `pack_dtype`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(pack_dtype(weight.dtype)), BATCH_SIZE_HINT)


def pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` on a packed `W` (oneDNN's product)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def product(x: torch.Tensor, pack: Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` on `pack`: a few rows through the native small-row product where it applies
    (runner/products/small_rows.py), else oneDNN's. A bf16 weight packed in float32 (`pack_dtype`) takes
    the float32 product on the widened rows, rounded once to bf16."""
    if x.dtype == torch.bfloat16 and pack.packed.dtype == torch.float32:
        wide_bias = None if bias is None else bias.float()
        return product(x.float(), pack, wide_bias).to(torch.bfloat16)
    out = rows_product(x, pack, bias)
    return pointwise(x, pack.packed, bias) if out is None else out


PACKS = PackRegistry()


@torch.library.custom_op("transformers_cb::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the oneDNN pack of `weight` registered under `handle`."""
    return packed_linear_eager(x, weight, bias, handle)


def packed_linear_eager(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int
) -> torch.Tensor:
    """`packed_linear` without the custom op's dispatch (~8 us a call, 200 calls a step on a 30-layer
    model): what an eager forward calls; a compiled one calls the op, which inductor can place."""
    if weight.is_inference():
        # An inference tensor has no version counter: an in-place write to it could not be seen.
        return F.linear(x, weight, bias)
    return product(x, PACKS.current(handle, weight), bias)


@packed_linear.register_fake
def _packed_linear_fake(x, weight, bias, handle):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def unsupported_reason(dtype: torch.dtype, device_type: str) -> str | None:
    """Why packed products cannot run for a model of `dtype` on `device_type`, or None."""
    if device_type != "cpu":
        return f"the model is on {device_type!r} (packed products are CPU only)"
    if dtype not in PACKED_DTYPES:
        return f"the model's dtype is {dtype} (float32 and bfloat16 only)"
    if platform.machine().lower() not in X86_MACHINES:
        return f"the CPU is {platform.machine()!r} (x86 only)"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    return None


def self_test(dtype: torch.dtype) -> str | None:
    """Run the op against `F.linear` on random products (1, 5 and 16 rows, with and without bias); a
    description of the first failure, or None when every result is within tolerance."""
    # Plain tensors even when the caller is in inference mode: an inference weight takes `F.linear`
    # (packed_linear_eager), and the test then passed on CPUs whose oneDNN refuses the dtype.
    with torch.inference_mode(False), torch.no_grad():
        return _self_test(dtype)


def _self_test(dtype: torch.dtype) -> str | None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=generator).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype)
    handle = PACKS.new_handle()
    rtol, atol = SELF_TEST_TOLERANCE[dtype]
    try:
        for rows in (1, 5, 16):
            x = torch.randn(1, rows, 40, generator=generator).to(dtype)
            for b in (bias, None):
                got, want = packed_linear(x, weight, b, handle), F.linear(x, weight, b)
                if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol, atol):
                    return f"self-test: {rows} rows differ from F.linear by {(got - want).abs().max()}"
    except (RuntimeError, NotImplementedError) as error:
        return f"self-test raised {type(error).__name__}: {error}"
    finally:
        PACKS.drop(handle)
    return None


def cpu_lacks_support(error: str) -> bool:
    """Whether oneDNN's error says this CPU lacks the instructions for a dtype (e.g. "bf16 path needs the cpu
    support avx_ne_convert or avx512bw, avx512vl and avx512dq")."""
    return "needs the cpu support" in error


_verdicts: dict[torch.dtype, str | None] = {}
_warned = False
_verdict_lock = threading.Lock()


def packed_linear_available(dtype: torch.dtype, device_type: str, asked: bool = True) -> bool:
    """Whether packed products run for this dtype and device (the self-test once per dtype per process);
    when not, one warning per process says why and the plain products run. `asked=False` (the default
    `packed_linear=None`): a platform that has no packed products (not x86, no oneDNN, CUDA, fp16) is
    silently plain; only a failed self-test warns."""
    with _verdict_lock:
        reason = unsupported_reason(dtype, device_type)
        if reason is None:
            if dtype not in _verdicts:
                _verdicts[dtype] = self_test(dtype)
            reason = _verdicts[dtype]
            asked = True  # the platform has them: a failed self-test is worth a warning either way
        if reason is not None and asked:
            warn_once(f"plain products run instead of packed oneDNN ones: {reason}")
        return reason is None


def warn_once(message: str) -> None:
    """The one packed-products warning of the process (`packed_linear_available`, the memory check)."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning("packed_linear: %s", message)


def reset_verdicts() -> None:
    """Forget the self-tests' verdicts and the warning (tests)."""
    global _warned
    with _verdict_lock:
        _verdicts.clear()
        _warned = False
