#!/usr/bin/env bash
# linmoe's GPU main job: configs/gpu-main.json (hybrid KDA / attention MoE, bounded gate,
# aux-loss-free balancing, Block AttnRes; context stages 2048 -> 8192 with passkey
# documents) trained on the Linux 6.1 subset of `scripts/fetch-data.sh --gpu` in one
# 10-minute call on one H200. Two halves, because the GPU machine has no network and
# receives at most 64 MiB:
#
#   scripts/main-job-gpu.sh pack [--dry-run]   HERE: build (scripts/gpu/pack.sh) when
#       build-gpu/ is older than the sources, then write gpu-carry/main-job.tar.gz: the
#       CLI and the libraries it loads (xz -9), the corpus archive, its manifest and the
#       GPT-2 BPE files. Prints the sizes and the device-tool call.
#   scripts/main-job-gpu.sh run [--dry-run]    THERE (device tool: carry
#       ["gpu-carry/main-job.tar.gz"]): unpack, tokenize (the command recorded in
#       data/linux/manifest.json), calibrate, train with --device cuda, evaluate, plot
#       when gnuplot is there, print a sample, write a summary; all inside BUDGET_S.
#   scripts/main-job-gpu.sh plots DIR          HERE, afterwards: unpack DIR/run.tar.gz
#       (what `run` left in $OUT, as the device tool returned it) into RUN and
#       draw the plots with `linmoe plot` (the GPU image has no gnuplot).
#
# The `run` half, step by step:
#  1. unpack the carry, extract the corpus subset (sha256 checked against the manifest);
#  2. tokenize it with GPT-2 BPE into data/linux/tok/{train,val}.json, the held-out split
#     by file (its counts checked against the manifest);
#  3. calibrate: start `linmoe train` on a copy of the config with train.eval_every =
#     CALIB_EVAL_AT, wait for CALIB_STEPS logged steps, stop it (no checkpoint is written):
#     the steady tokens/s, the start-up time and the time of one full eval;
#  4. plan: scale every stage's token budget by one factor so that the training steps
#     take what is left of BUDGET_S after start-up, one eval per stage (the measured one
#     plus 20 %) and 90 s for the steps after training, at most TRAIN_MAX_S; a stage at
#     another seq_len is costed by the model's FLOPs per token there
#     (lm_model_train_flops_per_token) over the measured rate, plus 15 %. The scaled
#     config goes to RUN-plan.json, the numbers to RUN-plan-info.json;
#  5. train it from scratch (`timeout` guards the deadline); the trainer's stage-end
#     evals run on the GPU: bits per byte on the whole held-out split under the pinned
#     protocol (windows of the last stage's 8192 tokens) and passkey accuracy at 2048 and
#     8192 tokens (200 samples each);
#  6. a CPU cross-check of the final checkpoint (`linmoe eval`) on CHECK_TOKENS tokens of
#     held-out files, beside `xz -9e` on the same files; plots; a sample (`linmoe generate`);
#  7. summary.json: training, the evals against the manifest's xz -9e baseline, the MoE
#     balance over the last 50 steps, the acceptance checks of issue 22, the timings.
#     $OUT (the device tool's return folder; else RUN-out/) receives summary.json,
#     main-job-gpu.log (the console) and run.tar.gz (the run without its weights).
#
# Environment (run): CONFIG (configs/gpu-main.json), RUN (runs/gpu-main; deleted and made
# again: every run starts over), DEVICE (cuda; cpu works for a smoke test), BUDGET_S
# (575: seconds from the start of `run` to its end), TRAIN_MAX_S (480), CALIB_STEPS (18),
# CALIB_EVAL_AT (10), CALIB_TIMEOUT_S (180), CHECK_TOKENS (32768; 0 skips the CPU check),
# THREADS (all cores), PROMPT, PACK (gpu-carry/main-job.tar.gz), WORK (where the carry is
# unpacked and the job runs; default the repository root), LINMOE (the CLI; default
# WORK/build-gpu/linmoe, with scripts/gpu/libpath.sh). Environment (pack): LINMOE_GPU_DIR
# (build-gpu), PACK_OUT (gpu-carry/main-job.tar.gz).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

