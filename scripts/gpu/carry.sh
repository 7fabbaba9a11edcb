#!/usr/bin/env bash
# Pack what a GPU session's device calls need into gpu-carry/ (git-excluded), within the device
# tool's 64 MiB (the tracked tree, about 9 MiB, travels too):
#   scripts/gpu/carry.sh [--no-so] [--no-tests]      HERE, after scripts/gpu/pack.sh
#     gpu-carry/bin.tar.gz    build-gpu/linmoe, the CUDA test binaries (unless --no-tests),
#                             liblinmoe_cuda.so (the FFI library of bench_model.py /
#                             bench_kda.py / bench_ops.py; unless --no-so) and build-gpu/lib
#     gpu-carry/data.tar.gz   data/brown/{train,val}.txt and data/gpt2 (train_parity.sh,
#                             fla_parity.sh; scripts/fetch-data.sh makes them)
#     gpu-carry/fla.tar.gz    peers/fla/fla (fla's Python package; peers/ is git-ignored: put
#                             fla's source at the commit the peers were measured at there)
#   source scripts/gpu/unpack.sh                      THERE, first thing in the command: unpacks
#                             every gpu-carry/*.tar.gz and sources scripts/gpu/libpath.sh
# Device call: carry ["gpu-carry/bin.tar.gz", "gpu-carry/data.tar.gz", "gpu-carry/fla.tar.gz"]
# (and a run script of your own under gpu-carry/, which is git-excluded too). The GPU main job
# has its own archive (scripts/main-job-gpu.sh pack: 42 MiB), which does not fit beside these.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SO=1
TESTS=1
for a in "$@"; do
    case "$a" in
    --no-so) SO=0 ;;
    --no-tests) TESTS=0 ;;
    *) echo "carry.sh: unknown option '$a' (known: --no-so, --no-tests)" >&2; exit 2 ;;
    esac
done
GPU="${LINMOE_GPU_DIR:-build-gpu}"
[[ -x "$GPU/linmoe" ]] || { echo "carry.sh: no $GPU/linmoe: run scripts/gpu/pack.sh first" >&2; exit 1; }
mkdir -p gpu-carry
grep -qx '/gpu-carry/' .git/info/exclude 2>/dev/null || echo '/gpu-carry/' >>.git/info/exclude
files=("$GPU/linmoe" "$GPU/lib")
if ((TESTS)); then
    for t in test_gpu_model test_kda_cuda test_kda_decode_cuda test_cuda_ctx test_backend_ops test_dist_nccl; do
        [[ -x "$GPU/$t" ]] && files+=("$GPU/$t")
    done
fi
((SO)) && [[ -f "$GPU/liblinmoe_cuda.so" ]] && files+=("$GPU/liblinmoe_cuda.so")
tar -cf - "${files[@]}" | gzip -6 >gpu-carry/bin.tar.gz
data=()
for f in data/brown/train.txt data/brown/val.txt data/gpt2; do [[ -e "$f" ]] && data+=("$f"); done
if ((${#data[@]})); then
    tar -czf gpu-carry/data.tar.gz "${data[@]}"
else
    echo "carry.sh: no data/brown or data/gpt2 (scripts/fetch-data.sh): data.tar.gz not made" >&2
fi
if [[ -d peers/fla/fla ]]; then
    tar -czf gpu-carry/fla.tar.gz peers/fla/fla
else
    echo "carry.sh: no peers/fla/fla: fla.tar.gz not made (the fla / twin peers need it)" >&2
fi
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$tree
for f in gpu-carry/bin.tar.gz gpu-carry/data.tar.gz gpu-carry/fla.tar.gz; do
    [[ -f "$f" ]] || continue
    s=$(stat -c %s "$f")
    total=$((total + s))
    awk -v f="$f" -v s="$s" 'BEGIN { printf "%-24s %6.1f MiB\n", f, s / 1048576 }'
done
awk -v s="$tree" 'BEGIN { printf "%-24s %6.1f MiB\n", "tracked files", s / 1048576 }'
awk -v s="$total" 'BEGIN { printf "%-24s %6.1f MiB of 64\n", "in all", s / 1048576 }'
((total <= 64 * 1048576)) || { echo "carry.sh: over the device tool's 64 MiB (try --no-tests or --no-so)" >&2; exit 1; }
