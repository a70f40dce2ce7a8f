"""compile.mode = graphs: the joint graph's F / B / W / BW partition, checked by running it.

The matmuls each graph runs are counted at dispatch (a TorchDispatchMode, not the
partitioner's own node lists) and classified by the shape they produce: the model's
sizes are chosen so that no parameter has a dimension of the microbatch's token count,
so an input-gradient matmul (tokens x features) has that dimension and a
weight-gradient one (a parameter's size) has not. B must run input-gradient
matmuls only, W weight-gradient ones only, and F+B+W exactly the matmuls of eager
autograd's forward and backward -- nothing run twice. The gradients equal eager
autograd's (float64, bitwise here). Also: what cannot be traced jointly is refused with
the op named.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeplan.backends.runtime.graph_stage import GraphStageRunner
from pipeplan.backends.runtime.stage import StageRunner
from pipeplan.compiler.driver import compile_plan
from pipeplan.compiler.graphs.joint import JointTraceError, trace_joint
from pipeplan.compiler.capture.loading import load_model
from pipeplan.dsl.ast import (DataSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, RecomputeRule,
                              TrainSpec)

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}
TOKENS = 2 * 16  # microbatch 2 x seq 16: no parameter has a dimension of 32


class Matmuls(TorchDispatchMode):
    """Records the output shape of every matmul dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.shapes.append(tuple(out.shape))
        return out


def _plan(model: str = "gpt") -> Plan:
    args = {"vocab": 64, "dim": 24, "layers": 2, "heads": 4, "seq_len": 16}
    if model == "moe":
        args.update(num_experts=4, top_k=2)
    source = {"gpt": "pipeplan.examples.models.gpt:GPT",
              "moe": "pipeplan.examples.models.moe_gpt:MoEGPT"}[model]
    return Plan(model=ModelSpec(source, args=args), data=DataSpec(seq_len=16, vocab=64, seed=1),
                mesh=MeshSpec(pp=2), pipeline=PipelineSpec(schedule="1f1b", microbatches=2),
                train=TrainSpec(steps=1, global_batch=4, precision="fp64"))


def _run(runner_cls, stages, ids, targets, split: bool):
    """F of both stages, then B and W (split) or BW of each, for two microbatches; per stage
    the matmul shapes of each action of the second, and every gradient (weights by name,
    then the boundary's input grads)."""
    modules = [copy.deepcopy(s.module) for s in stages]
    runners = [runner_cls(s, m, k == 1, 0.5) for k, (s, m) in enumerate(zip(stages, modules))]
    seen: dict[tuple[int, str], list] = {}
    for mb in (0, 1):  # microbatch 0 traces the graphs; microbatch 1 is counted
        def counted(stage, op, fn, *args):
            with Matmuls() as mode:
                out = fn(*args)
            if mb == 1:
                seen.setdefault((stage, op), []).extend(mode.shapes)
            return out

        out0 = counted(0, "F", runners[0].forward, mb, [ids])
        by_name = {o.name: v for o, v in zip(stages[0].outputs, out0)}
        counted(1, "F", runners[1].forward, mb,
                [by_name.get(r.name, targets) for r in stages[1].inputs])
        if split:
            g1 = counted(1, "B", runners[1].backward_input, mb)
            counted(1, "W", runners[1].backward_weight, mb)
        else:
            g1 = counted(1, "BW", runners[1].backward_full, mb)
        counted(0, "BW", runners[0].backward_full, mb,
                [g1.get(o.name) for o in stages[0].outputs])
    grads = {f"{k}.{n}": p.grad for k, m in enumerate(modules) for n, p in m.named_parameters()}
    grads.update({f"in.{n}": g for n, g in g1.items()})
    return seen, grads


def _weight_sized(stages) -> set[int]:
    return {p.numel() for s in stages for p in s.module.parameters()}


