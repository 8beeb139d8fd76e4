"""Scheduling, torch-free: the `Scheduler` (which requests run how many tokens each step), its
candidate orderings, the recompute count, and the step's plan (`StepPlan`) that the runner and the
tensor-parallel followers execute; speculation's side of it (drafts as data, the draft sources) in
speculation/."""
