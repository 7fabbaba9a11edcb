#!/usr/bin/env bash
# Run the CUDA tests on the GPU machine (after scripts/gpu/pack.sh here; the device
# tool carries build-gpu/): the KDA grid and decode tests, the context test (two contexts
# on two threads, no allocation in steady state), the GPU model against the CPU model
# (test_gpu_model) and test_backend_ops (every op against
# the CPU reference; its table goes to $OUT/backend_ops.txt when $OUT is set) and the NCCL
# communicator on world size 1 (test_dist_nccl: the collectives, and the trainer's NCCL
# path, `--dist nccl`, against the plain GPU run, bit for bit; it reads
# configs/tiny-train.json from the repository root). One test alone:
# LM_TEST_FILTER=test_train_world1 "$LINMOE_GPU_DIR/test_dist_nccl".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh # $LINMOE_GPU_DIR/lib, cuBLAS / cuDNN (pip wheels, /usr/local/cuda)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
log="${OUT:-/tmp}"
rc=0
for t in test_kda_cuda test_kda_decode_cuda test_cuda_ctx test_dist_nccl test_gpu_model; do
    "$LINMOE_GPU_DIR/$t" >"$log/$t.log" 2>&1
    r=$?
    echo "$t: exit $r ($(grep -cE '^\[ *(OK|PASSED) *\]' "$log/$t.log") ok lines)"
    [ $r -ne 0 ] && { rc=1; tail -30 "$log/$t.log"; }
done
"$LINMOE_GPU_DIR/test_backend_ops" "$@" >"$log/backend_ops.txt" 2>&1 || rc=1
cat "$log/backend_ops.txt"
exit $rc
