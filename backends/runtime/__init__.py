"""One rank's training loop: launch (launcher.py), the rank's process (worker.py), its
stages and optimizer (trainer.py), the scheduled actions in order (executor.py, stage.py,
split_backward.py, recompute.py, comm.py), gradient sync (grads.py), data (data.py),
the mesh and process groups (topology.py, layout.py) and failures (failure.py,
nonfinite.py, agreement.py)."""
