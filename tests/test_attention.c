/* The fp32 tiled causal GQA attention (include/linmoe/attention.h) held to a plain fp64
 * reference written here (naive softmax attention with RoPE, per document, and its
 * backward by the softmax Jacobian), which is itself checked by central finite
 * differences on tiny shapes.
 *
 *  - reference: analytic dq, dk, dv vs central finite differences of sum(o * do)
 *    (fp64, TOL_FD), RoPE on / off, GQA, varlen with empty and length-1 documents.
 *  - grid: T = 1, 63, 70, 100, 130, 257 (not multiples of the 64-token tile); D = 32,
 *    64, 100 (and 7, NoPE); GQA 4:2, 8:1, 3:1 and 2:2; scale D^-0.5, 0.3 and 1; RoPE
 *    off and on with theta 1e4 and 1e6; sharp softmax (q, k with std 3); varlen with
 *    documents of length 0, 1, 15, 63 and 121. Per case: o and lse <= TOL_FWD_F32, dq,
 *    dk, dv <= TOL_BWD_F32 against the reference (outputs poisoned with NaN before each
 *    call), the same through the portable small-matmul path, and bitwise equality
 *    across 1 and 2 threads and both backward schedules, run through one reused
 *    workspace.
 *  - causality: inputs at positions >= t0 leave o, lse before t0 exactly unchanged;
 *    upstream gradients before t0 leave dq, dk, dv at >= t0 exactly unchanged.
 *  - documents: perturbing one packed document leaves every other document's o,
 *    lse, dq, dk, dv bit-identical; a document at offset 0, after another, or alone
 *    gives bit-identical results (RoPE positions restart per document).
 *  - decode: prefill + cache writes + decode steps equal the full forward at every
 *    position (GQA 8:2, 4:4, 4:1 and 72:1); RoPE angles at positions 65530..65536
 *    against a long-double rotation, and a decode step at position 65536 against the
 *    fp64 reference.
 *  - invalid input: each bad field gives a non-OK status and a message naming it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "linmoe/attention.h"
#include "ops/cpu/attention_cpu.h" /* lm_attention_force_bwd_schedule (test hook) */
#include "ops/cpu/gemm_small.h"    /* lm_gemm_small_force_portable */

/* FD step: the loss is smooth and O(1..10); truncation h^2 ~ 1e-10 and rounding
 * 1e-16 * |L| / h ~ 1e-10 are both far below TOL_FD. */
#define FD_H 1e-5
/* RoPE rotation at long positions vs long double: fp32 rounding of cos / sin and of
 * the product (~1e-7 relative); an fp32 angle would be off by ~1e-3 at 65536. */
#define TOL_ROPE 1e-6

static void *xcalloc(int64_t n, size_t sz) {
    void *p = calloc((size_t)(n > 0 ? n : 1), sz);
    assert_non_null(p);
    return p;
}

/* ================================================================ fp64 reference */

typedef struct {
    int B, T, Hq, Hkv, D;
    const int64_t *cu; /* [ncu] or NULL */
    int ncu;
    double scale;
    int rope;
    double theta;
} rcfg;

static int ref_ndocs(const rcfg *r) { return r->cu ? r->ncu - 1 : r->B; }
static int64_t ref_bos(const rcfg *r, int n) { return r->cu ? r->cu[n] : (int64_t)n * r->T; }
static int64_t ref_len(const rcfg *r, int n) { return r->cu ? r->cu[n + 1] - r->cu[n] : r->T; }

/* y = R(pos) x (sign +1) or R(pos)^T x (sign -1), half-split (rotate_half) pairs
 * (f, f + D/2), angle pos * theta^(-2f/D). */
static void ref_rotate(const double *x, double *y, int D, int64_t pos, double theta, double sign) {
    const int h = D / 2;
    for (int f = 0; f < h; f++) {
        double a = (double)pos * pow(theta, -2.0 * f / D);
        double c = cos(a), s = sign * sin(a);
        double x1 = x[f], x2 = x[f + h];
        y[f] = x1 * c - x2 * s;
        y[f + h] = x2 * c + x1 * s;
    }
}

/* Rotated copies of the q rows of head h and k rows of kv head g of document n. */
static void ref_rotated(const rcfg *r, int n, int h, int g, const double *q, const double *k,
                        double *qt, double *kt) {
    const int64_t bos = ref_bos(r, n), len = ref_len(r, n);
    const int D = r->D;
    for (int64_t i = 0; i < len; i++) {
        const double *qi = q + ((bos + i) * r->Hq + h) * D, *ki = k + ((bos + i) * r->Hkv + g) * D;
        if (r->rope) {
            ref_rotate(qi, qt + i * D, D, i, r->theta, 1.0);
            ref_rotate(ki, kt + i * D, D, i, r->theta, 1.0);
        } else {
            memcpy(qt + i * D, qi, sizeof(double) * D);
            memcpy(kt + i * D, ki, sizeof(double) * D);
        }
    }
}

/* P [len, len] (lower triangle) of head h of document n; lse per row. */
static void ref_probs(const rcfg *r, int64_t len, const double *qt, const double *kt, double *P,
                      double *lse) {
    const int D = r->D;
    for (int64_t i = 0; i < len; i++) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; j++) {
            double s = 0;
            for (int d = 0; d < D; d++)
                s += qt[i * D + d] * kt[j * D + d];
            P[i * len + j] = r->scale * s;
            m = fmax(m, P[i * len + j]);
        }
        double z = 0;
        for (int64_t j = 0; j <= i; j++)
            z += (P[i * len + j] = exp(P[i * len + j] - m));
        for (int64_t j = 0; j <= i; j++)
            P[i * len + j] /= z;
        for (int64_t j = i + 1; j < len; j++)
            P[i * len + j] = 0;
        if (lse)
            lse[i] = m + log(z);
    }
}

static void ref_forward(const rcfg *r, const double *q, const double *k, const double *v, double *o,
                        double *lse) {
    const int D = r->D, grp = r->Hq / r->Hkv;
    for (int n = 0; n < ref_ndocs(r); n++) {
        const int64_t bos = ref_bos(r, n), len = ref_len(r, n);
        if (len == 0)
            continue;
        double *qt = xcalloc(len * D, sizeof(double)), *kt = xcalloc(len * D, sizeof(double));
        double *P = xcalloc(len * len, sizeof(double)), *l = xcalloc(len, sizeof(double));
        for (int h = 0; h < r->Hq; h++) {
            const int g = h / grp;
            ref_rotated(r, n, h, g, q, k, qt, kt);
            ref_probs(r, len, qt, kt, P, l);
            for (int64_t i = 0; i < len; i++) {
                double *oi = o + ((bos + i) * r->Hq + h) * D;
                for (int d = 0; d < D; d++) {
                    double s = 0;
                    for (int64_t j = 0; j <= i; j++)
                        s += P[i * len + j] * v[((bos + j) * r->Hkv + g) * D + d];
                    oi[d] = s;
                }
                if (lse)
                    lse[(bos + i) * r->Hq + h] = l[i];
            }
        }
        free(qt), free(kt), free(P), free(l);
    }
}

/* Gradients of sum(o * dO): softmax Jacobian dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)
 * (not the op's rowsum(dO * O) form), then back through the rotation. */
