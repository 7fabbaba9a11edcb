/* AttnRes aggregation on the GPU, forward and backward (include/linmoe/cuda_attnres.h has
 * the contract; math: reference/attnres_ctx.md §4.2-4.3, docs/attnres-math.md).
 *
 * Work split. A row (token) belongs to a group of `tpt` threads; thread `tl` of the group
 * owns E = 8 NV elements of every [D] vector of that row: in the vector path the 16-byte
 * chunks tl, tl + tpt, ... (NV of them), in the element path the columns tl + tpt e. tpt is
 * 8 or 16 (small D: several rows per warp, group sums by xor shuffles) or a multiple of 32
 * (one or more whole warps per row). A CTA holds tpc = 256 / tpt groups (at least one)
 * and walks row groups tg = blockIdx.x, + gridDim.x, ...; the grid is the number of CTAs
 * that fit on the device at once (occupancy query, cached per context), so the backward's
 * per-thread du partials stay in registers over all rows of a CTA.
 *
 * Group sums. Up to K = 2 LC (forward) or 3 LC (backward) partial sums per row are
 * reduced at once: with whole warps per row, a reduce-scatter inside each warp (K padded
 * to S = 32 J; five xor-shuffle stages that each halve the values a lane keeps, ~S
 * shuffles instead of 5 K) leaves lane l with the warp sums of entries l J .. l J + J - 1;
 * they go through shared memory (double-buffered by a parity bit, so one barrier per
 * reduction suffices), each warp adds the warps of its row in a fixed order and reads
 * back all K totals, so every thread of the row holds them (bitwise the same in every
 * warp) and computes the softmax redundantly: no second barrier, no broadcast.
 *
 * Numerics: fp32 partials and totals; exp by expf, the key norm by rsqrtf; the online
 * softmax rescales the fp32 accumulator by exp(M_old - M_new) between chunks of sources.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linmoe/cuda_attnres.h"
#include "ops/cuda/ctx.cuh"

namespace {

typedef __nv_bfloat16 bf16;

constexpr int AR_LMAX = LM_CUDA_ATTNRES_MAX_SOURCES;
constexpr int AR_MAX_THREADS = 512; /* threads of one row at most (tpt <= 512) */
constexpr int AR_MAX_WARPS = AR_MAX_THREADS / 32;
constexpr int AR_CTA = 256; /* target CTA size */
constexpr unsigned FULL = 0xffffffffu;

struct SrcTable {
    const bf16 *p[AR_LMAX];
};
struct DstTable {
    void *p[AR_LMAX];
};

struct FwdArgs {
    SrcTable src;
    const float *query, *rms_weight;
    bf16 *o;
    float *weights; /* [L, N] or NULL */
    int64_t N;
    int D, L, tpt, tpc;
    float eps, scale, inv_d;
};

struct BwdArgs {
    SrcTable src;
    DstTable dst;
    const float *query, *rms_weight;
    const bf16 *dout;
    float *partial; /* [gridDim.x * tpc, D] du partials, or NULL (no parameter gradients) */
    int64_t N;
    int D, L, tpt, tpc, accumulate;
    float eps, scale, inv_d;
};

/* ---------------------------------------------------------------- element access */

__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b); /* .x = a: the low half */
    return *reinterpret_cast<const uint32_t *>(&h);
}

/* Column of this thread's element e (0 <= e < 8 NV). */
template <bool VEC> __device__ __forceinline__ int col_of(int tl, int tpt, int e) {
    return VEC ? 8 * (tl + tpt * (e >> 3)) + (e & 7) : tl + tpt * e;
}

/* This thread's elements of one bf16 row as 4 NV packed words (element 2i in the low
 * half of word i); zeros where the column is past D or the row is not live. NC: through
 * the read-only path (inputs); false for a gradient row this kernel also writes. */
template <bool VEC, int NV, bool NC = true>
__device__ __forceinline__ void load_row(const bf16 *row, int tl, int tpt, int D, bool live,
                                         uint32_t (&w)[4 * NV]) {
    if (VEC) {
#pragma unroll
        for (int v = 0; v < NV; v++) {
            const int vi = tl + tpt * v;
            uint4 t = make_uint4(0u, 0u, 0u, 0u);
            if (live && 8 * vi < D)
                t = NC ? __ldg(reinterpret_cast<const uint4 *>(row) + vi)
                       : reinterpret_cast<const uint4 *>(row)[vi];
            w[4 * v] = t.x, w[4 * v + 1] = t.y, w[4 * v + 2] = t.z, w[4 * v + 3] = t.w;
        }
    } else {
        const unsigned short *r = reinterpret_cast<const unsigned short *>(row);
#pragma unroll
        for (int i = 0; i < 4 * NV; i++) {
            const int c0 = tl + tpt * (2 * i), c1 = c0 + tpt;
            const uint32_t a = (live && c0 < D) ? (uint32_t)(NC ? __ldg(r + c0) : r[c0]) : 0u;
            const uint32_t b = (live && c1 < D) ? (uint32_t)(NC ? __ldg(r + c1) : r[c1]) : 0u;
            w[i] = a | (b << 16);
        }
    }
}

