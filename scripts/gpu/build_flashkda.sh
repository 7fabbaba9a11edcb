#!/usr/bin/env bash
# Build FlashKDA's forward (github.com/MoonshotAI/FlashKDA) with linmoe's ctypes shim
# (scripts/gpu/flashkda_shim.cu) into build-gpu-peers/libflashkda_shim.so, here, with
# the local nvcc for sm_90a -- no PyTorch, so the GPU machine (no network, scarce
# time) only loads the library. scripts/gpu/bench_kda.py picks it up.
#
# Needs, git-ignored under peers/ (never committed):
#   peers/FlashKDA   FlashKDA's tree (read at 1ce47ea3)
#   peers/cutlass    CUTLASS include/ and tools/util/include/ at the commit FlashKDA
#                    pins as its submodule (5c149f52)
# e.g. from git mirrors:  git --git-dir=FLASHKDA.git archive HEAD | tar -x -C peers/FlashKDA
#   git --git-dir=CUTLASS.git archive 5c149f52a436782210263fb2f19b354443a61c6a include \
#       tools/util/include | tar -x -C peers/cutlass
# The compile flags are FlashKDA's setup.py nvcc flags. Takes a few minutes (two
# translation units; fwd_launch.cu instantiates 14 kernel-pair variants).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
FK=${FLASHKDA_DIR:-peers/FlashKDA}
CU=${CUTLASS_DIR:-peers/cutlass}
OUT=${FLASHKDA_OUT:-build-gpu-peers}
for f in "$FK/csrc/fwd.h" "$FK/csrc/smxx/fwd_launch.cu" "$CU/include/cute/tensor.hpp"; do
    [ -f "$f" ] || { echo "build_flashkda.sh: missing $f (see the header of this script)" >&2; exit 1; }
done
OBJ="$OUT.obj"   # objects beside, not inside, the folder the device tool carries
mkdir -p "$OUT" "$OBJ"
FLAGS=(-O3 -std=c++17 -Xcompiler -fPIC
       -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
       -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda
       --use_fast_math --ptxas-options=--register-usage-level=10,--warn-on-spills
       -gencode arch=compute_90a,code=sm_90a
       -I"$FK/csrc" -I"$CU/include" -I"$CU/tools/util/include")
# compile a unit unless its object is newer than its source (FlashKDA's part takes minutes)
compile() {
    if [ ! -f "$2" ] || [ "$1" -nt "$2" ]; then nvcc "${FLAGS[@]}" -c "$1" -o "$2"; fi
}
compile "$FK/csrc/smxx/fwd_launch.cu" "$OBJ/fwd_launch.o" &
p1=$!
compile scripts/gpu/flashkda_shim.cu "$OBJ/flashkda_shim.o" &
p2=$!
rc=0
wait $p1 || rc=1
wait $p2 || rc=1
[ $rc -eq 0 ] || { echo "build_flashkda.sh: compile failed" >&2; exit 1; }
nvcc -shared -gencode arch=compute_90a,code=sm_90a "$OBJ/fwd_launch.o" "$OBJ/flashkda_shim.o" \
    -o "$OUT/libflashkda_shim.so"
ls -la "$OUT/libflashkda_shim.so"
