/* Model config.json: parse (cJSON), validate, write back. See model_config.h. */
#include "linmoe/model_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void lm_model_config_default(lm_model_config *c) {
    memset(c, 0, sizeof *c);
    c->short_conv_kernel_size = 4;
    c->lower_bound = -5.0f;
    c->chunk_size = 64;
    c->rope_theta = 10000.0f;
    for (int i = 0; i < LM_MAX_LAYERS; i++) {
        c->gate[i] = LM_GATE_BOUNDED;
        c->position[i] = LM_POS_ROPE;
    }
    lm_router_config_default(&c->moe.router, 1, 1);
    c->residual = LM_RES_STANDARD;
    c->attnres_block_size = 1;
    c->rms_norm_eps = 1e-6f;
    c->initializer_range = 0.02f;
}

int lm_model_layer_is_moe(const lm_model_config *c, int i) { return i >= c->first_k_dense_replace; }

int lm_model_count_kind(const lm_model_config *c, lm_layer_kind k) {
    int n = 0;
    for (int i = 0; i < c->num_hidden_layers; i++)
        n += c->kinds[i] == k;
    return n;
}

static const char *gate_name(lm_gate_mode g) {
    return g == LM_GATE_SOFTPLUS ? "softplus" : "bounded";
}
static const char *pos_name(lm_attn_position p) { return p == LM_POS_NOPE ? "nope" : "rope"; }
static const char *res_name(lm_residual_mode r) {
    return r == LM_RES_BLOCK_ATTNRES  ? "block_attnres"
           : r == LM_RES_FULL_ATTNRES ? "full_attnres"
                                      : "standard";
}
static const char *score_name(lm_score_func s) {
    return s == LM_SCORE_SOFTMAX ? "softmax" : "sigmoid";
}
static const char *bal_name(lm_balance_mode b) {
    static const char *n[] = {"none", "aux_loss", "aux_free", "quantile"};
    return (b >= 0 && b <= 3) ? n[b] : "?";
}

/* ---------------------------------------------------------------- validation */

#define INV(...) lm_errorf(err, LM_ERR_INVALID, __VA_ARGS__)