template <bool VEC, int NV>
__device__ __forceinline__ void store_bf16_row(bf16 *row, int tl, int tpt, int D,
                                               const float (&f)[8 * NV]) {
    if (VEC) {
#pragma unroll
        for (int v = 0; v < NV; v++) {
            const int vi = tl + tpt * v;
            if (8 * vi < D) {
                uint4 t;
                t.x = pack_bf16(f[8 * v], f[8 * v + 1]);
                t.y = pack_bf16(f[8 * v + 2], f[8 * v + 3]);
                t.z = pack_bf16(f[8 * v + 4], f[8 * v + 5]);
                t.w = pack_bf16(f[8 * v + 6], f[8 * v + 7]);
                reinterpret_cast<uint4 *>(row)[vi] = t;
            }
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8 * NV; e++) {
            const int c = tl + tpt * e;
            if (c < D)
                row[c] = __float2bfloat16_rn(f[e]);
        }
    }
}

/* g += old gradient row (bf16 or fp32), for accumulate = 1. */
template <typename GT, bool VEC, int NV>
__device__ __forceinline__ void add_old_row(const GT *row, int tl, int tpt, int D,
                                            float (&g)[8 * NV]) {
    if constexpr (sizeof(GT) == 2) {
        uint32_t w[4 * NV];
        load_row<VEC, NV, false>(reinterpret_cast<const bf16 *>(row), tl, tpt, D, true, w);
#pragma unroll
        for (int i = 0; i < 4 * NV; i++) {
            g[2 * i] += lo_f(w[i]);
            g[2 * i + 1] += hi_f(w[i]);
        }
    } else if (VEC) {
#pragma unroll
        for (int v = 0; v < NV; v++) {
            const int vi = tl + tpt * v;
            if (8 * vi < D) {
                const float4 a = reinterpret_cast<const float4 *>(row)[2 * vi];
                const float4 b = reinterpret_cast<const float4 *>(row)[2 * vi + 1];
                g[8 * v] += a.x, g[8 * v + 1] += a.y, g[8 * v + 2] += a.z, g[8 * v + 3] += a.w;
                g[8 * v + 4] += b.x, g[8 * v + 5] += b.y, g[8 * v + 6] += b.z;
                g[8 * v + 7] += b.w;
            }
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8 * NV; e++) {
            const int c = tl + tpt * e;
            if (c < D)
                g[e] += row[c];
        }
    }
}

template <typename GT, bool VEC, int NV>
__device__ __forceinline__ void store_grad_row(GT *row, int tl, int tpt, int D,
                                               const float (&g)[8 * NV]) {
    if constexpr (sizeof(GT) == 2) {
        store_bf16_row<VEC, NV>(reinterpret_cast<bf16 *>(row), tl, tpt, D, g);
    } else if (VEC) {
#pragma unroll
        for (int v = 0; v < NV; v++) {
            const int vi = tl + tpt * v;
            if (8 * vi < D) {
                reinterpret_cast<float4 *>(row)[2 * vi] =
                    make_float4(g[8 * v], g[8 * v + 1], g[8 * v + 2], g[8 * v + 3]);
                reinterpret_cast<float4 *>(row)[2 * vi + 1] =
                    make_float4(g[8 * v + 4], g[8 * v + 5], g[8 * v + 6], g[8 * v + 7]);
            }
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8 * NV; e++) {
            const int c = tl + tpt * e;
            if (c < D)
                row[c] = g[e];
        }
    }
}

/* Asks for this thread's chunks of a gradient row in L1 ahead of the read-modify-write of
 * accumulate = 1: those reads come one source after another (a store to dsrc[m] may
 * alias dsrc[m+1] as far as the compiler knows), so without it each would wait for DRAM
 * with only one row in flight per CTA. Vector path only. */
template <typename GT, bool VEC, int NV>
__device__ __forceinline__ void prefetch_grad_row(const void *dst, int64_t off, int tl, int tpt,
                                                  int D) {
    if (!VEC || !dst)
        return;
    const GT *row = reinterpret_cast<const GT *>(dst) + off;
#pragma unroll
    for (int v = 0; v < NV; v++) {
        const int vi = tl + tpt * v;
        if (8 * vi < D) {
            asm volatile("prefetch.global.L1 [%0];" ::"l"(row + 8 * vi));
            if (sizeof(GT) == 4)
                asm volatile("prefetch.global.L1 [%0];" ::"l"(row + 8 * vi + 4));
        }
    }
}

/* u = query (.) rms_weight on this thread's columns (0 past D). */
template <bool VEC, int NV>
__device__ __forceinline__ void load_u(const float *q, const float *g, int tl, int tpt, int D,
                                       float (&u)[8 * NV]) {
#pragma unroll
    for (int e = 0; e < 8 * NV; e++) {
        const int c = col_of<VEC>(tl, tpt, e);
        u[e] = c < D ? __ldg(q + c) * __ldg(g + c) : 0.0f;
    }
}

