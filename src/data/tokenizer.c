/* linmoe tokenizers: the byte tokenizer and GPT-2 byte-level BPE (tokenizer.h).
 *
 * GPT-2 BPE as described by Radford et al. 2019 ("Language Models are Unsupervised
 * Multitask Learners", §2.2) and Sennrich et al. 2016 ("Neural Machine Translation of
 * Rare Words with Subword Units", the merge algorithm), re-derived here:
 *   1. pre-tokenize: the text is cut into pieces by the GPT-2 regex (below);
 *   2. each piece is a sequence of bytes; the vocabulary spells bytes through the
 *      bytes-to-unicode table (printable bytes stand for themselves, the other 68 are
 *      shifted to U+0100..U+0143 in byte order) - we undo that spelling once at load
 *      time and work on raw bytes from then on;
 *   3. starting from one symbol per byte, repeatedly merge the adjacent pair whose
 *      merge has the lowest rank (line order in merges.txt), all its occurrences
 *      left to right, until no adjacent pair has a merge; each symbol is a token.
 * Step 3 is done with a heap of candidate pairs keyed (rank, position), so a piece of
 * n bytes costs O(n log n), not O(n^2) (long runs of one character are common in
 * real text: "----", "    ", "=====").
 *
 * Whole pieces found in the vocabulary are emitted directly (as tiktoken does); for
 * the GPT-2 vocabulary this is the same result, since every token is what BPE makes
 * of its own bytes (checked for all 50256 tokens when this was written).
 *
 * Whitespace. The pattern's \s and \S are spelled out as the Unicode White_Space
 * property (U+0009-000D, 0020, 0085, 00A0, 1680, 2000-200A, 2028, 2029, 202F, 205F,
 * 3000), which is what the reference implementations use (Python's `regex` module in
 * OpenAI's encoder.py, the Rust regex crate in tiktoken). PCRE2's own \s with UCP
 * would add U+180E; JavaScript's \s (js-tiktoken) lacks U+0085 and adds U+FEFF, so
 * js-tiktoken differs from both on text holding those two code points (see
 * tests/test_tokenizer_oracle.c).
 *
 * Invalid UTF-8. The regex is compiled with PCRE2_MATCH_INVALID_UTF: invalid byte
 * sequences never match, so they end up in the gaps between matches; every gap is
 * encoded as one more piece (its bytes through BPE). Every input byte therefore lands
 * in exactly one piece and decode(encode(x)) == x for any bytes.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/tokenizer.h"

#define EOT_TEXT "<|endoftext|>"
#define EOT_LEN 13
/* Pieces up to this many bytes are cached; the cache is emptied when its storage
 * passes CACHE_MAX_BYTES (bounded memory on unbounded input). */
#define CACHE_MAX_KEY 256
#define CACHE_MAX_BYTES ((size_t)64 << 20)
/* Largest vocab.json / merges.txt we accept (the GPT-2 ones are 0.8 and 0.5 MB). */
#define MAX_FILE_BYTES ((long)256 << 20)

/* The pre-tokenizer (Radford et al. 2019, §2.2), with \s spelled as White_Space. */
#define WS                                                                                         \
    "\\t\\n\\x0b\\f\\r "                                                                           \
    "\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"
static const char k_gpt2_pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS
                                     "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+";

typedef struct {
    uint64_t key; /* (left id << 32) | right id; UINT64_MAX = empty */
    int32_t rank, merged;
} merge_slot;

typedef struct {
    uint64_t hash;
    int64_t off; /* into cache.buf; -1 = empty */
} cache_slot;

/* Heap entry of a candidate merge: the pair starting at symbol `pos`. */
typedef struct {
    int32_t rank, pos, left, right;
} heap_ent;

struct lm_tokenizer {
    lm_tokenizer_kind kind;
    int vocab;
    int32_t eot;
    /* id -> bytes: tok_bytes[tok_off[id] .. tok_off[id + 1]) */
    uint8_t *tok_bytes;
    int64_t *tok_off;
    int max_token_bytes;
    /* GPT-2 only */
    int32_t byte_id[256];
    int32_t *str_slots; /* bytes -> id, open addressing, -1 empty */
    uint64_t str_mask;
    merge_slot *merges;
    uint64_t merge_mask;
    int n_merges;
    pcre2_code *re;
    pcre2_match_data *md;
    struct {
        cache_slot *slots;
        uint64_t mask;
        int64_t count;
        uint8_t *buf;
        size_t used, cap;
    } cache;
    /* BPE scratch (grown on demand) */
    int32_t *s_id, *s_next, *s_prev;
    heap_ent *heap;
    int64_t s_cap, heap_cap;
    int32_t *piece_ids;
    int64_t piece_cap;
};

/* ---------------------------------------------------------------- helpers */

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t p = 16;
    while (p < n)
        p <<= 1;
    return p;
}

