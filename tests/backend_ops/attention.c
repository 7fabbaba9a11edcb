/* test_backend_ops family "attention": the CUDA attention op (include/linmoe/cuda_attention.h)
 * against the CPU fp32 op (include/linmoe/attention.h: lm_attention_forward / backward /
 * cache_write / decode) on the same bf16-rounded inputs.
 *
 * Cases: T = 1, 37, 130, 300 (not multiples of the 64 / 128 tiles; 300 has several query
 * and key blocks, so the ordered dQ accumulation chains over five key blocks), Hq/Hkv =
 * 4/4, 4/2, 8/1, D = 64 and 128, packed documents cu_seqlens {0,0,1,50,51,180} (an empty
 * and two length-1 documents), NoPE and RoPE (theta 1e4 and 5e5). Compared: o, lse
 * (BO_TOL_FWD), dq, dk, dv (BO_TOL_GRAD); the backward is run twice and must be bitwise
 * equal (tolerance 0), once more with the context option "deterministic" = 0 (float
 * atomics) against the reference; RoPE alone forward and inverse; the KV-cache writer and
 * the decode step (one split and several) against lm_attention_cache_write / decode. Every
 * case runs with our forward kernel; the dense ones again with cuDNN's fused forward
 * (lm_cuda_attention_set_impl CUDNN; a refusal fails its row, except at T = 1 where the
 * default AUTO would run ours) followed by our backward from cuDNN's o and lse.
 * Outputs go to poisoned (NaN) buffers, so an unwritten element fails its row. */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/attention.h"
#include "linmoe/cuda_attention.h"
#include "ops/cpu/attention_cpu.h" /* lm_attn_rope_factors, lm_attn_rope_rotate */

#define AT_MAXBUF 16

typedef struct {
    bo_ctx *c;
    void *p[AT_MAXBUF];
    int n;
} at_mem;

static void *at_keep(at_mem *m, void *p) {
    if (p && m->n < AT_MAXBUF)
        m->p[m->n++] = p;
    return p;
}
static void at_free_all(at_mem *m) {
    for (int i = 0; i < m->n; i++)
        bo_free(m->c, m->p[i]);
    m->n = 0;
}

typedef struct {
    int B, T, Hq, Hkv, D;
    const int64_t *cu;
    int ncu;
    int rope;
    double theta;
    int repeat; /* also check determinism and the atomic path */
} at_case;

static void at_shape(const at_case *k, char *buf, size_t n) {
    if (k->cu)
        snprintf(buf, n, "varlen%d T=%d H=%d/%d D=%d %s", k->ncu - 1, k->T, k->Hq, k->Hkv, k->D,
                 k->rope ? "rope" : "nope");
    else
        snprintf(buf, n, "B=%d T=%d H=%d/%d D=%d %s", k->B, k->T, k->Hq, k->Hkv, k->D,
                 k->rope ? "rope" : "nope");
}

static float *at_randn(bo_ctx *c, int64_t n, float s) {
    float *x = LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
    bo_fill_normal(c, x, n, s);
    bo_round_bf16(x, n);
    return x;
}

