/* The interface between attention.cu and attention_cudnn.cu: the forward and backward of
 * attention through cuDNN's fused engines (attention_cudnn.cu's file comment has the
 * graphs); LM_ERR_UNSUPPORTED when cuDNN builds no plan for the shape. Internal to
 * src/ops/cuda; not a public header. */
#ifndef LINMOE_OPS_CUDA_ATTENTION_CUDNN_CUH
#define LINMOE_OPS_CUDA_ATTENTION_CUDNN_CUH

#include <stdint.h>

#include "ops/cuda/ctx.cuh"

/* One cuDNN call's shape and device pointers (attention.cu fills it). Unused pointers
 * NULL. */
struct lm_attn_cudnn_io {
    int b, s, Hq, Hkv, D;
    int ragged; /* packed documents: ragged offsets and the padding mask */
    int det;    /* backward: the deterministic algorithm */
    float scale;
    const void *q, *k, *v, *o, *dO;
    void *o_out;                          /* forward output */
    float *stats;                         /* forward output / backward input */
    void *dq, *dk, *dv;                   /* backward outputs */
    float *dsum;                          /* backward scratch: rowsum(dO O) */
    float *dq_acc;                        /* backward scratch, non-deterministic only */
    void *dk_full, *dv_full;              /* backward scratch, ragged GQA only */
    const int *seq_len;                   /* ragged: int32 [b] */
    const int64_t *off_q, *off_k, *off_s; /* ragged: int64 [b + 1] */
};
struct lm_attn_cudnn;
void lm_attn_cudnn_destroy(lm_attn_cudnn *s);
lm_status lm_attn_cudnn_forward(lm_cuda_ctx *ctx, lm_attn_cudnn **state, const lm_attn_cudnn_io *io,
                                lm_error *err);
lm_status lm_attn_cudnn_backward(lm_cuda_ctx *ctx, lm_attn_cudnn **state,
                                 const lm_attn_cudnn_io *io, lm_error *err);

#endif
