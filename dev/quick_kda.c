/* dev/: scratch check: chunked vs recurrent forward and chunked backward vs fp32 finite differences.
 * Build (not part of CMake): gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L
 *   -D_DEFAULT_SOURCE -Iinclude -Isrc dev/quick_kda.c src/ops/kda.c plus every .c file of
 *   src/ops/cpu and src/core
 *   -I/usr/include/x86_64-linux-gnu -lopenblas -lcjson -lm -o /tmp/quick_kda */
/* scratch check: chunk vs recurrent forward, and chunk backward vs finite differences (fp32) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "linmoe/kda.h"
static double rn(void) { double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0); return sqrt(-2 * log(u)) * cos(6.283185307 * v); }
static float *mk(long n, double s, double m) { float *x = malloc(n * 4); for (long i = 0; i < n; i++) x[i] = (float)(m + s * rn()); return x; }
static double relerr(const float *a, const float *b, long n) { double num = 0, den = 0; for (long i = 0; i < n; i++) { num += (double)(a[i] - b[i]) * (a[i] - b[i]); den += (double)b[i] * b[i]; } return sqrt(num / (den + 1e-300)); }
int main(int argc, char **argv) {
    int B = 1, T = argc > 1 ? atoi(argv[1]) : 100, H = 1, HV = 2, K = 20, V = 12;
    int gate = argc > 2 ? atoi(argv[2]) : 2, kind = argc > 3 ? atoi(argv[3]) : 0, C = argc > 4 ? atoi(argv[4]) : 64;
    lm_kda_config c; lm_kda_config_default(&c, B, T, H, HV, K, V);
    c.kind = kind; c.gate = gate; c.chunk_size = C; c.use_qk_l2norm_in_kernel = 1; c.use_beta_sigmoid_in_kernel = 1;
    if (gate == 2) { c.has_lower_bound = 1; c.lower_bound = -5; }
    long nq = (long)B * T * H * K, nv = (long)B * T * HV * V, ng = kind ? (long)B * T * HV : (long)B * T * HV * K, nb = (long)B * T * HV, ns = (long)B * HV * K * V;
    float *q = mk(nq, 1, 0), *k = mk(nq, 1, 0), *v = mk(nv, 1, 0), *g = mk(ng, 2, 0), *beta = mk(nb, 1, 0), *h0 = mk(ns, 1, 0);
    float *A = mk(HV, 0.5, 0), *dtb = mk(kind ? HV : HV * K, 1, 0);
    if (gate == 0) for (long i = 0; i < ng; i++) g[i] = -fabsf(g[i]) * 0.3f;
    lm_kda_inputs in = {q, k, v, g, beta, A, dtb, h0};
    if (gate == 0) { in.A_log = NULL; in.dt_bias = NULL; }
    float *o1 = malloc(nv * 4), *o2 = malloc(nv * 4), *s1 = malloc(ns * 4), *s2 = malloc(ns * 4);
    lm_error err = {0};
    lm_kda_outputs out1 = {o1, s1}, out2 = {o2, s2};
    if (lm_kda_chunk_forward(&c, &in, &out1, &err)) { printf("err %s\n", err.msg); return 1; }
    if (lm_kda_recurrent_forward(&c, &in, &out2, &err)) { printf("err %s\n", err.msg); return 1; }
    printf("chunk vs recurrent: o %.3e  ht %.3e\n", relerr(o1, o2, nv), relerr(s1, s2, ns));
    float *dO = mk(nv, 1, 0), *dht = mk(ns, 1, 0);
    float *dq = calloc(nq, 4), *dk = calloc(nq, 4), *dv = calloc(nv, 4), *dg = calloc(ng, 4), *db = calloc(nb, 4), *dh0 = calloc(ns, 4), *dA = calloc(HV, 4), *ddt = calloc(kind ? HV : HV * K, 4);
    lm_kda_grads gr = {dO, dht, dq, dk, dv, dg, db, dh0, in.A_log ? dA : NULL, in.dt_bias ? ddt : NULL};
    if (lm_kda_chunk_backward(&c, &in, &gr, &err)) { printf("err %s\n", err.msg); return 1; }
    /* finite differences with the recurrent forward in fp32 (rough) */
    struct { const char *name; float *x; float *d; long n; } ps[] = {{"q", q, dq, nq}, {"k", k, dk, nq}, {"v", v, dv, nv}, {"g", g, dg, ng}, {"beta", beta, db, nb}, {"h0", h0, dh0, ns}, {"A_log", A, dA, HV}, {"dt_bias", dtb, ddt, kind ? HV : HV * K}};
    for (int pi = 0; pi < 8; pi++) {
        if (gate == 0 && pi >= 6) continue;
        double num = 0, den = 0;
        for (int s = 0; s < 6; s++) {
            long i = (long)(rand() % ps[pi].n);
            float x0 = ps[pi].x[i], hh = 1e-2f * (fabsf(x0) > 1 ? fabsf(x0) : 1);
            double L[2];
            for (int sgn = 0; sgn < 2; sgn++) {
                ps[pi].x[i] = x0 + (sgn ? -hh : hh);
                lm_kda_recurrent_forward(&c, &in, &out2, &err);
                double l = 0; for (long j = 0; j < nv; j++) l += (double)o2[j] * dO[j]; for (long j = 0; j < ns; j++) l += (double)s2[j] * dht[j];
                L[sgn] = l;
            }
            ps[pi].x[i] = x0;
            double fd = (L[0] - L[1]) / (2 * hh);
            num += (fd - ps[pi].d[i]) * (fd - ps[pi].d[i]); den += fd * fd;
        }
        printf("%-8s fd rel %.3e\n", ps[pi].name, sqrt(num / (den + 1e-30)));
    }
    return 0;
}
