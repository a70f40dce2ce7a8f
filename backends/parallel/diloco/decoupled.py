"""Decoupled DiLoCo: a sync goes on with the islands present; late islands catch up, lost
islands are dropped.

gloo collectives need every member, so a decoupled sync does not all-reduce. It goes
through the job's TCP store (MASTER_ADDR:MASTER_PORT) as a parameter server per dp
group: for each (pp, tp) coordinate, the rank of island 0 (dp = 0) is the coordinator.
Exactly what happens at fragment f's sync round r (diloco.py says when rounds fall):

* every other island's rank posts its pseudo-gradient `delta_i` under
  `pipeplan/diloco/<pp>.<tp>/f<f>/r<r>/delta<i>` and does not wait for the others;
* the coordinator waits until every island not reported lost has posted, or until
  `timeout` seconds after it reached the sync, whichever is first; it averages the
  pseudo-gradients present (its own always among them), applies the outer optimizer
  and publishes the global parameters of round r (and which islands were averaged,
  absent, lost); a pseudo-gradient posted after that is discarded;
* every non-coordinator then adopts the newest published global parameters (round r, or
  a later one when it is late: a straggler merges the latest global state and carries on
  from the round after it, so it falls back in step with the others' round numbers);
  once its coordinator has finished the run (no round r will come), a late island adopts
  the last published round at each of its remaining syncs;
* an island is lost when the launcher (launcher.py) saw one of its ranks die by a
  signal: it kills the island's other ranks, sets `pipeplan/diloco/lost/<i>`, and from
  then on no coordinator waits for that island. Losing island 0 (the coordinators, and
  rank 0 which hosts the store) ends the run, as does any other failure.

Each dp group syncs on its own, so with pp > 1 the stages of one round may average
different island sets when an island arrives between them (each stage's parameters are
still an average of whole pseudo-gradients). Only the coordinators hold the outer
optimizer's state. The payload goes through the store: fine for islands of small
models on one site, not a transport for large models (an all-reduce over the islands
present, e.g. a fresh gloo group per round, would be).
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ....dsl.layout import global_rank
from ....errors import PipeplanError

PREFIX = "pipeplan/diloco"
POLL_S = 0.01
COORDINATOR_WAIT_S = 600.0  # how long a non-coordinator waits for island 0's global state


def lost_key(island: int) -> str:
    return f"{PREFIX}/lost/{island}"


def done_key(rank: int) -> str:
    """Set by a rank of a decoupled run when it has finished its steps (`finish`)."""
    return f"{PREFIX}/done/{rank}"


def job_store(timeout_s: float = 60.0):
    """A client of the job's TCP store (the launcher's or torchrun's), else the default
    process group's store (in-process test worlds)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.distributed_c10d._get_default_store()


def _pack(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _unpack(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).clone()


class StoreExchange:
    """The decoupled exchange (see the module text); same interface as AllReduceExchange."""

    def __init__(self, topo, timeout_s: float):
        c = topo.coords
        self.store = job_store()
        self.prefix = f"{PREFIX}/{c.pp}.{c.tp}"
        self.island, self.islands = c.dp, topo.mesh.dp
        self.coordinator = c.dp == 0
        self.coordinator_done = done_key(global_rank(topo.mesh, c.pp, 0, c.tp))
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        self._info: dict[int, dict] = {}  # fragment -> what the coordinator averaged

    def _key(self, fragment: int, rnd: int, what: str) -> str:
        return f"{self.prefix}/f{fragment}/r{rnd}/{what}"

    def _lost(self) -> set[int]:
        return {i for i in range(self.islands) if self.store.check([lost_key(i)])}

    def start(self, fragment, delta: torch.Tensor):
        rnd = fragment.rounds
        if not self.coordinator:
            self.store.set(self._key(fragment.index, rnd, f"delta{self.island}"), _pack(delta))
            self.bytes_sent += delta.numel() * delta.element_size()
        return fragment.index, rnd, delta, time.perf_counter()

    def collect(self, handle) -> tuple[Optional[torch.Tensor], dict]:
        index, rnd, delta, started = handle
        if not self.coordinator:
            return None, {}
        waiting, present, got = set(range(1, self.islands)), [self.island], [delta]
        lost: set[int] = set()
        while True:
            lost |= self._lost() & waiting
            waiting -= lost
            for i in sorted(waiting):
                key = self._key(index, rnd, f"delta{i}")
                if self.store.check([key]):
                    got.append(_unpack(self.store.get(key), delta))
                    present.append(i)
                    waiting.discard(i)
                    self.store.delete_key(key)
            if not waiting or time.perf_counter() - started > self.timeout_s:
                break
            time.sleep(POLL_S)
        info = {"islands": tuple(sorted(present)), "absent": tuple(sorted(waiting)),
                "lost": tuple(sorted(lost)), "waited_s": time.perf_counter() - started}
        self._info[index] = info
        return torch.stack(got).mean(dim=0), info

    def publish(self, handle, fragment) -> tuple[torch.Tensor, dict]:
        index, rnd, _, started = handle
        if self.coordinator:
            info = {k: list(v) for k, v in self._info.pop(index).items() if k != "waited_s"}
            self.store.set(self._key(index, rnd, "global"), _pack(fragment.global_))
            self.store.set(self._key(index, rnd, "info"), json.dumps(info))
            self.store.set(f"{self.prefix}/f{index}/latest", str(rnd))
            self.bytes_sent += fragment.nbytes
            for old in (rnd - 3,):  # a late reader takes the newest; keep a few rounds
                if old >= 0:
                    for what in ["global", "info"] + [f"delta{i}" for i in range(self.islands)]:
                        self.store.delete_key(self._key(index, old, what))
            return fragment.global_, {"adopted_round": rnd}
        latest_key = f"{self.prefix}/f{index}/latest"
        while True:
            latest = int(self.store.get(latest_key)) if self.store.check([latest_key]) else -1
            if latest >= rnd or (latest >= 0 and self.store.check([self.coordinator_done])):
                break  # round rnd, a newer one, or the last one of a coordinator that is done
            if self.store.check([lost_key(0)]) or time.perf_counter() - started > \
                    COORDINATOR_WAIT_S:
                raise PipeplanError(f"island {self.island}: the coordinating island 0 did not "
                                    f"publish fragment {index}'s round {rnd}")
            time.sleep(POLL_S)
        flat = _unpack(self.store.get(self._key(index, latest, "global")), fragment.global_)
        info = json.loads(self.store.get(self._key(index, latest, "info")))
        return flat, {"islands": tuple(info["islands"]), "absent": tuple(info["absent"]),
                      "lost": tuple(info["lost"]), "adopted_round": latest,
                      "waited_s": time.perf_counter() - started}


def finish(rank: int, world: int, island_of: dict[int, int], timeout_s: float) -> None:
    """The end of a decoupled run without a collective: each rank says it is done; rank 0
    (which hosts the store under the local launcher) waits, up to `timeout_s`, until every
    rank of every island not lost is done, so late islands can still read the store."""
    store = job_store()
    store.set(done_key(rank), "1")
    if rank != 0:
        return
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        lost = {i for i in set(island_of.values()) if store.check([lost_key(i)])}
        if all(store.check([done_key(r)]) or island_of[r] in lost
               for r in range(world)):
            return
        time.sleep(0.05)
