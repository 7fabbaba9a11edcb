# Sourced (not run) by the GPU-machine scripts (test.sh, bench.sh, bench-c.sh), from
# the repository root: puts on LD_LIBRARY_PATH what the packed binaries load.
#   $LINMOE_GPU_DIR/lib   what scripts/gpu/pack.sh copied (default build-gpu/lib)
#   cuDNN                 not packed either (the engines are 250+ MB): torch's pip wheel
#                         nvidia-cudnn-cu13 has libcudnn.so.9 and its sub-libraries
#   NCCL                  not packed (218 MB): torch's pip wheel nvidia-nccl has libnccl.so.2
#   cuBLAS                not packed (libcublas + libcublasLt are 600 MB): the GPU
#                         image has it twice, in torch's pip wheels (nvidia/.../lib) and
#                         in the CUDA toolkit (/usr/local/cuda/lib64). The pip copy
#                         goes first so that a Python process that also loads torch
#                         (scripts/gpu/bench_kda.py) has one libcublas, torch's.
# The CUDA runtime is linked statically (CMake CUDA::cudart_static, nvcc's default).
LINMOE_GPU_DIR="${LINMOE_GPU_DIR:-build-gpu}"
lm_gpu_libpath="$PWD/$LINMOE_GPU_DIR/lib"
if command -v python3 >/dev/null 2>&1; then
    lm_pip_cublas="$(python3 - 2>/dev/null <<'PY'
import glob, os
try:
    import nvidia  # namespace package of the nvidia-* wheels
except Exception:
    raise SystemExit(0)
dirs = []
for lib in ("libcublas.so*", "libcudnn.so*", "libnccl.so*"):
    for root in list(getattr(nvidia, "__path__", [])):
        hits = sorted(glob.glob(os.path.join(root, "**", lib), recursive=True))
        if hits:
            dirs.append(os.path.dirname(hits[0]))
            break
print(":".join(dirs))
PY
)"
    [ -n "$lm_pip_cublas" ] && lm_gpu_libpath="$lm_gpu_libpath:$lm_pip_cublas"
fi
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && lm_gpu_libpath="$lm_gpu_libpath:$d"
done
export LD_LIBRARY_PATH="$lm_gpu_libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset lm_gpu_libpath lm_pip_cublas d
