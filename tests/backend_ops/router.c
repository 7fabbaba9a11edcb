/* test_backend_ops family `router`: the CUDA MoE router (include/linmoe/cuda_router.h)
 * against the CPU router (lm_router_forward / lm_router_backward / lm_router_update_bias /
 * lm_router_quantile_solve, src/ops/moe_router.c, moe_balance.c) on the same fp32 logits.
 *
 * The router is fp32 on both sides, so the comparisons are tight: scores and weights
 * 1e-6 (relative RMS), indices, counts, dropped sets and accumulators exact. An index
 * may differ only at a genuine near-tie (the two keys within 1e-6 on the CPU); such
 * tokens are reported, excluded from the weight / gradient rows, and the count rows then
 * use the GPU's own selection. Logits are N(0, 1) plus a per-expert skew (so capacity
 * drops and the bias moves), which puts no two keys of a token within 1e-6 but rarely.
 * Integer rows are float copies checked with tolerance 0 (max |diff| <= 1e-6 passes).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_router.h"
#include "linmoe/moe_router.h"

typedef struct {
    const char *name;
    int E, k, n_group, topk_group;
    lm_score_func sf;
    int norm;
    float scale;
} rcase;

static const rcase k_cases[] = {
    {"E=8 k=2", 8, 2, 1, 1, LM_SCORE_SIGMOID, 1, 1.0f},
    {"E=64 k=6", 64, 6, 1, 1, LM_SCORE_SIGMOID, 1, 2.5f},
    {"E=64 k=6 smax nonorm", 64, 6, 1, 1, LM_SCORE_SOFTMAX, 0, 1.0f},
    {"E=256 k=8 g8/4", 256, 8, 8, 4, LM_SCORE_SIGMOID, 1, 2.5f},
    {"E=40 k=3", 40, 3, 1, 1, LM_SCORE_SIGMOID, 1, 1.0f},
    {"E=96 k=4 g4/2 smax", 96, 4, 4, 2, LM_SCORE_SOFTMAX, 1, 1.0f},
};
#define N_CASES ((int)(sizeof k_cases / sizeof k_cases[0]))

static void make_cfg(const rcase *rc, lm_router_config *cfg) {
    lm_router_config_default(cfg, rc->E, rc->k);
    cfg->scoring_func = rc->sf;
    cfg->norm_topk_prob = rc->norm;
    cfg->routed_scaling_factor = rc->scale;
    cfg->n_group = rc->n_group;
    cfg->topk_group = rc->topk_group;
}

/* logits[t, e] = N(0, 1) + skew * (2 e / (E - 1) - 1) */
static void make_logits(bo_ctx *c, float *lg, int T, int E, float skew) {
    bo_fill_normal(c, lg, (int64_t)T * E, 1.0f);
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            lg[(size_t)t * E + e] += E > 1 ? skew * (2.0f * e / (E - 1) - 1.0f) : 0.0f;
}

/* A count row: passes iff n == 0. */
static int check_zero(bo_ctx *c, const char *op, const char *shape, const char *tensor, double n) {
    const float out = (float)n, ref = 0.0f;
    if (n != 0)
        printf("  (%s %s %s: %g)\n", op, shape, tensor, n);
    return bo_check(c, op, "i32", shape, tensor, &out, &ref, 1, 0.0);
}

static int check_ints(bo_ctx *c, const char *op, const char *shape, const char *tensor,
                      const int32_t *out, const int32_t *ref, int64_t n) {
    float *a = LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
    float *b = LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        a[i] = (float)out[i], b[i] = (float)ref[i];
    const int bad = bo_check(c, op, "i32", shape, tensor, a, b, n, 0.0);
    free(a);
    free(b);
    return bad;
}

/* ---------------------------------------------------------------- device route */

static void groute_free(bo_ctx *c, lm_cuda_route *r) {
    bo_free(c, r->topk_idx);
    bo_free(c, r->topk_weight);
    bo_free(c, r->counts);
    bo_free(c, r->demand);
    bo_free(c, r->scores);
    bo_free(c, r->sel_idx);
    bo_free(c, r->n_dropped);
    bo_free(c, r->aux_loss);
    bo_free(c, r->aux_coef);
    memset(r, 0, sizeof *r);
}

