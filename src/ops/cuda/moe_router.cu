/* MoE router on CUDA (include/linmoe/cuda_router.h): forward (scores, biased top-k with
 * group limiting, weights, capacity), aux loss, backward, step accumulators, bias update,
 * metrics and the quantile dual solve. The CPU reference is src/ops/moe_router.c and
 * src/ops/moe_balance.c; every per-token operation below is the CPU's, in its order,
 * so that indices, scores and weights match it bit for bit (reference/moe.md §1-§5).
 *
 * Layout of one warp's token row: lane `lane` holds EPL scores, element i being expert
 *   e = (i / V) * 32V + lane * V + i % V
 * (V = 4 or 2: vector loads when E is a multiple of 32V; V = 1 otherwise), so each lane's
 * experts ascend with i and a warp reads a row with 16-byte (8-, 4-byte) coalesced
 * loads. Experts e >= E are padding and never selected.
 */
#include <cuda_runtime.h>

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/cuda_router.h"
#include "ops/cuda/ctx.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 8; /* warps per block of the per-token kernels */
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 32;                   /* tokens per router block = capacity tile */
constexpr int kTokPerWarp = kTile / kWarps; /* 4 */
constexpr int kAuxTile = 64;                /* tokens per aux-loss partial */
constexpr double kDenomEps = 1e-20;         /* ROUTER_DENOM_EPS of the CPU */

/* ---------------------------------------------------------------- small helpers */

struct SumOp {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
    template <typename T> __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct MinOp {
    template <typename T> __device__ T operator()(T a, T b) const { return a < b ? a : b; }
};

template <typename T, typename Op> __device__ __forceinline__ T warp_allreduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o; o >>= 1)
        v = op(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

/* Block-wide reduction returned to every thread; fixed order (warp butterflies, then
 * the warp results in warp order), so the result does not depend on scheduling. sh:
 * shared scratch of >= 32 T. Every thread of the block must call it. */
template <typename T, typename Op> __device__ T block_allreduce(T v, Op op, T *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_allreduce(v, op);
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0)
        sh[w] = v;
    __syncthreads();
    T r = sh[0];
    for (int i = 1; i < nw; i++)
        r = op(r, sh[i]);
    return r;
}

/* Exclusive prefix sum over the block (thread order); *total = the block's sum. */
__device__ int block_exclusive_scan(int v, int *sh, int *total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(kFull, incl, o);
        if (lane >= o)
            incl += u;
    }
    __syncthreads();
    if (lane == 31)
        sh[w] = incl;
    __syncthreads();
    int pre = 0, tot = 0;
    for (int i = 0; i < nw; i++) {
        pre += i < w ? sh[i] : 0;
        tot += sh[i];
    }
    *total = tot;
    return pre + incl - v;
}

template <int V> __device__ __forceinline__ int elem_expert(int i, int lane) {
    return (i / V) * (32 * V) + lane * V + (i % V);
}

template <int EPL, int V>
__device__ __forceinline__ void load_row(const float *row, int E, int lane, float (&x)[EPL]) {
    if constexpr (V == 4) {
#pragma unroll
        for (int j = 0; j < EPL / 4; j++) {
            const int e0 = j * 128 + lane * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (e0 < E)
                v = *reinterpret_cast<const float4 *>(row + e0);
            x[4 * j] = v.x, x[4 * j + 1] = v.y, x[4 * j + 2] = v.z, x[4 * j + 3] = v.w;
        }
    } else if constexpr (V == 2) {
#pragma unroll
        for (int j = 0; j < EPL / 2; j++) {
            const int e0 = j * 64 + lane * 2;
            float2 v = make_float2(0.f, 0.f);
            if (e0 < E)
                v = *reinterpret_cast<const float2 *>(row + e0);
            x[2 * j] = v.x, x[2 * j + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            const int e = i * 32 + lane;
            x[i] = e < E ? row[e] : 0.f;
        }
    }
}

template <int EPL, int V>
__device__ __forceinline__ void store_row(float *row, int E, int lane, const float (&x)[EPL]) {
    if constexpr (V == 4) {
#pragma unroll
        for (int j = 0; j < EPL / 4; j++) {
            const int e0 = j * 128 + lane * 4;
            if (e0 < E)
                *reinterpret_cast<float4 *>(row + e0) =
                    make_float4(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]);
        }
    } else if constexpr (V == 2) {
#pragma unroll
        for (int j = 0; j < EPL / 2; j++) {
            const int e0 = j * 64 + lane * 2;
            if (e0 < E)
                *reinterpret_cast<float2 *>(row + e0) = make_float2(x[2 * j], x[2 * j + 1]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            const int e = i * 32 + lane;
            if (e < E)
                row[e] = x[i];
        }
    }
}

/* glibc's expf is correctly rounded (but for rare misroundings); the fp64 exponential
 * rounded once to fp32 is too, so s matches the CPU's bit for bit. */
__device__ __forceinline__ float exp_f32(float x) { return (float)exp((double)x); }

/* Scores of one token in place: sigmoid 1 / (1 + e^-x), or softmax over the E experts
 * (fp32 exponentials of x - max, fp64 sum, fp64 reciprocal, rounded once): the CPU's
 * token_scores. */
template <int EPL, int V>
__device__ __forceinline__ void token_scores(float (&x)[EPL], int E, int lane, int softmax) {
    if (!softmax) {
#pragma unroll
        for (int i = 0; i < EPL; i++)
            x[i] = 1.0f / (1.0f + exp_f32(-x[i]));
        return;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < EPL; i++)
        if (elem_expert<V>(i, lane) < E)
            mx = fmaxf(mx, x[i]);
    mx = warp_allreduce(mx, MaxOp());
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        if (elem_expert<V>(i, lane) < E) {
            x[i] = exp_f32(x[i] - mx);
            sum += (double)x[i];
        }
    }
    sum = warp_allreduce(sum, SumOp());
    const double inv = 1.0 / sum;
#pragma unroll
    for (int i = 0; i < EPL; i++)
        x[i] = (float)((double)x[i] * inv);
}

/* One round of the warp arg-max over the lanes' keys not yet taken (bit i of `taken`):
 * the largest key, ties to the lower expert id (the CPU's topk_push order). Returns the
 * winner's id (the same in every lane) and its key in *kout; marks it taken in its
 * owner lane. Needs at least one element not taken in the warp. */
template <int EPL, int V>
__device__ __forceinline__ int warp_argmax_take(const float (&key)[EPL], uint32_t &taken, int lane,
                                                float *kout) {
    float bk = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        const int e = elem_expert<V>(i, lane);
        if (!((taken >> i) & 1u) && (key[i] > bk || (key[i] == bk && e < bi))) {
            bk = key[i];
            bi = e;
        }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const float ok = __shfl_xor_sync(kFull, bk, o);
        const int oi = __shfl_xor_sync(kFull, bi, o);
        if (ok > bk || (ok == bk && oi < bi)) {
            bk = ok;
            bi = oi;
        }
    }
#pragma unroll
    for (int i = 0; i < EPL; i++)
        if (elem_expert<V>(i, lane) == bi)
            taken |= 1u << i;
    *kout = bk;
    return bi;
}

/* The value of expert e's element held by its owner lane, broadcast to the warp. */
template <int EPL, int V>
__device__ __forceinline__ float warp_fetch(const float (&x)[EPL], int e, int lane) {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; i++)
        if (elem_expert<V>(i, lane) == e)
            v = x[i];
    return __shfl_sync(kFull, v, (e % (32 * V)) / V);
}

