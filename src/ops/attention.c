/* Attention op: configuration defaults, validation of every input before any math,
 * scratch and RoPE table management, the preparation shared by the tiled kernels
 * (document table, rotated and transposed copies, Delta), the KV-cache writer and
 * the decode step. The tiled forward / backward are in cpu/attention_fwd.c and
 * cpu/attention_bwd.c. Math and layouts: include/linmoe/attention.h. */
#include "linmoe/attention.h"

#include <math.h>
#include <omp.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ops/cpu/attention_cpu.h"
#include "ops/cpu/gemm_rowwise.h"
#include "ops/cpu/kda_internal.h" /* lm_fexp: the vectorisable fp32 exp shared with KDA */

void lm_attention_config_default(lm_attention_config *c, int B, int T, int Hq, int Hkv, int D) {
    memset(c, 0, sizeof(*c));
    c->B = B, c->T = T, c->Hq = Hq, c->Hkv = Hkv, c->D = D;
    c->N = B;
    c->scale = D > 0 ? (float)(1.0 / sqrt((double)D)) : 1.0f;
    c->causal = 1;
    c->position = LM_POS_NOPE;
    c->rope_theta = 10000.0;
}

/* ---------------------------------------------------------------- workspace */

lm_attention_workspace *lm_attention_workspace_new(void) {
    return LM_CALLOC(1, sizeof(lm_attention_workspace));
}

void lm_attention_workspace_free(lm_attention_workspace *ws) {
    if (!ws)
        return;
    free(ws->buf);
    free(ws->rope_cs);
    free(ws);
}

static void *scratch_get(lm_attention_workspace *ws, size_t bytes) {
    if (bytes == 0)
        bytes = 1;
    if (!ws)
        return LM_MALLOC(bytes);
    if (ws->cap < bytes) {
        free(ws->buf);
        ws->buf = LM_MALLOC(bytes);
        ws->cap = bytes;
    }
    return ws->buf;
}

static void scratch_put(lm_attention_workspace *ws, void *p) {
    if (!ws)
        free(p);
}

/* Byte offsets of the pieces of one scratch buffer, each rounded to 64 bytes. */
static size_t carve(size_t *off, size_t bytes) {
    size_t o = *off;
    *off += (bytes + 63) & ~(size_t)63;
    return o;
}

/* ---------------------------------------------------------------- RoPE */

void lm_attn_rope_factors(double theta, int D, int64_t p, float *cs, float *sn) {
    const int h = D / 2;
    for (int f = 0; f < h; f++) {
        /* inv_freq = theta^(-2f/D) as Hugging Face's 1 / base^(arange(0, D, 2) / D),
         * but in fp64, and the angle p * inv_freq in fp64 (exact to ~1e-16 relative,
         * so 1e-11 rad at p = 65536, where an fp32 product is off by up to 4e-3). */
        const double ang = (double)p * pow(theta, -2.0 * f / (double)D);
        cs[f] = (float)cos(ang);
        sn[f] = (float)sin(ang);
    }
}

/* Fill *rc / *rs with the table for positions 0..len-1: kept in the workspace while
 * D and theta stay the same (grown when a longer document arrives), else in a fresh
 * buffer returned in *own (freed by the caller). */
static void rope_table(const lm_attention_config *c, int64_t len, const float **rc,
                       const float **rs, float **own) {
    const int h = c->D / 2;
    lm_attention_workspace *ws = c->ws;
    *own = NULL;
    if (ws && ws->rope_cs && ws->rope_D == c->D && ws->rope_theta == c->rope_theta &&
        ws->rope_len >= len) {
        *rc = ws->rope_cs;
        *rs = ws->rope_cs + (size_t)ws->rope_len * h;
        return;
    }
    const size_t need = 2 * (size_t)(len > 0 ? len : 1) * (size_t)h;
    float *t;
    if (ws) {
        if (ws->rope_cap < need) {
            free(ws->rope_cs);
            ws->rope_cs = LM_MALLOC(sizeof(float) * need);
            ws->rope_cap = need;
        }
        t = ws->rope_cs;
        ws->rope_len = len;
        ws->rope_D = c->D;
        ws->rope_theta = c->rope_theta;
    } else {
        t = *own = LM_MALLOC(sizeof(float) * need);
    }
    float *cs = t, *sn = t + (size_t)len * h;
    const double theta = c->rope_theta;
    const int D = c->D;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < len; p++)
        lm_attn_rope_factors(theta, D, p, cs + (size_t)p * h, sn + (size_t)p * h);
    *rc = cs;
    *rs = sn;
}

