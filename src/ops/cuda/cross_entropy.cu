/* The LM head fused with the token cross-entropy, chunked over tokens
 * (include/linmoe/cuda_gemm.h; the CPU reference is src/ops/cross_entropy.c).
 *
 * Per chunk of Nc tokens (rows r0 .. r0+n):
 *   1. logits[n, V] = h_c W^T              lm_cuda_gemm, fp32 (or bf16) out, row stride ldl
 *   2. ce_rows_kernel, a CTA per row       pass 1: per-thread online (max, sum exp) over
 *                                          16-byte vectors, merged across the CTA in a fixed
 *                                          butterfly order: lse, nll; pass 2 (training):
 *                                          dlogits = scale (exp(x - lse) - onehot) as bf16
 *   3. dh_c[n, D] = dlogits W              lm_cuda_gemm, bf16 out
 *   4. dW[V, D] += dlogits^T h_c           lm_cuda_gemm, fp32 C, beta = 1
 * Before the chunks one CTA counts the counted labels and forms the gradient scale on the
 * device (no host sync); after them one CTA sums nll in fp64 in index order. The row stride
 * ldl = V rounded up to 8 keeps every row 16-byte aligned for vector loads and cuBLASLt;
 * the pad columns are never read by the GEMMs (K = V) and masked in the row kernel. With
 * bf16 logits the dlogits overwrite the logits in place: each element is read and written
 * by the same thread, after the CTA-wide reduction that follows the last read of pass 1. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <string.h>

#include "linmoe/cuda_gemm.h"
#include "ops/cuda/ctx.cuh"

namespace {

const char *OP = "cross_entropy cuda";
constexpr int ROW_THREADS = 1024;
constexpr int RED_THREADS = 1024;
constexpr size_t HDR_BYTES = 256; /* scratch B: int count, float scale, then nll [N] */

typedef __nv_bfloat16 bf16;

int64_t ld_of(int V) { return ((int64_t)V + 7) / 8 * 8; }
size_t round256(size_t x) { return (x + 255) / 256 * 256; }

/* rows per chunk (the result depends only on the config, never on the device) */
int64_t chunk_rows_of(const lm_cuda_ce_config *c) {
    if (c->N <= 0)
        return 0;
    const int64_t per_row = ld_of(c->V) * (c->logits_bf16 ? 2 : 6);
    if (c->chunk_rows > 0)
        return c->chunk_rows < c->N ? c->chunk_rows : c->N;
    int64_t nc_max = (int64_t)(LM_CUDA_CE_SCRATCH_BYTES / (size_t)per_row) / 64 * 64;
    if (nc_max < 64)
        nc_max = 64;
    if (nc_max >= c->N)
        return c->N;
    const int64_t nchunks = (c->N + nc_max - 1) / nc_max;
    int64_t nc = ((c->N + nchunks - 1) / nchunks + 63) / 64 * 64; /* balanced, <= nc_max */
    return nc < c->N ? nc : c->N;
}

size_t scratch_a_bytes(const lm_cuda_ce_config *c, int64_t nc, int want_grad) {
    const size_t cells = (size_t)nc * (size_t)ld_of(c->V);
    if (c->logits_bf16)
        return cells * 2;
    return round256(cells * 4) + (want_grad ? cells * 2 : 0);
}

lm_status validate(const lm_cuda_ce_config *c, const void *h, const void *W, const int32_t *labels,
                   const lm_cuda_ce_outputs *out, int want_grad, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is required", OP);
    if (c->N < 0 || c->N > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be in [0, 2^31)", OP,
                         (long long)c->N);
    if (c->D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: D = %d must be >= 1", OP, c->D);
    if (c->V < 1 || c->V > INT32_MAX - 8)
        return lm_errorf(err, LM_ERR_INVALID, "%s: vocabulary size V = %d must be >= 1", OP, c->V);
    if (c->ignore_index >= 0 && c->ignore_index < c->V)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: ignore_index = %d is a valid token id (must lie outside [0, V = %d))",
                         OP, c->ignore_index, c->V);
    if (c->chunk_rows < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: chunk_rows = %d must be >= 0", OP,
                         c->chunk_rows);
    if (c->mean != 0 && c->mean != 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: mean = %d must be 0 or 1", OP, c->mean);
    if (c->logits_bf16 != 0 && c->logits_bf16 != 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: logits_bf16 = %d must be 0 or 1", OP,
                         c->logits_bf16);
    if (want_grad && !isfinite(c->dloss))
        return lm_errorf(err, LM_ERR_INVALID, "%s: dloss = %g is not finite", OP, (double)c->dloss);
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "%s: outputs are required", OP);
    if (!out->loss_sum && !out->count && !out->nll && !out->dh && !out->dW)
        return lm_errorf(err, LM_ERR_INVALID, "%s: no output requested", OP);
    if (!W)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'W' (lm_head.weight [V, D]) is required",
                         OP);
    if (c->N > 0 && (!h || !labels))
        return lm_errorf(err, LM_ERR_INVALID, "%s: inputs 'h' and 'labels' are required", OP);
    if (out->dh && out->dh == h)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dh' must not alias input 'h'", OP);
    if (out->dW && (const void *)out->dW == W)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dW' must not alias input 'W'", OP);
    return LM_OK;
}

