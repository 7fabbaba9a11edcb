/* KDA / GDN chunked forward on the GPU, tensor-core version (include/linmoe/kda_cuda.h
 * has the contract; docs/perf-notes.md the versions and their numbers).
 *
 * Notation per (sequence n, value head hv), chunk of L <= 64 tokens starting at t0,
 * rows i, j in [0, 64), channels d in [0, 128) (K, V zero-padded to 128), after the
 * in-kernel l2norm / scale (reference/kda.md §2.1; Kimi Linear Eqs. 6-9):
 *   G_i      = sum_{r <= i} g_r                      (per channel; <= 0, decreasing)
 *   Akk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)   (j < i)
 *   Aqk[i,j] = sum_d q_i k_j exp(G_i - G_j)          (j <= i)
 *   X        = (I + Akk)^-1                           (unit lower triangular)
 *   w        = X (beta k exp(G)),   u = X (beta v)
 *   per chunk, with S the state at its start:
 *   v'       = u - w S
 *   o        = (q exp(G)) S + Aqk v'
 *   S       <- exp(G_last) * S + (k exp(G_last - G))^T v'
 *
 * Akk and Aqk run on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate):
 * exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) with a reference row r between the key
 * rows and the query rows, so both factors are <= 1 for any gate. On the diagonal the
 * bounded gate (reference/kda.md §3.3, T1 of the design) puts r in the middle of a
 * 32-row half: |G_i - G_r| <= 16 |lower_bound| <= 80 for every row of the half, so the
 * factors stay within e^(+-80) and the diagonal shares the matmul path (three rounds:
 * two halves, then the lower-left 32 x 32 block). Other gates take the safe path on the
 * diagonal 16 x 16 blocks: per-pair exp(G_i - G_j) in fp32.
 *
 * The recurrence runs in value-column slices (kda_inter_tc, mma.sync); for the inference
 * forward at about a sequence-head per SM it runs on wgmma over all 128 columns
 * (kda_inter_wg: tensor-map loads, started per sequence-head under a programmatically
 * dependent launch; docs/perf-notes.md v11).
 */
#include <cuda.h> /* CUtensorMap (the driver entry point is fetched at run time) */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <type_traits>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/kda_cuda.h"

#include "ops/cuda/kda_common.cuh"

namespace {

/* m16n8k16 operand fragments from fp32 shared memory, split into bf16 hi + lo (lane l:
 * g = l / 4, t = l % 4). A: 16 x 16 row-major at A (row stride ld); B: 16 x 8 stored
 * [k][n] at B. */
__device__ __forceinline__ void split_pack(float x, float y, uint32_t &hi, uint32_t &lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    hi = *reinterpret_cast<const uint32_t *>(&h);
    lo = pack_bf16(x - __low2float(h), y - __high2float(h));
}
__device__ __forceinline__ void frag_a_f32(uint32_t hi[4], uint32_t lo[4], const float *A, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 v = *reinterpret_cast<const float2 *>(A + (g + (i & 1) * 8) * ld + 2 * t + (i >> 1) * 8);
        split_pack(v.x, v.y, hi[i], lo[i]);
    }
}
__device__ __forceinline__ void frag_b_f32(uint32_t hi[2], uint32_t lo[2], const float *B, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; i++)
        split_pack(B[(2 * t + 8 * i) * ld + g], B[(2 * t + 8 * i + 1) * ld + g], hi[i], lo[i]);
}

/* ------------------------------------------------------------------ kernel 1 */
/* One CTA per (chunk, value head), 8 warps. Shared memory layout (bytes): */
struct IntraSmem {
    float G[BT][GS];            /* gate, then its cumulative sum over rows, both times log2(e)
                                 * (fp32; exponentials are ex2 of differences) */
    bf16 q[BT][RS], k[BT][RS];  /* q, k as loaded; later beta k e^G and beta v */
    union {
        struct {
            bf16 op[96][RS]; /* a round's operands of Aqk / Akk: q rows, k rows, key rows */
        } a;
        struct {
            bf16 hi[BT][AS], lo[BT][AS]; /* X = hi + lo in bf16 (about fp32 accuracy) for w / u */
        } x;
    } u;
    float A[BT][FS];            /* Akk, then X = (I + Akk)^-1 in place */
    float nq[BT], nk[BT], beta[BT], gtot[KD];
};

/* Aqk's 10 blocks on or below the diagonal are staged in bf16 in A's strictly upper
 * 16 x 16 blocks, which nothing uses until the off-diagonal inverse parks T there: lower
 * block k = I (I + 1) / 2 + J goes to upper block (0,1) (0,2) (0,3) (1,2) (1,3) [k / 2],
 * columns 16 (k % 2) .. of its bf16 view (row stride 2 FS). From there they leave with
 * 16-byte stores (4-byte stores straight from the fragments half-filled their sectors). */
__device__ __forceinline__ bf16 *aqk_stage(float (*A)[FS], int I, int J) {
    const int k = I * (I + 1) / 2 + J, slot = k >> 1;
    const int r = slot < 3 ? 0 : 1, c = slot < 3 ? slot + 1 : slot - 1;
    return reinterpret_cast<bf16 *>(&A[16 * r][16 * c]) + 16 * (k & 1);
}
#define AQS (2 * FS) /* row stride of a staged Aqk block (bf16 elements) */

