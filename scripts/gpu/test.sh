#!/usr/bin/env bash
# Run the CUDA tests on the GPU machine (after scripts/gpu/pack.sh here; the device
# tool carries build-gpu/). Prints the per-case errors and cmocka's summary.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh # $LINMOE_GPU_DIR/lib, cuBLAS (pip wheels, /usr/local/cuda)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$LINMOE_GPU_DIR/test_kda_cuda"
rc=$?
"$LINMOE_GPU_DIR/test_kda_decode_cuda" || rc=1
exit $rc
