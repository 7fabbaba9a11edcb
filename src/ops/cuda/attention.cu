/* Causal GQA softmax attention on the GPU (include/linmoe/cuda_attention.h has the
 * contract): FlashAttention-2 forward and backward on mma.sync (D = 64, 128), simple
 * fp32 kernels for any other head dim up to 256 ("simple kernels" below), RoPE, the KV-cache
 * writer and split-K flash decoding. The math is FlashAttention-2 (Dao, arXiv 2307.08691,
 * Algorithms 1 and 2); layouts, RoPE and lse as the CPU op (src/ops/attention.c,
 * src/ops/cpu/attention_fwd.c, attention_bwd.c), which is the reference in
 * tests/backend_ops/attention.c.
 *
 * mma.sync m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane l,
 * g = l / 4, t = l % 4:
 *   A 16x16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
 *   B 16x8 (k x n):    b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
 *   C 16x8:            c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
 * so two neighbouring C tiles of a row block are exactly the A fragment of the next
 * product (P = softmax(S) feeds P V from registers). Shared-memory tiles have rows of
 * D + 8 bf16 (16 bytes of padding): the eight 16-byte rows an ldmatrix phase reads fall
 * in eight different bank groups.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "linmoe/cuda_attention.h"
#include "ops/cuda/attention_cudnn.cuh"
#include "ops/cuda/ctx.cuh"
#include "ops/cuda/ptx.cuh"

typedef __nv_bfloat16 bf16;

namespace {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

/* ---------------------------------------------------------------- PTX helpers */