lm_status lm_model_config_validate(const lm_model_config *c, lm_error *err) {
    if (!c)
        return INV("model config: config is required");
    if (c->vocab_size < 1)
        return INV("model config: vocab_size = %d must be >= 1", c->vocab_size);
    if (c->hidden_size < 1)
        return INV("model config: hidden_size = %d must be >= 1", c->hidden_size);
    if (c->num_hidden_layers < 1 || c->num_hidden_layers > LM_MAX_LAYERS)
        return INV("model config: num_hidden_layers = %d must be in [1, %d]", c->num_hidden_layers,
                   LM_MAX_LAYERS);
    const int L = c->num_hidden_layers;
    const int nk = lm_model_count_kind(c, LM_LAYER_KDA), na = L - nk;
    if (nk > 0) {
        if (c->kda_num_heads < 1)
            return INV("model config: linear_attn_config.num_heads = %d must be >= 1",
                       c->kda_num_heads);
        if (c->kda_head_dim < 1)
            return INV("model config: linear_attn_config.head_dim = %d must be >= 1",
                       c->kda_head_dim);
        if ((int64_t)c->kda_num_heads * c->kda_head_dim > (1 << 24))
            return INV(
                "model config: linear_attn_config.num_heads * head_dim = %d * %d is too large",
                c->kda_num_heads, c->kda_head_dim);
        if (c->short_conv_kernel_size < 1 || c->short_conv_kernel_size > 64)
            return INV(
                "model config: linear_attn_config.short_conv_kernel_size = %d must be in [1, 64]",
                c->short_conv_kernel_size);
        if (c->chunk_size != 16 && c->chunk_size != 32 && c->chunk_size != 64)
            return INV("model config: linear_attn_config.chunk_size = %d must be 16, 32 or 64",
                       c->chunk_size);
        if (!(c->lower_bound >= -5.0f && c->lower_bound < 0.0f))
            return INV("model config: linear_attn_config.lower_bound = %g must be in [-5, 0)",
                       (double)c->lower_bound);
        for (int i = 0; i < L; i++)
            if (c->kinds[i] == LM_LAYER_KDA && c->gate[i] != LM_GATE_BOUNDED &&
                c->gate[i] != LM_GATE_SOFTPLUS)
                return INV("model config: linear_attn_config.gate of layer %d (1-based) = %d is "
                           "not bounded or softplus",
                           i + 1, (int)c->gate[i]);
    }
    if (na > 0) {
        if (c->num_attention_heads < 1)
            return INV("model config: num_attention_heads = %d must be >= 1",
                       c->num_attention_heads);
        if (c->num_key_value_heads < 1)
            return INV("model config: num_key_value_heads = %d must be >= 1",
                       c->num_key_value_heads);
        if (c->num_attention_heads % c->num_key_value_heads != 0)
            return INV(
                "model config: num_key_value_heads = %d does not divide num_attention_heads = %d",
                c->num_key_value_heads, c->num_attention_heads);
        if (c->head_dim < 1)
            return INV("model config: head_dim = %d must be >= 1", c->head_dim);
        if ((int64_t)c->num_attention_heads * c->head_dim > (1 << 24))
            return INV("model config: num_attention_heads * head_dim = %d * %d is too large",
                       c->num_attention_heads, c->head_dim);
        int rope = 0;
        for (int i = 0; i < L; i++)
            rope |= c->kinds[i] == LM_LAYER_ATTN && c->position[i] == LM_POS_ROPE;
        if (rope && c->head_dim % 2 != 0)
            return INV("model config: head_dim = %d must be even with position = rope",
                       c->head_dim);
        if (rope && !(c->rope_theta > 0.0f && isfinite(c->rope_theta)))
            return INV("model config: rope_theta = %g must be > 0", (double)c->rope_theta);
    }
    if (c->first_k_dense_replace < 0 || c->first_k_dense_replace > L)
        return INV(
            "model config: first_k_dense_replace = %d must be in [0, num_hidden_layers = %d]",
            c->first_k_dense_replace, L);
    if (c->first_k_dense_replace > 0 && c->intermediate_size < 1)
        return INV("model config: intermediate_size = %d must be >= 1 (first_k_dense_replace = %d "
                   "dense layers)",
                   c->intermediate_size, c->first_k_dense_replace);
    if (c->first_k_dense_replace < L) {
        if (c->moe.hidden_size != c->hidden_size)
            return INV("model config: moe hidden_size = %d disagrees with hidden_size = %d",
                       c->moe.hidden_size, c->hidden_size);
        lm_error e2 = {0};
        if (lm_moe_config_validate(&c->moe, &e2) != LM_OK)
            return INV("model config: %s", e2.msg);
    }
    if (c->residual != LM_RES_STANDARD && c->residual != LM_RES_BLOCK_ATTNRES &&
        c->residual != LM_RES_FULL_ATTNRES)
        return INV("model config: residual = %d is not standard, block_attnres or full_attnres",
                   (int)c->residual);
    if (c->attnres_block_size < 1 || c->attnres_block_size > 2 * L)
        return INV("model config: attnres_block_size = %d must be in [1, 2 * num_hidden_layers = "
                   "%d] (sublayers)",
                   c->attnres_block_size, 2 * L);
    if (c->residual == LM_RES_FULL_ATTNRES && c->attnres_block_size != 1)
        return INV("model config: attnres_block_size = %d must be 1 with residual = full_attnres",
                   c->attnres_block_size);
    if (!(c->rms_norm_eps > 0.0f && isfinite(c->rms_norm_eps)))
        return INV("model config: rms_norm_eps = %g must be > 0", (double)c->rms_norm_eps);
    if (!(c->initializer_range > 0.0f && isfinite(c->initializer_range)))
        return INV("model config: initializer_range = %g must be > 0",
                   (double)c->initializer_range);
    if (c->seq_len < 0)
        return INV("model config: seq_len = %d must be >= 0", c->seq_len);
    if (c->batch_size < 0)
        return INV("model config: batch_size = %d must be >= 0", c->batch_size);
    return LM_OK;
}

/* ---------------------------------------------------------------- parsing */

typedef struct {
    const char *label;
    lm_error *err;
    int missing; /* the error is a missing required key */
} pctx;

static lm_status missing_key(pctx *p, const char *prefix, const char *key) {
    p->missing = 1;
    return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key '%s%s'", p->label, prefix,
                     key);
}

static lm_status get_num(pctx *p, const cJSON *o, const char *prefix, const char *key, int required,
                         double *out, int *found) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    *found = 0;
    if (!it || cJSON_IsNull(it)) {
        if (required)
            return missing_key(p, prefix, key);
        return LM_OK;
    }
    if (cJSON_IsBool(it)) {
        *out = cJSON_IsTrue(it) ? 1.0 : 0.0;
    } else if (cJSON_IsNumber(it)) {
        *out = it->valuedouble;
    } else {
        char *s = cJSON_PrintUnformatted(it);
        lm_status st = lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s%s' = %s is not a number",
                                 p->label, prefix, key, s ? s : "?");
        free(s);
        return st;
    }
    *found = 1;
    return LM_OK;
}

