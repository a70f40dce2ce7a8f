"""Capture: fx, export for transformers models, auto fallback with its reason, clear failures."""
from __future__ import annotations

import pytest
import torch

from pipeplan.compiler import compile_plan, load_model, reference_loss
from pipeplan.dsl.ast import ExpertsSpec
from pipeplan.dsl.errors import PlanError
from pipeplan.tests.backends.test_graph_split import _Custom  # x * 2, backward its gradient


def _batch(vocab, b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (b, t), generator=g),
            "targets": torch.randint(0, vocab, (b, t), generator=g)}


@pytest.mark.parametrize("factory,args", [
    ("tiny_llama", {"layers": 4}),
    ("tiny_llama", {"layers": 4, "tie": True}),
    ("tiny_llama", {"layers": 4, "use_cache": True}),  # the compiler passes use_cache=False
    ("tiny_mixtral", {"layers": 4}),
    ("tiny_qwen2_moe", {"layers": 4}),
    ("tiny_olmoe", {"layers": 4}),
    ("tiny_gpt2", {"layers": 4}),
])
def test_transformers_model_through_export_matches_eager(make_plan, chain, factory, args):
    plan = make_plan(f"tests/compiler/models.py:{factory}", args, pp=4, seq_len=16)
    model = load_model(plan, "cpu")
    compiled = compile_plan(plan, model)
    assert compiled.capture == "export"
    assert "fx failed" in compiled.capture_reason and "co_varnames" in compiled.capture_reason
    batch = _batch(64, plan.microbatch_size, 16)
    torch.manual_seed(1)  # GPT-2's dropout: the stages draw in the model's order
    got = chain(compiled, batch)
    torch.manual_seed(1)
    want = reference_loss("cross_entropy", model(input_ids=batch["input_ids"]), batch["targets"])
    assert torch.equal(got, want)
    assert compiled.stages[1].module_names[0] in ("model.layers.1", "transformer.h.1")
    own = {id(p) for p in model.parameters()}
    assert [n for st in compiled.stages for n, p in st.module.named_parameters()
            if id(p) not in own] == []
    names = set(model.state_dict())
    assert all(set(st.module.state_dict()) <= names for st in compiled.stages)
    if args.get("tie"):
        assert len(compiled.tied) == 1 and compiled.tied[0].stages == (0, 3)


def test_export_on_meta_compiles_without_weights(make_plan):
    plan = make_plan("tests/compiler/models.py:tiny_llama", {"layers": 4}, pp=2)
    compiled = compile_plan(plan)
    assert compiled.capture == "export"
    assert all(p.is_meta for st in compiled.stages for p in st.module.parameters())


def test_fx_chosen_when_it_works(make_plan):
    plan = make_plan("examples/models/gpt.py:GPT", {"layers": 2, "seq_len": 16})
    compiled = compile_plan(plan)
    assert compiled.capture == "fx" and "symbolic_trace succeeded" in compiled.capture_reason


def test_leaf_modules_are_kept_whole(make_plan, chain):
    plan = make_plan("examples/models/moe_gpt.py:MoEGPT", {"layers": 2, "seq_len": 16},
                     model_fields={"leaf_modules": ("layers.*.moe",), "capture": "fx"})
    model = load_model(plan, "cpu")
    compiled = compile_plan(plan, model)
    targets = [n.target for st in compiled.stages for n in st.module.graph.nodes
               if n.op == "call_module"]
    assert "layers.0.moe" in targets and "layers.1.moe" in targets
    batch = _batch(256, plan.microbatch_size, 16)
    assert torch.equal(chain(compiled, batch),
                       reference_loss("cross_entropy", model(batch["input_ids"]), batch["targets"]))


def test_uncapturable_model_names_module_and_line(make_plan):
    plan = make_plan("tests/compiler/models.py:Mixed", {}, pp=1)
    with pytest.raises(PlanError) as e:
        compile_plan(plan)
    text = str(e.value)
    assert "module `block`" in text and "models.py:" in text and "if x.sum() > 0" in text
    assert 'leaf_modules = ["block"]' in text
    assert "fx:" in text and "export:" in text


def test_fx_only_failure_on_transformers_points_at_forward(make_plan):
    plan = make_plan("tests/compiler/models.py:tiny_llama", {"layers": 2},
                     model_fields={"capture": "fx"})
    with pytest.raises(PlanError) as e:
        compile_plan(plan)
    assert "co_varnames" in str(e.value) and "modeling_llama.py" in str(e.value)
    assert 'capture = "export"' in str(e.value)


