/* dev/: how many subnormal (denormal) fp32 values do the chunked KDA kernels see at the
 * `linmoe bench kda` shapes and inputs, and what do FTZ/DAZ change (time, results)?
 *
 * Intel cores take a microcode assist (~100+ cycles) for an SSE/AVX operation whose
 * operand (DAZ off) or result (FTZ off) is subnormal; AMD Zen handles most cases in
 * hardware. This program compiles the chunked kernels (src/ops/cpu/kda_chunk.c) with
 * every small-GEMM call routed through a counter, so it counts, per GEMM operand, the
 * subnormal elements and the multiply-adds that read one (an element of A is read N
 * times, one of B M times), and the subnormal results. Inputs are those of
 * bench/bench_kda.c (same seeds and distributions), plus a "strong decay" variant
 * (raw gate shifted so that g is near the bound: -5 per token, -320 per chunk).
 *
 * The library's chunked kernels set FTZ/DAZ themselves (cpu/kda_cpu.h): to count what
 * they would see without it, and to time "off" against "on", build against a copy of
 * kda_cpu.h whose lm_kda_fp_enter does not set the bits (-I that copy's directory
 * before -Isrc; the timing then calls the same library twice, so it only means
 * something against a library built from such a copy).
 * Build (not part of CMake; needs build-h8/liblinmoe.a or any build of the library):
 *   gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L -Iinclude -Isrc \
 *     dev/kda_subnormal.c build-h8/liblinmoe.a -lopenblas -lcjson -lpcre2-8 -lm \
 *     -o /tmp/kda_subnormal
 * Run: OMP_NUM_THREADS=1 /tmp/kda_subnormal [T]      (counts are per thread-free run)
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/core.h"
#include "linmoe/kda.h"

/* ---- the kernels, with every small GEMM counted ---- */
#define lm_gemm_small counted_gemm_small
#define lm_gemm_small_nt counted_gemm_small_nt
#define lm_kda_chunk_forward dev_kda_chunk_forward
#define lm_kda_chunk_backward dev_kda_chunk_backward
#define lm_kda_diag_tile_shared dev_kda_diag_tile_shared
#define lm_kda_diag_tile_safe dev_kda_diag_tile_safe
#define lm_kda_use_shared_diag dev_kda_use_shared_diag
#define lm_kda_chunk_ws_floats dev_kda_chunk_ws_floats
#include "../src/ops/cpu/kda_chunk.c"
#undef lm_gemm_small
#undef lm_gemm_small_nt
void lm_gemm_small(int M, int N, int K, float alpha, const float *A, ptrdiff_t a_rs, ptrdiff_t a_cs,
                   const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc, int accumulate);

static int counting = 0;
static struct { double fma, fma_sub, elems, sub_a, sub_b, sub_c, calls; } cnt;

static int is_sub(float x) { return x != 0.0f && fabsf(x) < FLT_MIN; }

void counted_gemm_small(int M, int N, int K, float alpha, const float *A, ptrdiff_t a_rs,
                        ptrdiff_t a_cs, const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc,
                        int accumulate) {
    if (counting) {
        double sa = 0, sb = 0;
        for (int i = 0; i < M; i++)
            for (int p = 0; p < K; p++)
                sa += is_sub(A[i * a_rs + p * a_cs]);
        for (int p = 0; p < K; p++)
            for (int j = 0; j < N; j++)
                sb += is_sub(B[p * ldb + j]);
        cnt.sub_a += sa;
        cnt.sub_b += sb;
        cnt.fma += (double)M * N * K;
        cnt.fma_sub += sa * N + sb * M;
        cnt.elems += (double)M * K + (double)K * N;
        cnt.calls++;
    }
    lm_gemm_small(M, N, K, alpha, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
    if (counting)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++)
                cnt.sub_c += is_sub(C[i * ldc + j]);
}

void counted_gemm_small_nt(int M, int N, int K, float alpha, const float *A, ptrdiff_t lda,
                           const float *Bt, ptrdiff_t ldbt, float *C, ptrdiff_t ldc, int accumulate,
                           float *pack) {
    for (int j = 0; j < N; j++)
        for (int p = 0; p < K; p++)
            pack[p * N + j] = Bt[j * ldbt + p];
    counted_gemm_small(M, N, K, alpha, A, lda, 1, pack, N, C, ldc, accumulate);
}

