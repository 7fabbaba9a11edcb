/* The full-attention layer (include/linmoe/attn_layer.h), whole-layer checks:
 *
 *  - gradients: central finite differences of the whole fp32 layer, loss
 *    L = sum(out * R) (R fixed random, accumulated in fp64), step FD_STEP = 1e-3
 *    (the difference divided by the fp32-rounded perturbation actually applied), for
 *    FD_SAMPLES random entries of x and of every weight; the sample of analytic
 *    gradients vs the sample of differences at relative RMS <= TOL_LAYER_FD. Shape
 *    d = 16, Hq = 4, Hkv = 2 (GQA 4:2), Dh = 8, T = 37 (crosses no 64-tile, the op's
 *    tiling is tested in test_attention.c), as B = 2 sequences of T = 37 and as one
 *    packed batch cu_seqlens = [0, 5, 5, 37] (an empty document); RoPE (theta 10000)
 *    and NoPE.
 *    Why 5e-3: as in test_kda_layer.c, the layer is fp32, so each difference carries
 *    the fp32 rounding of the forward: |L| ~ 10, eps_32 ~ 6e-8 per output over ~1e3
 *    outputs gives ~1e-6 absolute noise in L, / (2 * 1e-3) ~ 1e-3 absolute noise per
 *    FD gradient, against gradients of O(0.1..10); truncation O(h^2) ~ 1e-6.
 *    Measured rel RMS is printed per tensor.
 *  - packing: perturbing one document's x leaves every other document's output bit
 *    for bit unchanged (and changes its own); each document run alone gives its rows
 *    of the packed output (TOL_PACK), on a reused context and a fresh one alike.
 *  - determinism: out, dx and every gradient bit-identical on 1 and 2 threads.
 *  - invalid input: backward without a forward, a missing weight or gradient, Hq not
 *    a multiple of Hkv, odd Dh with RoPE, a bad rope_theta, bad cu_seqlens and a
 *    non-finite x give LM_ERR_INVALID with the name, leaving `out` untouched.
 *
 * Inference (lm_attn_layer_infer), B = 2 rows, the shape above, RoPE and NoPE, the
 * KV cache poisoned with NaN at the start (a read of an unwritten position fails the
 * compare):
 *  - decode: a prefill of P tokens (pos 0) then 64 one-token steps equal, row by row
 *    (every (sequence, position)), one lm_attn_layer_forward over the P + 64 tokens at
 *    TOL_INFER; P = 37 (the forward then crosses a 64-key tile) and P = 1.
 *  - split prefill: P1 tokens at pos 0 then P2 > 1 at pos P1 (the decode loop) equal
 *    one prefill of P1 + P2 in the outputs and in the cache (positions 0 .. P1+P2-1)
 *    at TOL_INFER, and leave the positions past P1+P2 unwritten (still NaN); (P1, P2) =
 *    (1, 36), (21, 19), (5, 2).
 *  - determinism: outputs and cache bit-identical on 1 and 2 threads.
 *  - invalid input: pos + T > Tmax, pos < 0, Tmax < 1, a missing cache, k_cache or
 *    v_cache, B or T < 1, a missing weight, non-finite x give LM_ERR_INVALID with the
 *    name, leaving out and the cache untouched; a backward after infer needs a new
 *    forward (and works after one).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "linmoe/attn_layer.h"
#include "linmoe/core.h"

#define FD_STEP 1e-3
#define FD_SAMPLES 20
#define TOL_LAYER_FD 5e-3

enum { D = 16, HQ = 4, HKV = 2, DH = 8, CQ = HQ * DH, CKV = HKV * DH, NPARAM = 4 };

typedef struct {
    const char *name;
    int64_t n;
    float *w; /* weight */
    float *g; /* gradient */
} param;

typedef struct {
    lm_attn_layer_config cfg;
    lm_attn_layer_batch batch;
    int64_t cu[4];
    int N;
    param p[NPARAM];
    lm_attn_layer_weights w;
    lm_attn_layer_grads g;
    float *x, *R, *out, *dx;
    lm_attn_layer_ctx *ctx;
} fixture;

