/* fp64 token-by-token reference for KDA / GDN and its exact backward (see kda_ref.h).
 *
 * Forward, per (sequence n, value head hv), q/k head h = hv / (HV/H)
 * (reference/kda.md §1.2, §1.3):
 *   qn_t = l2norm?(q_t), kn_t = l2norm?(k_t)      l2norm(x) = x / r, r = sqrt(sum x^2 + 1e-6)
 *   qs_t = scale * qn_t
 *   b_t  = sigmoid?(beta_t)
 *   g_t  = gate(x_t)                               (vector [K] for KDA, scalar for GDN)
 *   Sd_t = D_t S_{t-1},  D_t = Diag(exp g_t)       (decay first)
 *   p_t  = Sd_t^T kn_t,  r_t = v_t - p_t,  u_t = b_t r_t
 *   S_t  = Sd_t + kn_t u_t^T
 *   o_t  = S_t^T qs_t
 *
 * Backward of L = sum_t <o_t, do_t> + <S_T, dht> (back-propagation through time).
 * Let dS denote dL/dS_t, accumulated from the future (dS = dht at t = T). Going
 * backwards through one token, with every intermediate of that token available:
 *   dS     += qs_t do_t^T                     (o_t = S_t^T qs_t)
 *   dqs_t   = S_t do_t
 *   du_t    = dS^T kn_t                        (S_t = Sd_t + kn_t u_t^T)
 *   dkn_t   = dS u_t
 *   dSd     = dS                               (identity branch of S_t)
 *   dv_t    = b_t du_t,  db_t = <r_t, du_t>    (u_t = b_t (v_t - p_t))
 *   dp_t    = -b_t du_t
 *   dSd    += kn_t dp_t^T,  dkn_t += Sd_t dp_t (p_t = Sd_t^T kn_t)
 *   dg_t[d] = sum_v dSd[d,v] Sd_t[d,v]         (Sd = Diag(e^g) S_{t-1}: d/dg_d of
 *                                               e^{g_d} S[d,v] is Sd[d,v]; GDN sums over d too)
 *   dS      = D_t dSd                          (gradient w.r.t. S_{t-1})
 * After the first token of the sequence dS is dL/dh0. The dg formula uses Sd_t itself,
 * so the decay is never inverted (g may be -1000, e^g = 0 exactly).
 * S_t is not stored for all t: the state before every 64th token is checkpointed in
 * the forward pass; the backward re-runs each 64-token segment forward from its
 * checkpoint (storing Sd_t, u_t, r_t) and then walks it backwards.
 *
 * Chain rule to the inputs as given:
 *   qs = scale*qn:        dqn = scale * dqs
 *   l2norm (x -> x/r):    dx = (dxn - xn <xn, dxn>) / r
 *   GVA: dq, dk of head h are sums over the HV/H value heads of its group.
 *   beta sigmoid:         dbeta = db * s (1 - s),  s = sigmoid(beta)   (1 - s as sigmoid(-beta))
 *   gate NONE:            dx = dg
 *   gate SOFTPLUS:        z = x + dt_bias, a = exp(A_log), g = -a sp(z)
 *                         dx = dg * (-a sp'(z)),  sp'(z) = 1 for z > 20 else sigmoid(z)
 *                         (the derivative of the thresholded softplus that is evaluated)
 *                         ddt_bias += dx,  dA_log += dg * g          (dg/dA_log = g)
 *   gate BOUNDED:         z = a (x + dt_bias), s = sigmoid(z), g = lb s
 *                         dz = dg * lb s (1 - s); dx = a dz; ddt_bias += a dz; dA_log += z dz
 *                         (1 - s as sigmoid(-z): the difference loses digits as s -> 1)
 * dA_log [HV] and ddt_bias sum over all tokens (and channels for dA_log).
 * A zero-length sequence gives ht = h0 and dh0 = dht.
 */