/* Every buffer poisoned (0xFF: NaN / -1), so an unwritten element shows. */
static int groute_alloc(bo_ctx *c, const lm_router_config *cfg, int T, int nseq, lm_cuda_route *r,
                        lm_error *e) {
    memset(r, 0, sizeof *r);
    const size_t E = (size_t)cfg->num_experts, k = (size_t)cfg->num_experts_per_tok;
    const size_t Tn = T > 0 ? (size_t)T : 1;
    r->topk_idx = bo_alloc_poisoned(c, 4 * Tn * k, e);
    r->topk_weight = bo_alloc_poisoned(c, 4 * Tn * k, e);
    r->counts = bo_alloc_poisoned(c, 4 * E, e);
    r->demand = bo_alloc_poisoned(c, 4 * E, e);
    r->scores = bo_alloc_poisoned(c, 4 * Tn * E, e);
    r->sel_idx = bo_alloc_poisoned(c, 4 * Tn * k, e);
    r->n_dropped = bo_alloc_poisoned(c, 8, e);
    r->aux_loss = bo_alloc_poisoned(c, 4, e);
    r->aux_coef = bo_alloc_poisoned(c, 8 * (size_t)nseq * E, e);
    r->T_cap = (int)Tn;
    r->seq_cap = nseq;
    if (!r->topk_idx || !r->topk_weight || !r->counts || !r->demand || !r->scores || !r->sel_idx ||
        !r->n_dropped || !r->aux_loss || !r->aux_coef) {
        groute_free(c, r);
        return -1;
    }
    return 0;
}

/* Downloaded GPU route. */
typedef struct {
    int32_t *idx, *sel, *counts, *demand, ndrop[2];
    float *w, *scores, aux;
} hroute;

static void hroute_free(hroute *h) {
    free(h->idx);
    free(h->sel);
    free(h->counts);
    free(h->demand);
    free(h->w);
    free(h->scores);
    memset(h, 0, sizeof *h);
}

static lm_status hroute_get(bo_ctx *c, const lm_cuda_route *r, int T, int E, int k, int aux,
                            hroute *h, lm_error *e) {
    const size_t Tk = (size_t)T * k, TE = (size_t)T * E;
    h->idx = LM_MALLOC(4 * (Tk + 1));
    h->sel = LM_MALLOC(4 * (Tk + 1));
    h->w = LM_MALLOC(4 * (Tk + 1));
    h->scores = LM_MALLOC(4 * (TE + 1));
    h->counts = LM_MALLOC(4 * (size_t)E);
    h->demand = LM_MALLOC(4 * (size_t)E);
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->idx, r->topk_idx, 4 * Tk, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->sel, r->sel_idx, 4 * Tk, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->w, r->topk_weight, 4 * Tk, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->scores, r->scores, 4 * TE, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->counts, r->counts, 4 * (size_t)E, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->demand, r->demand, 4 * (size_t)E, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, h->ndrop, r->n_dropped, 8, e));
    h->aux = 0.0f;
    if (aux)
        LM_TRY(lm_cuda_ctx_download(c->cuda, &h->aux, r->aux_loss, 4, e));
    return LM_OK;
}

/* Compare a GPU route with the CPU's. swap[t] = 1 for tokens with a near-tie swap.
 * Returns the number of such tokens; check_scores adds the scores row. */
