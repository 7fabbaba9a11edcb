/* linmoe model: the hybrid KDA / full-attention MoE language model on the CPU in fp32:
 * training forward and backward over [B, T] or packed batches, and the inference path
 * (prefill with the chunked kernels, then decode with the recurrent KDA state, the
 * short-convolution state and a KV cache for the attention layers).
 *
 * Architecture (Kimi Linear, reference/kda.md §7, with GQA in place of MLA; DESIGN.md;
 * the config fields of model_config.h, the parameters of params.h). Sublayer 2i is
 * layer i's token mixer (KDA layer: kda_layer.h, or attention layer: attn_layer.h),
 * sublayer 2i+1 its FFN (dense SwiGLU for i < first_k_dense_replace: layers.h, else
 * MoE: moe.h). With e = embed_tokens[ids] [N, d], N = B*T tokens:
 *
 *   residual = standard (pre-norm):
 *     h = e;  for each sublayer l:  h = h + f_l(RMSNorm(h; norm_l))
 *     out = RMSNorm(h; model.norm)
 *   residual = block_attnres / full_attnres (reference/attnres_ctx.md §1.3, §4.2;
 *   Attention Residuals, arXiv 2603.15031, Eq. 2-6; S = attnres_block_size, 1 for full):
 *     src = [e]; part = none
 *     for l = 0 .. 2L-1:
 *       if l > 0 and l % S == 0: src.append(part); part = none      (block boundary)
 *       h_l = AR(src + [part if any]; query_l, norm_l)               (attnres.h)
 *       o_l = f_l(RMSNorm(h_l; norm_pre_l))
 *       part = o_l if none else part + o_l
 *     h = AR(src + [part]; model.attnres_final);  out = RMSNorm(h; model.norm)
 *     (query_l / norm_l: model.layers.i.attn_res.* for the mixer, mlp_res.* for the
 *     FFN; norm_pre_l: input_layernorm / post_attention_layernorm; AR eps =
 *     rms_norm_eps, scale 1. A single source is passed through unchanged.)
 *   logits = out lm_head^T (lm_head = embed_tokens when tie_word_embeddings)
 *   loss   = mean over labelled tokens of -log softmax(logits)[label] (nats),
 *            plus the routers' aux losses when balance = aux_loss.
 * All RMSNorms use rms_norm_eps; the KDA layer's gated head norm uses 1e-5.
 *
 * Packed batches (B = 1 with cu_seqlens): nothing crosses a document boundary; the
 * KDA state and the short convolution restart, attention is masked per document and
 * RoPE positions restart at 0 (the layer ops take cu_seqlens); everything else acts
 * per token.
 *
 * Layouts: ids / labels [B, T] int32 row-major (labels: a token id, or
 * LM_MODEL_IGNORE = -100 for "no target"); logits [B, T, V] fp32; gradients in one
 * buffer with the layout of the parameter buffer (params.h offsets).
 *
 * Memory (DESIGN.md "Devices, memory and scale"; CONVENTIONS.md "Memory and
 * errors"): lm_model_mem_plan gives, for (config, micro-batch B, sequence length T),
 * the bytes of each memory class: parameters, gradients, optimizer state (AdamW's m
 * and v), activations saved for the backward, scratch. lm_model_new allocates the
 * gradient, activation and scratch classes once each and hands views of them to the
 * layers, norms and the cross-entropy; a training step (forward + backward) then
 * allocates nothing in this module (tests/test_mem_plan.c counts). Gradients
 * accumulate in place: a backward with accumulate = 1 adds into the one gradient
 * buffer (GEMMs with beta = 1); ops that can only overwrite a weight gradient write
 * into a stage in the scratch class (sized for the largest such tensor, e.g. the LM
 * head), which is then added. Not in the table: the MoE layers' routing and expert
 * buffers and the attention / AttnRes workspaces, which their ops allocate at
 * lm_model_new or on first use (moe.h, attention.h, attnres.h), and the inference
 * caches (lm_model_cache_new).
 *
 * Threads: OpenMP (lm_set_num_threads); every op below is bitwise thread-count
 * independent, so are the model's outputs and gradients.
 *
 * What this module does not do: the optimizer and the router bias update (trainer),
 * bf16, CUDA, data loading, sampling.
 */
#ifndef LINMOE_MODEL_H
#define LINMOE_MODEL_H

#include "linmoe/core.h"
#include "linmoe/moe_router.h"
#include "linmoe/params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_MODEL_IGNORE (-100)

/* B rows of T tokens, or B == 1 and cu_seqlens [n_cu_seqlens] int64 document offsets
 * (0 = c_0 <= ... <= c_n = T) for packed documents. */
