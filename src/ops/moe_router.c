/* MoE router (include/linmoe/moe_router.h): configuration defaults, validation and
 * name parsing; router state init/free; the forward (scores, biased top-k with
 * optional group limiting, gate weights, capacity, aux loss, demand accumulation,
 * per-micro-batch quantile solve); the backward into the logits; and the quantile
 * dual solve itself. The once-per-step bias update and the metrics are in
 * moe_balance.c.
 *
 * Math: reference/moe.md §1.1 (selection on s + b, weights from s), §2 (DeepSeek-V3
 * normalisation, scaling, group-limited routing, sequence-wise aux loss), §4.2 /
 * §4.6 (quantile dual), §5 (capacity). Everything per token is independent, so the
 * token loops run in parallel and every cross-token sum runs serially in a fixed
 * order: results are bit-identical for any thread count.
 */
#include "linmoe/moe_router.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Gate-weight and s' denominators get this added (Megatron / torchtitan use 1e-20),
 * so rows whose sigmoid scores all underflow give zero weights, not NaN. */
#define ROUTER_DENOM_EPS 1e-20
/* Token loops with fewer than this many scores stay on one thread. */
#define ROUTER_PAR_MIN 16384
#define ROUTER_MAX_EXPERTS 65536

struct lm_route_priv {
    int64_t *cu; /* sequence bounds used by the aux loss: [n_cu] */
    int n_cu;
    size_t cu_cap;
    void *sel; /* per-thread selection scratch */
    size_t sel_cap;
    void *qb; /* quantile solve scratch */
    size_t qb_cap;
    void *cap; /* capacity scratch */
    size_t cap_cap;
    void *aux; /* aux-loss value scratch: P, counts [2E] */
    size_t aux_cap;
    void *cnt; /* forward demand / kept counts [2E] */
    size_t cnt_cap;
    void *coef; /* backward aux-loss coefficients [n_seq, E] */
    size_t coef_cap;
    void *ds; /* backward per-thread score gradients [threads, E] */
    size_t ds_cap;
    int64_t tok_cap; /* tokens the route's arrays (topk_idx, ...) hold */
};

/* ---------------------------------------------------------------- config */

void lm_router_config_default(lm_router_config *c, int E, int k) {
    memset(c, 0, sizeof(*c));
    c->num_experts = E;
    c->num_experts_per_tok = k;
    c->scoring_func = LM_SCORE_SIGMOID;
    c->norm_topk_prob = 1;
    c->routed_scaling_factor = 1.0f;
    c->n_group = 1;
    c->topk_group = 1;
    c->balance = LM_BAL_AUX_FREE;
    c->bias_rule = LM_BIAS_SIGN;
    c->bias_update_rate = 1e-3f;
    c->bias_clamp = 1.0f;
    c->bias_center = 1;
    c->aux_loss_alpha = 1e-3f;
    c->aux_loss_seq = 0;
    c->quantile_iters = 1;
    c->quantile_ema = 0.0f;
    c->capacity_factor = 0.0f;
    c->drop_policy = LM_DROP_PROBS;
}

lm_status lm_router_config_validate(const lm_router_config *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "router: config is required");
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (E < 1 || E > ROUTER_MAX_EXPERTS)
        return lm_errorf(err, LM_ERR_INVALID, "router: num_experts = %d must be in [1, %d]", E,
                         ROUTER_MAX_EXPERTS);
    if (k < 1 || k > E)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: num_experts_per_tok = %d must be in [1, num_experts = %d]", k, E);
    if (c->scoring_func != LM_SCORE_SIGMOID && c->scoring_func != LM_SCORE_SOFTMAX)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: unknown scoring_func %d (expected sigmoid or softmax)",
                         (int)c->scoring_func);
    if (c->balance != LM_BAL_NONE && c->balance != LM_BAL_AUX_LOSS &&
        c->balance != LM_BAL_AUX_FREE && c->balance != LM_BAL_QUANTILE)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: unknown balance mode %d (expected none, aux_loss, aux_free or "
                         "quantile)",
                         (int)c->balance);
    if (c->bias_rule != LM_BIAS_SIGN && c->bias_rule != LM_BIAS_LINEAR)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: unknown bias_rule %d (expected sign or linear)",
                         (int)c->bias_rule);
    if (c->drop_policy != LM_DROP_PROBS && c->drop_policy != LM_DROP_POSITION)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: unknown drop_policy %d (expected probs or position)",
                         (int)c->drop_policy);
    if (!isfinite(c->routed_scaling_factor) || c->routed_scaling_factor <= 0.0f)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: routed_scaling_factor = %g must be finite and > 0",
                         (double)c->routed_scaling_factor);
    if (c->n_group < 0)
        return lm_errorf(err, LM_ERR_INVALID, "router: n_group = %d must be >= 0 (<= 1: off)",
                         c->n_group);
    if (c->n_group > 1) {
        if (E % c->n_group != 0)
            return lm_errorf(err, LM_ERR_INVALID,
                             "router: n_group = %d does not divide num_experts = %d", c->n_group,
                             E);
        if (c->topk_group < 1 || c->topk_group > c->n_group)
            return lm_errorf(err, LM_ERR_INVALID,
                             "router: topk_group = %d must be in [1, n_group = %d]", c->topk_group,
                             c->n_group);
        if ((int64_t)c->topk_group * (E / c->n_group) < k)
            return lm_errorf(err, LM_ERR_INVALID,
                             "router: topk_group = %d groups of %d experts hold fewer than "
                             "num_experts_per_tok = %d",
                             c->topk_group, E / c->n_group, k);
    }
    if (!isfinite(c->bias_update_rate) || c->bias_update_rate < 0.0f)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: bias_update_rate = %g must be finite and >= 0",
                         (double)c->bias_update_rate);
    if (!isfinite(c->bias_clamp))
        return lm_errorf(err, LM_ERR_INVALID, "router: bias_clamp = %g is not finite",
                         (double)c->bias_clamp);
    if (!isfinite(c->aux_loss_alpha) || c->aux_loss_alpha < 0.0f)
        return lm_errorf(err, LM_ERR_INVALID, "router: aux_loss_alpha = %g must be finite and >= 0",
                         (double)c->aux_loss_alpha);
    if (c->quantile_iters < 1)
        return lm_errorf(err, LM_ERR_INVALID, "router: quantile_iters = %d must be >= 1",
                         c->quantile_iters);
    if (!(c->quantile_ema >= 0.0f && c->quantile_ema <= 1.0f))
        return lm_errorf(err, LM_ERR_INVALID, "router: quantile_ema = %g must be in [0, 1]",
                         (double)c->quantile_ema);
    if (!isfinite(c->capacity_factor) || c->capacity_factor < 0.0f)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: capacity_factor = %g must be finite and >= 0 (0 = dropless)",
                         (double)c->capacity_factor);
    if (c->balance == LM_BAL_QUANTILE && k >= E)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: balance quantile needs num_experts_per_tok = %d < num_experts = "
                         "%d (the (k+1)-th score must exist)",
                         k, E);
    return LM_OK;
}

