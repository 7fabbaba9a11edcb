"""Peers of bench/bench_ops_norm.c on the same shapes and dtypes (bf16 activations and
weights): fla's fused Triton norms and torch's rms_norm (eager and torch.compile).

Rows (name, shape, pass) are exactly bench_ops_norm.c's:
  rmsnorm           N=32768 D=1024|2048     fwd, fwd+bwd   fla RMSNorm; F.rms_norm
  rmsnorm_residual  N=32768 D=1024|2048     fwd, fwd+bwd   fla RMSNorm(x, residual,
                    prenorm=True) -> (y, h); torch: h = x + r, rms_norm(h)
  gated_rmsnorm     N=32768 H=8|16 Dh=128   fwd, fwd+bwd   fla FusedRMSNormGated
                    (activation 'sigmoid'); torch: rms_norm(x) * sigmoid(g)
fwd+bwd is the forward plus torch.autograd.grad of every input and the weight with
random upstream gradients (for the residual form: dy for y and dr for h, as linmoe's
dresidual). A peer that cannot be imported or run gives a row with ms None and the error.
"""

N = 32768
EPS = 1e-6
GATED_EPS = 1e-5


def _shapes():
    for D in (1024, 2048):
        yield "rmsnorm", f"N={N} D={D}", (D,)
    for D in (1024, 2048):
        yield "rmsnorm_residual", f"N={N} D={D}", (D,)
    for H in (8, 16):
        yield "gated_rmsnorm", f"N={N} H={H} Dh=128", (H, 128)


def _make_fns(name, dims, impl):
    """(forward(), backward-inputs) closures for one implementation."""
    import torch
    import torch.nn.functional as F
    dev, bf = "cuda", torch.bfloat16
    if name == "gated_rmsnorm":
        H, Dh = dims
        x = torch.randn(N, H, Dh, device=dev, dtype=bf, requires_grad=True)
        g = torch.randn(N, H, Dh, device=dev, dtype=bf, requires_grad=True)
        w = (1 + 0.1 * torch.randn(Dh, device=dev)).to(bf).requires_grad_(True)
        dy = torch.randn(N, H, Dh, device=dev, dtype=bf)
        if impl == "fla":
            from fla.modules.fused_norm_gate import FusedRMSNormGated
            m = FusedRMSNormGated(Dh, eps=GATED_EPS, activation="sigmoid").to(dev, bf)
            with torch.no_grad():
                m.weight.copy_(w)
            return (lambda: m(x, g)), [x, g, m.weight], [dy]

        def f(x, g, w):
            return F.rms_norm(x, (Dh,), w, GATED_EPS) * torch.sigmoid(g)
        if impl == "torch.compile":
            f = torch.compile(f)
        return (lambda: f(x, g, w)), [x, g, w], [dy]
    (D,) = dims
    x = torch.randn(N, D, device=dev, dtype=bf, requires_grad=True)
    w = (1 + 0.1 * torch.randn(D, device=dev)).to(bf).requires_grad_(True)
    dy = torch.randn(N, D, device=dev, dtype=bf)
    res = name == "rmsnorm_residual"
    r = torch.randn(N, D, device=dev, dtype=bf, requires_grad=True) if res else None
    dr = torch.randn(N, D, device=dev, dtype=bf) if res else None
    if impl == "fla":
        from fla.modules import RMSNorm
        m = RMSNorm(D, eps=EPS).to(dev, bf)
        with torch.no_grad():
            m.weight.copy_(w)
        if res:
            return (lambda: m(x, residual=r, prenorm=True)), [x, r, m.weight], [dy, dr]
        return (lambda: m(x)), [x, m.weight], [dy]

    if res:
        def f(x, r, w):
            h = x + r
            return F.rms_norm(h, (D,), w, EPS), h
    else:
        def f(x, w):
            return F.rms_norm(x, (D,), w, EPS)
    if impl == "torch.compile":
        f = torch.compile(f)
    if res:
        return (lambda: f(x, r, w)), [x, r, w], [dy, dr]
    return (lambda: f(x, w)), [x, w], [dy]


def run(do_bench, quick):
    import torch
    impls = ["fla", "torch", "torch.compile"]
    rows = []
    for name, shape, dims in _shapes():
        for impl in impls:
            peer = {"fla": "fla RMSNorm" if name != "gated_rmsnorm" else "fla FusedRMSNormGated",
                    "torch": "torch F.rms_norm", "torch.compile": "torch.compile rms_norm"}[impl]
            try:
                fwd, ins, grads = _make_fns(name, dims, impl)

                def fwd_only():
                    with torch.no_grad():
                        return fwd()

                def fwd_bwd():
                    out = fwd()
                    outs = list(out) if isinstance(out, tuple) else [out]
                    return torch.autograd.grad(outs, ins, grads)

                fwd_bwd()  # compile / autotune outside the timing
                rows.append({"name": name, "shape": shape, "pass": "fwd",
                             "ms": do_bench(fwd_only), "peer": peer})
                rows.append({"name": name, "shape": shape, "pass": "fwd+bwd",
                             "ms": do_bench(fwd_bwd), "peer": peer})
            except Exception as e:  # noqa: BLE001 - report, do not stop the run
                for p in ("fwd", "fwd+bwd"):
                    rows.append({"name": name, "shape": shape, "pass": p, "ms": None,
                                 "peer": peer, "error": repr(e)[:200]})
            torch.cuda.empty_cache()
    return rows