/* Order-preserving map of fp32 to uint32 (larger float = larger key); -0 as +0. */
__device__ __forceinline__ uint32_t f2key(float f) {
    const uint32_t u = __float_as_uint(f + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key2f(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
/* Capacity key of assignment a: higher score first, then the earlier assignment (token
 * order; a token holds an expert at most once). Unique per assignment. */
__device__ __forceinline__ uint64_t cap_key(float s, int a) {
    return ((uint64_t)f2key(s) << 32) | (uint64_t)(0xffffffffu - (uint32_t)a);
}

/* The key of rank `rank` (0 = largest) among n keys load(0..n), by most-significant-digit
 * radix select with 8-bit digits; *gt = how many keys are strictly larger. Exact, and
 * independent of the order of the shared-memory atomics (integer counts). hist: shared
 * int[256]; sh: shared int[4]. Every thread of the block calls it. */
template <typename K, typename Load>
__device__ K block_radix_select(Load load, int n, int rank, int *hist, int *sh, int *gt) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    K prefix = 0, mask = 0;
    int r = rank, above = 0;
    for (int shift = (int)sizeof(K) * 8 - 8; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            hist[i] = 0;
        __syncthreads();
        for (int i0 = 0; i0 < n; i0 += blockDim.x) { /* uniform trip count: match_any */
            const int i = i0 + threadIdx.x;
            int bin = -1;
            if (i < n) {
                const K key = load(i);
                if ((key & mask) == prefix)
                    bin = (int)((key >> shift) & 0xff);
            }
            const unsigned peers = __match_any_sync(kFull, bin);
            if (bin >= 0 && lane == __ffs(peers) - 1)
                atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (warp == 0) {
            /* lane l holds bins 255 - 8l - j, j = 0..7 (descending) */
            int cnt[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                cnt[j] = hist[255 - 8 * lane - j];
                tot += cnt[j];
            }
            int incl = tot;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(kFull, incl, o);
                if (lane >= o)
                    incl += u;
            }
            const int excl = incl - tot;
            const unsigned here = __ballot_sync(kFull, r >= excl && r < incl);
            if (lane == __ffs(here) - 1) {
                int acc = excl;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (r < acc + cnt[j]) {
                        sh[0] = 255 - 8 * lane - j;
                        sh[1] = r - acc;
                        sh[2] = acc;
                        break;
                    }
                    acc += cnt[j];
                }
            }
        }
        __syncthreads();
        const int bin = sh[0];
        r = sh[1];
        above += sh[2];
        prefix |= (K)bin << shift;
        mask |= (K)0xff << shift;
        __syncthreads();
    }
    *gt = above;
    return prefix;
}

/* ---------------------------------------------------------------- router forward */

struct RouterParams {
    const float *logits; /* [T, E] */
    const float *bias;   /* [E] or null */
    float *scores;       /* [T, E] or null */
    int32_t *topk_idx;   /* [T, k] */
    float *topk_weight;  /* [T, k] */
    int32_t *sel_idx;    /* [T, k] or null */
    int32_t *hist;       /* [E, nb] per-block selection counts */
    int32_t *n_dropped;  /* [2] or null: zeroed by block 0 */
    int T, E, k, nb;
    int softmax, norm;
    double scale;
    int n_group, gsz, topk_group;
};

template <int EPL, int V>
__global__ void __launch_bounds__(kThreads, EPL >= 16 ? 1 : 2) router_fwd_kernel(RouterParams p) {
    extern __shared__ int sh_cnt[]; /* [E] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < p.E; e += kThreads)
        sh_cnt[e] = 0;
    if (blockIdx.x == 0 && threadIdx.x < 2 && p.n_dropped)
        p.n_dropped[threadIdx.x] = 0;
    float b[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        const int e = elem_expert<V>(i, lane);
        b[i] = (p.bias && e < p.E) ? p.bias[e] : 0.f;
    }
    __syncthreads();
    for (int tt = 0; tt < kTokPerWarp; tt++) {
        const int t = blockIdx.x * kTile + warp * kTokPerWarp + tt;
        if (t >= p.T)
            break;
        float s[EPL], key[EPL];
        load_row<EPL, V>(p.logits + (size_t)t * p.E, p.E, lane, s);
        token_scores<EPL, V>(s, p.E, lane, p.softmax);
        if (p.scores)
            store_row<EPL, V>(p.scores + (size_t)t * p.E, p.E, lane, s);
        uint32_t taken = 0; /* padding, masked groups and the already selected */
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            const int e = elem_expert<V>(i, lane);
            key[i] = p.bias ? s[i] + b[i] : s[i];
            if (key[i] != key[i])
                key[i] = -INFINITY; /* NaN: ranks last, still a valid expert */
            if (e >= p.E)
                taken |= 1u << i;
        }
        if (p.n_group > 1) {
            /* group score: the sum of the group's top-2 keys (the max when groups have one
             * expert); the topk_group best groups (ties: lower group) stay selectable */
            float my_gs = -INFINITY;
            for (int g = 0; g < p.n_group; g++) {
                const int lo = g * p.gsz, hi = lo + p.gsz;
                float m1 = -INFINITY, m2 = -INFINITY;
#pragma unroll
                for (int i = 0; i < EPL; i++) {
                    const int e = elem_expert<V>(i, lane);
                    if (e >= lo && e < hi && e < p.E) {
                        const float v = key[i];
                        if (v > m1) {
                            m2 = m1;
                            m1 = v;
                        } else if (v > m2) {
                            m2 = v;
                        }
                    }
                }
#pragma unroll
                for (int o = 16; o; o >>= 1) {
                    const float o1 = __shfl_xor_sync(kFull, m1, o);
                    const float o2 = __shfl_xor_sync(kFull, m2, o);
                    const float n2 = fmaxf(fminf(m1, o1), fmaxf(m2, o2));
                    m1 = fmaxf(m1, o1);
                    m2 = n2;
                }
                const float gs = p.gsz >= 2 ? m1 + m2 : m1;
                if (lane == g)
                    my_gs = gs;
            }
            int rank = 0;
            for (int g2 = 0; g2 < p.n_group; g2++) {
                const float v = __shfl_sync(kFull, my_gs, g2);
                rank += (v > my_gs) || (v == my_gs && g2 < lane);
            }
            const uint32_t gmask = __ballot_sync(kFull, lane < p.n_group && rank < p.topk_group);
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                const int e = elem_expert<V>(i, lane);
                if (e < p.E && !((gmask >> (e / p.gsz)) & 1u))
                    taken |= 1u << i;
            }
        }
        double Z = 0.0;
        int my_id = 0;
        float my_s = 0.f;
        for (int j = 0; j < p.k; j++) {
            float kv;
            const int id = warp_argmax_take<EPL, V>(key, taken, lane, &kv);
            const float sv = warp_fetch<EPL, V>(s, id, lane);
            Z += (double)sv; /* slot order: the CPU's sum */
            if (lane == j) {
                my_id = id;
                my_s = sv;
            }
        }
        const double mul = p.norm ? p.scale / (Z + kDenomEps) : p.scale;
        if (lane < p.k) {
            const size_t a = (size_t)t * p.k + lane;
            p.topk_idx[a] = my_id;
            p.topk_weight[a] = (float)((double)my_s * mul);
            if (p.sel_idx)
                p.sel_idx[a] = my_id;
            atomicAdd(&sh_cnt[my_id], 1); /* integer: order-free */
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < p.E; e += kThreads)
        p.hist[(size_t)e * p.nb + blockIdx.x] = sh_cnt[e];
}

/* Per expert (one block each): the selections of each router block turned into each
 * block's exclusive rank base (in place, when `bases`), demand = their total, counts =
 * min(demand, C) (C = 0: dropless). */
__global__ void __launch_bounds__(256)
    expert_scan_kernel(int32_t *hist, int nb, int C, int bases, int32_t *demand, int32_t *counts) {
    __shared__ int sh[32];
    const int e = blockIdx.x;
    int32_t *row = hist + (size_t)e * nb;
    const int per = (nb + blockDim.x - 1) / blockDim.x;
    const int b0 = threadIdx.x * per, b1 = min(nb, b0 + per);
    int loc = 0;
    for (int b = b0; b < b1; b++)
        loc += row[b];
    int total = 0;
    int run = block_exclusive_scan(loc, sh, &total);
    if (bases)
        for (int b = b0; b < b1; b++) {
            const int v = row[b];
            row[b] = run;
            run += v;
        }
    if (threadIdx.x == 0) {
        demand[e] = total;
        counts[e] = (C > 0 && total > C) ? C : total;
    }
}

/* Capacity, per 32-token tile (one warp each, 8 per block): the rank of each assignment
 * among its expert's, in token order = the tile's rank base + the rank inside the tile
 * (match_any over 32 assignments at a time, then a per-warp running count per expert).
 * Only experts over capacity are ranked. position: drop rank >= C here. probs: scatter
 * each ranked assignment's key into its expert's bucket at that rank. */
struct CapParams {
    const int32_t *sel;    /* [T, k] */
    int32_t *topk_idx;     /* [T, k] */
    float *topk_weight;    /* [T, k] */
    const int32_t *bases;  /* [E, nb] */
    const int32_t *demand; /* [E] */
    const float *scores;   /* [T, E] (probs) */
    uint64_t *bucket;      /* [sum of over-full demand] (probs) */
    int32_t *off;          /* [E] bucket offsets out (probs; written by block 0) */
    int32_t *n_dropped;    /* [2] */
    int T, E, k, nb, C, probs;
};