static void ref_backward(const rcfg *r, const double *q, const double *k, const double *v,
                         const double *dO, double *dq, double *dk, double *dv) {
    const int D = r->D, grp = r->Hq / r->Hkv;
    const int64_t BT = (int64_t)r->B * r->T;
    memset(dq, 0, sizeof(double) * BT * r->Hq * D);
    memset(dk, 0, sizeof(double) * BT * r->Hkv * D);
    memset(dv, 0, sizeof(double) * BT * r->Hkv * D);
    for (int n = 0; n < ref_ndocs(r); n++) {
        const int64_t bos = ref_bos(r, n), len = ref_len(r, n);
        if (len == 0)
            continue;
        double *qt = xcalloc(len * D, sizeof(double)), *kt = xcalloc(len * D, sizeof(double));
        double *P = xcalloc(len * len, sizeof(double)), *dS = xcalloc(len * len, sizeof(double));
        double *dqt = xcalloc(len * D, sizeof(double)), *dkt = xcalloc(len * D, sizeof(double));
        double tmp[1024];
        for (int h = 0; h < r->Hq; h++) {
            const int g = h / grp;
            ref_rotated(r, n, h, g, q, k, qt, kt);
            ref_probs(r, len, qt, kt, P, NULL);
            for (int64_t i = 0; i < len; i++) {
                const double *doi = dO + ((bos + i) * r->Hq + h) * D;
                double rs = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double *vj = v + ((bos + j) * r->Hkv + g) * D;
                    double dp = 0;
                    for (int d = 0; d < D; d++)
                        dp += doi[d] * vj[d];
                    dS[i * len + j] = dp;
                    rs += P[i * len + j] * dp;
                    double *dvj = dv + ((bos + j) * r->Hkv + g) * D;
                    for (int d = 0; d < D; d++)
                        dvj[d] += P[i * len + j] * doi[d];
                }
                for (int64_t j = 0; j <= i; j++)
                    dS[i * len + j] = P[i * len + j] * (dS[i * len + j] - rs);
            }
            memset(dqt, 0, sizeof(double) * len * D);
            memset(dkt, 0, sizeof(double) * len * D);
            for (int64_t i = 0; i < len; i++)
                for (int64_t j = 0; j <= i; j++) {
                    const double s = r->scale * dS[i * len + j];
                    for (int d = 0; d < D; d++) {
                        dqt[i * D + d] += s * kt[j * D + d];
                        dkt[j * D + d] += s * qt[i * D + d];
                    }
                }
            for (int64_t i = 0; i < len; i++) {
                double *dqi = dq + ((bos + i) * r->Hq + h) * D;
                double *dki = dk + ((bos + i) * r->Hkv + g) * D;
                if (r->rope)
                    ref_rotate(dqt + i * D, dqi, D, i, r->theta, -1.0);
                else
                    memcpy(dqi, dqt + i * D, sizeof(double) * D);
                if (r->rope)
                    ref_rotate(dkt + i * D, tmp, D, i, r->theta, -1.0);
                else
                    memcpy(tmp, dkt + i * D, sizeof(double) * D);
                for (int d = 0; d < D; d++)
                    dki[d] += tmp[d];
            }
        }
        free(qt), free(kt), free(P), free(dS), free(dqt), free(dkt);
    }
}

/* ================================================================ reference vs FD */

typedef struct {
    const char *name;
    int B, T, Hq, Hkv, D;
    const int64_t *cu;
    int ncu;
    double scale; /* 0: D^-0.5 */
    int rope;
    double theta;
    uint64_t seed;
} fd_case;

static double fd_loss(const rcfg *r, const double *q, const double *k, const double *v,
                      const double *dO, double *o) {
    ref_forward(r, q, k, v, o, NULL);
    double L = 0;
    for (int64_t i = 0; i < (int64_t)r->B * r->T * r->Hq * r->D; i++)
        L += o[i] * dO[i];
    return L;
}

static void test_reference_fd(void **state) {
    (void)state;
    static const int64_t cu1[] = {0, 0, 1, 5, 5, 7};
    static const fd_case cases[] = {
        {"fd nope 2:1 B2", 2, 5, 2, 1, 4, NULL, 0, 0, 0, 0, 11},
        {"fd rope 4:2 scale 0.7", 1, 6, 4, 2, 6, NULL, 0, 0.7, 1, 10000, 12},
        {"fd rope 1:1 theta 1e6 B2", 2, 4, 1, 1, 8, NULL, 0, 0, 1, 1e6, 13},
        {"fd rope theta 10 varlen 0,1,4,0,2", 1, 7, 4, 2, 4, cu1, 6, 0, 1, 10, 14},
        {"fd nope varlen 8:1 scale 1.3", 1, 7, 8, 1, 2, cu1, 6, 1.3, 0, 0, 15},
    };
    int ok = 1;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const fd_case *fc = &cases[ci];
        rcfg r = {fc->B,    fc->T,    fc->Hq,  fc->Hkv,
                  fc->D,    fc->cu,   fc->ncu, fc->scale > 0 ? fc->scale : 1.0 / sqrt(fc->D),
                  fc->rope, fc->theta};
        const int64_t BT = (int64_t)fc->B * fc->T, nq = BT * fc->Hq * fc->D,
                      nk = BT * fc->Hkv * fc->D;
        double *q = xcalloc(nq, 8), *k = xcalloc(nk, 8), *v = xcalloc(nk, 8), *dO = xcalloc(nq, 8);
        double *o = xcalloc(nq, 8), *dq = xcalloc(nq, 8), *dk = xcalloc(nk, 8),
               *dv = xcalloc(nk, 8);
        double *fq = xcalloc(nq, 8), *fk = xcalloc(nk, 8), *fv = xcalloc(nk, 8);
        lm_fill_normal(q, nq, fc->seed, 0, 1);
        lm_fill_normal(k, nk, fc->seed + 1, 0, 1);
        lm_fill_normal(v, nk, fc->seed + 2, 0, 1);
        lm_fill_normal(dO, nq, fc->seed + 3, 0, 1);
        ref_backward(&r, q, k, v, dO, dq, dk, dv);
        double *xs[3] = {q, k, v}, *fd[3] = {fq, fk, fv};
        const int64_t ns[3] = {nq, nk, nk};
        for (int t = 0; t < 3; t++)
            for (int64_t i = 0; i < ns[t]; i++) {
                const double x0 = xs[t][i];
                xs[t][i] = x0 + FD_H;
                const double lp = fd_loss(&r, q, k, v, dO, o);
                xs[t][i] = x0 - FD_H;
                const double lm = fd_loss(&r, q, k, v, dO, o);
                xs[t][i] = x0;
                fd[t][i] = (lp - lm) / (2 * FD_H);
            }
        char nm[128];
        snprintf(nm, sizeof nm, "%s dq", fc->name);
        ok &= lm_check_f64(nm, dq, fq, nq, TOL_FD);
        snprintf(nm, sizeof nm, "%s dk", fc->name);
        ok &= lm_check_f64(nm, dk, fk, nk, TOL_FD);
        snprintf(nm, sizeof nm, "%s dv", fc->name);
        ok &= lm_check_f64(nm, dv, fv, nk, TOL_FD);
        free(q), free(k), free(v), free(dO), free(o), free(dq), free(dk), free(dv);
        free(fq), free(fk), free(fv);
    }
    assert_true(ok);
}

/* ================================================================ op cases */

typedef struct {
    const char *name;
    int B, T, Hq, Hkv, D;
    const int64_t *cu;
    int ncu;
    float scale; /* 0: D^-0.5 */
    int rope;
    double theta;
    double qk_std;
    uint64_t seed;
} op_case;

typedef struct {
    lm_attention_config c;
    rcfg r;
    int64_t BT, nq, nk, nl;
    float *q, *k, *v, *dO;          /* op inputs */
    double *q64, *k64, *v64, *dO64; /* the same values in fp64 */
} ocase;

