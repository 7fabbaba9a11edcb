/* The CUDA context's isolation (include/linmoe/backend.h, include/linmoe/kda_cuda.h): the
 * KDA entry points keep all their state in the context they are given (workspaces,
 * chunk-table cache, tensor maps, shared-memory opt-ins, options) and run on its stream.
 *
 * (a) Two contexts on two threads run, at the same time and 20 times each, the KDA
 *     inference forward, the training forward + backward and a decode step on different
 *     random inputs (B = 2, T = 300: not a multiple of the 64-token chunk, H = HV = 4,
 *     K = V = 128, bounded gate with A_log, dt_bias, in-kernel l2norm and sigmoid, an
 *     initial state); every output must equal the same calls run serially on one context
 *     beforehand, bit for bit (every output, dbeta, dA_log and ddt_bias included: their
 *     sums have a fixed order, kda_cuda.h "Reproducibility"). The serial reference is also
 *     run twice, so a kernel that is not reproducible on one context is told apart from a
 *     context leak.
 * (b) After the first call, repeated calls on one context allocate no device memory
 *     (lm_cuda_ctx_alloc_count unchanged).
 * (c) A context on a device that does not exist (ordinal 4096) is refused with
 *     LM_ERR_UNSUPPORTED and a message naming it.
 *
 * Inputs come from lm_cuda_fill_normal_* (counter-based: the same seed gives the same
 * values on any context); outputs are poisoned (0xff bytes: NaN) before every call and
 * read back with lm_cuda_ctx_download. Without a CUDA device the program prints "no CUDA
 * device: skipped" and exits 77 (CTest: skipped).
 */
#include <math.h>
#include <pthread.h>
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
#include "linmoe/cuda_bench.h"
#include "linmoe/kda.h"
#include "linmoe/kda_cuda.h"

enum { B = 2, T = 300, H = 4, D = 128, DB = 3 /* decode batch */, ITERS = 20 };
/* Every buffer of one input set, on one context. Element counts in N_*. */
enum {
    X_Q,
    X_K,
    X_V,
    X_G,
    X_BETA,
    X_DO,
    X_ALOG,
    X_DTB,
    X_H0,
    X_DHT,
    X_DQ1, /* decode inputs */
    X_DK1,
    X_DV1,
    X_DG1,
    X_DBETA1,
    N_IN,
    /* outputs */
    Y_OINF = N_IN, /* inference forward */
    Y_HTINF,
    Y_O, /* training forward */
    Y_HT,
    Y_DQ,
    Y_DK,
    Y_DV,
    Y_DG,
    Y_DBETA,
    Y_DH0,
    Y_DALOG,
    Y_DDTB,
    Y_STATE, /* decode: state updated in place (re-filled before each call) */
    Y_O1,
    N_BUF
};
static const char *const k_names[N_BUF] = {"q",
                                           "k",
                                           "v",
                                           "g",
                                           "beta",
                                           "do",
                                           "A_log",
                                           "dt_bias",
                                           "h0",
                                           "dht",
                                           "q1",
                                           "k1",
                                           "v1",
                                           "g1",
                                           "beta1",
                                           "o (inference)",
                                           "final_state (inference)",
                                           "o",
                                           "final_state",
                                           "dq",
                                           "dk",
                                           "dv",
                                           "dg",
                                           "dbeta",
                                           "dh0",
                                           "dA_log",
                                           "ddt_bias",
                                           "decode state",
                                           "decode o"};

static int is_f32(int i) {
    return i == X_ALOG || i == X_DTB || i == X_H0 || i == X_DHT || i == Y_HTINF || i == Y_HT ||
           i == Y_DH0 || i == Y_DALOG || i == Y_DDTB || i == Y_STATE;
}
static int64_t count_of(int i) {
    const int64_t big = (int64_t)B * T * H * D, st = (int64_t)B * H * D * D;
    const int64_t one = (int64_t)DB * H * D;
    switch (i) {
    case X_BETA:
    case Y_DBETA:
        return (int64_t)B * T * H;
    case X_ALOG:
    case Y_DALOG:
        return H;
    case X_DTB:
    case Y_DDTB:
        return (int64_t)H * D;
    case X_H0:
    case X_DHT:
    case Y_HTINF:
    case Y_HT:
    case Y_DH0:
        return st;
    case X_DQ1:
    case X_DK1:
    case X_DV1:
    case X_DG1:
    case Y_O1:
        return one;
    case X_DBETA1:
        return (int64_t)DB * H;
    case Y_STATE:
        return (int64_t)DB * H * D * D;
    default:
        return big;
    }
}
static size_t bytes_of(int i) { return (size_t)count_of(i) * (is_f32(i) ? 4 : 2); }

