"""Sampling: per-request parameters and state, the logits-processor pipeline and per-row operations
(logits/), guided decoding (structured/), stop strings and the sampler."""
