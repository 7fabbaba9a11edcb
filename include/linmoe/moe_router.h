/* linmoe MoE router: scores, top-k selection with a per-expert selection bias,
 * gate weights, capacity (token dropping), the balancing rules (auxiliary loss,
 * auxiliary-loss-free sign / linear bias update, quantile balancing) and the
 * balance metrics. fp32 routing math, CPU.
 *
 * Math and sources: reference/moe.md §1 (Loss-Free Balancing, arXiv:2408.15664),
 * §2 (DeepSeek-V3, arXiv:2412.19437: sigmoid scores, bias for selection only,
 * group-limited routing, sequence-wise aux loss), §4.2/§4.5/§4.6 (quantile
 * balancing as the LP dual), §5 (capacity), §8 (API, metrics, tests).
 * Hugging Face / DeepSeek-V3 config names.
 *
 * Per token t (logits[t, :] = x_t . W_router^T, computed by the caller):
 *   s[t,e]   = sigmoid(logits) | softmax over all E (scoring_func)
 *   key      = s + e_score_correction_bias            (selection only)
 *   topk_idx = the k largest keys (ties: lower index), optionally group-limited
 *   w        = s[t, idx]  (unbiased; never key - bias)
 *              / sum over the k selected  (norm_topk_prob and k > 1)
 *              * routed_scaling_factor
 * The bias is a buffer: no gradient, no optimizer state; checkpointed.
 *
 * What this module does not do: the router matmul, the experts (moe.h), I/O.
 */
#ifndef LINMOE_MOE_ROUTER_H
#define LINMOE_MOE_ROUTER_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_SCORE_SIGMOID = 0, LM_SCORE_SOFTMAX = 1 } lm_score_func;
typedef enum {
    LM_BAL_NONE = 0,
    LM_BAL_AUX_LOSS = 1,  /* alpha * sum_i f_i P_i (batch- or sequence-wise) */
    LM_BAL_AUX_FREE = 2,  /* bias update once per optimizer step: sign or linear rule */
    LM_BAL_QUANTILE = 3   /* per-micro-batch dual (quantile) solve, averaged, EMA */
} lm_balance_mode;
typedef enum { LM_BIAS_SIGN = 0, LM_BIAS_LINEAR = 1 } lm_bias_rule;
typedef enum { LM_DROP_PROBS = 0, LM_DROP_POSITION = 1 } lm_drop_policy;

typedef struct {
    int num_experts;            /* E */
    int num_experts_per_tok;    /* k, 1 <= k <= E */
    lm_score_func scoring_func; /* default sigmoid */
    int norm_topk_prob;         /* default 1 (only applies when k > 1) */
    float routed_scaling_factor;/* default 1.0 */
    int n_group, topk_group;    /* group-limited routing; n_group <= 1: off. E % n_group == 0 */
    lm_balance_mode balance;    /* default AUX_FREE */
    lm_bias_rule bias_rule;     /* AUX_FREE: sign (default) or linear */
    float bias_update_rate;     /* u, default 1e-3 */
    float bias_clamp;           /* |b| <= clamp after centring, default 1.0; <= 0: no clamp */
    int bias_center;            /* default 1 */
    float aux_loss_alpha;       /* AUX_LOSS weight, default 1e-3 */
    int aux_loss_seq;           /* 1: DeepSeek's sequence-wise variant (per sequence, mean) */
    int quantile_iters;         /* QUANTILE alternations per micro-batch, default 1 */
    float quantile_ema;         /* b <- ema*b + (1-ema)*b_new, default 0 */
    float capacity_factor;      /* training only; 0 = dropless (default) */
    lm_drop_policy drop_policy; /* default probs */
} lm_router_config;

void lm_router_config_default(lm_router_config *c, int E, int k);
/* Errors name the field and value: k > E or < 1, E < 1, negative capacity_factor,
 * unknown scoring_func / balance / drop_policy / bias_rule, n_group not dividing E,
 * topk_group out of [1, n_group], topk_group * E/n_group < k, negative rates. */
lm_status lm_router_config_validate(const lm_router_config *c, lm_error *err);
/* Parse names used in configs / metadata ("sigmoid", "softmax", "none", "aux_loss",
 * "aux_free", "quantile", "sign", "linear", "probs", "position"). -1 when unknown. */
int lm_score_func_from_name(const char *s);
int lm_balance_from_name(const char *s);
int lm_bias_rule_from_name(const char *s);
int lm_drop_policy_from_name(const char *s);

