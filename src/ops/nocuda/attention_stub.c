/* linmoe built without CUDA: the CUDA attention entry points (include/linmoe/cuda_attention.h)
 * report LM_ERR_UNSUPPORTED. Compiled only when CMake finds no CUDA compiler. */
#include "linmoe/cuda_attention.h"

static lm_status no_cuda(lm_error *err, const char *what) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "attention cuda: %s: built without CUDA", what);
}

lm_status lm_cuda_attention_forward(lm_cuda_ctx *ctx, lm_attention_config *c, const void *q,
                                    const void *k, const void *v, void *o, float *lse,
                                    lm_error *err) {
    (void)ctx, (void)c, (void)q, (void)k, (void)v, (void)o, (void)lse;
    return no_cuda(err, "forward");
}

lm_status lm_cuda_attention_backward(lm_cuda_ctx *ctx, lm_attention_config *c, const void *q,
                                     const void *k, const void *v, const void *o, const float *lse,
                                     const void *do_, void *dq, void *dk, void *dv, lm_error *err) {
    (void)ctx, (void)c, (void)q, (void)k, (void)v, (void)o, (void)lse, (void)do_, (void)dq;
    (void)dk, (void)dv;
    return no_cuda(err, "backward");
}

lm_status lm_cuda_attention_rope(lm_cuda_ctx *ctx, lm_attention_config *c, int H, const void *x,
                                 void *y, int inverse, lm_error *err) {
    (void)ctx, (void)c, (void)H, (void)x, (void)y, (void)inverse;
    return no_cuda(err, "rope");
}

lm_status lm_cuda_attention_cache_write(lm_cuda_ctx *ctx, lm_attention_config *c, int64_t Tmax,
                                        int64_t pos, const void *k, const void *v, void *k_cache,
                                        void *v_cache, lm_error *err) {
    (void)ctx, (void)c, (void)Tmax, (void)pos, (void)k, (void)v, (void)k_cache, (void)v_cache;
    return no_cuda(err, "cache_write");
}

lm_status lm_cuda_attention_decode(lm_cuda_ctx *ctx, lm_attention_config *c, int64_t Tmax,
                                   int64_t pos, const void *q, const void *k_cache,
                                   const void *v_cache, void *o, float *lse, lm_error *err) {
    (void)ctx, (void)c, (void)Tmax, (void)pos, (void)q, (void)k_cache, (void)v_cache, (void)o;
    (void)lse;
    return no_cuda(err, "decode");
}

lm_status lm_cuda_attention_set_impl(lm_cuda_ctx *ctx, int impl, lm_error *err) {
    (void)ctx, (void)impl;
    return no_cuda(err, "set_impl");
}

int lm_cuda_attention_last_impl(lm_cuda_ctx *ctx) {
    (void)ctx;
    return 0;
}

lm_status lm_cuda_attention_set_bwd_impl(lm_cuda_ctx *ctx, int impl, lm_error *err) {
    (void)ctx, (void)impl;
    return no_cuda(err, "set_bwd_impl");
}

int lm_cuda_attention_last_bwd_impl(lm_cuda_ctx *ctx) {
    (void)ctx;
    return 0;
}

lm_status lm_cuda_attention_set_cudnn_workspace_limit(lm_cuda_ctx *ctx, int64_t bytes,
                                                      lm_error *err) {
    (void)ctx, (void)bytes;
    return no_cuda(err, "set_cudnn_workspace_limit");
}
