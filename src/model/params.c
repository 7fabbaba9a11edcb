/* Parameter table, init, counts and checkpoints. See params.h. */
#include "linmoe/params.h"
#include "model/model_internal.h"

#include "linmoe/safetensors.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ALIGN_ELEMS 16 /* 64 bytes */

typedef struct {
    lm_param_info *t;
    int n, cap;
    int64_t off;
} table;

static void add(table *tb, int layer, lm_param_init init, int decay, int buffer, int routed,
                int ndim, int64_t s0, int64_t s1, int64_t s2, const char *fmt, ...)
    __attribute__((format(printf, 11, 12)));

static void add(table *tb, int layer, lm_param_init init, int decay, int buffer, int routed,
                int ndim, int64_t s0, int64_t s1, int64_t s2, const char *fmt, ...) {
    if (tb->n == tb->cap) {
        tb->cap = tb->cap ? 2 * tb->cap : 64;
        lm_param_info *nt = realloc(tb->t, (size_t)tb->cap * sizeof *nt);
        LM_CHECK(nt != NULL);
        tb->t = nt;
    }
    lm_param_info *e = &tb->t[tb->n++];
    memset(e, 0, sizeof *e);
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(e->name, sizeof e->name, fmt, ap);
    va_end(ap);
    LM_CHECK(w > 0 && w < (int)sizeof e->name);
    e->ndim = ndim;
    e->shape[0] = s0;
    e->shape[1] = s1;
    e->shape[2] = s2;
    e->numel = s0 * (ndim > 1 ? s1 : 1) * (ndim > 2 ? s2 : 1);
    e->offset = tb->off;
    tb->off += (e->numel + ALIGN_ELEMS - 1) / ALIGN_ELEMS * ALIGN_ELEMS;
    e->layer = layer;
    e->init = init;
    e->gate = LM_GATE_BOUNDED;
    e->decay = (uint8_t)decay;
    e->buffer = (uint8_t)buffer;
    e->routed = (uint8_t)routed;
}

#define MAT2(layer, a, b, ...) add(&tb, layer, LM_INIT_NORMAL, 1, 0, 0, 2, a, b, 1, __VA_ARGS__)
#define VEC1(layer, init, a, ...) add(&tb, layer, init, 0, 0, 0, 1, a, 1, 1, __VA_ARGS__)

