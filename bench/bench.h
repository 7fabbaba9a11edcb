/* linmoe benchmark harness: warm up, repeat, take the median; print a table row per
 * measurement and collect JSON records
 *   {name, shape, ms, tokens_per_s, gflops, ratio_to_limit, ratio_to_peer}
 * (CONVENTIONS.md "Benchmarks") under a top-level object {bench, threads, date, records}.
 *
 * Header-only (static inline) so that every bench source shares it without another
 * translation unit. What it does not do: measure anything by itself (each bench
 * measures its own limit, e.g. sgemm on the same threads), or pick threads.
 */
#ifndef LINMOE_BENCH_H
#define LINMOE_BENCH_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "linmoe/core.h"

/* Options every `linmoe bench TARGET` takes (parsed by tools/linmoe.c). */
typedef struct {
    int threads;             /* > 0; the CLI defaults it to the number of cores */
    int quick;               /* fewer repeats (smoke runs) */
    const char *json_path;   /* NULL: no JSON file */
    const char *config_path; /* bench model: the model config (NULL: configs/bench-cpu.json,
                                searched upward from the working directory and the binary) */
    int no_peer;             /* bench model: skip the PyTorch reference step */
    int recompute;           /* bench model --device cuda: activation recompute on every layer */
} lm_bench_opts;

/* `linmoe bench kda` (bench/bench_kda.c). Returns an exit code (0 ok, 1 failure). */
int lm_bench_kda(const lm_bench_opts *opts);
/* `linmoe bench kda --device cuda` (bench/bench_kda_cuda.c): the CUDA KDA forward,
 * training forward, forward+backward and decode step against the GPU's bf16 GEMM rate
 * and copy bandwidth measured in the same run (include/linmoe/cuda_bench.h). Exit code
 * as above; 1 with a message when there is no CUDA build or no GPU. opts->threads is
 * only recorded. */
int lm_bench_kda_cuda(const lm_bench_opts *opts);
/* `linmoe bench moe` (bench/bench_moe.c). Returns an exit code (0 ok, 1 failure). */
int lm_bench_moe(const lm_bench_opts *opts);
/* `linmoe bench attnres` (bench/bench_attnres.c): the AttnRes aggregation forward and
 * backward against the copy bandwidth measured in the same run. Exit code as above. */
int lm_bench_attnres(const lm_bench_opts *opts);
/* `linmoe bench model` (bench/bench_model.c): one training step (forward with labels
 * + backward) of a model config against the sgemm limit and, when a Python with torch
 * is found, the PyTorch reference step. Exit code as above. */
int lm_bench_model(const lm_bench_opts *opts);
/* `linmoe bench model --device cuda` (bench/bench_model_gpu.c): one training step of the
 * GPU model (default config configs/gpu-dense.json), its MFU against the bf16 matmul rate
 * measured in the same run, peak device memory and each op class's share. Exit code as
 * above. lm_bench_model_gpu_run is the FFI entry (scripts/gpu/bench_model.py). */
int lm_bench_model_gpu(const lm_bench_opts *opts);
int lm_bench_model_gpu_run(const char *config_path, const char *json_path, int quick);
/* The same with activation recompute on every layer when recompute != 0 (gpu_model.h). */
int lm_bench_model_gpu_run_opts(const char *config_path, const char *json_path, int quick,
                                int recompute);

/* The 1-minute load average from /proc/loadavg (NAN when unreadable): printed with the
 * numbers because the machines are shared. */
static inline double lm_bench_loadavg1(void) {
    double l = NAN;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = NAN;
        fclose(f);
    }
    return l;
}

/* ---------------------------------------------------------------- timing */

/* The measured callable: returns 0 on success, non-zero to abort the measurement. */
typedef int (*lm_bench_fn)(void *ctx);

typedef struct {
    double median_ms, min_ms, max_ms;
    int n;      /* timed repeats */
    int failed; /* the callable returned non-zero */
} lm_bench_timing;

