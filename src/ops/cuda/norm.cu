/* RMSNorm (optionally fused with the residual add) and the head-wise sigmoid-gated
 * RMSNorm on the GPU (include/linmoe/cuda_layers.h has the contract; the math is that
 * of src/ops/rmsnorm.c).
 *
 * Both are one kernel over R rows of D elements (plain: R = N; gated: R = N*H rows of
 * Dh sharing one weight). A row belongs to a group of LPR lanes of one warp (LPR = 32,
 * or 16 / 8 for short rows such as Dh = 128, so that every lane still moves 16 bytes
 * per load); lane `sub` of the group owns the 8-element vectors v = k*LPR + sub. Rows of
 * up to KV*LPR vectors (KV <= 8: D <= 2048) are held in registers between the
 * statistic and the output pass, longer ones are re-read (KV = 0). A row length that
 * is not a multiple of 8, or a pointer that is not 16-byte aligned, takes the scalar
 * instance (VEC = 1, re-read).
 *
 * Backward, per row: dot = sum_d dy w s x (s = sigmoid(gate) or 1), c = dot rstd^2 / D,
 * dx = rstd (dy w s - x c) (+ dresidual), dgate = dy x rstd w s (1 - s). The weight
 * gradient sum_rows dy x rstd s goes into a shared-memory accumulator row per lane group
 * (each lane updates only its own columns: no atomics), stored lane-interleaved so that
 * a warp's float4 accesses are contiguous. At the end each CTA sums its accumulator rows
 * in slot order into one row of partials [CTAs, D] (scratch), and colsum_add adds the
 * partials to dweight in CTA order: the same bits on every run. The CTA count is
 * min(row groups, SMs * resident CTAs per SM), which depends on the shape and the device.
 *
 * Kernel variants (src/ops/cuda/layers_variants.h; the public entry points run the
 * defaults): the forward's first kernels on an uncapped grid and the multi-row kernels
 * norm_fwd2; the backward's norm_bwd2 (with colsum2_add). Layouts norm_fwd2 / norm_bwd2
 * do not cover (the scalar path, rows re-read) run the first kernels (norm_fwd on a
 * one-wave grid, norm_bwd with colsum_add). The variants that lost their A/B tests are
 * described in dev/layers_variants.md.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "linmoe/cuda_layers.h"
#include "ops/cuda/ctx.cuh"
#include "ops/cuda/layers_variants.h"
#include "ops/cuda/vec.cuh"

namespace {

constexpr int FWD_THREADS = 256;
constexpr int BWD_WARPS_MAX = 8;

/* ---------------------------------------------------------------- bf16 vectors */

template <int VEC> struct Pk;
template <> struct Pk<8> { typedef uint4 T; };
template <> struct Pk<1> { typedef unsigned short T; };

template <int VEC> __device__ __forceinline__ typename Pk<VEC>::T ld_pk(const __nv_bfloat16 *p) {
    return *reinterpret_cast<const typename Pk<VEC>::T *>(p);
}
template <int VEC> __device__ __forceinline__ typename Pk<VEC>::T ldg_pk(const __nv_bfloat16 *p) {
    return __ldg(reinterpret_cast<const typename Pk<VEC>::T *>(p));
}
template <int VEC>
__device__ __forceinline__ void st_pk(__nv_bfloat16 *p, const typename Pk<VEC>::T &v) {
    *reinterpret_cast<typename Pk<VEC>::T *>(p) = v;
}

/* The weight vector v, or ones when the op has no weight. */
template <int VEC>
__device__ __forceinline__ void load_w(const __nv_bfloat16 *w, int v, float (&f)[VEC]) {
    if (w) {
        unpack(ldg_pk<VEC>(w + (int64_t)v * VEC), f);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++)
            f[i] = 1.0f;
    }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <int LPR> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Offset of element i of lane-vector k (lane `sub` of its group) in a shared-memory
 * accumulator row: lane-interleaved by 4 floats (VEC = 8) or 1 (VEC = 1), so that the
 * lanes of a group touch consecutive words. */
template <int VEC, int LPR> __device__ __forceinline__ int acc_off(int k, int sub, int i) {
    if constexpr (VEC == 8)
        return ((k * 2 + (i >> 2)) * LPR + sub) * 4 + (i & 3);
    else
        return k * LPR + sub;
}
/* The same for column `col` of the row. */
template <int VEC, int LPR> __device__ __forceinline__ int acc_off_col(int col) {
    const int v = col / VEC, i = col % VEC;
    return acc_off<VEC, LPR>(v / LPR, v % LPR, i);
}

/* ---------------------------------------------------------------- forward */

struct FwdP {
    const __nv_bfloat16 *x, *res, *w, *gate;
    __nv_bfloat16 *h, *y;
    float *rstd;
    int64_t R;
    int D;
    float eps;
};

/* One row: h = x (+ res), rstd, y = h rstd w (sigmoid(gate)). Lanes of rows past R
 * take part in the shuffles with zeros. */
/* MODE: 0 plain, 1 plain with the residual add, 2 gated (fixed per call site, so each
 * instance keeps only the registers it needs). */
template <int VEC, int KV, int LPR, int MODE>
__global__ void __launch_bounds__(FWD_THREADS) norm_fwd(const FwdP p) {
    constexpr bool RES = MODE == 1, GATED = MODE == 2;
    typedef typename Pk<VEC>::T P;
    constexpr int RPW = 32 / LPR;
    const int lane = threadIdx.x & 31, sub = lane % LPR;
    const int nvec = p.D / VEC;
    const int64_t warp0 = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int64_t wstride = (int64_t)gridDim.x * (blockDim.x >> 5);
    const float invD = 1.0f / (float)p.D;
    for (int64_t base = warp0 * RPW; base < p.R; base += wstride * RPW) {
        const int64_t row = base + lane / LPR;
        const bool ok = row < p.R;
        const int64_t off = row * p.D;
        float ss = 0.0f;
        if constexpr (KV > 0) {
            /* every load of the row first (the gate too: its latency then overlaps
             * the statistic's reduction) */
            P xr[KV], rr[RES ? KV : 1], gr[GATED ? KV : 1];
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                if (ok && v < nvec) {
                    xr[k] = ld_pk<VEC>(p.x + off + (int64_t)v * VEC);
                    if constexpr (RES)
                        rr[k] = ld_pk<VEC>(p.res + off + (int64_t)v * VEC);
                    if constexpr (GATED)
                        gr[k] = ldg_pk<VEC>(p.gate + off + (int64_t)v * VEC);
                }
            }
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                if (ok && v < nvec) {
                    float f[VEC];
                    unpack(xr[k], f);
                    if constexpr (RES) {
                        float r[VEC];
                        unpack(rr[k], r);
#pragma unroll
                        for (int i = 0; i < VEC; i++)
                            f[i] += r[i];
                        pack(f, xr[k]);
                        unpack(xr[k], f); /* the statistic of the stored bf16 h */
                        st_pk<VEC>(p.h + off + (int64_t)v * VEC, xr[k]);
                    }
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        ss += f[i] * f[i];
                }
            }
            ss = group_sum<LPR>(ss);
            const float rs = rsqrtf(ss * invD + p.eps);
            if (ok && sub == 0 && p.rstd)
                p.rstd[row] = rs;
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                if (ok && v < nvec) {
                    float f[VEC], w[VEC];
                    unpack(xr[k], f);
                    load_w<VEC>(p.w, v, w);
                    if constexpr (GATED) {
                        float g[VEC];
                        unpack(gr[k], g);
#pragma unroll
                        for (int i = 0; i < VEC; i++)
                            f[i] = f[i] * rs * w[i] * sigmoidf_(g[i]);
                    } else {
#pragma unroll
                        for (int i = 0; i < VEC; i++)
                            f[i] = f[i] * rs * w[i];
                    }
                    P o;
                    pack(f, o);
                    st_pk<VEC>(p.y + off + (int64_t)v * VEC, o);
                }
            }
        } else {
            /* long or scalar rows: two passes, the second reads h (or x) again */
            const __nv_bfloat16 *src = RES ? p.h : p.x;
            for (int v = sub; ok && v < nvec; v += LPR) {
                float f[VEC];
                P xv = ld_pk<VEC>(p.x + off + (int64_t)v * VEC);
                unpack(xv, f);
                if constexpr (RES) {
                    float r[VEC];
                    unpack(ld_pk<VEC>(p.res + off + (int64_t)v * VEC), r);
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        f[i] += r[i];
                    pack(f, xv);
                    unpack(xv, f);
                    st_pk<VEC>(p.h + off + (int64_t)v * VEC, xv);
                }
#pragma unroll
                for (int i = 0; i < VEC; i++)
                    ss += f[i] * f[i];
            }
            ss = group_sum<LPR>(ss);
            const float rs = rsqrtf(ss * invD + p.eps);
            if (ok && sub == 0 && p.rstd)
                p.rstd[row] = rs;
            for (int v = sub; ok && v < nvec; v += LPR) {
                float f[VEC], w[VEC];
                unpack(ld_pk<VEC>(src + off + (int64_t)v * VEC), f);
                load_w<VEC>(p.w, v, w);
                if constexpr (GATED) {
                    float g[VEC];
                    unpack(ldg_pk<VEC>(p.gate + off + (int64_t)v * VEC), g);
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        f[i] = f[i] * rs * w[i] * sigmoidf_(g[i]);
                } else {
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        f[i] = f[i] * rs * w[i];
                }
                P o;
                pack(f, o);
                st_pk<VEC>(p.y + off + (int64_t)v * VEC, o);
            }
        }
    }
}

