/* The hybrid model: embedding, KDA / attention token mixers, dense / MoE FFNs, the
 * standard or (Block) AttnRes residual, final norm, LM head and cross-entropy;
 * training forward/backward and the cached inference path. Math, layouts and
 * contracts: include/linmoe/model.h; the Block AttnRes bookkeeping follows
 * reference/attnres_ctx.md §4.2 (forward) and §4.3 (backward, reverse running
 * accumulator). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/attn_layer.h"
#include "linmoe/attnres.h"
#include "linmoe/kda_layer.h"
#include "linmoe/layers.h"
#include "linmoe/model.h"
#include "linmoe/moe.h"
#include "linmoe/moe_ep.h"
#include "model/model_internal.h"
#include "ops/cpu/gemm_rowwise.h"
#include "ops/cpu/kda_cpu.h"

typedef struct {
    lm_layer_kind kind;
    int moe;
    /* token mixer */
    lm_kda_layer_config kc;
    lm_kda_layer_weights kw;
    lm_kda_layer_grads kg;
    lm_kda_layer_ctx *kctx;
    lm_attn_layer_config ac;
    lm_attn_layer_weights aw;
    lm_attn_layer_grads ag;
    lm_attn_layer_ctx *actx;
    /* FFN */
    int I;                /* dense width */
    lm_swiglu_weights sw; /* dense */
    lm_swiglu_grads sg;
    float *hidden;               /* dense: [max_tokens, 2I] saved (activation class) */
    float *kda_acts, *attn_acts; /* the mixer's saved activations (activation class) */
    lm_moe_config mc;
    lm_moe_weights mw;
    lm_moe_grads mg;
    lm_moe_ctx *mctx;
    /* expert parallel (lm_model_set_expert_parallel): the layer over the EP group, its
     * weights (experts.* at this rank's first expert), and whether the last forward
     * ran through it (training forwards only) */
    lm_moe_ep *ep;
    lm_moe_weights mw_ep;
    int ep_fwd;
    lm_router_state rs;
    float *rs_own_bias; /* the state's own allocation, restored before freeing */
    /* norms and AttnRes (per sublayer: 0 mixer, 1 FFN) */
    const float *norm_w[2];
    float *norm_g[2];
    const float *arq[2], *arn[2];
    float *arq_g[2], *arn_g[2];
} layer_rt;

struct lm_model {
    lm_params *p;
    const lm_model_config *c;
    int L, nsub, S, nblocks, d, V;
    int64_t max_tokens;
    /* The memory plan (model.h): one allocation per class, every buffer below a view
     * of one of them. */
    lm_mem_plan plan;
    float *grads;     /* [numel], the gradient class (params layout) */
    lm_arena acts;    /* saved activations (core.h arena: one 64-byte aligned block) */
    lm_arena scratch; /* scratch */
    layer_rt *ly;
    /* activations, each [max_tokens, d] */
    float *e;     /* embedding rows */
    float **h;    /* [nsub] sublayer inputs (mixed / residual stream) */
    float **xn;   /* [nsub] normed sublayer inputs */
    float **rstd; /* [nsub] [max_tokens] */
    float **run;  /* [nsub] running block sums after sublayer l (AttnRes) */
    float *hfin, *xfin, *rstd_fin, *lse;
    float *tmp; /* scratch [max_tokens, d] */
    /* backward accumulators */
    float *dE, **dB, *G, *dh, *dxn;
    float *swiglu_ws;
    float *ce_ws; /* the cross-entropy's scratch (thread-count dependent) */
    int64_t ce_ws_floats;
    void *norm_ws; /* the RMSNorm backward's scratch (lm_rmsnorm_backward_ws_bytes) */
    /* gradient stage: what an op that overwrites its weight gradients writes when a
     * backward accumulates (then added in), [stage_floats] */
    float *stage;
    int64_t stage_floats;
    int acc;                  /* the backward in progress accumulates */
    lm_kda_workspace *kda_ws; /* the KDA op's scratch, shared by the KDA layers */
    lm_attnres_workspace *arws;
    const float *W_emb, *W_head, *norm_fin;
    const float *arq_fin, *arn_fin;
    /* the last forward */
    int have_fwd, have_labels, B, T, n_cu;
    int64_t N, n_labels;
    int64_t *cu;
    int32_t *ids, *labels;
    double loss;
    float loss_scale;   /* of the running backward (the MoE layers' aux gradient scale) */
    float ep_aux_scale; /* lm_model_set_ep_aux_scale; NAN: loss_scale */
};

/* ---------------------------------------------------------------- helpers */

static float *P(lm_params *p, const char *fmt, int i) {
    char name[LM_PARAM_NAME_MAX];
    snprintf(name, sizeof name, fmt, i);
    return lm_params_get(p, name);
}

static float *G_of(lm_model *m, const float *param) {
    if (!param)
        return NULL;
    return m->grads + (param - m->p->data);
}

static void add_into(float *y, const float *x, int64_t n);

/* Elements of the parameter tensor that starts at `param`. */
static int64_t param_numel_of(const lm_model *m, const float *param) {
    const int64_t off = param - m->p->data;
    for (int t = 0; t < m->p->n; t++)
        if (m->p->t[t].offset == off)
            return m->p->t[t].numel;
    return 0;
}

/* Where an op that overwrites its weight gradient writes it: the gradient itself, or
 * (accumulating backward) the stage at float offset `off`, added by stage_add. */
static float *G_dst(lm_model *m, const float *param, int64_t off) {
    if (!param)
        return NULL;
    return m->acc ? m->stage + off : G_of(m, param);
}
static void stage_add(lm_model *m, const float *param, int64_t off, int64_t n) {
    if (m->acc && param)
        add_into(G_of(m, param), m->stage + off, n);
}

lm_params *lm_model_params(lm_model *m) { return m->p; }

void lm_model_set_ep_aux_scale(lm_model *m, float scale) {
    if (m)
        m->ep_aux_scale = scale;
}

lm_status lm_model_set_expert_parallel(lm_model *m, lm_comm *ep, lm_comm *route, lm_error *err) {
    if (!m || !ep)
        return lm_errorf(err, LM_ERR_INVALID, "model: expert parallel: NULL argument");
    for (int i = 0; i < m->L; i++) {
        layer_rt *l = &m->ly[i];
        if (!l->moe || l->ep)
            continue;
        if (m->p->ep_size > 1 &&
            (lm_comm_size(ep) != m->p->ep_size || lm_comm_rank(ep) != m->p->ep_rank))
            return lm_errorf(err, LM_ERR_INVALID,
                             "model: expert parallel: the parameters hold the experts of EP "
                             "rank %d of %d, the group is rank %d of %d",
                             m->p->ep_rank, m->p->ep_size, lm_comm_rank(ep), lm_comm_size(ep));
        LM_TRY(lm_moe_ep_new(&l->ep, &l->mc, ep, route, (int)m->max_tokens, err));
        l->mw_ep = l->mw;
        if (m->p->ep_size > 1)
            continue; /* experts.* hold this rank's experts only already */
        const int64_t e0 = lm_moe_ep_first_expert(l->ep), f = l->mc.moe_intermediate_size,
                      d = l->mc.hidden_size;
        for (int w = LM_MOE_EXPERTS_GATE_PROJ; w <= LM_MOE_EXPERTS_DOWN_PROJ; w++)
            l->mw_ep.p[w] = l->mw.p[w] + e0 * f * d;
    }
    return LM_OK;
}
int64_t lm_model_max_tokens(const lm_model *m) { return m ? m->max_tokens : 0; }
float *lm_model_grads(lm_model *m) { return m->grads; }

lm_router_state *lm_model_router_state(lm_model *m, int layer) {
    if (!m || layer < 0 || layer >= m->L || !m->ly[layer].moe)
        return NULL;
    return &m->ly[layer].rs;
}

const lm_route *lm_model_route(const lm_model *m, int layer) {
    if (!m || layer < 0 || layer >= m->L || !m->ly[layer].moe)
        return NULL;
    if (m->ly[layer].ep_fwd)
        return lm_moe_ep_route(m->ly[layer].ep);
    return lm_moe_ctx_route(m->ly[layer].mctx);
}

lm_status lm_model_set_rope_theta(lm_model *m, double theta, lm_error *err) {
    if (!m)
        return lm_errorf(err, LM_ERR_INVALID, "model: NULL model");
    if (!(isfinite(theta) && theta > 0.0 && theta <= 3.0e38))
        return lm_errorf(err, LM_ERR_INVALID, "model: rope_theta = %g must be finite and > 0",
                         theta);
    m->p->cfg.rope_theta = (float)theta;
    for (int i = 0; i < m->L; i++)
        if (m->ly[i].kind == LM_LAYER_ATTN)
            m->ly[i].ac.rope_theta = m->p->cfg.rope_theta;
    return LM_OK;
}

const float *lm_model_sublayer_input(const lm_model *m, int l) {
    return m && l >= 0 && l < m->nsub ? m->h[l] : NULL;
}
const float *lm_model_block_partial(const lm_model *m, int l) {
    return m && m->run && l >= 0 && l < m->nsub ? m->run[l] : NULL;
}
const float *lm_model_embedding_out(const lm_model *m) { return m ? m->e : NULL; }

