/* The balancing acceptance runs of issue 3 / reference/moe.md §8.3 rows 1-2 on the
 * stationary skewed synthetic router of §7.3 (E = 64, k = 8, T = 4096, mu_j linear
 * in [-2, 2], N = 1000 steps, fixed seed), through lm_balance_sim_run (the library
 * router, not a copy of it), and `linmoe balance-sim` from outside (flags, JSON).
 *
 *  none            maxvio_batch > 3 at every step, dead experts at the end
 *  aux_free 1e-3   maxvio_batch < 0.2 within 400 steps; mean over the last 100 steps
 *                  <= 1.3 x the analytic floor; maxvio_global (last 100 pooled) <
 *                  0.02; no dead experts in the last 100 steps
 *  quantile, 5     maxvio_batch < 0.2 within 5 steps; maxvio_global < 0.03
 *  aux_free 1e-2   reaches 0.2 sooner than 1e-3 (and within 100 steps) and has the
 *                  larger late-phase maxvio_batch (mean of the last 100 steps)
 *  capacity        cf 1.25 at steady state drops ~nothing; cf 1.0 drops from
 *                  sampling noise alone (reference/moe.md §5 [sim])
 *
 * The analytic floor (§7.2): c_j ~ Binomial(T, k/E) under perfect balance, so
 * sigma_rel = sqrt((1 - k/E) / (T k/E)) = 0.0413 and E[maxvio_batch] ~ sigma_rel *
 * z_E with z_E ~ 2.4 for E = 64: 0.099.
 *
 * LINMOE_TEST_QUICK=1 (sanitizer runs) shortens the runs (N = 450 for aux_free,
 * 150 for quantile, 100 for none; the same criteria on the shorter windows); the
 * default is the acceptance setting.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "test_util.h"

#include "linmoe/moe_router.h"

static int quick_mode(void) {
    const char *s = getenv("LINMOE_TEST_QUICK");
    return s && s[0] == '1';
}

typedef struct {
    lm_router_metrics *m;
    lm_balance_sim_summary s;
    int n;
} sim_run;

static sim_run run(lm_balance_mode mode, float rate, int iters, int steps, float cf) {
    lm_balance_sim_config c;
    lm_balance_sim_config_default(&c); /* E 64, k 8, T 4096, clamp 1, centring, seed 1234 */
    c.mode = mode;
    c.rate = rate;
    c.iters = iters;
    c.steps = steps;
    c.capacity_factor = cf;
    sim_run r;
    r.n = steps;
    r.m = calloc((size_t)steps, sizeof(lm_router_metrics));
    assert_non_null(r.m);
    lm_error err = {0};
    if (lm_balance_sim_run(&c, r.m, &r.s, &err) != LM_OK)
        fail_msg("balance sim: %s", err.msg);
    return r;
}

static double floor_maxvio(void) {
    const double E = 64, k = 8, T = 4096;
    return sqrt((1 - k / E) / (T * k / E)) * 2.4;
}

static void print_summary(const char *name, const sim_run *r) {
    printf("  %-22s N=%4d  first<0.2: %4d  last100 mean: %.4f  global(100): %.4f  dead(final): %d  "
           "max|b|: %.3f  (%.2f s)\n",
           name, r->n, r->s.first_step_maxvio_below_0_2, r->s.maxvio_batch_last100_mean,
           r->s.maxvio_global_last100, r->s.n_dead_final, r->s.max_abs_bias, r->s.seconds);
    fflush(stdout);
}

static void test_none(void **state) {
    (void)state;
    sim_run r = run(LM_BAL_NONE, 1e-3f, 1, quick_mode() ? 100 : 1000, 0.0f);
    print_summary("none", &r);
    double mn = 1e9;
    for (int i = 0; i < r.n; i++)
        mn = fmin(mn, r.m[i].maxvio_batch);
    printf("    min maxvio_batch over all steps %.3f, min_load(final) %.3f\n", mn,
           r.m[r.n - 1].min_load);
    assert_true(mn > 3.0);
    assert_true(r.s.n_dead_final > 0);
    assert_true(r.m[r.n - 1].min_load == 0.0); /* min_vio = -1 */
    assert_int_equal(r.s.first_step_maxvio_below_0_2, 0);
    assert_true(r.s.max_abs_bias == 0.0);
    free(r.m);
}

