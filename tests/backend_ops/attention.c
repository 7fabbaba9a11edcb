/* test_backend_ops family "attention": the CUDA attention op (include/linmoe/cuda_attention.h)
 * against the CPU fp32 op (include/linmoe/attention.h: lm_attention_forward / backward /
 * cache_write / decode) on the same bf16-rounded inputs.
 *
 * Cases: T = 1, 37, 130, 300 (not multiples of the 64 / 128 tiles; 300 has several query
 * and key blocks, so the ordered dQ accumulation chains over five key blocks), Hq/Hkv =
 * 4/4, 4/2, 8/1, D = 64 and 128, packed documents cu_seqlens {0,0,1,50,51,180} (an empty
 * and two length-1 documents), {0,3,70,71,200,260} (five documents: cuDNN pads the batch to
 * six with an empty entry) and {0,1,2,3} (only length-1 documents), NoPE and RoPE (theta
 * 1e4 and 5e5). Compared: o, lse (BO_TOL_FWD), dq, dk, dv (BO_TOL_GRAD; dq, dk as
 * at_check_grad says). Each case runs with
 *   our forward and backward ("attention fwd" / "attention bwd"), the backward twice
 *     (bitwise equal, tolerance 0) and once with "deterministic" = 0 (float atomics);
 *   cuDNN's forward and backward ("... cudnn", lm_cuda_attention_set_impl / set_bwd_impl
 *     CUDNN, deterministic), the backward twice (bitwise equal), with the deterministic
 *     workspace limit 0 (one batch row / one document per cuDNN call), and with
 *     "deterministic" = 0 ("attention bwd cudnn nd");
 *   mixed: cuDNN's forward feeding our backward and ours feeding cuDNN's.
 * A cuDNN refusal fails its row, except at dense T = 1 where cuDNN's backward refuses by
 * design (the default AUTO runs ours): that row says so and is not counted. RoPE alone
 * forward and inverse; the KV-cache writer and the decode step (one split and several)
 * against lm_attention_cache_write / decode. Outputs go to poisoned (NaN) buffers, so an
 * unwritten element fails its row.
 *
 * The simple kernels (head dims other than 64 / 128, and LM_CUDA_ATTN_SIMPLE at any D):
 * D = 16 and 32 (the tiny configs), 6 (RoPE pairs without the 4-element vector path), 7
 * (odd, NoPE), 48, 96 and 256 (more dims than lanes, several per lane); Hq/Hkv 2/1, 4/2,
 * 6/3, 4/4; dense T = 1, 37, 53, 70 and the packed tables above (empty, length-1 and only
 * length-1 documents); each with OWN (which runs them, checked by last_impl), the
 * backward twice (bitwise) and with "deterministic" = 0 (still bitwise: no atomics), and
 * with AUTO; SIMPLE forced at D = 64 / 128, mixed with our FlashAttention-2 forward or
 * backward (one lse convention); a forced cuDNN call and the decode step at D = 16 must
 * refuse (LM_ERR_UNSUPPORTED); RoPE alone at D = 6 and 16. */
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
    int repeat; /* also the bitwise repeat, the atomic and the chunked runs */
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

/* dq and dk are compared by their RMS error relative to max(||ref||, AT_KAPPA ||U||), U the
 * gradient's un-cancelled magnitude (at_grad_scale). Where the reference is not degenerate
 * ||ref|| >= 0.057 ||U|| for every case here (0.06 - 0.3: the terms of dS partly cancel), so
 * AT_KAPPA = 1/32 leaves those rows plain relative errors. Where every query sees one key
 * (T = 1, length-1 documents) the softmax Jacobian makes dq, dk exactly zero: the reference
 * is rounding noise (~1e-8 ||U||) and a relative error against it means nothing; the row then
 * asks the error to stay below tol * ||U|| / 32 (2.5e-4 ||U||), still far below any real bug
 * (a wrong dq of the problem's magnitude is ~0.1 - 1 ||U||). */
#define AT_KAPPA (1.0 / 32.0)

