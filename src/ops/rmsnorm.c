/* RMSNorm and the head-wise sigmoid-gated RMSNorm (include/linmoe/layers.h).
 *
 * Both are one kernel over R rows of D elements (plain: R = N; gated: R = N*H rows of
 * Dh sharing one weight), with an optional gate. Rows are independent, so the
 * forward runs one row per iteration of a parallel loop. The backward runs groups of
 * RCH rows: each group writes its rows of dx / dgate and its own fp64 partial of
 * dweight, and the partials are summed in group order, so dweight is the same for
 * every thread count and x, dy, gate are read once. The partials live in the caller's
 * workspace (lm_rmsnorm_backward_ws_bytes; the model's memory plan reserves it) or,
 * without one, in an allocation per call. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops/layers_internal.h"

/* Rows per backward task; its partial dweight is one fp64 row of the scratch. */
#define RCH 256

static float row_rstd(const float *restrict xr, int D, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; d++)
        ss += xr[d] * xr[d];
    return (float)(1.0 / sqrt((double)ss / D + (double)eps));
}

static lm_status check_args(const char *op, int64_t N, int H, int D, float eps, const float *x,
                            const float *gate, int gated, const float *weight, lm_error *err) {
    if (N < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be >= 0", op, (long long)N);
    if (H < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: H = %d must be >= 1", op, H);
    if (D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: %s = %d must be >= 1", op, gated ? "Dh" : "D",
                         D);
    if ((double)N * H * D > 9.0e15)
        return lm_errorf(err, LM_ERR_INVALID, "%s: problem too large (N*H*D = %.3g)", op,
                         (double)N * H * D);
    if (!(eps > 0.0f) || !isfinite(eps))
        return lm_errorf(err, LM_ERR_INVALID, "%s: eps = %g must be finite and > 0", op,
                         (double)eps);
    if (!x && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'x' is required", op);
    if (gated && !gate && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'gate' is required", op);
    const int64_t n = N * H * D;
    LM_TRY(lm_layers_check_finite(op, "x", x, n, D, err));
    if (gated)
        LM_TRY(lm_layers_check_finite(op, "gate", gate, n, D, err));
    LM_TRY(lm_layers_check_finite(op, "weight", weight, D, D, err));
    return LM_OK;
}

/* The caller's backward scratch must hold doubles. */
static lm_status check_ws(const char *op, const void *ws, lm_error *err) {
    if ((uintptr_t)ws % sizeof(double))
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: workspace 'ws' = %p is not aligned to %zu bytes (fp64 partials)", op,
                         ws, sizeof(double));
    return LM_OK;
}

static inline void forward_row(int64_t r, int D, float eps, const float *x, const float *gate,
                               const float *weight, float *y, float *rstd) {
    const float *restrict xr = x + r * D;
    const float *restrict gr = gate ? gate + r * D : NULL;
    float *restrict yr = y + r * D;
    const float rs = row_rstd(xr, D, eps);
    if (rstd)
        rstd[r] = rs;
    if (gr && weight) {
#pragma omp simd
        for (int d = 0; d < D; d++)
            yr[d] = xr[d] * rs * weight[d] * lm_layers_sigmoid(gr[d]);
    } else if (gr) {
#pragma omp simd
        for (int d = 0; d < D; d++)
            yr[d] = xr[d] * rs * lm_layers_sigmoid(gr[d]);
    } else if (weight) {
#pragma omp simd
        for (int d = 0; d < D; d++)
            yr[d] = xr[d] * rs * weight[d];
    } else {
#pragma omp simd
        for (int d = 0; d < D; d++)
            yr[d] = xr[d] * rs;
    }
}

/* Small problems run as a plain loop, outside any OpenMP region (a one-thread
 * region still enters the runtime, which allocates a team for it). */
static void norm_forward(int64_t R, int D, float eps, const float *x, const float *gate,
                         const float *weight, float *y, float *rstd) {
    if (R * D > LM_LAYERS_PAR_MIN) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < R; r++)
            forward_row(r, D, eps, x, gate, weight, y, rstd);
    } else {
        for (int64_t r = 0; r < R; r++)
            forward_row(r, D, eps, x, gate, weight, y, rstd);
    }
}

/* One row of the backward. GATED / WEIGHTED are literal constants at each call site
 * (always inlined), so every loop is a plain vectorisable loop; s = sigmoid(gate) is
 * recomputed per loop instead of stored (D is unbounded). */
static inline __attribute__((always_inline)) void
row_backward(const int GATED, const int WEIGHTED, int D, float rs, const float *restrict xr,
             const float *restrict gr, const float *restrict w, const float *restrict dyr,
             float *restrict dxr, float *restrict dgr, double *restrict pg) {
    /* dot = sum_d gx * x with gx = dy * weight * s (the gradient reaching xh) */
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < D; d++) {
        const float s = GATED ? lm_layers_sigmoid(gr[d]) : 1.0f;
        dot += dyr[d] * (WEIGHTED ? w[d] : 1.0f) * s * xr[d];
    }
    /* dx = rs * (gx - xh * mean(gx * xh)) = rs * gx - x * (rs^3 * dot / D) */
    const float c = dot * rs * rs / (float)D;
    if (dxr) {
#pragma omp simd
        for (int d = 0; d < D; d++) {
            const float s = GATED ? lm_layers_sigmoid(gr[d]) : 1.0f;
            dxr[d] = rs * (dyr[d] * (WEIGHTED ? w[d] : 1.0f) * s - xr[d] * c);
        }
    }
    if (GATED && dgr) {
#pragma omp simd
        for (int d = 0; d < D; d++) {
            const float s = lm_layers_sigmoid(gr[d]);
            dgr[d] = dyr[d] * xr[d] * rs * (WEIGHTED ? w[d] : 1.0f) * s * (1.0f - s);
        }
    }
    if (pg) {
#pragma omp simd
        for (int d = 0; d < D; d++) {
            const float s = GATED ? lm_layers_sigmoid(gr[d]) : 1.0f;
            pg[d] += (double)(dyr[d] * xr[d] * rs * s);
        }
    }
}

