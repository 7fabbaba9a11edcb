"""Peer of bench/bench_ops_adamw.c: torch.nn.utils.clip_grad_norm_(foreach=True) then
torch.optim.AdamW(fused=True) over 400 M fp32 parameters in 10 tensors of 40 M (weight
decay on every other one, as linmoe's segments), the same hyper-parameters. torch writes no
bf16 working copy (linmoe does: 2 of its 34 bytes per parameter).
"""

NSEG, SEG_N = 10, 40_000_000


def run(do_bench, quick):
    import torch
    shape = "params=400M segs=10"
    peer = "torch AdamW fused+clip"
    try:
        params = [torch.nn.Parameter(torch.randn(SEG_N, device="cuda") * 0.02)
                  for _ in range(NSEG)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-4
        groups = [{"params": params[0::2], "weight_decay": 0.1},
                  {"params": params[1::2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)

        def step():
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()

        ms = do_bench(step)
        rows = [{"name": "adamw", "shape": shape, "pass": "step", "ms": ms, "peer": peer}]
        del opt, params, groups
    except Exception as e:  # noqa: BLE001
        rows = [{"name": "adamw", "shape": shape, "pass": "step", "ms": None, "peer": peer,
                 "error": repr(e)[:200]}]
    torch.cuda.empty_cache()
    return rows
