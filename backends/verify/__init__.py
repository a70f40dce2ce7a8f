"""`pipeplan verify`: the pipelined run (run.py) against the single-process reference
(reference.py), judged element by element (compare.py)."""
