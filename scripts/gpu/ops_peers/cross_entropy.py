"""Peers of bench/bench_ops_cross_entropy.c: the LM head + token cross-entropy, forward +
backward (dh and dW) and the forward alone, N = 32768 tokens, V = 50304, D = 1024 / 2048
(D = 1024 only with --quick, as the C side).

  F.linear + F.cross_entropy       what users write: the whole [N, V] bf16 logits exist;
                                   fwd: under no_grad (the loss only)
  fla FusedLinearCrossEntropyLoss  fla.modules.fused_linear_cross_entropy (the Liger-style
                                   chunked module), called as its forward documents:
                                   crit(x [N, D], target [N] int64, weight [V, D]); defaults:
                                   num_chunks 8 (chunks of 4096 tokens here, as linmoe's),
                                   accumulate_grad_in_fp32 = True, which casts each chunk's
                                   logits and x to fp32 and runs the dW addmm in fp32 (not
                                   TF32 unless torch allows it): that is fla's default and the
                                   one timed as "fla FusedLinearCE"; "fla FusedLinearCE bf16dW"
                                   is accumulate_grad_in_fp32 = False (bf16 GEMMs, dW summed
                                   across chunks in bf16: less precise than linmoe's fp32 dW).
                                   fla computes dh and dW inside its forward (the backward only
                                   scales them), so it has no loss-only path: no fwd rows.
No torch.compile (its compile time would dominate the run). Each timed call is 15-150 ms;
triton's do_bench (25 ms warm-up, 100 ms of repeats) keeps the whole family near 20 s,
most of it fla's first-call Triton compilation.
"""

N, V = 32768, 50304


def _row(shape, pas, peer, fn, do_bench):
    import torch
    try:
        ms = do_bench(fn)
        return {"name": "cross_entropy", "shape": shape, "pass": pas, "ms": ms, "peer": peer}
    except Exception as e:  # noqa: BLE001 (OOM, fla absent or incompatible)
        return {"name": "cross_entropy", "shape": shape, "pass": pas, "ms": None, "peer": peer,
                "error": repr(e)[:200]}
    finally:
        torch.cuda.empty_cache()


def run(do_bench, quick):
    import torch
    import torch.nn.functional as F
    rows = []
    for D in ((1024,) if quick else (1024, 2048)):
        shape = f"N={N} D={D} V={V}"
        h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        W = (torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, V, (N,), device="cuda")

        def clear():
            h.grad = None
            W.grad = None

        def torch_fb():
            clear()
            F.cross_entropy(F.linear(h, W), y).backward()

        def torch_f():
            with torch.no_grad():
                return F.cross_entropy(F.linear(h, W), y)

        peer = "torch linear+cross_entropy"
        rows.append(_row(shape, "fwd+bwd", peer, torch_fb, do_bench))
        clear()
        rows.append(_row(shape, "fwd", peer, torch_f, do_bench))

        try:
            from fla.modules import FusedLinearCrossEntropyLoss
            crits = [("fla FusedLinearCE", FusedLinearCrossEntropyLoss()),
                     ("fla FusedLinearCE bf16dW",
                      FusedLinearCrossEntropyLoss(accumulate_grad_in_fp32=False))]
        except Exception as e:  # noqa: BLE001 - fla absent or incompatible
            crits = []
            rows.append({"name": "cross_entropy", "shape": shape, "pass": "fwd+bwd", "ms": None,
                         "peer": "fla FusedLinearCE", "error": repr(e)[:200]})
        for peer, crit in crits:
            def fla_fb(crit=crit):
                clear()
                crit(h, y, W).backward()

            rows.append(_row(shape, "fwd+bwd", peer, fla_fb, do_bench))
            clear()
        del h, W, y
        torch.cuda.empty_cache()
    return rows
