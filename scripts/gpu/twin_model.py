#!/usr/bin/env python3
"""twin_model: a PyTorch + fla twin of linmoe's model, the peer of `linmoe bench model
--device cuda` for MoE configs (scripts/gpu/bench_model.py, issue 22 item 5).

The architecture is linmoe's (include/linmoe/model.h, kda_layer.h, attn_layer.h, moe.h,
moe_router.h; reference/attnres_ctx.md), as restated by the PyTorch reference
scripts/reference/linmoe_ref.py, whose Config, param_table and torch formulas this module
reuses. What differs from linmoe_ref is how each piece runs: the fast implementations a
PyTorch user would pick on a GPU, in bf16 autocast with fp32 master parameters.

  piece                        impl.fla = True (GPU)                   impl.fla = False (any)
  KDA op + gate + q/k L2 norm  fla chunk_kda(use_gate_in_kernel,       linmoe_ref kda_chunk and
  + beta sigmoid               use_qk_l2norm_in_kernel,                its gate / l2norm
                               use_beta_sigmoid_in_kernel; bounded:
                               safe_gate=True, lower_bound)
  short convolution + SiLU     fla ShortConvolution (Triton)           depthwise F.conv1d
  RMSNorm (pre-norms, final)   fla RMSNorm (Triton; the standard       own fp32 formula
                               residual's add fused in, prenorm=True)
  gated head norm              fla FusedRMSNormGated('sigmoid', 1e-5)  own fp32 formula
  RoPE                         fla RotaryEmbedding (half split)        linmoe_ref rope
  attention                    torch SDPA (causal, enable_gqa)         SDPA, or an explicit
                                                                       masked softmax (torch<2)
  dense SwiGLU, shared expert  fla swiglu_linear                       F.silu(g) * u, matmul
  Block AttnRes + its          fla fused_attnres(output_rms_weight=    own fp32 formula
  pre-norm                     the pre-norm) when impl.attnres_fla     (torch.compile'd when
                                                                       impl.compile)
  cross-entropy                fla FusedLinearCrossEntropyLoss         F.linear + F.cross_entropy
  routed experts               always: fp32 router, sigmoid scores, biased top-k selection,
                               weights normalised over the k unbiased scores, the
                               torchtitan token-group permutation (static sizes, no host
                               sync; as scripts/gpu/ops_peers/moe.py), three
                               torch._grouped_mm products around SwiGLU, weighted index_add
                               combine; a per-expert loop where torch has no _grouped_mm.
                               torch.compile'd as one function when impl.compile.
After each optimizer step, update_router_biases() applies the aux-loss-free rule of
moe_router.h (sign or linear, centred, clamped) to e_score_correction_bias from the
step's demand (counted on the GPU, no host sync), as linmoe's step does.

Parameters carry linmoe's names (params.h, linmoe_ref.param_table); the one difference in
shape is the convolution weights, [C, 1, W] (nn.Conv1d) for [C, W]. The residual stream of
the AttnRes modes is bf16 under autocast (the embedding rows are cast once), since fla's
fused_attnres takes sources of one dtype; the standard residual keeps fla's KDA-model
arrangement (fp32 embedding rows, fused add + norm).

Not supported (raises NotImplementedError, named): balance aux_loss / quantile, capacity
factor > 0, group-limited routing, packed batches (cu_seqlens).

  /usr/bin/python3 scripts/gpu/twin_model.py --check [--config configs/tiny.json]
runs the twin with impl.fla = False in fp64 on the CPU against linmoe_ref (same weights,
same batch) and checks loss, logits and every gradient (standard and AttnRes residuals),
the permutation and the bias update. Exit status 0 when all agree, 1 otherwise.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts", "reference"))
import linmoe_ref as R  # noqa: E402

IGNORE_INDEX = R.IGNORE_INDEX
ALIGN = 16  # rows per expert group multiple (torch._grouped_mm's bf16 offset alignment)


class Impl:
    """Which implementation each piece uses (see the module docstring)."""

    def __init__(self, fla=True, attnres_fla=True, compile=False, grouped=None):
        self.fla = fla
        self.attnres_fla = attnres_fla and fla
        self.compile = compile and hasattr(torch, "compile")
        if grouped is None:
            grouped = grouped_mm_fn() is not None
        self.grouped = grouped

    def describe(self, cfg):
        parts = ["fla chunk_kda + fla modules" if self.fla else "torch reference ops"]
        if cfg.residual != "standard":
            parts.append("AttnRes: " + ("fla fused_attnres" if self.attnres_fla else
                                        "torch" + (" (compiled)" if self.compile else "")))
        if any(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
            parts.append("MoE: " + ("torch._grouped_mm" if self.grouped else "per-expert loop")
                         + (" (torch.compile)" if self.compile else " (eager)"))
        parts.append("attention: torch SDPA")
        return ", ".join(parts)


def grouped_mm_fn():
    """torch._grouped_mm (torch 2.11: (mat_a, mat_b, offs=int32 group ends)), else the public
    torch.nn.functional.grouped_mm, else None."""
    return getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)


def _is_float_hi(t):
    return t.dtype in (torch.float32, torch.float64)


def _up(t):
    """bf16 / fp16 -> fp32, fp32 / fp64 unchanged (the formulas run in at least fp32)."""
    return t if _is_float_hi(t) else t.float()


def amp_dtype(x):
    """The dtype autocast computes matmuls in for x's device, or x.dtype when it is off."""
    dev = x.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except TypeError:  # torch < 2.4: no device argument
        on = torch.is_autocast_enabled() if dev == "cuda" else torch.is_autocast_cpu_enabled()
    if not on:
        return x.dtype
    try:
        return torch.get_autocast_dtype(dev)
    except AttributeError:
        return torch.get_autocast_gpu_dtype() if dev == "cuda" else torch.get_autocast_cpu_dtype()