/* impl: LM_CUDA_ATTN_OWN or LM_CUDA_ATTN_CUDNN for the forward (the backward is ours) */
static int at_run_case(bo_ctx *c, const at_case *k, int impl) {
    char shape[96];
    at_shape(k, shape, sizeof shape);
    const char *fwd_op = impl == LM_CUDA_ATTN_CUDNN ? "attention fwd cudnn" : "attention fwd";
    const char *bwd_op = impl == LM_CUDA_ATTN_CUDNN ? "attention bwd cudnn" : "attention bwd";
    const int before = c->failed;
    lm_error e = {0};
    lm_attention_config cfg;
    lm_attention_config_default(&cfg, k->B, k->T, k->Hq, k->Hkv, k->D);
    cfg.cu_seqlens = k->cu;
    cfg.n_cu_seqlens = k->ncu;
    cfg.position = k->rope ? LM_POS_ROPE : LM_POS_NOPE;
    cfg.rope_theta = k->theta;
    const int64_t BT = (int64_t)k->B * k->T, nq = BT * k->Hq * k->D, nk = BT * k->Hkv * k->D,
                  nl = BT * k->Hq;
    float *q = at_randn(c, nq, 1.0f), *kk = at_randn(c, nk, 1.0f), *v = at_randn(c, nk, 1.0f);
    float *dO = at_randn(c, nq, 1.0f);
    float *o = LM_MALLOC(sizeof(float) * (size_t)nq), *lse = LM_MALLOC(sizeof(float) * (size_t)nl);
    float *dq = LM_MALLOC(sizeof(float) * (size_t)nq), *dk = LM_MALLOC(sizeof(float) * (size_t)nk),
          *dv = LM_MALLOC(sizeof(float) * (size_t)nk);
    float *g = LM_MALLOC(sizeof(float) * (size_t)nq), *g2 = LM_MALLOC(sizeof(float) * (size_t)nq);
    at_mem m = {c, {0}, 0};
    lm_attention_inputs in = {q, kk, v};
    lm_attention_grads gr = {dO, dq, dk, dv};
    if (lm_attention_forward(&cfg, &in, o, lse, &e) != LM_OK ||
        lm_attention_backward(&cfg, &in, o, lse, &gr, &e) != LM_OK) {
        bo_fail(c, "attention cpu", shape, &e);
        goto done;
    }
    void *dq_ = at_keep(&m, bo_upload_bf16(c, q, nq, &e));
    void *dk_ = at_keep(&m, bo_upload_bf16(c, kk, nk, &e));
    void *dv_ = at_keep(&m, bo_upload_bf16(c, v, nk, &e));
    void *ddo = at_keep(&m, bo_upload_bf16(c, dO, nq, &e));
    void *go = at_keep(&m, bo_alloc_poisoned(c, (size_t)nq * 2, &e));
    float *glse = at_keep(&m, bo_alloc_poisoned(c, (size_t)nl * 4, &e));
    void *gdq = at_keep(&m, bo_alloc_poisoned(c, (size_t)nq * 2, &e));
    void *gdk = at_keep(&m, bo_alloc_poisoned(c, (size_t)nk * 2, &e));
    void *gdv = at_keep(&m, bo_alloc_poisoned(c, (size_t)nk * 2, &e));
    if (m.n != 9) {
        bo_fail(c, "attention", shape, &e);
        goto done;
    }
    lm_status fst = lm_cuda_attention_set_impl(c->cuda, impl, &e);
    if (fst == LM_OK)
        fst = lm_cuda_attention_forward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, &e);
    lm_cuda_attention_set_impl(c->cuda, LM_CUDA_ATTN_AUTO, NULL);
    if (fst == LM_ERR_UNSUPPORTED && impl == LM_CUDA_ATTN_CUDNN && k->T == 1) {
        /* a single-token sequence may be outside cuDNN's engine: AUTO runs ours there */
        printf("| %-14s | %-5s | %-34s | %-10s | %9s | %6s | %s |\n", fwd_op, "bf16", shape, "o",
               "-", "-", "cudnn refused (not counted)");
        goto done;
    }
    if (fst == LM_OK && lm_cuda_attention_last_impl(c->cuda) != impl)
        fst = lm_errorf(&e, LM_ERR_INVALID, "forward ran implementation %d, not %d",
                        lm_cuda_attention_last_impl(c->cuda), impl);
    if (fst != LM_OK || bo_download_bf16(c, g, go, nq, &e) != LM_OK) {
        bo_fail(c, fwd_op, shape, &e);
        goto done;
    }
    bo_check(c, fwd_op, "bf16", shape, "o", g, o, nq, BO_TOL_FWD);
    if (bo_download_f32(c, g, glse, nl, &e) != LM_OK) {
        bo_fail(c, fwd_op, shape, &e);
        goto done;
    }
    bo_check(c, fwd_op, "bf16", shape, "lse", g, lse, nl, BO_TOL_FWD);
    if (lm_cuda_attention_backward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, ddo, gdq, gdk, gdv,
                                   &e) != LM_OK) {
        bo_fail(c, bwd_op, shape, &e);
        goto done;
    }
    const struct {
        const char *name;
        void *dev;
        const float *ref;
        int64_t n;
    } outs[3] = {{"dq", gdq, dq, nq}, {"dk", gdk, dk, nk}, {"dv", gdv, dv, nk}};
    for (int i = 0; i < 3; i++) {
        if (bo_download_bf16(c, g, outs[i].dev, outs[i].n, &e) != LM_OK) {
            bo_fail(c, bwd_op, shape, &e);
            goto done;
        }
        bo_check(c, bwd_op, "bf16", shape, outs[i].name, g, outs[i].ref, outs[i].n, BO_TOL_GRAD);
    }
    if (k->repeat && impl == LM_CUDA_ATTN_OWN) {
        /* the same backward again into fresh poisoned buffers: bitwise equal */
        float *first = LM_MALLOC(sizeof(float) * (size_t)nq);
        for (int i = 0; i < 3 && c->failed == before; i++) {
            void *again = bo_alloc_poisoned(c, (size_t)outs[i].n * 2, &e);
            void *o3[3] = {gdq, gdk, gdv};
            o3[i] = again;
            lm_status st = again ? LM_OK : LM_ERR_NOMEM;
            if (st == LM_OK)
                st = bo_download_bf16(c, first, outs[i].dev, outs[i].n, &e);
            if (st == LM_OK)
                st = lm_cuda_attention_backward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, ddo, o3[0],
                                                o3[1], o3[2], &e);
            if (st == LM_OK)
                st = bo_download_bf16(c, g2, again, outs[i].n, &e);
            if (st != LM_OK)
                bo_fail(c, "attention bwd", shape, &e);
            else
                bo_check(c, "attention bwd x2", "bf16", shape, outs[i].name, g2, first, outs[i].n,
                         0.0);
            if (again)
                bo_free(c, again);
        }
        free(first);
        /* the float-atomic dQ path (context option deterministic = 0) */
        if (lm_cuda_ctx_set_option(c->cuda, "deterministic", 0, &e) != LM_OK ||
            lm_cuda_attention_backward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, ddo, gdq, gdk, gdv,
                                       &e) != LM_OK ||
            lm_cuda_ctx_set_option(c->cuda, "deterministic", 1, &e) != LM_OK ||
            bo_download_bf16(c, g, gdq, nq, &e) != LM_OK) {
            lm_cuda_ctx_set_option(c->cuda, "deterministic", 1, NULL);
            bo_fail(c, "attention bwd", shape, &e);
            goto done;
        }
        bo_check(c, "attention bwd atomic", "bf16", shape, "dq", g, dq, nq, BO_TOL_GRAD);
    }
