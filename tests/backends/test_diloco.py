"""DiLoCo (backends/parallel/diloco/sync.py) against single-process references written here, in float64.

One spawned 4-rank world (pp=2 x dp=2 islands) runs, in a row: DiLoCo H=3 with a Nesterov
outer step (9 steps, AdamW inside, clipping on), streaming DiLoCo with K=2 fragments, and
H=1 with outer sgd(lr=1, momentum=0) (SGD inside), which must equal plain data parallel. The
references simulate the islands one after the other with the model's own modules, torch's
inner optimizer and a hand-written outer Nesterov step; nothing of pipeplan's trainer.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from pipeplan.backends.runtime import data
from pipeplan.backends.state.model import build_model
from pipeplan.backends.verify.reference import train_reference
from pipeplan.dsl.ast import (DataSpec, MeshSpec, ModelSpec, OptimizerSpec, OuterOptimizerSpec, PipelineSpec, Plan, SplitSpec, LayerRange, SyncSpec, TrainSpec)

STEPS = 9
ADAMW = OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)
SGD = OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.1)
NESTEROV = OuterOptimizerSpec("nesterov", lr=0.7, momentum=0.9)
PLAIN = OuterOptimizerSpec("sgd", lr=1.0, momentum=0.0)
RTOL, ATOL = 1e-9, 1e-12


def make_plan(sync: SyncSpec, optimizer: OptimizerSpec, clip=0.5) -> Plan:
    args = {"vocab": 64, "dim": 32, "layers": 4, "heads": 4, "seq_len": 16}
    split = SplitSpec(kind="ranges", ranges=(LayerRange("layers", 0, 2), LayerRange("layers", 2, 4)))
    return Plan(model=ModelSpec("pipeplan.examples.models.gpt:GPT", args=args),
                data=DataSpec(seq_len=16, vocab=64, seed=7), mesh=MeshSpec(pp=2, dp=2),
                pipeline=PipelineSpec(schedule="1f1b", microbatches=2, split=split),
                sync=sync,
                train=TrainSpec(steps=STEPS, global_batch=8, grad_clip=clip, seed=11,
                                optimizer=optimizer, precision="fp64"))


CONFIGS = {
    "diloco": make_plan(SyncSpec("diloco", inner_steps=3, outer_optimizer=NESTEROV), ADAMW),
    "streaming": make_plan(SyncSpec("diloco", inner_steps=3, outer_optimizer=NESTEROV,
                                    fragments=2), ADAMW),
    "h1": make_plan(SyncSpec("diloco", inner_steps=1, outer_optimizer=PLAIN), SGD, clip=None),
}


def _worker(rank, world):
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    out = {}
    for key, plan in CONFIGS.items():
        trainer = PipelineTrainer.for_plan(plan)
        reports = [trainer.step(t) for t in range(STEPS)]
        state = {k: v.clone() for k, v in trainer.diloco.state_dict().items()}
        out[key] = dict(dp=trainer.topo.coords.dp, losses=[r.loss for r in reports],
                        params=trainer.named_parameters(),
                        syncs=[(e.step, e.fragment) for r in reports for e in r.sync_events],
                        state=state)
        for fr in trainer.diloco.fragments:  # load_state_dict restores what was saved
            fr.global_.data.zero_()
            fr.outer.state.clear()
            fr.rounds = 0
        trainer.diloco.load_state_dict(state)
        again = trainer.diloco.state_dict()
        assert again.keys() == state.keys() and all(torch.equal(again[k], v)
                                                    for k, v in state.items())
    return out


# ------------------------------------------------------------- the reference
def _fragment_of(name: str, fragments: int) -> int:
    """Stage 0 holds the embeddings and layers 0-1 (the plan's split); with 2 fragments
    stage 0 is fragment 0, stage 1 fragment 1."""
    if fragments == 1:
        return 0
    first = name.startswith(("tok_emb", "pos_emb", "layers.0.", "layers.1."))
    return 0 if first else 1


def _loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits, plus the model's aux loss when it returns (logits, aux)
    (the example MoE: every expert of a layer in one process)."""
    logits, aux = output if isinstance(output, tuple) else (output, 0.0)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1)) + aux