__global__ void __launch_bounds__(kThreads) cap_rank_kernel(CapParams p) {
    extern __shared__ int sh_cap[]; /* cnt [kWarps][E], off [E], scan [32] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int *cnt = sh_cap + warp * p.E;
    int *off = sh_cap + kWarps * p.E;
    int *scan = off + p.E;
    for (int i = threadIdx.x; i < kWarps * p.E; i += kThreads)
        sh_cap[i] = 0;
    if (p.probs) {
        /* bucket offsets: exclusive prefix over the over-full experts' demand */
        int carry = 0;
        for (int e0 = 0; e0 < p.E; e0 += kThreads) {
            const int e = e0 + threadIdx.x;
            const int d = (e < p.E && p.demand[e] > p.C) ? p.demand[e] : 0;
            int tot = 0;
            const int ex = block_exclusive_scan(d, scan, &tot);
            if (e < p.E) {
                off[e] = carry + ex;
                if (blockIdx.x == 0)
                    p.off[e] = carry + ex;
            }
            carry += tot;
        }
    }
    __syncthreads();
    const int tile = blockIdx.x * kWarps + warp;
    if (tile >= p.nb)
        return;
    const int64_t a0 = (int64_t)tile * kTile * p.k;
    const int64_t a1 = min((int64_t)p.T * p.k, a0 + (int64_t)kTile * p.k);
    const unsigned lt = (1u << lane) - 1u;
    uint32_t tok = 0;
    for (int64_t c0 = a0; c0 < a1; c0 += 32) {
        const int64_t a = c0 + lane;
        int e = -1;
        if (a < a1) {
            e = p.sel[a];
            if (p.demand[e] <= p.C)
                e = -1;
        }
        const unsigned peers = __match_any_sync(kFull, e);
        const int r = e >= 0 ? cnt[e] + __popc(peers & lt) : 0;
        __syncwarp();
        if (e >= 0 && lane == 31 - __clz(peers))
            cnt[e] += __popc(peers);
        __syncwarp();
        if (e >= 0) {
            const int rank = p.bases[(size_t)e * p.nb + tile] + r;
            const int64_t t = a / p.k;
            if (p.probs) {
                p.bucket[off[e] + rank] = cap_key(p.scores[(size_t)t * p.E + e], (int)a);
            } else if (rank >= p.C) {
                p.topk_idx[a] = -1;
                p.topk_weight[a] = 0.f;
                tok |= 1u << (int)(t - (int64_t)tile * kTile);
            }
        }
    }
    if (!p.probs) {
        tok = __reduce_or_sync(kFull, tok);
        if (lane == 0 && tok)
            atomicAdd(&p.n_dropped[1], __popc(tok));
    }
}

/* probs: per over-full expert, the key of its C-th best assignment. */
__global__ void __launch_bounds__(256)
    cap_select_kernel(const uint64_t *bucket, const int32_t *off, const int32_t *demand, int C,
                      uint64_t *thr) {
    __shared__ int hist[256];
    __shared__ int sh[4];
    const int e = blockIdx.x;
    const int n = demand[e];
    if (n <= C)
        return;
    const uint64_t *b = bucket + off[e];
    int gt = 0;
    const uint64_t k =
        block_radix_select<uint64_t>([b](int i) { return b[i]; }, n, C - 1, hist, sh, &gt);
    if (threadIdx.x == 0)
        thr[e] = k;
}

/* probs: drop the assignments below their expert's threshold (thread per token). */
__global__ void __launch_bounds__(256) cap_mark_kernel(CapParams p, const uint64_t *thr) {
    const int lane = threadIdx.x & 31;
    for (int64_t t0 = (int64_t)blockIdx.x * blockDim.x; t0 < p.T;
         t0 += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = t0 + threadIdx.x;
        bool lost = false;
        if (t < p.T) {
            for (int j = 0; j < p.k; j++) {
                const int64_t a = t * p.k + j;
                const int e = p.sel[a];
                if (p.demand[e] > p.C && cap_key(p.scores[(size_t)t * p.E + e], (int)a) < thr[e]) {
                    p.topk_idx[a] = -1;
                    p.topk_weight[a] = 0.f;
                    lost = true;
                }
            }
        }
        const unsigned m = __ballot_sync(kFull, lost);
        if (lane == 0 && m)
            atomicAdd(&p.n_dropped[1], __popc(m));
    }
}

/* ---------------------------------------------------------------- aux loss */

/* Bounds of sequence n of the aux loss: cu (device) or one sequence [0, T). */
__device__ __forceinline__ int seq_bound(const int32_t *cu, int n, int T) {
    return cu ? cu[n] : (n == 0 ? 0 : T);
}

/* Items (sequence, kAuxTile-token chunk): ioff[n] = items before sequence n,
 * ioff[nseq] = all; *nne = non-empty sequences. One block. */
__global__ void __launch_bounds__(256)
    aux_items_kernel(const int32_t *cu, int nseq, int T, int32_t *ioff, int32_t *nne) {
    __shared__ int sh[32];
    int carry = 0, ne = 0;
    for (int n0 = 0; n0 < nseq; n0 += blockDim.x) {
        const int n = n0 + threadIdx.x;
        int c = 0, nonempty = 0;
        if (n < nseq) {
            const int Tn = seq_bound(cu, n + 1, T) - seq_bound(cu, n, T);
            c = Tn > 0 ? (Tn + kAuxTile - 1) / kAuxTile : 0;
            nonempty = Tn > 0;
        }
        int tot = 0;
        const int ex = block_exclusive_scan(c, sh, &tot);
        if (n < nseq)
            ioff[n] = carry + ex;
        carry += tot;
        int tne = 0;
        block_exclusive_scan(nonempty, sh, &tne);
        ne += tne;
    }
    if (threadIdx.x == 0) {
        ioff[nseq] = carry;
        *nne = ne;
    }
}

/* Per item: P partial = sum over its tokens of s' (sigmoid: s / (sum_e s + eps);
 * softmax: s) per expert, fp64 in token order; selection counts per expert. */
__global__ void __launch_bounds__(kThreads)
    aux_partial_kernel(const float *scores, const int32_t *sel, const int32_t *cu, int nseq, int T,
                       int E, int k, int sigmoid, const int32_t *ioff, double *Ppart,
                       int32_t *Cpart) {
    __shared__ double inv[kAuxTile];
    extern __shared__ int sh_aux[]; /* cnt [E] */
    const int item = blockIdx.x;
    if (item >= ioff[nseq])
        return;
    int lo = 0, hi = nseq - 1; /* the n with ioff[n] <= item < ioff[n + 1] */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ioff[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int n = lo;
    const int t0 = seq_bound(cu, n, T) + (item - ioff[n]) * kAuxTile;
    const int t1 = min(t0 + kAuxTile, seq_bound(cu, n + 1, T));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < E; e += kThreads)
        sh_aux[e] = 0;
    for (int t = t0 + warp; t < t1; t += kWarps) {
        double S = 0.0;
        if (sigmoid)
            for (int e = lane; e < E; e += 32)
                S += (double)scores[(size_t)t * E + e];
        S = warp_allreduce(S, SumOp());
        if (lane == 0)
            inv[t - t0] = sigmoid ? 1.0 / (S + kDenomEps) : 1.0;
    }
    __syncthreads();
    for (int64_t a = (int64_t)t0 * k + threadIdx.x; a < (int64_t)t1 * k; a += kThreads)
        atomicAdd(&sh_aux[sel[a]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kThreads) {
        double P = 0.0;
        for (int t = t0; t < t1; t++)
            P += (double)scores[(size_t)t * E + e] * inv[t - t0];
        Ppart[(size_t)item * E + e] = P;
        Cpart[(size_t)item * E + e] = sh_aux[e];
    }
}

/* Per sequence: its loss term alpha * sum_i f_i P_i and the backward coefficients
 * coef[n, i] = alpha E / (k T_n^2 nne) * count_i. */
__global__ void __launch_bounds__(256)
    aux_seq_kernel(const int32_t *cu, int nseq, int T, int E, int k, double alpha,
                   const int32_t *ioff, const int32_t *nne, const double *Ppart,
                   const int32_t *Cpart, double *coef, double *lpart) {
    __shared__ double sh[32];
    const int n = blockIdx.x;
    const int Tn = seq_bound(cu, n + 1, T) - seq_bound(cu, n, T);
    const double mul = Tn > 0 ? alpha * E / ((double)k * Tn * Tn * (double)*nne) : 0.0;
    double l = 0.0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double P = 0.0, cnt = 0.0;
        for (int i = ioff[n]; i < ioff[n + 1]; i++) {
            P += Ppart[(size_t)i * E + e];
            cnt += (double)Cpart[(size_t)i * E + e];
        }
        if (Tn > 0)
            l += ((double)E / ((double)k * Tn) * cnt) * (P / Tn);
        coef[(size_t)n * E + e] = cnt * mul;
    }
    l = block_allreduce(l, SumOp(), sh);
    if (threadIdx.x == 0)
        lpart[n] = alpha * l;
}

__global__ void __launch_bounds__(256)
    aux_final_kernel(const double *lpart, int nseq, const int32_t *nne, float *aux_loss) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int n = threadIdx.x; n < nseq; n += blockDim.x)
        s += lpart[n];
    s = block_allreduce(s, SumOp(), sh);
    if (threadIdx.x == 0)
        *aux_loss = *nne > 0 ? (float)(s / *nne) : 0.0f;
}

/* ---------------------------------------------------------------- step accumulators */

__global__ void __launch_bounds__(256)
    accumulate_kernel(double *acc, const int32_t *demand, const int32_t *counts, int E, int T,
                      int32_t *n_dropped, const float *aux_loss) {
    __shared__ int sh[32];
    int da = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        acc[e] += (double)demand[e];
        acc[E + e] += (double)counts[e];
        da += demand[e] - counts[e];
    }
    da = block_allreduce(da, SumOp(), sh);
    if (threadIdx.x == 0) {
        double *sc = acc + 3 * E;
        n_dropped[0] = da;
        sc[LM_CUDA_ROUTER_ACC_TOKENS] += (double)T;
        sc[LM_CUDA_ROUTER_ACC_DROP_ASSIGN] += (double)da;
        sc[LM_CUDA_ROUTER_ACC_DROP_TOKENS] += (double)n_dropped[1];
        sc[LM_CUDA_ROUTER_ACC_AUX] += aux_loss ? (double)*aux_loss : 0.0;
        sc[LM_CUDA_ROUTER_ACC_NMICRO] += 1.0;
    }
}