static void ocase_init(const op_case *oc, ocase *x) {
    memset(x, 0, sizeof *x);
    lm_attention_config_default(&x->c, oc->B, oc->T, oc->Hq, oc->Hkv, oc->D);
    if (oc->scale > 0)
        x->c.scale = oc->scale;
    x->c.cu_seqlens = oc->cu;
    x->c.n_cu_seqlens = oc->cu ? oc->ncu : 0;
    x->c.position = oc->rope ? LM_POS_ROPE : LM_POS_NOPE;
    if (oc->rope)
        x->c.rope_theta = oc->theta;
    x->r = (rcfg){oc->B,    oc->T,          oc->Hq,  oc->Hkv,
                  oc->D,    oc->cu,         oc->ncu, (double)x->c.scale,
                  oc->rope, x->c.rope_theta};
    x->BT = (int64_t)oc->B * oc->T;
    x->nq = x->BT * oc->Hq * oc->D;
    x->nk = x->BT * oc->Hkv * oc->D;
    x->nl = x->BT * oc->Hq;
    x->q64 = xcalloc(x->nq, 8), x->k64 = xcalloc(x->nk, 8), x->v64 = xcalloc(x->nk, 8);
    x->dO64 = xcalloc(x->nq, 8);
    lm_fill_normal(x->q64, x->nq, oc->seed, 0, oc->qk_std);
    lm_fill_normal(x->k64, x->nk, oc->seed + 1, 0, oc->qk_std);
    lm_fill_normal(x->v64, x->nk, oc->seed + 2, 0, 1);
    lm_fill_normal(x->dO64, x->nq, oc->seed + 3, 0, 1);
    double *src[4] = {x->q64, x->k64, x->v64, x->dO64};
    float **dst[4] = {&x->q, &x->k, &x->v, &x->dO};
    const int64_t ns[4] = {x->nq, x->nk, x->nk, x->nq};
    for (int i = 0; i < 4; i++) {
        *dst[i] = lm_to_f32(src[i], ns[i]);
        for (int64_t j = 0; j < ns[i]; j++)
            src[i][j] = (double)(*dst[i])[j]; /* both sides see the fp32 values */
    }
}

static void ocase_free(ocase *x) {
    free(x->q), free(x->k), free(x->v), free(x->dO);
    free(x->q64), free(x->k64), free(x->v64), free(x->dO64);
}

typedef struct {
    float *o, *lse, *dq, *dk, *dv;
} opres;

static void opres_alloc(const ocase *x, opres *r) {
    r->o = xcalloc(x->nq, 4), r->lse = xcalloc(x->nl, 4), r->dq = xcalloc(x->nq, 4);
    r->dk = xcalloc(x->nk, 4), r->dv = xcalloc(x->nk, 4);
}

static void opres_free(opres *r) {
    free(r->o), free(r->lse), free(r->dq), free(r->dk), free(r->dv);
}

/* Forward and backward of the op (outputs poisoned first); ws may be NULL. */
static void op_run(const ocase *x, const float *q, const float *k, const float *v, const float *dO,
                   lm_attention_workspace *ws, opres *r) {
    lm_attention_config c = x->c;
    c.ws = ws;
    lm_attention_inputs in = {q, k, v};
    lm_error err = {0};
    lm_poison_f32(r->o, x->nq), lm_poison_f32(r->lse, x->nl);
    lm_status st = lm_attention_forward(&c, &in, r->o, r->lse, &err);
    if (st != LM_OK)
        print_message("forward: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
    lm_poison_f32(r->dq, x->nq), lm_poison_f32(r->dk, x->nk), lm_poison_f32(r->dv, x->nk);
    lm_attention_grads gr = {dO, r->dq, r->dk, r->dv};
    st = lm_attention_backward(&c, &in, r->o, r->lse, &gr, &err);
    if (st != LM_OK)
        print_message("backward: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static int same_bits(const char *what, const opres *a, const opres *b, const ocase *x) {
    int ok = memcmp(a->o, b->o, sizeof(float) * x->nq) == 0 &&
             memcmp(a->lse, b->lse, sizeof(float) * x->nl) == 0 &&
             memcmp(a->dq, b->dq, sizeof(float) * x->nq) == 0 &&
             memcmp(a->dk, b->dk, sizeof(float) * x->nk) == 0 &&
             memcmp(a->dv, b->dv, sizeof(float) * x->nk) == 0;
    if (!ok)
        printf("  %s: results are not bitwise identical\n", what);
    return ok;
}

static const int64_t CU_A[] = {0, 0, 1, 16, 16, 79, 200, 201, 264}; /* 0,1,15,0,63,121,1,63 */
static const int64_t CU_B[] = {0, 15, 16, 16, 137};                 /* 15,1,0,121 */

static const op_case GRID[] = {
    /* name                          B  T    Hq Hkv D    cu    ncu scale rope theta qk  seed */
    {"T1 D32 4:2 nope B3", 3, 1, 4, 2, 32, NULL, 0, 0, 0, 0, 1, 101},
    {"T1 D64 8:1 rope1e4", 2, 1, 8, 1, 64, NULL, 0, 0, 1, 1e4, 1, 102},
    {"T63 D64 4:2 rope1e4 B2", 2, 63, 4, 2, 64, NULL, 0, 0, 1, 1e4, 1, 103},
    {"T63 D32 8:1 nope scale1", 1, 63, 8, 1, 32, NULL, 0, 1.0f, 0, 0, 1, 104},
    {"T100 D100 8:1 rope1e6 scale0.3", 1, 100, 8, 1, 100, NULL, 0, 0.3f, 1, 1e6, 1, 105},
    {"T100 D64 4:2 nope B2", 2, 100, 4, 2, 64, NULL, 0, 0, 0, 0, 1, 106},
    {"T130 D32 2:2 rope1e4", 1, 130, 2, 2, 32, NULL, 0, 0, 1, 1e4, 1, 107},
    {"T70 D7 3:1 nope (odd head dim)", 2, 70, 3, 1, 7, NULL, 0, 0, 0, 0, 1, 114},
    {"T257 D64 8:1 nope", 1, 257, 8, 1, 64, NULL, 0, 0, 0, 0, 1, 108},
    {"T257 D100 4:2 rope1e4", 1, 257, 4, 2, 100, NULL, 0, 0, 1, 1e4, 1, 109},
    {"T257 D32 4:2 rope1e6 sharp", 1, 257, 4, 2, 32, NULL, 0, 0, 1, 1e6, 3, 110},
    {"varlen 0,1,15,0,63,121,1,63 D64 4:2 rope1e4", 1, 264, 4, 2, 64, CU_A, 9, 0, 1, 1e4, 1, 111},
    {"varlen 0,1,15,0,63,121,1,63 D100 8:1 nope", 1, 264, 8, 1, 100, CU_A, 9, 1.0f, 0, 0, 1, 112},
    {"varlen 15,1,0,121 D32 8:1 rope1e6 sharp", 1, 137, 8, 1, 32, CU_B, 5, 0, 1, 1e6, 3, 113},
};

static int all_zero(const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != 0.0)
            return 0;
    return 1;
}

/* Where the exact gradient is zero everywhere (T = 1: one key, P = 1, so dS = dP -
 * Delta = 0) the relative error is undefined, and fp32 leaves the cancellation
 * dP - Delta at ~ |dO| |v| 1e-7, above the compare helper's 1e-6 absolute floor at
 * D = 64. The error is then measured against the scale of the gradients of the same
 * call: ||out|| / ||dv_ref|| <= TOL_BWD_F32 (NaN fails). */
static int check_zero_grad(const char *cname, const char *what, const float *out, int64_t n,
                           const double *dv_ref, int64_t nv) {
    double num = 0, den = 0;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        finite &= isfinite(out[i]) != 0;
        num += (double)out[i] * out[i];
    }
    for (int64_t i = 0; i < nv; i++)
        den += dv_ref[i] * dv_ref[i];
    const double rel = sqrt(num) / sqrt(den);
    const int pass = finite && rel <= TOL_BWD_F32;
    printf("%s %s: exact gradient is 0; ||out|| / ||dv_ref|| = %.3e tol=%.3g %s\n", cname, what,
           rel, TOL_BWD_F32, pass ? "PASS" : "FAIL");
    return pass;
}