/* ---- inputs of bench/bench_kda.c ---- */
typedef struct {
    int B, T, H, D;
    float *q, *k, *v, *x, *beta, *A_sp, *A_zero, *dtb, *dO, *o, *ht, *dq, *dk, *dv, *dg, *db, *dA,
        *ddt;
} bufs;

static float *al(int64_t n) { return malloc(sizeof(float) * (size_t)(n > 0 ? n : 1)); }

static void init(bufs *b, int B, int T, int H, int D, uint64_t seed) {
    b->B = B, b->T = T, b->H = H, b->D = D;
    const int64_t nqk = (int64_t)B * T * H * D, nb = (int64_t)B * T * H;
    b->q = al(nqk), b->k = al(nqk), b->v = al(nqk), b->x = al(nqk), b->beta = al(nb);
    b->A_sp = al(H), b->A_zero = al(H), b->dtb = al((int64_t)H * D), b->dO = al(nqk);
    b->o = al(nqk), b->ht = al((int64_t)B * H * D * D), b->dq = al(nqk), b->dk = al(nqk);
    b->dv = al(nqk), b->dg = al(nqk), b->db = al(nb), b->dA = al(H), b->ddt = al((int64_t)H * D);
    lm_rng r;
    lm_rng_init(&r, seed);
    float *fills[] = {b->q, b->k, b->v, b->x};
    for (int f = 0; f < 4; f++)
        for (int64_t i = 0; i < nqk; i++)
            fills[f][i] = (float)lm_rng_normal(&r);
    for (int64_t i = 0; i < nb; i++)
        b->beta[i] = (float)lm_rng_normal(&r);
    for (int64_t i = 0; i < nqk; i++)
        b->dO[i] = (float)lm_rng_normal(&r);
    for (int h = 0; h < H; h++) {
        b->A_sp[h] = (float)log(1.0 + 15.0 * lm_rng_uniform(&r));
        b->A_zero[h] = 0.0f;
    }
    for (int64_t i = 0; i < (int64_t)H * D; i++) {
        double dt = exp(log(1e-3) + (log(1e-1) - log(1e-3)) * lm_rng_uniform(&r));
        if (dt < 1e-4)
            dt = 1e-4;
        b->dtb[i] = (float)(dt + log(-expm1(-dt)));
    }
}

static void cfg(lm_kda_config *c, lm_kda_inputs *in, lm_kda_outputs *out, lm_kda_grads *gr, bufs *b,
                int gate, lm_kda_workspace *ws) {
    lm_kda_config_default(c, b->B, b->T, b->H, b->H, b->D, b->D);
    c->ws = ws;
    c->use_qk_l2norm_in_kernel = 1;
    c->use_beta_sigmoid_in_kernel = 1;
    if (gate == 0) {
        c->gate = LM_GATE_BOUNDED;
        c->has_lower_bound = 1;
        c->lower_bound = -5.0f;
    } else {
        c->gate = LM_GATE_SOFTPLUS;
    }
    lm_kda_inputs i = {b->q,   b->k, b->v, b->x, b->beta, gate == 0 ? b->A_zero : b->A_sp,
                       b->dtb, NULL};
    *in = i;
    lm_kda_outputs o = {b->o, b->ht};
    *out = o;
    lm_kda_grads g = {b->dO, NULL, b->dq, b->dk, b->dv, b->dg, b->db, NULL, b->dA, b->ddt};
    *gr = g;
}

static int64_t count_sub(const float *x, int64_t n) {
    int64_t s = 0;
    for (int64_t i = 0; i < n; i++)
        s += is_sub(x[i]);
    return s;
}

static void set_ftz_daz(int on) {
    unsigned m = _mm_getcsr();
    m = on ? (m | 0x8040u) : (m & ~0x8040u);
    _mm_setcsr(m);
}

