/* `linmoe bench ops` family "short_conv" (bench/bench_ops.h): lm_cuda_short_conv_*, the
 * causal depthwise conv (W = 4, fused SiLU) in front of KDA, at the q/k/v projections'
 * channels for hidden 1024 (C = 3 * 8 heads * 128 = 3072), B*T = 32768 tokens packed as
 * 8 documents of unequal length (cu_seqlens), no initial state (training).
 *
 * Rows (name, shape, pass):
 *   short_conv       T=32768 C=3072 W=4 docs=8   fwd, fwd+bwd
 *   short_conv_step  B=64 C=3072 W=4             step (decode, state in place)
 * (the public entry points, the default variant), then the kernel variants side by side
 * (src/ops/cuda/layers_variants.h; no peer rows):
 *   short_conv/v<V>  T=32768 C=3072 W=4 docs=8   fwd, fwd+bwd, bwd (the backward alone;
 *                    v1 is the earlier v2, the tiled kernels: dev/layers_variants.md)
 * Bytes (bf16 activations, fp32 state and dweight): forward x read, y written = 4 T C;
 * backward x, dy read, dx written = 6 T C, dweight read and written 8 C W; the step x, y
 * = 4 B C and the state read and written 8 B C (W-1). FLOPs 2 W per element (+ SiLU),
 * backward 3x (the floor is the bytes). */
#include <stdio.h>

#include "bench_ops.h"
#include "linmoe/cuda_layers.h"
#include "ops/cuda/layers_variants.h"

typedef struct {
    lm_cuda_ctx *ctx;
    lm_short_conv_config cfg;
    int fwd, bwd, step, B, variant;
    void *x, *w, *y, *dy, *dx;
    float *dw, *state;
} sc_arg;

static int sc_run(void *p) {
    sc_arg *a = p;
    lm_error e = {0};
    lm_status st;
    if (a->step) {
        st = lm_cuda_short_conv_step(a->ctx, a->B, a->cfg.C, a->cfg.W, LM_ACT_SILU, a->x, a->w,
                                     a->state, a->y, &e);
    } else {
        st = LM_OK;
        if (a->fwd)
            st = lm_cuda_short_conv_forward_v(a->ctx, a->variant, &a->cfg, a->x, a->w, NULL, a->y,
                                              NULL, &e);
        if (st == LM_OK && a->bwd)
            st = lm_cuda_short_conv_backward_v(a->ctx, a->variant, &a->cfg, a->x, a->w, NULL, a->dy,
                                               a->dx, a->dw, NULL, &e);
    }
    if (st != LM_OK)
        fprintf(stderr, "bench ops short_conv: %s\n", e.msg);
    return st != LM_OK;
}

int lm_bench_ops_short_conv(lm_bench_ops_env *env) {
    const int T = 32768, C = 3072, W = 4, B = 64;
    /* 8 documents of unequal length summing to T */
    static const int64_t cu[9] = {0, 2000, 6096, 9000, 15000, 16384, 22000, 27000, 32768};
    sc_arg a = {0};
    a.ctx = env->ctx;
    lm_short_conv_config_default(&a.cfg, 1, T, C, W);
    a.cfg.cu_seqlens = cu;
    a.cfg.n_cu_seqlens = 9;
    const int64_t n = (int64_t)T * C;
    lm_error e = {0};
    int rc = 0;
    if (lm_cuda_ctx_alloc(env->ctx, &a.x, (size_t)n * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.y, (size_t)n * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.dy, (size_t)n * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.dx, (size_t)n * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.w, (size_t)C * W * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.dw, sizeof(float) * C * W, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.state, sizeof(float) * B * C * (W - 1), &e) !=
            LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.x, n, 31, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.dy, n, 32, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.w, (int64_t)C * W, 33, 0.0f, 0.5f, &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, a.state, (int64_t)B * C * (W - 1), 34, 0.0f, 1.0f, &e) !=
            LM_OK ||
        lm_cuda_ctx_memset(env->ctx, a.dw, 0, sizeof(float) * C * W, &e) != LM_OK) {
        fprintf(stderr, "bench ops short_conv: %s\n", e.msg);
        rc = 1;
    }
    char shape[64];
    snprintf(shape, sizeof shape, "T=%d C=%d W=%d docs=8", T, C, W);
    /* the public entry points (variant 0), then each variant: fwd, fwd+bwd, bwd */
    for (int v = 0; v <= LM_LAYERS_CONV_VARIANTS && !rc; v++) {
        char name[32] = "short_conv";
        if (v)
            snprintf(name, sizeof name, "short_conv/v%d", v);
        for (int pass = 0; pass < (v ? 3 : 2) && !rc; pass++) {
            a.variant = v;
            a.fwd = pass != 2;
            a.bwd = pass != 0;
            const double ms = lm_bench_ops_time(env, sc_run, &a);
            if (ms < 0) {
                rc = 1;
                break;
            }
            const double bytes = (a.fwd ? 4.0 * n : 0) + (a.bwd ? 6.0 * n + 8.0 * C * W : 0);
            const double flops = ((a.fwd ? 1.0 : 0) + (a.bwd ? 3.0 : 0)) * (2.0 * W + 4) * n;
            lm_bench_ops_row(env, name, shape,
                             pass == 0   ? "fwd"
                             : pass == 1 ? "fwd+bwd"
                                         : "bwd",
                             ms, flops, bytes, (double)T);
        }
    }
    if (!rc) {
        a.step = 1;
        a.B = B;
        const double ms = lm_bench_ops_time(env, sc_run, &a);
        if (ms < 0) {
            rc = 1;
        } else {
            snprintf(shape, sizeof shape, "B=%d C=%d W=%d", B, C, W);
            const double bc = (double)B * C;
            lm_bench_ops_row(env, "short_conv_step", shape, "step", ms, (2.0 * W + 4) * bc,
                             4.0 * bc + 8.0 * bc * (W - 1) + 2.0 * C * W, (double)B);
        }
    }
    lm_cuda_ctx_free_mem(env->ctx, a.x);
    lm_cuda_ctx_free_mem(env->ctx, a.y);
    lm_cuda_ctx_free_mem(env->ctx, a.dy);
    lm_cuda_ctx_free_mem(env->ctx, a.dx);
    lm_cuda_ctx_free_mem(env->ctx, a.w);
    lm_cuda_ctx_free_mem(env->ctx, a.dw);
    lm_cuda_ctx_free_mem(env->ctx, a.state);
    return rc;
}
