/* Element-wise conversions and sums (include/linmoe/cuda_elementwise.h has the contract).
 * One grid-stride kernel per operation: 8 elements per thread step through 16-byte
 * (bf16) / 32-byte (fp32) accesses when every pointer is 16-byte aligned, one element per
 * step otherwise. fp32 math, one rounding to bf16. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "linmoe/cuda_elementwise.h"
#include "ops/cuda/ctx.cuh"

namespace {

constexpr int THREADS = 256;

enum Op { F2B = 0, B2F = 1, ADDB = 2, ACCF = 3, SCALEB = 4, ACCFF = 5 };

__device__ __forceinline__ float b2f(unsigned short v) {
    return __uint_as_float((uint32_t)v << 16);
}
__device__ __forceinline__ unsigned short f2b(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

/* One element of operation OP: a and b the inputs (fp32 or bf16 by OP), out the output. */
template <int OP>
__device__ __forceinline__ void one(int64_t i, const void *a, const void *b, void *out,
                                    float alpha) {
    if (OP == F2B)
        ((unsigned short *)out)[i] = f2b(((const float *)a)[i]);
    else if (OP == B2F)
        ((float *)out)[i] = b2f(((const unsigned short *)a)[i]);
    else if (OP == ADDB)
        ((unsigned short *)out)[i] =
            f2b(b2f(((const unsigned short *)a)[i]) + b2f(((const unsigned short *)b)[i]));
    else if (OP == ACCF)
        ((float *)out)[i] += b2f(((const unsigned short *)a)[i]);
    else if (OP == ACCFF)
        ((float *)out)[i] += ((const float *)a)[i];
    else
        ((unsigned short *)out)[i] = f2b(alpha * ((const float *)a)[i]);
}

template <int OP, int VEC>
__global__ void __launch_bounds__(THREADS)
    ew_kernel(int64_t n, const void *a, const void *b, void *out, float alpha) {
    const int64_t stride = (int64_t)gridDim.x * THREADS * VEC;
    for (int64_t base = ((int64_t)blockIdx.x * THREADS + threadIdx.x) * VEC; base < n;
         base += stride) {
        if (VEC == 1 || base + VEC > n) {
            for (int64_t i = base; i < n && i < base + VEC; i++)
                one<OP>(i, a, b, out, alpha);
            continue;
        }
        /* VEC = 8: the same element operation on 8 consecutive elements; the compiler
         * merges the accesses into 16-byte loads / stores (aligned by the host check). */
        float fa[8], fb[8];
        if (OP == F2B || OP == SCALEB || OP == ACCFF) {
            const float4 *p = (const float4 *)((const float *)a + base);
            const float4 x0 = p[0], x1 = p[1];
            fa[0] = x0.x, fa[1] = x0.y, fa[2] = x0.z, fa[3] = x0.w;
            fa[4] = x1.x, fa[5] = x1.y, fa[6] = x1.z, fa[7] = x1.w;
        } else {
            const uint4 v = *(const uint4 *)((const unsigned short *)a + base);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                fa[2 * j] = __uint_as_float(w[j] << 16);
                fa[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
            }
        }
        if (OP == ADDB) {
            const uint4 v = *(const uint4 *)((const unsigned short *)b + base);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                fb[2 * j] = __uint_as_float(w[j] << 16);
                fb[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
            }
        }
        if (OP == B2F || OP == ACCF || OP == ACCFF) {
            float4 *p = (float4 *)((float *)out + base);
            float4 y0, y1;
            if (OP == ACCF || OP == ACCFF) {
                y0 = p[0], y1 = p[1];
                y0.x += fa[0], y0.y += fa[1], y0.z += fa[2], y0.w += fa[3];
                y1.x += fa[4], y1.y += fa[5], y1.z += fa[6], y1.w += fa[7];
            } else {
                y0 = make_float4(fa[0], fa[1], fa[2], fa[3]);
                y1 = make_float4(fa[4], fa[5], fa[6], fa[7]);
            }
            p[0] = y0, p[1] = y1;
        } else {
            uint32_t w[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float lo = fa[2 * j], hi = fa[2 * j + 1];
                if (OP == ADDB)
                    lo += fb[2 * j], hi += fb[2 * j + 1];
                if (OP == SCALEB)
                    lo *= alpha, hi *= alpha;
                w[j] = (uint32_t)f2b(lo) | ((uint32_t)f2b(hi) << 16);
            }
            *(uint4 *)((unsigned short *)out + base) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

template <int OP>
lm_status launch(lm_cuda_ctx *ctx, const char *name, int64_t n, const void *a, const void *b,
                 void *out, float alpha, lm_error *err) {
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "cuda %s: NULL context", name);
    if (n < 0)
        return lm_errorf(err, LM_ERR_INVALID, "cuda %s: n = %lld < 0", name, (long long)n);
    if (n == 0)
        return LM_OK;
    if (!a || !out || (OP == ADDB && !b))
        return lm_errorf(err, LM_ERR_INVALID, "cuda %s: NULL device pointer", name);
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    const int aligned = ((uintptr_t)a % 16 == 0) && ((uintptr_t)out % 16 == 0) &&
                        (OP != ADDB || (uintptr_t)b % 16 == 0);
    const int vec = aligned ? 8 : 1;
    int64_t blocks = (n + (int64_t)THREADS * vec - 1) / ((int64_t)THREADS * vec);
    if (blocks > 132 * 16)
        blocks = 132 * 16; /* grid-stride beyond about 16 CTAs per SM */
    cudaStream_t s = (cudaStream_t)lm_cuda_ctx_stream(ctx);
    if (aligned)
        ew_kernel<OP, 8><<<(unsigned)blocks, THREADS, 0, s>>>(n, a, b, out, alpha);
    else
        ew_kernel<OP, 1><<<(unsigned)blocks, THREADS, 0, s>>>(n, a, b, out, alpha);
    LM_CK_LAUNCH(name);
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_cuda_f32_to_bf16(lm_cuda_ctx *ctx, int64_t n, const float *src, void *dst,
                                         lm_error *err) {
    return launch<F2B>(ctx, "f32_to_bf16", n, src, nullptr, dst, 1.0f, err);
}
extern "C" lm_status lm_cuda_bf16_to_f32(lm_cuda_ctx *ctx, int64_t n, const void *src, float *dst,
                                         lm_error *err) {
    return launch<B2F>(ctx, "bf16_to_f32", n, src, nullptr, dst, 1.0f, err);
}
extern "C" lm_status lm_cuda_add_bf16(lm_cuda_ctx *ctx, int64_t n, const void *a, const void *b,
                                      void *out, lm_error *err) {
    return launch<ADDB>(ctx, "add_bf16", n, a, b, out, 1.0f, err);
}
extern "C" lm_status lm_cuda_acc_bf16_f32(lm_cuda_ctx *ctx, int64_t n, const void *x, float *y,
                                          lm_error *err) {
    return launch<ACCF>(ctx, "acc_bf16_f32", n, x, nullptr, y, 1.0f, err);
}
extern "C" lm_status lm_cuda_acc_f32(lm_cuda_ctx *ctx, int64_t n, const float *x, float *y,
                                     lm_error *err) {
    return launch<ACCFF>(ctx, "acc_f32", n, x, nullptr, y, 1.0f, err);
}
extern "C" lm_status lm_cuda_scale_f32_to_bf16(lm_cuda_ctx *ctx, int64_t n, float alpha,
                                               const float *x, void *y, lm_error *err) {
    return launch<SCALEB>(ctx, "scale_f32_to_bf16", n, x, nullptr, y, alpha, err);
}