/* ---------------------------------------------------------------- quantile solve */

/* Per 32-token tile: alpha_t = the (k+1)-th largest of s_t + b (k+1 arg-max rounds), and
 * the margins s[t, e] - alpha_t written transposed, M [E, T], through shared memory. */
template <int EPL, int V>
__global__ void __launch_bounds__(kThreads)
    qb_alpha_kernel(const float *S, const float *bias, int T, int E, int k1, float *M) {
    extern __shared__ float sh_m[]; /* [kTile][E + 1] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t0 = blockIdx.x * kTile;
    float b[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        const int e = elem_expert<V>(i, lane);
        b[i] = (bias && e < E) ? bias[e] : 0.f;
    }
    for (int tt = 0; tt < kTokPerWarp; tt++) {
        const int tl = warp * kTokPerWarp + tt, t = t0 + tl;
        if (t >= T)
            break;
        float s[EPL], key[EPL];
        load_row<EPL, V>(S + (size_t)t * E, E, lane, s);
        uint32_t taken = 0;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            key[i] = s[i] + b[i]; /* the CPU adds its zero bias too */
            if (elem_expert<V>(i, lane) >= E)
                taken |= 1u << i;
        }
        float alpha = 0.f;
        for (int j = 0; j < k1; j++)
            warp_argmax_take<EPL, V>(key, taken, lane, &alpha);
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            const int e = elem_expert<V>(i, lane);
            if (e < E)
                sh_m[tl * (E + 1) + e] = s[i] - alpha;
        }
    }
    __syncthreads();
    const int t = t0 + lane;
    if (t < T)
        for (int e = warp; e < E; e += kWarps)
            M[(size_t)e * T + t] = sh_m[lane * (E + 1) + e];
}

/* Per expert column of M: beta = the (q+1)-th largest margin, mid = the midpoint between
 * beta and the smallest margin above it when exactly q margins exceed beta. */
__global__ void __launch_bounds__(512)
    qb_column_kernel(const float *M, int T, int q, float *beta, double *mid) {
    __shared__ int hist[256];
    __shared__ int sh[4];
    __shared__ uint32_t shmin;
    const int e = blockIdx.x;
    const float *col = M + (size_t)e * T;
    int above = 0;
    const uint32_t kb = block_radix_select<uint32_t>([col](int i) { return f2key(col[i]); }, T, q,
                                                     hist, sh, &above);
    if (threadIdx.x == 0)
        shmin = 0xffffffffu;
    __syncthreads();
    uint32_t m = 0xffffffffu;
    for (int i = threadIdx.x; i < T; i += blockDim.x) {
        const uint32_t kk = f2key(col[i]);
        if (kk > kb && kk < m)
            m = kk;
    }
    m = warp_allreduce(m, MinOp());
    if ((threadIdx.x & 31) == 0)
        atomicMin(&shmin, m); /* min: order-free */
    __syncthreads();
    if (threadIdx.x == 0) {
        const float bj = key2f(kb);
        beta[e] = bj;
        mid[e] = (q > 0 && above == q) ? 0.5 * ((double)bj + (double)key2f(shmin)) : (double)bj;
    }
}

/* b = -mid, centred; optionally copied out and summed into the step accumulators. */
__global__ void __launch_bounds__(256)
    qb_finish_kernel(const double *mid, int E, float *bcur, float *b_out, double *acc) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        s += -mid[e];
    const double mean = block_allreduce(s, SumOp(), sh) / E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float v = (float)(-mid[e] - mean);
        bcur[e] = v;
        if (b_out)
            b_out[e] = v;
        if (acc)
            acc[2 * E + e] += (double)v;
    }
    if (acc && threadIdx.x == 0)
        acc[3 * E + LM_CUDA_ROUTER_ACC_QBCOUNT] += 1.0;
}

/* ---------------------------------------------------------------- backward */

struct BwdParams {
    const float *scores; /* [T, E] */
    const int32_t *sel;  /* [T, k] selection before capacity */
    const int32_t *idx;  /* [T, k] after capacity: -1 = dropped */
    const float *dw;     /* [T, k] or null */
    const double *coef;  /* [nseq, E] or null */
    const int32_t *cu;   /* [nseq + 1] or null */
    int nseq;
    float *dlogits; /* [T, E] */
    int T, E, k;
    int softmax, norm;
    double scale;
};

template <int EPL, int V>
__global__ void __launch_bounds__(kThreads) router_bwd_kernel(BwdParams p) {
    const int lane = threadIdx.x & 31;
    for (int t = blockIdx.x * kWarps + (threadIdx.x >> 5); t < p.T; t += gridDim.x * kWarps) {
        float s[EPL];
        load_row<EPL, V>(p.scores + (size_t)t * p.E, p.E, lane, s);
        double ds[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++)
            ds[i] = 0.0;
        if (p.dw) {
            int ej = -1, keep = 0;
            double sj = 0.0, dwj = 0.0;
            if (lane < p.k) {
                const size_t a = (size_t)t * p.k + lane;
                ej = p.sel[a];
                keep = p.idx[a] >= 0;
                dwj = (double)p.dw[a];
                sj = (double)p.scores[(size_t)t * p.E + ej];
            }
            double g = 0.0;
            int apply = 0;
            if (p.norm) {
                double Z = 0.0, A = 0.0;
                for (int j = 0; j < p.k; j++) { /* slot order: the CPU's sums */
                    Z += __shfl_sync(kFull, sj, j);
                    A += __shfl_sync(kFull, keep ? dwj * sj : 0.0, j);
                }
                Z += kDenomEps;
                const double a2 = A / (Z * Z);
                g = p.scale * ((keep ? dwj : 0.0) / Z - a2);
                apply = lane < p.k;
            } else {
                g = p.scale * dwj;
                apply = lane < p.k && keep;
            }
            for (int j = 0; j < p.k; j++) {
                const int e = __shfl_sync(kFull, ej, j);
                const double gj = __shfl_sync(kFull, g, j);
                if (__shfl_sync(kFull, apply, j)) {
#pragma unroll
                    for (int i = 0; i < EPL; i++)
                        if (elem_expert<V>(i, lane) == e)
                            ds[i] += gj;
                }
            }
        }
        if (p.coef) {
            int lo = 0, hi = p.nseq - 1; /* sequence n with cu[n] <= t < cu[n + 1] */
            if (p.cu)
                while (lo < hi) {
                    const int mid = (lo + hi + 1) / 2;
                    if (p.cu[mid] <= t)
                        lo = mid;
                    else
                        hi = mid - 1;
                }
            const double *cf = p.coef + (size_t)lo * p.E;
            double c[EPL];
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                const int e = elem_expert<V>(i, lane);
                c[i] = e < p.E ? cf[e] : 0.0;
            }
            if (!p.softmax) {
                double S = 0.0, B = 0.0; /* padding: s = 0 (not loaded), c = 0 */
#pragma unroll
                for (int i = 0; i < EPL; i++) {
                    S += (double)s[i];
                    B += c[i] * (double)s[i];
                }
                S = warp_allreduce(S, SumOp()) + kDenomEps;
                B = warp_allreduce(B, SumOp()) / S;
#pragma unroll
                for (int i = 0; i < EPL; i++)
                    ds[i] += (c[i] - B) / S;
            } else {
#pragma unroll
                for (int i = 0; i < EPL; i++)
                    ds[i] += c[i];
            }
        }
        float dl[EPL];
        if (!p.softmax) {
#pragma unroll
            for (int i = 0; i < EPL; i++)
                dl[i] = (float)(ds[i] * (double)s[i] * (1.0 - (double)s[i]));
        } else {
            double D = 0.0;
#pragma unroll
            for (int i = 0; i < EPL; i++)
                if (elem_expert<V>(i, lane) < p.E)
                    D += ds[i] * (double)s[i];
            D = warp_allreduce(D, SumOp());
#pragma unroll
            for (int i = 0; i < EPL; i++)
                dl[i] = (float)((double)s[i] * (ds[i] - D));
        }
        store_row<EPL, V>(p.dlogits + (size_t)t * p.E, p.E, lane, dl);
    }
}

/* ---------------------------------------------------------------- bias update */

struct UpdParams {
    double *acc;
    float *bias, *prev;
    double *history;
    int32_t *hlp; /* hist_len, hist_pos */
    lm_router_metrics *m;
    int E, k, balance, rule, center;
    double u, ema;
    float clamp;
};

