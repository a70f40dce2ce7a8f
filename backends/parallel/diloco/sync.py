"""DiLoCo: data-parallel replicas ("islands") train alone and synchronise every H steps.

Chosen by the plan's `sync = diloco(...)` (dsl/sync_checks.py says what is refused).
An island is one data-parallel replica: a whole pipeline x TP group, running the
compiled plan (its schedule, TP and EP inside: dsl/layout.py keeps EP groups on an
island's tp ranks) with the plan's optimizer as the *inner* optimizer and no per-step
gradient all-reduce across islands (the mesh's `islands` flag takes the dp groups out of
gradient sync, backends/parallel/layout.py; trainer.py scales the loss by 1/microbatches: an
island's gradient is the mean over its own share of the global batch).

The math, per fragment f of the parameters (the run of stages
[f*S/K, (f+1)*S/K) of the S stages; a tied parameter goes with its first stage),
after inner step n (1-based) when n = offset_f + k*H, k >= 1, offset_f = floor(f*H/K):

    delta_i = theta_global - theta_i            (island i's pseudo-gradient)
    delta   = mean over islands of delta_i      (all-reduce over each rank's dp group)
    theta_global <- outer_step(theta_global, delta)
                                                (torch SGD: nesterov(lr, momentum) or
                                                 sgd(lr, momentum), grad = delta)
    theta_i <- theta_global                     (every island adopts it)

Inner optimizer state is kept across syncs (as the paper). With K = 1 every parameter
syncs at n = H, 2H, ...; with K fragments (streaming DiLoCo) the syncs are staggered,
so a sync moves 1/K of the model. Each rank keeps the global copy and the outer
optimizer of its own parameters only (its stages, its TP shard): `state_dict()` names
them by the reference's parameter names.

The all-reduces of every fragment due at a step are launched together (asynchronous)
before any is waited; overlapping them with the next inner steps would change the
math (the islands would adopt a global a step late), so it is not done.

The exchange is pluggable: `AllReduceExchange` here (synchronous, every island), or
decoupled.py's `StoreExchange` (islands present within a timeout).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ....compiler.parallel.diloco import fragment_of_stage, syncs_after
from ....dsl.ast import SyncSpec


# ------------------------------------------------------------------ timing


@dataclass(frozen=True)
class SyncEvent:
    """One fragment's sync as this rank saw it (printed by each island's first rank)."""

    step: int  # inner steps done (1-based) when it ran
    fragment: int
    round: int  # this fragment's sync count, from 0
    islands: tuple[int, ...]  # whose pseudo-gradients were averaged
    absent: tuple[int, ...] = ()  # decoupled: missed the timeout
    lost: tuple[int, ...] = ()  # decoupled: reported dead by the launcher
    waited_s: float = 0.0  # how long this rank waited for the others
    adopted_round: Optional[int] = None  # decoupled: the round whose global it took (late: newer)

    def describe(self) -> str:
        text = (f"sync after step {self.step}, fragment {self.fragment} round {self.round}: "
                f"averaged islands {list(self.islands)}")
        if self.absent:
            text += f", absent {list(self.absent)} (not there within the timeout)"
        if self.lost:
            text += f", lost {list(self.lost)}"
        if self.adopted_round is not None and self.adopted_round != self.round:
            text += f"; this island was late and adopted round {self.adopted_round}'s parameters"
        return text + f" (waited {self.waited_s:.2f} s)"


# ---------------------------------------------------------------- fragment
def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds for `p` (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


class Fragment:
    """One fragment's parameters on this rank, their global copy and outer optimizer."""

    def __init__(self, index: int, named: Sequence[tuple[str, torch.nn.Parameter]],
                 spec: SyncSpec):
        self.index = index
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            flat = torch.cat([_local(p).detach().reshape(-1) for p in self.params]) \
                if self.params else torch.zeros(0)
        self.global_ = torch.nn.Parameter(flat.clone())
        o = spec.outer_optimizer
        self.outer = torch.optim.SGD([self.global_], lr=o.lr, momentum=o.momentum,
                                     nesterov=o.name == "nesterov", foreach=False)
        self.rounds = 0

    def pseudo_gradient(self) -> torch.Tensor:
        with torch.no_grad():
            return self.global_.detach() - torch.cat(
                [_local(p).detach().reshape(-1) for p in self.params])

    def outer_step(self, delta: torch.Tensor) -> None:
        self.global_.grad = delta.to(self.global_.dtype)
        self.outer.step()
        self.global_.grad = None

    def adopt(self, flat: torch.Tensor) -> None:
        """theta_i <- theta_global (and the global copy is `flat`)."""
        with torch.no_grad():
            if flat is not self.global_:
                self.global_.copy_(flat)
            offset = 0
            for p in self.params:
                t = _local(p)
                t.copy_(self.global_[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for n, p in zip(self.names, self.params):
            k = _local(p).numel()
            out[n] = flat[offset:offset + k].view_as(_local(p))
            offset += k
        return out

    @property
    def nbytes(self) -> int:
        return self.global_.numel() * self.global_.element_size()


# ---------------------------------------------------------------- exchanges
class AllReduceExchange:
    """Synchronous: the mean over every island, by an all-reduce over the dp group."""

    def __init__(self, group: dist.ProcessGroup, islands: int):
        self.group, self.islands = group, islands
        self.bytes_sent = 0  # ring all-reduce: 2(n-1)/n of each tensor

    def start(self, fragment: Fragment, delta: torch.Tensor):
        self.bytes_sent += int(2 * (self.islands - 1) / self.islands
                               * delta.numel() * delta.element_size())
        return (delta, dist.all_reduce(delta, group=self.group, async_op=True), time.perf_counter())

    def collect(self, handle) -> tuple[Optional[torch.Tensor], dict]:
        delta, work, started = handle
        work.wait()
        return delta / self.islands, {"islands": tuple(range(self.islands)),
                                      "waited_s": time.perf_counter() - started}

    def publish(self, handle, fragment: Fragment) -> tuple[torch.Tensor, dict]:
        return fragment.global_, {}


# -------------------------------------------------------------------- sync
class DiLoCo:
    """The outer loop on one rank: `after_step(t)` after every inner optimizer step."""

    def __init__(self, spec: SyncSpec, named: Sequence[tuple[str, int, torch.nn.Parameter]],
                 exchange):
        self.spec, self.exchange = spec, exchange
        by_fragment: dict[int, list] = {}
        for name, f, p in named:
            by_fragment.setdefault(f, []).append((name, p))
        self.fragments = [Fragment(f, items, spec) for f, items in sorted(by_fragment.items())]

    def after_step(self, t: int) -> list[SyncEvent]:
        n = t + 1
        due = [fr for fr in self.fragments if syncs_after(n, fr.index, self.spec)]
        handles = [(fr, self.exchange.start(fr, fr.pseudo_gradient())) for fr in due]
        events = []
        for fr, handle in handles:
            delta, info = self.exchange.collect(handle)
            if delta is not None:  # this rank applies the outer step (every rank, unless decoupled)
                fr.outer_step(delta)
            flat, more = self.exchange.publish(handle, fr)
            fr.adopt(flat)
            events.append(SyncEvent(n, fr.index, fr.rounds, **{**info, **more}))
            fr.rounds = more.get("adopted_round", fr.rounds) + 1
        return events

    # -- named state (checkpoints)
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global parameters and outer momentum by reference name, and each fragment's
        sync count: `diloco/global/<name>`, `diloco/outer_momentum/<name>`,
        `diloco/rounds/<fragment>`."""
        out: dict[str, torch.Tensor] = {}
        for fr in self.fragments:
            for n, v in fr.views(fr.global_.detach()).items():
                out[f"diloco/global/{n}"] = v
            buf = fr.outer.state.get(fr.global_, {}).get("momentum_buffer")
            if buf is not None:
                for n, v in fr.views(buf).items():
                    out[f"diloco/outer_momentum/{n}"] = v
            out[f"diloco/rounds/{fr.index}"] = torch.tensor(fr.rounds)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for fr in self.fragments:
                fr.global_.copy_(torch.cat([state[f"diloco/global/{n}"].reshape(-1)
                                            for n in fr.names]))
                key = f"diloco/outer_momentum/{fr.names[0]}" if fr.names else None
                if key in state:
                    fr.outer.state[fr.global_]["momentum_buffer"] = torch.cat(
                        [state[f"diloco/outer_momentum/{n}"].reshape(-1) for n in fr.names]
                    ).to(fr.global_.dtype)
                fr.rounds = int(state[f"diloco/rounds/{fr.index}"])

    @property
    def bytes_sent(self) -> int:
        return self.exchange.bytes_sent


def fragment_params(runners: dict, stages: int, fragments: int, tied) -> list:
    """(reference name, fragment, parameter) of this rank's parameters, each once, in a
    deterministic order equal on every rank of a dp group."""
    first_stage = {}
    for t in tied:  # a tied parameter syncs with its first stage's fragment on every holder
        for s, n in zip(t.stages, t.names):
            first_stage[(s, n)] = t.stages[0]
    seen, out = set(), []
    for s in sorted(runners):
        for name, p in runners[s].module.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append((name, fragment_of_stage(first_stage.get((s, name), s), stages,
                                                fragments), p))
    return out


def island_groups(mesh) -> tuple[list, Optional[dist.ProcessGroup]]:
    """One process group per island (the ranks of one dp coordinate), created by every
    rank in the same order; returns (all groups, this rank's)."""
    from ...runtime.topology import global_rank, new_groups

    return new_groups([[global_rank(mesh, p, d, t) for p in range(mesh.pp) for t in range(mesh.tp)]
                       for d in range(mesh.dp)])


def build_diloco(plan, runners: dict, tied, topo) -> DiLoCo:
    """This rank's DiLoCo outer loop (the exchange per the plan: all-reduce, or decoupled)."""
    spec = plan.sync
    stages = plan.mesh.pp * plan.pipeline.virtual
    named = fragment_params(runners, stages, spec.fragments, tied)
    if spec.decoupled:
        from .decoupled import StoreExchange

        exchange = StoreExchange(topo, spec.timeout)
    else:
        exchange = AllReduceExchange(topo.dp_group, plan.mesh.dp)
    return DiLoCo(spec, named, exchange)
