/* The once-per-optimizer-step part of expert balancing (include/linmoe/moe_router.h):
 * reduce the step's accumulators over ranks, update e_score_correction_bias
 * (auxiliary-loss-free sign / linear rule, or the averaged quantile solution with
 * EMA), centre, clamp, compute the metrics and reset the accumulators.
 *
 * Math: reference/moe.md §1.1 (Algorithm 1: b += u * sign(mean - c)), §1.3 / §4.3
 * (linear rule), §4.5 (Megatron's QB finalisation: mean of the micro-batch
 * solutions, EMA, mean-centring), §3.2 (torchtitan's centring), §8.2 (metrics).
 */
#include "linmoe/moe_router.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Layout of the buffer handed to the reduce callback. Every entry is a sum over
 * ranks, so a plain element-wise all-reduce(SUM) of n doubles is all it needs. */
enum { RED_TOKENS, RED_DROP_A, RED_DROP_T, RED_AUX, RED_NMICRO, RED_QBCOUNT, RED_SCALARS };
/* it lives in the state (lm_router_state.reduce_buf): 3E + RED_SCALARS + E doubles */
_Static_assert(RED_SCALARS <= 16, "LM_ROUTER_REDUCE_BUF_LEN holds 16 scalars");

lm_status lm_router_update_bias(const lm_router_config *c, lm_router_state *st,
                                lm_allreduce_fn reduce, void *reduce_ctx, lm_router_metrics *m,
                                lm_error *err) {
    LM_TRY(lm_router_config_validate(c, err));
    if (!st || !st->e_score_correction_bias || !st->reduce_buf)
        return lm_errorf(err, LM_ERR_INVALID, "router: update_bias needs an initialised state");
    const int E = c->num_experts;
    if (st->E != E)
        return lm_errorf(err, LM_ERR_INVALID, "router: state has %d experts but num_experts = %d",
                         st->E, E);

    /* pack: demand[E] kept[E] qb_accum[E] scalars[RED_SCALARS] | b_old[E] (not reduced) */
    const int n = 3 * E + RED_SCALARS;
    double *buf = st->reduce_buf; /* LM_ROUTER_REDUCE_BUF_LEN(E) >= n + E doubles */
    double *dem = buf, *kept = buf + E, *qacc = buf + 2 * E, *sc = buf + 3 * E;
    double *b_old = buf + n;
    memcpy(dem, st->demand, sizeof(double) * (size_t)E);
    memcpy(kept, st->kept, sizeof(double) * (size_t)E);
    memcpy(qacc, st->qb_accum, sizeof(double) * (size_t)E);
    sc[RED_TOKENS] = (double)st->tokens;
    sc[RED_DROP_A] = (double)st->dropped_assign;
    sc[RED_DROP_T] = (double)st->dropped_tokens;
    sc[RED_AUX] = st->aux_loss_sum;
    sc[RED_NMICRO] = (double)st->n_micro;
    sc[RED_QBCOUNT] = (double)st->qb_count;
    if (reduce)
        reduce(buf, n, reduce_ctx);

    float *b = st->e_score_correction_bias;
    for (int e = 0; e < E; e++)
        b_old[e] = b[e];
    double total = 0.0;
    for (int e = 0; e < E; e++)
        total += dem[e];
    const double mean = total / E;
    const int observed = sc[RED_TOKENS] > 0.0 && total > 0.0;
    const int moves = c->balance == LM_BAL_AUX_FREE || c->balance == LM_BAL_QUANTILE;

    if (observed && moves) {
        if (c->balance == LM_BAL_AUX_FREE) {
            const double u = c->bias_update_rate;
            for (int e = 0; e < E; e++) {
                const double gap = mean - dem[e]; /* > 0: underloaded, raise its bias */
                const double d = c->bias_rule == LM_BIAS_SIGN
                                     ? u * (double)((gap > 0.0) - (gap < 0.0))
                                     : u * gap / mean;
                b[e] = (float)(b[e] + d);
            }
        } else if (sc[RED_QBCOUNT] > 0.0) {
            const double ema = c->quantile_ema;
            for (int e = 0; e < E; e++) {
                const double bnew = qacc[e] / sc[RED_QBCOUNT];
                b[e] = (float)(ema * b[e] + (1.0 - ema) * bnew);
            }
        }
        if (c->bias_center) {
            double mb = 0.0;
            for (int e = 0; e < E; e++)
                mb += b[e];
            mb /= E;
            for (int e = 0; e < E; e++)
                b[e] = (float)(b[e] - mb);
        }
        if (c->bias_clamp > 0.0f) {
            const float B = c->bias_clamp;
            for (int e = 0; e < E; e++)
                b[e] = b[e] > B ? B : (b[e] < -B ? -B : b[e]);
        }
    }

    /* bias change, sign flips against the last non-zero change */
    int flips = 0;
    for (int e = 0; e < E; e++) {
        const float d = (float)((double)b[e] - b_old[e]);
        if (d != 0.0f) {
            if ((d > 0.0f && st->prev_delta[e] < 0.0f) || (d < 0.0f && st->prev_delta[e] > 0.0f))
                flips++;
            st->prev_delta[e] = d;
        }
    }

    /* history of demand for maxvio_global */
    if (observed) {
        memcpy(st->history + (size_t)st->hist_pos * E, dem, sizeof(double) * (size_t)E);
        st->hist_pos = (st->hist_pos + 1) % LM_ROUTER_HISTORY;
        if (st->hist_len < LM_ROUTER_HISTORY)
            st->hist_len++;
    }

    if (m) {
        memset(m, 0, sizeof(*m));
        m->tokens = (int64_t)sc[RED_TOKENS];
        if (observed) {
            double mx = dem[0], mn = dem[0];
            int dead = 0;
            for (int e = 0; e < E; e++) {
                mx = dem[e] > mx ? dem[e] : mx;
                mn = dem[e] < mn ? dem[e] : mn;
                dead += dem[e] == 0.0;
            }
            m->maxvio_batch = mx / mean - 1.0;
            m->min_load = mn / mean;
            m->n_dead = dead;
            /* pooled over the history window (this step included) */
            double pmx = 0.0, ptot = 0.0;
            for (int e = 0; e < E; e++) {
                double p = 0.0;
                for (int h = 0; h < st->hist_len; h++)
                    p += st->history[(size_t)h * E + e];
                pmx = p > pmx ? p : pmx;
                ptot += p;
            }
            m->maxvio_global = pmx / (ptot / E) - 1.0;
            const int k = c->num_experts_per_tok;
            m->dropped_assign_frac = sc[RED_DROP_A] / (sc[RED_TOKENS] * k);
            m->dropped_token_frac = sc[RED_DROP_T] / sc[RED_TOKENS];
        } else {
            m->n_dead = E;
        }
        m->aux_loss = sc[RED_NMICRO] > 0.0 ? sc[RED_AUX] / sc[RED_NMICRO] : 0.0;
        double s1 = 0.0, bmin = b[0], bmax = b[0];
        for (int e = 0; e < E; e++) {
            s1 += b[e];
            bmin = b[e] < bmin ? b[e] : bmin;
            bmax = b[e] > bmax ? b[e] : bmax;
        }
        const double bm = s1 / E;
        double s2 = 0.0;
        for (int e = 0; e < E; e++)
            s2 += (b[e] - bm) * (b[e] - bm);
        m->bias_mean = bm;
        m->bias_std = sqrt(s2 / E);
        m->bias_min = bmin;
        m->bias_max = bmax;
        int ncl = 0;
        if (c->bias_clamp > 0.0f)
            for (int e = 0; e < E; e++)
                ncl += fabsf(b[e]) >= c->bias_clamp;
        m->n_clamped = ncl;
        m->sign_flip_rate = (double)flips / E;
    }

    /* reset the step accumulators */
    memset(st->demand, 0, sizeof(double) * (size_t)E);
    memset(st->kept, 0, sizeof(double) * (size_t)E);
    memset(st->qb_accum, 0, sizeof(double) * (size_t)E);
    st->qb_count = 0;
    st->tokens = st->dropped_assign = st->dropped_tokens = 0;
    st->aux_loss_sum = 0.0;
    st->n_micro = 0;
    return LM_OK;
}