typedef struct {
    int B, T;
    const int64_t *cu_seqlens;
    int n_cu_seqlens;
} lm_model_batch;

typedef struct lm_model lm_model;

/* ---------------------------------------------------------------- memory plan */

typedef enum {
    LM_MEM_PARAMS = 0, /* fp32 parameters (lm_params; allocated by its owner) */
    LM_MEM_GRADS,      /* fp32 gradients, the parameter layout (the model's) */
    LM_MEM_OPTIM,      /* AdamW first and second moments, fp32 (the trainer's) */
    LM_MEM_ACTS,       /* activations the forward saves for the backward (the model's) */
    LM_MEM_SCRATCH,    /* backward accumulators, layer scratch, op workspaces, the
                          gradient stage (the model's) */
    LM_MEM_N_CLASSES
} lm_mem_class;

/* The size table for batches of B rows of T tokens (or B*T packed tokens in
 * documents of up to T tokens) on `threads` OpenMP threads. bytes[] per class,
 * 64-byte aligned slices included; total = their sum. */
typedef struct {
    int B, T, threads;
    int64_t numel; /* parameter elements (p->numel) */
    int64_t bytes[LM_MEM_N_CLASSES];
    int64_t total;
    int64_t kda_workspace_bytes; /* part of scratch: the KDA op's (shared by KDA layers) */
} lm_mem_plan;

/* The plan of `cfg` for B x T (B, T >= 1, B*T <= 2^30) at the current OpenMP thread
 * count (lm_get_num_threads: the per-thread scratch of the KDA op and the
 * cross-entropy scale with it). Pure: allocates nothing lasting. Errors:
 * LM_ERR_INVALID for a bad config (named), B or T. */
lm_status lm_model_mem_plan(const lm_model_config *cfg, int B, int T, lm_mem_plan *out,
                            lm_error *err);
/* "parameters", "gradients", "optimizer state", "activations", "scratch". */
const char *lm_mem_class_name(lm_mem_class k);
/* One line "memory plan (B = .., T = .., N threads): parameters X MiB, ...; total Y
 * MiB" into buf (snprintf semantics: returns the length it needed). */
int lm_mem_plan_format(const lm_mem_plan *p, char *buf, size_t size);

/* Build the runtime around the parameters `p` (borrowed: it must outlive the model
 * and keep its buffer): per-layer contexts, one router state per MoE layer whose
 * selection bias IS p's mlp.gate.e_score_correction_bias buffer (updates land in the
 * checkpoint), and the memory plan for batches of up to max_tokens = B*T tokens
 * (planned as B = 1, T = max_tokens, the worst case of every B*T <= max_tokens): the
 * gradient buffer of p->numel floats, the activation and the scratch class, one
 * allocation each. Errors: LM_ERR_INVALID (max_tokens < 1, an invalid config),
 * LM_ERR_NOMEM (naming the class sizes). */
lm_status lm_model_new(lm_model **out, lm_params *p, int64_t max_tokens, lm_error *err);
void lm_model_free(lm_model *m);
/* The plan lm_model_new allocated (B = 1, T = max_tokens, the thread count then). */
const lm_mem_plan *lm_model_plan(const lm_model *m);

lm_params *lm_model_params(lm_model *m);
/* The max_tokens given to lm_model_new (largest B*T per forward / infer call). */
int64_t lm_model_max_tokens(const lm_model *m);
/* Gradient buffer: p->numel floats, tensor t at p->t[t].offset (buffers stay 0). */
float *lm_model_grads(lm_model *m);
/* Expert parallel (issue 24, moe_ep.h): from now on the training forwards (training
 * = 1) and their backwards of every MoE layer run over the ranks of `ep` (borrowed;
 * collective: every rank of route makes the same calls), each rank computing the
 * routed experts [r*E/P, (r+1)*E/P) for the tokens of the EP group, the router on
 * the tokens of `route` (NULL: ep; moe_ep.h). With parameters of the single-rank
 * layout (every expert on every rank; evals and inference run locally) the backward
 * writes this rank's experts' gradients and zeros the others' (the sum over the
 * ranks is the whole gradient); with an expert-sharded table (params.h
 * lm_params_init_ep, whose rank and size must be ep's) the experts' tensors are
 * this rank's and only training forwards are possible. gate.weight / shared
 * experts' gradients are over this rank's tokens. The router state accumulates the
 * routed batch's demand. Errors: those of lm_moe_ep_new (E not divisible by the
 * group size); a sharded table of another rank or size (names both). */
