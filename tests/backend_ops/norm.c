/* test_backend_ops family "norm": lm_cuda_rmsnorm_* (with and without the fused
 * residual add / residual gradient) and lm_cuda_gated_rmsnorm_* against the CPU fp32
 * ops lm_rmsnorm_* / lm_gated_rmsnorm_* (src/ops/rmsnorm.c) on the same bf16-rounded
 * inputs.
 *
 * Every case runs through the public entry points (the default variants, op "rmsnorm")
 * and through each kernel variant of src/ops/cuda/layers_variants.h (op
 * "rmsnorm/f<forward variant>b<backward variant>": f1b1, f2b1, f1b2, so that every forward and
 * every backward variant is covered; the first backward kernels, the fallback of the
 * backward, run the scalar (D = 1000, Dh = 100) and re-read (D = 4096) shapes).
 *
 * Shapes cover every kernel layout: D = 1024 / 2048 (rows in registers, 32 lanes),
 * D = 256 / 512 (one / two vectors per lane: several rows per lane group in the v2
 * kernels), D = 64 / 128 and Dh = 128 (8 / 16 lanes per row), D = 4096 (rows re-read),
 * D = 1000 and Dh = 100 (not multiples of 8: the scalar path), N = 1, N = 37 and R = 15
 * (partial warps and partial multi-row steps), N = 20011 / 9001 and N*H = 48016 (several
 * sweeps of the persistent grids). Weight gradients are accumulated into a random
 * prefill (checks the +=); cases run in place (h over x, dx over dresidual), without
 * rstd (recomputed) and without weight. The backward runs twice on some cases (the
 * second time with neither dx nor the residual gradient) and the two dweights must be
 * the same bits. A backward given rstd and one without it may run different kernels
 * (layers_variants.h), whose dweight sums differ in order: both are checked against the
 * CPU.
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
#include "ops/cuda/layers_variants.h"

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

/* (forward, backward) variants: 0 = the public entry points */
static const int VPAIRS[][2] = {{0, 0}, {1, 1}, {2, 1}, {1, 2}};
#define NVPAIRS ((int)(sizeof VPAIRS / sizeof VPAIRS[0]))

static void op_name(char *buf, size_t n, const char *base, int vp) {
    if (VPAIRS[vp][0] == 0)
        snprintf(buf, n, "%s", base);
    else
        snprintf(buf, n, "%s/f%db%d", base, VPAIRS[vp][0], VPAIRS[vp][1]);
}

typedef struct {
    int64_t N;
    int D;
    int weight, residual, inplace, pass_rstd, twice;
} rcase;

/* Host inputs and CPU references of one RMSNorm case. */
typedef struct {
    float *x, *r, *w, *h, *y, *rs, *dy, *dr, *dx, *dw0, *dw;
} rhost;