# ============================================================================ small modules

class _Weight(nn.Module):
    """A holder of one `weight` parameter (the AttnRes key norm)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class TorchRMSNorm(nn.Module):
    """RMSNorm with fla RMSNorm's call signature: forward(x, residual=None, prenorm=False);
    with a residual it returns (norm(x + residual), x + residual) when prenorm."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x, residual=None, prenorm=False):
        if residual is not None:
            x = x + residual
        y = R.rmsnorm(_up(x), self.weight, self.eps).to(x.dtype)
        return (y, x) if prenorm else y


class TorchGatedRMSNorm(nn.Module):
    """o * rstd * weight * sigmoid(gate) per head (layers.h; fla FusedRMSNormGated)."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x, g):
        return R.gated_rmsnorm(_up(x), _up(g), self.weight, self.eps).to(x.dtype)


class TorchShortConv(nn.Conv1d):
    """Depthwise causal conv + SiLU with fla ShortConvolution's weight [C, 1, W] and call
    (returns (y, None)): y[t] = silu(sum_j w[j] x[t - (W-1) + j]), left zero padding."""

    def __init__(self, C, W):
        super().__init__(C, C, W, groups=C, bias=False, padding=W - 1)

    def forward(self, x, **kwargs):
        T = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), self.weight.to(x.dtype), None, padding=self.padding,
                     groups=self.groups)[..., :T]
        return F.silu(y.transpose(1, 2)), None


def make_norm(n, eps, impl):
    if impl.fla:
        from fla.modules import RMSNorm
        return RMSNorm(n, eps=eps)
    return TorchRMSNorm(n, eps)


def swiglu_ffn(x, wg, wu, wd, fused):
    """down(silu(x wg^T) * (x wu^T)); fused: fla's swiglu_linear (Triton SwiGLU + matmul)."""
    g, u = F.linear(x, wg), F.linear(x, wu)
    if fused:
        from fla.modules.activations import swiglu_linear
        return swiglu_linear(g, u, wd, None)
    return F.linear(F.silu(g) * u, wd)


def sdpa(q, k, v, causal=True, scale=None):
    """Causal GQA attention on [B, T, H, D] tensors -> [B, T, Hq, D]: torch SDPA (enable_gqa
    where torch has it, else repeated kv heads); an explicit masked softmax on torch < 2."""
    hq, hkv = q.shape[2], k.shape[2]
    if not hasattr(F, "scaled_dot_product_attention"):
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=2)
            v = v.repeat_interleave(hq // hkv, dim=2)
        D, T = q.shape[-1], q.shape[1]
        s = torch.einsum("bihd,bjhd->bhij", q, k) * (scale if scale is not None else D ** -0.5)
        if causal:
            i = torch.arange(T, device=q.device)
            s = s.masked_fill(~(i.view(T, 1) >= i.view(1, T)), float("-inf"))
        return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kw = {} if scale is None else {"scale": scale}
    if hq != hkv:
        try:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True, **kw)
            return o.transpose(1, 2)
        except TypeError:  # torch < 2.5: no enable_gqa
            kt = kt.repeat_interleave(hq // hkv, dim=1)
            vt = vt.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kw).transpose(1, 2)