__global__ void __launch_bounds__(NT1, 2) kda_intra_tc(Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    IntraSmem &s = *reinterpret_cast<IntraSmem *>(smem_raw);
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int2 ch = p.chunks[ci];
    const int t0 = ch.x, L = ch.y;
    const int K = p.K, V = p.V, H = p.H, HV = p.HV;
    const int h = HV == H ? hv : hv / (HV / H); /* no integer division without GVA */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t cb = (int64_t)ci * HV + hv;
    if (p.flags) /* kda_inter_wg (launched programmatically dependent) may start once every
                  * CTA of this grid has: it waits on the per-block flags, not the grid */
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    constexpr int NIT = BT * (KD / 8) / NT1; /* 8-wide items per thread: 4 */
    /* item m of this thread: row i = tid / 16 + 16 m, channels d0 .. d0 + 7 */
    const int d0 = (tid & 15) * 8, r0 = tid >> 4;
    const bool vecK = (K & 7) == 0, vecV = (V & 7) == 0;
    const uint4 z4 = make_uint4(0, 0, 0, 0);

    /* 1. every global load of q, k, g first (in flight together), then v (used late) */
    uint4 rq[NIT], rk[NIT], rg[NIT], vreg[NIT];
    {
        /* row r0 of this thread's items, the others 16 m rows further (one stride each) */
        const int64_t sH = (int64_t)16 * H * K, sG = (int64_t)16 * HV * K,
                      sV = (int64_t)16 * HV * V;
        const int64_t oH = ((int64_t)(t0 + r0) * H + h) * K + d0;
        const bf16 *q0 = p.q + oH, *k0 = p.k + oH;
        const bf16 *g0 = p.g + ((int64_t)(t0 + r0) * HV + hv) * K + d0;
        const bf16 *v0 = p.v + ((int64_t)(t0 + r0) * HV + hv) * V + d0;
#pragma unroll
        for (int m = 0; m < NIT; m++) {
            const int i = r0 + 16 * m;
            rq[m] = rk[m] = rg[m] = z4;
            if (i < L && vecK && d0 < K) {
                rq[m] = __ldg(reinterpret_cast<const uint4 *>(q0 + m * sH));
                rk[m] = __ldg(reinterpret_cast<const uint4 *>(k0 + m * sH));
                if (!p.gdn)
                    rg[m] = __ldg(reinterpret_cast<const uint4 *>(g0 + m * sG));
            }
        }
#pragma unroll
        for (int m = 0; m < NIT; m++) {
            const int i = r0 + 16 * m;
            vreg[m] = z4;
            if (i < L && vecV && d0 < V)
                vreg[m] = __ldg(reinterpret_cast<const uint4 *>(v0 + m * sV));
        }
    }
    if (!vecK || !vecV) { /* K or V not a multiple of 8: element loads */
#pragma unroll
        for (int m = 0; m < NIT; m++) {
            const int i = r0 + 16 * m;
            if (i >= L)
                continue;
            const int64_t row = (int64_t)(t0 + i);
            bf16 *tq = reinterpret_cast<bf16 *>(&rq[m]), *tk = reinterpret_cast<bf16 *>(&rk[m]);
            bf16 *tg = reinterpret_cast<bf16 *>(&rg[m]), *tv = reinterpret_cast<bf16 *>(&vreg[m]);
            for (int x = 0; x < 8; x++) {
                const int d = d0 + x;
                if (!vecK) {
                    tq[x] = d < K ? p.q[(row * H + h) * K + d] : __float2bfloat16(0.0f);
                    tk[x] = d < K ? p.k[(row * H + h) * K + d] : __float2bfloat16(0.0f);
                    if (!p.gdn)
                        tg[x] = d < K ? p.g[(row * HV + hv) * K + d] : __float2bfloat16(0.0f);
                }
                if (!vecV)
                    tv[x] = d < V ? p.v[(row * HV + hv) * V + d] : __float2bfloat16(0.0f);
            }
        }
    }
    /* gate parameters of this thread's channels */
    const float ga = p.A_log ? fexp(p.A_log[hv]) : 1.0f;
    float gb[8];
    if (p.dt_bias && !p.gdn && vecK && d0 < K && ((uintptr_t)p.dt_bias & 15) == 0) {
        /* 8 whole channels: two 16-byte loads */
        const float4 b0 = __ldg(reinterpret_cast<const float4 *>(p.dt_bias + hv * K + d0));
        const float4 b1 = __ldg(reinterpret_cast<const float4 *>(p.dt_bias + hv * K + d0 + 4));
        gb[0] = b0.x; gb[1] = b0.y; gb[2] = b0.z; gb[3] = b0.w;
        gb[4] = b1.x; gb[5] = b1.y; gb[6] = b1.z; gb[7] = b1.w;
    } else {
#pragma unroll
        for (int x = 0; x < 8; x++)
            gb[x] = (p.dt_bias && (p.gdn || d0 + x < K)) ? p.dt_bias[p.gdn ? hv : hv * K + d0 + x] : 0.0f;
    }
    if (tid < BT) {
        float b = 0.0f;
        if (tid < L) {
            b = __bfloat162float(p.beta[(int64_t)(t0 + tid) * HV + hv]);
            if (p.sig)
                b = sigmoidf_(b);
        }
        s.beta[tid] = b;
    }
    /* 2. q, k to shared memory; row sums of squares (16 lanes share a row); gate */
#pragma unroll
    for (int m = 0; m < NIT; m++) {
        const int i = r0 + 16 * m;
        *reinterpret_cast<uint4 *>(&s.q[i][d0]) = rq[m];
        *reinterpret_cast<uint4 *>(&s.k[i][d0]) = rk[m];
        float xq[8], xk[8], f[8];
        const __nv_bfloat162 *hq = reinterpret_cast<const __nv_bfloat162 *>(&rq[m]);
        const __nv_bfloat162 *hk = reinterpret_cast<const __nv_bfloat162 *>(&rk[m]);
        const __nv_bfloat162 *hg = reinterpret_cast<const __nv_bfloat162 *>(&rg[m]);
        float a = 0, b = 0;
#pragma unroll
        for (int x = 0; x < 4; x++) {
            xq[2 * x] = __low2float(hq[x]);
            xq[2 * x + 1] = __high2float(hq[x]);
            xk[2 * x] = __low2float(hk[x]);
            xk[2 * x + 1] = __high2float(hk[x]);
            f[2 * x] = __low2float(hg[x]);
            f[2 * x + 1] = __high2float(hg[x]);
        }
#pragma unroll
        for (int x = 0; x < 8; x++) {
            a += xq[x] * xq[x];
            b += xk[x] * xk[x];
        }
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, o);
            b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        if ((tid & 15) == 0) {
            s.nq[i] = (p.l2 ? rsqrtf(a + 1e-6f) : 1.0f) * p.scale;
            s.nk[i] = p.l2 ? rsqrtf(b + 1e-6f) : 1.0f;
        }
        if (p.gdn) {
            const float gx = i < L ? __bfloat162float(p.g[(int64_t)(t0 + i) * HV + hv]) : 0.0f;
#pragma unroll
            for (int x = 0; x < 8; x++)
                f[x] = gx;
        }
        /* the gate in log2 units (one branch per row item, not per element), then zero
         * outside [L, K] */
        gate_log2_n<8, 1>(p.gate, f, gb, ga, p.lb);
        if (!(i < L && d0 + 8 <= K)) /* only the last chunk's rows and K's tail */
#pragma unroll
            for (int x = 0; x < 8; x++)
                f[x] = (i < L && d0 + x < K) ? f[x] : 0.0f;
        *reinterpret_cast<float4 *>(&s.G[i][d0]) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4 *>(&s.G[i][d0 + 4]) = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncthreads();
    /* 3. cumulative sum over rows: thread (channel, half of the rows) with the half
     * prefetched into registers; the second half then adds the first half's total */
    {
        const int d = tid & (KD - 1), seg = tid >> 7;
        float gv[32];
#pragma unroll
        for (int x = 0; x < 32; x++)
            gv[x] = s.G[seg * 32 + x][d];
#pragma unroll
        for (int x = 1; x < 32; x++)
            gv[x] += gv[x - 1];
        if (seg == 0)
            s.gtot[d] = gv[31];
        __syncthreads();
        const float base = seg ? s.gtot[d] : 0.0f;
#pragma unroll
        for (int x = 0; x < 32; x++)
            s.G[seg * 32 + x][d] = gv[x] + base;
    }
    __syncthreads();
    if (p.nqs && tid < BT) { /* training forward: the row factors */
        p.nqs[cb * BT + tid] = s.nq[tid];
        p.nks[cb * BT + tid] = s.nk[tid];
        p.bs[cb * BT + tid] = s.beta[tid];
    }

    bf16 *Aqk = p.Aqk + cb * BT * BT;
    /* Aqk's and P's blocks above the diagonal are left unwritten: kda_inter_tc and
     * kda_bwd_dh read only Aqk's blocks at or below it, kda_bwd_ut selects P's. */
    /* safe diagonal (any gate): per-pair exponent in fp32 on the CUDA cores */
    if (!p.shared_diag) {
        for (int e = tid; e < 4 * 16 * 16; e += NT1) {
            const int a = e >> 8, r = (e >> 4) & 15, c = e & 15;
            const int i = a * 16 + r, j = a * 16 + c;
            float aq = 0, ak = 0;
            if (j <= i) {
                for (int d = 0; d < KD; d++) {
                    const float f = ex2f(s.G[i][d] - s.G[j][d]) * __bfloat162float(s.k[j][d]);
                    aq += __bfloat162float(s.q[i][d]) * f;
                    ak += __bfloat162float(s.k[i][d]) * f;
                }
            }
            aqk_stage(s.A, a, a)[r * AQS + c] = __float2bfloat16(j <= i ? aq * s.nq[i] * s.nk[j] : 0.0f);
            s.A[i][j] = j < i ? ak * s.nk[i] * s.nk[j] * s.beta[i] : 0.0f;
            if (p.Ps)
                p.Ps[cb * BT * BT + i * BT + j] = __float2bfloat16(j < i ? ak * s.nk[i] * s.nk[j] : 0.0f);
        }
    }
    /* Aqk, Akk on the tensor cores in three rounds; a round scales its query rows (q and k,
     * rows qb ..) by exp(G_i - G_ref) and its key rows (kb ..) by exp(G_ref - G_j); the row
     * factors nq, nk are applied to the products (on the accumulators), not the operands:
     * - bounded gate (shared diagonal): 32-row halves with the reference in the middle row
     *   (15, 47), so |G_i - G_ref| <= 16 |lower_bound| <= 80 on both sides and every factor
     *   is a normal fp32 / bf16 number (the masked products above the diagonal may
     *   overflow; they are selected away, never multiplied); then rows 32..63 against keys
     *   0..31 with the same operands of rows 32..63 (reference 47) and only the key rows
     *   rebuilt: exp(G_47 - G_j) <= 1, and where it flushes to zero (below e^-87.3) the
     *   true product exp(G_i - G_j) <= e^(15 * 5) e^-87.3 < 5e-6 (i >= 32) is dropped;
     * - other gates: rows 16a.. (a = 1..3) against keys 0..16a-1 with the reference at row
     *   16a - 1 (factors <= 1); the diagonal blocks took the safe path above. */
    for (int rd = 0; rd < 3; rd++) {
        int qb, nqb, kb, nkb, ref, ntiles;
        if (p.shared_diag) {
            qb = rd == 0 ? 0 : 32;
            kb = rd == 1 ? 32 : 0;
            ref = rd == 0 ? 15 : 47;
            nqb = nkb = 2;
            ntiles = rd < 2 ? 3 : 4; /* (0,0) (1,0) (1,1) | all four */
        } else {
            qb = 16 * (rd + 1);
            kb = 0;
            ref = qb - 1;
            nqb = 1;
            nkb = ntiles = rd + 1; /* (0, J), J < nkb */
        }
        /* the bounded gate's last round keeps the query operands of the one before; its
         * first two rounds use the same rows as query and key rows (one pass over them) */
        const bool build_q = !(p.shared_diag && rd == 2);
        const bool same_rows = p.shared_diag && rd < 2;
        bf16 *opQ = &s.u.a.op[0][0], *opK = opQ + 16 * nqb * RS, *opC = opQ + 32 * nqb * RS;
        __syncthreads();
        float ra[8]; /* this thread's channels are the same d0 in every item */
        ld8f(ra, &s.G[ref][d0]);
        /* query and key-side operands of row i (slot r): q, k times exp(G_i - G_ref), one
         * exponential for both; k and G of the row are left in xk, gr */
        auto qk_operands = [&](int r, int i, float (&xk)[8], float (&gr)[8], float (&fq)[8], float (&fk)[8]) {
            float xq[8];
            ld8h(xq, &s.q[i][d0]);
            ld8h(xk, &s.k[i][d0]);
            ld8f(gr, &s.G[i][d0]);
#pragma unroll
            for (int x = 0; x < 8; x++) {
                const float e = ex2f(gr[x] - ra[x]);
                fq[x] = xq[x] * e;
                fk[x] = xk[x] * e;
            }
            st8h(opQ + r * RS + d0, fq);
            st8h(opK + r * RS + d0, fk);
        };
        if (same_rows) {
            /* the bounded gate's qg, kg, beta k e^G (and, for rows 32..63, beta v) come out
             * of these two rounds (the pass after the inverse is for the other gates):
             * q e^G = (q e^(G - G_ref)) e^(G_ref) is the round's fp32 operand times one
             * exponential per channel. e^(G_ref) flushes to zero only below e^-87.3 (ref
             * 47), where every row of the half has e^G <= e^(15 |lb|) e^-87.3 < 5e-6. */
            float ea[8], Gl[8]; /* Gl: G of the chunk's last row */
            ld8f(Gl, &s.G[BT - 1][d0]);
#pragma unroll
            for (int x = 0; x < 8; x++)
                ea[x] = ex2f(ra[x]);
#pragma unroll 1
            for (int jr = 0; jr < 2; jr++) { /* rows r0, r0 + 16 of the half: items 2 rd + jr */
                const int r = r0 + 16 * jr, i = qb + r;
                float xk[8], gr[8], fq[8], fk[8], fc[8];
                qk_operands(r, i, xk, gr, fq, fk);
#pragma unroll
                for (int x = 0; x < 8; x++)
                    fc[x] = xk[x] * ex2f(ra[x] - gr[x]);
                st8h(opC + r * RS + d0, fc);
                const float nq = s.nq[i], nk = s.nk[i], bk = s.beta[i] * nk;
                float oq[8], ok[8], ob[8];
#pragma unroll
                for (int x = 0; x < 8; x++) {
                    oq[x] = fq[x] * nq * ea[x];
                    ok[x] = xk[x] * nk * ex2f(Gl[x] - gr[x]);
                    ob[x] = fk[x] * ea[x]; /* k e^G */
                }
                st8h(p.qg + (cb * BT + i) * KD + d0, oq);
                st8h(p.kg + (cb * BT + i) * KD + d0, ok);
                if (p.Kgs) { /* training: Kg = nk k e^G for the backward */
                    float og[8];
#pragma unroll
                    for (int x = 0; x < 8; x++)
                        og[x] = ob[x] * nk;
                    st8h(p.Kgs + (cb * BT + i) * KD + d0, og);
                }
#pragma unroll
                for (int x = 0; x < 8; x++)
                    ob[x] *= bk;
                st8h(&s.q[i][d0], ob); /* rounds 2 and 3 read no row of q this one wrote */
                if (rd == 1) { /* round 3 reads k of rows 0..31 only */
                    float fv[8];
                    const uint4 vv = jr ? vreg[3] : vreg[2]; /* a select, not an indexed array */
                    ld8h(fv, reinterpret_cast<const bf16 *>(&vv));
#pragma unroll
                    for (int x = 0; x < 8; x++)
                        fv[x] *= s.beta[i];
                    st8h(&s.k[i][d0], fv);
                }
            }
        } else if (build_q)
            for (int r = r0; r < 16 * nqb; r += NT1 / 16) { /* q and k rows */
                float xk[8], gr[8], fq[8], fk[8];
                qk_operands(r, qb + r, xk, gr, fq, fk);
            }
        if (!same_rows)
            for (int r = r0; r < 16 * nkb; r += NT1 / 16) { /* key rows */
                const int j = kb + r;
                float gr[8], x8[8], f[8];
                ld8h(x8, &s.k[j][d0]);
                ld8f(gr, &s.G[j][d0]);
#pragma unroll
                for (int x = 0; x < 8; x++)
                    f[x] = x8[x] * ex2f(ra[x] - gr[x]);
                st8h(opC + r * RS + d0, f);
                if (p.shared_diag) { /* the bounded gate's last round: beta v of rows 0..31 */
                    float fv[8];
                    const uint4 vv = r < 16 ? vreg[0] : vreg[1]; /* a select, not an indexed array */
                    ld8h(fv, reinterpret_cast<const bf16 *>(&vv));
#pragma unroll
                    for (int x = 0; x < 8; x++)
                        fv[x] *= s.beta[j];
                    st8h(&s.k[j][d0], fv);
                }
            }
        __syncthreads();
        /* jobs: 16 x 16 tile (I, J) of the round x {Aqk, Akk}; one per warp */
        for (int job = warp; job < 2 * ntiles; job += NT1 / 32) {
            const int tile = job >> 1, isk = job & 1;
            int I, J;
            if (p.shared_diag) {
                I = rd < 2 ? (tile > 0) : (tile >> 1);
                J = rd < 2 ? (tile == 2) : (tile & 1);
            } else {
                I = 0;
                J = tile;
            }
            const bf16 *A = (isk ? opK : opQ) + 16 * I * RS;
            const bf16 *Bm = opC + 16 * J * RS;
            float acc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
            uint32_t fa[2][4], fb[2][4];
            ldsm4(fa[0], a_addr(A, RS, 0, 0, lane));
            ldsm4(fb[0], b_nk_addr(Bm, RS, 0, 0, lane));
#pragma unroll
            for (int ks = 0; ks < KD / 16; ks++) { /* step ks + 1 requested before ks's products */
                const int f = ks & 1;
                if (ks + 1 < KD / 16) {
                    ldsm4(fa[f ^ 1], a_addr(A, RS, 0, (ks + 1) * 16, lane));
                    ldsm4(fb[f ^ 1], b_nk_addr(Bm, RS, (ks + 1) * 16, 0, lane));
                }
                mma16816(acc[0], fa[f], fb[f][0], fb[f][1]);
                mma16816(acc[1], fa[f], fb[f][2], fb[f][3]);
            }
            const int g = lane >> 2, t = lane & 3;
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int i = qb + 16 * I + g + hh * 8;
                    const int j = kb + 16 * J + nt * 8 + 2 * t;
                    const float2 nj = *reinterpret_cast<const float2 *>(&s.nk[j]);
                    const float ni = isk ? s.nk[i] : s.nq[i];
                    const float v0 = acc[nt][2 * hh] * ni * nj.x, v1 = acc[nt][2 * hh + 1] * ni * nj.y;
                    if (isk) {
                        s.A[i][j] = j < i ? v0 * s.beta[i] : 0.0f;
                        s.A[i][j + 1] = j + 1 < i ? v1 * s.beta[i] : 0.0f;
                        if (p.Ps)
                            *reinterpret_cast<uint32_t *>(p.Ps + cb * BT * BT + i * BT + j) =
                                pack_bf16(j < i ? v0 : 0.0f, j + 1 < i ? v1 : 0.0f);
                    } else {
                        bf16 *st = aqk_stage(s.A, (qb >> 4) + I, (kb >> 4) + J);
                        *reinterpret_cast<uint32_t *>(st + (g + hh * 8) * AQS + nt * 8 + 2 * t) =
                            pack_bf16(j <= i ? v0 : 0.0f, j + 1 <= i ? v1 : 0.0f);
                    }
                }
        }
    }
    __syncthreads();
    /* X = (I + Akk)^-1 in place: diagonal 16x16 blocks by substitution, a lane per
     * column (read all, then write) */
    if (tid < 4 * 32) {
        const int a = tid >> 5, c = lane & 15, o = a * 16;
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < r; j++)
                acc += s.A[o + r][o + j] * x[j];
            x[r] = r < c ? 0.0f : (r == c ? 1.0f : -acc);
        }
        __syncwarp();
        if (lane < 16) {
#pragma unroll
            for (int r = 0; r < 16; r++)
                s.A[o + r][o + c] = x[r];
        }
    } else { /* meanwhile the other 4 warps store the staged Aqk blocks */
        for (int e = tid - 4 * 32; e < 10 * 16 * 2; e += NT1 - 4 * 32) {
            const int k = e >> 5, r = (e >> 1) & 15, hf = e & 1;
            const int I = (k >= 1) + (k >= 3) + (k >= 6), J = k - I * (I + 1) / 2;
            *reinterpret_cast<uint4 *>(Aqk + (I * 16 + r) * BT + J * 16 + hf * 8) =
                *reinterpret_cast<const uint4 *>(aqk_stage(s.A, I, J) + r * AQS + hf * 8);
        }
    }
    __syncthreads();
    /* block rows I = 1..3: X_IJ = -X_II T_IJ, T_IJ = sum_{J <= K < I} A_IK X_KJ, a warp per
     * 16 x 16 tile (J = warp) on the tensor cores with fp32 operands as bf16 hi + lo (three
     * mma per product: hi hi, hi lo, lo hi; about fp32 accuracy). T is parked in the unused
     * upper-right block [J*16 + r][I*16 + c] and read back as the B operand. */
    for (int I = 1; I < 4; I++) {
        /* warp: tile column block J = warp / 2, 8-column half nt = warp % 2 */
        const int J = warp >> 1, nt = warp & 1, g = lane >> 2, t = lane & 3;
        if (J < I) {
            float acc[4] = {0, 0, 0, 0};
            for (int Kb = J; Kb < I; Kb++) {
                uint32_t ah[4], al[4], bh[2], bl[2];
                frag_a_f32(ah, al, &s.A[I * 16][Kb * 16], FS, lane);
                frag_b_f32(bh, bl, &s.A[Kb * 16][J * 16 + nt * 8], FS, lane);
                mma16816(acc, ah, bh[0], bh[1]);
                mma16816(acc, ah, bl[0], bl[1]);
                mma16816(acc, al, bh[0], bh[1]);
            }
            float *dst = &s.A[J * 16 + g][I * 16 + nt * 8 + 2 * t];
            *reinterpret_cast<float2 *>(dst) = make_float2(acc[0], acc[1]);
            *reinterpret_cast<float2 *>(dst + 8 * FS) = make_float2(acc[2], acc[3]);
        }
        __syncthreads(); /* every A_IK read before X_IJ overwrites A_IJ */
        if (J < I) {
            float acc[4] = {0, 0, 0, 0};
            uint32_t ah[4], al[4], bh[2], bl[2];
            frag_a_f32(ah, al, &s.A[I * 16][I * 16], FS, lane);
            frag_b_f32(bh, bl, &s.A[J * 16][I * 16 + nt * 8], FS, lane);
            mma16816(acc, ah, bh[0], bh[1]);
            mma16816(acc, ah, bl[0], bl[1]);
            mma16816(acc, al, bh[0], bh[1]);
            float *dst = &s.A[I * 16 + g][J * 16 + nt * 8 + 2 * t];
            *reinterpret_cast<float2 *>(dst) = make_float2(-acc[0], -acc[1]);
            *reinterpret_cast<float2 *>(dst + 8 * FS) = make_float2(-acc[2], -acc[3]);
        }
        __syncthreads();
    }
    /* X to bf16 (upper part zero); qg, kg, gl out; beta k e^G and beta v in place of q, k */
    for (int e = tid; e < BT * BT / 4; e += NT1) { /* 4 columns per item */
        const int i = e / (BT / 4), j = (e % (BT / 4)) * 4;
        const float4 a = *reinterpret_cast<const float4 *>(&s.A[i][j]);
        const float4 xv = make_float4(j <= i ? a.x : 0.0f, j + 1 <= i ? a.y : 0.0f,
                                      j + 2 <= i ? a.z : 0.0f, j + 3 <= i ? a.w : 0.0f);
        if (p.Xs)
            *reinterpret_cast<float4 *>(p.Xs + cb * BT * BT + i * BT + j) = xv;
        const __nv_bfloat162 h0 = __floats2bfloat162_rn(xv.x, xv.y);
        const __nv_bfloat162 h1 = __floats2bfloat162_rn(xv.z, xv.w);
        uint2 hi, lo;
        hi.x = *reinterpret_cast<const uint32_t *>(&h0);
        hi.y = *reinterpret_cast<const uint32_t *>(&h1);
        lo.x = pack_bf16(xv.x - __low2float(h0), xv.y - __high2float(h0));
        lo.y = pack_bf16(xv.z - __low2float(h1), xv.w - __high2float(h1));
        *reinterpret_cast<uint2 *>(&s.u.x.hi[i][j]) = hi;
        *reinterpret_cast<uint2 *>(&s.u.x.lo[i][j]) = lo;
    }
    if (!p.shared_diag) { /* the other gates (the bounded gate's come out of its rounds) */
        float Gl[8]; /* G of the chunk's last row, this thread's channels */
        ld8f(Gl, &s.G[BT - 1][d0]);
#pragma unroll
        for (int m = 0; m < NIT; m++) {
            const int i = r0 + 16 * m;
            float fq[8], fk[8], fb[8], fv[8], G[8], xq[8], xk[8];
            const bf16 *vb = reinterpret_cast<const bf16 *>(&vreg[m]);
            ld8f(G, &s.G[i][d0]);
            ld8h(xq, &s.q[i][d0]);
            ld8h(xk, &s.k[i][d0]);
            const float nq = s.nq[i], nk = s.nk[i], be = s.beta[i];
#pragma unroll
            for (int x = 0; x < 8; x++) {
                const float kq = xk[x] * nk;
                const float eg = ex2f(G[x]);
                fq[x] = xq[x] * nq * eg;
                fk[x] = kq * ex2f(Gl[x] - G[x]);
                fb[x] = kq * eg; /* Kg */
                fv[x] = be * __bfloat162float(vb[x]);
            }
            st8h(p.qg + (cb * BT + i) * KD + d0, fq);
            st8h(p.kg + (cb * BT + i) * KD + d0, fk);
            if (p.Kgs) /* training: Kg = nk k e^G for the backward */
                st8h(p.Kgs + (cb * BT + i) * KD + d0, fb);
#pragma unroll
            for (int x = 0; x < 8; x++)
                fb[x] *= be;
            st8h(&s.q[i][d0], fb); /* this thread alone reads q[i][d0..] */
            st8h(&s.k[i][d0], fv);
        }
    }
    if (tid < KD)
        p.gl[cb * KD + tid] = ex2f(s.G[BT - 1][tid]);
    __syncthreads();
    /* w = X (beta k e^G), u = X (beta v): jobs (row block a, matrix, 64-column half),
     * 2 per warp; the fragments go to bf16 tiles in the space of A (w) and G (u), both
     * free now, and from there to global memory with 16-byte stores (4-byte stores
     * straight from the fragments half-filled their sectors) */
    bf16 (*wt)[RS] = reinterpret_cast<bf16 (*)[RS]>(&s.A[0][0]);
    bf16 (*ut)[RS] = reinterpret_cast<bf16 (*)[RS]>(&s.G[0][0]);
    static_assert(sizeof(s.A) >= sizeof(bf16) * BT * RS && sizeof(s.G) >= sizeof(bf16) * BT * RS,
                  "w / u staging tiles");
    for (int jj = 0; jj < 2; jj++) {
        /* row block a takes a + 1 steps: warps pair a with 3 - a (5 steps each) */
        const int a = jj == 0 ? (warp >> 2) : 3 - (warp >> 2);
        const int mat = (warp >> 1) & 1, half = warp & 1;
        const bf16 *B = mat ? &s.k[0][0] : &s.q[0][0];
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        /* all fragments of a step first, then its 16 products */
        for (int ks = 0; ks <= a; ks++) {
            uint32_t fa[4], fl[4], fb[4][4];
            ldsm4(fa, a_addr(&s.u.x.hi[0][0], AS, a * 16, ks * 16, lane));
            ldsm4(fl, a_addr(&s.u.x.lo[0][0], AS, a * 16, ks * 16, lane));
#pragma unroll
            for (int np = 0; np < 4; np++)
                ldsm4t(fb[np], b_kn_addr(B, RS, ks * 16, half * 64 + np * 16, lane));
#pragma unroll
            for (int np = 0; np < 4; np++) {
                mma16816(acc[2 * np], fa, fb[np][0], fb[np][1]);
                mma16816(acc[2 * np + 1], fa, fb[np][2], fb[np][3]);
            }
#pragma unroll
            for (int np = 0; np < 4; np++) {
                mma16816(acc[2 * np], fl, fb[np][0], fb[np][1]);
                mma16816(acc[2 * np + 1], fl, fb[np][2], fb[np][3]);
            }
        }
        bf16 (*dst)[RS] = mat ? ut : wt;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const int col = half * 64 + nt * 8 + 2 * t;
            *reinterpret_cast<uint32_t *>(&dst[a * 16 + g][col]) = pack_bf16(acc[nt][0], acc[nt][1]);
            *reinterpret_cast<uint32_t *>(&dst[a * 16 + g + 8][col]) = pack_bf16(acc[nt][2], acc[nt][3]);
        }
    }
    __syncthreads();
    {
        static_assert(NT1 % 16 == 0 && BT % (NT1 / 16) == 0, "whole rows per pass");
        const int r = tid >> 4, c = (tid & 15) * 8; /* rows r + (NT1 / 16) m */
        bf16 *gw = p.w + (cb * BT + r) * KD + c, *gu = p.u + (cb * BT + r) * KD + c;
#pragma unroll
        for (int m = 0; m < BT / (NT1 / 16); m++) {
            const int rr = r + (NT1 / 16) * m, o = (NT1 / 16) * m * KD;
            *reinterpret_cast<uint4 *>(gw + o) = *reinterpret_cast<const uint4 *>(&wt[rr][c]);
            *reinterpret_cast<uint4 *>(gu + o) = *reinterpret_cast<const uint4 *>(&ut[rr][c]);
        }
    }
    if (p.flags) { /* the CTA's stores (ordered by the barrier), then the flag: a release at
                    * gpu scope is cumulative over what the barrier ordered before it */
        __syncthreads();
        if (tid == 0)
            st_release(p.flags + cb, p.epoch);
    }
}

