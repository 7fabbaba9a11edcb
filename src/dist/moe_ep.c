/* The expert-parallel MoE layer of include/linmoe/moe_ep.h: routing on the group's
 * gathered logits, the dispatch / return all-to-alls, the experts' SwiGLU (the GEMM
 * sequence of src/ops/cpu/moe_experts.c, so a segment gives the same bits as on one
 * process), and the backward in reverse. */
#include "linmoe/moe_ep.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/moe_cpu.h"

#define ROWS 256 /* token rows per GEMM block (moe_cpu.h MOE_ROW_BLOCK) */

struct lm_moe_ep {
    lm_moe_config c;
    lm_comm *comm;  /* the EP group: dispatch and experts */
    lm_comm *rcomm; /* the routed batch's ranks (comm, or a larger group holding it) */
    int P, p, R, rr, E, El, e0, k, d, f, fs, max_T;
    float aux_scale;
    /* last forward */
    int T, have_fwd;
    int64_t Tg, off, M;
    lm_route route;         /* over the group's Tg tokens */
    int64_t *Tr, *toff;     /* [R] tokens per rank of rcomm, [R+1] their offsets */
    float *logits_l;        /* [max_T, E] */
    float *logits_g;        /* [R*max_T, E]; backward: dlogits of the routed batch */
    int64_t *cu_g, *ncu;    /* [R*(max_T+1)], [R] */
    int32_t *send_slot;     /* [max_T*k] send row -> local assignment t*k+j */
    int32_t *row_of;        /* [max_T*k] local assignment -> send row, -1 dropped */
    int64_t *cnt_s, *cnt_r; /* [E] rows to expert e / [P*El] rows from rank s for local l */
    int64_t *sc, *rc, *scn, *rcn, *ones; /* [P] rows sent / received, element counts */
    int64_t *seg;                        /* [El+1] compute-row segments of the local experts */
    int32_t *crow;                       /* [P*max_T*k] compute row -> receive row */
    float *sbuf;                         /* [max_T*k, d+1] send rows (dispatch), returned rows */
    float *rbuf;                         /* [P*max_T*k, d+1] receive rows, rows to return */
    float *xp, *H, *A, *Y, *G, *dH;      /* per compute row: d, 2f, f, d, f, 2f */
    float *Hs, *As, *Gs, *dHs;           /* shared experts per local token */
    float *dw_l, *dw_g;                  /* [max_T*k], [R*max_T*k] */
    void *mem;
};

int lm_moe_ep_first_expert(const lm_moe_ep *l) { return l ? l->e0 : 0; }
int lm_moe_ep_num_local(const lm_moe_ep *l) { return l ? l->El : 0; }
void lm_moe_ep_set_aux_scale(lm_moe_ep *l, float s) {
    if (l && isfinite(s))
        l->aux_scale = s;
}
const lm_route *lm_moe_ep_route(const lm_moe_ep *l) { return l && l->have_fwd ? &l->route : NULL; }
int64_t lm_moe_ep_token_offset(const lm_moe_ep *l) { return l ? l->off : 0; }

