/* The GPU model (include/linmoe/gpu_model.h): model.h's wiring on one CUDA device.
 *
 * Per sublayer l (2i: layer i's mixer, 2i+1 its FFN), with N tokens:
 *   standard residual (pre-norm): the residual add and the next norm are one fused op,
 *     xn_0 = RMSNorm(e);  o_l = f_l(xn_l);
 *     h_{l+1} = h_l + o_l, xn_{l+1} = RMSNorm(h_{l+1})   (lm_cuda_rmsnorm_forward with a
 *     residual), the last one into the final norm; backward: the gradient stream G
 *     (bf16) goes down with dx = RMSNorm'(dxn) + G in one op per sublayer;
 *   AttnRes (model.h; reference/attnres_ctx.md §4.2): the sources are e and the block
 *     sums run[l] (bf16), h_l = AR(sources) (lm_cuda_attnres_forward_ptrs), xn_l =
 *     RMSNorm(h_l); backward: bf16 gradient accumulators for the embedding, every
 *     completed block and the running part (the AR backward adds into them in fp32 and
 *     rounds once per contribution, as the standard path's G is rounded once per
 *     sublayer), read directly by the sublayer below them.
 * The mixers and FFNs: the attention layer and the dense SwiGLU here (attn_layer.h,
 * layers.h math), the KDA layer and the MoE layer in gpu_kda_layer.c / gpu_moe_layer.c
 * (src/model/gpu_internal.h). The head: RMSNorm, then the fused LM head +
 * cross-entropy (lm_cuda_ce_forward_backward), which gives the loss and dh in the
 * forward pass.
 */
#include "linmoe/gpu_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/cuda_attention.h"
#include "linmoe/cuda_attnres.h"
#include "linmoe/cuda_bench.h"
#include "linmoe/cuda_elementwise.h"
#include "linmoe/cuda_gemm.h"
#include "linmoe/cuda_layers.h"
#include "linmoe/cuda_optim.h"
#include "linmoe/cuda_router.h"
#include "model/gpu_internal.h"
#include "model/model_internal.h"

#define NSUB_MAX (LM_MAX_LAYERS * 2)

typedef struct {
    lm_layer_kind kind;
    int moe;
    int rc; /* activation recompute: the backward runs the layer's forward again */
    /* KDA */
    lm_kda_layer_config kc;
    lm_gpu_kda_layer *kda;
    int kda_owner; /* 0: kda is an earlier recomputed layer's (shared saved activations) */
    lm_gpu_kda_weights kw;
    lm_gpu_kda_grads kg;
    /* attention: saved q k v o lse */
    lm_attn_layer_config ac;
    void *q, *k, *v, *o;
    float *lse;
    const void *wq, *wk, *wv, *wo;
    float *gq, *gk, *gv, *go;
    /* dense FFN: saved [g | u] */
    int I;
    void *gu;
    const void *wg, *wu, *wd;
    float *gg, *gup, *gd;
    int gu_fused; /* gate_proj and up_proj adjacent: one GEMM over [Wg; Wu] */
    /* MoE */
    lm_gpu_moe_layer *ml;
    lm_gpu_moe_weights mw;
    lm_gpu_moe_grads mg;
    int64_t bias_off; /* e_score_correction_bias offset in the parameter buffer */
    int E;
    /* norms (bf16 gains) and AttnRes vectors (fp32) of the two sublayers */
    const void *norm_w[2];
    float *norm_g[2];
    const float *arq[2], *arn[2];
    float *arq_g[2], *arn_g[2];
} gpu_layer;

struct lm_gpu_model {
    lm_cuda_ctx *ctx;
    lm_model_config cfg;
    int L, nsub, d, V, S, nblocks, attnres;
    int64_t numel, max_tokens;
    int max_seqs;
    int n_info;
    lm_param_info *info;
    lm_mem_plan plan;
    /* parameters */
    float *p32, *g32, *m1, *m2;
    void *p16;
    lm_cuda_adamw_plan *opt;
    gpu_layer ly[LM_MAX_LAYERS];
    const void *W_emb, *W_head, *norm_fin;
    float *g_emb, *g_head, *g_norm_fin;
    const float *arq_fin, *arn_fin;
    float *arq_fin_g, *arn_fin_g;
    /* activations */
    void *e, *h[NSUB_MAX], *xn[NSUB_MAX], *run[NSUB_MAX], *hfin, *xfin, *dxfin, *obuf;
    const void *hp[NSUB_MAX]; /* the input of sublayer l's norm */
    float *rstd[NSUB_MAX], *rstd_fin;
    /* backward */
    void *G16, *dxn, *dh;
    /* AttnRes: the gradients of the running sum, the embedding and each block sum, bf16
     * (the precision of the standard residual's gradient stream G16) */
    void *Gr16, *dE16, *dB16[NSUB_MAX];
    /* layer scratch shared by the attention / dense layers */
    void *s_dO, *s_dq, *s_dk, *s_dv, *s_dh, *s_h, *s_dgu;
    void *kda_scratch; /* the KDA layers' backward scratch (one layer at a time) */
    void *moe_scratch; /* the MoE layers' experts scratch (one layer at a time) */
    void *moe_saved;   /* the recomputed MoE layers' saved activations, or NULL */
    /* batch */
    int32_t *ids, *labels, *cu_dev;
    int64_t *cu_host;
    float *nll;
    float *logit_rows; /* [LM_GPU_MODEL_LOGIT_ROWS, V] fp32 */
    /* step scalars */
    float *loss_sum, *aux, *gnorm;
    int32_t *count, *skipped;
    lm_router_metrics *metrics;
    double *demand;
    /* one allocation per class */
    void *mem[LM_MEM_N_CLASSES];
    /* the last micro-batch */
    lm_gpu_batch b;
    int have_fwd;
    float loss_scale; /* of the running micro-step */
    /* profiling (lm_gpu_model_set_profile): GPU ms per op class */
    lm_cuda_timer *timer;
    double prof[LM_GPU_PROF_N];
    /* data parallelism (lm_gpu_model_set_dp): the hooks; reduce: the running micro-step
     * calls grads_ready; the gradient ranges: layer i's tensors are [lay_lo[i],
     * lay_lo[i + 1]) with lay_lo[L] the tail's start (ranges_ok: the layout is so) */
    lm_gpu_model_dp dp;
    int reduce, ranges_ok;
    int64_t lay_lo[LM_MAX_LAYERS + 1];
};

/* Runs `call` (an lm_status expression); with profiling on, timed with the context's
 * events (start, call, stop: a synchronisation per call) and added to class `cls`. */