/* ------------------------------------------------------------------ kernel 2 */
/* One CTA per (V slice of BV columns, sequence * HV), 4 warps. The state slice
 * S [128][BV] lives in fp32 accumulator registers (warp w: rows 32w..32w+31); each
 * chunk's w, qg, kg, Aqk, u slice and exp(G_last) are double-buffered in shared
 * memory with cp.async (the next chunk loads while this one computes). Per chunk:
 * S -> bf16 tile; v' = u - w S and o = qg S (warp w: chunk rows 16w..16w+15);
 * o += Aqk v'; S <- diag(gl) S + kg^T v'. */
/* The stage of the recurrence when the tensor copy engine loads it (TM): w, qg, kg as two
 * 64 x 64 boxes with the 128-byte swizzle, Aqk one such box, the u slice one box of BV
 * columns (BV <= 64; rows of 2 BV bytes, swizzled over that span) or two 64-column boxes,
 * gl by a bulk copy; one mbarrier per stage, one thread issuing. Against cp.async (about 29
 * 16-byte copies per thread and chunk with their address arithmetic, at one warp per
 * scheduler on the recurrence's critical path) the warps only wait on the barrier. */
template <int BV> struct __align__(1024) InterStageT {
    unsigned char w[2 * SWT], qg[2 * SWT], kg[2 * SWT], A[SWT];
    unsigned char u[BT * BV * 2];
    float gl[KD];
};
template <int BV> struct InterSmemT {
    InterStageT<BV> st[REC_STAGES];
    bf16 S[KD][BV + 8];
    bf16 vn[BT][BV + 8];
    uint64_t bar[REC_STAGES], empty[REC_STAGES];
};
template <int BV> constexpr size_t inter_smem_t() { return sizeof(InterSmemT<BV>) + 1024; }
static_assert(inter_smem_t<128>() <= 227 * 1024,
              "the TM recurrence at 128 columns fits an SM's shared memory");
