/* linmoe element-wise helpers on NVIDIA GPUs (CUDA C, sm_90a): the conversions and sums
 * the GPU model needs between its ops (src/model/gpu_*.c): the bf16 working copy of the
 * fp32 master weights, bf16 views of fp32 gradients that feed a GEMM (the router's
 * dlogits), and residual / gradient-stream sums.
 *
 * Every call: n elements (n >= 0; 0 is a no-op), device pointers of the context's device,
 * asynchronous on the context's stream, no allocation, no host synchronisation. bf16 is
 * stored as uint16 (round to nearest even from fp32, as __float2bfloat16_rn); sums are
 * formed in fp32 and rounded once. Outputs may alias inputs element for element (in
 * place), never partially overlap them. 16-byte aligned pointers take a vector path, any
 * other alignment a scalar one (same results).
 *
 * Errors: LM_ERR_INVALID (NULL context or pointer with n > 0, n < 0), LM_ERR_UNSUPPORTED
 * when linmoe was built without CUDA (src/ops/nocuda/elementwise_stub.c), LM_ERR_IO for a
 * launch failure.
 */
#ifndef LINMOE_CUDA_ELEMENTWISE_H
#define LINMOE_CUDA_ELEMENTWISE_H

#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = bf16(src[i]):  src fp32 [n], dst bf16 [n]. */
lm_status lm_cuda_f32_to_bf16(lm_cuda_ctx *ctx, int64_t n, const float *src, void *dst,
                              lm_error *err);
/* dst[i] = float(src[i]):  src bf16 [n], dst fp32 [n] (exact). */
lm_status lm_cuda_bf16_to_f32(lm_cuda_ctx *ctx, int64_t n, const void *src, float *dst,
                              lm_error *err);
/* out[i] = bf16(a[i] + b[i]):  a, b, out bf16 [n]. */
lm_status lm_cuda_add_bf16(lm_cuda_ctx *ctx, int64_t n, const void *a, const void *b, void *out,
                           lm_error *err);
/* y[i] += x[i]:  x bf16 [n], y fp32 [n] (an fp32 accumulator of bf16 terms). */
lm_status lm_cuda_acc_bf16_f32(lm_cuda_ctx *ctx, int64_t n, const void *x, float *y, lm_error *err);
/* y[i] += x[i]:  x fp32 [n], y fp32 [n] (a weight gradient that an op overwrites, staged
 * and added to the accumulated one). */
lm_status lm_cuda_acc_f32(lm_cuda_ctx *ctx, int64_t n, const float *x, float *y, lm_error *err);
/* y[i] = bf16(alpha * x[i]):  x fp32 [n], y bf16 [n]. */
lm_status lm_cuda_scale_f32_to_bf16(lm_cuda_ctx *ctx, int64_t n, float alpha, const float *x,
                                    void *y, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
