"""`torch.compile` of the model's forward, one compiled callable per path.

A step is on the *decode* path when every query is a single token (`max_seqlen_q == 1`), else on the
*varlen* path. Each path gets a `CompileConfig`, by precedence:
1. `varlen_compile_config` / `decode_compile_config` (a dict or a `CompileConfig`);
2. `default_compile_level` (the documents' table):

   | level | mode                         | dynamic |
   |-------|------------------------------|---------|
   | 0     | no compile                   |         |
   | 1     | `default`                    | True    |
   | 2     | `max-autotune-no-cudagraphs` | True    |
   | 3     | `max-autotune-no-cudagraphs` | False   |

   except the varlen path of a flash backend (its `max_seqlen_k` changes every step and would
   recompile), as the documents say;
3. the generation config's `compile_config`, if any;
4. none.
With the torch backends on CPU, a step whose every token the native kernel attends (decodes, short
prefill chunks) is one graph: each layer's paged attention is a custom op (`attention/paged.py`) with a
fake implementation, so inductor takes the whole decoder forward. The torch backends' other steps run the
eager forward; the flash backends' attention stays out of the graphs (`torch.compiler.disable`), a graph
break per layer.

Shapes are dynamic (levels 1 and 2, traced without duck shapes and with sizes of 1 treated like any other
size; one-token steps run eagerly and the native kernel's block tables are at least two columns wide, the
two sizes of 1 that would still specialise), so after the first step of each path a new token count, row
count or block-table width compiles nothing new;
`PathForwards.graphs_compiled` counts the graphs compiled by this engine's steps (`ManagerStats`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import CompileConfig, GenerationConfig

from ...config.continuous_batching import ContinuousBatchingConfig

logger = logging.getLogger(__name__)

VARLEN, DECODE = "varlen", "decode"


def level_compile_config(level: int) -> CompileConfig | None:
    """The default `CompileConfig` of `default_compile_level` (None for 0)."""
    if level <= 0:
        return None
    mode = "max-autotune-no-cudagraphs" if level >= 2 else "default"
    # fullgraph=False: the paged attention calls are graph breaks by design.
    return CompileConfig(fullgraph=False, dynamic=level <= 2, mode=mode)


@dataclass(frozen=True)
class CompileSettings:
    varlen: CompileConfig | None = None
    decode: CompileConfig | None = None

    def for_path(self, path: str) -> CompileConfig | None:
        return self.decode if path == DECODE else self.varlen


def resolve_compile_settings(
    cb_config: ContinuousBatchingConfig, generation_config: GenerationConfig | None, is_flash: bool
) -> CompileSettings:
    fallback = getattr(generation_config, "compile_config", None) if generation_config is not None else None
    level = level_compile_config(cb_config.default_compile_level)

    def pick(explicit: CompileConfig | None, default: CompileConfig | None) -> CompileConfig | None:
        if explicit is not None:
            return explicit
        if cb_config.default_compile_level > 0:
            return default
        return fallback

    settings = CompileSettings(
        varlen=pick(cb_config.varlen_compile_config, None if is_flash else level),
        decode=pick(cb_config.decode_compile_config, level),
    )
    for path in (VARLEN, DECODE):
        chosen = settings.for_path(path)
        if chosen is not None:
            logger.info("continuous batching compiles the %s path with %s", path, chosen.to_dict())
    return settings


def compile_forward(forward: Callable, config: CompileConfig) -> Callable:
    """`torch.compile(forward)` with the fields of `config` that `torch.compile` takes."""
    return torch.compile(
        forward,
        fullgraph=config.fullgraph,
        dynamic=config.dynamic,
        backend=config.backend,
        mode=None if config.options else config.mode,  # torch.compile takes one of the two
        options=config.options,
    )


# Compiled forwards per model and config, shared by every engine built on the model: each
# `generate_batch` call builds an engine, and a new `torch.compile` wrapper would compile again.
_compiled_by_model: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Callable]] = (
    weakref.WeakKeyDictionary()
)


def _config_key(config: CompileConfig) -> tuple:
    return (config.fullgraph, config.dynamic, config.backend, config.mode, repr(config.options))


def compiled_forward(model: torch.nn.Module, config: CompileConfig) -> Callable:
    """`model.forward` compiled with `config`, built once per model and config."""
    cache = _compiled_by_model.setdefault(model, {})
    key = _config_key(config)
    if key not in cache:
        cache[key] = compile_forward(model.forward, config)
    return cache[key]


def _graphs_compiled_in_process() -> int:
    """Graphs dynamo has compiled in this process (torch's own counter, read before and after a call)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class PathForwards:
    """The model's forward for each path: compiled lazily on the path's first step (or plain).

    `graphs_compiled`: graphs compiled (first compiles and recompiles) during this object's calls."""

    def __init__(self, model: torch.nn.Module, settings: CompileSettings) -> None:
        self._model = model
        self._forward = model.forward
        self._settings = settings
        self._compiled: dict[str, Callable] = {}
        self.graphs_compiled = 0

    @property
    def settings(self) -> CompileSettings:
        return self._settings

    @property
    def eager(self) -> Callable:
        """The model's own forward, as every step runs it that is not compiled."""
        return self._forward

    @property
    def compiled_paths(self) -> list[str]:
        """The paths whose compiled forward has run (compiled on first use)."""
        return list(self._compiled)

    def __call__(self, path: str, num_tokens: int = 2, traceable: bool = True) -> Callable:
        """The forward of a step on `path` with `num_tokens` tokens; `traceable`: its attention compiles (or
        is a clean break, as the flash backends' is).

        Eager instead: a one-token step (compiled, it would need a graph of its own, as torch.compile
        specialises sizes of 1, for a rare and short step: the last running request's decodes), and a step
        whose attention is not traceable (the torch backends' mixed steps: their break would sit inside
        the attention function, where dynamo compiles one frame per layer up to its recompile limit)."""
        config = self._settings.for_path(path)
        if config is None or num_tokens == 1 or not traceable:
            return self._forward
        if path not in self._compiled:
            self._compiled[path] = self._counted(compiled_forward(self._model, config))
        return self._compiled[path]

    def _counted(self, compiled: Callable) -> Callable:
        def run(*args, **kwargs):
            before = _graphs_compiled_in_process()
            # Sizes that happen to be equal (or 1) in the first step are not guarded as such: a later step
            # with other sizes reuses the graph instead of recompiling.
            # `patch` is added to the config module at import time (`install_config_module`), which the stubs
            # cannot see.
            patch = torch.fx.experimental._config.patch  # type: ignore[attr-defined]
            with patch(backed_size_oblivious=True, use_duck_shape=False):
                try:
                    return compiled(*args, **kwargs)
                finally:
                    self.graphs_compiled += _graphs_compiled_in_process() - before

        return run
