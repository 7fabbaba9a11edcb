/* `linmoe bench ops` family "moe" (bench/bench_ops.h): the expert side of the MoE layer
 * on CUDA (include/linmoe/cuda_moe.h), routing given, at the GPU configs' shapes: T =
 * 32768 tokens (8192 with --quick), hidden D = 1024 and 2048, E = 64 routed experts of
 * width F = 512, top-6, one shared expert of width 512.
 *
 * Routing: random N(0, 1) logits [T, E] routed on the host by the CPU router
 * (lm_router_forward, sigmoid scores, normalised top-6, dropless), uploaded once as the
 * int32 / fp32 topk_idx / topk_weight the GPU router would give.
 *
 * Rows (shape "T=.. D=.. E=64 k=6 F=512"), with the default grouped-GEMM variant:
 *   moe       fwd      lm_cuda_moe_forward, training (saves [g|u]): permutation, grouped
 *                      gate/up + SwiGLU and down GEMMs, shared expert, combine
 *   moe       fwd+bwd  the forward and lm_cuda_moe_backward (dx, dtopk_weight and all
 *                      six weight gradients, accumulated)
 *   moe_gemm  fwd      the routed grouped GEMMs of the forward alone (opts.gemm_only)
 *   moe_gemm  fwd+bwd  those of the forward and the backward alone
 * then the same four rows for each variant side by side ("moe/v0", "moe_gemm/v0": the
 * cp.async kernel, LM_CUDA_MOE_VARIANT_CPASYNC; "/v1": tensor copies and the staged
 * epilogue, LM_CUDA_MOE_VARIANT_TMA), and each routed product alone per variant
 * ("moe_gemm/v1:gateup" .. ":wgateup", opts.gemm_mask; pass fwd or bwd), so one run
 * shows which variant wins and which product lags.
 * FLOPs: forward 6 D F per assignment (T k of them) + 6 T D fs for the shared expert;
 * fwd+bwd 3x the forward (moe_gemm: the routed part only; per product 2 or 4 D F per
 * assignment). Minimum bytes: x read and y written (bf16) and the bf16 weights read once;
 * fwd+bwd adds dy read, dx written, the weights read again and the fp32 gradients read
 * and written; per product its operands read and its output written once.
 * Peer: scripts/gpu/ops_peers/moe.py (PyTorch, torch._grouped_mm as torchtitan does). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_moe.h"
#include "linmoe/moe_router.h"

enum { NW = 6 };

typedef struct {
    lm_cuda_ctx *ctx;
    lm_moe_config cfg;
    int T, bwd;
    lm_cuda_moe_weights w;
    lm_cuda_moe_grads g;
    lm_cuda_moe_opts o;
    void *x, *dy, *y, *dx, *saved, *scratch;
    int32_t *idx;
    float *wt, *dtopk;
} moe_arg;

static int moe_fn(void *p) {
    moe_arg *a = p;
    lm_error e = {0};
    if (lm_cuda_moe_forward(a->ctx, &a->cfg, a->T, &a->w, a->x, a->idx, a->wt, NULL, 1, a->saved,
                            a->scratch, a->y, &a->o, &e) != LM_OK ||
        (a->bwd &&
         lm_cuda_moe_backward(a->ctx, &a->cfg, a->T, &a->w, a->x, a->wt, a->saved, a->scratch,
                              a->dy, a->dx, a->dtopk, &a->g, &a->o, &e) != LM_OK)) {
        fprintf(stderr, "bench moe: %s\n", e.msg);
        return 1;
    }
    return 0;
}

/* CPU routing of random logits into int32 / fp32 device buffers */
static int make_route(lm_bench_ops_env *env, const lm_moe_config *cfg, int T, int32_t *idx,
                      float *wt) {
    const int E = cfg->router.num_experts, k = cfg->router.num_experts_per_tok;
    float *logits = malloc(sizeof(float) * (size_t)T * E);
    int32_t *hi = malloc(sizeof(int32_t) * (size_t)T * k);
    float *hw = malloc(sizeof(float) * (size_t)T * k);
    lm_route r;
    memset(&r, 0, sizeof r);
    lm_error e = {0};
    int rc = 1;
    if (!logits || !hi || !hw)
        goto out;
    lm_rng rng;
    lm_rng_init(&rng, 4242);
    for (int64_t i = 0; i < (int64_t)T * E; i++)
        logits[i] = (float)lm_rng_normal(&rng);
    if (lm_router_forward(&cfg->router, NULL, logits, T, NULL, 0, 0, &r, &e) != LM_OK)
        goto out;
    for (int64_t s = 0; s < (int64_t)T * k; s++) {
        hi[s] = r.keep[s] ? (int32_t)r.topk_idx[s] : -1;
        hw[s] = r.keep[s] ? r.topk_weight[s] : 0.0f;
    }
    if (lm_cuda_ctx_upload(env->ctx, idx, hi, sizeof(int32_t) * (size_t)T * k, &e) != LM_OK ||
        lm_cuda_ctx_upload(env->ctx, wt, hw, sizeof(float) * (size_t)T * k, &e) != LM_OK)
        goto out;
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "bench moe: routing: %s\n", e.msg[0] ? e.msg : "out of memory");
    lm_route_free(&r);
    free(logits);
    free(hi);
    free(hw);
    return rc;
}

