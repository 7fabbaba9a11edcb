/* The KDA token mixer (Kimi Linear) on one CUDA device: forward and hand-written backward
 * in bf16 storage with fp32 accumulation, from the backend's ops. Contract:
 * src/model/gpu_internal.h "KDA layer".
 *
 * Math: exactly lm_kda_layer_forward / _backward (include/linmoe/kda_layer.h;
 * reference/kda.md §7; Kimi Linear arXiv 2510.26692 §4, Eq. 10). With x [N, d] bf16
 * (N = B*T), C = H*Dh, every projection y = x W^T (W [out, in], no bias):
 *   pq = x Wq^T, pk = x Wk^T, pv = x Wv^T               [N, C]   (lm_cuda_gemm)
 *   q, k, v = SiLU(ShortConv(pq | pk | pv; *_conv1d))   [N, C]   (lm_cuda_short_conv_forward)
 *   fa = x Wfa^T [N, Dh];  g_raw = fa Wfb^T [N, C];  beta_raw = x Wb^T [N, H]
 *   o = KDA(q, k, v, g_raw, beta_raw; A_log, dt_bias)    [N, C]   (kda_cuda.h)
 *       HV = H, K = V = Dh, scale Dh^-0.5, use_qk_l2norm_in_kernel = 1,
 *       use_beta_sigmoid_in_kernel = 1, the gate (BOUNDED with lower_bound, or SOFTPLUS)
 *       and A_log / dt_bias applied inside the op, cu_seqlens as given
 *   ga = x Wga^T [N, Dh];  gate = ga Wgb^T [N, C]
 *   y = o * rstd * o_norm * sigmoid(gate) per (token, head), eps LM_GATED_RMSNORM_EPS
 *                                                        [N, C]   (lm_cuda_gated_rmsnorm_forward)
 *   out = y Wo^T                                          [N, d]
 * The [N, C] row-major GEMM outputs are the ops' [B, T, H, Dh] layouts as they stand.
 * Backward of sum(out * dout): the chain rule through the above, each op by its own
 * backward; projections dW += dY^T X (fp32 C, beta = 1) and dX = dY W. dx sums the
 * contributions of the six projections that read x (q, k, v, f_a, b, g_a; f_b and g_b read
 * fa and ga) in an fp32 stage [N, d] (one GEMM with beta = 0, five with beta = 1), rounded
 * once to bf16 at the end (lm_cuda_f32_to_bf16): one rounding instead of six.
 * Weight gradients are fp32 and ACCUMULATED: GEMMs with beta = 1, the short conv and gated
 * norm ops (they accumulate), and dA_log / ddt_bias, which the KDA op overwrites, through
 * an fp32 stage added with lm_cuda_acc_f32.
 * Numerics: every activation between ops is bf16 (GEMM outputs rounded once from fp32);
 * the KDA gradients are bf16 w.r.t. the raw op inputs (kda_cuda.h has their accuracy).
 *
 * Saved by a training forward (b->training = 1), all bf16 [N, *] unless said: pq pk pv
 * (conv inputs), q k v (KDA inputs), fa, g_raw, beta_raw, o, ga, gate, rstd (fp32 [N, H]),
 * y; and the KDA op's saved tensors (lm_kda_cuda_forward_train_buf) in a buffer of this
 * layer, kept across steps. An evaluation forward (b->training = 0) runs
 * lm_kda_cuda_chunk_forward through the same buffers and leaves nothing a backward can
 * use (a backward after it is refused).
 *
 * Memory: lm_gpu_kda_layer_new makes two allocations (lm_cuda_ctx_alloc, counted), sized
 * for max_tokens tokens; every slice 256-byte aligned (r(n) = n rounded up to 256), N =
 * max_tokens:
 *   activations  10 r(2NC) + 2 r(2N Dh) + r(2NH) + r(4NH)
 *   scratch      7 r(2NC) + r(2NH) + r(2N Dh) + r(4Nd) + r(4H) + r(4C)
 *                (dy / the conv input gradient, d_o, dgate, dq dk dv dg, dbeta, dlow,
 *                 the fp32 dx stage, the dA_log and ddt_bias stages)
 *   KDA saved    lm_kda_cuda_saved_bytes_max(N, S, H) with the planned number of sequences
 *                S = max(1, ceil(N / PLAN_DOC_TOKENS)): every batch of up to N tokens in
 *                up to S sequences fits (documents of 256 tokens on average), and so does
 *                a B x T batch with T a multiple of 64 (N / 64 chunks, any B)
 * lm_gpu_kda_layer_bytes is their sum. A training batch whose KDA tensors do not fit the
 * planned buffer (many short documents) makes the forward grow it once (a counted
 * allocation after a stream synchronisation) to the bound for max_tokens tokens in that
 * batch's number of sequences; later batches with no more sequences fit. Nothing else is
 * allocated by forward or backward; the ops' context buffers (the KDA workspaces, the
 * scratch of the conv / norm backward) grow on their first use, outside this count.
 *
 * Errors: LM_ERR_INVALID (message "gpu kda layer <call>: ..." naming the argument and
 * value) for a bad config, a missing weight, gradient or tensor, a batch on another
 * context, B or T < 1, N != B*T, N > max_tokens, bad cu_seqlens, a backward without a
 * matching training forward (B, T, cu_seqlens pointer and count); LM_ERR_UNSUPPORTED for
 * Dh > 128 (the KDA op) or W > LM_CUDA_SHORT_CONV_MAX_W, and without CUDA; LM_ERR_NOMEM /
 * LM_ERR_IO from the ops, their message prefixed with "gpu kda layer <call>: ". Found by
 * validation, an error leaves the outputs and gradients untouched; an op error after the
 * first launch can leave them partly written. Device data is not scanned for NaN / Inf (as
 * in the ops).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/cuda_elementwise.h"
#include "linmoe/cuda_gemm.h"
#include "linmoe/cuda_layers.h"
#include "linmoe/kda_cuda.h"
#include "linmoe/layers.h"
#include "model/gpu_internal.h"

/* K, V limit of the CUDA KDA op (include/linmoe/kda_cuda.h "Limits") */
#define KDA_CUDA_MAX_DH 128
/* the planned mean document length of the KDA saved buffer (see the top comment) */
#define PLAN_DOC_TOKENS 256

