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
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "linmoe/cuda_layers.h"
#include "ops/cuda/ctx.cuh"

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

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t bf_bits(float f) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ void unpack(const uint4 &v, float (&f)[8]) {
    f[0] = bf_lo(v.x), f[1] = bf_hi(v.x), f[2] = bf_lo(v.y), f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z), f[5] = bf_hi(v.z), f[6] = bf_lo(v.w), f[7] = bf_hi(v.w);
}
__device__ __forceinline__ void unpack(const unsigned short &v, float (&f)[1]) {
    f[0] = __uint_as_float((uint32_t)v << 16);
}
__device__ __forceinline__ void pack(const float (&f)[8], uint4 &v) {
    v.x = bf_bits(f[0]) | (bf_bits(f[1]) << 16);
    v.y = bf_bits(f[2]) | (bf_bits(f[3]) << 16);
    v.z = bf_bits(f[4]) | (bf_bits(f[5]) << 16);
    v.w = bf_bits(f[6]) | (bf_bits(f[7]) << 16);
}
__device__ __forceinline__ void pack(const float (&f)[1], unsigned short &v) {
    v = (unsigned short)bf_bits(f[0]);
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

template <bool G> BwdK pick_bwd_g(Layout l) {
    if (l.vec == 1)
        return norm_bwd<1, 0, 32, G>;
    if (l.lpr == 8)
        return norm_bwd<8, 1, 8, G>;
    if (l.lpr == 16)
        return norm_bwd<8, 1, 16, G>;
    switch (l.kv) {
    case 1:
        return norm_bwd<8, 1, 32, G>;
    case 2:
        return norm_bwd<8, 2, 32, G>;
    case 4:
        return norm_bwd<8, 4, 32, G>;
    case 8:
        return norm_bwd<8, 8, 32, G>;
    default:
        return norm_bwd<8, 0, 32, G>;
    }
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

lm_status launch_fwd(lm_cuda_ctx *ctx, FwdP p, bool aligned, lm_error *err) {
    if (p.R == 0)
        return LM_OK;
    const Layout l = choose_layout(p.D, aligned);
    const int64_t rows_per_cta = (int64_t)(FWD_THREADS / 32) * (32 / l.lpr);
    int64_t grid = (p.R + rows_per_cta - 1) / rows_per_cta;
    const int64_t cap = (int64_t)ctx->sm_count * 8;
    if (grid > cap)
        grid = cap;
    pick_fwd(l, p)<<<(unsigned)grid, FWD_THREADS, 0, ctx->stream>>>(p);
    LM_CK_LAUNCH("norm_fwd");
    return LM_OK;
}

lm_status launch_bwd(lm_cuda_ctx *ctx, const char *op, BwdP p, bool aligned, float *dweight,
                     lm_error *err) {
    if (p.R == 0 || (!p.dx && !p.dgate && !dweight))
        return LM_OK;
    const Layout l = choose_layout(p.D, aligned);
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

} // namespace

extern "C" lm_status lm_cuda_rmsnorm_forward(lm_cuda_ctx *ctx, int64_t N, int D, float eps,
                                             const void *x, const void *residual,
                                             const void *weight, void *h, void *y, float *rstd,
                                             lm_error *err) {
    const char *op = "rmsnorm";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
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
    return launch_fwd(ctx, p, al, err);
}

extern "C" lm_status lm_cuda_rmsnorm_backward(lm_cuda_ctx *ctx, int64_t N, int D, float eps,
                                              const void *x, const void *weight, const float *rstd,
                                              const void *dy, const void *dresidual, void *dx,
                                              float *dweight, lm_error *err) {
    const char *op = "rmsnorm backward";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
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
    return launch_bwd(ctx, op, p, al, dweight, err);
}

extern "C" lm_status lm_cuda_gated_rmsnorm_forward(lm_cuda_ctx *ctx, int64_t N, int H, int Dh,
                                                   float eps, const void *x, const void *gate,
                                                   const void *weight, void *o, float *rstd,
                                                   lm_error *err) {
    const char *op = "gated_rmsnorm";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
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
    return launch_fwd(ctx, p, al, err);
}

extern "C" lm_status lm_cuda_gated_rmsnorm_backward(lm_cuda_ctx *ctx, int64_t N, int H, int Dh,
                                                    float eps, const void *x, const void *gate,
                                                    const void *weight, const float *rstd,
                                                    const void *do_, void *dx, void *dgate,
                                                    float *dweight, lm_error *err) {
    const char *op = "gated_rmsnorm backward";
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
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
    return launch_bwd(ctx, op, p, al, dweight, err);
}