__device__ __forceinline__ void cp4z(void *dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(ok ? 4 : 0));
}
/* 2^x, one MUFU op; 2^-inf = +0 */
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void st_release(int *p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* Fragment addresses for lane l (ldmatrix x4). A at (m0, k0) of row-major [m][k]: */
__device__ __forceinline__ const bf16 *a_rm(const bf16 *M, int ld, int m0, int k0, int l) {
    return M + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8;
}
/* A at (m0, k0) of A = M^T, M row-major [k][m] (with ldsm4t) */
__device__ __forceinline__ const bf16 *a_tr(const bf16 *M, int ld, int m0, int k0, int l) {
    return M + (k0 + (l & 7) + ((l >> 4) & 1) * 8) * ld + m0 + ((l >> 3) & 1) * 8;
}
/* B tiles n0 (regs 0, 1) and n0 + 8 (regs 2, 3), k0..k0+15, of B = M^T with M row-major
 * [n][k] (with ldsm4) */
__device__ __forceinline__ const bf16 *b_nk(const bf16 *M, int ld, int k0, int n0, int l) {
    return M + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8;
}
/* the same two B tiles of B row-major [k][n] (with ldsm4t) */
__device__ __forceinline__ const bf16 *b_kn(const bf16 *M, int ld, int k0, int n0, int l) {
    return M + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0 + (l >> 4) * 8;
}

/* Position of flattened token t inside its document: cu [ncu] int32 document starts
 * (the last entry = B*T); the last n with cu[n] <= t (empty documents share values). */
__device__ __forceinline__ int tok_pos(const int *cu, int ncu, int t) {
    int lo = 0, hi = ncu - 1;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return t - cu[lo];
}

/* ---------------------------------------------------------------- forward */

struct FwdP {
    const bf16 *q, *k, *v;
    bf16 *o;
    float *lse;      /* may be NULL */
    const int4 *tab; /* per query block: (first token, document length, q0, 0) */
    int Hq, Hkv, grp;
    float scale_log2; /* scale * log2(e) */
};

constexpr int F_BM = 128, F_BN = 64;
template <int D> constexpr int fwd_smem() { return (F_BM + 4 * F_BN) * (D + 8) * 2; }

/* One CTA (4 warps; warp w owns query rows 32 w .. 32 w + 31 of the block) per
 * (query head blockIdx.x, query block blockIdx.y of the table). */
template <int D> __global__ void __launch_bounds__(128, 2) attn_fwd(const FwdP p) {
    constexpr int BM = F_BM, BN = F_BN, LD = D + 8, NT = D / 8, KS = D / 16, CH = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Qs = reinterpret_cast<bf16 *>(smem); /* [BM][LD] */
    bf16 *Ks = Qs + BM * LD;                   /* [2][BN][LD] */
    bf16 *Vs = Ks + 2 * BN * LD;               /* [2][BN][LD] */
    const int h = blockIdx.x;
    const int4 ent = p.tab[blockIdx.y];
    const int bos = ent.x, len = ent.y, q0 = ent.z;
    const int g = h / p.grp;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int64_t qstr = (int64_t)p.Hq * D, kstr = (int64_t)p.Hkv * D;
    const bf16 *qg = p.q + ((int64_t)bos * p.Hq + h) * D;
    const bf16 *kg = p.k + ((int64_t)bos * p.Hkv + g) * D;
    const bf16 *vg = p.v + ((int64_t)bos * p.Hkv + g) * D;

    for (int c = tid; c < BM * CH; c += 128) {
        const int r = c / CH, cc = c - r * CH, row = q0 + r;
        const bool ok = row < len;
        cp_async16_zfill(Qs + r * LD + cc * 8, qg + (ok ? row : 0) * qstr + cc * 8, ok);
    }
    auto load_kv = [&](int buf, int j0) {
        for (int c = tid; c < BN * CH; c += 128) {
            const int r = c / CH, cc = c - r * CH, row = j0 + r;
            const bool ok = row < len;
            const int64_t off = (ok ? row : 0) * kstr + cc * 8;
            cp_async16_zfill(Ks + (buf * BN + r) * LD + cc * 8, kg + off, ok);
            cp_async16_zfill(Vs + (buf * BN + r) * LD + cc * 8, vg + off, ok);
        }
    };
    const int kend = min(q0 + BM, len); /* keys 0 .. kend-1 */
    const int nkb = (kend + BN - 1) / BN;
    load_kv(0, 0);
    cp_async_commit();

    const int wr0 = warp * 32;
    float oacc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                oacc[mt][n][c] = 0.0f;
    float mrow[4], lrow[4]; /* rows mt * 16 + gq + 8 hf, index 2 mt + hf */
#pragma unroll
    for (int r = 0; r < 4; r++) {
        mrow[r] = -INFINITY;
        lrow[r] = 0.0f;
    }

    for (int jb = 0; jb < nkb; jb++) {
        const int buf = jb & 1, j0 = jb * BN;
        if (jb + 1 < nkb) {
            load_kv(buf ^ 1, j0 + BN);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        /* rows of this warp are all above the block's first key: nothing to add */
        if (j0 <= q0 + wr0 + 31) {
            const bf16 *Kb = Ks + buf * BN * LD, *Vb = Vs + buf * BN * LD;
            float s[2][8][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        s[mt][n][c] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t a0[4], a1[4];
                ldsm4(a0, a_rm(Qs, LD, wr0, ks * 16, lane));
                ldsm4(a1, a_rm(Qs, LD, wr0 + 16, ks * 16, lane));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t b[4];
                    ldsm4(b, b_nk(Kb, LD, ks * 16, np * 16, lane));
                    mma16816(s[0][2 * np], a0, b[0], b[1]);
                    mma16816(s[0][2 * np + 1], a0, b[2], b[3]);
                    mma16816(s[1][2 * np], a1, b[0], b[1]);
                    mma16816(s[1][2 * np + 1], a1, b[2], b[3]);
                }
            }
            const bool need_mask = (j0 + BN - 1 > q0 + wr0) || (j0 + BN > len);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        float x = s[mt][n][c] * p.scale_log2;
                        if (need_mask) {
                            const int i = q0 + wr0 + mt * 16 + gq + (c >> 1) * 8;
                            const int j = j0 + n * 8 + 2 * tq + (c & 1);
                            if (j > i || j >= len)
                                x = -INFINITY;
                        }
                        s[mt][n][c] = x;
                    }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int r = 2 * mt + hf;
                    float mx = mrow[r];
#pragma unroll
                    for (int n = 0; n < 8; n++)
                        mx = fmaxf(mx, fmaxf(s[mt][n][2 * hf], s[mt][n][2 * hf + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float ms = mx == -INFINITY ? 0.0f : mx;
                    const float alpha = ex2(mrow[r] - ms);
                    mrow[r] = mx;
                    float sum = 0.0f;
#pragma unroll
                    for (int n = 0; n < 8; n++)
#pragma unroll
                        for (int c2 = 0; c2 < 2; c2++) {
                            const float e = ex2(s[mt][n][2 * hf + c2] - ms);
                            s[mt][n][2 * hf + c2] = e;
                            sum += e;
                        }
                    lrow[r] = lrow[r] * alpha + sum;
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        oacc[mt][n][2 * hf] *= alpha;
                        oacc[mt][n][2 * hf + 1] *= alpha;
                    }
                }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                uint32_t a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < NT / 2; dp++) {
                    uint32_t b[4];
                    ldsm4t(b, b_kn(Vb, LD, kk * 16, dp * 16, lane));
                    mma16816(oacc[0][2 * dp], a[0], b[0], b[1]);
                    mma16816(oacc[0][2 * dp + 1], a[0], b[2], b[3]);
                    mma16816(oacc[1][2 * dp], a[1], b[0], b[1]);
                    mma16816(oacc[1][2 * dp + 1], a[1], b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }

    /* epilogue: o = acc / l staged in the warp's own rows of Qs, lse = (m + log2 l) ln 2 */
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = 2 * mt + hf;
            float l = lrow[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int lr = wr0 + mt * 16 + gq + hf * 8;
#pragma unroll
            for (int n = 0; n < NT; n++)
                *reinterpret_cast<uint32_t *>(Qs + lr * LD + n * 8 + 2 * tq) =
                    pack_bf16(oacc[mt][n][2 * hf] * inv, oacc[mt][n][2 * hf + 1] * inv);
            if (p.lse && tq == 0 && q0 + lr < len)
                p.lse[(int64_t)(bos + q0 + lr) * p.Hq + h] = (mrow[r] + log2f(l)) * LN2;
        }
    __syncwarp();
    bf16 *og = p.o + ((int64_t)bos * p.Hq + h) * D;
    for (int c = lane; c < 32 * CH; c += 32) {
        const int r = c / CH, cc = c - r * CH, row = q0 + wr0 + r;
        if (row < len)
            *reinterpret_cast<uint4 *>(og + row * qstr + cc * 8) =
                *reinterpret_cast<const uint4 *>(Qs + (wr0 + r) * LD + cc * 8);
    }
}

/* ---------------------------------------------------------------- backward */

struct BwdP {
    const bf16 *q, *k, *v, *dO;
    const float *lse, *delta;
    float *dqacc; /* [B*T, Hq, D] fp32, dQ~ / scale */
    bf16 *dk, *dv;
    const int4 *tab;    /* per key block: (first token, document length, jl, qbase) */
    int *locks;         /* [Hq][nqb_total] contributions added so far (zeroed) */
    unsigned *counter;  /* ticket counter (zeroed) */
    const float2 *rope; /* (cos, sin) [pos][D/2] or NULL (NoPE) */
    int Hq, Hkv, grp, nqb_total, atomic_mode;
    float scale, scale_log2;
};

constexpr int B_BM = 64, B_BN = 64;
template <int D> constexpr int bwd_smem() {
    return 4 * 64 * (D + 8) * 2 + B_BN * (B_BM + 8) * 2 + 2 * B_BM * 4;
}

/* One CTA (4 warps; warp w owns keys 16 w .. 16 w + 15 of the block) per (key block,
 * kv head), in ticket order. Per query head of the group and query block i >= the key
 * block: S^T = K Q^T, P^T = exp(S^T - lse), dV += P^T dO, dP^T = V dO^T,
 * dS^T = P^T (dP^T - Delta), dK += dS^T Q, dS^T to shared memory, dQ_i += dS K. */
template <int D> __global__ void __launch_bounds__(128, 2) attn_bwd(const BwdP p) {
    constexpr int BM = B_BM, BN = B_BN, LD = D + 8, LDS = BM + 8, NT = D / 8, KS = D / 16,
                  CH = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Ks = reinterpret_cast<bf16 *>(smem);                /* [BN][LD] */
    bf16 *Vs = Ks + BN * LD;                                  /* [BN][LD] */
    bf16 *Qs = Vs + BN * LD;                                  /* [BM][LD] */
    bf16 *dOs = Qs + BM * LD;                                 /* [BM][LD] */
    bf16 *dSt = dOs + BM * LD;                                /* [BN][LDS] dS^T, bf16 */
    float *lse_s = reinterpret_cast<float *>(dSt + BN * LDS); /* [BM] */
    float *dl_s = lse_s + BM;                                 /* [BM] */
    __shared__ int s_ticket;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    if (tid == 0)
        s_ticket = (int)atomicAdd(p.counter, 1u);
    __syncthreads();
    const int ticket = s_ticket;
    const int4 ent = p.tab[ticket / p.Hkv];
    const int g = ticket % p.Hkv;
    const int bos = ent.x, len = ent.y, jl = ent.z, qbase = ent.w;
    const int j0 = jl * BN;
    const int nqb = (len + BM - 1) / BM, nb2 = nqb - jl;
    const int niter = p.grp * nb2;
    const int64_t qstr = (int64_t)p.Hq * D, kstr = (int64_t)p.Hkv * D;

    {
        const bf16 *kg = p.k + ((int64_t)bos * p.Hkv + g) * D;
        const bf16 *vg = p.v + ((int64_t)bos * p.Hkv + g) * D;
        for (int c = tid; c < BN * CH; c += 128) {
            const int r = c / CH, cc = c - r * CH, row = j0 + r;
            const bool ok = row < len;
            const int64_t off = (ok ? row : 0) * kstr + cc * 8;
            cp_async16_zfill(Ks + r * LD + cc * 8, kg + off, ok);
            cp_async16_zfill(Vs + r * LD + cc * 8, vg + off, ok);
        }
    }
    auto load_q = [&](int it) {
        const int hh = it / nb2, i0 = (jl + it % nb2) * BM, h = g * p.grp + hh;
        const bf16 *qg = p.q + ((int64_t)bos * p.Hq + h) * D;
        const bf16 *og = p.dO + ((int64_t)bos * p.Hq + h) * D;
        for (int c = tid; c < BM * CH; c += 128) {
            const int r = c / CH, cc = c - r * CH, row = i0 + r;
            const bool ok = row < len;
            const int64_t off = (ok ? row : 0) * qstr + cc * 8;
            cp_async16_zfill(Qs + r * LD + cc * 8, qg + off, ok);
            cp_async16_zfill(dOs + r * LD + cc * 8, og + off, ok);
        }
        if (tid < BM) {
            const int row = i0 + tid;
            const bool ok = row < len;
            const int64_t off = (int64_t)(bos + (ok ? row : 0)) * p.Hq + h;
            cp4z(lse_s + tid, p.lse + off, ok);
            cp4z(dl_s + tid, p.delta + off, ok);
        }
    };
    load_q(0);
    cp_async_commit();

    float dk[NT][4], dv[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            dk[n][c] = dv[n][c] = 0.0f;
    const int kr0 = warp * 16; /* the warp's keys (rows of Ks) */

    for (int it = 0; it < niter; it++) {
        const int hh = it / nb2, i = jl + it % nb2, i0 = i * BM, h = g * p.grp + hh;
        cp_async_wait<0>();
        __syncthreads();
        float st[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                st[n][c] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t a[4];
            ldsm4(a, a_rm(Ks, LD, kr0, ks * 16, lane));
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldsm4(b, b_nk(Qs, LD, ks * 16, np * 16, lane));
                mma16816(st[2 * np], a, b[0], b[1]);
                mma16816(st[2 * np + 1], a, b[2], b[3]);
            }
        }
        /* P^T (keys x queries) */
        const bool need_mask = (i0 < j0 + BN) || (i0 + BM > len) || (j0 + BN > len);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int col = n * 8 + 2 * tq + (c & 1);
                float pv = ex2(st[n][c] * p.scale_log2 - lse_s[col] * LOG2E);
                if (need_mask) {
                    const int key = j0 + kr0 + gq + (c >> 1) * 8, qi = i0 + col;
                    if (key > qi || qi >= len || key >= len)
                        pv = 0.0f;
                }
                st[n][c] = pv;
            }
            /* dV += P^T dO */
#pragma unroll
        for (int kq = 0; kq < 4; kq++) {
            uint32_t a[4];
            a[0] = pack_bf16(st[2 * kq][0], st[2 * kq][1]);
            a[1] = pack_bf16(st[2 * kq][2], st[2 * kq][3]);
            a[2] = pack_bf16(st[2 * kq + 1][0], st[2 * kq + 1][1]);
            a[3] = pack_bf16(st[2 * kq + 1][2], st[2 * kq + 1][3]);
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                uint32_t b[4];
                ldsm4t(b, b_kn(dOs, LD, kq * 16, dp * 16, lane));
                mma16816(dv[2 * dp], a, b[0], b[1]);
                mma16816(dv[2 * dp + 1], a, b[2], b[3]);
            }
        }
        /* dP^T = V dO^T, then dS^T = P^T (dP^T - Delta) in st */
        {
            float dp_[8][4];
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    dp_[n][c] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t a[4];
                ldsm4(a, a_rm(Vs, LD, kr0, ks * 16, lane));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t b[4];
                    ldsm4(b, b_nk(dOs, LD, ks * 16, np * 16, lane));
                    mma16816(dp_[2 * np], a, b[0], b[1]);
                    mma16816(dp_[2 * np + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    st[n][c] *= dp_[n][c] - dl_s[n * 8 + 2 * tq + (c & 1)];
        }
        /* dK += dS^T Q (scaled at the end); dS^T to shared memory for dQ */
#pragma unroll
        for (int kq = 0; kq < 4; kq++) {
            uint32_t a[4];
            a[0] = pack_bf16(st[2 * kq][0], st[2 * kq][1]);
            a[1] = pack_bf16(st[2 * kq][2], st[2 * kq][3]);
            a[2] = pack_bf16(st[2 * kq + 1][0], st[2 * kq + 1][1]);
            a[3] = pack_bf16(st[2 * kq + 1][2], st[2 * kq + 1][3]);
            *reinterpret_cast<uint32_t *>(dSt + (kr0 + gq) * LDS + kq * 16 + 2 * tq) = a[0];
            *reinterpret_cast<uint32_t *>(dSt + (kr0 + gq + 8) * LDS + kq * 16 + 2 * tq) = a[1];
            *reinterpret_cast<uint32_t *>(dSt + (kr0 + gq) * LDS + kq * 16 + 8 + 2 * tq) = a[2];
            *reinterpret_cast<uint32_t *>(dSt + (kr0 + gq + 8) * LDS + kq * 16 + 8 + 2 * tq) = a[3];
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                uint32_t b[4];
                ldsm4t(b, b_kn(Qs, LD, kq * 16, dp * 16, lane));
                mma16816(dk[2 * dp], a, b[0], b[1]);
                mma16816(dk[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads(); /* dS^T complete; Qs, dOs, lse_s, dl_s free */
        if (it + 1 < niter) {
            load_q(it + 1);
            cp_async_commit();
        }
        /* dQ_i (this warp: query rows 16 w ..) += dS K */
        float dq[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                dq[n][c] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t a[4];
            ldsm4t(a, a_tr(dSt, LDS, warp * 16, kk * 16, lane));
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                uint32_t b[4];
                ldsm4t(b, b_kn(Ks, LD, kk * 16, dp * 16, lane));
                mma16816(dq[2 * dp], a, b[0], b[1]);
                mma16816(dq[2 * dp + 1], a, b[2], b[3]);
            }
        }
        int *lock = p.locks + (int64_t)h * p.nqb_total + qbase + i;
        if (!p.atomic_mode) {
            if (tid == 0)
                while (ld_acquire(lock) != jl)
                    __nanosleep(32);
            __syncthreads();
        }
        float *dst = p.dqacc + ((int64_t)(bos + i0) * p.Hq + h) * D;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int row = warp * 16 + gq + hf * 8;
            if (i0 + row < len) {
                float *rp = dst + row * qstr + 2 * tq;
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    float2 *ptr = reinterpret_cast<float2 *>(rp + n * 8);
                    const float x0 = dq[n][2 * hf], x1 = dq[n][2 * hf + 1];
                    if (p.atomic_mode) {
                        atomicAdd(&ptr->x, x0);
                        atomicAdd(&ptr->y, x1);
                    } else if (jl == 0) {
                        __stcg(ptr, make_float2(x0, x1));
                    } else {
                        const float2 old = __ldcg(ptr);
                        __stcg(ptr, make_float2(old.x + x0, old.y + x1));
                    }
                }
            }
        }
        if (!p.atomic_mode) {
            __threadfence();
            __syncthreads();
            if (tid == 0)
                st_release(lock, jl + 1);
        }
    }

    /* epilogue: dK = R^T(p_j) scale dK~, dV; staged in the warp's rows of Qs / dOs (no
     * warp reads those after the last iteration's second barrier) */
    const int H2 = D / 2;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int lr = kr0 + gq + hf * 8, key = j0 + lr;
        const float2 *cs = p.rope ? p.rope + (int64_t)min(key, len - 1) * H2 : nullptr;
#pragma unroll
        for (int n = 0; n < NT / 2; n++)
#pragma unroll
            for (int c2 = 0; c2 < 2; c2++) {
                const float a = dk[n][2 * hf + c2] * p.scale;
                const float b = dk[n + NT / 2][2 * hf + c2] * p.scale;
                if (cs) {
                    const float2 r = cs[n * 8 + 2 * tq + c2];
                    dk[n][2 * hf + c2] = a * r.x + b * r.y;
                    dk[n + NT / 2][2 * hf + c2] = b * r.x - a * r.y;
                } else {
                    dk[n][2 * hf + c2] = a;
                    dk[n + NT / 2][2 * hf + c2] = b;
                }
            }
#pragma unroll
        for (int n = 0; n < NT; n++) {
            *reinterpret_cast<uint32_t *>(Qs + lr * LD + n * 8 + 2 * tq) =
                pack_bf16(dk[n][2 * hf], dk[n][2 * hf + 1]);
            *reinterpret_cast<uint32_t *>(dOs + lr * LD + n * 8 + 2 * tq) =
                pack_bf16(dv[n][2 * hf], dv[n][2 * hf + 1]);
        }
    }
    __syncwarp();
    bf16 *dkg = p.dk + ((int64_t)bos * p.Hkv + g) * D;
    bf16 *dvg = p.dv + ((int64_t)bos * p.Hkv + g) * D;
    for (int c = lane; c < 16 * CH; c += 32) {
        const int r = c / CH, cc = c - r * CH, row = j0 + kr0 + r;
        if (row < len) {
            *reinterpret_cast<uint4 *>(dkg + row * kstr + cc * 8) =
                *reinterpret_cast<const uint4 *>(Qs + (kr0 + r) * LD + cc * 8);
            *reinterpret_cast<uint4 *>(dvg + row * kstr + cc * 8) =
                *reinterpret_cast<const uint4 *>(dOs + (kr0 + r) * LD + cc * 8);
        }
    }
}

/* Delta[r] = sum_d dO[r, d] o[r, d] over rows r of [B*T*Hq, D]; D / 8 lanes per row. */
template <int D>
__global__ void attn_delta(const bf16 *o, const bf16 *dO, float *delta, int64_t rows) {
    constexpr int L = D / 8, RPW = 32 / L;
    const int lane = threadIdx.x & 31, sub = lane / L, part = lane % L;
    const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t base = w * RPW; base < rows; base += nw * RPW) {
        const int64_t row = base + sub;
        float s = 0.0f;
        if (row < rows) {
            const uint4 a = *reinterpret_cast<const uint4 *>(o + row * D + part * 8);
            const uint4 b = *reinterpret_cast<const uint4 *>(dO + row * D + part * 8);
            const __nv_bfloat162 *ha = reinterpret_cast<const __nv_bfloat162 *>(&a);
            const __nv_bfloat162 *hb = reinterpret_cast<const __nv_bfloat162 *>(&b);
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const float2 fa = __bfloat1622float2(ha[x]), fb = __bfloat1622float2(hb[x]);
                s += fa.x * fb.x + fa.y * fb.y;
            }
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, off);
        if (row < rows && part == 0)
            delta[row] = s;
    }
}

/* dq = R^T(p) (scale * acc) in bf16; rows of [B*T*H, D], pairs (f, f + D/2), two
 * consecutive f per thread. */
__global__ void attn_dq_final(const float *acc, bf16 *dq, const float2 *rope, const int *cu,
                              int ncu, int H, int D, int64_t rows, float scale) {
    const int H2 = D / 2, Q = H2 / 2;
    const int64_t n = rows * Q;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = idx / Q;
        const int f = (int)(idx - row * Q) * 2;
        const float *a = acc + row * D;
        float2 x = *reinterpret_cast<const float2 *>(a + f);
        float2 y = *reinterpret_cast<const float2 *>(a + f + H2);
        x.x *= scale, x.y *= scale, y.x *= scale, y.y *= scale;
        if (rope) {
            const int pos = tok_pos(cu, ncu, (int)(row / H));
            const float2 r0 = rope[(int64_t)pos * H2 + f], r1 = rope[(int64_t)pos * H2 + f + 1];
            const float2 nx = make_float2(x.x * r0.x + y.x * r0.y, x.y * r1.x + y.y * r1.y);
            const float2 ny = make_float2(y.x * r0.x - x.x * r0.y, y.y * r1.x - x.y * r1.y);
            x = nx, y = ny;
        }
        *reinterpret_cast<__nv_bfloat162 *>(dq + row * D + f) = __floats2bfloat162_rn(x.x, x.y);
        *reinterpret_cast<__nv_bfloat162 *>(dq + row * D + f + H2) =
            __floats2bfloat162_rn(y.x, y.y);
    }
}

