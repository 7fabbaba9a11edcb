/* Row-wise GEMM for the inference path (serving): C[M, N] (+)= A[M, K] B[N, K]^T, fp32,
 * row-major with leading dimensions lda, ldb, ldc, where every element is computed by
 * the same instruction sequence whatever M, the row's index and the thread count: 16
 * fp32 lanes accumulate A[m, k] B[n, k] over k = lane (mod 16) in increasing k, then one
 * fixed horizontal sum. So a row of a decode batch gets bit for bit the result it gets
 * alone (B = 1): a served sequence decodes exactly as `linmoe generate` runs it,
 * whatever else is in the batch. It also skips OpenBLAS's packing of B, which dominates
 * for the few rows of a decode step. Used for inference GEMMs of at most
 * LM_GEMM_ROWWISE_MAX_M rows (lm_gemm_infer). Not a public API. */
#ifndef LINMOE_OPS_CPU_GEMM_ROWWISE_H
#define LINMOE_OPS_CPU_GEMM_ROWWISE_H

#include <stdint.h>

#define LM_GEMM_ROWWISE_MAX_M 64

void lm_gemm_rowwise(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                     int accum, float *C, int ldc);

/* The same product on the calling thread only (for callers inside a parallel loop). */
void lm_gemm_rowwise_serial(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                            int accum, float *C, int ldc);

/* Inference GEMMs (transA = 0, transB = 1): lm_gemm_rowwise for M <= LM_GEMM_ROWWISE_MAX_M,
 * else a single-threaded lm_sgemm. */
void lm_gemm_infer(int M, int N, int K, const float *A, int lda, const float *B, int ldb, int accum,
                   float *C, int ldc);

#endif