/* ---------------------------------------------------------------- group sums */

/* One reduce-scatter stage: the lane keeps half of its S live values (the upper half
 * when bit OFF of the lane is set) and adds the partner's copy of that half. */
template <int S, int OFF, int N> __device__ __forceinline__ void rs_step(float (&a)[N], int lane) {
    const bool up = (lane & OFF) != 0;
#pragma unroll
    for (int i = 0; i < S / 2; i++) {
        const float send = up ? a[i] : a[i + S / 2];
        const float keep = up ? a[i + S / 2] : a[i];
        a[i] = keep + __shfl_xor_sync(FULL, send, OFF);
    }
}

/* a[0 .. 32J) per lane -> a[j] = sum over the warp's lanes of a[lane J + j], j < J. */
template <int J> __device__ __forceinline__ void warp_reduce_scatter(float (&a)[32 * J], int lane) {
    rs_step<32 * J, 16>(a, lane);
    rs_step<16 * J, 8>(a, lane);
    rs_step<8 * J, 4>(a, lane);
    rs_step<4 * J, 2>(a, lane);
    rs_step<2 * J, 1>(a, lane);
}

/* Sums t[0 .. K) over the threads of each row's group; on return every thread of the group
 * holds the totals (identical bits in all of them). Every thread of the CTA must call it
 * (it may contain a barrier). red: [2][AR_MAX_WARPS][S], wtot: [AR_MAX_WARPS][S]. */
template <int K>
__device__ __forceinline__ void group_allreduce(float (&t)[32 * ((K + 31) / 32)], int tpt,
                                                float *red, float *wtot, int &parity) {
    constexpr int J = (K + 31) / 32, S = 32 * J;
    if (tpt < 32) { /* 8 or 16 lanes per row: xor shuffles stay inside the group */
        for (int off = tpt >> 1; off > 0; off >>= 1) {
#pragma unroll
            for (int k = 0; k < K; k++)
                t[k] += __shfl_xor_sync(FULL, t[k], off);
        }
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_reduce_scatter<J>(t, lane);
    float *r = red + parity * (AR_MAX_WARPS * S);
    parity ^= 1;
#pragma unroll
    for (int j = 0; j < J; j++)
        r[warp * S + lane * J + j] = t[j];
    __syncthreads();
    const int nw = tpt >> 5, w0 = warp - warp % nw;
    float s[J];
#pragma unroll
    for (int j = 0; j < J; j++)
        s[j] = 0.0f;
    for (int i = 0; i < nw; i++) {
#pragma unroll
        for (int j = 0; j < J; j++)
            s[j] += r[(w0 + i) * S + lane * J + j];
    }
    float *wt = wtot + warp * S;
#pragma unroll
    for (int j = 0; j < J; j++)
        wt[lane * J + j] = s[j];
    __syncwarp();
    const float4 *w4 = reinterpret_cast<const float4 *>(wt);
#pragma unroll
    for (int k4 = 0; k4 < (K + 3) / 4; k4++) {
        const float4 v = w4[k4];
        t[4 * k4] = v.x, t[4 * k4 + 1] = v.y, t[4 * k4 + 2] = v.z, t[4 * k4 + 3] = v.w;
    }
    /* wt is written again only after the next reduction's barrier, which every lane of
     * this warp reaches after these reads; r (this parity) after the one after that. */
}

/* ---------------------------------------------------------------- forward */

template <bool VEC, int NV, int LC>
__global__ void __launch_bounds__(AR_MAX_THREADS) ar_fwd_kernel(const __grid_constant__ FwdArgs a) {
    constexpr int E = 8 * NV, W = 4 * NV, K = 2 * LC, S = 32 * ((K + 31) / 32);
    __shared__ __align__(16) float red[2 * AR_MAX_WARPS * S];
    __shared__ __align__(16) float wtot[AR_MAX_WARPS * S];
    const int tpt = a.tpt, tpc = a.tpc, D = a.D, L = a.L;
    const int grp = threadIdx.x / tpt, tl = threadIdx.x - grp * tpt;
    const int64_t N = a.N, ntg = (N + tpc - 1) / tpc;
    float u[E];
    load_u<VEC, NV>(a.query, a.rms_weight, tl, tpt, D, u);
    int parity = 0;
    for (int64_t tg = blockIdx.x; tg < ntg; tg += gridDim.x) {
        const int64_t n = tg * tpc + grp;
        const bool live = n < N;
        const int64_t off = live ? n * D : 0;
        const bool wr_w = a.weights && live && tl == 0;
        float acc[E];
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] = 0.0f;
        float M = -INFINITY, Z = 0.0f;
        for (int c0 = 0; c0 < L; c0 += LC) {
            const int lc = min(LC, L - c0);
            uint32_t x[LC][W];
#pragma unroll
            for (int i = 0; i < LC; i++)
                load_row<VEC, NV>(a.src.p[min(c0 + i, L - 1)] + off, tl, tpt, D, live && i < lc,
                                  x[i]);
            float t[S];
#pragma unroll
            for (int k = 0; k < S; k++)
                t[k] = 0.0f;
#pragma unroll
            for (int i = 0; i < LC; i++) {
                float ss = 0.0f, su = 0.0f;
#pragma unroll
                for (int w = 0; w < W; w++) {
                    const float x0 = lo_f(x[i][w]), x1 = hi_f(x[i][w]);
                    ss = fmaf(x0, x0, ss);
                    ss = fmaf(x1, x1, ss);
                    su = fmaf(u[2 * w], x0, su);
                    su = fmaf(u[2 * w + 1], x1, su);
                }
                t[i] = ss;
                t[LC + i] = su;
            }
            group_allreduce<K>(t, tpt, red, wtot, parity);
            float s[LC];
            float Mn = M;
#pragma unroll
            for (int i = 0; i < LC; i++) {
                s[i] = 0.0f;
                if (i < lc) {
                    const float r = rsqrtf(fmaf(t[i], a.inv_d, a.eps));
                    s[i] = a.scale * (r * t[LC + i]);
                    Mn = fmaxf(Mn, s[i]);
                }
            }
            const float alpha = expf(M - Mn); /* 0 for the first chunk (M = -inf) */
            Z *= alpha;
#pragma unroll
            for (int e = 0; e < E; e++)
                acc[e] *= alpha;
#pragma unroll
            for (int i = 0; i < LC; i++) {
                if (i < lc) {
                    const float wg = expf(s[i] - Mn);
                    Z += wg;
#pragma unroll
                    for (int w = 0; w < W; w++) {
                        acc[2 * w] = fmaf(wg, lo_f(x[i][w]), acc[2 * w]);
                        acc[2 * w + 1] = fmaf(wg, hi_f(x[i][w]), acc[2 * w + 1]);
                    }
                    if (wr_w) /* the logit for now; turned into p below */
                        a.weights[(int64_t)(c0 + i) * N + n] = s[i];
                }
            }
            M = Mn;
        }
        const float iz = 1.0f / Z;
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] *= iz;
        if (live)
            store_bf16_row<VEC, NV>(a.o + off, tl, tpt, D, acc);
        if (wr_w)
            for (int m = 0; m < L; m++) {
                float *pw = a.weights + (int64_t)m * N + n; /* this thread's own store */
                *pw = expf(*pw - M) * iz;
            }
    }
}