/* ---------------------------------------------------------------- RoPE, cache */

/* y = R(p) x or R(p)^T x, bf16 rows [B*T*H, D], fp32 math; two consecutive f per thread.
 * y may alias x (each thread reads its four values before writing them). */
__global__ void attn_rope(const bf16 *x, bf16 *y, const float2 *rope, const int *cu, int ncu, int H,
                          int D, int64_t rows, int inverse) {
    const int H2 = D / 2, Q = H2 / 2;
    const float sg = inverse ? -1.0f : 1.0f;
    const int64_t n = rows * Q;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = idx / Q;
        const int f = (int)(idx - row * Q) * 2;
        const int pos = tok_pos(cu, ncu, (int)(row / H));
        const float2 a =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(x + row * D + f));
        const float2 b =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(x + row * D + f + H2));
        const float2 r0 = rope[(int64_t)pos * H2 + f], r1 = rope[(int64_t)pos * H2 + f + 1];
        const float s0 = sg * r0.y, s1 = sg * r1.y;
        *reinterpret_cast<__nv_bfloat162 *>(y + row * D + f) =
            __floats2bfloat162_rn(a.x * r0.x - b.x * s0, a.y * r1.x - b.y * s1);
        *reinterpret_cast<__nv_bfloat162 *>(y + row * D + f + H2) =
            __floats2bfloat162_rn(b.x * r0.x + a.x * s0, b.y * r1.x + a.y * s1);
    }
}

/* y = R(p) x or R(p)^T x as attn_rope, one pair (f, f + D/2) per thread: any even D
 * (attn_rope needs D % 4 == 0 for its paired 4-byte accesses). */
__global__ void attn_rope_pairs(const bf16 *x, bf16 *y, const float2 *rope, const int *cu, int ncu,
                                int H, int D, int64_t rows, int inverse) {
    const int H2 = D / 2;
    const float sg = inverse ? -1.0f : 1.0f;
    const int64_t n = rows * H2;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = idx / H2;
        const int f = (int)(idx - row * H2);
        const int pos = tok_pos(cu, ncu, (int)(row / H));
        const float a = __bfloat162float(x[row * D + f]), b = __bfloat162float(x[row * D + f + H2]);
        const float2 r = rope[(int64_t)pos * H2 + f];
        const float s = sg * r.y;
        y[row * D + f] = __float2bfloat16_rn(a * r.x - b * s);
        y[row * D + f + H2] = __float2bfloat16_rn(b * r.x + a * s);
    }
}

/* (cos, sin) of position p, frequency f: angle p * inv[f] in fp64 (inv[f] =
 * theta^(-2f/D) formed on the host exactly as lm_attn_rope_factors), rounded to fp32.
 * D <= ATTN_DMAX, so at most 128 frequencies. */
constexpr int ATTN_DMAX = 256;
struct InvFreq {
    double v[ATTN_DMAX / 2];
};
__global__ void attn_rope_table(float2 *tab, InvFreq inv, int H2, int64_t len) {
    const int64_t n = len * H2;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t p = idx / H2;
        const int f = (int)(idx - p * H2);
        double s, c;
        sincos((double)p * inv.v[f], &s, &c);
        tab[idx] = make_float2((float)c, (float)s);
    }
}

/* k_cache[b, pos+t] = R(pos+t) k[b, t] (rope != NULL) or k[b, t]; v_cache[b, pos+t] =
 * v[b, t]. Pairs (f, f + D/2) over rows of [B*T*Hkv, D]. */
__global__ void attn_cache_write(const bf16 *k, const bf16 *v, bf16 *kc, bf16 *vc,
                                 const float2 *rope, int T, int Hkv, int D, int64_t Tmax,
                                 int64_t pos, int64_t rows) {
    const int H2 = D / 2;
    const int64_t n = rows * H2;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = idx / H2;
        const int f = (int)(idx - row * H2);
        const int64_t gidx = row % Hkv, bt = row / Hkv, t = bt % T, b = bt / T;
        const int64_t dst = ((b * Tmax + pos + t) * Hkv + gidx) * D, src = row * D;
        vc[dst + f] = v[src + f];
        vc[dst + f + H2] = v[src + f + H2];
        if (rope) {
            const float a = __bfloat162float(k[src + f]), bb = __bfloat162float(k[src + f + H2]);
            const float2 r = rope[(pos + t) * H2 + f];
            kc[dst + f] = __float2bfloat16_rn(a * r.x - bb * r.y);
            kc[dst + f + H2] = __float2bfloat16_rn(bb * r.x + a * r.y);
        } else {
            kc[dst + f] = k[src + f];
            kc[dst + f + H2] = k[src + f + H2];
        }
    }
}

/* ---------------------------------------------------------------- decode */

struct DecP {
    const bf16 *q, *kc, *vc;
    float *pml;         /* [B*Hq][S][2] (max in log2 units, sum) */
    float *pacc;        /* [B*Hq][S][D] unnormalised */
    const float2 *rope; /* NULL: NoPE */
    int Hq, Hkv, grp, S, chunk, L, pos;
    int64_t Tmax;
    float scale_log2;
};

/* Decode geometry: DEC_W warps per CTA, each streaming its own tiles of DEC_BK cache rows
 * through DEC_ST cp.async stages (no CTA barrier inside the loop); a split's rows come in
 * multiples of DEC_CHUNK = DEC_W * DEC_BK; at most DEC_GH query heads per CTA. */
constexpr int DEC_BK = 16, DEC_ST = 3, DEC_W = 4, DEC_GH = 16, DEC_CHUNK = DEC_W * DEC_BK;
template <int D> __host__ __device__ constexpr int dec_stage() {
    return DEC_BK * (D + 8) + DEC_BK * D; /* bf16 elements */
}
template <int D> constexpr int dec_smem() {
    return DEC_W * DEC_ST * dec_stage<D>() * 2 + DEC_GH * D * 4 + DEC_W * DEC_GH * DEC_BK * 4;
}

/* One CTA (DEC_W warps) per (split blockIdx.x, (b, g) blockIdx.y, head slice blockIdx.z of
 * at most 16 query heads of the group), over cache rows [s chunk, min(L, (s+1) chunk)).
 * Warp w takes the split's tiles w, w + DEC_W, ... (16 rows each, DEC_ST-stage cp.async
 * pipeline of its own) and keeps an online softmax per head: lane (j, half) = (lane % 16,
 * lane / 16) forms half of the score of row j for every head (16-byte K loads, q from shared
 * memory as fp32 times scale log2 e), the halves meet by one shuffle; the weighted values
 * accumulate D / 32 dims per lane for every head. The warps' states merge in warp order
 * (deterministic) into the split's fp32 partial (max in log2 units, sum, weighted values). */
template <int D> __global__ void __launch_bounds__(DEC_W * 32) attn_decode(const DecP p) {
    constexpr int BK = DEC_BK, LDK = D + 8, HALF = D / 2, DPL = D / 32, CH = D / 8;
    constexpr int KST = BK * LDK, STG = dec_stage<D>();
    static_assert(DEC_W * DEC_GH * (D + 2) * 4 <= DEC_W * DEC_ST * STG * 2,
                  "the warp merge reuses the stage buffers");
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    bf16 *Kw = reinterpret_cast<bf16 *>(smem) + warp * DEC_ST * STG; /* [ST][K BKxLDK, V BKxD] */
    float *qs = reinterpret_cast<float *>(reinterpret_cast<bf16 *>(smem) + DEC_W * DEC_ST * STG);
    float *pw = qs + DEC_GH * D + warp * DEC_GH * BK; /* this warp's probabilities [GH][BK] */
    const int s = blockIdx.x, b = blockIdx.y / p.Hkv, g = blockIdx.y % p.Hkv;
    const int h0 = g * p.grp + blockIdx.z * DEC_GH,
              GH = min(DEC_GH, p.grp - (int)blockIdx.z * DEC_GH);
    const int kb0 = s * p.chunk, kb1 = min(p.L, kb0 + p.chunk);
    const int ntile = (kb1 - kb0 + BK - 1) / BK;
    const int nt_w = ntile > warp ? (ntile - warp + DEC_W - 1) / DEC_W : 0;
    const int64_t rstr = (int64_t)p.Hkv * D;
    const bf16 *kg = p.kc + ((int64_t)b * p.Tmax * p.Hkv + g) * D;
    const bf16 *vg = p.vc + ((int64_t)b * p.Tmax * p.Hkv + g) * D;
    auto load = [&](int st, int i) { /* the warp's i-th tile into stage st */
                                     const int t0 = kb0 + (warp + DEC_W * i) * BK;
                                     bf16 *Ks = Kw + st * STG, *Vs = Ks + KST;
#pragma unroll
                                     for (int c = lane; c < BK * CH; c += 32) {
                                         const int r = c / CH, cc = c - r * CH, row = t0 + r;
                                         const bool ok = row < kb1;
                                         const int64_t off =
                                             (int64_t)(ok ? row : kb0) * rstr + cc * 8;
                                         cp_async16_zfill(Ks + r * LDK + cc * 8, kg + off, ok);
                                         cp_async16_zfill(Vs + r * D + cc * 8, vg + off, ok);
                                     }
    };
#pragma unroll
    for (int i = 0; i < DEC_ST - 1; i++) {
        if (i < nt_w)
            load(i, i);
        cp_async_commit();
    }
    for (int idx = tid; idx < GH * HALF; idx += DEC_W * 32) {
        const int hh = idx / HALF, f = idx - hh * HALF;
        const bf16 *qr = p.q + ((int64_t)b * p.Hq + h0 + hh) * D;
        float x0 = __bfloat162float(qr[f]), x1 = __bfloat162float(qr[f + HALF]);
        if (p.rope) {
            const float2 r = p.rope[(int64_t)p.pos * HALF + f];
            const float y0 = x0 * r.x - x1 * r.y, y1 = x1 * r.x + x0 * r.y;
            x0 = y0, x1 = y1;
        }
        qs[hh * D + f] = x0 * p.scale_log2;
        qs[hh * D + f + HALF] = x1 * p.scale_log2;
    }
    __syncthreads();

    float m[DEC_GH], l[DEC_GH], acc[DEC_GH][DPL];
#pragma unroll
    for (int hh = 0; hh < DEC_GH; hh++) {
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
#pragma unroll
        for (int d = 0; d < DPL; d++)
            acc[hh][d] = 0.0f;
    }
    const int j = lane & 15, hf = lane >> 4;
    for (int i = 0; i < nt_w; i++) {
        if (i + DEC_ST - 1 < nt_w)
            load((i + DEC_ST - 1) % DEC_ST, i + DEC_ST - 1);
        cp_async_commit();
        cp_async_wait<DEC_ST - 1>();
        __syncwarp();
        const bf16 *Ks = Kw + (i % DEC_ST) * STG, *Vs = Ks + KST;
        const int nval = min(BK, kb1 - (kb0 + (warp + DEC_W * i) * BK));
        float sc[DEC_GH];
#pragma unroll
        for (int hh = 0; hh < DEC_GH; hh++)
            sc[hh] = 0.0f;
        const bf16 *kr = Ks + j * LDK + hf * HALF;
#pragma unroll
        for (int c = 0; c < HALF / 8; c++) {
            const uint4 u = *reinterpret_cast<const uint4 *>(kr + c * 8);
            const __nv_bfloat162 *hk = reinterpret_cast<const __nv_bfloat162 *>(&u);
            const float2 k0 = __bfloat1622float2(hk[0]), k1 = __bfloat1622float2(hk[1]);
            const float2 k2 = __bfloat1622float2(hk[2]), k3 = __bfloat1622float2(hk[3]);
#pragma unroll
            for (int hh = 0; hh < DEC_GH; hh++) {
                if (hh < GH) {
                    const float *qv = qs + hh * D + hf * HALF + c * 8;
                    const float4 qa = *reinterpret_cast<const float4 *>(qv);
                    const float4 qb = *reinterpret_cast<const float4 *>(qv + 4);
                    sc[hh] += qa.x * k0.x + qa.y * k0.y + qa.z * k1.x + qa.w * k1.y;
                    sc[hh] += qb.x * k2.x + qb.y * k2.y + qb.z * k3.x + qb.w * k3.y;
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < DEC_GH; hh++) {
            if (hh < GH) {
                const float tot = sc[hh] + __shfl_xor_sync(0xffffffffu, sc[hh], 16);
                const float x = j < nval ? tot : -INFINITY;
                float mx = x;
#pragma unroll
                for (int off = 8; off > 0; off >>= 1)
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
                const float mnew = fmaxf(m[hh], mx); /* finite: nval >= 1 */
                const float pj = ex2(x - mnew);
                float sum = pj;
#pragma unroll
                for (int off = 8; off > 0; off >>= 1)
                    sum += __shfl_xor_sync(0xffffffffu, sum, off);
                const float alpha = ex2(m[hh] - mnew);
                l[hh] = l[hh] * alpha + sum;
                m[hh] = mnew;
#pragma unroll
                for (int d = 0; d < DPL; d++)
                    acc[hh][d] *= alpha;
                if (hf == 0)
                    pw[hh * BK + j] = pj;
            }
        }
        __syncwarp();
        for (int jj = 0; jj < nval; jj++) {
            float vv[DPL];
            const bf16 *vr = Vs + jj * D + lane * DPL;
            if constexpr (DPL == 4) {
                const uint2 u = *reinterpret_cast<const uint2 *>(vr);
                const float2 a =
                    __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
                const float2 c =
                    __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
                vv[0] = a.x, vv[1] = a.y, vv[2] = c.x, vv[3] = c.y;
            } else {
                const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(vr));
                vv[0] = a.x, vv[1] = a.y;
            }
#pragma unroll
            for (int hh = 0; hh < DEC_GH; hh++) {
                if (hh < GH) {
                    const float pj = pw[hh * BK + jj];
#pragma unroll
                    for (int d = 0; d < DPL; d++)
                        acc[hh][d] += pj * vv[d];
                }
            }
        }
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncthreads(); /* every warp is done with its stages: reuse them for the merge */
    float *mm = reinterpret_cast<float *>(smem); /* [W][GH] max */
    float *ll = mm + DEC_W * DEC_GH;             /* [W][GH] sum */
    float *aa = ll + DEC_W * DEC_GH;             /* [W][GH][D] weighted values */
#pragma unroll
    for (int hh = 0; hh < DEC_GH; hh++) {
        if (hh < GH) {
            if (lane == 0) {
                mm[warp * DEC_GH + hh] = m[hh];
                ll[warp * DEC_GH + hh] = l[hh];
            }
#pragma unroll
            for (int d = 0; d < DPL; d++)
                aa[(warp * DEC_GH + hh) * D + lane * DPL + d] = acc[hh][d];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < GH * D; idx += DEC_W * 32) {
        const int hh = idx / D, d = idx - hh * D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < DEC_W; w++)
            M = fmaxf(M, mm[w * DEC_GH + hh]); /* finite: warp 0 always has a tile */
        float a = 0.0f, L = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_W; w++) {
            const float wt = ex2(mm[w * DEC_GH + hh] - M); /* 0 for a warp without tiles */
            a += aa[(w * DEC_GH + hh) * D + d] * wt;
            L += ll[w * DEC_GH + hh] * wt;
        }
        const int64_t pi = ((int64_t)b * p.Hq + h0 + hh) * p.S + s;
        p.pacc[pi * D + d] = a;
        if (d == 0) {
            p.pml[2 * pi] = M;
            p.pml[2 * pi + 1] = L;
        }
    }
}

/* Merge the S partials of row bh = b * Hq + h in split order: D/2 threads, a pair each. */
__global__ void attn_decode_merge(const float *pml, const float *pacc, bf16 *o, float *lse, int S,
                                  int D) {
    const int64_t bh = blockIdx.x;
    const int dp = threadIdx.x;
    const float *ml = pml + bh * S * 2;
    float M = -INFINITY;
    for (int s = 0; s < S; s++)
        M = fmaxf(M, ml[2 * s]);
    float l = 0.0f, a0 = 0.0f, a1 = 0.0f;
    for (int s = 0; s < S; s++) {
        const float w = ex2(ml[2 * s] - M);
        l += ml[2 * s + 1] * w;
        const float2 a = *reinterpret_cast<const float2 *>(pacc + (bh * S + s) * D + 2 * dp);
        a0 += a.x * w;
        a1 += a.y * w;
    }
    const float inv = 1.0f / l;
    *reinterpret_cast<__nv_bfloat162 *>(o + bh * D + 2 * dp) =
        __floats2bfloat162_rn(a0 * inv, a1 * inv);
    if (lse && dp == 0)
        lse[bh] = (M + log2f(l)) * LN2;
}

/* lse [B, T, Hq] from cuDNN's stats [B, Hq, T] */
__global__ void attn_stats_to_lse(const float *stats, float *lse, int T, int Hq, int64_t n) {
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t h = idx % Hq, bt = idx / Hq, t = bt % T, b = bt / T;
        lse[idx] = stats[(b * Hq + h) * T + t];
    }
}

