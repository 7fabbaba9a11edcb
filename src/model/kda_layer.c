/* KDA layer (Kimi Linear token mixer): forward and backward, fp32, on the CPU.
 * Math, layouts and contracts: include/linmoe/kda_layer.h. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/kda_layer.h"
#include "linmoe/layers.h"
#include "model/model_internal.h"

struct lm_kda_layer_ctx {
    float *buf;
    int64_t cap; /* floats in buf */
    lm_kda_workspace *ws;
    int own_ws; /* ws is this context's (else the model's, lm_kda_layer_ctx_bind) */
    /* caller-owned buffers for up to bound_N tokens (the model's memory plan), or NULL */
    float *bound_acts, *bound_scratch, *stage;
    int64_t bound_N;
    float *h0_buf; /* inference state copy, own, grow-only */
    int64_t h0_cap;
    /* the last forward */
    int have_fwd;
    int B, T, d, H, Dh, W;
    const int64_t *cu;
    /* saved activations (carved from buf) */
    float *pq, *pk, *pv, *q, *k, *v, *fa, *graw, *braw, *o, *ga, *gate, *rstd, *y;
    /* backward scratch (norm_ws: the gated RMSNorm backward's fp64 partials) */
    float *dy, *d_o, *dgate, *dq, *dk, *dv, *dg, *dbeta, *dlow, *norm_ws;
    /* inference: a copy of the recurrent state entering a prefill (the chunked op does
     * not promise that initial_state and final_state may alias) */
    float *h0;
};

void lm_kda_layer_config_default(lm_kda_layer_config *c, int d, int H, int Dh) {
    memset(c, 0, sizeof(*c));
    c->d = d;
    c->H = H;
    c->Dh = Dh;
    c->W = 4;
    c->gate = LM_GATE_SOFTPLUS;
    c->lower_bound = -5.0f;
    c->chunk_size = 64;
}

lm_kda_layer_ctx *lm_kda_layer_ctx_new(void) {
    lm_kda_layer_ctx *x = LM_CALLOC(1, sizeof(*x));
    x->ws = lm_kda_workspace_new();
    x->own_ws = 1;
    return x;
}

void lm_kda_layer_ctx_free(lm_kda_layer_ctx *ctx) {
    if (!ctx) return;
    if (ctx->own_ws)
        lm_kda_workspace_free(ctx->ws);
    free(ctx->buf);
    free(ctx->h0_buf);
    free(ctx);
}

/* 64-byte aligned slices: every buffer is rounded up to 16 floats */
#define PAD16(n) ((((n) + 15) / 16) * 16)

int64_t lm_kda_layer_act_floats(const lm_kda_layer_config *c, int64_t N) {
    const int64_t C = (int64_t)c->H * c->Dh;
    return 10 * PAD16(N * C) + 2 * PAD16(N * c->Dh) + 2 * PAD16(N * c->H);
}

/* Floats of the gated RMSNorm backward's scratch (fp64: the slices are 64-byte
 * aligned). */
static int64_t norm_ws_floats(int64_t N, int64_t H, int64_t Dh) {
    return (lm_gated_rmsnorm_backward_ws_bytes(N, (int)H, (int)Dh) + 3) / 4;
}

int64_t lm_kda_layer_scratch_floats(const lm_kda_layer_config *c, int64_t N) {
    const int64_t C = (int64_t)c->H * c->Dh;
    return 7 * PAD16(N * C) + PAD16(N * c->H) + PAD16(N * c->Dh) +
           PAD16(norm_ws_floats(N, c->H, c->Dh));
}

int64_t lm_kda_layer_stage_floats(const lm_kda_layer_config *c) {
    /* the largest weight gradient an overwriting op writes: a conv kernel [C, W],
     * dt_bias [C] + A_log [H], o_norm [Dh] */
    const int64_t C = (int64_t)c->H * c->Dh, a = C * c->W, b = C + c->H;
    const int64_t m = a > b ? a : b;
    return m > c->Dh ? m : c->Dh;
}