void lm_model_free(lm_model *m) {
    if (!m)
        return;
    for (int i = 0; m->ly && i < m->L; i++) {
        layer_rt *l = &m->ly[i];
        lm_kda_layer_ctx_free(l->kctx);
        lm_attn_layer_ctx_free(l->actx);
        lm_moe_ctx_free(l->mctx);
        lm_moe_ep_free(l->ep);
        if (l->moe) {
            l->rs.e_score_correction_bias = l->rs_own_bias;
            lm_router_state_free(&l->rs);
        }
    }
    free(m->ly);
    free(m->h);
    free(m->xn);
    free(m->rstd);
    free(m->run);
    free(m->dB);
    lm_kda_workspace_free(m->kda_ws); /* before the scratch its slots point into */
    lm_attnres_workspace_free(m->arws);
    free(m->grads);
    lm_arena_free(&m->acts);
    lm_arena_free(&m->scratch);
    free(m);
}

/* ---------------------------------------------------------------- memory plan */

/* Layer i's mixer configs (KDA or attention) from the model config. */
static void layer_cfgs(const lm_model_config *c, int i, lm_kda_layer_config *kc,
                       lm_attn_layer_config *ac) {
    lm_kda_layer_config_default(kc, c->hidden_size, c->kda_num_heads, c->kda_head_dim);
    kc->W = c->short_conv_kernel_size;
    kc->gate = c->gate[i];
    kc->lower_bound = c->lower_bound;
    kc->chunk_size = c->chunk_size;
    lm_attn_layer_config_default(ac, c->hidden_size, c->num_attention_heads, c->num_key_value_heads,
                                 c->head_dim);
    ac->position = c->position[i];
    ac->rope_theta = c->rope_theta;
}

/* A bump allocator over one class: `base` NULL measures only. Slices are 64-byte
 * aligned (cache lines, AVX-512 loads). */
typedef struct {
    char *base;
    int64_t off;
} bump;

static void *take(bump *b, int64_t bytes) {
    const int64_t o = (b->off + 63) / 64 * 64;
    b->off = o + (bytes > 0 ? bytes : 0);
    return b->base ? b->base + o : NULL;
}
#define TAKE_F(b, n) ((float *)take((b), (int64_t)(n) * (int64_t)sizeof(float)))

/* Every buffer of the model for batches of B x T tokens (N = B*T; documents of up to
 * T tokens) on `threads` OpenMP threads, in two classes: `ac` the activations the
 * forward saves for the backward, `sc` the scratch (the backward's accumulators, the
 * layers' backward scratch, which the layers share since one runs at a time, the op
 * workspaces, the gradient stage). With m == NULL (or bases NULL) it measures; with m
 * and bases set it hands every view to the model and its layers. The same walk does
 * both, so the size table and the layout cannot disagree. */
static void layout(const lm_model_config *c, int64_t B, int64_t T, int threads, lm_model *m,
                   bump *ac, bump *sc, int64_t *kda_ws_bytes_out) {
    const int L = c->num_hidden_layers, nsub = 2 * L, d = c->hidden_size, V = c->vocab_size;
    const int64_t N = B * T, Nd = N * d;
    const int S = c->residual == LM_RES_FULL_ATTNRES    ? 1
                  : c->residual == LM_RES_BLOCK_ATTNRES ? c->attnres_block_size
                                                        : nsub;
    const int nblocks = (nsub + S - 1) / S, attnres = c->residual != LM_RES_STANDARD;
    const int carve = m && ac->base && sc->base;
    /* ---- saved activations */
    float *e = TAKE_F(ac, Nd);
    if (carve)
        m->e = e;
    for (int l = 0; l < nsub; l++) {
        float *h = TAKE_F(ac, Nd), *xn = TAKE_F(ac, Nd), *rs = TAKE_F(ac, N);
        float *run = attnres ? TAKE_F(ac, Nd) : NULL;
        if (carve) {
            m->h[l] = h;
            m->xn[l] = xn;
            m->rstd[l] = rs;
            if (attnres)
                m->run[l] = run;
        }
    }
    float *hfin = TAKE_F(ac, Nd), *xfin = TAKE_F(ac, Nd), *rstd_fin = TAKE_F(ac, N);
    float *lse = TAKE_F(ac, N);
    int32_t *ids = take(ac, N * (int64_t)sizeof(int32_t));
    int32_t *labels = take(ac, N * (int64_t)sizeof(int32_t));
    int64_t *cu = take(ac, (N + 2) * (int64_t)sizeof(int64_t));
    if (carve) {
        m->hfin = hfin;
        m->xfin = xfin;
        m->rstd_fin = rstd_fin;
        m->lse = lse;
        m->ids = ids;
        m->labels = labels;
        m->cu = cu;
    }
    /* ---- scratch: the model's backward accumulators */
    float *tmp = TAKE_F(sc, Nd), *dE = TAKE_F(sc, Nd), *G = TAKE_F(sc, Nd);
    float *dh = TAKE_F(sc, Nd), *dxn = TAKE_F(sc, Nd);
    if (carve) {
        m->tmp = tmp;
        m->dE = dE;
        m->G = G;
        m->dh = dh;
        m->dxn = dxn;
    }
    for (int j = 0; attnres && j < nblocks; j++) {
        float *db = TAKE_F(sc, Nd);
        if (carve)
            m->dB[j] = db;
    }
    /* the cross-entropy's scratch (at the current thread count) */
    lm_ce_config cc;
    lm_ce_config_default(&cc, N, d, V);
    const int64_t ce = lm_cross_entropy_ws_floats(&cc);
    float *ce_ws = TAKE_F(sc, ce);
    if (carve) {
        m->ce_ws = ce_ws;
        m->ce_ws_floats = ce;
    }
    /* the RMSNorm backward's fp64 partial weight gradients (pre-norms, final norm) */
    void *norm_ws = take(sc, lm_rmsnorm_backward_ws_bytes(N, d));
    if (carve)
        m->norm_ws = norm_ws;
    /* layers: saved activations per layer; backward scratch, SwiGLU scratch and the
     * gradient stage shared (the max over layers) */
    int64_t lscr = 0, swi = 0;
    int64_t stage = (int64_t)V * d; /* the LM head (cross-entropy dW) */
    if (stage < d)
        stage = d; /* RMSNorm weights */
    int have_kda = 0;
    lm_kda_layer_config kc0;
    memset(&kc0, 0, sizeof kc0);
    for (int i = 0; i < L; i++) {
        lm_kda_layer_config kc;
        lm_attn_layer_config acf;
        layer_cfgs(c, i, &kc, &acf);
        if (c->kinds[i] == LM_LAYER_KDA) {
            float *a = TAKE_F(ac, lm_kda_layer_act_floats(&kc, N));
            if (carve)
                m->ly[i].kda_acts = a;
            const int64_t ls = lm_kda_layer_scratch_floats(&kc, N);
            lscr = ls > lscr ? ls : lscr;
            const int64_t st = lm_kda_layer_stage_floats(&kc);
            stage = st > stage ? st : stage;
            if (!have_kda)
                kc0 = kc;
            have_kda = 1;
        } else {
            float *a = TAKE_F(ac, lm_attn_layer_act_floats(&acf, N));
            if (carve)
                m->ly[i].attn_acts = a;
            const int64_t ls = lm_attn_layer_scratch_floats(&acf, N);
            lscr = ls > lscr ? ls : lscr;
        }
        if (!lm_model_layer_is_moe(c, i)) {
            const int I = c->intermediate_size;
            float *hid = TAKE_F(ac, N * 2 * I);
            if (carve)
                m->ly[i].hidden = hid;
            const int64_t ws = lm_swiglu_ws_floats(N, I, 1);
            swi = ws > swi ? ws : swi;
            const int64_t st = 3 * (int64_t)I * d;
            stage = st > stage ? st : stage;
        } else {
            const int64_t E = c->moe.router.num_experts, f = c->moe.moe_intermediate_size,
                          fs = (int64_t)c->moe.n_shared_experts * f;
            const int64_t st = E * d + 3 * E * f * d + 3 * fs * d; /* lm_moe_backward's */
            stage = st > stage ? st : stage;
        }
    }
    float *lsp = TAKE_F(sc, lscr);
    float *swp = swi > 0 ? TAKE_F(sc, swi) : NULL;
    float *stp = TAKE_F(sc, stage);
    if (carve) {
        m->swiglu_ws = swp;
        m->stage = stp;
        m->stage_floats = stage;
    }
    /* the KDA op's workspace, shared by the KDA layers (the op recomputes what it
     * needs in the backward: everything in it is scratch) */
    int64_t kda_ws = 0;
    if (have_kda) {
        lm_kda_config kcfg;
        lm_kda_config_default(&kcfg, (int)B, (int)T, kc0.H, kc0.H, kc0.Dh, kc0.Dh);
        kcfg.chunk_size = kc0.chunk_size;
        size_t *bytes = LM_MALLOC(sizeof(size_t) * LM_KDA_WS_SLOTS);
        lm_kda_ws_plan(&kcfg, threads, bytes);
        const int64_t off0 = sc->off;
        for (int s = 0; s < LM_KDA_WS_SLOTS; s++) {
            if (!bytes[s])
                continue;
            void *q = take(sc, (int64_t)bytes[s]);
            if (carve)
                lm_kda_ws_bind(m->kda_ws, s, q, bytes[s]);
        }
        kda_ws = sc->off - off0;
        free(bytes);
    }
    if (kda_ws_bytes_out)
        *kda_ws_bytes_out = kda_ws;
    if (carve)
        for (int i = 0; i < L; i++) {
            if (c->kinds[i] == LM_LAYER_KDA)
                lm_kda_layer_ctx_bind(m->ly[i].kctx, N, m->ly[i].kda_acts, lsp, m->stage,
                                      m->kda_ws);
            else
                lm_attn_layer_ctx_bind(m->ly[i].actx, N, m->ly[i].attn_acts, lsp);
        }
}

