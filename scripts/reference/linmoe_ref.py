"""linmoe_ref: an independent PyTorch reference of the linmoe model (autograd, any dtype).

It re-derives, from the papers and linmoe's headers (not from linmoe's C code), the hybrid
KDA linear-attention + GQA + MoE language model with optional (Block) Attention Residuals,
so that golden fixtures for the C engine can be computed in fp64 (scripts/reference/
make_fixtures.py) and a PyTorch training step can be timed (bench_step.py).

Architecture (include/linmoe/model.h; Kimi Linear, arXiv 2510.26692; reference/kda.md §7):
    e = embed_tokens[ids]
    sublayer 2i   = layer i's token mixer: KDA layer (kda_layer.h) or GQA attention (attn_layer.h)
    sublayer 2i+1 = layer i's FFN: dense SwiGLU (i < first_k_dense_replace) or MoE (moe.h)
    residual standard:        h = h + f_l(RMSNorm(h; norm_l)) for every sublayer l
    residual block/full AR:   Block Attention Residuals (arXiv 2603.15031 Eq. 2-6;
                              reference/attnres_ctx.md §1.2-1.3, §4.2), see LinMoE.forward
    out = RMSNorm(h; model.norm);  logits = out lm_head^T;  loss = mean CE over labels != -100
                                                           (+ routers' aux losses if balance=aux_loss)

Packed batches (B = 1 and cu_seqlens) are supported: the short convolution, the KDA state,
the attention mask and the RoPE positions restart at every document.

Two KDA implementations of the same math (reference/kda.md §1.2 and §2.1):
    kda_recurrent  token by token (the "parity" mode, used for the fixtures)
    kda_chunk      chunked WY / UT-transform form with matmuls (the "fast" mode, chunk 64)
They agree to rounding (make_fixtures.py / selftest.py check it in fp64).

Parameter names and shapes are those of include/linmoe/params.h (HF / fla names); a
checkpoint is a directory with config.json and model.safetensors (F32), which
LinMoE.from_checkpoint reads with the numpy-only reader of safetensors_io.py.

The MoE is always dropless (linmoe's eval / inference path): capacity dropping, which linmoe
applies only in training with capacity_factor > 0, is not implemented. Group-limited routing
(n_group > 1) raises. The router bias update (aux_free / quantile balancing) happens between
steps, outside the forward, and is not part of this module; neither is the decode path.
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True  # no __pycache__ next to the sources
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

IGNORE_INDEX = -100
GATED_RMSNORM_EPS = float(np.float32(1e-5))  # LM_GATED_RMSNORM_EPS = 1e-5f (layers.h)
L2NORM_EPS = 1e-6          # fla l2norm eps inside the sqrt (kda.h, src/ops/cpu/kda_prep.c)
ROUTER_DENOM_EPS = 1e-20   # moe_router.h: w = rsf * s / (sum s + 1e-20)


def _f32(x):
    """A config float as the C config parser stores it (float, model_config.c)."""
    return float(np.float32(x))


# ============================================================================ config

class Config:
    """config.json (include/linmoe/model_config.h; defaults of src/model/config.c).

    kda_layers / full_attn_layers are 1-based in the JSON; `kinds[i]` is 'kda' or 'attn'
    for the 0-based layer i. `gate` / `position` are a name or a list with one entry per
    layer OF THAT KIND, in layer order."""

    def __init__(self, d):
        self.raw = d
        self.vocab_size = int(d["vocab_size"])
        self.hidden_size = int(d["hidden_size"])
        L = self.num_hidden_layers = int(d["num_hidden_layers"])
        la = d["linear_attn_config"]
        kda = [int(i) - 1 for i in la["kda_layers"]]
        if "full_attn_layers" in la:
            full = [int(i) - 1 for i in la["full_attn_layers"]]
            if sorted(kda + full) != list(range(L)):
                raise ValueError("config: kda_layers and full_attn_layers must partition 1..L")
        self.kinds = ["kda" if i in kda else "attn" for i in range(L)]
        self.kda_num_heads = int(la.get("num_heads", 0))
        self.kda_head_dim = int(la.get("head_dim", 0))
        self.short_conv_kernel_size = int(la.get("short_conv_kernel_size", 4))
        self.lower_bound = _f32(la.get("lower_bound", -5.0))
        self.chunk_size = int(la.get("chunk_size", 64))
        self.gate = self._per_layer(la.get("gate", "bounded"), "kda", ("bounded", "softplus"), "gate")

        self.num_attention_heads = int(d.get("num_attention_heads", 0))
        self.num_key_value_heads = int(d.get("num_key_value_heads", self.num_attention_heads))
        default_hd = self.hidden_size // self.num_attention_heads if self.num_attention_heads else 0
        self.head_dim = int(d.get("head_dim", default_hd))
        self.position = self._per_layer(d.get("position", "rope"), "attn", ("rope", "nope"), "position")
        self.rope_theta = _f32(d.get("rope_theta", 10000.0))

        self.first_k_dense_replace = int(d.get("first_k_dense_replace", 0))
        self.intermediate_size = int(d.get("intermediate_size", 0))
        self.num_experts = int(d.get("num_experts", d.get("n_routed_experts", 1)))
        self.num_experts_per_tok = int(d.get("num_experts_per_tok", 1))
        self.moe_intermediate_size = int(d.get("moe_intermediate_size", 0))
        self.n_shared_experts = int(d.get("n_shared_experts", 0))
        self.scoring_func = d.get("scoring_func", "sigmoid")
        self.norm_topk_prob = bool(d.get("norm_topk_prob", True))
        self.routed_scaling_factor = _f32(d.get("routed_scaling_factor", 1.0))
        self.n_group = int(d.get("n_group", 0))
        self.balance = d.get("balance", "aux_free")
        self.aux_loss_alpha = _f32(d.get("aux_loss_alpha", 1e-3))
        self.aux_loss_seq = bool(d.get("aux_loss_seq", False))
        self.capacity_factor = _f32(d.get("capacity_factor", 0.0))

        self.residual = d.get("residual", "standard")
        self.attnres_block_size = int(d.get("attnres_block_size", 1))
        if self.residual == "full_attnres":
            self.attnres_block_size = 1
        self.rms_norm_eps = _f32(d.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        self.initializer_range = _f32(d.get("initializer_range", 0.02))
        self.seed = int(d.get("seed", 0))
        self.seq_len = int(d.get("seq_len", 0))
        self.batch_size = int(d.get("batch_size", 0))

        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"config: scoring_func = {self.scoring_func!r}")
        if self.residual not in ("standard", "block_attnres", "full_attnres"):
            raise ValueError(f"config: residual = {self.residual!r}")
        if self.n_group > 1:
            raise NotImplementedError("linmoe_ref: group-limited routing (n_group > 1)")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("config: num_experts_per_tok > num_experts")

    def _per_layer(self, v, kind, allowed, key):
        idx = [i for i, k in enumerate(self.kinds) if k == kind]
        vals = [v] * len(idx) if isinstance(v, str) else list(v)
        if len(vals) != len(idx):
            raise ValueError(f"config: '{key}' has {len(vals)} entries for {len(idx)} {kind} layers")
        out = [None] * self.num_hidden_layers
        for i, val in zip(idx, vals):
            if val not in allowed:
                raise ValueError(f"config: '{key}' entry {val!r} not in {allowed}")
            out[i] = val
        return out

    def is_moe(self, i):
        return i >= self.first_k_dense_replace

    @staticmethod
    def load(path):
        with open(path) as f:
            return Config(json.load(f))


# ============================================================================ parameter table

def param_table(cfg):
    """[(name, shape, kind)] in checkpoint order (src/model/params.c order; params.h names).

    kind: 'matrix' (projections, experts, router, embeddings), 'norm' (RMSNorm gains),
    'conv', 'A_log', 'dt_bias', 'ar_query', 'buffer' (e_score_correction_bias)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    t = [("model.embed_tokens.weight", (V, d), "embed")]
    for i in range(cfg.num_hidden_layers):
        P = f"model.layers.{i}"
        t.append((f"{P}.input_layernorm.weight", (d,), "norm"))
        if cfg.kinds[i] == "kda":
            H, Dh, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
            C = H * Dh
            for n in ("q", "k", "v"):
                t.append((f"{P}.self_attn.{n}_proj.weight", (C, d), "matrix"))
            for n in ("q", "k", "v"):
                t.append((f"{P}.self_attn.{n}_conv1d.weight", (C, W), "conv"))
            t += [(f"{P}.self_attn.f_a_proj.weight", (Dh, d), "matrix"),
                  (f"{P}.self_attn.f_b_proj.weight", (C, Dh), "matrix"),
                  (f"{P}.self_attn.A_log", (H,), "A_log"),
                  (f"{P}.self_attn.dt_bias", (C,), "dt_bias"),
                  (f"{P}.self_attn.b_proj.weight", (H, d), "matrix"),
                  (f"{P}.self_attn.g_a_proj.weight", (Dh, d), "matrix"),
                  (f"{P}.self_attn.g_b_proj.weight", (C, Dh), "matrix"),
                  (f"{P}.self_attn.o_norm.weight", (Dh,), "norm"),
                  (f"{P}.self_attn.o_proj.weight", (d, C), "matrix")]
        else:
            Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            t += [(f"{P}.self_attn.q_proj.weight", (Hq * D, d), "matrix"),
                  (f"{P}.self_attn.k_proj.weight", (Hkv * D, d), "matrix"),
                  (f"{P}.self_attn.v_proj.weight", (Hkv * D, d), "matrix"),
                  (f"{P}.self_attn.o_proj.weight", (d, Hq * D), "matrix")]
        t.append((f"{P}.post_attention_layernorm.weight", (d,), "norm"))
        if not cfg.is_moe(i):
            I = cfg.intermediate_size
            t += [(f"{P}.mlp.gate_proj.weight", (I, d), "matrix"),
                  (f"{P}.mlp.up_proj.weight", (I, d), "matrix"),
                  (f"{P}.mlp.down_proj.weight", (d, I), "matrix")]
        else:
            E, f = cfg.num_experts, cfg.moe_intermediate_size
            fs = cfg.n_shared_experts * f
            t += [(f"{P}.mlp.gate.weight", (E, d), "matrix"),
                  (f"{P}.mlp.gate.e_score_correction_bias", (E,), "buffer"),
                  (f"{P}.mlp.experts.gate_proj", (E, f, d), "matrix"),
                  (f"{P}.mlp.experts.up_proj", (E, f, d), "matrix"),
                  (f"{P}.mlp.experts.down_proj", (E, d, f), "matrix")]
            if fs > 0:
                t += [(f"{P}.mlp.shared_experts.gate_proj", (fs, d), "matrix"),
                      (f"{P}.mlp.shared_experts.up_proj", (fs, d), "matrix"),
                      (f"{P}.mlp.shared_experts.down_proj", (d, fs), "matrix")]
        if cfg.residual != "standard":
            t += [(f"{P}.attn_res.query", (d,), "ar_query"),
                  (f"{P}.attn_res.norm.weight", (d,), "norm"),
                  (f"{P}.mlp_res.query", (d,), "ar_query"),
                  (f"{P}.mlp_res.norm.weight", (d,), "norm")]
    if cfg.residual != "standard":
        t += [("model.attnres_final.query", (d,), "ar_query"),
              ("model.attnres_final.norm.weight", (d,), "norm")]
    t.append(("model.norm.weight", (d,), "norm"))
    if not cfg.tie_word_embeddings:
        t.append(("lm_head.weight", (V, d), "matrix"))
    return t


