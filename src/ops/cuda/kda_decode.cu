/* KDA / GDN decode step on the GPU (include/linmoe/kda_cuda.h has the contract).
 *
 * Math per (sequence b, value head hv), reference/kda.md §1.2-1.3 and §6.3, with q
 * already scaled and l2-normalised, k l2-normalised, e = exp(g) (per channel for KDA,
 * one value for GDN), state S [K,V] fp32 row-major:
 *   S'  = Diag(e) S                      (the decayed state, never stored)
 *   p   = S'^T k,  o' = S'^T q           (two reductions over K per value column)
 *   u   = beta (v - p)
 *   S  <- S' + k u^T
 *   o   = S^T q = o' + (k . q) u         (so o needs no second pass over the state)
 * Every value column c is independent: p_c, o'_c and the update of column c only
 * touch column c. So one pass suffices: read S, reduce, write S once.
 *
 * Kernel (purely memory-bound: ~7 flop per 8 bytes of state traffic):
 *   one CTA per (b, hv, slice of VS value columns); thread (tx, ty) owns VEC = 4
 *   adjacent columns (a 16-byte load) and the rows d = ty, ty + TY, ... (R of them),
 *   so a warp reads contiguous row segments (two 256-byte segments with the default
 *   64 columns per CTA, one 512-byte row with 128), coalesced along V. The state
 *   loads are issued first, all R at once (R float4 in registers per thread), and the
 *   small per-head vectors (q, k, gate, norms) are prepared while they are in
 *   flight. Partial sums over each thread's rows go through shared memory to the
 *   ty == 0 threads, which form u and o; u comes back through shared memory and
 *   every thread writes its rows of the new state from registers.
 *   V % 4 != 0 or a state pointer that is not 16-byte aligned takes the scalar
 *   (VEC = 1) instance of the same kernel.
 * Launch shape (chosen by A/B measurement): 128 threads per CTA, 64 value columns per
 * CTA (16 x 8 threads at V >= 64: K / 8 rows per thread), streaming cache hints
 * (ld.global.cs / st.global.cs) on the state; the scalar path takes 256 threads and
 * 32 columns without hints.
 *
 * The alternatives that lost their A/B test, their kernel instances, the timing harness and
 * the measurements live in dev/kda_decode_variants.cu (it includes this file); the current
 * numbers are in docs/perf-notes.md.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "linmoe/kda_cuda.h"
#include "ops/cuda/ctx.cuh"

#define DEC_KMAX 256  /* rows per thread R <= 32 with at least 8 row groups */
#define DEC_VMAX 1024 /* as lm_kda_validate */
#define DEC_RMAX 32

namespace {

struct DecParams {
    const __nv_bfloat16 *q, *k, *v, *g, *beta;
    const float *A_log, *dt_bias;
    float *S;
    __nv_bfloat16 *o;
    int H, HV, K, V, gdn, gate, l2, sig;
    float lb, scale;
    int TX, TY, VS, KP; /* threads along V and along K; columns per CTA (TX * VEC);
                           K rounded up to 4 (shared-memory offsets stay 16-byte aligned) */
};

__device__ __forceinline__ float dec_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The log-decay from the gate input x (reference/kda.md §1.3), as gate_act in
 * kda_fwd.cu: softplus threshold 20, absent A_log means exp(A_log) = 1, absent
 * dt_bias means 0. Full-precision expf: only K values per CTA. */
__device__ __forceinline__ float dec_gate(const DecParams &p, float x, int hv, int d) {
    const float a = p.A_log ? expf(p.A_log[hv]) : 1.0f;
    const float b = p.dt_bias ? p.dt_bias[p.gdn ? hv : hv * p.K + d] : 0.0f;
    if (p.gate == LM_GATE_SOFTPLUS) {
        const float z = x + b;
        const float sp = z > 20.0f ? z : log1pf(expf(z));
        return -a * sp;
    }
    if (p.gate == LM_GATE_BOUNDED)
        return p.lb * dec_sigmoid(a * (x + b));
    return x;
}

template <int VEC, bool ST>
__device__ __forceinline__ void ld_state(const float *ptr, float (&x)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 t = ST ? __ldcs(reinterpret_cast<const float4 *>(ptr))
                            : *reinterpret_cast<const float4 *>(ptr);
        x[0] = t.x;
        x[1] = t.y;
        x[2] = t.z;
        x[3] = t.w;
    } else {
        x[0] = ST ? __ldcs(ptr) : *ptr;
    }
}

