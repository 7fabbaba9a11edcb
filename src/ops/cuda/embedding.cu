/* Token embedding on the GPU: the gather and its deterministic scatter-add backward
 * (include/linmoe/cuda_layers.h has the contract; the CPU semantics are those of
 * src/model/model.c, run_forward and the "embedding rows" step of the backward).
 *
 * Forward: one warp per token row, 16-byte copies of the weight row (scalar copies when
 * D % 8 != 0 or a pointer is not 16-byte aligned).
 *
 * Backward, without floating-point atomics:
 *   1. keys[n] = id << bits(N) | n (an out-of-range id becomes the sentinel V), in 32
 *      bits when bits(N - 1) + bits(V) <= 32, else 64; CUB's radix sort, stable, sorts
 *      them on their id bits only (ceil(bits(V) / 8) passes: 2 at V = 50304), and the
 *      keys are made in token order, so they end up in one order: by id, then by token;
 *   2. the sorted positions are cut into chunks of CHUNK2 = 16; a CTA per (chunk, 1024
 *      or 128 columns) walks the runs of equal ids of its chunk and sums each run's piece
 *      in fp32 registers. A piece whose run lies inside the chunk is added to
 *      dweight[id] directly (no other CTA touches that row). A piece whose run continues
 *      past the chunk start goes to part[chunk][0], one that only continues past the
 *      chunk end to part[chunk][1];
 *   3. for every run that crosses a chunk boundary, the CTA of the chunk where it starts
 *      adds part[start][1] and part[c][0] of the following chunks in a fixed grouping,
 *      then dweight[id] += that sum.
 * Every run is summed in token order and every dweight row gets exactly one addition,
 * so the result is the same on every run (and matches the CPU's token order up to the
 * fp32 rounding of adding the run's sum once instead of term by term). The first
 * backward kernels (64-bit keys sorted on all bits, chunks of 32), which lost their A/B
 * test, are described in dev/layers_variants.md.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "linmoe/cuda_layers.h"
#include "ops/cuda/ctx.cuh"
#include "ops/cuda/layers_variants.h"

namespace {

constexpr int BWD_THREADS = 128; /* column vectors per CTA in the backward */

template <int VEC> struct Pk;
template <> struct Pk<8> {
    typedef uint4 T;
    static __device__ __forceinline__ T zero() { return make_uint4(0, 0, 0, 0); }
};
template <> struct Pk<1> {
    typedef unsigned short T;
    static __device__ __forceinline__ T zero() { return 0; }
};