static void fill(float *x, int64_t n, uint64_t seed, double mean, double std) {
    double *t = calloc((size_t)n, sizeof(double));
    lm_fill_normal(t, n, seed, mean, std);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)t[i];
    free(t);
}

static void fx_init(fixture *f, int packed, lm_attn_position pos, uint64_t seed) {
    memset(f, 0, sizeof(*f));
    lm_attn_layer_config_default(&f->cfg, D, HQ, HKV, DH);
    f->cfg.position = pos;
    f->cfg.rope_theta = 10000.0;
    if (packed) {
        f->cu[0] = 0, f->cu[1] = 5, f->cu[2] = 5, f->cu[3] = 37;
        f->batch = (lm_attn_layer_batch){1, 37, f->cu, 4};
    } else {
        f->batch = (lm_attn_layer_batch){2, 37, NULL, 0};
    }
    f->N = f->batch.B * f->batch.T;
    /* q/k weights larger than 1/sqrt(d) so the softmax is far from uniform */
    const double sd = 1.0 / sqrt((double)D), sc = 1.0 / sqrt((double)CQ);
    const struct {
        const char *name;
        int64_t n;
        double std;
    } spec[NPARAM] = {{"q_proj", CQ * D, 2 * sd},
                      {"k_proj", CKV * D, 2 * sd},
                      {"v_proj", CKV * D, sd},
                      {"o_proj", D * CQ, sc}};
    for (int i = 0; i < NPARAM; i++) {
        f->p[i].name = spec[i].name;
        f->p[i].n = spec[i].n;
        f->p[i].w = calloc((size_t)spec[i].n, sizeof(float));
        f->p[i].g = calloc((size_t)spec[i].n, sizeof(float));
        fill(f->p[i].w, spec[i].n, seed + 100 + (uint64_t)i, 0.0, spec[i].std);
    }
    f->w = (lm_attn_layer_weights){f->p[0].w, f->p[1].w, f->p[2].w, f->p[3].w};
    f->g = (lm_attn_layer_grads){f->p[0].g, f->p[1].g, f->p[2].g, f->p[3].g};
    const int64_t nx = (int64_t)f->N * D;
    f->x = calloc((size_t)nx, sizeof(float));
    f->R = calloc((size_t)nx, sizeof(float));
    f->out = calloc((size_t)nx, sizeof(float));
    f->dx = calloc((size_t)nx, sizeof(float));
    fill(f->x, nx, seed + 1, 0, 1);
    fill(f->R, nx, seed + 2, 0, 1);
    f->ctx = lm_attn_layer_ctx_new();
}

static void fx_free(fixture *f) {
    for (int i = 0; i < NPARAM; i++) {
        free(f->p[i].w);
        free(f->p[i].g);
    }
    free(f->x);
    free(f->R);
    free(f->out);
    free(f->dx);
    lm_attn_layer_ctx_free(f->ctx);
}

