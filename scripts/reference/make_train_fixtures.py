"""Optimizer and training-trajectory fixtures for linmoe's C tests, from torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ (fp64) with linmoe's LR schedule restated here.

    /usr/bin/python3 scripts/reference/make_train_fixtures.py --out tests/fixtures \
        | tee tests/fixtures/make_train_fixtures.log

(/usr/bin/python3: Debian's python3-torch 1.13, `bash scripts/install-deps.sh --peer`; a pyenv
`python3` earlier on PATH may have no torch. Any torch >= 1.13 works.)

(a) adamw_torch.safetensors (tests/test_train_torch.c, test_adamw_vs_torch): six tensors of
    realistic sizes and scales (an embedding whose gradient rows are often exactly 0 and one
    row always 0, a projection, a short-conv weight, a norm gain, a dt_bias whose gradients
    are ~1e-8, i.e. at the size of eps, and a 4-element buffer that the optimizer must not
    touch), 10 steps of given gradients (step 5 all exact zeros; steps 3, 7, 9 with norms
    above grad_clip so clipping engages, one just above it), lr from the schedule of the
    embedded train config (warmup + WSD decay), weight decay on the tensors linmoe decays
    (params.h: matrices and conv weights; not norms, biases, A_log, AttnRes vectors, buffers).
    Stored: the start weights, every step's gradient (F32), lr, pre-clip norm, and the
    weights after every step plus the final m, v (F64, torch's exp_avg / exp_avg_sq).
(b) train_tiny_torch.safetensors (test_trajectory_vs_torch): configs/tiny.json (model), the
    fixture weights of make_fixtures.py (router bias non-zero), 10 optimizer steps of 2
    micro-batches [B=2, T=32] of fixed random tokens. Per step: lr from the restated
    schedule (warmup 2 + cosine), forward / backward of each micro-batch in fp64 with
    linmoe_ref (chunked KDA: it agrees with the token-by-token form to 1e-10) with the loss
    scaled by 1/M, clip_grad_norm_, torch.optim.AdamW, then the aux-loss-free router bias
    update restated from src/ops/moe_balance.c (b += u sign(mean - demand) in fp32, centred,
    clamped). Stored: the batches, each step's loss (mean over the micro-batches), lr,
    pre-clip norm, per-layer expert demand (counts), and every tensor after every step (F32;
    the start weights are the step-0 values). Every token's k-th vs (k+1)-th selection key
    gap must exceed ROUTER_GAP at every forward (else the next seed is tried), so fp32 and
    fp64 pick the same experts. Also stored per step and tensor: the fp32-noise mask (see
    NOISE below).

NOISE (b): the C side computes gradients in fp32 (rel RMS error ~1e-6 against fp64,
test_model_parity.c). Adam divides by sqrt(v): an element whose gradients are at the
round-off floor of its tensor (cancellation leaves ~1e-7 of the tensor's scale) gets an update
of size lr in a direction decided by round-off, on both sides of the comparison. Such elements
are found here, not guessed: the same 10 steps are re-run with the model in fp32 (torch,
the same batches and optimizer), and an element is "noise-decided" when its fp32-vs-fp64
trajectory differs by more than NOISE_ABS_LR * lr_max (1 % of a full Adam step) at any
step. The C test reports those elements separately (count and their error) and holds every
other element to the 1e-5 bar; the log prints how many there are per tensor.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, HERE)
import linmoe_ref as R  # noqa: E402
import safetensors_io  # noqa: E402
from make_fixtures import fixture_params  # noqa: E402

STEPS = 10
ROUTER_GAP = 2e-5     # fp32 keys are within ~1e-6 of fp64 ones after 10 steps (see log)
NOISE_ABS_LR = 1e-2   # fp32-vs-fp64 torch trajectory gap (x lr_max) that marks an element


def f32(x):
    return float(np.float32(x))


# ============================================================================ schedule

def lr_at(tc, step):
    """lm_train_lr (src/train/config.c) restated: stage s holds global steps
    [first_step, first_step + steps); i = step - first_step clamped to [0, steps - 1];
    warmup: P (i + 1) / w for i < w; cosine: m + (P - m)(1 + cos(pi t)) / 2 with
    t = (i - w) / max(steps - w - 1, 1) (0 at the first post-warmup step, 1 at the last);
    wsd: P until the last D = round(wsd_decay_frac * steps) (<= steps - w) steps, then
    linear from P towards m reaching m at the last step (D == 1: m). m = P * min_lr_ratio."""
    first = 0
    for st in tc["stages_resolved"]:
        if step < first + st["steps"] or st is tc["stages_resolved"][-1]:
            break
        first += st["steps"]
    P = st["lr"]
    m = P * tc["train"]["min_lr_ratio"]
    n, w = st["steps"], st["warmup_steps"]
    i = min(max(step - first, 0), n - 1)
    if i < w:
        return P * (i + 1) / w
    if tc["train"]["schedule"] == "cosine":
        denom = n - w - 1 if n - w > 1 else 1
        t = (i - w) / denom
        return m + (P - m) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
    D = int(math.floor(tc["train"]["wsd_decay_frac"] * n + 0.5))  # llround, x >= 0
    D = min(D, n - w)
    d0 = n - D
    if D <= 0 or i < d0:
        return P
    if D == 1:
        return m
    return P + (m - P) * (i - d0 + 1) / D


def resolve_stages(tc):
    """steps per stage: ceil(tokens / batch_tokens) (config.c), lr: the stage's or train.lr."""
    out = []
    for s in tc["stages"]:
        out.append({"steps": -(-s["tokens"] // tc["train"]["batch_tokens"]),
                    "lr": s.get("lr", tc["train"]["lr"]), "warmup_steps": s["warmup_steps"]})
    tc["stages_resolved"] = out
    return tc


def train_config(model, lr, schedule, warmup, seq_len, batch_tokens, micro, clip, wsd_frac=0.2):
    tc = {"model": model, "tokenizer": "byte",
          "data": {"train": "unused.bin", "val": "unused.bin"},
          "train": {"seed": 1, "batch_tokens": batch_tokens, "micro_batches": micro, "lr": lr,
                    "min_lr_ratio": 0.1, "schedule": schedule, "wsd_decay_frac": wsd_frac,
                    "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                    "grad_clip": clip, "log_every": 1, "eval_every": 0, "checkpoint_every": 0,
                    "keep_last": 1, "max_bad_steps": 5, "threads": 0},
          "stages": [{"name": "only", "seq_len": seq_len, "tokens": STEPS * batch_tokens,
                      "warmup_steps": warmup, "packing": False}]}
    return tc


def make_opt(named, decay_names, tc, dtype_note=""):
    t = tc["train"]
    dec = [p for n, p in named if n in decay_names]
    nod = [p for n, p in named if n not in decay_names]
    groups = [g for g in ({"params": dec, "weight_decay": t["weight_decay"]},
                          {"params": nod, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"])


def clip_and_step(opt, params, lr, clip):
    """torch's clip_grad_norm_ (coef = clip / (norm + 1e-6), clamped to 1) then AdamW. linmoe
    scales only when norm > clip (the same coefficient): they differ for norms in
    (clip - 1e-6, clip], which the callers assert never happens here."""
    for g in opt.param_groups:
        g["lr"] = lr
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    if clip - 1e-6 < norm <= clip:
        sys.exit(f"make_train_fixtures: norm {norm} within 1e-6 of grad_clip: linmoe and torch differ there")
    opt.step()
    return norm


def rel_rms(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / d) if d > 0 else float(np.linalg.norm(a))


# ============================================================================ (a) optimizer only

def make_adamw_fixture(path, seed):
    rng = np.random.default_rng(seed)
    # name, shape, decay, start values, gradient scale
    spec = [
        ("model.embed_tokens.weight", (64, 32), 1, rng.standard_normal((64, 32)), 2e-2),
        ("model.layers.0.self_attn.q_proj.weight", (48, 32), 1,
         rng.standard_normal((48, 32)) / np.sqrt(32), 1e-2),
        ("model.layers.0.self_attn.q_conv1d.weight", (64, 4), 1, rng.uniform(-0.5, 0.5, (64, 4)), 1e-3),
        ("model.layers.0.input_layernorm.weight", (32,), 0, 1 + 0.1 * rng.standard_normal(32), 1e-1),
        ("model.layers.0.self_attn.dt_bias", (32,), 0, rng.uniform(-7, -2, 32), 1e-8),
    ]
    buffer = ("model.layers.1.mlp.gate.e_score_correction_bias", (4,))
    mult = [1.0, 0.7, 300.0, 1.0, 0.0, 1.0, 50.0, 0.5, 1.0, 1.0]
    tc = resolve_stages(train_config(json.load(open(os.path.join(REPO, "configs", "tiny.json"))),
                                     1e-2, "wsd", 3, 64, 1024, 1, 1.0, wsd_frac=0.3))
    w0 = {n: np.asarray(x, np.float32).astype(np.float64) for n, _, _, x, _ in spec}
    grads = []
    for s in range(STEPS):
        g = {}
        for n, shape, _, _, sc in spec:
            x = sc * mult[s] * rng.standard_normal(shape)
            if n == "model.embed_tokens.weight":
                x[rng.random(shape[0]) < 0.5] = 0.0  # tokens absent from the batch
                x[0] = 0.0                           # a token never seen
            if n == "model.layers.0.self_attn.q_proj.weight":
                x[rng.random(shape) < 0.05] = 0.0    # scattered exact zeros
            g[n] = np.asarray(x, np.float32)
        grads.append(g)
    # step 9 (index 8) just above the clip threshold: scale its gradient to norm 1.02
    n8 = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads[8].values()))
    for n in grads[8]:
        grads[8][n] = np.asarray(grads[8][n].astype(np.float64) * (1.02 / n8), np.float32)

    decay_names = {n for n, _, d, _, _ in spec if d}
    results = {}
    for dtype in (torch.float64, torch.float32):
        named = [(n, torch.nn.Parameter(torch.from_numpy(w0[n].copy()).to(dtype))) for n, *_ in spec]
        opt = make_opt(named, decay_names, tc)
        lrs, norms, ws = [], [], []
        for s in range(STEPS):
            for n, p in named:
                p.grad = torch.from_numpy(grads[s][n].astype(np.float64)).to(dtype)
            lr = lr_at(tc, s)
            norms.append(clip_and_step(opt, [p for _, p in named], lr, tc["train"]["grad_clip"]))
            lrs.append(lr)
            ws.append({n: p.detach().to(torch.float64).numpy().copy() for n, p in named})
        st = {n: opt.state[p] for n, p in named}
        results[dtype] = (lrs, norms, ws, st)
    lrs, norms, ws, st = results[torch.float64]
    print(f"(a) AdamW fixture: {len(spec)} tensors + a buffer, {STEPS} steps, torch.optim.AdamW fp64")
    print("    lr:    " + " ".join(f"{x:.4e}" for x in lrs))
    print("    norm:  " + " ".join(f"{x:.4g}" for x in norms)
          + f"   (grad_clip {tc['train']['grad_clip']}; clipped: "
          + ",".join(str(i + 1) for i, x in enumerate(norms) if x > tc["train"]["grad_clip"]) + ")")
    w32 = results[torch.float32][2]
    worst = max(rel_rms(w32[s][n], ws[s][n]) for s in range(STEPS) for n in ws[s])
    print(f"    info: torch AdamW in fp32 vs fp64, worst per-tensor rel RMS over the steps {worst:.2e}")

    t = {}
    for n, *_ in spec:
        t[n] = w0[n].astype(np.float32)
    t[buffer[0]] = np.asarray(0.05 * rng.standard_normal(buffer[1]), np.float32)
    t["lr"] = np.array(lrs, np.float64)
    t["grad_norm"] = np.array(norms, np.float64)
    for s in range(STEPS):
        for n, *_ in spec:
            t[f"step{s + 1}.grad.{n}"] = grads[s][n]
        t[f"step{s + 1}.grad.{buffer[0]}"] = np.full(buffer[1], 1e3, np.float32)  # must be ignored
        for n, *_ in spec:
            t[f"step{s + 1}.{n}"] = ws[s][n]
    for n, *_ in spec:
        t["exp_avg." + n] = st[n]["exp_avg"].numpy().astype(np.float64)
        t["exp_avg_sq." + n] = st[n]["exp_avg_sq"].numpy().astype(np.float64)
    meta = {"train_config": json.dumps({k: v for k, v in tc.items() if k != "stages_resolved"}),
            "tensors": json.dumps([[n, list(shape), d] for n, shape, d, _, _ in spec]),
            "buffer": buffer[0], "steps": str(STEPS), "torch": torch.__version__,
            "generator": "scripts/reference/make_train_fixtures.py (a)"}
    safetensors_io.save_file(t, path, meta)
    print(f"(a) wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)")


# ============================================================================ (b) trajectory

DECAY_KINDS = ("embed", "matrix", "conv")  # params.h: weight decay on matrices and conv weights


def bias_update(cfg, b, demand):
    """lm_router_update_bias, AUX_FREE + sign rule + centre + clamp (src/ops/moe_balance.c):
    u is the config's float; b += u sign(mean - demand) rounded to fp32; b -= mean(b) (fp64
    mean of the fp32 values) rounded to fp32; clamp to +-bias_clamp."""
    E = len(b)
    total = float(demand.sum())
    if total <= 0:
        return b
    mean = total / E
    u = f32(cfg.raw.get("bias_update_rate", 1e-3))
    out = np.empty(E, np.float32)
    for e in range(E):
        gap = mean - float(demand[e])
        out[e] = np.float32(float(b[e]) + u * float((gap > 0) - (gap < 0)))
    mb = float(sum(float(x) for x in out)) / E
    out = np.asarray([np.float32(float(x) - mb) for x in out], np.float32)
    B = np.float32(cfg.raw.get("bias_clamp", 1.0))
    if B > 0:
        out = np.clip(out, -B, B)
    return out


def run_trajectory(cfg, tc, params, batches, dtype, kda_mode):
    M = tc["train"]["micro_batches"]
    model = R.LinMoE(cfg, params, dtype, kda_mode)
    table = R.param_table(cfg)
    kinds = {n: k for n, _, k in table}
    named = [(n, model.p[n]) for n in model.param_names]
    decay_names = {n for n in model.param_names if kinds[n] in DECAY_KINDS}
    opt = make_opt(named, decay_names, tc)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    out = {"loss": [], "lr": [], "norm": [], "demand": [], "w": [], "gap": math.inf}
    for s in range(STEPS):
        lr = lr_at(tc, s)
        model.zero_grad(set_to_none=True)
        loss_sum = 0.0
        dem = np.zeros((len(moe_layers), E))
        for mi in range(M):
            ids, labels = batches[s][mi]
            _, loss, _ = model(ids, labels)
            (loss / M).backward()
            loss_sum += loss.item()
            for j, i in enumerate(moe_layers):
                r = model.routes[i]
                ks = torch.sort(r.keys, dim=-1, descending=True).values
                out["gap"] = min(out["gap"], (ks[:, k - 1] - ks[:, k]).min().item())
                dem[j] += np.bincount(r.idx.reshape(-1).numpy(), minlength=E)
        for n, p in named:
            if p.grad is None:  # unused by the forward (layer 0's attn_res with AttnRes)
                p.grad = torch.zeros_like(p)
        norm = clip_and_step(opt, [p for _, p in named], lr, tc["train"]["grad_clip"])
        with torch.no_grad():
            for j, i in enumerate(moe_layers):
                bn = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                b = model.p[bn].detach().to(torch.float32).numpy()
                model.p[bn].copy_(torch.from_numpy(bias_update(cfg, b, dem[j])).to(dtype))
        out["loss"].append(loss_sum / M)
        out["lr"].append(lr)
        out["norm"].append(norm)
        out["demand"].append(dem)
        out["w"].append({n: model.p[n].detach().to(torch.float64).numpy().copy() for n, _, _ in table})
    return out


def make_trajectory_fixture(cfg_path, path, seed0, clip):
    cfg_text = open(cfg_path).read()
    cfg = R.Config(json.loads(cfg_text))
    B, T, M = 2, 32, 2
    tc = resolve_stages(train_config(json.loads(cfg_text), 3e-3, "cosine", 2, T, M * B * T, M, clip))
    for seed in range(seed0, seed0 + 50):
        params = fixture_params(cfg, seed)
        rng = np.random.default_rng(20_000 + seed)
        batches = []
        for s in range(STEPS):
            mb = []
            for mi in range(M):
                win = torch.from_numpy(rng.integers(0, cfg.vocab_size, (B, T + 1)))
                mb.append((win[:, :T].contiguous(), win[:, 1:].contiguous()))
            batches.append(mb)
        ref = run_trajectory(cfg, tc, params, batches, torch.float64, "chunk")
        if ref["gap"] > ROUTER_GAP:
            break
        print(f"(b) seed {seed}: a router key gap {ref['gap']:.2e} <= {ROUTER_GAP}; resampling")
    else:
        sys.exit("make_train_fixtures: no seed with clear router margins")
    r32 = run_trajectory(cfg, tc, params, batches, torch.float32, "chunk")
    print(f"(b) trajectory fixture: {os.path.relpath(cfg_path, REPO)}, seed {seed}, {STEPS} steps x {M} micro-batches "
          f"[B={B}, T={T}], fp64 (chunked KDA), torch.optim.AdamW, grad_clip {clip}")
    print(f"    min k-th vs (k+1)-th selection key gap over all forwards: {ref['gap']:.3e} (bar {ROUTER_GAP})")
    print("    loss:  " + " ".join(f"{x:.6f}" for x in ref["loss"]))
    print("    lr:    " + " ".join(f"{x:.4e}" for x in ref["lr"]))
    print("    norm:  " + " ".join(f"{x:.4f}" for x in ref["norm"])
          + "   (clipped: " + ",".join(str(i + 1) for i, x in enumerate(ref["norm"]) if x > clip) + ")")
    lrmax = max(ref["lr"])
    same_dem = all(np.array_equal(a, b) for a, b in zip(ref["demand"], r32["demand"]))
    print(f"    info: torch fp32 model vs fp64: same expert demand every step: {same_dem}; "
          f"loss rel err (worst step) {max(abs(a - b) / abs(b) for a, b in zip(r32['loss'], ref['loss'])):.2e}")
    names = [n for n, _, k in R.param_table(cfg) if k != "buffer"]
    dev = max(float(np.abs(r32["w"][s][n] - ref["w"][s][n]).max()) for s in range(STEPS) for n in names)
    print(f"    info: torch fp32 vs fp64 trajectory, largest element deviation {dev / lrmax:.2e} x lr_max")
    masks, worst_unmasked, worst_name = {}, 0.0, ""
    n_noise = {}
    for n in names:
        m = np.zeros_like(ref["w"][0][n], dtype=bool)
        for s in range(STEPS):
            m |= np.abs(r32["w"][s][n] - ref["w"][s][n]) > NOISE_ABS_LR * lrmax
        masks[n] = m
        n_noise[n] = int(m.sum())
        for s in range(STEPS):
            e = rel_rms(np.where(m, ref["w"][s][n], r32["w"][s][n]), ref["w"][s][n])
            if e > worst_unmasked:
                worst_unmasked, worst_name = e, f"{n} step {s + 1}"
    tot = sum(n_noise.values())
    print(f"    fp32-noise-decided elements (torch fp32 vs fp64 trajectory > {NOISE_ABS_LR} x lr_max at any step): "
          f"{tot} of {sum(m.size for m in masks.values())}")
    for n in names:
        if n_noise[n]:
            print(f"      {n}: {n_noise[n]} of {masks[n].size}")
    print(f"    info: torch fp32 vs fp64 trajectory, other elements: worst per-tensor rel RMS {worst_unmasked:.2e} ({worst_name})")

    t = {}
    for n, _, _ in R.param_table(cfg):
        t[n] = params[n].numpy().astype(np.float32)
    for s in range(STEPS):
        for mi in range(M):
            t[f"step{s + 1}.micro{mi}.input_ids"] = batches[s][mi][0].to(torch.int32).numpy()
            t[f"step{s + 1}.micro{mi}.labels"] = batches[s][mi][1].to(torch.int32).numpy()
    t["loss"] = np.array(ref["loss"], np.float64)
    t["lr"] = np.array(ref["lr"], np.float64)
    t["grad_norm"] = np.array(ref["norm"], np.float64)
    t["demand"] = np.stack(ref["demand"]).astype(np.int32)
    for n in names:
        if n_noise[n]:
            t["noise_mask." + n] = masks[n].astype(np.uint8)
    for s in range(STEPS):
        for n, _, _ in R.param_table(cfg):
            t[f"step{s + 1}.{n}"] = ref["w"][s][n].astype(np.float32)
    meta = {"train_config": json.dumps({k: v for k, v in tc.items() if k != "stages_resolved"}),
            "seed": str(seed), "steps": str(STEPS), "torch": torch.__version__,
            "decay": json.dumps(sorted(n for n, _, k in R.param_table(cfg) if k in DECAY_KINDS)),
            "math": "float64, chunked KDA (linmoe_ref.kda_chunk), torch.optim.AdamW",
            "generator": "scripts/reference/make_train_fixtures.py (b)"}
    safetensors_io.save_file(t, path, meta)
    print(f"(b) wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "tiny.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=7.0, help="grad_clip of the trajectory")
    ap.add_argument("--only", choices=("a", "b"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, numpy {np.__version__}")
    if args.only != "b":
        make_adamw_fixture(os.path.join(args.out, "adamw_torch.safetensors"), args.seed)
    if args.only != "a":
        make_trajectory_fixture(args.config, os.path.join(args.out, "train_tiny_torch.safetensors"),
                                args.seed, args.clip)


if __name__ == "__main__":
    main()