void lm_kda_layer_ctx_bind(lm_kda_layer_ctx *ctx, int64_t N, float *acts, float *scratch,
                           float *stage, lm_kda_workspace *ws) {
    ctx->bound_N = N;
    ctx->bound_acts = acts;
    ctx->bound_scratch = scratch;
    ctx->stage = stage;
    if (ws) {
        if (ctx->own_ws)
            lm_kda_workspace_free(ctx->ws);
        ctx->ws = ws;
        ctx->own_ws = 0;
    }
}

/* Config and token-count checks shared by forward, backward and infer. */
static lm_status validate_dims(const lm_kda_layer_config *c, int B, int T, const char *what,
                               lm_error *err) {
    if (c->d < 1) return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: d = %d must be >= 1", what, c->d);
    if (c->H < 1) return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: H = %d must be >= 1", what, c->H);
    if (c->Dh < 1)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: Dh = %d must be >= 1", what, c->Dh);
    if (c->W < 1 || c->W > LM_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: W = %d outside 1..%d", what, c->W,
                         LM_SHORT_CONV_MAX_W);
    if (c->gate != LM_GATE_BOUNDED && c->gate != LM_GATE_SOFTPLUS)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: gate = %d must be BOUNDED or SOFTPLUS",
                         what, (int)c->gate);
    if (c->gate == LM_GATE_BOUNDED && !(c->lower_bound >= -5.0f && c->lower_bound < 0.0f))
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: lower_bound = %g outside [-5, 0)", what,
                         (double)c->lower_bound);
    if (B < 1 || T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: B = %d, T = %d must be >= 1", what, B,
                         T);
    if ((int64_t)c->H * c->Dh > (1 << 30) / 4)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: H*Dh = %lld too large", what,
                         (long long)c->H * c->Dh);
    /* token-row offsets (B*T times the widest row) are formed in int by the projections */
    const int64_t wide = c->d > c->H * c->Dh ? c->d : (int64_t)c->H * c->Dh;
    if ((int64_t)B * T * wide > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: B*T = %lld tokens too many", what,
                         (long long)B * T);
    return LM_OK;
}

/* The weights with their element counts, in the order of lm_kda_layer_weights. */
enum { NWEIGHT = 15 };
typedef struct {
    const char *name;
    const float *p;
    int64_t n;
} weight_ref;

static void weight_list(const lm_kda_layer_config *c, const lm_kda_layer_weights *w,
                        weight_ref r[NWEIGHT]) {
    const int64_t d = c->d, C = (int64_t)c->H * c->Dh, Dh = c->Dh, H = c->H, W = c->W;
    const weight_ref t[NWEIGHT] = {{"q_proj", w->q_proj, C * d},
                                   {"k_proj", w->k_proj, C * d},
                                   {"v_proj", w->v_proj, C * d},
                                   {"q_conv1d", w->q_conv1d, C * W},
                                   {"k_conv1d", w->k_conv1d, C * W},
                                   {"v_conv1d", w->v_conv1d, C * W},
                                   {"f_a_proj", w->f_a_proj, Dh * d},
                                   {"f_b_proj", w->f_b_proj, C * Dh},
                                   {"A_log", w->A_log, H},
                                   {"dt_bias", w->dt_bias, C},
                                   {"b_proj", w->b_proj, H * d},
                                   {"g_a_proj", w->g_a_proj, Dh * d},
                                   {"g_b_proj", w->g_b_proj, C * Dh},
                                   {"o_norm", w->o_norm, Dh},
                                   {"o_proj", w->o_proj, d * C}};
    memcpy(r, t, sizeof(t));
}

static lm_status validate(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                          const lm_kda_layer_weights *w, const float *x, const char *what,
                          lm_error *err) {
    if (!c || !b || !w)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda_layer %s: config, batch and weights are required", what);
    LM_TRY(validate_dims(c, b->B, b->T, what, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "x", x, (int64_t)b->B * b->T * c->d, err));
    weight_ref r[NWEIGHT];
    weight_list(c, w, r);
    for (int i = 0; i < NWEIGHT; i++)
        LM_TRY(lm_model_check_finite("kda_layer", what, r[i].name, r[i].p, r[i].n, err));
    return LM_OK;
}