static lm_status get_int(pctx *p, const cJSON *o, const char *prefix, const char *key, int required,
                         int *out) {
    double v = 0;
    int f;
    LM_TRY(get_num(p, o, prefix, key, required, &v, &f));
    if (!f)
        return LM_OK;
    if (v != floor(v) || v < -2147483647.0 || v > 2147483647.0)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s%s' = %.17g is not an integer",
                         p->label, prefix, key, v);
    *out = (int)v;
    return LM_OK;
}

static lm_status get_float(pctx *p, const cJSON *o, const char *prefix, const char *key,
                           float *out) {
    double v = 0;
    int f;
    LM_TRY(get_num(p, o, prefix, key, 0, &v, &f));
    if (!f)
        return LM_OK;
    if (!isfinite(v))
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s%s' = %g is not finite", p->label,
                         prefix, key, v);
    *out = (float)v;
    return LM_OK;
}

static lm_status get_bool(pctx *p, const cJSON *o, const char *key, int *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!it || cJSON_IsNull(it))
        return LM_OK;
    if (cJSON_IsBool(it))
        *out = cJSON_IsTrue(it);
    else if (cJSON_IsNumber(it) && (it->valuedouble == 0 || it->valuedouble == 1))
        *out = (int)it->valuedouble;
    else
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s' is not a boolean", p->label, key);
    return LM_OK;
}

/* A string key mapped by `from_name` (-1 = unknown). */
static lm_status get_enum(pctx *p, const cJSON *o, const char *key, int (*from_name)(const char *),
                          const char *allowed, int *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!it || cJSON_IsNull(it))
        return LM_OK;
    if (!cJSON_IsString(it))
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s' must be a string (%s)", p->label,
                         key, allowed);
    int v = from_name(it->valuestring);
    if (v < 0)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s' = \"%s\" is not one of %s", p->label,
                         key, it->valuestring, allowed);
    *out = v;
    return LM_OK;
}

static int gate_from(const char *s) {
    return strcmp(s, "bounded") == 0    ? LM_GATE_BOUNDED
           : strcmp(s, "softplus") == 0 ? LM_GATE_SOFTPLUS
                                        : -1;
}
static int pos_from(const char *s) {
    return strcmp(s, "rope") == 0 ? LM_POS_ROPE : strcmp(s, "nope") == 0 ? LM_POS_NOPE : -1;
}
static int res_from(const char *s) {
    return strcmp(s, "standard") == 0        ? LM_RES_STANDARD
           : strcmp(s, "block_attnres") == 0 ? LM_RES_BLOCK_ATTNRES
           : strcmp(s, "full_attnres") == 0  ? LM_RES_FULL_ATTNRES
                                             : -1;
}

/* "gate" / "position": a name, or a list with one name per layer of `kind`
 * (in layer order). Fills out[i] for the layers of that kind. */
static lm_status get_per_layer(pctx *p, const cJSON *o, const char *prefix, const char *key,
                               int (*from)(const char *), const char *allowed,
                               const lm_model_config *c, lm_layer_kind kind, int *out,
                               int *per_layer) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!it || cJSON_IsNull(it))
        return LM_OK;
    const int n = lm_model_count_kind(c, kind);
    const char *kn = kind == LM_LAYER_KDA ? "KDA" : "full attention";
    if (cJSON_IsString(it)) {
        int v = from(it->valuestring);
        if (v < 0)
            return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s%s' = \"%s\" is not one of %s",
                             p->label, prefix, key, it->valuestring, allowed);
        for (int i = 0; i < c->num_hidden_layers; i++)
            if (c->kinds[i] == kind)
                out[i] = v;
        *per_layer = 0;
        return LM_OK;
    }
    if (!cJSON_IsArray(it))
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: key '%s%s' must be a string (%s) or a list of them", p->label, prefix,
                         key, allowed);
    if (cJSON_GetArraySize(it) != n)
        return lm_errorf(
            p->err, LM_ERR_INVALID,
            "%s: key '%s%s' has %d entries but there are %d %s layers (one entry per %s layer)",
            p->label, prefix, key, cJSON_GetArraySize(it), n, kn, kn);
    int j = 0;
    const cJSON *e = it->child;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        if (c->kinds[i] != kind)
            continue;
        int v = cJSON_IsString(e) ? from(e->valuestring) : -1;
        if (v < 0) {
            char *s = cJSON_PrintUnformatted(e);
            lm_status st = lm_errorf(p->err, LM_ERR_INVALID,
                                     "%s: key '%s%s'[%d] (layer %d) = %s is not one of %s",
                                     p->label, prefix, key, j, i + 1, s ? s : "?", allowed);
            free(s);
            return st;
        }
        out[i] = v;
        j++;
        e = e->next;
    }
    *per_layer = 1;
    return LM_OK;
}

