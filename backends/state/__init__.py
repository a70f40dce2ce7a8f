"""What outlives a process: sharded checkpoints (checkpoint/), pretrained weights in
(weights.py; checked before launch by compiler/weights.py), each rank's initial
weights (materialize.py), the reference model (model.py) and weights out (export.py)."""
