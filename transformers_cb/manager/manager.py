"""`ContinuousBatchingManager`: a background thread that runs the engine while requests arrive.

The public class owns its parts and hands each the ones it works with: the shared state and its lock
(state.py), the loop thread around `Engine.step()` (loop.py), submissions and cancellations
(submissions.py), the results router and its channels (results.py, channels.py), the throughput window
and the stats snapshot (stats.py), starting and stopping the thread (lifecycle.py), the pauses and the weight
check they owe (pausing.py); the thread settings (threads.py) travel into the loop's thread. This module is
the public API. See docs/manager.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor

from ..config.continuous_batching import ContinuousBatchingConfig
from ..config.interop import WorkloadHints, as_cb_config, as_workload_hints
from ..engine.build import build_engine
from ..engine.engine import Engine
from ..engine.weights.adapter_registry import UNSET, Unset
from ..requests import GenerationOutput
from ..sampling.structured.guided import GuidedDecoding
from ..scheduler.weight_updates import check_update_mode
from .adapters import ManagerAdapters
from .compat import BuiltinManagerAttributes, OutputRouterView
from .delivery.channels import async_channel, blocking_channel, shared_channel
from .delivery.results import Deliver, ResultRouter
from .holds.pausing import Pauses
from .lifecycle import Lifecycle
from .loop import ManagerLoop
from .state import BackgroundThreadStatus, ManagerState
from .stats import ManagerStats, ThroughputWindow, snapshot
from .submissions import SubmissionOptions, Submissions
from .torch_threads.adaptive_threads import AdaptiveThreads

logger = logging.getLogger(__name__)

# destroy() lets queued and running requests finish for this long, then hard-stops them.
DESTROY_GRACE_S = 10.0


class ContinuousBatchingManager(BuiltinManagerAttributes):
    """Serve requests with continuous batching from a background thread.

    Create it with `model.init_continuous_batching(...)` or
    `model.continuous_batching_context_manager(...)`. See docs/manager.md.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | Mapping[str, object] | object = None,
        workload_hints: WorkloadHints | Mapping[str, int] | object = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        logits_processor: Sequence[LogitsProcessor] | None = None,
        *,
        all_request_stages: bool = False,
        assistant_model: PreTrainedModel | None = None,
        adaptive_threads: AdaptiveThreads | None = None,
    ) -> None:
        """`all_request_stages`: the engine builds every per-request processor stage, and a request
        that gives no value for one uses its neutral value (the server's manager: each request brings
        its own values; see `SamplingSetup`). `assistant_model`: a draft model for speculative decoding
        (docs/speculative_decoding.md). `adaptive_threads`: the manager thread's torch threads follow the
        cores other processes leave idle while it runs (manager/torch_threads/adaptive_threads.py; the server's, on CPU)."""
        self.model = model
        hints = as_workload_hints(workload_hints)
        engine = build_engine(
            model,
            generation_config,
            as_cb_config(continuous_batching_config),
            tokenizer,
            logits_processor,
            workload=hints.workload() if hints is not None else None,
            all_request_stages=all_request_stages,
            assistant_model=assistant_model,
        )
        self.max_queue_size = engine.settings.scheduler.max_queue_size
        self._state = ManagerState(engine)
        self._router = ResultRouter()
        self._throughput = ThroughputWindow()
        self.adaptive_threads = adaptive_threads
        self._loop = ManagerLoop(
            self._state, self._router, self._throughput, model, self._release_engine, adaptive_threads
        )
        self._submissions = Submissions(self._state, self._router, self._loop)
        self._pauses = Pauses(self._state, self._loop)  # pause() blocks and the weight check they owe
        # Start, stop, destroy; the session's step driver (compat: `batch_processor`).
        self._lifecycle: Lifecycle = Lifecycle(self, model, self._state, self._loop, self._router)
        self.output_router = OutputRouterView(self._router)  # compat: `.output_queue` (compat.py)
        # The model's PEFT adapters while requests run: in use, load, update, unload (docs/adapters.md).
        self.adapters = ManagerAdapters(model, self._state, self.pause)

    @property
    def engine(self) -> Engine | None:
        """The engine the loop drives (None once destroyed). Only the loop thread touches it while the
        manager runs; read it from elsewhere inside `pause()`."""
        return self._state.engine

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def background_thread_status(self) -> BackgroundThreadStatus:
        """`.fatal_error`: None while the thread lives (or has not started), the exception once it died."""
        return self._state.thread_status

    def start(self) -> None:
        """Start the background thread (again after `stop()`). Raises `RuntimeError` after `destroy()`,
        `ManagerDeadError` (a `RuntimeError`) if the thread died."""
        self._lifecycle.start()

    def is_running(self) -> bool:
        return self._loop.is_running()

    @property
    def is_destroyed(self) -> bool:
        return self._state.destroyed

    @property
    def warmed_up(self) -> bool:
        return self.engine is not None and self.engine.warmed_up

    def warmup(self) -> None:
        """Run a throw-away prefill and decode step now, so the first request does not pay for
        first-call costs. Once per manager; only before `start()` (a running manager skips it)."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("this ContinuousBatchingManager was destroyed")
        if engine.warmed_up:
            return
        if self.is_running():
            logger.warning("ContinuousBatchingManager.warmup(): skipped, the manager is already running")
            return
        with engine.session():
            engine.warmup()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Refuse new submissions and end the thread: after finishing queued and active requests
        (default), or at once with every unfinished request failed by a `RuntimeError` (`hard_stop`).

        With `block`, wait up to `timeout` seconds (None: no limit) for the thread (see `join`). With
        `keep_for_next_session`, the manager is cached on the model and the next
        `init_continuous_batching` / context returns it.

        On a manager that is not running, every request still queued ends at once (FAILED, with the
        reason): nothing would ever run it; with `keep_for_next_session` they wait for the next
        session instead. Raises `RuntimeError` for a blocking graceful stop from inside `pause()` (the
        paused loop could never finish the queue)."""
        if self._pauses.held_here() and block and not hard_stop and self.is_running():
            raise RuntimeError(
                "stop() from inside pause() would wait forever: the loop is paused and cannot finish the "
                "queue; leave the pause first, or use hard_stop=True / block=False"
            )
        self._lifecycle.stop(block, timeout, keep_for_next_session, hard_stop)

    def join(self, stop_trigger_time: float, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: no limit) for the thread to end after a stop requested at
        `stop_trigger_time` (`time.perf_counter()`); logs how long it took, or that it is still running."""
        self._lifecycle.join(stop_trigger_time, timeout)

    def destroy(self, block: bool = True, grace_period: float | None = DESTROY_GRACE_S) -> None:
        """Stop and release the cache; the manager cannot restart afterwards. Idempotent.

        Queued and running requests get `grace_period` seconds to finish (None: no limit), then the
        rest is hard-stopped (each gets a FAILED final result). `block=False` returns at once: the
        thread finishes the queue gracefully and releases the cache when it ends."""
        self._lifecycle.destroy(block, grace_period)

    def _release_engine(self) -> None:
        """The end of `destroy()` (on the loop thread after a non-blocking one): drop the engine, and the
        cache with it, and the model's reference to this manager."""
        self._lifecycle.release_engine()

    def pause(self, mode: str = "keep") -> AbstractContextManager[None]:
        """Hold the loop between two steps (pages and in-flight requests kept), e.g. to update weights.

        When the block ends (the last one, if several threads pause), the loop checks the weights before
        its next step: if they changed (a parameter's version counter or address moved, or
        `weights_updated()` was called inside), the weight version goes up, no KV page computed before is
        reused by a later request, and the requests in flight are treated by `mode`: `"keep"` (they go on
        on their KV; tokens from now on come from the new weights), `"recompute"` (their KV is dropped and
        they run prompt + tokens so far again under the new weights) or `"abort"` (they end at once, status
        `ABORTED`, with the tokens they had). The block's exit returns once that is done, so a request
        submitted afterwards runs wholly on the new weights. See docs/manager.md, "Weight updates".

        Raises `ValueError` for an unknown `mode` at the call, before pausing anything."""
        return self._pauses.paused(check_update_mode(mode))

    def weights_updated(self, mode: str = "keep") -> None:
        """Say that the model's weights changed in a way no version counter shows (`param.data = ...`,
        `load_state_dict(assign=True)`, an optimizer writing through views or `.data`): the change is
        applied as a pause's would be (a new weight version; no KV page computed before is reused; the
        requests in flight treated by `mode`, see `pause`). Inside a `pause()` block it is applied when the
        block ends (the stricter of the two modes); outside, at once (a pause of its own). Raises
        `ValueError` for an unknown `mode`."""
        self._pauses.weights_updated(check_update_mode(mode))

    def release_cache(self) -> None:
        """Give the cache's memory back while a trainer trains: the loop leaves its run session (the model
        is plain again: attention backend, no packed forward), every request in flight drops its KV (it runs
        prompt + tokens so far again after the resume), and the device cache, the host tier and the packed
        copies of the weights are freed. Returns once they are. Submissions are accepted and wait; a second
        call is a no-op. `ValueError` where it is not supported (tensor parallelism, state layers, CUDA
        graphs, a draft model). See docs/manager.md, "Releasing the cache"."""
        self._loop.cache_release.release()

    def resume_cache(self) -> None:
        """Allocate the cache again (the same size) and check the weights (a change while released is a new
        weight version); returns once the loop runs its queue again. A no-op when nothing is released."""
        self._loop.cache_release.resume()

    @property
    def cache_released(self) -> bool:
        """Whether the cache is released now (between `release_cache()` and `resume_cache()`)."""
        return self._loop.cache_release.released()

    @property
    def weight_version(self) -> int:
        """The version of the model's weights: 0 at creation, one more at each change (`stats().weight_version`
        too; each output says which versions produced its tokens)."""
        engine = self.engine
        return engine.weight_version if engine is not None else 0

    # -- submissions -------------------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        guided: GuidedDecoding | dict[str, object] | type | None = None,
        max_staleness: int | None = None,
        adapter: str | Unset | None = UNSET,
        **logit_processor_kwargs: object,
    ) -> str | None:
        """Submit one request and return its id, or None (with a warning) after `stop()`.

        `record_timestamps` gives the outputs `timestamps` (one `time.perf_counter()` per token);
        `logit_processor_kwargs` are per-request sampling parameters and outputs (`temperature`,
        `top_k`, `top_p`, `min_p`, `repetition_penalty`, `seed`, `stop_strings`, `top_logprobs`,
        `prompt_logprobs`; docs/sampling.md), and `num_return_sequences` (default: the generation
        config's): n > 1 also gives results for the siblings `f"{request_id}__child#{i}"`,
        i < n - 1, which share the prompt's KV pages (docs/prefix_sharing.md).
        `guided`: the output must match a JSON schema, regex, choice list or grammar (a `GuidedDecoding`,
        a dict such as `{"json": schema}`, or a pydantic model class; needs the `structured` extra and
        the manager's tokenizer; docs/structured_outputs.md). One that does not compile is a `ValueError`
        with the grammar library's message. `max_staleness`: the most weight versions the request's KV may
        lag behind the model's: past it, a weight update recomputes its KV (aborts it under
        `pause(mode="abort")`); None: any (docs/manager.md, "Weight updates"). `adapter`: the PEFT
        adapter's name, None for the base model, not given for the model's active adapter(s); an unknown
        one is a `ValueError` naming the known ones (docs/adapters.md).

        Raises:
            ValueError: bad input (empty prompt, token outside the vocabulary, `max_new_tokens <= 0`,
                too long for the model or the whole cache, a bad per-request parameter, a negative
                `max_staleness`) or a duplicate live `request_id`.
            queue.Full: `max_queue_size` requests are already waiting to be scheduled.
            RuntimeError: the manager was destroyed.
        """
        kwargs = {
            **logit_processor_kwargs,
            "guided": guided,
            "max_staleness": max_staleness,
            "adapter": adapter,
        }
        options = SubmissionOptions.of(max_new_tokens, streaming, eos_token_id, record_timestamps, kwargs)
        ids = self._submissions.submit([(input_ids, request_id)], options, False, self.max_queue_size)
        return None if ids is None else ids[0]

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        guided: GuidedDecoding | dict[str, object] | type | Sequence[object] | None = None,
        max_staleness: int | None = None,
        adapter: str | Unset | Sequence[str | None] | None = UNSET,
        **logit_processor_kwargs: object,
    ) -> list[str] | None:
        """Submit many requests at once and return their ids in input order, or None (with a
        warning) after `stop()`. All or nothing: if any input is invalid (`ValueError` naming
        `inputs[i]`), none is submitted. Other arguments as in `add_request`.

        With prefix sharing on (`allow_block_sharing`), the requests reach the scheduler sorted by
        prompt, so that prompts sharing a prefix run one after the other and hit the prefix cache;
        ids are still given in input order. `guided`: one constraint for all inputs, or a list with one
        per input (None: unconstrained); `adapter` likewise."""
        items = [(input_ids, None) for input_ids in inputs]
        kwargs = {
            **logit_processor_kwargs,
            "guided": guided,
            "max_staleness": max_staleness,
            "adapter": adapter,
        }
        options = SubmissionOptions.of(
            max_new_tokens, streaming, eos_token_id, record_timestamps, kwargs, num_items=len(items)
        )
        return self._submissions.submit(items, options, True, self.max_queue_size)

    def cancel_request(self, request_id: str) -> None:
        """Cancel a pending or running request: its pages are freed at the next step boundary and
        it receives one final result with status CANCELLED. Unknown ids only log a warning."""
        self._submissions.cancel(request_id)

    # -- results -----------------------------------------------------------------------
    def get_result(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> GenerationOutput | None:
        """The next output in the shared queue: final results of unclaimed requests, and the partial
        outputs of unclaimed streaming requests before their final one, in order. With `request_id`,
        the next one of that request (the others stay queued).

        Returns None on timeout, or at once when no such output can arrive any more. Raises
        `ManagerDeadError` if the thread died and nothing is left, and `RuntimeError` when, without a
        timeout, outputs are outstanding but the manager is not running (it would wait forever)."""
        return self._router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Yield what `get_result()` returns, as it arrives, until nothing unclaimed is outstanding.

        Raises `ManagerDeadError` if the thread died, `RuntimeError` if requests are outstanding
        but the manager is not running.
        """
        return shared_channel(self._router, self.is_running)

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Yield the outputs of `request_id` not yet delivered to anyone (growing partials if streaming),
        ending with its final one.

        The request is claimed at the call: later outputs no longer reach `get_result()`. A new iterator
        resumes where the previous one stopped, so `next(manager.request_id_iter(rid))` per chunk loses
        and repeats nothing. Raises `KeyError` (`UnknownRequestError`) at the call for an unknown id or
        one whose final output was already delivered, and `RuntimeError` while waiting if the manager is
        not running."""
        return blocking_channel(self._router, request_id)

    def stream(self, request_id: str) -> AsyncIterator[GenerationOutput]:
        """`async for output in manager.stream(request_id)`: the asyncio counterpart of `request_id_iter`.

        Call it inside a running event loop; the loop is never blocked by the manager."""
        return async_channel(self._router, request_id)

    def register_result_handler(self, request_id: str, callback: Deliver) -> None:
        """Call `callback(output)` for each output of `request_id` (partials if streaming, then the
        final one), in order and one at a time. Exceptions in the callback are logged.

        Registered inside a running event loop, the callback runs on that loop (as in transformers);
        otherwise on the manager thread. An id not submitted yet is remembered and attached when a
        request with that id is submitted."""
        self._router.register_handler(request_id, callback)
        with self._state.lock:
            self._state.lock.notify_all()  # a backlog handed to the loop thread: wake it

    def stats(self) -> ManagerStats:
        """A snapshot of the queue, the cache and the counters (see `ManagerStats`)."""
        with self._state.lock:
            return snapshot(self._state, self._throughput)