lm_status lm_moe_ep_new(lm_moe_ep **out, const lm_moe_config *c, lm_comm *ep, lm_comm *route,
                        int max_tokens, lm_error *err) {
    if (!out || !ep)
        return lm_errorf(err, LM_ERR_INVALID, "moe_ep: NULL argument");
    *out = NULL;
    if (!route)
        route = ep;
    lm_status st = lm_moe_config_validate(c, err);
    const int P = lm_comm_size(ep), R = lm_comm_size(route);
    if (st == LM_OK && R % P != 0)
        st = lm_errorf(err, LM_ERR_INVALID,
                       "moe_ep: the routing group of %d ranks is not a multiple of the "
                       "expert-parallel group of %d",
                       R, P);
    if (st == LM_OK && c->router.num_experts % P != 0)
        st = lm_errorf(err, LM_ERR_INVALID,
                       "moe_ep: num_experts = %d is not divisible by the expert-parallel size %d",
                       c->router.num_experts, P);
    if (st == LM_OK && max_tokens < 1)
        st = lm_errorf(err, LM_ERR_INVALID, "moe_ep: max_tokens = %d (must be >= 1)", max_tokens);
    LM_TRY(lm_comm_agree(route, st, err));
    int64_t mt = max_tokens;
    LM_TRY(lm_comm_allreduce(route, &mt, 1, LM_I64, LM_DIST_MAX, err));
    lm_moe_ep *l = LM_CALLOC(1, sizeof *l);
    l->c = *c;
    l->comm = ep;
    l->rcomm = route;
    l->P = P;
    l->p = lm_comm_rank(ep);
    l->R = R;
    l->rr = lm_comm_rank(route);
    l->E = c->router.num_experts;
    l->El = l->E / P;
    l->e0 = l->p * l->El;
    l->k = c->router.num_experts_per_tok;
    l->d = c->hidden_size;
    l->f = c->moe_intermediate_size;
    l->fs = c->n_shared_experts * c->moe_intermediate_size;
    l->max_T = (int)mt;
    l->aux_scale = 1.0f;
    const size_t T = (size_t)mt, E = (size_t)l->E, k = (size_t)l->k, d = (size_t)l->d,
                 f = (size_t)l->f, fs = (size_t)l->fs, Pz = (size_t)P, El = (size_t)l->El,
                 Rz = (size_t)R;
    const size_t Mx = Pz * T * k; /* rows this rank's experts may receive */
    struct {
        void **p;
        size_t bytes;
    } tab[] = {
        {(void **)&l->Tr, 8 * Rz},
        {(void **)&l->toff, 8 * (Rz + 1)},
        {(void **)&l->logits_l, 4 * T * E},
        {(void **)&l->logits_g, 4 * Rz * T * E},
        {(void **)&l->cu_g, 8 * (Rz * (T + 1) + 1)},
        {(void **)&l->ncu, 8 * Rz},
        {(void **)&l->send_slot, 4 * T * k},
        {(void **)&l->row_of, 4 * T * k},
        {(void **)&l->cnt_s, 8 * E},
        {(void **)&l->cnt_r, 8 * Pz * El},
        {(void **)&l->sc, 8 * Pz},
        {(void **)&l->rc, 8 * Pz},
        {(void **)&l->scn, 8 * Pz},
        {(void **)&l->rcn, 8 * Pz},
        {(void **)&l->ones, 8 * Rz},
        {(void **)&l->seg, 8 * (El + 1)},
        {(void **)&l->crow, 4 * Mx},
        {(void **)&l->sbuf, 4 * T * k * (d + 1)},
        {(void **)&l->rbuf, 4 * Mx * (d + 1)},
        {(void **)&l->xp, 4 * Mx * d},
        {(void **)&l->H, 4 * Mx * 2 * f},
        {(void **)&l->A, 4 * Mx * f},
        {(void **)&l->Y, 4 * Mx * d},
        {(void **)&l->G, 4 * Mx * f},
        {(void **)&l->dH, 4 * Mx * 2 * f},
        {(void **)&l->Hs, 4 * T * 2 * fs},
        {(void **)&l->As, 4 * T * fs},
        {(void **)&l->Gs, 4 * T * fs},
        {(void **)&l->dHs, 4 * T * 2 * fs},
        {(void **)&l->dw_l, 4 * T * k},
        {(void **)&l->dw_g, 4 * Rz * T * k},
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        total += (tab[i].bytes + 63) / 64 * 64;
    l->mem = aligned_alloc(64, total);
    if (!l->mem) {
        free(l);
        return lm_errorf(err, LM_ERR_NOMEM, "moe_ep: out of memory (%zu bytes)", total);
    }
    unsigned char *q = l->mem;
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        *tab[i].p = q;
        q += (tab[i].bytes + 63) / 64 * 64;
    }
    for (int r = 0; r < R; r++)
        l->ones[r] = 1;
    *out = l;
    return LM_OK;
}

void lm_moe_ep_free(lm_moe_ep *l) {
    if (!l)
        return;
    lm_route_free(&l->route);
    free(l->mem);
    free(l);
}

