"""Batch jobs: prompts read from lines, one `generate_batch` call over them, one JSON line per result.

Shared by `transformers-cb generate` (cli/) and its Ray form (scale_out/)."""
