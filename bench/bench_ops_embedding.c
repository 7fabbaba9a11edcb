/* `linmoe bench ops` family "embedding" (bench/bench_ops.h): lm_cuda_embedding_forward
 * (the gather) and _backward (sort + deterministic scatter-add into an fp32 [V, D]
 * gradient) at N = 32768 tokens, V = 50304 (GPT-2's vocabulary padded to 64), D = 1024
 * and 2048.
 *
 * Token ids follow a Zipf-like law (id = floor(V^u) - 1, u uniform: P(id) ~ 1 / id, as
 * word frequencies in text), fixed seed, made on the host and uploaded: the most
 * frequent ids take hundreds of tokens each, which is what the scatter's runs across
 * chunks must handle.
 *
 * Rows (name, shape, pass):
 *   embedding     N=32768 V=50304 D=1024|2048   fwd, fwd+bwd (the public entry points)
 *   embedding/v<B>  the same shapes             fwd+bwd, bwd (backward variant B alone;
 *                                               src/ops/cuda/layers_variants.h; v1 is the
 *                                               earlier v2: dev/layers_variants.md)
 * Bytes, the fewest each pass must move: forward ids, the U distinct ids' rows read once
 * and out written (4 N + 2 U D + 2 N D; U counted on the host: the rows of repeated ids
 * come from L2); backward ids, dout read (4 N + 2 N D) and the distinct ids' rows of
 * dweight read and written (8 U D). The sort's keys and the cross-chunk partials are
 * not counted. FLOPs: N D adds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_ops.h"
#include "linmoe/cuda_layers.h"
#include "ops/cuda/layers_variants.h"

typedef struct {
    lm_cuda_ctx *ctx;
    int64_t N;
    int V, D, fwd, bwd, variant;
    int32_t *ids;
    void *W, *out, *dout;
    float *dW;
} emb_arg;

static int emb_run(void *p) {
    emb_arg *a = p;
    lm_error e = {0};
    lm_status st = LM_OK;
    if (a->fwd)
        st = lm_cuda_embedding_forward(a->ctx, a->N, a->V, a->D, a->ids, a->W, a->out, NULL, &e);
    if (st == LM_OK && a->bwd)
        st = lm_cuda_embedding_backward_v(a->ctx, a->variant, a->N, a->V, a->D, a->ids, a->dout,
                                          a->dW, &e);
    if (st != LM_OK)
        fprintf(stderr, "bench ops embedding: %s\n", e.msg);
    return st != LM_OK;
}

int lm_bench_ops_embedding(lm_bench_ops_env *env) {
    const int64_t N = 32768;
    const int V = 50304, Dmax = 2048;
    int32_t *ids = LM_MALLOC(sizeof(int32_t) * (size_t)N);
    unsigned char *seen = LM_CALLOC((size_t)V, 1);
    lm_rng rng;
    lm_rng_init(&rng, 4242);
    int64_t uniq = 0;
    for (int64_t n = 0; n < N; n++) {
        int64_t id = (int64_t)floor(pow((double)V, lm_rng_uniform(&rng))) - 1;
        id = id < 0 ? 0 : id >= V ? V - 1 : id;
        ids[n] = (int32_t)id;
        uniq += !seen[id];
        seen[id] = 1;
    }
    free(seen);
    emb_arg a = {0};
    a.ctx = env->ctx;
    a.N = N;
    a.V = V;
    lm_error e = {0};
    int rc = 0;
    if (lm_cuda_ctx_alloc(env->ctx, (void **)&a.ids, sizeof(int32_t) * (size_t)N, &e) != LM_OK ||
        lm_cuda_ctx_upload(env->ctx, a.ids, ids, sizeof(int32_t) * (size_t)N, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.W, (size_t)V * Dmax * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.out, (size_t)N * Dmax * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.dout, (size_t)N * Dmax * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.dW, sizeof(float) * (size_t)V * Dmax, &e) !=
            LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.W, (int64_t)V * Dmax, 41, 0.0f, 0.02f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.dout, N * Dmax, 42, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, a.dW, 0, sizeof(float) * (size_t)V * Dmax, &e) != LM_OK) {
        fprintf(stderr, "bench ops embedding: %s\n", e.msg);
        rc = 1;
    }
    free(ids);
    for (int s = 0; s < 2 && !rc; s++) {
        a.D = s ? 2048 : 1024;
        char shape[64];
        snprintf(shape, sizeof shape, "N=%lld V=%d D=%d", (long long)N, V, a.D);
        /* pass 0 fwd, 1 fwd+bwd, 2 bwd; variant 0 (public) rows: fwd, fwd+bwd */
        for (int v = 0; v <= LM_LAYERS_EMB_BWD_VARIANTS && !rc; v++) {
            char name[32] = "embedding";
            if (v)
                snprintf(name, sizeof name, "embedding/v%d", v);
            for (int pass = v ? 1 : 0; pass < (v ? 3 : 2) && !rc; pass++) {
                a.variant = v;
                a.fwd = pass != 2;
                a.bwd = pass != 0;
                const double ms = lm_bench_ops_time(env, emb_run, &a);
                if (ms < 0) {
                    rc = 1;
                    break;
                }
                const double nd = (double)N * a.D, ud = (double)uniq * a.D;
                double bytes = 0;
                if (a.fwd)
                    bytes += 4.0 * N + 2.0 * ud + 2.0 * nd;
                if (a.bwd)
                    bytes += 4.0 * N + 2.0 * nd + 8.0 * ud;
                lm_bench_ops_row(env, name, shape,
                                 pass == 0   ? "fwd"
                                 : pass == 1 ? "fwd+bwd"
                                             : "bwd",
                                 ms, a.bwd ? nd : 0.0, bytes, (double)N);
            }
        }
    }
    lm_cuda_ctx_free_mem(env->ctx, a.ids);
    lm_cuda_ctx_free_mem(env->ctx, a.W);
    lm_cuda_ctx_free_mem(env->ctx, a.out);
    lm_cuda_ctx_free_mem(env->ctx, a.dout);
    lm_cuda_ctx_free_mem(env->ctx, a.dW);
    return rc;
}
