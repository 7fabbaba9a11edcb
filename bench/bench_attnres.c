/* `linmoe bench attnres`: the AttnRes aggregation op (include/linmoe/attnres.h) on the
 * CPU against the machine's copy bandwidth.
 *
 * The op is memory-bound (a few FLOPs per element loaded), so the limit is the copy
 * bandwidth measured in the same run on the same OpenMP threads: dst[i] = src[i] over
 * 64 Mi floats (256 MiB each way), counted as read + write (write-allocate traffic
 * not counted), median of 5 after one warmup. A streaming add (y += x, 2 reads + 1
 * write) and a streaming read (sum) are printed next to it for context; their
 * ratio column is also relative to the copy rate.
 *
 * Cases: N = 4096 rows (tokens), D = 256 and 1024, L = 2, 5, 9, 17 sources (the
 * model's range: embedding + block sums + partial), each source its own [N, D]
 * tensor (the pointer-table entry points the model uses), sources ~ N(0, 1), query
 * ~ N(0, 1/D) (non-zero: logits of order 1, so every key-gradient term is live),
 * rms_weight = 1 + 0.1 N(0, 1), do ~ N(0, 1); one reusable workspace, trusted inputs
 * and, in the backward, accumulate = 1 into dsrc / dquery / drms_weight: as the
 * model calls it.
 *
 * Bytes that must move (fp32):
 *   forward   read L*N*D (sources), write N*D (o)
 *   backward  read L*N*D (sources) + N*D (do), read + write L*N*D (dsrc accumulators)
 * GB/s = those bytes / median time; ratio_to_limit = GB/s / copy GB/s.
 * FLOPs are pinned per source element (src/ops/attnres.c):
 *   forward   6  (sum of squares 2, <u, C> 2, o += p C 2)
 *   backward  14 (the three dot products 6, dC += p do + b u - e C 6, du += b C 2)
 * The JSON records carry the usual fields plus "gb_per_s" and "bytes".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "linmoe/attnres.h"
#include "linmoe/core.h"

#define AR_N 4096
#define AR_LMAX 17
static const int k_D[] = {256, 1024};
static const int k_L[] = {2, 5, 9, 17};
#define N_D ((int)(sizeof(k_D) / sizeof(k_D[0])))
#define N_L ((int)(sizeof(k_L) / sizeof(k_L[0])))

#define BW_N ((int64_t)64 << 20) /* floats per stream array: 256 MiB */

/* ---------------------------------------------------------------- table with GB/s */

static void table_header(void) {
    printf("%-30s %-16s %9s %12s %9s %9s %8s\n", "name", "shape", "ms", "tokens/s", "GFLOP/s",
           "GB/s", "limit");
    printf("%-30s %-16s %9s %12s %9s %9s %8s\n", "----", "-----", "--", "--------", "-------",
           "----", "-----");
}

static void table_row(const lm_bench_record *r, double gbps) {
    char shp[64], tps[32], gf[32];
    lm_bench_fmt_shape(shp, sizeof(shp), r->ndim, r->shape);
    if (isnan(r->tokens_per_s)) snprintf(tps, sizeof(tps), "-");
    else snprintf(tps, sizeof(tps), "%.0f", r->tokens_per_s);
    if (isnan(r->gflops)) snprintf(gf, sizeof(gf), "-");
    else snprintf(gf, sizeof(gf), "%.2f", r->gflops);
    printf("%-30s %-16s %9.3f %12s %9s %9.2f %8.3f\n", r->name, shp, r->ms, tps, gf, gbps,
           r->ratio_to_limit);
    fflush(stdout);
}

/* Append the record and its two extra fields. Returns 0, or -1 when out of memory. */
static int json_add(lm_bench_json *js, const lm_bench_record *r, double gbps, double bytes) {
    if (!js->root) return 0;
    if (lm_bench_json_add(js, r) != 0) return -1;
    cJSON *o = cJSON_GetArrayItem(js->records, cJSON_GetArraySize(js->records) - 1);
    if (!o || !lm_bench_json_number_or_null_(o, "gb_per_s", gbps) ||
        !lm_bench_json_number_or_null_(o, "bytes", bytes))
        return -1;
    return 0;
}

