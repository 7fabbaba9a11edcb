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
    /* non-finite x */
    f.x[3] = NAN;
    memset(&err, 0, sizeof err);
    st = lm_kda_layer_forward(&f.cfg, &f.batch, &f.w, f.x, f.out, f.ctx, &err);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'x'"));
    assert_memory_equal(o0, f.out, bytes);
    free(o0);
    fx_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fd_bounded),
        cmocka_unit_test(test_fd_softplus),
        cmocka_unit_test(test_packed_independence),
        cmocka_unit_test(test_packed_vs_alone),
        cmocka_unit_test(test_threads_deterministic),
        cmocka_unit_test(test_invalid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