static lm_status get_layer_list(pctx *p, const cJSON *la, const char *key, int L, int *mark,
                                int required) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(la, key);
    if (!it) {
        if (required)
            return missing_key(p, "linear_attn_config.", key);
        return LM_OK;
    }
    if (!cJSON_IsArray(it))
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: key 'linear_attn_config.%s' must be a list of 1-based layer indices",
                         p->label, key);
    const cJSON *e;
    cJSON_ArrayForEach(e, it) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 1 ||
            e->valuedouble > L) {
            char *s = cJSON_PrintUnformatted(e);
            lm_status st = lm_errorf(
                p->err, LM_ERR_INVALID,
                "%s: key 'linear_attn_config.%s' entry %s is not a layer index in [1, %d]",
                p->label, key, s ? s : "?", L);
            free(s);
            return st;
        }
        int li = (int)e->valuedouble - 1;
        if (mark[li] & 4)
            return lm_errorf(p->err, LM_ERR_INVALID,
                             "%s: key 'linear_attn_config.%s' lists layer %d twice", p->label, key,
                             li + 1);
        mark[li] |= 4;
    }
    return LM_OK;
}

static const char *k_top_keys[] = {"vocab_size",
                                   "hidden_size",
                                   "num_hidden_layers",
                                   "linear_attn_config",
                                   "num_attention_heads",
                                   "num_key_value_heads",
                                   "head_dim",
                                   "position",
                                   "rope_theta",
                                   "num_experts",
                                   "n_routed_experts",
                                   "num_experts_per_tok",
                                   "n_shared_experts",
                                   "moe_intermediate_size",
                                   "scoring_func",
                                   "norm_topk_prob",
                                   "routed_scaling_factor",
                                   "n_group",
                                   "topk_group",
                                   "balance",
                                   "bias_update_rate",
                                   "bias_clamp",
                                   "bias_rule",
                                   "bias_center",
                                   "aux_loss_seq",
                                   "quantile_iters",
                                   "quantile_ema",
                                   "capacity_factor",
                                   "drop_policy",
                                   "aux_loss_alpha",
                                   "first_k_dense_replace",
                                   "intermediate_size",
                                   "residual",
                                   "attnres_block_size",
                                   "rms_norm_eps",
                                   "tie_word_embeddings",
                                   "initializer_range",
                                   "seed",
                                   "seq_len",
                                   "batch_size",
                                   "model_type",
                                   "architectures",
                                   "torch_dtype",
                                   NULL};
static const char *k_la_keys[] = {
    "kda_layers", "full_attn_layers", "num_heads",  "head_dim", "short_conv_kernel_size",
    "gate",       "lower_bound",      "chunk_size", NULL};

static int in_list(const char *s, const char **l) {
    for (; *l; l++)
        if (strcmp(s, *l) == 0)
            return 1;
    return 0;
}

/* The keys of root (and of linear_attn_config) that are not known, comma-separated. */
static void unknown_key_list(const cJSON *root, const cJSON *la, char *buf, size_t size) {
    size_t n = 0;
    buf[0] = '\0';
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (!in_list(e->string, k_top_keys) && n < size)
            n += (size_t)snprintf(buf + n, size - n, "%s%s", n ? ", " : "", e->string);
    }
    if (cJSON_IsObject(la))
        cJSON_ArrayForEach(e, la) {
            if (!in_list(e->string, k_la_keys) && n < size)
                n += (size_t)snprintf(buf + n, size - n, "%slinear_attn_config.%s", n ? ", " : "",
                                      e->string);
        }
}

static void unknown_keys(const cJSON *root, const cJSON *la, const char *label, char *warn,
                         size_t warn_size) {
    char buf[1024];
    unknown_key_list(root, la, buf, sizeof buf);
    if (warn && warn_size)
        warn[0] = '\0';
    if (!buf[0])
        return;
    if (warn && warn_size)
        snprintf(warn, warn_size, "%s: unknown keys ignored: %s", label, buf);
    else
        fprintf(stderr, "%s: warning: unknown keys ignored: %s\n", label, buf);
}

