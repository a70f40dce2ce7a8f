"""10,000 random mutations of the example plans: every outcome is a valid plan or a
PlanError whose every diagnostic has a location; never another exception, never a hang."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from pipeplan.dsl import PlanError, format_plan, parse_plan

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.plan"))
TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z0-9_.*:+-]+|\S')
ASSIGN = re.compile(r"^(\s*)([\w.*]+)(\s*=\s*)(.+?)\s*$", re.M)
NOISE = list('{}[]()=,;:#"\\*.-+@\t\n\x00é€') + ["1f1b", "true", "GiB", "[0:", "}}", "{{"]
MUTATIONS = 10_000


def flip(text: str, rng: random.Random) -> str:
    if not text:
        return rng.choice(NOISE)
    i = rng.randrange(len(text))
    ch = rng.choice(NOISE) if rng.random() < 0.5 else chr(rng.randrange(32, 127))
    return text[:i] + ch + text[i + 1:]


def _tokens(text: str) -> list[re.Match]:
    return list(TOKEN.finditer(text))


def delete_token(text: str, rng: random.Random) -> str:
    toks = _tokens(text)
    if not toks:
        return text
    t = rng.choice(toks)
    return text[:t.start()] + text[t.end():]


def duplicate_token(text: str, rng: random.Random) -> str:
    toks = _tokens(text)
    if not toks:
        return text
    t = rng.choice(toks)
    return text[:t.end()] + " " + t.group() + text[t.end():]


def swap_tokens(text: str, rng: random.Random) -> str:
    toks = _tokens(text)
    if len(toks) < 2:
        return text
    a, b = sorted(rng.sample(toks, 2), key=lambda m: m.start())
    return (text[:a.start()] + b.group() + text[a.end():b.start()] + a.group() + text[b.end():])


def swap_key_and_value(text: str, rng: random.Random) -> str:
    lines = list(ASSIGN.finditer(text))
    if not lines:
        return text
    m = rng.choice(lines)
    return text[:m.start()] + f"{m.group(1)}{m.group(4)}{m.group(3)}{m.group(2)}" + text[m.end():]


def swap_values(text: str, rng: random.Random) -> str:
    lines = list(ASSIGN.finditer(text))
    if len(lines) < 2:
        return text
    a, b = sorted(rng.sample(lines, 2), key=lambda m: m.start())
    return (text[:a.start(4)] + b.group(4) + text[a.end(4):b.start(4)] + a.group(4)
            + text[b.end(4):])


def truncate(text: str, rng: random.Random) -> str:
    return text[:rng.randrange(len(text) + 1)]


OPS = [flip, delete_token, duplicate_token, swap_tokens, swap_key_and_value, swap_values, truncate]


def mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.choice([1, 1, 2, 3])):
        text = rng.choice(OPS)(text, rng)
    return text


def outcome(text: str, overrides: tuple[str, ...] = ()) -> str:
    """'ok' or 'error'; fails the test on anything else."""
    try:
        plan = parse_plan(text, "fuzz.plan", overrides)
    except PlanError as e:
        assert e.diagnostics, "a PlanError without diagnostics"
        for d in e.diagnostics:
            assert d.span.file == "fuzz.plan" or d.span.file.startswith("<--set")
            assert d.span.line >= 1 and d.span.col >= 1 and d.message
        assert str(e).count(": error: ") == len(e.diagnostics)
        return "error"
    canonical = format_plan(plan)
    again = parse_plan(canonical, "fuzz.plan")
    assert again == plan
    assert format_plan(again) == canonical  # comments included
    return "ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [2_000, pytest.param(MUTATIONS, marks=pytest.mark.heavy)])
def test_mutations_never_crash(count):
    """2,000 mutations in the default suite; the full 10,000 are heavy (suite time)."""
    rng = random.Random(0)
    sources = [p.read_text() for p in EXAMPLES]
    keys = sorted({m.group(2) for s in sources for m in ASSIGN.finditer(s)})
    seen = {"ok": 0, "error": 0}
    for i in range(count):
        text = mutate(rng.choice(sources), rng)
        if i % 10 == 0:  # one in ten also carries a mutated --set override
            override = mutate(f"pipeline.{rng.choice(keys)}={rng.choice(keys)}", rng)
            seen[outcome(rng.choice(sources), (override,))] += 1
        seen[outcome(text)] += 1
    # the mutations exercise both outcomes, not only one
    assert seen["ok"] > count // 100 and seen["error"] > count // 2, seen