static int name_index(const char *s, const char *const *names, int n) {
    if (!s)
        return -1;
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

int lm_score_func_from_name(const char *s) {
    static const char *const n[] = {"sigmoid", "softmax"};
    return name_index(s, n, 2);
}

int lm_balance_from_name(const char *s) {
    static const char *const n[] = {"none", "aux_loss", "aux_free", "quantile"};
    return name_index(s, n, 4);
}

int lm_bias_rule_from_name(const char *s) {
    static const char *const n[] = {"sign", "linear"};
    return name_index(s, n, 2);
}

int lm_drop_policy_from_name(const char *s) {
    static const char *const n[] = {"probs", "position"};
    return name_index(s, n, 2);
}

/* ---------------------------------------------------------------- state */

lm_status lm_router_state_init(lm_router_state *s, int E, lm_error *err) {
    if (!s)
        return lm_errorf(err, LM_ERR_INVALID, "router: state is required");
    memset(s, 0, sizeof(*s));
    if (E < 1 || E > ROUTER_MAX_EXPERTS)
        return lm_errorf(err, LM_ERR_INVALID, "router: state num_experts = %d must be in [1, %d]",
                         E, ROUTER_MAX_EXPERTS);
    s->E = E;
    s->e_score_correction_bias = calloc((size_t)E, sizeof(float));
    s->demand = calloc((size_t)E, sizeof(double));
    s->kept = calloc((size_t)E, sizeof(double));
    s->qb_accum = calloc((size_t)E, sizeof(double));
    s->prev_delta = calloc((size_t)E, sizeof(float));
    s->history = calloc((size_t)LM_ROUTER_HISTORY * E, sizeof(double));
    s->reduce_buf = calloc(LM_ROUTER_REDUCE_BUF_LEN(E), sizeof(double));
    if (!s->e_score_correction_bias || !s->demand || !s->kept || !s->qb_accum || !s->prev_delta ||
        !s->history || !s->reduce_buf) {
        lm_router_state_free(s);
        return lm_errorf(err, LM_ERR_NOMEM, "router: out of memory for the state of %d experts", E);
    }
    return LM_OK;
}

void lm_router_state_free(lm_router_state *s) {
    if (!s)
        return;
    free(s->e_score_correction_bias);
    free(s->demand);
    free(s->kept);
    free(s->qb_accum);
    free(s->prev_delta);
    free(s->history);
    free(s->reduce_buf);
    memset(s, 0, sizeof(*s));
}

void lm_route_free(lm_route *r) {
    if (!r)
        return;
    free(r->topk_idx);
    free(r->topk_weight);
    free(r->keep);
    free(r->scores);
    if (r->priv) {
        free(r->priv->cu);
        free(r->priv->sel);
        free(r->priv->qb);
        free(r->priv->cap);
        free(r->priv->aux);
        free(r->priv->cnt);
        free(r->priv->coef);
        free(r->priv->ds);
        free(r->priv);
    }
    memset(r, 0, sizeof(*r));
}

/* Grow-only scratch buffer. */
static void *grow(void **p, size_t *cap, size_t bytes) {
    if (*cap < bytes || !*p) {
        free(*p);
        *p = LM_MALLOC(bytes);
        *cap = bytes;
    }
    return *p;
}

/* ---------------------------------------------------------------- selection */

/* Insert (key, id) into keys[0..*n) kept in descending order, capacity cap. Ids
 * arrive in ascending order and an equal key goes after the ones already there, so
 * ties go to the lower id. ids may be NULL (value-only selection). */
static inline void topk_push(float *keys, int *ids, int *n, int cap, float key, int id) {
    int m = *n;
    if (m == cap) {
        if (!(key > keys[cap - 1]))
            return;
        m = cap - 1;
    } else {
        (*n)++;
    }
    int p = m;
    while (p > 0 && key > keys[p - 1]) {
        keys[p] = keys[p - 1];
        if (ids)
            ids[p] = ids[p - 1];
        p--;
    }
    keys[p] = key;
    if (ids)
        ids[p] = id;
}

/* Top-kk of key[0..E) into tk/tid (descending, ties to the lower id), given a
 * threshold thr such that at least kk keys are >= thr: every key < thr is then
 * strictly below the kk-th largest and can be skipped. Returns kk. tk and tid
 * need kk + 1 entries, cand[E] is scratch, tid may be NULL (values only).
 * Branch-free where it matters (a branchy selection mispredicts on most compares
 * with random scores): the survivors are gathered in ascending id order from a bit
 * mask, then
 * each survivor's rank = #{larger} + #{equal with a lower id}; ranks are distinct,
 * and the ones below kk land in their slot (the others in slot kk). */
static int topk_from_thr(const float *key, int E, int kk, float thr, float *tk, int *tid,
                         int *cand) {
    int nc = 0;
    for (int e0 = 0; e0 < E; e0 += 64) { /* a bit mask per 64 keys, then its set bits */
        const int n = E - e0 < 64 ? E - e0 : 64;
        uint64_t msk = 0;
        for (int i = 0; i < n; i++)
            msk |= (uint64_t)(key[e0 + i] >= thr) << i;
        while (msk) {
            cand[nc++] = e0 + __builtin_ctzll(msk);
            msk &= msk - 1;
        }
    }
    if (nc <= 64) {
        float cv[64];
        for (int i = 0; i < nc; i++)
            cv[i] = key[cand[i]];
        for (int i = 0; i < nc; i++) {
            const float x = cv[i];
            int r = 0;
            for (int j = 0; j < i; j++)
                r += cv[j] >= x;
            for (int j = i + 1; j < nc; j++)
                r += cv[j] > x;
            const int slot = r < kk ? r : kk;
            tk[slot] = x;
            if (tid)
                tid[slot] = cand[i];
        }
        return kk;
    }
    int n = 0;
    for (int i = 0; i < nc; i++)
        topk_push(tk, tid, &n, kk, key[cand[i]], cand[i]);
    return n;
}

/* Top-kk of key[0..E) as topk_from_thr. When kk is small against E the threshold
 * is the smallest of kk disjoint group maxima (kk distinct keys reach it);
 * otherwise -inf (every key survives). tk and tid need kk + 1 entries. */
static int topk_keys(const float *key, int E, int kk, float *tk, int *tid, int *cand) {
    float thr = -INFINITY;
    if (kk * 4 <= E) {
        /* group c = {e : e mod kk == c}: kk independent running maxima */
        for (int c = 0; c < kk; c++)
            tk[c] = key[c];
        int e0 = kk;
        for (; e0 + kk <= E; e0 += kk)
            for (int c = 0; c < kk; c++)
                tk[c] = key[e0 + c] > tk[c] ? key[e0 + c] : tk[c];
        for (int c = 0; e0 + c < E; c++)
            tk[c] = key[e0 + c] > tk[c] ? key[e0 + c] : tk[c];
        thr = tk[0];
        for (int c = 1; c < kk; c++)
            thr = tk[c] < thr ? tk[c] : thr;
    }
    return topk_from_thr(key, E, kk, thr, tk, tid, cand);
}

/* Per-thread selection scratch: the token's keys, candidates, the top-(k+1)
 * keys/ids and the group arrays. */
typedef struct {
    float *key;           /* [E] */
    int *cand;            /* [E] */
    float *keys;          /* [k+2] */
    int *ids;             /* [k+2] */
    float *gkeys;         /* [ng+1] */
    int *gids;            /* [ng+1] */
    unsigned char *gmask; /* [ng+1] */
} sel_scratch;

static size_t sel_bytes(int E, int k, int ng) {
    size_t b = 0;
    b += (sizeof(float) + sizeof(int)) * (size_t)E;
    b += (sizeof(float) + sizeof(int)) * (size_t)(k + 2);
    b += (sizeof(float) + sizeof(int) + 1) * (size_t)(ng + 1);
    return (b + 63) & ~(size_t)63;
}

static sel_scratch sel_carve(void *base, int E, int k, int ng) {
    sel_scratch s;
    char *p = base;
    s.key = (float *)p;
    p += sizeof(float) * (size_t)E;
    s.cand = (int *)p;
    p += sizeof(int) * (size_t)E;
    s.keys = (float *)p;
    p += sizeof(float) * (size_t)(k + 2);
    s.ids = (int *)p;
    p += sizeof(int) * (size_t)(k + 2);
    s.gkeys = (float *)p;
    p += sizeof(float) * (size_t)(ng + 1);
    s.gids = (int *)p;
    p += sizeof(int) * (size_t)(ng + 1);
    s.gmask = (unsigned char *)p;
    return s;
}

/* Scores of one token: sigmoid (element-wise) or softmax over all E, fp32. */
static void token_scores(lm_score_func f, const float *lg, int E, float *s) {
    if (f == LM_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++)
            s[e] = 1.0f / (1.0f + expf(-lg[e]));
    } else {
        float mx = lg[0];
        for (int e = 1; e < E; e++)
            mx = lg[e] > mx ? lg[e] : mx;
        double sum = 0.0;
        for (int e = 0; e < E; e++) {
            s[e] = expf(lg[e] - mx);
            sum += s[e];
        }
        const double inv = 1.0 / sum;
        for (int e = 0; e < E; e++)
            s[e] = (float)(s[e] * inv);
    }
}

