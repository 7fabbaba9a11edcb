/* linmoe built without CUDA: the AttnRes CUDA entry points report LM_ERR_UNSUPPORTED
 * (include/linmoe/cuda_attnres.h). Compiled only when CMake finds no CUDA compiler. */
#include "linmoe/cuda_attnres.h"

static lm_status no_cuda(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "attnres cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

lm_status lm_cuda_attnres_forward_ptrs(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                       const void *const *src, const float *query,
                                       const float *rms_weight, void *o, float *weights,
                                       lm_error *err) {
    (void)ctx, (void)c, (void)src, (void)query, (void)rms_weight, (void)o, (void)weights;
    return no_cuda(err);
}

lm_status lm_cuda_attnres_forward(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                  const void *residual, const float *query, const float *rms_weight,
                                  void *o, float *weights, lm_error *err) {
    (void)ctx, (void)c, (void)residual, (void)query, (void)rms_weight, (void)o, (void)weights;
    return no_cuda(err);
}

lm_status lm_cuda_attnres_backward_ptrs(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                        const void *const *src, const float *query,
                                        const float *rms_weight, const void *do_, void *const *dsrc,
                                        lm_dtype dsrc_dtype, float *dquery, float *drms_weight,
                                        lm_error *err) {
    (void)ctx, (void)c, (void)src, (void)query, (void)rms_weight, (void)do_, (void)dsrc;
    (void)dsrc_dtype, (void)dquery, (void)drms_weight;
    return no_cuda(err);
}

lm_status lm_cuda_attnres_backward(lm_cuda_ctx *ctx, const lm_attnres_config *c,
                                   const void *residual, const float *query,
                                   const float *rms_weight, const void *do_, void *dresidual,
                                   lm_dtype dsrc_dtype, float *dquery, float *drms_weight,
                                   lm_error *err) {
    (void)ctx, (void)c, (void)residual, (void)query, (void)rms_weight, (void)do_;
    (void)dresidual, (void)dsrc_dtype, (void)dquery, (void)drms_weight;
    return no_cuda(err);
}
