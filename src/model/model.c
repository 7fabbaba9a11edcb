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
#include "model/model_internal.h"

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
    int I;               /* dense width */
    lm_swiglu_weights sw; /* dense */
    lm_swiglu_grads sg;
    float *hidden; /* dense: [max_tokens, 2I] saved */
    lm_moe_config mc;
    lm_moe_weights mw;
    lm_moe_grads mg;
    lm_moe_ctx *mctx;
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
    float *grads; /* [numel], the public gradient buffer */
    float *gtmp;  /* [numel], one backward's gradients before (accumulating) copy */
    layer_rt *ly;
    /* activations, each [max_tokens, d] */
    float *e;        /* embedding rows */
    float **h;       /* [nsub] sublayer inputs (mixed / residual stream) */
    float **xn;      /* [nsub] normed sublayer inputs */
    float **rstd;    /* [nsub] [max_tokens] */
    float **run;     /* [nsub] running block sums after sublayer l (AttnRes) */
    float *hfin, *xfin, *rstd_fin, *lse;
    float *tmp, *tmp2; /* scratch [max_tokens, d] */
    /* backward accumulators */
    float *dE, **dB, *G, *dh, *dxn;
    float *swiglu_ws;
    lm_attnres_workspace *arws;
    const float *W_emb, *W_head, *norm_fin;
    const float *arq_fin, *arn_fin;
    /* the last forward */
    int have_fwd, have_labels, B, T, n_cu;
    int64_t N, n_labels;
    int64_t *cu;
    int32_t *ids, *labels;
    double loss;
};

/* ---------------------------------------------------------------- helpers */

static float *P(lm_params *p, const char *fmt, int i) {
    char name[LM_PARAM_NAME_MAX];
    snprintf(name, sizeof name, fmt, i);
    return lm_params_get(p, name);
}

static float *G_of(lm_model *m, const float *param) {
    if (!param) return NULL;
    return m->gtmp + (param - m->p->data);
}

lm_params *lm_model_params(lm_model *m) { return m->p; }
int64_t lm_model_max_tokens(const lm_model *m) { return m ? m->max_tokens : 0; }
float *lm_model_grads(lm_model *m) { return m->grads; }

lm_router_state *lm_model_router_state(lm_model *m, int layer) {
    if (!m || layer < 0 || layer >= m->L || !m->ly[layer].moe) return NULL;
    return &m->ly[layer].rs;
}

const lm_route *lm_model_route(const lm_model *m, int layer) {
    if (!m || layer < 0 || layer >= m->L || !m->ly[layer].moe) return NULL;
    return lm_moe_ctx_route(m->ly[layer].mctx);
}

lm_status lm_model_set_rope_theta(lm_model *m, double theta, lm_error *err) {
    if (!m) return lm_errorf(err, LM_ERR_INVALID, "model: NULL model");
    if (!(isfinite(theta) && theta > 0.0 && theta <= 3.0e38))
        return lm_errorf(err, LM_ERR_INVALID, "model: rope_theta = %g must be finite and > 0",
                         theta);
    m->p->cfg.rope_theta = (float)theta;
    for (int i = 0; i < m->L; i++)
        if (m->ly[i].kind == LM_LAYER_ATTN) m->ly[i].ac.rope_theta = m->p->cfg.rope_theta;
    return LM_OK;
}

const float *lm_model_sublayer_input(const lm_model *m, int l) {
    return m && l >= 0 && l < m->nsub ? m->h[l] : NULL;
}
const float *lm_model_block_partial(const lm_model *m, int l) {
    return m && m->run && l >= 0 && l < m->nsub ? m->run[l] : NULL;
}
const float *lm_model_embedding_out(const lm_model *m) { return m ? m->e : NULL; }

static float *act(int64_t n) { return LM_MALLOC((size_t)n * sizeof(float)); }