/* The GPU side of one case with the variant pair vp, checked against the references. */
static void rmsnorm_gpu(bo_ctx *c, const rcase *k, const rhost *H, int vp, const char *shape) {
    const int64_t N = k->N, n = N * k->D;
    const int D = k->D;
    const float eps = 1e-6f;
    const int fv = VPAIRS[vp][0], bv = VPAIRS[vp][1];
    char op[48];
    op_name(op, sizeof op, "rmsnorm", vp);
    float *gy = hbuf(n), *gh = hbuf(n), *grs = hbuf(N), *gdx = hbuf(n), *gdw = hbuf(D);
    float *gdw2 = hbuf(D);
    lm_error e = {0};
    dpool P = {0};
    void *dxd = dp(&P, bo_upload_bf16(c, H->x, n, &e));
    void *drd = k->residual ? dp(&P, bo_upload_bf16(c, H->r, n, &e)) : NULL;
    void *dwd = k->weight ? dp(&P, bo_upload_bf16(c, H->w, D, &e)) : NULL;
    void *dyd = dp(&P, bo_upload_bf16(c, H->dy, n, &e));
    void *ddr = k->residual ? dp(&P, bo_upload_bf16(c, H->dr, n, &e)) : NULL;
    float *dw0d = dp(&P, bo_upload_f32(c, H->dw0, D, &e));
    float *dw0d2 = k->twice ? dp(&P, bo_upload_f32(c, H->dw0, D, &e)) : NULL;
    void *dhd =
        k->residual ? (k->inplace ? dxd : dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e))) : NULL;
    void *dyo = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    float *drs = dp(&P, bo_alloc_poisoned(c, sizeof(float) * (size_t)N, &e));
    void *ddx = k->residual && k->inplace ? ddr : dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    if (!dxd || (k->residual && (!drd || !ddr || !dhd)) || (k->weight && !dwd) || !dyd || !dw0d ||
        (k->twice && !dw0d2) || !dyo || !drs || !ddx) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    const void *hin = k->residual ? dhd : dxd;
    lm_status st =
        fv == 0
            ? lm_cuda_rmsnorm_forward(c->cuda, N, D, eps, dxd, drd, dwd, dhd, dyo, drs, &e)
            : lm_cuda_rmsnorm_forward_v(c->cuda, fv, N, D, eps, dxd, drd, dwd, dhd, dyo, drs, &e);
    if (st == LM_OK)
        st = bv == 0
                 ? lm_cuda_rmsnorm_backward(c->cuda, N, D, eps, hin, dwd, k->pass_rstd ? drs : NULL,
                                            dyd, ddr, ddx, dw0d, &e)
                 : lm_cuda_rmsnorm_backward_v(c->cuda, bv, N, D, eps, hin, dwd,
                                              k->pass_rstd ? drs : NULL, dyd, ddr, ddx, dw0d, &e);
    if (st == LM_OK && k->twice) /* the same statistic argument: the same kernel */
        st = lm_cuda_rmsnorm_backward_v(c->cuda, bv, N, D, eps, hin, dwd,
                                        k->pass_rstd ? drs : NULL, dyd, NULL, NULL, dw0d2, &e);
    if (st != LM_OK || bo_download_bf16(c, gy, dyo, n, &e) != LM_OK ||
        bo_download_f32(c, grs, drs, N, &e) != LM_OK ||
        bo_download_bf16(c, gdx, ddx, n, &e) != LM_OK ||
        bo_download_f32(c, gdw, dw0d, D, &e) != LM_OK ||
        (k->residual && bo_download_bf16(c, gh, hin, n, &e) != LM_OK) ||
        (k->twice && bo_download_f32(c, gdw2, dw0d2, D, &e) != LM_OK)) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    if (k->residual)
        bo_check(c, op, "bf16", shape, "h", gh, H->h, n, TOL_EXACT);
    bo_check(c, op, "bf16", shape, "y", gy, H->y, n, BO_TOL_FWD);
    bo_check(c, op, "f32", shape, "rstd", grs, H->rs, N, TOL_RSTD);
    bo_check(c, op, "bf16", shape, "dx", gdx, H->dx, n, BO_TOL_GRAD);
    if (k->weight)
        bo_check(c, op, "f32", shape, "dweight", gdw, H->dw, D, TOL_DW);
    else
        bo_check(c, op, "f32", shape, "dw untouch", gdw, H->dw0, D, 0.0);
    if (k->twice)
        check_same_bits(c, op, shape, "dw rerun", gdw, gdw2, sizeof(float) * (size_t)D);
out:
    dp_free(c, &P);
    free(gy), free(gh), free(grs), free(gdx), free(gdw), free(gdw2);
}

static void rmsnorm_case(bo_ctx *c, const rcase *k) {
    const int64_t N = k->N, n = N * k->D;
    const int D = k->D;
    const float eps = 1e-6f;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld D=%d%s%s%s%s", (long long)N, D, k->residual ? " res" : "",
             k->weight ? "" : " now", k->inplace ? " inpl" : "", k->pass_rstd ? "" : " nors");
    rhost H;
    H.x = hbuf(n), H.r = hbuf(n), H.w = hbuf(D), H.h = hbuf(n), H.y = hbuf(n), H.rs = hbuf(N);
    H.dy = hbuf(n), H.dr = hbuf(n), H.dx = hbuf(n), H.dw0 = hbuf(D), H.dw = hbuf(D);
    bo_fill_normal(c, H.x, n, 1.0f);
    bo_fill_normal(c, H.r, n, 0.5f);
    bo_fill_normal(c, H.w, D, 0.1f);
    for (int d = 0; d < D; d++)
        H.w[d] += 1.0f;
    bo_fill_normal(c, H.dy, n, 1.0f);
    bo_fill_normal(c, H.dr, n, 0.3f);
    bo_fill_normal(c, H.dw0, D, 1.0f);
    bo_round_bf16(H.x, n);
    bo_round_bf16(H.r, n);
    bo_round_bf16(H.w, D);
    bo_round_bf16(H.dy, n);
    bo_round_bf16(H.dr, n);
    /* CPU reference */
    lm_error e = {0};
    for (int64_t i = 0; i < n; i++)
        H.h[i] = k->residual ? lm_bf16_round(H.x[i] + H.r[i]) : H.x[i];
    const float *wr = k->weight ? H.w : NULL;
    if (lm_rmsnorm_forward(N, D, eps, H.h, wr, H.y, H.rs, &e) != LM_OK ||
        lm_rmsnorm_backward(N, D, eps, H.h, wr, H.rs, H.dy, H.dx, H.dw, &e) != LM_OK) {
        bo_fail(c, "rmsnorm", shape, &e);
    } else {
        for (int64_t i = 0; i < n; i++)
            if (k->residual)
                H.dx[i] += H.dr[i];
        for (int d = 0; d < D; d++)
            H.dw[d] += H.dw0[d];
        for (int vp = 0; vp < NVPAIRS; vp++)
            rmsnorm_gpu(c, k, &H, vp, shape);
    }
    free(H.x), free(H.r), free(H.w), free(H.h), free(H.y), free(H.rs), free(H.dy), free(H.dr);
    free(H.dx), free(H.dw0), free(H.dw);
}

