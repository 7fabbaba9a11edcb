/* Evals (eval.h): bits per byte under the pinned window protocol, passkey accuracy by
 * greedy decoding with the inference cache, MoE balance and AttnRes summaries, and the
 * JSON report of `linmoe eval`. */
#include "linmoe/eval.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eval/eval_internal.h"
#include "linmoe/passkey.h"

#define EVAL_MAX_ROWS 256
#define EVAL_MAX_BATCH_TOKENS ((int64_t)1 << 20)

static const char *shard_name(const lm_shard *s) { return s && s->path ? s->path : "(unnamed)"; }

void lm_eval_stats_free(lm_eval_stats *s) {
    if (!s)
        return;
    free(s->expert_counts);
    free(s->n_sources);
    free(s->attnres_weights);
    memset(s, 0, sizeof(*s));
}

void lm_eval_balance(const int64_t *counts, int E, double *maxvio, double *min_load, int *dead,
                     double *load) {
    double sum = 0, mx = 0, mn = 0;
    int nd = 0;
    for (int e = 0; e < E; e++) {
        const double c = (double)counts[e];
        sum += c;
        if (e == 0 || c > mx)
            mx = c;
        if (e == 0 || c < mn)
            mn = c;
        nd += counts[e] == 0;
    }
    if (sum <= 0) {
        *maxvio = 0;
        *min_load = 0;
        *dead = E;
        if (load)
            for (int e = 0; e < E; e++)
                load[e] = 0;
        return;
    }
    const double mean = sum / E;
    *maxvio = mx / mean - 1;
    *min_load = mn / mean;
    *dead = nd;
    if (load)
        for (int e = 0; e < E; e++)
            load[e] = (double)counts[e] / sum;
}

/* ---------------------------------------------------------------- bits per byte */

typedef lm_eval_window window;

typedef struct {
    lm_model *m;
    const lm_shard *val;
    int32_t eot;
    int rows; /* current batch-row budget (halved when the model refuses) */
    int32_t *ids, *labels;
    double nll;
    int64_t tokens;
    lm_eval_stats *stats;
    double attn_positions; /* sum of B*T over batches, for the AttnRes average */
    double *attn_tmp;
    /* lm_eval_bpb_part: this rank scores the windows whose index in the walk's order is
     * rank mod world (the batch boundaries may differ between ranks; window indices do
     * not), compacted into sub */
    int rank, world;
    int64_t widx;
    window *sub;
    const lm_eval_options *po; /* progress (lm_eval_report), or NULL */
} bpb_state;

static lm_status stats_init(lm_eval_stats *s, const lm_model_config *c, lm_error *err) {
    memset(s, 0, sizeof(*s));
    s->n_layers = c->num_hidden_layers;
    int any_moe = 0;
    for (int i = 0; i < c->num_hidden_layers; i++)
        any_moe |= lm_model_layer_is_moe(c, i);
    if (any_moe) {
        s->n_experts = c->moe.router.num_experts;
        s->expert_counts = calloc((size_t)s->n_layers * s->n_experts, sizeof(int64_t));
        if (!s->expert_counts)
            goto nomem;
    }
    if (c->residual != LM_RES_STANDARD) {
        s->n_sublayers = 2 * c->num_hidden_layers + 1;
        s->max_sources = 2 * c->num_hidden_layers + 2;
        s->n_sources = calloc((size_t)s->n_sublayers, sizeof(int));
        s->attnres_weights = calloc((size_t)s->n_sublayers * s->max_sources, sizeof(double));
        if (!s->n_sources || !s->attnres_weights)
            goto nomem;
    }
    return LM_OK;
nomem:
    lm_eval_stats_free(s);
    return lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate the statistics");
}

/* Statistics of the batch just run: expert selections of the scored tokens, AttnRes
 * weights (position-weighted). */
