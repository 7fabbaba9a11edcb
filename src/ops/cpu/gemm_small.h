/* Small fp32 matrix products for the chunked kernels (tiles of 16..64 rows by
 * 16..256 columns), where an OpenBLAS call costs more than the arithmetic.
 *
 * C[M,N] = alpha * A[M,K] * B[K,N] (+ C when accumulate), row-major C and B
 * (row stride ldc / ldb, unit column stride), A with arbitrary strides (element
 * A[i,p] at A[i*a_rs + p*a_cs]) so A^T needs no copy. B^T is handled by the
 * `_nt` variant, which packs B^T into a caller scratch buffer first.
 *
 * Dispatch: an AVX-512 register-blocked kernel (8 rows x 32 columns of
 * accumulators, masked column tails) when the CPU has AVX-512F, a portable C
 * loop otherwise. Both accumulate in fp32 in the order p = 0..K-1.
 */
#ifndef LINMOE_OPS_CPU_GEMM_SMALL_H
#define LINMOE_OPS_CPU_GEMM_SMALL_H

#include <stddef.h>

void lm_gemm_small(int M, int N, int K, float alpha, const float *A, ptrdiff_t a_rs, ptrdiff_t a_cs,
                   const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc, int accumulate);

/* C = alpha * A * Bt^T (+C), Bt [N,K] row-major with row stride ldbt; `pack` must
 * hold K*N floats. */
void lm_gemm_small_nt(int M, int N, int K, float alpha, const float *A, ptrdiff_t lda,
                      const float *Bt, ptrdiff_t ldbt, float *C, ptrdiff_t ldc, int accumulate,
                      float *pack);

/* 1 when the AVX-512 path is in use (for the bench report). */
int lm_gemm_small_has_avx512(void);
/* Force the portable path (tests compare both). */
void lm_gemm_small_force_portable(int on);

#endif
