/* MoE experts on the GPU (include/linmoe/cuda_moe.h): the stable counting-sort
 * permutation, the grouped GEMMs (wgmma, warp-specialised, persistent, in two variants:
 * v0 loads every operand with cp.async and runs the epilogue from the accumulators, v1
 * loads the contiguous operands with the tensor copy engine and stores through shared
 * memory; and a plain reference kernel with the same tiles and epilogues), the fused
 * SwiGLU forward / backward epilogues, the combine / dx gathers and the dtopk_weight dot
 * products, and the forward / backward orchestration. Math and layouts: the header. */
#include <cuda.h> /* CUtensorMap (the driver entry point is fetched at run time) */
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "linmoe/cuda_moe.h"
#include "ops/cuda/ctx.cuh"
#include "ops/cuda/ptx.cuh"

typedef __nv_bfloat16 bf16;

namespace {

/* ---------------------------------------------------------------- constants */

constexpr int BM = 128;              /* GEMM tile rows (two consumer warpgroups of 64) */
constexpr int BN = 256;              /* GEMM tile columns (one m64n256 wgmma per k16) */
constexpr int BK = 64;               /* K per stage: one 128-byte swizzled row */
constexpr int NS = 4;                /* pipeline stages */
constexpr int A_BYTES = BM * BK * 2; /* 16 KiB */
constexpr int B_BYTES = BN * BK * 2; /* 32 KiB */
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int WG_THREADS = 384; /* producer warpgroup + two consumer warpgroups */
constexpr int WG_SMEM = NS * STAGE_BYTES + 1024 /* alignment slack */ + 2 * NS * 8;
constexpr int V1_STG = 16384; /* v1: epilogue staging per consumer warpgroup (64 x 128 bf16
                                 or 64 x 64 fp32) */
constexpr int V1_SMEM = NS * STAGE_BYTES + 2 * V1_STG + 1024 + 2 * NS * 8;
static_assert(V1_SMEM <= 232448, "v1 shared memory exceeds the sm_90 opt-in limit");
constexpr int SIMPLE_THREADS = 256;
constexpr int SIMPLE_BK = 16;
constexpr int SIMPLE_SMEM = BM * BN * 4; /* the fp32 C tile of the reference kernel */
constexpr int CH = 4096;                 /* assignments per permutation chunk */
constexpr int MAX_E = 1024;
constexpr int MAX_K = 32;

/* Products (the operand layouts they imply are in the loaders below). Per group g with
 * m_g rows starting at sorted row seg (routed: an expert's segment; shared: all tokens):
 *   GATEUP  [g|u] = X Wgu^T      M = m_g, N = 2F (tile: 128 gate + the same 128 up), K = D
 *   DOWN    Y = A Wd^T           M = m_g, N = D, K = F
 *   DDOWN   dH = dswiglu(dY Wd)  M = m_g, N = F, K = D
 *   DGATEUP dX = dH [Wg; Wu]     M = m_g, N = D, K = 2F
 *   WDOWN   dWd += dY^T A        M = D, N = F, K = m_g
 *   WGATEUP [dWg; dWu] += dH^T X M = 2F, N = D, K = m_g */
enum { K_GATEUP = 0, K_DOWN = 1, K_DDOWN = 2, K_DGATEUP = 3, K_WDOWN = 4, K_WGATEUP = 5 };

struct GArgs {
    const int *seg_off;  /* [G+1] first sorted row of each group */
    const int *seg_cnt;  /* [G] rows of each group (NULL: seg_off[g+1] - seg_off[g]) */
    const int *tile_off; /* [G+1] first 128-row tile of each group (GATEUP .. DGATEUP) */
    int G, D, F;
    int pad;         /* 1: each group's rows are padded to a multiple of BM in the sorted buffers
                        (routed experts): the M-direction epilogues also write the padding rows
                        (zeros, from zero-filled operands), and the K direction of the weight
                        gradients may read them; 0: the group's rows end the tensor (shared) */
    const bf16 *X;   /* x [T, D] */
    const int *xrow; /* [rows] sorted row -> token (NULL: identity) */
    const bf16 *Wg, *Wu, *Wd;
    bf16 *H;        /* [rows, 2F] [g | u] (GATEUP writes when non-NULL, DDOWN reads) */
    bf16 *A;        /* [rows, F] silu(g) u */
    bf16 *Y;        /* [rows, D] DOWN output */
    const bf16 *dY; /* [rows, D] upstream gradient rows (w dy sorted, or dy) */
    bf16 *dH;       /* [rows, 2F] */
    bf16 *dX;       /* [rows, D] */
    float *dWg, *dWu, *dWd;
};

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

template <int KIND> constexpr bool GK = KIND >= K_WDOWN;        /* K runs over a group's tokens */
template <int KIND> constexpr int TA = KIND >= K_WDOWN ? 1 : 0; /* A stored MN-major */
template <int KIND> constexpr int TB = KIND >= K_DDOWN ? 1 : 0; /* B stored MN-major */

template <int KIND> __host__ __device__ inline int n_tiles_n(int D, int F) {
    if (KIND == K_GATEUP)
        return cdiv(F, 128);
    return cdiv((KIND == K_DDOWN || KIND == K_WDOWN) ? F : D, BN);
}
template <int KIND> __host__ __device__ inline int m_tiles_gk(int D, int F) {
    return cdiv(KIND == K_WDOWN ? D : 2 * F, BM);
}

/* ---------------------------------------------------------------- PTX helpers */

/* 16 bytes global -> shared, or 16 zero bytes (nothing read) when !valid */
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ bool mbar_try(uint64_t *bar, uint32_t parity) {
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
    return ok != 0;
}
/* Wait for the phase of `parity` to complete. A handshake bug would hang the GPU: after
 * 2^24 failed tries (seconds; a real wait here lasts microseconds) the kernel traps, so
 * the next synchronising call reports a launch failure instead. */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t n = 0;
    while (!mbar_try(bar, parity))
        if (++n == (1u << 24))
            __trap();
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
/* wgmma shared-memory descriptor (PTX ISA "Matrix Descriptor Format"), 128-byte swizzle:
 * start address, leading-dimension byte offset, stride-dimension byte offset (all >> 4).
 * K-major tile (rows of 64 K values, 128 B): LBO unused (16), SBO = 1024 (8-row groups).
 * MN-major tile (blocks of [64 K rows][64 MN values]): LBO = the 64-wide MN block stride,
 * SBO = 1024 (8 K rows). */
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | ((uint64_t)1 << 62);
}

#define WG_D128_REGS                                                                               \
    "{"                                                                                            \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "             \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "             \
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "             \
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "             \
    "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "             \
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, "             \
    "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "           \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, "         \
    "%126, %127"                                                                                   \
    "}"
#define WG_F8(d, i)                                                                                \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),    \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_F32(d, i) WG_F8(d, i), WG_F8(d, i + 8), WG_F8(d, i + 16), WG_F8(d, i + 24)
#define WG_F128(d) WG_F32(d, 0), WG_F32(d, 32), WG_F32(d, 64), WG_F32(d, 96)

/* d (+)= A B for one warpgroup's 64 x 256 tile: wgmma m64n256k16, bf16 in, fp32
 * accumulate, both operands from shared memory; TA / TB = 1: that operand is stored
 * MN-major (transposed). acc = 0 overwrites d. d[4 j + e] is row 16 (warp % 4) + lane / 4
 * + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2 of the tile. */
template <int TA_, int TB_>
__device__ __forceinline__ void wgmma256(float (&d)[128], uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WG_D128_REGS
                 ", %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : WG_F128(d)
                 : "l"(da), "l"(db), "r"(acc), "n"(TA_), "n"(TB_));
}

__device__ __forceinline__ void st_bf16x2(bf16 *p, float a, float b) {
    *reinterpret_cast<uint32_t *>(p) = pack_bf16(a, b);
}
__device__ __forceinline__ float2 ld_bf16x2(const bf16 *p) {
    const __nv_bfloat162 h = __ldg(reinterpret_cast<const __nv_bfloat162 *>(p));
    return make_float2(__low2float(h), __high2float(h));
}
__device__ __forceinline__ void ld8(float f[8], const bf16 *src) {
    const uint4 u = *reinterpret_cast<const uint4 *>(src);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int x = 0; x < 4; x++) {
        f[2 * x] = __low2float(h[x]);
        f[2 * x + 1] = __high2float(h[x]);
    }
}
__device__ __forceinline__ void st8(bf16 *dst, const float f[8]) {
    uint4 u;
    u.x = pack_bf16(f[0], f[1]);
    u.y = pack_bf16(f[2], f[3]);
    u.z = pack_bf16(f[4], f[5]);
    u.w = pack_bf16(f[6], f[7]);
    *reinterpret_cast<uint4 *>(dst) = u;
}
__device__ __forceinline__ float sigmoid_(float x) { return __frcp_rn(1.0f + __expf(-x)); }

/* ---------------------------------------------------------------- tiles */

struct Tile {
    int g;   /* group */
    int seg; /* the group's first sorted row */
    int mg;  /* the group's rows */
    int ms;  /* rows the M-direction epilogues store: mg rounded up to BM when padded */
    int m0;  /* M offset of the tile (rows within the group, or the weight-gradient row) */
    int n0;  /* N offset (GATEUP: the f offset of the 128 gate / up columns) */
    int K;
    int h; /* v1 WGATEUP: 0 gate rows, 1 up rows */
};

__device__ __forceinline__ void group_rows(const GArgs &a, Tile &t) {
    t.seg = a.seg_off[t.g];
    t.mg = a.seg_cnt ? a.seg_cnt[t.g] : a.seg_off[t.g + 1] - t.seg;
    t.ms = a.pad ? cdiv(t.mg, BM) * BM : t.mg;
    t.h = 0;
}

template <int KIND> __device__ __forceinline__ int tiles_total(const GArgs &a) {
    const int ntn = n_tiles_n<KIND>(a.D, a.F);
    if (GK<KIND>)
        return a.G * m_tiles_gk<KIND>(a.D, a.F) * ntn;
    return a.tile_off[a.G] * ntn;
}

/* Tile `id` of the product; false when it has nothing to do (a weight gradient of a group
 * without rows). The same function in every role, so they all walk the same sequence. */
