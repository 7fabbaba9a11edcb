/* linmoe export: write a linmoe checkpoint (params.h: config.json + model.safetensors)
 * in the format of fla's KDAConfig / KDAForCausalLM (flash-linear-attention at
 * bc3b101: fla/models/kda/configuration_kda.py, modeling_kda.py, fla/layers/kda.py,
 * fla/layers/attn.py, fla/models/hybrid.py), so that
 * `KDAForCausalLM.from_pretrained(DIR)` loads it and computes the same function.
 *
 * What fla's model computes, read from its source, against linmoe's (model.h):
 *   - pre-norm blocks: h += attn(attn_norm(h)); h += mlp(mlp_norm(h)); logits =
 *     lm_head(norm(h)), RMSNorm x * rstd * w with eps = config.norm_eps: linmoe's
 *     standard residual with rms_norm_eps.
 *   - KimiDeltaAttention: q/k/v projections, ShortConvolution (depthwise causal,
 *     nn.Conv1d weight [C, 1, W], SiLU), f_proj = Linear(d, Dh) then Linear(Dh, C),
 *     b_proj, chunk_kda with use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
 *     use_gate_in_kernel, scale Dh^-0.5 and the gate
 *       safe_gate = true, lower_bound = lb:  g = lb * sigmoid(exp(A_log) * (f + dt_bias))
 *       safe_gate = false, lower_bound = null: g = -exp(A_log) * softplus(f + dt_bias)
 *     (fla/ops/kda/gate.py: the same two formulas as kda_layer.h's BOUNDED and
 *     SOFTPLUS, A_log [H] and dt_bias [H*Dh] used identically, so both are copied
 *     unchanged), then FusedRMSNormGated(o, g_proj(x)) with activation sigmoid and eps
 *     = config.norm_eps, where g_proj = Linear(d, Dh) then Linear(Dh, C, bias=True),
 *     and o_proj. linmoe's g_b_proj has no bias: the export writes zeros.
 *   - Attention (the layers listed in config.attn.layers): q/k/v/o projections without
 *     bias, head_dim = hidden_size / num_heads, GQA with num_kv_heads, RoPE on every
 *     such layer (fla/modules/rotary.py, non-interleaved = linmoe's half-split
 *     convention, base rope_theta), causal softmax with scale head_dim^-0.5.
 *   - GatedMLP with hidden_act "swish": down(silu(gate(x)) * up(x)), linmoe's SwiGLU.
 *
 * What cannot be represented, refused with LM_ERR_UNSUPPORTED and a message naming
 * the config field and its value (lm_export_fla_check):
 *   - any MoE layer (first_k_dense_replace < num_hidden_layers): fla's KDA model has a
 *     dense GatedMLP in every layer;
 *   - residual block_attnres / full_attnres: fla bc3b101 has an attnres_block_size
 *     option whose aggregation reads like linmoe's (attnres.h), but its fused kernel
 *     does not compile on the GPU machine (issue 22), so an export could not be
 *     checked against fla there; refused until it can;
 *   - KDA layers with different gates (fla has one safe_gate / lower_bound for all);
 *   - a KDA head_dim above 256 (chunk_kda's limit);
 *   - attention layers with position "nope" (fla applies RoPE in every attention
 *     layer), or num_attention_heads * head_dim != hidden_size (fla derives the head
 *     dim as hidden_size / num_heads);
 *   - with KDA layers, rms_norm_eps != 1e-5: fla's KDA output norm takes the model's
 *     one norm_eps, linmoe's takes LM_GATED_RMSNORM_EPS = 1e-5 (layers.h). Exported
 *     anyway with `allow_eps_mismatch` (norm_eps = rms_norm_eps: the block norms stay
 *     exact, the KDA output norm then runs at that eps instead of 1e-5).
 *
 * Tensor map (layer i 0-based in both; C = H*Dh; every shape is kept except the
 * short-conv weights, whose singleton dim is restored; the bytes are the same):
 *   model.embed_tokens.weight [V,d]                  model.embeddings.weight [V,d]
 *   model.layers.i.input_layernorm.weight [d]        model.layers.i.attn_norm.weight
 *   model.layers.i.post_attention_layernorm.weight   model.layers.i.mlp_norm.weight
 *   KDA layer, prefix model.layers.i.self_attn. ->   model.layers.i.attn.
 *     {q,k,v}_proj.weight [C,d]                        {q,k,v}_proj.weight [C,d]
 *     {q,k,v}_conv1d.weight [C,W]                      {q,k,v}_conv1d.weight [C,1,W]
 *     f_a_proj.weight [Dh,d], f_b_proj.weight [C,Dh]   f_proj.0.weight, f_proj.1.weight
 *     b_proj.weight [H,d], A_log [H], dt_bias [C]      b_proj.weight, A_log, dt_bias
 *     g_a_proj.weight [Dh,d], g_b_proj.weight [C,Dh]   g_proj.0.weight, g_proj.1.weight
 *     (none)                                           g_proj.1.bias [C] zeros
 *     o_norm.weight [Dh], o_proj.weight [d,C]          o_norm.weight, o_proj.weight
 *   attention layer: self_attn.{q,k,v,o}_proj.weight  attn.{q,k,v,o}_proj.weight
 *   model.layers.i.mlp.{gate,up,down}_proj.weight     the same names
 *   model.norm.weight [d]                            model.norm.weight
 *   lm_head.weight [V,d] (absent when tied)          lm_head.weight (absent when tied)
 *
 * config.json (KDAConfig keys): architectures ["KDAForCausalLM"], model_type "kda",
 * attn_mode "chunk", hidden_size, num_hidden_layers, num_heads, head_dim, num_v_heads
 * null, expand_v 1, use_short_conv true, conv_size, allow_neg_eigval false,
 * safe_gate / lower_bound (above), intermediate_size, hidden_ratio 4 (unused when
 * intermediate_size is given), hidden_act "swish", norm_eps, attn (null without
 * attention layers, else {"layers": [0-based indices], "num_heads", "num_kv_heads",
 * "qkv_bias": false, "window_size": null, "rope_theta"}), max_position_embeddings
 * (seq_len, else 2048: fla sizes its RoPE cache with it, no effect on the math),
 * vocab_size, tie_word_embeddings, initializer_range, attnres_block_size null,
 * fuse_norm / fuse_swiglu / fuse_cross_entropy true, use_l2warp false, use_cache true,
 * torch_dtype, and the token ids of the tokenizer `linmoe eval` picks for the vocab
 * (vocab 257: byte, <|endoftext|> = 256; vocab >= 50257: GPT-2, 50256; else null) as
 * bos_token_id and eos_token_id, pad_token_id null.
 *
 * Output directory: written to "OUT.tmp.<pid>" first (each file fsynced), then
 * renamed to OUT. An existing OUT that is not an empty directory is refused
 * (LM_ERR_INVALID) unless `force`; with force it is renamed aside, replaced, and its
 * config.json and model.safetensors removed (other files stay in the renamed-aside
 * copy, which is then left in place and named in stderr). A failure at any point
 * leaves OUT as it was.
 *
 * What this module does not do: the reverse direction (fla -> linmoe), tokenizer
 * files, sharded safetensors (one file, as lm_params_save writes), the math.
 */
