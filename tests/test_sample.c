/* Sampler (include/linmoe/sample.h):
 *  - greedy: the argmax, ties to the lower id, NaN never chosen, no randomness;
 *  - temperature: the distribution is softmax(z / T) (fp64 reference);
 *  - top-k keeps exactly the k most likely tokens, renormalised;
 *  - top-p keeps the shortest most-likely prefix whose mass reaches p (checked on
 *    hand-made distributions at and around the cut), renormalised; top-k then top-p;
 *  - sampling: same seed -> same tokens, other seed -> other tokens; the empirical
 *    frequencies of 200k draws match the distribution (chi-square);
 *  - non-finite logits; config validation.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/sample.h"

static lm_sampler *mk(float t, int k, float p, int V, uint64_t seed) {
    lm_sampler_config c = {t, k, p};
    lm_sampler *s = NULL;
    lm_error err = {0};
    assert_int_equal(lm_sampler_new(&s, &c, V, seed, &err), LM_OK);
    return s;
}

static void test_greedy(void **state) {
    (void)state;
    const float z[6] = {0.5f, 2.0f, -1.0f, 2.0f, NAN, 1.9f};
    lm_sampler *s = mk(0, 0, 1, 6, 1);
    for (int i = 0; i < 5; i++)
        assert_int_equal(lm_sampler_sample(s, z), 1);
    double pr[6];
    assert_int_equal(lm_sampler_probs(s, z, pr), 1);
    assert_true(pr[1] == 1.0 && pr[3] == 0.0);
    lm_sampler_free(s);
    /* greedy ignores top-k/top-p and the seed */
    s = mk(0, 2, 0.1f, 6, 99);
    assert_int_equal(lm_sampler_sample(s, z), 1);
    lm_sampler_free(s);
    const float nan6[6] = {NAN, NAN, NAN, NAN, NAN, NAN};
    s = mk(0, 0, 1, 6, 1);
    assert_int_equal(lm_sampler_sample(s, nan6), 0);
    lm_sampler_free(s);
}

static void softmax_ref(const float *z, int V, double t, double *p) {
    double mx = -INFINITY, sum = 0;
    for (int v = 0; v < V; v++)
        mx = fmax(mx, z[v] / t);
    for (int v = 0; v < V; v++)
        sum += p[v] = exp(z[v] / t - mx);
    for (int v = 0; v < V; v++)
        p[v] /= sum;
}

static void test_temperature_topk(void **state) {
    (void)state;
    enum { V = 50 };
    float z[V];
    lm_rng r;
    lm_rng_init(&r, 5);
    for (int v = 0; v < V; v++)
        z[v] = (float)(2.0 * lm_rng_normal(&r));
    double pr[V], ref[V];
    const float temps[3] = {0.5f, 1.0f, 2.5f};
    for (int ti = 0; ti < 3; ti++) {
        lm_sampler *s = mk(temps[ti], 0, 1, V, 1);
        assert_int_equal(lm_sampler_probs(s, z, pr), V);
        softmax_ref(z, V, temps[ti], ref);
        for (int v = 0; v < V; v++)
            assert_true(fabs(pr[v] - ref[v]) < 1e-12);
        lm_sampler_free(s);
    }
    /* top-k: the k largest logits, renormalised */
    for (int k = 1; k <= V + 5; k += 7) {
        lm_sampler *s = mk(0.7f, k, 1, V, 1);
        const int kept = lm_sampler_probs(s, z, pr);
        const int want = k < V ? k : V;
        assert_int_equal(kept, want);
        softmax_ref(z, V, (double)0.7f, ref);
        /* threshold: the want-th largest logit */
        float sorted[V];
        memcpy(sorted, z, sizeof sorted);
        for (int i = 0; i < V; i++)
            for (int j = i + 1; j < V; j++)
                if (sorted[j] > sorted[i]) {
                    float t = sorted[i];
                    sorted[i] = sorted[j];
                    sorted[j] = t;
                }
        const float thr = sorted[want - 1];
        double mass = 0, sum = 0;
        for (int v = 0; v < V; v++)
            if (z[v] >= thr)
                mass += ref[v];
        for (int v = 0; v < V; v++) {
            if (z[v] >= thr)
                assert_true(fabs(pr[v] - ref[v] / mass) < 1e-12);
            else
                assert_true(pr[v] == 0);
            sum += pr[v];
        }
        assert_true(fabs(sum - 1) < 1e-12);
        lm_sampler_free(s);
    }
}