/* Parameter count of the config without allocating them (params.c). */
static int64_t param_numel(const lm_model_config *c, lm_error *err, lm_status *st) {
    int64_t numel = 0;
    *st = lm_params_layout_numel(c, &numel, err);
    return numel;
}

const char *lm_mem_class_name(lm_mem_class k) {
    static const char *const names[LM_MEM_N_CLASSES] = {
        "parameters", "gradients", "optimizer state", "activations", "scratch"};
    return k >= 0 && k < LM_MEM_N_CLASSES ? names[k] : "?";
}

lm_status lm_model_mem_plan(const lm_model_config *cfg, int B, int T, lm_mem_plan *out,
                            lm_error *err) {
    if (!cfg || !out)
        return lm_errorf(err, LM_ERR_INVALID, "mem plan: NULL config or output");
    memset(out, 0, sizeof *out);
    LM_TRY(lm_model_config_validate(cfg, err));
    if (B < 1 || T < 1 || (int64_t)B * T > ((int64_t)1 << 30))
        return lm_errorf(err, LM_ERR_INVALID,
                         "mem plan: B = %d, T = %d (want >= 1 and B*T <= 2^30 tokens)", B, T);
    lm_status st;
    const int64_t numel = param_numel(cfg, err, &st);
    if (st != LM_OK)
        return st;
    bump ac = {NULL, 0}, sc = {NULL, 0};
    int64_t kda_ws = 0;
    const int threads = lm_get_num_threads();
    layout(cfg, B, T, threads, NULL, &ac, &sc, &kda_ws);
    out->B = B;
    out->T = T;
    out->threads = threads;
    out->numel = numel;
    out->bytes[LM_MEM_PARAMS] = numel * (int64_t)sizeof(float);
    out->bytes[LM_MEM_GRADS] = numel * (int64_t)sizeof(float);
    out->bytes[LM_MEM_OPTIM] = 2 * numel * (int64_t)sizeof(float);
    out->bytes[LM_MEM_ACTS] = ac.off;
    out->bytes[LM_MEM_SCRATCH] = sc.off;
    out->kda_workspace_bytes = kda_ws;
    for (int k = 0; k < LM_MEM_N_CLASSES; k++)
        out->total += out->bytes[k];
    return LM_OK;
}

const lm_mem_plan *lm_model_plan(const lm_model *m) { return m ? &m->plan : NULL; }

int lm_mem_plan_format(const lm_mem_plan *p, char *buf, size_t size) {
    if (!p || !buf || size == 0)
        return 0;
    int n =
        snprintf(buf, size, "memory plan (B = %d, T = %d, %d threads):", p->B, p->T, p->threads);
    for (int k = 0; k < LM_MEM_N_CLASSES && n >= 0 && (size_t)n < size; k++)
        n += snprintf(buf + n, size - (size_t)n, " %s %.2f MiB%s", lm_mem_class_name(k),
                      (double)p->bytes[k] / (1024.0 * 1024.0), k + 1 < LM_MEM_N_CLASSES ? "," : "");
    if (n >= 0 && (size_t)n < size)
        n += snprintf(buf + n, size - (size_t)n, "; total %.2f MiB",
                      (double)p->total / (1024.0 * 1024.0));
    return n;
}

lm_status lm_model_new(lm_model **out, lm_params *p, int64_t max_tokens, lm_error *err) {
    *out = NULL;
    if (!p || !p->data)
        return lm_errorf(err, LM_ERR_INVALID, "model: no parameters");
    LM_TRY(lm_model_config_validate(&p->cfg, err));
    if (max_tokens < 1 || max_tokens > ((int64_t)1 << 30))
        return lm_errorf(err, LM_ERR_INVALID, "model: max_tokens = %lld (want 1 .. 2^30)",
                         (long long)max_tokens);
    lm_model *m = LM_CALLOC(1, sizeof(*m));
    m->ep_aux_scale = NAN;
    const lm_model_config *c = &p->cfg;
    m->p = p;
    m->c = c;
    m->L = c->num_hidden_layers;
    m->nsub = 2 * m->L;
    m->d = c->hidden_size;
    m->V = c->vocab_size;
    m->max_tokens = max_tokens;
    m->S = c->residual == LM_RES_FULL_ATTNRES    ? 1
           : c->residual == LM_RES_BLOCK_ATTNRES ? c->attnres_block_size
                                                 : m->nsub;
    m->nblocks = (m->nsub + m->S - 1) / m->S;
    m->ly = LM_CALLOC((size_t)m->L, sizeof(layer_rt));
    lm_status st = LM_OK;
    int have_kda = 0;
    for (int i = 0; i < m->L && st == LM_OK; i++) {
        layer_rt *l = &m->ly[i];
        l->kind = c->kinds[i];
        l->moe = lm_model_layer_is_moe(c, i);
        layer_cfgs(c, i, &l->kc, &l->ac);
        const char *pre = "model.layers.%d.";
        char f[160];
#define PP(suffix) (snprintf(f, sizeof f, "%s%s", pre, suffix), P(p, f, i))
        if (l->kind == LM_LAYER_KDA) {
            l->kw.q_proj = PP("self_attn.q_proj.weight");
            l->kw.k_proj = PP("self_attn.k_proj.weight");
            l->kw.v_proj = PP("self_attn.v_proj.weight");
            l->kw.q_conv1d = PP("self_attn.q_conv1d.weight");
            l->kw.k_conv1d = PP("self_attn.k_conv1d.weight");
            l->kw.v_conv1d = PP("self_attn.v_conv1d.weight");
            l->kw.f_a_proj = PP("self_attn.f_a_proj.weight");
            l->kw.f_b_proj = PP("self_attn.f_b_proj.weight");
            l->kw.A_log = PP("self_attn.A_log");
            l->kw.dt_bias = PP("self_attn.dt_bias");
            l->kw.b_proj = PP("self_attn.b_proj.weight");
            l->kw.g_a_proj = PP("self_attn.g_a_proj.weight");
            l->kw.g_b_proj = PP("self_attn.g_b_proj.weight");
            l->kw.o_norm = PP("self_attn.o_norm.weight");
            l->kw.o_proj = PP("self_attn.o_proj.weight");
            l->kctx = lm_kda_layer_ctx_new();
            have_kda = 1;
        } else {
            l->aw.q_proj = PP("self_attn.q_proj.weight");
            l->aw.k_proj = PP("self_attn.k_proj.weight");
            l->aw.v_proj = PP("self_attn.v_proj.weight");
            l->aw.o_proj = PP("self_attn.o_proj.weight");
            l->actx = lm_attn_layer_ctx_new();
        }
        l->norm_w[0] = PP("input_layernorm.weight");
        l->norm_w[1] = PP("post_attention_layernorm.weight");
        if (c->residual != LM_RES_STANDARD) {
            l->arq[0] = PP("attn_res.query");
            l->arn[0] = PP("attn_res.norm.weight");
            l->arq[1] = PP("mlp_res.query");
            l->arn[1] = PP("mlp_res.norm.weight");
        }
        if (!l->moe) {
            l->I = c->intermediate_size;
            l->sw.gate_proj = PP("mlp.gate_proj.weight");
            l->sw.up_proj = PP("mlp.up_proj.weight");
            l->sw.down_proj = PP("mlp.down_proj.weight");
        } else {
            l->mc = c->moe;
            l->mc.hidden_size = m->d;
            static const char *const mn[LM_MOE_N_WEIGHTS] = {"mlp.gate.weight",
                                                             "mlp.experts.gate_proj",
                                                             "mlp.experts.up_proj",
                                                             "mlp.experts.down_proj",
                                                             "mlp.shared_experts.gate_proj",
                                                             "mlp.shared_experts.up_proj",
                                                             "mlp.shared_experts.down_proj"};
            for (int w = 0; w < LM_MOE_N_WEIGHTS; w++)
                l->mw.p[w] = PP(mn[w]);
            st = lm_moe_ctx_new(&l->mctx, &l->mc, (int)max_tokens, err);
            if (st == LM_OK)
                st = lm_router_state_init(&l->rs, l->mc.router.num_experts, err);
            if (st == LM_OK) {
                l->rs_own_bias = l->rs.e_score_correction_bias;
                l->rs.e_score_correction_bias = PP("mlp.gate.e_score_correction_bias");
            } else {
                l->moe = 0; /* nothing to restore at free */
            }
        }
#undef PP
    }
    if (st != LM_OK) {
        lm_model_free(m);
        return st;
    }
    m->W_emb = lm_params_get(p, "model.embed_tokens.weight");
    m->W_head = c->tie_word_embeddings ? m->W_emb : lm_params_get(p, "lm_head.weight");
    m->norm_fin = lm_params_get(p, "model.norm.weight");
    if (c->residual != LM_RES_STANDARD) {
        m->arq_fin = lm_params_get(p, "model.attnres_final.query");
        m->arn_fin = lm_params_get(p, "model.attnres_final.norm.weight");
    }
    m->h = LM_CALLOC((size_t)m->nsub, sizeof(float *));
    m->xn = LM_CALLOC((size_t)m->nsub, sizeof(float *));
    m->rstd = LM_CALLOC((size_t)m->nsub, sizeof(float *));
    if (c->residual != LM_RES_STANDARD) {
        m->run = LM_CALLOC((size_t)m->nsub, sizeof(float *));
        m->dB = LM_CALLOC((size_t)m->nblocks, sizeof(float *));
    }
    if (have_kda)
        m->kda_ws = lm_kda_workspace_new();
    m->arws = lm_attnres_workspace_new();
    /* The memory plan for batches of up to max_tokens tokens in one sequence (the
     * longest sequence a batch of max_tokens holds, the plan's worst case): measure,
     * allocate each class once (the gradient class: p->numel floats), carve. */
    const lm_status ps = lm_model_mem_plan(c, 1, (int)max_tokens, &m->plan, err);
    if (ps != LM_OK) {
        lm_model_free(m);
        return ps;
    }
    if (p->numel != m->plan.numel) {
        /* an expert-sharded table (params.h): its own experts only */
        m->plan.total -= m->plan.bytes[LM_MEM_PARAMS] + m->plan.bytes[LM_MEM_GRADS] +
                         m->plan.bytes[LM_MEM_OPTIM];
        m->plan.numel = p->numel;
        m->plan.bytes[LM_MEM_PARAMS] = m->plan.bytes[LM_MEM_GRADS] = p->numel * 4;
        m->plan.bytes[LM_MEM_OPTIM] = 2 * p->numel * 4;
        m->plan.total += 4 * p->numel * 4;
    }
    m->grads = calloc((size_t)p->numel, sizeof(float));
    lm_error aerr = {0};
    if (!m->grads || lm_arena_init(&m->acts, (size_t)m->plan.bytes[LM_MEM_ACTS], &aerr) != LM_OK ||
        lm_arena_init(&m->scratch, (size_t)m->plan.bytes[LM_MEM_SCRATCH], &aerr) != LM_OK) {
        const lm_mem_plan pl = m->plan;
        lm_model_free(m);
        return lm_errorf(err, LM_ERR_NOMEM,
                         "model: cannot allocate the memory plan (gradients %lld B, activations "
                         "%lld B, scratch %lld B)",
                         (long long)pl.bytes[LM_MEM_GRADS], (long long)pl.bytes[LM_MEM_ACTS],
                         (long long)pl.bytes[LM_MEM_SCRATCH]);
    }
    /* the arenas' blocks are 64-byte aligned, so the layout's slices are too */
    bump ac = {(char *)m->acts.base, 0}, sc = {(char *)m->scratch.base, 0};
    layout(c, 1, max_tokens, m->plan.threads, m, &ac, &sc, NULL);
    LM_CHECK(ac.off == m->plan.bytes[LM_MEM_ACTS] && sc.off == m->plan.bytes[LM_MEM_SCRATCH]);
    m->acts.used = m->acts.cap;
    m->scratch.used = m->scratch.cap;
    /* the attention op's own grow-only workspace, at its worst case for max_tokens now
     * (no training step allocates: tests/test_mem_plan.c) */
    for (int i = 0; i < m->L; i++) {
        if (m->ly[i].kind != LM_LAYER_ATTN)
            continue;
        const lm_status rs =
            lm_attn_layer_ctx_reserve(&m->ly[i].ac, max_tokens, m->ly[i].actx, err);
        if (rs != LM_OK) {
            lm_model_free(m);
            return rs;
        }
    }
    *out = m;
    return LM_OK;
}

