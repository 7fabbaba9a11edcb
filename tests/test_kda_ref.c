/* The fp64 KDA / GDN reference checked on its own (it is the oracle of test_kda.c):
 *  - every analytic gradient (q, k, v, g, beta, h0, A_log, dt_bias) against central
 *    finite differences of L = sum(o*do) + sum(ht*dht), on tiny shapes covering KDA
 *    and GDN, gates none / softplus / bounded with and without A_log / dt_bias,
 *    in-op l2norm and beta sigmoid on and off, GVA, varlen with empty and length-1
 *    segments, sequences longer than the 64-token checkpoint interval, h0 / dht
 *    present and absent;
 *  - the forward against an independent closed form: the chunked WY formula of
 *    reference/kda.md §2.1 written naively (explicit exp(G_r - G_i) per pair, forward
 *    substitution) on a single chunk;
 *  - empty sequences: ht = h0 and dh0 = dht exactly.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda_ref.h"
#include "test_util.h"

/* FD step: the loss is smooth and O(1..100); truncation h^2 ~ 1e-10 and rounding
 * 1e-16 * |L| / h ~ 1e-10 are both far below TOL_FD. */
#define FD_H 1e-5

typedef struct {
    const char *name;
    lm_kda_kind kind;
    lm_gate_mode gate;
    int has_A, has_bias;
    int l2, sig;
    int B, T, H, HV, K, V;
    const int64_t *cu; /* NULL or [ncu] */
    int ncu;
    int has_h0, has_dht;
    float lb;
    float scale;
    double mask_p; /* gate NONE: fraction of g set to -1000 (and as many to 0) */
    uint64_t seed;
} fd_case;

typedef struct {
    lm_kda_config c;
    int64_t nq, nv, ng, nb, nA, nbias, ns;
    double *q, *k, *v, *g, *beta, *A, *bias, *h0, *dO, *dht;
} fd_data;

static double *dup_or_null(int cond, int64_t n) {
    return cond ? calloc((size_t)(n ? n : 1), sizeof(double)) : NULL;
}

static void fd_setup(const fd_case *fc, fd_data *d) {
    memset(d, 0, sizeof *d);
    lm_kda_config *c = &d->c;
    c->kind = fc->kind;
    c->B = fc->B;
    c->T = fc->T;
    c->H = fc->H;
    c->HV = fc->HV;
    c->K = fc->K;
    c->V = fc->V;
    c->cu_seqlens = fc->cu;
    c->n_cu_seqlens = fc->cu ? fc->ncu : 0;
    c->N = fc->cu ? fc->ncu - 1 : fc->B;
    c->gate = fc->gate;
    c->has_lower_bound = fc->gate == LM_GATE_BOUNDED;
    c->lower_bound = fc->lb;
    c->scale = fc->scale;
    c->chunk_size = 64;
    c->use_qk_l2norm_in_kernel = fc->l2;
    c->use_beta_sigmoid_in_kernel = fc->sig;
    const int64_t BT = (int64_t)fc->B * fc->T;
    const int GK = fc->kind == LM_KDA ? fc->K : 1;
    d->nq = BT * fc->H * fc->K;
    d->nv = BT * fc->HV * fc->V;
    d->ng = BT * fc->HV * GK;
    d->nb = BT * fc->HV;
    d->nA = fc->HV;
    d->nbias = (int64_t)fc->HV * GK;
    d->ns = (int64_t)c->N * fc->HV * fc->K * fc->V;
    uint64_t s = fc->seed * 1000;
    d->q = dup_or_null(1, d->nq);
    d->k = dup_or_null(1, d->nq);
    d->v = dup_or_null(1, d->nv);
    d->g = dup_or_null(1, d->ng);
    d->beta = dup_or_null(1, d->nb);
    d->A = dup_or_null(fc->has_A, d->nA);
    d->bias = dup_or_null(fc->has_bias, d->nbias);
    d->h0 = dup_or_null(fc->has_h0, d->ns);
    d->dO = dup_or_null(1, d->nv);
    d->dht = dup_or_null(fc->has_dht, d->ns);
    /* Without in-op l2norm the keys must be small enough for I - b k k^T to stay a
     * contraction-ish map, as in real use (fla pre-normalises). */
    double qk_std = fc->l2 ? 1.0 : 0.5;
    lm_fill_normal(d->q, d->nq, s + 1, 0.0, qk_std);
    lm_fill_normal(d->k, d->nq, s + 2, 0.0, qk_std);
    lm_fill_normal(d->v, d->nv, s + 3, 0.0, 1.0);
    lm_fill_normal(d->dO, d->nv, s + 4, 0.0, 1.0);
    if (fc->sig)
        lm_fill_normal(d->beta, d->nb, s + 5, 0.0, 1.0);
    else
        lm_fill_uniform(d->beta, d->nb, s + 5, 0.05, 0.95);
    lm_fill_normal(d->g, d->ng, s + 6, 0.0, 1.0);
    if (fc->gate == LM_GATE_NONE) {
        double *m = calloc((size_t)d->ng, sizeof(double));
        lm_fill_uniform(m, d->ng, s + 7, 0.0, 1.0);
        for (int64_t i = 0; i < d->ng; i++) {
            /* logsigmoid(x) = -softplus(-x) <= 0 */
            double x = d->g[i];
            d->g[i] = -(x < -20 ? -x : log1p(exp(-x)));
            if (m[i] < fc->mask_p)
                d->g[i] = -1000.0;
            else if (m[i] < 2 * fc->mask_p)
                d->g[i] = 0.0;
        }
        free(m);
    }
    if (d->A)
        lm_fill_normal(d->A, d->nA, s + 8, 0.0, 0.5);
    if (d->bias)
        lm_fill_normal(d->bias, d->nbias, s + 9, 0.0, 0.5);
    if (d->h0)
        lm_fill_normal(d->h0, d->ns, s + 10, 0.0, 1.0);
    if (d->dht)
        lm_fill_normal(d->dht, d->ns, s + 11, 0.0, 1.0);
}

