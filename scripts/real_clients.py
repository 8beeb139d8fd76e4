"""Real OpenAI clients against `transformers-cb serve`: lm-evaluation-harness and guidellm, run unchanged.

    python3 -m venv /work/venv-clients
    /work/venv-clients/bin/pip install "lm-eval[hf,api]==0.4.13" "guidellm==0.8.1" openai   # torch comes with lm-eval
    PYTHONPATH=. python scripts/real_clients.py --clients-python /work/venv-clients/bin/python [--model tiny]

The clients talk to the server over HTTP, so they live in their own virtual environment (`--clients-python`);
this script runs with the project's Python. The model is the real one by default (SmolLM2-135M-Instruct from its
cached folder, `transformers-cb models fetch`; docs/real_model.md), `--model tiny` the built-in random model saved
to a temporary directory, or `--model DIR` any local model folder. It writes two small local tasks in plain English (below: a
multiple-choice set and a short-answer set), starts `transformers-cb serve` on 127.0.0.1 and checks:

1. lm-eval `local-completions` gives the same scores as lm-eval's `hf` model on the same weights, on the
   short-answer generate-until task (exact match; every generated string compared) and on the multiple-choice
   log-likelihood task (acc / acc_norm; every choice's log-likelihood compared within 1e-4), which needs
   `echo=true` + `logprobs` prompt log-probabilities;
2. on the real model, both tasks score above chance (1/4 for four choices; any exact answer);
3. lm-eval `local-chat-completions` runs the short-answer task through /v1/chat/completions (chat has no
   prompt log-probabilities, so lm-eval runs no log-likelihood task over it);
4. guidellm's synchronous and concurrent profiles finish with 0 errored requests.

Every wait is bounded; it exits 0 only if every check passed, and prints one line per check (with the scores).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "tcb-model"
LOGLIKELIHOOD_TOLERANCE = 1e-4
# Short answers, one word each; the prompt shows the form with two solved examples (QA_PREFIX).
QA_DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What colour is the sky on a clear day?", "answer": "blue"},
    {"question": "What do bees make?", "answer": "honey"},
    {"question": "What is the opposite of hot?", "answer": "cold"},
    {"question": "Which animal says woof?", "answer": "dog"},
    {"question": "What is frozen water called?", "answer": "ice"},
    {"question": "How many days are there in a week?", "answer": "seven"},
    {"question": "What is the capital of Italy?", "answer": "Rome"},
    {"question": "What is the largest planet in the solar system?", "answer": "Jupiter"},
    {"question": "What colour are ripe bananas?", "answer": "yellow"},
    {"question": "What is the capital of Japan?", "answer": "Tokyo"},
    {"question": "Which animal says moo?", "answer": "cow"},
    {"question": "What is the opposite of up?", "answer": "down"},
    {"question": "What do cows drink?", "answer": "water"},
    {"question": "What is the capital of Spain?", "answer": "Madrid"},
    {"question": "What is the first letter of the English alphabet?", "answer": "A"},
]
QA_PREFIX = (
    "Answer each question with one word.\\n\\nQuestion: What colour is grass?\\nAnswer: green\\n\\n"
    "Question: What is the capital of England?\\nAnswer: London\\n\\n"
)
# Four choices each, the right one first here (prepare() moves it to a different position per question).
MC_DOCS = [
    {"question": "What colour is the sky on a clear day?", "choices": ["blue", "green", "red", "black"]},
    {"question": "How many days are there in a week?", "choices": ["seven", "three", "twelve", "forty"]},
    {"question": "Which animal says meow?", "choices": ["cat", "dog", "cow", "duck"]},
    {"question": "What do bees make?", "choices": ["honey", "milk", "silk", "glass"]},
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid", "Rome"]},
    {"question": "What is frozen water called?", "choices": ["ice", "steam", "sand", "smoke"]},
    {"question": "Which planet do we live on?", "choices": ["Earth", "Mars", "Jupiter", "Venus"]},
    {"question": "What do you use to write on paper?", "choices": ["a pen", "a spoon", "a hammer", "a shoe"]},
    {"question": "Which season is the coldest?", "choices": ["winter", "summer", "spring", "autumn"]},
    {"question": "What is the opposite of hot?", "choices": ["cold", "loud", "tall", "fast"]},
    {"question": "How many legs does a dog have?", "choices": ["four", "two", "six", "eight"]},
    {"question": "Which fruit is yellow and curved?", "choices": ["banana", "apple", "grape", "cherry"]},
    {"question": "What gas do people need to breathe?", "choices": ["oxygen", "helium", "neon", "argon"]},
    {"question": "Where do fish live?", "choices": ["in water", "in trees", "in the sky", "in the desert"]},
    {
        "question": "What is the largest ocean on Earth?",
        "choices": ["the Pacific Ocean", "the Arctic Ocean", "the Indian Ocean", "the Southern Ocean"],
    },
    {
        "question": "Which organ pumps blood through the body?",
        "choices": ["the heart", "the lungs", "the liver", "the stomach"],
    },
    {"question": "What do plants need from the sun to grow?", "choices": ["light", "sound", "wind", "snow"]},
    {
        "question": "Who wrote Romeo and Juliet?",
        "choices": ["William Shakespeare", "Charles Dickens", "Jane Austen", "Mark Twain"],
    },
    {"question": "What is two plus two?", "choices": ["four", "five", "three", "six"]},
    {
        "question": "Which animal is known as the king of the jungle?",
        "choices": ["the lion", "the mouse", "the rabbit", "the sheep"],
    },
]
MC_CHANCE = 1 / 4
GEN_TASK = """task: tcb_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "QA_PREFIX_HEREQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""".replace("QA_PREFIX_HERE", QA_PREFIX)
MC_TASK = """task: tcb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(work: Path, model: str) -> tuple[Path, Path]:
    """The model directory and the task directory (YAML configs over local JSONL files)."""
    if model == "tiny":
        from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

        model_dir = work / "tiny"
        tokenizer = build_tiny_tokenizer()
        build_tiny_model(seed=0, tokenizer=tokenizer).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    elif Path(model).is_dir():  # any local model folder
        model_dir = Path(model)
    else:
        from transformers_cb.models.fetch import fetch_model

        model_dir = fetch_model(model)
    tasks = work / "tasks"
    tasks.mkdir()
    # The right answer at a different position in each question, so that acc is not the same for every doc.
    mc_docs = []
    for i, doc in enumerate(MC_DOCS):
        k = i % len(doc["choices"])
        choices = doc["choices"][-k:] + doc["choices"][:-k] if k else doc["choices"]
        mc_docs.append({**doc, "choices": choices, "label": k})
    for name, docs, template in (("gen", QA_DOCS, GEN_TASK), ("mc", mc_docs, MC_TASK)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (tasks / f"tcb_{name}.yaml").write_text(template.format(path=data))
    return model_dir, tasks


def start_server(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "transformers_cb.cli.main", "serve", "--model", str(model_dir)]
    command += [
        "--served-model-name",
        MODEL_NAME,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    import urllib.request

    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start in 300 s")


def run(command: list[str], log: Path, timeout: float) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the clients' venv, not the project's modules
    with log.open("w") as out:
        try:
            return subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def lm_eval(
    python: str, work: Path, tasks: Path, name: str, model: str, model_args: str, *extra: str, which: str = ""
) -> Path:
    out = work / f"lm_eval_{name}"
    command = [
        python,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        which or "tcb_gen,tcb_mc",
    ]
    command += [
        "--include_path",
        str(tasks),
        "--batch_size",
        "1",
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    code = run(command, work / f"lm_eval_{name}.log", timeout=900)
    if code != 0:
        raise SystemExit(
            f"lm-eval {name} exited {code}:\n{(work / f'lm_eval_{name}.log').read_text()[-4000:]}"
        )
    return out


def load_results(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in ("tcb_gen", "tcb_mc"):
        path = next(out.rglob(f"samples_{task}_*.jsonl"), None)
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()] if path else []
    return results, samples


def compare_lm_eval(hf: Path, api: Path) -> list[str]:
    """Mismatches between the two runs (empty: same scores, same answers)."""
    (hf_results, hf_samples), (api_results, api_samples) = load_results(hf), load_results(api)
    problems = []
    for task, metrics in (("tcb_gen", ("exact_match,none",)), ("tcb_mc", ("acc,none", "acc_norm,none"))):
        for metric in metrics:
            a, b = hf_results[task].get(metric), api_results[task].get(metric)
            if a is None or b is None or abs(a - b) > 1e-9:
                problems.append(f"{task} {metric}: hf {a} vs local-completions {b}")
    for x, y in zip(hf_samples["tcb_gen"], api_samples["tcb_gen"], strict=True):
        if x["filtered_resps"] != y["filtered_resps"]:
            problems.append(f"tcb_gen doc {x['doc_id']}: {x['filtered_resps']!r} vs {y['filtered_resps']!r}")
    for x, y in zip(hf_samples["tcb_mc"], api_samples["tcb_mc"], strict=True):
        for (lx, gx), (ly, gy) in zip(x["filtered_resps"], y["filtered_resps"], strict=True):
            if abs(float(lx) - float(ly)) > LOGLIKELIHOOD_TOLERANCE or str(gx) != str(gy):
                problems.append(f"tcb_mc doc {x['doc_id']}: ({lx}, {gx}) vs ({ly}, {gy})")
    return problems


def score_line(out: Path) -> str:
    results, _ = load_results(out)
    mc, gen = results["tcb_mc"], results["tcb_gen"]
    return (
        f"multiple choice acc {mc['acc,none']:.3f} / acc_norm {mc['acc_norm,none']:.3f} of {len(MC_DOCS)} "
        f"(chance {MC_CHANCE:.2f}); short answers exact match {gen['exact_match,none']:.3f} of {len(QA_DOCS)}"
    )


def above_chance(out: Path) -> bool:
    results, _ = load_results(out)
    return results["tcb_mc"]["acc,none"] > MC_CHANCE and results["tcb_gen"]["exact_match,none"] > 0


def guidellm(python: str, work: Path, url: str, model_dir: Path, profile: str) -> tuple[int, int]:
    """(successful, errored) requests of one guidellm run."""
    out = work / f"guidellm_{profile.replace(',', '_').replace('=', '-')}.json"
    guidellm_bin = str(Path(python).parent / "guidellm")
    command = [guidellm_bin, "run", "--backend", f"kind=openai_http,target={url},model={MODEL_NAME}"]
    command += ["--profile", profile, "--constraint", "kind=max_requests,count=12"]
    command += ["--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16"]
    command += [
        "--tokenizer",
        f"kind=huggingface_auto,model={model_dir}",
        "--output",
        f"kind=json,path={out}",
    ]
    command += ["--disable-progress"]
    code = run(command, out.with_suffix(".log"), timeout=600)
    if code != 0 or not out.exists():
        raise SystemExit(f"guidellm {profile} exited {code}:\n{out.with_suffix('.log').read_text()[-4000:]}")
    report = json.loads(out.read_text())
    totals = report["benchmarks"][0]["scheduler_state"]
    return totals["successful_requests"], totals["errored_requests"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--clients-python", default="/work/venv-clients/bin/python", help="the clients' venv python"
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2: the real model (default); tiny: the built-in random model (scores near chance); or a "
        "local model folder",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tcb-real-clients-"))
    model_dir, tasks = prepare(work, args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(model_dir, port, work / "server.log")
    checks: list[tuple[str, bool, str]] = []
    try:
        hf = lm_eval(args.clients_python, work, tasks, "hf", "hf", f"pretrained={model_dir},dtype=float32",
                     "--device", "cpu")  # fmt: skip
        # lm-eval's hf model encodes with the tokenizer's default (a BOS first), its API models without
        # one unless told: add_bos_token=True makes both score the same token ids.
        api_args = (f"model={MODEL_NAME},base_url={url}/v1/completions,tokenizer={model_dir},add_bos_token=True,"
                    "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
        api = lm_eval(args.clients_python, work, tasks, "completions", "local-completions", api_args)
        problems = compare_lm_eval(hf, api)
        checks.append(("lm-eval local-completions == hf (generate_until + multiple_choice)", not problems,
                       "; ".join(problems[:5])))  # fmt: skip
        scores = score_line(hf)
        if args.model == "tiny":  # random weights: the scores only have to agree
            checks.append((f"scores ({scores})", True, ""))
        else:
            checks.append((f"{Path(args.model).name} scores above chance ({scores})", above_chance(hf), ""))
        chat_args = f"model={MODEL_NAME},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1"
        # Chat has no prompt logprobs (lm-eval runs no log-likelihood task over it): generate-until only.
        chat = lm_eval(args.clients_python, work, tasks, "chat", "local-chat-completions", chat_args,
                       "--apply_chat_template", which="tcb_gen")  # fmt: skip
        chat_results, _ = load_results(chat)
        checks.append(("lm-eval local-chat-completions runs", "tcb_gen" in chat_results, ""))
        has_guidellm = (Path(args.clients_python).parent / "guidellm").exists()
        if not has_guidellm:
            print("SKIP  guidellm (not installed in the clients' venv)")
        for profile in ("kind=synchronous", "kind=concurrent,streams=4") if has_guidellm else ():
            ok, errored = guidellm(args.clients_python, work, url, model_dir, profile)
            checks.append(
                (f"guidellm {profile}: {ok} requests, {errored} errored", ok > 0 and errored == 0, "")
            )
    finally:
        server.terminate()
        server.wait(120)
    for name, passed, detail in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""))
    if args.keep or not all(passed for _, passed, _ in checks):
        print(f"work directory: {work}")
    return 0 if checks and all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
