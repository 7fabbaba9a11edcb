/* Export of a dense linmoe checkpoint to fla's KDAForCausalLM format (export.h). */
#include "linmoe/export.h"

#include "linmoe/layers.h"
#include "linmoe/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* fla's max_position_embeddings when the config has no seq_len (KDAConfig default) */
#define FLA_DEFAULT_MAX_POS 2048
/* chunk_kda: "Currently we only support key headdim <=256 for KDA" */
#define FLA_KDA_MAX_HEAD_DIM 256
#define PATH_CAP 4352

void lm_export_fla_options_default(lm_export_fla_options *o) {
    memset(o, 0, sizeof *o);
    o->dtype = LM_F32;
}

static const char *residual_name(lm_residual_mode r) {
    return r == LM_RES_BLOCK_ATTNRES  ? "block_attnres"
           : r == LM_RES_FULL_ATTNRES ? "full_attnres"
                                      : "standard";
}

static const char *gate_name(lm_gate_mode g) {
    return g == LM_GATE_SOFTPLUS ? "softplus" : g == LM_GATE_BOUNDED ? "bounded" : "none";
}

#define UNSUP(...) lm_errorf(err, LM_ERR_UNSUPPORTED, "export --format fla: " __VA_ARGS__)

lm_status lm_export_fla_check(const lm_model_config *c, const lm_export_fla_options *o,
                              lm_error *err) {
    lm_export_fla_options def;
    if (!o) {
        lm_export_fla_options_default(&def);
        o = &def;
    }
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: NULL config");
    LM_TRY(lm_model_config_validate(c, err));
    const int L = c->num_hidden_layers;
    if (c->first_k_dense_replace < L)
        return UNSUP("first_k_dense_replace = %d < num_hidden_layers = %d: layers %d..%d "
                     "have MoE FFNs (num_experts = %d), and fla's KDAForCausalLM has a "
                     "dense GatedMLP in every layer (only dense configs, first_k_dense_replace = "
                     "num_hidden_layers, can be exported)",
                     c->first_k_dense_replace, L, c->first_k_dense_replace + 1, L,
                     c->moe.router.num_experts);
    if (c->residual != LM_RES_STANDARD)
        return UNSUP("residual = \"%s\" (attnres_block_size = %d): only the standard pre-norm "
                     "residual is exported (fla's attnres_block_size path cannot be checked: its "
                     "fused AttnRes kernel does not compile on the GPU machine)",
                     residual_name(c->residual), c->attnres_block_size);
    int first_kda = -1, first_attn = -1;
    for (int i = 0; i < L; i++) {
        if (c->kinds[i] == LM_LAYER_KDA) {
            if (first_kda < 0)
                first_kda = i;
            else if (c->gate[i] != c->gate[first_kda])
                return UNSUP(
                    "linear_attn_config.gate: layer %d is \"%s\" but layer %d is "
                    "\"%s\": fla's KDAConfig has one gate (safe_gate / lower_bound) for "
                    "every KDA layer",
                    first_kda + 1, gate_name(c->gate[first_kda]), i + 1, gate_name(c->gate[i]));
        } else if (c->kinds[i] == LM_LAYER_ATTN) {
            if (first_attn < 0)
                first_attn = i;
            if (c->position[i] != LM_POS_ROPE)
                return UNSUP("position of attention layer %d is \"nope\": fla's "
                             "Attention applies RoPE in every attention layer",
                             i + 1);
        }
    }
    if (first_kda >= 0) {
        if (c->kda_head_dim > FLA_KDA_MAX_HEAD_DIM)
            return UNSUP("linear_attn_config.head_dim = %d: fla's chunk_kda supports a key head "
                         "dim of at most %d",
                         c->kda_head_dim, FLA_KDA_MAX_HEAD_DIM);
        if (c->rms_norm_eps != LM_GATED_RMSNORM_EPS && !o->allow_eps_mismatch)
            return UNSUP("rms_norm_eps = %g: fla's KDAForCausalLM uses its one norm_eps also for "
                         "the KDA layers' output norm (o_norm), where linmoe uses %g, so only "
                         "rms_norm_eps = %g maps exactly (allow the mismatch, e.g. `linmoe export "
                         "--allow-eps-mismatch`, to export with norm_eps = %g)",
                         (double)c->rms_norm_eps, (double)LM_GATED_RMSNORM_EPS,
                         (double)LM_GATED_RMSNORM_EPS, (double)c->rms_norm_eps);
    }
    if (first_attn >= 0 && (int64_t)c->num_attention_heads * c->head_dim != c->hidden_size)
        return UNSUP("num_attention_heads * head_dim = %d * %d = %lld != hidden_size = %d: fla's "
                     "Attention derives its head dim as hidden_size / num_heads (q_proj and o_proj "
                     "are [hidden_size, hidden_size])",
                     c->num_attention_heads, c->head_dim,
                     (long long)c->num_attention_heads * c->head_dim, c->hidden_size);
    if (o->dtype != LM_F32 && o->dtype != LM_BF16)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: dtype %s (want F32 or BF16)",
                         lm_dtype_name(o->dtype));
    return LM_OK;
}

