#!/usr/bin/env python3
"""`linmoe bench model --device cuda` beside its peers in one process, on the GPU machine
(issue 22 item 5).

For each config (default configs/gpu-dense.json, configs/gpu-moe.json):
  linmoe  build-gpu/liblinmoe_cuda.so (scripts/gpu/pack.sh) through ctypes:
          lm_bench_model_gpu_run(config, json, quick) (bench/bench_model_gpu.c): one full
          training step at the config's batch_size x seq_len, its JSON record (ms_step,
          tokens_per_s, mfu, flops_per_token, matmul_tflops, peak_mem_bytes, profile_ms, ...).
  peer    a dense config with the standard residual: fla's KDAForCausalLM (peers/fla, the
          source tree of fla bc3b101d) with the config mapped field by field (fla_kwargs);
          any other config (MoE, AttnRes): the PyTorch + fla twin of linmoe's model,
          scripts/gpu/twin_model.py. --twin-all adds the twin on the fla configs too.
Both peers take the same batch as linmoe: the ids of bench_model_gpu.c's generator (an
LCG, restated in linmoe_ids), B*T - B labelled tokens (the next token; the last position
of each row has none: fla's model shifts the labels itself, the twin gets linmoe's
labels), and the same step: bf16 autocast over fp32 master parameters, forward + loss,
backward, torch.nn.utils.clip_grad_norm_(1.0), torch.optim.AdamW(fused=True, lr 1e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1: linmoe's values), zero_grad(set_to_none);
the twin also applies the aux-loss-free router bias update after the step. Weights are
each implementation's own init (same distributions, different random values).

Timing (as bench_model_gpu.c): 2 warm-up steps (the first also tells whether the variant
runs at all), then 5 timed steps (--quick: 2), torch.cuda.synchronize() before and after
each, the median. Memory: torch.cuda.max_memory_allocated / max_memory_reserved over the
timed steps (peak stats reset after the warm-ups) and total - free from
torch.cuda.mem_get_info after them (what linmoe's peak_mem_bytes counts: everything the
process holds, the CUDA context included; "base" is that figure before the peer built its
model). MFU of a peer = linmoe's FLOPs per token (its JSON; this script's restatement of
lm_model_train_flops_per_token when linmoe did not run) x tokens/s / linmoe's measured
bf16 matmul rate (a torch 8192^3 bf16 matmul rate when linmoe did not run), so the rows
compare directly. peer/linmoe > 1: linmoe is faster.

fla's Attention layers import flash_attn, which the GPU image lacks: before fla is
imported a stand-in module `flash_attn` goes into sys.modules whose flash_attn_func /
flash_attn_varlen_func run torch's scaled_dot_product_attention (the output says so).

The twin tries, in order, until one runs a first step: torch.compile + fla fused_attnres,
torch.compile + torch AttnRes, eager + fla fused_attnres, eager + torch AttnRes (the
AttnRes choice only with an AttnRes residual; --no-compile drops the compiled ones); each
failure is printed and kept in the JSON. A peer that cannot run (import error, OOM, a
kernel that does not compile) prints its reason and the script goes on.

usage: bench_model.py [--configs A.json,B.json] [--peers fla,twin] [--twin-all] [--quick]
                      [--no-compile] [--twin-attnres auto|fla|torch] [--autotune full|first|pinned:F]
                      [--skip-linmoe] [--json FILE] [--lib LIB.so] [--dry-run]
Output: a table (one row per config and implementation: ms/step, tokens/s, MFU, peak GiB)
and $OUT/bench_model.json (else /tmp/bench_model.json): {"bench": "model", ..., "records":
[linmoe's records and the peers'], "comparisons": [...]}, rewritten after every row.
--dry-run needs neither torch nor a GPU: it prints the shapes, the FLOPs, the fla mapping
and the twin's plan.
"""
import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIGS = ["configs/gpu-dense.json", "configs/gpu-moe.json"]
IGNORE_INDEX = -100
WARMUP = 2
GIB = float(1 << 30)
DEVICE = "cuda"  # every tensor and autocast region of the peers (a test can point it elsewhere)


# ============================================================================ config restatements

