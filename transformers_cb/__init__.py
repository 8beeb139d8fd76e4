"""Continuous batching for Hugging Face Transformers causal LMs. `import transformers_cb` installs it."""

from __future__ import annotations

from .config import ContinuousBatchingConfig
from .manager import ContinuousBatchingManager
from .plugin import install, is_installed, uninstall
from .requests import GenerationOutput, RequestStatus
from .results import ManagerDeadError, UnknownRequestError
from .stats import ManagerStats

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "GenerationOutput",
    "ManagerDeadError",
    "ManagerStats",
    "RequestStatus",
    "UnknownRequestError",
    "install",
    "is_installed",
    "uninstall",
]

install()