def _layer_of(name):
    p = name.split(".")
    return int(p[2]) if len(p) > 2 and p[1] == "layers" else -1


def init_params(cfg, seed=0):
    """Random fp64 values with the distributions of params.h (lm_params_init_weights), drawn
    from torch's generator (the values differ from the C engine's Philox streams):
    matrices normal(0, initializer_range); norms 1; AttnRes queries 0; conv U(-1/sqrt(W),
    1/sqrt(W)); A_log 0 (bounded) or log U(1, 16) (softplus, fla); dt_bias softplus^-1(dt),
    dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4 (fla / Mamba); router bias 0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, kind in param_table(cfg):
        if kind in ("matrix", "embed"):
            x = torch.randn(shape, generator=g, dtype=torch.float64) * cfg.initializer_range
        elif kind == "norm":
            x = torch.ones(shape, dtype=torch.float64)
        elif kind in ("ar_query", "buffer"):
            x = torch.zeros(shape, dtype=torch.float64)
        elif kind == "conv":
            b = 1.0 / math.sqrt(shape[1])
            x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * b
        elif kind == "A_log":
            if cfg.gate[_layer_of(name)] == "softplus":
                x = torch.log(torch.rand(shape, generator=g, dtype=torch.float64) * 15 + 1)
            else:
                x = torch.zeros(shape, dtype=torch.float64)
        elif kind == "dt_bias":
            x = dt_bias_init(shape, g)
        else:
            raise AssertionError(kind)
        out[name] = x
    return out


def dt_bias_init(shape, gen):
    """fla KimiDeltaAttention / Mamba: dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4,
    dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt))."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    dt = torch.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


