#!/usr/bin/env bash
# On the GPU machine: linmoe's CUDA KDA kernels beside fla's chunk_kda / fused
# recurrent decode and FlashKDA's forward, in one process (scripts/gpu/bench_kda.py).
# Built here beforehand: build-gpu/liblinmoe_cuda.so (scripts/gpu/pack.sh) and
# build-gpu-peers/libflashkda_shim.so (scripts/gpu/build_flashkda.sh; optional: its
# row prints "not built" without it). The device tool carries
#   ["build-gpu/liblinmoe_cuda.so", "build-gpu-peers", "peers/fla"]
#   scripts/gpu/bench.sh [--quick] [--json OUT] [--lib LIB.so] [--flashkda SHIM.so]
# LINMOE_CUDA_LIB / FLASHKDA_SHIM also pick the libraries (default
# $LINMOE_GPU_DIR/liblinmoe_cuda.so, LINMOE_GPU_DIR defaulting to build-gpu). With $OUT
# set (the device tool's output folder) and no --json, the JSON goes to
# $OUT/bench_kda.json. scripts/gpu/libpath.sh puts torch's cuBLAS on the library path
# (liblinmoe_cuda.so links it).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1
export LINMOE_CUDA_LIB="${LINMOE_CUDA_LIB:-${LINMOE_GPU_DIR:-build-gpu}/liblinmoe_cuda.so}"
source scripts/gpu/libpath.sh # liblinmoe_cuda.so needs libcublas (torch's pip copy first)
args=("$@")
if [ -n "${OUT:-}" ] && [[ " $* " != *" --json "* ]]; then
    args+=(--json "$OUT/bench_kda.json")
fi
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader 2>/dev/null
python3 scripts/gpu/bench_kda.py "${args[@]}"
