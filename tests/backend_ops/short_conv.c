/* test_backend_ops family "short_conv": lm_cuda_short_conv_forward / _backward / _step
 * against the CPU fp32 ops lm_short_conv_forward / _backward / _step
 * (src/ops/short_conv.c) on the same bf16-rounded x, weight and dy (the states are fp32
 * on both sides).
 *
 * Shapes: packed documents with empty and length-1 documents (cu_seqlens {0,0,1,65,300}
 * and one ending in an empty document), T not a multiple of the 64 / 128-token tiles,
 * documents crossing tiles, B = 2 without cu_seqlens, T = 1, T = 0, W = 4 (8-channel
 * vectors), W = 3 with C = 37 (scalar path), W = 6 (the 8-tap instance), W = 1, SiLU and
 * none, with and without initial state, final state in place over the initial state;
 * three decode steps fed back in place. dweight is accumulated into a random prefill.
 * Every conv case runs through the public entry points (op "short_conv", the default
 * variant) and each variant of src/ops/cuda/layers_variants.h ("short_conv/v1": the
 * tiled kernels for W = 4 with C % 8 == 0, where C = 520 leaves a partial 512-channel CTA
 * and T = 1000 documents of length 1, 2 and 127 cross its 32-token sub-tiles and 128-token
 * dweight tiles; the other W and C run the first kernels, its fallback).
 *
 * Tolerances: y, dx: BO_TOL_FWD / BO_TOL_GRAD (bf16 output rounding). final_state:
 * exact (copies of bf16 inputs or fp32 state). dweight, dinitial_state: 1e-4 (fp32 sums
 * of the same products in another order; ~1e-6 expected). The decode state: exact.
 */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_layers.h"
#include "linmoe/layers.h"
#include "ops/cuda/layers_variants.h"

#define TOL_EXACT 1e-6
#define TOL_SUM 1e-4

typedef struct {
    void *p[24];
    int n;
} dpool;

static void *dp(dpool *d, void *p) {
    if (p)
        d->p[d->n++] = p;
    return p;
}

static void dp_free(bo_ctx *c, dpool *d) {
    for (int i = 0; i < d->n; i++)
        bo_free(c, d->p[i]);
    d->n = 0;
}

static float *hbuf(int64_t n) { return LM_CALLOC((size_t)(n > 0 ? n : 1), sizeof(float)); }

typedef struct {
    int B, T, C, W;
    int silu, state, inplace;
    int ncu;
    int64_t cu[8];
} ccase;