done:
    at_free_all(&m);
    free(q), free(kk), free(v), free(dO), free(o), free(lse), free(dq), free(dk), free(dv);
    free(g), free(g2);
    return c->failed - before;
}

/* RoPE alone: y = R x and x = R^T y against the CPU rotation (fp64 angles, fp32 math). */
static int at_rope(bo_ctx *c) {
    const int before = c->failed;
    static const int64_t cu[] = {0, 3, 3, 40, 97};
    const int T = 97, H = 3, D = 128;
    const char *shape = "varlen4 T=97 H=3 D=128";
    lm_error e = {0};
    lm_attention_config cfg;
    lm_attention_config_default(&cfg, 1, T, H, H, D);
    cfg.cu_seqlens = cu;
    cfg.n_cu_seqlens = 5;
    cfg.rope_theta = 10000.0;
    const int64_t n = (int64_t)T * H * D;
    float *x = at_randn(c, n, 1.0f), *ref = LM_MALLOC(sizeof(float) * (size_t)n);
    float *g = LM_MALLOC(sizeof(float) * (size_t)n);
    float cs[64], sn[64];
    for (int t = 0; t < T; t++) {
        int d = 0;
        while (d + 1 < 5 && cu[d + 1] <= t)
            d++;
        lm_attn_rope_factors(10000.0, D, t - cu[d], cs, sn);
        for (int h = 0; h < H; h++)
            lm_attn_rope_rotate(x + ((int64_t)t * H + h) * D, ref + ((int64_t)t * H + h) * D, D, cs,
                                sn, 0);
    }
    void *dx = bo_upload_bf16(c, x, n, &e), *dy = bo_alloc_poisoned(c, (size_t)n * 2, &e);
    if (!dx || !dy || lm_cuda_attention_rope(c->cuda, &cfg, H, dx, dy, 0, &e) != LM_OK ||
        bo_download_bf16(c, g, dy, n, &e) != LM_OK) {
        bo_fail(c, "attention rope", shape, &e);
    } else {
        bo_check(c, "attention rope", "bf16", shape, "y", g, ref, n, BO_TOL_FWD);
        /* inverse in place: back to x */
        if (lm_cuda_attention_rope(c->cuda, &cfg, H, dy, dy, 1, &e) != LM_OK ||
            bo_download_bf16(c, g, dy, n, &e) != LM_OK)
            bo_fail(c, "attention rope", shape, &e);
        else
            bo_check(c, "attention rope^T", "bf16", shape, "x", g, x, n, BO_TOL_FWD);
    }
    if (dx)
        bo_free(c, dx);
    if (dy)
        bo_free(c, dy);
    free(x), free(ref), free(g);
    return c->failed - before;
}

