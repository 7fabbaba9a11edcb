/* Shared pieces of the CUDA KDA kernels (kda_fwd.cu: forward; kda_train.cu: training
 * forward saves and backward): tile constants, the kernel parameter block, and the
 * KDA-specific PTX helpers (fragment addresses, bulk and tensor copies; the common
 * wrappers for mma.sync, ldmatrix, cp.async, mbarrier and wgmma are in ptx.cuh).
 * Internal to src/ops/cuda; not a public header. */
#ifndef LINMOE_KDA_COMMON_CUH
#define LINMOE_KDA_COMMON_CUH

#include <cuda.h> /* CUtensorMap (the driver entry point is fetched at run time) */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "linmoe/kda_cuda.h"
#include "ops/cuda/ctx.cuh"
#include "ops/cuda/ptx.cuh"

#define BT 64    /* chunk */
#define KD 128   /* K and V padded to this */
#define RS 136   /* bf16 row stride of 128-wide tiles in shared memory (272 B) */
#define AS 72    /* bf16 row stride of 64-wide tiles (144 B) */
#define FS 68    /* fp32 row stride of 64-wide fp32 tiles */
#define GS 132   /* fp32 row stride of the G tile */
#define NT1 256  /* threads of the intra kernel */
#define NT2 128  /* threads of the recurrence kernel */

typedef __nv_bfloat16 bf16;