__device__ __forceinline__ void add_bf16(float (&a)[8], const uint4 &v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        a[2 * i] += __uint_as_float(w[i] << 16);
        a[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void add_bf16(float (&a)[1], const unsigned short &v) {
    a[0] += __uint_as_float((uint32_t)v << 16);
}

/* dst[0..VEC) += a (fp32 row segment). */
template <int VEC> __device__ __forceinline__ void add_to(float *dst, const float (&a)[VEC]) {
    if constexpr (VEC == 8) {
        float4 *d = reinterpret_cast<float4 *>(dst);
        float4 u = d[0], w = d[1];
        u.x += a[0], u.y += a[1], u.z += a[2], u.w += a[3];
        w.x += a[4], w.y += a[5], w.z += a[6], w.w += a[7];
        d[0] = u;
        d[1] = w;
    } else {
        dst[0] += a[0];
    }
}
template <int VEC> __device__ __forceinline__ void put(float *dst, const float (&a)[VEC]) {
    if constexpr (VEC == 8) {
        float4 *d = reinterpret_cast<float4 *>(dst);
        d[0] = make_float4(a[0], a[1], a[2], a[3]);
        d[1] = make_float4(a[4], a[5], a[6], a[7]);
    } else {
        dst[0] = a[0];
    }
}
template <int VEC> __device__ __forceinline__ void get_add(float (&a)[VEC], const float *src) {
    if constexpr (VEC == 8) {
        const float4 *s = reinterpret_cast<const float4 *>(src);
        const float4 u = s[0], w = s[1];
        a[0] += u.x, a[1] += u.y, a[2] += u.z, a[3] += u.w;
        a[4] += w.x, a[5] += w.y, a[6] += w.z, a[7] += w.w;
    } else {
        a[0] += src[0];
    }
}

/* ---------------------------------------------------------------- forward */

template <int VEC>
__global__ void __launch_bounds__(256)
    emb_fwd(const int32_t *__restrict__ ids, const __nv_bfloat16 *__restrict__ W,
            __nv_bfloat16 *__restrict__ out, int64_t N, int V, int D, int32_t *n_bad) {
    typedef typename Pk<VEC>::T P;
    constexpr int U = 4;
    const int lane = threadIdx.x & 31, nvec = D / VEC;
    const int64_t w0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t ws = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t row = w0; row < N; row += ws) {
        const int32_t id = __ldg(ids + row);
        const bool valid = id >= 0 && id < V;
        if (!valid && lane == 0 && n_bad)
            atomicAdd(n_bad, 1);
        const P *src = reinterpret_cast<const P *>(W + (valid ? (int64_t)id * D : 0));
        P *dst = reinterpret_cast<P *>(out + row * D);
        for (int v0 = lane; v0 < nvec; v0 += 32 * U) {
            P t[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int v = v0 + 32 * u;
                t[u] = (valid && v < nvec) ? __ldg(src + v) : Pk<VEC>::zero();
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int v = v0 + 32 * u;
                if (v < nvec)
                    dst[v] = t[u];
            }
        }
    }
}

/* ---------------------------------------------------------------- helpers */

bool al16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

int bits_for(uint64_t x) { /* bits to hold the value x (>= 1) */
    int b = 1;
    while (b < 64 && (x >> b) != 0)
        b++;
    return b;
}

size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

lm_status check(const char *op, int64_t N, int V, int D, const int32_t *ids, const void *a,
                const void *b, const char *an, const char *bn, lm_error *err) {
    if (N < 0 || N >= ((int64_t)1 << 31))
        return lm_errorf(err, LM_ERR_INVALID, "%s: N = %lld must be in [0, 2^31)", op,
                         (long long)N);
    if (V < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: V = %d must be >= 1", op, V);
    if (D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: D = %d must be >= 1", op, D);
    if (N > 0 && (!ids || !a || !b))
        return lm_errorf(err, LM_ERR_INVALID, "%s: '%s' is required", op,
                         !ids ? "ids"
                         : !a ? an
                              : bn);
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

/* The backward (layers_variants.h), steps 2 and 3 of the file comment in detail:
 *   2. per run of equal ids in the chunk, the CTA issues the dweight row's load and the
 *      loads of the run's dout rows (8 at a time) together before summing, so that each
 *      run costs about one memory latency;
 *   3. a run that crosses chunks is finished by the CTA of its first chunk: 256 threads
 *      find how many following chunks it covers from their first keys at once, then
 *      8 groups of 128 column threads sum every 8th partial (8 loads per batch) and the
 *      group sums are added in group order.
 * The order depends on the ids and the shape only. */
constexpr int CHUNK2 = 16;
constexpr int CROSS_G = 8;                     /* groups of column threads */
constexpr int CROSS_T = CROSS_G * BWD_THREADS; /* 1024 */

template <typename K> struct BwdP2 {
    const K *keys; /* sorted */
    const __nv_bfloat16 *dout;
    float *dW, *part;
    int64_t N;
    int nb, V, D;
};

template <typename K> __device__ __forceinline__ int key_id2(const BwdP2<K> &p, int64_t s) {
    return (int)(p.keys[s] >> p.nb);
}

template <int VEC, typename K>
__global__ void __launch_bounds__(BWD_THREADS) emb_bwd_chunk2(const BwdP2<K> p) {
    typedef typename Pk<VEC>::T P;
    __shared__ int sid[CHUNK2];
    __shared__ int spos[CHUNK2];
    __shared__ int nbr[2];
    const int64_t c = blockIdx.x, s0 = c * CHUNK2;
    const int n = (int)(p.N - s0 < CHUNK2 ? p.N - s0 : CHUNK2);
    const K mask = (K)(((K)1 << p.nb) - 1);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const K k = p.keys[s0 + i];
        sid[i] = (int)(k >> p.nb);
        spos[i] = (int)(k & mask);
    }
    if (threadIdx.x == 0) {
        nbr[0] = c > 0 ? key_id2(p, s0 - 1) : -1;
        nbr[1] = s0 + n < p.N ? key_id2(p, s0 + n) : -1;
    }
    __syncthreads();
    const int v = blockIdx.y * BWD_THREADS + threadIdx.x;
    if (v >= p.D / VEC)
        return;
    const int64_t col = (int64_t)v * VEC;
    for (int j = 0; j < n;) {
        const int id = sid[j];
        int e = j + 1;
        while (e < n && sid[e] == id)
            e++;
        if (id < p.V) { /* the sentinel of out-of-range ids contributes nothing */
            const bool lopen = j == 0 && id == nbr[0];
            const bool ropen = e == n && id == nbr[1];
            const bool direct = !lopen && !ropen;
            float *dst = direct ? p.dW + (int64_t)id * p.D + col
                                : p.part + (c * 2 + (lopen ? 0 : 1)) * p.D + col;
            float old[VEC];
            if (direct) { /* the row's load goes out with the first dout loads */
#pragma unroll
                for (int i = 0; i < VEC; i++)
                    old[i] = 0.0f;
                get_add<VEC>(old, dst);
            }
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; i++)
                acc[i] = 0.0f;
            for (int b0 = j; b0 < e; b0 += 8) {
                P r[8];
#pragma unroll
                for (int q = 0; q < 8; q++)
                    if (b0 + q < e)
                        r[q] = __ldg(reinterpret_cast<const P *>(
                            p.dout + (int64_t)spos[b0 + q] * p.D + col));
#pragma unroll
                for (int q = 0; q < 8; q++)
                    if (b0 + q < e)
                        add_bf16(acc, r[q]);
            }
            if (direct) {
#pragma unroll
                for (int i = 0; i < VEC; i++)
                    acc[i] = old[i] + acc[i]; /* dW += the run's sum */
            }
            put<VEC>(dst, acc);
        }
        j = e;
    }
}

template <int VEC, typename K>
__global__ void __launch_bounds__(CROSS_T) emb_bwd_cross2(const BwdP2<K> p) {
    __shared__ int ext;       /* following chunks the run covers */
    __shared__ int first_out; /* first of the 256 probed chunks outside the run */
    __shared__ float gsum[CROSS_G - 1][BWD_THREADS * VEC]; /* the sums of groups 1.. */
    const int64_t c = blockIdx.x, s0 = c * CHUNK2, s1 = s0 + CHUNK2;
    if (s1 >= p.N)
        return;
    const int k = key_id2(p, s1 - 1);
    if (k >= p.V || key_id2(p, s1) != k)
        return; /* the chunk's last run ends inside it */
    if (c > 0 && key_id2(p, s0) == k && key_id2(p, s0 - 1) == k)
        return; /* the run started in an earlier chunk */
    /* extent: chunks c + 1 .. c + ext hold pieces of the run at their start */
    if (threadIdx.x == 0)
        ext = 0;
    for (;;) {
        __syncthreads();
        if (threadIdx.x == 0)
            first_out = 256;
        __syncthreads();
        const int base = ext;
        if (threadIdx.x < 256) {
            const int64_t s = (c + 1 + base + threadIdx.x) * CHUNK2;
            if (s >= p.N || key_id2(p, s) != k)
                atomicMin(&first_out, (int)threadIdx.x); /* an integer minimum */
        }
        __syncthreads();
        const int f = first_out;
        __syncthreads();
        if (threadIdx.x == 0)
            ext = base + f;
        if (f < 256)
            break;
    }
    __syncthreads();
    const int m = ext;
    const int g = threadIdx.x / BWD_THREADS, t = threadIdx.x % BWD_THREADS;
    const int v = blockIdx.y * BWD_THREADS + t;
    const bool on = v < p.D / VEC;
    const int64_t col = (int64_t)v * VEC;
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i++)
        acc[i] = 0.0f;
    if (on) {
        /* group g: the pieces of chunks c + 1 + i for i = g, g + 8, ... in order, 8 loads
         * in flight (unconditional, from a clamped index; a piece past the run is
         * weighted by 0, which adds exact zeros) */
        for (int i0 = g; i0 < m; i0 += CROSS_G * 8) {
            float r[8][VEC];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int i = i0 + CROSS_G * q < m ? i0 + CROSS_G * q : m - 1;
                const float *src = p.part + ((c + 1 + i) * 2 + 0) * p.D + col;
                if constexpr (VEC == 8) {
                    const float4 a = __ldg(reinterpret_cast<const float4 *>(src));
                    const float4 b = __ldg(reinterpret_cast<const float4 *>(src) + 1);
                    r[q][0] = a.x, r[q][1] = a.y, r[q][2] = a.z, r[q][3] = a.w;
                    r[q][4] = b.x, r[q][5] = b.y, r[q][6] = b.z, r[q][7] = b.w;
                } else {
                    r[q][0] = __ldg(src);
                }
            }
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const float wq = i0 + CROSS_G * q < m ? 1.0f : 0.0f;
#pragma unroll
                for (int x = 0; x < VEC; x++)
                    acc[x] += wq * r[q][x];
            }
        }
        if (g > 0)
#pragma unroll
            for (int x = 0; x < VEC; x++)
                gsum[g - 1][t * VEC + x] = acc[x];
    }
    __syncthreads();
    if (g == 0 && on) {
        float tot[VEC];
#pragma unroll
        for (int x = 0; x < VEC; x++)
            tot[x] = 0.0f;
        get_add<VEC>(tot, p.part + (c * 2 + 1) * p.D + col); /* the piece in chunk c */
#pragma unroll
        for (int x = 0; x < VEC; x++)
            tot[x] += acc[x];
        for (int gg = 0; gg < CROSS_G - 1; gg++)
#pragma unroll
            for (int x = 0; x < VEC; x++)
                tot[x] += gsum[gg][t * VEC + x];
        add_to<VEC>(p.dW + (int64_t)k * p.D + col, tot);
    }
}