/* o, lse <= TOL_FWD_F32 and dq, dk, dv <= TOL_BWD_F32 against ref = {o, lse, dq, dk, dv}. */
static int check_vs_ref(const char *tag, const ocase *x, const opres *r, const double *const *ref) {
    char nm[200];
    int ok = 1;
#define CHECK(what, out, rf, n, tol)                                                               \
    do {                                                                                           \
        snprintf(nm, sizeof nm, "%s %s", tag, what);                                               \
        ok &= lm_check_f32(nm, out, rf, n, tol);                                                   \
    } while (0)
    CHECK("o", r->o, ref[0], x->nq, TOL_FWD_F32);
    CHECK("lse", r->lse, ref[1], x->nl, TOL_FWD_F32);
    CHECK("dv", r->dv, ref[4], x->nk, TOL_BWD_F32);
    if (all_zero(ref[2], x->nq)) {
        ok &= check_zero_grad(tag, "dq", r->dq, x->nq, ref[4], x->nk);
        ok &= check_zero_grad(tag, "dk", r->dk, x->nk, ref[4], x->nk);
    } else {
        CHECK("dq", r->dq, ref[2], x->nq, TOL_BWD_F32);
        CHECK("dk", r->dk, ref[3], x->nk, TOL_BWD_F32);
    }
#undef CHECK
    return ok;
}

static void run_grid_case(void **state) {
    const op_case *oc = *state;
    ocase x;
    ocase_init(oc, &x);
    double *o = xcalloc(x.nq, 8), *lse = xcalloc(x.nl, 8), *dq = xcalloc(x.nq, 8);
    double *dk = xcalloc(x.nk, 8), *dv = xcalloc(x.nk, 8);
    ref_forward(&x.r, x.q64, x.k64, x.v64, o, lse);
    ref_backward(&x.r, x.q64, x.k64, x.v64, x.dO64, dq, dk, dv);

    opres r, r2;
    opres_alloc(&x, &r);
    opres_alloc(&x, &r2);
    op_run(&x, x.q, x.k, x.v, x.dO, NULL, &r);
    const double *ref[5] = {o, lse, dq, dk, dv};
    int ok = check_vs_ref(oc->name, &x, &r, ref);
    /* the portable small-matmul path (machines without AVX-512) */
    if (lm_gemm_small_has_avx512()) {
        char tag[160];
        snprintf(tag, sizeof tag, "%s (portable gemm)", oc->name);
        lm_gemm_small_force_portable(1);
        op_run(&x, x.q, x.k, x.v, x.dO, NULL, &r2);
        lm_gemm_small_force_portable(0);
        ok &= check_vs_ref(tag, &x, &r2, ref);
    }
    char nm[160];

    /* determinism: 1 and 2 threads x both backward schedules, all through one reused
     * workspace, against the first run (no workspace, default threads and schedule) */
    int same = 1;
    static const int threads[] = {1, 2};
    static const int sched[] = {LM_ATTN_BWD_OWNER, LM_ATTN_BWD_TWO_PASS};
    lm_attention_workspace *ws = lm_attention_workspace_new();
    for (int ti = 0; ti < 2; ti++)
        for (int si = 0; si < 2; si++) {
            lm_set_num_threads(threads[ti]);
            lm_attention_force_bwd_schedule(sched[si]);
            op_run(&x, x.q, x.k, x.v, x.dO, ws, &r2);
            snprintf(nm, sizeof nm, "%d thread(s), schedule %d", threads[ti], sched[si]);
            same &= same_bits(nm, &r, &r2, &x);
        }
    lm_attention_force_bwd_schedule(LM_ATTN_BWD_AUTO);
    lm_set_num_threads(0);
    lm_attention_workspace_free(ws);
    printf("%s: bitwise identical over 1 and 2 threads, both backward schedules, reused "
           "workspace: %s\n",
           oc->name, same ? "yes" : "NO");
    ok &= same;

    opres_free(&r), opres_free(&r2);
    free(o), free(lse), free(dq), free(dk), free(dv);
    ocase_free(&x);
    assert_true(ok);
}

/* ================================================================ causality */

static void test_causality(void **state) {
    (void)state;
    static const op_case oc = {"causal", 2, 150, 4, 2, 32, NULL, 0, 0, 1, 1e4, 1, 201};
    ocase x;
    ocase_init(&oc, &x);
    const int64_t t0 = 70; /* inside the second 64-token tile */
    const int Hq = oc.Hq, Hkv = oc.Hkv, D = oc.D;
    opres a, b;
    opres_alloc(&x, &a);
    opres_alloc(&x, &b);
    op_run(&x, x.q, x.k, x.v, x.dO, NULL, &a);
    /* future inputs: positions >= t0 of every batch row */
    float *q = xcalloc(x.nq, 4), *k = xcalloc(x.nk, 4), *v = xcalloc(x.nk, 4);
    memcpy(q, x.q, 4 * x.nq), memcpy(k, x.k, 4 * x.nk), memcpy(v, x.v, 4 * x.nk);
    for (int bb = 0; bb < oc.B; bb++)
        for (int64_t t = t0; t < oc.T; t++) {
            const int64_t r = (int64_t)bb * oc.T + t;
            for (int i = 0; i < Hq * D; i++)
                q[r * Hq * D + i] += 0.5f;
            for (int i = 0; i < Hkv * D; i++)
                k[r * Hkv * D + i] -= 0.7f, v[r * Hkv * D + i] *= -2.0f;
        }
    op_run(&x, q, k, v, x.dO, NULL, &b);
    int ok = 1;
    int64_t changed = 0;
    for (int bb = 0; bb < oc.B; bb++)
        for (int64_t t = 0; t < oc.T; t++) {
            const int64_t r = (int64_t)bb * oc.T + t;
            for (int i = 0; i < Hq * D; i++) {
                const int same = a.o[r * Hq * D + i] == b.o[r * Hq * D + i];
                if (t < t0)
                    ok &= same;
                else
                    changed += !same;
            }
            if (t < t0)
                for (int h = 0; h < Hq; h++)
                    ok &= a.lse[r * Hq + h] == b.lse[r * Hq + h];
        }
    printf(
        "causality (forward): o, lse before t0 = %lld unchanged: %s; %lld later values changed\n",
        (long long)t0, ok ? "yes" : "NO", (long long)changed);
    ok &= changed > 0;
    /* past upstream gradients: dO at positions < t0 */
    float *dO = xcalloc(x.nq, 4);
    memcpy(dO, x.dO, 4 * x.nq);
    for (int bb = 0; bb < oc.B; bb++)
        for (int64_t t = 0; t < t0; t++)
            for (int i = 0; i < Hq * D; i++)
                dO[((int64_t)bb * oc.T + t) * Hq * D + i] *= -1.5f;
    op_run(&x, x.q, x.k, x.v, dO, NULL, &b);
    int okb = 1;
    changed = 0;
    for (int bb = 0; bb < oc.B; bb++)
        for (int64_t t = 0; t < oc.T; t++) {
            const int64_t r = (int64_t)bb * oc.T + t;
            int same = 1;
            for (int i = 0; i < Hq * D; i++)
                same &= a.dq[r * Hq * D + i] == b.dq[r * Hq * D + i];
            for (int i = 0; i < Hkv * D; i++)
                same &= a.dk[r * Hkv * D + i] == b.dk[r * Hkv * D + i] &&
                        a.dv[r * Hkv * D + i] == b.dv[r * Hkv * D + i];
            if (t >= t0)
                okb &= same;
            else
                changed += !same;
        }
    printf("causality (backward): dq, dk, dv at >= t0 unchanged by dO before t0: %s; %lld earlier "
           "rows changed\n",
           okb ? "yes" : "NO", (long long)changed);
    ok &= okb && changed > 0;
    free(q), free(k), free(v), free(dO);
    opres_free(&a), opres_free(&b);
    ocase_free(&x);
    assert_true(ok);
}