class _HandsOnAView(torch.nn.Module):
    """A stage that hands on a slice of its input next to its own result (OPT's stage 0
    passes its mask's view on), both needing gradients."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x):
        return x @ self.w, x[:, :2]


def test_a_stage_output_that_views_its_input_is_traced_as_its_own_copy():
    """A joint graph cannot return what aliases its inputs ("stage returns a view of an
    input": OPT under graphs mode was refused); the output is traced as a copy of the view
    (its gradient flows back into the input's slice as the view's would: OPT pp2 under
    graphs mode verifies EQUAL, docs/models.md)."""
    gm = torch.fx.symbolic_trace(_HandsOnAView())
    x = torch.randn(3, 4, dtype=torch.float64)
    joint = trace_joint(gm, [x], [True])
    copies = [n for n in joint.gm.graph.nodes if n.op == "call_function"
              and "clone" in str(n.target)]
    assert copies and joint.tangent_outputs == [0, 1]


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_b_has_no_weight_matmuls_w_no_input_matmuls_and_nothing_runs_twice(model):
    plan = _plan(model)
    torch.manual_seed(0)
    net = load_model(plan, "cpu").double()
    stages = compile_plan(plan, net).stages
    assert all(TOKENS not in p.shape for s in stages for p in s.module.parameters())
    sizes = _weight_sized(stages)
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    eager, eager_grads = _run(StageRunner, stages, ids, targets, split=False)
    graphs, graph_grads = _run(GraphStageRunner, stages, ids, targets, split=True)
    b, w = graphs[(1, "B")], graphs[(1, "W")]
    assert b and w
    # an input-gradient matmul has a token dimension; a weight-gradient one has none and a
    # parameter's size (a matrix, or experts stacked / flattened by einsum)
    assert all(TOKENS in s for s in b), f"B ran a weight-gradient matmul: {b}"
    assert all(TOKENS not in s and math.prod(s) in sizes for s in w), \
        f"W ran an input-gradient matmul: {w}"
    for stage in (0, 1):  # the same matmuls as eager forward + backward, none twice
        ran = sorted(sum((v for (s, _), v in graphs.items() if s == stage), []))
        assert ran == sorted(sum((v for (s, _), v in eager.items() if s == stage), []))
    assert graph_grads.keys() == eager_grads.keys()
    for name, g in eager_grads.items():
        assert g is not None and graph_grads[name] is not None, name
        torch.testing.assert_close(graph_grads[name], g, rtol=1e-12, atol=1e-14, msg=name)


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _custom(x):
    return _Custom.apply(x)


def _calls_function() -> torch.fx.GraphModule:
    """A stage graph calling the Function as one op (fx's own tracer would inline it)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_method("sum", (g.call_function(_custom, (x,)),)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _scaled_by_its_sum(x):
    return x * float(x.sum().item())  # a value read on the host


torch.fx.wrap("_scaled_by_its_sum")


class _ReadsAValue(torch.nn.Module):
    def forward(self, x):
        return _scaled_by_its_sum(torch.relu(x)).sum()


class _DataDependent(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


def test_untraceable_stages_are_refused_naming_the_op():
    x = torch.randn(4, 4)
    with pytest.raises(JointTraceError, match="_Custom"):
        trace_joint(_calls_function(), [x], [True])
    gm = torch.fx.symbolic_trace(_DataDependent())
    with pytest.raises(JointTraceError, match="nonzero|masked_select|index"):
        trace_joint(gm, [x], [True])


def test_a_value_read_on_the_host_is_refused_naming_the_reader_and_the_stage_line():
    """The refusal says which code read the value (here a function the graph calls; under
    tp, DTensor's redistribution of a line's operands) and which line of the stage graph
    ran it, not only the op."""
    gm = torch.fx.symbolic_trace(_ReadsAValue())
    with pytest.raises(JointTraceError) as e:
        trace_joint(gm, [torch.randn(4, 4)], [True])
    msg = str(e.value)
    assert "_local_scalar_dense" in msg and "read as a Python value" in msg
    assert "test_graph_split.py" in msg and "_scaled_by_its_sum (`return x * float(" in msg
    assert "in the stage's `_scaled_by_its_sum = " in msg


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_activation_bytes_estimate_equals_what_graphs_mode_keeps(model):
    """The compiler's activation bytes per microbatch (graphs mode: what F saves for B and
    W, from the traced metadata) equal the bytes of the distinct storages the runtime keeps
    between F and the backward, measured on the real tensors, per stage."""
    import dataclasses

    from pipeplan.dsl.ast import CompileSpec

    plan = dataclasses.replace(_plan(model), compile=CompileSpec(mode="graphs"))
    torch.manual_seed(0)
    stages = compile_plan(plan, load_model(plan, "cpu").double()).stages
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    runners = [GraphStageRunner(s, s.module, k == 1, 0.5, joint=s.joint)
               for k, s in enumerate(stages)]
    for r in runners:
        r.measure_saved()
    out0 = runners[0].forward(0, [ids])
    by_name = {o.name: v for o, v in zip(stages[0].outputs, out0)}
    runners[1].forward(0, [by_name.get(r.name, targets) for r in stages[1].inputs])
    for s, r in zip(stages, runners):
        assert s.activation_bytes > 0
        assert r.saved_bytes[0] == s.activation_bytes, (s.index, r.saved_bytes, s.activation_bytes)


RULES = {"none": (), "selective": (RecomputeRule("layers.*", "selective"),),
         "full": (RecomputeRule("layers.*", "full"),)}


@pytest.mark.parametrize("model", ["gpt", pytest.param("moe", marks=pytest.mark.heavy)])
def test_recompute_is_a_partition_choice_saved_bytes_equal_the_estimate(model):
    """Under recompute rules in graphs mode, the compiler's activation bytes (its own trace,
    tagged by region) equal what the runtime keeps (the runner's own trace) per stage;
    `full` keeps less than `selective`, which keeps less than no recompute; and the
    gradients equal eager autograd's without recompute (B reruns what F did not save)."""
    import dataclasses

    from pipeplan.dsl.ast import CompileSpec

    torch.manual_seed(0)
    net = load_model(_plan(model), "cpu").double()
    eager_stages = compile_plan(_plan(model), copy.deepcopy(net)).stages
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    _, eager_grads = _run(StageRunner, eager_stages, ids, targets, split=False)
    kept = {}
    for mode, rules in RULES.items():
        plan = dataclasses.replace(_plan(model), compile=CompileSpec(mode="graphs"),
                                   recompute=rules)
        stages = compile_plan(plan, copy.deepcopy(net)).stages
        runners = [GraphStageRunner(s, copy.deepcopy(s.module), k == 1, 0.5, recompute=rules)
                   for k, s in enumerate(stages)]  # each traces its own joint graph
        for r in runners:
            r.measure_saved()
        out0 = runners[0].forward(0, [ids])
        by_name = {o.name: v for o, v in zip(stages[0].outputs, out0)}
        runners[1].forward(0, [by_name.get(r.name, targets) for r in stages[1].inputs])
        g1 = runners[1].backward_input(0)
        runners[1].backward_weight(0)
        runners[0].backward_full(0, [g1.get(o.name) for o in stages[0].outputs])
        for s, r in zip(stages, runners):
            assert r.saved_bytes[0] == s.activation_bytes, (mode, s.index, r.saved_bytes)
        kept[mode] = [s.activation_bytes for s in stages]
        grads = {f"{k}.{n}": p.grad for k, r in enumerate(runners)
                 for n, p in r.module.named_parameters()}
        for name, g in grads.items():
            ref = eager_grads[name] / 2  # eager ran two microbatches of the same batch
            torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-14, msg=f"{mode} {name}")
    for s in range(2):
        assert kept["full"][s] < kept["selective"][s] < kept["none"][s], kept
