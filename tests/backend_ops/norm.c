/* test_backend_ops family "norm": lm_cuda_rmsnorm_* (with and without the fused
 * residual add / residual gradient) and lm_cuda_gated_rmsnorm_* against the CPU fp32
 * ops lm_rmsnorm_* / lm_gated_rmsnorm_* (src/ops/rmsnorm.c) on the same bf16-rounded
 * inputs.
 *
 * Shapes cover every kernel layout: D = 1024 / 2048 (rows in registers, 32 lanes),
 * D = 64 / Dh = 128 (8 / 16 lanes per row), D = 4096 (rows re-read), D = 1000 and
 * Dh = 100 (not multiples of 8: the scalar path), N = 1 and N = 37 (partial warps).
 * Weight gradients are accumulated into a random prefill (checks the +=); one case runs
 * in place (h over x, dx over dresidual), one without rstd (recomputed) and one
 * without weight. The backward runs twice on one case and the two dweights must be the
 * same bits.
 *
 * Tolerances: y, o: BO_TOL_FWD (bf16 output rounding, ~2e-3). h: exact (both sides
 * round the fp32 sum of the same bf16 values). rstd: 1e-5 (fp32 summation order).
 * dx, dgate: BO_TOL_GRAD (bf16 rounding of the output). dweight: 1e-4 (fp32 sums of the
 * same products against the CPU's fp64: ~1e-6 expected).
 */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_layers.h"
#include "linmoe/layers.h"

#define TOL_EXACT 1e-6
#define TOL_RSTD 1e-5
#define TOL_DW 1e-4

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

/* One bitwise-equality row: out = 0 when equal, 1 otherwise (a 1 fails any tolerance). */
static void check_same_bits(bo_ctx *c, const char *op, const char *shape, const char *tensor,
                            const void *a, const void *b, size_t bytes) {
    const float z = 0.0f, d = memcmp(a, b, bytes) == 0 ? 0.0f : 1.0f;
    bo_check(c, op, "f32", shape, tensor, &d, &z, 1, 0.0);
}

static float *hbuf(int64_t n) { return LM_CALLOC((size_t)(n > 0 ? n : 1), sizeof(float)); }

typedef struct {
    int64_t N;
    int D;
    int weight, residual, inplace, pass_rstd, twice;
} rcase;