/* ================================================================ documents */

/* Rows [t0, t1) of every output equal (bitwise) between a and b at row offsets
 * sa and sb. */
static int rows_bitwise(const ocase *x, const opres *a, int64_t sa, const opres *b, int64_t sb,
                        int64_t len) {
    const int Hq = x->c.Hq, Hkv = x->c.Hkv, D = x->c.D;
    const size_t fq = sizeof(float) * (size_t)(len * Hq * D),
                 fk = sizeof(float) * (size_t)(len * Hkv * D);
    return memcmp(a->o + sa * Hq * D, b->o + sb * Hq * D, fq) == 0 &&
           memcmp(a->lse + sa * Hq, b->lse + sb * Hq, sizeof(float) * (size_t)(len * Hq)) == 0 &&
           memcmp(a->dq + sa * Hq * D, b->dq + sb * Hq * D, fq) == 0 &&
           memcmp(a->dk + sa * Hkv * D, b->dk + sb * Hkv * D, fk) == 0 &&
           memcmp(a->dv + sa * Hkv * D, b->dv + sb * Hkv * D, fk) == 0;
}

static void test_document_independence(void **state) {
    (void)state;
    static const op_case oc = {"docs", 1, 264, 4, 2, 64, CU_A, 9, 0, 1, 1e4, 1, 301};
    ocase x;
    ocase_init(&oc, &x);
    const int Hq = oc.Hq, Hkv = oc.Hkv, D = oc.D, pd = 5; /* perturb document 5 (121 tokens) */
    opres a, b;
    opres_alloc(&x, &a);
    opres_alloc(&x, &b);
    op_run(&x, x.q, x.k, x.v, x.dO, NULL, &a);
    float *q = xcalloc(x.nq, 4), *k = xcalloc(x.nk, 4), *v = xcalloc(x.nk, 4),
          *dO = xcalloc(x.nq, 4);
    memcpy(q, x.q, 4 * x.nq), memcpy(k, x.k, 4 * x.nk), memcpy(v, x.v, 4 * x.nk);
    memcpy(dO, x.dO, 4 * x.nq);
    for (int64_t t = CU_A[pd]; t < CU_A[pd + 1]; t++) {
        for (int i = 0; i < Hq * D; i++)
            q[t * Hq * D + i] += 0.3f, dO[t * Hq * D + i] *= 2.0f;
        for (int i = 0; i < Hkv * D; i++)
            k[t * Hkv * D + i] -= 0.2f, v[t * Hkv * D + i] *= -1.0f;
    }
    op_run(&x, q, k, v, dO, NULL, &b);
    int ok = 1;
    for (int n = 0; n < oc.ncu - 1; n++) {
        const int64_t len = CU_A[n + 1] - CU_A[n];
        const int same = rows_bitwise(&x, &a, CU_A[n], &b, CU_A[n], len);
        printf("document %d (length %lld): %s\n", n, (long long)len,
               same ? "bit-identical" : "changed");
        ok &= n == pd ? !same : same;
    }
    free(q), free(k), free(v), free(dO);
    opres_free(&a), opres_free(&b);
    ocase_free(&x);
    assert_true(ok);
}

/* Document A (37 tokens) and B (70 tokens): [A, B], [B, A], and each alone, with
 * RoPE (theta 1e4) and 4:2 heads. Positions restart per document, so A's and B's
 * results do not depend on where they sit. */
static void test_rope_restarts(void **state) {
    (void)state;
    enum { LA = 37, LB = 70, LT = LA + LB };
    const int Hq = 4, Hkv = 2, D = 32;
    const int64_t cu_ab[] = {0, LA, LT}, cu_ba[] = {0, LB, LT};
    op_case oc_ab = {"[A,B]", 1, LT, Hq, Hkv, D, cu_ab, 3, 0, 1, 1e4, 1, 401};
    ocase ab;
    ocase_init(&oc_ab, &ab);
    /* [B, A]: the same rows, moved */
    op_case oc_ba = oc_ab;
    oc_ba.cu = cu_ba;
    ocase ba;
    ocase_init(&oc_ba, &ba);
    const int64_t rq = (int64_t)Hq * D, rk = (int64_t)Hkv * D;
#define MOVE(dst, src, r, a0, b0, n)                                                               \
    memcpy(dst + (b0) * (r), src + (a0) * (r), sizeof(float) * (size_t)((n) * (r)))
    MOVE(ba.q, ab.q, rq, 0, LB, LA), MOVE(ba.q, ab.q, rq, LA, 0, LB);
    MOVE(ba.dO, ab.dO, rq, 0, LB, LA), MOVE(ba.dO, ab.dO, rq, LA, 0, LB);
    MOVE(ba.k, ab.k, rk, 0, LB, LA), MOVE(ba.k, ab.k, rk, LA, 0, LB);
    MOVE(ba.v, ab.v, rk, 0, LB, LA), MOVE(ba.v, ab.v, rk, LA, 0, LB);
#undef MOVE
    opres rab, rba;
    opres_alloc(&ab, &rab);
    opres_alloc(&ba, &rba);
    op_run(&ab, ab.q, ab.k, ab.v, ab.dO, NULL, &rab);
    op_run(&ba, ba.q, ba.k, ba.v, ba.dO, NULL, &rba);
    int okA = rows_bitwise(&ab, &rab, 0, &rba, LB, LA);
    int okB = rows_bitwise(&ab, &rab, LA, &rba, 0, LB);
    /* each alone (B = 1, no cu_seqlens) */
    int okAlone = 1;
    for (int which = 0; which < 2; which++) {
        const int L = which ? LB : LA;
        const int64_t off = which ? LA : 0;
        op_case oc1 = {"alone", 1, L, Hq, Hkv, D, NULL, 0, 0, 1, 1e4, 1, 402};
        ocase one;
        ocase_init(&oc1, &one);
        memcpy(one.q, ab.q + off * rq, sizeof(float) * (size_t)(L * rq));
        memcpy(one.dO, ab.dO + off * rq, sizeof(float) * (size_t)(L * rq));
        memcpy(one.k, ab.k + off * rk, sizeof(float) * (size_t)(L * rk));
        memcpy(one.v, ab.v + off * rk, sizeof(float) * (size_t)(L * rk));
        opres r1;
        opres_alloc(&one, &r1);
        op_run(&one, one.q, one.k, one.v, one.dO, NULL, &r1);
        okAlone &= rows_bitwise(&one, &r1, 0, &rab, off, L);
        opres_free(&r1);
        ocase_free(&one);
    }
    /* and the packed result is right (positions restart in the reference too) */
    double *o = xcalloc(ab.nq, 8), *lse = xcalloc(ab.nl, 8);
    ref_forward(&ab.r, ab.q64, ab.k64, ab.v64, o, lse);
    int okRef = lm_check_f32("rope restart [A,B] o vs reference", rab.o, o, ab.nq, TOL_FWD_F32);
    printf("rope restart: A at offset 0 vs after B: %s; B after A vs at 0: %s; alone: %s\n",
           okA ? "bit-identical" : "DIFFERENT", okB ? "bit-identical" : "DIFFERENT",
           okAlone ? "bit-identical" : "DIFFERENT");
    free(o), free(lse);
    opres_free(&rab), opres_free(&rba);
    ocase_free(&ab), ocase_free(&ba);
    assert_true(okA && okB && okAlone && okRef);
}

