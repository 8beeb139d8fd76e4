"""The code blocks of the seed documents (shared/seeds/), verbatim, and how each is run.

`000` is the getting-started article, `002` the API guide. Each block is kept exactly as the
document prints it; `adapt()` changes only the model id, the device and the dtype, as the tests
may. Blocks that assume earlier state (a `manager`, `inputs`, ...) get it from a preamble built
from earlier blocks of the same document, never from new API calls of ours.
"""

from __future__ import annotations

import re

# -- 000: the getting-started script (cb_first_run.py) ------------------------------------------
GETTING_STARTED = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import ContinuousBatchingConfig, GenerationConfig

MODEL_ID = "Qwen/Qwen3-0.6B"

tokenizer = AutoTokenizer.from_pretrained(MODEL_ID)
model = AutoModelForCausalLM.from_pretrained(
    MODEL_ID,
    attn_implementation="paged|sdpa",
    device_map="cuda",
    dtype=torch.bfloat16,
)

prompts = [
    "重力を一文で説明してください。",
    "猫の品種を一つ挙げてください。",
    "連続バッチングと固定バッチの違いを三文で説明してください。",
]
inputs = [tokenizer.encode(prompt) for prompt in prompts]

generation_config = GenerationConfig(
    max_new_tokens=64,
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
    do_sample=False,
)
batching_config = ContinuousBatchingConfig(
    max_batch_tokens=256,
    max_requests_per_batch=3,
    use_cuda_graph=False,
    use_async_batching=False,
)

outputs = model.generate_batch(
    inputs=inputs,
    generation_config=generation_config,
    continuous_batching_config=batching_config,
    progress_bar=True,
)

if len(outputs) != len(prompts):
    raise RuntimeError(f"expected {len(prompts)} results, got {len(outputs)}")

for request_id, output in outputs.items():
    text = tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
    print(f"[{request_id}] {text}")
"""

# -- 002: generate_batch ------------------------------------------------------------------------
GENERATE_BATCH = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import ContinuousBatchingConfig, GenerationConfig

model = AutoModelForCausalLM.from_pretrained(
    "Qwen/Qwen3-4B",
    attn_implementation="flash_attention_2",
    device_map="auto",
    dtype=torch.bfloat16,
)
tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen3-4B")

prompts = [
    "What's up?",
    "Name a cat breed.",
    "Write a detailed history of quantum mechanics.",
]
inputs = [tokenizer.encode(p) for p in prompts]

generation_config = GenerationConfig(
    max_new_tokens=64,
    eos_token_id=tokenizer.eos_token_id,
)

outputs = model.generate_batch(inputs=inputs, generation_config=generation_config)

for request_id, output in outputs.items():
    text = tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
    print(f"[{request_id}] {text}")
"""

CONTEXT_MANAGER = """
with model.continuous_batching_context_manager(generation_config=generation_config) as manager:
    manager.add_request(
        input_ids=tokenizer.encode("Write a detailed history of quantum mechanics."),
        request_id="long",
        max_new_tokens=512,
    )
    manager.add_request(
        input_ids=tokenizer.encode("What's up?"),
        request_id="short_0",
        max_new_tokens=32,
    )
    manager.add_request(
        input_ids=tokenizer.encode("Name a cat breed."),
        request_id="short_1",
        max_new_tokens=32,
    )

    for result in manager:
        text = tokenizer.decode(result.generated_tokens, skip_special_tokens=True)
        print(f"[{result.request_id}] {text}")
"""

INIT_AND_START = """
manager = model.init_continuous_batching(generation_config=generation_config)
manager.start()

# submit and retrieve requests...
"""

ADD_REQUEST = """
manager.add_request(input_ids=input_ids, request_id="my_request")
"""
ADD_REQUESTS = """
manager.add_requests(inputs=inputs)
"""
CANCEL_REQUEST = """
manager.cancel_request(request_id="my_request")
"""
ITERATE_RESULTS = """
for result in manager:
    print(tokenizer.decode(result.generated_tokens, skip_special_tokens=True))
"""
GET_RESULT = """
# next available result
result = manager.get_result()

# filter for a specific request
result = manager.get_result(request_id="my_request")
"""
STREAMING = """
from transformers.generation.continuous_batching import RequestStatus

manager.add_request(input_ids=input_ids, request_id="streamed", streaming=True)

for chunk in manager.request_id_iter(request_id="streamed"):
    token = tokenizer.decode(chunk.generated_tokens[-1:], skip_special_tokens=True)
    print(token, end="", flush=True)
    if chunk.status == RequestStatus.FINISHED:
        break
"""
STOP = """
manager.stop()
"""
HARD_STOP = """
manager.stop(hard_stop=True)
"""
DESTROY = """
manager.destroy()
"""

# Per-request sampling: the document shows the config, then submissions to a manager built from it.
PER_REQUEST_CONFIG = """
cb_config = ContinuousBatchingConfig(per_request_processors=True)
"""
PER_REQUEST_SUBMIT = """
# each request gets its own sampling parameters
manager.add_request(input_ids=inputs_a, temperature=0.9, top_p=0.95)
manager.add_request(input_ids=inputs_b, temperature=0.1, top_k=10)
"""