/* Group grp of the backward: rows [grp*RCH, (grp+1)*RCH) of R: dx and dgate row by
 * row, and the group's partial dweight (fp64) in part[grp*D..] (part may be NULL). */
static void backward_group(int64_t grp, int64_t R, int D, float eps, const float *x,
                           const float *gate, const float *weight, const float *rstd,
                           const float *dy, float *dx, float *dgate, double *part) {
    double *pg = part ? part + grp * D : NULL;
    if (pg)
        memset(pg, 0, sizeof(double) * (size_t)D);
    const int64_t r1 = (grp + 1) * RCH < R ? (grp + 1) * RCH : R;
    for (int64_t r = grp * RCH; r < r1; r++) {
        const float *xr = x + r * D, *dyr = dy + r * D, *gr = gate ? gate + r * D : NULL;
        const float rs = rstd ? rstd[r] : row_rstd(xr, D, eps);
        float *dxr = dx ? dx + r * D : NULL, *dgr = dgate ? dgate + r * D : NULL;
        if (gate && weight)
            row_backward(1, 1, D, rs, xr, gr, weight, dyr, dxr, dgr, pg);
        else if (gate)
            row_backward(1, 0, D, rs, xr, gr, NULL, dyr, dxr, dgr, NULL);
        else if (weight)
            row_backward(0, 1, D, rs, xr, NULL, weight, dyr, dxr, NULL, pg);
        else
            row_backward(0, 0, D, rs, xr, NULL, NULL, dyr, dxr, NULL, NULL);
    }
}

/* Backward over R rows in groups of RCH rows (one task per group). The groups are
 * fixed by R, so summing the partials in group order gives the same bits on any
 * thread count. rstd == NULL: recomputed per row. Small problems (or one group) run
 * as a plain loop outside any OpenMP region, in group order. */
static void norm_backward_rows(int64_t R, int D, float eps, const float *x, const float *gate,
                               const float *weight, const float *rstd, const float *dy, float *dx,
                               float *dgate, double *part) {
    const int64_t G = (R + RCH - 1) / RCH;
    if (R * D > LM_LAYERS_PAR_MIN && G > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t grp = 0; grp < G; grp++)
            backward_group(grp, R, D, eps, x, gate, weight, rstd, dy, dx, dgate, part);
    } else {
        for (int64_t grp = 0; grp < G; grp++)
            backward_group(grp, R, D, eps, x, gate, weight, rstd, dy, dx, dgate, part);
    }
}

/* Bytes of the backward's scratch for R rows of D: one fp64 partial dweight row per
 * group of RCH rows. */
static int64_t ws_bytes(int64_t R, int D) {
    if (R <= 0 || D < 1)
        return 0;
    return (int64_t)sizeof(double) * ((R + RCH - 1) / RCH) * D;
}

int64_t lm_rmsnorm_backward_ws_bytes(int64_t N, int D) { return ws_bytes(N, D); }

int64_t lm_gated_rmsnorm_backward_ws_bytes(int64_t N, int H, int Dh) {
    return H < 1 ? 0 : ws_bytes(N * H, Dh);
}

