#!/usr/bin/env bash
# Build linmoe with its CUDA kernels here (local nvcc, sm_90a) and pack what the GPU
# machine needs into build-gpu/ (or $LINMOE_GPU_DIR): the CLI, the CUDA test binaries
# and the shared libraries they load that a bare CUDA image may lack (cmocka, OpenMP
# runtime, OpenBLAS, cJSON, PCRE2 and their runtime dependencies). The GPU machine
# has no network and none of the Debian -dev packages, so the binaries travel instead
# (device tool: carry ["build-gpu"]); scripts/gpu/test.sh, bench.sh and bench-c.sh run
# them. cuBLAS (libcublas + libcublasLt, 600 MB), NCCL (218 MB) and the CUDA runtime do not travel:
# the GPU image has cuBLAS (torch's pip wheels and /usr/local/cuda/lib64;
# scripts/gpu/libpath.sh finds it) and the runtime is linked statically.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${LINMOE_GPU_DIR:-build-gpu}"
BINS=(linmoe test_kda_cuda test_kda_decode_cuda test_cuda_ctx test_backend_ops test_gpu_model test_dist_nccl)
cmake -S . -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DLINMOE_NATIVE=OFF -DLINMOE_FFI=ON >/dev/null
cmake --build "$OUT/cmake" -j "$(nproc)" --target linmoe_cli test_kda_cuda test_kda_decode_cuda \
    test_cuda_ctx test_backend_ops test_gpu_model test_dist_nccl linmoe_ffi >/dev/null
mkdir -p "$OUT/lib"
for b in "${BINS[@]}"; do cp "$OUT/cmake/$b" "$OUT/"; done
# the FFI library (scripts/gpu/bench_kda.py, bench_ops.py: linmoe beside PyTorch / fla in one
# process): the whole library and `bench ops` in one shared object
cp "$OUT/cmake/liblinmoe_ffi.so" "$OUT/liblinmoe_cuda.so"
for bin in "${BINS[@]/#/$OUT/}" "$OUT/liblinmoe_cuda.so"; do
    ldd "$bin" | awk '/=> \//{print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
            libcublas*|libcublasLt*|libcudart*|libcudnn*|libnccl*) ;; # on the GPU machine (scripts/gpu/libpath.sh)
            *) cp -L "$lib" "$OUT/lib/" ;;
        esac
    done
done
du -sh "${BINS[@]/#/$OUT/}" "$OUT/liblinmoe_cuda.so" "$OUT/lib"
