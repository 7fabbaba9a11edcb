/* `linmoe bench ops` family "swiglu" (bench/bench_ops.h): lm_cuda_swiglu_forward /
 * _backward, the element-wise step between the FFN's projections, at the dense FFN of
 * hidden 1024 (N = 32768 tokens, F = 2688) and at an expert's width for top-6 routing
 * (N = 32768 * 6 = 196608 token-slots, F = 512).
 *
 * Rows (name, shape, pass), paired by scripts/gpu/ops_peers/swiglu.py:
 *   swiglu  N=32768 F=2688 | N=196608 F=512   fwd, fwd+bwd
 * Bytes (bf16): forward gu [N, 2F] read, h [N, F] written = 6 N F; backward gu and dh
 * read, dgu written = 10 N F (h not recomputed); fwd+bwd = 16 N F. FLOPs ~ 5 per element
 * forward, 10 backward (the floor is the bytes). Inputs N(0,1) on the device. */
#include <stdio.h>

#include "bench_ops.h"
#include "linmoe/cuda_layers.h"

typedef struct {
    lm_cuda_ctx *ctx;
    int64_t N;
    int F, bwd;
    void *gu, *h, *dh, *dgu;
} sw_arg;

static int sw_run(void *p) {
    sw_arg *a = p;
    lm_error e = {0};
    lm_status st = lm_cuda_swiglu_forward(a->ctx, a->N, a->F, a->gu, a->h, &e);
    if (st == LM_OK && a->bwd)
        st = lm_cuda_swiglu_backward(a->ctx, a->N, a->F, a->gu, a->dh, a->dgu, NULL, &e);
    if (st != LM_OK)
        fprintf(stderr, "bench ops swiglu: %s\n", e.msg);
    return st != LM_OK;
}

int lm_bench_ops_swiglu(lm_bench_ops_env *env) {
    const struct {
        int64_t N;
        int F;
    } shapes[] = {{32768, 2688}, {32768 * 6, 512}};
    int rc = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0] && !rc; s++) {
        sw_arg a = {0};
        a.ctx = env->ctx;
        a.N = shapes[s].N;
        a.F = shapes[s].F;
        const int64_t nf = a.N * a.F;
        lm_error e = {0};
        if (lm_cuda_ctx_alloc(env->ctx, &a.gu, (size_t)nf * 4, &e) != LM_OK ||
            lm_cuda_ctx_alloc(env->ctx, &a.dgu, (size_t)nf * 4, &e) != LM_OK ||
            lm_cuda_ctx_alloc(env->ctx, &a.h, (size_t)nf * 2, &e) != LM_OK ||
            lm_cuda_ctx_alloc(env->ctx, &a.dh, (size_t)nf * 2, &e) != LM_OK ||
            lm_cuda_fill_normal_bf16(env->ctx, a.gu, 2 * nf, 21, 0.0f, 1.0f, &e) != LM_OK ||
            lm_cuda_fill_normal_bf16(env->ctx, a.dh, nf, 22, 0.0f, 1.0f, &e) != LM_OK) {
            fprintf(stderr, "bench ops swiglu: %s\n", e.msg);
            rc = 1;
        }
        char shape[64];
        snprintf(shape, sizeof shape, "N=%lld F=%d", (long long)a.N, a.F);
        for (a.bwd = 0; a.bwd < 2 && !rc; a.bwd++) {
            const double ms = lm_bench_ops_time(env, sw_run, &a);
            if (ms < 0) {
                rc = 1;
                break;
            }
            lm_bench_ops_row(env, "swiglu", shape, a.bwd ? "fwd+bwd" : "fwd", ms,
                             (a.bwd ? 15.0 : 5.0) * nf, (a.bwd ? 16.0 : 6.0) * nf, (double)a.N);
        }
        lm_cuda_ctx_free_mem(env->ctx, a.gu);
        lm_cuda_ctx_free_mem(env->ctx, a.dgu);
        lm_cuda_ctx_free_mem(env->ctx, a.h);
        lm_cuda_ctx_free_mem(env->ctx, a.dh);
    }
    return rc;
}