void lm_model_free(lm_model *m) {
    if (!m) return;
    for (int i = 0; m->ly && i < m->L; i++) {
        layer_rt *l = &m->ly[i];
        lm_kda_layer_ctx_free(l->kctx);
        lm_attn_layer_ctx_free(l->actx);
        lm_moe_ctx_free(l->mctx);
        free(l->hidden);
        if (l->moe) {
            l->rs.e_score_correction_bias = l->rs_own_bias;
            lm_router_state_free(&l->rs);
        }
    }
    free(m->ly);
    for (int l = 0; m->h && l < m->nsub; l++) {
        free(m->h[l]);
        free(m->xn[l]);
        free(m->rstd[l]);
        if (m->run) free(m->run[l]);
    }
    free(m->h);
    free(m->xn);
    free(m->rstd);
    free(m->run);
    for (int j = 0; m->dB && j < m->nblocks; j++) free(m->dB[j]);
    free(m->dB);
    free(m->e);
    free(m->hfin);
    free(m->xfin);
    free(m->rstd_fin);
    free(m->lse);
    free(m->tmp);
    free(m->tmp2);
    free(m->dE);
    free(m->G);
    free(m->dh);
    free(m->dxn);
    free(m->swiglu_ws);
    lm_attnres_workspace_free(m->arws);
    free(m->grads);
    free(m->gtmp);
    free(m->cu);
    free(m->ids);
    free(m->labels);
    free(m);
}