template <int KIND> __device__ __forceinline__ bool tile_decode(const GArgs &a, int id, Tile &t) {
    const int ntn = n_tiles_n<KIND>(a.D, a.F);
    if (GK<KIND>) {
        const int tpg = m_tiles_gk<KIND>(a.D, a.F) * ntn;
        t.g = id / tpg;
        const int rem = id - t.g * tpg, mt = rem / ntn, nt = rem - mt * ntn;
        group_rows(a, t);
        t.m0 = mt * BM;
        t.n0 = nt * BN;
        t.K = t.mg;
        return t.mg > 0;
    }
    const int mt = id / ntn, nt = id - mt * ntn;
    int lo = 0, hi = a.G; /* tile_off[lo] <= mt < tile_off[hi] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (a.tile_off[mid] <= mt)
            lo = mid;
        else
            hi = mid;
    }
    t.g = lo;
    group_rows(a, t);
    t.m0 = (mt - a.tile_off[lo]) * BM;
    t.n0 = nt * (KIND == K_GATEUP ? 128 : BN);
    t.K = KIND == K_DOWN ? a.F : KIND == K_DGATEUP ? 2 * a.F : a.D;
    return true;
}

/* Operand rows. K-major operands: the row of tile-local index r (its K values are
 * contiguous), NULL when r is outside the problem. MN-major operands: the K row kk (its
 * M or N values contiguous), NULL outside. */
template <int KIND>
__device__ __forceinline__ const bf16 *a_row(const GArgs &a, const Tile &t, int r) {
    const int m = t.m0 + r;
    if (m >= t.mg)
        return nullptr;
    const int64_t row = t.seg + m;
    if (KIND == K_GATEUP) {
        const int64_t p = a.xrow ? (int64_t)__ldg(a.xrow + row) : row;
        return a.X + p * a.D;
    }
    if (KIND == K_DOWN)
        return a.A + row * a.F;
    if (KIND == K_DDOWN)
        return a.dY + row * a.D;
    return a.dH + row * 2 * a.F; /* K_DGATEUP */
}
template <int KIND>
__device__ __forceinline__ const bf16 *a_krow(const GArgs &a, const Tile &t, int kk) {
    if (kk >= t.mg)
        return nullptr;
    const int64_t row = t.seg + kk;
    if (KIND == K_WDOWN)
        return a.dY + row * a.D;
    return a.dH + row * 2 * a.F; /* K_WGATEUP */
}
template <int KIND> __device__ __forceinline__ int a_mbound(const GArgs &a) {
    return KIND == K_WDOWN ? a.D : 2 * a.F;
}
template <int KIND>
__device__ __forceinline__ const bf16 *b_row(const GArgs &a, const Tile &t, int r) {
    if (KIND == K_GATEUP) {
        const int f = t.n0 + (r & 127);
        if (f >= a.F)
            return nullptr;
        return (r < 128 ? a.Wg : a.Wu) + ((int64_t)t.g * a.F + f) * a.D;
    }
    const int n = t.n0 + r; /* K_DOWN */
    if (n >= a.D)
        return nullptr;
    return a.Wd + ((int64_t)t.g * a.D + n) * a.F;
}
template <int KIND>
__device__ __forceinline__ const bf16 *b_krow(const GArgs &a, const Tile &t, int kk) {
    if (KIND == K_DDOWN) {
        if (kk >= a.D)
            return nullptr;
        return a.Wd + ((int64_t)t.g * a.D + kk) * a.F;
    }
    if (KIND == K_DGATEUP) {
        if (kk >= 2 * a.F)
            return nullptr;
        return kk < a.F ? a.Wg + ((int64_t)t.g * a.F + kk) * a.D
                        : a.Wu + ((int64_t)t.g * a.F + (kk - a.F)) * a.D;
    }
    if (kk >= t.mg)
        return nullptr;
    const int64_t row = t.seg + kk;
    if (KIND == K_WDOWN)
        return a.A + row * a.F;
    const int64_t p = a.xrow ? (int64_t)__ldg(a.xrow + row) : row; /* K_WGATEUP */
    return a.X + p * a.D;
}
template <int KIND> __device__ __forceinline__ int b_nbound(const GArgs &a) {
    return (KIND == K_DDOWN || KIND == K_WDOWN) ? a.F : a.D;
}
/* any valid address, for copies that read nothing */
template <int KIND> __device__ __forceinline__ const bf16 *some_ptr(const GArgs &a) {
    return KIND == K_GATEUP || KIND == K_DGATEUP ? a.Wg : a.Wd;
}

/* ---------------------------------------------------------------- epilogues */

/* Two adjacent output columns (c even, tile-local) of tile-local row r: v0, v1; GATEUP:
 * the gate values, with p0, p1 the up values of the same f (column c + 128). */
template <int KIND>
__device__ __forceinline__ void epi(const GArgs &a, const Tile &t, int r, int c, float v0, float v1,
                                    float p0, float p1) {
    if constexpr (KIND == K_GATEUP) {
        const int m = t.m0 + r, f = t.n0 + c;
        if (m >= t.ms || f >= a.F)
            return;
        const int64_t row = t.seg + m;
        if (a.H) {
            st_bf16x2(a.H + row * 2 * a.F + f, v0, v1);
            st_bf16x2(a.H + row * 2 * a.F + a.F + f, p0, p1);
        }
        st_bf16x2(a.A + row * a.F + f, v0 * sigmoid_(v0) * p0, v1 * sigmoid_(v1) * p1);
    } else if constexpr (KIND == K_DOWN || KIND == K_DGATEUP) {
        const int m = t.m0 + r, n = t.n0 + c;
        if (m >= t.ms || n >= a.D)
            return;
        st_bf16x2((KIND == K_DOWN ? a.Y : a.dX) + (int64_t)(t.seg + m) * a.D + n, v0, v1);
    } else if constexpr (KIND == K_DDOWN) {
        const int m = t.m0 + r, f = t.n0 + c;
        if (m >= t.ms || f >= a.F)
            return;
        const int64_t row = t.seg + m;
        const float2 g = ld_bf16x2(a.H + row * 2 * a.F + f);
        const float2 u = ld_bf16x2(a.H + row * 2 * a.F + a.F + f);
        const float s0 = sigmoid_(g.x), s1 = sigmoid_(g.y);
        /* da = v; du = da silu(g); dg = da u silu'(g), silu' = s (1 + g (1 - s)) */
        st_bf16x2(a.dH + row * 2 * a.F + f, v0 * u.x * s0 * (1.0f + g.x * (1.0f - s0)),
                  v1 * u.y * s1 * (1.0f + g.y * (1.0f - s1)));
        st_bf16x2(a.dH + row * 2 * a.F + a.F + f, v0 * g.x * s0, v1 * g.y * s1);
    } else if constexpr (KIND == K_WDOWN) {
        const int m = t.m0 + r, n = t.n0 + c;
        if (m >= a.D || n >= a.F)
            return;
        float2 *p = reinterpret_cast<float2 *>(a.dWd + ((int64_t)t.g * a.D + m) * a.F + n);
        float2 o = *p;
        o.x += v0;
        o.y += v1;
        *p = o;
    } else { /* K_WGATEUP */
        const int m = t.m0 + r, n = t.n0 + c;
        if (m >= 2 * a.F || n >= a.D)
            return;
        float *base = m < a.F ? a.dWg : a.dWu;
        if (!base)
            return;
        const int f = m < a.F ? m : m - a.F;
        float2 *p = reinterpret_cast<float2 *>(base + ((int64_t)t.g * a.F + f) * a.D + n);
        float2 o = *p;
        o.x += v0;
        o.y += v1;
        *p = o;
    }
}

/* ---------------------------------------------------------------- wgmma grouped GEMM */

/* One stage of operand tiles into shared memory (producer thread pt of 128): A 128 x 64,
 * B 256 x 64, both in the 128-byte swizzled layout the tensor copy engine would write
 * (16-byte chunk c of a 128-byte row r at chunk c ^ (r % 8); tiles 1024-byte aligned).
 * K-major tiles: row r = MN index, 64 K values. MN-major tiles: blocks of 64 MN values,
 * block b at b * 8 KiB, row = K index. Out-of-range chunks are zero-filled. */
template <int KIND>
__device__ __forceinline__ void load_stage(const GArgs &a, const Tile &t, int k0, uint32_t As,
                                           uint32_t Bs, int pt) {
    const int c8 = pt & 7, rr = pt >> 3;
    const uint32_t swz = (uint32_t)((c8 ^ (rr & 7)) << 4);
    const bf16 *dummy = some_ptr<KIND>(a);
    if (!TA<KIND>) {
        const int k = k0 + 8 * c8;
        const bool kin = k < t.K;
#pragma unroll
        for (int j = 0; j < BM / 16; j++) {
            const int r = rr + 16 * j;
            const bf16 *p = a_row<KIND>(a, t, r);
            const bool ok = p && kin;
            cp16(As + r * 128 + swz, ok ? p + k : dummy, ok);
        }
    } else {
        const int mb = a_mbound<KIND>(a);
#pragma unroll
        for (int j = 0; j < BK / 16; j++) {
            const int kr = rr + 16 * j;
            const bf16 *p = a_krow<KIND>(a, t, k0 + kr);
#pragma unroll
            for (int b = 0; b < BM / 64; b++) {
                const int mn = t.m0 + 64 * b + 8 * c8;
                const bool ok = p && mn < mb;
                cp16(As + b * 8192 + kr * 128 + swz, ok ? p + mn : dummy, ok);
            }
        }
    }
    if (!TB<KIND>) {
        const int k = k0 + 8 * c8;
        const bool kin = k < t.K;
#pragma unroll
        for (int j = 0; j < BN / 16; j++) {
            const int r = rr + 16 * j;
            const bf16 *p = b_row<KIND>(a, t, r);
            const bool ok = p && kin;
            cp16(Bs + r * 128 + swz, ok ? p + k : dummy, ok);
        }
    } else {
        const int nb = b_nbound<KIND>(a);
#pragma unroll
        for (int j = 0; j < BK / 16; j++) {
            const int kr = rr + 16 * j;
            const bf16 *p = b_krow<KIND>(a, t, k0 + kr);
#pragma unroll
            for (int b = 0; b < BN / 64; b++) {
                const int mn = t.n0 + 64 * b + 8 * c8;
                const bool ok = p && mn < nb;
                cp16(Bs + b * 8192 + kr * 128 + swz, ok ? p + mn : dummy, ok);
            }
        }
    }
}

/* Persistent over the product's tiles (id = blockIdx.x, += gridDim.x). Warpgroup 0
 * produces: for each stage (a running count `it` over all tiles: buffer it % NS, phase
 * it / NS), it waits for the buffer to be empty, issues its cp.async copies, and once the
 * previous stage's copies have landed (wait_group 1) fences them to the async proxy and
 * arrives on that stage's full barrier (128 arrivals). Warpgroups 1 and 2 consume: wait
 * for full, 4 wgmma k16 steps (rows 64 (wg - 1) .. + 63 of the tile), and after the next
 * stage's wgmma is issued and the previous one has completed (wait_group 1), one arrival
 * per warp on the previous buffer's empty barrier (8 arrivals). */
template <int KIND> __global__ void __launch_bounds__(WG_THREADS, 1) moe_gemm_wg(const GArgs a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    uint64_t *full = reinterpret_cast<uint64_t *>(sm + NS * STAGE_BYTES);
    uint64_t *empty = full + NS;
    const int tid = threadIdx.x;
    /* warpgroup index, visibly warp-uniform (wgmma behind a branch ptxas cannot prove
     * uniform is serialised) */
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < NS; s++) {
            mbar_init(&full[s], 128);
            mbar_init(&empty[s], 8);
        }
    }
    fence_proxy_async();
    __syncthreads();
    const int total = tiles_total<KIND>(a);
    const uint32_t sbase = smem_u32(sm);

    if (wg == 0) {
        setmaxnreg_dec<120>();
        uint32_t it = 0;
        for (int id = blockIdx.x; id < total; id += gridDim.x) {
            Tile t;
            if (!tile_decode<KIND>(a, id, t))
                continue;
            const int KT = cdiv(t.K, BK);
            for (int kt = 0; kt < KT; kt++, it++) {
                const uint32_t s = it % NS;
                if (it >= NS)
                    mbar_wait(&empty[s], ((it / NS) - 1) & 1);
                const uint32_t As = sbase + s * STAGE_BYTES;
                load_stage<KIND>(a, t, kt * BK, As, As + A_BYTES, tid);
                cp_commit();
                if (it >= 1) {
                    cp_wait<1>();
                    fence_proxy_async();
                    mbar_arrive(&full[(it - 1) % NS]);
                }
            }
        }
        if (it >= 1) {
            cp_wait<0>();
            fence_proxy_async();
            mbar_arrive(&full[(it - 1) % NS]);
        }
        return;
    }

    setmaxnreg_inc<192>();
    const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++)
        acc[i] = 0.0f;
    uint32_t it = 0;
    for (int id = blockIdx.x; id < total; id += gridDim.x) {
        Tile t;
        if (!tile_decode<KIND>(a, id, t))
            continue;
        const int KT = cdiv(t.K, BK);
        for (int kt = 0; kt < KT; kt++, it++) {
            const uint32_t s = it % NS;
            mbar_wait(&full[s], (it / NS) & 1);
            const uint32_t Ab = sbase + s * STAGE_BYTES + cw * 8192;
            const uint32_t Bb = sbase + s * STAGE_BYTES + A_BYTES;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ks++) {
                const uint64_t da = TA<KIND> ? wg_desc(Ab + 2048 * ks, 8192, 1024)
                                             : wg_desc(Ab + 32 * ks, 16, 1024);
                const uint64_t db = TB<KIND> ? wg_desc(Bb + 2048 * ks, 8192, 1024)
                                             : wg_desc(Bb + 32 * ks, 16, 1024);
                wgmma256<TA<KIND>, TB<KIND>>(acc, da, db, (kt | ks) != 0);
            }
            wg_commit();
            wg_wait<1>();
            if (kt > 0) { /* the previous stage's wgmma is complete */
                __syncwarp();
                if (lane == 0)
                    mbar_arrive(&empty[(it - 1) % NS]);
            }
        }
        wg_wait<0>();
        wg_regs(acc);
        __syncwarp();
        if (lane == 0)
            mbar_arrive(&empty[(it - 1) % NS]);

        const int rb = 64 * cw + 16 * warp + (lane >> 2), cb = 2 * (lane & 3);
        if constexpr (KIND == K_GATEUP) {
#pragma unroll
            for (int j = 0; j < 16; j++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    epi<KIND>(a, t, rb + 8 * h, 8 * j + cb, acc[4 * j + 2 * h],
                              acc[4 * j + 2 * h + 1], acc[4 * (j + 16) + 2 * h],
                              acc[4 * (j + 16) + 2 * h + 1]);
        } else {
#pragma unroll
            for (int j = 0; j < 32; j++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    epi<KIND>(a, t, rb + 8 * h, 8 * j + cb, acc[4 * j + 2 * h],
                              acc[4 * j + 2 * h + 1], 0.0f, 0.0f);
        }
    }
}