static void test_topp(void **state) {
    (void)state;
    /* logits = log of probabilities 0.4, 0.3, 0.2, 0.1 (in a shuffled order) */
    const float z[4] = {logf(0.2f), logf(0.4f), logf(0.1f), logf(0.3f)};
    double pr[4];
    struct {
        float p;
        int kept;
    } cases[] = {{0.3f, 1},  {0.39f, 1}, {0.41f, 2}, {0.69f, 2},
                 {0.71f, 3}, {0.89f, 3}, {0.95f, 4}, {1.0f, 4}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_sampler *s = mk(1, 0, cases[i].p, 4, 1);
        const int kept = lm_sampler_probs(s, z, pr);
        assert_int_equal(kept, cases[i].kept);
        /* kept = the most likely ones: ids 1 (0.4), 3 (0.3), 0 (0.2), 2 (0.1) */
        const int order[4] = {1, 3, 0, 2};
        const double base[4] = {0.4, 0.3, 0.2, 0.1};
        double mass = 0;
        for (int j = 0; j < kept; j++)
            mass += base[j];
        for (int j = 0; j < 4; j++) {
            const double want = j < kept ? base[j] / mass : 0;
            assert_true(fabs(pr[order[j]] - want) < 1e-6);
        }
        lm_sampler_free(s);
    }
    /* top-k first, then top-p over the renormalised top-k */
    lm_sampler *s = mk(1, 2, 0.6f, 4, 1); /* top-2: 0.4/0.7 = 0.571 < 0.6 -> both kept */
    assert_int_equal(lm_sampler_probs(s, z, pr), 2);
    assert_true(fabs(pr[1] - 0.4 / 0.7) < 1e-6 && fabs(pr[3] - 0.3 / 0.7) < 1e-6);
    lm_sampler_free(s);
    s = mk(1, 2, 0.55f, 4, 1);
    assert_int_equal(lm_sampler_probs(s, z, pr), 1);
    assert_true(pr[1] == 1.0);
    lm_sampler_free(s);
    /* samples only ever come from the nucleus */
    s = mk(1, 0, 0.71f, 4, 3);
    for (int i = 0; i < 2000; i++)
        assert_int_not_equal(lm_sampler_sample(s, z), 2);
    lm_sampler_free(s);
}

static void test_determinism_and_frequencies(void **state) {
    (void)state;
    enum { V = 12, N = 200000 };
    float z[V];
    lm_rng r;
    lm_rng_init(&r, 9);
    for (int v = 0; v < V; v++)
        z[v] = (float)lm_rng_normal(&r);
    lm_sampler *a = mk(0.9f, 8, 0.9f, V, 42), *b = mk(0.9f, 8, 0.9f, V, 42),
               *c = mk(0.9f, 8, 0.9f, V, 43);
    int differ = 0;
    long cnt[V] = {0};
    for (int i = 0; i < N; i++) {
        const int32_t x = lm_sampler_sample(a, z), y = lm_sampler_sample(b, z),
                      w = lm_sampler_sample(c, z);
        assert_int_equal(x, y);
        differ += x != w;
        assert_true(x >= 0 && x < V);
        cnt[x]++;
    }
    assert_true(differ > N / 10);
    double pr[V];
    lm_sampler_probs(a, z, pr);
    double chi2 = 0;
    int dof = -1;
    for (int v = 0; v < V; v++) {
        if (pr[v] == 0) {
            assert_int_equal(cnt[v], 0);
            continue;
        }
        const double e = pr[v] * N;
        chi2 += (cnt[v] - e) * (cnt[v] - e) / e;
        dof++;
    }
    print_message("chi2 = %.2f with %d degrees of freedom\n", chi2, dof);
    /* dof <= 7: the 99.99th percentile of chi2(7) is about 29.9 */
    assert_true(dof >= 1 && chi2 < 30);
    lm_sampler_free(a);
    lm_sampler_free(b);
    lm_sampler_free(c);
}

static void test_nonfinite_and_validation(void **state) {
    (void)state;
    const float z[5] = {-INFINITY, NAN, 1.0f, INFINITY, INFINITY};
    double pr[5];
    lm_sampler *s = mk(1, 0, 1, 5, 1);
    assert_int_equal(lm_sampler_probs(s, z, pr), 2);
    assert_true(pr[3] == 0.5 && pr[4] == 0.5 && pr[0] == 0 && pr[1] == 0 && pr[2] == 0);
    for (int i = 0; i < 100; i++) {
        const int32_t x = lm_sampler_sample(s, z);
        assert_true(x == 3 || x == 4);
    }
    const float bad[5] = {-INFINITY, NAN, -INFINITY, NAN, -INFINITY};
    assert_int_equal(lm_sampler_sample(s, bad), 0);
    lm_sampler_free(s);

    lm_error err = {0};
    lm_sampler_config c;
    lm_sampler_config_default(&c);
    assert_int_equal(lm_sampler_config_validate(&c, &err), LM_OK);
    c.temperature = -1;
    assert_int_equal(lm_sampler_config_validate(&c, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "temperature"));
    lm_sampler_config_default(&c);
    c.top_k = -2;
    assert_int_equal(lm_sampler_config_validate(&c, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "top_k"));
    lm_sampler_config_default(&c);
    c.top_p = 0;
    assert_int_equal(lm_sampler_config_validate(&c, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "top_p"));
    c.top_p = 1.5f;
    assert_int_equal(lm_sampler_config_validate(&c, &err), LM_ERR_INVALID);
    lm_sampler *t = NULL;
    assert_int_equal(lm_sampler_new(&t, &c, 10, 1, &err), LM_ERR_INVALID);
    assert_null(t);
    lm_sampler_config_default(&c);
    assert_int_equal(lm_sampler_new(&t, &c, 0, 1, &err), LM_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_temperature_topk),
        cmocka_unit_test(test_topp),
        cmocka_unit_test(test_determinism_and_frequencies),
        cmocka_unit_test(test_nonfinite_and_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
