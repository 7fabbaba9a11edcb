/* CPU kernels of the MoE layer: one task per expert segment (gather, GEMMs,
 * SwiGLU, and in backward the gate-weight gradient and the weight gradients),
 * shared-expert row blocks, weight-gradient blocks with the full token reduction
 * inside one GEMM, and the combine / dx gathers. The math of each line is in the
 * comment of include/linmoe/moe.h; the layout of the context in moe_cpu.h. */
#include <string.h>

#include "linmoe/core.h"
#include "ops/cpu/gemm_rowwise.h"
#include "ops/cpu/kda_internal.h" /* lm_fexp: vectorisable fp32 exp */
#include "ops/cpu/moe_cpu.h"

static int g_threaded_blas = 0;

void lm_moe_cpu_set_threaded_blas(int on) { g_threaded_blas = on != 0; }
int lm_moe_cpu_threaded_blas(void) { return g_threaded_blas; }

/* ---------------------------------------------------------------- SwiGLU */

/* a = silu(g) * u for m rows; H rows are [g (f) | u (f)] with row stride ldh. */
void lm_moe_cpu_swiglu_fwd(int64_t m, int f, const float *restrict H, int64_t ldh,
                           float *restrict A, int64_t lda) {
    for (int64_t r = 0; r < m; r++) {
        const float *restrict g = H + r * ldh, *restrict u = g + f;
        float *restrict a = A + r * lda;
#pragma omp simd
        for (int c = 0; c < f; c++) {
            float s = 1.0f / (1.0f + lm_fexp(-g[c]));
            a[c] = g[c] * s * u[c];
        }
    }
}

/* From da (rows of G) and the saved [g | u]:  dg = da * u * silu'(g),
 * du = da * silu(g), with silu'(g) = s (1 + g (1 - s)), s = sigmoid(g). */
void lm_moe_cpu_swiglu_bwd(int64_t m, int f, const float *restrict H, int64_t ldh,
                           const float *restrict G, int64_t ldg, float *restrict dH, int64_t lddh) {
    for (int64_t r = 0; r < m; r++) {
        const float *restrict g = H + r * ldh, *restrict u = g + f, *restrict da = G + r * ldg;
        float *restrict dg = dH + r * lddh, *restrict du = dg + f;
#pragma omp simd
        for (int c = 0; c < f; c++) {
            float s = 1.0f / (1.0f + lm_fexp(-g[c]));
            float silu = g[c] * s;
            du[c] = da[c] * silu;
            dg[c] = da[c] * u[c] * (s * (1.0f + g[c] * (1.0f - s)));
        }
    }
}

/* ---------------------------------------------------------------- tasks */

static void zero_if(float *p, int64_t n) {
    if (p)
        memset(p, 0, (size_t)n * sizeof(float));
}

static void expert_forward(const moe_run *run, int e) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, f = x->f, k = x->k;
    const int64_t r0 = x->seg_off[e];
    const int m = (int)(x->seg_off[e + 1] - r0);
    if (m == 0)
        return;
    const float *Wg = run->w->p[LM_MOE_EXPERTS_GATE_PROJ] + (int64_t)e * f * d;
    const float *Wu = run->w->p[LM_MOE_EXPERTS_UP_PROJ] + (int64_t)e * f * d;
    const float *Wd = run->w->p[LM_MOE_EXPERTS_DOWN_PROJ] + (int64_t)e * d * f;
    float *xp = x->xp + r0 * d, *H = x->H + r0 * 2 * f, *A = x->A + r0 * f, *Y = x->Y + r0 * d;
    for (int r = 0; r < m; r++)
        memcpy(xp + (int64_t)r * d, run->x + (int64_t)(x->perm_slot[r0 + r] / k) * d,
               (size_t)d * sizeof(float));
    if (run->infer) { /* inference: row-wise for few rows (gemm_rowwise.h) */
        lm_gemm_infer(m, f, d, xp, d, Wg, d, 0, H, 2 * f);
        lm_gemm_infer(m, f, d, xp, d, Wu, d, 0, H + f, 2 * f);
        lm_moe_cpu_swiglu_fwd(m, f, H, 2 * f, A, f);
        lm_gemm_infer(m, d, f, A, f, Wd, f, 0, Y, d);
        return;
    }
    lm_sgemm(0, 1, m, f, d, 1.0f, xp, d, Wg, d, 0.0f, H, 2 * f);
    lm_sgemm(0, 1, m, f, d, 1.0f, xp, d, Wu, d, 0.0f, H + f, 2 * f);
    lm_moe_cpu_swiglu_fwd(m, f, H, 2 * f, A, f);
    lm_sgemm(0, 1, m, d, f, 1.0f, A, f, Wd, f, 0.0f, Y, d);
}

