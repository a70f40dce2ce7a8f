"""A single-process float64 reference for the tensor-parallel equivalence tests.

Shares no code with the TP path: the unmodified model (`.double()`), torch's
AdamW with the plan's hyper-parameters, `clip_grad_norm_`, the mean
cross-entropy of each microbatch averaged over the microbatches, on the same
rows the pipeline reads (backends/runtime/data.py draws them; it is the data, not the
path under test).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeplan.backends.runtime import data


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def reference_run(plan, model, steps: int):
    """(losses per step, parameters by name after `steps` steps)."""
    model = model.double().train()
    opt = plan.train.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  eps=opt.eps, weight_decay=opt.weight_decay)
    m = plan.mesh.dp * plan.microbatches
    losses = []
    for step in range(steps):
        total = 0.0
        for mb in data.chunks(data.global_batch(plan, step), m):
            logits = logits_of(model(mb.input_ids))
            loss = F.cross_entropy(logits.flatten(0, -2), mb.targets.flatten()) / m
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n: p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}
