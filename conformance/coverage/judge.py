"""Judging one engine's runs against the `generate()` references: exact, mismatch, refused or crash."""

from __future__ import annotations

from collections.abc import Sequence

from .build import Generated, Subject, logit_margin
from .outcome import CRASH, EXACT, MISMATCH, NOT_INSTANTIABLE, REFUSED, Outcome, one_line

# Below this logit gap between generate()'s token and the engine's, a different greedy choice is a
# floating-point near-tie (two summation orders legitimately disagree in float32), not a bug.
NEAR_TIE = 1e-4
# Equal tokens are not enough: a tiny random model often repeats one token whatever it attends to. The
# engine's logprob of each token must match generate()'s within this (float32 paged vs dense: ~1e-6).
LOGPROB_TOLERANCE = 1e-3


class RunFailed(Exception):
    """A run that did not produce every output: a failed request, a dead manager thread, a stall."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logprob_difference(expected: Generated, actual: Generated, upto: int) -> str | None:
    """The first of the first `upto` tokens whose logprobs disagree beyond LOGPROB_TOLERANCE."""
    if expected.logprobs is None or actual.logprobs is None:
        return None
    for k, (a, b) in enumerate(zip(expected.logprobs[:upto], actual.logprobs[:upto], strict=False)):
        if abs(a - b) > LOGPROB_TOLERANCE:
            return (
                f"the logprob of generated token {k} ({expected.tokens[k]}) is {b:.5f}, generate()'s {a:.5f}"
            )
    return None


def compare(subject: Subject, run: str, outputs: list[Generated]) -> tuple[str | None, int]:
    """(a description of the first real difference or None, the number of near-ties) for one run."""
    near_ties = 0
    for i, (prompt, reference, output) in enumerate(
        zip(subject.prompts, subject.references or [], outputs, strict=True)
    ):
        expected, actual = reference.tokens, output.tokens
        index = first_difference(expected, actual)
        same_upto = len(expected) if index is None else index
        logprobs = logprob_difference(reference, output, same_upto)
        if logprobs is not None:
            return f"{run}: prompt {i} ({len(prompt)} tokens): {logprobs}", near_ties
        if index is None:
            continue
        if index < min(len(expected), len(actual)):
            margin = logit_margin(subject.model, [*prompt, *expected[:index]], actual[index])
            if margin is not None and margin < NEAR_TIE:
                near_ties += 1
                continue
        return (
            f"{run}: prompt {i} ({len(prompt)} tokens) differs from generate() at generated token {index}: "
            f"{expected} vs {actual}",
            near_ties,
        )
    return None, near_ties


def judge(subject: Subject, runs: dict[str, list[Generated]], notes: str = "") -> Outcome:
    """The outcome of runs that all completed (run name -> outputs in prompt order)."""
    if subject.references is None:
        return Outcome(NOT_INSTANTIABLE, one_line(f"generate() fails: {subject.reference_error}"), notes)
    total_ties = 0
    for run, outputs in runs.items():
        difference, ties = compare(subject, run, outputs)
        total_ties += ties
        if difference is not None:
            return Outcome(MISMATCH, one_line(difference), notes)
    if total_ties:
        notes = f"{notes} near_ties={total_ties}".strip()
    return Outcome(EXACT, "", notes)


def judge_error(
    subject: Subject,
    exc: BaseException,
    refusal_types: tuple[type, ...],
    started: bool,
    require_type: bool = True,
) -> Outcome:
    """The outcome of a run that raised. A refusal is an error of `refusal_types` raised up front (before
    any request ran) whose message names the model type (unless not `require_type`: the built-in's
    set-up errors do not); anything else is a crash."""
    message = f"{type(exc).__name__}: {exc}"
    model_type = getattr(subject.model.config.get_text_config(decoder=True), "model_type", "")
    names_type = model_type in str(exc) or subject.model.config.model_type in str(exc)
    if not started and isinstance(exc, refusal_types) and (names_type or not require_type):
        return Outcome(REFUSED, one_line(str(exc)))
    if subject.references is None:
        return Outcome(NOT_INSTANTIABLE, one_line(f"generate() fails: {subject.reference_error}"))
    return Outcome(CRASH, one_line(message))