/* ------------------------------------------------------------------ device helpers */

__device__ __forceinline__ void lse_combine(float &m, float &s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY)
        return; /* both empty (s = s2 = 0) */
    s = s * __expf(m - M) + s2 * __expf(m2 - M);
    m = M;
}

/* CTA-wide (max, sum) merge in a fixed butterfly order; every thread gets the result. */
__device__ __forceinline__ void block_lse(float &m, float &s, float2 *sh) {
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_combine(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0)
        sh[warp] = make_float2(m, s);
    __syncthreads();
    if (warp == 0) {
        float2 v = lane < nw ? sh[lane] : make_float2(-INFINITY, 0.0f);
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, v.x, o);
            const float s2 = __shfl_xor_sync(0xffffffffu, v.y, o);
            lse_combine(v.x, v.y, m2, s2);
        }
        if (lane == 0)
            sh[32] = v;
    }
    __syncthreads();
    m = sh[32].x;
    s = sh[32].y;
}

template <typename T> __device__ __forceinline__ T block_sum(T v, T *sh) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0)
        sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sh[lane] : (T)0;
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0)
            sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

/* VEC logits as floats from a 16-byte aligned address */
template <typename LT> struct Vec;
template <> struct Vec<float> {
    static constexpr int N = 4, UNR = 4;
    __device__ __forceinline__ static void load(const float *p, float *x) {
        const float4 v = *reinterpret_cast<const float4 *>(p);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    }
    __device__ __forceinline__ static float one(const float *p) { return *p; }
};
template <> struct Vec<bf16> {
    static constexpr int N = 8, UNR = 2;
    __device__ __forceinline__ static void load(const bf16 *p, float *x) {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __bfloat1622float2(b[j]);
            x[2 * j] = f.x, x[2 * j + 1] = f.y;
        }
    }
    __device__ __forceinline__ static float one(const bf16 *p) { return __bfloat162float(*p); }
};

/* VEC bf16 gradients to an address aligned to 2 * VEC bytes */
template <int VEC> __device__ __forceinline__ void store_bf16(bf16 *p, const float *g);
template <> __device__ __forceinline__ void store_bf16<4>(bf16 *p, const float *g) {
    __nv_bfloat162 b[2] = {__floats2bfloat162_rn(g[0], g[1]), __floats2bfloat162_rn(g[2], g[3])};
    *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<const uint2 *>(b);
}
template <> __device__ __forceinline__ void store_bf16<8>(bf16 *p, const float *g) {
    __nv_bfloat162 b[4] = {__floats2bfloat162_rn(g[0], g[1]), __floats2bfloat162_rn(g[2], g[3]),
                           __floats2bfloat162_rn(g[4], g[5]), __floats2bfloat162_rn(g[6], g[7])};
    *reinterpret_cast<uint4 *>(p) = *reinterpret_cast<const uint4 *>(b);
}

/* One CTA per row (grid-stride over the chunk's rows). logits and dlog may be the same
 * buffer (bf16 logits): no __restrict__ on them. */