namespace {


struct Params {
    const bf16 *q, *k, *v, *g, *beta;
    const float *A_log, *dt_bias, *h0;
    bf16 *o;
    float *ht;
    /* workspace, one block per (chunk ci, value head hv), cb = ci * HV + hv:
     * w, u, qg, kg [cb][64][128] bf16; Aqk [cb][64][64] bf16; gl [cb][128] fp32 */
    bf16 *w, *u, *qg, *kg, *Aqk;
    float *gl;
    /* training forward only (NULL otherwise), see KdaSaveBufs */
    float *Xs, *nqs, *nks, *bs;
    bf16 *Ps;
    bf16 *hs, *vns;
    bf16 *Kgs; /* [cb][64][128] nk k e^G, for the backward's UT kernel */
    const int2 *chunks;   /* [nchunks] (t0, L) in token rows of the flattened [B*T] */
    const int2 *seqs;     /* [N] (first chunk, number of chunks) */
    int nchunks, N;
    int T, H, HV, K, V, gdn, gate, l2, sig, shared_diag;
    /* inference with kda_inter_wg: flags[cb] = epoch once (chunk, head) cb's workspace is
     * written (kda_intra_tc), so the recurrence can start on a sequence-head before the
     * whole intra grid ends (NULL otherwise) */
    unsigned *flags;
    unsigned epoch;
    float lb, scale;
};

/* e^x as one MUFU.EX2 with flush-to-zero: __expf without -ftz compiles to ex2.approx plus
 * a denormal range fix (a compare and two multiplies); results below 2^-126 only ever
 * scale products that are negligible at bf16 precision here. */
__device__ __forceinline__ float fexp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}
/* 2^x as one MUFU.EX2 (flush-to-zero), for exponents already in log2 units */
__device__ __forceinline__ float ex2f(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f
__device__ __forceinline__ float sigmoidf_(float x) { return __fdividef(1.0f, 1.0f + fexp(-x)); }
/* The activated gate in log2 units, log2(e) g(x) for the raw gate x of one channel with
 * bias gb (reference/kda.md §2.1): bounded lb sigmoid(ga (x + gb)) as
 * (lb log2 e) / (1 + 2^(-ga log2(e) (x + gb))) (an FFMA, two MUFU ops and an add);
 * softplus -ga softplus(x + gb); none x. Shared by the forward's intra kernel and the
 * backward's pair kernel, which recomputes G instead of reading a saved one. */
template <int GATE>
__device__ __forceinline__ float gate_log2(float x, float gb, float ga, float lb) {
    if (GATE == LM_GATE_BOUNDED) {
        const float gc = -ga * LOG2E_F;
        return __fdividef(lb * LOG2E_F, 1.0f + ex2f(fmaf(x, gc, gc * gb)));
    }
    /* log-decays below LM_KDA_LOG_DECAY_FLOOR (kda.h) are the floor: a full reset that
     * keeps the fp32 cumulative sum exact enough (-1e9 + g loses g in fp32) */
    if (GATE == LM_GATE_SOFTPLUS) {
        const float z = x + gb;
        const float g = -ga * (z > 20.0f ? z : __logf(1.0f + fexp(z)));
        return fmaxf(g, LM_KDA_LOG_DECAY_FLOOR) * LOG2E_F;
    }
    return fmaxf(x, LM_KDA_LOG_DECAY_FLOOR) * LOG2E_F;
}
/* f[i] <- gate_log2(f[i], gb[i * BSTEP]) for i < N, with the gate chosen once outside
 * the (unrolled) loop: BSTEP = 1 for per-element biases, 0 for one bias for all */
template <int N, int BSTEP>
__device__ __forceinline__ void gate_log2_n(int gate, float (&f)[N], const float *gb, float ga, float lb) {
    if (gate == LM_GATE_BOUNDED) {
#pragma unroll
        for (int i = 0; i < N; i++)
            f[i] = gate_log2<LM_GATE_BOUNDED>(f[i], gb[i * BSTEP], ga, lb);
    } else if (gate == LM_GATE_SOFTPLUS) {
#pragma unroll
        for (int i = 0; i < N; i++)
            f[i] = gate_log2<LM_GATE_SOFTPLUS>(f[i], gb[i * BSTEP], ga, lb);
    } else {
#pragma unroll
        for (int i = 0; i < N; i++)
            f[i] = gate_log2<LM_GATE_NONE>(f[i], gb[i * BSTEP], ga, lb);
    }
}
/* G in log2 units over N consecutive rows of one channel from their raw gates (bf16 bits):
 * the gate of each row (bias gb), rows >= nrow counted as 0, then the inclusive sum over
 * the rows, as the forward's intra kernel computes G (the backward recomputes it). */
template <int N>
__device__ __forceinline__ void gate_cumsum_rows(int gate, const unsigned short (&raw)[N], int nrow,
                                                 float gb, float ga, float lb, float (&G)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++)
        G[i] = __uint_as_float((uint32_t)raw[i] << 16);
    gate_log2_n<N, 0>(gate, G, &gb, ga, lb);
    G[0] = nrow > 0 ? G[0] : 0.0f;
#pragma unroll
    for (int i = 1; i < N; i++)
        G[i] = G[i - 1] + (i < nrow ? G[i] : 0.0f);
}


/* ---------------------------------------------------------------- PTX helpers */
/* Fragment addresses (lane l). A tile at (m0, k0) of a row-major [m][k] array: */
__device__ __forceinline__ const bf16 *a_addr(const bf16 *base, int ld, int m0, int k0, int l) {
    return base + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8;
}
/* A tile at (m0, k0) of A = M^T, M stored row-major [k][m]: */
__device__ __forceinline__ const bf16 *at_addr(const bf16 *M, int ld, int m0, int k0, int l) {
    return M + (k0 + (l & 7) + ((l >> 4) & 1) * 8) * ld + m0 + ((l >> 3) & 1) * 8;
}
/* Two B tiles (k0..k0+15, n0..n0+15) of B stored row-major [k][n] (use with ldsm4t):
 * r[0], r[1] = tile n0; r[2], r[3] = tile n0 + 8 */
__device__ __forceinline__ const bf16 *b_kn_addr(const bf16 *B, int ld, int k0, int n0, int l) {
    return B + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0 + (l >> 4) * 8;
}
/* Two B tiles of B = M^T with M stored row-major [n][k] (use with ldsm4) */
__device__ __forceinline__ const bf16 *b_nk_addr(const bf16 *M, int ld, int k0, int n0, int l) {
    return M + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8;
}

