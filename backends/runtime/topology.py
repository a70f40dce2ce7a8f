"""Where a global rank sits in the (pp, dp, cp, tp) mesh, and every process group a run
creates: the one module that calls torch's group constructors.

pp is outermost and tp innermost, as in Megatron and torchtitan (the formula:
dsl/layout.py, `global_rank`; cp only with context parallel). The coordinates are a
pure function of the rank (`Coords`); the mesh's groups come from one torch DeviceMesh
(`build_topology`), and the groups an axis needs beyond it (expert parallel, tied
parameters, DiLoCo islands) from `new_groups`, given the rank lists that axis's rule
computes (backends/parallel/, grads.py), so every group is derived from the same layout
and created by every rank in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist

from ...dsl.ast import MeshSpec
from ...dsl.layout import global_rank, mesh_layout  # noqa: F401  (the rank formula lives there)


@dataclass(frozen=True)
class Coords:
    """One rank's coordinates in a (pp, dp, cp, tp) mesh."""

    pp: int
    dp: int
    tp: int
    cp: int = 0

    @staticmethod
    def of(rank: int, mesh: MeshSpec) -> "Coords":
        c = mesh_layout(mesh)[rank]
        return Coords(c.pp, c.dp, c.tp, c.cp)


@dataclass
class Topology:
    """This rank's coordinates and the process groups built from one DeviceMesh.

    `device_mesh` is None only in a single-process world without
    torch.distributed (the reference trainer); every group is then None too.
    """

    mesh: MeshSpec
    rank: int
    coords: Coords
    device_mesh: object = None  # torch.distributed.device_mesh.DeviceMesh
    pp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    tp_group: Optional[dist.ProcessGroup] = None
    # context parallel (mesh.cp > 1): the ranks holding slices of the same sequences. Then
    # dp_group is the flattened dp x cp group: replicated gradients are summed over both.
    cp_group: Optional[dist.ProcessGroup] = None

    def peer(self, pp_rank: int) -> int:
        """The global rank holding pipeline rank `pp_rank` at this rank's dp/cp/tp coordinates."""
        return global_rank(self.mesh, pp_rank, self.coords.dp, self.coords.tp, self.coords.cp)


def build_topology(mesh: MeshSpec, device_type: str = "cpu") -> Topology:
    """Create the DeviceMesh (dims pp, dp, tp; pp, dp, cp, tp with context parallel) over the
    initialised default group."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    if mesh.cp == 1:
        dm = init_device_mesh(device_type, (mesh.pp, mesh.dp, mesh.tp),
                              mesh_dim_names=("pp", "dp", "tp"))
        return Topology(mesh=mesh, rank=rank, coords=Coords.of(rank, mesh), device_mesh=dm,
                        pp_group=dm.get_group("pp"), dp_group=dm.get_group("dp"),
                        tp_group=dm.get_group("tp"))
    dm = init_device_mesh(device_type, (mesh.pp, mesh.dp, mesh.cp, mesh.tp),
                          mesh_dim_names=("pp", "dp", "cp", "tp"))
    dpcp = dm["dp", "cp"]._flatten("dp_cp")
    return Topology(mesh=mesh, rank=rank, coords=Coords.of(rank, mesh), device_mesh=dm,
                    pp_group=dm.get_group("pp"), dp_group=dpcp.get_group(),
                    tp_group=dm.get_group("tp"), cp_group=dm.get_group("cp"))


def new_groups(rank_lists: Sequence[Sequence[int]], singletons: bool = True
               ) -> tuple[list[Optional[dist.ProcessGroup]], Optional[dist.ProcessGroup]]:
    """Collective: one process group per list of global ranks, created by every rank in the
    same order (torch requires it); returns all of them and this rank's (None: in none).
    `singletons=False`: a list of one rank gets no group (None)."""
    me, groups, mine = dist.get_rank(), [], None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks)) if len(ranks) > 1 or singletons else None
        groups.append(group)
        if me in ranks:
            mine = group
    return groups, mine
