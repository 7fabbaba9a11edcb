/* The training config: parsing, validation (every error names the file, the key
 * path and the value), derived per-stage quantities and the LR schedule. Format:
 * include/linmoe/train.h. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/train.h"

typedef struct {
    const char *label;
    lm_error *err;
} pctx;

static char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = LM_MALLOC(n);
    memcpy(d, s, n);
    return d;
}

/* The value as short JSON text for messages. */
static void val_str(const cJSON *v, char *buf, size_t n) {
    char *s = v ? cJSON_PrintUnformatted(v) : NULL;
    snprintf(buf, n, "%s", s ? s : "?");
    if (s && strlen(s) >= n && n > 4)
        memcpy(buf + n - 4, "...", 4);
    free(s);
}

static lm_status bad_value(pctx *p, const char *path, const cJSON *v, const char *why) {
    char vs[96];
    val_str(v, vs, sizeof vs);
    return lm_errorf(p->err, LM_ERR_INVALID, "%s: key '%s' = %s %s", p->label, path, vs, why);
}

/* Reject keys outside `allowed` and duplicate keys of object `o` at `prefix`. */
static lm_status check_keys(pctx *p, const cJSON *o, const char *prefix,
                            const char *const *allowed) {
    const cJSON *e;
    cJSON_ArrayForEach(e, o) {
        int ok = 0;
        for (const char *const *a = allowed; *a && !ok; a++)
            ok = strcmp(*a, e->string) == 0;
        if (!ok)
            return lm_errorf(p->err, LM_ERR_INVALID, "%s: unknown key '%s%s'", p->label, prefix,
                             e->string);
        for (const cJSON *f = o->child; f != e; f = f->next)
            if (strcmp(f->string, e->string) == 0)
                return lm_errorf(p->err, LM_ERR_INVALID, "%s: duplicate key '%s%s'", p->label,
                                 prefix, e->string);
    }
    return LM_OK;
}

static lm_status want_object(pctx *p, const cJSON *o, const char *path) {
    if (!cJSON_IsObject(o))
        return bad_value(p, path, o, "must be an object");
    return LM_OK;
}

/* Number in [lo, hi] (inclusive; open ends via lo_open / hi_open), optionally
 * integral. Absent: *out unchanged. */
static lm_status get_num(pctx *p, const cJSON *o, const char *prefix, const char *key, double lo,
                         int lo_open, double hi, int integral, double *out, int *present) {
    if (present)
        *present = 0;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v)
        return LM_OK;
    char path[160];
    snprintf(path, sizeof path, "%s%s", prefix, key);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return bad_value(p, path, v, "must be a number");
    const double x = v->valuedouble;
    if (integral && x != floor(x))
        return bad_value(p, path, v, "must be an integer");
    if (x < lo || (lo_open && x == lo) || x > hi) {
        char why[128];
        if (integral)
            snprintf(why, sizeof why, "must be an integer in [%.0f, %.0f]", lo, hi);
        else
            snprintf(why, sizeof why, "must be in %s%g, %g]", lo_open ? "(" : "[", lo, hi);
        return bad_value(p, path, v, why);
    }
    *out = x;
    if (present)
        *present = 1;
    return LM_OK;
}

static lm_status get_int(pctx *p, const cJSON *o, const char *prefix, const char *key, int64_t lo,
                         int64_t hi, int64_t *out, int *present) {
    double x = (double)*out;
    LM_TRY(get_num(p, o, prefix, key, (double)lo, 0, (double)hi, 1, &x, present));
    *out = (int64_t)x;
    return LM_OK;
}

static lm_status get_int32(pctx *p, const cJSON *o, const char *prefix, const char *key, int lo,
                           int hi, int *out) {
    int64_t x = *out;
    LM_TRY(get_int(p, o, prefix, key, lo, hi, &x, NULL));
    *out = (int)x;
    return LM_OK;
}

static lm_status get_bool(pctx *p, const cJSON *o, const char *prefix, const char *key, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v)
        return LM_OK;
    char path[160];
    snprintf(path, sizeof path, "%s%s", prefix, key);
    if (!cJSON_IsBool(v))
        return bad_value(p, path, v, "must be true or false");
    *out = cJSON_IsTrue(v);
    return LM_OK;
}

/* train.recompute: false (default), true (every layer) or a list of 1-based layer
 * numbers (the convention of linear_attn_config.kda_layers). Needs the model parsed. */
static lm_status parse_recompute(pctx *p, lm_train_config *c, const cJSON *to) {
    memset(c->recompute, 0, sizeof c->recompute);
    c->n_recompute = 0;
    const cJSON *v = to ? cJSON_GetObjectItemCaseSensitive(to, "recompute") : NULL;
    if (!v || cJSON_IsFalse(v))
        return LM_OK;
    const int L = c->model.num_hidden_layers;
    if (cJSON_IsTrue(v)) {
        for (int i = 0; i < L; i++)
            c->recompute[i] = 1;
        c->n_recompute = L;
        return LM_OK;
    }
    if (!cJSON_IsArray(v))
        return bad_value(p, "train.recompute", v,
                         "must be true, false or a list of 1-based layer numbers");
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        const double x = cJSON_IsNumber(e) ? e->valuedouble : -1;
        if (!cJSON_IsNumber(e) || x != (double)(int)x || x < 1 || x > L)
            return bad_value(
                p, "train.recompute", e,
                L > 0 ? "has an entry that is not a layer number in [1, num_hidden_layers]"
                      : "needs a model with layers");
        if (c->recompute[(int)x - 1])
            return bad_value(p, "train.recompute", e, "lists a layer twice");
        c->recompute[(int)x - 1] = 1;
        c->n_recompute++;
    }
    return LM_OK;
}

