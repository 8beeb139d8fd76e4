"""Grammar-constrained decoding on llguidance: compiled grammars (cached), per-request matchers, masks.

`GrammarCompiler` turns a `GuidedDecoding` into a compiled grammar once per distinct constraint (an LRU
keyed by the constraint's canonical text) and refuses one that does not compile with llguidance's
message. Each constrained request owns a `GrammarState`: a copy of the compiled matcher that follows the
request's own generated tokens. It is synced lazily from `Request.generated_ids` (the request's tokens
are the truth, the matcher a cache of them), so forks, preemption with recompute or offload, and
tensor parallelism (rank 0 samples) need nothing of their own. `apply_masks` masks the constrained
rows of a step's logits in one batched operation; the other rows are not touched.

llguidance is the optional extra `structured` (why it and not xgrammar or outlines-core: docs/design.md).
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from ...invariants import present
from .guided import GuidedDecoding

EXTRA_HINT = "pip install 'transformers-cb[structured]'"
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): what models write most,
# and it keeps a weak model from filling its budget with whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 1024
# Above this many constrained rows in a step, masks are computed by llguidance's thread pool.
PARALLEL_ROWS = 4


def _llguidance() -> ModuleType:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as error:
        raise ImportError(
            f"guided decoding (structured outputs) needs llguidance, the optional extra 'structured': "
            f"{EXTRA_HINT} ({error})"
        ) from error
    return llguidance


# llguidance's view of a tokenizer takes ~0.1-1 s to build (it walks the vocabulary): one per tokenizer object,
# vocabulary width and eos ids, shared by every engine (each generate_batch call builds a new engine).
_TOKENIZERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple[int, tuple[int, ...]], object]] = (
    weakref.WeakKeyDictionary()
)


def _ll_tokenizer(
    lib: ModuleType, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: list[int]
) -> object:
    key = (vocab_size, tuple(eos))
    try:
        per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: not shared
        per_tokenizer = {}
    if key not in per_tokenizer:
        per_tokenizer[key] = lib.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
    return per_tokenizer[key]


class Matcher(Protocol):
    """What the package calls on llguidance's `LLMatcher` (an untyped extension type)."""

    def reset(self) -> object: ...
    def consume_tokens(self, tokens: list[int]) -> bool: ...
    def get_error(self) -> str: ...
    def rollback(self, num_tokens: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def is_error(self) -> bool: ...
    def validate_tokens(self, tokens: list[int]) -> int: ...
    def deep_copy(self) -> Matcher: ...


@dataclass(eq=False)
class GrammarState:
    """One request's matcher; `consumed` counts the generated tokens it has been fed."""

    matcher: Matcher
    consumed: int = 0
    error: str | None = field(default=None)

    def sync(self, generated_ids: list[int]) -> None:
        """Feed the matcher the tokens generated since the last sync (the request's tokens are the truth)."""
        if self.consumed > len(generated_ids):  # tokens were taken back: replay from the start
            self.matcher.reset()
            self.consumed = 0
        if self.consumed < len(generated_ids):
            new = generated_ids[self.consumed :]
            self.consumed = len(generated_ids)
            if not self.matcher.consume_tokens(new) and self.error is None:
                self.error = self.matcher.get_error()

    def rollback(self, num_generated: int) -> None:
        """Take back the tokens fed past the first `num_generated` (speculation's rejected draft tokens)."""
        if self.consumed <= num_generated:
            return
        if not self.matcher.rollback(self.consumed - num_generated):
            self.matcher.reset()  # beyond its rollback window: replayed from the start on the next sync
            self.consumed = 0
            return
        self.consumed = num_generated

    def allowed_prefix(self, generated_ids: list[int], draft: list[int]) -> int:
        """How many of `draft`'s tokens the grammar allows after `generated_ids` (a forbidden token ends
        a speculation run: the target would never produce it)."""
        self.sync(generated_ids)
        if self.matcher.is_stopped() or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens(draft))

    def finished(self, generated_ids: list[int]) -> bool:
        """The grammar has reached its end: no token but eos could follow."""
        self.sync(generated_ids)
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary, each distinct one once.

    Args:
        tokenizer: a Hugging Face fast tokenizer (its tokens' bytes are what the grammar spells).
        vocab_size: the width of the model's logits (may exceed the tokenizer's: the rest is never allowed).
        eos_token_ids: the ids that end a request, allowed once the grammar may end.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._lib: ModuleType | None = None  # llguidance, imported at the first constraint
        self._lltokenizer: object = None
        self._cache: OrderedDict[tuple[str, str], Matcher] = OrderedDict()
        self._executor: object = None
        self.compiled = 0  # grammars compiled (cache misses)

    def _tokenizer_info(self, label: str) -> object:
        if self._lltokenizer is None:
            lib = _llguidance()
            if self._tokenizer is None:
                raise ValueError(f"{label}: guided decoding needs a tokenizer (pass tokenizer=...)")
            try:
                self._lltokenizer = _ll_tokenizer(lib, self._tokenizer, self.vocab_size, self._eos)
            except Exception as error:  # noqa: BLE001 - llguidance's message names the problem
                raise ValueError(f"{label}: llguidance cannot use this tokenizer: {error}") from error
            self._lib = lib
        return self._lltokenizer

    def _grammar_text(self, guided: GuidedDecoding) -> str:
        lib, kind = present(self._lib, "compiled after the tokenizer"), guided.kind
        if kind == "json":
            schema = guided.json if isinstance(guided.json, str) else json.dumps(guided.json)
            return lib.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return lib.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return lib.LLMatcher.grammar_from_regex(guided.regex)
        if kind == "choice":
            return lib.grammar_from("choice", json.dumps(list(present(guided.choice, "kind is choice"))))
        return lib.grammar_from("grammar", guided.grammar)  # GBNF / EBNF, or Lark as it is

    def compile(self, guided: GuidedDecoding, label: str) -> Matcher:
        """The compiled matcher of `guided` (cached; never consume it, copy it). `ValueError` with
        llguidance's message when it does not compile."""
        tokenizer = self._tokenizer_info(label)
        key = guided.key()
        matcher = self._cache.get(key)
        if matcher is not None:
            self._cache.move_to_end(key)
            return matcher
        try:
            grammar = self._grammar_text(guided)
        except ValueError as error:
            raise ValueError(f"{label}: guided {guided.kind} does not compile: {error}") from None
        matcher = present(self._lib).LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{label}: guided {guided.kind} does not compile: {matcher.get_error()}")
        self.compiled += 1
        self._cache[key] = matcher
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return matcher

    def state(self, guided: GuidedDecoding, label: str) -> GrammarState:
        """A fresh per-request state (a copy of the cached compiled matcher)."""
        return GrammarState(self.compile(guided, label).deep_copy())

    def apply_masks(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Set the disallowed tokens of `logits[rows[i]]` to -inf, from `states[i]`, in place.

        Only these rows are read or written: one gather, one masked fill, one scatter."""
        lib = present(self._lib, "masks after a compile")
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        if len(rows) > PARALLEL_ROWS:
            if self._executor is None:
                self._executor = lib.LLExecutor()
            pairs = [(state.matcher, i) for i, state in enumerate(states)]
            lib.torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        else:
            for i, state in enumerate(states):
                lib.torch.fill_next_token_bitmask(state.matcher, bitmask, i)
        apply_bitmask(logits, rows, bitmask.to(logits.device, non_blocking=True))


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """`logits[rows[i], t] = -inf` where bit `t` of `bitmask[i]` (int32 words, little-endian bits) is 0."""
    device = logits.device
    shifts = _BITS.get(device)
    if shifts is None:
        shifts = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    vocab = logits.shape[-1]
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # logits wider than the mask: the extra ids are never allowed
        pad = torch.zeros(len(rows), vocab - allowed.shape[1], dtype=torch.bool, device=device)
        allowed = torch.cat([allowed, pad], dim=1)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