# ============================================================================ batch structure

class Segments:
    """Document structure of a [B, T] batch: every row one document, or B == 1 with
    cu_seqlens (0 = c_0 <= ... <= c_n = T) packed documents (model.h, lm_model_batch).

    pos [B, T]: index of each token inside its document (RoPE position, conv taps);
    doc [B, T]: document id (attention mask); docs: [(start, end)] of the packed row."""

    def __init__(self, B, T, cu_seqlens=None, device="cpu"):
        self.B, self.T = B, T
        if cu_seqlens is None:
            self.docs = None
            self.pos = torch.arange(T, device=device).expand(B, T)
            self.doc = torch.zeros(B, T, dtype=torch.long, device=device)
            return
        cu = [int(c) for c in cu_seqlens]
        if B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens {cu} invalid for B={B}, T={T}")
        self.docs = [(a, b) for a, b in zip(cu, cu[1:]) if b > a]
        pos = torch.zeros(1, T, dtype=torch.long)
        doc = torch.zeros(1, T, dtype=torch.long)
        for n, (a, b) in enumerate(self.docs):
            pos[0, a:b] = torch.arange(b - a)
            doc[0, a:b] = n
        self.pos, self.doc = pos.to(device), doc.to(device)

    def per_doc(self, fn, *xs):
        """fn over each document separately (tensors [B, T, ...]), results concatenated
        along T; without cu_seqlens, one call over the whole batch."""
        if self.docs is None:
            return fn(*xs)
        outs = [fn(*(x[:, a:b] for x in xs)) for a, b in self.docs]
        return torch.cat(outs, dim=1)


# ============================================================================ small layers