static lm_status parse(lm_model_config *c, const cJSON *root, pctx *p, char *warn,
                       size_t warn_size) {
    if (!cJSON_IsObject(root))
        return lm_errorf(p->err, LM_ERR_FORMAT, "%s: config is not a JSON object", p->label);
    lm_model_config_default(c);
    LM_TRY(get_int(p, root, "", "vocab_size", 1, &c->vocab_size));
    LM_TRY(get_int(p, root, "", "hidden_size", 1, &c->hidden_size));
    LM_TRY(get_int(p, root, "", "num_hidden_layers", 1, &c->num_hidden_layers));
    const int L = c->num_hidden_layers;
    if (L < 1 || L > LM_MAX_LAYERS)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: num_hidden_layers = %d must be in [1, %d]",
                         p->label, L, LM_MAX_LAYERS);
    const cJSON *la = cJSON_GetObjectItemCaseSensitive(root, "linear_attn_config");
    if (!la)
        return missing_key(p, "", "linear_attn_config");
    if (!cJSON_IsObject(la))
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: key 'linear_attn_config' must be an object",
                         p->label);
    int mk[LM_MAX_LAYERS] = {0}, ma[LM_MAX_LAYERS] = {0};
    LM_TRY(get_layer_list(p, la, "kda_layers", L, mk, 1));
    LM_TRY(get_layer_list(p, la, "full_attn_layers", L, ma, 0));
    const int have_full = cJSON_GetObjectItemCaseSensitive(la, "full_attn_layers") != NULL;
    for (int i = 0; i < L; i++) {
        if (mk[i] && ma[i])
            return lm_errorf(
                p->err, LM_ERR_INVALID,
                "%s: layer %d is in both linear_attn_config.kda_layers and full_attn_layers",
                p->label, i + 1);
        if (!mk[i] && !ma[i] && have_full)
            return lm_errorf(
                p->err, LM_ERR_INVALID,
                "%s: layer %d is in neither linear_attn_config.kda_layers nor full_attn_layers",
                p->label, i + 1);
        c->kinds[i] = mk[i] ? LM_LAYER_KDA : LM_LAYER_ATTN; /* no full_attn_layers: the rest */
    }
    const char *P = "linear_attn_config.";
    LM_TRY(get_int(p, la, P, "num_heads", 0, &c->kda_num_heads));
    LM_TRY(get_int(p, la, P, "head_dim", 0, &c->kda_head_dim));
    LM_TRY(get_int(p, la, P, "short_conv_kernel_size", 0, &c->short_conv_kernel_size));
    LM_TRY(get_float(p, la, P, "lower_bound", &c->lower_bound));
    LM_TRY(get_int(p, la, P, "chunk_size", 0, &c->chunk_size));
    int tmp[LM_MAX_LAYERS];
    for (int i = 0; i < L; i++)
        tmp[i] = (int)c->gate[i];
    LM_TRY(get_per_layer(p, la, P, "gate", gate_from, "bounded|softplus", c, LM_LAYER_KDA, tmp,
                         &c->gate_per_layer));
    for (int i = 0; i < L; i++)
        c->gate[i] = (lm_gate_mode)tmp[i];

    LM_TRY(get_int(p, root, "", "num_attention_heads", 0, &c->num_attention_heads));
    c->num_key_value_heads = c->num_attention_heads;
    LM_TRY(get_int(p, root, "", "num_key_value_heads", 0, &c->num_key_value_heads));
    if (c->num_attention_heads > 0)
        c->head_dim = c->hidden_size / c->num_attention_heads;
    LM_TRY(get_int(p, root, "", "head_dim", 0, &c->head_dim));
    for (int i = 0; i < L; i++)
        tmp[i] = (int)c->position[i];
    LM_TRY(get_per_layer(p, root, "", "position", pos_from, "rope|nope", c, LM_LAYER_ATTN, tmp,
                         &c->position_per_layer));
    for (int i = 0; i < L; i++)
        c->position[i] = (lm_attn_position)tmp[i];
    LM_TRY(get_float(p, root, "", "rope_theta", &c->rope_theta));

    LM_TRY(get_int(p, root, "", "first_k_dense_replace", 0, &c->first_k_dense_replace));
    LM_TRY(get_int(p, root, "", "intermediate_size", 0, &c->intermediate_size));
    const int any_moe = c->first_k_dense_replace < L;
    int E = 0, k = 0;
    if (cJSON_GetObjectItemCaseSensitive(root, "num_experts"))
        LM_TRY(get_int(p, root, "", "num_experts", 0, &E));
    else
        LM_TRY(get_int(p, root, "",
                       cJSON_GetObjectItemCaseSensitive(root, "n_routed_experts") || !any_moe
                           ? "n_routed_experts"
                           : "num_experts",
                       any_moe, &E));
    LM_TRY(get_int(p, root, "", "num_experts_per_tok", any_moe, &k));
    lm_moe_config_default(&c->moe, c->hidden_size, 1, E > 0 ? E : 1, k > 0 ? k : 1, 0);
    c->moe.router.num_experts = E > 0 || any_moe ? E : 1;
    c->moe.router.num_experts_per_tok = k > 0 || any_moe ? k : 1;
    LM_TRY(get_int(p, root, "", "moe_intermediate_size", any_moe, &c->moe.moe_intermediate_size));
    LM_TRY(get_int(p, root, "", "n_shared_experts", 0, &c->moe.n_shared_experts));
    lm_router_config *r = &c->moe.router;
    int v;
    v = (int)r->scoring_func;
    LM_TRY(get_enum(p, root, "scoring_func", lm_score_func_from_name, "sigmoid|softmax", &v));
    r->scoring_func = (lm_score_func)v;
    LM_TRY(get_bool(p, root, "norm_topk_prob", &r->norm_topk_prob));
    LM_TRY(get_float(p, root, "", "routed_scaling_factor", &r->routed_scaling_factor));
    LM_TRY(get_int(p, root, "", "n_group", 0, &r->n_group));
    LM_TRY(get_int(p, root, "", "topk_group", 0, &r->topk_group));
    v = (int)r->balance;
    LM_TRY(
        get_enum(p, root, "balance", lm_balance_from_name, "none|aux_loss|aux_free|quantile", &v));
    r->balance = (lm_balance_mode)v;
    v = (int)r->bias_rule;
    LM_TRY(get_enum(p, root, "bias_rule", lm_bias_rule_from_name, "sign|linear", &v));
    r->bias_rule = (lm_bias_rule)v;
    LM_TRY(get_float(p, root, "", "bias_update_rate", &r->bias_update_rate));
    LM_TRY(get_float(p, root, "", "bias_clamp", &r->bias_clamp));
    LM_TRY(get_bool(p, root, "bias_center", &r->bias_center));
    LM_TRY(get_float(p, root, "", "aux_loss_alpha", &r->aux_loss_alpha));
    LM_TRY(get_bool(p, root, "aux_loss_seq", &r->aux_loss_seq));
    LM_TRY(get_int(p, root, "", "quantile_iters", 0, &r->quantile_iters));
    LM_TRY(get_float(p, root, "", "quantile_ema", &r->quantile_ema));
    LM_TRY(get_float(p, root, "", "capacity_factor", &r->capacity_factor));
    v = (int)r->drop_policy;
    LM_TRY(get_enum(p, root, "drop_policy", lm_drop_policy_from_name, "probs|position", &v));
    r->drop_policy = (lm_drop_policy)v;

    v = (int)c->residual;
    LM_TRY(get_enum(p, root, "residual", res_from, "standard|block_attnres|full_attnres", &v));
    c->residual = (lm_residual_mode)v;
    LM_TRY(get_int(p, root, "", "attnres_block_size", 0, &c->attnres_block_size));
    LM_TRY(get_float(p, root, "", "rms_norm_eps", &c->rms_norm_eps));
    LM_TRY(get_bool(p, root, "tie_word_embeddings", &c->tie_word_embeddings));
    LM_TRY(get_float(p, root, "", "initializer_range", &c->initializer_range));
    double sd = 0;
    int f;
    LM_TRY(get_num(p, root, "", "seed", 0, &sd, &f));
    if (f) {
        if (sd < 0 || sd != floor(sd) || sd > 9007199254740992.0)
            return lm_errorf(p->err, LM_ERR_INVALID,
                             "%s: key 'seed' = %.17g is not a non-negative integer", p->label, sd);
        c->seed = (uint64_t)sd;
    }
    LM_TRY(get_int(p, root, "", "seq_len", 0, &c->seq_len));
    LM_TRY(get_int(p, root, "", "batch_size", 0, &c->batch_size));

    unknown_keys(root, la, p->label, warn, warn_size);
    lm_error e2 = {0};
    if (lm_model_config_validate(c, &e2) != LM_OK)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: %s", p->label, e2.msg);
    return LM_OK;
}

