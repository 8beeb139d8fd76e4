"""Everything on the device in one step: packing, the forward (compile, CUDA graphs, async batching)
and the sampling call."""
