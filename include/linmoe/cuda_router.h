/* linmoe MoE router on NVIDIA GPUs (CUDA C, sm_90a): the router forward (scores, biased
 * top-k selection with optional group limiting, gate weights, capacity dropping), the
 * sequence- or batch-wise aux loss, the backward into the logits, the per-step balance
 * accumulators, the bias update (sign / linear rule, quantile balancing), the balance
 * metrics and the quantile dual solve. fp32 routing math throughout, as on the CPU.
 *
 * Same math, configuration (lm_router_config) and results as include/linmoe/moe_router.h,
 * which is the reference: src/ops/moe_router.c (forward, backward, quantile solve) and
 * src/ops/moe_balance.c (update, metrics); reference/moe.md §1.1 (selection on s + b,
 * weights from s), §2 (DeepSeek-V3 normalisation, scaling, group-limited routing,
 * sequence-wise aux loss), §4.2 / §4.5 / §4.6 (quantile dual), §5 (capacity), §8.2
 * (metrics). Indices, scores and weights are bit-identical to the CPU's in all but rare
 * cases: the sigmoid / softmax exponential is evaluated in fp64 and rounded to fp32,
 * which is the correctly rounded expf that glibc's expf returns too, and every other
 * per-token operation is the CPU's, in the CPU's order (fp64 sums over the k selected
 * run in slot order). Sums over all E experts or over tokens run in fixed-order trees in
 * fp64, so they differ from the CPU's serial fp64 sums only in the last bits.
 *
 * Every call is asynchronous on the context's stream (backend.h), allocates nothing
 * (scratch from the context, grow-only) and never synchronises the host, except the
 * _init / _free / _upload / _download helpers and route_alloc, which do not run ops.
 * Results are deterministic: no float atomics; integer atomics only where the result
 * does not depend on their order (per-expert counts).
 *
 * Limits of this backend (LM_ERR_UNSUPPORTED, naming the key): num_experts <= 1024 (one
 * warp per token, ceil(E/32) scores per lane), num_experts_per_tok <= 32, n_group <= 32.
 *
 * What this module does not do: the router GEMM (logits = x W_router^T, fp32 output, by
 * the caller), the experts (permute, grouped GEMM, combine), the all-reduce of the step
 * accumulators across ranks (the caller's, at the point marked "all-reduce here").
 *
 * Errors: LM_ERR_INVALID for a bad configuration (lm_router_config_validate's checks and
 * messages), a missing buffer or a bad size (the message names it); LM_ERR_UNSUPPORTED
 * for the limits above or a build without CUDA; LM_ERR_IO / LM_ERR_NOMEM from CUDA.
 * Device data is not scanned (that would synchronise): non-finite logits are not
 * reported as on the CPU; a NaN key ranks below every finite key, indices stay in range.
 */
#ifndef LINMOE_CUDA_ROUTER_H
#define LINMOE_CUDA_ROUTER_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/moe_router.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_CUDA_ROUTER_MAX_EXPERTS 1024
#define LM_CUDA_ROUTER_MAX_TOPK 32
#define LM_CUDA_ROUTER_MAX_GROUPS 32

/* ---------------------------------------------------------------- step state */

/* The step accumulators: one fp64 buffer of LM_CUDA_ROUTER_ACC_LEN(E) sums, laid out as
 *   [0, E)     demand: selections per expert before capacity (the balance load)
 *   [E, 2E)    kept: selections per expert after capacity
 *   [2E, 3E)   QUANTILE: sum of the per-micro-batch centred dual solutions
 *   3E + LM_CUDA_ROUTER_ACC_*   the scalars below
 * Every entry is a sum (counts are exact integers in fp64), so an element-wise
 * all-reduce(SUM) of the whole buffer over the data-parallel ranks is all a multi-rank
 * step needs: ncclAllReduce(acc, acc, LM_CUDA_ROUTER_ACC_LEN(E), ncclDouble, ncclSum)
 * between the step's last lm_cuda_router_forward and lm_cuda_router_update_bias. It is
 * the CPU's reduce buffer (src/ops/moe_balance.c), so both backends reduce the same. */
