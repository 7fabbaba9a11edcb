/* KDA / GDN training forward and backward on the GPU (include/linmoe/kda_cuda.h has the
 * contract; docs/kda-math.md derives every line; reference/kda.md §4.1 lists fla's
 * kernels, whose split this follows: one sequential kernel for the state gradient and
 * chunk-parallel kernels for everything else).
 *
 * Training forward: the forward kernels of kda_fwd.cu with their workspace kept, plus
 * per block cb = (chunk, value head): X = (I + beta P)^-1 (fp32), P (bf16, blocks above
 * the diagonal unwritten), the row factors of q and k and beta, the state at the chunk
 * start S0 (bf16), v' = u - w S0 (bf16) and Kg = nk k e^G (bf16, for b3). G is not
 * saved: the pair kernel recomputes it from the raw gate (gate_cumsum_rows, as the intra
 * kernel computes it).
 *
 * Backward (notation of docs/kda-math.md "Backward of one chunk"):
 *   b0  only when V is not a multiple of 8 or do_ not 16-byte aligned (otherwise b1 and
 *       b2 read dO in place): dO gathered into the padded [cb][64][128] layout (zeros
 *       outside [L, V]) before b1.
 *       (Kg = nk k e^G for b3 is saved by the training forward's intra kernel.)
 *   b1  one CTA per (sequence, value head, V slice), chunks in reverse, the state
 *       gradient dS (the gradient w.r.t. the state after the chunk) in fp32 registers:
 *         dh[cb] = dS  (bf16, for the chunk-parallel kernels)
 *         dVn    = Aqk^T dO + Kd dS
 *         dS    <- gamma * dS + Qg^T dO - W^T dVn;      dh0 = dS at the end.
 *   b2  per block: dAqk = tril(dO Vn^T), dQg = dO S0^T, dKd = Vn dS^T, dW = -dVn S0^T,
 *       dgamma_d = sum_v S0 dS.
 *   b3  per block, the UT transform: dTm = dVn (beta v)^T + dW (beta Kg)^T;
 *       dv = beta Tm^T dVn; dKg = beta Tm^T dW; dAb = -Tm^T dTm Tm^T (strictly lower),
 *       dP = beta dAb; dbeta = sum v (Tm^T dVn) + sum Kg (Tm^T dW) + sum dAb P.
 *   b4  per block, G recomputed from the raw gate; the pair products by 16-row blocks
 *       with the forward's reference rows
 *       (the bounded gate's diagonal on the tensor cores, other gates per pair in fp32),
 *       the assembly of dq, dk, dG, the reverse cumulative sum dg_j = sum_{r>=j} dG_r,
 *       and the gate, l2norm, scale and sigmoid backward; the chunk's parts of dA_log,
 *       ddt_bias (KDA) or of each token's dg (GDN: one per channel slice) to scratch.
 *   b5  GDN: dg summed over the slices, the gate backward per token.
 *   sum dA_log, ddt_bias: the parts summed over chunks (segments) in a fixed order.
 *   b6  dq, dk summed over the value heads of each q/k head (GVA); l2norm, scale backward.
 * Every sum has an order fixed by the shape (no float atomics), so the backward gives the
 * same bits on every run of the same inputs (kda_cuda.h "Reproducibility").
 * Products run on mma.sync m16n8k16 (bf16 operands, fp32 accumulation); X, dTm and the
 * intermediate of the inverse's derivative enter as bf16 hi + lo (about fp32 accuracy).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/kda_common.cuh"

namespace {

#define NTB 256 /* threads of the chunk-parallel backward kernels */

/* The backward's per-element partial gradients between kernels (dQg, dKd from the state
 * kernel, dKg from the UT kernel, dq and dk of a value head from the pair kernel): bf16
 * storage, fp32 arithmetic (DESIGN.md), 2 of their 4 bytes per element and pass (an fp32
 * build lost its A/B test: docs/perf-notes.md v14 has both builds' errors and times). */
typedef bf16 part_t;
__device__ __forceinline__ void st_part2(bf16 *d, float a, float b) {
    *reinterpret_cast<uint32_t *>(d) = pack_bf16(a, b);
}
__device__ __forceinline__ float ld_part(const bf16 *s) {
    return __uint_as_float((uint32_t)__ldg(reinterpret_cast<const unsigned short *>(s)) << 16);
}
__device__ __forceinline__ void st_part(bf16 *d, float a) { *d = __float2bfloat16(a); }
__device__ __forceinline__ float4 ld_part4(const bf16 *s) {
    const uint2 x = __ldg(reinterpret_cast<const uint2 *>(s));
    return make_float4(__uint_as_float(x.x << 16), __uint_as_float(x.x & 0xffff0000u),
                       __uint_as_float(x.y << 16), __uint_as_float(x.y & 0xffff0000u));
}

struct BwdParams {
    int N, nchunks, T, H, HV, K, V, gdn, gate, l2, sig, shared_diag, grp;
    int do_direct; /* V % 8 == 0: the dh and state kernels read do_ itself (no padded copy) */
    float lb, scale;
    const int2 *chunks, *seqs;
    const bf16 *q, *k, *v, *g, *beta;
    const float *A_log, *dt_bias;
    /* saved by the training forward */
    const bf16 *w, *qg, *kd, *Aqk;
    const float *gl, *Xs, *nqs, *nks, *bs;
    const bf16 *Ps;
    const bf16 *hs, *vns;
    /* upstream */
    const bf16 *do_;
    const float *dht;
    /* scratch */
    bf16 *dO, *dh, *dvn, *dW;
    const bf16 *Kgs; /* [cb][64][128] nk k e^G (bf16), saved by the training forward */
    bf16 *dAqk, *dP; /* bf16: the pair products take them as bf16 operands */
    part_t *dQg, *dKd, *dKg, *dqs, *dks; /* see part_t */
    float *dgam, *dbp;
    /* the parts of the sums over chunks and slices, summed in a fixed order afterwards
     * (kda_bwd_gdn_gate, kda_bwd_sum): GDN dg per pair-kernel slice [nzs][B*T][HV]
     * (dgs_stride = B*T*HV); KDA ddt_bias per chunk [nchunks][HV*K], dA_log per chunk and
     * slice [nchunks][nzs][HV] */
    float *dgs, *pdb, *pda;
    int64_t dgs_stride;
    int nzs; /* pair-kernel slices holding channels: ceil(K / CW) */
    /* outputs */
    bf16 *dq, *dk, *dv, *dg, *dbeta;
    float *dh0, *dA_log, *ddt_bias;
};

/* the double-buffered fragment pipeline of wmma and wmma_fa: fa(ks) gives the A fragment's
 * address at K step ks, fb(ks, np) the B pair np's (the fragments of step ks + 1 are
 * requested before the products of step ks; the asm statements keep their order, so the
 * pipelining is written out; two named buffers) */
template <int NP, bool TA, bool TB, typename FA, typename FB>
__device__ __forceinline__ void wmma_core(float (*acc)[4], FA fa, FB fb, int nks) {
    uint32_t ra[2][4], rb[2][NP][4];
    auto frags = [&](int ks, int b) {
        if (TA)
            ldsm4t(ra[b], fa(ks));
        else
            ldsm4(ra[b], fa(ks));
#pragma unroll
        for (int np = 0; np < NP; np++) {
            if (TB)
                ldsm4(rb[b][np], fb(ks, np));
            else
                ldsm4t(rb[b][np], fb(ks, np));
        }
    };
    auto prods = [&](int b) {
#pragma unroll
        for (int np = 0; np < NP; np++) {
            mma16816(acc[2 * np], ra[b], rb[b][np][0], rb[b][np][1]);
            mma16816(acc[2 * np + 1], ra[b], rb[b][np][2], rb[b][np][3]);
        }
    };
    if (nks <= 0)
        return;
    frags(0, 0);
    for (int ks = 0; ks < nks; ks += 2) {
        if (ks + 1 < nks)
            frags(ks + 1, 1);
        prods(0);
        if (ks + 1 >= nks)
            break;
        if (ks + 2 < nks)
            frags(ks + 2, 0);
        prods(1);
    }
}
/* acc[2 NP][4] += A (16 rows at m0, 16 nks columns) * B (16 nks rows, 16 NP columns at n0);
 * A row-major [m][k] (TA false) or A = M^T with M [k][m] (TA true), starting at column /
 * row ka0 of the k dimension; B [k][n] (TB false) or B = M^T with M [n][k] (TB true),
 * starting at kb0. */
template <int NP, bool TA, bool TB>
__device__ __forceinline__ void wmma(float (*acc)[4], const bf16 *A, int lda, int m0, int ka0,
                                     const bf16 *B, int ldb, int n0, int kb0, int nks, int lane) {
    wmma_core<NP, TA, TB>(
        acc,
        [&](int ks) {
            return TA ? at_addr(A, lda, m0, ka0 + ks * 16, lane)
                      : a_addr(A, lda, m0, ka0 + ks * 16, lane);
        },
        [&](int ks, int np) {
            return TB ? b_nk_addr(B, ldb, kb0 + ks * 16, n0 + np * 16, lane)
                      : b_kn_addr(B, ldb, kb0 + ks * 16, n0 + np * 16, lane);
        },
        nks);
}
/* as wmma with B [k][n] (TB false), the A fragments' addresses from fa(ks) (any tile
 * layout: the frag_a / frag_at overloads) */
template <int NP, bool TA, typename FA>
__device__ __forceinline__ void wmma_fa(float (*acc)[4], FA fa, const bf16 *B, int ldb, int n0,
                                        int kb0, int nks, int lane) {
    wmma_core<NP, TA, false>(
        acc, fa,
        [&](int ks, int np) { return b_kn_addr(B, ldb, kb0 + ks * 16, n0 + np * 16, lane); }, nks);
}
/* as wmma_fa over NKS (a compile-time count) K steps with every step's fragments requested
 * before the first product (the recurrences' critical products at 16 columns) */
template <int NP, bool TA, int NKS, typename FA>
__device__ __forceinline__ void wmma_fa_all(float (*acc)[4], FA fa, const bf16 *B, int ldb, int n0,
                                            int kb0, int lane) {
    uint32_t ra[NKS][4], rb[NKS][NP][4];
#pragma unroll
    for (int ks = 0; ks < NKS; ks++) {
        if (TA)
            ldsm4t(ra[ks], fa(ks));
        else
            ldsm4(ra[ks], fa(ks));
#pragma unroll
        for (int np = 0; np < NP; np++)
            ldsm4t(rb[ks][np], b_kn_addr(B, ldb, kb0 + ks * 16, n0 + np * 16, lane));
    }
#pragma unroll
    for (int ks = 0; ks < NKS; ks++)
#pragma unroll
        for (int np = 0; np < NP; np++) {
            mma16816(acc[2 * np], ra[ks], rb[ks][np][0], rb[ks][np][1]);
            mma16816(acc[2 * np + 1], ra[ks], rb[ks][np][2], rb[ks][np][3]);
        }
}
template <int N> __device__ __forceinline__ void zero_acc(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < N; i++)
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}
/* fp32 value to bf16 hi + lo */
__device__ __forceinline__ void split_bf16(float x, bf16 &hi, bf16 &lo) {
    hi = __float2bfloat16(x);
    lo = __float2bfloat16(x - __bfloat162float(hi));
}

/* ------------------------------------------------------------- b0: gather dO */
/* dO into the padded [cb][64][128] layout (zeros outside [L, V]); launched only when the dh
 * and state kernels cannot read dO in place (p.do_direct false). */
__global__ void __launch_bounds__(NTB) kda_bwd_gather_do(BwdParams p) {
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int2 ch = p.chunks[ci];
    const int64_t cb = (int64_t)ci * p.HV + hv;
    bf16 *dst = p.dO + cb * BT * KD;
    const int V = p.V, HV = p.HV;
    if ((V & 7) == 0) {
        for (int e = threadIdx.x; e < BT * KD / 8; e += NTB) {
            const int r = e >> 4, c = (e & 15) * 8;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (r < ch.y && c < V)
                x = __ldg(reinterpret_cast<const uint4 *>(p.do_ + ((int64_t)(ch.x + r) * HV + hv) * V + c));
            *reinterpret_cast<uint4 *>(dst + r * KD + c) = x;
        }
    } else {
        for (int e = threadIdx.x; e < BT * KD; e += NTB) {
            const int r = e >> 7, c = e & 127;
            dst[e] = (r < ch.y && c < V) ? p.do_[((int64_t)(ch.x + r) * HV + hv) * V + c]
                                         : __float2bfloat16(0.0f);
        }
    }
}

/* ------------------------------------------------- b1: reverse state recurrence */
template <int BV> struct DhStage {
    bf16 w[BT][RS], qg[BT][RS], kd[BT][RS];
    bf16 A[BT][AS];
    bf16 dO[BT][BV + 8];
    float gl[KD];
};
template <int BV> struct DhSmem {
    DhStage<BV> st[REC_STAGES];
    bf16 dS[KD][BV + 8];
    bf16 dvn[BT][BV + 8], ndvn[BT][BV + 8];
};
static_assert(sizeof(DhSmem<128>) <= 227 * 1024, "the 128-column dh kernel fits an SM's shared memory");
/* The stage when the tensor copy engine loads w, qg, kd (64 x 64 boxes with the 128-byte
 * swizzle), Aqk (one box) and gl (a bulk copy) on one mbarrier per stage (TM, as the
 * forward's kda_inter_tc); dO stays on cp.async (zero past L and V, read in place) */
template <int BV> struct __align__(1024) DhStageT {
    unsigned char w[2 * SWT], qg[2 * SWT], kd[2 * SWT], A[SWT];
    bf16 dO[BT][BV + 8];
    float gl[KD];
};
template <int BV> struct DhSmemT {
    DhStageT<BV> st[tm_stages(BV)];
    bf16 dS[KD][BV + 8];
    bf16 dvn[BT][BV + 8], ndvn[BT][BV + 8];
    uint64_t bar[tm_stages(BV)], empty[tm_stages(BV)];
};
template <int BV> constexpr size_t dh_smem_t() { return sizeof(DhSmemT<BV>) + 1024; }
static_assert(dh_smem_t<128>() <= 227 * 1024 && dh_smem_t<64>() <= 227 * 1024 &&
                  dh_smem_t<32>() <= 227 * 1024 && dh_smem_t<16>() <= 227 * 1024,
              "the TM dh kernel fits an SM's shared memory at every slice width");