/* The un-cancelled magnitudes of dq and dk (fp64). With P the forward's probabilities,
 * dP_ij = dO_i . v_j, Delta_i = sum_j P_ij dP_ij and dS_ij = P_ij dP_ij - P_ij Delta_i,
 *   U^q_i = scale sum_j P_ij (|dP_ij| + |Delta_i|) |k~_j|,
 *   U^k_j = scale sum_{query heads h of j's group, i >= j} P_ij (|dP_ij| + |Delta_i|) |q~_i|
 * elementwise (|x| per element; q~, k~ rotated with RoPE). The triangle inequality bounds
 * |dq~| <= U^q and |dk~| <= U^k, and a bf16 / fp32 computation forms the two halves of dS
 * (from the mma's dP and from rowsum(dO o)) at U's magnitude before they cancel, so its
 * rounding errors scale with U, not with |dq|. Returns ||U^q||_2, ||U^k||_2 (the rotation
 * preserves the norms of dq, dk). */
static void at_grad_scale(const lm_attention_config *cfg, const float *q, const float *k,
                          const float *v, const float *dO, const float *lse, double *uq_norm,
                          double *uk_norm) {
    const int B = cfg->B, T = cfg->T, Hq = cfg->Hq, Hkv = cfg->Hkv, D = cfg->D,
              grp = cfg->Hq / cfg->Hkv;
    const int64_t BT = (int64_t)B * T, nq = BT * Hq * D, nk = BT * Hkv * D;
    float *qr = LM_MALLOC(sizeof(float) * (size_t)(nq > 0 ? nq : 1));
    float *kr = LM_MALLOC(sizeof(float) * (size_t)(nk > 0 ? nk : 1));
    double *uq = calloc((size_t)(nq > 0 ? nq : 1), sizeof(double));
    double *uk = calloc((size_t)(nk > 0 ? nk : 1), sizeof(double));
    double *p = LM_MALLOC(sizeof(double) * (size_t)(T > 0 ? T : 1));
    double *dp = LM_MALLOC(sizeof(double) * (size_t)(T > 0 ? T : 1));
    const int nseq = cfg->cu_seqlens ? cfg->n_cu_seqlens - 1 : B;
    float cs[128], sn[128];
    for (int n = 0; n < nseq; n++) {
        const int64_t bos = cfg->cu_seqlens ? cfg->cu_seqlens[n] : (int64_t)n * T;
        const int64_t len = cfg->cu_seqlens ? cfg->cu_seqlens[n + 1] - bos : T;
        for (int64_t i = 0; i < len; i++) {
            const int64_t t = bos + i;
            if (cfg->position == LM_POS_ROPE)
                lm_attn_rope_factors(cfg->rope_theta, D, i, cs, sn);
            for (int h = 0; h < Hq; h++) {
                const float *x = q + (t * Hq + h) * D;
                float *y = qr + (t * Hq + h) * D;
                if (cfg->position == LM_POS_ROPE)
                    lm_attn_rope_rotate(x, y, D, cs, sn, 0);
                else
                    memcpy(y, x, sizeof(float) * (size_t)D);
            }
            for (int g = 0; g < Hkv; g++) {
                const float *x = k + (t * Hkv + g) * D;
                float *y = kr + (t * Hkv + g) * D;
                if (cfg->position == LM_POS_ROPE)
                    lm_attn_rope_rotate(x, y, D, cs, sn, 0);
                else
                    memcpy(y, x, sizeof(float) * (size_t)D);
            }
        }
        for (int h = 0; h < Hq; h++) {
            const int g = h / grp;
            for (int64_t i = 0; i < len; i++) {
                const int64_t ti = bos + i;
                const float *qi = qr + (ti * Hq + h) * D, *di = dO + (ti * Hq + h) * D;
                const double l = lse[ti * Hq + h];
                double delta = 0.0;
                for (int64_t j = 0; j <= i; j++) {
                    const int64_t tj = bos + j;
                    const float *kj = kr + (tj * Hkv + g) * D, *vj = v + (tj * Hkv + g) * D;
                    double s = 0.0, d = 0.0;
                    for (int c = 0; c < D; c++) {
                        s += (double)qi[c] * kj[c];
                        d += (double)di[c] * vj[c];
                    }
                    p[j] = exp(cfg->scale * s - l);
                    dp[j] = d;
                    delta += p[j] * d;
                }
                for (int64_t j = 0; j <= i; j++) {
                    const int64_t tj = bos + j;
                    const double w = cfg->scale * p[j] * (fabs(dp[j]) + fabs(delta));
                    const float *kj = kr + (tj * Hkv + g) * D;
                    double *ui = uq + (ti * Hq + h) * D, *uj = uk + (tj * Hkv + g) * D;
                    for (int c = 0; c < D; c++) {
                        ui[c] += w * fabs((double)kj[c]);
                        uj[c] += w * fabs((double)qi[c]);
                    }
                }
            }
        }
    }
    double a = 0.0, b = 0.0;
    for (int64_t i = 0; i < nq; i++)
        a += uq[i] * uq[i];
    for (int64_t i = 0; i < nk; i++)
        b += uk[i] * uk[i];
    *uq_norm = sqrt(a);
    *uk_norm = sqrt(b);
    free(qr), free(kr), free(uq), free(uk), free(p), free(dp);
}

