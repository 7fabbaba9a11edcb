/* The GPU model's MoE FFN layer: one DeepseekV3MoE block (router, routed SwiGLU experts,
 * shared experts) on one CUDA device, in bf16 storage with fp32 accumulation and fp32
 * routing math, built from the backend's ops. Interface: src/model/gpu_internal.h
 * ("MoE FFN"); conventions (bf16 activations, fp32 accumulated gradients, no allocation
 * in a step, asynchronous on the context's stream) at the top of that header.
 *
 * Math: exactly the CPU layer's, include/linmoe/moe.h and src/ops/moe.c (lm_moe_forward /
 * lm_moe_backward); routing as include/linmoe/moe_router.h; sources reference/moe.md §2
 * (DeepSeek-V3 MoE: sigmoid scores, selection bias, shared + routed experts, sequence-wise
 * aux loss), §5 (capacity), §6.3 (grouped GEMM). For N = B*T tokens, x [N, d]:
 *   logits = x W_r^T                    fp32 [N, E]   (lm_cuda_gemm, W_r = gate.weight)
 *   (topk_idx, topk_weight, scores, aux_loss) = lm_cuda_router_forward(logits)
 *                                       (bias from the layer's device router state; the
 *                                       weights carry the top-k normalisation and
 *                                       routed_scaling_factor; -1 / 0 where capacity
 *                                       dropped an assignment, training only)
 *   out_t  = S(x_t) + sum_{j kept} topk_weight[t,j] E_{topk_idx[t,j]}(x_t)
 *                                       (lm_cuda_moe_forward: routed + shared SwiGLU)
 * Backward of  L = sum(out * dout) + aux_scale * aux_loss  (aux term only with
 * balance = AUX_LOSS and aux_loss_alpha > 0):
 *   dx_experts, dtopk_weight, d experts.* / shared_experts.*   (lm_cuda_moe_backward)
 *   dlogits = d(sum topk_weight * dtopk_weight)/dlogits + aux_scale * d(aux_loss)/dlogits
 *                                       (lm_cuda_router_backward; fp32 [N, E])
 *   dx     = dx_experts + bf16(dlogits) W_r             (bf16 GEMM, beta = 1)
 *   d gate.weight += bf16(dlogits)^T x                  (fp32 GEMM, beta = 1)
 * The CPU computes dlogits W_r and dlogits^T x in fp32; here dlogits is rounded to bf16
 * once because the GEMM takes bf16 operands (cuda_gemm.h).
 *
 * aux_scale: the router backward of cuda_router.h adds the gradient of the aux loss with
 * weight 1 (its coefficients, alpha included, are computed by the forward). aux_scale = 1
 * is one router backward; aux_scale = 0 runs it with aux_loss_alpha = 0 (no aux term);
 * any other value runs it twice, the aux-only part first (dtopk_weight = NULL), stored as
 * bf16(aux_scale * daux) and added in fp32 onto the weight part (aux_loss_alpha = 0): the
 * aux part picks up one extra bf16 rounding (relative 2^-9) before the sum is rounded to
 * bf16 for the GEMMs anyway. The CPU model's lm_model_backward(loss_scale) scales only the
 * cross-entropy gradient by loss_scale; the aux loss gradient enters with weight 1 for
 * every micro-batch (src/ops/moe.c calls lm_router_backward, which never sees
 * loss_scale). Calling this with aux_scale = 1 reproduces that.
 *
 * Sequence-wise aux loss (aux_loss_seq): the sequences are b->cu_dev when the batch is
 * packed (b->cu_seqlens != NULL), else the whole batch of N tokens is ONE sequence, also
 * for B > 1 rows: the CPU model passes no cu_seqlens for B rows (src/model/model.c
 * sublayer_forward) and lm_router_forward then uses the bounds (0, N).
 *
 * Buffers (one lm_cuda_ctx_alloc, 256-byte aligned pieces, for up to max_tokens = Nmax
 * tokens; plus the router state's own allocation, lm_cuda_router_state_init):
 *   logits     fp32 [Nmax, E]   the router GEMM's output; the backward reuses it as the
 *                               fp32 dlogits (the router backward reads only the scores)
 *   dl16       bf16 [Nmax, E]   bf16 dlogits (GEMM operand), and the bf16 aux part
 *   dtopk      fp32 [Nmax, k]   the experts' backward output, the router's input
 *   route      topk_idx int32 [Nmax, k], topk_weight fp32 [Nmax, k], counts / demand
 *              int32 [E], scores fp32 [Nmax, E], sel_idx int32 [Nmax, k] (only with
 *              capacity_factor > 0), n_dropped int32 [2], with AUX_LOSS aux_loss fp32 [1]
 *              and aux_coef fp64 [seq_cap, E] (seq_cap = min(max_seqs, Nmax) with
 *              aux_loss_seq, else 1)
 *   saved      lm_cuda_moe_plan(Nmax).saved_bytes    (forward -> backward)
 *   scratch    lm_cuda_moe_plan(Nmax).scratch_bytes  (one experts call)
 * The route and `saved` hold the last forward until the next one. Not counted here: the
 * context scratch the router forward grows on first use (LM_SCRATCH_A) and the cuBLASLt
 * workspace, both the context's.
 *
 * Errors: LM_ERR_INVALID for NULL arguments, a batch of the wrong size or context, a
 * backward without a training forward of the same N, a non-finite aux_scale, too many
 * sequences for max_seqs; LM_ERR_UNSUPPORTED for the CUDA ops' limits (E <= 1024, k <= 32,
 * n_group <= 32, d and f multiples of 8) and in a build without CUDA; the ops' errors
 * otherwise. Every message starts with "gpu moe: ". Device data is not scanned (that
 * would synchronise): non-finite inputs are not reported as on the CPU.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/cuda_elementwise.h"
#include "linmoe/cuda_gemm.h"
#include "linmoe/cuda_moe.h"
#include "linmoe/cuda_router.h"
#include "model/gpu_internal.h"

struct lm_gpu_moe_layer {
    lm_cuda_ctx *ctx;
    lm_moe_config c;
    int64_t max_tokens;
    int seq_cap; /* rows of route.aux_coef */
    lm_cuda_router_state st;
    lm_cuda_route route; /* carved from mem (route.base stays NULL) */
    float *logits;       /* [max_tokens, E] fp32; the backward's dlogits */
    void *dl16;          /* [max_tokens, E] bf16 */
    float *dtopk;        /* [max_tokens, k] fp32 */
    void *saved, *scratch;
    void *mem;
    /* the last forward */
    int have_fwd; /* 1: a training forward of fwd_N tokens is in route / saved */
    int64_t fwd_N;
};

