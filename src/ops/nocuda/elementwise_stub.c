/* linmoe built without CUDA: the element-wise entry points report LM_ERR_UNSUPPORTED
 * (include/linmoe/cuda_elementwise.h). Compiled only when CMake finds no CUDA compiler. */
#include "linmoe/cuda_elementwise.h"

static lm_status no_cuda(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "elementwise cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

lm_status lm_cuda_f32_to_bf16(lm_cuda_ctx *ctx, int64_t n, const float *src, void *dst,
                              lm_error *err) {
    (void)ctx, (void)n, (void)src, (void)dst;
    return no_cuda(err);
}
lm_status lm_cuda_bf16_to_f32(lm_cuda_ctx *ctx, int64_t n, const void *src, float *dst,
                              lm_error *err) {
    (void)ctx, (void)n, (void)src, (void)dst;
    return no_cuda(err);
}
lm_status lm_cuda_add_bf16(lm_cuda_ctx *ctx, int64_t n, const void *a, const void *b, void *out,
                           lm_error *err) {
    (void)ctx, (void)n, (void)a, (void)b, (void)out;
    return no_cuda(err);
}
lm_status lm_cuda_acc_bf16_f32(lm_cuda_ctx *ctx, int64_t n, const void *x, float *y,
                               lm_error *err) {
    (void)ctx, (void)n, (void)x, (void)y;
    return no_cuda(err);
}
lm_status lm_cuda_acc_f32(lm_cuda_ctx *ctx, int64_t n, const float *x, float *y, lm_error *err) {
    (void)ctx, (void)n, (void)x, (void)y;
    return no_cuda(err);
}
lm_status lm_cuda_scale_f32_to_bf16(lm_cuda_ctx *ctx, int64_t n, float alpha, const float *x,
                                    void *y, lm_error *err) {
    (void)ctx, (void)n, (void)alpha, (void)x, (void)y;
    return no_cuda(err);
}
