"""Guided decoding: a request's output constraint as the user gives it, checked (guided.py), and its
grammars on llguidance, the `structured` extra (grammars.py)."""
