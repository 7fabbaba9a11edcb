"""Peers of bench/bench_ops_attnres.c: the AttnRes aggregation op (one softmax over L = 9
sources of <query, RMSNorm(source)>, weights times the raw sources), N = 32768 tokens,
D = 2048 / 1024, forward and forward + backward (d sources, d query, d rms_weight).

  fla fused_attnres    fla.ops.attnres (Triton fwd + bwd), sources pre-stacked [L, N, D]
                       (its best case: a list would be stacked per call); guarded
  torch                plain PyTorch on the same stacked input: rms_norm, einsum, softmax,
                       weighted sum, in fp32
  torch.compile        the same function compiled (guarded)

Gradients come from torch.autograd.grad (written, not accumulated into .grad: the linmoe
rows "attnres" write them too). query and rms_weight are fp32, as linmoe's.
"""

N, L = 32768, 9
EPS = 1e-6


def _ref(q, res, w):
    import torch
    import torch.nn.functional as F
    x = res.float()
    k = F.rms_norm(x, (x.shape[-1],), w, EPS)
    p = torch.einsum("lnd,d->ln", k, q).softmax(0)
    return torch.einsum("ln,lnd->nd", p, x).to(res.dtype)


def _fla_fn():
    try:
        from fla.ops.attnres import fused_attnres
    except ImportError:
        from fla.ops.attnres.fused import fused_attnres
    return lambda q, res, w: fused_attnres(q, res, w, EPS, 1.0)


def run(do_bench, quick):
    import torch
    rows = []
    impls = [("torch", lambda: _ref)]
    impls.append(("torch.compile", lambda: torch.compile(_ref)))
    impls.append(("fla fused_attnres", _fla_fn))
    for D in (2048, 1024):
        shape = f"N={N} D={D} L={L}"
        res = torch.randn(L, N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        q = (torch.randn(D, device="cuda") * (2.0 / D ** 0.5)).requires_grad_()
        w = (1.0 + 0.1 * torch.randn(D, device="cuda")).requires_grad_()
        do = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        for peer, make in impls:
            try:
                f = make()
            except Exception as e:  # noqa: BLE001 - fla absent, compile unavailable
                for pas in ("fwd", "fwd+bwd"):
                    rows.append({"name": "attnres", "shape": shape, "pass": pas, "ms": None,
                                 "peer": peer, "error": repr(e)[:200]})
                continue

            def fwd(f=f):
                with torch.no_grad():
                    return f(q, res, w)

            def fwd_bwd(f=f):
                o = f(q, res, w)
                return torch.autograd.grad(o, (res, q, w), do)

            for pas, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                try:
                    ms = do_bench(fn)
                    rows.append({"name": "attnres", "shape": shape, "pass": pas, "ms": ms,
                                 "peer": peer})
                except Exception as e:  # noqa: BLE001 - Triton / inductor failure, OOM
                    rows.append({"name": "attnres", "shape": shape, "pass": pas, "ms": None,
                                 "peer": peer, "error": repr(e)[:200]})
                torch.cuda.empty_cache()
        del res, q, w, do
        torch.cuda.empty_cache()
    return rows
