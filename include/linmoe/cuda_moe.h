/* linmoe MoE experts on NVIDIA GPUs (CUDA C, sm_90a): the expert side of one MoE
 * feed-forward layer, forward and backward, given the router's output. bf16 activations
 * and weights, fp32 accumulation, fp32 weight gradients accumulated in place.
 *
 * Math: the same as the CPU layer (include/linmoe/moe.h, src/ops/moe.c); sources:
 * reference/moe.md §2 (DeepSeek-V3 MoE, shared + routed experts), §5 (capacity), §6.3
 * (grouped GEMM with device-resident group sizes), §6.4 (FLOP accounting); SwiGLU: Shazeer,
 * "GLU Variants Improve Transformer", arXiv:2002.05202, Eq. 6. For token t with input x_t:
 *   E_e(x) = W_down[e] (silu(W_gate[e] x) * W_up[e] x),   silu(z) = z sigmoid(z)
 *   S(x)   = the same SwiGLU with the shared weights (width fs = n_shared_experts * f)
 *   y_t    = S(x_t) + sum_{j < k, topk_idx[t,j] >= 0} topk_weight[t,j] E_{topk_idx[t,j]}(x_t)
 * The combine weight multiplies the expert's output after down_proj. topk_weight already
 * carries routed_scaling_factor and the top-k normalisation (moe_router.h): nothing here
 * scales it again. A dropped assignment (topk_idx = -1, capacity) contributes nothing.
 * Backward, for the upstream gradient dy (Ys = expert outputs before the weight):
 *   dtopk_weight[t,j] = <dy_t, E_e(x_t)>                     (0 where dropped)
 *   dA = (w dy) W_down[e],  dg = dA u silu'(g),  du = dA silu(g)
 *   dW_down[e] += (w dy)^T a,  dW_gate[e] += dg^T x,  dW_up[e] += du^T x
 *   dx_t = dS(x_t) + sum_j (dg W_gate[e] + du W_up[e]) rows of t
 * The router's own part of dx (dlogits W_router) and d gate.weight are not computed here
 * (the router backward turns dtopk_weight into dlogits; the caller adds dlogits W_router).
 *
 * Algorithm:
 *   1. permutation (3 small kernels, deterministic): a histogram of topk_idx per chunk of
 *      4096 assignments, one scan (per-expert offsets = exclusive prefix of the counts
 *      rounded up to 128: each expert's rows start on a 128-row tile, the rows between
 *      its count and the next expert's start are padding that the GEMMs fill with zeros),
 *      and a stable counting-sort scatter (by expert, then by token, then by slot: the
 *      order of the flat index t*k + j) giving perm[sorted row] = t*k + j, the token of
 *      each sorted row, and inv[t*k + j] = sorted row (-1 where dropped). No atomics whose
 *      order matters (the histogram's shared-memory integer adds are exact).
 *   2. grouped GEMMs of our own (no host synchronisation: the kernels read the group
 *      offsets from device memory): a persistent kernel per product over tiles
 *      (group, 128-row tile, 256-column tile), three warpgroups per CTA: one producer
 *      (cp.async with zero fill, 4 stages of 128x64 + 256x64 bf16 tiles in the 128-byte
 *      swizzled layout, mbarrier full / empty handshakes) and two consumers (wgmma
 *      m64n256k16, bf16 in, fp32 accumulators in registers), epilogue straight from the
 *      accumulators (variant v0) or, in variant v1 (the default), the weights and the
 *      sorted rows loaded by the tensor copy engine and the epilogue staged through
 *      shared memory (see opts.variant). The x rows are gathered by the loader (Xs is
 *      never materialised).
 *      gate_proj and up_proj are one GEMM: a 256-column tile holds 128 gate and the same
 *      128 up columns, so the epilogue computes a = silu(g) u and writes a (and [g | u],
 *      saved for the backward) directly. Products per routed expert segment (m rows):
 *        forward   [g|u] = X Wgu^T (SwiGLU epilogue), Ys = A W_down^T
 *        backward  dH = dswiglu((w dy) W_down) (epilogue reads the saved [g|u]),
 *                  dX = dH [W_gate; W_up], dW_down += (w dy)^T A, dW_gate|up += dH^T X
 *      The weight gradients reduce over the segment's tokens inside one CTA (no split-K,
 *      no atomics), so every result is bitwise reproducible.
 *   3. combine: y_t = S(x_t) + sum_j w[t,j] Ys[inv[t,j]] (one warp per token, fixed
 *      order: shared part first, then j = 0 .. k-1, fp32 sums); the backward's dx is the
 *      same gather with unit weights over dX, and dtopk_weight a per-token dot product
 *      (fixed butterfly reduction).
 *   4. shared experts: the same grouped kernels with one group of all T tokens.
 *
 * Layouts (row-major, innermost last, device memory of the context's device; E =
 * num_experts, k = num_experts_per_tok, D = hidden_size, F = moe_intermediate_size,
 * fs = n_shared_experts * F):
 *   x, y, dy, dx                    [T, D]     bf16
 *   topk_idx                        [T, k]     int32, expert id in [0, E) or -1 (dropped)
 *   topk_weight                     [T, k]     fp32 (0 where dropped)
 *   dtopk_weight                    [T, k]     fp32 (written; 0 where dropped)
 *   gate_proj, up_proj              [E, F, D]  bf16 (expert e at offset e*F*D)
 *   down_proj                       [E, D, F]  bf16
 *   shared_gate_proj, shared_up_proj [fs, D]   bf16
 *   shared_down_proj                [D, fs]    bf16
 *   gradients                       the weights' shapes, fp32, ACCUMULATED (+=)
 *
 * Memory: nothing is allocated inside forward / backward when the caller passes
 * `scratch` (or once the context's scratch slot LM_SCRATCH_D has grown to the size). The
 * forward writes the permutation and the activations the backward needs into `saved`,
 * a caller-owned device buffer of lm_cuda_moe_sizes.saved_bytes that must stay untouched
 * from the forward to its backward(s). Sizes (Tk = T*k, R = Tk + 127 E sorted rows):
 *   saved   8 R + 4 Tk + 2 R (2F + F + D) + 2 T (2fs + fs) bytes + O(E)
 *   scratch max(forward: 4 E ceil(Tk / 4096), backward: 2 R (D + 2F) + 4 T fs) bytes
 *
 * Context (include/linmoe/backend.h): every entry point takes the lm_cuda_ctx it runs on
 * (device made current, kernels on its stream, asynchronous; faults inside a kernel are
 * reported by the next synchronising call). No host synchronisation.
 *
 * Limits: D and F multiples of 8 (16-byte rows), E <= 1024, k <= 32, T * k + 127 E < 2^31
 * (LM_ERR_UNSUPPORTED otherwise, naming the key and value).
 *
 * Errors: LM_ERR_INVALID (message names the argument and value) for a NULL context,
 * config or required pointer, a config lm_moe_config_validate refuses, T < 0, opts.gemm or
 * opts.variant out of range;
 * LM_ERR_UNSUPPORTED for the limits above and in a build without CUDA
 * (src/ops/nocuda/moe_stub.c); LM_ERR_IO / LM_ERR_NOMEM from CUDA. The grouped GEMM
 * traps (reported as a launch failure by the next synchronising call) if a pipeline
 * handshake ever waits for seconds, instead of hanging the device.
 *
 * What this module does not do: the router matmul, routing and its backward
 * (cuda_router.h), the residual and the norm around the layer, expert parallelism.
 */