static void expert_backward(const moe_run *run, int e) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, f = x->f, k = x->k;
    const int64_t r0 = x->seg_off[e];
    const int m = (int)(x->seg_off[e + 1] - r0);
    float *dWg = run->g->p[LM_MOE_EXPERTS_GATE_PROJ];
    float *dWu = run->g->p[LM_MOE_EXPERTS_UP_PROJ];
    float *dWd = run->g->p[LM_MOE_EXPERTS_DOWN_PROJ];
    if (dWg)
        dWg += (int64_t)e * f * d;
    if (dWu)
        dWu += (int64_t)e * f * d;
    if (dWd)
        dWd += (int64_t)e * d * f;
    if (m == 0) { /* dead expert: exactly zero */
        zero_if(dWg, (int64_t)f * d);
        zero_if(dWu, (int64_t)f * d);
        zero_if(dWd, (int64_t)d * f);
        return;
    }
    const float *Wg = run->w->p[LM_MOE_EXPERTS_GATE_PROJ] + (int64_t)e * f * d;
    const float *Wu = run->w->p[LM_MOE_EXPERTS_UP_PROJ] + (int64_t)e * f * d;
    const float *Wd = run->w->p[LM_MOE_EXPERTS_DOWN_PROJ] + (int64_t)e * d * f;
    const float *xp = x->xp + r0 * d, *H = x->H + r0 * 2 * f, *A = x->A + r0 * f;
    float *D = x->Y + r0 * d, *G = x->G + r0 * f, *dH = x->dH + r0 * 2 * f;
    const int32_t *slot = x->perm_slot + r0;
    const float *wt = x->route.topk_weight;

    for (int r = 0; r < m; r++)
        memcpy(D + (int64_t)r * d, run->dout + (int64_t)(slot[r] / k) * d,
               (size_t)d * sizeof(float));
    /* G = dout_e W_down (unweighted): dw = rowsum(G * a), da = w G */
    lm_sgemm(0, 0, m, f, d, 1.0f, D, d, Wd, f, 0.0f, G, f);
    for (int r = 0; r < m; r++) {
        const float w = wt[slot[r]];
        float *restrict gr = G + (int64_t)r * f, *restrict dr = D + (int64_t)r * d;
        const float *restrict ar = A + (int64_t)r * f;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int c = 0; c < f; c++)
            s += gr[c] * ar[c];
        x->dw[slot[r]] = s;
#pragma omp simd
        for (int c = 0; c < f; c++)
            gr[c] *= w;
#pragma omp simd
        for (int c = 0; c < d; c++)
            dr[c] *= w;
    }
    /* dW_down = (w dout_e)^T a */
    if (dWd)
        lm_sgemm(1, 0, d, f, m, 1.0f, D, d, A, f, 0.0f, dWd, f);
    lm_moe_cpu_swiglu_bwd(m, f, H, 2 * f, G, f, dH, 2 * f);
    if (dWg)
        lm_sgemm(1, 0, f, d, m, 1.0f, dH, 2 * f, xp, d, 0.0f, dWg, d);
    if (dWu)
        lm_sgemm(1, 0, f, d, m, 1.0f, dH + f, 2 * f, xp, d, 0.0f, dWu, d);
    if (run->dx) { /* dx rows of the segment, into D (consumed above) */
        lm_sgemm(0, 0, m, d, f, 1.0f, dH, 2 * f, Wg, d, 0.0f, D, d);
        lm_sgemm(0, 0, m, d, f, 1.0f, dH + f, 2 * f, Wu, d, 1.0f, D, d);
    }
}