/* ---------------------------------------------------------------- backward */

/* dC = p do + b u - e C (+ the old value with accumulate) into dst (skipped when NULL or
 * the row is not live); du += b C. */
template <typename GT, bool VEC, int NV>
__device__ __forceinline__ void grad_row(void *dst, int64_t off, bool live, int tl, int tpt, int D,
                                         int accumulate, float p, float b, float e,
                                         const uint32_t (&x)[4 * NV], const uint32_t (&dh)[4 * NV],
                                         const float (&u)[8 * NV], float (&du)[8 * NV]) {
    float g[8 * NV];
#pragma unroll
    for (int w = 0; w < 4 * NV; w++) {
        const float x0 = lo_f(x[w]), x1 = hi_f(x[w]);
        g[2 * w] = fmaf(p, lo_f(dh[w]), fmaf(b, u[2 * w], -e * x0));
        g[2 * w + 1] = fmaf(p, hi_f(dh[w]), fmaf(b, u[2 * w + 1], -e * x1));
        du[2 * w] = fmaf(b, x0, du[2 * w]);
        du[2 * w + 1] = fmaf(b, x1, du[2 * w + 1]);
    }
    if (dst && live) {
        GT *row = reinterpret_cast<GT *>(dst) + off;
        if (accumulate)
            add_old_row<GT, VEC, NV>(row, tl, tpt, D, g);
        store_grad_row<GT, VEC, NV>(row, tl, tpt, D, g);
    }
}

/* Partial sums of LC sources from the rows in x: t[i] = sum C^2, t[LC+i] = <u, C>,
 * t[2LC+i] = <do, C>, then the group totals. */
template <int NV, int LC>
__device__ __forceinline__ void bwd_partials(const uint32_t (&x)[LC][4 * NV],
                                             const uint32_t (&dh)[4 * NV], const float (&u)[8 * NV],
                                             float (&t)[32 * ((3 * LC + 31) / 32)]) {
    constexpr int S = 32 * ((3 * LC + 31) / 32);
#pragma unroll
    for (int k = 0; k < S; k++)
        t[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < LC; i++) {
        float ss = 0.0f, su = 0.0f, sd = 0.0f;
#pragma unroll
        for (int w = 0; w < 4 * NV; w++) {
            const float x0 = lo_f(x[i][w]), x1 = hi_f(x[i][w]);
            ss = fmaf(x0, x0, ss);
            ss = fmaf(x1, x1, ss);
            su = fmaf(u[2 * w], x0, su);
            su = fmaf(u[2 * w + 1], x1, su);
            sd = fmaf(lo_f(dh[w]), x0, sd);
            sd = fmaf(hi_f(dh[w]), x1, sd);
        }
        t[i] = ss;
        t[LC + i] = su;
        t[2 * LC + i] = sd;
    }
}