__global__ void __launch_bounds__(256) update_kernel(UpdParams p) {
    __shared__ float b_old[LM_CUDA_ROUTER_MAX_EXPERTS];
    __shared__ double shd[32];
    __shared__ int shi[32];
    const int E = p.E;
    const double *dem = p.acc, *qacc = p.acc + 2 * E, *sc = p.acc + 3 * E;
    float *b = p.bias;
    double tot = 0.0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        b_old[e] = b[e];
        tot += dem[e];
    }
    const double total = block_allreduce(tot, SumOp(), shd); /* exact: integer counts */
    const double mean = total / E;
    const bool observed = sc[LM_CUDA_ROUTER_ACC_TOKENS] > 0.0 && total > 0.0;
    const bool moves = p.balance == LM_BAL_AUX_FREE || p.balance == LM_BAL_QUANTILE;
    if (observed && moves) {
        if (p.balance == LM_BAL_AUX_FREE) {
            for (int e = threadIdx.x; e < E; e += blockDim.x) {
                const double gap = mean - dem[e]; /* > 0: underloaded, raise its bias */
                const double d = p.rule == LM_BIAS_SIGN ? p.u * (double)((gap > 0.0) - (gap < 0.0))
                                                        : p.u * gap / mean;
                b[e] = (float)((double)b[e] + d);
            }
        } else if (sc[LM_CUDA_ROUTER_ACC_QBCOUNT] > 0.0) {
            for (int e = threadIdx.x; e < E; e += blockDim.x) {
                const double bnew = qacc[e] / sc[LM_CUDA_ROUTER_ACC_QBCOUNT];
                b[e] = (float)(p.ema * (double)b[e] + (1.0 - p.ema) * bnew);
            }
        }
        if (p.center) {
            double s = 0.0;
            for (int e = threadIdx.x; e < E; e += blockDim.x)
                s += (double)b[e];
            const double mb = block_allreduce(s, SumOp(), shd) / E;
            for (int e = threadIdx.x; e < E; e += blockDim.x)
                b[e] = (float)((double)b[e] - mb);
        }
        if (p.clamp > 0.0f) {
            const float B = p.clamp;
            for (int e = threadIdx.x; e < E; e += blockDim.x)
                b[e] = b[e] > B ? B : (b[e] < -B ? -B : b[e]);
        }
    }
    int flips = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float d = (float)((double)b[e] - (double)b_old[e]);
        if (d != 0.0f) {
            const float pd = p.prev[e];
            flips += (d > 0.0f && pd < 0.0f) || (d < 0.0f && pd > 0.0f);
            p.prev[e] = d;
        }
    }
    flips = block_allreduce(flips, SumOp(), shi);
    const int hlen0 = p.hlp[0], hpos = p.hlp[1];
    const int hlen = observed ? min(hlen0 + 1, LM_ROUTER_HISTORY) : hlen0;
    if (observed)
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            p.history[(size_t)hpos * E + e] = dem[e];
    __syncthreads();
    if (observed && threadIdx.x == 0) {
        p.hlp[0] = hlen;
        p.hlp[1] = (hpos + 1) % LM_ROUTER_HISTORY;
    }
    if (p.m) {
        double mx = -INFINITY, mn = INFINITY, pmx = 0.0, ptot = 0.0, s1 = 0.0;
        double bmin = INFINITY, bmax = -INFINITY;
        int dead = 0, ncl = 0;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            mx = fmax(mx, dem[e]);
            mn = fmin(mn, dem[e]);
            dead += dem[e] == 0.0;
            double pe = 0.0;
            for (int h = 0; h < hlen; h++)
                pe += p.history[(size_t)h * E + e];
            pmx = fmax(pmx, pe);
            ptot += pe;
            s1 += (double)b[e];
            bmin = fmin(bmin, (double)b[e]);
            bmax = fmax(bmax, (double)b[e]);
            ncl += p.clamp > 0.0f && fabsf(b[e]) >= p.clamp;
        }
        mx = block_allreduce(mx, MaxOp(), shd);
        mn = block_allreduce(mn, MinOp(), shd);
        pmx = block_allreduce(pmx, MaxOp(), shd);
        ptot = block_allreduce(ptot, SumOp(), shd);
        s1 = block_allreduce(s1, SumOp(), shd);
        bmin = block_allreduce(bmin, MinOp(), shd);
        bmax = block_allreduce(bmax, MaxOp(), shd);
        dead = block_allreduce(dead, SumOp(), shi);
        ncl = block_allreduce(ncl, SumOp(), shi);
        const double bm = s1 / E;
        double s2 = 0.0;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            s2 += ((double)b[e] - bm) * ((double)b[e] - bm);
        s2 = block_allreduce(s2, SumOp(), shd);
        if (threadIdx.x == 0) {
            lm_router_metrics mm;
            memset(&mm, 0, sizeof mm);
            mm.tokens = (int64_t)sc[LM_CUDA_ROUTER_ACC_TOKENS];
            if (observed) {
                mm.maxvio_batch = mx / mean - 1.0;
                mm.min_load = mn / mean;
                mm.n_dead = dead;
                mm.maxvio_global = pmx / (ptot / E) - 1.0;
                mm.dropped_assign_frac =
                    sc[LM_CUDA_ROUTER_ACC_DROP_ASSIGN] / (sc[LM_CUDA_ROUTER_ACC_TOKENS] * p.k);
                mm.dropped_token_frac =
                    sc[LM_CUDA_ROUTER_ACC_DROP_TOKENS] / sc[LM_CUDA_ROUTER_ACC_TOKENS];
            } else {
                mm.n_dead = E;
            }
            mm.aux_loss = sc[LM_CUDA_ROUTER_ACC_NMICRO] > 0.0
                              ? sc[LM_CUDA_ROUTER_ACC_AUX] / sc[LM_CUDA_ROUTER_ACC_NMICRO]
                              : 0.0;
            mm.bias_mean = bm;
            mm.bias_std = sqrt(s2 / E);
            mm.bias_min = bmin;
            mm.bias_max = bmax;
            mm.n_clamped = ncl;
            mm.sign_flip_rate = (double)flips / E;
            *p.m = mm;
        }
    }
    __syncthreads(); /* every read of acc is done */
    for (int i = threadIdx.x; i < LM_CUDA_ROUTER_ACC_LEN(E); i += blockDim.x)
        p.acc[i] = 0.0;
}

__global__ void __launch_bounds__(256) maxvio_kernel(const int32_t *counts, int E, float *out) {
    __shared__ double sh[32];
    double s = 0.0, mx = 0.0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        s += (double)counts[e];
        mx = fmax(mx, (double)counts[e]);
    }
    s = block_allreduce(s, SumOp(), sh);
    mx = block_allreduce(mx, MaxOp(), sh);
    if (threadIdx.x == 0)
        *out = s > 0.0 ? (float)(mx / (s / E) - 1.0) : 0.0f;
}

/* ---------------------------------------------------------------- host side */

/* Kernel variants: EPL scores per lane (a power of two >= ceil(E/32)), V-wide loads. */
#define LM_ROUTER_VARIANTS(X)                                                                      \
    X(1, 1) X(2, 1) X(2, 2) X(4, 1) X(4, 4) X(8, 1) X(8, 4) X(16, 1) X(16, 4) X(32, 1) X(32, 4)

typedef void (*router_fn)(RouterParams);
typedef void (*bwd_fn)(BwdParams);
typedef void (*alpha_fn)(const float *, const float *, int, int, int, float *);

template <typename F, template <int, int> class Pick> F pick(int epl, int v) {
#define LM_PICK(a, b)                                                                              \
    if (epl == a && v == b)                                                                        \
        return Pick<a, b>::fn();
    LM_ROUTER_VARIANTS(LM_PICK)
#undef LM_PICK
    return nullptr;
}
template <int A, int B> struct PickRouter {
    static router_fn fn() { return router_fwd_kernel<A, B>; }
};
template <int A, int B> struct PickBwd {
    static bwd_fn fn() { return router_bwd_kernel<A, B>; }
};
template <int A, int B> struct PickAlpha {
    static alpha_fn fn() { return qb_alpha_kernel<A, B>; }
};

int lanes_per_row(int E) {
    int epl = 1;
    while (epl * 32 < E)
        epl *= 2;
    return epl;
}

/* Vector width for rows of E fp32 at the given pointers (all must be aligned). */
int vec_width(int E, int epl, const void *a, const void *b) {
    const uintptr_t m = (uintptr_t)a | (uintptr_t)b;
    if (epl >= 4 && E % 128 == 0 && m % 16 == 0)
        return 4;
    if (epl == 2 && E % 64 == 0 && m % 8 == 0)
        return 2;
    return 1;
}

int token_blocks(const lm_cuda_ctx *ctx, int T) {
    int64_t b = ((int64_t)T + kWarps - 1) / kWarps;
    const int64_t cap = (int64_t)ctx->sm_count * 16;
    if (b > cap)
        b = cap;
    return b < 1 ? 1 : (int)b;
}

size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

/* Carves consecutive 256-byte-aligned pieces out of one scratch buffer. */
struct Carver {
    size_t off = 0;
    char *base = nullptr;
    template <typename T> T *take(size_t n) {
        T *p = (T *)(base ? base + off : nullptr);
        off += align_up(n * sizeof(T));
        return p;
    }
};

