/* linmoe model parameters: one fp32 buffer carved into named tensors by a size
 * table computed from the config (model_config.h), seeded initialisation, the
 * parameter counts, and checkpoints (model.safetensors + config.json in a
 * directory).
 *
 * Names are the Hugging Face / fla ones (d = hidden_size, V = vocab_size, H/Dh =
 * linear_attn_config num_heads/head_dim, Hq/Hkv/D = attention heads/head_dim,
 * W = short_conv_kernel_size, I = intermediate_size, E/k/f/ns = num_experts,
 * num_experts_per_tok, moe_intermediate_size, n_shared_experts; torch Linear
 * layout [out, in], row-major, contiguous):
 *   model.embed_tokens.weight [V, d]
 *   model.layers.i.input_layernorm.weight [d], post_attention_layernorm.weight [d]
 *   KDA layer i (fla KimiDeltaAttention):
 *     self_attn.{q,k,v}_proj.weight [H*Dh, d]
 *     self_attn.{q,k,v}_conv1d.weight [H*Dh, W]  (fla ShortConvolution / nn.Conv1d
 *         weight [C, 1, W] without the singleton; weight[c, W-1] hits the current token)
 *     self_attn.f_a_proj.weight [Dh, d], f_b_proj.weight [H*Dh, Dh]
 *     self_attn.A_log [H], self_attn.dt_bias [H*Dh], self_attn.b_proj.weight [H, d]
 *     self_attn.g_a_proj.weight [Dh, d], g_b_proj.weight [H*Dh, Dh]
 *     self_attn.o_norm.weight [Dh], self_attn.o_proj.weight [d, H*Dh]
 *   attention layer i: self_attn.q_proj.weight [Hq*D, d], k_proj/v_proj.weight
 *     [Hkv*D, d], o_proj.weight [d, Hq*D]
 *   dense FFN (i < first_k_dense_replace): mlp.{gate,up}_proj.weight [I, d],
 *     mlp.down_proj.weight [d, I]
 *   MoE FFN: mlp.gate.weight [E, d], mlp.experts.{gate,up}_proj [E, f, d],
 *     mlp.experts.down_proj [E, d, f], mlp.shared_experts.{gate,up}_proj [ns*f, d],
 *     mlp.shared_experts.down_proj [d, ns*f] (moe.h names, prefixed "mlp.");
 *     buffer mlp.gate.e_score_correction_bias [E]
 *   AttnRes (residual != standard), per layer: attn_res.query [d],
 *     attn_res.norm.weight [d], mlp_res.query [d], mlp_res.norm.weight [d];
 *     model.attnres_final.query [d], model.attnres_final.norm.weight [d]
 *   model.norm.weight [d];  lm_head.weight [V, d] unless tie_word_embeddings.
 *
 * Initialisation (lm_params_init_weights, deterministic per seed; each tensor
 * draws from its own Philox stream keyed by the seed and a hash of its name, so
 * a tensor's values do not depend on the others):
 *   matrices (projections, embeddings, experts, router)  normal(0, initializer_range)
 *   norm weights 1; AttnRes queries 0 (uniform mix) and their norm weights 1
 *   short conv weights  U(-1/sqrt(W), 1/sqrt(W)): PyTorch's nn.Conv1d default
 *     (kaiming_uniform, a = sqrt(5)) with fan_in = W for a depthwise conv, i.e.
 *     what fla's ShortConvolution starts from
 *   A_log  0 for the bounded gate (unused by it); log U(1, 16) for softplus (fla KDA)
 *   dt_bias  softplus^-1(dt), dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4
 *     (Mamba / fla: dt + log(-expm1(-dt)))
 *   e_score_correction_bias 0
 * Weight decay (decay flag): the matrices and the short conv weights; none on
 * norms, biases (dt_bias), AttnRes vectors, A_log and buffers.
 *
 * Expert-sharded tables (lm_params_init_ep, expert parallelism, docs/distributed.md):
 * rank p of an EP group of P holds only the routed experts [p E/P, (p+1) E/P) of
 * every MoE layer: mlp.experts.* have shape [E/P, f, d] / [E/P, d, f] (local expert
 * l is global expert p E/P + l). Every other tensor is whole. The routed tensors
 * are moved to the end of the table (table order = offset order), so the buffer is
 * [replicated region | expert region) split at `expert_off`: the same table and
 * offsets on every rank of the group, the values of the expert region the rank's
 * own. Such a table is never saved as is (lm_params_save refuses it): the trainer
 * converts to the single-rank layout (lm_params_shard_to_full).
 *
 * What this module does not do: gradients / optimizer state (same table, other
 * buffers), the forward.
 */
#ifndef LINMOE_PARAMS_H
#define LINMOE_PARAMS_H

