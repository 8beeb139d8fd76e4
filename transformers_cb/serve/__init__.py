"""`transformers-cb serve`: an OpenAI-compatible HTTP server on `ContinuousBatchingManager`.

The HTTP stack (FastAPI/Starlette + uvicorn) is the optional `serve` extra:
`pip install 'transformers-cb[serve]'`. This module imports nothing heavy, so
the CLI can explain what is missing instead of failing with an import error.
See docs/serve.md.
"""

from __future__ import annotations

import importlib.util

SERVE_EXTRA_MODULES = ("fastapi", "starlette", "uvicorn")
INSTALL_HINT = "pip install 'transformers-cb[serve]'"


def missing_serve_modules() -> list[str]:
    """Names of the `serve` extra's modules that cannot be imported here."""
    return [name for name in SERVE_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def require_serve_extra() -> None:
    """Raise `ImportError` naming the missing modules and the install command."""
    missing = missing_serve_modules()
    if missing:
        raise ImportError(
            f"transformers-cb serve needs the optional 'serve' extra ({', '.join(missing)} not installed): "
            f"{INSTALL_HINT}"
        )
