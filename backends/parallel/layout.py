"""This rank's stage modules after per-stage parallelism, and where each gradient goes.

Without tensor/expert parallelism a stage module is the compiled GraphModule
as is: every parameter is whole, reduced over the stage's DP group and
counted once in the global norm. With them (backends/parallel/__init__.py rewrites
the modules in place) a parameter may be

* a tensor-parallel shard: summed over nothing extra, but its squared norm
  is summed over the TP group;
* an expert shard: reduced over the expert-data-parallel group, its squared
  norm summed over the EP group.

`StageLayout` answers those two questions per parameter and rebuilds full
parameters (by their reference names) for checks and `pipeplan verify`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.topology import Topology


@dataclass
class StageLayout:
    topo: Topology
    modules: dict[int, nn.Module]
    device: torch.device = torch.device("cpu")
    parallel: dict = field(default_factory=dict)  # stage -> parallelize.ParallelStage
    groups: object = None  # parallelize.ParallelGroups
    _norm_group: dict[int, Optional[dist.ProcessGroup]] = field(default_factory=dict)

    @staticmethod
    def build(topo: Topology, modules: dict[int, nn.Module], device: torch.device,
              groups=None, parallel: Optional[dict] = None) -> "StageLayout":
        """The layout of stages `parallelize` rewrote (`parallel`: stage -> ParallelStage,
        made with `groups`); without them, plain stages (no per-stage parallelism)."""
        from .tp import tp_shard_dims

        layout = StageLayout(topo, modules, device, dict(parallel or {}), groups)
        for st in layout.parallel.values():
            for p in st.expert_params():
                layout._norm_group[id(p)] = st.groups.ep
            params = dict(st.module.named_parameters(remove_duplicate=False))
            for pname in tp_shard_dims(st.module):
                if pname in params:
                    layout._norm_group[id(params[pname])] = st.groups.tp
        return layout

    def reduce_group(self, stage: int, p: nn.Parameter) -> Optional[dist.ProcessGroup]:
        """The group p's gradient is summed over (None: no reduction)."""
        if stage in self.parallel:
            return self.parallel[stage].grad_group(p)
        m = self.topo.mesh  # DiLoCo islands: nothing is summed across islands
        return self.topo.dp_group if m.dp * m.cp > 1 and not m.islands else None

    def norm_group(self, p: nn.Parameter) -> Optional[dist.ProcessGroup]:
        """The group over which p's squared norm is summed (None: p is whole here)."""
        return self._norm_group.get(id(p))

    def after_backward(self, stage: int) -> None:
        """Once a stage's backwards of the step are done (sequence-parallel norm grads)."""
        if stage in self.parallel:
            self.parallel[stage].sync_sequence_parallel()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank's stages at full (reference) shape, by reference name.

        Collective over the TP and EP groups when those shard parameters.
        """
        out: dict[str, torch.Tensor] = {}
        for s in sorted(self.modules):
            module = self.modules[s]
            names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
            st = self.parallel.get(s)
            full = st.full_state_dict() if st is not None else dict(module.state_dict())
            for n in sorted(names):
                if n in full:
                    out.setdefault(n, full[n].detach().clone())
        return out
