"""Peer of bench/bench_ops_moe.c: a PyTorch grouped-GEMM MoE layer as torchtitan builds it
(torchtitan/models/moe: argsort of the expert ids, token groups padded to a multiple of 16
rows for torch._grouped_mm, offsets = cumsum of the padded counts, SwiGLU between the
grouped products, the weighted combine with index_add_), plus one shared SwiGLU expert as
three dense matmuls. bf16 everywhere, autograd for the backward. Same shapes and row names:

  moe       fwd      routing given (topk ids / weights): permute, 3 grouped GEMMs, SwiGLU,
                     combine, shared expert
  moe       fwd+bwd  the same and .backward(dy) (x and every expert weight need grad)
  moe_gemm  fwd      the three grouped GEMMs and the SwiGLU on the already permuted rows
  moe_gemm  fwd+bwd  those with their backward

The routing is the same kind as the C bench (random N(0, 1) logits, sigmoid scores,
normalised top-6, dropless), drawn with torch's generator, so the per-expert counts differ
from linmoe's run only by sampling noise.
"""

T = 32768
E, K, F, NS = 64, 6, 512, 1
ALIGN = 16  # rows per group multiple (torch._grouped_mm's bf16 offset alignment)


def shape_str(t, d):
    return f"T={t} D={d} E={E} k={K} F={F}"


def _route(torch, t, dev):
    g = torch.Generator(device=dev)
    g.manual_seed(4242)
    logits = torch.randn(t, E, device=dev, generator=g)
    s = torch.sigmoid(logits)
    w, idx = torch.topk(s, K, dim=-1)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w


def _permute(torch, topk_idx, t):
    """torchtitan's token-group permutation, in plain torch ops and with a static size (no
    host sync): sorted assignment i goes to row pos[i] of a buffer whose expert groups
    start at multiples of ALIGN; the buffer's slack rows (zeros) belong to the last group."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    m_pad = (t * K + E * ALIGN + ALIGN - 1) // ALIGN * ALIGN
    offs = torch.cumsum(padded, 0)
    start_pad = offs - padded
    start = torch.cumsum(counts, 0) - counts
    se = flat[order]
    pos = start_pad[se] + (torch.arange(t * K, device=flat.device) - start[se])
    offs = offs.to(torch.int32)
    offs[-1] = m_pad
    return order, pos, offs, m_pad


def run(do_bench, quick):
    import torch
    import torch.nn.functional as Fn

    dev, bf = "cuda", torch.bfloat16
    t = 8192 if quick else T
    rows = []
    peer = "torch._grouped_mm (torchtitan)"
    # torch 2.11: aten::_grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None,
    # Tensor? bias=None, ScalarType? out_dtype=None); offs: int32 group ends, 2-D x 3-D for
    # the forward (autograd gives the 2-D x 2-D weight gradients). The public wrapper
    # torch.nn.functional.grouped_mm(mat_a, mat_b, *, offs=...) calls the same kernel.
    gm = getattr(torch, "_grouped_mm", None) or getattr(Fn, "grouped_mm", None)
    for d in (1024, 2048):
        shape = shape_str(t, d)
        try:
            if gm is None:
                raise RuntimeError("torch._grouped_mm is not in this torch")
            fs = NS * F

            def param(*s, std):
                return (torch.randn(*s, device=dev, dtype=bf) * std).requires_grad_()

            w1 = param(E, F, d, std=d ** -0.5)   # experts.gate_proj [E, F, D]
            w3 = param(E, F, d, std=d ** -0.5)   # experts.up_proj
            w2 = param(E, d, F, std=F ** -0.5)   # experts.down_proj [E, D, F]
            s1 = param(fs, d, std=d ** -0.5)
            s3 = param(fs, d, std=d ** -0.5)
            s2 = param(d, fs, std=fs ** -0.5)
            x = torch.randn(t, d, device=dev, dtype=bf).requires_grad_()
            dy = torch.randn(t, d, device=dev, dtype=bf)
            topk_idx, topk_w = _route(torch, t, dev)
            topk_w = topk_w.to(bf)

            def experts(xs, offs):
                h = Fn.silu(gm(xs, w1.transpose(-2, -1), offs=offs)) * \
                    gm(xs, w3.transpose(-2, -1), offs=offs)
                return gm(h, w2.transpose(-2, -1), offs=offs)

            def layer():
                order, pos, offs, m_pad = _permute(torch, topk_idx, t)
                tok = order // K
                xs = x.new_zeros(m_pad, d)
                xs = xs.index_copy(0, pos, x[tok])
                ys = experts(xs, offs)
                yr = ys[pos] * topk_w.reshape(-1)[order, None]
                out = torch.zeros(t, d, device=dev, dtype=bf).index_add(0, tok, yr)
                sh = (Fn.silu(x @ s1.t()) * (x @ s3.t())) @ s2.t()
                return out + sh

            def fwd():
                with torch.no_grad():
                    layer()

            def fwdbwd():
                layer().backward(dy)

            rows.append({"name": "moe", "shape": shape, "pass": "fwd", "ms": do_bench(fwd),
                         "peer": peer})
            rows.append({"name": "moe", "shape": shape, "pass": "fwd+bwd",
                         "ms": do_bench(fwdbwd), "peer": peer})

            order, pos, offs, m_pad = _permute(torch, topk_idx, t)
            xs0 = torch.zeros(m_pad, d, device=dev, dtype=bf)
            xs0[pos] = x.detach()[order // K]
            xs_g = xs0.clone().requires_grad_()
            dys = torch.randn(m_pad, d, device=dev, dtype=bf)

            def gfwd():
                with torch.no_grad():
                    experts(xs0, offs)

            def gfwdbwd():
                experts(xs_g, offs).backward(dys)

            rows.append({"name": "moe_gemm", "shape": shape, "pass": "fwd", "ms": do_bench(gfwd),
                         "peer": peer})
            rows.append({"name": "moe_gemm", "shape": shape, "pass": "fwd+bwd",
                         "ms": do_bench(gfwdbwd), "peer": peer})
            del w1, w2, w3, s1, s2, s3, x, dy, xs0, xs_g, dys
        except Exception as e:  # noqa: BLE001 - report, do not stop the run
            for name in ("moe", "moe_gemm"):
                for p in ("fwd", "fwd+bwd"):
                    if not any(r["name"] == name and r["shape"] == shape and r["pass"] == p
                               for r in rows):
                        rows.append({"name": name, "shape": shape, "pass": p, "ms": None,
                                     "peer": peer, "error": repr(e)[:200]})
        torch.cuda.empty_cache()
    return rows
