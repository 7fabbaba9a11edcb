/* `linmoe bench moe`: the MoE layer on the CPU against the machine's limit.
 *
 * The limit is OpenBLAS sgemm 2048x2048x2048 on the same threads, measured in the
 * same run (bench.h). Then, for each shape, the forward (eval: dropless) and the
 * forward+backward (training mode, capacity_factor 0: dropless) of one layer with
 * a sigmoid router (top-k normalised), realistic random weights (torch Linear-like
 * N(0, 1/fan_in)), x and dout ~ N(0, 1), zero selection bias. Shapes:
 *   T=4096, d=512,  E=64, k=8, f=256, 1 shared expert   (the first shape)
 *   T=4096, d=256,  E=16, k=2, f=256, 1 shared expert   (the issue gives no f; 256)
 * Each mode runs with the default threading (tasks in parallel, single-threaded
 * BLAS per GEMM) and, for comparison, with every GEMM on OpenBLAS's threads and the
 * tasks in sequence ("_blasthreads").
 *
 * FLOPs are the active FLOPs of reference/moe.md §6.4 (lm_moe_forward_flops):
 * forward 2*T*d*E + 6*d*f per (token, expert) assignment + 6*T*d*fs; backward
 * twice that. GFLOP/s of forward and forward+backward are thus comparable as
 * "useful work per second". The load average is printed (and stored) because the
 * machine is shared: compare ratios from one run.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "linmoe/core.h"
#include "linmoe/moe.h"
#include "ops/cpu/moe_cpu.h"

typedef struct {
    int T, d, E, k, f, n_shared;
} moe_shape;

static const moe_shape k_shapes[] = {{4096, 512, 64, 8, 256, 1}, {4096, 256, 16, 2, 256, 1}};
#define N_SHAPES ((int)(sizeof(k_shapes) / sizeof(k_shapes[0])))

enum { MODE_FWD = 0, MODE_FWDBWD = 1, N_MODES = 2 };

typedef struct {
    lm_moe_config c;
    lm_moe_ctx *ctx;
    lm_router_state st;
    lm_moe_weights W;
    lm_moe_grads G;
    float *w[LM_MOE_N_WEIGHTS], *g[LM_MOE_N_WEIGHTS];
    int64_t n[LM_MOE_N_WEIGHTS];
    float *x, *dout, *out, *dx;
    int T, mode;
    lm_error err;
} moe_bench;

static void fill_normal(float *x, int64_t n, double std, lm_rng *r) {
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(std * lm_rng_normal(r));
}

static void mb_free(moe_bench *b) {
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
        free(b->w[i]), free(b->g[i]);
    free(b->x), free(b->dout), free(b->out), free(b->dx);
    lm_moe_ctx_free(b->ctx);
    lm_router_state_free(&b->st);
}

static int mb_init(moe_bench *b, const moe_shape *s, uint64_t seed) {
    memset(b, 0, sizeof(*b));
    lm_moe_config_default(&b->c, s->d, s->f, s->E, s->k, s->n_shared);
    b->c.router.balance = LM_BAL_AUX_FREE;
    b->T = s->T;
    if (lm_moe_ctx_new(&b->ctx, &b->c, s->T, &b->err) != LM_OK)
        return -1;
    if (lm_router_state_init(&b->st, s->E, &b->err) != LM_OK)
        return -1;
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        int64_t shape[3];
        const int nd = lm_moe_weight_shape(&b->c, (lm_moe_weight_id)i, shape);
        if (nd <= 0)
            continue;
        int64_t n = 1;
        for (int q = 0; q < nd; q++)
            n *= shape[q];
        b->n[i] = n;
        b->w[i] = (float *)malloc(sizeof(float) * (size_t)n);
        b->g[i] = (float *)malloc(sizeof(float) * (size_t)n);
        if (!b->w[i] || !b->g[i])
            return -1;
        fill_normal(b->w[i], n, 1.0 / sqrt((double)shape[nd - 1]), &r);
        b->W.p[i] = b->w[i];
        b->G.p[i] = b->g[i];
    }
    const int64_t nx = (int64_t)s->T * s->d;
    b->x = (float *)malloc(sizeof(float) * (size_t)nx);
    b->dout = (float *)malloc(sizeof(float) * (size_t)nx);
    b->out = (float *)malloc(sizeof(float) * (size_t)nx);
    b->dx = (float *)malloc(sizeof(float) * (size_t)nx);
    if (!b->x || !b->dout || !b->out || !b->dx)
        return -1;
    fill_normal(b->x, nx, 1.0, &r);
    fill_normal(b->dout, nx, 1.0, &r);
    return 0;
}

static int mb_run(void *ctx) {
    moe_bench *b = (moe_bench *)ctx;
    const int training = b->mode == MODE_FWDBWD;
    if (lm_moe_forward(b->ctx, &b->W, &b->st, b->x, b->T, NULL, 0, training, b->out, &b->err) !=
        LM_OK)
        return -1;
    if (training && lm_moe_backward(b->ctx, &b->W, b->x, b->dout, b->dx, &b->G, &b->err) != LM_OK)
        return -1;
    return 0;
}

static int64_t count_nonfinite(const float *x, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !isfinite(x[i]);
    return bad;
}

static double loadavg1(void) {
    double l = NAN;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1)
            l = NAN;
        fclose(f);
    }
    return l;
}

int lm_bench_moe(const lm_bench_opts *opts) {
    const int threads = opts->threads > 0 ? opts->threads : 1;
    const int warmup = 1, repeat_sgemm = 5, repeat = opts->quick ? 2 : 5;
    lm_set_num_threads(threads);
    lm_blas_set_threads(threads);

    lm_bench_json js = {NULL, NULL};
    if (opts->json_path && lm_bench_json_check_path(opts->json_path) != 0)
        return 1;
    if (opts->json_path && lm_bench_json_init(&js, "moe", threads) != 0) {
        fprintf(stderr, "linmoe bench moe: out of memory\n");
        return 1;
    }
    const double load0 = loadavg1();
    printf("linmoe bench moe: threads=%d, warmup=%d, repeat=%d (sgemm %d)%s, load average %.2f\n",
           threads, warmup, repeat, repeat_sgemm, opts->quick ? ", quick" : "", load0);
    lm_bench_table_header(stdout);
    lm_bench_record rec;
    const double limit = lm_bench_sgemm_limit(threads, repeat_sgemm, &rec);
    if (limit <= 0 || !isfinite(limit)) {
        fprintf(stderr, "linmoe bench moe: the sgemm limit could not be measured\n");
        lm_bench_json_free(&js);
        return 1;
    }
    lm_bench_table_row(stdout, &rec);
    int rc = 0;
    if (js.root && lm_bench_json_add(&js, &rec) != 0)
        rc = 1;

    for (int si = 0; si < N_SHAPES && rc == 0; si++) {
        const moe_shape *s = &k_shapes[si];
        moe_bench b;
        if (mb_init(&b, s, 2000 + (uint64_t)si) != 0) {
            fprintf(stderr, "linmoe bench moe: setup of T=%d d=%d E=%d k=%d f=%d failed: %s\n",
                    s->T, s->d, s->E, s->k, s->f, b.err.msg[0] ? b.err.msg : "out of memory");
            mb_free(&b);
            rc = 1;
            break;
        }
        const int64_t shape[6] = {s->T, s->d, s->E, s->k, s->f, s->n_shared};
        for (int m = 0; m < N_MODES && rc == 0; m++) {
            for (int blas_threaded = 0; blas_threaded < 2 && rc == 0; blas_threaded++) {
                b.mode = m;
                lm_moe_cpu_set_threaded_blas(blas_threaded);
                lm_set_num_threads(threads);
                lm_blas_set_threads(threads);
                lm_bench_timing t = lm_bench_time(mb_run, &b, warmup, repeat);
                lm_moe_cpu_set_threaded_blas(0);
                char name[96];
                snprintf(name, sizeof(name), "moe_%s%s", m == MODE_FWD ? "fwd" : "fwdbwd",
                         blas_threaded ? "_blasthreads" : "");
                if (t.failed) {
                    fprintf(stderr, "linmoe bench moe: %s: %s\n", name, b.err.msg);
                    rc = 1;
                    break;
                }
                const int64_t nx = (int64_t)s->T * s->d;
                int64_t bad = count_nonfinite(b.out, nx);
                if (m == MODE_FWDBWD) {
                    bad += count_nonfinite(b.dx, nx);
                    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
                        if (b.n[i])
                            bad += count_nonfinite(b.g[i], b.n[i]);
                }
                if (bad) {
                    fprintf(stderr, "linmoe bench moe: %s: %lld non-finite output values\n", name,
                            (long long)bad);
                    rc = 1;
                    break;
                }
                const int64_t assign = (int64_t)s->T * s->k; /* dropless */
                double flop = lm_moe_forward_flops(&b.c, s->T, assign);
                if (m == MODE_FWDBWD)
                    flop += lm_moe_backward_flops(&b.c, s->T, assign);
                lm_bench_record_init(&rec, name, 6, shape);
                rec.ms = t.median_ms;
                rec.tokens_per_s = s->T / (t.median_ms * 1e-3);
                rec.gflops = flop / (t.median_ms * 1e-3) / 1e9;
                rec.ratio_to_limit = rec.gflops / limit;
                lm_bench_table_row(stdout, &rec);
                if (js.root && lm_bench_json_add(&js, &rec) != 0)
                    rc = 1;
            }
        }
        mb_free(&b);
    }
    const double load1 = loadavg1();
    printf("shape = [T, d, E, k, f, n_shared]; load average at the end %.2f\n", load1);
    if (rc == 0 && js.root) {
        if (!lm_bench_json_number_or_null_(js.root, "loadavg_start", load0) ||
            !lm_bench_json_number_or_null_(js.root, "loadavg_end", load1))
            rc = 1;
        else if (lm_bench_json_save(&js, opts->json_path) != 0)
            rc = 1;
        else
            printf("wrote %s\n", opts->json_path);
    }
    lm_bench_json_free(&js);
    return rc;
}