enum {
    LM_CUDA_ROUTER_ACC_TOKENS = 0,      /* tokens routed */
    LM_CUDA_ROUTER_ACC_DROP_ASSIGN = 1, /* assignments dropped by capacity */
    LM_CUDA_ROUTER_ACC_DROP_TOKENS = 2, /* tokens that lost at least one assignment */
    LM_CUDA_ROUTER_ACC_AUX = 3,         /* sum of the micro-batches' aux loss (fp32 values) */
    LM_CUDA_ROUTER_ACC_NMICRO = 4,      /* micro-batches routed in training */
    LM_CUDA_ROUTER_ACC_QBCOUNT = 5,     /* quantile solutions summed */
    LM_CUDA_ROUTER_ACC_NSCALARS = 6
};
#define LM_CUDA_ROUTER_ACC_LEN(E) (3 * (E) + LM_CUDA_ROUTER_ACC_NSCALARS)

/* Persistent per-layer router state in device memory (one allocation, owned by the
 * struct; lm_cuda_router_state_free). The GPU twin of lm_router_state. */
typedef struct {
    int E;
    float *e_score_correction_bias; /* [E] fp32, the selection bias (checkpointed) */
    float *prev_delta;              /* [E] fp32, last non-zero bias change (sign flips) */
    double *acc;                    /* [LM_CUDA_ROUTER_ACC_LEN(E)] step sums (see above) */
    double *history;                /* [LM_ROUTER_HISTORY, E] demand of past steps */
    int32_t *hist_len_pos;          /* [2]: hist_len, hist_pos */
    void *base;                     /* the allocation */
} lm_cuda_router_state;

/* Allocate on the context's device and zero (bias 0, nothing accumulated). E in
 * [1, LM_CUDA_ROUTER_MAX_EXPERTS]. Synchronous (a memset). */
lm_status lm_cuda_router_state_init(lm_cuda_ctx *ctx, lm_cuda_router_state *s, int E,
                                    lm_error *err);
void lm_cuda_router_state_free(lm_cuda_ctx *ctx, lm_cuda_router_state *s);
/* Copy a CPU state (bias, accumulators, last changes, history) to the device state of
 * the same E, or back. Synchronous. These are how a checkpoint's bias gets to the GPU
 * and how the tests compare the backends. */
lm_status lm_cuda_router_state_upload(lm_cuda_ctx *ctx, lm_cuda_router_state *dst,
                                      const lm_router_state *src, lm_error *err);
lm_status lm_cuda_router_state_download(lm_cuda_ctx *ctx, const lm_cuda_router_state *src,
                                        lm_router_state *dst, lm_error *err);

/* ---------------------------------------------------------------- route */

/* One micro-batch's routing, a bundle of device buffers the caller owns (or
 * lm_cuda_route_alloc made). T tokens, E = num_experts, k = num_experts_per_tok, all
 * row-major. This is the format the expert side (permute / grouped GEMM / combine)
 * consumes:
 *   topk_idx     int32 [T, k]  selected experts in descending key order (key = s + bias),
 *                              ties to the lower expert id: the CPU's order; -1 where
 *                              the capacity policy dropped the assignment (training)
 *   topk_weight  fp32  [T, k]  combine weight w = s[t, idx] (unbiased) / (sum over the k
 *                              selected s + 1e-20) (norm_topk_prob and k > 1)
 *                              * routed_scaling_factor; 0 where dropped. The kept
 *                              weights are those of the CPU, normalised over all k
 *                              selected, dropped ones included.
 *   counts       int32 [E]     assignments kept per expert (= demand when dropless)
 *   demand       int32 [E]     selections per expert before capacity
 * Saved for the backward / the balance (required where noted):
 *   scores       fp32  [T, E]  unbiased scores s (sigmoid or softmax of the logits);
 *                              required in training and with AUX_LOSS; NULL allowed
 *                              otherwise (inference: not written)
 *   sel_idx      int32 [T, k]  the selection before capacity (topk_idx without the -1);
 *                              required in training with capacity_factor > 0, else may
 *                              be NULL (written when given)
 *   n_dropped    int32 [2]     dropped assignments, tokens that lost at least one
 *                              assignment; required in training (zeros when dropless)
 *   aux_loss     fp32  [1]     AUX_LOSS: alpha * sum_i f_i P_i (moe_router.h), else not
 *                              written; required with AUX_LOSS
 *   aux_coef     fp64  [seq_cap, E]  AUX_LOSS: d(aux)/d(s'_ti) per sequence, for the
 *                              backward; required with AUX_LOSS
 * Capacities (checked by the forward): T_cap tokens for the [T, *] buffers, seq_cap
 * rows of aux_coef (the number of sequences, n_cu - 1, or 1 for the batch-wise loss).
 * The forward fills the fields after the buffers for the backward; the buffers must stay
 * untouched between a forward and its backward. */
