/* linmoe passkey documents: the synthetic long-context retrieval task used both as
 * training data (mixed into a context-extension stage) and as an eval
 * (reference/attnres_ctx.md §2.2-2.3; Mohtashami & Jaggi 2023, "Landmark Attention",
 * passkey retrieval).
 *
 * A document of exactly `length` tokens (tokenizer ids, no <|endoftext|>):
 *   [filler ... ] KEY_SENTENCE [filler ...] QUESTION ANSWER
 * filler     consecutive tokens of the filler shard starting at a random offset
 *            (uniform over the shard's tokens; every <|endoftext|> is skipped so the
 *            filler is prose; the walk wraps around at the end of the shard), cut to
 *            n_fill = length - |KEY| - |QUESTION| - |ANSWER| tokens
 * KEY        " The pass key is 12345. Remember it. 12345 is the pass key." at a
 *            random depth key_pos, uniform over the n_fill + 1 insertion points between
 *            filler tokens (the whole sentence inside the filler)
 * QUESTION   " What is the pass key? The pass key is"
 * ANSWER     " 12345." (the 5 digits, uniform 10000..99999)
 * KEY, QUESTION and ANSWER are each encoded on their own (so |KEY| and |ANSWER|
 * depend on the digits with GPT-2); digits_pos / digits_end are the first / one past
 * the last token of the encoded ANSWER whose decoded bytes contain a digit.
 * Randomness is a pure function of (seed, index) (one Philox-4x32-10 block keyed by
 * the seed): document `index` of a stream with seed `seed` is the same on every call,
 * whatever was made before (eval sets are fixed; training is resumable).
 *
 * Errors: LM_ERR_INVALID when `length` is too short to hold key, question and
 * answer with at least 16 filler tokens, the filler shard is empty, its vocab differs
 * from the tokenizer's, a filler token is outside the vocab (names the index), or the
 * shard holds fewer than n_fill tokens besides <|endoftext|>; the tokenizer's errors.
 * On error *doc is left empty (ids NULL).
 */
#ifndef LINMOE_PASSKEY_H
#define LINMOE_PASSKEY_H

#include "linmoe/core.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int32_t *ids;       /* [n] owned */
    int64_t n;          /* == length */
    int64_t key_pos;    /* first token of the key sentence */
    int64_t answer_pos; /* first token of ANSWER: ids[answer_pos .. n) */
    int64_t digits_pos; /* first token that carries a digit of the key */
    int64_t digits_end; /* one past the last token carrying a digit */
    char key[6];        /* the 5 digits, NUL-terminated */
} lm_passkey_doc;

/* Makes document (seed, index) of `length` tokens into a fresh doc->ids (owned:
 * lm_passkey_doc_free). Allocates per call; loops use lm_passkey_make_into. */
lm_status lm_passkey_make(lm_tokenizer *tok, const lm_shard *filler, int64_t length, uint64_t seed,
                          uint64_t index, lm_passkey_doc *doc, lm_error *err);
void lm_passkey_doc_free(lm_passkey_doc *doc);

/* Grow-only scratch of lm_passkey_make_into, reused from document to document, so a
 * steady stream of documents allocates nothing once the buffers fit (the byte
 * tokenizer's encode allocates nothing else; GPT-2's may grow its piece cache).
 * Start zeroed; lm_passkey_ws_free releases it. Not shared between threads. */
typedef struct {
    int32_t *enc; /* [enc_cap] the encoded KEY, QUESTION, ANSWER back to back */
    int64_t enc_cap;
    int32_t *ids; /* [ids_cap] the document when the caller passes no `out` */
    int64_t ids_cap;
} lm_passkey_ws;

/* The same document as lm_passkey_make (same tokens, same positions, same errors),
 * written into out[length] (caller-owned int32 token ids) or, with out == NULL, into
 * ws's grow-only buffer (valid until the next call with ws or lm_passkey_ws_free).
 * doc->ids points at that buffer and is NOT owned: do not lm_passkey_doc_free it.
 * On error *doc is left empty and out[0..length) may be partly written. */
lm_status lm_passkey_make_into(lm_tokenizer *tok, const lm_shard *filler, int64_t length,
                               uint64_t seed, uint64_t index, lm_passkey_ws *ws, int32_t *out,
                               lm_passkey_doc *doc, lm_error *err);
void lm_passkey_ws_free(lm_passkey_ws *ws);

#ifdef __cplusplus
}
#endif
#endif
