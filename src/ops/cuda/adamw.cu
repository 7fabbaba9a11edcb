/* AdamW with global gradient-norm clipping (include/linmoe/cuda_optim.h; the CPU reference
 * is src/train/adamw.c).
 *
 * The plan splits every segment into tiles of at most LM_CUDA_ADAMW_TILE elements; both
 * kernels run one CTA of 256 threads per tile, so which thread sums which element depends on
 * the tile table only (the norm's bits do not depend on the device's SM count):
 *   adamw_norm_partial  partial[tile] = sum of g^2 (fp64), the CTA's tree in a fixed order
 *   adamw_norm_finish   one CTA: partials in tile order per thread, fixed tree, sqrt
 *   adamw_step_kernel   reads the norm (device), forms the clip factor, updates p, m, v and
 *                       writes the bf16 copy; 16-byte vectors with streaming (evict-first)
 *                       loads and stores, since nothing here is reused. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/cuda_optim.h"
#include "ops/cuda/ctx.cuh"

namespace {

const char *OP = "adamw cuda";
constexpr int THREADS = 256;
constexpr int FINISH_THREADS = 1024;

struct Tile {
    int64_t off;
    int32_t len;
    int32_t decay;
};

struct StepScalars {
    float b1, omb1, b2, omb2; /* beta1, 1 - beta1, beta2, 1 - beta2 */
    float step;               /* lr / (1 - beta1^t) */
    float isb2;               /* 1 / sqrt(1 - beta2^t) */
    float eps;
    float decay; /* 1 - lr * weight_decay */
    double clip; /* grad_clip (0 = off) */
};

__device__ __forceinline__ double block_sum(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0)
        sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sh[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v; /* valid in thread 0 */
}

__device__ __forceinline__ double sq(float x) { return (double)x * (double)x; }

__global__ void __launch_bounds__(THREADS)
    adamw_norm_partial(const float *__restrict__ g, const Tile *__restrict__ tiles,
                       double *__restrict__ partial, int vec_base) {
    __shared__ double sh[32];
    const Tile t = tiles[blockIdx.x];
    const float *x = g + t.off;
    double s = 0.0;
    int i0 = 0;
    if (vec_base && (t.off & 3) == 0) {
        const int n4 = t.len >> 2;
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += THREADS) {
            const float4 a = __ldcs(x4 + i);
            s += (sq(a.x) + sq(a.y)) + (sq(a.z) + sq(a.w));
        }
        i0 = n4 * 4;
    }
    for (int i = i0 + threadIdx.x; i < t.len; i += THREADS)
        s += sq(x[i]);
    s = block_sum(s, sh);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(FINISH_THREADS)
    adamw_norm_finish(const double *__restrict__ partial, int n, float *gnorm, int32_t *skipped) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += FINISH_THREADS)
        s += partial[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) {
        const float nf = (float)sqrt(s); /* beyond fp32: Inf, counted as non-finite */
        *gnorm = nf;
        if (skipped)
            *skipped = isfinite(nf) ? 0 : 1;
    }
}

/* the CPU's expression and rounding order (src/train/adamw.c), no contractions */
__device__ __forceinline__ void adamw_elem(float &p, float g, float &m, float &v, float gs,
                                           const StepScalars &c, float dk) {
    const float gi = __fmul_rn(g, gs);
    m = __fadd_rn(__fmul_rn(c.b1, m), __fmul_rn(c.omb1, gi));
    v = __fadd_rn(__fmul_rn(c.b2, v), __fmul_rn(__fmul_rn(c.omb2, gi), gi));
    const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(v), c.isb2), c.eps);
    p = __fsub_rn(__fmul_rn(p, dk), __fdiv_rn(__fmul_rn(c.step, m), den));
}

