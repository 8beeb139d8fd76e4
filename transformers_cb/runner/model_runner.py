"""The runner: everything that touches the device for one step.

It executes the step's plan (`StepPlan`, scheduler/step_plan.py) in order: the forks' copies, the host-tier
swaps (it owns the `SwapCopier`), the block-table rows to release, each copy and swap dispatched by
group (the KV groups' pages to the paged cache and the copier, a model's state-slot group, after the KV
groups, to its `StateCache`); then it
packs the scheduled batch, runs the transformers model's own forward once
(with the paged attention metadata passed through the attention kwargs: `model_call.py`),
computes logits only for positions that produce a token (and, for requests that
ask for prompt logprobs, their prompt positions), and samples. It returns a
`StepOutput` and mutates no `Request`: the engine's scheduler applies it (`update`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from ..attention.backends.fast_path import prepare_flash_step
from ..invariants import check, present
from ..kv.page_keys import PageCopy
from ..kv.swap_plan import SwapPlan
from ..memory.state_cache import swap_states
from ..memory.swap import SwapCopier
from ..requests import Request
from ..sampling.sampled_token import SampledToken
from ..sampling.sampler import Sampler
from ..scheduler.step_plan import StepPlan
from .adapter_rows import AdapterRows, adapter_step, step_adapters
from .forward.compiling import DECODE, VARLEN, PathForwards
from .forward.cuda_graphs import make_graph_steps
from .forward.model_call import call_model
from .layer_ops.direct_model import DirectModel
from .media.media_runner import MediaRunner, NoMedia
from .packing import MIN_COMPILED_TABLE_COLUMNS, BatchPacker, PackedStep
from .request_rotary import NoRotary, RequestRotary
from .states.state_layers import NoStateLayers, StateLayers
from .verified_step import verified_tokens

if TYPE_CHECKING:
    from ..sampling.logits.processors import Stage
    from .step_options import StepOptions


@dataclass
class StepOutput:
    """`sampled[i]`: the tokens of the i-th sampling entry, in `batch.entries` order: one token, or for a
    speculating entry its verified run (its accepted draft tokens, then the target's own: vLLM's
    `sampled_token_ids`; runner/verified_step.py); `prompt_logprobs`: request id -> raw-model
    log-probabilities of the prompt tokens this step scored (in order); `prompt_top_logprobs`: the same
    positions' best alternatives, for requests with `top_logprobs`."""

    sampled: list[list[SampledToken]] = field(default_factory=list)
    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_top_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