static lm_status norm_backward(const char *op, int64_t R, int D, float eps, const float *x,
                               const float *gate, const float *weight, const float *rstd,
                               const float *dy, float *dx, float *dgate, float *dweight, void *ws,
                               lm_error *err) {
    if (!dy && R > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: upstream gradient '%s' is required", op,
                         gate ? "do" : "dy");
    if ((dx && dx == dy) || (dgate && dgate == dy))
        return lm_errorf(err, LM_ERR_INVALID, "%s: outputs must not alias the upstream gradient",
                         op);
    LM_TRY(lm_layers_check_finite(op, gate ? "do" : "dy", dy, R * D, D, err));
    if (rstd) {
        /* NaN/Inf, and 0 (= 1/sqrt(+Inf): the forward's mean square overflowed fp32; any
         * finite mean square gives rstd >= 1/sqrt(FLT_MAX) > 0) are the data blowing up;
         * a finite negative rstd, which no forward computes, is bad input */
        for (int64_t r = 0; r < R; r++)
            if (!(rstd[r] > 0.0f) || !isfinite(rstd[r]))
                return lm_errorf(
                    err, isfinite(rstd[r]) && rstd[r] < 0.0f ? LM_ERR_INVALID : LM_ERR_NONFINITE,
                    "%s: input 'rstd' must be finite and > 0; rstd[%lld] = %g%s", op, (long long)r,
                    (double)rstd[r],
                    rstd[r] == 0.0f ? " (the forward's mean square overflowed fp32)" : "");
    }
    if (!weight)
        dweight = NULL;
    if (R == 0) {
        if (dweight)
            memset(dweight, 0, sizeof(float) * (size_t)D);
        return LM_OK;
    }
    if (!dx && !dgate && !dweight)
        return LM_OK;
    const int64_t G = (R + RCH - 1) / RCH;
    double *own = dweight && !ws ? LM_MALLOC((size_t)ws_bytes(R, D)) : NULL;
    double *part = dweight ? (ws ? (double *)ws : own) : NULL;
    norm_backward_rows(R, D, eps, x, gate, weight, rstd, dy, dx, dgate, part);
    if (dweight) {
        for (int d = 0; d < D; d++) {
            double acc = 0.0;
            for (int64_t grp = 0; grp < G; grp++)
                acc += part[grp * D + d];
            dweight[d] = (float)acc;
        }
    }
    free(own);
    return LM_OK;
}

lm_status lm_rmsnorm_forward(int64_t N, int D, float eps, const float *x, const float *weight,
                             float *y, float *rstd, lm_error *err) {
    const char *op = "rmsnorm";
    LM_TRY(check_args(op, N, 1, D, eps, x, NULL, 0, weight, err));
    if (!y && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' is required", op);
    if (y && y == x)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' must not alias input 'x'", op);
    norm_forward(N, D, eps, x, NULL, weight, y, rstd);
    return LM_OK;
}

lm_status lm_rmsnorm_backward_ws(int64_t N, int D, float eps, const float *x, const float *weight,
                                 const float *rstd, const float *dy, float *dx, float *dweight,
                                 void *ws, lm_error *err) {
    const char *op = "rmsnorm";
    LM_TRY(check_args(op, N, 1, D, eps, x, NULL, 0, weight, err));
    LM_TRY(check_ws(op, ws, err));
    return norm_backward(op, N, D, eps, x, NULL, weight, rstd, dy, dx, NULL, dweight, ws, err);
}

lm_status lm_rmsnorm_backward(int64_t N, int D, float eps, const float *x, const float *weight,
                              const float *rstd, const float *dy, float *dx, float *dweight,
                              lm_error *err) {
    return lm_rmsnorm_backward_ws(N, D, eps, x, weight, rstd, dy, dx, dweight, NULL, err);
}

lm_status lm_gated_rmsnorm_forward(int64_t N, int H, int Dh, float eps, const float *x,
                                   const float *gate, const float *weight, float *o, float *rstd,
                                   lm_error *err) {
    const char *op = "gated_rmsnorm";
    LM_TRY(check_args(op, N, H, Dh, eps, x, gate, 1, weight, err));
    if (!o && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'o' is required", op);
    if (o && (o == x || o == gate))
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'o' must not alias input '%s'", op,
                         o == x ? "x" : "gate");
    norm_forward(N * H, Dh, eps, x, gate, weight, o, rstd);
    return LM_OK;
}

lm_status lm_gated_rmsnorm_backward_ws(int64_t N, int H, int Dh, float eps, const float *x,
                                       const float *gate, const float *weight, const float *rstd,
                                       const float *do_, float *dx, float *dgate, float *dweight,
                                       void *ws, lm_error *err) {
    const char *op = "gated_rmsnorm";
    LM_TRY(check_args(op, N, H, Dh, eps, x, gate, 1, weight, err));
    LM_TRY(check_ws(op, ws, err));
    return norm_backward(op, N * H, Dh, eps, x, gate, weight, rstd, do_, dx, dgate, dweight, ws,
                         err);
}

lm_status lm_gated_rmsnorm_backward(int64_t N, int H, int Dh, float eps, const float *x,
                                    const float *gate, const float *weight, const float *rstd,
                                    const float *do_, float *dx, float *dgate, float *dweight,
                                    lm_error *err) {
    return lm_gated_rmsnorm_backward_ws(N, H, Dh, eps, x, gate, weight, rstd, do_, dx, dgate,
                                        dweight, NULL, err);
}
