#!/usr/bin/env bash
# GPU check (issue 11): on a machine with at least one CUDA GPU, run an example plan on
# CUDA with bf16 (one rank per GPU, NCCL; with one GPU every stage on that rank: pp=1), print
# tokens/s and model FLOPs utilisation, exit non-zero on any error.
#   bash scripts/gpu_check.sh [PLAN] [STEPS]
# Run from the repository root with pipeplan importable (PYTHONPATH set to its parent).
set -euo pipefail
PLAN=${1:-examples/gpt_pp4_1f1b.plan}
STEPS=${2:-20}
python - <<'PY' || { echo "gpu_check: no CUDA device" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
PP=$(( NGPU >= 4 ? 4 : 1 ))
METRICS=$(mktemp -d)/metrics.jsonl
torchrun --standalone --nproc-per-node "$PP" -m pipeplan run "$PLAN" \
    --set mesh.pp="$PP" --set train.precision=bf16 --steps "$STEPS" --metrics "$METRICS"
python - "$PLAN" "$PP" "$METRICS" <<'PY'
import json, sys
import torch
from pipeplan.dsl.load import load_plan
from pipeplan.compiler.driver import compile_plan
plan = load_plan(sys.argv[1], [f"mesh.pp={sys.argv[2]}", "train.precision=bf16"])
rows = [json.loads(l) for l in open(sys.argv[3])]
steady = rows[len(rows) // 2:] or rows  # skip warm-up (CUDA init, autotuning)
tok_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
c = compile_plan(plan)
flops_per_token = 3 * sum(s.flops for s in c.stages) / (plan.microbatch_size * plan.data.seq_len)
peak = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 peak per GPU
name = torch.cuda.get_device_name(0)
per_gpu = next((v for k, v in peak.items() if k in name), None)
print(f"gpu_check: {name} x{sys.argv[2]}: {tok_s:.0f} tokens/s (steady half of {len(rows)} steps)")
if per_gpu:
    print(f"gpu_check: model FLOPs utilisation {tok_s * flops_per_token / (per_gpu * int(sys.argv[2])):.2%}"
          f" ({flops_per_token:.3g} FLOPs/token, 3x forward)")
else:
    print(f"gpu_check: peak FLOP/s of {name} unknown: MFU not computed")
PY
# Compiled ZBV (issue 24): the same plan under ZBV (2 stages per rank), eager then inductor
# (pipeplan's compiled F/B/W graphs; torch refuses a compiled stage under ZBV), side by
# side: tokens/s of each and their ratio. Needs >= 2 GPUs (ZBV's V needs 2 ranks).
if (( NGPU >= 2 )); then
    ZPP=$(( NGPU >= 4 ? 4 : 2 ))
    for MODE in eager inductor; do
        torchrun --standalone --nproc-per-node "$ZPP" -m pipeplan run "$PLAN" \
            --set mesh.pp="$ZPP" --set train.precision=bf16 --set pipeline.schedule=zbv \
            --set pipeline.virtual=2 --set pipeline.split=auto --set compile.mode="$MODE" \
            --steps "$STEPS" --metrics "$(dirname "$METRICS")/zbv_$MODE.jsonl"
    done
    python - "$(dirname "$METRICS")" <<'PY'
import json, sys
def tok_s(path):
    rows = [json.loads(l) for l in open(path)]
    steady = rows[len(rows) // 2:] or rows
    return sum(r["tokens_per_s"] for r in steady) / len(steady)
eager, ind = (tok_s(f"{sys.argv[1]}/zbv_{m}.jsonl") for m in ("eager", "inductor"))
print(f"gpu_check: zbv eager {eager:.0f} tokens/s, zbv inductor {ind:.0f} tokens/s "
      f"({ind / eager:.2f}x)")
PY
fi