lm_status lm_model_config_from_string(lm_model_config *c, const char *json, const char *label,
                                      char *warn, size_t warn_size, lm_error *err) {
    if (!label)
        label = "config";
    if (warn && warn_size)
        warn[0] = '\0';
    if (!json)
        return lm_errorf(err, LM_ERR_INVALID, "%s: no JSON text", label);
    cJSON *root = cJSON_Parse(json);
    if (!root) {
        const char *ep = cJSON_GetErrorPtr();
        return lm_errorf(err, LM_ERR_FORMAT, "%s: JSON does not parse near '%.20s'", label,
                         ep ? ep : "?");
    }
    lm_error local = {0};
    pctx p = {label, err ? err : &local, 0};
    lm_status st = parse(c, root, &p, warn, warn_size);
    if (st != LM_OK && p.missing) {
        /* a missing key is often a misspelt one: name the keys the file has that are not
         * known (hiden_size next to the missing hidden_size) */
        char unk[1024];
        const cJSON *la = cJSON_GetObjectItemCaseSensitive(root, "linear_attn_config");
        unknown_key_list(root, la, unk, sizeof unk);
        if (unk[0]) {
            char msg[sizeof p.err->msg];
            snprintf(msg, sizeof msg, "%s", p.err->msg);
            lm_errorf(p.err, st, "%s (the file has unknown keys: %s)", msg, unk);
        }
    }
    cJSON_Delete(root);
    return st;
}