/* 8 consecutive values: fp32 from / bf16 to / bf16 from 16-byte aligned addresses */
__device__ __forceinline__ void ld8f(float f[8], const float *src) {
    const float4 a = *reinterpret_cast<const float4 *>(src);
    const float4 b = *reinterpret_cast<const float4 *>(src + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void ld8h(float f[8], const bf16 *src) {
    const uint4 u = *reinterpret_cast<const uint4 *>(src);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int x = 0; x < 4; x++) {
        f[2 * x] = __low2float(h[x]);
        f[2 * x + 1] = __high2float(h[x]);
    }
}
/* The tokens of a sequence whose chunks are entries sq.x .. sq.x + sq.y - 1 of the chunk
 * table (consecutive 64-token chunks): chunk j starts at first + 64 j and has
 * min(64, end - start) rows. Two table reads per sequence instead of one per step (a table
 * read per step put a global load on the recurrences' critical path). */
struct SeqSpan {
    int first = 0, end = 0;
    __device__ __forceinline__ SeqSpan(const int2 *chunks, int2 sq) {
        if (sq.y > 0) {
            const int2 cf = chunks[sq.x], cl = chunks[sq.x + sq.y - 1];
            first = cf.x;
            end = cl.x + cl.y;
        }
    }
    __device__ __forceinline__ void chunk(int j, int &t0, int &L) const {
        t0 = first + j * BT;
        L = min(BT, end - t0);
    }
};
__device__ __forceinline__ void st8h(bf16 *dst, const float f[8]) {
    uint4 u;
    u.x = pack_bf16(f[0], f[1]);
    u.y = pack_bf16(f[2], f[3]);
    u.z = pack_bf16(f[4], f[5]);
    u.w = pack_bf16(f[6], f[7]);
    *reinterpret_cast<uint4 *>(dst) = u;
}

/* ---------------------------------------------------------------- wgmma (sm_90a) */
/* Shared-memory operand descriptor of wgmma, no swizzle (PTX ISA, "Matrix Descriptor
 * Format"): the operand is stored as core matrices of 8 rows x 16 bytes, each contiguous
 * (128 B); lbo = bytes between core matrices adjacent in K, sbo = adjacent in M or N. */
__device__ __forceinline__ uint64_t wg_desc(const void *ptr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((smem_u32(ptr) >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}
/* mbarrier (shared::cta) and the bulk copy engine (sm_90): one thread posts the bytes
 * to expect and issues the copies, which complete the transaction count; waiters spin
 * on the phase parity */
/* NS stage barriers (one arrival each) set up by thread 0 and made visible to the copy
 * engine and to every thread of the CTA before the first copy is issued */
template <int NS>
__device__ __forceinline__ void mbar_init_stages(uint64_t *bar, int tid, uint64_t *empty = nullptr,
                                                 int consumers = 0, int arrivals = 1) {
    if (tid == 0) {
#pragma unroll
        for (int k = 0; k < NS; k++) {
            mbar_init(&bar[k], arrivals);
            if (empty)
                mbar_init(&empty[k], consumers);
        }
    }
    fence_proxy_async(); /* the barriers, before the async proxy */
    __syncthreads();
}
__device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}
/* an arrival on bar when this thread's earlier cp.async copies have landed (counted in the
 * barrier's arrivals: noinc) */
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, int parity) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, uint32_t bytes,
                                         uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];\n" ::"r"(smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
/* a 2-D box of a tensor map (the tensor copy engine) into shared memory, completing on
 * bar; c0 the inner (column) and r0 the outer (row) coordinate */
__device__ __forceinline__ void tma_g2s(void *dst, const void *tmap, int c0, int r0,
                                        uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(dst)),
                 "l"(tmap), "r"(c0), "r"(r0), "r"(smem_u32(bar))
                 : "memory");
}
/* Byte offset of (row r, column c) in a bf16 tile of rows x 64 columns that the tensor
 * copy engine wrote with the 128-byte swizzle (rows of 128 B, 1024-byte aligned): the
 * 16-byte chunk c / 8 of row r sits at chunk (c / 8) ^ (r % 8) */
