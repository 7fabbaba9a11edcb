/* linmoe layers: the small building blocks of the hybrid model around the KDA,
 * attention and MoE ops, each with an fp32 forward and a hand-written backward on the
 * CPU:
 *
 *   - RMSNorm over the last dim (pre-norm, final norm) and the head-wise RMSNorm gated
 *     by sigmoid that closes the KDA layer (reference/kda.md §7);
 *   - the depthwise causal short convolution in front of KDA (kernel 4, optional fused
 *     SiLU, packed sequences, conv state for decode);
 *   - the dense SwiGLU FFN (the first `first_k_dense_replace` layers);
 *   - cross-entropy fused with the LM head, chunked over the vocabulary.
 *
 * Common rules:
 *   - All tensors are fp32, contiguous, row-major (innermost dim last), owned by the
 *     caller. Outputs are overwritten (gradients too: nothing accumulates into what
 *     the caller passed) and must not alias inputs unless a function says so.
 *   - Every entry point validates dims, pointers, attributes and every float input
 *     (finite) before any math, and returns LM_ERR_INVALID with a message naming the
 *     op, the input or field and the bad value; such errors leave the outputs
 *     untouched.
 *   - Parallelism is OpenMP's (lm_set_num_threads). Results are bitwise identical for
 *     any thread count: work is split into tasks whose shape depends on the problem
 *     only, every reduction over tokens (parameter gradients) runs in a fixed order,
 *     and OpenBLAS runs one thread per task (its thread count is restored on return).
 *
 * What this module does not do: bf16 math, CUDA, RoPE (the attention op applies it),
 * the layer wiring (projections, residuals: src/model/), parameter ownership.
 */
#ifndef LINMOE_LAYERS_H
#define LINMOE_LAYERS_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ================================================================ RMSNorm */

/* eps of the KDA layer's gated output norm (reference/kda.md §7: "head-wise RMSNorm
 * (eps 1e-5)"; fla's KimiDeltaAttention norm_eps default). The model's other norms
 * take `rms_norm_eps` from the config. */
#define LM_GATED_RMSNORM_EPS 1e-5f

/* RMSNorm over the last dim, HF Llama / DeepSeek convention (LlamaRMSNorm: the
 * weight multiplies after normalising, the statistic is computed in fp32):
 *     rstd[n] = 1 / sqrt(mean_d x[n,d]^2 + eps),   y[n,d] = x[n,d] * rstd[n] * weight[d]
 *   x, y      [N, D] fp32 (y must not alias x)
 *   weight    [D] fp32, or NULL (no gain: weight = 1)
 *   rstd      [N] fp32 output or NULL: the statistic, saved for the backward
 *   eps       > 0, finite
 * Errors: LM_ERR_INVALID for N < 0, D < 1, eps, a missing tensor; LM_ERR_NONFINITE for
 * non-finite values (core.h). */
lm_status lm_rmsnorm_forward(int64_t N, int D, float eps, const float *x, const float *weight,
                             float *y, float *rstd, lm_error *err);

/* Backward of sum(y * dy) (Zhang & Sennrich 2019, RMSNorm, §3; with xh = x * rstd,
 * gy = dy * weight):
 *     dx[n,:]   = rstd[n] * (gy - xh * mean_d(gy * xh))
 *     dweight[d] = sum_n dy[n,d] * xh[n,d]        (fp64, in a fixed order)
 *   x, dy, dx [N, D]; weight [D] or NULL (= 1); rstd [N] from the forward, or NULL
 *   (recomputed); dx and dweight [D] may each be NULL when not wanted (dweight is
 *   ignored when weight is NULL). With N = 0, dweight is zeroed. */
lm_status lm_rmsnorm_backward(int64_t N, int D, float eps, const float *x, const float *weight,
                              const float *rstd, const float *dy, float *dx, float *dweight,
                              lm_error *err);

/* lm_rmsnorm_backward on caller scratch, so that the call allocates nothing (the
 * model's memory plan reserves it): ws holds lm_rmsnorm_backward_ws_bytes(N, D) bytes
 * (the fp64 partial dweight of each group of 256 rows; 0 for N = 0), 8-byte aligned,
 * owned by the caller, contents undefined on entry and exit; used only when dweight
 * is wanted. ws == NULL: allocated inside the call (= lm_rmsnorm_backward). Same
 * results bit for bit either way. Errors: as lm_rmsnorm_backward; LM_ERR_INVALID for
 * a misaligned ws. */
