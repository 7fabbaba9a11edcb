/* Dense SwiGLU FFN forward and backward (include/linmoe/layers.h).
 *
 * Every matmul is one lm_sgemm call on one thread inside a task of fixed shape:
 * blocks of RB tokens for everything row-wise (the projections, the element-wise
 * SwiGLU, dx) and blocks of WB output rows for the weight gradients, each of which
 * sums over all N tokens inside one call. The task list depends on (N, D, F) only,
 * so the results are the same bits for any thread count. */
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/gemm_rowwise.h"
#include "ops/layers_internal.h"

#define RB 64 /* tokens per row task */
#define WB 64 /* weight-gradient rows per task */

static const char *OP = "swiglu";

int64_t lm_swiglu_ws_floats(int64_t N, int F, int have_hidden) {
    return (have_hidden ? 3 : 5) * N * (int64_t)F;
}

static lm_status validate(int64_t N, int D, int F, const lm_swiglu_weights *w, const float *x,
                          lm_error *err) {
    if (N < 0 || N > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be in [0, 2^31)", OP,
                         (long long)N);
    if (D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: D = %d must be >= 1", OP, D);
    if (F < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: F = %d must be >= 1", OP, F);
    if ((double)N * F * 5 > 9.0e15 || (double)N * D > 9.0e15)
        return lm_errorf(err, LM_ERR_INVALID, "%s: problem too large (N = %lld, D = %d, F = %d)",
                         OP, (long long)N, D, F);
    if (!w || !w->gate_proj || !w->up_proj || !w->down_proj)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: weights gate_proj [F, D], up_proj [F, D] and down_proj [D, F] are "
                         "required",
                         OP);
    if (!x && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'x' is required", OP);
    LM_TRY(lm_layers_check_finite(OP, "x", x, N * D, D, err));
    LM_TRY(lm_layers_check_finite(OP, "gate_proj", w->gate_proj, (int64_t)F * D, D, err));
    LM_TRY(lm_layers_check_finite(OP, "up_proj", w->up_proj, (int64_t)F * D, D, err));
    LM_TRY(lm_layers_check_finite(OP, "down_proj", w->down_proj, (int64_t)D * F, F, err));
    return LM_OK;
}

/* H rows [g | u] = x_r [gate_proj | up_proj]^T for rows r0..r0+m-1. */
static void project(int64_t r0, int m, int D, int F, const lm_swiglu_weights *w, const float *x,
                    float *hid) {
    float *H = hid + r0 * 2 * F;
    lm_sgemm(0, 1, m, F, D, 1.0f, x + r0 * D, D, w->gate_proj, D, 0.0f, H, 2 * F);
    lm_sgemm(0, 1, m, F, D, 1.0f, x + r0 * D, D, w->up_proj, D, 0.0f, H + F, 2 * F);
}

/* a = silu(g) * u for m rows. */
static void swiglu_rows(int m, int F, const float *H, float *A) {
    for (int r = 0; r < m; r++) {
        const float *restrict g = H + (int64_t)r * 2 * F, *restrict u = g + F;
        float *restrict a = A + (int64_t)r * F;
#pragma omp simd
        for (int c = 0; c < F; c++)
            a[c] = g[c] * lm_layers_sigmoid(g[c]) * u[c];
    }
}

/* Forward row task i: tokens [i*RB, i*RB + RB) of N. */
static void forward_block(int i, int64_t N, int D, int F, const lm_swiglu_weights *w,
                          const float *x, float *hid, float *A, float *out, int infer) {
    const int64_t r0 = (int64_t)i * RB;
    const int m = (int)(N - r0 < RB ? N - r0 : RB);
    if (infer) { /* no hidden saved: inference, row-wise GEMMs (ops/cpu/gemm_rowwise.h) */
        float *H = hid + r0 * 2 * F;
        lm_gemm_infer(m, F, D, x + r0 * D, D, w->gate_proj, D, 0, H, 2 * F);
        lm_gemm_infer(m, F, D, x + r0 * D, D, w->up_proj, D, 0, H + F, 2 * F);
        swiglu_rows(m, F, H, A + r0 * F);
        lm_gemm_infer(m, D, F, A + r0 * F, F, w->down_proj, F, 0, out + r0 * D, D);
        return;
    }
    project(r0, m, D, F, w, x, hid);
    swiglu_rows(m, F, hid + r0 * 2 * F, A + r0 * F);
    lm_sgemm(0, 1, m, D, F, 1.0f, A + r0 * F, F, w->down_proj, F, 0.0f, out + r0 * D, D);
}

lm_status lm_swiglu_forward(int64_t N, int D, int F, const lm_swiglu_weights *w, const float *x,
                            float *out, float *hidden, float *ws, lm_error *err) {
    LM_TRY(validate(N, D, F, w, x, err));
    if (!out && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'out' is required", OP);
    if (out && out == x)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'out' must not alias input 'x'", OP);
    if (N == 0)
        return LM_OK;
    float *own =
        ws ? NULL : LM_MALLOC(sizeof(float) * (size_t)lm_swiglu_ws_floats(N, F, hidden != NULL));
    float *scratch = ws ? ws : own;
    float *hid = hidden ? hidden : scratch;
    float *A = hidden ? scratch : scratch + 2 * N * F;
    const int nt = (int)((N + RB - 1) / RB);
    lm_layers_blas_guard g = lm_layers_blas_single();
    if (nt > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < nt; i++)
            forward_block(i, N, D, F, w, x, hid, A, out, hidden == NULL);
    } else {
        for (int i = 0; i < nt; i++)
            forward_block(i, N, D, F, w, x, hid, A, out, hidden == NULL);
    }
    lm_layers_blas_restore(g);
    free(own);
    return LM_OK;
}

/* The backward's operands (lm_swiglu_backward). */
typedef struct {
    int64_t N;
    int D, F;
    const lm_swiglu_weights *w;
    const float *x, *hidden;
    float *hid; /* the saved hidden, or scratch for it (written when hidden == NULL) */
    const float *dout;
    float *dx, *A, *dH, *dWg, *dWu, *dWd;
} bwd_args;

/* Backward phase 1, row task i: (hidden), a = silu(g) u, da = dout down_proj, dg, du. */
static void backward_rows(const bwd_args *ar, int i) {
    const int64_t N = ar->N;
    const int D = ar->D, F = ar->F;
    const lm_swiglu_weights *w = ar->w;
    const float *x = ar->x, *dout = ar->dout;
    float *dx = ar->dx, *A = ar->A, *dH = ar->dH;
    float *dWg = ar->dWg, *dWu = ar->dWu, *dWd = ar->dWd;
    const float *hidden = ar->hidden;
    float *hid = ar->hid;
    const int64_t r0 = (int64_t)i * RB;
    const int m = (int)(N - r0 < RB ? N - r0 : RB);
    if (!hidden)
        project(r0, m, D, F, w, x, hid);
    const float *H = hid + r0 * 2 * F;
    float *dHr = dH + r0 * 2 * F;
    if (dWd)
        swiglu_rows(m, F, H, A + r0 * F);
    if (!dx && !dWg && !dWu)
        return;
    lm_sgemm(0, 0, m, F, D, 1.0f, dout + r0 * D, D, w->down_proj, F, 0.0f, dHr, 2 * F);
    for (int r = 0; r < m; r++) {
        const float *restrict gg = H + (int64_t)r * 2 * F, *restrict u = gg + F;
        float *restrict dg = dHr + (int64_t)r * 2 * F, *restrict du = dg + F;
#pragma omp simd
        for (int c = 0; c < F; c++) {
            const float s = lm_layers_sigmoid(gg[c]), da = dg[c];
            du[c] = da * gg[c] * s;
            dg[c] = da * u[c] * (s * (1.0f + gg[c] * (1.0f - s)));
        }
    }
}

/* Backward phase 2, task i of ntx dx row tasks, then nd down_proj, ng gate_proj and the
 * up_proj row blocks of the weight gradients. */
static void backward_task(const bwd_args *ar, int ntx, int nd, int ng, int i) {
    const int64_t N = ar->N;
    const int D = ar->D, F = ar->F;
    const lm_swiglu_weights *w = ar->w;
    const float *x = ar->x, *dout = ar->dout;
    float *dx = ar->dx, *A = ar->A, *dH = ar->dH;
    float *dWg = ar->dWg, *dWu = ar->dWu, *dWd = ar->dWd;
    if (i < ntx) {
        const int64_t r0 = (int64_t)i * RB;
        const int m = (int)(N - r0 < RB ? N - r0 : RB);
        const float *dHr = dH + r0 * 2 * F;
        lm_sgemm(0, 0, m, D, F, 1.0f, dHr, 2 * F, w->gate_proj, D, 0.0f, dx + r0 * D, D);
        lm_sgemm(0, 0, m, D, F, 1.0f, dHr + F, 2 * F, w->up_proj, D, 1.0f, dx + r0 * D, D);
    } else if (i < ntx + nd) {
        const int a = (i - ntx) * WB, b = a + WB < D ? a + WB : D;
        lm_sgemm(1, 0, b - a, F, (int)N, 1.0f, dout + a, D, A, F, 0.0f, dWd + (int64_t)a * F, F);
    } else {
        const int up = i >= ntx + nd + ng;
        const int a = (i - ntx - nd - (up ? ng : 0)) * WB, b = a + WB < F ? a + WB : F;
        lm_sgemm(1, 0, b - a, D, (int)N, 1.0f, dH + (up ? F : 0) + a, 2 * F, x, D, 0.0f,
                 (up ? dWu : dWg) + (int64_t)a * D, D);
    }
}

lm_status lm_swiglu_backward(int64_t N, int D, int F, const lm_swiglu_weights *w, const float *x,
                             const float *hidden, const float *dout, float *dx,
                             const lm_swiglu_grads *gr, float *ws, lm_error *err) {
    LM_TRY(validate(N, D, F, w, x, err));
    if (!dout && N > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: upstream gradient 'dout' is required", OP);
    if (dx && (dx == dout || dx == x))
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dx' must not alias 'x' or 'dout'", OP);
    LM_TRY(lm_layers_check_finite(OP, "dout", dout, N * D, D, err));
    LM_TRY(lm_layers_check_finite(OP, "hidden", hidden, N * 2 * F, 2 * F, err));
    float *dWg = gr ? gr->gate_proj : NULL, *dWu = gr ? gr->up_proj : NULL;
    float *dWd = gr ? gr->down_proj : NULL;
    if (N == 0) {
        if (dWg)
            memset(dWg, 0, sizeof(float) * (size_t)F * D);
        if (dWu)
            memset(dWu, 0, sizeof(float) * (size_t)F * D);
        if (dWd)
            memset(dWd, 0, sizeof(float) * (size_t)D * F);
        return LM_OK;
    }
    float *own =
        ws ? NULL : LM_MALLOC(sizeof(float) * (size_t)lm_swiglu_ws_floats(N, F, hidden != NULL));
    float *scratch = ws ? ws : own;
    float *hid = hidden ? (float *)hidden : scratch + 3 * N * F; /* only written when NULL */
    float *A = scratch, *dH = scratch + N * F;                   /* dH rows: [dg | du] */
    const int nt = (int)((N + RB - 1) / RB);
    lm_layers_blas_guard g = lm_layers_blas_single();

    /* phase 1, by token blocks: (hidden), a = silu(g) u, da = dout down_proj, dg, du */
    const bwd_args a = {N, D, F, w, x, hidden, hid, dout, dx, A, dH, dWg, dWu, dWd};
    if (nt > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < nt; i++)
            backward_rows(&a, i);
    } else {
        for (int i = 0; i < nt; i++)
            backward_rows(&a, i);
    }

    /* phase 2: dx by token blocks; each weight gradient by blocks of its rows, summing
     * over all N tokens in one matmul (fixed order) */
    const int ntx = dx ? nt : 0, nd = dWd ? (D + WB - 1) / WB : 0;
    const int ng = dWg ? (F + WB - 1) / WB : 0, nu = dWu ? (F + WB - 1) / WB : 0;
    const int ntask = ntx + nd + ng + nu;
    if (ntask > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < ntask; i++)
            backward_task(&a, ntx, nd, ng, i);
    } else {
        for (int i = 0; i < ntask; i++)
            backward_task(&a, ntx, nd, ng, i);
    }
    lm_layers_blas_restore(g);
    free(own);
    return LM_OK;
}