/* cuDNN's stats [B, Hq, T] from lse [B, T, Hq] */
__global__ void attn_lse_to_stats(const float *lse, float *stats, int T, int Hq, int64_t n) {
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t h = idx % Hq, bt = idx / Hq, t = bt % T, b = bt / T;
        stats[(b * Hq + h) * T + t] = lse[idx];
    }
}

/* ---------------------------------------------------------------- simple kernels (any D) */

/* The general fallback for head dims the FlashAttention-2 kernels do not take (any D <=
 * ATTN_DMAX; the small test configurations) and for LM_CUDA_ATTN_SIMPLE: plain fp32 loops,
 * correct and deterministic, not fast. One warp per output row: the row's own vector sits
 * in shared memory (fp32), lane l takes key (or query) l of each chunk of 32 and forms its
 * dot products alone, the chunk's softmax statistics meet by butterfly shuffles, and the
 * weighted sum over the chunk runs in key order with every lane owning dims l, l + 32, ...
 * Every sum has an order fixed by the shapes alone (no atomics), so results are bitwise
 * reproducible. q and k are the rotated copies with RoPE; dq, dk are rotated back in fp32
 * before their one bf16 rounding. */
constexpr int S_WARPS = 4;            /* warps (rows) per CTA */
constexpr int S_EPL = ATTN_DMAX / 32; /* dims per lane */

/* The document [*bos, *eos) of flattened token t (cu as tok_pos). */
__device__ __forceinline__ void tok_doc(const int *cu, int ncu, int t, int *bos, int *eos) {
    int lo = 0, hi = ncu - 1;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    *bos = cu[lo];
    *eos = cu[lo + 1];
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}
/* sum_d a[d] x[d], a fp32 in shared memory, x a bf16 row, in d order */
__device__ __forceinline__ float dot_row(const float *a, const bf16 *x, int D) {
    float s = 0.0f;
    for (int d = 0; d < D; d++)
        s = fmaf(a[d], __bfloat162float(x[d]), s);
    return s;
}

struct SmallP {
    const bf16 *q, *k, *v, *o, *dO; /* q, k rotated with RoPE */
    const float *lse_in, *delta;    /* backward */
    bf16 *o_out, *dq, *dk, *dv;
    float *lse;         /* forward, may be NULL */
    const float2 *rope; /* (cos, sin) [pos][D/2] or NULL (NoPE) */
    const int *cu;      /* document starts int32 [ncu] */
    int ncu, Hq, Hkv, grp, D;
    int64_t rows; /* rows of the kernel's output */
    float scale, scale_log2;
};

/* Writes w[d] (fp32, shared) as the bf16 row y, rotated back with R(pos)^T when rope is
 * set: y[f] = w[f] c + w[f + D/2] s, y[f + D/2] = w[f + D/2] c - w[f] s. */
__device__ __forceinline__ void store_grad_row(const float *w, bf16 *y, const float2 *rope, int pos,
                                               int D, int lane) {
    if (rope) {
        const int H2 = D / 2;
        const float2 *cs = rope + (int64_t)pos * H2;
        for (int f = lane; f < H2; f += 32) {
            const float a = w[f], b = w[f + H2];
            const float2 r = cs[f];
            y[f] = __float2bfloat16_rn(a * r.x + b * r.y);
            y[f + H2] = __float2bfloat16_rn(b * r.x - a * r.y);
        }
    } else {
        for (int d = lane; d < D; d += 32)
            y[d] = __float2bfloat16_rn(w[d]);
    }
}

/* Forward, one warp per (token t, query head h) row r = t Hq + h: keys j = bos .. t of
 * t's document in chunks of 32 (lane l: key j0 + l), online softmax in base 2 (q
 * pre-multiplied by scale log2 e), o = acc / l, lse = (m + log2 l) ln 2. */
__global__ void __launch_bounds__(S_WARPS * 32) attn_small_fwd(const SmallP p) {
    __shared__ float qs[S_WARPS][ATTN_DMAX];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, D = p.D;
    float *qw = qs[warp];
    const int64_t kstr = (int64_t)p.Hkv * D;
    for (int64_t r = (int64_t)blockIdx.x * S_WARPS + warp; r < p.rows;
         r += (int64_t)gridDim.x * S_WARPS) {
        const int t = (int)(r / p.Hq), h = (int)(r - (int64_t)t * p.Hq), g = h / p.grp;
        int bos, eos;
        tok_doc(p.cu, p.ncu, t, &bos, &eos);
        __syncwarp(); /* the previous row's reads of qw are done */
        for (int d = lane; d < D; d += 32)
            qw[d] = __bfloat162float(p.q[r * D + d]) * p.scale_log2;
        __syncwarp();
        const bf16 *kg = p.k + (int64_t)g * D, *vg = p.v + (int64_t)g * D;
        float m = -INFINITY, l = 0.0f, acc[S_EPL];
#pragma unroll
        for (int e = 0; e < S_EPL; e++)
            acc[e] = 0.0f;
        for (int j0 = bos; j0 <= t; j0 += 32) {
            const int j = j0 + lane, nj = min(32, t - j0 + 1);
            const float s = lane < nj ? dot_row(qw, kg + j * kstr, D) : -INFINITY;
            const float mnew = fmaxf(m, warp_max(s)); /* finite: key j0 <= t is valid */
            const float pj = lane < nj ? exp2f(s - mnew) : 0.0f;
            const float alpha = exp2f(m - mnew); /* 0 on the first chunk */
            l = l * alpha + warp_sum(pj);
            m = mnew;
#pragma unroll
            for (int e = 0; e < S_EPL; e++)
                acc[e] *= alpha;
            for (int jj = 0; jj < nj; jj++) {
                const float pb = __shfl_sync(0xffffffffu, pj, jj);
                const bf16 *vr = vg + (int64_t)(j0 + jj) * kstr;
#pragma unroll
                for (int e = 0; e < S_EPL; e++)
                    if (lane + 32 * e < D)
                        acc[e] = fmaf(pb, __bfloat162float(vr[lane + 32 * e]), acc[e]);
            }
        }
        const float inv = 1.0f / l; /* l >= 1: the row's maximum contributes 2^0 */
#pragma unroll
        for (int e = 0; e < S_EPL; e++)
            if (lane + 32 * e < D)
                p.o_out[r * D + lane + 32 * e] = __float2bfloat16_rn(acc[e] * inv);
        if (p.lse && lane == 0)
            p.lse[r] = (m + log2f(l)) * LN2;
    }
}

/* Delta[r] = sum_d dO[r, d] o[r, d] (fp32), one warp per row of [rows, D]. */
__global__ void __launch_bounds__(S_WARPS * 32) attn_small_delta(const SmallP p, float *delta) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, D = p.D;
    for (int64_t r = (int64_t)blockIdx.x * S_WARPS + warp; r < p.rows;
         r += (int64_t)gridDim.x * S_WARPS) {
        float s = 0.0f;
        for (int d = lane; d < D; d += 32)
            s = fmaf(__bfloat162float(p.o[r * D + d]), __bfloat162float(p.dO[r * D + d]), s);
        s = warp_sum(s);
        if (lane == 0)
            delta[r] = s;
    }
}

/* dq, one warp per query row r = t Hq + h: over keys j = bos .. t (lane l: key j0 + l),
 * P_tj = 2^(scale log2e q~.k~_j - lse log2e), dS_tj = P_tj (dO_t . v_j - Delta_t), then
 * dq~ += dS_tj k~_j in key order; dq = R^T(p_t) scale dq~. */
