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
#include "eval/eval_internal.h"

#define GPU_EVAL_MAX_ROWS 256

static const char *shard_name(const lm_shard *s) { return s && s->path ? s->path : "(unnamed)"; }

typedef struct {
    lm_gpu_model *m;
    const lm_shard *val;
    int32_t eot;
    int32_t *ids, *labels;
    float *nll;
    double sum;
    int64_t tokens;
} gstate;

/* Score windows w[0 .. nb) as one [nb, T] batch (lm_eval_score_fn). */
static lm_status score(void *ctx, const lm_eval_window *w, int nb, lm_error *err) {
    gstate *s = ctx;
    const int T = lm_eval_fill_windows(s->val, s->eot, w, nb, s->ids, s->labels);
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
    const int64_t rows = lm_gpu_model_max_tokens(m) / seq_len;
    int cap = rows < 1 ? 1 : rows > GPU_EVAL_MAX_ROWS ? GPU_EVAL_MAX_ROWS : (int)rows;
    gstate s = {m, val, lm_tokenizer_eot(tok), NULL, NULL, NULL, 0, 0};
    s.ids = malloc((size_t)cap * seq_len * sizeof(int32_t));
    s.labels = malloc((size_t)cap * seq_len * sizeof(int32_t));
    s.nll = malloc((size_t)cap * seq_len * sizeof(float));
    lm_status st = LM_OK;
    if (!s.ids || !s.labels || !s.nll)
        st = lm_errorf(err, LM_ERR_NOMEM, "eval: cannot allocate a batch of %d x %d tokens", cap,
                       seq_len);
    if (st == LM_OK)
        st = lm_eval_bpb_walk(tok, val, lm_gpu_model_config(m)->vocab_size, seq_len, &cap, score,
                              &s, out, err);
    free(s.ids);
    free(s.labels);
    free(s.nll);
    if (st != LM_OK) {
        memset(out, 0, sizeof(*out));
        return st;
    }
    out->nll_nats = s.sum;
    out->tokens = s.tokens;
    out->bits_per_byte = out->bytes > 0 ? s.sum / log(2.0) / (double)out->bytes : NAN;
    return LM_OK;
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
                if (lm_eval_argmax(logits + j * V, V) != d.ids[d.answer_pos + j]) {
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