/* ---------------------------------------------------------------- backward */

struct BwdP {
    const __nv_bfloat16 *x, *gate, *w, *dy, *dres;
    const float *rstd;
    __nv_bfloat16 *dx, *dgate;
    float *part; /* [gridDim.x, D] or NULL (no dweight) */
    int64_t R;
    int D, Dp; /* Dp: floats per shared accumulator row */
    float eps;
};

/* Per element of a row, given rs, c: dx, dgate and the dweight term. */
template <int VEC, int LPR, bool GATED>
__device__ __forceinline__ void
bwd_elems(const BwdP &p, int64_t off, int v, int k, int sub, float rs, float c,
          const float (&x)[VEC], const float (&dy)[VEC], const float (&g)[VEC], float *acc) {
    typedef typename Pk<VEC>::T P;
    float w[VEC];
    load_w<VEC>(p.w, v, w);
    float dxv[VEC], dgv[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        const float s = GATED ? sigmoidf_(g[i]) : 1.0f;
        dxv[i] = rs * (dy[i] * w[i] * s - x[i] * c);
        dgv[i] = dy[i] * x[i] * rs * w[i] * s * (1.0f - s);
        if (acc)
            acc[acc_off<VEC, LPR>(k, sub, i)] += dy[i] * x[i] * rs * s;
    }
    const int64_t e = off + (int64_t)v * VEC;
    if (p.dx) {
        if (p.dres) {
            float r[VEC];
            unpack(ld_pk<VEC>(p.dres + e), r);
#pragma unroll
            for (int i = 0; i < VEC; i++)
                dxv[i] += r[i];
        }
        P o;
        pack(dxv, o);
        st_pk<VEC>(p.dx + e, o);
    }
    if (GATED && p.dgate) {
        P o;
        pack(dgv, o);
        st_pk<VEC>(p.dgate + e, o);
    }
}

template <int VEC, int KV, int LPR, bool GATED>
__global__ void __launch_bounds__(BWD_WARPS_MAX * 32, 2) norm_bwd(const BwdP p) {
    typedef typename Pk<VEC>::T P;
    constexpr int RPW = 32 / LPR;
    extern __shared__ float sacc[];
    const int lane = threadIdx.x & 31, sub = lane % LPR, warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5, nslots = nw * RPW;
    const int nvec = p.D / VEC;
    const float invD = 1.0f / (float)p.D;
    float *acc = nullptr;
    if (p.part) {
        for (int i = threadIdx.x; i < nslots * p.Dp; i += blockDim.x)
            sacc[i] = 0.0f;
        __syncthreads();
        acc = sacc + (warp * RPW + lane / LPR) * p.Dp;
    }
    const int64_t warp0 = (int64_t)blockIdx.x * nw + warp, wstride = (int64_t)gridDim.x * nw;
    for (int64_t base = warp0 * RPW; base < p.R; base += wstride * RPW) {
        const int64_t row = base + lane / LPR;
        const bool ok = row < p.R;
        const int64_t off = row * p.D;
        float dot = 0.0f, ss = 0.0f;
        if constexpr (KV > 0) {
            P xr[KV], dr[KV], gr[GATED ? KV : 1];
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                if (ok && v < nvec) {
                    xr[k] = ldg_pk<VEC>(p.x + off + (int64_t)v * VEC);
                    dr[k] = ldg_pk<VEC>(p.dy + off + (int64_t)v * VEC);
                    if constexpr (GATED)
                        gr[k] = ldg_pk<VEC>(p.gate + off + (int64_t)v * VEC);
                }
            }
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                if (ok && v < nvec) {
                    float x[VEC], dy[VEC], g[VEC], w[VEC];
                    unpack(xr[k], x);
                    unpack(dr[k], dy);
                    if constexpr (GATED)
                        unpack(gr[k], g);
                    load_w<VEC>(p.w, v, w);
#pragma unroll
                    for (int i = 0; i < VEC; i++) {
                        const float s = GATED ? sigmoidf_(g[i]) : 1.0f;
                        dot += dy[i] * w[i] * s * x[i];
                        ss += x[i] * x[i];
                    }
                }
            }
            dot = group_sum<LPR>(dot);
            float rs = 0.0f;
            if (p.rstd) {
                rs = ok ? __ldg(p.rstd + row) : 0.0f;
            } else {
                ss = group_sum<LPR>(ss);
                rs = rsqrtf(ss * invD + p.eps);
            }
            const float c = dot * rs * rs * invD;
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                if (ok && v < nvec) {
                    float x[VEC], dy[VEC], g[VEC];
                    unpack(xr[k], x);
                    unpack(dr[k], dy);
                    if constexpr (GATED)
                        unpack(gr[k], g);
                    bwd_elems<VEC, LPR, GATED>(p, off, v, k, sub, rs, c, x, dy, g, acc);
                }
            }
        } else {
            for (int v = sub; ok && v < nvec; v += LPR) {
                float x[VEC], dy[VEC], g[VEC], w[VEC];
                unpack(ldg_pk<VEC>(p.x + off + (int64_t)v * VEC), x);
                unpack(ldg_pk<VEC>(p.dy + off + (int64_t)v * VEC), dy);
                if constexpr (GATED)
                    unpack(ldg_pk<VEC>(p.gate + off + (int64_t)v * VEC), g);
                load_w<VEC>(p.w, v, w);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float s = GATED ? sigmoidf_(g[i]) : 1.0f;
                    dot += dy[i] * w[i] * s * x[i];
                    ss += x[i] * x[i];
                }
            }
            dot = group_sum<LPR>(dot);
            float rs = 0.0f;
            if (p.rstd) {
                rs = ok ? __ldg(p.rstd + row) : 0.0f;
            } else {
                ss = group_sum<LPR>(ss);
                rs = rsqrtf(ss * invD + p.eps);
            }
            const float c = dot * rs * rs * invD;
            for (int v = sub; ok && v < nvec; v += LPR) {
                float x[VEC], dy[VEC], g[VEC];
                unpack(ldg_pk<VEC>(p.x + off + (int64_t)v * VEC), x);
                unpack(ldg_pk<VEC>(p.dy + off + (int64_t)v * VEC), dy);
                if constexpr (GATED)
                    unpack(ldg_pk<VEC>(p.gate + off + (int64_t)v * VEC), g);
                bwd_elems<VEC, LPR, GATED>(p, off, v, v / LPR, sub, rs, c, x, dy, g, acc);
            }
        }
    }
    if (p.part) {
        __syncthreads();
        for (int col = threadIdx.x; col < p.D; col += blockDim.x) {
            const int o = acc_off_col<VEC, LPR>(col);
            float s = 0.0f;
            for (int sl = 0; sl < nslots; sl++)
                s += sacc[sl * p.Dp + o];
            p.part[(int64_t)blockIdx.x * p.D + col] = s;
        }
    }
}

/* dst[col] += sum_{b < nb} part[b, col], in a fixed order: warp w sums the rows b = w,
 * w + 8, ... of 32 columns, then the 8 warp sums are added in warp order. */
