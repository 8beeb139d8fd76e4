"""`transformers serve` with the plugin: import `transformers_cb` first, then run transformers' own CLI.

    python tests/support/serve_launcher.py serve MODEL_DIR --continuous-batching --host 127.0.0.1 --port N ...

With `--builtin` as the first argument the plugin is not imported: transformers' built-in continuous
batching serves instead (the reference the latency test compares with).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--builtin":
        args = args[1:]
    else:
        import transformers_cb  # installs the plugin before transformers loads a model

        # The test checks this line: the plugin, not transformers' built-in, serves.
        print(
            f"transformers_cb plugin installed: {transformers_cb.is_installed()}", file=sys.stderr, flush=True
        )

    from transformers.cli.transformers import main

    sys.argv = ["transformers", *args]
    main()