__global__ void __launch_bounds__(S_WARPS * 32) attn_small_dq(const SmallP p) {
    __shared__ float qs[S_WARPS][ATTN_DMAX], ds[S_WARPS][ATTN_DMAX];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, D = p.D;
    float *qw = qs[warp], *dw = ds[warp];
    const int64_t kstr = (int64_t)p.Hkv * D;
    for (int64_t r = (int64_t)blockIdx.x * S_WARPS + warp; r < p.rows;
         r += (int64_t)gridDim.x * S_WARPS) {
        const int t = (int)(r / p.Hq), h = (int)(r - (int64_t)t * p.Hq), g = h / p.grp;
        int bos, eos;
        tok_doc(p.cu, p.ncu, t, &bos, &eos);
        __syncwarp();
        for (int d = lane; d < D; d += 32) {
            qw[d] = __bfloat162float(p.q[r * D + d]);
            dw[d] = __bfloat162float(p.dO[r * D + d]);
        }
        __syncwarp();
        const float lse2 = p.lse_in[r] * LOG2E, di = p.delta[r];
        const bf16 *kg = p.k + (int64_t)g * D, *vg = p.v + (int64_t)g * D;
        float acc[S_EPL];
#pragma unroll
        for (int e = 0; e < S_EPL; e++)
            acc[e] = 0.0f;
        for (int j0 = bos; j0 <= t; j0 += 32) {
            const int j = j0 + lane, nj = min(32, t - j0 + 1);
            float dsj = 0.0f;
            if (lane < nj) {
                const float s = dot_row(qw, kg + j * kstr, D);
                const float dp = dot_row(dw, vg + j * kstr, D);
                dsj = exp2f(s * p.scale_log2 - lse2) * (dp - di);
            }
            for (int jj = 0; jj < nj; jj++) {
                const float db = __shfl_sync(0xffffffffu, dsj, jj);
                const bf16 *kr = kg + (int64_t)(j0 + jj) * kstr;
#pragma unroll
                for (int e = 0; e < S_EPL; e++)
                    if (lane + 32 * e < D)
                        acc[e] = fmaf(db, __bfloat162float(kr[lane + 32 * e]), acc[e]);
            }
        }
        __syncwarp(); /* every lane is done reading qw */
#pragma unroll
        for (int e = 0; e < S_EPL; e++)
            if (lane + 32 * e < D)
                qw[lane + 32 * e] = acc[e] * p.scale;
        __syncwarp();
        store_grad_row(qw, p.dq + r * D, p.rope, t - bos, D, lane);
    }
}

/* dk, dv, one warp per key row r = j Hkv + g: over the query heads h of g's group (in
 * order) and the queries i = j .. eos-1 of j's document (lane l: query i0 + l),
 * dV_j += P_ij dO_i and dK~_j += dS_ij q~_i in (head, query) order; dk = R^T(p_j) scale
 * dK~. */
__global__ void __launch_bounds__(S_WARPS * 32) attn_small_dkv(const SmallP p) {
    __shared__ float ks[S_WARPS][ATTN_DMAX], vs[S_WARPS][ATTN_DMAX];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, D = p.D;
    float *kw = ks[warp], *vw = vs[warp];
    const int64_t qstr = (int64_t)p.Hq * D;
    for (int64_t r = (int64_t)blockIdx.x * S_WARPS + warp; r < p.rows;
         r += (int64_t)gridDim.x * S_WARPS) {
        const int j = (int)(r / p.Hkv), g = (int)(r - (int64_t)j * p.Hkv);
        int bos, eos;
        tok_doc(p.cu, p.ncu, j, &bos, &eos);
        __syncwarp();
        for (int d = lane; d < D; d += 32) {
            kw[d] = __bfloat162float(p.k[r * D + d]);
            vw[d] = __bfloat162float(p.v[r * D + d]);
        }
        __syncwarp();
        float ak[S_EPL], av[S_EPL];
#pragma unroll
        for (int e = 0; e < S_EPL; e++)
            ak[e] = av[e] = 0.0f;
        for (int hh = 0; hh < p.grp; hh++) {
            const int h = g * p.grp + hh;
            const bf16 *qg = p.q + (int64_t)h * D, *og = p.dO + (int64_t)h * D;
            for (int i0 = j; i0 < eos; i0 += 32) {
                const int i = i0 + lane, ni = min(32, eos - i0);
                float pi = 0.0f, dsi = 0.0f;
                if (lane < ni) {
                    const int64_t ri = (int64_t)i * p.Hq + h;
                    const float s = dot_row(kw, qg + i * qstr, D);
                    const float dp = dot_row(vw, og + i * qstr, D);
                    pi = exp2f(s * p.scale_log2 - p.lse_in[ri] * LOG2E);
                    dsi = pi * (dp - p.delta[ri]);
                }
                for (int ii = 0; ii < ni; ii++) {
                    const float pb = __shfl_sync(0xffffffffu, pi, ii);
                    const float db = __shfl_sync(0xffffffffu, dsi, ii);
                    const bf16 *qr = qg + (int64_t)(i0 + ii) * qstr;
                    const bf16 *orow = og + (int64_t)(i0 + ii) * qstr;
#pragma unroll
                    for (int e = 0; e < S_EPL; e++)
                        if (lane + 32 * e < D) {
                            av[e] = fmaf(pb, __bfloat162float(orow[lane + 32 * e]), av[e]);
                            ak[e] = fmaf(db, __bfloat162float(qr[lane + 32 * e]), ak[e]);
                        }
                }
            }
        }
        __syncwarp(); /* every lane is done reading kw */
#pragma unroll
        for (int e = 0; e < S_EPL; e++)
            if (lane + 32 * e < D) {
                kw[lane + 32 * e] = ak[e] * p.scale;
                p.dv[r * D + lane + 32 * e] = __float2bfloat16_rn(av[e]);
            }
        __syncwarp();
        store_grad_row(kw, p.dk + r * D, p.rope, j - bos, D, lane);
    }
}

/* ---------------------------------------------------------------- host side */

/* Per-context state (slot LM_SLOT_ATTENTION): the document / block tables (device copy
 * and the host copy it was made from, so an unchanged table is not uploaded again) and
 * the RoPE (cos, sin) table for positions 0 .. rope_len-1. */
struct AttnState {
    int *tab = nullptr;
    size_t tab_cap = 0; /* ints */
    std::vector<int> tab_host;
    float2 *rope = nullptr;
    int64_t rope_len = 0, rope_cap = 0;
    int rope_D = 0;
    double rope_theta = 0.0;
    lm_attn_cudnn *cudnn = nullptr; /* cuDNN handle and plans (attention_cudnn.cu) */
    int impl = LM_CUDA_ATTN_AUTO, last_impl = 0, bwd_impl = LM_CUDA_ATTN_AUTO, last_bwd_impl = 0;
    int64_t cudnn_ws_limit = (int64_t)2 << 30; /* deterministic backward, bytes per call */
    int dec_occ[2] = {0, 0}; /* decode CTAs per SM, D = 64 / 128 (0: not yet asked) */
    ~AttnState() {
        lm_attn_cudnn_destroy(cudnn);
        if (tab)
            cudaFree(tab);
        if (rope)
            cudaFree(rope);
    }
};

/* One cuDNN call over packed documents: b batch entries (the documents, padded with empty
 * entries up to a bucket so that few plans serve changing document sets) of at most s tokens;
 * int indices into AttnState::tab of its seq_len (int32 [b]) and offset tables (int64
 * [b + 1]: q / o / dq / do elements, k / v / dk / dv elements, lse elements). */
struct CuGroup {
    int b = 0, s = 0, seq = 0, offq = 0, offk = 0, offs = 0;
};

/* The tables of one configuration, as offsets into AttnState::tab. */
struct Plan {
    int N = 0, nfwd = 0, nbwd = 0, nqb = 0, ncu = 0;
    int64_t maxlen = 0;
    const int4 *fwd = nullptr, *bwd = nullptr;
    const int *cu = nullptr;
    std::vector<CuGroup> cfwd, cbwd; /* packed documents: the cuDNN calls */
};

/* cuDNN shape buckets: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and
 * 1.5 times them) >= n, at least lo. At most 1.5x padding, few distinct plans. */
int64_t bucket(int64_t n, int64_t lo) {
    int64_t p = 1;
    while (p < n && p < ((int64_t)1 << 40)) {
        if (p >= 2 && p + p / 2 >= n)
            return std::max(p + p / 2, lo);
        p *= 2;
    }
    return std::max(p, lo);
}

/* Packed documents: pad each cuDNN call's batch with empty (length 0) entries up to the
 * bucket of the document count (false: the exact count, one plan per distinct count). */
constexpr bool kPadBatch = true;
int64_t batch_bucket(int64_t n) { return kPadBatch ? bucket(n, 1) : n; }

/* The deterministic cuDNN backward keeps dS (b * hq * s * s bf16, s to the 128-row tile) in
 * its workspace: the estimate that sizes batch chunks and document groups. */
double det_ws_estimate(int64_t b, int64_t Hq, int64_t s) {
    const double sp = (double)((s + 127) / 128 * 128);
    return (double)b * (double)Hq * sp * sp * 2.0;
}

/* The head dims of the FlashAttention-2 kernels, the decode step and the cuDNN path. */
bool std_head_dim(int D) { return D == 64 || D == 128; }

lm_status check_config(lm_attention_config *c, const char *what, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: %s: config is required", what);
    const char *dn[] = {"B", "T", "Hq", "Hkv", "D"};
    const int dv[] = {c->B, c->T, c->Hq, c->Hkv, c->D};
    for (int i = 0; i < 5; i++)
        if (dv[i] < 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention cuda: %s: dimension %s = %d must be >= 1", what, dn[i],
                             dv[i]);
    if (c->Hq % c->Hkv != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: Hq = %d query heads is not a multiple of Hkv = %d "
                         "kv heads",
                         what, c->Hq, c->Hkv);
    if ((int64_t)c->B * c->T >= ((int64_t)1 << 31))
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: %s: B*T = %lld tokens (< 2^31)",
                         what, (long long)c->B * c->T);
    if ((int64_t)c->B * c->T * c->Hq * c->D > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: problem too large (B*T*Hq*D > 2^40)", what);
    if (c->causal != 1)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cuda: %s: causal = %d: only causal attention (causal = 1) is "
                         "implemented",
                         what, c->causal);
    if (!isfinite(c->scale))
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: %s: scale = %g is not finite", what,
                         (double)c->scale);
    if (c->position != LM_POS_NOPE && c->position != LM_POS_ROPE)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: unknown position encoding %d (NOPE = 0, ROPE = 1)",
                         what, (int)c->position);
    if (c->position == LM_POS_ROPE && !(isfinite(c->rope_theta) && c->rope_theta > 0.0))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: rope_theta = %g must be finite and > 0", what,
                         c->rope_theta);
    if (c->D > ATTN_DMAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention on cuda: head_dim %d is not supported (at most %d)", c->D,
                         ATTN_DMAX);
    if (c->position == LM_POS_ROPE && c->D % 2 != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: head_dim D = %d must be even with RoPE (pairs f, "
                         "f + D/2)",
                         what, c->D);
    if (c->cu_seqlens) {
        if (c->B != 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention cuda: %s: cu_seqlens needs B == 1 (packed), got B = %d",
                             what, c->B);
        if (c->n_cu_seqlens < 2)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention cuda: %s: cu_seqlens has %d entries (need >= 2)", what,
                             c->n_cu_seqlens);
        if (c->cu_seqlens[0] != 0)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention cuda: %s: cu_seqlens[0] = %lld (must be 0)", what,
                             (long long)c->cu_seqlens[0]);
        for (int i = 1; i < c->n_cu_seqlens; i++)
            if (c->cu_seqlens[i] < c->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "attention cuda: %s: cu_seqlens decreases at index %d (%lld < "
                                 "%lld)",
                                 what, i, (long long)c->cu_seqlens[i],
                                 (long long)c->cu_seqlens[i - 1]);
        if (c->cu_seqlens[c->n_cu_seqlens - 1] != c->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention cuda: %s: cu_seqlens ends at %lld, not at T = %d", what,
                             (long long)c->cu_seqlens[c->n_cu_seqlens - 1], c->T);
        c->N = c->n_cu_seqlens - 1;
    } else {
        c->N = c->B;
    }
    return LM_OK;
}

lm_status check_ptrs(const void *const *ptrs, const char *const *names, int n, const char *what,
                     lm_error *err) {
    for (int i = 0; i < n; i++) {
        if (!ptrs[i])
            return lm_errorf(err, LM_ERR_INVALID, "attention cuda: %s: '%s' is required", what,
                             names[i]);
        if ((uintptr_t)ptrs[i] % 16 != 0)
            return lm_errorf(err, LM_ERR_INVALID,
                             "attention cuda: %s: '%s' (%p) is not 16-byte aligned", what, names[i],
                             ptrs[i]);
    }
    return LM_OK;
}

/* Builds the tables of c (documents from cu_seqlens or the B rows) and uploads them
 * unless the device copy already holds exactly these:
 *   fwd  per 128-query block (first token, length, q0, 0), heaviest (largest q0) first;
 *   bwd  per 64-key block (first token, length, block jl, first 64-query block of the
 *        document in the lock table), by jl ascending: a block's predecessor in the dQ
 *        order always has a smaller index, hence a smaller ticket;
 *   cu   document starts as int32 [N+1] (positions for RoPE). */
