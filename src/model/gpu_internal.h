/* The GPU model's layers (src/model/gpu_*.c): the token mixers and FFNs of
 * include/linmoe/model.h on one CUDA device, in bf16 storage with fp32 accumulation,
 * built from the backend's ops (cuda_gemm.h, cuda_layers.h, kda_cuda.h,
 * cuda_attention.h, cuda_router.h, cuda_moe.h, cuda_elementwise.h). Not a public API:
 * gpu_model.c (include/linmoe/gpu_model.h) owns the parameters and calls these.
 *
 * Math: exactly the CPU layers' (kda_layer.h, attn_layer.h, layers.h SwiGLU, moe.h); the
 * CPU fp32 engine is the reference the GPU model is tested against
 * (tests/test_gpu_model.c).
 *
 * Conventions shared by every layer here:
 *   - tokens: N = B*T rows, activations bf16 [N, d] row-major (uint16 storage);
 *   - weights: each parameter is available as its bf16 working copy (the `w16` pointer,
 *     AdamW writes it: cuda_optim.h) and as its fp32 master (`w32`); matrices, conv
 *     kernels and norm gains are read in bf16, A_log / dt_bias in fp32 (the KDA op's
 *     dtypes), the MoE selection bias lives in the router's device state;
 *   - gradients: fp32, in the parameter layout, ACCUMULATED (+=; the model zeroes them
 *     once per step): GEMMs with an fp32 C and beta = 1, ops that accumulate (cuda_layers.h
 *     weight gradients, cuda_moe.h), or a layer-owned fp32 stage added with
 *     lm_cuda_acc_*;
 *   - activation gradients (dx) are bf16 and OVERWRITTEN;
 *   - memory: every buffer a layer needs for up to max_tokens tokens is allocated by its
 *     _new (through lm_cuda_ctx_alloc, counted) and reported by its _bytes, so a step
 *     allocates nothing; a forward saves what its backward needs in the layer;
 *   - everything is asynchronous on the context's stream; no host synchronisation in a
 *     forward or backward (cu_seqlens travel as a host array in the batch, as the ops
 *     take them, plus a device int32 copy made once per batch by the model);
 *   - errors: the ops' (LM_ERR_INVALID / UNSUPPORTED / NOMEM / IO), the message prefixed
 *     by the layer's name.
 */
#ifndef LINMOE_GPU_INTERNAL_H
#define LINMOE_GPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/attn_layer.h"
#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/cuda_router.h"
#include "linmoe/kda_layer.h"
#include "linmoe/moe.h"

/* One micro-batch as the layers see it. */
typedef struct {
    lm_cuda_ctx *ctx;
    int B, T;                  /* B rows of T tokens; B == 1 with cu_seqlens */
    int64_t N;                 /* B * T */
    const int64_t *cu_seqlens; /* host int64 [n_cu] or NULL (the ops' form) */
    int n_cu;
    const int32_t *cu_dev; /* device int32 [n_cu] copy of cu_seqlens, or NULL */
    int training;          /* 1: MoE capacity and balance accumulation */
} lm_gpu_batch;

/* ---------------------------------------------------------------- KDA layer (gpu_kda_layer.c)
 * kda_layer.h's math and parameter names. Saved for the backward: the projections'
 * outputs, the conv outputs, the gate and beta inputs, the KDA op's saved object
 * (kda_cuda.h lm_kda_cuda_saved, kept per layer across steps so the op does not allocate),
 * the KDA output and the gated norm's inputs. */
typedef struct {
    const void *q_proj, *k_proj, *v_proj;       /* bf16 [C, d] */
    const void *q_conv1d, *k_conv1d, *v_conv1d; /* bf16 [C, W] */
    const void *f_a_proj, *f_b_proj;            /* bf16 [Dh, d], [C, Dh] */
    const float *A_log, *dt_bias;               /* fp32 [H], [C] */
    const void *b_proj;                         /* bf16 [H, d] */
    const void *g_a_proj, *g_b_proj;            /* bf16 [Dh, d], [C, Dh] */
    const void *o_norm;                         /* bf16 [Dh] */
    const void *o_proj;                         /* bf16 [d, C] */
} lm_gpu_kda_weights;

typedef struct {
    float *q_proj, *k_proj, *v_proj;
    float *q_conv1d, *k_conv1d, *v_conv1d;
    float *f_a_proj, *f_b_proj;
    float *A_log, *dt_bias;
    float *b_proj;
    float *g_a_proj, *g_b_proj;
    float *o_norm;
    float *o_proj;
} lm_gpu_kda_grads; /* fp32, ACCUMULATED, shapes of the weights */

typedef struct lm_gpu_kda_layer lm_gpu_kda_layer;

/* Device bytes lm_gpu_kda_layer_new allocates for up to max_tokens tokens and up to
 * max_seqs sequences per batch (0: no bound): the saved activations and the KDA op's
 * saved tensors (the memory plan's activations of this layer). 0 for a bad config.
 * lm_gpu_kda_layer_scratch_bytes: the backward scratch, which one layer uses at a time,
 * so the model allocates one for every KDA layer and passes it to _new (NULL: the layer
 * allocates its own). */
size_t lm_gpu_kda_layer_bytes(const lm_kda_layer_config *c, int64_t max_tokens, int max_seqs);
size_t lm_gpu_kda_layer_scratch_bytes(const lm_kda_layer_config *c, int64_t max_tokens);
lm_status lm_gpu_kda_layer_new(lm_cuda_ctx *ctx, const lm_kda_layer_config *c, int64_t max_tokens,
                               int max_seqs, void *scratch, lm_gpu_kda_layer **out, lm_error *err);
