/* fp64 reference of the MoE layer with fixed routing: see moe_ref.h. */
#include "moe_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/core.h"

lm_moe_ref_cfg lm_moe_ref_cfg_from(const lm_moe_config *c, int T) {
    lm_moe_ref_cfg r;
    memset(&r, 0, sizeof r);
    r.T = T;
    r.d = c->hidden_size;
    r.f = c->moe_intermediate_size;
    r.fs = c->n_shared_experts * c->moe_intermediate_size;
    r.E = c->router.num_experts;
    r.k = c->router.num_experts_per_tok;
    r.softmax = c->router.scoring_func == LM_SCORE_SOFTMAX;
    r.norm_topk_prob = c->router.norm_topk_prob;
    r.routed_scaling_factor = c->router.routed_scaling_factor;
    r.aux_loss = c->router.balance == LM_BAL_AUX_LOSS;
    r.aux_loss_alpha = c->router.aux_loss_alpha;
    return r;
}

/* y += wt * Wd (silu(Wg x) * (Wu x)) for one token and one SwiGLU of width f:
 * Wg, Wu [f, d], Wd [d, f]. h scratch [f]. */
static void swiglu_add(int d, int f, const double *x, const double *Wg, const double *Wu,
                       const double *Wd, double wt, double *h, double *y) {
    for (int i = 0; i < f; i++) {
        double g = 0.0, u = 0.0;
        for (int c = 0; c < d; c++) {
            g += Wg[(int64_t)i * d + c] * x[c];
            u += Wu[(int64_t)i * d + c] * x[c];
        }
        h[i] = g / (1.0 + exp(-g)) * u;
    }
    for (int c = 0; c < d; c++) {
        double s = 0.0;
        for (int i = 0; i < f; i++)
            s += Wd[(int64_t)c * f + i] * h[i];
        y[c] += wt * s;
    }
}

/* scores s [E] of one token from its input row */
static void token_scores(const lm_moe_ref_cfg *c, const double *Wr, const double *x, double *s) {
    for (int e = 0; e < c->E; e++) {
        double l = 0.0;
        for (int q = 0; q < c->d; q++)
            l += Wr[(int64_t)e * c->d + q] * x[q];
        s[e] = l;
    }
    if (c->softmax) {
        double m = s[0], z = 0.0;
        for (int e = 1; e < c->E; e++)
            m = s[e] > m ? s[e] : m;
        for (int e = 0; e < c->E; e++)
            z += (s[e] = exp(s[e] - m));
        for (int e = 0; e < c->E; e++)
            s[e] /= z;
    } else {
        for (int e = 0; e < c->E; e++)
            s[e] = 1.0 / (1.0 + exp(-s[e]));
    }
}

void lm_moe_ref_forward(const lm_moe_ref_cfg *c, const lm_moe_ref_params *p,
                        const int64_t *topk_idx, const uint8_t *keep, double *out, double *aux) {
    const int d = c->d, f = c->f, fs = c->fs, E = c->E, k = c->k;
    double *s = malloc(sizeof(double) * (size_t)E);
    double *h = malloc(sizeof(double) * (size_t)((f > fs ? f : fs) + 1));
    double *P = calloc((size_t)E, sizeof(double));
    double *cnt = calloc((size_t)E, sizeof(double));
    for (int t = 0; t < c->T; t++) {
        const double *xt = p->x + (int64_t)t * d;
        double *y = out + (int64_t)t * d;
        for (int q = 0; q < d; q++)
            y[q] = 0.0;
        token_scores(c, p->w[LM_MOE_GATE_WEIGHT], xt, s);
        double Z = 0.0, S = 0.0;
        for (int j = 0; j < k; j++)
            Z += s[topk_idx[(int64_t)t * k + j]];
        for (int e = 0; e < E; e++)
            S += s[e];
        for (int e = 0; e < E; e++)
            P[e] += c->softmax ? s[e] : s[e] / (S + 1e-20);
        for (int j = 0; j < k; j++) {
            const int64_t a = (int64_t)t * k + j;
            const int e = (int)topk_idx[a];
            cnt[e] += 1.0;
            if (!keep[a])
                continue;
            double wt = s[e] * c->routed_scaling_factor;
            if (c->norm_topk_prob && k > 1)
                wt /= Z + 1e-20;
            swiglu_add(d, f, xt, p->w[LM_MOE_EXPERTS_GATE_PROJ] + (int64_t)e * f * d,
                       p->w[LM_MOE_EXPERTS_UP_PROJ] + (int64_t)e * f * d,
                       p->w[LM_MOE_EXPERTS_DOWN_PROJ] + (int64_t)e * d * f, wt, h, y);
        }
        if (fs > 0)
            swiglu_add(d, fs, xt, p->w[LM_MOE_SHARED_GATE_PROJ], p->w[LM_MOE_SHARED_UP_PROJ],
                       p->w[LM_MOE_SHARED_DOWN_PROJ], 1.0, h, y);
    }
    if (aux) {
        /* alpha * sum_i f_i P_i, f_i = E/(k T) count_i, P_i = mean_t s'_ti */
        double a = 0.0;
        if (c->aux_loss)
            for (int e = 0; e < E; e++)
                a += (double)E / ((double)k * c->T) * cnt[e] * (P[e] / c->T);
        *aux = c->aux_loss_alpha * a;
    }
    free(s);
    free(h);
    free(P);
    free(cnt);
}

double lm_moe_ref_loss(const lm_moe_ref_cfg *c, const lm_moe_ref_params *p, const int64_t *topk_idx,
                       const uint8_t *keep, const double *dout) {
    const int64_t n = (int64_t)c->T * c->d;
    double *out = malloc(sizeof(double) * (size_t)n);
    double aux = 0.0;
    lm_moe_ref_forward(c, p, topk_idx, keep, out, &aux);
    double L = 0.0;
    for (int64_t i = 0; i < n; i++)
        L += out[i] * dout[i];
    free(out);
    return L + aux;
}
