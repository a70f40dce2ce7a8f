"""The runtime trains bit for bit as the runtime before issue 13's optimisations, and
the one-home restructure (issue 28) changed no behaviour.

Reference: the whole package as it was at `BASE` (the last commit before issue 13's
runtime changes, in the layout before the restructure), read from git into a temporary
folder: the old code, run as it ran, sharing nothing with the tree under test. Both
packages train the same example plans (float64 and float32, with and without clipping,
split backward and full backward, tied embedding across ranks) in their own subprocess,
one gloo world per configuration, and every loss and every final parameter must be equal
(`torch.equal`, no tolerance).

    python tests/backends/test_runtime_bitwise.py OUT CONFIGS   # the driver both trees run
"""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

BASE = "a61f4ce07a30d55c5060e32481deea890a97c730"  # main before issue 13's runtime changes landed
ROOT = Path(__file__).resolve().parents[2]  # the package root (the repo root)
GPT_PP2 = ["mesh.pp=2", "pipeline.split=auto"]
QUICK = [  # (plan file, overrides, world size, steps)
    ("gpt_pp4_1f1b.plan", GPT_PP2 + ["pipeline.schedule=zbv", "pipeline.virtual=2",
                                     "train.precision=fp64", "train.grad_clip=0.5"], 2, 2),
    ("gpt_pp4_1f1b.plan", GPT_PP2 + ["train.precision=fp32"], 2, 2),
]
EXAMPLES = [(plan, [f"train.precision={p}"], world, 3)
            for plan, world in (("gpt_pp4_1f1b.plan", 4), ("moe_pp2_ep2_zbv.plan", 4))
            for p in ("fp64", "fp32")] + [("hybrid_pp2_dp2_tp2.plan", ["train.precision=fp64"], 8, 2)]


def _copy_tree(tmp: Path) -> Path:
    """This tree as the package `tmp/pipeplan` (whatever the checkout's folder is called)."""
    pkg = tmp / "pipeplan"
    shutil.copytree(ROOT, pkg, ignore=shutil.ignore_patterns(".git", "__pycache__", "build"))
    return pkg


def _base_package(tmp: Path) -> Path:
    """The whole tree as of BASE, as `tmp/pipeplan`; returns what goes on PYTHONPATH."""
    git = shutil.which("git")
    if git is None or subprocess.run([git, "-C", ROOT, "cat-file", "-e", f"{BASE}^{{commit}}"],
                                     capture_output=True).returncode:
        pytest.skip(f"needs git and commit {BASE[:12]} (the runtime before issue 13)")
    archive = subprocess.run([git, "-C", ROOT, "archive", "--format=tar", BASE],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp / "pipeplan", filter="data")
    assert not (tmp / "pipeplan" / "backends" / "runtime").exists()  # really the old tree
    return tmp


def _train_both(tmp: Path, configs) -> tuple[list, list]:
    """Run the driver under the old and the new package (concurrently); their results."""
    (tmp / "old").mkdir()
    (tmp / "new").mkdir()
    trees = {"old": _base_package(tmp / "old"), "new": _copy_tree(tmp / "new").parent}
    runs = {}
    for name, path in trees.items():
        out = tmp / f"{name}-out"
        out.mkdir()
        env = dict(os.environ, PYTHONPATH=str(path), OMP_NUM_THREADS="1")
        script = Path(__file__)  # the driver below imports whichever package PYTHONPATH holds
        runs[name] = (out, subprocess.Popen([sys.executable, script, out, json.dumps(configs)],
                                            env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True))
    results = {}
    for name, (out, proc) in runs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} runtime failed:\n{log[-3000:]}"
        results[name] = _load(out, configs)
    return results["old"], results["new"]


def _load(out: Path, configs) -> list:
    import torch
    return [[torch.load(out / f"{k}-rank{r}.pt", weights_only=True) for r in range(world)]
            for k, (_, _, world, _) in enumerate(configs)]


def _assert_bitwise(configs, old, new) -> None:
    import torch
    for (plan, overrides, _, steps), o_ranks, n_ranks in zip(configs, old, new):
        what = f"{plan} {' '.join(overrides)}"
        for rank, (o, n) in enumerate(zip(o_ranks, n_ranks)):
            assert len(o["losses"]) == steps and len(set(o["losses"])) == steps, what  # trained
            assert n["losses"] == o["losses"], f"{what} rank {rank}: losses differ"
            assert o["params"] and o["params"].keys() == n["params"].keys(), what
            differ = [k for k in o["params"] if not torch.equal(o["params"][k], n["params"][k])]
            assert not differ, f"{what} rank {rank}: parameters differ bitwise: {differ[:5]}"


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_optimised_runtime_is_bitwise_the_old_one(tmp_path):
    _assert_bitwise(QUICK, *_train_both(tmp_path, QUICK))


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_example_plans_bitwise_the_old_runtime(tmp_path):
    _assert_bitwise(EXAMPLES, *_train_both(tmp_path, EXAMPLES))


# ---------------------------------------------------------------- driver (one tree)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_for_judge(plan, steps: int) -> dict:
    """One rank trained as `pipeplan run` does, in either layout of the package."""
    try:
        from pipeplan.backends.runtime.trainer import PipelineTrainer
        from pipeplan.backends.verify.run import FirstStepGrads, rank_result
    except ImportError:  # the layout before the one-home restructure
        from pipeplan.backends.trainer import PipelineTrainer
        from pipeplan.backends.verify import FirstStepGrads, rank_result
    trainer = PipelineTrainer.for_plan(plan)
    grads = FirstStepGrads(trainer)
    return rank_result([trainer.step(t).loss for t in range(steps)], trainer, grads)


def _rank(rank: int, world: int, port: int, plan_file: str, overrides, steps: int,
          out: str) -> None:
    import torch
    import torch.distributed as dist

    from pipeplan.dsl.load import load_plan
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result = _train_for_judge(load_plan(plan_file, overrides), steps)
    torch.save({"losses": result["losses"], "params": result["params"]}, f"{out}-rank{rank}.pt")
    dist.destroy_process_group()


def _drive(out: str, configs) -> None:
    import torch._dynamo  # noqa: F401  (imported once here, not in every forked rank)
    import torch.multiprocessing as mp

    import pipeplan
    import pipeplan.dsl.load  # noqa: F401
    examples = Path(pipeplan.__file__).parent / "examples"
    for k, (plan, overrides, world, steps) in enumerate(configs):
        mp.start_processes(_rank, args=(world, _free_port(), str(examples / plan), overrides,
                                        steps, os.path.join(out, str(k))),
                           nprocs=world, start_method="fork")


if __name__ == "__main__":
    _drive(sys.argv[1], json.loads(sys.argv[2]))
