"""The mesh layout `pipeplan check` prints: pp outermost, tp innermost, ep re-divides dp."""
from __future__ import annotations

from pipeplan.dsl.ast import MeshSpec
from pipeplan.dsl.layout import RankCoords, group_sizes, groups, mesh_layout


def test_ranks_are_pp_major_and_tp_minor():
    layout = mesh_layout(MeshSpec(pp=2, dp=2, tp=2))
    assert [(c.pp, c.dp, c.tp) for c in layout] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_expert_parallel_re_divides_dp_without_adding_ranks():
    mesh = MeshSpec(pp=2, dp=4, tp=2, ep=2)
    layout = mesh_layout(mesh)
    assert len(layout) == mesh.world_size == 16
    # rank 13 = (pp 1, dp 2, tp 1): dp 2 is ep rank 0 of expert replica 1
    assert layout[13] == RankCoords(rank=13, pp=1, dp=2, tp=1, ep=0, edp=1)
    assert groups(layout, "ep") == [(0, 2), (1, 3), (4, 6), (5, 7),
                                    (8, 10), (9, 11), (12, 14), (13, 15)]
    assert groups(layout, "edp") == [(0, 4), (1, 5), (2, 6), (3, 7),
                                     (8, 12), (9, 13), (10, 14), (11, 15)]
    sizes = group_sizes(mesh)
    assert (sizes.ep, sizes.edp) == (2, 2)


def test_groups_along_each_axis():
    layout = mesh_layout(MeshSpec(pp=2, dp=2, tp=1, ep=2))
    assert groups(layout, "pp") == [(0, 2), (1, 3)]
    assert groups(layout, "dp") == [(0, 1), (2, 3)]
    assert groups(layout, "ep") == [(0, 1), (2, 3)]
    assert groups(layout, "edp") == [(0,), (1,), (2,), (3,)]


def test_ep_across_tp_groups_take_in_tensor_parallel_ranks():
    # ep = 4 does not divide dp = 2 but divides dp x tp = 4: one EP group per stage holds
    # both dp ranks and both tp ranks; ep rank = flat (dp, tp) index mod ep
    mesh = MeshSpec(pp=2, dp=2, tp=2, ep=4)
    layout = mesh_layout(mesh)
    assert [(c.ep, c.edp) for c in layout[:4]] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert groups(layout, "ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups(layout, "edp") == [(i,) for i in range(8)]
    assert group_sizes(mesh).edp == 1
    mesh = MeshSpec(pp=1, dp=3, tp=2, ep=2)  # ep divides neither dp nor tp, but dp x tp = 6
    layout = mesh_layout(mesh)
    assert groups(layout, "ep") == [(0, 1), (2, 3), (4, 5)]
    assert groups(layout, "edp") == [(0, 2, 4), (1, 3, 5)]
    assert group_sizes(mesh).edp == 3
