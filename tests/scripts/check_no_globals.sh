#!/usr/bin/env bash
# The library keeps no process-global mutable state in its CUDA code (DESIGN.md "Devices,
# memory and scale"): every buffer, cache, flag and option lives in the lm_cuda_ctx the
# caller owns. This check fails on, in src/ops/cuda/:
#   - a getenv call (options are context options, lm_cuda_ctx_set_option);
#   - a variable at namespace or file scope that is not const / constexpr;
#   - a static local variable that is not const / constexpr (function-local caches).
# It looks at declarations only (not at static functions, templates or kernels), by
# patterns a reviewer can read: a line declaring a variable ends in ';' or '= ...;'
# without '(' before the '=' or the ';'.
set -euo pipefail
dir="${1:-$(dirname "${BASH_SOURCE[0]}")/../../src/ops/cuda}"
fail=0
for f in "$dir"/*.cu "$dir"/*.cuh; do
    [ -e "$f" ] || continue
    if grep -nE '\bgetenv\s*\(' "$f"; then
        echo "$f: getenv in the library (use a context option)" >&2
        fail=1
    fi
    # static locals / file statics that are variables: 'static T name[...]? (= ...)?;'
    if grep -nE '^\s*static\s+(volatile\s+)?[A-Za-z_][A-Za-z0-9_:<>, ]*[ *&]+[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])*\s*(=[^(]*)?;' "$f" |
        grep -vE '\bconst(expr)?\b|static_assert'; then
        echo "$f: mutable static variable (keep it in the context)" >&2
        fail=1
    fi
    # namespace-scope variables without static: 'Type g_name...;' at column 0
    if grep -nE '^[A-Za-z_][A-Za-z0-9_:<>, ]*[ *&]+g_[A-Za-z0-9_]*(\[[^]]*\])*\s*(=[^(]*)?;' "$f" |
        grep -vE '\bconst(expr)?\b'; then
        echo "$f: global variable (keep it in the context)" >&2
        fail=1
    fi
    # __device__ globals that are written (not __constant__): flags, counters
    if grep -nE '^\s*(static\s+)?__device__\s+[A-Za-z_][A-Za-z0-9_ ]*[ *]+[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])*\s*(=[^(]*)?;' "$f"; then
        echo "$f: __device__ global variable (process-wide device state)" >&2
        fail=1
    fi
done
if [ $fail -ne 0 ]; then
    echo "check_no_globals: FAILED" >&2
    exit 1
fi
echo "check_no_globals: no getenv and no mutable global or static variable in $dir"
