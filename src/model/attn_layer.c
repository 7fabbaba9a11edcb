/* Full-attention layer (GQA token mixer): forward and backward, fp32, on the CPU.
 * Math, layouts and contracts: include/linmoe/attn_layer.h. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/attn_layer.h"
#include "model/model_internal.h"

struct lm_attn_layer_ctx {
    float *buf;
    int64_t cap; /* floats in buf */
    /* caller-owned buffers for up to bound_N tokens (the model's memory plan), or NULL */
    float *bound_acts, *bound_scratch;
    int64_t bound_N;
    lm_attention_workspace *ws;
    /* the last forward */
    int have_fwd;
    int B, T, d, Hq, Hkv, Dh;
    lm_attn_position position;
    double rope_theta;
    const int64_t *cu;
    /* saved activations (carved from buf) */
    float *q, *k, *v, *o, *lse;
    /* backward scratch */
    float *d_o, *dq, *dk, *dv;
};

void lm_attn_layer_config_default(lm_attn_layer_config *c, int d, int Hq, int Hkv, int Dh) {
    memset(c, 0, sizeof(*c));
    c->d = d;
    c->Hq = Hq;
    c->Hkv = Hkv;
    c->Dh = Dh;
    c->position = LM_POS_ROPE;
    c->rope_theta = 10000.0;
}

lm_attn_layer_ctx *lm_attn_layer_ctx_new(void) {
    lm_attn_layer_ctx *x = LM_CALLOC(1, sizeof(*x));
    x->ws = lm_attention_workspace_new();
    return x;
}

void lm_attn_layer_ctx_free(lm_attn_layer_ctx *ctx) {
    if (!ctx)
        return;
    lm_attention_workspace_free(ctx->ws);
    free(ctx->buf);
    free(ctx);
}

/* Config and token-count checks shared by forward, backward and infer. */
static lm_status validate_dims(const lm_attn_layer_config *c, int B, int T, const char *what,
                               lm_error *err) {
    if (c->d < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: d = %d must be >= 1", what, c->d);
    if (c->Hq < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: Hq = %d must be >= 1", what, c->Hq);
    if (c->Hkv < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: Hkv = %d must be >= 1", what, c->Hkv);
    if (c->Hq % c->Hkv != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer %s: Hq = %d must be a multiple of Hkv = %d", what, c->Hq,
                         c->Hkv);
    if (c->Dh < 1 || c->Dh > 1024)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: Dh = %d outside 1..1024", what,
                         c->Dh);
    if (c->position != LM_POS_ROPE && c->position != LM_POS_NOPE)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: position = %d must be ROPE or NOPE",
                         what, (int)c->position);
    if (c->position == LM_POS_ROPE) {
        if (c->Dh % 2 != 0)
            return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: Dh = %d must be even with RoPE",
                             what, c->Dh);
        if (!(isfinite(c->rope_theta) && c->rope_theta > 0.0))
            return lm_errorf(err, LM_ERR_INVALID,
                             "attn_layer %s: rope_theta = %g must be finite and > 0", what,
                             c->rope_theta);
    }
    if (B < 1 || T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: B = %d, T = %d must be >= 1", what, B,
                         T);
    if ((int64_t)c->Hq * c->Dh > (1 << 30) / 4)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: Hq*Dh = %lld too large", what,
                         (long long)c->Hq * c->Dh);
    /* token-row offsets (B*T times the widest row) are formed in int by the projections */
    const int64_t wide = c->d > c->Hq * c->Dh ? c->d : (int64_t)c->Hq * c->Dh;
    if ((int64_t)B * T * wide > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: B*T = %lld tokens too many", what,
                         (long long)B * T);
    return LM_OK;
}