static inline int lm_bench_cmp_double_(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of a[0..n) (sorts a in place); NAN when n == 0. */
static inline double lm_bench_median(double *a, int n) {
    if (n <= 0) return NAN;
    qsort(a, (size_t)n, sizeof(double), lm_bench_cmp_double_);
    return (n % 2) ? a[n / 2] : 0.5 * (a[n / 2 - 1] + a[n / 2]);
}

/* Run fn `warmup` times untimed, then `repeat` (>= 1) times timed, one call each. */
static inline lm_bench_timing lm_bench_time(lm_bench_fn fn, void *ctx, int warmup, int repeat) {
    lm_bench_timing t = {NAN, NAN, NAN, 0, 0};
    if (repeat < 1) repeat = 1;
    for (int i = 0; i < warmup; i++)
        if (fn(ctx) != 0) {
            t.failed = 1;
            return t;
        }
    double *ms = (double *)malloc((size_t)repeat * sizeof(double));
    if (!ms) {
        t.failed = 1;
        return t;
    }
    for (int i = 0; i < repeat; i++) {
        double t0 = lm_time_sec();
        int rc = fn(ctx);
        double t1 = lm_time_sec();
        if (rc != 0) {
            t.failed = 1;
            free(ms);
            return t;
        }
        ms[i] = (t1 - t0) * 1e3;
    }
    t.n = repeat;
    t.median_ms = lm_bench_median(ms, repeat); /* sorts */
    t.min_ms = ms[0];
    t.max_ms = ms[repeat - 1];
    free(ms);
    return t;
}

/* ---------------------------------------------------------------- records */

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[LM_MAX_DIMS];
    double ms;             /* median wall time of one call */
    double tokens_per_s;   /* NAN: not applicable (written as null) */
    double gflops;         /* 1e9 FLOP/s by the pinned FLOP count */
    double ratio_to_limit; /* gflops / limit gflops */
    double ratio_to_peer;  /* NAN: no peer measured in this run (null) */
} lm_bench_record;

static inline void lm_bench_record_init(lm_bench_record *r, const char *name, int ndim,
                                        const int64_t *shape) {
    memset(r, 0, sizeof(*r));
    snprintf(r->name, sizeof(r->name), "%s", name);
    r->ndim = ndim < 0 ? 0 : (ndim > LM_MAX_DIMS ? LM_MAX_DIMS : ndim);
    for (int i = 0; i < r->ndim; i++) r->shape[i] = shape[i];
    r->ms = r->tokens_per_s = r->gflops = r->ratio_to_limit = r->ratio_to_peer = NAN;
}

/* ---------------------------------------------------------------- table */

static inline void lm_bench_table_header(FILE *f) {
    fprintf(f, "%-34s %-20s %10s %13s %9s %8s\n", "name", "shape", "ms", "tokens/s", "GFLOP/s",
            "limit");
    fprintf(f, "%-34s %-20s %10s %13s %9s %8s\n", "----", "-----", "--", "--------", "-------",
            "-----");
}

static inline void lm_bench_fmt_shape(char *buf, size_t size, int ndim, const int64_t *shape) {
    size_t used = 0;
    int n = snprintf(buf, size, "[");
    used = n > 0 ? (size_t)n : 0;
    for (int i = 0; i < ndim && used < size; i++) {
        n = snprintf(buf + used, size - used, "%s%lld", i ? "," : "", (long long)shape[i]);
        if (n < 0) break;
        used += (size_t)n;
    }
    if (used < size) snprintf(buf + used, size - used, "]");
}

static inline void lm_bench_table_row(FILE *f, const lm_bench_record *r) {
    char shp[64], tps[32];
    lm_bench_fmt_shape(shp, sizeof(shp), r->ndim, r->shape);
    if (isnan(r->tokens_per_s))
        snprintf(tps, sizeof(tps), "-");
    else
        snprintf(tps, sizeof(tps), "%.0f", r->tokens_per_s);
    fprintf(f, "%-34s %-20s %10.3f %13s %9.2f %8.3f\n", r->name, shp, r->ms, tps, r->gflops,
            r->ratio_to_limit);
    fflush(f);
}

