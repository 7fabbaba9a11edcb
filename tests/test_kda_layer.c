/* The KDA layer (include/linmoe/kda_layer.h), whole-layer checks:
 *
 *  - gradients: central finite differences of the whole fp32 layer, loss
 *    L = sum(out * R) (R fixed random, accumulated in fp64), step FD_STEP = 1e-3
 *    (the difference divided by the fp32-rounded perturbation actually applied), for
 *    up to FD_SAMPLES random entries of every weight and of x (all entries of the
 *    smaller tensors: A_log, o_norm); the sample of analytic gradients vs the sample
 *    of differences at relative RMS <= TOL_LAYER_FD. Shape d = 16, H = 2, Dh = 8,
 *    W = 4, chunk 16 (T = 37 crosses chunks and sub-tiles), as B = 2 sequences of
 *    T = 37 and as one packed batch cu_seqlens = [0, 5, 5, 37] (an empty document);
 *    both gates (BOUNDED with lower_bound -5, SOFTPLUS).
 *    Why 5e-3: the layer is fp32 (no fp64 build), so each difference carries the
 *    fp32 rounding of the forward: |L| ~ 10, eps_32 ~ 6e-8 per output, summed over
 *    ~1e3 outputs gives ~1e-6 absolute noise in L, / (2 * 1e-3) ~ 1e-3 absolute
 *    noise per FD gradient, against gradients of O(0.1..10); truncation O(h^2) ~ 1e-6.
 *    Measured rel RMS is printed per tensor.
 *  - packing: perturbing one document's x leaves every other document's output bit
 *    for bit unchanged (and changes its own); each document run alone gives its rows
 *    of the packed output (TOL_PACK), on a reused context and a fresh one alike.
 *  - determinism: out, dx and every gradient bit-identical on 1 and 2 threads.
 *  - invalid input: a missing weight, a bad lower_bound and a backward without a
 *    forward give LM_ERR_INVALID with the name, leaving `out` untouched.
 *
 * Inference (lm_kda_layer_infer), B = 2 sequences, both gates, two shapes: the one
 * above (d = 16, H = 2, Dh = 8: lm_kda_forward takes the recurrent path with the
 * softplus gate) and a wide one (d = 24, H = 2, Dh = 72: K*V > 64*64, so the chunked
 * path for both gates), W = 4, chunk 16:
 *  - decode: a prefill of P tokens then 64 one-token steps equal, row by row (every
 *    (sequence, position)), one lm_kda_layer_forward over the P + 64 tokens at
 *    TOL_INFER; P = 37 (crosses two chunks, not a multiple) and P = 1 (decode from
 *    the zero state).
 *  - split prefill: P1 then P2 tokens (P2 > 1) equal one prefill of P1 + P2 in the
 *    outputs and in every final state (conv q/k/v, recurrent) at TOL_INFER, for
 *    (P1, P2) = (1, 36), (2, 35) (P1 < W-1: the conv state keeps its zeros),
 *    (21, 19) (P1 not a multiple of the chunk), (16, 21) (exactly one chunk).
 *  - determinism: outputs and states bit-identical on 1 and 2 threads.
 *  - invalid input: a missing state, state.state or conv state, B or T < 1, a
 *    missing weight, non-finite x or conv state give LM_ERR_INVALID with the name,
 *    leaving out and the states untouched (conv_q and conv_k too when conv_v is bad); W = 1 needs no conv states; a backward after infer needs a
 *    new forward (and works after one).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "linmoe/core.h"
#include "linmoe/kda_layer.h"

#define FD_STEP 1e-3
#define FD_SAMPLES 20
#define TOL_LAYER_FD 5e-3

enum { D = 16, NH = 2, DH = 8, CW = 4, CC = NH * DH, NPARAM = 15 };

typedef struct {
    const char *name;
    int64_t n;
    float *w; /* weight */
    float *g; /* gradient */
} param;