template <int VEC, bool ST>
__device__ __forceinline__ void st_state(float *ptr, const float (&x)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 t = make_float4(x[0], x[1], x[2], x[3]);
        if (ST)
            __stcs(reinterpret_cast<float4 *>(ptr), t);
        else
            *reinterpret_cast<float4 *>(ptr) = t;
    } else {
        if (ST)
            __stcs(ptr, x[0]);
        else
            *ptr = x[0];
    }
}

/* shared-memory vector of VEC floats (16-byte aligned when VEC == 4) */
template <int VEC> __device__ __forceinline__ void ld_smem(const float *ptr, float (&x)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 t = *reinterpret_cast<const float4 *>(ptr);
        x[0] = t.x;
        x[1] = t.y;
        x[2] = t.z;
        x[3] = t.w;
    } else {
        x[0] = *ptr;
    }
}

template <int VEC> __device__ __forceinline__ void st_smem(float *ptr, const float (&x)[VEC]) {
    if constexpr (VEC == 4)
        *reinterpret_cast<float4 *>(ptr) = make_float4(x[0], x[1], x[2], x[3]);
    else
        *ptr = x[0];
}

/* CTAs per SM the register file allows at about regs + 32 registers per thread
 * (R float4 of state plus the accumulators and addresses), at most 1024 threads'
 * worth: the launch bound that keeps the state resident without spilling. */
constexpr int dec_min_blocks(int nt, int regs) {
    return 65536 / (nt * (regs + 32)) < 1           ? 1
           : 65536 / (nt * (regs + 32)) > 1024 / nt ? 1024 / nt
                                                    : 65536 / (nt * (regs + 32));
}

/* grid (B*HV, ceil(V / VS)); NT threads; dynamic shared memory
 * 4 * (5*KP + 2*VS + 4 + 2*TY*VS) bytes:
 *   ekq [KP] float2 (k e, q e), eki [KP] float2 (e, k), sq [KP] (raw q for the norm),
 *   sv [VS] v then fk u, sb beta, rp / ro [TY][VS] partial p and o'.
 * The l2-norm factors fk, fq are applied after the reductions, so the per-row
 * factors need no norm and come from one 8-byte shared load per row and phase.
 * FULL: every thread is active and owns exactly R rows (K == TY*R, V % VS == 0,
 * TX*TY == NT), so no per-row predicates are kept in registers. */
