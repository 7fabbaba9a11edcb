/* Row-major fp32 GEMM through OpenBLAS's CBLAS interface. */
#include "linmoe/core.h"

#include <cblas.h>

#include <stdlib.h>
#include <string.h>

/* Declared by OpenBLAS's cblas.h; repeated here for CBLAS headers that omit them. */
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);
char *openblas_get_corename(void);

const char *lm_blas_corename(void) {
    const char *n = openblas_get_corename();
    return n ? n : "unknown";
}

const char *lm_blas_better_coretype(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    /* the pre-AVX cores OpenBLAS falls back to for a CPU model it does not know */
    static const char *const generic[] = {"Prescott",  "Core2",  "Penryn", "Dunnington",
                                          "Nehalem",   "Atom",   "Katmai", "Coppermine",
                                          "Northwood", "Banias", "unknown"};
    const char *core = lm_blas_corename();
    int is_generic = 0;
    for (size_t i = 0; i < sizeof generic / sizeof generic[0]; i++)
        is_generic |= strcmp(core, generic[i]) == 0;
    if (!is_generic)
        return NULL;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "Haswell";
#endif
    return NULL;
}

void lm_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc) {
    LM_CHECK(M >= 0 && N >= 0 && K >= 0);
    if (M == 0 || N == 0)
        return;
    /* Row-major leading dimensions: the row length of each stored matrix. */
    LM_CHECK(lda >= (transA ? (M > 1 ? M : 1) : (K > 1 ? K : 1)));
    LM_CHECK(ldb >= (transB ? (K > 1 ? K : 1) : (N > 1 ? N : 1)));
    LM_CHECK(ldc >= N);
    cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                transB ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static int g_blas_default = 0;

/* n <= 0 restores OpenBLAS's own default (OPENBLAS_NUM_THREADS or the core count). */
void lm_blas_set_threads(int n) {
    if (g_blas_default == 0)
        g_blas_default = openblas_get_num_threads();
    openblas_set_num_threads(n > 0 ? n : g_blas_default);
}

int lm_blas_get_threads(void) { return openblas_get_num_threads(); }
