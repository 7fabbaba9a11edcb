/* test_backend_ops family "attnres": lm_cuda_attnres_forward(_ptrs) / _backward(_ptrs)
 * (include/linmoe/cuda_attnres.h) against the CPU's lm_attnres_forward_ptrs /
 * lm_attnres_backward_ptrs (include/linmoe/attnres.h, src/ops/attnres.c, fp32 with fp64
 * dot products) on the same bf16-rounded sources, do, query and rms_weight; the depth
 * weights p against a plain fp64 loop here.
 *
 * Shapes: N = 1, 5, 37, 1000; D = 37 and 100 (element path), 64 (8 threads a row), 256,
 * 1000 (a row not a multiple of 256 threads), 1024, 2048, 4096 (512 threads), 8192 (two
 * 16-byte chunks a thread); L = 1, 2, 3, 5, 6, 9 (sources in registers), 17 and 64
 * (chunks of sources: online softmax, statistics in shared memory, rows read twice).
 * Variants: query = 0 (uniform weights), a non-default scale and eps, fp32 and bf16
 * source gradients, accumulate = 1 from non-zero values (dsrc, dquery, drms_weight), a
 * NULL gradient entry, sources at a 2-byte offset (element path at D = 2048), the stacked
 * [L, N, D] entry points, and a bitwise re-run of the backward (dquery, drms_weight,
 * dsrc_0). Outputs start poisoned (NaN) unless accumulated into. Argument errors last. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/attnres.h"
#include "linmoe/cuda_attnres.h"

typedef struct {
    int N, D, L;
    int qzero;    /* query = 0 */
    int f32grad;  /* dsrc in fp32 (else bf16) */
    int acc;      /* accumulate = 1 into non-zero gradients */
    int null_src; /* a dsrc entry left NULL (-1: none) */
    int misalign; /* sources at a 2-byte offset from their allocation */
    int stacked;  /* the [L, N, D] entry points */
    int weights;  /* also ask for (and check) the depth weights */
    float scale, eps;
} ar_case;

#define OP_F "attnres_fwd"
#define OP_B "attnres_bwd"

static int check_same(bo_ctx *c, const char *op, const char *shape, const char *tensor,
                      const void *a, const void *b, size_t bytes) {
    const unsigned char *x = a, *y = b;
    float diff = 0.0f, zero = 0.0f;
    for (size_t i = 0; i < bytes; i++)
        diff += x[i] != y[i];
    return bo_check(c, op, "bits", shape, tensor, &diff, &zero, 1, 0.0);
}

/* depth weights p [L, N] in fp64 from the fp32 host inputs (attnres.h, top) */
static void ref_weights(const ar_case *k, const float *src, const float *q, const float *g,
                        float *p) {
    const int L = k->L, D = k->D;
    const int64_t N = k->N;
    double s[64];
    for (int64_t n = 0; n < N; n++) {
        double mx = -INFINITY, z = 0.0;
        for (int m = 0; m < L; m++) {
            const float *x = src + ((int64_t)m * N + n) * D;
            double ss = 0.0, su = 0.0;
            for (int j = 0; j < D; j++) {
                ss += (double)x[j] * x[j];
                su += (double)q[j] * g[j] * x[j];
            }
            s[m] = k->scale * su / sqrt(ss / D + k->eps);
            if (s[m] > mx)
                mx = s[m];
        }
        for (int m = 0; m < L; m++)
            z += (s[m] = exp(s[m] - mx));
        for (int m = 0; m < L; m++)
            p[(int64_t)m * N + n] = (float)(s[m] / z);
    }
}

typedef struct {
    void *blk[64]; /* allocations (to free) */
    void *ptr[64]; /* what the op sees */
} devset;

static void devset_free(bo_ctx *c, devset *s) {
    for (int i = 0; i < 64; i++)
        if (s->blk[i])
            bo_free(c, s->blk[i]);
}