/* Prefill the cache with positions 0..pos-1, write token pos, decode at pos. */
static int at_decode(bo_ctx *c, int B, int Hq, int Hkv, int D, int64_t Tmax, int64_t pos,
                     int rope) {
    const int before = c->failed;
    char shape[96];
    snprintf(shape, sizeof shape, "B=%d pos=%lld H=%d/%d D=%d %s", B, (long long)pos, Hq, Hkv, D,
             rope ? "rope" : "nope");
    lm_error e = {0};
    const int64_t L = pos + 1, nk = (int64_t)B * L * Hkv * D, nc = (int64_t)B * Tmax * Hkv * D,
                  nq = (int64_t)B * Hq * D;
    float *k = at_randn(c, nk, 1.0f), *v = at_randn(c, nk, 1.0f), *q = at_randn(c, nq, 1.0f);
    float *kc = calloc((size_t)nc, sizeof(float)), *vc = calloc((size_t)nc, sizeof(float));
    float *o = LM_MALLOC(sizeof(float) * (size_t)nq),
          *lse = LM_MALLOC(sizeof(float) * (size_t)B * Hq);
    float *g = LM_MALLOC(sizeof(float) * (size_t)(nc > nq ? nc : nq));
    float *kc2 = LM_MALLOC(sizeof(float) * (size_t)nk);
    at_mem m = {c, {0}, 0};
    /* k, v as [B, L, Hkv, D]: the prefill is rows 0..pos-1, the new token row pos */
    float *kp = LM_MALLOC(sizeof(float) * (size_t)nk), *vp = LM_MALLOC(sizeof(float) * (size_t)nk);
    float *kn = LM_MALLOC(sizeof(float) * (size_t)B * Hkv * D),
          *vn = LM_MALLOC(sizeof(float) * (size_t)B * Hkv * D);
    const int64_t row = (int64_t)Hkv * D;
    for (int b = 0; b < B; b++) {
        memcpy(kp + b * pos * row, k + b * L * row, sizeof(float) * (size_t)(pos * row));
        memcpy(vp + b * pos * row, v + b * L * row, sizeof(float) * (size_t)(pos * row));
        memcpy(kn + b * row, k + (b * L + pos) * row, sizeof(float) * (size_t)row);
        memcpy(vn + b * row, v + (b * L + pos) * row, sizeof(float) * (size_t)row);
    }
    lm_attention_config pre, one;
    lm_attention_config_default(&pre, B, (int)pos, Hq, Hkv, D);
    lm_attention_config_default(&one, B, 1, Hq, Hkv, D);
    pre.position = one.position = rope ? LM_POS_ROPE : LM_POS_NOPE;
    if ((pos > 0 && lm_attention_cache_write(&pre, Tmax, 0, kp, vp, kc, vc, &e) != LM_OK) ||
        lm_attention_cache_write(&one, Tmax, pos, kn, vn, kc, vc, &e) != LM_OK ||
        lm_attention_decode(&one, Tmax, pos, q, kc, vc, o, lse, &e) != LM_OK) {
        bo_fail(c, "attention cpu", shape, &e);
        goto done;
    }
    void *dkc = at_keep(&m, bo_alloc_poisoned(c, (size_t)nc * 2, &e));
    void *dvc = at_keep(&m, bo_alloc_poisoned(c, (size_t)nc * 2, &e));
    void *dkp = at_keep(&m, bo_upload_bf16(c, kp, pos > 0 ? B * pos * row : 1, &e));
    void *dvp = at_keep(&m, bo_upload_bf16(c, vp, pos > 0 ? B * pos * row : 1, &e));
    void *dkn = at_keep(&m, bo_upload_bf16(c, kn, B * row, &e));
    void *dvn = at_keep(&m, bo_upload_bf16(c, vn, B * row, &e));
    void *dq = at_keep(&m, bo_upload_bf16(c, q, nq, &e));
    void *dout = at_keep(&m, bo_alloc_poisoned(c, (size_t)nq * 2, &e));
    float *dl = at_keep(&m, bo_alloc_poisoned(c, (size_t)B * Hq * 4, &e));
    if (m.n != 9 ||
        (pos > 0 &&
         lm_cuda_attention_cache_write(c->cuda, &pre, Tmax, 0, dkp, dvp, dkc, dvc, &e) != LM_OK) ||
        lm_cuda_attention_cache_write(c->cuda, &one, Tmax, pos, dkn, dvn, dkc, dvc, &e) != LM_OK ||
        lm_cuda_attention_decode(c->cuda, &one, Tmax, pos, dq, dkc, dvc, dout, dl, &e) != LM_OK) {
        bo_fail(c, "attention decode", shape, &e);
        goto done;
    }
    /* the cache rows 0..pos of every batch row (the rest stays poisoned, unread) */
    if (bo_download_bf16(c, g, dkc, nc, &e) != LM_OK) {
        bo_fail(c, "attention cache", shape, &e);
        goto done;
    }
    for (int b = 0; b < B; b++) { /* rows 0..pos of both caches, packed as [B, L, Hkv, D] */
        memcpy(kc2 + b * L * row, g + b * Tmax * row, sizeof(float) * (size_t)(L * row));
        memcpy(k + b * L * row, kc + b * Tmax * row, sizeof(float) * (size_t)(L * row));
    }
    bo_check(c, "attention cache", "bf16", shape, "k_cache", kc2, k, nk, BO_TOL_FWD);
    if (bo_download_bf16(c, g, dout, nq, &e) != LM_OK) {
        bo_fail(c, "attention decode", shape, &e);
        goto done;
    }
    bo_check(c, "attention decode", "bf16", shape, "o", g, o, nq, BO_TOL_FWD);
    if (bo_download_f32(c, g, dl, (int64_t)B * Hq, &e) != LM_OK) {
        bo_fail(c, "attention decode", shape, &e);
        goto done;
    }
    bo_check(c, "attention decode", "bf16", shape, "lse", g, lse, (int64_t)B * Hq, BO_TOL_FWD);
done:
    at_free_all(&m);
    free(k), free(v), free(q), free(kc), free(vc), free(o), free(lse), free(g), free(kc2);
    free(kp), free(vp), free(kn), free(vn);
    return c->failed - before;
}