lm_status check_config(const lm_router_config *c, const char *who, lm_error *err) {
    LM_TRY(lm_router_config_validate(c, err));
    if (c->num_experts > LM_CUDA_ROUTER_MAX_EXPERTS)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s on cuda: num_experts = %d is not supported (at most %d)", who,
                         c->num_experts, LM_CUDA_ROUTER_MAX_EXPERTS);
    if (c->num_experts_per_tok > LM_CUDA_ROUTER_MAX_TOPK)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s on cuda: num_experts_per_tok = %d is not supported (at most %d)", who,
                         c->num_experts_per_tok, LM_CUDA_ROUTER_MAX_TOPK);
    if (c->n_group > LM_CUDA_ROUTER_MAX_GROUPS)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s on cuda: n_group = %d is not supported (at most %d)", who, c->n_group,
                         LM_CUDA_ROUTER_MAX_GROUPS);
    return LM_OK;
}

lm_status check_ctx(lm_cuda_ctx *ctx, const char *who, lm_error *err) {
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "%s: the CUDA context is required", who);
    return lm_cuda_ctx_enter(ctx, err);
}

/* The alternations of the quantile solve on scratch pieces: M [E*T], mid [E], bcur [E].
 * acc (may be null) receives the final centred solution and one count. */
lm_status qb_run(lm_cuda_ctx *ctx, int E, int k, const float *S, int T, const float *bias,
                 int iters, float *beta, float *b_out, double *acc, float *M, double *mid,
                 float *bcur, lm_error *err) {
    int64_t q = llround((double)T * k / E);
    if (q > T - 1)
        q = T - 1;
    if (q < 0)
        q = 0;
    const int epl = lanes_per_row(E), v = vec_width(E, epl, S, S);
    const alpha_fn af = pick<alpha_fn, PickAlpha>(epl, v);
    const size_t smem = sizeof(float) * (size_t)kTile * (E + 1);
    /* opt in once per variant for the largest E it serves (32 EPL experts) */
    const size_t smem_max = sizeof(float) * (size_t)kTile * (32 * epl + 1);
    if (smem_max > 48 * 1024 && lm_cuda_ctx_first_use(ctx, (const void *)af))
        LM_CK(cudaFuncSetAttribute((const void *)af, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem_max));
    const int nb = (T + kTile - 1) / kTile;
    for (int it = 0; it < iters; it++) {
        af<<<nb, kThreads, smem, ctx->stream>>>(S, it == 0 ? bias : bcur, T, E, k + 1, M);
        LM_CK_LAUNCH("router quantile: qb_alpha_kernel");
        qb_column_kernel<<<E, 512, 0, ctx->stream>>>(M, T, (int)q, beta, mid);
        LM_CK_LAUNCH("router quantile: qb_column_kernel");
        const bool last = it == iters - 1;
        qb_finish_kernel<<<1, 256, 0, ctx->stream>>>(mid, E, bcur, last ? b_out : nullptr,
                                                     last ? acc : nullptr);
        LM_CK_LAUNCH("router quantile: qb_finish_kernel");
    }
    return LM_OK;
}

struct StateLayout {
    size_t bias, prev, acc, history, hlp, total;
};
StateLayout state_layout(int E) {
    StateLayout l;
    l.bias = 0;
    l.prev = align_up(sizeof(float) * (size_t)E);
    l.acc = l.prev + align_up(sizeof(float) * (size_t)E);
    l.history = l.acc + align_up(sizeof(double) * (size_t)LM_CUDA_ROUTER_ACC_LEN(E));
    l.hlp = l.history + align_up(sizeof(double) * (size_t)LM_ROUTER_HISTORY * E);
    l.total = l.hlp + align_up(sizeof(int32_t) * 2);
    return l;
}

} // namespace

/* ---------------------------------------------------------------- state */

extern "C" lm_status lm_cuda_router_state_init(lm_cuda_ctx *ctx, lm_cuda_router_state *s, int E,
                                               lm_error *err) {
    if (!s)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: state is required");
    memset(s, 0, sizeof *s);
    if (E < 1 || E > LM_CUDA_ROUTER_MAX_EXPERTS)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: state num_experts = %d must be in [1, %d]", E,
                         LM_CUDA_ROUTER_MAX_EXPERTS);
    LM_TRY(check_ctx(ctx, "router cuda: state", err));
    const StateLayout l = state_layout(E);
    LM_TRY(lm_cuda_ctx_alloc(ctx, &s->base, l.total, err));
    char *b = (char *)s->base;
    s->E = E;
    s->e_score_correction_bias = (float *)(b + l.bias);
    s->prev_delta = (float *)(b + l.prev);
    s->acc = (double *)(b + l.acc);
    s->history = (double *)(b + l.history);
    s->hist_len_pos = (int32_t *)(b + l.hlp);
    lm_status st = lm_cuda_ctx_memset(ctx, s->base, 0, l.total, err);
    if (st == LM_OK)
        st = lm_cuda_ctx_sync(ctx, err);
    if (st != LM_OK)
        lm_cuda_router_state_free(ctx, s);
    return st;
}

extern "C" void lm_cuda_router_state_free(lm_cuda_ctx *ctx, lm_cuda_router_state *s) {
    if (!s)
        return;
    if (ctx && s->base)
        lm_cuda_ctx_free_mem(ctx, s->base);
    memset(s, 0, sizeof *s);
}

extern "C" lm_status lm_cuda_router_state_upload(lm_cuda_ctx *ctx, lm_cuda_router_state *dst,
                                                 const lm_router_state *src, lm_error *err) {
    if (!dst || !dst->base || !src || !src->e_score_correction_bias)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: state upload needs both states");
    if (dst->E != src->E)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: state upload: device state has %d experts, CPU state %d",
                         dst->E, src->E);
    const int E = src->E;
    const StateLayout l = state_layout(E);
    char *img = (char *)calloc(1, l.total);
    if (!img)
        return lm_errorf(err, LM_ERR_NOMEM, "router cuda: %zu bytes of host staging", l.total);
    memcpy(img + l.bias, src->e_score_correction_bias, sizeof(float) * (size_t)E);
    memcpy(img + l.prev, src->prev_delta, sizeof(float) * (size_t)E);
    double *acc = (double *)(img + l.acc);
    memcpy(acc, src->demand, sizeof(double) * (size_t)E);
    memcpy(acc + E, src->kept, sizeof(double) * (size_t)E);
    memcpy(acc + 2 * E, src->qb_accum, sizeof(double) * (size_t)E);
    double *sc = acc + 3 * E;
    sc[LM_CUDA_ROUTER_ACC_TOKENS] = (double)src->tokens;
    sc[LM_CUDA_ROUTER_ACC_DROP_ASSIGN] = (double)src->dropped_assign;
    sc[LM_CUDA_ROUTER_ACC_DROP_TOKENS] = (double)src->dropped_tokens;
    sc[LM_CUDA_ROUTER_ACC_AUX] = src->aux_loss_sum;
    sc[LM_CUDA_ROUTER_ACC_NMICRO] = (double)src->n_micro;
    sc[LM_CUDA_ROUTER_ACC_QBCOUNT] = (double)src->qb_count;
    memcpy(img + l.history, src->history, sizeof(double) * (size_t)LM_ROUTER_HISTORY * E);
    int32_t *hlp = (int32_t *)(img + l.hlp);
    hlp[0] = src->hist_len;
    hlp[1] = src->hist_pos;
    lm_status st = lm_cuda_ctx_upload(ctx, dst->base, img, l.total, err);
    if (st == LM_OK)
        st = lm_cuda_ctx_sync(ctx, err);
    free(img);
    return st;
}

extern "C" lm_status lm_cuda_router_state_download(lm_cuda_ctx *ctx,
                                                   const lm_cuda_router_state *src,
                                                   lm_router_state *dst, lm_error *err) {
    if (!src || !src->base || !dst || !dst->e_score_correction_bias)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: state download needs both states");
    if (dst->E != src->E)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: state download: device state has %d experts, CPU state %d",
                         src->E, dst->E);
    const int E = src->E;
    const StateLayout l = state_layout(E);
    char *img = (char *)malloc(l.total);
    if (!img)
        return lm_errorf(err, LM_ERR_NOMEM, "router cuda: %zu bytes of host staging", l.total);
    lm_status st = lm_cuda_ctx_download(ctx, img, src->base, l.total, err);
    if (st == LM_OK) {
        memcpy(dst->e_score_correction_bias, img + l.bias, sizeof(float) * (size_t)E);
        memcpy(dst->prev_delta, img + l.prev, sizeof(float) * (size_t)E);
        const double *acc = (const double *)(img + l.acc), *sc = acc + 3 * E;
        memcpy(dst->demand, acc, sizeof(double) * (size_t)E);
        memcpy(dst->kept, acc + E, sizeof(double) * (size_t)E);
        memcpy(dst->qb_accum, acc + 2 * E, sizeof(double) * (size_t)E);
        dst->tokens = (int64_t)sc[LM_CUDA_ROUTER_ACC_TOKENS];
        dst->dropped_assign = (int64_t)sc[LM_CUDA_ROUTER_ACC_DROP_ASSIGN];
        dst->dropped_tokens = (int64_t)sc[LM_CUDA_ROUTER_ACC_DROP_TOKENS];
        dst->aux_loss_sum = sc[LM_CUDA_ROUTER_ACC_AUX];
        dst->n_micro = (int)sc[LM_CUDA_ROUTER_ACC_NMICRO];
        dst->qb_count = (int)sc[LM_CUDA_ROUTER_ACC_QBCOUNT];
        memcpy(dst->history, img + l.history, sizeof(double) * (size_t)LM_ROUTER_HISTORY * E);
        const int32_t *hlp = (const int32_t *)(img + l.hlp);
        dst->hist_len = hlp[0];
        dst->hist_pos = hlp[1];
    }
    free(img);
    return st;
}

