/* test_backend_ops family "moe": the expert side of the MoE layer on CUDA
 * (lm_cuda_moe_forward / lm_cuda_moe_backward, include/linmoe/cuda_moe.h) against the CPU
 * layer lm_moe_forward / lm_moe_backward (src/ops/moe.c, fp32) on the same bf16-rounded
 * weights and inputs and the same routing: the CPU routes (its router on x W_r^T), and
 * its route (topk_idx, topk_weight, keep) is what the GPU gets, as int32 with -1 / 0
 * where dropped. The CPU backward's dx also holds the router's part dlogits W_r, which the
 * expert side does not compute: the reference is dx - dlogits W_r (fp64, dlogits and the
 * d topk_weight from the CPU context, src/ops/cpu/moe_cpu.h).
 *
 * Rows per case: y (BO_TOL_FWD), dx (BO_TOL_GRAD), dtopk_weight and the six expert weight
 * gradients (BO_TOL_GATE_GRAD: bf16 activations between the products, ~3e-3 measured on
 * the CPU side of the error budget); then a second backward without re-zeroing the
 * gradients: dx and dtopk_weight bit-identical, every gradient exactly twice the first
 * (accumulation and determinism), as mismatch counts against 0. Every case runs the
 * wgmma grouped GEMM with the default variant ("moe"), each variant (v0: cp.async,
 * "moe/v0"; v1: tensor copies and staged epilogue, "moe/v1") alone and with the
 * persistent grid capped at 2 CTAs ("/cta2": every CTA runs many tiles, the pipeline's
 * stage ring and the epilogue staging buffers are reused across tiles), and the plain
 * reference GEMM ("moe/simple").
 * Outputs and the saved / scratch buffers start poisoned (NaN), so an unwritten element
 * or a read of an unwritten one fails.
 *
 * Cases: T = 37, D = 64, F = 96, E = 8 top-2, 1 shared expert (sizes that are not
 * multiples of the 128 / 256 tiles); the same with capacity drops (capacity_factor 0.6),
 * an expert that receives no tokens (selection bias -1000) and no shared expert; T = 300,
 * E = 64 top-6, 2 shared experts, a dead expert; T = 700, D = 320, F = 200, E = 4 top-2,
 * routed_scaling_factor 2.5 (several 128-row tiles per expert, K loops longer than the
 * 4-stage ring, gate / up tiles that straddle F); T = 2048, D = 256, F = 128, E = 64
 * top-6 (the benchmark's routing shape scaled down: whole 64-column K steps, full tiles,
 * ~190 rows per expert).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_moe.h"
#include "linmoe/moe.h"
#include "ops/cpu/moe_cpu.h" /* the CPU context's dw and dlogits */

typedef struct {
    int T, D, F, E, k, ns;
    float cf;  /* capacity_factor (training) */
    int dead;  /* expert given a -1000 selection bias, or -1 */
    float rsf; /* routed_scaling_factor */
    int pass_counts;
} mcase;

static float *hbuf(int64_t n) {
    float *p = LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
    memset(p, 0, sizeof(float) * (size_t)(n > 0 ? n : 1));
    return p;
}

/* bitwise mismatches of n floats: 0 or 1 per element, compared against zeros */
static int check_bits(bo_ctx *c, const char *op, const char *shape, const char *tensor,
                      const float *a, const float *b, int64_t n, float scale) {
    float *diff = hbuf(n), *zero = hbuf(n);
    for (int64_t i = 0; i < n; i++) {
        const float want = scale * b[i];
        diff[i] = memcmp(&a[i], &want, sizeof(float)) != 0 ? 1.0f : 0.0f;
    }
    const int bad = bo_check(c, op, "bits", shape, tensor, diff, zero, n, 0.0);
    free(diff);
    free(zero);
    return bad;
}

enum { W_G, W_U, W_D, W_SG, W_SU, W_SD, NW };
static const char *const wname[NW] = {"dWgate", "dWup", "dWdown", "dWs_gate", "dWs_up", "dWs_down"};