static void fd_free(fd_data *d) {
    free(d->q);
    free(d->k);
    free(d->v);
    free(d->g);
    free(d->beta);
    free(d->A);
    free(d->bias);
    free(d->h0);
    free(d->dO);
    free(d->dht);
}

static kda_ref_io fd_io(const fd_data *d) {
    kda_ref_io io = {0};
    io.q = d->q;
    io.k = d->k;
    io.v = d->v;
    io.g = d->g;
    io.beta = d->beta;
    io.A_log = d->A;
    io.dt_bias = d->bias;
    io.h0 = d->h0;
    return io;
}

/* L = sum(o*do) + sum(ht*dht), forward only. */
static double fd_loss(const fd_data *d, double *o, double *ht) {
    kda_ref_io io = fd_io(d);
    io.o = o;
    io.ht = ht;
    kda_ref_run(&d->c, &io);
    double L = 0;
    for (int64_t i = 0; i < d->nv; i++)
        L += o[i] * d->dO[i];
    if (d->dht)
        for (int64_t i = 0; i < d->ns; i++)
            L += ht[i] * d->dht[i];
    return L;
}

static void fd_grad(fd_data *d, double *x, int64_t n, double *out, double *o, double *ht) {
    for (int64_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + FD_H;
        double lp = fd_loss(d, o, ht);
        x[i] = x0 - FD_H;
        double lm = fd_loss(d, o, ht);
        x[i] = x0;
        out[i] = (lp - lm) / (2 * FD_H);
    }
}