static double loss(fixture *f) {
    lm_error err = {0};
    lm_status st = lm_attn_layer_forward(&f->cfg, &f->batch, &f->w, f->x, f->out, f->ctx, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    double s = 0.0;
    for (int64_t i = 0; i < (int64_t)f->N * D; i++)
        s += (double)f->out[i] * (double)f->R[i];
    return s;
}

static void fwd_bwd(fixture *f) {
    lm_error err = {0};
    (void)loss(f);
    lm_status st =
        lm_attn_layer_backward(&f->cfg, &f->batch, &f->w, f->x, f->R, f->dx, &f->g, f->ctx, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

/* FD check of one tensor t (n entries, gradient gr) at up to FD_SAMPLES entries. */
static double loss_cb(void *ctx) { return loss((fixture *)ctx); }
static int fd_tensor(fixture *f, const char *name, float *t, const float *gr, int64_t n,
                     uint64_t seed) {
    return lm_fd_check_sampled(name, t, gr, n, FD_SAMPLES, FD_STEP, seed, loss_cb, f, TOL_LAYER_FD);
}

static void run_fd(int packed, lm_attn_position pos) {
    fixture f;
    fx_init(&f, packed, pos, packed * 10 + (uint64_t)pos);
    printf("FD: %s, %s\n", packed ? "packed [0,5,5,37]" : "B=2 T=37",
           pos == LM_POS_ROPE ? "rope" : "nope");
    fwd_bwd(&f);
    /* keep the analytic gradients: the FD forwards reuse the context */
    int ok = 1;
    float *dx = malloc((size_t)f.N * D * sizeof(float));
    memcpy(dx, f.dx, (size_t)f.N * D * sizeof(float));
    ok &= fd_tensor(&f, "x", f.x, dx, (int64_t)f.N * D, 7);
    for (int i = 0; i < NPARAM; i++)
        ok &= fd_tensor(&f, f.p[i].name, f.p[i].w, f.p[i].g, f.p[i].n, 1000 + (uint64_t)i);
    free(dx);
    fx_free(&f);
    assert_true(ok);
}

static void test_fd_rope(void **s) {
    (void)s;
    run_fd(0, LM_POS_ROPE);
    run_fd(1, LM_POS_ROPE);
}

static void test_fd_nope(void **s) {
    (void)s;
    run_fd(0, LM_POS_NOPE);
    run_fd(1, LM_POS_NOPE);
}

/* Perturb the x of tokens [a, e) of the packed batch; outputs outside are unchanged. */
static void test_packed_independence(void **s) {
    (void)s;
    const int docs[2][2] = {{0, 5}, {5, 37}};
    for (int pi = 0; pi < 2; pi++) {
        fixture f;
        fx_init(&f, 1, pi ? LM_POS_ROPE : LM_POS_NOPE, 55);
        const size_t bytes = (size_t)f.N * D * sizeof(float);
        float *o0 = malloc(bytes);
        (void)loss(&f);
        memcpy(o0, f.out, bytes);
        for (int dd = 0; dd < 2; dd++) {
            float *x0 = malloc(bytes);
            memcpy(x0, f.x, bytes);
            for (int t = docs[dd][0]; t < docs[dd][1]; t++)
                for (int j = 0; j < D; j++)
                    f.x[t * D + j] += 0.5f;
            (void)loss(&f);
            for (int t = 0; t < f.N; t++) {
                const int inside = t >= docs[dd][0] && t < docs[dd][1];
                const int same = memcmp(o0 + t * D, f.out + t * D, D * sizeof(float)) == 0;
                if (inside == same)
                    fprintf(stderr, "doc [%d,%d) perturbed: token %d %s\n", docs[dd][0],
                            docs[dd][1], t, same ? "unchanged" : "changed");
                assert_true(inside != same);
            }
            memcpy(f.x, x0, bytes);
            free(x0);
        }
        free(o0);
        fx_free(&f);
    }
}

/* Each document of the packed batch run alone (B = 1, its own T, positions from 0)
 * gives the packed output rows (TOL_PACK). One context serves all the calls, and a
 * fresh context agrees bit for bit with the reused one. */
#define TOL_PACK 1e-5 /* issue 4 packing bar */
static void test_packed_vs_alone(void **s) {
    (void)s;
    for (int pi = 0; pi < 2; pi++) {
        fixture f;
        fx_init(&f, 1, pi ? LM_POS_ROPE : LM_POS_NOPE, 123);
        (void)loss(&f);
        const int docs[2][2] = {{0, 5}, {5, 37}};
        for (int dd = 0; dd < 2; dd++) {
            const int a = docs[dd][0], T = docs[dd][1] - a;
            lm_attn_layer_batch b1 = {1, T, NULL, 0};
            float *o1 = calloc((size_t)T * D, sizeof(float));
            float *o2 = calloc((size_t)T * D, sizeof(float));
            lm_error err = {0};
            assert_int_equal(lm_attn_layer_forward(&f.cfg, &b1, &f.w, f.x + a * D, o1, f.ctx, &err),
                             LM_OK);
            lm_attn_layer_ctx *fresh = lm_attn_layer_ctx_new();
            assert_int_equal(lm_attn_layer_forward(&f.cfg, &b1, &f.w, f.x + a * D, o2, fresh, &err),
                             LM_OK);
            lm_attn_layer_ctx_free(fresh);
            assert_memory_equal(o1, o2, (size_t)T * D * sizeof(float));
            double *ref = lm_to_f64(f.out + a * D, (int64_t)T * D);
            char label[64];
            snprintf(label, sizeof label, "  doc [%d,%d) alone vs packed", a, a + T);
            assert_true(lm_check_f32(label, o1, ref, (int64_t)T * D, TOL_PACK));
            printf("    bitwise equal: %s\n",
                   memcmp(o1, f.out + a * D, (size_t)T * D * sizeof(float)) ? "no" : "yes");
            free(ref);
            free(o1);
            free(o2);
        }
        fx_free(&f);
    }
}

static void test_threads_deterministic(void **s) {
    (void)s;
    for (int packed = 0; packed < 2; packed++) {
        for (int pi = 0; pi < 2; pi++) {
            const lm_attn_position pos = pi ? LM_POS_ROPE : LM_POS_NOPE;
            fixture a, b;
            fx_init(&a, packed, pos, 77);
            fx_init(&b, packed, pos, 77);
            lm_set_num_threads(1);
            fwd_bwd(&a);
            lm_set_num_threads(2);
            fwd_bwd(&b);
            lm_set_num_threads(0);
            const size_t bytes = (size_t)a.N * D * sizeof(float);
            assert_memory_equal(a.out, b.out, bytes);
            assert_memory_equal(a.dx, b.dx, bytes);
            for (int i = 0; i < NPARAM; i++)
                assert_memory_equal(a.p[i].g, b.p[i].g, (size_t)a.p[i].n * sizeof(float));
            fx_free(&a);
            fx_free(&b);
        }
    }
}

/* forward with the fixture as modified; expects status `want` naming `needle` */
static void expect_fwd_status(fixture *f, lm_status want, const char *needle) {
    lm_error err = {0};
    lm_status st = lm_attn_layer_forward(&f->cfg, &f->batch, &f->w, f->x, f->out, f->ctx, &err);
    if (st != want || !strstr(err.msg, needle))
        fprintf(stderr, "expected status %d naming '%s', got %d: %s\n", (int)want, needle, (int)st,
                err.msg);
    assert_int_equal(st, want);
    assert_non_null(strstr(err.msg, needle));
}

static void expect_invalid_fwd(fixture *f, const char *needle) {
    expect_fwd_status(f, LM_ERR_INVALID, needle);
}

static void test_invalid(void **s) {
    (void)s;
    fixture f;
    fx_init(&f, 1, LM_POS_ROPE, 99);
    lm_error err = {0};
    /* backward before any forward */
    lm_status st =
        lm_attn_layer_backward(&f.cfg, &f.batch, &f.w, f.x, f.R, f.dx, &f.g, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "forward"));
    const size_t bytes = (size_t)f.N * D * sizeof(float);
    lm_poison_f32(f.out, f.N * D);
    float *o0 = malloc(bytes);
    memcpy(o0, f.out, bytes);
    /* missing weight */
    const float *keep = f.w.k_proj;
    f.w.k_proj = NULL;
    expect_invalid_fwd(&f, "k_proj");
    f.w.k_proj = keep;
    /* GQA map */
    f.cfg.Hkv = 3;
    expect_invalid_fwd(&f, "Hkv");
    f.cfg.Hkv = HKV;
    /* RoPE needs an even head dim and a positive finite theta */
    f.cfg.Dh = 7;
    expect_invalid_fwd(&f, "Dh");
    f.cfg.Dh = DH;
    f.cfg.rope_theta = 0.0;
    expect_invalid_fwd(&f, "rope_theta");
    f.cfg.rope_theta = NAN;
    expect_invalid_fwd(&f, "rope_theta");
    f.cfg.rope_theta = 10000.0;
    f.cfg.position = (lm_attn_position)7;
    expect_invalid_fwd(&f, "position");
    f.cfg.position = LM_POS_ROPE;
    /* cu_seqlens: not ending at T, decreasing, with B > 1 */
    f.cu[3] = 36;
    expect_invalid_fwd(&f, "cu_seqlens");
    f.cu[3] = 37;
    f.cu[2] = 4;
    expect_invalid_fwd(&f, "cu_seqlens");
    f.cu[2] = 5;
    f.batch.B = 2;
    expect_invalid_fwd(&f, "cu_seqlens");
    f.batch.B = 1;
    /* non-finite x: a data error (LM_ERR_NONFINITE), unlike a non-finite rope_theta */
    f.x[3] = NAN;
    expect_fwd_status(&f, LM_ERR_NONFINITE, "'x'");
    f.x[3] = 0.25f;
    assert_memory_equal(o0, f.out, bytes);
    /* backward: a missing gradient, a non-finite dout, a mismatched batch */
    (void)loss(&f);
    f.g.o_proj = NULL;
    memset(&err, 0, sizeof err);
    st = lm_attn_layer_backward(&f.cfg, &f.batch, &f.w, f.x, f.R, f.dx, &f.g, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "grads.o_proj"));
    f.g.o_proj = f.p[3].g;
    f.R[5] = INFINITY;
    memset(&err, 0, sizeof err);
    st = lm_attn_layer_backward(&f.cfg, &f.batch, &f.w, f.x, f.R, f.dx, &f.g, f.ctx, &err);
    assert_int_equal(st, LM_ERR_NONFINITE);
    assert_non_null(strstr(err.msg, "dout"));
    f.R[5] = 1.0f;
    lm_attn_layer_batch other = {1, 37, NULL, 0};
    memset(&err, 0, sizeof err);
    st = lm_attn_layer_backward(&f.cfg, &other, &f.w, f.x, f.R, f.dx, &f.g, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "forward"));
    free(o0);
    fx_free(&f);
}

