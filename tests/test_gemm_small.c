/* The small-matrix kernel behind the chunked KDA tiles (src/ops/cpu/gemm_small.c):
 * the AVX-512 register-blocked path and the portable C path, each against an fp64
 * triple loop, on the shapes the kernels use (16..64 rows, 16..256 columns, tails
 * that are not multiples of 16 or 8), strided / transposed A, accumulate and alpha;
 * and the whole KDA forward+backward with the portable path forced, against the
 * default path. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/kda.h"
#include "ops/cpu/gemm_small.h"
#include "test_util.h"

static void ref_gemm(int M, int N, int K, double alpha, const float *A, ptrdiff_t a_rs,
                     ptrdiff_t a_cs, const float *B, ptrdiff_t ldb, const float *C0, ptrdiff_t ldc,
                     int accumulate, double *out) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int p = 0; p < K; p++) s += (double)A[i * a_rs + p * a_cs] * B[p * ldb + j];
            out[(size_t)i * N + j] = alpha * s + (accumulate ? C0[i * ldc + j] : 0.0);
        }
}

static void check_shapes(int portable) {
    static const int dims[][3] = {{16, 16, 128}, {32, 48, 128}, {64, 128, 64}, {7, 13, 5},
                                  {64, 100, 60}, {1, 1, 1},     {9, 33, 17},  {16, 256, 128},
                                  {64, 64, 0}};
    lm_gemm_small_force_portable(portable);
    for (size_t s = 0; s < sizeof(dims) / sizeof(dims[0]); s++) {
        const int M = dims[s][0], N = dims[s][1], K = dims[s][2];
        for (int transA = 0; transA < 2; transA++)
            for (int acc = 0; acc < 2; acc++) {
                const ptrdiff_t lda = K + 3, ldb = N + 5, ldc = N + 2;
                double *a64 = malloc(sizeof(double) * (size_t)(M + 1) * (lda + M + 1));
                double *b64 = malloc(sizeof(double) * (size_t)(K + 1) * ldb);
                double *c64 = malloc(sizeof(double) * (size_t)M * ldc);
                int64_t na = (int64_t)(M + 1) * (lda + M + 1), nb = (int64_t)(K + 1) * ldb;
                lm_fill_normal(a64, na, 100 + s, 0, 1);
                lm_fill_normal(b64, nb, 200 + s, 0, 1);
                lm_fill_normal(c64, (int64_t)M * ldc, 300 + s, 0, 1);
                float *A = lm_to_f32(a64, na), *B = lm_to_f32(b64, nb);
                float *C = lm_to_f32(c64, (int64_t)M * ldc), *C0 = lm_to_f32(c64, (int64_t)M * ldc);
                /* A as [M,K] with row stride lda, or as the transpose of a [K,M] buffer */
                ptrdiff_t a_rs = transA ? 1 : lda, a_cs = transA ? (M + 1) : 1;
                double *ref = malloc(sizeof(double) * (size_t)M * N + 1);
                ref_gemm(M, N, K, 0.75, A, a_rs, a_cs, B, ldb, C0, ldc, acc, ref);
                lm_gemm_small(M, N, K, 0.75f, A, a_rs, a_cs, B, ldb, C, ldc, acc);
                float *got = malloc(sizeof(float) * (size_t)M * N + 1);
                for (int i = 0; i < M; i++) memcpy(got + (size_t)i * N, C + i * ldc, sizeof(float) * N);
                char name[128];
                snprintf(name, sizeof(name), "%s M%d N%d K%d transA%d acc%d", portable ? "portable" : "default", M,
                         N, K, transA, acc);
                assert_true(lm_check_f32(name, got, ref, (int64_t)M * N, TOL_FWD_F32));
                /* padding columns between rows of C are never written */
                for (int i = 0; i < M; i++)
                    for (ptrdiff_t j = N; j < ldc; j++) assert_true(C[i * ldc + j] == C0[i * ldc + j]);
                free(a64), free(b64), free(c64), free(A), free(B), free(C), free(C0), free(ref), free(got);
            }
    }
    lm_gemm_small_force_portable(0);
}

static void test_default_path(void **state) {
    (void)state;
    print_message("AVX-512 kernel in use: %d\n", lm_gemm_small_has_avx512());
    check_shapes(0);
}

static void test_portable_path(void **state) {
    (void)state;
    check_shapes(1);
}

/* The op through the portable kernel equals the op through the default one to
 * fp32 rounding (different summation blocking only). */
static void test_kda_portable_equals_default(void **state) {
    (void)state;
    const int B = 1, T = 150, H = 2, K = 48, V = 40;
    lm_kda_config c;
    lm_kda_config_default(&c, B, T, H, H, K, V);
    c.gate = LM_GATE_BOUNDED;
    c.has_lower_bound = 1;
    c.lower_bound = -5.0f;
    c.use_qk_l2norm_in_kernel = 1;
    int64_t nq = (int64_t)B * T * H * K, nv = (int64_t)B * T * H * V, nb = (int64_t)B * T * H;
    double *tmp = malloc(sizeof(double) * (size_t)nq);
    float *q, *k, *g, *v, *beta, *dO;
    lm_fill_normal(tmp, nq, 1, 0, 1), q = lm_to_f32(tmp, nq);
    lm_fill_normal(tmp, nq, 2, 0, 1), k = lm_to_f32(tmp, nq);
    lm_fill_normal(tmp, nq, 3, 0, 2), g = lm_to_f32(tmp, nq);
    lm_fill_normal(tmp, nv, 4, 0, 1), v = lm_to_f32(tmp, nv);
    lm_fill_uniform(tmp, nb, 5, 0.05, 1), beta = lm_to_f32(tmp, nb);
    lm_fill_normal(tmp, nv, 6, 0, 1), dO = lm_to_f32(tmp, nv);
    lm_kda_inputs in = {q, k, v, g, beta, NULL, NULL, NULL};
    float *o[2], *dq[2], *dg[2];
    for (int pass = 0; pass < 2; pass++) {
        lm_gemm_small_force_portable(pass);
        o[pass] = malloc(sizeof(float) * (size_t)nv);
        dq[pass] = malloc(sizeof(float) * (size_t)nq);
        dg[pass] = malloc(sizeof(float) * (size_t)nq);
        lm_kda_outputs out = {o[pass], NULL};
        lm_kda_grads gr = {dO, NULL, dq[pass], NULL, NULL, dg[pass], NULL, NULL, NULL, NULL};
        lm_error err;
        assert_int_equal(lm_kda_chunk_forward(&c, &in, &out, &err), LM_OK);
        assert_int_equal(lm_kda_chunk_backward(&c, &in, &gr, &err), LM_OK);
    }
    lm_gemm_small_force_portable(0);
    double *o0 = lm_to_f64(o[0], nv), *dq0 = lm_to_f64(dq[0], nq), *dg0 = lm_to_f64(dg[0], nq);
    assert_true(lm_check_f32("kda o portable vs default", o[1], o0, nv, 1e-6));
    assert_true(lm_check_f32("kda dq portable vs default", dq[1], dq0, nq, 1e-5));
    assert_true(lm_check_f32("kda dg portable vs default", dg[1], dg0, nq, 1e-5));
    free(o0), free(dq0), free(dg0);
    for (int pass = 0; pass < 2; pass++) free(o[pass]), free(dq[pass]), free(dg[pass]);
    free(tmp), free(q), free(k), free(g), free(v), free(beta), free(dO);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_path),
        cmocka_unit_test(test_portable_path),
        cmocka_unit_test(test_kda_portable_equals_default),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
