/* CPU attention internals: the prepared inputs shared by the forward, backward and
 * decode kernels (document table, RoPE table, rotated / transposed copies), the RoPE
 * rotation, and a test hook that forces one of the two backward schedules. Not a
 * public API.
 */
#ifndef LINMOE_OPS_CPU_ATTENTION_CPU_H
#define LINMOE_OPS_CPU_ATTENTION_CPU_H

#include "linmoe/attention.h"

/* Tile edge: 64 queries x 64 keys. Query and key blocks start at the same offsets
 * of each document, so only the diagonal tile needs the causal mask. */
#define LM_ATTN_BLK 64

struct lm_attention_workspace {
    void *buf; /* scratch, grow-only */
    size_t cap;
    float *rope_cs; /* [rope_len, D/2] cos then [rope_len, D/2] sin */
    int64_t rope_len;
    size_t rope_cap; /* floats */
    int rope_D;
    double rope_theta;
};

/* One unit of parallel work: document n, head (query or kv) h, block b. */
typedef struct {
    int n, h, b;
} lm_attn_task;

typedef struct {
    int N;
    int64_t *bos, *len;   /* per document: first token (flattened B*T index), length */
    int64_t maxlen;       /* longest document */
    const float *rc, *rs; /* RoPE cos / sin [maxlen, D/2] (NULL: NoPE) */
    float *kT;            /* [Hkv, D, ldT] keys (rotated), transposed: the B operand of Q K^T */
    float *vT;            /* [Hkv, D, ldT] values transposed (backward: dO V^T) */
    int64_t ldT;          /* row stride of kT / vT: B*T padded to a multiple of 16 that is not
                             a multiple of 256 floats (with a 1 KiB-multiple stride the rows of
                             a tile share few L1 sets: measured 20% slower at B*T = 4096) */
    const float *qr;      /* [BT, Hq, D] rotated q (q itself for NoPE; backward) */
    const float *kr;      /* [BT, Hkv, D] rotated k (k itself for NoPE; backward) */
    float *delta;         /* [BT, Hq] rowsum(dO * O) (backward) */
    lm_attn_task *tasks;
    float *thr; /* per-thread tiles: thread i at thr + i * thr_floats */
    size_t thr_floats;
} lm_attn_prep;

/* RoPE factors of position p (fp64 angle p * theta^(-2f/D), rounded cos / sin):
 * cs[f], sn[f] for f < D/2. The table and the decode path both use this, so a
 * decode step rotates exactly as the full forward does. */
void lm_attn_rope_factors(double theta, int D, int64_t p, float *cs, float *sn);

/* y = R x (inverse = 0) or y = R^T x (inverse = 1), half-split convention; y may
 * alias x. */
static inline void lm_attn_rope_rotate(const float *x, float *y, int D, const float *cs,
                                       const float *sn, int inverse) {
    const int h = D / 2;
    const float sg = inverse ? -1.0f : 1.0f;
    for (int f = 0; f < h; f++) {
        const float a = x[f], b = x[f + h], c = cs[f], s = sg * sn[f];
        y[f] = a * c - b * s;
        y[f + h] = b * c + a * s;
    }
}

/* Kernels (after validation and preparation by src/ops/attention.c). */
void lm_attn_cpu_forward(const lm_attention_config *c, const lm_attn_prep *p,
                         const lm_attention_inputs *in, int ntasks, float *o, float *lse);
void lm_attn_cpu_backward(const lm_attention_config *c, const lm_attn_prep *p, const float *lse,
                          const lm_attention_grads *gr);

/* Backward schedules (bitwise identical results; the choice is about parallelism):
 *   OWNER     one task per (document, kv head) owns dq of its query heads and dk, dv
 *             of its kv head: 5 tile products, parallel over N * Hkv.
 *   TWO_PASS  tasks (document, kv head, key block) for dk, dv, then (document, query
 *             head, query block) for dq: 7 tile products, parallel over the blocks.
 * AUTO takes OWNER when N * Hkv >= 4 * threads. The hook is for tests. */
enum { LM_ATTN_BWD_AUTO = 0, LM_ATTN_BWD_OWNER = 1, LM_ATTN_BWD_TWO_PASS = 2 };
void lm_attention_force_bwd_schedule(int schedule);

#endif
