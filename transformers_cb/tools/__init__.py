"""User-facing tools: the conformance check a user points at their own model."""
