/* linmoe built without CUDA: the CUDA router entry points (include/linmoe/cuda_router.h)
 * report LM_ERR_UNSUPPORTED. Compiled only when CMake finds no CUDA compiler. */
#include <string.h>

#include "linmoe/cuda_router.h"

static lm_status no_cuda(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "router cuda: this linmoe was built without CUDA (no nvcc found by CMake)");
}

lm_status lm_cuda_router_state_init(lm_cuda_ctx *ctx, lm_cuda_router_state *s, int E,
                                    lm_error *err) {
    (void)ctx;
    (void)E;
    if (s)
        memset(s, 0, sizeof *s);
    return no_cuda(err);
}

void lm_cuda_router_state_free(lm_cuda_ctx *ctx, lm_cuda_router_state *s) {
    (void)ctx;
    if (s)
        memset(s, 0, sizeof *s);
}

lm_status lm_cuda_router_state_upload(lm_cuda_ctx *ctx, lm_cuda_router_state *dst,
                                      const lm_router_state *src, lm_error *err) {
    (void)ctx;
    (void)dst;
    (void)src;
    return no_cuda(err);
}

lm_status lm_cuda_router_state_download(lm_cuda_ctx *ctx, const lm_cuda_router_state *src,
                                        lm_router_state *dst, lm_error *err) {
    (void)ctx;
    (void)src;
    (void)dst;
    return no_cuda(err);
}

lm_status lm_cuda_route_alloc(lm_cuda_ctx *ctx, const lm_router_config *c, int T_cap, int seq_cap,
                              lm_cuda_route *r, lm_error *err) {
    (void)ctx;
    (void)c;
    (void)T_cap;
    (void)seq_cap;
    if (r)
        memset(r, 0, sizeof *r);
    return no_cuda(err);
}

void lm_cuda_route_free(lm_cuda_ctx *ctx, lm_cuda_route *r) {
    (void)ctx;
    if (r)
        memset(r, 0, sizeof *r);
}

lm_status lm_cuda_router_forward(lm_cuda_ctx *ctx, const lm_router_config *c,
                                 lm_cuda_router_state *st, const float *logits, int T,
                                 const int32_t *cu_seqlens, int n_cu, int training,
                                 lm_cuda_route *out, lm_error *err) {
    (void)ctx;
    (void)c;
    (void)st;
    (void)logits;
    (void)T;
    (void)cu_seqlens;
    (void)n_cu;
    (void)training;
    (void)out;
    return no_cuda(err);
}

lm_status lm_cuda_router_backward(lm_cuda_ctx *ctx, const lm_router_config *c,
                                  const lm_cuda_route *r, const float *dtopk_weight, float *dlogits,
                                  lm_error *err) {
    (void)ctx;
    (void)c;
    (void)r;
    (void)dtopk_weight;
    (void)dlogits;
    return no_cuda(err);
}

lm_status lm_cuda_router_update_bias(lm_cuda_ctx *ctx, const lm_router_config *c,
                                     lm_cuda_router_state *st, lm_router_metrics *metrics,
                                     lm_error *err) {
    (void)ctx;
    (void)c;
    (void)st;
    (void)metrics;
    return no_cuda(err);
}

lm_status lm_cuda_router_quantile_solve(lm_cuda_ctx *ctx, const lm_router_config *c,
                                        const float *scores, int T, const float *bias, int iters,
                                        float *beta, float *b_centred, lm_error *err) {
    (void)ctx;
    (void)c;
    (void)scores;
    (void)T;
    (void)bias;
    (void)iters;
    (void)beta;
    (void)b_centred;
    return no_cuda(err);
}

lm_status lm_cuda_router_maxvio(lm_cuda_ctx *ctx, const int32_t *counts, int E, float *maxvio,
                                lm_error *err) {
    (void)ctx;
    (void)counts;
    (void)E;
    (void)maxvio;
    return no_cuda(err);
}