/* ---------------------------------------------------------------- validation */

static lm_status check_finite(const float *x, int64_t n, const char *name, lm_error *err) {
    const int64_t i = lm_f32_first_nonfinite(x, n);
    if (i >= 0)
        return lm_errorf(err, LM_ERR_NONFINITE,
                         "attention: input '%s' has a non-finite value (%g) at element %lld",
                         name, (double)x[i], (long long)i);
    return LM_OK;
}

/* Everything but the tensors. */
static lm_status validate_config(lm_attention_config *c, lm_error *err) {
    const char *dn[] = {"B", "T", "Hq", "Hkv", "D"};
    int dv[] = {c->B, c->T, c->Hq, c->Hkv, c->D};
    for (int i = 0; i < 5; i++)
        if (dv[i] < 1)
            return lm_errorf(err, LM_ERR_INVALID, "attention: dimension %s = %d must be >= 1",
                             dn[i], dv[i]);
    if (c->D > 1024)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: head dim D = %d exceeds the supported 1024", c->D);
    if (c->Hq % c->Hkv != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: Hq = %d query heads is not a multiple of Hkv = %d kv heads",
                         c->Hq, c->Hkv);
    if ((int64_t)c->B * c->T * c->Hq * c->D > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID, "attention: problem too large (B*T*Hq*D > 2^40)");
    if (c->causal != 1)
        return lm_errorf(
            err, LM_ERR_UNSUPPORTED,
            "attention: causal = %d: only causal attention (causal = 1) is implemented", c->causal);
    if (!isfinite(c->scale))
        return lm_errorf(err, LM_ERR_INVALID, "attention: scale = %g is not finite",
                         (double)c->scale);
    if (c->position != LM_POS_NOPE && c->position != LM_POS_ROPE)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: unknown position encoding %d (NOPE = 0, ROPE = 1)",
                         (int)c->position);
    if (c->position == LM_POS_ROPE) {
        if (!(isfinite(c->rope_theta) && c->rope_theta > 0.0))
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention: rope_theta = %g must be finite and > 0", c->rope_theta);
        if (c->D % 2 != 0)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention: RoPE (half-split) needs an even head dim; D = %d", c->D);
    }
    if (c->cu_seqlens) {
        if (c->B != 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention: cu_seqlens needs B == 1 (packed), got B = %d", c->B);
        if (c->n_cu_seqlens < 2)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention: cu_seqlens has %d entries (need >= 2)", c->n_cu_seqlens);
        if (c->cu_seqlens[0] != 0)
            return lm_errorf(err, LM_ERR_INVALID, "attention: cu_seqlens[0] = %lld (must be 0)",
                             (long long)c->cu_seqlens[0]);
        for (int i = 1; i < c->n_cu_seqlens; i++)
            if (c->cu_seqlens[i] < c->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "attention: cu_seqlens decreases at index %d (%lld < %lld)", i,
                                 (long long)c->cu_seqlens[i], (long long)c->cu_seqlens[i - 1]);
        if (c->cu_seqlens[c->n_cu_seqlens - 1] != c->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention: cu_seqlens ends at %lld, not at T = %d",
                             (long long)c->cu_seqlens[c->n_cu_seqlens - 1], c->T);
        c->N = c->n_cu_seqlens - 1;
    } else {
        c->N = c->B;
    }
    return LM_OK;
}