static void stats_add(bpb_state *s, const window *w, int nb, int T) {
    lm_eval_stats *st = s->stats;
    if (!st)
        return;
    if (st->expert_counts) {
        for (int i = 0; i < st->n_layers; i++) {
            const lm_route *r = lm_model_route(s->m, i);
            if (!r || r->T != nb * T)
                continue;
            int64_t *cnt = st->expert_counts + (int64_t)i * st->n_experts;
            for (int b = 0; b < nb; b++)
                for (int j = 0; j < w[b].len; j++) {
                    const int64_t *idx = r->topk_idx + ((int64_t)b * T + j) * r->k;
                    for (int kk = 0; kk < r->k; kk++)
                        if (idx[kk] >= 0 && idx[kk] < st->n_experts)
                            cnt[idx[kk]]++;
                }
        }
    }
    if (st->n_sublayers > 0) {
        const double np = (double)nb * T;
        for (int l = 0; l < st->n_sublayers; l++) {
            const int ns = lm_model_attnres_weights(s->m, l, s->attn_tmp, st->max_sources);
            if (ns <= 0)
                continue;
            st->n_sources[l] = ns;
            for (int j = 0; j < ns; j++)
                st->attnres_weights[l * st->max_sources + j] += s->attn_tmp[j] * np;
        }
        s->attn_positions += np;
    }
}

/* Score nb windows as one [nb, T] batch; when the model refuses the batch (B*T >
 * max_tokens, or any other LM_ERR_INVALID) and nb > 1, shrink the row budget and
 * score the two halves separately. */
static lm_status run_windows(bpb_state *s, const window *w, int nb, lm_error *err) {
    const int T = lm_eval_fill_windows(s->val, s->eot, w, nb, s->ids, s->labels);
    lm_model_batch batch = {nb, T, NULL, 0};
    double loss = 0;
    int64_t cnt = 0;
    lm_error e2 = {0};
    lm_status st =
        lm_model_forward(s->m, &batch, s->ids, s->labels, 0, NULL, &loss, &cnt, nb > 1 ? &e2 : err);
    if (st == LM_ERR_INVALID && nb > 1) {
        const int half = nb / 2;
        if (s->rows > half)
            s->rows = half;
        LM_TRY(run_windows(s, w, half, err));
        return run_windows(s, w + half, nb - half, err);
    }
    if (st != LM_OK) {
        char buf[sizeof(err->msg)];
        snprintf(buf, sizeof buf, "%s", nb > 1 ? e2.msg : (err ? err->msg : ""));
        return lm_errorf(err, st, "eval: bits per byte on %s, window at token %llu (%d tokens): %s",
                         shard_name(s->val), (unsigned long long)w[0].start, w[0].len, buf);
    }
    /* the model's loss is mean CE + the routers' aux losses: take those out again */
    const lm_model_config *c = &lm_model_params(s->m)->cfg;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        const lm_route *r = lm_model_route(s->m, i);
        if (lm_model_layer_is_moe(c, i) && r)
            loss -= (double)r->aux_loss;
    }
    s->nll += loss * (double)cnt;
    s->tokens += cnt;
    stats_add(s, w, nb, T);
    if (s->po && s->po->progress)
        s->po->progress(s->po->progress_ctx, "bits per byte", 0, s->tokens, (int64_t)s->val->count);
    return LM_OK;
}

static lm_status score_cb(void *ctx, const lm_eval_window *w, int nb, lm_error *err) {
    bpb_state *s = ctx;
    if (s->world <= 1)
        return run_windows(s, w, nb, err);
    int n = 0;
    for (int b = 0; b < nb; b++, s->widx++)
        if (s->widx % s->world == s->rank)
            s->sub[n++] = w[b];
    return n > 0 ? run_windows(s, s->sub, n, err) : LM_OK;
}

int lm_eval_fill_windows(const lm_shard *val, int32_t eot, const lm_eval_window *w, int nb,
                         int32_t *ids, int32_t *labels) {
    int T = 1;
    for (int b = 0; b < nb; b++)
        if (w[b].len > T)
            T = w[b].len;
    for (int b = 0; b < nb; b++) {
        int32_t *id = ids + (int64_t)b * T, *lb = labels + (int64_t)b * T;
        id[0] = eot;
        for (int j = 0; j < w[b].len; j++) {
            const int32_t t = lm_shard_get(val, w[b].start + (uint64_t)j);
            lb[j] = t;
            if (j + 1 < T)
                id[j + 1] = t;
        }
        for (int j = w[b].len; j < T; j++) {
            lb[j] = LM_MODEL_IGNORE;
            if (j + 1 < T)
                id[j + 1] = eot;
        }
    }
    return T;
}

