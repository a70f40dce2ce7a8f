"""Where a global rank sits in the (pp, dp, cp, tp) mesh, and the process groups it uses.

pp is outermost and tp innermost, as in Megatron and torchtitan (the formula:
dsl/layout.py, `global_rank`; cp only with context parallel). The coordinates are a
pure function of the rank (`Coords`); the groups come from one torch DeviceMesh
so every group any part of pipeplan uses is derived from the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
