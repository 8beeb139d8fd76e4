"""The models a command runs: the device, a checkpoint (or the built-in tiny model) with its tokenizer and special ids."""