/* ---------------------------------------------------------------- bandwidth limit */

enum { BW_COPY = 0, BW_ADD = 1, BW_READ = 2, N_BW = 3 };
static const char *const k_bw_names[N_BW] = {"copy_256MiB", "add_256MiB", "read_256MiB"};

typedef struct {
    float *x, *y;
    int64_t n;
    int kind;
    volatile float sink;
} bw_ctx;

static int bw_run(void *ctx) {
    bw_ctx *b = (bw_ctx *)ctx;
    float *restrict y = b->y;
    const float *restrict x = b->x;
    const int64_t n = b->n;
    if (b->kind == BW_COPY) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) y[i] = x[i];
    } else if (b->kind == BW_ADD) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) y[i] += x[i];
    } else {
        /* 64 partial sums per thread (4 vector accumulators): not add-latency bound */
        float s = 0.0f;
        const int64_t nb = n / 64; /* n is a multiple of 64 */
#pragma omp parallel
        {
            float acc[64];
            for (int j = 0; j < 64; j++) acc[j] = 0.0f;
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < nb; blk++) {
                const float *restrict xb = x + blk * 64;
#pragma omp simd
                for (int j = 0; j < 64; j++) acc[j] += xb[j];
            }
            float t = 0.0f;
            for (int j = 0; j < 64; j++) t += acc[j];
#pragma omp atomic
            s += t;
        }
        b->sink = s;
    }
    return 0;
}

/* Measures copy, add and read; fills gbps[N_BW] and returns the copy GB/s (the
 * limit), or a negative value when out of memory. */
static double measure_bandwidth(int repeat, double gbps[N_BW], double ms[N_BW]) {
    bw_ctx b;
    memset(&b, 0, sizeof(b));
    b.n = BW_N;
    b.x = (float *)malloc((size_t)b.n * sizeof(float));
    b.y = (float *)malloc((size_t)b.n * sizeof(float));
    if (!b.x || !b.y) {
        free(b.x);
        free(b.y);
        return -1;
    }
    /* first touch in the same static split the kernels use */
    float *restrict x = b.x, *restrict y = b.y;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < b.n; i++) {
        x[i] = 1e-3f * (float)(i & 1023);
        y[i] = 0.0f;
    }
    const double moved[N_BW] = {2.0, 3.0, 1.0}; /* arrays of n floats moved per call */
    for (int k = 0; k < N_BW; k++) {
        b.kind = k;
        lm_bench_timing t = lm_bench_time(bw_run, &b, 1, repeat);
        ms[k] = t.median_ms;
        gbps[k] = moved[k] * (double)b.n * sizeof(float) / (t.median_ms * 1e-3) / 1e9;
    }
    free(b.x);
    free(b.y);
    return gbps[BW_COPY];
}

/* ---------------------------------------------------------------- the op */

typedef struct {
    lm_attnres_config c;
    const float *const *src;
    float *const *dsrc;
    const float *query, *rms_weight, *do_;
    float *o, *dquery, *drms_weight;
    int backward;
    lm_error err;
} ar_case;

static int ar_run(void *ctx) {
    ar_case *a = (ar_case *)ctx;
    lm_status st;
    if (a->backward)
        st = lm_attnres_backward_ptrs(&a->c, a->src, a->query, a->rms_weight, a->do_, a->dsrc,
                                      a->dquery, a->drms_weight, &a->err);
    else
        st = lm_attnres_forward_ptrs(&a->c, a->src, a->query, a->rms_weight, a->o, &a->err);
    return st == LM_OK ? 0 : -1;
}

typedef struct {
    int D;
    float *src[AR_LMAX], *dsrc[AR_LMAX];
    float *query, *rms_weight, *do_, *o, *dquery, *drms_weight;
} ar_bufs;