# ============================================================================ functions (compiled)

def attnres_torch(sources, query, rms_weight, out_weight, eps):
    """RMSNorm(AR(sources; query, rms_weight); out_weight) (attnres.h, model.h): per row
    p = softmax_m(<query, RMSNorm(C_m; rms_weight)>), o = sum_m p_m C_m, then the pre-norm.
    In at least fp32; the result has the sources' dtype."""
    V = _up(torch.stack(sources, dim=0))
    k = R.rmsnorm(V, rms_weight, eps)
    p = torch.softmax((k * query).sum(-1), dim=0)
    o = (p.unsqueeze(-1) * V).sum(0)
    return R.rmsnorm(o, out_weight, eps).to(sources[0].dtype)


def permute(topk_idx, E):
    """torchtitan's token-group permutation with static sizes (no host sync; the
    scripts/gpu/ops_peers/moe.py recipe, E and k from the arguments): sorted assignment i
    (argsort of the flat expert ids, stable) goes to row pos[i] of a buffer of m_pad rows
    whose expert groups start at multiples of ALIGN; offs = int32 group ends, the last one
    m_pad (the slack rows, zeros, belong to the last group). counts [E] int64."""
    N, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    m_pad = (N * k + E * ALIGN + ALIGN - 1) // ALIGN * ALIGN
    ends = torch.cumsum(padded, 0)
    start_pad = ends - padded
    start = torch.cumsum(counts, 0) - counts
    se = flat[order]
    pos = start_pad[se] + (torch.arange(N * k, device=flat.device) - start[se])
    offs = torch.cat([ends[:-1], ends.new_full((1,), m_pad)]).to(torch.int32)
    return order, pos, offs, m_pad, counts


_GM = grouped_mm_fn()


def _experts_grouped(xs, offs, w1, w3, w2):
    gm = _GM
    h = F.silu(gm(xs, w1.transpose(-2, -1), offs=offs)) * gm(xs, w3.transpose(-2, -1), offs=offs)
    return gm(h, w2.transpose(-2, -1), offs=offs)


def _experts_loop(xs, offs, w1, w3, w2):
    """The same products one expert at a time (host sync for the group bounds)."""
    ends = offs.tolist()
    outs, a = [], 0
    for e, b in enumerate(ends):
        xe = xs[a:b]
        outs.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
        a = b
    return torch.cat(outs, dim=0)


def moe_routed(x2, wr, bias, w1, w3, w2, k, rsf, norm_topk, sigmoid, grouped, ed):
    """The routed half of linmoe's MoE (moe.h, moe_router.h) on x2 [N, d]:
      logits = x2 W_r^T in fp32 (autocast off); s = sigmoid(logits) (or softmax);
      idx = top-k of s + bias (selection only); w = rsf * s[idx] / (sum s[idx] + 1e-20)
      (norm_topk and k > 1) else rsf * s[idx];
      out_t = sum_j w_tj E_{idx_tj}(x_t), experts SwiGLU in dtype ed.
    Returns (out [N, d] in ed, counts [E] int64: the selections per expert)."""
    N, d = x2.shape
    E = wr.shape[0]
    with torch.autocast(device_type=x2.device.type, enabled=False):
        logits = F.linear(x2.to(wr.dtype), wr)
    s = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    keys = s.detach() + bias.to(s.dtype)
    idx = torch.topk(keys, k, dim=-1).indices
    sel = s.gather(1, idx)
    if norm_topk and k > 1:
        w = sel / (sel.sum(-1, keepdim=True) + R.ROUTER_DENOM_EPS) * rsf
    else:
        w = sel * rsf
    order, pos, offs, m_pad, counts = permute(idx, E)
    tok = order // k
    xs = x2.new_zeros(m_pad, d, dtype=ed).index_copy(0, pos, x2[tok].to(ed))
    experts = _experts_grouped if grouped else _experts_loop
    ys = experts(xs, offs, w1.to(ed), w3.to(ed), w2.to(ed))
    yr = ys[pos] * w.reshape(-1)[order].unsqueeze(-1).to(ed)
    out = x2.new_zeros(N, d, dtype=ed).index_add(0, tok, yr)
    return out, counts