/* ---------------------------------------------------------------- inference */

/* TOL_INFER: the decode op sums in fp64 and in another order than the forward's
 * tiles, and the projections run on other BLAS row blocks, so agreement is to fp32
 * rounding, not bitwise; 1e-5 is the issue-4 bar for fp32 paths (TOL_FWD_F32),
 * applied per row of d values (every position on its own). Measured worst values are
 * printed. */
#define TOL_INFER 1e-5
enum { IB = 2, NDECODE = 64, TSLACK = 3 };

/* A NaN-poisoned cache for IB rows of Tmax positions. */
typedef struct {
    lm_attn_layer_cache kv;
    float *buf;
    int64_t n; /* floats per tensor */
} kvbuf;

static void kv_init(kvbuf *c, int64_t Tmax) {
    c->n = IB * Tmax * CKV;
    c->buf = malloc((size_t)(2 * c->n) * sizeof(float));
    lm_poison_f32(c->buf, 2 * c->n);
    c->kv = (lm_attn_layer_cache){c->buf, c->buf + c->n, Tmax, NULL};
}

/* Run the IB rows of x [IB, L, D] through infer in pieces of len[0..np) tokens at
 * positions from 0, writing out [IB, L, D] (poisoned first: every row must be written). */
static void run_pieces(fixture *f, int L, const float *x, const int *len, int np, float *out,
                       kvbuf *c, lm_attn_layer_ctx *ctx) {
    float *xb = malloc((size_t)IB * L * D * sizeof(float));
    float *ob = malloc((size_t)IB * L * D * sizeof(float));
    lm_poison_f32(out, (int64_t)IB * L * D);
    int t0 = 0;
    for (int i = 0; i < np; i++) {
        const int n = len[i];
        for (int b = 0; b < IB; b++)
            memcpy(xb + (size_t)b * n * D, x + ((size_t)b * L + t0) * D,
                   (size_t)n * D * sizeof(float));
        lm_poison_f32(ob, (int64_t)IB * n * D);
        lm_error err = {0};
        lm_status st = lm_attn_layer_infer(&f->cfg, IB, n, t0, &f->w, xb, ob, &c->kv, ctx, &err);
        if (st != LM_OK)
            fprintf(stderr, "%s\n", err.msg);
        assert_int_equal(st, LM_OK);
        for (int b = 0; b < IB; b++)
            memcpy(out + ((size_t)b * L + t0) * D, ob + (size_t)b * n * D,
                   (size_t)n * D * sizeof(float));
        t0 += n;
    }
    assert_int_equal(t0, L);
    free(xb);
    free(ob);
}

