"""The engine's speculation: whether it can speculate and every request's draft settings and source
(draft_setup.py), and the draft model: what it may be, its plan and its drafter (assistant.py)."""