lm_status lm_eval_bpb_walk(const lm_tokenizer *tok, const lm_shard *val, int model_vocab,
                           int seq_len, int *rows, lm_eval_score_fn score, void *ctx,
                           lm_eval_bpb_result *out, lm_error *err) {
    if (seq_len < 2)
        return lm_errorf(err, LM_ERR_INVALID, "eval: seq_len = %d (want >= 2)", seq_len);
    if (val->count == 0 || !val->tokens)
        return lm_errorf(err, LM_ERR_INVALID, "eval: validation shard %s is empty",
                         shard_name(val));
    const int tv = lm_tokenizer_vocab_size(tok);
    if ((int64_t)val->vocab != tv)
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: validation shard %s has vocab %u but the %s tokenizer has %d",
                         shard_name(val), val->vocab, lm_tokenizer_name(tok), tv);
    if (tv > model_vocab)
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: the %s tokenizer's vocab %d exceeds the model's vocab_size %d",
                         lm_tokenizer_name(tok), tv, model_vocab);
    /* bytes of each token when decoded (decoding is a concatenation per token) */
    int32_t *nbytes = malloc((size_t)tv * sizeof(int32_t));
    window *pend = malloc((size_t)(*rows > 0 ? *rows : 1) * sizeof(window));
    if (!nbytes || !pend) {
        free(nbytes);
        free(pend);
        return lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate %d entries", tv);
    }
    const int32_t eot = lm_tokenizer_eot(tok);
    lm_status st = LM_OK;
    for (int32_t v = 0; v < tv && st == LM_OK; v++) {
        char *txt = NULL;
        size_t len = 0;
        if (v == eot) {
            nbytes[v] = 0;
            continue;
        }
        st = lm_tokenizer_decode(tok, &v, 1, &txt, &len, err);
        free(txt);
        nbytes[v] = (int32_t)len;
    }
    int np = 0;
    uint64_t doc_start = 0;
    int64_t bytes = 0;
    for (uint64_t i = 0; st == LM_OK && i <= val->count; i++) {
        const int32_t t = i < val->count ? lm_shard_get(val, i) : eot;
        if (t != eot) {
            if (t < 0 || t >= tv)
                st = lm_errorf(err, LM_ERR_INVALID,
                               "eval: validation shard %s: token %llu = %d is outside [0, %d)",
                               shard_name(val), (unsigned long long)i, t, tv);
            else
                bytes += nbytes[t];
            continue;
        }
        /* document [doc_start, i) */
        if (i > doc_start)
            out->documents++;
        for (uint64_t w0 = doc_start; st == LM_OK && w0 < i; w0 += (uint64_t)seq_len) {
            const uint64_t left = i - w0;
            pend[np].start = w0;
            pend[np].len = left < (uint64_t)seq_len ? (int)left : seq_len;
            np++;
            out->windows++;
            if (np >= *rows) {
                st = score(ctx, pend, np, err);
                np = 0;
            }
        }
        doc_start = i + 1;
    }
    if (st == LM_OK && np > 0)
        st = score(ctx, pend, np, err);
    if (st == LM_OK && out->windows == 0)
        st = lm_errorf(err, LM_ERR_INVALID,
                       "eval: validation shard %s holds no document (only <|endoftext|>)",
                       shard_name(val));
    free(nbytes);
    free(pend);
    out->bytes = bytes;
    return st;
}