lm_status make_plan(lm_cuda_ctx *ctx, AttnState *st, const lm_attention_config *c, Plan *pl,
                    lm_error *err) {
    const int N = c->N;
    std::vector<int> bos(N), len(N), qbase(N);
    int64_t maxlen = 0;
    int nqb = 0;
    for (int n = 0; n < N; n++) {
        bos[n] = c->cu_seqlens ? (int)c->cu_seqlens[n] : n * c->T;
        len[n] = c->cu_seqlens ? (int)(c->cu_seqlens[n + 1] - c->cu_seqlens[n]) : c->T;
        qbase[n] = nqb;
        nqb += (len[n] + B_BM - 1) / B_BM;
        maxlen = len[n] > maxlen ? len[n] : maxlen;
    }
    std::vector<int> h;
    const int fmax = (int)((maxlen + F_BM - 1) / F_BM), bmax = (int)((maxlen + B_BN - 1) / B_BN);
    int nf = 0, nb = 0;
    for (int b = fmax - 1; b >= 0; b--)
        for (int n = 0; n < N; n++)
            if (b * F_BM < len[n]) {
                h.insert(h.end(), {bos[n], len[n], b * F_BM, 0});
                nf++;
            }
    for (int j = 0; j < bmax; j++)
        for (int n = 0; n < N; n++)
            if (j * B_BN < len[n]) {
                h.insert(h.end(), {bos[n], len[n], j, qbase[n]});
                nb++;
            }
    const size_t cu_off = h.size();
    for (int n = 0; n < N; n++)
        h.push_back(bos[n]);
    h.push_back(N > 0 ? bos[N - 1] + len[N - 1] : 0);
    while (h.size() % 4)
        h.push_back(0);
    if (c->cu_seqlens) {
        /* the cuDNN calls: the non-empty documents, longest first; the forward and the
         * atomic backward in one call, the deterministic backward in groups whose estimated
         * workspace fits the limit (a group of one document always runs) */
        std::vector<int> docs;
        for (int n = 0; n < N; n++)
            if (len[n] > 0)
                docs.push_back(n);
        std::stable_sort(docs.begin(), docs.end(), [&](int a, int b) { return len[a] > len[b]; });
        const int64_t tot = N > 0 ? bos[N - 1] + len[N - 1] : 0;
        auto add_group = [&](size_t first, size_t count) {
            CuGroup g;
            g.b = (int)batch_bucket((int64_t)count);
            g.s = (int)bucket(len[docs[first]], 64);
            auto align4 = [&]() {
                while (h.size() % 4)
                    h.push_back(0);
            };
            auto push64 = [&](int64_t x) {
                h.push_back((int)(uint32_t)(uint64_t)x);
                h.push_back((int)(uint32_t)((uint64_t)x >> 32));
            };
            align4();
            g.seq = (int)h.size();
            for (int i = 0; i < g.b; i++)
                h.push_back(i < (int)count ? len[docs[first + i]] : 0);
            const int64_t mul[3] = {(int64_t)c->Hq * c->D, (int64_t)c->Hkv * c->D, c->Hq};
            int *at[3] = {&g.offq, &g.offk, &g.offs};
            for (int t = 0; t < 3; t++) {
                align4();
                *at[t] = (int)h.size();
                for (int i = 0; i <= g.b; i++)
                    push64((i < (int)count ? bos[docs[first + i]] : tot) * mul[t]);
            }
            return g;
        };
        if (!docs.empty()) {
            pl->cfwd.push_back(add_group(0, docs.size()));
            if (!ctx->deterministic) {
                pl->cbwd = pl->cfwd;
            } else {
                const double lim = (double)st->cudnn_ws_limit;
                for (size_t i = 0; i < docs.size();) {
                    const int64_t sg = bucket(len[docs[i]], 64);
                    size_t n = 1;
                    while (i + n < docs.size() &&
                           det_ws_estimate(batch_bucket((int64_t)n + 1), c->Hq, sg) <= lim)
                        n++;
                    pl->cbwd.push_back(add_group(i, n));
                    i += n;
                }
            }
        }
        while (h.size() % 4)
            h.push_back(0);
    }
    if (h.size() > st->tab_cap) {
        if (st->tab)
            lm_cuda_ctx_free_mem(ctx, st->tab);
        st->tab = nullptr;
        st->tab_cap = 0;
        st->tab_host.clear();
        const size_t cap = h.size() + h.size() / 2 + 64;
        void *p = nullptr;
        LM_TRY(lm_cuda_ctx_alloc(ctx, &p, cap * sizeof(int), err));
        st->tab = (int *)p;
        st->tab_cap = cap;
    }
    if (st->tab_host != h) {
        LM_TRY(lm_cuda_ctx_upload(ctx, st->tab, h.data(), h.size() * sizeof(int), err));
        st->tab_host = h;
    }
    pl->N = N;
    pl->nfwd = nf;
    pl->nbwd = nb;
    pl->nqb = nqb;
    pl->maxlen = maxlen;
    pl->fwd = reinterpret_cast<const int4 *>(st->tab);
    pl->bwd = reinterpret_cast<const int4 *>(st->tab) + nf;
    pl->cu = st->tab + cu_off;
    pl->ncu = N + 1;
    return LM_OK;
}

/* The (cos, sin) table for positions 0 .. len-1 of (D, theta), rebuilt when D or theta
 * change and grown (to twice the length) when a longer one is needed. */
lm_status rope_table(lm_cuda_ctx *ctx, AttnState *st, int D, double theta, int64_t len,
                     lm_error *err) {
    if (st->rope && st->rope_D == D && st->rope_theta == theta && st->rope_len >= len)
        return LM_OK;
    int64_t want = len > 1024 ? len : 1024;
    if (st->rope && st->rope_D == D && st->rope_theta == theta && want < 2 * st->rope_len)
        want = 2 * st->rope_len;
    const int H2 = D / 2;
    if (want * H2 > st->rope_cap) {
        if (st->rope)
            lm_cuda_ctx_free_mem(ctx, st->rope);
        st->rope = nullptr;
        st->rope_cap = 0;
        st->rope_len = 0;
        void *p = nullptr;
        LM_TRY(lm_cuda_ctx_alloc(ctx, &p, (size_t)(want * H2) * sizeof(float2), err));
        st->rope = (float2 *)p;
        st->rope_cap = want * H2;
    }
    InvFreq inv;
    memset(&inv, 0, sizeof inv);
    for (int f = 0; f < H2; f++)
        inv.v[f] = pow(theta, -2.0 * f / (double)D);
    attn_rope_table<<<lm_cuda_grid(ctx, want * H2), 256, 0, ctx->stream>>>(st->rope, inv, H2, want);
    LM_CK_LAUNCH("attn_rope_table");
    st->rope_len = want;
    st->rope_D = D;
    st->rope_theta = theta;
    return LM_OK;
}

template <typename K> lm_status opt_in_smem(lm_cuda_ctx *ctx, K kernel, int bytes, lm_error *err) {
    if (bytes > 48 * 1024 && lm_cuda_ctx_first_use(ctx, (const void *)kernel))
        LM_CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return LM_OK;
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

lm_status launch_rope(lm_cuda_ctx *ctx, const Plan &pl, const AttnState *st, const void *x, void *y,
                      int H, int D, int64_t tokens, int inverse, lm_error *err) {
    const int64_t rows = tokens * H;
    if (D % 4 != 0) {
        attn_rope_pairs<<<lm_cuda_grid(ctx, rows * (D / 2)), 256, 0, ctx->stream>>>(
            (const bf16 *)x, (bf16 *)y, st->rope, pl.cu, pl.ncu, H, D, rows, inverse);
        LM_CK_LAUNCH("attn_rope_pairs");
        return LM_OK;
    }
    attn_rope<<<lm_cuda_grid(ctx, rows * (D / 4)), 256, 0, ctx->stream>>>(
        (const bf16 *)x, (bf16 *)y, st->rope, pl.cu, pl.ncu, H, D, rows, inverse);
    LM_CK_LAUNCH("attn_rope");
    return LM_OK;
}

/* With RoPE: q~, k~ (bf16, in scratch A) replace q, k. */
lm_status rotate_inputs(lm_cuda_ctx *ctx, AttnState *st, const lm_attention_config *c,
                        const Plan &pl, const void **q, const void **k, lm_error *err) {
    if (c->position != LM_POS_ROPE)
        return LM_OK;
    const int64_t BT = (int64_t)c->B * c->T;
    LM_TRY(rope_table(ctx, st, c->D, c->rope_theta, pl.maxlen, err));
    const size_t qb = align256((size_t)(BT * c->Hq * c->D) * 2);
    const size_t kb = align256((size_t)(BT * c->Hkv * c->D) * 2);
    void *buf = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, qb + kb, &buf, err));
    bf16 *qr = (bf16 *)buf, *kr = (bf16 *)((char *)buf + qb);
    LM_TRY(launch_rope(ctx, pl, st, *q, qr, c->Hq, c->D, BT, 0, err));
    LM_TRY(launch_rope(ctx, pl, st, *k, kr, c->Hkv, c->D, BT, 0, err));
    *q = qr;
    *k = kr;
    return LM_OK;
}

template <int D>
lm_status fwd_launch(lm_cuda_ctx *ctx, const lm_attention_config *c, const Plan &pl, const void *q,
                     const void *k, const void *v, void *o, float *lse, lm_error *err) {
    FwdP p;
    p.q = (const bf16 *)q;
    p.k = (const bf16 *)k;
    p.v = (const bf16 *)v;
    p.o = (bf16 *)o;
    p.lse = lse;
    p.tab = pl.fwd;
    p.Hq = c->Hq;
    p.Hkv = c->Hkv;
    p.grp = c->Hq / c->Hkv;
    p.scale_log2 = c->scale * LOG2E;
    LM_TRY(opt_in_smem(ctx, attn_fwd<D>, fwd_smem<D>(), err));
    if (pl.nfwd > 65535)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cuda: %d query blocks exceed the grid limit (65535)", pl.nfwd);
    attn_fwd<D><<<dim3(c->Hq, pl.nfwd), 128, fwd_smem<D>(), ctx->stream>>>(p);
    LM_CK_LAUNCH("attn_fwd");
    return LM_OK;
}

template <int D>
lm_status bwd_launch(lm_cuda_ctx *ctx, const lm_attention_config *c, const Plan &pl,
                     const AttnState *st, const void *q, const void *k, const void *v,
                     const void *o, const float *lse, const void *do_, void *dq, void *dk, void *dv,
                     lm_error *err) {
    const int64_t BT = (int64_t)c->B * c->T, rows = BT * c->Hq;
    const int rope = c->position == LM_POS_ROPE;
    const int atomic_mode = ctx->deterministic ? 0 : 1;
    void *acc = nullptr, *aux = nullptr;
    const size_t acc_b = (size_t)(rows * D) * sizeof(float);
    const size_t dl_b = align256((size_t)rows * sizeof(float));
    const size_t lk_b = ((size_t)c->Hq * pl.nqb + 1) * sizeof(int);
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_B, acc_b, &acc, err));
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_C, dl_b + lk_b, &aux, err));
    float *delta = (float *)aux;
    int *locks = (int *)((char *)aux + dl_b);
    LM_CK(cudaMemsetAsync(locks, 0, lk_b, ctx->stream));
    if (atomic_mode)
        LM_CK(cudaMemsetAsync(acc, 0, acc_b, ctx->stream));
    attn_delta<D><<<lm_cuda_grid(ctx, rows * (D / 8)), 256, 0, ctx->stream>>>(
        (const bf16 *)o, (const bf16 *)do_, delta, rows);
    LM_CK_LAUNCH("attn_delta");
    BwdP p;
    p.q = (const bf16 *)q;
    p.k = (const bf16 *)k;
    p.v = (const bf16 *)v;
    p.dO = (const bf16 *)do_;
    p.lse = lse;
    p.delta = delta;
    p.dqacc = (float *)acc;
    p.dk = (bf16 *)dk;
    p.dv = (bf16 *)dv;
    p.tab = pl.bwd;
    p.locks = locks;
    p.counter = (unsigned *)(locks + (size_t)c->Hq * pl.nqb);
    p.rope = rope ? st->rope : nullptr;
    p.Hq = c->Hq;
    p.Hkv = c->Hkv;
    p.grp = c->Hq / c->Hkv;
    p.nqb_total = pl.nqb;
    p.atomic_mode = atomic_mode;
    p.scale = c->scale;
    p.scale_log2 = c->scale * LOG2E;
    LM_TRY(opt_in_smem(ctx, attn_bwd<D>, bwd_smem<D>(), err));
    const int64_t nblk = (int64_t)pl.nbwd * c->Hkv;
    if (nblk > INT32_MAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "attention cuda: too many key blocks (%lld)",
                         (long long)nblk);
    attn_bwd<D><<<(unsigned)nblk, 128, bwd_smem<D>(), ctx->stream>>>(p);
    LM_CK_LAUNCH("attn_bwd");
    attn_dq_final<<<lm_cuda_grid(ctx, rows * (D / 4)), 256, 0, ctx->stream>>>(
        (const float *)acc, (bf16 *)dq, rope ? st->rope : nullptr, pl.cu, pl.ncu, c->Hq, D, rows,
        c->scale);
    LM_CK_LAUNCH("attn_dq_final");
    return LM_OK;
}

