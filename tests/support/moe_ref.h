/* Plain fp64 reference of the MoE layer (include/linmoe/moe.h) with the routing
 * decisions held fixed: the oracle for the fp32 layer's forward and, through
 * central finite differences of lm_moe_ref_loss, for its backward.
 *
 * The selection (topk_idx) and the capacity decisions (keep) are piecewise
 * constant functions of the inputs, so the layer's gradient is the gradient of the
 * layer with (idx, keep) frozen, wherever a small perturbation changes neither
 * (the tests assert that it does not). Everything else (router matmul, scores,
 * gate weights normalised over the selected k, SwiGLU experts, shared experts,
 * the batch-wise aux loss of moe_router.h) is recomputed here in fp64, straight
 * from the formulas, with no blocking, permutation or BLAS.
 */
#ifndef LINMOE_TEST_MOE_REF_H
#define LINMOE_TEST_MOE_REF_H

#include <stdint.h>

#include "linmoe/moe.h"

typedef struct {
    int T, d, f, fs, E, k; /* fs = n_shared_experts * f (0: none) */
    int softmax;           /* 0: sigmoid scores, 1: softmax over all E */
    int norm_topk_prob;
    double routed_scaling_factor;
    int aux_loss; /* 1: add the batch-wise aux loss (balance = AUX_LOSS, not seq-wise) */
    double aux_loss_alpha;
} lm_moe_ref_cfg;

/* The config of the fp32 layer, as the reference sees it. */
lm_moe_ref_cfg lm_moe_ref_cfg_from(const lm_moe_config *c, int T);

/* x [T,d] and the weights (lm_moe_weight_id order, shapes of moe.h; the shared ones
 * may be NULL when fs = 0), fp64. */
typedef struct {
    const double *x;
    const double *w[LM_MOE_N_WEIGHTS];
} lm_moe_ref_params;

/* out [T,d]; *aux (may be NULL) the aux-loss value (0 unless cfg.aux_loss).
 * topk_idx / keep [T,k] from the fp32 run. */
void lm_moe_ref_forward(const lm_moe_ref_cfg *c, const lm_moe_ref_params *p,
                        const int64_t *topk_idx, const uint8_t *keep, double *out, double *aux);

/* sum(out * dout) + aux: the scalar whose gradient the layer's backward computes. */
double lm_moe_ref_loss(const lm_moe_ref_cfg *c, const lm_moe_ref_params *p, const int64_t *topk_idx,
                       const uint8_t *keep, const double *dout);

#endif