static lm_status bpb_run(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                         int rank, int world, lm_eval_bpb_result *out, lm_eval_stats *stats,
                         const lm_eval_options *po, lm_error *err) {
    if (!m || !tok || !val || !out)
        return lm_errorf(err, LM_ERR_INVALID, "eval: NULL model, tokenizer, shard or result");
    if (world < 1 || rank < 0 || rank >= world)
        return lm_errorf(err, LM_ERR_INVALID, "eval: rank %d of %d", rank, world);
    memset(out, 0, sizeof(*out));
    if (stats)
        memset(stats, 0, sizeof(*stats));
    const lm_model_config *c = &lm_model_params(m)->cfg;
    bpb_state s = {0};
    s.m = m;
    s.val = val;
    s.po = po;
    s.eot = lm_tokenizer_eot(tok);
    const int64_t rows = EVAL_MAX_BATCH_TOKENS / (seq_len > 1 ? seq_len : 1);
    s.rows = rows < 1 ? 1 : rows > EVAL_MAX_ROWS ? EVAL_MAX_ROWS : (int)rows;
    const int cap_rows = s.rows;
    const size_t cap_tokens = (size_t)cap_rows * (size_t)(seq_len > 1 ? seq_len : 1);
    s.ids = malloc(cap_tokens * sizeof(int32_t));
    s.labels = malloc(cap_tokens * sizeof(int32_t));
    s.rank = rank;
    s.world = world;
    s.sub = world > 1 ? malloc((size_t)cap_rows * sizeof(window)) : NULL;
    lm_status st = LM_OK;
    if (!s.ids || !s.labels || (world > 1 && !s.sub))
        st = lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate a batch of %d x %d tokens",
                       cap_rows, seq_len);
    if (st == LM_OK && stats) {
        st = stats_init(stats, c, err);
        s.stats = stats;
        if (st == LM_OK && stats->max_sources > 0) {
            s.attn_tmp = calloc((size_t)stats->max_sources, sizeof(double));
            if (!s.attn_tmp)
                st = lm_errorf(err, LM_ERR_NOMEM, "eval: out of memory");
        }
    }
    if (st == LM_OK)
        st = lm_eval_bpb_walk(tok, val, c->vocab_size, seq_len, &s.rows, score_cb, &s, out, err);
    if (st == LM_OK && stats && stats->n_sublayers > 0 && s.attn_positions > 0)
        for (int64_t j = 0; j < (int64_t)stats->n_sublayers * stats->max_sources; j++)
            stats->attnres_weights[j] /= s.attn_positions;
    free(s.ids);
    free(s.labels);
    free(s.attn_tmp);
    free(s.sub);
    if (st != LM_OK) {
        if (stats)
            lm_eval_stats_free(stats);
        memset(out, 0, sizeof(*out));
        return st;
    }
    out->nll_nats = s.nll;
    out->tokens = s.tokens;
    out->bits_per_byte = out->bytes > 0 ? s.nll / log(2.0) / (double)out->bytes : NAN;
    return LM_OK;
}

lm_status lm_eval_bpb_stats(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                            lm_eval_bpb_result *out, lm_eval_stats *stats, lm_error *err) {
    return bpb_run(m, tok, val, seq_len, 0, 1, out, stats, NULL, err);
}

lm_status lm_eval_bpb(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                      lm_eval_bpb_result *out, lm_error *err) {
    return lm_eval_bpb_stats(m, tok, val, seq_len, out, NULL, err);
}

lm_status lm_eval_bpb_part(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                           int rank, int world, lm_eval_bpb_result *out, lm_error *err) {
    return bpb_run(m, tok, val, seq_len, rank, world, out, NULL, NULL, err);
}

/* ---------------------------------------------------------------- passkey */

int32_t lm_eval_argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i])))
            best = i;
    return best;
}

/* Prefill ids[0 .. n) in chunks of *chunk tokens from a fresh cache, leaving the
 * last token's logits. A refused chunk (LM_ERR_INVALID) halves *chunk and starts
 * over from a reset cache (a failed call may leave the cache unusable). */
static lm_status prefill(lm_model *m, lm_model_cache *c, const int32_t *ids, int64_t n, int *chunk,
                         float *logits, lm_error *err) {
    for (;;) {
        lm_model_cache_reset(c);
        lm_status st = LM_OK;
        lm_error e2 = {0};
        for (int64_t p = 0; p < n && st == LM_OK;) {
            const int T = n - p < *chunk ? (int)(n - p) : *chunk;
            st = lm_model_infer(m, c, ids + p, T, 1, logits, *chunk > 1 ? &e2 : err);
            p += T;
        }
        if (st == LM_OK)
            return LM_OK;
        if (st != LM_ERR_INVALID || *chunk <= 1) {
            if (*chunk > 1 && err)
                *err = e2;
            return st;
        }
        *chunk /= 2;
    }
}