lm_status lm_attention_validate(lm_attention_config *c, const lm_attention_inputs *in,
                                lm_error *err) {
    if (!c || !in)
        return lm_errorf(err, LM_ERR_INVALID, "attention: config and inputs are required");
    LM_TRY(validate_config(c, err));
    if (!in->q || !in->k || !in->v)
        return lm_errorf(err, LM_ERR_INVALID, "attention: inputs q, k and v are required");
    const int64_t BT = (int64_t)c->B * c->T;
    LM_TRY(check_finite(in->q, BT * c->Hq * c->D, "q", err));
    LM_TRY(check_finite(in->k, BT * c->Hkv * c->D, "k", err));
    LM_TRY(check_finite(in->v, BT * c->Hkv * c->D, "v", err));
    return LM_OK;
}

/* ---------------------------------------------------------------- preparation */

/* Position of flattened token t inside its document. */
static int64_t token_pos(const lm_attention_config *c, int64_t t) {
    if (!c->cu_seqlens)
        return t % c->T;
    /* last n with cu[n] <= t; then cu[n+1] > t (empty documents share cu values) */
    int lo = 0, hi = c->n_cu_seqlens - 1;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (c->cu_seqlens[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return t - c->cu_seqlens[lo];
}

/* x [BT, H, D] -> xT [H, D, ldT], rotated at each token's position when rc != NULL;
 * with xr != NULL the rotated rows are also stored row-major there. */
static void transpose_rows(const lm_attention_config *c, const lm_attn_prep *p, const float *x,
                           int H, float *xT, float *xr) {
    const int64_t BT = (int64_t)c->B * c->T;
    const int D = c->D, h2 = D / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < BT; t++) {
        float row[1024];
        const int64_t pos = p->rc ? token_pos(c, t) : 0;
        for (int h = 0; h < H; h++) {
            const float *src = x + (t * H + h) * D;
            if (p->rc) {
                lm_attn_rope_rotate(src, row, D, p->rc + pos * h2, p->rs + pos * h2, 0);
                src = row;
                if (xr)
                    memcpy(xr + (t * H + h) * D, row, sizeof(float) * (size_t)D);
            }
            for (int d = 0; d < D; d++)
                xT[((int64_t)h * D + d) * p->ldT + t] = src[d];
        }
    }
}

typedef struct {
    void *buf;
    float *rope_own;
} prep_mem;

/* Documents, task list, RoPE table, kT (and for the backward vT, q~, k~, Delta), per-
 * thread tiles, all carved from one scratch buffer. */
static void prep_build(const lm_attention_config *c, const lm_attention_inputs *in, int backward,
                       const float *o, const float *do_, lm_attn_prep *p, prep_mem *m) {
    memset(p, 0, sizeof(*p));
    const int64_t BT = (int64_t)c->B * c->T;
    const int D = c->D, Hq = c->Hq, Hkv = c->Hkv, N = c->N;
    const int rope = c->position == LM_POS_ROPE;
    const int nt = omp_get_max_threads();
    int64_t nblk = 0, maxlen = 0;
    for (int n = 0; n < N; n++) {
        int64_t len = c->cu_seqlens ? c->cu_seqlens[n + 1] - c->cu_seqlens[n] : c->T;
        nblk += (len + LM_ATTN_BLK - 1) / LM_ATTN_BLK;
        maxlen = len > maxlen ? len : maxlen;
    }
    const int64_t ntask = (int64_t)(Hq > Hkv ? Hq : Hkv) * nblk + (int64_t)N * Hkv;
    LM_CHECK(ntask <= INT32_MAX); /* task indices are int: 2^31 tiles is beyond any CPU run */
    const size_t f = sizeof(float), B2 = (size_t)LM_ATTN_BLK * LM_ATTN_BLK,
                 BD = (size_t)LM_ATTN_BLK * D;
    p->thr_floats = backward ? 2 * B2 + 2 * BD : 2 * BD + B2 + 2 * LM_ATTN_BLK;
    p->thr_floats = (p->thr_floats + 15) & ~(size_t)15;

    size_t off = 0;
    const size_t o_bos = carve(&off, sizeof(int64_t) * 2 * (size_t)N);
    const size_t o_task = carve(&off, sizeof(lm_attn_task) * (size_t)ntask);
    int64_t ldT = (BT + 15) & ~(int64_t)15;
    if (ldT % 256 == 0)
        ldT += 16;
    const size_t o_kT = carve(&off, f * (size_t)(ldT * Hkv * D));
    const size_t o_vT = backward ? carve(&off, f * (size_t)(ldT * Hkv * D)) : 0;
    const size_t o_qr = backward && rope ? carve(&off, f * (size_t)(BT * Hq * D)) : 0;
    const size_t o_kr = backward && rope ? carve(&off, f * (size_t)(BT * Hkv * D)) : 0;
    const size_t o_dl = backward ? carve(&off, f * (size_t)(BT * Hq)) : 0;
    const size_t o_thr = carve(&off, f * p->thr_floats * (size_t)nt);
    uint8_t *buf = scratch_get(c->ws, off);
    m->buf = buf;

    p->N = N;
    p->bos = (int64_t *)(buf + o_bos);
    p->len = p->bos + N;
    for (int n = 0; n < N; n++) {
        p->bos[n] = c->cu_seqlens ? c->cu_seqlens[n] : (int64_t)n * c->T;
        p->len[n] = c->cu_seqlens ? c->cu_seqlens[n + 1] - c->cu_seqlens[n] : c->T;
    }
    p->maxlen = maxlen;
    p->tasks = (lm_attn_task *)(buf + o_task);
    p->kT = (float *)(buf + o_kT);
    p->ldT = ldT;
    p->thr = (float *)(buf + o_thr);
    m->rope_own = NULL;
    if (rope)
        rope_table(c, maxlen, &p->rc, &p->rs, &m->rope_own);

    if (!backward) {
        transpose_rows(c, p, in->k, Hkv, p->kT, NULL);
        return;
    }
    float *qr = rope ? (float *)(buf + o_qr) : NULL, *kr = rope ? (float *)(buf + o_kr) : NULL;
    p->vT = (float *)(buf + o_vT);
    p->delta = (float *)(buf + o_dl);
    transpose_rows(c, p, in->k, Hkv, p->kT, kr);
    {
        lm_attn_prep pv = *p;
        pv.rc = pv.rs = NULL; /* values are never rotated */
        transpose_rows(c, &pv, in->v, Hkv, p->vT, NULL);
    }
    p->kr = rope ? kr : in->k;
    if (rope) {
        const int h2 = D / 2;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < BT; t++) {
            const int64_t pos = token_pos(c, t);
            for (int h = 0; h < Hq; h++)
                lm_attn_rope_rotate(in->q + (t * Hq + h) * D, qr + (t * Hq + h) * D, D,
                                    p->rc + pos * h2, p->rs + pos * h2, 0);
        }
    }
    p->qr = rope ? qr : in->q;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < BT * Hq; r++) {
        const float *a = o + r * D, *b = do_ + r * D;
        double s = 0.0;
        for (int d = 0; d < D; d++)
            s += (double)a[d] * b[d];
        p->delta[r] = (float)s;
    }
}