__global__ void __launch_bounds__(256)
    colsum_add(const float *__restrict__ part, int nb, int D, float *__restrict__ dst) {
    __shared__ float red[8][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (col < D)
        for (int b = warp; b < nb; b += 8)
            s += part[(int64_t)b * D + col];
    red[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && col < D) {
        float t = red[0][lane];
#pragma unroll
        for (int w = 1; w < 8; w++)
            t += red[w][lane];
        dst[col] += t;
    }
}

/* ---------------------------------------------------------------- v2 kernels */

/* The forward of variant 2 and the backward (layers_variants.h), for the
 * vector layouts with rows in registers (VEC = 8, KV > 0): U rows per lane group per step,
 * every load of the step issued before the first reduction (the forward aims at about 4
 * 16-byte loads in flight per lane, the backward at about 8), the U reductions
 * interleaved (independent shuffles). The backward has instances with and without rstd
 * (no unused sum of squares) and with the residual gradient (loaded with the inputs for
 * short rows); the gated backward keeps sigmoid(gate) between its passes for short rows;
 * the sigmoid is __expf + __fdividef (two MUFU ops). The second pass unpacks with byte
 * permutes (unpack2) and the weight / accumulator accesses are opaque, so that the
 * compiler keeps 4 registers of packed bf16 per 8 elements between the passes instead of
 * 8 of fp32 and does not hoist loop-invariant loads; each instance's register budget is
 * the largest without spills (fwd2_minb / bwd2_minb). Both run on a persistent grid of
 * one wave of resident CTAs (the occupancy, cached in the context's norm slot). */
constexpr int FWD2_THREADS = 256;
constexpr int BWD2_THREADS = 256;

constexpr int clamp_u(int u) { return u < 1 ? 1 : u > 4 ? 4 : u; }

/* The register budget of each instance: __launch_bounds__' minimum CTAs per SM (256
 * threads: 4 -> 64 registers, 3 -> 80, 2 -> 128, 1 -> 255), the largest with which ptxas
 * (CUDA 13.0, sm_90a) compiles the instance without spilling, found by compiling them
 * all at each budget. key: KV, LPR, MODE, RSTD (0 for the forward). */
#ifndef NORM2_MINB_OVERRIDE
constexpr int fwd2_minb(int kv, int lpr, int mode) {
    if (kv == 1 && lpr == 16 && mode == 0)
        return 4;
    if (kv == 1 && lpr == 16 && mode == 1)
        return 4;
    if (kv == 1 && lpr == 16 && mode == 2)
        return 4;
    if (kv == 1 && lpr == 32 && mode == 0)
        return 4;
    if (kv == 1 && lpr == 32 && mode == 1)
        return 4;
    if (kv == 1 && lpr == 32 && mode == 2)
        return 4;
    if (kv == 1 && lpr == 8 && mode == 0)
        return 4;
    if (kv == 1 && lpr == 8 && mode == 1)
        return 4;
    if (kv == 1 && lpr == 8 && mode == 2)
        return 4;
    if (kv == 2 && lpr == 32 && mode == 0)
        return 4;
    if (kv == 2 && lpr == 32 && mode == 1)
        return 4;
    if (kv == 2 && lpr == 32 && mode == 2)
        return 4;
    if (kv == 4 && lpr == 32 && mode == 0)
        return 4;
    if (kv == 4 && lpr == 32 && mode == 1)
        return 4;
    if (kv == 4 && lpr == 32 && mode == 2)
        return 4;
    if (kv == 8 && lpr == 32 && mode == 0)
        return 4;
    if (kv == 8 && lpr == 32 && mode == 1)
        return 3;
    if (kv == 8 && lpr == 32 && mode == 2)
        return 2;
    return 2;
}
constexpr int bwd2_minb(int kv, int lpr, int mode, int rstd) {
    if (kv == 1 && lpr == 16 && mode == 0 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 16 && mode == 0 && rstd == 1)
        return 2;
    if (kv == 1 && lpr == 16 && mode == 1 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 16 && mode == 1 && rstd == 1)
        return 4;
    if (kv == 1 && lpr == 16 && mode == 2 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 16 && mode == 2 && rstd == 1)
        return 3;
    if (kv == 1 && lpr == 32 && mode == 0 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 32 && mode == 0 && rstd == 1)
        return 3;
    if (kv == 1 && lpr == 32 && mode == 1 && rstd == 0)
        return 4;
    if (kv == 1 && lpr == 32 && mode == 1 && rstd == 1)
        return 4;
    if (kv == 1 && lpr == 32 && mode == 2 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 32 && mode == 2 && rstd == 1)
        return 3;
    if (kv == 1 && lpr == 8 && mode == 0 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 8 && mode == 0 && rstd == 1)
        return 3;
    if (kv == 1 && lpr == 8 && mode == 1 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 8 && mode == 1 && rstd == 1)
        return 4;
    if (kv == 1 && lpr == 8 && mode == 2 && rstd == 0)
        return 3;
    if (kv == 1 && lpr == 8 && mode == 2 && rstd == 1)
        return 3;
    if (kv == 2 && lpr == 32 && mode == 0 && rstd == 0)
        return 3;
    if (kv == 2 && lpr == 32 && mode == 0 && rstd == 1)
        return 3;
    if (kv == 2 && lpr == 32 && mode == 1 && rstd == 0)
        return 4;
    if (kv == 2 && lpr == 32 && mode == 1 && rstd == 1)
        return 4;
    if (kv == 2 && lpr == 32 && mode == 2 && rstd == 0)
        return 3;
    if (kv == 2 && lpr == 32 && mode == 2 && rstd == 1)
        return 3;
    if (kv == 4 && lpr == 32 && mode == 0 && rstd == 0)
        return 3;
    if (kv == 4 && lpr == 32 && mode == 0 && rstd == 1)
        return 3;
    if (kv == 4 && lpr == 32 && mode == 1 && rstd == 0)
        return 3;
    if (kv == 4 && lpr == 32 && mode == 1 && rstd == 1)
        return 3;
    if (kv == 4 && lpr == 32 && mode == 2 && rstd == 0)
        return 2;
    if (kv == 4 && lpr == 32 && mode == 2 && rstd == 1)
        return 2;
    if (kv == 8 && lpr == 32 && mode == 0 && rstd == 0)
        return 2;
    if (kv == 8 && lpr == 32 && mode == 0 && rstd == 1)
        return 2;
    if (kv == 8 && lpr == 32 && mode == 1 && rstd == 0)
        return 2;
    if (kv == 8 && lpr == 32 && mode == 1 && rstd == 1)
        return 2;
    if (kv == 8 && lpr == 32 && mode == 2 && rstd == 0)
        return 2;
    if (kv == 8 && lpr == 32 && mode == 2 && rstd == 1)
        return 2;
    return 2;
}
#else
constexpr int fwd2_minb(int, int, int) { return NORM2_MINB_OVERRIDE; }
constexpr int bwd2_minb(int, int, int, int) { return NORM2_MINB_OVERRIDE; }
#endif

/* MODE as norm_fwd: 0 plain, 1 residual add, 2 gated. About 4 16-byte loads in flight
 * per lane (as the first kernels at D = 1024): U > 1 only for rows of under 4 vectors
 * per lane. */
template <int KV, int LPR, int MODE> struct F2 {
    static constexpr int S = MODE == 0 ? 1 : 2; /* input streams */
    static constexpr int U = clamp_u(4 / (KV * S));
    static constexpr int MINB = fwd2_minb(KV, LPR, MODE);
};

/* Unpack of the second pass over registers: byte permutes instead of the first pass's
 * shift / and, so that neither the front end nor ptxas merges the two unpacks of one
 * value and keeps the fp32 values of the first pass (8 registers per 8 elements) live
 * instead of the packed bf16 ones (4). */
__device__ __forceinline__ void unpack2(const uint4 &v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(__byte_perm(w[i], 0u, 0x1044));
        f[2 * i + 1] = __uint_as_float(__byte_perm(w[i], 0u, 0x3244));
    }
}

/* Shared-memory float4 read / write of the accumulator rows, opaque to the compiler so
 * that it does not hoist the reads of every vector to the top of the pass (registers). */
__device__ __forceinline__ float4 lds4(const float *p) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"((unsigned)__cvta_generic_to_shared(p))
                 : "memory");
    return v;
}
__device__ __forceinline__ void sts4(float *p, const float4 &v) {
    asm volatile(
        "st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"((unsigned)__cvta_generic_to_shared(p)),
        "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
        : "memory");
}

__device__ __forceinline__ float sigmoid_fast(float x) {
    return __fdividef(1.0f, 1.0f + __expf(-x));
}

/* The weight vector v (ones without a weight), loaded where it is used: an opaque load,
 * so that the compiler does not hoist the loop-invariant loads out of the row loop and
 * hold KV * 8 fp32 weights in registers (they come from L1 at every use instead). */
__device__ __forceinline__ void load_w8(const __nv_bfloat16 *w, int v, float (&f)[8]) {
    if (w) {
        uint4 q;
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                     : "l"(reinterpret_cast<const uint4 *>(w) + v));
        unpack(q, f);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            f[i] = 1.0f;
    }
}

