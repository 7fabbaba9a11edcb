/* linmoe layers on NVIDIA GPUs (CUDA C, sm_90a): the memory-bound building blocks
 * around the KDA, attention and MoE ops, with bf16 storage and fp32 math.
 *
 *   - token embedding: gather (forward) and a deterministic scatter-add (backward);
 *   - RMSNorm over the last dim, with an optional fused residual add (forward) and
 *     an optional fused incoming residual gradient (backward);
 *   - the head-wise RMSNorm gated by sigmoid that closes the KDA layer;
 *   - the depthwise causal short convolution (kernel W <= 8, fused SiLU, packed
 *     documents, conv state, decode step);
 *   - the element-wise SwiGLU activation between the FFN's projections.
 *
 * Same math as the CPU reference (include/linmoe/layers.h; the embedding as in
 * src/model/model.c): each function below names the CPU function it matches.
 *
 * Common rules:
 *   - Every entry point takes the caller's context first (include/linmoe/backend.h),
 *     makes its device current and launches on its stream: asynchronous, no host
 *     synchronisation (the only exception: the first call at a new size grows the
 *     context's scratch, which synchronises the stream once, lm_cuda_ctx_scratch).
 *   - Tensors are device pointers, contiguous, row-major (innermost dim last), owned
 *     by the caller. bf16 tensors are `__nv_bfloat16` passed as void *; fp32 ones as
 *     float *. Activations and the weights' working copies are bf16, statistics,
 *     states and weight gradients fp32, all math in fp32 (DESIGN.md "Devices").
 *   - Weight gradients (dweight, the embedding's dW) ACCUMULATE: dW += ... (the caller
 *     zeroes them once per step; a tied LM head may already have added its part).
 *     Every other output is overwritten.
 *   - Deterministic: no floating-point atomics; every reduction over tokens runs in a
 *     fixed order that depends on the shape and the device's SM count only, so two
 *     runs on one machine give the same bits.
 *   - Vector path: 16-byte loads and stores when the row length is a multiple of 8
 *     elements and the pointers are 16-byte aligned; otherwise a scalar path with the
 *     same results (up to fp32 summation order).
 *   - Validation is of the arguments only (dims, pointers, aliasing, the host-side
 *     cu_seqlens); device data is not scanned for NaN / Inf (the CPU op does that).
 *
 * Errors: LM_ERR_INVALID for a bad argument (the message names the op, the argument
 * and its value); LM_ERR_UNSUPPORTED for a valid configuration this backend does not
 * run (the key and value named) or a linmoe built without CUDA
 * (src/ops/nocuda/layers_stub.c); LM_ERR_NOMEM / LM_ERR_IO from CUDA (the message
 * names the call). On LM_ERR_INVALID / LM_ERR_UNSUPPORTED nothing was launched.
 *
 * What this module does not do: the projections (GEMMs), the residual / AttnRes
 * wiring, the LM head and loss, bf16 <-> fp32 weight casts, the optimizer.
 */
#ifndef LINMOE_CUDA_LAYERS_H
#define LINMOE_CUDA_LAYERS_H

#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/layers.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ================================================================ embedding */

/* Token embedding gather (src/model/model.c run_forward: e[n,:] = W_emb[ids[n],:]):
 *     out[n, :] = weight[ids[n], :]
 *   ids     [N] int32 device, token ids in [0, V)
 *   weight  [V, D] bf16 (model.embed_tokens.weight, working copy)
 *   out     [N, D] bf16, overwritten
 *   n_bad   device int32 or NULL: out-of-range ids. An id outside [0, V) never reads
 *           out of bounds: its row of out is written as zeros and, when n_bad is
 *           given, *n_bad is incremented once per such token (an integer atomic; the
 *           caller zeroes it and reads it back when it wants to check). The data
 *           loader validates ids on the host (lm_model check_ids), so this is a guard.
 * N = 0 is a no-op. Errors: LM_ERR_INVALID for N < 0 or >= 2^31, V < 1, D < 1, a
 * missing pointer. */
lm_status lm_cuda_embedding_forward(lm_cuda_ctx *ctx, int64_t N, int V, int D, const int32_t *ids,
                                    const void *weight, void *out, int32_t *n_bad, lm_error *err);