static lm_status get_str(pctx *p, const cJSON *o, const char *prefix, const char *key,
                         const cJSON **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = NULL;
    if (!v)
        return LM_OK;
    char path[160];
    snprintf(path, sizeof path, "%s%s", prefix, key);
    if (!cJSON_IsString(v) || !v->valuestring[0])
        return bad_value(p, path, v, "must be a non-empty string");
    *out = v;
    return LM_OK;
}

void lm_train_config_free(lm_train_config *c) {
    if (!c)
        return;
    free(c->text);
    free(c->source);
    free(c->tokenizer_dir);
    free(c->train_path);
    free(c->val_path);
    free(c->stages);
    memset(c, 0, sizeof *c);
}

static const char *const k_top[] = {"model", "tokenizer", "tokenizer_dir", "data",
                                    "train", "stages",    "eval",          NULL};
static const char *const k_data[] = {"train", "val", NULL};
/* clang-format off */
static const char *const k_train[] = {
    "seed",         "batch_tokens",  "batch_size", "micro_batches",
    "lr",           "min_lr_ratio",  "schedule",   "wsd_decay_frac",
    "weight_decay", "beta1",         "beta2",      "eps",
    "grad_clip",    "log_every",     "eval_every", "checkpoint_every",
    "keep_last",    "max_bad_steps", "threads",    "recompute",
    "expert_parallel",
    NULL};
static const char *const k_stage[] = {
    "name",     "seq_len",          "tokens",            "lr",
    "warmup_steps", "rope_theta",   "packing",           "passkey_fraction",
    "long_doc_fraction", "repeat_fraction", "passkey_length", NULL};
/* clang-format on */
static const char *const k_eval[] = {"seq_len",      "passkey_lengths", "passkey_samples",
                                     "passkey_seed", "max_val_tokens",  NULL};

static lm_status parse_model(pctx *p, lm_train_config *c, const cJSON *mv) {
    char warn[1024] = "";
    char label[512];
    lm_status st;
    if (cJSON_IsObject(mv)) {
        char *s = cJSON_PrintUnformatted(mv);
        if (!s)
            return lm_errorf(p->err, LM_ERR_NOMEM, "%s: cannot print the model section", p->label);
        snprintf(label, sizeof label, "%s: model", p->label);
        st = lm_model_config_from_string(&c->model, s, label, warn, sizeof warn, p->err);
        free(s);
    } else if (cJSON_IsString(mv) && mv->valuestring[0]) {
        st = lm_model_config_load(&c->model, mv->valuestring, warn, sizeof warn, p->err);
        if (st != LM_OK) {
            char buf[sizeof p->err->msg];
            snprintf(buf, sizeof buf, "%s", p->err ? p->err->msg : "");
            return lm_errorf(p->err, st, "%s: key 'model': %s", p->label, buf);
        }
    } else {
        return bad_value(p, "model", mv, "must be a model config object or the path of one");
    }
    if (st != LM_OK)
        return st;
    if (warn[0]) {
        /* "LABEL: unknown keys ignored: a, b" -> the key paths under 'model.' */
        const char *tag = "unknown keys ignored: ";
        const char *list = strstr(warn, tag);
        list = list ? list + strlen(tag) : warn;
        char keys[900];
        size_t n = 0;
        keys[0] = '\0';
        while (*list && n + 8 < sizeof keys) {
            size_t len = strcspn(list, ",");
            n += (size_t)snprintf(keys + n, sizeof keys - n, "%s'model.%.*s'", n ? ", " : "",
                                  (int)len, list);
            list += len;
            while (*list == ',' || *list == ' ')
                list++;
        }
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: unknown key%s %s", p->label,
                         strchr(keys, ',') ? "s" : "", keys);
    }
    return LM_OK;
}