static int at_check_grad(bo_ctx *c, const char *op, const char *shape, const char *tensor,
                         const float *out, const float *ref, int64_t n, double unorm, double tol) {
    double num = 0, den = 0, maxd = 0;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(out[i])) {
            finite = 0;
            break;
        }
        const double d = (double)out[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
        if (fabs(d) > maxd)
            maxd = fabs(d);
    }
    const double scale = fmax(sqrt(den), AT_KAPPA * unorm);
    double e = INFINITY;
    if (finite)
        e = maxd <= 1e-6 ? 0.0 : (scale > 0 ? sqrt(num) / scale : INFINITY);
    const int bad = !(e <= tol);
    printf("| %-14s | %-5s | %-34s | %-10s | %9.2e | %6.0e | %s%s |\n", op, "bf16", shape, tensor,
           e, tol, bad ? "FAIL" : "ok", sqrt(den) < AT_KAPPA * unorm ? " (vs scale)" : "");
    fflush(stdout);
    c->rows++;
    c->failed += bad;
    return bad;
}

/* One run of a case: which implementation runs the forward and the backward, the
 * "deterministic" option, the cuDNN workspace limit (< 0: the default), a repeat of the
 * backward (bitwise equal). */
typedef struct {
    int fwd, bwd, det, repeat;
    int64_t limit;
    const char *fwd_op, *bwd_op;
} at_mode;

static void at_restore(bo_ctx *c) {
    lm_cuda_attention_set_impl(c->cuda, LM_CUDA_ATTN_AUTO, NULL);
    lm_cuda_attention_set_bwd_impl(c->cuda, LM_CUDA_ATTN_AUTO, NULL);
    lm_cuda_ctx_set_option(c->cuda, "deterministic", 1, NULL);
    lm_cuda_attention_set_cudnn_workspace_limit(c->cuda, (int64_t)2 << 30, NULL);
}

static void at_not_counted(const char *op, const char *shape, const char *tensor) {
    printf("| %-14s | %-5s | %-34s | %-10s | %9s | %6s | %s |\n", op, "bf16", shape, tensor, "-",
           "-", "cudnn refused T = 1 (AUTO runs ours; not counted)");
}

/* The implementation a call with `impl` must report: AUTO and OWN run the simple kernels
 * at head dims other than 64 / 128 (AUTO at 64 / 128 is not asked for here). */
static int at_expect_impl(int impl, int D) {
    if ((impl == LM_CUDA_ATTN_AUTO || impl == LM_CUDA_ATTN_OWN) && D != 64 && D != 128)
        return LM_CUDA_ATTN_SIMPLE;
    return impl;
}

