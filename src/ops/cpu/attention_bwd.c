/* Tiled causal attention backward on the CPU (fp32): FlashAttention-2 (Dao, arXiv
 * 2307.08691, Algorithm 2). Per 64 x 64 tile (query block qb, key block kb <= qb) of
 * query head h and its kv head g, P is recomputed from the saved lse:
 *   P  = exp(scale Q~ K~^T - lse)            (0 above the diagonal)
 *   dP = dO V^T,  dS = P * (dP - Delta)      (Delta = rowsum(dO * O), prepared)
 *   dV += P^T dO,  dK~ += scale dS^T Q~,  dQ~ += scale dS K~
 * dq is accumulated in place (rotated frame; the caller rotates it back); dk, dv of
 * one key block are accumulated in a tile, rotated back and stored once.
 *
 * Race freedom and determinism: every gradient element has exactly one owner and is
 * summed in an order fixed by the shapes: dK / dV of key block kb over (query head
 * of the group ascending, qb ascending), dQ of query block qb over kb ascending.
 * The two schedules below keep those orders, so they agree bit for bit with each
 * other and with themselves at any thread count (tests/test_attention.c). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/attention_cpu.h"
#include "ops/cpu/gemm_small.h"
#include "ops/cpu/kda_internal.h" /* lm_fexp */

static int g_force_schedule = LM_ATTN_BWD_AUTO;

void lm_attention_force_bwd_schedule(int schedule) { g_force_schedule = schedule; }

typedef struct {
    const lm_attention_config *c;
    const lm_attn_prep *p;
    const float *lse, *do_;
    float *dq, *dk, *dv;
} bwd_ctx;

static inline int blk_rows(int64_t len, int64_t b) {
    const int64_t r = len - b * LM_ATTN_BLK;
    return r < LM_ATTN_BLK ? (int)r : LM_ATTN_BLK;
}

/* P and dS of tile (qb, kb) of head h in document n: P [nq, nk], dS [nq, nk] (row
 * stride LM_ATTN_BLK). */
static void tile_p_ds(const bwd_ctx *x, int n, int h, int qb, int kb, float *restrict P,
                      float *restrict dS) {
    const lm_attention_config *c = x->c;
    const lm_attn_prep *p = x->p;
    const int D = c->D, Hq = c->Hq, g = h / (Hq / c->Hkv);
    const int64_t bos = p->bos[n], len = p->len[n], ldT = p->ldT;
    const int64_t q0 = (int64_t)qb * LM_ATTN_BLK, k0 = (int64_t)kb * LM_ATTN_BLK;
    const int nq = blk_rows(len, qb), nk = blk_rows(len, kb), diag = qb == kb;
    const size_t off_kT = (size_t)g * D * ldT + (size_t)(bos + k0);
    lm_gemm_small(nq, nk, D, c->scale, p->qr + ((bos + q0) * Hq + h) * D, (ptrdiff_t)Hq * D, 1,
                  p->kT + off_kT, ldT, P, LM_ATTN_BLK, 0);
    lm_gemm_small(nq, nk, D, 1.0f, x->do_ + ((bos + q0) * Hq + h) * D, (ptrdiff_t)Hq * D, 1,
                  p->vT + off_kT, ldT, dS, LM_ATTN_BLK, 0);
    for (int i = 0; i < nq; i++) {
        const int64_t r = (bos + q0 + i) * Hq + h;
        const float L = x->lse[r], dl = p->delta[r];
        float *restrict pr = P + (size_t)i * LM_ATTN_BLK, *restrict dr =
                                                              dS + (size_t)i * LM_ATTN_BLK;
        const int jn = diag ? i + 1 : nk;
#pragma omp simd
        for (int j = 0; j < jn; j++) {
            const float e = lm_fexp(pr[j] - L);
            pr[j] = e;
            dr[j] = e * (dr[j] - dl);
        }
        for (int j = jn; j < nk; j++)
            pr[j] = dr[j] = 0.0f;
    }
}

