/* dev/: time the chunked KDA forward (and forward + backward) at one shape and thread
 * count with the inputs of bench/bench_kda.c's bounded case (median of R runs after a
 * warmup), for A/B runs of two builds of the kernels on a shared machine.
 * Build: gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L -Iinclude -Isrc \
 *   dev/kda_fwd_time.c build-h8/liblinmoe.a -lopenblas -lcjson -lpcre2-8 -lm -o /tmp/kda_fwd_time
 * Run:   /tmp/kda_fwd_time B T H D threads [repeats] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/core.h"
#include "linmoe/kda.h"

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 6)
        return 2;
    const int B = atoi(argv[1]), T = atoi(argv[2]), H = atoi(argv[3]), D = atoi(argv[4]);
    const int thr = atoi(argv[5]), R = argc > 6 ? atoi(argv[6]) : 7;
    lm_set_num_threads(thr);
    const int64_t n = (int64_t)B * T * H * D, nb = (int64_t)B * T * H;
    float *q = malloc(4 * n), *k = malloc(4 * n), *v = malloc(4 * n), *x = malloc(4 * n);
    float *beta = malloc(4 * nb), *dO = malloc(4 * n), *o = malloc(4 * n);
    float *ht = malloc(sizeof(float) * (size_t)B * H * D * D), *A = calloc(H, 4);
    float *dtb = malloc(sizeof(float) * (size_t)H * D);
    float *dq = malloc(4 * n), *dk = malloc(4 * n), *dv = malloc(4 * n), *dg = malloc(4 * n);
    float *db = malloc(4 * nb), *dA = malloc(4 * H), *ddt = malloc(sizeof(float) * (size_t)H * D);
    lm_rng r;
    lm_rng_init(&r, 1000);
    float *f[] = {q, k, v, x};
    for (int j = 0; j < 4; j++)
        for (int64_t i = 0; i < n; i++)
            f[j][i] = (float)lm_rng_normal(&r);
    for (int64_t i = 0; i < nb; i++)
        beta[i] = (float)lm_rng_normal(&r);
    for (int64_t i = 0; i < n; i++)
        dO[i] = (float)lm_rng_normal(&r);
    for (int64_t i = 0; i < (int64_t)H * D; i++) {
        double dt = exp(log(1e-3) + (log(1e-1) - log(1e-3)) * lm_rng_uniform(&r));
        dtb[i] = (float)(dt + log(-expm1(-dt)));
    }
    lm_kda_config c;
    lm_kda_config_default(&c, B, T, H, H, D, D);
    c.ws = lm_kda_workspace_new();
    c.use_qk_l2norm_in_kernel = 1;
    c.use_beta_sigmoid_in_kernel = 1;
    c.gate = LM_GATE_BOUNDED;
    c.has_lower_bound = 1;
    c.lower_bound = -5.0f;
    lm_kda_inputs in = {q, k, v, x, beta, A, dtb, NULL};
    lm_kda_outputs out = {o, ht};
    lm_kda_grads gr = {dO, NULL, dq, dk, dv, dg, db, NULL, dA, ddt};
    lm_error err = {0};
    for (int mode = 0; mode < 2; mode++) {
        double *ms = malloc(sizeof(double) * (size_t)R);
        for (int i = -1; i < R; i++) {
            const double t0 = lm_time_sec();
            if (lm_kda_chunk_forward(&c, &in, &out, &err) ||
                (mode && lm_kda_chunk_backward(&c, &in, &gr, &err))) {
                fprintf(stderr, "%s\n", err.msg);
                return 1;
            }
            if (i >= 0)
                ms[i] = (lm_time_sec() - t0) * 1e3;
        }
        qsort(ms, (size_t)R, sizeof(double), cmpd);
        printf("[%d,%d,%d,%d] threads %d chunk %s bounded: median %.2f ms (min %.2f)\n", B, T, H, D,
               thr, mode ? "fwd+bwd" : "fwd", ms[R / 2], ms[0]);
        free(ms);
    }
    return 0;
}