CONFIG_AND_GENERATE = """
from transformers.generation import ContinuousBatchingConfig

cb_config = ContinuousBatchingConfig(
    max_memory_percent=0.8,
    page_size=256,           # KV cache page size in tokens
    scheduler_type="fifo",        # "fifo" or "prefill_first"
)

outputs = model.generate_batch(
    inputs=inputs,
    generation_config=generation_config,
    continuous_batching_config=cb_config,
)
"""

# Config blocks that the document follows with a generate_batch call (the "# generate_batch()" step).
CONFIG_BLOCKS = {
    "page_size": "cb_config = ContinuousBatchingConfig(page_size=128)",
    "max_batch_tokens": "cb_config = ContinuousBatchingConfig(max_batch_tokens=16384)",
    "max_requests_per_batch": "cb_config = ContinuousBatchingConfig(max_requests_per_batch=256)",
    "safety_margin": "cb_config = ContinuousBatchingConfig(safety_margin=0.15)",
    "cuda_graph": "cb_config = ContinuousBatchingConfig(use_cuda_graph=True)",
    "cuda_graph_padding": """cb_config = ContinuousBatchingConfig(
    use_cuda_graph=True,
    q_padding_interval_size=64,
    kv_padding_interval_size=16384,
)""",
    "async_batching": """cb_config = ContinuousBatchingConfig(
    use_cuda_graph=True,
    use_async_batching=True,
)""",
    "max_blocks_per_request": "cb_config = ContinuousBatchingConfig(max_blocks_per_request=64)",
    "no_fast_path": "cb_config = ContinuousBatchingConfig(max_blocks_per_request=0)",
    "cpu_group_timeout": "cb_config = ContinuousBatchingConfig(cpu_group_timeout=600.0)",
    "block_sharing": """cb_config = ContinuousBatchingConfig(
    allow_block_sharing=True,  # default
)""",
    # The guide's note: `block_size` is deprecated in favour of `page_size`.
    "block_size_deprecated": "cb_config = ContinuousBatchingConfig(block_size=128)",
}

RETURN_LOGPROBS = """
cb_config = ContinuousBatchingConfig(return_logprobs=True)

# generate_batch()

for request_id, output in outputs.items():
    for token_id, log_prob in zip(output.generated_tokens, output.logprobs):
        token = tokenizer.decode([token_id])
        print(f"{token} | logprob: {log_prob}")
"""

# Config blocks whose feature belongs to a later issue (xfail until it lands).
COMPILE = "cb_config = ContinuousBatchingConfig(default_compile_level=1)"
CPU_OFFLOAD = "cb_config = ContinuousBatchingConfig(cpu_offload_space=8.0)"

FLASH_LOAD = """
model = AutoModelForCausalLM.from_pretrained(
    "Qwen/Qwen3-4B",
    attn_implementation="flash_attention_2",
    device_map="auto",
    dtype=torch.bfloat16,
)
"""

SLIDING_WINDOW = """
from transformers import AutoConfig, AutoModelForCausalLM

config = AutoConfig.from_pretrained("google/gemma-2-2b")
config.sliding_window = 4096

model = AutoModelForCausalLM.from_pretrained(
    "google/gemma-2-2b",
    config=config,
    attn_implementation="sdpa",
    device_map="auto",
    dtype=torch.bfloat16,
)
"""

# -- 002: tensor parallelism (cb_tp.py, launched with `torchrun --nproc-per-node 4 cb_tp.py`) ----
TENSOR_PARALLEL = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig
from transformers.generation import ContinuousBatchingConfig, GenerationConfig

distributed_config = DistributedConfig(tp_size=4)
model = AutoModelForCausalLM.from_pretrained(
    "Qwen/Qwen3-32B",
    attn_implementation="flash_attention_2",
    distributed_config=distributed_config,
)
tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen3-32B")

inputs = [tokenizer.encode(p) for p in ["What's up?", "Name a cat breed."]]
generation_config = GenerationConfig(max_new_tokens=64, eos_token_id=tokenizer.eos_token_id)

outputs = model.generate_batch(inputs=inputs, generation_config=generation_config)
"""
TENSOR_PARALLEL_LAUNCH = "torchrun --nproc-per-node 4 cb_tp.py"

_MODEL_IDS = re.compile(r'"(Qwen/Qwen3-0\.6B|Qwen/Qwen3-4B|Qwen/Qwen3-32B|google/gemma-2-2b)"')


def adapt(code: str, model_dirs: dict[str, str], keep_dtype: bool = False) -> str:
    """The block with only the model id (a local directory), device (cpu) and dtype (float32, unless
    `keep_dtype`: the document's own bfloat16) changed."""
    code = _MODEL_IDS.sub(lambda m: repr(model_dirs[m.group(1)]), code)
    code = code.replace('device_map="cuda"', 'device_map="cpu"').replace(
        'device_map="auto"', 'device_map="cpu"'
    )
    return code if keep_dtype else code.replace("torch.bfloat16", "torch.float32")


def with_attn(code: str, attn_implementation: str) -> str:
    """A variant of a block with another attention implementation (used beside the verbatim block)."""
    return code.replace(
        'attn_implementation="flash_attention_2"', f'attn_implementation="{attn_implementation}"'
    )