/* Carve the saved activations and the backward scratch for N tokens from the
 * caller's buffers (lm_kda_layer_ctx_bind, N within the bound) or the context's own
 * grow-only buffer, and n_h0 floats of state copy (inference only) from its own
 * grow-only buffer. Allocates only on growth of an own buffer. */
static void ctx_carve(lm_kda_layer_ctx *x, int64_t N, int64_t C, int64_t Dh, int64_t H,
                      int64_t n_h0) {
    lm_kda_layer_config dims;
    memset(&dims, 0, sizeof dims);
    dims.H = (int)H;
    dims.Dh = (int)Dh;
    LM_CHECK(C == H * Dh);
    float *pa, *ps;
    if (x->bound_acts && x->bound_scratch && N <= x->bound_N) {
        pa = x->bound_acts;
        ps = x->bound_scratch;
    } else {
        const int64_t na = lm_kda_layer_act_floats(&dims, N);
        const int64_t need = na + lm_kda_layer_scratch_floats(&dims, N);
        if (need > x->cap) {
            free(x->buf);
            x->buf = LM_MALLOC((size_t)need * sizeof(float));
            x->cap = need;
        }
        pa = x->buf;
        ps = x->buf + na;
    }
    if (n_h0 > x->h0_cap) {
        free(x->h0_buf);
        x->h0_buf = LM_MALLOC((size_t)n_h0 * sizeof(float));
        x->h0_cap = n_h0;
    }
    x->h0 = x->h0_buf;
    float *p = pa;
#define TAKE(f, n)                                                                                 \
    do {                                                                                           \
        x->f = p;                                                                                  \
        p += PAD16(n); /* 64 B align */                                                            \
    } while (0)
    TAKE(pq, N * C);
    TAKE(pk, N * C);
    TAKE(pv, N * C);
    TAKE(q, N * C);
    TAKE(k, N * C);
    TAKE(v, N * C);
    TAKE(fa, N * Dh);
    TAKE(graw, N * C);
    TAKE(braw, N * H);
    TAKE(o, N * C);
    TAKE(ga, N * Dh);
    TAKE(gate, N * C);
    TAKE(rstd, N * H);
    TAKE(y, N * C);
    LM_CHECK(p == pa + lm_kda_layer_act_floats(&dims, N));
    p = ps;
    TAKE(dy, N * C);
    TAKE(d_o, N * C);
    TAKE(dgate, N * C);
    TAKE(dq, N * C);
    TAKE(dk, N * C);
    TAKE(dv, N * C);
    TAKE(dg, N * C);
    TAKE(dbeta, N * H);
    TAKE(dlow, N * Dh);
    TAKE(norm_ws, norm_ws_floats(N, H, Dh));
    LM_CHECK(p == ps + lm_kda_layer_scratch_floats(&dims, N));
#undef TAKE
}

static void kda_cfg(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                    lm_kda_layer_ctx *ctx, lm_kda_config *kc) {
    lm_kda_config_default(kc, b->B, b->T, c->H, c->H, c->Dh, c->Dh);
    kc->cu_seqlens = b->cu_seqlens;
    kc->n_cu_seqlens = b->n_cu_seqlens;
    kc->gate = c->gate;
    if (c->gate == LM_GATE_BOUNDED) {
        kc->has_lower_bound = 1;
        kc->lower_bound = c->lower_bound;
    }
    kc->scale = 1.0f / sqrtf((float)c->Dh);
    kc->chunk_size = c->chunk_size;
    kc->use_qk_l2norm_in_kernel = 1;
    kc->use_beta_sigmoid_in_kernel = 1;
    kc->ws = ctx->ws;
}

static void conv_cfg(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                     lm_short_conv_config *sc) {
    lm_short_conv_config_default(sc, b->B, b->T, c->H * c->Dh, c->W);
    sc->cu_seqlens = b->cu_seqlens;
    sc->n_cu_seqlens = b->n_cu_seqlens;
    sc->activation = LM_ACT_SILU;
}

