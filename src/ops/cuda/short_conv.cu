/* Depthwise causal short convolution (fused SiLU, packed documents, conv state, decode
 * step) on the GPU (include/linmoe/cuda_layers.h has the contract; the math, tap order
 * and layouts are those of src/ops/short_conv.c).
 *
 * Taps are padded on the left to WM = 4 or 8 (wp[j] = 0 for j < WM - W): a W-tap conv
 * is then a WM-tap conv whose extra terms are exact zeros, so one instance serves
 * every W <= WM with compile-time register windows (SP = WM - 1 previous inputs).
 *
 * Forward: a thread owns CV consecutive channels (CV = 8 for WM = 4, 4 for WM = 8;
 * smaller when C or the pointers do not allow it) of a tile of TT_FWD tokens, and walks
 * the tokens in order with the SP previous inputs in registers (loads issued G at a
 * time). The tile is cut at document boundaries (cu_seqlens, copied to the device); at
 * the start of a piece the window is refilled from x, from the initial state (positions
 * before the document start) or with zeros. The final state is written by a second
 * kernel (one thread per sequence and channel), after every read of the initial state,
 * so it may alias it.
 *
 * Backward, per thread the same ownership with tiles of TT_BWD tokens: the walk
 * recomputes pre and g = dy * act'(pre) token by token, keeps the last SP values of g,
 * and emits dx[s] = sum_k wp[SP-k] g[s+k] when g[s+SP] is known (g = 0 past the document
 * end, so each piece runs SP steps past its end, reading up to SP tokens of the next
 * tile). The tile that holds a document's first token also emits dinitial_state (the
 * positions before the start); empty documents get zeros from a small kernel. dweight:
 * each thread sums g * window over its tile's tokens in fp32 registers, writes one
 * partial per (tile, channel, tap) to scratch, and colsum_add adds the partials in tile
 * order (deterministic, no atomics).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "linmoe/cuda_layers.h"
#include "ops/cuda/ctx.cuh"
#include "ops/cuda/layers_variants.h"
#include "ops/cuda/vec.cuh"

namespace {

constexpr int THREADS = 128;
constexpr int TT_FWD = 64;  /* tokens per forward tile */
constexpr int TT_BWD = 128; /* tokens per backward tile (one dweight partial each) */
constexpr int G = 4;        /* tokens loaded ahead */

/* ---------------------------------------------------------------- bf16 vectors */

template <int CV> __device__ __forceinline__ void ld_bf(const __nv_bfloat16 *p, float (&f)[CV]) {
    if constexpr (CV == 8) {
        const uint4 v = __ldg(reinterpret_cast<const uint4 *>(p));
        f[0] = bf_lo(v.x), f[1] = bf_hi(v.x), f[2] = bf_lo(v.y), f[3] = bf_hi(v.y);
        f[4] = bf_lo(v.z), f[5] = bf_hi(v.z), f[6] = bf_lo(v.w), f[7] = bf_hi(v.w);
    } else if constexpr (CV == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(p));
        f[0] = bf_lo(v.x), f[1] = bf_hi(v.x), f[2] = bf_lo(v.y), f[3] = bf_hi(v.y);
    } else if constexpr (CV == 2) {
        const unsigned v = __ldg(reinterpret_cast<const unsigned *>(p));
        f[0] = bf_lo(v), f[1] = bf_hi(v);
    } else {
        f[0] = __uint_as_float((uint32_t)__ldg(reinterpret_cast<const unsigned short *>(p)) << 16);
    }
}