int64_t lm_rmsnorm_backward_ws_bytes(int64_t N, int D);
lm_status lm_rmsnorm_backward_ws(int64_t N, int D, float eps, const float *x, const float *weight,
                                 const float *rstd, const float *dy, float *dx, float *dweight,
                                 void *ws, lm_error *err);

/* Head-wise RMSNorm gated by a sigmoid: the KDA layer output (reference/kda.md §7,
 * Kimi Linear tech report arXiv 2510.26692 §4 / Fig. 3; fla's FusedRMSNormGated with
 * activation 'sigmoid'):
 *     o[n,h,:] = x[n,h,:] * rstd[n,h] * weight * sigmoid(gate[n,h,:]),
 *     rstd[n,h] = 1 / sqrt(mean_d x[n,h,d]^2 + eps)
 *   x, gate, o [N, H, Dh] fp32 ([B, T, H, Dh] with N = B*T); o must not alias x or gate
 *   weight     [Dh] fp32, shared by the heads, or NULL (= 1)
 *   rstd       [N, H] fp32 output or NULL
 *   eps        LM_GATED_RMSNORM_EPS in the Kimi Linear layer */
lm_status lm_gated_rmsnorm_forward(int64_t N, int H, int Dh, float eps, const float *x,
                                   const float *gate, const float *weight, float *o, float *rstd,
                                   lm_error *err);

/* Backward of sum(o * do_): with xh = x * rstd, s = sigmoid(gate),
 *     dgate   = do_ * xh * weight * s * (1 - s)
 *     dx      = rstd * (gx - xh * mean_d(gx * xh)),  gx = do_ * s * weight
 *     dweight = sum_{n,h} do_ * s * xh              (fixed order, fp64 sum)
 *   do_, dx, dgate [N, H, Dh]; dweight [Dh]; rstd [N, H] or NULL (recomputed). Any of
 *   dx, dgate, dweight may be NULL when not wanted. */
lm_status lm_gated_rmsnorm_backward(int64_t N, int H, int Dh, float eps, const float *x,
                                    const float *gate, const float *weight, const float *rstd,
                                    const float *do_, float *dx, float *dgate, float *dweight,
                                    lm_error *err);

/* lm_gated_rmsnorm_backward on caller scratch ws of
 * lm_gated_rmsnorm_backward_ws_bytes(N, H, Dh) bytes (the N*H rows' fp64 partials, as
 * lm_rmsnorm_backward_ws); ws == NULL allocates inside the call. */
int64_t lm_gated_rmsnorm_backward_ws_bytes(int64_t N, int H, int Dh);
lm_status lm_gated_rmsnorm_backward_ws(int64_t N, int H, int Dh, float eps, const float *x,
                                       const float *gate, const float *weight, const float *rstd,
                                       const float *do_, float *dx, float *dgate, float *dweight,
                                       void *ws, lm_error *err);

/* ================================================================ short convolution */

typedef enum { LM_ACT_NONE = 0, LM_ACT_SILU = 1 } lm_activation;

#define LM_SHORT_CONV_MAX_W 16

/* Depthwise causal 1-D convolution over time, no bias, optionally followed by SiLU
 * (reference/kda.md §7; Kimi Linear's q/k/v ShortConvolution, kernel 4). Tap order
 * and weight layout are those of HF / fla / Dao's causal_conv1d (nn.Conv1d weight
 * [C, 1, W] squeezed to [C, W], left zero padding W-1): for token t of a sequence
 *     pre[t,c] = sum_{j=0}^{W-1} weight[c,j] * x[t-(W-1)+j, c],   y = act(pre)
 * so weight[c, W-1] multiplies the current token and weight[c, 0] the oldest one.
 * Positions before the start of a sequence read the conv state (zeros without one);
 * with cu_seqlens each document is its own sequence: no tap reads across a boundary.
 *
 * Conv state (Dao's causal_conv1d_update / vLLM layout): [N, C, W-1] fp32, the last
 * W-1 inputs of each sequence, oldest first (state[n,c,W-2] is the most recent). A
 * sequence shorter than W-1 keeps the older entries of its initial state (or zeros).
 */
typedef struct {
    int B, T, C, W;            /* batch, tokens, channels, kernel size (1..LM_SHORT_CONV_MAX_W) */
    int N;                     /* sequences: set by validation (B, or n_cu_seqlens - 1) */
    const int64_t *cu_seqlens; /* [N+1] int64 token offsets, only with B == 1; or NULL */
    int n_cu_seqlens;          /* entries of cu_seqlens (N+1) */
    lm_activation activation;  /* NONE or SILU (fused) */
} lm_short_conv_config;

