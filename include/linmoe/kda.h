/* linmoe KDA / GDN: the gated delta rule, chunked (WY / UT-transform) forward and
 * backward, and the recurrent (token-by-token) forward used for decode, on the CPU
 * in fp32.
 *
 * Math: reference/kda.md §1.2 (recurrence), §1.3 (gates), §2.1 (chunk form),
 * §3 (sub-tiling and the bounded-gate shared-matmul diagonal), §4.1 (backward);
 * Kimi Linear tech report (arXiv 2510.26692) Eqs. 1 and 6-9. The derivation of the
 * backward used here is in docs/kda-math.md.
 *
 * Per (sequence n, value head hv), with q/k head h = hv / (HV/H) (fla's GVA map):
 *   q_t <- scale * l2norm?(q_t);  k_t <- l2norm?(k_t);  beta_t <- sigmoid?(beta_t)
 *   S   <- Diag(exp(g_t)) S                  (KDA: per channel; GDN: scalar)
 *   u_t  = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
 *
 * Layouts (row-major, innermost last, fp32, contiguous):
 *   q, k          [B, T, H, K]
 *   v, o, do      [B, T, HV, V]
 *   g             KDA: [B, T, HV, K]    GDN: [B, T, HV]
 *   beta          [B, T, HV]
 *   A_log         [HV]                  (optional)
 *   dt_bias       KDA: [HV*K]  GDN: [HV] (optional)
 *   initial_state, final_state, dht, dh0   [N, HV, K, V]
 *   cu_seqlens    [N+1] int64, only with B == 1 (packed varlen); otherwise N = B.
 * Gradients have the shape of their input; dg / dbeta are with respect to the g /
 * beta inputs as given (i.e. through the in-op gate / sigmoid when enabled).
 *
 * What this module does not do: bf16 math, CUDA (see the CUDA issue), the layer
 * around the op (projections, short conv, output norm).
 */
#ifndef LINMOE_KDA_H
#define LINMOE_KDA_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_KDA = 0, LM_GDN = 1 } lm_kda_kind;

/* How g is produced from the `g` input x (reference/kda.md §1.3):
 *   NONE      g = x (already the log-decay, <= 0)
 *   SOFTPLUS  g = -exp(A_log[hv]) * softplus(x + dt_bias)       (softplus threshold 20)
 *   BOUNDED   g = lower_bound * sigmoid(exp(A_log[hv]) * (x + dt_bias)),  -5 <= lower_bound < 0
 * Absent A_log means exp(A_log) = 1; absent dt_bias means 0. */
typedef enum { LM_GATE_NONE = 0, LM_GATE_SOFTPLUS = 1, LM_GATE_BOUNDED = 2 } lm_gate_mode;

/* Log-decays below this floor (gate NONE inputs, or softplus gates of huge inputs; a
 * mask such as -1e30) are computed as the floor: e^-128 = 2.6e-56 is below fp32's
 * smallest subnormal, so every product spanning such a token is exactly 0 in fp32
 * and the state is fully reset there, as in the exact recurrence (exp(-1e30) = 0),
 * while the chunk's cumulative sums stay small enough to subtract exactly (left as
 * they are, -1e30 + g in a cumulative sum loses g and every later decay inside the
 * chunk; fp32 sums on the GPU already lose them at -1e9). The gradient with respect
 * to such a g is exactly 0, as it is in the exact recurrence. */
#define LM_KDA_LOG_DECAY_FLOOR (-128.0f)

/* Diagonal-tile path of the chunked kernels (reference/kda.md §3.1-3.3):
 *   AUTO    SHARED when the log-decay is bounded (gate BOUNDED, or NONE with
 *           lower_bound given and every g >= lower_bound), SAFE otherwise.
 *   SHARED  (CPU) 16x16 diagonal tiles by matmuls with factors relative to the first
 *           row of each 8-row half (magnitudes <= exp(8*|lower_bound|) <= e^40), so
 *           that no output row depends on a later token even in its rounding: prefill
 *           is bit-exactly causal (appending tokens never changes earlier outputs; the
 *           tile midpoint used before moved them by ~3e-8). The CUDA kernels keep the
 *           midpoint (not bit-exactly causal).
 *   SAFE    per-pair exp(G_r - G_i) (never overflows, any gate). */
