/* linmoe GPU model: the hybrid KDA / full-attention MoE language model of model.h on one
 * CUDA device, for training and evaluation: bf16 activations and working weights, fp32
 * accumulation, fp32 master weights, gradients and AdamW moments (DESIGN.md "GPU
 * numerics"), built from the backend's ops (include/linmoe/cuda_*.h, kda_cuda.h).
 *
 * Math: exactly model.h's (the same parameters, the same wiring of sublayers, the
 * standard pre-norm residual or Block / full AttnRes, the same loss), so the CPU fp32
 * model is the reference (tests/test_gpu_model.c compares the loss, the logits' loss per
 * token and every parameter gradient). Differences are rounding only: bf16 storage of
 * activations (the residual stream included) and of the weights the ops read; the fused
 * LM head + cross-entropy computes bf16 logits (cuda_gemm.h).
 *
 * Parameters: the device holds the fp32 master copy of the whole lm_params buffer (same
 * layout, params.h offsets), its bf16 working copy, the fp32 gradient buffer and AdamW's
 * two moments, each one allocation. The MoE selection biases live in the layers' device
 * router states. lm_gpu_model_upload / _download move masters (and biases) between the
 * host lm_params and the device, so checkpoints are the CPU's (safetensors of fp32
 * masters) and load on either device.
 *
 * A training step (lm_gpu_model_micro_step per micro-batch, then lm_gpu_model_grad_norm,
 * one read of the step's scalars, lm_gpu_model_optim_step) allocates nothing on the
 * device after the first step (the ops' context workspaces grow once): every buffer for
 * batches of up to max_tokens tokens is allocated by lm_gpu_model_new, one allocation
 * per memory class where the layer modules allow it; lm_gpu_model_plan gives the sizes
 * before anything is allocated.
 *
 * Asynchrony: every call enqueues work on the context's stream; only
 * lm_gpu_model_read_step, _download, _new and _optim_step with metrics (its one download)
 * synchronise.
 *
 * Determinism: every op in the step is deterministic (fixed-order reductions, no float
 * atomics: kda_cuda.h "Reproducibility", the attention backward with the context's
 * "deterministic" option, the default), so two runs from the same state give the same
 * bits: a resumed run is the same run.
 *
 * Errors: LM_ERR_INVALID for a bad argument or batch (named), LM_ERR_UNSUPPORTED for a
 * configuration the CUDA backend cannot run (lm_gpu_model_supports names the key) or a
 * build without CUDA, LM_ERR_NOMEM when the plan does not fit the device (the message
 * gives the planned sizes per class), LM_ERR_IO from CUDA.
 */
#ifndef LINMOE_GPU_MODEL_H
#define LINMOE_GPU_MODEL_H

#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/model.h"
#include "linmoe/moe_router.h"
#include "linmoe/params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_gpu_model lm_gpu_model;

/* Most micro-batches of one step (loss slots read back per step). */
#define LM_GPU_MODEL_MAX_MICRO 256

/* LM_OK when the CUDA backend runs every layer of cfg (head dims, MoE limits, short
 * conv width, AttnRes sources), else LM_ERR_UNSUPPORTED naming the config key and
 * value. Pure (no device). */
lm_status lm_gpu_model_supports(const lm_model_config *cfg, lm_error *err);

/* Device bytes per memory class (lm_mem_class of model.h) for batches of up to
 * max_tokens tokens and max_seqs documents; threads is 0. Pure. */
lm_status lm_gpu_model_plan(const lm_model_config *cfg, int64_t max_tokens, int max_seqs,
                            lm_mem_plan *out, lm_error *err);

/* Build the model on ctx's device for batches of up to max_tokens tokens (B*T) and up to
 * max_seqs documents per packed batch, and upload p (masters, bf16 copy, MoE biases).
 * p is not kept. Checks lm_gpu_model_supports and that the plan fits the device's memory
 * before allocating. */
lm_status lm_gpu_model_new(lm_gpu_model **out, lm_cuda_ctx *ctx, const lm_params *p,
                           int64_t max_tokens, int max_seqs, lm_error *err);

/* Options of the _opts forms (NULL or zeroed: the defaults above).
 *   recompute: NULL, or uint8 [num_hidden_layers], 1 = activation recompute for decoder
 *     layer i (0-based): its mixer's and FFN's internal activations (KDA: projections,
 *     conv outputs, gate, the op's saved tensors; attention: q, k, v, o, lse; dense FFN:
 *     [g | u]; MoE: the experts' permuted inputs and [g | u]) are not kept per layer but
 *     in one buffer set shared by every recomputed layer, and the backward runs the
 *     layer's forward again from its kept input (the normed sublayer input; a MoE layer
 *     keeps its routing, so the router's balance counts are not taken twice). With
 *     deterministic ops the gradients should be bit-identical to those without recompute;
 *     tests/test_gpu_model.c test_recompute checks that (its status: docs/perf-notes.md,
 *     GPU model). The cost is one more forward of those layers. The memory plan counts the shared set
 *     once (lm_gpu_model_plan_opts: compare the activation class with and without). */