static int at_run_case(bo_ctx *c, const at_case *k, const at_mode *md) {
    char shape[96];
    at_shape(k, shape, sizeof shape);
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
    double uq = 0.0, uk = 0.0;
    at_mem m = {c, {0}, 0};
    lm_attention_inputs in = {q, kk, v};
    lm_attention_grads gr = {dO, dq, dk, dv};
    if (lm_attention_forward(&cfg, &in, o, lse, &e) != LM_OK ||
        lm_attention_backward(&cfg, &in, o, lse, &gr, &e) != LM_OK) {
        bo_fail(c, "attention cpu", shape, &e);
        goto done;
    }
    at_grad_scale(&cfg, q, kk, v, dO, lse, &uq, &uk);
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
    lm_status fst = lm_cuda_attention_set_impl(c->cuda, md->fwd, &e);
    if (fst == LM_OK)
        fst = lm_cuda_attention_set_bwd_impl(c->cuda, md->bwd, &e);
    if (fst == LM_OK)
        fst = lm_cuda_ctx_set_option(c->cuda, "deterministic", md->det, &e);
    if (fst == LM_OK && md->limit >= 0)
        fst = lm_cuda_attention_set_cudnn_workspace_limit(c->cuda, md->limit, &e);
    if (fst == LM_OK)
        fst = lm_cuda_attention_forward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, &e);
    if (fst == LM_OK && lm_cuda_attention_last_impl(c->cuda) != at_expect_impl(md->fwd, k->D))
        fst = lm_errorf(&e, LM_ERR_INVALID, "forward ran implementation %d, not %d",
                        lm_cuda_attention_last_impl(c->cuda), at_expect_impl(md->fwd, k->D));
    if (fst != LM_OK || bo_download_bf16(c, g, go, nq, &e) != LM_OK) {
        bo_fail(c, md->fwd_op, shape, &e);
        goto done;
    }
    bo_check(c, md->fwd_op, "bf16", shape, "o", g, o, nq, BO_TOL_FWD);
    if (bo_download_f32(c, g, glse, nl, &e) != LM_OK) {
        bo_fail(c, md->fwd_op, shape, &e);
        goto done;
    }
    bo_check(c, md->fwd_op, "bf16", shape, "lse", g, lse, nl, BO_TOL_FWD);
    lm_status bst =
        lm_cuda_attention_backward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, ddo, gdq, gdk, gdv, &e);
    if (bst == LM_ERR_UNSUPPORTED && md->bwd == LM_CUDA_ATTN_CUDNN && !k->cu && k->T == 1) {
        at_not_counted(md->bwd_op, shape, "dq dk dv");
        goto done;
    }
    if (bst == LM_OK && lm_cuda_attention_last_bwd_impl(c->cuda) != at_expect_impl(md->bwd, k->D))
        bst = lm_errorf(&e, LM_ERR_INVALID, "backward ran implementation %d, not %d",
                        lm_cuda_attention_last_bwd_impl(c->cuda), at_expect_impl(md->bwd, k->D));
    if (bst != LM_OK) {
        bo_fail(c, md->bwd_op, shape, &e);
        goto done;
    }
    const struct {
        const char *name;
        void *dev;
        const float *ref;
        int64_t n;
        double unorm; /* 0: plain relative error */
    } outs[3] = {{"dq", gdq, dq, nq, uq}, {"dk", gdk, dk, nk, uk}, {"dv", gdv, dv, nk, 0.0}};
    for (int i = 0; i < 3; i++) {
        if (bo_download_bf16(c, g, outs[i].dev, outs[i].n, &e) != LM_OK) {
            bo_fail(c, md->bwd_op, shape, &e);
            goto done;
        }
        if (outs[i].unorm > 0)
            at_check_grad(c, md->bwd_op, shape, outs[i].name, g, outs[i].ref, outs[i].n,
                          outs[i].unorm, BO_TOL_GRAD);
        else
            bo_check(c, md->bwd_op, "bf16", shape, outs[i].name, g, outs[i].ref, outs[i].n,
                     BO_TOL_GRAD);
    }
    if (md->repeat) {
        /* the same backward again into fresh poisoned buffers: bitwise equal */
        char op2[64];
        snprintf(op2, sizeof op2, "%s x2", md->bwd_op);
        for (int i = 0; i < 3 && c->failed == before; i++) {
            void *again = bo_alloc_poisoned(c, (size_t)outs[i].n * 2, &e);
            void *o3[3] = {gdq, gdk, gdv};
            o3[i] = again;
            lm_status st = again ? LM_OK : LM_ERR_NOMEM;
            if (st == LM_OK)
                st = bo_download_bf16(c, g, outs[i].dev, outs[i].n, &e);
            if (st == LM_OK)
                st = lm_cuda_attention_backward(c->cuda, &cfg, dq_, dk_, dv_, go, glse, ddo, o3[0],
                                                o3[1], o3[2], &e);
            if (st == LM_OK)
                st = bo_download_bf16(c, g2, again, outs[i].n, &e);
            if (st != LM_OK)
                bo_fail(c, op2, shape, &e);
            else
                bo_check(c, op2, "bf16", shape, outs[i].name, g2, g, outs[i].n, 0.0);
            if (again)
                bo_free(c, again);
        }
    }