/* Every row of d values of out against ref at tol; returns the worst row rel RMS. */
static double check_rows(const char *label, const float *out, const float *ref, int64_t rows, int d,
                         double tol) {
    double worst = 0.0, worst_abs = 0.0;
    int ok = 1;
    for (int64_t r = 0; r < rows; r++) {
        double *r64 = lm_to_f64(ref + r * d, d);
        lm_cmp c = lm_compare_f32(out + r * d, r64, d, tol);
        free(r64);
        if (!c.pass) {
            fprintf(stderr, "%s: row %lld rel_rms=%.3g max_abs=%.3g FAIL\n", label, (long long)r,
                    c.rel_rms, c.max_abs);
            ok = 0;
        }
        worst = c.rel_rms > worst ? c.rel_rms : worst;
        worst_abs = c.max_abs > worst_abs ? c.max_abs : worst_abs;
    }
    printf("%s: %lld rows, worst row rel_rms=%.3g max_abs=%.3g tol=%g %s\n", label, (long long)rows,
           worst, worst_abs, tol, ok ? "PASS" : "FAIL");
    assert_true(ok);
    return worst;
}

static void test_infer_decode_vs_forward(void **s) {
    (void)s;
    for (int pi = 0; pi < 2; pi++)
        for (int qi = 0; qi < 2; qi++) {
            const lm_attn_position pos = pi ? LM_POS_ROPE : LM_POS_NOPE;
            const int P = qi ? 1 : 37, L = P + NDECODE;
            fixture f;
            fx_init(&f, 0, pos, 200 + (uint64_t)pi);
            const int64_t nx = (int64_t)IB * L * D;
            float *x = malloc((size_t)nx * sizeof(float));
            float *ref = malloc((size_t)nx * sizeof(float));
            float *out = malloc((size_t)nx * sizeof(float));
            fill(x, nx, 300 + (uint64_t)pi, 0, 1);
            lm_attn_layer_batch b = {IB, L, NULL, 0};
            lm_error err = {0};
            assert_int_equal(lm_attn_layer_forward(&f.cfg, &b, &f.w, x, ref, f.ctx, &err), LM_OK);
            int len[1 + NDECODE];
            len[0] = P;
            for (int i = 1; i <= NDECODE; i++)
                len[i] = 1;
            kvbuf c;
            kv_init(&c, L + TSLACK);
            run_pieces(&f, L, x, len, 1 + NDECODE, out, &c, f.ctx);
            char label[96];
            snprintf(label, sizeof label, "  infer %s: prefill %d + %d decode vs forward",
                     pi ? "rope" : "nope", P, NDECODE);
            check_rows(label, out, ref, (int64_t)IB * L, D, TOL_INFER);
            free(c.buf);
            free(x);
            free(ref);
            free(out);
            fx_free(&f);
        }
}

