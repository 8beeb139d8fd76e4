"""The scheduling policies on a burst, without the noise of a shared machine: the real `Scheduler` (no model)
over a burst's prompt lengths, each step costed by a model measured on the real model.

    python benchmarks/burst_policy.py                              # SmolLM2 at 1 thread (the defaults below)
    python benchmarks/burst_policy.py --fixed-ms 56 --token-ms 2.25 --splits 2,3,4,6

A step costs `--fixed-ms` (reading the weights: the real model's 1-row decode step, 58 ms at 1 thread) plus
`--token-ms` per token it runs (prefill or decode alike on the CPU: 827 prompt tokens took 1917 ms, a 50-row
decode step 185 ms). Bursts: `n` requests at once, half chats (33 prompt tokens, the first to stream: the
TTFT column counts them, as `serve_load.py` does) and half completions (14), or prompts of 10-300 tokens
(seeded); 32 new tokens each, 16-token pages, 728 pages (the server's CPU default). It prints, per burst, the
wall time and the median TTFT of `fifo` and of `decode_first` at each `SPLIT`: the measurement behind
`DecodeFirstPolicy.SPLIT` (docs/benchmarks.md, "The server under a burst").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.fakes import FakeModel  # noqa: E402
from tests.support.requests import make_request  # noqa: E402
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec  # noqa: E402
from transformers_cb.kv.page_manager import PageManager  # noqa: E402
from transformers_cb.kv.page_policies import FullAttentionPolicy  # noqa: E402
from transformers_cb.kv.pool import PagePool  # noqa: E402
from transformers_cb.scheduler.policies import DecodeFirstPolicy, SchedulingPolicy, make_policy  # noqa: E402
from transformers_cb.scheduler.scheduler import Scheduler  # noqa: E402
from transformers_cb.scheduler.scheduler_settings import SchedulerSettings  # noqa: E402


def run(policy: SchedulingPolicy, lengths: list[int], fixed_s: float, token_s: float) -> tuple[float, float]:
    """(wall s, median TTFT s of the even-numbered requests) of one burst under `policy`."""
    pages = PageManager([FullAttentionPolicy(PagePool(728), 16)], [KVGroupSpec(FULL_ATTENTION, (0,))])
    scheduler = Scheduler(
        pages, SchedulerSettings("fifo", 0.15, max_queue_size=0, speculation_max_batch=None), 8192, 1024
    )
    scheduler.policy = policy
    requests = [make_request(f"r{i}", length, 32) for i, length in enumerate(lengths)]
    for request in requests:
        scheduler.add(request)
    model, clock, first = FakeModel(), 0.0, {}
    while scheduler.has_work():
        plan = scheduler.schedule()
        clock += fixed_s + token_s * sum(entry.num_tokens for entry in plan.entries)
        model.forget(scheduler.update(plan, model.run(plan)))
        for entry in plan.entries:
            if entry.request.generated_ids:
                first.setdefault(entry.request.request_id, clock)
    ttft = [first[r.request_id] for i, r in enumerate(requests) if i % 2 == 0]
    return clock, statistics.median(ttft)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fixed-ms", type=float, default=56.0)
    parser.add_argument("--token-ms", type=float, default=2.25)
    parser.add_argument("--splits", default="2,3,4,5,6")
    args = parser.parse_args(argv)
    splits = [int(value) for value in args.splits.split(",")]
    rng = random.Random(0)
    bursts = {
        f"{n} chats + completions": [33 if i % 2 == 0 else 14 for i in range(n)] for n in (20, 50, 100, 200)
    }
    bursts |= {f"{n} prompts of 10-300": [rng.randint(10, 300) for _ in range(n)] for n in (20, 50, 100)}
    fixed, token = args.fixed_ms / 1000, args.token_ms / 1000
    print(
        "| burst | fifo: wall / TTFT p50 s | " + " | ".join(f"decode_first SPLIT {s}" for s in splits) + " |"
    )
    print("|---|---|" + "---|" * len(splits))
    for name, lengths in bursts.items():
        wall, ttft = run(make_policy("fifo"), lengths, fixed, token)
        cells = []
        for split in splits:
            policy = DecodeFirstPolicy()
            policy.SPLIT = split
            cells.append("{:.2f} / {:.2f}".format(*run(policy, lengths, fixed, token)))
        print(f"| {name} | {wall:.2f} / {ttft:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
