"""Speculation on the scheduler's side, torch-free: the draft sources' protocol and the data drafts travel
as (draft_source.py), what a step runs of a proposal (drafts.py), a speculating request's state and back-off
(back_off.py), prompt lookup (prompt_lookup.py), a draft model's schedules (assisted.py) and its shadows
(shadow_planner.py), and the verification counts (speculation_stats.py)."""
