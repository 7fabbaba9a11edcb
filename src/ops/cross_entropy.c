/* Cross-entropy fused with the LM head, chunked over the vocabulary
 * (include/linmoe/layers.h).
 *
 * Forward: for each chunk of vocabulary rows (in order), every block of RB tokens
 * computes its [RB, chunk] logits with one lm_sgemm and folds them into a running
 * (max, sum of exp) per token: the online log-sum-exp. The chunk loop is outside the
 * token loop so a chunk of W is shared in cache by all threads; the per-token state
 * lives in the scratch. Backward: dh by token blocks over the chunks in order (each
 * block accumulates its own rows: no reduction across threads), dW by blocks of VB
 * vocabulary rows over all token blocks in order. Both recompute their logits. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "ops/layers_internal.h"

#define RB 64   /* tokens per block: forward and dh */
#define RB2 256 /* tokens per block: dW (the K of its matmul) */

static const char *OP = "cross_entropy";

void lm_ce_config_default(lm_ce_config *c, int64_t N, int D, int V) {
    memset(c, 0, sizeof(*c));
    c->N = N, c->D = D, c->V = V;
    c->chunk_size = LM_CE_CHUNK_DEFAULT;
    c->ignore_index = -1;
}

static int chunk_of(const lm_ce_config *c) { return c->chunk_size < c->V ? c->chunk_size : c->V; }

/* Vocabulary rows per dW task: about V/32 (enough tasks to share among threads),
 * between 16 and 256, never above the chunk size. Depends on the problem only. */
static int vblock_of(const lm_ce_config *c) {
    int vb = (c->V + 31) / 32;
    vb = vb < 16 ? 16 : vb > 256 ? 256 : vb;
    return vb < chunk_of(c) ? vb : chunk_of(c);
}

static int64_t logits_floats(const lm_ce_config *c) {
    int64_t a = (int64_t)RB * chunk_of(c), b = (int64_t)RB2 * vblock_of(c);
    return a > b ? a : b;
}

/* [N state rows: max, sum, target logit][threads x logits block] */
int64_t lm_cross_entropy_ws_floats(const lm_ce_config *c) {
    if (!c || c->N < 0 || c->V < 1 || c->chunk_size < 1)
        return 0;
    return 3 * c->N + (int64_t)lm_get_num_threads() * logits_floats(c);
}

static lm_status validate(const lm_ce_config *c, const float *h, const float *W,
                          const int32_t *targets, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is required", OP);
    if (c->N < 0 || c->N > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be in [0, 2^31)", OP,
                         (long long)c->N);
    if (c->D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: D = %d must be >= 1", OP, c->D);
    if (c->V < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: vocabulary size V = %d must be >= 1", OP, c->V);
    if (c->chunk_size < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: chunk_size = %d must be >= 1", OP,
                         c->chunk_size);
    if (c->ignore_index >= 0 && c->ignore_index < c->V)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: ignore_index = %d is a valid token id (must lie outside [0, V = %d))",
                         OP, c->ignore_index, c->V);
    if ((double)c->N * c->D > 9.0e15 || (double)c->V * c->D > 9.0e15)
        return lm_errorf(err, LM_ERR_INVALID, "%s: problem too large (N = %lld, D = %d, V = %d)",
                         OP, (long long)c->N, c->D, c->V);
    if (!W)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'W' (lm_head.weight [V, D]) is required",
                         OP);
    if (c->N > 0 && (!h || !targets))
        return lm_errorf(err, LM_ERR_INVALID, "%s: inputs 'h' and 'targets' are required", OP);
    const int64_t need = lm_cross_entropy_ws_floats(c);
    if (c->ws && c->ws_floats < need)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: scratch ws_floats = %lld is below the %lld needed (N = %lld, chunk "
                         "%d, %d threads)",
                         OP, (long long)c->ws_floats, (long long)need, (long long)c->N,
                         c->chunk_size, lm_get_num_threads());
    for (int64_t n = 0; n < c->N; n++) {
        const int32_t t = targets[n];
        if (t != c->ignore_index && (t < 0 || t >= c->V))
            return lm_errorf(err, LM_ERR_INVALID,
                             "%s: targets[%lld] = %d is outside [0, V = %d) and is not "
                             "ignore_index (%d)",
                             OP, (long long)n, (int)t, c->V, c->ignore_index);
    }
    LM_TRY(lm_layers_check_finite(OP, "h", h, c->N * c->D, c->D, err));
    LM_TRY(lm_layers_check_finite(OP, "W", W, (int64_t)c->V * c->D, c->D, err));
    return LM_OK;
}