static lm_status passkey_run(lm_model *m, lm_tokenizer *tok, const lm_shard *filler, int length,
                             int samples, uint64_t seed, int rank, int world,
                             lm_eval_passkey_result *out, const lm_eval_options *po,
                             lm_error *err) {
    if (!m || !tok || !filler || !out)
        return lm_errorf(err, LM_ERR_INVALID, "eval: NULL model, tokenizer, filler or result");
    if (world < 1 || rank < 0 || rank >= world)
        return lm_errorf(err, LM_ERR_INVALID, "eval: rank %d of %d", rank, world);
    memset(out, 0, sizeof(*out));
    if (samples < 1)
        return lm_errorf(err, LM_ERR_INVALID, "eval: passkey samples = %d (want >= 1)", samples);
    if (length < 1)
        return lm_errorf(err, LM_ERR_INVALID, "eval: passkey length = %d (want >= 1)", length);
    const int V = lm_model_params(m)->cfg.vocab_size;
    const int tv = lm_tokenizer_vocab_size(tok);
    if (tv > V)
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: the %s tokenizer's vocab %d exceeds the model's vocab_size %d",
                         lm_tokenizer_name(tok), tv, V);
    lm_model_cache *c = NULL;
    LM_TRY(lm_model_cache_new(&c, m, 1, length, err));
    float *logits = malloc((size_t)V * sizeof(float));
    if (!logits) {
        lm_model_cache_free(c);
        return lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate %d logits", V);
    }
    lm_status st = LM_OK;
    int chunk = length, correct = 0, mine = 0;
    for (int s = 0; s < samples && st == LM_OK; s++) {
        if (s % world != rank)
            continue;
        mine++;
        lm_passkey_doc d;
        st = lm_passkey_make(tok, filler, length, seed, (uint64_t)s, &d, err);
        if (st != LM_OK)
            break;
        st = prefill(m, c, d.ids, d.answer_pos, &chunk, logits, err);
        int ok = 1;
        int64_t prefix = 0;
        for (int64_t p = d.answer_pos; st == LM_OK && p < d.digits_end; p++) {
            int32_t pred = lm_eval_argmax(logits, V);
            if (pred != d.ids[p]) {
                ok = 0;
                break;
            }
            prefix++;
            if (p + 1 < d.digits_end)
                st = lm_model_infer(m, c, &pred, 1, 1, logits, err);
        }
        if (st == LM_OK) {
            correct += ok;
            out->answer_tokens += d.digits_end - d.answer_pos;
            out->prefix_tokens += prefix;
        }
        lm_passkey_doc_free(&d);
        if (st == LM_OK && po && po->progress)
            po->progress(po->progress_ctx, "passkey", length, s + 1, samples);
    }
    free(logits);
    lm_model_cache_free(c);
    if (st != LM_OK) {
        memset(out, 0, sizeof(*out));
        return st;
    }
    out->length = length;
    out->samples = mine;
    out->correct = correct;
    out->accuracy = mine > 0 ? (double)correct / mine : NAN;
    return LM_OK;
}

lm_status lm_eval_passkey(lm_model *m, lm_tokenizer *tok, const lm_shard *filler, int length,
                          int samples, uint64_t seed, lm_eval_passkey_result *out, lm_error *err) {
    return passkey_run(m, tok, filler, length, samples, seed, 0, 1, out, NULL, err);
}

lm_status lm_eval_passkey_part(lm_model *m, lm_tokenizer *tok, const lm_shard *filler, int length,
                               int samples, uint64_t seed, int rank, int world,
                               lm_eval_passkey_result *out, lm_error *err) {
    return passkey_run(m, tok, filler, length, samples, seed, rank, world, out, NULL, err);
}

/* ---------------------------------------------------------------- report */

static int add_num(cJSON *o, const char *k, double v) {
    return (isfinite(v) ? cJSON_AddNumberToObject(o, k, v) : cJSON_AddNullToObject(o, k)) != NULL;
}

static int add_arr_item(cJSON *a, cJSON *item) {
    if (!item)
        return 0;
    if (!cJSON_AddItemToArray(a, item)) {
        cJSON_Delete(item);
        return 0;
    }
    return 1;
}

static cJSON *num_item(double v) {
    return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull();
}

