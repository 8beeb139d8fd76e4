"""The manager thread's torch threads: the caller's settings carried into it (threads.py) and, on the CPU,
adapted between steps to the cores other processes leave idle (adaptive_threads.py)."""