lm_status lm_model_config_load(lm_model_config *c, const char *path, char *warn, size_t warn_size,
                               lm_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return lm_errorf(err, LM_ERR_IO, "%s: cannot seek", path);
    }
    long n = ftell(f);
    if (n < 0 || n > (64L << 20)) {
        fclose(f);
        return lm_errorf(err, LM_ERR_FORMAT, "%s: size %ld is not that of a config (max 64 MiB)",
                         path, n);
    }
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        return lm_errorf(err, LM_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) {
        free(buf);
        return lm_errorf(err, LM_ERR_IO, "%s: short read", path);
    }
    buf[n] = '\0';
    lm_status st = lm_model_config_from_string(c, buf, path, warn, warn_size, err);
    free(buf);
    return st;
}

/* ---------------------------------------------------------------- writing */

static void add_per_layer(cJSON *o, const char *key, const lm_model_config *c, lm_layer_kind kind,
                          const int *vals, int per_layer, const char *(*name)(int)) {
    int first = -1, uniform = 1;
    for (int i = 0; i < c->num_hidden_layers; i++)
        if (c->kinds[i] == kind) {
            if (first < 0)
                first = vals[i];
            else if (vals[i] != first)
                uniform = 0;
        }
    if (!per_layer && uniform) {
        cJSON_AddStringToObject(o, key, name(first < 0 ? 0 : first));
        return;
    }
    cJSON *a = cJSON_AddArrayToObject(o, key);
    for (int i = 0; i < c->num_hidden_layers; i++)
        if (c->kinds[i] == kind)
            cJSON_AddItemToArray(a, cJSON_CreateString(name(vals[i])));
}
static const char *gate_name_i(int g) { return gate_name((lm_gate_mode)g); }
static const char *pos_name_i(int p) { return pos_name((lm_attn_position)p); }