typedef struct {
    const uint8_t *recompute;
} lm_gpu_model_opts;
lm_status lm_gpu_model_plan_opts(const lm_model_config *cfg, int64_t max_tokens, int max_seqs,
                                 const lm_gpu_model_opts *o, lm_mem_plan *out, lm_error *err);
lm_status lm_gpu_model_new_opts(lm_gpu_model **out, lm_cuda_ctx *ctx, const lm_params *p,
                                int64_t max_tokens, int max_seqs, const lm_gpu_model_opts *o,
                                lm_error *err);
void lm_gpu_model_free(lm_gpu_model *m);
const lm_mem_plan *lm_gpu_model_mem_plan(const lm_gpu_model *m);
/* The model's config (rope_theta as last set) and its max_tokens. */
const lm_model_config *lm_gpu_model_config(const lm_gpu_model *m);
int64_t lm_gpu_model_max_tokens(const lm_gpu_model *m);

/* Host -> device: the parameter values of p (same config) into the masters, the bf16
 * copy and the MoE biases. Device -> host: masters and biases into p (synchronises). */
lm_status lm_gpu_model_upload(lm_gpu_model *m, const lm_params *p, lm_error *err);
lm_status lm_gpu_model_download(lm_gpu_model *m, lm_params *p, lm_error *err);

/* Set the RoPE base of every RoPE attention layer (a context-extension stage). */
lm_status lm_gpu_model_set_rope_theta(lm_gpu_model *m, double theta, lm_error *err);

/* One micro-batch of a training step: forward, the fused LM head + cross-entropy and
 * the backward of loss_scale * (mean CE over the labelled tokens + the routers' aux
 * losses), gradients accumulated into the device gradient buffer (accumulate = 0 zeroes
 * it first). ids, labels: host int32 [B*T] (validated on the host: ids in [0, V),
 * labels in [0, V) or LM_MODEL_IGNORE). slot in [0, LM_GPU_MODEL_MAX_MICRO): where this
 * micro-batch's loss sum and labelled-token count go (lm_gpu_model_read_step). The
 * routers accumulate the step's balance counts (b->training semantics of model.h). */
lm_status lm_gpu_model_micro_step(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                                  const int32_t *labels, float loss_scale, int accumulate, int slot,
                                  lm_error *err);

/* Data parallelism (the GPU trainer's gradient reduction over NCCL; docs/distributed.md
 * "GPU ranks"). The model calls the hooks from the host thread that enqueues its work;
 * each hook enqueues work of its own (on another stream, ordered with the model's stream
 * lm_cuda_ctx_stream by events) and must not synchronise the host.
 *   grads_ready: during the backward of a micro-step run with reduce = 1
 *     (lm_gpu_model_micro_step_ex), the gradient elements [lo, hi) of g (the device
 *     gradient buffer, fp32 [numel]) are final for the step: every op that writes them
 *     has been enqueued on the model's stream, no later op of the step writes them.
 *     The calls tile [0, numel) in decreasing order (each hi is the previous lo; the
 *     first has hi = numel): the tail tensors (final norm, AttnRes final vectors,
 *     lm_head) after the final norm's backward, then decoder layer L-1 .. 0, each after
 *     its mixer's backward (the layer's tensors are contiguous in the params.h layout:
 *     one range per layer), then the embedding (lo = 0) after the embedding backward,
 *     the step's last op. A parameter layout where a layer's tensors are not one range
 *     (expert-sharded tables) gets one call [0, numel) at the end.
 *   router_sums: in lm_gpu_model_optim_step, before the bias updates: the step
 *     accumulators of every MoE layer (acc[j], fp64 [n] each, cuda_router.h
 *     LM_CUDA_ROUTER_ACC_LEN(E), for `count` layers in layer order) must be summed over
 *     the ranks in place; the model's stream must wait for that before going on.
 * NULL (or zeroed hooks): one process, nothing is called. */
typedef struct {
    lm_status (*grads_ready)(void *arg, float *g, int64_t lo, int64_t hi, lm_error *err);
    lm_status (*router_sums)(void *arg, double *const *acc, int n, int count, lm_error *err);
    void *arg;
} lm_gpu_model_dp;
lm_status lm_gpu_model_set_dp(lm_gpu_model *m, const lm_gpu_model_dp *dp, lm_error *err);
/* lm_gpu_model_micro_step with reduce = 1: the step's last micro-batch, whose backward
 * calls dp's grads_ready (reduce = 0: the same as lm_gpu_model_micro_step). */
lm_status lm_gpu_model_micro_step_ex(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                                     const int32_t *labels, float loss_scale, int accumulate,
                                     int slot, int reduce, lm_error *err);

/* Evaluation forward (dropless routing, nothing saved, no gradient): the loss sum and
 * count into slot, and, when nll_host is not NULL, the per-token nll [B*T] in nats
 * (0 for ignored labels) downloaded into it (synchronises). */