static int bench_shape(lm_bench_ops_env *env, int T, int D) {
    const int E = 64, k = 6, F = 512, ns = 1;
    lm_error e = {0};
    moe_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = env->ctx;
    a.T = T;
    lm_moe_config_default(&a.cfg, D, F, E, k, ns);
    const int64_t fs = (int64_t)ns * F, Tk = (int64_t)T * k;
    const int64_t nw[NW] = {
        (int64_t)E * F * D, (int64_t)E * F * D, (int64_t)E * D * F, fs * D, fs * D, D * fs};
    void *wd[NW] = {0};
    float *gd[NW] = {0};
    int rc = 1;
    lm_cuda_moe_sizes sz;
    if (lm_cuda_moe_plan(&a.cfg, T, &sz, &e) != LM_OK)
        goto fail;
    for (int i = 0; i < NW; i++) {
        void *g = NULL;
        if (lm_cuda_ctx_alloc(env->ctx, &wd[i], (size_t)nw[i] * 2, &e) != LM_OK ||
            lm_cuda_fill_normal_bf16(env->ctx, wd[i], nw[i], 10 + (uint64_t)i, 0.0f,
                                     i == 2 || i == 5 ? 0.044f : 0.031f, &e) != LM_OK ||
            lm_cuda_ctx_alloc(env->ctx, &g, (size_t)nw[i] * 4, &e) != LM_OK ||
            lm_cuda_ctx_memset(env->ctx, g, 0, (size_t)nw[i] * 4, &e) != LM_OK)
            goto fail;
        gd[i] = g;
    }
    a.w = (lm_cuda_moe_weights){wd[0], wd[1], wd[2], wd[3], wd[4], wd[5]};
    a.g = (lm_cuda_moe_grads){gd[0], gd[1], gd[2], gd[3], gd[4], gd[5]};
    if (lm_cuda_ctx_alloc(env->ctx, &a.x, (size_t)T * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.dy, (size_t)T * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.y, (size_t)T * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.dx, (size_t)T * D * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.saved, sz.saved_bytes, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.scratch, sz.scratch_bytes, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.idx, sizeof(int32_t) * (size_t)Tk, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.wt, sizeof(float) * (size_t)Tk, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.dtopk, sizeof(float) * (size_t)Tk, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.x, (int64_t)T * D, 1, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.dy, (int64_t)T * D, 2, 0.0f, 1.0f, &e) != LM_OK)
        goto fail;
    if (make_route(env, &a.cfg, T, a.idx, a.wt))
        goto done;

    char shape[96];
    snprintf(shape, sizeof shape, "T=%d D=%d E=%d k=%d F=%d", T, D, E, k, F);
    const double fl = lm_cuda_moe_forward_flops(&a.cfg, T, Tk);
    const double fl_routed = 6.0 * (double)D * F * (double)Tk;
    double wbytes = 0, nwsum = 0;
    for (int i = 0; i < NW; i++)
        nwsum += (double)nw[i];
    wbytes = 2.0 * nwsum;
    const double act = 2.0 * (double)T * D; /* one bf16 [T, D] tensor */
    const double by_f = 2.0 * act + wbytes, by_fb = by_f + 2.0 * act + wbytes + 8.0 * nwsum;
    const double by_rw = 2.0 * 3.0 * (double)E * D * F; /* routed weights, bf16 */

    /* one full forward first: gemm_only reuses its permutation */
    a.bwd = 0;
    if (moe_fn(&a))
        goto done;
    static const struct {
        const char *tag;
        int variant;
    } vars[] = {{"", LM_CUDA_MOE_VARIANT_DEFAULT},
                {"/v0", LM_CUDA_MOE_VARIANT_CPASYNC},
                {"/v1", LM_CUDA_MOE_VARIANT_TMA}};
    const double tkdf = (double)Tk * D * F, ew = (double)E * D * F;
    const double tk2 = 2.0 * (double)Tk;
    const struct {
        const char *name;
        int mask, bwd;
        double flops, bytes;
    } prods[] = {
        {"gateup", LM_CUDA_MOE_P_GATEUP, 0, 4.0 * tkdf, tk2 * (D + 3.0 * F) + 4.0 * ew},
        {"down", LM_CUDA_MOE_P_DOWN, 0, 2.0 * tkdf, tk2 * (F + (double)D) + 2.0 * ew},
        {"ddown", LM_CUDA_MOE_P_DDOWN, 1, 2.0 * tkdf, tk2 * (D + 4.0 * F) + 2.0 * ew},
        {"wdown", LM_CUDA_MOE_P_WDOWN, 1, 2.0 * tkdf, tk2 * (D + (double)F) + 8.0 * ew},
        {"dgateup", LM_CUDA_MOE_P_DGATEUP, 1, 4.0 * tkdf, tk2 * (2.0 * F + D) + 4.0 * ew},
        {"wgateup", LM_CUDA_MOE_P_WGATEUP, 1, 4.0 * tkdf, tk2 * (2.0 * F + D) + 16.0 * ew},
    };
    for (size_t v = 0; v < sizeof vars / sizeof vars[0]; v++) {
        char nm[64], ng[64];
        snprintf(nm, sizeof nm, "moe%s", vars[v].tag);
        snprintf(ng, sizeof ng, "moe_gemm%s", vars[v].tag);
        a.o.variant = vars[v].variant;
        a.o.gemm_mask = 0;
        double ms;
        a.o.gemm_only = 0;
        a.bwd = 0;
        if ((ms = lm_bench_ops_time(env, moe_fn, &a)) < 0)
            goto done;
        lm_bench_ops_row(env, nm, shape, "fwd", ms, fl, by_f, T);
        a.bwd = 1;
        if ((ms = lm_bench_ops_time(env, moe_fn, &a)) < 0)
            goto done;
        lm_bench_ops_row(env, nm, shape, "fwd+bwd", ms, 3.0 * fl, by_fb, T);
        a.o.gemm_only = 1;
        a.bwd = 0;
        if ((ms = lm_bench_ops_time(env, moe_fn, &a)) < 0)
            goto done;
        lm_bench_ops_row(env, ng, shape, "fwd", ms, fl_routed, by_rw, T);
        a.bwd = 1;
        if ((ms = lm_bench_ops_time(env, moe_fn, &a)) < 0)
            goto done;
        lm_bench_ops_row(env, ng, shape, "fwd+bwd", ms, 3.0 * fl_routed, 2.0 * by_rw, T);
        if (!vars[v].tag[0])
            continue; /* the default is one of the variants below */
        for (size_t p = 0; p < sizeof prods / sizeof prods[0]; p++) {
            char np[80];
            snprintf(np, sizeof np, "%s:%s", ng, prods[p].name);
            a.o.gemm_mask = prods[p].mask;
            a.bwd = prods[p].bwd;
            if ((ms = lm_bench_ops_time(env, moe_fn, &a)) < 0)
                goto done;
            lm_bench_ops_row(env, np, shape, prods[p].bwd ? "bwd" : "fwd", ms, prods[p].flops,
                             prods[p].bytes, T);
        }
        a.o.gemm_mask = 0;
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "bench moe: %s\n", e.msg);
done:
    for (int i = 0; i < NW; i++) {
        lm_cuda_ctx_free_mem(env->ctx, wd[i]);
        lm_cuda_ctx_free_mem(env->ctx, gd[i]);
    }
    lm_cuda_ctx_free_mem(env->ctx, a.x);
    lm_cuda_ctx_free_mem(env->ctx, a.dy);
    lm_cuda_ctx_free_mem(env->ctx, a.y);
    lm_cuda_ctx_free_mem(env->ctx, a.dx);
    lm_cuda_ctx_free_mem(env->ctx, a.saved);
    lm_cuda_ctx_free_mem(env->ctx, a.scratch);
    lm_cuda_ctx_free_mem(env->ctx, a.idx);
    lm_cuda_ctx_free_mem(env->ctx, a.wt);
    lm_cuda_ctx_free_mem(env->ctx, a.dtopk);
    return rc;
}

int lm_bench_ops_moe(lm_bench_ops_env *env) {
    const int T = env->quick ? 8192 : 32768;
    int rc = 0;
    rc |= bench_shape(env, T, 1024);
    rc |= bench_shape(env, T, 2048);
    return rc;
}