struct lm_gpu_kda_layer {
    lm_cuda_ctx *ctx;
    lm_kda_layer_config c;
    int64_t max_tokens;
    void *mem; /* activations + scratch */
    size_t mem_bytes;
    void *kbuf; /* the KDA op's saved tensors */
    size_t kbuf_bytes;
    int plan_seqs;            /* sequences kbuf is planned for (at max_tokens tokens) */
    lm_kda_cuda_saved *saved; /* of the last training forward (borrows kbuf), or NULL */
    /* saved activations (bf16 unless said) */
    void *pq, *pk, *pv, *q, *k, *v, *fa, *graw, *braw, *o, *ga, *gate, *y;
    float *rstd; /* [N, H] fp32 */
    /* backward scratch */
    void *dy, *d_o, *dgate, *dq, *dk, *dv, *dg, *dbeta, *dlow;
    float *dx32, *stage_A, *stage_dt; /* [N, d], [H], [C] fp32 */
    /* the last training forward */
    int have_fwd, B, T, n_cu;
    const int64_t *cu;
};

/* ---------------------------------------------------------------- layout */

typedef struct {
    char *base; /* NULL: sizes only */
    size_t off;
} carve;

static void *take(carve *cv, size_t bytes) {
    void *p = cv->base ? cv->base + cv->off : NULL;
    cv->off += (bytes + 255) & ~(size_t)255;
    return p;
}

/* Bytes of the saved activations (part 0) or of the backward scratch (part 1) for N
 * tokens; with L, sets that part's pointers into base. */
