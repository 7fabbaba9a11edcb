#!/usr/bin/env bash
# `linmoe bench ops` beside its PyTorch / fla peers on the GPU machine (after
# scripts/gpu/pack.sh here; carry build-gpu and, for fla's modules, peers/fla):
#   scripts/gpu/bench_ops.sh [--ops LIST] [--quick]
# Writes $OUT/bench_ops.json (or /tmp/bench_ops.json).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh
export PYTHONUNBUFFERED=1
exec python3 scripts/gpu/bench_ops.py "$@"