/* Backward of the gather, a scatter-add (src/model/model.c backward, "embedding rows"):
 *     dweight[v, :] += sum over n with ids[n] = v of dout[n, :]    (fp32)
 * summed in token order n for each v, deterministically and without atomics: the
 * pairs (id, n) are sorted by CUB's radix sort (keys id << bits(N) | n made in token
 * order, 32-bit when they fit, sorted stably on their id bits: by id, then by token),
 * each block of 16 sorted positions sums its runs of equal ids in order, runs inside the
 * block go straight into dweight (one addition per row), and runs that cross a block
 * boundary are finished by the block where they start, its pieces summed in a fixed
 * grouping (two kernels). Rows of dweight that no token hits are untouched.
 * Out-of-range ids contribute nothing.
 *   ids      [N] int32 device (those of the forward)
 *   dout     [N, D] bf16, the gradient of out
 *   dweight  [V, D] fp32, accumulated (may already hold the tied LM head's gradient)
 * Scratch: 8 N (16 N with 64-bit keys) + 8 ceil(N/16) D bytes plus CUB's temporary
 * storage (LM_SCRATCH_A).
 * Errors: as the forward. */
lm_status lm_cuda_embedding_backward(lm_cuda_ctx *ctx, int64_t N, int V, int D, const int32_t *ids,
                                     const void *dout, float *dweight, lm_error *err);

/* ================================================================ RMSNorm */

/* RMSNorm over the last dim, as lm_rmsnorm_forward (HF LlamaRMSNorm; Zhang & Sennrich
 * 2019), optionally fused with the residual add that precedes it in a pre-norm block:
 *     h = x + residual (rounded to bf16; only when residual != NULL, else h = x)
 *     rstd[n] = 1 / sqrt(mean_d h[n,d]^2 + eps),   y[n,d] = h[n,d] * rstd[n] * weight[d]
 * The statistic is computed from the bf16 values of h that are stored, so the backward
 * (given h) sees exactly the forward's input.
 *   x, residual  [N, D] bf16 (residual may be NULL)
 *   weight       [D] bf16 or NULL (no gain: weight = 1)
 *   h            [N, D] bf16 output, required with residual (ignored without); may
 *                alias x or residual (each element is read before it is written)
 *   y            [N, D] bf16 output; must not alias x, residual or h
 *   rstd         [N] fp32 output or NULL (the statistic, for the backward)
 *   eps          finite, > 0 (the config's rms_norm_eps)
 * One warp per row (a group of 8 / 16 lanes for D <= 128); rows of D <= 2048 stay in
 * registers (one read of x), longer rows are read twice (the second time from L1/L2);
 * a persistent grid of one wave of resident CTAs. Errors: LM_ERR_INVALID for N < 0,
 * D < 1, eps, a missing or aliased tensor. */
lm_status lm_cuda_rmsnorm_forward(lm_cuda_ctx *ctx, int64_t N, int D, float eps, const void *x,
                                  const void *residual, const void *weight, void *h, void *y,
                                  float *rstd, lm_error *err);

/* Backward of sum(y * dy), as lm_rmsnorm_backward (with xh = x * rstd, gy = dy * w):
 *     dx[n,:]    = rstd[n] * (gy - xh * mean_d(gy * xh))  (+ dresidual[n,:])
 *     dweight[d] += sum_n dy[n,d] * xh[n,d]
 *   x          [N, D] bf16: the normalised input (h of the fused forward)
 *   weight     [D] bf16 or NULL (= 1; then dweight is ignored)
 *   rstd       [N] fp32 from the forward, or NULL (recomputed from x with eps)
 *   dy         [N, D] bf16
 *   dresidual  [N, D] bf16 or NULL: a gradient added to dx in the same pass (the
 *              residual stream's gradient in a pre-norm block); may alias dx
 *   dx         [N, D] bf16 output or NULL; must not alias x or dy
 *   dweight    [D] fp32, accumulated, or NULL
 * dweight is reduced deterministically: each CTA (one wave of resident CTAs, a few
 * hundred) sums its rows per column in shared memory (one accumulator row per warp, or
 * per group of 8 / 16 lanes for short rows; no atomics), writes one fp32 row of partials
 * to scratch (LM_SCRATCH_A, [CTAs, D]), and a second kernel adds the partials to dweight
 * in CTA order. Errors: as the forward;
 * LM_ERR_UNSUPPORTED when one warp's accumulator row (D fp32 values, rounded up to a
 * multiple of 256) does not fit the device's shared memory per CTA (D above about 56000
 * on the H200). */
lm_status lm_cuda_rmsnorm_backward(lm_cuda_ctx *ctx, int64_t N, int D, float eps, const void *x,
                                   const void *weight, const float *rstd, const void *dy,
                                   const void *dresidual, void *dx, float *dweight, lm_error *err);