/* GPT-2's bytes-to-unicode table: bytes 33..126, 161..172 and 174..255 stand for
 * themselves; the remaining 68 bytes, in increasing order, get U+0100, U+0101, ... */
static void bytes_to_unicode(uint32_t b2u[256]) {
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        int direct = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        b2u[b] = direct ? (uint32_t)b : 256 + n++;
    }
}

/* Decode one UTF-8 code point at s[0..n); returns its length (1..4) or 0 if invalid. */
static int utf8_decode(const uint8_t *s, size_t n, uint32_t *cp) {
    if (n == 0)
        return 0;
    uint8_t c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if ((size_t)len > n)
        return 0;
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

/* Length of the longest prefix of s[0..n) after which no complete-able UTF-8
 * sequence is cut: bytes that can never start or continue a valid sequence count as
 * complete (they are emitted as they are); a valid but unfinished sequence at the
 * end is held back. */
static size_t utf8_complete_prefix(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        int len = c < 0x80                   ? 1
                  : (c >= 0xC2 && c <= 0xDF) ? 2
                  : (c >= 0xE0 && c <= 0xEF) ? 3
                  : (c >= 0xF0 && c <= 0xF4) ? 4
                                             : 1;
        if (len == 1) {
            i++;
            continue;
        }
        /* the allowed range of the second byte depends on the lead (no overlongs,
         * surrogates or code points above U+10FFFF) */
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
        else if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
        int ok = 1, j;
        for (j = 1; j < len && i + (size_t)j < n; j++) {
            uint8_t d = s[i + (size_t)j];
            if (j == 1 ? (d < lo || d > hi) : ((d & 0xC0) != 0x80)) {
                ok = 0;
                break;
            }
        }
        if (!ok) { /* never completes: emit the lead byte as it is */
            i++;
            continue;
        }
        if (i + (size_t)len > n)
            return i; /* a valid prefix of a character: wait for the rest */
        i += (size_t)len;
    }
    return n;
}

/* Read a whole file (at most MAX_FILE_BYTES) into a NUL-terminated buffer. */
static lm_status read_file(const char *path, char **out, size_t *out_len, lm_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return lm_errorf(err, LM_ERR_IO, "cannot open %s: %s (run scripts/fetch-data.sh)", path,
                         strerror(errno));
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0)
        size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return lm_errorf(err, LM_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    }
    if (size > MAX_FILE_BYTES) {
        fclose(f);
        return lm_errorf(err, LM_ERR_FORMAT, "%s: file size %ld bytes exceeds the %ld limit", path,
                         size, MAX_FILE_BYTES);
    }
    char *buf = malloc((size_t)size + 1);
    if (!buf) {
        fclose(f);
        return lm_errorf(err, LM_ERR_NOMEM, "%s: cannot allocate %ld bytes", path, size);
    }
    size_t got = fread(buf, 1, (size_t)size, f);
    int bad = ferror(f);
    fclose(f);
    if (bad || got != (size_t)size) {
        free(buf);
        return lm_errorf(err, LM_ERR_IO, "cannot read %s: short read (%zu of %ld bytes)", path, got,
                         size);
    }
    buf[size] = '\0';
    *out = buf;
    *out_len = (size_t)size;
    return LM_OK;
}

/* ---------------------------------------------------------------- lifecycle */

void lm_tokenizer_free(lm_tokenizer *t) {
    if (!t)
        return;
    free(t->tok_bytes);
    free(t->tok_off);
    free(t->str_slots);
    free(t->merges);
    if (t->md)
        pcre2_match_data_free(t->md);
    if (t->re)
        pcre2_code_free(t->re);
    free(t->cache.slots);
    free(t->cache.buf);
    free(t->s_id);
    free(t->s_next);
    free(t->s_prev);
    free(t->heap);
    free(t->piece_ids);
    free(t);
}

lm_status lm_tokenizer_byte(lm_tokenizer **out, lm_error *err) {
    *out = NULL;
    lm_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return lm_errorf(err, LM_ERR_NOMEM, "byte tokenizer: out of memory");
    t->kind = LM_TOK_BYTE;
    t->vocab = 257;
    t->eot = 256;
    t->tok_bytes = malloc(256 + EOT_LEN);
    t->tok_off = malloc(258 * sizeof *t->tok_off);
    if (!t->tok_bytes || !t->tok_off) {
        lm_tokenizer_free(t);
        return lm_errorf(err, LM_ERR_NOMEM, "byte tokenizer: out of memory");
    }
    for (int b = 0; b < 256; b++) {
        t->tok_bytes[b] = (uint8_t)b;
        t->tok_off[b] = b;
        t->byte_id[b] = b;
    }
    memcpy(t->tok_bytes + 256, EOT_TEXT, EOT_LEN);
    t->tok_off[256] = 256;
    t->tok_off[257] = 256 + EOT_LEN;
    t->max_token_bytes = EOT_LEN;
    *out = t;
    return LM_OK;
}