/* Pieces are 256-byte aligned, as the CUDA ops carve their own buffers. */
static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* A bump allocator over one buffer; base NULL only sums the sizes. */
typedef struct {
    char *base;
    size_t off;
} carver;

static void *take(carver *cv, size_t bytes) {
    void *p = cv->base ? (void *)(cv->base + cv->off) : NULL;
    cv->off += align256(bytes);
    return p;
}

/* Bytes lm_cuda_router_state_init allocates for E experts (its layout in
 * src/ops/cuda/moe_router.cu: bias, last changes, accumulators, history, hist_len/pos,
 * each 256-byte aligned). */
static size_t router_state_bytes(int E) {
    return align256(sizeof(float) * (size_t)E) + align256(sizeof(float) * (size_t)E) +
           align256(sizeof(double) * (size_t)LM_CUDA_ROUTER_ACC_LEN(E)) +
           align256(sizeof(double) * (size_t)LM_ROUTER_HISTORY * (size_t)E) +
           align256(sizeof(int32_t) * 2);
}

static int seq_cap_of(const lm_moe_config *c, int64_t max_tokens, int max_seqs) {
    if (c->router.balance != LM_BAL_AUX_LOSS || !c->router.aux_loss_seq)
        return 1;
    return (int64_t)max_seqs < max_tokens ? max_seqs : (int)max_tokens;
}

/* The configuration checks of _bytes and _new: lm_moe_config_validate, the CUDA ops'
 * limits (router and experts), max_tokens and max_seqs. Fills the experts' sizes. */
