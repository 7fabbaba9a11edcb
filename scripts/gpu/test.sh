#!/usr/bin/env bash
# Run the CUDA tests on the GPU machine (after scripts/gpu/pack.sh here; the device
# tool carries build-gpu/). Prints the per-case errors and cmocka's summary.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export LD_LIBRARY_PATH="$PWD/build-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
build-gpu/test_kda_cuda