template <int NT, int VEC, int R, bool ST, bool FULL>
__global__ void __launch_bounds__(NT, dec_min_blocks(NT, VEC *R)) kda_decode(DecParams p) {
    extern __shared__ __align__(16) float smem[];
    const int K = p.K, V = p.V, HV = p.HV, TX = p.TX, TY = p.TY, VS = p.VS, KP = p.KP;
    float2 *ekq = reinterpret_cast<float2 *>(smem), *eki = ekq + KP;
    float *sq = reinterpret_cast<float *>(eki + KP), *sv = sq + KP, *sb = sv + VS;
    float *rp = sb + 4, *ro = rp + TY * VS;
    const int bh = blockIdx.x, hv = bh % HV, h = hv / (HV / p.H);
    const int c0 = blockIdx.y * VS;
    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX, lane = tid & 31;
    const int col = tx * VEC;
    const bool act = FULL || (ty < TY && c0 + col < V); /* V % VEC == 0 when VEC == 4 */
    /* this thread's rows d = ty + i*TY of the (b, hv) state block, columns c0 + col.. */
    const int64_t base = (int64_t)bh * K * V + c0 + col + (int64_t)ty * V;
    int rs = TY * V; /* < 2^18: offsets inside one block fit in 32 bits */

    /* 1. the state: all R loads in flight before anything else */
    float s[R][VEC];
    {
        const float *Sp = p.S + base;
#pragma unroll
        for (int i = 0; i < R; i++) {
            if (FULL || (act && ty + i * TY < K)) {
                ld_state<VEC, ST>(Sp + i * rs, s[i]);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    s[i][j] = 0.0f;
            }
        }
    }
    /* 2. q, k, exp(g), this CTA's v columns and beta to shared memory (not
     * unrolled: the state registers are live here, keep the rest small) */
    {
        const int64_t qk0 = ((int64_t)(bh / HV) * p.H + h) * K;
#pragma unroll 1
        for (int d = tid; d < K; d += NT) {
            const float q = __bfloat162float(p.q[qk0 + d]), k = __bfloat162float(p.k[qk0 + d]);
            const float x =
                p.gdn ? __bfloat162float(p.g[bh]) : __bfloat162float(p.g[(int64_t)bh * K + d]);
            const float e = expf(dec_gate(p, x, hv, d));
            ekq[d] = make_float2(k * e, q * e);
            eki[d] = make_float2(e, k);
            sq[d] = q;
        }
#pragma unroll 1
        for (int c = tid; c < VS; c += NT)
            sv[c] = c0 + c < V ? __bfloat162float(p.v[(int64_t)bh * V + c0 + c]) : 0.0f;
        if (tid == 0) {
            const float b = __bfloat162float(p.beta[bh]);
            sb[0] = p.sig ? dec_sigmoid(b) : b;
        }
    }
    __syncthreads();

    /* 3. partial sums over this thread's rows of (k e) S and (q e) S */
    float pp[VEC], po[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++)
        pp[j] = po[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++) {
        const int d = ty + i * TY;
        if (FULL || d < K) {
            const float2 f = ekq[d];
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                pp[j] = fmaf(f.x, s[i][j], pp[j]);
                po[j] = fmaf(f.y, s[i][j], po[j]);
            }
        }
    }
    if (act && ty > 0) {
        st_smem<VEC>(rp + ty * VS + col, pp);
        st_smem<VEC>(ro + ty * VS + col, po);
    }
    __syncthreads();
    /* 4. warp 0 (it holds every ty == 0 thread, TX <= 32): |q|^2, |k|^2, q.k, then
     * the ty == 0 threads: p = fk sum, o' = fq sum, u = beta (v - p),
     * o = o' + (k.q) u; fk u replaces v in shared memory */
    if (tid < 32) {
        float aq = 0.0f, ak = 0.0f, aqk = 0.0f;
#pragma unroll 1
        for (int d = lane; d < K; d += 32) {
            const float q = sq[d], k = eki[d].y;
            aq = fmaf(q, q, aq);
            ak = fmaf(k, k, ak);
            aqk = fmaf(q, k, aqk);
        }
#pragma unroll
        for (int off = 16; off; off >>= 1) {
            aq += __shfl_xor_sync(0xffffffffu, aq, off);
            ak += __shfl_xor_sync(0xffffffffu, ak, off);
            aqk += __shfl_xor_sync(0xffffffffu, aqk, off);
        }
        const float fq = (p.l2 ? rsqrtf(aq + 1e-6f) : 1.0f) * p.scale;
        const float fk = p.l2 ? rsqrtf(ak + 1e-6f) : 1.0f;
        if (act && ty == 0) {
#pragma unroll 1
            for (int t = 1; t < TY; t++) {
                float a[VEC], b[VEC];
                ld_smem<VEC>(rp + t * VS + col, a);
                ld_smem<VEC>(ro + t * VS + col, b);
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    pp[j] += a[j];
                    po[j] += b[j];
                }
            }
            const float kq = aqk * fq * fk, bt = sb[0];
            float u[VEC];
            ld_smem<VEC>(sv + col, u);
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                u[j] = bt * (u[j] - fk * pp[j]);
                p.o[(int64_t)bh * V + c0 + col + j] = __float2bfloat16(fmaf(kq, u[j], fq * po[j]));
                u[j] *= fk;
            }
            st_smem<VEC>(sv + col, u);
        }
    }
    __syncthreads();
    /* 5. S <- Diag(e) S + k (fk u)^T, written once. The row addresses are recomputed
     * (the empty asm hides rs from the compiler) rather than kept in registers
     * since phase 1: two registers per row matter at R = 16. */
    asm volatile("" : "+r"(rs));
    if (act) {
        float *Sp = p.S + base;
        float u[VEC];
        ld_smem<VEC>(sv + col, u);
#pragma unroll
        for (int i = 0; i < R; i++) {
            const int d = ty + i * TY;
            if (FULL || d < K) {
                const float2 f = eki[d];
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    s[i][j] = fmaf(f.y, u[j], f.x * s[i][j]);
                st_state<VEC, ST>(Sp + i * rs, s[i]);
            }
        }
    }
}

template <int NT, int VEC, bool ST, bool FULL>
void launch_r(int R, dim3 grid, size_t smem, cudaStream_t s, const DecParams &p) {
    switch (R) {
    case 1:
        kda_decode<NT, VEC, 1, ST, FULL><<<grid, NT, smem, s>>>(p);
        break;
    case 2:
        kda_decode<NT, VEC, 2, ST, FULL><<<grid, NT, smem, s>>>(p);
        break;
    case 4:
        kda_decode<NT, VEC, 4, ST, FULL><<<grid, NT, smem, s>>>(p);
        break;
    case 8:
        kda_decode<NT, VEC, 8, ST, FULL><<<grid, NT, smem, s>>>(p);
        break;
    case 16:
        kda_decode<NT, VEC, 16, ST, FULL><<<grid, NT, smem, s>>>(p);
        break;
    default:
        LM_CHECK(R == DEC_RMAX);
        kda_decode<NT, VEC, DEC_RMAX, ST, FULL><<<grid, NT, smem, s>>>(p);
        break;
    }
}