typedef struct lm_comm lm_comm;
lm_status lm_model_set_expert_parallel(lm_model *m, lm_comm *ep, lm_comm *route, lm_error *err);
/* The factor on the aux-loss gradient of the expert-parallel MoE layers in the
 * following backwards (default, or a non-finite value: the backward's loss_scale).
 * With the router over a routed batch of several ranks every rank holds that
 * batch's whole aux loss, so its gradient takes the batch's factor (1 / micro-batches
 * in the trainer), not this rank's loss share. */
void lm_model_set_ep_aux_scale(lm_model *m, float scale);
/* Router state of layer `layer` (NULL for a dense or out-of-range layer). */
lm_router_state *lm_model_router_state(lm_model *m, int layer);
/* Routing of layer `layer`'s last forward (NULL for dense / none yet). */
const lm_route *lm_model_route(const lm_model *m, int layer);

/* Change the RoPE base of every RoPE attention layer (a context-extension stage's
 * rope_theta): sets p->cfg.rope_theta, so a checkpoint saved afterwards records it,
 * and the value the attention layers use from the next forward / infer on (their
 * cos/sin tables are rebuilt when the base changes). Keys already rotated into an
 * inference cache keep the old base: reset caches after a change. With no RoPE
 * layer only the config value changes. Errors: LM_ERR_INVALID for a non-finite or
 * non-positive theta (nothing changed). */
lm_status lm_model_set_rope_theta(lm_model *m, double theta, lm_error *err);

/* Training / eval forward. ids [B*T] in [0, V) (checked, the error names the
 * position). labels [B*T] (ids or LM_MODEL_IGNORE) or NULL: no loss, no backward.
 * training = 1: MoE capacity dropping (when configured) and router demand
 * accumulation; 0: dropless eval. logits [B*T, V] written when not NULL (the loss
 * never needs them: the cross-entropy is fused and chunked). *loss (may be NULL):
 * the mean CE in nats (+ aux losses); *n_labels (may be NULL): labelled tokens.
 * Errors: LM_ERR_INVALID for B*T > max_tokens, bad cu_seqlens, bad ids/labels,
 * non-finite activations (names the layer); the layer ops' errors. */
lm_status lm_model_forward(lm_model *m, const lm_model_batch *b, const int32_t *ids,
                           const int32_t *labels, int training, float *logits, double *loss,
                           int64_t *n_labels, lm_error *err);

/* Backward of loss_scale * loss of the last forward (which must have had labels).
 * accumulate = 0 overwrites the gradient buffer, 1 adds to it in place (micro-
 * batches; no second gradient buffer: see "Memory" above). */
lm_status lm_model_backward(lm_model *m, float loss_scale, int accumulate, lm_error *err);

/* Inspection (tests, evals) of the last forward or infer call, NULL for a bad l:
 * the input h_l [N, d] of sublayer l (0 <= l < 2L: the AttnRes mix, or the residual
 * stream before sublayer l), the running block sum after sublayer l (AttnRes modes;
 * NULL with the standard residual), and the embedding rows e [N, d]. */
const float *lm_model_sublayer_input(const lm_model *m, int l);
const float *lm_model_block_partial(const lm_model *m, int l);
const float *lm_model_embedding_out(const lm_model *m);

/* AttnRes depth weights of the last forward / infer: for sublayer l (0 <= l < 2L;
 * l = 2L: the final aggregation) the softmax weights averaged over the tokens,
 * p_mean[j] for source j (0 = embedding, then the completed blocks in order, then the
 * running block sum when present). Returns the number of sources (<= max_out), 0
 * with the standard residual or a bad l. */
int lm_model_attnres_weights(const lm_model *m, int l, double *p_mean, int max_out);

/* FLOPs of one training step (forward + backward) per token for sequence length T
 * (issue 4 item 8): 6 x (matmul parameters touched per token: projections, dense
 * FFN, shared experts, k routed experts, router, LM head; embedding lookup excluded)
 * + the KDA op's FLOPs per token (bench kda's formula, forward + backward) + 6*T*d
 * per attention layer (causal: 12*T*Hq*D/2). */
double lm_model_train_flops_per_token(const lm_model_config *c, int T);

/* ---------------------------------------------------------------- inference */

/* Per-sequence inference state for B rows of up to max_len tokens: per KDA layer the
 * conv states [3][B, H*Dh, W-1] and the recurrent state [B, H, Dh, Dh] fp32, per
 * attention layer the K/V cache [B, max_len, Hkv, D] (RoPE-rotated keys). Each row has
 * its own position (tokens consumed): a prefill (T > 1) needs the rows at one position,
 * a decode step (T = 1) takes rows at any positions, so a server keeps one row per
 * sequence (a slot): it prefills a new sequence through a view of its row, resets a
 * finished sequence's row, and decodes all rows in one batched step. */