typedef struct {
    lm_kda_layer_config cfg;
    lm_kda_layer_batch batch;
    int64_t cu[4];
    int N;
    param p[NPARAM];
    lm_kda_layer_weights w;
    lm_kda_layer_grads g;
    float *x, *R, *out, *dx;
    lm_kda_layer_ctx *ctx;
} fixture;

static void fill(float *x, int64_t n, uint64_t seed, double mean, double std) {
    double *t = calloc((size_t)n, sizeof(double));
    lm_fill_normal(t, n, seed, mean, std);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)t[i];
    free(t);
}

static void fx_init(fixture *f, int packed, lm_gate_mode gate, uint64_t seed) {
    memset(f, 0, sizeof(*f));
    lm_kda_layer_config_default(&f->cfg, D, NH, DH);
    f->cfg.gate = gate;
    f->cfg.lower_bound = -5.0f;
    f->cfg.chunk_size = 16;
    if (packed) {
        f->cu[0] = 0, f->cu[1] = 5, f->cu[2] = 5, f->cu[3] = 37;
        f->batch = (lm_kda_layer_batch){1, 37, f->cu, 4};
    } else {
        f->batch = (lm_kda_layer_batch){2, 37, NULL, 0};
    }
    f->N = f->batch.B * f->batch.T;
    const double sd = 1.0 / sqrt((double)D), sh = 1.0 / sqrt((double)DH),
                 sc = 1.0 / sqrt((double)CC);
    const struct {
        const char *name;
        int64_t n;
        double mean, std;
    } spec[NPARAM] = {
        {"q_proj", CC * D, 0, sd},     {"k_proj", CC * D, 0, sd},  {"v_proj", CC * D, 0, sd},
        {"q_conv1d", CC * CW, 0, 0.5}, {"k_conv1d", CC * CW, 0, 0.5}, {"v_conv1d", CC * CW, 0, 0.5},
        {"f_a_proj", DH * D, 0, sd},   {"f_b_proj", CC * DH, 0, sh}, {"A_log", NH, 0.0, 0.3},
        {"dt_bias", CC, 0, 0.5},       {"b_proj", NH * D, 0, sd},  {"g_a_proj", DH * D, 0, sd},
        {"g_b_proj", CC * DH, 0, sh},  {"o_norm", DH, 1.0, 0.1},   {"o_proj", D * CC, 0, sc}};
    for (int i = 0; i < NPARAM; i++) {
        f->p[i].name = spec[i].name;
        f->p[i].n = spec[i].n;
        f->p[i].w = calloc((size_t)spec[i].n, sizeof(float));
        f->p[i].g = calloc((size_t)spec[i].n, sizeof(float));
        fill(f->p[i].w, spec[i].n, seed + 100 + (uint64_t)i, spec[i].mean, spec[i].std);
    }
    float **wp[NPARAM] = {(float **)&f->w.q_proj,   (float **)&f->w.k_proj,   (float **)&f->w.v_proj,
                          (float **)&f->w.q_conv1d, (float **)&f->w.k_conv1d, (float **)&f->w.v_conv1d,
                          (float **)&f->w.f_a_proj, (float **)&f->w.f_b_proj, (float **)&f->w.A_log,
                          (float **)&f->w.dt_bias,  (float **)&f->w.b_proj,   (float **)&f->w.g_a_proj,
                          (float **)&f->w.g_b_proj, (float **)&f->w.o_norm,   (float **)&f->w.o_proj};
    float **gp[NPARAM] = {&f->g.q_proj,   &f->g.k_proj,   &f->g.v_proj,  &f->g.q_conv1d,
                          &f->g.k_conv1d, &f->g.v_conv1d, &f->g.f_a_proj, &f->g.f_b_proj,
                          &f->g.A_log,    &f->g.dt_bias,  &f->g.b_proj,   &f->g.g_a_proj,
                          &f->g.g_b_proj, &f->g.o_norm,   &f->g.o_proj};
    for (int i = 0; i < NPARAM; i++) {
        *wp[i] = f->p[i].w;
        *gp[i] = f->p[i].g;
    }
    const int64_t nx = (int64_t)f->N * D;
    f->x = calloc((size_t)nx, sizeof(float));
    f->R = calloc((size_t)nx, sizeof(float));
    f->out = calloc((size_t)nx, sizeof(float));
    f->dx = calloc((size_t)nx, sizeof(float));
    fill(f->x, nx, seed + 1, 0, 1);
    fill(f->R, nx, seed + 2, 0, 1);
    f->ctx = lm_kda_layer_ctx_new();
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
    lm_kda_layer_ctx_free(f->ctx);
}