/* ---------------------------------------------------------------- AttnRes sources */

/* The sources of sublayer l (reference/attnres_ctx.md §4.2): the embedding, the
 * completed block sums of the blocks before l's block, and the running sum of l's
 * block when l is not its first sublayer. l == nsub: the final aggregation (every
 * block before the last, then the last block's sum as the running part). Returns
 * the count; src_idx[j] says what source j is: -1 embedding, else the sublayer whose
 * run[] holds it. */
static int ar_sources(const lm_model *m, int l, int *src_idx) {
    int n = 0;
    src_idx[n++] = -1;
    const int bl = l / m->S;
    for (int j = 0; j < bl && (j + 1) * m->S - 1 < m->nsub; j++)
        src_idx[n++] = (j + 1) * m->S - 1;
    if (l == m->nsub) {
        if (src_idx[n - 1] != m->nsub - 1)
            src_idx[n++] = m->nsub - 1;
    } else if (l % m->S != 0) {
        src_idx[n++] = l - 1;
    }
    return n;
}

static void ar_config(const lm_model *m, lm_attnres_config *ac, int L, int64_t N) {
    lm_attnres_config_default(ac, L, N, m->d);
    ac->eps = m->c->rms_norm_eps;
    ac->scale = 1.0f;
    ac->trusted_inputs = 1;
    ac->ws = m->arws;
}

static void add_into(float *y, const float *x, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        y[i] += x[i];
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    int B, T;
    const int64_t *cu;
    int n_cu;
    int training;
    lm_model_cache *cache; /* inference: non-NULL */
} fwd_mode;

struct lm_model_cache {
    int B;
    int64_t max_len;
    int64_t pos;             /* the rows' common position during an infer call */
    int64_t *pos_row;        /* [B] tokens consumed per row (a view: its parent's entry) */
    lm_kda_layer_state *ks;  /* [L] */
    lm_attn_layer_cache *kv; /* [L] */
    float *buf;              /* owned, NULL for a view */
    int64_t buf_floats;
    lm_model_cache *parent; /* a view of one row of parent, or NULL */
    int row;                /* the view's row in parent */
    int L;
    int64_t conv_n, st_n, kv_n; /* floats per row: a conv state, a recurrent state, K or V */
};

/* Run sublayer l on xn (normed input) into out. */
static lm_status sublayer_forward(lm_model *m, int l, const fwd_mode *fm, const float *x,
                                  float *out, lm_error *err) {
    layer_rt *ly = &m->ly[l / 2];
    const int64_t N = (int64_t)fm->B * fm->T;
    if (l % 2 == 0) {
        if (ly->kind == LM_LAYER_KDA) {
            if (fm->cache)
                return lm_kda_layer_infer(&ly->kc, fm->B, fm->T, &ly->kw, x, out,
                                          &fm->cache->ks[l / 2], ly->kctx, err);
            lm_kda_layer_batch b = {fm->B, fm->T, fm->cu, fm->n_cu};
            return lm_kda_layer_forward(&ly->kc, &b, &ly->kw, x, out, ly->kctx, err);
        }
        if (fm->cache)
            return lm_attn_layer_infer(&ly->ac, fm->B, fm->T, fm->cache->pos, &ly->aw, x, out,
                                       &fm->cache->kv[l / 2], ly->actx, err);
        lm_attn_layer_batch b = {fm->B, fm->T, fm->cu, fm->n_cu};
        return lm_attn_layer_forward(&ly->ac, &b, &ly->aw, x, out, ly->actx, err);
    }
    if (!ly->moe)
        return lm_swiglu_forward(N, m->d, ly->I, &ly->sw, x, out, fm->cache ? NULL : ly->hidden,
                                 fm->cache ? NULL : m->swiglu_ws, err);
    /* training forwards of an expert-parallel model go through the group (collective);
     * evals and inference use the local layer (every rank holds all experts) */
    ly->ep_fwd = ly->ep && fm->training && !fm->cache;
    if (!ly->ep_fwd && m->p->ep_size > 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model: layer %d holds the experts of EP rank %d of %d only: it runs "
                         "training forwards through the expert-parallel group "
                         "(lm_model_set_expert_parallel), not evals or inference",
                         l / 2, m->p->ep_rank, m->p->ep_size);
    if (ly->ep_fwd)
        return lm_moe_ep_forward(ly->ep, &ly->mw_ep, &ly->rs, x, (int)N, fm->cu, fm->n_cu, 1, out,
                                 err);
    lm_moe_set_inference(ly->mctx, fm->cache != NULL);
    return lm_moe_forward(ly->mctx, &ly->mw, &ly->rs, x, (int)N, fm->cu, fm->n_cu,
                          fm->cache ? 0 : fm->training, out, err);
}