DRY=0
T0=$(date +%s)
say() { printf '\n== %s (%ds)\n' "$*" "$(($(date +%s) - T0))"; }
die() { printf 'main-job-gpu: %s\n' "$*" >&2; exit 1; }
# x CMD...: run CMD, or with --dry-run print it (shell-quoted) instead
x() {
    if ((DRY)); then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
note() { if ((DRY)); then printf '+ # %s\n' "$*"; fi; }
# extract_txz ARCHIVE DIR: tar -xJf when xz is installed, else Python's lzma
extract_txz() {
    if command -v xz >/dev/null 2>&1; then
        x tar -xJf "$1" -C "$2"
    else
        x python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$1" "$2"
    fi
}
mib() { python3 -c 'import sys; print("%.2f MiB" % (int(sys.argv[1]) / 2**20))' "$1"; }

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ------------------------------------------------------------------------------ pack
do_pack() {
    local GPU="${LINMOE_GPU_DIR:-build-gpu}" OUTF="${PACK_OUT:-gpu-carry/main-job.tar.gz}"
    local LIMIT=$((64 * 1024 * 1024))
    say "build ($GPU)"
    local stale=""
    if [[ ! -x "$GPU/linmoe" ]]; then
        stale="no $GPU/linmoe"
    else
        stale="$(find src include tools CMakeLists.txt -newer "$GPU/linmoe" -type f -print -quit)"
    fi
    if [[ -n "$stale" ]]; then
        echo "stale ($stale): scripts/gpu/pack.sh"
        x env LINMOE_GPU_DIR="$GPU" scripts/gpu/pack.sh
    else
        echo "$GPU/linmoe is newer than src/ include/ tools/ CMakeLists.txt: not rebuilt"
    fi

    say "data"
    local f
    for f in data/linux/linux-subset.tar.xz data/linux/manifest.json data/linux/val-files.txt \
        data/gpt2/vocab.json data/gpt2/merges.txt; do
        [[ -f "$f" ]] || die "$f is missing: run scripts/fetch-data.sh --gpu first"
    done
    local want have
    want="$(python3 -c 'import json; print(json.load(open("data/linux/manifest.json"))["archive"]["sha256"])')"
    have="$(sha256sum data/linux/linux-subset.tar.xz | cut -d' ' -f1)"
    [[ "$want" == "$have" ]] || die "data/linux/linux-subset.tar.xz: sha256 $have, manifest says $want"
    echo "data/linux/linux-subset.tar.xz: sha256 matches the manifest ($(mib "$(stat -c %s data/linux/linux-subset.tar.xz)"))"

    say "archive -> $OUTF"
    local stage
    stage="$(mktemp -d /tmp/main-job-gpu-pack.XXXXXX)"
    # shellcheck disable=SC2064
    trap "rm -rf '$stage'" EXIT
    # the binaries travel as build-gpu/main-job-bins.tar.xz (build-gpu/linmoe, build-gpu/lib/)
    x mkdir -p "$stage/bins/build-gpu/lib" "$stage/build-gpu" "$(dirname "$OUTF")"
    x cp "$GPU/linmoe" "$stage/bins/build-gpu/"
    x cp -r "$GPU/lib/." "$stage/bins/build-gpu/lib/"
    if ((DRY)); then
        printf '+ tar -C %q -cf - build-gpu | xz -9 -T0 > %q\n' "$stage/bins" "$stage/build-gpu/main-job-bins.tar.xz"
    else
        tar -C "$stage/bins" --sort=name --owner=0 --group=0 --numeric-owner -cf - build-gpu |
            xz -9 -T0 >"$stage/build-gpu/main-job-bins.tar.xz"
    fi
    local commit dirty
    commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
    dirty="$(git status --porcelain --untracked-files=no -- src include tools CMakeLists.txt 2>/dev/null | wc -l)"
    if ! ((DRY)); then
        python3 - "$stage" "$commit" "$dirty" "$GPU" <<'PY'
import json, os, sys, time
stage, commit, dirty, gpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
files = {}
for root, _, names in os.walk(os.path.join(stage, "bins", "build-gpu")):
    for n in sorted(names):
        p = os.path.join(root, n)
        files[os.path.relpath(p, os.path.join(stage, "bins"))] = os.path.getsize(p)
json.dump({"made_by": "scripts/main-job-gpu.sh pack", "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": commit, "sources_modified_since_commit": dirty, "build_dir": gpu,
           "binaries": files,
           "main-job-bins.tar.xz": os.path.getsize(os.path.join(stage, "build-gpu", "main-job-bins.tar.xz"))},
          open(os.path.join(stage, "build-gpu", "main-job-pack.json"), "w"), indent=1)
PY
    fi
    x tar -czf "$OUTF" -C "$stage" build-gpu/main-job-bins.tar.xz build-gpu/main-job-pack.json -C "$REPO" \
        data/linux/linux-subset.tar.xz data/linux/manifest.json data/linux/val-files.txt \
        data/gpt2/vocab.json data/gpt2/merges.txt
    ((DRY)) && return 0

    say "sizes"
    local bins carry tree total
    bins=$(stat -c %s "$stage/build-gpu/main-job-bins.tar.xz")
    carry=$(stat -c %s "$OUTF")
    tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    local untracked
    untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
        awk '{s += $1} END {print s + 0}')
    total=$((carry + tree + untracked))
    echo "binaries (build-gpu/linmoe + lib/, xz -9): $(mib "$bins")"
    echo "carry $OUTF: $(mib "$carry")"
    echo "tracked files: $(mib "$tree"); untracked, not ignored: $(mib "$untracked")"
    echo "what travels in all: $(mib "$total") of 64 MiB"
    ((total <= LIMIT)) || die "$(mib "$total") is over the device tool's 64 MiB"
    cat <<EOF

Device tool call (one H200, one call of at most 10 minutes):
  run(kind="nvidia-h200", timeout_s=600, carry=["$OUTF"],
      command="bash scripts/main-job-gpu.sh run")
Afterwards, here: scripts/main-job-gpu.sh plots DIR   (DIR: the returned files; draws the plots from the returned run.tar.gz)
EOF
}

