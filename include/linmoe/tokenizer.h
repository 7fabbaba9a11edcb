/* linmoe tokenizers: byte-level (256 bytes + <|endoftext|>) and GPT-2 byte-level BPE,
 * encode / decode byte-exact, and a streaming decoder that emits only complete UTF-8.
 *
 * Byte tokenizer: id b (0..255) is the byte b; id 256 is <|endoftext|>; vocab 257.
 * GPT-2 BPE (Radford et al. 2019, "Language Models are Unsupervised Multitask
 * Learners" §2.2; the r50k_base encoding): text is split by the GPT-2 pre-tokenizer
 * regex (PCRE2, UTF-8 + UCP)
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * each piece's bytes are mapped to printable unicode by the bytes-to-unicode table,
 * merged by rank (merges.txt, lowest rank first) and looked up in vocab.json
 * (Hugging Face files); <|endoftext|> is id 50256, vocab 50257. A cache keyed by
 * piece avoids re-merging frequent words.
 *
 * Encoding never produces <|endoftext|> from text (the literal string is encoded as
 * ordinary text); callers insert lm_tokenizer_eot() between documents.
 *
 * GPT-2 details (src/data/tokenizer.c says why): \s in the pattern is the Unicode
 * White_Space property, as in OpenAI's encoder.py and tiktoken (js-tiktoken's JS \s
 * differs on U+0085 and U+FEFF); invalid UTF-8 is never dropped: byte sequences the
 * regex cannot match form pieces of their own, so decode(encode(x)) == x for any
 * bytes with both tokenizers. Ids equal tiktoken's r50k_base on valid UTF-8 without
 * U+0085 / U+FEFF (tests/test_tokenizer_oracle.c checks this against js-tiktoken).
 *
 * Data files: the text splits and the GPT-2 files come from scripts/fetch-data.sh
 * (data/brown/{train,val}.txt: one paragraph per line, documents separated by a line
 * holding only a form feed "\f"; data/gpt2/{vocab.json,merges.txt}).
 *
 * Errors: LM_ERR_IO / LM_ERR_FORMAT naming the file and the entry (vocab.json,
 * merges.txt), LM_ERR_INVALID for a bad id in decode (names the position and value).
 *
 * What this module does not do: training a BPE, special tokens other than
 * <|endoftext|>, normalisation (text is taken as bytes).
 */
#ifndef LINMOE_TOKENIZER_H
#define LINMOE_TOKENIZER_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_TOK_BYTE = 0, LM_TOK_GPT2 = 1 } lm_tokenizer_kind;

typedef struct lm_tokenizer lm_tokenizer;

/* Byte-level tokenizer (no files). */
lm_status lm_tokenizer_byte(lm_tokenizer **out, lm_error *err);
/* GPT-2 BPE from a directory holding vocab.json and merges.txt (Hugging Face format;
 * scripts/fetch-data.sh writes data/gpt2/). */
lm_status lm_tokenizer_gpt2(lm_tokenizer **out, const char *dir, lm_error *err);
/* "byte" or "gpt2" (dir used for gpt2; NULL = "data/gpt2"). */
lm_status lm_tokenizer_open(lm_tokenizer **out, const char *name, const char *dir, lm_error *err);
void lm_tokenizer_free(lm_tokenizer *t);

lm_tokenizer_kind lm_tokenizer_kind_of(const lm_tokenizer *t);
const char *lm_tokenizer_name(const lm_tokenizer *t); /* "byte" | "gpt2" */
int lm_tokenizer_vocab_size(const lm_tokenizer *t);   /* 257 | 50257 */
int32_t lm_tokenizer_eot(const lm_tokenizer *t);      /* 256 | 50256 */

/* Encode `len` bytes of text (any bytes; invalid UTF-8 is encoded byte-wise by the
 * byte tokenizer and, for GPT-2, as the bytes the regex leaves unmatched - still
 * byte-exact on decode). Appends to *ids (realloc'd, *n / *cap updated; *ids may
 * be NULL with *n = *cap = 0). Thread-safe for distinct tokenizers only (the GPT-2
 * piece cache is per tokenizer). On an error (LM_ERR_NOMEM) *n may already include
 * part of the text. */
