"""auto: never worse than the best fixed kind under the same memory limit; its gap to the bound is printed.

    python -m pytest -q -s tests/schedules/test_auto.py -k never_worse   # prints the table
"""
import pytest

from pipeplan.schedules import KINDS, Costs, ScheduleError, generate, simulate, verify
from pipeplan.schedules.gen_auto import auto_bound

P, M = 4, 8


def two_x_ends(stages: int, unit: float) -> tuple:
    costs = [(unit, unit, unit)] * stages
    costs[0] = costs[-1] = (2 * unit, 2 * unit, 2 * unit)
    return tuple(costs)


SETTINGS = {
    "F=1,B=1,W=1": Costs(),
    "F=1,B=1.5,W=0.5": Costs(1, 1.5, 0.5),
    "F=1,B=2,W=1": Costs(1, 2, 1),
    "F=1,B=1,W=1,c=0.1": Costs(latency=0.1),
    "per-stage 2x ends, v=1": Costs(per_stage=two_x_ends(P, 1.0)),
    "per-stage 2x ends, v=2": Costs(per_stage=two_x_ends(2 * P, 0.5)),
}


# Measured gaps to the all-placement bound (docs/schedules.md) plus slack for a slow machine,
# where the time-capped search stops earlier: 0 where auto reaches the bound.
MAX_GAP = {"F=1,B=1,W=1": 1e-9, "F=1,B=1.5,W=0.5": 0.02, "F=1,B=2,W=1": 0.03,
           "F=1,B=1,W=1,c=0.1": 0.035, "per-stage 2x ends, v=1": 1e-9, "per-stage 2x ends, v=2": 1e-9}


def best_fixed(costs: Costs, limit: float):
    v = None if costs.per_stage is None else len(costs.per_stage) // P
    out = []
    for kind in KINDS[:-1]:
        try:
            s = generate(kind, P, M, v, memory_limit=limit)
        except ScheduleError:
            continue  # the kind does not exist for this v or does not fit the limit
        out.append((simulate(s, costs).makespan, kind))
    return min(out)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_auto_never_worse_than_best_fixed_kind(name):
    costs, limit = SETTINGS[name], float(P)
    s = generate("auto", P, M, costs=costs, memory_limit=limit)
    verify(s, memory_limit=limit)
    r = simulate(s, costs, memory_limit=limit)  # bound: this placement, any order within the limit
    fixed_makespan, fixed_kind = best_fixed(costs, limit)
    assert r.makespan <= fixed_makespan + 1e-9
    bound = auto_bound(P, M, None, costs, limit)  # every placement auto searches
    bound_bubble = 1 - sum(r.busy) / (P * bound)
    assert bound <= r.lower_bound + 1e-9 and r.lower_bound <= r.makespan + 1e-9
    assert r.bubble - bound_bubble <= MAX_GAP[name]  # regression guard on the search
    print(f"\n{name:24} auto bubble {r.bubble:.4f}  bound (its placement) {r.lower_bound_bubble:.4f}  "
          f"bound (all placements) {bound_bubble:.4f}  gap {r.bubble - bound_bubble:.4f}  "
          f"best fixed {fixed_kind} {1 - sum(r.busy) / (P * fixed_makespan):.4f}  [{s.name}]")


def test_auto_reaches_the_bound_at_unit_costs():
    r = simulate(generate("auto", P, M, memory_limit=P))
    assert r.bubble == pytest.approx(r.lower_bound_bubble)


def test_auto_respects_a_tight_memory_limit():
    s = generate("auto", P, M, costs=Costs(1, 1.5, 0.5), memory_limit=2)
    assert max(simulate(s).peak_activations) <= 2


def test_auto_without_limit_may_use_more_memory_to_go_faster():
    costs = Costs(1, 1.5, 0.5)
    free = simulate(generate("auto", P, M, costs=costs), costs)
    tight = simulate(generate("auto", P, M, costs=costs, memory_limit=P), costs)
    assert free.makespan <= tight.makespan + 1e-9


def test_auto_respects_requested_virtual_stages():
    assert generate("auto", P, M, virtual=1).stages == P
    assert generate("auto", P, M, virtual=2).stages == 2 * P
    with pytest.raises(ScheduleError, match="per-stage costs list 5 stages"):
        generate("auto", P, M, costs=Costs(per_stage=((1, 1, 1),) * 5))


def test_local_search_keeps_a_verified_schedule_and_never_lengthens_it():
    from pipeplan.schedules.gen_greedy import Policy, list_schedule
    from pipeplan.schedules.gen_refine import refine
    from pipeplan.schedules.ir import v_placement

    costs, placement = Costs(latency=0.1), v_placement(P)
    start = list_schedule("greedy", placement, M, costs.stage_table(placement),
                          Policy(split=True, limits=(float(P),) * P))
    polished = refine(start, costs, float(P), budget_s=30, evaluations=400)
    verify(polished, memory_limit=P)
    assert simulate(polished, costs).makespan < simulate(start, costs).makespan  # 28.5 -> shorter


def test_auto_is_a_pure_function_of_its_inputs():
    costs = Costs(1, 2, 1)
    assert generate("auto", P, M, costs=costs, memory_limit=P).order == \
        generate("auto", P, M, costs=costs, memory_limit=P).order
