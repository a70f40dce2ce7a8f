"""What a run shows: rank 0's progress and JSONL metrics (progress.py), the measured
timings and bubble (timings.py), cost files (profiling.py), the Chrome trace
(trace.py) and the run directory's HTML report (run_dir.py)."""
