/* `linmoe bench ops` family "attnres": the AttnRes aggregation op on CUDA
 * (include/linmoe/cuda_attnres.h) at the GPU configs' shapes: N = 32768 tokens, D = 2048
 * and 1024, L = 9 sources (embedding + 7 completed block sums + the running partial),
 * each source its own [N, D] bf16 tensor (the pointer-table entry points the model uses).
 * Inputs: sources ~ N(0, 1), query ~ N(0, (2/sqrt(D))^2) (logits of order 1-2, so every
 * key-gradient term is live), rms_weight ~ 1 + 0.1 N(0, 1), do ~ N(0, 1).
 *
 * Rows (peer: scripts/gpu/ops_peers/attnres.py, fla's fused_attnres and plain PyTorch):
 *   attnres          fwd      o only (no depth weights)
 *   attnres          fwd+bwd  forward, then the backward with accumulate = 0 and bf16
 *                             dsrc (fla's contract: gradients written, not added)
 *   attnres_acc      fwd+bwd  the backward with accumulate = 1 into bf16 dsrc (the model's
 *                             reverse sweep)
 *   attnres_acc_f32  fwd+bwd  accumulate = 1 into fp32 dsrc
 * Bytes that must move (s = bytes of a dsrc element):
 *   fwd       (L + 1) N D 2                      L sources read, o written
 *   bwd       (L + 1) N D 2 + L N D s            sources + do read, dsrc written
 *             + L N D s with accumulate          (dsrc read too)
 *   fwd+bwd   the sum; the [D] parameter vectors and the du partials are left out
 *             (< 0.2 % here).
 * FLOPs per source element (as bench/bench_attnres.c): forward 6 (sum of squares 2,
 * <u, C> 2, o += p C 2), backward 14 (three dot products 6, dC = p do + b u - e C 6,
 * du += b C 2); bytes dominate by far. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_attnres.h"

#define AR_L 9
#define AR_N 32768

typedef struct {
    lm_bench_ops_env *env;
    lm_attnres_config cfg;
    const void *src[AR_L];
    void *dsrc[AR_L];
    float *q, *g, *dq, *dg;
    void *o, *dout;
    lm_dtype gt;
    int backward;
} ar_bench;

static int ar_run(void *arg) {
    ar_bench *b = arg;
    lm_error e = {0};
    lm_status st =
        lm_cuda_attnres_forward_ptrs(b->env->ctx, &b->cfg, b->src, b->q, b->g, b->o, NULL, &e);
    if (st == LM_OK && b->backward)
        st = lm_cuda_attnres_backward_ptrs(b->env->ctx, &b->cfg, b->src, b->q, b->g, b->dout,
                                           b->dsrc, b->gt, b->dq, b->dg, &e);
    if (st != LM_OK) {
        fprintf(stderr, "bench ops attnres: %s\n", e.msg);
        return 1;
    }
    return 0;
}

static int bench_shape(lm_bench_ops_env *env, int D) {
    lm_error e = {0};
    const int L = AR_L;
    const int64_t N = AR_N, nd = N * D;
    ar_bench b;
    memset(&b, 0, sizeof b);
    b.env = env;
    lm_attnres_config_default(&b.cfg, L, N, D);
    b.cfg.trusted_inputs = 1;
    int rc = 1;
    void *dsrc_blk = NULL; /* fp32-sized: serves the bf16 rows too */
    void *src_blk = NULL;
    if (lm_cuda_ctx_alloc(env->ctx, &src_blk, (size_t)(L * nd) * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &dsrc_blk, (size_t)(L * nd) * 4, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &b.o, (size_t)nd * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &b.dout, (size_t)nd * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.q, (size_t)D * 4, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.g, (size_t)D * 4, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.dq, (size_t)D * 4, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.dg, (size_t)D * 4, &e) != LM_OK)
        goto out;
    for (int m = 0; m < L; m++) {
        b.src[m] = (const char *)src_blk + (size_t)m * (size_t)nd * 2;
        if (lm_cuda_fill_normal_bf16(env->ctx, (void *)b.src[m], nd, 100 + (uint64_t)m, 0.0f, 1.0f,
                                     &e) != LM_OK)
            goto out;
    }
    if (lm_cuda_fill_normal_bf16(env->ctx, b.dout, nd, 7, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, b.q, D, 8, 0.0f, 2.0f / sqrtf((float)D), &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, b.g, D, 9, 1.0f, 0.1f, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, dsrc_blk, 0, (size_t)(L * nd) * 4, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, b.dq, 0, (size_t)D * 4, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, b.dg, 0, (size_t)D * 4, &e) != LM_OK)
        goto out;

    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld D=%d L=%d", (long long)N, D, L);
    const double src_b = (double)L * (double)nd * 2, row_b = (double)nd * 2;
    const double el = (double)L * (double)nd;
    const double fwd_bytes = src_b + row_b;
    struct {
        const char *name, *pass;
        int backward, accumulate;
        lm_dtype gt;
    } rows[] = {
        {"attnres", "fwd", 0, 0, LM_BF16},
        {"attnres", "fwd+bwd", 1, 0, LM_BF16},
        {"attnres_acc", "fwd+bwd", 1, 1, LM_BF16},
        {"attnres_acc_f32", "fwd+bwd", 1, 1, LM_F32},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        b.backward = rows[i].backward;
        b.cfg.accumulate = rows[i].accumulate;
        b.gt = rows[i].gt;
        const size_t gs = rows[i].gt == LM_F32 ? 4 : 2;
        for (int m = 0; m < L; m++)
            b.dsrc[m] = (char *)dsrc_blk + (size_t)m * (size_t)nd * gs;
        const double ms = lm_bench_ops_time(env, ar_run, &b);
        if (ms < 0)
            goto out;
        double bytes = fwd_bytes, flops = 6.0 * el;
        if (rows[i].backward) {
            const double gb = el * (double)gs;
            bytes += src_b + row_b + gb * (rows[i].accumulate ? 2.0 : 1.0);
            flops += 14.0 * el;
        }
        lm_bench_ops_row(env, rows[i].name, shape, rows[i].pass, ms, flops, bytes, (double)N);
    }
    rc = 0;
out:
    if (rc && e.msg[0])
        fprintf(stderr, "bench ops attnres: %s\n", e.msg);
    lm_cuda_ctx_free_mem(env->ctx, src_blk);
    lm_cuda_ctx_free_mem(env->ctx, dsrc_blk);
    lm_cuda_ctx_free_mem(env->ctx, b.o);
    lm_cuda_ctx_free_mem(env->ctx, b.dout);
    lm_cuda_ctx_free_mem(env->ctx, b.q);
    lm_cuda_ctx_free_mem(env->ctx, b.g);
    lm_cuda_ctx_free_mem(env->ctx, b.dq);
    lm_cuda_ctx_free_mem(env->ctx, b.dg);
    return rc;
}

int lm_bench_ops_attnres(lm_bench_ops_env *env) {
    int rc = bench_shape(env, 2048);
    rc |= bench_shape(env, 1024);
    return rc;
}