static lm_status check_weights(const lm_moe_ep *l, const lm_moe_weights *w, lm_error *err) {
    if (!w)
        return lm_errorf(err, LM_ERR_INVALID, "moe_ep: weights are required");
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
        if (!w->p[i] && (i < LM_MOE_SHARED_GATE_PROJ || l->fs > 0))
            return lm_errorf(err, LM_ERR_INVALID, "moe_ep: weight '%s' is NULL",
                             lm_moe_weight_name((lm_moe_weight_id)i));
    return LM_OK;
}

/* One local expert's forward over its compute rows (moe_experts.c expert_forward). */
static void expert_fwd(lm_moe_ep *l, const lm_moe_weights *w, int el) {
    const int d = l->d, f = l->f;
    const int64_t r0 = l->seg[el];
    const int m = (int)(l->seg[el + 1] - r0);
    if (m == 0)
        return;
    const float *Wg = w->p[LM_MOE_EXPERTS_GATE_PROJ] + (int64_t)el * f * d;
    const float *Wu = w->p[LM_MOE_EXPERTS_UP_PROJ] + (int64_t)el * f * d;
    const float *Wd = w->p[LM_MOE_EXPERTS_DOWN_PROJ] + (int64_t)el * d * f;
    float *xp = l->xp + r0 * d, *H = l->H + r0 * 2 * f, *A = l->A + r0 * f, *Y = l->Y + r0 * d;
    for (int r = 0; r < m; r++)
        memcpy(xp + (int64_t)r * d, l->rbuf + (int64_t)l->crow[r0 + r] * d,
               (size_t)d * sizeof(float));
    lm_sgemm(0, 1, m, f, d, 1.0f, xp, d, Wg, d, 0.0f, H, 2 * f);
    lm_sgemm(0, 1, m, f, d, 1.0f, xp, d, Wu, d, 0.0f, H + f, 2 * f);
    lm_moe_cpu_swiglu_fwd(m, f, H, 2 * f, A, f);
    lm_sgemm(0, 1, m, d, f, 1.0f, A, f, Wd, f, 0.0f, Y, d);
}

/* One local expert's backward (moe_experts.c expert_backward): reads [dout | w] rows
 * from rbuf (width d+1), writes [dx_e | dw] rows back there. */
static void expert_bwd(lm_moe_ep *l, const lm_moe_weights *w, lm_moe_grads *g, int el) {
    const int d = l->d, f = l->f;
    const int64_t r0 = l->seg[el];
    const int m = (int)(l->seg[el + 1] - r0);
    float *dWg = g->p[LM_MOE_EXPERTS_GATE_PROJ], *dWu = g->p[LM_MOE_EXPERTS_UP_PROJ];
    float *dWd = g->p[LM_MOE_EXPERTS_DOWN_PROJ];
    if (dWg)
        dWg += (int64_t)el * f * d;
    if (dWu)
        dWu += (int64_t)el * f * d;
    if (dWd)
        dWd += (int64_t)el * d * f;
    if (m == 0) {
        if (dWg)
            memset(dWg, 0, sizeof(float) * (size_t)f * d);
        if (dWu)
            memset(dWu, 0, sizeof(float) * (size_t)f * d);
        if (dWd)
            memset(dWd, 0, sizeof(float) * (size_t)d * f);
        return;
    }
    const float *Wg = w->p[LM_MOE_EXPERTS_GATE_PROJ] + (int64_t)el * f * d;
    const float *Wu = w->p[LM_MOE_EXPERTS_UP_PROJ] + (int64_t)el * f * d;
    const float *Wd = w->p[LM_MOE_EXPERTS_DOWN_PROJ] + (int64_t)el * d * f;
    const float *xp = l->xp + r0 * d, *H = l->H + r0 * 2 * f, *A = l->A + r0 * f;
    float *D = l->Y + r0 * d, *G = l->G + r0 * f, *dH = l->dH + r0 * 2 * f;
    for (int r = 0; r < m; r++)
        memcpy(D + (int64_t)r * d, l->rbuf + (int64_t)l->crow[r0 + r] * (d + 1),
               (size_t)d * sizeof(float));
    lm_sgemm(0, 0, m, f, d, 1.0f, D, d, Wd, f, 0.0f, G, f);
    for (int r = 0; r < m; r++) {
        float *rb = l->rbuf + (int64_t)l->crow[r0 + r] * (d + 1);
        const float wt = rb[d];
        float *restrict gr = G + (int64_t)r * f, *restrict dr = D + (int64_t)r * d;
        const float *restrict ar = A + (int64_t)r * f;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int c = 0; c < f; c++)
            s += gr[c] * ar[c];
        rb[d] = s; /* d w of this assignment, returned with the dx row */
#pragma omp simd
        for (int c = 0; c < f; c++)
            gr[c] *= wt;
#pragma omp simd
        for (int c = 0; c < d; c++)
            dr[c] *= wt;
    }
    if (dWd)
        lm_sgemm(1, 0, d, f, m, 1.0f, D, d, A, f, 0.0f, dWd, f);
    lm_moe_cpu_swiglu_bwd(m, f, H, 2 * f, G, f, dH, 2 * f);
    if (dWg)
        lm_sgemm(1, 0, f, d, m, 1.0f, dH, 2 * f, xp, d, 0.0f, dWg, d);
    if (dWu)
        lm_sgemm(1, 0, f, d, m, 1.0f, dH + f, 2 * f, xp, d, 0.0f, dWu, d);
    lm_sgemm(0, 0, m, d, f, 1.0f, dH, 2 * f, Wg, d, 0.0f, D, d);
    lm_sgemm(0, 0, m, d, f, 1.0f, dH + f, 2 * f, Wu, d, 1.0f, D, d);
    for (int r = 0; r < m; r++)
        memcpy(l->rbuf + (int64_t)l->crow[r0 + r] * (d + 1), D + (int64_t)r * d,
               (size_t)d * sizeof(float));
}

