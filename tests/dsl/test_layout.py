"""The mesh layout `pipeplan check` prints: pp outermost, tp innermost, ep re-divides dp*tp."""
from __future__ import annotations

from pipeplan.dsl.ast import MeshSpec
from pipeplan.dsl.layout import RankCoords, group_sizes, groups, mesh_layout


def test_ranks_are_pp_major_and_tp_minor():
    layout = mesh_layout(MeshSpec(pp=2, dp=2, tp=2))
    assert [(c.pp, c.dp, c.tp) for c in layout] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_expert_parallel_re_divides_dp_times_tp_without_adding_ranks():
    mesh = MeshSpec(pp=2, dp=2, tp=2, ep=4)
    layout = mesh_layout(mesh)
    assert len(layout) == mesh.world_size == 8
    assert layout[5] == RankCoords(rank=5, pp=1, dp=0, tp=1, ep=1, edp=0)
    assert groups(layout, "ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    sizes = group_sizes(mesh)
    assert (sizes.ep, sizes.edp) == (4, 1)


def test_groups_along_each_axis():
    layout = mesh_layout(MeshSpec(pp=2, dp=2, tp=1, ep=2))
    assert groups(layout, "pp") == [(0, 2), (1, 3)]
    assert groups(layout, "dp") == [(0, 1), (2, 3)]
    assert groups(layout, "ep") == [(0, 1), (2, 3)]
    assert groups(layout, "edp") == [(0,), (1,), (2,), (3,)]