/* ================================================================ decode */

/* Rows [t0, t0+n) of a [B, T, H, D] tensor, for every batch row, as [B, n, H, D]. */
static float *slice_rows(const float *x, int B, int T, int64_t row, int64_t t0, int64_t n) {
    float *y = xcalloc((int64_t)B * n * row, 4);
    for (int b = 0; b < B; b++)
        memcpy(y + (int64_t)b * n * row, x + ((int64_t)b * T + t0) * row,
               sizeof(float) * (size_t)(n * row));
    return y;
}

static int decode_case(const op_case *oc, int prefill) {
    ocase x;
    ocase_init(oc, &x);
    const int B = oc->B, T = oc->T, Hq = oc->Hq, Hkv = oc->Hkv, D = oc->D;
    const int64_t Tmax = T + 5, rq = (int64_t)Hq * D, rk = (int64_t)Hkv * D;
    lm_error err = {0};
    float *o = xcalloc(x.nq, 4), *lse = xcalloc(x.nl, 4);
    lm_attention_inputs in = {x.q, x.k, x.v};
    lm_attention_config c = x.c;
    assert_int_equal(lm_attention_forward(&c, &in, o, lse, &err), LM_OK);
    float *kc = xcalloc(B * Tmax * rk, 4), *vc = xcalloc(B * Tmax * rk, 4);
    float *od = xcalloc(x.nq, 4), *ld = xcalloc(x.nl, 4);
    lm_poison_f32(kc, B * Tmax * rk), lm_poison_f32(vc, B * Tmax * rk);
    lm_poison_f32(od, x.nq), lm_poison_f32(ld, x.nl);
    lm_attention_workspace *ws = lm_attention_workspace_new();
    /* prefill: one cache write of the first `prefill` tokens */
    if (prefill > 0) {
        lm_attention_config cw = x.c;
        cw.T = prefill;
        float *ks = slice_rows(x.k, B, T, rk, 0, prefill),
              *vs = slice_rows(x.v, B, T, rk, 0, prefill);
        assert_int_equal(lm_attention_cache_write(&cw, Tmax, 0, ks, vs, kc, vc, &err), LM_OK);
        free(ks), free(vs);
    }
    lm_attention_config c1 = x.c;
    c1.T = 1;
    c1.ws = ws;
    for (int64_t t = 0; t < T; t++) {
        if (t >= prefill) {
            float *ks = slice_rows(x.k, B, T, rk, t, 1), *vs = slice_rows(x.v, B, T, rk, t, 1);
            lm_status st = lm_attention_cache_write(&c1, Tmax, t, ks, vs, kc, vc, &err);
            if (st != LM_OK)
                print_message("cache_write: %s\n", err.msg);
            assert_int_equal(st, LM_OK);
            free(ks), free(vs);
        }
        float *qs = slice_rows(x.q, B, T, rq, t, 1), *os = xcalloc(B * rq, 4),
              *ls = xcalloc(B * Hq, 4);
        lm_status st = lm_attention_decode(&c1, Tmax, t, qs, kc, vc, os, ls, &err);
        if (st != LM_OK)
            print_message("decode: %s\n", err.msg);
        assert_int_equal(st, LM_OK);
        for (int b = 0; b < B; b++) {
            memcpy(od + ((int64_t)b * T + t) * rq, os + b * rq, sizeof(float) * (size_t)rq);
            memcpy(ld + ((int64_t)b * T + t) * Hq, ls + b * Hq, sizeof(float) * (size_t)Hq);
        }
        free(qs), free(os), free(ls);
    }
    double *o64 = lm_to_f64(o, x.nq), *l64 = lm_to_f64(lse, x.nl);
    char nm[160];
    snprintf(nm, sizeof nm, "%s decode o vs full forward", oc->name);
    int ok = lm_check_f32(nm, od, o64, x.nq, TOL_FWD_F32);
    snprintf(nm, sizeof nm, "%s decode lse vs full forward", oc->name);
    ok &= lm_check_f32(nm, ld, l64, x.nl, TOL_FWD_F32);
    free(o64), free(l64);
    lm_attention_workspace_free(ws);
    free(o), free(lse), free(kc), free(vc), free(od), free(ld);
    ocase_free(&x);
    return ok;
}

static void test_decode(void **state) {
    (void)state;
    static const op_case a = {"decode rope1e6 8:2 B2", 2, 75, 8, 2, 64, NULL, 0, 0, 1, 1e6, 1, 501};
    static const op_case b = {
        "decode nope 4:4 D100", 1, 70, 4, 4, 100, NULL, 0, 0.3f, 0, 0, 1, 502};
    static const op_case d = {
        "decode rope1e4 4:1 sharp", 1, 66, 4, 1, 32, NULL, 0, 0, 1, 1e4, 3, 503};
    int ok = decode_case(&a, 40);
    ok &= decode_case(&b, 0);
    ok &= decode_case(&d, 65);
    /* more than 64 query heads per kv head: the decode step takes them 64 at a time */
    static const op_case e = {
        "decode rope1e4 72:1 D8", 1, 20, 72, 1, 8, NULL, 0, 0, 1, 1e4, 1, 504};
    ok &= decode_case(&e, 3);
    assert_true(ok);
}

/* RoPE at positions 65530..65536 through the cache writer, against a long-double
 * rotation; then a decode step at 65536 over a full cache against the reference. */
