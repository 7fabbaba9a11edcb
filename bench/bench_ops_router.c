/* `linmoe bench ops` family `router` (bench/bench_ops.h): the CUDA MoE router
 * (include/linmoe/cuda_router.h) at B*T = 32768 tokens (8192 with --quick), fp32
 * logits N(0, 1), for E = 64 top-6 and E = 256 top-8 with 8 groups / 4 (DeepSeek-V3's
 * routing shape):
 *   fwd      training forward: scores, biased top-k, weights, capacity 1.25 (probs policy:
 *            per-expert radix select), the step accumulators
 *   fwd+bwd  that plus the backward into the logits
 *   step     the once-per-step bias update (sign rule, centring, clamp, metrics)
 * and two variants of the forward: "dropless" (inference: no capacity, no accumulators)
 * and "quantile" (training with the quantile solve of the micro-batch, 1 alternation).
 * The router is memory-bound: the floor counts the logits read and the scores written
 * (and in the backward the scores read and dlogits written), plus the [T, k] outputs.
 * No torch peer (the router peer is part of the MoE family's). */
#include <stdio.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_router.h"

typedef struct {
    lm_cuda_ctx *ctx;
    lm_router_config cfg;
    lm_cuda_router_state st;
    lm_cuda_route r;
    float *logits, *dw, *dlogits;
    lm_router_metrics *metrics;
    int T, training;
} router_bench;

static int run_fwd(void *p) {
    router_bench *b = p;
    lm_error e = {0};
    if (lm_cuda_router_forward(b->ctx, &b->cfg, &b->st, b->logits, b->T, NULL, 0, b->training,
                               &b->r, &e) != LM_OK) {
        fprintf(stderr, "bench ops router: %s\n", e.msg);
        return 1;
    }
    return 0;
}

static int run_fwd_bwd(void *p) {
    router_bench *b = p;
    lm_error e = {0};
    if (run_fwd(p))
        return 1;
    if (lm_cuda_router_backward(b->ctx, &b->cfg, &b->r, b->dw, b->dlogits, &e) != LM_OK) {
        fprintf(stderr, "bench ops router: %s\n", e.msg);
        return 1;
    }
    return 0;
}

static int run_step(void *p) {
    router_bench *b = p;
    lm_error e = {0};
    if (lm_cuda_router_update_bias(b->ctx, &b->cfg, &b->st, b->metrics, &e) != LM_OK) {
        fprintf(stderr, "bench ops router: %s\n", e.msg);
        return 1;
    }
    return 0;
}

/* One shape: E experts top-k (groups ng / tg, 1 = off). */
static int bench_shape(lm_bench_ops_env *env, int T, int E, int k, int ng, int tg,
                       const char *tag) {
    lm_error e = {0};
    router_bench b;
    memset(&b, 0, sizeof b);
    b.ctx = env->ctx;
    b.T = T;
    lm_router_config_default(&b.cfg, E, k);
    b.cfg.n_group = ng;
    b.cfg.topk_group = tg;
    b.cfg.routed_scaling_factor = ng > 1 ? 2.5f : 1.0f;
    b.cfg.capacity_factor = 1.25f;
    b.cfg.drop_policy = LM_DROP_PROBS;
    const size_t TE = (size_t)T * E, Tk = (size_t)T * k;
    int rc = 1;
    if (lm_cuda_router_state_init(env->ctx, &b.st, E, &e) != LM_OK ||
        lm_cuda_route_alloc(env->ctx, &b.cfg, T, 1, &b.r, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.logits, sizeof(float) * TE, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.dlogits, sizeof(float) * TE, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.dw, sizeof(float) * Tk, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&b.metrics, sizeof(lm_router_metrics), &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, b.logits, (int64_t)TE, 1, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, b.dw, (int64_t)Tk, 2, 0.0f, 1.0f, &e) != LM_OK) {
        fprintf(stderr, "bench ops router: %s\n", e.msg);
        goto done;
    }
    char shape[64];
    const double io_k = 12.0 * Tk; /* topk_idx, topk_weight, sel_idx */
    const double fwd_bytes = 8.0 * TE + io_k, bwd_bytes = 8.0 * TE + 12.0 * Tk;
    double ms;

    snprintf(shape, sizeof shape, "T=%d E=%d k=%d%s", T, E, k, tag);
    b.training = 1;
    if ((ms = lm_bench_ops_time(env, run_fwd, &b)) < 0)
        goto done;
    lm_bench_ops_row(env, "router", shape, "fwd", ms, 0, fwd_bytes, T);
    if ((ms = lm_bench_ops_time(env, run_fwd_bwd, &b)) < 0)
        goto done;
    lm_bench_ops_row(env, "router", shape, "fwd+bwd", ms, 0, fwd_bytes + bwd_bytes, T);
    if ((ms = lm_bench_ops_time(env, run_step, &b)) < 0)
        goto done;
    lm_bench_ops_row(env, "router", shape, "step", ms, 0,
                     16.0 * LM_CUDA_ROUTER_ACC_LEN(E) + 8.0 * E * (LM_ROUTER_HISTORY + 2), 0);

    snprintf(shape, sizeof shape, "T=%d E=%d k=%d%s dropless", T, E, k, tag);
    b.training = 0;
    if ((ms = lm_bench_ops_time(env, run_fwd, &b)) < 0)
        goto done;
    lm_bench_ops_row(env, "router", shape, "fwd", ms, 0, fwd_bytes, T);

    snprintf(shape, sizeof shape, "T=%d E=%d k=%d%s quantile", T, E, k, tag);
    b.training = 1;
    b.cfg.balance = LM_BAL_QUANTILE;
    b.cfg.capacity_factor = 0.0f;
    if ((ms = lm_bench_ops_time(env, run_fwd, &b)) < 0)
        goto done;
    /* plus the margins written and read back transposed (5 passes) */
    lm_bench_ops_row(env, "router", shape, "fwd", ms, 0, fwd_bytes + 4.0 * TE * 7, T);
    rc = 0;
done:
    lm_cuda_ctx_free_mem(env->ctx, b.logits);
    lm_cuda_ctx_free_mem(env->ctx, b.dlogits);
    lm_cuda_ctx_free_mem(env->ctx, b.dw);
    lm_cuda_ctx_free_mem(env->ctx, b.metrics);
    lm_cuda_route_free(env->ctx, &b.r);
    lm_cuda_router_state_free(env->ctx, &b.st);
    return rc;
}

int lm_bench_ops_router(lm_bench_ops_env *env) {
    const int T = env->quick ? 8192 : 32768;
    int rc = bench_shape(env, T, 64, 6, 1, 1, "");
    rc |= bench_shape(env, T, 256, 8, 8, 4, " g8/4");
    return rc;
}