static lm_status check_config(const lm_moe_config *c, int64_t max_tokens, int max_seqs,
                              lm_cuda_moe_sizes *sz, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: config is required");
    lm_error e = {0};
    lm_status s = lm_moe_config_validate(c, &e);
    if (s != LM_OK)
        return lm_errorf(err, s, "gpu moe: %s", e.msg);
    const lm_router_config *r = &c->router;
    if (r->num_experts > LM_CUDA_ROUTER_MAX_EXPERTS)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu moe: num_experts = %d is not supported (at most %d)", r->num_experts,
                         LM_CUDA_ROUTER_MAX_EXPERTS);
    if (r->num_experts_per_tok > LM_CUDA_ROUTER_MAX_TOPK)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu moe: num_experts_per_tok = %d is not supported (at most %d)",
                         r->num_experts_per_tok, LM_CUDA_ROUTER_MAX_TOPK);
    if (r->n_group > LM_CUDA_ROUTER_MAX_GROUPS)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu moe: n_group = %d is not supported (at most %d)", r->n_group,
                         LM_CUDA_ROUTER_MAX_GROUPS);
    if (max_tokens < 1 || max_tokens > INT_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: max_tokens = %lld is outside [1, %d]",
                         (long long)max_tokens, INT_MAX);
    /* the router and the GEMMs index [N, E] and [N, k] with 32-bit ints */
    const int64_t E = r->num_experts, k = r->num_experts_per_tok;
    if (max_tokens * (E > k ? E : k) > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu moe: max_tokens = %lld x num_experts = %lld is too large (must be "
                         "below 2^31)",
                         (long long)max_tokens, (long long)E);
    if (max_seqs < 1)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: max_seqs = %d (must be >= 1)", max_seqs);
    s = lm_cuda_moe_plan(c, (int)max_tokens, sz, &e);
    if (s != LM_OK)
        return lm_errorf(err, s, "gpu moe: %s", e.msg);
    return LM_OK;
}

/* Carve (base != NULL) or size (base NULL) the layer's buffers; returns the bytes. */
static size_t layout(const lm_moe_config *c, int64_t max_tokens, int seq_cap,
                     const lm_cuda_moe_sizes *sz, void *base, lm_gpu_moe_layer *L, int own_saved,
                     void *shared_saved, int own_scratch, void *shared_scratch) {
    const size_t N = (size_t)max_tokens, E = (size_t)c->router.num_experts,
                 k = (size_t)c->router.num_experts_per_tok;
    const int aux = c->router.balance == LM_BAL_AUX_LOSS;
    const int capacity = c->router.capacity_factor > 0.0f;
    carver cv = {(char *)base, 0};
    lm_gpu_moe_layer dummy;
    if (!L)
        L = &dummy;
    lm_cuda_route *r = &L->route;
    L->logits = (float *)take(&cv, sizeof(float) * N * E);
    L->dl16 = take(&cv, sizeof(uint16_t) * N * E);
    L->dtopk = (float *)take(&cv, sizeof(float) * N * k);
    r->topk_idx = (int32_t *)take(&cv, sizeof(int32_t) * N * k);
    r->topk_weight = (float *)take(&cv, sizeof(float) * N * k);
    r->counts = (int32_t *)take(&cv, sizeof(int32_t) * E);
    r->demand = (int32_t *)take(&cv, sizeof(int32_t) * E);
    r->scores = (float *)take(&cv, sizeof(float) * N * E);
    r->sel_idx = capacity ? (int32_t *)take(&cv, sizeof(int32_t) * N * k) : NULL;
    r->n_dropped = (int32_t *)take(&cv, sizeof(int32_t) * 2);
    r->aux_loss = aux ? (float *)take(&cv, sizeof(float)) : NULL;
    r->aux_coef = aux ? (double *)take(&cv, sizeof(double) * (size_t)seq_cap * E) : NULL;
    /* the experts' saved activations and scratch: carved here when the layer owns them,
     * else the caller's shared buffers (own_* without a buffer: sizing only) */
    if (!own_saved)
        L->saved = shared_saved;
    else
        L->saved = take(&cv, sz->saved_bytes);
    if (!own_scratch)
        L->scratch = shared_scratch;
    else
        L->scratch = take(&cv, sz->scratch_bytes);
    return cv.off;
}