/* ---------------------------------------------------------------- v1: tensor copies */

/* Variant v1 of the grouped GEMM: the same tiles, warp roles, stage ring and wgmma main
 * loop as moe_gemm_wg, but
 *  - every operand that is a plain strided tensor (the weights, the sorted activation
 *    rows) is loaded by the tensor copy engine (cp.async.bulk.tensor, 128-byte swizzle:
 *    the layout load_stage writes by hand), one thread issuing and posting the stage's
 *    bytes on its full barrier; the per-expert weights are 3-D maps [E][rows][cols] and
 *    the [g | u] / [dg | du] rows 3-D maps [rows][2][F], so that every box that runs past
 *    an expert's weights or past F reads zeros;
 *  - the gathered x rows (GATEUP's A, WGATEUP's B) stay on cp.async from all 128
 *    producer threads, which arrive on the full barrier when their copies land
 *    (cp.async.mbarrier.arrive.noinc: no producer ever waits for its copies), the
 *    consumers fencing the stage to the async proxy after the wait;
 *  - the routed groups' sorted rows are padded to whole 128-row tiles (zero rows, see
 *    GArgs::pad), so M tiles never straddle experts and the weight gradients' K loops
 *    (over an expert's rows, in steps of 64) read zeros past the expert's last row;
 *  - the epilogue stages the accumulators in shared memory (stmatrix / 8-byte stores into
 *    a per-warpgroup 16 KiB buffer, 16-byte chunks swizzled by row) and writes global
 *    memory in whole 16-byte chunks, rows contiguous across 8 or 16 threads; the weight
 *    gradients' += reads its old values before staging (their lines prefetched to L2 three
 *    stages before the tile's end), DDOWN's [g | u] likewise.
 * WGATEUP's M tiles are per half (gate rows, then up rows: tile mt < 2 ceil(F / 128)) so
 * that a tile never straddles F. */

/* cuTensorMapEncodeTiled's type (fetched from the driver at run time: no libcuda link) */
typedef CUresult (*EncodeFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                             const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                             const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* a: the A operand's map, b0 / b1: B's (GATEUP, DGATEUP: gate, up) */
struct TMaps {
    CUtensorMap a, b0, b1;
};

template <int KIND> constexpr bool GATHER = KIND == K_GATEUP || KIND == K_WGATEUP;
/* bytes the tensor copies of one stage bring */
template <int KIND>
constexpr uint32_t TX_BYTES = KIND == K_GATEUP    ? (uint32_t)B_BYTES
                              : KIND == K_WGATEUP ? (uint32_t)A_BYTES
                                                  : (uint32_t)STAGE_BYTES;

__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}
/* one arrival on bar when this thread's earlier cp.async copies have landed (counted in
 * the barrier's expected arrivals: noinc) */
__device__ __forceinline__ void cp_mbar_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void tma2(uint32_t dst, const CUtensorMap *m, int c0, int c1,
                                     uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void tma3(uint32_t dst, const CUtensorMap *m, int c0, int c1, int c2,
                                     uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
                 : "memory");
}
/* named barrier `id` over n threads */
__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
/* four 8 x 8 bf16 matrices: lanes 8 i .. 8 i + 7 give the row addresses of matrix i,
 * register i holds its fragment (row lane / 4, columns 2 (lane % 4), + 1) */
__device__ __forceinline__ void stsm4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                      uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}
__device__ __forceinline__ void st_shared_f2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_u4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_shared_f4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.L2 [%0];\n" ::"l"(p));
}
/* sigmoid with the approximate reciprocal (inf -> 0: sigmoid(-inf) = 0) */
__device__ __forceinline__ float sigmoid_fast(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(1.0f + __expf(-x)));
    return r;
}
__device__ __forceinline__ void unpack8(float f[8], uint4 u) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int x = 0; x < 4; x++) {
        f[2 * x] = __low2float(h[x]);
        f[2 * x + 1] = __high2float(h[x]);
    }
}

/* tiles: GATEUP .. DGATEUP and WDOWN as in v0; WGATEUP per half (see above) */
template <int KIND> __host__ __device__ inline int v1_m_tiles_gk(int D, int F) {
    return KIND == K_WDOWN ? cdiv(D, BM) : 2 * cdiv(F, BM);
}
template <int KIND> __device__ __forceinline__ int v1_tiles_total(const GArgs &a) {
    const int ntn = n_tiles_n<KIND>(a.D, a.F);
    if (GK<KIND>)
        return a.G * v1_m_tiles_gk<KIND>(a.D, a.F) * ntn;
    return a.tile_off[a.G] * ntn;
}
template <int KIND> __device__ __forceinline__ bool v1_decode(const GArgs &a, int id, Tile &t) {
    if constexpr (KIND == K_WGATEUP) {
        const int ntn = n_tiles_n<KIND>(a.D, a.F), mf = cdiv(a.F, BM);
        const int tpg = 2 * mf * ntn;
        t.g = id / tpg;
        const int rem = id - t.g * tpg, mt = rem / ntn, nt = rem - mt * ntn;
        group_rows(a, t);
        t.h = mt >= mf ? 1 : 0;
        t.m0 = (mt - t.h * mf) * BM;
        t.n0 = nt * BN;
        t.K = t.mg;
        return t.mg > 0;
    } else {
        return tile_decode<KIND>(a, id, t);
    }
}
/* K steps of a tile (DGATEUP: ceil(F / 64) over the gate rows, then as many over the up
 * rows) */
template <int KIND> __device__ __forceinline__ int v1_ksteps(const GArgs &a, const Tile &t) {
    return KIND == K_DGATEUP ? 2 * cdiv(a.F, BK) : cdiv(t.K, BK);
}

/* The tensor copies of K step kt into stage (As, Bs), completing on bar (thread 0). */
template <int KIND>
__device__ __forceinline__ void v1_tma_stage(const TMaps &m, const GArgs &a, const Tile &t, int kt,
                                             uint32_t As, uint32_t Bs, uint64_t *bar) {
    const int k0 = kt * BK;
    if constexpr (KIND == K_GATEUP) {
        tma3(Bs, &m.b0, k0, t.n0, t.g, bar);
        tma3(Bs + 16384, &m.b1, k0, t.n0, t.g, bar);
    } else if constexpr (KIND == K_DOWN) {
        tma2(As, &m.a, k0, t.seg + t.m0, bar);
        tma3(Bs, &m.b0, k0, t.n0, t.g, bar);
    } else if constexpr (KIND == K_DDOWN) {
        tma2(As, &m.a, k0, t.seg + t.m0, bar);
#pragma unroll
        for (int b = 0; b < BN / 64; b++)
            tma3(Bs + 8192 * b, &m.b0, t.n0 + 64 * b, k0, t.g, bar);
    } else if constexpr (KIND == K_DGATEUP) {
        const int kf = cdiv(a.F, BK), h = kt >= kf ? 1 : 0, kk = (kt - h * kf) * BK;
        tma3(As, &m.a, kk, h, t.seg + t.m0, bar);
        const CUtensorMap *w = h ? &m.b1 : &m.b0;
#pragma unroll
        for (int b = 0; b < BN / 64; b++)
            tma3(Bs + 8192 * b, w, t.n0 + 64 * b, kk, t.g, bar);
    } else if constexpr (KIND == K_WDOWN) {
#pragma unroll
        for (int b = 0; b < BM / 64; b++)
            tma2(As + 8192 * b, &m.a, t.m0 + 64 * b, t.seg + k0, bar);
#pragma unroll
        for (int b = 0; b < BN / 64; b++)
            tma2(Bs + 8192 * b, &m.b0, t.n0 + 64 * b, t.seg + k0, bar);
    } else { /* K_WGATEUP: A only; B is gathered */
#pragma unroll
        for (int b = 0; b < BM / 64; b++)
            tma3(As + 8192 * b, &m.a, t.m0 + 64 * b, t.h, t.seg + k0, bar);
    }
}

