/* dev/: subnormal fp32 values in the model's training step on configs/bench-cpu.json
 * (lm_params_init_weights, random ids, one forward + backward at B x T): how many of
 * the gradients, sublayer inputs and logits are subnormal, i.e. whether the FTZ/DAZ
 * treatment of the KDA op (src/ops/cpu/kda_cpu.h) is needed elsewhere in the step.
 * Build: gcc -std=c11 -O2 -fopenmp -D_POSIX_C_SOURCE=200809L -Iinclude -Isrc \
 *   dev/model_subnormal.c build-h8/liblinmoe.a -lopenblas -lcjson -lpcre2-8 -lm -o /tmp/ms
 * Run:   /tmp/ms [B T steps] */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "linmoe/model.h"

static long sub(const float *x, int64_t n) {
    long s = 0;
    for (int64_t i = 0; i < n; i++)
        s += x[i] != 0.0f && fabsf(x[i]) < FLT_MIN;
    return s;
}

int main(int argc, char **argv) {
    const int B = argc > 1 ? atoi(argv[1]) : 2, T = argc > 2 ? atoi(argv[2]) : 256;
    lm_error err = {0};
    lm_model_config cfg;
    char warn[256];
    if (lm_model_config_load(&cfg, "configs/bench-cpu.json", warn, sizeof warn, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    lm_params p;
    lm_params_init(&p, &cfg, &err);
    lm_params_init_weights(&p, 0);
    lm_model *m;
    if (lm_model_new(&m, &p, (int64_t)B * T, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    const int64_t N = (int64_t)B * T, d = cfg.hidden_size, V = cfg.vocab_size;
    int32_t *ids = malloc(sizeof(int32_t) * N), *lab = malloc(sizeof(int32_t) * N);
    lm_rng r;
    lm_rng_init(&r, 3);
    for (int64_t i = 0; i < N; i++)
        ids[i] = (int32_t)(lm_rng_u32(&r) % (uint32_t)V);
    for (int64_t i = 0; i < N; i++)
        lab[i] = (i + 1) % T ? ids[i + 1] : LM_MODEL_IGNORE;
    float *logits = malloc(sizeof(float) * (size_t)(N * V));
    lm_model_batch b = {B, T, NULL, 0};
    double loss;
    lm_model_forward(m, &b, ids, lab, 1, logits, &loss, NULL, &err);
    lm_model_backward(m, 1.0f, 0, &err);
    long sh = 0;
    for (int l = 0; l < 2 * cfg.num_hidden_layers; l++)
        sh += sub(lm_model_sublayer_input(m, l), N * d);
    printf("bench-cpu B=%d T=%d: loss %.4f; subnormal: gradients %ld of %lld, sublayer inputs %ld "
           "of %lld, logits %ld of %lld\n",
           B, T, loss, sub(lm_model_grads(m), p.numel), (long long)p.numel, sh,
           (long long)(2 * cfg.num_hidden_layers * N * d), sub(logits, N * V), (long long)(N * V));
    return 0;
}