lm_status lm_gpu_model_eval(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                            const int32_t *labels, int slot, float *nll_host, lm_error *err);

/* Logits of rows row0 .. row0 + n_rows - 1 (rows of the B*T tokens, row-major) of the
 * last forward (micro_step or eval), fp32, downloaded into logits_host [n_rows, V]
 * (synchronises). 1 <= n_rows <= LM_GPU_MODEL_LOGIT_ROWS. */
#define LM_GPU_MODEL_LOGIT_ROWS 64
lm_status lm_gpu_model_logits_rows(lm_gpu_model *m, int64_t row0, int n_rows, float *logits_host,
                                   lm_error *err);

/* The global gradient norm of the trainable parameters (device; AdamW's clipping input). */
lm_status lm_gpu_model_grad_norm(lm_gpu_model *m, lm_error *err);

/* The step's scalars in one synchronisation: loss[i] = loss_sum[i] / count[i] (+ the
 * slot's aux losses) for slots 0..n_slots-1 (NaN when not finite; 0 with no labels),
 * n_labels[i], and the last lm_gpu_model_grad_norm. Any output may be NULL. */
lm_status lm_gpu_model_read_step(lm_gpu_model *m, int n_slots, double *loss, int64_t *n_labels,
                                 double *gnorm, lm_error *err);

/* AdamW (cuda_optim.h) on every trainable parameter with the device grad norm (clip when
 * grad_clip > 0), then the bf16 working copy; step t >= 1. Then, when update_bias, every
 * MoE layer's bias update from the step's counts, its metrics downloaded into
 * metrics_host[layer] (array of num_hidden_layers, entries of dense layers untouched;
 * may be NULL) and the step's pre-capacity selections per expert into
 * demand_host[layer * E + e] (may be NULL), all in one download. */
lm_status lm_gpu_model_optim_step(lm_gpu_model *m, double lr, double weight_decay, double beta1,
                                  double beta2, double eps, double grad_clip, int64_t t,
                                  lm_router_metrics *metrics_host, double *demand_host,
                                  lm_error *err);
/* A skipped step: zero the routers' step accumulators (the gradients are zeroed by the
 * next micro-step with accumulate = 0). */
lm_status lm_gpu_model_skip_step(lm_gpu_model *m, lm_error *err);

/* AdamW moments host <-> device (train_state of a checkpoint): m1, m2 [p->numel] fp32. */
lm_status lm_gpu_model_get_moments(lm_gpu_model *m, float *m1, float *m2, lm_error *err);
lm_status lm_gpu_model_set_moments(lm_gpu_model *m, const float *m1, const float *m2,
                                   lm_error *err);
/* The router states host <-> device (bias, last changes, history, accumulators):
 * states[layer] for MoE layers (entries of dense layers ignored). */
lm_status lm_gpu_model_get_router(lm_gpu_model *m, int layer, lm_router_state *st, lm_error *err);
lm_status lm_gpu_model_set_router(lm_gpu_model *m, int layer, const lm_router_state *st,
                                  lm_error *err);

/* Test hook: gradient element `index` of the device buffer set to `value` (the trainer's
 * NaN injection). */
lm_status lm_gpu_model_poke_grad(lm_gpu_model *m, int64_t index, float value, lm_error *err);

/* Op classes of the step profile (`linmoe bench model --device cuda`). */
typedef enum {
    LM_GPU_PROF_EMBED = 0, /* embedding gather and scatter-add */
    LM_GPU_PROF_NORM,      /* RMSNorms (with the fused residual adds) */
    LM_GPU_PROF_KDA,       /* KDA layers (projections, convs, KDA, gated norm) */
    LM_GPU_PROF_ATTN,      /* attention layers (projections, attention) */
    LM_GPU_PROF_DENSE,     /* dense SwiGLU FFNs */
    LM_GPU_PROF_MOE,       /* MoE FFNs (router GEMM, routing, permute, expert GEMMs, combine) */
    LM_GPU_PROF_ATTNRES,   /* AttnRes aggregations and their accumulators */
    LM_GPU_PROF_CE,        /* the fused LM head + cross-entropy */
    LM_GPU_PROF_OPTIM,     /* grad norm, AdamW, bias updates */
    LM_GPU_PROF_N
} lm_gpu_prof_class;
/* Name of a class ("embedding", "norms", "kda", ...). */
const char *lm_gpu_prof_name(int cls);
/* on = 1: time every op class with CUDA events from now on (a synchronisation per op:
 * for profiling runs only) and zero the totals; 0: off. */
lm_status lm_gpu_model_set_profile(lm_gpu_model *m, int on, lm_error *err);
/* The GPU ms per class accumulated since set_profile(1): ms[LM_GPU_PROF_N]. */
void lm_gpu_model_profile(const lm_gpu_model *m, double *ms);

/* The device gradient buffer downloaded into g [numel] fp32 (tests). */
lm_status lm_gpu_model_get_grads(lm_gpu_model *m, float *g, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