/* bytes -> id lookup (GPT-2); -1 when absent. */
static int32_t str_find(const lm_tokenizer *t, const uint8_t *p, size_t n) {
    uint64_t i = hash_bytes(p, n) & t->str_mask;
    for (;;) {
        int32_t id = t->str_slots[i];
        if (id < 0)
            return -1;
        const uint8_t *q = t->tok_bytes + t->tok_off[id];
        if ((size_t)(t->tok_off[id + 1] - t->tok_off[id]) == n && memcmp(q, p, n) == 0)
            return id;
        i = (i + 1) & t->str_mask;
    }
}

static const merge_slot *merge_find(const lm_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t i = hash_u64(key) & t->merge_mask;
    for (;;) {
        const merge_slot *s = &t->merges[i];
        if (s->key == UINT64_MAX)
            return NULL;
        if (s->key == key)
            return s;
        i = (i + 1) & t->merge_mask;
    }
}

/* Undo the bytes-to-unicode spelling of a vocabulary string (UTF-8, n bytes) into
 * out (capacity >= n). Returns the byte count, or -1 when a character is not one of
 * the 256 the table uses. */
static int64_t unspell(const uint8_t u2b_ok[324], const uint8_t u2b[324], const char *s, size_t n,
                       uint8_t *out) {
    int64_t m = 0;
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        int l = utf8_decode((const uint8_t *)s + i, n - i, &cp);
        if (l == 0 || cp >= 324 || !u2b_ok[cp])
            return -1;
        out[m++] = u2b[cp];
        i += (size_t)l;
    }
    return m;
}