class _Fns:
    """The pure-torch functions, compiled once per model when impl.compile (the compiled
    objects are shared by every layer; dynamo recompiles per distinct AttnRes source count)."""

    def __init__(self, impl):
        self.moe, self.attnres = moe_routed, attnres_torch
        if impl.compile:
            self.moe = torch.compile(moe_routed, dynamic=False)
            self.attnres = torch.compile(attnres_torch, dynamic=False)


# ============================================================================ layers

class KDALayer(nn.Module):
    """The KDA token mixer (kda_layer.h): projections, short convs, low-rank gate and output
    gate, the KDA op with the gate, beta sigmoid and q/k L2 norm applied in it, gated head
    RMSNorm (eps 1e-5), output projection. No bias anywhere (linmoe's g_b_proj has none)."""

    def __init__(self, cfg, i, impl):
        super().__init__()
        d, H, Dh, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        C = H * Dh
        self.H, self.Dh, self.impl = H, Dh, impl
        self.bounded = cfg.gate[i] == "bounded"
        self.lower_bound = cfg.lower_bound
        self.chunk_size = cfg.chunk_size
        lin = lambda a, b: nn.Linear(a, b, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(d, C), lin(d, C), lin(d, C)
        if impl.fla:
            from fla.modules import ShortConvolution
            conv = lambda: ShortConvolution(C, W, bias=False, activation="silu")  # noqa: E731
        else:
            conv = lambda: TorchShortConv(C, W)  # noqa: E731
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj, self.f_b_proj = lin(d, Dh), lin(Dh, C)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(C))
        self.b_proj = lin(d, H)
        self.g_a_proj, self.g_b_proj = lin(d, Dh), lin(Dh, C)
        if impl.fla:
            from fla.modules import FusedRMSNormGated
            self.o_norm = FusedRMSNormGated(Dh, activation="sigmoid", eps=R.GATED_RMSNORM_EPS)
        else:
            self.o_norm = TorchGatedRMSNorm(Dh, R.GATED_RMSNORM_EPS)
        self.o_proj = lin(C, d)

    def forward(self, x):
        B, T, _ = x.shape
        H, Dh = self.H, self.Dh
        q, _ = self.q_conv1d(self.q_proj(x))
        k, _ = self.k_conv1d(self.k_proj(x))
        v, _ = self.v_conv1d(self.v_proj(x))
        g = self.f_b_proj(self.f_a_proj(x))
        beta = self.b_proj(x)
        gate = self.g_b_proj(self.g_a_proj(x))
        q, k, v, g, gate = (t.reshape(B, T, H, Dh) for t in (q, k, v, g, gate))
        if self.impl.fla:
            from fla.ops.kda import chunk_kda
            o, _ = chunk_kda(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=self.bounded,
                             lower_bound=self.lower_bound if self.bounded else None,
                             chunk_size=self.chunk_size)
        else:
            gf = _up(g)
            if self.bounded:
                gl = R.kda_gate_bounded(gf, self.A_log, self.dt_bias, self.lower_bound)
            else:
                gl = R.kda_gate_softplus(gf, self.A_log, self.dt_bias)
            o = R.kda_chunk(R.l2norm(_up(q)), R.l2norm(_up(k)), _up(v), gl,
                            torch.sigmoid(_up(beta)), Dh ** -0.5, chunk_size=self.chunk_size)[0]
            o = o.to(v.dtype)
        y = self.o_norm(o, gate)
        return self.o_proj(y.reshape(B, T, H * Dh))