static size_t layout(const lm_kda_layer_config *c, int64_t N, int part, char *base,
                     lm_gpu_kda_layer *L) {
    const size_t n = (size_t)N, C = (size_t)c->H * (size_t)c->Dh, Dh = (size_t)c->Dh,
                 H = (size_t)c->H, d = (size_t)c->d, e = 2 /* bf16 */, f = 4 /* fp32 */;
    carve cv = {base, 0};
    lm_gpu_kda_layer dummy;
    lm_gpu_kda_layer *x = L ? L : &dummy;
    if (part == 0) {
        x->pq = take(&cv, e * n * C);
        x->pk = take(&cv, e * n * C);
        x->pv = take(&cv, e * n * C);
        x->q = take(&cv, e * n * C);
        x->k = take(&cv, e * n * C);
        x->v = take(&cv, e * n * C);
        x->fa = take(&cv, e * n * Dh);
        x->graw = take(&cv, e * n * C);
        x->braw = take(&cv, e * n * H);
        x->o = take(&cv, e * n * C);
        x->ga = take(&cv, e * n * Dh);
        x->gate = take(&cv, e * n * C);
        x->rstd = take(&cv, f * n * H);
        x->y = take(&cv, e * n * C);
        return cv.off;
    }
    x->dy = take(&cv, e * n * C);
    x->d_o = take(&cv, e * n * C);
    x->dgate = take(&cv, e * n * C);
    x->dq = take(&cv, e * n * C);
    x->dk = take(&cv, e * n * C);
    x->dv = take(&cv, e * n * C);
    x->dg = take(&cv, e * n * C);
    x->dbeta = take(&cv, e * n * H);
    x->dlow = take(&cv, e * n * Dh);
    x->dx32 = take(&cv, f * n * d);
    x->stage_A = take(&cv, f * H);
    x->stage_dt = take(&cv, f * C);
    return cv.off;
}

/* Sequences the KDA saved buffer is planned for: the caller's bound, at most one per
 * PLAN_DOC_TOKENS tokens (a batch with more grows the buffer once). */
static int plan_seqs(int64_t max_tokens, int max_seqs) {
    int64_t s = (max_tokens + PLAN_DOC_TOKENS - 1) / PLAN_DOC_TOKENS;
    if (max_seqs > 0 && max_seqs < s)
        s = max_seqs;
    return s < 1 ? 1 : (int)s;
}

/* ---------------------------------------------------------------- checks */

/* The ops' message prefixed with the layer and call (validation messages carry it). */
static lm_status tag(lm_status st, const char *what, lm_error *err) {
    if (st != LM_OK && err) {
        char buf[sizeof(err->msg)];
        snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
        lm_errorf(err, st, "gpu kda layer %s: %s", what, buf);
    }
    return st;
}

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        const lm_status try_st_ = (expr);                                                          \
        if (try_st_ != LM_OK)                                                                      \
            return tag(try_st_, what, err);                                                        \
    } while (0)

static lm_status check_config(const lm_kda_layer_config *c, const char *what, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: config is required", what);
    if (c->d < 1 || c->H < 1 || c->Dh < 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer %s: d = %d, H = %d, Dh = %d must be >= 1", what, c->d, c->H,
                         c->Dh);
    if (c->W < 1 || c->W > LM_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: W = %d outside 1..%d", what, c->W,
                         LM_SHORT_CONV_MAX_W);
    if (c->W > LM_CUDA_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu kda layer %s: W = %d (the CUDA short conv takes at most %d)", what,
                         c->W, LM_CUDA_SHORT_CONV_MAX_W);
    if (c->Dh > KDA_CUDA_MAX_DH)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu kda layer %s: Dh = %d (the CUDA KDA op takes at most %d)", what,
                         c->Dh, KDA_CUDA_MAX_DH);
    if (c->gate != LM_GATE_BOUNDED && c->gate != LM_GATE_SOFTPLUS)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer %s: gate = %d must be BOUNDED or SOFTPLUS", what,
                         (int)c->gate);
    if (c->gate == LM_GATE_BOUNDED && !(c->lower_bound >= -5.0f && c->lower_bound < 0.0f))
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: lower_bound = %g outside [-5, 0)",
                         what, (double)c->lower_bound);
    if (c->chunk_size != 16 && c->chunk_size != 32 && c->chunk_size != 64)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer %s: chunk_size = %d must be 16, 32 or 64", what,
                         c->chunk_size);
    if ((int64_t)c->H * c->Dh > (1 << 30) / 4)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: H*Dh = %lld too large", what,
                         (long long)c->H * c->Dh);
    return LM_OK;
}