static int compare_route(bo_ctx *c, const char *op, const char *shape, const lm_route *cr,
                         const float *bias, const hroute *g, int check_scores,
                         unsigned char *swap) {
    const int T = cr->T, E = cr->E, k = cr->k;
    const size_t Tk = (size_t)T * k;
    if (check_scores)
        bo_check(c, op, "f32", shape, "scores", g->scores, cr->scores, (int64_t)T * E, 1e-6);
    int64_t bad = 0;
    int nswap = 0;
    for (int t = 0; t < T; t++) {
        swap[t] = 0;
        for (int j = 0; j < k; j++) {
            const size_t a = (size_t)t * k + j;
            const int ce = (int)cr->topk_idx[a];
            const int want = cr->keep[a] ? ce : -1;
            const int got = g->idx[a];
            if (got == want)
                continue;
            const int gs = g->sel[a];
            if (gs >= 0 && gs < E && gs != ce) { /* a different expert, not a drop mismatch */
                const float kc = cr->scores[(size_t)t * E + ce] + (bias ? bias[ce] : 0.0f);
                const float kg = cr->scores[(size_t)t * E + gs] + (bias ? bias[gs] : 0.0f);
                if (fabsf(kc - kg) < 1e-6f) {
                    swap[t] = 1;
                    continue;
                }
            }
            bad++;
        }
        nswap += swap[t];
    }
    if (nswap)
        printf("  (%s %s: %d tokens with near-tie swaps, excluded from weights/grads)\n", op, shape,
               nswap);
    check_zero(c, op, shape, "idx_bad", (double)bad);
    /* weights: 0 where dropped */
    float *ref = LM_MALLOC(sizeof(float) * (Tk + 1)), *got = LM_MALLOC(sizeof(float) * (Tk + 1));
    for (size_t a = 0; a < Tk; a++) {
        ref[a] = cr->keep[a] ? cr->topk_weight[a] : 0.0f;
        got[a] = swap[a / k] ? ref[a] : g->w[a];
    }
    bo_check(c, op, "f32", shape, "weight", got, ref, (int64_t)Tk, 1e-6);
    free(ref);
    free(got);
    /* counts: [demand | kept | dropped assignments, dropped tokens] from the CPU's route
     * (from the GPU's own selection after a near-tie swap) */
    int32_t *rc = LM_CALLOC((size_t)2 * E + 2, sizeof(int32_t));
    int32_t *gc = LM_CALLOC((size_t)2 * E + 2, sizeof(int32_t));
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < k; j++) {
            const size_t a = (size_t)t * k + j;
            if (nswap) {
                const int gs = g->sel[a];
                if (gs >= 0 && gs < E) {
                    rc[gs]++;
                    if (g->idx[a] >= 0)
                        rc[E + gs]++;
                }
            } else {
                rc[cr->topk_idx[a]]++;
                rc[E + cr->topk_idx[a]] += cr->keep[a] != 0;
            }
        }
    }
    rc[2 * E] = (int32_t)cr->n_dropped_assign;
    rc[2 * E + 1] = (int32_t)cr->n_dropped_tokens;
    memcpy(gc, g->demand, sizeof(int32_t) * (size_t)E);
    memcpy(gc + E, g->counts, sizeof(int32_t) * (size_t)E);
    gc[2 * E] = g->ndrop[0];
    gc[2 * E + 1] = g->ndrop[1];
    check_ints(c, op, shape, "counts", gc, rc, (int64_t)2 * E + 2);
    free(rc);
    free(gc);
    return nswap;
}