static lm_status load_vocab(lm_tokenizer *t, const char *path, const uint8_t *u2b_ok,
                            const uint8_t *u2b, lm_error *err) {
    char *text;
    size_t len;
    LM_TRY(read_file(path, &text, &len, err));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root || !cJSON_IsObject(root)) {
        long at = root ? 0 : (long)(cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - text : 0);
        cJSON_Delete(root);
        free(text);
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: not a JSON object mapping tokens to ids (parse error near byte %ld)",
                         path, at);
    }
    int n = cJSON_GetArraySize(root);
    lm_status st = LM_OK;
    if (n < 257 || n > (1 << 24)) {
        st = lm_errorf(err, LM_ERR_FORMAT, "%s: %d entries (want 257 .. %d)", path, n, 1 << 24);
        goto done;
    }
    t->vocab = n;
    t->eot = -1;
    t->tok_off = malloc(((size_t)n + 1) * sizeof *t->tok_off);
    int64_t *len_of = calloc((size_t)n, sizeof *len_of);
    char **key_of = calloc((size_t)n, sizeof *key_of);
    if (!t->tok_off || !len_of || !key_of) {
        free(len_of);
        free(key_of);
        st = lm_errorf(err, LM_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    for (int i = 0; i < n; i++)
        len_of[i] = -1;
    /* pass 1: ids dense and unique, keys spell bytes */
    size_t total = 0;
    uint8_t scratch[4096];
    for (cJSON *it = root->child; it; it = it->next) {
        double v = cJSON_IsNumber(it) ? it->valuedouble : -1.0;
        if (!(v >= 0 && v < n) || v != (double)(int)v) {
            st = lm_errorf(err, LM_ERR_FORMAT,
                           "%s: token \"%.64s\": id must be an integer in [0, %d)", path,
                           it->string, n);
            break;
        }
        int id = (int)v;
        if (len_of[id] >= 0) {
            st = lm_errorf(err, LM_ERR_FORMAT, "%s: id %d is used by \"%.64s\" and \"%.64s\"", path,
                           id, key_of[id], it->string);
            break;
        }
        size_t kl = strlen(it->string);
        int64_t bl;
        if (strcmp(it->string, EOT_TEXT) == 0) {
            t->eot = id;
            bl = EOT_LEN;
        } else if (kl > sizeof scratch ||
                   (bl = unspell(u2b_ok, u2b, it->string, kl, scratch)) <= 0) {
            st = lm_errorf(err, LM_ERR_FORMAT,
                           "%s: token \"%.64s\" (id %d) is not spelled in GPT-2's "
                           "bytes-to-unicode alphabet",
                           path, it->string, id);
            break;
        }
        len_of[id] = bl;
        key_of[id] = it->string;
        total += (size_t)bl;
    }
    if (st == LM_OK && t->eot < 0)
        st = lm_errorf(err, LM_ERR_FORMAT, "%s: no \"%s\" entry", path, EOT_TEXT);
    if (st == LM_OK) {
        t->tok_bytes = malloc(total ? total : 1);
        t->str_mask = pow2_at_least(2 * (uint64_t)n) - 1;
        t->str_slots = malloc((t->str_mask + 1) * sizeof *t->str_slots);
        if (!t->tok_bytes || !t->str_slots)
            st = lm_errorf(err, LM_ERR_NOMEM, "%s: out of memory", path);
    }
    if (st == LM_OK) {
        int64_t off = 0;
        t->max_token_bytes = 0;
        for (int id = 0; id < n; id++) {
            t->tok_off[id] = off;
            if (id == t->eot) {
                memcpy(t->tok_bytes + off, EOT_TEXT, EOT_LEN);
            } else {
                int64_t bl = unspell(u2b_ok, u2b, key_of[id], strlen(key_of[id]), scratch);
                memcpy(t->tok_bytes + off, scratch, (size_t)bl);
            }
            off += len_of[id];
            if (len_of[id] > t->max_token_bytes)
                t->max_token_bytes = (int)len_of[id];
        }
        t->tok_off[n] = off;
        memset(t->str_slots, 0xff, (t->str_mask + 1) * sizeof *t->str_slots);
        for (int id = 0; id < n && st == LM_OK; id++) {
            if (id == t->eot)
                continue; /* never produced from text */
            const uint8_t *p = t->tok_bytes + t->tok_off[id];
            size_t bl = (size_t)len_of[id];
            int32_t other = str_find(t, p, bl);
            if (other >= 0) {
                st = lm_errorf(err, LM_ERR_FORMAT,
                               "%s: tokens \"%.64s\" (id %d) and \"%.64s\" (id %d) "
                               "spell the same bytes",
                               path, key_of[other], other, key_of[id], id);
                break;
            }
            uint64_t i = hash_bytes(p, bl) & t->str_mask;
            while (t->str_slots[i] >= 0)
                i = (i + 1) & t->str_mask;
            t->str_slots[i] = id;
        }
        for (int b = 0; b < 256 && st == LM_OK; b++) {
            uint8_t c = (uint8_t)b;
            t->byte_id[b] = str_find(t, &c, 1);
            if (t->byte_id[b] < 0)
                st = lm_errorf(err, LM_ERR_FORMAT, "%s: no token for the single byte 0x%02x", path,
                               b);
        }
    }
    free(len_of);
    free(key_of);
done:
    cJSON_Delete(root);
    free(text);
    return st;
}

static lm_status load_merges(lm_tokenizer *t, const char *path, const uint8_t *u2b_ok,
                             const uint8_t *u2b, lm_error *err) {
    char *text;
    size_t len;
    LM_TRY(read_file(path, &text, &len, err));
    int64_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    t->merge_mask = pow2_at_least(2 * (uint64_t)lines) - 1;
    t->merges = malloc((t->merge_mask + 1) * sizeof *t->merges);
    if (!t->merges) {
        free(text);
        return lm_errorf(err, LM_ERR_NOMEM, "%s: out of memory", path);
    }
    for (uint64_t i = 0; i <= t->merge_mask; i++)
        t->merges[i].key = UINT64_MAX;
    lm_status st = LM_OK;
    uint8_t buf[2][1024];
    int64_t lineno = 0;
    size_t pos = 0;
    t->n_merges = 0;
    while (pos < len && st == LM_OK) {
        size_t e = pos;
        while (e < len && text[e] != '\n')
            e++;
        const char *line = text + pos;
        size_t ll = e - pos;
        pos = e + 1;
        lineno++;
        if (ll && line[ll - 1] == '\r')
            ll--;
        if (ll == 0 || (lineno == 1 && ll >= 8 && memcmp(line, "#version", 8) == 0))
            continue;
        const char *sp = memchr(line, ' ', ll);
        if (!sp || sp == line || sp == line + ll - 1 ||
            memchr(sp + 1, ' ', (size_t)(line + ll - sp - 1))) {
            st = lm_errorf(err, LM_ERR_FORMAT, "%s:%lld: not a merge \"A B\": \"%.*s\"", path,
                           (long long)lineno, (int)(ll > 64 ? 64 : ll), line);
            break;
        }
        const char *part[2] = {line, sp + 1};
        size_t plen[2] = {(size_t)(sp - line), (size_t)(line + ll - sp - 1)};
        int64_t blen[2];
        int32_t id[2];
        for (int k = 0; k < 2 && st == LM_OK; k++) {
            blen[k] =
                plen[k] <= sizeof buf[k] ? unspell(u2b_ok, u2b, part[k], plen[k], buf[k]) : -1;
            id[k] = blen[k] > 0 ? str_find(t, buf[k], (size_t)blen[k]) : -1;
            if (id[k] < 0)
                st =
                    lm_errorf(err, LM_ERR_FORMAT, "%s:%lld: token \"%.*s\" is not in vocab.json",
                              path, (long long)lineno, (int)(plen[k] > 64 ? 64 : plen[k]), part[k]);
        }
        if (st != LM_OK)
            break;
        uint8_t cat[2048];
        memcpy(cat, buf[0], (size_t)blen[0]);
        memcpy(cat + blen[0], buf[1], (size_t)blen[1]);
        int32_t merged = str_find(t, cat, (size_t)(blen[0] + blen[1]));
        if (merged < 0) {
            st = lm_errorf(err, LM_ERR_FORMAT,
                           "%s:%lld: the merge of \"%.*s\" and \"%.*s\" is not in vocab.json", path,
                           (long long)lineno, (int)(plen[0] > 64 ? 64 : plen[0]), part[0],
                           (int)(plen[1] > 64 ? 64 : plen[1]), part[1]);
            break;
        }
        uint64_t key = ((uint64_t)(uint32_t)id[0] << 32) | (uint32_t)id[1];
        uint64_t i = hash_u64(key) & t->merge_mask;
        while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
            i = (i + 1) & t->merge_mask;
        if (t->merges[i].key == key)
            continue; /* a repeated merge can never apply: the first rank wins */
        t->merges[i].key = key;
        t->merges[i].rank = t->n_merges++;
        t->merges[i].merged = merged;
    }
    free(text);
    return st;
}

lm_status lm_tokenizer_gpt2(lm_tokenizer **out, const char *dir, lm_error *err) {
    *out = NULL;
    if (!dir)
        dir = "data/gpt2";
    lm_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return lm_errorf(err, LM_ERR_NOMEM, "gpt2 tokenizer: out of memory");
    t->kind = LM_TOK_GPT2;
    uint32_t b2u[256];
    uint8_t u2b_ok[324] = {0}, u2b[324] = {0};
    bytes_to_unicode(b2u);
    for (int b = 0; b < 256; b++) {
        u2b_ok[b2u[b]] = 1;
        u2b[b2u[b]] = (uint8_t)b;
    }
    char path[4096];
    lm_status st;
    snprintf(path, sizeof path, "%s/vocab.json", dir);
    st = load_vocab(t, path, u2b_ok, u2b, err);
    if (st == LM_OK) {
        snprintf(path, sizeof path, "%s/merges.txt", dir);
        st = load_merges(t, path, u2b_ok, u2b, err);
    }
    if (st == LM_OK) {
        int ec;
        PCRE2_SIZE eo;
        t->re = pcre2_compile((PCRE2_SPTR)k_gpt2_pattern, PCRE2_ZERO_TERMINATED,
                              PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
        if (!t->re) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            st = lm_errorf(err, LM_ERR_UNSUPPORTED,
                           "gpt2 tokenizer: PCRE2 cannot compile the pre-tokenizer pattern at "
                           "offset %zu: %s",
                           (size_t)eo, (const char *)msg);
        } else {
            (void)pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE); /* optional speed-up */
            t->md = pcre2_match_data_create_from_pattern(t->re, NULL);
            if (!t->md)
                st = lm_errorf(err, LM_ERR_NOMEM, "gpt2 tokenizer: out of memory");
        }
    }
    if (st == LM_OK) {
        t->cache.mask = 4095;
        t->cache.slots = malloc((t->cache.mask + 1) * sizeof *t->cache.slots);
        if (!t->cache.slots)
            st = lm_errorf(err, LM_ERR_NOMEM, "gpt2 tokenizer: out of memory");
        else
            for (uint64_t i = 0; i <= t->cache.mask; i++)
                t->cache.slots[i].off = -1;
    }
    if (st != LM_OK) {
        lm_tokenizer_free(t);
        return st;
    }
    *out = t;
    return LM_OK;
}

