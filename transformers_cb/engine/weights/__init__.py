"""The model's weights as the engine sees them: a change of them applied between steps (weight_watch.py),
the PEFT adapters its layers hold (adapter_registry.py) and a compressed checkpoint's pending
decompression run before the support probe (pending_decompression.py)."""