__device__ __forceinline__ int sw128(int r, int c) {
    return r * 128 + ((((c >> 3) ^ r) & 7) << 4) + ((c & 7) << 1);
}
/* wgmma descriptor of a K-major operand in such a tile (8-row groups 1024 B apart),
 * starting at K offset 16 ks (ks < 4) */
__device__ __forceinline__ uint64_t wg_desc_sw128(const void *tile, int ks) {
    return (uint64_t)(((smem_u32(tile) + 32 * ks) >> 4) & 0x3FFF) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
/* release / acquire of a flag in global memory (gpu scope) */
__device__ __forceinline__ void st_release(unsigned *ptr, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned *ptr) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}
/* named barrier `id` of n threads: wait for it, or arrive without waiting */
__device__ __forceinline__ void bar_sync_n(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive_n(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
/* four 8 x 8 bf16 matrices stored transposed: lanes 8 i .. 8 i + 7 give the row addresses
 * of matrix i, register i holds its mma fragment (row lane / 4, columns 2 (lane % 4) ..) */
__device__ __forceinline__ void stsm4t(void *ptr, uint32_t r0, uint32_t r1, uint32_t r2,
                                       uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     smem_u32(ptr)),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}
/* The 64 fp32 accumulators of an m64n128 wgmma as inline-asm operands %0..%63: the
 * register list and the read-write constraints */
#define WG_D64_REGS                                                                            \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "   \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63} "
#define WG_D8(d, i)                                                                             \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D64(d)                                                                               \
    WG_D8(d, 0), WG_D8(d, 8), WG_D8(d, 16), WG_D8(d, 24), WG_D8(d, 32), WG_D8(d, 40),          \
        WG_D8(d, 48), WG_D8(d, 56)
/* d (+)= A B for the 64 x 128 tile of one warpgroup (wgmma m64n128k16, bf16 in, fp32
 * accumulate), A and B from shared memory (descriptors, both K-major); acc = 0 overwrites
 * d. d[4 j + e] is row 16 (warp % 4) + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) +
 * e % 2: the mma.sync accumulators of 16 n-tiles. */
__device__ __forceinline__ void wgmma_ss128(float (&d)[64], uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64_REGS
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_D64(d)
                 : "l"(da), "l"(db), "r"(acc));
}
/* the same with A from registers: the m16n8k16 A fragment of rows 16 (warp % 4) .. */
__device__ __forceinline__ void wgmma_rs128(float (&d)[64], const uint32_t (&a)[4], uint64_t db,
                                            int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64_REGS
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : WG_D64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

/* A double-buffered fragment pipeline over N (compile-time) K steps: frags(ks, b) requests
 * step ks's fragments into buffer b, body(ks, b) issues its products; step ks + 1's
 * fragments are requested before step ks's products (the asm statements keep their order,
 * so the pipelining is written out) */
template <int N, typename F, typename B>
__device__ __forceinline__ void frag_pipe(F frags, B body) {
    frags(0, 0);
#pragma unroll
    for (int ks = 0; ks < N; ks++) {
        if (ks + 1 < N)
            frags(ks + 1, (ks & 1) ^ 1);
        body(ks, ks & 1);
    }
}

/* The recurrence kernels' state slice in mma accumulator registers: warp w holds state
 * rows 32w + 16mt + (g, g + 8) and columns c0 + 8nt + 2t + (0, 1) (g = lane / 4,
 * t = lane % 4) of the [K][V] fp32 matrix at src / dst (NULL src: zeros). */
template <int NTV>
__device__ __forceinline__ void state_regs_load(float (&S)[2][NTV][4], const float *src, int K,
                                                int V, int c0, int warp, int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NTV; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int d = warp * 32 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
                const int c = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                S[mt][nt][e] = (src && d < K && c < V) ? src[(int64_t)d * V + c] : 0.0f;
            }
}
/* S <- diag(gl) S for the slice above: row d scaled by gl[d] (the chunk's decay) */
template <int NTV>
__device__ __forceinline__ void state_decay(float (&S)[2][NTV][4], const float *gl, int warp,
                                            int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        const int d = warp * 32 + mt * 16 + (lane >> 2);
        const float e0 = gl[d], e1 = gl[d + 8];
#pragma unroll
        for (int nt = 0; nt < NTV; nt++) {
            S[mt][nt][0] *= e0;
            S[mt][nt][1] *= e0;
            S[mt][nt][2] *= e1;
            S[mt][nt][3] *= e1;
        }
    }
}
template <int NTV>
__device__ __forceinline__ void state_regs_store(const float (&S)[2][NTV][4], float *dst, int K,
                                                 int V, int c0, int warp, int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NTV; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int d = warp * 32 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
                const int c = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                if (d < K && c < V)
                    dst[(int64_t)d * V + c] = S[mt][nt][e];
            }
}

