"""The seed documents' own code, run unchanged (but for model id, device and dtype) after
`import transformers_cb`, each script its own process (forked from one that made its first imports, or a
fresh interpreter), with the plugin imported before the transformers imports and after them. Outputs are compared with plain `generate()` on the same saved model.

Blocks whose feature is not built yet are `xfail(strict=True)`: the day the feature lands they pass,
the strict marker turns the test red, and the marker must go.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.models import build_model
from tests.support.processes import run_process
from tests.support.zygote import Zygotes, process_env
from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

from . import seed_blocks as blocks

ORDERS = ("plugin_first", "plugin_after")
# Every block runs in a fresh interpreter (seconds of imports each): the `slow` tier, but for the getting-started
# script with the plugin imported first, which the fast tier keeps as its one end-to-end run of the documents.
SLOW_ORDERS = [pytest.param(order, marks=pytest.mark.slow) for order in ORDERS]
FAST_FIRST_ORDERS = [ORDERS[0], pytest.param(ORDERS[1], marks=pytest.mark.slow)]
SCRIPT_TIMEOUT_S = 300

# Runs first in every script; stdlib only, so the import order under test is not disturbed.
PRELUDE = '''
import json as _json
import os as _os

_record = {"outputs": {}, "decoded": [], "marks": {}}


def _save(name, outputs):
    _record["outputs"][name] = {
        rid: {
            "prompt": list(o.prompt_ids),
            "tokens": list(o.generated_tokens),
            "logprobs": None if o.logprobs is None else [float(x) for x in o.logprobs],
            "status": int(o.status),
            "error": o.error,
        }
        for rid, o in outputs.items()
    }


def _record_decodes(tokenizer):
    """Keep every token list the document's code decodes (its way of reading results)."""
    cls = type(tokenizer)
    original = cls.decode

    def decode(self, token_ids, *args, **kwargs):
        _record["decoded"].append([int(t) for t in token_ids])
        return original(self, token_ids, *args, **kwargs)

    cls.decode = decode


def _mark(name):
    _record["marks"][name] = len(_record["decoded"])


def _dump():
    path = _os.environ["CB_SEED_OUT"]
    if "RANK" in _os.environ:  # under torchrun: one record per rank
        path += ".rank" + _os.environ["RANK"]
    with open(path, "w") as f:
        _json.dump(_record, f)