static lm_status parse_stage(pctx *p, lm_train_config *c, const cJSON *so, int i) {
    char pre[48];
    snprintf(pre, sizeof pre, "stages[%d].", i);
    char path[64];
    snprintf(path, sizeof path, "stages[%d]", i);
    LM_TRY(want_object(p, so, path));
    LM_TRY(check_keys(p, so, pre, k_stage));
    lm_train_stage *s = &c->stages[i];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "stage%d", i);
    const cJSON *nm;
    LM_TRY(get_str(p, so, pre, "name", &nm));
    if (nm) {
        const char *q = nm->valuestring;
        int ok = strlen(q) < LM_TRAIN_NAME_MAX;
        for (; ok && *q; q++)
            ok = (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') ||
                 *q == '_' || *q == '-' || *q == '.';
        snprintf(path, sizeof path, "%sname", pre);
        if (!ok)
            return bad_value(p, path, nm, "must be 1-63 characters of [A-Za-z0-9_.-]");
        snprintf(s->name, sizeof s->name, "%s", nm->valuestring);
        for (int j = 0; j < i; j++)
            if (strcmp(c->stages[j].name, s->name) == 0)
                return bad_value(p, path, nm, "repeats an earlier stage's name");
    }
    int have = 0;
    int64_t v = 0;
    LM_TRY(get_int(p, so, pre, "seq_len", 2, 1 << 24, &v, &have));
    if (!have)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key '%sseq_len'", p->label,
                         pre);
    s->seq_len = (int)v;
    v = 0;
    LM_TRY(get_int(p, so, pre, "tokens", 1, (int64_t)1 << 52, &v, &have));
    if (!have)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key '%stokens'", p->label,
                         pre);
    s->tokens = v;
    s->lr = c->lr;
    const cJSON *lv = cJSON_GetObjectItemCaseSensitive(so, "lr");
    if (lv && !cJSON_IsNull(lv))
        LM_TRY(get_num(p, so, pre, "lr", 0, 1, 10, 0, &s->lr, NULL));
    LM_TRY(get_int32(p, so, pre, "warmup_steps", 0, 1 << 30, &s->warmup_steps));
    s->rope_theta = 0;
    const cJSON *rv = cJSON_GetObjectItemCaseSensitive(so, "rope_theta");
    if (rv && !cJSON_IsNull(rv)) {
        LM_TRY(get_num(p, so, pre, "rope_theta", 0, 0, 1e30, 0, &s->rope_theta, NULL));
    }
    if (!(s->rope_theta > 0))
        s->rope_theta = c->model.rope_theta;
    s->packing = 1;
    LM_TRY(get_bool(p, so, pre, "packing", &s->packing));
    LM_TRY(get_num(p, so, pre, "passkey_fraction", 0, 0, 1, 0, &s->passkey_fraction, NULL));
    LM_TRY(get_num(p, so, pre, "long_doc_fraction", 0, 0, 1, 0, &s->long_doc_fraction, NULL));
    LM_TRY(get_num(p, so, pre, "repeat_fraction", 0, 0, 1, 0, &s->repeat_fraction, NULL));
    if (s->passkey_fraction + s->long_doc_fraction + s->repeat_fraction > 1.0 + 1e-12)
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: '%spasskey_fraction' + '%slong_doc_fraction' + '%srepeat_fraction' "
                         "= %g exceeds 1",
                         p->label, pre, pre, pre,
                         s->passkey_fraction + s->long_doc_fraction + s->repeat_fraction);
    double pl = 0;
    LM_TRY(get_num(p, so, pre, "passkey_length", 0, 0, s->seq_len, 1, &pl, NULL));
    s->passkey_length = (int)pl;
    if (s->passkey_length > 0 && !s->packing && s->passkey_length != s->seq_len)
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: '%spasskey_length' = %d needs packing (or equal seq_len = %d)",
                         p->label, pre, s->passkey_length, s->seq_len);
    if (s->repeat_fraction > 0 && s->seq_len < 10)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: '%srepeat_fraction' = %g needs seq_len >= 10",
                         p->label, pre, s->repeat_fraction);
    /* derived sizes */
    if (c->batch_tokens > 0) {
        if (c->batch_tokens % s->seq_len != 0)
            return lm_errorf(p->err, LM_ERR_INVALID,
                             "%s: key '%sseq_len' = %d does not divide train.batch_tokens = %lld",
                             p->label, pre, s->seq_len, (long long)c->batch_tokens);
        const int64_t rows = c->batch_tokens / s->seq_len;
        if (rows > (1 << 24))
            return lm_errorf(p->err, LM_ERR_INVALID,
                             "%s: key '%sseq_len' = %d gives %lld rows per step", p->label, pre,
                             s->seq_len, (long long)rows);
        s->rows_per_step = (int)rows;
    } else {
        s->rows_per_step = c->batch_size;
    }
    if (s->rows_per_step % c->micro_batches != 0)
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: stage %s has %d rows of %d tokens per step, not divisible by "
                         "train.micro_batches = %d",
                         p->label, s->name, s->rows_per_step, s->seq_len, c->micro_batches);
    s->rows_per_micro = s->rows_per_step / c->micro_batches;
    if ((int64_t)s->rows_per_micro * s->seq_len > ((int64_t)1 << 28))
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: stage %s: micro-batch of %lld tokens is too large", p->label, s->name,
                         (long long)s->rows_per_micro * s->seq_len);
    s->step_tokens = (int64_t)s->rows_per_step * s->seq_len;
    s->steps = (s->tokens + s->step_tokens - 1) / s->step_tokens;
    return LM_OK;
}

