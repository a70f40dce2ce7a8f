"""Milestone 1: stage graphs chained reproduce the unmodified model's loss exactly."""
from __future__ import annotations

import torch

from pipeplan.compiler import compile_plan, load_model, reference_loss
from pipeplan.dsl.ast import SplitSpec


def _batch(vocab, b=4, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (b, t), generator=g),
            "targets": torch.randint(0, vocab, (b, t), generator=g)}


def _check_equal(plan, chain, vocab, mb):
    model = load_model(plan, "cpu")
    compiled = compile_plan(plan, model)
    batch = _batch(vocab, b=mb, t=plan.data.seq_len)
    got = chain(compiled, batch)
    want = reference_loss(plan.model.loss, model(batch["input_ids"]), batch["targets"])
    assert torch.equal(got, want)
    # gradients through the chain equal the model's own (same parameter objects)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want.backward()
    for n, p in model.named_parameters():
        assert torch.equal(grads[n], p.grad), n
    return model, compiled


def test_gpt_tied_two_stages(make_plan, chain):
    plan = make_plan("examples/models/gpt.py:GPT", {"layers": 4, "seq_len": 16}, pp=2)
    model, compiled = _check_equal(plan, chain, 256, plan.microbatch_size)
    assert [t.names for t in compiled.tied] == [("tok_emb.weight", "lm_head.weight")]
    assert compiled.tied[0].stages == (0, 1)
    emb = dict(model.named_parameters())["tok_emb.weight"]
    assert dict(compiled.stages[1].module.named_parameters(remove_duplicate=False))[
        "lm_head.weight"] is emb


def test_stage_params_are_the_models_own_under_original_names(make_plan):
    plan = make_plan("examples/models/gpt.py:GPT", {"layers": 4, "seq_len": 16}, pp=4)
    model = load_model(plan, "cpu")
    compiled = compile_plan(plan, model)
    own = dict(model.named_parameters(remove_duplicate=False))
    held = set()
    for st in compiled.stages:
        state = st.module.state_dict(keep_vars=True)
        assert set(state) <= set(model.state_dict()), st.index
        for name, p in st.module.named_parameters(remove_duplicate=False):
            assert p is own[name]
            held.add(name)
        assert set(st.param_names) == {n for n, _ in
                                       st.module.named_parameters(remove_duplicate=False)}
    assert held == set(own)
    assert [s.inputs[0].name for s in compiled.stages[:1]] == ["input_ids"]


def test_moe_gpt_aux_losses_cross_stages(make_plan, chain):
    plan = make_plan("examples/models/moe_gpt.py:MoEGPT", {"layers": 4, "seq_len": 16}, pp=4)
    _, compiled = _check_equal(plan, chain, 256, plan.microbatch_size)
    # the running aux loss is a scalar sent along with the hidden state
    assert any(o.shape == () for o in compiled.stages[0].outputs)


def test_skip_connection_forwarded_through_middle_stages(make_plan, chain):
    plan = make_plan("tests/compiler/models.py:SkipNet", {"layers": 4}, pp=4,
                     split=SplitSpec(kind="points", points=("layers.1", "layers.2", "layers.3")))
    _, compiled = _check_equal(plan, chain, 32, plan.microbatch_size)
    emb = "emb"  # the embedding output is the skip value: produced in 0, used in 3
    for k in (1, 2):
        names_in = [r.name for r in compiled.stages[k].inputs]
        names_out = [o.name for o in compiled.stages[k].outputs]
        assert emb in names_in and emb in names_out
    assert emb in [r.name for r in compiled.stages[3].inputs]


def test_virtual_stages_and_loop_placement(make_plan, chain):
    plan = make_plan("examples/models/gpt.py:GPT", {"layers": 4, "seq_len": 16}, pp=2,
                     virtual=2, schedule="interleaved", microbatches=4, global_batch=8)
    _, compiled = _check_equal(plan, chain, 256, plan.microbatch_size)
    assert [s.rank for s in compiled.stages] == list(compiled.schedule.stage_to_rank)
    assert len(compiled.stages) == 4


def test_meta_compile_allocates_nothing_and_records_shapes(make_plan):
    plan = make_plan("examples/models/gpt.py:GPT", {"layers": 2, "seq_len": 16, "dim": 32},
                     pp=2, microbatches=2, global_batch=8)
    compiled = compile_plan(plan)
    for st in compiled.stages:
        assert all(p.is_meta for p in st.module.parameters())
    assert compiled.stages[0].outputs[0].shape == (4, 16, 32)  # microbatch 4 x seq 16 x dim
    assert compiled.stages[0].outputs[0].dtype == "float32"
    assert compiled.split_text == 'split = ["layers.1"]'


def test_mse_loss_and_float_inputs(make_plan, chain):
    from pipeplan.dsl.ast import InputSpec
    plan = make_plan("tests/compiler/models.py:Regressor", {"layers": 4}, pp=2, loss="mse",
                     inputs=(InputSpec("x", "float32", ("batch", 8)),))
    model = load_model(plan, "cpu")
    compiled = compile_plan(plan, model)
    batch = {"x": torch.randn(2, 8), "targets": torch.randn(2, 8)}
    assert torch.equal(chain(compiled, batch),
                       reference_loss("mse", model(batch["x"]), batch["targets"]))


def test_tuple_output_indexed_late_is_sent_not_recomputed(make_plan, chain):
    plan = make_plan("tests/compiler/models.py:LateIndex", {}, pp=3, schedule="gpipe",
                     split=SplitSpec(kind="points", points=("l1", "l2")),
                     model_fields={"leaf_modules": ("pair",), "capture": "fx"})
    _, compiled = _check_equal(plan, chain, 16, plan.microbatch_size)
    calls = [k for k, st in enumerate(compiled.stages) for n in st.module.graph.nodes
             if n.op == "call_module" and n.target == "pair"]
    assert calls == [0]  # the leaf runs once, in stage 0; its second output is forwarded
    assert "pair.scale" not in compiled.stages[2].param_names
