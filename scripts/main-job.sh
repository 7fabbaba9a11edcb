#!/usr/bin/env bash
# linmoe's main job (the README's first command): install what is missing, fetch the
# Brown corpus, build, tokenize, train configs/brown-cpu.json (hybrid KDA/attention MoE,
# bounded gate, aux-loss-free balancing, Block AttnRes; three stages at 4096 tokens per
# step: 5 M tokens at 256 with 40 % passkey rows of 128 tokens, then 1.7 M + 1.7 M tokens
# at 1024 with RoPE base 10k -> 40k, 60 % passkey rows (512 tokens long, then full length)
# and 25 % long-document rows), evaluate, plot and print a generated sample.
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

say "eval (held-out Brown split under the pinned protocol; the trainer's stage-end evals incl. passkey are in $RUN/evals.jsonl)"
seq=$(python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if l.strip()][-1]["seq_len"])' "$RUN/evals.jsonl")
build/linmoe eval --ckpt "$ckpt" --val data/brown/val.bin --seq-len "$seq" --passkey-lengths none \
    --threads "$THREADS" --json "$RUN/eval.json" >/dev/null
python3 - "$RUN" <<'EOF'
import json, sys
run = sys.argv[1]
e = json.load(open(run + "/eval.json"))
print("bits per byte (Brown val, %d bytes, windows of %d tokens): %.4f" % (e["bytes"], e["seq_len"], e["bits_per_byte"]))
for v in [json.loads(l) for l in open(run + "/evals.jsonl") if l.strip()]:
    pk = ", ".join("%d tokens: %.3f" % (p["length"], p["accuracy"]) for p in v.get("passkey", []))
    print("  trainer eval after step %d (end of stage %s): bits/byte %.4f; passkey accuracy {%s}"
          % (v["step"], v.get("stage_name", v["stage"]), v["bits_per_byte"], pk))
steps = [json.loads(l) for l in open(run + "/log.jsonl") if l.strip()]
last = [s for s in steps[-50:] if s.get("moe")]
if last:
    for i, m in enumerate(last[-1]["moe"]):
        mv = sum(s["moe"][i]["maxvio_batch"] for s in last) / len(last)
        dead = max(s["moe"][i]["n_dead"] for s in last)
        print("  MoE layer %d: maxvio_batch mean over the last %d steps %.3f, dead experts %d"
              % (m["layer"], len(last), mv, dead))
if len(steps) > 1:
    print("  tokens per step %d; training tokens/s %.0f (mean over steps)"
          % (steps[-1]["tokens"] - steps[-2]["tokens"], sum(s["tok_per_s"] for s in steps) / len(steps)))
for a in e.get("attnres", [])[-1:]:
    print("  AttnRes final aggregation, mean weight per source (embedding, blocks...): "
          + ", ".join("%.3f" % w for w in a["weights"]))
EOF

say "plots"
build/linmoe plot "$RUN"

say "sample"
build/linmoe generate --ckpt "$ckpt" --prompt "$PROMPT" --max-new 300 --temperature 0.8 \
    --top-p 0.95 --seed 1 --threads 1
say "done"
