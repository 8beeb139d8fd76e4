"""Import-time log lines of optional packages that say nothing on a CPU machine, dropped from the logs.

transformers imports torchao whenever it is installed (its quantizer registry), and torchao's binary wheel
(built for CUDA) then logs one "Failed to load .../_C_*.so" warning per CUDA extension it cannot load into
a CPU-only torch, and registers enums torch 2.13 no longer needs registered (one "... is an Enum subclass
and is now natively supported ..." warning each). Nothing is wrong and nothing can be done about it, yet
every command (`transformers-cb generate`, `serve`) would print them before its own output. Only those
exact records are dropped, and only while torch has no CUDA (on a CUDA torch a failed load is real news).
Installed first thing by `transformers_cb/__init__.py`, before anything imports transformers.
"""

from __future__ import annotations

import logging

# (logger, what a dropped record's message holds)
NOISE = (
    ("torchao", "Failed to load"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
)


class _DropNoise(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in str(record.msg)


def quiet_import_noise() -> None:
    """Drop the records of `NOISE` (once; a no-op where torch has CUDA)."""
    import torch

    if torch.version.cuda is not None:
        return
    for name, fragment in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(fragment))
