"""A submission made a `Request`: the `Submission` every entry point builds and the request builder
(submission.py), the user input checks (validation.py), a model's media taken in (media_inputs.py) and a
submission's sibling requests (siblings.py)."""