static void bufs_free(ar_bufs *b) {
    for (int m = 0; m < AR_LMAX; m++) {
        free(b->src[m]);
        free(b->dsrc[m]);
    }
    free(b->query), free(b->rms_weight), free(b->do_), free(b->o), free(b->dquery),
        free(b->drms_weight);
    memset(b, 0, sizeof(*b));
}

static void fill_normal(float *x, int64_t n, double mean, double sd, lm_rng *r) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(mean + sd * lm_rng_normal(r));
}

static int bufs_init(ar_bufs *b, int D, uint64_t seed) {
    memset(b, 0, sizeof(*b));
    b->D = D;
    const int64_t nd = (int64_t)AR_N * D;
    const size_t bytes = (size_t)nd * sizeof(float);
    int ok = 1;
    for (int m = 0; m < AR_LMAX && ok; m++) {
        b->src[m] = (float *)malloc(bytes);
        b->dsrc[m] = (float *)calloc((size_t)nd, sizeof(float));
        ok = b->src[m] && b->dsrc[m];
    }
    b->query = (float *)malloc((size_t)D * sizeof(float));
    b->rms_weight = (float *)malloc((size_t)D * sizeof(float));
    b->dquery = (float *)calloc((size_t)D, sizeof(float));
    b->drms_weight = (float *)calloc((size_t)D, sizeof(float));
    b->do_ = (float *)malloc(bytes);
    b->o = (float *)calloc((size_t)nd, sizeof(float));
    if (!ok || !b->query || !b->rms_weight || !b->dquery || !b->drms_weight || !b->do_ || !b->o) {
        bufs_free(b);
        return -1;
    }
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int m = 0; m < AR_LMAX; m++) fill_normal(b->src[m], nd, 0.0, 1.0, &r);
    fill_normal(b->do_, nd, 0.0, 1.0, &r);
    fill_normal(b->query, D, 0.0, 1.0 / sqrt((double)D), &r);
    fill_normal(b->rms_weight, D, 1.0, 0.1, &r);
    return 0;
}

static int64_t count_nonfinite(const float *x, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !isfinite(x[i]);
    return bad;
}

/* ---------------------------------------------------------------- main */

