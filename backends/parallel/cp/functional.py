"""The cp collectives as functional collectives, for stages traced into joint graphs.

Under `compile.mode = graphs | inductor` a context-parallel stage is traced into one joint
forward + backward graph (compiler/graphs/joint.py); the eager collectives of ring.py
(`dist.isend` / `irecv`) and ulysses.py (torch.distributed.nn's autograd all-to-all, a
custom autograd.Function) are not captured by that trace. While it runs (`traced`: the
tensors are the tracer's fake or functional ones) they go through torch's functional
collectives instead, which the trace records as `_c10d_functional` nodes (and their
`wait_tensor`), and which the graphs then run on the real process group:

* `hop`: ring attention's send-to-next / receive-from-previous, as one
  `all_to_all_single` whose only non-empty blocks go to rank+1 and come from rank-1
  (the same bytes as the isend/irecv pair);
* `all_to_all`: Ulysses' exchange of equal dim-0 blocks, the autograd-aware functional
  all-to-all (its backward is the inverse all-to-all, as torch.distributed.nn's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def traced(x: torch.Tensor) -> bool:
    """x is a value of a trace (fake, or functionalised) rather than a real tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, (FakeTensor, FunctionalTensor)) or \
        torch._is_functional_tensor(x)


def hop(x: torch.Tensor, group) -> torch.Tensor:
    """x (1-D) sent to the next rank of `group`; what the previous rank sent, received."""
    from torch.distributed import _functional_collectives as funcol

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n = x.numel()
    send = [n if j == (rank + 1) % size else 0 for j in range(size)]
    recv = [n if j == (rank - 1) % size else 0 for j in range(size)]
    return funcol.all_to_all_single(x.contiguous(), recv, send, group)  # waited in the trace


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal dim-0 blocks exchanged over `group`, differentiable (inverse all-to-all back)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
