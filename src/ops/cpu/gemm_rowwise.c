/* Row-wise GEMM (gemm_rowwise.h): every element C[m, n] is one 16-lane accumulator over k
 * (lane = k mod 16, increasing k, one FMA per step), then one transpose-add tree for the
 * 16 lanes, whose shape is the same for every element. Two kernels compute exactly that:
 * 4 rows x 4 columns at once (the weight rows loaded once for the 4 rows: 8 loads per 16
 * FMAs; also for 2 or 3 rows) and, for a single row, 1 row x 16 columns. Which one computes an
 * element changes nothing in its arithmetic, so a row's result never depends on m, M or the thread
 * count. The loop order keeps a block of 16 weight rows in L1 while every row of A passes over it
 * (the weights are read from memory once per call, whatever M). Threads split the column blocks. */
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

/* Rows a[0..nr-1] (stride lda, nr <= 4) against B rows 0..nc-1 (nc <= 4): the 16
 * accumulators are (row r, column j) -> r * 4 + j, so reduce16's lanes 4r..4r+3 are row
 * r's 4 results. Missing rows and columns repeat the first and are not stored. */
static void tile4x4(int nr, int nc, int K, const float *a, int lda, const float *B, int ldb,
                    int accum, float *c, int ldc) {
    const float *a0 = a, *a1 = a + (int64_t)(nr > 1) * lda, *a2 = a + (int64_t)(nr > 2) * 2 * lda,
                *a3 = a + (int64_t)(nr > 3) * 3 * lda;
    const float *b0 = B, *b1 = B + (int64_t)(nc > 1) * ldb, *b2 = B + (int64_t)(nc > 2) * 2 * ldb,
                *b3 = B + (int64_t)(nc > 3) * 3 * ldb;
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00,
           c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00,
           c32 = c00, c33 = c00;
    int k = 0;
#define STEP(M)                                                                                    \
    do {                                                                                           \
        const __m512 x0 = _mm512_maskz_loadu_ps(M, a0 + k), x1 = _mm512_maskz_loadu_ps(M, a1 + k), \
                     x2 = _mm512_maskz_loadu_ps(M, a2 + k), x3 = _mm512_maskz_loadu_ps(M, a3 + k); \
        __m512 w = _mm512_maskz_loadu_ps(M, b0 + k);                                               \
        c00 = _mm512_fmadd_ps(x0, w, c00);                                                         \
        c10 = _mm512_fmadd_ps(x1, w, c10);                                                         \
        c20 = _mm512_fmadd_ps(x2, w, c20);                                                         \
        c30 = _mm512_fmadd_ps(x3, w, c30);                                                         \
        w = _mm512_maskz_loadu_ps(M, b1 + k);                                                      \
        c01 = _mm512_fmadd_ps(x0, w, c01);                                                         \
        c11 = _mm512_fmadd_ps(x1, w, c11);                                                         \
        c21 = _mm512_fmadd_ps(x2, w, c21);                                                         \
        c31 = _mm512_fmadd_ps(x3, w, c31);                                                         \
        w = _mm512_maskz_loadu_ps(M, b2 + k);                                                      \
        c02 = _mm512_fmadd_ps(x0, w, c02);                                                         \
        c12 = _mm512_fmadd_ps(x1, w, c12);                                                         \
        c22 = _mm512_fmadd_ps(x2, w, c22);                                                         \
        c32 = _mm512_fmadd_ps(x3, w, c32);                                                         \
        w = _mm512_maskz_loadu_ps(M, b3 + k);                                                      \
        c03 = _mm512_fmadd_ps(x0, w, c03);                                                         \
        c13 = _mm512_fmadd_ps(x1, w, c13);                                                         \
        c23 = _mm512_fmadd_ps(x2, w, c23);                                                         \
        c33 = _mm512_fmadd_ps(x3, w, c33);                                                         \
    } while (0)
    for (; k + 16 <= K; k += 16)
        STEP((__mmask16)0xffff);
    if (k < K)
        STEP((__mmask16)((1u << (K - k)) - 1));
#undef STEP
    const __m512 acc[16] = {c00, c01, c02, c03, c10, c11, c12, c13,
                            c20, c21, c22, c23, c30, c31, c32, c33};
    const __m512 r = reduce16(acc);
    const __m128 v[4] = {_mm512_extractf32x4_ps(r, 0), _mm512_extractf32x4_ps(r, 1),
                         _mm512_extractf32x4_ps(r, 2), _mm512_extractf32x4_ps(r, 3)};
    const __mmask8 ms = (__mmask8)((1u << nc) - 1);
    for (int i = 0; i < nr; i++) {
        float *ci = c + (int64_t)i * ldc;
        _mm_mask_storeu_ps(ci, ms, accum ? _mm_add_ps(v[i], _mm_maskz_loadu_ps(ms, ci)) : v[i]);
    }
}
#define HAVE_TILE4X4 1
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