def rmsnorm(x, weight, eps):
    """RMSNorm, HF Llama convention (layers.h): y = x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gated_rmsnorm(x, gate, weight, eps=GATED_RMSNORM_EPS):
    """Head-wise RMSNorm gated by a sigmoid (layers.h lm_gated_rmsnorm_forward; fla
    FusedRMSNormGated, activation 'sigmoid'): x, gate [..., H, Dh], weight [Dh]."""
    return rmsnorm(x, weight, eps) * torch.sigmoid(gate)


def short_conv(x, weight, seg, activation=True):
    """Depthwise causal short convolution (layers.h; fla ShortConvolution / Dao's
    causal_conv1d tap order): pre[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c], left zero
    padding, no tap crosses a document start; then SiLU. x [B, T, C], weight [C, W]."""
    B, T, C = x.shape
    W = weight.shape[1]
    pre = x * weight[:, W - 1]
    for j in range(W - 1):
        s = W - 1 - j  # how many tokens back tap j reads
        if s >= T:
            continue
        xs = F.pad(x[:, :T - s], (0, 0, s, 0))
        valid = (seg.pos >= s).unsqueeze(-1).to(x.dtype)
        pre = pre + xs * valid * weight[:, j]
    return F.silu(pre) if activation else pre


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU FFN (Shazeer 2020, arXiv 2002.05202 Eq. 6): down(silu(gate x) * up x)."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def l2norm(x, eps=L2NORM_EPS):
    """fla's in-kernel q/k normalisation: x / sqrt(sum(x^2) + 1e-6) over the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# ============================================================================ KDA gates

def kda_gate_softplus(g_raw, A_log, dt_bias):
    """g = -exp(A_log[h]) * softplus(g_raw + dt_bias)  (kda.h SOFTPLUS; reference/kda.md §1.3;
    softplus threshold 20 as fla's Triton softplus). g_raw [..., H, K], A_log [H], dt_bias [H*K]."""
    H, K = g_raw.shape[-2:]
    z = g_raw + dt_bias.view(H, K)
    return -A_log.exp().view(H, 1) * F.softplus(z, beta=1.0, threshold=20.0)


def kda_gate_bounded(g_raw, A_log, dt_bias, lower_bound):
    """g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))  (kda.h BOUNDED;
    reference/kda.md §1.3, fla naive_kda_lowerbound_gate)."""
    H, K = g_raw.shape[-2:]
    z = g_raw + dt_bias.view(H, K)
    return lower_bound * torch.sigmoid(A_log.exp().view(H, 1) * z)


# ============================================================================ KDA op