done:
    at_restore(c);
    at_free_all(&m);
    free(q), free(kk), free(v), free(dO), free(o), free(lse), free(dq), free(dk), free(dv);
    free(g), free(g2);
    return c->failed - before;
}

/* RoPE alone: y = R x and x = R^T y against the CPU rotation (fp64 angles, fp32 math). */
static int at_rope(bo_ctx *c, int D) {
    const int before = c->failed;
    static const int64_t cu[] = {0, 3, 3, 40, 97};
    const int T = 97, H = 3;
    char shape[64];
    snprintf(shape, sizeof shape, "varlen4 T=97 H=3 D=%d", D);
    lm_error e = {0};
    lm_attention_config cfg;
    lm_attention_config_default(&cfg, 1, T, H, H, D);
    cfg.cu_seqlens = cu;
    cfg.n_cu_seqlens = 5;
    cfg.rope_theta = 10000.0;
    const int64_t n = (int64_t)T * H * D;
    float *x = at_randn(c, n, 1.0f), *ref = LM_MALLOC(sizeof(float) * (size_t)n);
    float *g = LM_MALLOC(sizeof(float) * (size_t)n);
    float cs[128], sn[128];
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

/* One table row asserting a refusal: `st` must be LM_ERR_UNSUPPORTED (the message is
 * printed with the row). */
static int at_expect_refused(bo_ctx *c, const char *op, const char *shape, lm_status st,
                             const lm_error *e) {
    const int bad = st != LM_ERR_UNSUPPORTED;
    printf("| %-14s | %-5s | %-34s | %-10s | %9s | %6s | %s (%s) |\n", op, "bf16", shape, "refusal",
           "-", "-", bad ? "FAIL" : "ok", st == LM_OK ? "ran" : e->msg);
    fflush(stdout);
    c->rows++;
    c->failed += bad;
    return bad;
}

/* A forced cuDNN forward / backward and the decode step at D = 16 refuse. */
static int at_small_refusals(bo_ctx *c) {
    const int before = c->failed;
    const int T = 5, Hq = 2, Hkv = 1, D = 16;
    const char *shape = "B=1 T=5 H=2/1 D=16 nope";
    lm_error e = {0};
    lm_attention_config cfg;
    lm_attention_config_default(&cfg, 1, T, Hq, Hkv, D);
    at_mem m = {c, {0}, 0};
    const size_t qb = (size_t)T * Hq * D * 2, kb = (size_t)T * Hkv * D * 2;
    void *q = at_keep(&m, bo_alloc_poisoned(c, qb, &e));
    void *k = at_keep(&m, bo_alloc_poisoned(c, kb, &e));
    void *v = at_keep(&m, bo_alloc_poisoned(c, kb, &e));
    void *o = at_keep(&m, bo_alloc_poisoned(c, qb, &e));
    float *lse = at_keep(&m, bo_alloc_poisoned(c, (size_t)T * Hq * 4, &e));
    void *dq = at_keep(&m, bo_alloc_poisoned(c, qb, &e));
    void *dk = at_keep(&m, bo_alloc_poisoned(c, kb, &e));
    void *dv = at_keep(&m, bo_alloc_poisoned(c, kb, &e));
    if (m.n != 8) {
        bo_fail(c, "attention", shape, &e);
        goto done;
    }
    lm_status st = lm_cuda_attention_set_impl(c->cuda, LM_CUDA_ATTN_CUDNN, &e);
    if (st == LM_OK)
        st = lm_cuda_attention_set_bwd_impl(c->cuda, LM_CUDA_ATTN_CUDNN, &e);
    if (st != LM_OK) {
        bo_fail(c, "attention", shape, &e);
        goto done;
    }
    st = lm_cuda_attention_forward(c->cuda, &cfg, q, k, v, o, lse, &e);
    at_expect_refused(c, "attention fwd cudnn", shape, st, &e);
    st = lm_cuda_attention_backward(c->cuda, &cfg, q, k, v, o, lse, o, dq, dk, dv, &e);
    at_expect_refused(c, "attention bwd cudnn", shape, st, &e);
    lm_attention_config one;
    lm_attention_config_default(&one, 1, 1, Hq, Hkv, D);
    st = lm_cuda_attention_decode(c->cuda, &one, T, 0, q, k, v, o, lse, &e);
    at_expect_refused(c, "attention decode", shape, st, &e);
done:
    at_restore(c);
    at_free_all(&m);
    return c->failed - before;
}

/* The simple kernels: the cases of the file comment, and SIMPLE forced at D = 64 / 128. */
static int at_small(bo_ctx *c) {
    const int before = c->failed;
    static const int64_t cu6[] = {0, 0, 1, 50, 51, 180}, cu5[] = {0, 3, 70, 71, 200, 260};
    static const int64_t cu3[] = {0, 1, 2, 3};
    const at_case cases[] = {
        {1, 180, 2, 1, 16, cu6, 6, 1, 1e4, 1}, {1, 180, 2, 1, 16, cu6, 6, 0, 1e4, 0},
        {2, 37, 2, 1, 16, NULL, 0, 1, 1e4, 1}, {1, 1, 2, 1, 16, NULL, 0, 1, 1e4, 0},
        {1, 260, 4, 2, 32, cu5, 6, 1, 5e5, 1}, {1, 3, 4, 4, 32, cu3, 4, 0, 1e4, 0},
        {3, 53, 6, 3, 32, NULL, 0, 0, 1e4, 1}, {1, 180, 4, 2, 6, cu6, 6, 1, 1e4, 1},
        {2, 37, 4, 2, 7, NULL, 0, 0, 1e4, 0},  {1, 260, 4, 2, 48, cu5, 6, 1, 1e4, 0},
        {2, 53, 4, 1, 96, NULL, 0, 1, 1e4, 1}, {1, 70, 2, 1, 256, NULL, 0, 1, 1e4, 1},
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    const int O = LM_CUDA_ATTN_OWN, S = LM_CUDA_ATTN_SIMPLE, A = LM_CUDA_ATTN_AUTO;
    const at_mode own = {O, O, 1, 1, -1, "attention fwd", "attention bwd"};
    const at_mode own_nd = {O, O, 0, 1, -1, "attention fwd", "attention bwd nd"};
    const at_mode aut = {A, A, 1, 0, -1, "attention fwd auto", "attention bwd auto"};
    for (int i = 0; i < n; i++) {
        const at_case *k = &cases[i];
        at_run_case(c, k, &own);
        if (k->repeat) {
            at_run_case(c, k, &own_nd);
            at_run_case(c, k, &aut);
        }
    }
    /* SIMPLE at the FlashAttention-2 head dims, alone and mixed with our kernels */
    const at_case big[] = {
        {2, 130, 4, 2, 128, NULL, 0, 1, 1e4, 1},
        {1, 180, 8, 1, 64, cu6, 6, 0, 1e4, 1},
        {1, 260, 4, 2, 128, cu5, 6, 1, 1e4, 0},
    };
    const at_mode simple = {S, S, 1, 1, -1, "attention fwd simple", "attention bwd simple"};
    const at_mode s_o = {S, O, 1, 0, -1, "attention fwd simple", "attention bwd own<simple"};
    const at_mode o_s = {O, S, 1, 0, -1, "attention fwd", "attention bwd simple<own"};
    for (int i = 0; i < (int)(sizeof big / sizeof big[0]); i++) {
        at_run_case(c, &big[i], &simple);
        if (big[i].repeat) {
            at_run_case(c, &big[i], &s_o);
            at_run_case(c, &big[i], &o_s);
        }
    }
    at_rope(c, 6);
    at_rope(c, 16);
    at_small_refusals(c);
    return c->failed - before;
}

int bo_family_attention(bo_ctx *c) {
    const int before = c->failed;
    static const int64_t cu6[] = {0, 0, 1, 50, 51, 180}, cu5[] = {0, 3, 70, 71, 200, 260};
    static const int64_t cu3[] = {0, 1, 2, 3};
    const at_case cases[] = {
        {2, 37, 4, 4, 64, NULL, 0, 0, 1e4, 1},   {1, 1, 4, 2, 128, NULL, 0, 1, 1e4, 0},
        {2, 130, 4, 2, 128, NULL, 0, 1, 1e4, 1}, {1, 130, 8, 1, 64, NULL, 0, 0, 1e4, 0},
        {1, 180, 4, 2, 128, cu6, 6, 1, 1e4, 1},  {1, 180, 8, 1, 64, cu6, 6, 0, 1e4, 0},
        {1, 300, 4, 4, 128, NULL, 0, 1, 5e5, 1}, {1, 1, 8, 1, 64, NULL, 0, 0, 1e4, 0},
        {1, 180, 4, 4, 64, cu6, 6, 1, 5e5, 0},   {1, 260, 4, 2, 128, cu5, 6, 1, 1e4, 1},
        {1, 260, 8, 8, 64, cu5, 6, 0, 1e4, 0},   {1, 3, 4, 4, 64, cu3, 4, 0, 1e4, 0},
        {3, 130, 8, 2, 128, NULL, 0, 0, 1e4, 1},
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    const int O = LM_CUDA_ATTN_OWN, N = LM_CUDA_ATTN_CUDNN;
    const at_mode own = {O, O, 1, 1, -1, "attention fwd", "attention bwd"};
    const at_mode own_nd = {O, O, 0, 0, -1, "attention fwd", "attention bwd atomic"};
    const at_mode cud = {N, N, 1, 1, -1, "attention fwd cudnn", "attention bwd cudnn"};
    const at_mode cud_l0 = {N, N, 1, 0, 0, "attention fwd cudnn", "attention bwd cudnn l0"};
    const at_mode cud_nd = {N, N, 0, 0, -1, "attention fwd cudnn", "attention bwd cudnn nd"};
    const at_mode n_o = {N, O, 1, 0, -1, "attention fwd cudnn", "attention bwd own<cudnn"};
    const at_mode o_n = {O, N, 1, 0, -1, "attention fwd", "attention bwd cudnn<own"};
    for (int i = 0; i < n; i++) {
        const at_case *k = &cases[i];
        at_run_case(c, k, &own);
        if (k->repeat)
            at_run_case(c, k, &own_nd);
    }
    for (int i = 0; i < n; i++) {
        const at_case *k = &cases[i];
        at_run_case(c, k, &cud);
        if (k->repeat) {
            at_run_case(c, k, &cud_l0);
            at_run_case(c, k, &cud_nd);
            at_run_case(c, k, &n_o);
            at_run_case(c, k, &o_n);
        }
    }
    at_rope(c, 128);
    at_decode(c, 2, 8, 2, 128, 80, 70, 1);    /* one split per (b, g) */
    at_decode(c, 1, 4, 4, 64, 1024, 1000, 0); /* 16 splits merged */
    at_decode(c, 3, 4, 1, 128, 8, 0, 1);      /* pos 0: the token alone */
    at_decode(c, 1, 32, 1, 128, 300, 299, 1); /* 32 heads per kv head: two head slices */
    at_small(c);
    return c->failed - before;
}
