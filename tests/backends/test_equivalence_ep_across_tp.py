"""EP across TP: pipeplan's example MoE at pp2 x tp2 x ep2 (dp = 1: each EP group is a TP
group) equals single-process training in float64, under 1f1b and zbv.

With dp = 1 and ep = 2 the experts' EP groups are the TP groups themselves
(dsl/layout.py): the two TP ranks of a stage hold different experts, and each
one's experts call takes its half of the token rows (backends/parallel/tp/rewrite.py
`_local_hooks`), routes them by all-to-all over the TP ranks and all-gathers the
outputs. Attention runs tensor-parallel (q, k, v column, proj row) on the same
ranks. 3 AdamW steps with gradient clipping on; losses and every parameter
within rtol 1e-9 / atol 1e-12 of the reference, one process training the
unmodified model on the same chunks (train_reference: the model's own forward).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.dsl.ast import MeshSpec, TensorSpec

from .test_equivalence_moe import STEPS, _check, moe_plan

TENSOR = TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v"),
                    row=("layers.*.attn.proj",))
KINDS = ("1f1b", "zbv")


def across_plan(kind: str, ep: int = 2):
    plan = moe_plan("moe_gpt", kind)
    return dataclasses.replace(plan, mesh=MeshSpec(pp=2, dp=1, tp=2, ep=ep), tensor=TENSOR)


def _worker(rank, world):
    out = []
    for kind in KINDS:
        trainer = PipelineTrainer.for_plan(across_plan(kind))
        groups = trainer.layout.groups
        tp_ranks = dist.get_process_group_ranks(groups.tp)
        assert dist.get_process_group_ranks(groups.ep) == tp_ranks  # EP spans the TP ranks
        for st in trainer.layout.parallel.values():  # TP peers hold different experts
            for layer in st.experts.values():
                assert layer.shard.first == 2 * tp_ranks.index(rank), layer.shard
        losses = [trainer.step(t).loss for t in range(STEPS)]
        out.append((losses, trainer.named_parameters()))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_moe_pp2_tp2_ep2_across_tp_equals_reference(spawn):
    _check(spawn(_worker, 4, timeout=280), KINDS, across_plan)