/* Load stages of the recurrence kernels (kda_inter_tc, kda_bwd_dh): chunk c + 1 loads
 * while c computes. Three stages fit at BV <= 32 but were measured slower at
 * (1, 32768, 16, 128): 1.08 vs 1.02 ms forward, 0.98 vs 0.87 ms backward (perf notes v8). */
constexpr int REC_STAGES = 2;
/* stages of the dh recurrence when the tensor copy engine loads them (TM): three at slices
 * of up to 32 columns (a chunk's 61 KB lands two steps ahead of its use: dh 0.718 -> 0.684 ms
 * at (1,32768,16,128)), two where three do not fit. The forward's kda_inter_tc keeps two
 * (three measured 0.643 -> 0.741 ms there) */
__host__ __device__ constexpr int tm_stages(int BV) { return BV <= 32 ? 3 : 2; }

/* The tensor-copy recurrences (kda_inter_tc, kda_bwd_dh with TM) run NT consumer threads
 * plus one producer warp, which loads every chunk: chunk j into stage j % NS once each
 * consumer warp has released the stage's previous use (an arrival on empty[j % NS] after its
 * last read of it). The caller's threads run the loop: kda_inter_tc's first producer thread
 * (the tensor copies), kda_bwd_dh's whole producer warp (lane 0 the tensor copies, every lane
 * its share of dO by cp.async). The consumers synchronise among
 * themselves on named barrier 1; the copies no longer sit on a consumer warp's path (about
 * 100 instructions per step on warp 0, which the other warps then waited for at the step's
 * barriers: perf notes v13). */
template <int NS, typename Load>
__device__ __forceinline__ void rec_producer(int n, uint64_t *empty, Load load) {
    for (int j = 0; j < n; j++) {
        if (j >= NS)
            mbar_wait(&empty[j % NS], ((j / NS) - 1) & 1);
        load(j % NS, j);
    }
}
/* whether a recurrence with the copy engine's loads (TM) and WC warp groups runs the
 * producer warp: at WC = 1, where thread 0's copies sat on the only group's path; with two
 * groups thread 0 keeps them. A ninth warp puts three warps on one SM sub-partition, which
 * caps every thread at 168 registers (kda_inter_tc's 128-column kernel and kda_inter_wg
 * then spill); a producer warp group with setmaxnreg would avoid that (not tried). */
template <bool TM, int WC> __host__ __device__ constexpr bool rec_prod() { return TM && WC == 1; }
/* the consumers' barrier: all NT threads of the CTA, or (TM) named barrier 1 of NT threads */
template <bool TM, int NT> __device__ __forceinline__ void rec_sync() {
    if (TM)
        bar_sync_n(1, NT);
    else
        __syncthreads();
}
/* a consumer warp releases stage k (after its last read of it) */
__device__ __forceinline__ void rec_release(uint64_t *empty, int k, int lane) {
    __syncwarp();
    if (lane == 0)
        mbar_arrive(&empty[k]);
}