/* Top-k of key = s + bias for one token (group-limited when n_group > 1); writes
 * idx[0..k) in descending key order. */
static void token_select(const lm_router_config *c, const float *s, const float *bias,
                         sel_scratch *w, int64_t *idx) {
    const int E = c->num_experts, k = c->num_experts_per_tok;
    float *key = w->key;
    if (bias)
        for (int e = 0; e < E; e++)
            key[e] = s[e] + bias[e];
    else
        memcpy(key, s, sizeof(float) * (size_t)E);
    int n = 0;
    if (c->n_group > 1) {
        const int ng = c->n_group, gsz = E / ng;
        int gn = 0;
        for (int g = 0; g < ng; g++) {
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int e = g * gsz; e < (g + 1) * gsz; e++) {
                if (key[e] > m1) {
                    m2 = m1;
                    m1 = key[e];
                } else if (key[e] > m2) {
                    m2 = key[e];
                }
            }
            topk_push(w->gkeys, w->gids, &gn, c->topk_group, gsz >= 2 ? m1 + m2 : m1, g);
        }
        memset(w->gmask, 0, (size_t)ng);
        for (int i = 0; i < gn; i++)
            w->gmask[w->gids[i]] = 1;
        for (int g = 0; g < ng; g++) {
            if (!w->gmask[g])
                continue;
            for (int e = g * gsz; e < (g + 1) * gsz; e++)
                topk_push(w->keys, w->ids, &n, k, key[e], e);
        }
    } else {
        n = topk_keys(key, E, k, w->keys, w->ids, w->cand);
    }
    LM_CHECK(n == k);
    for (int j = 0; j < k; j++)
        idx[j] = w->ids[j];
}

/* ---------------------------------------------------------------- quantile solve */

/* Value at position q (0-based) of src[0..n) sorted in descending order (src is
 * not modified; values must be finite). Quickselect whose partition writes every
 * element to both ends of an output buffer and advances one end (no data-dependent
 * branch: on random data a branchy partition mispredicts about half its compares);
 * a and b [n] are the ping-pong buffers. */
static float select_desc(const float *src, int n, int q, float *a, float *b) {
    const float *in = src;
    float *bufs[2] = {a, b};
    int which = 0;
    for (;;) {
        if (n <= 16) {
            float v[16] = {0};
            for (int i = 0; i < n; i++) {
                const float x = in[i];
                int p = i;
                while (p > 0 && x > v[p - 1]) {
                    v[p] = v[p - 1];
                    p--;
                }
                v[p] = x;
            }
            return v[q];
        }
        float piv;
        if (n >= 1024) {
            /* large ranges: the pivot is the sample at the target's rank among 31
             * evenly spaced samples, so the first pass already cuts close to q */
            float v[31];
            for (int i = 0; i < 31; i++) {
                const float x = in[(int64_t)(2 * i + 1) * n / 62];
                int p = i;
                while (p > 0 && x > v[p - 1]) {
                    v[p] = v[p - 1];
                    p--;
                }
                v[p] = x;
            }
            piv = v[(int)((int64_t)q * 31 / n)];
        } else {
            const float x0 = in[0], x1 = in[n / 2], x2 = in[n - 1];
            if ((x0 >= x1) == (x1 >= x2))
                piv = x1;
            else if ((x1 >= x0) == (x0 >= x2))
                piv = x0;
            else
                piv = x2;
        }
        float *out = bufs[which];
        which ^= 1;
        int g = 0, l = n - 1;
        for (int i = 0; i < n; i++) {
            const float x = in[i];
            const int c = x > piv;
            out[g] = x;
            out[l] = x;
            g += c;
            l -= 1 - c;
        }
        /* out[0..g) > piv >= out[g..n) */
        if (q < g) {
            in = out;
            n = g;
        } else if (g > 0) {
            in = out + g;
            n -= g;
            q -= g;
        } else {
            /* piv is the maximum: split off the copies of it */
            int eq = 0;
            for (int i = 0; i < n; i++)
                eq += out[i] == piv;
            if (q < eq)
                return piv;
            float *o2 = bufs[which];
            which ^= 1;
            int m = 0;
            for (int i = 0; i < n; i++) {
                o2[m] = out[i];
                m += out[i] < piv;
            }
            in = o2;
            n = m;
            q -= eq;
        }
    }
}

