"""The logits' processing stages: the ordered pipeline `generate()` would build (processors.py), the
per-request processors over all rows at once (warpers.py) and OpenAI's (openai.py)."""
