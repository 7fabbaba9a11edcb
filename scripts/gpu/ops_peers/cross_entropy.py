"""Peers of bench/bench_ops_cross_entropy.c: the LM head + token cross-entropy, forward +
backward (dh and dW) and the forward alone, N = 32768 tokens, V = 50304, D = 1024 / 2048.

  fla FusedLinearCrossEntropyLoss   chunked fused head + loss (guarded: fla may be absent)
  F.linear + F.cross_entropy        what users write: the whole [N, V] bf16 logits exist
"""

N, V = 32768, 50304


def run(do_bench, quick):
    import torch
    import torch.nn.functional as F
    rows = []
    for D in (1024, 2048):
        shape = f"N={N} D={D} V={V}"
        h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        W = (torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, V, (N,), device="cuda")

        def torch_fb():
            h.grad = None
            W.grad = None
            F.cross_entropy(F.linear(h, W), y).backward()

        def torch_f():
            with torch.no_grad():
                return F.cross_entropy(F.linear(h, W), y)

        for pas, fn in (("fwd+bwd", torch_fb), ("fwd", torch_f)):
            peer = "torch linear+cross_entropy"
            try:
                rows.append({"name": "cross_entropy", "shape": shape, "pass": pas,
                             "ms": do_bench(fn), "peer": peer})
            except Exception as e:  # noqa: BLE001 (OOM and the like)
                rows.append({"name": "cross_entropy", "shape": shape, "pass": pas, "ms": None,
                             "peer": peer, "error": repr(e)[:200]})
            h.grad = None
            W.grad = None
            torch.cuda.empty_cache()

        peer = "fla FusedLinearCE"
        try:
            from fla.modules import FusedLinearCrossEntropyLoss
            crit = FusedLinearCrossEntropyLoss()

            def fla_fb():
                h.grad = None
                W.grad = None
                crit(h, y, W).backward()

            def fla_f():
                with torch.no_grad():
                    return crit(h, y, W)

            for pas, fn in (("fwd+bwd", fla_fb), ("fwd", fla_f)):
                try:
                    rows.append({"name": "cross_entropy", "shape": shape, "pass": pas,
                                 "ms": do_bench(fn), "peer": peer})
                except Exception as e:  # noqa: BLE001
                    rows.append({"name": "cross_entropy", "shape": shape, "pass": pas,
                                 "ms": None, "peer": peer, "error": repr(e)[:200]})
        except Exception as e:  # noqa: BLE001 - fla absent or incompatible
            for pas in ("fwd+bwd", "fwd"):
                rows.append({"name": "cross_entropy", "shape": shape, "pass": pas, "ms": None,
                             "peer": peer, "error": repr(e)[:200]})
        del h, W, y
        torch.cuda.empty_cache()
    return rows