__global__ void __launch_bounds__(THREADS)
    adamw_step_kernel(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m,
                      float *__restrict__ v, __nv_bfloat16 *__restrict__ pb,
                      const Tile *__restrict__ tiles, const float *__restrict__ gnorm,
                      StepScalars c, int vec_base) {
    const float gn = *gnorm;
    if (!isfinite(gn))
        return; /* a skipped step: nothing is touched */
    float gs = 1.0f;
    if (c.clip > 0.0 && (double)gn > c.clip)
        gs = (float)(c.clip / ((double)gn + 1e-6));
    const Tile t = tiles[blockIdx.x];
    const float dk = t.decay ? c.decay : 1.0f;
    float *pt = p + t.off, *mt = m + t.off, *vt = v + t.off;
    const float *gt = g + t.off;
    __nv_bfloat16 *bt = pb ? pb + t.off : nullptr;
    int i0 = 0;
    if (vec_base && (t.off & 3) == 0) {
        const int n4 = t.len >> 2;
        float4 *p4 = reinterpret_cast<float4 *>(pt), *m4 = reinterpret_cast<float4 *>(mt),
               *v4 = reinterpret_cast<float4 *>(vt);
        const float4 *g4 = reinterpret_cast<const float4 *>(gt);
#pragma unroll 2
        for (int i = threadIdx.x; i < n4; i += THREADS) {
            float4 a = __ldcs(p4 + i), mm = __ldcs(m4 + i), vv = __ldcs(v4 + i);
            const float4 gg = __ldcs(g4 + i);
            adamw_elem(a.x, gg.x, mm.x, vv.x, gs, c, dk);
            adamw_elem(a.y, gg.y, mm.y, vv.y, gs, c, dk);
            adamw_elem(a.z, gg.z, mm.z, vv.z, gs, c, dk);
            adamw_elem(a.w, gg.w, mm.w, vv.w, gs, c, dk);
            __stcs(p4 + i, a);
            __stcs(m4 + i, mm);
            __stcs(v4 + i, vv);
            if (bt) {
                __nv_bfloat162 h[2] = {__floats2bfloat162_rn(a.x, a.y),
                                       __floats2bfloat162_rn(a.z, a.w)};
                __stcs(reinterpret_cast<uint2 *>(bt) + i, *reinterpret_cast<const uint2 *>(h));
            }
        }
        i0 = n4 * 4;
    }
    for (int i = i0 + threadIdx.x; i < t.len; i += THREADS) {
        float a = pt[i], mm = mt[i], vv = vt[i];
        adamw_elem(a, gt[i], mm, vv, gs, c, dk);
        pt[i] = a, mt[i] = mm, vt[i] = vv;
        if (bt)
            bt[i] = __float2bfloat16_rn(a);
    }
}

bool aligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

} // namespace

struct lm_cuda_adamw_plan {
    lm_cuda_ctx *ctx;
    Tile *tiles;     /* device [ntiles] */
    double *partial; /* device [ntiles] */
    int ntiles;
    int64_t numel, trainable;
};

extern "C" void lm_cuda_adamw_plan_free(lm_cuda_adamw_plan *plan) {
    if (!plan)
        return;
    lm_cuda_ctx_free_mem(plan->ctx, plan->tiles);
    lm_cuda_ctx_free_mem(plan->ctx, plan->partial);
    free(plan);
}

extern "C" int64_t lm_cuda_adamw_plan_numel(const lm_cuda_adamw_plan *plan) {
    return plan ? plan->trainable : 0;
}

extern "C" lm_status lm_cuda_adamw_plan_new(lm_cuda_ctx *ctx, const lm_cuda_adamw_segment *seg,
                                            int n_seg, int64_t numel, lm_cuda_adamw_plan **out,
                                            lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "%s: NULL output pointer for the plan", OP);
    *out = nullptr;
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (n_seg < 0 || (n_seg > 0 && !seg))
        return lm_errorf(err, LM_ERR_INVALID, "%s: %d segments with segments = %p", OP, n_seg,
                         (const void *)seg);
    if (numel < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: numel = %lld must be >= 0", OP,
                         (long long)numel);
    int64_t ntiles = 0, trainable = 0, end = 0;
    for (int i = 0; i < n_seg; i++) {
        const lm_cuda_adamw_segment *s = &seg[i];
        if (s->count < 0 || s->offset < 0 || s->offset > numel || s->count > numel - s->offset)
            return lm_errorf(err, LM_ERR_INVALID,
                             "%s: segment %d (offset %lld, count %lld) is outside the buffer of "
                             "%lld elements",
                             OP, i, (long long)s->offset, (long long)s->count, (long long)numel);
        if (s->offset < end)
            return lm_errorf(err, LM_ERR_INVALID,
                             "%s: segment %d (offset %lld) overlaps or precedes the previous one "
                             "(which ends at %lld): segments must be in increasing order",
                             OP, i, (long long)s->offset, (long long)end);
        if (s->decay != 0 && s->decay != 1)
            return lm_errorf(err, LM_ERR_INVALID, "%s: segment %d decay = %d must be 0 or 1", OP, i,
                             s->decay);
        if (s->count > 0)
            end = s->offset + s->count;
        ntiles += (s->count + LM_CUDA_ADAMW_TILE - 1) / LM_CUDA_ADAMW_TILE;
        trainable += s->count;
    }
    if (ntiles > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "%s: %lld tiles exceed 2^31", OP, (long long)ntiles);
    lm_cuda_adamw_plan *p = (lm_cuda_adamw_plan *)calloc(1, sizeof *p);
    if (!p)
        return lm_errorf(err, LM_ERR_NOMEM, "%s: out of host memory for a plan", OP);
    p->ctx = ctx;
    p->ntiles = (int)ntiles;
    p->numel = numel;
    p->trainable = trainable;
    const size_t nt = (size_t)(ntiles > 0 ? ntiles : 1);
    Tile *host = (Tile *)calloc(nt, sizeof(Tile));
    lm_status st = host ? LM_OK : lm_errorf(err, LM_ERR_NOMEM, "%s: out of host memory", OP);
    if (st == LM_OK) {
        int64_t k = 0;
        for (int i = 0; i < n_seg; i++)
            for (int64_t o = 0; o < seg[i].count; o += LM_CUDA_ADAMW_TILE) {
                const int64_t len = seg[i].count - o;
                host[k].off = seg[i].offset + o;
                host[k].len = (int32_t)(len < LM_CUDA_ADAMW_TILE ? len : LM_CUDA_ADAMW_TILE);
                host[k].decay = seg[i].decay;
                k++;
            }
        st = lm_cuda_ctx_alloc(ctx, (void **)&p->tiles, nt * sizeof(Tile), err);
    }
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(ctx, (void **)&p->partial, nt * sizeof(double), err);
    if (st == LM_OK && ntiles > 0)
        st = lm_cuda_ctx_upload(ctx, p->tiles, host, (size_t)ntiles * sizeof(Tile), err);
    free(host);
    if (st != LM_OK) {
        lm_cuda_adamw_plan_free(p);
        return st;
    }
    *out = p;
    return LM_OK;
}

