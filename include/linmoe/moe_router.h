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
 * It also holds the balance simulator behind `linmoe balance-sim` (§7.3), which
 * drives the router above on synthetic scores.
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
/* Doubles of lm_router_state.reduce_buf: the 3E + scalars reduced, then the old bias [E]. */
#define LM_ROUTER_REDUCE_BUF_LEN(E) (4 * (size_t)(E) + 16)

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
    double *reduce_buf;             /* [LM_ROUTER_REDUCE_BUF_LEN(E)] scratch of
                                       lm_router_update_bias (reduce buffer + old bias):
                                       the per-step update allocates nothing */
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
    struct lm_route_priv *priv; /* internal (sequence bounds for the backward, scratch);
                                   owned, freed by lm_route_free; do not touch */
} lm_route;

void lm_route_free(lm_route *r);

/* Route one micro-batch of T tokens. logits [T, E] fp32 row-major. cu_seqlens
 * [n_cu] (or NULL: one sequence of T tokens) only matters for the sequence-wise
 * aux loss. `training` enables capacity dropping, demand accumulation into `st`,
 * and the quantile solve (with the current, i.e. previous step's, bias: no
 * leakage). Errors: NaN/Inf logits (names the token and expert), bad shapes. */
/* Details (src/ops/moe_router.c):
 *  - `out` must be zero-initialised before its first use (lm_route r = {0}); later
 *    calls reuse its buffers when (T, E, k) are unchanged, else reallocate.
 *  - `st` may be NULL when training == 0 (zero bias, nothing accumulated).
 *  - The bias must be finite (error names the expert). T = 0 is an empty batch.
 *  - Weights: w = routed_scaling_factor * s / (sum_selected s + 1e-20) (the 1e-20
 *    as in Megatron / torchtitan, so all-underflowed sigmoid rows give 0, not NaN),
 *    computed in fp64 and rounded once.
 *  - Group-limited (n_group > 1): group score = sum of the top min(2, E/n_group)
 *    biased scores of the group; the topk_group best groups (ties: lower group) are
 *    kept and the top-k is taken over their experts only.
 *  - Capacity (training and capacity_factor > 0): C = min(T, ceil(T*k/E*cf)) in
 *    fp64, per expert. probs keeps the C highest unbiased scores (ties: earlier
 *    token), position keeps the C earliest tokens. n_dropped_tokens counts tokens
 *    that lost AT LEAST ONE assignment (with k = 1: tokens left with the residual).
 *  - Aux loss (AUX_LOSS): count_i = selections of expert i (with the bias, before
 *    capacity), f_i = E/(k*T_n) * count_i, P_i = mean over the T_n tokens of s'_i
 *    with s' = s / (sum_e s + 1e-20) (sigmoid) or s (softmax); loss = alpha *
 *    sum_i f_i P_i over the batch (T_n = T), or with aux_loss_seq per sequence of
 *    cu_seqlens and averaged over the non-empty sequences.
 *  - Demand (pre-capacity selections), kept counts, drops, aux loss and (QUANTILE)
 *    the per-micro-batch dual solution are accumulated into `st` when training. */
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
/* Details (src/ops/moe_balance.c):
 *  - The reduce buffer holds only sums (demand[E], kept[E], quantile solution sums
 *    [E], then tokens, dropped assignments / tokens, aux-loss sum, micro-batch and
 *    solution counts), so an element-wise all-reduce(SUM) is all `reduce` does.
 *  - AUX_FREE: sign: b += u * sign(mean - demand); linear: b += u * (mean - demand)
 *    / mean, mean = sum(demand) / E. QUANTILE: b_new = sum of the micro-batch
 *    solutions / their count over all ranks (Megatron averages per rank, then over
 *    ranks: the same when ranks run equal micro-batch counts), b = ema*b +
 *    (1-ema)*b_new. Then (both) b -= mean(b) when bias_center, and clamp to
 *    [-bias_clamp, bias_clamp] when bias_clamp > 0. NONE / AUX_LOSS leave b alone.
 *  - A step with no tokens leaves b unchanged, pushes nothing into the history and
 *    reports n_dead = E, maxvio 0.
 *  - sign_flip_rate: experts whose bias change has the opposite sign of their last
 *    non-zero change, over E. Fractions of drops are over the step's assignments
 *    (T*k) and tokens (a token counts once if it lost at least one assignment). */
lm_status lm_router_update_bias(const lm_router_config *c, lm_router_state *st, lm_allreduce_fn reduce,
                                void *reduce_ctx, lm_router_metrics *m, lm_error *err);