/* ---------------------------------------------------------------- config.json */

/* A float as the double of its shortest decimal form that rounds back to it
 * (1e-5f -> 1e-05, not 9.99999975e-06), so config.json reads like the linmoe one. */
static double f2d(float x) {
    char b[32];
    for (int prec = 1; prec <= 9; prec++) { /* 9 digits always round-trip a float */
        snprintf(b, sizeof b, "%.*g", prec, (double)x);
        const double d = strtod(b, NULL);
        if ((float)d == x)
            return d;
    }
    return (double)x;
}

lm_status lm_export_fla_config_json(const lm_model_config *c, const lm_export_fla_options *o,
                                    char **json, lm_error *err) {
    lm_export_fla_options def;
    if (!o) {
        lm_export_fla_options_default(&def);
        o = &def;
    }
    if (!json)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: NULL output");
    *json = NULL;
    LM_TRY(lm_export_fla_check(c, o, err));
    const int L = c->num_hidden_layers;
    lm_gate_mode gate = LM_GATE_SOFTPLUS;
    int n_attn = 0;
    for (int i = 0; i < L; i++)
        if (c->kinds[i] == LM_LAYER_KDA)
            gate = c->gate[i]; /* uniform (checked) */
        else
            n_attn++;
    /* the tokenizer `linmoe eval` picks by default: byte for vocab 257, else GPT-2 */
    const int eot = c->vocab_size == 257 ? 256 : c->vocab_size >= 50257 ? 50256 : -1;

    cJSON *j = cJSON_CreateObject();
    int ok = j != NULL;
    cJSON *arch = ok ? cJSON_AddArrayToObject(j, "architectures") : NULL;
    ok = ok && arch && cJSON_AddItemToArray(arch, cJSON_CreateString("KDAForCausalLM"));
#define NUM(k, v) (ok = ok && cJSON_AddNumberToObject(j, k, (double)(v)) != NULL)
#define STR(k, v) (ok = ok && cJSON_AddStringToObject(j, k, v) != NULL)
#define BOOL(k, v) (ok = ok && cJSON_AddBoolToObject(j, k, (v) ? 1 : 0) != NULL)
#define NUL(k) (ok = ok && cJSON_AddNullToObject(j, k) != NULL)
    STR("model_type", "kda");
    STR("attn_mode", "chunk");
    NUM("hidden_size", c->hidden_size);
    NUM("num_hidden_layers", L);
    NUM("vocab_size", c->vocab_size);
    NUM("num_heads", c->kda_num_heads);
    NUM("head_dim", c->kda_head_dim);
    NUL("num_v_heads");
    NUM("expand_v", 1.0);
    BOOL("use_short_conv", 1);
    NUM("conv_size", c->short_conv_kernel_size);
    BOOL("allow_neg_eigval", 0);
    BOOL("safe_gate", gate == LM_GATE_BOUNDED);
    if (gate == LM_GATE_BOUNDED)
        NUM("lower_bound", f2d(c->lower_bound));
    else
        NUL("lower_bound");
    NUM("intermediate_size", c->intermediate_size);
    NUM("hidden_ratio", 4);
    STR("hidden_act", "swish");
    NUM("norm_eps", f2d(c->rms_norm_eps));
    if (n_attn == 0) {
        NUL("attn");
    } else if (ok) {
        cJSON *a = cJSON_AddObjectToObject(j, "attn");
        cJSON *layers = a ? cJSON_AddArrayToObject(a, "layers") : NULL;
        ok = layers != NULL;
        for (int i = 0; ok && i < L; i++)
            if (c->kinds[i] == LM_LAYER_ATTN)
                ok = cJSON_AddItemToArray(layers, cJSON_CreateNumber(i));
        ok = ok && cJSON_AddNumberToObject(a, "num_heads", c->num_attention_heads) &&
             cJSON_AddNumberToObject(a, "num_kv_heads", c->num_key_value_heads) &&
             cJSON_AddBoolToObject(a, "qkv_bias", 0) && cJSON_AddNullToObject(a, "window_size") &&
             cJSON_AddNumberToObject(a, "rope_theta", f2d(c->rope_theta));
    }
    NUM("max_position_embeddings", c->seq_len > 0 ? c->seq_len : FLA_DEFAULT_MAX_POS);
    BOOL("tie_word_embeddings", c->tie_word_embeddings);
    NUM("initializer_range", f2d(c->initializer_range));
    NUL("attnres_block_size");
    BOOL("fuse_norm", 1);
    BOOL("fuse_swiglu", 1);
    BOOL("fuse_cross_entropy", 1);
    BOOL("use_l2warp", 0);
    BOOL("use_cache", 1);
    NUL("pad_token_id");
    if (eot >= 0) {
        NUM("bos_token_id", eot);
        NUM("eos_token_id", eot);
    } else {
        NUL("bos_token_id");
        NUL("eos_token_id");
    }
    STR("torch_dtype", o->dtype == LM_BF16 ? "bfloat16" : "float32");
#undef NUM
#undef STR
#undef BOOL
#undef NUL
    char *s = ok ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!s)
        return lm_errorf(err, LM_ERR_NOMEM, "export --format fla: cannot build config.json");
    *json = s;
    return LM_OK;
}

