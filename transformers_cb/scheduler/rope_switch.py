"""Phi-3's LongRoPE switch on the scheduler's side: which running requests `generate()` recomputes from
scratch at their length (`RopeRule.must_recompute`, kv/rope_rule.py), once each, and how far a draft may
reach before that switch (`RopeRule.draft_room`). The queues drop their KV (`RequestQueues.recompute_at_rope_switch`)."""

from __future__ import annotations

from ..kv.rope_rule import RopeRule
from ..requests import Request


class RopeSwitches:
    """The requests whose KV was recomputed at the switch: never again."""

    def __init__(self, rope: RopeRule | None) -> None:
        self.rope = rope
        self.switched: set[str] = set()

    def due(self, running: list[Request]) -> list[Request]:
        """The running requests that reach the switch now (each marked: it is due once)."""
        rope = self.rope
        if rope is None or not rope.recomputes_at_switch:
            return []
        due = [
            request
            for request in running
            if not request.is_finished
            and request.request_id not in self.switched
            and rope.must_recompute(
                request.num_prompt_tokens, request.num_computed_tokens, request.num_tokens
            )
        ]
        self.switched.update(request.request_id for request in due)
        return due

    def cut_draft(self, request: Request, draft: list[int]) -> list[int]:
        """`draft` cut so that its verification stays before the request's switch."""
        if self.rope is None or request.request_id in self.switched:
            return draft
        room = self.rope.draft_room(request.num_prompt_tokens, request.num_tokens)
        return draft if room is None else draft[:room]

    def forget(self, request_id: str) -> None:
        self.switched.discard(request_id)
