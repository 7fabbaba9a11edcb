/* linmoe built without CUDA: the GPU benchmark helpers (include/linmoe/cuda_bench.h)
 * report LM_ERR_UNSUPPORTED. Compiled only when CMake builds no CUDA kernels. */
#include "linmoe/cuda_bench.h"

#define NO_CUDA_MSG "cuda bench: this linmoe was built without CUDA (no nvcc found by CMake)"

int lm_cuda_built(void) { return 0; }

lm_status lm_cuda_device_info(char *name, size_t size, int *sm_count, size_t *mem_bytes,
                              lm_error *err) {
    if (name && size > 0)
        name[0] = '\0';
    if (sm_count)
        *sm_count = 0;
    if (mem_bytes)
        *mem_bytes = 0;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

lm_status lm_cuda_measure_limits(lm_cuda_ctx *ctx, int repeat, lm_cuda_limits *lim, lm_error *err) {
    (void)ctx;
    (void)repeat;
    (void)lim;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

lm_status lm_cuda_fill_normal_bf16(lm_cuda_ctx *ctx, void *dst, int64_t n, uint64_t seed,
                                   float mean, float std, lm_error *err) {
    (void)ctx;
    (void)dst;
    (void)n;
    (void)seed;
    (void)mean;
    (void)std;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

lm_status lm_cuda_fill_normal_f32(lm_cuda_ctx *ctx, float *dst, int64_t n, uint64_t seed,
                                  float mean, float std, lm_error *err) {
    (void)ctx;
    return lm_cuda_fill_normal_bf16(ctx, dst, n, seed, mean, std, err);
}

lm_status lm_cuda_count_nonfinite_bf16(lm_cuda_ctx *ctx, const void *x, int64_t n, int64_t *count,
                                       lm_error *err) {
    (void)ctx;
    (void)x;
    (void)n;
    if (count)
        *count = 0;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

lm_status lm_cuda_count_nonfinite_f32(lm_cuda_ctx *ctx, const float *x, int64_t n, int64_t *count,
                                      lm_error *err) {
    (void)ctx;
    return lm_cuda_count_nonfinite_bf16(ctx, x, n, count, err);
}

lm_status lm_cuda_timer_new(lm_cuda_ctx *ctx, lm_cuda_timer **t, lm_error *err) {
    (void)ctx;
    if (t)
        *t = NULL;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

lm_status lm_cuda_timer_start(lm_cuda_timer *t, lm_error *err) {
    (void)t;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

lm_status lm_cuda_timer_stop(lm_cuda_timer *t, double *ms, lm_error *err) {
    (void)t;
    if (ms)
        *ms = 0;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

void lm_cuda_timer_free(lm_cuda_timer *t) { (void)t; }