typedef struct {
    float *state;  /* [3, N]: running max, running sum of exp(logit - max), target logit */
    float *logits; /* [threads, logits_floats] */
    int64_t per_thread;
    int nthr;
    float *own;
} ce_scratch;

static void scratch_init(const lm_ce_config *c, ce_scratch *s) {
    s->nthr = lm_get_num_threads();
    s->per_thread = logits_floats(c);
    const int64_t n = 3 * c->N + s->nthr * s->per_thread;
    s->own = c->ws ? NULL : LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
    float *base = c->ws ? c->ws : s->own;
    s->state = base;
    s->logits = base + 3 * c->N;
}

static int counted(const lm_ce_config *c, int32_t t) { return t != c->ignore_index; }

/* Token block b (rows [b*RB, b*RB + RB) of N) against the vocabulary chunk
 * [v0, v0 + vc): its logits in buf, folded into the running max / sum, the target
 * logits into tl. */
static void lse_block(const lm_ce_config *c, const float *h, const float *W, const int32_t *targets,
                      const ce_scratch *s, int v0, int vc, int b, float *buf, float *tl) {
    const int64_t N = c->N;
    const int D = c->D;
    float *mx = s->state, *sm = s->state + N;
    const int64_t r0 = (int64_t)b * RB;
    const int m = (int)(N - r0 < RB ? N - r0 : RB);
    lm_sgemm(0, 1, m, vc, D, 1.0f, h + r0 * D, D, W + (int64_t)v0 * D, D, 0.0f, buf, vc);
    for (int i = 0; i < m; i++) {
        const int64_t n = r0 + i;
        const float *restrict row = buf + (int64_t)i * vc;
        float cmax = -INFINITY, bad = 0.0f;
#pragma omp simd reduction(max : cmax) reduction(+ : bad)
        for (int j = 0; j < vc; j++) {
            cmax = row[j] > cmax ? row[j] : cmax;
            bad += row[j] * 0.0f; /* NaN once a logit is not finite */
        }
        if (bad != 0.0f || isnan(mx[n])) { /* overflow: lse = NaN, reported */
            mx[n] = NAN;
            continue;
        }
        const float mnew = cmax > mx[n] ? cmax : mx[n];
        float csum = 0.0f;
#pragma omp simd reduction(+ : csum)
        for (int j = 0; j < vc; j++)
            csum += lm_fexp(row[j] - mnew);
        /* exp(-inf) = 0 rescales the empty initial sum */
        sm[n] = (float)((double)sm[n] * exp((double)mx[n] - (double)mnew) + csum);
        mx[n] = mnew;
        const int32_t t = targets[n];
        if (counted(c, t) && t >= v0 && t < v0 + vc)
            tl[n] = row[t - v0];
    }
}

/* lse[n] for every row and tl[n] = logits[n, target[n]] for counted rows. */
static void ce_lse(const lm_ce_config *c, const float *h, const float *W, const int32_t *targets,
                   ce_scratch *s, float *lse, float *tl) {
    const int64_t N = c->N;
    const int V = c->V, CH = chunk_of(c);
    float *mx = s->state, *sm = s->state + N;
    for (int64_t n = 0; n < N; n++)
        mx[n] = -INFINITY, sm[n] = 0.0f, tl[n] = 0.0f;
    const int nrb = (int)((N + RB - 1) / RB);
    lm_layers_blas_guard g = lm_layers_blas_single();
    if (nrb > 1) {
#pragma omp parallel num_threads(s->nthr)
        {
            float *buf = s->logits + (int64_t)omp_get_thread_num() * s->per_thread;
            for (int v0 = 0; v0 < V; v0 += CH) {
                const int vc = V - v0 < CH ? V - v0 : CH;
#pragma omp for schedule(dynamic, 1)
                for (int b = 0; b < nrb; b++)
                    lse_block(c, h, W, targets, s, v0, vc, b, buf, tl);
            }
        }
    } else {
        /* one token block: a plain loop, outside any OpenMP region (a one-thread
         * region still enters the runtime, which allocates a team for it) */
        for (int v0 = 0; v0 < V; v0 += CH) {
            const int vc = V - v0 < CH ? V - v0 : CH;
            for (int b = 0; b < nrb; b++)
                lse_block(c, h, W, targets, s, v0, vc, b, s->logits, tl);
        }
    }
    lm_layers_blas_restore(g);
    for (int64_t n = 0; n < N; n++)
        lse[n] = (float)((double)mx[n] + log((double)sm[n]));
}

