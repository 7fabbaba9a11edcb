/* Row-wise GEMM (gemm_rowwise.h): each row of A against tiles of 16 rows of B (columns
 * of C at fixed offsets, multiples of 16), one 16-lane accumulator per column over k, then
 * one transpose-add tree for the 16 sums. The arithmetic of C[m, n] depends on n's place
 * in its tile, which is the same in every call, and never on m or M. Threads split the
 * column tiles. */
#include "ops/cpu/gemm_rowwise.h"

#include <string.h>

#include "linmoe/core.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* The 16 sums of a[0..15]'s lanes: out[j] = sum of a[j] (a transpose-add tree whose shape
 * depends on j only, never on the row). */
static inline __m512 reduce16(const __m512 *a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

/* One row of A against B rows n0 .. n0+nb-1 (nb <= 16; missing rows repeat the first and
 * are not stored). Sixteen named accumulators and one row stride, so that they all stay
 * in registers (an array of them was spilled to the stack by gcc 12). */
static void tile(int nb, int K, const float *a, const float *B, int ldb, int accum, float *c) {
#define ROW(j) (B + (int64_t)((j) < nb ? (j) : 0) * ldb)
    const float *r0 = ROW(0), *r1 = ROW(1), *r2 = ROW(2), *r3 = ROW(3), *r4 = ROW(4), *r5 = ROW(5),
                *r6 = ROW(6), *r7 = ROW(7), *r8 = ROW(8), *r9 = ROW(9), *r10 = ROW(10),
                *r11 = ROW(11), *r12 = ROW(12), *r13 = ROW(13), *r14 = ROW(14), *r15 = ROW(15);
#undef ROW
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0,
           c8 = c0, c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
    int k = 0;
#define STEP(M)                                                                                    \
    do {                                                                                           \
        const __m512 x = _mm512_maskz_loadu_ps(M, a + k);                                          \
        c0 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r0 + k), c0);                             \
        c1 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r1 + k), c1);                             \
        c2 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r2 + k), c2);                             \
        c3 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r3 + k), c3);                             \
        c4 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r4 + k), c4);                             \
        c5 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r5 + k), c5);                             \
        c6 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r6 + k), c6);                             \
        c7 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r7 + k), c7);                             \
        c8 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r8 + k), c8);                             \
        c9 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r9 + k), c9);                             \
        c10 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r10 + k), c10);                          \
        c11 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r11 + k), c11);                          \
        c12 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r12 + k), c12);                          \
        c13 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r13 + k), c13);                          \
        c14 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r14 + k), c14);                          \
        c15 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(M, r15 + k), c15);                          \
    } while (0)
    /* the full 16-float steps unmasked (a mask of all ones: the same arithmetic) */
    for (; k + 16 <= K; k += 16)
        STEP((__mmask16)0xffff);
    if (k < K)
        STEP((__mmask16)((1u << (K - k)) - 1));
#undef STEP
    const __m512 acc[16] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15};
    const __mmask16 ms = nb >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nb) - 1);
    __m512 r = reduce16(acc);
    if (accum)
        r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(ms, c));
    _mm512_mask_storeu_ps(c, ms, r);
}
#else
/* Portable: each element a 16-lane sum over k, then the same fixed tree. */
static void tile(int nb, int K, const float *a, const float *B, int ldb, int accum, float *c) {
    for (int j = 0; j < nb; j++) {
        const float *b = B + (int64_t)j * ldb;
        float lane[16] = {0};
        for (int k = 0; k < K; k++)
            lane[k % 16] += a[k] * b[k];
        for (int w = 8; w >= 1; w /= 2)
            for (int l = 0; l < w; l++)
                lane[l] += lane[l + w];
        c[j] = accum ? c[j] + lane[0] : lane[0];
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
    const int nt = (N + 15) / 16;
    const int64_t work = (int64_t)M * N * K;
#pragma omp parallel for schedule(static) if (work >= (1 << 17))
    for (int t = 0; t < nt; t++) {
        const int n0 = 16 * t, nb = N - n0 < 16 ? N - n0 : 16;
        for (int m = 0; m < M; m++)
            tile(nb, K, A + (int64_t)m * lda, B + (int64_t)n0 * ldb, ldb, accum,
                 C + (int64_t)m * ldc + n0);
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
