/* Bits per byte and passkey accuracy with the GPU model (include/linmoe/eval.h,
 * lm_eval_bpb_gpu / lm_eval_passkey_gpu): the protocols of src/eval/eval.c on
 * lm_gpu_model_eval, so `linmoe train --device cuda` evaluates where it trains. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/eval.h"
#include "linmoe/gpu_model.h"
#include "linmoe/passkey.h"

#define GPU_EVAL_MAX_ROWS 256

static const char *shard_name(const lm_shard *s) { return s && s->path ? s->path : "(unnamed)"; }

typedef struct {
    uint64_t start; /* shard index of w_0 */
    int len;
} gwin;

typedef struct {
    lm_gpu_model *m;
    const lm_shard *val;
    int32_t eot;
    int32_t *ids, *labels;
    float *nll;
    double sum;
    int64_t tokens;
} gstate;

/* Score windows w[0 .. nb) as one [nb, T] batch (eval.c run_windows' layout). */
static lm_status score(gstate *s, const gwin *w, int nb, lm_error *err) {
    int T = 1;
    for (int b = 0; b < nb; b++)
        if (w[b].len > T)
            T = w[b].len;
    for (int b = 0; b < nb; b++) {
        int32_t *id = s->ids + (int64_t)b * T, *lb = s->labels + (int64_t)b * T;
        id[0] = s->eot;
        for (int j = 0; j < w[b].len; j++) {
            const int32_t t = lm_shard_get(s->val, w[b].start + (uint64_t)j);
            lb[j] = t;
            if (j + 1 < T)
                id[j + 1] = t;
        }
        for (int j = w[b].len; j < T; j++) {
            lb[j] = LM_MODEL_IGNORE;
            if (j + 1 < T)
                id[j + 1] = s->eot;
        }
    }
    lm_model_batch batch = {nb, T, NULL, 0};
    lm_status st = lm_gpu_model_eval(s->m, &batch, s->ids, s->labels, 0, s->nll, err);
    if (st != LM_OK) {
        char buf[sizeof(err->msg)];
        snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
        return lm_errorf(err, st, "eval: bits per byte on %s, window at token %llu: %s",
                         shard_name(s->val), (unsigned long long)w[0].start, buf);
    }
    for (int64_t n = 0; n < (int64_t)nb * T; n++) {
        if (s->labels[n] == LM_MODEL_IGNORE)
            continue;
        if (!isfinite(s->nll[n]))
            return lm_errorf(err, LM_ERR_NONFINITE,
                             "eval: bits per byte on %s: non-finite nll %g at window token %lld",
                             shard_name(s->val), (double)s->nll[n], (long long)n);
        s->sum += s->nll[n];
        s->tokens++;
    }
    return LM_OK;
}

lm_status lm_eval_bpb_gpu(lm_gpu_model *m, const lm_tokenizer *tok, const lm_shard *val,
                          int seq_len, lm_eval_bpb_result *out, lm_error *err) {
    if (!m || !tok || !val || !out)
        return lm_errorf(err, LM_ERR_INVALID, "eval: NULL model, tokenizer, shard or result");
    memset(out, 0, sizeof(*out));
    if (seq_len < 2 || seq_len > lm_gpu_model_max_tokens(m))
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: seq_len = %d (want 2 .. the GPU model's max_tokens = %lld)",
                         seq_len, (long long)lm_gpu_model_max_tokens(m));
    if (val->count == 0 || !val->tokens)
        return lm_errorf(err, LM_ERR_INVALID, "eval: validation shard %s is empty",
                         shard_name(val));
    const int tv = lm_tokenizer_vocab_size(tok);
    const lm_model_config *c = lm_gpu_model_config(m);
    if ((int64_t)val->vocab != tv)
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: validation shard %s has vocab %u but the %s tokenizer has %d",
                         shard_name(val), val->vocab, lm_tokenizer_name(tok), tv);
    if (tv > c->vocab_size)
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: the %s tokenizer's vocab %d exceeds the model's vocab_size %d",
                         lm_tokenizer_name(tok), tv, c->vocab_size);
    const int32_t eot = lm_tokenizer_eot(tok);
    int32_t *nbytes = malloc((size_t)tv * sizeof(int32_t));
    if (!nbytes)
        return lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate %d entries", tv);
    for (int32_t v = 0; v < tv; v++) {
        char *txt = NULL;
        size_t len = 0;
        if (v == eot) {
            nbytes[v] = 0;
            continue;
        }
        lm_status st = lm_tokenizer_decode(tok, &v, 1, &txt, &len, err);
        if (st != LM_OK) {
            free(nbytes);
            return st;
        }
        free(txt);
        nbytes[v] = (int32_t)len;
    }
    int64_t rows = lm_gpu_model_max_tokens(m) / seq_len;
    const int cap = rows < 1 ? 1 : rows > GPU_EVAL_MAX_ROWS ? GPU_EVAL_MAX_ROWS : (int)rows;
    gstate s = {m, val, eot, NULL, NULL, NULL, 0, 0};
    s.ids = malloc((size_t)cap * seq_len * sizeof(int32_t));
    s.labels = malloc((size_t)cap * seq_len * sizeof(int32_t));
    s.nll = malloc((size_t)cap * seq_len * sizeof(float));
    gwin *pend = malloc((size_t)cap * sizeof(gwin));
    lm_status st = LM_OK;
    if (!s.ids || !s.labels || !s.nll || !pend)
        st = lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate a batch of %d x %d tokens", cap,
                       seq_len);
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
        if (i > doc_start)
            out->documents++;
        for (uint64_t w0 = doc_start; st == LM_OK && w0 < i; w0 += (uint64_t)seq_len) {
            const uint64_t left = i - w0;
            pend[np].start = w0;
            pend[np].len = left < (uint64_t)seq_len ? (int)left : seq_len;
            np++;
            out->windows++;
            if (np >= cap) {
                st = score(&s, pend, np, err);
                np = 0;
            }
        }
        doc_start = i + 1;
    }
    if (st == LM_OK && np > 0)
        st = score(&s, pend, np, err);
    if (st == LM_OK && out->windows == 0)
        st = lm_errorf(err, LM_ERR_INVALID,
                       "eval: validation shard %s holds no document (only <|endoftext|>)",
                       shard_name(val));
    free(nbytes);
    free(s.ids);
    free(s.labels);
    free(s.nll);
    free(pend);
    if (st != LM_OK) {
        memset(out, 0, sizeof(*out));
        return st;
    }
    out->nll_nats = s.sum;
    out->tokens = s.tokens;
    out->bytes = bytes;
    out->bits_per_byte = bytes > 0 ? s.sum / log(2.0) / (double)bytes : NAN;
    return LM_OK;
}