#include "kda_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define REF_CKPT 64
#define REF_L2_EPS 1e-6

static void *ref_calloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    LM_CHECK(p != NULL);
    return p;
}

static double ref_sigmoid(double x) {
    if (x >= 0)
        return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}

static double ref_softplus(double z) { return z > 20.0 ? z : log1p(exp(z)); }

/* Per-token preprocessed values of one (sequence, value head). */
typedef struct {
    int L, K, V, GK; /* GK = K (KDA) or 1 (GDN): channels of the gate */
    double *qn, *kn; /* [L,K] normalised (or raw) q, k, before scale */
    double *rq, *rk; /* [L]   norms (1 when l2norm is off) */
    double *b;       /* [L]   activated beta */
    double *g;       /* [L,GK] log-decay */
    double *eg;      /* [L,GK] exp(g) */
} ref_seq;

/* Gate value for raw input x of channel index `ci` (into dt_bias) of head hv. */
static double ref_gate(const lm_kda_config *c, const kda_ref_io *io, int hv, int64_t ci, double x) {
    double a = io->A_log ? exp(io->A_log[hv]) : 1.0;
    double bias = io->dt_bias ? io->dt_bias[ci] : 0.0;
    switch (c->gate) {
    case LM_GATE_NONE:
        return x;
    case LM_GATE_SOFTPLUS:
        return -a * ref_softplus(x + bias);
    case LM_GATE_BOUNDED:
        return (double)c->lower_bound * ref_sigmoid(a * (x + bias));
    }
    LM_CHECK(0);
    return 0;
}

/* Backward of the gate for one element: returns dx; adds to *dA and *dbias. */
static double ref_gate_bwd(const lm_kda_config *c, const kda_ref_io *io, int hv, int64_t ci,
                           double x, double dg, double *dA, double *dbias) {
    double a = io->A_log ? exp(io->A_log[hv]) : 1.0;
    double bias = io->dt_bias ? io->dt_bias[ci] : 0.0;
    double dx = 0;
    switch (c->gate) {
    case LM_GATE_NONE:
        return dg;
    case LM_GATE_SOFTPLUS: {
        double z = x + bias;
        double sp = ref_softplus(z);
        double dsp = z > 20.0 ? 1.0 : ref_sigmoid(z);
        dx = dg * (-a * dsp);
        *dbias += dx;
        *dA += dg * (-a * sp);
        return dx;
    }
    case LM_GATE_BOUNDED: {
        double z = a * (x + bias);
        double s = ref_sigmoid(z);
        double dz = dg * (double)c->lower_bound * s * ref_sigmoid(-z); /* 1 - s, stably */
        dx = a * dz;
        *dbias += dx;
        *dA += z * dz;
        return dx;
    }
    }
    LM_CHECK(0);
    return 0;
}

typedef struct {
    int b;       /* batch index */
    int64_t bos; /* first token (within batch row b) */
    int L;       /* length */
} ref_span;

static ref_span ref_span_of(const lm_kda_config *c, int n) {
    ref_span s;
    if (c->cu_seqlens) {
        s.b = 0;
        s.bos = c->cu_seqlens[n];
        s.L = (int)(c->cu_seqlens[n + 1] - c->cu_seqlens[n]);
    } else {
        s.b = n;
        s.bos = 0;
        s.L = c->T;
    }
    return s;
}

