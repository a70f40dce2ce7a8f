"""A NaN activation is named by the model's module that computed it, not only by the
traced node (`mul`): the checked rerun's message says `in module `sick``."""
from __future__ import annotations

import pytest

from .test_scale import NAN_MODEL, _nan_step

SICK = NAN_MODEL + '''
class Sick(nn.Module):
    """Turns its input to NaN with a plain op (a traced `mul` inside this module)."""
    def forward(self, x):
        return x * float("nan")

class A(M):
    def __init__(self):
        super().__init__()
        del self.bad  # unused here: check refuses parameters the forward never reads
        self.sick = Sick()
    def forward(self, input_ids):
        return self.head(self.l1(self.sick(torch.tanh(self.l0(self.emb(input_ids))))))
'''


@pytest.mark.slow
def test_a_nan_activation_names_its_module(spawn, tmp_path):
    (tmp_path / "nanmodel.py").write_text(SICK)
    results = spawn(_nan_step, 2, str(tmp_path / "nanmodel.py") + ":A", timeout=120)
    for message, unchanged in results:
        assert message is not None and unchanged, message
        assert "the first: NaN in activation `mul` (in module `sick`) produced by stage 0 " \
               "microbatch 0 (F s0 mb0)" in message, message
    assert results[0][0] == results[1][0]