/* The simple kernels (any D <= ATTN_DMAX; q, k already rotated with RoPE): the forward,
 * and the backward as Delta (scratch C), dq, then dk / dv. No scratch beyond Delta. */
SmallP small_params(const lm_attention_config *c, const Plan &pl, const AttnState *st,
                    const void *q, const void *k, const void *v) {
    SmallP p;
    memset(&p, 0, sizeof p);
    p.q = (const bf16 *)q;
    p.k = (const bf16 *)k;
    p.v = (const bf16 *)v;
    p.rope = c->position == LM_POS_ROPE ? st->rope : nullptr;
    p.cu = pl.cu;
    p.ncu = pl.ncu;
    p.Hq = c->Hq;
    p.Hkv = c->Hkv;
    p.grp = c->Hq / c->Hkv;
    p.D = c->D;
    p.scale = c->scale;
    p.scale_log2 = c->scale * LOG2E;
    return p;
}

lm_status small_fwd_launch(lm_cuda_ctx *ctx, const lm_attention_config *c, const Plan &pl,
                           const AttnState *st, const void *q, const void *k, const void *v,
                           void *o, float *lse, lm_error *err) {
    SmallP p = small_params(c, pl, st, q, k, v);
    p.o_out = (bf16 *)o;
    p.lse = lse;
    p.rows = (int64_t)c->B * c->T * c->Hq;
    attn_small_fwd<<<lm_cuda_grid(ctx, p.rows, S_WARPS), S_WARPS * 32, 0, ctx->stream>>>(p);
    LM_CK_LAUNCH("attn_small_fwd");
    return LM_OK;
}

lm_status small_bwd_launch(lm_cuda_ctx *ctx, const lm_attention_config *c, const Plan &pl,
                           const AttnState *st, const void *q, const void *k, const void *v,
                           const void *o, const float *lse, const void *do_, void *dq, void *dk,
                           void *dv, lm_error *err) {
    const int64_t BT = (int64_t)c->B * c->T, qrows = BT * c->Hq, krows = BT * c->Hkv;
    void *dl = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_C, (size_t)qrows * sizeof(float), &dl, err));
    SmallP p = small_params(c, pl, st, q, k, v);
    p.o = (const bf16 *)o;
    p.dO = (const bf16 *)do_;
    p.lse_in = lse;
    p.delta = (const float *)dl;
    p.dq = (bf16 *)dq;
    p.dk = (bf16 *)dk;
    p.dv = (bf16 *)dv;
    p.rows = qrows;
    attn_small_delta<<<lm_cuda_grid(ctx, qrows, S_WARPS), S_WARPS * 32, 0, ctx->stream>>>(
        p, (float *)dl);
    LM_CK_LAUNCH("attn_small_delta");
    attn_small_dq<<<lm_cuda_grid(ctx, qrows, S_WARPS), S_WARPS * 32, 0, ctx->stream>>>(p);
    LM_CK_LAUNCH("attn_small_dq");
    p.rows = krows;
    attn_small_dkv<<<lm_cuda_grid(ctx, krows, S_WARPS), S_WARPS * 32, 0, ctx->stream>>>(p);
    LM_CK_LAUNCH("attn_small_dkv");
    return LM_OK;
}

template <int D>
lm_status decode_launch(lm_cuda_ctx *ctx, const lm_attention_config *c, AttnState *st, int64_t Tmax,
                        int64_t pos, const void *q, const void *kc, const void *vc, void *o,
                        float *lse, lm_error *err) {
    const int grp = c->Hq / c->Hkv, zdim = (grp + DEC_GH - 1) / DEC_GH;
    const int L = (int)(pos + 1);
    const int64_t base = (int64_t)c->B * c->Hkv * zdim;
    LM_TRY(opt_in_smem(ctx, attn_decode<D>, dec_smem<D>(), err));
    int &occ = st->dec_occ[D == 64 ? 0 : 1];
    if (occ == 0) {
        LM_CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, attn_decode<D>, DEC_W * 32,
                                                            dec_smem<D>()));
        occ = occ < 1 ? 1 : occ;
    }
    /* splits: the fewest whose CTAs fill the resident slots in whole waves to >= 85% (else
     * the best filling), each split a multiple of DEC_CHUNK rows */
    const int64_t res = (int64_t)occ * ctx->sm_count;
    const int64_t smax = (L + DEC_CHUNK - 1) / DEC_CHUNK;
    int64_t S = 1, chunk = (int64_t)smax * DEC_CHUNK;
    double best = -1.0;
    for (int64_t cand = 1; cand <= smax && cand <= 1024; cand++) {
        const int64_t per = (L + cand - 1) / cand;
        const int64_t ch = (per + DEC_CHUNK - 1) / DEC_CHUNK * DEC_CHUNK;
        const int64_t sc = (L + ch - 1) / ch, tot = base * sc;
        const double eff = (double)tot / (double)(((tot + res - 1) / res) * res);
        if (eff > best + 1e-9) {
            best = eff, S = sc, chunk = ch;
            if (eff >= 0.85)
                break;
        }
    }
    const int64_t BH = (int64_t)c->B * c->Hq;
    const size_t ml_b = align256((size_t)(BH * S * 2) * sizeof(float));
    void *buf = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_A, ml_b + (size_t)(BH * S * D) * sizeof(float), &buf,
                               err));
    DecP p;
    p.q = (const bf16 *)q;
    p.kc = (const bf16 *)kc;
    p.vc = (const bf16 *)vc;
    p.pml = (float *)buf;
    p.pacc = (float *)((char *)buf + ml_b);
    p.rope = c->position == LM_POS_ROPE ? st->rope : nullptr;
    p.Hq = c->Hq;
    p.Hkv = c->Hkv;
    p.grp = grp;
    p.S = (int)S;
    p.chunk = (int)chunk;
    p.L = L;
    p.pos = (int)pos;
    p.Tmax = Tmax;
    p.scale_log2 = c->scale * LOG2E;
    if (c->B * c->Hkv > 65535 || zdim > 65535)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cuda: decode: B*Hkv = %d exceeds the grid limit (65535)",
                         c->B * c->Hkv);
    attn_decode<D>
        <<<dim3((unsigned)S, c->B * c->Hkv, zdim), DEC_W * 32, dec_smem<D>(), ctx->stream>>>(p);
    LM_CK_LAUNCH("attn_decode");
    attn_decode_merge<<<(unsigned)BH, D / 2, 0, ctx->stream>>>(p.pml, p.pacc, (bf16 *)o, lse,
                                                               (int)S, D);
    LM_CK_LAUNCH("attn_decode_merge");
    return LM_OK;
}

/* ---------------------------------------------------------------- cuDNN drivers */

/* Fills the packed-document fields of io for group g. */
void io_group(lm_attn_cudnn_io *io, const AttnState *st, const CuGroup &g) {
    io->ragged = 1;
    io->b = g.b;
    io->s = g.s;
    io->seq_len = st->tab + g.seq;
    io->off_q = reinterpret_cast<const int64_t *>(st->tab + g.offq);
    io->off_k = reinterpret_cast<const int64_t *>(st->tab + g.offk);
    io->off_s = reinterpret_cast<const int64_t *>(st->tab + g.offs);
}

/* The forward through cuDNN: dense batches in one call (stats [B, Hq, T] in scratch C,
 * transposed into lse), packed documents in one ragged call that writes lse itself (through
 * scratch C when lse is NULL or not 16-byte aligned). */
lm_status cudnn_forward(lm_cuda_ctx *ctx, AttnState *st, const lm_attention_config *c,
                        const Plan &pl, const void *q, const void *k, const void *v, void *o,
                        float *lse, lm_error *err) {
    lm_attn_cudnn_io io;
    memset(&io, 0, sizeof io);
    io.Hq = c->Hq, io.Hkv = c->Hkv, io.D = c->D, io.scale = c->scale;
    io.q = q, io.k = k, io.v = v, io.o_out = o;
    const int64_t ns = (int64_t)c->B * c->T * c->Hq;
    if (!c->cu_seqlens) {
        void *stats = nullptr;
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_C, (size_t)ns * sizeof(float), &stats, err));
        io.b = c->B, io.s = c->T, io.stats = (float *)stats;
        LM_TRY(lm_attn_cudnn_forward(ctx, &st->cudnn, &io, err));
        if (lse) {
            attn_stats_to_lse<<<lm_cuda_grid(ctx, ns), 256, 0, ctx->stream>>>(io.stats, lse, c->T,
                                                                              c->Hq, ns);
            LM_CK_LAUNCH("attn_stats_to_lse");
        }
        return LM_OK;
    }
    if (pl.cfwd.empty())
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "attention cudnn: no non-empty document");
    io_group(&io, st, pl.cfwd[0]);
    const bool direct = lse && (uintptr_t)lse % 16 == 0;
    io.stats = lse;
    if (!direct) {
        void *stats = nullptr;
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_C, (size_t)ns * sizeof(float), &stats, err));
        io.stats = (float *)stats;
    }
    LM_TRY(lm_attn_cudnn_forward(ctx, &st->cudnn, &io, err));
    if (!direct && lse)
        LM_CK(cudaMemcpyAsync(lse, io.stats, (size_t)ns * sizeof(float), cudaMemcpyDeviceToDevice,
                              ctx->stream));
    return LM_OK;
}

/* The backward through cuDNN (q, k already rotated with RoPE; dq, dk rotated back here).
 * Dense batches: lse transposed into cuDNN's stats layout, the deterministic algorithm in
 * chunks of batch rows whose estimated workspace fits the limit (the largest divisor of B
 * that does). Packed documents: the groups of the plan, lse read in place. Scratch C holds
 * stats, rowsum(dO O), the fp32 dQ accumulator (atomic algorithm) and, packed GQA, the
 * per-query-head dK / dV; each packed buffer has 128 rows of slack past the last token. */
lm_status cudnn_backward(lm_cuda_ctx *ctx, AttnState *st, const lm_attention_config *c,
                         const Plan &pl, const void *q, const void *k, const void *v, const void *o,
                         const float *lse, const void *do_, void *dq, void *dk, void *dv,
                         lm_error *err) {
    const int det = ctx->deterministic ? 1 : 0;
    const int64_t B = c->B, T = c->T, Hq = c->Hq, Hkv = c->Hkv, D = c->D, BT = B * T;
    const bool packed = c->cu_seqlens != nullptr;
    if (!packed && T == 1)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cudnn: backward: T = 1 (s_q = s_kv = 1) is outside the fused "
                         "engine");
    if (packed && pl.cbwd.empty())
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "attention cudnn: no non-empty document");
    const int64_t rows = BT + (packed ? 128 : 0);
    const bool gqa_full = packed && Hq != Hkv;
    const bool lse_direct = packed && (uintptr_t)lse % 16 == 0;
    size_t off[6], tot = 0;
    const size_t want[6] = {lse_direct ? 0 : align256((size_t)(rows * Hq) * 4),
                            align256((size_t)(rows * Hq) * 4),
                            det ? 0 : align256((size_t)(rows * Hq * D) * 4),
                            gqa_full ? align256((size_t)(rows * Hq * D) * 2) : 0,
                            gqa_full ? align256((size_t)(rows * Hq * D) * 2) : 0,
                            0};
    for (int i = 0; i < 6; i++) {
        off[i] = tot;
        tot += want[i];
    }
    void *buf = nullptr;
    LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_C, tot, &buf, err));
    char *base = (char *)buf;
    float *stats = lse_direct ? (float *)lse : (float *)(base + off[0]);
    float *dsum = (float *)(base + off[1]);
    float *acc = det ? nullptr : (float *)(base + off[2]);
    void *dkf = gqa_full ? base + off[3] : nullptr, *dvf = gqa_full ? base + off[4] : nullptr;
    const int64_t nl = BT * Hq;
    if (!packed) {
        attn_lse_to_stats<<<lm_cuda_grid(ctx, nl), 256, 0, ctx->stream>>>(lse, stats, (int)T,
                                                                          (int)Hq, nl);
        LM_CK_LAUNCH("attn_lse_to_stats");
    } else if (!lse_direct) {
        LM_CK(cudaMemcpyAsync(stats, lse, (size_t)nl * sizeof(float), cudaMemcpyDeviceToDevice,
                              ctx->stream));
    }
    if (acc)
        LM_CK(cudaMemsetAsync(acc, 0, want[2], ctx->stream));
    lm_attn_cudnn_io io;
    memset(&io, 0, sizeof io);
    io.Hq = (int)Hq, io.Hkv = (int)Hkv, io.D = (int)D, io.det = det, io.scale = c->scale;
    io.dsum = dsum, io.dq_acc = acc, io.dk_full = dkf, io.dv_full = dvf;
    if (packed) {
        io.q = q, io.k = k, io.v = v, io.o = o, io.dO = do_, io.stats = stats;
        io.dq = dq, io.dk = dk, io.dv = dv;
        for (const CuGroup &g : pl.cbwd) {
            io_group(&io, st, g);
            LM_TRY(lm_attn_cudnn_backward(ctx, &st->cudnn, &io, err));
        }
    } else {
        int64_t bc = B;
        if (det)
            for (bc = B; bc > 1; bc--)
                if (B % bc == 0 && det_ws_estimate(bc, Hq, T) <= (double)st->cudnn_ws_limit)
                    break;
        io.s = (int)T, io.b = (int)bc;
        for (int64_t b0 = 0; b0 < B; b0 += bc) {
            const int64_t eq = b0 * T * Hq * D, ek = b0 * T * Hkv * D, es = b0 * Hq * T;
            io.q = (const bf16 *)q + eq, io.k = (const bf16 *)k + ek, io.v = (const bf16 *)v + ek;
            io.o = (const bf16 *)o + eq, io.dO = (const bf16 *)do_ + eq;
            io.dq = (bf16 *)dq + eq, io.dk = (bf16 *)dk + ek, io.dv = (bf16 *)dv + ek;
            io.stats = stats + es, io.dsum = dsum + es;
            LM_TRY(lm_attn_cudnn_backward(ctx, &st->cudnn, &io, err));
        }
    }
    if (c->position == LM_POS_ROPE) { /* gradients w.r.t. the un-rotated q, k */
        LM_TRY(launch_rope(ctx, pl, st, dq, dq, c->Hq, c->D, BT, 1, err));
        LM_TRY(launch_rope(ctx, pl, st, dk, dk, c->Hkv, c->D, BT, 1, err));
    }
    return LM_OK;
}

