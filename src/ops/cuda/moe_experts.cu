/* MoE experts on the GPU (include/linmoe/cuda_moe.h): the stable counting-sort
 * permutation, the grouped GEMMs (wgmma, warp-specialised, persistent; and a plain
 * reference kernel with the same tiles and epilogues), the fused SwiGLU forward /
 * backward epilogues, the combine / dx gathers and the dtopk_weight dot products, and the
 * forward / backward orchestration. Math and layouts: the header. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "linmoe/cuda_moe.h"
#include "ops/cuda/ctx.cuh"

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
    const int *tile_off; /* [G+1] first 128-row tile of each group (GATEUP .. DGATEUP) */
    int G, D, F;
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

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
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
/* this thread's generic-proxy shared-memory writes (its landed cp.async copies) made
 * visible to the async proxy wgmma reads through */
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
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
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void keep_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
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

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
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
    int m0;  /* M offset of the tile (rows within the group, or the weight-gradient row) */
    int n0;  /* N offset (GATEUP: the f offset of the 128 gate / up columns) */
    int K;
};

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
        t.seg = a.seg_off[t.g];
        t.mg = a.seg_off[t.g + 1] - t.seg;
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
    t.seg = a.seg_off[lo];
    t.mg = a.seg_off[lo + 1] - t.seg;
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
        if (m >= t.mg || f >= a.F)
            return;
        const int64_t row = t.seg + m;
        if (a.H) {
            st_bf16x2(a.H + row * 2 * a.F + f, v0, v1);
            st_bf16x2(a.H + row * 2 * a.F + a.F + f, p0, p1);
        }
        st_bf16x2(a.A + row * a.F + f, v0 * sigmoid_(v0) * p0, v1 * sigmoid_(v1) * p1);
    } else if constexpr (KIND == K_DOWN || KIND == K_DGATEUP) {
        const int m = t.m0 + r, n = t.n0 + c;
        if (m >= t.mg || n >= a.D)
            return;
        st_bf16x2((KIND == K_DOWN ? a.Y : a.dX) + (int64_t)(t.seg + m) * a.D + n, v0, v1);
    } else if constexpr (KIND == K_DDOWN) {
        const int m = t.m0 + r, f = t.n0 + c;
        if (m >= t.mg || f >= a.F)
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
        keep_regs(acc);
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
 * chunk c's assignments to e; seg_off / tile_off the exclusive prefixes of the experts'
 * counts and 128-row tile counts; sh_off / sh_tile the shared experts' one group. */
__global__ void __launch_bounds__(1024) moe_scan(int *cnt, int nch, int E, int T, int *seg_off,
                                                 int *tile_off, int *sh_off, int *sh_tile) {
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
    int off, off_all, tl, tl_all;
    block_scan(total, ws, off, off_all);
    block_scan(cdiv(total, BM), ws, tl, tl_all);
    if (e < E) {
        seg_off[e] = off;
        tile_off[e] = tl;
        for (int c = 0; c < nch; c++)
            cnt[(int64_t)c * E + e] += off;
    }
    if (e == 0) {
        seg_off[E] = off_all;
        tile_off[E] = tl_all;
        sh_off[0] = 0;
        sh_off[1] = T;
        sh_tile[0] = 0;
        sh_tile[1] = cdiv(T, BM);
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
    if (d->Tk + (int64_t)(BM - 1) * d->E >= INT32_MAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe cuda: T * num_experts_per_tok = %lld is not supported (below 2^31)",
                         (long long)d->Tk);
    d->nch = (int)((d->Tk + CH - 1) / CH);
    return LM_OK;
}

struct Saved {
    int *perm, *ptok, *inv, *seg_off, *tile_off, *sh_off, *sh_tile;
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
    s->perm = c.take<int>(d.Tk);
    s->ptok = c.take<int>(d.Tk);
    s->inv = c.take<int>(d.Tk);
    s->seg_off = c.take<int>(d.E + 1);
    s->tile_off = c.take<int>(d.E + 1);
    s->sh_off = c.take<int>(2);
    s->sh_tile = c.take<int>(2);
    s->H = c.take<bf16>(d.Tk * 2 * d.F);
    s->A = c.take<bf16>(d.Tk * d.F);
    s->Ys = c.take<bf16>(d.Tk * d.D);
    s->Hsh = c.take<bf16>((int64_t)d.T * 2 * d.fs);
    s->Ash = c.take<bf16>((int64_t)d.T * d.fs);
    return c.off;
}

size_t scratch_layout(const Dims &d, void *base, Scratch *s) {
    Carve f{(unsigned char *)base};
    s->cnt = f.take<int>((int64_t)d.nch * d.E);
    Carve b{(unsigned char *)base};
    s->dYs = b.take<bf16>(d.Tk * d.D);
    s->dH = b.take<bf16>(d.Tk * 2 * d.F);
    s->dHsh = b.take<bf16>((int64_t)d.T * 2 * d.fs);
    return f.off > b.off ? f.off : b.off;
}

lm_cuda_moe_opts get_opts(const lm_cuda_moe_opts *o) {
    lm_cuda_moe_opts r = {LM_CUDA_MOE_GEMM_WGMMA, 0, 0};
    if (o)
        r = *o;
    return r;
}

/* One grouped product. rows: the sorted rows the groups can hold (T k routed, T shared),
 * for the bound on the number of 128-row tiles. */
template <int KIND>
lm_status run_gemm(lm_cuda_ctx *ctx, const GArgs &a, int64_t rows, const lm_cuda_moe_opts &o,
                   lm_error *err) {
    const int64_t ntn = n_tiles_n<KIND>(a.D, a.F);
    const int64_t bound = GK<KIND> ? (int64_t)a.G * m_tiles_gk<KIND>(a.D, a.F) * ntn
                                   : ((rows + (int64_t)(BM - 1) * a.G) / BM) * ntn;
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
    const void *kf = (const void *)moe_gemm_wg<KIND>;
    if (lm_cuda_ctx_first_use(ctx, kf))
        LM_CK(cudaFuncSetAttribute(moe_gemm_wg<KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   WG_SMEM));
    const int grid = (int)(bound < cap ? bound : cap);
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
    if (T == 0)
        return LM_OK;
    const lm_cuda_moe_opts o = get_opts(opts);
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
        moe_scan<<<1, 1024, 0, ctx->stream>>>(sc.cnt, d.nch, d.E, d.T, s.seg_off, s.tile_off,
                                              s.sh_off, s.sh_tile);
        LM_CK_LAUNCH("moe_scan");
        moe_scatter<<<d.nch, 256, 0, ctx->stream>>>(topk_idx, d.Tk, d.k, d.E, sc.cnt, s.perm,
                                                    s.ptok, s.inv);
        LM_CK_LAUNCH("moe_scatter");
    }
    GArgs r = {};
    r.seg_off = s.seg_off;
    r.tile_off = s.tile_off;
    r.G = d.E;
    r.D = d.D;
    r.F = d.F;
    r.X = (const bf16 *)x;
    r.xrow = s.ptok;
    r.Wg = (const bf16 *)w->gate_proj;
    r.Wu = (const bf16 *)w->up_proj;
    r.Wd = (const bf16 *)w->down_proj;
    r.H = training ? s.H : nullptr;
    r.A = s.A;
    r.Y = s.Ys;
    LM_TRY(run_gemm<K_GATEUP>(ctx, r, d.Tk, o, err));
    LM_TRY(run_gemm<K_DOWN>(ctx, r, d.Tk, o, err));
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
    if (T == 0)
        return LM_OK;
    const lm_cuda_moe_opts o = get_opts(opts);
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
    }
    GArgs r = {};
    r.seg_off = s.seg_off;
    r.tile_off = s.tile_off;
    r.G = d.E;
    r.D = d.D;
    r.F = d.F;
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
    LM_TRY(run_gemm<K_DDOWN>(ctx, r, d.Tk, o, err));
    if (r.dWd)
        LM_TRY(run_gemm<K_WDOWN>(ctx, r, d.Tk, o, err));
    if (dx)
        LM_TRY(run_gemm<K_DGATEUP>(ctx, r, d.Tk, o, err));
    if (r.dWg || r.dWu)
        LM_TRY(run_gemm<K_WGATEUP>(ctx, r, d.Tk, o, err));
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