/* Whether a recurrence kernel writes its saved [rows][BV] tiles (h and v' forward, dh and
 * dVn backward) with 16-byte stores from the bf16 shared tile at the end of a step
 * (store_slice) rather than 4-byte stores from the fragments: faster from 32 columns
 * (0.10 ms at (1, 8192, 64, 128)); at BV = 16 the added step latency costs more. */
__host__ __device__ constexpr bool rec_staged_stores(int BV) { return BV >= 32; }

/* rows x BV bf16 from a padded shared tile (row stride BV + 8) to global rows of KD
 * elements starting at dst (16-byte stores, NT threads). */
template <int BV, int NT>
__device__ __forceinline__ void store_slice(bf16 *dst, const bf16 (*src)[BV + 8], int rows, int tid) {
    for (int e = tid; e < rows * (BV / 8); e += NT) {
        const int r = e / (BV / 8), c = (e % (BV / 8)) * 8;
        *reinterpret_cast<uint4 *>(dst + r * KD + c) = *reinterpret_cast<const uint4 *>(&src[r][c]);
    }
}

} // namespace

/* Device buffers of a training forward (kda_train.cu) that the forward kernels fill
 * besides their usual workspace; NULL members are not written. cb = chunk * HV + hv. */
struct KdaSaveBufs {
    bf16 *w, *u, *qg, *kg, *Aqk; /* the forward workspace (kept for the backward) */
    float *gl;
    const int2 *chunks, *seqs;   /* device chunk tables (already filled) */
    int nchunks;
    float *Xs;   /* [cb][64][64]  X = (I + beta P)^-1, upper part zero */
    bf16 *Ps;    /* [cb][64][64]  P[i][j] = sum_d k_i k_j e^(G_i - G_j), j < i (no beta;
                  * bf16; blocks above the diagonal unwritten) */
    float *nqs, *nks, *bs; /* [cb][64] q row factor (l2 norm * scale), k row factor, beta */
    bf16 *hs;    /* [cb][128][128] state at the chunk start (bf16) */
    bf16 *vns;   /* [cb][64][128]  v' = u - w S (bf16) */
    bf16 *Kg;    /* [cb][64][128]  Kg = nk k e^G (bf16; zero past L and K), for the UT
                  * kernel (saving it costs the intra kernel 16 KB of stores per block;
                  * recomputing it in the backward cost a 0.19 ms kernel, docs/perf-notes.md v14) */
};

/* V slice width of the recurrence kernels (forward kda_inter_tc, backward kda_bwd_dh) for
 * nsh = sequences x value heads: the widest of 16 / 32 / 64 that still gives about one CTA
 * per SM (kda_fwd.cu), or the context's kda.bv when set. A 128-wide slice with 16 warps was
 * measured slower at nsh = 128 (docs/perf-notes.md). */
int kda_cuda_bv(const lm_cuda_ctx *ctx, int nsh);

/* Launches kernel k on ctx's stream (grid x threads, sm bytes of dynamic shared memory)
 * after opting it in to sm bytes on the context's first use of k; returns the first CUDA
 * error */
template <typename... P, typename... A>
inline cudaError_t kda_cuda_launch_smem(lm_cuda_ctx *ctx, void (*k)(P...), dim3 grid, int threads,
                                        size_t sm, const A &...args) {
    cudaError_t e = cudaSuccess;
    if (lm_cuda_ctx_first_use(ctx, (const void *)k) &&
        (e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm)) !=
            cudaSuccess)
        return e;
    k<<<grid, threads, sm, ctx->stream>>>(args...);
    return cudaGetLastError();
}