template <int CV> __device__ __forceinline__ void st_bf(__nv_bfloat16 *p, const float (&f)[CV]) {
    if constexpr (CV == 8) {
        uint4 v;
        v.x = bf_bits(f[0]) | (bf_bits(f[1]) << 16);
        v.y = bf_bits(f[2]) | (bf_bits(f[3]) << 16);
        v.z = bf_bits(f[4]) | (bf_bits(f[5]) << 16);
        v.w = bf_bits(f[6]) | (bf_bits(f[7]) << 16);
        *reinterpret_cast<uint4 *>(p) = v;
    } else if constexpr (CV == 4) {
        uint2 v;
        v.x = bf_bits(f[0]) | (bf_bits(f[1]) << 16);
        v.y = bf_bits(f[2]) | (bf_bits(f[3]) << 16);
        *reinterpret_cast<uint2 *>(p) = v;
    } else if constexpr (CV == 2) {
        *reinterpret_cast<unsigned *>(p) = bf_bits(f[0]) | (bf_bits(f[1]) << 16);
    } else {
        *reinterpret_cast<unsigned short *>(p) = (unsigned short)bf_bits(f[0]);
    }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

/* ---------------------------------------------------------------- parameters */

struct ConvP {
    const __nv_bfloat16 *x, *w, *dy;
    const float *h0;   /* initial state [N, C, W-1] or NULL */
    const int64_t *cu; /* device cu_seqlens [N+1] or NULL (N sequences of Tseq) */
    __nv_bfloat16 *y, *dx;
    float *hT;    /* final state */
    float *dh0;   /* dinitial_state */
    float *part;  /* dweight partials [tiles, C, W] */
    int64_t rows; /* B * T */
    int Tseq, N, C, W, silu;
};

__device__ __forceinline__ int64_t bound(const ConvP &p, int n) {
    return p.cu ? p.cu[n] : (int64_t)n * p.Tseq;
}

/* The sequence holding token t (t < rows): the largest n with bound(n) <= t, which
 * skips empty documents. */
__device__ __forceinline__ int doc_of(const ConvP &p, int64_t t) {
    if (!p.cu)
        return (int)(t / p.Tseq);
    int lo = 0, hi = p.N - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Padded taps of channels c0..c0+CV-1: wp[j] = weight[c, j - (WM - W)], 0 before. */
template <int WM, int CV>
__device__ __forceinline__ void load_taps(const ConvP &p, int c0, float (&wp)[WM][CV]) {
#pragma unroll
    for (int j = 0; j < WM; j++) {
        const int jr = j - (WM - p.W);
#pragma unroll
        for (int cc = 0; cc < CV; cc++)
            wp[j][cc] = jr >= 0 ? __bfloat162float(p.w[(int64_t)(c0 + cc) * p.W + jr]) : 0.0f;
    }
}

/* Window of the SP inputs before token a of sequence n (starting at bos): x where
 * inside the sequence, the initial state (or zeros) before it. */
template <int WM, int CV>
__device__ __forceinline__ void load_window(const ConvP &p, int n, int64_t bos, int64_t a, int c0,
                                            float (&xw)[WM - 1][CV]) {
    const int S = p.W - 1;
#pragma unroll
    for (int j = 0; j < WM - 1; j++) {
        const int64_t q = a - (WM - 1) + j;
        if (q >= bos) {
            ld_bf<CV>(p.x + q * p.C + c0, xw[j]);
        } else {
            const int64_t i = S + (q - bos); /* index in the state, < S */
#pragma unroll
            for (int cc = 0; cc < CV; cc++)
                xw[j][cc] = (i >= 0 && p.h0) ? p.h0[((int64_t)n * p.C + c0 + cc) * S + i] : 0.0f;
        }
    }
}

/* ---------------------------------------------------------------- forward */

template <int WM, int CV> __global__ void __launch_bounds__(THREADS, 4) conv_fwd(const ConvP p) {
    constexpr int SP = WM - 1;
    const int c0 = (blockIdx.y * THREADS + threadIdx.x) * CV;
    if (c0 >= p.C)
        return;
    const int64_t t0 = (int64_t)blockIdx.x * TT_FWD;
    const int64_t t1 = t0 + TT_FWD < p.rows ? t0 + TT_FWD : p.rows;
    float wp[WM][CV];
    load_taps<WM, CV>(p, c0, wp);
    for (int n = doc_of(p, t0); n < p.N; n++) {
        const int64_t bos = bound(p, n), eos = bound(p, n + 1);
        if (bos >= t1)
            break;
        const int64_t a = bos > t0 ? bos : t0, b = eos < t1 ? eos : t1;
        if (a >= b)
            continue;
        float xw[SP][CV];
        load_window<WM, CV>(p, n, bos, a, c0, xw);
        for (int64_t t = a; t < b; t += G) {
            float xv[G][CV];
#pragma unroll
            for (int g = 0; g < G; g++)
                if (t + g < b)
                    ld_bf<CV>(p.x + (t + g) * p.C + c0, xv[g]);
#pragma unroll
            for (int g = 0; g < G; g++) {
                if (t + g < b) {
                    float acc[CV];
#pragma unroll
                    for (int cc = 0; cc < CV; cc++) {
                        acc[cc] = 0.0f;
#pragma unroll
                        for (int j = 0; j < SP; j++)
                            acc[cc] += wp[j][cc] * xw[j][cc];
                        acc[cc] += wp[SP][cc] * xv[g][cc];
                        if (p.silu)
                            acc[cc] = acc[cc] * sigmoidf_(acc[cc]);
                    }
                    st_bf<CV>(p.y + (t + g) * p.C + c0, acc);
#pragma unroll
                    for (int cc = 0; cc < CV; cc++) {
#pragma unroll
                        for (int j = 0; j < SP - 1; j++)
                            xw[j][cc] = xw[j + 1][cc];
                        if (SP > 0)
                            xw[SP - 1][cc] = xv[g][cc];
                    }
                }
            }
        }
    }
}

/* final_state[n, c, i] = the input at position len - S + i of sequence n (the initial
 * state before the start). Reads its S values, then writes them: hT may alias h0. */
__global__ void conv_final(const ConvP p) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)p.N * p.C)
        return;
    const int n = (int)(idx / p.C), c = (int)(idx % p.C), S = p.W - 1;
    const int64_t bos = bound(p, n), len = bound(p, n + 1) - bos;
    float v[LM_CUDA_SHORT_CONV_MAX_W];
#pragma unroll
    for (int i = 0; i < LM_CUDA_SHORT_CONV_MAX_W - 1; i++) {
        if (i < S) {
            const int64_t q = len - S + i;
            v[i] = q >= 0 ? __bfloat162float(p.x[(bos + q) * p.C + c])
                   : p.h0 ? p.h0[idx * S + S + q]
                          : 0.0f;
        }
    }
#pragma unroll
    for (int i = 0; i < LM_CUDA_SHORT_CONV_MAX_W - 1; i++)
        if (i < S)
            p.hT[idx * S + i] = v[i];
}

/* ---------------------------------------------------------------- backward */