static lm_status check_max_tokens(const lm_kda_layer_config *c, int64_t max_tokens,
                                  const char *what, lm_error *err) {
    /* GEMM dims and the ops' token counts are int; N * widest row in int64 */
    if (max_tokens < 1 || max_tokens > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: max_tokens = %lld outside 1..%d",
                         what, (long long)max_tokens, INT32_MAX);
    const int64_t C = (int64_t)c->H * c->Dh, wide = c->d > C ? c->d : C;
    if (max_tokens > INT64_MAX / 8 / wide)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: max_tokens = %lld too large", what,
                         (long long)max_tokens);
    return LM_OK;
}

/* The weights in the order of lm_gpu_kda_weights, with their names. */
enum { NWEIGHT = 15 };

static lm_status check_weights(const lm_gpu_kda_weights *w, const char *what, lm_error *err) {
    if (!w)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: weights are required", what);
    const struct {
        const char *name;
        const void *p;
    } r[NWEIGHT] = {{"q_proj", w->q_proj},     {"k_proj", w->k_proj},     {"v_proj", w->v_proj},
                    {"q_conv1d", w->q_conv1d}, {"k_conv1d", w->k_conv1d}, {"v_conv1d", w->v_conv1d},
                    {"f_a_proj", w->f_a_proj}, {"f_b_proj", w->f_b_proj}, {"A_log", w->A_log},
                    {"dt_bias", w->dt_bias},   {"b_proj", w->b_proj},     {"g_a_proj", w->g_a_proj},
                    {"g_b_proj", w->g_b_proj}, {"o_norm", w->o_norm},     {"o_proj", w->o_proj}};
    for (int i = 0; i < NWEIGHT; i++)
        if (!r[i].p)
            return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: weight '%s' is required", what,
                             r[i].name);
    return LM_OK;
}

static lm_status check_grads(const lm_gpu_kda_grads *g, const char *what, lm_error *err) {
    if (!g)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: grads are required", what);
    const struct {
        const char *name;
        const float *p;
    } r[NWEIGHT] = {{"q_proj", g->q_proj},     {"k_proj", g->k_proj},     {"v_proj", g->v_proj},
                    {"q_conv1d", g->q_conv1d}, {"k_conv1d", g->k_conv1d}, {"v_conv1d", g->v_conv1d},
                    {"f_a_proj", g->f_a_proj}, {"f_b_proj", g->f_b_proj}, {"A_log", g->A_log},
                    {"dt_bias", g->dt_bias},   {"b_proj", g->b_proj},     {"g_a_proj", g->g_a_proj},
                    {"g_b_proj", g->g_b_proj}, {"o_norm", g->o_norm},     {"o_proj", g->o_proj}};
    for (int i = 0; i < NWEIGHT; i++)
        if (!r[i].p)
            return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: gradient '%s' is required",
                             what, r[i].name);
    return LM_OK;
}

/* The batch against the layer, and the short conv config of it (validated: cu_seqlens
 * checked on the host before anything is launched; sets sc->N). */
static lm_status check_batch(const lm_gpu_kda_layer *L, const lm_gpu_batch *b,
                             lm_short_conv_config *sc, const char *what, lm_error *err) {
    if (!L || !b)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer %s: layer and batch are required",
                         what);
    if (b->ctx != L->ctx)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer %s: the batch's context is not the layer's", what);
    if (b->B < 1 || b->T < 1 || b->N != (int64_t)b->B * b->T)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer %s: B = %d, T = %d must be >= 1 with N = B*T (N = %lld)",
                         what, b->B, b->T, (long long)b->N);
    if (b->N > L->max_tokens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer %s: N = %lld tokens > max_tokens = %lld of the layer", what,
                         (long long)b->N, (long long)L->max_tokens);
    lm_short_conv_config_default(sc, b->B, b->T, L->c.H * L->c.Dh, L->c.W);
    sc->cu_seqlens = b->cu_seqlens;
    sc->n_cu_seqlens = b->cu_seqlens ? b->n_cu : 0;
    sc->activation = LM_ACT_SILU;
    TRY(lm_short_conv_config_validate(sc, err));
    return LM_OK;
}

