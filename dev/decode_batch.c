/* dev/: aggregate decode tokens/s of B rows decoded together against one row (issue 23's
 * "16 streams >= 6x one stream"), on a model config's random weights: a 64-token prefill,
 * then 64 batched decode steps, for B = 1, 4, 16.
 * Build: gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L -Iinclude \
 *   dev/decode_batch.c build/liblinmoe.a -lopenblas -lcjson -lpcre2-8 -lm -o /tmp/decode_batch
 * Run:   OMP_NUM_THREADS=2 /tmp/decode_batch MODEL_CONFIG.json [B [STEPS [REPS [PROMPT]]]]
 * (B: one batch size instead of 1, 4, 16; STEPS decode steps after the prefill, default 64;
 * REPS times, timing the decode steps only, after PROMPT prompt tokens (default 64): for
 * profiling)
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
    int Bs[3] = {1, 4, 16}, nB = 3;
    const int P = argc > 5 ? atoi(argv[5]) : 64, S = argc > 3 ? atoi(argv[3]) : 64,
              R = argc > 4 ? atoi(argv[4]) : 1;
    if (argc > 2) { /* one batch size only (for profiling) */
        Bs[0] = atoi(argv[2]);
        nB = 1;
    }
    double base = 0;
    for (int bi = 0; bi < nB; bi++) {
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
        double dt = 0, dp = 0;
        for (int r = 0; r < R; r++) {
            lm_model_cache_reset(kc);
            const double tp = now();
            if (lm_model_infer(m, kc, ids, P, 1, lg, &e) != LM_OK) {
                fprintf(stderr, "%s\n", e.msg);
                return 1;
            }
            const double t0 = now();
            dp += t0 - tp;
            for (int s = 0; s < S; s++)
                if (lm_model_infer(m, kc, ids, 1, 1, lg, &e) != LM_OK) {
                    fprintf(stderr, "%s\n", e.msg);
                    return 1;
                }
            dt += now() - t0;
        }
        const double tps = (double)B * S * R / dt;
        if (B == 1)
            base = tps;
        printf("B = %2d: %.2f ms per step, %.0f tokens/s in all (%.2fx one stream); prefill of "
               "%d x %d tokens %.2f ms\n",
               B, dt / S / R * 1e3, tps, tps / base, B, P, dp / R * 1e3);
        lm_model_cache_free(kc);
        lm_model_free(m);
        free(ids);
        free(lg);
    }
    lm_params_free(&p);
    return 0;
}
