#!/usr/bin/env bash
# CTest fixture of the server tests (server_client_*, server_load_short): a small trained
# checkpoint, configs/tiny-train.json with 8x its tokens (128 steps; it then answers with
# words), on the Brown splits, into OUT_DIR/serve-fixture/run. Trained once per build
# directory (kept when complete). Without data/brown it does nothing: the tests skip.
# Usage: server_fixture.sh OUT_DIR   (from the source root; LINMOE_BIN = the CLI)
set -euo pipefail
bin=${LINMOE_BIN:?LINMOE_BIN is not set (run through ctest)}
dir=${1:?usage: server_fixture.sh OUT_DIR}/serve-fixture
[[ -f data/brown/train.txt && -f data/brown/val.txt ]] || { echo "no data/brown: nothing to do"; exit 0; }
[[ -f $dir/run/ckpt/latest ]] && { echo "checkpoint $dir/run is there"; exit 0; }
rm -rf "$dir"
mkdir -p "$dir"
for s in train val; do
    "$bin" tokenize --tokenizer byte --in "data/brown/$s.txt" --out "$dir/$s.bin" >/dev/null 2>&1
done
sed -e "s|data/brown/train.bin|$dir/train.bin|" -e "s|data/brown/val.bin|$dir/val.bin|" \
    -e 's|"tokens": 8192|"tokens": 65536|' configs/tiny-train.json >"$dir/train.json"
"$bin" train --config "$dir/train.json" --run-dir "$dir/run.tmp" >"$dir/train.log" 2>&1 ||
    { cat "$dir/train.log"; exit 1; }
mv "$dir/run.tmp" "$dir/run"
echo "checkpoint $dir/run"