lm_status lm_model_new(lm_model **out, lm_params *p, int64_t max_tokens, lm_error *err) {
    *out = NULL;
    if (!p || !p->data) return lm_errorf(err, LM_ERR_INVALID, "model: no parameters");
    LM_TRY(lm_model_config_validate(&p->cfg, err));
    if (max_tokens < 1 || max_tokens > ((int64_t)1 << 30))
        return lm_errorf(err, LM_ERR_INVALID, "model: max_tokens = %lld (want 1 .. 2^30)",
                         (long long)max_tokens);
    lm_model *m = LM_CALLOC(1, sizeof(*m));
    const lm_model_config *c = &p->cfg;
    m->p = p;
    m->c = c;
    m->L = c->num_hidden_layers;
    m->nsub = 2 * m->L;
    m->d = c->hidden_size;
    m->V = c->vocab_size;
    m->max_tokens = max_tokens;
    m->S = c->residual == LM_RES_FULL_ATTNRES ? 1
           : c->residual == LM_RES_BLOCK_ATTNRES ? c->attnres_block_size
                                                  : m->nsub;
    m->nblocks = (m->nsub + m->S - 1) / m->S;
    const int64_t Nd = max_tokens * m->d;
    m->grads = LM_CALLOC((size_t)p->numel, sizeof(float));
    m->gtmp = LM_CALLOC((size_t)p->numel, sizeof(float));
    m->ly = LM_CALLOC((size_t)m->L, sizeof(layer_rt));
    lm_status st = LM_OK;
    int64_t swiglu_ws = 0;
    for (int i = 0; i < m->L && st == LM_OK; i++) {
        layer_rt *l = &m->ly[i];
        l->kind = c->kinds[i];
        l->moe = lm_model_layer_is_moe(c, i);
        const char *pre = "model.layers.%d.";
        char f[160];
#define PP(suffix) (snprintf(f, sizeof f, "%s%s", pre, suffix), P(p, f, i))
        if (l->kind == LM_LAYER_KDA) {
            lm_kda_layer_config_default(&l->kc, m->d, c->kda_num_heads, c->kda_head_dim);
            l->kc.W = c->short_conv_kernel_size;
            l->kc.gate = c->gate[i];
            l->kc.lower_bound = c->lower_bound;
            l->kc.chunk_size = c->chunk_size;
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
        } else {
            lm_attn_layer_config_default(&l->ac, m->d, c->num_attention_heads,
                                         c->num_key_value_heads, c->head_dim);
            l->ac.position = c->position[i];
            l->ac.rope_theta = c->rope_theta;
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
            l->hidden = act(max_tokens * 2 * l->I);
            int64_t ws = lm_swiglu_ws_floats(max_tokens, l->I, 1);
            if (ws > swiglu_ws) swiglu_ws = ws;
        } else {
            l->mc = c->moe;
            l->mc.hidden_size = m->d;
            static const char *const mn[LM_MOE_N_WEIGHTS] = {
                "mlp.gate.weight",           "mlp.experts.gate_proj",
                "mlp.experts.up_proj",       "mlp.experts.down_proj",
                "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                "mlp.shared_experts.down_proj"};
            for (int w = 0; w < LM_MOE_N_WEIGHTS; w++) l->mw.p[w] = PP(mn[w]);
            st = lm_moe_ctx_new(&l->mctx, &l->mc, (int)max_tokens, err);
            if (st == LM_OK) st = lm_router_state_init(&l->rs, l->mc.router.num_experts, err);
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
    if (c->residual != LM_RES_STANDARD) m->run = LM_CALLOC((size_t)m->nsub, sizeof(float *));
    for (int l = 0; l < m->nsub; l++) {
        m->h[l] = act(Nd);
        m->xn[l] = act(Nd);
        m->rstd[l] = act(max_tokens);
        if (m->run) m->run[l] = act(Nd);
    }
    if (m->run) {
        m->dB = LM_CALLOC((size_t)m->nblocks, sizeof(float *));
        for (int j = 0; j < m->nblocks; j++) m->dB[j] = act(Nd);
    }
    m->e = act(Nd);
    m->hfin = act(Nd);
    m->xfin = act(Nd);
    m->rstd_fin = act(max_tokens);
    m->lse = act(max_tokens);
    m->tmp = act(Nd);
    m->tmp2 = act(Nd);
    m->dE = act(Nd);
    m->G = act(Nd);
    m->dh = act(Nd);
    m->dxn = act(Nd);
    if (swiglu_ws > 0) m->swiglu_ws = act(swiglu_ws);
    m->arws = lm_attnres_workspace_new();
    m->cu = LM_CALLOC((size_t)max_tokens + 2, sizeof(int64_t));
    m->ids = LM_CALLOC((size_t)max_tokens, sizeof(int32_t));
    m->labels = LM_CALLOC((size_t)max_tokens, sizeof(int32_t));
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
    for (int j = 0; j < bl && (j + 1) * m->S - 1 < m->nsub; j++) src_idx[n++] = (j + 1) * m->S - 1;
    if (l == m->nsub) {
        if (src_idx[n - 1] != m->nsub - 1) src_idx[n++] = m->nsub - 1;
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
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
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
    int64_t max_len, pos;
    lm_kda_layer_state *ks;   /* [L] */
    lm_attn_layer_cache *kv;  /* [L] */
    float *buf;
    int64_t buf_floats;
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
                for (int j = 0; j < ns; j++) srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
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
            snprintf(buf, sizeof buf, "%s", err->msg);
            return lm_errorf(err, st, "model: layer %d %s: %s", l / 2,
                             l % 2 ? "ffn" : "mixer", buf);
        }
        if (attnres) {
            if (l % m->S != 0) add_into(o, m->run[l - 1], N * d);
        } else {
            float *hn = l + 1 < m->nsub ? m->h[l + 1] : m->hfin;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < N * d; i++) hn[i] = h[i] + o[i];
        }
    }
    if (attnres) {
        int ns = ar_sources(m, m->nsub, sidx);
        for (int j = 0; j < ns; j++) srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
        lm_attnres_config ac;
        ar_config(m, &ac, ns, N);
        LM_TRY(lm_attnres_forward_ptrs(&ac, srcs, m->arq_fin, m->arn_fin, m->hfin, err));
    }
    LM_TRY(lm_model_check_finite("final", "forward", "hidden", m->hfin, N * d, err));
    return lm_rmsnorm_forward(N, (int)d, eps, m->hfin, m->norm_fin, m->xfin, m->rstd_fin, err);
}

static lm_status check_ids(const lm_model *m, const int32_t *ids, int64_t N, const char *what,
                           int allow_ignore, lm_error *err) {
    if (!ids) return lm_errorf(err, LM_ERR_INVALID, "model: %s is NULL", what);
    for (int64_t n = 0; n < N; n++) {
        if (allow_ignore && ids[n] == LM_MODEL_IGNORE) continue;
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
    if (!m || !b) return lm_errorf(err, LM_ERR_INVALID, "model: NULL model or batch");
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
                return lm_errorf(err, LM_ERR_INVALID,
                                 "model: cu_seqlens[%d] = %lld < cu_seqlens[%d] = %lld", j,
                                 (long long)b->cu_seqlens[j], j - 1,
                                 (long long)b->cu_seqlens[j - 1]);
        memcpy(m->cu, b->cu_seqlens, (size_t)b->n_cu_seqlens * sizeof(int64_t));
    }
    LM_TRY(check_ids(m, ids, N, "ids", 0, err));
    if (labels) LM_TRY(check_ids(m, labels, N, "labels", 1, err));
    memcpy(m->ids, ids, (size_t)N * sizeof(int32_t));
    fwd_mode fm = {b->B, b->T, b->cu_seqlens ? m->cu : NULL, b->cu_seqlens ? b->n_cu_seqlens : 0,
                   training ? 1 : 0, NULL};
    LM_TRY(run_forward(m, &fm, m->ids, err));
    if (logits) write_logits(m, N, logits);
    double total = 0;
    int64_t cnt = 0;
    if (labels) {
        memcpy(m->labels, labels, (size_t)N * sizeof(int32_t));
        lm_ce_config cc;
        lm_ce_config_default(&cc, N, m->d, m->V);
        cc.ignore_index = LM_MODEL_IGNORE;
        LM_TRY(lm_cross_entropy_forward(&cc, m->xfin, m->W_head, m->labels, &total, &cnt, m->lse,
                                        err));
        for (int i = 0; i < m->L; i++)
            if (m->ly[i].moe) total += lm_moe_ctx_route(m->ly[i].mctx)->aux_loss;
    }
    m->B = b->B;
    m->T = b->T;
    m->n_cu = fm.n_cu;
    m->N = N;
    m->have_labels = labels != NULL;
    m->n_labels = cnt;
    m->loss = total;
    m->have_fwd = 1;
    if (loss) *loss = total;
    if (n_labels) *n_labels = cnt;
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

/* Backward of sublayer l: dout -> m->dxn (gradient of the normed input), weight
 * gradients into gtmp. */
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
            return lm_kda_layer_backward(&ly->kc, &b, w, x, dout, m->dxn, &g, ly->kctx, err);
        }
        const lm_attn_layer_weights *w = &ly->aw;
        lm_attn_layer_grads g = {G_of(m, w->q_proj), G_of(m, w->k_proj), G_of(m, w->v_proj),
                                 G_of(m, w->o_proj)};
        lm_attn_layer_batch b = {m->B, m->T, m->n_cu ? m->cu : NULL, m->n_cu};
        return lm_attn_layer_backward(&ly->ac, &b, w, x, dout, m->dxn, &g, ly->actx, err);
    }
    if (!ly->moe) {
        lm_swiglu_grads g = {G_of(m, ly->sw.gate_proj), G_of(m, ly->sw.up_proj),
                             G_of(m, ly->sw.down_proj)};
        return lm_swiglu_backward(N, m->d, ly->I, &ly->sw, x, ly->hidden, dout, m->dxn, &g,
                                  m->swiglu_ws, err);
    }
    lm_moe_grads g;
    for (int w = 0; w < LM_MOE_N_WEIGHTS; w++) g.p[w] = G_of(m, ly->mw.p[w]);
    return lm_moe_backward(ly->mctx, &ly->mw, x, dout, m->dxn, &g, err);
}