#define PROF(m, cls, call)                                                                         \
    do {                                                                                           \
        if ((m)->timer) {                                                                          \
            double ms_ = 0;                                                                        \
            LM_TRY(lm_cuda_timer_start((m)->timer, err));                                          \
            LM_TRY(call);                                                                          \
            LM_TRY(lm_cuda_timer_stop((m)->timer, &ms_, err));                                     \
            (m)->prof[cls] += ms_;                                                                 \
        } else {                                                                                   \
            LM_TRY(call);                                                                          \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------- helpers */

static void grad_ranges(lm_gpu_model *m);

static const lm_param_info *find_info(const lm_gpu_model *m, const char *name) {
    for (int i = 0; i < m->n_info; i++)
        if (strcmp(m->info[i].name, name) == 0)
            return &m->info[i];
    return NULL;
}

static int64_t off_of(const lm_gpu_model *m, const char *fmt, int i, int *found) {
    char name[LM_PARAM_NAME_MAX];
    snprintf(name, sizeof name, fmt, i);
    const lm_param_info *t = find_info(m, name);
    if (found)
        *found = t != NULL;
    return t ? t->offset : -1;
}

static const void *W16(const lm_gpu_model *m, const char *fmt, int i) {
    int f = 0;
    const int64_t o = off_of(m, fmt, i, &f);
    return f ? (const void *)((const uint16_t *)m->p16 + o) : NULL;
}
static const float *W32(const lm_gpu_model *m, const char *fmt, int i) {
    int f = 0;
    const int64_t o = off_of(m, fmt, i, &f);
    return f ? m->p32 + o : NULL;
}
static float *G32(const lm_gpu_model *m, const char *fmt, int i) {
    int f = 0;
    const int64_t o = off_of(m, fmt, i, &f);
    return f ? m->g32 + o : NULL;
}

/* Row-major GEMM shorthand (cuda_gemm.h): C[M,N] = op(A) op(B) + beta C. */
static lm_status mm(lm_gpu_model *m, int tA, int tB, int M, int N, int K, const void *A,
                    int64_t lda, const void *B, int64_t ldb, float beta, void *C, int64_t ldc,
                    int f32, lm_error *err) {
    return lm_cuda_gemm(m->ctx, tA, tB, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc,
                        f32 ? LM_CUDA_GEMM_F32 : LM_CUDA_GEMM_BF16, err);
}

static size_t al256(size_t n) { return (n + 255) & ~(size_t)255; }

/* ---------------------------------------------------------------- support check */

lm_status lm_gpu_model_supports(const lm_model_config *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL config");
    int has_kda = 0, has_attn = 0;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        if (c->kinds[i] == LM_LAYER_KDA)
            has_kda = 1;
        else
            has_attn = 1;
    }
    if (has_kda) {
        if (c->kda_head_dim > 128)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: linear_attn_config.head_dim = %d (the CUDA KDA kernels "
                             "take head_dim <= 128)",
                             c->kda_head_dim);
        if (c->short_conv_kernel_size > LM_CUDA_SHORT_CONV_MAX_W)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: short_conv_kernel_size = %d (CUDA takes <= %d)",
                             c->short_conv_kernel_size, LM_CUDA_SHORT_CONV_MAX_W);
        if ((c->kda_num_heads * c->kda_head_dim) % 8 != 0)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: linear_attn_config num_heads * head_dim = %d (CUDA needs "
                             "a multiple of 8)",
                             c->kda_num_heads * c->kda_head_dim);
    }
    if (has_attn && c->head_dim > 256)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu model: head_dim = %d (the CUDA attention takes head_dim <= 256)",
                         c->head_dim);
    if (c->hidden_size % 8 != 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu model: hidden_size = %d (CUDA needs a multiple of 8: 16-byte rows)",
                         c->hidden_size);
    if (c->first_k_dense_replace > 0 && c->intermediate_size % 8 != 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "gpu model: intermediate_size = %d (CUDA needs a multiple of 8)",
                         c->intermediate_size);
    if (c->first_k_dense_replace < c->num_hidden_layers) {
        const lm_router_config *r = &c->moe.router;
        if (r->num_experts > LM_CUDA_ROUTER_MAX_EXPERTS)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: num_experts = %d (CUDA takes <= %d)", r->num_experts,
                             LM_CUDA_ROUTER_MAX_EXPERTS);
        if (r->num_experts_per_tok > LM_CUDA_ROUTER_MAX_TOPK)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: num_experts_per_tok = %d (CUDA takes <= %d)",
                             r->num_experts_per_tok, LM_CUDA_ROUTER_MAX_TOPK);
        if (c->moe.moe_intermediate_size % 8 != 0)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: moe_intermediate_size = %d (CUDA needs a multiple of 8)",
                             c->moe.moe_intermediate_size);
    }
    if (c->residual != LM_RES_STANDARD) {
        const int S = c->residual == LM_RES_FULL_ATTNRES ? 1 : c->attnres_block_size;
        const int sources = 2 + (2 * c->num_hidden_layers) / (S > 0 ? S : 1);
        if (sources > LM_CUDA_ATTNRES_MAX_SOURCES)
            return lm_errorf(err, LM_ERR_UNSUPPORTED,
                             "gpu model: residual with %d AttnRes sources (attnres_block_size = "
                             "%d; CUDA takes <= %d)",
                             sources, S, LM_CUDA_ATTNRES_MAX_SOURCES);
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- layer configs */

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

/* ---------------------------------------------------------------- the memory plan
 * A bump layout over each class: `base` NULL measures. */
typedef struct {
    char *base;
    size_t off;
} bump;

static void *take(bump *b, size_t bytes) {
    void *p = b->base ? b->base + b->off : NULL;
    b->off += al256(bytes);
    return p;
}

/* Lays out (or measures, m->mem NULL) the parameter, gradient, optimizer, activation
 * and scratch classes of the model's own buffers (the KDA and MoE layers allocate their
 * own and are added to the activation class by the caller). */
static void layout(lm_gpu_model *m, size_t out[LM_MEM_N_CLASSES]) {
    const lm_model_config *c = &m->cfg;
    const int64_t N = m->max_tokens, d = m->d, Nd = N * d;
    bump pb = {(char *)m->mem[LM_MEM_PARAMS], 0}, gb = {(char *)m->mem[LM_MEM_GRADS], 0};
    bump ob = {(char *)m->mem[LM_MEM_OPTIM], 0}, ab = {(char *)m->mem[LM_MEM_ACTS], 0};
    bump sb = {(char *)m->mem[LM_MEM_SCRATCH], 0};
    m->p32 = take(&pb, (size_t)m->numel * 4);
    m->p16 = take(&pb, (size_t)m->numel * 2);
    m->g32 = take(&gb, (size_t)m->numel * 4);
    m->m1 = take(&ob, (size_t)m->numel * 4);
    m->m2 = take(&ob, (size_t)m->numel * 4);
    /* activations */
    m->e = take(&ab, (size_t)Nd * 2);
    for (int l = 0; l < m->nsub; l++) {
        m->h[l] = (m->attnres || l > 0) ? take(&ab, (size_t)Nd * 2) : NULL;
        m->xn[l] = take(&ab, (size_t)Nd * 2);
        m->rstd[l] = take(&ab, (size_t)N * 4);
        m->run[l] = m->attnres ? take(&ab, (size_t)Nd * 2) : NULL;
    }
    m->hfin = take(&ab, (size_t)Nd * 2);
    m->xfin = take(&ab, (size_t)Nd * 2);
    m->dxfin = take(&ab, (size_t)Nd * 2);
    m->rstd_fin = take(&ab, (size_t)N * 4);
    m->ids = take(&ab, (size_t)N * 4);
    m->labels = take(&ab, (size_t)N * 4);
    m->cu_dev = take(&ab, (size_t)(m->max_seqs + 1) * 4);
    size_t I_max = 0, attn_q = 0, attn_kv = 0;
    /* the recomputed layers' saved activations: one set, as large as the largest layer's */
    size_t rc_q = 0, rc_kv = 0, rc_h = 0, rc_I = 0;
    for (int i = 0; i < m->L; i++) {
        const gpu_layer *ly = &m->ly[i];
        if (!ly->rc)
            continue;
        if (ly->kind == LM_LAYER_ATTN) {
            const size_t cq = (size_t)ly->ac.Hq * ly->ac.Dh, ckv = (size_t)ly->ac.Hkv * ly->ac.Dh;
            rc_q = cq > rc_q ? cq : rc_q;
            rc_kv = ckv > rc_kv ? ckv : rc_kv;
            rc_h = (size_t)ly->ac.Hq > rc_h ? (size_t)ly->ac.Hq : rc_h;
        }
        if (!ly->moe && (size_t)ly->I > rc_I)
            rc_I = (size_t)ly->I;
    }
    void *rq = rc_q ? take(&ab, (size_t)N * rc_q * 2) : NULL;
    void *rk = rc_kv ? take(&ab, (size_t)N * rc_kv * 2) : NULL;
    void *rv = rc_kv ? take(&ab, (size_t)N * rc_kv * 2) : NULL;
    void *ro = rc_q ? take(&ab, (size_t)N * rc_q * 2) : NULL;
    float *rl = rc_h ? take(&ab, (size_t)N * rc_h * 4) : NULL;
    void *rgu = rc_I ? take(&ab, (size_t)N * 2 * rc_I * 2) : NULL;
    for (int i = 0; i < m->L; i++) {
        gpu_layer *ly = &m->ly[i];
        if (ly->kind == LM_LAYER_ATTN) {
            const size_t cq = (size_t)ly->ac.Hq * ly->ac.Dh, ckv = (size_t)ly->ac.Hkv * ly->ac.Dh;
            if (ly->rc) {
                ly->q = rq, ly->k = rk, ly->v = rv, ly->o = ro, ly->lse = rl;
            } else {
                ly->q = take(&ab, (size_t)N * cq * 2);
                ly->k = take(&ab, (size_t)N * ckv * 2);
                ly->v = take(&ab, (size_t)N * ckv * 2);
                ly->o = take(&ab, (size_t)N * cq * 2);
                ly->lse = take(&ab, (size_t)N * ly->ac.Hq * 4);
            }
            if (cq > attn_q)
                attn_q = cq;
            if (ckv > attn_kv)
                attn_kv = ckv;
        }
        if (!ly->moe) {
            ly->gu = ly->rc ? rgu : take(&ab, (size_t)N * 2 * ly->I * 2);
            if ((size_t)ly->I > I_max)
                I_max = (size_t)ly->I;
        }
    }
    /* the MoE layers' experts buffers: one scratch for all, one saved set for the
     * recomputed ones (the sizes of the layers' common config) */
    size_t moe_saved = 0, moe_scr = 0;
    int any_moe = 0, any_moe_rc = 0;
    for (int i = 0; i < m->L; i++) {
        any_moe |= m->ly[i].moe;
        any_moe_rc |= m->ly[i].moe && m->ly[i].rc;
    }
    if (any_moe && lm_gpu_moe_layer_shared_bytes(&c->moe, N, &moe_saved, &moe_scr, NULL) != LM_OK)
        moe_saved = moe_scr = 0;
    m->moe_saved = any_moe_rc && moe_saved ? take(&ab, moe_saved) : NULL;
    /* scratch */
    m->obuf = take(&sb, (size_t)Nd * 2);
    m->G16 = take(&sb, (size_t)Nd * 2);
    m->dxn = take(&sb, (size_t)Nd * 2);
    m->dh = take(&sb, (size_t)Nd * 2);
    if (m->attnres) {
        m->Gr16 = take(&sb, (size_t)Nd * 2);
        m->dE16 = take(&sb, (size_t)Nd * 2);
        for (int j = 0; j < m->nblocks; j++)
            m->dB16[j] = take(&sb, (size_t)Nd * 2);
    }
    m->s_dO = take(&sb, (size_t)N * attn_q * 2);
    m->s_dq = take(&sb, (size_t)N * attn_q * 2);
    m->s_dk = take(&sb, (size_t)N * attn_kv * 2);
    m->s_dv = take(&sb, (size_t)N * attn_kv * 2);
    m->s_dh = take(&sb, (size_t)N * I_max * 2);
    m->s_h = take(&sb, (size_t)N * I_max * 2);
    m->s_dgu = take(&sb, (size_t)N * 2 * I_max * 2);
    size_t kda_scr = 0;
    for (int i = 0; i < m->L; i++)
        if (m->ly[i].kind == LM_LAYER_KDA) {
            const size_t b = lm_gpu_kda_layer_scratch_bytes(&m->ly[i].kc, N);
            if (b > kda_scr)
                kda_scr = b;
        }
    m->kda_scratch = kda_scr ? take(&sb, kda_scr) : NULL;
    m->moe_scratch = any_moe && moe_scr ? take(&sb, moe_scr) : NULL;
    m->nll = take(&sb, (size_t)N * 4);
    m->logit_rows = take(&sb, (size_t)LM_GPU_MODEL_LOGIT_ROWS * m->V * 4);
    m->loss_sum = take(&sb, LM_GPU_MODEL_MAX_MICRO * 4);
    m->count = take(&sb, LM_GPU_MODEL_MAX_MICRO * 4);
    m->aux = take(&sb, (size_t)LM_GPU_MODEL_MAX_MICRO * m->L * 4);
    m->gnorm = take(&sb, 4);
    m->skipped = take(&sb, 4);
    /* metrics then demand, back to back (no 256-byte rounding between them): one download */
    {
        const size_t mb = sizeof(lm_router_metrics) * (size_t)m->L;
        const size_t db = sizeof(double) * (size_t)m->L *
                          (size_t)(c->moe.router.num_experts > 0 ? c->moe.router.num_experts : 1);
        char *md = take(&sb, mb + db);
        m->metrics = (lm_router_metrics *)md;
        m->demand = md ? (double *)(md + mb) : NULL;
    }
    out[LM_MEM_PARAMS] = pb.off;
    out[LM_MEM_GRADS] = gb.off;
    out[LM_MEM_OPTIM] = ob.off;
    out[LM_MEM_ACTS] = ab.off;
    out[LM_MEM_SCRATCH] = sb.off;
}

/* The layer whose KDA layer object layer i uses: itself, or for a recomputed layer the
 * first recomputed KDA layer of the same config (they share its saved activations). */
static int kda_owner_of(const lm_gpu_model *m, int i) {
    if (!m->ly[i].rc)
        return i;
    for (int j = 0; j < i; j++)
        if (m->ly[j].rc && m->ly[j].kind == LM_LAYER_KDA &&
            memcmp(&m->ly[j].kc, &m->ly[i].kc, sizeof m->ly[i].kc) == 0)
            return j;
    return i;
}

/* Fills the structure of m from cfg without device memory (numel, layers, configs). */
static lm_status shape_model(lm_gpu_model *m, const lm_model_config *cfg, int64_t max_tokens,
                             int max_seqs, const lm_gpu_model_opts *o, lm_error *err) {
    m->cfg = *cfg;
    m->L = cfg->num_hidden_layers;
    m->nsub = 2 * m->L;
    m->d = cfg->hidden_size;
    m->V = cfg->vocab_size;
    m->attnres = cfg->residual != LM_RES_STANDARD;
    m->S = cfg->residual == LM_RES_FULL_ATTNRES ? 1 : cfg->attnres_block_size;
    if (m->S < 1)
        m->S = 1;
    m->nblocks = m->attnres ? (m->nsub + m->S - 1) / m->S : 0;
    m->max_tokens = max_tokens;
    m->max_seqs = max_seqs;
    for (int i = 0; i < m->L; i++) {
        gpu_layer *ly = &m->ly[i];
        ly->kind = cfg->kinds[i];
        ly->moe = i >= cfg->first_k_dense_replace;
        ly->I = ly->moe ? 0 : cfg->intermediate_size;
        memset(&ly->kc, 0, sizeof ly->kc); /* compared with memcmp (kda_owner_of) */
        layer_cfgs(cfg, i, &ly->kc, &ly->ac);
        ly->rc = o && o->recompute && o->recompute[i];
    }
    (void)err;
    return LM_OK;
}

static void plan_fill(lm_gpu_model *m, lm_mem_plan *out) {
    size_t cls[LM_MEM_N_CLASSES] = {0};
    layout(m, cls);
    size_t layer_bytes = 0;
    for (int i = 0; i < m->L; i++) {
        if (m->ly[i].kind == LM_LAYER_KDA && kda_owner_of(m, i) == i)
            layer_bytes += lm_gpu_kda_layer_bytes(&m->ly[i].kc, m->max_tokens, m->max_seqs);
        if (m->ly[i].moe)
            layer_bytes += lm_gpu_moe_layer_bytes(&m->cfg.moe, m->max_tokens, !m->ly[i].rc, 0);
    }
    memset(out, 0, sizeof *out);
    out->B = 1;
    out->T = (int)m->max_tokens;
    out->threads = 0;
    out->numel = m->numel;
    for (int k = 0; k < LM_MEM_N_CLASSES; k++)
        out->bytes[k] = (int64_t)cls[k];
    out->bytes[LM_MEM_ACTS] += (int64_t)layer_bytes;
    out->total = 0;
    for (int k = 0; k < LM_MEM_N_CLASSES; k++)
        out->total += out->bytes[k];
}

static lm_status check_args(const lm_model_config *cfg, int64_t max_tokens, int max_seqs,
                            lm_error *err) {
    if (max_tokens < 1 || max_tokens > ((int64_t)1 << 30))
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: max_tokens = %lld (want 1 .. 2^30)",
                         (long long)max_tokens);
    if (max_seqs < 1)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: max_seqs = %d (want >= 1)", max_seqs);
    LM_TRY(lm_model_config_validate(cfg, err));
    return lm_gpu_model_supports(cfg, err);
}

