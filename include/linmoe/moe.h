/* linmoe MoE feed-forward layer on the CPU, fp32: the router matmul, routing (by
 * moe_router.h), routed SwiGLU experts run as one GEMM sequence per expert over
 * the tokens permuted by expert, the weighted scatter-add back to token order,
 * always-on shared experts, and the hand-written backward of all of it.
 *
 * Math (reference/moe.md §2: DeepSeek-V3 MoE with shared + routed experts; §5:
 * capacity; §6.3/§6.4: grouped GEMM and FLOP accounting; SwiGLU: Shazeer,
 * "GLU Variants Improve Transformer", arXiv:2002.05202, Eq. 6; layer structure as
 * Hugging Face DeepseekV3MoE). For token t with input x_t (row of x):
 *   logits_t  = x_t W_r^T                                 (fp32, W_r = gate.weight)
 *   (idx, w, keep) = lm_router_forward(logits)            (moe_router.h)
 *   E_e(x)    = W_down[e] (silu(W_gate[e] x) * W_up[e] x),  silu(z) = z * sigmoid(z)
 *   S(x)      = the same SwiGLU with the shared weights, width n_shared * f
 *   out_t     = S(x_t) + sum_{j < k, keep[t,j]} w[t,j] * E_{idx[t,j]}(x_t)
 * A dropped assignment (keep = 0, capacity in training only) contributes nothing;
 * the token keeps its other experts and the shared ones (and, outside this op,
 * the residual). The weights w are not renormalised after drops (router contract).
 *
 * Backward computes the gradient of  L = sum(out * dout) [+ the router's aux loss
 * when balance = LM_BAL_AUX_LOSS]  with respect to x, the router weight (through
 * the gate weights w and the aux loss; the selection itself is piecewise constant
 * and has no gradient, the selection bias never gets one) and every routed and
 * shared expert weight. The derivation, per expert segment with m tokens:
 *   G  = dout_e W_down[e]             [m,f]   (dout_e: dout rows of the segment)
 *   dw = rowsum(G * a)                [m]     (a = silu(g) * u saved by forward)
 *   dW_down[e] = (w * dout_e)^T a     [d,f]
 *   da = w * G;  dg = da * u * silu'(g);  du = da * silu(g)
 *   dW_gate[e] = dg^T x_e,  dW_up[e] = du^T x_e,  dx_e = dg W_gate[e] + du W_up[e]
 * and dx_t = dS(x_t) + dlogits_t W_r + sum_j dx_e rows of t;  dW_r = dlogits^T x.
 *
 * Layouts: row-major fp32, contiguous, torch Linear convention [out, in]; names
 * are the Hugging Face parameter names of one DeepseekV3MoE (E = num_experts,
 * k = num_experts_per_tok, d = hidden_size, f = moe_intermediate_size,
 * fs = n_shared_experts * f):
 *   x, out, dout, dx                [T, d]
 *   gate.weight                     [E, d]     (the router weight W_r)
 *   experts.gate_proj               [E, f, d]  (expert e at offset e*f*d)
 *   experts.up_proj                 [E, f, d]
 *   experts.down_proj               [E, d, f]
 *   shared_experts.gate_proj        [fs, d]    (absent when n_shared_experts = 0)
 *   shared_experts.up_proj          [fs, d]
 *   shared_experts.down_proj        [d, fs]
 *   e_score_correction_bias         [E]        (in lm_router_state; selection only)
 *
 * Determinism: every GEMM runs single-threaded BLAS on a fixed partition of the
 * work (one expert segment, or a fixed block of rows/columns that does not depend
 * on the thread count), and every reduction over experts runs in a fixed order, so
 * results are bitwise identical across thread counts and runs.
 *
 * What this module does not do: the routing math and balancing (moe_router.h),
 * the residual connection and the norm around the layer, bf16, CUDA, expert
 * parallelism across ranks.
 */
#ifndef LINMOE_MOE_H
#define LINMOE_MOE_H

