"""The peer column: transformers' built-in continuous batching on the same subject.

`import transformers_cb` replaces `PreTrainedModel.generate_batch`; the worker runs this after ours, in its
own forked process, so it uninstalls the plugin first and calls the built-in `generate_batch` with the
settings of our blocking run (4-token pages, a 16-token step budget, prefix sharing) and a cache of
BUILTIN_PAGES pages (sized from free memory it allocates gigabytes per type on CPU, seconds each, where ours
caps the cache to the known workload). The built-in logs and
swallows errors and returns what finished: a missing or failed request is a crash; an error raised at
set-up (e.g. "Invalid layer type") is its refusal.
"""

from __future__ import annotations

from .build import Generated, Subject, greedy
from .judge import RunFailed, judge, judge_error
from .ours import PAGE_SIZE, STEP_TOKENS
from .outcome import Outcome

BUILTIN_PAGES = 64  # twice what the four prompts need at once


def run_builtin(subject: Subject) -> Outcome:
    from transformers.generation import ContinuousBatchingConfig

    import transformers_cb.plugin

    transformers_cb.plugin.uninstall()
    config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE, max_batch_tokens=STEP_TOKENS, num_blocks=BUILTIN_PAGES, allow_block_sharing=True
    )
    try:
        results = subject.model.generate_batch(
            subject.prompts, greedy(), continuous_batching_config=config, progress_bar=False
        )
        outputs = list(results.values())
        if len(outputs) != len(subject.prompts):
            raise RunFailed(
                f"{len(subject.prompts) - len(outputs)} of {len(subject.prompts)} requests never finished"
            )
        for i, out in enumerate(outputs):
            if out.error is not None:
                raise RunFailed(f"request {i} failed: {out.error}")
    except RunFailed as exc:
        return judge_error(subject, exc, (), started=True)
    except Exception as exc:  # noqa: BLE001  (every failure is classified)
        return judge_error(subject, exc, (NotImplementedError, ValueError), started=False, require_type=False)
    return judge(subject, {"generate_batch": [Generated(list(o.generated_tokens)) for o in outputs]})