/* Both the buffers and the router state. */
static size_t layer_bytes(const lm_moe_config *c, int64_t max_tokens, int max_seqs,
                          const lm_cuda_moe_sizes *sz, int own_saved, int own_scratch) {
    return layout(c, max_tokens, seq_cap_of(c, max_tokens, max_seqs), sz, NULL, NULL, own_saved,
                  NULL, own_scratch, NULL) +
           router_state_bytes(c->router.num_experts);
}

/* _new's max_seqs is not an argument of the byte counts: the bound max_seqs = max_tokens
 * (every valid cu_seqlens has at most max_tokens sequences), exact for any max_seqs >=
 * max_tokens and an upper bound otherwise (only the sequence-wise aux loss depends on
 * it). */
static int bytes_max_seqs(int64_t max_tokens) {
    return max_tokens > 0 && max_tokens <= INT_MAX ? (int)max_tokens : 1;
}

size_t lm_gpu_moe_layer_bytes(const lm_moe_config *c, int64_t max_tokens, int own_saved,
                              int own_scratch) {
    const int max_seqs = bytes_max_seqs(max_tokens);
    lm_cuda_moe_sizes sz;
    if (check_config(c, max_tokens, max_seqs, &sz, NULL) != LM_OK)
        return 0;
    return layer_bytes(c, max_tokens, max_seqs, &sz, own_saved, own_scratch);
}

lm_status lm_gpu_moe_layer_shared_bytes(const lm_moe_config *c, int64_t max_tokens,
                                        size_t *saved_bytes, size_t *scratch_bytes, lm_error *err) {
    lm_cuda_moe_sizes sz;
    LM_TRY(check_config(c, max_tokens, bytes_max_seqs(max_tokens), &sz, err));
    if (saved_bytes)
        *saved_bytes = align256(sz.saved_bytes);
    if (scratch_bytes)
        *scratch_bytes = align256(sz.scratch_bytes);
    return LM_OK;
}

lm_status lm_gpu_moe_layer_new(lm_cuda_ctx *ctx, const lm_moe_config *c, int64_t max_tokens,
                               int max_seqs, void *shared_saved, void *shared_scratch,
                               lm_gpu_moe_layer **out, lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: output layer pointer is required");
    *out = NULL;
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: the CUDA context is required");
    lm_cuda_moe_sizes sz;
    LM_TRY(check_config(c, max_tokens, max_seqs, &sz, err));
    lm_gpu_moe_layer *L = (lm_gpu_moe_layer *)calloc(1, sizeof(*L));
    if (!L)
        return lm_errorf(err, LM_ERR_NOMEM, "gpu moe: out of host memory for the layer");
    L->ctx = ctx;
    L->c = *c;
    L->max_tokens = max_tokens;
    L->seq_cap = seq_cap_of(c, max_tokens, max_seqs);
    const int own_saved = shared_saved == NULL, own_scratch = shared_scratch == NULL;
    const size_t bytes =
        layout(c, max_tokens, L->seq_cap, &sz, NULL, NULL, own_saved, NULL, own_scratch, NULL);
    lm_error e = {0};
    lm_status s = lm_cuda_ctx_alloc(ctx, &L->mem, bytes, &e);
    if (s != LM_OK) {
        free(L);
        return lm_errorf(err, s, "gpu moe: buffers of %zu bytes for %lld tokens: %s", bytes,
                         (long long)max_tokens, e.msg);
    }
    layout(c, max_tokens, L->seq_cap, &sz, L->mem, L, own_saved, shared_saved, own_scratch,
           shared_scratch);
    L->route.T_cap = (int)max_tokens;
    L->route.seq_cap = L->seq_cap;
    s = lm_cuda_router_state_init(ctx, &L->st, c->router.num_experts, &e);
    if (s != LM_OK) {
        lm_cuda_ctx_free_mem(ctx, L->mem);
        free(L);
        return lm_errorf(err, s, "gpu moe: router state: %s", e.msg);
    }
    *out = L;
    return LM_OK;
}

void lm_gpu_moe_layer_free(lm_gpu_moe_layer *L) {
    if (!L)
        return;
    lm_cuda_router_state_free(L->ctx, &L->st);
    lm_cuda_ctx_free_mem(L->ctx, L->mem);
    free(L);
}

lm_cuda_router_state *lm_gpu_moe_layer_router(lm_gpu_moe_layer *L) { return L ? &L->st : NULL; }

