/* CUDA KDA / GDN decode step (lm_kda_cuda_decode_step, include/linmoe/kda_cuda.h)
 * against the CPU recurrent forward (lm_kda_recurrent_forward, fp32), on
 * bf16-rounded inputs: the reference sees exactly the values the GPU reads.
 *
 * Each case runs `steps` consecutive decode steps on the GPU, feeding the state
 * back in place, and compares every step's o and the final state with one
 * recurrent forward over T = steps tokens from the same initial state. Grid: KDA and
 * GDN; gates none / softplus / bounded with and without A_log / dt_bias; GVA HV = 2H;
 * in-kernel l2norm and sigmoid on and off; scale 1, 0.1 and K^-0.5; K, V in {64, 128},
 * K = 72 with V = 96 and K = 64 with V = 96 (partial thread rows or column slices),
 * V = 100 and a misaligned state pointer (the scalar path), K = 256 (32 rows per
 * thread).
 *
 * Tolerances (one table, TOL_*): o and state within 0.005 relative RMS error. The
 * GPU rounds o to bf16 (relative RMS ~1e-3 from that alone); the state differs from
 * the CPU's only by fp32 summation order (~1e-6).
 *
 * Timing is elsewhere: the decode row of `linmoe bench kda --device cuda`
 * (bench/bench_kda_cuda.c) times the production step against the copy bandwidth, and
 * dev/kda_decode_variants.cu times (and checks) the launch shapes that lost the A/B
 * test. Everything runs on one context (lm_cuda_ctx on cuda:0, its own stream). Without
 * a CUDA device (or a build without CUDA) the program prints "no CUDA device: skipped"
 * and exits 77 (CTest: skipped), so CI (no GPU) passes.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/kda.h"
#include "linmoe/kda_cuda.h"

#define TOL_O 0.005     /* bf16 output rounding (~1e-3) plus margin */
#define TOL_STATE 0.005 /* fp32 state: summation order only; same table as test_kda_cuda */

typedef struct {
    const char *name;
    lm_kda_kind kind;
    lm_gate_mode gate;
    int has_A, has_bias;
    float lb; /* 0: none */
    int l2, sig;
    int B, H, HV, K, V;
    float scale; /* 0: K^-0.5 */
    int steps;
    int misalign; /* 1: state pointer offset by one float (scalar path) */
    uint64_t seed;
} dcase;

#define KDA LM_KDA
#define GDN LM_GDN
#define GN LM_GATE_NONE
#define GSP LM_GATE_SOFTPLUS
#define GBD LM_GATE_BOUNDED
/* clang-format off */
static const dcase CASES[] = {
    /* name                               kind gate A  b  lb  l2 sig B  H  HV K    V    scale steps mis seed */
    {"kda none K64 V64",                  KDA, GN,  0, 0, 0,  1, 0,  3, 2, 2, 64,  64,  0,    8,    0,  1},
    {"kda softplus A bias K128 V128",     KDA, GSP, 1, 1, 0,  1, 1,  2, 4, 4, 128, 128, 0,    8,    0,  2},
    {"kda bounded A bias K128 no l2",     KDA, GBD, 1, 1, -5, 0, 0,  2, 2, 2, 128, 128, 0,    8,    0,  3},
    {"kda softplus gva2 K128 V64",        KDA, GSP, 1, 0, 0,  1, 1,  2, 2, 4, 128, 64,  0,    8,    0,  4},
    {"kda bounded lb-3 gva2 K64 V128",    KDA, GBD, 0, 1, -3, 1, 1,  2, 2, 4, 64,  128, 0,    8,    0,  5},
    {"kda none K72 V96 scale1",           KDA, GN,  0, 0, 0,  1, 0,  2, 2, 2, 72,  96,  1.0f, 8,    0,  6},
    {"kda softplus K128 V100 (scalar)",   KDA, GSP, 1, 1, 0,  1, 1,  2, 2, 2, 128, 100, 0,    8,    0,  7},
    {"kda softplus K128 misaligned",      KDA, GSP, 1, 1, 0,  1, 1,  2, 2, 2, 128, 128, 0,    8,    1,  8},
    {"kda bounded K256 V128 s0.1",        KDA, GBD, 1, 1, -5, 1, 1,  1, 2, 2, 256, 128, 0.1f, 8,    0,  9},
    {"kda softplus plain K128 1 step",    KDA, GSP, 0, 0, 0,  1, 0,  1, 1, 1, 128, 128, 0,    1,    0,  10},
    {"kda none sigmoid no l2 K64 V128",   KDA, GN,  0, 0, 0,  0, 1,  3, 1, 1, 64,  128, 0,    8,    0,  11},
    {"kda softplus A bias gva2 V128",     KDA, GSP, 1, 1, 0,  1, 1,  2, 2, 4, 128, 128, 0,    3,    0,  41},
    {"kda none K256 V128 B1",             KDA, GN,  0, 0, 0,  1, 0,  1, 2, 2, 256, 128, 0,    3,    0,  43},
    {"gdn none K64 V64",                  GDN, GN,  0, 0, 0,  1, 0,  3, 2, 2, 64,  64,  0,    8,    0,  21},
    {"gdn softplus A bias gva2 K128",     GDN, GSP, 1, 1, 0,  1, 1,  2, 2, 4, 128, 128, 0,    8,    0,  22},
    {"gdn bounded A bias K128 no l2",     GDN, GBD, 1, 1, -5, 0, 1,  2, 2, 2, 128, 128, 0.1f, 8,    0,  23},
    {"gdn bounded K72 V96 gva2",          GDN, GBD, 0, 1, -2, 1, 0,  2, 1, 2, 72,  96,  0,    8,    0,  24},
    {"gdn bounded A bias K64 V96",        GDN, GBD, 1, 1, -5, 1, 1,  3, 2, 2, 64,  96,  0,    3,    0,  42},
};
/* clang-format on */

