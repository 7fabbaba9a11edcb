/* linmoe KDA layer: the Kimi Linear token mixer around the KDA op, forward and
 * hand-written backward on the CPU in fp32 (training), and the inference path
 * (prefill and decode with conv and recurrent states).
 *
 * Math (reference/kda.md §7; Kimi Linear tech report arXiv 2510.26692 §4, Eq. 10,
 * Fig. 3; fla `fla/layers/kda.py` KimiDeltaAttention; vLLM `layers/kda.py`). With
 * x [N, d] (N = B*T tokens), C = H*Dh, every projection a torch Linear without bias
 * (y = x W^T, W [out, in]):
 *   pq = x Wq^T,  pk = x Wk^T,  pv = x Wv^T                          [N, C]
 *   q  = SiLU(ShortConv(pq; q_conv1d)),  k = ..., v = ...            [N, C]
 *        (depthwise causal, kernel W, no bias; each document restarts: layers.h)
 *   fa = x Wfa^T [N, Dh];  g_raw = fa Wfb^T [N, C]
 *   beta_raw = x Wb^T                                                 [N, H]
 *   o  = KDA(q, k, v, g_raw, beta_raw; A_log, dt_bias)               [N, C]
 *        kda.h with HV = H, K = V = Dh, use_qk_l2norm_in_kernel = 1, scale Dh^-0.5,
 *        use_beta_sigmoid_in_kernel = 1, and the gate applied in the op:
 *          BOUNDED   g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))
 *          SOFTPLUS  g = -exp(A_log[h]) * softplus(g_raw + dt_bias)
 *   ga = x Wga^T [N, Dh];  gate = ga Wgb^T [N, C]
 *   y  = GatedRMSNorm_head(o; o_norm, gate) = o * rstd * o_norm * sigmoid(gate)
 *        per (token, head), eps LM_GATED_RMSNORM_EPS (1e-5)
 *   out = y Wo^T                                                      [N, d]
 * fla's g_b_proj carries a bias; vLLM's (and this layer's) does not.
 *
 * Backward (of sum(out * dout)) is the chain rule through the above, each op by its
 * own backward (lm_gated_rmsnorm_backward, lm_kda_chunk_backward,
 * lm_short_conv_backward), the projections by
 *   dW = dY^T X (sum over the N tokens),  dX += dY W.
 *
 * Layouts (row-major fp32, contiguous; names are fla's parameter names):
 *   x, out, dout, dx   [B, T, d]   (B == 1 with cu_seqlens: packed documents)
 *   q_proj, k_proj, v_proj          [C, d]
 *   q_conv1d, k_conv1d, v_conv1d    [C, W]   (nn.Conv1d weight [C,1,W] squeezed)
 *   f_a_proj [Dh, d],  f_b_proj [C, Dh]
 *   A_log [H],  dt_bias [C]
 *   b_proj [H, d]
 *   g_a_proj [Dh, d],  g_b_proj [C, Dh]
 *   o_norm [Dh]
 *   o_proj [d, C]
 * Gradients have the shapes of their weights and are overwritten (never
 * accumulated into).
 *
 * Context: the saved activations (pq/pk/pv, q/k/v, fa, g_raw, beta_raw, o, ga, gate,
 * rstd, y) and the backward's scratch live in an lm_kda_layer_ctx, sized to the
 * largest B*T seen and kept, with the KDA op's workspace: after the first call of a
 * given size neither forward nor backward allocates. The backward uses the
 * activations of the last forward on the same context; it checks that the dims and
 * cu_seqlens pointer match and that a forward happened.
 *
 * Determinism: every projection runs single-threaded BLAS on fixed blocks of 64
 * output rows (the partition depends on the shape only) in an OpenMP loop, and the
 * ops below are bitwise thread-count independent (layers.h, kda.h), so outputs and
 * gradients are bitwise identical for any thread count.
 *
 * Errors: LM_ERR_INVALID (message names the field and value) for bad dims, a
 * missing weight, gradient or tensor, non-finite x or weights, bad cu_seqlens
 * (via the ops), lower_bound outside [-5, 0) with BOUNDED, a backward without a
 * matching forward; LM_ERR_NOMEM never (allocation failure aborts). On error `out`
 * / `dx` / the gradients are left untouched when the error is found by validation
 * (before any math).
 *
 * Inference (lm_kda_layer_infer): the same math over B sequences that continue
 * from a caller-owned lm_kda_layer_state: the three short-conv states (the last
 * W-1 conv inputs per channel, layers.h) and the recurrent KDA state S (kda.h).
 * Running a sequence in pieces (a prefill, more prefill, then one token per call)
 * gives the outputs of one lm_kda_layer_forward over the whole sequence, to fp32
 * rounding (the pieces take other op paths: chunked vs recurrent KDA).
 *
 * What this module does not do: bf16, CUDA, the residual and pre-norm around the
 * layer (src/model/), parameter or state ownership, packed documents at inference.
 */
#ifndef LINMOE_KDA_LAYER_H
#define LINMOE_KDA_LAYER_H

#include "linmoe/core.h"
#include "linmoe/kda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int d;              /* hidden_size */
    int H;              /* num_heads */
    int Dh;             /* head_dim (K = V) */
    int W;              /* short_conv_kernel_size (4), 1..LM_SHORT_CONV_MAX_W */
    lm_gate_mode gate;  /* LM_GATE_BOUNDED or LM_GATE_SOFTPLUS */
    float lower_bound;  /* BOUNDED only, in [-5, 0) */
    int chunk_size;     /* KDA chunk: 16, 32 or 64 */
} lm_kda_layer_config;

