/* CPU KDA/GDN internals: the prepared (activated) inputs shared by the chunked and
 * recurrent paths. Not a public API. */
#ifndef LINMOE_OPS_CPU_KDA_CPU_H
#define LINMOE_OPS_CPU_KDA_CPU_H

#include "linmoe/kda.h"
#include "ops/cpu/kda_internal.h"

/* Workspace slots: shared buffers, then three per thread. */
enum { LM_WS_QS, LM_WS_KN, LM_WS_BETA, LM_WS_GK, LM_WS_BOS, LM_WS_DQS, LM_WS_DKN, LM_WS_DGK,
       LM_WS_DBETA, LM_WS_THREAD0 = 16 };
#define LM_KDA_WS_MAX_THREADS 256
#define LM_KDA_WS_SLOTS (LM_WS_THREAD0 + 3 * LM_KDA_WS_MAX_THREADS)
struct lm_kda_workspace {
    void *buf[LM_KDA_WS_SLOTS];
    size_t cap[LM_KDA_WS_SLOTS];
};
/* Buffer of at least `bytes` for `slot` (slot < 0 or ws NULL: a fresh malloc);
 * release with lm_kda_ws_put, which frees only what was not from the workspace. */
void *lm_kda_ws_get(lm_kda_workspace *ws, int slot, size_t bytes);
void lm_kda_ws_put(lm_kda_workspace *ws, int slot, void *p);
/* Per-thread slot j (0..2) of the calling OpenMP thread, or -1 past the table. */
int lm_kda_ws_thread_slot(int j);

typedef struct {
    lm_kda_workspace *ws;
    int N;
    int64_t *bos, *len; /* per sequence: first token (flattened B*T index) and length */
    float *qs;   /* [BT, H, K]  scale * l2norm?(q) */
    float *kn;   /* [BT, H, K]  l2norm?(k) */
    float *beta; /* [BT, HV]    sigmoid?(beta) */
    float *gk;   /* [BT, HV, K] per-channel log-decay (GDN: broadcast over K) */
} lm_kda_prep;

lm_status lm_kda_prep_forward(const lm_kda_config *c, const lm_kda_inputs *in, lm_kda_prep *p);
void lm_kda_prep_backward(const lm_kda_config *c, const lm_kda_inputs *in, const lm_kda_prep *p,
                          const float *dqs_hv, const float *dkn_hv, const float *dbeta_act,
                          const float *dgk, lm_kda_grads *gr);
void lm_kda_prep_free(lm_kda_prep *p);

/* 1 when the chunked kernels take the shared-matmul diagonal path for `c`
 * (after lm_kda_validate). */
int lm_kda_use_shared_diag(const lm_kda_config *c);

#endif