/* Quantile balancing dual solve (reference/moe.md §4.2, §4.6; Megatron
 * qb_dual_update) on one micro-batch, ungrouped. scores [T, E] fp32 (the unbiased
 * s), bias [E] the starting bias (the previous step's: no leakage). Each of
 * `iters` (>= 1) alternations: alpha_t = the (k+1)-th largest of s_t + b (row
 * multiplier), beta_j = the (q+1)-th largest of the column s[:, j] - alpha
 * (q = round(T*k/E), clamped to [0, T-1]; quickselect), then b = -mid, centred,
 * where mid_j is the midpoint between beta_j and the q-th largest margin: every
 * value in that interval leaves exactly q margins above it, and the midpoint keeps
 * a gap on both sides (b = -beta itself puts the token that defines beta_j exactly
 * on its (k+1)-th key, and near convergence such tokens get exact k-th/(k+1)-th
 * key ties, which top-k breaks by index). Outputs beta [E] of the last
 * alternation, uncentred (Megatron's dual); b_centred [E] (may be NULL) = the bias
 * above. On a fixed batch the alternation converges slowly: re-routing the batch
 * after 5 alternations leaves max_j |c_j - q| of about one sampling s.d.
 * sqrt(T k/E (1 - k/E)), not <= 1 (tests/test_moe_router.c, quantile contract).
 * Requires 1 <= k < E and T >= 1. Called by lm_router_forward in QUANTILE mode. */
lm_status lm_router_quantile_solve(const lm_router_config *c, const float *scores, int T,
                                   const float *bias, int iters, float *beta, float *b_centred,
                                   lm_error *err);

/* ---------------------------------------------------------------- balance simulator */

/* The stationary skewed synthetic router of reference/moe.md §7.3, driven through
 * lm_router_forward / lm_router_update_bias (src/ops/moe_balance_sim.c):
 *   logits[t, j] = z_tj + mu_j (+ o_j),  z_tj ~ N(0, 1) iid per step, token and
 *   expert (Philox counter stream from `seed`), mu_j linear in [-skew, skew];
 *   sigmoid scores, so s_tj = sigmoid(z_tj + mu_j).
 * Each step routes `tokens` tokens in `micro` micro-batches (training mode), then
 * calls lm_router_update_bias once. Modes: NONE (bias stays 0), AUX_FREE (sign or
 * linear rule), QUANTILE (quantile_iters alternations per micro-batch), AUX_LOSS:
 * a pure score simulation has no router weights to train, so the router gets one
 * trainable logit offset o_j per expert (init 0) and plain SGD on the aux loss
 * alone, o -= aux_lr * d(aux)/do (gradient from lm_router_backward, summed over
 * tokens, averaged over micro-batches); the bias stays 0. */
typedef struct {
    int experts, topk, tokens, steps, micro; /* E, k, T per step, N, micro-batches per step */
    lm_balance_mode mode;
    lm_bias_rule rule;    /* AUX_FREE */
    float rate;           /* u, default 1e-3 */
    float clamp;          /* default 1.0 (<= 0: none) */
    int center;           /* default 1 */
    int iters;            /* QUANTILE alternations, default 1 */
    float ema;            /* QUANTILE EMA, default 0 */
    float capacity_factor;/* default 0 (dropless) */
    lm_drop_policy drop;  /* default probs */
    float aux_alpha;      /* AUX_LOSS weight, default 1e-2 */
    float aux_lr;         /* AUX_LOSS SGD rate on the offsets, default 100 */
    float skew;           /* mu_j in [-skew, skew], default 2 */
    uint64_t seed;        /* default 1234 */
} lm_balance_sim_config;

/* Summary over the run. Steps are numbered from 1. */
typedef struct {
    int first_step_maxvio_below_0_2; /* first step with maxvio_batch < 0.2; 0 = never */
    double maxvio_batch_last100_mean; /* mean of maxvio_batch over the last <= 100 steps */
    double maxvio_global_last100;     /* maxvio of the demand pooled over the last <= 100 steps */
    int n_dead_final;                 /* dead experts in the last step */
    double max_abs_bias;              /* max |b| over all steps (after each update) */
    int max_n_clamped;                /* max n_clamped over all steps */
    double seconds;                   /* wall time of the run */
} lm_balance_sim_summary;

/* Defaults above with E = 64, k = 8, T = 4096, N = 1000, micro 1, mode AUX_FREE. */
void lm_balance_sim_config_default(lm_balance_sim_config *c);
/* Run the simulation. steps: [c->steps] per-step metrics (may be NULL); sum may be
 * NULL. Errors: bad configuration (names the field). Deterministic for a seed, and
 * identical across thread counts. */
lm_status lm_balance_sim_run(const lm_balance_sim_config *c, lm_router_metrics *steps,
                             lm_balance_sim_summary *sum, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
