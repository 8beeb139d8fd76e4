"""Continuous batching for Hugging Face Transformers causal LMs. `import transformers_cb` installs it."""

from __future__ import annotations

from .import_noise import quiet_import_noise

quiet_import_noise()  # before anything imports transformers (and, through it, torchao)

from .config import ContinuousBatchingConfig
from .manager.delivery.results import ManagerDeadError, UnknownRequestError
from .manager.manager import ContinuousBatchingManager
from .manager.stats import ManagerStats
from .plugin import install, is_installed, uninstall
from .requests import GenerationOutput, RequestStatus
from .sampling.structured.guided import GuidedDecoding

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "GenerationOutput",
    "GuidedDecoding",
    "ManagerDeadError",
    "ManagerStats",
    "RequestStatus",
    "UnknownRequestError",
    "install",
    "is_installed",
    "uninstall",
]

install()
