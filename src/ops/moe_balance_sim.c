/* Balance simulator (include/linmoe/moe_router.h, lm_balance_sim_run): the
 * stationary skewed synthetic router of reference/moe.md §7.3 run through the
 * library router, so the simulation exercises the same forward, quantile solve and
 * bias update a training run uses.
 *
 * Noise: z[step, t, j] comes from Philox (lm_philox4x32) at counter
 * (step*T + t) * ceil(E/4) + j/4, four words per block turned into four normals by
 * Box-Muller (both the cos and the sin branch) in fp32 with 24-bit uniforms. Every
 * value is a pure function of (seed, step, t, j), so the run is identical for any
 * thread count.
 */
#include "linmoe/moe_router.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void lm_balance_sim_config_default(lm_balance_sim_config *c) {
    memset(c, 0, sizeof(*c));
    c->experts = 64;
    c->topk = 8;
    c->tokens = 4096;
    c->steps = 1000;
    c->micro = 1;
    c->mode = LM_BAL_AUX_FREE;
    c->rule = LM_BIAS_SIGN;
    c->rate = 1e-3f;
    c->clamp = 1.0f;
    c->center = 1;
    c->iters = 1;
    c->ema = 0.0f;
    c->capacity_factor = 0.0f;
    c->drop = LM_DROP_PROBS;
    c->aux_alpha = 1e-2f;
    c->aux_lr = 100.0f;
    c->skew = 2.0f;
    c->seed = 1234;
}

/* logits[t, j] = z[step, t, j] + off[j] for t in [0, T). */
static void sim_logits(uint64_t seed, int64_t step, int T, int E, const float *off, float *out) {
    const int nb = (E + 3) / 4;
    const float two_pi = 6.28318530717958647692f, inv24 = 1.0f / 16777216.0f;
#pragma omp parallel for schedule(static) if ((int64_t)T * E >= 16384)
    for (int t = 0; t < T; t++) {
        float *row = out + (size_t)t * E;
        const uint64_t base = ((uint64_t)step * (uint64_t)T + (uint64_t)t) * (uint64_t)nb;
        for (int b = 0; b < nb; b++) {
            uint32_t w[4];
            lm_philox4x32(seed, base + (uint64_t)b, w);
            float z[4];
            for (int h = 0; h < 2; h++) {
                const float u1 = ((float)(w[2 * h] >> 8) + 0.5f) * inv24; /* (0, 1) */
                const float u2 = (float)(w[2 * h + 1] >> 8) * inv24;
                const float r = sqrtf(-2.0f * logf(u1)), th = two_pi * u2;
                z[2 * h] = r * cosf(th);
                z[2 * h + 1] = r * sinf(th);
            }
            for (int i = 0; i < 4 && 4 * b + i < E; i++)
                row[4 * b + i] = z[i] + off[4 * b + i];
        }
    }
}

