#!/usr/bin/env bash
# linmoe's main job (the README's first command): install what is missing, fetch the
# Brown corpus, build, tokenize, train configs/brown-cpu.json (hybrid KDA/attention MoE,
# bounded gate, aux-loss-free balancing, Block AttnRes, two context stages 256 -> 1024
# with passkey documents), evaluate, plot and print a generated sample.
#
#   scripts/main-job.sh [CONFIG [RUN_DIR]]      (defaults: configs/brown-cpu.json, runs/brown-cpu)
#
# An interrupted run is resumed (bit-exactly) by running the same command again; a
# finished one is kept and only re-evaluated. Delete RUN_DIR to start over.
# Environment: THREADS (default: all cores), PROMPT (the generation prompt).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CONFIG="${1:-configs/brown-cpu.json}"
RUN="${2:-runs/brown-cpu}"
THREADS="${THREADS:-$(nproc)}"
PROMPT="${PROMPT:-The committee said that the city}"
t0=$(date +%s)
say() { printf '\n== %s (%ds)\n' "$*" "$(( $(date +%s) - t0 ))"; }

say "dependencies"
scripts/install-deps.sh
say "data"
scripts/fetch-data.sh
say "build"
make --no-print-directory >/dev/null
for s in train val; do
    if [[ ! -f data/brown/$s.bin || data/brown/$s.txt -nt data/brown/$s.bin ]]; then
        build/linmoe tokenize --tokenizer byte --in "data/brown/$s.txt" --out "data/brown/$s.bin"
    fi
done

say "train $CONFIG -> $RUN"
if [[ -f "$RUN/ckpt/latest" ]]; then
    build/linmoe train --run-dir "$RUN" --resume --threads "$THREADS"
else
    build/linmoe train --config "$CONFIG" --run-dir "$RUN" --threads "$THREADS"
fi
ckpt="$RUN/ckpt/$(cat "$RUN/ckpt/latest")"

say "eval (held-out Brown split, passkey retrieval; the trainer's stage-end evals are in $RUN/evals.jsonl)"
build/linmoe eval --ckpt "$ckpt" --val data/brown/val.bin --seq-len 1024 \
    --passkey-lengths 256,1024 --passkey-samples 200 --threads "$THREADS" --json "$RUN/eval.json" \
    >/dev/null
python3 - "$RUN" <<'EOF' 2>/dev/null || cat "$RUN/eval.json"
import json, sys
run = sys.argv[1]
e = json.load(open(run + "/eval.json"))
print("bits per byte (val, %d bytes, windows of %d): %.4f" % (e["bytes"], e["seq_len"], e["bits_per_byte"]))
for p in e.get("passkey", []):
    print("passkey @ %d tokens: %d/%d = %.3f" % (p["length"], p["correct"], p["samples"], p["accuracy"]))
evals = [json.loads(l) for l in open(run + "/evals.jsonl") if l.strip()]
for v in evals:
    pk = ", ".join("%d: %.3f" % (p["length"], p["accuracy"]) for p in v.get("passkey", []))
    print("  trainer eval at step %d (stage %s): bpb %.4f, passkey {%s}" % (v["step"], v["stage"], v["bits_per_byte"], pk))
steps = [json.loads(l) for l in open(run + "/log.jsonl") if l.strip()]
last = steps[-50:]
if last and last[-1].get("moe"):
    for i, m in enumerate(last[-1]["moe"]):
        mv = sum(s["moe"][i]["maxvio_batch"] for s in last) / len(last)
        dead = max(s["moe"][i]["n_dead"] for s in last)
        print("  MoE layer %d: maxvio_batch mean over the last %d steps %.3f, dead experts %d" % (m["layer"], len(last), mv, dead))
EOF

say "plots"
build/linmoe plot "$RUN"

say "sample"
build/linmoe generate --ckpt "$ckpt" --prompt "$PROMPT" --max-new 300 --temperature 0.8 \
    --top-p 0.95 --seed 1 --threads 1
echo
say "done"