/* Copies the chunk tables (n entries) to dst (lm_cuda_ctx_upload: pinned staging, ordered
 * on ctx's stream), inside the device buffer [buf, buf + cap) of ctx that the call's kernels
 * write, unless the context's last copy to dst had the same entries, none of its KDA device
 * buffers was allocated or freed since (kda_cuda_buffers_changed) and no call with another
 * layout of that buffer (whose workspace covers dst) came in between; saves a host-to-device
 * copy per call in training and inference loops. The cache lives in the context's
 * LM_SLOT_KDA_FWD state (kda_fwd.cu). */
lm_status kda_cuda_upload_tables(lm_cuda_ctx *ctx, int2 *dst, const int2 *h, size_t n,
                                 const void *buf, size_t cap, lm_error *err);
void kda_cuda_buffers_changed(lm_cuda_ctx *ctx);
/* Frees the context's training buffers (spare saved buffer, backward scratch; kda_train.cu);
 * the caller has synchronised the stream. */
void kda_cuda_train_release(lm_cuda_ctx *ctx);

/* Validates the configuration for the CUDA path and sets c->N (kda_fwd.cu); the caller
 * has entered its context. */
lm_status kda_cuda_check(lm_kda_config *c, const lm_kda_cuda_inputs *in, const void *o,
                         lm_error *err);
/* Number of 64-token chunks (c->N set) and the host chunk tables: chunks[nchunks]
 * (t0, L), seqs[N] (first chunk, count). */
int kda_cuda_nchunks(const lm_kda_config *c);
void kda_cuda_chunk_tables(const lm_kda_config *c, int2 *chunks, int2 *seqs);
/* The forward kernels on ctx's stream; with sv != NULL its buffers and chunk tables are
 * used and the training quantities saved, otherwise the context's workspace. */
lm_status kda_cuda_forward_run(lm_cuda_ctx *ctx, lm_kda_config *c, const lm_kda_cuda_inputs *in,
                               lm_kda_cuda_outputs *out, const KdaSaveBufs *sv, lm_error *err);

/* ------------------------------------------------ swizzled tiles, tensor maps */
#define SWT (BT * 64 * 2) /* bytes of one 64 x 64 swizzled box */
/* The tensor copies that every recurrence stage takes for a chunk at workspace row r0 (one
 * thread, completing on bar): three [64][128] operands x, y, z (two 64 x 64 boxes each, the
 * 128-byte swizzle; w, qg, kg forward, w, qg, kd backward), Aqk (one box) and gl (a bulk copy
 * of 128 floats); the caller posts the bytes (mbar_expect) and adds its own copies. */
__device__ __forceinline__ void tma_chunk(unsigned char *x, unsigned char *y, unsigned char *z,
                                          unsigned char *A, float *gl, const void *mx,
                                          const void *my, const void *mz, const void *mA,
                                          const float *gl_src, int r0, uint64_t *bar) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        tma_g2s(x + h * SWT, mx, 64 * h, r0, bar);
        tma_g2s(y + h * SWT, my, 64 * h, r0, bar);
        tma_g2s(z + h * SWT, mz, 64 * h, r0, bar);
    }
    tma_g2s(A, mA, 0, r0, bar);
    bulk_g2s(gl, gl_src, KD * sizeof(float), bar);
}
/* (row r, column c < 128) of a two-box swizzled tile */
__device__ __forceinline__ int sw128x2(int r, int c) { return (c >> 6) * SWT + sw128(r, c & 63); }

/* fragment addresses in either stage layout: A operand (rows m0.., K columns k0..) of a
 * row-major tile, and A = M^T of a row-major M */
