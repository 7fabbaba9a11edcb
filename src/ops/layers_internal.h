/* Helpers shared by the layer ops (include/linmoe/layers.h): input validation, the
 * single-threaded-BLAS guard used by every task-parallel matmul loop, and the
 * sigmoid / SiLU pieces. Not part of the public API. */
#ifndef LINMOE_OPS_LAYERS_INTERNAL_H
#define LINMOE_OPS_LAYERS_INTERNAL_H

#include <math.h>
#include <stdint.h>

#include "linmoe/layers.h"
#include "ops/cpu/kda_internal.h" /* lm_fexp: the vectorisable fp32 exp */

/* Parallel regions below this many elements run on one thread (OpenMP start-up
 * costs more than the work). Results do not depend on it. */
#define LM_LAYERS_PAR_MIN 16384

/* Index of the first non-finite element of block b (4096 elements) of x[0..n), or
 * INT64_MAX. The block is tested with sum(x * 0), which is 0 exactly when every
 * element is finite (x * 0 is NaN for NaN and +-Inf), so the common case is one
 * vectorised pass. */
#define LM_LAYERS_FINITE_BLOCK 4096
static inline int64_t lm_layers_block_nonfinite(const float *x, int64_t n, int64_t b) {
    const int64_t i0 = b * LM_LAYERS_FINITE_BLOCK;
    const int64_t i1 = i0 + LM_LAYERS_FINITE_BLOCK < n ? i0 + LM_LAYERS_FINITE_BLOCK : n;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = i0; i < i1; i++)
        acc += x[i] * 0.0f;
    if (acc != 0.0f) /* NaN compares unequal */
        for (int64_t i = i0; i < i1; i++)
            if (!isfinite(x[i]))
                return i;
    return INT64_MAX;
}

/* Index of the first non-finite element of x[0..n), or -1. Small inputs are a plain
 * loop outside any OpenMP region (a one-thread region still enters the runtime,
 * which allocates a team for it). */
static inline int64_t lm_layers_first_nonfinite(const float *x, int64_t n) {
    const int64_t nb = (n + LM_LAYERS_FINITE_BLOCK - 1) / LM_LAYERS_FINITE_BLOCK;
    int64_t first = INT64_MAX;
    if (n > 4 * LM_LAYERS_PAR_MIN) {
#pragma omp parallel for schedule(static) reduction(min : first)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = lm_layers_block_nonfinite(x, n, b);
            first = i < first ? i : first;
        }
    } else {
        for (int64_t b = 0; b < nb && first == INT64_MAX; b++)
            first = lm_layers_block_nonfinite(x, n, b);
    }
    return first == INT64_MAX ? -1 : first;
}

/* LM_OK when x (n elements, rows of `cols`) is finite; otherwise LM_ERR_NONFINITE
 * naming the op, the input, the value and its position (row, column). x == NULL is OK. */
static inline lm_status lm_layers_check_finite(const char *op, const char *name, const float *x,
                                               int64_t n, int64_t cols, lm_error *err) {
    if (!x || n <= 0)
        return LM_OK;
    int64_t i = lm_layers_first_nonfinite(x, n);
    if (i < 0)
        return LM_OK;
    if (cols <= 0)
        cols = 1;
    return lm_errorf(err, LM_ERR_NONFINITE,
                     "%s: input '%s' has a non-finite value (%g) at element %lld (row %lld, "
                     "column %lld)",
                     op, name, (double)x[i], (long long)i, (long long)(i / cols),
                     (long long)(i % cols));
}

/* sigmoid(x) = 1 / (1 + e^-x) in fp32; exact 0 / 1 in the tails, vectorises. */
static inline float lm_layers_sigmoid(float x) { return 1.0f / (1.0f + lm_fexp(-x)); }

/* OpenBLAS runs one thread per task inside our parallel regions (so a task's result
 * does not depend on how many threads there are); the caller's count comes back after. */
typedef struct {
    int saved;
} lm_layers_blas_guard;

static inline lm_layers_blas_guard lm_layers_blas_single(void) {
    lm_layers_blas_guard g = {lm_blas_get_threads()};
    lm_blas_set_threads(1);
    return g;
}

static inline void lm_layers_blas_restore(lm_layers_blas_guard g) { lm_blas_set_threads(g.saved); }

#endif