/* Column step for one expert: beta = the (q+1)-th largest margin m_t = col_t -
 * alpha_t (Megatron's dual) and mid = the midpoint between beta and the q-th largest
 * margin when exactly q margins exceed beta (else beta: ties). Bracketed fast path:
 * one fused pass counts the margins above hi_p, keeps their minimum, and compacts
 * those in (lo_p, hi_p] into buf; when the target rank falls inside, a small select
 * finishes (the same value as a full select, so results do not depend on whether
 * the bracket hit). Returns 0 when it missed; the caller then runs the full path. */
static int col_step_bracket(const float *col, const float *alpha, int T, int q, float lo_p,
                            float hi_p, float *buf, float *ba, float *bb, float *beta,
                            double *mid) {
    int nhi = 0, nmid = 0;
    float minhi = INFINITY;
    for (int t = 0; t < T; t++) {
        const float x = col[t] - alpha[t];
        const int hi = x > hi_p, md = (x > lo_p) & !hi;
        nhi += hi;
        minhi = (hi & (x < minhi)) ? x : minhi;
        buf[nmid] = x;
        nmid += md;
    }
    if (q < nhi || q >= nhi + nmid)
        return 0;
    const float bj = select_desc(buf, nmid, q - nhi, ba, bb);
    int above = nhi;
    float lo = minhi;
    for (int i = 0; i < nmid; i++) {
        const int a = buf[i] > bj;
        above += a;
        lo = (a & (buf[i] < lo)) ? buf[i] : lo;
    }
    *beta = bj;
    *mid = (q > 0 && above == q) ? 0.5 * ((double)bj + lo) : bj;
    return 1;
}

/* The full column step (same outputs as col_step_bracket). */
static void col_step_full(const float *col, const float *alpha, int T, int q, float *m, float *ba,
                          float *bb, float *beta, double *mid) {
    for (int t = 0; t < T; t++)
        m[t] = col[t] - alpha[t];
    const float bj = select_desc(m, T, q, ba, bb);
    int above = 0;
    float lo = INFINITY; /* the smallest margin above beta_j */
    for (int t = 0; t < T; t++) {
        const int a = m[t] > bj;
        above += a;
        lo = (a & (m[t] < lo)) ? m[t] : lo;
    }
    *beta = bj;
    *mid = (q > 0 && above == q) ? 0.5 * ((double)bj + lo) : bj;
}

/* Scratch of qb_solve: mid[E] (fp64), alpha[T], ST[E*T] (scores transposed),
 * bcur[E], dprev[E] (last change of beta), top[T*(k+1)] (each token's top-(k+1)
 * experts of the last alternation), and per thread: key[E], cand[E], tk[k+2],
 * tid[k+2], m/a/b [T] each. */
static size_t qb_thread_floats(int T, int E, int k) {
    return 2 * (size_t)E + 2 * ((size_t)k + 2) + 3 * (size_t)T + 16;
}
static size_t qb_bytes(int T, int E, int k, int nt) {
    return sizeof(double) * (size_t)E +
           sizeof(float) * ((size_t)T + (size_t)E * T + 2 * (size_t)E + (size_t)T * (k + 1) +
                            (size_t)nt * qb_thread_floats(T, E, k)) +
           64;
}

/* qb_solve's shared state (carved from the caller's scratch) and one thread's
 * slice of it. */
typedef struct {
    const float *S;
    int T, E, k, q;
    float w0;
    double *mid;
    float *alpha, *ST, *bcur, *dprev, *beta;
    int *top;
} qb_state;

typedef struct {
    float *key, *tk, *m, *ba, *bb;
    int *cand, *tid;
} qb_thread;

static qb_thread qb_thread_carve(float *tw, int T, int E, int k) {
    qb_thread w;
    w.key = tw;
    w.tk = tw + 2 * (size_t)E;
    w.m = w.tk + 2 * ((size_t)k + 2);
    w.ba = w.m + T;
    w.bb = w.ba + T;
    w.cand = (int *)(tw + E);
    w.tid = (int *)(w.tk + k + 2);
    return w;
}

/* Transpose tokens [t0, t0 + 64) so each expert's column is contiguous. */
static void qb_transpose(const qb_state *q, int t0) {
    const int t1 = t0 + 64 < q->T ? t0 + 64 : q->T;
    for (int e = 0; e < q->E; e++)
        for (int t = t0; t < t1; t++)
            q->ST[(size_t)e * q->T + t] = q->S[(size_t)t * q->E + e];
}

/* Row multiplier of token t: alpha_t = (k+1)-th largest of s_t + b. After the first
 * alternation, the last top-(k+1) set under the new bias gives the threshold (its
 * smallest new key: k+1 keys reach it), which leaves only a few candidates. */
static void qb_alpha(const qb_state *q, const qb_thread *w, int it, int t) {
    const int E = q->E, k1 = q->k + 1;
    const float *s = q->S + (size_t)t * E;
    int *tp = q->top + (size_t)t * k1;
    for (int e = 0; e < E; e++)
        w->key[e] = s[e] + q->bcur[e];
    if (it == 0) {
        topk_keys(w->key, E, k1, w->tk, w->tid, w->cand);
    } else {
        float thr = w->key[tp[0]];
        for (int i = 1; i < k1; i++)
            thr = w->key[tp[i]] < thr ? w->key[tp[i]] : thr;
        topk_from_thr(w->key, E, k1, thr, w->tk, w->tid, w->cand);
    }
    memcpy(tp, w->tid, sizeof(int) * (size_t)k1);
    q->alpha[t] = w->tk[q->k];
}

