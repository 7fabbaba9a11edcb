/* `linmoe bench ops` family "gemm" (bench/bench_ops.h): lm_cuda_gemm_ex at the model's
 * projection shapes, 32768 tokens, hidden 1024 and 2048: the forward y = x W^T (weights in
 * torch's [out, in] layout: NT), the input gradient's shape (a [tokens, I] x [I, d]
 * projection) and the weight gradient dW += dY^T X with fp32 C, beta = 1 (TN). Peer:
 * torch.matmul in bf16 (scripts/gpu/ops_peers/gemm.py). */
#include <stdio.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_gemm.h"

typedef struct {
    lm_cuda_ctx *ctx;
    lm_cuda_gemm_desc d;
} gemm_arg;

static int gemm_fn(void *p) {
    gemm_arg *a = p;
    lm_error e = {0};
    if (lm_cuda_gemm_ex(a->ctx, &a->d, &e) != LM_OK) {
        fprintf(stderr, "bench gemm: %s\n", e.msg);
        return 1;
    }
    return 0;
}

typedef struct {
    const char *name;
    int ta, tb, M, N, K, f32_acc;
} gemm_shape;

static int bench_one(lm_bench_ops_env *env, const gemm_shape *s) {
    lm_error e = {0};
    const int64_t na = (int64_t)s->M * s->K, nb = (int64_t)s->K * s->N, nc = (int64_t)s->M * s->N;
    const size_t cb = s->f32_acc ? 4 : 2;
    void *A = NULL, *B = NULL, *C = NULL;
    int rc = 1;
    if (lm_cuda_ctx_alloc(env->ctx, &A, (size_t)na * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &B, (size_t)nb * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &C, (size_t)nc * cb, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, A, na, 1, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, B, nb, 2, 0.0f, 0.03f, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, C, 0, (size_t)nc * cb, &e) != LM_OK) {
        fprintf(stderr, "bench gemm: %s\n", e.msg);
        goto done;
    }
    gemm_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = env->ctx;
    a.d.trans_a = s->ta, a.d.trans_b = s->tb, a.d.M = s->M, a.d.N = s->N, a.d.K = s->K;
    a.d.alpha = 1.0f, a.d.beta = s->f32_acc ? 1.0f : 0.0f;
    a.d.A = A, a.d.lda = s->ta ? s->M : s->K;
    a.d.B = B, a.d.ldb = s->tb ? s->K : s->N;
    a.d.C = C, a.d.ldc = s->N;
    a.d.c_type = s->f32_acc ? LM_CUDA_GEMM_F32 : LM_CUDA_GEMM_BF16;
    a.d.batch = 1;
    const double ms = lm_bench_ops_time(env, gemm_fn, &a);
    if (ms < 0)
        goto done;
    char shape[96];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d %s%s", s->M, s->N, s->K,
             s->ta ? (s->tb ? "TT" : "TN") : (s->tb ? "NT" : "NN"), s->f32_acc ? " f32+=" : "");
    const double bytes = 2.0 * (double)(na + nb) + (s->f32_acc ? 8.0 : 2.0) * (double)nc;
    lm_bench_ops_row(env, s->name, shape, "fwd", ms, 2.0 * s->M * (double)s->N * s->K, bytes,
                     s->f32_acc ? s->K : s->M);
    rc = 0;
done:
    lm_cuda_ctx_free_mem(env->ctx, A);
    lm_cuda_ctx_free_mem(env->ctx, B);
    lm_cuda_ctx_free_mem(env->ctx, C);
    return rc;
}

int lm_bench_ops_gemm(lm_bench_ops_env *env) {
    const int T = 32768;
    const gemm_shape shapes[] = {
        {"gemm", 0, 1, T, 3072, 1024, 0},       {"gemm", 0, 1, T, 1024, 2688, 0},
        {"gemm_wgrad", 1, 0, 3072, 1024, T, 1}, {"gemm_wgrad", 1, 0, 1024, 2688, T, 1},
        {"gemm", 0, 1, T, 6144, 2048, 0},       {"gemm", 0, 1, T, 2048, 5376, 0},
        {"gemm_wgrad", 1, 0, 6144, 2048, T, 1}, {"gemm_wgrad", 1, 0, 2048, 5376, T, 1},
    };
    int rc = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        rc |= bench_one(env, &shapes[i]);
    return rc;
}