static void prep_free(const lm_attention_config *c, prep_mem *m) {
    scratch_put(c->ws, m->buf);
    free(m->rope_own);
}

/* Forward tasks (document, query head, query block), heaviest blocks first. */
static int64_t forward_tasks(const lm_attention_config *c, lm_attn_prep *p) {
    int64_t nt = 0;
    const int64_t maxnb = (p->maxlen + LM_ATTN_BLK - 1) / LM_ATTN_BLK;
    for (int64_t b = maxnb - 1; b >= 0; b--)
        for (int n = 0; n < p->N; n++)
            if (b * LM_ATTN_BLK < p->len[n])
                for (int h = 0; h < c->Hq; h++)
                    p->tasks[nt++] = (lm_attn_task){n, h, (int)b};
    return nt;
}

/* ---------------------------------------------------------------- entry points */

lm_status lm_attention_forward(lm_attention_config *c, const lm_attention_inputs *in, float *o,
                               float *lse, lm_error *err) {
    LM_TRY(lm_attention_validate(c, in, err));
    if (!o)
        return lm_errorf(err, LM_ERR_INVALID, "attention: output 'o' is required");
    lm_attn_prep p;
    prep_mem m;
    prep_build(c, in, 0, NULL, NULL, &p, &m);
    const int64_t nt = forward_tasks(c, &p);
    LM_CHECK(nt <= INT32_MAX);
    lm_attn_cpu_forward(c, &p, in, (int)nt, o, lse);
    prep_free(c, &m);
    return LM_OK;
}