/* Column multiplier of expert j: beta_j = (q+1)-th largest of s[:, j] - alpha; the
 * bias takes the midpoint between it and the q-th largest (see the header). From the
 * second alternation on, the last beta_j brackets the new one. */
static void qb_beta(const qb_state *q, const qb_thread *w, int it, int j) {
    const float *col = q->ST + (size_t)j * q->T;
    const float prev = it > 0 ? q->beta[j] : 0.0f;
    int hit = 0;
    if (it > 0) {
        const float wd = fmaxf(q->w0, 2.0f * q->dprev[j]);
        hit = col_step_bracket(col, q->alpha, q->T, q->q, prev - wd, prev + wd, w->m, w->ba, w->bb,
                               &q->beta[j], &q->mid[j]);
    }
    if (!hit)
        col_step_full(col, q->alpha, q->T, q->q, w->m, w->ba, w->bb, &q->beta[j], &q->mid[j]);
    q->dprev[j] = it > 0 ? fabsf(q->beta[j] - prev) : 0.0f;
}

/* b = -mid, centred. */
static void qb_centre(const qb_state *q) {
    double mean = 0.0;
    for (int j = 0; j < q->E; j++)
        mean += -q->mid[j];
    mean /= q->E;
    for (int j = 0; j < q->E; j++)
        q->bcur[j] = (float)(-q->mid[j] - mean);
}

/* The alternations of lm_router_quantile_solve on caller scratch (qb_bytes). Small
 * problems run as plain loops, outside any OpenMP region (a one-thread region still
 * enters the runtime, which allocates a team for it), in the order one thread of the
 * parallel version runs them. */
static void qb_solve(const lm_router_config *c, const float *S, int T, const float *bias, int iters,
                     float *beta, float *b_centred, void *scratch, int nt) {
    const int E = c->num_experts, k = c->num_experts_per_tok, k1 = k + 1;
    qb_state st;
    st.S = S;
    st.T = T;
    st.E = E;
    st.k = k;
    st.beta = beta;
    st.mid = scratch; /* first: the scratch is malloc-aligned */
    st.alpha = (float *)(st.mid + E);
    st.ST = st.alpha + T;
    st.bcur = st.ST + (size_t)E * T;
    st.dprev = st.bcur + E;
    st.top = (int *)(st.dprev + E);
    float *tbase = (float *)(st.top + (size_t)T * k1);
    const size_t tf = qb_thread_floats(T, E, k);
    int q = (int)llround((double)T * k / E);
    if (q > T - 1)
        q = T - 1;
    if (q < 0)
        q = 0;
    st.q = q;
    /* bracket half-width floor: margins lie in (-1, 1) (scores in (0, 1)), so
     * 32/T holds some tens of margins around the target at typical densities */
    st.w0 = 32.0f / (float)T;
    for (int e = 0; e < E; e++)
        st.bcur[e] = bias ? bias[e] : 0.0f;
    const qb_state *qs = &st;
    if ((int64_t)T * E >= ROUTER_PAR_MIN) {
#pragma omp parallel num_threads(nt)
        {
            const qb_thread w = qb_thread_carve(tbase + tf * (size_t)omp_get_thread_num(), T, E, k);
#pragma omp for schedule(static)
            for (int t0 = 0; t0 < T; t0 += 64)
                qb_transpose(qs, t0);
            for (int it = 0; it < iters; it++) {
#pragma omp for schedule(static)
                for (int t = 0; t < T; t++)
                    qb_alpha(qs, &w, it, t);
#pragma omp for schedule(dynamic, 1)
                for (int j = 0; j < E; j++)
                    qb_beta(qs, &w, it, j);
#pragma omp single
                qb_centre(qs);
            }
        }
    } else {
        const qb_thread w = qb_thread_carve(tbase, T, E, k);
        for (int t0 = 0; t0 < T; t0 += 64)
            qb_transpose(qs, t0);
        for (int it = 0; it < iters; it++) {
            for (int t = 0; t < T; t++)
                qb_alpha(qs, &w, it, t);
            for (int j = 0; j < E; j++)
                qb_beta(qs, &w, it, j);
            qb_centre(qs);
        }
    }
    if (b_centred)
        memcpy(b_centred, st.bcur, sizeof(float) * (size_t)E);
}

lm_status lm_router_quantile_solve(const lm_router_config *c, const float *scores, int T,
                                   const float *bias, int iters, float *beta, float *b_centred,
                                   lm_error *err) {
    LM_TRY(lm_router_config_validate(c, err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (k >= E)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: quantile solve needs num_experts_per_tok = %d < num_experts = %d",
                         k, E);
    if (T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "router: quantile solve needs T = %d >= 1", T);
    if (iters < 1)
        return lm_errorf(err, LM_ERR_INVALID, "router: quantile solve iters = %d must be >= 1",
                         iters);
    if (!scores || !beta)
        return lm_errorf(err, LM_ERR_INVALID, "router: quantile solve needs scores and beta");
    for (int64_t i = 0; i < (int64_t)T * E; i++)
        if (!isfinite(scores[i]))
            return lm_errorf(err, LM_ERR_NONFINITE,
                             "router: quantile solve: scores[t=%lld, expert=%d] = %g is not finite",
                             (long long)(i / E), (int)(i % E), (double)scores[i]);
    if (bias)
        for (int e = 0; e < E; e++)
            if (!isfinite(bias[e]))
                return lm_errorf(err, LM_ERR_NONFINITE, "router: bias[%d] = %g is not finite", e,
                                 (double)bias[e]);
    const int nt = omp_get_max_threads();
    void *scr = LM_MALLOC(qb_bytes(T, E, k, nt));
    qb_solve(c, scores, T, bias, iters, beta, b_centred, scr, nt);
    free(scr);
    return LM_OK;
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    float s;
    int32_t a; /* assignment t*k + j */
} cap_item;

/* x goes before y: higher score first, then the lower assignment (a total order:
 * assignments are distinct, scores finite). */
static inline int cap_item_before(const cap_item *x, const cap_item *y) {
    return x->s > y->s || (x->s == y->s && x->a < y->a);
}

static void cap_sift_down(cap_item *v, int64_t i, int64_t n) {
    for (;;) {
        int64_t m = i;
        const int64_t l = 2 * i + 1, r = l + 1;
        if (l < n && cap_item_before(&v[m], &v[l]))
            m = l;
        if (r < n && cap_item_before(&v[m], &v[r]))
            m = r;
        if (m == i)
            return;
        const cap_item t = v[i];
        v[i] = v[m];
        v[m] = t;
        i = m;
    }
}

/* Sort v[0..n) into cap_item_before order in place: a heap sort, so no allocation
 * (glibc's qsort takes a malloc'd merge buffer past 1 KiB). The order is total, so
 * the result is the one any correct sort gives. */
static void cap_items_sort(cap_item *v, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; i--)
        cap_sift_down(v, i, n);
    for (int64_t end = n - 1; end > 0; end--) {
        const cap_item t = v[0];
        v[0] = v[end];
        v[end] = t;
        cap_sift_down(v, 0, end);
    }
}

