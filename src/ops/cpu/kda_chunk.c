/* Chunked (WY / UT-transform) KDA/GDN forward and backward on the CPU, fp32.
 *
 * Math: reference/kda.md §2.1 (per-chunk quantities), §3.1 (16-token sub-tiles:
 * off-diagonal tiles with both factors relative to the first row of the row tile;
 * diagonal tiles, when the log-decay is bounded, by matmuls relative to the first row
 * of each 8-row half (the second half's rows against the first half's columns as an
 * off-diagonal piece): factors within e^{+-8|lb|}, and every reference at or before the
 * rows that use it, so no row's rounding depends on later tokens (the tile midpoint
 * did; the tile's first row alone gave e^{+-15|lb|} and lost precision in dg);
 * per-pair exp of differences otherwise), §3.1 "Inverse" (forward
 * substitution on 16x16 diagonal blocks, then block merge), §4.1 (backward). The
 * backward below is derived in docs/kda-math.md; every line names the forward
 * product it differentiates.
 *
 * Work split: one task per (sequence, value head), run in parallel with OpenMP;
 * inside a task the chunks run in order (the state recurrence is sequential).
 * Each thread owns one workspace, allocated once per call.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "linmoe/core.h"
#include "ops/cpu/gemm_small.h"
#include "ops/cpu/kda_cpu.h"

#define BC 16 /* sub-tile rows */
#define BH 8  /* rows per reference inside a shared diagonal tile */

typedef struct {
    int C, K, V, M; /* M = max(C, K, V) */
    /* gathered chunk inputs */
    float *Q, *Kc, *Vc, *beta;
    double *G; /* cumulative log-decay; fp64 so that G_r - G_i is exact even when |G| is
                  in the thousands (gates of -1000), see docs/kda-math.md */
    /* per-chunk forward quantities */
    float *eG, *eGd, *Qg, *Kg, *Kd, *gam, *Bk, *Bv;
    float *Aqk, *P, *Ab, *Tm, *W, *U, *Vn;
    /* tile scratch */
    float *X, *Er, *Z, *Ec, *T1, *pack;
    /* backward */
    float *dO, *dVn, *dAqk, *dP, *dQg, *dKd, *dW, *dTm, *dA, *dBv, *dBk, *dQp, *dKr, *dKc, *dZ,
        *dG, *dgam, *dSn, *S0T, *dbeta;
    float *buf;
} ws_t;

size_t lm_kda_chunk_ws_floats(int C, int K, int V, int bwd) {
    int M = C > K ? C : K;
    M = M > V ? M : V;
    int TR = C > 2 * BC ? C : 2 * BC; /* rows of T1 */
    size_t CK = (size_t)C * K, CV = (size_t)C * V, CC = (size_t)C * C;
    size_t n = 4 * CK + CV + C                    /* Q Kc G(fp64: 2 floats) Vc beta */
               + 6 * CK + K + CV                  /* eG eGd Qg Kg Kd gam Bk Bv */
               + 4 * CC + CK + 2 * CV             /* Aqk P Ab Tm W U Vn */
               + 2 * BC * K + BC * K + 2 * CK     /* X Er Z Ec */
               + (size_t)TR * M + (size_t)M * M;  /* T1 pack */
    if (bwd)
        n += CV * 2 + CC * 2 + CK * 3 + CC * 2 + CV + CK + CK * 3 + CK + CK + K +
             (size_t)K * V * 2 + C;
    return n;
}

static void ws_init(ws_t *w, lm_kda_workspace *wsp, int C, int K, int V, int bwd) {
    memset(w, 0, sizeof(*w));
    w->C = C, w->K = K, w->V = V;
    int M = C > K ? C : K;
    M = M > V ? M : V;
    w->M = M;
    size_t CK = (size_t)C * K, CV = (size_t)C * V, CC = (size_t)C * C;
    const size_t n = lm_kda_chunk_ws_floats(C, K, V, bwd);
    int TR = C > 2 * BC ? C : 2 * BC; /* rows of T1 */
    float *p = lm_kda_ws_get(wsp, lm_kda_ws_thread_slot(0), n * sizeof(float));
    w->buf = p;
#define TAKE(ptr, cnt) (ptr = p, p += (cnt))
    TAKE(w->Q, CK); TAKE(w->Kc, CK); w->G = (double *)(void *)p; p += 2 * CK; TAKE(w->Vc, CV); TAKE(w->beta, C);
    TAKE(w->eG, CK); TAKE(w->eGd, CK); TAKE(w->Qg, CK); TAKE(w->Kg, CK); TAKE(w->Kd, CK);
    TAKE(w->gam, K); TAKE(w->Bk, CK); TAKE(w->Bv, CV);
    TAKE(w->Aqk, CC); TAKE(w->P, CC); TAKE(w->Ab, CC); TAKE(w->Tm, CC);
    TAKE(w->W, CK); TAKE(w->U, CV); TAKE(w->Vn, CV);
    TAKE(w->X, 2 * BC * K); TAKE(w->Er, BC * K); TAKE(w->Z, CK); TAKE(w->Ec, CK);
    TAKE(w->T1, (size_t)TR * M); TAKE(w->pack, (size_t)M * M);
    if (bwd) {
        TAKE(w->dO, CV); TAKE(w->dVn, CV); TAKE(w->dAqk, CC); TAKE(w->dP, CC);
        TAKE(w->dQg, CK); TAKE(w->dKd, CK); TAKE(w->dW, CK); TAKE(w->dTm, CC); TAKE(w->dA, CC);
        TAKE(w->dBv, CV); TAKE(w->dBk, CK); TAKE(w->dQp, CK); TAKE(w->dKr, CK); TAKE(w->dKc, CK);
        TAKE(w->dZ, CK); TAKE(w->dG, CK); TAKE(w->dgam, K); TAKE(w->dSn, (size_t)K * V);
        TAKE(w->S0T, (size_t)K * V); TAKE(w->dbeta, C);
    }
#undef TAKE
}

