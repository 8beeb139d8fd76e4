"""oneDNN's two shape caches, bounded for a long-lived process (the server).

A packed product (packed_linear.py) runs a oneDNN primitive made for its exact shape, and every row
count is a new shape: a server's steps run every count from 1 to `max_batch_tokens`. Two caches keep
what each shape built, 1024 entries each by default: oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's, torch's oneDNN layer (`LRU_CACHE_CAPACITY`). Measured
on the real model's 576 x 1536 product (2 cores, Zen 4): about 0.45 MiB per new row count for the two
together, so a server's resident memory grew for the best part of an hour (+34 % in the hour's soak, then
flat at ~700 MiB more; docs/benchmarks.md, "An hour of traffic"). A step uses one entry per weight shape
(five or six on a decoder), so a capacity of `SERVER_CAPACITY` keeps the last twenty-odd step sizes; a
miss costs about 0.5 ms (the primitive is made again), against a step of tens of milliseconds.

Both libraries read their capacity once, when they first make a primitive: `bound_shape_caches` must run
before the process's first oneDNN product (the server calls it before loading the model). A capacity
the user set in the environment is kept.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CAPACITY_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
SERVER_CAPACITY = 128


def bound_shape_caches(capacity: int = SERVER_CAPACITY) -> dict[str, str]:
    """Give both caches `capacity` entries unless the environment already says; returns what is in force."""
    if capacity < 1:  # oneDNN crashes with an empty primitive cache (measured: a segmentation fault)
        raise ValueError(f"the oneDNN cache capacity must be at least 1, got {capacity}")
    for name in CAPACITY_ENVS:
        os.environ.setdefault(name, str(capacity))
    in_force = {name: os.environ[name] for name in CAPACITY_ENVS}
    logger.debug("oneDNN shape caches: %s", in_force)
    return in_force