/* Token dropping by capacity C per expert; sets keep[] and the drop counters.
 * counts[E] are the pre-capacity selections. kept_out[E] (may be NULL) gets the
 * post-capacity counts. */
static void apply_capacity(const lm_router_config *c, lm_route *r, const int64_t *counts, int64_t C,
                           int64_t *kept_out) {
    const int E = r->E, k = r->k, T = r->T;
    const int64_t nA = (int64_t)T * k;
    int64_t over = 0;
    for (int e = 0; e < E; e++)
        over += counts[e] > C;
    if (kept_out)
        for (int e = 0; e < E; e++)
            kept_out[e] = counts[e] < C ? counts[e] : C;
    /* the scratch is taken on the first call, overflow or not, so that a later step's
     * first overflow does not allocate */
    struct lm_route_priv *pv = r->priv;
    size_t bytes = sizeof(int64_t) * (size_t)(E + 1) + sizeof(cap_item) * (size_t)nA;
    char *base = grow(&pv->cap, &pv->cap_cap, bytes);
    if (!over)
        return;
    /* Bucket the assignments by expert, in token order (a counting sort). */
    int64_t *off = (int64_t *)base;
    cap_item *items = (cap_item *)(base + sizeof(int64_t) * (size_t)(E + 1));
    off[0] = 0;
    for (int e = 0; e < E; e++)
        off[e + 1] = off[e] + counts[e];
    for (int e = 0; e < E; e++)
        off[e] = off[e + 1] - counts[e]; /* fill cursor = start */
    for (int64_t a = 0; a < nA; a++) {
        const int e = (int)r->topk_idx[a];
        const int64_t t = a / k;
        items[off[e]].s = r->scores[t * E + e];
        items[off[e]].a = (int32_t)a;
        off[e]++;
    }
    /* off[e] is now the end of expert e's bucket */
    for (int e = 0; e < E; e++) {
        if (counts[e] <= C)
            continue;
        cap_item *b = items + (off[e] - counts[e]);
        if (c->drop_policy == LM_DROP_PROBS)
            cap_items_sort(b, counts[e]);
        for (int64_t i = C; i < counts[e]; i++) {
            r->keep[b[i].a] = 0;
            r->n_dropped_assign++;
        }
    }
    for (int t = 0; t < T; t++) {
        int lost = 0;
        for (int j = 0; j < k; j++)
            lost |= r->keep[(int64_t)t * k + j] == 0;
        r->n_dropped_tokens += lost;
    }
}

/* Aux loss of the route (reference/moe.md §1.1, §2): alpha * sum_i f_i P_i per
 * sequence of priv->cu, mean over the non-empty sequences. */
static double aux_loss_value(const lm_router_config *c, const lm_route *r) {
    const int E = r->E, k = r->k;
    struct lm_route_priv *pv = r->priv;
    double *P = grow(&pv->aux, &pv->aux_cap, sizeof(double) * (size_t)E * 2), *cnt = P + E;
    memset(P, 0, sizeof(double) * (size_t)E * 2);
    double total = 0.0;
    int nne = 0;
    for (int n = 0; n + 1 < pv->n_cu; n++) {
        const int64_t b0 = pv->cu[n], b1 = pv->cu[n + 1], Tn = b1 - b0;
        if (Tn <= 0)
            continue;
        memset(P, 0, sizeof(double) * (size_t)E * 2);
        for (int64_t t = b0; t < b1; t++) {
            const float *s = r->scores + t * E;
            if (c->scoring_func == LM_SCORE_SIGMOID) {
                double S = 0.0;
                for (int e = 0; e < E; e++)
                    S += s[e];
                const double inv = 1.0 / (S + ROUTER_DENOM_EPS);
                for (int e = 0; e < E; e++)
                    P[e] += s[e] * inv;
            } else {
                for (int e = 0; e < E; e++)
                    P[e] += s[e];
            }
            for (int j = 0; j < k; j++)
                cnt[r->topk_idx[t * k + j]] += 1.0;
        }
        double l = 0.0;
        for (int e = 0; e < E; e++)
            l += ((double)E / ((double)k * Tn) * cnt[e]) * (P[e] / Tn);
        total += (double)c->aux_loss_alpha * l;
        nne++;
    }
    return nne ? total / nne : 0.0;
}

static lm_status prepare_route(lm_route *r, int T, int E, int k) {
    if (!r->priv)
        r->priv = LM_CALLOC(1, sizeof(struct lm_route_priv));
    /* grow-only: a smaller batch reuses the arrays */
    if (r->E != E || r->k != k || T > r->priv->tok_cap || !r->topk_idx || !r->topk_weight ||
        !r->keep || !r->scores) {
        free(r->topk_idx);
        free(r->topk_weight);
        free(r->keep);
        free(r->scores);
        r->topk_idx = LM_MALLOC(sizeof(int64_t) * (size_t)T * k);
        r->topk_weight = LM_MALLOC(sizeof(float) * (size_t)T * k);
        r->keep = LM_MALLOC((size_t)T * k);
        r->scores = LM_MALLOC(sizeof(float) * (size_t)T * E);
        r->priv->tok_cap = T;
    }
    r->T = T, r->E = E, r->k = k;
    r->aux_loss = 0.0f;
    r->capacity = 0;
    r->n_dropped_assign = r->n_dropped_tokens = 0;
    return LM_OK;
}

/* Token t of the forward: scores, selection, gate weights (w: this thread's
 * selection scratch). */
static void route_token(const lm_router_config *c, const float *logits, const float *bias,
                        lm_route *out, sel_scratch *w, double scale, int norm, int t) {
    const int E = out->E, k = out->k;
    float *s = out->scores + (size_t)t * E;
    int64_t *idx = out->topk_idx + (size_t)t * k;
    float *wt = out->topk_weight + (size_t)t * k;
    token_scores(c->scoring_func, logits + (size_t)t * E, E, s);
    token_select(c, s, bias, w, idx);
    double Z = 0.0;
    for (int j = 0; j < k; j++)
        Z += s[idx[j]];
    const double mul = norm ? scale / (Z + ROUTER_DENOM_EPS) : scale;
    for (int j = 0; j < k; j++)
        wt[j] = (float)(s[idx[j]] * mul);
    memset(out->keep + (size_t)t * k, 1, (size_t)k);
}

