/* dev/: aggregate decode tokens/s of B rows decoded together against one row (issue 23's
 * "16 streams >= 6x one stream"), on a model config's random weights: a 64-token prefill,
 * then 64 batched decode steps, for B = 1, 4, 16.
 * Build: gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L -Iinclude \
 *   dev/decode_batch.c build/liblinmoe.a -lopenblas -lcjson -lpcre2-8 -lm -o /tmp/decode_batch
 * Run:   OMP_NUM_THREADS=2 /tmp/decode_batch MODEL_CONFIG.json
 * (a model config object: for configs/brown-cpu.json take its "model" member). On a CPU that
 * OpenBLAS does not know, set OPENBLAS_CORETYPE as the CLI would (core.h). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "linmoe/model.h"
#include "linmoe/model_config.h"
#include "linmoe/params.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_CONFIG.json\n", argv[0]);
        return 2;
    }
    lm_error e = {0};
    lm_model_config c;
    lm_params p = {0};
    if (lm_model_config_load(&c, argv[1], NULL, 0, &e) != LM_OK ||
        lm_params_init(&p, &c, &e) != LM_OK) {
        fprintf(stderr, "%s\n", e.msg);
        return 1;
    }
    lm_params_init_weights(&p, 1);
    const int Bs[] = {1, 4, 16}, P = 64, S = 64;
    double base = 0;
    for (int bi = 0; bi < 3; bi++) {
        const int B = Bs[bi];
        lm_model *m = NULL;
        lm_model_cache *kc = NULL;
        if (lm_model_new(&m, &p, (int64_t)B * P, &e) != LM_OK ||
            lm_model_cache_new(&kc, m, B, P + S, &e) != LM_OK) {
            fprintf(stderr, "%s\n", e.msg);
            return 1;
        }
        int32_t *ids = calloc((size_t)B * P, sizeof(int32_t));
        float *lg = malloc(sizeof(float) * (size_t)B * c.vocab_size);
        for (int i = 0; i < B * P; i++)
            ids[i] = i % (c.vocab_size - 1);
        if (lm_model_infer(m, kc, ids, P, 1, lg, &e) != LM_OK) {
            fprintf(stderr, "%s\n", e.msg);
            return 1;
        }
        const double t0 = now();
        for (int s = 0; s < S; s++)
            if (lm_model_infer(m, kc, ids, 1, 1, lg, &e) != LM_OK) {
                fprintf(stderr, "%s\n", e.msg);
                return 1;
            }
        const double dt = now() - t0, tps = B * S / dt;
        if (B == 1)
            base = tps;
        printf("B = %2d: %.2f ms per step, %.0f tokens/s in all (%.2fx one stream)\n", B,
               dt / S * 1e3, tps, tps / base);
        lm_model_cache_free(kc);
        lm_model_free(m);
        free(ids);
        free(lg);
    }
    lm_params_free(&p);
    return 0;
}