static void conv_case(bo_ctx *c, const ccase *k) {
    lm_short_conv_config cfg;
    lm_short_conv_config_default(&cfg, k->B, k->T, k->C, k->W);
    cfg.activation = k->silu ? LM_ACT_SILU : LM_ACT_NONE;
    if (k->ncu) {
        cfg.cu_seqlens = k->cu;
        cfg.n_cu_seqlens = k->ncu;
    }
    const int Ns = k->ncu ? k->ncu - 1 : k->B, S = k->W - 1;
    const int64_t n = (int64_t)k->B * k->T * k->C, ns = (int64_t)Ns * k->C * S;
    const int64_t nw = (int64_t)k->C * k->W;
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d C=%d W=%d%s%s%s%s", k->B, k->T, k->C, k->W,
             k->ncu ? " cu" : "", k->silu ? " silu" : "", k->state ? " h0" : "",
             k->inplace ? " inpl" : "");
    float *x = hbuf(n), *w = hbuf(nw), *h0 = hbuf(ns), *y = hbuf(n), *hT = hbuf(ns);
    float *dy = hbuf(n), *dx = hbuf(n), *dw = hbuf(nw), *dw0 = hbuf(nw), *dh0 = hbuf(ns);
    float *gy = hbuf(n), *ghT = hbuf(ns), *gdx = hbuf(n), *gdw = hbuf(nw), *gdh0 = hbuf(ns);
    bo_fill_normal(c, x, n, 1.0f);
    bo_fill_normal(c, w, nw, 0.5f);
    bo_fill_normal(c, h0, ns, 1.0f);
    bo_fill_normal(c, dy, n, 1.0f);
    bo_fill_normal(c, dw0, nw, 1.0f);
    bo_round_bf16(x, n);
    bo_round_bf16(w, nw);
    bo_round_bf16(dy, n);
    lm_error e = {0};
    const float *h0r = k->state ? h0 : NULL;
    if (lm_short_conv_forward(&cfg, x, w, h0r, y, hT, &e) != LM_OK ||
        lm_short_conv_backward(&cfg, x, w, h0r, dy, dx, dw, dh0, &e) != LM_OK) {
        bo_fail(c, "short_conv", shape, &e);
        goto out;
    }
    for (int64_t i = 0; i < nw; i++)
        dw[i] += dw0[i];
    for (int v = 0; v <= LM_LAYERS_CONV_VARIANTS; v++) {
        char op[32] = "short_conv";
        if (v)
            snprintf(op, sizeof op, "short_conv/v%d", v);
        dpool P = {0};
        void *dxd = dp(&P, bo_upload_bf16(c, x, n, &e));
        void *dwd = dp(&P, bo_upload_bf16(c, w, nw, &e));
        float *dh0d = k->state ? dp(&P, bo_upload_f32(c, h0, ns, &e)) : NULL;
        void *dyd = dp(&P, bo_upload_bf16(c, dy, n, &e));
        float *dw0d = dp(&P, bo_upload_f32(c, dw0, nw, &e));
        void *dyo = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
        float *dhT = k->inplace ? dh0d : dp(&P, bo_alloc_poisoned(c, sizeof(float) * ns, &e));
        void *ddx = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
        float *ddh0 = dp(&P, bo_alloc_poisoned(c, sizeof(float) * ns, &e));
        if ((n > 0 && (!dxd || !dyd || !dyo || !ddx)) || !dwd || (k->state && ns && !dh0d) ||
            !dw0d || (ns && (!dhT || !ddh0))) {
            bo_fail(c, op, shape, &e);
            dp_free(c, &P);
            continue;
        }
        /* the backward reads the initial state, so it runs before an in-place forward */
        if (lm_cuda_short_conv_backward_v(c->cuda, v, &cfg, dxd, dwd, dh0d, dyd, ddx, dw0d, ddh0,
                                          &e) != LM_OK ||
            lm_cuda_short_conv_forward_v(c->cuda, v, &cfg, dxd, dwd, dh0d, dyo, dhT, &e) != LM_OK ||
            bo_download_bf16(c, gy, dyo, n, &e) != LM_OK ||
            bo_download_f32(c, ghT, dhT, ns, &e) != LM_OK ||
            bo_download_bf16(c, gdx, ddx, n, &e) != LM_OK ||
            bo_download_f32(c, gdw, dw0d, nw, &e) != LM_OK ||
            bo_download_f32(c, gdh0, ddh0, ns, &e) != LM_OK) {
            bo_fail(c, op, shape, &e);
            dp_free(c, &P);
            continue;
        }
        if (n > 0)
            bo_check(c, op, "bf16", shape, "y", gy, y, n, BO_TOL_FWD);
        if (ns > 0)
            bo_check(c, op, "f32", shape, "final", ghT, hT, ns, TOL_EXACT);
        if (n > 0)
            bo_check(c, op, "bf16", shape, "dx", gdx, dx, n, BO_TOL_GRAD);
        bo_check(c, op, "f32", shape, "dweight", gdw, dw, nw, TOL_SUM);
        if (ns > 0)
            bo_check(c, op, "f32", shape, "dinitial", gdh0, dh0, ns, TOL_SUM);
        dp_free(c, &P);
    }
out:
    free(x), free(w), free(h0), free(y), free(hT), free(dy), free(dx), free(dw), free(dw0);
    free(dh0), free(gy), free(ghT), free(gdx), free(gdw), free(gdh0);
}