def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """Gated delta rule with per-channel decay, token by token (reference/kda.md §1.2; Kimi
    Linear arXiv 2510.26692 Eq. 1; kda.h). Per (sequence, head):
        S <- Diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;
        o_t = S^T (scale q_t)
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (already sigmoid); q, k already
    L2-normalised when the layer wants it. Returns o [B, T, H, V], final state [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    q = q * scale
    a = g.exp()
    outs = []
    for t in range(T):
        S = S * a[:, t].unsqueeze(-1)
        kt = k[:, t]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, S


def _intra_chunk_safe(x, k, G, sub, inclusive):
    """M[r, i] = sum_d x[r, d] k[i, d] exp(G[r, d] - G[i, d]) for i <= r (inclusive) or i < r,
    zero above; x, k, G [..., C, K] -> [..., C, C]. Never forms exp of a positive number (no
    reciprocal decay, reference/kda.md §2.4): on the diagonal sub-blocks of `sub` tokens the
    exponent is formed per pair (G_r - G_i <= 0); an off-diagonal block (rows after sub-block
    b, columns in b) factors the decay at the last token s of block b, exp(G_r - G_s) *
    exp(G_s - G_i), both factors <= 1, so it is one matmul. Any decay; memory-heavy."""
    C = x.shape[-2]
    nb = C // sub
    tri = torch.ones(sub, sub, dtype=torch.bool, device=x.device)
    tri = torch.tril(tri, diagonal=0 if inclusive else -1)
    strips = []
    for b in range(nb):
        lo, hi = b * sub, (b + 1) * sub
        xb, kb, Gb = x[..., lo:hi, :], k[..., lo:hi, :], G[..., lo:hi, :]
        diff = Gb.unsqueeze(-2) - Gb.unsqueeze(-3)  # [..., r, i, K]
        diff = torch.where(tri.unsqueeze(-1), diff, torch.zeros_like(diff))
        D = (xb.unsqueeze(-2) * kb.unsqueeze(-3) * diff.exp()).sum(-1) * tri.to(x.dtype)
        parts = []
        if lo > 0:
            parts.append(x.new_zeros(*x.shape[:-2], lo, sub))
        parts.append(D)
        if hi < C:
            Gs = G[..., hi - 1:hi, :]
            xr = x[..., hi:, :] * (G[..., hi:, :] - Gs).exp()
            kc = kb * (Gs - Gb).exp()
            parts.append(xr @ kc.transpose(-1, -2))
        strips.append(torch.cat(parts, dim=-2))
    return torch.cat(strips, dim=-1)


def _intra_chunk_shared(x, k, G, sub, inclusive, cap):
    """The same M as _intra_chunk_safe with one matmul per column sub-block b, the decay
    factored at the block's midpoint m: exp(G_r - G_i) = exp(G_r - G_m) exp(G_m - G_i)
    (reference/kda.md §3: fla's bounded-gate shared diagonal path, with a 16-token tile).
    Every factor that enters a kept entry is at most exp(decay across one sub-block), which
    the caller guarantees is <= exp(cap); rows before block b (masked out) are clamped to cap,
    so no product exceeds exp(2 cap) (cap 40 in fp32: e^80 < FLT_MAX ~ e^88.7)."""
    C, K = x.shape[-2:]
    nb = C // sub
    batch = x.shape[:-2]
    Gm = G[..., sub // 2::sub, :]                                        # [..., nb, K]
    xs = x.unsqueeze(-3) * (G.unsqueeze(-3) - Gm.unsqueeze(-2)).clamp(max=cap).exp()   # [.., nb, C, K]
    kb = k.reshape(*batch, nb, sub, K)
    ks = kb * (Gm.unsqueeze(-2) - G.reshape(*batch, nb, sub, K)).exp()  # [..., nb, sub, K]
    M = (xs @ ks.transpose(-1, -2)).movedim(-3, -2).reshape(*batch, C, C)
    mask = torch.tril(torch.ones(C, C, dtype=torch.bool, device=x.device), diagonal=0 if inclusive else -1)
    return torch.where(mask, M, torch.zeros((), dtype=M.dtype, device=M.device))


def _intra_chunk(x, k, G, sub, inclusive, diag="auto"):
    """Dispatch ('auto'): 'shared' (matmul) when the decay across every sub-block is small
    enough that its factors cannot overflow in this dtype (<= cap = 40 in fp32, 300 in fp64),
    else 'safe'. A forced 'shared' outside that range raises."""
    cap = 300.0 if G.dtype == torch.float64 else 40.0
    if diag in ("auto", "shared"):
        # decay across each sub-block, counted from the token before it (G_-1 := 0)
        Gp = F.pad(G, (0, 0, 1, 0))[..., :-1:sub, :]                   # G just before each block
        spread = (Gp - G[..., sub - 1::sub, :]).max().item()
        if diag == "shared" and spread > cap:
            raise ValueError(f"kda_chunk: diag='shared' needs the decay across a {sub}-token "
                             f"sub-block <= {cap} in {G.dtype}, got {spread:.1f}")
        diag = "shared" if spread <= cap else "safe"
    if diag == "shared":
        return _intra_chunk_shared(x, k, G, sub, inclusive, cap)
    return _intra_chunk_safe(x, k, G, sub, inclusive)


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64, sub=16, diag="auto"):
    """The same op as kda_recurrent in the chunked WY / UT-transform form (reference/kda.md
    §2.1; Kimi Linear Eqs. 6-9; fla naive_chunk_kda). Per chunk of C tokens with S0 the state
    at its start and G the chunk-local cumsum of g:
        Akk[r,i] = beta_r sum_d k_rd k_id e^{G_rd - G_id}  (i < r),  Aqk likewise with q (i <= r)
        Tm = (I + Akk)^-1;  W = Tm diag(beta) (K * e^G);  U = Tm diag(beta) V
        Vn = U - W S0;  O = (Q * e^G) S0 + Aqk Vn
        S  = Diag(e^{G_last}) S0 + (K * e^{G_last - G})^T Vn
    T need not be a multiple of C (the tail is zero-padded: k = 0 and g = 0 leave the state
    unchanged). The intra-chunk matrices come from _intra_chunk (diag: 'auto', 'shared',
    'safe'). Shapes and returns as kda_recurrent."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    C = chunk_size
    sub = min(sub, C)
    assert C % sub == 0
    pad = (-T) % C
    tr = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, .] -> [B, H, T, .]
    q, k, v, g = tr(q) * scale, tr(k), tr(v), tr(g)
    beta = beta.transpose(1, 2)
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    NT = (T + pad) // C
    q, k, g = (x.reshape(B, H, NT, C, K) for x in (q, k, g))
    v = v.reshape(B, H, NT, C, V)
    beta = beta.reshape(B, H, NT, C)

    G = g.cumsum(-2)
    Aqk = _intra_chunk(q, k, G, sub, True, diag)
    Akk = beta.unsqueeze(-1) * _intra_chunk(k, k, G, sub, False, diag)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Lm = eye + Akk  # unit lower triangular
    eG = G.exp()
    bb = beta.unsqueeze(-1)
    Wm = torch.linalg.solve_triangular(Lm, bb * k * eG, upper=False, unitriangular=True)
    Um = torch.linalg.solve_triangular(Lm, bb * v, upper=False, unitriangular=True)
    qg = q * eG
    Glast = G[..., -1, :]                              # [B, H, NT, K]
    kd = k * (Glast.unsqueeze(-2) - G).exp()           # k * e^{G_last - G}
    dl = Glast.exp().unsqueeze(-1)                     # [B, H, NT, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    outs = []
    for n in range(NT):
        Vn = Um[:, :, n] - Wm[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + Aqk[:, :, n] @ Vn)
        S = dl[:, :, n] * S + kd[:, :, n].transpose(-1, -2) @ Vn
    o = torch.stack(outs, dim=2).reshape(B, H, NT * C, V)[:, :, :T]
    return o.transpose(1, 2), S


