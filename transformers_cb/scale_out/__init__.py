"""Beyond one machine: batch generation on Ray Data and OpenAI serving replicas on Ray Serve.

`predictor.py` (the callable class of `Dataset.map_batches`, one model and engine per actor) needs no Ray
itself; `batch_job.py` (`transformers-cb generate --ray`) and `serve_app.py` (`transformers-cb serve
--ray-replicas`, `build_app(...)`) do. Ray is the optional `ray` extra: this module imports nothing heavy,
so the CLI can name what is missing instead of failing with an import error. See docs/scale_out.md.
"""

from __future__ import annotations

import importlib.util

RAY_EXTRA_MODULES = ("ray", "ray.data", "ray.serve")
RAY_INSTALL_HINT = "pip install 'transformers-cb[ray]'"


def missing_ray_modules(modules: tuple[str, ...] = RAY_EXTRA_MODULES) -> list[str]:
    """Names of the `ray` extra's modules (of `modules`) that cannot be imported here."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package (`ray`) itself is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def require_ray_extra(what: str, modules: tuple[str, ...] = RAY_EXTRA_MODULES) -> None:
    """Raise `ImportError` naming `what` needs Ray, the missing modules and the install command."""
    missing = missing_ray_modules(modules)
    if missing:
        raise ImportError(
            f"{what} needs the optional 'ray' extra ({', '.join(missing)} not installed): {RAY_INSTALL_HINT}"
        )
