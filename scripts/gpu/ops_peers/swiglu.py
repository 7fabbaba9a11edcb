"""Peers of bench/bench_ops_swiglu.c on the same shapes (bf16): fla's fused swiglu
(fla.modules.activations.swiglu, Triton, its own backward) and torch's F.silu(g) * u
(eager and torch.compile), on g, u the two halves of one [N, 2F] tensor (linmoe's layout).

Rows (name, shape, pass) are exactly bench_ops_swiglu.c's:
  swiglu  N=32768 F=2688 | N=196608 F=512   fwd, fwd+bwd
fwd+bwd: the forward plus torch.autograd.grad of gu with a random dh (dgu [N, 2F]).
"""

SHAPES = [(32768, 2688), (32768 * 6, 512)]


def run(do_bench, quick):
    import torch
    import torch.nn.functional as F
    rows = []
    for N, Fd in SHAPES:
        shape = f"N={N} F={Fd}"
        for impl in ("fla", "torch", "torch.compile"):
            peer = {"fla": "fla swiglu", "torch": "torch silu(g)*u",
                    "torch.compile": "torch.compile silu(g)*u"}[impl]
            try:
                gu = torch.randn(N, 2 * Fd, device="cuda", dtype=torch.bfloat16,
                                 requires_grad=True)
                dh = torch.randn(N, Fd, device="cuda", dtype=torch.bfloat16)
                if impl == "fla":
                    from fla.modules.activations import swiglu as f
                else:
                    def f(g, u):
                        return F.silu(g) * u
                    if impl == "torch.compile":
                        f = torch.compile(f)

                def fwd():
                    with torch.no_grad():
                        return f(gu[:, :Fd], gu[:, Fd:])

                def fwd_bwd():
                    h = f(gu[:, :Fd], gu[:, Fd:])
                    return torch.autograd.grad(h, gu, dh)

                fwd_bwd()  # compile / autotune outside the timing
                rows.append({"name": "swiglu", "shape": shape, "pass": "fwd",
                             "ms": do_bench(fwd), "peer": peer})
                rows.append({"name": "swiglu", "shape": shape, "pass": "fwd+bwd",
                             "ms": do_bench(fwd_bwd), "peer": peer})
                del gu, dh
            except Exception as e:  # noqa: BLE001 - report, do not stop the run
                for p in ("fwd", "fwd+bwd"):
                    rows.append({"name": "swiglu", "shape": shape, "pass": p, "ms": None,
                                 "peer": peer, "error": repr(e)[:200]})
            torch.cuda.empty_cache()
    return rows