/* Staging buffer of a consumer warpgroup: 64 rows of 256 bytes, the 16-byte chunk c of
 * row r at chunk c ^ (r % 8) (conflict-free for the fragment stores and the row reads). */
__device__ __forceinline__ uint32_t stg_off(int r, int c) { return r * 256 + ((c ^ (r & 7)) << 4); }

/* The warpgroup's 64 x 128 bf16 of accumulator columns 8 j0 .. 8 j0 + 127 (j0 = 0 or 16)
 * into the staging buffer; val(i): the value of accumulator register i. */
template <typename V>
__device__ __forceinline__ void stage_bf16(uint32_t S, int warp, int lane, int j0, V val) {
    const int q = lane >> 3, r = 16 * warp + 8 * (q & 1) + (lane & 7);
#pragma unroll
    for (int jj = 0; jj < 8; jj++) {
        const int j = j0 + 2 * jj;
        stsm4(S + stg_off(r, 2 * jj + (q >> 1)), pack_bf16(val(4 * j), val(4 * j + 1)),
              pack_bf16(val(4 * j + 2), val(4 * j + 3)), pack_bf16(val(4 * j + 4), val(4 * j + 5)),
              pack_bf16(val(4 * j + 6), val(4 * j + 7)));
    }
}
/* The staged 64 x 128 bf16 to global memory: row r to row_ptr(r) (nullptr: not stored),
 * chunk c to columns col0 + 8 c .. + 7 when col0 + 8 c < ncols. */
template <typename R>
__device__ __forceinline__ void unstage_bf16(uint32_t S, int wtid, R row_ptr, int col0, int ncols) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int idx = wtid + 128 * i, r = idx >> 4, c = idx & 15;
        const uint4 v = ld_shared_u4(S + stg_off(r, c));
        bf16 *p = row_ptr(r);
        if (p && col0 + 8 * c < ncols)
            *reinterpret_cast<uint4 *>(p + col0 + 8 * c) = v;
    }
}
/* The warpgroup's 64 x 64 fp32 of accumulator columns 8 j0 .. 8 j0 + 63 into the staging
 * buffer (chunk c of row r: columns 4 c .. 4 c + 3). */
__device__ __forceinline__ void stage_f32(uint32_t S, int warp, int lane, int j0,
                                          const float (&acc)[128]) {
    const int r0 = 16 * warp + (lane >> 2), cc = (lane & 3) >> 1, hb = (lane & 1) * 8;
#pragma unroll
    for (int jj = 0; jj < 8; jj++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + 8 * h;
            st_shared_f2(S + stg_off(r, 2 * jj + cc) + hb, acc[4 * (j0 + jj) + 2 * h],
                         acc[4 * (j0 + jj) + 2 * h + 1]);
        }
}

/* L2 prefetch of what the tile's epilogue reads (ctid: consumer thread 0 .. 255): DDOWN
 * the [g | u] rows, the weight gradients their old values. */
template <int KIND>
__device__ __forceinline__ void v1_prefetch(const GArgs &a, const Tile &t, int ctid) {
    const int r = ctid >> 1, hh = ctid & 1;
    if constexpr (KIND == K_DDOWN) {
        const int m = t.m0 + r;
        if (m < t.ms) {
            const bf16 *p = a.H + (int64_t)(t.seg + m) * 2 * a.F + hh * a.F;
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (t.n0 + 64 * i < a.F)
                    prefetch_l2(p + t.n0 + 64 * i);
        }
    } else if constexpr (KIND == K_WDOWN || KIND == K_WGATEUP) {
        const int m = t.m0 + r;
        const float *base = KIND == K_WDOWN ? a.dWd : t.h ? a.dWu : a.dWg;
        const int Mo = KIND == K_WDOWN ? a.D : a.F, No = KIND == K_WDOWN ? a.F : a.D;
        if (base && m < Mo) {
            const float *p = base + ((int64_t)t.g * Mo + m) * No;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int n = t.n0 + 128 * hh + 32 * i;
                if (n < No)
                    prefetch_l2(p + n);
            }
        }
    }
}

/* The epilogue of one tile for consumer warpgroup cw (rows 64 cw .. + 63 of the tile):
 * S its staging buffer, named barrier 1 + cw. Every round starts with a barrier (the
 * previous round's, or the previous tile's, reads of S are done). */
template <int KIND>
__device__ __forceinline__ void v1_epilogue(const GArgs &a, const Tile &t, float (&acc)[128],
                                            uint32_t S, int cw, int warp, int lane, int wtid) {
    const int bid = 1 + cw, rb = t.m0 + 64 * cw;
    if constexpr (KIND == K_GATEUP) {
        auto hrow = [&](int r) -> bf16 * {
            const int m = rb + r;
            return m < t.ms ? a.H + (int64_t)(t.seg + m) * 2 * a.F : nullptr;
        };
        if (a.H) {
            bar_sync(bid, 128);
            stage_bf16(S, warp, lane, 0, [&](int i) { return acc[i]; });
            bar_sync(bid, 128);
            unstage_bf16(S, wtid, hrow, t.n0, a.F);
            bar_sync(bid, 128);
            stage_bf16(S, warp, lane, 16, [&](int i) { return acc[i]; });
            bar_sync(bid, 128);
            unstage_bf16(
                S, wtid,
                [&](int r) -> bf16 * {
                    bf16 *p = hrow(r);
                    return p ? p + a.F : p;
                },
                t.n0, a.F);
        }
        bar_sync(bid, 128);
        stage_bf16(S, warp, lane, 0, [&](int i) {
            const float g = acc[i];
            return g * sigmoid_fast(g) * acc[i + 64];
        });
        bar_sync(bid, 128);
        unstage_bf16(
            S, wtid,
            [&](int r) -> bf16 * {
                const int m = rb + r;
                return m < t.ms ? a.A + (int64_t)(t.seg + m) * a.F : nullptr;
            },
            t.n0, a.F);
    } else if constexpr (KIND == K_DOWN || KIND == K_DGATEUP) {
        bf16 *out = KIND == K_DOWN ? a.Y : a.dX;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            bar_sync(bid, 128);
            stage_bf16(S, warp, lane, 16 * half, [&](int i) { return acc[i]; });
            bar_sync(bid, 128);
            unstage_bf16(
                S, wtid,
                [&](int r) -> bf16 * {
                    const int m = rb + r;
                    return m < t.ms ? out + (int64_t)(t.seg + m) * a.D : nullptr;
                },
                t.n0 + 128 * half, a.D);
        }
    } else if constexpr (KIND == K_DDOWN) {
        /* dA (fp32) staged 64 columns at a time; each thread then takes 8 consecutive f of
         * a row: da from S, g / u from H (loaded before the staging), dg / du to dH */
#pragma unroll
        for (int q = 0; q < 4; q++) { /* unrolled: acc is indexed by q */
            uint4 gv[4], uv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int idx = wtid + 128 * i, r = idx >> 3, f = t.n0 + 64 * q + 8 * (idx & 7);
                const int m = rb + r;
                gv[i] = uv[i] = make_uint4(0u, 0u, 0u, 0u);
                if (m < t.ms && f < a.F) {
                    const bf16 *h = a.H + (int64_t)(t.seg + m) * 2 * a.F + f;
                    gv[i] = __ldg(reinterpret_cast<const uint4 *>(h));
                    uv[i] = __ldg(reinterpret_cast<const uint4 *>(h + a.F));
                }
            }
            bar_sync(bid, 128);
            stage_f32(S, warp, lane, 8 * q, acc);
            bar_sync(bid, 128);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int idx = wtid + 128 * i, r = idx >> 3, gq = idx & 7;
                const int f = t.n0 + 64 * q + 8 * gq, m = rb + r;
                if (m >= t.ms || f >= a.F)
                    continue;
                const float4 d0 = ld_shared_f4(S + stg_off(r, 2 * gq));
                const float4 d1 = ld_shared_f4(S + stg_off(r, 2 * gq + 1));
                const float da[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
                float g[8], u[8], dg[8], du[8];
                unpack8(g, gv[i]);
                unpack8(u, uv[i]);
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    /* da = v; du = da silu(g); dg = da u silu'(g), silu' = s (1 + g (1 - s)) */
                    const float s = sigmoid_fast(g[e]);
                    dg[e] = da[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
                    du[e] = da[e] * g[e] * s;
                }
                bf16 *o = a.dH + (int64_t)(t.seg + m) * 2 * a.F + f;
                st8(o, dg);
                st8(o + a.F, du);
            }
        }
    } else { /* K_WDOWN, K_WGATEUP: dW[rows, No] += the tile, 64 fp32 columns per round */
        float *base = KIND == K_WDOWN ? a.dWd : t.h ? a.dWu : a.dWg;
        if (!base) /* uniform over the CTA: no barrier is skipped by some threads only */
            return;
        const int Mo = KIND == K_WDOWN ? a.D : a.F, No = KIND == K_WDOWN ? a.F : a.D;
        auto ptr = [&](int i, int q) -> float * {
            const int idx = wtid + 128 * i, r = idx >> 4, n = t.n0 + 64 * q + 4 * (idx & 15);
            const int m = rb + r;
            return (m < Mo && n < No) ? base + ((int64_t)t.g * Mo + m) * No + n : nullptr;
        };
#pragma unroll
        for (int q = 0; q < 4; q++) { /* unrolled: acc is indexed by q */
            float4 old[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float *p = ptr(i, q);
                old[i] = p ? *reinterpret_cast<const float4 *>(p) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            bar_sync(bid, 128);
            stage_f32(S, warp, lane, 8 * q, acc);
            bar_sync(bid, 128);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float *p = ptr(i, q);
                if (!p)
                    continue;
                const int idx = wtid + 128 * i;
                const float4 v = ld_shared_f4(S + stg_off(idx >> 4, idx & 15));
                float4 o = old[i];
                o.x += v.x;
                o.y += v.y;
                o.z += v.z;
                o.w += v.w;
                *reinterpret_cast<float4 *>(p) = o;
            }
        }
    }
}