static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i])))
            best = i;
    return best;
}

lm_status lm_eval_passkey_gpu(lm_gpu_model *m, lm_tokenizer *tok, const lm_shard *filler,
                              int length, int samples, uint64_t seed, lm_eval_passkey_result *out,
                              lm_error *err) {
    if (!m || !tok || !filler || !out)
        return lm_errorf(err, LM_ERR_INVALID, "eval: NULL model, tokenizer, filler or result");
    memset(out, 0, sizeof(*out));
    if (samples < 1)
        return lm_errorf(err, LM_ERR_INVALID, "eval: passkey samples = %d (want >= 1)", samples);
    if (length < 2 || length > lm_gpu_model_max_tokens(m))
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: passkey length = %d (want 2 .. the GPU model's max_tokens = %lld)",
                         length, (long long)lm_gpu_model_max_tokens(m));
    const int V = lm_gpu_model_config(m)->vocab_size;
    const int tv = lm_tokenizer_vocab_size(tok);
    if (tv > V)
        return lm_errorf(err, LM_ERR_INVALID,
                         "eval: the %s tokenizer's vocab %d exceeds the model's vocab_size %d",
                         lm_tokenizer_name(tok), tv, V);
    int32_t *labels = malloc(sizeof(int32_t) * (size_t)length);
    float *logits = malloc(sizeof(float) * (size_t)LM_GPU_MODEL_LOGIT_ROWS * V);
    if (!labels || !logits) {
        free(labels);
        free(logits);
        return lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate the passkey buffers");
    }
    lm_status st = LM_OK;
    int correct = 0;
    for (int smp = 0; smp < samples && st == LM_OK; smp++) {
        lm_passkey_doc d;
        st = lm_passkey_make(tok, filler, length, seed, (uint64_t)smp, &d, err);
        if (st != LM_OK)
            break;
        /* one forward over ids[0 .. T), T = digits_end: row p - 1 predicts ids[p] */
        const int T = (int)d.digits_end;
        const int64_t first = d.answer_pos - 1, n_ans = d.digits_end - d.answer_pos;
        if (first < 0 || n_ans < 1 || n_ans > LM_GPU_MODEL_LOGIT_ROWS) {
            st = lm_errorf(err, LM_ERR_INVALID,
                           "eval: passkey document %d: answer at %lld .. %lld cannot be scored", smp,
                           (long long)d.answer_pos, (long long)d.digits_end);
            lm_passkey_doc_free(&d);
            break;
        }
        for (int p = 0; p < T; p++)
            labels[p] = p + 1 < T ? d.ids[p + 1] : LM_MODEL_IGNORE;
        lm_model_batch batch = {1, T, NULL, 0};
        st = lm_gpu_model_eval(m, &batch, d.ids, labels, 0, NULL, err);
        if (st == LM_OK)
            st = lm_gpu_model_logits_rows(m, first, (int)n_ans, logits, err);
        if (st == LM_OK) {
            int64_t prefix = 0;
            int ok = 1;
            for (int64_t j = 0; j < n_ans; j++) {
                if (argmax(logits + j * V, V) != d.ids[d.answer_pos + j]) {
                    ok = 0;
                    break;
                }
                prefix++;
            }
            correct += ok;
            out->answer_tokens += n_ans;
            out->prefix_tokens += prefix;
        }
        lm_passkey_doc_free(&d);
    }
    free(labels);
    free(logits);
    if (st != LM_OK) {
        memset(out, 0, sizeof(*out));
        return st;
    }
    out->length = length;
    out->samples = samples;
    out->correct = correct;
    out->accuracy = (double)correct / samples;
    return LM_OK;
}