template <int WM, int CV> __global__ void __launch_bounds__(THREADS, 4) conv_bwd(const ConvP p) {
    constexpr int SP = WM - 1;
    const int c0 = (blockIdx.y * THREADS + threadIdx.x) * CV;
    if (c0 >= p.C)
        return;
    const int S = p.W - 1;
    const int64_t t0 = (int64_t)blockIdx.x * TT_BWD;
    const int64_t t1 = t0 + TT_BWD < p.rows ? t0 + TT_BWD : p.rows;
    float wp[WM][CV], dw[WM][CV];
    load_taps<WM, CV>(p, c0, wp);
#pragma unroll
    for (int j = 0; j < WM; j++)
#pragma unroll
        for (int cc = 0; cc < CV; cc++)
            dw[j][cc] = 0.0f;
    for (int n = doc_of(p, t0); n < p.N; n++) {
        const int64_t bos = bound(p, n), eos = bound(p, n + 1);
        if (bos >= t1)
            break;
        const int64_t a = bos > t0 ? bos : t0, b = eos < t1 ? eos : t1;
        if (a >= b)
            continue;
        float xw[SP][CV], gr[SP][CV];
        load_window<WM, CV>(p, n, bos, a, c0, xw);
#pragma unroll
        for (int j = 0; j < SP; j++)
#pragma unroll
            for (int cc = 0; cc < CV; cc++)
                gr[j][cc] = 0.0f;
        const int64_t tend = b - 1 + SP; /* last step: emits dx[b-1] */
        for (int64_t t = a; t <= tend; t += G) {
            float xv[G][CV], dv[G][CV];
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t tt = t + g;
                if (tt <= tend && tt < eos) {
                    ld_bf<CV>(p.x + tt * p.C + c0, xv[g]);
                    ld_bf<CV>(p.dy + tt * p.C + c0, dv[g]);
                }
            }
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t tt = t + g;
                if (tt > tend)
                    break;
                float gc[CV];
                if (tt < eos) {
#pragma unroll
                    for (int cc = 0; cc < CV; cc++) {
                        if (p.silu) {
                            float pre = 0.0f;
#pragma unroll
                            for (int j = 0; j < SP; j++)
                                pre += wp[j][cc] * xw[j][cc];
                            pre += wp[SP][cc] * xv[g][cc];
                            const float s = sigmoidf_(pre);
                            gc[cc] = dv[g][cc] * (s * (1.0f + pre * (1.0f - s)));
                        } else {
                            gc[cc] = dv[g][cc];
                        }
                    }
                    if (tt < b) {
#pragma unroll
                        for (int cc = 0; cc < CV; cc++) {
#pragma unroll
                            for (int j = 0; j < SP; j++)
                                dw[j][cc] += gc[cc] * xw[j][cc];
                            dw[SP][cc] += gc[cc] * xv[g][cc];
                        }
                    }
#pragma unroll
                    for (int cc = 0; cc < CV; cc++) {
#pragma unroll
                        for (int j = 0; j < SP - 1; j++)
                            xw[j][cc] = xw[j + 1][cc];
                        if (SP > 0)
                            xw[SP - 1][cc] = xv[g][cc];
                    }
                } else {
#pragma unroll
                    for (int cc = 0; cc < CV; cc++)
                        gc[cc] = 0.0f;
                }
                /* position s = tt - SP has all of its taps now */
                const int64_t s = tt - SP;
                float o[CV];
#pragma unroll
                for (int cc = 0; cc < CV; cc++) {
                    float acc = 0.0f;
#pragma unroll
                    for (int k = 0; k < SP; k++)
                        acc += wp[SP - k][cc] * gr[k][cc];
                    o[cc] = acc + wp[0][cc] * gc[cc];
                }
                if (s >= a) {
                    if (p.dx)
                        st_bf<CV>(p.dx + s * p.C + c0, o);
                } else if (a == bos && p.dh0 && s >= bos - S) {
                    const int64_t i = s - bos + S;
#pragma unroll
                    for (int cc = 0; cc < CV; cc++)
                        p.dh0[((int64_t)n * p.C + c0 + cc) * S + i] = o[cc];
                }
#pragma unroll
                for (int cc = 0; cc < CV; cc++) {
#pragma unroll
                    for (int j = 0; j < SP - 1; j++)
                        gr[j][cc] = gr[j + 1][cc];
                    if (SP > 0)
                        gr[SP - 1][cc] = gc[cc];
                }
            }
        }
    }
    if (p.part) {
        float *dst = p.part + ((int64_t)blockIdx.x * p.C + c0) * p.W;
#pragma unroll
        for (int cc = 0; cc < CV; cc++)
#pragma unroll
            for (int j = WM - 1; j >= 0; j--) {
                const int jr = j - (WM - p.W);
                if (jr >= 0)
                    dst[cc * p.W + jr] = dw[j][cc];
            }
    }
}

/* dinitial_state of empty sequences: zeros (nothing reads their state). */
__global__ void conv_dh0_empty(const ConvP p) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)p.N * p.C)
        return;
    const int n = (int)(idx / p.C), S = p.W - 1;
    if (bound(p, n + 1) != bound(p, n))
        return;
    for (int i = 0; i < S; i++)
        p.dh0[idx * S + i] = 0.0f;
}

/* dst[col] += sum_{b < nb} part[b, col] in a fixed order (as in norm.cu). */
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

/* ---------------------------------------------------------------- decode step */

/* One thread per (b, c): y = act(sum_j w[j] * window[j]), window = (state, x); then the
 * state shifts by one and takes x. */