/* The v1 kernel: persistent over the tiles like moe_gemm_wg (same roles and handshakes;
 * full barriers expect one arrival with the stage's tensor-copy bytes, plus 128 cp.async
 * arrivals where the stage has a gathered operand). */
template <int KIND>
__global__ void __launch_bounds__(WG_THREADS, 1)
    moe_gemm_v1(const GArgs a, const __grid_constant__ TMaps maps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    uint64_t *full = reinterpret_cast<uint64_t *>(sm + NS * STAGE_BYTES + 2 * V1_STG);
    uint64_t *empty = full + NS;
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < NS; s++) {
            mbar_init(&full[s], GATHER<KIND> ? 129 : 1);
            mbar_init(&empty[s], 8);
        }
    }
    fence_proxy_async();
    __syncthreads();
    const int total = v1_tiles_total<KIND>(a);
    const uint32_t sbase = smem_u32(sm);

    if (wg == 0) {
        if constexpr (GATHER<KIND>)
            setmaxnreg_dec<96>();
        else
            setmaxnreg_dec<56>();
        if (!GATHER<KIND> && tid != 0)
            return;
        const int c8 = tid & 7, rr = tid >> 3;
        const uint32_t swz = (uint32_t)((c8 ^ (rr & 7)) << 4);
        uint32_t it = 0;
        for (int id = blockIdx.x; id < total; id += gridDim.x) {
            Tile t;
            if (!v1_decode<KIND>(a, id, t))
                continue;
            const int KT = v1_ksteps<KIND>(a, t);
            /* GATEUP: this thread's 8 gathered rows, fixed over the tile (nullptr: zeros) */
            const bf16 *xs[GATHER<KIND> ? BM / 16 : 1];
            if constexpr (KIND == K_GATEUP) {
#pragma unroll
                for (int j = 0; j < BM / 16; j++) {
                    const int m = t.m0 + rr + 16 * j;
                    xs[j] = nullptr;
                    if (m < t.mg) {
                        const int64_t row = t.seg + m;
                        const int64_t tok = a.xrow ? (int64_t)__ldg(a.xrow + row) : row;
                        xs[j] = a.X + tok * a.D + 8 * c8;
                    }
                }
            }
            for (int kt = 0; kt < KT; kt++, it++) {
                const uint32_t s = it % NS;
                if (it >= NS)
                    mbar_wait(&empty[s], ((it / NS) - 1) & 1);
                const uint32_t As = sbase + s * STAGE_BYTES, Bs = As + A_BYTES;
                if (tid == 0) {
                    mbar_expect_tx(&full[s], TX_BYTES<KIND>);
                    v1_tma_stage<KIND>(maps, a, t, kt, As, Bs, &full[s]);
                }
                if constexpr (KIND == K_GATEUP) {
                    const int k0 = kt * BK;
                    const bool kin = k0 + 8 * c8 < a.D;
#pragma unroll
                    for (int j = 0; j < BM / 16; j++) {
                        const bool ok = xs[j] && kin;
                        cp16(As + (rr + 16 * j) * 128 + swz, ok ? xs[j] + k0 : a.X, ok);
                    }
                    cp_mbar_arrive(&full[s]);
                } else if constexpr (KIND == K_WGATEUP) {
                    const int k0 = kt * BK;
#pragma unroll
                    for (int j = 0; j < BK / 16; j++) {
                        const int kr = rr + 16 * j, kk = k0 + kr;
                        const bf16 *p = nullptr;
                        if (kk < t.mg) {
                            const int64_t row = t.seg + kk;
                            const int64_t tok = a.xrow ? (int64_t)__ldg(a.xrow + row) : row;
                            p = a.X + tok * a.D;
                        }
#pragma unroll
                        for (int b = 0; b < BN / 64; b++) {
                            const int n = t.n0 + 64 * b + 8 * c8;
                            const bool ok = p && n < a.D;
                            cp16(Bs + b * 8192 + kr * 128 + swz, ok ? p + n : a.X, ok);
                        }
                    }
                    cp_mbar_arrive(&full[s]);
                }
            }
        }
        if constexpr (GATHER<KIND>)
            cp_wait_all();
        return;
    }

    if constexpr (GATHER<KIND>)
        setmaxnreg_inc<200>();
    else
        setmaxnreg_inc<224>();
    const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31, wtid = tid & 127;
    const uint32_t S = sbase + NS * STAGE_BYTES + cw * V1_STG;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++)
        acc[i] = 0.0f;
    uint32_t it = 0;
    for (int id = blockIdx.x; id < total; id += gridDim.x) {
        Tile t;
        if (!v1_decode<KIND>(a, id, t))
            continue;
        const int KT = v1_ksteps<KIND>(a, t), pf = KT > 3 ? KT - 3 : 0;
        for (int kt = 0; kt < KT; kt++, it++) {
            const uint32_t s = it % NS;
            mbar_wait(&full[s], (it / NS) & 1);
            if constexpr (GATHER<KIND>)
                fence_proxy_async(); /* the landed cp.async copies, to the async proxy */
            if (kt == pf)
                v1_prefetch<KIND>(a, t, tid - 128);
            const uint32_t Ab = sbase + s * STAGE_BYTES + cw * 8192;
            const uint32_t Bb = sbase + s * STAGE_BYTES + A_BYTES;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ks++) {
                const uint64_t da = TA<KIND> ? wg_desc(Ab + 2048 * ks, 8192, 1024)
                                             : wg_desc(Ab + 32 * ks, 16, 1024);
                const uint64_t db = TB<KIND> ? wg_desc(Bb + 2048 * ks, 8192, 1024)
                                             : wg_desc(Bb + 32 * ks, 16, 1024);
                wgmma256<TA<KIND>, TB<KIND>>(acc, da, db, (kt | ks) != 0);
            }
            wg_commit();
            wg_wait<1>();
            if (kt > 0) {
                __syncwarp();
                if (lane == 0)
                    mbar_arrive(&empty[(it - 1) % NS]);
            }
        }
        wg_wait<0>();
        wg_regs(acc);
        __syncwarp();
        if (lane == 0)
            mbar_arrive(&empty[(it - 1) % NS]);
        v1_epilogue<KIND>(a, t, acc, S, cw, warp, lane, wtid);
    }
}

/* ---------------------------------------------------------------- reference GEMM */

template <int KIND>
__device__ __forceinline__ float elem_a(const GArgs &a, const Tile &t, int m, int k) {
    if (!TA<KIND>) {
        if (k >= t.K)
            return 0.0f;
        const bf16 *p = a_row<KIND>(a, t, m);
        return p ? __bfloat162float(p[k]) : 0.0f;
    }
    const bf16 *p = a_krow<KIND>(a, t, k);
    const int mn = t.m0 + m;
    return (p && mn < a_mbound<KIND>(a)) ? __bfloat162float(p[mn]) : 0.0f;
}
template <int KIND>
__device__ __forceinline__ float elem_b(const GArgs &a, const Tile &t, int n, int k) {
    if (!TB<KIND>) {
        if (k >= t.K)
            return 0.0f;
        const bf16 *p = b_row<KIND>(a, t, n);
        return p ? __bfloat162float(p[k]) : 0.0f;
    }
    const bf16 *p = b_krow<KIND>(a, t, k);
    const int mn = t.n0 + n;
    return (p && mn < b_nbound<KIND>(a)) ? __bfloat162float(p[mn]) : 0.0f;
}

/* The same tiles, operand mapping and epilogues with fp32 FMAs in a fixed order (k
 * ascending): the reference the wgmma kernel is tested against on the device, and a
 * fallback. Thread (ty, tx) computes rows 16 ty .. + 15 and columns tx + 32 j. */
