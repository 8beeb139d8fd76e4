"""`transformers serve --continuous-batching`: the plugin's latency vs transformers' built-in engine.

Usage: python benchmarks/transformers_serve_latency.py [--rounds 4]

Both servers (tests/support/serve_launcher.py, tiny model, 127.0.0.1) run at once, idle between their
rounds, and are measured in alternating rounds so that a load change on a shared machine hits both
alike. Per mode (chat / completion, streaming or not), the best of the rounds' mean latency of 8
concurrent requests. Prints a table; the target is the plugin within 2x of the built-in.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.transformers_serve import (  # noqa: E402  (after the path set-up)
    MODES,
    build_model_dir,
    run_concurrently,
    start_server,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per server")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = build_model_dir(tmp_path / "model")
        servers = {}
        try:
            for name, builtin in (("plugin", False), ("builtin", True)):
                servers[name] = start_server(model_dir, tmp_path / f"{name}.log", builtin=builtin)
            for server in servers.values():
                run_concurrently(server, "chat", False)  # first-request costs (CB manager start, warmup)
            best: dict[tuple[str, str, bool], float] = {}
            for round_index in range(args.rounds):
                order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
                for name in order:
                    for mode, stream in MODES:
                        results = run_concurrently(servers[name], mode, stream)
                        mean = sum(seconds for _, seconds in results) / len(results)
                        key = (name, mode, stream)
                        best[key] = min(best.get(key, float("inf")), mean)
        finally:
            for server in servers.values():
                server.stop()
    print("| mode | plugin ms | built-in ms | ratio |\n|---|---|---|---|")
    for mode, stream in MODES:
        ours, theirs = best[("plugin", mode, stream)], best[("builtin", mode, stream)]
        label = mode + (" stream" if stream else "")
        print(f"| {label} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {ours / theirs:.2f} |")
    ours_total = sum(best[("plugin", m, s)] for m, s in MODES)
    theirs_total = sum(best[("builtin", m, s)] for m, s in MODES)
    print(
        f"| all modes | {ours_total * 1e3:.1f} | {theirs_total * 1e3:.1f} | {ours_total / theirs_total:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
