#!/usr/bin/env bash
# fla parity on a trained gpu-dense checkpoint (issue 22 "fla parity"), on the GPU machine
# after scripts/gpu/pack.sh here (carry build-gpu, data/brown, data/gpt2 and peers/fla):
#   scripts/gpu/fla_parity.sh [STEPS]          (default 60)
# 1. Brown (data/brown/{train,val}.txt) tokenized with GPT-2 BPE (data/gpt2);
# 2. configs/gpu-dense.json (the fla anchor: hidden 1024, 12 layers, vocab 50304)
#    trained STEPS steps of 8 x 4096 tokens with --device cuda, so that the weights are
#    no longer at initialisation (a random model's loss is ln V whatever the mapping);
# 3. scripts/gpu/fla_parity.py: `linmoe export --format fla`, fla's KDAForCausalLM
#    loads it, and its loss on 2 held-out documents of 2048 tokens is compared with
#    linmoe's CPU fp32 loss on the same batch (fp32 and bf16 autocast, tol 0.01).
# Output under $OUT/fla_parity (or /tmp/fla_parity): train logs, fla_parity.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/libpath.sh
STEPS="${1:-60}"
DIR="${OUT:-/tmp}/fla_parity"
TOK="${TMPDIR:-/tmp}/fla_parity_tok"
rm -rf "$DIR" "$TOK" && mkdir -p "$DIR" "$TOK"
BIN=build-gpu/linmoe
for s in train val; do
    $BIN tokenize --tokenizer gpt2 --gpt2-dir data/gpt2 --in "data/brown/$s.txt" \
        --out "$TOK/$s.bin" --quiet
done
python3 - "$STEPS" "$DIR/config.json" "$TOK" <<'PY'
import json, sys
steps, out, tok = int(sys.argv[1]), sys.argv[2], sys.argv[3]
bt = 8 * 4096
c = {
    "model": "configs/gpu-dense.json",
    "tokenizer": "gpt2", "tokenizer_dir": "data/gpt2",
    "data": {"train": tok + "/train.bin", "val": tok + "/val.bin"},
    "train": {"seed": 0, "batch_tokens": bt, "micro_batches": 1, "lr": 1e-3,
              "min_lr_ratio": 0.1, "schedule": "wsd", "wsd_decay_frac": 0.2,
              "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
              "grad_clip": 1.0, "log_every": 10, "eval_every": 0,
              "checkpoint_every": 0, "keep_last": 1, "max_bad_steps": 5, "threads": 0},
    "stages": [{"name": "ctx4096", "seq_len": 4096, "tokens": steps * bt,
                "warmup_steps": 10, "rope_theta": 10000.0, "packing": True,
                "passkey_fraction": 0.0, "long_doc_fraction": 0.0, "repeat_fraction": 0.0}],
    "eval": {"seq_len": 0, "passkey_lengths": [], "passkey_samples": 1,
             "passkey_seed": 1234, "max_val_tokens": 65536},
}
json.dump(c, open(out, "w"), indent=1)
PY
$BIN train --config "$DIR/config.json" --run-dir "$DIR/run" --device cuda \
    > "$DIR/train.json" 2> "$DIR/train.log" || { tail -5 "$DIR/train.log"; exit 1; }
tail -3 "$DIR/train.log"
PYTHONPATH="$PWD/peers/fla${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/gpu/fla_parity.py \
    --ckpt "$DIR/run" --linmoe "$BIN" --shard "$TOK/val.bin" --batch 2 --seq-len 2048 \
    --tokenizer gpt2 --gpt2-dir data/gpt2 --work "$DIR/work" --threads "$(nproc)" \
    --json "$DIR/fla_parity.json"