static void build(table *tb_, const lm_model_config *c) {
    table tb = *tb_;
    const int64_t d = c->hidden_size, V = c->vocab_size;
    const char *P = "model.layers";
    MAT2(-1, V, d, "model.embed_tokens.weight");
    for (int i = 0; i < c->num_hidden_layers; i++) {
        VEC1(i, LM_INIT_ONES, d, "%s.%d.input_layernorm.weight", P, i);
        if (c->kinds[i] == LM_LAYER_KDA) {
            const int64_t H = c->kda_num_heads, Dh = c->kda_head_dim, HD = H * Dh,
                          W = c->short_conv_kernel_size;
            MAT2(i, HD, d, "%s.%d.self_attn.q_proj.weight", P, i);
            MAT2(i, HD, d, "%s.%d.self_attn.k_proj.weight", P, i);
            MAT2(i, HD, d, "%s.%d.self_attn.v_proj.weight", P, i);
            static const char *cv[3] = {"q", "k", "v"};
            for (int j = 0; j < 3; j++)
                add(&tb, i, LM_INIT_CONV, 1, 0, 0, 2, HD, W, 1, "%s.%d.self_attn.%s_conv1d.weight",
                    P, i, cv[j]);
            MAT2(i, Dh, d, "%s.%d.self_attn.f_a_proj.weight", P, i);
            MAT2(i, HD, Dh, "%s.%d.self_attn.f_b_proj.weight", P, i);
            VEC1(i, LM_INIT_A_LOG, H, "%s.%d.self_attn.A_log", P, i);
            tb.t[tb.n - 1].gate = c->gate[i];
            VEC1(i, LM_INIT_DT_BIAS, HD, "%s.%d.self_attn.dt_bias", P, i);
            MAT2(i, H, d, "%s.%d.self_attn.b_proj.weight", P, i);
            MAT2(i, Dh, d, "%s.%d.self_attn.g_a_proj.weight", P, i);
            MAT2(i, HD, Dh, "%s.%d.self_attn.g_b_proj.weight", P, i);
            VEC1(i, LM_INIT_ONES, Dh, "%s.%d.self_attn.o_norm.weight", P, i);
            MAT2(i, d, HD, "%s.%d.self_attn.o_proj.weight", P, i);
        } else {
            const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads,
                          D = c->head_dim;
            MAT2(i, Hq * D, d, "%s.%d.self_attn.q_proj.weight", P, i);
            MAT2(i, Hkv * D, d, "%s.%d.self_attn.k_proj.weight", P, i);
            MAT2(i, Hkv * D, d, "%s.%d.self_attn.v_proj.weight", P, i);
            MAT2(i, d, Hq * D, "%s.%d.self_attn.o_proj.weight", P, i);
        }
        VEC1(i, LM_INIT_ONES, d, "%s.%d.post_attention_layernorm.weight", P, i);
        if (!lm_model_layer_is_moe(c, i)) {
            const int64_t I = c->intermediate_size;
            MAT2(i, I, d, "%s.%d.mlp.gate_proj.weight", P, i);
            MAT2(i, I, d, "%s.%d.mlp.up_proj.weight", P, i);
            MAT2(i, d, I, "%s.%d.mlp.down_proj.weight", P, i);
        } else {
            const int64_t E = c->moe.router.num_experts, f = c->moe.moe_intermediate_size,
                          fs = (int64_t)c->moe.n_shared_experts * f;
            MAT2(i, E, d, "%s.%d.mlp.gate.weight", P, i);
            add(&tb, i, LM_INIT_ZEROS, 0, 1, 0, 1, E, 1, 1,
                "%s.%d.mlp.gate.e_score_correction_bias", P, i);
            add(&tb, i, LM_INIT_NORMAL, 1, 0, 1, 3, E, f, d, "%s.%d.mlp.experts.gate_proj", P, i);
            add(&tb, i, LM_INIT_NORMAL, 1, 0, 1, 3, E, f, d, "%s.%d.mlp.experts.up_proj", P, i);
            add(&tb, i, LM_INIT_NORMAL, 1, 0, 1, 3, E, d, f, "%s.%d.mlp.experts.down_proj", P, i);
            if (fs > 0) {
                MAT2(i, fs, d, "%s.%d.mlp.shared_experts.gate_proj", P, i);
                MAT2(i, fs, d, "%s.%d.mlp.shared_experts.up_proj", P, i);
                MAT2(i, d, fs, "%s.%d.mlp.shared_experts.down_proj", P, i);
            }
        }
        if (c->residual != LM_RES_STANDARD) {
            VEC1(i, LM_INIT_ZEROS, d, "%s.%d.attn_res.query", P, i);
            VEC1(i, LM_INIT_ONES, d, "%s.%d.attn_res.norm.weight", P, i);
            VEC1(i, LM_INIT_ZEROS, d, "%s.%d.mlp_res.query", P, i);
            VEC1(i, LM_INIT_ONES, d, "%s.%d.mlp_res.norm.weight", P, i);
        }
    }
    if (c->residual != LM_RES_STANDARD) {
        VEC1(-1, LM_INIT_ZEROS, d, "model.attnres_final.query");
        VEC1(-1, LM_INIT_ONES, d, "model.attnres_final.norm.weight");
    }
    VEC1(-1, LM_INIT_ONES, d, "model.norm.weight");
    if (!c->tie_word_embeddings)
        MAT2(-1, V, d, "lm_head.weight");
    *tb_ = tb;
}

/* Expert sharding (params.h): the routed tensors cut to their E/P local experts and
 * moved behind the others (stable), then every offset laid out again in table order. */
static void shard_experts(table *tb, int ep_size, int64_t *expert_off) {
    lm_param_info *t = tb->t;
    int k = 0;
    lm_param_info *tmp = malloc((size_t)(tb->n > 0 ? tb->n : 1) * sizeof *tmp);
    LM_CHECK(tmp != NULL);
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < tb->n; i++)
            if (t[i].routed == pass)
                tmp[k++] = t[i];
    memcpy(t, tmp, (size_t)tb->n * sizeof *t);
    free(tmp);
    int64_t off = 0;
    *expert_off = -1;
    for (int i = 0; i < tb->n; i++) {
        if (t[i].routed) {
            if (*expert_off < 0)
                *expert_off = off;
            t[i].shape[0] /= ep_size;
            t[i].numel /= ep_size;
        }
        t[i].offset = off;
        off += (t[i].numel + ALIGN_ELEMS - 1) / ALIGN_ELEMS * ALIGN_ELEMS;
    }
    tb->off = off;
    if (*expert_off < 0)
        *expert_off = off;
}

