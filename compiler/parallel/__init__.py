"""What the compiler knows of each parallel axis, one module per axis as in
backends/parallel/: tp.py, cp.py, ep.py (+ ep_checks, ep_cost, ep_balance), zero.py,
diloco.py; and checks.py, the runtime's refusals run at compile time."""