static lm_status validate(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                          const lm_attn_layer_weights *w, const float *x, const char *what,
                          lm_error *err) {
    if (!c || !b || !w)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer %s: config, batch and weights are required", what);
    LM_TRY(validate_dims(c, b->B, b->T, what, err));
    if (b->cu_seqlens) {
        if (b->B != 1)
            return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: B = %d must be 1 with cu_seqlens",
                             what, b->B);
        if (b->n_cu_seqlens < 2)
            return lm_errorf(err, LM_ERR_INVALID, "attn_layer %s: n_cu_seqlens = %d must be >= 2",
                             what, b->n_cu_seqlens);
        if (b->cu_seqlens[0] != 0 || b->cu_seqlens[b->n_cu_seqlens - 1] != b->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attn_layer %s: cu_seqlens must start at 0 and end at T = %d", what,
                             b->T);
        for (int i = 1; i < b->n_cu_seqlens; i++)
            if (b->cu_seqlens[i] < b->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "attn_layer %s: cu_seqlens[%d] = %lld decreases", what, i,
                                 (long long)b->cu_seqlens[i]);
    }
    const int64_t d = c->d, Cq = (int64_t)c->Hq * c->Dh, Ckv = (int64_t)c->Hkv * c->Dh;
    LM_TRY(lm_model_check_finite("attn_layer", what, "x", x, (int64_t)b->B * b->T * d, err));
    LM_TRY(lm_model_check_finite("attn_layer", what, "q_proj", w->q_proj, Cq * d, err));
    LM_TRY(lm_model_check_finite("attn_layer", what, "k_proj", w->k_proj, Ckv * d, err));
    LM_TRY(lm_model_check_finite("attn_layer", what, "v_proj", w->v_proj, Ckv * d, err));
    LM_TRY(lm_model_check_finite("attn_layer", what, "o_proj", w->o_proj, d * Cq, err));
    return LM_OK;
}

#define PAD16(n) ((((n) + 15) / 16) * 16) /* 64-byte aligned slices */

int64_t lm_attn_layer_act_floats(const lm_attn_layer_config *c, int64_t N) {
    const int64_t Cq = (int64_t)c->Hq * c->Dh, Ckv = (int64_t)c->Hkv * c->Dh;
    return 2 * PAD16(N * Cq) + 2 * PAD16(N * Ckv) + PAD16(N * c->Hq);
}

int64_t lm_attn_layer_scratch_floats(const lm_attn_layer_config *c, int64_t N) {
    const int64_t Cq = (int64_t)c->Hq * c->Dh, Ckv = (int64_t)c->Hkv * c->Dh;
    return 2 * PAD16(N * Cq) + 2 * PAD16(N * Ckv);
}

void lm_attn_layer_ctx_bind(lm_attn_layer_ctx *ctx, int64_t N, float *acts, float *scratch) {
    ctx->bound_N = N;
    ctx->bound_acts = acts;
    ctx->bound_scratch = scratch;
}

/* Carve the saved activations and the backward scratch for N tokens from the
 * caller's buffers (lm_attn_layer_ctx_bind, N within the bound) or the context's own
 * grow-only buffer (allocates only on growth). */
static void ctx_carve(lm_attn_layer_ctx *x, int64_t N, int64_t Cq, int64_t Ckv, int64_t Hq) {
    lm_attn_layer_config dims;
    memset(&dims, 0, sizeof dims);
    dims.Hq = (int)Hq;
    dims.Hkv = (int)(Ckv / (Cq / Hq));
    dims.Dh = (int)(Cq / Hq);
    LM_CHECK((int64_t)dims.Hkv * dims.Dh == Ckv);
    float *pa, *ps;
    if (x->bound_acts && x->bound_scratch && N <= x->bound_N) {
        pa = x->bound_acts;
        ps = x->bound_scratch;
    } else {
        const int64_t na = lm_attn_layer_act_floats(&dims, N);
        const int64_t need = na + lm_attn_layer_scratch_floats(&dims, N);
        if (need > x->cap) {
            free(x->buf);
            x->buf = LM_MALLOC((size_t)need * sizeof(float));
            x->cap = need;
        }
        pa = x->buf;
        ps = x->buf + na;
    }
    float *p = pa;
#define TAKE(f, n)                                                                                 \
    do {                                                                                           \
        x->f = p;                                                                                  \
        p += PAD16(n); /* 64 B align */                                                            \
    } while (0)
    TAKE(q, N * Cq);
    TAKE(k, N * Ckv);
    TAKE(v, N * Ckv);
    TAKE(o, N * Cq);
    TAKE(lse, N * Hq);
    LM_CHECK(p == pa + lm_attn_layer_act_floats(&dims, N));
    p = ps;
    TAKE(d_o, N * Cq);
    TAKE(dq, N * Cq);
    TAKE(dk, N * Ckv);
    TAKE(dv, N * Ckv);
    LM_CHECK(p == ps + lm_attn_layer_scratch_floats(&dims, N));
#undef TAKE
}

static void attn_cfg(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                     lm_attn_layer_ctx *ctx, lm_attention_config *ac) {
    lm_attention_config_default(ac, b->B, b->T, c->Hq, c->Hkv, c->Dh);
    ac->cu_seqlens = b->cu_seqlens;
    ac->n_cu_seqlens = b->n_cu_seqlens;
    ac->scale = 1.0f / sqrtf((float)c->Dh);
    ac->causal = 1;
    ac->position = c->position;
    ac->rope_theta = c->rope_theta;
    ac->ws = ctx->ws;
}