template <typename K>
__global__ void emb_keys2(const int32_t *__restrict__ ids, int64_t N, int V, int nb,
                          K *__restrict__ keys) {
    const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N)
        return;
    const int32_t id = ids[n];
    const K k = (id >= 0 && id < V) ? (K)id : (K)(unsigned)V;
    keys[n] = (K)((k << nb) | (K)n);
}

template <typename K>
lm_status emb_bwd2(lm_cuda_ctx *ctx, int64_t N, int V, int D, const int32_t *ids, const void *dout,
                   float *dweight, lm_error *err) {
    const int nb = bits_for((uint64_t)(N - 1));
    const int end_bit = nb + bits_for((uint64_t)V);
    const int64_t nchunks = (N + CHUNK2 - 1) / CHUNK2;
    size_t temp_bytes = 0;
    K *knull = nullptr;
    LM_CK(cub::DeviceRadixSort::SortKeys(nullptr, temp_bytes, knull, knull, (int)N, nb, end_bit,
                                         ctx->stream));
    const size_t kb = align256((size_t)N * sizeof(K));
    const size_t pb = align256((size_t)nchunks * 2 * D * sizeof(float));
    void *s = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, 2 * kb + pb + temp_bytes, &s, err));
    unsigned char *base = (unsigned char *)s;
    K *keys_in = (K *)base;
    K *keys = (K *)(base + kb);
    float *part = (float *)(base + 2 * kb);
    void *temp = base + 2 * kb + pb;
    emb_keys2<K><<<(unsigned)((N + 255) / 256), 256, 0, ctx->stream>>>(ids, N, V, nb, keys_in);
    LM_CK_LAUNCH("emb_keys2");
    LM_CK(cub::DeviceRadixSort::SortKeys(temp, temp_bytes, keys_in, keys, (int)N, nb, end_bit,
                                         ctx->stream));
    BwdP2<K> p;
    p.keys = keys;
    p.dout = (const __nv_bfloat16 *)dout;
    p.dW = dweight;
    p.part = part;
    p.N = N;
    p.nb = nb;
    p.V = V;
    p.D = D;
    const bool vec = D % 8 == 0 && al16(dout) && al16(dweight);
    const int nvec = vec ? D / 8 : D;
    const dim3 grid((unsigned)nchunks, (unsigned)((nvec + BWD_THREADS - 1) / BWD_THREADS));
    if (vec) {
        emb_bwd_chunk2<8, K><<<grid, BWD_THREADS, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("emb_bwd_chunk2");
        emb_bwd_cross2<8, K><<<grid, CROSS_T, 0, ctx->stream>>>(p);
    } else {
        emb_bwd_chunk2<1, K><<<grid, BWD_THREADS, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("emb_bwd_chunk2");
        emb_bwd_cross2<1, K><<<grid, CROSS_T, 0, ctx->stream>>>(p);
    }
    LM_CK_LAUNCH("emb_bwd_cross2");
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_cuda_embedding_forward(lm_cuda_ctx *ctx, int64_t N, int V, int D,
                                               const int32_t *ids, const void *weight, void *out,
                                               int32_t *n_bad, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check("embedding", N, V, D, ids, weight, out, "weight", "out", err));
    if (N == 0)
        return LM_OK;
    const __nv_bfloat16 *W = (const __nv_bfloat16 *)weight;
    __nv_bfloat16 *o = (__nv_bfloat16 *)out;
    int64_t blocks = (N + 7) / 8; /* a warp per row, 8 warps per CTA */
    if (blocks > (int64_t)ctx->sm_count * 8)
        blocks = (int64_t)ctx->sm_count * 8;
    if (D % 8 == 0 && al16(W) && al16(o))
        emb_fwd<8><<<(unsigned)blocks, 256, 0, ctx->stream>>>(ids, W, o, N, V, D, n_bad);
    else
        emb_fwd<1><<<(unsigned)blocks, 256, 0, ctx->stream>>>(ids, W, o, N, V, D, n_bad);
    LM_CK_LAUNCH("emb_fwd");
    return LM_OK;
}

extern "C" lm_status lm_cuda_embedding_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int V,
                                                  int D, const int32_t *ids, const void *dout,
                                                  float *dweight, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (variant < 0 || variant > LM_LAYERS_EMB_BWD_VARIANTS)
        return lm_errorf(err, LM_ERR_INVALID, "embedding backward: variant = %d is outside [0, %d]",
                         variant, LM_LAYERS_EMB_BWD_VARIANTS);
    LM_TRY(check("embedding backward", N, V, D, ids, dout, dweight, "dout", "dweight", err));
    if (N == 0)
        return LM_OK;
    const int bits = bits_for((uint64_t)(N - 1)) + bits_for((uint64_t)V);
    return bits <= 32 ? emb_bwd2<unsigned>(ctx, N, V, D, ids, dout, dweight, err)
                      : emb_bwd2<unsigned long long>(ctx, N, V, D, ids, dout, dweight, err);
}

extern "C" lm_status lm_cuda_embedding_backward(lm_cuda_ctx *ctx, int64_t N, int V, int D,
                                                const int32_t *ids, const void *dout,
                                                float *dweight, lm_error *err) {
    return lm_cuda_embedding_backward_v(ctx, 0, N, V, D, ids, dout, dweight, err);
}