/* kda_layer.c kda_cfg: the op configuration of the layer (the CUDA op takes no ws). */
static void kda_cfg(const lm_kda_layer_config *c, const lm_gpu_batch *b, lm_kda_config *kc) {
    lm_kda_config_default(kc, b->B, b->T, c->H, c->H, c->Dh, c->Dh);
    kc->cu_seqlens = b->cu_seqlens;
    kc->n_cu_seqlens = b->cu_seqlens ? b->n_cu : 0;
    kc->gate = c->gate;
    if (c->gate == LM_GATE_BOUNDED) {
        kc->has_lower_bound = 1;
        kc->lower_bound = c->lower_bound;
    }
    kc->scale = 1.0f / sqrtf((float)c->Dh);
    kc->chunk_size = c->chunk_size;
    kc->use_qk_l2norm_in_kernel = 1;
    kc->use_beta_sigmoid_in_kernel = 1;
    kc->ws = NULL;
}

/* ---------------------------------------------------------------- GEMMs */

/* C[M,N] (bf16, overwritten) = op(A) op(B), row-major */
static lm_status mm_bf16(lm_cuda_ctx *ctx, int ta, int tb, int M, int N, int K, const void *A,
                         int64_t lda, const void *B, int64_t ldb, void *C, int64_t ldc,
                         lm_error *err) {
    return lm_cuda_gemm(ctx, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, LM_CUDA_GEMM_BF16,
                        err);
}

/* C[M,N] (fp32) = op(A) op(B) + beta C, row-major */
static lm_status mm_f32(lm_cuda_ctx *ctx, int ta, int tb, int M, int N, int K, const void *A,
                        int64_t lda, const void *B, int64_t ldb, float beta, float *C, int64_t ldc,
                        lm_error *err) {
    return lm_cuda_gemm(ctx, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc, LM_CUDA_GEMM_F32,
                        err);
}

/* ---------------------------------------------------------------- life cycle */

size_t lm_gpu_kda_layer_bytes(const lm_kda_layer_config *c, int64_t max_tokens, int max_seqs) {
    if (check_config(c, "bytes", NULL) != LM_OK || check_max_tokens(c, max_tokens, "bytes", NULL))
        return 0;
    const size_t kda =
        lm_kda_cuda_saved_bytes_max(max_tokens, plan_seqs(max_tokens, max_seqs), c->H);
    if (kda == 0)
        return 0; /* without CUDA */
    return layout(c, max_tokens, 0, NULL, NULL) + kda;
}

size_t lm_gpu_kda_layer_scratch_bytes(const lm_kda_layer_config *c, int64_t max_tokens) {
    if (check_config(c, "bytes", NULL) != LM_OK || check_max_tokens(c, max_tokens, "bytes", NULL))
        return 0;
    return layout(c, max_tokens, 1, NULL, NULL);
}

