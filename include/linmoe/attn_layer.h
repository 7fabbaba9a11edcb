/* linmoe full-attention layer: the grouped-query softmax attention token mixer of the
 * hybrid model (Kimi Linear's MLA layers replaced by GQA, issue 4 item 2), forward
 * and hand-written backward on the CPU in fp32 (training), and the inference path
 * (prefill and decode over a KV cache).
 *
 * Math. With x [N, d] (N = B*T tokens), Cq = Hq*Dh, Ckv = Hkv*Dh, every projection a
 * torch Linear without bias (y = x W^T, W [out, in]):
 *   q = x Wq^T [N, Cq],  k = x Wk^T [N, Ckv],  v = x Wv^T [N, Ckv]
 *   o = attention(q, k, v)                                            [N, Cq]
 *       attention.h: causal, GQA (query head h uses kv head h / (Hq/Hkv)), scale
 *       Dh^-0.5, RoPE (half-split, rope_theta) or NoPE applied inside the op,
 *       positions restarting at 0 in each document of a packed batch
 *   out = o Wo^T                                                      [N, d]
 * No q/k norm, no bias, no output gate (Hugging Face LlamaAttention without bias).
 *
 * Backward (of sum(out * dout)): dO = dout Wo, dWo = dout^T O; the op's backward
 * (lm_attention_backward, FlashAttention-2 with the saved lse) gives dq, dk, dv; then
 *   dWq = dq^T x,  dWk = dk^T x,  dWv = dv^T x,  dx = dq Wq + dk Wk + dv Wv.
 *
 * Layouts (row-major fp32, contiguous; Hugging Face parameter names):
 *   x, out, dout, dx   [B, T, d]   (B == 1 with cu_seqlens: packed documents)
 *   q_proj [Cq, d],  k_proj [Ckv, d],  v_proj [Ckv, d],  o_proj [d, Cq]
 * Gradients have the shapes of their weights and are overwritten (never
 * accumulated into).
 *
 * Context: the saved activations (q, k, v, o, lse) and the backward's scratch (dO,
 * dq, dk, dv) live in an lm_attn_layer_ctx, sized to the largest B*T seen and kept,
 * with the attention op's workspace: after the first call of a given size neither
 * forward nor backward allocates. The backward uses the activations of the last
 * forward on the same context; it checks that the dims and cu_seqlens pointer match
 * and that a forward happened.
 *
 * Determinism: every projection runs single-threaded BLAS on fixed blocks of 64
 * output rows (the partition depends on the shape only) in an OpenMP loop, and the
 * attention op is bitwise thread-count independent (attention.h), so outputs and
 * gradients are bitwise identical for any thread count.
 *
 * Errors: LM_ERR_INVALID (message names the field and value) for bad dims (Hq not a
 * multiple of Hkv, odd Dh with RoPE, Dh > 1024), a bad position or rope_theta, a
 * missing weight, gradient or tensor, non-finite x, weights or dout, bad cu_seqlens
 * (via the op), a backward without a matching forward; LM_ERR_NOMEM never
 * (allocation failure aborts). On error `out` / `dx` / the gradients are left
 * untouched when the error is found by validation (before any math).
 *
 * Inference (lm_attn_layer_infer): the same math over B rows that continue from a
 * caller-owned KV cache holding the (RoPE-rotated) keys and the values of the
 * positions seen so far (attention.h's lm_attention_cache_write / _decode). Running
 * a sequence in pieces (a prefill, more prefill, then one token per call) gives the
 * outputs of one lm_attn_layer_forward over the whole sequence, to fp32 rounding.
 *
 * What this module does not do: sliding windows, attention bias, partial rotary, bf16,
 * CUDA, the residual and pre-norm around the layer (src/model/), parameter or cache
 * ownership, packed documents or per-row positions at inference.
 */
#ifndef LINMOE_ATTN_LAYER_H
#define LINMOE_ATTN_LAYER_H

#include "linmoe/attention.h"
#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int d;                     /* hidden_size */
    int Hq;                    /* num_attention_heads */
    int Hkv;                   /* num_key_value_heads (divides Hq) */
    int Dh;                    /* head_dim (even with RoPE) */
    lm_attn_position position; /* LM_POS_ROPE or LM_POS_NOPE */
    double rope_theta;         /* RoPE base (ROPE only), finite and > 0 */
} lm_attn_layer_config;

/* Defaults: RoPE, rope_theta = 10000. */
void lm_attn_layer_config_default(lm_attn_layer_config *c, int d, int Hq, int Hkv, int Dh);

typedef struct {
    const float *q_proj, *k_proj, *v_proj, *o_proj;
} lm_attn_layer_weights;

