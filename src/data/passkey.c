/* Passkey documents (passkey.h; reference/attnres_ctx.md §2.2; Mohtashami & Jaggi 2023).
 *
 * Layout of document `index` of stream `seed` (exactly `length` tokens):
 *   filler[0 .. p)  KEY  filler[p .. n_fill)  QUESTION  ANSWER
 * KEY / QUESTION / ANSWER are encoded separately (each starts with a space, so the
 * GPT-2 pre-tokenizer splits at the same place it would in running text). The filler
 * is the stretch of the filler shard starting at a random token offset with every
 * <|endoftext|> skipped (wrapping around at the end of the shard), and n_fill is what
 * is left of `length` after the three fixed parts.
 *
 * Randomness: one Philox-4x32-10 block per document, key = seed, counter = (index,
 * a domain tag, 0): word 0 picks the key digits, words 1-2 the filler offset, word 3
 * the key depth. No state is carried between documents, so a document never depends
 * on which others were made before it (training resumes exactly, eval sets are fixed).
 */
#include "linmoe/passkey.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PASSKEY_MIN_FILLER 16
#define PASSKEY_TAG 0x7061736bu /* "pask": keeps these draws apart from other streams */

static const char k_question[] = " What is the pass key? The pass key is";

static void draw(uint64_t seed, uint64_t index, uint32_t out[4]) {
    const uint32_t ctr[4] = {(uint32_t)index, (uint32_t)(index >> 32), PASSKEY_TAG, 0u};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    lm_philox4x32_10(ctr, key, out);
}

/* Append the encoding of `s` to ws->enc (grow-only: *n is the fill, ws->enc_cap the
 * capacity, kept across documents). */
static lm_status encode_append(lm_tokenizer *tok, const char *s, lm_passkey_ws *ws, int64_t *n,
                               lm_error *err) {
    return lm_tokenizer_encode(tok, s, strlen(s), &ws->enc, n, &ws->enc_cap, err);
}

/* 1 when token `id`'s bytes (what decoding it alone gives) contain an ASCII digit. */
static lm_status has_digit(const lm_tokenizer *tok, int32_t id, int *out, lm_error *err) {
    size_t len = 0;
    const uint8_t *s = lm_tokenizer_token_bytes(tok, id, &len);
    if (!s)
        return lm_errorf(err, LM_ERR_INVALID, "passkey: token id %d is outside the %s vocab",
                         (int)id, lm_tokenizer_name(tok));
    *out = 0;
    for (size_t i = 0; i < len; i++)
        if (s[i] >= '0' && s[i] <= '9')
            *out = 1;
    return LM_OK;
}

/* Copy `want` filler tokens (separators skipped) into dst, continuing the walk at
 * *pos; *visited counts shard positions looked at (the walk gives up after one full
 * pass over the shard). */
static lm_status take_filler(const lm_shard *f, int32_t eot, int64_t want, uint64_t *pos,
                             uint64_t *visited, int32_t *dst, lm_error *err) {
    int64_t got = 0;
    while (got < want) {
        if (*visited >= f->count)
            return lm_errorf(err, LM_ERR_INVALID,
                             "passkey: filler shard %s holds fewer than %lld tokens of prose "
                             "(%llu tokens, <|endoftext|> excluded)",
                             f->path ? f->path : "(unnamed)", (long long)want,
                             (unsigned long long)f->count);
        const int32_t t = lm_shard_get(f, *pos);
        if (t != eot) {
            if (t < 0 || (uint32_t)t >= f->vocab)
                return lm_errorf(err, LM_ERR_INVALID,
                                 "passkey: filler shard %s: token %llu = %d is outside [0, %u)",
                                 f->path ? f->path : "(unnamed)", (unsigned long long)*pos, t,
                                 f->vocab);
            dst[got++] = t;
        }
        *pos = *pos + 1 == f->count ? 0 : *pos + 1;
        ++*visited;
    }
    return LM_OK;
}