static void ref_prep(const lm_kda_config *c, const kda_ref_io *io, ref_span sp, int hv,
                     ref_seq *s) {
    const int K = c->K, H = c->H, HV = c->HV;
    const int h = hv / (HV / H);
    const int GK = c->kind == LM_KDA ? K : 1;
    for (int t = 0; t < sp.L; t++) {
        int64_t bt = (int64_t)sp.b * c->T + sp.bos + t;
        const double *qx = io->q + (bt * H + h) * K;
        const double *kx = io->k + (bt * H + h) * K;
        double rq = 1, rk = 1;
        if (c->use_qk_l2norm_in_kernel) {
            double sq = 0, sk = 0;
            for (int d = 0; d < K; d++) {
                sq += qx[d] * qx[d];
                sk += kx[d] * kx[d];
            }
            rq = sqrt(sq + REF_L2_EPS);
            rk = sqrt(sk + REF_L2_EPS);
        }
        s->rq[t] = rq;
        s->rk[t] = rk;
        for (int d = 0; d < K; d++) {
            s->qn[(int64_t)t * K + d] = qx[d] / rq;
            s->kn[(int64_t)t * K + d] = kx[d] / rk;
        }
        double braw = io->beta[bt * HV + hv];
        s->b[t] = c->use_beta_sigmoid_in_kernel ? ref_sigmoid(braw) : braw;
        for (int d = 0; d < GK; d++) {
            double x = io->g[(bt * HV + hv) * GK + d];
            double gv = ref_gate(c, io, hv, (int64_t)hv * GK + d, x);
            s->g[(int64_t)t * GK + d] = gv;
            s->eg[(int64_t)t * GK + d] = exp(gv);
        }
    }
}

/* One forward step on S (in place). Optionally records Sd (state after decay),
 * u and r = v - Sd^T k. Writes o (V) when non-NULL. */
static void ref_step(const ref_seq *s, int t, double scale, const double *v, double *S,
                     double *Sd_out, double *u_out, double *r_out, double *o, double *tmp_u) {
    const int K = s->K, V = s->V, GK = s->GK;
    const double *kn = s->kn + (int64_t)t * K;
    const double *qn = s->qn + (int64_t)t * K;
    const double *eg = s->eg + (int64_t)t * GK;
    for (int d = 0; d < K; d++) {
        double e = eg[GK == 1 ? 0 : d];
        for (int j = 0; j < V; j++)
            S[(int64_t)d * V + j] *= e;
    }
    if (Sd_out)
        memcpy(Sd_out, S, sizeof(double) * K * V);
    double *u = u_out ? u_out : tmp_u;
    for (int j = 0; j < V; j++) {
        double p = 0;
        for (int d = 0; d < K; d++)
            p += S[(int64_t)d * V + j] * kn[d];
        double r = v[j] - p;
        if (r_out)
            r_out[j] = r;
        u[j] = s->b[t] * r;
    }
    for (int d = 0; d < K; d++)
        for (int j = 0; j < V; j++)
            S[(int64_t)d * V + j] += kn[d] * u[j];
    if (o) {
        for (int j = 0; j < V; j++) {
            double acc = 0;
            for (int d = 0; d < K; d++)
                acc += S[(int64_t)d * V + j] * qn[d];
            o[j] = scale * acc;
        }
    }
}

/* Work of one (sequence n, q/k head h): every value head of the group. dA / dbias
 * are this task's private accumulators ([HV] and [HV*GK]). */