typedef struct {
    float *q_proj, *k_proj, *v_proj, *o_proj;
} lm_attn_layer_grads;

typedef struct lm_attn_layer_ctx lm_attn_layer_ctx;
lm_attn_layer_ctx *lm_attn_layer_ctx_new(void);
void lm_attn_layer_ctx_free(lm_attn_layer_ctx *ctx);

/* The token batch: B sequences of T tokens, or B == 1 and cu_seqlens [n_cu_seqlens]
 * int64 document offsets (0 = c_0 <= ... <= c_N = T). */
typedef struct {
    int B, T;
    const int64_t *cu_seqlens;
    int n_cu_seqlens;
} lm_attn_layer_batch;

/* Forward: out [B*T, d] = layer(x [B*T, d]); saves the activations in ctx. */
lm_status lm_attn_layer_forward(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                                const lm_attn_layer_weights *w, const float *x, float *out,
                                lm_attn_layer_ctx *ctx, lm_error *err);

/* Backward of sum(out * dout) after lm_attn_layer_forward on the same ctx, config,
 * batch, weights and x: dx [B*T, d] (may be NULL) and every weight gradient (all
 * required in g). */
lm_status lm_attn_layer_backward(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                                 const lm_attn_layer_weights *w, const float *x, const float *dout,
                                 float *dx, const lm_attn_layer_grads *g, lm_attn_layer_ctx *ctx,
                                 lm_error *err);

/* KV cache of one attention layer for B rows: caller-owned fp32, contiguous. Only
 * positions 0 .. pos-1 (those written by earlier calls) are read; nothing needs
 * clearing at the start of a sequence. Per layer 2 * B * Tmax * Hkv * Dh floats. */
typedef struct {
    float *k_cache, *v_cache; /* [B, Tmax, Hkv, Dh]; keys stored RoPE-rotated by their
                                 position (lm_attention_cache_write), values as is */
    int64_t Tmax;             /* positions the cache holds, >= 1 */
    const int64_t *pos_rows;  /* NULL, or [B]: each row's own position for a decode step
                                 (T = 1; the call's pos is then not read): rows of one
                                 batch at different positions (serving) */
} lm_attn_layer_cache;

/* Inference (prefill and decode, no backward): out = layer(x) for T >= 1 new tokens of
 * each of B rows at positions pos .. pos+T-1 (the same pos for every row; positions
 * 0 .. pos-1 are already in kv), or, with kv->pos_rows and T = 1, one token per row at
 * that row's own position. The layer does not advance positions; the caller does.
 *   x, out  [B, T, d] fp32 (out must not alias x)
 *   kv      the cache; positions pos .. pos+T-1 are written, the others untouched
 *   ctx     scratch only (the same grow-only buffers as the forward)
 * pos == 0: the T keys/values are written to the cache and the causal forward over
 * the T tokens (lm_attention_forward, lse NULL) gives o. pos > 0: the T keys/values
 * are written, then each new token t attends over positions 0 .. pos+t by one
 * lm_attention_decode step (T steps for T > 1: a chunk of prefill continuing a cache
 * costs T cache reads, fine for the short continuations it is used for).
 * Outputs equal those of lm_attn_layer_forward over the whole sequence (fp32 rounding,
 * rel RMS <= 1e-5, tests/test_attn_layer.c). Bitwise identical for any thread count.
 * The context's buffers grow only on a larger B*T than seen before; the decode op's
 * own scratch (attention.c) grows with pos, outside this layer's control.
 * The call overwrites the activations a forward saved in ctx, so a backward after it
 * needs a new lm_attn_layer_forward first (it returns LM_ERR_INVALID otherwise); a
 * forward/backward pair after it is unaffected.
 * Not scanned for finiteness, unlike in the forward: the weights (a decode step would
 * read them twice; check them once after loading, the forward does) and the cache
 * (its writer checked what it stored, attention.h).
 * Errors: LM_ERR_INVALID (message names the field and value) for bad dims (B, T < 1,
 * the config checks of the forward), pos < 0, pos + T > kv->Tmax, kv->Tmax < 1, a
 * missing weight, out, ctx, kv or cache tensor, non-finite x; out and kv are then
 * untouched. An op error after the math began (only with non-finite weights) can
 * leave positions pos .. pos+T-1 of the cache written. */
lm_status lm_attn_layer_infer(const lm_attn_layer_config *c, int B, int T, int64_t pos,
                              const lm_attn_layer_weights *w, const float *x, float *out,
                              lm_attn_layer_cache *kv, lm_attn_layer_ctx *ctx, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