/* Column blocks t0 .. t1-1 of 16 columns. */
static void gemm_blocks(int t0, int t1, int M, int N, int K, const float *A, int lda,
                        const float *B, int ldb, int accum, float *C, int ldc) {
    for (int t = t0; t < t1; t++) {
        const int n0 = 16 * t, nb = N - n0 < 16 ? N - n0 : 16;
        const float *Bt = B + (int64_t)n0 * ldb;
        int m = 0;
#ifdef HAVE_TILE4X4
        /* 2 or 3 rows left also go 4 x 4 (fewer loads than 1 x 16 per row) */
        for (; M - m >= 2; m += 4)
            for (int j = 0; j < nb; j += 4)
                tile4x4(M - m < 4 ? M - m : 4, nb - j < 4 ? nb - j : 4, K, A + (int64_t)m * lda,
                        lda, Bt + (int64_t)j * ldb, ldb, accum, C + (int64_t)m * ldc + n0 + j, ldc);
#endif
        for (; m < M; m++)
            tile(nb, K, A + (int64_t)m * lda, Bt, ldb, accum, C + (int64_t)m * ldc + n0);
    }
}

/* M, N or K zero: 1 when there is nothing more to do (C cleared for K = 0). */
static int degenerate(int M, int N, int K, int accum, float *C, int ldc) {
    LM_CHECK(M >= 0 && N >= 0 && K >= 0);
    if (M == 0 || N == 0)
        return 1;
    if (K == 0) {
        if (!accum)
            for (int i = 0; i < M; i++)
                memset(C + (int64_t)i * ldc, 0, sizeof(float) * (size_t)N);
        return 1;
    }
    return 0;
}

void lm_gemm_rowwise(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                     int accum, float *C, int ldc) {
    if (degenerate(M, N, K, accum, C, ldc))
        return;
    const int nt = (N + 15) / 16;
    const int64_t work = (int64_t)M * N * K;
    if (work < (1 << 17)) { /* no parallel region: libgomp allocates a team even for one */
        gemm_blocks(0, nt, M, N, K, A, lda, B, ldb, accum, C, ldc);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int t = 0; t < nt; t++)
        gemm_blocks(t, t + 1, M, N, K, A, lda, B, ldb, accum, C, ldc);
}

void lm_gemm_rowwise_serial(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                            int accum, float *C, int ldc) {
    if (!degenerate(M, N, K, accum, C, ldc))
        gemm_blocks(0, (N + 15) / 16, M, N, K, A, lda, B, ldb, accum, C, ldc);
}

void lm_gemm_infer(int M, int N, int K, const float *A, int lda, const float *B, int ldb, int accum,
                   float *C, int ldc) {
    if (M <= LM_GEMM_ROWWISE_MAX_M) {
        lm_gemm_rowwise(M, N, K, A, lda, B, ldb, accum, C, ldc);
        return;
    }
    lm_sgemm(0, 1, M, N, K, 1.0f, A, lda, B, ldb, accum ? 1.0f : 0.0f, C, ldc);
}
