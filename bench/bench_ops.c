/* `linmoe bench ops --device cuda` (bench/bench_ops.h). */
#include "bench_ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "linmoe/kda_cuda.h"

#define OPS_FAMILIES(X) \
    X(embedding) X(norm) X(swiglu) X(short_conv) X(gemm) X(attention) X(router) X(moe) \
        X(attnres) X(cross_entropy) X(adamw)

#define DECL(n) int lm_bench_ops_##n(lm_bench_ops_env *env) __attribute__((weak));
OPS_FAMILIES(DECL)
#undef DECL

double lm_bench_ops_time(lm_bench_ops_env *env, lm_bench_ops_fn fn, void *arg) {
    lm_error e = {0};
    /* warm up for at least env->warmup calls and LM_BENCH_OPS_WARMUP_MS of GPU time, so that
     * the clocks have left their idle state (an idle H200 reports a 345 MHz SM clock) */
    double warm_ms = 0;
    for (int i = 0; i < env->warmup || warm_ms < LM_BENCH_OPS_WARMUP_MS; i++) {
        double t = 0;
        if (lm_cuda_timer_start(env->timer, &e) != LM_OK || fn(arg) ||
            lm_cuda_timer_stop(env->timer, &t, &e) != LM_OK) {
            if (e.msg[0])
                fprintf(stderr, "bench ops: %s\n", e.msg);
            return -1;
        }
        warm_ms += t;
        if (i >= 100000)
            break;
    }
    double *ms = LM_MALLOC(sizeof(double) * (size_t)env->repeat);
    for (int i = 0; i < env->repeat; i++) {
        if ((env->flush &&
             lm_cuda_ctx_memset(env->ctx, env->flush, 0, LM_BENCH_OPS_FLUSH_BYTES, &e) != LM_OK) ||
            lm_cuda_timer_start(env->timer, &e) != LM_OK || fn(arg) ||
            lm_cuda_timer_stop(env->timer, &ms[i], &e) != LM_OK) {
            if (e.msg[0])
                fprintf(stderr, "bench ops: %s\n", e.msg);
            free(ms);
            return -1;
        }
    }
    qsort(ms, (size_t)env->repeat, sizeof(double), lm_bench_cmp_double_);
    const int n = env->repeat;
    const double m = (n % 2) ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
    free(ms);
    return m;
}

void lm_bench_ops_row(lm_bench_ops_env *env, const char *op, const char *shape, const char *pass,
                      double ms, double flops, double bytes, double tokens) {
    const double s = ms * 1e-3;
    const double tf = flops > 0 ? flops / s / 1e12 : 0, gbs = bytes > 0 ? bytes / s / 1e9 : 0;
    const double fl_ms = flops / (env->lim.bf16_tflops * 1e12) * 1e3;
    const double by_ms = bytes / (env->lim.copy_gbs * 1e9) * 1e3;
    const double floor_ms = fl_ms > by_ms ? fl_ms : by_ms;
    const double ratio = ms > 0 ? floor_ms / ms : 0;
    printf(
        "%-22s %-32s %-8s %9.4f ms %8.1f TFLOP/s %8.0f GB/s  floor %8.4f ms (%s)  %5.2f of limit\n",
        op, shape, pass, ms, tf, gbs, floor_ms, fl_ms > by_ms ? "flops" : "bytes", ratio);
    fflush(stdout);
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "name", op);
    cJSON_AddStringToObject(r, "family", env->family ? env->family : "");
    cJSON_AddStringToObject(r, "shape", shape);
    cJSON_AddStringToObject(r, "pass", pass);
    cJSON_AddNumberToObject(r, "ms", ms);
    cJSON_AddNumberToObject(r, "tflops", tf);
    cJSON_AddNumberToObject(r, "gbs", gbs);
    cJSON_AddNumberToObject(r, "floor_ms", floor_ms);
    cJSON_AddStringToObject(r, "floor_by", fl_ms > by_ms ? "flops" : "bytes");
    cJSON_AddNumberToObject(r, "ratio_to_limit", ratio);
    cJSON_AddNumberToObject(r, "tokens", tokens);
    cJSON_AddNumberToObject(r, "tokens_per_s", tokens > 0 ? tokens / s : 0);
    cJSON_AddItemToArray(env->records, r);
}

static int wanted(const char *list, const char *name) {
    if (!list || !*list)
        return 1;
    const size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *c = strchr(p, ',');
        const size_t len = c ? (size_t)(c - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0)
            return 1;
        if (!c)
            break;
        p = c + 1;
    }
    return 0;
}

int lm_bench_ops_run(const char *families, const char *json_path, int quick) {
    lm_error e = {0};
    lm_bench_ops_env env = {0};
    env.quick = quick;
    env.repeat = quick ? 5 : 20;
    env.warmup = quick ? 2 : 5;
    if (lm_cuda_ctx_new(&env.ctx, 0, &e) != LM_OK ||
        lm_cuda_measure_limits(env.ctx, quick ? 3 : 10, &env.lim, &e) != LM_OK ||
        lm_cuda_timer_new(env.ctx, &env.timer, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env.ctx, &env.flush, LM_BENCH_OPS_FLUSH_BYTES, &e) != LM_OK) {
        fprintf(stderr, "bench ops: %s\n", e.msg);
        lm_cuda_timer_free(env.timer);
        lm_cuda_ctx_free_mem(env.ctx, env.flush);
        lm_cuda_ctx_free(env.ctx);
        return 1;
    }
    char name[128] = "";
    int sms = 0;
    size_t mem = 0;
    lm_cuda_device_info(name, sizeof name, &sms, &mem, &e);
    printf("bench ops on %s (%d SMs): bf16 matmul %.0f TFLOP/s, copy %.0f GB/s (measured now)\n",
           name, sms, env.lim.bf16_tflops, env.lim.copy_gbs);
    env.records = cJSON_CreateArray();
    int rc = 0;
    struct {
        const char *name;
        int (*fn)(lm_bench_ops_env *);
    } fams[] = {
#define ENTRY(n) {#n, lm_bench_ops_##n},
        OPS_FAMILIES(ENTRY)
#undef ENTRY
    };
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) {
        if (!wanted(families, fams[i].name))
            continue;
        if (!fams[i].fn) {
            printf("%-22s not built\n", fams[i].name);
            continue;
        }
        env.family = fams[i].name;
        rc |= fams[i].fn(&env);
    }
    if (json_path) {
        cJSON *doc = cJSON_CreateObject();
        cJSON_AddStringToObject(doc, "bench", "ops");
        cJSON_AddStringToObject(doc, "device", name);
        cJSON_AddNumberToObject(doc, "matmul_tflops", env.lim.bf16_tflops);
        cJSON_AddNumberToObject(doc, "copy_gbs", env.lim.copy_gbs);
        cJSON_AddItemToObject(doc, "records", env.records);
        char *txt = cJSON_Print(doc);
        FILE *f = fopen(json_path, "w");
        if (!f || fputs(txt, f) < 0) {
            fprintf(stderr, "bench ops: cannot write %s\n", json_path);
            rc = 1;
        }
        if (f)
            fclose(f);
        free(txt);
        cJSON_Delete(doc);
    } else {
        cJSON_Delete(env.records);
    }
    lm_cuda_timer_free(env.timer);
    lm_cuda_ctx_free_mem(env.ctx, env.flush);
    lm_cuda_ctx_free(env.ctx);
    return rc;
}