template <int KIND>
__global__ void __launch_bounds__(SIMPLE_THREADS) moe_gemm_simple(const GArgs a) {
    __shared__ float As[SIMPLE_BK][BM], Bs[SIMPLE_BK][BN];
    extern __shared__ float Cs[]; /* [BM][BN] */
    const int tid = threadIdx.x, tx = tid & 31, ty = tid >> 5;
    const int total = tiles_total<KIND>(a);
    for (int id = blockIdx.x; id < total; id += gridDim.x) {
        Tile t;
        if (!tile_decode<KIND>(a, id, t))
            continue;
        float acc[16][8];
#pragma unroll
        for (int i = 0; i < 16; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc[i][j] = 0.0f;
        for (int k0 = 0; k0 < t.K; k0 += SIMPLE_BK) {
            for (int x = tid; x < BM * SIMPLE_BK; x += SIMPLE_THREADS)
                As[x / BM][x % BM] = elem_a<KIND>(a, t, x % BM, k0 + x / BM);
            for (int x = tid; x < BN * SIMPLE_BK; x += SIMPLE_THREADS)
                Bs[x / BN][x % BN] = elem_b<KIND>(a, t, x % BN, k0 + x / BN);
            __syncthreads();
#pragma unroll 4
            for (int kk = 0; kk < SIMPLE_BK; kk++) {
                float bv[8];
#pragma unroll
                for (int j = 0; j < 8; j++)
                    bv[j] = Bs[kk][tx + 32 * j];
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const float av = As[kk][16 * ty + i];
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        acc[i][j] = fmaf(av, bv[j], acc[i][j]);
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 16; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                Cs[(16 * ty + i) * BN + tx + 32 * j] = acc[i][j];
        __syncthreads();
        for (int x = tid; x < BM * BN / 2; x += SIMPLE_THREADS) {
            const int r = x / (BN / 2), c = 2 * (x % (BN / 2));
            const float *cr = Cs + r * BN;
            if constexpr (KIND == K_GATEUP) {
                if (c < 128)
                    epi<KIND>(a, t, r, c, cr[c], cr[c + 1], cr[c + 128], cr[c + 129]);
            } else {
                epi<KIND>(a, t, r, c, cr[c], cr[c + 1], 0.0f, 0.0f);
            }
        }
        __syncthreads();
    }
}

/* ---------------------------------------------------------------- permutation */

/* Per chunk of CH assignments: kept assignments per expert (shared-memory integer adds:
 * exact, order-free). cnt [nchunks][E]. */
__global__ void __launch_bounds__(256) moe_hist(const int32_t *idx, int64_t n, int E, int *cnt) {
    __shared__ int h[MAX_E];
    for (int e = threadIdx.x; e < E; e += 256)
        h[e] = 0;
    __syncthreads();
    const int64_t i0 = (int64_t)blockIdx.x * CH, i1 = i0 + CH < n ? i0 + CH : n;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += 256) {
        const int e = idx[i];
        if (e >= 0 && e < E)
            atomicAdd(&h[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += 256)
        cnt[(int64_t)blockIdx.x * E + e] = h[e];
}

/* Exclusive prefix of v over the block (blockDim.x = 1024), and the total. */
__device__ __forceinline__ void block_scan(int v, int *ws, int &excl, int &total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        ws[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = ws[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o)
                w += y;
        }
        ws[lane] = w;
    }
    __syncthreads();
    excl = (warp ? ws[warp - 1] : 0) + x - v;
    total = ws[31];
    __syncthreads();
}

/* One block of 1024 threads, thread e = expert: cnt[c][e] becomes the first sorted row of
 * chunk c's assignments to e; seg_cnt the experts' counts, seg_off the exclusive prefix
 * of the counts rounded up to BM (each expert's rows start on a 128-row tile and its
 * last tile ends on padding rows), tile_off = seg_off / BM; sh_off / sh_tile
 * the shared experts' one group of T rows. */
__global__ void __launch_bounds__(1024)
    moe_scan(int *cnt, int nch, int E, int T, int *seg_off, int *seg_cnt, int *tile_off,
             int *sh_off, int *sh_tile) {
    __shared__ int ws[32];
    const int e = threadIdx.x;
    int total = 0;
    if (e < E)
        for (int c = 0; c < nch; c++) {
            const int64_t q = (int64_t)c * E + e;
            const int v = cnt[q];
            cnt[q] = total;
            total += v;
        }
    int off, off_all;
    block_scan(cdiv(total, BM) * BM, ws, off, off_all);
    if (e < E) {
        seg_off[e] = off;
        seg_cnt[e] = total;
        tile_off[e] = off / BM;
        for (int c = 0; c < nch; c++)
            cnt[(int64_t)c * E + e] += off;
    }
    if (e == 0) {
        seg_off[E] = off_all;
        tile_off[E] = off_all / BM;
        sh_off[0] = 0;
        sh_off[1] = T;
        sh_tile[0] = 0;
        sh_tile[1] = cdiv(T, BM);
    }
}

/* Zeroes the padding rows [seg_off[e] + seg_cnt[e], seg_off[e + 1]) of a sorted [rows, W]
 * bf16 buffer (W a multiple of 8), one block per expert: the backward's dYs, so that the
 * products reading it whole (v1's tensor copies) see zeros there. */
__global__ void __launch_bounds__(256)
    moe_pad_zero(const int *seg_off, const int *seg_cnt, bf16 *buf, int W) {
    const int e = blockIdx.x;
    const int64_t r0 = (int64_t)seg_off[e] + seg_cnt[e], r1 = seg_off[e + 1];
    const int nc = W / 8;
    const int64_t n = (r1 - r0) * nc;
    for (int64_t i = threadIdx.x; i < n; i += 256) {
        const int64_t r = r0 + i / nc, c = i % nc;
        *reinterpret_cast<uint4 *>(buf + r * W + 8 * c) = make_uint4(0u, 0u, 0u, 0u);
    }
}

/* Stable scatter of chunk blockIdx.x: in order of the flat index i = t k + j, each kept
 * assignment gets the next sorted row of its expert. Per 256 assignments: rank among the
 * same expert inside the warp (__match_any_sync), the counts of the warps before it, and
 * the chunk's running row per expert. */
__global__ void __launch_bounds__(256)
    moe_scatter(const int32_t *idx, int64_t n, int k, int E, const int *base, int *perm, int *ptok,
                int *inv) {
    __shared__ int run[MAX_E];
    __shared__ int wc[8][MAX_E];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += 256) {
        run[e] = base[(int64_t)blockIdx.x * E + e];
#pragma unroll
        for (int w = 0; w < 8; w++)
            wc[w][e] = 0;
    }
    __syncthreads();
    const int64_t i0 = (int64_t)blockIdx.x * CH;
    const unsigned lt = (1u << lane) - 1u;
    for (int sub = 0; sub < CH && i0 + sub < n; sub += 256) {
        const int64_t i = i0 + sub + tid;
        const int e0 = i < n ? idx[i] : -1;
        const bool valid = e0 >= 0 && e0 < E;
        const int e = valid ? e0 : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & lt);
        if (valid && (__ffs(peers) - 1) == lane)
            wc[warp][e] = __popc(peers);
        __syncthreads();
        if (valid) {
            int pos = run[e] + rank;
            for (int w = 0; w < warp; w++)
                pos += wc[w][e];
            perm[pos] = (int)i;
            ptok[pos] = (int)(i / k);
            inv[i] = pos;
        } else if (i < n) {
            inv[i] = -1;
        }
        __syncthreads();
        for (int x = tid; x < E; x += 256) {
            int s = 0;
#pragma unroll
            for (int w = 0; w < 8; w++) {
                s += wc[w][x];
                wc[w][x] = 0;
            }
            run[x] += s;
        }
        __syncthreads();
    }
}

/* ---------------------------------------------------------------- gathers */

/* out[t] = (accumulate ? out[t] : 0) + sum_{j, inv >= 0} w[t,j] src[inv[t,j]] (w NULL:
 * unit weights), fp32, in j order. One warp per token, 8 values per lane per step. */
__global__ void __launch_bounds__(256)
    moe_combine(int T, int D, int k, const int *inv, const float *w, const bf16 *src, bf16 *out,
                int accumulate) {
    const int lane = threadIdx.x & 31, nc = D / 8;
    const int nw = gridDim.x * 8;
    for (int t = blockIdx.x * 8 + (threadIdx.x >> 5); t < T; t += nw) {
        const int64_t b = (int64_t)t * k;
        const int my_s = lane < k ? inv[b + lane] : -1;
        const float my_w = lane < k ? (w ? w[b + lane] : 1.0f) : 0.0f;
        bf16 *o = out + (int64_t)t * D;
        for (int c0 = 0; c0 < nc; c0 += 32) {
            const int c = c0 + lane;
            const bool act = c < nc;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (act && accumulate)
                ld8(acc, o + 8 * c);
            for (int j = 0; j < k; j++) {
                const int s = __shfl_sync(0xffffffffu, my_s, j);
                const float wj = __shfl_sync(0xffffffffu, my_w, j);
                if (s >= 0 && act) {
                    float v[8];
                    ld8(v, src + (int64_t)s * D + 8 * c);
#pragma unroll
                    for (int q = 0; q < 8; q++)
                        acc[q] = fmaf(wj, v[q], acc[q]);
                }
            }
            if (act)
                st8(o + 8 * c, acc);
        }
    }
}

/* Backward entry, per token t and slot j with sorted row s = inv[t,j] >= 0:
 * dtopk[t,j] = <dy[t], Ys[s]> (fp32, lanes then a fixed butterfly) and dYs[s] = w dy[t];
 * dtopk[t,j] = 0 where dropped. */
__global__ void __launch_bounds__(256)
    moe_dys(int T, int D, int k, const int *inv, const float *w, const bf16 *dy, const bf16 *Ys,
            bf16 *dYs, float *dtopk) {
    const int lane = threadIdx.x & 31, nc = D / 8;
    const int nw = gridDim.x * 8;
    for (int t = blockIdx.x * 8 + (threadIdx.x >> 5); t < T; t += nw) {
        const int64_t b = (int64_t)t * k;
        const int my_s = lane < k ? inv[b + lane] : -1;
        const float my_w = lane < k ? w[b + lane] : 0.0f;
        const bf16 *g = dy + (int64_t)t * D;
        for (int j = 0; j < k; j++) {
            const int s = __shfl_sync(0xffffffffu, my_s, j);
            const float wj = __shfl_sync(0xffffffffu, my_w, j);
            if (s < 0) {
                if (lane == 0 && dtopk)
                    dtopk[b + j] = 0.0f;
                continue;
            }
            float dot = 0.0f;
            for (int c = lane; c < nc; c += 32) {
                float gv[8], yv[8];
                ld8(gv, g + 8 * c);
                ld8(yv, Ys + (int64_t)s * D + 8 * c);
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    dot = fmaf(gv[q], yv[q], dot);
                    gv[q] *= wj;
                }
                st8(dYs + (int64_t)s * D + 8 * c, gv);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (lane == 0 && dtopk)
                dtopk[b + j] = dot;
        }
    }
}

/* ---------------------------------------------------------------- host side */

struct Dims {
    int T, D, F, E, k, fs, nch;
    int64_t Tk;
    int64_t R; /* rows of the sorted buffers: T k plus up to BM - 1 padding rows per expert */
};

lm_status get_dims(const lm_moe_config *c, int T, Dims *d, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: config is required");
    LM_TRY(lm_moe_config_validate(c, err));
    if (T < 0)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: T = %d tokens (must be >= 0)", T);
    d->T = T;
    d->D = c->hidden_size;
    d->F = c->moe_intermediate_size;
    d->E = c->router.num_experts;
    d->k = c->router.num_experts_per_tok;
    d->fs = c->n_shared_experts * c->moe_intermediate_size;
    d->Tk = (int64_t)T * d->k;
    d->R = d->Tk + (int64_t)(BM - 1) * d->E;
    if (d->D % 8)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: hidden_size = %d is not supported (a multiple of 8)", d->D);
    if (d->F % 8)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: moe_intermediate_size = %d is not supported (a multiple of 8)",
                         d->F);
    if (d->E > MAX_E)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: num_experts = %d is not supported (at most %d)", d->E, MAX_E);
    if (d->k > MAX_K)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: num_experts_per_tok = %d is not supported (at most %d)", d->k,
                         MAX_K);
    if (d->R >= INT32_MAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: T * num_experts_per_tok = %lld is not supported (below 2^31)",
                         (long long)d->Tk);
    d->nch = (int)((d->Tk + CH - 1) / CH);
    return LM_OK;
}

struct Saved {
    int *perm, *ptok, *inv, *seg_off, *seg_cnt, *tile_off, *sh_off, *sh_tile;
    bf16 *H, *A, *Ys, *Hsh, *Ash;
};
struct Scratch {
    int *cnt;              /* forward */
    bf16 *dYs, *dH, *dHsh; /* backward; dYs later holds the routed dX */
};

/* A bump allocator over a buffer (base NULL: sizes only), 256-byte aligned pieces. */
struct Carve {
    unsigned char *base;
    size_t off = 0;
    template <typename T> T *take(int64_t n) {
        T *p = base ? reinterpret_cast<T *>(base + off) : nullptr;
        off += ((size_t)n * sizeof(T) + 255) / 256 * 256;
        return p;
    }
};