template <typename LT, bool GRAD>
__global__ void __launch_bounds__(ROW_THREADS)
    ce_rows_kernel(const LT *logits, bf16 *dlog, int64_t ld, int V, int rows,
                   const int32_t *__restrict__ labels, int ignore,
                   const float *__restrict__ scale_p, float *__restrict__ nll) {
    constexpr int VEC = Vec<LT>::N, UNR = Vec<LT>::UNR;
    __shared__ float2 sh[33];
    const int64_t stride = (int64_t)blockDim.x * VEC;
    const float scale = GRAD ? *scale_p : 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const LT *x_row = logits + (int64_t)r * ld;
        const int label = labels[r];
        const bool counted = label != ignore;
        const bool valid = counted && label >= 0 && label < V;
        if (!valid) { /* ignored (nll 0) or a bad label (NaN): no softmax, zero dlogits */
            if (threadIdx.x == 0)
                nll[r] = counted ? __int_as_float(0x7fc00000) : 0.0f;
            if (GRAD) {
                bf16 *g_row = dlog + (int64_t)r * ld;
                const float z[VEC] = {};
                for (int64_t i = (int64_t)threadIdx.x * VEC; i < V; i += stride)
                    store_bf16<VEC>(g_row + i, z);
            }
            continue; /* uniform across the CTA: no barrier is skipped by a part of it */
        }
        /* the target logit, read before any thread of the CTA overwrites the row */
        const float xt = threadIdx.x == 0 ? Vec<LT>::one(x_row + label) : 0.0f;
        float m = -INFINITY, s = 0.0f;
        for (int64_t i0 = (int64_t)threadIdx.x * VEC; i0 < V; i0 += UNR * stride) {
            float x[UNR][VEC];
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                const int64_t i = i0 + u * stride;
                if (i < V)
                    Vec<LT>::load(x_row + i, x[u]);
                else
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        x[u][j] = -INFINITY;
            }
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                const int64_t i = i0 + u * stride;
                float vm = -INFINITY;
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    if (i + j >= V)
                        x[u][j] = -INFINITY;
                    vm = fmaxf(vm, x[u][j]);
                }
                if (vm == -INFINITY)
                    continue;
                const float mn = fmaxf(m, vm);
                float acc = 0.0f;
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    acc += __expf(x[u][j] - mn);
                s = s * __expf(m - mn) + acc;
                m = mn;
            }
        }
        block_lse(m, s, sh);
        const float lse = m + logf(s);
        if (threadIdx.x == 0)
            nll[r] = lse - xt;
        if (GRAD) {
            /* UNR vectors loaded before any is stored: the loads overlap. In place (bf16)
             * a thread reads and writes only its own elements, so the order is safe. */
            bf16 *g_row = dlog + (int64_t)r * ld;
            for (int64_t i0 = (int64_t)threadIdx.x * VEC; i0 < V; i0 += UNR * stride) {
                float x[UNR][VEC];
#pragma unroll
                for (int u = 0; u < UNR; u++)
                    if (i0 + u * stride < V)
                        Vec<LT>::load(x_row + i0 + u * stride, x[u]);
#pragma unroll
                for (int u = 0; u < UNR; u++) {
                    const int64_t i = i0 + u * stride;
                    if (i >= V)
                        break;
                    float g[VEC];
#pragma unroll
                    for (int j = 0; j < VEC; j++) {
                        const int64_t v = i + j;
                        g[j] = v < V ? scale * __expf(x[u][j] - lse) : 0.0f;
                        if (v == label)
                            g[j] -= scale;
                    }
                    store_bf16<VEC>(g_row + i, g);
                }
            }
        }
    }
}

/* one CTA: hdr[0] = counted labels (int), hdr[1] = the dlogits scale (float) */
__global__ void __launch_bounds__(RED_THREADS)
    ce_count_kernel(const int32_t *__restrict__ labels, int64_t N, int ignore, float dloss,
                    int mean, void *hdr) {
    __shared__ long long sh[33];
    long long c = 0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
        c += labels[i] != ignore;
    c = block_sum<long long>(c, sh);
    if (threadIdx.x == 0) {
        ((int32_t *)hdr)[0] = (int32_t)c;
        ((float *)hdr)[1] = mean ? (c > 0 ? (float)((double)dloss / (double)c) : 0.0f) : dloss;
    }
}

/* one CTA: loss_sum = sum of nll in fp64, index order per thread, fixed tree after */
__global__ void __launch_bounds__(RED_THREADS)
    ce_loss_kernel(const float *__restrict__ nll, int64_t N, const void *hdr, float *loss_sum,
                   int32_t *count) {
    __shared__ double sh[33];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
        s += (double)nll[i];
    s = block_sum<double>(s, sh);
    if (threadIdx.x == 0) {
        if (loss_sum)
            *loss_sum = (float)s;
        if (count)
            *count = ((const int32_t *)hdr)[0];
    }
}

template <typename LT, bool GRAD>
lm_status launch_rows(lm_cuda_ctx *ctx, const void *logits, bf16 *dlog, int64_t ld, int V, int n,
                      const int32_t *labels, int ignore, const float *scale_p, float *nll,
                      lm_error *err) {
    const int grid = n < ctx->sm_count ? n : ctx->sm_count;
    ce_rows_kernel<LT, GRAD><<<grid, ROW_THREADS, 0, ctx->stream>>>(
        (const LT *)logits, dlog, ld, V, n, labels, ignore, scale_p, nll);
    LM_CK_LAUNCH("ce_rows_kernel");
    return LM_OK;
}

