/* test_backend_ops family "cross_entropy": lm_cuda_ce_forward_backward / lm_cuda_ce_forward
 * (include/linmoe/cuda_gemm.h) against the CPU's lm_cross_entropy_forward / _nll / _backward
 * (include/linmoe/layers.h, src/ops/cross_entropy.c) on the same bf16-rounded h and W:
 * N = 1, N = 37 with ignored labels, one chunk and several (a short last chunk), V = 1000,
 * an odd V (row padding), V = 50304, fp32 and bf16 logits, the caller's gradient scale
 * (mean = 0), every label ignored, the eval forward, and a bitwise re-run. dW starts from a
 * non-zero value (the GPU accumulates: dW += ...); dh and nll start poisoned. */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_gemm.h"
#include "linmoe/layers.h"

typedef struct {
    int N, D, V;
    int n_ignored;
    int chunk_rows;
    int logits_bf16;
    int mean;    /* 0: the caller's scale dloss */
    float dloss; /* gradient of the loss */
    int rerun;   /* also check a second run is bitwise identical */
} ce_case;

static double rms(const float *x, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return n > 0 ? sqrt(s / (double)n) : 0.0;
}

/* count of differing bytes as one row that passes only at 0 */
static int check_same(bo_ctx *c, const char *shape, const char *tensor, const void *a,
                      const void *b, size_t bytes) {
    const unsigned char *x = a, *y = b;
    float diff = 0.0f, zero = 0.0f;
    for (size_t i = 0; i < bytes; i++)
        diff += x[i] != y[i];
    return bo_check(c, "cross_entropy", "bits", shape, tensor, &diff, &zero, 1, 0.0);
}