static void run_fd_case(void **state) {
    const fd_case *fc = *state;
    printf("--- %s\n", fc->name);
    fd_data d;
    fd_setup(fc, &d);
    double *o = calloc((size_t)d.nv, sizeof(double));
    double *ht = calloc((size_t)(d.ns ? d.ns : 1), sizeof(double));
    /* analytic */
    double *dq = calloc((size_t)d.nq, sizeof(double)), *dk = calloc((size_t)d.nq, sizeof(double));
    double *dv = calloc((size_t)d.nv, sizeof(double)), *dg = calloc((size_t)d.ng, sizeof(double));
    double *db = calloc((size_t)d.nb, sizeof(double));
    double *dh0 = calloc((size_t)(d.ns ? d.ns : 1), sizeof(double));
    double *dA = calloc((size_t)d.nA, sizeof(double)),
           *dbias = calloc((size_t)d.nbias, sizeof(double));
    kda_ref_io io = fd_io(&d);
    io.o = o;
    io.ht = ht;
    io.do_ = d.dO;
    io.dht = d.dht;
    io.dq = dq;
    io.dk = dk;
    io.dv = dv;
    io.dg = dg;
    io.dbeta = db;
    io.dh0 = dh0;
    io.dA_log = dA;
    io.ddt_bias = dbias;
    kda_ref_run(&d.c, &io);

    /* The forward-only path must give the same o/ht as the forward inside the
     * backward run. */
    double *o2 = calloc((size_t)d.nv, sizeof(double));
    double *ht2 = calloc((size_t)(d.ns ? d.ns : 1), sizeof(double));
    fd_loss(&d, o2, ht2);
    assert_memory_equal(o, o2, sizeof(double) * d.nv);
    assert_memory_equal(ht, ht2, sizeof(double) * d.ns);

    int64_t nmax = d.nq;
    if (d.nv > nmax)
        nmax = d.nv;
    if (d.ng > nmax)
        nmax = d.ng;
    if (d.ns > nmax)
        nmax = d.ns;
    double *fd = calloc((size_t)nmax, sizeof(double));
    int ok = 1;
    char nm[128];
#define FD_CHECK(label, arr, n, an)                                                                \
    do {                                                                                           \
        fd_grad(&d, arr, n, fd, o2, ht2);                                                          \
        snprintf(nm, sizeof nm, "%s: %s vs FD", fc->name, label);                                  \
        ok &= lm_check_f64(nm, an, fd, n, TOL_FD);                                                 \
    } while (0)
    FD_CHECK("dq", d.q, d.nq, dq);
    FD_CHECK("dk", d.k, d.nq, dk);
    FD_CHECK("dv", d.v, d.nv, dv);
    FD_CHECK("dg", d.g, d.ng, dg);
    FD_CHECK("dbeta", d.beta, d.nb, db);
    if (d.h0)
        FD_CHECK("dh0", d.h0, d.ns, dh0);
    if (d.A)
        FD_CHECK("dA_log", d.A, d.nA, dA);
    if (d.bias)
        FD_CHECK("ddt_bias", d.bias, d.nbias, dbias);
#undef FD_CHECK
    /* Without h0, dh0 is the gradient w.r.t. a zero initial state: check it by
     * perturbing an explicit zero h0. */
    if (!d.h0 && d.ns > 0) {
        d.h0 = calloc((size_t)d.ns, sizeof(double));
        fd_grad(&d, d.h0, d.ns, fd, o2, ht2);
        snprintf(nm, sizeof nm, "%s dh0(zero h0) vs FD", fc->name);
        ok &= lm_check_f64(nm, dh0, fd, d.ns, TOL_FD);
    }

    /* Gradients must not be trivially zero (a test that cannot fail is a defect). */
    double sq = 0;
    for (int64_t i = 0; i < d.nq; i++)
        sq += dq[i] * dq[i] + dk[i] * dk[i];
    assert_true(sq > 1e-6);

    /* Empty sequences: ht = h0 and dh0 = dht exactly. */
    if (fc->cu) {
        const int64_t KV = (int64_t)fc->K * fc->V;
        for (int n = 0; n + 1 < fc->ncu; n++) {
            if (fc->cu[n + 1] != fc->cu[n])
                continue;
            for (int64_t i = 0; i < (int64_t)fc->HV * KV; i++) {
                int64_t j = (int64_t)n * fc->HV * KV + i;
                assert_true(ht[j] == (d.h0 ? d.h0[j] : 0.0));
                assert_true(dh0[j] == (d.dht ? d.dht[j] : 0.0));
            }
        }
    }

    free(fd);
    free(o);
    free(ht);
    free(o2);
    free(ht2);
    free(dq);
    free(dk);
    free(dv);
    free(dg);
    free(db);
    free(dh0);
    free(dA);
    free(dbias);
    fd_free(&d);
    assert_true(ok);
}

static const int64_t CU_A[] = {0, 0, 1, 5, 5, 9};      /* empty, 1, 4, empty, 4 */
static const int64_t CU_B[] = {0, 3, 3, 4, 8, 8};      /* 3, empty, 1, 4, empty */
static const int64_t CU_LONG[] = {0, 70, 70, 71, 140}; /* crosses the 64-token checkpoint */

#define KDA LM_KDA
#define GDN LM_GDN
#define GN LM_GATE_NONE
#define GS LM_GATE_SOFTPLUS
#define GBD LM_GATE_BOUNDED