static lm_status parse(lm_train_config *c, const cJSON *root, pctx *p) {
    if (!cJSON_IsObject(root))
        return lm_errorf(p->err, LM_ERR_FORMAT, "%s: the training config is not a JSON object",
                         p->label);
    LM_TRY(check_keys(p, root, "", k_top));
    /* model */
    const cJSON *mv = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!mv)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key 'model'", p->label);
    LM_TRY(parse_model(p, c, mv));
    /* tokenizer */
    snprintf(c->tokenizer, sizeof c->tokenizer, "byte");
    const cJSON *tv;
    LM_TRY(get_str(p, root, "", "tokenizer", &tv));
    if (tv) {
        if (strcmp(tv->valuestring, "byte") && strcmp(tv->valuestring, "gpt2"))
            return bad_value(p, "tokenizer", tv, "is not one of byte|gpt2");
        snprintf(c->tokenizer, sizeof c->tokenizer, "%s", tv->valuestring);
    }
    LM_TRY(get_str(p, root, "", "tokenizer_dir", &tv));
    if (tv)
        c->tokenizer_dir = xstrdup(tv->valuestring);
    const int tok_vocab = strcmp(c->tokenizer, "byte") == 0 ? 257 : 50257;
    if (c->model.vocab_size < tok_vocab)
        return lm_errorf(
            p->err, LM_ERR_INVALID,
            "%s: key 'model.vocab_size' = %d is smaller than the %s tokenizer's vocab %d", p->label,
            c->model.vocab_size, c->tokenizer, tok_vocab);
    /* data */
    const cJSON *dv = cJSON_GetObjectItemCaseSensitive(root, "data");
    if (!dv)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key 'data'", p->label);
    LM_TRY(want_object(p, dv, "data"));
    LM_TRY(check_keys(p, dv, "data.", k_data));
    LM_TRY(get_str(p, dv, "data.", "train", &tv));
    if (!tv)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key 'data.train'", p->label);
    c->train_path = xstrdup(tv->valuestring);
    LM_TRY(get_str(p, dv, "data.", "val", &tv));
    if (!tv)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key 'data.val'", p->label);
    c->val_path = xstrdup(tv->valuestring);
    /* train */
    c->seed = 0;
    c->micro_batches = 1;
    c->lr = 1e-3;
    c->min_lr_ratio = 0.1;
    c->schedule = LM_SCHED_COSINE;
    c->wsd_decay_frac = 0.2;
    c->weight_decay = 0.1;
    c->beta1 = 0.9;
    c->beta2 = 0.95;
    c->eps = 1e-8;
    c->grad_clip = 1.0;
    c->log_every = 10;
    c->eval_every = 0;
    c->checkpoint_every = 0;
    c->keep_last = 3;
    c->max_bad_steps = 5;
    c->threads = 0;
    const cJSON *to = cJSON_GetObjectItemCaseSensitive(root, "train");
    if (!to)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key 'train'", p->label);
    LM_TRY(want_object(p, to, "train"));
    LM_TRY(check_keys(p, to, "train.", k_train));
    const char *T = "train.";
    {
        const cJSON *sv = cJSON_GetObjectItemCaseSensitive(to, "seed");
        if (sv) {
            if (!cJSON_IsNumber(sv) || sv->valuedouble != floor(sv->valuedouble) ||
                sv->valuedouble < 0 || sv->valuedouble >= 9007199254740992.0)
                return bad_value(p, "train.seed", sv, "must be an integer in [0, 2^53)");
            c->seed = (uint64_t)sv->valuedouble;
        }
    }
    int hb = 0, hs = 0;
    int64_t v = 0;
    LM_TRY(get_int(p, to, T, "batch_tokens", 2, (int64_t)1 << 30, &v, &hb));
    c->batch_tokens = hb ? v : 0;
    v = 0;
    LM_TRY(get_int(p, to, T, "batch_size", 1, 1 << 24, &v, &hs));
    c->batch_size = hs ? (int)v : 0;
    if (hb && hs)
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: give either 'train.batch_tokens' or 'train.batch_size', not both",
                         p->label);
    if (!hb && !hs)
        return lm_errorf(p->err, LM_ERR_INVALID,
                         "%s: missing required key 'train.batch_tokens' (or 'train.batch_size')",
                         p->label);
    LM_TRY(get_int32(p, to, T, "micro_batches", 1, 1 << 20, &c->micro_batches));
    LM_TRY(get_num(p, to, T, "lr", 0, 1, 10, 0, &c->lr, NULL));
    LM_TRY(get_num(p, to, T, "min_lr_ratio", 0, 0, 1, 0, &c->min_lr_ratio, NULL));
    LM_TRY(get_str(p, to, T, "schedule", &tv));
    if (tv) {
        if (strcmp(tv->valuestring, "cosine") == 0)
            c->schedule = LM_SCHED_COSINE;
        else if (strcmp(tv->valuestring, "wsd") == 0)
            c->schedule = LM_SCHED_WSD;
        else
            return bad_value(p, "train.schedule", tv, "is not one of cosine|wsd");
    }
    LM_TRY(get_num(p, to, T, "wsd_decay_frac", 0, 0, 1, 0, &c->wsd_decay_frac, NULL));
    LM_TRY(get_num(p, to, T, "weight_decay", 0, 0, 10, 0, &c->weight_decay, NULL));
    LM_TRY(get_num(p, to, T, "beta1", 0, 0, 0.999999, 0, &c->beta1, NULL));
    LM_TRY(get_num(p, to, T, "beta2", 0, 0, 0.9999999, 0, &c->beta2, NULL));
    LM_TRY(get_num(p, to, T, "eps", 0, 1, 1, 0, &c->eps, NULL));
    LM_TRY(get_num(p, to, T, "grad_clip", 0, 0, 1e30, 0, &c->grad_clip, NULL));
    LM_TRY(get_int32(p, to, T, "log_every", 1, 1 << 30, &c->log_every));
    LM_TRY(get_int(p, to, T, "eval_every", 0, (int64_t)1 << 50, &c->eval_every, NULL));
    LM_TRY(get_int(p, to, T, "checkpoint_every", 0, (int64_t)1 << 50, &c->checkpoint_every, NULL));
    LM_TRY(get_int32(p, to, T, "keep_last", 0, 1 << 20, &c->keep_last));
    LM_TRY(get_int32(p, to, T, "max_bad_steps", 1, 1 << 30, &c->max_bad_steps));
    LM_TRY(get_int32(p, to, T, "threads", 0, 4096, &c->threads));
    c->expert_parallel = 1;
    LM_TRY(get_int32(p, to, T, "expert_parallel", 1, 4096, &c->expert_parallel));
    LM_TRY(parse_recompute(p, c, to));
    /* stages */
    const cJSON *sa = cJSON_GetObjectItemCaseSensitive(root, "stages");
    if (!sa)
        return lm_errorf(p->err, LM_ERR_INVALID, "%s: missing required key 'stages'", p->label);
    if (!cJSON_IsArray(sa) || cJSON_GetArraySize(sa) < 1 || cJSON_GetArraySize(sa) > 64)
        return bad_value(p, "stages", sa, "must be a list of 1 to 64 stage objects");
    c->n_stages = cJSON_GetArraySize(sa);
    c->stages = LM_CALLOC((size_t)c->n_stages, sizeof(lm_train_stage));
    int i = 0;
    const cJSON *so;
    int64_t first = 0;
    cJSON_ArrayForEach(so, sa) {
        LM_TRY(parse_stage(p, c, so, i));
        c->stages[i].first_step = first;
        first += c->stages[i].steps;
        i++;
    }
    c->total_steps = first;
    /* eval */
    c->eval_seq_len = 0;
    c->passkey_samples = 200;
    c->passkey_seed = 1234;
    c->max_val_tokens = 0;
    const cJSON *eo = cJSON_GetObjectItemCaseSensitive(root, "eval");
    if (eo) {
        LM_TRY(want_object(p, eo, "eval"));
        LM_TRY(check_keys(p, eo, "eval.", k_eval));
        LM_TRY(get_int32(p, eo, "eval.", "seq_len", 0, 1 << 24, &c->eval_seq_len));
        if (c->eval_seq_len == 1)
            return bad_value(p, "eval.seq_len", cJSON_GetObjectItemCaseSensitive(eo, "seq_len"),
                             "must be 0 (the last stage's) or >= 2");
        const cJSON *pl = cJSON_GetObjectItemCaseSensitive(eo, "passkey_lengths");
        if (pl) {
            if (!cJSON_IsArray(pl) || cJSON_GetArraySize(pl) > LM_TRAIN_MAX_PASSKEY_LENGTHS)
                return bad_value(p, "eval.passkey_lengths", pl,
                                 "must be a list of up to 32 lengths");
            int j = 0;
            const cJSON *e;
            cJSON_ArrayForEach(e, pl) {
                char path[64];
                snprintf(path, sizeof path, "eval.passkey_lengths[%d]", j);
                if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) ||
                    e->valuedouble < 2 || e->valuedouble > (1 << 24))
                    return bad_value(p, path, e, "must be an integer length in [2, 2^24]");
                c->passkey_lengths[j++] = (int)e->valuedouble;
            }
            c->n_passkey_lengths = j;
        }
        LM_TRY(get_int32(p, eo, "eval.", "passkey_samples", 1, 1 << 20, &c->passkey_samples));
        int64_t ps = (int64_t)c->passkey_seed;
        LM_TRY(get_int(p, eo, "eval.", "passkey_seed", 0, (int64_t)1 << 53, &ps, NULL));
        c->passkey_seed = (uint64_t)ps;
        LM_TRY(get_int(p, eo, "eval.", "max_val_tokens", 0, (int64_t)1 << 53, &c->max_val_tokens,
                       NULL));
    }
    if (c->eval_seq_len == 0)
        c->eval_seq_len = c->stages[c->n_stages - 1].seq_len;
    return LM_OK;
}

