"""DiLoCo's state in a checkpoint (backends/parallel/diloco/sync.py): what the islands share.

Between syncs every island holds its own parameters and inner optimizer state;
state.py keeps those apart under the island's prefix (`island<d>/params/<name>`,
`island<d>/optim/<name>/<state>`). What the islands share is written once (DCP
keeps one copy of the islands' equal chunks):

    diloco/global/<name>            the global parameters of the last sync (theta_global)
    diloco/outer_momentum/<name>    the outer optimizer's momentum buffer (momentum > 0)
    diloco/rounds/<fragment>        the fragment's sync count

each at the parameter's global shape, a TP shard at its offset (as params/).
Resuming needs the same islands and the same outer loop (manifest.py refuses a
checkpoint written under another `sync` or another island count before launch).
"""
from __future__ import annotations

import torch

from .pieces import Pieces


def _momentum(fr) -> torch.Tensor | None:
    """The fragment's outer momentum buffer, created zero where missing (before the first
    sync: torch SGD's first update of a zero buffer, 0·mu + delta, is delta, as its
    clone of delta); None when the outer step has no momentum."""
    if not fr.outer.defaults.get("momentum", 0):
        return None
    state = fr.outer.state[fr.global_]
    if state.get("momentum_buffer") is None:
        state["momentum_buffer"] = torch.zeros_like(fr.global_.detach())
    return state["momentum_buffer"]


def diloco_pieces(trainer, placed, names: str = "written") -> dict[str, Pieces]:
    """This rank's pieces of the shared DiLoCo keys (`placed`: state.placed_parameters;
    `names` as in state.rank_pieces)."""
    where = {}  # id(param) -> (global copy view, momentum view or None)
    out: dict[str, Pieces] = {}
    for fr in trainer.diloco.fragments:
        buf = _momentum(fr)
        offset = 0
        for p in fr.params:
            local = p.to_local() if hasattr(p, "to_local") else p
            k = local.numel()
            where[id(p)] = (fr.global_.data[offset:offset + k].view_as(local),
                            None if buf is None else buf[offset:offset + k].view_as(local))
            offset += k
        rounds = torch.tensor(fr.rounds, dtype=torch.int64)
        out.setdefault(f"diloco/rounds/{fr.index}", Pieces((), torch.int64)).add((), rounds)
    for pl in placed:
        if id(pl.param) not in where:
            continue
        value, momentum = where[id(pl.param)]
        for name in (pl.written if names == "written" else pl.names[:1]):
            for key, view in (("global", value), ("outer_momentum", momentum)):
                if view is not None:
                    pieces = out.setdefault(f"diloco/{key}/{name}", Pieces(pl.shape, view.dtype))
                    for at, part in pl.place((0,) * view.dim(), view):
                        pieces.add(at, part)
    return out


def after_load(trainer, state: dict) -> None:
    """The fragments' sync counts, from the loaded holders."""
    if getattr(trainer, "diloco", None) is None:
        return
    for fr in trainer.diloco.fragments:
        fr.rounds = int(state[f"diloco/rounds/{fr.index}"].at(()))


def sync_summary(plan) -> dict:
    """The data-parallel sync a checkpoint was written under (manifest.json)."""
    s = plan.sync
    if not s.diloco:
        return {"mode": "every_step"}
    o = s.outer_optimizer
    out = {"mode": "diloco", "islands": plan.mesh.dp, "inner_steps": s.inner_steps,
           "fragments": s.fragments,
           "outer_optimizer": {"name": o.name, "lr": o.lr, "momentum": o.momentum}}
    if s.fragments > 1:  # the fragments are runs of stages: their count fixes who syncs when
        out["stages"] = plan.mesh.pp * plan.pipeline.virtual
    if s.decoupled:  # one series per island, each at its own step (store.py)
        out["decoupled"] = True
    return out


def describe(sync: dict) -> str:
    if sync.get("mode") != "diloco":
        return "every-step data parallel"
    o = sync["outer_optimizer"]
    return (f"diloco with {sync['islands']} islands, inner_steps = {sync['inner_steps']}, "
            f"fragments = {sync['fragments']}"
            + (f" over {sync['stages']} stages" if "stages" in sync else "")
            + (", decoupled" if sync.get("decoupled") else "") + ", "
            f"{o['name']}(lr = {o['lr']}, momentum = {o['momentum']})")