static int run_case(bo_ctx *c, const ar_case *k) {
    lm_error e = {0};
    const int L = k->L, D = k->D, N = k->N;
    const int64_t nd = (int64_t)N * D, tot = (int64_t)L * nd;
    const size_t gsz = k->f32grad ? sizeof(float) : 2;
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d D=%d L=%d%s%s%s%s%s%s", N, D, L, k->qzero ? " q0" : "",
             k->f32grad ? " f32" : "", k->acc ? " acc" : "", k->null_src >= 0 ? " null" : "",
             k->misalign ? " mis" : "", k->stacked ? " stk" : "");
    if (k->scale != 1.0f)
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " s=%g", (double)k->scale);

    /* inputs: sources of growing size (block sums grow with depth), logits of order 1-2 */
    float *src = LM_MALLOC(sizeof(float) * (size_t)tot);
    float *q = LM_MALLOC(sizeof(float) * (size_t)D), *g = LM_MALLOC(sizeof(float) * (size_t)D);
    float *dout = LM_MALLOC(sizeof(float) * (size_t)nd);
    for (int m = 0; m < L; m++)
        bo_fill_normal(c, src + (int64_t)m * nd, nd, 0.5f + 0.4f * (float)(m % 5));
    bo_fill_normal(c, q, D, 2.0f / sqrtf((float)D));
    if (k->qzero)
        memset(q, 0, sizeof(float) * (size_t)D);
    bo_fill_normal(c, g, D, 0.1f);
    for (int j = 0; j < D; j++)
        g[j] += 1.0f;
    bo_fill_normal(c, dout, nd, 1.0f);
    bo_round_bf16(src, tot);
    bo_round_bf16(q, D);
    bo_round_bf16(g, D);
    bo_round_bf16(dout, nd);
    /* gradient starting values (accumulate = 1), exactly representable in the GPU dtype */
    float *dsrc0 = LM_MALLOC(sizeof(float) * (size_t)tot);
    float *dq0 = LM_MALLOC(sizeof(float) * (size_t)D), *dg0 = LM_MALLOC(sizeof(float) * (size_t)D);
    bo_fill_normal(c, dsrc0, tot, 0.1f);
    bo_fill_normal(c, dq0, D, 0.5f);
    bo_fill_normal(c, dg0, D, 0.5f);
    if (!k->f32grad)
        bo_round_bf16(dsrc0, tot);

    /* CPU reference */
    lm_attnres_config cfg;
    lm_attnres_config_default(&cfg, L, N, D);
    cfg.scale = k->scale;
    cfg.eps = k->eps;
    cfg.accumulate = k->acc;
    const float *sp[64];
    float *dp[64];
    float *o_ref = LM_MALLOC(sizeof(float) * (size_t)nd);
    float *dsrc_ref = LM_MALLOC(sizeof(float) * (size_t)tot);
    float *dq_ref = LM_MALLOC(sizeof(float) * (size_t)D),
          *dg_ref = LM_MALLOC(sizeof(float) * (size_t)D);
    float *w_ref = LM_MALLOC(sizeof(float) * (size_t)L * (size_t)N);
    memcpy(dsrc_ref, dsrc0, sizeof(float) * (size_t)tot);
    memcpy(dq_ref, dq0, sizeof(float) * (size_t)D);
    memcpy(dg_ref, dg0, sizeof(float) * (size_t)D);
    for (int m = 0; m < L; m++) {
        sp[m] = src + (int64_t)m * nd;
        dp[m] = m == k->null_src ? NULL : dsrc_ref + (int64_t)m * nd;
    }
    lm_status st = lm_attnres_forward_ptrs(&cfg, sp, q, g, o_ref, &e);
    if (st == LM_OK)
        st = lm_attnres_backward_ptrs(&cfg, sp, q, g, dout, dp, dq_ref, dg_ref, &e);
    if (k->weights)
        ref_weights(k, src, q, g, w_ref);

    /* device buffers */
    devset S, G;
    memset(&S, 0, sizeof S);
    memset(&G, 0, sizeof G);
    void *d_do = NULL, *d_o = NULL;
    float *d_q = NULL, *d_g = NULL, *d_dq = NULL, *d_dg = NULL, *d_w = NULL;
    int fails = 0;
    if (st != LM_OK)
        goto fail;
    uint16_t *hb = LM_MALLOC(sizeof(uint16_t) * (size_t)(nd > 0 ? nd : 1));
    if (k->stacked) {
        if (!(S.blk[0] = bo_upload_bf16(c, src, tot, &e)))
            goto fail_hb;
        for (int m = 0; m < L; m++)
            S.ptr[m] = (char *)S.blk[0] + (size_t)m * (size_t)nd * 2;
    } else {
        for (int m = 0; m < L; m++) {
            const size_t off = k->misalign ? 2 : 0;
            if (lm_cuda_ctx_alloc(c->cuda, &S.blk[m], (size_t)nd * 2 + 16, &e) != LM_OK)
                goto fail_hb;
            S.ptr[m] = (char *)S.blk[m] + off;
            for (int64_t i = 0; i < nd; i++)
                hb[i] = lm_f32_to_bf16(src[(int64_t)m * nd + i]);
            if (lm_cuda_ctx_upload(c->cuda, S.ptr[m], hb, (size_t)nd * 2, &e) != LM_OK)
                goto fail_hb;
        }
    }
    /* gradients: one block (stacked) or one buffer per source; the starting values
     * (accumulate) or poison */
    {
        const int nbuf = k->stacked ? 1 : L;
        const int64_t per = k->stacked ? tot : nd;
        for (int b = 0; b < nbuf; b++) {
            if (!k->stacked && b == k->null_src)
                continue;
            const float *init = dsrc0 + (int64_t)b * nd;
            if (!k->acc)
                G.blk[b] = bo_alloc_poisoned(c, (size_t)per * gsz, &e);
            else if (k->f32grad)
                G.blk[b] = bo_upload_f32(c, init, per, &e);
            else
                G.blk[b] = bo_upload_bf16(c, init, per, &e);
            if (!G.blk[b])
                goto fail_hb;
        }
        for (int m = 0; m < L; m++)
            G.ptr[m] = k->stacked ? (char *)G.blk[0] + (size_t)m * (size_t)nd * gsz : G.blk[m];
    }
    if (!(d_do = bo_upload_bf16(c, dout, nd, &e)) || !(d_q = bo_upload_f32(c, q, D, &e)) ||
        !(d_g = bo_upload_f32(c, g, D, &e)) || !(d_o = bo_alloc_poisoned(c, (size_t)nd * 2, &e)))
        goto fail_hb;
    if (k->acc) {
        if (!(d_dq = bo_upload_f32(c, dq0, D, &e)) || !(d_dg = bo_upload_f32(c, dg0, D, &e)))
            goto fail_hb;
    } else if (!(d_dq = bo_alloc_poisoned(c, sizeof(float) * (size_t)D, &e)) ||
               !(d_dg = bo_alloc_poisoned(c, sizeof(float) * (size_t)D, &e))) {
        goto fail_hb;
    }
    if (k->weights && !(d_w = bo_alloc_poisoned(c, sizeof(float) * (size_t)L * N, &e)))
        goto fail_hb;
    free(hb);
    hb = NULL;

    /* the op */
    const lm_dtype gt = k->f32grad ? LM_F32 : LM_BF16;
    if (k->stacked) {
        st = lm_cuda_attnres_forward(c->cuda, &cfg, S.blk[0], d_q, d_g, d_o, d_w, &e);
        if (st == LM_OK)
            st = lm_cuda_attnres_backward(c->cuda, &cfg, S.blk[0], d_q, d_g, d_do, G.blk[0], gt,
                                          d_dq, d_dg, &e);
    } else {
        st = lm_cuda_attnres_forward_ptrs(c->cuda, &cfg, (const void *const *)S.ptr, d_q, d_g, d_o,
                                          d_w, &e);
        if (st == LM_OK)
            st = lm_cuda_attnres_backward_ptrs(c->cuda, &cfg, (const void *const *)S.ptr, d_q, d_g,
                                               d_do, G.ptr, gt, d_dq, d_dg, &e);
    }
    if (st == LM_OK)
        st = lm_cuda_ctx_sync(c->cuda, &e);
    if (st != LM_OK)
        goto fail;

    /* compare */
    {
        float *out = LM_MALLOC(sizeof(float) * (size_t)(nd > L * (int64_t)N ? nd : L * (int64_t)N));
        float *dq = LM_MALLOC(sizeof(float) * (size_t)D),
              *dg = LM_MALLOC(sizeof(float) * (size_t)D);
        char name[32];
        if (bo_download_bf16(c, out, d_o, nd, &e) != LM_OK)
            goto fail_out;
        fails += bo_check(c, OP_F, "bf16", shape, "o", out, o_ref, nd, BO_TOL_FWD);
        if (k->weights) {
            if (bo_download_f32(c, out, d_w, (int64_t)L * N, &e) != LM_OK)
                goto fail_out;
            /* fp32 softmax of fp32 logits: ~1e-6; 1e-4 still catches a wrong index */
            fails += bo_check(c, OP_F, "fp32", shape, "p", out, w_ref, (int64_t)L * N, 1e-4);
        }
        for (int m = 0; m < L; m++) {
            if (m == k->null_src)
                continue;
            st = k->f32grad ? bo_download_f32(c, out, G.ptr[m], nd, &e)
                            : bo_download_bf16(c, out, G.ptr[m], nd, &e);
            if (st != LM_OK)
                goto fail_out;
            snprintf(name, sizeof name, "dsrc_%d", m);
            fails += bo_check(c, OP_B, k->f32grad ? "fp32" : "bf16", shape, name, out,
                              dsrc_ref + (int64_t)m * nd, nd, BO_TOL_GRAD);
        }
        if (bo_download_f32(c, dq, d_dq, D, &e) != LM_OK ||
            bo_download_f32(c, dg, d_dg, D, &e) != LM_OK)
            goto fail_out;
        fails += bo_check(c, OP_B, "fp32", shape, "dquery", dq, dq_ref, D, BO_TOL_GATE_GRAD);
        fails += bo_check(c, OP_B, "fp32", shape, "drms_w", dg, dg_ref, D, BO_TOL_GATE_GRAD);

        /* bitwise re-run of the backward (overwrite mode only: accumulate would add twice) */
        if (!k->acc && !k->stacked) {
            float *dq2 = LM_MALLOC(sizeof(float) * (size_t)D),
                  *dg2 = LM_MALLOC(sizeof(float) * (size_t)D);
            float *g0 = LM_MALLOC(sizeof(float) * (size_t)nd);
            const int m0 = k->null_src == 0 ? 1 : 0;
            st = m0 < L ? (k->f32grad ? bo_download_f32(c, g0, G.ptr[m0], nd, &e)
                                      : bo_download_bf16(c, g0, G.ptr[m0], nd, &e))
                        : LM_OK;
            if (st == LM_OK)
                st = lm_cuda_attnres_backward_ptrs(c->cuda, &cfg, (const void *const *)S.ptr, d_q,
                                                   d_g, d_do, G.ptr, gt, d_dq, d_dg, &e);
            if (st == LM_OK)
                st = bo_download_f32(c, dq2, d_dq, D, &e);
            if (st == LM_OK)
                st = bo_download_f32(c, dg2, d_dg, D, &e);
            if (st == LM_OK && m0 < L)
                st = k->f32grad ? bo_download_f32(c, out, G.ptr[m0], nd, &e)
                                : bo_download_bf16(c, out, G.ptr[m0], nd, &e);
            if (st == LM_OK) {
                fails += check_same(c, OP_B, shape, "dq rerun", dq, dq2, sizeof(float) * (size_t)D);
                fails += check_same(c, OP_B, shape, "dg rerun", dg, dg2, sizeof(float) * (size_t)D);
                if (m0 < L)
                    fails += check_same(c, OP_B, shape, "dsrc rerun", g0, out,
                                        sizeof(float) * (size_t)nd);
            } else {
                fails += bo_fail(c, OP_B, shape, &e);
            }
            free(dq2), free(dg2), free(g0);
        }
        free(out), free(dq), free(dg);
        goto done;
    fail_out:
        free(out), free(dq), free(dg);
        goto fail;
    }