__global__ void conv_step(const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w,
                          float *__restrict__ state, __nv_bfloat16 *__restrict__ y, int B, int C,
                          int W, int silu) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)B * C)
        return;
    const int c = (int)(idx % C), S = W - 1;
    float st[LM_CUDA_SHORT_CONV_MAX_W];
#pragma unroll
    for (int i = 0; i < LM_CUDA_SHORT_CONV_MAX_W - 1; i++)
        if (i < S)
            st[i] = state[idx * S + i];
    const float xv = __bfloat162float(x[idx]);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < LM_CUDA_SHORT_CONV_MAX_W - 1; j++)
        if (j < S)
            acc += __bfloat162float(w[(int64_t)c * W + j]) * st[j];
    acc += __bfloat162float(w[(int64_t)c * W + S]) * xv;
    if (silu)
        acc = acc * sigmoidf_(acc);
    y[idx] = __float2bfloat16_rn(acc);
#pragma unroll
    for (int i = 0; i < LM_CUDA_SHORT_CONV_MAX_W - 1; i++)
        if (i < S)
            state[idx * S + i] = i + 1 < S ? st[i + 1] : xv;
}

/* ---------------------------------------------------------------- host side */

const char *OP = "short_conv";

/* The shared configuration checks (lm_short_conv_config_validate: sets c->N), then this
 * backend's limit. */
lm_status validate(lm_short_conv_config *c, const void *x, const void *weight, lm_error *err) {
    LM_TRY(lm_short_conv_config_validate(c, err));
    if (c->W > LM_CUDA_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s on cuda: kernel size W = %d is not supported (at most %d)", OP, c->W,
                         LM_CUDA_SHORT_CONV_MAX_W);
    if (!weight)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'weight' [C, W] is required", OP);
    if (!x && (int64_t)c->B * c->T > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: input 'x' is required", OP);
    return LM_OK;
}

bool aligned(const void *p, int bytes) { return ((uintptr_t)p % (uintptr_t)bytes) == 0; }

/* Largest channel vector <= pref that C and the bf16 pointers allow. */
int pick_cv(int pref, int C, const void *a, const void *b, const void *c) {
    int cv = pref;
    while (cv > 1 &&
           (C % cv != 0 || !aligned(a, 2 * cv) || !aligned(b, 2 * cv) || !aligned(c, 2 * cv)))
        cv /= 2;
    return cv;
}

size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* Fills the common fields; uploads cu_seqlens to the front of scratch A, which is at
 * least `extra` bytes more (returned in *extra_ptr). */
lm_status setup(lm_cuda_ctx *ctx, const lm_short_conv_config *c, ConvP &p, size_t extra,
                void **extra_ptr, lm_error *err) {
    memset(&p, 0, sizeof p);
    p.rows = (int64_t)c->B * c->T;
    p.Tseq = c->T;
    p.N = c->N;
    p.C = c->C;
    p.W = c->W;
    p.silu = c->activation == LM_ACT_SILU;
    const size_t cub = c->cu_seqlens ? align256(sizeof(int64_t) * (size_t)c->n_cu_seqlens) : 0;
    *extra_ptr = nullptr;
    if (cub + extra == 0)
        return LM_OK;
    void *s = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, cub + extra, &s, err));
    if (c->cu_seqlens) {
        LM_TRY(lm_cuda_ctx_upload(ctx, s, c->cu_seqlens, sizeof(int64_t) * (size_t)c->n_cu_seqlens,
                                  err));
        p.cu = (const int64_t *)s;
    }
    *extra_ptr = extra ? (void *)((unsigned char *)s + cub) : nullptr;
    return LM_OK;
}

/* ---------------------------------------------------------------- v2 (tiled) */

/* The tiled kernels (layers_variants.h), for W = 4, C % 8 == 0 and 16-byte aligned x (and dy):
 * a CTA of 256 threads owns 512 channels of a sub-tile of TS2 = 32 tokens and stages the
 * rows it reads into shared memory with cp.async (16-byte copies straight to shared
 * memory, every copy of the tile in flight at once, no registers held): x rows
 * [ts - 3, ts + 32) for the forward; x rows [ts - 3, ts + 35) and dy rows [ts, ts + 35)
 * for the backward (the 3-row halos come from L2: the neighbouring tile reads the same
 * rows). Thread (h, tg) then owns channels 4h .. 4h + 3 of the CTA and the 16 tokens
 * ts + 16 tg .. ts + 16 tg + 15, and runs the first kernels' walk over them (pieces cut
 * at document boundaries, windows refilled from the initial state or zeros before a
 * document start) reading shared memory. SiLU uses __expf and __fdividef. The backward
 * CTA walks 4 sub-tiles (128 tokens, the first kernels' dweight tile) and sums its
 * dweight terms in registers, then over its two token groups in shared memory (in
 * order), one partial per (tile, channel, tap) as before. */