template <int NT, int VEC, bool ST>
void launch_full(bool full, int R, dim3 grid, size_t smem, cudaStream_t s, const DecParams &p) {
    if (full)
        launch_r<NT, VEC, ST, true>(R, grid, smem, s, p);
    else
        launch_r<NT, VEC, ST, false>(R, grid, smem, s, p);
}

lm_status dec_cuda_err(lm_error *err, cudaError_t e, const char *what) {
    return lm_errorf(err, e == cudaErrorMemoryAllocation ? LM_ERR_NOMEM : LM_ERR_IO,
                     "kda cuda decode: %s: %s", what, cudaGetErrorString(e));
}

/* The configuration checks of the chunked forward (kda_fwd.cu) plus T == 1 and no
 * cu_seqlens; no scan of device data. */
lm_status dec_check(lm_kda_config *c, const lm_kda_cuda_inputs *in, const float *state,
                    const void *o, lm_error *err) {
    if (!c || !in || !in->q || !in->k || !in->v || !in->g || !in->beta || !state || !o)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda decode: q, k, v, g, beta, state and o are required");
    if (c->T != 1)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda decode: T = %d (a decode step has T = 1)",
                         c->T);
    if (c->cu_seqlens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda decode: cu_seqlens is not supported (one token per sequence, "
                         "B sequences)");
    if (c->B < 1 || c->H < 1 || c->HV < 1 || c->K < 1 || c->V < 1 || c->HV % c->H)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda decode: bad dims B=%d H=%d HV=%d K=%d V=%d (HV must be a "
                         "multiple of H)",
                         c->B, c->H, c->HV, c->K, c->V);
    if ((int64_t)c->B * c->HV > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda decode: B*HV = %lld exceeds 2^31 - 1",
                         (long long)c->B * c->HV);
    if (c->kind != LM_KDA && c->kind != LM_GDN)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda decode: unknown kind %d", (int)c->kind);
    if (c->gate != LM_GATE_NONE && c->gate != LM_GATE_SOFTPLUS && c->gate != LM_GATE_BOUNDED)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda decode: unknown gate mode %d",
                         (int)c->gate);
    if (!isfinite(c->scale))
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda decode: scale = %g is not finite",
                         (double)c->scale);
    if (c->has_lower_bound && !(c->lower_bound >= -5.0f && c->lower_bound < 0.0f))
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda decode: lower_bound = %g is outside [-5, 0)",
                         (double)c->lower_bound);
    if (c->gate == LM_GATE_BOUNDED && !c->has_lower_bound)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda decode: the bounded gate needs lower_bound in [-5, 0)");
    if (c->K > DEC_KMAX || c->V > DEC_VMAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "kda cuda decode: K = %d, V = %d (at most K = %d, V = %d)", c->K, c->V,
                         DEC_KMAX, DEC_VMAX);
    c->N = c->B;
    return LM_OK;
}

/* A launch of kda_decode: its parameters, grid, dynamic shared memory, rows per
 * thread R (a power of two) and whether the FULL instance applies. */
struct DecLaunch {
    DecParams p;
    dim3 grid;
    size_t smem;
    int R;
    bool full;
};

/* Fills *L for a checked config with `nt` threads per CTA, `cols` value columns per
 * CTA and VEC = vec columns per thread. LM_ERR_UNSUPPORTED when K needs more than
 * DEC_RMAX rows per thread with that shape. */