int lm_bench_attnres(const lm_bench_opts *opts) {
    const int threads = opts->threads > 0 ? opts->threads : 1;
    const int warmup = 1, repeat_bw = 5, repeat = opts->quick ? 2 : 5;
    lm_set_num_threads(threads);
    lm_blas_set_threads(threads);

    lm_bench_json js = {NULL, NULL};
    if (opts->json_path && lm_bench_json_check_path(opts->json_path) != 0) return 1;
    if (opts->json_path && lm_bench_json_init(&js, "attnres", threads) != 0) {
        fprintf(stderr, "linmoe bench attnres: out of memory\n");
        return 1;
    }
    const double load0 = lm_bench_loadavg1();
    printf("linmoe bench attnres: threads=%d, warmup=%d, repeat=%d (bandwidth %d)%s, load "
           "average %.2f\n",
           threads, warmup, repeat, repeat_bw, opts->quick ? ", quick" : "", load0);
    table_header();

    double bw[N_BW], bw_ms[N_BW];
    const double limit = measure_bandwidth(repeat_bw, bw, bw_ms);
    if (limit <= 0 || !isfinite(limit)) {
        fprintf(stderr, "linmoe bench attnres: the copy bandwidth could not be measured (out of "
                        "memory for 2 x 256 MiB)\n");
        lm_bench_json_free(&js);
        return 1;
    }
    int rc = 0;
    lm_bench_record rec;
    for (int k = 0; k < N_BW && rc == 0; k++) {
        const int64_t shape[1] = {BW_N};
        lm_bench_record_init(&rec, k_bw_names[k], 1, shape);
        rec.ms = bw_ms[k];
        rec.ratio_to_limit = bw[k] / limit;
        table_row(&rec, bw[k]);
        const double bytes = (k == BW_COPY ? 2.0 : k == BW_ADD ? 3.0 : 1.0) * BW_N * sizeof(float);
        if (json_add(&js, &rec, bw[k], bytes) != 0) rc = 1;
    }

    lm_attnres_workspace *ws = lm_attnres_workspace_new();
    if (!ws) rc = 1;
    for (int di = 0; di < N_D && rc == 0; di++) {
        const int D = k_D[di];
        ar_bufs b;
        if (bufs_init(&b, D, 3000 + (uint64_t)di) != 0) {
            fprintf(stderr,
                    "linmoe bench attnres: out of memory allocating %d sources of [%d,%d] and "
                    "their gradients\n",
                    AR_LMAX, AR_N, D);
            rc = 1;
            break;
        }
        const int64_t nd = (int64_t)AR_N * D;
        for (int li = 0; li < N_L && rc == 0; li++) {
            const int L = k_L[li];
            for (int bwd = 0; bwd < 2 && rc == 0; bwd++) {
                ar_case a;
                memset(&a, 0, sizeof(a));
                lm_attnres_config_default(&a.c, L, AR_N, D);
                a.c.accumulate = 1;
                a.c.trusted_inputs = 1;
                a.c.ws = ws;
                a.src = (const float *const *)b.src;
                a.dsrc = b.dsrc;
                a.query = b.query;
                a.rms_weight = b.rms_weight;
                a.do_ = b.do_;
                a.o = b.o;
                a.dquery = b.dquery;
                a.drms_weight = b.drms_weight;
                a.backward = bwd;
                lm_set_num_threads(threads);
                lm_bench_timing t = lm_bench_time(ar_run, &a, warmup, repeat);
                char name[96];
                snprintf(name, sizeof(name), "attnres_%s_L%d_D%d", bwd ? "bwd" : "fwd", L, D);
                if (t.failed) {
                    fprintf(stderr, "linmoe bench attnres: %s: %s\n", name, a.err.msg);
                    rc = 1;
                    break;
                }
                int64_t bad = bwd ? count_nonfinite(b.dsrc[0], nd) +
                                        count_nonfinite(b.dsrc[L - 1], nd) +
                                        count_nonfinite(b.dquery, D) +
                                        count_nonfinite(b.drms_weight, D)
                                  : count_nonfinite(b.o, nd);
                if (bad) {
                    fprintf(stderr, "linmoe bench attnres: %s: %lld non-finite output values\n",
                            name, (long long)bad);
                    rc = 1;
                    break;
                }
                const double elems = (double)L * nd;
                const double bytes =
                    sizeof(float) * (bwd ? 3.0 * elems + (double)nd : elems + (double)nd);
                const double flop = (bwd ? 14.0 : 6.0) * elems;
                const double sec = t.median_ms * 1e-3;
                const int64_t shape[3] = {L, AR_N, D};
                lm_bench_record_init(&rec, name, 3, shape);
                rec.ms = t.median_ms;
                rec.tokens_per_s = AR_N / sec;
                rec.gflops = flop / sec / 1e9;
                const double gbps = bytes / sec / 1e9;
                rec.ratio_to_limit = gbps / limit;
                table_row(&rec, gbps);
                if (json_add(&js, &rec, gbps, bytes) != 0) rc = 1;
            }
        }
        bufs_free(&b);
    }
    lm_attnres_workspace_free(ws);

    const double load1 = lm_bench_loadavg1();
    printf("shape = [L, N, D]; limit = GB/s over the copy rate (%.2f GB/s, same threads); FLOPs "
           "pinned: fwd 6, bwd 14 per source element; load average at the end %.2f\n",
           limit, load1);
    if (rc == 0 && js.root) {
        if (!lm_bench_json_number_or_null_(js.root, "copy_gb_per_s", limit) ||
            !lm_bench_json_number_or_null_(js.root, "loadavg_start", load0) ||
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
