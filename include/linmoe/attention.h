/* linmoe attention: causal grouped-query softmax attention on the CPU in fp32, the
 * full-attention layer's op in the hybrid model (issue 4). Forward and backward over
 * [B, T] batches or packed documents (cu_seqlens), optional RoPE applied inside the
 * op, and the decode step over a KV cache.
 *
 * Math, per sequence n, query head h (kv head g = h / (Hq/Hkv), fla / flash-attn's
 * GQA map), query position i and key positions j <= i of the same document:
 *   q~_i = R(p_i) q_i,  k~_j = R(p_j) k_j        (RoPE; identity for NoPE)
 *   s_ij = scale * q~_i . k~_j
 *   lse_i = log sum_{j<=i} exp(s_ij)             (natural log, nats)
 *   o_i   = sum_{j<=i} exp(s_ij - lse_i) v_j
 * p_i is the index of token i inside its document (0 at each document start).
 * Forward: tiled online softmax (64 queries x 64 keys per tile, running row max and
 * sum), FlashAttention-2 (Dao, arXiv 2307.08691, Algorithm 1). Backward: Algorithm 2
 * of the same paper, P recomputed from the saved lse:
 *   dV = P^T dO,  dP = dO V^T,  Delta_i = rowsum(dO_i * O_i),
 *   dS = P * (dP - Delta),  dQ~ = scale dS K~,  dK~ = scale dS^T Q~,
 * then dq = R(p)^T dQ~ and dk = R(p)^T dK~ (gradients w.r.t. the un-rotated q, k);
 * dk and dv of a kv head sum over the Hq/Hkv query heads that share it.
 *
 * RoPE: the half-split ("rotate_half", GPT-NeoX / Hugging Face Llama) convention over
 * the whole head (D even): for f = 0 .. D/2-1, with theta_f = p * rope_theta^(-2f/D),
 *   y[f]       = x[f] cos theta_f - x[f + D/2] sin theta_f
 *   y[f + D/2] = x[f + D/2] cos theta_f + x[f] sin theta_f
 * (not the interleaved GPT-J / Meta-Llama pairs (2f, 2f+1)). Angles are formed in fp64
 * and cos / sin rounded to fp32, so positions up to 2^16 and beyond keep fp32-exact
 * rotations; Hugging Face forms inv_freq and p * inv_freq in fp32, which differs from
 * this by up to ~p * 6e-8 rad (a reference model must form the angles in fp64 to
 * match to 1e-6 at long positions).
 *
 * Layouts (row-major, innermost last, fp32, contiguous, owned by the caller):
 *   q, o, do, dq      [B, T, Hq, D]
 *   k, v, dk, dv      [B, T, Hkv, D]
 *   lse               [B, T, Hq]           log-sum-exp of the scaled scores, nats
 *   cu_seqlens        [N+1] int64, only with B == 1 (packed documents); else N = B
 *   k_cache, v_cache  [B, Tmax, Hkv, D]    decode only (see lm_attention_decode)
 *
 * Determinism: every output element is computed by one thread in an order fixed by
 * the shapes alone, so results are bitwise identical for any number of threads.
 *
 * What this module does not do: non-causal or sliding-window masks, attention bias /
 * ALiBi, partial rotary dims, bf16 math, CUDA, the layer around the op (projections,
 * q/k norms, o_proj), or KV-cache allocation.
 */
#ifndef LINMOE_ATTENTION_H
#define LINMOE_ATTENTION_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Position encoding applied inside the op to q and k (model config `position`). */
typedef enum { LM_POS_NOPE = 0, LM_POS_ROPE = 1 } lm_attn_position;

/* Reusable scratch: one grow-only buffer for the tiles and the rotated / transposed
 * copies of q, k, v, plus the RoPE cos/sin table (kept while D and rope_theta stay
 * the same), so repeated calls (training steps, decode steps) do not allocate. One
 * workspace must not be used by two calls at the same time. */
typedef struct lm_attention_workspace lm_attention_workspace;
lm_attention_workspace *lm_attention_workspace_new(void);
void lm_attention_workspace_free(lm_attention_workspace *ws);

typedef struct {
    int B, T, Hq, Hkv, D;       /* batch, tokens per row, query heads, kv heads, head dim */
    int N;                      /* sequences: set by lm_attention_validate (B or len(cu)-1) */
    const int64_t *cu_seqlens;  /* [N+1] or NULL */
    int n_cu_seqlens;           /* number of entries of cu_seqlens (N+1) */
    float scale;                /* softmax scale; default D^-0.5 */
    int causal;                 /* must be 1 (the only mask implemented) */
    lm_attn_position position;  /* NOPE (default) or ROPE */
    double rope_theta;          /* RoPE base; default 10000; used with ROPE only */
    lm_attention_workspace *ws; /* NULL: scratch is allocated and freed per call */
    const int64_t *pos_rows;    /* cache_write / decode with T = 1: [B] position of each row
                                   (rows of one batch at different positions: serving);
                                   NULL: every row at the call's `pos` */
} lm_attention_config;