#ifndef LINMOE_EXPORT_H
#define LINMOE_EXPORT_H

#include "linmoe/params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    lm_dtype dtype;         /* LM_F32 (default) or LM_BF16 (round to nearest even) */
    int force;              /* 1: replace an existing non-empty output directory */
    int allow_eps_mismatch; /* 1: export rms_norm_eps != 1e-5 with KDA layers anyway */
} lm_export_fla_options;

/* F32, no force, no eps mismatch. */
void lm_export_fla_options_default(lm_export_fla_options *o);

/* Can fla's KDAForCausalLM represent `c` exactly (with the options' tolerance)?
 * LM_OK, or LM_ERR_UNSUPPORTED with a message naming the field and value (list at
 * the top), or the errors of lm_model_config_validate. o may be NULL (defaults). */
lm_status lm_export_fla_check(const lm_model_config *c, const lm_export_fla_options *o,
                              lm_error *err);

/* config.json of the export (see above) as a new JSON string (malloc'd, caller
 * frees). Runs lm_export_fla_check first; LM_ERR_NOMEM when the JSON cannot be
 * built. On error *json is NULL. */
lm_status lm_export_fla_config_json(const lm_model_config *c, const lm_export_fla_options *o,
                                    char **json, lm_error *err);

/* One tensor of the export: its fla name and shape, and the linmoe tensor it is
 * copied from ("" for a tensor fla has and linmoe lacks, written as zeros). */
typedef struct {
    char name[LM_PARAM_NAME_MAX];
    char src[LM_PARAM_NAME_MAX];
    int ndim; /* 1..3 */
    int64_t shape[3];
    int64_t numel;
} lm_export_fla_tensor;

/* The tensor list of p's export in file order (the map above), malloc'd into *out
 * (caller frees), *n entries. Checks p's config (lm_export_fla_check with `o`),
 * that every tensor the map names exists in p with the shape the map expects, and
 * that every tensor of p is mapped (LM_ERR_UNSUPPORTED naming the tensor
 * otherwise). */
lm_status lm_export_fla_plan(const lm_params *p, const lm_export_fla_options *o,
                             lm_export_fla_tensor **out, int *n, lm_error *err);

/* Write p as an fla checkpoint directory `out_dir` (config.json +
 * model.safetensors, __metadata__ {"format": "pt"}), atomically as described above.
 * Errors: those of lm_export_fla_plan; LM_ERR_INVALID for a bad dtype or out_dir
 * (empty, an existing file, a non-empty directory without force); LM_ERR_IO for
 * file-system failures (named); LM_ERR_NOMEM. */
lm_status lm_export_fla_save(const lm_params *p, const char *out_dir,
                             const lm_export_fla_options *o, lm_error *err);

/* lm_params_load(ckpt_dir) then lm_export_fla_save. out_dir must not be ckpt_dir
 * (LM_ERR_INVALID). */
lm_status lm_export_fla(const char *ckpt_dir, const char *out_dir, const lm_export_fla_options *o,
                        lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
