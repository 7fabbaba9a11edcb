/* Row-wise inference GEMM (src/ops/cpu/gemm_rowwise.h): C (+)= A B^T against an fp64
 * reference (1e-5 relative RMS, DESIGN.md's fp32 forward bar), and every row of an M-row
 * product bit for bit equal to the same row computed alone, for M = 1 .. 64, K not a
 * multiple of 16 and N not a multiple of 4, with and without accumulation, on 1 and 2
 * threads. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/core.h"
#include "ops/cpu/gemm_rowwise.h"
#include "test_util.h"

static void test_rowwise(void **state) {
    (void)state;
    const int shapes[][2] = {{1, 1}, {7, 5}, {130, 37}, {128, 128}, {385, 129}};
    lm_rng r;
    lm_rng_init(&r, 3);
    int checked = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int N = shapes[si][0], K = shapes[si][1];
        for (int M = 1; M <= 64; M += (M < 8 ? 1 : 9)) {
            const int lda = K + 3, ldb = K + 1, ldc = N + 2;
            float *A = malloc(sizeof(float) * (size_t)M * lda),
                  *B = malloc(sizeof(float) * (size_t)N * ldb);
            float *C = malloc(sizeof(float) * (size_t)M * ldc),
                  *C1 = malloc(sizeof(float) * (size_t)ldc);
            for (int i = 0; i < M * lda; i++)
                A[i] = (float)lm_rng_normal(&r);
            for (int i = 0; i < N * ldb; i++)
                B[i] = (float)lm_rng_normal(&r);
            for (int accum = 0; accum < 2; accum++)
                for (int th = 1; th <= 2; th++) {
                    lm_set_num_threads(th);
                    for (int i = 0; i < M * ldc; i++)
                        C[i] = accum ? 0.5f * (float)(i % 7) : NAN;
                    lm_gemm_rowwise(M, N, K, A, lda, B, ldb, accum, C, ldc);
                    double *ref = malloc(sizeof(double) * (size_t)M * N);
                    float *got = malloc(sizeof(float) * (size_t)M * N);
                    for (int m = 0; m < M; m++)
                        for (int n = 0; n < N; n++) {
                            double s = accum ? 0.5 * ((m * ldc + n) % 7) : 0;
                            for (int k = 0; k < K; k++)
                                s += (double)A[m * lda + k] * B[n * ldb + k];
                            ref[m * N + n] = s;
                            got[m * N + n] = C[m * ldc + n];
                        }
                    assert_true(lm_compare_f32(got, ref, (int64_t)M * N, TOL_FWD_F32).pass);
                    for (int m = 0; m < M; m++) { /* each row alone */
                        for (int n = 0; n < ldc; n++)
                            C1[n] = accum ? 0.5f * (float)((m * ldc + n) % 7) : NAN;
                        lm_gemm_rowwise(1, N, K, A + (size_t)m * lda, lda, B, ldb, accum, C1, ldc);
                        assert_memory_equal(C1, C + (size_t)m * ldc, sizeof(float) * (size_t)N);
                    }
                    free(ref);
                    free(got);
                    checked++;
                }
            free(A), free(B), free(C), free(C1);
        }
    }
    printf("gemm_rowwise: %d products (M 1..64, N up to 385, K up to 129) within 1e-5 of fp64, "
           "every row bitwise equal to the row alone\n",
           checked);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_rowwise)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
