/* The LM head fused with the token cross-entropy, chunked over tokens
 * (include/linmoe/cuda_gemm.h; the CPU reference is src/ops/cross_entropy.c).
 *
 * Per chunk of Nc tokens (rows r0 .. r0+n):
 *   1. logits[n, V] = h_c W^T        lm_cuda_gemm, bf16 (or fp32) out, row stride ldl
 *   2. ce_rows_kernel, a CTA per row  the row is staged in shared memory with cp.async
 *                                    (STAGED) or read from global memory (STREAM); every
 *                                    thread owns the 16-byte vectors tid, tid + T, ...:
 *                                    pass 1a: max; pass 1b: sum exp(x - max); a fixed
 *                                    butterfly merge across the CTA gives lse (Milakov &
 *                                    Gimelshein 2018, the (max, sum) pair merge); the
 *                                    owner of the target's vector writes nll; pass 2
 *                                    (training): dlogits = scale (exp(x - lse) - onehot)
 *                                    as bf16, in place over bf16 logits
 *   3. dh_c[n, D] = dlogits W        lm_cuda_gemm bf16 out, or S fp32 partial GEMMs over
 *                                    vocabulary slices in one strided batch + an ordered sum
 *   4. dW[V, D] += dlogits^T h_c     lm_cuda_gemm, fp32 C, beta = 1
 * Before the chunks one CTA counts the counted labels and forms the gradient scale on the
 * device (no host sync); after them one CTA sums nll in fp64 in index order. The row stride
 * ldl = V rounded up to 8 keeps every row 16-byte aligned for vector loads, cp.async and
 * cuBLASLt; the pad columns are never read by the GEMMs (K = V) and masked in the row
 * kernel. STAGED and STREAM run the same arithmetic in the same order (only the source of
 * the loads differs), so they give the same bits.
 *
 * Traffic: STAGED reads each logit from HBM once (cp.async, all of a row in flight) and
 * writes each dlogit once; two CTAs of 100 KB fit an SM at V = 50304, so one row's
 * reduction overlaps the other's copy. In place is safe: a thread writes only the vectors
 * it alone loaded, after its copies completed (STAGED) or after its own loads (STREAM). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <string.h>

#include "linmoe/cuda_gemm.h"
#include "ops/cuda/ctx.cuh"

namespace {

const char *OP = "cross_entropy cuda";
constexpr int ROW_THREADS = 512; /* two CTAs per SM (launch bounds) */
constexpr int UNR = 4;           /* vectors loaded before use, per thread */
constexpr int RED_THREADS = 1024;
constexpr int SUM_THREADS = 256;
constexpr int MAX_SPLIT = 8;
constexpr size_t HDR_BYTES = 256;  /* scratch B: int count, float scale, then nll [N] */
constexpr int SMEM_RESERVE = 1024; /* static shared memory of the row kernel, rounded up */

typedef __nv_bfloat16 bf16;

struct CeState {
    int smem_optin = -1; /* cudaDevAttrMaxSharedMemoryPerBlockOptin of the context's device */
};

int64_t ld_of(int V) { return ((int64_t)V + 7) / 8 * 8; }
size_t round256(size_t x) { return (x + 255) / 256 * 256; }

/* rows per chunk (depends only on the config, never on the device): the largest power of
 * two (>= 64) whose scratch fits LM_CUDA_CE_SCRATCH_BYTES, then balanced over N in
 * multiples of 64 */
int64_t chunk_rows_of(const lm_cuda_ce_config *c) {
    if (c->N <= 0)
        return 0;
    if (c->chunk_rows > 0)
        return c->chunk_rows < c->N ? c->chunk_rows : c->N;
    const int64_t per_row = ld_of(c->V) * (c->logits_bf16 ? 2 : 6);
    const int64_t nc_max = (int64_t)(LM_CUDA_CE_SCRATCH_BYTES / (size_t)per_row);
    int64_t p = 64;
    while (p * 2 <= nc_max)
        p *= 2;
    if (p >= c->N)
        return c->N;
    const int64_t nchunks = (c->N + p - 1) / p;
    const int64_t nc = ((c->N + nchunks - 1) / nchunks + 63) / 64 * 64; /* <= p */
    return nc < c->N ? nc : c->N;
}

/* the dh GEMM's split over the vocabulary (depends only on the config) */
int split_of(const lm_cuda_ce_config *c, int64_t nc) {
    int S;
    if (c->dh_split >= 1) {
        S = c->dh_split;
        if (c->V % (8 * S) != 0)
            S = 1;
        return S;
    }
    const int64_t tiles = (nc + 127) / 128 * ((c->D + 255) / 256);
    S = 1;
    while (S < MAX_SPLIT && tiles * S < 128)
        S *= 2;
    while (S > 1 && c->V % (8 * S) != 0)
        S /= 2;
    return S;
}