lm_status lm_kda_layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                               const lm_kda_layer_weights *w, const float *x, float *out,
                               lm_kda_layer_ctx *ctx, lm_error *err) {
    LM_TRY(validate(c, b, w, x, "forward", err));
    if (!out || !ctx)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer forward: 'out' and 'ctx' are required");
    const int d = c->d, H = c->H, Dh = c->Dh, C = H * Dh;
    const int N = b->B * b->T;
    ctx->have_fwd = 0;
    ctx_carve(ctx, N, C, Dh, H, 0);

    /* q, k, v: projection, short conv + SiLU */
    lm_model_mm(0, 1, N, C, d, x, d, w->q_proj, d, 0, ctx->pq, C);
    lm_model_mm(0, 1, N, C, d, x, d, w->k_proj, d, 0, ctx->pk, C);
    lm_model_mm(0, 1, N, C, d, x, d, w->v_proj, d, 0, ctx->pv, C);
    lm_short_conv_config sc;
    conv_cfg(c, b, &sc);
    LM_TRY(lm_short_conv_forward(&sc, ctx->pq, w->q_conv1d, NULL, ctx->q, NULL, err));
    LM_TRY(lm_short_conv_forward(&sc, ctx->pk, w->k_conv1d, NULL, ctx->k, NULL, err));
    LM_TRY(lm_short_conv_forward(&sc, ctx->pv, w->v_conv1d, NULL, ctx->v, NULL, err));

    /* gate (low rank) and beta */
    lm_model_mm(0, 1, N, Dh, d, x, d, w->f_a_proj, d, 0, ctx->fa, Dh);
    lm_model_mm(0, 1, N, C, Dh, ctx->fa, Dh, w->f_b_proj, Dh, 0, ctx->graw, C);
    lm_model_mm(0, 1, N, H, d, x, d, w->b_proj, d, 0, ctx->braw, H);

    /* the KDA op */
    lm_kda_config kc;
    kda_cfg(c, b, ctx, &kc);
    lm_kda_inputs in = {ctx->q, ctx->k, ctx->v, ctx->graw, ctx->braw, w->A_log, w->dt_bias, NULL};
    lm_kda_outputs ko = {ctx->o, NULL};
    LM_TRY(lm_kda_chunk_forward(&kc, &in, &ko, err));

    /* gated head-wise RMSNorm, output projection */
    lm_model_mm(0, 1, N, Dh, d, x, d, w->g_a_proj, d, 0, ctx->ga, Dh);
    lm_model_mm(0, 1, N, C, Dh, ctx->ga, Dh, w->g_b_proj, Dh, 0, ctx->gate, C);
    LM_TRY(lm_gated_rmsnorm_forward(N, H, Dh, LM_GATED_RMSNORM_EPS, ctx->o, ctx->gate, w->o_norm,
                                    ctx->y, ctx->rstd, err));
    lm_model_mm(0, 1, N, d, C, ctx->y, C, w->o_proj, C, 0, out, d);

    ctx->have_fwd = 1;
    ctx->B = b->B;
    ctx->T = b->T;
    ctx->d = d;
    ctx->H = H;
    ctx->Dh = Dh;
    ctx->W = c->W;
    ctx->cu = b->cu_seqlens;
    return LM_OK;
}

/* dst[i] += src[i] (a staged weight gradient of an op that overwrites, model.c) */
static void add_small(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        dst[i] += src[i];
}

lm_status lm_kda_layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                                const lm_kda_layer_weights *w, const float *x, const float *dout,
                                float *dx, const lm_kda_layer_grads *g, lm_kda_layer_ctx *ctx,
                                lm_error *err) {
    return lm_kda_layer_backward_acc(c, b, w, x, dout, dx, g, 0, ctx, err);
}

