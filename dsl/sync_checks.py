"""Checks of the plan's `sync` setting (data-parallel sync modes, backends/parallel/diloco/sync.py).

DiLoCo makes each data-parallel replica an island that trains alone for
`inner_steps` steps; what cannot work that way is refused here, at the plan
line, with the reason.
"""
from __future__ import annotations

from typing import Iterator

from .ast import Plan
from .rules import Problem, check, where


@check("sync", "mesh", "zero", "pipeline.schedule", "pipeline.virtual", "train.steps",
       "experts.balance")
def _sync(plan: Plan) -> Iterator[Problem]:
    s, m = plan.sync, plan.mesh
    if not s.diloco:
        return
    if plan.spans and "sync.inner_steps" not in plan.spans:  # a plan read from text
        yield Problem("sync", "diloco needs inner_steps",
                      "how many optimizer steps each island takes alone between syncs, "
                      "e.g. diloco(inner_steps = 50)")
    if m.dp < 2:
        yield Problem(where(plan, "mesh.dp", "sync"), f"diloco needs islands: mesh.dp = {m.dp}",
                      "each data-parallel replica is an island; set dp >= 2 or sync = every_step")
    if plan.zero > 0:
        yield Problem(where(plan, "zero", "sync"),
                      f"zero = {plan.zero} shards the optimizer across the dp ranks, which "
                      "diloco makes separate islands",
                      "each island keeps its whole inner optimizer; set zero = 0 (ZeRO inside "
                      "an island needs dp inside the island, which the mesh has not)")
    if m.ep > 1 and m.tp % m.ep:
        yield Problem(where(plan, "mesh.ep", "sync"),
                      f"ep = {m.ep} does not divide tp = {m.tp}, so its EP groups would "
                      "cross diloco's islands and their all-to-all would join them every step",
                      "an island is one dp replica; EP must stay inside it, on the island's "
                      "tp ranks: pick ep dividing tp (e.g. tp = 2, ep = 2), or ep = 1 (the "
                      "experts then live whole in every island)")
    if plan.experts is not None and plan.experts.balance == "step":
        yield Problem(where(plan, "experts.balance", "sync"),
                      "experts.balance = step averages the routing statistics over the step's "
                      "global tokens, across the dp ranks that diloco makes separate islands",
                      "use balance = microbatch with diloco (each call's own statistics), or "
                      "sync = every_step")
    stages = m.pp * plan.pipeline.virtual
    if s.fragments > 1 and stages % s.fragments:
        yield Problem(where(plan, "sync.fragments", "sync"),
                      f"fragments = {s.fragments} does not divide the {stages} pipeline stages",
                      "a fragment is a run of whole stages; pick a divisor of pp * virtual")
    if s.fragments > s.inner_steps:
        yield Problem(where(plan, "sync.fragments", "sync"),
                      f"fragments = {s.fragments} is more than inner_steps = {s.inner_steps}",
                      "fragments sync at offsets spread over inner_steps; with more fragments "
                      "than steps two would share an offset")
    if s.inner_steps > plan.train.steps:
        yield Problem(where(plan, "sync.inner_steps", "sync"),
                      f"inner_steps = {s.inner_steps} but training runs {plan.train.steps} "
                      "steps: the islands would never sync", f"use inner_steps <= "
                      f"{plan.train.steps}")
    if s.outer_optimizer.name == "nesterov" and s.outer_optimizer.momentum == 0:
        yield Problem(where(plan, "sync.outer_optimizer.momentum", "sync.outer_optimizer"),
                      "nesterov needs momentum > 0", "for plain averaging steps use "
                      "sgd(lr = ..., momentum = 0)")
    if not s.decoupled and "sync.timeout" in plan.spans:
        yield Problem("sync.timeout", "timeout does nothing unless decoupled = true",
                      "a synchronous diloco waits for every island; remove timeout or set "
                      "decoupled = true")
    if s.decoupled and s.timeout <= 0:
        yield Problem(where(plan, "sync.timeout", "sync"), "timeout must be above 0s",
                      "how long a sync waits for late islands, e.g. timeout = 30s")
