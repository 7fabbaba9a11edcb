/* AttnRes aggregation op: configuration defaults, validation of every input before
 * any math, and the fp32 CPU forward and backward (math: include/linmoe/attnres.h,
 * reference/attnres_ctx.md §4.2-4.3; derivation: docs/attnres-math.md).
 *
 * Work split: rows are cut into at most AR_MAX_CHUNKS contiguous chunks whose
 * boundaries depend on N only (never on the thread count). Each chunk is processed
 * by one thread, rows in order, and keeps its own partial sum of the query-gain
 * gradient; the partials are then added in chunk order. Per-row math does not
 * depend on the chunk either, so every output is bitwise identical for 1, 2 or
 * any number of threads.
 */
#include "linmoe/attnres.h"

#include <math.h>
#include <string.h>

#define AR_MAX_CHUNKS 64
#define AR_MIN_ROWS_PER_CHUNK 16
/* Below this many source elements (L*N*D) one thread does it all: a parallel
 * region costs a few microseconds. Does not change results. */
#define AR_PAR_MIN_WORK 32768

struct lm_attnres_workspace {
    void *buf;
    size_t cap; /* bytes */
};

lm_attnres_workspace *lm_attnres_workspace_new(void) {
    lm_attnres_workspace *ws = LM_CALLOC(1, sizeof(*ws));
    return ws;
}

void lm_attnres_workspace_free(lm_attnres_workspace *ws) {
    if (!ws)
        return;
    free(ws->buf);
    free(ws);
}

void lm_attnres_config_default(lm_attnres_config *c, int L, int64_t N, int D) {
    memset(c, 0, sizeof(*c));
    c->L = L, c->N = N, c->D = D;
    c->eps = 1e-6f;  /* reference/attnres_ctx.md §4.1 (fla default) */
    c->scale = 1.0f; /* §1.2, §4.1: no 1/sqrt(D) temperature */
}

/* ---------------------------------------------------------------- sources */

/* L source tensors, given either as a pointer table or as one [L, N, D] block. */
typedef struct {
    const float *const *ptrs;
    const float *base;
    int64_t stride; /* N*D */
} srcset;

typedef struct {
    float *const *ptrs;
    float *base;
    int64_t stride;
} dstset;

static inline const float *src_at(const srcset *s, int m) {
    return s->ptrs ? s->ptrs[m] : s->base + (int64_t)m * s->stride;
}

static inline float *dst_at(const dstset *d, int m) {
    if (d->ptrs)
        return d->ptrs[m];
    return d->base ? d->base + (int64_t)m * d->stride : NULL;
}

/* ---------------------------------------------------------------- validation */

static lm_status check_finite(const float *x, int64_t n, int D, const char *name, int idx,
                              lm_error *err) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) {
            char nm[48];
            if (idx >= 0)
                snprintf(nm, sizeof(nm), "%s_%d", name, idx);
            else
                snprintf(nm, sizeof(nm), "%s", name);
            return lm_errorf(err, LM_ERR_NONFINITE,
                             "attnres: input '%s' has a non-finite value (%g) at element %lld "
                             "(row %lld, column %lld)",
                             nm, (double)x[i], (long long)i, (long long)(i / D),
                             (long long)(i % D));
        }
    return LM_OK;
}

