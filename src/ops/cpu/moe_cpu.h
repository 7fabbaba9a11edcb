/* Internals of the CPU MoE layer (include/linmoe/moe.h): the context layout shared
 * by the orchestration in src/ops/moe.c and the kernels in cpu/moe_experts.c, the
 * work items ("tasks") the parallel loops run, and a switch the benchmark uses to
 * compare the two threading strategies.
 *
 * Threading. Every GEMM is a single-threaded OpenBLAS call on a fixed piece of
 * work (one expert segment, or a fixed block of rows / columns whose size does not
 * depend on the thread count); the pieces run in an OpenMP loop with dynamic
 * scheduling, largest first. The alternative (pieces in sequence, each GEMM on
 * OpenBLAS's own threads) is kept behind lm_moe_cpu_set_threaded_blas for the
 * measurement in `linmoe bench moe` (docs/perf-notes.md).
 */
#ifndef LINMOE_OPS_CPU_MOE_CPU_H
#define LINMOE_OPS_CPU_MOE_CPU_H

#include <stdint.h>

#include "linmoe/moe.h"

/* Work items of the parallel loops. Each writes a disjoint part of the outputs, so
 * the order they run in never changes a result. */
typedef enum {
    MOE_T_EXPERT = 0,     /* a = expert: forward or backward of its whole segment */
    MOE_T_SHARED_ROWS,    /* token rows [a, b): shared experts forward / backward (dx part) */
    MOE_T_SHARED_DDOWN,   /* rows [a, b) of d: d shared_experts.down_proj */
    MOE_T_SHARED_DGATEUP, /* rows [a, b) of fs: d shared_experts.gate_proj and .up_proj */
    MOE_T_ROUTER_DW,      /* columns [a, b) of d: d gate.weight */
    MOE_T_DX_ROWS,        /* token rows [a, b): dx += dlogits W_r + routed dx rows */
    MOE_T_LOGITS_ROWS     /* token rows [a, b): logits = x W_r^T */
} moe_task_kind;

typedef struct {
    int kind;
    int a, b;
    double cost; /* FLOP estimate, for largest-first ordering */
} moe_task;

/* Fixed block sizes (never derived from the thread count: determinism). */
#define MOE_ROW_BLOCK 256 /* token rows per shared / logits / dx task */
#define MOE_DIM_BLOCK 64  /* output rows or columns per weight-gradient task */

struct lm_moe_ctx {
    lm_moe_config c;
    int E, k, d, f, fs;
    int max_T;
    int T;        /* tokens of the last forward; 0: no forward yet */
    int infer;    /* lm_moe_set_inference: row-wise expert GEMMs */
    int training; /* flag of the last forward */
    float aux_scale; /* factor on the aux loss's gradient in the backward (default 1) */
    lm_route route;
    /* permutation of the last forward: expert e owns rows [seg_off[e], seg_off[e+1])
     * of the permuted buffers, tokens in increasing order inside a segment */
    int64_t *seg_off;   /* [E+1] */
    int64_t *cursor;    /* [E] */
    int32_t *perm_slot; /* [max_T*k] permuted row -> assignment t*k+j */
    int32_t *row_of;    /* [max_T*k] assignment t*k+j -> permuted row, -1: dropped */
    moe_task *tasks;    /* [max_tasks] */
    int max_tasks;
    /* per token */
    float *logits, *dlogits; /* [max_T, E] */
    float *dw;               /* [max_T, k] d topk_weight */
    /* per permuted row (assignment) */
    float *xp; /* [max_T*k, d]  gathered x */
    float *H;  /* [max_T*k, 2f] [gate | up] pre-activations */
    float *A;  /* [max_T*k, f]  silu(gate) * up */
    float *Y;  /* [max_T*k, d]  forward: expert outputs; backward: dout rows, then dx rows */
    float *G;  /* [max_T*k, f]  backward: dout W_down, then da */
    float *dH; /* [max_T*k, 2f] backward: [d gate | d up] */
    /* shared experts, per token */
    float *Hs, *As, *Gs, *dHs; /* [max_T, 2fs], [max_T, fs], [max_T, fs], [max_T, 2fs] */
    void *mem;                 /* the one allocation all of the above live in */
};

/* Run tasks[0..n) in parallel (largest first) in `phase` of forward or backward.
 * Sets OpenBLAS to one thread for the duration and restores it. */
typedef struct {
    lm_moe_ctx *ctx;
    const lm_moe_weights *w;
    const float *x, *dout;
    float *out, *dx;
    lm_moe_grads *g;
    int backward;
    int infer; /* forward without training: row-wise GEMMs for small segments */
} moe_run;

void lm_moe_cpu_run_tasks(const moe_run *run, moe_task *tasks, int n);
/* Forward combine: out[t] (+)= sum_j keep * w[t,j] * Y[row_of[t,j]], rows [0, T). */
void lm_moe_cpu_combine(const moe_run *run);
/* Sort tasks by cost, largest first (ties: kind, then a). */
void lm_moe_cpu_sort_tasks(moe_task *tasks, int n);

/* SwiGLU of m rows (the routed experts' and the expert-parallel layer's,
 * src/dist/moe_ep.c, so both run the same arithmetic): a = silu(g) * u from H rows
 * [g (f) | u (f)] (row stride ldh) into A; backward from da (rows of G): dg = da * u *
 * silu'(g), du = da * silu(g) into dH rows [dg | du]. */
void lm_moe_cpu_swiglu_fwd(int64_t m, int f, const float *H, int64_t ldh, float *A, int64_t lda);
void lm_moe_cpu_swiglu_bwd(int64_t m, int f, const float *H, int64_t ldh, const float *G,
                           int64_t ldg, float *dH, int64_t lddh);

/* Benchmark switch: 1 runs the tasks one after another with every GEMM on
 * OpenBLAS's threads (as set by lm_blas_set_threads), 0 (default) runs tasks in
 * parallel with single-threaded GEMMs. Results are identical either way only up
 * to OpenBLAS's own partitioning; tests use the default. */
void lm_moe_cpu_set_threaded_blas(int on);
int lm_moe_cpu_threaded_blas(void);

#endif