class AttnLayer(nn.Module):
    """GQA softmax attention (attn_layer.h): no bias, no q/k norm, RoPE (half split) or NoPE."""

    def __init__(self, cfg, i, impl):
        super().__init__()
        d = cfg.hidden_size
        self.Hq, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rope = cfg.position[i] == "rope"
        self.theta, self.impl = cfg.rope_theta, impl
        self.q_proj = nn.Linear(d, self.Hq * self.D, bias=False)
        self.k_proj = nn.Linear(d, self.Hkv * self.D, bias=False)
        self.v_proj = nn.Linear(d, self.Hkv * self.D, bias=False)
        self.o_proj = nn.Linear(self.Hq * self.D, d, bias=False)
        if self.rope and impl.fla:
            from fla.modules import RotaryEmbedding
            self.rotary = RotaryEmbedding(dim=self.D, base=self.theta)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.Hq, self.D)
        k = self.k_proj(x).view(B, T, self.Hkv, self.D)
        v = self.v_proj(x).view(B, T, self.Hkv, self.D)
        if self.rope:
            if self.impl.fla:
                q, k = self.rotary(q, k, seqlen_offset=0, max_seqlen=T)
            else:
                pos = torch.arange(T, device=x.device).expand(B, T)
                q, k = R.rope(q, pos, self.theta), R.rope(k, pos, self.theta)
        o = sdpa(q, k, v, causal=True)
        return self.o_proj(o.reshape(B, T, self.Hq * self.D))


class DenseMLP(nn.Module):
    def __init__(self, d, inter, impl):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.fused = impl.fla

    def forward(self, x):
        return swiglu_ffn(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                          self.fused)


class _Router(nn.Module):
    def __init__(self, E, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class _Experts(nn.Module):
    def __init__(self, E, f, d):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(E, f, d))
        self.up_proj = nn.Parameter(torch.zeros(E, f, d))
        self.down_proj = nn.Parameter(torch.zeros(E, d, f))


class _Shared(nn.Module):
    def __init__(self, fs, d):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(fs, d))
        self.up_proj = nn.Parameter(torch.zeros(fs, d))
        self.down_proj = nn.Parameter(torch.zeros(d, fs))


class MoE(nn.Module):
    """DeepSeek-V3 style MoE (moe.h): routed experts by moe_routed, plus the shared SwiGLU."""

    def __init__(self, cfg, impl, fns):
        super().__init__()
        d, E, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.k, self.rsf = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.norm_topk, self.sigmoid = cfg.norm_topk_prob, cfg.scoring_func == "sigmoid"
        self.impl, self.fns = impl, fns
        self.gate = _Router(E, d)
        self.experts = _Experts(E, f, d)
        fs = cfg.n_shared_experts * f
        self.shared_experts = _Shared(fs, d) if fs > 0 else None
        self.register_buffer("demand", torch.zeros(E), persistent=False)

    def forward(self, x):
        B, T, d = x.shape
        x2 = x.reshape(B * T, d)
        ed = amp_dtype(x2)
        ex = self.experts
        out, counts = self.fns.moe(x2, self.gate.weight, self.gate.e_score_correction_bias,
                                   ex.gate_proj, ex.up_proj, ex.down_proj, self.k, self.rsf,
                                   self.norm_topk, self.sigmoid, self.impl.grouped, ed)
        if self.shared_experts is not None:
            sh = self.shared_experts
            out = out + swiglu_ffn(x2, sh.gate_proj, sh.up_proj, sh.down_proj,
                                   self.impl.fla).to(out.dtype)
        with torch.no_grad():
            self.demand += counts.to(self.demand.dtype)
        return out.view(B, T, d)


class _AttnResParams(nn.Module):
    """model.layers.i.{attn_res,mlp_res}.{query, norm.weight}, model.attnres_final.*"""

    def __init__(self, d):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d))
        self.norm = _Weight(d)


class Layer(nn.Module):
    def __init__(self, cfg, i, impl, fns):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = make_norm(d, eps, impl)
        self.self_attn = KDALayer(cfg, i, impl) if cfg.kinds[i] == "kda" else AttnLayer(cfg, i, impl)
        self.post_attention_layernorm = make_norm(d, eps, impl)
        self.mlp = MoE(cfg, impl, fns) if cfg.is_moe(i) else DenseMLP(d, cfg.intermediate_size, impl)
        if cfg.residual != "standard":
            self.attn_res = _AttnResParams(d)
            self.mlp_res = _AttnResParams(d)


class _Trunk(nn.Module):
    def __init__(self, cfg, impl, fns):
        super().__init__()
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList([Layer(cfg, i, impl, fns) for i in range(cfg.num_hidden_layers)])
        if cfg.residual != "standard":
            self.attnres_final = _AttnResParams(d)
        self.norm = make_norm(d, cfg.rms_norm_eps, impl)


