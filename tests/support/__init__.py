"""Helpers shared by the unit tests (tests/) and the parity suite (conformance/); no tests here.

- `models`: the one tiny-model builder (seeded random weights, fp32, eval) and the model-family tables.
- `prompts`: seeded random prompts. `reference`: the greedy plain-`generate()` reference.
- `requests`: `Request` objects for the allocator and scheduler tests. `fakes`: the scheduler's fake model.
- `threads`: bounded waits and calls in a helper thread (a bug fails instead of hanging).
- `offload`, `serve`, `flash_double`: the offload rig, the server helpers, the CPU double of flash-attn.
- `tp_worker`, `serve_launcher`: scripts the tests start by file path in a subprocess.

Import direction: `conformance` builds on `tests.support` (conformance/common.py adds the parity checks);
`tests.support` imports neither `conformance` nor any test module.
"""