lm_status lm_gpu_model_plan(const lm_model_config *cfg, int64_t max_tokens, int max_seqs,
                            lm_mem_plan *out, lm_error *err) {
    return lm_gpu_model_plan_opts(cfg, max_tokens, max_seqs, NULL, out, err);
}

lm_status lm_gpu_model_plan_opts(const lm_model_config *cfg, int64_t max_tokens, int max_seqs,
                                 const lm_gpu_model_opts *o, lm_mem_plan *out, lm_error *err) {
    if (!cfg || !out)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL config or plan");
    LM_TRY(check_args(cfg, max_tokens, max_seqs, err));
    lm_gpu_model *m = LM_CALLOC(1, sizeof *m);
    lm_status st = shape_model(m, cfg, max_tokens, max_seqs, o, err);
    int64_t numel = 0;
    if (st == LM_OK)
        st = lm_params_layout_numel(cfg, &numel, err);
    if (st == LM_OK) {
        m->numel = numel;
        plan_fill(m, out);
    }
    free(m);
    return st;
}

const lm_mem_plan *lm_gpu_model_mem_plan(const lm_gpu_model *m) { return m ? &m->plan : NULL; }
const lm_model_config *lm_gpu_model_config(const lm_gpu_model *m) { return m ? &m->cfg : NULL; }
int64_t lm_gpu_model_max_tokens(const lm_gpu_model *m) { return m ? m->max_tokens : 0; }

/* ---------------------------------------------------------------- construction */