template <int KV, int LPR, int MODE>
__global__ void __launch_bounds__(FWD2_THREADS, F2<KV, LPR, MODE>::MINB) norm_fwd2(const FwdP p) {
    constexpr bool RES = MODE == 1, GATED = MODE == 2;
    constexpr int U = F2<KV, LPR, MODE>::U, RPW = 32 / LPR, RPS = RPW * U;
    constexpr int NW = FWD2_THREADS / 32;
    const int lane = threadIdx.x & 31, sub = lane % LPR, grp = lane / LPR;
    const int nvec = p.D >> 3;
    const int64_t gw = (int64_t)blockIdx.x * NW + (threadIdx.x >> 5);
    const int64_t nwt = (int64_t)gridDim.x * NW;
    const float invD = 1.0f / (float)p.D;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    for (int64_t base = gw * RPS; base < p.R; base += nwt * RPS) {
        uint4 xr[U][KV], rr[RES ? U : 1][RES ? KV : 1], gr[GATED ? U : 1][GATED ? KV : 1];
        /* every load of the step first; x and residual with plain loads (h may alias
         * them), the gate through the read-only path */
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPW + grp;
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                const bool in = row < p.R && v < nvec;
                const int64_t e = row * p.D + (int64_t)v * 8;
                xr[u][k] = in ? *reinterpret_cast<const uint4 *>(p.x + e) : z;
                if constexpr (RES)
                    rr[u][k] = in ? *reinterpret_cast<const uint4 *>(p.res + e) : z;
                if constexpr (GATED)
                    gr[u][k] = in ? __ldg(reinterpret_cast<const uint4 *>(p.gate + e)) : z;
            }
        }
        float ss[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPW + grp;
            ss[u] = 0.0f;
#pragma unroll
            for (int k = 0; k < KV; k++) {
                float f[8];
                unpack(xr[u][k], f);
                if constexpr (RES) {
                    const int v = k * LPR + sub;
                    float r[8];
                    unpack(rr[u][k], r);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        f[i] += r[i];
                    pack(f, xr[u][k]);
                    unpack(xr[u][k], f); /* the statistic of the stored bf16 h */
                    if (row < p.R && v < nvec)
                        *reinterpret_cast<uint4 *>(p.h + row * p.D + (int64_t)v * 8) = xr[u][k];
                }
#pragma unroll
                for (int i = 0; i < 8; i++)
                    ss[u] += f[i] * f[i];
            }
        }
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < U; u++)
                ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
        float rs[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPW + grp;
            rs[u] = rsqrtf(ss[u] * invD + p.eps);
            if (sub == 0 && row < p.R && p.rstd)
                p.rstd[row] = rs[u];
        }
#pragma unroll
        for (int k = 0; k < KV; k++) {
            const int v = k * LPR + sub;
            if (v >= nvec)
                continue;
            float w[8];
            load_w8(p.w, v, w);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t row = base + u * RPW + grp;
                if (row >= p.R)
                    continue;
                float f[8];
                unpack2(xr[u][k], f);
                if constexpr (GATED) {
                    float g[8];
                    unpack2(gr[u][k], g);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        f[i] = f[i] * rs[u] * w[i] * sigmoid_fast(g[i]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        f[i] = f[i] * rs[u] * w[i];
                }
                uint4 o;
                pack(f, o);
                *reinterpret_cast<uint4 *>(p.y + row * p.D + (int64_t)v * 8) = o;
            }
        }
    }
}

/* MODE: 0 plain, 1 plain with the residual gradient (dres), 2 gated. About 8 16-byte
 * loads in flight per lane. */
template <int KV, int LPR, int MODE, bool RSTD> struct B2 {
    static constexpr int S = MODE == 0 ? 2 : 3; /* input streams */
    static constexpr int U = clamp_u(8 / (KV * S));
    /* keep sigmoid(gate) in registers between the passes (else recomputed) */
    static constexpr bool KEEP_S = MODE == 2 && KV * U <= 2;
    /* load dres with the inputs (else at its use) */
    static constexpr bool DRES_EARLY = MODE == 1 && KV * U <= 2;
    static constexpr int MINB = bwd2_minb(KV, LPR, MODE, RSTD);
};

template <int KV, int LPR, int MODE, bool RSTD>
__global__ void __launch_bounds__(BWD2_THREADS, B2<KV, LPR, MODE, RSTD>::MINB)
    norm_bwd2(const BwdP p) {
    typedef B2<KV, LPR, MODE, RSTD> C;
    constexpr bool GATED = MODE == 2, DRES = MODE == 1;
    constexpr int U = C::U, RPW = 32 / LPR, RPS = RPW * U, NW = BWD2_THREADS / 32;
    constexpr bool KS = C::KEEP_S, DE = C::DRES_EARLY;
    extern __shared__ float4 sacc4[];
    float *const sacc = reinterpret_cast<float *>(sacc4);
    const int lane = threadIdx.x & 31, sub = lane % LPR, grp = lane / LPR, warp = threadIdx.x >> 5;
    const int nvec = p.D >> 3;
    const float invD = 1.0f / (float)p.D;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    float *acc = nullptr;
    if (p.part) {
        const int n4 = NW * RPW * p.Dp / 4;
        for (int i = threadIdx.x; i < n4; i += BWD2_THREADS)
            sacc4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        __syncthreads();
        acc = sacc + (warp * RPW + grp) * p.Dp;
    }
    const int64_t gw = (int64_t)blockIdx.x * NW + warp, nwt = (int64_t)gridDim.x * NW;
    for (int64_t base = gw * RPS; base < p.R; base += nwt * RPS) {
        uint4 xr[U][KV], dr[U][KV], gr[GATED ? U : 1][GATED ? KV : 1];
        uint4 rr[DE ? U : 1][DE ? KV : 1];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPW + grp;
#pragma unroll
            for (int k = 0; k < KV; k++) {
                const int v = k * LPR + sub;
                const bool in = row < p.R && v < nvec;
                const int64_t e = row * p.D + (int64_t)v * 8;
                xr[u][k] = in ? __ldg(reinterpret_cast<const uint4 *>(p.x + e)) : z;
                dr[u][k] = in ? __ldg(reinterpret_cast<const uint4 *>(p.dy + e)) : z;
                if constexpr (GATED)
                    gr[u][k] = in ? __ldg(reinterpret_cast<const uint4 *>(p.gate + e)) : z;
                if constexpr (DE) /* plain loads: dres may alias dx */
                    rr[u][k] = (in && p.dres) ? *reinterpret_cast<const uint4 *>(p.dres + e) : z;
            }
        }
        /* pass 1: dot = sum dy w s x (and sum x^2 without rstd) */
        float dot[U], ss[U];
        float sv[KS ? U : 1][KS ? KV : 1][8];
#pragma unroll
        for (int u = 0; u < U; u++)
            dot[u] = 0.0f, ss[u] = 0.0f;
#pragma unroll
        for (int k = 0; k < KV; k++) {
            const int v = k * LPR + sub;
            float w[8];
            load_w8(v < nvec ? p.w : nullptr, v, w);
#pragma unroll
            for (int u = 0; u < U; u++) {
                float x[8], dy[8];
                unpack(xr[u][k], x);
                unpack(dr[u][k], dy);
                if constexpr (GATED) {
                    float g[8];
                    unpack(gr[u][k], g);
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const float s = sigmoid_fast(g[i]);
                        if constexpr (KS)
                            sv[u][k][i] = s;
                        dot[u] += dy[i] * w[i] * s * x[i];
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        dot[u] += dy[i] * w[i] * x[i];
                }
                if constexpr (!RSTD) {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        ss[u] += x[i] * x[i];
                }
            }
        }
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < U; u++) {
                dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
                if constexpr (!RSTD)
                    ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
            }
        float rs[U], rc[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPW + grp;
            if constexpr (RSTD)
                rs[u] = row < p.R ? __ldg(p.rstd + row) : 0.0f;
            else
                rs[u] = rsqrtf(ss[u] * invD + p.eps);
            rc[u] = rs[u] * (dot[u] * rs[u] * rs[u] * invD); /* rstd * c */
        }
        /* pass 2: dx = rs dy w s - rs c x (+ dres), dgate, the dweight terms */