/* ---------------------------------------------------------------- route */

extern "C" lm_status lm_cuda_route_alloc(lm_cuda_ctx *ctx, const lm_router_config *c, int T_cap,
                                         int seq_cap, lm_cuda_route *r, lm_error *err) {
    if (!r)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: route is required");
    memset(r, 0, sizeof *r);
    LM_TRY(check_config(c, "router", err));
    if (T_cap < 1 || seq_cap < 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: route_alloc T_cap = %d and seq_cap = %d must be >= 1", T_cap,
                         seq_cap);
    LM_TRY(check_ctx(ctx, "router cuda: route_alloc", err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    const bool aux = c->balance == LM_BAL_AUX_LOSS;
    const size_t Tk = (size_t)T_cap * k, TE = (size_t)T_cap * E;
    Carver cv;
    for (int pass = 0; pass < 2; pass++) {
        cv.off = 0;
        r->topk_idx = cv.take<int32_t>(Tk);
        r->topk_weight = cv.take<float>(Tk);
        r->counts = cv.take<int32_t>(E);
        r->demand = cv.take<int32_t>(E);
        r->scores = cv.take<float>(TE);
        r->sel_idx = cv.take<int32_t>(Tk);
        r->n_dropped = cv.take<int32_t>(2);
        r->aux_loss = aux ? cv.take<float>(1) : nullptr;
        r->aux_coef = aux ? cv.take<double>((size_t)seq_cap * E) : nullptr;
        if (pass == 0) {
            void *p = nullptr;
            LM_TRY(lm_cuda_ctx_alloc(ctx, &p, cv.off, err));
            cv.base = (char *)p;
            r->base = p;
        }
    }
    r->T_cap = T_cap;
    r->seq_cap = seq_cap;
    return LM_OK;
}

extern "C" void lm_cuda_route_free(lm_cuda_ctx *ctx, lm_cuda_route *r) {
    if (!r)
        return;
    if (ctx && r->base)
        lm_cuda_ctx_free_mem(ctx, r->base);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- forward */

extern "C" lm_status lm_cuda_router_forward(lm_cuda_ctx *ctx, const lm_router_config *c,
                                            lm_cuda_router_state *st, const float *logits, int T,
                                            const int32_t *cu_seqlens, int n_cu, int training,
                                            lm_cuda_route *out, lm_error *err) {
    LM_TRY(check_config(c, "router", err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: output route is required");
    if (T < 0)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: T = %d tokens must be >= 0", T);
    if ((int64_t)T * (E > k ? E : k) > ((int64_t)1 << 31) - 1)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: T = %d x num_experts = %d is too large",
                         T, E);
    if (T > out->T_cap)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: T = %d exceeds the route's T_cap = %d",
                         T, out->T_cap);
    if (training && !st)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: training needs a router state");
    if (st && (st->E != E || !st->base))
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: state has %d experts but num_experts = %d (or is not "
                         "initialised)",
                         st->E, E);
    const bool aux = c->balance == LM_BAL_AUX_LOSS;
    const bool capacity = training && c->capacity_factor > 0.0f;
    const bool probs = capacity && c->drop_policy == LM_DROP_PROBS;
    const bool quantile = training && c->balance == LM_BAL_QUANTILE;
    if (!out->topk_idx || !out->topk_weight || !out->counts || !out->demand)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: route needs topk_idx, topk_weight, counts and demand");
    if ((training || aux) && !out->scores)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: route scores [T, E] are required in training and with "
                         "balance aux_loss");
    if (capacity && !out->sel_idx)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: route sel_idx [T, k] is required with capacity_factor = %g",
                         (double)c->capacity_factor);
    if (training && !out->n_dropped)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: route n_dropped [2] is required in "
                         "training");
    const bool seqwise = aux && c->aux_loss_seq && cu_seqlens;
    if (seqwise && n_cu < 2)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: cu_seqlens has %d entries (need >= 2)",
                         n_cu);
    const int nseq = seqwise ? n_cu - 1 : 1;
    if (aux && (!out->aux_loss || !out->aux_coef || nseq > out->seq_cap))
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: balance aux_loss needs the route's aux_loss and aux_coef "
                         "[%d sequences, E] (seq_cap = %d)",
                         nseq, out->seq_cap);
    if (T > 0 && !logits)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: logits are required");
    LM_TRY(check_ctx(ctx, "router cuda: forward", err));
    cudaStream_t s = ctx->stream;

    out->T = T, out->E = E, out->k = k;
    out->capacity = 0;
    out->dropped = 0;
    out->aux_ready = 0;
    out->aux_cu = seqwise ? cu_seqlens : nullptr;
    out->aux_nseq = nseq;
    if (T == 0) {
        LM_CK(cudaMemsetAsync(out->counts, 0, sizeof(int32_t) * (size_t)E, s));
        LM_CK(cudaMemsetAsync(out->demand, 0, sizeof(int32_t) * (size_t)E, s));
        if (out->n_dropped)
            LM_CK(cudaMemsetAsync(out->n_dropped, 0, sizeof(int32_t) * 2, s));
        if (aux)
            LM_CK(cudaMemsetAsync(out->aux_loss, 0, sizeof(float), s));
        return LM_OK;
    }
    int C = 0;
    if (capacity) {
        const double cd = ceil((double)T * k / E * (double)c->capacity_factor);
        C = cd >= T ? T : (int)cd;
        out->capacity = C;
        out->dropped = 1;
    }

    /* scratch */
    const int nb = (T + kTile - 1) / kTile;
    const int items_max = T / kAuxTile + nseq + 1;
    Carver cv;
    int32_t *hist = nullptr, *off = nullptr, *ioff = nullptr, *nne = nullptr, *Cpart = nullptr;
    uint64_t *bucket = nullptr, *thr = nullptr;
    double *Ppart = nullptr, *lpart = nullptr, *mid = nullptr;
    float *M = nullptr, *bcur = nullptr, *beta = nullptr;
    for (int pass = 0; pass < 2; pass++) {
        cv.off = 0;
        hist = cv.take<int32_t>((size_t)E * nb);
        if (probs) {
            off = cv.take<int32_t>(E);
            thr = cv.take<uint64_t>(E);
            bucket = cv.take<uint64_t>((size_t)T * k);
        }
        if (aux) {
            ioff = cv.take<int32_t>(nseq + 1);
            nne = cv.take<int32_t>(1);
            Ppart = cv.take<double>((size_t)items_max * E);
            Cpart = cv.take<int32_t>((size_t)items_max * E);
            lpart = cv.take<double>(nseq);
        }
        if (quantile) {
            M = cv.take<float>((size_t)E * T);
            mid = cv.take<double>(E);
            bcur = cv.take<float>(E);
            beta = cv.take<float>(E);
        }
        if (pass == 0) {
            void *p = nullptr;
            LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, cv.off, &p, err));
            cv.base = (char *)p;
        }
    }

    /* router */
    RouterParams rp;
    rp.logits = logits;
    rp.bias = st ? st->e_score_correction_bias : nullptr;
    rp.scores = out->scores;
    rp.topk_idx = out->topk_idx;
    rp.topk_weight = out->topk_weight;
    rp.sel_idx = out->sel_idx;
    rp.hist = hist;
    rp.n_dropped = out->n_dropped;
    rp.T = T, rp.E = E, rp.k = k, rp.nb = nb;
    rp.softmax = c->scoring_func == LM_SCORE_SOFTMAX;
    rp.norm = c->norm_topk_prob && k > 1;
    rp.scale = (double)c->routed_scaling_factor;
    rp.n_group = c->n_group > 1 ? c->n_group : 1;
    rp.gsz = E / rp.n_group;
    rp.topk_group = c->topk_group;
    const int epl = lanes_per_row(E);
    const int v = vec_width(E, epl, logits, out->scores ? (const void *)out->scores : logits);
    const router_fn rf = pick<router_fn, PickRouter>(epl, v);
    rf<<<nb, kThreads, sizeof(int) * (size_t)E, s>>>(rp);
    LM_CK_LAUNCH("router cuda: router_fwd_kernel");
    expert_scan_kernel<<<E, 256, 0, s>>>(hist, nb, C, capacity ? 1 : 0, out->demand, out->counts);
    LM_CK_LAUNCH("router cuda: expert_scan_kernel");

    /* capacity */
    if (capacity) {
        CapParams cp;
        cp.sel = out->sel_idx;
        cp.topk_idx = out->topk_idx;
        cp.topk_weight = out->topk_weight;
        cp.bases = hist;
        cp.demand = out->demand;
        cp.scores = out->scores;
        cp.bucket = bucket;
        cp.off = off;
        cp.n_dropped = out->n_dropped;
        cp.T = T, cp.E = E, cp.k = k, cp.nb = nb, cp.C = C, cp.probs = probs ? 1 : 0;
        const size_t smem = sizeof(int) * ((size_t)(kWarps + 1) * E + 32);
        cap_rank_kernel<<<(nb + kWarps - 1) / kWarps, kThreads, smem, s>>>(cp);
        LM_CK_LAUNCH("router cuda: cap_rank_kernel");
        if (probs) {
            cap_select_kernel<<<E, 256, 0, s>>>(bucket, off, out->demand, C, thr);
            LM_CK_LAUNCH("router cuda: cap_select_kernel");
            cap_mark_kernel<<<lm_cuda_grid(ctx, T), 256, 0, s>>>(cp, thr);
            LM_CK_LAUNCH("router cuda: cap_mark_kernel");
        }
    }

    /* aux loss */
    if (aux) {
        const int32_t *cu = seqwise ? cu_seqlens : nullptr;
        const int32_t *sel = out->sel_idx ? out->sel_idx : out->topk_idx;
        aux_items_kernel<<<1, 256, 0, s>>>(cu, nseq, T, ioff, nne);
        LM_CK_LAUNCH("router cuda: aux_items_kernel");
        aux_partial_kernel<<<items_max, kThreads, sizeof(int) * (size_t)E, s>>>(
            out->scores, sel, cu, nseq, T, E, k, c->scoring_func == LM_SCORE_SIGMOID, ioff, Ppart,
            Cpart);
        LM_CK_LAUNCH("router cuda: aux_partial_kernel");
        aux_seq_kernel<<<nseq, 256, 0, s>>>(cu, nseq, T, E, k, (double)c->aux_loss_alpha, ioff, nne,
                                            Ppart, Cpart, out->aux_coef, lpart);
        LM_CK_LAUNCH("router cuda: aux_seq_kernel");
        aux_final_kernel<<<1, 256, 0, s>>>(lpart, nseq, nne, out->aux_loss);
        LM_CK_LAUNCH("router cuda: aux_final_kernel");
        out->aux_ready = 1;
    }

    /* step accumulators ("count"; the update is lm_cuda_router_update_bias) */
    if (training) {
        accumulate_kernel<<<1, 256, 0, s>>>(st->acc, out->demand, out->counts, E, T, out->n_dropped,
                                            aux ? out->aux_loss : nullptr);
        LM_CK_LAUNCH("router cuda: accumulate_kernel");
        if (quantile)
            LM_TRY(qb_run(ctx, E, k, out->scores, T, st->e_score_correction_bias, c->quantile_iters,
                          beta, nullptr, st->acc, M, mid, bcur, err));
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

extern "C" lm_status lm_cuda_router_backward(lm_cuda_ctx *ctx, const lm_router_config *c,
                                             const lm_cuda_route *r, const float *dtopk_weight,
                                             float *dlogits, lm_error *err) {
    LM_TRY(check_config(c, "router", err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (!r)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: route is required");
    if (r->E != E || r->k != k)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: route has E = %d, k = %d but the config has num_experts = "
                         "%d, num_experts_per_tok = %d",
                         r->E, r->k, E, k);
    const int T = r->T;
    if (T == 0)
        return LM_OK;
    if (!r->scores || !r->topk_idx || (r->dropped && !r->sel_idx))
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: backward needs the route's scores, topk_idx (and sel_idx "
                         "after capacity)");
    if (!dlogits)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: dlogits is required");
    const bool aux = c->balance == LM_BAL_AUX_LOSS && c->aux_loss_alpha > 0.0f;
    if (aux && (!r->aux_ready || !r->aux_coef))
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: balance aux_loss: the route has no aux coefficients (not "
                         "produced by lm_cuda_router_forward with aux_loss)");
    LM_TRY(check_ctx(ctx, "router cuda: backward", err));
    BwdParams bp;
    bp.scores = r->scores;
    bp.sel = r->sel_idx ? r->sel_idx : r->topk_idx;
    bp.idx = r->topk_idx;
    bp.dw = dtopk_weight;
    bp.coef = aux ? r->aux_coef : nullptr;
    bp.cu = aux ? r->aux_cu : nullptr;
    bp.nseq = r->aux_nseq > 0 ? r->aux_nseq : 1;
    bp.dlogits = dlogits;
    bp.T = T, bp.E = E, bp.k = k;
    bp.softmax = c->scoring_func == LM_SCORE_SOFTMAX;
    bp.norm = c->norm_topk_prob && k > 1;
    bp.scale = (double)c->routed_scaling_factor;
    const int epl = lanes_per_row(E), v = vec_width(E, epl, r->scores, dlogits);
    const bwd_fn bf = pick<bwd_fn, PickBwd>(epl, v);
    bf<<<token_blocks(ctx, T), kThreads, 0, ctx->stream>>>(bp);
    LM_CK_LAUNCH("router cuda: router_bwd_kernel");
    return LM_OK;
}

/* ---------------------------------------------------------------- update */

extern "C" lm_status lm_cuda_router_update_bias(lm_cuda_ctx *ctx, const lm_router_config *c,
                                                lm_cuda_router_state *st,
                                                lm_router_metrics *metrics, lm_error *err) {
    LM_TRY(check_config(c, "router", err));
    if (!st || !st->base)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: update_bias needs an initialised device state");
    if (st->E != c->num_experts)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: state has %d experts but num_experts = %d", st->E,
                         c->num_experts);
    LM_TRY(check_ctx(ctx, "router cuda: update_bias", err));
    UpdParams up;
    up.acc = st->acc;
    up.bias = st->e_score_correction_bias;
    up.prev = st->prev_delta;
    up.history = st->history;
    up.hlp = st->hist_len_pos;
    up.m = metrics;
    up.E = st->E;
    up.k = c->num_experts_per_tok;
    up.balance = (int)c->balance;
    up.rule = (int)c->bias_rule;
    up.center = c->bias_center;
    up.u = (double)c->bias_update_rate;
    up.ema = (double)c->quantile_ema;
    up.clamp = c->bias_clamp;
    update_kernel<<<1, 256, 0, ctx->stream>>>(up);
    LM_CK_LAUNCH("router cuda: update_kernel");
    return LM_OK;
}

