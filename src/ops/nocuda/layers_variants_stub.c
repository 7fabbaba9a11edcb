/* linmoe built without CUDA: the kernel-variant entry points of the CUDA layer ops
 * (src/ops/cuda/layers_variants.h, used by the benchmark and the conformance tests)
 * report LM_ERR_UNSUPPORTED. Compiled only when CMake finds no CUDA compiler. */
#include "ops/cuda/layers_variants.h"

static lm_status no_cuda(lm_error *err, const char *op) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "%s on cuda: this linmoe was built without CUDA (no nvcc found by CMake)", op);
}

lm_status lm_cuda_rmsnorm_forward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int D, float eps,
                                    const void *x, const void *residual, const void *weight,
                                    void *h, void *y, float *rstd, lm_error *err) {
    (void)ctx, (void)variant, (void)N, (void)D, (void)eps, (void)x, (void)residual, (void)weight,
        (void)h, (void)y, (void)rstd;
    return no_cuda(err, "rmsnorm");
}

lm_status lm_cuda_rmsnorm_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int D, float eps,
                                     const void *x, const void *weight, const float *rstd,
                                     const void *dy, const void *dresidual, void *dx,
                                     float *dweight, lm_error *err) {
    (void)ctx, (void)variant, (void)N, (void)D, (void)eps, (void)x, (void)weight, (void)rstd,
        (void)dy, (void)dresidual, (void)dx, (void)dweight;
    return no_cuda(err, "rmsnorm backward");
}

lm_status lm_cuda_gated_rmsnorm_forward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int H, int Dh,
                                          float eps, const void *x, const void *gate,
                                          const void *weight, void *o, float *rstd, lm_error *err) {
    (void)ctx, (void)variant, (void)N, (void)H, (void)Dh, (void)eps, (void)x, (void)gate,
        (void)weight, (void)o, (void)rstd;
    return no_cuda(err, "gated_rmsnorm");
}

lm_status lm_cuda_gated_rmsnorm_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int H, int Dh,
                                           float eps, const void *x, const void *gate,
                                           const void *weight, const float *rstd, const void *do_,
                                           void *dx, void *dgate, float *dweight, lm_error *err) {
    (void)ctx, (void)variant, (void)N, (void)H, (void)Dh, (void)eps, (void)x, (void)gate,
        (void)weight, (void)rstd, (void)do_, (void)dx, (void)dgate, (void)dweight;
    return no_cuda(err, "gated_rmsnorm backward");
}

lm_status lm_cuda_short_conv_forward_v(lm_cuda_ctx *ctx, int variant, lm_short_conv_config *c,
                                       const void *x, const void *weight,
                                       const float *initial_state, void *y, float *final_state,
                                       lm_error *err) {
    (void)ctx, (void)variant, (void)c, (void)x, (void)weight, (void)initial_state, (void)y,
        (void)final_state;
    return no_cuda(err, "short_conv");
}

lm_status lm_cuda_short_conv_backward_v(lm_cuda_ctx *ctx, int variant, lm_short_conv_config *c,
                                        const void *x, const void *weight,
                                        const float *initial_state, const void *dy, void *dx,
                                        float *dweight, float *dinitial_state, lm_error *err) {
    (void)ctx, (void)variant, (void)c, (void)x, (void)weight, (void)initial_state, (void)dy,
        (void)dx, (void)dweight, (void)dinitial_state;
    return no_cuda(err, "short_conv backward");
}

lm_status lm_cuda_embedding_backward_v(lm_cuda_ctx *ctx, int variant, int64_t N, int V, int D,
                                       const int32_t *ids, const void *dout, float *dweight,
                                       lm_error *err) {
    (void)ctx, (void)variant, (void)N, (void)V, (void)D, (void)ids, (void)dout, (void)dweight;
    return no_cuda(err, "embedding backward");
}