lm_status lm_attn_layer_ctx_reserve(const lm_attn_layer_config *c, int64_t N,
                                    lm_attn_layer_ctx *ctx, lm_error *err) {
    if (!c || !ctx || N < 1 || N > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer reserve: config, ctx and N >= 1");
    LM_TRY(validate_dims(c, 1, (int)N, "reserve", err));
    const int64_t Cq = (int64_t)c->Hq * c->Dh, Ckv = (int64_t)c->Hkv * c->Dh;
    ctx->have_fwd = 0;
    ctx_carve(ctx, N, Cq, Ckv, c->Hq);
    memset(ctx->q, 0, sizeof(float) * (size_t)(N * Cq));
    memset(ctx->k, 0, sizeof(float) * (size_t)(N * Ckv));
    memset(ctx->v, 0, sizeof(float) * (size_t)(N * Ckv));
    memset(ctx->o, 0, sizeof(float) * (size_t)(N * Cq));
    memset(ctx->lse, 0, sizeof(float) * (size_t)(N * c->Hq));
    memset(ctx->d_o, 0, sizeof(float) * (size_t)(N * Cq));
    const lm_attn_layer_batch one = {1, (int)N, NULL, 0};
    lm_attention_config ac;
    lm_attention_inputs in = {ctx->q, ctx->k, ctx->v};
    if (c->position == LM_POS_ROPE) {
        /* the RoPE table of positions 0..N-1: one document of N tokens, one head */
        lm_attn_layer_config c1 = *c;
        c1.Hq = c1.Hkv = 1;
        attn_cfg(&c1, &one, ctx, &ac);
        LM_TRY(lm_attention_forward(&ac, &in, ctx->o, NULL, err));
    }
    /* the buffer: N documents of one token, every head, backward */
    int64_t *cu = LM_MALLOC(sizeof(int64_t) * (size_t)(N + 1));
    for (int64_t j = 0; j <= N; j++)
        cu[j] = j;
    const lm_attn_layer_batch docs = {1, (int)N, cu, (int)N + 1};
    attn_cfg(c, &docs, ctx, &ac);
    lm_attention_grads ag = {ctx->d_o, ctx->dq, ctx->dk, ctx->dv};
    const lm_status st = lm_attention_backward(&ac, &in, ctx->o, ctx->lse, &ag, err);
    free(cu);
    return st;
}

lm_status lm_attn_layer_forward(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                                const lm_attn_layer_weights *w, const float *x, float *out,
                                lm_attn_layer_ctx *ctx, lm_error *err) {
    LM_TRY(validate(c, b, w, x, "forward", err));
    if (!out || !ctx)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer forward: 'out' and 'ctx' are required");
    const int d = c->d, Cq = c->Hq * c->Dh, Ckv = c->Hkv * c->Dh;
    const int N = b->B * b->T;
    ctx->have_fwd = 0;
    ctx_carve(ctx, N, Cq, Ckv, c->Hq);

    /* projections */
    lm_model_mm(0, 1, N, Cq, d, x, d, w->q_proj, d, 0, ctx->q, Cq);
    lm_model_mm(0, 1, N, Ckv, d, x, d, w->k_proj, d, 0, ctx->k, Ckv);
    lm_model_mm(0, 1, N, Ckv, d, x, d, w->v_proj, d, 0, ctx->v, Ckv);

    /* the attention op (RoPE / NoPE inside) */
    lm_attention_config ac;
    attn_cfg(c, b, ctx, &ac);
    lm_attention_inputs in = {ctx->q, ctx->k, ctx->v};
    LM_TRY(lm_attention_forward(&ac, &in, ctx->o, ctx->lse, err));

    /* output projection */
    lm_model_mm(0, 1, N, d, Cq, ctx->o, Cq, w->o_proj, Cq, 0, out, d);

    ctx->have_fwd = 1;
    ctx->B = b->B;
    ctx->T = b->T;
    ctx->d = d;
    ctx->Hq = c->Hq;
    ctx->Hkv = c->Hkv;
    ctx->Dh = c->Dh;
    ctx->position = c->position;
    ctx->rope_theta = c->rope_theta;
    ctx->cu = b->cu_seqlens;
    return LM_OK;
}

lm_status lm_attn_layer_backward(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                                 const lm_attn_layer_weights *w, const float *x, const float *dout,
                                 float *dx, const lm_attn_layer_grads *g, lm_attn_layer_ctx *ctx,
                                 lm_error *err) {
    return lm_attn_layer_backward_acc(c, b, w, x, dout, dx, g, 0, ctx, err);
}

lm_status lm_attn_layer_backward_acc(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                                     const lm_attn_layer_weights *w, const float *x,
                                     const float *dout, float *dx, const lm_attn_layer_grads *g,
                                     int accumulate, lm_attn_layer_ctx *ctx, lm_error *err) {
    const int acc = accumulate ? 1 : 0; /* weight gradients: GEMM beta = acc */
    LM_TRY(validate(c, b, w, x, "backward", err));
    if (!ctx || !g)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer backward: 'ctx' and 'grads' are required");
    if (!ctx->have_fwd || ctx->B != b->B || ctx->T != b->T || ctx->d != c->d || ctx->Hq != c->Hq ||
        ctx->Hkv != c->Hkv || ctx->Dh != c->Dh || ctx->position != c->position ||
        ctx->rope_theta != c->rope_theta || ctx->cu != b->cu_seqlens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer backward: no matching forward on this ctx (B=%d T=%d)", b->B,
                         b->T);
    const int d = c->d, Cq = c->Hq * c->Dh, Ckv = c->Hkv * c->Dh;
    const int N = b->B * b->T;
    LM_TRY(lm_model_check_finite("attn_layer", "backward", "dout", dout, (int64_t)N * d, err));
    const struct {
        const char *name;
        float *p;
    } req[] = {{"grads.q_proj", g->q_proj},
               {"grads.k_proj", g->k_proj},
               {"grads.v_proj", g->v_proj},
               {"grads.o_proj", g->o_proj}};
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++)
        if (!req[i].p)
            return lm_errorf(err, LM_ERR_INVALID, "attn_layer backward: '%s' is required",
                             req[i].name);

    /* out = o Wo^T */
    lm_model_mm(0, 0, N, Cq, d, dout, d, w->o_proj, Cq, 0, ctx->d_o, Cq);
    lm_model_mm(1, 0, d, Cq, N, dout, d, ctx->o, Cq, acc, g->o_proj, Cq);

    /* the attention op */
    lm_attention_config ac;
    attn_cfg(c, b, ctx, &ac);
    lm_attention_inputs in = {ctx->q, ctx->k, ctx->v};
    lm_attention_grads ag = {ctx->d_o, ctx->dq, ctx->dk, ctx->dv};
    LM_TRY(lm_attention_backward(&ac, &in, ctx->o, ctx->lse, &ag, err));

    /* q, k, v projections */
    lm_model_mm(1, 0, Cq, d, N, ctx->dq, Cq, x, d, acc, g->q_proj, d);
    lm_model_mm(1, 0, Ckv, d, N, ctx->dk, Ckv, x, d, acc, g->k_proj, d);
    lm_model_mm(1, 0, Ckv, d, N, ctx->dv, Ckv, x, d, acc, g->v_proj, d);
    if (dx) {
        lm_model_mm(0, 0, N, d, Cq, ctx->dq, Cq, w->q_proj, d, 0, dx, d);
        lm_model_mm(0, 0, N, d, Ckv, ctx->dk, Ckv, w->k_proj, d, 1, dx, d);
        lm_model_mm(0, 0, N, d, Ckv, ctx->dv, Ckv, w->v_proj, d, 1, dx, d);
    }
    return LM_OK;
}