__device__ __forceinline__ const void *frag_a(const bf16 (&t)[BT][RS], int m0, int k0, int l) {
    return a_addr(&t[0][0], RS, m0, k0, l);
}
__device__ __forceinline__ const void *frag_a(const bf16 (&t)[BT][AS], int m0, int k0, int l) {
    return a_addr(&t[0][0], AS, m0, k0, l);
}
__device__ __forceinline__ const void *frag_a(const unsigned char (&t)[2 * SWT], int m0, int k0,
                                              int l) {
    return t + sw128x2(m0 + (l & 15), k0 + (l >> 4) * 8);
}
__device__ __forceinline__ const void *frag_a(const unsigned char (&t)[SWT], int m0, int k0,
                                              int l) {
    return t + sw128(m0 + (l & 15), k0 + (l >> 4) * 8);
}
__device__ __forceinline__ const void *frag_at(const bf16 (&t)[BT][RS], int m0, int k0, int l) {
    return at_addr(&t[0][0], RS, m0, k0, l);
}
__device__ __forceinline__ const void *frag_at(const bf16 (&t)[BT][AS], int m0, int k0, int l) {
    return at_addr(&t[0][0], AS, m0, k0, l);
}
__device__ __forceinline__ const void *frag_at(const unsigned char (&t)[2 * SWT], int m0, int k0,
                                               int l) {
    return t + sw128x2(k0 + (l & 7) + ((l >> 4) & 1) * 8, m0 + ((l >> 3) & 1) * 8);
}
__device__ __forceinline__ const void *frag_at(const unsigned char (&t)[SWT], int m0, int k0,
                                               int l) {
    return t + sw128(k0 + (l & 7) + ((l >> 4) & 1) * 8, m0 + ((l >> 3) & 1) * 8);
}

/* Tensor maps of the workspaces for the recurrences' tensor copies: cuTensorMapEncodeTiled
 * from the driver, fetched through the runtime (no link-time dependency on libcuda); false
 * when the driver has none or refuses the map (the caller takes its cp.async path then) */
typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                  const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                  const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
/* The context's cuTensorMapEncodeTiled, fetched on its first use (kept in the
 * LM_SLOT_KDA_FWD state, kda_fwd.cu); NULL when the driver has none */
EncodeTiledFn kda_cuda_encoder(lm_cuda_ctx *ctx);
/* [rows][cols] bf16 row-major at base, boxes of 64 x 64 with the 128-byte swizzle */
static inline bool wg_map(EncodeTiledFn fn, CUtensorMap *m, const void *base, uint64_t rows,
                          uint64_t cols) {
    if (!fn)
        return false;
    const cuuint64_t dim[2] = {cols, rows}, stride[1] = {cols * sizeof(bf16)};
    const cuuint32_t box[2] = {64, 64}, es[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dim, stride, box,
              es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
/* The tensor maps that both recurrences' stages take (tma_chunk): w, qg, a third [rows][128]
 * operand x (kg forward, kd backward) and Aqk [rows][64], for a workspace of `rows` rows;
 * false when the driver gives none */
static inline bool rec_maps(EncodeTiledFn fn, CUtensorMap *w, CUtensorMap *qg, CUtensorMap *x,
                            CUtensorMap *A, const void *pw, const void *pqg, const void *px,
                            const void *pA, uint64_t rows) {
    return wg_map(fn, w, pw, rows, KD) && wg_map(fn, qg, pqg, rows, KD) &&
           wg_map(fn, x, px, rows, KD) && wg_map(fn, A, pA, rows, BT);
}
/* What a host-side tensor-map cache was encoded for (up to five operand addresses, the rows
 * and a slice width); the maps are encoded again when any of it changes, since saved buffers
 * of another call may share one address but not the others */
struct MapKey {
    const void *a[5];
    uint64_t rows;
    int width;
    bool operator==(const MapKey &o) const {
        for (int i = 0; i < 5; i++)
            if (a[i] != o.a[i])
                return false;
        return rows == o.rows && width == o.width;
    }
};
/* out = the maps cached for key now, encoded again by enc() (false: the driver gave none)
 * when the cache at was for another key */
template <typename Maps, typename Enc>
static inline bool cached_maps(Maps &maps, MapKey &at, const MapKey &now, Enc enc, Maps &out) {
    if (!(at == now)) {
        at = MapKey{};
        if (!enc())
            return false;
        at = now;
    }
    out = maps;
    return true;
}

#endif