lm_status lm_tokenizer_encode(lm_tokenizer *t, const char *text, size_t len, int32_t **ids,
                              int64_t *n, int64_t *cap, lm_error *err);

/* Documents in one text (the data/brown/{train,val}.txt format and friends), for
 * lm_tokenizer_encode_documents:
 *   LM_DOCSEP_FORMFEED  a line holding only "\f" ("\f\n", or "\f" at the end)
 *                       ends a document; the separator line belongs to no document
 *   LM_DOCSEP_BLANK     an empty line ("\n" alone) ends a document (and is dropped)
 *   LM_DOCSEP_NONE      the whole text is one document
 * A document keeps every other byte, its final "\n" included; empty documents (two
 * separators in a row, one at the start or end) are skipped. */
typedef enum { LM_DOCSEP_FORMFEED = 0, LM_DOCSEP_BLANK = 1, LM_DOCSEP_NONE = 2 } lm_docsep;

/* Encode every document of text[0..len) followed by <|endoftext|> (appending to *ids
 * as lm_tokenizer_encode does). *n_docs and *doc_bytes (may be NULL) receive the
 * number of documents and the bytes they hold (separators excluded): the byte count
 * that bits per byte divides by. */
lm_status lm_tokenizer_encode_documents(lm_tokenizer *t, const char *text, size_t len,
                                        lm_docsep sep, int32_t **ids, int64_t *n, int64_t *cap,
                                        int64_t *n_docs, int64_t *doc_bytes, lm_error *err);

/* Decode ids to bytes (malloc'd, NUL-terminated, *out_len excludes the NUL).
 * <|endoftext|> decodes to the literal "<|endoftext|>". */
lm_status lm_tokenizer_decode(const lm_tokenizer *t, const int32_t *ids, int64_t n, char **out,
                              size_t *out_len, lm_error *err);

/* Streaming decode: feed one id at a time; writes into buf the bytes that now form
 * complete UTF-8 characters (held-back partial sequences are emitted once complete, or
 * as-is by lm_tokenizer_stream_flush). Returns the byte count (0 is normal: the token
 * only started a character). Bytes that can never become valid UTF-8 (0xFF, a stray
 * continuation byte, a broken sequence) are emitted as they are, at once, so the
 * concatenation of all outputs plus the flush is exactly the decode of the ids.
 * buf_size must be >= LM_TOKENIZER_STREAM_BUF (enough for any token: GPT-2 has
 * 128-byte tokens, so 64 is NOT enough for it; 64 is for the byte tokenizer only).
 * Returns -1, changing nothing, for an id outside [0, vocab) or a buf too small for
 * the held bytes plus the token (3 + lm_tokenizer_max_token_bytes(t) always fits).
 * Start with a zeroed lm_tokenizer_stream. */
#define LM_TOKENIZER_STREAM_BUF 256
typedef struct {
    unsigned char pend[8];
    int npend;
} lm_tokenizer_stream;
int lm_tokenizer_stream_push(const lm_tokenizer *t, lm_tokenizer_stream *s, int32_t id,
                             char *buf, size_t buf_size);
int lm_tokenizer_stream_flush(lm_tokenizer_stream *s, char *buf, size_t buf_size);

/* The bytes of token `id` (not NUL-terminated; <|endoftext|> gives its literal text),
 * owned by t; NULL and *len = 0 for an id outside [0, vocab). Lets callers count the
 * UTF-8 bytes of token ranges (bits per byte) without decoding. */
const uint8_t *lm_tokenizer_token_bytes(const lm_tokenizer *t, int32_t id, size_t *len);
/* Longest token in bytes (13 for the byte tokenizer: <|endoftext|>; 128 for GPT-2). */
int lm_tokenizer_max_token_bytes(const lm_tokenizer *t);

#ifdef __cplusplus
}
#endif
#endif