template <bool VEC, int NV, int LC, typename GT>
__global__ void __launch_bounds__(AR_MAX_THREADS) ar_bwd_kernel(const __grid_constant__ BwdArgs a) {
    constexpr int E = 8 * NV, W = 4 * NV, K = 3 * LC, S = 32 * ((K + 31) / 32);
    __shared__ __align__(16) float red[2 * AR_MAX_WARPS * S];
    __shared__ __align__(16) float wtot[AR_MAX_WARPS * S];
    extern __shared__ __align__(16) float ar_stats[]; /* L > LC: [owners][3][L] */
    const int tpt = a.tpt, tpc = a.tpc, D = a.D, L = a.L;
    const int grp = threadIdx.x / tpt, tl = threadIdx.x - grp * tpt;
    const int64_t N = a.N, ntg = (N + tpc - 1) / tpc;
    const float scale = a.scale, inv_d = a.inv_d, eps = a.eps;
    /* streaming statistics: one copy per warp (whole-warp rows) or per group (small rows),
     * written by one lane, read by the lanes of the same warp */
    const bool big = tpt >= 32;
    const int owner = big ? (int)(threadIdx.x >> 5) : grp;
    const bool writer = big ? (threadIdx.x & 31) == 0 : tl == 0;
    float *st = ar_stats + owner * 3 * L;
    float u[E], du[E];
    load_u<VEC, NV>(a.query, a.rms_weight, tl, tpt, D, u);
#pragma unroll
    for (int e = 0; e < E; e++)
        du[e] = 0.0f;
    int parity = 0;
    for (int64_t tg = blockIdx.x; tg < ntg; tg += gridDim.x) {
        const int64_t n = tg * tpc + grp;
        const bool live = n < N;
        const int64_t off = live ? n * D : 0;
        uint32_t dh[W];
        load_row<VEC, NV>(a.dout + off, tl, tpt, D, live, dh);
        uint32_t x[LC][W];
        float t[S];
        float M = -INFINITY;
        if (L <= LC) {
            /* one chunk: the rows stay in registers for the second phase */
            if (a.accumulate && live)
#pragma unroll
                for (int i = 0; i < LC; i++)
                    if (i < L)
                        prefetch_grad_row<GT, VEC, NV>(a.dst.p[i], off, tl, tpt, D);
#pragma unroll
            for (int i = 0; i < LC; i++)
                load_row<VEC, NV>(a.src.p[i < L ? i : 0] + off, tl, tpt, D, live && i < L, x[i]);
            bwd_partials<NV, LC>(x, dh, u, t);
            group_allreduce<K>(t, tpt, red, wtot, parity);
            float r[LC], tt[LC], p[LC];
#pragma unroll
            for (int i = 0; i < LC; i++) {
                r[i] = tt[i] = p[i] = 0.0f;
                if (i < L) {
                    r[i] = rsqrtf(fmaf(t[i], inv_d, eps));
                    tt[i] = r[i] * t[LC + i];
                    M = fmaxf(M, scale * tt[i]);
                }
            }
            float Z = 0.0f;
#pragma unroll
            for (int i = 0; i < LC; i++)
                if (i < L) {
                    p[i] = expf(scale * tt[i] - M);
                    Z += p[i];
                }
            const float iz = 1.0f / Z;
            float delta = 0.0f;
#pragma unroll
            for (int i = 0; i < LC; i++)
                if (i < L) {
                    p[i] *= iz;
                    delta = fmaf(p[i], t[2 * LC + i], delta);
                }
#pragma unroll
            for (int i = 0; i < LC; i++)
                if (i < L) {
                    const float b = scale * p[i] * (t[2 * LC + i] - delta) * r[i];
                    const float e = b * tt[i] * r[i] * inv_d;
                    grad_row<GT, VEC, NV>(a.dst.p[i], off, live, tl, tpt, D, a.accumulate, p[i], b,
                                          e, x[i], dh, u, du);
                }
        } else {
            /* several chunks: statistics of every source to shared memory, then the rows
             * are read again for the second phase */
            __syncwarp(); /* the previous row's readers of st are done */
            for (int c0 = 0; c0 < L; c0 += LC) {
                const int lc = min(LC, L - c0);
#pragma unroll
                for (int i = 0; i < LC; i++)
                    load_row<VEC, NV>(a.src.p[min(c0 + i, L - 1)] + off, tl, tpt, D, live && i < lc,
                                      x[i]);
                bwd_partials<NV, LC>(x, dh, u, t);
                group_allreduce<K>(t, tpt, red, wtot, parity);
#pragma unroll
                for (int i = 0; i < LC; i++)
                    if (i < lc) {
                        const float r = rsqrtf(fmaf(t[i], inv_d, eps));
                        const float tv = r * t[LC + i];
                        M = fmaxf(M, scale * tv);
                        if (writer) {
                            st[c0 + i] = r;
                            st[L + c0 + i] = tv;
                            st[2 * L + c0 + i] = t[2 * LC + i];
                        }
                    }
            }
            __syncwarp();
            float Z = 0.0f, zd = 0.0f;
            for (int m = 0; m < L; m++) {
                const float w = expf(scale * st[L + m] - M);
                Z += w;
                zd = fmaf(w, st[2 * L + m], zd);
            }
            const float iz = 1.0f / Z, delta = zd * iz;
            for (int c0 = 0; c0 < L; c0 += LC) {
                const int lc = min(LC, L - c0);
                if (a.accumulate && live)
                    for (int i = 0; i < lc; i++)
                        prefetch_grad_row<GT, VEC, NV>(a.dst.p[c0 + i], off, tl, tpt, D);
#pragma unroll
                for (int i = 0; i < LC; i++)
                    load_row<VEC, NV>(a.src.p[min(c0 + i, L - 1)] + off, tl, tpt, D, live && i < lc,
                                      x[i]);
#pragma unroll
                for (int i = 0; i < LC; i++)
                    if (i < lc) {
                        const int m = c0 + i;
                        const float r = st[m], tv = st[L + m], dp = st[2 * L + m];
                        const float p = expf(scale * tv - M) * iz;
                        const float b = scale * p * (dp - delta) * r;
                        const float e = b * tv * r * inv_d;
                        grad_row<GT, VEC, NV>(a.dst.p[m], off, live, tl, tpt, D, a.accumulate, p, b,
                                              e, x[i], dh, u, du);
                    }
            }
        }
    }
    if (a.partial) {
        float *row = a.partial + ((int64_t)blockIdx.x * tpc + grp) * D;
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int c = col_of<VEC>(tl, tpt, e);
            if (c < D)
                row[c] = du[e];
        }
    }
}