/* Also sets S->stride for a contiguous block once the dims are known to be sane. */
static lm_status validate(const lm_attnres_config *c, srcset *S, const float *query,
                          const float *rms_weight, const float *do_, int need_do, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: config is required");
    if (c->L < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: L = %d sources (must be >= 1)", c->L);
    if (c->N < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: N = %lld rows (must be >= 1)",
                         (long long)c->N);
    if (c->D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: D = %d (must be >= 1)", c->D);
    if (c->N > ((int64_t)1 << 46) / c->D / c->L)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attnres: problem too large (L*N*D = %d*%lld*%d > 2^46)", c->L,
                         (long long)c->N, c->D);
    S->stride = c->N * c->D;
    if (!isfinite(c->eps) || !(c->eps > 0.0f))
        return lm_errorf(err, LM_ERR_INVALID, "attnres: eps = %g (must be finite and > 0)",
                         (double)c->eps);
    if (!isfinite(c->scale))
        return lm_errorf(err, LM_ERR_INVALID, "attnres: scale = %g is not finite",
                         (double)c->scale);
    if (!query)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: input 'query' is required");
    if (!rms_weight)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: input 'rms_weight' is required");
    if (!S->ptrs && !S->base)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: the sources (residual_0..) are required");
    for (int m = 0; m < c->L; m++)
        if (!src_at(S, m))
            return lm_errorf(err, LM_ERR_INVALID, "attnres: source residual_%d is NULL (L = %d)", m,
                             c->L);
    if (need_do && !do_)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: upstream gradient 'do' is required");
    if (c->trusted_inputs)
        return LM_OK;
    const int64_t nd = c->N * c->D;
    LM_TRY(check_finite(query, c->D, c->D, "query", -1, err));
    LM_TRY(check_finite(rms_weight, c->D, c->D, "rms_weight", -1, err));
    for (int m = 0; m < c->L; m++)
        LM_TRY(check_finite(src_at(S, m), nd, c->D, "residual", m, err));
    if (do_)
        LM_TRY(check_finite(do_, nd, c->D, "do", -1, err));
    return LM_OK;
}

lm_status lm_attnres_validate(const lm_attnres_config *c, const float *const *src,
                              const float *query, const float *rms_weight, const float *do_,
                              lm_error *err) {
    srcset S = {src, NULL, 0};
    return validate(c, &S, query, rms_weight, do_, 0, err);
}

/* ---------------------------------------------------------------- scratch */

typedef struct {
    int nchunk;
    int64_t rows; /* rows per chunk (the last one may be short) */
} chunking;

static chunking make_chunks(int64_t N) {
    chunking k;
    int64_t rows = (N + AR_MAX_CHUNKS - 1) / AR_MAX_CHUNKS;
    if (rows < AR_MIN_ROWS_PER_CHUNK)
        rows = AR_MIN_ROWS_PER_CHUNK;
    k.rows = rows;
    k.nchunk = (int)((N + rows - 1) / rows);
    return k;
}

/* Scratch layout (doubles first, then floats), per call:
 *   rowd  [nchunk, 4L] double   per-row r, t, p, dp of the chunk's current row
 *   dup   [nchunk, D]  double   backward: the chunk's partial of du = sum ds*scale*r*C
 *   ud    [D]          double   u = w (.) g, exact (scores)
 *   uf    [D]          float    u rounded to fp32 (the key term of dC)                 */
typedef struct {
    double *rowd, *dup, *ud;
    float *uf;
    void *owned;
} scratch;

static void scratch_get(const lm_attnres_config *c, int nchunk, int backward, scratch *s) {
    const size_t nrow = (size_t)nchunk * 4 * (size_t)c->L;
    const size_t ndu = backward ? (size_t)nchunk * (size_t)c->D : 0;
    const size_t bytes =
        (nrow + ndu + (size_t)c->D) * sizeof(double) + (size_t)c->D * sizeof(float);
    void *buf;
    s->owned = NULL;
    if (c->ws) {
        if (c->ws->cap < bytes) {
            free(c->ws->buf);
            c->ws->buf = LM_MALLOC(bytes);
            c->ws->cap = bytes;
        }
        buf = c->ws->buf;
    } else {
        buf = s->owned = LM_MALLOC(bytes);
    }
    s->rowd = (double *)buf;
    s->dup = backward ? s->rowd + nrow : NULL;
    s->ud = s->rowd + nrow + ndu;
    s->uf = (float *)(s->ud + c->D);
}

static void make_u(const float *query, const float *rms_weight, int D, scratch *s) {
    for (int j = 0; j < D; j++) {
        s->ud[j] = (double)query[j] * (double)rms_weight[j];
        s->uf[j] = (float)s->ud[j];
    }
}

/* ---------------------------------------------------------------- per row */

/* Scores of row `off` (element offset n*D) into r, t, p (and dp = <do, C_m> when
 * dorow is given). t_m = r_m <u, C_m> is the unscaled logit; p the softmax of
 * scale*t, max-subtracted. The three dot products are accumulated in fp64: a sum
 * of squares of fp32 values cannot overflow there, so every finite input gives
 * finite logits and weights (and the logits are exact to ~1e-16 relative, which
 * keeps large-logit softmaxes as accurate as small ones). */
static inline void row_scores(int L, int D, const srcset *S, int64_t off, const double *restrict u,
                              double eps, double scale, const float *restrict dorow,
                              double *restrict r, double *restrict t, double *restrict p,
                              double *restrict dp) {
    double mx = -INFINITY;
    for (int m = 0; m < L; m++) {
        const float *restrict x = src_at(S, m) + off;
        double ss = 0.0, su = 0.0, sd = 0.0;
        if (dorow) {
#pragma omp simd reduction(+ : ss, su, sd)
            for (int j = 0; j < D; j++) {
                const double xj = x[j];
                ss += xj * xj;
                su += u[j] * xj;
                sd += (double)dorow[j] * xj;
            }
            dp[m] = sd;
        } else {
#pragma omp simd reduction(+ : ss, su)
            for (int j = 0; j < D; j++) {
                const double xj = x[j];
                ss += xj * xj;
                su += u[j] * xj;
            }
        }
        r[m] = 1.0 / sqrt(ss / D + eps);
        t[m] = r[m] * su;
        const double s = scale * t[m];
        if (s > mx)
            mx = s;
    }
    double z = 0.0;
    for (int m = 0; m < L; m++)
        z += (p[m] = exp(scale * t[m] - mx));
    const double iz = 1.0 / z;
    for (int m = 0; m < L; m++)
        p[m] *= iz;
}

static void forward_chunk(const lm_attnres_config *c, const srcset *S, const double *u, int64_t n0,
                          int64_t n1, double *rowd, float *o) {
    const int L = c->L, D = c->D;
    double *r = rowd, *t = r + L, *p = t + L, *dp = p + L;
    for (int64_t n = n0; n < n1; n++) {
        const int64_t off = n * D;
        row_scores(L, D, S, off, u, c->eps, c->scale, NULL, r, t, p, dp);
        float *restrict orow = o + off;
        const float *restrict x0 = src_at(S, 0) + off;
        const float p0 = (float)p[0];
#pragma omp simd
        for (int j = 0; j < D; j++)
            orow[j] = p0 * x0[j];
        for (int m = 1; m < L; m++) {
            const float *restrict x = src_at(S, m) + off;
            const float pm = (float)p[m];
#pragma omp simd
            for (int j = 0; j < D; j++)
                orow[j] += pm * x[j];
        }
    }
}

/* Backward of one chunk of rows (docs/attnres-math.md):
 *   delta = sum_m p_m dp_m            (= <do, o>)
 *   dt_m  = scale * p_m (dp_m - delta)
 *   b_m   = dt_m r_m ;  e_m = b_m t_m r_m / D
 *   dC_m  = p_m do + b_m u - e_m C_m  (values, then keys through the RMSNorm)
 *   du   += b_m C_m                   (= dt_m k_m, k_m without the gain)       */
static void backward_chunk(const lm_attnres_config *c, const srcset *S, const double *ud,
                           const float *restrict u, const float *do_, const dstset *G, int64_t n0,
                           int64_t n1, double *rowd, double *restrict du) {
    const int L = c->L, D = c->D;
    const int acc = c->accumulate;
    double *r = rowd, *t = r + L, *p = t + L, *dp = p + L;
    for (int j = 0; j < D; j++)
        du[j] = 0.0;
    for (int64_t n = n0; n < n1; n++) {
        const int64_t off = n * D;
        const float *restrict dorow = do_ + off;
        row_scores(L, D, S, off, ud, c->eps, c->scale, dorow, r, t, p, dp);
        double delta = 0.0;
        for (int m = 0; m < L; m++)
            delta += p[m] * dp[m];
        for (int m = 0; m < L; m++) {
            const float *restrict x = src_at(S, m) + off;
            const double dt = c->scale * p[m] * (dp[m] - delta);
            const double bd = dt * r[m];
            const float a = (float)p[m], b = (float)bd, e = (float)(bd * t[m] * r[m] / D);
            float *g = dst_at(G, m);
            if (g) {
                float *restrict grow = g + off;
                if (acc) {
#pragma omp simd
                    for (int j = 0; j < D; j++)
                        grow[j] += a * dorow[j] + b * u[j] - e * x[j];
                } else {
#pragma omp simd
                    for (int j = 0; j < D; j++)
                        grow[j] = a * dorow[j] + b * u[j] - e * x[j];
                }
            }
            if (b != 0.0f) {
#pragma omp simd
                for (int j = 0; j < D; j++)
                    du[j] += (double)b * (double)x[j]; /* exact product */
            }
        }
    }
}

/* Chunk ci of the forward / backward (rows [ci * k->rows, ...) of N) with its slices
 * of the scratch. */
static void forward_chunk_at(const lm_attnres_config *c, const srcset *S, const chunking *k,
                             const scratch *s, int ci, float *o) {
    const int64_t n0 = (int64_t)ci * k->rows;
    const int64_t n1 = n0 + k->rows < c->N ? n0 + k->rows : c->N;
    forward_chunk(c, S, s->ud, n0, n1, s->rowd + (size_t)ci * 4 * c->L, o);
}

static void backward_chunk_at(const lm_attnres_config *c, const srcset *S, const chunking *k,
                              const scratch *s, const float *do_, const dstset *G, int ci) {
    const int64_t n0 = (int64_t)ci * k->rows;
    const int64_t n1 = n0 + k->rows < c->N ? n0 + k->rows : c->N;
    backward_chunk(c, S, s->ud, s->uf, do_, G, n0, n1, s->rowd + (size_t)ci * 4 * c->L,
                   s->dup + (size_t)ci * c->D);
}

/* ---------------------------------------------------------------- entry points */

static lm_status forward_impl(const lm_attnres_config *c, srcset *S, const float *query,
                              const float *rms_weight, float *o, lm_error *err) {
    LM_TRY(validate(c, S, query, rms_weight, NULL, 0, err));
    if (!o)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: output 'o' is required");
    const chunking k = make_chunks(c->N);
    scratch s;
    scratch_get(c, k.nchunk, 0, &s);
    make_u(query, rms_weight, c->D, &s);
    /* small problems: a plain loop, outside any OpenMP region (a one-thread region
     * still enters the runtime, which allocates a team for it) */
    const int par = k.nchunk > 1 && (int64_t)c->L * c->N * c->D >= AR_PAR_MIN_WORK;
    if (par) {
#pragma omp parallel for schedule(static)
        for (int ci = 0; ci < k.nchunk; ci++)
            forward_chunk_at(c, S, &k, &s, ci, o);
    } else {
        for (int ci = 0; ci < k.nchunk; ci++)
            forward_chunk_at(c, S, &k, &s, ci, o);
    }
    free(s.owned);
    return LM_OK;
}

static lm_status backward_impl(const lm_attnres_config *c, srcset *S, const float *query,
                               const float *rms_weight, const float *do_, dstset *G, float *dquery,
                               float *drms_weight, lm_error *err) {
    LM_TRY(validate(c, S, query, rms_weight, do_, 1, err));
    G->stride = S->stride;
    const chunking k = make_chunks(c->N);
    scratch s;
    scratch_get(c, k.nchunk, 1, &s);
    const int D = c->D;
    make_u(query, rms_weight, D, &s);
    const int par = k.nchunk > 1 && (int64_t)c->L * c->N * c->D >= AR_PAR_MIN_WORK;
    if (par) {
#pragma omp parallel for schedule(static)
        for (int ci = 0; ci < k.nchunk; ci++)
            backward_chunk_at(c, S, &k, &s, do_, G, ci);
    } else {
        for (int ci = 0; ci < k.nchunk; ci++)
            backward_chunk_at(c, S, &k, &s, do_, G, ci);
    }
    /* fixed-order reduction over chunks: dw = du (.) g, dg = du (.) w */
    for (int j = 0; j < D; j++) {
        double du = 0.0;
        for (int ci = 0; ci < k.nchunk; ci++)
            du += s.dup[(size_t)ci * D + j];
        if (dquery) {
            const float v = (float)(du * rms_weight[j]);
            dquery[j] = c->accumulate ? dquery[j] + v : v;
        }
        if (drms_weight) {
            const float v = (float)(du * query[j]);
            drms_weight[j] = c->accumulate ? drms_weight[j] + v : v;
        }
    }
    free(s.owned);
    return LM_OK;
}

lm_status lm_attnres_forward_ptrs(const lm_attnres_config *c, const float *const *src,
                                  const float *query, const float *rms_weight, float *o,
                                  lm_error *err) {
    if (!src)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: the source table is required");
    srcset S = {src, NULL, 0};
    return forward_impl(c, &S, query, rms_weight, o, err);
}

lm_status lm_attnres_forward(const lm_attnres_config *c, const float *residual, const float *query,
                             const float *rms_weight, float *o, lm_error *err) {
    if (!residual)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: input 'residual' is required");
    srcset S = {NULL, residual, 0}; /* stride set by validate */
    return forward_impl(c, &S, query, rms_weight, o, err);
}

lm_status lm_attnres_backward_ptrs(const lm_attnres_config *c, const float *const *src,
                                   const float *query, const float *rms_weight, const float *do_,
                                   float *const *dsrc, float *dquery, float *drms_weight,
                                   lm_error *err) {
    if (!src)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: the source table is required");
    srcset S = {src, NULL, 0};
    dstset G = {dsrc, NULL, 0};
    return backward_impl(c, &S, query, rms_weight, do_, &G, dquery, drms_weight, err);
}

lm_status lm_attnres_backward(const lm_attnres_config *c, const float *residual, const float *query,
                              const float *rms_weight, const float *do_, float *dresidual,
                              float *dquery, float *drms_weight, lm_error *err) {
    if (!residual)
        return lm_errorf(err, LM_ERR_INVALID, "attnres: input 'residual' is required");
    srcset S = {NULL, residual, 0}; /* strides set by validate */
    dstset G = {NULL, dresidual, 0};
    return backward_impl(c, &S, query, rms_weight, do_, &G, dquery, drms_weight, err);
}