typedef struct {
    lm_cuda_ctx *ctx;
    void *p[N_BUF];
} kset;

/* host copies of the outputs of one round */
typedef struct {
    void *h[N_BUF];
} kout;

static void kout_init(kout *o) {
    memset(o, 0, sizeof *o);
    for (int i = N_IN; i < N_BUF; i++)
        o->h[i] = malloc(bytes_of(i));
}
static void kout_free(kout *o) {
    for (int i = N_IN; i < N_BUF; i++)
        free(o->h[i]);
}

static uint64_t seed_of(int set, int i) { return 1000 * (uint64_t)(set + 1) + (uint64_t)i; }

/* Buffers on ctx and input set `set` in them (fills on ctx's stream). */
static lm_status kset_init(kset *s, lm_cuda_ctx *ctx, int set, lm_error *err) {
    memset(s, 0, sizeof *s);
    s->ctx = ctx;
    for (int i = 0; i < N_BUF; i++)
        LM_TRY(lm_cuda_ctx_alloc(ctx, &s->p[i], bytes_of(i), err));
    for (int i = 0; i < N_IN; i++) {
        float std = 1.0f;
        if (i == X_ALOG)
            std = 0.3f;
        else if (i == X_DTB)
            std = 0.5f;
        else if (i == X_H0)
            std = 0.2f;
        LM_TRY(is_f32(i) ? lm_cuda_fill_normal_f32(ctx, s->p[i], count_of(i), seed_of(set, i), 0.0f,
                                                   std, err)
                         : lm_cuda_fill_normal_bf16(ctx, s->p[i], count_of(i), seed_of(set, i),
                                                    0.0f, std, err));
    }
    return LM_OK;
}

static void kset_free(kset *s) {
    for (int i = 0; i < N_BUF; i++)
        lm_cuda_ctx_free_mem(s->ctx, s->p[i]);
    memset(s, 0, sizeof *s);
}

static void config(lm_kda_config *c, int b, int t) {
    lm_kda_config_default(c, b, t, H, H, D, D);
    c->kind = LM_KDA;
    c->gate = LM_GATE_BOUNDED;
    c->has_lower_bound = 1;
    c->lower_bound = -5.0f;
    c->use_qk_l2norm_in_kernel = 1;
    c->use_beta_sigmoid_in_kernel = 1;
}

/* One round on s's context: the inference forward, the training forward, the backward,
 * a decode step from a re-filled state; every output poisoned first and downloaded into
 * o (when not NULL). */
static lm_status kset_round(kset *s, int set, kout *o, lm_error *err) {
    lm_cuda_ctx *ctx = s->ctx;
    void *const *p = s->p;
    for (int i = N_IN; i < N_BUF; i++)
        LM_TRY(lm_cuda_ctx_memset(ctx, p[i], 0xff, bytes_of(i), err));
    LM_TRY(lm_cuda_fill_normal_f32(ctx, p[Y_STATE], count_of(Y_STATE), seed_of(set, Y_STATE), 0.0f,
                                   0.1f, err));
    lm_kda_config c;
    config(&c, B, T);
    lm_kda_cuda_inputs in = {p[X_Q],    p[X_K],    p[X_V],   p[X_G],
                             p[X_BETA], p[X_ALOG], p[X_DTB], p[X_H0]};
    lm_kda_cuda_outputs out_inf = {p[Y_OINF], p[Y_HTINF]};
    LM_TRY(lm_kda_cuda_chunk_forward(ctx, &c, &in, &out_inf, err));
    lm_kda_cuda_outputs out = {p[Y_O], p[Y_HT]};
    lm_kda_cuda_saved *saved = NULL;
    LM_TRY(lm_kda_cuda_forward_train(ctx, &c, &in, &out, &saved, err));
    lm_kda_cuda_grads gr = {p[X_DO], p[X_DHT],   p[Y_DQ],  p[Y_DK],    p[Y_DV],
                            p[Y_DG], p[Y_DBETA], p[Y_DH0], p[Y_DALOG], p[Y_DDTB]};
    const lm_status st = lm_kda_cuda_backward(ctx, saved, &gr, err);
    lm_kda_cuda_saved_free(ctx, saved);
    LM_TRY(st);
    lm_kda_config dc;
    config(&dc, DB, 1);
    lm_kda_cuda_inputs din = {p[X_DQ1],    p[X_DK1],  p[X_DV1], p[X_DG1],
                              p[X_DBETA1], p[X_ALOG], p[X_DTB], NULL};
    LM_TRY(lm_kda_cuda_decode_step(ctx, &dc, &din, p[Y_STATE], p[Y_O1], err));
    if (o)
        for (int i = N_IN; i < N_BUF; i++)
            LM_TRY(lm_cuda_ctx_download(ctx, o->h[i], p[i], bytes_of(i), err));
    else
        LM_TRY(lm_cuda_ctx_sync(ctx, err));
    return LM_OK;
}

