/* dev/: timing harness for the CPU KDA kernels (env: REP, NOSG, WALL, ONLYFWD, ONLYREC, ONLYBWD, H0).
 * Build (not part of CMake): gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L
 *   -D_DEFAULT_SOURCE -Iinclude -Isrc dev/perf_kda.c src/ops/kda.c plus every .c file of
 *   src/ops/cpu and src/core
 *   -I/usr/include/x86_64-linux-gnu -lopenblas -lcjson -lm -o /tmp/perf_kda */
/* scratch timing: sgemm 2048^3 rate vs chunk fwd / fwdbwd at (1,4096,4,128) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "linmoe/kda.h"
#include <malloc.h>
#include <time.h>
static double cpu(void){struct timespec t; clock_gettime(getenv("WALL")?CLOCK_MONOTONIC:CLOCK_PROCESS_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
static unsigned long long st = 88172645463325252ULL; static double rn(void) { double a = 0; for (int i = 0; i < 4; i++) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; a += (st >> 11) * (1.0 / 9007199254740992.0); } return (a - 2.0) * 1.732; }
static float *mk(long n, double s, double m) { float *x = malloc(n * 4); for (long i = 0; i < n; i++) x[i] = (float)(m + s * rn()); return x; }
int main(int argc, char **argv) {
    int B = argc > 1 ? atoi(argv[1]) : 1, T = argc > 2 ? atoi(argv[2]) : 4096, H = argc > 3 ? atoi(argv[3]) : 4, D = argc > 4 ? atoi(argv[4]) : 128, gate = argc > 5 ? atoi(argv[5]) : 2;
    if (getenv("MALLOPT")) { mallopt(M_MMAP_THRESHOLD, 1 << 30); mallopt(M_TRIM_THRESHOLD, 1 << 30); }
    int n = 2048; float *A = mk((long)n * n, 1, 0), *Bm = mk((long)n * n, 1, 0), *Cm = malloc((long)n * n * 4);
    double best = 1e9;
    for (int r = 0; r < (getenv("NOSG") ? 0 : 4); r++) { double t0 = cpu(); lm_sgemm(0, 0, n, n, n, 1, A, n, Bm, n, 0, Cm, n); double t = cpu() - t0; if (t < best) best = t; }
    double sg = 2.0 * n * n * n / best / 1e9;
    printf("sgemm %.1f GFLOP/s\n", sg);
    lm_kda_config c; lm_kda_config_default(&c, B, T, H, H, D, D);
    c.gate = gate; c.use_qk_l2norm_in_kernel = 1; c.use_beta_sigmoid_in_kernel = 1; c.has_lower_bound = gate == 2; c.lower_bound = -5; c.ws = lm_kda_workspace_new();
    long nq = (long)B * T * H * D, nb = (long)B * T * H, ns = (long)B * H * D * D;
    float *q = mk(nq, 1, 0), *k = mk(nq, 1, 0), *v = mk(nq, 1, 0), *g = mk(nq, 1, 0), *beta = mk(nb, 1, 0), *Al = mk(H, 0, 0), *dtb = mk(H * D, 0.5, -4);
    lm_kda_inputs in = {q, k, v, g, beta, Al, dtb, NULL};
    if (getenv("H0")) in.initial_state = mk(ns, 1, 0);
    float *o = malloc(nq * 4), *s = malloc(ns * 4);
    lm_kda_outputs out = {o, s}; lm_error err;
    double C = 64, F = 6.0 * D * D + C * (6.0 * D + 4.0 * D), Fb = 16.0 * D * D + C * (12.0 * D + 10.0 * D) + 4 * C * C;
    double tok = (double)B * T * H;
    for (int pass = getenv("ONLYBWD") ? 2 : getenv("ONLYREC") ? 1 : 0; pass < (getenv("ONLYFWD") ? 1 : getenv("ONLYREC") ? 2 : 3); pass++) {
        double t0 = cpu();
        if (pass == 0) { lm_kda_chunk_forward(&c, &in, &out, &err); t0 = cpu(); int rep = getenv("REP") ? atoi(getenv("REP")) : 1; for (int r = 0; r < rep; r++) lm_kda_chunk_forward(&c, &in, &out, &err); }
        else if (pass == 1) { int rep = getenv("REP") ? atoi(getenv("REP")) : 1; for (int r = 0; r < rep; r++) lm_kda_recurrent_forward(&c, &in, &out, &err); }
        else {
            float *dO = mk(nq, 1, 0), *dq = malloc(nq * 4), *dk = malloc(nq * 4), *dv = malloc(nq * 4), *dg = malloc(nq * 4), *db = malloc(nb * 4);
            float *dA = malloc(H * 4), *ddt = malloc(H * D * 4);
            lm_kda_grads gr = {dO, NULL, dq, dk, dv, dg, db, NULL, dA, ddt};
            lm_kda_chunk_backward(&c, &in, &gr, &err);
            t0 = cpu();
            lm_kda_chunk_forward(&c, &in, &out, &err);
            lm_kda_chunk_backward(&c, &in, &gr, &err);
        }
        double t = (cpu() - t0) / (pass <= 1 && getenv("REP") ? atoi(getenv("REP")) : 1);
        double fl = pass == 0 ? F : pass == 1 ? 7.0 * D * D : F + Fb;
        printf("%s: %.1f ms  %.1f GFLOP/s  ratio %.3f  tok/s %.0f\n", pass == 0 ? "chunk fwd" : pass == 1 ? "recurrent" : "fwd+bwd", t * 1e3, tok * fl / t / 1e9, tok * fl / t / 1e9 / sg, tok / t);
    }
    return 0;
}