#include "linmoe/core.h"
#include "linmoe/moe_router.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int hidden_size;           /* d >= 1 */
    int moe_intermediate_size; /* f >= 1, width of one routed expert */
    int n_shared_experts;      /* >= 0; the shared experts are one SwiGLU of width n_shared * f */
    lm_router_config router;   /* E = router.num_experts, k = router.num_experts_per_tok */
} lm_moe_config;

/* Defaults: the router's (lm_router_config_default(E, k)) and the given sizes. */
void lm_moe_config_default(lm_moe_config *c, int hidden_size, int moe_intermediate_size,
                           int num_experts, int num_experts_per_tok, int n_shared_experts);

/* Errors (LM_ERR_INVALID, message names the field and value): hidden_size or
 * moe_intermediate_size < 1; n_shared_experts < 0; 2 * n_shared_experts *
 * moe_intermediate_size beyond 2^31 - 1 (BLAS dims are int); and every error of
 * lm_router_config_validate (num_experts_per_tok > num_experts, negative
 * capacity_factor, unknown scoring_func / drop_policy, bad n_group, ...). */
lm_status lm_moe_config_validate(const lm_moe_config *c, lm_error *err);

/* Weight names, in the order of lm_moe_weights / lm_moe_grads. */
typedef enum {
    LM_MOE_GATE_WEIGHT = 0,   /* "gate.weight" */
    LM_MOE_EXPERTS_GATE_PROJ, /* "experts.gate_proj" */
    LM_MOE_EXPERTS_UP_PROJ,   /* "experts.up_proj" */
    LM_MOE_EXPERTS_DOWN_PROJ, /* "experts.down_proj" */
    LM_MOE_SHARED_GATE_PROJ,  /* "shared_experts.gate_proj" */
    LM_MOE_SHARED_UP_PROJ,    /* "shared_experts.up_proj" */
    LM_MOE_SHARED_DOWN_PROJ,  /* "shared_experts.down_proj" */
    LM_MOE_N_WEIGHTS
} lm_moe_weight_id;

/* The Hugging Face name of a weight ("gate.weight", ...); NULL for a bad id. */
const char *lm_moe_weight_name(lm_moe_weight_id id);
/* The shape a weight must have under config c: returns its ndim (2 or 3) and
 * fills shape[0..ndim), or 0 when the weight does not exist under c (shared
 * weights with n_shared_experts = 0), or -1 for a bad id. c must be valid. */
int lm_moe_weight_shape(const lm_moe_config *c, lm_moe_weight_id id, int64_t shape[3]);
/* Check a weight's given shape against the config. Errors name the weight, the
 * dim, the config field it comes from and both values, e.g.
 * "moe: weight 'experts.down_proj' shape [4,8,6]: dim 2 is 6 but
 *  moe_intermediate_size = 5". Also errors for a weight that must be absent. */
lm_status lm_moe_check_weight_shape(const lm_moe_config *c, lm_moe_weight_id id, int ndim,
                                    const int64_t *shape, lm_error *err);

/* Pointers to the weights (shapes above, fp32, contiguous, owned by the caller).
 * The shared ones must be non-NULL when n_shared_experts > 0 and are ignored
 * otherwise. Indexable as w->p[id] through lm_moe_weight_id. */
typedef struct {
    const float *p[LM_MOE_N_WEIGHTS];
} lm_moe_weights;

/* Gradient outputs, same shapes as the weights (d<name>). Each is OVERWRITTEN
 * (not accumulated); NULL: that gradient is not computed. */
typedef struct {
    float *p[LM_MOE_N_WEIGHTS];
} lm_moe_grads;

/* Saved activations and scratch of one layer: sized once for up to max_tokens
 * tokens per call by lm_moe_ctx_new (one allocation), reused by every forward /
 * backward so a training step allocates nothing. Holds the routing result of the
 * last forward. Not thread-safe: one call at a time per context.
 * Memory: about 4*(T*k*(2d + 6f + 3) + T*(2E + 6fs)) bytes for T = max_tokens
 * (T = 4096, d = 512, f = 256, E = 64, k = 8, fs = 256: 363 MB). */
