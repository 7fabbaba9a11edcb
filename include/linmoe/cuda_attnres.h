/* linmoe AttnRes on NVIDIA GPUs (CUDA C, sm_90a): the Attention Residuals aggregation op
 * (one "AR" call of Block / Full AttnRes), forward and backward, with bf16 sources and
 * outputs, fp32 statistics and fp32 parameter gradients.
 *
 * Same math, configuration and contract as the CPU op (include/linmoe/attnres.h, whose
 * lm_attnres_config is reused): reference/attnres_ctx.md §1.2 (kernel, keys, values),
 * §4.2 (forward), §4.3 (backward); docs/attnres-math.md (derivation); Attention
 * Residuals, arXiv 2603.15031, Eq. 2-4. For every row n (token) and sources C_0..C_{L-1}:
 *   r_m = 1 / sqrt(mean_j C_m[n,j]^2 + eps)      key RMSNorm (fp32)
 *   u   = query (.) rms_weight                   the gain folded into the query
 *   t_m = r_m <u, C_m[n,:]>,  s_m = scale t_m    logits (no 1/sqrt(D))
 *   p   = softmax_m(s),  o[n,:] = sum_m p_m C_m[n,:]
 * backward (do = dL/do):  dp_m = <do, C_m>, delta = sum_m p_m dp_m,
 *   b_m = scale p_m (dp_m - delta) r_m,  e_m = b_m t_m r_m / D
 *   dC_m = p_m do + b_m u - e_m C_m,   du = sum_rows sum_m b_m C_m
 *   dquery = du (.) rms_weight,   drms_weight = du (.) query
 *
 * Layouts (row-major, contiguous, device memory, caller-owned):
 *   src[m]       [N, D] bf16, m < L: a HOST array of L device pointers (the model's
 *                embedding, block sums and running sum, never stacked); the _ptrs entry
 *                points copy the table into the kernel's parameters, so it may be reused
 *                as soon as the call returns
 *   residual     [L, N, D] bf16, the stacked alternative (lm_cuda_attnres_forward / _backward)
 *   query        [D] fp32 (the pseudo-query w, master copy), rms_weight [D] fp32 (gain g)
 *   o, do        [N, D] bf16
 *   weights      [L, N] fp32 (optional forward output: the depth weights p, fla's layout)
 *   dsrc[m]      [N, D] bf16 or fp32 (dsrc_dtype): a host array of L device pointers, an
 *                entry may be NULL (that gradient is not wanted), dsrc itself may be NULL
 *   dquery, drms_weight  [D] fp32 or NULL
 * Outputs must not overlap the inputs or each other (not checked).
 *
 * Algorithm: a group of threads per row (D/8 threads, rounded up to 8, 16 or a multiple
 * of 32; 8 elements per thread, 16-byte loads; CTAs of about 256 threads, persistent,
 * as many as fit on the device at once). Forward, for up to LC sources at a time (LC =
 * 3, 6, 9 or 12, the smallest >= L; L > 12 takes chunks of 12): the rows are loaded
 * into registers (every source row is read once), the group reduces the 2 LC partial
 * sums (sum of squares, <u, C>) at once (a warp reduce-scatter, one barrier across the
 * warps of a row), and an online softmax (running max, running sum, rescaled fp32
 * accumulator) folds the chunk into the output. Backward: the statistics are recomputed
 * (no saved forward state, as on the CPU: the pass reads every source row for <do, C_m>
 * anyway, so r_m and t_m cost no extra bytes) in a first phase that reduces 3 partials
 * per source, then a second phase writes dC_m from the rows still in registers (L <= 9;
 * above, chunks of 9 whose rows are read a second time, mostly from L1 / L2) and
 * accumulates du per thread. du partials go to a scratch [rows, D] (one row per row
 * group of a CTA), summed by a second kernel in a fixed order (fp64): deterministic on a
 * given device (the split depends on N, D and the SM count only), no atomics. The
 * element path and D > 4096 use chunks of 4 sources.
 *
 * Bytes that must move: forward (L + 1) N D 2 (+ 4 L N with weights); backward
 * (L + 1) N D 2 read + L N D s written (s = 2 bf16, 4 fp32), plus L N D s read with
 * accumulate = 1.
 *
 * Limits (LM_ERR_UNSUPPORTED otherwise): 1 <= L <= 64 (LM_CUDA_ATTNRES_MAX_SOURCES);
 * D <= 8192 when D % 8 == 0 and every bf16 / dsrc pointer is 16-byte aligned (the vector
 * path), D <= 4096 otherwise (element loads: slower, same math); dsrc_dtype LM_BF16 or
 * LM_F32.
 *
 * Config fields: L, N, D, eps, scale as on the CPU; accumulate = 1 adds into dsrc,
 * dquery and drms_weight (the model's reverse sweep accumulates a block sum's gradient
 * from all its consumers), 0 overwrites them. trusted_inputs and ws are ignored: device
 * data is never scanned for non-finite values, and scratch comes from the context.
 *
 * Precision: fp32 throughout (the CPU reference takes its dot products in fp64); o and
 * bf16 dsrc are rounded once (with accumulate = 1 the old bf16 value is added in fp32
 * before rounding). With query = 0 every p_m = 1/L; with L = 1, o = C_0 and dC_0 = do
 * bit for bit.
 *
 * Ordering: asynchronous on ctx's stream; no host synchronisation (except when the
 * context's scratch has to grow, once). Errors: LM_ERR_INVALID for a bad argument (the
 * message names it and its value), LM_ERR_UNSUPPORTED as above or when linmoe was built
 * without CUDA, LM_ERR_IO / LM_ERR_NOMEM from the CUDA runtime.
 */
#ifndef LINMOE_CUDA_ATTNRES_H
#define LINMOE_CUDA_ATTNRES_H

#include "linmoe/attnres.h"
#include "linmoe/backend.h"
#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_CUDA_ATTNRES_MAX_SOURCES 64

/* Forward: o [N,D] bf16 = sum_m p_m src[m]; weights [L,N] fp32 (p) when not NULL. */
lm_status lm_cuda_attnres_forward_ptrs(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                       const void *const *src, const float *query,
                                       const float *rms_weight, void *o, float *weights,
                                       lm_error *err);
/* The same with the sources stacked in one [L, N, D] bf16 tensor. */
lm_status lm_cuda_attnres_forward(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                  const void *residual, const float *query, const float *rms_weight,
                                  void *o, float *weights, lm_error *err);

/* Backward of sum(o * do): dsrc[m] [N,D] (dsrc_dtype LM_BF16 or LM_F32), dquery [D],
 * drms_weight [D] fp32; each written (c->accumulate = 0) or added to (1); NULL entries
 * are skipped. The statistics are recomputed from src (the forward's inputs). */
lm_status lm_cuda_attnres_backward_ptrs(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                        const void *const *src, const float *query,
                                        const float *rms_weight, const void *do_, void *const *dsrc,
                                        lm_dtype dsrc_dtype, float *dquery, float *drms_weight,
                                        lm_error *err);
/* The same with [L, N, D] stacked sources and dresidual ([L, N, D] of dsrc_dtype, or NULL). */
lm_status lm_cuda_attnres_backward(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                   const void *residual, const float *query,
                                   const float *rms_weight, const void *do_, void *dresidual,
                                   lm_dtype dsrc_dtype, float *dquery, float *drms_weight,
                                   lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
