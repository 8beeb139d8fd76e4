"""Sampling: per-request parameters and state, the logits-processor pipeline, per-row operations,
stop strings and the sampler."""
