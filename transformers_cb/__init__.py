"""Continuous batching for Hugging Face Transformers causal LMs. `import transformers_cb` installs it."""

from __future__ import annotations

from .config import ContinuousBatchingConfig
from .plugin import install, is_installed, uninstall
from .requests import GenerationOutput, RequestStatus

__all__ = [
    "ContinuousBatchingConfig",
    "GenerationOutput",
    "RequestStatus",
    "install",
    "is_installed",
    "uninstall",
]

install()