lm_status lm_model_backward(lm_model *m, float loss_scale, int accumulate, lm_error *err) {
    if (!m || !m->have_fwd || !m->have_labels)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model: backward needs a forward with labels first");
    if (!isfinite(loss_scale))
        return lm_errorf(err, LM_ERR_INVALID, "model: loss_scale = %g is not finite",
                         (double)loss_scale);
    const int64_t N = m->N, d = m->d, Nd = N * d;
    const float eps = m->c->rms_norm_eps;
    memset(m->gtmp, 0, (size_t)m->p->numel * sizeof(float));
    /* head and final norm */
    lm_ce_config cc;
    lm_ce_config_default(&cc, N, m->d, m->V);
    cc.ignore_index = LM_MODEL_IGNORE;
    float *dWhead = G_of(m, m->W_head);
    LM_TRY(lm_cross_entropy_backward(&cc, m->xfin, m->W_head, m->labels, m->lse, loss_scale,
                                     m->tmp, dWhead, err));
    LM_TRY(lm_rmsnorm_backward(N, (int)d, eps, m->hfin, m->norm_fin, m->rstd_fin, m->tmp,
                               m->dh, G_of(m, m->norm_fin), err));
    const int attnres = m->run != NULL;
    const float *srcs[LM_MAX_LAYERS * 2 + 2];
    float *dsrc[LM_MAX_LAYERS * 2 + 2];
    int sidx[LM_MAX_LAYERS * 2 + 2];
    /* dsrc target of a source: the embedding accumulator, the block accumulator of a
     * completed block, or G for the running part (the source at run[l-1] of the
     * current sublayer, or the last block in the final aggregation). */
    memset(m->dE, 0, (size_t)Nd * sizeof(float));
    if (attnres) {
        for (int j = 0; j < m->nblocks; j++) memset(m->dB[j], 0, (size_t)Nd * sizeof(float));
        memset(m->G, 0, (size_t)Nd * sizeof(float));
        int ns = ar_sources(m, m->nsub, sidx);
        for (int j = 0; j < ns; j++) {
            srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
            dsrc[j] = sidx[j] < 0 ? m->dE
                      : sidx[j] == m->nsub - 1 ? m->G
                                               : m->dB[sidx[j] / m->S];
        }
        lm_attnres_config ac;
        ar_config(m, &ac, ns, N);
        ac.accumulate = 1;
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
            snprintf(buf, sizeof buf, "%s", err->msg);
            return lm_errorf(err, st, "model: layer %d %s backward: %s", l / 2,
                             l % 2 ? "ffn" : "mixer", buf);
        }
        LM_TRY(lm_rmsnorm_backward(N, (int)d, eps, m->h[l], ly->norm_w[l % 2], m->rstd[l],
                                   m->dxn, m->dh, G_of(m, ly->norm_w[l % 2]), err));
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
            dsrc[j] = sidx[j] < 0                         ? m->dE
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
    if (!attnres) memcpy(m->dE, m->G, (size_t)Nd * sizeof(float));
    /* embedding rows: fixed token order (serial over tokens, parallel over columns) */
    float *dW = G_of(m, m->W_emb);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < d; j++)
        for (int64_t n = 0; n < N; n++) dW[(int64_t)m->ids[n] * d + j] += m->dE[n * d + j];
    /* buffers carry no gradient */
    for (int t = 0; t < m->p->n; t++)
        if (m->p->t[t].buffer)
            memset(m->gtmp + m->p->t[t].offset, 0, (size_t)m->p->t[t].numel * sizeof(float));
    if (accumulate) {
        add_into(m->grads, m->gtmp, m->p->numel);
    } else {
        float *t = m->grads;
        m->grads = m->gtmp;
        m->gtmp = t;
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- depth weights */

int lm_model_attnres_weights(const lm_model *m, int l, double *p_mean, int max_out) {
    if (!m || !m->run || l < 0 || l > m->nsub || m->N < 1) return 0;
    int sidx[LM_MAX_LAYERS * 2 + 2];
    const int ns = ar_sources(m, l, sidx);
    if (ns > max_out) return 0;
    const float *q = l == m->nsub ? m->arq_fin : m->ly[l / 2].arq[l % 2];
    const float *g = l == m->nsub ? m->arn_fin : m->ly[l / 2].arn[l % 2];
    const int64_t N = m->N, d = m->d;
    const double eps = m->c->rms_norm_eps;
    for (int j = 0; j < ns; j++) p_mean[j] = 0;
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
            if (s[j] > mx) mx = s[j];
        }
        for (int j = 0; j < ns; j++) z += exp(s[j] - mx);
        for (int j = 0; j < ns; j++) p_mean[j] += exp(s[j] - mx) / z / (double)N;
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
            const double Hq = c->num_attention_heads, Hkv = c->num_key_value_heads,
                         D = c->head_dim;
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
        return lm_errorf(err, LM_ERR_INVALID, "model cache: B = %d, max_len = %lld (want >= 1)",
                         B, (long long)max_len);
    const lm_model_config *c = m->c;
    int64_t total = 0;
    const int64_t C = (int64_t)c->kda_num_heads * c->kda_head_dim,
                  Wm = c->short_conv_kernel_size - 1;
    const int64_t kda_f = 3 * B * C * Wm + (int64_t)B * c->kda_num_heads * c->kda_head_dim *
                                                c->kda_head_dim;
    const int64_t kv_f = 2 * B * max_len * (int64_t)c->num_key_value_heads * c->head_dim;
    for (int i = 0; i < m->L; i++) total += c->kinds[i] == LM_LAYER_KDA ? kda_f : kv_f;
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
    if (!c) return;
    free(c->buf);
    free(c->ks);
    free(c->kv);
    free(c);
}