/* Head-wise RMSNorm gated by sigmoid, as lm_gated_rmsnorm_forward (reference/kda.md §7;
 * Kimi Linear arXiv 2510.26692 §4; fla FusedRMSNormGated, activation 'sigmoid'):
 *     o[n,h,:] = x[n,h,:] * rstd[n,h] * weight * sigmoid(gate[n,h,:])
 *     rstd[n,h] = 1 / sqrt(mean_d x[n,h,d]^2 + eps)
 *   x, gate, o  [N, H, Dh] bf16 ([B, T, H, Dh] with N = B*T); o must not alias x, gate
 *   weight      [Dh] bf16, shared by the heads, or NULL (= 1)
 *   rstd        [N, H] fp32 output or NULL
 *   eps         LM_GATED_RMSNORM_EPS in the Kimi Linear layer
 * Rows of Dh = 128 take 16 lanes (one 16-byte load of x and of gate per lane).
 * Errors: LM_ERR_INVALID for N < 0, H < 1, Dh < 1, eps, missing or aliased tensors. */
lm_status lm_cuda_gated_rmsnorm_forward(lm_cuda_ctx *ctx, int64_t N, int H, int Dh, float eps,
                                        const void *x, const void *gate, const void *weight,
                                        void *o, float *rstd, lm_error *err);

/* Backward of sum(o * do_), as lm_gated_rmsnorm_backward (xh = x * rstd, s =
 * sigmoid(gate)):
 *     dgate    = do_ * xh * weight * s * (1 - s)
 *     dx       = rstd * (gx - xh * mean_d(gx * xh)),   gx = do_ * s * weight
 *     dweight += sum_{n,h} do_ * s * xh
 *   x, gate, do_  [N, H, Dh] bf16;  weight [Dh] bf16 or NULL;  rstd [N, H] fp32 or NULL
 *   dx, dgate     [N, H, Dh] bf16 outputs or NULL (must not alias the inputs)
 *   dweight       [Dh] fp32, accumulated, or NULL (ignored without weight)
 * dweight reduced as in lm_cuda_rmsnorm_backward. Errors: as the forward. */
lm_status lm_cuda_gated_rmsnorm_backward(lm_cuda_ctx *ctx, int64_t N, int H, int Dh, float eps,
                                         const void *x, const void *gate, const void *weight,
                                         const float *rstd, const void *do_, void *dx, void *dgate,
                                         float *dweight, lm_error *err);

/* ================================================================ short convolution */

/* Largest kernel size of the CUDA short convolution (the CPU op takes up to
 * LM_SHORT_CONV_MAX_W; W in 9..16 gives LM_ERR_UNSUPPORTED here). */
#define LM_CUDA_SHORT_CONV_MAX_W 8

/* Depthwise causal conv + optional SiLU, as lm_short_conv_forward (reference/kda.md
 * §7; HF / fla / causal_conv1d tap order): for token t of a sequence
 *     pre[t,c] = sum_{j=0}^{W-1} weight[c,j] * x[t-(W-1)+j, c],   y = act(pre)
 * positions before the sequence start read the initial state (zeros without one);
 * with cu_seqlens every document is its own sequence (empty and length-1 documents
 * allowed).
 *   c              the CPU config (B, T, C, W <= 8, activation NONE / SILU,
 *                  cu_seqlens: HOST int64 [N+1], only with B == 1); validated on the
 *                  host and sets c->N; cu_seqlens is copied to the device through the
 *                  context's pinned staging (lm_cuda_ctx_upload) on every call
 *   x, y           [B, T, C] bf16; y must not alias x
 *   weight         [C, W] bf16 (nn.Conv1d weight [C, 1, W] squeezed)
 *   initial_state  [N, C, W-1] fp32 or NULL (zeros); oldest entry first
 *   final_state    [N, C, W-1] fp32 output or NULL: the last W-1 inputs of each
 *                  sequence (a sequence shorter than W-1 keeps the newer entries of
 *                  its initial state); may alias initial_state (a second kernel writes
 *                  it after every read of the initial state)
 * W = 4 with C % 8 == 0 and 16-byte aligned x, y: a CTA stages 32 tokens (+ the W-1
 * halo rows) of 512 channels in shared memory (cp.async) and each thread walks 16 tokens
 * of 4 channels out of it; other shapes: each thread walks 64 tokens of 8 channels (4
 * with W > 4; 1 when C or the pointers do not allow vectors) from global memory. Both
 * keep the W-1 previous inputs in registers.
 * Errors: LM_ERR_INVALID as lm_short_conv_forward (minus the finiteness scan) and for
 * aliasing; LM_ERR_UNSUPPORTED for W > LM_CUDA_SHORT_CONV_MAX_W. */
