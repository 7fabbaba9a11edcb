/* Devices and lm_backend_supports (include/linmoe/backend.h): parsing, names, and the
 * refusals a caller gets before any work starts. Runs without a GPU: the CUDA answers
 * depend only on the configuration (and on whether CUDA was built in). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/attention.h"
#include "linmoe/attnres.h"
#include "linmoe/backend.h"
#include "linmoe/cuda_bench.h"
#include "linmoe/kda.h"
#include "linmoe/layers.h"
#include "linmoe/moe.h"

static void test_device_parse(void **state) {
    (void)state;
    lm_device d;
    lm_error e = {0};
    char buf[32];
    assert_int_equal(lm_device_parse("cpu", "--device", &d, &e), LM_OK);
    assert_int_equal(d.type, LM_DEVICE_CPU);
    assert_string_equal(lm_device_name(d, buf, sizeof buf), "cpu");
    assert_int_equal(lm_device_parse("cuda", "--device", &d, &e), LM_OK);
    assert_int_equal(d.type, LM_DEVICE_CUDA);
    assert_int_equal(d.index, 0);
    assert_int_equal(lm_device_parse("cuda:3", "--device", &d, &e), LM_OK);
    assert_int_equal(d.index, 3);
    assert_string_equal(lm_device_name(d, buf, sizeof buf), "cuda:3");
    const char *bad[] = {"gpu", "cuda:", "cuda:-1", "cuda:1x", "CUDA", "", "cuda:99999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&e, 0, sizeof e);
        assert_int_equal(lm_device_parse(bad[i], "--device", &d, &e), LM_ERR_INVALID);
        assert_non_null(strstr(e.msg, "--device"));
        assert_non_null(strstr(e.msg, bad[i]));
    }
}

/* A refusal on CUDA names the config key (or says CUDA is not built in). */
static void expect_refused(lm_op op, const void *cfg, const char *key) {
    lm_error e = {0};
    const lm_device cuda = {LM_DEVICE_CUDA, 0}, cpu = {LM_DEVICE_CPU, 0};
    assert_int_equal(lm_backend_supports(cpu, op, cfg, &e), LM_OK);
    assert_int_equal(lm_backend_supports(cuda, op, cfg, &e), LM_ERR_UNSUPPORTED);
    if (lm_cuda_built())
        assert_non_null(strstr(e.msg, key));
    else
        assert_non_null(strstr(e.msg, "without CUDA"));
    assert_non_null(strstr(e.msg, lm_op_name(op)));
}

static void expect_supported(lm_op op, const void *cfg) {
    lm_error e = {0};
    const lm_device cuda = {LM_DEVICE_CUDA, 0};
    const lm_status st = lm_backend_supports(cuda, op, cfg, &e);
    assert_int_equal(st, lm_cuda_built() ? LM_OK : LM_ERR_UNSUPPORTED);
}

static void test_supports(void **state) {
    (void)state;
    lm_kda_config k;
    lm_kda_config_default(&k, 1, 64, 4, 4, 128, 128);
    expect_supported(LM_OP_KDA, &k);
    k.K = 256;
    expect_refused(LM_OP_KDA, &k, "head_k_dim 256");
    lm_attention_config a;
    lm_attention_config_default(&a, 1, 64, 8, 2, 128);
    expect_supported(LM_OP_ATTENTION, &a);
    a.D = 16; /* the simple kernels: any head_dim up to 256 */
    expect_supported(LM_OP_ATTENTION, &a);
    a.D = 96;
    expect_supported(LM_OP_ATTENTION, &a);
    a.D = 256;
    expect_supported(LM_OP_ATTENTION, &a);
    a.D = 320;
    expect_refused(LM_OP_ATTENTION, &a, "head_dim 320");
    lm_attnres_config r;
    lm_attnres_config_default(&r, 9, 32, 2048);
    expect_supported(LM_OP_ATTNRES, &r);
    r.L = 65;
    expect_refused(LM_OP_ATTNRES, &r, "65 sources");
    lm_short_conv_config s;
    lm_short_conv_config_default(&s, 1, 64, 256, 4);
    expect_supported(LM_OP_SHORT_CONV, &s);
    s.W = 12;
    expect_refused(LM_OP_SHORT_CONV, &s, "conv_size 12");
    lm_moe_config m;
    lm_moe_config_default(&m, 1024, 512, 64, 6, 1);
    expect_supported(LM_OP_MOE, &m);
    m.moe_intermediate_size = 500 + 3;
    expect_refused(LM_OP_MOE, &m, "moe_intermediate_size 503");
    for (int op = 0; op < LM_OP_COUNT; op++)
        assert_string_not_equal(lm_op_name((lm_op)op), "(unknown op)");
    lm_error e = {0};
    assert_int_equal(lm_backend_supports((lm_device){LM_DEVICE_CPU, 0}, LM_OP_COUNT, NULL, &e),
                     LM_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device_parse),
        cmocka_unit_test(test_supports),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