static double loss(fixture *f) {
    lm_error err = {0};
    lm_status st = lm_kda_layer_forward(&f->cfg, &f->batch, &f->w, f->x, f->out, f->ctx, &err);
    if (st != LM_OK) fprintf(stderr, "%s\n", err.msg);
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
        lm_kda_layer_backward(&f->cfg, &f->batch, &f->w, f->x, f->R, f->dx, &f->g, f->ctx, &err);
    if (st != LM_OK) fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

/* FD check of one tensor t (n entries, gradient gr) at up to FD_SAMPLES entries. */
static double loss_cb(void *ctx) { return loss((fixture *)ctx); }
static int fd_tensor(fixture *f, const char *name, float *t, const float *gr, int64_t n,
                     uint64_t seed) {
    return lm_fd_check_sampled(name, t, gr, n, FD_SAMPLES, FD_STEP, seed, loss_cb, f, TOL_LAYER_FD);
}

static void run_fd(int packed, lm_gate_mode gate) {
    fixture f;
    fx_init(&f, packed, gate, packed * 10 + (uint64_t)gate);
    printf("FD: %s, gate %s\n", packed ? "packed [0,5,5,37]" : "B=2 T=37",
           gate == LM_GATE_BOUNDED ? "bounded" : "softplus");
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

static void test_fd_bounded(void **s) {
    (void)s;
    run_fd(0, LM_GATE_BOUNDED);
    run_fd(1, LM_GATE_BOUNDED);
}

static void test_fd_softplus(void **s) {
    (void)s;
    run_fd(0, LM_GATE_SOFTPLUS);
    run_fd(1, LM_GATE_SOFTPLUS);
}

/* Perturb the x of tokens [a, e) of the packed batch; outputs outside are unchanged. */
static void test_packed_independence(void **s) {
    (void)s;
    const int docs[2][2] = {{0, 5}, {5, 37}};
    for (int gi = 0; gi < 2; gi++) {
        fixture f;
        fx_init(&f, 1, gi ? LM_GATE_BOUNDED : LM_GATE_SOFTPLUS, 55);
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

/* Each document of the packed batch run alone (B = 1, its own T) gives the packed
 * output rows (TOL_PACK: the same math per document, but not bit for bit; where the
 * last-bit differences come from, BLAS row blocking or the ops, is not isolated). One context serves all the calls (it grows and shrinks
 * its use without reallocating past the largest), and a fresh context agrees bit for
 * bit with the reused one. */
#define TOL_PACK 1e-5 /* issue 4 packing bar; measured <= 4.5e-7 (not bitwise) */
static void test_packed_vs_alone(void **s) {
    (void)s;
    for (int gi = 0; gi < 2; gi++) {
        fixture f;
        fx_init(&f, 1, gi ? LM_GATE_BOUNDED : LM_GATE_SOFTPLUS, 123);
        (void)loss(&f);
        const int docs[2][2] = {{0, 5}, {5, 37}};
        for (int dd = 0; dd < 2; dd++) {
            const int a = docs[dd][0], T = docs[dd][1] - a;
            lm_kda_layer_batch b1 = {1, T, NULL, 0};
            float *o1 = calloc((size_t)T * D, sizeof(float));
            float *o2 = calloc((size_t)T * D, sizeof(float));
            lm_error err = {0};
            assert_int_equal(lm_kda_layer_forward(&f.cfg, &b1, &f.w, f.x + a * D, o1, f.ctx, &err),
                             LM_OK);
            lm_kda_layer_ctx *fresh = lm_kda_layer_ctx_new();
            assert_int_equal(lm_kda_layer_forward(&f.cfg, &b1, &f.w, f.x + a * D, o2, fresh, &err),
                             LM_OK);
            lm_kda_layer_ctx_free(fresh);
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
        fixture a, b;
        fx_init(&a, packed, LM_GATE_BOUNDED, 77);
        fx_init(&b, packed, LM_GATE_BOUNDED, 77);
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

static void test_invalid(void **s) {
    (void)s;
    fixture f;
    fx_init(&f, 1, LM_GATE_BOUNDED, 99);
    lm_error err = {0};
    /* backward before any forward */
    lm_status st =
        lm_kda_layer_backward(&f.cfg, &f.batch, &f.w, f.x, f.R, f.dx, &f.g, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "forward"));
    const size_t bytes = (size_t)f.N * D * sizeof(float);
    lm_poison_f32(f.out, f.N * D);
    float *o0 = malloc(bytes);
    memcpy(o0, f.out, bytes);
    /* missing weight */
    const float *keep = f.w.g_b_proj;
    f.w.g_b_proj = NULL;
    memset(&err, 0, sizeof err);
    st = lm_kda_layer_forward(&f.cfg, &f.batch, &f.w, f.x, f.out, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "g_b_proj"));
    f.w.g_b_proj = keep;
    /* lower_bound */
    f.cfg.lower_bound = -6.0f;
    memset(&err, 0, sizeof err);
    st = lm_kda_layer_forward(&f.cfg, &f.batch, &f.w, f.x, f.out, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "lower_bound"));
    f.cfg.lower_bound = -5.0f;
    /* non-finite x: a data error (LM_ERR_NONFINITE), not bad input */
    f.x[3] = NAN;
    memset(&err, 0, sizeof err);
    st = lm_kda_layer_forward(&f.cfg, &f.batch, &f.w, f.x, f.out, f.ctx, &err);
    assert_int_equal(st, LM_ERR_NONFINITE);
    assert_non_null(strstr(err.msg, "'x'"));
    assert_memory_equal(o0, f.out, bytes);
    free(o0);
    fx_free(&f);
}

/* ---------------------------------------------------------------- inference */

/* TOL_INFER: the pieces run other op paths than the one forward (recurrent decode vs
 * chunked, BLAS on other row blocks), so agreement is to fp32 rounding, not bitwise;
 * 1e-5 is the issue-4 bar for fp32 paths (TOL_FWD_F32). It is applied per row of
 * d values (every position on its own), which reads higher than over the tensor:
 * measured worst row 6.0e-6 (Dh = 8, bounded; 6.3e-6 over 16 seeds, both gates, where
 * the source of the last bits, chunked op or BLAS blocking, is not isolated); outputs
 * are poisoned before each call. */
#define TOL_INFER 1e-5
enum { IB = 2, NDECODE = 64 };

/* Weights of one layer with runtime dims (same distributions as fx_init). */
typedef struct {
    lm_kda_layer_config cfg;
    float *p[NPARAM];
    lm_kda_layer_weights w;
} ifx;

static void ifx_init(ifx *f, int d, int H, int Dh, lm_gate_mode gate, uint64_t seed) {
    memset(f, 0, sizeof(*f));
    lm_kda_layer_config_default(&f->cfg, d, H, Dh);
    f->cfg.gate = gate;
    f->cfg.lower_bound = -5.0f;
    f->cfg.chunk_size = 16;
    const int64_t C = (int64_t)H * Dh, W = f->cfg.W;
    const double sd = 1.0 / sqrt((double)d), sh = 1.0 / sqrt((double)Dh),
                 sc = 1.0 / sqrt((double)C);
    const struct {
        int64_t n;
        double mean, std;
    } spec[NPARAM] = {{C * d, 0, sd},  {C * d, 0, sd},  {C * d, 0, sd},  {C * W, 0, 0.5},
                      {C * W, 0, 0.5}, {C * W, 0, 0.5}, {Dh * d, 0, sd}, {C * Dh, 0, sh},
                      {H, 0.0, 0.3},   {C, 0, 0.5},     {H * d, 0, sd},  {Dh * d, 0, sd},
                      {C * Dh, 0, sh}, {Dh, 1.0, 0.1},  {d * C, 0, sc}};
    for (int i = 0; i < NPARAM; i++) {
        f->p[i] = calloc((size_t)spec[i].n, sizeof(float));
        fill(f->p[i], spec[i].n, seed + 100 + (uint64_t)i, spec[i].mean, spec[i].std);
    }
    f->w = (lm_kda_layer_weights){f->p[0],  f->p[1],  f->p[2],  f->p[3],  f->p[4],
                                  f->p[5],  f->p[6],  f->p[7],  f->p[8],  f->p[9],
                                  f->p[10], f->p[11], f->p[12], f->p[13], f->p[14]};
}

static void ifx_free(ifx *f) {
    for (int i = 0; i < NPARAM; i++)
        free(f->p[i]);
}

/* Zeroed inference state for IB sequences, in one block. */
typedef struct {
    lm_kda_layer_state s;
    float *buf;
    int64_t nconv, nstate, n; /* floats per conv state, in the recurrent state, in all */
} kstate;

static void ks_init(kstate *k, const lm_kda_layer_config *c) {
    const int64_t C = (int64_t)c->H * c->Dh;
    k->nconv = IB * C * (c->W - 1);
    k->nstate = (int64_t)IB * c->H * c->Dh * c->Dh;
    k->n = 3 * k->nconv + k->nstate;
    k->buf = calloc((size_t)k->n, sizeof(float));
    k->s = (lm_kda_layer_state){k->buf, k->buf + k->nconv, k->buf + 2 * k->nconv,
                                k->buf + 3 * k->nconv};
}

/* Run the IB sequences of x [IB, L, d] through infer in pieces of len[0..np) tokens
 * from the state k, writing out [IB, L, d] (poisoned first: every row must be written). */
static void run_pieces(const ifx *f, int L, const float *x, const int *len, int np, float *out,
                       kstate *k, lm_kda_layer_ctx *ctx) {
    const int d = f->cfg.d;
    float *xb = malloc((size_t)IB * L * d * sizeof(float));
    float *ob = malloc((size_t)IB * L * d * sizeof(float));
    lm_poison_f32(out, (int64_t)IB * L * d);
    int t0 = 0;
    for (int i = 0; i < np; i++) {
        const int n = len[i];
        for (int b = 0; b < IB; b++)
            memcpy(xb + (size_t)b * n * d, x + ((size_t)b * L + t0) * d,
                   (size_t)n * d * sizeof(float));
        lm_poison_f32(ob, (int64_t)IB * n * d);
        lm_error err = {0};
        lm_status st = lm_kda_layer_infer(&f->cfg, IB, n, &f->w, xb, ob, &k->s, ctx, &err);
        if (st != LM_OK)
            fprintf(stderr, "%s\n", err.msg);
        assert_int_equal(st, LM_OK);
        for (int b = 0; b < IB; b++)
            memcpy(out + ((size_t)b * L + t0) * d, ob + (size_t)b * n * d,
                   (size_t)n * d * sizeof(float));
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

static const int ISHAPE[2][3] = {{D, NH, DH}, {24, 2, 72}}; /* d, H, Dh */

static void test_infer_decode_vs_forward(void **s) {
    (void)s;
    for (int sh = 0; sh < 2; sh++)
        for (int gi = 0; gi < 2; gi++)
            for (int pi = 0; pi < 2; pi++) {
                const lm_gate_mode gate = gi ? LM_GATE_BOUNDED : LM_GATE_SOFTPLUS;
                const int P = pi ? 1 : 37, L = P + NDECODE, d = ISHAPE[sh][0];
                ifx f;
                ifx_init(&f, d, ISHAPE[sh][1], ISHAPE[sh][2], gate, 200 + (uint64_t)(sh * 4 + gi));
                const int64_t nx = (int64_t)IB * L * d;
                float *x = malloc((size_t)nx * sizeof(float));
                float *ref = malloc((size_t)nx * sizeof(float));
                float *out = malloc((size_t)nx * sizeof(float));
                fill(x, nx, 300 + (uint64_t)(sh * 4 + gi), 0, 1);
                lm_kda_layer_ctx *ctx = lm_kda_layer_ctx_new();
                lm_kda_layer_batch b = {IB, L, NULL, 0};
                lm_error err = {0};
                assert_int_equal(lm_kda_layer_forward(&f.cfg, &b, &f.w, x, ref, ctx, &err), LM_OK);
                int len[1 + NDECODE];
                len[0] = P;
                for (int i = 1; i <= NDECODE; i++)
                    len[i] = 1;
                kstate k;
                ks_init(&k, &f.cfg);
                run_pieces(&f, L, x, len, 1 + NDECODE, out, &k, ctx);
                char label[96];
                snprintf(label, sizeof label, "  infer Dh=%d %s: prefill %d + %d decode vs forward",
                         ISHAPE[sh][2], gi ? "bounded" : "softplus", P, NDECODE);
                check_rows(label, out, ref, (int64_t)IB * L, d, TOL_INFER);
                free(k.buf);
                free(x);
                free(ref);
                free(out);
                lm_kda_layer_ctx_free(ctx);
                ifx_free(&f);
            }
}

static void test_infer_split_prefill(void **s) {
    (void)s;
    const int cases[4][2] = {{1, 36}, {2, 35}, {21, 19}, {16, 21}};
    for (int sh = 0; sh < 2; sh++)
        for (int gi = 0; gi < 2; gi++)
            for (int ci = 0; ci < 4; ci++) {
                const lm_gate_mode gate = gi ? LM_GATE_BOUNDED : LM_GATE_SOFTPLUS;
                const int P1 = cases[ci][0], P2 = cases[ci][1], L = P1 + P2, d = ISHAPE[sh][0];
                ifx f;
                ifx_init(&f, d, ISHAPE[sh][1], ISHAPE[sh][2], gate, 400 + (uint64_t)(sh * 4 + gi));
                const int64_t nx = (int64_t)IB * L * d;
                float *x = malloc((size_t)nx * sizeof(float));
                float *o1 = malloc((size_t)nx * sizeof(float));
                float *o2 = malloc((size_t)nx * sizeof(float));
                fill(x, nx, 500 + (uint64_t)ci, 0, 1);
                lm_kda_layer_ctx *ctx = lm_kda_layer_ctx_new();
                kstate k1, k2;
                ks_init(&k1, &f.cfg);
                ks_init(&k2, &f.cfg);
                const int one[1] = {L}, two[2] = {P1, P2};
                run_pieces(&f, L, x, one, 1, o1, &k1, ctx);
                run_pieces(&f, L, x, two, 2, o2, &k2, ctx);
                char label[96];
                snprintf(label, sizeof label, "  infer Dh=%d %s: prefill %d+%d vs %d, out",
                         ISHAPE[sh][2], gi ? "bounded" : "softplus", P1, P2, L);
                check_rows(label, o2, o1, (int64_t)IB * L, d, TOL_INFER);
                const char *names[4] = {"conv_q", "conv_k", "conv_v", "state"};
                const float *a[4] = {k2.s.conv_q, k2.s.conv_k, k2.s.conv_v, k2.s.state};
                const float *r[4] = {k1.s.conv_q, k1.s.conv_k, k1.s.conv_v, k1.s.state};
                for (int i = 0; i < 4; i++) {
                    const int64_t n = i < 3 ? k1.nconv : k1.nstate;
                    double *r64 = lm_to_f64(r[i], n);
                    snprintf(label, sizeof label, "    final %s", names[i]);
                    assert_true(lm_check_f32(label, a[i], r64, n, TOL_INFER));
                    free(r64);
                }
                free(k1.buf);
                free(k2.buf);
                free(x);
                free(o1);
                free(o2);
                lm_kda_layer_ctx_free(ctx);
                ifx_free(&f);
            }
}

static void test_infer_threads_deterministic(void **s) {
    (void)s;
    for (int gi = 0; gi < 2; gi++) {
        ifx f;
        ifx_init(&f, 24, 2, 72, gi ? LM_GATE_BOUNDED : LM_GATE_SOFTPLUS, 600);
        const int L = 45, d = f.cfg.d, len[5] = {37, 1, 5, 1, 1};
        const int64_t nx = (int64_t)IB * L * d;
        float *x = malloc((size_t)nx * sizeof(float));
        float *o[2] = {malloc((size_t)nx * sizeof(float)), malloc((size_t)nx * sizeof(float))};
        fill(x, nx, 601, 0, 1);
        kstate k[2];
        for (int r = 0; r < 2; r++) {
            ks_init(&k[r], &f.cfg);
            lm_kda_layer_ctx *ctx = lm_kda_layer_ctx_new();
            lm_set_num_threads(r + 1);
            run_pieces(&f, L, x, len, 5, o[r], &k[r], ctx);
            lm_kda_layer_ctx_free(ctx);
        }
        lm_set_num_threads(0);
        assert_memory_equal(o[0], o[1], (size_t)nx * sizeof(float));
        assert_memory_equal(k[0].buf, k[1].buf, (size_t)k[0].n * sizeof(float));
        for (int r = 0; r < 2; r++) {
            free(o[r]);
            free(k[r].buf);
        }
        free(x);
        ifx_free(&f);
    }
}

/* infer with the given arguments; expects status `want` naming `needle` */
static void expect_infer_status(const ifx *f, lm_status want, int B, int T,
                                const lm_kda_layer_weights *w, const float *x, float *out,
                                lm_kda_layer_state *st, lm_kda_layer_ctx *ctx, const char *needle) {
    lm_error err = {0};
    lm_status rc = lm_kda_layer_infer(&f->cfg, B, T, w, x, out, st, ctx, &err);
    if (rc != want || !strstr(err.msg, needle))
        fprintf(stderr, "expected status %d naming '%s', got %d: %s\n", (int)want, needle, (int)rc,
                err.msg);
    assert_int_equal(rc, want);
    assert_non_null(strstr(err.msg, needle));
}

static void expect_invalid_infer(const ifx *f, int B, int T, const lm_kda_layer_weights *w,
                                 const float *x, float *out, lm_kda_layer_state *st,
                                 lm_kda_layer_ctx *ctx, const char *needle) {
    expect_infer_status(f, LM_ERR_INVALID, B, T, w, x, out, st, ctx, needle);
}

static void test_infer_invalid(void **s) {
    (void)s;
    ifx f;
    ifx_init(&f, D, NH, DH, LM_GATE_BOUNDED, 700);
    const int T = 5;
    const int64_t nx = (int64_t)IB * T * D;
    float *x = malloc((size_t)nx * sizeof(float));
    float *out = malloc((size_t)nx * sizeof(float));
    float *o0 = malloc((size_t)nx * sizeof(float));
    fill(x, nx, 701, 0, 1);
    lm_poison_f32(out, nx);
    memcpy(o0, out, (size_t)nx * sizeof(float));
    kstate k;
    ks_init(&k, &f.cfg);
    fill(k.buf, k.n, 702, 0, 0.5); /* a mid-sequence state */
    float *k0 = malloc((size_t)k.n * sizeof(float));
    memcpy(k0, k.buf, (size_t)k.n * sizeof(float));
    lm_kda_layer_ctx *ctx = lm_kda_layer_ctx_new();

    expect_invalid_infer(&f, IB, T, &f.w, x, out, NULL, ctx, "'s'");
    lm_kda_layer_state bad = k.s;
    bad.state = NULL;
    expect_invalid_infer(&f, IB, T, &f.w, x, out, &bad, ctx, "state.state");
    bad = k.s;
    bad.conv_k = NULL;
    expect_invalid_infer(&f, IB, T, &f.w, x, out, &bad, ctx, "state.conv_k");
    expect_invalid_infer(&f, IB, 0, &f.w, x, out, &k.s, ctx, "T = 0");
    expect_invalid_infer(&f, 0, T, &f.w, x, out, &k.s, ctx, "B = 0");
    expect_invalid_infer(&f, IB, T, &f.w, x, NULL, &k.s, ctx, "'out'");
    expect_invalid_infer(&f, IB, T, &f.w, x, out, &k.s, NULL, "'ctx'");
    lm_kda_layer_weights w = f.w;
    w.o_norm = NULL;
    expect_invalid_infer(&f, IB, T, &w, x, out, &k.s, ctx, "o_norm");
    x[7] = INFINITY;
    expect_infer_status(&f, LM_ERR_NONFINITE, IB, T, &f.w, x, out, &k.s, ctx, "'x'");
    x[7] = 0.5f;
    const float keep = k.s.conv_v[3];
    k.s.conv_v[3] = NAN;
    expect_infer_status(&f, LM_ERR_NONFINITE, IB, T, &f.w, x, out, &k.s, ctx, "state.conv_v");
    k.s.conv_v[3] = keep;
    assert_memory_equal(o0, out, (size_t)nx * sizeof(float));
    assert_memory_equal(k0, k.buf, (size_t)k.n * sizeof(float));

    /* W = 1: no conv state */
    ifx f1 = f;
    f1.cfg.W = 1;
    lm_kda_layer_state s1 = {NULL, NULL, NULL, k.s.state};
    lm_error err = {0};
    assert_int_equal(lm_kda_layer_infer(&f1.cfg, IB, T, &f1.w, x, out, &s1, ctx, &err), LM_OK);
    assert_int_equal(lm_kda_layer_infer(&f1.cfg, IB, 1, &f1.w, x, out, &s1, ctx, &err), LM_OK);

    /* a backward after infer needs a new forward */
    float *R = malloc((size_t)nx * sizeof(float));
    fill(R, nx, 703, 0, 1);
    float *gbuf[NPARAM];
    for (int i = 0; i < NPARAM; i++)
        gbuf[i] = calloc(1 << 12, sizeof(float));
    lm_kda_layer_grads g = {gbuf[0],  gbuf[1],  gbuf[2],  gbuf[3],  gbuf[4],
                            gbuf[5],  gbuf[6],  gbuf[7],  gbuf[8],  gbuf[9],
                            gbuf[10], gbuf[11], gbuf[12], gbuf[13], gbuf[14]};
    lm_kda_layer_batch b = {IB, T, NULL, 0};
    assert_int_equal(lm_kda_layer_forward(&f.cfg, &b, &f.w, x, out, ctx, &err), LM_OK);
    assert_int_equal(lm_kda_layer_infer(&f.cfg, IB, T, &f.w, x, out, &k.s, ctx, &err), LM_OK);
    memset(&err, 0, sizeof err);
    assert_int_equal(lm_kda_layer_backward(&f.cfg, &b, &f.w, x, R, NULL, &g, ctx, &err),
                     LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "forward"));
    assert_int_equal(lm_kda_layer_forward(&f.cfg, &b, &f.w, x, out, ctx, &err), LM_OK);
    assert_int_equal(lm_kda_layer_backward(&f.cfg, &b, &f.w, x, R, NULL, &g, ctx, &err), LM_OK);
    for (int i = 0; i < NPARAM; i++)
        free(gbuf[i]);
    free(R);
    free(k0);
    free(k.buf);
    free(x);
    free(out);
    free(o0);
    lm_kda_layer_ctx_free(ctx);
    ifx_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fd_bounded),
        cmocka_unit_test(test_fd_softplus),
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