lm_status lm_kda_layer_backward_acc(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                                    const lm_kda_layer_weights *w, const float *x,
                                    const float *dout, float *dx, const lm_kda_layer_grads *g,
                                    int accumulate, lm_kda_layer_ctx *ctx, lm_error *err) {
    LM_TRY(validate(c, b, w, x, "backward", err));
    if (!ctx || !g)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer backward: 'ctx' and 'grads' are required");
    if (!ctx->have_fwd || ctx->B != b->B || ctx->T != b->T || ctx->d != c->d || ctx->H != c->H ||
        ctx->Dh != c->Dh || ctx->W != c->W || ctx->cu != b->cu_seqlens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda_layer backward: no matching forward on this ctx (B=%d T=%d)", b->B,
                         b->T);
    const int d = c->d, H = c->H, Dh = c->Dh, C = H * Dh;
    const int N = b->B * b->T;
    LM_TRY(lm_model_check_finite("kda_layer", "backward", "dout", dout, (int64_t)N * d, err));
    const struct {
        const char *name;
        float *p;
    } req[] = {{"grads.q_proj", g->q_proj},     {"grads.k_proj", g->k_proj},
               {"grads.v_proj", g->v_proj},     {"grads.q_conv1d", g->q_conv1d},
               {"grads.k_conv1d", g->k_conv1d}, {"grads.v_conv1d", g->v_conv1d},
               {"grads.f_a_proj", g->f_a_proj}, {"grads.f_b_proj", g->f_b_proj},
               {"grads.A_log", g->A_log},       {"grads.dt_bias", g->dt_bias},
               {"grads.b_proj", g->b_proj},     {"grads.g_a_proj", g->g_a_proj},
               {"grads.g_b_proj", g->g_b_proj}, {"grads.o_norm", g->o_norm},
               {"grads.o_proj", g->o_proj}};
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++)
        if (!req[i].p)
            return lm_errorf(err, LM_ERR_INVALID, "kda_layer backward: '%s' is required",
                             req[i].name);
    /* accumulate: GEMM weight gradients add in place (beta = 1); the ops that
     * overwrite their weight gradient (gated norm, KDA gate parameters, short conv)
     * write into the stage, which is then added */
    const int acc = accumulate ? 1 : 0;
    float *stage = NULL;
    if (acc) {
        stage = ctx->stage;
        if (!stage) {
            const int64_t ns = lm_kda_layer_stage_floats(c);
            if (ns > ctx->h0_cap) {
                free(ctx->h0_buf);
                ctx->h0_buf = LM_MALLOC((size_t)ns * sizeof(float));
                ctx->h0_cap = ns;
            }
            stage = ctx->h0_buf;
        }
    }

    /* out = y Wo^T */
    lm_model_mm(0, 0, N, C, d, dout, d, w->o_proj, C, 0, ctx->dy, C);
    lm_model_mm(1, 0, d, C, N, dout, d, ctx->y, C, acc, g->o_proj, C);

    /* gated RMSNorm -> d_o, dgate, do_norm */
    LM_TRY(lm_gated_rmsnorm_backward_ws(N, H, Dh, LM_GATED_RMSNORM_EPS, ctx->o, ctx->gate,
                                        w->o_norm, ctx->rstd, ctx->dy, ctx->d_o, ctx->dgate,
                                        acc ? stage : g->o_norm, ctx->norm_ws, err));
    if (acc)
        add_small(g->o_norm, stage, Dh);
    /* gate = (x Wga^T) Wgb^T */
    lm_model_mm(1, 0, C, Dh, N, ctx->dgate, C, ctx->ga, Dh, acc, g->g_b_proj, Dh);
    lm_model_mm(0, 0, N, Dh, C, ctx->dgate, C, w->g_b_proj, Dh, 0, ctx->dlow, Dh);
    lm_model_mm(1, 0, Dh, d, N, ctx->dlow, Dh, x, d, acc, g->g_a_proj, d);
    if (dx) lm_model_mm(0, 0, N, d, Dh, ctx->dlow, Dh, w->g_a_proj, d, 0, dx, d);

    /* the KDA op */
    lm_kda_config kc;
    kda_cfg(c, b, ctx, &kc);
    lm_kda_inputs in = {ctx->q, ctx->k, ctx->v, ctx->graw, ctx->braw, w->A_log, w->dt_bias, NULL};
    lm_kda_grads kg;
    memset(&kg, 0, sizeof(kg));
    kg.do_ = ctx->d_o;
    kg.dq = ctx->dq;
    kg.dk = ctx->dk;
    kg.dv = ctx->dv;
    kg.dg = ctx->dg;
    kg.dbeta = ctx->dbeta;
    kg.dA_log = acc ? stage : g->A_log;
    kg.ddt_bias = acc ? stage + H : g->dt_bias;
    LM_TRY(lm_kda_chunk_backward(&kc, &in, &kg, err));
    if (acc) {
        add_small(g->A_log, stage, H);
        add_small(g->dt_bias, stage + H, C);
    }

    /* beta_raw = x Wb^T */
    lm_model_mm(1, 0, H, d, N, ctx->dbeta, H, x, d, acc, g->b_proj, d);
    if (dx) lm_model_mm(0, 0, N, d, H, ctx->dbeta, H, w->b_proj, d, 1, dx, d);

    /* g_raw = (x Wfa^T) Wfb^T */
    lm_model_mm(1, 0, C, Dh, N, ctx->dg, C, ctx->fa, Dh, acc, g->f_b_proj, Dh);
    lm_model_mm(0, 0, N, Dh, C, ctx->dg, C, w->f_b_proj, Dh, 0, ctx->dlow, Dh);
    lm_model_mm(1, 0, Dh, d, N, ctx->dlow, Dh, x, d, acc, g->f_a_proj, d);
    if (dx) lm_model_mm(0, 0, N, d, Dh, ctx->dlow, Dh, w->f_a_proj, d, 1, dx, d);

    /* q, k, v: short conv + SiLU, projections (dy is free now: the conv input grad) */
    lm_short_conv_config sc;
    conv_cfg(c, b, &sc);
    const float *pin[3] = {ctx->pq, ctx->pk, ctx->pv};
    const float *dconv_out[3] = {ctx->dq, ctx->dk, ctx->dv};
    const float *cw[3] = {w->q_conv1d, w->k_conv1d, w->v_conv1d};
    const float *pw[3] = {w->q_proj, w->k_proj, w->v_proj};
    float *gcw[3] = {g->q_conv1d, g->k_conv1d, g->v_conv1d};
    float *gpw[3] = {g->q_proj, g->k_proj, g->v_proj};
    for (int i = 0; i < 3; i++) {
        LM_TRY(lm_short_conv_backward(&sc, pin[i], cw[i], NULL, dconv_out[i], ctx->dy,
                                      acc ? stage : gcw[i], NULL, err));
        if (acc)
            add_small(gcw[i], stage, (int64_t)C * c->W);
        lm_model_mm(1, 0, C, d, N, ctx->dy, C, x, d, acc, gpw[i], d);
        if (dx) lm_model_mm(0, 0, N, d, C, ctx->dy, C, pw[i], d, 1, dx, d);
    }
    return LM_OK;
}