'''

CALL_GENERATE_BATCH = """
outputs = model.generate_batch(
    inputs=inputs, generation_config=generation_config, continuous_batching_config=cb_config
)
"""


def _import_plugin(body: str, order: str) -> str:
    """`import transformers_cb` first, or right after the script's first run of import lines."""
    if order == "plugin_first":
        return "import transformers_cb  # noqa\n" + body
    lines = body.split("\n")
    lines.insert(_end_of_first_imports(lines) + 1, "import transformers_cb  # noqa")
    return "\n".join(lines)


def _end_of_first_imports(lines: list[str]) -> int:
    """The index of the last line of the script's first run of import statements (blank lines and
    parenthesized names within it): an import further down, after code has run (a later block's own
    `from transformers.generation import ...`), is not part of it."""
    i = next(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    end = i
    while i < len(lines):
        line = lines[i]
        if line.startswith(("import ", "from ")):
            if "(" in line and ")" not in line:
                while ")" not in lines[i]:
                    i += 1
            end = i
        elif line.strip():
            break
        i += 1
    return end


# What each order's scripts import first, made once per test process by a `Zygote` that forks a child per
# script (tests/support/zygote.py): plugin_first's scripts begin with `import transformers_cb`; plugin_after's
# with transformers' imports, and the plugin comes after them, so its zygote imports transformers' modules
# that the plugin imports (not the plugin). About 5 s of imports saved per script.
PRELOADS = {
    "plugin_first": "import transformers_cb",
    "plugin_after": "\n".join(
        [
            "import torch",
            "from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig",
            "import transformers.modeling_utils",
            # what the plugin imports, where this transformers has it (a preload that fails starts no zygote)
            "import importlib, contextlib",
            "for _name in ('transformers.integrations.flash_attention', 'transformers.integrations.finegrained_fp8'):",
            "    with contextlib.suppress(ImportError):",
            "        importlib.import_module(_name)",
        ]
    ),
}
_zygotes = Zygotes()
_close_zygotes = _zygotes.closed_after_module()


def _script_env() -> dict[str, str]:
    env = process_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(
    script: str, order: str, tmp_path: Path, launcher: tuple[str, ...] = (), fresh: bool = False
) -> dict:
    """Run the script as its own process: forked from the order's zygote, or in a fresh interpreter when
    `fresh` or under `launcher` (e.g. torchrun's arguments)."""
    source = PRELUDE + _import_plugin(script, order) + "\n_dump()\n"
    path = tmp_path / f"seed_{order}.py"
    path.write_text(source)
    out = tmp_path / f"seed_{order}.json"
    env = {**_script_env(), "CB_SEED_OUT": str(out)}
    if fresh or launcher:
        done: subprocess.CompletedProcess[str] = run_process(
            [sys.executable, *launcher, str(path)],
            env=env,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
        )
    else:
        done = _zygotes.get(order, PRELOADS[order], _script_env()).run(
            path, env, Path.cwd(), SCRIPT_TIMEOUT_S
        )
    assert done.returncode == 0, f"the document's code failed ({order}):\n{done.stderr[-4000:]}"
    if launcher:
        return {rank: json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(TP_RANKS)}
    return json.loads(out.read_text())


def test_the_plugin_comes_after_the_first_imports_and_before_any_call() -> None:
    """plugin_after puts `import transformers_cb` after the document's first import lines, before its first
    `generate_batch`: a later block's own import (the config block's `from transformers.generation import
    ContinuousBatchingConfig`) does not move it past a call that transformers' built-in would then serve."""
    script = _import_plugin(
        "\n".join(
            [
                _generate_batch_preamble(defaultdict(lambda: "tiny")),
                "_save('generate_batch', outputs)",
                blocks.CONFIG_AND_GENERATE,
            ]
        ),
        "plugin_after",
    )
    lines = script.split("\n")
    plugin = lines.index("import transformers_cb  # noqa")
    first_call = next(i for i, line in enumerate(lines) if "generate_batch(" in line)
    assert all(line.startswith(("import ", "from ")) or not line.strip() for line in lines[:plugin]), lines[
        :plugin
    ]
    assert plugin < first_call
    parenthesized = _import_plugin(
        "from a import (\n    b,\n    c,\n)\nimport d\n\nx = 1\nimport e", "plugin_after"
    )
    assert parenthesized.split("\n")[5] == "import transformers_cb  # noqa", parenthesized


# -- the saved models -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seed_models")
    tokenizer = build_tiny_tokenizer()
    llama = root / "tiny-llama"
    build_tiny_model(seed=0, tokenizer=tokenizer).save_pretrained(llama)
    tokenizer.save_pretrained(llama)
    # transformers 5.23 refuses sdpa for Gemma 2 (the block loads it with sdpa), so the block's model id
    # points at a tiny Gemma 3 (hybrid sliding + full attention), which runs sdpa.
    gemma = root / "tiny-gemma3"
    gemma3 = build_model(
        "gemma3",
        seed=0,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        sliding_window=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    gemma3.save_pretrained(gemma)
    tokenizer.save_pretrained(gemma)
    return {
        "Qwen/Qwen3-0.6B": str(llama),
        "Qwen/Qwen3-4B": str(llama),
        "Qwen/Qwen3-32B": str(llama),
        "google/gemma-2-2b": str(gemma),
    }


class Reference:
    """Plain `generate()` on a saved model, greedy, memoized per (prompt, max_new_tokens)."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32, **config_overrides) -> None:
        """`config_overrides`: the config changes the block itself makes before loading."""
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **config_overrides).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._memo: dict[tuple, tuple[list[int], list[float]]] = {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return self.with_logprobs(prompt, max_new_tokens)[0]

    @torch.inference_mode()
    def with_logprobs(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            ids = torch.tensor([prompt])
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                torch.log_softmax(score[0].float(), -1)[token].item()
                for score, token in zip(out.scores, tokens, strict=True)
            ]
            self._memo[key] = (tokens, logprobs)
        return self._memo[key]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


@pytest.fixture(scope="module")
def reference(model_dirs) -> Reference:
    return Reference(model_dirs["Qwen/Qwen3-4B"])


def _check_outputs(outputs: dict, reference: Reference, max_new_tokens: int) -> None:
    assert outputs, "no outputs"
    for rid, out in outputs.items():
        assert out["error"] is None, f"{rid} failed: {out['error']}"
        assert out["tokens"] == reference(out["prompt"], max_new_tokens), rid


# -- the blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("order", FAST_FIRST_ORDERS)
def test_getting_started_script(order, model_dirs, reference, tmp_path) -> None:
    script = blocks.adapt(blocks.GETTING_STARTED, model_dirs) + "\n_save('run', outputs)\n"
    record = _run(script, order, tmp_path)
    outputs = record["outputs"]["run"]
    assert len(outputs) == 3
    _check_outputs(outputs, reference, 64)


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_getting_started_script_in_bfloat16(order, model_dirs, tmp_path) -> None:
    """The getting-started script with its own `dtype=torch.bfloat16`: three prompts of uneven lengths
    decode in one step, each equal to plain bf16 `generate()` token for token."""
    script = blocks.adapt(blocks.GETTING_STARTED, model_dirs, keep_dtype=True) + "\n_save('run', outputs)\n"
    assert "torch.bfloat16" in script
    record = _run(script, order, tmp_path)
    outputs = record["outputs"]["run"]
    assert len(outputs) == 3
    _check_outputs(outputs, Reference(model_dirs["Qwen/Qwen3-0.6B"], dtype=torch.bfloat16), 64)


def _generate_batch_preamble(model_dirs) -> str:
    """The guide's generate_batch block, with sdpa for its flash_attention_2 (flash: see the xfail)."""
    return blocks.adapt(blocks.with_attn(blocks.GENERATE_BATCH, "sdpa"), model_dirs)


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_generate_batch_and_config_blocks(order, model_dirs, reference, tmp_path) -> None:
    parts = [_generate_batch_preamble(model_dirs), "_save('generate_batch', outputs)"]
    parts += [blocks.CONFIG_AND_GENERATE, "_save('config', outputs)"]
    for name, block in blocks.CONFIG_BLOCKS.items():
        parts += [block, CALL_GENERATE_BATCH, f"_save({name!r}, outputs)"]
    parts.append(blocks.RETURN_LOGPROBS.replace("# generate_batch()", CALL_GENERATE_BATCH))
    parts.append("_save('return_logprobs', outputs)")
    record = _run("\n".join(parts), order, tmp_path)
    expected = ["generate_batch", "config", *blocks.CONFIG_BLOCKS, "return_logprobs"]
    assert list(record["outputs"]) == expected
    for name in expected:
        _check_outputs(record["outputs"][name], reference, 64)
    for rid, out in record["outputs"]["return_logprobs"].items():
        _, logprobs = reference.with_logprobs(out["prompt"], 64)
        assert out["logprobs"] == pytest.approx(logprobs, abs=1e-4), rid
    # The logprob loop decoded each generated token once.
    assert sum(len(o["tokens"]) for o in record["outputs"]["return_logprobs"].values()) > 0


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_manager_blocks(order, model_dirs, reference, tmp_path) -> None:
    script = "\n".join(
        [
            _generate_batch_preamble(model_dirs),
            "_record_decodes(tokenizer)",
            blocks.CONTEXT_MANAGER,
            "_mark('context')",
            blocks.INIT_AND_START,
            "input_ids = inputs[0]  # the guide's snippets use an `input_ids` of the reader's",
            blocks.ADD_REQUEST,
            blocks.ADD_REQUESTS,
            blocks.GET_RESULT,
            blocks.CANCEL_REQUEST,
            blocks.ITERATE_RESULTS,
            "_mark('lifecycle')",
            blocks.STREAMING,
            "_mark('streaming')",
            blocks.STOP,
            blocks.HARD_STOP,
            blocks.DESTROY,
        ]
    )
    record = _run(script, order, tmp_path)
    decoded, marks = record["decoded"], record["marks"]
    encode = reference.encode

    context = decoded[: marks["context"]]
    expected = [
        reference(encode("Write a detailed history of quantum mechanics."), 512),
        reference(encode("What's up?"), 32),
        reference(encode("Name a cat breed."), 32),
    ]
    assert sorted(context) == sorted(expected)

    # Every result the guide's loop read is a whole generate() output, or a prefix of one for the
    # cancelled "my_request" (cancelled late, it may also have finished whole).
    lifecycle = decoded[marks["context"] : marks["lifecycle"]]
    prompts = [
        encode(p)
        for p in ("What's up?", "Name a cat breed.", "Write a detailed history of quantum mechanics.")
    ]
    whole = [reference(p, 64) for p in prompts]
    assert len(lifecycle) >= len(prompts)
    for tokens in lifecycle:
        assert tokens in whole or whole[0][: len(tokens)] == tokens, tokens

    stream = decoded[marks["lifecycle"] : marks["streaming"]]
    assert all(len(piece) <= 1 for piece in stream)
    assert [t for piece in stream for t in piece] == whole[0]


# -- per-request sampling ---------------------------------------------------------------------------

# The guide's paragraph after the block: each processor needs a non-default GenerationConfig value
# (e.g. temperature other than None or 1); requests may then use any value, 1 included.
SAMPLING_CONFIG = """
generation_config = GenerationConfig(
    max_new_tokens=64, eos_token_id=tokenizer.eos_token_id, do_sample=True, temperature=0.7, top_k=50, top_p=0.9
)
"""


def _per_request_script(model_dirs, sampling: bool) -> str:
    return "\n".join(
        [
            _generate_batch_preamble(model_dirs),
            SAMPLING_CONFIG if sampling else "",
            "inputs_a, inputs_b = inputs[0], inputs[1]",
            blocks.PER_REQUEST_CONFIG,
            "manager = model.init_continuous_batching(generation_config=generation_config, "
            "continuous_batching_config=cb_config)\nmanager.start()",
            blocks.PER_REQUEST_SUBMIT
            if sampling
            else "try:\n    "
            + blocks.PER_REQUEST_SUBMIT.strip().splitlines()[1]
            + "\nexcept ValueError as error:\n    _record['outputs']['refused'] = str(error)",
            "_results = {r.request_id: r for r in manager}\nmanager.stop()\n_save('sampled', _results)",
        ]
    )


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_per_request_sampling_block(order, model_dirs, tmp_path) -> None:
    """The guide's per-request block runs once the GenerationConfig creates the processors, and each
    request samples with its own parameters (temperature 0.1 + top_k 10 keeps the top 10 tokens)."""
    record = _run(_per_request_script(model_dirs, sampling=True), order, tmp_path)
    results = record["outputs"]["sampled"]
    assert len(results) == 2 and all(r["error"] is None and r["tokens"] for r in results.values())


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_per_request_sampling_block_needs_the_processor(order, model_dirs, tmp_path) -> None:
    """With the guide's greedy GenerationConfig no temperature processor exists: the submission is
    refused with an error that says what to set (the built-in errors the request in its loop)."""
    record = _run(_per_request_script(model_dirs, sampling=False), order, tmp_path)
    assert "set a non-default temperature in the GenerationConfig" in record["outputs"]["refused"]


TP_RANKS = 2


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_tensor_parallel_block(order, model_dirs, reference, tmp_path) -> None:
    """The guide's tensor-parallel script under `torchrun --nproc-per-node 2` (tp_size 4 -> 2, the
    ranks we have on CPU/gloo; sdpa for its flash_attention_2, see issue 11): every rank returns
    the outputs of plain single-process `generate()`."""
    assert blocks.TENSOR_PARALLEL_LAUNCH == "torchrun --nproc-per-node 4 cb_tp.py"
    script = blocks.adapt(blocks.with_attn(blocks.TENSOR_PARALLEL, "sdpa"), model_dirs)
    script = script.replace("DistributedConfig(tp_size=4)", f"DistributedConfig(tp_size={TP_RANKS})")
    script += "\n_save('run', outputs)\nassert model.tp_size == 2\n"
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", str(TP_RANKS))
    records = _run(script, order, tmp_path, launcher)
    for rank, record in records.items():
        assert len(record["outputs"]["run"]) == 2, rank
        _check_outputs(record["outputs"]["run"], reference, 64)
    assert records[0]["outputs"] == records[1]["outputs"]


# -- blocks of features that belong to later issues ------------------------------------------------

LATER = {
    # Not a later issue: transformers 5.23 itself refuses from_pretrained(attn_implementation=
    # "flash_attention_2") without the flash-attn package and a CUDA device, before the plugin runs. The
    # block's flash path runs through paged|flash_attention_2 and the flash-attn test double in
    # test_flash_block_through_the_test_double; on a CUDA machine with flash-attn, scripts/gpu_check.sh.
    "flash_attention": "transformers refuses flash_attention_2 without flash-attn + CUDA (not on this machine)",
}
# Blocks whose issue has landed: they must pass.
LANDED = (
    "sliding_window",  # sliding-window / hybrid models (issue 7)
    "compile",  # default_compile_level=1: torch.compile on CPU (issue 11)
    "cpu_offload",  # CPU offload of evicted KV pages (issue 9)
)


def _later_script(name: str, model_dirs) -> str:
    preamble = _generate_batch_preamble(model_dirs)
    if name == "flash_attention":
        return blocks.adapt(blocks.GENERATE_BATCH, model_dirs) + "\n_save('run', outputs)"
    if name in ("compile", "cpu_offload"):
        block = blocks.COMPILE if name == "compile" else blocks.CPU_OFFLOAD
        return "\n".join([preamble, block, CALL_GENERATE_BATCH, "_save('run', outputs)"])
    assert name == "sliding_window"
    return "\n".join(
        [
            "import torch",
            blocks.adapt(blocks.SLIDING_WINDOW, model_dirs),
            textwrap.dedent(
                f"""
                from transformers import AutoTokenizer
                from transformers.generation import GenerationConfig
                tokenizer = AutoTokenizer.from_pretrained({model_dirs["google/gemma-2-2b"]!r})
                inputs = [tokenizer.encode(p) for p in ["What's up?", "Name a cat breed."]]
                generation_config = GenerationConfig(max_new_tokens=64, eos_token_id=tokenizer.eos_token_id)
                outputs = model.generate_batch(inputs=inputs, generation_config=generation_config)
                _save('run', outputs)
                """
            ),
        ]
    )


# The compile and offload blocks are one config line after the generate_batch block's preamble: the plugin's
# place among those imports is test_generate_batch_and_config_blocks[plugin_after]'s, so they run plugin_first
# only (the compile block compiles in a fresh interpreter: 17-25 s on a quiet CPU).
PREAMBLE_ONLY = ("compile", "cpu_offload")


def _later_params() -> list:
    params = []
    for order in ORDERS:
        for name, why in LATER.items():
            params.append(
                pytest.param(
                    name, order, marks=[pytest.mark.slow, pytest.mark.xfail(strict=True, reason=why)]
                )
            )
        for name in LANDED:
            if order == "plugin_first" or name not in PREAMBLE_ONLY:
                params.append(pytest.param(name, order, marks=pytest.mark.slow))
    return params


@pytest.mark.parametrize(("name", "order"), _later_params())
def test_blocks_of_later_issues(name, order, model_dirs, reference, tmp_path) -> None:
    record = _run(_later_script(name, model_dirs), order, tmp_path)
    if name == "sliding_window":
        # The block sets config.sliding_window = 4096 before loading: the reference does the same.
        gemma = Reference(model_dirs["google/gemma-2-2b"], sliding_window=4096)
        _check_outputs(record["outputs"]["run"], gemma, 64)
    else:
        _check_outputs(record["outputs"]["run"], reference, 64)


# Entered right before the block loads its model (the plugin is imported by then in both orders).
FLASH_DOUBLE = f"""
import sys as _sys
_sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from tests.support import flash_double as _flash_double
_flash_context = _flash_double.injected(fa2=True)  # kept referenced: collecting it would undo it
_flash_context.__enter__()  # `import flash_attn` finds the CPU test double
"""


@pytest.mark.parametrize("order", SLOW_ORDERS)
def test_flash_block_through_the_test_double(order, model_dirs, reference, tmp_path) -> None:
    """The guide's generate_batch block with paged|flash_attention_2 (transformers refuses its plain
    flash_attention_2 here, see LATER): the plugin's flash backend, through the flash-attn test double,
    gives plain generate()'s outputs."""
    script = blocks.adapt(blocks.with_attn(blocks.GENERATE_BATCH, "paged|flash_attention_2"), model_dirs)
    loading = "model = AutoModelForCausalLM.from_pretrained("
    assert loading in script
    script = script.replace(loading, FLASH_DOUBLE + loading, 1)
    script += (
        "\n_save('run', outputs)\nassert model.config._attn_implementation == 'paged|flash_attention_2'\n"
    )
    script += "assert any(name.startswith('flash_attn.') for name, _ in _flash_double.CALLS)\n"
    # a fresh interpreter: transformers' flash-attn checks must first run after the double is in place
    record = _run(script, order, tmp_path, fresh=True)
    _check_outputs(record["outputs"]["run"], reference, 64)