constexpr int T2 = 256;      /* threads */
constexpr int HV2 = 128;     /* 4-channel groups per CTA (512 channels) */
constexpr int VV2 = HV2 / 2; /* 16-byte vectors per row per CTA */
constexpr int TS2 = 32;      /* tokens per sub-tile */
constexpr int TG2 = 16;      /* tokens per thread */
constexpr int SUB2 = 4;      /* backward sub-tiles per tile (TT_BWD tokens) */
constexpr int XF2 = TS2 + 3; /* forward x rows */
constexpr int XB2 = TS2 + 6; /* backward x rows */
constexpr int DB2 = TS2 + 3; /* backward dy rows */
static_assert(SUB2 * TS2 == TT_BWD, "the v2 backward tile is the v1 dweight tile");
static_assert(T2 == HV2 * (TS2 / TG2), "thread mapping");

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    asm volatile(
        "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(smem)),
        "l"(gmem)
        : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_fast(float x) {
    return __fdividef(1.0f, 1.0f + __expf(-x));
}

/* 4 channels of row r of a staged [rows][VV2] uint4 tile: group h is half (h & 1) of
 * vector h >> 1 */
__device__ __forceinline__ void ld_row4(const uint2 *tile, int r, int h, float (&f)[4]) {
    const uint2 v = tile[r * HV2 + h];
    f[0] = bf_lo(v.x), f[1] = bf_hi(v.x), f[2] = bf_lo(v.y), f[3] = bf_hi(v.y);
}

/* Stages rows q0 .. q0 + nr - 1 (those inside [0, rows)) of the CTA's 512 channels of
 * src ([rows, C] bf16) into tile ([nr][VV2] 16-byte vectors). */
__device__ __forceinline__ void stage_rows(const ConvP &p, const __nv_bfloat16 *src, uint4 *tile,
                                           int64_t q0, int nr, int vb) {
    const int nvc = p.C >> 3;
    for (int i = threadIdx.x; i < nr * VV2; i += T2) {
        const int r = i / VV2, v = i - r * VV2;
        const int64_t q = q0 + r;
        if (q >= 0 && q < p.rows && vb + v < nvc)
            cp_async16(tile + i, src + q * p.C + (int64_t)(vb + v) * 8);
    }
}

/* Taps of channels c0 .. c0 + 3 (W = 4: weight[c, 0..3] is 8 bytes). */
__device__ __forceinline__ void load_taps4(const ConvP &p, int c0, float (&wp)[4][4]) {
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
        const uint2 v = *reinterpret_cast<const uint2 *>(p.w + (int64_t)(c0 + cc) * 4);
        wp[0][cc] = bf_lo(v.x), wp[1][cc] = bf_hi(v.x), wp[2][cc] = bf_lo(v.y),
        wp[3][cc] = bf_hi(v.y);
    }
}

/* The window of the 3 inputs before token a of sequence n (from bos): the staged x
 * (row of token q: q - qbase) where q >= bos, the initial state (or zeros) before. */
__device__ __forceinline__ void window4(const ConvP &p, const uint2 *xt, int64_t qbase, int h,
                                        int n, int64_t bos, int64_t a, int c0, float (&xw)[3][4]) {
#pragma unroll
    for (int j = 0; j < 3; j++) {
        const int64_t q = a - 3 + j;
        if (q >= bos) {
            ld_row4(xt, (int)(q - qbase), h, xw[j]);
        } else {
            const int64_t i = 3 + (q - bos);
#pragma unroll
            for (int cc = 0; cc < 4; cc++)
                xw[j][cc] = (i >= 0 && p.h0) ? p.h0[((int64_t)n * p.C + c0 + cc) * 3 + i] : 0.0f;
        }
    }
}

__global__ void __launch_bounds__(T2) conv_fwd2(const ConvP p) {
    __shared__ __align__(16) uint4 xs[XF2 * VV2];
    const int64_t ts = (int64_t)blockIdx.x * TS2;
    const int vb = blockIdx.y * VV2;
    stage_rows(p, p.x, xs, ts - 3, XF2, vb);
    cp_async_wait_all();
    __syncthreads();
    const uint2 *xt = reinterpret_cast<const uint2 *>(xs);
    const int h = threadIdx.x % HV2, tg = threadIdx.x / HV2;
    const int c0 = vb * 8 + h * 4;
    const int64_t ta = ts + tg * TG2;
    const int64_t tb = ta + TG2 < p.rows ? ta + TG2 : p.rows;
    if (c0 >= p.C || ta >= tb)
        return;
    float wp[4][4];
    load_taps4(p, c0, wp);
    const int64_t qbase = ts - 3; /* token of staged row 0 */
    for (int n = doc_of(p, ta); n < p.N; n++) {
        const int64_t bos = bound(p, n), eos = bound(p, n + 1);
        if (bos >= tb)
            break;
        const int64_t a = bos > ta ? bos : ta, b = eos < tb ? eos : tb;
        if (a >= b)
            continue;
        float xw[3][4];
        window4(p, xt, qbase, h, n, bos, a, c0, xw);
        for (int64_t t = a; t < b; t++) {
            float xv[4], o[4];
            ld_row4(xt, (int)(t - qbase), h, xv);
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
                float acc = wp[0][cc] * xw[0][cc];
                acc += wp[1][cc] * xw[1][cc];
                acc += wp[2][cc] * xw[2][cc];
                acc += wp[3][cc] * xv[cc];
                o[cc] = p.silu ? silu_fast(acc) : acc;
                xw[0][cc] = xw[1][cc], xw[1][cc] = xw[2][cc], xw[2][cc] = xv[cc];
            }
            st_bf<4>(p.y + t * p.C + c0, o);
        }
    }
}