static void test_aux_free_and_rate_tradeoff(void **state) {
    (void)state;
    const int N = quick_mode() ? 450 : 1000;
    sim_run a = run(LM_BAL_AUX_FREE, 1e-3f, 1, N, 0.0f);
    print_summary("aux_free u=1e-3", &a);
    sim_run b = run(LM_BAL_AUX_FREE, 1e-2f, 1, N, 0.0f);
    print_summary("aux_free u=1e-2", &b);
    printf("    analytic floor %.4f, 1.3x floor %.4f\n", floor_maxvio(), 1.3 * floor_maxvio());

    /* u = 1e-3 */
    assert_true(a.s.first_step_maxvio_below_0_2 >= 1 && a.s.first_step_maxvio_below_0_2 <= 400);
    assert_true(a.s.maxvio_global_last100 < 0.02);
    assert_true(a.s.maxvio_batch_last100_mean <= 1.3 * floor_maxvio());
    for (int i = a.n - 100; i < a.n; i++)
        assert_int_equal(a.m[i].n_dead, 0);
    assert_int_equal(a.s.n_dead_final, 0);
    assert_true(a.s.max_abs_bias < 1.0); /* the clamp never bound */
    /* u = 1e-2: faster, noisier */
    assert_true(b.s.first_step_maxvio_below_0_2 >= 1);
    assert_true(b.s.first_step_maxvio_below_0_2 < a.s.first_step_maxvio_below_0_2);
    assert_true(b.s.first_step_maxvio_below_0_2 < 100);
    assert_true(b.s.maxvio_batch_last100_mean > a.s.maxvio_batch_last100_mean);
    /* centring: mean(b) stays ~0 */
    for (int i = 0; i < a.n; i++)
        assert_true(fabs(a.m[i].bias_mean) < 1e-6);
    free(a.m);
    free(b.m);
}

static void test_quantile(void **state) {
    (void)state;
    sim_run q = run(LM_BAL_QUANTILE, 1e-3f, 5, quick_mode() ? 150 : 1000, 0.0f);
    print_summary("quantile iters=5", &q);
    printf("    maxvio_batch steps 1-3: %.3f %.3f %.3f\n", q.m[0].maxvio_batch, q.m[1].maxvio_batch,
           q.m[2].maxvio_batch);
    assert_true(q.s.first_step_maxvio_below_0_2 >= 1 && q.s.first_step_maxvio_below_0_2 <= 5);
    assert_true(q.s.maxvio_global_last100 < 0.03);
    assert_int_equal(q.s.n_dead_final, 0);
    free(q.m);
}

static void test_capacity_steady_state(void **state) {
    (void)state;
    const int N = 50;
    sim_run a = run(LM_BAL_QUANTILE, 1e-3f, 5, N, 1.25f);
    sim_run b = run(LM_BAL_QUANTILE, 1e-3f, 5, N, 1.0f);
    double da = 0, db = 0;
    for (int i = 10; i < N; i++)
        da += a.m[i].dropped_assign_frac, db += b.m[i].dropped_assign_frac;
    da /= N - 10, db /= N - 10;
    printf("  quantile at steady state: dropped assignments cf=1.25 %.5f, cf=1.0 %.5f; first step "
           "(cf=1.25, unbalanced) %.3f, token frac %.3f\n",
           da, db, a.m[0].dropped_assign_frac, a.m[0].dropped_token_frac);
    assert_true(da < 1e-3);
    assert_true(db > 2e-3);
    assert_true(a.m[0].dropped_assign_frac > 0.3); /* step 1 routes with b = 0 */
    assert_true(a.m[0].dropped_token_frac >= a.m[0].dropped_assign_frac);
    free(a.m);
    free(b.m);
}

/* ------------------------------------------------------------------ CLI */

