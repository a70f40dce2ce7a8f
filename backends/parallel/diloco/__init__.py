"""Data-parallel sync modes beyond every step: DiLoCo and streaming DiLoCo (sync.py),
decoupled DiLoCo (decoupled.py). Their timing rules and estimates are
compiler/parallel/diloco.py."""