static void bind_weights(lm_gpu_model *m) {
    const char *P = "model.layers.%d.";
    char f[160];
#define NAME(s) (snprintf(f, sizeof f, "%s%s", P, s), f)
    for (int i = 0; i < m->L; i++) {
        gpu_layer *ly = &m->ly[i];
        ly->norm_w[0] = W16(m, NAME("input_layernorm.weight"), i);
        ly->norm_g[0] = G32(m, NAME("input_layernorm.weight"), i);
        ly->norm_w[1] = W16(m, NAME("post_attention_layernorm.weight"), i);
        ly->norm_g[1] = G32(m, NAME("post_attention_layernorm.weight"), i);
        if (m->attnres) {
            ly->arq[0] = W32(m, NAME("attn_res.query"), i);
            ly->arn[0] = W32(m, NAME("attn_res.norm.weight"), i);
            ly->arq[1] = W32(m, NAME("mlp_res.query"), i);
            ly->arn[1] = W32(m, NAME("mlp_res.norm.weight"), i);
            ly->arq_g[0] = G32(m, NAME("attn_res.query"), i);
            ly->arn_g[0] = G32(m, NAME("attn_res.norm.weight"), i);
            ly->arq_g[1] = G32(m, NAME("mlp_res.query"), i);
            ly->arn_g[1] = G32(m, NAME("mlp_res.norm.weight"), i);
        }
        if (ly->kind == LM_LAYER_KDA) {
#define KW(x)                                                                                      \
    ly->kw.x = W16(m, NAME("self_attn." #x ".weight"), i),                                         \
    ly->kg.x = G32(m, NAME("self_attn." #x ".weight"), i)
            KW(q_proj);
            KW(k_proj);
            KW(v_proj);
            KW(q_conv1d);
            KW(k_conv1d);
            KW(v_conv1d);
            KW(f_a_proj);
            KW(f_b_proj);
            KW(b_proj);
            KW(g_a_proj);
            KW(g_b_proj);
            KW(o_norm);
            KW(o_proj);
#undef KW
            ly->kw.A_log = W32(m, NAME("self_attn.A_log"), i);
            ly->kg.A_log = G32(m, NAME("self_attn.A_log"), i);
            ly->kw.dt_bias = W32(m, NAME("self_attn.dt_bias"), i);
            ly->kg.dt_bias = G32(m, NAME("self_attn.dt_bias"), i);
        } else {
            ly->wq = W16(m, NAME("self_attn.q_proj.weight"), i);
            ly->wk = W16(m, NAME("self_attn.k_proj.weight"), i);
            ly->wv = W16(m, NAME("self_attn.v_proj.weight"), i);
            ly->wo = W16(m, NAME("self_attn.o_proj.weight"), i);
            ly->gq = G32(m, NAME("self_attn.q_proj.weight"), i);
            ly->gk = G32(m, NAME("self_attn.k_proj.weight"), i);
            ly->gv = G32(m, NAME("self_attn.v_proj.weight"), i);
            ly->go = G32(m, NAME("self_attn.o_proj.weight"), i);
        }
        if (!ly->moe) {
            ly->wg = W16(m, NAME("mlp.gate_proj.weight"), i);
            ly->wu = W16(m, NAME("mlp.up_proj.weight"), i);
            ly->wd = W16(m, NAME("mlp.down_proj.weight"), i);
            ly->gg = G32(m, NAME("mlp.gate_proj.weight"), i);
            ly->gup = G32(m, NAME("mlp.up_proj.weight"), i);
            ly->gd = G32(m, NAME("mlp.down_proj.weight"), i);
            const int64_t og = off_of(m, NAME("mlp.gate_proj.weight"), i, NULL);
            const int64_t ou = off_of(m, NAME("mlp.up_proj.weight"), i, NULL);
            ly->gu_fused = ou == og + (int64_t)ly->I * m->d;
        } else {
#define MW(x, s) ly->mw.x = W16(m, NAME(s), i), ly->mg.x = G32(m, NAME(s), i)
            MW(gate, "mlp.gate.weight");
            MW(gate_proj, "mlp.experts.gate_proj");
            MW(up_proj, "mlp.experts.up_proj");
            MW(down_proj, "mlp.experts.down_proj");
            MW(shared_gate_proj, "mlp.shared_experts.gate_proj");
            MW(shared_up_proj, "mlp.shared_experts.up_proj");
            MW(shared_down_proj, "mlp.shared_experts.down_proj");
#undef MW
            ly->bias_off = off_of(m, NAME("mlp.gate.e_score_correction_bias"), i, NULL);
            ly->E = m->cfg.moe.router.num_experts;
        }
    }
#undef NAME
    m->W_emb = W16(m, "model.embed_tokens.weight", 0);
    m->g_emb = G32(m, "model.embed_tokens.weight", 0);
    m->norm_fin = W16(m, "model.norm.weight", 0);
    m->g_norm_fin = G32(m, "model.norm.weight", 0);
    if (m->cfg.tie_word_embeddings) {
        m->W_head = m->W_emb;
        m->g_head = m->g_emb;
    } else {
        m->W_head = W16(m, "lm_head.weight", 0);
        m->g_head = G32(m, "lm_head.weight", 0);
    }
    if (m->attnres) {
        m->arq_fin = W32(m, "model.attnres_final.query", 0);
        m->arn_fin = W32(m, "model.attnres_final.norm.weight", 0);
        m->arq_fin_g = G32(m, "model.attnres_final.query", 0);
        m->arn_fin_g = G32(m, "model.attnres_final.norm.weight", 0);
    }
}

static int cmp_seg(const void *a, const void *b) {
    const lm_cuda_adamw_segment *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

lm_status lm_gpu_model_new(lm_gpu_model **out, lm_cuda_ctx *ctx, const lm_params *p,
                           int64_t max_tokens, int max_seqs, lm_error *err) {
    return lm_gpu_model_new_opts(out, ctx, p, max_tokens, max_seqs, NULL, err);
}

lm_status lm_gpu_model_new_opts(lm_gpu_model **out, lm_cuda_ctx *ctx, const lm_params *p,
                                int64_t max_tokens, int max_seqs, const lm_gpu_model_opts *o,
                                lm_error *err) {
    if (!out || !ctx || !p || !p->data)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL output, context or parameters");
    *out = NULL;
    LM_TRY(check_args(&p->cfg, max_tokens, max_seqs, err));
    lm_gpu_model *m = LM_CALLOC(1, sizeof *m);
    m->ctx = ctx;
    lm_status st0 = shape_model(m, &p->cfg, max_tokens, max_seqs, o, err);
    if (st0 != LM_OK) {
        free(m);
        return st0;
    }
    m->numel = p->numel;
    m->n_info = p->n;
    m->info = LM_MALLOC(sizeof(lm_param_info) * (size_t)p->n);
    memcpy(m->info, p->t, sizeof(lm_param_info) * (size_t)p->n);
    plan_fill(m, &m->plan);
    grad_ranges(m);
    lm_status st = LM_OK;
    size_t dev_mem = 0;
    if (lm_cuda_device_info(NULL, 0, NULL, &dev_mem, err) == LM_OK && dev_mem > 0 &&
        (double)m->plan.total > 0.92 * (double)dev_mem) {
        char buf[512];
        lm_mem_plan_format(&m->plan, buf, sizeof buf);
        st = lm_errorf(err, LM_ERR_NOMEM,
                       "gpu model: the plan for %lld tokens needs more than the device's %.1f GiB "
                       "(less the ops' workspaces): %s",
                       (long long)max_tokens, (double)dev_mem / (1 << 30), buf);
        goto fail;
    }
    size_t cls[LM_MEM_N_CLASSES] = {0};
    layout(m, cls);
    for (int k = 0; k < LM_MEM_N_CLASSES && st == LM_OK; k++)
        st = lm_cuda_ctx_alloc(ctx, &m->mem[k], cls[k], err);
    if (st != LM_OK)
        goto fail;
    layout(m, cls);
    bind_weights(m);
    for (int i = 0; i < m->L && st == LM_OK; i++) {
        gpu_layer *ly = &m->ly[i];
        if (ly->kind == LM_LAYER_KDA) {
            const int own = kda_owner_of(m, i);
            ly->kda_owner = own == i;
            if (ly->kda_owner)
                st = lm_gpu_kda_layer_new(ctx, &ly->kc, max_tokens, max_seqs, m->kda_scratch,
                                          &ly->kda, err);
            else
                ly->kda = m->ly[own].kda;
        }
        if (st == LM_OK && ly->moe)
            st = lm_gpu_moe_layer_new(ctx, &m->cfg.moe, max_tokens, max_seqs,
                                      ly->rc ? m->moe_saved : NULL, m->moe_scratch, &ly->ml, err);
    }
    if (st != LM_OK)
        goto fail;
    /* AdamW over every trainable tensor */
    {
        lm_cuda_adamw_segment *seg = LM_MALLOC(sizeof *seg * (size_t)p->n);
        int ns = 0;
        for (int t = 0; t < p->n; t++)
            if (!p->t[t].buffer)
                seg[ns++] = (lm_cuda_adamw_segment){p->t[t].offset, p->t[t].numel, p->t[t].decay};
        qsort(seg, (size_t)ns, sizeof *seg, cmp_seg);
        st = lm_cuda_adamw_plan_new(ctx, seg, ns, m->numel, &m->opt, err);
        free(seg);
    }
    /* the whole classes: m2 starts at the 256-byte aligned end of m1, not at numel * 4 */
    if (st == LM_OK)
        st = lm_cuda_ctx_memset(ctx, m->mem[LM_MEM_GRADS], 0, cls[LM_MEM_GRADS], err);
    if (st == LM_OK)
        st = lm_cuda_ctx_memset(ctx, m->mem[LM_MEM_OPTIM], 0, cls[LM_MEM_OPTIM], err);
    if (st == LM_OK)
        st = lm_gpu_model_upload(m, p, err);
    if (st == LM_OK)
        st = lm_cuda_ctx_sync(ctx, err);
    if (st != LM_OK)
        goto fail;
    *out = m;
    return LM_OK;
fail:
    lm_gpu_model_free(m);
    return st;
}

void lm_gpu_model_free(lm_gpu_model *m) {
    if (!m)
        return;
    for (int i = 0; i < m->L; i++) {
        if (m->ly[i].kda_owner)
            lm_gpu_kda_layer_free(m->ly[i].kda);
        lm_gpu_moe_layer_free(m->ly[i].ml);
    }
    lm_cuda_adamw_plan_free(m->opt);
    lm_cuda_timer_free(m->timer);
    for (int k = 0; k < LM_MEM_N_CLASSES; k++)
        lm_cuda_ctx_free_mem(m->ctx, m->mem[k]);
    free(m->info);
    free(m->cu_host);
    free(m);
}

/* ---------------------------------------------------------------- parameters */

lm_status lm_gpu_model_upload(lm_gpu_model *m, const lm_params *p, lm_error *err) {
    if (!m || !p || p->numel != m->numel)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu model: upload of %lld parameters into a model of %lld",
                         p ? (long long)p->numel : -1LL, m ? (long long)m->numel : -1LL);
    LM_TRY(lm_cuda_ctx_upload(m->ctx, m->p32, p->data, (size_t)m->numel * 4, err));
    LM_TRY(lm_cuda_f32_to_bf16(m->ctx, m->numel, m->p32, m->p16, err));
    for (int i = 0; i < m->L; i++) {
        gpu_layer *ly = &m->ly[i];
        if (!ly->ml)
            continue;
        lm_cuda_router_state *rs = lm_gpu_moe_layer_router(ly->ml);
        LM_TRY(lm_cuda_ctx_upload(m->ctx, rs->e_score_correction_bias, p->data + ly->bias_off,
                                  (size_t)ly->E * 4, err));
    }
    return LM_OK;
}

lm_status lm_gpu_model_download(lm_gpu_model *m, lm_params *p, lm_error *err) {
    if (!m || !p || p->numel != m->numel)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu model: download into a parameter set of "
                         "another size");
    LM_TRY(lm_cuda_ctx_download(m->ctx, p->data, m->p32, (size_t)m->numel * 4, err));
    for (int i = 0; i < m->L; i++) {
        gpu_layer *ly = &m->ly[i];
        if (!ly->ml)
            continue;
        lm_cuda_router_state *rs = lm_gpu_moe_layer_router(ly->ml);
        LM_TRY(lm_cuda_ctx_download(m->ctx, p->data + ly->bias_off, rs->e_score_correction_bias,
                                    (size_t)ly->E * 4, err));
    }
    return LM_OK;
}

lm_status lm_gpu_model_set_rope_theta(lm_gpu_model *m, double theta, lm_error *err) {
    if (!m || !isfinite(theta) || theta <= 0)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: rope_theta = %g (want finite, > 0)",
                         theta);
    m->cfg.rope_theta = (float)theta;
    for (int i = 0; i < m->L; i++)
        m->ly[i].ac.rope_theta = theta;
    return LM_OK;
}

/* ---------------------------------------------------------------- batch */

static lm_status set_batch(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                           const int32_t *labels, int training, lm_error *err) {
    if (!b || !ids)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL batch or ids");
    if (b->B < 1 || b->T < 1)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: batch B = %d, T = %d (want >= 1)", b->B,
                         b->T);
    const int64_t N = (int64_t)b->B * b->T;
    if (N > m->max_tokens)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: batch of %lld tokens > max_tokens = %lld",
                         (long long)N, (long long)m->max_tokens);
    for (int64_t n = 0; n < N; n++)
        if (ids[n] < 0 || ids[n] >= m->V)
            return lm_errorf(err, LM_ERR_INVALID,
                             "gpu model: ids[%lld] = %d is outside [0, vocab_size = %d)",
                             (long long)n, ids[n], m->V);
    if (labels)
        for (int64_t n = 0; n < N; n++)
            if (labels[n] != LM_MODEL_IGNORE && (labels[n] < 0 || labels[n] >= m->V))
                return lm_errorf(err, LM_ERR_INVALID,
                                 "gpu model: labels[%lld] = %d is outside [0, vocab_size = %d) "
                                 "and not %d",
                                 (long long)n, labels[n], m->V, LM_MODEL_IGNORE);
    int n_cu = 0;
    if (b->cu_seqlens) {
        n_cu = b->n_cu_seqlens;
        if (b->B != 1 || n_cu < 2 || n_cu > m->max_seqs + 1)
            return lm_errorf(
                err, LM_ERR_INVALID,
                "gpu model: cu_seqlens needs B == 1 and 2 .. max_seqs + 1 = %d entries "
                "(B = %d, %d entries)",
                m->max_seqs + 1, b->B, n_cu);
        if (b->cu_seqlens[0] != 0 || b->cu_seqlens[n_cu - 1] != b->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "gpu model: cu_seqlens must start at 0 and end at T = %d", b->T);
        for (int j = 1; j < n_cu; j++)
            if (b->cu_seqlens[j] < b->cu_seqlens[j - 1])
                return lm_errorf(
                    err, LM_ERR_INVALID, "gpu model: cu_seqlens[%d] = %lld < cu_seqlens[%d] = %lld",
                    j, (long long)b->cu_seqlens[j], j - 1, (long long)b->cu_seqlens[j - 1]);
        if (!m->cu_host)
            m->cu_host = LM_MALLOC(sizeof(int64_t) * (size_t)(m->max_seqs + 1) * 3);
        memcpy(m->cu_host, b->cu_seqlens, sizeof(int64_t) * (size_t)n_cu);
        int32_t *c32 = (int32_t *)(m->cu_host + m->max_seqs + 1);
        for (int j = 0; j < n_cu; j++)
            c32[j] = (int32_t)b->cu_seqlens[j];
        LM_TRY(lm_cuda_ctx_upload(m->ctx, m->cu_dev, c32, sizeof(int32_t) * (size_t)n_cu, err));
    }
    LM_TRY(lm_cuda_ctx_upload(m->ctx, m->ids, ids, sizeof(int32_t) * (size_t)N, err));
    if (labels)
        LM_TRY(lm_cuda_ctx_upload(m->ctx, m->labels, labels, sizeof(int32_t) * (size_t)N, err));
    m->b = (lm_gpu_batch){m->ctx,
                          b->B,
                          b->T,
                          N,
                          b->cu_seqlens ? m->cu_host : NULL,
                          n_cu,
                          b->cu_seqlens ? m->cu_dev : NULL,
                          training};
    return LM_OK;
}