size_t saved_layout(const Dims &d, void *base, Saved *s) {
    Carve c{(unsigned char *)base};
    s->perm = c.take<int>(d.R);
    s->ptok = c.take<int>(d.R);
    s->inv = c.take<int>(d.Tk);
    s->seg_off = c.take<int>(d.E + 1);
    s->seg_cnt = c.take<int>(d.E);
    s->tile_off = c.take<int>(d.E + 1);
    s->sh_off = c.take<int>(2);
    s->sh_tile = c.take<int>(2);
    s->H = c.take<bf16>(d.R * 2 * d.F);
    s->A = c.take<bf16>(d.R * d.F);
    s->Ys = c.take<bf16>(d.R * d.D);
    s->Hsh = c.take<bf16>((int64_t)d.T * 2 * d.fs);
    s->Ash = c.take<bf16>((int64_t)d.T * d.fs);
    return c.off;
}

size_t scratch_layout(const Dims &d, void *base, Scratch *s) {
    Carve f{(unsigned char *)base};
    s->cnt = f.take<int>((int64_t)d.nch * d.E);
    Carve b{(unsigned char *)base};
    s->dYs = b.take<bf16>(d.R * d.D);
    s->dH = b.take<bf16>(d.R * 2 * d.F);
    s->dHsh = b.take<bf16>((int64_t)d.T * 2 * d.fs);
    return f.off > b.off ? f.off : b.off;
}

lm_cuda_moe_opts get_opts(const lm_cuda_moe_opts *o) {
    lm_cuda_moe_opts r;
    r.gemm = LM_CUDA_MOE_GEMM_WGMMA;
    r.max_ctas = 0;
    r.gemm_only = 0;
    r.variant = LM_CUDA_MOE_VARIANT_DEFAULT;
    r.gemm_mask = 0;
    if (o)
        r = *o;
    if (!r.gemm_only || r.gemm_mask == 0)
        r.gemm_mask = ~0;
    return r;
}

/* The context's cuTensorMapEncodeTiled (LM_SLOT_MOE state, fetched on first use); NULL
 * when the driver has none (v1 then runs as v0). */
struct MoeState {
    bool tried = false;
    EncodeFn enc = nullptr;
};
EncodeFn moe_encoder(lm_cuda_ctx *ctx) {
    MoeState *st = lm_cuda_ctx_get<MoeState>(ctx, LM_SLOT_MOE);
    if (!st->tried) {
        st->tried = true;
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            st->enc = (EncodeFn)f;
        else
            cudaGetLastError();
    }
    return st->enc;
}

/* A bf16 tensor map of rank 2 or 3 (dims innermost first, strides in bytes of dims 1..,
 * box in elements), 128-byte swizzle, zeros outside; false when the driver refuses it or
 * the base is not 16-byte aligned. */
bool enc_map(EncodeFn fn, CUtensorMap *m, const void *base, int rank, const uint64_t *dims,
             const uint64_t *strides, const uint32_t *box) {
    if (!fn || !base || ((uintptr_t)base & 15))
        return false;
    cuuint64_t d[3], st[2];
    cuuint32_t b[3], es[3] = {1, 1, 1};
    for (int i = 0; i < rank; i++) {
        d[i] = dims[i];
        b[i] = box[i];
        if (i + 1 < rank)
            st[i] = strides[i];
    }
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, const_cast<void *>(base), d,
              st, b, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
/* [rows][cols] row-major, boxes of 64 columns x br rows */
bool map_rows(EncodeFn fn, CUtensorMap *m, const void *base, int64_t rows, int cols, int br) {
    const uint64_t dims[2] = {(uint64_t)cols, (uint64_t)rows}, st[1] = {(uint64_t)cols * 2};
    const uint32_t box[2] = {64, (uint32_t)br};
    return enc_map(fn, m, base, 2, dims, st, box);
}
/* [G][rows][cols] (per-expert weights), boxes of 64 columns x br rows of one group */
bool map_groups(EncodeFn fn, CUtensorMap *m, const void *base, int G, int rows, int cols, int br) {
    const uint64_t dims[3] = {(uint64_t)cols, (uint64_t)rows, (uint64_t)G};
    const uint64_t st[2] = {(uint64_t)cols * 2, (uint64_t)rows * cols * 2};
    const uint32_t box[3] = {64, (uint32_t)br, 1};
    return enc_map(fn, m, base, 3, dims, st, box);
}
/* [rows][2][F] ([g | u] / [dg | du] rows), boxes of 64 columns of one half x br rows */
bool map_halves(EncodeFn fn, CUtensorMap *m, const void *base, int64_t rows, int F, int br) {
    const uint64_t dims[3] = {(uint64_t)F, 2, (uint64_t)rows};
    const uint64_t st[2] = {(uint64_t)F * 2, (uint64_t)F * 4};
    const uint32_t box[3] = {64, 1, (uint32_t)br};
    return enc_map(fn, m, base, 3, dims, st, box);
}
bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* v1's maps of one product over groups of rows R (the sorted buffers' rows: d.R routed,
 * T shared); false when one cannot be made (the product runs as v0). The pointers the
 * kernel stores through must be 16-byte aligned too. */
template <int KIND> bool v1_maps(EncodeFn fn, const GArgs &a, int64_t R, TMaps *m) {
    if (!fn)
        return false;
    const int D = a.D, F = a.F, G = a.G;
    if constexpr (KIND == K_GATEUP)
        return al16(a.X) && al16(a.A) && (!a.H || al16(a.H)) &&
               map_groups(fn, &m->b0, a.Wg, G, F, D, 128) &&
               map_groups(fn, &m->b1, a.Wu, G, F, D, 128);
    if constexpr (KIND == K_DOWN)
        return al16(a.Y) && map_rows(fn, &m->a, a.A, R, F, 128) &&
               map_groups(fn, &m->b0, a.Wd, G, D, F, 256);
    if constexpr (KIND == K_DDOWN)
        return al16(a.H) && al16(a.dH) && map_rows(fn, &m->a, a.dY, R, D, 128) &&
               map_groups(fn, &m->b0, a.Wd, G, D, F, 64);
    if constexpr (KIND == K_DGATEUP)
        return al16(a.dX) && map_halves(fn, &m->a, a.dH, R, F, 128) &&
               map_groups(fn, &m->b0, a.Wg, G, F, D, 64) &&
               map_groups(fn, &m->b1, a.Wu, G, F, D, 64);
    if constexpr (KIND == K_WDOWN)
        return al16(a.dWd) && map_rows(fn, &m->a, a.dY, R, D, 64) &&
               map_rows(fn, &m->b0, a.A, R, F, 64);
    return al16(a.X) && (!a.dWg || al16(a.dWg)) && (!a.dWu || al16(a.dWu)) &&
           map_halves(fn, &m->a, a.dH, R, F, 64); /* K_WGATEUP */
}

/* One grouped product. rows: the sorted rows the groups hold (R routed, T shared), for
 * the bound on the number of 128-row tiles and v1's maps. */
template <int KIND>
lm_status run_gemm(lm_cuda_ctx *ctx, const GArgs &a, int64_t rows, const lm_cuda_moe_opts &o,
                   lm_error *err) {
    const int64_t ntn = n_tiles_n<KIND>(a.D, a.F);
    TMaps maps;
    memset(&maps, 0, sizeof maps);
    /* the default is v1 where its maps can be made, v0 otherwise; v1 asked for by name
     * fails instead (so that a benchmark of v1 never times v0) */
    const bool want_v1 =
        o.gemm == LM_CUDA_MOE_GEMM_WGMMA &&
        (o.variant == LM_CUDA_MOE_VARIANT_TMA || o.variant == LM_CUDA_MOE_VARIANT_DEFAULT);
    const bool v1 = want_v1 && v1_maps<KIND>(moe_encoder(ctx), a, rows, &maps);
    if (want_v1 && !v1 && o.variant == LM_CUDA_MOE_VARIANT_TMA)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: opts.variant = %d (tensor copies) cannot run product %d: no "
                         "cuTensorMapEncodeTiled in the driver, a map it refuses, or a buffer "
                         "not 16-byte aligned",
                         o.variant, KIND);
    const int64_t mgk = v1 ? v1_m_tiles_gk<KIND>(a.D, a.F) : m_tiles_gk<KIND>(a.D, a.F);
    const int64_t bound =
        GK<KIND> ? (int64_t)a.G * mgk * ntn : ((rows + (int64_t)(BM - 1) * a.G) / BM) * ntn;
    if (bound <= 0)
        return LM_OK;
    int cap = o.max_ctas > 0 ? o.max_ctas : ctx->sm_count;
    if (o.gemm == LM_CUDA_MOE_GEMM_SIMPLE) {
        const void *kf = (const void *)moe_gemm_simple<KIND>;
        if (lm_cuda_ctx_first_use(ctx, kf))
            LM_CK(cudaFuncSetAttribute(moe_gemm_simple<KIND>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, SIMPLE_SMEM));
        if (o.max_ctas <= 0)
            cap = 2 * ctx->sm_count;
        const int grid = (int)(bound < cap ? bound : cap);
        moe_gemm_simple<KIND><<<grid, SIMPLE_THREADS, SIMPLE_SMEM, ctx->stream>>>(a);
        LM_CK_LAUNCH("moe_gemm_simple");
        return LM_OK;
    }
    const int grid = (int)(bound < cap ? bound : cap);
    if (v1) {
        const void *kf = (const void *)moe_gemm_v1<KIND>;
        if (lm_cuda_ctx_first_use(ctx, kf))
            LM_CK(cudaFuncSetAttribute(moe_gemm_v1<KIND>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, V1_SMEM));
        moe_gemm_v1<KIND><<<grid, WG_THREADS, V1_SMEM, ctx->stream>>>(a, maps);
        LM_CK_LAUNCH("moe_gemm_v1");
        return LM_OK;
    }
    const void *kf = (const void *)moe_gemm_wg<KIND>;
    if (lm_cuda_ctx_first_use(ctx, kf))
        LM_CK(cudaFuncSetAttribute(moe_gemm_wg<KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   WG_SMEM));
    moe_gemm_wg<KIND><<<grid, WG_THREADS, WG_SMEM, ctx->stream>>>(a);
    LM_CK_LAUNCH("moe_gemm_wg");
    return LM_OK;
}

int gather_grid(const lm_cuda_ctx *ctx, int T) {
    const int b = cdiv(T, 8), cap = ctx->sm_count * 8;
    return b < cap ? (b > 0 ? b : 1) : cap;
}

lm_status check_weights(const Dims &d, const lm_cuda_moe_weights *w, lm_error *err) {
    if (!w)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: weights are required");
    const char *miss = !w->gate_proj   ? "gate_proj"
                       : !w->up_proj   ? "up_proj"
                       : !w->down_proj ? "down_proj"
                                       : nullptr;
    if (!miss && d.fs > 0)
        miss = !w->shared_gate_proj   ? "shared_gate_proj (n_shared_experts > 0)"
               : !w->shared_up_proj   ? "shared_up_proj (n_shared_experts > 0)"
               : !w->shared_down_proj ? "shared_down_proj (n_shared_experts > 0)"
                                      : nullptr;
    if (miss)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: weight '%s' is NULL", miss);
    return LM_OK;
}

