/* `linmoe bench ops` family "cross_entropy" (bench/bench_ops.h): the LM head fused with the
 * chunked cross-entropy (lm_cuda_ce_forward_backward: loss, dh, dW +=; and the eval forward
 * lm_cuda_ce_forward: loss only) at vocabulary 50304 (GPT-2's, padded to 64), hidden 1024
 * and 2048, 32768 tokens. FLOPs: 2 N D V per GEMM, three in the training pass. Peers: fla's
 * FusedLinearCrossEntropyLoss and F.linear + F.cross_entropy with bf16 logits
 * (scripts/gpu/ops_peers/cross_entropy.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_gemm.h"

typedef struct {
    lm_cuda_ctx *ctx;
    lm_cuda_ce_config cfg;
    const void *h, *W;
    const int32_t *labels;
    lm_cuda_ce_outputs out;
    int train;
} ce_arg;

static int ce_fn(void *p) {
    ce_arg *a = p;
    lm_error e = {0};
    lm_status st =
        a->train ? lm_cuda_ce_forward_backward(a->ctx, &a->cfg, a->h, a->W, a->labels, &a->out, &e)
                 : lm_cuda_ce_forward(a->ctx, &a->cfg, a->h, a->W, a->labels, a->out.loss_sum,
                                      a->out.count, NULL, &e);
    if (st != LM_OK) {
        fprintf(stderr, "bench cross_entropy: %s\n", e.msg);
        return 1;
    }
    return 0;
}

static int bench_one(lm_bench_ops_env *env, int N, int D, int V) {
    lm_error e = {0};
    void *h = NULL, *W = NULL, *dh = NULL, *lab = NULL;
    float *dW = NULL, *sc = NULL;
    int32_t *hl = LM_MALLOC(sizeof(int32_t) * (size_t)N);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        hl[i] = (int32_t)((s >> 33) % (uint64_t)V);
    }
    int rc = 1;
    if (lm_cuda_ctx_alloc(env->ctx, &h, (size_t)N * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &W, (size_t)V * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &dh, (size_t)N * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&dW, (size_t)V * D * 4, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &lab, (size_t)N * 4, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&sc, 16, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, h, (int64_t)N * D, 11, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, W, (int64_t)V * D, 12, 0.0f, 0.02f, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, dW, 0, (size_t)V * D * 4, &e) != LM_OK ||
        lm_cuda_ctx_upload(env->ctx, lab, hl, (size_t)N * 4, &e) != LM_OK) {
        fprintf(stderr, "bench cross_entropy: %s\n", e.msg);
        goto done;
    }
    ce_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = env->ctx;
    lm_cuda_ce_config_default(&a.cfg, N, D, V);
    a.h = h, a.W = W, a.labels = lab;
    a.out.loss_sum = sc, a.out.count = (int32_t *)(sc + 1), a.out.dh = dh, a.out.dW = dW;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d D=%d V=%d", N, D, V);
    const double ndv = (double)N * D * V;
    a.train = 1;
    double ms = lm_bench_ops_time(env, ce_fn, &a);
    if (ms < 0)
        goto done;
    lm_bench_ops_row(env, "cross_entropy", shape, "fwd+bwd", ms, 6.0 * ndv,
                     4.0 * N * D + 10.0 * V * D, N);
    a.train = 0;
    ms = lm_bench_ops_time(env, ce_fn, &a);
    if (ms < 0)
        goto done;
    lm_bench_ops_row(env, "cross_entropy", shape, "fwd", ms, 2.0 * ndv, 2.0 * N * D + 2.0 * V * D,
                     N);
    rc = 0;
done:
    free(hl);
    lm_cuda_ctx_free_mem(env->ctx, h);
    lm_cuda_ctx_free_mem(env->ctx, W);
    lm_cuda_ctx_free_mem(env->ctx, dh);
    lm_cuda_ctx_free_mem(env->ctx, dW);
    lm_cuda_ctx_free_mem(env->ctx, lab);
    lm_cuda_ctx_free_mem(env->ctx, sc);
    return rc;
}

int lm_bench_ops_cross_entropy(lm_bench_ops_env *env) {
    int rc = bench_one(env, 32768, 1024, 50304);
    rc |= bench_one(env, 32768, 2048, 50304);
    return rc;
}