void lm_model_cache_reset(lm_model_cache *c) {
    if (!c) return;
    memset(c->buf, 0, (size_t)c->buf_floats * sizeof(float));
    c->pos = 0;
}

int64_t lm_model_cache_pos(const lm_model_cache *c) { return c ? c->pos : 0; }

lm_status lm_model_infer(lm_model *m, lm_model_cache *c, const int32_t *ids, int T,
                         int last_only, float *logits, lm_error *err) {
    if (!m || !c) return lm_errorf(err, LM_ERR_INVALID, "model infer: NULL model or cache");
    if (T < 1) return lm_errorf(err, LM_ERR_INVALID, "model infer: T = %d (want >= 1)", T);
    const int64_t N = (int64_t)c->B * T;
    if (N > m->max_tokens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model infer: B*T = %lld tokens > the model's max_tokens = %lld",
                         (long long)N, (long long)m->max_tokens);
    if (c->pos + T > c->max_len)
        return lm_errorf(err, LM_ERR_INVALID,
                         "model infer: position %lld + %d new tokens > cache max_len = %lld",
                         (long long)c->pos, T, (long long)c->max_len);
    LM_TRY(check_ids(m, ids, N, "ids", 0, err));
    m->have_fwd = 0; /* the saved training activations are overwritten */
    memcpy(m->ids, ids, (size_t)N * sizeof(int32_t));
    fwd_mode fm = {c->B, T, NULL, 0, 0, c};
    LM_TRY(run_forward(m, &fm, m->ids, err));
    m->N = N;
    c->pos += T;
    if (!logits) return LM_OK;
    if (!last_only) {
        write_logits(m, N, logits);
        return LM_OK;
    }
    for (int b = 0; b < c->B; b++)
        lm_model_mm(0, 1, 1, m->V, m->d, m->xfin + ((int64_t)b * T + T - 1) * m->d, m->d,
                    m->W_head, m->d, 0, logits + (int64_t)b * m->V, m->V);
    return LM_OK;
}