/* clang-format off */
static fd_case FD_CASES[] = {
    /* name                 kind gate A bias l2 sig B  T  H HV K V  cu ncu h0 dht lb   scale mask seed */
    {"kda none",             KDA, GN,  0, 0, 0, 0, 2, 6, 1, 2, 3, 2, NULL, 0, 1, 1, 0, 0.6f, 0.15, 1},
    {"kda none l2 sig gva",  KDA, GN,  0, 0, 1, 1, 1, 7, 2, 4, 4, 3, NULL, 0, 1, 1, 0, 0.5f, 0.1, 2},
    {"kda none no h0/dht",   KDA, GN,  0, 0, 1, 0, 1, 5, 1, 1, 5, 4, NULL, 0, 0, 0, 0, 1.0f, 0.0, 3},
    {"kda softplus A bias",  KDA, GS,  1, 1, 1, 1, 2, 6, 1, 2, 3, 2, NULL, 0, 1, 1, 0, 0.6f, 0, 4},
    {"kda softplus plain",   KDA, GS,  0, 0, 0, 0, 1, 8, 2, 2, 4, 3, NULL, 0, 1, 1, 0, 0.5f, 0, 5},
    {"kda softplus A",       KDA, GS,  1, 0, 1, 0, 1, 6, 1, 3, 3, 4, NULL, 0, 1, 1, 0, 0.1f, 0, 6},
    {"kda softplus bias",    KDA, GS,  0, 1, 0, 1, 1, 6, 2, 4, 3, 2, NULL, 0, 1, 0, 0, 0.7f, 0, 7},
    {"kda bounded A bias",   KDA, GBD, 1, 1, 1, 1, 2, 7, 1, 2, 4, 3, NULL, 0, 1, 1, -5, 0.5f, 0, 8},
    {"kda bounded bias",     KDA, GBD, 0, 1, 0, 0, 1, 9, 1, 1, 3, 2, NULL, 0, 1, 1, -2, 1.0f, 0, 9},
    {"kda bounded plain gva",KDA, GBD, 0, 0, 1, 0, 1, 5, 1, 4, 5, 2, NULL, 0, 1, 1, -1, 0.4f, 0, 10},
    {"kda bounded A",        KDA, GBD, 1, 0, 0, 1, 1, 6, 2, 2, 3, 3, NULL, 0, 0, 1, -5, 0.6f, 0, 11},
    {"kda varlen softplus",  KDA, GS,  1, 1, 1, 1, 1, 9, 1, 2, 3, 2, CU_A, 6, 1, 1, 0, 0.6f, 0, 12},
    {"kda varlen bounded",   KDA, GBD, 1, 1, 0, 1, 1, 8, 2, 4, 4, 2, CU_B, 6, 1, 1, -3, 0.5f, 0, 13},
    {"kda varlen none long", KDA, GN,  0, 0, 1, 0, 1, 140, 1, 1, 2, 2, CU_LONG, 5, 1, 1, 0, 0.7f, 0.05, 14},
    {"kda none long",        KDA, GN,  0, 0, 1, 1, 1, 130, 1, 1, 2, 2, NULL, 0, 1, 1, 0, 0.7f, 0.0, 15},
    {"gdn none",             GDN, GN,  0, 0, 0, 0, 2, 6, 1, 2, 3, 2, NULL, 0, 1, 1, 0, 0.6f, 0.15, 21},
    {"gdn none l2 sig gva",  GDN, GN,  0, 0, 1, 1, 1, 7, 2, 4, 4, 3, NULL, 0, 1, 1, 0, 0.5f, 0.1, 22},
    {"gdn softplus A bias",  GDN, GS,  1, 1, 1, 1, 2, 6, 1, 2, 3, 2, NULL, 0, 1, 1, 0, 0.6f, 0, 23},
    {"gdn softplus plain",   GDN, GS,  0, 0, 0, 0, 1, 8, 2, 2, 4, 3, NULL, 0, 0, 1, 0, 0.5f, 0, 24},
    {"gdn softplus bias",    GDN, GS,  0, 1, 1, 0, 1, 6, 1, 2, 3, 4, NULL, 0, 1, 0, 0, 1.0f, 0, 25},
    {"gdn bounded A bias",   GDN, GBD, 1, 1, 1, 1, 2, 7, 1, 2, 4, 3, NULL, 0, 1, 1, -5, 0.5f, 0, 26},
    {"gdn bounded A",        GDN, GBD, 1, 0, 0, 0, 1, 6, 1, 3, 3, 2, NULL, 0, 1, 1, -2, 0.8f, 0, 27},
    {"gdn bounded plain",    GDN, GBD, 0, 0, 1, 1, 1, 5, 2, 2, 3, 2, NULL, 0, 1, 1, -4, 0.5f, 0, 28},
    {"gdn varlen softplus",  GDN, GS,  1, 1, 1, 1, 1, 9, 1, 2, 3, 2, CU_A, 6, 1, 1, 0, 0.6f, 0, 29},
    {"gdn varlen bounded",   GDN, GBD, 0, 1, 1, 0, 1, 8, 2, 4, 4, 2, CU_B, 6, 1, 1, -5, 0.5f, 0, 30},
    {"gdn varlen none long", GDN, GN,  0, 0, 0, 1, 1, 140, 1, 2, 2, 2, CU_LONG, 5, 1, 1, 0, 0.7f, 0.05, 31},
};
/* clang-format on */