lm_status lm_gpu_kda_layer_new(lm_cuda_ctx *ctx, const lm_kda_layer_config *c, int64_t max_tokens,
                               int max_seqs, void *scratch, lm_gpu_kda_layer **out,
                               lm_error *err) {
    const char *what = "new";
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer new: 'out' is required");
    *out = NULL;
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer new: context is required");
    LM_TRY(check_config(c, what, err));
    LM_TRY(check_max_tokens(c, max_tokens, what, err));
    const int S = plan_seqs(max_tokens, max_seqs);
    const size_t kbytes = lm_kda_cuda_saved_bytes_max(max_tokens, S, c->H);
    if (kbytes == 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu kda layer new: no size for the KDA saved tensors (a linmoe built "
                         "without CUDA?)");
    lm_gpu_kda_layer *L = calloc(1, sizeof(*L));
    if (!L)
        return lm_errorf(err, LM_ERR_NOMEM, "gpu kda layer new: host bookkeeping");
    L->ctx = ctx;
    L->c = *c;
    L->max_tokens = max_tokens;
    L->plan_seqs = S;
    const size_t acts = layout(c, max_tokens, 0, NULL, NULL);
    const size_t scr = layout(c, max_tokens, 1, NULL, NULL);
    L->mem_bytes = acts + (scratch ? 0 : scr);
    lm_status st = lm_cuda_ctx_alloc(ctx, &L->mem, L->mem_bytes, err);
    if (st == LM_OK) {
        st = lm_cuda_ctx_alloc(ctx, &L->kbuf, kbytes, err);
        if (st == LM_OK)
            L->kbuf_bytes = kbytes;
    }
    if (st != LM_OK) {
        lm_gpu_kda_layer_free(L);
        return tag(st, what, err);
    }
    layout(c, max_tokens, 0, (char *)L->mem, L);
    layout(c, max_tokens, 1, scratch ? (char *)scratch : (char *)L->mem + acts, L);
    *out = L;
    return LM_OK;
}

void lm_gpu_kda_layer_free(lm_gpu_kda_layer *L) {
    if (!L)
        return;
    lm_kda_cuda_saved_free(L->ctx, L->saved); /* bookkeeping only: kbuf is ours */
    lm_cuda_ctx_free_mem(L->ctx, L->kbuf);
    lm_cuda_ctx_free_mem(L->ctx, L->mem);
    free(L);
}

/* kbuf grown to hold `need` bytes: to the bound for max_tokens tokens in nseq sequences
 * (so that later batches with no more sequences fit). The old buffer is freed first (a
 * stream synchronisation: queued kernels may still read it). */
static lm_status grow_saved(lm_gpu_kda_layer *L, int nseq, size_t need, lm_error *err) {
    const int S = nseq > L->plan_seqs ? nseq : L->plan_seqs;
    size_t bytes = lm_kda_cuda_saved_bytes_max(L->max_tokens, S, L->c.H);
    if (bytes < need)
        bytes = need;
    lm_cuda_ctx_free_mem(L->ctx, L->kbuf);
    L->kbuf = NULL;
    L->kbuf_bytes = 0;
    LM_TRY(lm_cuda_ctx_alloc(L->ctx, &L->kbuf, bytes, err));
    L->kbuf_bytes = bytes;
    L->plan_seqs = S;
    return LM_OK;
}

/* ---------------------------------------------------------------- forward */

lm_status lm_gpu_kda_layer_forward(lm_gpu_kda_layer *L, const lm_gpu_batch *b,
                                   const lm_gpu_kda_weights *w, const void *x, void *out,
                                   lm_error *err) {
    const char *what = "forward";
    lm_short_conv_config sc;
    LM_TRY(check_batch(L, b, &sc, what, err));
    LM_TRY(check_weights(w, what, err));
    if (!x || !out)
        return lm_errorf(err, LM_ERR_INVALID, "gpu kda layer forward: 'x' and 'out' are required");
    lm_cuda_ctx *ctx = L->ctx;
    const lm_kda_layer_config *c = &L->c;
    const int d = c->d, H = c->H, Dh = c->Dh, C = H * Dh, N = (int)b->N;
    const int train = b->training != 0;

    /* the last forward's KDA state is overwritten from here on */
    L->have_fwd = 0;
    lm_kda_cuda_saved_free(ctx, L->saved);
    L->saved = NULL;
    lm_kda_config kc;
    kda_cfg(c, b, &kc);
    if (train) {
        const size_t need = lm_kda_cuda_saved_bytes(&kc);
        if (need > L->kbuf_bytes)
            TRY(grow_saved(L, sc.N, need, err));
    }

    /* q, k, v: projection, short conv + SiLU */
    TRY(mm_bf16(ctx, 0, 1, N, C, d, x, d, w->q_proj, d, L->pq, C, err));
    TRY(mm_bf16(ctx, 0, 1, N, C, d, x, d, w->k_proj, d, L->pk, C, err));
    TRY(mm_bf16(ctx, 0, 1, N, C, d, x, d, w->v_proj, d, L->pv, C, err));
    TRY(lm_cuda_short_conv_forward(ctx, &sc, L->pq, w->q_conv1d, NULL, L->q, NULL, err));
    TRY(lm_cuda_short_conv_forward(ctx, &sc, L->pk, w->k_conv1d, NULL, L->k, NULL, err));
    TRY(lm_cuda_short_conv_forward(ctx, &sc, L->pv, w->v_conv1d, NULL, L->v, NULL, err));

    /* gate (low rank) and beta */
    TRY(mm_bf16(ctx, 0, 1, N, Dh, d, x, d, w->f_a_proj, d, L->fa, Dh, err));
    TRY(mm_bf16(ctx, 0, 1, N, C, Dh, L->fa, Dh, w->f_b_proj, Dh, L->graw, C, err));
    TRY(mm_bf16(ctx, 0, 1, N, H, d, x, d, w->b_proj, d, L->braw, H, err));

    /* the KDA op (the saved object keeps these input pointers for the backward) */
    const lm_kda_cuda_inputs in = {L->q, L->k, L->v, L->graw, L->braw, w->A_log, w->dt_bias, NULL};
    lm_kda_cuda_outputs ko = {L->o, NULL};
    if (train)
        TRY(lm_kda_cuda_forward_train_buf(ctx, &kc, &in, &ko, L->kbuf, L->kbuf_bytes, &L->saved,
                                          err));
    else
        TRY(lm_kda_cuda_chunk_forward(ctx, &kc, &in, &ko, err));

    /* gated head-wise RMSNorm, output projection */
    TRY(mm_bf16(ctx, 0, 1, N, Dh, d, x, d, w->g_a_proj, d, L->ga, Dh, err));
    TRY(mm_bf16(ctx, 0, 1, N, C, Dh, L->ga, Dh, w->g_b_proj, Dh, L->gate, C, err));
    TRY(lm_cuda_gated_rmsnorm_forward(ctx, N, H, Dh, LM_GATED_RMSNORM_EPS, L->o, L->gate, w->o_norm,
                                      L->y, L->rstd, err));
    TRY(mm_bf16(ctx, 0, 1, N, d, C, L->y, C, w->o_proj, C, out, d, err));

    if (train) {
        L->have_fwd = 1;
        L->B = b->B;
        L->T = b->T;
        L->cu = b->cu_seqlens;
        L->n_cu = b->cu_seqlens ? b->n_cu : 0;
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

lm_status lm_gpu_kda_layer_backward(lm_gpu_kda_layer *L, const lm_gpu_batch *b,
                                    const lm_gpu_kda_weights *w, const void *x, const void *dout,
                                    void *dx, const lm_gpu_kda_grads *g, lm_error *err) {
    const char *what = "backward";
    lm_short_conv_config sc;
    LM_TRY(check_batch(L, b, &sc, what, err));
    LM_TRY(check_weights(w, what, err));
    LM_TRY(check_grads(g, what, err));
    if (!x || !dout || !dx)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer backward: 'x', 'dout' and 'dx' are required");
    if (!L->have_fwd || !L->saved || L->B != b->B || L->T != b->T || L->cu != b->cu_seqlens ||
        L->n_cu != (b->cu_seqlens ? b->n_cu : 0))
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu kda layer backward: no matching training forward on this layer "
                         "(B = %d, T = %d)",
                         b->B, b->T);
    lm_cuda_ctx *ctx = L->ctx;
    const lm_kda_layer_config *c = &L->c;
    const int d = c->d, H = c->H, Dh = c->Dh, C = H * Dh, N = (int)b->N;

    /* out = y Wo^T */
    TRY(mm_bf16(ctx, 0, 0, N, C, d, dout, d, w->o_proj, C, L->dy, C, err));
    TRY(mm_f32(ctx, 1, 0, d, C, N, dout, d, L->y, C, 1.0f, g->o_proj, C, err));

    /* gated RMSNorm -> d_o, dgate, do_norm (accumulated) */
    TRY(lm_cuda_gated_rmsnorm_backward(ctx, N, H, Dh, LM_GATED_RMSNORM_EPS, L->o, L->gate,
                                       w->o_norm, L->rstd, L->dy, L->d_o, L->dgate, g->o_norm,
                                       err));
    /* gate = (x Wga^T) Wgb^T; dx32 starts here (beta = 0) */
    TRY(mm_f32(ctx, 1, 0, C, Dh, N, L->dgate, C, L->ga, Dh, 1.0f, g->g_b_proj, Dh, err));
    TRY(mm_bf16(ctx, 0, 0, N, Dh, C, L->dgate, C, w->g_b_proj, Dh, L->dlow, Dh, err));
    TRY(mm_f32(ctx, 1, 0, Dh, d, N, L->dlow, Dh, x, d, 1.0f, g->g_a_proj, d, err));
    TRY(mm_f32(ctx, 0, 0, N, d, Dh, L->dlow, Dh, w->g_a_proj, d, 0.0f, L->dx32, d, err));

    /* the KDA op: dq dk dv dg dbeta (bf16, w.r.t. the raw inputs); dA_log, ddt_bias are
     * written by the op into the stages, then added */
    lm_kda_cuda_grads kg;
    memset(&kg, 0, sizeof kg);
    kg.do_ = L->d_o;
    kg.dq = L->dq;
    kg.dk = L->dk;
    kg.dv = L->dv;
    kg.dg = L->dg;
    kg.dbeta = L->dbeta;
    kg.dA_log = L->stage_A;
    kg.ddt_bias = L->stage_dt;
    TRY(lm_kda_cuda_backward(ctx, L->saved, &kg, err));
    TRY(lm_cuda_acc_f32(ctx, H, L->stage_A, g->A_log, err));
    TRY(lm_cuda_acc_f32(ctx, C, L->stage_dt, g->dt_bias, err));

    /* beta_raw = x Wb^T */
    TRY(mm_f32(ctx, 1, 0, H, d, N, L->dbeta, H, x, d, 1.0f, g->b_proj, d, err));
    TRY(mm_f32(ctx, 0, 0, N, d, H, L->dbeta, H, w->b_proj, d, 1.0f, L->dx32, d, err));

    /* g_raw = (x Wfa^T) Wfb^T */
    TRY(mm_f32(ctx, 1, 0, C, Dh, N, L->dg, C, L->fa, Dh, 1.0f, g->f_b_proj, Dh, err));
    TRY(mm_bf16(ctx, 0, 0, N, Dh, C, L->dg, C, w->f_b_proj, Dh, L->dlow, Dh, err));
    TRY(mm_f32(ctx, 1, 0, Dh, d, N, L->dlow, Dh, x, d, 1.0f, g->f_a_proj, d, err));
    TRY(mm_f32(ctx, 0, 0, N, d, Dh, L->dlow, Dh, w->f_a_proj, d, 1.0f, L->dx32, d, err));

    /* q, k, v: short conv + SiLU (conv weight gradients accumulated by the op), then the
     * projections; dy is free now and takes each conv input gradient in turn */
    const void *pin[3] = {L->pq, L->pk, L->pv};
    const void *dconv_out[3] = {L->dq, L->dk, L->dv};
    const void *cw[3] = {w->q_conv1d, w->k_conv1d, w->v_conv1d};
    const void *pw[3] = {w->q_proj, w->k_proj, w->v_proj};
    float *gcw[3] = {g->q_conv1d, g->k_conv1d, g->v_conv1d};
    float *gpw[3] = {g->q_proj, g->k_proj, g->v_proj};
    for (int i = 0; i < 3; i++) {
        TRY(lm_cuda_short_conv_backward(ctx, &sc, pin[i], cw[i], NULL, dconv_out[i], L->dy, gcw[i],
                                        NULL, err));
        TRY(mm_f32(ctx, 1, 0, C, d, N, L->dy, C, x, d, 1.0f, gpw[i], d, err));
        TRY(mm_f32(ctx, 0, 0, N, d, C, L->dy, C, pw[i], d, 1.0f, L->dx32, d, err));
    }

    /* dx: the six projections' sum, rounded once */
    TRY(lm_cuda_f32_to_bf16(ctx, (int64_t)N * d, L->dx32, dx, err));
    return LM_OK;
}
