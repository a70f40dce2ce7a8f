"""`pipeplan plan` on a tiny GPT and 8 ranks, judged by the compiler itself.

The reference is `compile_plan` on plans written out layout by layout (its own split,
capture and estimate for each), never the planner's unit tables or bounds.
"""
from __future__ import annotations

import dataclasses
import itertools
import os

import pytest

from pipeplan.cli import main
from pipeplan.compiler import compile_plan
from pipeplan.compiler.estimate.device import device_model
from pipeplan.dsl.ast import ContextSpec, DeviceSpec, MeshSpec
from pipeplan.dsl.load import load_plan, parse_plan
from pipeplan.planner.cost import auto_memory_limit, lower_bound, predict, quick_bound, \
    quick_held, step_bound
from pipeplan.schedules.memory import peak_per_rank
from pipeplan.planner.report import summary
from pipeplan.planner.search import search
from pipeplan.planner.space import Candidate, Constraints, enumerate_space, plan_of
from pipeplan.planner.units import measure

GPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "models", "gpt.py")
PLAN = f"""model {{
  source = "{os.path.abspath(GPT)}:GPT"
  args = {{ vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 32 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 32)
mesh {{ tp = 2 }}
tensor {{
  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v, layers.*.mlp.up]
  row = [layers.*.attn.proj, layers.*.mlp.down]
}}
train {{ global_batch = 8 }}
device {{ flops = 20TFLOP/s  intra_node = 100GB/s  inter_node = 10GB/s  ranks_per_node = 4 }}
"""


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.plan"
    path.write_text(PLAN)
    return load_plan(str(path))


@pytest.fixture(scope="module")
def units(plan):
    """The model measured once for every search here (three captures)."""
    return measure(plan, (1, 2, 4, 8), (1, 2, 4, 8), "layers.*")


def _peak(est) -> int:
    return est.peak_bytes


def _reference(plan, layouts):
    """{layout: (step time, peak bytes)} from the compiler, each layout its own plan."""
    out = {}
    for pp, tp, mbs in layouts:
        dp = 8 // (pp * tp)
        text = PLAN.replace("mesh { tp = 2 }", f"mesh {{ pp = {pp}  dp = {dp}  tp = {tp} }}\n"
                            f"pipeline {{ schedule = 1f1b  microbatch_size = {mbs} }}")
        if tp == 1:
            text = text.split("tensor {")[0] + "train {" + text.split("train {")[1]
        est = compile_plan(parse_plan(text, plan.path)).estimates
        out[(pp, tp, mbs)] = (est.step_time_s, _peak(est))
    return out


