#!/usr/bin/env bash
# Fuzz every parser of linmoe (issue 25 item 1; docs/fuzzing.md) with libFuzzer under
# AddressSanitizer + UndefinedBehaviorSanitizer (Debian's clang, >= 14).
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# Builds the library sources and tests/fuzz/targets.c with clang into build-fuzz/ (a
# standalone build: CMake's build uses gcc), then runs each target (default: all) for
# SECONDS (default 60) from its seed corpus tests/fuzz/corpus/<target>/ (read only; the
# inputs it finds go to build-fuzz/corpus/<target>/). Stops at the first crash, hang
# (-timeout 10 s per input), leak or sanitizer report and prints the reproducer and
# the command that replays it; a crash's reproducer belongs in tests/fuzz/corpus/<target>/
# (the CTest fuzz_corpus_replay then keeps it fixed). Per-target executions and seconds
# go to build-fuzz/summary.txt. Environment: FUZZ_JOBS (parallel targets, default 1),
# CC (default clang).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_EACH=${1:-60}
shift || true
CC=${CC:-clang}
OUT=build-fuzz
if ! command -v "$CC" >/dev/null; then
  echo "fuzz.sh: $CC not found (apt-get install -y clang)" >&2
  exit 1
fi
ALL=$(grep -o '{"[a-z_0-9]*", run_' tests/fuzz/targets.c | sed 's/{"\(.*\)", run_/\1/')
TARGETS=${*:-$ALL}

mkdir -p "$OUT/obj"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
CFLAGS="-std=c11 -D_POSIX_C_SOURCE=200809L -O1 -g -Wall -Wextra -Werror -Wno-pass-failed -fopenmp $SAN \
  -Iinclude -Isrc -Itests/fuzz $(pkg-config --cflags libcjson libpcre2-8 libmicrohttpd)"
LIBS="$(pkg-config --libs libcjson libpcre2-8 libmicrohttpd) -lopenblas -lm -lpthread"
SRCS=$(ls src/core/*.c src/ops/*.c src/ops/cpu/*.c src/model/*.c src/data/*.c src/train/*.c \
          src/eval/*.c src/dist/*.c src/serve/*.c src/ops/nocuda/*.c tools/op_*.c tests/fuzz/targets.c)
echo "fuzz.sh: compiling $(echo "$SRCS" | wc -w) sources with $($CC --version | head -1)"
objs=()
pids=()
for s in $SRCS; do
  o="$OUT/obj/$(echo "$s" | tr / _).o"
  objs+=("$o")
  if [ ! -f "$o" ] || [ "$s" -nt "$o" ] || [ -n "$(find include src tools tests/fuzz -name '*.h' -newer "$o" 2>/dev/null | head -1)" ]; then
    # shellcheck disable=SC2086
    $CC $CFLAGS -fsanitize=fuzzer-no-link -c "$s" -o "$o" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$(nproc)" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
for t in $TARGETS; do
  # shellcheck disable=SC2086
  $CC $CFLAGS -fsanitize=fuzzer -DLM_FUZZ_TARGET="\"$t\"" tests/fuzz/fuzz_main.c "${objs[@]}" \
    $LIBS -o "$OUT/fuzz_$t"
done

: > "$OUT/summary.txt"
run_one() {
  local t=$1
  local log="$OUT/fuzz_$t.log"
  mkdir -p "$OUT/corpus/$t" "$OUT/crash/$t"
  if OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     "$OUT/fuzz_$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=4096 \
       -max_len=65536 -print_final_stats=1 -artifact_prefix="$OUT/crash/$t/" \
       "$OUT/corpus/$t" "tests/fuzz/corpus/$t" >"$log" 2>&1; then
    local execs secs
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
    printf '%-16s %8s s %12s executions\n' "$t" "${secs:-$SECONDS_EACH}" "${execs:-?}" | tee -a "$OUT/summary.txt"
    return 0
  fi
  echo "fuzz.sh: target $t FAILED; the end of $log:" >&2
  tail -60 "$log" >&2
  local a
  a=$(ls -t "$OUT/crash/$t/"* 2>/dev/null | head -1 || true)
  if [ -n "$a" ]; then
    echo "fuzz.sh: reproducer $a ($(stat -c %s "$a") bytes):" >&2
    od -A d -c "$a" | head -20 >&2
    echo "fuzz.sh: replay with: LINMOE_FUZZ_VERBOSE=1 $OUT/fuzz_$t $a   (or build/fuzz_replay $t $a; LINMOE_FUZZ_VERBOSE shows what op_meta sends to /dev/null, a sanitizer report included)" >&2
  fi
  return 1
}
JOBS=${FUZZ_JOBS:-1}
fail=0
set -- $TARGETS
while [ $# -gt 0 ] && [ $fail -eq 0 ]; do
  pids=()
  for _ in $(seq "$JOBS"); do
    [ $# -gt 0 ] || break
    run_one "$1" & pids+=($!)
    shift
  done
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
done
[ $fail -eq 0 ] && echo "fuzz.sh: every target ran ${SECONDS_EACH} s without a crash (build-fuzz/summary.txt)"
exit $fail