/* ---------------------------------------------------------------- the sgemm limit */

typedef struct {
    int n;
    float *A, *B, *C;
} lm_bench_sgemm_ctx_;

static inline int lm_bench_sgemm_run_(void *ctx) {
    lm_bench_sgemm_ctx_ *s = (lm_bench_sgemm_ctx_ *)ctx;
    lm_sgemm(0, 0, s->n, s->n, s->n, 1.0f, s->A, s->n, s->B, s->n, 0.0f, s->C, s->n);
    return 0;
}

/* The limit: OpenBLAS sgemm n x n x n (n = 2048) on `threads` BLAS threads, median
 * of `repeat` after one warmup. Fills `rec` ("sgemm_2048", ratio 1) and returns the
 * GFLOP/s, or a negative value when out of memory. Then sleeps 0.3 s so that
 * OpenBLAS's worker threads stop spinning before the next measurement. */
static inline double lm_bench_sgemm_limit(int threads, int repeat, lm_bench_record *rec) {
    lm_bench_sgemm_ctx_ s = {2048, NULL, NULL, NULL};
    const size_t nn = (size_t)s.n * s.n;
    s.A = (float *)malloc(nn * sizeof(float));
    s.B = (float *)malloc(nn * sizeof(float));
    s.C = (float *)malloc(nn * sizeof(float));
    double gflops = -1;
    if (s.A && s.B && s.C) {
        lm_rng r;
        lm_rng_init(&r, 12345);
        for (size_t i = 0; i < nn; i++) s.A[i] = (float)lm_rng_normal(&r);
        for (size_t i = 0; i < nn; i++) s.B[i] = (float)lm_rng_normal(&r);
        lm_blas_set_threads(threads);
        lm_bench_timing t = lm_bench_time(lm_bench_sgemm_run_, &s, 1, repeat);
        gflops = 2.0 * s.n * (double)s.n * s.n / (t.median_ms * 1e-3) / 1e9;
        int64_t shape[3] = {s.n, s.n, s.n};
        lm_bench_record_init(rec, "sgemm_2048", 3, shape);
        rec->ms = t.median_ms;
        rec->gflops = gflops;
        rec->ratio_to_limit = 1.0;
    }
    free(s.A);
    free(s.B);
    free(s.C);
    struct timespec nap = {0, 300000000L};
    nanosleep(&nap, NULL);
    return gflops;
}

/* ---------------------------------------------------------------- JSON */

typedef struct {
    cJSON *root;    /* {bench, threads, date, records: [...]} */
    cJSON *records; /* owned by root */
} lm_bench_json;

/* ISO-8601 UTC time of now, e.g. "2025-01-31T12:00:00Z". */
static inline void lm_bench_date(char *buf, size_t size) {
    time_t now = time(NULL);
    struct tm tmv;
    if (gmtime_r(&now, &tmv) == NULL || strftime(buf, size, "%Y-%m-%dT%H:%M:%SZ", &tmv) == 0)
        snprintf(buf, size, "unknown");
}

/* Returns 0 on success, -1 when out of memory. */
static inline int lm_bench_json_init(lm_bench_json *j, const char *bench, int threads) {
    char date[64];
    lm_bench_date(date, sizeof(date));
    j->root = cJSON_CreateObject();
    j->records = NULL;
    if (!j->root) return -1;
    if (!cJSON_AddStringToObject(j->root, "bench", bench) ||
        !cJSON_AddNumberToObject(j->root, "threads", threads) ||
        !cJSON_AddStringToObject(j->root, "date", date) ||
        !(j->records = cJSON_AddArrayToObject(j->root, "records"))) {
        cJSON_Delete(j->root);
        j->root = NULL;
        return -1;
    }
    return 0;
}

