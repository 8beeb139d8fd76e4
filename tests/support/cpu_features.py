"""What this CPU offers the tests: oneDNN's bf16 products need AVX512-BW/VL/DQ or AVX-NE-CONVERT, which an
AVX2-only CPU (e.g. AMD Zen 3) lacks; there a bf16 weight is packed in float32 (`packed_linear.pack_dtype`), so
bf16 packs are refused only where even that fails its self-test, and the tests of bf16 packs then skip."""

from __future__ import annotations

import pytest
import torch

from transformers_cb.runner.products.packed_linear import cpu_lacks_support, self_test, unsupported_reason

BF16_PACKS_REFUSED = unsupported_reason(torch.bfloat16, "cpu") is None and cpu_lacks_support(
    self_test(torch.bfloat16)
)

needs_bf16_packs = pytest.mark.skipif(
    BF16_PACKS_REFUSED, reason="oneDNN has no bf16 packed products on this CPU (AVX2 only)"
)
