#!/usr/bin/env bash
# On the GPU machine: the C benchmark table `linmoe bench kda --device cuda`
# (bench/bench_kda_cuda.c: the CUDA KDA forward, training forward, forward+backward
# and decode step against the cuBLAS bf16 GEMM rate and the copy bandwidth measured
# in the same run), after scripts/gpu/pack.sh here; the device tool carries
# build-gpu/ (or $LINMOE_GPU_DIR).
#   scripts/gpu/bench-c.sh [--quick] [--json FILE]
# Without --json and with $OUT set (the device tool's output folder) the JSON goes
# to $OUT/bench_kda_cuda.json.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
args=("$@")
have_json=0
for a in "$@"; do [ "$a" = "--json" ] && have_json=1; done
if [ "$have_json" = 0 ] && [ -n "${OUT:-}" ]; then
    args+=(--json "$OUT/bench_kda_cuda.json")
fi
exec "$LINMOE_GPU_DIR/linmoe" bench kda --device cuda "${args[@]}"