struct DhMaps {
    CUtensorMap w, qg, kd, A;
};

/* dO rows t0 .. t0 + L - 1 of value head hv, columns c0 .. c0 + NC - 1, into a [64][ld]
 * tile at dst (element (r, c) at dst + off(r, c)), zeros past L and V; V % 8 == 0 */
template <int NC, int NT, typename Off>
__device__ __forceinline__ void load_do_direct(const BwdParams &p, bf16 *dst, Off off, int t0, int L, int hv,
                                               int c0, int tid) {
    for (int e = tid; e < BT * (NC / 8); e += NT) {
        const int i = e / (NC / 8), c = (e % (NC / 8)) * 8;
        const bool ok = i < L && c0 + c < p.V;
        const bf16 *src = ok ? p.do_ + ((int64_t)(t0 + i) * p.HV + hv) * p.V + c0 + c : p.do_;
        cp_async16_zfill(dst + off(i, c), src, ok);
    }
}

/* dO of chunk cb (columns c0 ..) into a stage by cp.async, every thread */
template <int BV, int NT, typename Stage>
__device__ __forceinline__ void dh_load_do(const BwdParams &p, Stage &st, int64_t cb, int c0,
                                           int tid, int hv, int t0, int L) {
    if (p.do_direct) {
        load_do_direct<BV, NT>(p, &st.dO[0][0], [](int i, int c) { return i * (BV + 8) + c; }, t0, L,
                               hv, c0, tid);
    } else {
        const bf16 *dO = p.dO + cb * BT * KD + c0;
        for (int e = tid; e < BT * (BV / 8); e += NT) {
            const int i = e / (BV / 8), c = (e % (BV / 8)) * 8;
            cp_async16(&st.dO[i][c], dO + i * KD + c);
        }
    }
}
template <int BV, int NT>
__device__ __forceinline__ void dh_load(const BwdParams &p, DhStage<BV> &st, int64_t cb, int c0,
                                        int tid, int hv, int t0, int L) {
    const bf16 *w = p.w + cb * BT * KD, *qg = p.qg + cb * BT * KD, *kd = p.kd + cb * BT * KD;
    for (int e = tid; e < BT * (KD / 8); e += NT) {
        const int i = e >> 4, d0 = (e & 15) * 8;
        cp_async16(&st.w[i][d0], w + i * KD + d0);
        cp_async16(&st.qg[i][d0], qg + i * KD + d0);
        cp_async16(&st.kd[i][d0], kd + i * KD + d0);
    }
    const bf16 *A = p.Aqk + cb * BT * BT;
    for (int e = tid; e < BT * (BT / 8); e += NT) {
        const int i = e >> 3, j0 = (e & 7) * 8;
        cp_async16(&st.A[i][j0], A + i * BT + j0);
    }
    dh_load_do<BV, NT>(p, st, cb, c0, tid, hv, t0, L);
    if (tid < KD / 4)
        cp_async16(&st.gl[tid * 4], p.gl + cb * KD + tid * 4);
}
/* TM: the tensor copies of chunk cb into a stage, on the stage's barrier (the producer
 * warp's first thread); dO comes by cp.async from the consumers (dh_load_do) */
template <int BV>
__device__ __forceinline__ void dh_tma(const BwdParams &p, DhStageT<BV> &st, uint64_t *bar,
                                       const DhMaps &m, int64_t cb) {
    mbar_expect(bar, 7 * SWT + KD * sizeof(float));
    tma_chunk(st.w, st.qg, st.kd, st.A, st.gl, &m.w, &m.qg, &m.kd, &m.A, p.gl + cb * KD,
              (int)(cb * BT), bar);
}

/* WC column groups of 4 warps, as in the forward's kda_inter_tc (and as there a producer
 * warp with the tensor copies at WC = 1) */
template <int BV, int WC, bool TM>
__global__ void __launch_bounds__(NT2 * WC + (rec_prod<TM, WC>() ? 32 : 0))
    kda_bwd_dh(BwdParams p, const __grid_constant__ DhMaps maps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    using Smem = typename std::conditional<TM, DhSmemT<BV>, DhSmem<BV>>::type;
    Smem &s = *reinterpret_cast<Smem *>(
        TM ? smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023) : smem_raw);
    constexpr int NTV = BV / 8 / WC;
    constexpr int NT = NT2 * WC; /* consumer threads (PROD: a producer warp after them) */
    constexpr bool PROD = rec_prod<TM, WC>();
    const int c0 = blockIdx.x * BV;
    const int n = blockIdx.y / p.HV, hv = blockIdx.y % p.HV;
    const int K = p.K, V = p.V, HV = p.HV;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wc = tid >> 7;
    const int g = lane >> 2, t = lane & 3;
    const int cw = wc * (BV / WC);
    constexpr bool STAGED = rec_staged_stores(BV); /* the dh and dVn tiles */

    const int2 sq = p.seqs[n];
    constexpr int NS = TM ? tm_stages(BV) : REC_STAGES;
    const SeqSpan span(p.chunks, sq); /* the tokens of each chunk, for dO read in place */
    if constexpr (TM) {
        /* PROD: the stage barrier counts thread 0's arrival with the tensor copies' bytes and
         * one arrival per producer lane when its dO copies have landed */
        mbar_init_stages<NS>(s.bar, tid, PROD ? s.empty : nullptr, NT / 32, PROD ? 33 : 1);
        if (PROD && tid >= NT) { /* the producer warp, every lane: chunk j from the end */
            const int pl = tid - NT;
            rec_producer<NS>(sq.y, s.empty, [&](int k, int j) {
                const int64_t cbj = (int64_t)(sq.x + sq.y - 1 - j) * HV + hv;
                if (pl == 0)
                    dh_tma<BV>(p, s.st[k], &s.bar[k], maps, cbj);
                int t0, L;
                span.chunk(sq.y - 1 - j, t0, L);
                dh_load_do<BV, 32>(p, s.st[k], cbj, c0, pl, hv, t0, L);
                cp_async_mbar_arrive(&s.bar[k]);
            });
            cp_async_wait<0>();
            return;
        }
    }
    float S[2][NTV][4]; /* dS, state rows 32 warp + 16 mt + ... */
    state_regs_load<NTV>(S, p.dht ? p.dht + ((int64_t)n * HV + hv) * K * V : nullptr, K, V, c0 + cw,
                         warp, lane);
    /* chunk j (from the end) into stage k (TM: the tensor copies from thread 0, dO from
     * every thread; without PROD only) */
    auto load = [&](int k, int j, int64_t cb) {
        int t0, L;
        span.chunk(sq.y - 1 - j, t0, L);
        if constexpr (TM) {
            if (tid == 0)
                dh_tma<BV>(p, s.st[k], &s.bar[k], maps, cb);
            dh_load_do<BV, NT>(p, s.st[k], cb, c0, tid, hv, t0, L);
        } else
            dh_load<BV, NT>(p, s.st[k], cb, c0, tid, hv, t0, L);
    };
    /* one commit group per chunk (empty past the end), so the wait count is constant */
    if (!PROD) {
#pragma unroll
        for (int k = 0; k < NS - 1; k++) {
            if (k < sq.y)
                load(k, k, (int64_t)(sq.x + sq.y - 1 - k) * HV + hv);
            cp_async_commit();
        }
    }
    for (int jj = 0; jj < sq.y; jj++) {
        const int ci = sq.x + sq.y - 1 - jj;
        const int64_t cb = (int64_t)ci * HV + hv;
        auto &st = s.st[jj % NS];
        if (!PROD) {
            if (jj + NS - 1 < sq.y)
                load((jj + NS - 1) % NS, jj + NS - 1, cb - (int64_t)(NS - 1) * HV);
            cp_async_commit();
        }
        /* dS -> bf16 tile and dh[cb] */
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NTV; nt++) {
                const int d = warp * 32 + mt * 16 + g, c = cw + nt * 8 + 2 * t;
                const uint32_t lo = pack_bf16(S[mt][nt][0], S[mt][nt][1]);
                const uint32_t hi = pack_bf16(S[mt][nt][2], S[mt][nt][3]);
                *reinterpret_cast<uint32_t *>(&s.dS[d][c]) = lo;
                *reinterpret_cast<uint32_t *>(&s.dS[d + 8][c]) = hi;
                if (!STAGED) {
                    bf16 *dh = p.dh + cb * KD * KD + c0 + c;
                    *reinterpret_cast<uint32_t *>(dh + d * KD) = lo;
                    *reinterpret_cast<uint32_t *>(dh + (d + 8) * KD) = hi;
                }
            }
        if (!PROD)
            cp_async_wait<NS - 1>(); /* chunk jj's group is complete */
        if constexpr (TM)
            mbar_wait(&s.bar[jj % NS], (jj / NS) & 1); /* and its tensor copies (PROD: all) */
        /* dVn = Aqk^T dO + Kd dS (rows 16 warp ..). The stage's products (Aqk^T dO here,
         * Qg^T dO below) need no barrier when the producer warp loaded all of it (its
         * mbarrier covers dO too): they run before the barriers, off the dS chain. */
        float av[NTV][4];
        zero_acc<NTV>(av);
        auto aqk_do = [&]() {
            wmma_fa<NTV / 2, true>(
                av, [&](int ks) { return frag_at(st.A, warp * 16, warp * 16 + ks * 16, lane); },
                &st.dO[0][0], BV + 8, cw, warp * 16, 4 - warp, lane);
        };
        if constexpr (PROD)
            aqk_do();
        rec_sync<PROD, NT>();
        if constexpr (!PROD)
            aqk_do();
        {
            auto fkd = [&](int ks) { return frag_a(st.kd, warp * 16, ks * 16, lane); };
            if (NTV == 2)
                wmma_fa_all<NTV / 2, false, KD / 16>(av, fkd, &s.dS[0][0], BV + 8, cw, 0, lane);
            else
                wmma_fa<NTV / 2, false>(av, fkd, &s.dS[0][0], BV + 8, cw, 0, KD / 16, lane);
        }
#pragma unroll
        for (int nt = 0; nt < NTV; nt++) {
            const int r = warp * 16 + g, c = cw + nt * 8 + 2 * t;
            const uint32_t a0 = pack_bf16(av[nt][0], av[nt][1]);
            const uint32_t a1 = pack_bf16(av[nt][2], av[nt][3]);
            *reinterpret_cast<uint32_t *>(&s.dvn[r][c]) = a0;
            *reinterpret_cast<uint32_t *>(&s.dvn[r + 8][c]) = a1;
            *reinterpret_cast<uint32_t *>(&s.ndvn[r][c]) = a0 ^ 0x80008000u;
            *reinterpret_cast<uint32_t *>(&s.ndvn[r + 8][c]) = a1 ^ 0x80008000u;
            if (!STAGED) {
                bf16 *dv = p.dvn + cb * BT * KD + c0 + c;
                *reinterpret_cast<uint32_t *>(dv + r * KD) = a0;
                *reinterpret_cast<uint32_t *>(dv + (r + 8) * KD) = a1;
            }
        }
        /* dS <- gamma dS + Qg^T dO - W^T dVn */
        auto decay_qg_do = [&]() {
            state_decay<NTV>(S, st.gl, warp, lane);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                wmma_fa<NTV / 2, true>(
                    S[mt],
                    [&](int ks) { return frag_at(st.qg, warp * 32 + mt * 16, ks * 16, lane); },
                    &st.dO[0][0], BV + 8, cw, 0, BT / 16, lane);
        };
        if constexpr (PROD)
            decay_qg_do();
        rec_sync<PROD, NT>();
        if constexpr (!PROD)
            decay_qg_do();
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            wmma_fa<NTV / 2, true>(
                S[mt], [&](int ks) { return frag_at(st.w, warp * 32 + mt * 16, ks * 16, lane); },
                &s.ndvn[0][0], BV + 8, cw, 0, BT / 16, lane);
        }
        /* dh[cb] and dVn out (s.dS and s.dvn are rewritten only after the barrier below) */
        if (STAGED) {
            store_slice<BV, NT>(p.dh + cb * KD * KD + c0, s.dS, KD, tid);
            store_slice<BV, NT>(p.dvn + cb * BT * KD + c0, s.dvn, BT, tid);
        }
        /* the next step rewrites s.dS before its first barrier and s.dvn after it; every
         * read of s.dS precedes this step's second barrier, so only the staged stores (and
         * the loads that every thread issues at the next step's start) need this one */
        if (STAGED || !PROD)
            rec_sync<PROD, NT>();
        if constexpr (PROD)
            rec_release(s.empty, jj % NS, lane);
    }
    if (p.dh0)
        state_regs_store<NTV>(S, p.dh0 + ((int64_t)n * HV + hv) * K * V, K, V, c0 + cw, warp, lane);
}

/* ------------------------------------------------------ b2: the state products */
/* 128-wide bf16 tiles without padding (112 KB in all, so that 2 CTAs fit on an SM): the
 * 16-byte chunk x of row r sits at chunk x ^ (r & 7), which keeps the 8 rows that one
 * ldmatrix 8x8 reads in distinct banks. */
struct StateSmem {
    bf16 S0[KD * KD], dS[KD * KD];
    bf16 dO[BT * KD], vn[BT * KD], dvn[BT * KD];
};
__device__ __forceinline__ int swz_chunk(int r, int c) { return r * KD + ((((c >> 3) ^ (r & 7)) & 15) << 3); }

/* acc[2 NP][4] += A (16 rows at m0, all 128 columns) * M^T (M rows n0 .. n0 + 16 NP - 1),
 * A and M swizzled 128-wide tiles */