/* ---------------------------------------------------------------- attention layer */

static void attn_cfg(const lm_gpu_model *m, const gpu_layer *ly, lm_attention_config *ac) {
    lm_attention_config_default(ac, m->b.B, m->b.T, ly->ac.Hq, ly->ac.Hkv, ly->ac.Dh);
    ac->cu_seqlens = m->b.cu_seqlens;
    ac->n_cu_seqlens = m->b.n_cu;
    ac->scale = 1.0f / sqrtf((float)ly->ac.Dh);
    ac->causal = 1;
    ac->position = ly->ac.position;
    ac->rope_theta = ly->ac.rope_theta;
}

static lm_status attn_forward(lm_gpu_model *m, gpu_layer *ly, const void *x, void *out,
                              lm_error *err) {
    const int N = (int)m->b.N, d = m->d;
    const int cq = ly->ac.Hq * ly->ac.Dh, ckv = ly->ac.Hkv * ly->ac.Dh;
    LM_TRY(mm(m, 0, 1, N, cq, d, x, d, ly->wq, d, 0, ly->q, cq, 0, err));
    LM_TRY(mm(m, 0, 1, N, ckv, d, x, d, ly->wk, d, 0, ly->k, ckv, 0, err));
    LM_TRY(mm(m, 0, 1, N, ckv, d, x, d, ly->wv, d, 0, ly->v, ckv, 0, err));
    lm_attention_config ac;
    attn_cfg(m, ly, &ac);
    LM_TRY(lm_cuda_attention_forward(m->ctx, &ac, ly->q, ly->k, ly->v, ly->o, ly->lse, err));
    return mm(m, 0, 1, N, d, cq, ly->o, cq, ly->wo, cq, 0, out, d, 0, err);
}

static lm_status attn_backward(lm_gpu_model *m, gpu_layer *ly, const void *x, const void *dout,
                               void *dx, lm_error *err) {
    const int N = (int)m->b.N, d = m->d;
    const int cq = ly->ac.Hq * ly->ac.Dh, ckv = ly->ac.Hkv * ly->ac.Dh;
    /* out = o Wo^T: dO = dout Wo [N, cq], dWo += dout^T o [d, cq] */
    LM_TRY(mm(m, 0, 0, N, cq, d, dout, d, ly->wo, cq, 0, m->s_dO, cq, 0, err));
    LM_TRY(mm(m, 1, 0, d, cq, N, dout, d, ly->o, cq, 1, ly->go, cq, 1, err));
    lm_attention_config ac;
    attn_cfg(m, ly, &ac);
    LM_TRY(lm_cuda_attention_backward(m->ctx, &ac, ly->q, ly->k, ly->v, ly->o, ly->lse, m->s_dO,
                                      m->s_dq, m->s_dk, m->s_dv, err));
    LM_TRY(mm(m, 1, 0, cq, d, N, m->s_dq, cq, x, d, 1, ly->gq, d, 1, err));
    LM_TRY(mm(m, 1, 0, ckv, d, N, m->s_dk, ckv, x, d, 1, ly->gk, d, 1, err));
    LM_TRY(mm(m, 1, 0, ckv, d, N, m->s_dv, ckv, x, d, 1, ly->gv, d, 1, err));
    LM_TRY(mm(m, 0, 0, N, d, cq, m->s_dq, cq, ly->wq, d, 0, dx, d, 0, err));
    LM_TRY(mm(m, 0, 0, N, d, ckv, m->s_dk, ckv, ly->wk, d, 1, dx, d, 0, err));
    return mm(m, 0, 0, N, d, ckv, m->s_dv, ckv, ly->wv, d, 1, dx, d, 0, err);
}

/* ---------------------------------------------------------------- dense SwiGLU FFN */

static lm_status dense_forward(lm_gpu_model *m, gpu_layer *ly, const void *x, void *out,
                               lm_error *err) {
    const int N = (int)m->b.N, d = m->d, I = ly->I;
    if (ly->gu_fused) {
        LM_TRY(mm(m, 0, 1, N, 2 * I, d, x, d, ly->wg, d, 0, ly->gu, 2 * I, 0, err));
    } else {
        LM_TRY(mm(m, 0, 1, N, I, d, x, d, ly->wg, d, 0, ly->gu, 2 * I, 0, err));
        LM_TRY(mm(m, 0, 1, N, I, d, x, d, ly->wu, d, 0, (uint16_t *)ly->gu + I, 2 * I, 0, err));
    }
    LM_TRY(lm_cuda_swiglu_forward(m->ctx, N, I, ly->gu, m->s_h, err));
    return mm(m, 0, 1, N, d, I, m->s_h, I, ly->wd, I, 0, out, d, 0, err);
}

static lm_status dense_backward(lm_gpu_model *m, gpu_layer *ly, const void *x, const void *dout,
                                void *dx, lm_error *err) {
    const int N = (int)m->b.N, d = m->d, I = ly->I;
    /* dh = dout Wd [N, I]; [dg | du] and h (recomputed) from the saved [g | u] */
    LM_TRY(mm(m, 0, 0, N, I, d, dout, d, ly->wd, I, 0, m->s_dh, I, 0, err));
    LM_TRY(lm_cuda_swiglu_backward(m->ctx, N, I, ly->gu, m->s_dh, m->s_dgu, m->s_h, err));
    LM_TRY(mm(m, 1, 0, d, I, N, dout, d, m->s_h, I, 1, ly->gd, I, 1, err));
    const uint16_t *dgu = m->s_dgu;
    if (ly->gu_fused) {
        /* d[Wg; Wu] += [dg | du]^T x;  dx = [dg | du] [Wg; Wu] */
        LM_TRY(mm(m, 1, 0, 2 * I, d, N, dgu, 2 * I, x, d, 1, ly->gg, d, 1, err));
        return mm(m, 0, 0, N, d, 2 * I, dgu, 2 * I, ly->wg, d, 0, dx, d, 0, err);
    }
    LM_TRY(mm(m, 1, 0, I, d, N, dgu, 2 * I, x, d, 1, ly->gg, d, 1, err));
    LM_TRY(mm(m, 1, 0, I, d, N, dgu + I, 2 * I, x, d, 1, ly->gup, d, 1, err));
    LM_TRY(mm(m, 0, 0, N, d, I, dgu, 2 * I, ly->wg, d, 0, dx, d, 0, err));
    return mm(m, 0, 0, N, d, I, dgu + I, 2 * I, ly->wu, d, 1, dx, d, 0, err);
}

/* ---------------------------------------------------------------- sublayers */

static int sub_class(const lm_gpu_model *m, int l) {
    const gpu_layer *ly = &m->ly[l / 2];
    if (l % 2 == 0)
        return ly->kind == LM_LAYER_KDA ? LM_GPU_PROF_KDA : LM_GPU_PROF_ATTN;
    return ly->moe ? LM_GPU_PROF_MOE : LM_GPU_PROF_DENSE;
}