static double rel_rms(const void *a, const void *ref, int64_t n, int f32) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = f32 ? ((const float *)a)[i] : lm_bf16_to_f32(((const uint16_t *)a)[i]);
        const double y = f32 ? ((const float *)ref)[i] : lm_bf16_to_f32(((const uint16_t *)ref)[i]);
        num += (x - y) * (x - y);
        den += y * y;
    }
    if (!(num == num))
        return INFINITY;
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Outputs of a against ref: the number that are not finite or differ in their bits; the
 * first difference described in msg. */
static int compare(const kout *a, const kout *ref, char *msg, size_t size) {
    int bad = 0;
    for (int i = N_IN; i < N_BUF; i++) {
        const int64_t n = count_of(i);
        const int f32 = is_f32(i);
        int64_t nan = 0;
        for (int64_t j = 0; j < n; j++) {
            const double x =
                f32 ? ((const float *)a->h[i])[j] : lm_bf16_to_f32(((const uint16_t *)a->h[i])[j]);
            nan += !isfinite(x);
        }
        if (nan) {
            if (!bad++)
                snprintf(msg, size, "%s: %lld of %lld values not finite (not written?)", k_names[i],
                         (long long)nan, (long long)n);
            continue;
        }
        if (memcmp(a->h[i], ref->h[i], bytes_of(i)) != 0) {
            int64_t differ = 0;
            const size_t es = f32 ? 4 : 2;
            for (int64_t j = 0; j < n; j++)
                differ += memcmp((const char *)a->h[i] + j * es, (const char *)ref->h[i] + j * es,
                                 es) != 0;
            if (!bad++)
                snprintf(msg, size,
                         "%s: %lld of %lld values differ in their bits (relative RMS %.3e)",
                         k_names[i], (long long)differ, (long long)n,
                         rel_rms(a->h[i], ref->h[i], n, f32));
        }
    }
    return bad;
}

/* ------------------------------------------------------------------- (a) */

typedef struct {
    int set;
    const kout *ref;
    pthread_barrier_t *go;
    /* results */
    lm_status st;
    char msg[1024];
    int rounds, mismatched;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    lm_error err = {0};
    lm_cuda_ctx *ctx = NULL;
    kset s;
    memset(&s, 0, sizeof s);
    kout o;
    kout_init(&o);
    w->st = lm_cuda_ctx_new(&ctx, 0, &err);
    if (w->st == LM_OK)
        w->st = kset_init(&s, ctx, w->set, &err);
    pthread_barrier_wait(w->go); /* both threads start their rounds together */
    for (int it = 0; it < ITERS && w->st == LM_OK; it++) {
        w->st = kset_round(&s, w->set, &o, &err);
        if (w->st != LM_OK)
            break;
        w->rounds++;
        char m[512];
        if (compare(&o, w->ref, m, sizeof m) && !w->mismatched++)
            snprintf(w->msg, sizeof w->msg, "round %d: %s", it, m);
    }
    if (w->st != LM_OK)
        snprintf(w->msg, sizeof w->msg, "%s", err.msg);
    kset_free(&s);
    lm_cuda_ctx_free(ctx);
    kout_free(&o);
    return NULL;
}

