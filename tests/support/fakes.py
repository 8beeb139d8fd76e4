"""The scheduler's fake model (no tensors): it keeps a per-request 'KV' of the tokens it was fed and checks
that every scheduled entry continues exactly where that KV ends."""

from __future__ import annotations

import zlib

from tests.support.requests import FIRST_NORMAL_TOKEN
from transformers_cb.requests import Request
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.step_plan import StepPlan

EOS = 2


class FakeModel:
    """Stands in for the model: keeps a per-request 'KV' of the tokens it was fed.

    It checks that every entry continues exactly where the request's KV ends (so a
    preempted request is recomputed from position 0 over prompt + generated tokens),
    and samples a token that depends on the whole KV, so any scheduling mistake
    would change the generated sequence.
    """

    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        self.kv: dict[str, list[int]] = {}
        self.eos_at = eos_at or {}  # request id -> number of generated tokens at which to emit EOS

    def run(self, batch: StepPlan) -> list[list[SampledToken]]:
        for request in batch.preempted:
            self.kv.pop(request.request_id, None)
        sampled = []
        for entry in batch.entries:
            request = entry.request
            kv = self.kv.setdefault(request.request_id, [])
            assert entry.start == len(kv) == request.num_computed_tokens, (
                f"{request.request_id}: {entry.start=} {len(kv)=} {request.num_computed_tokens=}"
            )
            assert entry.num_tokens >= 1
            kv.extend(request.all_token_ids[entry.start : entry.end])
            if entry.samples:
                assert kv == request.all_token_ids
                sampled.append([SampledToken(self.token(request, kv))])
        return sampled

    def token(self, request: Request, kv: list[int]) -> int:
        if self.eos_at.get(request.request_id) == len(request.generated_ids) + 1:
            return EOS
        digest = zlib.crc32(repr((request.request_id, kv)).encode())
        return FIRST_NORMAL_TOKEN + digest % 200

    def forget(self, requests: list[Request]) -> None:
        for request in requests:
            self.kv.pop(request.request_id, None)