typedef struct {
    int32_t *topk_idx;
    float *topk_weight;
    int32_t *counts;
    int32_t *demand;
    float *scores;
    int32_t *sel_idx;
    int32_t *n_dropped;
    float *aux_loss;
    double *aux_coef;
    int T_cap, seq_cap;
    /* set by lm_cuda_router_forward */
    int T, E, k;
    int64_t capacity;      /* per-expert capacity C used (0 = dropless) */
    int dropped;           /* 1 when capacity applied: topk_idx may hold -1 */
    int aux_ready;         /* 1 when aux_coef holds this route's coefficients */
    const int32_t *aux_cu; /* the cu_seqlens the aux loss used (NULL: one sequence) */
    int aux_nseq;          /* rows of aux_coef in use */
    void *base;            /* lm_cuda_route_alloc's allocation, else NULL */
} lm_cuda_route;

/* Allocate every buffer above for up to T_cap tokens and seq_cap sequences (one
 * allocation through the context; scores, sel_idx, n_dropped always; aux_loss and
 * aux_coef when c->balance is AUX_LOSS). Free with lm_cuda_route_free (which leaves a
 * caller-carved route alone: base NULL). */
lm_status lm_cuda_route_alloc(lm_cuda_ctx *ctx, const lm_router_config *c, int T_cap, int seq_cap,
                              lm_cuda_route *r, lm_error *err);
void lm_cuda_route_free(lm_cuda_ctx *ctx, lm_cuda_route *r);

/* ---------------------------------------------------------------- ops */

/* Route one micro-batch (lm_router_forward's semantics, moe_router.h "Details").
 *   logits      fp32 [T, E] device, row-major: x W_router^T (the caller's GEMM)
 *   st          device state or NULL (then zero bias; training needs it): the bias read
 *               for the selection is st->e_score_correction_bias (the previous step's)
 *   cu_seqlens  int32 [n_cu] device, the packed sequences' bounds (0, ..., T), only read
 *               by the sequence-wise aux loss (AUX_LOSS with aux_loss_seq); NULL: one
 *               sequence. Not validated on the device (it must satisfy the CPU's rules);
 *               n_cu >= 2 is checked. It must stay valid until the backward.
 *   training    1: capacity dropping (capacity_factor > 0: C = min(T, ceil(T*k/E*cf)),
 *               policy probs keeps each expert's C highest unbiased scores, ties to the
 *               earlier token; position keeps its C earliest tokens), the step
 *               accumulators of st (demand, kept, drops, aux loss, micro-batches; the
 *               "count" half of balancing), and in QUANTILE mode the dual solve of this
 *               micro-batch with the current bias (lm_cuda_router_quantile_solve, its
 *               centred solution summed into st->acc). 0: dropless, nothing accumulated.
 * T = 0 writes zero counts and returns (nothing accumulated, as on the CPU).
 * Kernels: the router (one warp per token, 32 tokens per block: scores, keys, group
 * limiting, k rounds of a warp arg-max with the CPU's tie-break, weights; per-block
 * expert histograms), a per-expert scan of those histograms (demand, counts, each
 * block's rank base), then with capacity a per-tile rank pass (warp match_any over the
 * assignments in token order), and for probs a scatter into per-expert buckets, a radix
 * select of each over-full expert's C-th best (score, token) key and a marking pass. */