static void test_two_threads(void **state) {
    (void)state;
    lm_error err = {0};
    lm_cuda_ctx *ctx = NULL;
    assert_int_equal(lm_cuda_ctx_new(&ctx, 0, &err), LM_OK);
    /* the serial reference on one context: set 0, set 1, then set 0 again (the kernels'
     * own reproducibility, apart from any second context) */
    kset s[2];
    kout ref[2], again;
    for (int k = 0; k < 2; k++) {
        kout_init(&ref[k]);
        assert_int_equal(kset_init(&s[k], ctx, k, &err), LM_OK);
    }
    kout_init(&again);
    for (int k = 0; k < 2; k++) {
        const lm_status st = kset_round(&s[k], k, &ref[k], &err);
        if (st != LM_OK)
            print_error("%s\n", err.msg);
        assert_int_equal(st, LM_OK);
    }
    assert_int_equal(kset_round(&s[0], 0, &again, &err), LM_OK);
    char msg[512] = "";
    const int self = compare(&again, &ref[0], msg, sizeof msg);
    if (self)
        print_error("one context, same inputs twice: %s (the kernels, not the contexts)\n", msg);
    assert_int_equal(self, 0);
    /* the two input sets must differ, or the test could not see a mix-up */
    assert_true(compare(&ref[1], &ref[0], msg, sizeof msg) > 0);
    for (int k = 0; k < 2; k++)
        kset_free(&s[k]);
    lm_cuda_ctx_free(ctx);

    pthread_barrier_t go;
    assert_int_equal(pthread_barrier_init(&go, NULL, 2), 0);
    worker w[2];
    pthread_t th[2];
    for (int k = 0; k < 2; k++) {
        memset(&w[k], 0, sizeof w[k]);
        w[k].set = k;
        w[k].ref = &ref[k];
        w[k].go = &go;
        assert_int_equal(pthread_create(&th[k], NULL, work, &w[k]), 0);
    }
    for (int k = 0; k < 2; k++)
        assert_int_equal(pthread_join(th[k], NULL), 0);
    pthread_barrier_destroy(&go);
    int failed = 0;
    for (int k = 0; k < 2; k++) {
        print_message("thread %d (input set %d): %d rounds, %d differ from the serial run%s%s\n", k,
                      k, w[k].rounds, w[k].mismatched, w[k].msg[0] ? ": " : "", w[k].msg);
        failed |= w[k].st != LM_OK || w[k].rounds != ITERS || w[k].mismatched != 0;
    }
    for (int k = 0; k < 2; k++)
        kout_free(&ref[k]);
    kout_free(&again);
    assert_int_equal(failed, 0);
}

/* ------------------------------------------------------------------- (b) */

static void test_no_allocation_after_first(void **state) {
    (void)state;
    lm_error err = {0};
    lm_cuda_ctx *ctx = NULL;
    assert_int_equal(lm_cuda_ctx_new(&ctx, 0, &err), LM_OK);
    kset s;
    assert_int_equal(kset_init(&s, ctx, 0, &err), LM_OK);
    lm_status st = kset_round(&s, 0, NULL, &err);
    if (st != LM_OK)
        print_error("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    const uint64_t n0 = lm_cuda_ctx_alloc_count(ctx);
    for (int it = 0; it < 5; it++)
        assert_int_equal(kset_round(&s, 0, NULL, &err), LM_OK);
    const uint64_t n1 = lm_cuda_ctx_alloc_count(ctx);
    print_message("device allocations: %llu after the first round, %llu after 5 more\n",
                  (unsigned long long)n0, (unsigned long long)n1);
    assert_int_equal(n1, n0);
    /* releasing the KDA buffers makes the next round allocate again (the count is live) */
    lm_kda_cuda_release(ctx);
    assert_int_equal(kset_round(&s, 0, NULL, &err), LM_OK);
    assert_true(lm_cuda_ctx_alloc_count(ctx) > n1);
    kset_free(&s);
    lm_cuda_ctx_free(ctx);
}

/* ------------------------------------------------------------------- (c) */

static void test_missing_device(void **state) {
    (void)state;
    lm_error err = {0};
    lm_cuda_ctx *ctx = (lm_cuda_ctx *)&err; /* must come back NULL */
    assert_int_equal(lm_cuda_ctx_new(&ctx, 4096, &err), LM_ERR_UNSUPPORTED);
    assert_null(ctx);
    print_message("%s\n", err.msg);
    assert_non_null(strstr(err.msg, "4096"));
}

int main(void) {
    if (lm_cuda_device_count() < 1) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_threads),
        cmocka_unit_test(test_no_allocation_after_first),
        cmocka_unit_test(test_missing_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