static lm_status sub_forward(lm_gpu_model *m, int l, const void *x, void *out, int slot,
                             lm_error *err) {
    gpu_layer *ly = &m->ly[l / 2];
    if (l % 2 == 0) {
        if (ly->kind == LM_LAYER_KDA)
            return lm_gpu_kda_layer_forward(ly->kda, &m->b, &ly->kw, x, out, err);
        return attn_forward(m, ly, x, out, err);
    }
    if (!ly->moe)
        return dense_forward(m, ly, x, out, err);
    const float *aux = NULL;
    LM_TRY(lm_gpu_moe_layer_forward(ly->ml, &m->b, &ly->mw, x, out, &aux, err));
    if (aux && slot >= 0)
        LM_TRY(lm_cuda_ctx_copy(m->ctx, m->aux + (size_t)slot * m->L + l / 2, aux, 4, err));
    return LM_OK;
}

/* Activation recompute: sublayer l's forward again from its kept input xn[l], refilling
 * the saved activations it shares with the other recomputed layers; the output goes to
 * obuf (free during the backward) and is not used. */
static lm_status sub_refill(lm_gpu_model *m, int l, lm_error *err) {
    gpu_layer *ly = &m->ly[l / 2];
    const void *x = m->xn[l];
    if (l % 2 == 0) {
        if (ly->kind == LM_LAYER_KDA)
            return lm_gpu_kda_layer_forward(ly->kda, &m->b, &ly->kw, x, m->obuf, err);
        return attn_forward(m, ly, x, m->obuf, err);
    }
    if (!ly->moe)
        return dense_forward(m, ly, x, m->obuf, err);
    return lm_gpu_moe_layer_refill(ly->ml, &m->b, &ly->mw, x, m->obuf, err);
}

static lm_status sub_backward(lm_gpu_model *m, int l, const void *dout, void *dx, lm_error *err) {
    gpu_layer *ly = &m->ly[l / 2];
    const void *x = m->xn[l];
    if (ly->rc)
        LM_TRY(sub_refill(m, l, err));
    if (l % 2 == 0) {
        if (ly->kind == LM_LAYER_KDA)
            return lm_gpu_kda_layer_backward(ly->kda, &m->b, &ly->kw, x, dout, dx, &ly->kg, err);
        return attn_backward(m, ly, x, dout, dx, err);
    }
    if (!ly->moe)
        return dense_backward(m, ly, x, dout, dx, err);
    /* the backward of loss_scale * (CE + aux losses), as the CPU model's */
    return lm_gpu_moe_layer_backward(ly->ml, &m->b, &ly->mw, x, dout, m->loss_scale, dx, &ly->mg,
                                     err);
}

/* AttnRes sources of sublayer l (model.c ar_sources): -1 the embedding, else the
 * sublayer whose run[] holds it. */
static int ar_sources(const lm_gpu_model *m, int l, int *src_idx) {
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

static void ar_config(const lm_gpu_model *m, lm_attnres_config *ac, int L) {
    lm_attnres_config_default(ac, L, m->b.N, m->d);
    ac->eps = m->cfg.rms_norm_eps;
    ac->scale = 1.0f;
    ac->trusted_inputs = 1;
}

static lm_status prefix(lm_status st, int l, const char *what, lm_error *err) {
    if (st == LM_OK)
        return st;
    char buf[sizeof(err->msg)];
    snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
    return lm_errorf(err, st, "gpu model: layer %d %s %s: %s", l / 2 + 1, l % 2 ? "ffn" : "mixer", what,
                     buf);
}

/* Embedding through the final norm: m->xfin. slot: where MoE aux losses go (-1: none). */
static lm_status run_forward(lm_gpu_model *m, int slot, lm_error *err) {
    const int64_t N = m->b.N;
    const int d = m->d;
    const float eps = m->cfg.rms_norm_eps;
    PROF(m, LM_GPU_PROF_EMBED,
         lm_cuda_embedding_forward(m->ctx, N, m->V, d, m->ids, m->W_emb, m->e, NULL, err));
    const void *srcs[NSUB_MAX + 2];
    int sidx[NSUB_MAX + 2];
    if (!m->attnres) {
        m->hp[0] = m->e;
        PROF(m, LM_GPU_PROF_NORM,
             lm_cuda_rmsnorm_forward(m->ctx, N, d, eps, m->e, NULL, m->ly[0].norm_w[0], NULL,
                                     m->xn[0], m->rstd[0], err));
        for (int l = 0; l < m->nsub; l++) {
            PROF(m, sub_class(m, l),
                 prefix(sub_forward(m, l, m->xn[l], m->obuf, slot, err), l, "forward", err));
            if (l + 1 < m->nsub) {
                PROF(m, LM_GPU_PROF_NORM,
                     lm_cuda_rmsnorm_forward(m->ctx, N, d, eps, m->obuf, m->hp[l],
                                             m->ly[(l + 1) / 2].norm_w[(l + 1) % 2], m->h[l + 1],
                                             m->xn[l + 1], m->rstd[l + 1], err));
                m->hp[l + 1] = m->h[l + 1];
            } else {
                PROF(m, LM_GPU_PROF_NORM,
                     lm_cuda_rmsnorm_forward(m->ctx, N, d, eps, m->obuf, m->hp[l], m->norm_fin,
                                             m->hfin, m->xfin, m->rstd_fin, err));
            }
        }
        return LM_OK;
    }
    for (int l = 0; l < m->nsub; l++) {
        gpu_layer *ly = &m->ly[l / 2];
        const int ns = ar_sources(m, l, sidx);
        if (ns == 1) {
            m->hp[l] = m->e;
        } else {
            for (int j = 0; j < ns; j++)
                srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
            lm_attnres_config ac;
            ar_config(m, &ac, ns);
            PROF(m, LM_GPU_PROF_ATTNRES,
                 lm_cuda_attnres_forward_ptrs(m->ctx, &ac, srcs, ly->arq[l % 2], ly->arn[l % 2],
                                              m->h[l], NULL, err));
            m->hp[l] = m->h[l];
        }
        PROF(m, LM_GPU_PROF_NORM,
             lm_cuda_rmsnorm_forward(m->ctx, N, d, eps, m->hp[l], NULL, ly->norm_w[l % 2], NULL,
                                     m->xn[l], m->rstd[l], err));
        PROF(m, sub_class(m, l),
             prefix(sub_forward(m, l, m->xn[l], m->run[l], slot, err), l, "forward", err));
        if (l % m->S != 0)
            PROF(m, LM_GPU_PROF_ATTNRES,
                 lm_cuda_add_bf16(m->ctx, N * d, m->run[l], m->run[l - 1], m->run[l], err));
    }
    const int ns = ar_sources(m, m->nsub, sidx);
    for (int j = 0; j < ns; j++)
        srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
    lm_attnres_config ac;
    ar_config(m, &ac, ns);
    PROF(m, LM_GPU_PROF_ATTNRES,
         lm_cuda_attnres_forward_ptrs(m->ctx, &ac, srcs, m->arq_fin, m->arn_fin, m->hfin, NULL,
                                      err));
    PROF(m, LM_GPU_PROF_NORM,
         lm_cuda_rmsnorm_forward(m->ctx, N, d, eps, m->hfin, NULL, m->norm_fin, NULL, m->xfin,
                                 m->rstd_fin, err));
    return LM_OK;
}

static void ce_cfg(const lm_gpu_model *m, lm_cuda_ce_config *cc, float dloss) {
    lm_cuda_ce_config_default(cc, m->b.N, m->d, m->V);
    cc->ignore_index = LM_MODEL_IGNORE;
    cc->dloss = dloss;
    cc->mean = 1;
}

/* The parameter ranges of grads_ready (gpu_model.h): [0, lay_lo[0]) the embedding (and
 * any model-level tensor before layer 0), [lay_lo[i], lay_lo[i + 1]) decoder layer i,
 * [lay_lo[L], numel) the tail. ranges_ok = 0 when some tensor lies outside its range
 * (an expert-sharded table puts the routed experts behind everything). */
static void grad_ranges(lm_gpu_model *m) {
    const int L = m->L;
    m->ranges_ok = 0;
    if (L < 1)
        return;
    for (int i = 0; i <= L; i++)
        m->lay_lo[i] = -1;
    int64_t tail = m->numel;
    for (int t = 0; t < m->n_info; t++) {
        const lm_param_info *e = &m->info[t];
        if (e->layer >= 0 && e->layer < L &&
            (m->lay_lo[e->layer] < 0 || e->offset < m->lay_lo[e->layer]))
            m->lay_lo[e->layer] = e->offset;
    }
    int ok = 1;
    for (int i = 0; i < L; i++)
        ok &= m->lay_lo[i] >= 0 && (i == 0 || m->lay_lo[i] > m->lay_lo[i - 1]);
    for (int t = 0; ok && t < m->n_info; t++) {
        const lm_param_info *e = &m->info[t];
        if (e->layer < 0 && e->offset > m->lay_lo[L - 1] && e->offset < tail)
            tail = e->offset;
    }
    m->lay_lo[L] = tail;
    for (int t = 0; ok && t < m->n_info; t++) {
        const lm_param_info *e = &m->info[t];
        const int64_t lo = e->offset, hi = e->offset + e->numel;
        if (e->layer >= 0 && e->layer < L)
            ok = lo >= m->lay_lo[e->layer] && hi <= m->lay_lo[e->layer + 1];
        else
            ok = hi <= m->lay_lo[0] || lo >= m->lay_lo[L];
    }
    m->ranges_ok = ok;
}

/* grads_ready for [lo, hi) when the running micro-step reduces. */
static lm_status ready(lm_gpu_model *m, int64_t lo, int64_t hi, lm_error *err) {
    if (!m->reduce || !m->dp.grads_ready || hi <= lo)
        return LM_OK;
    return m->dp.grads_ready(m->dp.arg, m->g32, lo, hi, err);
}

/* The backward of sublayer l is done (its norm and AttnRes vectors too): layer l / 2's
 * gradients are final once its mixer (the even sublayer, the layer's last) is done. */
static lm_status ready_sub(lm_gpu_model *m, int l, lm_error *err) {
    if (l % 2 != 0 || !m->ranges_ok)
        return LM_OK;
    return ready(m, m->lay_lo[l / 2], m->lay_lo[l / 2 + 1], err);
}

static lm_status ready_tail(lm_gpu_model *m, lm_error *err) {
    return m->ranges_ok ? ready(m, m->lay_lo[m->L], m->numel, err) : LM_OK;
}

static lm_status ready_head(lm_gpu_model *m, lm_error *err) {
    return ready(m, 0, m->ranges_ok ? m->lay_lo[0] : m->numel, err);
}

static lm_status run_backward(lm_gpu_model *m, lm_error *err) {
    const int64_t N = m->b.N, Nd = N * m->d;
    const int d = m->d;
    const float eps = m->cfg.rms_norm_eps;
    const void *srcs[NSUB_MAX + 2];
    void *dsrc[NSUB_MAX + 2];
    int sidx[NSUB_MAX + 2];
    if (!m->attnres) {
        /* G: the gradient of the residual stream, bf16 */
        PROF(m, LM_GPU_PROF_NORM,
             lm_cuda_rmsnorm_backward(m->ctx, N, d, eps, m->hfin, m->norm_fin, m->rstd_fin,
                                      m->dxfin, NULL, m->G16, m->g_norm_fin, err));
        LM_TRY(ready_tail(m, err));
        for (int l = m->nsub - 1; l >= 0; l--) {
            gpu_layer *ly = &m->ly[l / 2];
            PROF(m, sub_class(m, l),
                 prefix(sub_backward(m, l, m->G16, m->dxn, err), l, "backward", err));
            PROF(m, LM_GPU_PROF_NORM,
                 lm_cuda_rmsnorm_backward(m->ctx, N, d, eps, m->hp[l], ly->norm_w[l % 2],
                                          m->rstd[l], m->dxn, m->G16, m->G16, ly->norm_g[l % 2],
                                          err));
            LM_TRY(ready_sub(m, l, err));
        }
        PROF(m, LM_GPU_PROF_EMBED,
             lm_cuda_embedding_backward(m->ctx, N, m->V, d, m->ids, m->G16, m->g_emb, err));
        return ready_head(m, err);
    }
    PROF(m, LM_GPU_PROF_NORM,
         lm_cuda_rmsnorm_backward(m->ctx, N, d, eps, m->hfin, m->norm_fin, m->rstd_fin, m->dxfin,
                                  NULL, m->dh, m->g_norm_fin, err));
    LM_TRY(lm_cuda_ctx_memset(m->ctx, m->dE16, 0, (size_t)Nd * 2, err));
    LM_TRY(lm_cuda_ctx_memset(m->ctx, m->Gr16, 0, (size_t)Nd * 2, err));
    for (int j = 0; j < m->nblocks; j++)
        LM_TRY(lm_cuda_ctx_memset(m->ctx, m->dB16[j], 0, (size_t)Nd * 2, err));
    /* dL/d run[l]: the running part's accumulator. The accumulators are bf16, added in
     * fp32 and rounded once per contribution (cuda_attnres.h), as the standard residual's
     * gradient stream is: an fp32 read-modify-write of every source at every sublayer
     * was most of Block AttnRes's cost (docs/perf-notes.md). */
    void *Gp = m->Gr16;
    int ns = ar_sources(m, m->nsub, sidx);
    for (int j = 0; j < ns; j++) {
        srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
        dsrc[j] = sidx[j] < 0 ? m->dE16 : sidx[j] == m->nsub - 1 ? Gp : m->dB16[sidx[j] / m->S];
    }
    lm_attnres_config ac;
    ar_config(m, &ac, ns);
    ac.accumulate = 1;
    PROF(m, LM_GPU_PROF_ATTNRES,
         lm_cuda_attnres_backward_ptrs(m->ctx, &ac, srcs, m->arq_fin, m->arn_fin, m->dh, dsrc,
                                       LM_BF16, m->arq_fin_g, m->arn_fin_g, err));
    LM_TRY(ready_tail(m, err));
    for (int l = m->nsub - 1; l >= 0; l--) {
        gpu_layer *ly = &m->ly[l / 2];
        /* a block's last sublayer (not the model's last) takes its block's gradient */
        if (l != m->nsub - 1 && l % m->S == m->S - 1)
            Gp = m->dB16[l / m->S];
        PROF(m, sub_class(m, l), prefix(sub_backward(m, l, Gp, m->dxn, err), l, "backward", err));
        PROF(m, LM_GPU_PROF_NORM,
             lm_cuda_rmsnorm_backward(m->ctx, N, d, eps, m->hp[l], ly->norm_w[l % 2], m->rstd[l],
                                      m->dxn, NULL, m->dh, ly->norm_g[l % 2], err));
        ns = ar_sources(m, l, sidx);
        if (ns == 1) {
            PROF(m, LM_GPU_PROF_ATTNRES, lm_cuda_add_bf16(m->ctx, Nd, m->dE16, m->dh, m->dE16, err));
            LM_TRY(ready_sub(m, l, err));
            continue;
        }
        for (int j = 0; j < ns; j++) {
            srcs[j] = sidx[j] < 0 ? m->e : m->run[sidx[j]];
            dsrc[j] = sidx[j] < 0                           ? m->dE16
                      : (l % m->S != 0 && sidx[j] == l - 1) ? Gp
                                                            : m->dB16[sidx[j] / m->S];
        }
        ar_config(m, &ac, ns);
        ac.accumulate = 1;
        PROF(m, LM_GPU_PROF_ATTNRES,
             lm_cuda_attnres_backward_ptrs(m->ctx, &ac, srcs, ly->arq[l % 2], ly->arn[l % 2], m->dh,
                                           dsrc, LM_BF16, ly->arq_g[l % 2], ly->arn_g[l % 2], err));
        LM_TRY(ready_sub(m, l, err));
    }
    PROF(m, LM_GPU_PROF_EMBED,
         lm_cuda_embedding_backward(m->ctx, N, m->V, d, m->ids, m->dE16, m->g_emb, err));
    return ready_head(m, err);
}

static lm_status check_slot(int slot, lm_error *err) {
    if (slot < 0 || slot >= LM_GPU_MODEL_MAX_MICRO)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: slot = %d outside [0, %d)", slot,
                         LM_GPU_MODEL_MAX_MICRO);
    return LM_OK;
}

