"""Self-checks of linmoe_ref that need no fla (run locally, CPU, a few seconds):

  1. chunked KDA == token-by-token KDA in fp64 (rel err < 1e-10; T not a multiple of the
     chunk, bounded and unbounded decays, initial state, chunk 16/32/64);
  2. torch.autograd.gradcheck (fp64 finite differences) of the KDA forms, the short conv,
     attention (RoPE, packed), AttnRes, the gates, the MoE layer, and a central-difference
     spot check of d loss / d param on the whole model;
  3. a packed batch (cu_seqlens, with an empty and a length-1 document) equals per-document
     runs: logits, and the gradients of the summed token losses;
  4. the model runs in fp64 and fp32 in both KDA modes; fp32 vs fp64 differences reported;
  5. checkpoint round trip (config.json + model.safetensors).

    /usr/bin/python3 scripts/reference/selftest.py
"""

import os
import sys
import tempfile

import torch

sys.dont_write_bytecode = True  # no __pycache__ next to the sources
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import linmoe_ref as R  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAILED = []


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check(name, err, tol):
    ok = err <= tol
    print(f"  {name:64s} {err:10.3e}  (tol {tol:.0e})  {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILED.append(name)


def gradcheck(name, fn, inputs):
    ok = torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6, raise_exception=False)
    print(f"  gradcheck {name:54s} {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILED.append("gradcheck " + name)


def tiny_cfg(**over):
    c = R.Config.load(os.path.join(REPO, "configs", "tiny.json"))
    raw = dict(c.raw)
    raw.update(over)
    return R.Config(raw)


def fixture_like_params(cfg, seed):
    """Weights of a useful size (the model init is too small to test anything)."""
    p = R.init_params(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, shape, kind in R.param_table(cfg):
        if kind in ("matrix", "embed"):
            p[name] = torch.randn(shape, generator=g, dtype=torch.float64) / (shape[-1] ** 0.5 if kind == "matrix" else 1)
        elif kind == "norm":
            p[name] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif kind == "ar_query":
            p[name] = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif kind == "buffer":
            p[name] = 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif kind == "A_log" and cfg.gate[R._layer_of(name)] == "bounded":
            p[name] = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    return p


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    n = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731

    print("1. chunked vs token-by-token KDA (fp64)")
    for gate in ("moderate", "bounded", "strong"):
        B, T, H, K, V = 2, 133, 2, 16, 12
        q, k = R.l2norm(n(B, T, H, K)), R.l2norm(n(B, T, H, K))
        v, beta, h0 = n(B, T, H, V), torch.sigmoid(n(B, T, H)), n(B, H, K, V)
        g = {"moderate": torch.nn.functional.logsigmoid(n(B, T, H, K)),
             "bounded": -5 * torch.sigmoid(2 * n(B, T, H, K)),
             "strong": -16 * torch.nn.functional.softplus(2 * n(B, T, H, K))}[gate]
        o1, s1 = R.kda_recurrent(q, k, v, g, beta, initial_state=h0)
        for C in (16, 32, 64):
            for diag in ("auto", "safe") + (("shared",) if gate != "strong" else ()):
                o2, s2 = R.kda_chunk(q, k, v, g, beta, initial_state=h0, chunk_size=C, diag=diag)
                check(f"kda_chunk C={C} {diag:6s} vs kda_recurrent [{gate}] o / state",
                      max(rel(o2, o1), rel(s2, s1)), 1e-10)
        # fp32: 'auto' must pick a path that cannot overflow, whatever the decay
        f32 = [t.float() for t in (q, k, v, g, beta, h0)]
        o3, _ = R.kda_chunk(*f32[:5], initial_state=f32[5])
        check(f"kda_chunk fp32 auto vs fp64 recurrent [{gate}] o", rel(o3, o1), 1e-4)
    try:
        R.kda_chunk(q, k, v, g, beta, diag="shared")
        check("kda_chunk diag='shared' refuses a decay it cannot represent", 1.0, 0.0)
    except ValueError:
        check("kda_chunk diag='shared' refuses a decay it cannot represent", 0.0, 0.0)
    o1, _ = R.kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    o2, _ = R.kda_chunk(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    check("kda_chunk vs kda_recurrent, T = 1", rel(o2, o1), 1e-12)

    print("2. gradients (torch.autograd.gradcheck, fp64)")
    B, T, H, K, V = 1, 21, 2, 4, 3
    rq = lambda *s: n(*s).requires_grad_()  # noqa: E731
    q, k, v = rq(B, T, H, K), rq(B, T, H, K), rq(B, T, H, V)
    g = (-torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64).requires_grad_()
    h0 = rq(B, H, K, V)
    gradcheck("kda_recurrent", lambda *a: R.kda_recurrent(*a[:5], None, a[5]), (q, k, v, g, beta, h0))
    gradcheck("kda_chunk (C=16, 2 chunks)", lambda *a: R.kda_chunk(*a[:5], None, a[5], chunk_size=16),
              (q, k, v, g, beta, h0))
    seg = R.Segments(1, T, [0, 5, 5, 6, T])
    x, w = rq(1, T, 3), rq(3, 4)
    gradcheck("short_conv (packed)", lambda x_, w_: R.short_conv(x_, w_, seg), (x, w))
    qa, ka, va = rq(1, T, 4, 6), rq(1, T, 2, 6), rq(1, T, 2, 6)
    gradcheck("attention GQA RoPE (packed)", lambda a, b, c: R.attention(a, b, c, seg, "rope", 10000.0),
              (qa, ka, va))
    srcs = [rq(7, 8) for _ in range(4)]
    gradcheck("attnres", lambda qq, ww, *s: R.attnres(list(s), qq, ww, 1e-6), (rq(8), rq(8), *srcs))
    gr = rq(3, 5, 2, 4)
    gradcheck("gates", lambda z, A, dt: (R.kda_gate_softplus(z, A, dt), R.kda_gate_bounded(z, A, dt, -5.0)),
              (gr, rq(2), rq(8)))
    cfg = tiny_cfg()
    p = fixture_like_params(cfg, 3)
    mp = {kk: vv.clone().requires_grad_() for kk, vv in p.items() if ".layers.1.mlp." in kk and "bias" not in kk}
    pre = "model.layers.1.mlp."
    xm = rq(9, cfg.hidden_size)
    names = sorted(mp)

    def moe_fn(xx, *ws):
        d = dict(zip(names, ws))
        d[pre + "gate.e_score_correction_bias"] = p[pre + "gate.e_score_correction_bias"]
        return R.moe(xx, d, pre, cfg, R.Segments(1, 9))[0]
    gradcheck("moe (sigmoid router, shared expert)", moe_fn, (xm, *[mp[nm] for nm in names]))

    # whole model: central differences on a few entries of several parameters
    m = R.LinMoE(cfg, p, torch.float64, "chunk")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    lab = R.next_token_labels(ids)
    _, loss, _ = m(ids, lab)
    loss.backward()
    worst = 0.0
    pick = ["model.embed_tokens.weight", "model.layers.0.self_attn.A_log", "model.layers.1.self_attn.dt_bias",
            "model.layers.1.self_attn.q_conv1d.weight", "model.layers.2.self_attn.k_proj.weight",
            "model.layers.3.mlp.experts.up_proj", "model.layers.2.mlp.gate.weight",
            "model.layers.4.mlp_res.query", "model.attnres_final.norm.weight", "lm_head.weight",
            "model.layers.3.self_attn.o_norm.weight", "model.layers.1.mlp.shared_experts.down_proj"]
    with torch.no_grad():
        for nm in pick:
            t = m.p[nm]
            flat = t.view(-1)
            for j in torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(7))[:3].tolist():
                old = flat[j].item()
                hstep = 1e-5
                flat[j] = old + hstep
                lp = m(ids, lab)[1].item()
                flat[j] = old - hstep
                lm_ = m(ids, lab)[1].item()
                flat[j] = old
                fd = (lp - lm_) / (2 * hstep)
                an = t.grad.view(-1)[j].item()
                worst = max(worst, abs(fd - an) / max(abs(an), 1e-3))
    check("model d loss / d param, central differences (36 entries)", worst, 1e-6)

    print("3. packed batch == per-document runs")
    for mode in ("recurrent", "chunk"):
        m = R.LinMoE(cfg, p, torch.float64, mode)
        T = 30
        cu = [0, 11, 11, 12, 25, T]
        ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(9))
        lab = R.next_token_labels(ids, cu)
        logits, loss, nl = m(ids, lab, cu)
        (loss * nl).backward()
        gpk = {kk: (m.p[kk].grad.clone() if m.p[kk].grad is not None else torch.zeros_like(m.p[kk]))
               for kk in m.param_names}
        m.zero_grad(set_to_none=True)
        parts = []
        for a, b in zip(cu, cu[1:]):
            if b == a:
                continue
            lg, ls, nd = m(ids[:, a:b], lab[:, a:b])
            parts.append(lg)
            if nd > 0:
                (ls * nd).backward()
        gdoc = {kk: (m.p[kk].grad.clone() if m.p[kk].grad is not None else torch.zeros_like(m.p[kk]))
                for kk in m.param_names}
        check(f"[{mode}] packed logits vs per-document logits", rel(logits, torch.cat(parts, 1)), 1e-12)
        check(f"[{mode}] packed grads vs per-document grads (worst)",
              max(rel(gpk[kk], gdoc[kk]) for kk in gpk if gdoc[kk].abs().max() > 0), 1e-12)

    print("4. fp64 / fp32, recurrent / chunk")
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(11))
    lab = R.next_token_labels(ids)
    out = {}
    for dt in (torch.float64, torch.float32):
        for mode in ("recurrent", "chunk"):
            m = R.LinMoE(cfg, p, dt, mode)
            lg, ls, _ = m(ids, lab)
            ls.backward()
            out[(dt, mode)] = (lg.detach(), ls.detach(), {kk: m.p[kk].grad for kk in m.param_names
                                                          if m.p[kk].grad is not None})
    ref = out[(torch.float64, "recurrent")]
    for key, (lg, ls, gr) in out.items():
        wg = max(rel(gr[kk], ref[2][kk]) for kk in gr)
        print(f"  {str(key[0]):14s} {key[1]:9s} loss {ls.item():.10f}  logits {rel(lg, ref[0]):.2e}  "
              f"worst grad {wg:.2e}")
        tol = 1e-10 if key[0] == torch.float64 else 1e-3
        check(f"{key[0]} {key[1]} vs fp64 recurrent (logits)", rel(lg, ref[0]), tol)

    print("5. checkpoint round trip")
    m = R.LinMoE(cfg, p, torch.float32)
    with tempfile.TemporaryDirectory() as d:
        m.save_checkpoint(d)
        m2 = R.LinMoE.from_checkpoint(d, torch.float32)
    check("from_checkpoint(save_checkpoint(p)) == p (worst)",
          max(rel(m2.p[kk], m.p[kk]) if m.p[kk].abs().max() > 0 else m2.p[kk].abs().max().item()
              for kk in m.p), 0.0)

    if FAILED:
        sys.exit("selftest FAILED: " + "; ".join(FAILED))
    print("selftest: all checks passed")


if __name__ == "__main__":
    main()