static void test_rope_long_positions(void **state) {
    (void)state;
    int ok = 1;
    static const double thetas[] = {1e4, 1e6};
    for (int ti = 0; ti < 2; ti++) {
        const int D = 128, Hkv = 2, n = 7;
        const int64_t Tmax = 65537, pos = Tmax - n;
        lm_attention_config c;
        lm_attention_config_default(&c, 1, n, 2, Hkv, D);
        c.position = LM_POS_ROPE, c.rope_theta = thetas[ti];
        const int64_t nk = (int64_t)n * Hkv * D;
        double *k64 = xcalloc(nk, 8);
        lm_fill_normal(k64, nk, 600 + ti, 0, 1);
        float *k = lm_to_f32(k64, nk);
        float *kc = xcalloc(Tmax * Hkv * D, 4), *vc = xcalloc(Tmax * Hkv * D, 4);
        lm_error err = {0};
        assert_int_equal(lm_attention_cache_write(&c, Tmax, pos, k, k, kc, vc, &err), LM_OK);
        double *ref = xcalloc(nk, 8);
        for (int t = 0; t < n; t++)
            for (int g = 0; g < Hkv; g++)
                for (int f = 0; f < D / 2; f++) {
                    const long double ang =
                        (long double)(pos + t) * powl((long double)thetas[ti], -2.0L * f / D);
                    const long double cs = cosl(ang), sn = sinl(ang);
                    const float *x = k + ((int64_t)t * Hkv + g) * D;
                    double *y = ref + ((int64_t)t * Hkv + g) * D;
                    y[f] = (double)(x[f] * cs - x[f + D / 2] * sn);
                    y[f + D / 2] = (double)(x[f + D / 2] * cs + x[f] * sn);
                }
        char nm[128];
        snprintf(nm, sizeof nm, "rope theta %g positions %lld..%lld", thetas[ti], (long long)pos,
                 (long long)(Tmax - 1));
        ok &= lm_check_f32(nm, kc + pos * Hkv * D, ref, nk, TOL_ROPE);
        free(k64), free(k), free(kc), free(vc), free(ref);
    }
    {
        /* decode at position 65536 (B = 1, 4:1 heads, D = 32, theta 1e6) */
        const int D = 32, Hq = 4, Hkv = 1;
        const int64_t Tmax = 65537, pos = Tmax - 1, nk = Tmax * Hkv * D;
        lm_attention_config c;
        lm_attention_config_default(&c, 1, (int)Tmax, Hq, Hkv, D);
        c.position = LM_POS_ROPE, c.rope_theta = 1e6;
        double *q64 = xcalloc(Hq * D, 8), *k64 = xcalloc(nk, 8), *v64 = xcalloc(nk, 8);
        lm_fill_normal(q64, Hq * D, 610, 0, 2);
        lm_fill_normal(k64, nk, 611, 0, 2);
        lm_fill_normal(v64, nk, 612, 0, 1);
        float *q = lm_to_f32(q64, Hq * D), *k = lm_to_f32(k64, nk), *v = lm_to_f32(v64, nk);
        float *kc = xcalloc(nk, 4), *vc = xcalloc(nk, 4), *o = xcalloc(Hq * D, 4),
              *lse = xcalloc(Hq, 4);
        lm_error err = {0};
        assert_int_equal(lm_attention_cache_write(&c, Tmax, 0, k, v, kc, vc, &err), LM_OK);
        lm_attention_config c1 = c;
        c1.T = 1;
        lm_poison_f32(o, Hq * D);
        assert_int_equal(lm_attention_decode(&c1, Tmax, pos, q, kc, vc, o, lse, &err), LM_OK);
        /* fp64 reference: the last query against every key */
        double *ro = xcalloc(Hq * D, 8), *rl = xcalloc(Hq, 8), *s = xcalloc(Tmax, 8);
        double *kt = xcalloc(nk, 8), qt[32], qx[32], kx[32];
        for (int64_t j = 0; j < Tmax; j++) {
            for (int d = 0; d < D; d++)
                kx[d] = (double)k[j * D + d];
            ref_rotate(kx, kt + j * D, D, j, 1e6, 1.0);
        }
        for (int h = 0; h < Hq; h++) {
            for (int d = 0; d < D; d++)
                qx[d] = (double)q[h * D + d];
            ref_rotate(qx, qt, D, pos, 1e6, 1.0);
            double m = -INFINITY;
            for (int64_t j = 0; j < Tmax; j++) {
                double dot = 0;
                for (int d = 0; d < D; d++)
                    dot += qt[d] * kt[j * D + d];
                s[j] = dot * (double)c.scale;
                m = fmax(m, s[j]);
            }
            double z = 0;
            for (int64_t j = 0; j < Tmax; j++)
                z += (s[j] = exp(s[j] - m));
            for (int64_t j = 0; j < Tmax; j++)
                for (int d = 0; d < D; d++)
                    ro[h * D + d] += s[j] / z * (double)v[j * D + d];
            rl[h] = m + log(z);
        }
        free(kt);
        ok &= lm_check_f32("decode at position 65536 o vs reference", o, ro, Hq * D, TOL_FWD_F32);
        ok &= lm_check_f32("decode at position 65536 lse vs reference", lse, rl, Hq, TOL_FWD_F32);
        free(q64), free(k64), free(v64), free(q), free(k), free(v), free(kc), free(vc);
        free(o), free(lse), free(ro), free(rl), free(s);
    }
    assert_true(ok);
}

/* ================================================================ invalid input */

static int names(const char *msg, const char *field) {
    return field == NULL || strstr(msg, field) != NULL;
}

/* Validation, forward and backward all refuse `c` / `in`; the message names f1 and
 * (when given) f2. */
/* validate, forward and backward all refuse (c, in); want < 0: with any status, else with
 * exactly status `want`. The validate message must name f1 and f2. */
static int expect_refusal(const char *what, lm_attention_config c, const lm_attention_inputs *in,
                          int want, const char *f1, const char *f2) {
    lm_error err = {0};
    lm_attention_config cv = c;
    lm_status st = lm_attention_validate(&cv, in, &err);
    int named = names(err.msg, f1) && names(err.msg, f2);
    printf("invalid %-36s -> %d \"%s\"%s\n", what, (int)st, err.msg,
           named ? "" : "  <-- not named");
#define REFUSED(s) (want < 0 ? (s) != LM_OK : (int)(s) == want)
    int ok = REFUSED(st) && named;
    const int64_t nq = (int64_t)(c.B > 0 ? c.B : 1) * (c.T > 0 ? c.T : 1) * (c.Hq > 0 ? c.Hq : 1) *
                       (c.D > 0 ? c.D : 1);
    float *o = xcalloc(nq, 4), *lse = xcalloc(nq, 4);
    lm_error e2 = {0};
    lm_attention_config cf = c;
    ok &= REFUSED(lm_attention_forward(&cf, in, o, lse, &e2));
    lm_attention_grads gr = {o, o, o, o};
    cf = c;
    ok &= REFUSED(lm_attention_backward(&cf, in, o, lse, &gr, &e2));
#undef REFUSED
    free(o), free(lse);
    return ok;
}

static int expect_invalid(const char *what, lm_attention_config c, const lm_attention_inputs *in,
                          const char *f1, const char *f2) {
    return expect_refusal(what, c, in, -1, f1, f2);
}

/* a non-finite input tensor: LM_ERR_NONFINITE from all three calls */
static int expect_nonfinite(const char *what, lm_attention_config c, const lm_attention_inputs *in,
                            const char *f1, const char *f2) {
    return expect_refusal(what, c, in, LM_ERR_NONFINITE, f1, f2);
}

