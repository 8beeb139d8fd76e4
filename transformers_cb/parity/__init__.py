"""Parity with plain `generate()`: the conformance check a user points at their own model (`check.py`) and the
token comparison it shares with the `conformance/` suite (`compare.py`); `conformance_check.py` is its command."""
