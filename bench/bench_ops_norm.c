/* `linmoe bench ops` family "norm" (bench/bench_ops.h): lm_cuda_rmsnorm_* (plain and
 * with the fused residual add / residual gradient) and lm_cuda_gated_rmsnorm_* at the
 * GPU configs' shapes: N = 32768 tokens, D = 1024 and 2048; the KDA output norm with
 * H = 8 and 16 heads of Dh = 128.
 *
 * Rows (name, shape, pass), paired by scripts/gpu/ops_peers/norm.py:
 *   rmsnorm           N=32768 D=1024|2048        fwd, fwd+bwd
 *   rmsnorm_residual  N=32768 D=1024|2048        fwd, fwd+bwd
 *   gated_rmsnorm     N=32768 H=8|16 Dh=128      fwd, fwd+bwd
 * (the public entry points: the default variants), then the kernel variants side by
 * side (src/ops/cuda/layers_variants.h; no peer rows):
 *   <name>/f<F>b<B>   the same shapes            fwd (forward variant F), fwd+bwd (F, B)
 *                     for (F, B) = (1, 1), (2, 1), (1, 2)
 *   <name>/b<B>       the same shapes            bwd (backward variant B alone, B = 1, 2)
 * (the variants were renumbered when the losers of the 2026-12-01 A/B test left:
 * dev/layers_variants.md; today's f1b1 / f2b1 / b1 are the earlier f3b2 / f4b2 / b2)
 * Bytes (each tensor once, bf16 = 2 bytes): rmsnorm forward x, y (+ residual, h) and
 * rstd; backward x, dy, dx (+ dresidual), rstd, dweight read and written; gated forward
 * x, gate, o; backward x, gate, do, dx, dgate. The weight gradient's per-CTA partials
 * (a few hundred rows of D fp32, in L2) are not counted: they are not bytes the op must
 * move. FLOPs: a rough count (the floor is the bytes). Inputs N(0,1) on the device,
 * weights 1 + N(0, 0.1). */
#include <stdio.h>

#include "bench_ops.h"
#include "linmoe/cuda_layers.h"
#include "ops/cuda/layers_variants.h"

typedef struct {
    lm_cuda_ctx *ctx;
    int64_t N;
    int H, D, gated, residual;
    int fwd, bwd; /* passes to run */
    int fv, bv;   /* variants (0 = the public entry points) */
    void *x, *r, *g, *w, *h, *y, *dy, *dr, *dx, *dg;
    float *rstd, *dw;
} norm_arg;

static int norm_run(void *p) {
    norm_arg *a = p;
    lm_error e = {0};
    lm_status st = LM_OK;
    if (a->gated) {
        if (a->fwd)
            st = lm_cuda_gated_rmsnorm_forward_v(a->ctx, a->fv, a->N, a->H, a->D,
                                                 LM_GATED_RMSNORM_EPS, a->x, a->g, a->w, a->y,
                                                 a->rstd, &e);
        if (st == LM_OK && a->bwd)
            st = lm_cuda_gated_rmsnorm_backward_v(a->ctx, a->bv, a->N, a->H, a->D,
                                                  LM_GATED_RMSNORM_EPS, a->x, a->g, a->w, a->rstd,
                                                  a->dy, a->dx, a->dg, a->dw, &e);
    } else {
        if (a->fwd)
            st =
                lm_cuda_rmsnorm_forward_v(a->ctx, a->fv, a->N, a->D, 1e-6f, a->x,
                                          a->residual ? a->r : NULL, a->w, a->h, a->y, a->rstd, &e);
        if (st == LM_OK && a->bwd)
            st = lm_cuda_rmsnorm_backward_v(a->ctx, a->bv, a->N, a->D, 1e-6f,
                                            a->residual ? a->h : a->x, a->w, a->rstd, a->dy,
                                            a->residual ? a->dr : NULL, a->dx, a->dw, &e);
    }
    if (st != LM_OK)
        fprintf(stderr, "bench ops norm: %s\n", e.msg);
    return st != LM_OK;
}

/* Times one row: passes fwd / bwd with variants fv / bv. Returns 0, 1 on error. */
static int norm_row(lm_bench_ops_env *env, norm_arg *a, const char *name, const char *shape,
                    int fwd, int bwd, int fv, int bv) {
    const double nd = (double)a->N * a->H * a->D, rows = (double)a->N * a->H;
    double fb = 0, ff = 0;
    if (a->gated) {
        if (fwd)
            fb += 6 * nd + 4 * rows + 2.0 * a->D, ff += 8 * nd;
        if (bwd)
            fb += 10 * nd + 4 * rows + 2.0 * a->D + 8.0 * a->D, ff += 20 * nd;
    } else {
        if (fwd)
            fb += (a->residual ? 8 : 4) * nd + 4 * rows + 2.0 * a->D, ff += 4 * nd;
        if (bwd)
            fb += (a->residual ? 8 : 6) * nd + 4 * rows + 2.0 * a->D + 8.0 * a->D, ff += 10 * nd;
    }
    a->fwd = fwd, a->bwd = bwd, a->fv = fv, a->bv = bv;
    const double ms = lm_bench_ops_time(env, norm_run, a);
    if (ms < 0)
        return 1;
    lm_bench_ops_row(env, name, shape,
                     fwd && bwd ? "fwd+bwd"
                     : fwd      ? "fwd"
                                : "bwd",
                     ms, ff, fb, (double)a->N);
    return 0;
}

