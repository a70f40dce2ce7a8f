"""Capture: the plan's model built (loading.py), checked against the plan
(model_checks.py), captured as one FX graph (capture.py, experts_call.py, tied.py,
blocks.py), the loss appended (loss.py) and shapes and costs propagated on meta
(analysis.py, traced.py)."""