/* ---------------------------------------------------------------- tensor plan */

typedef struct {
    lm_export_fla_tensor *t;
    int n, cap;
    const lm_params *p;
    uint8_t *used; /* [p->n] */
    lm_error *err;
} plan_b;

static lm_status plan_push(plan_b *b, const char *fla, const char *src, int ndim,
                           const int64_t *shape) {
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 64;
        lm_export_fla_tensor *t = realloc(b->t, (size_t)cap * sizeof *t);
        if (!t)
            return lm_errorf(b->err, LM_ERR_NOMEM, "export --format fla: out of memory");
        b->t = t;
        b->cap = cap;
    }
    if (!src)
        src = "";
    const size_t lf = strlen(fla), ls = strlen(src);
    if (lf >= sizeof b->t->name || ls >= sizeof b->t->src)
        return lm_errorf(b->err, LM_ERR_INVALID, "export --format fla: tensor name '%s' too long",
                         lf >= sizeof b->t->name ? fla : src);
    lm_export_fla_tensor *e = &b->t[b->n++];
    memset(e, 0, sizeof *e);
    memcpy(e->name, fla, lf + 1);
    memcpy(e->src, src, ls + 1);
    e->ndim = ndim;
    e->numel = 1;
    for (int k = 0; k < ndim; k++) {
        e->shape[k] = shape[k];
        e->numel *= shape[k];
    }
    return LM_OK;
}

/* Map linmoe tensor `src` (which must exist with the expected rank) to `fla`;
 * `conv` restores the singleton of a short-conv weight ([C, W] -> [C, 1, W]). */
static lm_status map1(plan_b *b, const char *src, const char *fla, int conv) {
    const lm_param_info *e = lm_params_find(b->p, src);
    if (!e)
        return lm_errorf(b->err, LM_ERR_UNSUPPORTED,
                         "export --format fla: the checkpoint has no tensor '%s' (fla's '%s' "
                         "needs it)",
                         src, fla);
    b->used[e - b->p->t] = 1;
    if (conv) {
        if (e->ndim != 2)
            return lm_errorf(b->err, LM_ERR_UNSUPPORTED,
                             "export --format fla: tensor '%s' has %d dims, a short-conv "
                             "weight [C, W] has 2",
                             src, e->ndim);
        const int64_t sh[3] = {e->shape[0], 1, e->shape[1]};
        return plan_push(b, fla, src, 3, sh);
    }
    return plan_push(b, fla, src, e->ndim, e->shape);
}