def test_grouped_mm_experts_are_costed_per_routed_token(make_plan):
    """transformers' Mixtral dispatches tokens to experts with a grouped matmul that torch's
    flop counter does not know; the compiler counts 2·rows·K·N for it."""
    from pipeplan.compiler.capture.blocks import module_path, within
    from pipeplan.compiler.capture.traced import trace_with_loss
    args = {"layers": 1, "dim": 32, "experts": 4, "top_k": 2}
    plan = make_plan("tests/compiler/models.py:tiny_mixtral", args, pp=1, microbatches=1,
                     global_batch=2, seq_len=16)
    traced = trace_with_loss(plan, load_model(plan))
    measured = sum(c.flops for n, c in traced.run.costs.items()
                   if within(module_path(n), "model.layers.0.mlp.experts"))
    tokens, d, inter = 2 * 16, 32, 64
    routed = tokens * 2  # each token visits top_k = 2 experts
    assert measured == 2 * routed * d * (2 * inter) + 2 * routed * inter * d  # gate_up, down


def test_move_stage_retargets_device_constants(make_plan):
    from pipeplan.compiler import move_stage
    plan = make_plan("tests/compiler/models.py:tiny_llama", {"layers": 2}, pp=2)
    compiled = compile_plan(plan, load_model(plan, "cpu"))
    stage = compiled.stages[0].module

    def named():
        return {str(v) for n in stage.graph.nodes for v in n.kwargs.values()
                if isinstance(v, torch.device)}
    assert named() == {"cpu"}  # export spelled out the capture device (arange etc.)
    move_stage(stage, "meta")
    assert named() == {"meta"}
    assert all(p.is_meta for p in stage.parameters())
    out = stage(torch.zeros(plan.microbatch_size, 16, dtype=torch.int64, device="meta"))
    assert all(t.is_meta for t in out)


def test_data_dependent_moe_as_leaf(make_plan, chain):
    """An eager expert loop breaks fx (the error names the MoE and suggests a leaf); as a
    leaf it compiles, runs exactly, and is costed at top_k / num_experts of dense."""
    plan = make_plan("tests/compiler/models.py:LoopMoENet", {"layers": 2}, pp=2,
                     model_fields={"capture": "fx"})
    with pytest.raises(PlanError) as e:
        compile_plan(plan)
    assert 'leaf_modules = ["layers.0"]' in str(e.value)
    leaf = make_plan("tests/compiler/models.py:LoopMoENet", {"layers": 2}, pp=2,
                     model_fields={"capture": "fx", "leaf_modules": ("layers.*",)})
    model = load_model(leaf, "cpu")
    compiled = compile_plan(leaf, model)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 16, (2, 16), generator=g),
             "targets": torch.randint(0, 16, (2, 16), generator=g)}
    assert torch.equal(chain(compiled, batch),
                       reference_loss("cross_entropy", model(batch["input_ids"]), batch["targets"]))
    from dataclasses import replace
    routed = compile_plan(replace(leaf, experts=ExpertsSpec(modules=("layers.*",),
                                                           num_experts=4, top_k=2)))
    assert compiled.stages[0].module_names == ("emb", "layers.0")
    tokens, d = 2 * 16, 8
    # meta run with everything selected: each of the 4 experts takes all tokens * top_k pairs
    everything = 4 * 2 * (tokens * 2) * d * d + 2 * tokens * d * 4  # experts + router
    # routed for real, the pairs are spread over the experts: 1/4 of that
    assert compiled.stages[0].flops - routed.stages[0].flops == pytest.approx(everything * 3 / 4)


