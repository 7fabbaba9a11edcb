#!/usr/bin/env bash
# `make` after a failed configure (issue 25): the first configure of a fresh build
# directory fails (LINMOE_TEST_FAIL_CONFIGURE), leaving CMakeCache.txt but no Makefile;
# the next `make configure`, with the cause gone, must configure instead of failing with
# "No rule to make target 'Makefile'" until `make clean`, and show CMake's linmoe status
# line. Only the configure step runs (no build). Usage: make_recovers.sh SOURCE_DIR
set -u
src=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
b=$tmp/build
flags="-DLINMOE_CUDA=OFF -DLINMOE_NATIVE=OFF"
if make -s -C "$src" configure BUILD="$b" CMAKE_FLAGS="$flags -DLINMOE_TEST_FAIL_CONFIGURE=ON" \
    >"$tmp/out1" 2>&1; then
    echo "FAIL: the configure with LINMOE_TEST_FAIL_CONFIGURE=ON succeeded"; exit 1
fi
grep -q "LINMOE_TEST_FAIL_CONFIGURE is ON" "$tmp/out1" || { echo "FAIL: CMake's error not shown:"; cat "$tmp/out1"; exit 1; }
grep -q "configuring $b failed" "$tmp/out1" || { echo "FAIL: no 'configuring failed' line:"; cat "$tmp/out1"; exit 1; }
test -f "$b/CMakeCache.txt" || { echo "FAIL: no CMakeCache.txt after the failed configure"; exit 1; }
if ! make -s -C "$src" configure BUILD="$b" CMAKE_FLAGS="$flags -DLINMOE_TEST_FAIL_CONFIGURE=OFF" \
    >"$tmp/out2" 2>&1; then
    echo "FAIL: make configure did not recover:"; cat "$tmp/out2"; exit 1
fi
test -f "$b/Makefile" || { echo "FAIL: no Makefile after recovering"; exit 1; }
grep -q -- "-- linmoe: no CUDA compiler" "$tmp/out2" || grep -q -- "-- linmoe:" "$tmp/out2" || {
    echo "FAIL: CMake's linmoe status line not shown:"; cat "$tmp/out2"; exit 1; }
echo "make_recovers: configure failed, then recovered; status line: $(grep -- '-- linmoe' "$tmp/out2" | head -1)"
