/* The layer building blocks (include/linmoe/layers.h) held to fp64 references
 * written here, each reference's hand-derived backward first checked by central
 * finite differences of its own forward (fp64, h = FD_H, TOL_FD) on tiny shapes:
 *
 *  - RMSNorm and the head-wise sigmoid-gated RMSNorm: forward (y, rstd) <= TOL_FWD_F32,
 *    dx / dgate / dweight <= TOL_BWD_F32; with and without weight, with and without the
 *    saved rstd; D not a multiple of the 16-column dweight block; rows scaled down to
 *    where eps matters; gates saturated at +-30.
 *  - short convolution (W = 1, 3, 4, 5; SiLU on and off; initial state): y, final
 *    state, dx, dweight, dinitial_state vs the reference; packed documents of lengths
 *    0, 1, 2 (< W-1) and longer; a perturbed document changes no other document's
 *    output or input gradient (bit for bit) and each document alone gives the packed
 *    result bit for bit; prefill + chained decode steps equal the full forward (bit
 *    for bit) and leave the same state.
 *  - SwiGLU: out, dx and the three weight gradients vs the reference; hidden kept or
 *    recomputed, scratch given or allocated; N not a multiple of the token block.
 *  - cross-entropy: loss / count / nll / dh / dW vs the materialised fp64 reference
 *    for chunk sizes 1, 7, 64, V and the default, V = 257 and 50257 (not multiples of
 *    the chunk), ignored targets; every chunk size agrees with the unchunked one
 *    (chunk = V) to tol_chunk(V); all targets ignored gives loss 0, count 0 and exactly
 *    zero gradients; dloss scales the gradients.
 *  - determinism: every output bit-identical on 1, 2 and 3 threads.
 *  - invalid input: each bad field gives LM_ERR_INVALID, a message naming it, and
 *    untouched outputs.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "linmoe/core.h"
#include "linmoe/layers.h"

#define FD_H 1e-5
/* Chunked vs unchunked cross-entropy: the same fp32 logits (the matmul's inner dimension is
 * D either way) and the same exponentials; what differs is the order of the fp32 sums over
 * the vocabulary: the forward's sum of exp (one sum of V terms, or one per chunk folded into
 * the running sum; how the compiler vectorises the loop changes the order too, e.g. in the
 * -O1 sanitizer build) and the backward's dh GEMM (K = V, or one K = chunk GEMM per chunk
 * accumulated). Reordering an fp32 sum of n terms without cancellation moves it by about
 * sqrt(n) u relative when the roundings behave as independent zero-mean errors (Higham and
 * Mary, "A new approach to probabilistic rounding error analysis", 2019); the sum of exp is
 * all positive, and dh = sum_v (p_v - y_v) W_v is dominated by its target row. The bound
 * here is 4 such standard deviations with n = V: 5.3e-5 for V = 50257, 3.8e-6 for V = 257
 * (the worst-case bound, (n - 1) u, would be 3e-3: too loose to catch a lost chunk). */
static double tol_chunk(int V) { return 4.0 * sqrt((double)V) * 0x1p-24; }

/* ================================================================ helpers */

