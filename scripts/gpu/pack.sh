#!/usr/bin/env bash
# Build linmoe with its CUDA kernels here (local nvcc, sm_90a) and pack what the GPU
# machine needs into build-gpu/ (or $LINMOE_GPU_DIR): the CLI, the CUDA test binaries
# and the shared libraries they load that a bare CUDA image may lack (cmocka, OpenMP
# runtime, OpenBLAS, cJSON, PCRE2 and their runtime dependencies). The GPU machine
# has no network and none of the Debian -dev packages, so the binaries travel instead
# (device tool: carry ["build-gpu"]); scripts/gpu/test.sh, bench.sh and bench-c.sh run
# them. cuBLAS (libcublas + libcublasLt, 600 MB) and the CUDA runtime do not travel:
# the GPU image has cuBLAS (torch's pip wheels and /usr/local/cuda/lib64;
# scripts/gpu/libpath.sh finds it) and the runtime is linked statically.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${LINMOE_GPU_DIR:-build-gpu}"
cmake -S . -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DLINMOE_NATIVE=OFF >/dev/null
cmake --build "$OUT/cmake" -j "$(nproc)" --target linmoe_cli test_kda_cuda test_kda_decode_cuda >/dev/null
mkdir -p "$OUT/lib"
cp "$OUT/cmake/linmoe" "$OUT/cmake/test_kda_cuda" "$OUT/cmake/test_kda_decode_cuda" "$OUT/"
for bin in "$OUT/linmoe" "$OUT/test_kda_cuda" "$OUT/test_kda_decode_cuda"; do
    ldd "$bin" | awk '/=> \//{print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
            libcublas*|libcublasLt*|libcudart*) ;; # on the GPU machine (scripts/gpu/libpath.sh)
            *) cp -L "$lib" "$OUT/lib/" ;;
        esac
    done
done
du -sh "$OUT/linmoe" "$OUT/test_kda_cuda" "$OUT/test_kda_decode_cuda" "$OUT/lib"
# the FFI library for scripts/gpu/bench_kda.py (linmoe beside fla in one process):
# every CUDA source (kernels and the benchmark helpers, which use cuBLAS)
nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc \
    src/ops/cuda/*.cu src/core/errors.c -lcublas -o "$OUT/liblinmoe_cuda.so"
ls -la "$OUT/liblinmoe_cuda.so"