lm_status lm_balance_sim_run(const lm_balance_sim_config *sc, lm_router_metrics *steps,
                             lm_balance_sim_summary *sum, lm_error *err) {
    if (!sc)
        return lm_errorf(err, LM_ERR_INVALID, "balance-sim: config is required");
    if (sc->tokens < 1)
        return lm_errorf(err, LM_ERR_INVALID, "balance-sim: tokens = %d must be >= 1", sc->tokens);
    if (sc->steps < 1)
        return lm_errorf(err, LM_ERR_INVALID, "balance-sim: steps = %d must be >= 1", sc->steps);
    if (sc->micro < 1 || sc->micro > sc->tokens)
        return lm_errorf(err, LM_ERR_INVALID, "balance-sim: micro = %d must be in [1, tokens = %d]",
                         sc->micro, sc->tokens);
    if (!isfinite(sc->skew) || sc->skew < 0.0f)
        return lm_errorf(err, LM_ERR_INVALID, "balance-sim: skew = %g must be finite and >= 0",
                         (double)sc->skew);
    if (!isfinite(sc->aux_lr) || sc->aux_lr < 0.0f)
        return lm_errorf(err, LM_ERR_INVALID, "balance-sim: aux_lr = %g must be finite and >= 0",
                         (double)sc->aux_lr);
    if ((int64_t)sc->tokens * (sc->experts > 0 ? sc->experts : 1) > ((int64_t)1 << 30))
        return lm_errorf(err, LM_ERR_INVALID,
                         "balance-sim: tokens x experts = %d x %d is too large", sc->tokens,
                         sc->experts);

    lm_router_config rc;
    lm_router_config_default(&rc, sc->experts, sc->topk);
    rc.balance = sc->mode;
    rc.bias_rule = sc->rule;
    rc.bias_update_rate = sc->rate;
    rc.bias_clamp = sc->clamp;
    rc.bias_center = sc->center;
    rc.quantile_iters = sc->iters;
    rc.quantile_ema = sc->ema;
    rc.capacity_factor = sc->capacity_factor;
    rc.drop_policy = sc->drop;
    rc.aux_loss_alpha = sc->aux_alpha;
    LM_TRY(lm_router_config_validate(&rc, err));

    const int E = sc->experts, T = sc->tokens, M = sc->micro, N = sc->steps;
    lm_router_state st;
    LM_TRY(lm_router_state_init(&st, E, err));
    /* mu: fixed skew; o: the trainable logit offsets of AUX_LOSS mode (else 0) */
    float *mu = LM_CALLOC((size_t)E * 3, sizeof(float)), *o = mu + E, *off = mu + 2 * E;
    for (int j = 0; j < E; j++)
        mu[j] = E > 1 ? (float)(-(double)sc->skew + 2.0 * sc->skew * j / (E - 1)) : 0.0f;
    float *logits = LM_MALLOC(sizeof(float) * (size_t)T * E);
    float *dlog = sc->mode == LM_BAL_AUX_LOSS ? LM_MALLOC(sizeof(float) * (size_t)T * E) : NULL;
    double *grad = LM_CALLOC((size_t)E, sizeof(double));
    lm_route *routes = LM_CALLOC((size_t)M, sizeof(lm_route)); /* one per micro-batch shape */
    lm_router_metrics *met = steps ? steps : LM_MALLOC(sizeof(lm_router_metrics) * (size_t)N);
    lm_status rcode = LM_OK;
    const double t0 = lm_time_sec();

    for (int s = 0; s < N && rcode == LM_OK; s++) {
        for (int j = 0; j < E; j++)
            off[j] = mu[j] + o[j];
        sim_logits(sc->seed, s, T, E, off, logits);
        for (int j = 0; j < E; j++)
            grad[j] = 0.0;
        for (int mb = 0; mb < M && rcode == LM_OK; mb++) {
            const int b0 = (int)((int64_t)T * mb / M), b1 = (int)((int64_t)T * (mb + 1) / M);
            rcode = lm_router_forward(&rc, &st, logits + (size_t)b0 * E, b1 - b0, NULL, 0, 1,
                                      &routes[mb], err);
            if (rcode == LM_OK && dlog) {
                rcode = lm_router_backward(&rc, &routes[mb], NULL, dlog, err);
                for (int j = 0; j < E && rcode == LM_OK; j++) {
                    double g = 0.0;
                    for (int t = 0; t < b1 - b0; t++)
                        g += dlog[(size_t)t * E + j];
                    grad[j] += g;
                }
            }
        }
        if (rcode != LM_OK)
            break;
        rcode = lm_router_update_bias(&rc, &st, NULL, NULL, &met[s], err);
        if (dlog)
            for (int j = 0; j < E; j++)
                o[j] = (float)(o[j] - sc->aux_lr * grad[j] / M);
    }

    if (rcode == LM_OK && sum) {
        memset(sum, 0, sizeof(*sum));
        for (int s = 0; s < N; s++)
            if (met[s].maxvio_batch < 0.2) {
                sum->first_step_maxvio_below_0_2 = s + 1;
                break;
            }
        const int w = N < 100 ? N : 100;
        double acc = 0.0;
        for (int s = N - w; s < N; s++)
            acc += met[s].maxvio_batch;
        sum->maxvio_batch_last100_mean = acc / w;
        sum->maxvio_global_last100 = met[N - 1].maxvio_global;
        sum->n_dead_final = met[N - 1].n_dead;
        for (int s = 0; s < N; s++) {
            const double a = fmax(fabs(met[s].bias_min), fabs(met[s].bias_max));
            sum->max_abs_bias = a > sum->max_abs_bias ? a : sum->max_abs_bias;
            sum->max_n_clamped =
                met[s].n_clamped > sum->max_n_clamped ? met[s].n_clamped : sum->max_n_clamped;
        }
        sum->seconds = lm_time_sec() - t0;
    }

    for (int mb = 0; mb < M; mb++)
        lm_route_free(&routes[mb]);
    free(routes);
    if (!steps)
        free(met);
    free(grad);
    free(dlog);
    free(logits);
    free(mu);
    lm_router_state_free(&st);
    return rcode;
}
