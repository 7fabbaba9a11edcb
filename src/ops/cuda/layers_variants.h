/* Kernel variants of the CUDA layer ops (include/linmoe/cuda_layers.h), for the
 * conformance tests (tests/backend_ops/{norm,short_conv,embedding}.c) and the benchmark
 * (bench/bench_ops_{norm,short_conv,embedding}.c) only. Not installed, not part of the API:
 * the public entry points run variant 0, the default, which is one of the numbered ones
 * (LM_LAYERS_*_DEFAULT below; the benchmark times every variant side by side so that the
 * default can be chosen on the GPU). Each function takes the same arguments as its public
 * counterpart, plus `variant` in [0, count]; any other value gives LM_ERR_INVALID. A
 * variant that does not cover a configuration (a scalar row, a long row, W != 4, ...)
 * runs the first kernels for it, so every variant accepts every valid input. Where one
 * variant is left (count 1), the entry point is kept so that the tests and the benchmark
 * can time new candidates against it.
 *
 * The variants that lost their A/B tests (H200, docs/perf/h200-2026-12-01c) were removed
 * and the kept ones renumbered from 1: dev/layers_variants.md lists the removed ones, their
 * numbers and the commit that has their code.
 *
 * Plain C (the bench and tests are C11); the definitions are in the .cu files next to
 * the public entry points, the no-CUDA stubs in src/ops/nocuda/layers_variants_stub.c.
 */
#ifndef LINMOE_CUDA_LAYERS_VARIANTS_H
#define LINMOE_CUDA_LAYERS_VARIANTS_H

#include "linmoe/cuda_layers.h"

#ifdef __cplusplus
extern "C" {
#endif

/* RMSNorm / gated RMSNorm forward (src/ops/cuda/norm.cu):
 *   1  the first kernels (one row per lane group in flight) with one step per warp:
 *      hardware-scheduled CTAs of 256 threads, grid not capped (was variant 3);
 *   2  U rows per lane group in flight for short rows (every load of the U rows issued
 *      before the statistics, U reductions interleaved; U = 1 from 4 vectors per lane),
 *      fast sigmoid (__expf, __fdividef), register budget per instance, one-wave grid
 *      (was variant 4). The layouts it does not cover (scalar rows, D > 2048) run the
 *      first kernels on a one-wave grid (the occupancy, cached per context).
 * Default (variant 0): DEFAULT_LONG for plain / residual rows of 32 lanes (D >= 256),
 * DEFAULT_SHORT for the gated norm and short rows. */
#define LM_LAYERS_NORM_FWD_VARIANTS 2
#define LM_LAYERS_NORM_FWD_DEFAULT_LONG 1
#define LM_LAYERS_NORM_FWD_DEFAULT_SHORT 2
/* RMSNorm / gated RMSNorm backward:
 *   1  U rows per lane group for short rows, rstd-given and residual-gradient instances
 *      (no unused statistic, the residual gradient loaded with the inputs), register
 *      budget for 3-4 CTAs per SM, sigmoid computed once, float4 accumulator updates,
 *      one-wave grid, colsum of 32 warps per 32 columns with 8 loads in flight (was
 *      variant 2). The layouts it does not cover (scalar rows, D > 2048) run the first
 *      kernels (one row per lane group, 2 CTAs of 8 warps per SM, colsum of 8 warps per
 *      32 columns).
 *   2  plain and residual rows of 256 <= D <= 2048 (D / 8 a power of two) with the
 *      forward's rstd (without it, variant 1 recomputes the forward's bits): a CTA's 256
 *      threads span 256 / (D / 8) rows, each thread 8 fixed columns, 2 rows deep, 4 CTAs
 *      per SM; the weight gradient in registers (no shared accumulator rows), the row
 *      statistics summed across warps through shared memory. Other layouts (the gated
 *      norm, short and long rows) run variant 1. */
#define LM_LAYERS_NORM_BWD_VARIANTS 2
#define LM_LAYERS_NORM_BWD_DEFAULT 2

lm_status lm_cuda_rmsnorm_forward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int D, float eps,
                                    const void *x, const void *residual, const void *weight,
                                    void *h, void *y, float *rstd, lm_error *err);
lm_status lm_cuda_rmsnorm_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int D, float eps,
                                     const void *x, const void *weight, const float *rstd,
                                     const void *dy, const void *dresidual, void *dx,
                                     float *dweight, lm_error *err);
lm_status lm_cuda_gated_rmsnorm_forward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int H, int Dh,
                                          float eps, const void *x, const void *gate,
                                          const void *weight, void *o, float *rstd, lm_error *err);
lm_status lm_cuda_gated_rmsnorm_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int H, int Dh,
                                           float eps, const void *x, const void *gate,
                                           const void *weight, const float *rstd, const void *do_,
                                           void *dx, void *dgate, float *dweight, lm_error *err);

/* Short convolution forward and backward (src/ops/cuda/short_conv.cu):
 *   1  W = 4 with 16-byte vectors: a CTA stages a 32-token x tile (+ 3-row halo; the
 *      backward also dy) of 512 channels in shared memory with cp.async, then each
 *      thread walks 16 tokens of 4 channels out of shared memory; fast SiLU; the
 *      backward keeps the 128-token dweight tiles (4 sub-tiles per CTA) and sums the
 *      partials with 32 warps per 32 columns (was variant 2). Other W / C / alignments
 *      run the first kernels: a thread walks 64 (forward) / 128 (backward) tokens of
 *      8 / 4 channels, loading 4 tokens ahead from global memory. */
#define LM_LAYERS_CONV_VARIANTS 1
#define LM_LAYERS_CONV_DEFAULT 1

lm_status lm_cuda_short_conv_forward_v(lm_cuda_ctx *ctx, int variant, lm_short_conv_config *c,
                                       const void *x, const void *weight,
                                       const float *initial_state, void *y, float *final_state,
                                       lm_error *err);
lm_status lm_cuda_short_conv_backward_v(lm_cuda_ctx *ctx, int variant, lm_short_conv_config *c,
                                        const void *x, const void *weight,
                                        const float *initial_state, const void *dy, void *dx,
                                        float *dweight, float *dinitial_state, lm_error *err);

/* Embedding backward (src/ops/cuda/embedding.cu):
 *   1  32-bit keys (when bits(N - 1) + bits(V) <= 32, else 64-bit) sorted on the id bits
 *      only (2 passes at V = 50304), chunks of 16, per run the dweight row and the dout
 *      rows loaded together, crossing runs summed by 8 groups of column threads (was
 *      variant 2; covers every shape). */
#define LM_LAYERS_EMB_BWD_VARIANTS 1
#define LM_LAYERS_EMB_BWD_DEFAULT 1

lm_status lm_cuda_embedding_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int V, int D,
                                       const int32_t *ids, const void *dout, float *dweight,
                                       lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