static void ws_free(ws_t *w, lm_kda_workspace *wsp) {
    lm_kda_ws_put(wsp, lm_kda_ws_thread_slot(0), w->buf);
}

/* dst[r,:] = src[r,:] * exp(dir * (G[r,:] - Gref[:])) for r < n; the factor is
 * also stored in E (when non-NULL). dir = +1: row factor (<= 1 when Gref is an
 * earlier row); dir = -1: column factor. */
static void scaled_rows(int n, int K, const float *src, int lds, const double *G, int ldg,
                        const double *Gref, float dir, float *dst, int ldd, float *E, int lde) {
    for (int r = 0; r < n; r++) {
        const float *s = src + (size_t)r * lds;
        const double *g = G + (size_t)r * ldg;
        float *o = dst + (size_t)r * ldd;
        float *e = E ? E + (size_t)r * lde : NULL;
        for (int d = 0; d < K; d++) {
            float f = lm_fexp(dir * (float)(g[d] - Gref[d]));
            o[d] = s[d] * f;
            if (e) e[d] = f;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Public helpers for the bound demonstration (declared in kda_internal.h).  */

void lm_kda_diag_tile_shared(int L, int K, const float *a, int lda, const float *b, int ldb,
                             const double *G, int ldg, int ref, int round_bf16, float *out,
                             float *scratch) {
    float *Xa = scratch, *Zb = scratch + (size_t)L * K;
    const double *Gref = G + (size_t)ref * ldg;
    scaled_rows(L, K, a, lda, G, ldg, Gref, +1.0f, Xa, K, NULL, 0);
    scaled_rows(L, K, b, ldb, G, ldg, Gref, -1.0f, Zb, K, NULL, 0);
    if (round_bf16)
        for (size_t i = 0; i < (size_t)2 * L * K; i++) scratch[i] = lm_bf16_round(scratch[i]);
    /* out = Xa * Zb^T: plain triple loop (this helper is for tests, not speed) */
    for (int r = 0; r < L; r++)
        for (int i = 0; i < L; i++) {
            float s = 0.0f;
            for (int d = 0; d < K; d++) s += Xa[(size_t)r * K + d] * Zb[(size_t)i * K + d];
            out[(size_t)r * L + i] = i <= r ? s : 0.0f;
        }
}

void lm_kda_diag_tile_safe(int L, int K, const float *a, int lda, const float *b, int ldb,
                           const double *G, int ldg, float *out) {
    for (int r = 0; r < L; r++)
        for (int i = 0; i < L; i++) {
            float s = 0.0f;
            if (i <= r) {
                const double *gr = G + (size_t)r * ldg, *gi = G + (size_t)i * ldg;
                const float *ar = a + (size_t)r * lda, *bi = b + (size_t)i * ldb;
                for (int d = 0; d < K; d++) s += ar[d] * bi[d] * lm_fexp((float)(gr[d] - gi[d]));
            }
            out[(size_t)r * L + i] = s;
        }
}

/* ------------------------------------------------------------------------ */
/* Intra-chunk products Aqk (incl. diagonal, q pre-scaled) and P (strict,     */
/* unscaled by beta) for rows [r0, r0+L) and columns [c0, c1), factors        */
/* relative to row `ref`.                                                     */
static void tile_fwd(ws_t *w, int r0, int L, int c0, int c1, int ref, int diag) {
    const int K = w->K, C = w->C, nc = c1 - c0;
    const double *Gref = w->G + (size_t)ref * K;
    scaled_rows(L, K, w->Q + (size_t)r0 * K, K, w->G + (size_t)r0 * K, K, Gref, +1.0f, w->X, K,
                NULL, 0);
    scaled_rows(L, K, w->Kc + (size_t)r0 * K, K, w->G + (size_t)r0 * K, K, Gref, +1.0f,
                w->X + (size_t)L * K, K, NULL, 0);
    scaled_rows(nc, K, w->Kc + (size_t)c0 * K, K, w->G + (size_t)c0 * K, K, Gref, -1.0f, w->Z, K,
                NULL, 0);
    lm_gemm_small_nt(2 * L, nc, K, 1.0f, w->X, K, w->Z, K, w->T1, C, 0, w->pack);
    for (int r = 0; r < L; r++) {
        float *aq = w->Aqk + (size_t)(r0 + r) * C + c0, *pp = w->P + (size_t)(r0 + r) * C + c0;
        const float *tq = w->T1 + (size_t)r * C, *tk = w->T1 + (size_t)(L + r) * C;
        for (int i = 0; i < nc; i++) {
            aq[i] = (!diag || i <= r) ? tq[i] : 0.0f;
            pp[i] = (!diag || i < r) ? tk[i] : 0.0f;
        }
    }
}

static void tile_fwd_safe_diag(ws_t *w, int r0, int L) {
    const int K = w->K, C = w->C;
    for (int r = 0; r < L; r++) {
        const double *gr = w->G + (size_t)(r0 + r) * K;
        const float *qr = w->Q + (size_t)(r0 + r) * K, *kr = w->Kc + (size_t)(r0 + r) * K;
        float *aq = w->Aqk + (size_t)(r0 + r) * C + r0, *pp = w->P + (size_t)(r0 + r) * C + r0;
        for (int i = 0; i < L; i++) {
            float sq = 0.0f, sk = 0.0f;
            if (i <= r) {
                const double *gi = w->G + (size_t)(r0 + i) * K;
                const float *ki = w->Kc + (size_t)(r0 + i) * K;
#pragma omp simd reduction(+ : sq, sk)
                for (int d = 0; d < K; d++) {
                    float e = ki[d] * lm_fexp((float)(gr[d] - gi[d]));
                    sq += qr[d] * e;
                    sk += kr[d] * e;
                }
            }
            aq[i] = sq;
            pp[i] = i < r ? sk : 0.0f;
        }
    }
}

/* Tm = (I + diag(beta) P)^-1 by forward substitution on 16x16 diagonal blocks and
 * block merge T[a, <a] = -T[a,a] * (A[a, <a] * T[<a, <a]). */
static void ut_inverse(ws_t *w, int c) {
    const int C = w->C;
    for (int r = 0; r < c; r++)
        for (int i = 0; i < C; i++) {
            w->Ab[(size_t)r * C + i] = i < r ? w->beta[r] * w->P[(size_t)r * C + i] : 0.0f;
            w->Tm[(size_t)r * C + i] = 0.0f;
        }
    for (int r0 = 0; r0 < c; r0 += BC) {
        int L = c - r0 < BC ? c - r0 : BC;
        for (int r = 0; r < L; r++) {
            float *Tr = w->Tm + (size_t)(r0 + r) * C + r0;
            const float *Ar = w->Ab + (size_t)(r0 + r) * C + r0;
            Tr[r] = 1.0f;
            for (int j = 0; j < r; j++) {
                float s = 0.0f;
                for (int m = j; m < r; m++) s += Ar[m] * w->Tm[(size_t)(r0 + m) * C + r0 + j];
                Tr[j] = -s;
            }
        }
        if (r0 > 0) {
            lm_gemm_small(L, r0, r0, 1.0f, w->Ab + (size_t)r0 * C, C, 1, w->Tm, C, w->T1, C, 0);
            lm_gemm_small(L, r0, L, -1.0f, w->Tm + (size_t)r0 * C + r0, C, 1, w->T1, C,
                          w->Tm + (size_t)r0 * C, C, 0);
        }
    }
}

/* Everything of a chunk that does not depend on the state: G (cumsum, in place),
 * e^G, Qg, Kg, Kd, gamma, Aqk, P, Tm, W, U. Expects Q, Kc, G (raw g), Vc, beta. */
static void chunk_intra(ws_t *w, int c, int shared) {
    const int K = w->K, V = w->V, C = w->C;
    for (int r = 1; r < c; r++)
        for (int d = 0; d < K; d++) w->G[(size_t)r * K + d] += w->G[(size_t)(r - 1) * K + d];
    const double *restrict Gl = w->G + (size_t)(c - 1) * K;
    for (int d = 0; d < K; d++) w->gam[d] = lm_fexp((float)Gl[d]);
    for (int r = 0; r < c; r++) {
        size_t o = (size_t)r * K;
        const double *restrict g = w->G + o;
        const float *restrict q = w->Q + o, *restrict k = w->Kc + o;
        float *restrict eG = w->eG + o, *restrict eGd = w->eGd + o, *restrict Qg = w->Qg + o;
        float *restrict Kg = w->Kg + o, *restrict Kd = w->Kd + o, *restrict Bk = w->Bk + o;
        const float b = w->beta[r];
#pragma omp simd
        for (int d = 0; d < K; d++) {
            float e = lm_fexp((float)g[d]), ed = lm_fexp((float)(Gl[d] - g[d]));
            eG[d] = e;
            eGd[d] = ed;
            Qg[d] = q[d] * e;
            Kg[d] = k[d] * e;
            Kd[d] = k[d] * ed;
            Bk[d] = b * k[d] * e;
        }
        float *restrict Bv = w->Bv + (size_t)r * V;
        const float *restrict vv = w->Vc + (size_t)r * V;
        for (int v = 0; v < V; v++) Bv[v] = b * vv[v];
    }
    for (int r = 0; r < c; r++) {
        memset(w->Aqk + (size_t)r * C, 0, sizeof(float) * C);
        memset(w->P + (size_t)r * C, 0, sizeof(float) * C);
    }
    for (int r0 = 0; r0 < c; r0 += BC) {
        int L = c - r0 < BC ? c - r0 : BC;
        if (r0 > 0) tile_fwd(w, r0, L, 0, r0, r0, 0);
        if (shared) {
            /* rows relative to references at or before them (causal): the tile's first row
             * for its first half, the second half's first row for the rest (factors within
             * e^{+-8|lb|}, the range the tile midpoint gave) */
            const int h = L < BH ? L : BH;
            tile_fwd(w, r0, h, r0, r0 + h, r0, 1);
            if (L > h) {
                tile_fwd(w, r0 + h, L - h, r0, r0 + h, r0 + h, 0);
                tile_fwd(w, r0 + h, L - h, r0 + h, r0 + L, r0 + h, 1);
            }
        } else
            tile_fwd_safe_diag(w, r0, L);
    }
    ut_inverse(w, c);
    lm_gemm_small(c, K, c, 1.0f, w->Tm, C, 1, w->Bk, K, w->W, K, 0);
    lm_gemm_small(c, V, c, 1.0f, w->Tm, C, 1, w->Bv, V, w->U, V, 0);
}

/* Vn = U - W S;  O = Qg S + Aqk Vn (rows of stride ldo, skipped when O is NULL);
 * S <- gamma (.) S + Kd^T Vn (in place). */
static void chunk_state(ws_t *w, int c, float *S, float *O, ptrdiff_t ldo) {
    const int K = w->K, V = w->V, C = w->C;
    for (int r = 0; r < c; r++) memcpy(w->Vn + (size_t)r * V, w->U + (size_t)r * V, sizeof(float) * V);
    lm_gemm_small(c, V, K, -1.0f, w->W, K, 1, S, V, w->Vn, V, 1);
    if (O) {
        lm_gemm_small(c, V, K, 1.0f, w->Qg, K, 1, S, V, O, ldo, 0);
        lm_gemm_small(c, V, c, 1.0f, w->Aqk, C, 1, w->Vn, V, O, ldo, 1);
    }
    for (int d = 0; d < K; d++) {
        float gm = w->gam[d];
        float *s = S + (size_t)d * V;
        for (int v = 0; v < V; v++) s[v] *= gm;
    }
    lm_gemm_small(K, V, c, 1.0f, w->Kd, 1, K, w->Vn, V, S, V, 1);
}

/* Gather chunk rows [t0, t0+c) of task (h, hv) into the workspace: the value
 * columns [v0, v0 + w->V) of the cf->V of a head. */
static void gather(ws_t *w, const lm_kda_config *cf, const lm_kda_prep *p, const float *v,
                   int64_t t0, int c, int h, int hv, int v0) {
    const int K = w->K, V = w->V, H = cf->H, HV = cf->HV, VF = cf->V;
    for (int r = 0; r < c; r++) {
        int64_t t = t0 + r;
        memcpy(w->Q + (size_t)r * K, p->qs + (t * H + h) * K, sizeof(float) * K);
        memcpy(w->Kc + (size_t)r * K, p->kn + (t * H + h) * K, sizeof(float) * K);
        const float *gsrc = p->gk + (t * HV + hv) * K;
        double *gdst = w->G + (size_t)r * K;
        for (int d = 0; d < K; d++) gdst[d] = gsrc[d];
        memcpy(w->Vc + (size_t)r * V, v + (t * HV + hv) * VF + v0, sizeof(float) * V);
        w->beta[r] = p->beta[t * HV + hv];
    }
}

int lm_kda_use_shared_diag(const lm_kda_config *c) {
    if (c->diag == LM_DIAG_SHARED) return 1;
    if (c->diag == LM_DIAG_SAFE) return 0;
    return c->gate == LM_GATE_BOUNDED || (c->gate == LM_GATE_NONE && c->has_lower_bound);
}

/* Value-column blocks per (sequence, value head) task of the forward. The state
 * recurrence is sequential over chunks but independent per value column (Vn = U - W S,
 * O = Qg S + Aqk Vn and S <- gamma S + Kd^T Vn act column by column on S, U and Vn), so
 * when there are fewer tasks than threads (B * HV = 4 at the bench shape [1,4096,4,128],
 * which left all but 4 threads idle on a 16-core machine) each task splits its V
 * columns into nvb blocks of a multiple of 32 columns. A block recomputes the chunk's
 * V-independent part (Aqk, P, the UT inverse, W: about a quarter of the forward's
 * FLOPs at K = V = 128, C = 64), so the split is only taken while threads would idle.
 * Every output element is computed by the same operations in the same order for any
 * nvb (the small GEMM sums over its inner dimension in order, in 32-column panels),
 * so results stay bitwise independent of the thread count. */
static int fwd_value_blocks(int ntask, int V, int threads) {
    int nvb = 1;
    while (ntask * nvb < threads && V % (64 * nvb) == 0)
        nvb *= 2;
    return nvb;
}

lm_status lm_kda_chunk_forward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_outputs *out,
                               lm_error *err) {
    LM_TRY(lm_kda_validate(c, in, err));
    if (!out || !out->o) return lm_errorf(err, LM_ERR_INVALID, "kda: output 'o' is required");
    lm_kda_prep p;
    LM_TRY(lm_kda_prep_forward(c, in, &p, err));
    const int K = c->K, V = c->V, HV = c->HV, C = c->chunk_size, grp = c->HV / c->H;
    const int shared = lm_kda_use_shared_diag(c);
    const int ntask = c->N * HV;
    const int nvb = fwd_value_blocks(ntask, V, omp_get_max_threads()), Vb = V / nvb;
    const int njob = ntask * nvb;
#pragma omp parallel
    {
        const unsigned fp = lm_kda_fp_enter(); /* FTZ/DAZ (kda_cpu.h), restored below */
        ws_t w;
        ws_init(&w, c->ws, C, K, Vb, 0);
        float *S = lm_kda_ws_get(c->ws, lm_kda_ws_thread_slot(1), sizeof(float) * (size_t)K * Vb);
#pragma omp for schedule(dynamic, 1)
        for (int job = 0; job < njob; job++) {
            const int task = job / nvb, v0 = (job % nvb) * Vb;
            int n = task / HV, hv = task % HV, h = hv / grp;
            /* S [K, Vb]: columns v0 .. v0+Vb of the task's [K, V] state */
            for (int d = 0; d < K; d++) {
                float *sr = S + (size_t)d * Vb;
                if (in->initial_state)
                    memcpy(sr, in->initial_state + ((size_t)task * K + d) * V + v0,
                           sizeof(float) * Vb);
                else
                    memset(sr, 0, sizeof(float) * Vb);
            }
            int64_t bos = p.bos[n], len = p.len[n];
            for (int64_t c0 = 0; c0 < len; c0 += C) {
                int cl = (int)(len - c0 < C ? len - c0 : C);
                gather(&w, c, &p, in->v, bos + c0, cl, h, hv, v0);
                chunk_intra(&w, cl, shared);
                chunk_state(&w, cl, S, out->o + ((bos + c0) * HV + hv) * V + v0, (ptrdiff_t)HV * V);
            }
            if (out->final_state)
                for (int d = 0; d < K; d++)
                    memcpy(out->final_state + ((size_t)task * K + d) * V + v0, S + (size_t)d * Vb,
                           sizeof(float) * Vb);
        }
        lm_kda_ws_put(c->ws, lm_kda_ws_thread_slot(1), S);
        ws_free(&w, c->ws);
        lm_kda_fp_leave(fp);
    }
    lm_kda_prep_free(&p);
    return LM_OK;
}

/* ------------------------------------------------------------------------ */
/* Backward of the pair products for rows [r0,r0+L), columns [c0,c1), factors */
/* relative to row `ref` (mirrors tile_fwd):                                  */
/*   Aqk[r,i] = sum_d (q_r e^{G_r-G_n})_d (k_i e^{G_n-G_i})_d, P likewise with k_r */
static void tile_bwd(ws_t *w, int r0, int L, int c0, int c1, int ref) {
    const int K = w->K, C = w->C, nc = c1 - c0;
    const double *Gref = w->G + (size_t)ref * K;
    float *Xq = w->X, *Xk = w->X + (size_t)L * K;
    scaled_rows(L, K, w->Q + (size_t)r0 * K, K, w->G + (size_t)r0 * K, K, Gref, +1.0f, Xq, K,
                w->Er, K);
    scaled_rows(L, K, w->Kc + (size_t)r0 * K, K, w->G + (size_t)r0 * K, K, Gref, +1.0f, Xk, K,
                NULL, 0);
    scaled_rows(nc, K, w->Kc + (size_t)c0 * K, K, w->G + (size_t)c0 * K, K, Gref, -1.0f, w->Z, K,
                w->Ec, K);
    const float *dAq = w->dAqk + (size_t)r0 * C + c0, *dPk = w->dP + (size_t)r0 * C + c0;
    /* rows: d(Xq) = dAqk Z, d(Xk) = dP Z, then times the row factor */
    lm_gemm_small(L, K, nc, 1.0f, dAq, C, 1, w->Z, K, w->T1, K, 0);
    lm_gemm_small(L, K, nc, 1.0f, dPk, C, 1, w->Z, K, w->T1 + (size_t)L * K, K, 0);
    for (int r = 0; r < L; r++) {
        float *dq = w->dQp + (size_t)(r0 + r) * K, *dk = w->dKr + (size_t)(r0 + r) * K;
        const float *e = w->Er + (size_t)r * K, *tq = w->T1 + (size_t)r * K;
        const float *tk = w->T1 + (size_t)(L + r) * K;
        for (int d = 0; d < K; d++) {
            dq[d] += tq[d] * e[d];
            dk[d] += tk[d] * e[d];
        }
    }
    /* columns: dZ = dAqk^T Xq + dP^T Xk, then times the column factor */
    lm_gemm_small(nc, K, L, 1.0f, dAq, 1, C, Xq, K, w->dZ, K, 0);
    lm_gemm_small(nc, K, L, 1.0f, dPk, 1, C, Xk, K, w->dZ, K, 1);
    for (int i = 0; i < nc; i++) {
        float *dk = w->dKc + (size_t)(c0 + i) * K;
        const float *e = w->Ec + (size_t)i * K, *t = w->dZ + (size_t)i * K;
        for (int d = 0; d < K; d++) dk[d] += t[d] * e[d];
    }
}

static void tile_bwd_safe_diag(ws_t *w, int r0, int L) {
    const int K = w->K, C = w->C;
    for (int r = 0; r < L; r++) {
        const double *gr = w->G + (size_t)(r0 + r) * K;
        const float *qr = w->Q + (size_t)(r0 + r) * K, *kr = w->Kc + (size_t)(r0 + r) * K;
        float *dqr = w->dQp + (size_t)(r0 + r) * K, *dkr = w->dKr + (size_t)(r0 + r) * K;
        for (int i = 0; i <= r; i++) {
            float aq = w->dAqk[(size_t)(r0 + r) * C + r0 + i];
            float ap = i < r ? w->dP[(size_t)(r0 + r) * C + r0 + i] : 0.0f;
            if (aq == 0.0f && ap == 0.0f) continue;
            const double *gi = w->G + (size_t)(r0 + i) * K;
            const float *ki = w->Kc + (size_t)(r0 + i) * K;
            float *dki = w->dKc + (size_t)(r0 + i) * K;
#pragma omp simd
            for (int d = 0; d < K; d++) {
                float e = lm_fexp((float)(gr[d] - gi[d]));
                dqr[d] += aq * ki[d] * e;
                dkr[d] += ap * ki[d] * e;
                dki[d] += (aq * qr[d] + ap * kr[d]) * e;
            }
        }
    }
}

/* One chunk of the backward. In: workspace after chunk_intra, S0 (state at chunk
 * start), dS (gradient w.r.t. the state after the chunk), dO gathered in w->dO.
 * Out: dS <- gradient w.r.t. S0; w->dQp (dq), w->dKr (dk), w->dBv (dv),
 * w->dG (dg, per channel, after the reverse cumsum), w->dbeta. */
static void chunk_backward(ws_t *w, int c, int shared, const float *S0, float *dS) {
    const int K = w->K, V = w->V, C = w->C;
    /* recompute v_new */
    for (int r = 0; r < c; r++) memcpy(w->Vn + (size_t)r * V, w->U + (size_t)r * V, sizeof(float) * V);
    lm_gemm_small(c, V, K, -1.0f, w->W, K, 1, S0, V, w->Vn, V, 1);
    /* O = Qg S0 + Aqk Vn;  S1 = gam S0 + Kd^T Vn */
    lm_gemm_small(c, V, c, 1.0f, w->Aqk, 1, C, w->dO, V, w->dVn, V, 0);  /* Aqk^T dO */
    lm_gemm_small(c, V, K, 1.0f, w->Kd, K, 1, dS, V, w->dVn, V, 1);      /* + Kd dS1 */
    lm_gemm_small_nt(c, c, V, 1.0f, w->dO, V, w->Vn, V, w->dAqk, C, 0, w->pack); /* dO Vn^T */
    for (int r = 0; r < c; r++)
        for (int i = r + 1; i < C; i++) w->dAqk[(size_t)r * C + i] = 0.0f;
    for (int d = 0; d < K; d++)
        for (int v = 0; v < V; v++) w->S0T[(size_t)v * K + d] = S0[(size_t)d * V + v];
    lm_gemm_small(c, K, V, 1.0f, w->dO, V, 1, w->S0T, K, w->dQg, K, 0);      /* dO S0^T */
    lm_gemm_small_nt(c, K, V, 1.0f, w->Vn, V, dS, V, w->dKd, K, 0, w->pack); /* Vn dS1^T */
    for (int d = 0; d < K; d++) {
        double s = 0;
        for (int v = 0; v < V; v++) s += (double)S0[(size_t)d * V + v] * dS[(size_t)d * V + v];
        w->dgam[d] = (float)s;
    }
    /* Vn = U - W S0 */
    lm_gemm_small(c, K, V, -1.0f, w->dVn, V, 1, w->S0T, K, w->dW, K, 0);     /* dW = -dVn S0^T */
    /* dS0 = gam dS1 + Qg^T dO - W^T dVn */
    for (int d = 0; d < K; d++)
        for (int v = 0; v < V; v++) w->dSn[(size_t)d * V + v] = w->gam[d] * dS[(size_t)d * V + v];
    lm_gemm_small(K, V, c, 1.0f, w->Qg, 1, K, w->dO, V, w->dSn, V, 1);
    lm_gemm_small(K, V, c, -1.0f, w->W, 1, K, w->dVn, V, w->dSn, V, 1);
    memcpy(dS, w->dSn, sizeof(float) * (size_t)K * V);
    /* U = Tm Bv, W = Tm Bk */
    lm_gemm_small_nt(c, c, V, 1.0f, w->dVn, V, w->Bv, V, w->dTm, C, 0, w->pack);
    lm_gemm_small_nt(c, c, K, 1.0f, w->dW, K, w->Bk, K, w->dTm, C, 1, w->pack);
    lm_gemm_small(c, V, c, 1.0f, w->Tm, 1, C, w->dVn, V, w->dBv, V, 0); /* Tm^T dU */
    lm_gemm_small(c, K, c, 1.0f, w->Tm, 1, C, w->dW, K, w->dBk, K, 0);  /* Tm^T dW */
    for (int r = 0; r < c; r++) {
        float b = w->beta[r];
        double db = 0;
        for (int v = 0; v < V; v++) {
            float g = w->dBv[(size_t)r * V + v];
            db += (double)w->Vc[(size_t)r * V + v] * g;
            w->dBv[(size_t)r * V + v] = b * g; /* dv */
        }
        for (int d = 0; d < K; d++) db += (double)w->Kg[(size_t)r * K + d] * w->dBk[(size_t)r * K + d];
        w->dbeta[r] = (float)db;
    }
    /* Tm = (I + Ab)^-1:  dAb = -Tm^T dTm Tm^T (strictly lower part) */
    lm_gemm_small_nt(c, c, c, 1.0f, w->dTm, C, w->Tm, C, w->T1, C, 0, w->pack);
    lm_gemm_small(c, c, c, -1.0f, w->Tm, 1, C, w->T1, C, w->dA, C, 0);
    /* Ab = diag(beta) P */
    for (int r = 0; r < c; r++) {
        double db = 0;
        float b = w->beta[r];
        for (int i = 0; i < C; i++) {
            size_t o = (size_t)r * C + i;
            float a = i < r ? w->dA[o] : 0.0f;
            db += (double)a * w->P[o];
            w->dP[o] = b * a;
        }
        w->dbeta[r] += (float)db;
    }
    /* pair products */
    for (int r = 0; r < c; r++) {
        memset(w->dQp + (size_t)r * K, 0, sizeof(float) * K);
        memset(w->dKr + (size_t)r * K, 0, sizeof(float) * K);
        memset(w->dKc + (size_t)r * K, 0, sizeof(float) * K);
    }
    for (int r0 = 0; r0 < c; r0 += BC) {
        int L = c - r0 < BC ? c - r0 : BC;
        if (r0 > 0) tile_bwd(w, r0, L, 0, r0, r0);
        if (shared) { /* the forward's three pieces */
            const int h = L < BH ? L : BH;
            tile_bwd(w, r0, h, r0, r0 + h, r0);
            if (L > h) {
                tile_bwd(w, r0 + h, L - h, r0, r0 + h, r0 + h);
                tile_bwd(w, r0 + h, L - h, r0 + h, r0 + L, r0 + h);
            }
        } else
            tile_bwd_safe_diag(w, r0, L);
    }
    /* assemble dq, dk, dG; then dg = reverse cumsum of dG */
    float *dGl = w->dgam; /* reuse: gradient w.r.t. G_last */
    for (int d = 0; d < K; d++) dGl[d] *= w->gam[d];
    for (int r = 0; r < c; r++) {
        size_t o = (size_t)r * K;
        float bt = w->beta[r];
#pragma omp simd
        for (int d = 0; d < K; d++) {
            float dkg = bt * w->dBk[o + d]; /* Bk = beta Kg */
            float q = w->Q[o + d], k = w->Kc[o + d];
            float dq = w->dQp[o + d], dkr = w->dKr[o + d], dkc = w->dKc[o + d];
            float dqg = w->dQg[o + d], dkd = w->dKd[o + d];
            w->dG[o + d] = q * dq + k * dkr - k * dkc + dqg * w->Qg[o + d] + dkg * w->Kg[o + d] -
                           dkd * w->Kd[o + d];
            dGl[d] += dkd * w->Kd[o + d];
            w->dQp[o + d] = dq + dqg * w->eG[o + d];
            w->dKr[o + d] = dkr + dkc + dkg * w->eG[o + d] + dkd * w->eGd[o + d];
        }
    }
    for (int d = 0; d < K; d++) w->dG[(size_t)(c - 1) * K + d] += dGl[d];
    for (int r = c - 2; r >= 0; r--)
        for (int d = 0; d < K; d++) w->dG[(size_t)r * K + d] += w->dG[(size_t)(r + 1) * K + d];
    /* A token whose decay underflows (g < -87.33: lm_fexp flushes e^g to 0) cuts every
     * product that spans it to exactly 0, so the forward does not depend on its g:
     * the derivative is exactly 0. The reverse cumsum above would instead leave the
     * rounding residue of terms that cancel, which a gate derivative like
     * dA_log = sum(dg * g) multiplies by |g| >= 87. */
    for (int r = 0; r < c; r++) {
        for (int d = 0; d < K; d++) {
            double gr = w->G[(size_t)r * K + d] - (r > 0 ? w->G[(size_t)(r - 1) * K + d] : 0.0);
            if (gr < -87.33) w->dG[(size_t)r * K + d] = 0.0f;
        }
    }
}

lm_status lm_kda_chunk_backward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_grads *gr,
                                lm_error *err) {
    LM_TRY(lm_kda_validate(c, in, err));
    if (!gr || !gr->do_) return lm_errorf(err, LM_ERR_INVALID, "kda backward: 'do' is required");
    for (int64_t i = 0, n = (int64_t)c->B * c->T * c->HV * c->V; i < n; i++)
        if (!isfinite(gr->do_[i]))
            return lm_errorf(err, LM_ERR_NONFINITE,
                             "kda backward: 'do' has a non-finite value %g at element %lld",
                             (double)gr->do_[i], (long long)i);
    if (gr->dht)
        for (int64_t i = 0, n = (int64_t)c->N * c->HV * c->K * c->V; i < n; i++)
            if (!isfinite(gr->dht[i]))
                return lm_errorf(err, LM_ERR_NONFINITE,
                                 "kda backward: 'dht' has a non-finite value %g at element %lld",
                                 (double)gr->dht[i], (long long)i);
    lm_kda_prep p;
    LM_TRY(lm_kda_prep_forward(c, in, &p, err));
    const int K = c->K, V = c->V, HV = c->HV, C = c->chunk_size, grp = c->HV / c->H;
    const int64_t BT = (int64_t)c->B * c->T;
    const int shared = lm_kda_use_shared_diag(c);
    const int ntask = c->N * HV;
    int64_t maxlen = 0;
    for (int n = 0; n < c->N; n++) maxlen = p.len[n] > maxlen ? p.len[n] : maxlen;
    const int64_t maxnt = (maxlen + C - 1) / C;
    /* every row of these is written by exactly one task (cu_seqlens covers [0, T)) */
    float *dqs = lm_kda_ws_get(c->ws, LM_WS_DQS, sizeof(float) * (size_t)(BT * HV * K));
    float *dkn = lm_kda_ws_get(c->ws, LM_WS_DKN, sizeof(float) * (size_t)(BT * HV * K));
    float *dgk = lm_kda_ws_get(c->ws, LM_WS_DGK, sizeof(float) * (size_t)(BT * HV * K));
    float *dbeta = lm_kda_ws_get(c->ws, LM_WS_DBETA, sizeof(float) * (size_t)(BT * HV));
#pragma omp parallel
    {
        const unsigned fp = lm_kda_fp_enter(); /* FTZ/DAZ (kda_cpu.h), restored below */
        ws_t w;
        ws_init(&w, c->ws, C, K, V, 1);
        float *Hs = lm_kda_ws_get(c->ws, lm_kda_ws_thread_slot(1),
                                  sizeof(float) * (size_t)((maxnt + 1) * K * V));
        float *dS = lm_kda_ws_get(c->ws, lm_kda_ws_thread_slot(2), sizeof(float) * (size_t)K * V);
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < ntask; task++) {
            int n = task / HV, hv = task % HV, h = hv / grp;
            int64_t bos = p.bos[n], len = p.len[n];
            int64_t nt = (len + C - 1) / C;
            /* pass 1: states at every chunk start */
            if (in->initial_state)
                memcpy(Hs, in->initial_state + (size_t)task * K * V, sizeof(float) * K * V);
            else
                memset(Hs, 0, sizeof(float) * K * V);
            for (int64_t j = 0; j < nt; j++) {
                int64_t c0 = j * C;
                int cl = (int)(len - c0 < C ? len - c0 : C);
                memcpy(Hs + (size_t)(j + 1) * K * V, Hs + (size_t)j * K * V, sizeof(float) * K * V);
                gather(&w, c, &p, in->v, bos + c0, cl, h, hv, 0);
                chunk_intra(&w, cl, shared);
                chunk_state(&w, cl, Hs + (size_t)(j + 1) * K * V, NULL, 0);
            }
            /* pass 2: reverse over chunks */
            if (gr->dht)
                memcpy(dS, gr->dht + (size_t)task * K * V, sizeof(float) * K * V);
            else
                memset(dS, 0, sizeof(float) * K * V);
            for (int64_t j = nt - 1; j >= 0; j--) {
                int64_t c0 = j * C, t0 = bos + c0;
                int cl = (int)(len - c0 < C ? len - c0 : C);
                gather(&w, c, &p, in->v, t0, cl, h, hv, 0);
                for (int r = 0; r < cl; r++)
                    memcpy(w.dO + (size_t)r * V, gr->do_ + ((t0 + r) * HV + hv) * V, sizeof(float) * V);
                chunk_intra(&w, cl, shared);
                chunk_backward(&w, cl, shared, Hs + (size_t)j * K * V, dS);
                for (int r = 0; r < cl; r++) {
                    int64_t row = (t0 + r) * HV + hv;
                    memcpy(dqs + row * K, w.dQp + (size_t)r * K, sizeof(float) * K);
                    memcpy(dkn + row * K, w.dKr + (size_t)r * K, sizeof(float) * K);
                    memcpy(dgk + row * K, w.dG + (size_t)r * K, sizeof(float) * K);
                    if (gr->dv) memcpy(gr->dv + row * V, w.dBv + (size_t)r * V, sizeof(float) * V);
                    dbeta[row] = w.dbeta[r];
                }
            }
            if (gr->dh0) memcpy(gr->dh0 + (size_t)task * K * V, dS, sizeof(float) * K * V);
        }
        lm_kda_ws_put(c->ws, lm_kda_ws_thread_slot(2), dS);
        lm_kda_ws_put(c->ws, lm_kda_ws_thread_slot(1), Hs);
        ws_free(&w, c->ws);
        lm_kda_fp_leave(fp);
    }
    lm_kda_prep_backward(c, in, &p, dqs, dkn, dbeta, dgk, gr);
    lm_kda_ws_put(c->ws, LM_WS_DQS, dqs);
    lm_kda_ws_put(c->ws, LM_WS_DKN, dkn);
    lm_kda_ws_put(c->ws, LM_WS_DGK, dgk);
    lm_kda_ws_put(c->ws, LM_WS_DBETA, dbeta);
    lm_kda_prep_free(&p);
    return LM_OK;
}