static void test_cli(void **state) {
    (void)state;
    char out[8192];
    char dir[] = "/tmp/linmoe_test_bsim_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char json[256];
    snprintf(json, sizeof json, "%s/run.json", dir);

    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --help"), 0);
    assert_non_null(strstr(out, "--experts"));
    assert_non_null(strstr(out, "--json"));
    assert_int_equal(lm_run_cli(out, sizeof out, "help balance-sim"), 0);
    assert_non_null(strstr(out, "--mode"));
    assert_int_equal(lm_run_cli(out, sizeof out, "help"), 0);
    assert_non_null(strstr(out, "balance-sim"));

    assert_int_equal(lm_run_cli(out, sizeof out,
                                "balance-sim --experts 32 --topk 4 --tokens 1024 --steps 30 "
                                "--mode quantile --iters 5 --seed 7 --micro 2 --json %s",
                                json),
                     0);
    printf("%s", out);
    assert_non_null(strstr(out, "first step with maxvio_batch < 0.2"));
    FILE *f = fopen(json, "rb");
    assert_non_null(f);
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    cJSON *root = cJSON_Parse(buf);
    assert_non_null(root);
    cJSON *steps = cJSON_GetObjectItem(root, "steps");
    assert_true(cJSON_IsArray(steps));
    assert_int_equal(cJSON_GetArraySize(steps), 30);
    const char *keys[] = {"maxvio_batch", "n_dead", "dropped_frac", "bias_min", "bias_max"};
    for (int i = 0; i < 30; i++) {
        cJSON *s = cJSON_GetArrayItem(steps, i);
        for (int j = 0; j < 5; j++)
            assert_true(cJSON_IsNumber(cJSON_GetObjectItem(s, keys[j])));
    }
    cJSON *sum = cJSON_GetObjectItem(root, "summary");
    assert_non_null(sum);
    cJSON *first = cJSON_GetObjectItem(sum, "first_step_maxvio_below_0_2");
    assert_true(cJSON_IsNumber(first) && first->valuedouble >= 1 && first->valuedouble <= 5);
    assert_true(cJSON_IsNumber(cJSON_GetObjectItem(sum, "maxvio_batch_last100_mean")));
    assert_true(cJSON_IsNumber(cJSON_GetObjectItem(sum, "maxvio_global_last100")));
    assert_true(cJSON_IsNumber(cJSON_GetObjectItem(sum, "n_dead_final")));
    /* the JSON holds what the library computes for the same configuration */
    lm_balance_sim_config c;
    lm_balance_sim_config_default(&c);
    c.experts = 32, c.topk = 4, c.tokens = 1024, c.steps = 30, c.mode = LM_BAL_QUANTILE;
    c.iters = 5, c.seed = 7, c.micro = 2;
    lm_router_metrics m[30];
    lm_balance_sim_summary s;
    lm_error err = {0};
    assert_int_equal(lm_balance_sim_run(&c, m, &s, &err), LM_OK);
    for (int i = 0; i < 30; i++) {
        cJSON *st = cJSON_GetArrayItem(steps, i);
        assert_true(fabs(cJSON_GetObjectItem(st, "maxvio_batch")->valuedouble - m[i].maxvio_batch) <
                    1e-12);
        assert_true(fabs(cJSON_GetObjectItem(st, "bias_max")->valuedouble - m[i].bias_max) < 1e-12);
    }
    assert_int_equal((int)first->valuedouble, s.first_step_maxvio_below_0_2);
    cJSON_Delete(root);

    /* never reaching 0.2: null */
    assert_int_equal(
        lm_run_cli(out, sizeof out,
                   "balance-sim --experts 16 --topk 2 --tokens 256 --steps 5 --mode none --json %s",
                   json),
        0);
    f = fopen(json, "rb");
    assert_non_null(f);
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    root = cJSON_Parse(buf);
    assert_non_null(root);
    assert_true(cJSON_IsNull(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "summary"), "first_step_maxvio_below_0_2")));
    cJSON_Delete(root);

    /* bad input */
    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --mode sinkhorn"), 2);
    assert_non_null(strstr(out, "sinkhorn"));
    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --bogus"), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --steps"), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --steps -3"), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --rate nan"), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "balance-sim --experts 8 --topk 9 --steps 1"), 1);
    assert_non_null(strstr(out, "num_experts_per_tok"));
    assert_int_equal(
        lm_run_cli(out, sizeof out, "balance-sim --experts 8 --topk 8 --mode quantile --steps 1"),
        1);
    assert_int_equal(
        lm_run_cli(out, sizeof out, "balance-sim --steps 1 --json /nonexistent/dir/x.json"), 1);
    assert_non_null(strstr(out, "/nonexistent/dir"));

    unlink(json);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_none),     cmocka_unit_test(test_aux_free_and_rate_tradeoff),
        cmocka_unit_test(test_quantile), cmocka_unit_test(test_capacity_steady_state),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
