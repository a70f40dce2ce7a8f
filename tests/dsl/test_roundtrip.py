"""parse -> format -> parse is the identity on the AST, and format is a fixed point
on canonical text: for every example plan and for hypothesis-generated plans."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.dsl import KINDS_TABLE, format_plan, load_plan, parse_plan
from pipeplan.dsl import ast as A
from pipeplan.schedules.kinds import min_microbatches

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.plan"))


def test_there_are_the_three_required_examples():
    names = {p.name for p in EXAMPLES}
    assert {"gpt_pp4_1f1b.plan", "moe_pp2_ep2_zbv.plan", "hybrid_pp2_dp2_tp2.plan"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("full", [False, True])
def test_examples_round_trip(path, full):
    plan = load_plan(str(path))
    text = format_plan(plan, full=full)
    again = parse_plan(text, str(path))
    assert again == plan
    assert format_plan(again, full=full) == text


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_canonical_text(path):
    """The examples are written in canonical form, comments included: fmt leaves them alone."""
    assert format_plan(load_plan(str(path))) == path.read_text()


# ------------------------------------------------------------------ hypothesis
RESERVED = {"vocab", "seq_len", "layers", "num_experts", "top_k", "aux_loss", "z_loss"}
names = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(lambda s: s not in RESERVED)
segments = st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True),
                     st.integers(0, 12).map(str), st.just("*"))
patterns = st.lists(segments, min_size=1, max_size=4).map(".".join)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
positive = st.floats(min_value=1e-6, max_value=10.0, allow_nan=False)
rates = st.one_of(st.floats(min_value=1e-3, max_value=1e18), st.integers(1, 10**6).map(
    lambda n: n * 10.0 ** 9), st.integers(1, 4096).map(lambda n: float(n * 2**30)))
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
plain = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), finite, texts),
                     lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)


@st.composite
def plans(draw) -> A.Plan:
    pp, dp, tp = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    ep = draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
    schedule = draw(st.sampled_from(sorted(KINDS_TABLE)))
    rule = KINDS_TABLE[schedule]
    virtual = draw(st.integers(rule.min_virtual, rule.max_virtual or 3))
    m = min_microbatches(schedule, pp) * draw(st.integers(1, 3))
    per_mb = draw(st.integers(1, 3))
    stages = pp * virtual
    split_kind = draw(st.sampled_from(["auto", "points", "ranges"]))
    layers = None
    if split_kind == "auto":
        split = A.SplitSpec("auto", draw(st.sampled_from(["flops", "params", "profile"])))
    elif split_kind == "points":
        split = A.SplitSpec("points", points=tuple(f"blocks.{i + 1}" for i in range(stages - 1)))
    else:
        sizes = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
        edges = [sum(sizes[:i]) for i in range(stages + 1)]
        split = A.SplitSpec("ranges", ranges=tuple(
            A.LayerRange("layers", a, b) for a, b in zip(edges, edges[1:])))
        layers = edges[-1]
    args = draw(st.dictionaries(names, plain, max_size=4))
    if layers is not None and draw(st.booleans()):
        args["layers"] = layers
    memory = draw(st.one_of(st.none(), st.integers(1, 8).map(lambda n: A.MemoryLimit(float(n))),
                            st.integers(1, 64).map(lambda n: A.MemoryLimit(float(n * 2**30), True))))
    use_size = draw(st.booleans())
    pipeline = A.PipelineSpec(schedule, None if use_size else m, per_mb if use_size else None,
                              virtual, split, memory)
    experts = None
    if ep > 1 or draw(st.booleans()):
        n = ep * draw(st.integers(1, 4))
        dropless = draw(st.booleans())
        experts = A.ExpertsSpec(
            modules=tuple(draw(st.lists(patterns, min_size=1, max_size=2))), num_experts=n,
            top_k=draw(st.integers(1, n)), dropless=dropless,
            capacity_factor=None if dropless else draw(positive),
            drop_policy="probs" if dropless else draw(st.sampled_from(["probs", "position"])),
            aux_loss=draw(st.floats(0, 1)), z_loss=draw(st.floats(0, 1)),
            dispatcher=draw(st.sampled_from(["alltoall", "allgather"])),
            shared_experts=draw(st.integers(0, 2)))
    tensor = A.TensorSpec()
    if tp > 1:
        tensor = A.TensorSpec(column=(draw(patterns),), row=(), vocab=tuple(draw(st.lists(patterns, max_size=1))),
                              sequence_parallel=draw(st.booleans()))
    steps = draw(st.integers(2, 100))
    optimizer = draw(st.one_of(
        st.builds(A.OptimizerSpec, name=st.just("adamw"), lr=positive,
                  betas=st.tuples(st.floats(0, 0.99), st.floats(0, 0.999)), eps=positive,
                  weight_decay=st.floats(0, 1)),
        st.builds(A.OptimizerSpec, name=st.just("sgd"), lr=positive, momentum=st.floats(0, 1),
                  weight_decay=st.floats(0, 1))))
    lr_schedule = draw(st.one_of(
        st.builds(A.LRScheduleSpec, kind=st.just("constant"), warmup=st.integers(0, steps - 1)),
        st.builds(A.LRScheduleSpec, kind=st.just("cosine"), warmup=st.integers(0, steps - 1),
                  min_lr=st.floats(0, optimizer.lr))))
    checkpoint = draw(st.one_of(st.none(), st.builds(
        A.CheckpointSpec, every=st.integers(1, steps), dir=texts, keep=st.integers(1, 5))))
    train = A.TrainSpec(steps=steps, global_batch=dp * m * per_mb, optimizer=optimizer,
                        lr_schedule=lr_schedule, grad_clip=draw(st.one_of(st.none(), positive)),
                        precision=draw(st.sampled_from(["fp32", "bf16"])), seed=draw(st.integers(0, 2**31)),
                        checkpoint=checkpoint, log_dir=draw(st.one_of(st.none(), texts)))
    # the first input reads the token stream; a second one reads a field the data names
    inputs = [A.InputSpec("in0", draw(st.sampled_from(["int64", "int32"])), ("batch", "seq"))]
    feeds = ()
    if draw(st.booleans()):
        field = draw(st.sampled_from(["positions", "mask", "tokens"]))
        shape = tuple(draw(st.lists(st.one_of(st.sampled_from(["batch", "seq"]), st.integers(1, 9)),
                                    min_size=1, max_size=3))) if field == "mask" else ("batch", "seq")
        dtype = draw(st.sampled_from(["int64", "float32", "bool"])) if field == "mask" else "int64"
        inputs.append(A.InputSpec("in1", dtype, shape))
        feeds = (("in1", field),)
    data = draw(st.one_of(
        st.builds(A.DataSpec, kind=st.just("synthetic"), seq_len=st.integers(1, 64),
                  seed=st.integers(0, 99), vocab=st.integers(2, 1000), inputs=st.just(feeds)),
        st.builds(A.DataSpec, kind=st.just("file"), seq_len=st.integers(1, 64),
                  path=st.sampled_from(["a.bin", "data/tokens.npy", "x y.bin"]),
                  wrap=st.booleans(), inputs=st.just(feeds))))
    inputs = tuple(inputs)
    model = A.ModelSpec(
        source=draw(st.sampled_from(["models/gpt.py:GPT", "pkg.mod:Net", "../m.py:M"])),
        args=A._frozen_map(args), inputs=inputs,
        capture=draw(st.sampled_from(["auto", "fx", "export"])),
        leaf_modules=tuple(draw(st.lists(patterns, max_size=2))),
        loss=draw(st.sampled_from(["cross_entropy", "mse", "model"])))
    rules = draw(st.lists(patterns, max_size=3, unique=True))
    recompute = tuple(A.RecomputeRule(p, draw(st.sampled_from(["none", "full", "selective"])))
                      for p in rules)
    device = draw(st.one_of(st.just(A.DeviceSpec()), st.builds(
        A.DeviceSpec, name=st.one_of(st.none(), st.sampled_from(["a100", "h100", "b200"])),
        flops=rates, memory_bandwidth=st.one_of(st.none(), rates), intra_node=rates,
        inter_node=rates,
        latency=st.one_of(st.just(0.0), st.floats(1e-12, 10.0)),
        ranks_per_node=st.one_of(st.none(), st.integers(1, 64)))))
    return A.Plan(model=model, data=data, mesh=A.MeshSpec(pp, dp, tp, ep), pipeline=pipeline,
                  experts=experts, tensor=tensor, zero=draw(st.integers(0, 3)) if dp > 1 else 0,
                  recompute=recompute, train=train, device=device)


@settings(max_examples=200, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_generated_plans_round_trip(plan):
    text = format_plan(plan)
    again = parse_plan(text)
    assert again == plan, text
    assert format_plan(again) == text
    full = format_plan(plan, full=True)
    assert parse_plan(full) == plan
    assert format_plan(parse_plan(full), full=True) == full


def test_fmt_keeps_comments_next_to_their_keys():
    text = ('# header\n\nmodel { source = "m.py:M" }  # the model\n'
            "mesh { pp = 1  tp = 2 }\ntensor {\n  column = [\n    layers.*.attn.q,  # q\n"
            "    layers.*.attn.k,\n  ]\n  # sp on\n  sequence_parallel = true\n}\n# the end\n")
    canonical = format_plan(parse_plan(text))
    assert canonical == (
        '# header\n\nmodel {\n  source = "m.py:M"  # the model\n}\n\nmesh {\n  pp = 1\n  tp = 2\n}\n\n'
        "tensor {\n  column = [layers.*.attn.q, layers.*.attn.k]  # q\n  # sp on\n"
        "  sequence_parallel = true\n}\n\n# the end\n")
    assert format_plan(parse_plan(canonical)) == canonical


LEXEME = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z0-9_.*:+/-]+|\S')
SEPARATORS = st.sampled_from([" ", "\n", "\t", "  ", " # a comment\n", "\n\n"])


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(st.sampled_from(EXAMPLES), st.data())
def test_layout_and_comments_do_not_change_the_plan(path, data):
    """Any whitespace, newlines and comments between tokens give the same plan."""
    canonical = format_plan(load_plan(str(path)), comments=False)
    tokens = LEXEME.findall(canonical)
    seps = data.draw(st.lists(SEPARATORS, min_size=len(tokens), max_size=len(tokens)))
    text = "".join(t + s for t, s in zip(tokens, seps))
    assert parse_plan(text, str(path)) == load_plan(str(path))