static void test_invalid(void **state) {
    (void)state;
    static const op_case oc = {"invalid", 1, 40, 4, 2, 16, NULL, 0, 0, 1, 1e4, 1, 701};
    ocase x;
    ocase_init(&oc, &x);
    lm_attention_inputs in = {x.q, x.k, x.v};
    lm_error err = {0};
    {
        lm_attention_config cv = x.c;
        assert_int_equal(lm_attention_validate(&cv, &in, &err), LM_OK); /* the base is valid */
    }
    const lm_attention_config base = x.c;
    lm_attention_config c;
    int ok = 1;
    c = base, c.Hkv = 3;
    ok &= expect_invalid("Hq not a multiple of Hkv", c, &in, "Hq = 4", "Hkv = 3");
    c = base, c.D = 0;
    ok &= expect_invalid("D = 0", c, &in, "D = 0", NULL);
    c = base, c.T = -1;
    ok &= expect_invalid("T = -1", c, &in, "T = -1", NULL);
    c = base, c.D = 2048;
    ok &= expect_invalid("D = 2048", c, &in, "D = 2048", NULL);
    c = base, c.D = 15, c.Hq = 2;
    ok &= expect_invalid("odd D with RoPE", c, &in, "D = 15", "RoPE");
    c = base, c.causal = 0;
    ok &= expect_invalid("non-causal", c, &in, "causal = 0", NULL);
    {
        lm_attention_config cv = c;
        assert_int_equal(lm_attention_validate(&cv, &in, &err), LM_ERR_UNSUPPORTED);
    }
    c = base, c.scale = NAN; /* a config scalar: LM_ERR_INVALID, not LM_ERR_NONFINITE */
    ok &= expect_refusal("scale NaN", c, &in, LM_ERR_INVALID, "scale", NULL);
    c = base, c.rope_theta = 0.0;
    ok &= expect_invalid("rope_theta 0", c, &in, "rope_theta = 0", NULL);
    c = base, c.rope_theta = INFINITY;
    ok &= expect_refusal("rope_theta inf", c, &in, LM_ERR_INVALID, "rope_theta", NULL);
    c = base, c.position = (lm_attn_position)7;
    ok &= expect_invalid("position 7", c, &in, "position", "7");
    {
        /* NoPE ignores rope_theta */
        lm_attention_config cv = base;
        cv.position = LM_POS_NOPE, cv.rope_theta = -1;
        assert_int_equal(lm_attention_validate(&cv, &in, &err), LM_OK);
    }
    const int64_t cu_start[] = {1, 20, 40}, cu_dec[] = {0, 25, 20, 40}, cu_end[] = {0, 20, 39},
                  cu_b[] = {0, 10, 20}, cu_one[] = {0};
    c = base, c.cu_seqlens = cu_start, c.n_cu_seqlens = 3;
    ok &= expect_invalid("cu_seqlens not starting at 0", c, &in, "cu_seqlens[0] = 1", NULL);
    c = base, c.cu_seqlens = cu_dec, c.n_cu_seqlens = 4;
    ok &= expect_invalid("cu_seqlens decreasing", c, &in, "cu_seqlens decreases", "20 < 25");
    c = base, c.cu_seqlens = cu_end, c.n_cu_seqlens = 3;
    ok &= expect_invalid("cu_seqlens not ending at T", c, &in, "ends at 39", "T = 40");
    c = base, c.cu_seqlens = cu_one, c.n_cu_seqlens = 1;
    ok &= expect_invalid("cu_seqlens with 1 entry", c, &in, "cu_seqlens has 1", NULL);
    c = base, c.B = 2, c.T = 20, c.cu_seqlens = cu_b, c.n_cu_seqlens = 3;
    ok &= expect_invalid("cu_seqlens with B = 2", c, &in, "B == 1", "B = 2");

    float *bad = xcalloc(x.nq, 4);
    memcpy(bad, x.q, 4 * x.nq);
    bad[x.nq / 2] = NAN;
    lm_attention_inputs bq = {bad, x.k, x.v};
    ok &= expect_nonfinite("NaN in q", base, &bq, "'q'", "non-finite");
    lm_attention_inputs bk = {x.q, bad, x.v}; /* nk < nq: element nq/2 is past k; use k's own */
    float *badk = xcalloc(x.nk, 4);
    memcpy(badk, x.k, 4 * x.nk);
    badk[3] = INFINITY;
    bk.k = badk;
    ok &= expect_nonfinite("Inf in k", base, &bk, "'k'", NULL);
    lm_attention_inputs bv = {x.q, x.k, badk};
    ok &= expect_nonfinite("Inf in v", base, &bv, "'v'", NULL);
    lm_attention_inputs bn = {x.q, NULL, x.v};
    ok &= expect_invalid("k missing", base, &bn, "required", NULL);

    /* backward: NaN in do, missing lse */
    {
        lm_attention_config cb = base;
        float *o = xcalloc(x.nq, 4), *lse = xcalloc(x.nl, 4), *g = xcalloc(x.nq, 4);
        assert_int_equal(lm_attention_forward(&cb, &in, o, lse, &err), LM_OK);
        lm_attention_grads gr = {bad, g, g, g};
        lm_status st = lm_attention_backward(&cb, &in, o, lse, &gr, &err);
        printf("invalid NaN in do -> %d \"%s\"\n", (int)st, err.msg);
        ok &= st == LM_ERR_NONFINITE && names(err.msg, "'do'");
        gr.do_ = x.dO;
        st = lm_attention_backward(&cb, &in, o, NULL, &gr, &err);
        printf("invalid lse missing -> %d \"%s\"\n", (int)st, err.msg);
        ok &= st == LM_ERR_INVALID && names(err.msg, "lse");
        free(o), free(lse), free(g);
    }
    /* cache writer and decode */
    {
        const int64_t Tmax = 8, nc = 2 * Tmax * 16;
        float *kc = xcalloc(nc, 4), *vc = xcalloc(nc, 4), *o = xcalloc(64, 4);
        lm_attention_config cd = base;
        cd.T = 1;
        lm_status st = lm_attention_decode(&cd, Tmax, 8, x.q, kc, vc, o, NULL, &err);
        printf("invalid decode pos = Tmax -> %d \"%s\"\n", (int)st, err.msg);
        ok &= st == LM_ERR_INVALID && names(err.msg, "pos = 8") && names(err.msg, "Tmax = 8");
        st = lm_attention_decode(&cd, Tmax, -1, x.q, kc, vc, o, NULL, &err);
        ok &= st == LM_ERR_INVALID && names(err.msg, "pos = -1");
        cd.T = 2;
        st = lm_attention_decode(&cd, Tmax, 0, x.q, kc, vc, o, NULL, &err);
        printf("invalid decode T = 2 -> %d \"%s\"\n", (int)st, err.msg);
        ok &= st == LM_ERR_INVALID && names(err.msg, "T = 2");
        cd.T = 1;
        st = lm_attention_decode(&cd, Tmax, 0, bad + x.nq / 2 - 5, kc, vc, o, NULL, &err);
        ok &= st == LM_ERR_NONFINITE && names(err.msg, "'q'");
        lm_attention_config cw = base;
        cw.T = 3;
        st = lm_attention_cache_write(&cw, Tmax, 6, x.k, x.v, kc, vc, &err);
        printf("invalid cache_write past Tmax -> %d \"%s\"\n", (int)st, err.msg);
        ok &= st == LM_ERR_INVALID && names(err.msg, "pos = 6") && names(err.msg, "3 token");
        st = lm_attention_cache_write(&cw, Tmax, 0, badk, x.v, kc, vc, &err);
        ok &= st == LM_ERR_NONFINITE && names(err.msg, "'k'");
        const int64_t cu2[] = {0, 3};
        cw.cu_seqlens = cu2, cw.n_cu_seqlens = 2;
        st = lm_attention_cache_write(&cw, Tmax, 0, x.k, x.v, kc, vc, &err);
        ok &= st == LM_ERR_INVALID && names(err.msg, "cu_seqlens");
        free(kc), free(vc), free(o);
    }
    free(bad), free(badk);
    ocase_free(&x);
    assert_true(ok);
}

int main(void) {
    enum { NG = sizeof GRID / sizeof GRID[0] };
    struct CMUnitTest tests[NG + 8];
    int n = 0;
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_reference_fd);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_invalid);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_causality);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_document_independence);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_rope_restarts);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_decode);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_rope_long_positions);
    for (int i = 0; i < NG; i++) {
        tests[n] = (struct CMUnitTest)cmocka_unit_test_prestate(run_grid_case, (void *)&GRID[i]);
        tests[n].name = GRID[i].name;
        n++;
    }
    double t0 = lm_time_sec();
    int rc = _cmocka_run_group_tests("attention", tests, (size_t)n, NULL, NULL);
    printf("test_attention: %.1f s\n", lm_time_sec() - t0);
    return rc;
}