@pytest.mark.parametrize("source,args", [
    ("examples/models/gpt.py:GPT", {"layers": 4, "seq_len": 16}),
    ("tests/compiler/models.py:Llama", {"vocab": 64, "dim": 32, "layers": 5, "heads": 4,
                                        "kv_heads": 2, "ffn": 48}),
    ("tests/compiler/models.py:Widening", {"layers": 4}),  # alike graphs, other shapes
    ("tests/compiler/models.py:tiny_llama", {"layers": 4, "tie": True}),  # export
    ("tests/compiler/models.py:tiny_mixtral", {"layers": 4}),
    ("tests/compiler/models.py:tiny_gpt2", {"layers": 4}),
])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_repeated_blocks_are_replayed_exactly(make_plan, monkeypatch, source, args, precision):
    """A block whose graph and inputs repeat one already run is replayed from it
    (capture/replay.py): every node's value spec, FLOPs, ops, work, saved and output
    storages (keys included) and the bf16 run's saved records equal a run of every node;
    the layer stacks are replayed, the widening one (other shapes each layer) never."""
    from pipeplan.compiler.capture import replay
    from pipeplan.compiler.capture.traced import trace_with_loss
    from pipeplan.compiler.estimate.activations import saved_records
    from pipeplan.compiler.estimate.precision import to_precision
    from pipeplan.dsl.ast import TrainSpec
    plan = make_plan(source, args, train=TrainSpec(global_batch=4, precision=precision))

    def spec(v):
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: (tuple(t.shape), t.stride(), t.dtype, t.requires_grad), v)

    def measured(enabled: bool):
        monkeypatch.setattr(replay, "ENABLED", enabled)
        model = load_model(plan, "meta")
        to_precision(model, precision)
        traced = trace_with_loss(plan, model)
        run = traced.run
        records = saved_records(precision, traced.module, run)
        return ({n.name: c for n, c in run.costs.items()},
                {n.name: spec(v) for n, v in run.values.items()}, records,
                run._replays.replayed)
    whole, replayed = measured(False), measured(True)
    assert whole[0] == replayed[0]
    assert whole[1] == replayed[1]
    assert whole[2] == replayed[2]
    assert whole[3] == 0
    if "Widening" in source:
        assert replayed[3] == 0
    else:
        assert replayed[3] >= args["layers"] - 2


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_custom_autograd_function_is_refused_at_the_model_line(make_plan, capture):
    """Both front ends trace through an autograd.Function's forward and drop its backward:
    the stages would train with round()'s zero gradient where the model's is the identity
    (a straight-through estimator)."""
    plan = make_plan("tests/compiler/models.py:FunctionLM", {"fn": "round"}, pp=1,
                     model_fields={"capture": capture})
    with pytest.raises(PlanError) as e:
        compile_plan(plan)
    text = str(e.value)
    assert "test.plan" in text and "_StraightThrough" in text and "models.py" in text
    assert "differs from autograd's gradient of its forward" in text


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_function_whose_backward_is_its_forwards_gradient_is_kept(make_plan, chain, capture):
    """A Function whose backward writes out its forward's derivative (BLOOM's GeLUFunction)
    trains the same model through the captured graph: proven on random float64 inputs,
    then accepted; the stages' loss and gradients are the model's."""
    plan = make_plan("tests/compiler/models.py:FunctionLM", {"fn": "square"}, pp=2,
                     model_fields={"capture": capture})
    torch.manual_seed(0)
    model = load_model(plan, "cpu").double()
    compiled = compile_plan(plan, model)
    batch = _batch(8, plan.microbatch_size, 16)
    got = chain(compiled, batch)
    want = reference_loss("cross_entropy", model(input_ids=batch["input_ids"]), batch["targets"])
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)




@pytest.mark.slow
def test_phimoe_is_refused_at_a_plan_line_not_crashed(tmp_path):
    """PhiMoE's router: export keeps its `torch.no_grad()` masks as higher-order ops over
    graphs of their own, and its gradient is a custom autograd.Function's. `check` crashed
    (KeyError: 'submod_7', a traceback); it refuses at the model's lines now."""
    import re
    import subprocess
    import sys

    from pipeplan.tests.parallel.test_family_matrix import plan_text

    path = tmp_path / "phimoe.plan"
    path.write_text(plan_text("phimoe", "pp2_1f1b"))
    run = subprocess.run([sys.executable, "-m", "pipeplan", "check", str(path)],
                         capture_output=True, text=True, timeout=600)
    said = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in said, said[-3000:]
    assert re.search(r"phimoe\.plan:\d+:\d+: error: ", said), said[-3000:]


def test_a_constant_export_lifts_is_never_taken_for_a_parameter():
    """A meta model is exported on fake CPU tensors; the constants export lifts are mapped
    back to the model's buffers by the id of each buffer's fake (`_on_cpu_if_meta`). Only
    live tensors may be in that map: a parameter's fake, dropped once wrapped in its
    Parameter, freed its id for another tensor, so `torch.tensor(2)` in BART's forward was
    at times taken for a [32] parameter ("fill_ only supports 0-dimension value tensor",
    one `pipeplan check` in several)."""
    import gc

    from pipeplan.compiler.capture.capture import _on_cpu_if_meta
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    meta = dict(model.named_buffers())
    with _on_cpu_if_meta(model, torch.device("meta")) as place:
        gc.collect()
        fakes = dict(model.named_buffers())
        assert {id(t) for t in fakes.values()} == set(place.original)  # live: the slots'
        assert all(place.original[id(fakes[k])] is meta[k] for k in meta)


