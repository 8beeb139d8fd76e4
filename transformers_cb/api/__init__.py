"""The user-facing entry points on the model: `generate_batch` and the manager's model methods."""
