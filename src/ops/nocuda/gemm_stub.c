/* linmoe built without CUDA: the GEMM and cross-entropy entry points report
 * LM_ERR_UNSUPPORTED (include/linmoe/cuda_gemm.h). Compiled only when CMake finds no CUDA
 * compiler. */
#include "linmoe/cuda_gemm.h"

static lm_status no_cuda(lm_error *err, const char *op) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "%s: this linmoe was built without CUDA (no nvcc found by CMake)", op);
}

lm_status lm_cuda_gemm(lm_cuda_ctx *ctx, int trans_a, int trans_b, int M, int N, int K, float alpha,
                       const void *A, int64_t lda, const void *B, int64_t ldb, float beta, void *C,
                       int64_t ldc, lm_cuda_gemm_type c_type, lm_error *err) {
    (void)ctx, (void)trans_a, (void)trans_b, (void)M, (void)N, (void)K, (void)alpha, (void)A;
    (void)lda, (void)B, (void)ldb, (void)beta, (void)C, (void)ldc, (void)c_type;
    return no_cuda(err, "gemm cuda");
}

lm_status lm_cuda_gemm_ex(lm_cuda_ctx *ctx, const lm_cuda_gemm_desc *d, lm_error *err) {
    (void)ctx, (void)d;
    return no_cuda(err, "gemm cuda");
}

size_t lm_cuda_ce_scratch_bytes(const lm_cuda_ce_config *c, int want_grad) {
    (void)c, (void)want_grad;
    return 0;
}

lm_status lm_cuda_ce_forward_backward(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, const void *h,
                                      const void *W, const int32_t *labels,
                                      const lm_cuda_ce_outputs *out, lm_error *err) {
    (void)ctx, (void)c, (void)h, (void)W, (void)labels, (void)out;
    return no_cuda(err, "cross_entropy cuda");
}

lm_status lm_cuda_ce_forward(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, const void *h,
                             const void *W, const int32_t *labels, float *loss_sum, int32_t *count,
                             float *nll, lm_error *err) {
    (void)ctx, (void)c, (void)h, (void)W, (void)labels, (void)loss_sum, (void)count, (void)nll;
    return no_cuda(err, "cross_entropy cuda");
}