lm_status lm_export_fla_plan(const lm_params *p, const lm_export_fla_options *o,
                             lm_export_fla_tensor **out, int *n, lm_error *err) {
    if (!p || !out || !n)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: NULL argument");
    *out = NULL;
    *n = 0;
    const lm_model_config *c = &p->cfg;
    LM_TRY(lm_export_fla_check(c, o, err));
    plan_b b = {0};
    b.p = p;
    b.err = err;
    b.used = calloc((size_t)(p->n > 0 ? p->n : 1), 1);
    if (!b.used)
        return lm_errorf(err, LM_ERR_NOMEM, "export --format fla: out of memory");
    static const char *const kda_same[] = {"q_proj.weight",
                                           "k_proj.weight",
                                           "v_proj.weight",
                                           "q_conv1d.weight",
                                           "k_conv1d.weight",
                                           "v_conv1d.weight",
                                           NULL};
    static const char *const attn_same[] = {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                            "o_proj.weight", NULL};
    static const char *const mlp[] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight",
                                      NULL};
    char s[LM_PARAM_NAME_MAX + 32], f[LM_PARAM_NAME_MAX + 32];
    lm_status st = map1(&b, "model.embed_tokens.weight", "model.embeddings.weight", 0);
#define MAP(conv)                                                                                  \
    do {                                                                                           \
        if (st == LM_OK) {                                                                         \
            snprintf(s, sizeof s, "model.layers.%d.%s", i, src_sfx);                               \
            snprintf(f, sizeof f, "model.layers.%d.%s", i, fla_sfx);                               \
            st = map1(&b, s, f, conv);                                                             \
        }                                                                                          \
    } while (0)
    for (int i = 0; st == LM_OK && i < c->num_hidden_layers; i++) {
        const char *src_sfx, *fla_sfx;
        char sbuf[64], fbuf[64];
        src_sfx = "input_layernorm.weight", fla_sfx = "attn_norm.weight";
        MAP(0);
        if (c->kinds[i] == LM_LAYER_KDA) {
            for (int k = 0; kda_same[k]; k++) {
                snprintf(sbuf, sizeof sbuf, "self_attn.%s", kda_same[k]);
                snprintf(fbuf, sizeof fbuf, "attn.%s", kda_same[k]);
                src_sfx = sbuf, fla_sfx = fbuf;
                MAP(strstr(kda_same[k], "conv1d") != NULL);
            }
            static const char *const pairs[][2] = {
                {"self_attn.f_a_proj.weight", "attn.f_proj.0.weight"},
                {"self_attn.f_b_proj.weight", "attn.f_proj.1.weight"},
                {"self_attn.b_proj.weight", "attn.b_proj.weight"},
                {"self_attn.A_log", "attn.A_log"},
                {"self_attn.dt_bias", "attn.dt_bias"},
                {"self_attn.g_a_proj.weight", "attn.g_proj.0.weight"},
                {"self_attn.g_b_proj.weight", "attn.g_proj.1.weight"},
            };
            for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
                src_sfx = pairs[k][0], fla_sfx = pairs[k][1];
                MAP(0);
            }
            if (st == LM_OK) {
                /* fla's g_proj[1] is Linear(head_v_dim, value_dim, bias=True) */
                const int64_t sh[1] = {b.t[b.n - 1].shape[0]};
                snprintf(f, sizeof f, "model.layers.%d.attn.g_proj.1.bias", i);
                st = plan_push(&b, f, NULL, 1, sh);
            }
            src_sfx = "self_attn.o_norm.weight", fla_sfx = "attn.o_norm.weight";
            MAP(0);
            src_sfx = "self_attn.o_proj.weight", fla_sfx = "attn.o_proj.weight";
            MAP(0);
        } else {
            for (int k = 0; attn_same[k]; k++) {
                snprintf(sbuf, sizeof sbuf, "self_attn.%s", attn_same[k]);
                snprintf(fbuf, sizeof fbuf, "attn.%s", attn_same[k]);
                src_sfx = sbuf, fla_sfx = fbuf;
                MAP(0);
            }
        }
        src_sfx = "post_attention_layernorm.weight", fla_sfx = "mlp_norm.weight";
        MAP(0);
        for (int k = 0; mlp[k]; k++) {
            snprintf(sbuf, sizeof sbuf, "mlp.%s", mlp[k]);
            src_sfx = sbuf, fla_sfx = sbuf;
            MAP(0);
        }
    }
#undef MAP
    if (st == LM_OK)
        st = map1(&b, "model.norm.weight", "model.norm.weight", 0);
    if (st == LM_OK && !c->tie_word_embeddings)
        st = map1(&b, "lm_head.weight", "lm_head.weight", 0);
    for (int i = 0; st == LM_OK && i < p->n; i++)
        if (!b.used[i])
            st = lm_errorf(err, LM_ERR_UNSUPPORTED,
                           "export --format fla: tensor '%s' has no counterpart in fla's "
                           "KDAForCausalLM",
                           p->t[i].name);
    free(b.used);
    if (st != LM_OK) {
        free(b.t);
        return st;
    }
    *out = b.t;
    *n = b.n;
    return LM_OK;
}