lm_status lm_params_init(lm_params *p, const lm_model_config *cfg, lm_error *err) {
    return lm_params_init_ep(p, cfg, 0, 1, err);
}

lm_status lm_params_init_ep(lm_params *p, const lm_model_config *cfg, int ep_rank, int ep_size,
                            lm_error *err) {
    memset(p, 0, sizeof *p);
    LM_TRY(lm_model_config_validate(cfg, err));
    int any_moe = 0;
    for (int i = 0; i < cfg->num_hidden_layers; i++)
        any_moe |= lm_model_layer_is_moe(cfg, i);
    if (ep_size < 1 || ep_rank < 0 || ep_rank >= ep_size ||
        (any_moe && cfg->moe.router.num_experts % ep_size != 0))
        return lm_errorf(err, LM_ERR_INVALID,
                         "params: expert sharding rank %d of %d: want 0 <= rank < size and a "
                         "size that divides num_experts = %d",
                         ep_rank, ep_size, any_moe ? cfg->moe.router.num_experts : 0);
    p->cfg = *cfg;
    table tb = {0};
    build(&tb, cfg);
    p->ep_rank = ep_rank;
    p->ep_size = ep_size;
    p->expert_off = tb.off;
    if (ep_size > 1)
        shard_experts(&tb, ep_size, &p->expert_off);
    p->t = tb.t;
    p->n = tb.n;
    p->numel = tb.off;
    p->data = calloc((size_t)(p->numel > 0 ? p->numel : 1), sizeof(float));
    if (!p->data) {
        lm_params_free(p);
        return lm_errorf(err, LM_ERR_NOMEM, "params: cannot allocate %lld floats",
                         (long long)tb.off);
    }
    return LM_OK;
}

lm_status lm_params_layout_numel(const lm_model_config *cfg, int64_t *numel, lm_error *err) {
    *numel = 0;
    LM_TRY(lm_model_config_validate(cfg, err));
    table tb = {0};
    build(&tb, cfg);
    *numel = tb.off;
    free(tb.t);
    return LM_OK;
}

void lm_params_free(lm_params *p) {
    if (!p)
        return;
    free(p->t);
    free(p->data);
    memset(p, 0, sizeof *p);
}

const lm_param_info *lm_params_find(const lm_params *p, const char *name) {
    for (int i = 0; i < p->n; i++)
        if (strcmp(p->t[i].name, name) == 0)
            return &p->t[i];
    return NULL;
}

float *lm_params_get(const lm_params *p, const char *name) {
    const lm_param_info *e = lm_params_find(p, name);
    return e ? p->data + e->offset : NULL;
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h;
}

/* Value j of lm_rng_normal's stream with key `key`: it reads stream words 4j .. 4j+3,
 * which are Philox block j (core.h), so the block is computed once (not once per word)
 * and any j can be computed independently: the same values as the sequential stream,
 * on any number of threads. The uniforms are lm_rng_uniform's (27 + 26 bits). */
