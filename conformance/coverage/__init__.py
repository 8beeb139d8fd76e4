"""The coverage matrix: every causal-LM model type of the installed transformers, certified.

`python -m conformance.coverage [--types a,b] [--subset] [--jobs N] [--no-sharp] [--sharp-factor F]
[--media] [--json PATH] [--markdown PATH]`

For each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (and the text path of
`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`) it builds a tiny random-weight model from the type's own
config class (`shrink.py`), runs greedy `generate()` per prompt as the reference, then ours
(`generate_batch` with chunked prefill and prefix sharing, and the manager with a cache small enough to
preempt), ours again on the model with its query / key projections scaled (`sharp.py`: the sharp column,
attention far from uniform) and transformers' built-in continuous batching as a peer column (`builtin.py`), and classifies
each type (`outcome.py`): exact, refused, mismatch, crash, not instantiable. Each type runs in a forked
worker with a deadline (`pool.py`), so a hang or a dead process is a crash of that type only. The table
goes to docs/models.md and JSON (`report.py`); the exit status is 1 on any crash or mismatch of ours, plain or sharp.

It lives in `conformance/` (not the package): it imports `transformers.generation.continuous_batching`
for the peer column, which `transformers_cb/` never does.
"""
