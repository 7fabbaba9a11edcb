/* `linmoe bench` argument handling from outside: the help lists every target and the
 * model bench's options, and every argument error exits non-zero with a message
 * naming the problem before anything is measured. Nothing here runs a benchmark
 * (they are slow and their numbers are the machine's, never asserted by tests).
 *
 * Runs $LINMOE_BIN (set by CTest) through lm_run_cli.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"
#include "linmoe/kda_cuda.h"
#include "test_util.h"

/* A plain exit with status want_rc, no signal, no sanitizer report. */
static void assert_exit(int rc, const char *out, int want_rc) {
    if (rc != want_rc || strstr(out, "Sanitizer") || strstr(out, "runtime error:"))
        print_message("exit status %d (want %d), output:\n%s\n", rc, want_rc, out);
    assert_int_equal(rc, want_rc);
    assert_null(strstr(out, "Sanitizer"));
    assert_null(strstr(out, "runtime error:"));
}

static void test_help_lists_targets(void **state) {
    (void)state;
    char msg[16384];
    int rc = lm_run_cli(msg, sizeof msg, "bench --help");
    assert_exit(rc, msg, 0);
    lm_assert_says(msg, "bench kda|moe|attnres|model");
    lm_assert_says(msg, "--config FILE");
    lm_assert_says(msg, "--no-peer");
    lm_assert_says(msg, "ratio_to_peer");
    rc = lm_run_cli(msg, sizeof msg, "bench model --help");
    assert_exit(rc, msg, 0);
    lm_assert_says(msg, "usage:");
    rc = lm_run_cli(msg, sizeof msg, "help");
    assert_exit(rc, msg, 0);
    lm_assert_says(msg, "kda, moe, attnres, model");
}

static void test_target_errors(void **state) {
    (void)state;
    char msg[16384];
    int rc = lm_run_cli(msg, sizeof msg, "bench frobnicate");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "unknown target 'frobnicate'");
    lm_assert_says(msg, "kda, moe, attnres, model");
    rc = lm_run_cli(msg, sizeof msg, "bench");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "missing target");
    lm_assert_says(msg, "attnres");
    rc = lm_run_cli(msg, sizeof msg, "bench Model");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "unknown target 'Model'");
}

static void test_option_errors(void **state) {
    (void)state;
    char msg[16384];
    /* model-only options on other targets */
    int rc = lm_run_cli(msg, sizeof msg, "bench attnres --config configs/bench-cpu.json");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "--config applies only to");
    rc = lm_run_cli(msg, sizeof msg, "bench kda --no-peer");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "--no-peer applies only to");
    /* missing values, bad values, unknown flags */
    rc = lm_run_cli(msg, sizeof msg, "bench model --config");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "--config needs a value");
    rc = lm_run_cli(msg, sizeof msg, "bench model --threads 0");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "--threads '0'");
    rc = lm_run_cli(msg, sizeof msg, "bench attnres --threads two");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "--threads 'two'");
    rc = lm_run_cli(msg, sizeof msg, "bench model --peer");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "unknown option '--peer'");
    rc = lm_run_cli(msg, sizeof msg, "bench attnres extra");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "unexpected argument 'extra'");
    rc = lm_run_cli(msg, sizeof msg, "bench model --device tpu");
    assert_exit(rc, msg, 2);
    lm_assert_says(msg, "unknown device 'tpu'");
    rc = lm_run_cli(msg, sizeof msg, "bench attnres --device cuda");
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "scripts/gpu/bench.sh");
}

/* Bad inputs of the model bench fail before any measurement (fast). */
static void test_model_bad_inputs(void **state) {
    (void)state;
    char msg[16384];
    const char *missing = lm_cli_path("no_such_config.json");
    int rc = lm_run_cli(msg, sizeof msg, "bench model --no-peer --config %s", missing);
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "no_such_config.json");

    /* a valid config without the bench keys batch_size / seq_len */
    const char *nobatch = lm_cli_path("no_batch.json");
    FILE *f = fopen(nobatch, "w");
    assert_non_null(f);
    fputs("{\"vocab_size\": 32, \"hidden_size\": 16, \"num_hidden_layers\": 1,\n"
          " \"linear_attn_config\": {\"kda_layers\": [1], \"num_heads\": 2, \"head_dim\": 8},\n"
          " \"num_experts\": 4, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 16}\n",
          f);
    assert_int_equal(fclose(f), 0);
    rc = lm_run_cli(msg, sizeof msg, "bench model --no-peer --config %s", nobatch);
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "batch_size and seq_len");

    /* --json into a directory that does not exist: refused before measuring */
    rc = lm_run_cli(msg, sizeof msg, "bench model --no-peer --json %s",
                    lm_cli_path("no_such_dir/out.json"));
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "does not exist");
    rc = lm_run_cli(msg, sizeof msg, "bench attnres --json %s", lm_cli_path("no_such_dir/out.json"));
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "does not exist");
}

/* `bench kda --device cuda` on a machine without a GPU (or a build without CUDA): a
 * plain exit 1 with a message that names the GPU / CUDA and where the GPU bench runs,
 * and no JSON file. On a machine with a GPU it would run the benchmark: skipped. */
static void test_kda_cuda_without_gpu(void **state) {
    (void)state;
    if (lm_cuda_device_count() > 0) skip();
    char msg[16384];
    const char *json = lm_cli_path("kda_cuda.json");
    int rc = lm_run_cli(msg, sizeof msg, "bench kda --device cuda --quick --json %s", json);
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "no CUDA GPU");
    lm_assert_says(msg, "bench-c.sh");
    assert_true(lm_contains_ci(msg, "built without CUDA") ||
                lm_contains_ci(msg, "driver reports no device"));
    FILE *f = fopen(json, "r");
    if (f) fclose(f);
    assert_null(f);
    /* the other targets still have no CUDA path */
    rc = lm_run_cli(msg, sizeof msg, "bench moe --device cuda");
    assert_exit(rc, msg, 1);
    lm_assert_says(msg, "`bench kda`, `bench model` and `bench ops` have CUDA paths");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_lists_targets),
        cmocka_unit_test(test_target_errors),
        cmocka_unit_test(test_option_errors),
        cmocka_unit_test(test_model_bad_inputs),
        cmocka_unit_test(test_kda_cuda_without_gpu),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