/* dquery = du (.) rms_weight, drms_weight = du (.) query, du = sum of the R partial rows
 * in a fixed order: 8 row slices per column (r = slice, slice + 8, ...) in fp64, then the
 * slices in order. CTA: 32 columns x 8 slices. */
__global__ void __launch_bounds__(256)
    ar_dparam_kernel(const float *__restrict__ part, int64_t R, int D, const float *query,
                     const float *rms_weight, float *dquery, float *drms_weight, int accumulate) {
    __shared__ double sh[8][32];
    const int lane = threadIdx.x & 31, sl = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    double s = 0.0;
    if (c < D) {
#pragma unroll 4
        for (int64_t r = sl; r < R; r += 8)
            s += (double)part[r * D + c];
    }
    sh[sl][lane] = s;
    __syncthreads();
    if (sl != 0 || c >= D)
        return;
    double du = 0.0;
#pragma unroll
    for (int i = 0; i < 8; i++)
        du += sh[i][lane];
    if (dquery) {
        const float v = (float)(du * (double)rms_weight[c]);
        dquery[c] = accumulate ? dquery[c] + v : v;
    }
    if (drms_weight) {
        const float v = (float)(du * (double)query[c]);
        drms_weight[c] = accumulate ? drms_weight[c] + v : v;
    }
}

/* ---------------------------------------------------------------- host side */

typedef void (*FwdKernel)(FwdArgs);
typedef void (*BwdKernel)(BwdArgs);

/* Occupancy per (kernel, block, shared bytes), cached in the context's AttnRes slot. */
struct ArState {
    struct Entry {
        const void *k;
        int block;
        size_t smem;
        int nb;
    } e[64];
    int n = 0;
};

lm_status occupancy(lm_cuda_ctx *ctx, const void *k, int block, size_t smem, int *nb,
                    lm_error *err) {
    ArState *s = lm_cuda_ctx_get<ArState>(ctx, LM_SLOT_ATTNRES);
    for (int i = 0; i < s->n; i++)
        if (s->e[i].k == k && s->e[i].block == block && s->e[i].smem == smem) {
            *nb = s->e[i].nb;
            return LM_OK;
        }
    LM_CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(nb, k, block, smem));
    if (*nb < 1)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attnres cuda: a CTA of %d threads with %zu bytes of shared memory does "
                         "not fit on cuda:%d",
                         block, smem, ctx->device);
    if (s->n < (int)(sizeof s->e / sizeof s->e[0]))
        s->e[s->n++] = {k, block, smem, *nb};
    return LM_OK;
}

struct Plan {
    bool vec;
    int nv, tpt, tpc, block;
};

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

lm_status make_plan(int D, bool aligned, const char *op, Plan *p, lm_error *err) {
    p->vec = aligned && D % 8 == 0;
    p->nv = 1;
    int units = (D + 7) / 8; /* threads of a row at 8 elements per thread */
    if (p->vec && units > AR_MAX_THREADS) {
        p->nv = 2;
        units = (D + 15) / 16;
    }
    if (units > AR_MAX_THREADS)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attnres cuda %s: D = %d is not supported (at most 8192 with D %% 8 == 0 "
                         "and 16-byte aligned tensors, 4096 otherwise)",
                         op, D);
    p->tpt = units <= 8 ? 8 : units <= 16 ? 16 : (units + 31) / 32 * 32;
    p->tpc = p->tpt >= AR_CTA ? 1 : AR_CTA / p->tpt;
    p->block = p->tpt * p->tpc;
    return LM_OK;
}

