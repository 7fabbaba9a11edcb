/* Helpers shared by the model's layers (src/model/). Not a public API. */
#ifndef LINMOE_MODEL_INTERNAL_H
#define LINMOE_MODEL_INTERNAL_H

#include "linmoe/attn_layer.h"
#include "linmoe/core.h"
#include "linmoe/kda_layer.h"
#include "linmoe/model_config.h"

/* Output rows per task of lm_model_mm: fixed, so the summation order of every
 * element does not depend on the thread count. */
#define LM_MODEL_MM_BLK 64

/* C[M,N] = op(A) op(B) (+ C when accum), row-major, as single-threaded OpenBLAS
 * calls on fixed blocks of LM_MODEL_MM_BLK rows of C run in an OpenMP loop
 * (bitwise identical results for any thread count). */
void lm_model_mm(int tA, int tB, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, int accum, float *C, int ldc);

/* The inference path's C[M,N] (+)= A[M,K] B[N,K]^T: row-wise (ops/cpu/gemm_rowwise.h:
 * each row's result independent of the others, so a decode batch equals its rows run
 * alone) for M <= LM_GEMM_ROWWISE_MAX_M, else lm_model_mm(0, 1, ...). */
void lm_model_mm_infer(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                       int accum, float *C, int ldc);

/* LM_ERR_INVALID naming `layer`, `what` (forward/backward) and the tensor when `p` is
 * NULL; LM_ERR_NONFINITE when it holds a non-finite value (the first one's index and
 * value). */
lm_status lm_model_check_finite(const char *layer, const char *what, const char *name,
                                const float *p, int64_t n, lm_error *err);

/* The parameter buffer's element count for `cfg` (params.h layout, padding
 * included) without allocating it. Errors: the config's validation. */
lm_status lm_params_layout_numel(const lm_model_config *cfg, int64_t *numel, lm_error *err);

/* ---------------------------------------------------------------- memory plan hooks
 * (model.c lays every layer's buffers out in its activation and scratch classes,
 * model.h lm_model_mem_plan; a context used on its own keeps allocating its own) */

/* Floats of a KDA layer's saved activations (pq pk pv q k v fa g_raw beta_raw o ga
 * gate rstd y) and of its backward scratch (dy d_o dgate dq dk dv dg dbeta dlow) for N
 * tokens, each slice rounded up to 16 floats; and of its gradient stage (the largest
 * weight gradient written by an op that overwrites: conv kernel, gate parameters,
 * o_norm). */
int64_t lm_kda_layer_act_floats(const lm_kda_layer_config *c, int64_t N);
int64_t lm_kda_layer_scratch_floats(const lm_kda_layer_config *c, int64_t N);
int64_t lm_kda_layer_stage_floats(const lm_kda_layer_config *c);
/* From now on carve up to N tokens from acts / scratch (caller-owned, 64-byte
 * aligned, of the sizes above for N) and use `stage` (>= the stage floats, may be
 * shared by every layer) and the KDA op workspace `ws` (shared; NULL: keep own). */
void lm_kda_layer_ctx_bind(lm_kda_layer_ctx *ctx, int64_t N, float *acts, float *scratch,
                           float *stage, lm_kda_workspace *ws);
/* lm_kda_layer_backward with accumulate = 1: every weight gradient is added to what
 * g holds (GEMMs with beta = 1; the gated norm, KDA gate and short-conv gradients
 * through the stage). accumulate = 0 is lm_kda_layer_backward (overwrite). */
lm_status lm_kda_layer_backward_acc(const lm_kda_layer_config *c, const lm_kda_layer_batch *b,
                                    const lm_kda_layer_weights *w, const float *x,
                                    const float *dout, float *dx, const lm_kda_layer_grads *g,
                                    int accumulate, lm_kda_layer_ctx *ctx, lm_error *err);

/* The same for the attention layer: saved q k v o lse, scratch d_o dq dk dv. */
int64_t lm_attn_layer_act_floats(const lm_attn_layer_config *c, int64_t N);
int64_t lm_attn_layer_scratch_floats(const lm_attn_layer_config *c, int64_t N);
void lm_attn_layer_ctx_bind(lm_attn_layer_ctx *ctx, int64_t N, float *acts, float *scratch);
/* Grow the attention op's workspace (its grow-only buffer and RoPE table, which live
 * outside the memory plan: attention.h exposes no sizing) to what any batch of up to
 * N tokens needs, so that no later step makes it grow: one forward over one
 * document of N tokens on one head (the RoPE table of N positions) and one backward
 * over N documents of one token (the most documents and tiles) on every head, on
 * zeros in the bound buffers (overwritten; the ctx has no forward afterwards). Cost:
 * about one head of one attention forward at N tokens. Errors: the config checks. */
lm_status lm_attn_layer_ctx_reserve(const lm_attn_layer_config *c, int64_t N,
                                    lm_attn_layer_ctx *ctx, lm_error *err);
lm_status lm_attn_layer_backward_acc(const lm_attn_layer_config *c, const lm_attn_layer_batch *b,
                                     const lm_attn_layer_weights *w, const float *x,
                                     const float *dout, float *dx, const lm_attn_layer_grads *g,
                                     int accumulate, lm_attn_layer_ctx *ctx, lm_error *err);

#endif
