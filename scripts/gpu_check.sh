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