static void ref_task(const lm_kda_config *c, const kda_ref_io *io, int n, int h, double *dA,
                     double *dbias) {
    const int K = c->K, V = c->V, H = c->H, HV = c->HV;
    const int G = HV / H;
    const int GK = c->kind == LM_KDA ? K : 1;
    const int64_t KV = (int64_t)K * V;
    const double scale = c->scale;
    ref_span sp = ref_span_of(c, n);
    const int L = sp.L;
    const int bwd = io->do_ != NULL;

    ref_seq s = {.L = L, .K = K, .V = V, .GK = GK};
    s.qn = ref_calloc((size_t)L * K, sizeof(double));
    s.kn = ref_calloc((size_t)L * K, sizeof(double));
    s.rq = ref_calloc((size_t)L, sizeof(double));
    s.rk = ref_calloc((size_t)L, sizeof(double));
    s.b = ref_calloc((size_t)L, sizeof(double));
    s.g = ref_calloc((size_t)L * GK, sizeof(double));
    s.eg = ref_calloc((size_t)L * GK, sizeof(double));
    int ncp = (L + REF_CKPT - 1) / REF_CKPT;
    double *S = ref_calloc((size_t)KV, sizeof(double));
    double *ckpt = ref_calloc((size_t)(ncp ? ncp : 1) * KV, sizeof(double));
    double *tmp_u = ref_calloc((size_t)V, sizeof(double));
    /* backward scratch */
    double *segSd = NULL, *segU = NULL, *segR = NULL, *dS = NULL, *dqs = NULL, *dkn = NULL,
           *du = NULL, *dgv = NULL, *dqn_acc = NULL, *dkn_acc = NULL;
    if (bwd) {
        segSd = ref_calloc((size_t)REF_CKPT * KV, sizeof(double));
        segU = ref_calloc((size_t)REF_CKPT * V, sizeof(double));
        segR = ref_calloc((size_t)REF_CKPT * V, sizeof(double));
        dS = ref_calloc((size_t)KV, sizeof(double));
        dqs = ref_calloc((size_t)K, sizeof(double));
        dkn = ref_calloc((size_t)K, sizeof(double));
        du = ref_calloc((size_t)V, sizeof(double));
        dgv = ref_calloc((size_t)K, sizeof(double));
        /* dL/dqn, dL/dkn summed over the group (the l2norm backward is linear in them) */
        dqn_acc = ref_calloc((size_t)L * K, sizeof(double));
        dkn_acc = ref_calloc((size_t)L * K, sizeof(double));
    }

    for (int hv = h * G; hv < (h + 1) * G; hv++) {
        ref_prep(c, io, sp, hv, &s);
        const int64_t sidx = ((int64_t)n * HV + hv) * KV;
        if (io->h0)
            memcpy(S, io->h0 + sidx, sizeof(double) * KV);
        else
            memset(S, 0, sizeof(double) * KV);
        /* forward */
        for (int t = 0; t < L; t++) {
            if (t % REF_CKPT == 0)
                memcpy(ckpt + (int64_t)(t / REF_CKPT) * KV, S, sizeof(double) * KV);
            int64_t bt = (int64_t)sp.b * c->T + sp.bos + t;
            const double *v = io->v + (bt * HV + hv) * V;
            double *o = io->o ? io->o + (bt * HV + hv) * V : NULL;
            ref_step(&s, t, scale, v, S, NULL, NULL, NULL, o, tmp_u);
        }
        if (io->ht)
            memcpy(io->ht + sidx, S, sizeof(double) * KV);
        if (!bwd)
            continue;

        /* backward */
        if (io->dht)
            memcpy(dS, io->dht + sidx, sizeof(double) * KV);
        else
            memset(dS, 0, sizeof(double) * KV);
        for (int seg = ncp - 1; seg >= 0; seg--) {
            int t0 = seg * REF_CKPT;
            int t1 = t0 + REF_CKPT < L ? t0 + REF_CKPT : L;
            memcpy(S, ckpt + (int64_t)seg * KV, sizeof(double) * KV);
            for (int t = t0; t < t1; t++) {
                int64_t bt = (int64_t)sp.b * c->T + sp.bos + t;
                const double *v = io->v + (bt * HV + hv) * V;
                ref_step(&s, t, scale, v, S, segSd + (int64_t)(t - t0) * KV,
                         segU + (int64_t)(t - t0) * V, segR + (int64_t)(t - t0) * V, NULL, tmp_u);
            }
            for (int t = t1 - 1; t >= t0; t--) {
                int64_t bt = (int64_t)sp.b * c->T + sp.bos + t;
                const double *Sd = segSd + (int64_t)(t - t0) * KV;
                const double *u = segU + (int64_t)(t - t0) * V;
                const double *r = segR + (int64_t)(t - t0) * V;
                const double *kn = s.kn + (int64_t)t * K;
                const double *qn = s.qn + (int64_t)t * K;
                const double *dO = io->do_ + (bt * HV + hv) * V;
                const double bt_ = s.b[t];
                /* dS += qs do^T; dqs = S_t do with S_t = Sd + kn u^T */
                double udo = 0;
                for (int j = 0; j < V; j++)
                    udo += u[j] * dO[j];
                for (int d = 0; d < K; d++) {
                    double qs = scale * qn[d];
                    double acc = 0;
                    for (int j = 0; j < V; j++) {
                        dS[(int64_t)d * V + j] += qs * dO[j];
                        acc += Sd[(int64_t)d * V + j] * dO[j];
                    }
                    dqs[d] = acc + kn[d] * udo;
                }
                /* du = dS^T kn; dkn = dS u */
                for (int j = 0; j < V; j++)
                    du[j] = 0;
                for (int d = 0; d < K; d++) {
                    double acc = 0;
                    for (int j = 0; j < V; j++) {
                        du[j] += dS[(int64_t)d * V + j] * kn[d];
                        acc += dS[(int64_t)d * V + j] * u[j];
                    }
                    dkn[d] = acc;
                }
                /* dv, dbeta (activated), dp = -b du */
                double db = 0;
                for (int j = 0; j < V; j++)
                    db += r[j] * du[j];
                if (io->dv) {
                    double *dv = io->dv + (bt * HV + hv) * V;
                    for (int j = 0; j < V; j++)
                        dv[j] = bt_ * du[j];
                }
                if (io->dbeta) {
                    double braw = io->beta[bt * HV + hv];
                    double f = 1.0;
                    if (c->use_beta_sigmoid_in_kernel) {
                        double sg = ref_sigmoid(braw);
                        f = sg * ref_sigmoid(-braw); /* 1 - sg, stably */
                    }
                    io->dbeta[bt * HV + hv] = db * f;
                }
                /* dSd = dS + kn dp^T; dkn += Sd dp; dg = sum_v dSd .* Sd; dS = D dSd */
                for (int d = 0; d < GK; d++)
                    dgv[d] = 0;
                for (int d = 0; d < K; d++) {
                    double acc = 0, gacc = 0;
                    for (int j = 0; j < V; j++) {
                        double dp = -bt_ * du[j];
                        acc += Sd[(int64_t)d * V + j] * dp;
                        double dsd = dS[(int64_t)d * V + j] + kn[d] * dp;
                        gacc += dsd * Sd[(int64_t)d * V + j];
                        dS[(int64_t)d * V + j] = dsd;
                    }
                    dkn[d] += acc;
                    dgv[GK == 1 ? 0 : d] += gacc;
                    double e = s.eg[(int64_t)t * GK + (GK == 1 ? 0 : d)];
                    for (int j = 0; j < V; j++)
                        dS[(int64_t)d * V + j] *= e;
                }
                /* gate backward to the raw input */
                for (int d = 0; d < GK; d++) {
                    int64_t gi = (bt * HV + hv) * GK + d;
                    double dA_local = 0, dbias_local = 0;
                    double dx = ref_gate_bwd(c, io, hv, (int64_t)hv * GK + d, io->g[gi], dgv[d],
                                             &dA_local, &dbias_local);
                    if (io->dg)
                        io->dg[gi] = dx;
                    dA[hv] += dA_local;
                    dbias[(int64_t)hv * GK + d] += dbias_local;
                }
                for (int d = 0; d < K; d++) {
                    dqn_acc[(int64_t)t * K + d] += scale * dqs[d];
                    dkn_acc[(int64_t)t * K + d] += dkn[d];
                }
            }
        }
        if (io->dh0)
            memcpy(io->dh0 + sidx, dS, sizeof(double) * KV);
    }

    /* l2norm backward and the write of dq, dk (this task owns head h of sequence n) */
    if (bwd) {
        for (int t = 0; t < L; t++) {
            int64_t bt = (int64_t)sp.b * c->T + sp.bos + t;
            for (int which = 0; which < 2; which++) {
                double *dst = which == 0 ? io->dq : io->dk;
                if (!dst)
                    continue;
                dst += (bt * H + h) * K;
                const double *xn = (which == 0 ? s.qn : s.kn) + (int64_t)t * K;
                const double *dxn = (which == 0 ? dqn_acc : dkn_acc) + (int64_t)t * K;
                if (c->use_qk_l2norm_in_kernel) {
                    double r = which == 0 ? s.rq[t] : s.rk[t];
                    double dot = 0;
                    for (int d = 0; d < K; d++)
                        dot += xn[d] * dxn[d];
                    for (int d = 0; d < K; d++)
                        dst[d] = (dxn[d] - xn[d] * dot) / r;
                } else {
                    for (int d = 0; d < K; d++)
                        dst[d] = dxn[d];
                }
            }
        }
    }

    free(s.qn);
    free(s.kn);
    free(s.rq);
    free(s.rk);
    free(s.b);
    free(s.g);
    free(s.eg);
    free(S);
    free(ckpt);
    free(tmp_u);
    free(segSd);
    free(segU);
    free(segR);
    free(dS);
    free(dqs);
    free(dkn);
    free(du);
    free(dgv);
    free(dqn_acc);
    free(dkn_acc);
}