/* Finite h and W can still give non-finite logits (|h . W| beyond fp32). */
static lm_status check_lse(const float *lse, int64_t N, lm_error *err) {
    const int64_t i = lm_layers_first_nonfinite(lse, N);
    if (i < 0)
        return LM_OK;
    return lm_errorf(
        err, LM_ERR_NONFINITE,
        "%s: the logits of row %lld overflow fp32 (log-sum-exp = %g): h or W too large", OP,
        (long long)i, (double)lse[i]);
}

lm_status lm_cross_entropy_forward(const lm_ce_config *c, const float *h, const float *W,
                                   const int32_t *targets, double *loss, int64_t *count, float *lse,
                                   lm_error *err) {
    LM_TRY(validate(c, h, W, targets, err));
    if (!loss)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'loss' is required", OP);
    ce_scratch s;
    scratch_init(c, &s);
    float *tl = s.state + 2 * c->N;
    float *lse_own = lse ? NULL : LM_MALLOC(sizeof(float) * (size_t)(c->N > 0 ? c->N : 1));
    float *L = lse ? lse : lse_own;
    ce_lse(c, h, W, targets, &s, L, tl);
    lm_status st = check_lse(L, c->N, err);
    if (st != LM_OK) {
        free(lse_own);
        free(s.own);
        return st;
    }
    double sum = 0.0;
    int64_t cnt = 0;
    for (int64_t n = 0; n < c->N; n++)
        if (counted(c, targets[n])) {
            sum += (double)L[n] - (double)tl[n];
            cnt++;
        }
    *loss = cnt > 0 ? sum / (double)cnt : 0.0;
    if (count)
        *count = cnt;
    free(lse_own);
    free(s.own);
    return LM_OK;
}