lm_status lm_train_config_parse(lm_train_config *c, const char *json, const char *label,
                                lm_error *err) {
    memset(c, 0, sizeof *c);
    if (!label)
        label = "(training config)";
    if (!json)
        return lm_errorf(err, LM_ERR_INVALID, "%s: no text", label);
    pctx p = {label, err};
    cJSON *root = cJSON_Parse(json);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at && at >= json ? (long)(at - json) : -1;
        int line = 1;
        for (long i = 0; i < off; i++)
            line += json[i] == '\n';
        return lm_errorf(err, LM_ERR_FORMAT, "%s: not valid JSON (near line %d, byte %ld)", label,
                         line, off);
    }
    lm_status st = parse(c, root, &p);
    cJSON_Delete(root);
    if (st != LM_OK) {
        lm_train_config_free(c);
        return st;
    }
    c->text = xstrdup(json);
    c->source = xstrdup(label);
    return LM_OK;
}

lm_status lm_train_config_load(lm_train_config *c, const char *path, lm_error *err) {
    memset(c, 0, sizeof *c);
    FILE *f = fopen(path, "rb");
    if (!f)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (cap - n < 65536) {
            if (cap > ((size_t)64 << 20)) {
                fclose(f);
                free(buf);
                return lm_errorf(err, LM_ERR_FORMAT, "%s: larger than 64 MiB", path);
            }
            cap = cap ? 2 * cap : 65536;
            buf = realloc(buf, cap + 1);
            LM_CHECK(buf != NULL);
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return lm_errorf(err, LM_ERR_IO, "%s: read error", path);
    }
    buf[n] = '\0';
    if (strlen(buf) != n) {
        free(buf);
        return lm_errorf(err, LM_ERR_FORMAT, "%s: contains a NUL byte", path);
    }
    lm_status st = lm_train_config_parse(c, buf, path, err);
    free(buf);
    return st;
}

