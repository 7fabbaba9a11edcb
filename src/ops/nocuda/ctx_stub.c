/* linmoe built without CUDA: the context entry points of include/linmoe/backend.h report
 * LM_ERR_UNSUPPORTED. Compiled only when CMake finds no CUDA compiler. */
#include "linmoe/backend.h"

static lm_status no_cuda(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

lm_status lm_cuda_ctx_new(lm_cuda_ctx **out, int device, lm_error *err) {
    (void)device;
    if (out)
        *out = NULL;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_new_on_stream(lm_cuda_ctx **out, int device, void *stream, lm_error *err) {
    (void)stream;
    return lm_cuda_ctx_new(out, device, err);
}
void lm_cuda_ctx_free(lm_cuda_ctx *ctx) { (void)ctx; }
int lm_cuda_ctx_device(const lm_cuda_ctx *ctx) {
    (void)ctx;
    return -1;
}
void *lm_cuda_ctx_stream(const lm_cuda_ctx *ctx) {
    (void)ctx;
    return NULL;
}
lm_status lm_cuda_ctx_sync(lm_cuda_ctx *ctx, lm_error *err) {
    (void)ctx;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_alloc(lm_cuda_ctx *ctx, void **ptr, size_t bytes, lm_error *err) {
    (void)ctx;
    (void)bytes;
    if (ptr)
        *ptr = NULL;
    return no_cuda(err);
}
void lm_cuda_ctx_free_mem(lm_cuda_ctx *ctx, void *ptr) {
    (void)ctx;
    (void)ptr;
}
uint64_t lm_cuda_ctx_alloc_count(const lm_cuda_ctx *ctx) {
    (void)ctx;
    return 0;
}
lm_status lm_cuda_ctx_upload(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                             lm_error *err) {
    (void)ctx;
    (void)dst;
    (void)src;
    (void)bytes;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_download(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                               lm_error *err) {
    (void)ctx;
    (void)dst;
    (void)src;
    (void)bytes;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_memset(lm_cuda_ctx *ctx, void *dst, int value, size_t bytes, lm_error *err) {
    (void)ctx;
    (void)dst;
    (void)value;
    (void)bytes;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_mem_info(lm_cuda_ctx *ctx, size_t *free_bytes, size_t *total_bytes,
                               lm_error *err) {
    (void)ctx;
    (void)free_bytes;
    (void)total_bytes;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_copy(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                           lm_error *err) {
    (void)ctx;
    (void)dst;
    (void)src;
    (void)bytes;
    return no_cuda(err);
}
lm_status lm_cuda_ctx_set_option(lm_cuda_ctx *ctx, const char *key, int value, lm_error *err) {
    (void)ctx;
    (void)key;
    (void)value;
    return no_cuda(err);
}
int lm_cuda_ctx_get_option(const lm_cuda_ctx *ctx, const char *key) {
    (void)ctx;
    (void)key;
    return -1;
}