fail_hb:
    free(hb);
fail:
    fails += bo_fail(c, OP_F, shape, &e);
done:
    devset_free(c, &S);
    devset_free(c, &G);
    bo_free(c, d_do), bo_free(c, d_o), bo_free(c, d_q), bo_free(c, d_g);
    bo_free(c, d_dq), bo_free(c, d_dg), bo_free(c, d_w);
    free(src), free(q), free(g), free(dout), free(dsrc0), free(dq0), free(dg0);
    free(o_ref), free(dsrc_ref), free(dq_ref), free(dg_ref), free(w_ref);
    return fails;
}

/* Bad arguments: each call must fail with the expected status before touching memory. */
static int check_errors(bo_ctx *c) {
    lm_error e = {0};
    int fails = 0;
    void *dummy = NULL;
    if (lm_cuda_ctx_alloc(c->cuda, &dummy, 4096, &e) != LM_OK)
        return bo_fail(c, OP_F, "errors", &e);
    const void *tab[65];
    void *dtab[65];
    for (int i = 0; i < 65; i++)
        tab[i] = dtab[i] = dummy;
    const float *f = (const float *)dummy;
    struct {
        const char *what;
        int L, D, null_o;
        lm_dtype gt;
        lm_status want;
    } cases[] = {
        {"L=65", 65, 64, 0, LM_BF16, LM_ERR_UNSUPPORTED},
        {"L=0", 0, 64, 0, LM_BF16, LM_ERR_INVALID},
        {"D=9000", 2, 9000, 0, LM_BF16, LM_ERR_UNSUPPORTED},
        {"D=4100 odd", 2, 4100, 0, LM_BF16, LM_ERR_UNSUPPORTED},
        {"o=NULL", 2, 64, 1, LM_BF16, LM_ERR_INVALID},
        {"dsrc F16", 2, 64, 0, LM_F16, LM_ERR_UNSUPPORTED},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_attnres_config cfg;
        lm_attnres_config_default(&cfg, cases[i].L, 1, cases[i].D);
        lm_status st;
        if (cases[i].gt != LM_BF16)
            st = lm_cuda_attnres_backward_ptrs(c->cuda, &cfg, tab, f, f, dummy, dtab, cases[i].gt,
                                               NULL, NULL, &e);
        else
            st = lm_cuda_attnres_forward_ptrs(c->cuda, &cfg, tab, f, f,
                                              cases[i].null_o ? NULL : dummy, NULL, &e);
        const float got = st == cases[i].want ? 0.0f : 1.0f, zero = 0.0f;
        if (got != 0.0f)
            printf("attnres errors: %s: status %d (want %d): %s\n", cases[i].what, (int)st,
                   (int)cases[i].want, e.msg);
        fails += bo_check(c, OP_F, "-", cases[i].what, "status", &got, &zero, 1, 0.0);
    }
    bo_free(c, dummy);
    return fails;
}