/* ------------------------------------------------------------------ closed form */

/* reference/kda.md §2.1 on a single chunk of C tokens (one head, no l2norm, no
 * in-op sigmoid, log-decay given), written naively: G = cumsum g; Akk, Aqk with an
 * explicit exp(G_r - G_i) per pair; Tm = (I + Akk)^{-1} by forward substitution;
 * W, U, Vn = U - W S0; O = s (Q . e^G) S0 + Aqk Vn; S' = e^{G_last} S0 + (K . e^{G_last - G})^T Vn.
 * gk = K for KDA, 1 for GDN (broadcast over channels). */
static void closed_form_chunk(int C, int K, int V, int gk, double s, const double *q,
                              const double *k, const double *v, const double *g, const double *beta,
                              const double *S0, double *O, double *S1) {
    double *G = calloc((size_t)C * K, sizeof(double));
    double *Akk = calloc((size_t)C * C, sizeof(double)),
           *Aqk = calloc((size_t)C * C, sizeof(double));
    double *Tm = calloc((size_t)C * C, sizeof(double));
    double *W = calloc((size_t)C * K, sizeof(double)), *U = calloc((size_t)C * V, sizeof(double));
    double *Vn = calloc((size_t)C * V, sizeof(double));
    for (int d = 0; d < K; d++) {
        double acc = 0;
        for (int r = 0; r < C; r++) {
            acc += g[r * gk + (gk == 1 ? 0 : d)];
            G[r * K + d] = acc;
        }
    }
    for (int r = 0; r < C; r++)
        for (int i = 0; i <= r; i++) {
            double akk = 0, aqk = 0;
            for (int d = 0; d < K; d++) {
                double e = exp(G[r * K + d] - G[i * K + d]);
                akk += k[r * K + d] * k[i * K + d] * e;
                aqk += q[r * K + d] * k[i * K + d] * e;
            }
            if (i < r)
                Akk[r * C + i] = beta[r] * akk;
            Aqk[r * C + i] = s * aqk;
        }
    /* (I + A) T = I, A strictly lower: row r of T = e_r - sum_{i<r} A[r,i] T[i,:] */
    for (int r = 0; r < C; r++) {
        for (int j = 0; j < C; j++) {
            double acc = r == j ? 1.0 : 0.0;
            for (int i = 0; i < r; i++)
                acc -= Akk[r * C + i] * Tm[i * C + j];
            Tm[r * C + j] = acc;
        }
    }
    for (int r = 0; r < C; r++) {
        for (int d = 0; d < K; d++) {
            double acc = 0;
            for (int i = 0; i < C; i++)
                acc += Tm[r * C + i] * beta[i] * k[i * K + d] * exp(G[i * K + d]);
            W[r * K + d] = acc;
        }
        for (int j = 0; j < V; j++) {
            double acc = 0;
            for (int i = 0; i < C; i++)
                acc += Tm[r * C + i] * beta[i] * v[i * V + j];
            U[r * V + j] = acc;
        }
    }
    for (int r = 0; r < C; r++)
        for (int j = 0; j < V; j++) {
            double acc = U[r * V + j];
            for (int d = 0; d < K; d++)
                acc -= W[r * K + d] * S0[d * V + j];
            Vn[r * V + j] = acc;
        }
    for (int r = 0; r < C; r++)
        for (int j = 0; j < V; j++) {
            double acc = 0;
            for (int d = 0; d < K; d++)
                acc += s * q[r * K + d] * exp(G[r * K + d]) * S0[d * V + j];
            for (int i = 0; i <= r; i++)
                acc += Aqk[r * C + i] * Vn[i * V + j];
            O[r * V + j] = acc;
        }
    for (int d = 0; d < K; d++)
        for (int j = 0; j < V; j++) {
            double Gl = G[(C - 1) * K + d];
            double acc = exp(Gl) * S0[d * V + j];
            for (int i = 0; i < C; i++)
                acc += k[i * K + d] * exp(Gl - G[i * K + d]) * Vn[i * V + j];
            S1[d * V + j] = acc;
        }
    free(G);
    free(Akk);
    free(Aqk);
    free(Tm);
    free(W);
    free(U);
    free(Vn);
}