#pragma unroll
        for (int k = 0; k < KV; k++) {
            const int v = k * LPR + sub;
            if (v >= nvec)
                continue;
            float w[8];
            load_w8(p.w, v, w);
            float4 a0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), a1 = a0;
            float *const ap0 = acc ? acc + ((k * 2) * LPR + sub) * 4 : nullptr;
            float *const ap1 = acc ? acc + ((k * 2 + 1) * LPR + sub) * 4 : nullptr;
            if (acc)
                a0 = lds4(ap0), a1 = lds4(ap1);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t row = base + u * RPW + grp;
                if (row >= p.R)
                    continue;
                const int64_t e = row * p.D + (int64_t)v * 8;
                float x[8], dy[8], s[8];
                unpack2(xr[u][k], x);
                unpack2(dr[u][k], dy);
                if constexpr (GATED) {
                    if constexpr (KS) {
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            s[i] = sv[u][k][i];
                    } else {
                        float g[8];
                        unpack2(gr[u][k], g);
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            s[i] = sigmoid_fast(g[i]);
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        s[i] = 1.0f;
                }
                float dxv[8], t[8];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float ds = dy[i] * s[i];
                    dxv[i] = rs[u] * (ds * w[i]) - rc[u] * x[i];
                    t[i] = ds * x[i] * rs[u]; /* the dweight term dy s xh */
                }
                a0.x += t[0], a0.y += t[1], a0.z += t[2], a0.w += t[3];
                a1.x += t[4], a1.y += t[5], a1.z += t[6], a1.w += t[7];
                if (p.dx) {
                    if constexpr (DRES) {
                        if (p.dres) {
                            float r[8];
                            if constexpr (DE)
                                unpack2(rr[u][k], r);
                            else
                                unpack(*reinterpret_cast<const uint4 *>(p.dres + e), r);
#pragma unroll
                            for (int i = 0; i < 8; i++)
                                dxv[i] += r[i];
                        }
                    }
                    uint4 o;
                    pack(dxv, o);
                    *reinterpret_cast<uint4 *>(p.dx + e) = o;
                }
                if constexpr (GATED) {
                    if (p.dgate) {
                        float dg[8];
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            dg[i] = t[i] * w[i] * (1.0f - s[i]);
                        uint4 o;
                        pack(dg, o);
                        *reinterpret_cast<uint4 *>(p.dgate + e) = o;
                    }
                }
            }
            if (acc) {
                sts4(ap0, a0);
                sts4(ap1, a1);
            }
        }
    }
    if (p.part) {
        /* this CTA's accumulator rows, summed in slot order, 4 columns per thread */
        __syncthreads();
        const int nslots = NW * RPW;
        for (int c4 = threadIdx.x; c4 < (p.D >> 2); c4 += BWD2_THREADS) {
            const int o = acc_off_col<8, LPR>(c4 * 4);
            float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int sl = 0; sl < nslots; sl++) {
                const float4 a = *reinterpret_cast<const float4 *>(sacc + sl * p.Dp + o);
                s.x += a.x, s.y += a.y, s.z += a.z, s.w += a.w;
            }
            reinterpret_cast<float4 *>(p.part + (int64_t)blockIdx.x * p.D)[c4] = s;
        }
    }
}

/* dst[col] += sum_{b < nb} part[b, col], in a fixed order: warp w of 32 sums the rows
 * b = w, w + 32, ... (8 loads in flight), then the 32 warp sums are added in warp
 * order. */
__global__ void __launch_bounds__(1024)
    colsum2_add(const float *__restrict__ part, int nb, int D, float *__restrict__ dst) {
    __shared__ float red[32][33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (col < D) {
        for (int b0 = warp; b0 < nb; b0 += 8 * 32) {
            float t[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int b = b0 + 32 * j;
                t[j] = b < nb ? __ldg(part + (int64_t)b * D + col) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                s += t[j];
        }
    }
    red[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && col < D) {
        float t = red[0][lane];
        for (int w = 1; w < 32; w++)
            t += red[w][lane];
        dst[col] += t;
    }
}


/* Backward variant 2, for plain and residual rows of D = 8 TPR elements (TPR = 256, 128,
 * 64 or 32 threads per row: D = 2048 ... 256): the CTA's 256 threads cover RPC = 256 / TPR
 * rows side by side, thread t the 8 columns (t % TPR) * 8 of its row, U rows deep. A
 * thread's columns never change, so its share of the weight gradient stays in 8 fp32
 * registers and its weights in 8 more: no shared accumulator rows (which cap the first
 * design at 2 CTAs of 8 warps per SM at D = 2048), far fewer registers per thread, and so
 * more warps with loads in flight. The price: a row's dot product spans TPR / 32 warps,
 * summed through shared memory (double-buffered, one __syncthreads per U rows) in warp
 * order. At the end the RPC row groups' gradients are summed in group order into this
 * CTA's row of partials; colsum2_add adds the partials in CTA order (deterministic). */
constexpr int BWD3_THREADS = 256;

/* U rows deep, MINB CTAs per SM (the register budget: 4 -> 64, 3 -> 80, 2 -> 128) */
template <int TPR, int MODE, bool RSTD, int U, int MINB>
__global__ void __launch_bounds__(BWD3_THREADS, MINB) norm_bwd3(const BwdP p) {
    constexpr int RPC = BWD3_THREADS / TPR, WPR = TPR / 32, NW = BWD3_THREADS / 32;
    constexpr bool DRES = MODE == 1;
    __shared__ float red[2][U][NW][2]; /* per warp: dot, sum x^2 */
    extern __shared__ float4 sacc4[];  /* [RPC, D] gradient rows of the row groups */
    const int t = threadIdx.x, rg = t / TPR, v = t % TPR, warp = t >> 5, lane = t & 31;
    const float invD = 1.0f / (float)p.D;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    float w[8], acc[8];
    load_w8(p.w, v, w);
#pragma unroll
    for (int i = 0; i < 8; i++)
        acc[i] = 0.0f;
    int buf = 0;
    for (int64_t base = (int64_t)blockIdx.x * RPC * U; base < p.R;
         base += (int64_t)gridDim.x * RPC * U, buf ^= 1) {
        uint4 xr[U], dr[U], rr[DRES ? U : 1];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPC + rg;
            const bool in = row < p.R;
            const int64_t e = row * p.D + (int64_t)v * 8;
            xr[u] = in ? __ldg(reinterpret_cast<const uint4 *>(p.x + e)) : z;
            dr[u] = in ? __ldg(reinterpret_cast<const uint4 *>(p.dy + e)) : z;
            if constexpr (DRES) /* plain loads: dres may alias dx */
                rr[u] = (in && p.dres) ? *reinterpret_cast<const uint4 *>(p.dres + e) : z;
        }
        float dot[U], ss[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[8], dy[8];
            unpack(xr[u], x);
            unpack(dr[u], dy);
            dot[u] = 0.0f, ss[u] = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                dot[u] += dy[i] * w[i] * x[i];
                if constexpr (!RSTD)
                    ss[u] += x[i] * x[i];
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < U; u++) {
                dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
                if constexpr (!RSTD)
                    ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
            }
        if constexpr (WPR > 1) {
            if (lane == 0)
#pragma unroll
                for (int u = 0; u < U; u++)
                    red[buf][u][warp][0] = dot[u], red[buf][u][warp][1] = ss[u];
            __syncthreads();
            const int w0 = rg * WPR;
#pragma unroll
            for (int u = 0; u < U; u++) {
                float a = red[buf][u][w0][0], b = red[buf][u][w0][1];
#pragma unroll
                for (int j = 1; j < WPR; j++)
                    a += red[buf][u][w0 + j][0], b += red[buf][u][w0 + j][1];
                dot[u] = a, ss[u] = b;
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t row = base + u * RPC + rg;
            if (row >= p.R)
                continue;
            float rs;
            if constexpr (RSTD)
                rs = __ldg(p.rstd + row);
            else
                rs = rsqrtf(ss[u] * invD + p.eps);
            const float rc = rs * (dot[u] * rs * rs * invD); /* rstd * c */
            float x[8], dy[8], dxv[8];
            unpack2(xr[u], x);
            unpack2(dr[u], dy);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                dxv[i] = rs * (dy[i] * w[i]) - rc * x[i];
                acc[i] += dy[i] * x[i] * rs; /* the dweight term dy xh */
            }
            if (p.dx) {
                const int64_t e = row * p.D + (int64_t)v * 8;
                if constexpr (DRES) {
                    if (p.dres) {
                        float r[8];
                        unpack2(rr[u], r);
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            dxv[i] += r[i];
                    }
                }
                uint4 o;
                pack(dxv, o);
                *reinterpret_cast<uint4 *>(p.dx + e) = o;
            }
        }
    }
    if (p.part) {
        float *const sacc = reinterpret_cast<float *>(sacc4);
        if constexpr (RPC == 1) {
            float4 *dst = reinterpret_cast<float4 *>(p.part + (int64_t)blockIdx.x * p.D + v * 8);
            dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        } else {
            float4 *mine = reinterpret_cast<float4 *>(sacc + rg * p.D + v * 8);
            mine[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            mine[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
            __syncthreads();
            for (int c = t; c < p.D; c += BWD3_THREADS) {
                float s = sacc[c];
#pragma unroll
                for (int g = 1; g < RPC; g++)
                    s += sacc[g * p.D + c];
                p.part[(int64_t)blockIdx.x * p.D + c] = s;
            }
        }
    }
}

/* ---------------------------------------------------------------- dispatch */

struct Layout {
    int vec, lpr, kv; /* kv = 0: re-read rows */
};

bool al16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

Layout choose_layout(int D, bool aligned) {
    if (D % 8 != 0 || !aligned)
        return Layout{1, 32, 0};
    const int nvec = D / 8;
    const int lpr = nvec <= 8 ? 8 : nvec <= 16 ? 16 : 32;
    const int kv = (nvec + lpr - 1) / lpr;
    return Layout{8, lpr, kv <= 1 ? 1 : kv <= 2 ? 2 : kv <= 4 ? 4 : kv <= 8 ? 8 : 0};
}

typedef void (*FwdK)(FwdP);
typedef void (*BwdK)(BwdP);

template <int MODE> FwdK pick_fwd_m(Layout l) {
    if (l.vec == 1)
        return norm_fwd<1, 0, 32, MODE>;
    if (l.lpr == 8)
        return norm_fwd<8, 1, 8, MODE>;
    if (l.lpr == 16)
        return norm_fwd<8, 1, 16, MODE>;
    switch (l.kv) {
    case 1:
        return norm_fwd<8, 1, 32, MODE>;
    case 2:
        return norm_fwd<8, 2, 32, MODE>;
    case 4:
        return norm_fwd<8, 4, 32, MODE>;
    case 8:
        return norm_fwd<8, 8, 32, MODE>;
    default:
        return norm_fwd<8, 0, 32, MODE>;
    }
}

FwdK pick_fwd(Layout l, const FwdP &p) {
    return p.gate ? pick_fwd_m<2>(l) : p.res ? pick_fwd_m<1>(l) : pick_fwd_m<0>(l);
}

/* The first backward kernels run only the layouts norm_bwd2 does not cover (run_bwd):
 * scalar rows and re-read rows (D > 2048), both of 32 lanes. */
template <bool G> BwdK pick_bwd_g(Layout l) {
    return l.vec == 1 ? norm_bwd<1, 0, 32, G> : norm_bwd<8, 0, 32, G>;
}

BwdK pick_bwd(Layout l, const BwdP &p) {
    return p.gate ? pick_bwd_g<true>(l) : pick_bwd_g<false>(l);
}

lm_status check_common(const char *op, int64_t N, int H, int D, float eps, lm_error *err) {
    if (N < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be >= 0", op, (long long)N);
    if (H < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: H = %d must be >= 1", op, H);
    if (D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: %s = %d must be >= 1", op, H > 1 ? "Dh" : "D",
                         D);
    if ((double)N * H * D > 4.0e18)
        return lm_errorf(err, LM_ERR_INVALID, "%s: problem too large (N*H*D = %.3g)", op,
                         (double)N * H * D);
    if (!(eps > 0.0f) || !isfinite(eps))
        return lm_errorf(err, LM_ERR_INVALID, "%s: eps = %g must be finite and > 0", op,
                         (double)eps);
    return LM_OK;
}

lm_status launch_bwd(lm_cuda_ctx *ctx, const char *op, BwdP p, bool aligned, float *dweight,
                     lm_error *err) {
    if (p.R == 0 || (!p.dx && !p.dgate && !dweight))
        return LM_OK;
    const Layout l = choose_layout(p.D, aligned);
    if (l.kv != 0) /* run_bwd sends these layouts to norm_bwd2 */
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s on cuda: internal error: D = %d has no first-kernel instance", op,
                         p.D);
    const BwdK k = pick_bwd(l, p);
    const int nvec = p.D / l.vec;
    p.Dp = ((nvec + l.lpr - 1) / l.lpr) * l.lpr * l.vec;
    const int rpw = 32 / l.lpr;
    int optin = 0;
    LM_CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
    int nw = BWD_WARPS_MAX;
    size_t smem = 0;
    if (dweight) {
        while (nw > 1 && (size_t)nw * rpw * p.Dp * sizeof(float) > (size_t)optin)
            nw /= 2;
        smem = (size_t)nw * rpw * p.Dp * sizeof(float);
        if (smem > (size_t)optin)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "%s on cuda: D = %d is too long for the weight-gradient "
                             "accumulator (%zu bytes of shared memory, the device has %d)",
                             op, p.D, smem, optin);
        if (smem > 48 * 1024 && lm_cuda_ctx_first_use(ctx, (const void *)k))
            LM_CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    }
    const int threads = nw * 32;
    int per_sm = 0;
    LM_CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem));
    if (per_sm < 1)
        per_sm = 1;
    const int64_t rows_per_cta = (int64_t)nw * rpw;
    int64_t grid = (p.R + rows_per_cta - 1) / rows_per_cta;
    const int64_t cap = (int64_t)ctx->sm_count * per_sm;
    if (grid > cap)
        grid = cap;
    p.part = nullptr;
    if (dweight) {
        void *s = nullptr;
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, (size_t)grid * p.D * sizeof(float), &s, err));
        p.part = (float *)s;
    }
    k<<<(unsigned)grid, threads, smem, ctx->stream>>>(p);
    LM_CK_LAUNCH("norm_bwd");
    if (dweight) {
        colsum_add<<<(p.D + 31) / 32, 256, 0, ctx->stream>>>(p.part, (int)grid, p.D, dweight);
        LM_CK_LAUNCH("norm colsum_add");
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- v2 dispatch */

/* Per-context cache of what the v2 launchers ask the runtime on every call otherwise
 * (each query is host time between the caller's launches). */
struct NormState {
    struct Occ {
        const void *k;
        int threads;
        size_t smem;
        int per_sm;
    };
    Occ occ[96];
    int n_occ = 0;
    int optin = -1; /* max dynamic shared memory per CTA (opt-in) */
};

/* Resident CTAs per SM of kernel k with `threads` threads and `smem` dynamic bytes. */
lm_status occupancy(lm_cuda_ctx *ctx, const void *k, int threads, size_t smem, int *per_sm,
                    lm_error *err) {
    NormState *s = lm_cuda_ctx_get<NormState>(ctx, LM_SLOT_NORM);
    for (int i = 0; i < s->n_occ; i++)
        if (s->occ[i].k == k && s->occ[i].threads == threads && s->occ[i].smem == smem) {
            *per_sm = s->occ[i].per_sm;
            return LM_OK;
        }
    int b = 0;
    LM_CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, threads, smem));
    if (b < 1)
        b = 1;
    if (s->n_occ < (int)(sizeof s->occ / sizeof s->occ[0]))
        s->occ[s->n_occ++] = NormState::Occ{k, threads, smem, b};
    *per_sm = b;
    return LM_OK;
}

