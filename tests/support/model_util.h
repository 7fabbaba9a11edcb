/* Model fixtures shared by the model and serving tests (test_model, test_serve,
 * test_server): a model config from a JSON file, and non-trivial random parameters.
 * Not a public API. */
#ifndef LINMOE_TEST_MODEL_UTIL_H
#define LINMOE_TEST_MODEL_UTIL_H

#include <stdint.h>

#include "linmoe/model_config.h"
#include "linmoe/params.h"

/* The model config of `path` (a model config or a training config's "model"); fails the
 * running cmocka test with the loader's message when it does not load. */
void lm_test_load_model_config(lm_model_config *c, const char *path);

/* Non-trivial parameters, so that every path of the model is exercised: after
 * lm_params_init_weights(p, seed), matrices normal(0, 1/sqrt(fan_in)) (embeddings
 * N(0, 1)), gains 1 + 0.1 N, AttnRes queries 0.3 N (not the zero init), selection biases
 * 0.05 N; conv weights, A_log and dt_bias keep their init. Seeded: the same p for the
 * same seed. */
void lm_test_randomize_params(lm_params *p, uint64_t seed);

#endif
