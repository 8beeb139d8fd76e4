"""Helpers shared by the unit tests (tests/) and the parity suite (conformance/); no tests here.

- `models`: the one tiny-model builder (seeded random weights, fp32, eval) and the model-family tables.
- `sharp`: query / key projections scaled after init (`sharpen`, `SHARP_FACTOR`): attention far from uniform.
- `prompts`: seeded random prompts. `reference`: the greedy plain-`generate()` reference.
- `requests`: `Request` objects for the page policy and scheduler tests. `fakes`: the scheduler's fake model.
- `engine`: an `Engine` driven directly to completion. `faults`: a method that fails on its n-th call.
- `threads`: bounded waits and calls in a helper thread (a bug fails instead of hanging).
- `manager`: what the manager tests share (references, result collection, leak checks).
- `offload`, `serve`, `transformers_serve`, `flash_double`: the offload rig, the in-thread server, the
  `transformers serve` subprocess, the CPU double of flash-attn.
- `tp_pair`: rank 0's engine and a follower in one process, joined by an in-memory channel.
- `tp_worker`, `serve_launcher`: scripts the tests start by file path (`paths`) in a subprocess.

Import direction: `conformance` builds on `tests.support` (conformance/common.py adds the parity checks);
`tests.support` imports neither `conformance` nor any test module.
"""
