"""`python -m conformance.coverage`: see the package docstring."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

# One intra-op thread per worker, set before torch is imported (the workers are forked from this process).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m conformance.coverage", description=__doc__)
    parser.add_argument("--types", help="comma list of model types (or `<type>:vlm` rows); default: all")
    parser.add_argument(
        "--subset", action="store_true", help="the fixed representative subset (catalog.SUBSET)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at a time (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per type for ours (default 120)"
    )
    parser.add_argument(
        "--builtin-timeout", type=float, default=60.0, help="seconds per type for the built-in (default 60)"
    )
    parser.add_argument("--no-builtin", action="store_true", help="skip the built-in peer column")
    parser.add_argument("--no-sharp", action="store_true", help="skip the sharp column (coverage/sharp.py)")
    parser.add_argument(
        "--sharp-factor",
        type=float,
        default=None,
        help="the sharp column's query / key scale (default tests/support/sharp.py's SHARP_FACTOR, 20)",
    )
    parser.add_argument(
        "--media",
        action="store_true",
        help="the media column: classes with an image encoder judged with images",
    )
    parser.add_argument("--json", type=Path, help="write the rows and counts as JSON")
    parser.add_argument("--markdown", type=Path, help="write the table (docs/models.md)")
    parser.add_argument("--verbose", action="store_true", help="let the workers print (logs, warnings)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # noqa: F401  (imported once here; every worker is forked from this process)
    import transformers

    import transformers_cb  # noqa: F401  (installs the plugin)

    from .catalog import SUBSET, all_entries, select
    from .outcome import failing
    from .pool import run_all
    from .report import markdown, summary_table, write_json
    from .sharp import SHARP_FACTOR

    transformers.logging.set_verbosity_error()
    # Everything imported so far is permanent: the workers' garbage collections (the built-in runs a full
    # one per call) skip it, and forked pages stay shared.
    gc.freeze()
    names = args.types.split(",") if args.types else (list(SUBSET) if args.subset else None)
    entries = select(all_entries(), names)

    def progress(done: int, total: int, row) -> None:
        theirs = "" if row.builtin is None else f"  [built-in: {row.builtin.state}]"
        theirs += "" if row.media is None else f"  [media: {row.media.state}]"
        theirs += "" if row.sharp is None else f"  [sharp: {row.sharp.state}]"
        reason = f"  {row.ours.reason[:160]}" if row.ours.reason else ""
        print(f"[{done}/{total}] {row.name}: {row.ours.state} {row.seconds:.1f}s{theirs}{reason}", flush=True)

    start = time.time()
    rows = run_all(
        entries,
        jobs=max(1, args.jobs),
        timeout=args.timeout,
        builtin_timeout=args.builtin_timeout,
        builtin=not args.no_builtin,
        quiet=not args.verbose,
        progress=progress,
        media=args.media,
        sharp=None if args.no_sharp else (args.sharp_factor or SHARP_FACTOR),
    )
    wall = time.time() - start
    print(f"\n{summary_table(rows)}\n\nwall: {wall:.0f} s")
    when = time.strftime("%Y-%m-%d")
    shown = list(argv if argv is not None else sys.argv[1:])
    for option in ("--markdown", "--json"):  # where the output went is not part of how it was made
        if option in shown:
            del shown[shown.index(option) : shown.index(option) + 2]
    shown_args = " ".join(a for a in shown if not a.startswith(("--markdown=", "--json=")))
    if args.markdown:
        args.markdown.write_text(markdown(rows, f" {shown_args}".rstrip(), when, wall))
    if args.json:
        write_json(
            args.json, rows, {"transformers": transformers.__version__, "date": when, "wall_s": round(wall)}
        )
    failed = [(r, column, o) for r in rows for column, o in failing(r)]
    for r, column, o in failed:
        print(f"FAIL {r.name} ({column}): {o.state}: {o.reason}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
