"""Which global rank holds which mesh coordinates, known before any tracing.

Order (torchtitan/Megatron convention): pp outermost, then dp, cp, tp innermost:
rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i (`global_rank`). cp (context
parallel) ranks hold slices of the same sequences; their gradients are reduced
together with dp (`groups(layout, "dpcp")`). Expert parallelism re-divides the
ranks of one pipeline stage; ep adds no ranks. Two cases:

* ep divides dp (EP among data-parallel ranks): inside one pipeline stage and
  tp coordinate, dp rank dp_i is ep rank dp_i % ep, and dp_i // ep numbers the
  expert-data-parallel (edp) replica that holds the same experts. TP peers hold
  the same experts and the same tokens.
* otherwise ep must divide dp * tp (EP across TP, as Megatron allows): the
  stage's dp x tp ranks, flat index f = dp_i * tp + tp_i, form EP groups of ep
  consecutive ranks: ep rank f % ep, edp replica f // ep. TP peers in one EP
  group hold different experts; the experts call then runs on each TP rank's
  1/tp share of the tokens (backends/parallel/tp/rewrite.py).

DiLoCo islands (`mesh.islands`, set from the plan's sync): each dp replica trains
alone, so EP may not take in dp ranks. EP is then always across TP (the second
case, whatever dp), and the plan checks (dsl/sync_checks.py) require ep to divide
tp: an EP group is ep consecutive tp ranks of one island's stage, ep rank =
tp_i % ep. The edp groups are cut at the islands (`groups(..., islands=True)`):
the tp/ep ranks of one island holding the same experts, whose gradients are summed
every step; the same experts in the other islands are the rank's dp group, over
which DiLoCo averages pseudo-gradients.

The runtime builds its EP groups from this layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ast import MeshSpec


@dataclass(frozen=True)
class RankCoords:
    rank: int
    pp: int
    dp: int
    tp: int
    ep: int
    edp: int  # expert-data-parallel replica: ranks with equal (pp, ep) and different edp hold the same experts
    cp: int = 0


@dataclass(frozen=True)
class GroupSizes:
    pp: int
    dp: int
    tp: int
    ep: int
    edp: int  # dp // ep
    cp: int = 1


def ep_fits(mesh: MeshSpec) -> bool:
    """EP re-divides the ranks of each pipeline stage (it adds none): ep divides dp, or
    dp x tp (expert parallel across tensor-parallel ranks)."""
    return mesh.ep == 1 or mesh.dp % mesh.ep == 0 or (mesh.dp * mesh.tp) % mesh.ep == 0


def ep_across_tp(mesh: MeshSpec) -> bool:
    """Whether EP groups take in tensor-parallel ranks (ep > 1 not dividing dp, or DiLoCo
    islands, whose dp ranks no EP group may span)."""
    return mesh.ep > 1 and (mesh.islands or mesh.dp % mesh.ep != 0)


def mesh_layout(mesh: MeshSpec) -> tuple[RankCoords, ...]:
    across = ep_across_tp(mesh)
    out = []
    for rank in range(mesh.world_size):
        pp_i, rest = divmod(rank, mesh.dp * mesh.cp * mesh.tp)
        dp_i, rest = divmod(rest, mesh.cp * mesh.tp)
        cp_i, tp_i = divmod(rest, mesh.tp)
        flat = dp_i * mesh.tp + tp_i  # (EP with cp > 1 is refused by the plan checks)
        edp_i, ep_i = divmod(flat if across else dp_i, mesh.ep)
        out.append(RankCoords(rank, pp_i, dp_i, tp_i, ep_i, edp_i, cp_i))
    return tuple(out)


def global_rank(mesh: MeshSpec, pp: int, dp: int, tp: int, cp: int = 0) -> int:
    """The rank at these coordinates (the inverse of mesh_layout)."""
    return ((pp * mesh.dp + dp) * mesh.cp + cp) * mesh.tp + tp


def group_sizes(mesh: MeshSpec) -> GroupSizes:
    """Group sizes per axis; edp under islands: inside one island (tp / ep)."""
    spread = (mesh.tp if mesh.islands else mesh.dp * mesh.tp) if ep_across_tp(mesh) else mesh.dp
    return GroupSizes(mesh.pp, mesh.dp, mesh.tp, mesh.ep, spread // mesh.ep, mesh.cp)


def groups(layout: tuple[RankCoords, ...], axis: str,
           islands: bool = False) -> list[tuple[int, ...]]:
    """The rank groups along `axis`: ranks that differ only in that coordinate.

    For ep and edp, groups live inside one pipeline stage, and inside one tp
    coordinate unless EP spans TP (see the module docstring); `islands`
    (mesh.islands): inside one dp replica too. Ranks in a group are in
    increasing order, so a group's i-th rank is its ep (or edp) rank i.
    """
    # EP across TP: the ranks of one (pp, edp) are exactly one EP group (ep of them)
    ep = 1 + max(c.ep for c in layout)
    across = sum(1 for c in layout if (c.pp, c.edp) == (0, 0)) == ep
    tp_key = () if across else ("tp",)
    others = {"pp": ("dp", "cp", "tp"), "dp": ("pp", "cp", "tp"), "tp": ("pp", "dp", "cp"),
              "cp": ("pp", "dp", "tp"), "dpcp": ("pp", "tp"),
              "ep": ("pp", "cp", "edp") + tp_key, "edp": ("pp", "cp", "ep") + tp_key}[axis]
    if islands and axis in ("ep", "edp"):
        others += ("dp",)
    found: dict[tuple[int, ...], list[int]] = {}
    for c in layout:
        found.setdefault(tuple(getattr(c, o) for o in others), []).append(c.rank)
    return [tuple(g) for g in found.values()]


def format_layout(mesh: MeshSpec, max_rows: int = 64) -> str:
    """A table of every rank's coordinates and a line per axis with its groups."""
    layout = mesh_layout(mesh)
    sizes = group_sizes(mesh)
    lines = [f"mesh: pp={mesh.pp} dp={mesh.dp} cp={mesh.cp} tp={mesh.tp} ep={mesh.ep} "
             f"-> world size {mesh.world_size} "
             + ("(diloco islands: ep re-divides each island's tp ranks)" if mesh.islands
                and mesh.ep > 1 else "(ep re-divides dp x tp: EP across TP)"
                if ep_across_tp(mesh) else "(ep re-divides dp)"),
             "  rank  pp  dp  cp  tp  ep  edp"]
    for c in layout[:max_rows]:
        lines.append(f"  {c.rank:>4}  {c.pp:>2}  {c.dp:>2}  {c.cp:>2}  {c.tp:>2}  {c.ep:>2}"
                     f"  {c.edp:>3}")
    if len(layout) > max_rows:
        lines.append(f"  ... {len(layout) - max_rows} more ranks")
    lines.append("groups:")
    for axis in ("pp", "dp", "cp", "tp", "ep", "edp"):
        gs = groups(layout, axis, mesh.islands)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in gs[:8])
        more = f" ... ({len(gs)} groups)" if len(gs) > 8 else ""
        lines.append(f"  {axis:<4} size {getattr(sizes, axis)}: {shown}{more}")
    return "\n".join(lines)