def test_search_returns_the_exhaustive_optimum_and_only_plans_that_fit(plan, units):
    layouts = [(pp, tp, mbs) for pp, tp in itertools.product((1, 2, 4), (1, 2))
               for mbs in (1, 2, 4, 8) if (8 // (pp * tp)) * mbs <= 8]
    ref = _reference(plan, layouts)
    capacity = sorted(p for _, p in ref.values())[len(ref) // 2]  # half the layouts fit
    fits = {k: v for k, v in ref.items() if v[1] <= capacity}
    assert 0 < len(fits) < len(ref)
    cons = Constraints(fixed={"zero": 0, "sp": False, "recompute": "none", "cp": 1},
                       schedules=("1f1b",))
    res = search(plan, 8, device_model(plan), capacity, cons, top_k=5, units=units)
    assert res.closed and res.top
    best = res.top[0]
    # at least as fast as every layout that fits (the planner's split may beat auto(flops))
    assert best.prediction.step_time_s <= min(t for t, _ in fits.values()) * (1 + 1e-9)
    for r in res.top:  # every proposal, compiled on its own, fits and is estimated alike
        est = compile_plan(plan_of(plan, r.candidate, res.units.blocks)).estimates
        assert _peak(est) <= capacity
        assert est.step_time_s == pytest.approx(r.prediction.step_time_s, rel=1e-9)
        assert _peak(est) == r.prediction.peak_bytes
    over = [k for k in ref if k not in fits]
    chosen = {(r.candidate.pp, r.candidate.tp, r.candidate.mbs) for r in res.top}
    assert not chosen & set(over)


def test_constraints_are_honoured(plan, units):
    cons = Constraints(fixed={"tp": 2, "zero": 1}, max_pp=2, schedules=("zbh1", "gpipe"),
                       no_recompute=True)
    res = search(plan, 8, device_model(plan), 1e9, cons, top_k=20, units=units)
    assert res.top
    for r in res.top:
        c = r.candidate
        assert (c.tp, c.zero, c.recompute) == (2, 1, "none")
        assert c.pp <= 2 and c.schedule in ("zbh1", "gpipe")
    assert any("--max-pp 2" in reason for reason in res.not_considered)


@pytest.mark.parametrize("cpu", [False, True], ids=["plan's device", "this CPU, shared"])
def test_bound_never_exceeds_the_prediction(plan, units, cpu):
    """The bounds read the speeds alone; on this CPU's measured model the prediction shares
    the cores (Sharing.factor >= 1: never faster than alone), so they bound it too."""
    cands = enumerate_space(plan, 8, len(units.blocks), Constraints(), 4, units.refused, True,
                            {}, frozenset({("cp", 1)}))
    dev = device_model(plan) if not cpu else device_model(dataclasses.replace(
        plan, device=DeviceSpec(), mesh=MeshSpec(pp=1, dp=8)))
    assert (dev.sharing is not None) == cpu
    picked = cands[::max(1, len(cands) // 60)]  # 60 spread over the space, every kind
    picked += [dataclasses.replace(c, memory_limit=n) for c in picked  # auto under a limit
               if c.schedule == "auto" for n in (1, 2)]
    assert any(c.memory_limit for c in picked)
    for c in picked:
        lb, held = lower_bound(units, c, dev)
        p = predict(units, c, dev)
        tighter = step_bound(units, c, dev)
        quick = quick_bound(units, c, dev)
        assert quick <= lb * (1 + 1e-12) and lb <= tighter <= p.step_time_s * (1 + 1e-12), \
            c.label()
        assert quick_held(units, c) <= held <= p.peak_bytes, c.label()
        if c.pp == 1:  # one rank holds the whole model's state: the quick bound is exact
            assert quick_held(units, c) == p.state_bytes, c.label()


def test_a_prediction_reads_no_other_devices_cached_times(plan, units):
    """Cached stage times are keyed by device: a device freed (the measured CPU's shared
    one is made per candidate, the plan's device per test) never lends its id, and so its
    cached times, to another. Every kind on one mesh (the same stages, a different busy
    share each), after the plan's device's own, predicted as on an empty cache."""
    def on_the_plans_device(cands):
        dev = device_model(plan)
        return [predict(units, c, dev).step_time_s for c in cands]

    cands = [c for c in enumerate_space(plan, 8, len(units.blocks), Constraints(), 4,
                                        units.refused, True, {}, frozenset({("cp", 1)}))
             if (c.pp, c.dp, c.tp, c.mbs, c.recompute, c.zero, c.sp) ==
             (2, 2, 2, 1, "none", 0, False)]
    assert len({c.schedule for c in cands}) >= 4
    on_the_plans_device(cands)
    cpu = device_model(dataclasses.replace(plan, device=DeviceSpec(), mesh=MeshSpec(pp=1, dp=8)))
    got = [predict(units, c, cpu) for c in cands]
    for c, p in zip(cands, got):
        assert predict(dataclasses.replace(units, cache={}), c, cpu) == p, c.label()


def test_one_pipeline_rank_searches_1f1b_not_gpipe_its_costlier_twin(plan, units):
    """At pp 1 gpipe is 1f1b's step holding every microbatch: enumerated only when 1f1b is
    not allowed."""
    kinds = {(c.pp == 1, c.schedule) for c in enumerate_space(
        plan, 8, len(units.blocks), Constraints(), 4, units.refused, True, {},
        frozenset({("cp", 1)}))}
    assert (True, "1f1b") in kinds and (True, "gpipe") not in kinds and (False, "gpipe") in kinds
    only = enumerate_space(plan, 8, len(units.blocks), Constraints(schedules=("gpipe",)), 4,
                           units.refused, True, {}, frozenset({("cp", 1)}))
    assert any(c.pp == 1 for c in only)
    one = Candidate(1, 2, 1, 1, 1, "1f1b", 1, 1, 4, False, "none", 0)  # 4 microbatches of 1
    a, b = predict(units, one, device_model(plan)), \
        predict(units, dataclasses.replace(one, schedule="gpipe"), device_model(plan))
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)  # the same step, summed
    assert a.peak_bytes < b.peak_bytes  # in another order


def test_zero_stages_predicted_as_fast_are_listed_once_holding_the_least_memory(plan, units):
    """ZeRO 1, 2 and 3 of one layout predicted exactly as fast (here pp2 x dp4: each
    stage's one reduction and gather pattern costs alike): listed once, the stage holding
    the least memory, and the report says how many it folded; a faster or slower stage
    stays listed (z0 here)."""
    fixed = {"sp": False, "recompute": "none", "cp": 1, "pp": 2, "tp": 1, "mbs": 1}
    device = device_model(plan)
    alone = {z: search(plan, 8, device, 1e12, Constraints(fixed={**fixed, "zero": z},
                                                           schedules=("1f1b",)),
                       top_k=1, units=units).top[0].prediction for z in (0, 1, 2, 3)}
    tied = (1, 2, 3)
    assert all(alone[z].step_time_s == pytest.approx(alone[1].step_time_s, rel=1e-9)
               for z in tied)
    assert alone[0].step_time_s != pytest.approx(alone[1].step_time_s, rel=1e-6)
    least = min(tied, key=lambda z: alone[z].peak_bytes)
    res = search(plan, 8, device, 1e12, Constraints(fixed=fixed, schedules=("1f1b",)),
                 top_k=6, units=units)
    assert sorted(r.candidate.zero for r in res.top) == [0, least]
    assert res.zero_ties == len(tied) - 1
    assert f"{len(tied) - 1} a listed plan's layout at another ZeRO stage" in summary(res)


def test_not_considered_names_each_reason_once(plan, units):
    res = search(plan, 8, device_model(plan), 1e9,
                 Constraints(tp_in_node=False, schedules=("1f1b",)), top_k=1, units=units)
    reasons = res.not_considered
    assert [v for r, v in reasons.items() if "tp does not divide the 4 heads" in r] == \
        [["tp=8"]]
    # cp: check's own reasons, Ulysses over 4 heads (cp alone, and tp x cp together), the
    # values beside them; the model's `arange` positions are renumbered per cp rank
    # (cp_locality), never a reason
    assert [v for r, v in reasons.items() if r.startswith("cp does not divide the 4 heads")] \
        == [["cp=8"]]
    assert sorted(reasons.get("tp * cp does not divide the 4 heads of attention "
                              "`scaled_dot_product_attention`")) == ["tp=2 cp=4", "tp=4 cp=2"]
    assert not any("positions" in r for r in reasons)
    assert len(reasons) == len(set(reasons))


def test_a_cp_value_is_captured_and_checked_only_when_the_search_reaches_it(plan):
    """The search measures cp = 1 only; a cp value is captured (and the compiler's cp checks
    run on it) when one of its candidates is reached: cp = 8 (8 ranks of Ulysses over 4
    heads) is refused with check's reason once reached, and never captured when fixed off."""
    lazy = measure(plan, (1, 2), (1, 2, 4, 8), "layers.*", check_all_cp=False)
    assert lazy.captures == 3 and not lazy.checked
    res = search(plan, 8, device_model(plan), 1e9,
                 Constraints(fixed={"cp": 8, "tp": 1}, schedules=("1f1b",)), units=lazy)
    assert not res.top and lazy.checked == {("cp", 8)}
    assert res.not_considered.get(next(r for r in res.not_considered if r.startswith(
        "cp does not divide the 4 heads"))) == ["cp=8"]
    res = search(plan, 8, device_model(plan), 1e9,
                 Constraints(fixed={"cp": 1, "tp": 1}, schedules=("1f1b",)), units=lazy)
    assert res.top and lazy.checked == {("cp", 8)} and lazy.captures == 4
    # before cp = 2 is captured its quick bound is the cp = 1 table's work halved per rank
    # (here twice the microbatches of half the dp: the same bound), asked in either order
    one = Candidate(2, 4, 1, 1, 1, "1f1b", 1, 2, 1, False, "none", 0)
    two = dataclasses.replace(one, dp=2, cp=2, microbatches=2)
    dev = device_model(plan)
    assert quick_bound(lazy, one, dev) == pytest.approx(quick_bound(lazy, two, dev), rel=1e-12)
    assert lazy.captures == 4


def test_auto_evaluations_are_capped_and_the_report_says_the_bound_did_not_close(plan, units):
    cons = Constraints(fixed={"tp": 1, "cp": 1, "zero": 0, "recompute": "none", "sp": False},
                       schedules=("auto", "1f1b"))
    full = search(plan, 8, device_model(plan), 1e9, cons, top_k=50, units=units,
                  max_auto=1000)
    assert full.closed and full.auto_evaluated > 2
    capped = search(plan, 8, device_model(plan), 1e9, cons, top_k=50, units=units,
                    max_auto=2)
    assert capped.auto_evaluated == 2 and not capped.closed
    assert capped.evaluated == full.evaluated - full.auto_evaluated + 2


def test_auto_predictions_made_ahead_in_a_child_are_those_made_here(plan, units, monkeypatch):
    """The search predicts its next auto candidate in a forked child while it evaluates one
    (search._ahead): the same top list, predictions and counts as a search that forks
    nothing, and the children's predictions were used."""
    from pipeplan.planner import forked

    cons = Constraints(fixed={"tp": 1, "cp": 1, "zero": 0, "recompute": "none", "sp": False},
                       schedules=("auto", "1f1b"))
    used = []
    wait = forked.Child.wait
    monkeypatch.setattr(forked.Child, "wait", lambda self: used.append(wait(self)) or used[-1])
    ahead = search(plan, 8, device_model(plan), 1e9, cons, top_k=50, units=units, max_auto=1000)
    monkeypatch.setattr(forked, "start", lambda work: None)
    here = search(plan, 8, device_model(plan), 1e9, cons, top_k=50, units=units, max_auto=1000)
    assert ahead.auto_evaluated > 2 and sum(1 for u in used if u and "prediction" in u) >= 2
    assert [(r.candidate, r.prediction) for r in ahead.top] == \
        [(r.candidate, r.prediction) for r in here.top]
    assert (ahead.evaluated, ahead.pruned, ahead.over_memory, ahead.closed) == \
        (here.evaluated, here.pruned, here.over_memory, here.closed)


def test_auto_searches_only_orders_that_fit_beside_the_states(plan, units):
    """An auto candidate gets the activations left beside its states as its memory limit:
    its schedule holds no more (the engine's count), its peak fits, and a tighter capacity
    gives a smaller limit (no limit at all: the fastest order holds more than fits)."""
    cons = Constraints(fixed={"tp": 1, "cp": 1, "zero": 0, "recompute": "none", "sp": False,
                              "pp": 4, "mbs": 1}, schedules=("auto",))
    free = search(plan, 8, device_model(plan), 1e12, cons, top_k=1, units=units)
    dev = device_model(plan)
    c = dataclasses.replace(free.top[0].candidate, memory_limit=0)
    unlimited = predict(units, c, dev).peak_bytes
    held = auto_memory_limit(units, c, dev, 1e12)
    assert held == c.microbatches  # everything fits: the limit is every microbatch
    capacity = (unlimited + quick_held(units, c)) / 2  # between the states and that peak
    res = search(plan, 8, dev, capacity, cons, top_k=3, units=units, max_auto=1000)
    assert res.top
    for r in res.top:
        lim = r.candidate.memory_limit
        assert 1 <= lim < c.microbatches and r.prediction.peak_bytes <= capacity
        sched = compile_plan(plan_of(plan, r.candidate, res.units.blocks)).schedule
        assert max(peak_per_rank(sched)[0]) <= lim + 1e-9
        assert sched.name.startswith("auto")


def test_a_context_parallel_candidate_is_estimated_as_check_estimates_it(plan, units):
    """cp is searched on a model whose positions come from its own `arange`: the best cp = 2
    plan, compiled on its own (check's path: locality, context checks, estimate), agrees."""
    cons = Constraints(fixed={"cp": 2, "tp": 2, "zero": 1}, schedules=("1f1b",))
    res = search(plan, 8, device_model(plan), 1e9, cons, top_k=2, units=units)
    assert res.top and all(r.candidate.cp == 2 for r in res.top)
    for r in res.top:
        est = compile_plan(plan_of(plan, r.candidate, res.units.blocks)).estimates
        assert est.step_time_s == pytest.approx(r.prediction.step_time_s, rel=1e-9)
        assert _peak(est) == r.prediction.peak_bytes


def test_cli_writes_a_plan_check_accepts_with_the_same_estimates(plan, tmp_path, capsys):
    src = tmp_path / "tiny.plan"
    src.write_text(PLAN)
    out = tmp_path / "best.plan"
    code = main(["plan", str(src), "--gpus", "8", "--memory", "0.004", "--ranks-per-node", "4",
                 "--schedules", "1f1b,zbv,interleaved", "--set", "zero=1", "--top", "3",
                 "-o", str(out), "--pick", "2", "--no-progress", "--no-verify"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    written = load_plan(str(out), world_size=8)
    assert written.zero == 1 and written.pipeline.schedule in ("1f1b", "zbv", "interleaved")
    est = compile_plan(written).estimates  # what `pipeplan check` estimates for it
    assert f" {est.step_time_s:.4g} " in printed.split("\n  2  ")[1].split("\n")[0]
    assert "# Chose #2:" in out.read_text()
    assert main(["check", str(out), "--world-size", "8"]) == 0


def test_the_input_plans_pipeline_limit_and_costs_do_not_reach_the_written_plan(tmp_path,
                                                                               capsys):
    """A memory limit or relative costs in the input describe another layout: the written
    plan (a pp 2 pipeline, whose 1f1b would break a limit of 1 and whose 2 stages the
    input's one-stage costs do not describe) carries the search's pipeline, and check accepts it."""
    src = tmp_path / "tiny.plan"
    src.write_text(PLAN.replace("train {", "pipeline {\n  memory_limit = 1\n  costs = "
                                "[[1, 2, 1]]\n}\ntrain {"))
    out = tmp_path / "best.plan"
    code = main(["plan", str(src), "--gpus", "8", "--memory", "1", "--set", "mesh.pp=2",
                 "--schedules", "1f1b", "--top", "2", "-o", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "pipeline.memory_limit, pipeline.costs are replaced by the search's" in printed
    written = load_plan(str(out), world_size=8)
    assert written.pipeline.memory_limit is None and written.pipeline.costs is None
    assert written.mesh.pp == 2 and main(["check", str(out), "--world-size", "8"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0", "--memory", "1"], "--gpus must be at least 1"),
    (["--gpus", "8", "--device", "tpu"], "known devices"),
    (["--gpus", "8", "--memory", "1", "--set", "mesh.tp=two"], "not a valid value"),
    (["--gpus", "8", "--memory", "1", "--schedules", "1f2b"], "unknown kind"),
    (["--gpus", "8"], "give --device"),
])
def test_bad_arguments_are_refused_clearly(tmp_path, capsys, argv, message):
    src = tmp_path / "tiny.plan"
    src.write_text(PLAN)
    assert main(["plan", str(src)] + argv) == 2
    assert message in capsys.readouterr().err


def test_planner_imports_point_down():
    """planner/ sits above compiler, dsl and schedules; it imports neither cli nor backends."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2] / "planner"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                top = (node.module or "").split(".")[0]
                assert top not in ("cli", "backends"), f"{path.name} imports {node.module}"


def test_recompute_only_where_it_pays_is_found_and_compiles_alike(plan, units):
    """1F1B holds pp - r microbatches on rank r: with memory between what recompute on
    every rank and no recompute need, the search recomputes on the first ranks only
    (faster than everywhere, fits where nothing else of the layout does)."""
    fixed = {"pp": 4, "tp": 1, "dp": 2, "mbs": 1, "zero": 0, "sp": False}
    dev = device_model(plan)
    base = search(plan, 8, dev, 1e12, Constraints(fixed=dict(fixed, recompute="none"),
                                                  schedules=("1f1b",)), top_k=1, units=units)
    full = search(plan, 8, dev, 1e12, Constraints(fixed=dict(fixed, recompute="full"),
                                                  schedules=("1f1b",)), top_k=1, units=units)
    none_peak = base.top[0].prediction.peak_bytes
    full_peak = full.top[0].prediction.peak_bytes
    assert full_peak < none_peak
    capacity = (none_peak + full_peak) / 2
    res = search(plan, 8, dev, capacity, Constraints(fixed=fixed, schedules=("1f1b",)),
                 top_k=3, units=units)
    best = res.top[0]
    assert 0 < best.candidate.rc_ranks < 4 and best.candidate.recompute != "none"
    assert best.prediction.peak_bytes <= capacity
    everywhere = [r for r in res.top if not r.candidate.rc_ranks]
    assert all(best.prediction.step_time_s < r.prediction.step_time_s for r in everywhere)
    est = compile_plan(plan_of(plan, best.candidate, res.units.blocks)).estimates
    assert est.step_time_s == pytest.approx(best.prediction.step_time_s, rel=1e-9)
    assert _peak(est) == best.prediction.peak_bytes


def test_orders_built_ahead_in_children_are_those_built_here(plan, units, monkeypatch):
    """The fixed kinds' orders the stand-ins read are built by forked children in the order
    the search pops them (search._orders_ahead): the same top list, predictions and counts
    as a search that forks nothing, the children's orders were used, and the held states
    they handed back equal those built here."""
    from pipeplan.planner import forked
    from pipeplan.planner.cost import order_held_states

    fixed = {"tp": 1, "cp": 1, "zero": 0, "sp": False, "mbs": 1}
    cons = Constraints(fixed=fixed, schedules=("1f1b", "zbh2", "vhalf", "interleaved"))
    dev = device_model(plan)
    full = search(plan, 8, dev, 1e12, Constraints(fixed=dict(fixed, recompute="full", pp=4),
                                                  schedules=("1f1b",)), top_k=1, units=units)
    none = search(plan, 8, dev, 1e12, Constraints(fixed=dict(fixed, recompute="none", pp=4),
                                                  schedules=("1f1b",)), top_k=1, units=units)
    capacity = (full.top[0].prediction.peak_bytes + none.top[0].prediction.peak_bytes) / 2
    streams, taken = [], {}
    start = forked.stream

    def watched(n, plan_, work, workers=1):
        streams.append(start(n, plan_, work, workers))
        take = streams[-1].take
        streams[-1].take = lambda i: taken.setdefault(i, take(i))
        return streams[-1]
    monkeypatch.setattr(forked, "stream", watched)
    units.cache.clear()
    ahead = search(plan, 8, dev, capacity, cons, top_k=20, units=units)
    monkeypatch.setattr(forked, "stream", lambda n, plan_, work, workers=1:
                        forked.Stream(n, plan_, work, workers=0))
    units.cache.clear()
    here = search(plan, 8, dev, capacity, cons, top_k=20, units=units)
    assert streams and streams[0].taken >= 3
    assert any(r.candidate.rc_ranks for r in here.top)  # the stand-ins were resolved
    assert [(r.candidate, r.prediction) for r in ahead.top] == \
        [(r.candidate, r.prediction) for r in here.top]
    assert (ahead.evaluated, ahead.enumerated, ahead.pruned, ahead.over_memory) == \
        (here.evaluated, here.enumerated, here.pruned, here.over_memory)
    got = {k: v for k, v in units.cache.items() if k[0] == "held states"}
    assert got and all(order_held_states(k) == v for k, v in got.items())


def test_a_stream_hands_back_what_its_work_computes_and_skips_what_is_taken_here():
    """forked.Stream: the children's results equal the work's; an item claimed here before
    a child reaches it is left to the caller (None), never computed twice by the children;
    a failing item is handed back as None; with no children every take is None."""
    import time

    from pipeplan.planner import forked

    def plan(wanted):
        time.sleep(0.2)  # (the caller claims item 5 first)
        return list(range(20))

    def work(i):
        if i == 7:
            raise ValueError("seven")
        return {"square": i * i}

    s = forked.stream(20, plan, work, workers=2)
    try:
        assert s.take(5) is None  # claimed before any child started it
        while not all(child.done() for child in s.children):
            time.sleep(0.05)
        got = {i: s.take(i) for i in range(20) if i != 5}
        assert got.pop(7) is None
        assert got == {i: {"square": i * i} for i in got}
        assert s.taken == 18
    finally:
        s.close()
    assert not s.children
    idle = forked.Stream(3, plan, work, workers=0)
    assert [idle.take(i) for i in range(3)] == [None, None, None]


@pytest.mark.heavy
def test_cp_is_searched_on_a_library_model_with_its_own_mask(tmp_path):
    """A transformers Llama (export, the library's own sdpa mask): cp = 2 passes the
    compiler's cp passes (the mask rebuilt on the whole sequence), so the planner measures
    and offers it; the best cp = 2 plan compiles with the same estimate."""
    from pipeplan.tests.parallel.test_family_matrix import plan_text
    path = tmp_path / "llama.plan"
    path.write_text(plan_text("llama", "cp2_ring").replace("mesh { cp = 2 }", "mesh { dp = 2 }")
                    .replace("context { method = ring }\n", ""))
    hf = load_plan(str(path))
    units = measure(hf, (1,), (1, 2), None)
    assert ("cp", 2) not in units.refused, units.refused
    res = search(hf, 2, device_model(hf), 1e12, Constraints(fixed={"cp": 2, "recompute": "none"}),
                 top_k=1,
                 units=units)
    best = res.top[0]
    assert best.candidate.cp == 2
    est = compile_plan(plan_of(hf, best.candidate, res.units.blocks)).estimates
    assert est.step_time_s == pytest.approx(best.prediction.step_time_s, rel=1e-9)


def _library_plan(tmp_path, source: str):
    """A plan for a transformers model by export (no `tensor` section), this file's device."""
    path = tmp_path / "library.plan"
    path.write_text(f'model {{\n  source = "{source}"\n  capture = export\n}}\n'
                    "data = synthetic(seed = 0, vocab = 64, seq_len = 16)\n"
                    "train { global_batch = 8 }\n" + PLAN[PLAN.index("device {"):])
    return load_plan(str(path))


def test_tp_is_searched_by_the_models_own_plan_where_the_plan_names_no_patterns(tmp_path):
    """A plan with no `tensor` section: `check` splits a transformers Llama by the plan the
    model declares (config.base_model_tp_plan), so the planner searches tp on it and writes
    `tensor.plan = model`; the written plan compiles to the planner's estimate. A model that
    declares none (the example GPT) gets tp refused with the compiler's own reason."""
    hf = _library_plan(tmp_path, "pipeplan.tests.compiler.models:tiny_llama")
    units = measure(hf, (1, 2), (1,), None)
    assert ("tp", 2) not in units.refused, units.refused
    res = search(hf, 4, device_model(hf), 1e12,
                 Constraints(fixed={"tp": 2, "pp": 1, "recompute": "none"}), top_k=2,
                 units=units)
    best = res.top[0]
    written = plan_of(hf, best.candidate, res.units.blocks)
    assert best.candidate.tp == 2 and written.tensor.plan == "model"
    est = compile_plan(written).estimates
    assert est.step_time_s == pytest.approx(best.prediction.step_time_s, rel=1e-9)
    gpt = dataclasses.replace(hf, model=dataclasses.replace(
        hf.model, source=os.path.abspath(GPT) + ":GPT", capture="fx",
        args={"vocab": 64, "dim": 32, "layers": 4, "heads": 4, "seq_len": 16}))
    res = search(gpt, 4, device_model(gpt), 1e12,
                 Constraints(fixed={"pp": 1, "cp": 1, "recompute": "none"}), top_k=1)
    (reason,) = [r for r, v in res.not_considered.items() if "tp=2" in v]
    assert "declares no tensor-parallel plan" in reason and res.top[0].candidate.tp == 1


def test_a_cp_value_the_model_cannot_be_captured_at_is_listed_not_raised(tmp_path):
    """Megatron 2021's attention adds a causal buffer made at the whole sequence: at cp = 2
    its capture fails (one cp rank's sequence is half). Reached first by a stand-in for
    recomputing on the first ranks only, the cp value is still checked before any table
    of it is read: the search lists check's reason and proposes no cp = 2 plan."""
    megatron = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "calibration",
                            "megatron_gpt.py")
    path = tmp_path / "megatron.plan"
    path.write_text(PLAN.replace(os.path.abspath(GPT), os.path.abspath(megatron)))
    tiny = load_plan(str(path))
    lazy = measure(tiny, (1, 2), (1, 2), "layers.*", check_all_cp=False)
    res = search(tiny, 8, device_model(tiny), 1e12,
                 Constraints(fixed={"cp": 2, "tp": 1, "pp": 2, "recompute": "full"},
                             schedules=("1f1b",)), units=lazy)
    assert not res.top
    assert res.not_considered and all(v == ["cp=2"] for v in res.not_considered.values())
    assert any("shape propagation failed" in r for r in res.not_considered)


def test_a_reason_every_cp_value_meets_is_listed_once_with_the_values(tmp_path):
    """OPT's positions (a cumulative sum over a mask the model makes, added to the tokens)
    refuse context parallel at every cp value, for the same reason but for the counts in it
    (cp, the rows of a rank): "not considered" lists the reason once, with the cp values
    beside it, not once per value."""
    opt = _library_plan(tmp_path, "pipeplan.tests.parallel.families:opt")
    units = measure(opt, (1,), (1, 2, 4), "model.decoder.layers.*", check_all_cp=True)
    res = search(opt, 4, device_model(opt), 1e12,
                 Constraints(fixed={"tp": 1}, schedules=("1f1b",)), units=units)
    cp = {r: v for r, v in res.not_considered.items() if any("cp=" in x for x in v)}
    assert len(cp) == 1, cp
    (reason, values), = cp.items()
    assert sorted(values) == ["cp=2", "cp=4"] and "mixes positions" in reason
    assert "cp = " not in reason and res.top


def test_a_cp_rank_runs_every_attention_block_in_the_time_model(plan, units):
    """The meta run costs each attention op on one cp rank's slice: one block of (S/cp)^2.
    A rank runs more (ring, causal: its own block and cp-1 half blocks; Ulysses: the whole
    sequence over H/cp heads, cp blocks), and the time model's ops and the FLOPs say so."""
    method = (plan.context or ContextSpec()).method  # ulysses unless the plan says
    for cp in (2, 4):
        blocks = 1 + (cp - 1) / 2 if method == "ring" else cp  # the GPT's is_causal=True
        one, many = (units.at(1, False, False, "none", c)[units.blocks.index("layers.0")]
                      for c in (1, cp))
        att = [sum(n for (g, _, _), n in u.work.gemms.items() if g.attention) for u in (one, many)]
        assert att[0] > 0 and att[1] == pytest.approx(blocks * att[0])


LLAMA = os.path.join(os.path.dirname(__file__), "..", "compiler", "models.py")


@pytest.mark.parametrize("source", ["gpt", "llama", "widening"])
def test_repeated_blocks_share_one_walk_and_give_the_same_tables(plan, source, monkeypatch):
    """A layer stack's blocks are walked once per distinct form (planner/repeats.py): every
    table (tp on and off, sequence parallel, every recompute mode, sizes 1-3) equals the
    one walked block by block, and fewer walks ran."""
    import pipeplan.planner.units as units_module
    from pipeplan.planner import repeats
    if source == "llama":
        plan = dataclasses.replace(
            plan, model=dataclasses.replace(
                plan.model, source=os.path.abspath(LLAMA) + ":Llama",
                args={"vocab": 64, "dim": 32, "layers": 5, "heads": 4, "kv_heads": 2,
                      "ffn": 48}),
            tensor=dataclasses.replace(
                plan.tensor, column=tuple(f"layers.*.{m}" for m in ("attn.q", "attn.k",
                                                                    "attn.v", "gate", "up")),
                row=("layers.*.attn.o", "layers.*.down")))
    if source == "widening":  # alike graphs, other bytes: no walk may be shared
        plan = dataclasses.replace(
            plan, model=dataclasses.replace(plan.model, source=os.path.abspath(LLAMA) +
                                            ":Widening", args={"layers": 4}),
            tensor=dataclasses.replace(plan.tensor, column=(), row=()))
    walks = {}

    def measured(enabled: bool):
        calls = [0]
        real = units_module.stage_saved_bytes

        def counted(*a, **k):
            calls[0] += 1
            return real(*a, **k)
        monkeypatch.setattr(units_module, "stage_saved_bytes", counted)
        monkeypatch.setattr(repeats, "ENABLED", enabled)
        u = measure(plan, (1, 2), (1,), "layers.*")
        walks[enabled], walks["blocks"] = calls[0], len(u.blocks)
        return {k: [dataclasses.replace(x, params=tuple((kind, n) for _, kind, n in x.params))
                    for x in t] for k, t in u.tables.items()}
    plain, shared = measured(False), measured(True)
    assert shared == plain
    assert {k[3] for k in plain} == {"none", "selective", "full"}
    if source == "widening":
        return
    assert any(k[2] for k in plain)  # sequence parallel among them
    layers = plan.model.args["layers"]  # layers 2.. reuse layer 1's walks at least
    assert walks[True] <= walks[False] * (walks["blocks"] - (layers - 2)) / walks["blocks"], \
        walks


def test_balanced_split_minimises_the_heaviest_stage():
    """Against every way to cut small runs of blocks (equal layers among them): the split's
    heaviest stage is the least possible, and every stage has a block."""
    import random
    from pipeplan.planner.cost import balanced_split
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 9)
        w = [rng.choice([1.0, 1.0, 0.25, 3.0, rng.uniform(0.01, 4.0)]) for _ in range(n)]
        stages = rng.randint(1, n)

        def heaviest(split):
            b = (0,) + tuple(split) + (n,)
            return max(sum(w[x:y]) for x, y in zip(b, b[1:]))
        best = min(heaviest(c) for c in itertools.combinations(range(1, n), stages - 1))
        got = balanced_split(w, stages)
        assert len(got) == stages - 1 and list(got) == sorted(set(got)) and \
            all(0 < g < n for g in got)
        assert heaviest(got) == pytest.approx(best, rel=1e-9), (w, stages, got)


def test_balanced_split_cuts_at_the_least_bottleneck_a_whole_range_bisection_finds():
    """The bracketed search lands on the very float a bisection of the whole range
    [max, sum] finds when run until it cannot move (written here on its own), so the cut is
    the same: equal layers (sums equal up to rounding), a heavy first and last unit, up to
    130 units in 1 to 64 stages, and units that do not all fit one per stage."""
    import bisect
    import random
    from pipeplan.planner.cost import balanced_split

    def greedy(prefix, stages, limit):
        n, out, start = len(prefix) - 1, [], 0
        for left in range(stages - 1, 0, -1):
            cut = min(bisect.bisect_right(prefix, prefix[start] + limit, start + 1) - 1,
                      n - left)
            if cut <= start:
                return None
            out.append(cut)
            start = cut
        return out if prefix[n] - prefix[start] <= limit else None

    rng = random.Random(3)
    for _ in range(400):
        n = rng.randint(2, 130)
        layer = rng.uniform(0.001, 2.0)
        w = [layer * rng.choice([1.0, 1.0, 1.0, 1.0 + 1e-13, rng.uniform(0.5, 2)])
             for _ in range(n)]
        w[0] *= rng.choice([1.0, 3.0, 17.0])
        w[-1] *= rng.choice([1.0, 5.0])
        stages = rng.randint(1, min(n, 64))
        if stages == 1:
            assert balanced_split(w, stages) == ()
            continue
        prefix = [0.0]
        for x in w:
            prefix.append(prefix[-1] + x)
        lo, hi = max(w), sum(w)
        while True:
            mid = (lo + hi) / 2
            if mid in (lo, hi):
                break
            if greedy(prefix, stages, mid) is None:
                lo = mid
            else:
                hi = mid
        want = tuple(greedy(prefix, stages, hi * (1 + 1e-12))
                     or greedy(prefix, stages, hi * (1 + 1e-9)))
        assert balanced_split(w, stages) == want, (n, stages)


def test_on_the_measured_cpu_a_pipelined_plan_is_estimated_as_check_estimates_it(tmp_path,
                                                                                 capsys):
    """No device section: the planner predicts on this CPU's measured model, whose ranks
    share the cores (Sharing: each candidate's dp x cp x tp copies of its pipeline) and pay
    for posting each transfer (post_s, by stage adjacency). The written pp = 4 plans,
    compiled as `pipeplan check` compiles them, agree with the printed steps. (Before: every
    candidate was timed as if world / 1 pipelines shared the cores -- 2x on pp 4 -- and
    without the posting.)"""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt_pp4_1f1b.plan")
    for pick in (1, 2):
        out = tmp_path / f"cpu{pick}.plan"
        code = main(["plan", src, "--gpus", "4", "--memory", "2", "--set", "mesh.pp=4",
                     "--schedules", "1f1b,zbv", "--top", "2", "--pick", str(pick), "-o",
                     str(out), "--no-progress", "--no-verify"])
        printed = capsys.readouterr().out
        assert code == 0, printed
        row = printed.split(f"\n  {pick}  ")[1].split("\n")[0].split()
        step = float(row[-6])  # step s, then TFLOP/s, MFU, peak GiB, bubble, comm s
        written = load_plan(str(out), world_size=4)
        assert written.mesh.pp == 4 and written.device.name is None
        est = compile_plan(written).estimates
        assert est.step_time_s == pytest.approx(step, rel=2e-3), (pick, printed)


def test_two_kinds_with_the_same_order_are_listed_once(plan, units):
    """ZB-H1 and ZB-H2 coincide when too few microbatches are in flight to differ: the same
    actions on the same ranks, the same run. The top list holds each run once (as the kind
    reached first) and says how many twins it left out; kinds whose orders differ both stay."""
    from pipeplan.planner.cost import order

    cons = Constraints(fixed={"pp": 2, "tp": 1, "cp": 1, "zero": 0, "recompute": "none",
                              "sp": False}, schedules=("zbh1", "zbh2"))
    res = search(plan, 8, device_model(plan), 1e9, cons, top_k=50, units=units)
    assert res.twins > 0 and "the same order as a listed plan" in summary(res)
    listed = [r.candidate for r in res.top]
    for a, b in itertools.combinations(listed, 2):
        if dataclasses.replace(a, schedule=b.schedule) == b:
            oa, ob = order(res.units, a), order(res.units, b)
            assert (oa.order, oa.stage_to_rank) != (ob.order, ob.stage_to_rank), (a, b)
    one = [c for c in listed if c.microbatches == 1]
    assert one and len({dataclasses.replace(c, schedule="") for c in one}) == len(one)


def test_a_size_read_off_the_line_equals_its_own_capture():
    """Sizes above 3 are read off the line through sizes 2 and 3 (Units.at); on the example
    GPT (vocabulary 256, 64 tokens a sequence) an embedding's gathered rows outgrow its
    table between 3 and 8 sequences: every unit's work, FLOPs, traffic and activation bytes
    at 8 equal a capture at 8 (the work rule is linear in the batch: compiler/capture/
    work.py, a gather reads the rows it writes)."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt_pp4_1f1b.plan")
    plan = load_plan(src)
    key = (8, False, False, "none", 1)
    lined = measure(plan, (1, 2, 4), (1,), "layers.*")
    got = lined.at(*key)
    assert lined.affine == {1: True}  # read off the line, not captured
    captured = measure(plan, (1, 2, 4), (1,), "layers.*")
    captured.affine[1] = False  # every size captured
    want = captured.at(*key)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.work.memory == b.work.memory and a.work.ops == b.work.ops, a.name
        assert a.work.gemms == b.work.gemms, a.name
        assert (a.flops, a.out_bytes) == pytest.approx((b.flops, b.out_bytes)), a.name
        assert a.activation_bytes == b.activation_bytes, a.name
