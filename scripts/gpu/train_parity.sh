#!/usr/bin/env bash
# The GPU trainer against the CPU trainer, and its resume (issue 22 "Correctness"), on the
# GPU machine after scripts/gpu/pack.sh here (carry build-gpu and data/brown):
#   scripts/gpu/train_parity.sh [STEPS]        (default 300)
# 1. configs/brown-cpu.json cut to its first stage, STEPS steps of 4096 tokens (packed
#    Brown documents, passkey rows), a short eval at the end: trained from the same seed
#    with --device cpu (all cores) and --device cuda; the mean training loss of the last
#    20 steps must agree within 2 %.
# 2. --device cuda to STEPS/2 with --max-steps, then --resume to STEPS: every logged loss
#    and grad norm of the resumed half must equal the straight run's, bit for bit.
# Logs and the summary (parity.json) go to $OUT/train_parity (or /tmp/train_parity).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh
STEPS="${1:-300}"
DIR="${OUT:-/tmp}/train_parity"
rm -rf "$DIR" && mkdir -p "$DIR"
python3 - "$STEPS" "$DIR/config.json" <<'PY'
import json, sys
steps, out = int(sys.argv[1]), sys.argv[2]
c = json.load(open("configs/brown-cpu.json"))
st = c["stages"][0]
st["tokens"] = steps * c["train"]["batch_tokens"]
c["stages"] = [st]
c["train"]["log_every"] = 1
c["train"]["checkpoint_every"] = 0
c["train"]["threads"] = 0
c["eval"] = {"seq_len": 0, "passkey_lengths": [256], "passkey_samples": 20,
             "passkey_seed": 1234, "max_val_tokens": 20000}
json.dump(c, open(out, "w"), indent=1)
PY
BIN=build-gpu/linmoe
for s in train val; do  # scripts/main-job.sh's byte-level shards
    [ -f "data/brown/$s.bin" ] || $BIN tokenize --tokenizer byte --in "data/brown/$s.txt" \
        --out "data/brown/$s.bin" > /dev/null
done
T0=$(date +%s.%N)
$BIN train --config "$DIR/config.json" --run-dir "$DIR/cpu" --device cpu --threads "$(nproc)" \
    > "$DIR/cpu.json" 2> "$DIR/cpu.log" || { tail -5 "$DIR/cpu.log"; exit 1; }
T1=$(date +%s.%N)
$BIN train --config "$DIR/config.json" --run-dir "$DIR/cuda" --device cuda \
    > "$DIR/cuda.json" 2> "$DIR/cuda.log" || { tail -5 "$DIR/cuda.log"; exit 1; }
T2=$(date +%s.%N)
HALF=$((STEPS / 2))
$BIN train --config "$DIR/config.json" --run-dir "$DIR/resume" --device cuda \
    --max-steps "$HALF" > /dev/null 2> "$DIR/resume1.log" || { tail -5 "$DIR/resume1.log"; exit 1; }
$BIN train --run-dir "$DIR/resume" --resume --device cuda > /dev/null \
    2> "$DIR/resume2.log" || { tail -5 "$DIR/resume2.log"; exit 1; }
python3 - "$DIR" "$STEPS" "$T0" "$T1" "$T2" <<'PY'
import json, sys
d, steps = sys.argv[1], int(sys.argv[2])
t0, t1, t2 = map(float, sys.argv[3:6])
def log(run):
    return [json.loads(l) for l in open(f"{d}/{run}/log.jsonl")]
cpu, gpu, res = log("cpu"), log("cuda"), log("resume")
tail = lambda L: sum(r["loss"] for r in L[-20:]) / 20
lc, lg = tail(cpu), tail(gpu)
rel = abs(lg - lc) / lc
half = steps // 2
same = [(a["step"], a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"])
        for a, b in zip(gpu[half:], res[half:])]
n_same = sum(1 for _, s in same if s)
first_diff = next((s for s, ok in same if not ok), None)
out = {"steps": steps, "cpu_last20_loss": lc, "cuda_last20_loss": lg, "rel_diff": rel,
       "cpu_seconds": t1 - t0, "cuda_seconds": t2 - t1,
       "resume_steps_compared": len(same), "resume_bit_exact_steps": n_same,
       "resume_first_diff_step": first_diff,
       "cuda_final_eval": json.load(open(f"{d}/cuda.json")),
       "cpu_final_eval": json.load(open(f"{d}/cpu.json"))}
json.dump(out, open(f"{d}/parity.json", "w"), indent=1)
print(json.dumps(out, indent=1))
ok = rel <= 0.02 and n_same == len(same) and len(same) > 0
print("train parity:", "PASS" if ok else "FAIL",
      f"(loss rel diff {rel:.4f} <= 0.02; resume {n_same}/{len(same)} steps bit-exact)")
sys.exit(0 if ok else 1)
PY
