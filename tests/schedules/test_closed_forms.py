"""Fixed kinds against their papers' closed forms at every p (equal costs F=B=W=1 per rank share).

Makespan of the whole iteration, m >= 2p (the formulas' regime), p in 2..16, m in {2p, 4p}:
  GPipe, 1F1B      3m + 3(p-1)             (Megatron SC'21 §2.2.1)
  interleaved, v   3m + 3(p-1)/v           (Megatron, p | m)
  ZB-H1            3m + (p-1)(F+B-W)       (arXiv 2401.10241 §2.1)
  ZB-V             3m + (p-1)F/2           (arXiv 2401.10241 §6; torch's ScheduleZBVZeroBubble)
"""
import pytest

from pipeplan.schedules import generate, simulate

CASES = [(p, k * p) for p in range(2, 17) for k in (2, 4)]
FORMS = {
    "gpipe": lambda p, m: 3 * m + 3 * (p - 1),
    "1f1b": lambda p, m: 3 * m + 3 * (p - 1),
    "interleaved": lambda p, m: 3 * m + 3 * (p - 1) / 2,
    "zbh1": lambda p, m: 3 * m + (p - 1),
    "zbv": lambda p, m: 3 * m + (p - 1) / 2,
}


@pytest.mark.parametrize("kind", list(FORMS))
def test_closed_form_at_every_p(kind):
    for p, m in CASES:
        r = simulate(generate(kind, p, m))
        assert r.makespan == pytest.approx(FORMS[kind](p, m), abs=1e-9), (kind, p, m)
        assert r.bubble == pytest.approx(1 - 3 * m / FORMS[kind](p, m), abs=1e-12)