/* Fill defaults: scale = D^-0.5, causal, NoPE, rope_theta = 10000, no cu_seqlens. */
void lm_attention_config_default(lm_attention_config *c, int B, int T, int Hq, int Hkv, int D);

typedef struct {
    const float *q, *k, *v; /* [B,T,Hq,D], [B,T,Hkv,D], [B,T,Hkv,D]; all required */
} lm_attention_inputs;

/* Backward: `do_` in, gradients out. dq, dk, dv are all required and fully written. */
typedef struct {
    const float *do_;    /* [B,T,Hq,D] upstream gradient of o */
    float *dq, *dk, *dv; /* [B,T,Hq,D], [B,T,Hkv,D], [B,T,Hkv,D] */
} lm_attention_grads;

/* Check the configuration and the inputs before any math: dims >= 1, D <= 1024 and
 * even with RoPE, Hq a multiple of Hkv, causal == 1 (LM_ERR_UNSUPPORTED otherwise),
 * scale finite, rope_theta finite and > 0 with RoPE, position known, cu_seqlens
 * (B == 1, >= 2 entries, starts at 0, non-decreasing, ends at T), and q, k, v
 * present and finite. Sets c->N. Errors: LM_ERR_INVALID naming the field and value. */
lm_status lm_attention_validate(lm_attention_config *c, const lm_attention_inputs *in,
                                lm_error *err);

/* Forward. o [B,T,Hq,D] is required; lse [B,T,Hq] may be NULL (inference) and is
 * what lm_attention_backward needs. Tokens of empty documents do not exist; every
 * token of a non-empty document sees at least itself, so every row is written. */
lm_status lm_attention_forward(lm_attention_config *c, const lm_attention_inputs *in, float *o,
                               float *lse, lm_error *err);

/* Backward of sum(o * do) given the forward's o and lse (FlashAttention-2: P is
 * recomputed per tile, nothing of size T^2 is stored). o, lse and do are checked
 * finite. dq, dk, dv are overwritten (not accumulated). */
lm_status lm_attention_backward(lm_attention_config *c, const lm_attention_inputs *in,
                                const float *o, const float *lse, lm_attention_grads *gr,
                                lm_error *err);

/* ---------------------------------------------------------------- KV cache, decode */

/* Store the keys and values of c->T new tokens per batch row at positions
 * pos .. pos+T-1 of the cache: k_cache[b, pos+t] = R(pos+t) k[b, t] (rotated when
 * c->position is ROPE, so the cache holds k~ and a decode step rotates only its
 * query) and v_cache[b, pos+t] = v[b, t]. `c` describes the new tokens (B, T, Hq, Hkv,
 * D, position, rope_theta; the layer's own config with T set to their count).
 * k, v [B,T,Hkv,D]; k_cache, v_cache [B,Tmax,Hkv,D], caller-owned, positions outside
 * pos..pos+T-1 untouched. Used after a prefill (T = prompt length, pos = 0) and
 * before each decode step (T = 1, pos = step). All rows of the batch share `pos`, unless
 * c->pos_rows gives each row its own (then T must be 1 and `pos` is not read).
 * Errors (LM_ERR_INVALID): the config checks of lm_attention_validate, k and v
 * finite, cu_seqlens NULL, pos >= 0 and pos + T <= Tmax (for every row's position). */
lm_status lm_attention_cache_write(lm_attention_config *c, int64_t Tmax, int64_t pos,
                                   const float *k, const float *v, float *k_cache, float *v_cache,
                                   lm_error *err);

/* One decode step: q [B,1,Hq,D] (c->T must be 1) is the query at position `pos` of
 * every batch row; k_cache, v_cache [B,Tmax,Hkv,D] hold positions 0..pos as written by
 * lm_attention_cache_write (including the token at pos itself). Writes o [B,1,Hq,D]
 * and, when not NULL, lse [B,1,Hq]; equal (to fp32 rounding) to row pos of
 * lm_attention_forward over the whole sequence. Work and memory traffic are
 * O(B * (pos+1) * Hkv * D); each kv head's cache rows are read once for all the
 * query heads of its group. The cache is not scanned for finiteness (its writer
 * checked what it stored). The softmax sums are accumulated in fp64, so a decode at
 * position 65536 stays within 1e-6 of an fp64 reference. Errors (LM_ERR_INVALID): the
 * config checks of lm_attention_validate, q finite, 0 <= pos < Tmax, cu_seqlens NULL.
 * With c->pos_rows, row b's query is at position pos_rows[b] and attends over 0 ..
 * pos_rows[b] (`pos` is not read): the same result per row as a decode of that row alone. */
lm_status lm_attention_decode(lm_attention_config *c, int64_t Tmax, int64_t pos, const float *q,
                              const float *k_cache, const float *v_cache, float *o, float *lse,
                              lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