template <int NP>
__device__ __forceinline__ void wmma_swz(float (*acc)[4], const bf16 *A, int m0, const bf16 *M, int n0,
                                         int lane) {
#pragma unroll 2
    for (int ks = 0; ks < KD / 16; ks++) {
        uint32_t fa[4];
        ldsm4(fa, A + swz_chunk(m0 + (lane & 15), ks * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < NP; np++) {
            uint32_t fb[4];
            ldsm4(fb, M + swz_chunk(n0 + np * 16 + (lane & 7) + (lane >> 4) * 8, ks * 16 + ((lane >> 3) & 1) * 8));
            mma16816(acc[2 * np], fa, fb[0], fb[1]);
            mma16816(acc[2 * np + 1], fa, fb[2], fb[3]);
        }
    }
}

__global__ void __launch_bounds__(NTB, 2) kda_bwd_state(BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    StateSmem &s = *reinterpret_cast<StateSmem *>(smem_raw);
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int64_t cb = (int64_t)ci * p.HV + hv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    {
        const bf16 *S0 = p.hs + cb * KD * KD, *dS = p.dh + cb * KD * KD;
        for (int e = tid; e < KD * KD / 8; e += NTB) {
            const int r = e >> 4, c = (e & 15) * 8;
            cp_async16(&s.S0[swz_chunk(r, c)], S0 + r * KD + c);
            cp_async16(&s.dS[swz_chunk(r, c)], dS + r * KD + c);
        }
        const bf16 *vn = p.vns + cb * BT * KD, *dvn = p.dvn + cb * BT * KD;
        const bf16 *dO = p.do_direct ? nullptr : p.dO + cb * BT * KD;
        if (p.do_direct) {
            const int2 ch = p.chunks[ci];
            load_do_direct<KD, NTB>(p, s.dO, [](int r, int c) { return swz_chunk(r, c); }, ch.x, ch.y, hv, 0,
                                    tid);
        }
        for (int e = tid; e < BT * KD / 8; e += NTB) {
            const int r = e >> 4, c = (e & 15) * 8;
            if (!p.do_direct)
                cp_async16(&s.dO[swz_chunk(r, c)], dO + r * KD + c);
            cp_async16(&s.vn[swz_chunk(r, c)], vn + r * KD + c);
            cp_async16(&s.dvn[swz_chunk(r, c)], dvn + r * KD + c);
        }
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();
    /* dgamma_d = sum_v S0[d][v] dS[d][v]: two threads per row */
    {
        const int d = tid >> 1, h2 = (tid & 1) * 64;
        float acc = 0.0f;
        for (int c = 0; c < 64; c += 8) {
            float a[8], b[8];
            ld8h(a, &s.S0[swz_chunk(d, h2 + c)]);
            ld8h(b, &s.dS[swz_chunk(d, h2 + c)]);
#pragma unroll
            for (int x = 0; x < 8; x++)
                acc += a[x] * b[x];
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        if ((tid & 1) == 0)
            p.dgam[cb * KD + d] = acc;
    }
    /* 24 jobs of 16 x 64 (dQg, dKd, dW) and 8 of 16 x 32 (dAqk) */
    for (int job = warp; job < 32; job += NTB / 32) {
        if (job < 24) {
            const int mat = job >> 3, a = (job >> 1) & 3, half = job & 1;
            const bf16 *A = mat == 0 ? s.dO : (mat == 1 ? s.vn : s.dvn);
            const bf16 *B = mat == 1 ? s.dS : s.S0;
            float acc[8][4];
            zero_acc<8>(acc);
            wmma_swz<4>(acc, A, a * 16, B, half * 64, lane);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int r = a * 16 + g + hh * 8, c = half * 64 + nt * 8 + 2 * t;
                    const float v0 = acc[nt][2 * hh], v1 = acc[nt][2 * hh + 1];
                    const int64_t o = (cb * BT + r) * KD + c;
                    if (mat == 0)
                        st_part2(p.dQg + o, v0, v1);
                    else if (mat == 1)
                        st_part2(p.dKd + o, v0, v1);
                    else
                        *reinterpret_cast<uint32_t *>(p.dW + o) = pack_bf16(-v0, -v1);
                }
        } else {
            const int a = (job - 24) >> 1, half = job & 1;
            float acc[4][4];
            zero_acc<4>(acc);
            wmma_swz<2>(acc, s.dO, a * 16, s.vn, half * 32, lane);
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int r = a * 16 + g + hh * 8, c = half * 32 + nt * 8 + 2 * t;
                    *reinterpret_cast<uint32_t *>(p.dAqk + (cb * BT + r) * BT + c) =
                        pack_bf16(c <= r ? acc[nt][2 * hh] : 0.0f, c + 1 <= r ? acc[nt][2 * hh + 1] : 0.0f);
                }
        }
    }
}

/* -------------------------------------------------------- b3: the UT transform */
/* 109 KB, 2 CTAs per SM: beta enters dTm in its epilogue (by column) instead of through
 * beta-scaled copies of v and Kg (Kg = nk k e^G as the training forward saved it), and
 * T = dTm Tm^T (hi, lo) reuses dvn's space once dv, dKg are out. */
struct UtSmem {
    union {
        bf16 dvn[BT][RS];
        struct {
            bf16 h[BT][AS], l[BT][AS];
        } T;
    } u;
    bf16 dW[BT][RS], vr[BT][RS], kg[BT][RS];
    bf16 Xh[BT][AS], Xl[BT][AS], Dh[BT][AS], Dl[BT][AS];
    float beta[BT];
    /* dbeta's six row sums, one slot per producer (the v . dBv and Kg . dBk terms of each
     * 64-column half: DB_BV + half, DB_BK + half; the dAb . P terms of each 32-column
     * half: DB_P + half): each row of a slot written once, summed in slot order */
    float dbs[6][BT];
};
enum { DB_BV = 0, DB_BK = 2, DB_P = 4 };
static_assert(2 * (sizeof(UtSmem) + 1024) <= 228 * 1024,
              "two UT CTAs fit an SM's shared memory (1 KB reserved per CTA)");

/* rows of an input [B*T][heads][D] (bf16) into a [64][RS] tile, zeros outside [L, D] */
__device__ __forceinline__ void load_rows(bf16 (*dst)[RS], const bf16 *src, int t0, int L,
                                          int heads, int head, int D, int tid) {
    if ((D & 7) == 0) { /* every load in flight before the first store */
        constexpr int NI = BT * KD / 8 / NTB;
        uint4 x[NI];
#pragma unroll
        for (int m = 0; m < NI; m++) {
            const int e = tid + m * NTB, r = e >> 4, c = (e & 15) * 8;
            x[m] = make_uint4(0, 0, 0, 0);
            if (r < L && c < D)
                x[m] = __ldg(reinterpret_cast<const uint4 *>(src + ((int64_t)(t0 + r) * heads + head) * D + c));
        }
#pragma unroll
        for (int m = 0; m < NI; m++) {
            const int e = tid + m * NTB, r = e >> 4, c = (e & 15) * 8;
            *reinterpret_cast<uint4 *>(&dst[r][c]) = x[m];
        }
    } else {
        for (int e = tid; e < BT * KD; e += NTB) {
            const int r = e >> 7, c = e & 127;
            dst[r][c] = (r < L && c < D) ? src[((int64_t)(t0 + r) * heads + head) * D + c]
                                         : __float2bfloat16(0.0f);
        }
    }
}

/* Per-row partial sums of an mma fragment (db[hh]: row g + 8 hh of row block a, this
 * lane's columns) reduced over the 4 lanes of a row (a fixed butterfly) into sums[row]:
 * the warp is the only writer of these rows of this slot, so the sum's order is fixed. */
__device__ __forceinline__ void store_row_sums(float *sums, const float db[2], int a, int lane) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        float x = db[hh];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        if ((lane & 3) == 0)
            sums[a * 16 + (lane >> 2) + hh * 8] = x;
    }
}

__global__ void __launch_bounds__(NTB, 2) kda_bwd_ut(BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    UtSmem &s = *reinterpret_cast<UtSmem *>(smem_raw);
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int2 ch = p.chunks[ci];
    const int t0 = ch.x, L = ch.y;
    const int HV = p.HV;
    const int64_t cb = (int64_t)ci * HV + hv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    {
        const bf16 *dvn = p.dvn + cb * BT * KD, *dW = p.dW + cb * BT * KD;
        for (int e = tid; e < BT * KD / 8; e += NTB) {
            const int r = e >> 4, c = (e & 15) * 8;
            cp_async16(&s.u.dvn[r][c], dvn + r * KD + c);
            cp_async16(&s.dW[r][c], dW + r * KD + c);
        }
        cp_async_commit();
        const float *X = p.Xs + cb * BT * BT;
        float4 xr[BT * BT / 4 / NTB];
#pragma unroll
        for (int m = 0; m < BT * BT / 4 / NTB; m++)
            xr[m] = __ldg(reinterpret_cast<const float4 *>(X) + tid + m * NTB);
        /* v, X (bf16 hi + lo), beta to shared memory */
        auto stage_v_x_beta = [&]() {
            load_rows(s.vr, p.v, t0, L, HV, hv, p.V, tid);
            if (tid < BT)
                s.beta[tid] = p.bs[cb * BT + tid];
#pragma unroll
            for (int m = 0; m < BT * BT / 4 / NTB; m++) {
                const int e = (tid + m * NTB) * 4, i = e >> 6, j = e & 63;
                split_bf16(xr[m].x, s.Xh[i][j], s.Xl[i][j]);
                split_bf16(xr[m].y, s.Xh[i][j + 1], s.Xl[i][j + 1]);
                split_bf16(xr[m].z, s.Xh[i][j + 2], s.Xl[i][j + 2]);
                split_bf16(xr[m].w, s.Xh[i][j + 3], s.Xl[i][j + 3]);
            }
        };
        /* Kg = nk k e^G (bf16), saved by the training forward */
        const bf16 *Kg = p.Kgs + cb * BT * KD;
        for (int e = tid; e < BT * KD / 8; e += NTB) {
            const int r = e >> 4, c = (e & 15) * 8;
            cp_async16(&s.kg[r][c], Kg + r * KD + c);
        }
        cp_async_commit();
        stage_v_x_beta();
        cp_async_wait<0>();
    }
    __syncthreads();
    /* jobs: 8 x dTm (16 x 32), 8 x dBv (16 x 64), 8 x dBk (16 x 64) */
    for (int job = warp; job < 24; job += NTB / 32) {
        if (job < 8) {
            const int a = job >> 1, half = job & 1;
            float acc[4][4];
            zero_acc<4>(acc);
            wmma<2, false, true>(acc, &s.u.dvn[0][0], RS, a * 16, 0, &s.vr[0][0], RS, half * 32, 0,
                                 KD / 16, lane);
            wmma<2, false, true>(acc, &s.dW[0][0], RS, a * 16, 0, &s.kg[0][0], RS, half * 32, 0,
                                 KD / 16, lane);
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = a * 16 + g + (e >> 1) * 8, c = half * 32 + nt * 8 + 2 * t + (e & 1);
                    split_bf16(acc[nt][e] * s.beta[c], s.Dh[r][c], s.Dl[r][c]);
                }
        } else {
            const int isk = job >= 16, a = ((job - 8) >> 1) & 3, half = job & 1;
            const bf16 *B = isk ? &s.dW[0][0] : &s.u.dvn[0][0];
            float acc[8][4];
            zero_acc<8>(acc);
            /* Tm^T[r][i] = X[i][r], nonzero for i >= r: k blocks a..3 */
            wmma<4, true, false>(acc, &s.Xh[0][0], AS, a * 16, a * 16, B, RS, half * 64, a * 16,
                                 4 - a, lane);
            wmma<4, true, false>(acc, &s.Xl[0][0], AS, a * 16, a * 16, B, RS, half * 64, a * 16,
                                 4 - a, lane);
            float db[2] = {0.0f, 0.0f};
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int r = a * 16 + g + hh * 8, c = half * 64 + nt * 8 + 2 * t;
                    const float v0 = acc[nt][2 * hh], v1 = acc[nt][2 * hh + 1];
                    const float b = s.beta[r];
                    if (!isk) { /* dv = beta dBv; dbeta += v . dBv */
                        const __nv_bfloat162 x =
                            *reinterpret_cast<const __nv_bfloat162 *>(&s.vr[r][c]);
                        db[hh] += __low2float(x) * v0 + __high2float(x) * v1;
                        if (r < L && p.dv && c < p.V) {
                            bf16 *dst = p.dv + ((int64_t)(t0 + r) * HV + hv) * p.V + c;
                            if ((p.V & 1) == 0) /* c even: c + 1 < V too */
                                *reinterpret_cast<uint32_t *>(dst) = pack_bf16(b * v0, b * v1);
                            else {
                                dst[0] = __float2bfloat16(b * v0);
                                if (c + 1 < p.V)
                                    dst[1] = __float2bfloat16(b * v1);
                            }
                        }
                    } else { /* dKg = beta dBk; dbeta += Kg . dBk */
                        const __nv_bfloat162 x =
                            *reinterpret_cast<const __nv_bfloat162 *>(&s.kg[r][c]);
                        db[hh] += __low2float(x) * v0 + __high2float(x) * v1;
                        st_part2(p.dKg + (cb * BT + r) * KD + c, b * v0, b * v1);
                    }
                }
            store_row_sums(s.dbs[(isk ? DB_BK : DB_BV) + half], db, a, lane);
        }
    }
    __syncthreads();
    /* T1 = dTm Tm^T (Tm^T[k][n] = X[n][k]: B = X as [n][k]) */
    {
        const int a = warp >> 1, half = warp & 1;
        float acc[4][4];
        zero_acc<4>(acc);
        wmma<2, false, true>(acc, &s.Dh[0][0], AS, a * 16, 0, &s.Xh[0][0], AS, half * 32, 0, 4, lane);
        wmma<2, false, true>(acc, &s.Dl[0][0], AS, a * 16, 0, &s.Xh[0][0], AS, half * 32, 0, 4, lane);
        wmma<2, false, true>(acc, &s.Dh[0][0], AS, a * 16, 0, &s.Xl[0][0], AS, half * 32, 0, 4, lane);
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = a * 16 + g + (e >> 1) * 8, c = half * 32 + nt * 8 + 2 * t + (e & 1);
                split_bf16(acc[nt][e], s.u.T.h[r][c], s.u.T.l[r][c]);
            }
    }
    __syncthreads();
    /* dAb = -Tm^T T1 (strictly lower); dP = beta dAb; dbeta += dAb . P */
    {
        const int a = warp >> 1, half = warp & 1;
        float acc[4][4];
        zero_acc<4>(acc);
        wmma<2, true, false>(acc, &s.Xh[0][0], AS, a * 16, a * 16, &s.u.T.h[0][0], AS, half * 32, a * 16,
                             4 - a, lane);
        wmma<2, true, false>(acc, &s.Xl[0][0], AS, a * 16, a * 16, &s.u.T.h[0][0], AS, half * 32, a * 16,
                             4 - a, lane);
        wmma<2, true, false>(acc, &s.Xh[0][0], AS, a * 16, a * 16, &s.u.T.l[0][0], AS, half * 32, a * 16,
                             4 - a, lane);
        const bf16 *P = p.Ps + cb * BT * BT; /* blocks above the diagonal are unwritten */
        float db[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int r = a * 16 + g + hh * 8, c = half * 32 + nt * 8 + 2 * t;
                const float d0 = c < r ? -acc[nt][2 * hh] : 0.0f;
                const float d1 = c + 1 < r ? -acc[nt][2 * hh + 1] : 0.0f;
                const __nv_bfloat162 pp = *reinterpret_cast<const __nv_bfloat162 *>(P + r * BT + c);
                db[hh] += (c < r ? d0 * __low2float(pp) : 0.0f) + (c + 1 < r ? d1 * __high2float(pp) : 0.0f);
                const float b = s.beta[r];
                *reinterpret_cast<uint32_t *>(p.dP + (cb * BT + r) * BT + c) = pack_bf16(b * d0, b * d1);
            }
        store_row_sums(s.dbs[DB_P + half], db, a, lane);
    }
    __syncthreads();
    if (tid < BT) { /* the six row sums in a fixed order */
        float x = s.dbs[0][tid];
#pragma unroll
        for (int k = 1; k < 6; k++)
            x += s.dbs[k][tid];
        p.dbp[cb * BT + tid] = x;
    }
}