static_assert(inter_smem_t<32>() <= 227 * 1024 && inter_smem_t<64>() <= 227 * 1024 &&
                  inter_smem_t<16>() <= 227 * 1024,
              "the TM recurrence fits an SM's shared memory at every slice width");
struct TcMaps { /* tensor maps of the workspace, [cb * 64 + row][128 (Aqk: 64) columns]: of
                 * kda_inter_tc (TM; u in boxes of its slice width) and kda_inter_wg */
    CUtensorMap w, qg, kg, u, A;
};
/* byte offset of u's (row r, column c) in a TM stage: the box rows are 2 BV bytes,
 * swizzled over that span (32, 64 or 128 bytes: the 16-byte chunk index XOR the row bits
 * above it, as the copy engine writes them into a 1024-byte aligned tile) */
template <int BV> __device__ __forceinline__ int u_off(int r, int c) {
    if (BV == 128)
        return sw128x2(r, c);
    constexpr int S = BV * 2;
    const int off = r * S + c * 2;
    return off ^ (((off >> 7) & (S / 16 - 1)) << 4);
}
template <int BV> struct InterStage {
    bf16 w[BT][RS], qg[BT][RS], kg[BT][RS];
    bf16 A[BT][AS];
    bf16 u[BT][BV + 8];
    float gl[KD];
};
template <int BV> struct InterSmem {
    InterStage<BV> st[REC_STAGES];
    bf16 S[KD][BV + 8];  /* the state in bf16 (B operand of w S and qg S) */
    bf16 vn[BT][BV + 8]; /* v' in bf16 */
};
static_assert(sizeof(InterSmem<128>) <= 227 * 1024, "the 128-column recurrence fits an SM's shared memory");

template <int BV, int NT>
__device__ __forceinline__ void inter_load(const Params &p, InterStage<BV> &st, int64_t cb, int c0,
                                           int tid) {
    const bf16 *w = p.w + cb * BT * KD, *qg = p.qg + cb * BT * KD, *kg = p.kg + cb * BT * KD;
    for (int e = tid; e < BT * (KD / 8); e += NT) {
        const int i = e >> 4, d0 = (e & 15) * 8;
        cp_async16(&st.w[i][d0], w + i * KD + d0);
        cp_async16(&st.qg[i][d0], qg + i * KD + d0);
        cp_async16(&st.kg[i][d0], kg + i * KD + d0);
    }
    const bf16 *A = p.Aqk + cb * BT * BT;
    for (int e = tid; e < BT * (BT / 8); e += NT) {
        const int i = e >> 3, j0 = (e & 7) * 8;
        cp_async16(&st.A[i][j0], A + i * BT + j0);
    }
    const bf16 *u = p.u + cb * BT * KD + c0;
    for (int e = tid; e < BT * (BV / 8); e += NT) {
        const int i = e / (BV / 8), c = (e % (BV / 8)) * 8;
        cp_async16(&st.u[i][c], u + i * KD + c);
    }
    if (tid < KD / 4)
        cp_async16(&st.gl[tid * 4], p.gl + cb * KD + tid * 4);
}

/* WC column groups of 4 warps: warp (wr = warp % 4, wc = warp / 4) takes rows 16 wr
 * (v', o) and 32 wr (state) of the columns wc * BV / WC .. of the slice. WC = 2 puts two
 * warps on each SM sub-partition, whose tensor pipe one warp's dependent mma chain
 * leaves mostly idle (the grid has about one CTA per SM). */
template <int BV>
__device__ __forceinline__ __nv_bfloat162 u_pair(const InterStage<BV> &st, int r, int c) {
    return *reinterpret_cast<const __nv_bfloat162 *>(&st.u[r][c]);
}
template <int BV>
__device__ __forceinline__ __nv_bfloat162 u_pair(const InterStageT<BV> &st, int r, int c) {
    return *reinterpret_cast<const __nv_bfloat162 *>(st.u + u_off<BV>(r, c));
}
/* chunk cb's operands (u: columns c0 .. c0 + BV - 1) into a TM stage or a kda_inter_wg
 * stage (BV = 128), one thread */
template <int BV, typename Stage>
__device__ __forceinline__ void tc_load(const Params &p, const TcMaps &m, Stage &st, uint64_t *bar,
                                        int64_t cb, int c0) {
    mbar_expect(bar, 7 * SWT + BT * BV * 2 + KD * sizeof(float));
    const int r0 = (int)(cb * BT);
    tma_chunk(st.w, st.qg, st.kg, st.A, st.gl, &m.w, &m.qg, &m.kg, &m.A, p.gl + cb * KD, r0, bar);
    if constexpr (BV == 128) {
        tma_g2s(st.u, &m.u, c0, r0, bar);
        tma_g2s(st.u + SWT, &m.u, c0 + 64, r0, bar);
    } else
        tma_g2s(st.u, &m.u, c0, r0, bar);
}

template <int BV, int WC, bool TM>
__global__ void __launch_bounds__(NT2 * WC + (rec_prod<TM, WC>() ? 32 : 0))
    kda_inter_tc(Params p, const __grid_constant__ TcMaps maps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    using Smem = typename std::conditional<TM, InterSmemT<BV>, InterSmem<BV>>::type;
    Smem &s = *reinterpret_cast<Smem *>(
        TM ? smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023) : smem_raw);
    constexpr int NTV = BV / 8 / WC; /* n-tiles of this warp */
    constexpr int NT = NT2 * WC;     /* consumer threads (PROD: a producer warp after them) */
    constexpr bool PROD = rec_prod<TM, WC>();
    const int c0 = blockIdx.x * BV;
    const int n = blockIdx.y / p.HV, hv = blockIdx.y % p.HV;
    const int K = p.K, V = p.V, HV = p.HV;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wc = tid >> 7;
    const int g = lane >> 2, t = lane & 3;
    const int cw = wc * (BV / WC); /* this warp's first column in the slice */
    constexpr bool STAGED = rec_staged_stores(BV); /* the saved h and v' tiles */

    const int2 sq = p.seqs[n];
    constexpr int NS = REC_STAGES;
    if constexpr (TM) {
        mbar_init_stages<NS>(s.bar, tid, PROD ? s.empty : nullptr, NT / 32);
        if (PROD && tid >= NT) { /* the producer warp */
            if (tid == NT)
                rec_producer<NS>(sq.y, s.empty, [&](int k, int j) {
                    tc_load<BV>(p, maps, s.st[k], &s.bar[k], (int64_t)(sq.x + j) * HV + hv, c0);
                });
            return;
        }
        if (!PROD && tid == 0)
            for (int k = 0; k < NS - 1 && k < sq.y; k++)
                tc_load<BV>(p, maps, s.st[k], &s.bar[k], (int64_t)(sq.x + k) * HV + hv, c0);
    }
    float S[2][NTV][4];
    state_regs_load<NTV>(S, p.h0 ? p.h0 + ((int64_t)n * HV + hv) * K * V : nullptr, K, V, c0 + cw,
                         warp, lane);
    if constexpr (!TM) {
        /* one commit group per chunk (empty past the end), so the wait count is constant */
#pragma unroll
        for (int k = 0; k < NS - 1; k++) {
            if (k < sq.y)
                inter_load<BV, NT>(p, s.st[k], (int64_t)(sq.x + k) * HV + hv, c0, tid);
            cp_async_commit();
        }
    }
    const SeqSpan span(p.chunks, sq);
    /* o stores without per-element column checks when the whole slice lies inside V */
    const bool vfull = (V & 1) == 0 && c0 + BV <= V;
    for (int cc = 0; cc < sq.y; cc++) {
        const int ci = sq.x + cc;
        int t0, L;
        span.chunk(cc, t0, L);
        auto &st = s.st[cc % NS];
        if constexpr (TM) { /* the stage last read in step cc - 1 (before its end barrier) */
            if (!PROD && tid == 0 && cc + NS - 1 < sq.y)
                tc_load<BV>(p, maps, s.st[(cc + NS - 1) % NS], &s.bar[(cc + NS - 1) % NS],
                            (int64_t)(ci + NS - 1) * HV + hv, c0);
        } else {
            if (cc + NS - 1 < sq.y)
                inter_load<BV, NT>(p, s.st[(cc + NS - 1) % NS], (int64_t)(ci + NS - 1) * HV + hv,
                                   c0, tid);
            cp_async_commit();
        }
        /* S -> bf16 tile */
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NTV; nt++) {
                const int d = warp * 32 + mt * 16 + g, c = cw + nt * 8 + 2 * t;
                const uint32_t lo = pack_bf16(S[mt][nt][0], S[mt][nt][1]);
                const uint32_t hi = pack_bf16(S[mt][nt][2], S[mt][nt][3]);
                *reinterpret_cast<uint32_t *>(&s.S[d][c]) = lo;
                *reinterpret_cast<uint32_t *>(&s.S[d + 8][c]) = hi;
                if (!STAGED && p.hs) { /* training forward: the state at the chunk start */
                    bf16 *hs = p.hs + ((int64_t)ci * HV + hv) * KD * KD + c0 + c;
                    *reinterpret_cast<uint32_t *>(hs + d * KD) = lo;
                    *reinterpret_cast<uint32_t *>(hs + (d + 8) * KD) = hi;
                }
            }
        if constexpr (TM)
            mbar_wait(&s.bar[cc % NS], (cc / NS) & 1); /* chunk cc has landed */
        else
            cp_async_wait<NS - 1>(); /* chunk cc's group is complete */
        rec_sync<PROD, NT>();
        /* v' = u - w S ; o = qg S  (rows 16 warp ..) */
        /* w S in SPL independent partial sums at 16 columns (two chains of 8 dependent mma
         * otherwise: the step's critical path) */
        constexpr int SPL = NTV == 2 ? 2 : 1;
        float av[SPL][NTV][4], ao[NTV][4];