/* Inference. The math is the forward's, token for token; only the state handling
 * differs: the short convs start from and write back s->conv_*, the KDA op starts
 * from s->state and writes its final state there. */
lm_status lm_kda_layer_infer(const lm_kda_layer_config *c, int B, int T,
                             const lm_kda_layer_weights *w, const float *x, float *out,
                             lm_kda_layer_state *s, lm_kda_layer_ctx *ctx, lm_error *err) {
    if (!c || !w)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer infer: config and weights are required");
    LM_TRY(validate_dims(c, B, T, "infer", err));
    if (!out || !ctx || !s)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda_layer infer: 'out', 'ctx' and the state 's' are required");
    if (!s->state)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda_layer infer: 'state.state' [B, H, Dh, Dh] is required");
    /* the conv states are small: scanned here, before any of them is updated (the
     * conv op's own scan would find a bad conv_k after conv_q was advanced) */
    const char *cname[3] = {"state.conv_q", "state.conv_k", "state.conv_v"};
    const float *cptr[3] = {s->conv_q, s->conv_k, s->conv_v};
    for (int i = 0; i < 3 && c->W > 1; i++)
        LM_TRY(lm_model_check_finite("kda_layer", "infer", cname[i], cptr[i],
                                     (int64_t)B * c->H * c->Dh * (c->W - 1), err));
    /* Weights: presence only. A finiteness scan would read every weight a second time
     * per decode step (the step is bound by that one read); lm_kda_layer_forward
     * scans them, the caller checks them once after loading. */
    weight_ref r[NWEIGHT];
    weight_list(c, w, r);
    for (int i = 0; i < NWEIGHT; i++)
        if (!r[i].p)
            return lm_errorf(err, LM_ERR_INVALID, "kda_layer infer: '%s' is required", r[i].name);
    LM_TRY(lm_model_check_finite("kda_layer", "infer", "x", x, (int64_t)B * T * c->d, err));

    const int d = c->d, H = c->H, Dh = c->Dh, C = H * Dh;
    const int N = B * T;
    const int64_t n_state = (int64_t)B * H * Dh * Dh;
    /* infer reuses the activation buffers: a backward now needs a new forward first */
    ctx->have_fwd = 0;
    ctx_carve(ctx, N, C, Dh, H, T > 1 ? n_state : 0);

    /* q, k, v: projection, short conv + SiLU continuing from the conv states */
    lm_model_mm_infer(N, C, d, x, d, w->q_proj, d, 0, ctx->pq, C);
    lm_model_mm_infer(N, C, d, x, d, w->k_proj, d, 0, ctx->pk, C);
    lm_model_mm_infer(N, C, d, x, d, w->v_proj, d, 0, ctx->pv, C);
    const float *pin[3] = {ctx->pq, ctx->pk, ctx->pv};
    const float *cw[3] = {w->q_conv1d, w->k_conv1d, w->v_conv1d};
    float *cout[3] = {ctx->q, ctx->k, ctx->v};
    float *cst[3] = {s->conv_q, s->conv_k, s->conv_v};
    const lm_kda_layer_batch b = {B, T, NULL, 0};
    for (int i = 0; i < 3; i++) {
        float *st = c->W > 1 ? cst[i] : NULL;
        if (T == 1) {
            LM_TRY(lm_short_conv_step(B, C, c->W, LM_ACT_SILU, pin[i], cw[i], st, cout[i], err));
        } else {
            /* initial and final state may alias (layers.h) */
            lm_short_conv_config sc;
            conv_cfg(c, &b, &sc);
            LM_TRY(lm_short_conv_forward(&sc, pin[i], cw[i], st, cout[i], st, err));
        }
    }

    /* gate (low rank) and beta */
    lm_model_mm_infer(N, Dh, d, x, d, w->f_a_proj, d, 0, ctx->fa, Dh);
    lm_model_mm_infer(N, C, Dh, ctx->fa, Dh, w->f_b_proj, Dh, 0, ctx->graw, C);
    lm_model_mm_infer(N, H, d, x, d, w->b_proj, d, 0, ctx->braw, H);

    /* the KDA op. The state is not scanned (trusted_state): it is zeros or what an
     * earlier call wrote, and the scan would double a decode step's state traffic. */
    lm_kda_config kc;
    kda_cfg(c, &b, ctx, &kc);
    kc.trusted_state = 1;
    lm_kda_inputs in = {ctx->q, ctx->k, ctx->v, ctx->graw, ctx->braw, w->A_log, w->dt_bias, NULL};
    lm_kda_outputs ko = {ctx->o, s->state};
    if (T == 1) {
        in.initial_state = s->state; /* may alias final_state (kda.h) */
        LM_TRY(lm_kda_recurrent_forward(&kc, &in, &ko, err));
    } else {
        /* kda.h promises in-place state updates for the recurrent forward only */
        memcpy(ctx->h0, s->state, sizeof(float) * (size_t)n_state);
        in.initial_state = ctx->h0;
        LM_TRY(lm_kda_forward(&kc, &in, &ko, err));
    }

    /* gated head-wise RMSNorm, output projection */
    lm_model_mm_infer(N, Dh, d, x, d, w->g_a_proj, d, 0, ctx->ga, Dh);
    lm_model_mm_infer(N, C, Dh, ctx->ga, Dh, w->g_b_proj, Dh, 0, ctx->gate, C);
    LM_TRY(lm_gated_rmsnorm_forward(N, H, Dh, LM_GATED_RMSNORM_EPS, ctx->o, ctx->gate, w->o_norm,
                                    ctx->y, NULL, err));
    lm_model_mm_infer(N, d, C, ctx->y, C, w->o_proj, C, 0, out, d);
    return LM_OK;
}