#ifndef LINMOE_CUDA_MOE_H
#define LINMOE_CUDA_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device pointers to the working copy of the expert weights (bf16, shapes above, owned
 * by the caller). The shared ones are required when n_shared_experts > 0 and ignored
 * otherwise. The router weight (gate.weight) is not used here. */
typedef struct {
    const void *gate_proj, *up_proj, *down_proj;
    const void *shared_gate_proj, *shared_up_proj, *shared_down_proj;
} lm_cuda_moe_weights;

/* Device pointers to fp32 weight gradients, same shapes as the weights. Each is
 * ACCUMULATED (dW += ...; the caller zeroes them once per step); NULL: not computed.
 * An expert that received no token adds exactly nothing. */
typedef struct {
    float *gate_proj, *up_proj, *down_proj;
    float *shared_gate_proj, *shared_up_proj, *shared_down_proj;
} lm_cuda_moe_grads;

/* Bytes the caller reserves for T tokens under a config (lm_cuda_moe_plan). */
typedef struct {
    size_t saved_bytes;   /* forward -> backward buffer (`saved`), device */
    size_t scratch_bytes; /* temporary buffer of one forward or backward call, device */
} lm_cuda_moe_sizes;

/* Options of one call (NULL: all defaults, zero-initialise to get them). */
enum {
    LM_CUDA_MOE_GEMM_WGMMA = 0, /* default: the warp-specialised wgmma grouped GEMM */
    LM_CUDA_MOE_GEMM_SIMPLE = 1 /* a plain fp32-FMA tiled kernel (reference, slow): same
                                   tiles, same epilogues, same results up to rounding */
};
/* Variants of the wgmma grouped GEMM (opts.variant; same tiles, same math, results equal
 * up to rounding; each is deterministic). Any variant's backward may follow any variant's
 * forward. */