/* Inference. Keys and values of the new tokens go to the cache first, so every new
 * token finds positions 0..its own there. pos == 0 needs no cache read: the causal
 * forward over the T tokens is the same attention. pos > 0 runs one decode step per
 * new token over the cache (a chunked prefill against a cache is not implemented). */
lm_status lm_attn_layer_infer(const lm_attn_layer_config *c, int B, int T, int64_t pos,
                              const lm_attn_layer_weights *w, const float *x, float *out,
                              lm_attn_layer_cache *kv, lm_attn_layer_ctx *ctx, lm_error *err) {
    if (!c || !w)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer infer: config and weights are required");
    LM_TRY(validate_dims(c, B, T, "infer", err));
    if (!out || !ctx || !kv)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer infer: 'out', 'ctx' and the cache 'kv' are required");
    if (!kv->k_cache || !kv->v_cache)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer infer: 'kv.%s' [B, Tmax, Hkv, Dh] is required",
                         !kv->k_cache ? "k_cache" : "v_cache");
    if (kv->Tmax < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer infer: kv.Tmax = %lld must be >= 1",
                         (long long)kv->Tmax);
    if (kv->pos_rows) {
        if (T != 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attn_layer infer: kv.pos_rows (a position per row) needs T = 1, "
                             "got T = %d",
                             T);
        pos = 1; /* not read below: the ops take every row's own position */
    }
    if (pos < 0)
        return lm_errorf(err, LM_ERR_INVALID, "attn_layer infer: pos = %lld must be >= 0",
                         (long long)pos);
    if (!kv->pos_rows && pos > kv->Tmax - T)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer infer: pos + T = %lld + %d exceeds kv.Tmax = %lld",
                         (long long)pos, T, (long long)kv->Tmax);
    if ((int64_t)B * kv->Tmax * c->Hkv * c->Dh > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attn_layer infer: cache too large (B*Tmax*Hkv*Dh with Tmax = %lld)",
                         (long long)kv->Tmax);
    /* Weights: presence only. A finiteness scan would read every weight a second time
     * per decode step (the step is bound by that one read); lm_attn_layer_forward
     * scans them, the caller checks them once after loading. */
    const struct {
        const char *name;
        const float *p;
    } req[] = {
        {"q_proj", w->q_proj}, {"k_proj", w->k_proj}, {"v_proj", w->v_proj}, {"o_proj", w->o_proj}};
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++)
        if (!req[i].p)
            return lm_errorf(err, LM_ERR_INVALID, "attn_layer infer: '%s' is required",
                             req[i].name);
    LM_TRY(lm_model_check_finite("attn_layer", "infer", "x", x, (int64_t)B * T * c->d, err));

    const int d = c->d, Cq = c->Hq * c->Dh, Ckv = c->Hkv * c->Dh;
    const int N = B * T;
    /* infer reuses the activation buffers: a backward now needs a new forward first */
    ctx->have_fwd = 0;
    ctx_carve(ctx, N, Cq, Ckv, c->Hq);

    /* projections */
    lm_model_mm_infer(N, Cq, d, x, d, w->q_proj, d, 0, ctx->q, Cq);
    lm_model_mm_infer(N, Ckv, d, x, d, w->k_proj, d, 0, ctx->k, Ckv);
    lm_model_mm_infer(N, Ckv, d, x, d, w->v_proj, d, 0, ctx->v, Ckv);

    /* k (rotated) and v of the new tokens into the cache at pos .. pos+T-1 */
    const lm_attn_layer_batch b = {B, T, NULL, 0};
    lm_attention_config ac;
    attn_cfg(c, &b, ctx, &ac);
    ac.pos_rows = kv->pos_rows;
    LM_TRY(lm_attention_cache_write(&ac, kv->Tmax, pos, ctx->k, ctx->v, kv->k_cache, kv->v_cache,
                                    err));

    if (pos == 0) {
        lm_attention_inputs in = {ctx->q, ctx->k, ctx->v};
        LM_TRY(lm_attention_forward(&ac, &in, ctx->o, NULL, err));
    } else {
        lm_attention_config a1;
        const lm_attn_layer_batch b1 = {B, 1, NULL, 0};
        attn_cfg(c, &b1, ctx, &a1);
        a1.pos_rows = kv->pos_rows;
        for (int t = 0; t < T; t++) {
            /* decode takes q [B, 1, Hq, Dh] contiguous: with T > 1 the rows of token t
             * are gathered (into the backward's free dq / d_o scratch) and o scattered */
            const float *qt = ctx->q;
            float *ot = ctx->o;
            if (T > 1) {
                for (int r = 0; r < B; r++)
                    memcpy(ctx->dq + (size_t)r * Cq, ctx->q + ((size_t)r * T + t) * Cq,
                           sizeof(float) * (size_t)Cq);
                qt = ctx->dq;
                ot = ctx->d_o;
            }
            LM_TRY(lm_attention_decode(&a1, kv->Tmax, pos + t, qt, kv->k_cache, kv->v_cache, ot,
                                       NULL, err));
            if (T > 1)
                for (int r = 0; r < B; r++)
                    memcpy(ctx->o + ((size_t)r * T + t) * Cq, ctx->d_o + (size_t)r * Cq,
                           sizeof(float) * (size_t)Cq);
        }
    }

    /* output projection */
    lm_model_mm_infer(N, d, Cq, ctx->o, Cq, w->o_proj, Cq, 0, out, d);
    return LM_OK;
}