static void shared_rows_forward(const moe_run *run, int t0, int t1) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, fs = x->fs, m = t1 - t0;
    const float *Wg = run->w->p[LM_MOE_SHARED_GATE_PROJ], *Wu = run->w->p[LM_MOE_SHARED_UP_PROJ];
    const float *Wd = run->w->p[LM_MOE_SHARED_DOWN_PROJ];
    const float *xr = run->x + (int64_t)t0 * d;
    float *H = x->Hs + (int64_t)t0 * 2 * fs, *A = x->As + (int64_t)t0 * fs;
    if (run->infer) {
        lm_gemm_infer(m, fs, d, xr, d, Wg, d, 0, H, 2 * fs);
        lm_gemm_infer(m, fs, d, xr, d, Wu, d, 0, H + fs, 2 * fs);
        lm_moe_cpu_swiglu_fwd(m, fs, H, 2 * fs, A, fs);
        lm_gemm_infer(m, d, fs, A, fs, Wd, fs, 0, run->out + (int64_t)t0 * d, d);
        return;
    }
    lm_sgemm(0, 1, m, fs, d, 1.0f, xr, d, Wg, d, 0.0f, H, 2 * fs);
    lm_sgemm(0, 1, m, fs, d, 1.0f, xr, d, Wu, d, 0.0f, H + fs, 2 * fs);
    lm_moe_cpu_swiglu_fwd(m, fs, H, 2 * fs, A, fs);
    lm_sgemm(0, 1, m, d, fs, 1.0f, A, fs, Wd, fs, 0.0f, run->out + (int64_t)t0 * d, d);
}

static void shared_rows_backward(const moe_run *run, int t0, int t1) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, fs = x->fs, m = t1 - t0;
    const float *Wg = run->w->p[LM_MOE_SHARED_GATE_PROJ], *Wu = run->w->p[LM_MOE_SHARED_UP_PROJ];
    const float *Wd = run->w->p[LM_MOE_SHARED_DOWN_PROJ];
    const float *H = x->Hs + (int64_t)t0 * 2 * fs;
    float *G = x->Gs + (int64_t)t0 * fs, *dH = x->dHs + (int64_t)t0 * 2 * fs;
    lm_sgemm(0, 0, m, fs, d, 1.0f, run->dout + (int64_t)t0 * d, d, Wd, fs, 0.0f, G, fs);
    lm_moe_cpu_swiglu_bwd(m, fs, H, 2 * fs, G, fs, dH, 2 * fs);
    if (run->dx) {
        float *dx = run->dx + (int64_t)t0 * d;
        lm_sgemm(0, 0, m, d, fs, 1.0f, dH, 2 * fs, Wg, d, 0.0f, dx, d);
        lm_sgemm(0, 0, m, d, fs, 1.0f, dH + fs, 2 * fs, Wu, d, 1.0f, dx, d);
    }
}

/* rows [a, b) of d shared_experts.down_proj = dout[:, a:b]^T As */
static void shared_ddown(const moe_run *run, int a, int b) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, fs = x->fs;
    float *dW = run->g->p[LM_MOE_SHARED_DOWN_PROJ];
    lm_sgemm(1, 0, b - a, fs, x->T, 1.0f, run->dout + a, d, x->As, fs, 0.0f, dW + (int64_t)a * fs,
             fs);
}

/* rows [a, b) of d shared_experts.gate_proj / .up_proj = dHs[:, a:b]^T x */
static void shared_dgateup(const moe_run *run, int a, int b) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, fs = x->fs;
    float *dWg = run->g->p[LM_MOE_SHARED_GATE_PROJ], *dWu = run->g->p[LM_MOE_SHARED_UP_PROJ];
    if (dWg)
        lm_sgemm(1, 0, b - a, d, x->T, 1.0f, x->dHs + a, 2 * fs, run->x, d, 0.0f,
                 dWg + (int64_t)a * d, d);
    if (dWu)
        lm_sgemm(1, 0, b - a, d, x->T, 1.0f, x->dHs + fs + a, 2 * fs, run->x, d, 0.0f,
                 dWu + (int64_t)a * d, d);
}

/* columns [a, b) of d gate.weight = dlogits^T x[:, a:b] */
static void router_dw(const moe_run *run, int a, int b) {
    lm_moe_ctx *x = run->ctx;
    lm_sgemm(1, 0, x->E, b - a, x->T, 1.0f, x->dlogits, x->E, run->x + a, x->d, 0.0f,
             run->g->p[LM_MOE_GATE_WEIGHT] + a, x->d);
}

/* dx rows [t0, t1): (shared part, already there when fs > 0) + dlogits W_r + the
 * routed dx rows of each kept assignment, in j order. */
static void dx_rows(const moe_run *run, int t0, int t1) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, k = x->k, E = x->E;
    float *dx = run->dx + (int64_t)t0 * d;
    lm_sgemm(0, 0, t1 - t0, d, E, 1.0f, x->dlogits + (int64_t)t0 * E, E,
             run->w->p[LM_MOE_GATE_WEIGHT], d, x->fs > 0 ? 1.0f : 0.0f, dx, d);
    for (int t = t0; t < t1; t++) {
        float *restrict o = run->dx + (int64_t)t * d;
        for (int j = 0; j < k; j++) {
            const int32_t r = x->row_of[(int64_t)t * k + j];
            if (r < 0)
                continue;
            const float *restrict y = x->Y + (int64_t)r * d;
#pragma omp simd
            for (int c = 0; c < d; c++)
                o[c] += y[c];
        }
    }
}

