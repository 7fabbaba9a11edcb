#!/usr/bin/env bash
# On the GPU machine: linmoe's CUDA KDA forward beside fla's chunk_kda in one
# process (scripts/gpu/bench_kda.py), after scripts/gpu/pack.sh here. The device
# tool carries build-gpu/ and peers/fla/ (fla's source, git-ignored).
#   scripts/gpu/bench.sh [--quick] [--json OUT]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1
python3 scripts/gpu/bench_kda.py "$@"