class ModelRunner:
    """Args: options: backend, fast path, compile settings and graphs; swapper: the copier between the
    device and the host tier (None: no CPU offload); states: the model's state layers and their slots'
    tensors (None: no state layers); media: the encoder and the embedding store of a model that takes
    images / videos / audio (runner/media/media_runner.py; None: text only).

    The optional parts the forward calls at every step are held as null objects in place of None
    (`NoStateLayers`, `NoRotary`, `NoMedia`: nothing installed, encoded or carried), as the scheduler holds
    `NoOffload`: no step asks whether the model has state layers, a dynamic rotary or media."""

    def __init__(
        self,
        model: PreTrainedModel,
        packer: BatchPacker,
        sampler: Sampler,
        options: StepOptions,
        swapper: SwapCopier | None = None,
        states: StateLayers | None = None,
        media: MediaRunner | None = None,
    ) -> None:
        self.model = model
        self.states: StateLayers | NoStateLayers = states if states is not None else NoStateLayers()
        # A dynamic rotary embedding (LongRoPE, dynamic NTK): each request's own frequencies.
        rotary = RequestRotary.of(model, packer.rope_rule)
        self.rotary: RequestRotary | NoRotary = rotary if rotary is not None else NoRotary()
        self.media: MediaRunner | NoMedia = media if media is not None else NoMedia()
        self.packer = packer
        self.sampler = sampler
        self.swapper = swapper
        # Copies and swaps of this group are state slots (`PageManager.slot_group`): right after the KV groups.
        self.slot_group = len(packer.cache.group_tensors)
        self.device = packer.device
        self.options = options
        self.forwards = PathForwards(model, options.compile_settings)
        self.graphs = make_graph_steps(model, packer, options, self.forwards)
        compiled = self.forwards.settings
        if (compiled.varlen is not None or compiled.decode is not None) and not options.is_flash:
            packer.min_table_columns = MIN_COMPILED_TABLE_COLUMNS
        # A 4D mask makes transformers' mask builders return early: the paged kernels mask by construction.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # The head sees the kept rows only: its adapter groups are theirs (runner/adapter_rows.py).
        self._head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.adapter_rows = AdapterRows()
        # A Llama-form model's eager steps through its modules, without its forwards (runner/layer_ops/direct_model.py).
        self.direct_model = DirectModel(model)

    @contextmanager
    def session(self) -> Iterator[None]:
        """The runner's part of the run session (`Engine.session`): the state layers' split forwards and
        the per-request rotary forwards (runner/request_rotary.py), installed once for the run (nothing
        without either)."""
        with (
            self.states.session(),
            self.rotary.session(),
            self.adapter_rows.session(),
            self.direct_model.session(),
        ):
            yield

    # -- the sampler: replaced only through these two ---------------------------------------------
    def replace_stages(self, stages: list[Stage]) -> None:
        """Sample through `stages` from now on (the engine's `clear_logits_processors`); the default
        (argmax or draw) and the guided decoding masks stay."""
        self.sampler = Sampler(stages, self.sampler.do_sample, self.device, self.sampler.grammars)

    @contextmanager
    def plain_greedy_sampler(self) -> Iterator[None]:
        """Inside: argmax with no processing stage and no guided masks (the engine's warmup, whose
        request has no sampling state, so it draws from no generator a real request uses)."""
        sampler, self.sampler = self.sampler, Sampler([], False, self.device)
        try:
            yield
        finally:
            self.sampler = sampler

    @torch.inference_mode()
    def apply(self, batch: StepPlan) -> None:
        """The step's plan before its forward: fork copies (they read the last forward's KV, which a
        swap may move or hand over), then swaps, then the rolled-back and the released block-table rows."""
        if batch.copies:
            self._copy(batch.copies)
        if batch.swaps is not None:
            self._swap(batch.swaps)
        for item in batch.taken_back:
            self.packer.take_back(item.request, item.end_pages)
        self.release(batch.released)

    def _copy(self, copies: list[PageCopy]) -> None:
        """Run copies `(group, source, destination)`: the KV groups' pages, then the slot group's states
        (none without state layers)."""
        slot_group = self.slot_group
        pages = [copy for copy in copies if copy[0] != slot_group]
        if pages:
            self.packer.cache.copy_pages(pages)
        slots = [(source, destination) for group, source, destination in copies if group == slot_group]
        if slots:
            present(self.states.cache, "state copies planned without state layers").copy_slots(slots)

    def _swap(self, plan: SwapPlan) -> None:
        """Run the host-tier swaps: the slot group's states, then the KV groups' pages."""
        out, back = plan.pairs(self.slot_group)
        if out or back:
            cache = present(self.states.cache, "state swaps planned without state layers")
            host = present(self.states.host, "state swaps planned without a host tier")
            swap_states(cache, host, out, back)
        pages = plan.head(min(plan.num_groups, self.slot_group))
        check(self.swapper is not None or pages.is_empty, "swaps planned without a host tier")
        if self.swapper is not None:
            self.swapper.run(pages)

    def release(self, requests: list[Request]) -> None:
        """Give the block-table rows of `requests` back (their pages were freed)."""
        for request in requests:
            self.packer.release_request(request)
            self.media.release(request)

    def encode_media(self, batch: StepPlan) -> dict[str, str]:
        """Encode the media of the plan's `encode` requests into the store; `{request id: why}` for those
        that failed (the engine fails only them, before the step runs)."""
        if not batch.encode:
            return {}
        return self.media.encode(batch.encode)

    @torch.inference_mode()
    def run(self, batch: StepPlan) -> StepOutput:
        """Run one step (`batch.entries` not empty): its plan, then the forward and the sampling."""
        self.apply(batch)
        step = self.packer.pack(batch)
        logits, prompt_logits = self._forward(step)
        self.media.after_step(step.ordered)
        if any(entry.draft for entry in step.sampling_entries):
            verified = verified_tokens(self.sampler, logits.float(), step.sampling_entries, batch)
            output = StepOutput(sampled=verified)
        else:
            output = self._sample(logits, step, batch)
        if prompt_logits is not None:
            output.prompt_logprobs, output.prompt_top_logprobs = _prompt_logprobs(step, prompt_logits.float())
        return output

    def _sample(self, logits: torch.Tensor, step: PackedStep, batch: StepPlan) -> StepOutput:
        """One token per sampling entry (no speculation in the step)."""
        samples = self.sampler.sample(logits, [entry.request for entry in step.sampling_entries])
        by_entry = {}
        for i, entry in enumerate(step.sampling_entries):
            by_entry[id(entry)] = SampledToken(
                samples.tokens[i],
                None if samples.logprobs is None else samples.logprobs[i],
                None if samples.top_logprobs is None else samples.top_logprobs[i],
            )
        return StepOutput(sampled=[[by_entry[id(entry)]] for entry in batch.entries if entry.samples])

    @torch.inference_mode()
    def forward(self, batch: StepPlan) -> None:
        """A tensor-parallel follower's step: the plan, then the forward (when there are entries)
        without sampling; rank 0 samples."""
        self.apply(batch)
        if batch.entries:
            self._forward(self.packer.pack(batch))

    def _forward(self, step: PackedStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the logits `[S, vocab]` of the sampled positions, and `[P, vocab]` of the prompt-logprob
        positions (None when no request asks for them), in the model's dtype: a greedy step's argmax reads
        them as they are (widening bf16 to float32 is exact, so the argmax and its ties are float32's), the
        other consumers widen them first (`Sampler.sample`, verification, prompt logprobs). Widening every
        step's rows cost a float32 copy of them each step (32 rows x 49,152: 6 MB written and read again)."""
        num_sampled = step.logits_indices.numel()
        keep = step.logits_indices
        if step.prompt_indices:
            extra = torch.tensor(step.prompt_indices, dtype=torch.int64, device=self.device)
            keep = torch.cat([keep, extra])
        if keep.numel() == 0:
            # A step of prefill chunks only: keep one position so shapes stay valid, discard it.
            keep = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.options.is_flash:
            prepare_flash_step(step.metadata, self.options.max_blocks_per_request)
        path = DECODE if step.metadata.max_seqlen_q == 1 else VARLEN
        adapters = step_adapters(
            [entry.request for entry in step.ordered],
            [entry.num_tokens for entry in step.ordered],
            keep,
            self._head,
        )
        media = self.media.step_inputs(step.ordered, step.input_ids)
        if adapters is not None or media.inputs_embeds is not None or media.position_ids is not None:
            # The eager forward: requests on adapters (runner/adapter_rows.py groups rows in Python; no graph or
            # compiled path captures one step's groups), or embeddings / 3-D positions (the compiled paths and
            # graphs take token ids and 1-D positions; one token's path is never compiled).
            with (
                self.states.step(step.states),
                self.rotary.step(),
                self.adapter_rows.step() if adapters is not None else nullcontext(),
                adapter_step(adapters),
                self.media.carried(media),
            ):
                logits = call_model(
                    self.forwards(path, 1),
                    step.input_ids,
                    media.position_ids if media.position_ids is not None else step.position_ids,
                    self._no_mask,
                    keep,
                    step.metadata,
                    self.options.select_logit_rows,
                    inputs_embeds=media.inputs_embeds,
                )
            return logits[:num_sampled], (logits[num_sampled:] if step.prompt_indices else None)
        if self.graphs is not None and not step.prompt_indices:
            # Graphs follow transformers' split: the decode graph is the fast path's, the rest is varlen.
            graph_path = DECODE if step.metadata.decode_fast_path is not None else VARLEN
            if self.graphs.covers(graph_path):
                return self.graphs.run(step, graph_path)[:num_sampled], None
        traceable = step.metadata.all_native or self.options.is_flash
        forward = self.forwards(path, step.input_ids.shape[1], traceable)
        with self.states.step(step.states), self.rotary.step():
            direct = (
                self.direct_model.logits(step.input_ids, step.position_ids, keep, step.metadata)
                if forward is self.forwards.eager and not self.options.select_logit_rows
                else None
            )
            logits = (
                direct
                if direct is not None
                else call_model(
                    forward,
                    step.input_ids,
                    step.position_ids,
                    self._no_mask,
                    keep,
                    step.metadata,
                    self.options.select_logit_rows,
                )
            )  # [S (+ P), vocab]
        if not step.prompt_indices:
            return logits[:num_sampled], None
        return logits[:num_sampled], logits[num_sampled:]


def _prompt_logprobs(
    step: PackedStep, logits: torch.Tensor
) -> tuple[dict[str, list[float]], dict[str, list[dict[int, float]]]]:
    """Raw-model log-probability of each scored prompt token (what log-likelihood evaluation uses),
    and, for requests asking for `top_logprobs=k`, the k best tokens at each of those positions."""
    targets = []
    for request, first, count in step.prompt_spans:
        targets.extend(request.all_token_ids[first : first + count])
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device)[:, None]
    logprobs = logits.log_softmax(dim=-1)
    values = logprobs.gather(1, index).squeeze(1).tolist()
    scored: dict[str, list[float]] = {}
    tops: dict[str, list[dict[int, float]]] = {}
    offset = 0
    for request, _first, count in step.prompt_spans:
        scored.setdefault(request.request_id, []).extend(values[offset : offset + count])
        # Only requests that want prompt logprobs have spans, and those have sampling state.
        sampling = present(request.sampling, "a prompt-logprobs request has sampling state")
        k = min(sampling.params.top_logprobs, logprobs.shape[-1])
        if k:
            best, ids = logprobs[offset : offset + count].topk(k, dim=-1)
            rows = [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), best.tolist(), strict=True)]
            tops.setdefault(request.request_id, []).extend(rows)
        offset += count
    return scored, tops
