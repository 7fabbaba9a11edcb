/* linmoe AdamW with global gradient-norm clipping on NVIDIA GPUs (CUDA C, sm_90a).
 *
 * The math is the CPU trainer's (src/train/adamw.c, lm_adamw_grad_norm / lm_adamw_step;
 * Loshchilov & Hutter 2019, decoupled weight decay, torch.optim.AdamW's update order), on
 * the flat fp32 parameter buffer of the memory plan (include/linmoe/params.h: one buffer,
 * tensors at 64-byte aligned offsets):
 *   norm  = sqrt(sum over trainable elements of g^2)            (fp64 sums)
 *   gs    = grad_clip / (norm + 1e-6)  if grad_clip > 0 and norm > grad_clip, else 1
 *   g'    = g gs
 *   m     = b1 m + (1 - b1) g';   v = b2 v + (1 - b2) g'^2
 *   p     = p (1 - lr wd [decay segment])  -  lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) +
 * eps) in fp32 with the CPU's operation order and no fused multiply-adds, so with the same gs the
 * result is the CPU's to the bit. The bias corrections and the other scalars are formed on
 * the host from the hyper-parameters and the step number t (no device read); the norm stays
 * on the device: the step reads it (no host synchronisation), and a non-finite norm skips
 * the update (p, m, v and the bf16 copy untouched) and sets a device flag, which the trainer
 * reads with the loss in its one synchronisation per step and counts as a skipped step
 * (the CPU trainer's bad-step rule). Deterministic: the norm is a two-pass reduction in a
 * fixed order (one CTA per tile of at most LM_CUDA_ADAMW_TILE elements writes its fp64
 * partial; one CTA adds the partials in tile order), and the update is elementwise.
 *
 * Which elements: the plan's segments (offset, count, decay), in increasing offset order,
 * not overlapping; elements outside every segment (the MoE selection bias and other
 * params.h buffers) are neither counted in the norm nor updated. The CPU's rule: one
 * segment per lm_param_info with buffer == 0, {offset, numel, decay}.
 *
 * Passes over memory: the norm reads g once (4 B / parameter); the step reads p, g, m, v and
 * writes p, m, v and the bf16 working copy (30 B / parameter), 16-byte vectors where a tile
 * is 16-byte aligned (every params.h tensor), scalars otherwise.
 *
 * Errors: LM_ERR_INVALID for a bad argument (named with its value), LM_ERR_UNSUPPORTED when
 * linmoe was built without CUDA (src/ops/nocuda/optim_stub.c), LM_ERR_NOMEM / LM_ERR_IO from
 * CUDA.
 *
 * What this module does not do: other optimizers, per-segment learning rates, ZeRO
 * sharding (a rank passes the segments of its shard), the learning-rate schedule.
 */
#ifndef LINMOE_CUDA_OPTIM_H
#define LINMOE_CUDA_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per tile of the norm's partial sums and of the update's CTAs (the CPU's
 * LM_ADAMW_BLOCK). */
#define LM_CUDA_ADAMW_TILE 16384

/* A run of parameters [offset, offset + count) of the flat buffer (elements), decayed
 * (decay = 1) or not (0). */
typedef struct {
    int64_t offset, count;
    int decay;
} lm_cuda_adamw_segment;

/* The device-side tile table of a segment list and the norm's partial sums (device memory
 * allocated through the context at creation, so a step allocates nothing). Created once per
 * parameter layout, outside the step; freed before the context. */
typedef struct lm_cuda_adamw_plan lm_cuda_adamw_plan;

/* segments [n_segments] host array (copied); numel: elements of the flat buffers (every
 * segment must lie inside [0, numel)). Errors: LM_ERR_INVALID for a negative count, a
 * segment outside the buffer, overlapping or unordered segments, more than 2^31 tiles. */
lm_status lm_cuda_adamw_plan_new(lm_cuda_ctx *ctx, const lm_cuda_adamw_segment *segments,
                                 int n_segments, int64_t numel, lm_cuda_adamw_plan **out,
                                 lm_error *err);
void lm_cuda_adamw_plan_free(lm_cuda_adamw_plan *plan); /* NULL is a no-op; synchronises */
int64_t lm_cuda_adamw_plan_numel(const lm_cuda_adamw_plan *plan); /* trainable elements */

/* Global L2 norm of the plan's elements of g.
 *   g        [numel] fp32 device (gradients, params layout)
 *   gnorm    [1] fp32 device, written: the norm (NaN / Inf when g has a non-finite value)
 *   skipped  [1] int32 device, written: 1 when the norm is not finite in fp32, else 0
 *            (may be NULL)
 * Asynchronous on the context's stream. */
lm_status lm_cuda_adamw_grad_norm(lm_cuda_ctx *ctx, const lm_cuda_adamw_plan *plan, const float *g,
                                  float *gnorm, int32_t *skipped, lm_error *err);

typedef struct {
    double lr, weight_decay, beta1, beta2, eps;
    double grad_clip; /* max global norm; 0 = no clipping */
    int64_t step;     /* t >= 1: the AdamW steps applied so far including this one */
} lm_cuda_adamw_hparams;

/* One AdamW step over the plan's elements (see the top of this header).
 *   params     [numel] fp32 device, master weights, updated in place
 *   g          [numel] fp32 device, gradients (read only)
 *   m, v       [numel] fp32 device, moments, updated in place
 *   params_bf16 [numel] bf16 device or NULL: the working copy, written (round to nearest
 *              even) at the plan's elements
 *   gnorm      [1] fp32 device, from lm_cuda_adamw_grad_norm (the clipping input; a
 *              non-finite value makes the step a no-op)
 * Errors: LM_ERR_INVALID for NULL buffers, t < 1, non-finite / out-of-range hyper-parameters
 * (lr >= 0, weight_decay >= 0, beta in [0, 1), eps > 0, grad_clip >= 0). */
lm_status lm_cuda_adamw_step(lm_cuda_ctx *ctx, const lm_cuda_adamw_plan *plan,
                             const lm_cuda_adamw_hparams *hp, float *params, const float *g,
                             float *m, float *v, void *params_bf16, const float *gnorm,
                             lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