lm_status lm_gpu_model_micro_step(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                                  const int32_t *labels, float loss_scale, int accumulate, int slot,
                                  lm_error *err) {
    return lm_gpu_model_micro_step_ex(m, b, ids, labels, loss_scale, accumulate, slot, 0, err);
}

lm_status lm_gpu_model_set_dp(lm_gpu_model *m, const lm_gpu_model_dp *dp, lm_error *err) {
    if (!m)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL model");
    memset(&m->dp, 0, sizeof m->dp);
    if (dp)
        m->dp = *dp;
    return LM_OK;
}

lm_status lm_gpu_model_micro_step_ex(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                                     const int32_t *labels, float loss_scale, int accumulate,
                                     int slot, int reduce, lm_error *err) {
    if (!m || !labels)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: micro_step needs a model and labels");
    if (!isfinite(loss_scale))
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: loss_scale = %g is not finite",
                         (double)loss_scale);
    LM_TRY(check_slot(slot, err));
    LM_TRY(set_batch(m, b, ids, labels, 1, err));
    m->loss_scale = loss_scale;
    if (!accumulate)
        LM_TRY(lm_cuda_ctx_memset(m->ctx, m->g32, 0, (size_t)m->numel * 4, err));
    LM_TRY(lm_cuda_ctx_memset(m->ctx, m->aux + (size_t)slot * m->L, 0, (size_t)m->L * 4, err));
    LM_TRY(run_forward(m, slot, err));
    lm_cuda_ce_config cc;
    ce_cfg(m, &cc, loss_scale);
    lm_cuda_ce_outputs co = {m->loss_sum + slot, m->count + slot, NULL, m->dxfin, m->g_head};
    PROF(m, LM_GPU_PROF_CE,
         lm_cuda_ce_forward_backward(m->ctx, &cc, m->xfin, m->W_head, m->labels, &co, err));
    m->reduce = reduce != 0;
    const lm_status st = run_backward(m, err);
    m->reduce = 0;
    /* the buffers (MoE biases' slots of the gradient) carry no gradient: never written */
    return st;
}

lm_status lm_gpu_model_eval(lm_gpu_model *m, const lm_model_batch *b, const int32_t *ids,
                            const int32_t *labels, int slot, float *nll_host, lm_error *err) {
    if (!m || !labels)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: eval needs a model and labels");
    LM_TRY(check_slot(slot, err));
    LM_TRY(set_batch(m, b, ids, labels, 0, err));
    LM_TRY(lm_cuda_ctx_memset(m->ctx, m->aux + (size_t)slot * m->L, 0, (size_t)m->L * 4, err));
    LM_TRY(run_forward(m, slot, err));
    lm_cuda_ce_config cc;
    ce_cfg(m, &cc, 1.0f);
    PROF(m, LM_GPU_PROF_CE,
         lm_cuda_ce_forward(m->ctx, &cc, m->xfin, m->W_head, m->labels, m->loss_sum + slot,
                            m->count + slot, m->nll, err));
    if (nll_host)
        LM_TRY(lm_cuda_ctx_download(m->ctx, nll_host, m->nll, sizeof(float) * (size_t)m->b.N, err));
    return LM_OK;
}