/* dV += P^T dO_qb, dK~ += scale dS^T Q~_qb for one tile. */
static void tile_dkdv(const bwd_ctx *x, int n, int h, int qb, int kb, const float *P,
                      const float *dS, float *dKt, float *dVt) {
    const lm_attention_config *c = x->c;
    const int D = c->D, Hq = c->Hq;
    const int64_t bos = x->p->bos[n], len = x->p->len[n], q0 = (int64_t)qb * LM_ATTN_BLK;
    const int nq = blk_rows(len, qb), nk = blk_rows(len, kb);
    lm_gemm_small(nk, D, nq, 1.0f, P, 1, LM_ATTN_BLK, x->do_ + ((bos + q0) * Hq + h) * D,
                  (ptrdiff_t)Hq * D, dVt, D, 1);
    lm_gemm_small(nk, D, nq, c->scale, dS, 1, LM_ATTN_BLK, x->p->qr + ((bos + q0) * Hq + h) * D,
                  (ptrdiff_t)Hq * D, dKt, D, 1);
}

/* dQ~_qb += scale dS K~_kb, in place in dq. */
static void tile_dq(const bwd_ctx *x, int n, int h, int qb, int kb, const float *dS) {
    const lm_attention_config *c = x->c;
    const int D = c->D, Hq = c->Hq, Hkv = c->Hkv, g = h / (Hq / Hkv);
    const int64_t bos = x->p->bos[n], len = x->p->len[n];
    const int64_t q0 = (int64_t)qb * LM_ATTN_BLK, k0 = (int64_t)kb * LM_ATTN_BLK;
    const int nq = blk_rows(len, qb), nk = blk_rows(len, kb);
    lm_gemm_small(nq, D, nk, c->scale, dS, LM_ATTN_BLK, 1, x->p->kr + ((bos + k0) * Hkv + g) * D,
                  (ptrdiff_t)Hkv * D, x->dq + ((bos + q0) * Hq + h) * D, (ptrdiff_t)Hq * D, 1);
}

/* Store the key block's dk (rotated back) and dv. */
static void store_dkdv(const bwd_ctx *x, int n, int g, int kb, const float *dKt, const float *dVt) {
    const lm_attention_config *c = x->c;
    const lm_attn_prep *p = x->p;
    const int D = c->D, Hkv = c->Hkv, h2 = D / 2;
    const int64_t bos = p->bos[n], k0 = (int64_t)kb * LM_ATTN_BLK;
    const int nk = blk_rows(p->len[n], kb);
    for (int j = 0; j < nk; j++) {
        const size_t r = (size_t)((bos + k0 + j) * Hkv + g) * D;
        if (p->rc)
            lm_attn_rope_rotate(dKt + (size_t)j * D, x->dk + r, D, p->rc + (k0 + j) * h2,
                                p->rs + (k0 + j) * h2, 1);
        else
            memcpy(x->dk + r, dKt + (size_t)j * D, sizeof(float) * (size_t)D);
        memcpy(x->dv + r, dVt + (size_t)j * D, sizeof(float) * (size_t)D);
    }
}

/* dK, dV of key block kb of kv head g (all query heads of the group, all qb >= kb);
 * with `with_dq` also the dQ contributions of those tiles. */
static void key_block(const bwd_ctx *x, int n, int g, int kb, int with_dq, float *scr) {
    const lm_attention_config *c = x->c;
    const int D = c->D, grp = c->Hq / c->Hkv;
    const int nb = (int)((x->p->len[n] + LM_ATTN_BLK - 1) / LM_ATTN_BLK);
    float *P = scr, *dS = P + (size_t)LM_ATTN_BLK * LM_ATTN_BLK;
    float *dKt = dS + (size_t)LM_ATTN_BLK * LM_ATTN_BLK, *dVt = dKt + (size_t)LM_ATTN_BLK * D;
    const int nk = blk_rows(x->p->len[n], kb);
    memset(dKt, 0, sizeof(float) * (size_t)nk * D);
    memset(dVt, 0, sizeof(float) * (size_t)nk * D);
    for (int hh = 0; hh < grp; hh++) {
        const int h = g * grp + hh;
        for (int qb = kb; qb < nb; qb++) {
            tile_p_ds(x, n, h, qb, kb, P, dS);
            tile_dkdv(x, n, h, qb, kb, P, dS, dKt, dVt);
            if (with_dq)
                tile_dq(x, n, h, qb, kb, dS);
        }
    }
    store_dkdv(x, n, g, kb, dKt, dVt);
}

/* Owner tasks carry the document length in `b`; longest first. The order only
 * balances the load (results do not depend on it). */
/* Strict total order of the owner schedule's tasks: longest document first, then
 * document, then kv head ((n, h) is unique, so no two tasks tie). */