/* ---------------------------------------------------------------- quantile solve */

extern "C" lm_status lm_cuda_router_quantile_solve(lm_cuda_ctx *ctx, const lm_router_config *c,
                                                   const float *scores, int T, const float *bias,
                                                   int iters, float *beta, float *b_centred,
                                                   lm_error *err) {
    LM_TRY(check_config(c, "router", err));
    const int E = c->num_experts, k = c->num_experts_per_tok;
    if (k >= E)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: quantile solve needs num_experts_per_tok = %d < "
                         "num_experts = %d",
                         k, E);
    if (T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: quantile solve needs T = %d >= 1", T);
    if ((int64_t)T * E > ((int64_t)1 << 31) - 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: quantile solve: T = %d x num_experts = %d is too large", T,
                         E);
    if (iters < 1)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: quantile solve iters = %d must be >= 1",
                         iters);
    if (!scores || !beta)
        return lm_errorf(err, LM_ERR_INVALID, "router cuda: quantile solve needs scores and beta");
    LM_TRY(check_ctx(ctx, "router cuda: quantile solve", err));
    Carver cv;
    float *M = nullptr, *bcur = nullptr;
    double *mid = nullptr;
    for (int pass = 0; pass < 2; pass++) {
        cv.off = 0;
        M = cv.take<float>((size_t)E * T);
        mid = cv.take<double>(E);
        bcur = cv.take<float>(E);
        if (pass == 0) {
            void *p = nullptr;
            LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, cv.off, &p, err));
            cv.base = (char *)p;
        }
    }
    return qb_run(ctx, E, k, scores, T, bias, iters, beta, b_centred, nullptr, M, mid, bcur, err);
}

extern "C" lm_status lm_cuda_router_maxvio(lm_cuda_ctx *ctx, const int32_t *counts, int E,
                                           float *maxvio, lm_error *err) {
    if (E < 1 || !counts || !maxvio)
        return lm_errorf(err, LM_ERR_INVALID,
                         "router cuda: maxvio needs counts [E >= 1] and an output (E = %d)", E);
    LM_TRY(check_ctx(ctx, "router cuda: maxvio", err));
    maxvio_kernel<<<1, 256, 0, ctx->stream>>>(counts, E, maxvio);
    LM_CK_LAUNCH("router cuda: maxvio_kernel");
    return LM_OK;
}