lm_status lm_cuda_short_conv_forward(lm_cuda_ctx *ctx, lm_short_conv_config *c, const void *x,
                                     const void *weight, const float *initial_state, void *y,
                                     float *final_state, lm_error *err);

/* Backward of sum(y * dy), as lm_short_conv_backward (the final state carries no
 * gradient): with g = dy * act'(pre) (pre recomputed),
 *     dx[s,c]             = sum_j weight[c,j] * g[s+(W-1)-j, c]   (g = 0 past the end)
 *     dweight[c,j]       += sum_t g[t,c] * x[t-(W-1)+j, c]        (state rows included)
 *     dinitial_state[n,c,i] = the same sum as dx at the position i-(W-1) before the
 *                           sequence start (zeros for an empty sequence)
 *   x, dy          [B, T, C] bf16;  weight [C, W] bf16;  initial_state [N, C, W-1] fp32
 *                  or NULL (zeros, as in the forward)
 *   dx             [B, T, C] bf16 output or NULL; must not alias x or dy
 *   dweight        [C, W] fp32, accumulated, or NULL
 *   dinitial_state [N, C, W-1] fp32 output (overwritten) or NULL
 * dweight: each 64-token tile writes fp32 partials [tiles, C, W] to scratch
 * (LM_SCRATCH_A), then a second kernel adds them to dweight in tile order. */
lm_status lm_cuda_short_conv_backward(lm_cuda_ctx *ctx, lm_short_conv_config *c, const void *x,
                                      const void *weight, const float *initial_state,
                                      const void *dy, void *dx, float *dweight,
                                      float *dinitial_state, lm_error *err);

/* One decode step for B sequences, as lm_short_conv_step: y[b,:] = act(conv of
 * (state[b], x[b])), then the state shifts by one and takes x[b] (as stored in bf16)
 * as its newest entry.
 *   x, y        [B, C] bf16 (y must not alias x)
 *   weight      [C, W] bf16
 *   conv_state  [B, C, W-1] fp32, in place (required when W > 1)
 * Errors: LM_ERR_INVALID for B < 1, C < 1, W outside [1, LM_SHORT_CONV_MAX_W], act,
 * missing pointers; LM_ERR_UNSUPPORTED for W > LM_CUDA_SHORT_CONV_MAX_W. */
lm_status lm_cuda_short_conv_step(lm_cuda_ctx *ctx, int B, int C, int W, lm_activation act,
                                  const void *x, const void *weight, float *conv_state, void *y,
                                  lm_error *err);

/* ================================================================ SwiGLU */

/* The element-wise part of the SwiGLU FFN (Shazeer 2020, Eq. 6; lm_swiglu_forward's
 * `hidden` layout): row n of gu holds g = gate_proj x (columns 0..F-1) and u = up_proj x
 * (columns F..2F-1);
 *     h[n, f] = silu(g[n, f]) * u[n, f] = g * sigmoid(g) * u
 *   gu  [N, 2F] bf16
 *   h   [N, F] bf16 output (must not alias gu)
 * One pass, 16-byte loads and stores when F % 8 == 0 and the pointers are aligned.
 * Errors: LM_ERR_INVALID for N < 0, F < 1, missing or aliased tensors. */
lm_status lm_cuda_swiglu_forward(lm_cuda_ctx *ctx, int64_t N, int F, const void *gu, void *h,
                                 lm_error *err);

/* Backward (lm_swiglu_backward's element-wise step), with s = sigmoid(g):
 *     dg = dh * u * s * (1 + g * (1 - s)),   du = dh * g * s
 *   gu   [N, 2F] bf16 (the forward's input);  dh [N, F] bf16
 *   dgu  [N, 2F] bf16 output: dg in columns 0..F-1, du in F..2F-1; may alias gu (in
 *        place: each element is read before it is written); must not alias dh
 *   h    [N, F] bf16 output or NULL: silu(g) * u recomputed in the same pass (the
 *        activation the down projection's weight gradient needs), so the forward's h
 *        need not be kept
 * Errors: as the forward. */
lm_status lm_cuda_swiglu_backward(lm_cuda_ctx *ctx, int64_t N, int F, const void *gu,
                                  const void *dh, void *dgu, void *h, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