lm_status ce_run(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, const void *h, const void *W,
                 const int32_t *labels, const lm_cuda_ce_outputs *out, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    const int grad = out && (out->dh || out->dW);
    LM_TRY(validate(c, h, W, labels, out, grad, err));
    if (c->N == 0) {
        if (out->loss_sum)
            LM_CK(cudaMemsetAsync(out->loss_sum, 0, sizeof(float), ctx->stream));
        if (out->count)
            LM_CK(cudaMemsetAsync(out->count, 0, sizeof(int32_t), ctx->stream));
        return LM_OK;
    }
    const int64_t N = c->N, ldl = ld_of(c->V), nc = chunk_rows_of(c);
    const int D = c->D, V = c->V;
    void *sa = nullptr, *sb = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, scratch_a_bytes(c, nc, grad), &sa, err));
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_B,
                               HDR_BYTES + (out->nll ? 0 : (size_t)N * sizeof(float)), &sb, err));
    unsigned char *hdr = (unsigned char *)sb;
    const float *scale_p = (const float *)hdr + 1;
    float *nll = out->nll ? out->nll : (float *)(hdr + HDR_BYTES);
    void *logits = sa;
    bf16 *dlog = c->logits_bf16
                     ? (bf16 *)sa
                     : (bf16 *)((unsigned char *)sa + round256((size_t)nc * ldl * sizeof(float)));
    const lm_cuda_gemm_type lt = c->logits_bf16 ? LM_CUDA_GEMM_BF16 : LM_CUDA_GEMM_F32;

    ce_count_kernel<<<1, RED_THREADS, 0, ctx->stream>>>(labels, N, c->ignore_index, c->dloss,
                                                        c->mean, hdr);
    LM_CK_LAUNCH("ce_count_kernel");
    for (int64_t r0 = 0; r0 < N; r0 += nc) {
        const int n = (int)(N - r0 < nc ? N - r0 : nc);
        const bf16 *hc = (const bf16 *)h + r0 * D;
        LM_TRY(lm_cuda_gemm(ctx, 0, 1, n, V, D, 1.0f, hc, D, W, D, 0.0f, logits, ldl, lt, err));
        if (c->logits_bf16) {
            if (grad)
                LM_TRY((launch_rows<bf16, true>(ctx, logits, dlog, ldl, V, n, labels + r0,
                                                c->ignore_index, scale_p, nll + r0, err)));
            else
                LM_TRY((launch_rows<bf16, false>(ctx, logits, dlog, ldl, V, n, labels + r0,
                                                 c->ignore_index, scale_p, nll + r0, err)));
        } else {
            if (grad)
                LM_TRY((launch_rows<float, true>(ctx, logits, dlog, ldl, V, n, labels + r0,
                                                 c->ignore_index, scale_p, nll + r0, err)));
            else
                LM_TRY((launch_rows<float, false>(ctx, logits, dlog, ldl, V, n, labels + r0,
                                                  c->ignore_index, scale_p, nll + r0, err)));
        }
        if (out->dh)
            LM_TRY(lm_cuda_gemm(ctx, 0, 0, n, D, V, 1.0f, dlog, ldl, W, D, 0.0f,
                                (bf16 *)out->dh + r0 * D, D, LM_CUDA_GEMM_BF16, err));
        if (out->dW)
            LM_TRY(lm_cuda_gemm(ctx, 1, 0, V, D, n, 1.0f, dlog, ldl, hc, D, 1.0f, out->dW, D,
                                LM_CUDA_GEMM_F32, err));
    }
    if (out->loss_sum || out->count) {
        ce_loss_kernel<<<1, RED_THREADS, 0, ctx->stream>>>(nll, N, hdr, out->loss_sum, out->count);
        LM_CK_LAUNCH("ce_loss_kernel");
    }
    return LM_OK;
}

} // namespace

extern "C" size_t lm_cuda_ce_scratch_bytes(const lm_cuda_ce_config *c, int want_grad) {
    if (!c || c->N < 0 || c->D < 1 || c->V < 1 || c->chunk_rows < 0)
        return 0;
    return scratch_a_bytes(c, chunk_rows_of(c), want_grad) + HDR_BYTES +
           (size_t)c->N * sizeof(float);
}

extern "C" lm_status lm_cuda_ce_forward_backward(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c,
                                                 const void *h, const void *W,
                                                 const int32_t *labels,
                                                 const lm_cuda_ce_outputs *out, lm_error *err) {
    return ce_run(ctx, c, h, W, labels, out, err);
}

extern "C" lm_status lm_cuda_ce_forward(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, const void *h,
                                        const void *W, const int32_t *labels, float *loss_sum,
                                        int32_t *count, float *nll, lm_error *err) {
    lm_cuda_ce_outputs out;
    memset(&out, 0, sizeof out);
    out.loss_sum = loss_sum, out.count = count, out.nll = nll;
    return ce_run(ctx, c, h, W, labels, &out, err);
}
