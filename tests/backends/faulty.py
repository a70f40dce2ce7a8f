"""A tiny GPT whose chosen block raises on its N-th real (non-meta) call: a rank failure on demand."""
from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from pipeplan.examples.models.gpt import GPT


class Bomb(nn.Module):
    """Identity that raises (or hangs, or SIGKILLs its own process) on call number
    `after` + 1 with real tensors (a leaf)."""

    def __init__(self, after: int, hang: bool = False, kill: bool = False):
        super().__init__()
        self.after, self.hang, self.kill, self.calls = after, hang, kill, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            self.calls += 1
            if self.calls > self.after:
                if self.hang:
                    time.sleep(3600)
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected fault")
        return x


class FaultyGPT(GPT):
    def __init__(self, fail_layer: int = 2, fail_after: int = 3, hang: bool = False,
                 kill: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.bomb = Bomb(fail_after, hang, kill)
        self.fail_layer = fail_layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device))
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.fail_layer:
                x = self.bomb(x)
        return self.lm_head(self.ln_f(x))
