"""`GET /metrics`: the manager's `stats()` and the server's latency histograms, in Prometheus text format.

Written by hand (the text format is a few lines per family) rather than pulling
in `prometheus_client` for it. Format reference:
https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

from ..manager.stats import ManagerStats

PREFIX = "transformers_cb"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram of seconds, safe to observe from any thread."""

    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        with self._lock:
            index = bisect.bisect_left(self.buckets, value)
            if index < len(self.counts):
                self.counts[index] += 1
            self.total += value
            self.count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.total, self.count
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, bucket_count in zip(self.buckets, counts, strict=True):
            cumulative += bucket_count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {count}')
        lines.append(f"{self.name}_sum {total!r}")
        lines.append(f"{self.name}_count {count}")
        return lines


@dataclass
class ServerMetrics:
    ttft: Histogram = field(
        default_factory=lambda: Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from submission to the first generated token, seen by the server.",
        )
    )
    itl: Histogram = field(
        default_factory=lambda: Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Seconds between two generated tokens of one request, seen by the server.",
        )
    )
    responses: Counter[tuple[str, int]] = field(default_factory=Counter)

    def count_response(self, endpoint: str, status: int) -> None:
        self.responses[(endpoint, status)] += 1

    def render(self, stats: ManagerStats) -> str:
        lines: list[str] = []
        gauges = {
            "queue_depth": (stats.queued, "Requests submitted and waiting to be scheduled."),
            "running_requests": (stats.running, "Requests in the running batch."),
            "kv_pages_in_use": (stats.pages_in_use, "KV cache pages held by requests."),
            "kv_pages_total": (stats.pages_total, "KV cache pages in the pool."),
            "tokens_per_second": (stats.tokens_per_second, "Generated tokens per second (recent window)."),
            "prefix_cache_hit_rate": (stats.prefix_cache_hit_rate, "Share of prompt tokens found in cache."),
            "swapped_out_requests": (stats.swapped_out, "Requests whose KV is in the CPU offload tier."),
            "state_slots_in_use": (stats.state_slots_in_use, "Per-request state slots held (state layers)."),
            "state_slots_total": (stats.state_slots_total, "Per-request state slots (state layers)."),
            "packed_weight_bytes": (
                stats.packed_weight_bytes,
                "Bytes of the packed copies of the model's Linear weights (packed products).",
            ),
            "weight_version": (
                stats.weight_version,
                "The model's weight version: 0 at start, one more per weight update (docs/manager.md).",
            ),
            "speculation_acceptance_rate": (stats.acceptance_rate, "Share of draft tokens accepted."),
            "speculation_tokens_per_step": (
                stats.tokens_per_speculation_step,
                "Tokens a speculating request appended per verification step.",
            ),
        }
        for name, (value, text) in gauges.items():
            lines += [
                f"# HELP {PREFIX}_{name} {text}",
                f"# TYPE {PREFIX}_{name} gauge",
                f"{PREFIX}_{name} {value}",
            ]
        counters = {
            "requests_finished": (stats.finished, "Requests that finished normally."),
            "requests_failed": (stats.failed, "Requests that failed."),
            "requests_cancelled": (
                stats.cancelled,
                "Requests cancelled (client gone, stop string, shutdown).",
            ),
            "requests_aborted": (stats.aborted, "Requests aborted by a weight update (pause mode abort)."),
            "preemptions": (stats.preemptions, "Requests evicted from the cache to make room."),
            "prefill_tokens": (stats.prefill_tokens, "Prompt tokens computed."),
            "decode_tokens": (stats.decode_tokens, "Decode tokens computed."),
            "recomputed_tokens": (
                stats.recomputed_tokens,
                "Tokens run again after preemption dropped their KV.",
            ),
            "swap_out_pages": (stats.swap_out_pages, "KV pages copied to the CPU offload tier."),
            "swap_in_pages": (stats.swap_in_pages, "KV pages copied back from the CPU offload tier."),
            "draft_tokens": (stats.draft_tokens, "Speculative draft tokens verified."),
            "accepted_draft_tokens": (stats.accepted_draft_tokens, "Speculative draft tokens accepted."),
        }
        for name, (value, text) in counters.items():
            family = f"{PREFIX}_{name}"
            lines += [f"# HELP {family} {text}", f"# TYPE {family} counter", f"{family}_total {value}"]
        family = f"{PREFIX}_http_responses"
        lines += [f"# HELP {family} HTTP responses by endpoint and status.", f"# TYPE {family} counter"]
        for (endpoint, status), value in sorted(self.responses.items()):
            lines.append(f'{family}_total{{endpoint="{endpoint}",status="{status}"}} {value}')
        lines += self.ttft.render() + self.itl.render()
        return "\n".join(lines) + "\n"