/* bytes of one row staged in shared memory */
size_t staged_bytes(const lm_cuda_ce_config *c) {
    const int vec = c->logits_bf16 ? 8 : 4;
    return ((size_t)c->V + vec - 1) / vec * 16;
}

/* elements between the dh partials: n D rounded up to 64 (256 bytes) */
int64_t part_stride(int64_t n, int D) { return (n * D + 63) / 64 * 64; }

struct ScratchPlan {
    size_t logits, dlog, part, total; /* byte offsets of the regions of scratch A, and size */
};

ScratchPlan plan_of(const lm_cuda_ce_config *c, int64_t nc, int grad, int S) {
    const size_t cells = (size_t)nc * (size_t)ld_of(c->V);
    ScratchPlan p;
    p.logits = 0;
    size_t off = round256(cells * (c->logits_bf16 ? 2 : 4));
    p.dlog = c->logits_bf16 ? 0 : off;
    if (!c->logits_bf16 && grad)
        off += round256(cells * 2);
    p.part = off;
    if (grad && S > 1)
        off += (size_t)S * (size_t)part_stride(nc, c->D) * sizeof(float);
    p.total = off;
    return p;
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
    if (c->row_kernel < LM_CUDA_CE_ROW_AUTO || c->row_kernel > LM_CUDA_CE_ROW_STREAM)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: row_kernel = %d is not LM_CUDA_CE_ROW_AUTO / _STAGED / _STREAM", OP,
                         c->row_kernel);
    if (c->dh_split < 0 || c->dh_split > MAX_SPLIT)
        return lm_errorf(err, LM_ERR_INVALID, "%s: dh_split = %d must be in [0, %d]", OP,
                         c->dh_split, MAX_SPLIT);
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
        return;                                      /* both empty (s = s2 = 0) */
    s = fmaf(s, __expf(m - M), s2 * __expf(m2 - M)); /* explicit: no contraction choice */
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

/* 16 bytes of logits as floats */
template <typename LT> struct Vec;
template <> struct Vec<float> {
    static constexpr int N = 4;
    __device__ __forceinline__ static void unpack(const uint4 &u, float *x) {
        x[0] = __uint_as_float(u.x), x[1] = __uint_as_float(u.y);
        x[2] = __uint_as_float(u.z), x[3] = __uint_as_float(u.w);
    }
};
template <> struct Vec<bf16> {
    static constexpr int N = 8;
    __device__ __forceinline__ static void unpack(const uint4 &u, float *x) {
        const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __bfloat1622float2(b[j]);
            x[2 * j] = f.x, x[2 * j + 1] = f.y;
        }
    }
};
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }

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

constexpr float LOG2E = 1.4426950408889634f;

/* 2^x (MUFU.EX2; relative error about 2^-22, flushes results below 2^-126 to 0) */
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
/* commit and wait for all of this thread's copies (visible to this thread only) */
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

/* vector k of the row: from shared memory (STAGED) or global memory */
template <bool STAGED>
__device__ __forceinline__ uint4 ld_vec(const unsigned char *sm, const void *g_row, int k) {
    if (STAGED)
        return *reinterpret_cast<const uint4 *>(sm + (size_t)k * 16);
    return *(reinterpret_cast<const uint4 *>(g_row) + k);
}

/* One CTA per row of the chunk (grid = rows). logits and dlog may be the same buffer
 * (bf16 logits): no __restrict__ on them. Dynamic shared memory (STAGED): the row's
 * ceil(V / VEC) vectors. */