static void test_closed_form(void **state) {
    (void)state;
    for (int kind = 0; kind < 2; kind++) {
        const int C = 16, K = 5, V = 3;
        const int gk = kind == LM_KDA ? K : 1;
        const double s = (double)0.45f; /* the value the float config carries */
        double q[16 * 5], k[16 * 5], v[16 * 3], g[16 * 5], beta[16], S0[5 * 3];
        lm_fill_normal(q, C * K, 101 + kind, 0.0, 1.0);
        lm_fill_normal(k, C * K, 102 + kind, 0.0, 1.0);
        /* fla-style: unit-norm keys */
        for (int r = 0; r < C; r++) {
            double n2 = 0;
            for (int d = 0; d < K; d++)
                n2 += k[r * K + d] * k[r * K + d];
            for (int d = 0; d < K; d++)
                k[r * K + d] /= sqrt(n2);
        }
        lm_fill_normal(v, C * V, 103 + kind, 0.0, 1.0);
        lm_fill_uniform(beta, C, 104 + kind, 0.0, 1.0);
        lm_fill_uniform(g, C * gk, 105 + kind, -2.0, 0.0);
        g[3 * gk] = 0.0;
        g[7 * gk] = -6.0;
        lm_fill_normal(S0, K * V, 106 + kind, 0.0, 1.0);
        double Oc[16 * 3], S1c[5 * 3], Or[16 * 3], S1r[5 * 3];
        lm_kda_config c = {0};
        c.kind = (lm_kda_kind)kind;
        c.B = 1;
        c.T = C;
        c.H = 1;
        c.HV = 1;
        c.K = K;
        c.V = V;
        c.N = 1;
        c.gate = LM_GATE_NONE;
        c.scale = 0.45f;
        closed_form_chunk(C, K, V, gk, s, q, k, v, g, beta, S0, Oc, S1c);
        c.chunk_size = 64;
        kda_ref_io io = {0};
        io.q = q;
        io.k = k;
        io.v = v;
        io.g = g;
        io.beta = beta;
        io.h0 = S0;
        io.o = Or;
        io.ht = S1r;
        kda_ref_run(&c, &io);
        /* Both are fp64 evaluations of the same quantity by different algorithms:
         * they agree to rounding (the inverse's condition number is modest here). */
        assert_true(lm_check_f64(kind == LM_KDA ? "kda closed-form o" : "gdn closed-form o", Or, Oc,
                                 C * V, 1e-12));
        assert_true(lm_check_f64(kind == LM_KDA ? "kda closed-form ht" : "gdn closed-form ht", S1r,
                                 S1c, K * V, 1e-12));
        /* and the compare is not vacuous: a perturbed g changes the closed form */
        g[5 * gk] -= 0.1;
        closed_form_chunk(C, K, V, gk, s, q, k, v, g, beta, S0, Oc, S1c);
        lm_cmp cmp = lm_compare_f64(Or, Oc, C * V, 1e-12);
        assert_false(cmp.pass);
    }
}

int main(void) {
    enum { NC = sizeof FD_CASES / sizeof FD_CASES[0] };
    struct CMUnitTest tests[NC + 1];
    tests[0] = (struct CMUnitTest)cmocka_unit_test(test_closed_form);
    for (int i = 0; i < NC; i++) {
        tests[i + 1] = (struct CMUnitTest)cmocka_unit_test_prestate(run_fd_case, &FD_CASES[i]);
        tests[i + 1].name = FD_CASES[i].name;
    }
    return _cmocka_run_group_tests("kda_ref", tests, NC + 1, NULL, NULL);
}