/* Run fn over the local experts in parallel, single-threaded BLAS (as moe_experts.c). */
#define EXPERTS_PARALLEL(l, call)                                                                  \
    do {                                                                                           \
        const int blas0_ = lm_blas_get_threads();                                                  \
        lm_blas_set_threads(1);                                                                    \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int el = 0; el < (l)->El; el++)      \
            call;                                                                                  \
        lm_blas_set_threads(blas0_);                                                               \
    } while (0)

lm_status lm_moe_ep_forward(lm_moe_ep *l, const lm_moe_weights *w, lm_router_state *st,
                            const float *x, int T, const int64_t *cu_seqlens, int n_cu,
                            int training, float *out, lm_error *err) {
    if (!l)
        return lm_errorf(err, LM_ERR_INVALID, "moe_ep: layer is required");
    lm_status v = LM_OK;
    if (T < 0 || T > l->max_T)
        v = lm_errorf(err, LM_ERR_INVALID, "moe_ep: T = %d tokens is outside [0, max_tokens = %d]",
                      T, l->max_T);
    else if (T > 0 && (!x || !out))
        v = lm_errorf(err, LM_ERR_INVALID, "moe_ep: %s is NULL", !x ? "x" : "out");
    else if (!st || st->E != l->E)
        v = lm_errorf(err, LM_ERR_INVALID, "moe_ep: router state missing or of the wrong size");
    else if (cu_seqlens &&
             (n_cu < 2 || n_cu > l->max_T + 1 || cu_seqlens[0] != 0 || cu_seqlens[n_cu - 1] != T))
        v = lm_errorf(err, LM_ERR_INVALID,
                      "moe_ep: cu_seqlens (%d bounds) must run from 0 to T = %d in at most "
                      "max_tokens + 1 bounds",
                      n_cu, T);
    if (v == LM_OK)
        v = check_weights(l, w, err);
    for (int64_t i = 0; v == LM_OK && i < (int64_t)T * l->d; i++)
        if (!isfinite(x[i]))
            v = lm_errorf(
                err, LM_ERR_NONFINITE,
                "moe_ep: input 'x' has a non-finite value (%g) at token %lld, channel %lld",
                (double)x[i], (long long)(i / l->d), (long long)(i % l->d));
    LM_TRY(lm_comm_agree(l->rcomm, v, err));
    l->have_fwd = 0;
    const int P = l->P, R = l->R, E = l->E, El = l->El, k = l->k, d = l->d, f = l->f;
    (void)f;
    /* 1. tokens per rank of the routed batch, local logits */
    l->Tr[l->rr] = T;
    LM_TRY(lm_comm_allgather(l->rcomm, l->Tr + l->rr, l->Tr, l->ones, LM_I64, err));
    l->toff[0] = 0;
    for (int q = 0; q < R; q++)
        l->toff[q + 1] = l->toff[q] + l->Tr[q];
    l->Tg = l->toff[R];
    l->off = l->toff[l->rr];
    if (l->Tg > INT32_MAX / k)
        return lm_errorf(err, LM_ERR_INVALID, "moe_ep: %lld tokens in the group", (long long)l->Tg);
    {
        const int blas0 = lm_blas_get_threads();
        lm_blas_set_threads(1);
#pragma omp parallel for schedule(dynamic, 1)
        for (int t0 = 0; t0 < T; t0 += ROWS) {
            const int m = T - t0 < ROWS ? T - t0 : ROWS;
            lm_sgemm(0, 1, m, E, d, 1.0f, x + (int64_t)t0 * d, d, w->p[LM_MOE_GATE_WEIGHT], d, 0.0f,
                     l->logits_l + (int64_t)t0 * E, E);
        }
        lm_blas_set_threads(blas0);
    }
    /* 2. the routed batch's logits and sequence bounds; route it */
    int64_t cnt[64], *cnts = R <= 64 ? cnt : LM_MALLOC(sizeof(int64_t) * (size_t)R);
    for (int q = 0; q < R; q++)
        cnts[q] = l->Tr[q] * E;
    lm_status r = lm_comm_allgather(l->rcomm, l->logits_l, l->logits_g, cnts, LM_F32, err);
    const int64_t my_ncu = cu_seqlens ? n_cu : 2;
    l->ncu[l->rr] = my_ncu;
    if (r == LM_OK)
        r = lm_comm_allgather(l->rcomm, l->ncu + l->rr, l->ncu, l->ones, LM_I64, err);
    if (r == LM_OK) {
        int64_t o = 0;
        for (int q = 0; q < R; q++) {
            cnts[q] = l->ncu[q];
            if (q < l->rr)
                o += l->ncu[q];
        }
        int64_t *mine = l->cu_g + o;
        const int64_t two[2] = {0, T};
        /* this rank's bounds into its place (in-place all-gather) */
        memcpy(mine, cu_seqlens ? cu_seqlens : two, sizeof(int64_t) * (size_t)my_ncu);
        r = lm_comm_allgather(l->rcomm, mine, l->cu_g, cnts, LM_I64, err);
    }
    if (cnts != cnt)
        free(cnts);
    LM_TRY(r);
    /* rebase and merge: rank q's bounds + toff[q], the shared boundaries once */
    int64_t n = 0, o = 0;
    for (int q = 0; q < R; q++) {
        for (int64_t i = 0; i < l->ncu[q]; i++) {
            const int64_t b = l->cu_g[o + i] + l->toff[q];
            if (n == 0 || b != l->cu_g[n - 1])
                l->cu_g[n++] = b;
        }
        o += l->ncu[q];
    }
    if (n < 2) /* every rank empty */
        l->cu_g[0] = 0, l->cu_g[1] = 0, n = 2;
    if (l->Tg == 0) {
        l->T = 0;
        l->M = 0;
        l->have_fwd = 1;
        return LM_OK;
    }
    LM_TRY(lm_router_forward(&l->c.router, st, l->logits_g, (int)l->Tg, l->cu_g, (int)n, training,
                             &l->route, err));
    l->T = T;
    /* 3. this rank's kept assignments sorted by expert (stable), counts per expert */
    const int64_t *idx = l->route.topk_idx + l->off * k;
    const uint8_t *keep = l->route.keep + l->off * k;
    memset(l->cnt_s, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t s = 0; s < (int64_t)T * k; s++)
        if (keep[s])
            l->cnt_s[idx[s]]++;
    {
        /* expert start rows (the send order) in a scratch of E int64: cnt_r is [P*El] = E */
        int64_t *start = l->cnt_r;
        int64_t a = 0;
        for (int e = 0; e < E; e++) {
            start[e] = a;
            a += l->cnt_s[e];
        }
        for (int64_t s = 0; s < (int64_t)T * k; s++) {
            if (!keep[s]) {
                l->row_of[s] = -1;
                continue;
            }
            const int64_t row = start[idx[s]]++;
            l->send_slot[row] = (int32_t)s;
            l->row_of[s] = (int32_t)row;
        }
    }
    for (int q = 0; q < P; q++) {
        l->sc[q] = 0;
        for (int e = q * El; e < (q + 1) * El; e++)
            l->sc[q] += l->cnt_s[e];
    }
    /* counts first: E_loc per peer (cnt_s is already in peer order) */
    int64_t elc[64], *el_counts = P <= 64 ? elc : LM_MALLOC(sizeof(int64_t) * (size_t)P);
    for (int q = 0; q < P; q++)
        el_counts[q] = El;
    r = lm_comm_alltoallv(l->comm, l->cnt_s, el_counts, l->cnt_r, el_counts, LM_I64, err);
    if (el_counts != elc)
        free(el_counts);
    LM_TRY(r);
    l->M = 0;
    for (int s = 0; s < P; s++) {
        l->rc[s] = 0;
        for (int e = 0; e < El; e++)
            l->rc[s] += l->cnt_r[s * El + e];
        l->M += l->rc[s];
    }
    /* token rows out */
    int64_t ns = 0;
    for (int q = 0; q < P; q++)
        ns += l->sc[q];
    for (int64_t row = 0; row < ns; row++)
        memcpy(l->sbuf + row * d, x + (int64_t)(l->send_slot[row] / k) * d,
               (size_t)d * sizeof(float));
    for (int q = 0; q < P; q++) {
        l->scn[q] = l->sc[q] * d;
        l->rcn[q] = l->rc[q] * d;
    }
    LM_TRY(lm_comm_alltoallv(l->comm, l->sbuf, l->scn, l->rbuf, l->rcn, LM_F32, err));
    /* 4. compute rows in (local expert, source rank, token) order */
    {
        int64_t a = 0;
        for (int e = 0; e < El; e++) {
            l->seg[e] = a;
            for (int s = 0; s < P; s++)
                a += l->cnt_r[s * El + e];
        }
        l->seg[El] = a;
        int64_t roff = 0;
        for (int s = 0; s < P; s++) {
            int64_t sub = roff;
            for (int e = 0; e < El; e++) {
                int64_t dst = l->seg[e];
                for (int q = 0; q < s; q++)
                    dst += l->cnt_r[q * El + e];
                for (int64_t i = 0; i < l->cnt_r[s * El + e]; i++)
                    l->crow[dst + i] = (int32_t)(sub + i);
                sub += l->cnt_r[s * El + e];
            }
            roff += l->rc[s];
        }
    }
    EXPERTS_PARALLEL(l, expert_fwd(l, w, el));
    /* 5. outputs back in receive order, then combine */
    for (int64_t r2 = 0; r2 < l->M; r2++)
        memcpy(l->rbuf + (int64_t)l->crow[r2] * d, l->Y + r2 * d, (size_t)d * sizeof(float));
    LM_TRY(lm_comm_alltoallv(l->comm, l->rbuf, l->rcn, l->sbuf, l->scn, LM_F32, err));
    const int fs = l->fs;
    const float *wt = l->route.topk_weight + l->off * k;
    {
        const int blas0 = lm_blas_get_threads();
        lm_blas_set_threads(1);
#pragma omp parallel for schedule(dynamic, 1)
        for (int t0 = 0; t0 < T; t0 += ROWS) {
            const int m = T - t0 < ROWS ? T - t0 : ROWS;
            if (fs > 0) {
                float *Hs = l->Hs + (int64_t)t0 * 2 * fs, *As = l->As + (int64_t)t0 * fs;
                const float *xr = x + (int64_t)t0 * d;
                lm_sgemm(0, 1, m, fs, d, 1.0f, xr, d, w->p[LM_MOE_SHARED_GATE_PROJ], d, 0.0f, Hs,
                         2 * fs);
                lm_sgemm(0, 1, m, fs, d, 1.0f, xr, d, w->p[LM_MOE_SHARED_UP_PROJ], d, 0.0f, Hs + fs,
                         2 * fs);
                lm_moe_cpu_swiglu_fwd(m, fs, Hs, 2 * fs, As, fs);
                lm_sgemm(0, 1, m, d, fs, 1.0f, As, fs, w->p[LM_MOE_SHARED_DOWN_PROJ], fs, 0.0f,
                         out + (int64_t)t0 * d, d);
            }
            for (int t = t0; t < t0 + m; t++) {
                float *restrict ot = out + (int64_t)t * d;
                if (fs == 0)
                    memset(ot, 0, (size_t)d * sizeof(float));
                for (int j = 0; j < k; j++) {
                    const int32_t row = l->row_of[(int64_t)t * k + j];
                    if (row < 0)
                        continue;
                    const float wj = wt[(int64_t)t * k + j];
                    const float *restrict y = l->sbuf + (int64_t)row * d;
#pragma omp simd
                    for (int c = 0; c < d; c++)
                        ot[c] += wj * y[c];
                }
            }
        }
        lm_blas_set_threads(blas0);
    }
    l->have_fwd = 1;
    return LM_OK;
}