/* ------------------------------------- b4: pair products, assembly, gate backward */
/* One CTA per (chunk, value head, slice of CW channels): the pair products are
 * separable over channels, so a CTA needs only its slice (2 CTAs per SM).
 * Every pair term dA[r][i] q_r k_i e^(G_r - G_i) enters dG_r with + (row side) and
 * dG_i with - (column side); the reverse cumulative sum cancels the two for every
 * pair with both rows after j. So that they cancel to rounding, both sides take the
 * pair term as the same product of the same bf16 operands: the row side's dG part is
 * Q~_r (the rounded operand of the column side) times its accumulator, the column
 * side's is Z~_i (the rounded key operand of the row side) times its accumulator, so
 * either sees dA Q~_r Z~_i with its exact exponential scale factor between (an
 * earlier version rounded the operands independently and needed them as bf16 hi + lo
 * to cancel; docs/perf-notes.md). dq and dk take the fp32 factors. dA and dP are bf16
 * on both sides (the state and UT kernels write them in bf16; the per-pair diagonal of
 * the other gates reads the same bf16 values).
 *
 * Bounded gate (every factor <= e^(16 |lower_bound|) <= e^80, as in the forward's
 * rounds): 32-row halves with references rh = G_15 (rows 0..31) and G_47 (rows 32..63);
 *   Q = q e^(G - rh), K = k e^(G - rh), Z0 = k e^(G_15 - G) (rows 0..31),
 *   Z1 = k e^(G_47 - G) (all rows; <= 1 on rows 0..31).
 * Row side of block a (warps 2a, 2a + 1: 16 channels each): sum over key blocks b <= a of
 * dA_ab Z_b with Z = Z0 (a in the first half) or Z1, times e^(G_r - rh). Column side of
 * block a: the row blocks a' >= a of its own half, (dA_a'a^T Q_a' + dP_a'a^T K_a') times
 * e^(rh - G_j), plus for a block of the first half those of the second, times
 * e^(G_47 - G_j). Where e^(G_47 - G_j) flushes
 * to zero (below e^-87.3), both sides drop the same pairs, each below e^(75 - 87.3).
 * Other gates: per 16-row block a with r_a = G at the row before the block (r_0 = 0) and
 * r_{a+1} = G at its last row, all factors <= 1: Q = q e^(G - r_a), K = k e^(G - r_a),
 * Zc = k e^(r_{a+1} - G). Row side: sum over column blocks b < a of dA_ab Zc_b e^(r_a -
 * r_{b+1}), accumulated in registers by Horner steps (acc *= e^(r_{b+1} - r_b) <= 1
 * before adding block b), times e^(G_r - r_a). Column side: sum over row blocks a' > a of
 * (dA_a'a^T Q_a' + dP_a'a^T K_a') e^(r_a' - r_{a+1}) (Horner from a' = 3 down), times
 * e^(r_{a+1} - G_j); the diagonal blocks per pair in fp32 (lane = channel). */
#define CW 32       /* channels per CTA */
#define CWS 40      /* bf16 row stride of the operand tiles */
#define OS 36       /* fp32 row stride of the slice tiles */
#define PW 8        /* warps per CTA */
#define NTP (32 * PW)
#define RPW                                                                                        \
    8 /* rows per warp in the lane = channel phases: warp w holds rows 8w .. 8w + 7;               \
         in the products warp w computes row block w / 2, channels 16 (w % 2) .. + 15 */

struct PairSmem {
    bf16 op[4][BT][CWS]; /* Q; K; Z0 (bounded; other gates: raw k); Z1 or Zc */
    bf16 dA[BT][AS], dPb[BT][AS];
    float G[BT][OS];
    float out[3][BT][OS]; /* dq and dk of the pairs, the pairs' part of dG; later dG */
    float rr[5][CW];
    float nq[BT], nk[BT], red[PW][CW], redw[PW];
    float xs[4][2][RPW][CW]; /* the diagonal's column sides of a block's first rows from its
                                second warp (dk, dG), added by the first after a barrier */
};

/* A Horner step of the off-diagonal accumulation: acc[., channel x] *= e^(hi[x] - lo[x])
 * (<= 1: hi is the log-decay at a later row than lo); NT n-tiles of 8 channels */
template <int NT>
__device__ __forceinline__ void horner_step(float (*acc)[4], const float *hi, const float *lo, int t) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int x = nt * 8 + 2 * t + (e & 1);
            acc[nt][e] *= fexp(hi[x] - lo[x]);
        }
}

/* d(loss)/d(gate input) from dg = d(loss)/d(g) for gate GATE at input x; adds this
 * element's part of d(loss)/d(A_log) to dAl */
template <int GATE>
__device__ __forceinline__ float gate_bwd_t(float lb, float x, float bias, float ga, float dg, float &dAl) {
    if (GATE == LM_GATE_SOFTPLUS) {
        const float z = x + bias;
        const float gv = -ga * (z > 20.0f ? z : log1pf(fexp(z)));
        if (gv < -87.33f) /* e^g underflows: the forward does not depend on this g */
            return 0.0f;
        dAl += dg * gv;
        return -ga * (z > 20.0f ? 1.0f : sigmoidf_(z)) * dg;
    }
    if (GATE == LM_GATE_BOUNDED) {
        const float z = x + bias;
        /* 1 - sigmoid(u) as sigmoid(-u): the difference cancels as the gate saturates */
        const float sg = sigmoidf_(ga * z), sgm = sigmoidf_(-ga * z);
        const float dz = dg * lb * sg * sgm * ga;
        dAl += dz * z;
        return dz;
    }
    return x < -87.33f ? 0.0f : dg;
}
__device__ __forceinline__ float gate_bwd(const BwdParams &p, float x, float bias, float ga, float dg,
                                          float &dAl) {
    if (p.gate == LM_GATE_SOFTPLUS)
        return gate_bwd_t<LM_GATE_SOFTPLUS>(p.lb, x, bias, ga, dg, dAl);
    if (p.gate == LM_GATE_BOUNDED)
        return gate_bwd_t<LM_GATE_BOUNDED>(p.lb, x, bias, ga, dg, dAl);
    return gate_bwd_t<LM_GATE_NONE>(p.lb, x, bias, ga, dg, dAl);
}
/* the gate backward of this lane's N rows (rows m >= nrow give 0 and add nothing) */
template <int GATE, int N>
__device__ __forceinline__ void gate_bwd_rows(float lb, const unsigned short (&gr)[N],
                                              const float (&dg)[N], int nrow, float bias, float ga,
                                              float (&dz)[N], float &dAl) {
#pragma unroll
    for (int m = 0; m < N; m++) {
        float a = 0.0f;
        const float v = gate_bwd_t<GATE>(lb, __uint_as_float((uint32_t)gr[m] << 16), bias, ga, dg[m], a);
        dz[m] = m < nrow ? v : 0.0f;
        dAl += m < nrow ? a : 0.0f;
    }
}

/* raw q and k of a row as one register: q's bf16 bits in the high half, k's in the low */
__device__ __forceinline__ float qk_q(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }
__device__ __forceinline__ float qk_k(uint32_t x) { return __uint_as_float(x << 16); }

/* The diagonal block of the gates without a shared reference, per pair in fp32 (lane =
 * channel): rows R0 .. R0 + RPW - 1 of the 16-row block at row o (this warp's rows; q, k, G
 * of them in registers) against keys i <= r of the block (keys before R0 from shared
 * memory: raw k in operand slot 2, G). Row sides and the column sides of this warp's rows
 * into out[0..2]; the second warp of a block (R0 = RPW) leaves the column sides of the
 * first warp's rows in xs, which that warp adds after a barrier (no shared atomics). */