char *lm_model_config_to_json(const lm_model_config *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    const int L = c->num_hidden_layers;
    int tmp[LM_MAX_LAYERS];
    cJSON_AddStringToObject(o, "model_type", "linmoe");
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", c->hidden_size);
    cJSON_AddNumberToObject(o, "num_hidden_layers", L);
    cJSON *la = cJSON_AddObjectToObject(o, "linear_attn_config");
    cJSON *kl = cJSON_AddArrayToObject(la, "kda_layers"),
          *fl = cJSON_AddArrayToObject(la, "full_attn_layers");
    for (int i = 0; i < L; i++)
        cJSON_AddItemToArray(c->kinds[i] == LM_LAYER_KDA ? kl : fl, cJSON_CreateNumber(i + 1));
    cJSON_AddNumberToObject(la, "num_heads", c->kda_num_heads);
    cJSON_AddNumberToObject(la, "head_dim", c->kda_head_dim);
    cJSON_AddNumberToObject(la, "short_conv_kernel_size", c->short_conv_kernel_size);
    for (int i = 0; i < L; i++)
        tmp[i] = (int)c->gate[i];
    add_per_layer(la, "gate", c, LM_LAYER_KDA, tmp, c->gate_per_layer, gate_name_i);
    cJSON_AddNumberToObject(la, "lower_bound", c->lower_bound);
    cJSON_AddNumberToObject(la, "chunk_size", c->chunk_size);
    cJSON_AddNumberToObject(o, "num_attention_heads", c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "head_dim", c->head_dim);
    for (int i = 0; i < L; i++)
        tmp[i] = (int)c->position[i];
    add_per_layer(o, "position", c, LM_LAYER_ATTN, tmp, c->position_per_layer, pos_name_i);
    cJSON_AddNumberToObject(o, "rope_theta", c->rope_theta);
    const lm_router_config *r = &c->moe.router;
    cJSON_AddNumberToObject(o, "num_experts", r->num_experts);
    cJSON_AddNumberToObject(o, "num_experts_per_tok", r->num_experts_per_tok);
    cJSON_AddNumberToObject(o, "n_shared_experts", c->moe.n_shared_experts);
    cJSON_AddNumberToObject(o, "moe_intermediate_size", c->moe.moe_intermediate_size);
    cJSON_AddStringToObject(o, "scoring_func", score_name(r->scoring_func));
    cJSON_AddBoolToObject(o, "norm_topk_prob", r->norm_topk_prob);
    cJSON_AddNumberToObject(o, "routed_scaling_factor", r->routed_scaling_factor);
    cJSON_AddNumberToObject(o, "n_group", r->n_group);
    cJSON_AddNumberToObject(o, "topk_group", r->topk_group);
    cJSON_AddStringToObject(o, "balance", bal_name(r->balance));
    cJSON_AddStringToObject(o, "bias_rule", r->bias_rule == LM_BIAS_LINEAR ? "linear" : "sign");
    cJSON_AddNumberToObject(o, "bias_update_rate", r->bias_update_rate);
    cJSON_AddNumberToObject(o, "bias_clamp", r->bias_clamp);
    cJSON_AddBoolToObject(o, "bias_center", r->bias_center);
    cJSON_AddNumberToObject(o, "aux_loss_alpha", r->aux_loss_alpha);
    cJSON_AddBoolToObject(o, "aux_loss_seq", r->aux_loss_seq);
    cJSON_AddNumberToObject(o, "quantile_iters", r->quantile_iters);
    cJSON_AddNumberToObject(o, "quantile_ema", r->quantile_ema);
    cJSON_AddNumberToObject(o, "capacity_factor", r->capacity_factor);
    cJSON_AddStringToObject(o, "drop_policy",
                            r->drop_policy == LM_DROP_POSITION ? "position" : "probs");
    cJSON_AddNumberToObject(o, "first_k_dense_replace", c->first_k_dense_replace);
    cJSON_AddNumberToObject(o, "intermediate_size", c->intermediate_size);
    cJSON_AddStringToObject(o, "residual", res_name(c->residual));
    cJSON_AddNumberToObject(o, "attnres_block_size", c->attnres_block_size);
    cJSON_AddNumberToObject(o, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddNumberToObject(o, "initializer_range", c->initializer_range);
    cJSON_AddNumberToObject(o, "seed", (double)c->seed);
    if (c->seq_len)
        cJSON_AddNumberToObject(o, "seq_len", c->seq_len);
    if (c->batch_size)
        cJSON_AddNumberToObject(o, "batch_size", c->batch_size);
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}

lm_status lm_model_config_save(const lm_model_config *c, const char *path, lm_error *err) {
    char *s = lm_model_config_to_json(c);
    if (!s)
        return lm_errorf(err, LM_ERR_NOMEM, "%s: out of memory writing the config", path);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        free(s);
        return lm_errorf(err, LM_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    }
    size_t n = strlen(s), off = 0;
    int ok = 1;
    while (off < n) {
        ssize_t w = write(fd, s + off, n - off);
        if (w <= 0) {
            ok = 0;
            break;
        }
        off += (size_t)w;
    }
    if (ok && write(fd, "\n", 1) != 1)
        ok = 0;
    if (ok && fsync(fd) != 0)
        ok = 0;
    if (close(fd) != 0)
        ok = 0;
    free(s);
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return lm_errorf(err, LM_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    }
    return LM_OK;
}

void lm_model_config_print(const lm_model_config *c, FILE *f) {
    const int L = c->num_hidden_layers;
    fprintf(f, "vocab_size %d  hidden_size %d  layers %d  (KDA %d, full attention %d)\n",
            c->vocab_size, c->hidden_size, L, lm_model_count_kind(c, LM_LAYER_KDA),
            lm_model_count_kind(c, LM_LAYER_ATTN));
    fprintf(f, "KDA: %d heads x %d, short conv %d, lower_bound %g, chunk %d\n", c->kda_num_heads,
            c->kda_head_dim, c->short_conv_kernel_size, (double)c->lower_bound, c->chunk_size);
    fprintf(f, "attention: %d query / %d KV heads x %d, rope_theta %g\n", c->num_attention_heads,
            c->num_key_value_heads, c->head_dim, (double)c->rope_theta);
    const lm_router_config *r = &c->moe.router;
    fprintf(f,
            "MoE: %d experts, top-%d, %d shared, width %d, %s scores, balance %s; dense layers %d "
            "(width %d)\n",
            r->num_experts, r->num_experts_per_tok, c->moe.n_shared_experts,
            c->moe.moe_intermediate_size, score_name(r->scoring_func), bal_name(r->balance),
            c->first_k_dense_replace, c->intermediate_size);
    fprintf(f,
            "residual %s (block %d sublayers), rms_norm_eps %g, tie_word_embeddings %s, init std "
            "%g, seed %llu\n",
            res_name(c->residual), c->attnres_block_size, (double)c->rms_norm_eps,
            c->tie_word_embeddings ? "true" : "false", (double)c->initializer_range,
            (unsigned long long)c->seed);
    fprintf(f, "layers (numbered from 1, as in linear_attn_config):");
    for (int i = 0; i < L; i++)
        fprintf(f, " %d:%s%s/%s", i + 1, c->kinds[i] == LM_LAYER_KDA ? "kda-" : "attn-",
                c->kinds[i] == LM_LAYER_KDA ? gate_name(c->gate[i]) : pos_name(c->position[i]),
                lm_model_layer_is_moe(c, i) ? "moe" : "dense");
    fprintf(f, "\n");
}