lm_status lm_tokenizer_open(lm_tokenizer **out, const char *name, const char *dir, lm_error *err) {
    *out = NULL;
    if (name && strcmp(name, "byte") == 0)
        return lm_tokenizer_byte(out, err);
    if (name && strcmp(name, "gpt2") == 0)
        return lm_tokenizer_gpt2(out, dir, err);
    return lm_errorf(err, LM_ERR_INVALID, "tokenizer: unknown name \"%s\" (known: byte, gpt2)",
                     name ? name : "(null)");
}

lm_tokenizer_kind lm_tokenizer_kind_of(const lm_tokenizer *t) { return t->kind; }
const char *lm_tokenizer_name(const lm_tokenizer *t) {
    return t->kind == LM_TOK_BYTE ? "byte" : "gpt2";
}
int lm_tokenizer_vocab_size(const lm_tokenizer *t) { return t->vocab; }
int32_t lm_tokenizer_eot(const lm_tokenizer *t) { return t->eot; }
int lm_tokenizer_max_token_bytes(const lm_tokenizer *t) { return t->max_token_bytes; }

const uint8_t *lm_tokenizer_token_bytes(const lm_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->vocab) {
        *len = 0;
        return NULL;
    }
    *len = (size_t)(t->tok_off[id + 1] - t->tok_off[id]);
    return t->tok_bytes + t->tok_off[id];
}

/* ---------------------------------------------------------------- encode */