#pragma unroll
        for (int nt = 0; nt < NTV; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                ao[nt][e] = 0.0f;
#pragma unroll
                for (int sp = 0; sp < SPL; sp++)
                    av[sp][nt][e] = 0.0f;
            }
        {
            uint32_t fw[2][4], fq[2][4], fb[2][NTV / 2][4];
            auto frags = [&](int ks, int b) {
                ldsm4(fw[b], frag_a(st.w, warp * 16, ks * 16, lane));
                ldsm4(fq[b], frag_a(st.qg, warp * 16, ks * 16, lane));
#pragma unroll
                for (int np = 0; np < NTV / 2; np++)
                    ldsm4t(fb[b][np], b_kn_addr(&s.S[0][0], BV + 8, ks * 16, cw + np * 16, lane));
            };
            frag_pipe<KD / 16>(frags, [&](int ks, int b) {
#pragma unroll
                for (int np = 0; np < NTV / 2; np++) {
                    mma16816(av[ks % SPL][2 * np], fw[b], fb[b][np][0], fb[b][np][1]);
                    mma16816(av[ks % SPL][2 * np + 1], fw[b], fb[b][np][2], fb[b][np][3]);
                    mma16816(ao[2 * np], fq[b], fb[b][np][0], fb[b][np][1]);
                    mma16816(ao[2 * np + 1], fq[b], fb[b][np][2], fb[b][np][3]);
                }
            });
        }
#pragma unroll
        for (int nt = 0; nt < NTV; nt++) {
            const int r = warp * 16 + g, c = cw + nt * 8 + 2 * t;
            const __nv_bfloat162 u0 = u_pair<BV>(st, r, c);
            const __nv_bfloat162 u1 = u_pair<BV>(st, r + 8, c);
#pragma unroll
            for (int sp = 1; sp < SPL; sp++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    av[0][nt][e] += av[sp][nt][e];
            const float v0 = __low2float(u0) - av[0][nt][0], v1 = __high2float(u0) - av[0][nt][1];
            const float v2 = __low2float(u1) - av[0][nt][2], v3 = __high2float(u1) - av[0][nt][3];
            *reinterpret_cast<uint32_t *>(&s.vn[r][c]) = pack_bf16(v0, v1);
            *reinterpret_cast<uint32_t *>(&s.vn[r + 8][c]) = pack_bf16(v2, v3);
            if (!STAGED && p.vns) {
                bf16 *vns = p.vns + ((int64_t)ci * HV + hv) * BT * KD + c0 + c;
                *reinterpret_cast<uint32_t *>(vns + r * KD) = pack_bf16(v0, v1);
                *reinterpret_cast<uint32_t *>(vns + (r + 8) * KD) = pack_bf16(v2, v3);
            }
        }
        rec_sync<PROD, NT>();
        /* S <- diag(gl) S + kg^T v' (warp w: state rows 32w..32w+31) and o += Aqk v' (causal:
         * column blocks <= warp) in one pass over the chunk's 16-row blocks, which shares
         * the v' fragments; o is stored after both products are issued, so that its chain
         * overlaps the state's instead of preceding it */
        state_decay<NTV>(S, st.gl, warp, lane);
        {
            uint32_t fa[2][2][4], fb[2][NTV / 2][4], fA[2][4];
            auto frags = [&](int ks, int b) {
                ldsm4t(fa[b][0], frag_at(st.kg, warp * 32, ks * 16, lane));
                ldsm4t(fa[b][1], frag_at(st.kg, warp * 32 + 16, ks * 16, lane));
#pragma unroll
                for (int np = 0; np < NTV / 2; np++)
                    ldsm4t(fb[b][np], b_kn_addr(&s.vn[0][0], BV + 8, ks * 16, cw + np * 16, lane));
                if (ks <= warp)
                    ldsm4(fA[b], frag_a(st.A, warp * 16, ks * 16, lane));
            };
            frag_pipe<BT / 16>(frags, [&](int ks, int b) {
#pragma unroll
                for (int np = 0; np < NTV / 2; np++) {
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        mma16816(S[mt][2 * np], fa[b][mt], fb[b][np][0], fb[b][np][1]);
                        mma16816(S[mt][2 * np + 1], fa[b][mt], fb[b][np][2], fb[b][np][3]);
                    }
                    if (ks <= warp) {
                        mma16816(ao[2 * np], fA[b], fb[b][np][0], fb[b][np][1]);
                        mma16816(ao[2 * np + 1], fA[b], fb[b][np][2], fb[b][np][3]);
                    }
                }
            });
        }
        if (vfull) {
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int r = warp * 16 + g + hh * 8;
                if (r < L) {
                    bf16 *dst = p.o + ((int64_t)(t0 + r) * HV + hv) * V + c0 + cw + 2 * t;
#pragma unroll
                    for (int nt = 0; nt < NTV; nt++)
                        *reinterpret_cast<uint32_t *>(dst + nt * 8) =
                            pack_bf16(ao[nt][2 * hh], ao[nt][2 * hh + 1]);
                }
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NTV; nt++) {
                const int c = c0 + cw + nt * 8 + 2 * t;
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int r = warp * 16 + g + hh * 8;
                    if (r < L) {
                        bf16 *dst = p.o + ((int64_t)(t0 + r) * HV + hv) * V + c;
                        if (c + 1 < V && (V & 1) == 0)
                            *reinterpret_cast<uint32_t *>(dst) =
                                pack_bf16(ao[nt][2 * hh], ao[nt][2 * hh + 1]);
                        else {
                            if (c < V)
                                dst[0] = __float2bfloat16(ao[nt][2 * hh]);
                            if (c + 1 < V)
                                dst[1] = __float2bfloat16(ao[nt][2 * hh + 1]);
                        }
                    }
                }
            }
        }
        /* training forward: the saved tiles, after this step's products (s.S and s.vn are
         * rewritten only after the barrier below; stored earlier in the step, while the
         * products run, they were measured 0.015 ms slower at (1, 8192, 64, 128)) */
        if (STAGED && p.hs) /* the state at the chunk start */
            store_slice<BV, NT>(p.hs + ((int64_t)ci * HV + hv) * KD * KD + c0, s.S, KD, tid);
        if (STAGED && p.vns) /* v' */
            store_slice<BV, NT>(p.vns + ((int64_t)ci * HV + hv) * BT * KD + c0, s.vn, BT, tid);
        /* The next step rewrites s.S before its first barrier and s.vn after it: every read
         * of s.S precedes this step's second barrier, so only the staged stores (which read
         * both tiles here) need a barrier before that; with the copy engine's loads each
         * warp then releases the stage (the cp.async loads of the next step are issued by
         * every thread, so they wait for all). */
        if (STAGED || !PROD)
            rec_sync<PROD, NT>();
        if constexpr (PROD)
            rec_release(s.empty, cc % NS, lane);
    }
    if (p.ht)
        state_regs_store<NTV>(S, p.ht + ((int64_t)n * HV + hv) * K * V, K, V, c0 + cw, warp, lane);
}

/* ------------------------------------------------------------------ kernel 2, wgmma */
/* The inference recurrence over all 128 columns on wgmma (sm_90a), for grids of about a
 * sequence-head per SM: one CTA per sequence-head, two warpgroups, the fp32 state S
 * [128][128] in accumulator registers (warpgroup wg: state rows 64 wg ..). Per chunk:
 *   wg 0: v' = u - w S          wg 1: o = qg S          (S^T tile from shared memory)
 *   wg 1: o += Aqk v'           both: S <- diag(gl) S + kg^T v' (their 64 state rows)
 * The chunk's w, qg, kg, u (two 64-column boxes each) and Aqk arrive by the tensor copy
 * engine with the 128-byte swizzle, gl by a bulk copy, on one mbarrier per stage, issued
 * by one thread a chunk ahead. w and qg are wgmma A operands in place; kg^T (ldmatrix
 * .trans) and Aqk (ldmatrix, blocks above the diagonal zeroed in registers) are register
 * A operands. S^T and v'^T are written from the accumulators with stmatrix.trans into
 * K-major core-matrix tiles ("CM", no swizzle, chunk stride padded by 16 bytes). */
#define CM128 2064        /* chunk stride (bytes) of the 128-row CM tiles */
struct __align__(1024) WgStage {
    unsigned char w[2 * SWT], qg[2 * SWT], kg[2 * SWT], u[2 * SWT], A[SWT];
    float gl[KD];
};
struct WgSmem {
    WgStage st[2];
    unsigned char S[16 * CM128]; /* S^T in bf16: rows = the state's columns, K = its rows */
    unsigned char vn[8 * CM128]; /* v'^T in bf16: rows = columns, K = chunk rows */
    uint64_t bar[2];
};
#define WG_SMEM (sizeof(WgSmem) + 1024) /* and room to align the base to 1024 bytes */
static_assert(WG_SMEM <= 227 * 1024, "the wgmma recurrence fits an SM's shared memory");
#define NTW 256 /* threads of kda_inter_wg */

/* chunk cb's operands into a stage (one thread): all 128 columns of u */
__device__ __forceinline__ void wg_load(const Params &p, const TcMaps &m, WgStage &st,
                                        uint64_t *bar, int64_t cb) {
    tc_load<128>(p, m, st, bar, cb, 0);
}

/* the accumulators d (rows 16 w + 8 h .. of the warpgroup's 64, 16 n-tiles) to a CM tile
 * of 128 rows = d's columns, transposed: K-chunk kc0 + 2 w + h */
__device__ __forceinline__ void wg_store_t(unsigned char *tile, const float (&d)[64], int kc0,
                                           int w, int lane) {
    const int i = lane >> 3, k = lane & 7;
#pragma unroll
    for (int jp = 0; jp < 8; jp++) {
        /* matrices (h, j) = (0, 2jp) (1, 2jp) (0, 2jp+1) (1, 2jp+1) */
        const int j = 2 * jp + (i >> 1), h = i & 1;
        unsigned char *row = tile + (kc0 + 2 * w + h) * CM128 + (8 * j + k) * 16;
        stsm4t(row, pack_bf16(d[8 * jp], d[8 * jp + 1]), pack_bf16(d[8 * jp + 2], d[8 * jp + 3]),
               pack_bf16(d[8 * jp + 4], d[8 * jp + 5]), pack_bf16(d[8 * jp + 6], d[8 * jp + 7]));
    }
}

