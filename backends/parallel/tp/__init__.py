"""Tensor parallelism (+ sequence parallel) on a captured stage graph, with torch's DTensor.

    rewrite.py  the graph rewrite: which tensors become which DTensors, where the
                collectives of each style go (the concept; read it first)
    dtensor.py  the nodes it inserts (to/from DTensor, redistribute, vocab loss)
    params.py   this rank's parameter shards and the full tensors back

The plan's patterns and the compile-time checks are compiler/parallel/tp.py.
"""
from ....compiler.parallel.tp import TensorParallelRules
from .params import ParameterSlicer, gather_full, gather_full_state, tp_shard_dims
from .rewrite import TensorParallelResult, apply_tensor_parallel

__all__ = ["TensorParallelRules", "TensorParallelResult", "ParameterSlicer", "apply_tensor_parallel",
           "gather_full", "gather_full_state", "tp_shard_dims"]