class Twin(nn.Module):
    """linmoe's model (model.h) with the implementations of `impl`. forward(ids [B, T] int64,
    labels [B, T] int64: the target of each position, IGNORE_INDEX for none) -> mean CE over
    the labelled positions (nats); with return_logits (impl.fla = False only) also the logits
    [B, T, V]."""

    def __init__(self, cfg, impl):
        super().__init__()
        if cfg.balance not in ("aux_free", "none"):
            raise NotImplementedError(f"twin: balance = {cfg.balance!r} (aux_free / none only)")
        if cfg.capacity_factor > 0:
            raise NotImplementedError(f"twin: capacity_factor = {cfg.capacity_factor} (dropless only)")
        self.cfg, self.impl = cfg, impl
        self.fns = _Fns(impl)
        self.model = _Trunk(cfg, impl, self.fns)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        raw = cfg.raw
        self.bias_rate = float(raw.get("bias_update_rate", 1e-3))
        self.bias_clamp = float(raw.get("bias_clamp", 1.0))
        self.bias_center = bool(raw.get("bias_center", True))
        self.bias_linear = raw.get("bias_rule", "sign") == "linear"
        self.flce = None
        if impl.fla:
            from fla.modules import FusedLinearCrossEntropyLoss
            self.flce = FusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        self._check_names()

    # ------------------------------------------------------------------ parameters
    def _check_names(self):
        """The parameters and buffers are exactly linmoe's table (params.h names)."""
        table = R.param_table(self.cfg)
        want = {n for n, _, k in table if k != "buffer"}
        have = {n for n, _ in self.named_parameters()}
        if want != have:
            raise AssertionError(f"twin parameters differ from params.h: missing "
                                 f"{sorted(want - have)[:4]}, extra {sorted(have - want)[:4]}")
        for n, shape, _ in table:
            t = self.tensor(n)
            if t.numel() != math.prod(shape):
                raise AssertionError(f"twin {n}: {tuple(t.shape)} for {shape}")

    def tensor(self, name):
        """The parameter or buffer of a params.h name."""
        mod, _, leaf = name.rpartition(".")
        m = self.get_submodule(mod)
        return getattr(m, leaf)

    @torch.no_grad()
    def load_params(self, params):
        """Copy {params.h name: tensor} into the twin (conv weights reshaped)."""
        for name, shape, _ in R.param_table(self.cfg):
            t = self.tensor(name)
            t.copy_(torch.as_tensor(params[name]).reshape(t.shape).to(t.dtype))

    @torch.no_grad()
    def init_weights(self, seed):
        """params.h's distributions (linmoe_ref.init_params), drawn on the model's device:
        matrices and embeddings N(0, initializer_range), norms 1, AttnRes queries and the
        router bias 0, conv U(+-1/sqrt(W)), A_log 0 (bounded) or log U(1, 16), dt_bias
        fla's inverse-softplus init."""
        dev = next(self.parameters()).device
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        std = self.cfg.initializer_range
        for name, shape, kind in R.param_table(self.cfg):
            t = self.tensor(name)
            if kind in ("matrix", "embed"):
                t.normal_(0.0, std, generator=g)
            elif kind == "norm":
                t.fill_(1.0)
            elif kind in ("ar_query", "buffer"):
                t.zero_()
            elif kind == "conv":
                b = 1.0 / math.sqrt(shape[1])
                t.uniform_(-b, b, generator=g)
            elif kind == "A_log":
                if self.cfg.gate[int(name.split(".")[2])] == "softplus":
                    t.uniform_(1.0, 16.0, generator=g).log_()
                else:
                    t.zero_()
            elif kind == "dt_bias":
                u = torch.rand(t.shape, generator=g, device=dev, dtype=torch.float64)
                dt = torch.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
                t.copy_(dt + torch.log(-torch.expm1(-dt)))
            else:
                raise AssertionError(kind)

    @torch.no_grad()
    def update_router_biases(self):
        """The aux-loss-free bias update of every MoE layer from the demand counted since the
        last call (moe_router.h lm_router_update_bias: sign rule b += u sign(mean - demand) or
        linear b += u (mean - demand) / mean; centred; clamped), then the demand is reset."""
        if self.cfg.balance != "aux_free":
            return
        for layer in self.model.layers:
            m = layer.mlp
            if not isinstance(m, MoE):
                continue
            dem = m.demand.double()
            mean = dem.mean()
            if self.bias_linear:
                delta = (mean - dem) / mean.clamp_min(1e-30)
            else:
                delta = torch.sign(mean - dem)
            b = m.gate.e_score_correction_bias.double() + self.bias_rate * delta
            b = torch.where(mean > 0, b, m.gate.e_score_correction_bias.double())
            if self.bias_center:
                b = b - b.mean()
            if self.bias_clamp > 0:
                b = b.clamp(-self.bias_clamp, self.bias_clamp)
            m.gate.e_score_correction_bias.copy_(b.to(m.gate.e_score_correction_bias.dtype))
            m.demand.zero_()

    # ------------------------------------------------------------------ forward
    def _ar(self, sources, arp, out_norm):
        """The pre-normed input of a sublayer from its AttnRes sources."""
        if len(sources) == 1:  # a single source passes through AR unchanged
            return out_norm(sources[0])
        if self.impl.attnres_fla:
            from fla.ops.attnres import fused_attnres
            return fused_attnres(query=arp.query, residuals=sources, rms_weight=arp.norm.weight,
                                 output_rms_weight=out_norm.weight, rms_eps=self.cfg.rms_norm_eps)
        return self.fns.attnres(sources, arp.query, arp.norm.weight, out_norm.weight,
                                self.cfg.rms_norm_eps)

    def _sublayer(self, l, x):
        layer = self.model.layers[l // 2]
        return layer.self_attn(x) if l % 2 == 0 else layer.mlp(x)

    def _pre_norm(self, l):
        layer = self.model.layers[l // 2]
        return layer.input_layernorm if l % 2 == 0 else layer.post_attention_layernorm

    def forward(self, ids, labels, return_logits=False):
        c = self.cfg
        nsub = 2 * c.num_hidden_layers
        e = self.model.embed_tokens(ids)
        if c.residual == "standard":
            # pre-norm residual; fla mode fuses each add into the next norm (prenorm=True),
            # as fla's KDA model does
            h = e
            x = self._pre_norm(0)(h)
            for l in range(nsub):
                o = self._sublayer(l, x)
                nxt = self._pre_norm(l + 1) if l + 1 < nsub else self.model.norm
                x, h = nxt(o, h, True)
            out = x
        else:
            # Block AttnRes (model.h; attnres_ctx.md §4.2), sources in the autocast dtype
            e = e.to(amp_dtype(e)) if ids.is_cuda else e
            S = c.attnres_block_size
            src, part = [e], None
            for l in range(nsub):
                if l > 0 and l % S == 0:
                    src.append(part)
                    part = None
                layer = self.model.layers[l // 2]
                arp = layer.attn_res if l % 2 == 0 else layer.mlp_res
                x = self._ar(src + ([part] if part is not None else []), arp, self._pre_norm(l))
                o = self._sublayer(l, x).to(e.dtype)
                part = o if part is None else part + o
            out = self._ar(src + [part], self.model.attnres_final, self.model.norm)
        head = self.model.embed_tokens.weight if c.tie_word_embeddings else self.lm_head.weight
        if self.flce is not None and not return_logits:
            return self.flce(out.contiguous(), labels, head, None)
        logits = F.linear(out, head)
        loss = F.cross_entropy(_up(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return (loss, logits) if return_logits else loss


def next_token_labels(ids):
    """labels[:, t] = ids[:, t+1], IGNORE_INDEX at the last position of each row (as
    bench/bench_model_gpu.c builds them): B*T - B labelled tokens."""
    lab = torch.full_like(ids, IGNORE_INDEX)
    lab[:, :-1] = ids[:, 1:]
    return lab


# ============================================================================ CPU check

def _check(config_path):
    """The twin (torch ops, fp64, CPU) against linmoe_ref on the same weights and batch."""
    torch.manual_seed(0)
    failed = []

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()

    def report(name, err, tol):
        ok = err <= tol
        print(f"  {name:58s} {err:10.3e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'}")
        if not ok:
            failed.append(name)

    base = R.Config.load(config_path)
    variants = [("as configured", dict(base.raw))]
    other = dict(base.raw)
    other["residual"] = "standard" if base.residual != "standard" else "block_attnres"
    other.setdefault("attnres_block_size", 4)
    variants.append((f"residual {other['residual']}", other))
    for label, raw in variants:
        cfg = R.Config(raw)
        print(f"{os.path.relpath(config_path, ROOT)} ({label}): residual {cfg.residual}")
        p = R.init_params(cfg, seed=3)
        g = torch.Generator().manual_seed(4)
        for name, shape, kind in R.param_table(cfg):  # weights that exercise every path
            if kind in ("matrix", "embed"):
                p[name] = torch.randn(shape, generator=g, dtype=torch.float64) / (
                    shape[-1] ** 0.5 if kind == "matrix" else 1.0)
            elif kind == "norm":
                p[name] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
            elif kind in ("ar_query",):
                p[name] = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
            elif kind == "buffer":
                p[name] = 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
            elif kind == "A_log" and cfg.gate[int(name.split(".")[2])] == "bounded":
                p[name] = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
        ref = R.LinMoE(cfg, p, dtype=torch.float64, kda_mode="chunk")
        twin = Twin(cfg, Impl(fla=False, compile=False, grouped=False)).double()
        twin.load_params(p)
        B, T = 2, 37
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        labels = next_token_labels(ids)
        r_logits, r_loss, n = ref(ids, labels)
        t_loss, t_logits = twin(ids, labels, return_logits=True)
        report("loss", rel(t_loss, r_loss), 1e-10)
        report("logits", rel(t_logits, r_logits), 1e-10)
        r_loss.backward()
        t_loss.backward()
        worst, wname = 0.0, ""
        for name, shape, kind in R.param_table(cfg):
            if kind == "buffer":
                continue
            # an unused parameter (layer 0's attn_res: one source) has no gradient: zeros
            gr = ref.p[name].grad
            gt = twin.tensor(name).grad
            gr = torch.zeros(shape, dtype=torch.float64) if gr is None else gr
            gt = torch.zeros(shape, dtype=torch.float64) if gt is None else gt
            if float(gr.abs().max()) == 0.0:
                err = float(gt.abs().max())
            else:
                err = rel(gt.reshape(gr.shape), gr)
            if err > worst:
                worst, wname = err, name
        report(f"every gradient (worst: {wname})", worst, 1e-9)

    print("permutation (static sizes) vs a direct gather")
    N, E, k = 50, 8, 3
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    order, pos, offs, m_pad, counts = permute(idx, E)
    ends = offs.tolist()
    ok = ends[-1] == m_pad and sorted(pos.tolist()) == sorted(set(pos.tolist()))
    flat = idx.reshape(-1)
    for i in range(N * k):
        e = int(flat[order[i]])
        lo = 0 if e == 0 else ends[e - 1]
        hi = ends[e] if e < E - 1 else m_pad
        ok = ok and lo <= int(pos[i]) < hi and lo % ALIGN == 0
    ok = ok and counts.tolist() == torch.bincount(flat, minlength=E).tolist()
    report("rows inside their expert's aligned group, counts", 0.0 if ok else 1.0, 0.0)

    print("aux-free bias update (sign rule, centred, clamped)")
    cfg = R.Config(dict(base.raw))
    twin = Twin(cfg, Impl(fla=False, compile=False, grouped=False))
    moes = [l.mlp for l in twin.model.layers if isinstance(l.mlp, MoE)]
    if moes:
        m = moes[0]
        Em = m.demand.numel()
        m.demand.copy_(torch.arange(Em, dtype=m.demand.dtype))
        twin.update_router_biases()
        b = m.gate.e_score_correction_bias.double()
        u = twin.bias_rate
        mean = (Em - 1) / 2
        want = torch.tensor([u * (1.0 if j < mean else -1.0 if j > mean else 0.0)
                             for j in range(Em)], dtype=torch.float64)
        want = want - want.mean()
        report("bias after one update", (b - want).abs().max().item(), 1e-7)
        report("demand reset", float(m.demand.abs().max()), 0.0)
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU fp64 check against linmoe_ref")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.json"))
    a = ap.parse_args()
    if not a.check:
        ap.print_help()
        return 2
    return _check(a.config)


if __name__ == "__main__":
    sys.exit(main())