lm_status lm_cross_entropy_nll(const lm_ce_config *c, const float *h, const float *W,
                               const int32_t *targets, float *nll, int64_t *count, lm_error *err) {
    LM_TRY(validate(c, h, W, targets, err));
    if (!nll && c->N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'nll' is required", OP);
    ce_scratch s;
    scratch_init(c, &s);
    float *tl = s.state + 2 * c->N;
    /* lse lands in nll, then becomes lse - logit[target] in place */
    ce_lse(c, h, W, targets, &s, nll, tl);
    lm_status st = check_lse(nll, c->N, err);
    if (st != LM_OK) {
        free(s.own);
        return st;
    }
    int64_t cnt = 0;
    for (int64_t n = 0; n < c->N; n++) {
        if (counted(c, targets[n])) {
            nll[n] = (float)((double)nll[n] - (double)tl[n]);
            cnt++;
        } else {
            nll[n] = 0.0f;
        }
    }
    if (count)
        *count = cnt;
    free(s.own);
    return LM_OK;
}

/* dlogits for m rows of one block (in place over its logits, row stride ld, vocab
 * columns v0..v0+vc-1): scale * (exp(logit - lse) - onehot), 0 on ignored rows. */
static void dlogits_rows(const lm_ce_config *c, const int32_t *targets, const float *lse,
                         int64_t r0, int m, int v0, int vc, float scale, float *buf) {
    for (int i = 0; i < m; i++) {
        const int64_t n = r0 + i;
        float *restrict row = buf + (int64_t)i * vc;
        const int32_t t = targets[n];
        if (!counted(c, t)) {
            memset(row, 0, sizeof(float) * (size_t)vc);
            continue;
        }
        const float l = lse[n];
#pragma omp simd
        for (int j = 0; j < vc; j++)
            row[j] = scale * lm_fexp(row[j] - l);
        if (t >= v0 && t < v0 + vc)
            row[t - v0] -= scale;
    }
}

static int block_counted(const lm_ce_config *c, const int32_t *targets, int64_t r0, int m) {
    for (int i = 0; i < m; i++)
        if (counted(c, targets[r0 + i]))
            return 1;
    return 0;
}

lm_status lm_cross_entropy_backward(const lm_ce_config *c, const float *h, const float *W,
                                    const int32_t *targets, const float *lse, float dloss,
                                    float *dh, float *dW, lm_error *err) {
    LM_TRY(validate(c, h, W, targets, err));
    if (!isfinite(dloss))
        return lm_errorf(err, LM_ERR_INVALID, "%s: dloss = %g is not finite", OP, (double)dloss);
    if (dh && dh == h)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dh' must not alias input 'h'", OP);
    if (dW && dW == W)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dW' must not alias input 'W'", OP);
    LM_TRY(lm_layers_check_finite(OP, "lse", lse, c->N, 1, err));
    const int64_t N = c->N;
    const int D = c->D, V = c->V, CH = chunk_of(c), VB = vblock_of(c);
    int64_t cnt = 0;
    for (int64_t n = 0; n < N; n++)
        cnt += counted(c, targets[n]);
    ce_scratch s = {0};
    float *lse_own = NULL;
    if (cnt > 0 && (dh || dW)) {
        scratch_init(c, &s);
        if (!lse) {
            lse_own = LM_MALLOC(sizeof(float) * (size_t)N);
            ce_lse(c, h, W, targets, &s, lse_own, s.state + 2 * N);
            lm_status st = check_lse(lse_own, N, err);
            if (st != LM_OK) {
                free(lse_own);
                free(s.own);
                return st;
            }
            lse = lse_own;
        }
    }
    if (dh)
        memset(dh, 0, sizeof(float) * (size_t)(N * D));
    if (dW)
        memset(dW, 0, sizeof(float) * (size_t)V * D);
    if (cnt == 0 || (!dh && !dW))
        return LM_OK;
    const float scale = (float)((double)dloss / (double)cnt);
    const int nrb = (int)((N + RB - 1) / RB), nrb2 = (int)((N + RB2 - 1) / RB2);
    const int nvb = (V + VB - 1) / VB;
    lm_layers_blas_guard g = lm_layers_blas_single();
#pragma omp parallel num_threads(s.nthr)
    {
        float *buf = s.logits + (int64_t)omp_get_thread_num() * s.per_thread;
        /* dh: token blocks, chunks in order (each block owns its rows of dh) */
        if (dh) {
            for (int v0 = 0; v0 < V; v0 += CH) {
                const int vc = V - v0 < CH ? V - v0 : CH;
#pragma omp for schedule(dynamic, 1)
                for (int b = 0; b < nrb; b++) {
                    const int64_t r0 = (int64_t)b * RB;
                    const int m = (int)(N - r0 < RB ? N - r0 : RB);
                    if (!block_counted(c, targets, r0, m))
                        continue;
                    lm_sgemm(0, 1, m, vc, D, 1.0f, h + r0 * D, D, W + (int64_t)v0 * D, D, 0.0f, buf,
                             vc);
                    dlogits_rows(c, targets, lse, r0, m, v0, vc, scale, buf);
                    lm_sgemm(0, 0, m, D, vc, 1.0f, buf, vc, W + (int64_t)v0 * D, D, 1.0f,
                             dh + r0 * D, D);
                }
            }
        }
        /* dW: vocabulary blocks, token blocks in order (each block owns its rows of dW) */
        if (dW) {
#pragma omp for schedule(dynamic, 1)
            for (int vb = 0; vb < nvb; vb++) {
                const int v0 = vb * VB, vc = V - v0 < VB ? V - v0 : VB;
                for (int b = 0; b < nrb2; b++) {
                    const int64_t r0 = (int64_t)b * RB2;
                    const int m = (int)(N - r0 < RB2 ? N - r0 : RB2);
                    if (!block_counted(c, targets, r0, m))
                        continue;
                    lm_sgemm(0, 1, m, vc, D, 1.0f, h + r0 * D, D, W + (int64_t)v0 * D, D, 0.0f, buf,
                             vc);
                    dlogits_rows(c, targets, lse, r0, m, v0, vc, scale, buf);
                    lm_sgemm(1, 0, vc, D, m, 1.0f, buf, vc, h + r0 * D, D, 1.0f,
                             dW + (int64_t)v0 * D, D);
                }
            }
        }
    }
    lm_layers_blas_restore(g);
    free(lse_own);
    free(s.own);
    return LM_OK;
}