static int task_before(const lm_attn_task *x, const lm_attn_task *y) {
    if (x->b != y->b)
        return x->b > y->b;
    if (x->n != y->n)
        return x->n < y->n;
    return x->h < y->h;
}

/* In-place heap sort by task_before (glibc's qsort mallocs a merge buffer past ~1 KiB,
 * and the step must not allocate). Under a strict total order the sorted sequence is
 * unique, so the schedule is the one any sort gives. */
static void sift_down(lm_attn_task *t, int i, int n) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n)
            return;
        if (c + 1 < n && task_before(&t[c], &t[c + 1]))
            c++;
        if (!task_before(&t[i], &t[c]))
            return;
        const lm_attn_task tmp = t[i];
        t[i] = t[c];
        t[c] = tmp;
        i = c;
    }
}
static void sort_tasks(lm_attn_task *t, int n) {
    for (int i = n / 2 - 1; i >= 0; i--)
        sift_down(t, i, n);
    for (int e = n - 1; e > 0; e--) {
        const lm_attn_task tmp = t[0];
        t[0] = t[e];
        t[e] = tmp;
        sift_down(t, 0, e);
    }
}

void lm_attn_cpu_backward(const lm_attention_config *c, const lm_attn_prep *p, const float *lse,
                          const lm_attention_grads *gr) {
    bwd_ctx x = {c, p, lse, gr->do_, gr->dq, gr->dk, gr->dv};
    const int Hq = c->Hq, Hkv = c->Hkv;
    int nonempty = 0;
    for (int n = 0; n < p->N; n++)
        nonempty += p->len[n] > 0;
    int sched = g_force_schedule;
    if (sched == LM_ATTN_BWD_AUTO)
        sched = (int64_t)nonempty * Hkv >= 4 * (int64_t)omp_get_max_threads()
                    ? LM_ATTN_BWD_OWNER
                    : LM_ATTN_BWD_TWO_PASS;
    lm_attn_task *tk = p->tasks;
    if (sched == LM_ATTN_BWD_OWNER) {
        /* tasks (document, kv head), longest documents first */
        int nt = 0;
        for (int n = 0; n < p->N; n++)
            if (p->len[n] > 0)
                for (int g = 0; g < Hkv; g++)
                    tk[nt++] = (lm_attn_task){n, g, (int)p->len[n]};
        sort_tasks(tk, nt);
#pragma omp parallel
        {
            float *scr = p->thr + p->thr_floats * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
            for (int t = 0; t < nt; t++) {
                const int nb = (int)((p->len[tk[t].n] + LM_ATTN_BLK - 1) / LM_ATTN_BLK);
                for (int kb = 0; kb < nb; kb++)
                    key_block(&x, tk[t].n, tk[t].h, kb, 1, scr);
            }
        }
        return;
    }
    /* two passes: (document, kv head, key block) for dk, dv, heaviest (kb = 0) first;
     * then (document, query head, query block) for dq, heaviest (last qb) first */
    const int64_t maxnb = (p->maxlen + LM_ATTN_BLK - 1) / LM_ATTN_BLK;
    int nt = 0;
    for (int64_t b = 0; b < maxnb; b++)
        for (int n = 0; n < p->N; n++)
            if (b * LM_ATTN_BLK < p->len[n])
                for (int g = 0; g < Hkv; g++)
                    tk[nt++] = (lm_attn_task){n, g, (int)b};
#pragma omp parallel
    {
        float *scr = p->thr + p->thr_floats * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < nt; t++)
            key_block(&x, tk[t].n, tk[t].h, tk[t].b, 0, scr);
    }
    nt = 0;
    for (int64_t b = maxnb - 1; b >= 0; b--)
        for (int n = 0; n < p->N; n++)
            if (b * LM_ATTN_BLK < p->len[n])
                for (int h = 0; h < Hq; h++)
                    tk[nt++] = (lm_attn_task){n, h, (int)b};
#pragma omp parallel
    {
        float *scr = p->thr + p->thr_floats * (size_t)omp_get_thread_num();
        float *P = scr, *dS = P + (size_t)LM_ATTN_BLK * LM_ATTN_BLK;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < nt; t++)
            for (int kb = 0; kb <= tk[t].b; kb++) {
                tile_p_ds(&x, tk[t].n, tk[t].h, tk[t].b, kb, P, dS);
                tile_dq(&x, tk[t].n, tk[t].h, tk[t].b, kb, dS);
            }
    }
}