static void rmsnorm_case(bo_ctx *c, const rcase *k) {
    const int64_t N = k->N, n = N * k->D;
    const int D = k->D;
    const float eps = 1e-6f;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld D=%d%s%s%s", (long long)N, D, k->residual ? " res" : "",
             k->weight ? "" : " now", k->inplace ? " inpl" : "");
    float *x = hbuf(n), *r = hbuf(n), *w = hbuf(D), *h = hbuf(n), *y = hbuf(n), *rs = hbuf(N);
    float *dy = hbuf(n), *dr = hbuf(n), *dx = hbuf(n), *dw0 = hbuf(D), *dw = hbuf(D);
    float *gy = hbuf(n), *gh = hbuf(n), *grs = hbuf(N), *gdx = hbuf(n), *gdw = hbuf(D);
    float *gdw2 = hbuf(D);
    bo_fill_normal(c, x, n, 1.0f);
    bo_fill_normal(c, r, n, 0.5f);
    bo_fill_normal(c, w, D, 0.1f);
    for (int d = 0; d < D; d++)
        w[d] += 1.0f;
    bo_fill_normal(c, dy, n, 1.0f);
    bo_fill_normal(c, dr, n, 0.3f);
    bo_fill_normal(c, dw0, D, 1.0f);
    bo_round_bf16(x, n);
    bo_round_bf16(r, n);
    bo_round_bf16(w, D);
    bo_round_bf16(dy, n);
    bo_round_bf16(dr, n);
    /* CPU reference */
    lm_error e = {0};
    for (int64_t i = 0; i < n; i++)
        h[i] = k->residual ? lm_bf16_round(x[i] + r[i]) : x[i];
    const float *wr = k->weight ? w : NULL;
    if (lm_rmsnorm_forward(N, D, eps, h, wr, y, rs, &e) != LM_OK ||
        lm_rmsnorm_backward(N, D, eps, h, wr, rs, dy, dx, dw, &e) != LM_OK) {
        bo_fail(c, "rmsnorm", shape, &e);
        goto out;
    }
    for (int64_t i = 0; i < n; i++)
        if (k->residual)
            dx[i] += dr[i];
    for (int d = 0; d < D; d++)
        dw[d] += dw0[d];
    /* GPU */
    dpool P = {0};
    void *dxd = dp(&P, bo_upload_bf16(c, x, n, &e));
    void *drd = k->residual ? dp(&P, bo_upload_bf16(c, r, n, &e)) : NULL;
    void *dwd = k->weight ? dp(&P, bo_upload_bf16(c, w, D, &e)) : NULL;
    void *dyd = dp(&P, bo_upload_bf16(c, dy, n, &e));
    void *ddr = k->residual ? dp(&P, bo_upload_bf16(c, dr, n, &e)) : NULL;
    float *dw0d = dp(&P, bo_upload_f32(c, dw0, D, &e));
    float *dw0d2 = k->twice ? dp(&P, bo_upload_f32(c, dw0, D, &e)) : NULL;
    void *dhd =
        k->residual ? (k->inplace ? dxd : dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e))) : NULL;
    void *dyo = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    float *drs = dp(&P, bo_alloc_poisoned(c, sizeof(float) * (size_t)N, &e));
    void *ddx = k->residual && k->inplace ? ddr : dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    if (!dxd || (k->residual && (!drd || !ddr || !dhd)) || (k->weight && !dwd) || !dyd || !dw0d ||
        (k->twice && !dw0d2) || !dyo || !drs || !ddx) {
        bo_fail(c, "rmsnorm", shape, &e);
        dp_free(c, &P);
        goto out;
    }
    const void *hin = k->residual ? dhd : dxd;
    if (lm_cuda_rmsnorm_forward(c->cuda, N, D, eps, dxd, drd, dwd, dhd, dyo, drs, &e) != LM_OK ||
        lm_cuda_rmsnorm_backward(c->cuda, N, D, eps, hin, dwd, k->pass_rstd ? drs : NULL, dyd, ddr,
                                 ddx, dw0d, &e) != LM_OK ||
        (k->twice && lm_cuda_rmsnorm_backward(c->cuda, N, D, eps, hin, dwd, drs, dyd, NULL, NULL,
                                              dw0d2, &e) != LM_OK) ||
        bo_download_bf16(c, gy, dyo, n, &e) != LM_OK ||
        bo_download_f32(c, grs, drs, N, &e) != LM_OK ||
        bo_download_bf16(c, gdx, ddx, n, &e) != LM_OK ||
        bo_download_f32(c, gdw, dw0d, D, &e) != LM_OK ||
        (k->residual && bo_download_bf16(c, gh, hin, n, &e) != LM_OK) ||
        (k->twice && bo_download_f32(c, gdw2, dw0d2, D, &e) != LM_OK)) {
        bo_fail(c, "rmsnorm", shape, &e);
        dp_free(c, &P);
        goto out;
    }
    if (k->residual)
        bo_check(c, "rmsnorm", "bf16", shape, "h", gh, h, n, TOL_EXACT);
    bo_check(c, "rmsnorm", "bf16", shape, "y", gy, y, n, BO_TOL_FWD);
    bo_check(c, "rmsnorm", "f32", shape, "rstd", grs, rs, N, TOL_RSTD);
    bo_check(c, "rmsnorm", "bf16", shape, "dx", gdx, dx, n, BO_TOL_GRAD);
    if (k->weight)
        bo_check(c, "rmsnorm", "f32", shape, "dweight", gdw, dw, D, TOL_DW);
    else
        bo_check(c, "rmsnorm", "f32", shape, "dw untouch", gdw, dw0, D, 0.0);
    if (k->twice)
        check_same_bits(c, "rmsnorm", shape, "dw rerun", gdw, gdw2, sizeof(float) * (size_t)D);
    dp_free(c, &P);
out:
    free(x), free(r), free(w), free(h), free(y), free(rs), free(dy), free(dr), free(dx);
    free(dw0), free(dw), free(gy), free(gh), free(grs), free(gdx), free(gdw), free(gdw2);
}

typedef struct {
    int64_t N;
    int H, Dh, weight, pass_rstd;
} gcase;