void lm_gpu_kda_layer_free(lm_gpu_kda_layer *L);
/* out [N, d] bf16 (overwritten) from the normed input x [N, d] bf16. b->training = 1
 * saves for the backward; 0 (evaluation) may skip it. */
lm_status lm_gpu_kda_layer_forward(lm_gpu_kda_layer *L, const lm_gpu_batch *b,
                                   const lm_gpu_kda_weights *w, const void *x, void *out,
                                   lm_error *err);
/* Backward of sum(out * dout) of the last training forward (same batch, weights, x):
 * dx [N, d] bf16 overwritten; weight gradients accumulated into g. */
lm_status lm_gpu_kda_layer_backward(lm_gpu_kda_layer *L, const lm_gpu_batch *b,
                                    const lm_gpu_kda_weights *w, const void *x, const void *dout,
                                    void *dx, const lm_gpu_kda_grads *g, lm_error *err);

/* ---------------------------------------------------------------- MoE FFN (gpu_moe_layer.c)
 * moe.h's math: router logits = x gate.weight^T (fp32), lm_cuda_router_forward (bias
 * from the layer's device router state), lm_cuda_moe_forward (routed + shared experts);
 * backward lm_cuda_moe_backward, lm_cuda_router_backward, then the router's share of dx
 * (dlogits W_router) and d gate.weight. */
typedef struct {
    const void *gate;                            /* bf16 [E, d] router */
    const void *gate_proj, *up_proj, *down_proj; /* bf16 [E,f,d],[E,f,d],[E,d,f] */
    const void *shared_gate_proj, *shared_up_proj, *shared_down_proj; /* bf16 or NULL */
} lm_gpu_moe_weights;

typedef struct {
    float *gate;
    float *gate_proj, *up_proj, *down_proj;
    float *shared_gate_proj, *shared_up_proj, *shared_down_proj;
} lm_gpu_moe_grads; /* fp32, ACCUMULATED */

typedef struct lm_gpu_moe_layer lm_gpu_moe_layer;

/* Device bytes of lm_gpu_moe_layer_new for up to max_tokens tokens: the routing buffers
 * and router state always, the experts' saved activations when own_saved and their
 * scratch when own_scratch (0 for a bad config). lm_gpu_moe_layer_shared_bytes: the sizes
 * of those two buffers, for a caller that shares them (the scratch between every MoE
 * layer, since one layer runs at a time; the saved activations between the layers it
 * recomputes). */
size_t lm_gpu_moe_layer_bytes(const lm_moe_config *c, int64_t max_tokens, int own_saved,
                              int own_scratch);
lm_status lm_gpu_moe_layer_shared_bytes(const lm_moe_config *c, int64_t max_tokens,
                                        size_t *saved_bytes, size_t *scratch_bytes, lm_error *err);
/* max_seqs: the most documents a batch may hold (rows of the sequence-wise aux loss).
 * shared_saved / shared_scratch: caller-owned device buffers of the shared sizes, or
 * NULL for the layer's own. */
lm_status lm_gpu_moe_layer_new(lm_cuda_ctx *ctx, const lm_moe_config *c, int64_t max_tokens,
                               int max_seqs, void *shared_saved, void *shared_scratch,
                               lm_gpu_moe_layer **out, lm_error *err);
void lm_gpu_moe_layer_free(lm_gpu_moe_layer *L);
/* The layer's device router state (selection bias [E] fp32, step accumulators): the
 * model uploads the checkpoint's bias into it and downloads it for a checkpoint. */
lm_cuda_router_state *lm_gpu_moe_layer_router(lm_gpu_moe_layer *L);
/* out [N, d] bf16 (overwritten). b->training: capacity dropping and the step
 * accumulators (moe_router.h). *aux_loss_dev: device fp32 [1] of this micro-batch's aux
 * loss when the config has balance = AUX_LOSS, else NULL (may be NULL). */
lm_status lm_gpu_moe_layer_forward(lm_gpu_moe_layer *L, const lm_gpu_batch *b,
                                   const lm_gpu_moe_weights *w, const void *x, void *out,
                                   const float **aux_loss_dev, lm_error *err);
/* Activation recompute: the experts' forward of the last training forward again, from
 * the routing it kept (no router work, no balance accumulation), refilling the saved
 * activations that another layer sharing them overwrote; out [N, d] bf16 receives the
 * same output again (bit-identical: deterministic ops). Then _backward as usual. */
lm_status lm_gpu_moe_layer_refill(lm_gpu_moe_layer *L, const lm_gpu_batch *b,
                                  const lm_gpu_moe_weights *w, const void *x, void *out,
                                  lm_error *err);
/* Backward of sum(out * dout) [+ aux_scale * aux loss] of the last training forward:
 * dx [N, d] bf16 overwritten (experts + router share); gradients accumulated. */
lm_status lm_gpu_moe_layer_backward(lm_gpu_moe_layer *L, const lm_gpu_batch *b,
                                    const lm_gpu_moe_weights *w, const void *x, const void *dout,
                                    float aux_scale, void *dx, const lm_gpu_moe_grads *g,
                                    lm_error *err);
/* Once per optimizer step after the last micro-batch: lm_cuda_router_update_bias with
 * the step's accumulators ("all-reduce here" is this call's caller), writing the step's
 * metrics into *metrics_dev (device lm_router_metrics, may be NULL). */
lm_status lm_gpu_moe_layer_update_bias(lm_gpu_moe_layer *L, lm_router_metrics *metrics_dev,
                                       lm_error *err);
/* Zero the step accumulators (a skipped step). */
lm_status lm_gpu_moe_layer_reset_step(lm_gpu_moe_layer *L, lm_error *err);

#endif