lm_status smem_optin(lm_cuda_ctx *ctx, int *optin, lm_error *err) {
    NormState *s = lm_cuda_ctx_get<NormState>(ctx, LM_SLOT_NORM);
    if (s->optin < 0)
        LM_CK(cudaDeviceGetAttribute(&s->optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                     ctx->device));
    *optin = s->optin;
    return LM_OK;
}

/* v2 covers the vector layouts with rows in registers */
bool v2_covers(Layout l) { return l.vec == 8 && l.kv > 0; }

template <int MODE> FwdK pick_fwd2_m(Layout l) {
    if (l.lpr == 8)
        return norm_fwd2<1, 8, MODE>;
    if (l.lpr == 16)
        return norm_fwd2<1, 16, MODE>;
    switch (l.kv) {
    case 1:
        return norm_fwd2<1, 32, MODE>;
    case 2:
        return norm_fwd2<2, 32, MODE>;
    case 4:
        return norm_fwd2<4, 32, MODE>;
    default:
        return norm_fwd2<8, 32, MODE>;
    }
}

/* Rows per warp step of the v2 forward (RPW * U). */
template <int MODE> int fwd2_rps_m(Layout l) {
    const int rpw = 32 / l.lpr;
    switch (l.kv) {
    case 1:
        return rpw * F2<1, 32, MODE>::U;
    case 2:
        return rpw * F2<2, 32, MODE>::U;
    case 4:
        return rpw * F2<4, 32, MODE>::U;
    default:
        return rpw * F2<8, 32, MODE>::U;
    }
}

lm_status launch_fwd2(lm_cuda_ctx *ctx, const FwdP &p, Layout l, lm_error *err) {
    const int mode = p.gate ? 2 : p.res ? 1 : 0;
    const FwdK k = mode == 2   ? pick_fwd2_m<2>(l)
                   : mode == 1 ? pick_fwd2_m<1>(l)
                               : pick_fwd2_m<0>(l);
    const int rps = mode == 2 ? fwd2_rps_m<2>(l) : mode == 1 ? fwd2_rps_m<1>(l) : fwd2_rps_m<0>(l);
    const int64_t rows_per_cta = (int64_t)(FWD2_THREADS / 32) * rps;
    int64_t grid = (p.R + rows_per_cta - 1) / rows_per_cta;
    int per_sm = 1;
    LM_TRY(occupancy(ctx, (const void *)k, FWD2_THREADS, 0, &per_sm, err));
    const int64_t cap = (int64_t)ctx->sm_count * per_sm;
    if (grid > cap)
        grid = cap;
    k<<<(unsigned)grid, FWD2_THREADS, 0, ctx->stream>>>(p);
    LM_CK_LAUNCH("norm_fwd2");
    return LM_OK;
}

template <int MODE, bool RSTD> BwdK pick_bwd2_m(Layout l) {
    if (l.lpr == 8)
        return norm_bwd2<1, 8, MODE, RSTD>;
    if (l.lpr == 16)
        return norm_bwd2<1, 16, MODE, RSTD>;
    switch (l.kv) {
    case 1:
        return norm_bwd2<1, 32, MODE, RSTD>;
    case 2:
        return norm_bwd2<2, 32, MODE, RSTD>;
    case 4:
        return norm_bwd2<4, 32, MODE, RSTD>;
    default:
        return norm_bwd2<8, 32, MODE, RSTD>;
    }
}