/* Three decode steps on the GPU (state fed back in place) against lm_short_conv_step. */
static void step_case(bo_ctx *c, int B, int C, int W, int silu) {
    const int S = W - 1, steps = 3;
    const int64_t n = (int64_t)B * C, ns = n * S, nw = (int64_t)C * W;
    const lm_activation act = silu ? LM_ACT_SILU : LM_ACT_NONE;
    char shape[64];
    snprintf(shape, sizeof shape, "step B=%d C=%d W=%d%s", B, C, W, silu ? " silu" : "");
    float *x = hbuf(n * steps), *w = hbuf(nw), *st = hbuf(ns), *y = hbuf(n * steps);
    float *gy = hbuf(n * steps), *gst = hbuf(ns);
    bo_fill_normal(c, x, n * steps, 1.0f);
    bo_fill_normal(c, w, nw, 0.5f);
    bo_fill_normal(c, st, ns, 1.0f);
    bo_round_bf16(x, n * steps);
    bo_round_bf16(w, nw);
    lm_error e = {0};
    dpool P = {0};
    void *dxd = dp(&P, bo_upload_bf16(c, x, n * steps, &e));
    void *dwd = dp(&P, bo_upload_bf16(c, w, nw, &e));
    float *dst = ns ? dp(&P, bo_upload_f32(c, st, ns, &e)) : NULL;
    void *dyo = dp(&P, bo_alloc_poisoned(c, (size_t)(n * steps) * 2, &e));
    if (!dxd || !dwd || (ns && !dst) || !dyo) {
        bo_fail(c, "short_conv", shape, &e);
        goto out;
    }
    for (int s = 0; s < steps; s++) {
        if (lm_short_conv_step(B, C, W, act, x + s * n, w, st, y + s * n, &e) != LM_OK ||
            lm_cuda_short_conv_step(c->cuda, B, C, W, act, (const uint16_t *)dxd + s * n, dwd, dst,
                                    (uint16_t *)dyo + s * n, &e) != LM_OK) {
            bo_fail(c, "short_conv", shape, &e);
            goto out;
        }
    }
    if (bo_download_bf16(c, gy, dyo, n * steps, &e) != LM_OK ||
        bo_download_f32(c, gst, dst, ns, &e) != LM_OK) {
        bo_fail(c, "short_conv", shape, &e);
        goto out;
    }
    bo_check(c, "short_conv", "bf16", shape, "y", gy, y, n * steps, BO_TOL_FWD);
    if (ns > 0)
        bo_check(c, "short_conv", "f32", shape, "conv_state", gst, st, ns, TOL_EXACT);
out:
    dp_free(c, &P);
    free(x), free(w), free(st), free(y), free(gy), free(gst);
}

int bo_family_short_conv(bo_ctx *c) {
    const int failed0 = c->failed;
    /* B, T, C, W, silu, state, inplace, ncu, cu */
    const ccase cc[] = {
        {1, 300, 64, 4, 1, 1, 0, 5, {0, 0, 1, 65, 300}},
        {1, 300, 3072, 4, 1, 1, 1, 5, {0, 0, 1, 65, 300}},
        {1, 333, 96, 4, 1, 0, 0, 6, {0, 130, 131, 131, 333, 333}},
        {2, 77, 48, 4, 0, 0, 0, 0, {0}},
        {1, 200, 37, 3, 1, 1, 0, 4, {0, 5, 5, 200}},
        {1, 150, 40, 6, 1, 1, 0, 3, {0, 2, 150}},
        {2, 70, 20, 8, 0, 1, 1, 0, {0}},
        {3, 1, 16, 4, 1, 1, 0, 0, {0}},
        {2, 0, 8, 4, 1, 1, 0, 0, {0}},
        {1, 65, 24, 1, 1, 0, 0, 3, {0, 1, 65}},
        {1, 1000, 128, 2, 1, 1, 0, 4, {0, 1, 129, 1000}},
        {1, 1000, 520, 4, 1, 1, 1, 7, {0, 31, 32, 34, 161, 288, 1000}},
        {1, 129, 16, 4, 0, 1, 0, 3, {0, 2, 129}},
        {2, 200, 1024, 4, 1, 0, 0, 0, {0}},
    };
    for (size_t i = 0; i < sizeof cc / sizeof cc[0]; i++)
        conv_case(c, &cc[i]);
    step_case(c, 5, 40, 4, 1);
    step_case(c, 3, 37, 3, 0);
    step_case(c, 2, 16, 1, 1);
    return c->failed - failed0;
}