__global__ void __launch_bounds__(NTW, 1)
    kda_inter_wg(Params p, const __grid_constant__ TcMaps maps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    WgSmem &s =
        *reinterpret_cast<WgSmem *>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
    const int n = blockIdx.y / p.HV, hv = blockIdx.y % p.HV;
    const int K = p.K, V = p.V, HV = p.HV;
    const int tid = threadIdx.x, lane = tid & 31, w = (tid >> 5) & 3;
    /* warpgroup index, visibly warp-uniform (ptxas serializes wgmma behind a branch it
     * cannot prove uniform, warning C7520) */
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int g = lane >> 2, t = lane & 3;

    mbar_init_stages<2>(s.bar, tid);
    const int2 sq = p.seqs[n];
    if (p.flags && tid < 32) {
        /* every chunk of this sequence-head written by kda_intra_tc (its CTAs of one
         * sequence-head run close together, so waiting for all of them up front costs
         * little and keeps the acquire loads off the recurrence's path) */
        for (int c = lane; c < sq.y; c += 32)
            while (ld_acquire(p.flags + (int64_t)(sq.x + c) * HV + hv) != p.epoch)
                __nanosleep(256);
        __syncwarp();
        if (lane == 0) /* before the copy engine reads them */
            asm volatile("fence.proxy.async.global;\n" ::: "memory");
    }
    if (tid == 0 && sq.y > 0)
        wg_load(p, maps, s.st[0], &s.bar[0], (int64_t)sq.x * HV + hv);
    float S[64], acc[64];
    {
        const float *h0 = p.h0 ? p.h0 + ((int64_t)n * HV + hv) * K * V : nullptr;
#pragma unroll
        for (int x = 0; x < 64; x++) {
            const int d = 64 * wg + 16 * w + g + ((x >> 1) & 1) * 8,
                      c = 8 * (x >> 2) + 2 * t + (x & 1);
            S[x] = (h0 && d < K && c < V) ? h0[(int64_t)d * V + c] : 0.0f;
            acc[x] = 0.0f;
        }
    }
    const SeqSpan span(p.chunks, sq);
    const bool vfull = V == KD;
    /* Named barriers (256 threads: one warpgroup arrives, the other waits), so that
     * warpgroup 0 never waits for warpgroup 1's o (Aqk v' and the stores):
     *   WB_S1: wg 1's S^T rows written (wg 1 arrives after its state update)
     *   WB_S0: wg 0's S^T rows written
     *   WB_VN: wg 1 done with v'^T (its wgmma read it), before wg 0 rewrites it
     *   barrier 0 (__syncthreads) once per step: v'^T written and both phase-1 products
     *   done (S^T may be rewritten after it) */
    enum { WB_S1 = 1, WB_S0 = 2, WB_VN = 3 };
    if (wg == 1 && sq.y > 0) {
        wg_store_t(s.S, S, 8, w, lane);
        fence_proxy_async();
        bar_arrive_n(WB_S1, NTW);
    }
    for (int cc = 0; cc < sq.y; cc++) {
        const int ci = sq.x + cc;
        int t0, L;
        span.chunk(cc, t0, L);
        WgStage &st = s.st[cc & 1];
        if (wg == 0) {
            wg_store_t(s.S, S, 0, w, lane); /* S^T, K-chunks 0..7: state rows 0..63 */
            fence_proxy_async();
            bar_arrive_n(WB_S0, NTW);
            bar_sync_n(WB_S1, NTW);
            /* the other stage was last read in step cc - 1: by wg 1 before it arrived */
            if (tid == 0 && cc + 1 < sq.y)
                wg_load(p, maps, s.st[(cc + 1) & 1], &s.bar[(cc + 1) & 1],
                        (int64_t)(ci + 1) * HV + hv);
        } else
            bar_sync_n(WB_S0, NTW);
        mbar_wait(&s.bar[cc & 1], (cc >> 1) & 1); /* chunk cc has landed */
        /* wg 0: acc = w S, wg 1: acc = qg S */
        {
            const unsigned char *Aop = wg ? st.qg : st.w;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < KD / 16; ks++)
                wgmma_ss128(acc, wg_desc_sw128(Aop + (ks >> 2) * SWT, ks & 3),
                            wg_desc(s.S + 2 * ks * CM128, CM128, 128), ks > 0);
            wg_commit();
            wg_wait<0>();
            wg_regs(acc);
        }
        if (wg == 0) { /* v' = u - w S, to v'^T once wg 1 is done with the previous one */
            if (cc > 0)
                bar_sync_n(WB_VN, NTW);
#pragma unroll
            for (int x = 0; x < 64; x += 2) {
                const int r = 16 * w + g + ((x >> 1) & 1) * 8, c = 8 * (x >> 2) + 2 * t;
                const __nv_bfloat162 uu =
                    *reinterpret_cast<const __nv_bfloat162 *>(st.u + sw128x2(r, c));
                acc[x] = __low2float(uu) - acc[x];
                acc[x + 1] = __high2float(uu) - acc[x + 1];
            }
            wg_store_t(s.vn, acc, 0, w, lane);
            fence_proxy_async();
        }
        __syncthreads();
        /* both: S <- diag(gl) S + kg^T v' (group 1); wg 1: o += Aqk v' (group 2) */
        {
            const int d = 64 * wg + 16 * w + g;
            const float e0 = st.gl[d], e1 = st.gl[d + 8];
#pragma unroll
            for (int x = 0; x < 64; x++)
                S[x] *= (x & 2) ? e1 : e0;
            uint32_t fk[BT / 16][4], fa[BT / 16][4];
#pragma unroll
            for (int ks = 0; ks < BT / 16; ks++) {
                /* kg^T rows 64 wg + 16 w .., tokens 16 ks .. (at_addr's lane map) */
                const int tok = 16 * ks + (lane & 7) + ((lane >> 4) & 1) * 8;
                ldsm4t(fk[ks], st.kg + sw128x2(tok, 64 * wg + 16 * w + ((lane >> 3) & 1) * 8));
                /* Aqk rows 16 w .., columns 16 ks .. (a_addr's lane map); zero above the
                 * diagonal blocks (never written there) */
                fa[ks][0] = fa[ks][1] = fa[ks][2] = fa[ks][3] = 0u;
                if (wg == 1 && ks <= w)
                    ldsm4(fa[ks], st.A + sw128(16 * w + (lane & 15), 16 * ks + (lane >> 4) * 8));
            }
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < BT / 16; ks++)
                wgmma_rs128(S, fk[ks], wg_desc(s.vn + 2 * ks * CM128, CM128, 128), 1);
            wg_commit();
            if (wg == 1) {
#pragma unroll
                for (int ks = 0; ks < BT / 16; ks++)
                    wgmma_rs128(acc, fa[ks], wg_desc(s.vn + 2 * ks * CM128, CM128, 128), 1);
                wg_commit();
                wg_wait<1>(); /* the state update */
                wg_regs(S);
                if (cc + 1 < sq.y) { /* S^T rows 64..127 of the next step */
                    wg_store_t(s.S, S, 8, w, lane);
                    fence_proxy_async();
                    bar_arrive_n(WB_S1, NTW);
                }
                wg_wait<0>();
                wg_regs(acc);
                bar_arrive_n(WB_VN, NTW);
            } else {
                wg_wait<0>();
                wg_regs(S);
            }
        }
        if (wg == 1) { /* o rows < L */
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int r = 16 * w + g + hh * 8;
                if (r < L) {
                    bf16 *dst = p.o + ((int64_t)(t0 + r) * HV + hv) * V;
#pragma unroll
                    for (int j = 0; j < 16; j++) {
                        const int c = 8 * j + 2 * t;
                        const float a0 = acc[4 * j + 2 * hh], a1 = acc[4 * j + 2 * hh + 1];
                        if (vfull)
                            *reinterpret_cast<uint32_t *>(dst + c) = pack_bf16(a0, a1);
                        else {
                            if (c < V)
                                dst[c] = __float2bfloat16(a0);
                            if (c + 1 < V)
                                dst[c + 1] = __float2bfloat16(a1);
                        }
                    }
                }
            }
        }
    }
    if (wg == 0 && sq.y > 0) /* wg 1's last arrival */
        bar_sync_n(WB_VN, NTW);
    if (p.ht) {
        float *ht = p.ht + ((int64_t)n * HV + hv) * K * V;
#pragma unroll
        for (int x = 0; x < 64; x++) {
            const int d = 64 * wg + 16 * w + g + ((x >> 1) & 1) * 8,
                      c = 8 * (x >> 2) + 2 * t + (x & 1);
            if (d < K && c < V)
                ht[(int64_t)d * V + c] = S[x];
        }
    }
}

/* ------------------------------------------------------------------ host side */

/* the chunk-table upload cache: a few (device address, entries) pairs */
struct TableCache {
    int2 *dst = nullptr;
    int2 *host = nullptr;
    size_t n = 0;
};

/* The forward's per-context state (slot LM_SLOT_KDA_FWD; created on first use, deleted by
 * lm_cuda_ctx_free after its stream is synchronised, with its device current). Also holds
 * what the training forward and backward (kda_train.cu) share with it: the chunk-table
 * cache and the driver's tensor-map encoder. */
struct FwdState {
    void *ws = nullptr; /* the inference workspace, grow-only */
    size_t ws_cap = 0;
    TableCache tabs[4];
    int tab_next = 0;
    /* kda_inter_wg's flags: their place and extent when last zeroed, the last epoch */
    const void *flags_at = nullptr;
    size_t flags_n = 0;
    unsigned epoch = 0;
    /* kda_inter_wg's tensor maps and the workspace they were encoded for */
    TcMaps wg_maps;
    const void *wg_at = nullptr;
    uint64_t wg_rows = 0;
    /* kda_inter_tc's (TM) tensor maps and their key */
    TcMaps tc_maps;
    MapKey tc_at = {};
    EncodeTiledFn enc = nullptr;
    bool enc_tried = false;
    cudaEvent_t ev[3] = {}; /* kda.profile */
    bool ev_made = false;
    void forget_tables() {
        for (TableCache &t : tabs) {
            free(t.host);
            t = TableCache();
        }
    }
    ~FwdState() {
        forget_tables();
        if (ws)
            cudaFree(ws);
        if (ev_made)
            for (cudaEvent_t e : ev)
                cudaEventDestroy(e);
    }
};

FwdState *fwd_state(lm_cuda_ctx *ctx) { return lm_cuda_ctx_get<FwdState>(ctx, LM_SLOT_KDA_FWD); }

} // namespace

EncodeTiledFn kda_cuda_encoder(lm_cuda_ctx *ctx) {
    FwdState *st = fwd_state(ctx);
    if (!st->enc_tried) {
        st->enc_tried = true;
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            st->enc = (EncodeTiledFn)f;
        else
            cudaGetLastError();
    }
    return st->enc;
}

/* u's [rows][128] with boxes of min(BV, 64) columns x 64 rows, swizzled over the box row
 * (32, 64 or 128 bytes; u_off) */