template <int MODE> BwdK pick_bwd2_r(Layout l, bool rstd) {
    return rstd ? pick_bwd2_m<MODE, true>(l) : pick_bwd2_m<MODE, false>(l);
}

template <int MODE> int bwd2_rps_m(Layout l) {
    const int rpw = 32 / l.lpr;
    switch (l.kv) {
    case 1:
        return rpw * B2<1, 32, MODE, true>::U;
    case 2:
        return rpw * B2<2, 32, MODE, true>::U;
    case 4:
        return rpw * B2<4, 32, MODE, true>::U;
    default:
        return rpw * B2<8, 32, MODE, true>::U;
    }
}

lm_status launch_bwd2(lm_cuda_ctx *ctx, BwdP p, Layout l, float *dweight, lm_error *err) {
    const int mode = p.gate ? 2 : p.dres ? 1 : 0;
    const bool rstd = p.rstd != nullptr;
    const BwdK k = mode == 2   ? pick_bwd2_r<2>(l, rstd)
                   : mode == 1 ? pick_bwd2_r<1>(l, rstd)
                               : pick_bwd2_r<0>(l, rstd);
    const int rps = mode == 2 ? bwd2_rps_m<2>(l) : mode == 1 ? bwd2_rps_m<1>(l) : bwd2_rps_m<0>(l);
    const int nvec = p.D / 8;
    p.Dp = ((nvec + l.lpr - 1) / l.lpr) * l.lpr * 8;
    const int nslots = (BWD2_THREADS / 32) * (32 / l.lpr);
    /* rows in registers means D <= 2048: at most 8 slots of 2048 floats (64 KiB) */
    const size_t smem = dweight ? (size_t)nslots * p.Dp * sizeof(float) : 0;
    if (smem > 48 * 1024) {
        int optin = 0;
        LM_TRY(smem_optin(ctx, &optin, err));
        if (smem > (size_t)optin) /* not on sm_90 (227 KiB); kept as a guard */
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "rmsnorm backward on cuda: D = %d needs %zu bytes of shared memory "
                             "(the device has %d)",
                             p.D, smem, optin);
        if (lm_cuda_ctx_first_use(ctx, (const void *)k))
            LM_CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    }
    int per_sm = 1;
    LM_TRY(occupancy(ctx, (const void *)k, BWD2_THREADS, smem, &per_sm, err));
    const int64_t rows_per_cta = (int64_t)(BWD2_THREADS / 32) * rps;
    int64_t grid = (p.R + rows_per_cta - 1) / rows_per_cta;
    const int64_t cap = (int64_t)ctx->sm_count * per_sm;
    if (grid > cap)
        grid = cap;
    p.part = nullptr;
    if (dweight) {
        void *s = nullptr;
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, (size_t)grid * p.D * sizeof(float), &s, err));
        p.part = (float *)s;
    }
    k<<<(unsigned)grid, BWD2_THREADS, smem, ctx->stream>>>(p);
    LM_CK_LAUNCH("norm_bwd2");
    if (dweight) {
        colsum2_add<<<(p.D + 31) / 32, 1024, 0, ctx->stream>>>(p.part, (int)grid, p.D, dweight);
        LM_CK_LAUNCH("norm colsum2_add");
    }
    return LM_OK;
}

lm_status check_variant(const char *op, int variant, int count, lm_error *err) {
    if (variant < 0 || variant > count)
        return lm_errorf(err, LM_ERR_INVALID, "%s: variant = %d is outside [0, %d]", op, variant,
                         count);
    return LM_OK;
}

/* The first forward kernels: one row-group step per warp (uncapped: variant 1), or one
 * wave of resident CTAs (persistent: the fallback of variant 2 for the layouts norm_fwd2
 * does not cover). */
lm_status launch_fwd_grid(lm_cuda_ctx *ctx, const FwdP &p, bool aligned, bool persistent,
                          lm_error *err) {
    const Layout l = choose_layout(p.D, aligned);
    const FwdK k = pick_fwd(l, p);
    const int64_t rows_per_cta = (int64_t)(FWD_THREADS / 32) * (32 / l.lpr);
    int64_t grid = (p.R + rows_per_cta - 1) / rows_per_cta;
    int64_t cap = 0x7fffffff; /* the grid-stride loop covers the rest */
    if (persistent) {
        int per_sm = 1;
        LM_TRY(occupancy(ctx, (const void *)k, FWD_THREADS, 0, &per_sm, err));
        cap = (int64_t)ctx->sm_count * per_sm;
    }
    if (grid > cap)
        grid = cap;
    k<<<(unsigned)grid, FWD_THREADS, 0, ctx->stream>>>(p);
    LM_CK_LAUNCH("norm_fwd");
    return LM_OK;
}

/* Forward of any variant (0 = the default: layers_variants.h). */
lm_status run_fwd(lm_cuda_ctx *ctx, int variant, const FwdP &p, bool aligned, lm_error *err) {
    if (p.R == 0)
        return LM_OK;
    const Layout l = choose_layout(p.D, aligned);
    if (variant == 0)
        variant = (p.gate || l.lpr < 32) ? LM_LAYERS_NORM_FWD_DEFAULT_SHORT
                                         : LM_LAYERS_NORM_FWD_DEFAULT_LONG;
    if (variant == 1)
        return launch_fwd_grid(ctx, p, aligned, false, err);
    if (!v2_covers(l))
        return launch_fwd_grid(ctx, p, aligned, true, err);
    return launch_fwd2(ctx, p, l, err);
}

/* Backward variant 2 (norm_bwd3): plain and residual rows of 256 <= D <= 2048 elements,
 * D / 8 a power of two, 16-byte aligned, with the forward's rstd. Without it the row
 * statistic must be recomputed in the forward's summation order (so that a backward with
 * and one without rstd give the same bits: tests/backend_ops/norm.c "dw rerun"), which
 * norm_bwd2's lane layout reproduces and this one does not: variant 1 runs it. */
bool v3_covers(const BwdP &p, bool aligned) {
    const int nvec = p.D / 8;
    return aligned && !p.gate && p.rstd && p.D % 8 == 0 &&
           (nvec == 32 || nvec == 64 || nvec == 128 || nvec == 256);
}

template <int MODE, bool RSTD, int U, int MINB> BwdK pick_bwd3_m(int nvec) {
    switch (nvec) {
    case 32:
        return norm_bwd3<32, MODE, RSTD, U, MINB>;
    case 64:
        return norm_bwd3<64, MODE, RSTD, U, MINB>;
    case 128:
        return norm_bwd3<128, MODE, RSTD, U, MINB>;
    default:
        return norm_bwd3<256, MODE, RSTD, U, MINB>;
    }
}

/* 2 rows deep, 4 CTAs per SM (64 registers): as fast as 3 rows / 3 CTAs and faster than
 * 4 rows / 2 CTAs at D = 1024 and 2048 (dev/layers_variants.md) */
constexpr int BWD3_U = 2, BWD3_MINB = 4;

lm_status launch_bwd3(lm_cuda_ctx *ctx, BwdP p, float *dweight, lm_error *err) {
    const int nvec = p.D / 8, rpc = BWD3_THREADS / nvec, U = BWD3_U;
    const BwdK k = p.dres ? pick_bwd3_m<1, true, BWD3_U, BWD3_MINB>(nvec)
                          : pick_bwd3_m<0, true, BWD3_U, BWD3_MINB>(nvec);
    const size_t smem = (dweight && rpc > 1) ? (size_t)rpc * p.D * sizeof(float) : 0;
    int per_sm = 1;
    LM_TRY(occupancy(ctx, (const void *)k, BWD3_THREADS, smem, &per_sm, err));
    const int64_t rows_per_cta = (int64_t)rpc * U;
    int64_t grid = (p.R + rows_per_cta - 1) / rows_per_cta;
    const int64_t cap = (int64_t)ctx->sm_count * per_sm;
    if (grid > cap)
        grid = cap;
    p.part = nullptr;
    p.Dp = p.D;
    if (dweight) {
        void *s = nullptr;
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, (size_t)grid * p.D * sizeof(float), &s, err));
        p.part = (float *)s;
    }
    k<<<(unsigned)grid, BWD3_THREADS, smem, ctx->stream>>>(p);
    LM_CK_LAUNCH("norm_bwd3");
    if (dweight) {
        colsum2_add<<<(p.D + 31) / 32, 1024, 0, ctx->stream>>>(p.part, (int)grid, p.D, dweight);
        LM_CK_LAUNCH("norm colsum2_add");
    }
    return LM_OK;
}