void kda_ref_run(const lm_kda_config *c, const kda_ref_io *io) {
    const int N = c->N, H = c->H, HV = c->HV, K = c->K;
    LM_CHECK(N >= 0 && H > 0 && HV % H == 0 && c->K > 0 && c->V > 0);
    LM_CHECK(!c->cu_seqlens || (c->B == 1 && c->n_cu_seqlens == N + 1));
    LM_CHECK(c->cu_seqlens || N == c->B);
    const int GK = c->kind == LM_KDA ? K : 1;
    const int64_t BT = (int64_t)c->B * c->T;
    const int bwd = io->do_ != NULL;

    /* Every token belongs to a sequence, but zero all gradient outputs first so that
     * nothing is left undefined (and dq/dk of a head group are written once). */
    if (bwd) {
        if (io->dq)
            memset(io->dq, 0, sizeof(double) * BT * H * K);
        if (io->dk)
            memset(io->dk, 0, sizeof(double) * BT * H * K);
        if (io->dv)
            memset(io->dv, 0, sizeof(double) * BT * HV * c->V);
        if (io->dg)
            memset(io->dg, 0, sizeof(double) * BT * HV * GK);
        if (io->dbeta)
            memset(io->dbeta, 0, sizeof(double) * BT * HV);
    }
    if (io->o)
        memset(io->o, 0, sizeof(double) * BT * HV * c->V);

    const int ntask = N * H;
    double *dA = ref_calloc((size_t)(ntask ? ntask : 1) * HV, sizeof(double));
    double *dbias = ref_calloc((size_t)(ntask ? ntask : 1) * HV * GK, sizeof(double));
#pragma omp parallel for schedule(dynamic, 1)
    for (int task = 0; task < ntask; task++)
        ref_task(c, io, task / H, task % H, dA + (int64_t)task * HV,
                 dbias + (int64_t)task * HV * GK);

    /* deterministic reduction of the per-task parameter gradients */
    if (bwd && io->dA_log) {
        for (int hv = 0; hv < HV; hv++) {
            double acc = 0;
            for (int task = 0; task < ntask; task++)
                acc += dA[(int64_t)task * HV + hv];
            io->dA_log[hv] = io->A_log ? acc : 0.0;
        }
    }
    if (bwd && io->ddt_bias) {
        for (int64_t i = 0; i < (int64_t)HV * GK; i++) {
            double acc = 0;
            for (int task = 0; task < ntask; task++)
                acc += dbias[(int64_t)task * HV * GK + i];
            io->ddt_bias[i] = acc;
        }
    }
    free(dA);
    free(dbias);
}