template <typename LT, bool GRAD, bool STAGED>
__global__ void __launch_bounds__(ROW_THREADS, 2)
    ce_rows_kernel(const LT *logits, bf16 *dlog, int64_t ld, int V,
                   const int32_t *__restrict__ labels, int ignore,
                   const float *__restrict__ scale_p, float *__restrict__ nll) {
    constexpr int VEC = Vec<LT>::N;
    extern __shared__ __align__(16) unsigned char row_sm[];
    __shared__ float2 sh[33];
    const int r = blockIdx.x, tid = threadIdx.x;
    const int nvec = (V + VEC - 1) / VEC;
    const LT *x_row = logits + (int64_t)r * ld;
    const int label = labels[r];
    const bool counted = label != ignore;
    const bool valid = counted && label >= 0 && label < V;
    if (!valid) { /* ignored (nll 0) or a bad label (NaN): no softmax, zero dlogits */
        if (tid == 0)
            nll[r] = counted ? __int_as_float(0x7fc00000) : 0.0f;
        if (GRAD) {
            bf16 *g_row = dlog + (int64_t)r * ld;
            const float z[VEC] = {};
            for (int k = tid; k < nvec; k += ROW_THREADS)
                store_bf16<VEC>(g_row + (int64_t)k * VEC, z);
        }
        return; /* uniform across the CTA */
    }
    if (STAGED) {
        for (int k = tid; k < nvec; k += ROW_THREADS)
            cp_async16(row_sm + (size_t)k * 16, x_row + (int64_t)k * VEC);
        cp_async_wait_all();
    }
    /* pass 1a: the thread's max */
    float m = -INFINITY;
    for (int k0 = tid; k0 < nvec; k0 += UNR * ROW_THREADS) {
        uint4 raw[UNR] = {};
#pragma unroll
        for (int u = 0; u < UNR; u++)
            if (k0 + u * ROW_THREADS < nvec)
                raw[u] = ld_vec<STAGED>(row_sm, x_row, k0 + u * ROW_THREADS);
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int k = k0 + u * ROW_THREADS;
            if (k >= nvec)
                break;
            float x[VEC];
            Vec<LT>::unpack(raw[u], x);
            if ((k + 1) * VEC <= V) {
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    m = fmaxf(m, x[j]);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    if (k * VEC + j < V)
                        m = fmaxf(m, x[j]);
            }
        }
    }
    /* pass 1b: the thread's sum of exp(x - m) = 2^(x log2e - m log2e), one vector's
     * partial sum at a time */
    float s = 0.0f;
    if (m != -INFINITY) {
        const float m2 = m * LOG2E;
        for (int k0 = tid; k0 < nvec; k0 += UNR * ROW_THREADS) {
            uint4 raw[UNR] = {};
#pragma unroll
            for (int u = 0; u < UNR; u++)
                if (k0 + u * ROW_THREADS < nvec)
                    raw[u] = ld_vec<STAGED>(row_sm, x_row, k0 + u * ROW_THREADS);
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                const int k = k0 + u * ROW_THREADS;
                if (k >= nvec)
                    break;
                float x[VEC];
                Vec<LT>::unpack(raw[u], x);
                float acc = 0.0f;
                if ((k + 1) * VEC <= V) {
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        acc += ex2(fmaf(x[j], LOG2E, -m2));
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        acc += k * VEC + j < V ? ex2(fmaf(x[j], LOG2E, -m2)) : 0.0f;
                }
                s += acc;
            }
        }
    }
    /* the target logit, read by the thread that owns its vector, before any write */
    const int kl = label / VEC;
    const bool owner = kl % ROW_THREADS == tid;
    const float xt =
        owner ? (STAGED ? to_f(reinterpret_cast<const LT *>(row_sm)[label]) : to_f(x_row[label]))
              : 0.0f;
    block_lse(m, s, sh);
    const float lse = m + logf(s);
    if (owner)
        nll[r] = lse - xt;
    if (GRAD) {
        /* pass 2: dlogits = scale 2^(x log2e - lse log2e) - scale onehot */
        const float scale = *scale_p, lse2 = lse * LOG2E;
        bf16 *g_row = dlog + (int64_t)r * ld;
        for (int k0 = tid; k0 < nvec; k0 += UNR * ROW_THREADS) {
            uint4 raw[UNR] = {};
#pragma unroll
            for (int u = 0; u < UNR; u++)
                if (k0 + u * ROW_THREADS < nvec)
                    raw[u] = ld_vec<STAGED>(row_sm, x_row, k0 + u * ROW_THREADS);
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                const int k = k0 + u * ROW_THREADS;
                if (k >= nvec)
                    break;
                float x[VEC], g[VEC];
                Vec<LT>::unpack(raw[u], x);
                if ((k + 1) * VEC <= V) {
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        g[j] = scale * ex2(fmaf(x[j], LOG2E, -lse2));
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        g[j] = k * VEC + j < V ? scale * ex2(fmaf(x[j], LOG2E, -lse2)) : 0.0f;
                }
                if (k == kl) {
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        if (k * VEC + j == label)
                            g[j] -= scale;
                }
                store_bf16<VEC>(g_row + (int64_t)k * VEC, g);
            }
        }
    }
}