/* dlogits of the GPU against the CPU; rows of swapped tokens excluded. */
static void compare_bwd(bo_ctx *c, const char *op, const char *shape, const lm_router_config *cfg,
                        const lm_route *cr, const lm_cuda_route *gr, const float *dw,
                        const float *d_dw, const unsigned char *swap) {
    lm_error e = {0};
    const int T = cr->T, E = cr->E;
    const size_t TE = (size_t)T * E;
    float *ref = LM_MALLOC(sizeof(float) * (TE + 1)), *got = LM_MALLOC(sizeof(float) * (TE + 1));
    float *d_dl = bo_alloc_poisoned(c, 4 * (TE + 1), &e);
    if (!d_dl || lm_router_backward(cfg, cr, dw, ref, &e) != LM_OK ||
        lm_cuda_router_backward(c->cuda, cfg, gr, d_dw, d_dl, &e) != LM_OK ||
        bo_download_f32(c, got, d_dl, (int64_t)TE, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
    } else {
        for (int t = 0; t < T; t++)
            if (swap[t])
                memcpy(got + (size_t)t * E, ref + (size_t)t * E, sizeof(float) * (size_t)E);
        bo_check(c, op, "f32", shape, dw ? "dlogits" : "dlogits_aux", got, ref, (int64_t)TE, 1e-5);
    }
    bo_free(c, d_dl);
    free(ref);
    free(got);
}

/* ---------------------------------------------------------------- forward / capacity / bwd */

/* One forward on both backends (training: capacity_factor and policy from cfg), compared;
 * then the backward with random dtopk_weight (training only). */
static void fwd_case(bo_ctx *c, const lm_router_config *cfg, const char *op, const char *shape,
                     int T, float skew, int training) {
    lm_error e = {0};
    const int E = cfg->num_experts, k = cfg->num_experts_per_tok;
    float *lg = LM_MALLOC(sizeof(float) * ((size_t)T * E + 1));
    float *dw = LM_MALLOC(sizeof(float) * ((size_t)T * k + 1));
    make_logits(c, lg, T, E, skew);
    bo_fill_normal(c, dw, (int64_t)T * k, 1.0f);
    lm_router_state cst = {0};
    lm_cuda_router_state gst = {0};
    lm_route cr = {0};
    lm_cuda_route gr = {0};
    hroute hg = {0};
    unsigned char *swap = LM_CALLOC((size_t)T + 1, 1);
    float *d_lg = NULL, *d_dw = NULL;
    if (lm_router_state_init(&cst, E, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto done;
    }
    for (int i = 0; i < E; i++)
        cst.e_score_correction_bias[i] = (float)(0.05 * lm_rng_normal(&c->rng));
    d_lg = bo_upload_f32(c, lg, (int64_t)T * E, &e);
    d_dw = bo_upload_f32(c, dw, (int64_t)T * k, &e);
    if (!d_lg || !d_dw || lm_cuda_router_state_init(c->cuda, &gst, E, &e) != LM_OK ||
        lm_cuda_router_state_upload(c->cuda, &gst, &cst, &e) != LM_OK ||
        groute_alloc(c, cfg, T, 1, &gr, &e) != 0 ||
        lm_router_forward(cfg, &cst, lg, T, NULL, 0, training, &cr, &e) != LM_OK ||
        lm_cuda_router_forward(c->cuda, cfg, &gst, d_lg, T, NULL, 0, training, &gr, &e) != LM_OK ||
        hroute_get(c, &gr, T, E, k, 0, &hg, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto done;
    }
    compare_route(c, op, shape, &cr, cst.e_score_correction_bias, &hg, !training, swap);
    if (training) {
        compare_bwd(c, "router_bwd", shape, cfg, &cr, &gr, dw, d_dw, swap);
        /* the step accumulators after one micro-batch */
        lm_router_state gs = {0};
        if (lm_router_state_init(&gs, E, &e) != LM_OK ||
            lm_cuda_router_state_download(c->cuda, &gst, &gs, &e) != LM_OK) {
            bo_fail(c, op, shape, &e);
        } else {
            float a[4 * 1024 + 8], b[4 * 1024 + 8];
            int n = 0;
            for (int i = 0; i < E; i++, n++)
                a[n] = (float)gs.demand[i], b[n] = (float)cst.demand[i];
            for (int i = 0; i < E; i++, n++)
                a[n] = (float)gs.kept[i], b[n] = (float)cst.kept[i];
            a[n] = (float)gs.tokens, b[n++] = (float)cst.tokens;
            a[n] = (float)gs.dropped_assign, b[n++] = (float)cst.dropped_assign;
            a[n] = (float)gs.dropped_tokens, b[n++] = (float)cst.dropped_tokens;
            a[n] = (float)gs.n_micro, b[n++] = (float)cst.n_micro;
            if (!memchr(swap, 1, (size_t)T))
                bo_check(c, op, "f64", shape, "acc", a, b, n, 0.0);
        }
        lm_router_state_free(&gs);
    }
done:
    hroute_free(&hg);
    groute_free(c, &gr);
    lm_cuda_router_state_free(c->cuda, &gst);
    lm_route_free(&cr);
    lm_router_state_free(&cst);
    bo_free(c, d_lg);
    bo_free(c, d_dw);
    free(lg);
    free(dw);
    free(swap);
}

/* ---------------------------------------------------------------- aux loss */

static void aux_case(bo_ctx *c, const rcase *rc, int T, int seqwise) {
    lm_error e = {0};
    lm_router_config cfg;
    make_cfg(rc, &cfg);
    cfg.balance = LM_BAL_AUX_LOSS;
    cfg.aux_loss_alpha = 0.01f;
    cfg.aux_loss_seq = seqwise;
    const int E = cfg.num_experts, k = cfg.num_experts_per_tok;
    /* documents: empty, length 1, then the rest split in two (one of them may be empty) */
    int64_t cu64[6] = {0, 0, 1, 1 + (T - 1) / 3, 1 + (T - 1) / 3, T};
    int32_t cu32[6];
    for (int i = 0; i < 6; i++)
        cu32[i] = (int32_t)cu64[i];
    const int n_cu = seqwise ? 6 : 0;
    char shape[96];
    snprintf(shape, sizeof shape, "%s T=%d %s", rc->name, T, seqwise ? "seq" : "batch");
    float *lg = LM_MALLOC(sizeof(float) * ((size_t)T * E + 1));
    float *dw = LM_MALLOC(sizeof(float) * ((size_t)T * k + 1));
    make_logits(c, lg, T, E, 0.5f);
    bo_fill_normal(c, dw, (int64_t)T * k, 1.0f);
    lm_route cr = {0};
    lm_cuda_route gr = {0};
    hroute hg = {0};
    unsigned char *swap = LM_CALLOC((size_t)T + 1, 1);
    float *d_lg = bo_upload_f32(c, lg, (int64_t)T * E, &e);
    float *d_dw = bo_upload_f32(c, dw, (int64_t)T * k, &e);
    int32_t *d_cu = bo_upload_bytes(c, cu32, sizeof cu32, &e);
    if (!d_lg || !d_dw || !d_cu || groute_alloc(c, &cfg, T, 5, &gr, &e) != 0 ||
        lm_router_forward(&cfg, NULL, lg, T, seqwise ? cu64 : NULL, n_cu, 0, &cr, &e) != LM_OK ||
        lm_cuda_router_forward(c->cuda, &cfg, NULL, d_lg, T, seqwise ? d_cu : NULL, n_cu, 0, &gr,
                               &e) != LM_OK ||
        hroute_get(c, &gr, T, E, k, 1, &hg, &e) != LM_OK) {
        bo_fail(c, "router_aux", shape, &e);
        goto done;
    }
    compare_route(c, "router_aux", shape, &cr, NULL, &hg, 1, swap);
    {
        const float ref = cr.aux_loss;
        bo_check(c, "router_aux", "f32", shape, "aux_loss", &hg.aux, &ref, 1, 1e-6);
    }
    compare_bwd(c, "router_aux", shape, &cfg, &cr, &gr, dw, d_dw, swap);
    compare_bwd(c, "router_aux", shape, &cfg, &cr, &gr, NULL, NULL, swap);
done:
    hroute_free(&hg);
    groute_free(c, &gr);
    lm_route_free(&cr);
    bo_free(c, d_lg);
    bo_free(c, d_dw);
    bo_free(c, d_cu);
    free(lg);
    free(dw);
    free(swap);
}

/* ---------------------------------------------------------------- bias updates */

/* N steps of M micro-batches (training forward on both, then the update), from the same
 * starting state. Compares the bias after every step, and at the end the whole state and
 * the last step's metrics. */
static void update_case(bo_ctx *c, const rcase *rc, int T, const char *rule) {
    enum { N_STEPS = 6, N_MICRO = 2 };
    lm_error e = {0};
    lm_router_config cfg;
    make_cfg(rc, &cfg);
    if (strcmp(rule, "sign") == 0) {
        cfg.balance = LM_BAL_AUX_FREE;
        cfg.bias_rule = LM_BIAS_SIGN;
        cfg.bias_update_rate = 1e-2f;
        cfg.bias_clamp = 0.03f; /* binds after a few steps */
        cfg.bias_center = 1;
        cfg.capacity_factor = 1.25f;
        cfg.drop_policy = LM_DROP_PROBS;
    } else if (strcmp(rule, "linear") == 0) {
        cfg.balance = LM_BAL_AUX_FREE;
        cfg.bias_rule = LM_BIAS_LINEAR;
        cfg.bias_update_rate = 5e-2f;
        cfg.bias_clamp = 0.0f;
        cfg.bias_center = 0;
        cfg.capacity_factor = 1.0f;
        cfg.drop_policy = LM_DROP_POSITION;
    } else {
        cfg.balance = LM_BAL_QUANTILE;
        cfg.quantile_iters = 2;
        cfg.quantile_ema = 0.5f;
        cfg.bias_center = 1;
        cfg.bias_clamp = 1.0f;
    }
    const int E = cfg.num_experts, k = cfg.num_experts_per_tok;
    char shape[96];
    snprintf(shape, sizeof shape, "%s T=%d %s", rc->name, T, rule);
    float *lg = LM_MALLOC(sizeof(float) * ((size_t)T * E + 1));
    float *bg = LM_MALLOC(sizeof(float) * (size_t)E);
    lm_router_state cst = {0}, gs = {0};
    lm_cuda_router_state gst = {0};
    lm_route cr = {0};
    lm_cuda_route gr = {0};
    lm_router_metrics cm, gm;
    memset(&cm, 0, sizeof cm);
    memset(&gm, 0, sizeof gm);
    lm_router_metrics *d_m = NULL;
    float *d_lg = NULL;
    double max_db = 0.0;
    if (lm_router_state_init(&cst, E, &e) != LM_OK || lm_router_state_init(&gs, E, &e) != LM_OK ||
        lm_cuda_router_state_init(c->cuda, &gst, E, &e) != LM_OK ||
        lm_cuda_router_state_upload(c->cuda, &gst, &cst, &e) != LM_OK ||
        groute_alloc(c, &cfg, T, 1, &gr, &e) != 0 ||
        !(d_m = bo_alloc_poisoned(c, sizeof(lm_router_metrics), &e)) ||
        !(d_lg = bo_alloc_poisoned(c, sizeof(float) * ((size_t)T * E + 1), &e))) {
        bo_fail(c, "router_update", shape, &e);
        goto done;
    }
    for (int step = 0; step < N_STEPS; step++) {
        for (int mb = 0; mb < N_MICRO; mb++) {
            make_logits(c, lg, T, E, 1.0f);
            if (lm_cuda_ctx_upload(c->cuda, d_lg, lg, sizeof(float) * (size_t)T * E, &e) != LM_OK ||
                lm_router_forward(&cfg, &cst, lg, T, NULL, 0, 1, &cr, &e) != LM_OK ||
                lm_cuda_router_forward(c->cuda, &cfg, &gst, d_lg, T, NULL, 0, 1, &gr, &e) !=
                    LM_OK) {
                bo_fail(c, "router_update", shape, &e);
                goto done;
            }
        }
        /* all-reduce here (one rank) */
        if (lm_router_update_bias(&cfg, &cst, NULL, NULL, &cm, &e) != LM_OK ||
            lm_cuda_router_update_bias(c->cuda, &cfg, &gst, d_m, &e) != LM_OK ||
            lm_cuda_ctx_download(c->cuda, bg, gst.e_score_correction_bias,
                                 sizeof(float) * (size_t)E, &e) != LM_OK) {
            bo_fail(c, "router_update", shape, &e);
            goto done;
        }
        for (int i = 0; i < E; i++) {
            const double d = fabs((double)bg[i] - cst.e_score_correction_bias[i]);
            max_db = d > max_db ? d : max_db;
        }
    }
    if (lm_cuda_router_state_download(c->cuda, &gst, &gs, &e) != LM_OK ||
        lm_cuda_ctx_download(c->cuda, &gm, d_m, sizeof gm, &e) != LM_OK) {
        bo_fail(c, "router_update", shape, &e);
        goto done;
    }
    bo_check(c, "router_update", "f32", shape, "bias", gs.e_score_correction_bias,
             cst.e_score_correction_bias, E, 1e-6);
    {
        const float z = 0.0f, md = (float)max_db;
        bo_check(c, "router_update", "f32", shape, "max|db|", &md, &z, 1, 0.0);
    }
    bo_check(c, "router_update", "f32", shape, "prev_delta", gs.prev_delta, cst.prev_delta, E,
             1e-5);
    {
        /* history (exact counts), its cursor, and the accumulators zeroed */
        const int nh = LM_ROUTER_HISTORY * E;
        float *a = LM_MALLOC(sizeof(float) * ((size_t)nh + 16));
        float *b = LM_MALLOC(sizeof(float) * ((size_t)nh + 16));
        int n = 0;
        for (int i = 0; i < nh; i++, n++)
            a[n] = (float)gs.history[i], b[n] = (float)cst.history[i];
        a[n] = (float)gs.hist_len, b[n++] = (float)cst.hist_len;
        a[n] = (float)gs.hist_pos, b[n++] = (float)cst.hist_pos;
        double accsum = 0.0;
        for (int i = 0; i < E; i++)
            accsum += fabs(gs.demand[i]) + fabs(gs.kept[i]) + fabs(gs.qb_accum[i]);
        accsum += (double)gs.tokens + (double)gs.n_micro + (double)gs.qb_count;
        a[n] = (float)accsum, b[n++] = 0.0f;
        bo_check(c, "router_update", "f64", shape, "history", a, b, n, 0.0);
        free(a);
        free(b);
    }
    {
        const float gv[] = {(float)gm.maxvio_batch,
                            (float)gm.maxvio_global,
                            (float)gm.min_load,
                            (float)gm.n_dead,
                            (float)gm.dropped_assign_frac,
                            (float)gm.dropped_token_frac,
                            (float)gm.bias_mean,
                            (float)gm.bias_std,
                            (float)gm.bias_min,
                            (float)gm.bias_max,
                            (float)gm.n_clamped,
                            (float)gm.sign_flip_rate,
                            (float)gm.aux_loss,
                            (float)gm.tokens};
        const float cv[] = {(float)cm.maxvio_batch,
                            (float)cm.maxvio_global,
                            (float)cm.min_load,
                            (float)cm.n_dead,
                            (float)cm.dropped_assign_frac,
                            (float)cm.dropped_token_frac,
                            (float)cm.bias_mean,
                            (float)cm.bias_std,
                            (float)cm.bias_min,
                            (float)cm.bias_max,
                            (float)cm.n_clamped,
                            (float)cm.sign_flip_rate,
                            (float)cm.aux_loss,
                            (float)cm.tokens};
        /* per field: |gpu - cpu| / max(|cpu|, 1) */
        double worst = 0.0;
        for (int i = 0; i < 14; i++) {
            const double d = fabs((double)gv[i] - cv[i]) / fmax(fabs((double)cv[i]), 1.0);
            worst = d > worst ? d : worst;
        }
        const float wf = (float)worst, z = 0.0f;
        bo_check(c, "router_update", "f64", shape, "metrics", &wf, &z, 1, 0.0);
    }
    /* maxvio of the last micro-batch's demand on the device */
    {
        int32_t *dem = LM_MALLOC(sizeof(int32_t) * (size_t)E);
        float *d_mv = bo_alloc_poisoned(c, sizeof(float), &e);
        float mv = 0.0f;
        if (!d_mv || lm_cuda_router_maxvio(c->cuda, gr.demand, E, d_mv, &e) != LM_OK ||
            bo_download_f32(c, &mv, d_mv, 1, &e) != LM_OK ||
            lm_cuda_ctx_download(c->cuda, dem, gr.demand, sizeof(int32_t) * (size_t)E, &e) !=
                LM_OK) {
            bo_fail(c, "router_maxvio", shape, &e);
        } else {
            double s = 0.0, mx = 0.0;
            for (int i = 0; i < E; i++) {
                s += dem[i];
                mx = dem[i] > mx ? dem[i] : mx;
            }
            const float ref = s > 0 ? (float)(mx / (s / E) - 1.0) : 0.0f;
            bo_check(c, "router_maxvio", "f32", shape, "maxvio", &mv, &ref, 1, 1e-6);
        }
        bo_free(c, d_mv);
        free(dem);
    }
done:
    groute_free(c, &gr);
    lm_cuda_router_state_free(c->cuda, &gst);
    lm_route_free(&cr);
    lm_router_state_free(&cst);
    lm_router_state_free(&gs);
    bo_free(c, d_m);
    bo_free(c, d_lg);
    free(lg);
    free(bg);
    (void)k;
}

/* ---------------------------------------------------------------- quantile solve */

static void qb_case(bo_ctx *c, const rcase *rc, int T, int iters) {
    lm_error e = {0};
    lm_router_config cfg;
    make_cfg(rc, &cfg);
    const int E = cfg.num_experts;
    char shape[96];
    snprintf(shape, sizeof shape, "%s T=%d it=%d", rc->name, T, iters);
    float *lg = LM_MALLOC(sizeof(float) * ((size_t)T * E + 1));
    float *bias = LM_MALLOC(sizeof(float) * (size_t)E);
    float *beta = LM_MALLOC(sizeof(float) * (size_t)E), *bc = LM_MALLOC(sizeof(float) * (size_t)E);
    float *gbeta = LM_MALLOC(sizeof(float) * (size_t)E),
          *gbc = LM_MALLOC(sizeof(float) * (size_t)E);
    make_logits(c, lg, T, E, 1.0f);
    for (int i = 0; i < E; i++)
        bias[i] = (float)(0.05 * lm_rng_normal(&c->rng));
    lm_route cr = {0};
    float *d_s = NULL, *d_b = NULL, *d_beta = NULL, *d_bc = NULL;
    if (lm_router_forward(&cfg, NULL, lg, T, NULL, 0, 0, &cr, &e) != LM_OK ||
        lm_router_quantile_solve(&cfg, cr.scores, T, bias, iters, beta, bc, &e) != LM_OK ||
        !(d_s = bo_upload_f32(c, cr.scores, (int64_t)T * E, &e)) ||
        !(d_b = bo_upload_f32(c, bias, E, &e)) ||
        !(d_beta = bo_alloc_poisoned(c, sizeof(float) * (size_t)E, &e)) ||
        !(d_bc = bo_alloc_poisoned(c, sizeof(float) * (size_t)E, &e)) ||
        lm_cuda_router_quantile_solve(c->cuda, &cfg, d_s, T, d_b, iters, d_beta, d_bc, &e) !=
            LM_OK ||
        bo_download_f32(c, gbeta, d_beta, E, &e) != LM_OK ||
        bo_download_f32(c, gbc, d_bc, E, &e) != LM_OK) {
        bo_fail(c, "router_qb", shape, &e);
    } else {
        /* beta is an exact order statistic: tight even relative to its spread */
        bo_check(c, "router_qb", "f32", shape, "beta", gbeta, beta, E, 1e-6);
        bo_check(c, "router_qb", "f32", shape, "b_centred", gbc, bc, E, 1e-6);
    }
    lm_route_free(&cr);
    bo_free(c, d_s);
    bo_free(c, d_b);
    bo_free(c, d_beta);
    bo_free(c, d_bc);
    free(lg);
    free(bias);
    free(beta);
    free(bc);
    free(gbeta);
    free(gbc);
}

/* ---------------------------------------------------------------- family */

int bo_family_router(bo_ctx *c) {
    const int f0 = c->failed;
    static const int Ts[] = {1, 37, 4096};
    char shape[96];
    for (int ci = 0; ci < N_CASES; ci++) {
        const rcase *rc = &k_cases[ci];
        lm_router_config cfg;
        make_cfg(rc, &cfg);
        for (int ti = 0; ti < 3; ti++) {
            const int T = Ts[ti];
            snprintf(shape, sizeof shape, "%s T=%d", rc->name, T);
            fwd_case(c, &cfg, "router_fwd", shape, T, 0.5f, 0);
            /* training, dropless (the backward without drops) */
            cfg.capacity_factor = 0.0f;
            snprintf(shape, sizeof shape, "%s T=%d dropless", rc->name, T);
            fwd_case(c, &cfg, "router_train", shape, T, 0.5f, 1);
            /* capacity 1.0 with a skew: the high experts overflow */
            cfg.capacity_factor = 1.0f;
            cfg.drop_policy = LM_DROP_PROBS;
            snprintf(shape, sizeof shape, "%s T=%d probs", rc->name, T);
            fwd_case(c, &cfg, "router_cap", shape, T, 1.0f, 1);
            cfg.drop_policy = LM_DROP_POSITION;
            snprintf(shape, sizeof shape, "%s T=%d position", rc->name, T);
            fwd_case(c, &cfg, "router_cap", shape, T, 1.0f, 1);
            cfg.capacity_factor = 0.0f;
        }
    }
    /* aux loss: sigmoid and softmax, batch- and sequence-wise */
    const int aux_cases[] = {1, 2, 3};
    for (int i = 0; i < 3; i++)
        for (int ti = 1; ti < 3; ti++) {
            aux_case(c, &k_cases[aux_cases[i]], Ts[ti], 0);
            aux_case(c, &k_cases[aux_cases[i]], Ts[ti], 1);
        }
    /* bias updates: N steps of each rule */
    const int upd_cases[] = {0, 1, 3, 5};
    static const char *const rules[] = {"sign", "linear", "quantile"};
    for (int i = 0; i < 4; i++)
        for (int ti = 1; ti < 3; ti++)
            for (int r = 0; r < 3; r++)
                update_case(c, &k_cases[upd_cases[i]], Ts[ti], rules[r]);
    /* the quantile solve alone */
    for (int i = 0; i < 4; i++)
        for (int ti = 0; ti < 3; ti++)
            qb_case(c, &k_cases[upd_cases[i]], Ts[ti], ti == 2 ? 3 : 1);
    return c->failed - f0;
}