static double rel_rms(const float *a, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        const double d = (double)a[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Round x in place to bf16 and keep the bits in h. */
static void to_bf16(uint16_t *h, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        h[i] = lm_f32_to_bf16(x[i]);
        x[i] = lm_bf16_to_f32(h[i]);
    }
}

/* the context every test runs on (made in main) */
static lm_cuda_ctx *g_ctx;

static void dev_free(const void *d) { lm_cuda_ctx_free_mem(g_ctx, (void *)d); }

static void *dev_alloc(size_t bytes) {
    lm_error err = {0};
    void *d = NULL;
    assert_int_equal(lm_cuda_ctx_alloc(g_ctx, &d, bytes, &err), LM_OK);
    return d;
}

static void *dev_upload(const void *src, size_t bytes) {
    lm_error err = {0};
    void *d = dev_alloc(bytes);
    assert_int_equal(lm_cuda_ctx_upload(g_ctx, d, src, bytes, &err), LM_OK);
    return d;
}

/* Host inputs of T tokens: fp32 (bf16-rounded) for the CPU, bf16 bits for the GPU. */
typedef struct {
    int B, T, H, HV, K, V, GK;
    float *q, *k, *v, *g, *b, *A, *bias, *h0;
    uint16_t *hq, *hk, *hv, *hg, *hb;
} inputs;

static void inputs_make(inputs *x, const dcase *cc, int T, int repeat_token) {
    lm_rng rng;
    lm_rng_init(&rng, cc->seed);
    memset(x, 0, sizeof *x);
    x->B = cc->B, x->T = T, x->H = cc->H, x->HV = cc->HV, x->K = cc->K, x->V = cc->V;
    x->GK = cc->kind == LM_GDN ? 1 : cc->K;
    const int B = cc->B, H = cc->H, HV = cc->HV, K = cc->K, V = cc->V, GK = x->GK;
    const int64_t nq = (int64_t)B * T * H * K, nv = (int64_t)B * T * HV * V,
                  ng = (int64_t)B * T * HV * GK, nb = (int64_t)B * T * HV,
                  ns = (int64_t)B * HV * K * V;
    x->q = malloc(sizeof(float) * nq), x->k = malloc(sizeof(float) * nq);
    x->v = malloc(sizeof(float) * nv), x->g = malloc(sizeof(float) * ng);
    x->b = malloc(sizeof(float) * nb), x->h0 = malloc(sizeof(float) * ns);
    x->hq = malloc(2 * nq), x->hk = malloc(2 * nq), x->hv = malloc(2 * nv);
    x->hg = malloc(2 * ng), x->hb = malloc(2 * nb);
    /* token t draws its own values, or (repeat_token) every token copies token 0 */
    for (int bb = 0; bb < B; bb++)
        for (int t = 0; t < T; t++) {
            const int src = repeat_token ? 0 : t;
            const int64_t r = (int64_t)bb * T + t, r0 = (int64_t)bb * T + src;
            if (src != t) {
                memcpy(x->q + r * H * K, x->q + r0 * H * K, sizeof(float) * H * K);
                memcpy(x->k + r * H * K, x->k + r0 * H * K, sizeof(float) * H * K);
                memcpy(x->v + r * HV * V, x->v + r0 * HV * V, sizeof(float) * HV * V);
                memcpy(x->g + r * HV * GK, x->g + r0 * HV * GK, sizeof(float) * HV * GK);
                memcpy(x->b + r * HV, x->b + r0 * HV, sizeof(float) * HV);
                continue;
            }
            for (int i = 0; i < H; i++) {
                float *q = x->q + (r * H + i) * K, *k = x->k + (r * H + i) * K;
                double sq = 0, sk = 0;
                for (int d = 0; d < K; d++) {
                    q[d] = (float)lm_rng_normal(&rng);
                    k[d] = (float)lm_rng_normal(&rng);
                    sq += (double)q[d] * q[d];
                    sk += (double)k[d] * k[d];
                }
                if (!cc->l2) /* unit-norm rows, as the delta rule needs */
                    for (int d = 0; d < K; d++) {
                        q[d] = (float)(q[d] / sqrt(sq));
                        k[d] = (float)(k[d] / sqrt(sk));
                    }
            }
            for (int64_t i = 0; i < (int64_t)HV * V; i++)
                x->v[r * HV * V + i] = (float)lm_rng_normal(&rng);
            for (int64_t i = 0; i < (int64_t)HV * GK; i++) {
                const double z = lm_rng_normal(&rng);
                /* gate none takes the log-decay itself: logsigmoid keeps it <= 0, and
                 * with lower_bound given it must not go below it */
                double gv = cc->gate == LM_GATE_NONE ? -log1p(exp(-z)) : z;
                if (cc->gate == LM_GATE_NONE && cc->lb != 0 && gv < cc->lb)
                    gv = cc->lb;
                x->g[r * HV * GK + i] = (float)gv;
            }
            for (int i = 0; i < HV; i++)
                x->b[r * HV + i] = (float)(cc->sig ? lm_rng_normal(&rng) : lm_rng_uniform(&rng));
        }
    if (cc->has_A) {
        x->A = malloc(sizeof(float) * HV);
        for (int i = 0; i < HV; i++)
            x->A[i] = (float)(cc->gate == LM_GATE_SOFTPLUS ? log(1 + 15 * lm_rng_uniform(&rng))
                                                           : 0.3 * lm_rng_normal(&rng));
    }
    if (cc->has_bias) {
        x->bias = malloc(sizeof(float) * HV * GK);
        for (int i = 0; i < HV * GK; i++)
            x->bias[i] = (float)(0.5 * lm_rng_normal(&rng));
    }
    for (int64_t i = 0; i < ns; i++)
        x->h0[i] = (float)(0.2 * lm_rng_normal(&rng));
    to_bf16(x->hq, x->q, nq);
    to_bf16(x->hk, x->k, nq);
    to_bf16(x->hv, x->v, nv);
    to_bf16(x->hg, x->g, ng);
    to_bf16(x->hb, x->b, nb);
}

static void inputs_free(inputs *x) {
    free(x->q), free(x->k), free(x->v), free(x->g), free(x->b), free(x->A), free(x->bias);
    free(x->h0), free(x->hq), free(x->hk), free(x->hv), free(x->hg), free(x->hb);
}

static void config_make(lm_kda_config *c, const dcase *cc, int B, int T) {
    lm_kda_config_default(c, B, T, cc->H, cc->HV, cc->K, cc->V);
    c->kind = cc->kind;
    c->gate = cc->gate;
    c->has_lower_bound = cc->lb != 0;
    c->lower_bound = cc->lb;
    c->use_qk_l2norm_in_kernel = cc->l2;
    c->use_beta_sigmoid_in_kernel = cc->sig;
    if (cc->scale != 0)
        c->scale = cc->scale;
}

/* CPU reference: T tokens from h0 (o [B,T,HV,V], final state [B,HV,K,V]). */
static void cpu_ref(const dcase *cc, const inputs *x, float *o, float *ht) {
    lm_kda_config c;
    config_make(&c, cc, x->B, x->T);
    lm_kda_inputs in = {x->q, x->k, x->v, x->g, x->b, x->A, x->bias, x->h0};
    lm_kda_outputs out = {o, ht};
    lm_error err = {0};
    lm_status st = lm_kda_recurrent_forward(&c, &in, &out, &err);
    if (st != LM_OK)
        print_error("cpu reference: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

/* Copy token t of a [B,T,rowlen] bf16 tensor into a [B,1,rowlen] buffer. */
static void slice_token(uint16_t *dst, const uint16_t *src, int B, int T, int t, int64_t rowlen) {
    for (int b = 0; b < B; b++)
        memcpy(dst + (int64_t)b * rowlen, src + ((int64_t)b * T + t) * rowlen, 2 * (size_t)rowlen);
}

static void run_case(void **state) {
    const dcase *cc = *state;
    const int T = cc->steps, B = cc->B, H = cc->H, HV = cc->HV, K = cc->K, V = cc->V;
    inputs x;
    inputs_make(&x, cc, T, 0);
    const int GK = x.GK;
    const int64_t nv = (int64_t)B * T * HV * V, ns = (int64_t)B * HV * K * V;
    float *o_ref = malloc(sizeof(float) * nv), *ht_ref = malloc(sizeof(float) * ns);
    cpu_ref(cc, &x, o_ref, ht_ref);

    /* device buffers of one token */
    const int64_t tq = (int64_t)H * K, tv = (int64_t)HV * V, tg = (int64_t)HV * GK;
    lm_kda_cuda_inputs in = {0};
    in.q = dev_alloc(2 * B * tq);
    in.k = dev_alloc(2 * B * tq);
    in.v = dev_alloc(2 * B * tv);
    in.g = dev_alloc(2 * B * tg);
    in.beta = dev_alloc(2 * B * HV);
    in.A_log = x.A ? dev_upload(x.A, sizeof(float) * HV) : NULL;
    in.dt_bias = x.bias ? dev_upload(x.bias, sizeof(float) * HV * GK) : NULL;
    float *dstate_buf = dev_alloc(sizeof(float) * (ns + 1));
    float *dstate = dstate_buf + cc->misalign;
    void *d_o = dev_alloc(2 * B * tv);
    lm_error err = {0};
    assert_int_equal(lm_cuda_ctx_upload(g_ctx, dstate, x.h0, sizeof(float) * ns, &err), LM_OK);

    uint16_t *tmp = malloc(2 * (size_t)B * (tq > tv ? (tq > tg ? tq : tg) : (tv > tg ? tv : tg)));
    uint16_t *ho = malloc(2 * (size_t)B * tv);
    float *o = malloc(sizeof(float) * nv), *ht = malloc(sizeof(float) * ns);
    lm_kda_config c;
    config_make(&c, cc, B, 1);
    for (int t = 0; t < T; t++) {
        slice_token(tmp, x.hq, B, T, t, tq);
        assert_int_equal(lm_cuda_ctx_upload(g_ctx, (void *)in.q, tmp, 2 * B * tq, &err), LM_OK);
        slice_token(tmp, x.hk, B, T, t, tq);
        assert_int_equal(lm_cuda_ctx_upload(g_ctx, (void *)in.k, tmp, 2 * B * tq, &err), LM_OK);
        slice_token(tmp, x.hv, B, T, t, tv);
        assert_int_equal(lm_cuda_ctx_upload(g_ctx, (void *)in.v, tmp, 2 * B * tv, &err), LM_OK);
        slice_token(tmp, x.hg, B, T, t, tg);
        assert_int_equal(lm_cuda_ctx_upload(g_ctx, (void *)in.g, tmp, 2 * B * tg, &err), LM_OK);
        slice_token(tmp, x.hb, B, T, t, HV);
        assert_int_equal(lm_cuda_ctx_upload(g_ctx, (void *)in.beta, tmp, 2 * B * HV, &err), LM_OK);
        /* poison o: every element must be written */
        for (int64_t i = 0; i < B * tv; i++)
            ho[i] = 0x7fc1; /* NaN */
        assert_int_equal(lm_cuda_ctx_upload(g_ctx, d_o, ho, 2 * B * tv, &err), LM_OK);
        lm_status st = lm_kda_cuda_decode_step(g_ctx, &c, &in, dstate, d_o, &err);
        if (st != LM_OK)
            print_error("%s\n", err.msg);
        assert_int_equal(st, LM_OK);
        assert_int_equal(c.N, B);
        assert_int_equal(lm_cuda_ctx_download(g_ctx, ho, d_o, 2 * B * tv, &err), LM_OK);
        for (int b = 0; b < B; b++)
            for (int64_t i = 0; i < tv; i++)
                o[((int64_t)b * T + t) * tv + i] = lm_bf16_to_f32(ho[b * tv + i]);
    }
    assert_int_equal(lm_cuda_ctx_download(g_ctx, ht, dstate, sizeof(float) * ns, &err), LM_OK);
    const double eo = rel_rms(o, o_ref, nv), eh = rel_rms(ht, ht_ref, ns);
    print_message("%-36s %d steps  o %.2e  state %.2e\n", cc->name, T, eo, eh);
    assert_true(eo <= TOL_O);
    assert_true(eh <= TOL_STATE);

    dev_free(in.q);
    dev_free(in.k);
    dev_free(in.v);
    dev_free(in.g);
    dev_free(in.beta);
    dev_free(in.A_log);
    dev_free(in.dt_bias);
    dev_free(dstate_buf);
    dev_free(d_o);
    free(tmp), free(ho), free(o), free(ht), free(o_ref), free(ht_ref);
    inputs_free(&x);
}

/* Bad configurations and a missing context are refused before any device work. */
static void test_invalid(void **state) {
    (void)state;
    lm_kda_config c;
    lm_kda_config_default(&c, 2, 2, 2, 2, 64, 64);
    lm_kda_cuda_inputs in = {0};
    uint16_t dummy[4] = {0};
    float fdummy[4] = {0};
    lm_error err = {0};
    in.q = in.k = in.v = in.g = in.beta = dummy;
    lm_status st = lm_kda_cuda_decode_step(g_ctx, &c, &in, fdummy, dummy, &err);
    assert_int_equal(st, LM_ERR_INVALID); /* T = 2 */
    assert_non_null(strstr(err.msg, "T = 2"));
    c.T = 1;
    c.HV = 3; /* not a multiple of H */
    assert_int_equal(lm_kda_cuda_decode_step(g_ctx, &c, &in, fdummy, dummy, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "HV=3"));
    c.HV = 2;
    static const int64_t cu[] = {0, 1, 2};
    c.cu_seqlens = cu;
    c.n_cu_seqlens = 3;
    assert_int_equal(lm_kda_cuda_decode_step(g_ctx, &c, &in, fdummy, dummy, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "cu_seqlens"));
    c.cu_seqlens = NULL;
    c.n_cu_seqlens = 0;
    c.gate = LM_GATE_BOUNDED; /* without lower_bound */
    assert_int_equal(lm_kda_cuda_decode_step(g_ctx, &c, &in, fdummy, dummy, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "lower_bound"));
    c.gate = LM_GATE_NONE;
    assert_int_equal(lm_kda_cuda_decode_step(g_ctx, &c, &in, NULL, dummy, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "state"));
    c.K = 512;
    assert_int_equal(lm_kda_cuda_decode_step(g_ctx, &c, &in, fdummy, dummy, &err),
                     LM_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "K = 512"));
    c.K = 64;
    char buf[256] = {0};
    assert_int_equal(lm_kda_cuda_decode_flat(g_ctx, 2, 2, 3, 64, 64, LM_KDA, LM_GATE_NONE, 0.0f,
                                             0.0f, 1, 0, dummy, dummy, dummy, dummy, dummy, NULL,
                                             NULL, fdummy, dummy, buf, (int)sizeof buf),
                     LM_ERR_INVALID);
    assert_non_null(strstr(buf, "HV=3"));
    /* no context */
    c.T = 1;
    assert_int_equal(lm_kda_cuda_decode_step(NULL, &c, &in, fdummy, dummy, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "context"));
    assert_int_equal(lm_kda_cuda_decode_flat(NULL, 2, 2, 2, 64, 64, LM_KDA, LM_GATE_NONE, 0.0f,
                                             0.0f, 1, 0, dummy, dummy, dummy, dummy, dummy, NULL,
                                             NULL, fdummy, dummy, buf, (int)sizeof buf),
                     LM_ERR_INVALID);
}

int main(void) {
    if (lm_cuda_device_count() < 1) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    lm_error err = {0};
    if (lm_cuda_ctx_new(&g_ctx, 0, &err) != LM_OK) {
        fprintf(stderr, "test_kda_decode_cuda: %s\n", err.msg);
        return 1;
    }
    enum { NC = sizeof CASES / sizeof CASES[0] };
    struct CMUnitTest tests[NC + 1];
    for (int i = 0; i < NC; i++) {
        tests[i] = (struct CMUnitTest)cmocka_unit_test_prestate(run_case, (void *)&CASES[i]);
        tests[i].name = CASES[i].name;
    }
    tests[NC] = (struct CMUnitTest)cmocka_unit_test(test_invalid);
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    lm_cuda_ctx_free(g_ctx);
    return rc;
}
