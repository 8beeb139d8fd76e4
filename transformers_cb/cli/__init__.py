"""Command-line interface for transformers_cb (``transformers-cb generate``)."""