extern "C" lm_status lm_cuda_adamw_grad_norm(lm_cuda_ctx *ctx, const lm_cuda_adamw_plan *plan,
                                             const float *g, float *gnorm, int32_t *skipped,
                                             lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!plan || plan->ctx != ctx)
        return lm_errorf(err, LM_ERR_INVALID, "%s: the plan is NULL or from another context", OP);
    if (!gnorm || (!g && plan->ntiles > 0))
        return lm_errorf(err, LM_ERR_INVALID, "%s: 'g' and 'gnorm' are required", OP);
    if (plan->ntiles > 0) {
        adamw_norm_partial<<<plan->ntiles, THREADS, 0, ctx->stream>>>(g, plan->tiles, plan->partial,
                                                                      aligned(g, 16));
        LM_CK_LAUNCH("adamw_norm_partial");
    }
    adamw_norm_finish<<<1, FINISH_THREADS, 0, ctx->stream>>>(plan->partial, plan->ntiles, gnorm,
                                                             skipped);
    LM_CK_LAUNCH("adamw_norm_finish");
    return LM_OK;
}

extern "C" lm_status lm_cuda_adamw_step(lm_cuda_ctx *ctx, const lm_cuda_adamw_plan *plan,
                                        const lm_cuda_adamw_hparams *hp, float *params,
                                        const float *g, float *m, float *v, void *params_bf16,
                                        const float *gnorm, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (!plan || plan->ctx != ctx)
        return lm_errorf(err, LM_ERR_INVALID, "%s: the plan is NULL or from another context", OP);
    if (!hp)
        return lm_errorf(err, LM_ERR_INVALID, "%s: hyper-parameters are required", OP);
    if (!(hp->lr >= 0 && isfinite(hp->lr)) ||
        !(hp->weight_decay >= 0 && isfinite(hp->weight_decay)) ||
        !(hp->beta1 >= 0 && hp->beta1 < 1) || !(hp->beta2 >= 0 && hp->beta2 < 1) ||
        !(hp->eps > 0 && isfinite(hp->eps)) || !(hp->grad_clip >= 0 && isfinite(hp->grad_clip)))
        return lm_errorf(
            err, LM_ERR_INVALID,
            "%s: bad hyper-parameters lr %g weight_decay %g beta1 %g beta2 %g eps %g "
            "grad_clip %g (lr, weight_decay, grad_clip >= 0, betas in [0, 1), eps > 0)",
            OP, hp->lr, hp->weight_decay, hp->beta1, hp->beta2, hp->eps, hp->grad_clip);
    if (hp->step < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: step t = %lld must be >= 1", OP,
                         (long long)hp->step);
    if (plan->ntiles == 0)
        return LM_OK;
    if (!params || !g || !m || !v || !gnorm)
        return lm_errorf(err, LM_ERR_INVALID, "%s: params, g, m, v and gnorm are required", OP);
    /* the scalars exactly as lm_adamw_step forms them */
    const double t = (double)hp->step;
    const double bc1 = 1.0 - pow(hp->beta1, t), bc2 = 1.0 - pow(hp->beta2, t);
    StepScalars c;
    c.b1 = (float)hp->beta1, c.b2 = (float)hp->beta2;
    c.omb1 = (float)(1.0 - hp->beta1), c.omb2 = (float)(1.0 - hp->beta2);
    c.step = (float)(hp->lr / bc1);
    c.isb2 = (float)(1.0 / sqrt(bc2));
    c.eps = (float)hp->eps;
    c.decay = (float)(1.0 - hp->lr * hp->weight_decay);
    c.clip = hp->grad_clip;
    const int vec = aligned(params, 16) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16) &&
                    aligned(params_bf16, 8);
    adamw_step_kernel<<<plan->ntiles, THREADS, 0, ctx->stream>>>(
        params, g, m, v, (__nv_bfloat16 *)params_bf16, plan->tiles, gnorm, c, vec);
    LM_CK_LAUNCH("adamw_step_kernel");
    return LM_OK;
}