int main(int argc, char **argv) {
    const int T = argc > 1 ? atoi(argv[1]) : 4096;
    const int shapes[2][4] = {{1, T, 4, 128}, {4, T / 2, 4, 64}};
    lm_kda_workspace *ws = lm_kda_workspace_new();
    for (int si = 0; si < 2; si++) {
        bufs b;
        init(&b, shapes[si][0], shapes[si][1], shapes[si][2], shapes[si][3], 1000 + si);
        const int64_t n = (int64_t)b.B * b.T * b.H * b.D;
        for (int variant = 0; variant < 2; variant++) {
            if (variant == 1) /* strong decay: sigmoid / softplus near saturation */
                for (int64_t i = 0; i < n; i++)
                    b.x[i] += 8.0f;
            for (int gate = 0; gate < 2; gate++) {
                lm_kda_config c;
                lm_kda_inputs in;
                lm_kda_outputs out;
                lm_kda_grads gr;
                cfg(&c, &in, &out, &gr, &b, gate, ws);
                lm_error err = {0};
                memset(&cnt, 0, sizeof cnt);
                counting = 1;
                if (dev_kda_chunk_forward(&c, &in, &out, &err) ||
                    dev_kda_chunk_backward(&c, &in, &gr, &err)) {
                    fprintf(stderr, "%s\n", err.msg);
                    return 1;
                }
                counting = 0;
                printf("[%d,%d,%d,%d] %-8s %-6s fwd+bwd: %.0f gemm calls, %.3g FMAs, %.3g with a "
                       "subnormal operand (%.2e), subnormal operands A %.3g B %.3g of %.3g "
                       "(%.2e), subnormal results %.3g; outputs o %lld dq %lld dg %lld\n",
                       b.B, b.T, b.H, b.D, gate ? "softplus" : "bounded",
                       variant ? "strong" : "bench", cnt.calls, cnt.fma, cnt.fma_sub,
                       cnt.fma_sub / cnt.fma, cnt.sub_a, cnt.sub_b, cnt.elems,
                       (cnt.sub_a + cnt.sub_b) / cnt.elems, cnt.sub_c, (long long)count_sub(b.o, n),
                       (long long)count_sub(b.dq, n), (long long)count_sub(b.dg, n));
                /* time and results with FTZ/DAZ off and on (the library as built) */
                float *o0 = al(n), *dg0 = al(n);
                double ms[2][2];
                for (int f = 0; f < 2; f++) {
                    set_ftz_daz(f);
                    for (int mode = 0; mode < 2; mode++) {
                        double best = 1e30;
                        for (int rep = 0; rep < 3; rep++) {
                            const double t0 = lm_time_sec();
                            lm_kda_chunk_forward(&c, &in, &out, &err);
                            if (mode)
                                lm_kda_chunk_backward(&c, &in, &gr, &err);
                            const double dt = (lm_time_sec() - t0) * 1e3;
                            best = dt < best ? dt : best;
                        }
                        ms[f][mode] = best;
                    }
                    if (f == 0) {
                        memcpy(o0, b.o, sizeof(float) * (size_t)n);
                        memcpy(dg0, b.dg, sizeof(float) * (size_t)n);
                    }
                    set_ftz_daz(0);
                }
                double eo = 0, no = 0, eg = 0, ng = 0;
                for (int64_t i = 0; i < n; i++) {
                    eo += (double)(b.o[i] - o0[i]) * (b.o[i] - o0[i]);
                    no += (double)o0[i] * o0[i];
                    eg += (double)(b.dg[i] - dg0[i]) * (b.dg[i] - dg0[i]);
                    ng += (double)dg0[i] * dg0[i];
                }
                printf("    best of 3: fwd %.1f ms -> %.1f ms with FTZ/DAZ, fwd+bwd %.1f -> %.1f "
                       "ms; FTZ/DAZ vs not: o rel %.2e, dg rel %.2e\n",
                       ms[0][0], ms[1][0], ms[0][1], ms[1][1], sqrt(eo / no), sqrt(eg / ng));
                free(o0);
                free(dg0);
            }
        }
    }
    lm_kda_workspace_free(ws);
    return 0;
}
