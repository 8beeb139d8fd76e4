"""The CUDA checks of issue 11 in one run (scripts/gpu_check.sh calls this after the CUDA-only tests).

For every paged backend that runs here (paged|sdpa, paged|eager, the real flash-attn 2 / 3 when they
import, and the flash glue through the test double of flash-attn when they do not), and each of
CUDA graphs off/on, async batching off/on (with graphs) and compile level 0/1: generate_batch on the
benchmarks' "small" model (random weights, greedy, no EOS) against plain generate() on the same model,
then a throughput table (tokens/s of each configuration on a mixed workload).

    python scripts/gpu_check.py [--dtype float32|bfloat16] [--requests 32] [--max-new-tokens 64]

fp32 (default) runs our kernels and the flash glue through the test double: they must match generate()
token for token. `--dtype bfloat16` runs the real flash-attn kernels that import (they take fp16/bf16
only): each row reports the share of requests identical to bf16 generate() (rounding may flip late
tokens), which is reported, not asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import common  # noqa: E402  (benchmarks/common.py: the benchmark models)

import transformers_cb  # noqa: E402,F401
from tests.support import flash_double  # noqa: E402
from transformers_cb import ContinuousBatchingConfig  # noqa: E402

FLASH = {"flash_attn": "paged|flash_attention_2", "flash_attn_interface": "paged|flash_attention_3"}


def backends(exact: bool) -> list[tuple[str, str, bool]]:
    """(label, attn_implementation, inject the test double). fp32 (`exact`): our kernels and the flash glue
    through the double (real flash-attn takes no fp32); bf16: the real flash kernels that import, and sdpa."""
    found = [("paged|sdpa", "paged|sdpa", False)]
    if exact:
        found.append(("paged|eager", "paged|eager", False))
        found += [(f"{name} (test double)", name, True) for name in FLASH.values()]
    else:
        found += [(name, name, False) for module, name in FLASH.items() if importlib.util.find_spec(module)]
    return found


def workload(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 300))] for _ in range(count)]


def reference(model, prompts, max_new_tokens) -> list[list[int]]:
    model.set_attn_implementation("sdpa")
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run the CPU suite instead)")
        return 1
    dtype = getattr(torch, args.dtype)
    model = common.build_model("small", dtype=dtype).cuda()
    prompts = workload(model.config.vocab_size, args.requests)
    expected = reference(model, prompts, args.max_new_tokens)
    generation_config = common.greedy_generation_config(args.max_new_tokens)
    configs = {
        "eager": {},
        "graphs": {"use_cuda_graph": True},
        "graphs+async": {"use_cuda_graph": True, "use_async_batching": True},
        "compile 1": {"default_compile_level": 1},
        "graphs+compile 1": {"use_cuda_graph": True, "default_compile_level": 1},
    }
    rows, failures = [], 0
    exact = dtype == torch.float32
    for label, name, double in backends(exact):
        for config_name, options in configs.items():
            config = ContinuousBatchingConfig(page_size=256, max_batch_tokens=512, **options)
            context = flash_double.injected(fa2=True, fa3=True, cpu=False) if double else _nothing()
            try:
                with context:
                    model.set_attn_implementation(name)
                    model.generate_batch(prompts[:2], generation_config, config, progress_bar=False)  # warm
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = model.generate_batch(prompts, generation_config, config, progress_bar=False)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 - reported in the table, the check goes on
                rows.append((label, config_name, "-", "-", f"ERROR {type(error).__name__}: {error}"[:160]))
                failures += 1
                continue
            finally:
                model.set_attn_implementation("sdpa")
            same = sum(out[f"req_{i}"].generated_tokens == e for i, e in enumerate(expected))
            tokens = sum(len(o.generated_tokens) for o in out.values())
            if exact and same != len(expected):
                failures += 1
            rows.append(
                (label, config_name, f"{wall:.2f}", f"{tokens / wall:.0f}", f"{same}/{len(expected)}")
            )
    print(f"\nmodel small ({common.param_count(model) / 1e6:.1f}M), {args.dtype}, {len(prompts)} requests, "
          f"{args.max_new_tokens} new tokens each, {torch.cuda.get_device_name()}")  # fmt: skip
    print("| backend | config | wall s | gen tok/s | identical to generate() |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
