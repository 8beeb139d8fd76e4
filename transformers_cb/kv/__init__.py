"""Who owns which KV page, torch-free: the page pools, the page policy of each attention type, the
facade the scheduler talks to, prefix sharing and offload planning."""
