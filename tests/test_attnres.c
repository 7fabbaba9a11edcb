/* AttnRes aggregation op (include/linmoe/attnres.h) against an fp64 reference.
 *
 * The reference below is written the way fla's naive_attnres states the op
 * (reference/attnres_ctx.md §1.8: the gain inside the key, k = rms_norm(v) * g,
 * logits k . (w * scale)) and its backward through the textbook RMSNorm backward,
 * not the folded u = w (.) g form the C kernel uses (§4.3), so the two are not the
 * same formula twice. The reference backward is itself checked against central
 * finite differences of the reference forward for every input element.
 *
 * Tolerances: TOL_FWD_F32 / TOL_BWD_F32 / TOL_FD from test_util.h; the zero-query
 * mean is held to 1e-6 absolute (sources are O(1): p = 1/L rounds once, the sum
 * of L fp32 products adds a few ulp).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "linmoe/attnres.h"
#include "linmoe/core.h"

/* ---------------------------------------------------------------- fp64 reference */

/* One row's softmax weights p[L] (and, when k is given, the keys k[L*D] with gain,
 * r[L]); src row m at src + m*stride. */
static void ref_row(int L, int D, const double *src, int64_t stride, const double *w,
                    const double *g, double eps, double scale, double *p, double *k, double *r) {
    double mx = -INFINITY;
    for (int m = 0; m < L; m++) {
        const double *x = src + m * stride;
        double ms = 0.0;
        for (int j = 0; j < D; j++)
            ms += x[j] * x[j];
        ms /= D;
        const double rm = 1.0 / sqrt(ms + eps);
        double s = 0.0;
        for (int j = 0; j < D; j++) {
            const double kj = x[j] * rm * g[j];
            if (k)
                k[(size_t)m * D + j] = kj;
            s += kj * (w[j] * scale);
        }
        if (r)
            r[m] = rm;
        p[m] = s;
        if (s > mx)
            mx = s;
    }
    double z = 0.0;
    for (int m = 0; m < L; m++)
        z += (p[m] = exp(p[m] - mx));
    for (int m = 0; m < L; m++)
        p[m] /= z;
}

/* src [L,N,D] -> o [N,D] */
static void ref_forward(int L, int N, int D, const double *src, const double *w, const double *g,
                        double eps, double scale, double *o) {
    double *p = malloc(sizeof(double) * (size_t)L);
    const int64_t st = (int64_t)N * D;
    for (int n = 0; n < N; n++) {
        ref_row(L, D, src + (int64_t)n * D, st, w, g, eps, scale, p, NULL, NULL);
        for (int j = 0; j < D; j++) {
            double acc = 0.0;
            for (int m = 0; m < L; m++)
                acc += p[m] * src[m * st + (int64_t)n * D + j];
            o[(int64_t)n * D + j] = acc;
        }
    }
    free(p);
}

/* Gradients of sum(o * do): dsrc [L,N,D], dw [D], dg [D] (all overwritten). */
static void ref_backward(int L, int N, int D, const double *src, const double *w, const double *g,
                         double eps, double scale, const double *dout, double *dsrc, double *dw,
                         double *dg) {
    double *p = malloc(sizeof(double) * (size_t)L), *r = malloc(sizeof(double) * (size_t)L);
    double *dp = malloc(sizeof(double) * (size_t)L), *k = malloc(sizeof(double) * (size_t)L * D);
    double *dxh = malloc(sizeof(double) * (size_t)D);
    const int64_t st = (int64_t)N * D;
    memset(dw, 0, sizeof(double) * (size_t)D);
    memset(dg, 0, sizeof(double) * (size_t)D);
    for (int n = 0; n < N; n++) {
        const int64_t off = (int64_t)n * D;
        const double *dor = dout + off;
        ref_row(L, D, src + off, st, w, g, eps, scale, p, k, r);
        double delta = 0.0;
        for (int m = 0; m < L; m++) {
            dp[m] = 0.0;
            for (int j = 0; j < D; j++)
                dp[m] += dor[j] * src[m * st + off + j];
            delta += p[m] * dp[m];
        }
        for (int m = 0; m < L; m++) {
            const double *x = src + m * st + off;
            double *dx = dsrc + m * st + off;
            const double ds = p[m] * (dp[m] - delta); /* d loss / d logit */
            /* logit = sum_j k_j w_j scale,  k_j = xhat_j g_j,  xhat = r x */
            double xd = 0.0;
            for (int j = 0; j < D; j++) {
                const double dk = ds * scale * w[j];
                dw[j] += ds * scale * k[(size_t)m * D + j];
                dg[j] += dk * x[j] * r[m];
                dxh[j] = dk * g[j];
                xd += x[j] * dxh[j];
            }
            /* RMSNorm backward: dx = r dxhat - r^3 x (x . dxhat) / D; plus the value path */
            for (int j = 0; j < D; j++)
                dx[j] = p[m] * dor[j] + r[m] * dxh[j] - r[m] * r[m] * r[m] * x[j] * xd / D;
        }
    }
    free(p), free(r), free(dp), free(k), free(dxh);
}

