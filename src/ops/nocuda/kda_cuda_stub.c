/* linmoe built without CUDA: the CUDA entry points report LM_ERR_UNSUPPORTED
 * (include/linmoe/kda_cuda.h). Compiled only when CMake finds no CUDA compiler. */
#include <stdio.h>

#include "linmoe/kda_cuda.h"

static lm_status no_cuda(lm_error *err, const char *what) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "%s: this linmoe was built without CUDA", what);
}

static int no_cuda_flat(char *errbuf, int errlen, const char *what) {
    if (errbuf && errlen > 0)
        snprintf(errbuf, (size_t)errlen, "%s: this linmoe was built without CUDA", what);
    return (int)LM_ERR_UNSUPPORTED;
}

int lm_cuda_device_count(void) { return 0; }

lm_status lm_kda_cuda_chunk_forward(lm_cuda_ctx *ctx, lm_kda_config *c,
                                    const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                    lm_error *err) {
    (void)ctx, (void)c, (void)in, (void)out;
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "kda cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

void lm_kda_cuda_release(lm_cuda_ctx *ctx) { (void)ctx; }

lm_status lm_cuda_alloc(void **ptr, size_t bytes, lm_error *err) {
    (void)bytes;
    if (ptr)
        *ptr = NULL;
    return no_cuda(err, "cuda");
}

void lm_cuda_free(void *ptr) { (void)ptr; }

lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes, lm_error *err) {
    (void)dst, (void)src, (void)bytes;
    return no_cuda(err, "cuda");
}

lm_status lm_cuda_download(void *dst, const void *src, size_t bytes, lm_error *err) {
    return lm_cuda_upload(dst, src, bytes, err);
}

int lm_kda_cuda_forward_flat(lm_cuda_ctx *ctx, int B, int T, int H, int HV, int K, int V,
                             const int64_t *cu_seqlens, int n_cu_seqlens, int kind, int gate,
                             float lower_bound, float scale, int use_qk_l2norm_in_kernel,
                             int use_beta_sigmoid_in_kernel, const void *q, const void *k,
                             const void *v, const void *g, const void *beta, const float *A_log,
                             const float *dt_bias, const float *h0, void *o, float *ht,
                             char *errbuf, int errlen) {
    (void)ctx, (void)B, (void)T, (void)H, (void)HV, (void)K, (void)V, (void)cu_seqlens;
    (void)n_cu_seqlens, (void)kind, (void)gate, (void)lower_bound, (void)scale;
    (void)use_qk_l2norm_in_kernel, (void)use_beta_sigmoid_in_kernel, (void)q, (void)k, (void)v;
    (void)g, (void)beta, (void)A_log, (void)dt_bias, (void)h0, (void)o, (void)ht;
    return no_cuda_flat(errbuf, errlen, "kda cuda");
}

lm_status lm_kda_cuda_decode_step(lm_cuda_ctx *ctx, lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                  float *state, void *o, lm_error *err) {
    (void)ctx, (void)c, (void)in, (void)state, (void)o;
    return no_cuda(err, "kda cuda decode");
}

lm_status lm_kda_cuda_forward_train(lm_cuda_ctx *ctx, lm_kda_config *c,
                                    const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                    lm_kda_cuda_saved **saved, lm_error *err) {
    (void)ctx, (void)c, (void)in, (void)out;
    if (saved)
        *saved = NULL;
    return no_cuda(err, "kda cuda");
}

size_t lm_kda_cuda_saved_bytes(const lm_kda_config *c) {
    (void)c;
    return 0;
}

size_t lm_kda_cuda_saved_bytes_max(int64_t max_tokens, int max_seqs, int HV) {
    (void)max_tokens, (void)max_seqs, (void)HV;
    return 0;
}

lm_status lm_kda_cuda_forward_train_buf(lm_cuda_ctx *ctx, lm_kda_config *c,
                                        const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                        void *buf, size_t cap, lm_kda_cuda_saved **saved,
                                        lm_error *err) {
    (void)ctx, (void)c, (void)in, (void)out, (void)buf, (void)cap;
    if (saved)
        *saved = NULL;
    return no_cuda(err, "kda cuda");
}

lm_status lm_kda_cuda_backward(lm_cuda_ctx *ctx, lm_kda_cuda_saved *saved,
                               const lm_kda_cuda_grads *gr, lm_error *err) {
    (void)ctx, (void)saved, (void)gr;
    return no_cuda(err, "kda cuda");
}

void lm_kda_cuda_saved_free(lm_cuda_ctx *ctx, lm_kda_cuda_saved *saved) { (void)ctx, (void)saved; }

int lm_kda_cuda_decode_flat(lm_cuda_ctx *ctx, int B, int H, int HV, int K, int V, int kind,
                            int gate, float lower_bound, float scale, int use_qk_l2norm_in_kernel,
                            int use_beta_sigmoid_in_kernel, const void *q, const void *k,
                            const void *v, const void *g, const void *beta, const float *A_log,
                            const float *dt_bias, float *state, void *o, char *errbuf, int errlen) {
    (void)ctx, (void)B, (void)H, (void)HV, (void)K, (void)V, (void)kind, (void)gate;
    (void)lower_bound, (void)scale, (void)use_qk_l2norm_in_kernel;
    (void)use_beta_sigmoid_in_kernel, (void)q, (void)k, (void)v, (void)g, (void)beta;
    (void)A_log, (void)dt_bias, (void)state, (void)o;
    return no_cuda_flat(errbuf, errlen, "kda cuda decode");
}
