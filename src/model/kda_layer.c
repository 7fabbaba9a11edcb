/* KDA layer (Kimi Linear token mixer): forward and backward, fp32, on the CPU.
 * Math, layouts and contracts: include/linmoe/kda_layer.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/kda_layer.h"
#include "linmoe/layers.h"
#include "model/model_internal.h"

struct lm_kda_layer_ctx {
    float *buf;
    int64_t cap; /* floats in buf */
    lm_kda_workspace *ws;
    /* the last forward */
    int have_fwd;
    int B, T, d, H, Dh, W;
    const int64_t *cu;
    /* saved activations (carved from buf) */
    float *pq, *pk, *pv, *q, *k, *v, *fa, *graw, *braw, *o, *ga, *gate, *rstd, *y;
    /* backward scratch */
    float *dy, *d_o, *dgate, *dq, *dk, *dv, *dg, *dbeta, *dlow;
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
    return x;
}

void lm_kda_layer_ctx_free(lm_kda_layer_ctx *ctx) {
    if (!ctx) return;
    lm_kda_workspace_free(ctx->ws);
    free(ctx->buf);
    free(ctx);
}

static lm_status validate(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                          const lm_kda_layer_weights *w, const float *x, const char *what,
                          lm_error *err) {
    if (!c || !b || !w)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: config, batch and weights are required",
                         what);
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
    if (b->B < 1 || b->T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: B = %d, T = %d must be >= 1", what, b->B,
                         b->T);
    if ((int64_t)c->H * c->Dh > (1 << 30) / 4)
        return lm_errorf(err, LM_ERR_INVALID, "kda_layer %s: H*Dh = %lld too large", what,
                         (long long)c->H * c->Dh);
    const int64_t d = c->d, C = (int64_t)c->H * c->Dh, Dh = c->Dh, H = c->H;
    LM_TRY(lm_model_check_finite("kda_layer", what, "x", x, (int64_t)b->B * b->T * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "q_proj", w->q_proj, C * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "k_proj", w->k_proj, C * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "v_proj", w->v_proj, C * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "q_conv1d", w->q_conv1d, C * c->W, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "k_conv1d", w->k_conv1d, C * c->W, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "v_conv1d", w->v_conv1d, C * c->W, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "f_a_proj", w->f_a_proj, Dh * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "f_b_proj", w->f_b_proj, C * Dh, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "A_log", w->A_log, H, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "dt_bias", w->dt_bias, C, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "b_proj", w->b_proj, H * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "g_a_proj", w->g_a_proj, Dh * d, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "g_b_proj", w->g_b_proj, C * Dh, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "o_norm", w->o_norm, Dh, err));
    LM_TRY(lm_model_check_finite("kda_layer", what, "o_proj", w->o_proj, d * C, err));
    return LM_OK;
}

/* Size the context for N tokens and carve the buffers (allocates only on growth). */
static void ctx_carve(lm_kda_layer_ctx *x, int64_t N, int64_t C, int64_t Dh, int64_t H) {
    const int64_t need = 17 * N * C + 3 * N * Dh + 3 * N * H + 16 * 32;
    if (need > x->cap) {
        free(x->buf);
        x->buf = LM_MALLOC((size_t)need * sizeof(float));
        x->cap = need;
    }
    float *p = x->buf;
#define TAKE(f, n)                                  \
    do {                                            \
        x->f = p;                                   \
        p += (((n) + 15) / 16) * 16; /* 64 B align */ \
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
    TAKE(dy, N * C);
    TAKE(d_o, N * C);
    TAKE(dgate, N * C);
    TAKE(dq, N * C);
    TAKE(dk, N * C);
    TAKE(dv, N * C);
    TAKE(dg, N * C);
    TAKE(dbeta, N * H);
    TAKE(dlow, N * Dh);
#undef TAKE
    LM_CHECK(p <= x->buf + x->cap);
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
    ctx_carve(ctx, N, C, Dh, H);

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

lm_status lm_kda_layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                                const lm_kda_layer_weights *w, const float *x, const float *dout,
                                float *dx, const lm_kda_layer_grads *g, lm_kda_layer_ctx *ctx,
                                lm_error *err) {
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

    /* out = y Wo^T */
    lm_model_mm(0, 0, N, C, d, dout, d, w->o_proj, C, 0, ctx->dy, C);
    lm_model_mm(1, 0, d, C, N, dout, d, ctx->y, C, 0, g->o_proj, C);

    /* gated RMSNorm -> d_o, dgate, do_norm */
    LM_TRY(lm_gated_rmsnorm_backward(N, H, Dh, LM_GATED_RMSNORM_EPS, ctx->o, ctx->gate, w->o_norm,
                                     ctx->rstd, ctx->dy, ctx->d_o, ctx->dgate, g->o_norm, err));
    /* gate = (x Wga^T) Wgb^T */
    lm_model_mm(1, 0, C, Dh, N, ctx->dgate, C, ctx->ga, Dh, 0, g->g_b_proj, Dh);
    lm_model_mm(0, 0, N, Dh, C, ctx->dgate, C, w->g_b_proj, Dh, 0, ctx->dlow, Dh);
    lm_model_mm(1, 0, Dh, d, N, ctx->dlow, Dh, x, d, 0, g->g_a_proj, d);
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
    kg.dA_log = g->A_log;
    kg.ddt_bias = g->dt_bias;
    LM_TRY(lm_kda_chunk_backward(&kc, &in, &kg, err));

    /* beta_raw = x Wb^T */
    lm_model_mm(1, 0, H, d, N, ctx->dbeta, H, x, d, 0, g->b_proj, d);
    if (dx) lm_model_mm(0, 0, N, d, H, ctx->dbeta, H, w->b_proj, d, 1, dx, d);

    /* g_raw = (x Wfa^T) Wfb^T */
    lm_model_mm(1, 0, C, Dh, N, ctx->dg, C, ctx->fa, Dh, 0, g->f_b_proj, Dh);
    lm_model_mm(0, 0, N, Dh, C, ctx->dg, C, w->f_b_proj, Dh, 0, ctx->dlow, Dh);
    lm_model_mm(1, 0, Dh, d, N, ctx->dlow, Dh, x, d, 0, g->f_a_proj, d);
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
        LM_TRY(lm_short_conv_backward(&sc, pin[i], cw[i], NULL, dconv_out[i], ctx->dy, gcw[i], NULL,
                                      err));
        lm_model_mm(1, 0, C, d, N, ctx->dy, C, x, d, 0, gpw[i], d);
        if (dx) lm_model_mm(0, 0, N, d, C, ctx->dy, C, pw[i], d, 1, dx, d);
    }
    return LM_OK;
}