static double ref_loss(int L, int N, int D, const double *src, const double *w, const double *g,
                       double eps, double scale, const double *dout, double *o) {
    ref_forward(L, N, D, src, w, g, eps, scale, o);
    double s = 0.0;
    for (int64_t i = 0; i < (int64_t)N * D; i++)
        s += o[i] * dout[i];
    return s;
}

/* ---------------------------------------------------------------- inputs */

typedef struct {
    int L, N, D;
    double eps, scale;
    double qmul; /* query std multiplier (0: zero query) */
} shape;

typedef struct {
    shape s;
    int64_t nd;                 /* N*D */
    double *src, *w, *g, *dout; /* fp64 inputs (the fp32 values, exactly) */
    float *fsrc, *fw, *fg, *fdo;
} problem;

/* Sources like a residual stream: the embedding small, block sums growing with
 * depth, each with its own offset; queries with logits of O(qmul); gains around 1
 * (§1.4 init 1, trained ones drift). Everything rounded to fp32 once, so the fp64
 * reference sees exactly what the fp32 op sees. */
static void problem_make(problem *P, shape s, uint64_t seed) {
    memset(P, 0, sizeof(*P));
    P->s = s;
    P->nd = (int64_t)s.N * s.D;
    const int64_t ns = (int64_t)s.L * P->nd;
    P->src = malloc(sizeof(double) * (size_t)ns);
    P->w = malloc(sizeof(double) * (size_t)s.D);
    P->g = malloc(sizeof(double) * (size_t)s.D);
    P->dout = malloc(sizeof(double) * (size_t)P->nd);
    for (int m = 0; m < s.L; m++) {
        const double sd = m == 0 ? 0.3 : 0.5 + 0.75 * m;
        lm_fill_normal(P->src + m * P->nd, P->nd, seed * 131 + (uint64_t)m, 0.1 * m, sd);
    }
    lm_fill_normal(P->w, s.D, seed * 131 + 100, 0.0, s.qmul / sqrt((double)s.D));
    lm_fill_uniform(P->g, s.D, seed * 131 + 101, 0.5, 1.5);
    lm_fill_normal(P->dout, P->nd, seed * 131 + 102, 0.0, 1.0);
    P->fsrc = lm_to_f32(P->src, ns);
    P->fw = lm_to_f32(P->w, s.D);
    P->fg = lm_to_f32(P->g, s.D);
    P->fdo = lm_to_f32(P->dout, P->nd);
    for (int64_t i = 0; i < ns; i++)
        P->src[i] = P->fsrc[i];
    for (int j = 0; j < s.D; j++)
        P->w[j] = P->fw[j], P->g[j] = P->fg[j];
    for (int64_t i = 0; i < P->nd; i++)
        P->dout[i] = P->fdo[i];
}

static void problem_free(problem *P) {
    free(P->src), free(P->w), free(P->g), free(P->dout);
    free(P->fsrc), free(P->fw), free(P->fg), free(P->fdo);
}

static lm_attnres_config problem_config(const problem *P) {
    lm_attnres_config c;
    lm_attnres_config_default(&c, P->s.L, P->s.N, P->s.D);
    c.eps = (float)P->s.eps;
    c.scale = (float)P->s.scale;
    return c;
}

/* fp32 results of one op run (contiguous API), outputs poisoned before the call. */
typedef struct {
    float *o, *dsrc, *dw, *dg;
} result;

