#!/usr/bin/env bash
# What the gate and the residual cost in the whole model (issue 22 "In the whole model"),
# on the GPU machine after scripts/gpu/pack.sh here (carry build-gpu):
#   scripts/gpu/bench_variants.sh [--quick] [BASE ...]     (default configs/gpu-moe.json)
# For each BASE config, `linmoe bench model --device cuda` times one training step of
#   the base config as it is,
#   gate = softplus              (linear_attn_config.gate; everything else the same),
#   residual = standard          (when the base has an AttnRes residual), and
#   residual = block_attnres     (when the base has the standard one; blocks of 8),
# one process per variant, in that order, and prints each variant's step time against
# the base's: gate bounded / softplus, and Block AttnRes / standard (the issue's bound
# on Block AttnRes: <= 1.04). Per-variant JSON and summary.json go to
# $OUT/bench_variants (or /tmp/bench_variants).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh
QUICK=()
BASES=()
for a in "$@"; do
    case "$a" in
    --quick) QUICK=(--quick) ;;
    *) BASES+=("$a") ;;
    esac
done
((${#BASES[@]})) || BASES=(configs/gpu-moe.json)
DIR="${OUT:-/tmp}/bench_variants"
rm -rf "$DIR" && mkdir -p "$DIR"
BIN="${LINMOE_BIN:-build-gpu/linmoe}"
for base in "${BASES[@]}"; do
    name="$(basename "$base" .json)"
    python3 - "$base" "$DIR" "$name" <<'PY'
import json, sys
base, out, name = sys.argv[1:]
c = json.load(open(base))
variants = {"base": dict(c)}
sp = json.loads(json.dumps(c))
sp["linear_attn_config"]["gate"] = "softplus"
variants["softplus"] = sp
r = json.loads(json.dumps(c))
if c.get("residual", "standard") == "standard":
    r["residual"] = "block_attnres"
    r["attnres_block_size"] = 8
    variants["block_attnres"] = r
else:
    r["residual"] = "standard"
    variants["standard"] = r
for k, v in variants.items():
    json.dump(v, open(f"{out}/{name}-{k}.json", "w"), indent=1)
print(" ".join(variants))
PY
    for cfg in "$DIR/$name"-*.json; do
        case "$cfg" in *.result.json) continue ;; esac
        echo "== $cfg"
        "$BIN" bench model --device cuda --config "$cfg" "${QUICK[@]}" \
            --json "${cfg%.json}.result.json" || echo "bench_variants: $cfg failed"
    done
done
python3 - "$DIR" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
rows, summ = {}, {}
for f in sorted(glob.glob(f"{d}/*.result.json")):
    key = os.path.basename(f)[: -len(".result.json")]
    name, var = key.rsplit("-", 1)
    rows.setdefault(name, {})[var] = json.load(open(f))
for name, vs in rows.items():
    b = vs.get("base")
    if not b:
        continue
    s = {"base_ms": b["ms_step"]}
    print(f"{name}: base {b['ms_step']:.2f} ms/step, {b['tokens_per_s']:.0f} tok/s, "
          f"MFU {100 * b['mfu']:.1f} %")
    for var, r in vs.items():
        if var == "base":
            continue
        s[var + "_ms"] = r["ms_step"]
        print(f"  {var:14s} {r['ms_step']:.2f} ms/step  (base / {var} = "
              f"{b['ms_step'] / r['ms_step']:.4f})")
    if "softplus" in vs:
        s["bounded_over_softplus"] = b["ms_step"] / vs["softplus"]["ms_step"]
    if "standard" in vs:
        s["block_attnres_over_standard"] = b["ms_step"] / vs["standard"]["ms_step"]
    if "block_attnres" in vs:
        s["block_attnres_over_standard"] = vs["block_attnres"]["ms_step"] / b["ms_step"]
    if "block_attnres_over_standard" in s:
        v = s["block_attnres_over_standard"]
        print(f"  Block AttnRes / standard = {v:.4f} ({'within' if v <= 1.04 else 'ABOVE'} 1.04)")
    summ[name] = s
json.dump(summ, open(f"{d}/summary.json", "w"), indent=1)
PY