/* Chunk of sources held in registers at once: the smallest instance >= L (the element
 * path and D > 4096 take 4). */
FwdKernel pick_fwd(const Plan &p, int L) {
    if (!p.vec)
        return ar_fwd_kernel<false, 1, 4>;
    if (p.nv == 2)
        return ar_fwd_kernel<true, 2, 4>;
    if (L <= 3)
        return ar_fwd_kernel<true, 1, 3>;
    if (L <= 6)
        return ar_fwd_kernel<true, 1, 6>;
    if (L <= 9)
        return ar_fwd_kernel<true, 1, 9>;
    return ar_fwd_kernel<true, 1, 12>; /* L > 12: chunks of 12 */
}

/* The backward holds 3 partials per source besides the rows: at most 9 in registers (12
 * spilled at the 128-register bound of a 512-thread CTA); L > 9 takes chunks of 9. */
template <typename GT> BwdKernel pick_bwd_t(const Plan &p, int L, int *lc) {
    if (!p.vec) {
        *lc = 4;
        return ar_bwd_kernel<false, 1, 4, GT>;
    }
    if (p.nv == 2) {
        *lc = 4;
        return ar_bwd_kernel<true, 2, 4, GT>;
    }
    if (L <= 3) {
        *lc = 3;
        return ar_bwd_kernel<true, 1, 3, GT>;
    }
    if (L <= 6) {
        *lc = 6;
        return ar_bwd_kernel<true, 1, 6, GT>;
    }
    *lc = 9;
    return ar_bwd_kernel<true, 1, 9, GT>;
}

lm_status check_common(const lm_attnres_config *c, const void *const *src, const float *query,
                       const float *rms_weight, const char *op, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: config is required", op);
    if (c->L < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: L = %d sources (must be >= 1)", op,
                         c->L);
    if (c->L > AR_LMAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attnres cuda %s: L = %d sources is not supported (at most %d)", op, c->L,
                         AR_LMAX);
    if (c->N < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: N = %lld rows (must be >= 1)", op,
                         (long long)c->N);
    if (c->D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: D = %d (must be >= 1)", op, c->D);
    if (c->N > ((int64_t)1 << 46) / c->D / c->L)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attnres cuda %s: problem too large (L*N*D = %d*%lld*%d > 2^46)", op, c->L,
                         (long long)c->N, c->D);
    if (!isfinite(c->eps) || !(c->eps > 0.0f))
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: eps = %g (must be finite and > 0)",
                         op, (double)c->eps);
    if (!isfinite(c->scale))
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: scale = %g is not finite", op,
                         (double)c->scale);
    if (!query)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: input 'query' is required", op);
    if (!rms_weight)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: input 'rms_weight' is required",
                         op);
    if (!src)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda %s: the source table is required", op);
    for (int m = 0; m < c->L; m++)
        if (!src[m])
            return lm_errorf(err, LM_ERR_INVALID,
                             "attnres cuda %s: source residual_%d is NULL (L = %d)", op, m, c->L);
    return LM_OK;
}

int grid_for(const lm_cuda_ctx *ctx, int64_t ntg, int nb) {
    const int64_t cap = (int64_t)ctx->sm_count * nb;
    return (int)(ntg < cap ? ntg : cap);
}

} // namespace