static void run_op(const problem *P, const lm_attnres_config *c, result *R) {
    const shape s = P->s;
    const int64_t ns = (int64_t)s.L * P->nd;
    R->o = malloc(sizeof(float) * (size_t)P->nd);
    R->dsrc = malloc(sizeof(float) * (size_t)ns);
    R->dw = malloc(sizeof(float) * (size_t)s.D);
    R->dg = malloc(sizeof(float) * (size_t)s.D);
    lm_poison_f32(R->o, P->nd);
    lm_poison_f32(R->dsrc, ns);
    lm_poison_f32(R->dw, s.D);
    lm_poison_f32(R->dg, s.D);
    lm_error err = {LM_OK, ""};
    lm_status st = lm_attnres_forward(c, P->fsrc, P->fw, P->fg, R->o, &err);
    if (st != LM_OK)
        print_message("forward: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
    st = lm_attnres_backward(c, P->fsrc, P->fw, P->fg, P->fdo, R->dsrc, R->dw, R->dg, &err);
    if (st != LM_OK)
        print_message("backward: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void result_free(result *R) { free(R->o), free(R->dsrc), free(R->dw), free(R->dg); }

/* Worst errors over the grid, printed at the end (the numbers the README quotes). */
static double g_worst_fwd = 0.0, g_worst_bwd = 0.0, g_worst_fd = 0.0;

static int check32(const char *name, const float *out, const double *ref, int64_t n, double tol,
                   double *worst) {
    lm_cmp c = lm_compare_f32(out, ref, n, tol);
    if (c.rel_rms > *worst)
        *worst = c.rel_rms;
    return lm_check_f32(name, out, ref, n, tol);
}

/* ---------------------------------------------------------------- grid vs fp64 */

static void compare_to_ref(const problem *P, const result *R, const char *tag) {
    const shape s = P->s;
    const int64_t ns = (int64_t)s.L * P->nd;
    double *o = malloc(sizeof(double) * (size_t)P->nd), *ds = malloc(sizeof(double) * (size_t)ns);
    double *dw = malloc(sizeof(double) * (size_t)s.D), *dg = malloc(sizeof(double) * (size_t)s.D);
    ref_forward(s.L, s.N, s.D, P->src, P->w, P->g, s.eps, s.scale, o);
    ref_backward(s.L, s.N, s.D, P->src, P->w, P->g, s.eps, s.scale, P->dout, ds, dw, dg);
    char name[128];
    snprintf(name, sizeof name, "%s o", tag);
    assert_true(check32(name, R->o, o, P->nd, TOL_FWD_F32, &g_worst_fwd));
    for (int m = 0; m < s.L; m++) {
        snprintf(name, sizeof name, "%s dresidual_%d", tag, m);
        assert_true(
            check32(name, R->dsrc + m * P->nd, ds + m * P->nd, P->nd, TOL_BWD_F32, &g_worst_bwd));
    }
    snprintf(name, sizeof name, "%s dquery", tag);
    assert_true(check32(name, R->dw, dw, s.D, TOL_BWD_F32, &g_worst_bwd));
    snprintf(name, sizeof name, "%s drms_weight", tag);
    assert_true(check32(name, R->dg, dg, s.D, TOL_BWD_F32, &g_worst_bwd));
    free(o), free(ds), free(dw), free(dg);
}

static shape GRID[] = {
    /* L = 2..9 against D = 1, 64, 100 and N from 1 to 300 (chunks of 16 rows: 1, 2,
       partial and many chunks; the parallel path starts at L*N*D >= 32768) */
    {2, 1, 1, 1e-6, 1.0, 1.5},
    {2, 300, 64, 1e-6, 1.0, 1.5},
    {2, 17, 100, 1e-6, 1.0, 1.5},
    {3, 33, 1, 1e-6, 1.0, 1.5},
    {3, 1, 64, 1e-6, 1.0, 1.5},
    {3, 300, 100, 1e-6, 1.0, 1.5},
    {4, 300, 1, 1e-6, 1.0, 1.5},
    {4, 16, 64, 1e-6, 1.0, 1.5},
    {4, 129, 100, 1e-6, 1.0, 1.5},
    {5, 7, 1, 1e-6, 1.0, 1.5},
    {5, 200, 64, 1e-6, 1.0, 1.5},
    {5, 1, 100, 1e-6, 1.0, 1.5},
    {6, 64, 1, 1e-6, 1.0, 1.5},
    {6, 65, 64, 1e-6, 1.0, 1.5},
    {6, 300, 100, 1e-6, 1.0, 1.5},
    {7, 2, 1, 1e-6, 1.0, 1.5},
    {7, 299, 64, 1e-6, 1.0, 1.5},
    {7, 31, 100, 1e-6, 1.0, 1.5},
    {8, 300, 1, 1e-6, 1.0, 1.5},
    {8, 1, 64, 1e-6, 1.0, 1.5},
    {8, 100, 100, 1e-6, 1.0, 1.5},
    {9, 3, 1, 1e-6, 1.0, 1.5},
    {9, 300, 64, 1e-6, 1.0, 1.5},
    {9, 47, 100, 1e-6, 1.0, 1.5},
    /* other eps / scale, sharper and flatter logits */
    {5, 50, 64, 1e-5, 0.125, 4.0},
    {4, 37, 100, 1e-2, 2.0, 3.0},
    {9, 20, 64, 1e-6, -1.0, 0.2},
    {3, 11, 1, 1e-3, 0.5, 8.0},
};
#define N_GRID (int)(sizeof(GRID) / sizeof(GRID[0]))

static void run_grid_case(void **state) {
    const shape *s = (const shape *)*state;
    problem P;
    problem_make(&P, *s, (uint64_t)(s->L * 1000 + s->N * 7 + s->D));
    lm_attnres_config c = problem_config(&P);
    result R;
    run_op(&P, &c, &R);
    char tag[96];
    snprintf(tag, sizeof tag, "L=%d N=%d D=%d eps=%g scale=%g q=%g", s->L, s->N, s->D, s->eps,
             s->scale, s->qmul);
    compare_to_ref(&P, &R, tag);
    result_free(&R);
    problem_free(&P);
}

/* ---------------------------------------------------------------- finite differences */

/* Central differences (fp64, h = 1e-5 and h/2, Richardson-extrapolated so the
 * truncation error is O(h^4): with D = 1 a small source sits where the key
 * C / sqrt(C^2 + eps) bends sharply and plain O(h^2) differences are off by ~1e-7)
 * of sum(o * do) through the reference forward, for every element of query,
 * rms_weight and every residual, against the reference backward. A random
 * (non-zero) query, so the key path is exercised. */
static void fd_case(shape s, uint64_t seed) {
    problem P;
    problem_make(&P, s, seed);
    const int64_t ns = (int64_t)s.L * P.nd;
    double *ds = malloc(sizeof(double) * (size_t)ns), *dw = malloc(sizeof(double) * (size_t)s.D);
    double *dg = malloc(sizeof(double) * (size_t)s.D), *o = malloc(sizeof(double) * (size_t)P.nd);
    double *fds = malloc(sizeof(double) * (size_t)ns), *fdw = malloc(sizeof(double) * (size_t)s.D);
    double *fdg = malloc(sizeof(double) * (size_t)s.D);
    ref_backward(s.L, s.N, s.D, P.src, P.w, P.g, s.eps, s.scale, P.dout, ds, dw, dg);
    const double h = 1e-5;
    double *targets[3] = {P.src, P.w, P.g};
    double *fds_[3] = {fds, fdw, fdg};
    const int64_t cnt[3] = {ns, s.D, s.D};
    for (int t = 0; t < 3; t++)
        for (int64_t i = 0; i < cnt[t]; i++) {
            double *x = targets[t] + i;
            const double x0 = *x;
            double cd[2];
            for (int k = 0; k < 2; k++) {
                const double hk = k ? h / 2 : h;
                *x = x0 + hk;
                const double lp =
                    ref_loss(s.L, s.N, s.D, P.src, P.w, P.g, s.eps, s.scale, P.dout, o);
                *x = x0 - hk;
                const double lm =
                    ref_loss(s.L, s.N, s.D, P.src, P.w, P.g, s.eps, s.scale, P.dout, o);
                *x = x0;
                cd[k] = (lp - lm) / (2 * hk);
            }
            fds_[t][i] = (4 * cd[1] - cd[0]) / 3; /* Richardson: error O(h^4) */
        }
    char name[96];
    for (int m = 0; m < s.L; m++) {
        snprintf(name, sizeof name, "fd L=%d N=%d D=%d dresidual_%d", s.L, s.N, s.D, m);
        lm_cmp c = lm_compare_f64(ds + m * P.nd, fds + m * P.nd, P.nd, TOL_FD);
        if (c.rel_rms > g_worst_fd)
            g_worst_fd = c.rel_rms;
        assert_true(lm_check_f64(name, ds + m * P.nd, fds + m * P.nd, P.nd, TOL_FD));
    }
    lm_cmp c1 = lm_compare_f64(dw, fdw, s.D, TOL_FD), c2 = lm_compare_f64(dg, fdg, s.D, TOL_FD);
    if (c1.rel_rms > g_worst_fd)
        g_worst_fd = c1.rel_rms;
    if (c2.rel_rms > g_worst_fd)
        g_worst_fd = c2.rel_rms;
    snprintf(name, sizeof name, "fd L=%d N=%d D=%d dquery", s.L, s.N, s.D);
    assert_true(lm_check_f64(name, dw, fdw, s.D, TOL_FD));
    snprintf(name, sizeof name, "fd L=%d N=%d D=%d drms_weight", s.L, s.N, s.D);
    assert_true(lm_check_f64(name, dg, fdg, s.D, TOL_FD));
    /* the gradients are not trivially zero */
    double nw = 0.0, ng = 0.0;
    for (int j = 0; j < s.D; j++)
        nw += fdw[j] * fdw[j], ng += fdg[j] * fdg[j];
    assert_true(nw > 1e-8 && ng > 1e-8);
    free(ds), free(dw), free(dg), free(o), free(fds), free(fdw), free(fdg);
    problem_free(&P);
}

static void test_finite_differences(void **state) {
    (void)state;
    fd_case((shape){3, 2, 5, 1e-6, 1.0, 1.5}, 1);
    fd_case((shape){4, 3, 1, 1e-6, 1.0, 1.5}, 2);
    fd_case((shape){9, 2, 7, 1e-6, 1.0, 2.0}, 3);
    fd_case((shape){2, 4, 16, 1e-3, 0.7, 3.0}, 4);
    fd_case((shape){6, 1, 64, 1e-6, -1.3, 1.0}, 5);
}

/* ---------------------------------------------------------------- properties */

/* §1.4: w = 0 => uniform weights: o = mean of the sources (1e-6), dresidual_m = do/L,
 * drms_weight exactly 0 (dg = du (.) w), dquery non-zero and right. */
static void test_zero_query(void **state) {
    (void)state;
    const int Ls[] = {2, 3, 7, 9};
    for (int li = 0; li < 4; li++) {
        shape s = {Ls[li], 45, 64, 1e-6, 1.0, 0.0};
        problem P;
        problem_make(&P, s, 40 + (uint64_t)li);
        for (int64_t i = 0; i < (int64_t)s.L * P.nd; i++) /* O(1) sources for the 1e-6 bound */
            P.fsrc[i] = (float)(P.src[i] /= (1.0 + 0.75 * s.L)), P.src[i] = P.fsrc[i];
        for (int j = 0; j < s.D; j++)
            assert_true(P.fw[j] == 0.0f);
        lm_attnres_config c = problem_config(&P);
        result R;
        run_op(&P, &c, &R);
        double maxerr = 0.0;
        for (int64_t i = 0; i < P.nd; i++) {
            double mean = 0.0;
            for (int m = 0; m < s.L; m++)
                mean += P.src[m * P.nd + i];
            mean /= s.L;
            const double e = fabs(R.o[i] - mean);
            if (e > maxerr)
                maxerr = e;
            for (int m = 0; m < s.L; m++)
                assert_true(fabs(R.dsrc[m * P.nd + i] - P.dout[i] / s.L) <= 1e-6);
        }
        printf("zero query L=%d: max|o - mean| = %.3e\n", s.L, maxerr);
        assert_true(maxerr <= 1e-6);
        double nw = 0.0;
        for (int j = 0; j < s.D; j++) {
            assert_true(R.dg[j] == 0.0f);
            nw += (double)R.dw[j] * R.dw[j];
        }
        assert_true(nw > 1e-6);
        compare_to_ref(&P, &R, "zero query");
        result_free(&R);
        problem_free(&P);
    }
}

/* One source: o is the source bit for bit; dresidual_0 = do; parameter grads 0. */
static void test_single_source(void **state) {
    (void)state;
    const int Ds[] = {1, 64, 100};
    for (int di = 0; di < 3; di++) {
        shape s = {1, 37, Ds[di], 1e-6, 1.0, 3.0};
        problem P;
        problem_make(&P, s, 60 + (uint64_t)di);
        lm_attnres_config c = problem_config(&P);
        result R;
        run_op(&P, &c, &R);
        assert_memory_equal(R.o, P.fsrc, sizeof(float) * (size_t)P.nd);
        assert_memory_equal(R.dsrc, P.fdo, sizeof(float) * (size_t)P.nd);
        for (int j = 0; j < s.D; j++)
            assert_true(R.dw[j] == 0.0f && R.dg[j] == 0.0f);
        result_free(&R);
        problem_free(&P);
    }
}

/* Logits far beyond exp's range: the max-subtracted softmax stays finite and still
 * matches fp64 (the logits are accumulated in fp64 and are exact to ~1e-16). */
static void test_large_logits(void **state) {
    (void)state;
    const double mul[] = {1e3, 1e6, 1e30};
    for (int i = 0; i < 3; i++) {
        shape s = {6, 40, 64, 1e-6, 1.0, 1.5};
        problem P;
        problem_make(&P, s, 80 + (uint64_t)i);
        for (int j = 0; j < s.D; j++)
            P.fw[j] = (float)(P.w[j] * mul[i]), P.w[j] = P.fw[j];
        lm_attnres_config c = problem_config(&P);
        result R;
        run_op(&P, &c, &R);
        for (int64_t q = 0; q < P.nd; q++)
            assert_true(isfinite(R.o[q]));
        for (int64_t q = 0; q < (int64_t)s.L * P.nd; q++)
            assert_true(isfinite(R.dsrc[q]));
        for (int j = 0; j < s.D; j++)
            assert_true(isfinite(R.dw[j]) && isfinite(R.dg[j]));
        /* p is one-hot for almost every row: o picks one source */
        double *o = malloc(sizeof(double) * (size_t)P.nd);
        ref_forward(s.L, s.N, s.D, P.src, P.w, P.g, s.eps, s.scale, o);
        char name[64];
        snprintf(name, sizeof name, "large logits x%g o", mul[i]);
        assert_true(check32(name, R.o, o, P.nd, TOL_FWD_F32, &g_worst_fwd));
        free(o);
        if (i < 2)
            compare_to_ref(&P, &R, name);
        result_free(&R);
        problem_free(&P);
    }
}

/* Pointer table == contiguous block, bit for bit; with NULL entries in dsrc the
 * other gradients are unchanged; a reused, growing workspace gives the same bits
 * as none; accumulate = 1 adds onto what is there. */
static void test_ptrs_workspace_accumulate(void **state) {
    (void)state;
    shape s = {5, 123, 100, 1e-6, 1.0, 1.5};
    problem P;
    problem_make(&P, s, 90);
    lm_attnres_config c = problem_config(&P);
    result R;
    run_op(&P, &c, &R);

    /* sources in separate allocations */
    float *sep[5], *dsep[5];
    const float *csep[5];
    for (int m = 0; m < s.L; m++) {
        sep[m] = malloc(sizeof(float) * (size_t)P.nd);
        dsep[m] = malloc(sizeof(float) * (size_t)P.nd);
        memcpy(sep[m], P.fsrc + m * P.nd, sizeof(float) * (size_t)P.nd);
        lm_poison_f32(dsep[m], P.nd);
        csep[m] = sep[m];
    }
    lm_attnres_workspace *ws = lm_attnres_workspace_new();
    assert_non_null(ws);
    lm_error err = {LM_OK, ""};
    float *o = malloc(sizeof(float) * (size_t)P.nd), dw[100], dg[100];
    for (int pass = 0; pass < 2; pass++) {
        /* first pass: a small call first so the workspace has to grow */
        lm_attnres_config c2 = c;
        c2.ws = ws;
        if (pass == 0) {
            lm_attnres_config cs = c2;
            cs.N = 3;
            assert_int_equal(lm_attnres_forward_ptrs(&cs, csep, P.fw, P.fg, o, &err), LM_OK);
        }
        lm_poison_f32(o, P.nd);
        lm_poison_f32(dw, s.D);
        lm_poison_f32(dg, s.D);
        assert_int_equal(lm_attnres_forward_ptrs(&c2, csep, P.fw, P.fg, o, &err), LM_OK);
        assert_int_equal(lm_attnres_backward_ptrs(&c2, csep, P.fw, P.fg, P.fdo, dsep, dw, dg, &err),
                         LM_OK);
        assert_memory_equal(o, R.o, sizeof(float) * (size_t)P.nd);
        for (int m = 0; m < s.L; m++)
            assert_memory_equal(dsep[m], R.dsrc + m * P.nd, sizeof(float) * (size_t)P.nd);
        assert_memory_equal(dw, R.dw, sizeof(float) * (size_t)s.D);
        assert_memory_equal(dg, R.dg, sizeof(float) * (size_t)s.D);
    }

    /* NULL gradient slots: the embedding's gradient not wanted, no dquery */
    float *dpart[5] = {NULL, dsep[1], dsep[2], dsep[3], dsep[4]};
    float *keep0 = malloc(sizeof(float) * (size_t)P.nd);
    memcpy(keep0, dsep[0], sizeof(float) * (size_t)P.nd);
    for (int m = 1; m < s.L; m++)
        lm_poison_f32(dsep[m], P.nd);
    lm_poison_f32(dg, s.D);
    assert_int_equal(lm_attnres_backward_ptrs(&c, csep, P.fw, P.fg, P.fdo, dpart, NULL, dg, &err),
                     LM_OK);
    for (int m = 1; m < s.L; m++)
        assert_memory_equal(dsep[m], R.dsrc + m * P.nd, sizeof(float) * (size_t)P.nd);
    assert_memory_equal(dsep[0], keep0, sizeof(float) * (size_t)P.nd); /* slot 0 untouched */
    assert_memory_equal(dg, R.dg, sizeof(float) * (size_t)s.D);

    /* no source gradients at all (dsrc == NULL): the parameter gradients are unchanged */
    lm_poison_f32(dw, s.D);
    lm_poison_f32(dg, s.D);
    assert_int_equal(lm_attnres_backward_ptrs(&c, csep, P.fw, P.fg, P.fdo, NULL, dw, dg, &err),
                     LM_OK);
    assert_memory_equal(dw, R.dw, sizeof(float) * (size_t)s.D);
    assert_memory_equal(dg, R.dg, sizeof(float) * (size_t)s.D);
    assert_int_equal(lm_attnres_backward(&c, P.fsrc, P.fw, P.fg, P.fdo, NULL, dw, NULL, &err),
                     LM_OK);
    assert_memory_equal(dw, R.dw, sizeof(float) * (size_t)s.D);

    /* accumulate: prefill with values, add */
    lm_attnres_config ca = c;
    ca.accumulate = 1;
    for (int m = 0; m < s.L; m++)
        for (int64_t i = 0; i < P.nd; i++)
            dsep[m][i] = (float)(0.5 * P.dout[i] - m);
    for (int j = 0; j < s.D; j++)
        dw[j] = (float)j, dg[j] = (float)-j;
    assert_int_equal(lm_attnres_backward_ptrs(&ca, csep, P.fw, P.fg, P.fdo, dsep, dw, dg, &err),
                     LM_OK);
    double *want = malloc(sizeof(double) * (size_t)P.nd);
    for (int m = 0; m < s.L; m++) {
        for (int64_t i = 0; i < P.nd; i++)
            want[i] = (double)(float)(0.5 * P.dout[i] - m) + R.dsrc[m * P.nd + i];
        assert_true(lm_check_f32("accumulate dresidual", dsep[m], want, P.nd, 1e-6));
    }
    for (int j = 0; j < s.D; j++) {
        assert_true(fabs(dw[j] - (j + (double)R.dw[j])) <= 1e-6 * (1 + j));
        assert_true(fabs(dg[j] - (-j + (double)R.dg[j])) <= 1e-6 * (1 + j));
    }
    free(want);
    free(keep0);
    free(o);
    for (int m = 0; m < s.L; m++)
        free(sep[m]), free(dsep[m]);
    lm_attnres_workspace_free(ws);
    result_free(&R);
    problem_free(&P);
}

/* Bitwise identical outputs for 1, 2 and 3 threads (fixed row chunks, fixed-order
 * reduction of the parameter gradients). */
static void test_threads(void **state) {
    (void)state;
    const shape cases[] = {{5, 300, 100, 1e-6, 1.0, 1.5},
                           {9, 1000, 64, 1e-6, 1.0, 2.0},
                           {3, 20000, 1, 1e-6, 1.0, 1.5}};
    for (int k = 0; k < 3; k++) {
        problem P;
        problem_make(&P, cases[k], 100 + (uint64_t)k);
        lm_attnres_config c = problem_config(&P);
        const int counts[3] = {1, 2, 3};
        result R[3];
        for (int t = 0; t < 3; t++) {
            lm_set_num_threads(counts[t]);
            run_op(&P, &c, &R[t]);
        }
        lm_set_num_threads(0);
        const size_t bo = sizeof(float) * (size_t)P.nd;
        for (int t = 1; t < 3; t++) {
            assert_memory_equal(R[t].o, R[0].o, bo);
            assert_memory_equal(R[t].dsrc, R[0].dsrc, bo * (size_t)cases[k].L);
            assert_memory_equal(R[t].dw, R[0].dw, sizeof(float) * (size_t)cases[k].D);
            assert_memory_equal(R[t].dg, R[0].dg, sizeof(float) * (size_t)cases[k].D);
        }
        compare_to_ref(&P, &R[0], "threads");
        for (int t = 0; t < 3; t++)
            result_free(&R[t]);
        problem_free(&P);
    }
}

/* ---------------------------------------------------------------- bad inputs */

/* st must be `want` with a message naming `needle` */
static void expect_status(lm_status st, lm_status want, const lm_error *err, const char *needle) {
    if (st != want)
        print_message("expected status %d mentioning '%s', got %d\n", (int)want, needle, (int)st);
    assert_int_equal(st, want);
    if (!strstr(err->msg, needle))
        print_message("message '%s' lacks '%s'\n", err->msg, needle);
    assert_non_null(strstr(err->msg, needle));
}

/* bad configuration or argument: LM_ERR_INVALID (a non-finite eps or scale included) */
static void expect_fail(lm_status st, const lm_error *err, const char *needle) {
    expect_status(st, LM_ERR_INVALID, err, needle);
}

/* a non-finite tensor value: LM_ERR_NONFINITE */
static void expect_nonfinite(lm_status st, const lm_error *err, const char *needle) {
    expect_status(st, LM_ERR_NONFINITE, err, needle);
}

static void test_bad_inputs(void **state) {
    (void)state;
    shape s = {4, 10, 8, 1e-6, 1.0, 1.5};
    problem P;
    problem_make(&P, s, 7);
    const float *src[4];
    for (int m = 0; m < 4; m++)
        src[m] = P.fsrc + m * P.nd;
    float *o = malloc(sizeof(float) * 80), *d = malloc(sizeof(float) * 320), dw[8], dg[8];
    for (int i = 0; i < 80; i++)
        o[i] = 12345.0f;
    lm_error err;
    lm_attnres_config c;
#define RESET() (lm_attnres_config_default(&c, 4, 10, 8), memset(&err, 0, sizeof err))
#define FWD() lm_attnres_forward_ptrs(&c, src, P.fw, P.fg, o, &err)
#define BWD() lm_attnres_backward(&c, P.fsrc, P.fw, P.fg, P.fdo, d, dw, dg, &err)
    RESET(), c.L = 0;
    expect_fail(FWD(), &err, "L = 0");
    RESET(), c.N = 0;
    expect_fail(FWD(), &err, "N = 0");
    RESET(), c.D = -3;
    expect_fail(BWD(), &err, "D = -3");
    RESET(), c.N = (int64_t)1 << 45;
    expect_fail(FWD(), &err, "too large");
    RESET(), c.eps = 0.0f;
    expect_fail(FWD(), &err, "eps = 0");
    RESET(), c.eps = -1e-6f;
    expect_fail(BWD(), &err, "eps = -1e-06");
    RESET(), c.eps = NAN;
    expect_fail(FWD(), &err, "eps = nan");
    RESET(), c.eps = INFINITY;
    expect_fail(FWD(), &err, "eps = inf");
    RESET(), c.scale = NAN;
    expect_fail(FWD(), &err, "scale = nan");
    RESET();
    expect_fail(lm_attnres_forward_ptrs(&c, src, NULL, P.fg, o, &err), &err, "query");
    RESET();
    expect_fail(lm_attnres_forward_ptrs(&c, src, P.fw, NULL, o, &err), &err, "rms_weight");
    RESET();
    expect_fail(lm_attnres_forward_ptrs(&c, NULL, P.fw, P.fg, o, &err), &err, "source");
    RESET();
    expect_fail(lm_attnres_forward(&c, NULL, P.fw, P.fg, o, &err), &err, "residual");
    RESET();
    expect_fail(lm_attnres_forward_ptrs(&c, src, P.fw, P.fg, NULL, &err), &err, "'o'");
    RESET();
    expect_fail(lm_attnres_backward(&c, P.fsrc, P.fw, P.fg, NULL, d, dw, dg, &err), &err, "'do'");
    RESET();
    const float *holey[4] = {src[0], NULL, src[2], src[3]};
    expect_fail(lm_attnres_forward_ptrs(&c, holey, P.fw, P.fg, o, &err), &err, "residual_1");
    expect_fail(lm_attnres_validate(NULL, src, P.fw, P.fg, NULL, &err), &err, "config");

    /* non-finite values, named with their tensor and position */
    P.fsrc[2 * P.nd + 19] = NAN; /* residual_2, row 2, column 3 */
    RESET();
    expect_nonfinite(FWD(), &err, "'residual_2'");
    assert_non_null(strstr(err.msg, "row 2, column 3"));
    expect_nonfinite(BWD(), &err, "'residual_2'");
    P.fsrc[2 * P.nd + 19] = 0.5f;
    P.fw[5] = INFINITY;
    expect_nonfinite(FWD(), &err, "'query'");
    P.fw[5] = 0.1f;
    P.fg[0] = -INFINITY;
    expect_nonfinite(FWD(), &err, "'rms_weight'");
    P.fg[0] = 1.0f;
    P.fdo[79] = NAN;
    expect_nonfinite(BWD(), &err, "'do'");
    /* trusted inputs skip the scan (documented), and then the call goes through */
    c.trusted_inputs = 1;
    assert_int_equal(BWD(), LM_OK);
    P.fdo[79] = 0.0f;
    /* the output was never touched by a failing forward */
    for (int i = 0; i < 80; i++)
        assert_true(o[i] == 12345.0f);
    RESET();
    assert_int_equal(FWD(), LM_OK);
    assert_int_equal(lm_attnres_validate(&c, src, P.fw, P.fg, P.fdo, &err), LM_OK);
#undef RESET
#undef FWD
#undef BWD
    free(o), free(d);
    problem_free(&P);
}

static void test_summary(void **state) {
    (void)state;
    printf("attnres worst rel RMS: forward %.3e (tol %.0e), gradients %.3e (tol %.0e), "
           "reference vs finite differences %.3e (tol %.0e)\n",
           g_worst_fwd, TOL_FWD_F32, g_worst_bwd, TOL_BWD_F32, g_worst_fd, TOL_FD);
    assert_true(g_worst_fwd <= TOL_FWD_F32 && g_worst_bwd <= TOL_BWD_F32 && g_worst_fd <= TOL_FD);
}

int main(void) {
    struct CMUnitTest tests[N_GRID + 16];
    static char names[N_GRID][64];
    int n = 0;
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_bad_inputs);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_finite_differences);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_zero_query);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_single_source);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_large_logits);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_ptrs_workspace_accumulate);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_threads);
    for (int i = 0; i < N_GRID; i++) {
        tests[n] = (struct CMUnitTest)cmocka_unit_test_prestate(run_grid_case, &GRID[i]);
        snprintf(names[i], sizeof names[i], "grid L=%d N=%d D=%d", GRID[i].L, GRID[i].N, GRID[i].D);
        tests[n].name = names[i];
        n++;
    }
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_summary);
    double t0 = lm_time_sec();
    int rc = _cmocka_run_group_tests("attnres", tests, (size_t)n, NULL, NULL);
    printf("test_attnres: %.1f s\n", lm_time_sec() - t0);
    return rc;
}