def test_a_meta_stand_in_is_never_found_for_another_tensor():
    """The meta run caches each tensor's stand-in by the tensor's id (parameters, constants,
    inputs under autocast); the tensor is held while its stand-in is cached, so a tensor
    made after another was freed never gets the freed one's stand-in (another shape)."""
    import gc

    from pipeplan.compiler.capture.analysis import MetaRun
    run = MetaRun(torch.fx.symbolic_trace(torch.nn.Identity()), autocast=torch.bfloat16)
    for n in range(1, 9):  # CPython gives a freed tensor's id to the next one ~7 times in 8
        first = torch.empty(n)
        assert run._to_meta(first, parameter=False).shape == (n,)
        del first
        gc.collect()
        second = torch.empty(n + 1)
        assert run._to_meta(second, parameter=False).shape == (n + 1,)


class _Net(torch.nn.Module):
    def __init__(self, function: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.function = function

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.relu(self.a(x)), 0.5, self.training)
        return self.b(_Custom.apply(h) if self.function else h)


def _traces(monkeypatch):
    from pipeplan.compiler.capture import capture as cap
    count = []
    trace = cap._LeafTracer.trace

    def counted(self, *args, **kwargs):
        count.append(1)
        return trace(self, *args, **kwargs)
    monkeypatch.setattr(cap._LeafTracer, "trace", counted)
    return cap, count


def test_an_fx_capture_at_another_shape_copies_the_models_graph(monkeypatch):
    """The planner captures one model at several microbatch sizes and cp values: the second
    capture copies the first's graph (no shape enters a symbolic trace) instead of tracing
    again, as an independent graph (what one capture's later passes add to its graph is not
    in the next), the same code; a change a trace reads (a module's training flag) traces
    again."""
    cap, count = _traces(monkeypatch)
    model = _Net()
    first = cap.capture_fx(model, {"x": torch.empty(2, 8, device="meta")}, (), "test")
    second = cap.capture_fx(model, {"x": torch.empty(5, 8, device="meta")}, (), "test")
    assert len(count) == 1 and second.module.code == first.module.code
    assert "training = True" in first.module.code
    assert second.module.graph is not first.module.graph
    names = [n.name for n in second.module.graph.nodes]
    node = next(n for n in first.module.graph.nodes if n.op == "call_function")
    with first.module.graph.inserting_after(node):
        first.module.graph.call_function(torch.neg, (node,))
    assert [n.name for n in second.module.graph.nodes] == names
    third = cap.capture_fx(model, {"x": torch.empty(2, 8, device="meta")}, (), "test")
    assert len(count) == 1 and [n.name for n in third.module.graph.nodes] == names
    model.eval()  # dropout's training flag is a constant of the trace
    evaluated = cap.capture_fx(model, {"x": torch.empty(2, 8, device="meta")}, (), "test")
    assert len(count) == 2 and "training = False" in evaluated.module.code


def test_a_trace_that_calls_an_autograd_function_is_traced_at_every_capture(monkeypatch):
    """capture() checks each custom Function's backward from the calls its trace records: a
    model calling one is traced again each time, so no capture skips that check."""
    from pipeplan.dsl.ast import ModelSpec, Plan
    cap, count = _traces(monkeypatch)
    model = _Net(function=True)
    plan = Plan(model=ModelSpec(source="x.py:Net", capture="fx"))
    for rows in (2, 3):
        cap.capture(plan, model, {"x": torch.randn(rows, 8)})
    assert len(count) == 2


def test_a_no_grad_region_is_inlined_with_its_inputs_detached(make_plan, chain):
    """export keeps a `torch.no_grad()` region as a higher-order op over a graph of its own;
    check refused it (DeepSeek-V3.2, GLM-MoE-DSA, HunYuan V4, LongCat-Flash: their indexers
    or routers pick under no_grad). It is inlined, its tensor inputs read through detach: the
    stages' loss and every gradient are the eager model's in float64 (the scorer, read only
    in the region, gets none in both)."""
    plan = make_plan("tests/compiler/models.py:NoGradIndexer", {}, pp=2,
                     model_fields={"capture": "export"})
    torch.manual_seed(0)
    model = load_model(plan, "cpu").double()
    compiled = compile_plan(plan, model)
    assert compiled.capture == "export"
    graph_ops = {n.target for st in compiled.stages for n in st.module.graph.nodes}
    assert torch.ops.aten.detach.default in graph_ops
    assert not any("wrap_with" in str(t) for t in graph_ops)
    batch = _batch(16, plan.microbatch_size, 16)
    got = chain(compiled, batch)
    want = reference_loss("cross_entropy", model(input_ids=batch["input_ids"]), batch["targets"])
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    params = list(model.parameters())
    grads = zip(torch.autograd.grad(got, params, allow_unused=True),
                torch.autograd.grad(want, params, allow_unused=True))
    for (name, _), (a, b) in zip(model.named_parameters(), grads):
        assert (a is None) == (b is None) == ("scorer" in name), name
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-14), name