template <int R0>
__device__ __forceinline__ void pair_diag(PairSmem &s, int o, int lane, const uint32_t (&qk)[RPW],
                                          const float (&gv)[RPW]) {
    float qv[RPW], kv[RPW], dq[RPW], dkr[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        qv[r] = qk_q(qk[r]) * s.nq[o + R0 + r];
        kv[r] = qk_k(qk[r]) * s.nk[o + R0 + r];
        dq[r] = dkr[r] = 0.0f;
    }
    /* key i outer (its k and G in two registers), this warp's rows r >= i inner */
#pragma unroll
    for (int i = 0; i < R0 + RPW; i++) {
        const float ki =
            i >= R0 ? kv[i - R0] : __bfloat162float(s.op[2][o + i][lane]) * s.nk[o + i];
        const float Gi = i >= R0 ? gv[i - R0] : s.G[o + i][lane];
        float dkc = 0.0f;
#pragma unroll
        for (int r = (i > R0 ? i - R0 : 0); r < RPW; r++) {
            const float aqv = __bfloat162float(s.dA[o + R0 + r][o + i]);
            const float apv = i < R0 + r ? __bfloat162float(s.dPb[o + R0 + r][o + i]) : 0.0f;
            const float e = fexp(gv[r] - Gi);
            dq[r] += aqv * ki * e;
            dkr[r] += apv * ki * e;
            dkc += (aqv * qv[r] + apv * kv[r]) * e;
        }
        if (i < R0) {
            s.xs[o / 16][0][i][lane] = dkc;
            s.xs[o / 16][1][i][lane] = -ki * dkc;
        } else {
            s.out[1][o + i][lane] += dkc;
            s.out[2][o + i][lane] -= ki * dkc;
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        s.out[0][o + R0 + r][lane] += dq[r];
        s.out[1][o + R0 + r][lane] += dkr[r];
        s.out[2][o + R0 + r][lane] += qv[r] * dq[r] + kv[r] * dkr[r];
    }
}

__global__ void __launch_bounds__(NTP, 2) kda_bwd_pairs(BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    PairSmem &s = *reinterpret_cast<PairSmem *>(smem_raw);
    const int ci = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * CW;
    const int2 chk = p.chunks[ci];
    const int t0 = chk.x, L = chk.y;
    const int K = p.K, HV = p.HV, H = p.H;
    const int h = p.grp == 1 ? hv : hv / p.grp; /* no integer division without GVA */
    const int64_t cb = (int64_t)ci * HV + hv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    if (blockIdx.z == 0 && tid < L && p.dbeta) { /* beta (sigmoid) backward */
        float db = p.dbp[cb * BT + tid];
        if (p.sig) { /* b sigmoid(-x), not b (1 - b): that cancels as beta saturates */
            const float b = p.bs[cb * BT + tid];
            db *= b * sigmoidf_(-__bfloat162float(p.beta[(int64_t)(t0 + tid) * HV + hv]));
        }
        p.dbeta[(int64_t)(t0 + tid) * HV + hv] = __float2bfloat16(db);
    }
    if (c0 >= K)
        return;
    const int d = c0 + lane; /* this lane's channel in the lane = channel phases */
    const bool dok = d < K;
    const int rb = warp * RPW; /* this warp's rows in the lane = channel phases */
    const int ab = warp >> 1;  /* their 16-row block */
    /* 1. loads. Everything this warp reads from global memory is issued here, before
     * the first shared-memory store, in two waves, so that the kernel pays about two
     * load latencies instead of one per phase. Wave 1: the raw gate, q, k (raw), dA / dP,
     * row factors. Rows past L or channels past K load element 0 (branch-free, so that
     * the compiler keeps every load in flight together) and are zeroed on conversion */
    const int nrow = dok ? min(max(L - rb, 0), RPW) : 0; /* valid rows of this lane */
    /* this lane's element of row rb + m: base + m * stride (rows past nrow read row rb,
     * or element 0 when no row is valid) */
    const int64_t offH = nrow ? ((int64_t)(t0 + rb) * H + h) * K + d : 0;
    const int64_t offHV = nrow ? ((int64_t)(t0 + rb) * HV + hv) * K + d : 0;
    const int strH = H * K, strHV = HV * K;
    float gv[RPW];
    uint32_t qk[RPW]; /* raw q, k (qk_q, qk_k); zero past the valid rows */
    unsigned short gr[RPW]; /* raw gate (bf16 bits), converted where used */
    /* the gate parameters of this lane's channel (GDN: of the head) */
    const float ga = p.A_log ? fexp(p.A_log[hv]) : 1.0f;
    const float bias = p.dt_bias ? (p.gdn ? p.dt_bias[hv] : (dok ? p.dt_bias[hv * K + d] : 0.0f)) : 0.0f;
    {
        unsigned short qr[RPW], kr[RPW];
        const unsigned short *q16 = reinterpret_cast<const unsigned short *>(p.q) + offH;
        const unsigned short *k16 = reinterpret_cast<const unsigned short *>(p.k) + offH;
        /* the raw gate: per channel (KDA) or per token (GDN, the same for every channel) */
        const int64_t offG = p.gdn ? (nrow ? (int64_t)(t0 + rb) * HV + hv : 0) : offHV;
        const int strG = p.gdn ? HV : strHV;
        const unsigned short *g16 = reinterpret_cast<const unsigned short *>(p.g) + offG;
#pragma unroll
        for (int m = 0; m < RPW; m++) {
            const int o = (m < nrow ? m : 0) * strH;
            qr[m] = __ldg(q16 + o);
            kr[m] = __ldg(k16 + o);
            gr[m] = __ldg(g16 + (m < nrow ? m : 0) * strG);
        }
        const bf16 *dA = p.dAqk + cb * BT * BT, *dP = p.dP + cb * BT * BT;
        for (int e = tid; e < BT * BT / 8; e += NTP) {
            const int i = e >> 3, j = (e & 7) * 8;
            cp_async16(&s.dA[i][j], dA + i * BT + j);
            cp_async16(&s.dPb[i][j], dP + i * BT + j);
        }
        cp_async_commit();
        float nqv = 0.0f, nkv = 0.0f;
        if (tid < BT) {
            nqv = p.nqs[cb * BT + tid];
            nkv = p.nks[cb * BT + tid];
        }
        /* G of this lane's channel recomputed from the raw gate as the forward's intra
         * kernel does (log2 units, cumulative over rows, zero past L): the warp's rows
         * here, the earlier warps' totals added after the barrier below */
        gate_cumsum_rows<RPW>(p.gate, gr, nrow, bias, ga, p.lb, gv);
        s.red[warp][lane] = gv[RPW - 1];
        if (tid < BT) {
            s.nq[tid] = nqv;
            s.nk[tid] = nkv;
        }
#pragma unroll
        for (int m = 0; m < RPW; m++) {
            qk[m] = m < nrow ? ((uint32_t)qr[m] << 16) | kr[m] : 0u;
        }
    }
    /* wave 2, used only by the assembly and the gate backward (after the products):
     * dQg, dKd, dKg, dgamma and gl of this lane's channel */
    float xq_[RPW], xd_[RPW], xg_[RPW];
    float gam_l = 0.0f;
    {
        /* this lane's element of row rb: the rows at constant offsets m KD from it */
        const int64_t o2 = cb * BT * KD + c0 + rb * KD + lane;
        const part_t *dQg = p.dQg + o2, *dKd = p.dKd + o2, *dKg = p.dKg + o2;
#pragma unroll
        for (int m = 0; m < RPW; m++) {
            xq_[m] = ld_part(dQg + m * KD);
            xd_[m] = ld_part(dKd + m * KD);
            xg_[m] = ld_part(dKg + m * KD);
        }
        if (warp == PW - 1 && dok)
            gam_l = p.dgam[cb * KD + d] * p.gl[cb * KD + d];
    }
    cp_async_wait<0>();
    __syncthreads();
    {
        float off = 0.0f; /* G at the row before this warp's rows */
        for (int b = 0; b < warp; b++)
            off += s.red[b][lane];
#pragma unroll
        for (int m = 0; m < RPW; m++) {
            gv[m] = (gv[m] + off) * LN2_F; /* natural log units from here on */
            s.G[rb + m][lane] = gv[m];
        }
        if (warp & 1)
            s.rr[ab + 1][lane] = gv[RPW - 1]; /* rr[b] = G of row 16 b - 1, rr[0] = 0 */
        if (warp == 0)
            s.rr[0][lane] = 0.0f;
    }
    __syncthreads();
    /* 2. operands (lane = channel, warp = rows). The bounded gate: references at the
     * middle rows of the 32-row halves, rh = G_15 (rows 0..31) or G_47 (rows 32..63):
     * Q = q e^(G - rh), K = k e^(G - rh), Z0 = k e^(G_15 - G) (rows 0..31 only),
     * Z1 = k e^(G_47 - G); every factor <= e^(16 |lower_bound|) <= e^80, Z1 <= 1 on rows
     * 0..31. Other gates: slot 2 holds the raw k for the per-pair diagonal */
    {
        const float rh = s.rr[ab < 2 ? 1 : 3][lane], r47 = s.rr[3][lane];
        const float ra = s.rr[ab][lane], rn = s.rr[ab + 1][lane];
#pragma unroll
        for (int m = 0; m < RPW; m++) {
            const int r = rb + m;
            const float qv = qk_q(qk[m]) * s.nq[r];
            const float kv = qk_k(qk[m]) * s.nk[r];
            const float G = gv[m];
            if (p.shared_diag) {
                const float eg = fexp(G - rh);
                s.op[0][r][lane] = __float2bfloat16(qv * eg);
                s.op[1][r][lane] = __float2bfloat16(kv * eg);
                if (ab < 2)
                    s.op[2][r][lane] = __float2bfloat16(kv * fexp(rh - G));
                s.op[3][r][lane] = __float2bfloat16(kv * fexp(r47 - G));
            } else {
                const float eg = fexp(G - ra);
                s.op[0][r][lane] = __float2bfloat16(qv * eg);
                s.op[1][r][lane] = __float2bfloat16(kv * eg);
                s.op[2][r][lane] = __ushort_as_bfloat16((unsigned short)(qk[m] & 0xffffu));
                s.op[3][r][lane] = __float2bfloat16(kv * fexp(rn - G));
            }
        }
    }
    __syncthreads();
    /* 3. row and column sides of block a = warp / 2, channels cx .. cx + 15 */
    {
        const int a = warp >> 1, cx = (warp & 1) * 16;
        float aq[2][4], ak[2][4], ac[2][4], ad[2][4];
        zero_acc<2>(aq);
        zero_acc<2>(ak);
        zero_acc<2>(ac);
        zero_acc<2>(ad);
        /* row side: key block b against operand slot zs into aq (dA) and ak (dP); column
         * side: row block a2 of Q (dA^T) and K (dP^T) into acc */
        auto row_block = [&](int b, int zs) {
            wmma<1, false, false>(aq, &s.dA[0][0], AS, a * 16, b * 16, &s.op[zs][0][0], CWS, cx,
                                  b * 16, 1, lane);
            wmma<1, false, false>(ak, &s.dPb[0][0], AS, a * 16, b * 16, &s.op[zs][0][0], CWS, cx,
                                  b * 16, 1, lane);
        };
        auto col_block = [&](float(&acc)[2][4], int a2) {
            wmma<1, true, false>(acc, &s.dA[0][0], AS, a * 16, a2 * 16, &s.op[0][0][0], CWS, cx,
                                 a2 * 16, 1, lane);
            wmma<1, true, false>(acc, &s.dPb[0][0], AS, a * 16, a2 * 16, &s.op[1][0][0], CWS, cx,
                                 a2 * 16, 1, lane);
        };
        auto opf = [&](int slot, int r, int x) { return __bfloat162float(s.op[slot][r][x]); };
        if (p.shared_diag) {
            /* bounded gate, by halves: the row side of block a against key blocks 0..a with
             * the key operand of its half's reference (Z0 or Z1), no Horner steps; the column
             * side from the row blocks of its own half (reference rh, into ac) and, for a
             * block of the first half, from the second half's (reference G_47, into ad) */
            const int zs = a < 2 ? 2 : 3, hend = a < 2 ? 2 : 4;
            for (int b = 0; b <= a; b++)
                row_block(b, zs);
            for (int a2 = a; a2 < hend; a2++)
                col_block(ac, a2);
            for (int a2 = hend; a2 < 4; a2++)
                col_block(ad, a2);
            const int ih = a < 2 ? 1 : 3;
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = a * 16 + g + (e >> 1) * 8, x = cx + nt * 8 + 2 * t + (e & 1);
                    const float G = s.G[r][x], rx = s.rr[ih][x];
                    const float fr = fexp(G - rx);
                    float vc = ac[nt][e] * fexp(rx - G);
                    float gp = opf(0, r, x) * aq[nt][e] + opf(1, r, x) * ak[nt][e] -
                               opf(zs, r, x) * ac[nt][e];
                    if (a < 2) {
                        vc += ad[nt][e] * fexp(s.rr[3][x] - G);
                        gp -= opf(3, r, x) * ad[nt][e];
                    }
                    s.out[0][r][x] = aq[nt][e] * fr;
                    s.out[1][r][x] = ak[nt][e] * fr + vc;
                    s.out[2][r][x] = gp;
                }
        } else {
            for (int b = 0; b < a; b++) {
                if (b > 0) {
                    horner_step<2>(aq, s.rr[b + 1] + cx, s.rr[b] + cx, t);
                    horner_step<2>(ak, s.rr[b + 1] + cx, s.rr[b] + cx, t);
                }
                row_block(b, 3);
            }
            for (int a2 = 3; a2 > a; a2--) {
                if (a2 < 3)
                    horner_step<2>(ac, s.rr[a2 + 1] + cx, s.rr[a2] + cx, t);
                col_block(ac, a2);
            }
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = a * 16 + g + (e >> 1) * 8, x = cx + nt * 8 + 2 * t + (e & 1);
                    const float G = s.G[r][x];
                    const float fr = fexp(G - s.rr[a][x]);
                    s.out[0][r][x] = aq[nt][e] * fr;
                    s.out[1][r][x] = ak[nt][e] * fr + ac[nt][e] * fexp(s.rr[a + 1][x] - G);
                    s.out[2][r][x] = opf(0, r, x) * aq[nt][e] + opf(1, r, x) * ak[nt][e] -
                                     opf(3, r, x) * ac[nt][e];
                }
        }
    }
    __syncthreads();
    if (!p.shared_diag) { /* diagonal block per pair in fp32 (lane = channel) */
        if (warp & 1)
            pair_diag<RPW>(s, ab * 16, lane, qk, gv);
        else
            pair_diag<0>(s, ab * 16, lane, qk, gv);
        __syncthreads();
        if (!(warp & 1)) {
#pragma unroll
            for (int m = 0; m < RPW; m++) {
                s.out[1][rb + m][lane] += s.xs[ab][0][m][lane];
                s.out[2][rb + m][lane] += s.xs[ab][1][m][lane];
            }
        }
        __syncthreads();
    }
    /* 4. assembly (lane = channel, this warp's rows):
     * dq = dq_pair + dQg e^G;  dk = dk_pair + dKg e^G + dKd e^(Gl - G);
     * dG = dG_pair + dQg Qg + dKg Kg - dKd Kd; dGl += sum dKd Kd */
    {
        const float Gl = s.G[BT - 1][lane];
        float gsum = 0.0f;
        part_t *pdq = p.dqs + offHV, *pdk = p.dks + offHV; /* row rb + m, advanced per row */
#pragma unroll
        for (int m = 0; m < RPW; m++) {
            const int r = rb + m;
            const float qv = qk_q(qk[m]) * s.nq[r], kv = qk_k(qk[m]) * s.nk[r];
            const float G = gv[m], eg = fexp(G), ed = fexp(Gl - G);
            const float xq = xq_[m], xd = xd_[m], xg = xg_[m];
            const float pq = s.out[0][r][lane], pk = s.out[1][r][lane], pg = s.out[2][r][lane];
            const float dq = pq + xq * eg;
            const float dk = pk + xg * eg + xd * ed;
            const float kdd = xd * kv * ed;
            s.out[0][r][lane] = pg + xq * qv * eg + xg * kv * eg - kdd;
            gsum += kdd;
            if (m < nrow) {
                st_part(pdq, dq);
                st_part(pdk, dk);
            }
            pdq += strHV;
            pdk += strHV;
        }
        s.red[warp][lane] = gsum;
    }
    __syncthreads();
    if (warp == PW - 1) {
        float x = 0.0f;
#pragma unroll
        for (int b = 0; b < PW; b++)
            x += s.red[b][lane];
        s.out[0][BT - 1][lane] += dok ? x + gam_l : 0.0f;
    }
    __syncthreads();
    /* 5. reverse cumulative sum over rows: within this warp's rows, then the later warps'
     * totals */
    {
        float acc = 0.0f;
#pragma unroll
        for (int m = RPW - 1; m >= 0; m--) {
            acc += s.out[0][rb + m][lane];
            s.out[0][rb + m][lane] = acc;
        }
        s.red[warp][lane] = acc;
    }
    __syncthreads();
    float base = 0.0f;
    for (int w2 = warp + 1; w2 < PW; w2++)
        base += s.red[w2][lane];
    __syncthreads(); /* red is reused below */
    /* 6. gate backward (KDA), or the per-row channel sum (GDN) */
    float dAl = 0.0f;
    if (!p.gdn) {
        float dbias = 0.0f, dgv[RPW], dz[RPW];
#pragma unroll
        for (int m = 0; m < RPW; m++)
            dgv[m] = s.out[0][rb + m][lane] + base;
        if (p.gate == LM_GATE_BOUNDED)
            gate_bwd_rows<LM_GATE_BOUNDED, RPW>(p.lb, gr, dgv, nrow, bias, ga, dz, dAl);
        else if (p.gate == LM_GATE_SOFTPLUS)
            gate_bwd_rows<LM_GATE_SOFTPLUS, RPW>(p.lb, gr, dgv, nrow, bias, ga, dz, dAl);
        else
            gate_bwd_rows<LM_GATE_NONE, RPW>(p.lb, gr, dgv, nrow, bias, ga, dz, dAl);
#pragma unroll
        for (int m = 0; m < RPW; m++)
            dbias += dz[m];
        if (p.dg) {
            bf16 *pdg = p.dg + offHV; /* row rb + m, advanced per row */
#pragma unroll
            for (int m = 0; m < RPW; m++) {
                if (m < nrow)
                    *pdg = __float2bfloat16(dz[m]);
                pdg += strHV;
            }
        }
        s.red[warp][lane] = dbias; /* the previous reads of red are before the barrier above */
        __syncthreads();
        if (warp == 0 && p.ddt_bias && dok) { /* this chunk's part, summed by kda_bwd_sum */
            float x = 0.0f;
#pragma unroll
            for (int b = 0; b < PW; b++)
                x += s.red[b][lane];
            p.pdb[(int64_t)ci * HV * K + hv * K + d] = x;
        }
        if (p.dA_log) {
#pragma unroll
            for (int o = 16; o; o >>= 1)
                dAl += __shfl_xor_sync(0xffffffffu, dAl, o);
            if (lane == 0)
                s.redw[warp] = dAl;
            __syncthreads();
            if (tid == 0) { /* this CTA's part, row ci * nzs + slice of pda */
                float x = 0.0f;
#pragma unroll
                for (int b = 0; b < PW; b++)
                    x += s.redw[b];
                p.pda[((int64_t)ci * p.nzs + blockIdx.z) * HV + hv] = x;
            }
        }
    } else { /* this slice's part of each token's dg, [slice][B*T][HV] */
        float *dgs = p.dgs + (int64_t)blockIdx.z * p.dgs_stride;
        for (int r = rb; r < rb + RPW; r++) {
            float x = dok ? s.out[0][r][lane] + base : 0.0f;
#pragma unroll
            for (int o = 16; o; o >>= 1)
                x += __shfl_xor_sync(0xffffffffu, x, o);
            if (lane == 0 && r < L)
                dgs[(int64_t)(t0 + r) * HV + hv] = x;
        }
    }
}
/* ------------------------------------------- b5: GDN gate backward (per token, head) */
/* Thread (x, y) of a (32, 8) CTA takes head 32 blockIdx.y + x and the rows y, y + 8, ... of
 * the GSEG-row segment blockIdx.x: a token's dg is the sum of the pair kernel's slices in
 * slice order; the segment's sums of d(loss)/d(dt_bias) and d(loss)/d(A_log) go, summed
 * over y in order, to gpart[segment][0][HV] and [1][HV] (kda_bwd_sum adds the segments). */
