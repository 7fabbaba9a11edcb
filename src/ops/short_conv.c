/* Depthwise causal short convolution with optional fused SiLU, packed sequences and
 * conv state (include/linmoe/layers.h).
 *
 * Work is split into blocks of CB channels. The forward runs one task per (sequence,
 * channel block); the backward one task per channel block that walks every sequence
 * and token in order, so dweight is summed in a fixed order (fp64) and dx comes from
 * a ring of the last W pre-activation gradients. The taps of a block are transposed
 * to [W][CB] on the stack so the inner loops run over contiguous channels. */
#include <string.h>

#include "ops/layers_internal.h"

#define CB 32 /* channels per task: two 64-byte lines per token row */

static const char *OP = "short_conv";

void lm_short_conv_config_default(lm_short_conv_config *c, int B, int T, int C, int W) {
    memset(c, 0, sizeof(*c));
    c->B = B, c->T = T, c->C = C, c->W = W;
    c->N = B;
    c->activation = LM_ACT_SILU;
}

lm_status lm_short_conv_config_validate(lm_short_conv_config *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is required", OP);
    if (c->B < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: B = %d must be >= 1", OP, c->B);
    if (c->T < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: T = %d must be >= 0", OP, c->T);
    if (c->C < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: C = %d must be >= 1", OP, c->C);
    if (c->W < 1 || c->W > LM_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_INVALID, "%s: kernel size W = %d is outside [1, %d]", OP, c->W,
                         LM_SHORT_CONV_MAX_W);
    if (c->activation != LM_ACT_NONE && c->activation != LM_ACT_SILU)
        return lm_errorf(err, LM_ERR_INVALID, "%s: unknown activation %d", OP, (int)c->activation);
    if ((double)c->B * c->T * c->C > 9.0e15)
        return lm_errorf(err, LM_ERR_INVALID, "%s: problem too large (B*T*C = %.3g)", OP,
                         (double)c->B * c->T * c->C);
    if (c->cu_seqlens) {
        if (c->B != 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "%s: cu_seqlens needs B == 1 (packed), got B = %d", OP, c->B);
        if (c->n_cu_seqlens < 2)
            return lm_errorf(err, LM_ERR_INVALID, "%s: cu_seqlens has %d entries (need >= 2)", OP,
                             c->n_cu_seqlens);
        if (c->cu_seqlens[0] != 0)
            return lm_errorf(err, LM_ERR_INVALID, "%s: cu_seqlens[0] = %lld (must be 0)", OP,
                             (long long)c->cu_seqlens[0]);
        for (int i = 1; i < c->n_cu_seqlens; i++)
            if (c->cu_seqlens[i] < c->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "%s: cu_seqlens decreases at index %d (%lld < %lld)", OP, i,
                                 (long long)c->cu_seqlens[i], (long long)c->cu_seqlens[i - 1]);
        if (c->cu_seqlens[c->n_cu_seqlens - 1] != c->T)
            return lm_errorf(err, LM_ERR_INVALID, "%s: cu_seqlens ends at %lld, not at T = %d", OP,
                             (long long)c->cu_seqlens[c->n_cu_seqlens - 1], c->T);
        c->N = c->n_cu_seqlens - 1;
    } else {
        c->N = c->B;
    }
    return LM_OK;
}

static lm_status validate(lm_short_conv_config *c, const float *x, const float *weight,
                          const float *initial_state, lm_error *err) {
    LM_TRY(lm_short_conv_config_validate(c, err));
    if (!weight)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'weight' [C, W] is required", OP);
    const int64_t nx = (int64_t)c->B * c->T * c->C;
    if (!x && nx > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'x' is required", OP);
    LM_TRY(lm_layers_check_finite(OP, "x", x, nx, c->C, err));
    LM_TRY(lm_layers_check_finite(OP, "weight", weight, (int64_t)c->C * c->W, c->W, err));
    LM_TRY(lm_layers_check_finite(OP, "initial_state", initial_state,
                                  (int64_t)c->N * c->C * (c->W - 1), c->W - 1, err));
    return LM_OK;
}

static inline void seq_range(const lm_short_conv_config *c, int n, int64_t *bos, int64_t *len) {
    if (c->cu_seqlens) {
        *bos = c->cu_seqlens[n];
        *len = c->cu_seqlens[n + 1] - c->cu_seqlens[n];
    } else {
        *bos = (int64_t)n * c->T;
        *len = c->T;
    }
}

/* Taps of channels c0..c0+w-1 as wt[j][cc], and the W-1 state rows before the start of
 * sequence n as pre[i][cc] (zeros without a state), i = 0 oldest. */
static void load_block(const lm_short_conv_config *c, int n, int c0, int w, const float *weight,
                       const float *state, float wt[][CB], float pre[][CB]) {
    const int W = c->W, S = W - 1;
    for (int j = 0; j < W; j++)
        for (int cc = 0; cc < w; cc++)
            wt[j][cc] = weight[(int64_t)(c0 + cc) * W + j];
    for (int i = 0; i < S; i++)
        for (int cc = 0; cc < w; cc++)
            pre[i][cc] = state ? state[((int64_t)n * c->C + c0 + cc) * S + i] : 0.0f;
}

/* Row of the W-tap window at position p of a sequence starting at token bos: the
 * input row (channel c0) for p >= 0, the state row for p < 0. */
static inline const float *window_row(const float *x, int64_t bos, int64_t p, int C, int c0, int S,
                                      const float pre[][CB]) {
    return p >= 0 ? x + (bos + p) * C + c0 : pre[S + p];
}

/* Forward task `task` = (sequence n, channel block): every token of the block. */
static void forward_task(const lm_short_conv_config *c, const float *x, const float *weight,
                         const float *initial_state, float *y, float *final_state, int task) {
    const int C = c->C, W = c->W, S = W - 1, silu = c->activation == LM_ACT_SILU;
    const int nb = (C + CB - 1) / CB;
    const int n = task / nb, c0 = (task % nb) * CB, w = C - c0 < CB ? C - c0 : CB;
    float wt[LM_SHORT_CONV_MAX_W][CB], pre[LM_SHORT_CONV_MAX_W][CB];
    load_block(c, n, c0, w, weight, initial_state, wt, pre);
    int64_t bos, len;
    seq_range(c, n, &bos, &len);
    for (int64_t t = 0; t < len; t++) {
        float acc[CB];
        for (int cc = 0; cc < CB; cc++)
            acc[cc] = 0.0f;
        for (int j = 0; j < W; j++) {
            const float *restrict xr = window_row(x, bos, t - S + j, C, c0, S, pre);
            const float *restrict wj = wt[j];
#pragma omp simd
            for (int cc = 0; cc < w; cc++)
                acc[cc] += wj[cc] * xr[cc];
        }
        float *restrict yr = y + (bos + t) * C + c0;
        if (silu) {
#pragma omp simd
            for (int cc = 0; cc < w; cc++)
                yr[cc] = acc[cc] * lm_layers_sigmoid(acc[cc]);
        } else {
            for (int cc = 0; cc < w; cc++)
                yr[cc] = acc[cc];
        }
    }
    if (final_state) {
        /* the last W-1 inputs: state entries shift by len, then the sequence's tail */
        for (int i = 0; i < S; i++) {
            const float *restrict src = window_row(x, bos, len - S + i, C, c0, S, pre);
            for (int cc = 0; cc < w; cc++)
                final_state[((int64_t)n * C + c0 + cc) * S + i] = src[cc];
        }
    }
}

lm_status lm_short_conv_forward(lm_short_conv_config *c, const float *x, const float *weight,
                                const float *initial_state, float *y, float *final_state,
                                lm_error *err) {
    LM_TRY(validate(c, x, weight, initial_state, err));
    const int64_t nx = (int64_t)c->B * c->T * c->C;
    if (!y && nx > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' is required", OP);
    if (y && y == x)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' must not alias input 'x'", OP);
    if (final_state && (final_state == x || final_state == y))
        return lm_errorf(err, LM_ERR_INVALID, "%s: 'final_state' must not alias 'x' or 'y'", OP);
    const int nb = (c->C + CB - 1) / CB, ntask = c->N * nb, W = c->W;
    if (nx * W > LM_LAYERS_PAR_MIN && ntask > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int task = 0; task < ntask; task++)
            forward_task(c, x, weight, initial_state, y, final_state, task);
    } else {
        for (int task = 0; task < ntask; task++)
            forward_task(c, x, weight, initial_state, y, final_state, task);
    }
    return LM_OK;
}

/* Backward task: channel block b over every sequence and token, in order. */
static void backward_block(const lm_short_conv_config *c, const float *x, const float *weight,
                           const float *initial_state, const float *dy, float *dx, float *dweight,
                           float *dinitial_state, int b) {
    const int C = c->C, W = c->W, S = W - 1, silu = c->activation == LM_ACT_SILU;
    const int c0 = b * CB, w = C - c0 < CB ? C - c0 : CB;
    float wt[LM_SHORT_CONV_MAX_W][CB], pre[LM_SHORT_CONV_MAX_W][CB];
    float ring[LM_SHORT_CONV_MAX_W][CB]; /* gradients of pre-activations, slot t % W */
    double dwacc[LM_SHORT_CONV_MAX_W][CB];
    memset(dwacc, 0, sizeof(dwacc));
    for (int n = 0; n < c->N; n++) {
        load_block(c, n, c0, w, weight, initial_state, wt, pre);
        int64_t bos, len;
        seq_range(c, n, &bos, &len);
        /* token t's pre-activation gradient g_t enters the ring at step t; the input
         * at position s = t - (W-1) has then received all of its W taps:
         *   dx[s] = sum_j w[j] * g[s + (W-1) - j] = sum_j w[j] * g[t - j]
         * (g = 0 past the end). t runs over [0, len + W-1), so s covers [-(W-1), len):
         * s < 0 are the state rows (dinitial_state). */
        for (int64_t t = 0; t < len + S; t++) {
            float *restrict gt = ring[t % W];
            if (t < len) {
                const float *restrict dyr = dy + (bos + t) * C + c0;
                if (silu) {
                    float acc[CB];
                    for (int cc = 0; cc < CB; cc++)
                        acc[cc] = 0.0f;
                    for (int j = 0; j < W; j++) {
                        const float *restrict xr = window_row(x, bos, t - S + j, C, c0, S, pre);
#pragma omp simd
                        for (int cc = 0; cc < w; cc++)
                            acc[cc] += wt[j][cc] * xr[cc];
                    }
#pragma omp simd
                    for (int cc = 0; cc < w; cc++) {
                        const float s = lm_layers_sigmoid(acc[cc]);
                        gt[cc] = dyr[cc] * (s * (1.0f + acc[cc] * (1.0f - s)));
                    }
                } else {
                    for (int cc = 0; cc < w; cc++)
                        gt[cc] = dyr[cc];
                }
                if (dweight) {
                    for (int j = 0; j < W; j++) {
                        const float *restrict xr = window_row(x, bos, t - S + j, C, c0, S, pre);
                        double *restrict dj = dwacc[j];
#pragma omp simd
                        for (int cc = 0; cc < w; cc++)
                            dj[cc] += (double)gt[cc] * (double)xr[cc];
                    }
                }
            } else {
                for (int cc = 0; cc < w; cc++)
                    gt[cc] = 0.0f;
            }
            const int64_t s = t - S;
            float *restrict out = NULL;
            int64_t ostride = 1;
            if (s >= 0) {
                out = dx ? dx + (bos + s) * C + c0 : NULL;
            } else if (dinitial_state) {
                out = dinitial_state + ((int64_t)n * C + c0) * S + (S + s);
                ostride = S;
            }
            if (!out)
                continue;
            float acc[CB];
            for (int cc = 0; cc < CB; cc++)
                acc[cc] = 0.0f;
            for (int j = 0; j < W && j <= t; j++) {
                const float *restrict gj = ring[(t - j) % W];
#pragma omp simd
                for (int cc = 0; cc < w; cc++)
                    acc[cc] += wt[j][cc] * gj[cc];
            }
            for (int cc = 0; cc < w; cc++)
                out[cc * ostride] = acc[cc];
        }
    }
    if (dweight)
        for (int j = 0; j < W; j++)
            for (int cc = 0; cc < w; cc++)
                dweight[(int64_t)(c0 + cc) * W + j] = (float)dwacc[j][cc];
}

lm_status lm_short_conv_backward(lm_short_conv_config *c, const float *x, const float *weight,
                                 const float *initial_state, const float *dy, float *dx,
                                 float *dweight, float *dinitial_state, lm_error *err) {
    LM_TRY(validate(c, x, weight, initial_state, err));
    const int64_t nx = (int64_t)c->B * c->T * c->C;
    if (!dy && nx > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: upstream gradient 'dy' is required", OP);
    if (dx && (dx == dy || dx == x))
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dx' must not alias 'x' or 'dy'", OP);
    LM_TRY(lm_layers_check_finite(OP, "dy", dy, nx, c->C, err));
    const int nb = (c->C + CB - 1) / CB, W = c->W;
    if (nx * W > LM_LAYERS_PAR_MIN && nb > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int b = 0; b < nb; b++)
            backward_block(c, x, weight, initial_state, dy, dx, dweight, dinitial_state, b);
    } else {
        for (int b = 0; b < nb; b++)
            backward_block(c, x, weight, initial_state, dy, dx, dweight, dinitial_state, b);
    }
    return LM_OK;
}

lm_status lm_short_conv_step(int B, int C, int W, lm_activation act, const float *x,
                             const float *weight, float *conv_state, float *y, lm_error *err) {
    lm_short_conv_config c;
    lm_short_conv_config_default(&c, B, 1, C, W);
    c.activation = act;
    if (!conv_state && W > 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: decode step needs 'conv_state' [B, C, W-1]", OP);
    return lm_short_conv_forward(&c, x, weight, conv_state, y, conv_state, err);
}
