/* The chunked KDA forward's value-column split (src/ops/cpu/kda_chunk.c
 * fwd_value_blocks): with fewer (sequence, value head) tasks than threads each task's
 * V columns run as independent blocks. The outputs and final states must be bitwise
 * those of the unsplit run (1 thread) for split factors 2 and 4 (8 threads over 1, 2
 * or 4 tasks; V = 64, 128, and 96, which does not split), with and without an initial
 * state, packed documents, both gates. The unsplit path itself is checked against
 * fp64 in tests/test_kda.c. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/kda.h"
#include "test_util.h"

static float *randn(int64_t n, uint64_t seed, double std) {
    lm_rng r;
    lm_rng_init(&r, seed);
    float *x = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(std * lm_rng_normal(&r));
    return x;
}

static void run_case(int B, int T, int HV, int D, int gate, int with_h0, int packed) {
    const int H = HV, K = D, V = D;
    lm_kda_config c;
    lm_kda_config_default(&c, B, T, H, HV, K, V);
    c.use_qk_l2norm_in_kernel = 1;
    c.use_beta_sigmoid_in_kernel = 1;
    if (gate) {
        c.gate = LM_GATE_BOUNDED;
        c.has_lower_bound = 1;
        c.lower_bound = -5.0f;
    } else {
        c.gate = LM_GATE_SOFTPLUS;
    }
    const int64_t cu[4] = {0, 37, 37, T};
    if (packed) {
        c.cu_seqlens = cu;
        c.n_cu_seqlens = 4;
    }
    const int N = packed ? 3 : B;
    const int64_t nq = (int64_t)B * T * H * K, nv = (int64_t)B * T * HV * V;
    const int64_t ns = (int64_t)N * HV * K * V;
    float *q = randn(nq, 1, 1), *k = randn(nq, 2, 1), *v = randn(nv, 3, 1);
    float *g = randn((int64_t)B * T * HV * K, 4, 1), *beta = randn((int64_t)B * T * HV, 5, 1);
    float *A = randn(HV, 6, 0.5), *dtb = randn((int64_t)HV * K, 7, 1), *h0 = randn(ns, 8, 0.3);
    lm_kda_inputs in = {q, k, v, g, beta, A, dtb, with_h0 ? h0 : NULL};
    float *o[2], *ht[2];
    const int saved = lm_get_num_threads();
    for (int pass = 0; pass < 2; pass++) {
        lm_set_num_threads(pass ? 8 : 1);
        o[pass] = malloc(sizeof(float) * (size_t)nv);
        ht[pass] = malloc(sizeof(float) * (size_t)ns);
        lm_poison_f32(o[pass], nv);
        lm_poison_f32(ht[pass], ns);
        lm_kda_outputs out = {o[pass], ht[pass]};
        lm_error err = {0};
        lm_status st = lm_kda_chunk_forward(&c, &in, &out, &err);
        if (st != LM_OK)
            fprintf(stderr, "%s\n", err.msg);
        assert_int_equal(st, LM_OK);
    }
    lm_set_num_threads(saved);
    printf("  B=%d T=%d HV=%d D=%d %s%s%s: 8 threads vs 1 bitwise: o %s, final state %s\n", B, T,
           HV, D, gate ? "bounded" : "softplus", with_h0 ? " h0" : "", packed ? " packed" : "",
           memcmp(o[0], o[1], sizeof(float) * (size_t)nv) ? "DIFFER" : "equal",
           memcmp(ht[0], ht[1], sizeof(float) * (size_t)ns) ? "DIFFER" : "equal");
    assert_memory_equal(o[0], o[1], sizeof(float) * (size_t)nv);
    assert_memory_equal(ht[0], ht[1], sizeof(float) * (size_t)ns);
    for (int pass = 0; pass < 2; pass++)
        free(o[pass]), free(ht[pass]);
    free(q), free(k), free(v), free(g), free(beta), free(A), free(dtb), free(h0);
}

static void test_split_bitwise(void **state) {
    (void)state;
    run_case(1, 150, 1, 128, 1, 0, 0); /* 1 task, split 4 */
    run_case(1, 150, 1, 128, 0, 1, 0);
    run_case(1, 100, 2, 64, 1, 1, 0);  /* 2 tasks, split 2 */
    run_case(2, 70, 2, 128, 0, 0, 0);  /* 4 tasks, split 2 */
    run_case(1, 90, 1, 96, 1, 1, 0);   /* V = 96: no split */
    run_case(1, 120, 1, 128, 1, 1, 1); /* packed, an empty document: 3 tasks, split 2 */
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_split_bitwise)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