#define GSEG 256
__global__ void __launch_bounds__(256) kda_bwd_gdn_gate(BwdParams p, int64_t rows, float *gpart) {
    __shared__ float red[2][8][32];
    const int x = threadIdx.x, y = threadIdx.y, HV = p.HV;
    const int hv = blockIdx.y * 32 + x;
    const int64_t r0 = (int64_t)blockIdx.x * GSEG;
    const int64_t r1 = r0 + GSEG < rows ? r0 + GSEG : rows;
    float sdz = 0.0f, sdA = 0.0f;
    if (hv < HV) {
        const float ga = p.A_log ? fexp(p.A_log[hv]) : 1.0f;
        const float bias = p.dt_bias ? p.dt_bias[hv] : 0.0f;
        for (int64_t r = r0 + y; r < r1; r += 8) {
            const int64_t e = r * HV + hv;
            float dg = p.dgs[e];
            for (int z = 1; z < p.nzs; z++)
                dg += p.dgs[z * p.dgs_stride + e];
            float dA1 = 0.0f;
            const float dz = gate_bwd(p, __bfloat162float(p.g[e]), bias, ga, dg, dA1);
            if (p.dg)
                p.dg[e] = __float2bfloat16(dz);
            sdz += dz;
            sdA += dA1;
        }
    }
    red[0][y][x] = sdz;
    red[1][y][x] = sdA;
    __syncthreads();
    if (y == 0 && hv < HV && gpart) {
        float a = red[0][0][x], b = red[1][0][x];
#pragma unroll
        for (int k = 1; k < 8; k++) {
            a += red[0][k][x];
            b += red[1][k][x];
        }
        gpart[(int64_t)blockIdx.x * 2 * HV + hv] = a;
        gpart[(int64_t)blockIdx.x * 2 * HV + HV + hv] = b;
    }
}

/* ------------------------------------------- fixed-order column sums (dA_log, ddt_bias) */
/* out[c] = sum over rows r of in[r][c] (in [nrows][ncols] fp32) in an order fixed by the
 * shape alone: CTA (blockIdx.x, blockIdx.y) of (32, 8) threads takes the SUM_ROWS-row
 * segment blockIdx.x of columns 32 blockIdx.y .. + 31, thread (x, y) its rows y, y + 8, ...
 * in order, then the 8 partials in order. A job with more than one segment writes the
 * segment sums to tmp [segments][ncols] (the next pass sums them); the last pass writes
 * columns c < split to out0[c] and the others to out1[c - split] (either may be NULL). */
#define SUM_ROWS 256
struct SumJob {
    const float *in;
    float *tmp;
    float *out0, *out1;
    int64_t nrows;
    int ncols, split;
};
struct SumPass {
    SumJob j[2]; /* blockIdx.z */
};
__global__ void __launch_bounds__(256) kda_bwd_sum(SumPass sp) {
    __shared__ float red[8][32];
    /* the job's fields one by one (indexing the parameter array would copy it to the stack) */
    const bool z = blockIdx.z != 0;
    const int64_t nrows = z ? sp.j[1].nrows : sp.j[0].nrows;
    const int ncols = z ? sp.j[1].ncols : sp.j[0].ncols;
    const int x = threadIdx.x, y = threadIdx.y;
    const int64_t r0 = (int64_t)blockIdx.x * SUM_ROWS;
    if (r0 >= nrows || (int)blockIdx.y * 32 >= ncols) /* the CTA is past this job */
        return;
    const int64_t r1 = r0 + SUM_ROWS < nrows ? r0 + SUM_ROWS : nrows;
    const int c = blockIdx.y * 32 + x;
    float acc = 0.0f;
    if (c < ncols) {
        const float *in = (z ? sp.j[1].in : sp.j[0].in) + c;
#pragma unroll 4
        for (int64_t r = r0 + y; r < r1; r += 8)
            acc += in[r * ncols];
    }
    red[y][x] = acc;
    __syncthreads();
    if (y != 0 || c >= ncols)
        return;
    float s = red[0][x];
#pragma unroll
    for (int k = 1; k < 8; k++)
        s += red[k][x];
    float *const tmp = z ? sp.j[1].tmp : sp.j[0].tmp;
    const int split = z ? sp.j[1].split : sp.j[0].split;
    float *const out0 = z ? sp.j[1].out0 : sp.j[0].out0;
    float *const out1 = z ? sp.j[1].out1 : sp.j[0].out1;
    if (tmp)
        tmp[(int64_t)blockIdx.x * ncols + c] = s;
    else if (c < split) {
        if (out0)
            out0[c] = s;
    } else if (out1)
        out1[c - split] = s;
}

/* ------------------------ b6: dq, dk: GVA sum, l2norm and scale backward (warp per row) */
/* y = x r with r = (|x|^2 + 1e-6)^-1/2 (l2norm), then q_hat = scale y: dx = r (dy - y (y . dy)).
 * Lane l holds channels 4l .. 4l + 3 (K a multiple of 4) or l + 32 i (otherwise); each warp
 * takes QK_ROWS rows and issues every load of them before the first use. */
#define QK_ROWS 2
__device__ __forceinline__ void l2_bwd_row(const BwdParams &p, float (&xq)[4], float (&xk)[4],
                                           float (&dq)[4], float (&dk)[4]) {
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dq[i] *= p.scale;
        sq += xq[i] * xq[i];
        sk += xk[i] * xk[i];
    }
    if (!p.l2)
        return;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float rq = rsqrtf(sq + 1e-6f), rk = rsqrtf(sk + 1e-6f);
    float dotq = 0.0f, dotk = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dotq += xq[i] * rq * dq[i];
        dotk += xk[i] * rk * dk[i];
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        dotq += __shfl_xor_sync(0xffffffffu, dotq, o);
        dotk += __shfl_xor_sync(0xffffffffu, dotk, o);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dq[i] = rq * (dq[i] - xq[i] * rq * dotq);
        dk[i] = rk * (dk[i] - xk[i] * rk * dotk);
    }
}

__global__ void kda_bwd_qk(BwdParams p, int64_t rows) {
    const int lane = threadIdx.x & 31;
    const int64_t nw = rows * p.H;
    const int K = p.K;
    const int64_t w0 = ((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5) * QK_ROWS;
    if ((K & 3) == 0) { /* 4 consecutive channels per lane, 8- and 16-byte loads */
        const int d0 = 4 * lane;
        float xq[QK_ROWS][4], xk[QK_ROWS][4], dq[QK_ROWS][4], dk[QK_ROWS][4];
        bool ok[QK_ROWS];
#pragma unroll
        for (int rr = 0; rr < QK_ROWS; rr++) {
            const int64_t wi = w0 + rr;
            ok[rr] = wi < nw && d0 < K;
            const int64_t tr = wi / p.H;
            const int hh = (int)(wi % p.H);
            const int64_t oq = ok[rr] ? wi * K + d0 : 0;
            const uint2 q2 = __ldg(reinterpret_cast<const uint2 *>(p.q + oq));
            const uint2 k2 = __ldg(reinterpret_cast<const uint2 *>(p.k + oq));
            const __nv_bfloat162 *hq = reinterpret_cast<const __nv_bfloat162 *>(&q2);
            const __nv_bfloat162 *hk = reinterpret_cast<const __nv_bfloat162 *>(&k2);
            xq[rr][0] = __low2float(hq[0]); xq[rr][1] = __high2float(hq[0]);
            xq[rr][2] = __low2float(hq[1]); xq[rr][3] = __high2float(hq[1]);
            xk[rr][0] = __low2float(hk[0]); xk[rr][1] = __high2float(hk[0]);
            xk[rr][2] = __low2float(hk[1]); xk[rr][3] = __high2float(hk[1]);
#pragma unroll
            for (int i = 0; i < 4; i++)
                dq[rr][i] = dk[rr][i] = 0.0f;
            for (int x = 0; x < p.grp; x++) {
                const int64_t o = ok[rr] ? (tr * p.HV + hh * p.grp + x) * K + d0 : 0;
                const float4 a = ld_part4(p.dqs + o);
                const float4 b = ld_part4(p.dks + o);
                dq[rr][0] += a.x; dq[rr][1] += a.y; dq[rr][2] += a.z; dq[rr][3] += a.w;
                dk[rr][0] += b.x; dk[rr][1] += b.y; dk[rr][2] += b.z; dk[rr][3] += b.w;
            }
        }
#pragma unroll
        for (int rr = 0; rr < QK_ROWS; rr++) {
            if (!ok[rr]) /* zero rows: no contribution to the warp sums */
#pragma unroll
                for (int i = 0; i < 4; i++)
                    xq[rr][i] = xk[rr][i] = dq[rr][i] = dk[rr][i] = 0.0f;
            l2_bwd_row(p, xq[rr], xk[rr], dq[rr], dk[rr]);
            if (!ok[rr])
                continue;
            const int64_t o = (w0 + rr) * K + d0;
            if (p.dq)
                *reinterpret_cast<uint2 *>(p.dq + o) =
                    make_uint2(pack_bf16(dq[rr][0], dq[rr][1]), pack_bf16(dq[rr][2], dq[rr][3]));
            if (p.dk)
                *reinterpret_cast<uint2 *>(p.dk + o) =
                    make_uint2(pack_bf16(dk[rr][0], dk[rr][1]), pack_bf16(dk[rr][2], dk[rr][3]));
        }
        return;
    }
    for (int rr = 0; rr < QK_ROWS; rr++) { /* any K <= 128: channels lane + 32 i */
        const int64_t wi = w0 + rr;
        if (wi >= nw)
            return; /* whole warp: wi is uniform */
        const int64_t tr = wi / p.H;
        const int hh = (int)(wi % p.H);
        float xq[4], xk[4], dq[4], dk[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int d = lane + 32 * i;
            xq[i] = xk[i] = dq[i] = dk[i] = 0.0f;
            if (d < K) {
                xq[i] = __bfloat162float(p.q[wi * K + d]);
                xk[i] = __bfloat162float(p.k[wi * K + d]);
                for (int x = 0; x < p.grp; x++) {
                    const int64_t o = (tr * p.HV + hh * p.grp + x) * K + d;
                    dq[i] += ld_part(p.dqs + o);
                    dk[i] += ld_part(p.dks + o);
                }
            }
        }
        l2_bwd_row(p, xq, xk, dq, dk);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int d = lane + 32 * i;
            if (d < K) {
                if (p.dq)
                    p.dq[wi * K + d] = __float2bfloat16(dq[i]);
                if (p.dk)
                    p.dk[wi * K + d] = __float2bfloat16(dk[i]);
            }
        }
    }
}

/* bump allocator over one device buffer (256-byte aligned pieces) */
struct Carve {
    char *base;
    size_t off;
    template <class T> T *take(size_t count) {
        T *r = reinterpret_cast<T *>(base ? base + off : nullptr);
        off += (count * sizeof(T) + 255) & ~(size_t)255;
        return r;
    }
};