#include "linmoe/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    LM_INIT_NORMAL = 0, /* normal(0, initializer_range) */
    LM_INIT_ONES,
    LM_INIT_ZEROS,
    LM_INIT_CONV,  /* U(-1/sqrt(W), 1/sqrt(W)) */
    LM_INIT_A_LOG, /* 0 (bounded) | log U(1, 16) (softplus) */
    LM_INIT_DT_BIAS
} lm_param_init;

#define LM_PARAM_NAME_MAX 96

typedef struct {
    char name[LM_PARAM_NAME_MAX];
    int ndim; /* 1..3 */
    int64_t shape[3];
    int64_t numel;
    int64_t offset; /* elements from the start of the buffer (64-byte aligned) */
    int layer;      /* 0-based layer, -1 for model-level tensors */
    lm_param_init init;
    lm_gate_mode gate; /* for LM_INIT_A_LOG */
    uint8_t decay;     /* 1: weight decay applies */
    uint8_t buffer;    /* 1: a buffer (checkpointed, not trained, not counted) */
    uint8_t routed;    /* 1: routed-expert weight (active fraction k/E) */
} lm_param_info;

typedef struct {
    lm_model_config cfg;
    int n;            /* tensors */
    lm_param_info *t; /* [n], in checkpoint order */
    float *data;      /* one allocation of `numel` floats (padding zero) */
    int64_t numel;    /* buffer size in floats, padding included */
    /* expert sharding (lm_params_init_ep): this table holds the experts of EP rank
     * ep_rank of ep_size (1: all experts, the single-rank layout); the routed tensors
     * occupy [expert_off, numel) (expert_off = numel without MoE layers or when
     * ep_size is 1) */
    int ep_rank, ep_size;
    int64_t expert_off;
} lm_params;

/* Validate cfg, build the table and allocate the buffer (zeroed). Errors: those of
 * lm_model_config_validate; LM_ERR_NOMEM. `p` is safe to lm_params_free after
 * any return. */
lm_status lm_params_init(lm_params *p, const lm_model_config *cfg, lm_error *err);
/* The expert-sharded table of EP rank ep_rank of ep_size (layout in the top
 * comment; ep_size 1 is lm_params_init). Errors: those of lm_params_init;
 * LM_ERR_INVALID when ep_size < 1, ep_rank outside [0, ep_size) or ep_size does
 * not divide num_experts of a config with MoE layers (names the values). */
lm_status lm_params_init_ep(lm_params *p, const lm_model_config *cfg, int ep_rank, int ep_size,
                            lm_error *err);
void lm_params_free(lm_params *p);
/* Copy a buffer in the single-rank layout `full` (params, gradients or AdamW moments:
 * full->numel floats at src) into the layout of the sharded table `sp` (dst,
 * sp->numel floats): every tensor whole, the routed ones at rows [e0, e0 + E/P) of
 * the full tensors with e0 = ep_rank E/P. Both tables from the same config. */
void lm_params_full_to_shard(const lm_params *full, const float *src, const lm_params *sp,
                             int ep_rank, float *dst);
/* The reverse: the buffer `src` of EP rank ep_rank in the layout of sp written into
 * dst in the layout of full: its routed rows always, the replicated tensors when
 * `replicated` is 1 (once, from any rank: they are equal). */
void lm_params_shard_to_full(const lm_params *sp, const float *src, int ep_rank, int replicated,
                             const lm_params *full, float *dst);
/* Initialise every tensor as described above from `seed`. A sharded table gets
 * the values of its experts in the single-rank initialisation (the same bits). */
void lm_params_init_weights(lm_params *p, uint64_t seed);
/* NULL when absent. */
const lm_param_info *lm_params_find(const lm_params *p, const char *name);
float *lm_params_get(const lm_params *p, const char *name);

/* Trainable parameters (buffers excluded): total, and active per token (routed
 * expert weights counted k/E of their size; shared experts, router, attention,
 * embeddings and everything else in full). Of the whole model also for a sharded
 * table (its routed tensors counted ep_size times). */
void lm_params_count(const lm_params *p, int64_t *total, int64_t *active);

/* Save p (parameters and buffers, F32) to DIR/model.safetensors and its config to
 * DIR/config.json. Both go to a fresh "DIR.tmp.<pid>" directory first (each file
 * fsynced); then an existing DIR is renamed aside, the temp dir renamed to DIR
 * and the old one removed: a failure at any point leaves the old checkpoint
 * intact. DIR must contain only these two files (others are kept in the
 * renamed-aside copy, which is then left in place). An expert-sharded table is
 * LM_ERR_INVALID. */
lm_status lm_params_save(const lm_params *p, const char *dir, lm_error *err);

/* Load DIR/config.json and DIR/model.safetensors into a new `p` (lm_params_init
 * then copy). Errors name the file and the tensor: a missing tensor, a wrong
 * shape, a dtype other than F32, an unexpected extra tensor, and every
 * config / safetensors format error (truncated files included). On error p is
 * left empty. */
lm_status lm_params_load(lm_params *p, const char *dir, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