enum {
    LM_CUDA_MOE_VARIANT_DEFAULT = 0, /* the default: currently LM_CUDA_MOE_VARIANT_TMA */
    LM_CUDA_MOE_VARIANT_CPASYNC = 1, /* "v0": every operand loaded with cp.async by a producer
                                        warpgroup, epilogue straight from the accumulators */
    LM_CUDA_MOE_VARIANT_TMA = 2      /* "v1": weights and sorted rows by the tensor copy
                                        engine, gathered x rows by cp.async completing on the
                                        stage barrier, epilogue staged through shared memory
                                        (16-byte coalesced stores / read-modify-writes). Where
                                        the driver has no cuTensorMapEncodeTiled or a buffer is
                                        not 16-byte aligned, the default runs v0 instead and
                                        this value fails with LM_ERR_UNSUPPORTED */
};
typedef struct {
    int gemm;      /* LM_CUDA_MOE_GEMM_* */
    int max_ctas;  /* 0: one CTA per SM; > 0: cap on the persistent grid (tests use it to
                      make one CTA run many tiles) */
    int gemm_only; /* benchmarks: 1 runs only the routed grouped GEMMs of the pass (no
                      permutation, gathers, shared experts or combine); needs an earlier
                      full forward into the same `saved` */
    int variant;   /* LM_CUDA_MOE_VARIANT_* (gemm = WGMMA); other values: LM_ERR_INVALID */
    int gemm_mask; /* with gemm_only: the LM_CUDA_MOE_P_* products of the pass to run
                      (0: all of them); ignored otherwise */
} lm_cuda_moe_opts;
/* The routed grouped products (bits of opts.gemm_mask; rows m of an expert, K noted):
 * forward [g | u] = X [Wg; Wu]^T with the SwiGLU epilogue (K = D), Ys = A Wd^T (K = F);
 * backward dH = dswiglu((w dy) Wd) (K = D), dWd += (w dy)^T A (K = m), dX = dH [Wg; Wu]
 * (K = 2F), [dWg; dWu] += dH^T X (K = m). */
enum {
    LM_CUDA_MOE_P_GATEUP = 1,
    LM_CUDA_MOE_P_DOWN = 2,
    LM_CUDA_MOE_P_DDOWN = 4,
    LM_CUDA_MOE_P_WDOWN = 8,
    LM_CUDA_MOE_P_DGATEUP = 16,
    LM_CUDA_MOE_P_WGATEUP = 32
};

/* The sizes for T >= 0 tokens. Errors: LM_ERR_INVALID (bad config, T < 0, NULL out),
 * LM_ERR_UNSUPPORTED (the limits above). Never touches a device. */
lm_status lm_cuda_moe_plan(const lm_moe_config *c, int T, lm_cuda_moe_sizes *out, lm_error *err);

/* Forward of the expert side over T tokens: y [T, D] bf16 (overwritten) from x [T, D]
 * bf16 and the router's output topk_idx / topk_weight [T, k]. counts [E] int32 (kept
 * assignments per expert, the router's) may be NULL: the permutation recounts topk_idx,
 * so a counts that disagrees can never make it write out of bounds; it is not read.
 * Entries of topk_idx outside [0, E) count as dropped. training = 1 also saves [g | u]
 * for the backward; 0 (inference) skips it and the backward must not be called.
 * saved: device buffer of lm_cuda_moe_plan's saved_bytes for the same (config, T);
 * scratch: device buffer of scratch_bytes, or NULL for the context's LM_SCRATCH_D slot.
 * T = 0 does nothing. Errors: see the top of this header. */
lm_status lm_cuda_moe_forward(lm_cuda_ctx *ctx, const lm_moe_config *c, int T,
                              const lm_cuda_moe_weights *w, const void *x, const int32_t *topk_idx,
                              const float *topk_weight, const int32_t *counts, int training,
                              void *saved, void *scratch, void *y, const lm_cuda_moe_opts *opts,
                              lm_error *err);

/* Backward of the last training forward into `saved` (same config, T, weights, x and
 * topk_weight, unchanged): from dy [T, D] bf16, writes dx [T, D] bf16 (the experts' part:
 * routed + shared; NULL: not computed) and dtopk_weight [T, k] fp32 (the router
 * backward's input; NULL: not computed), and accumulates the weight gradients of `g`
 * (NULL: none). May be called more than once per forward; bitwise reproducible.
 * scratch as in the forward. Errors: see the top of this header. */
lm_status lm_cuda_moe_backward(lm_cuda_ctx *ctx, const lm_moe_config *c, int T,
                               const lm_cuda_moe_weights *w, const void *x,
                               const float *topk_weight, const void *saved, void *scratch,
                               const void *dy, void *dx, float *dtopk_weight,
                               const lm_cuda_moe_grads *g, const lm_cuda_moe_opts *opts,
                               lm_error *err);

/* FLOPs of the expert side (routing given), reference/moe.md §6.4: forward
 * 6 D F per kept assignment + 6 T D fs; backward twice that. */
double lm_cuda_moe_forward_flops(const lm_moe_config *c, int64_t T, int64_t assignments);

#ifdef __cplusplus
}
#endif
#endif
