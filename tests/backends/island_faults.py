"""A tiny GPT whose chosen global ranks sleep once or SIGKILL themselves on their N-th real
(non-meta) call of a leaf: a slow or lost DiLoCo island on demand (test_diloco_decoupled)."""
from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from pipeplan.examples.models.gpt import GPT


class Hazard(nn.Module):
    """Identity; on call `after` + 1 on rank `sleep_rank` sleeps `sleep_s`, on call
    `kill_after` + 1 on rank `kill_rank` kills its own process."""

    def __init__(self, sleep_rank: int, sleep_after: int, sleep_s: float, kill_rank: int,
                 kill_after: int):
        super().__init__()
        self.sleep_rank, self.sleep_after, self.sleep_s = sleep_rank, sleep_after, sleep_s
        self.kill_rank, self.kill_after, self.calls = kill_rank, kill_after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            self.calls += 1
            rank = int(os.environ.get("RANK", "-1"))
            if rank == self.sleep_rank and self.calls == self.sleep_after + 1:
                time.sleep(self.sleep_s)
            if rank == self.kill_rank and self.calls == self.kill_after + 1:
                os.kill(os.getpid(), signal.SIGKILL)
        return x


class IslandFaultGPT(GPT):
    def __init__(self, sleep_rank: int = -1, sleep_after: int = 0, sleep_s: float = 0.0,
                 kill_rank: int = -1, kill_after: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.hazard = Hazard(sleep_rank, sleep_after, sleep_s, kill_rank, kill_after)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device))
        x = self.hazard(x)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))