static void gated_case(bo_ctx *c, const gcase *k) {
    const int64_t N = k->N, R = N * k->H, n = R * k->Dh;
    const int Dh = k->Dh;
    const float eps = LM_GATED_RMSNORM_EPS;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld H=%d Dh=%d%s", (long long)N, k->H, Dh,
             k->weight ? "" : " now");
    float *x = hbuf(n), *g = hbuf(n), *w = hbuf(Dh), *o = hbuf(n), *rs = hbuf(R);
    float *dov = hbuf(n), *dx = hbuf(n), *dg = hbuf(n), *dw0 = hbuf(Dh), *dw = hbuf(Dh);
    float *go = hbuf(n), *grs = hbuf(R), *gdx = hbuf(n), *gdg = hbuf(n), *gdw = hbuf(Dh);
    bo_fill_normal(c, x, n, 1.0f);
    bo_fill_normal(c, g, n, 1.5f);
    bo_fill_normal(c, w, Dh, 0.1f);
    for (int d = 0; d < Dh; d++)
        w[d] += 1.0f;
    bo_fill_normal(c, dov, n, 1.0f);
    bo_fill_normal(c, dw0, Dh, 1.0f);
    bo_round_bf16(x, n);
    bo_round_bf16(g, n);
    bo_round_bf16(w, Dh);
    bo_round_bf16(dov, n);
    lm_error e = {0};
    const float *wr = k->weight ? w : NULL;
    if (lm_gated_rmsnorm_forward(N, k->H, Dh, eps, x, g, wr, o, rs, &e) != LM_OK ||
        lm_gated_rmsnorm_backward(N, k->H, Dh, eps, x, g, wr, rs, dov, dx, dg, dw, &e) != LM_OK) {
        bo_fail(c, "gated_rmsnorm", shape, &e);
        goto out;
    }
    for (int d = 0; d < Dh; d++)
        dw[d] += dw0[d];
    dpool P = {0};
    void *dxd = dp(&P, bo_upload_bf16(c, x, n, &e));
    void *dgd = dp(&P, bo_upload_bf16(c, g, n, &e));
    void *dwd = k->weight ? dp(&P, bo_upload_bf16(c, w, Dh, &e)) : NULL;
    void *dod = dp(&P, bo_upload_bf16(c, dov, n, &e));
    float *dw0d = dp(&P, bo_upload_f32(c, dw0, Dh, &e));
    void *doo = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    float *drs = dp(&P, bo_alloc_poisoned(c, sizeof(float) * (size_t)R, &e));
    void *ddx = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    void *ddg = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    if (!dxd || !dgd || (k->weight && !dwd) || !dod || !dw0d || !doo || !drs || !ddx || !ddg) {
        bo_fail(c, "gated_rmsnorm", shape, &e);
        dp_free(c, &P);
        goto out;
    }
    if (lm_cuda_gated_rmsnorm_forward(c->cuda, N, k->H, Dh, eps, dxd, dgd, dwd, doo, drs, &e) !=
            LM_OK ||
        lm_cuda_gated_rmsnorm_backward(c->cuda, N, k->H, Dh, eps, dxd, dgd, dwd,
                                       k->pass_rstd ? drs : NULL, dod, ddx, ddg, dw0d,
                                       &e) != LM_OK ||
        bo_download_bf16(c, go, doo, n, &e) != LM_OK ||
        bo_download_f32(c, grs, drs, R, &e) != LM_OK ||
        bo_download_bf16(c, gdx, ddx, n, &e) != LM_OK ||
        bo_download_bf16(c, gdg, ddg, n, &e) != LM_OK ||
        bo_download_f32(c, gdw, dw0d, Dh, &e) != LM_OK) {
        bo_fail(c, "gated_rmsnorm", shape, &e);
        dp_free(c, &P);
        goto out;
    }
    bo_check(c, "gated_rmsnorm", "bf16", shape, "o", go, o, n, BO_TOL_FWD);
    bo_check(c, "gated_rmsnorm", "f32", shape, "rstd", grs, rs, R, TOL_RSTD);
    bo_check(c, "gated_rmsnorm", "bf16", shape, "dx", gdx, dx, n, BO_TOL_GRAD);
    bo_check(c, "gated_rmsnorm", "bf16", shape, "dgate", gdg, dg, n, BO_TOL_GATE_GRAD);
    if (k->weight)
        bo_check(c, "gated_rmsnorm", "f32", shape, "dweight", gdw, dw, Dh, TOL_DW);
    dp_free(c, &P);
out:
    free(x), free(g), free(w), free(o), free(rs), free(dov), free(dx), free(dg), free(dw0);
    free(dw), free(go), free(grs), free(gdx), free(gdg), free(gdw);
}

int bo_family_norm(bo_ctx *c) {
    const int failed0 = c->failed;
    /* N, D, weight, residual, inplace, pass_rstd, twice */
    const rcase rc[] = {
        {1, 1024, 1, 0, 0, 1, 0},   {37, 1000, 1, 1, 0, 1, 0}, {37, 2048, 1, 1, 1, 1, 1},
        {300, 64, 1, 0, 0, 1, 0},   {40, 4096, 1, 1, 0, 0, 0}, {200, 1024, 0, 0, 0, 0, 0},
        {513, 2048, 1, 0, 0, 1, 1}, {129, 200, 1, 1, 0, 1, 0},
    };
    for (size_t i = 0; i < sizeof rc / sizeof rc[0]; i++)
        rmsnorm_case(c, &rc[i]);
    /* N, H, Dh, weight, pass_rstd */
    const gcase gc[] = {
        {37, 8, 128, 1, 1}, {1, 16, 128, 1, 1}, {45, 3, 100, 1, 0},
        {20, 4, 64, 1, 1},  {33, 2, 256, 0, 1}, {300, 16, 128, 1, 1},
    };
    for (size_t i = 0; i < sizeof gc / sizeof gc[0]; i++)
        gated_case(c, &gc[i]);
    return c->failed - failed0;
}