lm_status check_opts(const lm_cuda_moe_opts &o, lm_error *err) {
    if (o.gemm != LM_CUDA_MOE_GEMM_WGMMA && o.gemm != LM_CUDA_MOE_GEMM_SIMPLE)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: opts.gemm = %d (0 or 1)", o.gemm);
    if (o.variant != LM_CUDA_MOE_VARIANT_DEFAULT && o.variant != LM_CUDA_MOE_VARIANT_CPASYNC &&
        o.variant != LM_CUDA_MOE_VARIANT_TMA)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: opts.variant = %d (0, 1 or 2)", o.variant);
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_cuda_moe_plan(const lm_moe_config *c, int T, lm_cuda_moe_sizes *out,
                                      lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda: plan output is NULL");
    Dims d = {};
    LM_TRY(get_dims(c, T, &d, err));
    Saved s;
    Scratch x;
    out->saved_bytes = saved_layout(d, nullptr, &s);
    out->scratch_bytes = scratch_layout(d, nullptr, &x);
    return LM_OK;
}

extern "C" double lm_cuda_moe_forward_flops(const lm_moe_config *c, int64_t T,
                                            int64_t assignments) {
    const double d = c->hidden_size, f = c->moe_intermediate_size;
    const double fs = (double)c->n_shared_experts * f;
    return 6.0 * d * f * (double)assignments + 6.0 * (double)T * d * fs;
}

extern "C" lm_status lm_cuda_moe_forward(lm_cuda_ctx *ctx, const lm_moe_config *c, int T,
                                         const lm_cuda_moe_weights *w, const void *x,
                                         const int32_t *topk_idx, const float *topk_weight,
                                         const int32_t *counts, int training, void *saved,
                                         void *scratch, void *y, const lm_cuda_moe_opts *opts,
                                         lm_error *err) {
    (void)counts; /* the permutation recounts topk_idx (see the header) */
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    Dims d = {};
    LM_TRY(get_dims(c, T, &d, err));
    LM_TRY(check_weights(d, w, err));
    const char *miss = !x             ? "x"
                       : !topk_idx    ? "topk_idx"
                       : !topk_weight ? "topk_weight"
                       : !saved       ? "saved"
                       : !y           ? "y"
                                      : nullptr;
    if (miss)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda forward: '%s' is NULL", miss);
    const lm_cuda_moe_opts o = get_opts(opts);
    LM_TRY(check_opts(o, err));
    if (T == 0)
        return LM_OK;
    Saved s;
    saved_layout(d, saved, &s);
    Scratch sc;
    const size_t sbytes = scratch_layout(d, nullptr, &sc);
    if (!scratch)
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_D, sbytes, &scratch, err));
    scratch_layout(d, scratch, &sc);

    if (!o.gemm_only) {
        moe_hist<<<d.nch, 256, 0, ctx->stream>>>(topk_idx, d.Tk, d.E, sc.cnt);
        LM_CK_LAUNCH("moe_hist");
        moe_scan<<<1, 1024, 0, ctx->stream>>>(sc.cnt, d.nch, d.E, d.T, s.seg_off, s.seg_cnt,
                                              s.tile_off, s.sh_off, s.sh_tile);
        LM_CK_LAUNCH("moe_scan");
        moe_scatter<<<d.nch, 256, 0, ctx->stream>>>(topk_idx, d.Tk, d.k, d.E, sc.cnt, s.perm,
                                                    s.ptok, s.inv);
        LM_CK_LAUNCH("moe_scatter");
    }
    GArgs r = {};
    r.seg_off = s.seg_off;
    r.seg_cnt = s.seg_cnt;
    r.tile_off = s.tile_off;
    r.G = d.E;
    r.D = d.D;
    r.F = d.F;
    r.pad = 1;
    r.X = (const bf16 *)x;
    r.xrow = s.ptok;
    r.Wg = (const bf16 *)w->gate_proj;
    r.Wu = (const bf16 *)w->up_proj;
    r.Wd = (const bf16 *)w->down_proj;
    r.H = training ? s.H : nullptr;
    r.A = s.A;
    r.Y = s.Ys;
    if (o.gemm_mask & LM_CUDA_MOE_P_GATEUP)
        LM_TRY(run_gemm<K_GATEUP>(ctx, r, d.R, o, err));
    if (o.gemm_mask & LM_CUDA_MOE_P_DOWN)
        LM_TRY(run_gemm<K_DOWN>(ctx, r, d.R, o, err));
    if (o.gemm_only)
        return LM_OK;
    if (d.fs > 0) { /* S(x) straight into y; the combine adds the routed part */
        GArgs sh = {};
        sh.seg_off = s.sh_off;
        sh.tile_off = s.sh_tile;
        sh.G = 1;
        sh.D = d.D;
        sh.F = d.fs;
        sh.X = (const bf16 *)x;
        sh.Wg = (const bf16 *)w->shared_gate_proj;
        sh.Wu = (const bf16 *)w->shared_up_proj;
        sh.Wd = (const bf16 *)w->shared_down_proj;
        sh.H = training ? s.Hsh : nullptr;
        sh.A = s.Ash;
        sh.Y = (bf16 *)y;
        LM_TRY(run_gemm<K_GATEUP>(ctx, sh, d.T, o, err));
        LM_TRY(run_gemm<K_DOWN>(ctx, sh, d.T, o, err));
    }
    moe_combine<<<gather_grid(ctx, d.T), 256, 0, ctx->stream>>>(d.T, d.D, d.k, s.inv, topk_weight,
                                                                s.Ys, (bf16 *)y, d.fs > 0);
    LM_CK_LAUNCH("moe_combine");
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_backward(lm_cuda_ctx *ctx, const lm_moe_config *c, int T,
                                          const lm_cuda_moe_weights *w, const void *x,
                                          const float *topk_weight, const void *saved,
                                          void *scratch, const void *dy, void *dx,
                                          float *dtopk_weight, const lm_cuda_moe_grads *g,
                                          const lm_cuda_moe_opts *opts, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    Dims d = {};
    LM_TRY(get_dims(c, T, &d, err));
    LM_TRY(check_weights(d, w, err));
    const char *miss = !x             ? "x"
                       : !topk_weight ? "topk_weight"
                       : !saved       ? "saved"
                       : !dy          ? "dy"
                                      : nullptr;
    if (miss)
        return lm_errorf(err, LM_ERR_INVALID, "moe cuda backward: '%s' is NULL", miss);
    const lm_cuda_moe_opts o = get_opts(opts);
    LM_TRY(check_opts(o, err));
    if (T == 0)
        return LM_OK;
    const lm_cuda_moe_grads none = {};
    if (!g)
        g = &none;
    Saved s;
    saved_layout(d, (void *)saved, &s);
    Scratch sc;
    const size_t sbytes = scratch_layout(d, nullptr, &sc);
    if (!scratch)
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_D, sbytes, &scratch, err));
    scratch_layout(d, scratch, &sc);

    if (!o.gemm_only) {
        moe_dys<<<gather_grid(ctx, d.T), 256, 0, ctx->stream>>>(
            d.T, d.D, d.k, s.inv, topk_weight, (const bf16 *)dy, s.Ys, sc.dYs, dtopk_weight);
        LM_CK_LAUNCH("moe_dys");
        moe_pad_zero<<<d.E, 256, 0, ctx->stream>>>(s.seg_off, s.seg_cnt, sc.dYs, d.D);
        LM_CK_LAUNCH("moe_pad_zero");
    }
    GArgs r = {};
    r.seg_off = s.seg_off;
    r.seg_cnt = s.seg_cnt;
    r.tile_off = s.tile_off;
    r.G = d.E;
    r.D = d.D;
    r.F = d.F;
    r.pad = 1;
    r.X = (const bf16 *)x;
    r.xrow = s.ptok;
    r.Wg = (const bf16 *)w->gate_proj;
    r.Wu = (const bf16 *)w->up_proj;
    r.Wd = (const bf16 *)w->down_proj;
    r.H = s.H;
    r.A = s.A;
    r.dY = sc.dYs;
    r.dH = sc.dH;
    r.dX = sc.dYs; /* dYs is dead once DDOWN and WDOWN have read it */
    r.dWg = g->gate_proj;
    r.dWu = g->up_proj;
    r.dWd = g->down_proj;
    if (o.gemm_mask & LM_CUDA_MOE_P_DDOWN)
        LM_TRY(run_gemm<K_DDOWN>(ctx, r, d.R, o, err));
    if (r.dWd && (o.gemm_mask & LM_CUDA_MOE_P_WDOWN))
        LM_TRY(run_gemm<K_WDOWN>(ctx, r, d.R, o, err));
    if (dx && (o.gemm_mask & LM_CUDA_MOE_P_DGATEUP))
        LM_TRY(run_gemm<K_DGATEUP>(ctx, r, d.R, o, err));
    if ((r.dWg || r.dWu) && (o.gemm_mask & LM_CUDA_MOE_P_WGATEUP))
        LM_TRY(run_gemm<K_WGATEUP>(ctx, r, d.R, o, err));
    if (o.gemm_only)
        return LM_OK;
    if (d.fs > 0) { /* the shared experts: upstream dy itself (unit weight), dX into dx */
        GArgs sh = {};
        sh.seg_off = s.sh_off;
        sh.tile_off = s.sh_tile;
        sh.G = 1;
        sh.D = d.D;
        sh.F = d.fs;
        sh.X = (const bf16 *)x;
        sh.Wg = (const bf16 *)w->shared_gate_proj;
        sh.Wu = (const bf16 *)w->shared_up_proj;
        sh.Wd = (const bf16 *)w->shared_down_proj;
        sh.H = s.Hsh;
        sh.A = s.Ash;
        sh.dY = (const bf16 *)dy;
        sh.dH = sc.dHsh;
        sh.dX = (bf16 *)dx;
        sh.dWg = g->shared_gate_proj;
        sh.dWu = g->shared_up_proj;
        sh.dWd = g->shared_down_proj;
        LM_TRY(run_gemm<K_DDOWN>(ctx, sh, d.T, o, err));
        if (sh.dWd)
            LM_TRY(run_gemm<K_WDOWN>(ctx, sh, d.T, o, err));
        if (dx)
            LM_TRY(run_gemm<K_DGATEUP>(ctx, sh, d.T, o, err));
        if (sh.dWg || sh.dWu)
            LM_TRY(run_gemm<K_WGATEUP>(ctx, sh, d.T, o, err));
    }
    if (dx) {
        moe_combine<<<gather_grid(ctx, d.T), 256, 0, ctx->stream>>>(d.T, d.D, d.k, s.inv, nullptr,
                                                                    sc.dYs, (bf16 *)dx, d.fs > 0);
        LM_CK_LAUNCH("moe_combine (dx)");
    }
    return LM_OK;
}