lm_status lm_gpu_model_logits_rows(lm_gpu_model *m, int64_t row0, int n_rows, float *logits_host,
                                   lm_error *err) {
    if (!m || !logits_host)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: logits_rows: NULL argument");
    if (n_rows < 1 || n_rows > LM_GPU_MODEL_LOGIT_ROWS || row0 < 0 || row0 + n_rows > m->b.N)
        return lm_errorf(err, LM_ERR_INVALID,
                         "gpu model: logits_rows %lld .. %lld outside the last batch of %lld "
                         "tokens (at most %d rows)",
                         (long long)row0, (long long)(row0 + n_rows), (long long)m->b.N,
                         LM_GPU_MODEL_LOGIT_ROWS);
    const uint16_t *x = (const uint16_t *)m->xfin + row0 * m->d;
    LM_TRY(
        mm(m, 0, 1, n_rows, m->V, m->d, x, m->d, m->W_head, m->d, 0, m->logit_rows, m->V, 1, err));
    return lm_cuda_ctx_download(m->ctx, logits_host, m->logit_rows,
                                sizeof(float) * (size_t)n_rows * m->V, err);
}

/* ---------------------------------------------------------------- optimizer */

lm_status lm_gpu_model_grad_norm(lm_gpu_model *m, lm_error *err) {
    if (!m)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL model");
    PROF(m, LM_GPU_PROF_OPTIM,
         lm_cuda_adamw_grad_norm(m->ctx, m->opt, m->g32, m->gnorm, m->skipped, err));
    return LM_OK;
}

lm_status lm_gpu_model_read_step(lm_gpu_model *m, int n_slots, double *loss, int64_t *n_labels,
                                 double *gnorm, lm_error *err) {
    if (!m || n_slots < 0 || n_slots > LM_GPU_MODEL_MAX_MICRO)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: read_step of %d slots", n_slots);
    /* one synchronisation: the scalars live next to each other in the scratch class */
    const size_t bytes = (size_t)((char *)(m->metrics) - (char *)m->loss_sum);
    char *buf = LM_MALLOC(bytes);
    lm_status st = lm_cuda_ctx_download(m->ctx, buf, m->loss_sum, bytes, err);
    if (st == LM_OK) {
        const float *ls = (const float *)buf;
        const int32_t *cn = (const int32_t *)(buf + ((char *)m->count - (char *)m->loss_sum));
        const float *ax = (const float *)(buf + ((char *)m->aux - (char *)m->loss_sum));
        const float *gn = (const float *)(buf + ((char *)m->gnorm - (char *)m->loss_sum));
        for (int i = 0; i < n_slots; i++) {
            double v = cn[i] > 0 ? (double)ls[i] / cn[i] : 0.0;
            for (int l = 0; l < m->L; l++)
                v += ax[(size_t)i * m->L + l];
            if (loss)
                loss[i] = isfinite(v) ? v : NAN;
            if (n_labels)
                n_labels[i] = cn[i];
        }
        if (gnorm)
            *gnorm = isfinite(*gn) ? (double)*gn : NAN;
    }
    free(buf);
    return st;
}

lm_status lm_gpu_model_optim_step(lm_gpu_model *m, double lr, double weight_decay, double beta1,
                                  double beta2, double eps, double grad_clip, int64_t t,
                                  lm_router_metrics *metrics_host, double *demand_host,
                                  lm_error *err) {
    if (!m)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL model");
    lm_cuda_adamw_hparams hp = {lr, weight_decay, beta1, beta2, eps, grad_clip, t};
    PROF(m, LM_GPU_PROF_OPTIM,
         lm_cuda_adamw_step(m->ctx, m->opt, &hp, m->p32, m->g32, m->m1, m->m2, m->p16, m->gnorm,
                            err));
    int any = 0;
    const int E = m->cfg.moe.router.num_experts;
    if (m->dp.router_sums) {
        /* data parallel: the step's balance sums over the ranks ("all-reduce here",
         * cuda_router.h), so every rank applies the same bias update */
        double *acc[LM_MAX_LAYERS];
        int n = 0;
        for (int i = 0; i < m->L; i++)
            if (m->ly[i].ml)
                acc[n++] = lm_gpu_moe_layer_router(m->ly[i].ml)->acc;
        if (n > 0)
            LM_TRY(m->dp.router_sums(m->dp.arg, acc, LM_CUDA_ROUTER_ACC_LEN(E), n, err));
    }
    for (int i = 0; i < m->L; i++) {
        if (!m->ly[i].ml)
            continue;
        /* the step's demand (the first E sums of the accumulators) before the update
         * zeroes them */
        lm_cuda_router_state *rs = lm_gpu_moe_layer_router(m->ly[i].ml);
        LM_TRY(
            lm_cuda_ctx_copy(m->ctx, m->demand + (size_t)i * E, rs->acc, sizeof(double) * E, err));
        PROF(m, LM_GPU_PROF_OPTIM, lm_gpu_moe_layer_update_bias(m->ly[i].ml, m->metrics + i, err));
        any = 1;
    }
    if (any && (metrics_host || demand_host)) {
        const size_t mb = sizeof(lm_router_metrics) * (size_t)m->L;
        const size_t db = sizeof(double) * (size_t)m->L * E;
        char *tmp = LM_MALLOC(mb + db);
        /* metrics and demand are adjacent in the scratch class: one download */
        lm_status st = lm_cuda_ctx_download(m->ctx, tmp, m->metrics, mb + db, err);
        if (st == LM_OK)
            for (int i = 0; i < m->L; i++) {
                if (!m->ly[i].ml)
                    continue;
                if (metrics_host)
                    metrics_host[i] = ((const lm_router_metrics *)tmp)[i];
                if (demand_host)
                    memcpy(demand_host + (size_t)i * E, tmp + mb + sizeof(double) * (size_t)i * E,
                           sizeof(double) * E);
            }
        free(tmp);
        LM_TRY(st);
    }
    return LM_OK;
}

lm_status lm_gpu_model_skip_step(lm_gpu_model *m, lm_error *err) {
    if (!m)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL model");
    for (int i = 0; i < m->L; i++)
        if (m->ly[i].ml)
            LM_TRY(lm_gpu_moe_layer_reset_step(m->ly[i].ml, err));
    return LM_OK;
}

lm_status lm_gpu_model_get_moments(lm_gpu_model *m, float *m1, float *m2, lm_error *err) {
    if (!m || !m1 || !m2)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: get_moments: NULL argument");
    LM_TRY(lm_cuda_ctx_download(m->ctx, m1, m->m1, (size_t)m->numel * 4, err));
    return lm_cuda_ctx_download(m->ctx, m2, m->m2, (size_t)m->numel * 4, err);
}

lm_status lm_gpu_model_set_moments(lm_gpu_model *m, const float *m1, const float *m2,
                                   lm_error *err) {
    if (!m || !m1 || !m2)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: set_moments: NULL argument");
    LM_TRY(lm_cuda_ctx_upload(m->ctx, m->m1, m1, (size_t)m->numel * 4, err));
    return lm_cuda_ctx_upload(m->ctx, m->m2, m2, (size_t)m->numel * 4, err);
}

static lm_status router_of(lm_gpu_model *m, int layer, lm_cuda_router_state **rs, lm_error *err) {
    if (!m || layer < 0 || layer >= m->L || !m->ly[layer].ml)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: layer %d has no router", layer);
    *rs = lm_gpu_moe_layer_router(m->ly[layer].ml);
    return LM_OK;
}

lm_status lm_gpu_model_get_router(lm_gpu_model *m, int layer, lm_router_state *st, lm_error *err) {
    lm_cuda_router_state *rs = NULL;
    LM_TRY(router_of(m, layer, &rs, err));
    return lm_cuda_router_state_download(m->ctx, rs, st, err);
}

lm_status lm_gpu_model_set_router(lm_gpu_model *m, int layer, const lm_router_state *st,
                                  lm_error *err) {
    lm_cuda_router_state *rs = NULL;
    LM_TRY(router_of(m, layer, &rs, err));
    return lm_cuda_router_state_upload(m->ctx, rs, st, err);
}

lm_status lm_gpu_model_poke_grad(lm_gpu_model *m, int64_t index, float value, lm_error *err) {
    if (!m || index < 0 || index >= m->numel)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: poke_grad index %lld", (long long)index);
    return lm_cuda_ctx_upload(m->ctx, m->g32 + index, &value, sizeof value, err);
}

lm_status lm_gpu_model_get_grads(lm_gpu_model *m, float *g, lm_error *err) {
    if (!m || !g)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: get_grads: NULL argument");
    return lm_cuda_ctx_download(m->ctx, g, m->g32, (size_t)m->numel * 4, err);
}

/* ---------------------------------------------------------------- profiling */

const char *lm_gpu_prof_name(int cls) {
    static const char *const names[LM_GPU_PROF_N] = {"embedding", "norms",         "kda",
                                                     "attention", "dense_ffn",     "moe",
                                                     "attnres",   "cross_entropy", "optimizer"};
    return cls >= 0 && cls < LM_GPU_PROF_N ? names[cls] : "?";
}

lm_status lm_gpu_model_set_profile(lm_gpu_model *m, int on, lm_error *err) {
    if (!m)
        return lm_errorf(err, LM_ERR_INVALID, "gpu model: NULL model");
    memset(m->prof, 0, sizeof m->prof);
    if (on && !m->timer)
        LM_TRY(lm_cuda_timer_new(m->ctx, &m->timer, err));
    if (!on) {
        lm_cuda_timer_free(m->timer);
        m->timer = NULL;
    }
    return LM_OK;
}

void lm_gpu_model_profile(const lm_gpu_model *m, double *ms) {
    for (int k = 0; k < LM_GPU_PROF_N; k++)
        ms[k] = m ? m->prof[k] : 0;
}