lm_status lm_eval_report(lm_model *m, lm_tokenizer *tok, const lm_shard *val,
                         const lm_eval_options *o, struct cJSON *obj, lm_error *err) {
    if (!o || !obj)
        return lm_errorf(err, LM_ERR_INVALID, "eval: NULL options or JSON object");
    if (o->n_passkey < 0 || (o->n_passkey > 0 && !o->passkey_lengths))
        return lm_errorf(err, LM_ERR_INVALID, "eval: %d passkey lengths given without a list",
                         o->n_passkey);
    lm_eval_bpb_result r;
    lm_eval_stats stats = {0};
    LM_TRY(bpb_run(m, tok, val, o->seq_len, 0, 1, &r, &stats, o, err));
    lm_eval_passkey_result *pk = NULL;
    lm_status st = LM_OK;
    if (o->n_passkey > 0) {
        pk = calloc((size_t)o->n_passkey, sizeof(*pk));
        if (!pk)
            st = lm_errorf(err, LM_ERR_NOMEM, "eval: out of memory");
    }
    for (int i = 0; st == LM_OK && i < o->n_passkey; i++)
        st = passkey_run(m, tok, o->filler ? o->filler : val, o->passkey_lengths[i],
                         o->passkey_samples, o->passkey_seed, 0, 1, &pk[i], o, err);
    if (st != LM_OK) {
        free(pk);
        lm_eval_stats_free(&stats);
        return st;
    }
    int ok = cJSON_AddNumberToObject(obj, "seq_len", o->seq_len) != NULL &&
             add_num(obj, "bits_per_byte", r.bits_per_byte) &&
             add_num(obj, "nll_nats", r.nll_nats) &&
             cJSON_AddNumberToObject(obj, "bytes", (double)r.bytes) != NULL &&
             cJSON_AddNumberToObject(obj, "tokens", (double)r.tokens) != NULL &&
             cJSON_AddNumberToObject(obj, "windows", (double)r.windows) != NULL &&
             cJSON_AddNumberToObject(obj, "documents", (double)r.documents) != NULL;
    cJSON *a = ok ? cJSON_AddArrayToObject(obj, "passkey") : NULL;
    ok = ok && a;
    for (int i = 0; ok && i < o->n_passkey; i++) {
        cJSON *e = cJSON_CreateObject();
        ok = add_arr_item(a, e) && cJSON_AddNumberToObject(e, "length", pk[i].length) &&
             cJSON_AddNumberToObject(e, "samples", pk[i].samples) &&
             cJSON_AddNumberToObject(e, "correct", pk[i].correct) &&
             add_num(e, "accuracy", pk[i].accuracy) &&
             cJSON_AddNumberToObject(e, "answer_tokens", (double)pk[i].answer_tokens) &&
             cJSON_AddNumberToObject(e, "prefix_tokens", (double)pk[i].prefix_tokens);
    }
    const lm_model_config *c = &lm_model_params(m)->cfg;
    a = ok ? cJSON_AddArrayToObject(obj, "moe") : NULL;
    ok = ok && a;
    double *load = stats.n_experts > 0 ? calloc((size_t)stats.n_experts, sizeof(double)) : NULL;
    for (int i = 0; ok && stats.expert_counts && i < stats.n_layers; i++) {
        if (!lm_model_layer_is_moe(c, i))
            continue;
        double maxvio, min_load;
        int dead;
        ok = load != NULL;
        if (!ok)
            break;
        lm_eval_balance(stats.expert_counts + (int64_t)i * stats.n_experts, stats.n_experts,
                        &maxvio, &min_load, &dead, load);
        cJSON *e = cJSON_CreateObject();
        ok = add_arr_item(a, e) && cJSON_AddNumberToObject(e, "layer", i + 1) &&
             add_num(e, "maxvio", maxvio) && add_num(e, "min_load", min_load) &&
             cJSON_AddNumberToObject(e, "dead", dead);
        cJSON *la = ok ? cJSON_AddArrayToObject(e, "load") : NULL;
        ok = ok && la;
        for (int j = 0; ok && j < stats.n_experts; j++)
            ok = add_arr_item(la, num_item(load[j]));
    }
    free(load);
    if (ok && stats.n_sublayers > 0) {
        a = cJSON_AddArrayToObject(obj, "attnres");
        ok = a != NULL;
        for (int l = 0; ok && l < stats.n_sublayers; l++) {
            cJSON *e = cJSON_CreateObject();
            ok = add_arr_item(a, e) && cJSON_AddNumberToObject(e, "sublayer", l);
            cJSON *wa = ok ? cJSON_AddArrayToObject(e, "weights") : NULL;
            ok = ok && wa;
            for (int j = 0; ok && j < stats.n_sources[l]; j++)
                ok = add_arr_item(wa, num_item(stats.attnres_weights[l * stats.max_sources + j]));
        }
    }
    free(pk);
    lm_eval_stats_free(&stats);
    if (!ok)
        return lm_errorf(err, LM_ERR_NOMEM, "eval: out of memory building the JSON report");
    return LM_OK;
}
