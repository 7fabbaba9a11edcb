/* CPU KDA/GDN internals: the prepared (activated) inputs shared by the chunked and
 * recurrent paths. Not a public API. */
#ifndef LINMOE_OPS_CPU_KDA_CPU_H
#define LINMOE_OPS_CPU_KDA_CPU_H

#include "linmoe/kda.h"
#include "ops/cpu/kda_internal.h"

/* Workspace slots: shared buffers, then three per thread. LM_WS_DB: the gate
 * backward's per-head fp64 dt_bias sums. */
enum {
    LM_WS_QS,
    LM_WS_KN,
    LM_WS_BETA,
    LM_WS_GK,
    LM_WS_BOS,
    LM_WS_DQS,
    LM_WS_DKN,
    LM_WS_DGK,
    LM_WS_DBETA,
    LM_WS_DB,
    LM_WS_THREAD0 = 16
};
#define LM_KDA_WS_MAX_THREADS 256
#define LM_KDA_WS_SLOTS (LM_WS_THREAD0 + 3 * LM_KDA_WS_MAX_THREADS)
struct lm_kda_workspace {
    void *buf[LM_KDA_WS_SLOTS];
    size_t cap[LM_KDA_WS_SLOTS];
    unsigned char borrowed[LM_KDA_WS_SLOTS]; /* buf is the caller's (lm_kda_ws_bind) */
};
/* Buffer of at least `bytes` for `slot` (slot < 0 or ws NULL: a fresh malloc);
 * release with lm_kda_ws_put, which frees only what was not from the workspace. A
 * slot allocates only when a call needs more than it holds (grow-only). */
void *lm_kda_ws_get(lm_kda_workspace *ws, int slot, size_t bytes);
void lm_kda_ws_put(lm_kda_workspace *ws, int slot, void *p);
/* Per-thread slot j (0..2) of the calling OpenMP thread, or -1 past the table. */
int lm_kda_ws_thread_slot(int j);

/* The bytes every slot of a workspace needs for chunked forward + backward calls of
 * configs like `c` (dims, chunk size, gate; B*T up to c->B * c->T tokens, documents of
 * up to c->T tokens, any cu_seqlens with at most B*T documents) on `threads` OpenMP
 * threads: bytes[LM_KDA_WS_SLOTS], 0 for an unused slot. Used by the model's memory
 * plan (model.h lm_model_mem_plan) to carve the workspace from its scratch class. */
void lm_kda_ws_plan(const lm_kda_config *c, int threads, size_t *bytes);
/* Hand `slot` the caller's buffer p of `bytes` (it must outlive the workspace); the
 * workspace never frees it, and allocates its own only if a call needs more. */
void lm_kda_ws_bind(lm_kda_workspace *ws, int slot, void *p, size_t bytes);
/* Floats of the per-thread chunk workspace (cpu/kda_chunk.c ws_init). */
size_t lm_kda_chunk_ws_floats(int C, int K, int V, int bwd);

/* Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) for the calling thread,
 * returning the previous control word for lm_kda_fp_leave. The chunked kernels take
 * e^{+-G} factors of cumulative log-decays that reach -5 per token (-320 per 64-token
 * chunk with the bounded gate): products of such factors with q, k and the state fall
 * below FLT_MIN (1.2e-38) and would be subnormal, which Intel cores handle by a
 * microcode assist of ~100+ cycles per instruction (AMD Zen 4: mostly in hardware).
 * Flushing them changes results by < 1.2e-38 absolute. Every OpenMP region of the op
 * sets the mode at its start in each thread and restores it at its end, so nothing
 * leaks to the caller's threads. A no-op off x86. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
static inline unsigned lm_kda_fp_enter(void) {
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u);
    return old;
}
static inline void lm_kda_fp_leave(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned lm_kda_fp_enter(void) { return 0; }
static inline void lm_kda_fp_leave(unsigned old) { (void)old; }
#endif

typedef struct {
    lm_kda_workspace *ws;
    int N;
    int64_t *bos, *len; /* per sequence: first token (flattened B*T index) and length */
    float *qs;   /* [BT, H, K]  scale * l2norm?(q) */
    float *kn;   /* [BT, H, K]  l2norm?(k) */
    float *beta; /* [BT, HV]    sigmoid?(beta) */
    float *gk;   /* [BT, HV, K] per-channel log-decay (GDN: broadcast over K) */
} lm_kda_prep;

/* Errors: LM_ERR_NONFINITE when the gate's log-decay overflows fp32 for finite inputs
 * (exp(A_log) * softplus(g + dt_bias), exp(A_log) * (g + dt_bias) with A_log near the
 * validator's bound), naming the token row, head and A_log. */
lm_status lm_kda_prep_forward(const lm_kda_config *c, const lm_kda_inputs *in, lm_kda_prep *p,
                              lm_error *err);
void lm_kda_prep_backward(const lm_kda_config *c, const lm_kda_inputs *in, const lm_kda_prep *p,
                          const float *dqs_hv, const float *dkn_hv, const float *dbeta_act,
                          const float *dgk, lm_kda_grads *gr);
void lm_kda_prep_free(lm_kda_prep *p);

/* 1 when the chunked kernels take the shared-matmul diagonal path for `c`
 * (after lm_kda_validate). */
int lm_kda_use_shared_diag(const lm_kda_config *c);

#endif