lm_status dec_setup(const lm_kda_config *c, const lm_kda_cuda_inputs *in, float *state, void *o,
                    int vec, int nt, int cols, DecLaunch *L, lm_error *err) {
    const int TX = (cols + vec - 1) / vec;
    const int TY = nt / TX;
    const int rneed = (c->K + TY - 1) / TY;
    int R = 1;
    while (R < rneed)
        R *= 2;
    if (R > DEC_RMAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "kda cuda decode: K = %d needs %d rows per thread with %d threads and "
                         "%d columns per CTA (at most %d)",
                         c->K, rneed, nt, cols, DEC_RMAX);
    DecParams &p = L->p;
    memset(&p, 0, sizeof p);
    p.q = (const __nv_bfloat16 *)in->q;
    p.k = (const __nv_bfloat16 *)in->k;
    p.v = (const __nv_bfloat16 *)in->v;
    p.g = (const __nv_bfloat16 *)in->g;
    p.beta = (const __nv_bfloat16 *)in->beta;
    p.A_log = in->A_log;
    p.dt_bias = in->dt_bias;
    p.S = state;
    p.o = (__nv_bfloat16 *)o;
    p.H = c->H;
    p.HV = c->HV;
    p.K = c->K;
    p.V = c->V;
    p.gdn = c->kind == LM_GDN;
    p.gate = (int)c->gate;
    p.l2 = c->use_qk_l2norm_in_kernel;
    p.sig = c->use_beta_sigmoid_in_kernel;
    p.lb = c->lower_bound;
    p.scale = c->scale;
    p.TX = TX;
    p.TY = TY;
    p.VS = TX * vec;
    p.KP = (c->K + 3) & ~3;
    L->grid = dim3((unsigned)(c->B * c->HV), (unsigned)((c->V + p.VS - 1) / p.VS));
    L->smem = sizeof(float) * (size_t)(5 * p.KP + 2 * p.VS + 4 + 2 * TY * p.VS);
    L->R = R;
    L->full = c->K == TY * R && c->V % p.VS == 0 && TX * TY == nt;
    return LM_OK;
}

/* the launch shape of the vectorised path (threads, columns per CTA) and of the
 * scalar one */
constexpr int DEC_NT = 128, DEC_VS = 64, DEC_NT_SCALAR = 256, DEC_VS_SCALAR = 32;

/* Launch one step (checked config) on ctx's stream. With VEC = 4 TX <= 16, so
 * TY >= 8 and K <= DEC_KMAX fits R <= DEC_RMAX; the scalar path has TY = 8. */
lm_status dec_launch(lm_cuda_ctx *ctx, const lm_kda_config *c, const lm_kda_cuda_inputs *in,
                     float *state, void *o, lm_error *err) {
    const bool vec4 = c->V % 4 == 0 && ((uintptr_t)state & 15) == 0;
    DecLaunch L{};
    cudaStream_t s = ctx->stream;
    if (vec4) {
        LM_TRY(dec_setup(c, in, state, o, 4, DEC_NT, c->V < DEC_VS ? c->V : DEC_VS, &L, err));
        launch_full<DEC_NT, 4, true>(L.full, L.R, L.grid, L.smem, s, L.p);
    } else {
        LM_TRY(dec_setup(c, in, state, o, 1, DEC_NT_SCALAR, DEC_VS_SCALAR, &L, err));
        launch_r<DEC_NT_SCALAR, 1, false, false>(L.R, L.grid, L.smem, s, L.p);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return dec_cuda_err(err, e, "kda_decode launch");
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_kda_cuda_decode_step(lm_cuda_ctx *ctx, lm_kda_config *c,
                                             const lm_kda_cuda_inputs *in, float *state, void *o,
                                             lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(dec_check(c, in, state, o, err));
    return dec_launch(ctx, c, in, state, o, err);
}

extern "C" int lm_kda_cuda_decode_flat(lm_cuda_ctx *ctx, int B, int H, int HV, int K, int V,
                                       int kind, int gate, float lower_bound, float scale,
                                       int use_qk_l2norm_in_kernel, int use_beta_sigmoid_in_kernel,
                                       const void *q, const void *k, const void *v, const void *g,
                                       const void *beta, const float *A_log, const float *dt_bias,
                                       float *state, void *o, char *errbuf, int errlen) {
    lm_kda_config c; /* filled here (the FFI library has no lm_kda_config_default) */
    memset(&c, 0, sizeof c);
    c.B = B;
    c.T = 1;
    c.H = H;
    c.HV = HV;
    c.K = K;
    c.V = V;
    c.N = B;
    c.chunk_size = 64;
    c.scale = scale > 0 ? scale : (K > 0 ? 1.0f / sqrtf((float)K) : 1.0f);
    c.kind = (lm_kda_kind)kind;
    c.gate = (lm_gate_mode)gate;
    c.has_lower_bound = lower_bound != 0.0f;
    c.lower_bound = lower_bound;
    c.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel;
    c.use_beta_sigmoid_in_kernel = use_beta_sigmoid_in_kernel;
    lm_kda_cuda_inputs in = {q, k, v, g, beta, A_log, dt_bias, NULL};
    lm_error err;
    memset(&err, 0, sizeof err);
    const lm_status st = lm_kda_cuda_decode_step(ctx, &c, &in, state, o, &err);
    if (st != LM_OK && errbuf && errlen > 0)
        snprintf(errbuf, (size_t)errlen, "%s", err.msg);
    return (int)st;
}
