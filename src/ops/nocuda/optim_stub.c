/* linmoe built without CUDA: the AdamW entry points report LM_ERR_UNSUPPORTED
 * (include/linmoe/cuda_optim.h). Compiled only when CMake finds no CUDA compiler. */
#include "linmoe/cuda_optim.h"

static lm_status no_cuda(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "adamw cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

lm_status lm_cuda_adamw_plan_new(lm_cuda_ctx *ctx, const lm_cuda_adamw_segment *segments,
                                 int n_segments, int64_t numel, lm_cuda_adamw_plan **out,
                                 lm_error *err) {
    (void)ctx, (void)segments, (void)n_segments, (void)numel;
    if (out)
        *out = NULL;
    return no_cuda(err);
}

void lm_cuda_adamw_plan_free(lm_cuda_adamw_plan *plan) { (void)plan; }

int64_t lm_cuda_adamw_plan_numel(const lm_cuda_adamw_plan *plan) {
    (void)plan;
    return 0;
}

lm_status lm_cuda_adamw_grad_norm(lm_cuda_ctx *ctx, const lm_cuda_adamw_plan *plan, const float *g,
                                  float *gnorm, int32_t *skipped, lm_error *err) {
    (void)ctx, (void)plan, (void)g, (void)gnorm, (void)skipped;
    return no_cuda(err);
}

lm_status lm_cuda_adamw_step(lm_cuda_ctx *ctx, const lm_cuda_adamw_plan *plan,
                             const lm_cuda_adamw_hparams *hp, float *params, const float *g,
                             float *m, float *v, void *params_bf16, const float *gnorm,
                             lm_error *err) {
    (void)ctx, (void)plan, (void)hp, (void)params, (void)g, (void)m, (void)v, (void)params_bf16;
    (void)gnorm;
    return no_cuda(err);
}