static lm_status push_ids(const int32_t *src, int64_t m, int32_t **ids, int64_t *n, int64_t *cap,
                          lm_error *err) {
    if (*n + m > *cap) {
        int64_t nc = *cap ? *cap : 256;
        while (nc < *n + m)
            nc *= 2;
        int32_t *p = realloc(*ids, (size_t)nc * sizeof *p);
        if (!p)
            return lm_errorf(err, LM_ERR_NOMEM, "tokenizer: cannot grow the id buffer to %lld ids",
                             (long long)nc);
        *ids = p;
        *cap = nc;
    }
    memcpy(*ids + *n, src, (size_t)m * sizeof *src);
    *n += m;
    return LM_OK;
}

static int heap_less(const heap_ent *a, const heap_ent *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(lm_tokenizer *t, int64_t *hn, heap_ent e) {
    int64_t i = (*hn)++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!heap_less(&e, &t->heap[p]))
            break;
        t->heap[i] = t->heap[p];
        i = p;
    }
    t->heap[i] = e;
}

static heap_ent heap_pop(lm_tokenizer *t, int64_t *hn) {
    heap_ent top = t->heap[0], last = t->heap[--(*hn)];
    int64_t i = 0, n = *hn;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && heap_less(&t->heap[c + 1], &t->heap[c]))
            c++;
        if (!heap_less(&t->heap[c], &last))
            break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (n)
        t->heap[i] = last;
    return top;
}

static void try_pair(lm_tokenizer *t, int64_t *hn, int32_t pos) {
    int32_t r = t->s_next[pos];
    if (r < 0)
        return;
    const merge_slot *m = merge_find(t, t->s_id[pos], t->s_id[r]);
    if (m)
        heap_push(t, hn, (heap_ent){m->rank, pos, t->s_id[pos], t->s_id[r]});
}

/* BPE of one piece (n >= 1 bytes) into t->piece_ids; returns the id count or -1 on
 * allocation failure. Symbols are indexed by the position of their first byte. */
static int64_t bpe_piece(lm_tokenizer *t, const uint8_t *p, int64_t n) {
    if (n > t->s_cap) {
        int64_t c = n < 1024 ? 1024 : n;
        int32_t *a = realloc(t->s_id, (size_t)c * sizeof *a);
        if (a)
            t->s_id = a;
        int32_t *b = realloc(t->s_next, (size_t)c * sizeof *b);
        if (b)
            t->s_next = b;
        int32_t *d = realloc(t->s_prev, (size_t)c * sizeof *d);
        if (d)
            t->s_prev = d;
        int32_t *e = realloc(t->piece_ids, (size_t)c * sizeof *e);
        if (e)
            t->piece_ids = e;
        if (!a || !b || !d || !e)
            return -1;
        t->s_cap = c;
    }
    /* each merge pushes at most 2 entries: n - 1 initial + 2 (n - 1) */
    if (3 * n > t->heap_cap) {
        heap_ent *h = realloc(t->heap, (size_t)(3 * n) * sizeof *h);
        if (!h)
            return -1;
        t->heap = h;
        t->heap_cap = 3 * n;
    }
    for (int64_t i = 0; i < n; i++) {
        t->s_id[i] = t->byte_id[p[i]];
        t->s_next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
        t->s_prev[i] = (int32_t)i - 1;
    }
    int64_t hn = 0;
    for (int32_t i = 0; i + 1 < n; i++)
        try_pair(t, &hn, i);
    while (hn > 0) {
        heap_ent e = heap_pop(t, &hn);
        int32_t r = t->s_next[e.pos];
        /* stale when the left symbol was absorbed (s_id = -1) or either side changed */
        if (t->s_id[e.pos] != e.left || r < 0 || t->s_id[r] != e.right)
            continue;
        t->s_id[e.pos] = merge_find(t, e.left, e.right)->merged;
        t->s_id[r] = -1;
        t->s_next[e.pos] = t->s_next[r];
        if (t->s_next[r] >= 0)
            t->s_prev[t->s_next[r]] = e.pos;
        if (t->s_prev[e.pos] >= 0)
            try_pair(t, &hn, t->s_prev[e.pos]);
        try_pair(t, &hn, e.pos);
    }
    int64_t m = 0;
    for (int32_t i = 0; i >= 0; i = t->s_next[i])
        t->piece_ids[m++] = t->s_id[i];
    return m;
}

/* The slot holding piece p, or the empty slot where it would go. */
static cache_slot *cache_find(lm_tokenizer *t, const uint8_t *p, size_t n, uint64_t h) {
    for (uint64_t i = h & t->cache.mask;; i = (i + 1) & t->cache.mask) {
        cache_slot *s = &t->cache.slots[i];
        if (s->off < 0)
            return s;
        if (s->hash != h)
            continue;
        uint32_t kl;
        memcpy(&kl, t->cache.buf + s->off, 4);
        if (kl == n && memcmp(t->cache.buf + s->off + 8, p, n) == 0)
            return s;
    }
}