/* Embedding through final norm: m->xfin [N, d]. */
static lm_status run_forward(lm_model *m, const fwd_mode *fm, const int32_t *ids, lm_error *err) {
    const int64_t N = (int64_t)fm->B * fm->T, d = m->d;
    const float eps = m->c->rms_norm_eps;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        memcpy(m->e + n * d, m->W_emb + (int64_t)ids[n] * d, (size_t)d * sizeof(float));
    const int attnres = m->run != NULL;
    const float *srcs[LM_MAX_LAYERS * 2 + 2];
    int sidx[LM_MAX_LAYERS * 2 + 2];
    for (int l = 0; l < m->nsub; l++) {
        layer_rt *ly = &m->ly[l / 2];
        float *h = m->h[l];
        if (attnres) {
            int ns = ar_sources(m, l, sidx);
            if (ns == 1) {
                memcpy(h, m->e, (size_t)(N * d) * sizeof(float));
            } else {
                for (int j = 0; j < ns; j++)
                    srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
                lm_attnres_config ac;
                ar_config(m, &ac, ns, N);
                LM_TRY(lm_attnres_forward_ptrs(&ac, srcs, ly->arq[l % 2], ly->arn[l % 2], h, err));
            }
        } else if (l == 0) {
            memcpy(h, m->e, (size_t)(N * d) * sizeof(float));
        }
        LM_TRY(lm_rmsnorm_forward(N, (int)d, eps, h, ly->norm_w[l % 2], m->xn[l], m->rstd[l], err));
        float *o = attnres ? m->run[l] : m->tmp;
        lm_status st = sublayer_forward(m, l, fm, m->xn[l], o, err);
        if (st != LM_OK) {
            char buf[sizeof(err->msg)];
            snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
            return lm_errorf(err, st, "model: layer %d %s: %s", l / 2 + 1, l % 2 ? "ffn" : "mixer",
                             buf);
        }
        if (attnres) {
            if (l % m->S != 0)
                add_into(o, m->run[l - 1], N * d);
        } else {
            float *hn = l + 1 < m->nsub ? m->h[l + 1] : m->hfin;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < N * d; i++)
                hn[i] = h[i] + o[i];
        }
    }
    if (attnres) {
        int ns = ar_sources(m, m->nsub, sidx);
        for (int j = 0; j < ns; j++)
            srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
        lm_attnres_config ac;
        ar_config(m, &ac, ns, N);
        LM_TRY(lm_attnres_forward_ptrs(&ac, srcs, m->arq_fin, m->arn_fin, m->hfin, err));
    }
    LM_TRY(lm_model_check_finite("final", "forward", "hidden", m->hfin, N * d, err));
    return lm_rmsnorm_forward(N, (int)d, eps, m->hfin, m->norm_fin, m->xfin, m->rstd_fin, err);
}

static lm_status check_ids(const lm_model *m, const int32_t *ids, int64_t N, const char *what,
                           int allow_ignore, lm_error *err) {
    if (!ids)
        return lm_errorf(err, LM_ERR_INVALID, "model: %s is NULL", what);
    for (int64_t n = 0; n < N; n++) {
        if (allow_ignore && ids[n] == LM_MODEL_IGNORE)
            continue;
        if (ids[n] < 0 || ids[n] >= m->V)
            return lm_errorf(err, LM_ERR_INVALID,
                             "model: %s[%lld] = %d is outside [0, vocab_size = %d)", what,
                             (long long)n, ids[n], m->V);
    }
    return LM_OK;
}

static void write_logits(lm_model *m, int64_t N, float *logits) {
    lm_model_mm(0, 1, (int)N, m->V, m->d, m->xfin, m->d, m->W_head, m->d, 0, logits, m->V);
}

