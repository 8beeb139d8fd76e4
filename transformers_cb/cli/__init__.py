"""The commands (``transformers-cb generate | serve | build-kernels``): the top room, which no other imports."""