/* ---------------------------------------------------------------- forward */

static lm_status check_batch(const lm_gpu_moe_layer *L, const lm_gpu_batch *b, lm_error *err) {
    if (!b)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: batch is required");
    if (b->ctx != L->ctx)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu moe: the batch's CUDA context is not the layer's");
    if (b->B < 0 || b->T < 0 || b->N != (int64_t)b->B * b->T)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: batch N = %lld is not B * T = %d * %d",
                         (long long)b->N, b->B, b->T);
    if (b->N > L->max_tokens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu moe: batch of N = %lld tokens exceeds max_tokens = %lld",
                         (long long)b->N, (long long)L->max_tokens);
    if (b->cu_seqlens && b->B != 1)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: cu_seqlens needs B == 1 (B = %d)", b->B);
    return LM_OK;
}

static lm_status check_weights(const lm_gpu_moe_layer *L, const lm_gpu_moe_weights *w,
                               lm_error *err) {
    if (!w)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: weights are required");
    const char *miss = !w->gate        ? "gate.weight"
                       : !w->gate_proj ? "experts.gate_proj"
                       : !w->up_proj   ? "experts.up_proj"
                       : !w->down_proj ? "experts.down_proj"
                                       : NULL;
    if (!miss && L->c.n_shared_experts > 0)
        miss = !w->shared_gate_proj   ? "shared_experts.gate_proj"
               : !w->shared_up_proj   ? "shared_experts.up_proj"
               : !w->shared_down_proj ? "shared_experts.down_proj"
                                      : NULL;
    if (miss)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: weight '%s' is NULL%s", miss,
                         L->c.n_shared_experts > 0 && !strncmp(miss, "shared", 6)
                             ? " (n_shared_experts > 0)"
                             : "");
    return LM_OK;
}

static lm_cuda_moe_weights expert_weights(const lm_gpu_moe_weights *w) {
    lm_cuda_moe_weights ew = {w->gate_proj,        w->up_proj,        w->down_proj,
                              w->shared_gate_proj, w->shared_up_proj, w->shared_down_proj};
    return ew;
}

/* An op's failure, its message prefixed with the layer's name and the step. */
static lm_status fail(lm_error *err, lm_status s, const char *what, const lm_error *e) {
    return lm_errorf(err, s, "gpu moe: %s: %s", what, e->msg);
}

lm_status lm_gpu_moe_layer_forward(lm_gpu_moe_layer *L, const lm_gpu_batch *b,
                                   const lm_gpu_moe_weights *w, const void *x, void *out,
                                   const float **aux_loss_dev, lm_error *err) {
    if (aux_loss_dev)
        *aux_loss_dev = NULL;
    if (!L)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: layer is required");
    LM_TRY(check_batch(L, b, err));
    LM_TRY(check_weights(L, w, err));
    if (!x || !out)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: %s is NULL", !x ? "x" : "out");
    const lm_router_config *rc = &L->c.router;
    const int N = (int)b->N, E = rc->num_experts, d = L->c.hidden_size;
    const int aux = rc->balance == LM_BAL_AUX_LOSS;
    /* sequence bounds of the sequence-wise aux loss: the packed batch's, else one
     * sequence of N tokens (the CPU's rule, see the top of the file) */
    const int seqwise = aux && rc->aux_loss_seq && b->cu_seqlens;
    if (seqwise) {
        if (!b->cu_dev)
            return lm_errorf(err, LM_ERR_INVALID,
                             "gpu moe: the sequence-wise aux loss needs the device copy cu_dev "
                             "of cu_seqlens");
        if (b->n_cu < 2 || b->n_cu - 1 > L->seq_cap)
            return lm_errorf(err, LM_ERR_INVALID,
                             "gpu moe: cu_seqlens has %d entries: %d sequences, the layer holds "
                             "1 .. %d (max_seqs)",
                             b->n_cu, b->n_cu - 1, L->seq_cap);
    }
    L->have_fwd = 0; /* route and saved are overwritten from here on */
    lm_cuda_ctx *ctx = L->ctx;
    lm_error e = {0};
    lm_status s;

    s = lm_cuda_gemm(ctx, 0, 1, N, E, d, 1.0f, x, d, w->gate, d, 0.0f, L->logits, E,
                     LM_CUDA_GEMM_F32, &e);
    if (s != LM_OK)
        return fail(err, s, "router logits GEMM", &e);
    s = lm_cuda_router_forward(ctx, rc, &L->st, L->logits, N, seqwise ? b->cu_dev : NULL,
                               seqwise ? b->n_cu : 0, b->training ? 1 : 0, &L->route, &e);
    if (s != LM_OK)
        return fail(err, s, "router forward", &e);
    const lm_cuda_moe_weights ew = expert_weights(w);
    s = lm_cuda_moe_forward(ctx, &L->c, N, &ew, x, L->route.topk_idx, L->route.topk_weight,
                            L->route.counts, b->training ? 1 : 0, L->saved, L->scratch, out, NULL,
                            &e);
    if (s != LM_OK)
        return fail(err, s, "experts forward", &e);
    if (b->training) {
        L->have_fwd = 1;
        L->fwd_N = b->N;
    }
    if (aux_loss_dev && aux)
        *aux_loss_dev = L->route.aux_loss;
    return LM_OK;
}

