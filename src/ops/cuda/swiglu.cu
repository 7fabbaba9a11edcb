/* The element-wise SwiGLU step on the GPU (include/linmoe/cuda_layers.h has the
 * contract; the math is that of src/ops/swiglu.c, swiglu_rows and the dg / du loop of
 * the backward, on the same [N, 2F] layout of the two projections).
 *
 * One pass over memory: each thread takes U = 2 items of 8 consecutive columns of one
 * row (a 16-byte load of g and of u, a 16-byte store of h; the backward also loads dh
 * and stores dg, du), issuing all its loads before any math. Items are numbered row by
 * row, so a warp reads contiguous 512-byte runs; the row of an item comes from a 32-bit
 * division when N * F / 8 < 2^32 (always at the model's sizes), else 64-bit. F % 8 != 0
 * or a pointer that is not 16-byte aligned takes the scalar instance (VEC = 1).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "linmoe/cuda_layers.h"
#include "ops/cuda/ctx.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int U = 2; /* items per thread */

template <int VEC> struct Pk;
template <> struct Pk<8> { typedef uint4 T; };
template <> struct Pk<1> { typedef unsigned short T; };

__device__ __forceinline__ uint32_t bf_bits(float f) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ void unpack(const uint4 &v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
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

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

/* Element offsets of item i: its g in gu ([N, 2F]) and its h in an [N, F] tensor. */
template <int VEC, typename I>
__device__ __forceinline__ void item_offsets(I i, I nvec, int F, int64_t &og, int64_t &oh) {
    const I row = i / nvec, v = i - row * nvec;
    og = (int64_t)row * 2 * F + (int64_t)v * VEC;
    oh = (int64_t)row * F + (int64_t)v * VEC;
}

template <int VEC, typename I>
__global__ void __launch_bounds__(THREADS)
    swiglu_fwd(const __nv_bfloat16 *__restrict__ gu, __nv_bfloat16 *__restrict__ h, I total, I nvec,
               int F) {
    typedef typename Pk<VEC>::T P;
    const I base = (I)blockIdx.x * (THREADS * U) + threadIdx.x;
    P gp[U], up[U];
    int64_t og[U], oh[U];
#pragma unroll
    for (int k = 0; k < U; k++) {
        const I i = base + (I)(k * THREADS);
        if (i < total) {
            item_offsets<VEC, I>(i, nvec, F, og[k], oh[k]);
            gp[k] = __ldg(reinterpret_cast<const P *>(gu + og[k]));
            up[k] = __ldg(reinterpret_cast<const P *>(gu + og[k] + F));
        }
    }
#pragma unroll
    for (int k = 0; k < U; k++) {
        const I i = base + (I)(k * THREADS);
        if (i < total) {
            float g[VEC], u[VEC];
            unpack(gp[k], g);
            unpack(up[k], u);
#pragma unroll
            for (int e = 0; e < VEC; e++)
                g[e] = g[e] * sigmoidf_(g[e]) * u[e];
            P o;
            pack(g, o);
            *reinterpret_cast<P *>(h + oh[k]) = o;
        }
    }
}

/* gu and dgu may be the same buffer: every element is loaded before it is stored, by
 * the same thread (so no __restrict__ on them). */
template <int VEC, typename I>
__global__ void __launch_bounds__(THREADS)
    swiglu_bwd(const __nv_bfloat16 *gu, const __nv_bfloat16 *__restrict__ dh, __nv_bfloat16 *dgu,
               __nv_bfloat16 *__restrict__ h, I total, I nvec, int F) {
    typedef typename Pk<VEC>::T P;
    const I base = (I)blockIdx.x * (THREADS * U) + threadIdx.x;
    P gp[U], up[U], dp[U];
    int64_t og[U], oh[U];
#pragma unroll
    for (int k = 0; k < U; k++) {
        const I i = base + (I)(k * THREADS);
        if (i < total) {
            item_offsets<VEC, I>(i, nvec, F, og[k], oh[k]);
            gp[k] = *reinterpret_cast<const P *>(gu + og[k]);
            up[k] = *reinterpret_cast<const P *>(gu + og[k] + F);
            dp[k] = __ldg(reinterpret_cast<const P *>(dh + oh[k]));
        }
    }
#pragma unroll
    for (int k = 0; k < U; k++) {
        const I i = base + (I)(k * THREADS);
        if (i < total) {
            float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC], a[VEC];
            unpack(gp[k], g);
            unpack(up[k], u);
            unpack(dp[k], d);
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                const float s = sigmoidf_(g[e]);
                du[e] = d[e] * g[e] * s;
                dg[e] = d[e] * u[e] * (s * (1.0f + g[e] * (1.0f - s)));
                a[e] = g[e] * s * u[e];
            }
            P o;
            pack(dg, o);
            *reinterpret_cast<P *>(dgu + og[k]) = o;
            pack(du, o);
            *reinterpret_cast<P *>(dgu + og[k] + F) = o;
            if (h) {
                pack(a, o);
                *reinterpret_cast<P *>(h + oh[k]) = o;
            }
        }
    }
}

