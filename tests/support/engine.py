"""Driving an `Engine` directly (no manager thread): prompts in, every request run to completion."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from transformers_cb.attention.selection import paged_backend
from transformers_cb.engine.engine import Engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.requests import Request


def run_prompts(engine: Engine, model: PreTrainedModel, prompts: list[list[int]]) -> list[Request]:
    """Requests `r0`, `r1`, ... for `prompts`, all added, then stepped until no work is left; in order."""
    requests = [engine.build_request(Submission(p, f"r{i}")) for i, p in enumerate(prompts)]
    with paged_backend(model, engine.settings.step_options.attn_implementation), torch.inference_mode():
        for request in requests:
            engine.add(request)
        while engine.has_work():
            engine.step()
    return requests