# ============================================================================ attention

def rope(x, pos, theta):
    """RoPE, half-split / rotate_half convention over the whole head (attention.h):
    angle_f = p * theta^(-2f/D) formed in fp64 (as linmoe does), then
    y[f] = x[f] cos - x[f+D/2] sin,  y[f+D/2] = x[f+D/2] cos + x[f] sin.  x [B, T, H, D]."""
    D = x.shape[-1]
    f = torch.arange(D // 2, dtype=torch.float64, device=x.device)
    inv = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -2.0 * f / D)
    ang = pos.to(torch.float64).unsqueeze(-1) * inv           # [B, T, D/2]
    c = ang.cos().to(x.dtype).unsqueeze(2)
    s = ang.sin().to(x.dtype).unsqueeze(2)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def attention(q, k, v, seg, position, theta, scale=None):
    """Causal GQA softmax attention (attention.h): query head h uses kv head h // (Hq/Hkv);
    s_ij = scale q~_i . k~_j over keys j <= i of the same document; RoPE (positions
    restarting per document) or NoPE. Explicit masked matmul. q [B,T,Hq,D], k, v [B,T,Hkv,D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if scale is None:
        scale = D ** -0.5
    if position == "rope":
        q, k = rope(q, seg.pos, theta), rope(k, seg.pos, theta)
    rep = Hq // Hkv
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    i = torch.arange(T, device=q.device)
    mask = (i.view(1, T, 1) >= i.view(1, 1, T)) & (seg.doc.unsqueeze(2) == seg.doc.unsqueeze(1))
    s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", p, v)


# ============================================================================ AttnRes

def attnres(sources, query, rms_weight, eps, scale=1.0):
    """One AttnRes aggregation AR(C, w, g) (attnres.h; reference/attnres_ctx.md §1.2, §4.2;
    arXiv 2603.15031 Eq. 2-4): per row, k_m = RMSNorm(C_m; g), s_m = scale <w, k_m>,
    p = softmax_m(s), o = sum_m p_m C_m (the values are the raw sources). One source is
    returned unchanged. sources: list of [..., D] tensors."""
    if len(sources) == 1:
        return sources[0]
    Vs = torch.stack(sources, dim=0)                     # [L, ..., D]
    kn = rmsnorm(Vs, rms_weight, eps)
    p = torch.softmax((kn * query).sum(-1) * scale, dim=0)
    return (p.unsqueeze(-1) * Vs).sum(0)


# ============================================================================ MoE

class Route:
    """What the router chose (for inspection): unbiased scores s [N, E], selection keys
    s + bias [N, E], selected experts idx [N, k] (descending key order), weights w [N, k]."""

    def __init__(self, scores, keys, idx, w):
        self.scores, self.keys, self.idx, self.w = scores, keys, idx, w


def moe(x, p, prefix, cfg, seg):
    """DeepSeek-V3 style MoE (moe.h, moe_router.h; reference/moe.md §2): x [N, d].
      s = sigmoid(x W_r^T) (or softmax); key = s + e_score_correction_bias (selection only);
      idx = top-k of key (ties: lower index); w = s[idx] / (sum s[idx] + 1e-20) * rsf when
      norm_topk_prob and k > 1, else s[idx] * rsf;
      out = shared SwiGLU(x) + sum_j w_j SwiGLU_{idx_j}(x).
    Returns (out [N, d], route, aux_loss or None)."""
    E, kk = cfg.num_experts, cfg.num_experts_per_tok
    logits = x @ p[prefix + "gate.weight"].T
    s = torch.sigmoid(logits) if cfg.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    keys = s.detach() + p[prefix + "gate.e_score_correction_bias"].to(s.dtype)
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :kk]
    sel = s.gather(1, order)
    rsf = cfg.routed_scaling_factor
    if cfg.norm_topk_prob and kk > 1:
        w = sel / (sel.sum(-1, keepdim=True) + ROUTER_DENOM_EPS) * rsf
    else:
        w = sel * rsf
    out = torch.zeros_like(x)
    if cfg.n_shared_experts > 0:
        out = swiglu(x, p[prefix + "shared_experts.gate_proj"], p[prefix + "shared_experts.up_proj"],
                     p[prefix + "shared_experts.down_proj"])
    Wg, Wu, Wd = (p[prefix + "experts." + n] for n in ("gate_proj", "up_proj", "down_proj"))
    for e in range(E):
        tok, slot = (order == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = swiglu(x[tok], Wg[e], Wu[e], Wd[e]) * w[tok, slot].unsqueeze(-1)
        out = out.index_add(0, tok, y)
    aux = None
    if cfg.balance == "aux_loss" and cfg.aux_loss_alpha > 0:
        aux = _aux_loss(s, order, cfg, seg)
    return out, Route(s.detach(), keys, order, w.detach()), aux


def _aux_loss(s, order, cfg, seg):
    """alpha * sum_i f_i P_i (moe_router.h; reference/moe.md §1.1, §2): f_i = E/(k T_n) count_i
    (no gradient), P_i = mean over the T_n tokens of s'_i, s' = s / (sum_e s + 1e-20) for
    sigmoid scores, s for softmax; over the whole batch, or with aux_loss_seq per document
    (rows of [B, T], documents of a packed row), averaged over the non-empty ones."""
    E, kk = cfg.num_experts, cfg.num_experts_per_tok
    sp = s / (s.sum(-1, keepdim=True) + ROUTER_DENOM_EPS) if cfg.scoring_func == "sigmoid" else s
    if cfg.aux_loss_seq:
        if seg.docs is None:
            bounds = [(b * seg.T, (b + 1) * seg.T) for b in range(seg.B)]
        else:
            bounds = seg.docs
    else:
        bounds = [(0, s.shape[0])]
    total, n = 0.0, 0
    for a, b in bounds:
        Tn = b - a
        if Tn <= 0:
            continue
        cnt = torch.bincount(order[a:b].reshape(-1), minlength=E).to(s.dtype)
        f = E / (kk * Tn) * cnt
        P = sp[a:b].mean(0)
        total = total + cfg.aux_loss_alpha * (f * P).sum()
        n += 1
    return total / max(n, 1)


# ============================================================================ the model

class LinMoE(torch.nn.Module):
    """The linmoe model (model.h) over a dict of named parameters (params.h names).

    kda_mode: 'recurrent' (token-by-token, parity) or 'chunk' (chunked, fast)."""

    def __init__(self, cfg, params, dtype=torch.float64, kda_mode="recurrent"):
        super().__init__()
        self.cfg = cfg
        self.kda_mode = kda_mode
        self.p = {}
        table = param_table(cfg)
        names = {n for n, _, _ in table}
        extra = set(params) - names
        if extra:
            raise ValueError(f"unexpected tensors: {sorted(extra)[:5]}")
        for name, shape, kind in table:
            if name not in params:
                raise ValueError(f"missing tensor '{name}'")
            t = torch.as_tensor(params[name]).to(dtype)
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"tensor '{name}' has shape {tuple(t.shape)}, expected {shape}")
            safe = name.replace(".", "__")
            if kind == "buffer":
                self.register_buffer(safe, t.clone())
                self.p[name] = getattr(self, safe)
            else:
                par = torch.nn.Parameter(t.clone())
                self.register_parameter(safe, par)
                self.p[name] = par
        self.buffer_names = [n for n, _, k in table if k == "buffer"]
        self.param_names = [n for n, _, k in table if k != "buffer"]
        self.routes = {}

    # ------------------------------------------------------------------ I/O
    @staticmethod
    def from_checkpoint(path, dtype=torch.float64, kda_mode="recurrent"):
        """Load a linmoe checkpoint directory (config.json + model.safetensors, params.h)."""
        cfg = Config.load(os.path.join(path, "config.json"))
        tensors, _ = safetensors_io.load_file(os.path.join(path, "model.safetensors"))
        return LinMoE(cfg, {k: torch.from_numpy(v) for k, v in tensors.items()}, dtype, kda_mode)

    def save_checkpoint(self, path):
        """Write config.json (the JSON this config came from) and model.safetensors (F32)."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.cfg.raw, f, indent=2)
        t = {n: self.p[n].detach().to(torch.float32).cpu().numpy() for n, _, _ in param_table(self.cfg)}
        safetensors_io.save_file(t, os.path.join(path, "model.safetensors"))

    # ------------------------------------------------------------------ sublayers
    def _kda_layer(self, i, x, seg):
        """KDA token mixer (kda_layer.h; reference/kda.md §7; fla KimiDeltaAttention)."""
        c, p, P = self.cfg, self.p, f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        H, Dh = c.kda_num_heads, c.kda_head_dim
        q = short_conv(x @ p[P + "q_proj.weight"].T, p[P + "q_conv1d.weight"], seg)
        k = short_conv(x @ p[P + "k_proj.weight"].T, p[P + "k_conv1d.weight"], seg)
        v = short_conv(x @ p[P + "v_proj.weight"].T, p[P + "v_conv1d.weight"], seg)
        g_raw = (x @ p[P + "f_a_proj.weight"].T) @ p[P + "f_b_proj.weight"].T
        beta = torch.sigmoid(x @ p[P + "b_proj.weight"].T)              # [B, T, H]
        gate = (x @ p[P + "g_a_proj.weight"].T) @ p[P + "g_b_proj.weight"].T
        q, k, v, g_raw, gate = (t.reshape(B, T, H, Dh) for t in (q, k, v, g_raw, gate))
        if c.gate[i] == "softplus":
            g = kda_gate_softplus(g_raw, p[P + "A_log"], p[P + "dt_bias"])
        else:
            g = kda_gate_bounded(g_raw, p[P + "A_log"], p[P + "dt_bias"], c.lower_bound)
        q, k = l2norm(q), l2norm(k)
        scale = Dh ** -0.5
        if self.kda_mode == "recurrent":
            op = lambda q_, k_, v_, g_, b_: kda_recurrent(q_, k_, v_, g_, b_, scale)[0]  # noqa: E731
        else:
            op = lambda q_, k_, v_, g_, b_: kda_chunk(  # noqa: E731
                q_, k_, v_, g_, b_, scale, chunk_size=64)[0]
        o = seg.per_doc(op, q, k, v, g, beta)
        y = gated_rmsnorm(o, gate, p[P + "o_norm.weight"])
        return y.reshape(B, T, H * Dh) @ p[P + "o_proj.weight"].T

    def _attn_layer(self, i, x, seg):
        """GQA attention token mixer (attn_layer.h): no bias, no q/k norm, no output gate."""
        c, p, P = self.cfg, self.p, f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = (x @ p[P + "q_proj.weight"].T).reshape(B, T, Hq, D)
        k = (x @ p[P + "k_proj.weight"].T).reshape(B, T, Hkv, D)
        v = (x @ p[P + "v_proj.weight"].T).reshape(B, T, Hkv, D)
        o = attention(q, k, v, seg, c.position[i], c.rope_theta)
        return o.reshape(B, T, Hq * D) @ p[P + "o_proj.weight"].T

    def _ffn(self, i, x, seg):
        c, p, P = self.cfg, self.p, f"model.layers.{i}.mlp."
        if not c.is_moe(i):
            return swiglu(x, p[P + "gate_proj.weight"], p[P + "up_proj.weight"], p[P + "down_proj.weight"]), None
        B, T, d = x.shape
        out, route, aux = moe(x.reshape(B * T, d), p, P, c, seg)
        self.routes[i] = route
        return out.reshape(B, T, d), aux

    def _sublayer(self, l, x, seg):
        """Sublayer l applied to its (pre-normed) input: returns (output, aux loss or None)."""
        i = l // 2
        if l % 2 == 0:
            f = self._kda_layer if self.cfg.kinds[i] == "kda" else self._attn_layer
            return f(i, x, seg), None
        return self._ffn(i, x, seg)

    # ------------------------------------------------------------------ forward
    def forward(self, ids, labels=None, cu_seqlens=None):
        """ids [B, T] (int), labels [B, T] or None (-100 = no target), cu_seqlens: packed
        documents (B == 1). Returns (logits [B, T, V], loss or None, n_labels)."""
        c, p = self.cfg, self.p
        ids = torch.as_tensor(ids).long()
        B, T = ids.shape
        seg = Segments(B, T, cu_seqlens, device=ids.device)
        eps = c.rms_norm_eps
        e = p["model.embed_tokens.weight"][ids]
        auxes = []  # the routers' aux losses (balance = aux_loss)
        nsub = 2 * c.num_hidden_layers

        def pre_norm(l):
            i = l // 2
            return p[f"model.layers.{i}.{'input_layernorm' if l % 2 == 0 else 'post_attention_layernorm'}.weight"]

        if c.residual == "standard":
            h = e
            for l in range(nsub):
                o, aux = self._sublayer(l, rmsnorm(h, pre_norm(l), eps), seg)
                h = h + o
                auxes += [aux] if aux is not None else []
        else:
            # Block AttnRes (model.h; attnres_ctx.md §4.2): S = attnres_block_size sublayers
            S = c.attnres_block_size
            src, part = [e], None
            for l in range(nsub):
                if l > 0 and l % S == 0:
                    src.append(part)
                    part = None
                i = l // 2
                which = "attn_res" if l % 2 == 0 else "mlp_res"
                h_l = attnres(src + ([part] if part is not None else []),
                              p[f"model.layers.{i}.{which}.query"],
                              p[f"model.layers.{i}.{which}.norm.weight"], eps)
                o, aux = self._sublayer(l, rmsnorm(h_l, pre_norm(l), eps), seg)
                part = o if part is None else part + o
                auxes += [aux] if aux is not None else []
            h = attnres(src + [part], p["model.attnres_final.query"],
                        p["model.attnres_final.norm.weight"], eps)
        out = rmsnorm(h, p["model.norm.weight"], eps)
        head = p["model.embed_tokens.weight"] if c.tie_word_embeddings else p["lm_head.weight"]
        logits = out @ head.T
        if labels is None:
            return logits, None, 0
        labels = torch.as_tensor(labels).long().reshape(-1)
        keep = labels != IGNORE_INDEX
        n = int(keep.sum())
        lp = torch.log_softmax(logits.reshape(B * T, -1), dim=-1)
        nll = -lp[keep.nonzero(as_tuple=True)[0], labels[keep]]
        loss = nll.sum() / n if n > 0 else lp.sum() * 0.0
        for a in auxes:
            loss = loss + a
        return logits, loss, n


def next_token_labels(ids, cu_seqlens=None):
    """labels[t] = ids[t+1] inside each row / document, -100 at the last token of each."""
    ids = torch.as_tensor(ids)
    lab = torch.full_like(ids, IGNORE_INDEX)
    if cu_seqlens is None:
        lab[:, :-1] = ids[:, 1:]
    else:
        for a, b in zip(cu_seqlens, cu_seqlens[1:]):
            if b - a > 1:
                lab[0, a:b - 1] = ids[0, a + 1:b]
    return lab
