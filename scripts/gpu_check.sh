#!/usr/bin/env bash
# Issue 11's CUDA checks, on any CUDA machine, in a few minutes (see docs/fast_paths.md):
#   1. the CUDA-only tests (graph capture/replay, async batching) and the flash glue tests;
#   2. parity of every paged backend against generate() with graphs on/off, async on/off, compile
#      level 1, and a throughput table (scripts/gpu_check.py).
# Usage: scripts/gpu_check.sh [python]   (default: python). Exit status: non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for module in flash_attn flash_attn_interface kernels; do
  "$PY" -c "import $module" 2>/dev/null && echo "$module: installed" || echo "$module: not installed (the test double stands in)"
done
status=0
"$PY" -m pytest -q -p no:cacheprovider -rs tests/runner/test_cuda_graphs.py tests/attention/test_flash_backends.py tests/runner/test_compile.py tests/memory/test_host_tier.py || status=1
"$PY" scripts/gpu_check.py --dtype float32 || status=1
if "$PY" -c "import flash_attn" 2>/dev/null || "$PY" -c "import flash_attn_interface" 2>/dev/null; then
  "$PY" scripts/gpu_check.py --dtype bfloat16 || status=1   # real flash kernels take fp16/bf16 only
fi
exit $status
