"""Where the KV bytes are: the device KV tensors, the host tier, the swap copier, block tables and
the sizing of it all."""