lm_status lm_model_forward(lm_model *m, const lm_model_batch *b, const int32_t *ids,
                           const int32_t *labels, int training, float *logits, double *loss,
                           int64_t *n_labels, lm_error *err) {
    if (!m || !b)
        return lm_errorf(err, LM_ERR_INVALID, "model: NULL model or batch");
    m->have_fwd = 0;
    if (b->B < 1 || b->T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "model: batch B = %d, T = %d (want >= 1)", b->B,
                         b->T);
    const int64_t N = (int64_t)b->B * b->T;
    if (N > m->max_tokens)
        return lm_errorf(err, LM_ERR_INVALID, "model: batch of %lld tokens > max_tokens = %lld",
                         (long long)N, (long long)m->max_tokens);
    if (b->cu_seqlens) {
        if (b->B != 1 || b->n_cu_seqlens < 2 || b->n_cu_seqlens > m->max_tokens + 1)
            return lm_errorf(err, LM_ERR_INVALID,
                             "model: cu_seqlens needs B == 1 and 2 .. T+1 entries (B = %d, %d "
                             "entries)",
                             b->B, b->n_cu_seqlens);
        if (b->cu_seqlens[0] != 0 || b->cu_seqlens[b->n_cu_seqlens - 1] != b->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "model: cu_seqlens must start at 0 and end at T = %d (got %lld .. "
                             "%lld)",
                             b->T, (long long)b->cu_seqlens[0],
                             (long long)b->cu_seqlens[b->n_cu_seqlens - 1]);
        for (int j = 1; j < b->n_cu_seqlens; j++)
            if (b->cu_seqlens[j] < b->cu_seqlens[j - 1])
                return lm_errorf(
                    err, LM_ERR_INVALID, "model: cu_seqlens[%d] = %lld < cu_seqlens[%d] = %lld", j,
                    (long long)b->cu_seqlens[j], j - 1, (long long)b->cu_seqlens[j - 1]);
        memcpy(m->cu, b->cu_seqlens, (size_t)b->n_cu_seqlens * sizeof(int64_t));
    }
    LM_TRY(check_ids(m, ids, N, "ids", 0, err));
    if (labels)
        LM_TRY(check_ids(m, labels, N, "labels", 1, err));
    memcpy(m->ids, ids, (size_t)N * sizeof(int32_t));
    fwd_mode fm = {b->B,
                   b->T,
                   b->cu_seqlens ? m->cu : NULL,
                   b->cu_seqlens ? b->n_cu_seqlens : 0,
                   training ? 1 : 0,
                   NULL};
    LM_TRY(run_forward(m, &fm, m->ids, err));
    if (logits)
        write_logits(m, N, logits);
    double total = 0;
    int64_t cnt = 0;
    if (labels) {
        memcpy(m->labels, labels, (size_t)N * sizeof(int32_t));
        lm_ce_config cc;
        lm_ce_config_default(&cc, N, m->d, m->V);
        cc.ignore_index = LM_MODEL_IGNORE;
        if (lm_cross_entropy_ws_floats(&cc) <= m->ce_ws_floats) {
            cc.ws = m->ce_ws; /* planned at the thread count of lm_model_new */
            cc.ws_floats = m->ce_ws_floats;
        }
        LM_TRY(lm_cross_entropy_forward(&cc, m->xfin, m->W_head, m->labels, &total, &cnt, m->lse,
                                        err));
        for (int i = 0; i < m->L; i++)
            if (m->ly[i].moe)
                total += lm_model_route(m, i)->aux_loss;
    }
    m->B = b->B;
    m->T = b->T;
    m->n_cu = fm.n_cu;
    m->N = N;
    m->have_labels = labels != NULL;
    m->n_labels = cnt;
    m->loss = total;
    m->have_fwd = 1;
    if (loss)
        *loss = total;
    if (n_labels)
        *n_labels = cnt;
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

/* Backward of sublayer l: dout -> m->dxn (gradient of the normed input), weight
 * gradients into m->grads (added in place when m->acc). */
static lm_status sublayer_backward(lm_model *m, int l, const float *dout, lm_error *err) {
    layer_rt *ly = &m->ly[l / 2];
    const int64_t N = m->N;
    const float *x = m->xn[l];
    if (l % 2 == 0) {
        if (ly->kind == LM_LAYER_KDA) {
            const lm_kda_layer_weights *w = &ly->kw;
            lm_kda_layer_grads g = {
                G_of(m, w->q_proj),   G_of(m, w->k_proj),   G_of(m, w->v_proj),
                G_of(m, w->q_conv1d), G_of(m, w->k_conv1d), G_of(m, w->v_conv1d),
                G_of(m, w->f_a_proj), G_of(m, w->f_b_proj), G_of(m, w->A_log),
                G_of(m, w->dt_bias),  G_of(m, w->b_proj),   G_of(m, w->g_a_proj),
                G_of(m, w->g_b_proj), G_of(m, w->o_norm),   G_of(m, w->o_proj)};
            lm_kda_layer_batch b = {m->B, m->T, m->n_cu ? m->cu : NULL, m->n_cu};
            return lm_kda_layer_backward_acc(&ly->kc, &b, w, x, dout, m->dxn, &g, m->acc, ly->kctx,
                                             err);
        }
        const lm_attn_layer_weights *w = &ly->aw;
        lm_attn_layer_grads g = {G_of(m, w->q_proj), G_of(m, w->k_proj), G_of(m, w->v_proj),
                                 G_of(m, w->o_proj)};
        lm_attn_layer_batch b = {m->B, m->T, m->n_cu ? m->cu : NULL, m->n_cu};
        return lm_attn_layer_backward_acc(&ly->ac, &b, w, x, dout, m->dxn, &g, m->acc, ly->actx,
                                          err);
    }
    if (!ly->moe) {
        /* SwiGLU overwrites its weight gradients: staged when accumulating */
        const int64_t nw = (int64_t)ly->I * m->d;
        lm_swiglu_grads g = {G_dst(m, ly->sw.gate_proj, 0), G_dst(m, ly->sw.up_proj, nw),
                             G_dst(m, ly->sw.down_proj, 2 * nw)};
        LM_TRY(lm_swiglu_backward(N, m->d, ly->I, &ly->sw, x, ly->hidden, dout, m->dxn, &g,
                                  m->swiglu_ws, err));
        stage_add(m, ly->sw.gate_proj, 0, nw);
        stage_add(m, ly->sw.up_proj, nw, nw);
        stage_add(m, ly->sw.down_proj, 2 * nw, nw);
        return LM_OK;
    }
    /* the MoE op overwrites its weight gradients: staged when accumulating */
    lm_moe_grads g;
    int64_t off[LM_MOE_N_WEIGHTS], n[LM_MOE_N_WEIGHTS], o = 0;
    for (int w = 0; w < LM_MOE_N_WEIGHTS; w++) {
        n[w] = 0;
        if (ly->mw.p[w])
            n[w] = param_numel_of(m, ly->mw.p[w]);
        off[w] = o;
        o += n[w];
        g.p[w] = G_dst(m, ly->mw.p[w], off[w]);
    }
    LM_CHECK(o <= m->stage_floats);
    if (ly->ep_fwd) {
        /* this rank's experts only: the others' gradients are zero here (their owners
         * hold them; the trainer's sum over the ranks adds them exactly) */
        const int e0 = lm_moe_ep_first_expert(ly->ep), El = lm_moe_ep_num_local(ly->ep);
        lm_moe_grads ge = g;
        for (int w = LM_MOE_EXPERTS_GATE_PROJ; w <= LM_MOE_EXPERTS_DOWN_PROJ && m->p->ep_size == 1;
             w++) {
            const int64_t per = n[w] / ly->mc.router.num_experts;
            float *full = g.p[w];
            ge.p[w] = full + (int64_t)e0 * per;
            memset(full, 0, sizeof(float) * (size_t)(e0 * per));
            memset(full + (int64_t)(e0 + El) * per, 0,
                   sizeof(float) * (size_t)(n[w] - (int64_t)(e0 + El) * per));
        }
        lm_moe_ep_set_aux_scale(ly->ep,
                                isfinite(m->ep_aux_scale) ? m->ep_aux_scale : m->loss_scale);
        LM_TRY(lm_moe_ep_backward(ly->ep, &ly->mw_ep, x, dout, m->dxn, &ge, err));
        for (int w = 0; w < LM_MOE_N_WEIGHTS; w++)
            stage_add(m, ly->mw.p[w], off[w], n[w]);
        return LM_OK;
    }
    lm_moe_ctx_set_aux_scale(ly->mctx, m->loss_scale); /* backward of scale * (CE + aux) */
    LM_TRY(lm_moe_backward(ly->mctx, &ly->mw, x, dout, m->dxn, &g, err));
    for (int w = 0; w < LM_MOE_N_WEIGHTS; w++)
        stage_add(m, ly->mw.p[w], off[w], n[w]);
    return LM_OK;
}

lm_status lm_model_backward(lm_model *m, float loss_scale, int accumulate, lm_error *err) {
    if (!m || !m->have_fwd || !m->have_labels)
        return lm_errorf(err, LM_ERR_INVALID, "model: backward needs a forward with labels first");
    if (!isfinite(loss_scale))
        return lm_errorf(err, LM_ERR_INVALID, "model: loss_scale = %g is not finite",
                         (double)loss_scale);
    const int64_t N = m->N, d = m->d, Nd = N * d;
    const float eps = m->c->rms_norm_eps;
    /* In place: accumulate = 0 zeroes the gradient buffer, then every writer adds (the
     * AttnRes backward, the embedding scatter, the GEMMs with beta = 1) or, for ops
     * that overwrite, writes its tensor directly (accumulate = 0: the only writer, on
     * zeros) or through the stage (accumulate = 1). */
    m->acc = accumulate ? 1 : 0;
    m->loss_scale = loss_scale;
    if (!m->acc)
        memset(m->grads, 0, (size_t)m->p->numel * sizeof(float));
    /* head and final norm */
    lm_ce_config cc;
    lm_ce_config_default(&cc, N, m->d, m->V);
    cc.ignore_index = LM_MODEL_IGNORE;
    if (lm_cross_entropy_ws_floats(&cc) <= m->ce_ws_floats) {
        cc.ws = m->ce_ws; /* planned at the thread count of lm_model_new */
        cc.ws_floats = m->ce_ws_floats;
    }
    const int64_t nhead = (int64_t)m->V * d;
    LM_TRY(lm_cross_entropy_backward(&cc, m->xfin, m->W_head, m->labels, m->lse, loss_scale, m->tmp,
                                     G_dst(m, m->W_head, 0), err));
    stage_add(m, m->W_head, 0, nhead);
    LM_TRY(lm_rmsnorm_backward_ws(N, (int)d, eps, m->hfin, m->norm_fin, m->rstd_fin, m->tmp, m->dh,
                                  G_dst(m, m->norm_fin, 0), m->norm_ws, err));
    stage_add(m, m->norm_fin, 0, d);
    const int attnres = m->run != NULL;
    const float *srcs[LM_MAX_LAYERS * 2 + 2];
    float *dsrc[LM_MAX_LAYERS * 2 + 2];
    int sidx[LM_MAX_LAYERS * 2 + 2];
    /* dsrc target of a source: the embedding accumulator, the block accumulator of a
     * completed block, or G for the running part (the source at run[l-1] of the
     * current sublayer, or the last block in the final aggregation). */
    memset(m->dE, 0, (size_t)Nd * sizeof(float));
    if (attnres) {
        for (int j = 0; j < m->nblocks; j++)
            memset(m->dB[j], 0, (size_t)Nd * sizeof(float));
        memset(m->G, 0, (size_t)Nd * sizeof(float));
        int ns = ar_sources(m, m->nsub, sidx);
        for (int j = 0; j < ns; j++) {
            srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
            dsrc[j] = sidx[j] < 0 ? m->dE : sidx[j] == m->nsub - 1 ? m->G : m->dB[sidx[j] / m->S];
        }
        lm_attnres_config ac;
        ar_config(m, &ac, ns, N);
        ac.accumulate = 1; /* into dsrc and into the gradient buffer (zeroed or summing) */
        LM_TRY(lm_attnres_backward_ptrs(&ac, srcs, m->arq_fin, m->arn_fin, m->dh, dsrc,
                                        G_of(m, m->arq_fin), G_of(m, m->arn_fin), err));
    } else {
        memcpy(m->G, m->dh, (size_t)Nd * sizeof(float));
    }
    for (int l = m->nsub - 1; l >= 0; l--) {
        layer_rt *ly = &m->ly[l / 2];
        /* G = dL/d(run[l]) (AttnRes) or dL/d(h_{l+1}) (standard). A block's last
         * sublayer (not the model's last) takes its block's accumulated gradient. */
        if (attnres && l != m->nsub - 1 && l % m->S == m->S - 1)
            memcpy(m->G, m->dB[l / m->S], (size_t)Nd * sizeof(float));
        lm_status st = sublayer_backward(m, l, m->G, err);
        if (st != LM_OK) {
            char buf[sizeof(err->msg)];
            snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
            return lm_errorf(err, st, "model: layer %d %s backward: %s", l / 2 + 1,
                             l % 2 ? "ffn" : "mixer", buf);
        }
        LM_TRY(lm_rmsnorm_backward_ws(N, (int)d, eps, m->h[l], ly->norm_w[l % 2], m->rstd[l],
                                      m->dxn, m->dh, G_dst(m, ly->norm_w[l % 2], 0), m->norm_ws,
                                      err));
        stage_add(m, ly->norm_w[l % 2], 0, d);
        if (!attnres) {
            add_into(m->G, m->dh, Nd); /* h_l feeds both h_{l+1} and the sublayer */
            continue;
        }
        int ns = ar_sources(m, l, sidx);
        if (ns == 1) {
            add_into(m->dE, m->dh, Nd);
            continue;
        }
        for (int j = 0; j < ns; j++) {
            srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
            dsrc[j] = sidx[j] < 0                           ? m->dE
                      : (l % m->S != 0 && sidx[j] == l - 1) ? m->G
                                                            : m->dB[sidx[j] / m->S];
        }
        /* G (= dL/d run[l]) flows unchanged into run[l-1] (run[l] = run[l-1] + o_l);
         * the AR adds its part gradient on top. At a block's first sublayer G is
         * not a source and gets reset at the previous block's last sublayer. */
        lm_attnres_config ac;
        ar_config(m, &ac, ns, N);
        ac.accumulate = 1;
        LM_TRY(lm_attnres_backward_ptrs(&ac, srcs, ly->arq[l % 2], ly->arn[l % 2], m->dh, dsrc,
                                        G_of(m, ly->arq[l % 2]), G_of(m, ly->arn[l % 2]), err));
    }
    if (!attnres)
        memcpy(m->dE, m->G, (size_t)Nd * sizeof(float));
    /* embedding rows: fixed token order (serial over tokens, parallel over columns) */
    float *dW = G_of(m, m->W_emb);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < d; j++)
        for (int64_t n = 0; n < N; n++)
            dW[(int64_t)m->ids[n] * d + j] += m->dE[n * d + j];
    /* buffers carry no gradient */
    for (int t = 0; t < m->p->n; t++)
        if (m->p->t[t].buffer)
            memset(m->grads + m->p->t[t].offset, 0, (size_t)m->p->t[t].numel * sizeof(float));
    m->acc = 0;
    return LM_OK;
}