typedef struct {
    int64_t N;
    int H, Dh, weight, pass_rstd;
} gcase;

typedef struct {
    float *x, *g, *w, *o, *rs, *dov, *dx, *dg, *dw0, *dw;
} ghost;

static void gated_gpu(bo_ctx *c, const gcase *k, const ghost *G, int vp, const char *shape) {
    const int64_t N = k->N, R = N * k->H, n = R * k->Dh;
    const int Dh = k->Dh;
    const float eps = LM_GATED_RMSNORM_EPS;
    const int fv = VPAIRS[vp][0], bv = VPAIRS[vp][1];
    char op[48];
    op_name(op, sizeof op, "gated_rmsnorm", vp);
    float *go = hbuf(n), *grs = hbuf(R), *gdx = hbuf(n), *gdg = hbuf(n), *gdw = hbuf(Dh);
    lm_error e = {0};
    dpool P = {0};
    void *dxd = dp(&P, bo_upload_bf16(c, G->x, n, &e));
    void *dgd = dp(&P, bo_upload_bf16(c, G->g, n, &e));
    void *dwd = k->weight ? dp(&P, bo_upload_bf16(c, G->w, Dh, &e)) : NULL;
    void *dod = dp(&P, bo_upload_bf16(c, G->dov, n, &e));
    float *dw0d = dp(&P, bo_upload_f32(c, G->dw0, Dh, &e));
    void *doo = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    float *drs = dp(&P, bo_alloc_poisoned(c, sizeof(float) * (size_t)R, &e));
    void *ddx = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    void *ddg = dp(&P, bo_alloc_poisoned(c, (size_t)n * 2, &e));
    if (!dxd || !dgd || (k->weight && !dwd) || !dod || !dw0d || !doo || !drs || !ddx || !ddg) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    const float *rsin = k->pass_rstd ? drs : NULL;
    lm_status st = fv == 0 ? lm_cuda_gated_rmsnorm_forward(c->cuda, N, k->H, Dh, eps, dxd, dgd, dwd,
                                                           doo, drs, &e)
                           : lm_cuda_gated_rmsnorm_forward_v(c->cuda, fv, N, k->H, Dh, eps, dxd,
                                                             dgd, dwd, doo, drs, &e);
    if (st == LM_OK)
        st = bv == 0 ? lm_cuda_gated_rmsnorm_backward(c->cuda, N, k->H, Dh, eps, dxd, dgd, dwd,
                                                      rsin, dod, ddx, ddg, dw0d, &e)
                     : lm_cuda_gated_rmsnorm_backward_v(c->cuda, bv, N, k->H, Dh, eps, dxd, dgd,
                                                        dwd, rsin, dod, ddx, ddg, dw0d, &e);
    if (st != LM_OK || bo_download_bf16(c, go, doo, n, &e) != LM_OK ||
        bo_download_f32(c, grs, drs, R, &e) != LM_OK ||
        bo_download_bf16(c, gdx, ddx, n, &e) != LM_OK ||
        bo_download_bf16(c, gdg, ddg, n, &e) != LM_OK ||
        bo_download_f32(c, gdw, dw0d, Dh, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    bo_check(c, op, "bf16", shape, "o", go, G->o, n, BO_TOL_FWD);
    bo_check(c, op, "f32", shape, "rstd", grs, G->rs, R, TOL_RSTD);
    bo_check(c, op, "bf16", shape, "dx", gdx, G->dx, n, BO_TOL_GRAD);
    bo_check(c, op, "bf16", shape, "dgate", gdg, G->dg, n, BO_TOL_GATE_GRAD);
    if (k->weight)
        bo_check(c, op, "f32", shape, "dweight", gdw, G->dw, Dh, TOL_DW);
out:
    dp_free(c, &P);
    free(go), free(grs), free(gdx), free(gdg), free(gdw);
}

static void gated_case(bo_ctx *c, const gcase *k) {
    const int64_t N = k->N, R = N * k->H, n = R * k->Dh;
    const int Dh = k->Dh;
    const float eps = LM_GATED_RMSNORM_EPS;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld H=%d Dh=%d%s%s", (long long)N, k->H, Dh,
             k->weight ? "" : " now", k->pass_rstd ? "" : " nors");
    ghost G;
    G.x = hbuf(n), G.g = hbuf(n), G.w = hbuf(Dh), G.o = hbuf(n), G.rs = hbuf(R);
    G.dov = hbuf(n), G.dx = hbuf(n), G.dg = hbuf(n), G.dw0 = hbuf(Dh), G.dw = hbuf(Dh);
    bo_fill_normal(c, G.x, n, 1.0f);
    bo_fill_normal(c, G.g, n, 1.5f);
    bo_fill_normal(c, G.w, Dh, 0.1f);
    for (int d = 0; d < Dh; d++)
        G.w[d] += 1.0f;
    bo_fill_normal(c, G.dov, n, 1.0f);
    bo_fill_normal(c, G.dw0, Dh, 1.0f);
    bo_round_bf16(G.x, n);
    bo_round_bf16(G.g, n);
    bo_round_bf16(G.w, Dh);
    bo_round_bf16(G.dov, n);
    lm_error e = {0};
    const float *wr = k->weight ? G.w : NULL;
    if (lm_gated_rmsnorm_forward(N, k->H, Dh, eps, G.x, G.g, wr, G.o, G.rs, &e) != LM_OK ||
        lm_gated_rmsnorm_backward(N, k->H, Dh, eps, G.x, G.g, wr, G.rs, G.dov, G.dx, G.dg, G.dw,
                                  &e) != LM_OK) {
        bo_fail(c, "gated_rmsnorm", shape, &e);
    } else {
        for (int d = 0; d < Dh; d++)
            G.dw[d] += G.dw0[d];
        for (int vp = 0; vp < NVPAIRS; vp++)
            gated_gpu(c, k, &G, vp, shape);
    }
    free(G.x), free(G.g), free(G.w), free(G.o), free(G.rs), free(G.dov), free(G.dx), free(G.dg);
    free(G.dw0), free(G.dw);
}

int bo_family_norm(bo_ctx *c) {
    const int failed0 = c->failed;
    /* N, D, weight, residual, inplace, pass_rstd, twice */
    const rcase rc[] = {
        {1, 1024, 1, 0, 0, 1, 0},     {37, 1000, 1, 1, 0, 1, 0},   {37, 2048, 1, 1, 1, 1, 1},
        {300, 64, 1, 0, 0, 1, 0},     {40, 4096, 1, 1, 0, 0, 0},   {200, 1024, 0, 0, 0, 0, 0},
        {513, 2048, 1, 0, 0, 1, 1},   {129, 200, 1, 1, 0, 1, 0},   {37, 1024, 1, 0, 0, 1, 0},
        {77, 512, 1, 0, 0, 1, 0},     {45, 256, 1, 1, 0, 0, 0},    {101, 128, 1, 1, 1, 1, 0},
        {20011, 1024, 1, 0, 0, 1, 1}, {9001, 2048, 1, 1, 0, 1, 0}, {3000, 1024, 1, 1, 1, 0, 1},
    };
    for (size_t i = 0; i < sizeof rc / sizeof rc[0]; i++)
        rmsnorm_case(c, &rc[i]);
    /* N, H, Dh, weight, pass_rstd */
    const gcase gc[] = {
        {37, 8, 128, 1, 1}, {1, 16, 128, 1, 1},    {45, 3, 100, 1, 0}, {20, 4, 64, 1, 1},
        {33, 2, 256, 0, 1}, {300, 16, 128, 1, 1},  {5, 3, 128, 1, 0},  {7, 2, 1024, 1, 1},
        {9, 4, 512, 1, 0},  {3001, 16, 128, 1, 1},
    };
    for (size_t i = 0; i < sizeof gc / sizeof gc[0]; i++)
        gated_case(c, &gc[i]);
    return c->failed - failed0;
}