def _layer_kinds(raw):
    """0-based layer kinds from the 1-based kda_layers / full_attn_layers (model_config.h)."""
    L = int(raw["num_hidden_layers"])
    la = raw.get("linear_attn_config", {})
    kda = {int(i) - 1 for i in la.get("kda_layers", [])}
    return ["kda" if i in kda else "attn" for i in range(L)]


def _heads(raw):
    Hq = int(raw.get("num_attention_heads", 0))
    Hkv = int(raw.get("num_key_value_heads", Hq))
    D = int(raw.get("head_dim", int(raw["hidden_size"]) // Hq if Hq else 0))
    return Hq, Hkv, D


def _is_moe(raw, i):
    return i >= int(raw.get("first_k_dense_replace", 0))


def flops_per_token(raw, T):
    """lm_model_train_flops_per_token (model.h, src/model/model.c) restated: 6 x matmul
    parameters touched per token (projections, dense FFN, router, shared + k routed experts,
    LM head; no embedding) + the KDA op's forward + backward FLOPs + 6*T*Hq*D per attention
    layer (causal)."""
    d, V = float(raw["hidden_size"]), float(raw["vocab_size"])
    la = raw.get("linear_attn_config", {})
    mm, extra = V * d, 0.0
    for i, kind in enumerate(_layer_kinds(raw)):
        if kind == "kda":
            H, Dh = float(la["num_heads"]), float(la["head_dim"])
            HD = H * Dh
            mm += 3 * HD * d + Dh * d + HD * Dh + H * d + Dh * d + HD * Dh + d * HD
            C, dk, dv = float(la.get("chunk_size", 64)), Dh, Dh
            extra += H * (6 * dk * dv + C * (6 * dk + 4 * dv) + 16 * dk * dv +
                          C * (12 * dk + 10 * dv) + 4 * C * C)
        else:
            Hq, Hkv, D = _heads(raw)
            mm += (Hq * D + 2 * Hkv * D) * d + d * Hq * D
            extra += 6.0 * T * Hq * D
        if not _is_moe(raw, i):
            mm += 3.0 * float(raw["intermediate_size"]) * d
        else:
            E = float(raw.get("num_experts", raw.get("n_routed_experts", 1)))
            k, f = float(raw["num_experts_per_tok"]), float(raw["moe_intermediate_size"])
            ns = float(raw.get("n_shared_experts", 0))
            mm += E * d + k * 3 * f * d + ns * 3 * f * d
    return 6 * mm + extra


def param_counts(raw):
    """(total, active) trainable parameters as lm_params_count counts them (params.h table;
    routed experts at k/E for active; the router bias is a buffer)."""
    d, V = int(raw["hidden_size"]), int(raw["vocab_size"])
    la = raw.get("linear_attn_config", {})
    res = raw.get("residual", "standard") != "standard"
    tot = act = V * d + d + (0 if raw.get("tie_word_embeddings", False) else V * d)
    if res:
        tot += 2 * d
        act += 2 * d
    for i, kind in enumerate(_layer_kinds(raw)):
        n = 2 * d + (4 * d if res else 0)
        if kind == "kda":
            H, Dh, W = int(la["num_heads"]), int(la["head_dim"]), int(la.get("short_conv_kernel_size", 4))
            C = H * Dh
            n += 3 * C * d + 3 * C * W + Dh * d + C * Dh + H + C + H * d + Dh * d + C * Dh + Dh + d * C
        else:
            Hq, Hkv, D = _heads(raw)
            n += (Hq * D + 2 * Hkv * D) * d + d * Hq * D
        a = n
        if not _is_moe(raw, i):
            n += 3 * int(raw["intermediate_size"]) * d
            a = n
        else:
            E = int(raw.get("num_experts", raw.get("n_routed_experts", 1)))
            k, f = int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"])
            fs = int(raw.get("n_shared_experts", 0)) * f
            shared = E * d + 3 * fs * d
            n += shared + 3 * E * f * d
            a += shared + 3 * k * f * d
        tot += n
        act += a
    return tot, act


def fla_kwargs(raw, T):
    """fla's KDAConfig (bc3b101 fla/models/kda/configuration_kda.py) for a linmoe config, or
    (None, reason) where fla's KDAForCausalLM cannot express it. Mapping: hidden_size,
    num_hidden_layers, vocab_size; KDA num_heads / head_dim / conv_size; gate bounded ->
    safe_gate=True, lower_bound (fla's lower_bound * sigmoid(exp(A_log) (g + dt_bias)) gate),
    softplus -> safe_gate=False, lower_bound=None; attention layers (0-based) with num_heads,
    num_kv_heads, rope_theta, no qkv bias, no window (fla's Attention uses head_dim =
    hidden_size / num_heads and always RoPE); intermediate_size with hidden_ratio None;
    norm_eps = rms_norm_eps (fla also uses it for the KDA head norm, linmoe 1e-5);
    tie_word_embeddings; fused CE / norm / SwiGLU; no AttnRes. fla's g_proj output layer
    has a bias linmoe lacks (d_kda more parameters per KDA layer)."""
    kinds = _layer_kinds(raw)
    L, d = len(kinds), int(raw["hidden_size"])
    la = raw.get("linear_attn_config", {})
    if any(_is_moe(raw, i) for i in range(L)):
        return None, "MoE layers (fla's KDAForCausalLM has a dense GatedMLP only)"
    if raw.get("residual", "standard") != "standard":
        return None, f"residual {raw.get('residual')} (fla AttnRes is not mapped here)"
    gates = la.get("gate", "bounded")
    gates = [gates] if isinstance(gates, str) else list(gates)
    if len(set(gates)) > 1:
        return None, "per-layer gates (fla has one gate for all KDA layers)"
    bounded = gates[0] == "bounded"
    attn = [i for i, k in enumerate(kinds) if k == "attn"]
    spec = None
    if attn:
        Hq, Hkv, D = _heads(raw)
        if Hq * D != d:
            return None, f"attention head_dim {D} != hidden_size / num_attention_heads"
        pos = raw.get("position", "rope")
        if (pos if isinstance(pos, str) else "mixed") != "rope" and not (
                isinstance(pos, list) and set(pos) == {"rope"}):
            return None, f"position {pos!r} (fla's Attention always applies RoPE)"
        spec = {"layers": attn, "num_heads": Hq, "num_kv_heads": Hkv, "qkv_bias": False,
                "window_size": None, "rope_theta": float(raw.get("rope_theta", 10000.0))}
    return {
        "attn_mode": "chunk", "hidden_size": d, "expand_v": 1.0, "use_short_conv": True,
        "allow_neg_eigval": False, "safe_gate": bounded,
        "lower_bound": float(la.get("lower_bound", -5.0)) if bounded else None,
        "conv_size": int(la.get("short_conv_kernel_size", 4)),
        "head_dim": int(la.get("head_dim", 128)), "num_heads": int(la.get("num_heads", 8)),
        "num_v_heads": None, "max_position_embeddings": int(T), "hidden_ratio": None,
        "intermediate_size": int(raw["intermediate_size"]), "hidden_act": "swish",
        "num_hidden_layers": L, "norm_eps": float(raw.get("rms_norm_eps", 1e-6)), "attn": spec,
        "use_cache": False, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "initializer_range": float(raw.get("initializer_range", 0.02)), "fuse_norm": True,
        "fuse_swiglu": True, "fuse_cross_entropy": True, "use_l2warp": False,
        "vocab_size": int(raw["vocab_size"]), "attnres_block_size": None,
    }, None


def twin_variants(raw, compile_ok, attnres="auto"):
    """(attnres_fla, compile) in the order the twin tries them; attnres "fla" / "torch"
    keeps only that AttnRes implementation (--twin-attnres)."""
    ar = raw.get("residual", "standard") != "standard"
    ars = {"auto": (True, False), "fla": (True,), "torch": (False,)}[attnres] if ar else (True,)
    out = []
    for comp in ((True, False) if compile_ok else (False,)):
        for fla_ar in ars:
            out.append((fla_ar, comp))
    return out


def linmoe_ids(B, T, V):
    """bench/bench_model_gpu.c's ids: s <- s * 6364136223846793005 + 1442695040888963407
    (mod 2^64) from s = 0x9e3779b97f4a7c15, id = (s >> 33) mod V, row-major [B, T]."""
    s, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    out = []
    for _ in range(B * T):
        s = (s * 6364136223846793005 + 1442695040888963407) & m
        out.append((s >> 33) % V)
    return out


# ============================================================================ flash_attn stand-in

def _sdpa_bthd(q, k, v, causal, scale, window):
    """Attention on [B, T, H, D] (flash-attn's layout and GQA map: query head h reads kv head
    h // (Hq / Hkv)) through torch SDPA. flash-attn's causal mask is bottom-right aligned
    when Tq != Tk, window_size = (left, right) keeps keys in [i - left, i + right]."""
    import torch
    import torch.nn.functional as F
    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hq != hkv:
        kt = kt.repeat_interleave(hq // hkv, dim=1)
        vt = vt.repeat_interleave(hq // hkv, dim=1)
    Tq, Tk = q.shape[1], k.shape[1]
    left, right = (int(w) for w in window)
    mask, is_causal = None, False
    if left >= 0 or right >= 0 or (causal and Tq != Tk):
        i = torch.arange(Tq, device=q.device).view(Tq, 1) + (Tk - Tq)
        j = torch.arange(Tk, device=q.device).view(1, Tk)
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
        if causal:
            mask &= j <= i
        if left >= 0:
            mask &= j >= i - left
        if right >= 0:
            mask &= j <= i + right
    else:
        is_causal = causal
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal,
                                       scale=scale)
    return o.transpose(1, 2)


def sdpa_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), **kwargs):
    """flash_attn_func's contract ([B, T, H, D] in and out) on torch SDPA."""
    if dropout_p:
        raise NotImplementedError("flash_attn stand-in: dropout")
    return _sdpa_bthd(q, k, v, causal, softmax_scale, window_size).contiguous()


def sdpa_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                                max_seqlen_k=None, dropout_p=0.0, softmax_scale=None,
                                causal=False, window_size=(-1, -1), **kwargs):
    """flash_attn_varlen_func's contract (packed [total, H, D], int32 cu_seqlens) by a loop
    over the documents (one host read of the offsets)."""
    import torch
    if dropout_p:
        raise NotImplementedError("flash_attn stand-in: dropout")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for n in range(len(cq) - 1):
        a, b, c, e = cq[n], cq[n + 1], ck[n], ck[n + 1]
        if b == a:
            continue
        if e == c:
            outs.append(q.new_zeros(b - a, q.shape[1], v.shape[2]))
            continue
        outs.append(_sdpa_bthd(q[a:b].unsqueeze(0), k[c:e].unsqueeze(0), v[c:e].unsqueeze(0),
                               causal, softmax_scale, window_size)[0])
    return torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


