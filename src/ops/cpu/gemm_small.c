#include "ops/cpu/gemm_small.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LM_HAVE_X86 1
#else
#define LM_HAVE_X86 0
#endif

static int g_force_portable = 0;

void lm_gemm_small_force_portable(int on) { g_force_portable = on; }

int lm_gemm_small_has_avx512(void) {
#if LM_HAVE_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return cached && !g_force_portable;
#else
    return 0;
#endif
}

static void gemm_portable(int M, int N, int K, float alpha, const float *A, ptrdiff_t a_rs,
                          ptrdiff_t a_cs, const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc,
                          int accumulate) {
    float acc[256];
    for (int j0 = 0; j0 < N; j0 += 256) {
        int nb = N - j0 < 256 ? N - j0 : 256;
        for (int i = 0; i < M; i++) {
            for (int j = 0; j < nb; j++) acc[j] = 0.f;
            for (int p = 0; p < K; p++) {
                float a = A[i * a_rs + p * a_cs];
                const float *b = B + p * ldb + j0;
                for (int j = 0; j < nb; j++) acc[j] += a * b[j];
            }
            float *c = C + i * ldc + j0;
            if (accumulate)
                for (int j = 0; j < nb; j++) c[j] += alpha * acc[j];
            else
                for (int j = 0; j < nb; j++) c[j] = alpha * acc[j];
        }
    }
}

#if LM_HAVE_X86
#define LM_AVX512 __attribute__((target("avx512f")))

/* One MR x (16*NV) block of C; MR and NV are compile-time constants at every call
 * site, so the loops below unroll into registers. */
static inline __attribute__((always_inline)) LM_AVX512 void
kern(const int MR, const int NV, int K, float alpha, const float *A, ptrdiff_t a_rs,
     ptrdiff_t a_cs, const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc, int accumulate,
     __mmask16 mlast) {
    __m512 acc[8][2];
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();
    for (int p = 0; p < K; p++) {
        __m512 b[2];
        for (int v = 0; v < NV; v++) {
            __mmask16 m = (v == NV - 1) ? mlast : (__mmask16)0xFFFF;
            b[v] = _mm512_maskz_loadu_ps(m, B + p * ldb + 16 * v);
        }
        const float *ap = A + p * a_cs;
        for (int i = 0; i < MR; i++) {
            __m512 a = _mm512_set1_ps(ap[i * a_rs]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
        }
    }
    __m512 al = _mm512_set1_ps(alpha);
    for (int i = 0; i < MR; i++) {
        for (int v = 0; v < NV; v++) {
            __mmask16 m = (v == NV - 1) ? mlast : (__mmask16)0xFFFF;
            float *c = C + i * ldc + 16 * v;
            __m512 r = _mm512_mul_ps(al, acc[i][v]);
            if (accumulate) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, c));
            _mm512_mask_storeu_ps(c, m, r);
        }
    }
}

#define KERN_CASES(NV)                                                                             \
    switch (mr) {                                                                                  \
    case 8: kern(8, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    case 7: kern(7, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    case 6: kern(6, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    case 5: kern(5, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    case 4: kern(4, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    case 3: kern(3, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    case 2: kern(2, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;      \
    default: kern(1, NV, K, alpha, Ai, a_rs, a_cs, Bj, ldb, Cij, ldc, accumulate, ml); break;     \
    }

static LM_AVX512 void gemm_avx512(int M, int N, int K, float alpha, const float *A, ptrdiff_t a_rs,
                                  ptrdiff_t a_cs, const float *B, ptrdiff_t ldb, float *C,
                                  ptrdiff_t ldc, int accumulate) {
    for (int j0 = 0; j0 < N; j0 += 32) {
        int nc = N - j0 < 32 ? N - j0 : 32;
        int nv = (nc + 15) / 16;
        int tail = nc - 16 * (nv - 1);
        __mmask16 ml = (__mmask16)((1u << tail) - 1u);
        const float *Bj = B + j0;
        for (int i0 = 0; i0 < M; i0 += 8) {
            int mr = M - i0 < 8 ? M - i0 : 8;
            const float *Ai = A + i0 * a_rs;
            float *Cij = C + i0 * ldc + j0;
            if (nv == 2) {
                KERN_CASES(2)
            } else {
                KERN_CASES(1)
            }
        }
    }
}
#endif

void lm_gemm_small(int M, int N, int K, float alpha, const float *A, ptrdiff_t a_rs, ptrdiff_t a_cs,
                   const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc, int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate)
            for (int i = 0; i < M; i++) memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
        return;
    }
#if LM_HAVE_X86
    if (lm_gemm_small_has_avx512()) {
        gemm_avx512(M, N, K, alpha, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
        return;
    }
#endif
    gemm_portable(M, N, K, alpha, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
}

void lm_gemm_small_nt(int M, int N, int K, float alpha, const float *A, ptrdiff_t lda,
                      const float *Bt, ptrdiff_t ldbt, float *C, ptrdiff_t ldc, int accumulate,
                      float *pack) {
    for (int j = 0; j < N; j++)
        for (int p = 0; p < K; p++) pack[p * N + j] = Bt[j * ldbt + p];
    lm_gemm_small(M, N, K, alpha, A, lda, 1, pack, N, C, ldc, accumulate);
}