int lm_train_stage_of(const lm_train_config *c, int64_t step) {
    int s = 0;
    while (s + 1 < c->n_stages && step >= c->stages[s + 1].first_step)
        s++;
    return s;
}

double lm_train_lr(const lm_train_config *c, int64_t step) {
    const lm_train_stage *s = &c->stages[lm_train_stage_of(c, step)];
    const double P = s->lr, m = P * c->min_lr_ratio;
    int64_t i = step - s->first_step;
    const int64_t n = s->steps, w = s->warmup_steps;
    if (i < 0)
        i = 0;
    if (i >= n)
        i = n - 1;
    if (i < w)
        return P * (double)(i + 1) / (double)w;
    if (c->schedule == LM_SCHED_COSINE) {
        const double denom = (double)(n - w > 1 ? n - w - 1 : 1);
        const double t =
            (double)(i - w) / denom; /* 0 at the first post-warmup step, 1 at the last */
        return m + (P - m) * 0.5 * (1.0 + cos(3.14159265358979323846 * (t > 1 ? 1 : t)));
    }
    int64_t D = (int64_t)llround(c->wsd_decay_frac * (double)n);
    if (D > n - w)
        D = n - w;
    const int64_t d0 = n - D; /* first decay step */
    if (D <= 0 || i < d0)
        return P;
    if (D == 1)
        return m;
    return P + (m - P) * (double)(i - d0 + 1) / (double)D;
}

/* ---------------------------------------------------------------- resume with a changed config */

typedef struct {
    const lm_train_config *was, *now;
    int64_t step;
    char *log;
    size_t size, used;
    lm_error *err;
} rctx;