int bo_family_attnres(bo_ctx *c) {
    /*  N     D    L  q0 f32 acc null mis stk  w  scale eps */
    const ar_case cases[] = {
        {1, 64, 1, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {37, 64, 2, 0, 1, 1, -1, 0, 0, 1, 1.0f, 1e-6f},
        {1000, 64, 17, 0, 0, 0, 3, 0, 0, 1, 1.0f, 1e-6f},
        {37, 1000, 9, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {1000, 1000, 17, 0, 0, 1, -1, 0, 0, 0, 1.0f, 1e-6f},
        {1000, 2048, 9, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {1000, 2048, 9, 1, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {1000, 2048, 9, 0, 1, 1, -1, 0, 0, 0, 1.0f, 1e-6f},
        {37, 2048, 17, 0, 0, 0, -1, 0, 1, 1, 1.0f, 1e-6f},
        {1, 2048, 2, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {1000, 1024, 5, 0, 0, 0, 0, 0, 0, 1, 0.5f, 1e-5f},
        {37, 37, 9, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {37, 2048, 9, 0, 0, 1, -1, 1, 0, 1, 1.0f, 1e-6f},
        {37, 4096, 3, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {5, 8192, 6, 0, 1, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {37, 256, 64, 0, 0, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {1000, 1000, 2, 1, 1, 0, -1, 0, 0, 1, 1.0f, 1e-6f},
        {37, 100, 2, 0, 0, 1, -1, 0, 0, 1, 2.0f, 1e-6f},
    };
    int fails = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        fails += run_case(c, &cases[i]);
    fails += check_errors(c);
    return fails;
}
