#!/usr/bin/env bash
# Kill-and-resume soak (issue 25, Build item 4): the CI training config trained once
# uninterrupted, then RUNS times started, killed with SIGKILL at a random moment, and
# resumed with --resume until it is done; every run's final checkpoint (model.safetensors,
# train_state.safetensors, config.json: the bytes) and its logs (log.jsonl, evals.jsonl,
# stages.jsonl without the timing fields tok_per_s / mfu / *_s) must equal the
# uninterrupted run's. The resume contract is docs/training.md "Checkpoints and resume":
# the logs are cut back to the checkpoint's step and appended to, so after a resume they
# hold each step once.
#
#   scripts/soak.sh [RUNS]        (default 50)
#
# Kill moments: odd runs at a uniformly random time within the uninterrupted run's wall
# time (mostly during steps); even runs a random 0-70 ms after a random checkpoint's
# temporary directory (ckpt/.tmp-step-N) appears, so inside that checkpoint's write. Every
# run (the uninterrupted one too) has the test hook LINMOE_TEST_CKPT_PAUSE_US=20000
# (src/train/checkpoint.c: a 20 ms pause after the model file, after the train state and
# after the directory's rename, before `latest` is replaced), which widens the writes
# without changing what is written. The config is configs/tiny-train.json with
# checkpoint_every 1 (a write after every step), keep_last 2 and shorter evals
# (max_val_tokens 4096, passkey_samples 4). A kill before the first checkpoint leaves nothing to resume:
# the run is then started again from scratch, as a user would.
#
# Environment: LINMOE_BIN (default build/linmoe), SOAK_CONFIG (default
# configs/tiny-train.json), SOAK_DIR (work directory, default a mktemp -d, removed on
# success), SOAK_SEED (the kill moments' RNG seed, default 1).
# Exit status: 0 when every run matched, 1 otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS=${1:-50}
BIN=${LINMOE_BIN:-build/linmoe}
CONFIG=${SOAK_CONFIG:-configs/tiny-train.json}
RANDOM=${SOAK_SEED:-1}
[[ -x $BIN ]] || { echo "soak: $BIN not found (build first, or set LINMOE_BIN)" >&2; exit 1; }
W=${SOAK_DIR:-$(mktemp -d /tmp/linmoe-soak.XXXXXX)}
mkdir -p "$W"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} LINMOE_NO_BLAS_REEXEC=1 LINMOE_TEST_CKPT_PAUSE_US=20000

# the data: the Brown splits (scripts/fetch-data.sh) as byte-token shards, unless the
# config's shards exist
for s in train val; do
    [[ -f data/brown/$s.txt ]] || { echo "soak: no data/brown/$s.txt (run scripts/fetch-data.sh)" >&2; exit 1; }
    "$BIN" tokenize --tokenizer byte --in "data/brown/$s.txt" --out "$W/$s.bin" >/dev/null 2>&1 ||
        { echo "soak: tokenizing data/brown/$s.txt failed" >&2; exit 1; }
done
python3 - "$CONFIG" "$W/config.json" "$W" <<'EOF' || exit 1
import json, os, sys
c = json.load(open(sys.argv[1]))
for s in ("train", "val"):
    if not os.path.exists(c["data"][s]):
        c["data"][s] = os.path.join(sys.argv[3], s + ".bin")
c["train"]["checkpoint_every"] = 1
c["train"]["keep_last"] = 2
# shorter evals (the stage-end evals stay: a kill can land in one)
c["eval"]["max_val_tokens"] = 4096
c["eval"]["passkey_samples"] = 4
json.dump(c, open(sys.argv[2], "w"), indent=1)
EOF

# the logs without their timing fields, one canonical line per entry
canon() {
    python3 - "$1" <<'EOF'
import json, sys, os
d = sys.argv[1]
for f in ("log.jsonl", "evals.jsonl", "stages.jsonl"):
    p = os.path.join(d, f)
    if not os.path.exists(p):
        print(f, "missing")
        continue
    for line in open(p):
        j = json.loads(line)
        for k in list(j):
            if k in ("tok_per_s", "mfu", "ref_gflops") or k.endswith("_s") or k.endswith("_ms"):
                del j[k]
        print(f, json.dumps(j, sort_keys=True))
EOF
}