/* the training forward's buffers (sizes only when base is NULL) */
size_t carve_saved(char *base, size_t nblk, int nchunks, int N, KdaSaveBufs *sv) {
    Carve c{base, 0};
    sv->w = c.take<bf16>(nblk * BT * KD);
    sv->u = c.take<bf16>(nblk * BT * KD);
    sv->qg = c.take<bf16>(nblk * BT * KD);
    sv->kg = c.take<bf16>(nblk * BT * KD);
    sv->Aqk = c.take<bf16>(nblk * BT * BT);
    sv->gl = c.take<float>(nblk * KD);
    sv->Xs = c.take<float>(nblk * BT * BT);
    sv->Ps = c.take<bf16>(nblk * BT * BT);
    sv->nqs = c.take<float>(nblk * BT);
    sv->nks = c.take<float>(nblk * BT);
    sv->bs = c.take<float>(nblk * BT);
    sv->hs = c.take<bf16>(nblk * KD * KD);
    sv->vns = c.take<bf16>(nblk * BT * KD);
    sv->Kg = c.take<bf16>(nblk * BT * KD);
    int2 *ch = c.take<int2>((size_t)nchunks + N);
    sv->chunks = ch;
    sv->seqs = ch ? ch + nchunks : nullptr;
    sv->nchunks = nchunks;
    return c.off;
}

struct DevBuf {
    void *buf = nullptr;
    size_t cap = 0;
};

/* The training forward's and backward's per-context state (slot LM_SLOT_KDA_TRAIN; deleted
 * by lm_cuda_ctx_free after its stream is synchronised, with its device current) */
struct TrainState {
    DevBuf spare;   /* a freed training-forward buffer kept for the next one */
    DevBuf bws;     /* backward scratch, grow-only */
    DhMaps dh_maps; /* kda_bwd_dh's (TM) tensor maps and their key */
    MapKey dh_at = {};
    cudaEvent_t ev[7] = {}; /* kda.profile */
    bool ev_made = false;
    ~TrainState() {
        if (spare.buf)
            cudaFree(spare.buf);
        if (bws.buf)
            cudaFree(bws.buf);
        if (ev_made)
            for (cudaEvent_t e : ev)
                cudaEventDestroy(e);
    }
};

TrainState *train_state(lm_cuda_ctx *ctx) {
    return lm_cuda_ctx_get<TrainState>(ctx, LM_SLOT_KDA_TRAIN);
}

/* b grown to at least `bytes` (after a stream synchronisation: queued kernels may still use
 * the old buffer; counted as a context allocation) */
lm_status devbuf_reserve(lm_cuda_ctx *ctx, DevBuf &b, size_t bytes, lm_error *err,
                         const char *what) {
    if (bytes <= b.cap)
        return LM_OK;
    kda_cuda_buffers_changed(ctx);
    if (b.buf) {
        LM_CK(cudaStreamSynchronize(ctx->stream));
        cudaFree(b.buf);
    }
    b.buf = nullptr;
    b.cap = 0;
    cudaError_t e = cudaMalloc(&b.buf, bytes);
    if (e != cudaSuccess) {
        b.buf = nullptr;
        cudaGetLastError();
        return lm_errorf(err, LM_ERR_NOMEM, "kda cuda: cudaMalloc(%s, %zu bytes) on cuda:%d: %s",
                         what, bytes, ctx->device, cudaGetErrorString(e));
    }
    ctx->n_alloc++;
    b.cap = bytes;
    return lm_cuda_ctx_poison(ctx, LM_POISON_KDA, b.buf, bytes, err);
}

/* frees b (after a stream synchronisation) */
void devbuf_free(lm_cuda_ctx *ctx, DevBuf &b) {
    if (b.buf) {
        kda_cuda_buffers_changed(ctx);
        cudaStreamSynchronize(ctx->stream);
        cudaFree(b.buf);
    }
    b = DevBuf();
}

} // namespace

struct lm_kda_cuda_saved {
    lm_cuda_ctx *ctx; /* the context of the forward (its stream, its spare buffer) */
    lm_kda_config c;  /* cu_seqlens not kept (the chunk tables are) */
    lm_kda_cuda_inputs in;
    DevBuf mem;
    KdaSaveBufs sv; /* sv.nchunks; c.N is the number of sequences */
    bool borrowed;  /* mem is the caller's (lm_kda_cuda_forward_train_buf): never freed here */
};

extern "C" void lm_kda_cuda_saved_free(lm_cuda_ctx *ctx, lm_kda_cuda_saved *saved) {
    (void)ctx; /* the context of the forward is the one saved remembers */
    if (!saved)
        return;
    lm_cuda_ctx *cx = saved->ctx;
    if (!saved->borrowed && saved->mem.buf && lm_cuda_ctx_enter(cx, nullptr) == LM_OK) {
        TrainState *ts = train_state(cx);
        if (saved->mem.cap > ts->spare.cap) { /* keep the larger one for the next forward */
            devbuf_free(cx, ts->spare);
            ts->spare = saved->mem;
        } else {
            devbuf_free(cx, saved->mem);
        }
    }
    free(saved);
}

void kda_cuda_train_release(lm_cuda_ctx *ctx) {
    TrainState *ts = (TrainState *)lm_cuda_ctx_state(ctx, LM_SLOT_KDA_TRAIN);
    if (!ts)
        return;
    devbuf_free(ctx, ts->spare);
    devbuf_free(ctx, ts->bws);
    ts->dh_at = MapKey{};
}

/* Bytes of the saved buffer for nchunks chunks of N sequences over HV value heads
 * (carve_saved's sizes). */
static size_t saved_bytes_of(int64_t nchunks, int64_t N, int HV) {
    KdaSaveBufs sv;
    return carve_saved(nullptr, (size_t)nchunks * (size_t)HV, (int)nchunks, (int)N, &sv);
}

extern "C" size_t lm_kda_cuda_saved_bytes(const lm_kda_config *c) {
    if (!c || c->B < 1 || c->T < 1 || c->HV < 1)
        return 0;
    int64_t nseq = c->B, nchunks = 0;
    if (c->cu_seqlens) {
        const int64_t *cu = c->cu_seqlens;
        if (c->B != 1 || c->n_cu_seqlens < 2 || cu[0] != 0 || cu[c->n_cu_seqlens - 1] != c->T)
            return 0;
        nseq = c->n_cu_seqlens - 1;
        for (int i = 1; i < c->n_cu_seqlens; i++) {
            if (cu[i] < cu[i - 1])
                return 0;
            nchunks += (cu[i] - cu[i - 1] + BT - 1) / BT;
        }
    } else {
        nchunks = (int64_t)c->B * ((c->T + BT - 1) / BT);
    }
    if (nchunks > INT32_MAX || nseq > INT32_MAX)
        return 0;
    return saved_bytes_of(nchunks, nseq, c->HV);
}

/* A batch of L <= max_tokens tokens in S <= max_seqs sequences has
 *   nchunks = sum_n ceil(L_n / 64) <= floor(L / 64) + (sequences with L_n > 0)
 *           <= floor(max_tokens / 64) + min(max_seqs, max_tokens)
 * (sum_n floor(L_n / 64) <= floor(L / 64); ceil(x / 64) <= floor(x / 64) + 1 for x > 0, 0
 * for x = 0), and nchunks <= L; carve_saved's size grows with nchunks and N. */
extern "C" size_t lm_kda_cuda_saved_bytes_max(int64_t max_tokens, int max_seqs, int HV) {
    if (max_tokens < 1 || max_seqs < 1 || HV < 1)
        return 0;
    const int64_t s = max_seqs < max_tokens ? max_seqs : max_tokens;
    int64_t nchunks = max_tokens / BT + s;
    if (nchunks > max_tokens)
        nchunks = max_tokens;
    if (nchunks > INT32_MAX)
        return 0;
    return saved_bytes_of(nchunks, max_seqs, HV);
}

/* The training forward into *saved: the saved tensors in buf [cap bytes] of the caller
 * (borrowed) when buf is not NULL, else in a buffer of the op (the context's spare or a new
 * one). */
static lm_status forward_train_impl(lm_cuda_ctx *ctx, lm_kda_config *c,
                                    const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                    void *buf, size_t cap, lm_kda_cuda_saved **saved,
                                    lm_error *err) {
    if (!saved)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda: forward_train needs 'saved'");
    *saved = nullptr;
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda: outputs are required");
    LM_TRY(kda_cuda_check(c, in, out->o, err));
    TrainState *ts = train_state(ctx);
    const int N = c->N, nchunks = kda_cuda_nchunks(c);
    const size_t nblk = (size_t)nchunks * c->HV;
    KdaSaveBufs probe;
    const size_t bytes = carve_saved(nullptr, nblk, nchunks, N, &probe);
    if (buf && ((uintptr_t)buf % 256 != 0 || cap < bytes))
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda: forward_train_buf: the saved buffer (%zu bytes at %p) must be "
                         "256-byte aligned and hold %zu bytes for this batch (%d chunks, %d "
                         "sequences, HV = %d)",
                         cap, buf, bytes, nchunks, N, c->HV);
    lm_kda_cuda_saved *sv = (lm_kda_cuda_saved *)calloc(1, sizeof *sv);
    int2 *hch = (int2 *)malloc(sizeof(int2) * (size_t)(nchunks + N));
    if (!sv || !hch) {
        free(sv);
        free(hch);
        return lm_errorf(err, LM_ERR_NOMEM, "kda cuda: training forward bookkeeping");
    }
    sv->ctx = ctx;
    sv->sv = probe;
    if (buf) {
        sv->mem.buf = buf;
        sv->mem.cap = cap;
        sv->borrowed = true;
    } else if (ts->spare.buf && ts->spare.cap >= bytes) {
        sv->mem = ts->spare;
        ts->spare = DevBuf();
    } else {
        lm_status st = devbuf_reserve(ctx, sv->mem, bytes, err, "saved tensors");
        if (st != LM_OK) {
            free(sv);
            free(hch);
            return st;
        }
    }
    carve_saved((char *)sv->mem.buf, nblk, nchunks, N, &sv->sv);
    kda_cuda_chunk_tables(c, hch, hch + nchunks);
    /* the caller's buffer may be freed and its address reused without the op knowing, so
     * its tables are not cached (kda_cuda_upload_tables): copied on every call */
    const lm_status ut =
        buf ? lm_cuda_ctx_upload(ctx, (void *)sv->sv.chunks, hch,
                                 sizeof(int2) * (size_t)(nchunks + N), err)
            : kda_cuda_upload_tables(ctx, (int2 *)sv->sv.chunks, hch, (size_t)(nchunks + N),
                                     sv->mem.buf, sv->mem.cap, err);
    free(hch);
    if (ut != LM_OK) {
        lm_kda_cuda_saved_free(ctx, sv);
        return ut;
    }
    sv->c = *c;
    sv->c.cu_seqlens = nullptr;
    sv->in = *in;
    lm_status st = kda_cuda_forward_run(ctx, c, in, out, &sv->sv, err);
    if (st != LM_OK) {
        lm_kda_cuda_saved_free(ctx, sv);
        return st;
    }
    *saved = sv;
    return LM_OK;
}

extern "C" lm_status lm_kda_cuda_forward_train(lm_cuda_ctx *ctx, lm_kda_config *c,
                                               const lm_kda_cuda_inputs *in,
                                               lm_kda_cuda_outputs *out, lm_kda_cuda_saved **saved,
                                               lm_error *err) {
    return forward_train_impl(ctx, c, in, out, nullptr, 0, saved, err);
}

extern "C" lm_status lm_kda_cuda_forward_train_buf(lm_cuda_ctx *ctx, lm_kda_config *c,
                                                   const lm_kda_cuda_inputs *in,
                                                   lm_kda_cuda_outputs *out, void *buf, size_t cap,
                                                   lm_kda_cuda_saved **saved, lm_error *err) {
    if (!buf) {
        if (saved)
            *saved = nullptr;
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda: forward_train_buf needs a buffer");
    }
    return forward_train_impl(ctx, c, in, out, buf, cap, saved, err);
}

/* floats of the segment sums a kda_bwd_sum job of nrows rows of ncols columns keeps between
 * its passes (each pass divides the rows by SUM_ROWS) */
static size_t sum_tmp_floats(int64_t nrows, int ncols) {
    size_t n = 0;
    while (nrows > SUM_ROWS) {
        nrows = (nrows + SUM_ROWS - 1) / SUM_ROWS;
        n += (size_t)nrows * (size_t)ncols;
    }
    return n;
}

/* The jobs' fixed-order sums on stream s: one kda_bwd_sum launch per pass for every job
 * still running (jobs[j].tmp holds sum_tmp_floats of its shape; the pass structure is a
 * function of the shapes only). */
static lm_status run_sums(cudaStream_t s, const SumJob *jobs, int njobs, lm_error *err) {
    SumJob cur[2];
    for (int j = 0; j < njobs; j++)
        cur[j] = jobs[j];
    bool live[2] = {njobs > 0, njobs > 1};
    while (live[0] || live[1]) {
        SumPass sp;
        memset(&sp, 0, sizeof sp);
        int nz = 0, idx[2] = {0, 0};
        int64_t gx = 1;
        int gy = 1;
        for (int j = 0; j < njobs; j++) {
            if (!live[j])
                continue;
            SumJob jb = cur[j];
            const int64_t segs = (jb.nrows + SUM_ROWS - 1) / SUM_ROWS;
            if (segs <= 1)
                jb.tmp = nullptr; /* the last pass: into the outputs */
            sp.j[nz] = jb;
            idx[nz++] = j;
            gx = segs > gx ? segs : gx;
            gy = (jb.ncols + 31) / 32 > gy ? (jb.ncols + 31) / 32 : gy;
        }
        kda_bwd_sum<<<dim3((unsigned)gx, gy, nz), dim3(32, 8), 0, s>>>(sp);
        LM_CK_LAUNCH("kda_bwd_sum");
        for (int z = 0; z < nz; z++) {
            SumJob &jb = cur[idx[z]];
            if (!sp.j[z].tmp) {
                live[idx[z]] = false;
                continue;
            }
            const int64_t segs = (jb.nrows + SUM_ROWS - 1) / SUM_ROWS;
            jb.in = jb.tmp;
            jb.tmp += segs * jb.ncols;
            jb.nrows = segs;
        }
    }
    return LM_OK;
}

/* the tensor maps of kda_bwd_dh (TM) for the saved buffers at p, encoded again only when
 * their place or extent changes; false when the driver gives none */