bool known_impl(int impl) {
    return impl == LM_CUDA_ATTN_AUTO || impl == LM_CUDA_ATTN_OWN || impl == LM_CUDA_ATTN_CUDNN ||
           impl == LM_CUDA_ATTN_SIMPLE;
}

/* AUTO: a refusal (or a failed cuDNN allocation) is not an error, our kernels run */
bool cudnn_may_fall_back(lm_status s, int impl, lm_error *err) {
    if (impl == LM_CUDA_ATTN_CUDNN || (s != LM_ERR_UNSUPPORTED && s != LM_ERR_NOMEM))
        return false;
    if (err) {
        err->status = LM_OK;
        err->msg[0] = '\0';
    }
    return true;
}

lm_status check_cache(lm_attention_config *c, int64_t Tmax, int64_t pos, int64_t need,
                      const char *what, lm_error *err) {
    LM_TRY(check_config(c, what, err));
    if (!std_head_dim(c->D))
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention on cuda: %s: head_dim %d is not supported (64 or 128; the "
                         "general kernels cover the forward and backward only)",
                         what, c->D);
    if (c->cu_seqlens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: cu_seqlens must be NULL (one position per batch "
                         "row)",
                         what);
    if (Tmax < 1 || Tmax >= ((int64_t)1 << 31))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: Tmax = %lld must be in [1, 2^31)", what,
                         (long long)Tmax);
    if (pos < 0 || pos > Tmax - need)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: pos = %lld with %lld token(s) does not fit a cache "
                         "of Tmax = %lld positions",
                         what, (long long)pos, (long long)need, (long long)Tmax);
    if ((int64_t)c->B * Tmax * c->Hkv * c->D > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: %s: cache too large (B*Tmax*Hkv*D > 2^40)", what);
    return LM_OK;
}

} // namespace

/* ---------------------------------------------------------------- entry points */

extern "C" lm_status lm_cuda_attention_forward(lm_cuda_ctx *ctx, lm_attention_config *c,
                                               const void *q, const void *k, const void *v, void *o,
                                               float *lse, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_config(c, "forward", err));
    const void *ptrs[] = {q, k, v, o};
    const char *names[] = {"q", "k", "v", "o"};
    LM_TRY(check_ptrs(ptrs, names, 4, "forward", err));
    if ((uintptr_t)lse % 4 != 0)
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: forward: 'lse' (%p) is misaligned",
                         (void *)lse);
    AttnState *st = lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION);
    if (st->impl == LM_CUDA_ATTN_CUDNN && !std_head_dim(c->D))
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cudnn: forward: head_dim %d is outside the cuDNN path (64 or "
                         "128)",
                         c->D);
    Plan pl;
    LM_TRY(make_plan(ctx, st, c, &pl, err));
    LM_TRY(rotate_inputs(ctx, st, c, pl, &q, &k, err));
    if (st->impl == LM_CUDA_ATTN_SIMPLE || !std_head_dim(c->D)) {
        st->last_impl = LM_CUDA_ATTN_SIMPLE;
        return small_fwd_launch(ctx, c, pl, st, q, k, v, o, lse, err);
    }
    if (st->impl != LM_CUDA_ATTN_OWN) {
        const lm_status s = cudnn_forward(ctx, st, c, pl, q, k, v, o, lse, err);
        if (s == LM_OK)
            st->last_impl = LM_CUDA_ATTN_CUDNN;
        if (s == LM_OK || !cudnn_may_fall_back(s, st->impl, err))
            return s;
    }
    st->last_impl = LM_CUDA_ATTN_OWN;
    if (c->D == 64)
        return fwd_launch<64>(ctx, c, pl, q, k, v, o, lse, err);
    return fwd_launch<128>(ctx, c, pl, q, k, v, o, lse, err);
}

extern "C" lm_status lm_cuda_attention_set_impl(lm_cuda_ctx *ctx, int impl, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!known_impl(impl))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: set_impl: unknown implementation %d (AUTO 0, OWN 1, "
                         "CUDNN 2, SIMPLE 3)",
                         impl);
    lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION)->impl = impl;
    return LM_OK;
}

extern "C" int lm_cuda_attention_last_impl(lm_cuda_ctx *ctx) {
    if (!ctx)
        return 0;
    return lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION)->last_impl;
}

extern "C" lm_status lm_cuda_attention_backward(lm_cuda_ctx *ctx, lm_attention_config *c,
                                                const void *q, const void *k, const void *v,
                                                const void *o, const float *lse, const void *do_,
                                                void *dq, void *dk, void *dv, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(check_config(c, "backward", err));
    const void *ptrs[] = {q, k, v, o, do_, dq, dk, dv};
    const char *names[] = {"q", "k", "v", "o", "do", "dq", "dk", "dv"};
    LM_TRY(check_ptrs(ptrs, names, 8, "backward", err));
    if (!lse || (uintptr_t)lse % 4 != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: backward: 'lse' (%p) is required (4-byte aligned)",
                         (const void *)lse);
    AttnState *st = lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION);
    if (st->bwd_impl == LM_CUDA_ATTN_CUDNN && !std_head_dim(c->D))
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cudnn: backward: head_dim %d is outside the cuDNN path (64 or "
                         "128)",
                         c->D);
    Plan pl;
    LM_TRY(make_plan(ctx, st, c, &pl, err));
    LM_TRY(rotate_inputs(ctx, st, c, pl, &q, &k, err));
    if (st->bwd_impl == LM_CUDA_ATTN_SIMPLE || !std_head_dim(c->D)) {
        st->last_bwd_impl = LM_CUDA_ATTN_SIMPLE;
        return small_bwd_launch(ctx, c, pl, st, q, k, v, o, lse, do_, dq, dk, dv, err);
    }
    if (st->bwd_impl != LM_CUDA_ATTN_OWN) {
        const lm_status s = cudnn_backward(ctx, st, c, pl, q, k, v, o, lse, do_, dq, dk, dv, err);
        if (s == LM_OK)
            st->last_bwd_impl = LM_CUDA_ATTN_CUDNN;
        if (s == LM_OK || !cudnn_may_fall_back(s, st->bwd_impl, err))
            return s;
    }
    st->last_bwd_impl = LM_CUDA_ATTN_OWN;
    if (c->D == 64)
        return bwd_launch<64>(ctx, c, pl, st, q, k, v, o, lse, do_, dq, dk, dv, err);
    return bwd_launch<128>(ctx, c, pl, st, q, k, v, o, lse, do_, dq, dk, dv, err);
}

extern "C" lm_status lm_cuda_attention_set_bwd_impl(lm_cuda_ctx *ctx, int impl, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!known_impl(impl))
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: set_bwd_impl: unknown implementation %d (AUTO 0, OWN "
                         "1, CUDNN 2, SIMPLE 3)",
                         impl);
    lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION)->bwd_impl = impl;
    return LM_OK;
}

extern "C" int lm_cuda_attention_last_bwd_impl(lm_cuda_ctx *ctx) {
    if (!ctx)
        return 0;
    return lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION)->last_bwd_impl;
}

extern "C" lm_status lm_cuda_attention_set_cudnn_workspace_limit(lm_cuda_ctx *ctx, int64_t bytes,
                                                                 lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (bytes < 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: set_cudnn_workspace_limit: bytes = %lld must be >= 0",
                         (long long)bytes);
    lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION)->cudnn_ws_limit = bytes;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attention_rope(lm_cuda_ctx *ctx, lm_attention_config *c, int H,
                                            const void *x, void *y, int inverse, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: rope: config is required");
    lm_attention_config cc = *c;
    cc.position = LM_POS_ROPE;
    LM_TRY(check_config(&cc, "rope", err));
    c->N = cc.N;
    if (H < 1)
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: rope: H = %d must be >= 1", H);
    const void *ptrs[] = {x, y};
    const char *names[] = {"x", "y"};
    LM_TRY(check_ptrs(ptrs, names, 2, "rope", err));
    AttnState *st = lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION);
    Plan pl;
    LM_TRY(make_plan(ctx, st, &cc, &pl, err));
    LM_TRY(rope_table(ctx, st, cc.D, cc.rope_theta, pl.maxlen, err));
    return launch_rope(ctx, pl, st, x, y, H, cc.D, (int64_t)cc.B * cc.T, inverse ? 1 : 0, err);
}

extern "C" lm_status lm_cuda_attention_cache_write(lm_cuda_ctx *ctx, lm_attention_config *c,
                                                   int64_t Tmax, int64_t pos, const void *k,
                                                   const void *v, void *k_cache, void *v_cache,
                                                   lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: cache_write: config is required");
    LM_TRY(check_cache(c, Tmax, pos, c->T, "cache_write", err));
    const void *ptrs[] = {k, v, k_cache, v_cache};
    const char *names[] = {"k", "v", "k_cache", "v_cache"};
    LM_TRY(check_ptrs(ptrs, names, 4, "cache_write", err));
    AttnState *st = lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION);
    const int rope = c->position == LM_POS_ROPE;
    if (rope)
        LM_TRY(rope_table(ctx, st, c->D, c->rope_theta, pos + c->T, err));
    const int64_t rows = (int64_t)c->B * c->T * c->Hkv;
    attn_cache_write<<<lm_cuda_grid(ctx, rows * (c->D / 2)), 256, 0, ctx->stream>>>(
        (const bf16 *)k, (const bf16 *)v, (bf16 *)k_cache, (bf16 *)v_cache,
        rope ? st->rope : nullptr, c->T, c->Hkv, c->D, Tmax, pos, rows);
    LM_CK_LAUNCH("attn_cache_write");
    return LM_OK;
}

extern "C" lm_status lm_cuda_attention_decode(lm_cuda_ctx *ctx, lm_attention_config *c,
                                              int64_t Tmax, int64_t pos, const void *q,
                                              const void *k_cache, const void *v_cache, void *o,
                                              float *lse, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "attention cuda: decode: config is required");
    if (c->T != 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "attention cuda: decode: T = %d (a decode step takes one token, q "
                         "[B,1,Hq,D])",
                         c->T);
    LM_TRY(check_cache(c, Tmax, pos, 1, "decode", err));
    const void *ptrs[] = {q, k_cache, v_cache, o};
    const char *names[] = {"q", "k_cache", "v_cache", "o"};
    LM_TRY(check_ptrs(ptrs, names, 4, "decode", err));
    AttnState *st = lm_cuda_ctx_get<AttnState>(ctx, LM_SLOT_ATTENTION);
    if (c->position == LM_POS_ROPE)
        LM_TRY(rope_table(ctx, st, c->D, c->rope_theta, pos + 1, err));
    if (c->D == 64)
        return decode_launch<64>(ctx, c, st, Tmax, pos, q, k_cache, v_cache, o, lse, err);
    return decode_launch<128>(ctx, c, st, Tmax, pos, q, k_cache, v_cache, o, lse, err);
}