final_ckpt() { echo "$1/ckpt/$(tr -d '\n' <"$1/ckpt/latest" 2>/dev/null)"; }

same_run() { # ref run: 0 when equal, else prints the first difference
    local a b f
    a=$(final_ckpt "$W/ref") b=$(final_ckpt "$1")
    for f in model.safetensors train_state.safetensors config.json; do
        cmp -s "$a/$f" "$b/$f" || { echo "differs: $b/$f"; return 1; }
    done
    [[ $(basename "$a") == $(basename "$b") ]] || { echo "final step $(basename "$b")"; return 1; }
    diff <(canon "$W/ref") <(canon "$1") >"$1.logdiff" || { echo "log differs: $1.logdiff"; head -4 "$1.logdiff"; return 1; }
}

t0=$(date +%s.%N)
"$BIN" train --config "$W/config.json" --run-dir "$W/ref" >"$W/ref.out" 2>"$W/ref.err" ||
    { echo "soak: the uninterrupted run failed:"; tail "$W/ref.err"; exit 1; }
t1=$(date +%s.%N)
T=$(python3 -c "print($t1 - $t0)")
printf 'soak: uninterrupted run %.2f s (%s, %s), %d runs\n' "$T" "$CONFIG" "$BIN" "$RUNS"

pass=0 fail=0 in_write=0 in_step=0 fresh=0
for ((i = 1; i <= RUNS; i++)); do
    R=$W/run-$i msg=""
    "$BIN" train --config "$W/config.json" --run-dir "$R" >"$R.out" 2>"$R.err" &
    pid=$!
    if ((i % 2)); then
        d=$(python3 -c "import random; random.seed($RANDOM * 65536 + $RANDOM); print(random.uniform(0, 0.95 * $T))")
        sleep "$d"
        mode="t=${d:0:5}s"
    else
        # a random checkpoint (1..16): wait for its temporary directory to appear
        k=$((RANDOM % 16 + 1))
        tmpd=$(printf '%s/ckpt/.tmp-step-%07d' "$R" "$k")
        while kill -0 "$pid" 2>/dev/null && [[ ! -e $tmpd ]]; do sleep 0.001; done
        sleep "0.0$((RANDOM % 70))"
        mode="ckpt $k"
    fi
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    newest=$(ls "$R/ckpt" 2>/dev/null | grep '^step-' | sort | tail -1)
    if compgen -G "$R/ckpt/.tmp-step-*" >/dev/null ||
        [[ -n $newest && $(tr -d '\n' <"$R/ckpt/latest" 2>/dev/null) != "$newest" ]]; then
        in_write=$((in_write + 1)) where="in a checkpoint write"
    else
        in_step=$((in_step + 1)) where="between writes"
    fi
    # resume until done (one resume is expected to suffice; 3 tries at most)
    ok=0
    for ((n = 0; n < 3; n++)); do
        if [[ -e $R/ckpt/latest ]]; then
            "$BIN" train --run-dir "$R" --resume >>"$R.out" 2>>"$R.err" && { ok=1; break; }
        else
            fresh=$((fresh + 1))
            "$BIN" train --config "$W/config.json" --run-dir "$R" >>"$R.out" 2>>"$R.err" && { ok=1; break; }
        fi
    done
    if ((ok)) && msg=$(same_run "$R"); then
        pass=$((pass + 1))
        echo "run $i: pass (killed at $mode, $where)"
        rm -rf "$R" "$R.out" "$R.err" "$R.logdiff"
    else
        fail=$((fail + 1))
        echo "run $i: FAIL (killed at $mode, $where): ${msg:-resume failed: $(tail -1 "$R.err")}"
    fi
done
t2=$(date +%s.%N)
printf 'soak: %d/%d passed (%d killed inside a checkpoint write, %d between; %d restarted from scratch), %.0f s\n' \
    "$pass" "$RUNS" "$in_write" "$in_step" "$fresh" "$(python3 -c "print($t2 - $t0)")"
if ((fail == 0)) && [[ -z ${SOAK_DIR:-} ]]; then rm -rf "$W"; fi
((fail == 0))
