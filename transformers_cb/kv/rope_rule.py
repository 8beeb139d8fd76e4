"""Which rotary frequencies a request's token gets when the model's rotary embedding is dynamic.

transformers' LongRoPE (`rope_type="longrope"`: Phi-3, Phi-3.5, Phi-4-mini) and dynamic NTK
(`rope_type` containing `"dynamic"`) choose their frequencies in the forward (`dynamic_rope_update` in
transformers' `modeling_rope_utils`) from the largest position the call sees. A packed step holds many
requests, so the step's largest position is not the request's: each request's rows must get what
`generate()` gives that request alone. In `generate()`'s single prefill the call sees the whole prompt
(`P` tokens); each decoded token at position `p` is a call of its own that sees `p + 1`. So a token at
position `p` of a request whose prompt has `P` tokens sees the sequence length

    effective_length(P, p) = max(P, p + 1)

(the prompt's tokens: `P`; a generated one, recomputed after a preemption or not: `p + 1`). Phi-3's
`generate()` (and PhiMoE's) goes further: when the sequence first reaches
`original_max_position_embeddings + 1` tokens it drops its cache and computes every token again in one
call, so there a request's tokens all see its current length (`RopeRule.recomputes_at_switch`; the
scheduler drops the request's KV at that point, scheduler/scheduler.py). Then:

- LongRoPE takes the long factors when that length passes `original_max_position_embeddings`,
  the short ones otherwise;
- dynamic NTK (judged against a fresh model, whose cached length starts at `max_position_embeddings`
  and only grows within one `generate()`) takes the frequencies computed for that length when it
  passes `max_position_embeddings`, the original ones otherwise.

`RopeRule.frequency_key` names the frequency set of a token (0: the original / short one); the runner
computes cos/sin once per key in the step (runner/request_rotary.py). `RopeRule.prefix_salt` is what the
prefix cache salts a request's page keys with (kv/prefix_cache.py): two requests whose salts are equal
give every position the same frequencies, so their equal tokens have equal KV. Both rules extend the
model past its native length the way `generate()` does, so such requests are not refused there
(`RopeRule.extends_positions`, read by memory/sizing.py's `ModelShape`).

Torch-free: the scheduler's rooms read it. Models whose per-layer-type rope parameters hold a dynamic type
are not covered (`rope_rule_of` returns None for them: transformers' whole-step rule stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LONGROPE = "longrope"
DYNAMIC = "dynamic"


@dataclass(frozen=True)
class RopeRule:
    """A dynamic rotary embedding's rule: `kind` (`LONGROPE` or `DYNAMIC`) and the length past which
    its frequencies change (`original_max_position_embeddings`, or `max_position_embeddings`).

    `recomputes_at_switch`: the model's `generate()` drops its cache when the sequence first passes the
    threshold and computes every token again with the long factors (Phi-3's, PhiMoE's
    `prepare_inputs_for_generation`): a request's tokens then all take the set of its current length,
    and the scheduler drops a request's KV at that point (`must_recompute`)."""

    kind: str
    threshold: int
    recomputes_at_switch: bool = False

    def effective_length(self, prompt_tokens: int, num_tokens: int, position: int) -> int:
        """The sequence length `generate()`'s call computing position `position` sees, for a request of
        `prompt_tokens` prompt tokens that holds `num_tokens` tokens now."""
        if self.recomputes_at_switch:
            return num_tokens
        return max(prompt_tokens, position + 1)

    def frequency_key(self, prompt_tokens: int, num_tokens: int, position: int) -> int:
        """The token's frequency set: 0 for the original (short) one; LongRoPE's long set is 1, dynamic
        NTK's is the effective length it is computed for."""
        length = self.effective_length(prompt_tokens, num_tokens, position)
        if length <= self.threshold:
            return 0
        return 1 if self.kind == LONGROPE else length

    def prefix_salt(self, prompt_tokens: int, num_tokens: int) -> bytes:
        """Salt of a request's page keys: requests with the same salt give each position the same
        frequencies. Within the native length (both kinds) a token's set depends on its position only:
        no salt. Past it, LongRoPE's prompt takes the long set (one salt; with `recomputes_at_switch`, a
        request past the threshold holds long KV only, recomputed there); dynamic NTK's prompt takes the
        set of its exact length (a salt per prompt length)."""
        length = num_tokens if self.recomputes_at_switch else prompt_tokens
        if length <= self.threshold:
            return b""
        key = 1 if self.kind == LONGROPE else length
        return f"rope:{self.kind}:{key}".encode()

    def must_recompute(self, prompt_tokens: int, num_computed_tokens: int, num_tokens: int) -> bool:
        """Whether a running request whose KV was computed within the threshold (its prompt was, and it
        was not recomputed at the switch yet: the caller's to know) must drop its KV and compute it again:
        `generate()` does so when the sequence passes `threshold` tokens with KV in its cache
        (`recomputes_at_switch`)."""
        return (
            self.recomputes_at_switch
            and prompt_tokens <= self.threshold
            and num_tokens > self.threshold
            and num_computed_tokens > 0
        )

    def draft_room(self, prompt_tokens: int, num_tokens: int) -> int | None:
        """The most draft tokens a request may verify in one step before its KV's switch (None: no
        bound): each verified position `q` must see at most `threshold` tokens (`q + 1`), as the
        `generate()` call that computes it before its recompute does."""
        if not self.recomputes_at_switch or prompt_tokens > self.threshold or num_tokens > self.threshold:
            return None
        return max(0, self.threshold - num_tokens)

    @property
    def extends_positions(self) -> bool:
        """Requests past the native length run (what the rope type is for): `generate()` runs them."""
        return True


def rope_parameters_of(config: PretrainedConfig) -> dict[str, Any] | None:
    """The text config's rope parameters (transformers 5's `rope_parameters`, else the older
    `rope_scaling`), or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    return params if isinstance(params, dict) else None


def rope_rule_of(config: PretrainedConfig, recomputes_at_switch: bool = False) -> RopeRule | None:
    """The rule of a model whose one rope type is LongRoPE or dynamic NTK; None for every other model
    (position-only rope types, no rope, per-layer-type parameters). `recomputes_at_switch`: the model's
    `generate()` recomputes its cache at LongRoPE's switch (`recomputes_at_switch_of`)."""
    params = rope_parameters_of(config)
    if params is None:
        return None
    rope_type = params.get("rope_type", params.get("type"))
    if not isinstance(rope_type, str):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if rope_type == LONGROPE:
        original = params.get("original_max_position_embeddings") or getattr(
            text, "original_max_position_embeddings", None
        )
        return RopeRule(LONGROPE, int(original), recomputes_at_switch) if original else None
    if DYNAMIC in rope_type:
        native = getattr(text, "max_position_embeddings", None)
        return RopeRule(DYNAMIC, int(native)) if native else None
    return None


def recomputes_at_switch_of(model: object) -> bool:
    """Whether the model's `prepare_inputs_for_generation` drops the cache at LongRoPE's switch: its own
    code reads `original_max_position_embeddings` (Phi-3, PhiMoE, Phi-4-multimodal override it so)."""
    prepare = getattr(type(model), "prepare_inputs_for_generation", None)
    code = getattr(prepare, "__code__", None)
    return code is not None and "original_max_position_embeddings" in code.co_names