static bool tc_umap(EncodeTiledFn fn, CUtensorMap *m, const void *base, uint64_t rows, int BV) {
    if (!fn)
        return false;
    const cuuint64_t dim[2] = {KD, rows}, stride[1] = {KD * sizeof(bf16)};
    const cuuint32_t box[2] = {(cuuint32_t)(BV < 64 ? BV : 64), 64}, es[2] = {1, 1};
    const CUtensorMapSwizzle sw = BV == 16   ? CU_TENSOR_MAP_SWIZZLE_32B
                                  : BV == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                             : CU_TENSOR_MAP_SWIZZLE_128B;
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dim, stride, box,
              es, CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
/* the tensor maps of kda_inter_tc (TM) for the workspace at p, encoded again only when its
 * place, extent or the slice width changes; false when the driver gives none */
static bool tc_maps(lm_cuda_ctx *ctx, const Params &p, uint64_t rows, int BV, TcMaps &out) {
    FwdState *st = fwd_state(ctx);
    const EncodeTiledFn fn = kda_cuda_encoder(ctx);
    TcMaps &maps = st->tc_maps;
    return cached_maps(
        maps, st->tc_at, MapKey{{p.w, p.qg, p.kg, p.Aqk, p.u}, rows, BV},
        [&] {
            return rec_maps(fn, &maps.w, &maps.qg, &maps.kg, &maps.A, p.w, p.qg, p.kg, p.Aqk,
                            rows) &&
                   tc_umap(fn, &maps.u, p.u, rows, BV);
        },
        out);
}
/* kda_inter_tc<BV, WC, TM> on ctx's stream with its shared memory (the opt-in on the
 * context's first use of the kernel) */
template <int BV, int WC, bool TM>
static cudaError_t launch_inter_tc(lm_cuda_ctx *ctx, dim3 grid, const Params &p, const TcMaps &m) {
    return kda_cuda_launch_smem(ctx, kda_inter_tc<BV, WC, TM>, grid,
                                NT2 * WC + (rec_prod<TM, WC>() ? 32 : 0),
                                TM ? inter_smem_t<BV>() : sizeof(InterSmem<BV>), p, m);
}
template <int BV, int WC>
static cudaError_t launch_inter(lm_cuda_ctx *ctx, dim3 grid, const Params &p, bool tm,
                                const TcMaps &m) {
    return tm ? launch_inter_tc<BV, WC, true>(ctx, grid, p, m)
              : launch_inter_tc<BV, WC, false>(ctx, grid, p, m);
}

int kda_cuda_bv(const lm_cuda_ctx *ctx, int nsh) {
    /* the context's kda.bv (16, 32, 64 or 128; lm_cuda_ctx_set_option checks it) overrides
     * the choice (measurements, docs/perf-notes.md) */
    const int forced = ctx->kda_bv;
    if (forced == 16 || forced == 32 || forced == 64 || forced == 128)
        return forced;
    /* the widest slice that still gives about a CTA per SM: at 128 sequence-heads one
     * 128-column CTA each beats two 64-column waves (w / qg / kg loaded once) */
    return nsh >= 120 ? 128 : (nsh * 2 >= 120 ? 64 : (nsh * 4 >= 120 ? 32 : 16));
}

extern "C" int lm_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" lm_status lm_cuda_alloc(void **ptr, size_t bytes, lm_error *err) {
    if (!ptr)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: lm_cuda_alloc: NULL output pointer");
    *ptr = nullptr;
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *ptr = nullptr;
        cudaGetLastError();
        return lm_errorf(err, LM_ERR_NOMEM, "cuda: cudaMalloc(%zu bytes): %s", bytes,
                         cudaGetErrorString(e));
    }
    return LM_OK;
}

extern "C" void lm_cuda_free(void *ptr) {
    if (ptr)
        cudaFree(ptr);
}

extern "C" lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes, lm_error *err) {
    LM_CK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return LM_OK;
}

extern "C" lm_status lm_cuda_download(void *dst, const void *src, size_t bytes, lm_error *err) {
    LM_CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return LM_OK;
}

void kda_cuda_buffers_changed(lm_cuda_ctx *ctx) { fwd_state(ctx)->forget_tables(); }

lm_status kda_cuda_upload_tables(lm_cuda_ctx *ctx, int2 *dst, const int2 *h, size_t n,
                                 const void *buf, size_t cap, lm_error *err) {
    FwdState *st = fwd_state(ctx);
    /* a call with another layout of the same buffer writes its workspace over the other
     * layouts' tables: only an entry for this very place survives it */
    const char *lo = (const char *)buf, *hi = lo + cap;
    for (TableCache &t : st->tabs)
        if (t.dst && (t.dst != dst || t.n != n) && (const char *)t.dst >= lo &&
            (const char *)t.dst < hi) {
            free(t.host);
            t = TableCache();
        }
    for (const TableCache &t : st->tabs)
        if (t.dst == dst && t.n == n && memcmp(t.host, h, sizeof(int2) * n) == 0)
            return LM_OK;
    /* pinned staging, ordered on the stream before the call's kernels (h may be freed on
     * return) */
    LM_TRY(lm_cuda_ctx_upload(ctx, dst, h, sizeof(int2) * n, err));
    for (TableCache &t : st->tabs) /* forget an older copy for dst */
        if (t.dst == dst) {
            free(t.host);
            t = TableCache();
        }
    TableCache &t = st->tabs[st->tab_next];
    st->tab_next = (st->tab_next + 1) % 4;
    free(t.host);
    t = TableCache();
    t.host = (int2 *)malloc(sizeof(int2) * n);
    if (t.host) { /* without it the next call copies again */
        memcpy(t.host, h, sizeof(int2) * n);
        t.dst = dst;
        t.n = n;
    }
    return LM_OK;
}

extern "C" void lm_kda_cuda_release(lm_cuda_ctx *ctx) {
    if (!ctx || lm_cuda_ctx_enter(ctx, nullptr) != LM_OK)
        return;
    cudaStreamSynchronize(ctx->stream); /* queued kernels may still use the buffers */
    FwdState *st = (FwdState *)lm_cuda_ctx_state(ctx, LM_SLOT_KDA_FWD);
    if (st) {
        st->forget_tables();
        if (st->ws)
            cudaFree(st->ws);
        st->ws = nullptr;
        st->ws_cap = 0;
        st->flags_at = nullptr;
        st->flags_n = 0;
        st->wg_at = nullptr;
        st->wg_rows = 0;
        st->tc_at = MapKey{};
    }
    kda_cuda_train_release(ctx);
    cudaGetLastError();
}

lm_status kda_cuda_check(lm_kda_config *c, const lm_kda_cuda_inputs *in, const void *o,
                         lm_error *err) {
    if (!c || !in || !in->q || !in->k || !in->v || !in->g || !in->beta || !o)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda: q, k, v, g, beta and o are required");
    if (c->B < 1 || c->T < 1 || c->H < 1 || c->HV < 1 || c->K < 1 || c->V < 1 || c->HV % c->H)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda: bad dims B=%d T=%d H=%d HV=%d K=%d V=%d (HV must be a "
                         "multiple of H)",
                         c->B, c->T, c->H, c->HV, c->K, c->V);
    if (c->K > KD || c->V > KD)
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: K = %d, V = %d (at most %d each)",
                         c->K, c->V, KD);
    if (c->gate == LM_GATE_BOUNDED && !(c->has_lower_bound && c->lower_bound >= -5.0f &&
                                        c->lower_bound < 0.0f))
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda: the bounded gate needs lower_bound in [-5, 0), got %g",
                         c->has_lower_bound ? (double)c->lower_bound : 0.0);
    int N = c->B;
    if (c->cu_seqlens) {
        if (c->B != 1)
            return lm_errorf(err, LM_ERR_INVALID, "kda cuda: cu_seqlens needs B == 1, got B = %d",
                             c->B);
        if (c->n_cu_seqlens < 2 || c->cu_seqlens[0] != 0 ||
            c->cu_seqlens[c->n_cu_seqlens - 1] != c->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "kda cuda: cu_seqlens must start at 0 and end at T = %d", c->T);
        for (int i = 1; i < c->n_cu_seqlens; i++)
            if (c->cu_seqlens[i] < c->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "kda cuda: cu_seqlens[%d] = %lld < cu_seqlens[%d]", i,
                                 (long long)c->cu_seqlens[i], i - 1);
        N = c->n_cu_seqlens - 1;
    }
    c->N = N;
    return LM_OK;
}

int kda_cuda_nchunks(const lm_kda_config *c) {
    int nchunks = 0;
    for (int n = 0; n < c->N; n++) {
        const int64_t a = c->cu_seqlens ? c->cu_seqlens[n] : (int64_t)n * c->T;
        const int64_t b = c->cu_seqlens ? c->cu_seqlens[n + 1] : (int64_t)(n + 1) * c->T;
        nchunks += (int)((b - a + BT - 1) / BT);
    }
    return nchunks;
}

void kda_cuda_chunk_tables(const lm_kda_config *c, int2 *hch, int2 *hsq) {
    int k = 0;
    for (int n = 0; n < c->N; n++) {
        const int64_t a = c->cu_seqlens ? c->cu_seqlens[n] : (int64_t)n * c->T;
        const int64_t b = c->cu_seqlens ? c->cu_seqlens[n + 1] : (int64_t)(n + 1) * c->T;
        hsq[n].x = k;
        for (int64_t t = a; t < b; t += BT) {
            hch[k].x = (int)t;
            hch[k].y = (int)(b - t < BT ? b - t : BT);
            k++;
        }
        hsq[n].y = k - hsq[n].x;
    }
}

extern "C" lm_status lm_kda_cuda_chunk_forward(lm_cuda_ctx *ctx, lm_kda_config *c,
                                               const lm_kda_cuda_inputs *in,
                                               lm_kda_cuda_outputs *out, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda: outputs are required");
    LM_TRY(kda_cuda_check(c, in, out->o, err));
    return kda_cuda_forward_run(ctx, c, in, out, nullptr, err);
}

/* the inference workspace of at least `bytes` (grown after a stream synchronisation: the
 * queued kernels may still use the old one; counted as a context allocation) */
static lm_status fwd_ws_reserve(lm_cuda_ctx *ctx, FwdState *st, size_t bytes, bool &fresh,
                                lm_error *err) {
    fresh = false;
    if (bytes <= st->ws_cap)
        return LM_OK;
    fresh = true; /* a new allocation: whatever its memory held is not a flag */
    LM_CK(cudaStreamSynchronize(ctx->stream));
    kda_cuda_buffers_changed(ctx);
    if (st->ws)
        cudaFree(st->ws);
    st->ws = nullptr;
    st->ws_cap = 0;
    const cudaError_t e = cudaMalloc(&st->ws, bytes);
    if (e != cudaSuccess) {
        st->ws = nullptr;
        cudaGetLastError();
        return lm_errorf(err, LM_ERR_NOMEM,
                         "kda cuda: cudaMalloc(workspace, %zu bytes) on cuda:%d: %s", bytes,
                         ctx->device, cudaGetErrorString(e));
    }
    ctx->n_alloc++;
    st->ws_cap = bytes;
    return lm_cuda_ctx_poison(ctx, LM_POISON_KDA, st->ws, bytes, err);
}