lm_status lm_cuda_router_forward(lm_cuda_ctx *ctx, const lm_router_config *c,
                                 lm_cuda_router_state *st, const float *logits, int T,
                                 const int32_t *cu_seqlens, int n_cu, int training,
                                 lm_cuda_route *out, lm_error *err);

/* Gradient of sum(topk_weight * dtopk_weight) [+ aux_loss when AUX_LOSS and
 * aux_loss_alpha > 0] with respect to the logits (lm_router_backward's math): through
 * the normalisation over the k selected, dropped ones included in the sum but getting
 * no direct term; the bias gets none.
 *   r             the route of lm_cuda_router_forward (scores, sel_idx / topk_idx,
 *                 aux_coef and aux_cu read)
 *   dtopk_weight  fp32 [T, k] device: the gradient of the combine weights (the combine
 *                 backward's); NULL = zero (aux loss only)
 *   dlogits       fp32 [T, E] device, overwritten */
lm_status lm_cuda_router_backward(lm_cuda_ctx *ctx, const lm_router_config *c,
                                  const lm_cuda_route *r, const float *dtopk_weight, float *dlogits,
                                  lm_error *err);

/* Once per optimizer step, after all micro-batches and AFTER the caller's all-reduce of
 * st->acc ("all-reduce here", see the layout above): update the bias on the device
 * (lm_router_update_bias's semantics, moe_router.h "Details": AUX_FREE sign
 * b += u sign(mean - demand) or linear b += u (mean - demand) / mean; QUANTILE b = ema b +
 * (1 - ema) * mean of the summed solutions; then centring and clamping; NONE / AUX_LOSS
 * leave b alone; a step without tokens changes nothing), record the last changes and the
 * demand history, write the metrics and zero st->acc. One block; fixed-order fp64
 * reductions.
 *   metrics  device pointer to one lm_router_metrics (the CPU's struct, same layout), or
 *            NULL; maxvio_batch = max_e demand_e / mean - 1, maxvio_global over the
 *            demand pooled across the last <= LM_ROUTER_HISTORY steps, and the rest. */
lm_status lm_cuda_router_update_bias(lm_cuda_ctx *ctx, const lm_router_config *c,
                                     lm_cuda_router_state *st, lm_router_metrics *metrics,
                                     lm_error *err);

/* Quantile balancing dual solve on one micro-batch (lm_router_quantile_solve's algorithm
 * and results): per alternation alpha_t = the (k+1)-th largest of s_t + b, beta_j = the
 * (q+1)-th largest of s[:, j] - alpha (q = round(T*k/E) clamped to [0, T-1]), b = -mid
 * centred, mid_j the midpoint between beta_j and the q-th largest margin when exactly q
 * margins exceed beta_j (else beta_j). The order statistics are exact (radix select on
 * the fp32 bits), so beta equals the CPU's bit for bit.
 *   scores     fp32 [T, E] device (the unbiased s)
 *   bias       fp32 [E] device, the starting bias, or NULL (zeros)
 *   beta       fp32 [E] device out: the last alternation's beta, uncentred
 *   b_centred  fp32 [E] device out, or NULL
 * Requires 1 <= k < E, T >= 1, iters >= 1. Scratch: E*T fp32 of transposed margins. */
lm_status lm_cuda_router_quantile_solve(lm_cuda_ctx *ctx, const lm_router_config *c,
                                        const float *scores, int T, const float *bias, int iters,
                                        float *beta, float *b_centred, lm_error *err);

/* maxvio of one count vector on the device: max_e counts_e / mean - 1 (0 when the counts
 * sum to 0), the CPU's maxvio_batch formula, e.g. on a micro-batch's demand.
 *   counts int32 [E] device; maxvio fp32 [1] device out. */
lm_status lm_cuda_router_maxvio(lm_cuda_ctx *ctx, const int32_t *counts, int E, float *maxvio,
                                lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