static void *dalloc(lm_bench_ops_env *env, size_t bytes, int *bad) {
    void *p = NULL;
    lm_error e = {0};
    if (lm_cuda_ctx_alloc(env->ctx, &p, bytes, &e) != LM_OK) {
        fprintf(stderr, "bench ops norm: %s\n", e.msg);
        *bad = 1;
    }
    return p;
}

static int fill(lm_bench_ops_env *env, void *p, int64_t n, uint64_t seed, float mean, float std) {
    lm_error e = {0};
    if (lm_cuda_fill_normal_bf16(env->ctx, p, n, seed, mean, std, &e) != LM_OK) {
        fprintf(stderr, "bench ops norm: %s\n", e.msg);
        return 1;
    }
    return 0;
}

int lm_bench_ops_norm(lm_bench_ops_env *env) {
    const int64_t N = 32768;
    const int64_t maxn = N * 2048;
    int bad = 0;
    norm_arg a = {0};
    a.ctx = env->ctx;
    a.x = dalloc(env, (size_t)maxn * 2, &bad);
    a.r = dalloc(env, (size_t)maxn * 2, &bad);
    a.g = dalloc(env, (size_t)maxn * 2, &bad);
    a.w = dalloc(env, 2048 * 2, &bad);
    a.h = dalloc(env, (size_t)maxn * 2, &bad);
    a.y = dalloc(env, (size_t)maxn * 2, &bad);
    a.dy = dalloc(env, (size_t)maxn * 2, &bad);
    a.dr = dalloc(env, (size_t)maxn * 2, &bad);
    a.dx = dalloc(env, (size_t)maxn * 2, &bad);
    a.dg = dalloc(env, (size_t)maxn * 2, &bad);
    a.rstd = dalloc(env, sizeof(float) * (size_t)N * 16, &bad);
    a.dw = dalloc(env, sizeof(float) * 2048, &bad);
    int rc = bad;
    if (!bad)
        rc = fill(env, a.x, maxn, 11, 0.0f, 1.0f) || fill(env, a.r, maxn, 12, 0.0f, 1.0f) ||
             fill(env, a.g, maxn, 13, 0.0f, 1.0f) || fill(env, a.w, 2048, 14, 1.0f, 0.1f) ||
             fill(env, a.dy, maxn, 15, 0.0f, 1.0f) || fill(env, a.dr, maxn, 16, 0.0f, 1.0f);
    lm_error e = {0};
    if (!rc && lm_cuda_ctx_memset(env->ctx, a.dw, 0, sizeof(float) * 2048, &e) != LM_OK)
        rc = 1;
    for (int kind = 0; kind < 3 && !rc; kind++) {
        for (int s = 0; s < 2 && !rc; s++) {
            a.gated = kind == 2;
            a.residual = kind == 1;
            a.H = a.gated ? (s ? 16 : 8) : 1;
            a.D = a.gated ? 128 : (s ? 2048 : 1024);
            a.N = N;
            char shape[64];
            const char *name = a.gated      ? "gated_rmsnorm"
                               : a.residual ? "rmsnorm_residual"
                                            : "rmsnorm";
            if (a.gated)
                snprintf(shape, sizeof shape, "N=%lld H=%d Dh=%d", (long long)N, a.H, a.D);
            else
                snprintf(shape, sizeof shape, "N=%lld D=%d", (long long)N, a.D);
            /* the public entry points, then every variant */
            rc = norm_row(env, &a, name, shape, 1, 0, 0, 0) ||
                 norm_row(env, &a, name, shape, 1, 1, 0, 0);
            static const int VP[][2] = {{1, 1}, {2, 1}, {1, 2}};
            for (int v = 0; v < (int)(sizeof VP / sizeof VP[0]) && !rc; v++) {
                char vname[48];
                snprintf(vname, sizeof vname, "%s/f%db%d", name, VP[v][0], VP[v][1]);
                rc = norm_row(env, &a, vname, shape, 1, 0, VP[v][0], VP[v][1]) ||
                     norm_row(env, &a, vname, shape, 1, 1, VP[v][0], VP[v][1]);
            }
            for (int b = 1; b <= LM_LAYERS_NORM_BWD_VARIANTS && !rc; b++) {
                char vname[48];
                snprintf(vname, sizeof vname, "%s/b%d", name, b);
                rc = norm_row(env, &a, vname, shape, 0, 1, 0, b);
            }
        }
    }
    void *ptrs[] = {a.x, a.r, a.g, a.w, a.h, a.y, a.dy, a.dr, a.dx, a.dg, a.rstd, a.dw};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        lm_cuda_ctx_free_mem(env->ctx, ptrs[i]);
    return rc;
}