def diloco_reference(plan: Plan, steps: int = STEPS):
    """Islands one after the other, each one process with the whole model: inner steps on
    each island's rows, then the outer Nesterov (or plain SGD) step on the mean
    pseudo-gradient of the fragments due."""
    s, dp, m = plan.sync, plan.mesh.dp, plan.microbatches
    base = build_model(plan).double()
    islands = [copy.deepcopy(base) for _ in range(dp)]
    opt = plan.train.optimizer
    if opt.name == "adamw":
        inner = [torch.optim.AdamW(i.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                   weight_decay=opt.weight_decay) for i in islands]
    else:
        inner = [torch.optim.SGD(i.parameters(), lr=opt.lr, momentum=opt.momentum,
                                 weight_decay=opt.weight_decay) for i in islands]
    names = [n for n, _ in base.named_parameters()]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    buf = {n: None for n in names}
    losses = [[] for _ in range(dp)]
    for t in range(steps):
        batch = data.global_batch(plan, t)
        rows = plan.train.global_batch // dp
        for d, (model, o) in enumerate(zip(islands, inner)):
            total = 0.0
            for k in range(m):
                lo = d * rows + k * rows // m
                hi = lo + rows // m
                loss = _loss(model(batch.input_ids[lo:hi]), batch.targets[lo:hi]) / m
                loss.backward()
                total += float(loss.detach())
            if plan.train.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), plan.train.grad_clip)
            o.step()
            o.zero_grad(set_to_none=True)
            losses[d].append(total)
        n = t + 1
        for f in range(s.fragments):
            offset = f * s.inner_steps // s.fragments
            if not (n > offset and (n - offset) % s.inner_steps == 0):
                continue
            mine = [x for x in names if _fragment_of(x, s.fragments) == f]
            with torch.no_grad():
                for x in mine:
                    delta = sum(glob[x] - dict(i.named_parameters())[x] for i in islands) / dp
                    mu, lr = s.outer_optimizer.momentum, s.outer_optimizer.lr
                    if mu:
                        buf[x] = delta.clone() if buf[x] is None else mu * buf[x] + delta
                        step = delta + mu * buf[x] if s.outer_optimizer.name == "nesterov" \
                            else buf[x]
                    else:
                        step = delta
                    glob[x] = glob[x] - lr * step
                    for i in islands:
                        dict(i.named_parameters())[x].copy_(glob[x])
    params = [{n: p.detach().clone() for n, p in i.named_parameters(remove_duplicate=False)}
              for i in islands]
    return losses, params, glob, buf


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def reference_mismatches(key: str, plan: Plan, runs: list, steps: int = STEPS) -> list[str]:
    """What differs between the ranks' runs (per rank: its island `dp`, `losses`, full
    `params` by reference name, the DiLoCo `state`) and `diloco_reference(plan)`."""
    losses, params, glob, buf = diloco_reference(plan, steps)
    bad = []
    for rank, got in enumerate(runs):
        d = got["dp"]
        if got["losses"] != pytest.approx(losses[d], rel=RTOL, abs=ATOL):
            bad.append(f"{key} rank {rank}: losses {got['losses']} != {losses[d]}")
        for name, value in got["params"].items():
            if not _close(value, params[d][name]):
                bad.append(f"{key} rank {rank}: {name} differs by "
                           f"{float((value - params[d][name]).abs().max()):.3g}")
        # the named outer state equals the reference's (a TP or expert shard: the part at
        # its offset, when the run gives (offset, shard))
        for name, value in got["state"].items():
            _, kind, pname = name.split("/", 2)  # diloco/<kind>/<name>; the tied head is
            pname = pname.replace("lm_head.weight", "tok_emb.weight")  # the embedding here
            if kind not in ("global", "outer_momentum"):
                continue
            ref = (glob if kind == "global" else buf)[pname]
            offset, value = value if isinstance(value, tuple) else ((0,) * value.dim(), value)
            part = tuple(slice(o, o + n) for o, n in zip(offset, value.shape))
            ok = ref is not None and _close(value, ref[part])
            if not ok:
                bad.append(f"{key} rank {rank}: {name} differs from the reference")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_equals_its_reference_and_h1_equals_data_parallel(spawn):
    results = spawn(_worker, 4, timeout=280)
    bad = []
    for key in ("diloco", "streaming", "h1"):
        bad += reference_mismatches(key, CONFIGS[key], [r[key] for r in results])
    assert not bad, "\n".join(bad[:20])
    # the syncs ran when the plan says: H=3 after steps 3, 6, 9; K=2 fragment 1 at 4, 7
    stage0, stage1 = results[0], results[2]
    assert stage0["diloco"]["syncs"] == [(3, 0), (6, 0), (9, 0)]
    assert stage0["streaming"]["syncs"] == [(3, 0), (6, 0), (9, 0)]
    # stage 1 holds fragment 1 and the LM head tied to stage 0's embedding (fragment 0)
    assert stage1["streaming"]["syncs"] == [(3, 0), (4, 1), (6, 0), (7, 1), (9, 0)]
    assert any(k.startswith("diloco/outer_momentum/") for k in stage0["diloco"]["state"])
    # the islands really diverge between syncs (else the test could not tell DiLoCo from DP)
    assert results[0]["diloco"]["losses"] != results[1]["diloco"]["losses"]
    # H=1, outer sgd(lr=1, momentum=0), SGD inside: every step averages the islands' new
    # parameters, which is plain data parallelism: one process on the global batch (the
    # equivalence suite's reference for dp runs); the mean of the island losses is its loss
    dp = train_reference(dataclasses.replace(CONFIGS["h1"], sync=SyncSpec()), STEPS)
    for rank, r in enumerate(results):
        for name, value in r["h1"]["params"].items():
            assert _close(value, dp.params[name]), f"h1 vs data parallel: rank {rank} {name}"
    mean = [(a + b) / 2 for a, b in zip(results[0]["h1"]["losses"], results[1]["h1"]["losses"])]
    assert mean == pytest.approx(dp.losses, rel=RTOL, abs=ATOL)