/* ---------------------------------------------------------------- depth weights */

int lm_model_attnres_weights(const lm_model *m, int l, double *p_mean, int max_out) {
    if (!m || !m->run || l < 0 || l > m->nsub || m->N < 1)
        return 0;
    int sidx[LM_MAX_LAYERS * 2 + 2];
    const int ns = ar_sources(m, l, sidx);
    if (ns > max_out)
        return 0;
    const float *q = l == m->nsub ? m->arq_fin : m->ly[l / 2].arq[l % 2];
    const float *g = l == m->nsub ? m->arn_fin : m->ly[l / 2].arn[l % 2];
    const int64_t N = m->N, d = m->d;
    const double eps = m->c->rms_norm_eps;
    for (int j = 0; j < ns; j++)
        p_mean[j] = 0;
    if (ns == 1) {
        p_mean[0] = 1;
        return 1;
    }
    double s[LM_MAX_LAYERS * 2 + 2];
    for (int64_t n = 0; n < N; n++) {
        double mx = -INFINITY, z = 0;
        for (int j = 0; j < ns; j++) {
            const float *C = (sidx[j] < 0 ? m->e : m->run[sidx[j]]) + n * d;
            double ms = 0, dot = 0;
            for (int64_t k = 0; k < d; k++) {
                ms += (double)C[k] * C[k];
                dot += (double)q[k] * g[k] * C[k];
            }
            s[j] = dot / sqrt(ms / (double)d + eps);
            if (s[j] > mx)
                mx = s[j];
        }
        for (int j = 0; j < ns; j++)
            z += exp(s[j] - mx);
        for (int j = 0; j < ns; j++)
            p_mean[j] += exp(s[j] - mx) / z / (double)N;
    }
    return ns;
}

/* ---------------------------------------------------------------- FLOPs */

double lm_model_train_flops_per_token(const lm_model_config *c, int T) {
    const double d = c->hidden_size;
    double mm = (double)c->vocab_size * d; /* LM head */
    double extra = 0;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        if (c->kinds[i] == LM_LAYER_KDA) {
            const double H = c->kda_num_heads, Dh = c->kda_head_dim, HD = H * Dh;
            mm += 3 * HD * d + Dh * d + HD * Dh + H * d + Dh * d + HD * Dh + d * HD;
            /* KDA op forward + backward per token (reference/kda.md §6.1, bench kda) */
            const double Cc = c->chunk_size, dk = Dh, dv = Dh;
            extra += H * (6 * dk * dv + Cc * (6 * dk + 4 * dv) + 16 * dk * dv +
                          Cc * (12 * dk + 10 * dv) + 4 * Cc * Cc);
        } else {
            const double Hq = c->num_attention_heads, Hkv = c->num_key_value_heads, D = c->head_dim;
            mm += (Hq * D + 2 * Hkv * D) * d + d * Hq * D;
            extra += 6.0 * T * Hq * D; /* causal: half of 12*T*Hq*D */
        }
        if (!lm_model_layer_is_moe(c, i)) {
            mm += 3.0 * c->intermediate_size * d;
        } else {
            const double E = c->moe.router.num_experts, k = c->moe.router.num_experts_per_tok,
                         f = c->moe.moe_intermediate_size, ns = c->moe.n_shared_experts;
            mm += E * d + k * 3 * f * d + ns * 3 * f * d;
        }
    }
    return 6 * mm + extra;
}

/* ---------------------------------------------------------------- inference */

lm_status lm_model_cache_new(lm_model_cache **out, const lm_model *m, int B, int64_t max_len,
                             lm_error *err) {
    *out = NULL;
    if (!m || B < 1 || max_len < 1 || (int64_t)B * max_len > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID, "model cache: B = %d, max_len = %lld (want >= 1)", B,
                         (long long)max_len);
    const lm_model_config *c = m->c;
    int64_t total = 0;
    const int64_t C = (int64_t)c->kda_num_heads * c->kda_head_dim,
                  Wm = c->short_conv_kernel_size - 1;
    const int64_t kda_f =
        3 * B * C * Wm + (int64_t)B * c->kda_num_heads * c->kda_head_dim * c->kda_head_dim;
    const int64_t kv_f = 2 * B * max_len * (int64_t)c->num_key_value_heads * c->head_dim;
    for (int i = 0; i < m->L; i++)
        total += c->kinds[i] == LM_LAYER_KDA ? kda_f : kv_f;
    lm_model_cache *k = LM_CALLOC(1, sizeof(*k));
    k->B = B;
    k->max_len = max_len;
    k->ks = LM_CALLOC((size_t)m->L, sizeof(lm_kda_layer_state));
    k->kv = LM_CALLOC((size_t)m->L, sizeof(lm_attn_layer_cache));
    k->buf = calloc((size_t)(total > 0 ? total : 1), sizeof(float));
    if (!k->buf) {
        free(k->ks);
        free(k->kv);
        free(k);
        return lm_errorf(err, LM_ERR_NOMEM, "model cache: cannot allocate %lld floats",
                         (long long)total);
    }
    k->buf_floats = total;
    k->L = m->L;
    k->pos_row = LM_CALLOC((size_t)B, sizeof(int64_t));
    k->conv_n = C * Wm;
    k->st_n = (int64_t)c->kda_num_heads * c->kda_head_dim * c->kda_head_dim;
    k->kv_n = max_len * (int64_t)c->num_key_value_heads * c->head_dim;
    float *q = k->buf;
    for (int i = 0; i < m->L; i++) {
        if (c->kinds[i] == LM_LAYER_KDA) {
            k->ks[i].conv_q = q;
            q += B * C * Wm;
            k->ks[i].conv_k = q;
            q += B * C * Wm;
            k->ks[i].conv_v = q;
            q += B * C * Wm;
            k->ks[i].state = q;
            q += (int64_t)B * c->kda_num_heads * c->kda_head_dim * c->kda_head_dim;
        } else {
            const int64_t n = B * max_len * (int64_t)c->num_key_value_heads * c->head_dim;
            k->kv[i].k_cache = q;
            q += n;
            k->kv[i].v_cache = q;
            q += n;
            k->kv[i].Tmax = max_len;
        }
    }
    *out = k;
    return LM_OK;
}

void lm_model_cache_free(lm_model_cache *c) {
    if (!c)
        return;
    if (!c->parent) {
        free(c->buf);
        free(c->pos_row);
    }
    free(c->ks);
    free(c->kv);
    free(c);
}

lm_status lm_model_cache_view(lm_model_cache **out, lm_model_cache *c, const lm_model *m, int row,
                              int nrows, lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "model cache view: NULL output");
    *out = NULL;
    if (!c || !m || c->parent || c->L != m->L)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model cache view: needs a model and a cache of it (not a view)");
    if (row < 0 || nrows < 1 || row > c->B - nrows)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model cache view: rows %d .. %d outside the cache's [0, %d)", row,
                         row + nrows - 1, c->B);
    lm_model_cache *v = LM_CALLOC(1, sizeof(*v));
    v->B = nrows;
    v->max_len = c->max_len;
    v->L = c->L;
    v->conv_n = c->conv_n;
    v->st_n = c->st_n;
    v->kv_n = c->kv_n;
    v->parent = c;
    v->row = row;
    v->pos_row = c->pos_row + row;
    v->ks = LM_CALLOC((size_t)c->L, sizeof(lm_kda_layer_state));
    v->kv = LM_CALLOC((size_t)c->L, sizeof(lm_attn_layer_cache));
    for (int i = 0; i < c->L; i++) {
        if (c->ks[i].state) {
            v->ks[i].conv_q = c->ks[i].conv_q + row * c->conv_n;
            v->ks[i].conv_k = c->ks[i].conv_k + row * c->conv_n;
            v->ks[i].conv_v = c->ks[i].conv_v + row * c->conv_n;
            v->ks[i].state = c->ks[i].state + row * c->st_n;
        }
        if (c->kv[i].k_cache) {
            v->kv[i].k_cache = c->kv[i].k_cache + row * c->kv_n;
            v->kv[i].v_cache = c->kv[i].v_cache + row * c->kv_n;
            v->kv[i].Tmax = c->max_len;
        }
    }
    *out = v;
    return LM_OK;
}

void lm_model_cache_reset_row(lm_model_cache *c, int row) {
    if (!c)
        return;
    if (c->parent) { /* a view: its row `row` */
        if (row < 0 || row >= c->B)
            return;
        row += c->row;
        c = c->parent;
    }
    if (row < 0 || row >= c->B)
        return;
    for (int i = 0; i < c->L; i++) {
        if (!c->ks[i].state)
            continue; /* a KV cache needs no clearing: only positions
                          below the row's are read */
        memset(c->ks[i].conv_q + row * c->conv_n, 0, sizeof(float) * (size_t)c->conv_n);
        memset(c->ks[i].conv_k + row * c->conv_n, 0, sizeof(float) * (size_t)c->conv_n);
        memset(c->ks[i].conv_v + row * c->conv_n, 0, sizeof(float) * (size_t)c->conv_n);
        memset(c->ks[i].state + row * c->st_n, 0, sizeof(float) * (size_t)c->st_n);
    }
    c->pos_row[row] = 0;
}

