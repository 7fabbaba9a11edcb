/* linmoe built without CUDA: the CUDA entry points report LM_ERR_UNSUPPORTED
 * (include/linmoe/kda_cuda.h). Compiled only when CMake finds no CUDA compiler. */
#include "linmoe/kda_cuda.h"

int lm_cuda_device_count(void) { return 0; }

lm_status lm_kda_cuda_chunk_forward(lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                    lm_kda_cuda_outputs *out, lm_error *err) {
    (void)c;
    (void)in;
    (void)out;
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "kda cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

void lm_kda_cuda_release(void) {}

lm_status lm_cuda_alloc(void **ptr, size_t bytes, lm_error *err) {
    (void)bytes;
    if (ptr)
        *ptr = NULL;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "cuda: this linmoe was built without CUDA");
}

void lm_cuda_free(void *ptr) { (void)ptr; }

lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes, lm_error *err) {
    (void)dst;
    (void)src;
    (void)bytes;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "cuda: this linmoe was built without CUDA");
}

lm_status lm_cuda_download(void *dst, const void *src, size_t bytes, lm_error *err) {
    return lm_cuda_upload(dst, src, bytes, err);
}

lm_status lm_kda_cuda_decode_step(lm_kda_config *c, const lm_kda_cuda_inputs *in, float *state,
                                  void *o, lm_error *err) {
    (void)c;
    (void)in;
    (void)state;
    (void)o;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda decode: this linmoe was built without CUDA");
}

lm_status lm_kda_cuda_forward_train(lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                    lm_kda_cuda_outputs *out, lm_kda_cuda_saved **saved,
                                    lm_error *err) {
    (void)c;
    (void)in;
    (void)out;
    if (saved)
        *saved = NULL;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: this linmoe was built without CUDA");
}

lm_status lm_kda_cuda_backward(lm_kda_cuda_saved *saved, const lm_kda_cuda_grads *gr,
                               lm_error *err) {
    (void)saved;
    (void)gr;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: this linmoe was built without CUDA");
}

void lm_kda_cuda_saved_free(lm_kda_cuda_saved *saved) { (void)saved; }

int lm_kda_cuda_decode_flat(int B, int H, int HV, int K, int V, int kind, int gate,
                            float lower_bound, float scale, int use_qk_l2norm_in_kernel,
                            int use_beta_sigmoid_in_kernel, const void *q, const void *k,
                            const void *v, const void *g, const void *beta, const float *A_log,
                            const float *dt_bias, float *state, void *o, char *errbuf, int errlen) {
    (void)B, (void)H, (void)HV, (void)K, (void)V, (void)kind, (void)gate, (void)lower_bound;
    (void)scale, (void)use_qk_l2norm_in_kernel, (void)use_beta_sigmoid_in_kernel;
    (void)q, (void)k, (void)v, (void)g, (void)beta, (void)A_log, (void)dt_bias, (void)state;
    (void)o;
    if (errbuf && errlen > 0)
        snprintf(errbuf, (size_t)errlen, "kda cuda decode: this linmoe was built without CUDA");
    return (int)LM_ERR_UNSUPPORTED;
}

lm_status lm_kda_cuda_decode_bench(lm_kda_config *c, const lm_kda_cuda_inputs *in, float *state,
                                   void *o, int variant, int warmup, int iters, double *ms,
                                   double *copy_gbs, lm_error *err) {
    (void)c, (void)in, (void)state, (void)o, (void)variant, (void)warmup, (void)iters;
    (void)ms, (void)copy_gbs;
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "kda cuda decode: this linmoe was built without CUDA");
}
