/* linmoe built without CUDA: the CUDA MoE expert entry points (include/linmoe/cuda_moe.h)
 * report LM_ERR_UNSUPPORTED. Compiled only when CMake finds no CUDA compiler. */
#include <string.h>

#include "linmoe/cuda_moe.h"

static lm_status no_cuda(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "moe cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

lm_status lm_cuda_moe_plan(const lm_moe_config *c, int T, lm_cuda_moe_sizes *out, lm_error *err) {
    (void)c;
    (void)T;
    if (out)
        memset(out, 0, sizeof *out);
    return no_cuda(err);
}

lm_status lm_cuda_moe_forward(lm_cuda_ctx *ctx, const lm_moe_config *c, int T,
                              const lm_cuda_moe_weights *w, const void *x, const int32_t *topk_idx,
                              const float *topk_weight, const int32_t *counts, int training,
                              void *saved, void *scratch, void *y, const lm_cuda_moe_opts *opts,
                              lm_error *err) {
    (void)ctx, (void)c, (void)T, (void)w, (void)x, (void)topk_idx, (void)topk_weight;
    (void)counts, (void)training, (void)saved, (void)scratch, (void)y, (void)opts;
    return no_cuda(err);
}

lm_status lm_cuda_moe_backward(lm_cuda_ctx *ctx, const lm_moe_config *c, int T,
                               const lm_cuda_moe_weights *w, const void *x,
                               const float *topk_weight, const void *saved, void *scratch,
                               const void *dy, void *dx, float *dtopk_weight,
                               const lm_cuda_moe_grads *g, const lm_cuda_moe_opts *opts,
                               lm_error *err) {
    (void)ctx, (void)c, (void)T, (void)w, (void)x, (void)topk_weight, (void)saved;
    (void)scratch, (void)dy, (void)dx, (void)dtopk_weight, (void)g, (void)opts;
    return no_cuda(err);
}

double lm_cuda_moe_forward_flops(const lm_moe_config *c, int64_t T, int64_t assignments) {
    const double d = c->hidden_size, f = c->moe_intermediate_size;
    const double fs = (double)c->n_shared_experts * f;
    return 6.0 * d * f * (double)assignments + 6.0 * (double)T * d * fs;
}