bool al16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

lm_status check(const char *op, int64_t N, int F, lm_error *err) {
    if (N < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be >= 0", op, (long long)N);
    if (F < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: F = %d must be >= 1", op, F);
    if ((double)N * 2 * F > 4.0e18)
        return lm_errorf(err, LM_ERR_INVALID, "%s: problem too large (N = %lld, F = %d)", op,
                         (long long)N, F);
    return LM_OK;
}

/* Launches kernel instance (VEC, index type) for N rows. */
template <int VEC, typename Launch> lm_status launch(int64_t N, int F, Launch &&go, lm_error *err) {
    const int64_t nvec = F / VEC, total = N * nvec;
    const int64_t blocks = (total + THREADS * U - 1) / (THREADS * U);
    if (blocks > INT32_MAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "swiglu on cuda: N * F = %lld is too large",
                         (long long)(N * F));
    if (total < ((int64_t)1 << 32) - THREADS * U)
        go((unsigned)blocks, (uint32_t)total, (uint32_t)nvec);
    else
        go((unsigned)blocks, (uint64_t)total, (uint64_t)nvec);
    LM_CK_LAUNCH("swiglu");
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_cuda_swiglu_forward(lm_cuda_ctx *ctx, int64_t N, int F, const void *gu,
                                            void *h, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check("swiglu", N, F, err));
    if (N == 0)
        return LM_OK;
    if (!gu || !h)
        return lm_errorf(err, LM_ERR_INVALID, "swiglu: '%s' is required", !gu ? "gu" : "h");
    if (h == gu)
        return lm_errorf(err, LM_ERR_INVALID, "swiglu: output 'h' must not alias input 'gu'");
    const __nv_bfloat16 *g = (const __nv_bfloat16 *)gu;
    __nv_bfloat16 *o = (__nv_bfloat16 *)h;
    cudaStream_t st = ctx->stream;
    if (F % 8 == 0 && al16(gu) && al16(h))
        return launch<8>(
            N, F,
            [&](unsigned b, auto total, auto nvec) {
                swiglu_fwd<8, decltype(total)><<<b, THREADS, 0, st>>>(g, o, total, nvec, F);
            },
            err);
    return launch<1>(
        N, F,
        [&](unsigned b, auto total, auto nvec) {
            swiglu_fwd<1, decltype(total)><<<b, THREADS, 0, st>>>(g, o, total, nvec, F);
        },
        err);
}

extern "C" lm_status lm_cuda_swiglu_backward(lm_cuda_ctx *ctx, int64_t N, int F, const void *gu,
                                             const void *dh, void *dgu, void *h, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check("swiglu backward", N, F, err));
    if (N == 0)
        return LM_OK;
    if (!gu || !dh || !dgu)
        return lm_errorf(err, LM_ERR_INVALID, "swiglu backward: '%s' is required",
                         !gu   ? "gu"
                         : !dh ? "dh"
                               : "dgu");
    if (dgu == dh || (h && (h == gu || h == dh || h == dgu)))
        return lm_errorf(err, LM_ERR_INVALID,
                         "swiglu backward: 'dgu' must not alias 'dh', and 'h' no other tensor");
    const __nv_bfloat16 *g = (const __nv_bfloat16 *)gu, *d = (const __nv_bfloat16 *)dh;
    __nv_bfloat16 *dg = (__nv_bfloat16 *)dgu, *a = (__nv_bfloat16 *)h;
    cudaStream_t st = ctx->stream;
    if (F % 8 == 0 && al16(gu) && al16(dh) && al16(dgu) && al16(h))
        return launch<8>(
            N, F,
            [&](unsigned b, auto total, auto nvec) {
                swiglu_bwd<8, decltype(total)><<<b, THREADS, 0, st>>>(g, d, dg, a, total, nvec, F);
            },
            err);
    return launch<1>(
        N, F,
        [&](unsigned b, auto total, auto nvec) {
            swiglu_bwd<1, decltype(total)><<<b, THREADS, 0, st>>>(g, d, dg, a, total, nvec, F);
        },
        err);
}