static bool dh_maps(lm_cuda_ctx *ctx, const BwdParams &p, uint64_t rows, DhMaps &out) {
    TrainState *ts = train_state(ctx);
    const EncodeTiledFn fn = kda_cuda_encoder(ctx);
    DhMaps &maps = ts->dh_maps;
    return cached_maps(
        maps, ts->dh_at, MapKey{{p.w, p.qg, p.kd, p.Aqk, nullptr}, rows, 0},
        [&] {
            return rec_maps(fn, &maps.w, &maps.qg, &maps.kd, &maps.A, p.w, p.qg, p.kd, p.Aqk, rows);
        },
        out);
}
/* kda_bwd_dh<BV, WC, TM> on ctx's stream with its shared memory (the opt-in on the
 * context's first use of the kernel) */
template <int BV, int WC, bool TM>
static cudaError_t launch_dh_t(lm_cuda_ctx *ctx, dim3 grid, const BwdParams &p, const DhMaps &m) {
    return kda_cuda_launch_smem(ctx, kda_bwd_dh<BV, WC, TM>, grid,
                                NT2 * WC + (rec_prod<TM, WC>() ? 32 : 0),
                                TM ? dh_smem_t<BV>() : sizeof(DhSmem<BV>), p, m);
}
template <int BV, int WC>
static cudaError_t launch_dh(lm_cuda_ctx *ctx, dim3 grid, const BwdParams &p, bool tm,
                             const DhMaps &m) {
    return tm ? launch_dh_t<BV, WC, true>(ctx, grid, p, m)
              : launch_dh_t<BV, WC, false>(ctx, grid, p, m);
}

extern "C" lm_status lm_kda_cuda_backward(lm_cuda_ctx *ctx, lm_kda_cuda_saved *saved,
                                          const lm_kda_cuda_grads *gr, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!saved || !gr || !gr->do_)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda backward: 'saved' and 'do' are required");
    if (saved->ctx != ctx)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda backward: 'saved' belongs to another context (its forward ran "
                         "on cuda:%d, this call's context is on cuda:%d)",
                         saved->ctx ? saved->ctx->device : -1, ctx->device);
    TrainState *ts = train_state(ctx);
    const lm_kda_config &c = saved->c;
    const int nchunks = saved->sv.nchunks, N = c.N, HV = c.HV, H = c.H, K = c.K, V = c.V;
    const size_t nblk = (size_t)nchunks * HV;
    const int grp = HV / H;
    const int64_t rows = (int64_t)c.B * c.T;
    BwdParams p;
    memset(&p, 0, sizeof p);
    p.N = N;
    p.nchunks = nchunks;
    p.T = c.T;
    p.H = H;
    p.HV = HV;
    p.K = K;
    p.V = V;
    p.gdn = c.kind == LM_GDN;
    p.gate = (int)c.gate;
    p.l2 = c.use_qk_l2norm_in_kernel;
    p.sig = c.use_beta_sigmoid_in_kernel;
    p.shared_diag = c.gate == LM_GATE_BOUNDED && c.diag != LM_DIAG_SAFE;
    p.grp = grp;
    p.lb = c.lower_bound;
    p.scale = c.scale;
    const KdaSaveBufs &sv = saved->sv;
    p.chunks = sv.chunks;
    p.seqs = sv.seqs;
    p.q = (const bf16 *)saved->in.q;
    p.k = (const bf16 *)saved->in.k;
    p.v = (const bf16 *)saved->in.v;
    p.g = (const bf16 *)saved->in.g;
    p.beta = (const bf16 *)saved->in.beta;
    p.A_log = saved->in.A_log;
    p.dt_bias = saved->in.dt_bias;
    p.w = sv.w;
    p.qg = sv.qg;
    p.kd = sv.kg;
    p.Aqk = sv.Aqk;
    p.gl = sv.gl;
    p.Xs = sv.Xs;
    p.Ps = sv.Ps;
    p.nqs = sv.nqs;
    p.nks = sv.nks;
    p.bs = sv.bs;
    p.hs = sv.hs;
    p.vns = sv.vns;
    p.Kgs = sv.Kg;
    p.do_ = (const bf16 *)gr->do_;
    /* 16-byte rows of dO (V % 8 == 0, 16-byte aligned): read in place by the dh and state
     * kernels; otherwise the gather kernel copies it into the padded layout */
    p.do_direct = (V & 7) == 0 && ((uintptr_t)gr->do_ & 15) == 0;
    p.dht = gr->dht;
    p.dq = (bf16 *)gr->dq;
    p.dk = (bf16 *)gr->dk;
    p.dv = (bf16 *)gr->dv;
    p.dg = (bf16 *)gr->dg;
    p.dbeta = (bf16 *)gr->dbeta;
    p.dh0 = gr->dh0;
    p.dA_log = saved->in.A_log ? gr->dA_log : nullptr;
    p.ddt_bias = saved->in.dt_bias ? gr->ddt_bias : nullptr;

    p.nzs = (K + CW - 1) / CW;
    p.dgs_stride = rows * HV;
    /* the fixed-order sums of dA_log and ddt_bias (kda_bwd_sum): KDA sums the pair kernel's
     * parts over the chunks (ddt_bias) and the chunks' slices (dA_log); GDN the gate
     * kernel's segment sums, ddt_bias and dA_log side by side */
    const int64_t gsegs = (rows + GSEG - 1) / GSEG;
    SumJob jobs[2];
    memset(jobs, 0, sizeof jobs);
    int njobs = 0, jgate = -1, jdb = -1, jda = -1; /* the jobs' indices (-1: none) */
    if (p.gdn) {
        if (p.dA_log || p.ddt_bias)
            jobs[jgate = njobs++] =
                SumJob{nullptr, nullptr, p.ddt_bias, p.dA_log, gsegs, 2 * HV, HV};
    } else {
        if (p.ddt_bias)
            jobs[jdb = njobs++] =
                SumJob{nullptr, nullptr, p.ddt_bias, nullptr, (int64_t)nchunks, HV * K, HV * K};
        if (p.dA_log)
            jobs[jda = njobs++] =
                SumJob{nullptr, nullptr, p.dA_log, nullptr, (int64_t)nchunks * p.nzs, HV, HV};
    }
    float *gpart = nullptr;

    /* scratch */
    size_t bytes = 0;
    for (int pass = 0; pass < 2; pass++) {
        Carve cv{pass ? (char *)ts->bws.buf : nullptr, 0};
        p.dO = p.do_direct ? nullptr : cv.take<bf16>(nblk * BT * KD); /* the padded copy */
        p.dh = cv.take<bf16>(nblk * KD * KD);
        p.dvn = cv.take<bf16>(nblk * BT * KD);
        p.dW = cv.take<bf16>(nblk * BT * KD);
        p.dAqk = cv.take<bf16>(nblk * BT * BT);
        p.dQg = cv.take<part_t>(nblk * BT * KD);
        p.dKd = cv.take<part_t>(nblk * BT * KD);
        p.dgam = cv.take<float>(nblk * KD);
        p.dKg = cv.take<part_t>(nblk * BT * KD);
        p.dP = cv.take<bf16>(nblk * BT * BT);
        p.dbp = cv.take<float>(nblk * BT);
        p.dqs = cv.take<part_t>((size_t)rows * HV * K);
        p.dks = cv.take<part_t>((size_t)rows * HV * K);
        p.dgs = p.gdn ? cv.take<float>((size_t)p.nzs * rows * HV) : nullptr;
        p.pdb = !p.gdn && p.ddt_bias ? cv.take<float>(nblk * K) : nullptr;
        p.pda = !p.gdn && p.dA_log ? cv.take<float>(nblk * p.nzs) : nullptr;
        gpart =
            p.gdn && (p.dA_log || p.ddt_bias) ? cv.take<float>((size_t)gsegs * 2 * HV) : nullptr;
        for (int j = 0; j < njobs; j++)
            jobs[j].tmp = cv.take<float>(sum_tmp_floats(jobs[j].nrows, jobs[j].ncols));
        if (!pass) {
            bytes = cv.off;
            LM_TRY(devbuf_reserve(ctx, ts->bws, bytes, err, "backward scratch"));
        }
    }
    if (jgate >= 0)
        jobs[jgate].in = gpart;
    if (jdb >= 0)
        jobs[jdb].in = p.pdb;
    if (jda >= 0)
        jobs[jda].in = p.pda;
    cudaStream_t s = ctx->stream;
    /* dA_log, ddt_bias are written by kda_bwd_sum; zeros without chunks (no sums run) */
    if (p.dA_log && nchunks == 0)
        LM_CK(cudaMemsetAsync(p.dA_log, 0, sizeof(float) * HV, s));
    if (p.ddt_bias && nchunks == 0)
        LM_CK(cudaMemsetAsync(p.ddt_bias, 0, sizeof(float) * HV * (p.gdn ? 1 : K), s));
    if (gr->dA_log && !saved->in.A_log)
        LM_CK(cudaMemsetAsync(gr->dA_log, 0, sizeof(float) * HV, s));
    if (gr->ddt_bias && !saved->in.dt_bias)
        LM_CK(cudaMemsetAsync(gr->ddt_bias, 0, sizeof(float) * HV * (p.gdn ? 1 : K), s));

    const int nsh = N * HV;
    const int BVsel = kda_cuda_bv(ctx, nsh);
    /* the dh recurrence's loads by the tensor copy engine (kda.tma = 0: cp.async) */
    DhMaps dmaps;
    memset(&dmaps, 0, sizeof dmaps);
    const bool tm =
        ctx->kda_tma && nchunks > 0 && dh_maps(ctx, p, (uint64_t)nchunks * HV * BT, dmaps);
    /* the shared-memory opt-ins on the context's first use of each kernel */
    if (lm_cuda_ctx_first_use(ctx, (const void *)kda_bwd_state))
        LM_CK(cudaFuncSetAttribute(kda_bwd_state, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(StateSmem)));
    if (lm_cuda_ctx_first_use(ctx, (const void *)kda_bwd_ut))
        LM_CK(cudaFuncSetAttribute(kda_bwd_ut, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(UtSmem)));
    if (lm_cuda_ctx_first_use(ctx, (const void *)kda_bwd_pairs))
        LM_CK(cudaFuncSetAttribute(kda_bwd_pairs, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(PairSmem)));
    /* kda.profile = 1: per-kernel times on stderr; the events are the context's, made once */
    const bool prof = ctx->kda_profile != 0;
    cudaEvent_t *ev = ts->ev;
    if (prof && !ts->ev_made) {
        for (int i = 0; i < 7; i++)
            LM_CK(cudaEventCreate(&ev[i]));
        ts->ev_made = true;
    }
    if (prof)
        LM_CK(cudaEventRecord(ev[0], s));
    const dim3 gb(nchunks, HV);
    if (!p.do_direct && nchunks > 0) {
        kda_bwd_gather_do<<<gb, NTB, 0, s>>>(p);
        LM_CK_LAUNCH("kda_bwd_gather_do");
    }
    if (prof)
        LM_CK(cudaEventRecord(ev[1], s));
    const dim3 g1(KD / BVsel, N * HV);
    if (BVsel == 64)
        LM_CK((launch_dh<64, 2>(ctx, g1, p, tm, dmaps)));
    else if (BVsel == 128) /* 8 warps of 16 x 64: 0.317 -> 0.305 ms against 16 of 16 x 32 */
        LM_CK((launch_dh<128, 2>(ctx, g1, p, tm, dmaps)));
    else if (BVsel == 32)
        LM_CK((launch_dh<32, 2>(ctx, g1, p, tm, dmaps)));
    else
        LM_CK((launch_dh<16, 1>(ctx, g1, p, tm, dmaps)));
    if (prof)
        LM_CK(cudaEventRecord(ev[2], s));
    if (nchunks > 0) {
        kda_bwd_state<<<gb, NTB, sizeof(StateSmem), s>>>(p);
        LM_CK_LAUNCH("kda_bwd_state");
        if (prof)
            LM_CK(cudaEventRecord(ev[3], s));
        kda_bwd_ut<<<gb, NTB, sizeof(UtSmem), s>>>(p);
        LM_CK_LAUNCH("kda_bwd_ut");
        if (prof)
            LM_CK(cudaEventRecord(ev[4], s));
        kda_bwd_pairs<<<dim3(nchunks, HV, KD / CW), NTP, sizeof(PairSmem), s>>>(p);
        LM_CK_LAUNCH("kda_bwd_pairs");
        if (prof)
            LM_CK(cudaEventRecord(ev[5], s));
        if (p.gdn && (p.dg || gpart)) {
            kda_bwd_gdn_gate<<<dim3((unsigned)gsegs, (HV + 31) / 32), dim3(32, 8), 0, s>>>(p, rows,
                                                                                           gpart);
            LM_CK_LAUNCH("kda_bwd_gdn_gate");
        }
        LM_TRY(run_sums(s, jobs, njobs, err));
        if (p.dq || p.dk) {
            const int64_t nwarps = (rows * H + QK_ROWS - 1) / QK_ROWS;
            kda_bwd_qk<<<(unsigned)((nwarps + 7) / 8), 256, 0, s>>>(p, rows);
            LM_CK_LAUNCH("kda_bwd_qk");
        }
    } else if (prof) {
        LM_CK(cudaEventRecord(ev[3], s));
        LM_CK(cudaEventRecord(ev[4], s));
        LM_CK(cudaEventRecord(ev[5], s));
    }
    /* asynchronous on ctx's stream (include/linmoe/kda_cuda.h); the profile waits for its
     * last event (a host synchronisation, only with kda.profile) */
    if (prof) {
        LM_CK(cudaEventRecord(ev[6], s));
        LM_CK(cudaEventSynchronize(ev[6]));
        const char *const names[6] = {"gather", "dh", "state", "ut", "pairs", "sums+qk"};
        fprintf(stderr, "kda cuda backward:");
        for (int i = 0; i < 6; i++) {
            float ms = 0;
            LM_CK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
            fprintf(stderr, " %s %.3f ms", names[i], ms);
        }
        fprintf(stderr, "\n");
    }
    return LM_OK;
}