static double normal_at(uint64_t key, int64_t j) {
    const double two_pi = 6.283185307179586476925286766559;
    uint32_t w[4];
    lm_philox4x32(key, (uint64_t)j, w);
    const double u1 =
        1.0 - ((double)(w[0] >> 5) * 67108864.0 + (double)(w[1] >> 6)) * (1.0 / 9007199254740992.0);
    const double u2 =
        ((double)(w[2] >> 5) * 67108864.0 + (double)(w[3] >> 6)) * (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
}

void lm_params_init_weights(lm_params *p, uint64_t seed) {
    const lm_model_config *c = &p->cfg;
    for (int i = 0; i < p->n; i++) {
        const lm_param_info *e = &p->t[i];
        float *x = p->data + e->offset;
        lm_rng r;
        const uint64_t key = seed * 0x9E3779B97F4A7C15ULL ^ fnv1a(e->name);
        lm_rng_init(&r, key);
        switch (e->init) {
        case LM_INIT_NORMAL: {
            const double sd = c->initializer_range;
            const int64_t n = e->numel;
            /* a sharded routed tensor: rows [e0, e0 + E/P) of the whole one, i.e. its
             * stream from element ep_rank * n */
            const int64_t j0 = e->routed ? (int64_t)p->ep_rank * n : 0;
#pragma omp parallel for schedule(static) if (n >= 65536)
            for (int64_t j = 0; j < n; j++)
                x[j] = (float)(sd * normal_at(key, j0 + j));
            break;
        }
        case LM_INIT_ONES:
            for (int64_t j = 0; j < e->numel; j++)
                x[j] = 1.0f;
            break;
        case LM_INIT_ZEROS:
            memset(x, 0, (size_t)e->numel * sizeof(float));
            break;
        case LM_INIT_CONV: {
            const double b = 1.0 / sqrt((double)e->shape[1]);
            for (int64_t j = 0; j < e->numel; j++)
                x[j] = (float)(b * (2.0 * lm_rng_uniform(&r) - 1.0));
            break;
        }
        case LM_INIT_A_LOG:
            for (int64_t j = 0; j < e->numel; j++)
                x[j] = e->gate == LM_GATE_SOFTPLUS ? (float)log(1.0 + 15.0 * lm_rng_uniform(&r))
                                                   : 0.0f;
            break;
        case LM_INIT_DT_BIAS:
            for (int64_t j = 0; j < e->numel; j++) {
                const double lo = log(1e-3), hi = log(1e-1);
                double dt = exp(lo + (hi - lo) * lm_rng_uniform(&r));
                if (dt < 1e-4)
                    dt = 1e-4;
                x[j] = (float)(dt + log(-expm1(-dt)));
            }
            break;
        }
    }
}

void lm_params_count(const lm_params *p, int64_t *total, int64_t *active) {
    int64_t t = 0, a = 0;
    const int64_t E = p->cfg.moe.router.num_experts, k = p->cfg.moe.router.num_experts_per_tok;
    for (int i = 0; i < p->n; i++) {
        const lm_param_info *e = &p->t[i];
        if (e->buffer)
            continue;
        const int64_t n = e->routed && p->ep_size > 1 ? e->numel * p->ep_size : e->numel;
        t += n;
        a += e->routed ? n / E * k : n; /* n is a multiple of E */
    }
    if (total)
        *total = t;
    if (active)
        *active = a;
}

void lm_params_full_to_shard(const lm_params *full, const float *src, const lm_params *sp,
                             int ep_rank, float *dst) {
    LM_CHECK(ep_rank >= 0 && ep_rank < sp->ep_size && full->ep_size <= 1);
    for (int i = 0; i < sp->n; i++) {
        const lm_param_info *e = &sp->t[i], *f = lm_params_find(full, e->name);
        LM_CHECK(f != NULL && f->numel == (e->routed ? e->numel * sp->ep_size : e->numel));
        const int64_t o = e->routed ? (int64_t)ep_rank * e->numel : 0;
        memcpy(dst + e->offset, src + f->offset + o, (size_t)e->numel * sizeof(float));
    }
}

void lm_params_shard_to_full(const lm_params *sp, const float *src, int ep_rank, int replicated,
                             const lm_params *full, float *dst) {
    LM_CHECK(ep_rank >= 0 && ep_rank < sp->ep_size && full->ep_size <= 1);
    for (int i = 0; i < sp->n; i++) {
        const lm_param_info *e = &sp->t[i], *f = lm_params_find(full, e->name);
        LM_CHECK(f != NULL && f->numel == (e->routed ? e->numel * sp->ep_size : e->numel));
        if (!e->routed && !replicated)
            continue;
        const int64_t o = e->routed ? (int64_t)ep_rank * e->numel : 0;
        memcpy(dst + f->offset + o, src + e->offset, (size_t)e->numel * sizeof(float));
    }
}

/* ---------------------------------------------------------------- checkpoints */

static void rm_ckpt_dir(const char *dir) {
    char path[8300];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

lm_status lm_params_save(const lm_params *p, const char *dir, lm_error *err) {
    if (!dir || !*dir || strlen(dir) > 3000)
        return lm_errorf(err, LM_ERR_INVALID, "checkpoint: bad directory name");
    if (p->ep_size > 1)
        return lm_errorf(err, LM_ERR_INVALID,
                         "checkpoint %s: the parameters hold the experts of EP rank %d of %d "
                         "only; save the single-rank layout (lm_params_shard_to_full)",
                         dir, p->ep_rank, p->ep_size);
    char tmp[4096], old[4096], path[8300];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", dir, (long)getpid());
    snprintf(old, sizeof old, "%s.old.%ld", dir, (long)getpid());
    rm_ckpt_dir(tmp);
    if (mkdir(tmp, 0755) != 0)
        return lm_errorf(err, LM_ERR_IO, "checkpoint %s: cannot create %s: %s", dir, tmp,
                         strerror(errno));
    lm_st_writer w;
    lm_st_writer_init(&w);
    lm_status st = lm_st_writer_meta(&w, "format", "pt", err);
    for (int i = 0; i < p->n && st == LM_OK; i++)
        st = lm_st_writer_add(&w, p->t[i].name, LM_F32, p->t[i].ndim, p->t[i].shape,
                              p->data + p->t[i].offset, err);
    snprintf(path, sizeof path, "%s/model.safetensors", tmp);
    if (st == LM_OK)
        st = lm_st_writer_save(&w, path, err);
    lm_st_writer_free(&w);
    snprintf(path, sizeof path, "%s/config.json", tmp);
    if (st == LM_OK)
        st = lm_model_config_save(&p->cfg, path, err);
    if (st != LM_OK) {
        rm_ckpt_dir(tmp);
        return st;
    }
    struct stat sb;
    const int had_old = stat(dir, &sb) == 0;
    if (had_old && rename(dir, old) != 0) {
        rm_ckpt_dir(tmp);
        return lm_errorf(err, LM_ERR_IO, "checkpoint %s: cannot move the old checkpoint aside: %s",
                         dir, strerror(errno));
    }
    if (rename(tmp, dir) != 0) {
        int e = errno;
        if (had_old)
            rename(old, dir);
        rm_ckpt_dir(tmp);
        return lm_errorf(err, LM_ERR_IO, "checkpoint %s: cannot rename %s into place: %s", dir, tmp,
                         strerror(e));
    }
    if (had_old)
        rm_ckpt_dir(old);
    return LM_OK;
}

lm_status lm_params_load(lm_params *p, const char *dir, lm_error *err) {
    memset(p, 0, sizeof *p);
    char path[8300];
    lm_model_config cfg;
    char warn[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    LM_TRY(lm_model_config_load(&cfg, path, warn, sizeof warn, err));
    if (warn[0])
        fprintf(stderr, "warning: %s\n", warn);
    LM_TRY(lm_params_init(p, &cfg, err));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    lm_safetensors st;
    lm_status s = lm_st_read(path, &st, err);
    if (s != LM_OK) {
        lm_params_free(p);
        return s;
    }
    for (int i = 0; i < p->n && s == LM_OK; i++) {
        const lm_param_info *e = &p->t[i];
        const lm_st_entry *t = lm_st_find(&st, e->name);
        if (!t) {
            s = lm_errorf(err, LM_ERR_FORMAT, "%s: missing tensor '%s' (expected by config.json)",
                          path, e->name);
            break;
        }
        if (t->dtype != LM_F32) {
            s = lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s' has dtype %s, expected F32", path,
                          e->name, lm_dtype_name(t->dtype));
            break;
        }
        int ok = t->ndim == e->ndim;
        for (int j = 0; ok && j < e->ndim; j++)
            ok = t->shape[j] == e->shape[j];
        if (!ok) {
            char got[128] = "", want[128] = "";
            size_t n1 = 0, n2 = 0;
            for (int j = 0; j < t->ndim && n1 < sizeof got; j++)
                n1 += (size_t)snprintf(got + n1, sizeof got - n1, "%s%lld", j ? "," : "",
                                       (long long)t->shape[j]);
            for (int j = 0; j < e->ndim && n2 < sizeof want; j++)
                n2 += (size_t)snprintf(want + n2, sizeof want - n2, "%s%lld", j ? "," : "",
                                       (long long)e->shape[j]);
            s = lm_errorf(err, LM_ERR_FORMAT,
                          "%s: tensor '%s' has shape [%s], config.json implies [%s]", path, e->name,
                          got, want);
            break;
        }
        memcpy(p->data + e->offset, t->data, (size_t)e->numel * sizeof(float));
    }
    if (s == LM_OK && st.n_entries != p->n) {
        for (int i = 0; i < st.n_entries; i++)
            if (!lm_params_find(p, st.entries[i].name)) {
                s = lm_errorf(err, LM_ERR_FORMAT,
                              "%s: unexpected tensor '%s' (not in the model of config.json)", path,
                              st.entries[i].name);
                break;
            }
    }
    lm_st_free(&st);
    if (s != LM_OK)
        lm_params_free(p);
    return s;
}
