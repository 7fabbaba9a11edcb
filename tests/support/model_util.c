/* Model fixtures for tests (model_util.h). */
#include "model_util.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

void lm_test_load_model_config(lm_model_config *c, const char *path) {
    lm_error err = {0};
    char warn[256];
    const lm_status st = lm_model_config_load(c, path, warn, sizeof warn, &err);
    if (st != LM_OK)
        fail_msg("%s: %s", path, err.msg);
}

void lm_test_randomize_params(lm_params *p, uint64_t seed) {
    lm_params_init_weights(p, seed);
    lm_rng r;
    lm_rng_init(&r, seed ^ 0x5eedULL);
    for (int t = 0; t < p->n; t++) {
        const lm_param_info *in = &p->t[t];
        float *x = p->data + in->offset;
        double std = 0, mean = 0;
        if (in->init == LM_INIT_NORMAL) {
            const int is_emb = strstr(in->name, "embed_tokens") != NULL;
            std = is_emb ? 1.0 : 1.0 / sqrt((double)in->shape[in->ndim - 1]);
        } else if (in->init == LM_INIT_ONES) {
            mean = 1;
            std = 0.1;
        } else if (in->init == LM_INIT_ZEROS) {
            std = in->buffer ? 0.05 : 0.3;
        } else {
            continue;
        }
        for (int64_t i = 0; i < in->numel; i++)
            x[i] = (float)(mean + std * lm_rng_normal(&r));
    }
}