def install_flash_attn_standin():
    """A module `flash_attn` with the two functions fla's attention layers import, unless a
    real flash_attn is importable. Returns what fla's attention runs on."""
    import importlib.machinery
    import importlib.util
    import types
    try:
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attn (installed)"
    except (ValueError, ImportError):
        pass
    m = types.ModuleType("flash_attn")
    m.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    m.__version__ = "0+sdpa-standin"
    m.flash_attn_func = sdpa_flash_attn_func
    m.flash_attn_varlen_func = sdpa_flash_attn_varlen_func
    sys.modules["flash_attn"] = m
    return "torch SDPA stand-in for flash_attn (not installed in this image)"


# ============================================================================ measuring

def device_ctx(torch):
    """The context that makes new modules' parameters on DEVICE."""
    return torch.device(DEVICE)


def make_step(torch, params, loss_fn, post=None):
    """One training step: autocast bf16 forward + loss, backward, clip 1.0, fused AdamW,
    zero_grad(set_to_none), then post() (the twin's router bias update). Returns the loss
    tensor (not read: no host sync beyond what the model itself does)."""
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)

    def step():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if post is not None:
            post()
        return loss.detach()
    return step, opt


def time_steps(torch, step, reps, warm_done):
    """Remaining warm-ups, then reps timed steps with a synchronisation around each."""
    for _ in range(WARMUP - warm_done):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms, loss = [], None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    free, total = torch.cuda.mem_get_info()
    return {"ms_step": statistics.median(ms), "ms_steps": ms,
            "max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "peak_mem_bytes": total - free, "loss": float(loss)}


def used_bytes(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def cleanup(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure_matmul_tflops(torch):
    """bf16 8192^3 matmul rate (TFLOP/s), median of 10 after 3 warm-ups: the MFU reference
    when linmoe's own measurement is absent."""
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    del a, b
    return 2.0 * n ** 3 / statistics.median(ts) / 1e12


# ============================================================================ the runs

def run_linmoe(lib, cfg_path, quick):
    tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    os.unlink(tmp)
    sys.stdout.flush()
    rc = lib.lm_bench_model_gpu_run(cfg_path.encode(), tmp.encode(), int(quick))
    ctypes.CDLL(None).fflush(None)  # the C side's printf output before ours
    if rc != 0 or not os.path.exists(tmp):
        return {"impl": "linmoe", "error": f"lm_bench_model_gpu_run returned {rc} (see above)"}
    with open(tmp) as f:
        rec = json.load(f)
    os.unlink(tmp)
    rec["impl"] = "linmoe"
    return rec


def run_fla(torch, raw, ids_list, B, T, reps, attn_impl):
    kw, why = fla_kwargs(raw, T)
    rec = {"impl": "fla KDAForCausalLM", "attention": attn_impl, "fla_config": kw}
    if kw is None:
        rec["error"] = f"config not expressible in fla's KDAForCausalLM: {why}"
        return rec
    base = used_bytes(torch)
    try:
        import fla
        from fla.models import KDAConfig, KDAForCausalLM
        rec["fla_version"] = getattr(fla, "__version__", "?")
        conf = KDAConfig(**kw)
        torch.manual_seed(0)
        try:
            with device_ctx(torch):
                model = KDAForCausalLM(conf)
        except (ImportError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - a model that cannot be built on the device
            rec["note"] = f"built on the CPU, then moved ({type(e).__name__}: {str(e)[:200]})"
            model = KDAForCausalLM(conf)
        model = model.to(device=DEVICE, dtype=torch.float32).train()
        rec["params"] = sum(p.numel() for p in model.parameters())
        params = [p for p in model.parameters() if p.requires_grad]
        ids = torch.tensor(ids_list, dtype=torch.long, device=DEVICE).view(B, T)
        # fla's forward shifts the labels itself: labels = ids gives targets ids[:, t+1] and
        # ignore_index at t = T-1, B*T - B labelled tokens as in linmoe
        step, opt = make_step(torch, params,
                              lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
        t0 = time.time()
        step()
        torch.cuda.synchronize()
        rec["first_step_s"] = time.time() - t0
        rec.update(time_steps(torch, step, reps, warm_done=1))
        rec["base_mem_bytes"] = base
        del step, opt, params, model, ids
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    cleanup(torch)
    return rec


def run_twin(torch, cfg_path, ids_list, B, T, reps, compile_ok, attnres="auto"):
    rec = {"impl": "twin (PyTorch + fla)", "attempts": []}
    base = used_bytes(torch)
    try:
        import twin_model as TM
        cfg = TM.R.Config.load(cfg_path)
        raw = cfg.raw
        ids = torch.tensor(ids_list, dtype=torch.long, device=DEVICE).view(B, T)
        labels = TM.next_token_labels(ids)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return rec
    for attnres_fla, comp in twin_variants(raw, compile_ok, attnres):
        impl = TM.Impl(fla=True, attnres_fla=attnres_fla, compile=comp)
        desc = impl.describe(cfg)
        short = "twin (" + ("torch.compile" if impl.compile else "eager") + (
            (", fla AttnRes" if impl.attnres_fla else ", torch AttnRes")
            if cfg.residual != "standard" else "") + ")"
        try:
            with device_ctx(torch):
                model = TM.Twin(cfg, impl)
            model.init_weights(cfg.seed)
            model.train()
            params = list(model.parameters())

            def loss_fn():
                return model(ids, labels)
            step, opt = make_step(torch, params, loss_fn, post=model.update_router_biases)
            t0 = time.time()
            step()
            torch.cuda.synchronize()
            first = time.time() - t0
        except Exception as e:  # noqa: BLE001 - try the next variant
            msg = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  twin [{desc}]: failed: {msg.splitlines()[0] if msg else msg}")
            rec["attempts"].append({"impl": desc, "error": msg})
            if isinstance(e, ImportError):  # every variant needs the same imports
                break
            model = step = opt = params = None
            cleanup(torch)
            if comp:
                try:
                    torch._dynamo.reset()
                except Exception:  # noqa: BLE001
                    pass
            continue
        try:
            rec["variant"], rec["label"] = desc, short
            rec["params"] = sum(p.numel() for p in params)
            rec["first_step_s"] = first
            rec.update(time_steps(torch, step, reps, warm_done=1))
            rec["base_mem_bytes"] = base
            rec["attempts"].append({"impl": desc, "error": None})
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        del step, opt, params, model, loss_fn
        cleanup(torch)
        return rec
    rec["error"] = "no twin variant ran (attempts above)"
    return rec


# ============================================================================ main

def gib(x):
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) else "-"


def print_plan(a, cfgs):
    print(f"linmoe library: {a.lib} ({'present' if os.path.exists(a.lib) else 'MISSING'})")
    print(f"json: {a.json}; reps {2 if a.quick else 5} after {WARMUP} warm-ups")
    for path, raw in cfgs:
        B, T = int(raw.get("batch_size") or 8), int(raw.get("seq_len") or 4096)
        tot, act = param_counts(raw)
        fpt = flops_per_token(raw, T)
        kinds = _layer_kinds(raw)
        print(f"\n{os.path.relpath(path, ROOT)}: B = {B}, T = {T}, {B * T} tokens "
              f"({B * T - B} labelled), {tot / 1e6:.1f}M parameters ({act / 1e6:.1f}M active), "
              f"{fpt / 1e9:.3f} GFLOP per token (restated lm_model_train_flops_per_token)")
        print(f"  layers: {''.join('K' if k == 'kda' else 'A' for k in kinds)} "
              f"(A = full attention at 0-based {[i for i, k in enumerate(kinds) if k == 'attn']}), "
              f"residual {raw.get('residual', 'standard')}, "
              f"MoE from layer {raw.get('first_k_dense_replace', 0)}")
        ids = linmoe_ids(1, 4, int(raw["vocab_size"]))
        print(f"  batch ids (bench_model_gpu.c's LCG): {ids} ...")
        kw, why = fla_kwargs(raw, T)
        peers = []
        if kw is not None and "fla" in a.peers:
            peers.append("fla")
        if (kw is None or a.twin_all) and "twin" in a.peers:
            peers.append("twin")
        print(f"  peers: {', '.join(peers) or 'none'}")
        if kw is not None:
            print("  fla KDAConfig: " + json.dumps(kw))
        else:
            print(f"  fla KDAForCausalLM: not mapped ({why})")
        if "twin" in peers:
            for ar, comp in twin_variants(raw, not a.no_compile, a.twin_attnres):
                print(f"  twin variant: {'torch.compile' if comp else 'eager'}, AttnRes "
                      f"{'fla fused_attnres' if ar else 'torch'}"
                      if raw.get("residual", "standard") != "standard" else
                      f"  twin variant: {'torch.compile' if comp else 'eager'}")


def main():
    ap = argparse.ArgumentParser(description="linmoe bench model --device cuda beside fla's "
                                 "KDAForCausalLM and the PyTorch + fla twin")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--peers", default="fla,twin", help="which peers may run (fla, twin)")
    ap.add_argument("--twin-all", action="store_true",
                    help="also run the twin on the configs fla's model takes")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="the twin without torch.compile")
    ap.add_argument("--twin-attnres", choices=("auto", "fla", "torch"), default="auto",
                    help="the twin's AttnRes: fla's fused_attnres, torch, or fla then torch")
    ap.add_argument("--autotune", default="full",
                    help="Triton autotuning of the peers' kernels (scripts/gpu/triton_pin.py): "
                         "full (every config, what a user gets; minutes on a fresh machine), "
                         "first (each kernel's first config), pinned:FILE (the configs fla's "
                         "autotuner selected in an earlier run, e.g. "
                         "docs/perf/h200-2026-12-02c/triton_best.json)")
    ap.add_argument("--skip-linmoe", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_model.json"))
    ap.add_argument("--lib", default=os.environ.get("LINMOE_CUDA_LIB", os.path.join(
        ROOT, os.environ.get("LINMOE_GPU_DIR", "build-gpu"), "liblinmoe_cuda.so")))
    a = ap.parse_args()
    a.peers = {p for p in a.peers.split(",") if p}
    bad = a.peers - {"fla", "twin"}
    if bad:
        print(f"bench_model: unknown peers {sorted(bad)} (fla, twin)", file=sys.stderr)
        return 2
    cfgs = []
    for c in (x for x in a.configs.split(",") if x):
        path = c if os.path.isabs(c) else os.path.join(ROOT, c)
        try:
            with open(path) as f:
                cfgs.append((path, json.load(f)))
        except (OSError, ValueError) as e:
            print(f"bench_model: cannot read config {path}: {e}", file=sys.stderr)
            return 2
    if a.dry_run:
        print_plan(a, cfgs)
        return 0

    import torch
    if not torch.cuda.is_available():
        print("bench_model: no CUDA device", file=sys.stderr)
        return 1
    torch.cuda.init()
    sys.path.insert(0, os.path.join(ROOT, "peers", "fla"))  # fla's source, git-ignored
    sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
    import triton_pin
    how = triton_pin.patch(a.autotune)
    if how:
        print(f"bench_model: {how}")
    attn_impl = "-"
    if "fla" in a.peers or "twin" in a.peers:
        try:
            import transformers  # noqa: F401  (imported before the stand-in is visible)
        except Exception as e:  # noqa: BLE001
            print(f"bench_model: transformers does not import ({e}); fla's model will fail")
        attn_impl = install_flash_attn_standin()
        print(f"fla's attention layers: {attn_impl}")

    lib = None
    if not a.skip_linmoe:
        try:
            lib = ctypes.CDLL(a.lib)
            lib.lm_bench_model_gpu_run.restype = ctypes.c_int
            lib.lm_bench_model_gpu_run.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
        except (OSError, AttributeError) as e:
            print(f"bench_model: cannot load {a.lib}: {e}; linmoe rows skipped")
            lib = None
    reps = 2 if a.quick else 5
    dev = torch.cuda.get_device_name(0)
    out = {"bench": "model", "device": dev, "torch": torch.__version__, "reps": reps,
           "triton_autotune": a.autotune,
           "warmup": WARMUP, "attention_for_fla": attn_impl, "records": [], "comparisons": []}
    torch_rate = [None]

    def dump():
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)

    def rate_for(rec_l):
        if rec_l and rec_l.get("matmul_tflops"):
            return rec_l["matmul_tflops"], "linmoe (same run)"
        if torch_rate[0] is None:
            torch_rate[0] = measure_matmul_tflops(torch)
        return torch_rate[0], "torch 8192^3 bf16 matmul (linmoe did not run)"

    for path, raw in cfgs:
        name = os.path.splitext(os.path.basename(path))[0]
        B, T = int(raw.get("batch_size") or 8), int(raw.get("seq_len") or 4096)
        V = int(raw["vocab_size"])
        print(f"\n=== {name}: B = {B}, T = {T} ===")
        rec_l = None
        if lib is not None:
            rec_l = run_linmoe(lib, path, a.quick)
            rec_l.update({"config": name, "config_path": os.path.relpath(path, ROOT)})
            out["records"].append(rec_l)
            dump()
            cleanup(torch)
        ok_l = rec_l is not None and not rec_l.get("error")
        fpt_py = flops_per_token(raw, T)
        if ok_l and abs(rec_l["flops_per_token"] - fpt_py) > 1e-6 * fpt_py:
            print(f"  note: linmoe's FLOPs per token {rec_l['flops_per_token']:.6g} differ from "
                  f"this script's restatement {fpt_py:.6g}")
        fpt = rec_l["flops_per_token"] if ok_l else fpt_py
        ids = linmoe_ids(B, T, V)
        kw, why = fla_kwargs(raw, T)
        todo = []
        if kw is not None and "fla" in a.peers:
            todo.append("fla")
        if (kw is None or a.twin_all) and "twin" in a.peers:
            todo.append("twin")
        if kw is None and "fla" in a.peers:
            print(f"  fla KDAForCausalLM: not run, the config does not map to it ({why})")
        for peer in todo:
            t0 = time.time()
            print(f"  {peer}: running ...")
            if peer == "fla":
                rec = run_fla(torch, raw, ids, B, T, reps, attn_impl)
            else:
                rec = run_twin(torch, path, ids, B, T, reps, not a.no_compile, a.twin_attnres)
            cleanup(torch)  # what the run's frames held, now released
            rec.update({"config": name, "B": B, "T": T, "wall_s": time.time() - t0})
            if not rec.get("error"):
                rate, src = rate_for(rec_l if ok_l else None)
                rec["tokens_per_s"] = B * T / (rec["ms_step"] * 1e-3)
                rec["flops_per_token"] = fpt
                rec["flops_source"] = "linmoe" if ok_l else "restatement (linmoe did not run)"
                rec["matmul_tflops"], rec["matmul_source"] = rate, src
                rec["mfu"] = fpt * rec["tokens_per_s"] / (rate * 1e12)
                lp = f", linmoe {rec_l['params'] / 1e6:.3f}M" if ok_l and "params" in rec_l else ""
                print(f"  {rec.get('label') or rec['impl']}: {rec['ms_step']:.1f} ms/step, loss "
                      f"{rec['loss']:.4f}, first step {rec['first_step_s']:.1f} s, "
                      f"{rec.get('params', 0) / 1e6:.3f}M parameters{lp} ({rec['wall_s']:.0f} s "
                      f"in all)")
            else:
                print(f"  {rec['impl']}: FAILED: {rec['error']}")
            out["records"].append(rec)
            if ok_l and not rec.get("error"):
                out["comparisons"].append({
                    "config": name, "peer": rec.get("label") or rec["impl"],
                    "peer_over_linmoe_ms": rec["ms_step"] / rec_l["ms_step"],
                    "linmoe_peak_mem_bytes": rec_l["peak_mem_bytes"],
                    "peer_peak_mem_bytes": rec["peak_mem_bytes"],
                    "peer_max_allocated_bytes": rec["max_allocated_bytes"]})
            dump()

    print(f"\n{'config':<11} {'implementation':<40} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6} "
          f"{'peak GiB':>8} {'alloc GiB':>9} {'base GiB':>8} {'loss':>7}")
    for r in out["records"]:
        label = r.get("label") or r["impl"]
        if r["impl"].startswith("fla"):
            label += " (SDPA stand-in)" if "stand-in" in r.get("attention", "") else ""
        if r.get("error"):
            print(f"{r['config']:<11} {label[:40]:<40} failed: {r['error'][:120]}")
            continue
        print(f"{r['config']:<11} {label[:40]:<40} {r['ms_step']:>9.2f} {r['tokens_per_s']:>10.0f} "
              f"{100 * r['mfu']:>5.1f}% {gib(r.get('peak_mem_bytes')):>8} "
              f"{gib(r.get('max_allocated_bytes')):>9} {gib(r.get('base_mem_bytes')):>8} "
              f"{r.get('loss', float('nan')):>7.4f}")
    for r in out["records"]:
        if r.get("variant"):
            print(f"{r['config']}: {r['label']} = {r['variant']}")
        for t in r.get("attempts", []):
            if t.get("error"):
                print(f"{r['config']}: twin [{t['impl']}] did not run: {t['error'][:200]}")
    for c in out["comparisons"]:
        print(f"{c['config']}: {c['peer']} / linmoe = {c['peer_over_linmoe_ms']:.2f}x ms/step "
              f"(> 1: linmoe faster); peak memory linmoe {gib(c['linmoe_peak_mem_bytes'])} GiB vs "
              f"{gib(c['peer_peak_mem_bytes'])} GiB device used "
              f"({gib(c['peer_max_allocated_bytes'])} GiB max allocated by torch)")
    print("peak GiB: total - free after the timed steps (context included); alloc: torch's "
          "max_memory_allocated; base: device memory in use before the peer was built")
    print(f"json: {a.json}")
    return 0 if all(not r.get("error") for r in out["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