/* Store ids for piece p (cache entry: u32 key length, u32 id count, key, ids). */
static void cache_store(lm_tokenizer *t, const uint8_t *p, size_t n, uint64_t h, const int32_t *ids,
                        int64_t m) {
    size_t need = 8 + n + (size_t)m * 4;
    if (t->cache.used + need > CACHE_MAX_BYTES) { /* start over */
        for (uint64_t i = 0; i <= t->cache.mask; i++)
            t->cache.slots[i].off = -1;
        t->cache.count = 0;
        t->cache.used = 0;
    }
    if ((uint64_t)(t->cache.count + 1) * 4 > (t->cache.mask + 1) * 3) { /* grow the table */
        uint64_t nm = 2 * (t->cache.mask + 1) - 1;
        cache_slot *ns = malloc((nm + 1) * sizeof *ns);
        if (!ns)
            return; /* caching is optional */
        for (uint64_t i = 0; i <= nm; i++)
            ns[i].off = -1;
        for (uint64_t i = 0; i <= t->cache.mask; i++) {
            cache_slot s = t->cache.slots[i];
            if (s.off < 0)
                continue;
            uint64_t j = s.hash & nm;
            while (ns[j].off >= 0)
                j = (j + 1) & nm;
            ns[j] = s;
        }
        free(t->cache.slots);
        t->cache.slots = ns;
        t->cache.mask = nm;
    }
    if (t->cache.used + need > t->cache.cap) {
        size_t nc = t->cache.cap ? t->cache.cap : (size_t)1 << 20;
        while (nc < t->cache.used + need)
            nc *= 2;
        uint8_t *nb = realloc(t->cache.buf, nc);
        if (!nb)
            return;
        t->cache.buf = nb;
        t->cache.cap = nc;
    }
    cache_slot *cs = cache_find(t, p, n, h);
    uint8_t *e = t->cache.buf + t->cache.used;
    uint32_t kl = (uint32_t)n, nm = (uint32_t)m;
    memcpy(e, &kl, 4);
    memcpy(e + 4, &nm, 4);
    memcpy(e + 8, p, n);
    memcpy(e + 8 + n, ids, (size_t)m * 4);
    cs->hash = h;
    cs->off = (int64_t)t->cache.used;
    t->cache.used += need;
    t->cache.count++;
}

static lm_status encode_piece(lm_tokenizer *t, const uint8_t *p, size_t n, int32_t **ids,
                              int64_t *nids, int64_t *cap, lm_error *err) {
    uint64_t h = 0;
    if (n <= CACHE_MAX_KEY) {
        h = hash_bytes(p, n);
        int64_t off = cache_find(t, p, n, h)->off;
        if (off >= 0) {
            uint32_t m;
            memcpy(&m, t->cache.buf + off + 4, 4);
            /* ids may sit unaligned in the cache: copy through a small buffer */
            int32_t tmp[64];
            const uint8_t *src = t->cache.buf + off + 8 + n;
            for (uint32_t done = 0; done < m;) {
                uint32_t k = m - done < 64 ? m - done : 64;
                memcpy(tmp, src + (size_t)done * 4, (size_t)k * 4);
                LM_TRY(push_ids(tmp, k, ids, nids, cap, err));
                done += k;
            }
            return LM_OK;
        }
    }
    int32_t whole = str_find(t, p, n);
    if (whole >= 0)
        return push_ids(&whole, 1, ids, nids, cap, err);
    int64_t m = bpe_piece(t, p, (int64_t)n);
    if (m < 0)
        return lm_errorf(err, LM_ERR_NOMEM, "tokenizer: out of memory encoding a %zu-byte piece",
                         n);
    if (n <= CACHE_MAX_KEY)
        cache_store(t, p, n, h, t->piece_ids, m);
    return push_ids(t->piece_ids, m, ids, nids, cap, err);
}

lm_status lm_tokenizer_encode(lm_tokenizer *t, const char *text, size_t len, int32_t **ids,
                              int64_t *n, int64_t *cap, lm_error *err) {
    if (len == 0)
        return LM_OK;
    if (!text)
        return lm_errorf(err, LM_ERR_INVALID, "tokenizer encode: text is NULL with len %zu", len);
    const uint8_t *s = (const uint8_t *)text;
    if (t->kind == LM_TOK_BYTE) {
        int32_t buf[1024];
        for (size_t i = 0; i < len;) {
            size_t k = len - i < 1024 ? len - i : 1024;
            for (size_t j = 0; j < k; j++)
                buf[j] = s[i + j];
            LM_TRY(push_ids(buf, (int64_t)k, ids, n, cap, err));
            i += k;
        }
        return LM_OK;
    }
    if (len > (size_t)INT32_MAX / 2)
        return lm_errorf(err, LM_ERR_INVALID,
                         "tokenizer encode: %zu bytes in one call (encode at most %d; split the "
                         "text)",
                         len, INT32_MAX / 2);
    size_t pos = 0;
    while (pos < len) {
        int rc = pcre2_match(t->re, s, len, pos, 0, t->md, NULL);
        size_t ms = len, me = len;
        if (rc >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(t->md);
            ms = ov[0];
            me = ov[1];
            LM_CHECK(ms >= pos && me > ms && me <= len);
        } else if (rc != PCRE2_ERROR_NOMATCH) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return lm_errorf(err, LM_ERR_INVALID, "tokenizer encode: PCRE2 match at byte %zu: %s",
                             pos, (const char *)msg);
        }
        if (ms > pos) /* bytes no alternative matches: invalid UTF-8 */
            LM_TRY(encode_piece(t, s + pos, ms - pos, ids, n, cap, err));
        if (me > ms)
            LM_TRY(encode_piece(t, s + ms, me - ms, ids, n, cap, err));
        pos = me;
    }
    return LM_OK;
}

