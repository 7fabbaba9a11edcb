#!/usr/bin/env bash
# A checkpoint written to a full filesystem (issue 25, Build item 4): the run directory on a
# size-limited tmpfs; a run trains to a first checkpoint, the filesystem is filled, and the
# resumed run's next checkpoint must fail with a clear error naming the file and the cause
# (`checkpoint at step N not written (the previous one is intact): FILE: ... No space left
# on device`), leave no temporary directory, and keep `latest` naming the previous
# checkpoint, which must still load: once space is freed, --resume from it finishes the run.
# Two fill levels: 64 KiB free (the logs and train_config.json fit, the model file does
# not) and room for the model file but not the train state.
# Needs a tmpfs mount: as root, or in a user namespace (unshare -rm); otherwise it skips (77).
# Usage: full_disk.sh   (from the source root; LINMOE_BIN = the CLI)
set -uo pipefail
bin=$(realpath "${LINMOE_BIN:?LINMOE_BIN is not set (run through ctest)}")
if [[ -z ${FULL_DISK_INNER:-} ]]; then
    # a private mount namespace (the mount vanishes with the test, even when it is killed)
    if [[ $(id -u) == 0 ]] && unshare -m true 2>/dev/null; then
        FULL_DISK_INNER=1 exec unshare -m bash "$0" "$@"
    elif unshare -rm true 2>/dev/null; then
        FULL_DISK_INNER=1 exec unshare -rm bash "$0" "$@"
    fi
    echo "full_disk: cannot create a mount namespace (not root, no user namespaces): skipped"
    exit 77
fi
fail() { echo "full_disk: FAIL: $*"; exit 1; }
W=$(mktemp -d /tmp/linmoe-fulldisk.XXXXXX)
trap 'umount "$W/fs" 2>/dev/null; rm -rf "$W"' EXIT
mkdir -p "$W/fs"
mount -t tmpfs -o size=8m tmpfs "$W/fs" 2>/dev/null ||
    { echo "full_disk: cannot mount a tmpfs: skipped"; exit 77; }

# data: a small byte-token shard (this script's own text repeated) outside the tmpfs
for i in $(seq 60); do cat "$0"; done >"$W/text.txt"
"$bin" tokenize --tokenizer byte --doc-sep blank --in "$W/text.txt" --out "$W/data.bin" >/dev/null ||
    fail "tokenize"
python3 - "$W" <<'EOF' || fail "config"
import json, sys
w = sys.argv[1]
c = json.load(open("configs/tiny-train.json"))
c["data"] = {"train": w + "/data.bin", "val": w + "/data.bin"}
c["train"]["checkpoint_every"] = 2
c["eval"]["passkey_lengths"] = []
json.dump(c, open(w + "/train.json", "w"), indent=1)
EOF

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} LINMOE_NO_BLAS_REEXEC=1
"$bin" train --config "$W/train.json" --run-dir "$W/ref" --max-steps 6 >/dev/null 2>"$W/ref.err" ||
    { cat "$W/ref.err"; fail "the reference run"; }
model_bytes=$(stat -c %s "$W/ref/ckpt/step-0000006/model.safetensors")

for level in small model; do
    R=$W/fs/run
    rm -rf "$R" "$W/fs/filler"
    "$bin" train --config "$W/train.json" --run-dir "$R" --max-steps 4 >/dev/null 2>"$W/a.err" ||
        { cat "$W/a.err"; fail "the first run on the tmpfs"; }
    [[ $(cat "$R/ckpt/latest") == step-0000004 ]] || fail "latest is $(cat "$R/ckpt/latest")"
    # fill the filesystem, then free what this level leaves
    dd if=/dev/zero of="$W/fs/filler" bs=4k 2>/dev/null
    free=65536
    [[ $level == model ]] && free=$((model_bytes + 65536))
    truncate -s "-$free" "$W/fs/filler"
    "$bin" train --run-dir "$R" --resume --max-steps 6 >"$W/b.out" 2>"$W/b.err"
    rc=$?
    echo "--- $level free: exit $rc; stderr:"
    cat "$W/b.err"
    ((rc != 0)) || fail "$level: the run with a full disk exited 0"
    grep -q "checkpoint at step 6 not written (the previous one is intact)" "$W/b.err" ||
        fail "$level: no 'checkpoint at step 6 not written (the previous one is intact)'"
    grep -q "No space left on device" "$W/b.err" || fail "$level: the cause (ENOSPC) is not named"
    want=model.safetensors
    [[ $level == model ]] && want=train_state.safetensors
    grep -q "$want" "$W/b.err" || fail "$level: the file ($want) is not named"
    [[ $(cat "$R/ckpt/latest") == step-0000004 ]] || fail "$level: latest is $(cat "$R/ckpt/latest")"
    ls -A "$R/ckpt" | grep -q '^\.tmp' && fail "$level: temporary files left: $(ls -A "$R/ckpt")"
    # space again: the previous checkpoint loads and the run finishes as the reference did
    rm -f "$W/fs/filler"
    "$bin" train --run-dir "$R" --resume --max-steps 6 >/dev/null 2>"$W/c.err" ||
        { cat "$W/c.err"; fail "$level: resume from the previous checkpoint"; }
    for f in model.safetensors train_state.safetensors; do
        cmp -s "$R/ckpt/step-0000006/$f" "$W/ref/ckpt/step-0000006/$f" ||
            fail "$level: $f after the resume differs from the uninterrupted run's"
    done
done
echo "full_disk: pass"