lm_status run_bwd(lm_cuda_ctx *ctx, int variant, const char *op, const BwdP &p, bool aligned,
                  float *dweight, lm_error *err) {
    if (p.R == 0 || (!p.dx && !p.dgate && !dweight))
        return LM_OK;
    const int v = variant == 0 ? LM_LAYERS_NORM_BWD_DEFAULT : variant;
    if (v == 2 && v3_covers(p, aligned))
        return launch_bwd3(ctx, p, dweight, err);
    const Layout l = choose_layout(p.D, aligned);
    if (!v2_covers(l))
        return launch_bwd(ctx, op, p, aligned, dweight, err);
    return launch_bwd2(ctx, p, l, dweight, err);
}

} // namespace

extern "C" lm_status lm_cuda_rmsnorm_forward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int D,
                                               float eps, const void *x, const void *residual,
                                               const void *weight, void *h, void *y, float *rstd,
                                               lm_error *err) {
    const char *op = "rmsnorm";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_variant(op, variant, LM_LAYERS_NORM_FWD_VARIANTS, err));
    LM_TRY(check_common(op, N, 1, D, eps, err));
    if (N == 0)
        return LM_OK;
    if (!x || !y)
        return lm_errorf(err, LM_ERR_INVALID, "%s: '%s' is required", op, !x ? "x" : "y");
    if (residual && !h)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: output 'h' (= x + residual) is required with 'residual'", op);
    if (y == x || (residual && (y == residual || y == h)))
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' must not alias x, residual or h", op);
    FwdP p;
    p.x = (const __nv_bfloat16 *)x;
    p.res = (const __nv_bfloat16 *)residual;
    p.w = (const __nv_bfloat16 *)weight;
    p.gate = nullptr;
    p.h = residual ? (__nv_bfloat16 *)h : nullptr;
    p.y = (__nv_bfloat16 *)y;
    p.rstd = rstd;
    p.R = N;
    p.D = D;
    p.eps = eps;
    const bool al = al16(x) && al16(residual) && al16(weight) && al16(p.h) && al16(y);
    return run_fwd(ctx, variant, p, al, err);
}

extern "C" lm_status lm_cuda_rmsnorm_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int D,
                                                float eps, const void *x, const void *weight,
                                                const float *rstd, const void *dy,
                                                const void *dresidual, void *dx, float *dweight,
                                                lm_error *err) {
    const char *op = "rmsnorm backward";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_variant(op, variant, LM_LAYERS_NORM_BWD_VARIANTS, err));
    LM_TRY(check_common(op, N, 1, D, eps, err));
    if (!weight)
        dweight = nullptr;
    if (N == 0 || (!dx && !dweight))
        return LM_OK;
    if (!x || !dy)
        return lm_errorf(err, LM_ERR_INVALID, "%s: '%s' is required", op, !x ? "x" : "dy");
    if (dx && (dx == x || dx == dy))
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dx' must not alias 'x' or 'dy'", op);
    BwdP p;
    p.x = (const __nv_bfloat16 *)x;
    p.gate = nullptr;
    p.w = (const __nv_bfloat16 *)weight;
    p.dy = (const __nv_bfloat16 *)dy;
    p.dres = dx ? (const __nv_bfloat16 *)dresidual : nullptr;
    p.rstd = rstd;
    p.dx = (__nv_bfloat16 *)dx;
    p.dgate = nullptr;
    p.part = nullptr;
    p.R = N;
    p.D = D;
    p.Dp = 0;
    p.eps = eps;
    const bool al = al16(x) && al16(weight) && al16(dy) && al16(p.dres) && al16(dx);
    return run_bwd(ctx, variant, op, p, al, dweight, err);
}

extern "C" lm_status lm_cuda_gated_rmsnorm_forward_v(lm_cuda_ctx *ctx, int variant, int64_t N,
                                                     int H, int Dh, float eps, const void *x,
                                                     const void *gate, const void *weight, void *o,
                                                     float *rstd, lm_error *err) {
    const char *op = "gated_rmsnorm";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_variant(op, variant, LM_LAYERS_NORM_FWD_VARIANTS, err));
    LM_TRY(check_common(op, N, H, Dh, eps, err));
    if (N == 0)
        return LM_OK;
    if (!x || !gate || !o)
        return lm_errorf(err, LM_ERR_INVALID, "%s: '%s' is required", op,
                         !x      ? "x"
                         : !gate ? "gate"
                                 : "o");
    if (o == x || o == gate)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'o' must not alias input '%s'", op,
                         o == x ? "x" : "gate");
    FwdP p;
    p.x = (const __nv_bfloat16 *)x;
    p.res = nullptr;
    p.w = (const __nv_bfloat16 *)weight;
    p.gate = (const __nv_bfloat16 *)gate;
    p.h = nullptr;
    p.y = (__nv_bfloat16 *)o;
    p.rstd = rstd;
    p.R = N * H;
    p.D = Dh;
    p.eps = eps;
    const bool al = al16(x) && al16(gate) && al16(weight) && al16(o);
    return run_fwd(ctx, variant, p, al, err);
}

extern "C" lm_status lm_cuda_gated_rmsnorm_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N,
                                                      int H, int Dh, float eps, const void *x,
                                                      const void *gate, const void *weight,
                                                      const float *rstd, const void *do_, void *dx,
                                                      void *dgate, float *dweight, lm_error *err) {
    const char *op = "gated_rmsnorm backward";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_variant(op, variant, LM_LAYERS_NORM_BWD_VARIANTS, err));
    LM_TRY(check_common(op, N, H, Dh, eps, err));
    if (!weight)
        dweight = nullptr;
    if (N == 0 || (!dx && !dgate && !dweight))
        return LM_OK;
    if (!x || !gate || !do_)
        return lm_errorf(err, LM_ERR_INVALID, "%s: '%s' is required", op,
                         !x      ? "x"
                         : !gate ? "gate"
                                 : "do");
    const void *ins[3] = {x, gate, do_};
    for (int i = 0; i < 3; i++)
        if ((dx && dx == ins[i]) || (dgate && dgate == ins[i]) || (dx && dx == dgate))
            return lm_errorf(err, LM_ERR_INVALID,
                             "%s: outputs 'dx' and 'dgate' must not alias each other or the "
                             "inputs",
                             op);
    BwdP p;
    p.x = (const __nv_bfloat16 *)x;
    p.gate = (const __nv_bfloat16 *)gate;
    p.w = (const __nv_bfloat16 *)weight;
    p.dy = (const __nv_bfloat16 *)do_;
    p.dres = nullptr;
    p.rstd = rstd;
    p.dx = (__nv_bfloat16 *)dx;
    p.dgate = (__nv_bfloat16 *)dgate;
    p.part = nullptr;
    p.R = N * H;
    p.D = Dh;
    p.Dp = 0;
    p.eps = eps;
    const bool al = al16(x) && al16(gate) && al16(weight) && al16(do_) && al16(dx) && al16(dgate);
    return run_bwd(ctx, variant, op, p, al, dweight, err);
}

/* The public entry points: the default variants. */
extern "C" lm_status lm_cuda_rmsnorm_forward(lm_cuda_ctx *ctx, int64_t N, int D, float eps,
                                             const void *x, const void *residual,
                                             const void *weight, void *h, void *y, float *rstd,
                                             lm_error *err) {
    return lm_cuda_rmsnorm_forward_v(ctx, 0, N, D, eps, x, residual, weight, h, y, rstd, err);
}

extern "C" lm_status lm_cuda_rmsnorm_backward(lm_cuda_ctx *ctx, int64_t N, int D, float eps,
                                              const void *x, const void *weight, const float *rstd,
                                              const void *dy, const void *dresidual, void *dx,
                                              float *dweight, lm_error *err) {
    return lm_cuda_rmsnorm_backward_v(ctx, 0, N, D, eps, x, weight, rstd, dy, dresidual, dx,
                                      dweight, err);
}

extern "C" lm_status lm_cuda_gated_rmsnorm_forward(lm_cuda_ctx *ctx, int64_t N, int H, int Dh,
                                                   float eps, const void *x, const void *gate,
                                                   const void *weight, void *o, float *rstd,
                                                   lm_error *err) {
    return lm_cuda_gated_rmsnorm_forward_v(ctx, 0, N, H, Dh, eps, x, gate, weight, o, rstd, err);
}

extern "C" lm_status lm_cuda_gated_rmsnorm_backward(lm_cuda_ctx *ctx, int64_t N, int H, int Dh,
                                                    float eps, const void *x, const void *gate,
                                                    const void *weight, const float *rstd,
                                                    const void *do_, void *dx, void *dgate,
                                                    float *dweight, lm_error *err) {
    return lm_cuda_gated_rmsnorm_backward_v(ctx, 0, N, H, Dh, eps, x, gate, weight, rstd, do_, dx,
                                            dgate, dweight, err);
}