static int run_case(bo_ctx *c, const ce_case *k) {
    lm_error e = {0};
    const int N = k->N, D = k->D, V = k->V;
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d D=%d V=%d ign=%d ch=%d%s%s", N, D, V, k->n_ignored,
             k->chunk_rows, k->logits_bf16 ? " bf16" : "", k->mean ? "" : " sum");
    const int64_t nh = (int64_t)N * D, nw = (int64_t)V * D;
    float *h = LM_MALLOC(sizeof(float) * (size_t)(nh > 0 ? nh : 1));
    float *W = LM_MALLOC(sizeof(float) * (size_t)nw);
    int32_t *lab = LM_MALLOC(sizeof(int32_t) * (size_t)(N > 0 ? N : 1));
    /* logits of std about 1.5, as a trained LM head gives */
    bo_fill_normal(c, h, nh, 1.0f);
    bo_fill_normal(c, W, nw, 1.5f / sqrtf((float)D));
    bo_round_bf16(h, nh);
    bo_round_bf16(W, nw);
    for (int i = 0; i < N; i++)
        lab[i] = (int32_t)(lm_rng_u32(&c->rng) % (uint32_t)V);
    for (int j = 0; j < k->n_ignored && j < N; j++)
        lab[(j * 7 + 3) % N] = -1;

    /* CPU reference */
    lm_ce_config cc;
    lm_ce_config_default(&cc, N, D, V);
    double loss = 0;
    int64_t cnt = 0;
    float *nll_ref = LM_MALLOC(sizeof(float) * (size_t)(N > 0 ? N : 1));
    float *dh_ref = LM_MALLOC(sizeof(float) * (size_t)(nh > 0 ? nh : 1));
    float *dW_ref = LM_MALLOC(sizeof(float) * (size_t)nw);
    lm_status st = lm_cross_entropy_forward(&cc, h, W, lab, &loss, &cnt, NULL, &e);
    if (st == LM_OK)
        st = lm_cross_entropy_nll(&cc, h, W, lab, nll_ref, NULL, &e);
    /* mean = 0: the GPU scales by dloss alone, the CPU by dloss / count */
    const float cpu_dloss = k->mean ? k->dloss : k->dloss * (float)(cnt > 0 ? cnt : 1);
    if (st == LM_OK)
        st = lm_cross_entropy_backward(&cc, h, W, lab, NULL, cpu_dloss, dh_ref, dW_ref, &e);
    if (st != LM_OK) {
        bo_fail(c, "cross_entropy", shape, &e);
        free(h), free(W), free(lab), free(nll_ref), free(dh_ref), free(dW_ref);
        return 1;
    }
    /* dW starts at values of the gradient's size: the += is checked, not masked */
    float *dW0 = LM_MALLOC(sizeof(float) * (size_t)nw);
    bo_fill_normal(c, dW0, nw, (float)(rms(dW_ref, nw) + 1e-6));

    lm_cuda_ce_config g;
    lm_cuda_ce_config_default(&g, N, D, V);
    g.chunk_rows = k->chunk_rows;
    g.logits_bf16 = k->logits_bf16;
    g.mean = k->mean;
    g.dloss = k->dloss;

    void *dh_ = bo_upload_bf16(c, h, nh, &e);
    void *dWt = dh_ ? bo_upload_bf16(c, W, nw, &e) : NULL;
    int32_t *dlab =
        dWt ? bo_upload_bytes(c, lab, sizeof(int32_t) * (size_t)(N > 0 ? N : 1), &e) : NULL;
    float *d_dW = dlab ? bo_upload_f32(c, dW0, nw, &e) : NULL;
    void *d_dh = d_dW ? bo_alloc_poisoned(c, (size_t)(nh > 0 ? nh : 1) * 2, &e) : NULL;
    float *d_nll = d_dh ? bo_alloc_poisoned(c, sizeof(float) * (size_t)(N > 0 ? N : 1), &e) : NULL;
    float *d_sc = d_nll ? bo_alloc_poisoned(c, 4 * sizeof(float), &e) : NULL; /* sum, count */
    int bad = 0;
    float *o_dh = LM_MALLOC(sizeof(float) * (size_t)(nh > 0 ? nh : 1));
    float *o_dW = LM_MALLOC(sizeof(float) * (size_t)nw);
    float *o_nll = LM_MALLOC(sizeof(float) * (size_t)(N > 0 ? N : 1));
    float sc[4];
    if (!d_sc) {
        bad = bo_fail(c, "cross_entropy", shape, &e);
        goto done;
    }
    lm_cuda_ce_outputs out = {d_sc, (int32_t *)(d_sc + 1), d_nll, d_dh, d_dW};
    st = lm_cuda_ce_forward_backward(c->cuda, &g, dh_, dWt, dlab, &out, &e);
    if (st == LM_OK)
        st = bo_download_f32(c, sc, d_sc, 4, &e);
    if (st == LM_OK)
        st = bo_download_f32(c, o_nll, d_nll, N, &e);
    if (st == LM_OK)
        st = bo_download_bf16(c, o_dh, d_dh, nh, &e);
    if (st == LM_OK)
        st = bo_download_f32(c, o_dW, d_dW, nw, &e);
    if (st != LM_OK) {
        bad = bo_fail(c, "cross_entropy", shape, &e);
        goto done;
    }
    {
        int32_t gcnt;
        memcpy(&gcnt, &sc[1], sizeof gcnt);
        const float lg = gcnt > 0 ? sc[0] / (float)gcnt : sc[0], lr = (float)loss;
        const float cg = (float)gcnt, cr = (float)cnt;
        bad |= bo_check(c, "cross_entropy", "f32", shape, "count", &cg, &cr, 1, 0.0);
        /* fp32 logits: the CPU's to ~1e-6; bf16 logits: their rounding, about 1e-4 */
        bad |= bo_check(c, "cross_entropy", "f32", shape, "loss", &lg, &lr, 1, 1e-3);
        bad |= bo_check(c, "cross_entropy", "f32", shape, "nll", o_nll, nll_ref, N, 1e-3);
        bad |= bo_check(c, "cross_entropy", "bf16", shape, "dh", o_dh, dh_ref, nh, BO_TOL_GRAD);
        for (int64_t i = 0; i < nw; i++)
            o_dW[i] -= dW0[i];
        bad |= bo_check(c, "cross_entropy", "f32", shape, "dW", o_dW, dW_ref, nw, BO_TOL_GATE_GRAD);
    }
    if (k->rerun) {
        /* the same call from the same dW0: every output bitwise the same */
        uint16_t *dh1 = LM_MALLOC(2 * (size_t)(nh > 0 ? nh : 1)),
                 *dh2 = LM_MALLOC(2 * (size_t)(nh > 0 ? nh : 1));
        float *dW1 = LM_MALLOC(sizeof(float) * (size_t)nw),
              *dW2 = LM_MALLOC(sizeof(float) * (size_t)nw);
        float sc2[4];
        st = lm_cuda_ctx_download(c->cuda, dh1, d_dh, 2 * (size_t)nh, &e);
        if (st == LM_OK)
            st = bo_download_f32(c, dW1, d_dW, nw, &e);
        if (st == LM_OK)
            st = lm_cuda_ctx_upload(c->cuda, d_dW, dW0, sizeof(float) * (size_t)nw, &e);
        if (st == LM_OK)
            st = lm_cuda_ce_forward_backward(c->cuda, &g, dh_, dWt, dlab, &out, &e);
        if (st == LM_OK)
            st = lm_cuda_ctx_download(c->cuda, dh2, d_dh, 2 * (size_t)nh, &e);
        if (st == LM_OK)
            st = bo_download_f32(c, dW2, d_dW, nw, &e);
        if (st == LM_OK)
            st = bo_download_f32(c, sc2, d_sc, 4, &e);
        if (st != LM_OK) {
            bad |= bo_fail(c, "cross_entropy", shape, &e);
        } else {
            bad |= check_same(c, shape, "rerun dh", dh1, dh2, 2 * (size_t)nh);
            bad |= check_same(c, shape, "rerun dW", dW1, dW2, sizeof(float) * (size_t)nw);
            bad |= check_same(c, shape, "rerun loss", sc, sc2, 2 * sizeof(float));
        }
        free(dh1), free(dh2), free(dW1), free(dW2);
    }
    {
        /* the eval forward: loss_sum and nll without gradients */
        lm_status s2 = lm_cuda_ctx_memset(c->cuda, d_nll, 0xFF, sizeof(float) * (size_t)N, &e);
        if (s2 == LM_OK)
            s2 = lm_cuda_ce_forward(c->cuda, &g, dh_, dWt, dlab, d_sc, NULL, d_nll, &e);
        float sc3[4];
        if (s2 == LM_OK)
            s2 = bo_download_f32(c, sc3, d_sc, 4, &e);
        if (s2 == LM_OK)
            s2 = bo_download_f32(c, o_nll, d_nll, N, &e);
        if (s2 != LM_OK) {
            bad |= bo_fail(c, "cross_entropy", shape, &e);
        } else {
            const float lf = (float)(loss * (double)cnt);
            bad |= bo_check(c, "cross_entropy", "f32", shape, "eval sum", &sc3[0], &lf, 1, 1e-3);
            bad |= bo_check(c, "cross_entropy", "f32", shape, "eval nll", o_nll, nll_ref, N, 1e-3);
        }
    }