/* Defaults: W = 4, gate SOFTPLUS, lower_bound -5, chunk 64. */
void lm_kda_layer_config_default(lm_kda_layer_config *c, int d, int H, int Dh);

typedef struct {
    const float *q_proj, *k_proj, *v_proj;
    const float *q_conv1d, *k_conv1d, *v_conv1d;
    const float *f_a_proj, *f_b_proj;
    const float *A_log, *dt_bias;
    const float *b_proj;
    const float *g_a_proj, *g_b_proj;
    const float *o_norm;
    const float *o_proj;
} lm_kda_layer_weights;

typedef struct {
    float *q_proj, *k_proj, *v_proj;
    float *q_conv1d, *k_conv1d, *v_conv1d;
    float *f_a_proj, *f_b_proj;
    float *A_log, *dt_bias;
    float *b_proj;
    float *g_a_proj, *g_b_proj;
    float *o_norm;
    float *o_proj;
} lm_kda_layer_grads;

typedef struct lm_kda_layer_ctx lm_kda_layer_ctx;
lm_kda_layer_ctx *lm_kda_layer_ctx_new(void);
void lm_kda_layer_ctx_free(lm_kda_layer_ctx *ctx);

/* The token batch: B sequences of T tokens, or B == 1 and cu_seqlens [n_cu_seqlens]
 * int64 document offsets (0 = c_0 <= ... <= c_N = T). */
typedef struct {
    int B, T;
    const int64_t *cu_seqlens;
    int n_cu_seqlens;
} lm_kda_layer_batch;

/* Forward: out [B*T, d] = layer(x [B*T, d]); saves the activations in ctx. */
lm_status lm_kda_layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                               const lm_kda_layer_weights *w, const float *x, float *out,
                               lm_kda_layer_ctx *ctx, lm_error *err);

/* Backward of sum(out * dout) after lm_kda_layer_forward on the same ctx, config,
 * batch, weights and x: dx [B*T, d] (may be NULL) and every weight gradient (all
 * required in g). */
lm_status lm_kda_layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                                const lm_kda_layer_weights *w, const float *x, const float *dout,
                                float *dx, const lm_kda_layer_grads *g, lm_kda_layer_ctx *ctx,
                                lm_error *err);

/* Inference state of one KDA layer for B sequences: caller-owned fp32, contiguous,
 * all zeros at the start of a sequence (then only what lm_kda_layer_infer wrote).
 * C = H*Dh. Per layer this is B * (3*C*(W-1) + H*Dh*Dh) floats. */
typedef struct {
    float *conv_q, *conv_k, *conv_v; /* [B, C, W-1] short-conv states (layers.h layout:
                                        oldest input first); may be NULL when W == 1 */
    float *state;                    /* [B, H, Dh, Dh] recurrent KDA state S (kda.h
                                        [N, HV, K, V] with HV = H, K = V = Dh) */
} lm_kda_layer_state;

/* Inference (prefill and decode, no backward): out = layer(x) for T >= 1 new tokens
 * of each of B sequences, continuing from the state s and updating it in place.
 *   x, out  [B, T, d] fp32 (out must not alias x)
 *   s       see lm_kda_layer_state; on return it holds the state after the T tokens
 *   ctx     scratch only (the same grow-only buffers as the forward)
 * T > 1 (prefill): lm_short_conv_forward with initial = final state, and the KDA op by
 * lm_kda_forward (chunked or recurrent by the measured crossover) from a copy of
 * s->state (the chunked op does not promise in-place state updates) into s->state.
 * T == 1 (decode): lm_short_conv_step and lm_kda_recurrent_forward, state in place.
 * Outputs equal those of lm_kda_layer_forward over the whole sequence (fp32 rounding,
 * rel RMS <= 1e-5, tests/test_kda_layer.c). Bitwise identical for any thread count.
 * The context's buffers grow only on a larger B*T (or, for a prefill, B) than seen
 * before; the recurrent KDA op (decode, and short-state prefills) still takes a
 * small per-thread buffer per call (src/ops/kda.c), outside this layer's control.
 * The call overwrites the activations a forward saved in ctx, so a backward after it
 * needs a new lm_kda_layer_forward first (it returns LM_ERR_INVALID otherwise); a
 * forward/backward pair after it is unaffected.
 * Not scanned for finiteness, unlike in the forward: the weights (a decode step would
 * read them twice; check them once after loading, the forward does) and s->state
 * (zeros or what an earlier call wrote; the scan would double a decode step's state
 * traffic). The (small) conv states are scanned.
 * Errors: LM_ERR_INVALID (message names the field and value) for bad dims (B, T < 1,
 * the config checks of the forward), a missing weight, out, ctx, s, s->state or
 * (W > 1) conv state, non-finite x or conv state; out and s are then untouched. An op
 * error after the math began (only with non-finite weights) can leave s partly
 * advanced. */
lm_status lm_kda_layer_infer(const lm_kda_layer_config *c, int B, int T,
                             const lm_kda_layer_weights *w, const float *x, float *out,
                             lm_kda_layer_state *s, lm_kda_layer_ctx *ctx, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