lm_status lm_router_forward(const lm_router_config *c, lm_router_state *st, const float *logits,
                            int T, const int64_t *cu_seqlens, int n_cu, int training, lm_route *out,
                            lm_error *err) {
    LM_TRY(lm_router_config_validate(c, err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "router: output route is required");
    if (T < 0)
        return lm_errorf(err, LM_ERR_INVALID, "router: T = %d tokens must be >= 0", T);
    if ((int64_t)T * (E > k ? E : k) > ((int64_t)1 << 31) - 1)
        return lm_errorf(err, LM_ERR_INVALID, "router: T = %d x num_experts = %d is too large", T,
                         E);
    if (T > 0 && !logits)
        return lm_errorf(err, LM_ERR_INVALID, "router: logits are required");
    if (training && !st)
        return lm_errorf(err, LM_ERR_INVALID, "router: training needs a router state");
    if (st && st->E != E)
        return lm_errorf(err, LM_ERR_INVALID, "router: state has %d experts but num_experts = %d",
                         st->E, E);
    const float *bias = st ? st->e_score_correction_bias : NULL;
    if (st && !bias)
        return lm_errorf(err, LM_ERR_INVALID, "router: state is not initialised");
    if (bias)
        for (int e = 0; e < E; e++)
            if (!isfinite(bias[e]))
                return lm_errorf(err, LM_ERR_NONFINITE,
                                 "router: e_score_correction_bias[%d] = %g is not finite", e,
                                 (double)bias[e]);
    if (cu_seqlens) {
        if (n_cu < 2)
            return lm_errorf(err, LM_ERR_INVALID, "router: cu_seqlens has %d entries (need >= 2)",
                             n_cu);
        if (cu_seqlens[0] != 0)
            return lm_errorf(err, LM_ERR_INVALID, "router: cu_seqlens[0] = %lld (must be 0)",
                             (long long)cu_seqlens[0]);
        for (int i = 1; i < n_cu; i++)
            if (cu_seqlens[i] < cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "router: cu_seqlens decreases at index %d (%lld < %lld)", i,
                                 (long long)cu_seqlens[i], (long long)cu_seqlens[i - 1]);
        if (cu_seqlens[n_cu - 1] != T)
            return lm_errorf(err, LM_ERR_INVALID, "router: cu_seqlens ends at %lld, not at T = %d",
                             (long long)cu_seqlens[n_cu - 1], T);
    }
    for (int64_t i = 0; i < (int64_t)T * E; i++)
        if (!isfinite(logits[i]))
            return lm_errorf(err, LM_ERR_NONFINITE,
                             "router: logits[token %lld, expert %d] = %g is not finite",
                             (long long)(i / E), (int)(i % E), (double)logits[i]);

    LM_TRY(prepare_route(out, T, E, k));
    struct lm_route_priv *pv = out->priv;
    /* sequence bounds for the aux loss (batch-wise: one sequence) */
    const int seqwise = c->aux_loss_seq && cu_seqlens;
    const int ncu = seqwise ? n_cu : 2;
    /* sequence-wise aux loss: room for T + 1 bounds (every document non-empty), so that
     * the packing of later batches does not make it grow */
    const int ncu_cap = c->aux_loss_seq && ncu < T + 1 ? T + 1 : ncu;
    int64_t *cu = grow((void **)&pv->cu, &pv->cu_cap, sizeof(int64_t) * (size_t)ncu_cap);
    if (seqwise)
        memcpy(cu, cu_seqlens, sizeof(int64_t) * (size_t)ncu);
    else
        cu[0] = 0, cu[1] = T;
    pv->n_cu = ncu;
    if (T == 0)
        return LM_OK;

    /* scores, selection, weights: per token, in parallel */
    const int nt = omp_get_max_threads();
    const int ng = c->n_group > 1 ? c->n_group : 1;
    const size_t sb = sel_bytes(E, k, ng);
    char *selbase = grow(&pv->sel, &pv->sel_cap, sb * (size_t)nt);
    const int par = (int64_t)T * E >= ROUTER_PAR_MIN;
    const double scale = c->routed_scaling_factor;
    const int norm = c->norm_topk_prob && k > 1;
    if (par) {
#pragma omp parallel num_threads(nt)
        {
            sel_scratch w = sel_carve(selbase + sb * (size_t)omp_get_thread_num(), E, k, ng);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                route_token(c, logits, bias, out, &w, scale, norm, t);
        }
    } else {
        sel_scratch w = sel_carve(selbase, E, k, ng);
        for (int t = 0; t < T; t++)
            route_token(c, logits, bias, out, &w, scale, norm, t);
    }

    /* pre-capacity demand */
    int64_t *counts = grow(&out->priv->cnt, &out->priv->cnt_cap, sizeof(int64_t) * (size_t)E * 2);
    int64_t *kept = counts + E;
    memset(counts, 0, sizeof(int64_t) * (size_t)E * 2);
    for (int64_t a = 0; a < (int64_t)T * k; a++)
        counts[out->topk_idx[a]]++;
    for (int e = 0; e < E; e++)
        kept[e] = counts[e];
    if (training && c->capacity_factor > 0.0f) {
        double cd = ceil((double)T * k / E * (double)c->capacity_factor);
        out->capacity = cd >= T ? T : (int64_t)cd;
        apply_capacity(c, out, counts, out->capacity, kept);
    }
    if (c->balance == LM_BAL_AUX_LOSS)
        out->aux_loss = (float)aux_loss_value(c, out);

    if (training) {
        for (int e = 0; e < E; e++) {
            st->demand[e] += (double)counts[e];
            st->kept[e] += (double)kept[e];
        }
        st->tokens += T;
        st->dropped_assign += out->n_dropped_assign;
        st->dropped_tokens += out->n_dropped_tokens;
        st->aux_loss_sum += out->aux_loss;
        st->n_micro++;
        if (c->balance == LM_BAL_QUANTILE) {
            void *scr = grow(&pv->qb, &pv->qb_cap, qb_bytes(T, E, k, nt) + sizeof(float) * 2 * E);
            float *beta = (float *)((char *)scr + qb_bytes(T, E, k, nt));
            float *bc = beta + E;
            qb_solve(c, out->scores, T, bias, c->quantile_iters, beta, bc, scr, nt);
            for (int e = 0; e < E; e++)
                st->qb_accum[e] += bc[e];
            st->qb_count++;
        }
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

/* The backward's operands (lm_router_backward). */
typedef struct {
    const lm_route *r;
    const float *dtopk_weight;
    float *dlogits;
    const double *coef; /* aux-loss coefficients [nseq, E], or NULL */
    int nseq;
    double scale;
    int norm, sig;
} bwd_args;

/* Token t of the backward (ds: this thread's [E] fp64 scratch). */
static void backward_token(const bwd_args *a, double *ds, int t) {
    const lm_route *r = a->r;
    const struct lm_route_priv *pv = r->priv;
    const int E = r->E, k = r->k, nseq = a->nseq, norm = a->norm, sig = a->sig;
    const double scale = a->scale, *coef = a->coef;
    const float *dtopk_weight = a->dtopk_weight;
    float *dlogits = a->dlogits;
    const float *s = r->scores + (size_t)t * E;
    const int64_t *idx = r->topk_idx + (size_t)t * k;
    const uint8_t *keep = r->keep + (size_t)t * k;
    float *dl = dlogits + (size_t)t * E;
    for (int e = 0; e < E; e++)
        ds[e] = 0.0;
    /* gate weights: w_j = scale * s_j / (Z + eps) (or scale * s_j) */
    if (dtopk_weight) {
        const float *dw = dtopk_weight + (size_t)t * k;
        if (norm) {
            double Z = 0.0, A = 0.0;
            for (int j = 0; j < k; j++) {
                const double sj = s[idx[j]];
                Z += sj;
                A += keep[j] ? dw[j] * sj : 0.0;
            }
            Z += ROUTER_DENOM_EPS;
            const double a2 = A / (Z * Z);
            for (int j = 0; j < k; j++)
                ds[idx[j]] += scale * ((keep[j] ? dw[j] : 0.0) / Z - a2);
        } else {
            for (int j = 0; j < k; j++)
                if (keep[j])
                    ds[idx[j]] += scale * dw[j];
        }
    }
    /* aux loss through P: s' = s / (sum s + eps) (sigmoid) or s (softmax) */
    if (coef) {
        int lo = 0, hi = nseq - 1; /* sequence n with cu[n] <= t < cu[n+1] */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (pv->cu[mid] <= t)
                lo = mid;
            else
                hi = mid - 1;
        }
        const double *cf = coef + (size_t)lo * E;
        if (sig) {
            double S = 0.0, B = 0.0;
            for (int e = 0; e < E; e++) {
                S += s[e];
                B += cf[e] * s[e];
            }
            S += ROUTER_DENOM_EPS;
            B /= S;
            for (int e = 0; e < E; e++)
                ds[e] += (cf[e] - B) / S;
        } else {
            for (int e = 0; e < E; e++)
                ds[e] += cf[e];
        }
    }
    if (sig) {
        for (int e = 0; e < E; e++)
            dl[e] = (float)(ds[e] * s[e] * (1.0 - (double)s[e]));
    } else {
        double D = 0.0;
        for (int e = 0; e < E; e++)
            D += ds[e] * s[e];
        for (int e = 0; e < E; e++)
            dl[e] = (float)(s[e] * (ds[e] - D));
    }
}

lm_status lm_router_backward(const lm_router_config *c, const lm_route *r,
                             const float *dtopk_weight, float *dlogits, lm_error *err) {
    LM_TRY(lm_router_config_validate(c, err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (!r)
        return lm_errorf(err, LM_ERR_INVALID, "router: route is required");
    if (r->E != E || r->k != k)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: route has E = %d, k = %d but the config has num_experts = %d, "
                         "num_experts_per_tok = %d",
                         r->E, r->k, E, k);
    const int T = r->T;
    if (T == 0)
        return LM_OK;
    if (!r->priv || !r->scores || !r->topk_idx || !r->keep)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router: route was not produced by lm_router_forward");
    if (!dlogits)
        return lm_errorf(err, LM_ERR_INVALID, "router: dlogits is required");
    if (dtopk_weight)
        for (int64_t i = 0; i < (int64_t)T * k; i++)
            if (!isfinite(dtopk_weight[i]))
                return lm_errorf(err, LM_ERR_NONFINITE,
                                 "router: dtopk_weight[token %lld, slot %d] = %g is not finite",
                                 (long long)(i / k), (int)(i % k), (double)dtopk_weight[i]);

    /* aux-loss coefficients d(aux)/d(s'_ti) = alpha * f_i / (T_n * n_nonempty), per sequence */
    struct lm_route_priv *pv = r->priv; /* scratch only; the route's results are not changed */
    const int nseq = pv->n_cu - 1;
    double *coef = NULL;
    if (c->balance == LM_BAL_AUX_LOSS && c->aux_loss_alpha > 0.0f) {
        /* sequence-wise: room for T sequences (see the forward's cu) */
        const int64_t ncap = c->aux_loss_seq && nseq < T ? T : (nseq > 0 ? nseq : 1);
        coef = grow(&pv->coef, &pv->coef_cap, sizeof(double) * (size_t)ncap * E);
        memset(coef, 0, sizeof(double) * (size_t)(nseq > 0 ? nseq : 1) * E);
        int nne = 0;
        for (int n = 0; n < nseq; n++)
            nne += pv->cu[n + 1] > pv->cu[n];
        for (int n = 0; n < nseq; n++) {
            const int64_t b0 = pv->cu[n], b1 = pv->cu[n + 1], Tn = b1 - b0;
            if (Tn <= 0)
                continue;
            double *cf = coef + (size_t)n * E;
            for (int64_t a = b0 * k; a < b1 * k; a++)
                cf[r->topk_idx[a]] += 1.0;
            const double mul = (double)c->aux_loss_alpha * E / ((double)k * Tn * Tn * nne);
            for (int e = 0; e < E; e++)
                cf[e] *= mul;
        }
    }

    const int nt = omp_get_max_threads();
    double *dsall = grow(&pv->ds, &pv->ds_cap, sizeof(double) * (size_t)E * nt);
    const int par = (int64_t)T * E >= ROUTER_PAR_MIN;
    const double scale = c->routed_scaling_factor;
    const int norm = c->norm_topk_prob && k > 1;
    const int sig = c->scoring_func == LM_SCORE_SIGMOID;
    const bwd_args a = {r, dtopk_weight, dlogits, coef, nseq, scale, norm, sig};
    if (par) {
#pragma omp parallel num_threads(nt)
        {
            double *ds = dsall + (size_t)E * omp_get_thread_num();
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                backward_token(&a, ds, t);
        }
    } else {
        for (int t = 0; t < T; t++)
            backward_token(&a, dsall, t);
    }
    return LM_OK;
}
