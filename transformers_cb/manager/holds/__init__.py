"""What holds the manager's loop between steps: `pause()` blocks and the weight check they owe
(pausing.py), and a cache release until its resume (release.py)."""