lm_status lm_model_cache_copy_row(lm_model_cache *c, int dst, int src, lm_error *err) {
    if (!c || c->parent)
        return lm_errorf(err, LM_ERR_INVALID, "model cache copy_row: needs a cache (not a view)");
    if (dst < 0 || dst >= c->B || src < 0 || src >= c->B)
        return lm_errorf(err, LM_ERR_INVALID, "model cache copy_row: rows %d <- %d outside [0, %d)",
                         dst, src, c->B);
    if (dst == src)
        return LM_OK;
    const int64_t pos = c->pos_row[src];
    for (int i = 0; i < c->L; i++) {
        if (c->ks[i].state) {
            float *p[4] = {c->ks[i].conv_q, c->ks[i].conv_k, c->ks[i].conv_v, c->ks[i].state};
            for (int j = 0; j < 4; j++) {
                const int64_t n = j < 3 ? c->conv_n : c->st_n;
                memcpy(p[j] + dst * n, p[j] + src * n, sizeof(float) * (size_t)n);
            }
        }
        if (c->kv[i].k_cache) {
            /* positions 0 .. pos-1 of the row: [Tmax, Hkv, D] per row, the first pos */
            const int64_t per = c->kv_n / c->max_len, n = pos * per;
            memcpy(c->kv[i].k_cache + dst * c->kv_n, c->kv[i].k_cache + src * c->kv_n,
                   sizeof(float) * (size_t)n);
            memcpy(c->kv[i].v_cache + dst * c->kv_n, c->kv[i].v_cache + src * c->kv_n,
                   sizeof(float) * (size_t)n);
        }
    }
    c->pos_row[dst] = pos;
    return LM_OK;
}

void lm_model_cache_row_sizes(const lm_model_cache *c, int64_t *recurrent_floats,
                              int64_t *kv_floats_per_pos) {
    int64_t r = 0, kv = 0;
    for (int i = 0; c && i < c->L; i++) {
        if (c->ks[i].state)
            r += 3 * c->conv_n + c->st_n;
        if (c->kv[i].k_cache)
            kv += 2 * (c->kv_n / c->max_len);
    }
    if (recurrent_floats)
        *recurrent_floats = r;
    if (kv_floats_per_pos)
        *kv_floats_per_pos = kv;
}

/* The owning cache and row of (c, row): a view's row in its parent. */
static lm_model_cache *row_owner(const lm_model_cache *c, int *row) {
    if (c->parent) {
        *row += c->row;
        return c->parent;
    }
    return (lm_model_cache *)c;
}

lm_status lm_model_cache_save_row(const lm_model_cache *c, int row, int64_t t0, int64_t t1,
                                  float *recurrent, float *kv, lm_error *err) {
    if (!c || row < 0 || row >= c->B)
        return lm_errorf(err, LM_ERR_INVALID, "model cache save_row: row %d outside [0, %d)", row,
                         c ? c->B : 0);
    if (t0 < 0 || t1 < t0 || t1 > c->pos_row[row])
        return lm_errorf(err, LM_ERR_INVALID,
                         "model cache save_row: positions [%lld, %lld) outside the row's [0, %lld)",
                         (long long)t0, (long long)t1, (long long)c->pos_row[row]);
    const lm_model_cache *o = row_owner(c, &row);
    for (int i = 0; i < o->L; i++) {
        if (recurrent && o->ks[i].state) {
            const float *p[4] = {o->ks[i].conv_q, o->ks[i].conv_k, o->ks[i].conv_v, o->ks[i].state};
            for (int j = 0; j < 4; j++) {
                const int64_t n = j < 3 ? o->conv_n : o->st_n;
                memcpy(recurrent, p[j] + row * n, sizeof(float) * (size_t)n);
                recurrent += n;
            }
        }
    }
    if (kv) {
        const int64_t per = o->kv_n / o->max_len;
        for (int64_t t = t0; t < t1; t++)
            for (int i = 0; i < o->L; i++) {
                if (!o->kv[i].k_cache)
                    continue;
                memcpy(kv, o->kv[i].k_cache + row * o->kv_n + t * per, sizeof(float) * (size_t)per);
                kv += per;
                memcpy(kv, o->kv[i].v_cache + row * o->kv_n + t * per, sizeof(float) * (size_t)per);
                kv += per;
            }
    }
    return LM_OK;
}

lm_status lm_model_cache_load_row(lm_model_cache *c, int row, int64_t t0, int64_t t1,
                                  const float *recurrent, const float *kv, lm_error *err) {
    if (!c || row < 0 || row >= c->B)
        return lm_errorf(err, LM_ERR_INVALID, "model cache load_row: row %d outside [0, %d)", row,
                         c ? c->B : 0);
    if (t0 < 0 || t1 < t0 || t1 > c->max_len)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model cache load_row: positions [%lld, %lld) outside [0, max_len = %lld]",
                         (long long)t0, (long long)t1, (long long)c->max_len);
    int64_t *pos = &c->pos_row[row];
    lm_model_cache *o = row_owner(c, &row);
    for (int i = 0; i < o->L; i++) {
        if (recurrent && o->ks[i].state) {
            float *p[4] = {o->ks[i].conv_q, o->ks[i].conv_k, o->ks[i].conv_v, o->ks[i].state};
            for (int j = 0; j < 4; j++) {
                const int64_t n = j < 3 ? o->conv_n : o->st_n;
                memcpy(p[j] + row * n, recurrent, sizeof(float) * (size_t)n);
                recurrent += n;
            }
        }
    }
    if (kv) {
        const int64_t per = o->kv_n / o->max_len;
        for (int64_t t = t0; t < t1; t++)
            for (int i = 0; i < o->L; i++) {
                if (!o->kv[i].k_cache)
                    continue;
                memcpy(o->kv[i].k_cache + row * o->kv_n + t * per, kv, sizeof(float) * (size_t)per);
                kv += per;
                memcpy(o->kv[i].v_cache + row * o->kv_n + t * per, kv, sizeof(float) * (size_t)per);
                kv += per;
            }
    }
    *pos = t1;
    return LM_OK;
}

void lm_model_cache_reset(lm_model_cache *c) {
    if (!c)
        return;
    if (c->parent) {
        for (int r = 0; r < c->B; r++)
            lm_model_cache_reset_row(c, r);
        return;
    }
    memset(c->buf, 0, (size_t)c->buf_floats * sizeof(float));
    memset(c->pos_row, 0, sizeof(int64_t) * (size_t)c->B);
    c->pos = 0;
}

int64_t lm_model_cache_pos(const lm_model_cache *c) { return c ? c->pos_row[0] : 0; }

int64_t lm_model_cache_row_pos(const lm_model_cache *c, int row) {
    return c && row >= 0 && row < c->B ? c->pos_row[row] : 0;
}

lm_status lm_model_infer(lm_model *m, lm_model_cache *c, const int32_t *ids, int T, int last_only,
                         float *logits, lm_error *err) {
    if (!m || !c)
        return lm_errorf(err, LM_ERR_INVALID, "model infer: NULL model or cache");
    if (T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "model infer: T = %d (want >= 1)", T);
    const int64_t N = (int64_t)c->B * T;
    if (N > m->max_tokens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model infer: B*T = %lld tokens > the model's max_tokens = %lld",
                         (long long)N, (long long)m->max_tokens);
    if (c->L != m->L)
        return lm_errorf(err, LM_ERR_INVALID, "model infer: the cache is not of this model");
    /* the rows' positions: all equal (one pos for the layers), or differing, which a
     * decode step (T = 1) takes row by row (kv.pos_rows) */
    int same = 1;
    for (int b = 0; b < c->B; b++) {
        if (c->pos_row[b] + T > c->max_len)
            return lm_errorf(err, LM_ERR_INVALID,
                             "model infer: row %d: position %lld + %d new tokens > cache max_len "
                             "= %lld",
                             b, (long long)c->pos_row[b], T, (long long)c->max_len);
        same &= c->pos_row[b] == c->pos_row[0];
    }
    if (!same && T != 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model infer: rows at different positions take one token at a time "
                         "(T = %d): prefill a row through lm_model_cache_view",
                         T);
    LM_TRY(check_ids(m, ids, N, "ids", 0, err));
    m->have_fwd = 0; /* the saved training activations are overwritten */
    memcpy(m->ids, ids, (size_t)N * sizeof(int32_t));
    c->pos = c->pos_row[0];
    for (int i = 0; i < c->L; i++)
        c->kv[i].pos_rows = same ? NULL : c->pos_row;
    fwd_mode fm = {c->B, T, NULL, 0, 0, c};
    LM_TRY(run_forward(m, &fm, m->ids, err));
    m->N = N;
    for (int b = 0; b < c->B; b++)
        c->pos_row[b] += T;
    c->pos = c->pos_row[0];
    if (!logits)
        return LM_OK;
    if (!last_only) {
        write_logits(m, N, logits);
        return LM_OK;
    }
    /* every row's last position in one row-wise product (the head is read once for the
     * batch; each row's logits are those it gets alone, at any B) */
    lm_gemm_rowwise(c->B, m->V, m->d, m->xfin + (int64_t)(T - 1) * m->d, T * m->d, m->W_head, m->d,
                    0, logits, m->V);
    return LM_OK;
}