/* dh[i] = bf16(sum_s part[s pstride + i]) in index order of s; 4 at a time when aligned */
__global__ void __launch_bounds__(SUM_THREADS)
    ce_dh_sum_kernel(const float *__restrict__ part, int S, int64_t pstride, int64_t cnt,
                     bf16 *__restrict__ dh, int vec4) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec4) {
        const float4 *p = reinterpret_cast<const float4 *>(part);
        const int64_t c4 = cnt / 4;
        for (int64_t i = i0; i < c4; i += stride) {
            float4 a = p[i];
            for (int s = 1; s < S; s++) {
                const float4 b = p[(int64_t)s * (pstride / 4) + i];
                a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
            }
            __nv_bfloat162 o[2] = {__floats2bfloat162_rn(a.x, a.y),
                                   __floats2bfloat162_rn(a.z, a.w)};
            reinterpret_cast<uint2 *>(dh)[i] = *reinterpret_cast<const uint2 *>(o);
        }
    } else {
        for (int64_t i = i0; i < cnt; i += stride) {
            float a = part[i];
            for (int s = 1; s < S; s++)
                a += part[(int64_t)s * pstride + i];
            dh[i] = __float2bfloat16_rn(a);
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

struct RowArgs {
    const void *logits;
    bf16 *dlog;
    int64_t ld;
    int V, n;
    const int32_t *labels;
    int ignore;
    const float *scale_p;
    float *nll;
    size_t smem;    /* dynamic shared memory (STAGED) */
    int smem_optin; /* the device's opt-in limit per block */
};

template <typename LT, bool GRAD, bool STAGED>
lm_status launch_rows_t(lm_cuda_ctx *ctx, const RowArgs &a, lm_error *err) {
    auto kernel = ce_rows_kernel<LT, GRAD, STAGED>;
    const size_t smem = STAGED ? a.smem : 0;
    if (STAGED && lm_cuda_ctx_first_use(ctx, (const void *)kernel)) {
        /* the opt-in maximum once: any later V that fits (checked by the caller) launches */
        LM_CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   a.smem_optin - SMEM_RESERVE));
        LM_CK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   (int)cudaSharedmemCarveoutMaxShared));
    }
    kernel<<<a.n, ROW_THREADS, smem, ctx->stream>>>((const LT *)a.logits, a.dlog, a.ld, a.V,
                                                    a.labels, a.ignore, a.scale_p, a.nll);
    LM_CK_LAUNCH("ce_rows_kernel");
    return LM_OK;
}

lm_status launch_rows(lm_cuda_ctx *ctx, int bf16_logits, int grad, int staged, const RowArgs &a,
                      lm_error *err) {
    if (a.n <= 0)
        return LM_OK;
    const int sel = (bf16_logits ? 4 : 0) + (grad ? 2 : 0) + (staged ? 1 : 0);
    switch (sel) {
    case 0:
        return launch_rows_t<float, false, false>(ctx, a, err);
    case 1:
        return launch_rows_t<float, false, true>(ctx, a, err);
    case 2:
        return launch_rows_t<float, true, false>(ctx, a, err);
    case 3:
        return launch_rows_t<float, true, true>(ctx, a, err);
    case 4:
        return launch_rows_t<bf16, false, false>(ctx, a, err);
    case 5:
        return launch_rows_t<bf16, false, true>(ctx, a, err);
    case 6:
        return launch_rows_t<bf16, true, false>(ctx, a, err);
    default:
        return launch_rows_t<bf16, true, true>(ctx, a, err);
    }
}

/* dh_c = dlog W: one GEMM, or S partial GEMMs over vocabulary slices (one strided batch,
 * fp32 partials) and their ordered sum */