typedef struct {
    void *x, *dy, *w[NW], *idx, *wt, *cnt, *saved, *scratch, *y, *dx, *dtopk;
    float *g[NW];
} gpu_bufs;

static void free_bufs(bo_ctx *c, gpu_bufs *b) {
    void **all[] = {&b->x,     &b->dy,      &b->idx, &b->wt, &b->cnt,
                    &b->saved, &b->scratch, &b->y,   &b->dx, &b->dtopk};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (*all[i])
            bo_free(c, *all[i]), *all[i] = NULL;
    for (int i = 0; i < NW; i++) {
        if (b->w[i])
            bo_free(c, b->w[i]), b->w[i] = NULL;
        if (b->g[i])
            bo_free(c, b->g[i]), b->g[i] = NULL;
    }
}

/* Host data of one case: inputs, the CPU reference and the routing the GPU gets. */
typedef struct {
    int64_t n[NW]; /* elements of each expert weight */
    float *wt[NW], *x, *dy;
    float *y_ref, *dx_ref, *dtopk_ref, *g_ref[NW];
    int32_t *idx32, *counts;
    float *w32;
} host_case;

static void run_gpu(bo_ctx *c, const mcase *k, const lm_moe_config *cfg, const host_case *h,
                    const char *shape, int gemm, int variant, int max_ctas) {
    const int64_t T = k->T, D = k->D, Tk = T * k->k;
    const char *op =
        gemm == LM_CUDA_MOE_GEMM_SIMPLE          ? "moe/simple"
        : variant == LM_CUDA_MOE_VARIANT_CPASYNC ? (max_ctas > 0 ? "moe/v0/cta2" : "moe/v0")
        : variant == LM_CUDA_MOE_VARIANT_TMA     ? (max_ctas > 0 ? "moe/v1/cta2" : "moe/v1")
        : max_ctas > 0                           ? "moe/cta2"
                                                 : "moe";
    lm_error e = {0};
    gpu_bufs b;
    memset(&b, 0, sizeof b);
    lm_cuda_moe_sizes sz;
    float *y = hbuf(T * D), *dx = hbuf(T * D), *dt = hbuf(Tk), *dx2 = hbuf(T * D), *dt2 = hbuf(Tk);
    float *g1[NW], *g2[NW];
    for (int i = 0; i < NW; i++)
        g1[i] = hbuf(h->n[i]), g2[i] = hbuf(h->n[i]);
    if (lm_cuda_moe_plan(cfg, k->T, &sz, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    b.x = bo_upload_bf16(c, h->x, T * D, &e);
    b.dy = b.x ? bo_upload_bf16(c, h->dy, T * D, &e) : NULL;
    for (int i = 0; i < NW && b.dy; i++)
        if (h->n[i] > 0 && !(b.w[i] = bo_upload_bf16(c, h->wt[i], h->n[i], &e)))
            break;
    if (!e.msg[0]) {
        b.idx = bo_upload_bytes(c, h->idx32, sizeof(int32_t) * (size_t)Tk, &e);
        b.wt = b.idx ? bo_upload_f32(c, h->w32, Tk, &e) : NULL;
        b.cnt = b.wt ? bo_upload_bytes(c, h->counts, sizeof(int32_t) * (size_t)k->E, &e) : NULL;
        b.saved = b.cnt ? bo_alloc_poisoned(c, sz.saved_bytes, &e) : NULL;
        b.scratch = b.saved ? bo_alloc_poisoned(c, sz.scratch_bytes, &e) : NULL;
        b.y = b.scratch ? bo_alloc_poisoned(c, (size_t)(T * D) * 2, &e) : NULL;
        b.dx = b.y ? bo_alloc_poisoned(c, (size_t)(T * D) * 2, &e) : NULL;
        b.dtopk = b.dx ? bo_alloc_poisoned(c, sizeof(float) * (size_t)Tk, &e) : NULL;
    }
    for (int i = 0; i < NW && !e.msg[0]; i++)
        if (h->n[i] > 0) {
            void *p = NULL;
            if (lm_cuda_ctx_alloc(c->cuda, &p, sizeof(float) * (size_t)h->n[i], &e) != LM_OK ||
                lm_cuda_ctx_memset(c->cuda, p, 0, sizeof(float) * (size_t)h->n[i], &e) != LM_OK)
                break;
            b.g[i] = (float *)p;
        }
    if (e.msg[0]) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    {
        const lm_cuda_moe_weights w = {b.w[W_G],  b.w[W_U],  b.w[W_D],
                                       b.w[W_SG], b.w[W_SU], b.w[W_SD]};
        const lm_cuda_moe_grads g = {b.g[W_G], b.g[W_U], b.g[W_D], b.g[W_SG], b.g[W_SU], b.g[W_SD]};
        lm_cuda_moe_opts o;
        memset(&o, 0, sizeof o);
        o.gemm = gemm;
        o.variant = variant;
        o.max_ctas = max_ctas;
        if (lm_cuda_moe_forward(c->cuda, cfg, k->T, &w, b.x, (const int32_t *)b.idx,
                                (const float *)b.wt, k->pass_counts ? (const int32_t *)b.cnt : NULL,
                                1, b.saved, b.scratch, b.y, &o, &e) != LM_OK ||
            lm_cuda_moe_backward(c->cuda, cfg, k->T, &w, b.x, (const float *)b.wt, b.saved,
                                 b.scratch, b.dy, b.dx, (float *)b.dtopk, &g, &o, &e) != LM_OK ||
            bo_download_bf16(c, y, b.y, T * D, &e) != LM_OK ||
            bo_download_bf16(c, dx, b.dx, T * D, &e) != LM_OK ||
            bo_download_f32(c, dt, (const float *)b.dtopk, Tk, &e) != LM_OK) {
            bo_fail(c, op, shape, &e);
            goto out;
        }
        for (int i = 0; i < NW; i++)
            if (h->n[i] > 0 && bo_download_f32(c, g1[i], b.g[i], h->n[i], &e) != LM_OK) {
                bo_fail(c, op, shape, &e);
                goto out;
            }
        bo_check(c, op, "bf16", shape, "y", y, h->y_ref, T * D, BO_TOL_FWD);
        bo_check(c, op, "bf16", shape, "dx", dx, h->dx_ref, T * D, BO_TOL_GRAD);
        bo_check(c, op, "fp32", shape, "dtopk_w", dt, h->dtopk_ref, Tk, BO_TOL_GATE_GRAD);
        for (int i = 0; i < NW; i++)
            if (h->n[i] > 0)
                bo_check(c, op, "fp32", shape, wname[i], g1[i], h->g_ref[i], h->n[i],
                         BO_TOL_GATE_GRAD);

        /* again, gradients not re-zeroed: the same dx / dtopk, every gradient doubled */
        if (lm_cuda_moe_backward(c->cuda, cfg, k->T, &w, b.x, (const float *)b.wt, b.saved,
                                 b.scratch, b.dy, b.dx, (float *)b.dtopk, &g, &o, &e) != LM_OK ||
            bo_download_bf16(c, dx2, b.dx, T * D, &e) != LM_OK ||
            bo_download_f32(c, dt2, (const float *)b.dtopk, Tk, &e) != LM_OK) {
            bo_fail(c, op, shape, &e);
            goto out;
        }
        check_bits(c, op, shape, "dx again", dx2, dx, T * D, 1.0f);
        check_bits(c, op, shape, "dtopk agn", dt2, dt, Tk, 1.0f);
        for (int i = 0; i < NW; i++)
            if (h->n[i] > 0) {
                if (bo_download_f32(c, g2[i], b.g[i], h->n[i], &e) != LM_OK) {
                    bo_fail(c, op, shape, &e);
                    goto out;
                }
                char nm[32];
                snprintf(nm, sizeof nm, "%s x2", wname[i]);
                check_bits(c, op, shape, nm, g2[i], g1[i], h->n[i], 2.0f);
            }
    }
out:
    free_bufs(c, &b);
    free(y), free(dx), free(dt), free(dx2), free(dt2);
    for (int i = 0; i < NW; i++)
        free(g1[i]), free(g2[i]);
}

static void moe_case(bo_ctx *c, const mcase *k) {
    const int64_t T = k->T, D = k->D, F = k->F, E = k->E, K = k->k, Tk = T * K;
    const int64_t fs = (int64_t)k->ns * F;
    char shape[80];
    snprintf(shape, sizeof shape, "T=%d D=%d F=%d E=%d k=%d s=%d%s%s", k->T, k->D, k->F, k->E, k->k,
             k->ns, k->cf > 0 ? " drop" : "", k->dead >= 0 ? " dead" : "");
    lm_error e = {0};
    lm_moe_config cfg;
    lm_moe_config_default(&cfg, k->D, k->F, k->E, k->k, k->ns);
    cfg.router.capacity_factor = k->cf;
    cfg.router.routed_scaling_factor = k->rsf;
    lm_moe_ctx *mc = NULL;
    lm_router_state st;
    memset(&st, 0, sizeof st);
    host_case h;
    memset(&h, 0, sizeof h);
    float *wr = hbuf(E * D), *dx_cpu = hbuf(T * D);
    h.n[W_G] = h.n[W_U] = E * F * D;
    h.n[W_D] = E * D * F;
    h.n[W_SG] = h.n[W_SU] = h.n[W_SD] = fs * D;
    const float sd[NW] = {1.0f / sqrtf((float)D), 1.0f / sqrtf((float)D),
                          1.0f / sqrtf((float)F), 1.0f / sqrtf((float)D),
                          1.0f / sqrtf((float)D), fs > 0 ? 1.0f / sqrtf((float)fs) : 0.0f};
    for (int i = 0; i < NW; i++) {
        h.wt[i] = hbuf(h.n[i]);
        h.g_ref[i] = hbuf(h.n[i]);
        bo_fill_normal(c, h.wt[i], h.n[i], sd[i]);
        bo_round_bf16(h.wt[i], h.n[i]);
    }
    h.x = hbuf(T * D);
    h.dy = hbuf(T * D);
    h.y_ref = hbuf(T * D);
    h.dx_ref = hbuf(T * D);
    h.dtopk_ref = hbuf(Tk);
    h.idx32 = LM_MALLOC(sizeof(int32_t) * (size_t)Tk);
    h.counts = LM_MALLOC(sizeof(int32_t) * (size_t)E);
    h.w32 = hbuf(Tk);
    bo_fill_normal(c, wr, E * D, 1.0f / sqrtf((float)D));
    bo_fill_normal(c, h.x, T * D, 1.0f);
    bo_fill_normal(c, h.dy, T * D, 1.0f);
    bo_round_bf16(wr, E * D);
    bo_round_bf16(h.x, T * D);
    bo_round_bf16(h.dy, T * D);

    /* the CPU layer, training (capacity applies), its route and gradients */
    if (lm_moe_ctx_new(&mc, &cfg, k->T, &e) != LM_OK ||
        lm_router_state_init(&st, k->E, &e) != LM_OK) {
        bo_fail(c, "moe", shape, &e);
        goto out;
    }
    if (k->dead >= 0)
        st.e_score_correction_bias[k->dead] = -1000.0f;
    {
        const lm_moe_weights w = {{wr, h.wt[W_G], h.wt[W_U], h.wt[W_D], fs ? h.wt[W_SG] : NULL,
                                   fs ? h.wt[W_SU] : NULL, fs ? h.wt[W_SD] : NULL}};
        lm_moe_grads g = {{NULL, h.g_ref[W_G], h.g_ref[W_U], h.g_ref[W_D],
                           fs ? h.g_ref[W_SG] : NULL, fs ? h.g_ref[W_SU] : NULL,
                           fs ? h.g_ref[W_SD] : NULL}};
        if (lm_moe_forward(mc, &w, &st, h.x, k->T, NULL, 0, 1, h.y_ref, &e) != LM_OK ||
            lm_moe_backward(mc, &w, h.x, h.dy, dx_cpu, &g, &e) != LM_OK) {
            bo_fail(c, "moe", shape, &e);
            goto out;
        }
    }
    {
        const lm_route *r = lm_moe_ctx_route(mc);
        int64_t dropped = 0;
        memset(h.counts, 0, sizeof(int32_t) * (size_t)E);
        for (int64_t s = 0; s < Tk; s++) {
            const int kept = r->keep[s] != 0;
            h.idx32[s] = kept ? (int32_t)r->topk_idx[s] : -1;
            h.w32[s] = kept ? r->topk_weight[s] : 0.0f;
            h.dtopk_ref[s] = kept ? mc->dw[s] : 0.0f;
            if (kept)
                h.counts[r->topk_idx[s]]++;
            dropped += !kept;
        }
        /* the reference dx: the CPU's minus the router's part dlogits W_r */
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++) {
                double s = 0;
                for (int64_t x = 0; x < E; x++)
                    s += (double)mc->dlogits[t * E + x] * wr[x * D + d];
                h.dx_ref[t * D + d] = (float)(dx_cpu[t * D + d] - s);
            }
        if ((k->cf > 0 && dropped == 0) || (k->dead >= 0 && h.counts[k->dead] != 0)) {
            lm_error why = {0};
            snprintf(why.msg, sizeof why.msg,
                     "test setup: expected drops / a dead expert (dropped %lld, count %d)",
                     (long long)dropped, k->dead >= 0 ? h.counts[k->dead] : -1);
            bo_fail(c, "moe", shape, &why);
        }
    }
    run_gpu(c, k, &cfg, &h, shape, LM_CUDA_MOE_GEMM_WGMMA, LM_CUDA_MOE_VARIANT_DEFAULT, 0);
    run_gpu(c, k, &cfg, &h, shape, LM_CUDA_MOE_GEMM_WGMMA, LM_CUDA_MOE_VARIANT_CPASYNC, 0);
    run_gpu(c, k, &cfg, &h, shape, LM_CUDA_MOE_GEMM_WGMMA, LM_CUDA_MOE_VARIANT_CPASYNC, 2);
    run_gpu(c, k, &cfg, &h, shape, LM_CUDA_MOE_GEMM_WGMMA, LM_CUDA_MOE_VARIANT_TMA, 0);
    run_gpu(c, k, &cfg, &h, shape, LM_CUDA_MOE_GEMM_WGMMA, LM_CUDA_MOE_VARIANT_TMA, 2);
    run_gpu(c, k, &cfg, &h, shape, LM_CUDA_MOE_GEMM_SIMPLE, LM_CUDA_MOE_VARIANT_DEFAULT, 0);
out:
    lm_moe_ctx_free(mc);
    lm_router_state_free(&st);
    for (int i = 0; i < NW; i++)
        free(h.wt[i]), free(h.g_ref[i]);
    free(h.x), free(h.dy), free(h.y_ref), free(h.dx_ref), free(h.dtopk_ref), free(h.idx32),
        free(h.counts), free(h.w32);
    free(wr), free(dx_cpu);
}

int bo_family_moe(bo_ctx *c) {
    const int failed0 = c->failed;
    const mcase cases[] = {
        {37, 64, 96, 8, 2, 1, 0.0f, -1, 1.0f, 1},      {37, 64, 96, 8, 2, 0, 0.6f, 5, 1.0f, 0},
        {300, 136, 40, 64, 6, 2, 0.0f, 7, 1.0f, 1},    {700, 320, 200, 4, 2, 1, 0.0f, -1, 2.5f, 0},
        {2048, 256, 128, 64, 6, 1, 0.0f, -1, 1.0f, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        moe_case(c, &cases[i]);
    return c->failed - failed0;
}
