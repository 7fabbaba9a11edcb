#!/usr/bin/env bash
# `linmoe bench model --device cuda` beside its peers (fla's KDAForCausalLM for
# configs/gpu-dense.json, the PyTorch + fla twin scripts/gpu/twin_model.py for
# configs/gpu-moe.json) in one process on the GPU machine, after scripts/gpu/pack.sh
# here; carry build-gpu and peers/fla (fla's source at bc3b101d, git-ignored):
#   scripts/gpu/bench_model.sh [--configs A,B] [--peers fla,twin] [--twin-all] [--quick]
#                              [--no-compile] [--skip-linmoe] [--dry-run]
# Writes $OUT/bench_model.json (or /tmp/bench_model.json); scripts/gpu/libpath.sh puts
# torch's cuBLAS on the library path (liblinmoe_cuda.so links it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader \
    2>/dev/null || true
exec python3 scripts/gpu/bench_model.py "$@"