lm_status lm_gpu_moe_layer_refill(lm_gpu_moe_layer *L, const lm_gpu_batch *b,
                                  const lm_gpu_moe_weights *w, const void *x, void *out,
                                  lm_error *err) {
    if (!L)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: layer is required");
    LM_TRY(check_batch(L, b, err));
    LM_TRY(check_weights(L, w, err));
    if (!x || !out)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: %s is NULL", !x ? "x" : "out");
    if (!L->have_fwd || L->fwd_N != b->N)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu moe: refill needs the training forward of this batch first");
    lm_error e = {0};
    const lm_cuda_moe_weights ew = expert_weights(w);
    const lm_status s = lm_cuda_moe_forward(L->ctx, &L->c, (int)b->N, &ew, x, L->route.topk_idx,
                                            L->route.topk_weight, L->route.counts, 1, L->saved,
                                            L->scratch, out, NULL, &e);
    return s == LM_OK ? LM_OK : fail(err, s, "experts forward (recompute)", &e);
}

/* ---------------------------------------------------------------- backward */

/* dlogits (fp32, L->logits) of sum(topk_weight * dtopk) + aux_scale * aux_loss. */
static lm_status router_backward(lm_gpu_moe_layer *L, float aux_scale, lm_error *err) {
    lm_cuda_ctx *ctx = L->ctx;
    const lm_router_config *rc = &L->c.router;
    const int64_t NE = L->fwd_N * rc->num_experts;
    const int aux = rc->balance == LM_BAL_AUX_LOSS && rc->aux_loss_alpha > 0.0f;
    lm_error e = {0};
    lm_status s;
    if (!aux || aux_scale == 1.0f) {
        s = lm_cuda_router_backward(ctx, rc, &L->route, L->dtopk, L->logits, &e);
        return s == LM_OK ? LM_OK : fail(err, s, "router backward", &e);
    }
    /* the same routing without the aux term (aux_loss_alpha only gates it in the
     * backward: the coefficients come from the forward) */
    lm_router_config no_aux = *rc;
    no_aux.aux_loss_alpha = 0.0f;
    if (aux_scale != 0.0f) {
        /* aux part alone, scaled, parked in dl16 until the weight part is there */
        s = lm_cuda_router_backward(ctx, rc, &L->route, NULL, L->logits, &e);
        if (s != LM_OK)
            return fail(err, s, "router backward (aux loss)", &e);
        s = lm_cuda_scale_f32_to_bf16(ctx, NE, aux_scale, L->logits, L->dl16, &e);
        if (s != LM_OK)
            return fail(err, s, "router backward (aux loss scale)", &e);
    }
    s = lm_cuda_router_backward(ctx, &no_aux, &L->route, L->dtopk, L->logits, &e);
    if (s != LM_OK)
        return fail(err, s, "router backward", &e);
    if (aux_scale != 0.0f) {
        s = lm_cuda_acc_bf16_f32(ctx, NE, L->dl16, L->logits, &e);
        if (s != LM_OK)
            return fail(err, s, "router backward (aux loss sum)", &e);
    }
    return LM_OK;
}