/* ---------------------------------------------------------------- files */

/* Remove the two files an export writes, then the directory (fails, leaving it, when
 * it holds anything else). 0 when the directory is gone. */
static int rm_export_dir(const char *dir) {
    char path[PATH_CAP + 32];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    return rmdir(dir) == 0 || errno == ENOENT ? 0 : -1;
}

/* 1 when `dir` is a directory without entries, 0 when it has some, -1 on error. */
static int dir_is_empty(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int empty = 1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
            empty = 0;
            break;
        }
    closedir(d);
    return empty;
}

static lm_status write_text(const char *path, const char *text, lm_error *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return lm_errorf(err, LM_ERR_IO, "export --format fla: cannot create %s: %s", path,
                         strerror(errno));
    const size_t n = strlen(text);
    size_t done = 0;
    int ok = 1;
    while (ok && done < n) {
        ssize_t w = write(fd, text + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        ok = w > 0;
        if (ok)
            done += (size_t)w;
    }
    ok = ok && write(fd, "\n", 1) == 1;
    ok = ok && fsync(fd) == 0;
    const int e = errno;
    ok = (close(fd) == 0) && ok;
    if (!ok)
        return lm_errorf(err, LM_ERR_IO, "export --format fla: write to %s failed: %s", path,
                         strerror(e));
    return LM_OK;
}

static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

/* The parent directory of `path` into buf ("." when it has none). */
static void parent_dir(const char *path, char *buf, size_t size) {
    snprintf(buf, size, "%s", path);
    char *slash = strrchr(buf, '/');
    if (!slash)
        snprintf(buf, size, ".");
    else if (slash == buf)
        buf[1] = '\0';
    else
        *slash = '\0';
}

/* Fill the safetensors writer with the plan's tensors in the chosen dtype. */
static lm_status add_tensors(lm_st_writer *w, const lm_params *p, const lm_export_fla_tensor *t,
                             int n, lm_dtype dt, lm_error *err) {
    int64_t max_numel = 1;
    for (int i = 0; i < n; i++)
        if (t[i].numel > max_numel)
            max_numel = t[i].numel;
    void *buf = malloc((size_t)max_numel * (dt == LM_BF16 ? sizeof(uint16_t) : sizeof(float)));
    if (!buf)
        return lm_errorf(err, LM_ERR_NOMEM,
                         "export --format fla: cannot allocate %lld elements of staging",
                         (long long)max_numel);
    lm_status st = LM_OK;
    for (int i = 0; i < n && st == LM_OK; i++) {
        const float *src = NULL;
        if (t[i].src[0]) {
            const lm_param_info *e = lm_params_find(p, t[i].src);
            LM_CHECK(e && e->numel == t[i].numel); /* the plan was built from p */
            src = p->data + e->offset;
        }
        if (dt == LM_BF16) {
            uint16_t *h = buf;
            for (int64_t k = 0; k < t[i].numel; k++)
                h[k] = src ? lm_f32_to_bf16(src[k]) : 0; /* bf16 +0 is all-zero bits */
        } else {
            float *x = buf;
            if (src)
                memcpy(x, src, (size_t)t[i].numel * sizeof(float));
            else
                memset(x, 0, (size_t)t[i].numel * sizeof(float));
        }
        st = lm_st_writer_add(w, t[i].name, dt, t[i].ndim, t[i].shape, buf, err);
    }
    free(buf);
    return st;
}

lm_status lm_export_fla_save(const lm_params *p, const char *out_dir,
                             const lm_export_fla_options *o, lm_error *err) {
    lm_export_fla_options def;
    if (!o) {
        lm_export_fla_options_default(&def);
        o = &def;
    }
    if (!out_dir || !*out_dir)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: empty output directory name");
    char out[PATH_CAP - 64];
    if (strlen(out_dir) >= sizeof out)
        return lm_errorf(err, LM_ERR_INVALID,
                         "export --format fla: output directory name too long");
    snprintf(out, sizeof out, "%s", out_dir);
    for (size_t k = strlen(out); k > 1 && out[k - 1] == '/'; k--)
        out[k - 1] = '\0'; /* "dir/" + ".tmp.PID" must not land inside dir */
    if (strcmp(out, "/") == 0 || strcmp(out, ".") == 0 || strcmp(out, "..") == 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "export --format fla: output directory '%s' cannot "
                         "be replaced (name a new directory)",
                         out_dir);

    struct stat sb;
    int had_old = 0;
    if (stat(out, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode))
            return lm_errorf(err, LM_ERR_INVALID,
                             "export --format fla: output %s exists and is not a directory", out);
        const int empty = dir_is_empty(out);
        if (empty < 0)
            return lm_errorf(err, LM_ERR_IO, "export --format fla: cannot read directory %s: %s",
                             out, strerror(errno));
        if (!empty && !o->force)
            return lm_errorf(err, LM_ERR_INVALID,
                             "export --format fla: output directory %s exists and is not empty "
                             "(pass --force to replace it)",
                             out);
        had_old = !empty;
    } else if (errno != ENOENT) {
        return lm_errorf(err, LM_ERR_IO, "export --format fla: cannot stat %s: %s", out,
                         strerror(errno));
    }

    lm_export_fla_tensor *t = NULL;
    int n = 0;
    LM_TRY(lm_export_fla_plan(p, o, &t, &n, err));
    char *json = NULL;
    lm_status st = lm_export_fla_config_json(&p->cfg, o, &json, err);

    char tmp[PATH_CAP], old[PATH_CAP], path[PATH_CAP + 32];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", out, (long)getpid());
    snprintf(old, sizeof old, "%s.old.%ld", out, (long)getpid());
    if (st == LM_OK && rm_export_dir(tmp) != 0)
        st = lm_errorf(err, LM_ERR_IO,
                       "export --format fla: a stale %s holds other files; remove it first", tmp);
    if (st == LM_OK && mkdir(tmp, 0755) != 0)
        st = lm_errorf(err, LM_ERR_IO, "export --format fla: cannot create %s: %s", tmp,
                       strerror(errno));
    int made_tmp = st == LM_OK;
    if (st == LM_OK) {
        lm_st_writer w;
        lm_st_writer_init(&w);
        st = lm_st_writer_meta(&w, "format", "pt", err); /* transformers requires it */
        if (st == LM_OK)
            st = lm_st_writer_meta(&w, "producer", "linmoe export --format fla", err);
        if (st == LM_OK)
            st = add_tensors(&w, p, t, n, o->dtype, err);
        snprintf(path, sizeof path, "%s/model.safetensors", tmp);
        if (st == LM_OK)
            st = lm_st_writer_save(&w, path, err);
        lm_st_writer_free(&w);
    }
    free(t);
    snprintf(path, sizeof path, "%s/config.json", tmp);
    if (st == LM_OK)
        st = write_text(path, json, err);
    free(json);
    if (st == LM_OK) {
        fsync_dir(tmp);
        if (had_old && rename(out, old) != 0)
            st = lm_errorf(err, LM_ERR_IO, "export --format fla: cannot move the old %s aside: %s",
                           out, strerror(errno));
    }
    if (st == LM_OK && rename(tmp, out) != 0) {
        /* rename(2) replaces an existing empty directory; anything else is an error */
        const int e = errno;
        if (had_old)
            rename(old, out);
        st = lm_errorf(err, LM_ERR_IO, "export --format fla: cannot rename %s to %s: %s", tmp, out,
                       strerror(e));
    }
    if (st != LM_OK) {
        if (made_tmp)
            rm_export_dir(tmp);
        return st;
    }
    char parent[PATH_CAP];
    parent_dir(out, parent, sizeof parent);
    fsync_dir(parent);
    if (had_old && rm_export_dir(old) != 0)
        fprintf(stderr,
                "export --format fla: the replaced %s held other files; they are kept in %s\n", out,
                old);
    return LM_OK;
}

lm_status lm_export_fla(const char *ckpt_dir, const char *out_dir, const lm_export_fla_options *o,
                        lm_error *err) {
    if (!ckpt_dir || !*ckpt_dir)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: empty checkpoint directory");
    if (!out_dir || !*out_dir)
        return lm_errorf(err, LM_ERR_INVALID, "export --format fla: empty output directory name");
    struct stat sa, sb;
    if (stat(ckpt_dir, &sa) == 0 && stat(out_dir, &sb) == 0 && sa.st_dev == sb.st_dev &&
        sa.st_ino == sb.st_ino)
        return lm_errorf(err, LM_ERR_INVALID,
                         "export --format fla: output directory %s is the checkpoint itself",
                         out_dir);
    lm_params p;
    LM_TRY(lm_params_load(&p, ckpt_dir, err));
    lm_status st = lm_export_fla_save(&p, out_dir, o, err);
    lm_params_free(&p);
    return st;
}