lm_status lm_passkey_make_into(lm_tokenizer *tok, const lm_shard *filler, int64_t length,
                               uint64_t seed, uint64_t index, lm_passkey_ws *ws, int32_t *out,
                               lm_passkey_doc *doc, lm_error *err) {
    if (!doc)
        return lm_errorf(err, LM_ERR_INVALID, "passkey: NULL document");
    memset(doc, 0, sizeof(*doc));
    if (!ws)
        return lm_errorf(err, LM_ERR_INVALID, "passkey: NULL workspace");
    if (!tok || !filler)
        return lm_errorf(err, LM_ERR_INVALID, "passkey: NULL tokenizer or filler");
    const char *fname = filler->path ? filler->path : "(unnamed)";
    if (filler->count == 0 || !filler->tokens)
        return lm_errorf(err, LM_ERR_INVALID, "passkey: filler shard %s is empty", fname);
    const int vocab = lm_tokenizer_vocab_size(tok);
    if ((int64_t)filler->vocab != vocab)
        return lm_errorf(err, LM_ERR_INVALID,
                         "passkey: filler shard %s has vocab %u but the %s tokenizer has %d", fname,
                         filler->vocab, lm_tokenizer_name(tok), vocab);
    if (length < 1 || length > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID, "passkey: length = %lld (want >= 1)",
                         (long long)length);

    uint32_t w[4];
    draw(seed, index, w);
    const unsigned key_num = 10000u + w[0] % 90000u;
    char key[6], key_sent[96], answer[16];
    snprintf(key, sizeof key, "%05u", key_num);
    snprintf(key_sent, sizeof key_sent, " The pass key is %s. Remember it. %s is the pass key.",
             key, key);
    snprintf(answer, sizeof answer, " %s.", key);

    /* KEY, QUESTION, ANSWER back to back in ws->enc */
    int64_t ne = 0, nk = 0, nq = 0, na = 0;
    lm_status st = encode_append(tok, key_sent, ws, &ne, err);
    nk = ne;
    if (st == LM_OK)
        st = encode_append(tok, k_question, ws, &ne, err);
    nq = ne - nk;
    if (st == LM_OK)
        st = encode_append(tok, answer, ws, &ne, err);
    na = ne - nk - nq;
    if (st != LM_OK)
        return st;
    const int32_t *k_ids = ws->enc, *q_ids = ws->enc + nk, *a_ids = ws->enc + nk + nq;
    const int64_t n_fill = length - nk - nq - na;
    if (n_fill < PASSKEY_MIN_FILLER)
        return lm_errorf(err, LM_ERR_INVALID,
                         "passkey: length = %lld is too short: key sentence (%lld tokens), "
                         "question (%lld) and answer (%lld) leave %lld filler tokens (need >= %d)",
                         (long long)length, (long long)nk, (long long)nq, (long long)na,
                         (long long)n_fill, PASSKEY_MIN_FILLER);
    int32_t *ids = out;
    if (!ids) {
        if (ws->ids_cap < length) {
            int32_t *p = realloc(ws->ids, (size_t)length * sizeof(int32_t));
            if (!p)
                return lm_errorf(err, LM_ERR_NOMEM, "passkey: cannot allocate %lld tokens",
                                 (long long)length);
            ws->ids = p;
            ws->ids_cap = length;
        }
        ids = ws->ids;
    }
    /* offset uniform over the shard, depth uniform over the n_fill + 1 insertion
     * points (64-bit modulo: bias < count / 2^64) */
    uint64_t pos = ((uint64_t)w[1] | ((uint64_t)w[2] << 32)) % filler->count, visited = 0;
    const int64_t depth = (int64_t)(w[3] % (uint64_t)(n_fill + 1));
    const int32_t eot = lm_tokenizer_eot(tok);
    int64_t o = 0;
    LM_TRY(take_filler(filler, eot, depth, &pos, &visited, ids, err));
    o += depth;
    memcpy(ids + o, k_ids, (size_t)nk * sizeof(int32_t));
    o += nk;
    LM_TRY(take_filler(filler, eot, n_fill - depth, &pos, &visited, ids + o, err));
    o += n_fill - depth;
    memcpy(ids + o, q_ids, (size_t)nq * sizeof(int32_t));
    o += nq;
    memcpy(ids + o, a_ids, (size_t)na * sizeof(int32_t));
    o += na;
    LM_CHECK(o == length);
    /* the tokens of ANSWER that carry a digit of the key */
    int64_t first = -1, last = -1;
    for (int64_t i = 0; i < na; i++) {
        int d = 0;
        LM_TRY(has_digit(tok, a_ids[i], &d, err));
        if (d) {
            if (first < 0)
                first = i;
            last = i;
        }
    }
    if (first < 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "passkey: the %s tokenizer's encoding of \"%s\" has no token with a digit",
                         lm_tokenizer_name(tok), answer);
    doc->ids = ids;
    doc->n = length;
    doc->key_pos = depth;
    doc->answer_pos = length - na;
    doc->digits_pos = doc->answer_pos + first;
    doc->digits_end = doc->answer_pos + last + 1;
    memcpy(doc->key, key, sizeof doc->key);
    return LM_OK;
}

lm_status lm_passkey_make(lm_tokenizer *tok, const lm_shard *filler, int64_t length, uint64_t seed,
                          uint64_t index, lm_passkey_doc *doc, lm_error *err) {
    lm_passkey_ws ws;
    memset(&ws, 0, sizeof ws);
    lm_status st = lm_passkey_make_into(tok, filler, length, seed, index, &ws, NULL, doc, err);
    if (st == LM_OK) {
        doc->ids = ws.ids; /* the document takes the workspace's buffer */
        ws.ids = NULL;
    } else if (doc) {
        memset(doc, 0, sizeof(*doc));
    }
    lm_passkey_ws_free(&ws);
    return st;
}

void lm_passkey_ws_free(lm_passkey_ws *ws) {
    if (!ws)
        return;
    free(ws->enc);
    free(ws->ids);
    memset(ws, 0, sizeof(*ws));
}

void lm_passkey_doc_free(lm_passkey_doc *doc) {
    if (!doc)
        return;
    free(doc->ids);
    memset(doc, 0, sizeof(*doc));
}