lm_status lm_gpu_moe_layer_backward(lm_gpu_moe_layer *L, const lm_gpu_batch *b,
                                    const lm_gpu_moe_weights *w, const void *x, const void *dout,
                                    float aux_scale, void *dx, const lm_gpu_moe_grads *g,
                                    lm_error *err) {
    if (!L)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: layer is required");
    LM_TRY(check_batch(L, b, err));
    if (!L->have_fwd)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu moe: backward needs a training forward first (b->training = 1)");
    if (b->N != L->fwd_N)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu moe: backward batch of N = %lld tokens, the forward had %lld",
                         (long long)b->N, (long long)L->fwd_N);
    LM_TRY(check_weights(L, w, err));
    if (!x || !dout)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: %s is NULL", !x ? "x" : "dout");
    if (!isfinite(aux_scale))
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: aux_scale = %g is not finite",
                         (double)aux_scale);
    lm_gpu_moe_grads none;
    memset(&none, 0, sizeof(none));
    if (!g)
        g = &none;
    lm_cuda_ctx *ctx = L->ctx;
    const int N = (int)b->N, E = L->c.router.num_experts, d = L->c.hidden_size;
    lm_error e = {0};
    lm_status s;

    /* experts: dx (=, routed + shared), dtopk_weight, expert weight gradients (+=) */
    const lm_cuda_moe_weights ew = expert_weights(w);
    const lm_cuda_moe_grads eg = {g->gate_proj,        g->up_proj,        g->down_proj,
                                  g->shared_gate_proj, g->shared_up_proj, g->shared_down_proj};
    s = lm_cuda_moe_backward(ctx, &L->c, N, &ew, x, L->route.topk_weight, L->saved, L->scratch,
                             dout, dx, L->dtopk, &eg, NULL, &e);
    if (s != LM_OK)
        return fail(err, s, "experts backward", &e);
    if (!dx && !g->gate)
        return LM_OK;

    /* router: dlogits fp32 [N, E], then its bf16 copy for the GEMMs */
    LM_TRY(router_backward(L, aux_scale, err));
    s = lm_cuda_f32_to_bf16(ctx, (int64_t)N * E, L->logits, L->dl16, &e);
    if (s != LM_OK)
        return fail(err, s, "dlogits to bf16", &e);
    /* dx += dlogits W_r:  [N, E] x [E, d] */
    if (dx) {
        s = lm_cuda_gemm(ctx, 0, 0, N, d, E, 1.0f, L->dl16, E, w->gate, d, 1.0f, dx, d,
                         LM_CUDA_GEMM_BF16, &e);
        if (s != LM_OK)
            return fail(err, s, "router dx GEMM", &e);
    }
    /* d gate.weight += dlogits^T x:  [E, N] x [N, d] */
    if (g->gate) {
        s = lm_cuda_gemm(ctx, 1, 0, E, d, N, 1.0f, L->dl16, E, x, d, 1.0f, g->gate, d,
                         LM_CUDA_GEMM_F32, &e);
        if (s != LM_OK)
            return fail(err, s, "d gate.weight GEMM", &e);
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- per step */

lm_status lm_gpu_moe_layer_update_bias(lm_gpu_moe_layer *L, lm_router_metrics *metrics_dev,
                                       lm_error *err) {
    if (!L)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: layer is required");
    lm_error e = {0};
    const lm_status s = lm_cuda_router_update_bias(L->ctx, &L->c.router, &L->st, metrics_dev, &e);
    return s == LM_OK ? LM_OK : fail(err, s, "router bias update", &e);
}

lm_status lm_gpu_moe_layer_reset_step(lm_gpu_moe_layer *L, lm_error *err) {
    if (!L)
        return lm_errorf(err, LM_ERR_INVALID, "gpu moe: layer is required");
    /* st->acc holds every step accumulator (demand, kept, quantile sums, tokens, drops,
     * aux sum, micro-batch and solution counts: cuda_router.h), the CPU trainer's
     * reset_router_accumulators; bias, last changes and history stay */
    lm_error e = {0};
    const lm_status s = lm_cuda_ctx_memset(
        L->ctx, L->st.acc, 0, sizeof(double) * (size_t)LM_CUDA_ROUTER_ACC_LEN(L->st.E), &e);
    return s == LM_OK ? LM_OK : fail(err, s, "router accumulators reset", &e);
}