typedef struct lm_moe_ctx lm_moe_ctx;

/* Validates c (errors of lm_moe_config_validate; max_tokens < 1, max_tokens *
 * num_experts_per_tok >= 2^31, or buffers too large: LM_ERR_INVALID) and allocates
 * (LM_ERR_NOMEM when the allocation fails). */
lm_status lm_moe_ctx_new(lm_moe_ctx **out, const lm_moe_config *c, int max_tokens, lm_error *err);
void lm_moe_ctx_free(lm_moe_ctx *ctx);
/* The configuration the context was made with. */
const lm_moe_config *lm_moe_ctx_config(const lm_moe_ctx *ctx);

/* Inference mode (on = 1; the model sets it for lm_model_infer, off for training and
 * evaluation forwards): expert and shared-expert GEMMs of at most 64 rows are computed
 * row-wise (src/ops/cpu/gemm_rowwise.h), so each token's output does not depend on the
 * other tokens of the call (a decode batch equals its rows run alone, bit for bit). */
void lm_moe_set_inference(lm_moe_ctx *ctx, int on);

/* Forward over T tokens (1 <= T <= max_tokens): out [T, d] (overwritten) from
 * x [T, d]. `st` is the layer's router state (E must match; holds the selection
 * bias; in training it accumulates the step's demand, see moe_router.h).
 * `training` = 1 enables capacity dropping (router.capacity_factor > 0) and the
 * router's training-time bookkeeping; 0 is the dropless eval / inference path.
 * cu_seqlens [n_cu] (or NULL) only matters for the sequence-wise aux loss.
 * Errors: bad T, NULL pointers, missing shared weights, state of the wrong size,
 * non-finite x (names the token and channel), router errors (NaN logits, ...). */
lm_status lm_moe_forward(lm_moe_ctx *ctx, const lm_moe_weights *w, lm_router_state *st,
                         const float *x, int T, const int64_t *cu_seqlens, int n_cu, int training,
                         float *out, lm_error *err);

/* Backward of the last forward of this context: x and w must be the ones that
 * forward saw (unchanged). dout [T, d]; dx [T, d] (overwritten; NULL: not
 * computed); g: the weight gradients (see lm_moe_grads). Experts that received no
 * token get exactly zero gradients. May be called more than once per forward.
 * Errors: no forward yet, NULL dout, router backward errors. */
lm_status lm_moe_backward(lm_moe_ctx *ctx, const lm_moe_weights *w, const float *x,
                          const float *dout, float *dx, lm_moe_grads *g, lm_error *err);

/* The factor the aux loss's gradient (balance = AUX_LOSS) gets in the following
 * backward calls: the caller's loss scale, so that the backward is that of
 * scale * (loss + aux loss) when dout is the gradient of scale * loss (model.h's
 * lm_model_backward with micro-batches). Default 1; any finite value. */
void lm_moe_ctx_set_aux_scale(lm_moe_ctx *ctx, float scale);

/* The routing of the last forward (topk_idx, topk_weight, keep, scores, aux_loss,
 * capacity, drop counts); NULL before the first forward. Owned by the context. */
const lm_route *lm_moe_ctx_route(const lm_moe_ctx *ctx);

/* Active FLOPs of one forward over T tokens (reference/moe.md §6.4): the router
 * 2*T*d*E, plus 6*d*f per kept (token, expert) assignment, plus 6*T*d*fs for the
 * shared experts. The backward's count is twice the forward's (d gate.weight and
 * the router part of dx: 2*T*d*E each; 12*d*f per assignment; 12*T*d*fs).
 * Used by the benchmark; `assignments` = T*k for dropless routing. */
double lm_moe_forward_flops(const lm_moe_config *c, int64_t T, int64_t assignments);
double lm_moe_backward_flops(const lm_moe_config *c, int64_t T, int64_t assignments);

#ifdef __cplusplus
}
#endif
#endif
