#!/usr/bin/env bash
# scripts/nvcc-quiet.sh (the CUDA compiler launcher of CMakeLists.txt): on a stand-in for
# nvcc that prints ptxas's info lines, a warning, an error and stdout, and exits 3, the
# info lines are gone and everything else (and the status) is kept. With real nvcc,
# kda_fwd.cu prints "ptxas info    : (C7519) warpgroup.arrive is injected ..." lines.
set -u
root="${1:?usage: nvcc_quiet.sh REPO_ROOT}"
fake() {
    echo "stdout line"
    echo "ptxas info    : (C7519) warpgroup.arrive is injected in around line 19794" >&2
    echo "ptxas warning : Registers are spilled to local memory in function 'k'" >&2
    echo "ptxas info    : Used 128 registers, used 1 barriers" >&2
    echo "src/x.cu(3): error: identifier \"y\" is undefined" >&2
    return 3
}
export -f fake
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
bash "$root/scripts/nvcc-quiet.sh" bash -c fake >"$out" 2>"$err"
rc=$?
fail() { echo "nvcc_quiet: $*"; echo "stdout:"; cat "$out"; echo "stderr:"; cat "$err"; exit 1; }
[[ $rc -eq 3 ]] || fail "exit status $rc, want 3 (nvcc's)"
grep -q '^stdout line$' "$out" || fail "stdout lost"
grep -q '^ptxas info' "$err" && fail "ptxas info lines not dropped"
grep -q '^ptxas warning : Registers are spilled' "$err" || fail "the ptxas warning was dropped"
grep -q 'error: identifier' "$err" || fail "the error was dropped"
# a command that succeeds quietly exits 0 (grep finding nothing to print is not a failure)
bash "$root/scripts/nvcc-quiet.sh" true >"$out" 2>"$err" || fail "exit status $? for 'true'"
[[ ! -s "$err" ]] || fail "output for 'true'"
echo "nvcc_quiet: ok"