static void test_infer_split_prefill(void **s) {
    (void)s;
    const int cases[3][2] = {{1, 36}, {21, 19}, {5, 2}};
    for (int pi = 0; pi < 2; pi++)
        for (int ci = 0; ci < 3; ci++) {
            const lm_attn_position pos = pi ? LM_POS_ROPE : LM_POS_NOPE;
            const int P1 = cases[ci][0], P2 = cases[ci][1], L = P1 + P2;
            fixture f;
            fx_init(&f, 0, pos, 400 + (uint64_t)pi);
            const int64_t nx = (int64_t)IB * L * D;
            float *x = malloc((size_t)nx * sizeof(float));
            float *o1 = malloc((size_t)nx * sizeof(float));
            float *o2 = malloc((size_t)nx * sizeof(float));
            fill(x, nx, 500 + (uint64_t)ci, 0, 1);
            kvbuf c1, c2;
            kv_init(&c1, L + TSLACK);
            kv_init(&c2, L + TSLACK);
            const int one[1] = {L}, two[2] = {P1, P2};
            run_pieces(&f, L, x, one, 1, o1, &c1, f.ctx);
            run_pieces(&f, L, x, two, 2, o2, &c2, f.ctx);
            char label[96];
            snprintf(label, sizeof label, "  infer %s: prefill %d+%d vs %d, out",
                     pi ? "rope" : "nope", P1, P2, L);
            check_rows(label, o2, o1, (int64_t)IB * L, D, TOL_INFER);
            /* cache rows: positions < L written and equal, positions >= L still NaN */
            const int64_t Tmax = L + TSLACK;
            for (int kvi = 0; kvi < 2; kvi++)
                for (int b = 0; b < IB; b++) {
                    const float *a = c2.buf + kvi * c2.n + (size_t)b * Tmax * CKV;
                    const float *r = c1.buf + kvi * c1.n + (size_t)b * Tmax * CKV;
                    double *r64 = lm_to_f64(r, (int64_t)L * CKV);
                    snprintf(label, sizeof label, "    %s_cache row %d, positions 0..%d",
                             kvi ? "v" : "k", b, L - 1);
                    assert_true(lm_check_f32(label, a, r64, (int64_t)L * CKV, TOL_INFER));
                    free(r64);
                    for (int64_t i = (int64_t)L * CKV; i < Tmax * CKV; i++)
                        assert_true(isnan(a[i]) && isnan(r[i]));
                }
            free(c1.buf);
            free(c2.buf);
            free(x);
            free(o1);
            free(o2);
            fx_free(&f);
        }
}