static void logits_rows(const moe_run *run, int t0, int t1) {
    lm_moe_ctx *x = run->ctx;
    lm_sgemm(0, 1, t1 - t0, x->E, x->d, 1.0f, run->x + (int64_t)t0 * x->d, x->d,
             run->w->p[LM_MOE_GATE_WEIGHT], x->d, 0.0f, x->logits + (int64_t)t0 * x->E, x->E);
}

static void run_task(const moe_run *run, const moe_task *t) {
    switch (t->kind) {
    case MOE_T_EXPERT:
        if (run->backward)
            expert_backward(run, t->a);
        else
            expert_forward(run, t->a);
        break;
    case MOE_T_SHARED_ROWS:
        if (run->backward)
            shared_rows_backward(run, t->a, t->b);
        else
            shared_rows_forward(run, t->a, t->b);
        break;
    case MOE_T_SHARED_DDOWN:
        shared_ddown(run, t->a, t->b);
        break;
    case MOE_T_SHARED_DGATEUP:
        shared_dgateup(run, t->a, t->b);
        break;
    case MOE_T_ROUTER_DW:
        router_dw(run, t->a, t->b);
        break;
    case MOE_T_DX_ROWS:
        dx_rows(run, t->a, t->b);
        break;
    case MOE_T_LOGITS_ROWS:
        logits_rows(run, t->a, t->b);
        break;
    default:
        LM_CHECK(0 && "unknown MoE task kind");
    }
}

void lm_moe_cpu_run_tasks(const moe_run *run, moe_task *tasks, int n) {
    if (n <= 0)
        return;
    const int threaded = g_threaded_blas;
    const int blas0 = lm_blas_get_threads();
    if (!threaded)
        lm_blas_set_threads(1);
    if (threaded || n == 1) {
        /* in sequence, without a parallel region: a serialized one (`if` false) makes
         * libgomp allocate and free a one-thread team per call, an allocation in the
         * training step (tests/test_mem_plan.c) */
        for (int i = 0; i < n; i++)
            run_task(run, &tasks[i]);
    } else {
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < n; i++)
            run_task(run, &tasks[i]);
    }
    if (!threaded)
        lm_blas_set_threads(blas0);
}

void lm_moe_cpu_combine(const moe_run *run) {
    lm_moe_ctx *x = run->ctx;
    const int d = x->d, k = x->k, T = x->T, shared = x->fs > 0;
    const float *wt = x->route.topk_weight;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        float *restrict o = run->out + (int64_t)t * d;
        if (!shared)
            memset(o, 0, (size_t)d * sizeof(float));
        for (int j = 0; j < k; j++) {
            const int64_t s = (int64_t)t * k + j;
            const int32_t r = x->row_of[s];
            if (r < 0)
                continue;
            const float w = wt[s];
            const float *restrict y = x->Y + (int64_t)r * d;
#pragma omp simd
            for (int c = 0; c < d; c++)
                o[c] += w * y[c];
        }
    }
}

/* Strict total order: cost descending, then kind, a, b ascending ((kind, a) is unique
 * within one task list, so nothing ties; b makes it total over any fields). */
static int task_before(const moe_task *x, const moe_task *y) {
    if (x->cost != y->cost)
        return x->cost > y->cost;
    if (x->kind != y->kind)
        return x->kind < y->kind;
    if (x->a != y->a)
        return x->a < y->a;
    return x->b < y->b;
}

static void sift_down(moe_task *t, int i, int n) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n)
            return;
        if (c + 1 < n && task_before(&t[c], &t[c + 1]))
            c++;
        if (!task_before(&t[i], &t[c]))
            return;
        const moe_task tmp = t[i];
        t[i] = t[c];
        t[c] = tmp;
        i = c;
    }
}

/* In-place heap sort (glibc's qsort mallocs a merge buffer past ~1 KiB, and the step
 * must not allocate). Under the strict total order the result is the unique sorted
 * sequence, the same one qsort gave. */
void lm_moe_cpu_sort_tasks(moe_task *tasks, int n) {
    for (int i = n / 2 - 1; i >= 0; i--)
        sift_down(tasks, i, n);
    for (int e = n - 1; e > 0; e--) {
        const moe_task tmp = tasks[0];
        tasks[0] = tasks[e];
        tasks[e] = tmp;
        sift_down(tasks, 0, e);
    }
}