__global__ void __launch_bounds__(T2, 2) conv_bwd2(const ConvP p) {
    extern __shared__ uint4 sm2[]; /* x tile [XB2][VV2], then dy tile [DB2][VV2] */
    uint4 *xs = sm2, *ds = sm2 + XB2 * VV2;
    const uint2 *xt = reinterpret_cast<const uint2 *>(xs);
    const uint2 *dt = reinterpret_cast<const uint2 *>(ds);
    const int64_t t0 = (int64_t)blockIdx.x * TT_BWD;
    const int vb = blockIdx.y * VV2;
    const int h = threadIdx.x % HV2, tg = threadIdx.x / HV2;
    const int c0 = vb * 8 + h * 4;
    const bool chan = c0 < p.C;
    const int S = 3;
    float wp[4][4], dw[4][4];
    if (chan)
        load_taps4(p, c0, wp);
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++)
            dw[j][cc] = 0.0f;
    for (int sub = 0; sub < SUB2; sub++) {
        const int64_t ts = t0 + sub * TS2;
        if (ts >= p.rows)
            break;
        if (sub > 0)
            __syncthreads(); /* every read of the previous sub-tile is done */
        stage_rows(p, p.x, xs, ts - 3, XB2, vb);
        stage_rows(p, p.dy, ds, ts, DB2, vb);
        cp_async_wait_all();
        __syncthreads();
        const int64_t ta = ts + tg * TG2;
        const int64_t tb = ta + TG2 < p.rows ? ta + TG2 : p.rows;
        if (!chan || ta >= tb)
            continue;
        const int64_t xbase = ts - 3, dbase = ts; /* tokens of staged row 0 */
        for (int n = doc_of(p, ta); n < p.N; n++) {
            const int64_t bos = bound(p, n), eos = bound(p, n + 1);
            if (bos >= tb)
                break;
            const int64_t a = bos > ta ? bos : ta, b = eos < tb ? eos : tb;
            if (a >= b)
                continue;
            float xw[3][4], gr[3][4];
            window4(p, xt, xbase, h, n, bos, a, c0, xw);
#pragma unroll
            for (int j = 0; j < 3; j++)
#pragma unroll
                for (int cc = 0; cc < 4; cc++)
                    gr[j][cc] = 0.0f;
            const int64_t tend = b - 1 + 3; /* last step: emits dx[b-1] */
            for (int64_t tt = a; tt <= tend; tt++) {
                float gc[4];
                if (tt < eos) {
                    float xv[4], dv[4];
                    ld_row4(xt, (int)(tt - xbase), h, xv);
                    ld_row4(dt, (int)(tt - dbase), h, dv);
#pragma unroll
                    for (int cc = 0; cc < 4; cc++) {
                        if (p.silu) {
                            float pre = wp[0][cc] * xw[0][cc];
                            pre += wp[1][cc] * xw[1][cc];
                            pre += wp[2][cc] * xw[2][cc];
                            pre += wp[3][cc] * xv[cc];
                            const float s = sigmoid_fast(pre);
                            gc[cc] = dv[cc] * (s * (1.0f + pre * (1.0f - s)));
                        } else {
                            gc[cc] = dv[cc];
                        }
                    }
                    if (tt < b) {
#pragma unroll
                        for (int cc = 0; cc < 4; cc++) {
                            dw[0][cc] += gc[cc] * xw[0][cc];
                            dw[1][cc] += gc[cc] * xw[1][cc];
                            dw[2][cc] += gc[cc] * xw[2][cc];
                            dw[3][cc] += gc[cc] * xv[cc];
                        }
                    }
#pragma unroll
                    for (int cc = 0; cc < 4; cc++)
                        xw[0][cc] = xw[1][cc], xw[1][cc] = xw[2][cc], xw[2][cc] = xv[cc];
                } else {
#pragma unroll
                    for (int cc = 0; cc < 4; cc++)
                        gc[cc] = 0.0f;
                }
                /* position s = tt - 3 has all of its taps now */
                const int64_t s = tt - 3;
                float o[4];
#pragma unroll
                for (int cc = 0; cc < 4; cc++)
                    o[cc] = wp[3][cc] * gr[0][cc] + wp[2][cc] * gr[1][cc] + wp[1][cc] * gr[2][cc] +
                            wp[0][cc] * gc[cc];
                if (s >= a) {
                    if (p.dx)
                        st_bf<4>(p.dx + s * p.C + c0, o);
                } else if (a == bos && p.dh0 && s >= bos - S) {
                    const int64_t i = s - bos + S;
#pragma unroll
                    for (int cc = 0; cc < 4; cc++)
                        p.dh0[((int64_t)n * p.C + c0 + cc) * S + i] = o[cc];
                }
#pragma unroll
                for (int cc = 0; cc < 4; cc++)
                    gr[0][cc] = gr[1][cc], gr[1][cc] = gr[2][cc], gr[2][cc] = gc[cc];
            }
        }
    }
    if (p.part) {
        /* the two token groups' sums, in group order, into one partial per (tile,
         * channel, tap) */
        __syncthreads();
        float *red = reinterpret_cast<float *>(sm2); /* [2][HV2][16] */
        float *mine = red + ((int64_t)tg * HV2 + h) * 16;
#pragma unroll
        for (int cc = 0; cc < 4; cc++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                mine[cc * 4 + j] = dw[j][cc];
        __syncthreads();
        if (tg == 0 && chan) {
            const float *other = red + ((int64_t)HV2 + h) * 16;
            float4 *dst = reinterpret_cast<float4 *>(p.part + ((int64_t)blockIdx.x * p.C + c0) * 4);
#pragma unroll
            for (int cc = 0; cc < 4; cc++)
                dst[cc] = make_float4(
                    mine[cc * 4 + 0] + other[cc * 4 + 0], mine[cc * 4 + 1] + other[cc * 4 + 1],
                    mine[cc * 4 + 2] + other[cc * 4 + 2], mine[cc * 4 + 3] + other[cc * 4 + 3]);
        }
    }
}