static void test_infer_threads_deterministic(void **s) {
    (void)s;
    for (int pi = 0; pi < 2; pi++) {
        fixture f;
        fx_init(&f, 0, pi ? LM_POS_ROPE : LM_POS_NOPE, 600);
        const int L = 45, len[5] = {37, 1, 5, 1, 1};
        const int64_t nx = (int64_t)IB * L * D;
        float *x = malloc((size_t)nx * sizeof(float));
        float *o[2] = {malloc((size_t)nx * sizeof(float)), malloc((size_t)nx * sizeof(float))};
        fill(x, nx, 601, 0, 1);
        kvbuf c[2];
        for (int r = 0; r < 2; r++) {
            kv_init(&c[r], L);
            lm_attn_layer_ctx *ctx = lm_attn_layer_ctx_new();
            lm_set_num_threads(r + 1);
            run_pieces(&f, L, x, len, 5, o[r], &c[r], ctx);
            lm_attn_layer_ctx_free(ctx);
        }
        lm_set_num_threads(0);
        assert_memory_equal(o[0], o[1], (size_t)nx * sizeof(float));
        assert_memory_equal(c[0].buf, c[1].buf, (size_t)(2 * c[0].n) * sizeof(float));
        for (int r = 0; r < 2; r++) {
            free(o[r]);
            free(c[r].buf);
        }
        free(x);
        fx_free(&f);
    }
}

/* infer with the given arguments; expects status `want` naming `needle` */
static void expect_infer_status(fixture *f, lm_status want, int B, int T, int64_t pos,
                                const lm_attn_layer_weights *w, const float *x, float *out,
                                lm_attn_layer_cache *kv, const char *needle) {
    lm_error err = {0};
    lm_status rc = lm_attn_layer_infer(&f->cfg, B, T, pos, w, x, out, kv, f->ctx, &err);
    if (rc != want || !strstr(err.msg, needle))
        fprintf(stderr, "expected status %d naming '%s', got %d: %s\n", (int)want, needle, (int)rc,
                err.msg);
    assert_int_equal(rc, want);
    assert_non_null(strstr(err.msg, needle));
}

static void expect_invalid_infer(fixture *f, int B, int T, int64_t pos,
                                 const lm_attn_layer_weights *w, const float *x, float *out,
                                 lm_attn_layer_cache *kv, const char *needle) {
    expect_infer_status(f, LM_ERR_INVALID, B, T, pos, w, x, out, kv, needle);
}

