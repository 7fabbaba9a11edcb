/* The model's backward scales the MoE aux loss's gradient with loss_scale (model.h:
 * lm_model_backward is the backward of loss_scale * loss, the loss including the routers'
 * aux losses; moe.h lm_moe_ctx_set_aux_scale). On configs/tiny.json with balance =
 * AUX_LOSS (alpha 0.1, large enough that the aux term is a visible part of the router's
 * gradient), a backward with loss_scale 0.25 must give 0.25 times every gradient of the
 * backward with loss_scale 1 (the router's gate.weight included), to fp32 rounding of
 * the scaled sums (1e-5 relative RMS). Before the fix the aux part stayed unscaled, which
 * moved the router's gradient by percents. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/model.h"
#include "linmoe/model_config.h"
#include "linmoe/params.h"

static void test_aux_scale(void **state) {
    (void)state;
    lm_error e = {0};
    lm_model_config cfg;
    assert_int_equal(lm_model_config_load(&cfg, "configs/tiny.json", NULL, 0, &e), LM_OK);
    cfg.moe.router.balance = LM_BAL_AUX_LOSS;
    cfg.moe.router.aux_loss_alpha = 0.1f;
    lm_params p = {0};
    assert_int_equal(lm_params_init(&p, &cfg, &e), LM_OK);
    lm_params_init_weights(&p, 3);
    lm_model *m = NULL;
    const int B = 2, T = 40;
    assert_int_equal(lm_model_new(&m, &p, B * T, &e), LM_OK);
    int32_t ids[80], labels[80];
    for (int n = 0; n < B * T; n++) {
        ids[n] = (n * 37 + 11) % cfg.vocab_size;
        labels[n] = (n * 53 + 5) % cfg.vocab_size;
    }
    lm_model_batch b = {B, T, NULL, 0};
    double loss = 0;
    assert_int_equal(lm_model_forward(m, &b, ids, labels, 1, NULL, &loss, NULL, &e), LM_OK);
    assert_int_equal(lm_model_backward(m, 1.0f, 0, &e), LM_OK);
    float *g1 = malloc(sizeof(float) * (size_t)p.numel);
    memcpy(g1, lm_model_grads(m), sizeof(float) * (size_t)p.numel);
    assert_int_equal(lm_model_forward(m, &b, ids, labels, 1, NULL, &loss, NULL, &e), LM_OK);
    assert_int_equal(lm_model_backward(m, 0.25f, 0, &e), LM_OK);
    const float *g2 = lm_model_grads(m);
    int checked_router = 0;
    for (int t = 0; t < p.n; t++) {
        const lm_param_info *ti = &p.t[t];
        if (ti->buffer)
            continue;
        double num = 0, den = 0;
        for (int64_t i = 0; i < ti->numel; i++) {
            const double ref = 0.25 * g1[ti->offset + i];
            const double d = g2[ti->offset + i] - ref;
            num += d * d;
            den += ref * ref;
        }
        const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (strstr(ti->name, "mlp.gate.weight"))
            checked_router++;
        if (!(rel <= 1e-5))
            fail_msg("%s: gradient at loss_scale 0.25 is not 0.25 x the one at 1 (rel %.3e)",
                     ti->name, rel);
    }
    assert_true(checked_router > 0);
    free(g1);
    lm_model_free(m);
    lm_params_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_aux_scale)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