@pytest.mark.heavy  # two 4-rank verify runs: ~6 min on 2 loaded cores
@pytest.mark.timeout(900)
def test_verify_says_equal_on_diloco_plans(tmp_path):
    """`pipeplan verify` judges a DiLoCo plan (pp2 x dp2, H = 2, Nesterov outer step; and
    streaming with 2 fragments) island by island against backends/verify/diloco.py."""
    import subprocess
    import sys

    for name, sync in (("h2", "diloco(inner_steps = 2, outer_optimizer = nesterov(lr = 0.7, momentum = 0.9))"),
                       ("streaming", "diloco(inner_steps = 2, fragments = 2, "
                                     "outer_optimizer = nesterov(lr = 0.7, momentum = 0.9))")):
        plan = tmp_path / f"{name}.plan"
        plan.write_text('model { source = "pipeplan.examples.models.gpt:GPT"\n'
                        '  args = { vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 16 } }\n'
                        "data = synthetic(seed = 7, vocab = 64, seq_len = 16)\n"
                        "mesh { pp = 2  dp = 2 }\npipeline { schedule = 1f1b  microbatches = 2 }\n"
                        f"sync = {sync}\n"
                        "train { steps = 4  global_batch = 8  grad_clip = 0.5  seed = 11\n"
                        "  optimizer = adamw(lr = 0.003, weight_decay = 0.1) }\n")
        r = subprocess.run([sys.executable, "-m", "pipeplan", "verify", str(plan)],
                           capture_output=True, text=True, timeout=280)
        assert r.returncode == 0, name + r.stdout[-3000:] + r.stderr[-3000:]
        assert r.stdout.count("EQUAL to single-process training (fp64)") == 2, r.stdout
        assert "island 1:" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.slow
def test_library_island_reference_equals_this_files_reference():
    """backends/verify/diloco.train_islands (what `verify` uses) against the hand-written
    reference above: per island, every loss and final parameter."""
    from pipeplan.backends.verify.diloco import train_islands

    for key in ("diloco", "streaming"):
        plan = CONFIGS[key]
        losses, params, _, _ = diloco_reference(plan, 4)
        islands = train_islands(plan, 4)
        for d, island in enumerate(islands):
            assert island.losses == pytest.approx(losses[d], rel=RTOL, abs=ATOL), (key, d)
            for name, value in params[d].items():
                assert _close(island.params[name], value), (key, d, name)
