/* `linmoe bench ops` family "cross_entropy" (bench/bench_ops.h): the LM head fused with the
 * chunked cross-entropy (lm_cuda_ce_forward_backward: loss, dh, dW +=; and the eval forward
 * lm_cuda_ce_forward: loss only) at vocabulary 50304 (GPT-2's, padded to 64), hidden 1024
 * and 2048, 32768 tokens. FLOPs: 2 N D V per GEMM, three in the training pass.
 *
 * Rows: "cross_entropy" is the default config (what the trainer runs); the
 * "cross_entropy/<variant>" rows time the other configs side by side in the same run
 * (logits dtype, chunk rows, row kernel, dh split: see the table below), so the default can
 * be chosen from one GPU run. "cross_entropy_gemms/nc<Nc>" times the default's three GEMMs
 * alone over the same chunks (fwd: the logits GEMM alone): the difference to the default
 * row is what the row kernel and the chunking cost. Peers: F.linear + F.cross_entropy and
 * fla's FusedLinearCrossEntropyLoss (scripts/gpu/ops_peers/cross_entropy.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_gemm.h"

typedef struct {
    const char *tag; /* NULL: the default config, row "cross_entropy" */
    int logits_bf16, chunk_rows, row_kernel, dh_split;
    int fwd;   /* also time the eval forward (it depends on the logits dtype and Nc only) */
    int quick; /* kept in --quick runs */
} ce_variant;

static const ce_variant VARIANTS[] = {
    {NULL, 1, 0, LM_CUDA_CE_ROW_AUTO, 0, 1, 1}, /* bf16, Nc 4096, staged, no split */
    /* the first GPU run's configuration: fp32 logits, Nc 1728, two-pass row kernel */
    {"f32_nc1728_stream", 0, 1728, LM_CUDA_CE_ROW_STREAM, 1, 1, 1},
    {"bf16_nc512", 1, 512, LM_CUDA_CE_ROW_AUTO, 0, 1, 0},   /* split 8 */
    {"bf16_nc1024", 1, 1024, LM_CUDA_CE_ROW_AUTO, 0, 1, 1}, /* split 4 (D 1024), 2 (D 2048) */
    {"bf16_nc1024_nosplit", 1, 1024, LM_CUDA_CE_ROW_AUTO, 1, 0, 0},
    {"bf16_nc2048", 1, 2048, LM_CUDA_CE_ROW_AUTO, 0, 1, 0}, /* split 2 (D 1024), 1 (D 2048) */
    {"bf16_nc4096_stream", 1, 4096, LM_CUDA_CE_ROW_STREAM, 0, 0, 1},
    {"bf16_nc4096_split2", 1, 4096, LM_CUDA_CE_ROW_AUTO, 2, 0, 0},
    {"bf16_nc8192", 1, 8192, LM_CUDA_CE_ROW_AUTO, 0, 1, 0},
};

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

/* the three GEMMs of the training pass (or the logits GEMM alone) over chunks of nc rows,
 * with the chunk's logits buffer standing in for the dlogits */
typedef struct {
    lm_cuda_ctx *ctx;
    int N, D, V, nc, train;
    const void *h, *W;
    void *logits; /* [nc, V] bf16 */
    void *dh;
    float *dW;
} gemm_arg;

static int gemms_fn(void *p) {
    gemm_arg *a = p;
    lm_error e = {0};
    for (int r0 = 0; r0 < a->N; r0 += a->nc) {
        const int n = a->N - r0 < a->nc ? a->N - r0 : a->nc;
        const uint16_t *hc = (const uint16_t *)a->h + (int64_t)r0 * a->D;
        lm_status st = lm_cuda_gemm(a->ctx, 0, 1, n, a->V, a->D, 1.0f, hc, a->D, a->W, a->D, 0.0f,
                                    a->logits, a->V, LM_CUDA_GEMM_BF16, &e);
        if (st == LM_OK && a->train)
            st = lm_cuda_gemm(a->ctx, 0, 0, n, a->D, a->V, 1.0f, a->logits, a->V, a->W, a->D, 0.0f,
                              (uint16_t *)a->dh + (int64_t)r0 * a->D, a->D, LM_CUDA_GEMM_BF16, &e);
        if (st == LM_OK && a->train)
            st = lm_cuda_gemm(a->ctx, 1, 0, a->V, a->D, n, 1.0f, a->logits, a->V, hc, a->D, 1.0f,
                              a->dW, a->D, LM_CUDA_GEMM_F32, &e);
        if (st != LM_OK) {
            fprintf(stderr, "bench cross_entropy gemms: %s\n", e.msg);
            return 1;
        }
    }
    return 0;
}