/* dst[col] += sum_{b < nb} part[b, col] in a fixed order: warp w of 32 sums the rows
 * b = w, w + 32, ... (8 loads in flight), then the 32 warp sums in warp order. */
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

constexpr size_t BWD2_SMEM = (size_t)(XB2 + DB2) * VV2 * sizeof(uint4);

/* v2 covers W = 4 with 16-byte vectors of x, y / dy, dx and 8-byte weight rows. */
bool v2_conv_ok(const lm_short_conv_config *c, const void *w, const void *a, const void *b,
                const void *d) {
    return c->W == 4 && c->C % 8 == 0 && aligned(w, 8) && aligned(a, 16) && aligned(b, 16) &&
           aligned(d, 16);
}

lm_status check_variant(int variant, lm_error *err) {
    if (variant < 0 || variant > LM_LAYERS_CONV_VARIANTS)
        return lm_errorf(err, LM_ERR_INVALID, "%s: variant = %d is outside [0, %d]", OP, variant,
                         LM_LAYERS_CONV_VARIANTS);
    return LM_OK;
}

typedef void (*ConvK)(ConvP);

ConvK pick_fwd(int wm, int cv) {
    if (wm == 4)
        return cv == 8   ? conv_fwd<4, 8>
               : cv == 4 ? conv_fwd<4, 4>
               : cv == 2 ? conv_fwd<4, 2>
                         : conv_fwd<4, 1>;
    return cv == 4 ? conv_fwd<8, 4> : cv == 2 ? conv_fwd<8, 2> : conv_fwd<8, 1>;
}

ConvK pick_bwd(int wm, int cv) {
    if (wm == 4)
        return cv == 4 ? conv_bwd<4, 4> : cv == 2 ? conv_bwd<4, 2> : conv_bwd<4, 1>;
    return cv == 2 ? conv_bwd<8, 2> : conv_bwd<8, 1>;
}

} // namespace