typedef struct lm_model_cache lm_model_cache;
lm_status lm_model_cache_new(lm_model_cache **out, const lm_model *m, int B, int64_t max_len,
                             lm_error *err);
void lm_model_cache_free(lm_model_cache *c);
/* Back to position 0 (states zeroed). */
void lm_model_cache_reset(lm_model_cache *c);
/* Tokens consumed so far by row 0 (lm_model_cache_row_pos: by `row`, 0 outside). */
int64_t lm_model_cache_pos(const lm_model_cache *c);
int64_t lm_model_cache_row_pos(const lm_model_cache *c, int row);
/* Row `row` back to position 0: its KDA conv and recurrent states zeroed (its KV cache
 * rows need no clearing: only positions below the row's are read). On a view: the
 * view's row `row`. */
void lm_model_cache_reset_row(lm_model_cache *c, int row);
/* A cache of B = nrows over rows row .. row+nrows-1 of c (no copy: the view's states and
 * positions are those rows'); lm_model_cache_free frees only the view. c must outlive it
 * and not be a view. With one row: prefill a new sequence while the others keep their
 * state. With rows 0 .. n-1: decode the n active sequences of a server that keeps them
 * packed at the front (retiring row i: lm_model_cache_copy_row(c, i, n-1)), so idle rows
 * cost nothing. Errors: LM_ERR_INVALID (rows outside [0, B), m not c's model). */
lm_status lm_model_cache_view(lm_model_cache **out, lm_model_cache *c, const lm_model *m, int row,
                              int nrows, lm_error *err);
/* Row src's state (KDA conv and recurrent states, the KV cache up to its position) and
 * position into row dst of c (not a view). Errors: LM_ERR_INVALID for rows outside
 * [0, B). */
lm_status lm_model_cache_copy_row(lm_model_cache *c, int dst, int src, lm_error *err);

/* A row's state in two parts, for a prefix cache (serve.h): the recurrent part, per KDA
 * layer in layer order the conv states q, k, v [H*Dh, W-1] then the recurrent state
 * [H, Dh, Dh] (fp32, recurrent_floats in all; 0 without KDA layers), and per position the
 * attention layers' keys and values, in layer order K [Hkv, D] then V [Hkv, D]
 * (kv_floats_per_pos in all; 0 without attention layers). */
void lm_model_cache_row_sizes(const lm_model_cache *c, int64_t *recurrent_floats,
                              int64_t *kv_floats_per_pos);
/* Copy out row `row`'s recurrent part (recurrent [recurrent_floats], or NULL: skipped)
 * and its keys / values at positions [t0, t1) (kv [(t1 - t0) * kv_floats_per_pos], or
 * NULL). On a view: the view's row. Errors: LM_ERR_INVALID for a bad row or a range
 * outside [0, the row's position]. */
lm_status lm_model_cache_save_row(const lm_model_cache *c, int row, int64_t t0, int64_t t1,
                                  float *recurrent, float *kv, lm_error *err);
/* The inverse: write keys / values of positions [t0, t1) into row `row` (kv NULL:
 * none) and, when recurrent is not NULL, its recurrent part; the row's position becomes
 * t1. Restoring a prefix of P tokens is one call per saved range, in order, with the
 * recurrent part of position P on the last. Errors: LM_ERR_INVALID for a bad row or a
 * range outside [0, max_len]. */
lm_status lm_model_cache_load_row(lm_model_cache *c, int row, int64_t t0, int64_t t1,
                                  const float *recurrent, const float *kv, lm_error *err);

/* Feed T new tokens per row (ids [B, T]) through the model, updating the cache:
 * T > 1 is a prefill (chunked KDA with the cached state as initial state; attention
 * over the cache), T = 1 a decode step (recurrent KDA, one conv step, cached
 * attention). MoE without capacity. logits: [B, T, V] for every new token, or with
 * last_only = 1 [B, V] for the last one; may be NULL. Rows at different positions:
 * T must be 1 (each row's token at its own position). Errors: a row's position + T >
 * max_len, rows at different positions with T > 1,
 * T * B > the model's max_tokens, bad ids. On error the cache is left unusable
 * (reset it). Batch independence: in a call of at most 64 tokens (B * T), each row's
 * logits and cache are bit for bit those it gets in a call of its own, on any thread
 * count (the GEMMs are row-wise, ops/cpu/gemm_rowwise.h, the LM head at any B; every
 * other op is per row); the serving engine relies on it to batch and split decode rows. */
lm_status lm_model_infer(lm_model *m, lm_model_cache *c, const int32_t *ids, int T,
                         int last_only, float *logits, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