static double *dalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* fp64 values rounded through fp32 (the op's inputs), and their fp32 copy. */
static double *rand_in(int64_t n, uint64_t seed, double mean, double std, float **f32) {
    double *x = dalloc(n);
    lm_fill_normal(x, n, seed, mean, std);
    for (int64_t i = 0; i < n; i++)
        x[i] = (double)(float)x[i];
    *f32 = lm_to_f32(x, n);
    return x;
}

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

static double dot64(const double *a, const double *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* Central differences of f(ctx) with respect to every element of p (perturbed in
 * place), compared with the analytic gradient g. */
typedef double (*loss_fn)(void *ctx);

static int fd_check(const char *name, loss_fn f, void *ctx, double *p, int64_t n, const double *g) {
    double *fd = dalloc(n);
    for (int64_t i = 0; i < n; i++) {
        const double save = p[i];
        p[i] = save + FD_H;
        const double fp = f(ctx);
        p[i] = save - FD_H;
        const double fm = f(ctx);
        p[i] = save;
        fd[i] = (fp - fm) / (2.0 * FD_H);
    }
    char label[128];
    snprintf(label, sizeof label, "fd %s", name);
    int ok = lm_check_f64(label, g, fd, n, TOL_FD);
    free(fd);
    return ok;
}

/* st must be `want` (LM_ERR_INVALID: bad argument or config scalar; LM_ERR_NONFINITE:
 * a NaN/Inf tensor value) with a message naming `needle`. */
static void expect_status(const char *what, lm_status st, lm_status want, const lm_error *err,
                          const char *needle) {
    const int named = strstr(err->msg, needle) != NULL;
    printf("invalid %-44s -> %d \"%s\"%s\n", what, (int)st, err->msg,
           named ? "" : "  <-- not named");
    if (st != want || !named)
        print_message("case '%s': expected status %d (%s) naming '%s'\n", what, (int)want,
                      lm_status_str(want), needle);
    assert_int_equal(st, want);
    assert_true(named);
}

/* An output buffer filled with a sentinel, to check errors leave it untouched. */
static void fill_sentinel(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = 7.25f;
}

static void assert_sentinel(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        assert_true(x[i] == 7.25f);
}

/* ================================================================ RMSNorm reference */

/* R rows of D; gate and w may be NULL (plain RMSNorm / no gain). */
static void ref_norm_fwd(int64_t R, int D, double eps, const double *x, const double *gate,
                         const double *w, double *y, double *rstd) {
    for (int64_t r = 0; r < R; r++) {
        const double *xr = x + r * D;
        double ss = 0.0;
        for (int d = 0; d < D; d++)
            ss += xr[d] * xr[d];
        const double rs = 1.0 / sqrt(ss / D + eps);
        if (rstd)
            rstd[r] = rs;
        for (int d = 0; d < D; d++) {
            double v = xr[d] * rs * (w ? w[d] : 1.0);
            if (gate)
                v *= sigm(gate[r * D + d]);
            y[r * D + d] = v;
        }
    }
}

static void ref_norm_bwd(int64_t R, int D, double eps, const double *x, const double *gate,
                         const double *w, const double *dy, double *dx, double *dgate, double *dw) {
    if (dw)
        memset(dw, 0, sizeof(double) * (size_t)D);
    for (int64_t r = 0; r < R; r++) {
        const double *xr = x + r * D, *dyr = dy + r * D;
        double ss = 0.0;
        for (int d = 0; d < D; d++)
            ss += xr[d] * xr[d];
        const double rs = 1.0 / sqrt(ss / D + eps);
        double dot = 0.0;
        for (int d = 0; d < D; d++) {
            const double s = gate ? sigm(gate[r * D + d]) : 1.0;
            dot += dyr[d] * (w ? w[d] : 1.0) * s * xr[d] * rs;
        }
        for (int d = 0; d < D; d++) {
            const double s = gate ? sigm(gate[r * D + d]) : 1.0, xh = xr[d] * rs;
            const double gx = dyr[d] * (w ? w[d] : 1.0) * s;
            dx[r * D + d] = rs * (gx - xh * dot / D);
            if (dgate)
                dgate[r * D + d] = dyr[d] * xh * (w ? w[d] : 1.0) * s * (1.0 - s);
            if (dw)
                dw[d] += dyr[d] * xh * s;
        }
    }
}

typedef struct {
    int64_t R;
    int D;
    double eps;
    double *x, *gate, *w, *dy, *y;
} norm_ctx;

static double norm_loss(void *p) {
    norm_ctx *c = p;
    ref_norm_fwd(c->R, c->D, c->eps, c->x, c->gate, c->w, c->y, NULL);
    return dot64(c->y, c->dy, c->R * c->D);
}

static void test_norm_ref_fd(void **state) {
    (void)state;
    for (int gated = 0; gated < 2; gated++) {
        norm_ctx c = {.R = 3, .D = 5, .eps = 1e-2};
        const int64_t n = c.R * c.D;
        c.x = dalloc(n), c.gate = gated ? dalloc(n) : NULL, c.w = dalloc(c.D), c.dy = dalloc(n);
        c.y = dalloc(n);
        lm_fill_normal(c.x, n, 11, 0.0, 1.0);
        lm_fill_normal(c.x, c.D, 12, 0.0, 0.05); /* row 0 small: eps matters */
        if (gated)
            lm_fill_normal(c.gate, n, 13, 0.0, 2.0);
        lm_fill_normal(c.w, c.D, 14, 1.0, 0.3);
        lm_fill_normal(c.dy, n, 15, 0.0, 1.0);
        double *dx = dalloc(n), *dg = dalloc(n), *dw = dalloc(c.D);
        ref_norm_bwd(c.R, c.D, c.eps, c.x, c.gate, c.w, c.dy, dx, gated ? dg : NULL, dw);
        assert_true(fd_check(gated ? "gated_rmsnorm dx" : "rmsnorm dx", norm_loss, &c, c.x, n, dx));
        assert_true(fd_check(gated ? "gated_rmsnorm dweight" : "rmsnorm dweight", norm_loss, &c,
                             c.w, c.D, dw));
        if (gated)
            assert_true(fd_check("gated_rmsnorm dgate", norm_loss, &c, c.gate, n, dg));
        free(c.x), free(c.gate), free(c.w), free(c.dy), free(c.y), free(dx), free(dg), free(dw);
    }
}

typedef struct {
    const char *name;
    int64_t N;
    int H, D; /* H = 0: plain RMSNorm over D; else gated over [N, H, D] */
    float eps;
    int has_w, pass_rstd;
    double gate_std;
    uint64_t seed;
} norm_case;

static void run_norm_case(const norm_case *nc) {
    const int gated = nc->H > 0;
    const int64_t R = nc->N * (gated ? nc->H : 1), n = R * nc->D;
    float *x, *g = NULL, *w = NULL, *dy;
    double *x64 = rand_in(n, nc->seed, 0.0, 1.0, &x);
    /* every 5th row tiny so that eps matters */
    for (int64_t r = 0; r < R; r += 5)
        for (int d = 0; d < nc->D; d++) {
            x64[r * nc->D + d] = (double)(float)(x64[r * nc->D + d] * 1e-3);
            x[r * nc->D + d] = (float)x64[r * nc->D + d];
        }
    double *g64 = gated ? rand_in(n, nc->seed + 1, 0.0, nc->gate_std, &g) : NULL;
    if (gated) /* saturated gates */
        for (int64_t i = 0; i < n; i += 13) {
            g64[i] = (i / 13) % 2 ? 30.0 : -30.0;
            g[i] = (float)g64[i];
        }
    double *w64 = nc->has_w ? rand_in(nc->D, nc->seed + 2, 1.0, 0.2, &w) : NULL;
    double *dy64 = rand_in(n, nc->seed + 3, 0.0, 1.0, &dy);
    double *y64 = dalloc(n), *rs64 = dalloc(R), *dx64 = dalloc(n), *dg64 = dalloc(n);
    double *dw64 = dalloc(nc->D);
    ref_norm_fwd(R, nc->D, nc->eps, x64, g64, w64, y64, rs64);
    ref_norm_bwd(R, nc->D, nc->eps, x64, g64, w64, dy64, dx64, gated ? dg64 : NULL, dw64);

    float *y = falloc(n), *rs = falloc(R), *dx = falloc(n), *dg = falloc(n), *dw = falloc(nc->D);
    lm_poison_f32(y, n), lm_poison_f32(rs, R), lm_poison_f32(dx, n), lm_poison_f32(dg, n);
    lm_poison_f32(dw, nc->D);
    lm_error err = {0};
    lm_status st;
    if (gated)
        st = lm_gated_rmsnorm_forward(nc->N, nc->H, nc->D, nc->eps, x, g, w, y, rs, &err);
    else
        st = lm_rmsnorm_forward(nc->N, nc->D, nc->eps, x, w, y, rs, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    char lab[160];
    printf("-- %s\n", nc->name);
    snprintf(lab, sizeof lab, "%s y", nc->name);
    assert_true(lm_check_f32(lab, y, y64, n, TOL_FWD_F32));
    snprintf(lab, sizeof lab, "%s rstd", nc->name);
    assert_true(lm_check_f32(lab, rs, rs64, R, TOL_FWD_F32));
    const float *rsin = nc->pass_rstd ? rs : NULL;
    if (gated)
        st = lm_gated_rmsnorm_backward(nc->N, nc->H, nc->D, nc->eps, x, g, w, rsin, dy, dx, dg,
                                       w ? dw : NULL, &err);
    else
        st = lm_rmsnorm_backward(nc->N, nc->D, nc->eps, x, w, rsin, dy, dx, w ? dw : NULL, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    snprintf(lab, sizeof lab, "%s dx", nc->name);
    assert_true(lm_check_f32(lab, dx, dx64, n, TOL_BWD_F32));
    if (gated) {
        snprintf(lab, sizeof lab, "%s dgate", nc->name);
        assert_true(lm_check_f32(lab, dg, dg64, n, TOL_BWD_F32));
    }
    if (w) {
        snprintf(lab, sizeof lab, "%s dweight", nc->name);
        assert_true(lm_check_f32(lab, dw, dw64, nc->D, TOL_BWD_F32));
    }
    free(x), free(g), free(w), free(dy), free(x64), free(g64), free(w64), free(dy64);
    free(y64), free(rs64), free(dx64), free(dg64), free(dw64), free(y), free(rs), free(dx);
    free(dg), free(dw);
}

static void test_norm(void **state) {
    (void)state;
    /* clang-format off */
    static const norm_case cases[] = {
        {"rmsnorm N=37 D=64",            37, 0, 64, 1e-6f, 1, 1, 0, 101},
        {"rmsnorm N=300 D=100 no-rstd",  300, 0, 100, 1e-5f, 1, 0, 0, 102},
        {"rmsnorm N=1 D=1",              1, 0, 1, 1e-5f, 1, 1, 0, 103},
        {"rmsnorm N=20 D=33 no-weight",  20, 0, 33, 1e-5f, 0, 1, 0, 104},
        {"gated N=29 H=3 Dh=64",         29, 3, 64, 1e-5f, 1, 1, 2.0, 105},
        {"gated N=64 H=4 Dh=20 no-rstd", 64, 4, 20, 1e-5f, 1, 0, 3.0, 106},
        {"gated N=5 H=2 Dh=128 no-w",    5, 2, 128, 1e-5f, 0, 1, 1.0, 107},
    };
    /* clang-format on */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_norm_case(&cases[i]);
}

/* ================================================================ short conv reference */

typedef struct {
    int B, T, C, W;
    const int64_t *cu;
    int ncu;
    int silu;
} conv_shape;

static int conv_nseq(const conv_shape *s) { return s->cu ? s->ncu - 1 : s->B; }

static void conv_seq(const conv_shape *s, int n, int64_t *bos, int64_t *len) {
    *bos = s->cu ? s->cu[n] : (int64_t)n * s->T;
    *len = s->cu ? s->cu[n + 1] - s->cu[n] : s->T;
}

/* Input at position p of sequence n (p < 0: the initial state, or 0). */
static double conv_in(const conv_shape *s, const double *x, const double *h0, int n, int64_t bos,
                      int64_t p, int c) {
    const int S = s->W - 1;
    if (p >= 0)
        return x[(bos + p) * s->C + c];
    return h0 ? h0[((int64_t)n * s->C + c) * S + S + p] : 0.0;
}

static double conv_pre(const conv_shape *s, const double *x, const double *w, const double *h0,
                       int n, int64_t bos, int64_t t, int c) {
    double pre = 0.0;
    for (int j = 0; j < s->W; j++)
        pre += w[(int64_t)c * s->W + j] * conv_in(s, x, h0, n, bos, t - (s->W - 1) + j, c);
    return pre;
}

static void ref_conv_fwd(const conv_shape *s, const double *x, const double *w, const double *h0,
                         double *y, double *hT) {
    const int S = s->W - 1;
    for (int n = 0; n < conv_nseq(s); n++) {
        int64_t bos, len;
        conv_seq(s, n, &bos, &len);
        for (int64_t t = 0; t < len; t++)
            for (int c = 0; c < s->C; c++) {
                const double pre = conv_pre(s, x, w, h0, n, bos, t, c);
                y[(bos + t) * s->C + c] = s->silu ? pre * sigm(pre) : pre;
            }
        if (hT)
            for (int c = 0; c < s->C; c++)
                for (int i = 0; i < S; i++)
                    hT[((int64_t)n * s->C + c) * S + i] = conv_in(s, x, h0, n, bos, len - S + i, c);
    }
}

static void ref_conv_bwd(const conv_shape *s, const double *x, const double *w, const double *h0,
                         const double *dy, double *dx, double *dw, double *dh0) {
    const int S = s->W - 1;
    memset(dx, 0, sizeof(double) * (size_t)s->B * s->T * s->C);
    memset(dw, 0, sizeof(double) * (size_t)s->C * s->W);
    if (dh0)
        memset(dh0, 0, sizeof(double) * (size_t)conv_nseq(s) * s->C * S);
    for (int n = 0; n < conv_nseq(s); n++) {
        int64_t bos, len;
        conv_seq(s, n, &bos, &len);
        for (int64_t t = 0; t < len; t++)
            for (int c = 0; c < s->C; c++) {
                const double pre = conv_pre(s, x, w, h0, n, bos, t, c), sg = sigm(pre);
                const double g =
                    dy[(bos + t) * s->C + c] * (s->silu ? sg * (1 + pre * (1 - sg)) : 1);
                for (int j = 0; j < s->W; j++) {
                    const int64_t p = t - S + j;
                    dw[(int64_t)c * s->W + j] += g * conv_in(s, x, h0, n, bos, p, c);
                    if (p >= 0)
                        dx[(bos + p) * s->C + c] += g * w[(int64_t)c * s->W + j];
                    else if (dh0)
                        dh0[((int64_t)n * s->C + c) * S + S + p] += g * w[(int64_t)c * s->W + j];
                }
            }
    }
}

typedef struct {
    conv_shape s;
    double *x, *w, *h0, *dy, *y;
} conv_ctx;

static double conv_loss(void *p) {
    conv_ctx *c = p;
    ref_conv_fwd(&c->s, c->x, c->w, c->h0, c->y, NULL);
    return dot64(c->y, c->dy, (int64_t)c->s.B * c->s.T * c->s.C);
}

static void test_conv_ref_fd(void **state) {
    (void)state;
    static const int64_t cu[] = {0, 0, 1, 3, 8};
    for (int silu = 0; silu < 2; silu++) {
        conv_ctx c = {.s = {.B = 1, .T = 8, .C = 3, .W = 4, .cu = cu, .ncu = 5, .silu = silu}};
        const int64_t nx = 8 * 3, nw = 3 * 4, nh = 4 * 3 * 3;
        c.x = dalloc(nx), c.w = dalloc(nw), c.h0 = dalloc(nh), c.dy = dalloc(nx), c.y = dalloc(nx);
        lm_fill_normal(c.x, nx, 21, 0.0, 1.0);
        lm_fill_normal(c.w, nw, 22, 0.0, 0.5);
        lm_fill_normal(c.h0, nh, 23, 0.0, 1.0);
        lm_fill_normal(c.dy, nx, 24, 0.0, 1.0);
        double *dx = dalloc(nx), *dw = dalloc(nw), *dh0 = dalloc(nh);
        ref_conv_bwd(&c.s, c.x, c.w, c.h0, c.dy, dx, dw, dh0);
        assert_true(fd_check("short_conv dx", conv_loss, &c, c.x, nx, dx));
        assert_true(fd_check("short_conv dweight", conv_loss, &c, c.w, nw, dw));
        assert_true(fd_check("short_conv dinitial_state", conv_loss, &c, c.h0, nh, dh0));
        free(c.x), free(c.w), free(c.h0), free(c.dy), free(c.y), free(dx), free(dw), free(dh0);
    }
}

/* ================================================================ short conv op */

typedef struct {
    const char *name;
    int B, T, C, W;
    const int64_t *cu;
    int ncu;
    int silu, has_h0;
    uint64_t seed;
} conv_case;

typedef struct {
    conv_shape s;
    lm_short_conv_config c;
    int64_t nx, nw, nh;
    float *x, *w, *h0, *dy;
    double *x64, *w64, *h064, *dy64;
} conv_fix;

static void conv_fix_init(conv_fix *f, const conv_case *cc) {
    memset(f, 0, sizeof(*f));
    f->s = (conv_shape){cc->B, cc->T, cc->C, cc->W, cc->cu, cc->ncu, cc->silu};
    lm_short_conv_config_default(&f->c, cc->B, cc->T, cc->C, cc->W);
    f->c.cu_seqlens = cc->cu, f->c.n_cu_seqlens = cc->ncu;
    f->c.activation = cc->silu ? LM_ACT_SILU : LM_ACT_NONE;
    f->nx = (int64_t)cc->B * cc->T * cc->C;
    f->nw = (int64_t)cc->C * cc->W;
    f->nh = (int64_t)conv_nseq(&f->s) * cc->C * (cc->W - 1);
    f->x64 = rand_in(f->nx, cc->seed, 0.0, 1.0, &f->x);
    f->w64 = rand_in(f->nw, cc->seed + 1, 0.0, 0.5, &f->w);
    f->dy64 = rand_in(f->nx, cc->seed + 2, 0.0, 1.0, &f->dy);
    if (cc->has_h0)
        f->h064 = rand_in(f->nh, cc->seed + 3, 0.0, 1.0, &f->h0);
}

static void conv_fix_free(conv_fix *f) {
    free(f->x), free(f->w), free(f->h0), free(f->dy);
    free(f->x64), free(f->w64), free(f->h064), free(f->dy64);
}

static void run_conv_case(const conv_case *cc) {
    conv_fix f;
    conv_fix_init(&f, cc);
    double *y64 = dalloc(f.nx), *hT64 = dalloc(f.nh), *dx64 = dalloc(f.nx), *dw64 = dalloc(f.nw);
    double *dh64 = dalloc(f.nh);
    ref_conv_fwd(&f.s, f.x64, f.w64, f.h064, y64, hT64);
    ref_conv_bwd(&f.s, f.x64, f.w64, f.h064, f.dy64, dx64, dw64, dh64);
    float *y = falloc(f.nx), *hT = falloc(f.nh), *dx = falloc(f.nx), *dw = falloc(f.nw);
    float *dh = falloc(f.nh);
    lm_poison_f32(y, f.nx), lm_poison_f32(hT, f.nh), lm_poison_f32(dx, f.nx);
    lm_poison_f32(dw, f.nw), lm_poison_f32(dh, f.nh);
    lm_error err = {0};
    lm_status st = lm_short_conv_forward(&f.c, f.x, f.w, f.h0, y, hT, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    st = lm_short_conv_backward(&f.c, f.x, f.w, f.h0, f.dy, dx, dw, dh, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    printf("-- %s\n", cc->name);
    char lab[160];
    snprintf(lab, sizeof lab, "%s y", cc->name);
    assert_true(lm_check_f32(lab, y, y64, f.nx, TOL_FWD_F32));
    snprintf(lab, sizeof lab, "%s final_state", cc->name);
    assert_true(lm_check_f32(lab, hT, hT64, f.nh, TOL_FWD_F32));
    snprintf(lab, sizeof lab, "%s dx", cc->name);
    assert_true(lm_check_f32(lab, dx, dx64, f.nx, TOL_BWD_F32));
    snprintf(lab, sizeof lab, "%s dweight", cc->name);
    assert_true(lm_check_f32(lab, dw, dw64, f.nw, TOL_BWD_F32));
    snprintf(lab, sizeof lab, "%s dinitial_state", cc->name);
    assert_true(lm_check_f32(lab, dh, dh64, f.nh, TOL_BWD_F32));
    free(y64), free(hT64), free(dx64), free(dw64), free(dh64);
    free(y), free(hT), free(dx), free(dw), free(dh);
    conv_fix_free(&f);
}

/* documents of length 0, 1, 2 (< W-1 = 3), 0 again, 5, 40 and 1 */
static const int64_t CU_MIX[] = {0, 0, 1, 3, 3, 8, 48, 49};

static void test_conv(void **state) {
    (void)state;
    /* clang-format off */
    static const conv_case cases[] = {
        {"conv B=2 T=37 C=70 W=4 silu h0",   2, 37, 70, 4, NULL, 0, 1, 1, 201},
        {"conv B=3 T=20 C=33 W=4 none",      3, 20, 33, 4, NULL, 0, 0, 0, 202},
        {"conv packed 0,1,2,0,5,40,1 silu",  1, 49, 40, 4, CU_MIX, 8, 1, 1, 203},
        {"conv packed 0,1,2,0,5,40,1 none",  1, 49, 17, 4, CU_MIX, 8, 0, 0, 204},
        {"conv W=1 silu h0",                 2, 9, 65, 1, NULL, 0, 1, 1, 205},
        {"conv W=3 T=2 h0",                  2, 2, 8, 3, NULL, 0, 1, 1, 206},
        {"conv W=5 C=1 packed",              1, 49, 1, 5, CU_MIX, 8, 1, 1, 207},
        {"conv B=1 T=1 C=96 W=4 h0",         1, 1, 96, 4, NULL, 0, 1, 1, 208},
    };
    /* clang-format on */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_conv_case(&cases[i]);
}

/* Perturbing one document's inputs changes no other document's y, final state or dx,
 * bit for bit; and each document run alone gives the packed results bit for bit. */
static void test_conv_docs(void **state) {
    (void)state;
    const conv_case cc = {"docs", 1, 49, 40, 4, CU_MIX, 8, 1, 1, 301};
    conv_fix f;
    conv_fix_init(&f, &cc);
    const int N = 7, C = cc.C, S = cc.W - 1;
    float *y0 = falloc(f.nx), *h0T = falloc(f.nh), *dx0 = falloc(f.nx), *dw0 = falloc(f.nw);
    float *y1 = falloc(f.nx), *h1T = falloc(f.nh), *dx1 = falloc(f.nx), *dw1 = falloc(f.nw);
    lm_error err = {0};
    assert_int_equal(lm_short_conv_forward(&f.c, f.x, f.w, f.h0, y0, h0T, &err), LM_OK);
    assert_int_equal(lm_short_conv_backward(&f.c, f.x, f.w, f.h0, f.dy, dx0, dw0, NULL, &err),
                     LM_OK);
    for (int k = 0; k < N; k++) {
        const int64_t a = CU_MIX[k], b = CU_MIX[k + 1];
        float *xp = malloc(sizeof(float) * (size_t)f.nx);
        memcpy(xp, f.x, sizeof(float) * (size_t)f.nx);
        for (int64_t i = a * C; i < b * C; i++)
            xp[i] += 0.5f;
        float *h0p = malloc(sizeof(float) * (size_t)f.nh);
        memcpy(h0p, f.h0, sizeof(float) * (size_t)f.nh);
        for (int64_t i = (int64_t)k * C * S; i < (int64_t)(k + 1) * C * S; i++)
            h0p[i] -= 0.25f;
        assert_int_equal(lm_short_conv_forward(&f.c, xp, f.w, h0p, y1, h1T, &err), LM_OK);
        assert_int_equal(lm_short_conv_backward(&f.c, xp, f.w, h0p, f.dy, dx1, dw1, NULL, &err),
                         LM_OK);
        int changed = 0;
        for (int m = 0; m < N; m++) {
            const int64_t ma = CU_MIX[m] * C, mb = CU_MIX[m + 1] * C;
            const size_t sz = sizeof(float) * (size_t)(mb - ma);
            const size_t hs = sizeof(float) * (size_t)C * S;
            if (m == k) {
                changed |= memcmp(h0T + (int64_t)m * C * S, h1T + (int64_t)m * C * S, hs) != 0;
                if (mb > ma)
                    changed |= memcmp(y0 + ma, y1 + ma, sz) != 0;
                continue;
            }
            if (sz) {
                assert_memory_equal(y0 + ma, y1 + ma, sz);
                assert_memory_equal(dx0 + ma, dx1 + ma, sz);
            }
            assert_memory_equal(h0T + (int64_t)m * C * S, h1T + (int64_t)m * C * S, hs);
        }
        assert_true(changed); /* the perturbation did reach its own document */
        free(xp), free(h0p);
    }
    /* each document alone (B = 1, its own T, its own state) */
    for (int k = 0; k < N; k++) {
        const int64_t a = CU_MIX[k], L = CU_MIX[k + 1] - a;
        lm_short_conv_config c1;
        lm_short_conv_config_default(&c1, 1, (int)L, C, cc.W);
        float *ys = falloc(L * C), *hs = falloc((int64_t)C * S), *dxs = falloc(L * C);
        assert_int_equal(
            lm_short_conv_forward(&c1, f.x + a * C, f.w, f.h0 + (int64_t)k * C * S, ys, hs, &err),
            LM_OK);
        assert_int_equal(lm_short_conv_backward(&c1, f.x + a * C, f.w, f.h0 + (int64_t)k * C * S,
                                                f.dy + a * C, dxs, NULL, NULL, &err),
                         LM_OK);
        if (L) {
            assert_memory_equal(ys, y0 + a * C, sizeof(float) * (size_t)(L * C));
            assert_memory_equal(dxs, dx0 + a * C, sizeof(float) * (size_t)(L * C));
        }
        assert_memory_equal(hs, h0T + (int64_t)k * C * S, sizeof(float) * (size_t)C * S);
        free(ys), free(hs), free(dxs);
    }
    printf("conv docs: independent under cu_seqlens, each alone = packed (bitwise)\n");
    free(y0), free(h0T), free(dx0), free(dw0), free(y1), free(h1T), free(dx1), free(dw1);
    conv_fix_free(&f);
}

/* Prefill of P tokens (returning the state) then T - P decode steps equal the full
 * forward bit for bit, and the state after the last step equals its final state. */
static void test_conv_decode(void **state) {
    (void)state;
    const int B = 3, T = 23, C = 50, W = 4, S = W - 1;
    const conv_case cc = {"decode", B, T, C, W, NULL, 0, 1, 1, 401};
    conv_fix f;
    conv_fix_init(&f, &cc);
    float *yfull = falloc(f.nx), *hfull = falloc(f.nh);
    lm_error err = {0};
    assert_int_equal(lm_short_conv_forward(&f.c, f.x, f.w, f.h0, yfull, hfull, &err), LM_OK);
    const int prefill[] = {0, 1, 2, 3, 10};
    for (int pi = 0; pi < 5; pi++) {
        const int P = prefill[pi];
        float *st = falloc(f.nh), *y = falloc(f.nx), *xt = falloc((int64_t)B * C);
        float *yt = falloc((int64_t)B * C);
        lm_poison_f32(y, f.nx);
        memcpy(st, f.h0, sizeof(float) * (size_t)f.nh);
        if (P > 0) {
            /* prefill: the first P tokens of each sequence, state updated in place */
            float *xp = falloc((int64_t)B * P * C), *yp = falloc((int64_t)B * P * C);
            for (int b = 0; b < B; b++)
                memcpy(xp + (int64_t)b * P * C, f.x + (int64_t)b * T * C,
                       sizeof(float) * (size_t)P * C);
            lm_short_conv_config c1;
            lm_short_conv_config_default(&c1, B, P, C, W);
            assert_int_equal(lm_short_conv_forward(&c1, xp, f.w, st, yp, st, &err), LM_OK);
            for (int b = 0; b < B; b++)
                memcpy(y + (int64_t)b * T * C, yp + (int64_t)b * P * C,
                       sizeof(float) * (size_t)P * C);
            free(xp), free(yp);
        }
        for (int t = P; t < T; t++) {
            for (int b = 0; b < B; b++)
                memcpy(xt + (int64_t)b * C, f.x + ((int64_t)b * T + t) * C, sizeof(float) * C);
            assert_int_equal(lm_short_conv_step(B, C, W, LM_ACT_SILU, xt, f.w, st, yt, &err),
                             LM_OK);
            for (int b = 0; b < B; b++)
                memcpy(y + ((int64_t)b * T + t) * C, yt + (int64_t)b * C, sizeof(float) * C);
        }
        assert_memory_equal(y, yfull, sizeof(float) * (size_t)f.nx);
        assert_memory_equal(st, hfull, sizeof(float) * (size_t)B * C * S);
        printf("conv decode: prefill %d + %d steps = full forward (bitwise), state equal\n", P,
               T - P);
        free(st), free(y), free(xt), free(yt);
    }
    free(yfull), free(hfull);
    conv_fix_free(&f);
}

/* ================================================================ SwiGLU reference */

typedef struct {
    int64_t N;
    int D, F;
    double *x, *wg, *wu, *wd, *dout, *out;
} swiglu_ctx;

static void ref_swiglu_fwd(int64_t N, int D, int F, const double *x, const double *wg,
                           const double *wu, const double *wd, double *out) {
    double *a = dalloc(F);
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * D;
        for (int f = 0; f < F; f++) {
            double g = 0.0, u = 0.0;
            for (int d = 0; d < D; d++) {
                g += wg[(int64_t)f * D + d] * xr[d];
                u += wu[(int64_t)f * D + d] * xr[d];
            }
            a[f] = g * sigm(g) * u;
        }
        for (int d = 0; d < D; d++) {
            double o = 0.0;
            for (int f = 0; f < F; f++)
                o += wd[(int64_t)d * F + f] * a[f];
            out[n * D + d] = o;
        }
    }
    free(a);
}

static void ref_swiglu_bwd(int64_t N, int D, int F, const double *x, const double *wg,
                           const double *wu, const double *wd, const double *dout, double *dx,
                           double *dwg, double *dwu, double *dwd) {
    memset(dx, 0, sizeof(double) * (size_t)(N * D));
    memset(dwg, 0, sizeof(double) * (size_t)F * D);
    memset(dwu, 0, sizeof(double) * (size_t)F * D);
    memset(dwd, 0, sizeof(double) * (size_t)D * F);
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * D, *dor = dout + n * D;
        for (int f = 0; f < F; f++) {
            double g = 0.0, u = 0.0, da = 0.0;
            for (int d = 0; d < D; d++) {
                g += wg[(int64_t)f * D + d] * xr[d];
                u += wu[(int64_t)f * D + d] * xr[d];
                da += dor[d] * wd[(int64_t)d * F + f];
            }
            const double s = sigm(g), a = g * s * u;
            const double dg = da * u * s * (1.0 + g * (1.0 - s)), du = da * g * s;
            for (int d = 0; d < D; d++) {
                dwd[(int64_t)d * F + f] += dor[d] * a;
                dwg[(int64_t)f * D + d] += dg * xr[d];
                dwu[(int64_t)f * D + d] += du * xr[d];
                dx[n * D + d] += dg * wg[(int64_t)f * D + d] + du * wu[(int64_t)f * D + d];
            }
        }
    }
}

static double swiglu_loss(void *p) {
    swiglu_ctx *c = p;
    ref_swiglu_fwd(c->N, c->D, c->F, c->x, c->wg, c->wu, c->wd, c->out);
    return dot64(c->out, c->dout, c->N * c->D);
}

static void test_swiglu_ref_fd(void **state) {
    (void)state;
    swiglu_ctx c = {.N = 3, .D = 4, .F = 5};
    const int64_t nx = 12, nw = 20;
    c.x = dalloc(nx), c.wg = dalloc(nw), c.wu = dalloc(nw), c.wd = dalloc(nw);
    c.dout = dalloc(nx), c.out = dalloc(nx);
    lm_fill_normal(c.x, nx, 31, 0.0, 1.0);
    lm_fill_normal(c.wg, nw, 32, 0.0, 0.7);
    lm_fill_normal(c.wu, nw, 33, 0.0, 0.7);
    lm_fill_normal(c.wd, nw, 34, 0.0, 0.7);
    lm_fill_normal(c.dout, nx, 35, 0.0, 1.0);
    double *dx = dalloc(nx), *dwg = dalloc(nw), *dwu = dalloc(nw), *dwd = dalloc(nw);
    ref_swiglu_bwd(c.N, c.D, c.F, c.x, c.wg, c.wu, c.wd, c.dout, dx, dwg, dwu, dwd);
    assert_true(fd_check("swiglu dx", swiglu_loss, &c, c.x, nx, dx));
    assert_true(fd_check("swiglu dgate_proj", swiglu_loss, &c, c.wg, nw, dwg));
    assert_true(fd_check("swiglu dup_proj", swiglu_loss, &c, c.wu, nw, dwu));
    assert_true(fd_check("swiglu ddown_proj", swiglu_loss, &c, c.wd, nw, dwd));
    free(c.x), free(c.wg), free(c.wu), free(c.wd), free(c.dout), free(c.out);
    free(dx), free(dwg), free(dwu), free(dwd);
}

typedef struct {
    int64_t N;
    int D, F;
    float *x, *wg, *wu, *wd, *dout;
    double *x64, *wg64, *wu64, *wd64, *dout64;
} swiglu_fix;

static void swiglu_fix_init(swiglu_fix *f, int64_t N, int D, int F, uint64_t seed) {
    f->N = N, f->D = D, f->F = F;
    const double sd = 1.0 / sqrt((double)D), sf = 1.0 / sqrt((double)F);
    f->x64 = rand_in(N * D, seed, 0.0, 1.0, &f->x);
    f->wg64 = rand_in((int64_t)F * D, seed + 1, 0.0, 2.0 * sd, &f->wg);
    f->wu64 = rand_in((int64_t)F * D, seed + 2, 0.0, sd, &f->wu);
    f->wd64 = rand_in((int64_t)D * F, seed + 3, 0.0, sf, &f->wd);
    f->dout64 = rand_in(N * D, seed + 4, 0.0, 1.0, &f->dout);
}

static void swiglu_fix_free(swiglu_fix *f) {
    free(f->x), free(f->wg), free(f->wu), free(f->wd), free(f->dout);
    free(f->x64), free(f->wg64), free(f->wu64), free(f->wd64), free(f->dout64);
}

static void test_swiglu(void **state) {
    (void)state;
    const struct {
        int64_t N;
        int D, F, keep_hidden, give_ws;
    } cases[] = {{100, 48, 80, 1, 0}, {130, 40, 70, 0, 1}, {1, 16, 24, 1, 1}, {64, 8, 200, 0, 0}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t N = cases[ci].N;
        const int D = cases[ci].D, F = cases[ci].F;
        swiglu_fix f;
        swiglu_fix_init(&f, N, D, F, 500 + ci);
        const int64_t nx = N * D, nw = (int64_t)F * D;
        double *out64 = dalloc(nx), *dx64 = dalloc(nx), *dwg64 = dalloc(nw), *dwu64 = dalloc(nw);
        double *dwd64 = dalloc(nw);
        ref_swiglu_fwd(N, D, F, f.x64, f.wg64, f.wu64, f.wd64, out64);
        ref_swiglu_bwd(N, D, F, f.x64, f.wg64, f.wu64, f.wd64, f.dout64, dx64, dwg64, dwu64, dwd64);
        float *out = falloc(nx), *dx = falloc(nx), *dwg = falloc(nw), *dwu = falloc(nw);
        float *dwd = falloc(nw);
        float *hidden = cases[ci].keep_hidden ? falloc(N * 2 * F) : NULL;
        float *ws = cases[ci].give_ws ? falloc(lm_swiglu_ws_floats(N, F, hidden != NULL)) : NULL;
        lm_poison_f32(out, nx), lm_poison_f32(dx, nx), lm_poison_f32(dwg, nw);
        lm_poison_f32(dwu, nw), lm_poison_f32(dwd, nw);
        if (hidden)
            lm_poison_f32(hidden, N * 2 * F);
        if (ws)
            lm_poison_f32(ws, lm_swiglu_ws_floats(N, F, hidden != NULL));
        lm_swiglu_weights w = {f.wg, f.wu, f.wd};
        lm_swiglu_grads g = {dwg, dwu, dwd};
        lm_error err = {0};
        lm_status st = lm_swiglu_forward(N, D, F, &w, f.x, out, hidden, ws, &err);
        if (st != LM_OK)
            print_message("%s\n", err.msg);
        assert_int_equal(st, LM_OK);
        st = lm_swiglu_backward(N, D, F, &w, f.x, hidden, f.dout, dx, &g, ws, &err);
        if (st != LM_OK)
            print_message("%s\n", err.msg);
        assert_int_equal(st, LM_OK);
        printf("-- swiglu N=%lld D=%d F=%d hidden=%d ws=%d\n", (long long)N, D, F,
               cases[ci].keep_hidden, cases[ci].give_ws);
        assert_true(lm_check_f32("swiglu out", out, out64, nx, TOL_FWD_F32));
        assert_true(lm_check_f32("swiglu dx", dx, dx64, nx, TOL_BWD_F32));
        assert_true(lm_check_f32("swiglu dgate_proj", dwg, dwg64, nw, TOL_BWD_F32));
        assert_true(lm_check_f32("swiglu dup_proj", dwu, dwu64, nw, TOL_BWD_F32));
        assert_true(lm_check_f32("swiglu ddown_proj", dwd, dwd64, nw, TOL_BWD_F32));
        free(out64), free(dx64), free(dwg64), free(dwu64), free(dwd64);
        free(out), free(dx), free(dwg), free(dwu), free(dwd), free(hidden), free(ws);
        swiglu_fix_free(&f);
    }
}

/* ================================================================ cross-entropy reference */

/* Materialised logits in fp64. nll, dh, dW may be NULL. Returns the loss. */
static double ref_ce(int64_t N, int D, int V, const double *h, const double *W, const int32_t *tg,
                     int ign, double dloss, int64_t *count, double *nll, double *dh, double *dW) {
    double *l = dalloc(V);
    int64_t cnt = 0;
    for (int64_t n = 0; n < N; n++)
        cnt += tg[n] != ign;
    if (dh)
        memset(dh, 0, sizeof(double) * (size_t)(N * D));
    if (dW)
        memset(dW, 0, sizeof(double) * (size_t)V * D);
    double sum = 0.0;
    for (int64_t n = 0; n < N; n++) {
        double m = -INFINITY;
        for (int v = 0; v < V; v++) {
            l[v] = dot64(h + n * D, W + (int64_t)v * D, D);
            m = l[v] > m ? l[v] : m;
        }
        double s = 0.0;
        for (int v = 0; v < V; v++)
            s += exp(l[v] - m);
        const double lse = m + log(s);
        if (tg[n] == ign) {
            if (nll)
                nll[n] = 0.0;
            continue;
        }
        if (nll)
            nll[n] = lse - l[tg[n]];
        sum += lse - l[tg[n]];
        if (dh || dW)
            for (int v = 0; v < V; v++) {
                const double dl = dloss * (exp(l[v] - lse) - (v == tg[n])) / (double)cnt;
                for (int d = 0; d < D; d++) {
                    if (dh)
                        dh[n * D + d] += dl * W[(int64_t)v * D + d];
                    if (dW)
                        dW[(int64_t)v * D + d] += dl * h[n * D + d];
                }
            }
    }
    free(l);
    if (count)
        *count = cnt;
    return cnt ? sum / (double)cnt : 0.0;
}

typedef struct {
    int64_t N;
    int D, V;
    double *h, *W;
    const int32_t *tg;
} ce_ctx;

static double ce_loss(void *p) {
    ce_ctx *c = p;
    return ref_ce(c->N, c->D, c->V, c->h, c->W, c->tg, -1, 1.0, NULL, NULL, NULL, NULL);
}

static void test_ce_ref_fd(void **state) {
    (void)state;
    static const int32_t tg[] = {3, -1, 0, 6, 6};
    ce_ctx c = {.N = 5, .D = 4, .V = 7, .tg = tg};
    c.h = dalloc(20), c.W = dalloc(28);
    lm_fill_normal(c.h, 20, 41, 0.0, 1.0);
    lm_fill_normal(c.W, 28, 42, 0.0, 1.0);
    double *dh = dalloc(20), *dW = dalloc(28);
    int64_t cnt = 0;
    ref_ce(c.N, c.D, c.V, c.h, c.W, tg, -1, 1.0, &cnt, NULL, dh, dW);
    assert_int_equal(cnt, 4);
    for (int d = 0; d < c.D; d++) /* the ignored row gets no gradient */
        assert_true(dh[1 * c.D + d] == 0.0);
    assert_true(fd_check("cross_entropy dh", ce_loss, &c, c.h, 20, dh));
    assert_true(fd_check("cross_entropy dW", ce_loss, &c, c.W, 28, dW));
    free(c.h), free(c.W), free(dh), free(dW);
}

typedef struct {
    int64_t N;
    int D, V;
    float *h, *W;
    double *h64, *W64;
    int32_t *tg;
} ce_fix;

/* targets: uniform ids, every 7th ignored (-1) when ignore_some; all ignored when
 * ignore_all. h ~ N(0, 1), W ~ N(0, 1/sqrt(D)) * 2 (logits of a few nats). */
static void ce_fix_init(ce_fix *f, int64_t N, int D, int V, int ignore_some, int ignore_all,
                        uint64_t seed) {
    f->N = N, f->D = D, f->V = V;
    f->h64 = rand_in(N * D, seed, 0.0, 1.0, &f->h);
    f->W64 = rand_in((int64_t)V * D, seed + 1, 0.0, 2.0 / sqrt((double)D), &f->W);
    f->tg = malloc(sizeof(int32_t) * (size_t)(N > 0 ? N : 1));
    lm_rng r;
    lm_rng_init(&r, seed + 2);
    for (int64_t n = 0; n < N; n++) {
        f->tg[n] = (int32_t)(lm_rng_u32(&r) % (uint32_t)V);
        if (ignore_all || (ignore_some && n % 7 == 3))
            f->tg[n] = -1;
    }
    if (N > 2 && !ignore_all)
        f->tg[1] = V - 1, f->tg[2] = 0; /* the first and last vocabulary rows */
}

static void ce_fix_free(ce_fix *f) {
    free(f->h), free(f->W), free(f->h64), free(f->W64), free(f->tg);
}

typedef struct {
    double loss;
    int64_t count;
    float *lse, *nll, *dh, *dW;
} ce_out;

static void ce_run(const ce_fix *f, int chunk, float dloss, int pass_lse, int give_ws, ce_out *o) {
    lm_ce_config c;
    lm_ce_config_default(&c, f->N, f->D, f->V);
    if (chunk > 0)
        c.chunk_size = chunk;
    float *ws = NULL;
    if (give_ws) {
        c.ws_floats = lm_cross_entropy_ws_floats(&c);
        ws = falloc(c.ws_floats);
        lm_poison_f32(ws, c.ws_floats);
        c.ws = ws;
    }
    const int64_t N = f->N;
    o->lse = falloc(N), o->nll = falloc(N), o->dh = falloc(N * f->D);
    o->dW = falloc((int64_t)f->V * f->D);
    lm_poison_f32(o->lse, N), lm_poison_f32(o->nll, N), lm_poison_f32(o->dh, N * f->D);
    lm_poison_f32(o->dW, (int64_t)f->V * f->D);
    lm_error err = {0};
    lm_status st =
        lm_cross_entropy_forward(&c, f->h, f->W, f->tg, &o->loss, &o->count, o->lse, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    int64_t cnt2 = -1;
    st = lm_cross_entropy_nll(&c, f->h, f->W, f->tg, o->nll, &cnt2, &err);
    assert_int_equal(st, LM_OK);
    assert_int_equal(cnt2, o->count);
    st = lm_cross_entropy_backward(&c, f->h, f->W, f->tg, pass_lse ? o->lse : NULL, dloss, o->dh,
                                   o->dW, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    free(ws);
}

static void ce_out_free(ce_out *o) { free(o->lse), free(o->nll), free(o->dh), free(o->dW); }

static void test_ce(void **state) {
    (void)state;
    const struct {
        int64_t N;
        int D, V;
        int chunks[6];
        uint64_t seed;
    } cases[] = {
        {300, 32, 257, {1, 7, 64, 257, LM_CE_CHUNK_DEFAULT, 100}, 601},
        {70, 16, 50257, {LM_CE_CHUNK_DEFAULT, 4096, 50257, 3000, 0, 0}, 602},
        {1, 8, 5, {1, 2, 5, 64, 0, 0}, 603},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        ce_fix f;
        const int64_t N = cases[ci].N;
        const int D = cases[ci].D, V = cases[ci].V;
        ce_fix_init(&f, N, D, V, 1, 0, cases[ci].seed);
        const float dloss = 0.75f;
        double *nll64 = dalloc(N), *dh64 = dalloc(N * D), *dW64 = dalloc((int64_t)V * D);
        int64_t cnt64;
        const double loss64 =
            ref_ce(N, D, V, f.h64, f.W64, f.tg, -1, dloss, &cnt64, nll64, dh64, dW64);
        ce_out unchunked;
        ce_run(&f, V, dloss, 1, 0, &unchunked);
        for (int k = 0; k < 6 && cases[ci].chunks[k]; k++) {
            const int ch = cases[ci].chunks[k];
            ce_out o;
            ce_run(&f, ch, dloss, k % 2 == 0, k % 3 == 1, &o);
            printf("-- cross_entropy N=%lld D=%d V=%d chunk=%d (loss %.6f, ref %.6f, count %lld)\n",
                   (long long)N, D, V, ch, o.loss, loss64, (long long)o.count);
            assert_int_equal(o.count, cnt64);
            assert_true(lm_check_f64("ce loss", &o.loss, &loss64, 1, TOL_FWD_F32));
            assert_true(lm_check_f32("ce nll", o.nll, nll64, N, TOL_FWD_F32));
            assert_true(lm_check_f32("ce dh", o.dh, dh64, N * D, TOL_BWD_F32));
            assert_true(lm_check_f32("ce dW", o.dW, dW64, (int64_t)V * D, TOL_BWD_F32));
            for (int64_t n = 0; n < N; n++) /* ignored rows: nll 0, dh exactly 0 */
                if (f.tg[n] == -1) {
                    assert_true(o.nll[n] == 0.0f);
                    for (int d = 0; d < D; d++)
                        assert_true(o.dh[n * D + d] == 0.0f);
                }
            /* chunked = unchunked */
            double *u = lm_to_f64(unchunked.dh, N * D);
            assert_true(lm_check_f32("ce dh chunked vs unchunked", o.dh, u, N * D, tol_chunk(V)));
            free(u);
            u = lm_to_f64(unchunked.dW, (int64_t)V * D);
            assert_true(
                lm_check_f32("ce dW chunked vs unchunked", o.dW, u, (int64_t)V * D, tol_chunk(V)));
            free(u);
            assert_true(fabs(o.loss - unchunked.loss) <= tol_chunk(V) * fabs(unchunked.loss));
            ce_out_free(&o);
        }
        ce_out_free(&unchunked);
        free(nll64), free(dh64), free(dW64);
        ce_fix_free(&f);
    }
}

static void test_ce_all_ignored(void **state) {
    (void)state;
    ce_fix f;
    ce_fix_init(&f, 90, 12, 257, 0, 1, 701);
    for (int ch = 1; ch <= 257; ch += 128) {
        ce_out o;
        ce_run(&f, ch, 1.0f, ch == 1, 1, &o);
        assert_int_equal(o.count, 0);
        assert_true(o.loss == 0.0);
        for (int64_t i = 0; i < f.N; i++)
            assert_true(o.nll[i] == 0.0f && isfinite(o.lse[i]));
        for (int64_t i = 0; i < f.N * f.D; i++)
            assert_true(o.dh[i] == 0.0f);
        for (int64_t i = 0; i < (int64_t)f.V * f.D; i++)
            assert_true(o.dW[i] == 0.0f);
        ce_out_free(&o);
    }
    /* N = 0: nothing counted, dW zeroed */
    lm_ce_config c;
    lm_ce_config_default(&c, 0, f.D, f.V);
    double loss = -1;
    int64_t cnt = -1;
    lm_error err = {0};
    assert_int_equal(lm_cross_entropy_forward(&c, NULL, f.W, NULL, &loss, &cnt, NULL, &err), LM_OK);
    assert_true(loss == 0.0 && cnt == 0);
    float *dW = falloc((int64_t)f.V * f.D);
    lm_poison_f32(dW, (int64_t)f.V * f.D);
    assert_int_equal(lm_cross_entropy_backward(&c, NULL, f.W, NULL, NULL, 1.0f, NULL, dW, &err),
                     LM_OK);
    for (int64_t i = 0; i < (int64_t)f.V * f.D; i++)
        assert_true(dW[i] == 0.0f);
    free(dW);
    printf("cross_entropy all ignored / N = 0: loss 0, count 0, zero gradients\n");
    ce_fix_free(&f);
}

/* ================================================================ determinism */

typedef struct {
    float *buf[12];
    int64_t len[12];
    int n;
} outset;

static void outset_add(outset *s, float *p, int64_t n) {
    s->buf[s->n] = p, s->len[s->n] = n, s->n++;
}

static void outset_snap(const outset *s, float **copy) {
    for (int i = 0; i < s->n; i++) {
        copy[i] = malloc(sizeof(float) * (size_t)s->len[i]);
        memcpy(copy[i], s->buf[i], sizeof(float) * (size_t)s->len[i]);
    }
}

static void outset_compare(const outset *s, float **copy, const char *op, int threads) {
    for (int i = 0; i < s->n; i++) {
        if (memcmp(copy[i], s->buf[i], sizeof(float) * (size_t)s->len[i]) != 0)
            print_message("%s: output %d differs between 1 and %d threads\n", op, i, threads);
        assert_memory_equal(copy[i], s->buf[i], sizeof(float) * (size_t)s->len[i]);
    }
}

static void test_threads(void **state) {
    (void)state;
    /* shapes above the single-thread threshold, with several tasks each */
    const int64_t Nn = 300;
    const int Dn = 96, Hg = 4, Dg = 40;
    float *xn, *wn, *dyn, *xg, *gg, *wg, *dog;
    double *t0 = rand_in(Nn * Dn, 801, 0.0, 1.0, &xn), *t1 = rand_in(Dn, 802, 1.0, 0.2, &wn);
    double *t2 = rand_in(Nn * Dn, 803, 0.0, 1.0, &dyn);
    double *t3 = rand_in(Nn * Hg * Dg, 804, 0.0, 1.0, &xg);
    double *t4 = rand_in(Nn * Hg * Dg, 805, 0.0, 2.0, &gg), *t5 = rand_in(Dg, 806, 1.0, 0.2, &wg);
    double *t6 = rand_in(Nn * Hg * Dg, 807, 0.0, 1.0, &dog);
    const conv_case cc = {"threads", 1, 49 * 6, 100, 4, NULL, 0, 1, 1, 808};
    conv_fix cf;
    conv_fix_init(&cf, &cc);
    swiglu_fix sf;
    swiglu_fix_init(&sf, 300, 64, 96, 809);
    ce_fix ef;
    ce_fix_init(&ef, 300, 32, 257, 1, 0, 810);

    float *yn = falloc(Nn * Dn), *rn = falloc(Nn), *dxn = falloc(Nn * Dn), *dwn = falloc(Dn);
    float *og = falloc(Nn * Hg * Dg), *dxg = falloc(Nn * Hg * Dg), *dgg = falloc(Nn * Hg * Dg);
    float *dwg = falloc(Dg);
    float *yc = falloc(cf.nx), *hc = falloc(cf.nh), *dxc = falloc(cf.nx), *dwc = falloc(cf.nw);
    float *dhc = falloc(cf.nh);
    const int64_t snx = sf.N * sf.D, snw = (int64_t)sf.F * sf.D;
    float *so = falloc(snx), *shid = falloc(sf.N * 2 * sf.F), *sdx = falloc(snx);
    float *sdg = falloc(snw), *sdu = falloc(snw), *sdd = falloc(snw);
    float loss_f = 0;
    float *elsev = falloc(ef.N), *edh = falloc(ef.N * ef.D), *edW = falloc((int64_t)ef.V * ef.D);
    outset s = {0};
    outset_add(&s, yn, Nn * Dn), outset_add(&s, dxn, Nn * Dn), outset_add(&s, dwn, Dn);
    outset_add(&s, og, Nn * Hg * Dg), outset_add(&s, dxg, Nn * Hg * Dg);
    outset_add(&s, dgg, Nn * Hg * Dg), outset_add(&s, dwg, Dg);
    outset_add(&s, yc, cf.nx), outset_add(&s, dxc, cf.nx), outset_add(&s, dwc, cf.nw);
    outset_add(&s, so, snx), outset_add(&s, sdx, snx);
    outset s2 = {0};
    outset_add(&s2, sdg, snw), outset_add(&s2, sdu, snw), outset_add(&s2, sdd, snw);
    outset_add(&s2, edh, ef.N * ef.D), outset_add(&s2, edW, (int64_t)ef.V * ef.D);
    outset_add(&s2, elsev, ef.N), outset_add(&s2, &loss_f, 1), outset_add(&s2, dhc, cf.nh);
    outset_add(&s2, hc, cf.nh), outset_add(&s2, rn, Nn);
    float *ref1[12] = {0}, *ref2[12] = {0};
    const int counts[] = {1, 2, 3};
    for (int ti = 0; ti < 3; ti++) {
        lm_set_num_threads(counts[ti]);
        lm_error err = {0};
        assert_int_equal(lm_rmsnorm_forward(Nn, Dn, 1e-6f, xn, wn, yn, rn, &err), LM_OK);
        assert_int_equal(lm_rmsnorm_backward(Nn, Dn, 1e-6f, xn, wn, NULL, dyn, dxn, dwn, &err),
                         LM_OK);
        assert_int_equal(lm_gated_rmsnorm_forward(Nn, Hg, Dg, 1e-5f, xg, gg, wg, og, NULL, &err),
                         LM_OK);
        assert_int_equal(lm_gated_rmsnorm_backward(Nn, Hg, Dg, 1e-5f, xg, gg, wg, NULL, dog, dxg,
                                                   dgg, dwg, &err),
                         LM_OK);
        assert_int_equal(lm_short_conv_forward(&cf.c, cf.x, cf.w, cf.h0, yc, hc, &err), LM_OK);
        assert_int_equal(
            lm_short_conv_backward(&cf.c, cf.x, cf.w, cf.h0, cf.dy, dxc, dwc, dhc, &err), LM_OK);
        lm_swiglu_weights w = {sf.wg, sf.wu, sf.wd};
        lm_swiglu_grads g = {sdg, sdu, sdd};
        assert_int_equal(lm_swiglu_forward(sf.N, sf.D, sf.F, &w, sf.x, so, shid, NULL, &err),
                         LM_OK);
        assert_int_equal(
            lm_swiglu_backward(sf.N, sf.D, sf.F, &w, sf.x, shid, sf.dout, sdx, &g, NULL, &err),
            LM_OK);
        lm_ce_config c;
        lm_ce_config_default(&c, ef.N, ef.D, ef.V);
        c.chunk_size = 100;
        double loss;
        assert_int_equal(lm_cross_entropy_forward(&c, ef.h, ef.W, ef.tg, &loss, NULL, elsev, &err),
                         LM_OK);
        loss_f = (float)loss;
        assert_int_equal(
            lm_cross_entropy_backward(&c, ef.h, ef.W, ef.tg, elsev, 1.0f, edh, edW, &err), LM_OK);
        if (ti == 0) {
            outset_snap(&s, ref1);
            outset_snap(&s2, ref2);
        } else {
            outset_compare(&s, ref1, "layers (set 1)", counts[ti]);
            outset_compare(&s2, ref2, "layers (set 2)", counts[ti]);
            printf("threads: all layer outputs on %d threads = 1 thread (bitwise)\n", counts[ti]);
        }
    }
    lm_set_num_threads(0);
    for (int i = 0; i < 12; i++)
        free(ref1[i]), free(ref2[i]);
    free(t0), free(t1), free(t2), free(t3), free(t4), free(t5), free(t6);
    free(xn), free(wn), free(dyn), free(xg), free(gg), free(wg), free(dog);
    free(yn), free(rn), free(dxn), free(dwn), free(og), free(dxg), free(dgg), free(dwg);
    free(yc), free(hc), free(dxc), free(dwc), free(dhc);
    free(so), free(shid), free(sdx), free(sdg), free(sdu), free(sdd);
    free(elsev), free(edh), free(edW);
    conv_fix_free(&cf);
    swiglu_fix_free(&sf);
    ce_fix_free(&ef);
}

/* ================================================================ invalid input */

static void test_invalid(void **state) {
    (void)state;
    lm_error err;
    lm_status st;
    float x[64], w[32], y[64], dy[64], g[64], st3[64];
    for (int i = 0; i < 64; i++)
        x[i] = 0.1f * (float)(i % 7) - 0.2f, dy[i] = 1.0f, g[i] = 0.5f, st3[i] = 0.0f;
    for (int i = 0; i < 32; i++)
        w[i] = 1.0f;
#define EXPECT(want, what, call, needle)                                                           \
    do {                                                                                           \
        memset(&err, 0, sizeof err);                                                               \
        fill_sentinel(y, 64);                                                                      \
        st = (call);                                                                               \
        expect_status(what, st, want, &err, needle);                                               \
        assert_sentinel(y, 64);                                                                    \
    } while (0)
#define INV(what, call, needle) EXPECT(LM_ERR_INVALID, what, call, needle)
#define NONF(what, call, needle) EXPECT(LM_ERR_NONFINITE, what, call, needle)

    /* RMSNorm */
    INV("rmsnorm D = 0", lm_rmsnorm_forward(4, 0, 1e-5f, x, w, y, NULL, &err), "D = 0");
    INV("rmsnorm N < 0", lm_rmsnorm_forward(-1, 4, 1e-5f, x, w, y, NULL, &err), "N = -1");
    INV("rmsnorm eps = 0", lm_rmsnorm_forward(4, 4, 0.0f, x, w, y, NULL, &err), "eps");
    INV("rmsnorm eps NaN", lm_rmsnorm_forward(4, 4, NAN, x, w, y, NULL, &err), "eps");
    INV("rmsnorm x NULL", lm_rmsnorm_forward(4, 4, 1e-5f, NULL, w, y, NULL, &err), "'x'");
    INV("rmsnorm y aliases x", lm_rmsnorm_forward(4, 4, 1e-5f, y, w, y, NULL, &err), "alias");
    x[9] = NAN;
    NONF("rmsnorm x NaN", lm_rmsnorm_forward(4, 4, 1e-5f, x, w, y, NULL, &err), "'x'");
    assert_non_null(strstr(err.msg, "row 2"));
    x[9] = 0.5f;
    w[2] = INFINITY;
    NONF("rmsnorm weight Inf", lm_rmsnorm_forward(4, 4, 1e-5f, x, w, y, NULL, &err), "'weight'");
    w[2] = 1.0f;
    dy[5] = NAN;
    NONF("rmsnorm dy NaN", lm_rmsnorm_backward(4, 4, 1e-5f, x, w, NULL, dy, y, NULL, &err), "'dy'");
    dy[5] = 1.0f;
    {
        float rs[4] = {1, 1, -1, 1};
        INV("rmsnorm rstd < 0", lm_rmsnorm_backward(4, 4, 1e-5f, x, w, rs, dy, y, NULL, &err),
            "rstd");
        rs[2] = NAN;
        NONF("rmsnorm rstd NaN", lm_rmsnorm_backward(4, 4, 1e-5f, x, w, rs, dy, y, NULL, &err),
             "rstd");
        rs[2] = 0.0f; /* what the forward saves when a row's mean square overflows */
        NONF("rmsnorm rstd 0", lm_rmsnorm_backward(4, 4, 1e-5f, x, w, rs, dy, y, NULL, &err),
             "overflowed");
    }
    /* gated RMSNorm */
    INV("gated H = 0", lm_gated_rmsnorm_forward(4, 0, 4, 1e-5f, x, g, w, y, NULL, &err), "H = 0");
    INV("gated Dh = 0", lm_gated_rmsnorm_forward(4, 2, 0, 1e-5f, x, g, w, y, NULL, &err), "Dh");
    INV("gated gate NULL", lm_gated_rmsnorm_forward(4, 2, 4, 1e-5f, x, NULL, w, y, NULL, &err),
        "'gate'");
    g[30] = -INFINITY;
    NONF("gated gate Inf", lm_gated_rmsnorm_forward(4, 2, 4, 1e-5f, x, g, w, y, NULL, &err),
         "'gate'");
    NONF("gated backward gate Inf",
         lm_gated_rmsnorm_backward(4, 2, 4, 1e-5f, x, g, w, NULL, dy, y, NULL, NULL, &err),
         "'gate'");
    g[30] = 0.5f;
    INV("gated o aliases gate", lm_gated_rmsnorm_forward(4, 2, 4, 1e-5f, x, y, w, y, NULL, &err),
        "alias");

    /* short conv */
    lm_short_conv_config c;
    lm_short_conv_config_default(&c, 2, 4, 8, 4);
    INV("conv ok-but-y-aliases-x", lm_short_conv_forward(&c, y, w, NULL, y, NULL, &err), "alias");
    c.W = 0;
    INV("conv W = 0", lm_short_conv_forward(&c, x, w, NULL, y, NULL, &err), "W = 0");
    c.W = LM_SHORT_CONV_MAX_W + 1;
    INV("conv W too large", lm_short_conv_forward(&c, x, w, NULL, y, NULL, &err), "W = 17");
    c.W = 4;
    c.activation = (lm_activation)7;
    INV("conv activation", lm_short_conv_forward(&c, x, w, NULL, y, NULL, &err), "activation");
    c.activation = LM_ACT_SILU;
    c.C = 0;
    INV("conv C = 0", lm_short_conv_forward(&c, x, w, NULL, y, NULL, &err), "C = 0");
    c.C = 8;
    INV("conv weight NULL", lm_short_conv_forward(&c, x, NULL, NULL, y, NULL, &err), "'weight'");
    INV("conv x NULL", lm_short_conv_forward(&c, NULL, w, NULL, y, NULL, &err), "'x'");
    INV("conv y NULL", lm_short_conv_forward(&c, x, w, NULL, NULL, NULL, &err), "'y'");
    {
        const int64_t cu_bad0[] = {1, 4, 8}, cu_dec[] = {0, 5, 3, 8}, cu_end[] = {0, 3, 7};
        const int64_t cu_ok[] = {0, 3, 8};
        lm_short_conv_config cp;
        lm_short_conv_config_default(&cp, 2, 8, 8, 4);
        cp.cu_seqlens = cu_ok, cp.n_cu_seqlens = 3;
        INV("conv cu_seqlens with B = 2", lm_short_conv_forward(&cp, x, w, NULL, y, NULL, &err),
            "B == 1");
        cp.B = 1;
        cp.cu_seqlens = cu_bad0;
        INV("conv cu_seqlens[0] != 0", lm_short_conv_forward(&cp, x, w, NULL, y, NULL, &err),
            "cu_seqlens[0]");
        cp.cu_seqlens = cu_dec, cp.n_cu_seqlens = 4;
        INV("conv cu_seqlens decreasing", lm_short_conv_forward(&cp, x, w, NULL, y, NULL, &err),
            "decreases");
        cp.cu_seqlens = cu_end, cp.n_cu_seqlens = 3;
        INV("conv cu_seqlens end != T", lm_short_conv_forward(&cp, x, w, NULL, y, NULL, &err),
            "T = 8");
        cp.n_cu_seqlens = 1;
        INV("conv cu_seqlens too short", lm_short_conv_forward(&cp, x, w, NULL, y, NULL, &err),
            "cu_seqlens");
    }
    st3[5] = NAN;
    NONF("conv initial_state NaN", lm_short_conv_forward(&c, x, w, st3, y, NULL, &err),
         "'initial_state'");
    st3[5] = 0.0f;
    x[3] = INFINITY;
    NONF("conv x Inf", lm_short_conv_forward(&c, x, w, NULL, y, NULL, &err), "'x'");
    x[3] = 0.5f;
    dy[60] = NAN;
    NONF("conv dy NaN", lm_short_conv_backward(&c, x, w, NULL, dy, y, NULL, NULL, &err), "'dy'");
    dy[60] = 1.0f;
    INV("conv step without state", lm_short_conv_step(2, 8, 4, LM_ACT_SILU, x, w, NULL, y, &err),
        "conv_state");
    INV("conv step B = 0", lm_short_conv_step(0, 8, 4, LM_ACT_SILU, x, w, st3, y, &err), "B = 0");

    /* SwiGLU: D = 4, F = 4 */
    lm_swiglu_weights sw = {w, w, w};
    INV("swiglu D = 0", lm_swiglu_forward(4, 0, 4, &sw, x, y, NULL, NULL, &err), "D = 0");
    INV("swiglu F = 0", lm_swiglu_forward(4, 4, 0, &sw, x, y, NULL, NULL, &err), "F = 0");
    INV("swiglu N < 0", lm_swiglu_forward(-3, 4, 4, &sw, x, y, NULL, NULL, &err), "N = -3");
    lm_swiglu_weights sw_missing = {w, NULL, w};
    INV("swiglu up_proj NULL", lm_swiglu_forward(4, 4, 4, &sw_missing, x, y, NULL, NULL, &err),
        "up_proj");
    {
        float wbad[16];
        memcpy(wbad, w, sizeof wbad);
        wbad[7] = NAN;
        lm_swiglu_weights swb = {w, w, wbad};
        NONF("swiglu down_proj NaN", lm_swiglu_forward(4, 4, 4, &swb, x, y, NULL, NULL, &err),
             "'down_proj'");
    }
    INV("swiglu out aliases x", lm_swiglu_forward(4, 4, 4, &sw, y, y, NULL, NULL, &err), "alias");
    {
        float hid[32];
        for (int i = 0; i < 32; i++)
            hid[i] = 0.0f;
        hid[17] = INFINITY;
        lm_swiglu_grads sg = {NULL, NULL, NULL};
        NONF("swiglu hidden Inf", lm_swiglu_backward(4, 4, 4, &sw, x, hid, dy, y, &sg, NULL, &err),
             "'hidden'");
        dy[2] = NAN;
        NONF("swiglu dout NaN", lm_swiglu_backward(4, 4, 4, &sw, x, NULL, dy, y, &sg, NULL, &err),
             "'dout'");
        dy[2] = 1.0f;
    }

    /* cross-entropy: N = 4, D = 4, V = 16 */
    lm_ce_config ce;
    int32_t tg[4] = {1, -1, 15, 0};
    double loss = 0;
    float *lse = y;
#define CE_SET() (lm_ce_config_default(&ce, 4, 4, 16))
    CE_SET();
    ce.V = 0;
    INV("ce V = 0", lm_cross_entropy_forward(&ce, x, x, tg, &loss, NULL, lse, &err), "V = 0");
    CE_SET();
    ce.chunk_size = 0;
    INV("ce chunk_size = 0", lm_cross_entropy_forward(&ce, x, x, tg, &loss, NULL, lse, &err),
        "chunk_size");
    CE_SET();
    ce.ignore_index = 5;
    INV("ce ignore_index in vocab", lm_cross_entropy_forward(&ce, x, x, tg, &loss, NULL, lse, &err),
        "ignore_index = 5");
    CE_SET();
    tg[2] = 16;
    INV("ce target = V", lm_cross_entropy_forward(&ce, x, x, tg, &loss, NULL, lse, &err),
        "targets[2] = 16");
    tg[2] = -2;
    INV("ce target negative", lm_cross_entropy_nll(&ce, x, x, tg, lse, NULL, &err),
        "targets[2] = -2");
    INV("ce target negative (backward)",
        lm_cross_entropy_backward(&ce, x, x, tg, NULL, 1.0f, y, NULL, &err), "targets[2]");
    tg[2] = 15;
    INV("ce W NULL", lm_cross_entropy_forward(&ce, x, NULL, tg, &loss, NULL, lse, &err), "'W'");
    x[6] = NAN;
    NONF("ce h NaN", lm_cross_entropy_forward(&ce, x, w, tg, &loss, NULL, lse, &err), "'h'");
    x[6] = 0.5f;
    {
        float Wb[64];
        for (int i = 0; i < 64; i++)
            Wb[i] = 0.1f;
        Wb[63] = INFINITY;
        NONF("ce W Inf", lm_cross_entropy_forward(&ce, x, Wb, tg, &loss, NULL, lse, &err), "'W'");
        Wb[63] = 0.1f;
        float small[4];
        ce.ws = small, ce.ws_floats = 4;
        INV("ce ws too small", lm_cross_entropy_forward(&ce, x, Wb, tg, &loss, NULL, lse, &err),
            "ws_floats");
        CE_SET();
        INV("ce dloss NaN", lm_cross_entropy_backward(&ce, x, Wb, tg, NULL, NAN, y, NULL, &err),
            "dloss");
        float lbad[4] = {1, 2, NAN, 3};
        NONF("ce lse NaN", lm_cross_entropy_backward(&ce, x, Wb, tg, lbad, 1.0f, y, NULL, &err),
             "'lse'");
        INV("ce dh aliases h", lm_cross_entropy_backward(&ce, y, Wb, tg, NULL, 1.0f, y, NULL, &err),
            "alias");
        /* finite but huge: the logits overflow */
        float hb[16], Wh[64];
        for (int i = 0; i < 16; i++)
            hb[i] = 3e19f;
        for (int i = 0; i < 64; i++)
            Wh[i] = 3e19f;
        NONF("ce logits overflow",
             lm_cross_entropy_forward(&ce, hb, Wh, tg, &loss, NULL, NULL, &err), "overflow");
    }
#undef CE_SET
#undef NONF
#undef INV
#undef EXPECT
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_norm_ref_fd),    cmocka_unit_test(test_norm),
        cmocka_unit_test(test_conv_ref_fd),    cmocka_unit_test(test_conv),
        cmocka_unit_test(test_conv_docs),      cmocka_unit_test(test_conv_decode),
        cmocka_unit_test(test_swiglu_ref_fd),  cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_ce_ref_fd),      cmocka_unit_test(test_ce),
        cmocka_unit_test(test_ce_all_ignored), cmocka_unit_test(test_threads),
        cmocka_unit_test(test_invalid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