static void rlog(rctx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rlog(rctx *r, const char *fmt, ...) {
    if (!r->log || r->used + 1 >= r->size)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(r->log + r->used, r->size - r->used, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    r->used += (size_t)n;
    if (r->used >= r->size)
        r->used = r->size - 1;
    if (r->used + 1 < r->size) {
        r->log[r->used++] = '\n';
        r->log[r->used] = '\0';
    }
}

static lm_status runsafe(rctx *r, const char *field, const char *a, const char *b,
                         const char *why) {
    return lm_errorf(r->err, LM_ERR_INVALID,
                     "%s: cannot resume at step %lld with %s changed from %s to %s (the run was "
                     "started with %s): %s; restore the old value or start a new run directory",
                     r->now->source, (long long)r->step, field, a, b, r->was->source, why);
}

/* doubles printed so that different values print differently */
static void fmt_num(char *buf, size_t n, double v) {
    snprintf(buf, n, "%g", v);
    if (strtod(buf, NULL) != v)
        snprintf(buf, n, "%.17g", v);
}

static lm_status cmp_num(rctx *r, const char *field, double a, double b, const char *unsafe_why) {
    if (a == b || (isnan(a) && isnan(b)))
        return LM_OK;
    char sa[40], sb[40];
    fmt_num(sa, sizeof sa, a);
    fmt_num(sb, sizeof sb, b);
    if (unsafe_why)
        return runsafe(r, field, sa, sb, unsafe_why);
    rlog(r, "%s: %s -> %s", field, sa, sb);
    return LM_OK;
}

static lm_status cmp_int(rctx *r, const char *field, uint64_t a, uint64_t b, int is_signed,
                         const char *unsafe_why) {
    if (a == b)
        return LM_OK;
    char sa[32], sb[32];
    if (is_signed) {
        snprintf(sa, sizeof sa, "%lld", (long long)a);
        snprintf(sb, sizeof sb, "%lld", (long long)b);
    } else {
        snprintf(sa, sizeof sa, "%llu", (unsigned long long)a);
        snprintf(sb, sizeof sb, "%llu", (unsigned long long)b);
    }
    if (unsafe_why)
        return runsafe(r, field, sa, sb, unsafe_why);
    rlog(r, "%s: %s -> %s", field, sa, sb);
    return LM_OK;
}
#define CMP_I(r, f, a, b, why) cmp_int(r, f, (uint64_t)(int64_t)(a), (uint64_t)(int64_t)(b), 1, why)

static lm_status cmp_str(rctx *r, const char *field, const char *a, const char *b,
                         const char *unsafe_why) {
    const char *x = a ? a : "(default)", *y = b ? b : "(default)";
    if (strcmp(x, y) == 0)
        return LM_OK;
    char qa[PATH_MAX + 4], qb[PATH_MAX + 4];
    snprintf(qa, sizeof qa, "'%s'", x);
    snprintf(qb, sizeof qb, "'%s'", y);
    if (unsafe_why)
        return runsafe(r, field, qa, qb, unsafe_why);
    rlog(r, "%s: %s -> %s", field, qa, qb);
    return LM_OK;
}

static void fmt_list(char *buf, size_t n, const int *v, int cnt) {
    size_t u = 0;
    buf[0] = '\0';
    u += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < cnt && u + 16 < n; i++)
        u += (size_t)snprintf(buf + u, n - u, "%s%d", i ? ", " : "", v[i]);
    snprintf(buf + u, n - u, "]");
}

lm_status lm_train_config_resume_check(const lm_train_config *was, const lm_train_config *now,
                                       int64_t step, char *log, size_t log_size, lm_error *err) {
    rctx r = {was, now, step, log, log_size, 0, err};
    if (log && log_size)
        log[0] = '\0';
    static const char *DATA = "the data order would no longer be the run's";
    static const char *STEPS = "the global steps would no longer map to the run's stages and "
                               "token counts";
    LM_TRY(cmp_str(&r, "tokenizer", was->tokenizer, now->tokenizer, "the token ids would change"));
    LM_TRY(cmp_str(&r, "tokenizer_dir", was->tokenizer_dir, now->tokenizer_dir,
                   "the token ids would change"));
    LM_TRY(cmp_str(&r, "data.train", was->train_path, now->train_path, DATA));
    LM_TRY(cmp_int(&r, "train.seed", was->seed, now->seed, 0, DATA));
    LM_TRY(CMP_I(&r, "train.batch_tokens", was->batch_tokens, now->batch_tokens, STEPS));
    LM_TRY(CMP_I(&r, "train.batch_size", was->batch_size, now->batch_size, STEPS));
    LM_TRY(CMP_I(&r, "train.micro_batches", was->micro_batches, now->micro_batches,
                 "each step's batch would be split and summed differently"));
    /* stages: those that have started must be the same stages; the ones after may change */
    for (int i = 0; i < was->n_stages; i++) {
        const lm_train_stage *a = &was->stages[i];
        if (a->first_step >= step)
            break; /* not started: everything from here on may change */
        char f[LM_TRAIN_NAME_MAX + 64];
        if (i >= now->n_stages) {
            char sa[16], sb[16];
            snprintf(sa, sizeof sa, "%d", was->n_stages);
            snprintf(sb, sizeof sb, "%d", now->n_stages);
            return runsafe(&r, "the number of stages", sa, sb,
                           "a stage that has started would be dropped");
        }
        const lm_train_stage *b = &now->stages[i];
        const int done = step >= a->first_step + a->steps; /* completed */
        snprintf(f, sizeof f, "stages[%d].name", i);
        LM_TRY(cmp_str(&r, f, a->name, b->name, "a stage that has started cannot be replaced"));
#define STAGE_FIELD(key, expr, why)                                                                \
    do {                                                                                           \
        snprintf(f, sizeof f, "stages[%d] (%s).%s", i, a->name, key);                              \
        LM_TRY(cmp_num(&r, f, (double)(a->expr), (double)(b->expr), why));                         \
    } while (0)
#define STAGE_INT(key, expr, why)                                                                  \
    do {                                                                                           \
        snprintf(f, sizeof f, "stages[%d] (%s).%s", i, a->name, key);                              \
        LM_TRY(CMP_I(&r, f, a->expr, b->expr, why));                                               \
    } while (0)
        STAGE_INT("seq_len", seq_len, STEPS);
        STAGE_INT("packing", packing, DATA);
        STAGE_FIELD("passkey_fraction", passkey_fraction, DATA);
        STAGE_FIELD("long_doc_fraction", long_doc_fraction, DATA);
        STAGE_FIELD("repeat_fraction", repeat_fraction, DATA);
        STAGE_INT("passkey_length", passkey_length, DATA);
        STAGE_FIELD("rope_theta", rope_theta, "the model was trained with the old RoPE base");
        if (done) {
            STAGE_INT("tokens", tokens, "the stage is complete: its token budget is spent");
        } else {
            const int64_t in_stage = step - a->first_step;
            if (b->steps < in_stage) {
                char sa[32], sb[32], why[160];
                snprintf(sa, sizeof sa, "%lld", (long long)a->tokens);
                snprintf(sb, sizeof sb, "%lld", (long long)b->tokens);
                snprintf(why, sizeof why, "%lld tokens of the stage are already trained",
                         (long long)(in_stage * a->step_tokens));
                snprintf(f, sizeof f, "stages[%d] (%s).tokens", i, a->name);
                return runsafe(&r, f, sa, sb, why);
            }
            STAGE_INT("tokens", tokens, NULL);
        }
        STAGE_FIELD("lr", lr, NULL);
        STAGE_INT("warmup_steps", warmup_steps, NULL);
#undef STAGE_FIELD
#undef STAGE_INT
    }
    /* stages that have not started yet: logged as a change of plan */
    for (int i = 0; i < was->n_stages || i < now->n_stages; i++) {
        if (i < was->n_stages && was->stages[i].first_step < step)
            continue;
        if (i >= now->n_stages) {
            rlog(&r, "stages[%d] (%s): dropped (not started)", i, was->stages[i].name);
        } else if (i >= was->n_stages) {
            rlog(&r, "stages[%d] (%s): added (seq_len %d, %lld tokens)", i, now->stages[i].name,
                 now->stages[i].seq_len, (long long)now->stages[i].tokens);
        } else {
            const lm_train_stage *a = &was->stages[i], *b = &now->stages[i];
            if (strcmp(a->name, b->name) != 0 || a->seq_len != b->seq_len ||
                a->tokens != b->tokens || a->lr != b->lr || a->warmup_steps != b->warmup_steps ||
                a->rope_theta != b->rope_theta || a->packing != b->packing ||
                a->passkey_fraction != b->passkey_fraction ||
                a->long_doc_fraction != b->long_doc_fraction ||
                a->repeat_fraction != b->repeat_fraction || a->passkey_length != b->passkey_length)
                rlog(&r,
                     "stages[%d]: '%s' (seq_len %d, %lld tokens) -> '%s' (seq_len %d, %lld "
                     "tokens; not started)",
                     i, a->name, a->seq_len, (long long)a->tokens, b->name, b->seq_len,
                     (long long)b->tokens);
        }
    }
    /* the rest only changes how the remaining steps are run, evaluated or logged */
    static const struct {
        const char *key;
        size_t off;
    } dbl[] = {
        {"train.lr", offsetof(lm_train_config, lr)},
        {"train.min_lr_ratio", offsetof(lm_train_config, min_lr_ratio)},
        {"train.wsd_decay_frac", offsetof(lm_train_config, wsd_decay_frac)},
        {"train.weight_decay", offsetof(lm_train_config, weight_decay)},
        {"train.beta1", offsetof(lm_train_config, beta1)},
        {"train.beta2", offsetof(lm_train_config, beta2)},
        {"train.eps", offsetof(lm_train_config, eps)},
        {"train.grad_clip", offsetof(lm_train_config, grad_clip)},
    };
    for (size_t i = 0; i < sizeof dbl / sizeof dbl[0]; i++)
        LM_TRY(cmp_num(&r, dbl[i].key,
                       *(const double *)(const void *)((const char *)was + dbl[i].off),
                       *(const double *)(const void *)((const char *)now + dbl[i].off), NULL));
    if (was->schedule != now->schedule)
        rlog(&r, "train.schedule: %s -> %s", was->schedule == LM_SCHED_WSD ? "wsd" : "cosine",
             now->schedule == LM_SCHED_WSD ? "wsd" : "cosine");
    LM_TRY(CMP_I(&r, "train.log_every", was->log_every, now->log_every, NULL));
    LM_TRY(CMP_I(&r, "train.eval_every", was->eval_every, now->eval_every, NULL));
    LM_TRY(CMP_I(&r, "train.checkpoint_every", was->checkpoint_every, now->checkpoint_every, NULL));
    LM_TRY(CMP_I(&r, "train.keep_last", was->keep_last, now->keep_last, NULL));
    LM_TRY(CMP_I(&r, "train.max_bad_steps", was->max_bad_steps, now->max_bad_steps, NULL));
    LM_TRY(CMP_I(&r, "train.threads", was->threads, now->threads, NULL));
    if (was->n_recompute != now->n_recompute ||
        memcmp(was->recompute, now->recompute, sizeof was->recompute) != 0)
        rlog(&r, "train.recompute: %d -> %d layers", was->n_recompute, now->n_recompute);
    LM_TRY(cmp_str(&r, "data.val", was->val_path, now->val_path, NULL));
    LM_TRY(CMP_I(&r, "eval.seq_len", was->eval_seq_len, now->eval_seq_len, NULL));
    if (was->n_passkey_lengths != now->n_passkey_lengths ||
        memcmp(was->passkey_lengths, now->passkey_lengths,
               sizeof(int) * (size_t)was->n_passkey_lengths) != 0) {
        char sa[256], sb[256];
        fmt_list(sa, sizeof sa, was->passkey_lengths, was->n_passkey_lengths);
        fmt_list(sb, sizeof sb, now->passkey_lengths, now->n_passkey_lengths);
        rlog(&r, "eval.passkey_lengths: %s -> %s", sa, sb);
    }
    LM_TRY(CMP_I(&r, "eval.passkey_samples", was->passkey_samples, now->passkey_samples, NULL));
    LM_TRY(cmp_int(&r, "eval.passkey_seed", was->passkey_seed, now->passkey_seed, 0, NULL));
    LM_TRY(CMP_I(&r, "eval.max_val_tokens", was->max_val_tokens, now->max_val_tokens, NULL));
    if (was->total_steps != now->total_steps)
        rlog(&r, "total: %lld -> %lld steps", (long long)was->total_steps,
             (long long)now->total_steps);
    return LM_OK;
}
