/* linmoe model configuration: the Hugging Face style config.json of a hybrid
 * linear-attention MoE model (Kimi-Linear naming where it exists: the
 * `linear_attn_config` object with 1-based `kda_layers` / `full_attn_layers`;
 * DeepSeek-V3 / HF names for the MoE and attention fields), parsed with cJSON,
 * validated, and written back (round trip).
 *
 * Layers are 0-based inside linmoe (kinds[i], model.layers.i.*); the JSON lists
 * kda_layers / full_attn_layers are 1-based as in Kimi-Linear's config, and so is
 * every layer number a user sees (messages, logs, `linmoe info`, eval reports, plots:
 * i + 1). Tensor names keep the 0-based index of Hugging Face's.
 * Sublayers: layer i has sublayer 2i (token mixer) and 2i+1 (FFN);
 * attnres_block_size counts sublayers (reference/attnres_ctx.md §1.3).
 * The FFN of layer i is dense SwiGLU (intermediate_size) when
 * i < first_k_dense_replace, else MoE (moe.h).
 *
 * Errors (LM_ERR_INVALID, or LM_ERR_IO / LM_ERR_FORMAT for the file) name the
 * source (file path or label), the key and the value. Unknown keys are not an
 * error: one warning listing them goes to stderr (or to the caller's buffer).
 *
 * What this module does not do: parameters (params.h), the layers, training
 * settings other than the two bench keys seq_len / batch_size it carries along.
 */
#ifndef LINMOE_MODEL_CONFIG_H
#define LINMOE_MODEL_CONFIG_H

#include "linmoe/attention.h"
#include "linmoe/core.h"
#include "linmoe/kda.h"
#include "linmoe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_MAX_LAYERS 512

typedef enum { LM_LAYER_KDA = 0, LM_LAYER_ATTN = 1 } lm_layer_kind;
typedef enum {
    LM_RES_STANDARD = 0,      /* pre-norm x + f(norm(x)) */
    LM_RES_BLOCK_ATTNRES = 1, /* Block AttnRes, blocks of attnres_block_size sublayers */
    LM_RES_FULL_ATTNRES = 2   /* AttnRes over every sublayer (block size 1) */
} lm_residual_mode;

typedef struct {
    int vocab_size;                     /* V */
    int hidden_size;                    /* d */
    int num_hidden_layers;              /* L <= LM_MAX_LAYERS */
    lm_layer_kind kinds[LM_MAX_LAYERS]; /* from kda_layers / full_attn_layers */

    /* linear_attn_config (KDA layers) */
    int kda_num_heads;                /* H */
    int kda_head_dim;                 /* Dh (K = V = Dh) */
    int short_conv_kernel_size;       /* W, default 4 */
    lm_gate_mode gate[LM_MAX_LAYERS]; /* per layer (BOUNDED or SOFTPLUS; KDA layers only) */
    int gate_per_layer;               /* 1 when the JSON gave a list (written back as a list) */
    float lower_bound;                /* bounded gate, in [-5, 0), default -5 */
    int chunk_size;                   /* 16 | 32 | 64, default 64 */

    /* full attention layers */
    int num_attention_heads;                  /* Hq */
    int num_key_value_heads;                  /* Hkv, divides Hq */
    int head_dim;                             /* D */
    lm_attn_position position[LM_MAX_LAYERS]; /* per layer (attention layers only) */
    int position_per_layer;
    float rope_theta; /* default 10000 */

    /* FFN */
    int first_k_dense_replace; /* layers [0, this) are dense, default 0 */
    int intermediate_size;     /* dense SwiGLU width (required when first_k_dense_replace > 0) */
    lm_moe_config moe;         /* hidden_size, moe_intermediate_size, n_shared_experts, router */

    /* residual */
    lm_residual_mode residual;
    int attnres_block_size; /* sublayers per block (BLOCK_ATTNRES); 1 for FULL */

    float rms_norm_eps;      /* default 1e-6 */
    int tie_word_embeddings; /* default 0 */
    float initializer_range; /* default 0.02 */
    uint64_t seed;           /* init seed, default 0 */

    int seq_len, batch_size; /* optional (0 = absent), carried for the benchmarks */
} lm_model_config;

/* Fills the defaults named above; required keys are left 0 (invalid). */
void lm_model_config_default(lm_model_config *c);

/* Parse from a JSON string (`label` names it in messages) / a file. The result is
 * validated (lm_model_config_validate). Unknown keys: when `warn` is non-NULL a
 * message "LABEL: unknown keys ignored: a, b" is written there (empty when none,
 * size warn_size); when NULL it goes to stderr. Required: vocab_size,
 * hidden_size, num_hidden_layers, linear_attn_config.kda_layers (may be []),
 * num_experts / n_routed_experts, num_experts_per_tok, moe_intermediate_size
 * when any layer is MoE; the head fields of each layer kind present. */
lm_status lm_model_config_from_string(lm_model_config *c, const char *json, const char *label,
                                      char *warn, size_t warn_size, lm_error *err);
lm_status lm_model_config_load(lm_model_config *c, const char *path, char *warn, size_t warn_size,
                               lm_error *err);

/* Errors name the key and value: sizes < 1, a layer in both or neither of
 * kda_layers / full_attn_layers, indices out of [1, L], heads * head_dim beyond
 * int range, num_key_value_heads not dividing num_attention_heads, odd head_dim
 * with rope, kernel size < 1, chunk_size not 16/32/64, lower_bound outside
 * [-5, 0), first_k_dense_replace outside [0, L], attnres_block_size < 1,
 * non-positive eps / initializer_range, and every MoE / router error. */
lm_status lm_model_config_validate(const lm_model_config *c, lm_error *err);

/* The config as a new JSON string (malloc'd, caller frees), all keys written,
 * parsing back to an equal config. NULL on allocation failure. */
char *lm_model_config_to_json(const lm_model_config *c);
/* Write to `path` atomically (temp name, fsync, rename). */
lm_status lm_model_config_save(const lm_model_config *c, const char *path, lm_error *err);

/* Is layer i's FFN MoE?  1 / 0. */
int lm_model_layer_is_moe(const lm_model_config *c, int i);
/* Counts of layers of each kind. */
int lm_model_count_kind(const lm_model_config *c, lm_layer_kind k);
/* Print a human summary (several lines) to f. */
void lm_model_config_print(const lm_model_config *c, FILE *f);

#ifdef __cplusplus
}
#endif
#endif