#define LM_ROUTER_HISTORY 100 /* steps pooled for maxvio_global */

/* Metrics of one optimizer step (reference/moe.md §8.2). */
typedef struct {
    double maxvio_batch;     /* max_e demand_e / mean - 1 over the step's demand */
    double maxvio_global;    /* same over demand pooled across the last <= 100 steps */
    double min_load;         /* min_e demand_e / mean */
    int n_dead;              /* experts with zero demand in the step */
    double dropped_assign_frac, dropped_token_frac; /* by capacity, over the step */
    double bias_mean, bias_std, bias_min, bias_max; /* after the update */
    int n_clamped;           /* entries at +-bias_clamp after the update */
    double sign_flip_rate;   /* fraction of experts whose bias change flipped sign */
    double aux_loss;         /* mean aux loss over the step's micro-batches (AUX_LOSS) */
    int64_t tokens;          /* tokens routed in the step */
} lm_router_metrics;

/* Persistent per-layer router state. e_score_correction_bias is checkpointed;
 * the accumulators are per step. */
typedef struct {
    int E;
    float *e_score_correction_bias; /* [E] */
    double *demand;                 /* [E] pre-capacity selections, this step */
    double *kept;                   /* [E] post-capacity selections, this step */
    double *qb_accum;               /* [E] QUANTILE: sum of per-micro-batch solutions */
    int qb_count;
    float *prev_delta;              /* [E] last bias change (for the sign-flip rate) */
    double *history;                /* [LM_ROUTER_HISTORY, E] demand of past steps */
    int hist_len, hist_pos;
    int64_t tokens, dropped_assign, dropped_tokens;
    double aux_loss_sum;
    int n_micro;
} lm_router_state;

lm_status lm_router_state_init(lm_router_state *s, int E, lm_error *err);
void lm_router_state_free(lm_router_state *s);

/* Routing result of one micro-batch; buffers owned by the struct (lm_route_free). */
typedef struct {
    int T, E, k;
    int64_t *topk_idx;   /* [T, k] selected experts, in descending key order */
    float *topk_weight;  /* [T, k] gate weights (before drops; dropped ones are kept here) */
    uint8_t *keep;       /* [T, k] 0 = dropped by capacity (training only), else 1 */
    float *scores;       /* [T, E] unbiased scores s (saved for backward / aux loss) */
    float aux_loss;      /* AUX_LOSS value for this micro-batch, else 0 */
    int64_t capacity;    /* per-expert capacity used (0 = dropless) */
    int64_t n_dropped_assign, n_dropped_tokens;
} lm_route;

void lm_route_free(lm_route *r);

/* Route one micro-batch of T tokens. logits [T, E] fp32 row-major. cu_seqlens
 * [n_cu] (or NULL: one sequence of T tokens) only matters for the sequence-wise
 * aux loss. `training` enables capacity dropping, demand accumulation into `st`,
 * and the quantile solve (with the current, i.e. previous step's, bias: no
 * leakage). Errors: NaN/Inf logits (names the token and expert), bad shapes. */
lm_status lm_router_forward(const lm_router_config *c, lm_router_state *st, const float *logits,
                            int T, const int64_t *cu_seqlens, int n_cu, int training, lm_route *out,
                            lm_error *err);

/* Gradient of sum(topk_weight * dtopk_weight) [+ aux_loss when AUX_LOSS] with
 * respect to the logits. Dropped assignments get no gradient (their weight is not
 * used). dtopk_weight [T, k]; dlogits [T, E] (overwritten). The bias gets none. */
lm_status lm_router_backward(const lm_router_config *c, const lm_route *r, const float *dtopk_weight,
                             float *dlogits, lm_error *err);

/* Sum-reduction over ranks, applied to a buffer of n doubles in place (NULL: one
 * rank). Called by lm_router_update_bias on the step's demand / quantile sums. */
typedef void (*lm_allreduce_fn)(double *buf, int n, void *ctx);

/* Once per optimizer step, after all micro-batches: reduce the demand (and quantile
 * sums) over ranks, update the bias (AUX_FREE / QUANTILE), centre, clamp, fill
 * `m` (may be NULL), push the demand into the history and reset the step
 * accumulators. Modes NONE / AUX_LOSS only compute metrics. */
lm_status lm_router_update_bias(const lm_router_config *c, lm_router_state *st, lm_allreduce_fn reduce,
                                void *reduce_ctx, lm_router_metrics *m, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