lm_status dh_gemm(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, int n, int S, const bf16 *dlog,
                  int64_t ldl, const void *W, float *part, bf16 *dh, lm_error *err) {
    const int D = c->D, V = c->V;
    if (S <= 1)
        return lm_cuda_gemm(ctx, 0, 0, n, D, V, 1.0f, dlog, ldl, W, D, 0.0f, dh, D,
                            LM_CUDA_GEMM_BF16, err);
    const int Ks = V / S;
    lm_cuda_gemm_desc d;
    memset(&d, 0, sizeof d);
    d.trans_a = 0, d.trans_b = 0;
    d.M = n, d.N = D, d.K = Ks;
    d.alpha = 1.0f, d.beta = 0.0f;
    d.A = dlog, d.lda = ldl;
    d.B = W, d.ldb = D;
    d.C = part, d.ldc = D;
    d.c_type = LM_CUDA_GEMM_F32;
    d.epilogue = LM_CUDA_GEMM_EPI_NONE;
    d.batch = S;
    d.stride_a = Ks;                /* columns [s Ks, (s+1) Ks) of dlog */
    d.stride_b = (int64_t)Ks * D;   /* rows [s Ks, (s+1) Ks) of W */
    d.stride_c = part_stride(n, D); /* partial s, 256-byte aligned */
    LM_TRY(lm_cuda_gemm_ex(ctx, &d, err));
    const int64_t cnt = (int64_t)n * D;
    const int vec4 = D % 4 == 0 && ((uintptr_t)dh & 7) == 0;
    const int grid = lm_cuda_grid(ctx, vec4 ? cnt / 4 : cnt, SUM_THREADS);
    ce_dh_sum_kernel<<<grid, SUM_THREADS, 0, ctx->stream>>>(part, S, d.stride_c, cnt, dh, vec4);
    LM_CK_LAUNCH("ce_dh_sum_kernel");
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
    CeState *cs = lm_cuda_ctx_get<CeState>(ctx, LM_SLOT_CE);
    if (cs->smem_optin < 0) {
        int v = 0;
        LM_CK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        cs->smem_optin = v;
    }
    const size_t row_smem = staged_bytes(c);
    const bool fits = row_smem + SMEM_RESERVE <= (size_t)cs->smem_optin;
    if (c->row_kernel == LM_CUDA_CE_ROW_STAGED && !fits)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s: row_kernel = STAGED needs %zu bytes of shared memory for a row of V "
                         "= %d %s logits; this device allows %d per block (use AUTO or STREAM)",
                         OP, row_smem, c->V, c->logits_bf16 ? "bf16" : "fp32",
                         cs->smem_optin - SMEM_RESERVE);
    const int staged =
        c->row_kernel == LM_CUDA_CE_ROW_STAGED || (c->row_kernel == LM_CUDA_CE_ROW_AUTO && fits);

    const int64_t N = c->N, ldl = ld_of(c->V), nc = chunk_rows_of(c);
    const int D = c->D, V = c->V;
    const int S = out->dh ? split_of(c, nc) : 1;
    const ScratchPlan pl = plan_of(c, nc, grad, S);
    void *sa = nullptr, *sb = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, pl.total, &sa, err));
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_B,
                               HDR_BYTES + (out->nll ? 0 : (size_t)N * sizeof(float)), &sb, err));
    unsigned char *hdr = (unsigned char *)sb;
    float *nll = out->nll ? out->nll : (float *)(hdr + HDR_BYTES);
    unsigned char *base = (unsigned char *)sa;
    void *logits = base + pl.logits;
    bf16 *dlog = (bf16 *)(base + pl.dlog); /* = logits with bf16 logits: in place */
    float *part = (float *)(base + pl.part);
    const lm_cuda_gemm_type lt = c->logits_bf16 ? LM_CUDA_GEMM_BF16 : LM_CUDA_GEMM_F32;

    ce_count_kernel<<<1, RED_THREADS, 0, ctx->stream>>>(labels, N, c->ignore_index, c->dloss,
                                                        c->mean, hdr);
    LM_CK_LAUNCH("ce_count_kernel");
    RowArgs ra;
    memset(&ra, 0, sizeof ra);
    ra.logits = logits, ra.dlog = dlog, ra.ld = ldl, ra.V = V;
    ra.ignore = c->ignore_index;
    ra.scale_p = (const float *)hdr + 1;
    ra.smem = row_smem, ra.smem_optin = cs->smem_optin;
    for (int64_t r0 = 0; r0 < N; r0 += nc) {
        const int n = (int)(N - r0 < nc ? N - r0 : nc);
        const bf16 *hc = (const bf16 *)h + r0 * D;
        LM_TRY(lm_cuda_gemm(ctx, 0, 1, n, V, D, 1.0f, hc, D, W, D, 0.0f, logits, ldl, lt, err));
        ra.n = n, ra.labels = labels + r0, ra.nll = nll + r0;
        LM_TRY(launch_rows(ctx, c->logits_bf16, grad, staged, ra, err));
        if (out->dh)
            LM_TRY(dh_gemm(ctx, c, n, S, dlog, ldl, W, part, (bf16 *)out->dh + r0 * D, err));
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
    if (!c || c->N < 0 || c->D < 1 || c->V < 1 || c->chunk_rows < 0 || c->dh_split < 0 ||
        c->dh_split > MAX_SPLIT)
        return 0;
    const int64_t nc = chunk_rows_of(c);
    const int S = want_grad ? split_of(c, nc) : 1;
    return plan_of(c, nc, want_grad, S).total + HDR_BYTES + (size_t)c->N * sizeof(float);
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
