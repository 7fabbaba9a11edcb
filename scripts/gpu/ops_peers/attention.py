"""Peers of bench/bench_ops_attention.c: causal softmax attention, bf16, D = 128, NoPE.

  dense rows   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
               enable_gqa=True) on [B, H, T, D] views of [B, T, H, D] tensors (linmoe's
               layout); the flash backend is tried first (sdpa_kernel(FLASH_ATTENTION)),
               the default dispatch when flash refuses the call ("peer" says which ran).
  varlen rows  torch.nn.attention.varlen.varlen_attn (flash-attention varlen kernel) on
               [T, H, D] with cu_seqlens of the 8 documents; where it is absent or refuses
               GQA, SDPA per document in a Python loop ("peer" says which).
  decode row   SDPA of one query per row against the full cache [B, Hkv, L, D] (enable_gqa).
fwd+bwd is o = attn(q, k, v); o.backward(do) with the gradients of q, k, v.
The shape / pass strings are exactly those of the C rows. The C side times three
implementations per shape ("attention" the default, "attention_own" linmoe's kernels,
"attention_nondet" the default with cuDNN's atomic dQ, fwd+bwd only); each gets the same
peer measurement (copied rows, timed once).
"""

import inspect

DENSE = [(8, 4096, 8, 8), (8, 4096, 16, 4), (4, 8192, 8, 8), (4, 8192, 16, 4)]
VARLEN = [(16, 4), (8, 8)]
DOCS = [8192, 2048, 6144, 1024, 4096, 3072, 5120, 3072]
D = 128


def _err(name, shape, peer, e):
    return [{"name": name, "shape": shape, "pass": p, "ms": None, "peer": peer,
             "error": repr(e)[:200]} for p in ("fwd", "fwd+bwd")]


def _time_pair(do_bench, fwd, leaves, do):
    import torch

    def f():
        with torch.no_grad():
            fwd()

    def fb():
        for t in leaves:
            t.grad = None
        fwd().backward(do)

    return do_bench(f), do_bench(fb)


def _dense(do_bench, B, T, Hq, Hkv):
    import torch
    import torch.nn.functional as F
    shape = f"B={B} T={T} H={Hq}/{Hkv} D={D}"
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dt).requires_grad_()
    k = torch.randn(B, T, Hkv, D, device=dev, dtype=dt).requires_grad_()
    v = torch.randn(B, T, Hkv, D, device=dev, dtype=dt).requires_grad_()
    do = torch.randn(B, Hq, T, D, device=dev, dtype=dt)

    def fwd():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True, enable_gqa=True)

    peer = "torch sdpa flash (enable_gqa)"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fwd().backward(do)
            torch.cuda.synchronize()

            def fwd_flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return fwd()
        ms_f, ms_fb = _time_pair(do_bench, fwd_flash, (q, k, v), do)
    except Exception:  # noqa: BLE001  flash refused (GQA, version): default dispatch
        peer = "torch sdpa default (enable_gqa)"
        try:
            ms_f, ms_fb = _time_pair(do_bench, fwd, (q, k, v), do)
        except Exception as e:  # noqa: BLE001
            return _err("attention", shape, peer, e)
    return [{"name": "attention", "shape": shape, "pass": "fwd", "ms": ms_f, "peer": peer},
            {"name": "attention", "shape": shape, "pass": "fwd+bwd", "ms": ms_fb, "peer": peer}]


def _varlen(do_bench, Hq, Hkv):
    import torch
    import torch.nn.functional as F
    T = sum(DOCS)
    shape = f"varlen8 T={T} H={Hq}/{Hkv} D={D}"
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(T, Hq, D, device=dev, dtype=dt).requires_grad_()
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt).requires_grad_()
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt).requires_grad_()
    do = torch.randn(T, Hq, D, device=dev, dtype=dt)
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, device=dev, dtype=torch.int32)
    mx = max(DOCS)
    try:
        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
        kw = {}
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise RuntimeError("varlen_attn has neither is_causal nor window_size")
        if "enable_gqa" in params:
            kw["enable_gqa"] = True

        def fwd():
            return varlen_attn(q, k, v, cu_t, cu_t, mx, mx, **kw)

        fwd().backward(do)
        torch.cuda.synchronize()
        peer = "torch varlen_attn (flash varlen)"
    except Exception:  # noqa: BLE001  no varlen API (or no GQA in it): SDPA per document
        peer = "torch sdpa per document (enable_gqa)"

        def fwd():
            outs = []
            for a, b in zip(cu[:-1], cu[1:]):
                outs.append(F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1).unsqueeze(0), k[a:b].transpose(0, 1).unsqueeze(0),
                    v[a:b].transpose(0, 1).unsqueeze(0), is_causal=True,
                    enable_gqa=True)[0].transpose(0, 1))
            return torch.cat(outs, 0)
    try:
        ms_f, ms_fb = _time_pair(do_bench, fwd, (q, k, v), do)
    except Exception as e:  # noqa: BLE001
        return _err("attention", shape, peer, e)
    return [{"name": "attention", "shape": shape, "pass": "fwd", "ms": ms_f, "peer": peer},
            {"name": "attention", "shape": shape, "pass": "fwd+bwd", "ms": ms_fb, "peer": peer}]


def _decode(do_bench):
    import torch
    import torch.nn.functional as F
    B, L, Hq, Hkv = 32, 8192, 16, 4
    shape = f"B={B} L={L} H={Hq}/{Hkv} D={D}"
    peer = "torch sdpa (enable_gqa), one query"
    try:
        dev, dt = "cuda", torch.bfloat16
        q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
        kc = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
        vc = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)

        def step():
            return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)

        ms = do_bench(step)
        return [{"name": "attention_decode", "shape": shape, "pass": "step", "ms": ms,
                 "peer": peer}]
    except Exception as e:  # noqa: BLE001
        return [{"name": "attention_decode", "shape": shape, "pass": "step", "ms": None,
                 "peer": peer, "error": repr(e)[:200]}]


def run(do_bench, quick):
    import torch
    rows = []
    for i, (B, T, Hq, Hkv) in enumerate(DENSE):
        if quick and i != 0:
            continue
        rows += _dense(do_bench, B, T, Hq, Hkv)
        torch.cuda.empty_cache()
    for i, (Hq, Hkv) in enumerate(VARLEN):
        if quick and i != 0:
            continue
        rows += _varlen(do_bench, Hq, Hkv)
        torch.cuda.empty_cache()
    rows += _decode(do_bench)
    torch.cuda.empty_cache()
    extra = []
    for r in rows:
        if r["name"] != "attention":
            continue
        extra.append(dict(r, name="attention_own"))
        if r["pass"] == "fwd+bwd":
            extra.append(dict(r, name="attention_nondet"))
    return rows + extra