done:
    bo_free(c, dh_);
    bo_free(c, dWt);
    bo_free(c, dlab);
    bo_free(c, d_dW);
    bo_free(c, d_dh);
    bo_free(c, d_nll);
    bo_free(c, d_sc);
    free(h), free(W), free(lab), free(nll_ref), free(dh_ref), free(dW_ref), free(dW0);
    free(o_dh), free(o_dW), free(o_nll);
    return bad;
}

int bo_family_cross_entropy(bo_ctx *c) {
    const int before = c->failed;
    /*  N   D     V      ign chunk bf16 mean dloss rerun */
    const ce_case cases[] = {
        {1, 64, 1000, 0, 0, 0, 1, 1.0f, 0},    {37, 64, 1000, 5, 0, 0, 1, 1.0f, 0},
        {37, 256, 1000, 4, 16, 0, 1, 1.0f, 1}, /* chunks of 16, 16, 5 */
        {37, 256, 1001, 3, 8, 0, 1, 1.0f, 0},  /* odd V: padded rows */
        {37, 64, 1000, 5, 16, 1, 1, 1.0f, 1},  /* bf16 logits, in place */
        {37, 64, 50304, 3, 0, 0, 1, 1.0f, 0},  {9, 256, 50304, 2, 4, 1, 1, 1.0f, 0},
        {37, 64, 1000, 5, 0, 0, 0, 0.01f, 0}, /* the caller's scale */
        {5, 64, 1000, 5, 0, 0, 1, 1.0f, 0},   /* every label ignored */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(c, &cases[i]);
    return c->failed - before;
}