lm_status kda_cuda_forward_run(lm_cuda_ctx *ctx, lm_kda_config *c, const lm_kda_cuda_inputs *in,
                               lm_kda_cuda_outputs *out, const KdaSaveBufs *sv, lm_error *err) {
    FwdState *fs = fwd_state(ctx);
    const int N = c->N;
    const int K = c->K, V = c->V, HV = c->HV;
    Params p;
    memset(&p, 0, sizeof p);
    int nchunks;
    if (sv) {
        nchunks = sv->nchunks;
        p.w = sv->w;
        p.qg = sv->qg;
        p.kg = sv->kg;
        p.u = sv->u;
        p.Aqk = sv->Aqk;
        p.gl = sv->gl;
        p.chunks = sv->chunks;
        p.seqs = sv->seqs;
        p.Xs = sv->Xs;
        p.Ps = sv->Ps;
        p.Kgs = sv->Kg;
        p.nqs = sv->nqs;
        p.nks = sv->nks;
        p.bs = sv->bs;
        p.hs = sv->hs;
        p.vns = sv->vns;
    } else {
        nchunks = kda_cuda_nchunks(c);
        const size_t nblk = (size_t)nchunks * HV; /* (chunk, value head) blocks */
        const size_t nW = nblk * BT * KD, nA = nblk * BT * BT, nG = nblk * KD;
        const size_t bytes = sizeof(bf16) * (4 * nW + nA) + sizeof(float) * nG +
                             sizeof(int2) * (nchunks + N) + sizeof(unsigned) * nblk + 256;
        bool fresh = false;
        LM_TRY(fwd_ws_reserve(ctx, fs, bytes, fresh, err));
        int2 *hch = (int2 *)malloc(sizeof(int2) * (size_t)(nchunks + N));
        if (!hch)
            return lm_errorf(err, LM_ERR_NOMEM, "kda cuda: chunk table");
        kda_cuda_chunk_tables(c, hch, hch + nchunks);
        bf16 *f = (bf16 *)fs->ws;
        p.w = f;
        p.qg = f + nW;
        p.kg = f + 2 * nW;
        p.u = f + 3 * nW;
        p.Aqk = f + 4 * nW;
        p.gl = (float *)(p.Aqk + nA);
        int2 *dch = (int2 *)(p.gl + nG);
        /* kda_inter_wg's flags: zeroed whenever their place or extent changes, then each
         * call writes its own epoch (never 0). Tracked on every inference call, whichever
         * recurrence it takes: a call with another layout writes its workspace over the
         * flags' old place, and moving flags_at to its own place makes the next call with
         * the old layout zero them again. */
        unsigned *flags = (unsigned *)(dch + nchunks + N);
        if (fresh || flags != fs->flags_at || nblk > fs->flags_n) {
            const cudaError_t e = cudaMemsetAsync(flags, 0, sizeof(unsigned) * nblk, ctx->stream);
            if (e != cudaSuccess) {
                free(hch);
                return lm_cuda_fail(err, e, "cudaMemsetAsync(flags)");
            }
            fs->flags_at = flags;
            fs->flags_n = nblk;
        }
        if (++fs->epoch == 0)
            fs->epoch = 1;
        p.flags = flags;
        p.epoch = fs->epoch;
        const lm_status st =
            kda_cuda_upload_tables(ctx, dch, hch, (size_t)(nchunks + N), fs->ws, fs->ws_cap, err);
        free(hch);
        if (st != LM_OK)
            return st;
        p.chunks = dch;
        p.seqs = dch + nchunks;
    }
    p.nchunks = nchunks;
    p.N = N;
    p.q = (const __nv_bfloat16 *)in->q;
    p.k = (const __nv_bfloat16 *)in->k;
    p.v = (const __nv_bfloat16 *)in->v;
    p.g = (const __nv_bfloat16 *)in->g;
    p.beta = (const __nv_bfloat16 *)in->beta;
    p.A_log = in->A_log;
    p.dt_bias = in->dt_bias;
    p.h0 = in->initial_state;
    p.o = (__nv_bfloat16 *)out->o;
    p.ht = out->final_state;
    p.T = c->T;
    p.H = c->H;
    p.HV = HV;
    p.K = K;
    p.V = V;
    p.gdn = c->kind == LM_GDN;
    p.gate = (int)c->gate;
    p.l2 = c->use_qk_l2norm_in_kernel;
    p.sig = c->use_beta_sigmoid_in_kernel;
    p.lb = c->lower_bound;
    p.scale = c->scale;

    p.shared_diag = c->gate == LM_GATE_BOUNDED && c->diag != LM_DIAG_SAFE;
    /* V slice of the recurrence: the widest that still gives about a CTA per SM */
    const int nsh = N * HV;
    int BVsel = kda_cuda_bv(ctx, nsh);
    if (BVsel == 128 && !sv && V <= 64) /* inference: no idle half of a 128-column slice */
        BVsel = 64;
    /* kda.wgmma = 0: kda_inter_tc<128, 2> instead */
    bool wgrec = BVsel == 128 && !sv && ctx->kda_wgmma && nchunks > 0;
    /* the tensor maps, encoded again only when the workspace or its extent changes */
    TcMaps &maps = fs->wg_maps;
    if (wgrec) {
        const uint64_t rows = (uint64_t)nchunks * HV * BT;
        if (fs->wg_at != p.w || fs->wg_rows != rows) {
            fs->wg_at = nullptr;
            const EncodeTiledFn fn = kda_cuda_encoder(ctx);
            if (!(wg_map(fn, &maps.w, p.w, rows, KD) && wg_map(fn, &maps.qg, p.qg, rows, KD) &&
                  wg_map(fn, &maps.kg, p.kg, rows, KD) && wg_map(fn, &maps.u, p.u, rows, KD) &&
                  wg_map(fn, &maps.A, p.Aqk, rows, BT)))
                wgrec = false;
            else {
                fs->wg_at = p.w;
                fs->wg_rows = rows;
            }
        }
    }
    if (!wgrec)
        p.flags = nullptr;
    const size_t sm1 = sizeof(IntraSmem);
    /* kda_inter_tc's loads by the tensor copy engine (kda.tma = 0: cp.async) */
    TcMaps tmaps;
    memset(&tmaps, 0, sizeof tmaps);
    const bool tm = !wgrec && ctx->kda_tma && nchunks > 0 &&
                    tc_maps(ctx, p, (uint64_t)nchunks * HV * BT, BVsel, tmaps);
    /* the shared-memory opt-ins on the context's first use (a driver call each; they add up
     * in a training loop) */
    if (lm_cuda_ctx_first_use(ctx, (const void *)kda_intra_tc))
        LM_CK(cudaFuncSetAttribute(kda_intra_tc, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sm1));
    if (lm_cuda_ctx_first_use(ctx, (const void *)kda_inter_wg))
        LM_CK(cudaFuncSetAttribute(kda_inter_wg, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)WG_SMEM));
    /* kda.profile = 1: per-kernel times on stderr (docs/perf-notes.md); the events are the
     * context's, made once */
    const bool prof = ctx->kda_profile != 0;
    if (prof && !fs->ev_made) {
        for (int i = 0; i < 3; i++)
            LM_CK(cudaEventCreate(&fs->ev[i]));
        fs->ev_made = true;
    }
    cudaStream_t s = ctx->stream;
    if (prof)
        LM_CK(cudaEventRecord(fs->ev[0], s));
    if (nchunks > 0) {
        kda_intra_tc<<<dim3(nchunks, HV), NT1, sm1, s>>>(p);
        LM_CK_LAUNCH("kda_intra_tc");
    }
    if (prof)
        LM_CK(cudaEventRecord(fs->ev[1], s));
    /* the training forward covers all 128 columns (the saved h and v' tiles are read
     * whole by the backward; columns >= V come out zero) */
    const dim3 g2(sv ? KD / BVsel : (V + BVsel - 1) / BVsel, N * HV);
    if (wgrec) {
        /* programmatically dependent on the intra grid (kda.pdl = 0: a plain launch): its
         * CTAs take SMs as the intra grid's last wave drains and start on the
         * sequence-heads whose chunks are flagged */
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        cfg.gridDim = g2;
        cfg.blockDim = dim3(NTW);
        cfg.dynamicSmemBytes = WG_SMEM;
        cfg.stream = s;
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = ctx->kda_pdl && !prof ? 1 : 0;
        cudaError_t e = cudaLaunchKernelEx(&cfg, kda_inter_wg, p, maps);
        if (e != cudaSuccess && cfg.numAttrs) { /* a driver without it: a plain launch */
            cudaGetLastError();
            cfg.numAttrs = 0;
            e = cudaLaunchKernelEx(&cfg, kda_inter_wg, p, maps);
        }
        LM_CK(e);
    } else if (BVsel == 128) /* 8 warps of 16 x 64: 0.292 -> 0.284 ms against 16 of 16 x 32 */
        LM_CK((launch_inter<128, 2>(ctx, g2, p, tm, tmaps)));
    else if (BVsel == 64)
        LM_CK((launch_inter<64, 2>(ctx, g2, p, tm, tmaps)));
    else if (BVsel == 32)
        LM_CK((launch_inter<32, 2>(ctx, g2, p, tm, tmaps)));
    else
        LM_CK((launch_inter<16, 1>(ctx, g2, p, tm, tmaps)));
    /* asynchronous on ctx's stream (include/linmoe/kda_cuda.h); the profile waits for its
     * last event (a host synchronisation, only with kda.profile) */
    if (prof) {
        LM_CK(cudaEventRecord(fs->ev[2], s));
        LM_CK(cudaEventSynchronize(fs->ev[2]));
        float t1 = 0, t2 = 0;
        LM_CK(cudaEventElapsedTime(&t1, fs->ev[0], fs->ev[1]));
        LM_CK(cudaEventElapsedTime(&t2, fs->ev[1], fs->ev[2]));
        fprintf(stderr, "kda cuda: intra %.3f ms (%d CTAs), inter %.3f ms (%d CTAs)\n", t1,
                nchunks * HV, t2, (int)(g2.x * g2.y));
    }
    return LM_OK;
}

extern "C" int lm_kda_cuda_forward_flat(lm_cuda_ctx *ctx, int B, int T, int H, int HV, int K, int V,
                                        const int64_t *cu_seqlens, int n_cu_seqlens, int kind,
                                        int gate, float lower_bound, float scale,
                                        int use_qk_l2norm_in_kernel, int use_beta_sigmoid_in_kernel,
                                        const void *q, const void *k, const void *v, const void *g,
                                        const void *beta, const float *A_log, const float *dt_bias,
                                        const float *h0, void *o, float *ht, char *errbuf,
                                        int errlen) {
    lm_kda_config c; /* filled here, not by lm_kda_config_default: the FFI library is
                        built from src/ops/cuda/ and src/core/errors.c alone */
    memset(&c, 0, sizeof c);
    c.B = B;
    c.T = T;
    c.H = H;
    c.HV = HV;
    c.K = K;
    c.V = V;
    c.chunk_size = 64;
    c.scale = K > 0 ? 1.0f / sqrtf((float)K) : 1.0f;
    c.kind = (lm_kda_kind)kind;
    c.gate = (lm_gate_mode)gate;
    c.has_lower_bound = lower_bound != 0.0f;
    c.lower_bound = lower_bound;
    if (scale > 0)
        c.scale = scale;
    c.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel;
    c.use_beta_sigmoid_in_kernel = use_beta_sigmoid_in_kernel;
    c.cu_seqlens = cu_seqlens;
    c.n_cu_seqlens = n_cu_seqlens;
    lm_kda_cuda_inputs in = {q, k, v, g, beta, A_log, dt_bias, h0};
    lm_kda_cuda_outputs out = {o, ht};
    lm_error err;
    memset(&err, 0, sizeof err);
    lm_status st = lm_kda_cuda_chunk_forward(ctx, &c, &in, &out, &err);
    if (st != LM_OK && errbuf && errlen > 0)
        snprintf(errbuf, (size_t)errlen, "%s", err.msg);
    return (int)st;
}
