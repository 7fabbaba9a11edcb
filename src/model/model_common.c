#include <math.h>

#include "model/model_internal.h"
#include "ops/cpu/gemm_rowwise.h"

void lm_model_mm(int tA, int tB, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, int accum, float *C, int ldc) {
    const int nb = (M + LM_MODEL_MM_BLK - 1) / LM_MODEL_MM_BLK;
    const int blas0 = lm_blas_get_threads();
    lm_blas_set_threads(1);
    if (nb == 1) {
        /* no parallel region: a serialized one makes libgomp allocate (and free) a
         * one-thread team per call (libgomp 12), i.e. an allocation in the step */
        lm_sgemm(tA, tB, M, N, K, 1.0f, A, lda, B, ldb, accum ? 1.0f : 0.0f, C, ldc);
        lm_blas_set_threads(blas0);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int i = 0; i < nb; i++) {
        const int m0 = i * LM_MODEL_MM_BLK, m = M - m0 < LM_MODEL_MM_BLK ? M - m0 : LM_MODEL_MM_BLK;
        const float *Ai = tA ? A + m0 : A + (int64_t)m0 * lda;
        lm_sgemm(tA, tB, m, N, K, 1.0f, Ai, lda, B, ldb, accum ? 1.0f : 0.0f, C + (int64_t)m0 * ldc,
                 ldc);
    }
    lm_blas_set_threads(blas0);
}

void lm_model_mm_infer(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                       int accum, float *C, int ldc) {
    if (M <= LM_GEMM_ROWWISE_MAX_M)
        lm_gemm_rowwise(M, N, K, A, lda, B, ldb, accum, C, ldc);
    else
        lm_model_mm(0, 1, M, N, K, A, lda, B, ldb, accum, C, ldc);
}

lm_status lm_model_check_finite(const char *layer, const char *what, const char *name,
                                const float *p, int64_t n, lm_error *err) {
    if (!p)
        return lm_errorf(err, LM_ERR_INVALID, "%s %s: '%s' is required", layer, what, name);
    /* blocks scanned branch-free (x * 0 is 0 for a finite x, NaN otherwise; the sum of a
     * block is NaN iff one is not finite), element by element only in a bad block */
    for (int64_t i0 = 0; i0 < n; i0 += 1024) {
        const int64_t i1 = n - i0 < 1024 ? n : i0 + 1024;
        float z = 0.0f;
#pragma omp simd reduction(+ : z)
        for (int64_t i = i0; i < i1; i++)
            z += p[i] * 0.0f;
        if (z == 0.0f)
            continue;
        for (int64_t i = i0; i < i1; i++)
            if (!isfinite(p[i]))
                return lm_errorf(err, LM_ERR_NONFINITE,
                                 "%s %s: '%s' has a non-finite value %g at element %lld", layer,
                                 what, name, (double)p[i], (long long)i);
    }
    return LM_OK;
}
