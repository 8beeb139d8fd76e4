"""Settings: the hardware side (`ContinuousBatchingConfig`), the model side (the table of
`GenerationConfig` fields) and transformers' own forms of both, converted into ours."""

from __future__ import annotations

from .continuous_batching import ContinuousBatchingConfig
from .interop import WorkloadHints, as_cb_config, as_workload_hints

__all__ = ["ContinuousBatchingConfig", "WorkloadHints", "as_cb_config", "as_workload_hints"]