lm_status lm_attention_backward(lm_attention_config *c, const lm_attention_inputs *in,
                                const float *o, const float *lse, lm_attention_grads *gr,
                                lm_error *err) {
    LM_TRY(lm_attention_validate(c, in, err));
    if (!o || !lse)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: backward needs the forward's 'o' and 'lse' (got %s NULL)",
                         !o ? "o" : "lse");
    if (!gr || !gr->do_ || !gr->dq || !gr->dk || !gr->dv)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: backward needs 'do' and the outputs 'dq', 'dk', 'dv'");
    const int64_t BT = (int64_t)c->B * c->T;
    LM_TRY(check_finite(gr->do_, BT * c->Hq * c->D, "do", err));
    LM_TRY(check_finite(o, BT * c->Hq * c->D, "o", err));
    LM_TRY(check_finite(lse, BT * c->Hq, "lse", err));
    lm_attn_prep p;
    prep_mem m;
    prep_build(c, in, 1, o, gr->do_, &p, &m);
    memset(gr->dq, 0, sizeof(float) * (size_t)(BT * c->Hq * c->D));
    lm_attn_cpu_backward(c, &p, lse, gr);
    if (c->position == LM_POS_ROPE) {
        /* dq was accumulated as dQ~ (rotated frame): dq = R(p)^T dQ~ */
        const int D = c->D, h2 = D / 2, Hq = c->Hq;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < BT; t++) {
            const int64_t pos = token_pos(c, t);
            for (int h = 0; h < Hq; h++) {
                float *r = gr->dq + (t * Hq + h) * D;
                lm_attn_rope_rotate(r, r, D, p.rc + pos * h2, p.rs + pos * h2, 1);
            }
        }
    }
    prep_free(c, &m);
    return LM_OK;
}

/* ---------------------------------------------------------------- KV cache, decode */

static lm_status validate_cache(lm_attention_config *c, int64_t Tmax, int64_t pos, int64_t need,
                                const char *what, lm_error *err) {
    LM_TRY(validate_config(c, err));
    if (c->cu_seqlens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: %s: cu_seqlens must be NULL (one position per batch row)",
                         what);
    if (Tmax < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attention: %s: Tmax = %lld must be >= 1", what,
                         (long long)Tmax);
    if (c->pos_rows) {
        if (c->T != 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention: %s: pos_rows (a position per row) needs T = 1, got T = %d",
                             what, c->T);
        for (int b = 0; b < c->B; b++)
            if (c->pos_rows[b] < 0 || c->pos_rows[b] > Tmax - 1)
                return lm_errorf(err, LM_ERR_INVALID,
                                 "attention: %s: pos_rows[%d] = %lld does not fit a cache of "
                                 "Tmax = %lld positions",
                                 what, b, (long long)c->pos_rows[b], (long long)Tmax);
    } else if (pos < 0 || pos > Tmax - need) {
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: %s: pos = %lld with %lld token(s) does not fit a cache of "
                         "Tmax = %lld positions",
                         what, (long long)pos, (long long)need, (long long)Tmax);
    }
    if ((int64_t)c->B * Tmax * c->Hkv * c->D > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: %s: cache too large (B*Tmax*Hkv*D > 2^40)", what);
    return LM_OK;
}

