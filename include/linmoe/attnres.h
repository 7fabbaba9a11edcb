/* linmoe AttnRes: the Attention Residuals aggregation op (one "AR" call of Block /
 * Full AttnRes), forward and backward, on the CPU in fp32.
 *
 * Math: reference/attnres_ctx.md §1.2 (kernel, keys, values), §1.3 (Block AttnRes:
 * which sources), §1.4 (zero-initialised query), §4.1 (defaults), §4.2 (exact
 * forward, `AR(C, w, g)`), §4.3 (exact backward); Attention Residuals, arXiv
 * 2603.15031, Eq. 2-4. The derivation of the backward is in docs/attnres-math.md.
 *
 * For every row n (a token; rows never mix) and L sources C_0 .. C_{L-1} (the
 * embedding, completed block sums, the running partial sum: the op does not care):
 *   r_m = 1 / sqrt(mean_j C_m[n,j]^2 + eps)            (key RMSNorm, fp32)
 *   k_m = r_m * C_m[n,:] (.) rms_weight                 (normalised key with its gain)
 *   s_m = scale * <query, k_m>                          (logit; no 1/sqrt(D): §1.2, §4.1)
 *   p   = softmax_m(s)                                  (max-subtracted)
 *   o[n,:] = sum_m p_m C_m[n,:]                         (values = the raw sources, §1.2)
 * Defaults: eps = 1e-6, scale = 1 (§4.1; fla's naive_attnres defaults).
 * With query = 0 (the model's init, §1.4) every p_m = 1/L: o is the mean of the
 * sources. With L = 1, o is the source itself (bit for bit).
 *
 * Layouts (fp32, row-major, contiguous, caller-owned):
 *   sources     L tensors [N, D], either one [L, N, D] block (lm_attnres_forward /
 *               _backward) or an array of L pointers to [N, D] tensors
 *               (lm_attnres_forward_ptrs / _backward_ptrs: the model passes its
 *               block sums without stacking them)
 *   query       [D]   the per-sublayer pseudo-query w
 *   rms_weight  [D]   the key RMSNorm gain g
 *   o, do       [N, D]
 *   dsources    like the sources; dquery, drms_weight [D]
 * Outputs must not overlap the inputs or each other.
 *
 * Threads: OpenMP over fixed blocks of rows; the parameter gradients are summed per
 * block and then over blocks in block order, so every output is bitwise identical
 * for any thread count.
 *
 * What this module does not do: the Block AttnRes bookkeeping (which sources a
 * sublayer sees, block boundaries, the running sum and its reverse accumulator:
 * src/model/), the fused output RMSNorm of fla, the two-phase inference merge,
 * bf16 math, CUDA.
 */
#ifndef LINMOE_ATTNRES_H
#define LINMOE_ATTNRES_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reusable scratch: buffers grow to the largest call seen and are kept, so repeated
 * calls (every sublayer of every training step) do not allocate. One workspace must
 * not be used by two calls at the same time. */
typedef struct lm_attnres_workspace lm_attnres_workspace;
lm_attnres_workspace *lm_attnres_workspace_new(void);
void lm_attnres_workspace_free(lm_attnres_workspace *ws);

typedef struct {
    int L;                    /* number of sources, >= 1 */
    int64_t N;                /* rows (tokens, B*T), >= 1 */
    int D;                    /* hidden size, >= 1 */
    float eps;                /* key RMSNorm epsilon inside the sqrt, finite and > 0 (1e-6) */
    float scale;              /* logit scale, finite (1.0) */
    int accumulate;           /* backward: 1 adds into dsources / dquery / drms_weight
                                 (the model's gradient accumulators), 0 overwrites them */
    int trusted_inputs;       /* 1: skip the finiteness scan of the tensors (activations the
                                 model produced itself; saves one read of every source) */
    lm_attnres_workspace *ws; /* NULL: scratch is allocated and freed per call */
} lm_attnres_config;

/* Fill defaults: eps = 1e-6, scale = 1, accumulate = 0, trusted_inputs = 0, ws = NULL. */
void lm_attnres_config_default(lm_attnres_config *c, int L, int64_t N, int D);

/* Check the configuration and inputs before any math: L, N, D >= 1, L*N*D <= 2^46,
 * eps finite and > 0, scale finite, every pointer present (a source pointer may not
 * be NULL), and, unless c->trusted_inputs, every value of query, rms_weight, the
 * sources and do (when not NULL) finite. Errors: LM_ERR_INVALID naming the field
 * (e.g. "residual_2", with row and column) and the value. `src`: L pointers. */
lm_status lm_attnres_validate(const lm_attnres_config *c, const float *const *src,
                              const float *query, const float *rms_weight, const float *do_,
                              lm_error *err);

/* Forward: o[N,D] = sum_m p_m C_m (see the top of this file). */
lm_status lm_attnres_forward_ptrs(const lm_attnres_config *c, const float *const *src,
                                  const float *query, const float *rms_weight, float *o,
                                  lm_error *err);
/* The same with the sources stacked in one contiguous [L, N, D] tensor. */
lm_status lm_attnres_forward(const lm_attnres_config *c, const float *residual, const float *query,
                             const float *rms_weight, float *o, lm_error *err);

/* Backward of sum(o * do) (reference/attnres_ctx.md §4.3): the softmax statistics
 * are recomputed from the sources in the pass that also forms <do, C_m> (no saved
 * state), so only the forward's inputs and do are needed.
 *   dsrc[m]      [N,D]  through the values and through the keys' RMSNorm; an entry
 *                       may be NULL (that gradient is not wanted); dsrc itself may
 *                       be NULL for none
 *   dquery       [D]    summed over rows, or NULL
 *   drms_weight  [D]    summed over rows, or NULL
 * Written (accumulate = 0) or added to (accumulate = 1). */
lm_status lm_attnres_backward_ptrs(const lm_attnres_config *c, const float *const *src,
                                   const float *query, const float *rms_weight, const float *do_,
                                   float *const *dsrc, float *dquery, float *drms_weight,
                                   lm_error *err);
/* The same with [L, N, D] contiguous sources and dresidual (dresidual may be NULL). */
lm_status lm_attnres_backward(const lm_attnres_config *c, const float *residual, const float *query,
                              const float *rms_weight, const float *do_, float *dresidual,
                              float *dquery, float *drms_weight, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