typedef enum { LM_DIAG_AUTO = 0, LM_DIAG_SHARED = 1, LM_DIAG_SAFE = 2 } lm_kda_diag;

/* Reusable scratch for the CPU kernels: buffers grow to the largest call seen and
 * are kept, so repeated calls (training steps, decode steps, benchmarks) neither
 * allocate nor fault in fresh pages. One workspace must not be used by two calls
 * at the same time. */
typedef struct lm_kda_workspace lm_kda_workspace;
lm_kda_workspace *lm_kda_workspace_new(void);
void lm_kda_workspace_free(lm_kda_workspace *ws);

typedef struct {
    lm_kda_kind kind;
    int B, T, H, HV, K, V;
    int N;                      /* sequences: set by lm_kda_validate (B, or len(cu_seqlens)-1) */
    const int64_t *cu_seqlens;  /* [N+1] or NULL */
    int n_cu_seqlens;           /* number of entries of cu_seqlens (N+1) */
    lm_gate_mode gate;
    int has_lower_bound;
    float lower_bound;
    float scale;                /* default K^-0.5 (set by the caller) */
    int chunk_size;             /* 16, 32 or 64 */
    int use_qk_l2norm_in_kernel;   /* eps 1e-6 inside the sqrt */
    int use_beta_sigmoid_in_kernel;
    lm_kda_diag diag;
    lm_kda_workspace *ws;       /* NULL: scratch is allocated and freed per call */
    int trusted_state;          /* 1: skip the finiteness scan of initial_state (decode on
                                   a state linmoe itself produced; saves a full state read) */
} lm_kda_config;

/* Fill defaults: kind KDA, gate NONE, scale = K^-0.5, chunk 64, AUTO diag. */
void lm_kda_config_default(lm_kda_config *c, int B, int T, int H, int HV, int K, int V);

typedef struct {
    const float *q, *k, *v, *g, *beta;
    const float *A_log;         /* NULL: absent */
    const float *dt_bias;       /* NULL: absent */
    const float *initial_state; /* NULL: zeros */
} lm_kda_inputs;

typedef struct {
    float *o;                   /* [B,T,HV,V], required */
    float *final_state;         /* [N,HV,K,V] or NULL */
} lm_kda_outputs;

/* Upstream gradients in, gradients out. Any output pointer may be NULL when not
 * wanted (dh0 / dA_log / ddt_bias are only meaningful when the input exists). */
typedef struct {
    const float *do_;           /* [B,T,HV,V], required */
    const float *dht;           /* [N,HV,K,V] or NULL (zero) */
    float *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias;
} lm_kda_grads;

/* Check the configuration and inputs before any math: dims positive, HV a multiple
 * of H, chunk_size in {16,32,64}, lower_bound in [-5,0) when given (required for
 * BOUNDED), cu_seqlens (B == 1, starts at 0, non-decreasing, ends at T), every
 * input finite, and for gate NONE: g <= 0, and g >= lower_bound when SHARED is
 * requested or when lower_bound is given. Sets c->N. Errors: LM_ERR_INVALID with
 * the field and the value. */
lm_status lm_kda_validate(lm_kda_config *c, const lm_kda_inputs *in, lm_error *err);

/* Chunked forward (WY / UT transform), the prefill and training path. */
lm_status lm_kda_chunk_forward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_outputs *out,
                               lm_error *err);

/* Chunked backward of sum(o*do) + sum(final_state*dht); recomputes the forward
 * per chunk (states at chunk starts, w, u, Aqk, Akk^-1) as fla does. */
lm_status lm_kda_chunk_backward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_grads *gr,
                                lm_error *err);

/* Token-by-token forward (the recurrence above, fp32). Also the decode step:
 * in->initial_state and out->final_state may alias (state updated in place). */
lm_status lm_kda_recurrent_forward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_outputs *out,
                                   lm_error *err);

/* Forward-only entry (prefill / inference): picks the recurrent or the chunked
 * path by the crossover measured with `linmoe bench kda` (docs/perf-notes.md). */
lm_status lm_kda_forward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_outputs *out,
                         lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