lm_status lm_attention_cache_write(lm_attention_config *c, int64_t Tmax, int64_t pos,
                                   const float *k, const float *v, float *k_cache, float *v_cache,
                                   lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attention: cache_write: config is required");
    LM_TRY(validate_cache(c, Tmax, pos, c->T, "cache_write", err));
    if (!k || !v || !k_cache || !v_cache)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: cache_write: k, v, k_cache and v_cache are required");
    const int64_t n = (int64_t)c->B * c->T * c->Hkv * c->D;
    LM_TRY(check_finite(k, n, "k", err));
    LM_TRY(check_finite(v, n, "v", err));
    const int D = c->D, Hkv = c->Hkv, T = c->T, rope = c->position == LM_POS_ROPE;
    const int64_t rows = (int64_t)c->B * T;
    const double theta = c->rope_theta;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / T, t = r % T;
        const int64_t at = c->pos_rows ? c->pos_rows[b] : pos + t;
        const size_t src = (size_t)(r * Hkv) * D, dst = (size_t)((b * Tmax + at) * Hkv) * D;
        memcpy(v_cache + dst, v + src, sizeof(float) * (size_t)Hkv * D);
        if (!rope) {
            memcpy(k_cache + dst, k + src, sizeof(float) * (size_t)Hkv * D);
            continue;
        }
        float cs[512], sn[512];
        lm_attn_rope_factors(theta, D, at, cs, sn);
        for (int g = 0; g < Hkv; g++)
            lm_attn_rope_rotate(k + src + (size_t)g * D, k_cache + dst + (size_t)g * D, D, cs, sn,
                                0);
    }
    return LM_OK;
}

/* sum_t p[t] in fp64: 8 partial sums (lane t mod 8, increasing t), then a fixed tree: the
 * same for every row and thread count. */