/* Defaults: no cu_seqlens, activation SILU (the KDA layer's use). */
void lm_short_conv_config_default(lm_short_conv_config *c, int B, int T, int C, int W);
/* Checks the configuration alone (B >= 1, T >= 0, C >= 1, 1 <= W <= LM_SHORT_CONV_MAX_W, the
 * activation, the size, cu_seqlens: B == 1, starts at 0, non-decreasing, ends at T) and sets
 * c->N; every backend's entry points call it first. Errors: LM_ERR_INVALID naming the field. */
lm_status lm_short_conv_config_validate(lm_short_conv_config *c, lm_error *err);

/* Forward (training and prefill).
 *   x, y           [B, T, C] fp32 (y must not alias x)
 *   weight         [C, W] fp32
 *   initial_state  [N, C, W-1] or NULL (zeros)
 *   final_state    [N, C, W-1] output or NULL; may alias initial_state (updated in place)
 * Errors: LM_ERR_INVALID for dims, W outside 1..LM_SHORT_CONV_MAX_W, activation,
 * cu_seqlens (B == 1, starts at 0, non-decreasing, ends at T), missing or aliased
 * tensors; LM_ERR_NONFINITE for non-finite values (core.h). Sets c->N. */
lm_status lm_short_conv_forward(lm_short_conv_config *c, const float *x, const float *weight,
                                const float *initial_state, float *y, float *final_state,
                                lm_error *err);

/* Backward of sum(y * dy) (the final state is not differentiated).
 *   x, dy, dx      [B, T, C];  weight, dweight [C, W];  initial_state, dinitial_state
 *   [N, C, W-1] (initial_state NULL = zeros, as in the forward). dx, dweight and
 *   dinitial_state may each be NULL when not wanted. dweight sums over sequences and
 *   tokens in a fixed order in fp64. */
lm_status lm_short_conv_backward(lm_short_conv_config *c, const float *x, const float *weight,
                                 const float *initial_state, const float *dy, float *dx,
                                 float *dweight, float *dinitial_state, lm_error *err);

/* One decode step for B sequences: y[b,:] = act(conv of (state[b], x[b])), then the
 * state shifts by one and takes x[b] as its newest entry. The same as the forward with
 * T = 1 and initial_state = final_state = conv_state.
 *   x, y [B, C];  weight [C, W];  conv_state [B, C, W-1] in/out. */
lm_status lm_short_conv_step(int B, int C, int W, lm_activation act, const float *x,
                             const float *weight, float *conv_state, float *y, lm_error *err);

/* ================================================================ SwiGLU MLP */

/* Dense SwiGLU FFN (Shazeer 2020, "GLU Variants Improve Transformer", Eq. 6; HF
 * LlamaMLP / DeepseekV3MLP): out = down_proj( silu(gate_proj x) * up_proj x ).
 *   x, out      [N, D] fp32 (out must not alias x)
 *   gate_proj   [F, D], up_proj [F, D], down_proj [D, F] (torch Linear layout [out, in])
 *   hidden      [N, 2F] output or NULL: row n holds gate_proj x (columns 0..F-1) and
 *               up_proj x (F..2F-1), the activations the backward needs
 *   ws          scratch of lm_swiglu_ws_floats(N, F, hidden != NULL) floats, or NULL
 *               (allocated and freed inside the call)
 * Matmuls by lm_sgemm (OpenBLAS), one thread per block of tokens. */
typedef struct {
    const float *gate_proj, *up_proj, *down_proj;
} lm_swiglu_weights;

typedef struct {
    float *gate_proj, *up_proj, *down_proj; /* each may be NULL when not wanted */
} lm_swiglu_grads;

/* Floats of scratch enough for both the forward and the backward: 3*N*F when the
 * caller keeps `hidden`, 5*N*F when it does not. */
int64_t lm_swiglu_ws_floats(int64_t N, int F, int have_hidden);

lm_status lm_swiglu_forward(int64_t N, int D, int F, const lm_swiglu_weights *w, const float *x,
                            float *out, float *hidden, float *ws, lm_error *err);

/* Backward of sum(out * dout): with g, u the two halves of hidden, a = silu(g) * u,
 * da = dout down_proj:
 *   d down_proj = dout^T a,  dg = da * u * silu'(g),  du = da * silu(g),
 *   d gate_proj = dg^T x,    d up_proj = du^T x,      dx = dg gate_proj + du up_proj
 *   hidden   [N, 2F] from the forward, or NULL (recomputed: two more matmuls)
 *   dout, dx [N, D] (dx may be NULL); g: weight gradients in the weights' layouts.
 * Weight gradients are sums over the N tokens computed by one matmul each per block of
 * output rows (fixed order). */
