"""``transformers-cb build-kernels``: build the native CPU paged-attention kernel ahead of use.

The Makefile's install targets run it after ``pip install -e``, so that the first request of ``make run``
/ ``make test`` loads a ready library. It exits 0 when the kernel cannot be built here (no compiler, a
failed compile) after one warning: the pure-torch kernels run instead. See docs/design.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXIT_OK = 0
EXIT_NOT_LOADED = 1


def add_build_kernels_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "build-kernels",
        help="build the native CPU paged-attention kernel ahead of use",
        description=(
            "Build the native CPU paged-attention kernel into its cache folder (keyed by the source, flags, "
            "torch build, Python ABI, compiler and CPU). Without a compiler it warns and exits 0: the "
            "pure-torch kernels run instead."
        ),
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for another process's build before building anyway (default: the build timeout)",
    )
    parser.add_argument(
        "--retry", action="store_true", help="build again even if an earlier build failed (drops failed.txt)"
    )
    parser.set_defaults(func=run_build_kernels)


def _warn(message: str) -> int:
    print(
        f"transformers-cb build-kernels: warning: {message}; the pure-torch kernels will run", file=sys.stderr
    )
    return EXIT_OK


def run_build_kernels(args: argparse.Namespace) -> int:
    from ..attention.native import kernel as native
    from ..attention.native.native_build import KernelUnavailable, build, kernel_folder

    if os.environ.get(native.ENV_SWITCH, "1") == "0":
        print(f"native kernel: switched off ({native.ENV_SWITCH}=0)")
        return EXIT_OK
    try:
        folder = kernel_folder()
    except KernelUnavailable as error:
        return _warn(f"native CPU paged-attention kernel unavailable ({error})")
    if folder.failure.exists() and not args.retry:
        return _warn(f"an earlier build failed (see {folder.failure}; --retry builds again)")
    folder.failure.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        outcome = build(folder, wait=True, timeout=args.timeout)
    except KernelUnavailable as error:
        return _warn(str(error))
    if native.native_module() is None:
        print(
            f"transformers-cb build-kernels: error: {folder.library} was built but does not load",
            file=sys.stderr,
        )
        return EXIT_NOT_LOADED
    seconds = time.monotonic() - start
    done = f"built in {seconds:.1f} s" if outcome == "built" else "ready"
    print(f"native kernel: {done}: {folder.library}")
    return EXIT_OK
