#!/usr/bin/env bash
# Regenerate linmoe's golden fixtures (tests/fixtures/model_tiny.safetensors and
# tests/fixtures/attnres_naive.safetensors) on the GPU machine, whose python3 has
# PyTorch >= 2.4 with einops and triton (fla's naive references need einops and
# F.rms_norm). Every fla agreement check must run and pass (--require-fla).
#
#   scripts/reference/make_fixtures.sh [OUT_DIR]        (default: tests/fixtures)
#
# fla's source is read from peers/fla (git-ignored; github fla-org/flash-linear-attention
# at bc3b101dcb713ddc5bd8924b66754eb68b5ccf89, see scripts/reference/README.md), or
# from $FLA. No GPU is used: everything runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
FLA="${FLA:-peers/fla}"
OUT="${1:-tests/fixtures}"
if [[ ! -d "$FLA/fla/ops/kda" ]]; then
    echo "make_fixtures.sh: no fla source tree at $FLA (see scripts/reference/README.md)" >&2
    exit 1
fi
export PYTHONUNBUFFERED=1
exec python3 scripts/reference/make_fixtures.py --fla "$FLA" --require-fla --out "$OUT"
