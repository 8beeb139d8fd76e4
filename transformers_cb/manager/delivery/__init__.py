"""Outputs to their receivers: who receives which output, exactly once and in order (results.py), and the
iterators that pull from it (channels.py)."""