lm_status lm_swiglu_backward(int64_t N, int D, int F, const lm_swiglu_weights *w, const float *x,
                             const float *hidden, const float *dout, float *dx,
                             const lm_swiglu_grads *g, float *ws, lm_error *err);

/* ================================================================ cross-entropy */

/* Default vocabulary rows per chunk: a byte vocabulary (257) is one chunk, GPT-2's
 * 50257 is 25 chunks; the logits block held per thread is 64 x 2048 fp32 (512 KiB).
 * Measured on 1024 x 512 x 50257 (2 cores): chunk 2048 was the fastest of 512..8192,
 * all within 13% (forward and backward). */
#define LM_CE_CHUNK_DEFAULT 2048

/* Cross-entropy fused with the LM head (untied or tied: W is the embedding then),
 * chunked over the vocabulary so that the [N, V] logits never exist:
 *     logits[n,v] = h[n,:] . W[v,:],   lse[n] = log sum_v exp(logits[n,v])
 *     loss = (1/count) sum_{n: target[n] != ignore_index} (lse[n] - logits[n, target[n]])
 * in nats; count = the number of counted targets (loss 0 when count = 0). lse is built
 * by an online log-sum-exp over chunks of chunk_size vocabulary rows (Milakov &
 * Gimelshein 2018, "Online normalizer calculation for softmax"), each chunk's logits
 * computed for 64 tokens at a time by lm_sgemm.
 *   h        [N, D] fp32 (final hidden states, after the final norm)
 *   W        [V, D] fp32 (lm_head.weight, torch Linear layout)
 *   targets  [N] int32: token ids in [0, V), or ignore_index (skipped)
 *   ws       optional scratch of lm_cross_entropy_ws_floats(c) floats (depends on the
 *            current thread count); NULL: allocated inside the call */
typedef struct {
    int64_t N;
    int D, V;
    int chunk_size;    /* vocabulary rows per chunk, >= 1 (LM_CE_CHUNK_DEFAULT) */
    int ignore_index;  /* -1; must lie outside [0, V) */
    float *ws;         /* optional scratch */
    int64_t ws_floats; /* its size in floats */
} lm_ce_config;

void lm_ce_config_default(lm_ce_config *c, int64_t N, int D, int V);
int64_t lm_cross_entropy_ws_floats(const lm_ce_config *c);

/* Forward: *loss (nats, mean over counted targets), *count (counted targets; may be
 * NULL), lse [N] output or NULL (saved for the backward; computed for every row,
 * ignored or not). Errors: LM_ERR_INVALID for dims, chunk_size, ignore_index, a target
 * outside [0, V) that is not ignore_index (named with its index), non-finite h or W,
 * a scratch that is too small, and logits that overflow fp32 (finite but huge h, W:
 * detected after the pass, so lse may then have been written). */
lm_status lm_cross_entropy_forward(const lm_ce_config *c, const float *h, const float *W,
                                   const int32_t *targets, double *loss, int64_t *count, float *lse,
                                   lm_error *err);

/* Backward of dloss * loss: dlogits = dloss * (softmax(logits) - onehot(target)) / count
 * on counted rows, 0 on ignored rows; dh = dlogits W, dW = dlogits^T h. The logits are
 * recomputed chunk by chunk (twice: once for dh by blocks of tokens, once for dW by
 * blocks of vocabulary rows, so that each gradient sums in a fixed order without a
 * [N, V] or per-thread [V, D] buffer).
 *   lse   [N] from the forward, or NULL (recomputed by a forward pass)
 *   dh    [N, D], dW [V, D]: either may be NULL. With count = 0 both are zero. */
lm_status lm_cross_entropy_backward(const lm_ce_config *c, const float *h, const float *W,
                                    const int32_t *targets, const float *lse, float dloss,
                                    float *dh, float *dW, lm_error *err);

/* Per-row negative log-likelihood (nats) for evals: nll[n] = lse[n] - logits[n,
 * target[n]], 0 for ignored rows. nll [N] fp32. *count (may be NULL): counted rows. */
lm_status lm_cross_entropy_nll(const lm_ce_config *c, const float *h, const float *W,
                               const int32_t *targets, float *nll, int64_t *count, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