static int bench_one(lm_bench_ops_env *env, int N, int D, int V) {
    lm_error e = {0};
    void *h = NULL, *W = NULL, *dh = NULL, *lab = NULL, *lg = NULL;
    float *dW = NULL, *sc = NULL;
    const int gemm_nc = 4096 < N ? 4096 : N;
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
        lm_cuda_ctx_alloc(env->ctx, &lg, (size_t)gemm_nc * V * 2, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, h, (int64_t)N * D, 11, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, W, (int64_t)V * D, 12, 0.0f, 0.02f, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, dW, 0, (size_t)V * D * 4, &e) != LM_OK ||
        lm_cuda_ctx_upload(env->ctx, lab, hl, (size_t)N * 4, &e) != LM_OK) {
        fprintf(stderr, "bench cross_entropy: %s\n", e.msg);
        goto done;
    }
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d D=%d V=%d", N, D, V);
    const double ndv = (double)N * D * V;
    const double bytes_fb = 4.0 * N * D + 10.0 * V * D, bytes_f = 2.0 * N * D + 2.0 * V * D;
    for (size_t i = 0; i < sizeof VARIANTS / sizeof VARIANTS[0]; i++) {
        const ce_variant *v = &VARIANTS[i];
        if (env->quick && !v->quick)
            continue;
        ce_arg a;
        memset(&a, 0, sizeof a);
        a.ctx = env->ctx;
        lm_cuda_ce_config_default(&a.cfg, N, D, V);
        a.cfg.logits_bf16 = v->logits_bf16;
        a.cfg.chunk_rows = v->chunk_rows;
        a.cfg.row_kernel = v->row_kernel;
        a.cfg.dh_split = v->dh_split;
        a.h = h, a.W = W, a.labels = lab;
        a.out.loss_sum = sc, a.out.count = (int32_t *)(sc + 1), a.out.dh = dh, a.out.dW = dW;
        char name[64];
        if (v->tag)
            snprintf(name, sizeof name, "cross_entropy/%s", v->tag);
        else
            snprintf(name, sizeof name, "cross_entropy");
        a.train = 1;
        double ms = lm_bench_ops_time(env, ce_fn, &a);
        if (ms < 0)
            goto done;
        lm_bench_ops_row(env, name, shape, "fwd+bwd", ms, 6.0 * ndv, bytes_fb, N);
        if (v->fwd) {
            a.train = 0;
            ms = lm_bench_ops_time(env, ce_fn, &a);
            if (ms < 0)
                goto done;
            lm_bench_ops_row(env, name, shape, "fwd", ms, 2.0 * ndv, bytes_f, N);
        }
    }
    {
        gemm_arg g = {env->ctx, N, D, V, gemm_nc, 1, h, W, lg, dh, dW};
        char name[64];
        snprintf(name, sizeof name, "cross_entropy_gemms/nc%d", gemm_nc);
        double ms = lm_bench_ops_time(env, gemms_fn, &g);
        if (ms < 0)
            goto done;
        lm_bench_ops_row(env, name, shape, "fwd+bwd", ms, 6.0 * ndv, bytes_fb, N);
        g.train = 0;
        ms = lm_bench_ops_time(env, gemms_fn, &g);
        if (ms < 0)
            goto done;
        lm_bench_ops_row(env, name, shape, "fwd", ms, 2.0 * ndv, bytes_f, N);
    }
    rc = 0;
done:
    free(hl);
    lm_cuda_ctx_free_mem(env->ctx, h);
    lm_cuda_ctx_free_mem(env->ctx, W);
    lm_cuda_ctx_free_mem(env->ctx, dh);
    lm_cuda_ctx_free_mem(env->ctx, dW);
    lm_cuda_ctx_free_mem(env->ctx, lab);
    lm_cuda_ctx_free_mem(env->ctx, sc);
    lm_cuda_ctx_free_mem(env->ctx, lg);
    return rc;
}

int lm_bench_ops_cross_entropy(lm_bench_ops_env *env) {
    int rc = bench_one(env, 32768, 1024, 50304);
    if (!env->quick)
        rc |= bench_one(env, 32768, 2048, 50304);
    return rc;
}
