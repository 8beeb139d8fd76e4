"""The grammar libraries compared for structured outputs (docs/design.md): llguidance, xgrammar, outlines-core.

    python -m venv /tmp/venv-grammar && /tmp/venv-grammar/bin/pip install torch transformers llguidance xgrammar outlines-core
    /tmp/venv-grammar/bin/python benchmarks/grammar_libraries.py llguidance xgrammar outlines

On a 32000-token byte-level vocabulary (256 bytes + random 2-8 byte tokens, built offline), one thread: the time
to build each library's view of the tokenizer, to compile a JSON schema (five variants, median and first), and to
fill one next-token bitmask along a random walk through the grammar (80 steps per schema, 400 in all; the bit
unpacking is not timed). One JSON line per library. Not part of the package's dependencies: each library is
imported only by its own function.
"""

# ruff: noqa: B023 - each walk calls its closures before the loop moves on
import json
import os
import random
import statistics
import sys
import time

import torch

VOCAB = 32000
EOS = 2


def build_tokenizer():
    """The structured workload's byte-level tokenizer (benchmarks/structured.py), `VOCAB` ids; eos is id 2."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import structured

    return structured.byte_tokenizer(VOCAB)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "kind": {"enum": ["person", "company", "bot"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "kind", "address", "score"],
}


def schema_variant(i):
    s = json.loads(json.dumps(SCHEMA))
    s["properties"][f"extra_{i}"] = {"type": "integer"}
    return s


def walk(allowed_fn, consume_fn, done_fn, steps, seed):
    """Random walk through the grammar; returns per-step mask times (s)."""
    r = random.Random(seed)
    times = []
    for _ in range(steps):
        allowed, dt = allowed_fn()
        times.append(dt)
        ids = allowed.nonzero().flatten().tolist()
        ids = [i for i in ids if i != EOS] or ids
        if not ids or done_fn():
            break
        consume_fn(r.choice(ids))
    return times


def unpack(bitmask):
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB].bool()


def report(name, tok_s, compile_s, times):
    print(
        json.dumps(
            {
                "library": name,
                "tokenizer_s": round(tok_s, 3),
                "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
                "compile_ms_first": round(compile_s[0] * 1e3, 2),
                "mask_us_median": round(statistics.median(times) * 1e6, 1),
                "mask_us_mean": round(statistics.mean(times) * 1e6, 1),
                "mask_us_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
                "steps": len(times),
            }
        )
    )


def bench_llguidance(tok):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    tok_s = time.perf_counter() - t0
    compile_s = []
    matchers = []
    for i in range(5):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema_variant(i)))
        assert not m.is_error(), m.get_error()
        compile_s.append(time.perf_counter() - t0)
        matchers.append(m)
    times = []
    for i, m in enumerate(matchers):
        bm = lt.allocate_token_bitmask(1, lltok.vocab_size)

        def allowed():
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bm, 0)
            dt = time.perf_counter() - t0
            return unpack(bm), dt

        times += walk(allowed, m.consume_token, m.is_stopped, 80, i)
    report(f"llguidance {llguidance.__version__}", tok_s, compile_s, times)


def bench_xgrammar(tok):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    tok_s = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_s = []
    compiled = []
    for i in range(5):
        t0 = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema_variant(i))))
        compile_s.append(time.perf_counter() - t0)
    times = []
    for i, c in enumerate(compiled):
        m = xgr.GrammarMatcher(c)
        bm = xgr.allocate_token_bitmask(1, VOCAB)

        def allowed():
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            dt = time.perf_counter() - t0
            return unpack(bm), dt

        times += walk(allowed, m.accept_token, m.is_terminated, 80, i)
    import importlib.metadata as md

    report(f"xgrammar {md.version('xgrammar')}", tok_s, compile_s, times)


def bench_outlines(tok):
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    mapping = {}
    for t, i in tok.get_vocab().items():
        if i in (0, 1, 2):
            continue
        mapping.setdefault(tok.convert_tokens_to_string([t]), []).append(i)
    vocab = Vocabulary(EOS, mapping)
    tok_s = time.perf_counter() - t0
    compile_s = []
    idx = []
    for i in range(5):
        t0 = time.perf_counter()
        idx.append(Index(build_regex_from_schema(json.dumps(schema_variant(i))), vocab))
        compile_s.append(time.perf_counter() - t0)
    times = []
    words = (VOCAB + 31) // 32
    for i, ix in enumerate(idx):
        g = Guide(ix)
        bm = torch.zeros(1, words, dtype=torch.int32)

        def allowed():
            t0 = time.perf_counter()
            bm.zero_()
            g.write_mask_into(bm.data_ptr(), bm.numel(), bm.element_size())
            dt = time.perf_counter() - t0
            return unpack(bm), dt

        times += walk(allowed, g.advance, g.is_finished, 80, i)
    report(
        f"outlines-core {outlines_core.__version__ if hasattr(outlines_core, '__version__') else '0.2.14'}",
        tok_s,
        compile_s,
        times,
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    tok = build_tokenizer()
    print("vocab", len(tok))
    for b in sys.argv[1:]:
        try:
            globals()[f"bench_{b}"](tok)
        except Exception as e:
            print(b, "FAILED", type(e).__name__, e)