lm_status lm_tokenizer_encode_documents(lm_tokenizer *t, const char *text, size_t len,
                                        lm_docsep sep, int32_t **ids, int64_t *n, int64_t *cap,
                                        int64_t *n_docs, int64_t *doc_bytes, lm_error *err) {
    int64_t docs = 0, bytes = 0;
    if (sep != LM_DOCSEP_FORMFEED && sep != LM_DOCSEP_BLANK && sep != LM_DOCSEP_NONE)
        return lm_errorf(err, LM_ERR_INVALID, "tokenizer: unknown document separator mode %d",
                         (int)sep);
    size_t doc_start = 0, pos = 0;
    int32_t eot = t->eot;
    while (pos <= len) {
        /* the line [pos, e) and its terminator; at the end of text, a final flush */
        size_t e = pos, next;
        int is_sep = 0;
        if (pos == len) {
            next = len + 1;
        } else {
            const char *nl = memchr(text + pos, '\n', len - pos);
            e = nl ? (size_t)(nl - text) : len;
            next = nl ? e + 1 : len;
            if (sep == LM_DOCSEP_FORMFEED)
                is_sep = e - pos == 1 && text[pos] == '\f';
            else if (sep == LM_DOCSEP_BLANK)
                is_sep = e == pos && nl != NULL;
        }
        if (is_sep || pos == len) {
            if (pos > doc_start) {
                LM_TRY(lm_tokenizer_encode(t, text + doc_start, pos - doc_start, ids, n, cap, err));
                LM_TRY(push_ids(&eot, 1, ids, n, cap, err));
                docs++;
                bytes += (int64_t)(pos - doc_start);
            }
            doc_start = next;
        }
        pos = next;
    }
    if (n_docs)
        *n_docs = docs;
    if (doc_bytes)
        *doc_bytes = bytes;
    return LM_OK;
}

/* ---------------------------------------------------------------- decode */

lm_status lm_tokenizer_decode(const lm_tokenizer *t, const int32_t *ids, int64_t n, char **out,
                              size_t *out_len, lm_error *err) {
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->vocab)
            return lm_errorf(err, LM_ERR_INVALID,
                             "tokenizer decode: id %d at position %lld is outside [0, %d) (%s "
                             "vocabulary)",
                             ids[i], (long long)i, t->vocab, lm_tokenizer_name(t));
        total += (size_t)(t->tok_off[ids[i] + 1] - t->tok_off[ids[i]]);
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return lm_errorf(err, LM_ERR_NOMEM, "tokenizer decode: cannot allocate %zu bytes", total);
    size_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        size_t l = (size_t)(t->tok_off[ids[i] + 1] - t->tok_off[ids[i]]);
        memcpy(buf + o, t->tok_bytes + t->tok_off[ids[i]], l);
        o += l;
    }
    buf[o] = '\0';
    *out = buf;
    *out_len = o;
    return LM_OK;
}

int lm_tokenizer_stream_push(const lm_tokenizer *t, lm_tokenizer_stream *s, int32_t id, char *buf,
                             size_t buf_size) {
    if (id < 0 || id >= t->vocab || s->npend < 0 || s->npend > 3)
        return -1;
    size_t l = (size_t)(t->tok_off[id + 1] - t->tok_off[id]);
    size_t total = (size_t)s->npend + l;
    if (buf_size < total)
        return -1;
    memcpy(buf, s->pend, (size_t)s->npend);
    memcpy(buf + s->npend, t->tok_bytes + t->tok_off[id], l);
    size_t cut = utf8_complete_prefix((const uint8_t *)buf, total);
    s->npend = (int)(total - cut);
    memcpy(s->pend, buf + cut, (size_t)s->npend);
    return (int)cut;
}

int lm_tokenizer_stream_flush(lm_tokenizer_stream *s, char *buf, size_t buf_size) {
    if (s->npend < 0 || s->npend > (int)sizeof s->pend || buf_size < (size_t)s->npend)
        return -1;
    int n = s->npend;
    memcpy(buf, s->pend, (size_t)n);
    s->npend = 0;
    return n;
}