int bo_family_attention(bo_ctx *c) {
    const int before = c->failed;
    static const int64_t cu6[] = {0, 0, 1, 50, 51, 180};
    const at_case cases[] = {
        {2, 37, 4, 4, 64, NULL, 0, 0, 1e4, 1},   {1, 1, 4, 2, 128, NULL, 0, 1, 1e4, 0},
        {2, 130, 4, 2, 128, NULL, 0, 1, 1e4, 1}, {1, 130, 8, 1, 64, NULL, 0, 0, 1e4, 0},
        {1, 180, 4, 2, 128, cu6, 6, 1, 1e4, 1},  {1, 180, 8, 1, 64, cu6, 6, 0, 1e4, 0},
        {1, 300, 4, 4, 128, NULL, 0, 1, 5e5, 1}, {1, 1, 8, 1, 64, NULL, 0, 0, 1e4, 0},
        {1, 180, 4, 4, 64, cu6, 6, 1, 5e5, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        at_run_case(c, &cases[i], LM_CUDA_ATTN_OWN);
    /* the cuDNN forward (dense batches only), our backward from its o and lse */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!cases[i].cu)
            at_run_case(c, &cases[i], LM_CUDA_ATTN_CUDNN);
    at_rope(c);
    at_decode(c, 2, 8, 2, 128, 80, 70, 1);    /* one split per (b, g) */
    at_decode(c, 1, 4, 4, 64, 1024, 1000, 0); /* 16 splits merged */
    at_decode(c, 3, 4, 1, 128, 8, 0, 1);      /* pos 0: the token alone */
    at_decode(c, 1, 32, 1, 128, 300, 299, 1); /* 32 heads per kv head: two head slices */
    return c->failed - before;
}
