"""What a transformer block's memory-bound ops move under the runtime's bf16 (torch autocast
over float32 weights) against what the time model charges them (every float at 2 bytes:
compiler/capture/work.py counts float elements in the float32 meta run, optime.memory_time
multiplies by the plan's float size).

    python tests/benchmarks/bench_autocast_bytes.py      (seconds; fake tensors, no memory)

Counts, per aten op outside matmuls, attention kernels, views and allocations, the bytes of
its floating-point inputs and outputs at their own dtypes, for the example GPT's forward
and backward (loss in float32, as the runtime computes it), once in float32 and once under
CPU autocast to bf16; one block's share is the difference between 3 and 1 blocks over 2.
Autocast keeps the norms and the residual stream in float32 and casts each weight once a
microbatch: the printed ratio is what the time model leaves out of a bf16 plan's memory-bound
ops (docs/compiler.md, "What it leaves out").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from pipeplan.examples.models.gpt import GPT

VOCAB = 50368
_FREE = {"view", "transpose", "t", "expand", "permute", "unsqueeze", "squeeze", "slice",
         "select", "_unsafe_view", "alias", "detach", "as_strided", "empty", "empty_like",
         "zeros", "new_empty", "empty_strided"}


class FloatBytes(TorchDispatchMode):
    """Float bytes in and out of each memory-bound aten op; of them, the casts'."""

    def __init__(self):
        super().__init__()
        self.total = self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.overloadpacket in flop_registry or name in _FREE or "attention" in name:
            return out
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)
        self.total += moved
        self.casts += moved if name == "_to_copy" else 0
        return out


def step_bytes(autocast: bool, dim: int, heads: int, layers: int, seq: int = 2048,
               batch: int = 4) -> tuple[int, int]:
    with FakeTensorMode():
        model = GPT(vocab=VOCAB, dim=dim, layers=layers, heads=heads, seq_len=seq)
        ids = torch.randint(0, VOCAB, (batch, seq))
        meter = FloatBytes()
        with meter:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(ids)
            F.cross_entropy(logits.float().view(-1, VOCAB), ids.view(-1)).backward()
    return meter.total, meter.casts


def main() -> int:
    for dim, heads in ((1024, 16), (4096, 32)):
        (a1, c1), (a3, c3) = (step_bytes(True, dim, heads, n) for n in (1, 3))
        f1, f3 = (step_bytes(False, dim, heads, n)[0] for n in (1, 3))
        amp, charged = (a3 - a1) / 2, (f3 - f1) / 2 / 2  # float32 bytes at 2 bytes a float
        print(f"width {dim}: a block's memory-bound ops move {amp / 1e9:.3f} GB under autocast "
              f"(weight and input casts {(c3 - c1) / 2 / 1e9:.3f}); the time model charges "
              f"{charged / 1e9:.3f} GB; ratio {amp / charged:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