extern "C" lm_status lm_cuda_attnres_forward_ptrs(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                                  const void *const *src, const float *query,
                                                  const float *rms_weight, void *o, float *weights,
                                                  lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_common(c, src, query, rms_weight, "forward", err));
    if (!o)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda forward: output 'o' is required");
    FwdArgs a;
    memset(&a, 0, sizeof a);
    bool aligned = aligned16(o);
    for (int m = 0; m < c->L; m++) {
        a.src.p[m] = (const bf16 *)src[m];
        aligned = aligned && aligned16(src[m]);
    }
    Plan p = {};
    LM_TRY(make_plan(c->D, aligned, "forward", &p, err));
    a.query = query, a.rms_weight = rms_weight, a.o = (bf16 *)o, a.weights = weights;
    a.N = c->N, a.D = c->D, a.L = c->L, a.tpt = p.tpt, a.tpc = p.tpc;
    a.eps = c->eps, a.scale = c->scale, a.inv_d = 1.0f / (float)c->D;
    const FwdKernel k = pick_fwd(p, c->L);
    int nb = 0;
    LM_TRY(occupancy(ctx, (const void *)k, p.block, 0, &nb, err));
    const int grid = grid_for(ctx, (c->N + p.tpc - 1) / p.tpc, nb);
    k<<<grid, p.block, 0, ctx->stream>>>(a);
    LM_CK_LAUNCH("ar_fwd_kernel");
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_backward_ptrs(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                                   const void *const *src, const float *query,
                                                   const float *rms_weight, const void *do_,
                                                   void *const *dsrc, lm_dtype dsrc_dtype,
                                                   float *dquery, float *drms_weight,
                                                   lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_common(c, src, query, rms_weight, "backward", err));
    if (!do_)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attnres cuda backward: upstream gradient 'do' is required");
    if (dsrc_dtype != LM_BF16 && dsrc_dtype != LM_F32)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attnres cuda backward: dsrc_dtype %s is not supported (BF16 or F32)",
                         lm_dtype_name(dsrc_dtype));
    BwdArgs a;
    memset(&a, 0, sizeof a);
    bool aligned = aligned16(do_);
    for (int m = 0; m < c->L; m++) {
        a.src.p[m] = (const bf16 *)src[m];
        a.dst.p[m] = dsrc ? dsrc[m] : nullptr;
        aligned = aligned && aligned16(src[m]) && aligned16(a.dst.p[m]);
    }
    Plan p = {};
    LM_TRY(make_plan(c->D, aligned, "backward", &p, err));
    a.query = query, a.rms_weight = rms_weight, a.dout = (const bf16 *)do_;
    a.N = c->N, a.D = c->D, a.L = c->L, a.tpt = p.tpt, a.tpc = p.tpc;
    a.accumulate = c->accumulate ? 1 : 0;
    a.eps = c->eps, a.scale = c->scale, a.inv_d = 1.0f / (float)c->D;
    int lc = 0;
    const BwdKernel k =
        dsrc_dtype == LM_BF16 ? pick_bwd_t<bf16>(p, c->L, &lc) : pick_bwd_t<float>(p, c->L, &lc);
    const int owners = p.tpt >= 32 ? p.block / 32 : p.tpc;
    const size_t smem = c->L > lc ? (size_t)owners * 3 * (size_t)c->L * sizeof(float) : 0;
    int nb = 0;
    LM_TRY(occupancy(ctx, (const void *)k, p.block, smem, &nb, err));
    const int grid = grid_for(ctx, (c->N + p.tpc - 1) / p.tpc, nb);
    const bool params = dquery || drms_weight;
    const int64_t R = (int64_t)grid * p.tpc;
    if (params) {
        void *part = nullptr;
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, (size_t)R * (size_t)c->D * sizeof(float),
                                   &part, err));
        a.partial = (float *)part;
    }
    k<<<grid, p.block, smem, ctx->stream>>>(a);
    LM_CK_LAUNCH("ar_bwd_kernel");
    if (params) {
        ar_dparam_kernel<<<(c->D + 31) / 32, 256, 0, ctx->stream>>>(
            a.partial, R, c->D, query, rms_weight, dquery, drms_weight, a.accumulate);
        LM_CK_LAUNCH("ar_dparam_kernel");
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_forward(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                             const void *residual, const float *query,
                                             const float *rms_weight, void *o, float *weights,
                                             lm_error *err) {
    if (!c || c->L < 1 || c->L > AR_LMAX || c->N < 1 || c->D < 1)
        return lm_cuda_attnres_forward_ptrs(ctx, c, residual ? &residual : nullptr, query,
                                            rms_weight, o, weights, err);
    if (!residual)
        return lm_errorf(err, LM_ERR_INVALID, "attnres cuda forward: input 'residual' is required");
    const void *tab[AR_LMAX];
    for (int m = 0; m < c->L; m++)
        tab[m] = (const char *)residual + (size_t)m * (size_t)c->N * (size_t)c->D * sizeof(bf16);
    return lm_cuda_attnres_forward_ptrs(ctx, c, tab, query, rms_weight, o, weights, err);
}

extern "C" lm_status lm_cuda_attnres_backward(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                              const void *residual, const float *query,
                                              const float *rms_weight, const void *do_,
                                              void *dresidual, lm_dtype dsrc_dtype, float *dquery,
                                              float *drms_weight, lm_error *err) {
    if (!c || c->L < 1 || c->L > AR_LMAX || c->N < 1 || c->D < 1)
        return lm_cuda_attnres_backward_ptrs(ctx, c, residual ? &residual : nullptr, query,
                                             rms_weight, do_, nullptr, dsrc_dtype, dquery,
                                             drms_weight, err);
    if (!residual)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attnres cuda backward: input 'residual' is required");
    const void *tab[AR_LMAX];
    void *dtab[AR_LMAX];
    const size_t nd = (size_t)c->N * (size_t)c->D;
    const size_t gs = dsrc_dtype == LM_F32 ? sizeof(float) : sizeof(bf16);
    for (int m = 0; m < c->L; m++) {
        tab[m] = (const char *)residual + (size_t)m * nd * sizeof(bf16);
        dtab[m] = dresidual ? (char *)dresidual + (size_t)m * nd * gs : nullptr;
    }
    return lm_cuda_attnres_backward_ptrs(ctx, c, tab, query, rms_weight, do_,
                                         dresidual ? dtab : nullptr, dsrc_dtype, dquery,
                                         drms_weight, err);
}