static double sum_exps(const float *p, int64_t L) {
    double z[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t t = 0;
    for (; t + 8 <= L; t += 8)
        for (int l = 0; l < 8; l++)
            z[l] += p[t + l];
    for (int l = 0; t < L; t++, l++)
        z[l] += p[t];
    return ((z[0] + z[4]) + (z[2] + z[6])) + ((z[1] + z[5]) + (z[3] + z[7]));
}

/* acc[0..D-1] = sum_t p[t] v[t*ldv + d] over t = 0..L-1, fp64, increasing t (a long
 * cache sums 2^16+ terms, which fp32 rounds to ~1e-4 relative). The accumulators stay
 * in registers for a 32-wide column strip while the keys stream past. */
static void pv_accumulate(int64_t L, int D, const float *p, const float *v, int64_t ldv,
                          double *acc) {
    int d0 = 0;
#if defined(__AVX512F__)
    for (; d0 + 16 <= D; d0 += 16) {
        __m512d a0 = _mm512_setzero_pd(), a1 = a0;
        const float *vc = v + d0;
        for (int64_t t = 0; t < L; t++, vc += ldv) {
            const __m512d w = _mm512_set1_pd((double)p[t]);
            a0 = _mm512_fmadd_pd(w, _mm512_cvtps_pd(_mm256_loadu_ps(vc)), a0);
            a1 = _mm512_fmadd_pd(w, _mm512_cvtps_pd(_mm256_loadu_ps(vc + 8)), a1);
        }
        _mm512_storeu_pd(acc + d0, a0);
        _mm512_storeu_pd(acc + d0 + 8, a1);
    }
#endif
    for (int d = d0; d < D; d++) {
        double a = 0.0;
        for (int64_t t = 0; t < L; t++)
            a = fma((double)p[t], (double)v[t * ldv + d], a);
        acc[d] = a;
    }
}

lm_status lm_attention_decode(lm_attention_config *c, int64_t Tmax, int64_t pos, const float *q,
                              const float *k_cache, const float *v_cache, float *o, float *lse,
                              lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attention: decode: config is required");
    if (c->T != 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: decode: T = %d (a decode step takes one token, q [B,1,Hq,D])",
                         c->T);
    LM_TRY(validate_cache(c, Tmax, pos, 1, "decode", err));
    if (!q || !k_cache || !v_cache || !o)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention: decode: q, k_cache, v_cache and o are required");
    const int B = c->B, Hq = c->Hq, Hkv = c->Hkv, D = c->D, grp = Hq / Hkv;
    LM_TRY(check_finite(q, (int64_t)B * Hq * D, "q", err));
    /* keys 0..pos (0..pos_rows[b] per row): the scratch holds the longest row's scores */
    int64_t L = pos + 1;
    if (c->pos_rows) {
        L = 1;
        for (int b = 0; b < B; b++)
            L = c->pos_rows[b] + 1 > L ? c->pos_rows[b] + 1 : L;
    }
    const int nt = omp_get_max_threads();
    /* per thread (in floats, a multiple of 16 so every piece stays 8-byte aligned):
     * accumulators [64, D] in fp64 (a long cache sums 2^16+ terms, which fp32 rounds to
     * ~1e-4 relative), rotated queries [grp, D] and scores [grp, L] in fp32 */
    const size_t per =
        (2 * 64 * (size_t)D + (size_t)grp * ((size_t)D + (size_t)L) + 15) & ~(size_t)15;
    float *buf = scratch_get(c->ws, sizeof(float) * per * (size_t)nt);
    float cs0[512], sn0[512];
    if (c->position == LM_POS_ROPE && !c->pos_rows)
        lm_attn_rope_factors(c->rope_theta, D, pos, cs0, sn0);
    const float scale = c->scale;
    const int rope = c->position == LM_POS_ROPE;
    const int64_t Lmax = L;
#pragma omp parallel for schedule(dynamic, 1)
    for (int task = 0; task < B * Hkv; task++) {
        const int b = task / Hkv, g = task % Hkv;
        /* this row's keys 0..L-1 and, with per-row positions, its own rotation */
        const int64_t L = c->pos_rows ? c->pos_rows[b] + 1 : Lmax;
        float csr[512], snr[512];
        const float *cs = cs0, *sn = sn0;
        if (rope && c->pos_rows) {
            lm_attn_rope_factors(c->rope_theta, D, c->pos_rows[b], csr, snr);
            cs = csr, sn = snr;
        }
        double *acc = (double *)(buf + per * (size_t)omp_get_thread_num());
        float *qt = (float *)(acc + 64 * (size_t)D), *s = qt + (size_t)grp * D;
        for (int j = 0; j < grp; j++) {
            const float *src = q + ((size_t)b * Hq + (size_t)g * grp + j) * D;
            if (rope)
                lm_attn_rope_rotate(src, qt + (size_t)j * D, D, cs, sn, 0);
            else
                memcpy(qt + (size_t)j * D, src, sizeof(float) * (size_t)D);
        }
        /* scores [grp, L] = the group's queries against keys 0..L-1 (row stride Hkv*D):
         * the row-wise kernel, one thread (this loop is the parallel one) */
        lm_gemm_rowwise_serial(grp, (int)L, D, qt, D, k_cache + ((size_t)b * Tmax * Hkv + g) * D,
                               Hkv * D, 0, s, (int)L);
        for (int64_t i = 0; i < (int64_t)grp * L; i++)
            s[i] *= scale;
        float mx[64];
        double sum[64]; /* the group's heads, 64 at a time */
        for (int j0 = 0; j0 < grp; j0 += 64) {
            const int jn = grp - j0 < 64 ? grp - j0 : 64;
            for (int jj = 0; jj < jn; jj++) {
                float *sj = s + (size_t)(j0 + jj) * L;
                float m = -INFINITY;
                for (int64_t t = 0; t < L; t++)
                    m = sj[t] > m ? sj[t] : m;
#pragma omp simd
                for (int64_t t = 0; t < L; t++)
                    sj[t] = lm_fexp(sj[t] - m);
                mx[jj] = m, sum[jj] = sum_exps(sj, L);
            }
            for (int jj = 0; jj < jn; jj++)
                pv_accumulate(L, D, s + (size_t)(j0 + jj) * L,
                              v_cache + ((size_t)b * Tmax * Hkv + g) * D, (int64_t)Hkv * D,
                              acc + (size_t)jj * D);
            for (int jj = 0; jj < jn; jj++) {
                const int h = g * grp + j0 + jj;
                float *orow = o + ((size_t)b * Hq + h) * D;
                const double inv = 1.0 / sum[jj];
                for (int d = 0; d < D; d++)
                    orow[d] = (float)(acc[(size_t)jj * D + d] * inv);
                if (lse)
                    lse[(size_t)b * Hq + h] = (float)(mx[jj] + log(sum[jj]));
            }
        }
    }
    scratch_put(c->ws, buf);
    return LM_OK;
}