extern "C" lm_status lm_cuda_short_conv_forward_v(lm_cuda_ctx *ctx, int variant,
                                                  lm_short_conv_config *c, const void *x,
                                                  const void *weight, const float *initial_state,
                                                  void *y, float *final_state, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_variant(variant, err)); /* one variant: LM_LAYERS_CONV_VARIANTS */
    LM_TRY(validate(c, x, weight, err));
    const int64_t rows = (int64_t)c->B * c->T;
    if (!y && rows > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' is required", OP);
    if (y && y == x)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'y' must not alias input 'x'", OP);
    if (final_state && ((const void *)final_state == x || (void *)final_state == y))
        return lm_errorf(err, LM_ERR_INVALID, "%s: 'final_state' must not alias 'x' or 'y'", OP);
    if (c->W == 1)
        final_state = nullptr; /* [N, C, 0]: nothing to write */
    if (rows == 0 && !final_state)
        return LM_OK;
    ConvP p;
    void *unused = nullptr;
    LM_TRY(setup(ctx, c, p, 0, &unused, err));
    p.x = (const __nv_bfloat16 *)x;
    p.w = (const __nv_bfloat16 *)weight;
    p.h0 = c->W > 1 ? initial_state : nullptr;
    p.y = (__nv_bfloat16 *)y;
    p.hT = final_state;
    if (rows > 0 && v2_conv_ok(c, weight, x, y, nullptr)) {
        const dim3 grid((unsigned)((rows + TS2 - 1) / TS2),
                        (unsigned)((c->C + 8 * VV2 - 1) / (8 * VV2)));
        conv_fwd2<<<grid, T2, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("conv_fwd2");
    } else if (rows > 0) {
        const int wm = c->W <= 4 ? 4 : 8;
        const int cv = pick_cv(wm == 4 ? 8 : 4, c->C, x, y, nullptr);
        const dim3 grid((unsigned)((rows + TT_FWD - 1) / TT_FWD),
                        (unsigned)((c->C / cv + THREADS - 1) / THREADS));
        pick_fwd(wm, cv)<<<grid, THREADS, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("conv_fwd");
    }
    if (final_state) {
        const int64_t n = (int64_t)p.N * p.C;
        conv_final<<<(unsigned)((n + 255) / 256), 256, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("conv_final");
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_short_conv_backward_v(lm_cuda_ctx *ctx, int variant,
                                                   lm_short_conv_config *c, const void *x,
                                                   const void *weight, const float *initial_state,
                                                   const void *dy, void *dx, float *dweight,
                                                   float *dinitial_state, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_variant(variant, err)); /* one variant: LM_LAYERS_CONV_VARIANTS */
    LM_TRY(validate(c, x, weight, err));
    const int64_t rows = (int64_t)c->B * c->T;
    if (!dy && rows > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: upstream gradient 'dy' is required", OP);
    if (dx && (dx == dy || dx == x))
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'dx' must not alias 'x' or 'dy'", OP);
    if (c->W == 1)
        dinitial_state = nullptr;
    if (rows == 0)
        dweight = nullptr; /* nothing to add */
    if (!dx && !dweight && !dinitial_state)
        return LM_OK;
    const int wm = c->W <= 4 ? 4 : 8;
    const int cv = pick_cv(wm == 4 ? 4 : 2, c->C, x, dy, dx);
    const int64_t tiles = (rows + TT_BWD - 1) / TT_BWD;
    const int64_t cw = (int64_t)c->C * c->W;
    ConvP p;
    void *part = nullptr;
    LM_TRY(setup(ctx, c, p, dweight ? (size_t)tiles * cw * sizeof(float) : 0, &part, err));
    p.x = (const __nv_bfloat16 *)x;
    p.w = (const __nv_bfloat16 *)weight;
    p.dy = (const __nv_bfloat16 *)dy;
    p.h0 = c->W > 1 ? initial_state : nullptr;
    p.dx = (__nv_bfloat16 *)dx;
    p.dh0 = dinitial_state;
    p.part = (float *)part;
    const bool v2 = v2_conv_ok(c, weight, x, dy, dx);
    if (rows > 0 && v2) {
        if (lm_cuda_ctx_first_use(ctx, (const void *)conv_bwd2))
            LM_CK(cudaFuncSetAttribute(conv_bwd2, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)BWD2_SMEM));
        const dim3 grid((unsigned)tiles, (unsigned)((c->C + 8 * VV2 - 1) / (8 * VV2)));
        conv_bwd2<<<grid, T2, BWD2_SMEM, ctx->stream>>>(p);
        LM_CK_LAUNCH("conv_bwd2");
    } else if (rows > 0) {
        const dim3 grid((unsigned)tiles, (unsigned)((c->C / cv + THREADS - 1) / THREADS));
        pick_bwd(wm, cv)<<<grid, THREADS, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("conv_bwd");
    }
    if (dinitial_state) {
        const int64_t n = (int64_t)p.N * p.C;
        conv_dh0_empty<<<(unsigned)((n + 255) / 256), 256, 0, ctx->stream>>>(p);
        LM_CK_LAUNCH("conv_dh0_empty");
    }
    if (dweight && v2) {
        colsum2_add<<<(unsigned)((cw + 31) / 32), 1024, 0, ctx->stream>>>(p.part, (int)tiles,
                                                                          (int)cw, dweight);
        LM_CK_LAUNCH("conv colsum2_add");
    } else if (dweight) {
        colsum_add<<<(unsigned)((cw + 31) / 32), 256, 0, ctx->stream>>>(p.part, (int)tiles, (int)cw,
                                                                        dweight);
        LM_CK_LAUNCH("conv colsum_add");
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_short_conv_step(lm_cuda_ctx *ctx, int B, int C, int W,
                                             lm_activation act, const void *x, const void *weight,
                                             float *conv_state, void *y, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (B < 1 || C < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s step: B = %d and C = %d must be >= 1", OP, B, C);
    if (W < 1 || W > LM_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_INVALID, "%s step: kernel size W = %d is outside [1, %d]", OP,
                         W, LM_SHORT_CONV_MAX_W);
    if (W > LM_CUDA_SHORT_CONV_MAX_W)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s step on cuda: kernel size W = %d is not supported (at most %d)", OP, W,
                         LM_CUDA_SHORT_CONV_MAX_W);
    if (act != LM_ACT_NONE && act != LM_ACT_SILU)
        return lm_errorf(err, LM_ERR_INVALID, "%s step: unknown activation %d", OP, (int)act);
    if (!x || !weight || !y)
        return lm_errorf(err, LM_ERR_INVALID, "%s step: '%s' is required", OP,
                         !x        ? "x"
                         : !weight ? "weight"
                                   : "y");
    if (!conv_state && W > 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: decode step needs 'conv_state' [B, C, W-1]", OP);
    if (y == x)
        return lm_errorf(err, LM_ERR_INVALID, "%s step: output 'y' must not alias input 'x'", OP);
    const int64_t n = (int64_t)B * C;
    conv_step<<<(unsigned)((n + 255) / 256), 256, 0, ctx->stream>>>(
        (const __nv_bfloat16 *)x, (const __nv_bfloat16 *)weight, conv_state, (__nv_bfloat16 *)y, B,
        C, W, act == LM_ACT_SILU);
    LM_CK_LAUNCH("conv_step");
    return LM_OK;
}

/* The public entry points: the default variants. */
extern "C" lm_status lm_cuda_short_conv_forward(lm_cuda_ctx *ctx, lm_short_conv_config *c,
                                                const void *x, const void *weight,
                                                const float *initial_state, void *y,
                                                float *final_state, lm_error *err) {
    return lm_cuda_short_conv_forward_v(ctx, 0, c, x, weight, initial_state, y, final_state, err);
}

extern "C" lm_status lm_cuda_short_conv_backward(lm_cuda_ctx *ctx, lm_short_conv_config *c,
                                                 const void *x, const void *weight,
                                                 const float *initial_state, const void *dy,
                                                 void *dx, float *dweight, float *dinitial_state,
                                                 lm_error *err) {
    return lm_cuda_short_conv_backward_v(ctx, 0, c, x, weight, initial_state, dy, dx, dweight,
                                         dinitial_state, err);
}