static void test_infer_invalid(void **s) {
    (void)s;
    fixture f;
    fx_init(&f, 0, LM_POS_ROPE, 700);
    const int T = 3;
    const int64_t Tmax = 10, nx = (int64_t)IB * T * D;
    float *x = malloc((size_t)nx * sizeof(float));
    float *out = malloc((size_t)nx * sizeof(float));
    float *o0 = malloc((size_t)nx * sizeof(float));
    fill(x, nx, 701, 0, 1);
    lm_poison_f32(out, nx);
    memcpy(o0, out, (size_t)nx * sizeof(float));
    kvbuf c;
    kv_init(&c, Tmax);
    fill(c.buf, 2 * c.n, 702, 0, 1); /* a cache in use */
    float *c0 = malloc((size_t)(2 * c.n) * sizeof(float));
    memcpy(c0, c.buf, (size_t)(2 * c.n) * sizeof(float));

    expect_invalid_infer(&f, IB, T, 8, &f.w, x, out, &c.kv, "Tmax = 10"); /* 8 + 3 > 10 */
    expect_invalid_infer(&f, IB, T, -1, &f.w, x, out, &c.kv, "pos = -1");
    expect_invalid_infer(&f, IB, T, 0, &f.w, x, out, NULL, "'kv'");
    lm_attn_layer_cache bad = c.kv;
    bad.k_cache = NULL;
    expect_invalid_infer(&f, IB, T, 0, &f.w, x, out, &bad, "kv.k_cache");
    bad = c.kv;
    bad.v_cache = NULL;
    expect_invalid_infer(&f, IB, T, 0, &f.w, x, out, &bad, "kv.v_cache");
    bad = c.kv;
    bad.Tmax = 0;
    expect_invalid_infer(&f, IB, T, 0, &f.w, x, out, &bad, "kv.Tmax = 0");
    expect_invalid_infer(&f, IB, 0, 0, &f.w, x, out, &c.kv, "T = 0");
    expect_invalid_infer(&f, 0, T, 0, &f.w, x, out, &c.kv, "B = 0");
    expect_invalid_infer(&f, IB, T, 0, &f.w, x, NULL, &c.kv, "'out'");
    lm_attn_layer_weights w = f.w;
    w.v_proj = NULL;
    expect_invalid_infer(&f, IB, T, 0, &w, x, out, &c.kv, "v_proj");
    x[4] = NAN;
    expect_infer_status(&f, LM_ERR_NONFINITE, IB, T, 2, &f.w, x, out, &c.kv, "'x'");
    x[4] = 0.5f;
    lm_error err = {0};
    assert_int_equal(lm_attn_layer_infer(&f.cfg, IB, T, 1, &f.w, x, out, &c.kv, NULL, &err),
                     LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'ctx'"));
    assert_memory_equal(o0, out, (size_t)nx * sizeof(float));
    assert_memory_equal(c0, c.buf, (size_t)(2 * c.n) * sizeof(float));
    /* the last positions fit exactly */
    assert_int_equal(lm_attn_layer_infer(&f.cfg, IB, T, Tmax - T, &f.w, x, out, &c.kv, f.ctx, &err),
                     LM_OK);

    /* a backward after infer needs a new forward */
    lm_attn_layer_batch b = {IB, T, NULL, 0};
    float *R = malloc((size_t)nx * sizeof(float));
    fill(R, nx, 703, 0, 1);
    assert_int_equal(lm_attn_layer_forward(&f.cfg, &b, &f.w, x, out, f.ctx, &err), LM_OK);
    assert_int_equal(lm_attn_layer_infer(&f.cfg, IB, 1, 4, &f.w, x, out, &c.kv, f.ctx, &err),
                     LM_OK);
    memset(&err, 0, sizeof err);
    assert_int_equal(lm_attn_layer_backward(&f.cfg, &b, &f.w, x, R, NULL, &f.g, f.ctx, &err),
                     LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "forward"));
    assert_int_equal(lm_attn_layer_forward(&f.cfg, &b, &f.w, x, out, f.ctx, &err), LM_OK);
    assert_int_equal(lm_attn_layer_backward(&f.cfg, &b, &f.w, x, R, NULL, &f.g, f.ctx, &err),
                     LM_OK);
    free(R);
    free(c0);
    free(c.buf);
    free(x);
    free(out);
    free(o0);
    fx_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fd_rope),
        cmocka_unit_test(test_fd_nope),
        cmocka_unit_test(test_packed_independence),
        cmocka_unit_test(test_packed_vs_alone),
        cmocka_unit_test(test_threads_deterministic),
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_infer_decode_vs_forward),
        cmocka_unit_test(test_infer_split_prefill),
        cmocka_unit_test(test_infer_threads_deterministic),
        cmocka_unit_test(test_infer_invalid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