lm_status lm_moe_ep_backward(lm_moe_ep *l, const lm_moe_weights *w, const float *x,
                             const float *dout, float *dx, lm_moe_grads *g, lm_error *err) {
    if (!l)
        return lm_errorf(err, LM_ERR_INVALID, "moe_ep: layer is required");
    lm_status v = LM_OK;
    if (!l->have_fwd)
        v = lm_errorf(err, LM_ERR_INVALID, "moe_ep: backward called before forward");
    else if (l->T > 0 && (!x || !dout))
        v = lm_errorf(err, LM_ERR_INVALID, "moe_ep: %s is NULL", !x ? "x" : "dout");
    if (v == LM_OK)
        v = check_weights(l, w, err);
    LM_TRY(lm_comm_agree(l->rcomm, v, err));
    lm_moe_grads none;
    memset(&none, 0, sizeof none);
    if (!g)
        g = &none;
    const int P = l->P, R = l->R, E = l->E, k = l->k, d = l->d, T = l->T, fs = l->fs;
    if (l->Tg == 0)
        return LM_OK;
    /* 1. [dout | w] rows to the experts' ranks, in the dispatch order */
    const float *wt = l->route.topk_weight + l->off * k;
    int64_t ns = 0;
    for (int q = 0; q < P; q++) {
        ns += l->sc[q];
        l->scn[q] = l->sc[q] * (d + 1);
        l->rcn[q] = l->rc[q] * (d + 1);
    }
    for (int64_t row = 0; row < ns; row++) {
        const int32_t s = l->send_slot[row];
        float *b = l->sbuf + row * (d + 1);
        memcpy(b, dout + (int64_t)(s / k) * d, (size_t)d * sizeof(float));
        b[d] = wt[s];
    }
    LM_TRY(lm_comm_alltoallv(l->comm, l->sbuf, l->scn, l->rbuf, l->rcn, LM_F32, err));
    /* 2. the experts */
    EXPERTS_PARALLEL(l, expert_bwd(l, w, g, el));
    /* 3. [dx_e | dw] rows back */
    LM_TRY(lm_comm_alltoallv(l->comm, l->rbuf, l->rcn, l->sbuf, l->scn, LM_F32, err));
    memset(l->dw_l, 0, sizeof(float) * (size_t)T * k);
    for (int64_t row = 0; row < ns; row++)
        l->dw_l[l->send_slot[row]] = l->sbuf[row * (d + 1) + d];
    /* 4. router backward on the routed batch */
    int64_t cnt[64], *cnts = R <= 64 ? cnt : LM_MALLOC(sizeof(int64_t) * (size_t)R);
    for (int q = 0; q < R; q++)
        cnts[q] = l->Tr[q] * k;
    lm_status r = lm_comm_allgather(l->rcomm, l->dw_l, l->dw_g, cnts, LM_F32, err);
    if (cnts != cnt)
        free(cnts);
    LM_TRY(r);
    lm_router_config rc = l->c.router;
    rc.aux_loss_alpha *= l->aux_scale;
    float *dlog = l->logits_g; /* the forward's logits are not needed any more */
    LM_TRY(lm_router_backward(&rc, &l->route, l->dw_g, dlog, err));
    const float *dl = dlog + l->off * E;
    /* 5. local: shared experts, dx, d gate.weight */
    const int blas0 = lm_blas_get_threads();
    lm_blas_set_threads(1);
#pragma omp parallel for schedule(dynamic, 1)
    for (int t0 = 0; t0 < T; t0 += ROWS) {
        const int m = T - t0 < ROWS ? T - t0 : ROWS;
        if (fs > 0) {
            const float *Hs = l->Hs + (int64_t)t0 * 2 * fs;
            float *Gs = l->Gs + (int64_t)t0 * fs, *dHs = l->dHs + (int64_t)t0 * 2 * fs;
            lm_sgemm(0, 0, m, fs, d, 1.0f, dout + (int64_t)t0 * d, d, w->p[LM_MOE_SHARED_DOWN_PROJ],
                     fs, 0.0f, Gs, fs);
            lm_moe_cpu_swiglu_bwd(m, fs, Hs, 2 * fs, Gs, fs, dHs, 2 * fs);
            if (dx) {
                lm_sgemm(0, 0, m, d, fs, 1.0f, dHs, 2 * fs, w->p[LM_MOE_SHARED_GATE_PROJ], d, 0.0f,
                         dx + (int64_t)t0 * d, d);
                lm_sgemm(0, 0, m, d, fs, 1.0f, dHs + fs, 2 * fs, w->p[LM_MOE_SHARED_UP_PROJ], d,
                         1.0f, dx + (int64_t)t0 * d, d);
            }
        }
        if (dx) {
            lm_sgemm(0, 0, m, d, E, 1.0f, dl + (int64_t)t0 * E, E, w->p[LM_MOE_GATE_WEIGHT], d,
                     fs > 0 ? 1.0f : 0.0f, dx + (int64_t)t0 * d, d);
            for (int t = t0; t < t0 + m; t++) {
                float *restrict o = dx + (int64_t)t * d;
                for (int j = 0; j < k; j++) {
                    const int32_t row = l->row_of[(int64_t)t * k + j];
                    if (row < 0)
                        continue;
                    const float *restrict y = l->sbuf + (int64_t)row * (d + 1);
#pragma omp simd
                    for (int c = 0; c < d; c++)
                        o[c] += y[c];
                }
            }
        }
    }
    lm_blas_set_threads(blas0);
    /* weight gradients over this rank's tokens (zero with no tokens) */
    float *dWr = g->p[LM_MOE_GATE_WEIGHT];
    if (dWr) {
        if (T > 0)
            lm_sgemm(1, 0, E, d, T, 1.0f, dl, E, x, d, 0.0f, dWr, d);
        else
            memset(dWr, 0, sizeof(float) * (size_t)E * d);
    }
    if (fs > 0) {
        float *dWd = g->p[LM_MOE_SHARED_DOWN_PROJ], *dWg = g->p[LM_MOE_SHARED_GATE_PROJ],
              *dWu = g->p[LM_MOE_SHARED_UP_PROJ];
        if (T == 0) {
            if (dWd)
                memset(dWd, 0, sizeof(float) * (size_t)d * fs);
            if (dWg)
                memset(dWg, 0, sizeof(float) * (size_t)fs * d);
            if (dWu)
                memset(dWu, 0, sizeof(float) * (size_t)fs * d);
        } else {
            if (dWd)
                lm_sgemm(1, 0, d, fs, T, 1.0f, dout, d, l->As, fs, 0.0f, dWd, fs);
            if (dWg)
                lm_sgemm(1, 0, fs, d, T, 1.0f, l->dHs, 2 * fs, x, d, 0.0f, dWg, d);
            if (dWu)
                lm_sgemm(1, 0, fs, d, T, 1.0f, l->dHs + fs, 2 * fs, x, d, 0.0f, dWu, d);
        }
    }
    return LM_OK;
}