static inline cJSON *lm_bench_json_number_or_null_(cJSON *obj, const char *key, double v) {
    if (isnan(v) || isinf(v)) return cJSON_AddNullToObject(obj, key);
    return cJSON_AddNumberToObject(obj, key, v);
}

/* Returns 0 on success, -1 when out of memory. */
static inline int lm_bench_json_add(lm_bench_json *j, const lm_bench_record *r) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return -1;
    int ok = cJSON_AddStringToObject(o, "name", r->name) != NULL;
    cJSON *shape = ok ? cJSON_AddArrayToObject(o, "shape") : NULL;
    ok = ok && shape != NULL;
    for (int i = 0; ok && i < r->ndim; i++) {
        cJSON *d = cJSON_CreateNumber((double)r->shape[i]);
        ok = d != NULL && cJSON_AddItemToArray(shape, d);
        if (!ok) cJSON_Delete(d); /* NULL-safe */
    }
    ok = ok && lm_bench_json_number_or_null_(o, "ms", r->ms) &&
         lm_bench_json_number_or_null_(o, "tokens_per_s", r->tokens_per_s) &&
         lm_bench_json_number_or_null_(o, "gflops", r->gflops) &&
         lm_bench_json_number_or_null_(o, "ratio_to_limit", r->ratio_to_limit) &&
         lm_bench_json_number_or_null_(o, "ratio_to_peer", r->ratio_to_peer);
    if (!ok || !cJSON_AddItemToArray(j->records, o)) {
        cJSON_Delete(o);
        return -1;
    }
    return 0;
}

/* Write the JSON to `path` via "<path>.tmp.<pid>" + rename, so a failed run never
 * leaves a half-written file. Returns 0 on success, -1 (with a message on stderr). */
static inline int lm_bench_json_save(const lm_bench_json *j, const char *path) {
    char *text = cJSON_Print(j->root);
    if (!text) {
        fprintf(stderr, "%s: out of memory printing JSON\n", path);
        return -1;
    }
    size_t plen = strlen(path) + 32;
    char *tmp = (char *)malloc(plen);
    if (!tmp) {
        free(text);
        fprintf(stderr, "%s: out of memory\n", path);
        return -1;
    }
    snprintf(tmp, plen, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    int ok = f != NULL;
    if (ok) {
        size_t n = strlen(text);
        ok = fwrite(text, 1, n, f) == n && fputc('\n', f) != EOF;
        ok = (fclose(f) == 0) && ok;
    }
    ok = ok && rename(tmp, path) == 0;
    if (!ok) {
        perror(path);
        remove(tmp);
    }
    free(tmp);
    free(text);
    return ok ? 0 : -1;
}

/* Before a long run: can `path` be created (its directory exists and is writable)?
 * Returns 0, or -1 with a message on stderr. */
static inline int lm_bench_json_check_path(const char *path) {
    size_t n = strlen(path);
    char *dir = (char *)malloc(n + 2);
    if (!dir) return -1;
    memcpy(dir, path, n + 1);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, n + 2, ".");
    else if (slash == dir) dir[1] = '\0';
    else *slash = '\0';
    int ok = 1;
    if (n == 0) {
        fprintf(stderr, "linmoe bench: --json needs a file name\n");
        ok = 0;
    } else if (path[n - 1] == '/') {
        fprintf(stderr, "linmoe bench: --json '%s' names a directory, not a file\n", path);
        ok = 0;
    } else if (access(dir, W_OK | X_OK) != 0) {
        fprintf(stderr, "linmoe bench: --json '%s': directory '%s' does not exist or is not writable\n",
                path, dir);
        ok = 0;
    }
    free(dir);
    return ok ? 0 : -1;
}

static inline void lm_bench_json_free(lm_bench_json *j) {
    cJSON_Delete(j->root);
    j->root = j->records = NULL;
}

#endif
