/* Row-wise GEMM (gemm_rowwise.h): 4 x 4 tiles of (rows of A) x (rows of B), each tile
 * element a 16-lane accumulator over k; rows past the end of a tile repeat the tile's
 * first row and are not stored, so a tile's arithmetic does not depend on how full it
 * is. Threads split the columns (B rows) in fixed tiles. */
#include "ops/cpu/gemm_rowwise.h"

#include <string.h>

#include "linmoe/core.h"

#if defined(__AVX512F__)
#include <immintrin.h>

static void tile(int mb, int nb, int K, const float *A, int lda, const float *B, int ldb, int accum,
                 float *C, int ldc) {
    const float *a[4], *b[4];
    for (int i = 0; i < 4; i++)
        a[i] = A + (int64_t)(i < mb ? i : 0) * lda;
    for (int j = 0; j < 4; j++)
        b[j] = B + (int64_t)(j < nb ? j : 0) * ldb;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        const __m512 b0 = _mm512_maskz_loadu_ps(mk, b[0] + k),
                     b1 = _mm512_maskz_loadu_ps(mk, b[1] + k),
                     b2 = _mm512_maskz_loadu_ps(mk, b[2] + k),
                     b3 = _mm512_maskz_loadu_ps(mk, b[3] + k);
        for (int i = 0; i < 4; i++) {
            const __m512 x = _mm512_maskz_loadu_ps(mk, a[i] + k);
            acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(x, b2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(x, b3, acc[i][3]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            const float s = _mm512_reduce_add_ps(acc[i][j]);
            float *c = C + (int64_t)i * ldc + j;
            *c = accum ? *c + s : s;
        }
}
#else
/* Portable: the same lane structure in scalar code. */
static void tile(int mb, int nb, int K, const float *A, int lda, const float *B, int ldb, int accum,
                 float *C, int ldc) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            const float *a = A + (int64_t)i * lda, *b = B + (int64_t)j * ldb;
            float lane[16] = {0};
            for (int k = 0; k < K; k++)
                lane[k % 16] += a[k] * b[k];
            for (int w = 8; w >= 1; w /= 2)
                for (int l = 0; l < w; l++)
                    lane[l] += lane[l + w];
            float *c = C + (int64_t)i * ldc + j;
            *c = accum ? *c + lane[0] : lane[0];
        }
}
#endif

void lm_gemm_rowwise(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                     int accum, float *C, int ldc) {
    LM_CHECK(M >= 0 && N >= 0 && K >= 0);
    if (M == 0 || N == 0)
        return;
    if (K == 0) {
        if (!accum)
            for (int i = 0; i < M; i++)
                memset(C + (int64_t)i * ldc, 0, sizeof(float) * (size_t)N);
        return;
    }
    const int nt = (N + 3) / 4;
    const int64_t work = (int64_t)M * N * K;
#pragma omp parallel for schedule(static) if (work >= (1 << 17))
    for (int t = 0; t < nt; t++) {
        const int n0 = 4 * t, nb = N - n0 < 4 ? N - n0 : 4;
        for (int m0 = 0; m0 < M; m0 += 4)
            tile(M - m0 < 4 ? M - m0 : 4, nb, K, A + (int64_t)m0 * lda, lda, B + (int64_t)n0 * ldb,
                 ldb, accum, C + (int64_t)m0 * ldc + n0, ldc);
    }
}

void lm_gemm_infer(int M, int N, int K, const float *A, int lda, const float *B, int ldb, int accum,
                   float *C, int ldc) {
    if (M <= LM_GEMM_ROWWISE_MAX_M) {
        lm_gemm_rowwise(M, N, K, A, lda, B, ldb, accum, C, ldc);
        return;
    }
    lm_sgemm(0, 1, M, N, K, 1.0f, A, lda, B, ldb, accum ? 1.0f : 0.0f, C, ldc);
}