# ------------------------------------------------------------------------------ run
do_run() {
    local WORK="${WORK:-$REPO}"
    local CONFIG="${CONFIG:-configs/gpu-main.json}" RUN="${RUN:-runs/gpu-main}"
    [[ "$CONFIG" == /* ]] || CONFIG="$REPO/$CONFIG"
    local DEVICE="${DEVICE:-cuda}" BUDGET_S="${BUDGET_S:-575}" TRAIN_MAX_S="${TRAIN_MAX_S:-480}"
    local CALIB_STEPS="${CALIB_STEPS:-18}" CALIB_EVAL_AT="${CALIB_EVAL_AT:-10}"
    local CHECK_TOKENS="${CHECK_TOKENS:-32768}"
    local THREADS="${THREADS:-$(nproc)}"
    local PROMPT="${PROMPT:-}"
    [[ -n "$PROMPT" ]] || PROMPT=$'#include <linux/kernel.h>\n#include <linux/slab.h>\n\nstatic int '
    local PACK="${PACK:-gpu-carry/main-job.tar.gz}"
    [[ "$PACK" == /* ]] || PACK="$REPO/$PACK"
    local DEADLINE=$((T0 + BUDGET_S))
    local RES="${OUT:-}"
    mkdir -p "$WORK"
    cd "$WORK"
    [[ -n "$RES" ]] || RES="$WORK/$RUN-out"
    [[ "$RES" == /* ]] || RES="$WORK/$RES"
    local LM="${LINMOE:-build-gpu/linmoe}"
    local CAL="$RUN-calib" PLANCFG="$RUN-plan.json" PLANINFO="$RUN-plan-info.json"
    local TIMES="$RUN-times.txt"
    left() { echo $((DEADLINE - $(date +%s))); }
    phase() { ((DRY)) || echo "$1 $(($(date +%s) - T0))" >>"$TIMES"; }

    ((DRY)) || { rm -rf "$RUN" "$CAL" "$PLANCFG" "$PLANINFO" "$TIMES" "$RES/run.tar.gz" "$RES/summary.json"
                 mkdir -p "$(dirname "$RUN")" "$RES"; phase start; }
    echo "main-job-gpu run: work dir $WORK, config $CONFIG, run $RUN, device $DEVICE, budget ${BUDGET_S}s, results -> $RES"

    say "unpack"
    if [[ -f "$PACK" ]]; then
        x tar -xzf "$PACK" -C "$WORK"
        extract_txz build-gpu/main-job-bins.tar.xz .
        if ! ((DRY)); then
            python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); print("packed", p["made"], "from commit", p["commit"], "(%d source files modified since)" % p["sources_modified_since_commit"])' build-gpu/main-job-pack.json || true
        fi
    else
        echo "no $PACK: using $LM and data/ as they are"
    fi
    ((DRY)) || [[ -x "$LM" ]] || die "$LM is missing (run scripts/main-job-gpu.sh pack here, carry its archive)"
    if [[ -z "${LINMOE:-}" ]]; then
        if ((DRY)); then
            echo "+ source scripts/gpu/libpath.sh"
        else
            LINMOE_GPU_DIR=build-gpu
            # shellcheck source=scripts/gpu/libpath.sh
            source "$REPO/scripts/gpu/libpath.sh"
        fi
    fi
    ((DRY)) || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    if [[ ! -d data/linux/subset ]]; then
        if ! ((DRY)); then
            local want have
            want="$(python3 -c 'import json; print(json.load(open("data/linux/manifest.json"))["archive"]["sha256"])')"
            have="$(sha256sum data/linux/linux-subset.tar.xz | cut -d' ' -f1)"
            [[ "$want" == "$have" ]] || die "data/linux/linux-subset.tar.xz: sha256 $have, the manifest says $want"
        fi
        x rm -rf data/linux/.subset-tmp
        x mkdir -p data/linux/.subset-tmp
        extract_txz data/linux/linux-subset.tar.xz data/linux/.subset-tmp
        x mv data/linux/.subset-tmp/subset data/linux/subset
        x rmdir data/linux/.subset-tmp
    else
        echo "data/linux/subset exists: not extracted again"
    fi
    phase unpack

    say "tokenize (data/linux/manifest.json's command, $THREADS threads)"
    local tokcmd
    if ((DRY)) && [[ ! -f data/linux/manifest.json ]]; then
        tokcmd="linmoe tokenize --tokenizer gpt2 --out-dir data/linux/tok --val-fraction 0.01 --split-seed 0 data/linux/subset"
    else
        tokcmd="$(python3 -c 'import json; print(json.load(open("data/linux/manifest.json"))["tokenize"])')"
    fi
    [[ "$tokcmd" == "linmoe tokenize "* ]] || die "data/linux/manifest.json: unexpected tokenize command '$tokcmd'"
    # shellcheck disable=SC2206
    local targs=(${tokcmd#linmoe })
    x "$LM" "${targs[@]}" --threads "$THREADS"
    if ! ((DRY)); then
        python3 - <<'PY' || die "the tokenized split does not match data/linux/manifest.json"
import json, sys
m = json.load(open("data/linux/manifest.json"))["held_out"]
v = json.load(open("data/linux/tok/val.json"))["held_out"]
ok = (v["val"]["sources"] == m["val"]["files"] and v["val"]["bytes"] == m["val"]["bytes"]
      and v["train"]["sources"] == m["train"]["files"] and v["train"]["bytes"] == m["train"]["bytes"])
print("held-out split: %d files, %d bytes, %d tokens; train %d files, %d tokens: %s"
      % (v["val"]["sources"], v["val"]["bytes"], v["val"]["tokens"], v["train"]["sources"],
         v["train"]["tokens"], "as in the manifest" if ok else "DIFFERS from the manifest"))
sys.exit(0 if ok else 1)
PY
    fi
    phase tokenize

    say "calibrate: $CALIB_STEPS steps of $CONFIG with one eval after step $CALIB_EVAL_AT"
    local t_launch t_first="" n=0 pid rc=0 calcfg="$CAL-config.json"
    if ((DRY)); then
        note "python3: $CONFIG with train.eval_every = $CALIB_EVAL_AT -> $calcfg"
        x "$LM" train --config "$calcfg" --run-dir "$CAL" --device "$DEVICE" --threads "$THREADS" --max-steps $((CALIB_STEPS + 100))
        note "in the background; stopped (kill PID) once $CAL/log.jsonl holds $CALIB_STEPS steps"
    else
        python3 - "$CONFIG" "$calcfg" "$CALIB_EVAL_AT" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["train"]["eval_every"] = int(sys.argv[3])  # one eval (the run stops before the second)
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
        t_launch=$(date +%s.%N)
        "$LM" train --config "$calcfg" --run-dir "$CAL" --device "$DEVICE" --threads "$THREADS" \
            --max-steps $((CALIB_STEPS + 100)) >"$CAL.out" 2>&1 &
        pid=$!
        local limit=$(($(date +%s) + ${CALIB_TIMEOUT_S:-180}))
        while :; do
            n=0
            [[ -f "$CAL/log.jsonl" ]] && n=$(wc -l <"$CAL/log.jsonl")
            if ((n > 0)) && [[ -z "$t_first" ]]; then t_first=$(date +%s.%N); fi
            ((n >= CALIB_STEPS)) && break
            kill -0 "$pid" 2>/dev/null || break
            (($(date +%s) < limit)) || break
            sleep 0.25
        done
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || rc=$?
        grep -v '^step ' "$CAL.out" | head -20
        ((n >= CALIB_EVAL_AT + 3)) || { tail -20 "$CAL.out"; die "calibration: only $n steps logged (exit $rc)"; }
        grep -q '^eval at step' "$CAL.out" || { tail -20 "$CAL.out"; die "calibration: the eval after step $CALIB_EVAL_AT did not run"; }
        [[ -n "$t_first" ]] || t_first=$(date +%s.%N)
        echo "calibration: $n steps logged; the first $(python3 -c "print('%.1f' % ($t_first - $t_launch))") s after launch"
    fi
    phase calibrate

    say "plan: stage budgets for the time that is left"
    if ((DRY)); then
        note "python3: tokens/s = median of $CAL/log.jsonl steps 4..$CALIB_STEPS; scale every stage's tokens to fit; write $PLANCFG and $PLANINFO"
    else
        python3 - "$CONFIG" "$CAL/log.jsonl" "$PLANCFG" "$PLANINFO" "$(python3 -c "print($t_first - $t_launch)")" \
            "$(left)" "$TRAIN_MAX_S" "$CHECK_TOKENS" "$CAL.out" "$CALIB_EVAL_AT" <<'PY' || die "plan failed"
import json, re, statistics, sys
cfg_path, log_path, out_cfg, out_info = sys.argv[1:5]
startup, left, train_max, check_tokens = float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8])
cal_out, eval_at = sys.argv[9], int(sys.argv[10])
c = json.load(open(cfg_path))
m = c["model"] if isinstance(c["model"], dict) else json.load(open(c["model"]))

def fpt(m, T):
    """lm_model_train_flops_per_token (src/model/model.c), per token at seq_len T."""
    d, V, L = m["hidden_size"], m["vocab_size"], m["num_hidden_layers"]
    lac = m.get("linear_attn_config", {})
    kda = set(lac.get("kda_layers", []))
    mm, extra = float(V * d), 0.0
    for i in range(L):
        if (i + 1) in kda:
            H, Dh = lac["num_heads"], lac["head_dim"]
            HD = H * Dh
            mm += 3 * HD * d + Dh * d + HD * Dh + H * d + Dh * d + HD * Dh + d * HD
            Cc, dk, dv = lac.get("chunk_size", 64), Dh, Dh
            extra += H * (6 * dk * dv + Cc * (6 * dk + 4 * dv) + 16 * dk * dv + Cc * (12 * dk + 10 * dv) + 4 * Cc * Cc)
        else:
            Hq, Hkv, D = m["num_attention_heads"], m.get("num_key_value_heads", m["num_attention_heads"]), m["head_dim"]
            mm += (Hq * D + 2 * Hkv * D) * d + d * Hq * D
            extra += 6.0 * T * Hq * D
        if i < m.get("first_k_dense_replace", 0) or m.get("num_experts", 0) == 0:
            mm += 3.0 * m["intermediate_size"] * d
        else:
            E, k, f, ns = m["num_experts"], m["num_experts_per_tok"], m["moe_intermediate_size"], m.get("n_shared_experts", 0)
            mm += E * d + k * 3 * f * d + ns * 3 * f * d
    return 6 * mm + extra

steps = []
for l in open(log_path):
    try:
        steps.append(json.loads(l))
    except ValueError:
        pass  # a line cut short when the calibration run was stopped
# steady state: from step 4 on, leaving out the step after the eval
rates = [s["tok_per_s"] for s in steps[3:] if not s.get("skipped") and s["step"] != eval_at + 1]
rates = rates or [s["tok_per_s"] for s in steps]
evals_s = [float(x) for x in re.findall(r"^eval at step \d+ .*\(([0-9.]+) s\)$", open(cal_out).read(), re.M)]
rate = statistics.median(rates)
tr = c["train"]
stages = c["stages"]
T1 = stages[0]["seq_len"]
MARGIN = 1.15  # an unmeasured seq_len: its FLOPs at the measured rate, plus 15 %
def step_tokens(st):
    return tr["batch_tokens"] if "batch_tokens" in tr else tr["batch_size"] * st["seq_len"]
sec_per_tok = []
for st in stages:
    r = fpt(m, st["seq_len"]) / fpt(m, T1) / rate
    sec_per_tok.append(r * (MARGIN if st["seq_len"] != T1 else 1.0))
nominal = sum(st["tokens"] * s for st, s in zip(stages, sec_per_tok))
# the stage-end evals: as long as the calibration's eval, plus 20 % (the eval at the
# long stages' rope_theta does the same work)
eval_s = 1.2 * max(evals_s) + 2.0
n_evals = len(stages)
# after training: the final checkpoint (12 bytes per parameter at ~0.5 GB/s), the CPU
# check, the sample, plots, summary and the results archive, and a safety margin
post_s = 90.0 if check_tokens > 0 else 60.0
avail = min(train_max, left - startup - n_evals * eval_s - post_s)
if avail < 30:
    sys.exit("plan: only %.0f s would be left for training (left %.0f s, start-up %.0f s, evals %d x %.0f s, after %.0f s)"
             % (avail, left, startup, n_evals, eval_s, post_s))
scale = avail / nominal
plan = []
for st, s in zip(stages, sec_per_tok):
    stt = step_tokens(st)
    n = max(1, int(st["tokens"] * scale // stt))
    w0 = st.get("warmup_steps", 0)
    st["tokens"] = n * stt
    if w0 > n // 4:
        st["warmup_steps"] = n // 4
    plan.append({"name": st["name"], "seq_len": st["seq_len"], "steps": n, "tokens": n * stt,
                 "warmup_steps": st.get("warmup_steps", 0), "est_seconds": round(n * stt * s, 1),
                 "est_tokens_per_s": round(1 / s)})
json.dump(c, open(out_cfg, "w"), indent=1)
info = {"measured_tokens_per_s": rate, "measured_steps": len(steps), "measured_seq_len": T1,
        "startup_s": round(startup, 1), "seconds_left_at_plan": left,
        "calibration_eval_s": evals_s, "eval_s_each": round(eval_s, 1),
        "n_evals": n_evals, "after_training_s": post_s, "train_s_planned": round(avail, 1),
        "scale": scale, "flops_per_token": {str(st["seq_len"]): fpt(m, st["seq_len"]) for st in stages},
        "stages": plan}
json.dump(info, open(out_info, "w"), indent=1)
print("measured %.0f tokens/s at seq_len %d (median of %d steps); start-up %.1f s; an eval %.1f s"
      % (rate, T1, len(rates), startup, max(evals_s)))
print("time left %.0f s: start-up %.0f + %d evals x %.0f + after training %.0f -> %.0f s of training (cap %.0f); scale %.3f"
      % (left, startup, n_evals, eval_s, post_s, avail, train_max, scale))
for p in plan:
    print("  stage %-10s seq %5d: %5d steps, %11d tokens, warmup %3d, ~%5.1f s (%.0f tokens/s)"
          % (p["name"], p["seq_len"], p["steps"], p["tokens"], p["warmup_steps"], p["est_seconds"], p["est_tokens_per_s"]))
print("  total %d tokens" % sum(p["tokens"] for p in plan))
PY
    fi
    ((DRY)) || rm -rf "$CAL" "$CAL.out" "$CAL-config.json"
    phase plan

    say "train $PLANCFG -> $RUN (device $DEVICE)"
    local tlim train_rc=0
    tlim=$(($(left) - 45))
    ((DRY)) && tlim="{seconds left - 45}"
    if ((DRY)); then
        printf '+ timeout --kill-after=10 %s %q train --config %q --run-dir %q --device %q --threads %q > %q\n' \
            "$tlim" "$LM" "$PLANCFG" "$RUN" "$DEVICE" "$THREADS" "$RUN/train-summary.json"
    else
        mkdir -p "$RUN"
        timeout --kill-after=10 "$tlim" "$LM" train --config "$PLANCFG" --run-dir "$RUN" \
            --device "$DEVICE" --threads "$THREADS" >"$RUN/train-summary.json" || train_rc=$?
        echo "train exit status $train_rc$( ((train_rc == 124 || train_rc == 137)) && echo ' (stopped by the deadline)')"
        cat "$RUN/train-summary.json"
    fi
    ((DRY)) || echo "$train_rc" >"$RUN/train-rc.txt"
    phase train

    local have_ckpt=0
    [[ -f "$RUN/ckpt/latest" ]] && have_ckpt=1
    # the bits-per-byte window: eval.seq_len, else the last stage's seq_len (train.h)
    local EVAL_SEQ
    EVAL_SEQ="$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c.get("eval", {}).get("seq_len") or c["stages"][-1]["seq_len"])' "$CONFIG")"
    if ((CHECK_TOKENS > 0)); then
        say "CPU cross-check: linmoe eval on ~$CHECK_TOKENS tokens of held-out files, xz -9e on the same files"
        if ((DRY)); then
            note "python3: every 10th source of data/linux/tok/val.json until $CHECK_TOKENS tokens -> data/linux/check-files.txt; xz -9e of their concatenation"
            x "$LM" tokenize --tokenizer gpt2 --out-dir data/linux/tok-check --quiet "data/linux/subset/FILE..."
            x timeout "{seconds left - 60}" "$LM" eval --ckpt "$RUN" --val data/linux/tok-check/train.json --seq-len "$EVAL_SEQ" \
                --passkey-lengths none --threads "$THREADS" --json "$RUN/eval-check.json"
        elif ((have_ckpt)) && (($(left) > 90)); then
            rm -f data/linux/check-files.txt
            python3 - "$CHECK_TOKENS" "$RUN/check-xz.json" <<'PY' || echo "check: file selection failed"
import json, lzma, os, shutil, subprocess, sys
want, out = int(sys.argv[1]), sys.argv[2]
src = json.load(open("data/linux/tok/val.json"))["sources"]
pick, tok = [], 0
for s in src[::10]:
    if tok >= want:
        break
    pick.append(s["path"]); tok += s["tokens"]
open("data/linux/check-files.txt", "w").write("".join(p + "\n" for p in pick))
raw = b"".join(open(os.path.join("data/linux/subset", p), "rb").read() for p in pick)
if shutil.which("xz"):
    comp = len(subprocess.run(["xz", "-9e", "-T1", "-c"], input=raw, capture_output=True, check=True).stdout)
    tool = subprocess.run(["xz", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
else:
    comp = len(lzma.compress(raw, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME))
    tool = "python lzma preset 9e"
json.dump({"files": len(pick), "tokens": tok, "raw_bytes": len(raw), "xz_bytes": comp,
           "xz_bits_per_byte": comp * 8 / len(raw), "xz": tool}, open(out, "w"), indent=1)
print("check set: %d held-out files (every 10th), %d tokens, %d bytes; xz -9e: %.4f bits per byte"
      % (len(pick), tok, len(raw), comp * 8 / len(raw)))
PY
            if [[ -f data/linux/check-files.txt ]]; then
                local files=()
                mapfile -t files < <(sed 's|^|data/linux/subset/|' data/linux/check-files.txt)
                "$LM" tokenize --tokenizer gpt2 --out-dir data/linux/tok-check --quiet "${files[@]}" || true
                timeout $(($(left) - 60)) "$LM" eval --ckpt "$RUN" --val data/linux/tok-check/train.json \
                    --seq-len "$EVAL_SEQ" --passkey-lengths none --threads "$THREADS" \
                    --json "$RUN/eval-check.json" >/dev/null || echo "check: linmoe eval failed or ran out of time"
            fi
        else
            echo "skipped (checkpoint: $have_ckpt, $(left) s left)"
        fi
        phase check
    fi

    say "plots"
    if command -v gnuplot >/dev/null 2>&1; then
        x "$LM" plot "$RUN" || echo "plot failed"
    else
        echo "no gnuplot on this machine: plots skipped here (scripts/main-job-gpu.sh plots DIR draws them from run.tar.gz)"
        ((DRY)) || echo "skipped: no gnuplot on the GPU machine" >"$RUN/plots-status.txt"
    fi
    phase plots

    say "sample"
    if ((DRY)); then
        x timeout "{seconds left - 20}" "$LM" generate --ckpt "$RUN" --prompt "$PROMPT" --max-new 200 --temperature 0.8 --top-p 0.95 --seed 1 --threads "$THREADS"
    elif ((have_ckpt)) && (($(left) > 40)); then
        timeout $(($(left) - 20)) "$LM" generate --ckpt "$RUN" --prompt "$PROMPT" --max-new 200 \
            --temperature 0.8 --top-p 0.95 --seed 1 --threads "$THREADS" >"$RUN/sample.txt" ||
            echo "generate failed or ran out of time"
        cat "$RUN/sample.txt"
        echo
    else
        echo "skipped (checkpoint: $have_ckpt, $(left) s left)"
    fi
    phase sample

    say "summary -> $RES"
    if ((DRY)); then
        note "python3: $RES/summary.json from data/linux/manifest.json, $PLANINFO, $RUN/{train-summary.json,log.jsonl,evals.jsonl,stages.jsonl,eval-check.json,sample.txt}"
        x tar -czf "$RES/run.tar.gz" --exclude='*.safetensors' "$RUN" "$PLANCFG" "$PLANINFO"
        return 0
    fi
    phase end
    local model_info=""
    if [[ -f "$RUN/ckpt/latest" ]]; then
        model_info="$("$LM" info "$RUN" 2>/dev/null | grep '^parameters:' || true)"
    fi
    python3 - "$RUN" "$PLANCFG" "$PLANINFO" "$TIMES" "$RES/summary.json" "$BUDGET_S" "$model_info" \
        "$DEVICE" <<'PY' || echo "summary failed"
import json, os, re, subprocess, sys
run, plancfg, planinfo, times, out, budget, model_info, device = sys.argv[1:9]
def jl(p):
    out = []
    try:
        for l in open(p):
            try:
                out.append(json.loads(l))
            except ValueError:
                pass  # a line cut short by the deadline's kill
    except OSError:
        pass
    return out
def jf(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None
man = json.load(open("data/linux/manifest.json"))
base = man["baseline_xz"]["bits_per_byte"]
cfg = jf(plancfg) or {}
t = {}
for l in open(times):
    k, v = l.split()
    t[k] = int(v)
order = [k for k in ["start", "unpack", "tokenize", "calibrate", "plan", "train", "check", "plots", "sample", "end"] if k in t]
phases = {b: t[b] - t[a] for a, b in zip(order, order[1:])}
steps = [s for s in jl(run + "/log.jsonl")]
evals = jl(run + "/evals.jsonl")
stages = jl(run + "/stages.jsonl")
ts = None
try:
    ts = json.loads(open(run + "/train-summary.json").read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    pass
rc = int(open(run + "/train-rc.txt").read().strip() or -1) if os.path.exists(run + "/train-rc.txt") else -1
n_st = len(cfg.get("stages", []))
final = [e for e in evals if e.get("stage") == n_st - 1]
final = final[-1] if final else (evals[-1] if evals else None)
last_len = cfg["stages"][-1]["seq_len"] if n_st else None
moe = []
last = [s for s in steps[-50:] if s.get("moe")]
if last:
    for i, ml in enumerate(last[-1]["moe"]):
        mv = [s["moe"][i]["maxvio_batch"] for s in last]
        moe.append({"layer": ml["layer"], "steps": len(last), "maxvio_batch_mean": sum(mv) / len(mv),
                    "maxvio_batch_max": max(mv), "n_dead_max": max(s["moe"][i]["n_dead"] for s in last)})
m = re.search(r"total (\d+).*active per token (\d+)", model_info or "")
pk = {p["length"]: p["accuracy"] for p in (final or {}).get("passkey", [])}
chk = jf(run + "/eval-check.json")
cxz = jf(run + "/check-xz.json")
gpu = ""
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
except Exception:
    pass
sample = open(run + "/sample.txt", errors="replace").read() if os.path.exists(run + "/sample.txt") else None
wall = t.get("end", 0) - t.get("start", 0)
acc = {
    "inside_the_call": {"wall_s": wall, "limit_s": 600, "ok": wall < 600},
    "heldout_bpb_below_xz": {"bits_per_byte": final and final["bits_per_byte"], "xz_9e": base,
                             "ok": bool(final and final.get("stage") == n_st - 1 and final["bits_per_byte"] < base)},
    "passkey_at_last_stage_length": {"length": last_len, "accuracy": pk.get(last_len), "bar": 0.9,
                                     "ok": bool(final and final.get("stage") == n_st - 1 and (pk.get(last_len) or 0) >= 0.9)},
    "moe_balance_last_50_steps": {"maxvio_batch_mean_max": max((x["maxvio_batch_mean"] for x in moe), default=None),
                                  "dead_max": max((x["n_dead_max"] for x in moe), default=None), "bar": 0.3,
                                  "ok": bool(moe) and all(x["maxvio_batch_mean"] <= 0.3 and x["n_dead_max"] == 0 for x in moe)},
}
plots = open(run + "/plots-status.txt").read().strip() if os.path.exists(run + "/plots-status.txt") else (
    "drawn: " + ", ".join(sorted(f for f in os.listdir(run + "/plots") if f.endswith(".png"))) if os.path.isdir(run + "/plots") else "none")
s = {
    "job": "scripts/main-job-gpu.sh run", "device": device, "gpu": gpu, "pack": jf("build-gpu/main-job-pack.json"),
    "wall_s": wall, "phases_s": phases, "train_exit_status": rc,
    "model": {"config": cfg.get("model"), "parameters": int(m.group(1)) if m else None,
              "active_per_token": int(m.group(2)) if m else None},
    "plan": jf(planinfo), "training": ts,
    "stages": stages,
    "evals": [{k: e.get(k) for k in ("step", "tokens", "stage", "stage_name", "seq_len", "bits_per_byte", "bytes", "eval_tokens", "passkey")} for e in evals],
    "heldout": final and {"bits_per_byte": final["bits_per_byte"], "bytes": final.get("bytes"), "tokens": final.get("eval_tokens"),
                          "seq_len": final.get("seq_len"), "step": final.get("step"), "stage": final.get("stage_name"),
                          "xz_9e_bits_per_byte": base, "ratio_to_xz": final["bits_per_byte"] / base},
    "passkey": pk, "moe": moe,
    "cpu_check": chk and {"bits_per_byte": chk.get("bits_per_byte"), "bytes": chk.get("bytes"), "tokens": chk.get("tokens"),
                          "seq_len": chk.get("seq_len"), "xz": cxz},
    "plots": plots, "sample": sample, "acceptance": acc,
}
json.dump(s, open(out, "w"), indent=1)
print("device %s (%s); wall %d s of %s (phases: %s); train exit %d"
      % (device, gpu or "?", wall, budget, ", ".join("%s %ds" % kv for kv in phases.items()), rc))
if m:
    print("model: %.1f M parameters, %.1f M active per token" % (int(m.group(1)) / 1e6, int(m.group(2)) / 1e6))
if ts:
    print("training: %d steps, %d tokens in %.1f s: %.0f tokens/s, MFU %.1f %% (of the %s), last loss %s"
          % (ts["steps"], ts["tokens"], ts["train_seconds"], ts["tok_per_s"], 100 * ts["mfu"],
             "bf16 matmul rate" if device == "cuda" else "sgemm rate", ts["last_loss"]))
for e in evals:
    print("  eval after step %d (end of stage %s): bits/byte %.4f; passkey {%s}"
          % (e["step"], e.get("stage_name", e["stage"]), e["bits_per_byte"],
             ", ".join("%d tokens: %.3f" % (p["length"], p["accuracy"]) for p in e.get("passkey", []))))
if final:
    print("held-out bits per byte (%s bytes, windows of %s tokens): %.4f vs xz -9e %.4f: %s"
          % (final.get("bytes"), final.get("seq_len"), final["bits_per_byte"], base,
             "below" if final["bits_per_byte"] < base else "NOT below"))
for x in moe:
    print("  MoE layer %d: maxvio_batch mean %.3f (max %.3f) over the last %d steps, dead experts %d"
          % (x["layer"], x["maxvio_batch_mean"], x["maxvio_batch_max"], x["steps"], x["n_dead_max"]))
if chk:
    print("CPU check (%s bytes of held-out files): %.4f bits per byte; xz -9e on the same bytes %.4f"
          % (chk.get("bytes"), chk.get("bits_per_byte"), (cxz or {}).get("xz_bits_per_byte", float("nan"))))
print("plots: " + plots)
print("acceptance: " + ", ".join("%s %s" % (k, "ok" if v["ok"] else "NO") for k, v in acc.items()))
PY
    local keep=("$RUN" "$PLANCFG" "$PLANINFO" "$TIMES")
    tar -czf "$RES/run.tar.gz" --exclude='*.safetensors' "${keep[@]}" 2>/dev/null ||
        echo "run.tar.gz: tar failed"
    ls -la "$RES"
    say "done"
}

# ------------------------------------------------------------------------------ plots
do_plots() {
    local dir="${1:-}" RUN="${RUN:-runs/gpu-main}"
    [[ -n "$dir" && -f "$dir/run.tar.gz" ]] || die "no run.tar.gz in '${dir:-(no folder given)}': give the folder of the returned files (scripts/main-job-gpu.sh plots DIR)"
    local LM="${LINMOE:-}"
    if [[ -z "$LM" ]]; then
        for c in build/linmoe build-gpu/linmoe; do [[ -x "$c" ]] && { LM="$c"; break; }; done
    fi
    [[ -n "$LM" ]] || die "no linmoe CLI here (make, or set LINMOE)"
    [[ "$LM" == build-gpu/* ]] && { LINMOE_GPU_DIR=build-gpu; source scripts/gpu/libpath.sh; }
    local tmp inner
    tmp="$(mktemp -d /tmp/main-job-gpu-plots.XXXXXX)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    tar -xzf "$dir/run.tar.gz" -C "$tmp"
    inner="$(find "$tmp" -maxdepth 3 -name train_config.json -printf '%h\n' | head -1)"
    [[ -n "$inner" ]] || die "$dir/run.tar.gz holds no run directory (no train_config.json)"
    x mkdir -p "$(dirname "$RUN")"
    x rm -rf "$RUN"
    x mv "$inner" "$RUN"
    if [[ -f "$dir/summary.json" ]]; then x cp "$dir/summary.json" "$RUN/summary.json"; fi
    x "$LM" plot "$RUN"
    echo "plots in $RUN/plots/"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
for a in "$@"; do [[ "$a" == "--dry-run" ]] && DRY=1; done
args=()
for a in "$@"; do [[ "$a" == "--dry-run" ]] || args+=("$a"); done
case "$cmd" in
pack) do_pack ;;
run)
    if ((DRY)) || [[ -n "${MAIN_JOB_GPU_TEED:-}" ]]; then
        do_run
    else
        res="${OUT:-${WORK:-$REPO}/${RUN:-runs/gpu-main}-out}"
        mkdir -p "$res"
        MAIN_JOB_GPU_TEED=1 bash "${BASH_SOURCE[0]}" run 2>&1 | tee "$res/main-job-gpu.log"
        exit "${PIPESTATUS[0]}"
    fi
    ;;
plots) do_plots "${args[@]+"${args[@]}"}" ;;
-h | --help | help) usage ;;
*)
    usage >&2
    exit 2
    ;;
esac
