/* Tokenizers without downloaded data (tokenizer.h; the GPT-2 vocabulary itself is
 * tested in tests/test_tokenizer_oracle.c):
 *  - byte tokenizer: ids are the bytes, decode(encode(x)) == x for random bytes;
 *  - GPT-2 BPE machinery on a small hand-made vocabulary written in GPT-2's file
 *    formats: ids worked out by hand (merge order, the pre-tokenizer's splits of
 *    contractions and whitespace runs, invalid UTF-8 as its own piece), equality with
 *    a naive fp-free reference of the merge loop (Sennrich et al. 2016) on random
 *    strings, round trips of random bytes, loader errors naming file and entry;
 *  - streaming decode: only complete UTF-8 comes out, and the pieces concatenate to
 *    the full decode, for valid and broken UTF-8;
 *  - document splitting (ff / blank / none) and `linmoe tokenize` end to end.
 */
/* cmocka.h needs these first */
/* clang-format off */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
/* clang-format on */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_util.h"
#include "test_util.h"

#include "linmoe/core.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

/* ---------------------------------------------------------------- helpers */

static char g_tmp[64];

static int setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/linmoe_test_tok_XXXXXX");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *tmp_path(const char *name) {
    static char buf[8][512];
    static int next;
    char *p = buf[next];
    next = (next + 1) % 8;
    snprintf(p, 512, "%s/%s", g_tmp, name);
    return p;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void encode_ok(lm_tokenizer *t, const char *s, size_t n, int32_t **ids, int64_t *nids) {
    int64_t cap = 0;
    *ids = NULL;
    *nids = 0;
    lm_error err = {0};
    lm_status st = lm_tokenizer_encode(t, s, n, ids, nids, &cap, &err);
    if (st != LM_OK)
        print_message("encode: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void assert_ids(lm_tokenizer *t, const char *s, const int32_t *want, int64_t nwant) {
    int32_t *ids;
    int64_t n;
    encode_ok(t, s, strlen(s), &ids, &n);
    int same = n == nwant && (n == 0 || memcmp(ids, want, (size_t)n * sizeof *ids) == 0);
    if (!same) {
        print_message("encode(\"%s\"): got", s);
        for (int64_t i = 0; i < n; i++)
            print_message(" %d", ids[i]);
        print_message(", want");
        for (int64_t i = 0; i < nwant; i++)
            print_message(" %d", want[i]);
        print_message("\n");
    }
    assert_true(same);
    free(ids);
}

static void assert_roundtrip(lm_tokenizer *t, const char *s, size_t n) {
    int32_t *ids;
    int64_t nids;
    encode_ok(t, s, n, &ids, &nids);
    char *back;
    size_t blen;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_decode(t, ids, nids, &back, &blen, &err), LM_OK);
    assert_int_equal(blen, n);
    assert_memory_equal(back, s, n);
    assert_int_equal(back[blen], '\0');
    for (int64_t i = 0; i < nids; i++) /* encoding never makes <|endoftext|> */
        assert_true(ids[i] >= 0 && ids[i] < lm_tokenizer_vocab_size(t) &&
                    ids[i] != lm_tokenizer_eot(t));
    free(back);
    free(ids);
}

static void fill_random(uint8_t *p, size_t n, lm_rng *r) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)lm_rng_u32(r);
}

/* ---------------------------------------------------------------- byte tokenizer */

static void test_byte_roundtrip_random(void **state) {
    (void)state;
    lm_tokenizer *t;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_open(&t, "byte", NULL, &err), LM_OK);
    assert_int_equal(lm_tokenizer_kind_of(t), LM_TOK_BYTE);
    assert_string_equal(lm_tokenizer_name(t), "byte");
    assert_int_equal(lm_tokenizer_vocab_size(t), 257);
    assert_int_equal(lm_tokenizer_eot(t), 256);
    assert_int_equal(lm_tokenizer_max_token_bytes(t), 13);
    lm_rng r;
    lm_rng_init(&r, 1234);
    uint8_t buf[5000];
    for (int trial = 0; trial < 40; trial++) {
        size_t n = trial == 0 ? 0 : trial == 1 ? 1 : lm_rng_u32(&r) % sizeof buf;
        fill_random(buf, n, &r);
        int32_t *ids;
        int64_t nids;
        encode_ok(t, (const char *)buf, n, &ids, &nids);
        assert_int_equal(nids, (int64_t)n);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(ids[i], buf[i]);
        free(ids);
        assert_roundtrip(t, (const char *)buf, n);
    }
    /* <|endoftext|> decodes to its literal text; a bad id is an error naming it */
    int32_t ids[3] = {'a', 256, 'b'};
    char *out;
    size_t olen;
    assert_int_equal(lm_tokenizer_decode(t, ids, 3, &out, &olen, &err), LM_OK);
    assert_string_equal(out, "a<|endoftext|>b");
    free(out);
    int32_t bad[2] = {'a', 257};
    assert_int_equal(lm_tokenizer_decode(t, bad, 2, &out, &olen, &err), LM_ERR_INVALID);
    assert_null(out);
    lm_assert_says(err.msg, "id 257 at position 1");
    size_t l;
    assert_null(lm_tokenizer_token_bytes(t, -1, &l));
    assert_int_equal(l, 0);
    const uint8_t *p = lm_tokenizer_token_bytes(t, 256, &l);
    assert_int_equal(l, 13);
    assert_memory_equal(p, "<|endoftext|>", 13);
    lm_tokenizer_free(t);

    assert_int_equal(lm_tokenizer_open(&t, "bpe", NULL, &err), LM_ERR_INVALID);
    assert_null(t);
    lm_assert_says(err.msg, "unknown name \"bpe\"");
}

/* ---------------------------------------------------------------- a tiny GPT-2 vocab */

/* GPT-2's bytes-to-unicode table (Radford et al. 2019 §2.2), re-derived for the test. */
static uint32_t b2u(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)
        return (uint32_t)b;
    uint32_t n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174))
            n++;
    return 256 + n;
}

/* Append the UTF-8 of code point cp. */
static size_t put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2; /* the table stays below U+0800 */
}

/* Spell bytes s[0..n) in the vocabulary alphabet, JSON-escaped when json != 0. */
static void spell(char *o, const char *s, size_t n, int json) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = b2u((uint8_t)s[i]);
        if (json && (cp == '"' || cp == '\\'))
            o[k++] = '\\';
        k += put_utf8(o + k, cp);
    }
    o[k] = '\0';
}

/* Merges, in rank order, as raw bytes "left" + "right"; token 256 + rank is their
 * concatenation; <|endoftext|> is 269. Chosen so each rule below is visible in ids. */
static const struct {
    const char *l, *r;
} k_merges[] = {
    {"h", "e"},       /* 256 */
    {" ", "t"},       /* 257 */
    {" t", "he"},     /* 258 */
    {"a", "a"},       /* 259 */
    {"aa", "aa"},     /* 260 */
    {"l", "l"},       /* 261 */
    {"n", "'"},       /* 262: would win in "don't" if the contraction were not split */
    {"'", "t"},       /* 263 */
    {" ", " "},       /* 264 */
    {" ", "b"},       /* 265 */
    {"a", "\xc3"},    /* 266: a token ending inside a UTF-8 character */
    {"\xc3", "\xa9"}, /* 267: e-acute */
    {"\xff", "\xfe"}, /* 268: two bytes that are never valid UTF-8 */
    {" ", "\xc2"},    /* 269: would show " " + U+0085 taken as one piece */
};
#define N_MERGES ((int)(sizeof k_merges / sizeof k_merges[0]))
#define TINY_EOT (256 + N_MERGES)

/* Write vocab.json + merges.txt of the tiny vocabulary into directory `dir`. */
static void write_tiny_gpt2(const char *dir) {
    char *json = malloc(1 << 16), *merges = malloc(1 << 14);
    size_t j = 0, m = 0;
    char tok[64];
    j += (size_t)sprintf(json + j, "{");
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        spell(tok, &c, 1, 1);
        j += (size_t)sprintf(json + j, "%s\"%s\": %d", b ? ", " : "", tok, b);
    }
    m += (size_t)sprintf(merges + m, "#version: 0.2\n");
    for (int i = 0; i < N_MERGES; i++) {
        char cat[16];
        snprintf(cat, sizeof cat, "%s%s", k_merges[i].l, k_merges[i].r);
        spell(tok, cat, strlen(cat), 1);
        j += (size_t)sprintf(json + j, ", \"%s\": %d", tok, 256 + i);
        spell(tok, k_merges[i].l, strlen(k_merges[i].l), 0);
        m += (size_t)sprintf(merges + m, "%s ", tok);
        spell(tok, k_merges[i].r, strlen(k_merges[i].r), 0);
        m += (size_t)sprintf(merges + m, "%s\n", tok);
    }
    j += (size_t)sprintf(json + j, ", \"<|endoftext|>\": %d}", TINY_EOT);
    char p[512];
    snprintf(p, sizeof p, "%s/vocab.json", dir);
    write_file(p, json, j);
    snprintf(p, sizeof p, "%s/merges.txt", dir);
    write_file(p, merges, m);
    free(json);
    free(merges);
}

static lm_tokenizer *open_tiny(void) {
    write_tiny_gpt2(g_tmp);
    lm_tokenizer *t;
    lm_error err = {0};
    lm_status st = lm_tokenizer_open(&t, "gpt2", g_tmp, &err);
    if (st != LM_OK)
        print_message("open tiny gpt2: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
    return t;
}

static void test_gpt2_tiny_by_hand(void **state) {
    (void)state;
    lm_tokenizer *t = open_tiny();
    assert_int_equal(lm_tokenizer_kind_of(t), LM_TOK_GPT2);
    assert_int_equal(lm_tokenizer_vocab_size(t), TINY_EOT + 1);
    assert_int_equal(lm_tokenizer_eot(t), TINY_EOT);
    /* merges by rank: "he" (0) before " t" (1), then " t"+"he" (2) */
    assert_ids(t, " the", (int32_t[]){258}, 1);
    assert_ids(t, "the", (int32_t[]){'t', 256}, 2);
    /* all occurrences of the best pair, left to right: aaaaa -> aa aa a -> aaaa a */
    assert_ids(t, "aaaaa", (int32_t[]){260, 'a'}, 2);
    assert_ids(t, "aaa", (int32_t[]){259, 'a'}, 2);
    /* pieces "hello", " there" */
    assert_ids(t, "hello there", (int32_t[]){256, 261, 'o', 258, 'r', 'e'}, 6);
    /* the contraction 't is its own piece, so "n'" (rank 6) cannot form */
    assert_ids(t, "don't", (int32_t[]){'d', 'o', 'n', 263}, 4);
    /* "a  b": the whitespace run leaves its last space to the word: "a", " ", " b" */
    assert_ids(t, "a  b", (int32_t[]){'a', ' ', 265}, 3);
    /* trailing whitespace is one piece: "x", "   \n" */
    assert_ids(t, "x   \n", (int32_t[]){'x', 264, ' ', '\n'}, 4);
    /* a token may end inside a character (a + first byte of e-acute) */
    assert_ids(t, "a\xc3\xa9", (int32_t[]){266, 0xa9}, 2);
    assert_ids(t, "\xc3\xa9", (int32_t[]){267}, 1);
    /* invalid UTF-8 is a piece of its own, between "x" and "y" */
    assert_ids(t, "x\xff\xfey", (int32_t[]){'x', 268, 'y'}, 3);
    /* U+0085 (NEL) is White_Space: "a \x85b" -> "a", " ", "\x85", "b" */
    assert_ids(t, "a \xc2\x85\x62", (int32_t[]){'a', ' ', 0xc2, 0x85, 'b'}, 5);
    /* the literal text of <|endoftext|> is ordinary text */
    int32_t *ids;
    int64_t n;
    encode_ok(t, "<|endoftext|>", 13, &ids, &n);
    for (int64_t i = 0; i < n; i++)
        assert_int_not_equal(ids[i], TINY_EOT);
    free(ids);
    assert_roundtrip(t, "<|endoftext|>", 13);
    lm_tokenizer_free(t);
}

/* The merge loop done the slow, obvious way (Sennrich et al. 2016, Algorithm 1 at
 * encode time): repeatedly take the adjacent pair with the lowest merge rank and merge
 * every occurrence left to right. Symbols are byte strings. */
static int64_t ref_bpe(const char *s, int32_t *out) {
    char sym[64][16];
    int n = 0;
    for (const char *p = s; *p; p++) {
        sym[n][0] = *p;
        sym[n][1] = '\0';
        n++;
    }
    for (;;) {
        int best = -1;
        for (int i = 0; i + 1 < n; i++)
            for (int k = 0; k < N_MERGES; k++)
                if (strcmp(sym[i], k_merges[k].l) == 0 && strcmp(sym[i + 1], k_merges[k].r) == 0 &&
                    (best < 0 || k < best))
                    best = k;
        if (best < 0)
            break;
        int m = 0;
        for (int i = 0; i < n;) {
            if (i + 1 < n && strcmp(sym[i], k_merges[best].l) == 0 &&
                strcmp(sym[i + 1], k_merges[best].r) == 0) {
                snprintf(sym[m++], 16, "%s%s", k_merges[best].l, k_merges[best].r);
                i += 2;
            } else {
                memmove(sym[m++], sym[i], 16);
                i++;
            }
        }
        n = m;
    }
    for (int i = 0; i < n; i++) {
        out[i] = -1;
        if (strlen(sym[i]) == 1)
            out[i] = (uint8_t)sym[i][0];
        for (int k = 0; k < N_MERGES; k++) {
            char cat[16];
            snprintf(cat, sizeof cat, "%s%s", k_merges[k].l, k_merges[k].r);
            if (strcmp(cat, sym[i]) == 0)
                out[i] = 256 + k;
        }
    }
    return n;
}

static void test_gpt2_tiny_matches_reference(void **state) {
    (void)state;
    lm_tokenizer *t = open_tiny();
    lm_rng r;
    lm_rng_init(&r, 77);
    const char alpha[] = "aaahelt"; /* letters only: one pre-tokenizer piece */
    for (int trial = 0; trial < 2000; trial++) {
        char s[48];
        int n = 1 + (int)(lm_rng_u32(&r) % 40);
        for (int i = 0; i < n; i++)
            s[i] = alpha[lm_rng_u32(&r) % (sizeof alpha - 1)];
        s[n] = '\0';
        int32_t want[64];
        int64_t nw = ref_bpe(s, want);
        assert_ids(t, s, want, nw);
    }
    lm_tokenizer_free(t);
}

static void test_gpt2_tiny_roundtrip_random(void **state) {
    (void)state;
    lm_tokenizer *t = open_tiny();
    lm_rng r;
    lm_rng_init(&r, 99);
    /* clang-format off */
    static const char *const frags[] = {
        "a", "aa", " ", "  ", "\n", "\t", "'s", "'t", "don't", "\xc3\xa9", "\xc3", "\xa9", "\xff",
        "\xfe", "\xe2\x82", "\xf0\x9f\x98\x80", "\xed\xa0\x80", "12", " the", "<|endoftext|>",
        "\x00", "\xc2\x85", "\xef\xbb\xbf"};
    /* clang-format on */
    const int nf = (int)(sizeof frags / sizeof frags[0]);
    char buf[4096];
    for (int trial = 0; trial < 200; trial++) {
        size_t n = 0;
        if (trial % 2) { /* random bytes */
            n = lm_rng_u32(&r) % 2048;
            fill_random((uint8_t *)buf, n, &r);
        } else { /* random concatenations of awkward fragments */
            while (n < 1024) {
                const char *f = frags[lm_rng_u32(&r) % (uint32_t)nf];
                size_t l = f[0] ? strlen(f) : 1;
                memcpy(buf + n, f, l);
                n += l;
            }
        }
        assert_roundtrip(t, buf, n);
    }
    /* long runs (the heap keeps these O(n log n)) */
    static char run[200001];
    memset(run, 'a', sizeof run - 1);
    assert_roundtrip(t, run, sizeof run - 1);
    memset(run, ' ', sizeof run - 1);
    assert_roundtrip(t, run, sizeof run - 1);
    lm_tokenizer_free(t);
}

/* Loader errors: each names the file and the entry. */
static void expect_load_error(const char *vocab, const char *merges, lm_status want,
                              const char *says1, const char *says2) {
    if (vocab)
        write_file(tmp_path("vocab.json"), vocab, strlen(vocab));
    if (merges)
        write_file(tmp_path("merges.txt"), merges, strlen(merges));
    lm_tokenizer *t = (lm_tokenizer *)0x1;
    lm_error err = {0};
    lm_status st = lm_tokenizer_gpt2(&t, g_tmp, &err);
    if (st != want)
        print_message("status %d (want %d): %s\n", st, want, err.msg);
    assert_int_equal(st, want);
    assert_null(t);
    lm_assert_says(err.msg, says1);
    if (says2)
        lm_assert_says(err.msg, says2);
}

static void test_gpt2_load_errors(void **state) {
    (void)state;
    lm_tokenizer *t;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_gpt2(&t, "/nonexistent/gpt2", &err), LM_ERR_IO);
    assert_null(t);
    lm_assert_says(err.msg, "/nonexistent/gpt2/vocab.json");
    lm_assert_says(err.msg, "fetch-data.sh");

    write_tiny_gpt2(g_tmp);
    char *good_vocab;
    {
        FILE *f = fopen(tmp_path("vocab.json"), "rb");
        assert_non_null(f);
        good_vocab = calloc(1, 1 << 16);
        assert_true(fread(good_vocab, 1, (1 << 16) - 1, f) > 0);
        fclose(f);
    }
    /* not JSON */
    expect_load_error("{\"a\": 1,", NULL, LM_ERR_FORMAT, "vocab.json", "not a JSON object");
    /* an id out of range, a repeated id, a non-integer id */
    char *v = malloc(strlen(good_vocab) + 64);
    strcpy(v, good_vocab);
    char *tail = strstr(v, ", \"<|endoftext|>\"");
    assert_non_null(tail);
    strcpy(tail, ", \"<|endoftext|>\": 999}");
    expect_load_error(v, NULL, LM_ERR_FORMAT, "vocab.json", "<|endoftext|>");
    strcpy(tail, ", \"<|endoftext|>\": 5}");
    expect_load_error(v, NULL, LM_ERR_FORMAT, "id 5 is used by", NULL);
    strcpy(tail, ", \"<|endoftext|>\": 1.5}");
    expect_load_error(v, NULL, LM_ERR_FORMAT, "must be an integer", NULL);
    /* no <|endoftext|> */
    sprintf(tail, ", \"zz\": %d}", TINY_EOT);
    expect_load_error(v, NULL, LM_ERR_FORMAT, "no \"<|endoftext|>\"", NULL);
    /* a token outside the bytes-to-unicode alphabet (U+4E00) */
    sprintf(tail, ", \"\xe4\xb8\x80\": %d, \"<|endoftext|>\": %d}", TINY_EOT, TINY_EOT + 1);
    expect_load_error(v, NULL, LM_ERR_FORMAT, "is not spelled in GPT-2", NULL);
    /* two tokens with the same bytes */
    sprintf(tail, ", \"a\": %d, \"<|endoftext|>\": %d}", TINY_EOT, TINY_EOT + 1);
    expect_load_error(v, NULL, LM_ERR_FORMAT, "spell the same bytes", NULL);
    free(v);
    /* merges: unknown token, a merge whose result is missing, a malformed line */
    expect_load_error(good_vocab, "#version: 0.2\nh e\nq \xc4\xa0zz\n", LM_ERR_FORMAT,
                      "merges.txt:3", "not in vocab.json");
    expect_load_error(good_vocab, "#version: 0.2\nh e\nx y\n", LM_ERR_FORMAT, "merges.txt:3",
                      "the merge of \"x\" and \"y\"");
    expect_load_error(good_vocab, "#version: 0.2\nh e f\n", LM_ERR_FORMAT, "merges.txt:2",
                      "not a merge");
    /* a missing single byte */
    char *nob = malloc(strlen(good_vocab) + 1);
    strcpy(nob, good_vocab);
    char *a = strstr(nob, "\"a\": 97, ");
    assert_non_null(a);
    memmove(a, a + 9, strlen(a + 9) + 1);
    expect_load_error(nob, "#version: 0.2\n", LM_ERR_FORMAT, "vocab.json", NULL);
    free(nob);
    free(good_vocab);
}

/* ---------------------------------------------------------------- streaming decode */

/* 1 when s[0..n) is entirely valid, complete UTF-8. */
static int valid_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        int len = c < 0x80                   ? 1
                  : (c >= 0xC2 && c <= 0xDF) ? 2
                  : (c >= 0xE0 && c <= 0xEF) ? 3
                  : (c >= 0xF0 && c <= 0xF4) ? 4
                                             : 0;
        if (!len || i + (size_t)len > n)
            return 0;
        for (int j = 1; j < len; j++)
            if ((s[i + (size_t)j] & 0xC0) != 0x80)
                return 0;
        if ((c == 0xE0 && s[i + 1] < 0xA0) || (c == 0xED && s[i + 1] > 0x9F) ||
            (c == 0xF0 && s[i + 1] < 0x90) || (c == 0xF4 && s[i + 1] > 0x8F))
            return 0;
        i += (size_t)len;
    }
    return 1;
}

/* Stream-decode ids; every chunk must be complete UTF-8 when `text_valid`; the chunks
 * plus the flush must equal the text. */
static void check_stream(const lm_tokenizer *t, const int32_t *ids, int64_t n, const char *text,
                         size_t len, int text_valid) {
    char *acc = malloc(len + 1);
    size_t got = 0;
    lm_tokenizer_stream s = {{0}, 0};
    char buf[LM_TOKENIZER_STREAM_BUF];
    for (int64_t i = 0; i < n; i++) {
        int k = lm_tokenizer_stream_push(t, &s, ids[i], buf, sizeof buf);
        assert_true(k >= 0);
        if (text_valid)
            assert_true(valid_utf8((const uint8_t *)buf, (size_t)k));
        assert_true(got + (size_t)k <= len);
        memcpy(acc + got, buf, (size_t)k);
        got += (size_t)k;
    }
    int k = lm_tokenizer_stream_flush(&s, buf, sizeof buf);
    assert_true(k >= 0);
    if (text_valid)
        assert_int_equal(k, 0);
    memcpy(acc + got, buf, (size_t)k);
    got += (size_t)k;
    assert_int_equal(got, len);
    assert_memory_equal(acc, text, len);
    free(acc);
}

static void test_stream_decode(void **state) {
    (void)state;
    lm_tokenizer *bt;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_byte(&bt, &err), LM_OK);
    const char *text = "h\xc3\xa9llo \xf0\x9f\x98\x80 w\xc3\xb6rld \xe4\xb8\x96\xe7\x95\x8c "
                       "e\xcc\x81 \xe2\x82\xac";
    size_t len = strlen(text);
    int32_t *ids;
    int64_t n;
    encode_ok(bt, text, len, &ids, &n);
    check_stream(bt, ids, n, text, len, 1);
    free(ids);

    /* byte by byte: a 4-byte character comes out whole, at its last byte */
    lm_tokenizer_stream s = {{0}, 0};
    char buf[LM_TOKENIZER_STREAM_BUF];
    const uint8_t emoji[4] = {0xf0, 0x9f, 0x98, 0x80};
    for (int i = 0; i < 3; i++)
        assert_int_equal(lm_tokenizer_stream_push(bt, &s, emoji[i], buf, sizeof buf), 0);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, emoji[3], buf, sizeof buf), 4);
    assert_memory_equal(buf, emoji, 4);
    /* a broken sequence is released as soon as it cannot complete */
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0xe2, buf, sizeof buf), 0);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0x82, buf, sizeof buf), 0);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 'a', buf, sizeof buf), 3);
    assert_memory_equal(buf, "\xe2\x82\x61", 3); /* \x61 = 'a' */
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0xff, buf, sizeof buf), 1);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0xed, buf, sizeof buf), 0);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0xa0, buf, sizeof buf), 2); /* surrogate */
    /* a partial character at the end comes out at the flush */
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0xf0, buf, sizeof buf), 0);
    assert_int_equal(lm_tokenizer_stream_flush(&s, buf, sizeof buf), 1);
    assert_int_equal((uint8_t)buf[0], 0xf0);
    /* <|endoftext|> streams as its text; bad ids and short buffers change nothing */
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 0xc3, buf, sizeof buf), 0);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 257, buf, sizeof buf), -1);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 256, buf, 13), -1);
    assert_int_equal(s.npend, 1);
    assert_int_equal(lm_tokenizer_stream_push(bt, &s, 256, buf, sizeof buf), 14);
    assert_memory_equal(buf, "\xc3<|endoftext|>", 14);

    /* random bytes (mostly invalid UTF-8): chunks + flush == text */
    lm_rng r;
    lm_rng_init(&r, 5);
    uint8_t rnd[3000];
    fill_random(rnd, sizeof rnd, &r);
    encode_ok(bt, (const char *)rnd, sizeof rnd, &ids, &n);
    check_stream(bt, ids, n, (const char *)rnd, sizeof rnd, 0);
    free(ids);
    lm_tokenizer_free(bt);

    /* GPT-2: a token that ends inside a character */
    lm_tokenizer *gt = open_tiny();
    lm_tokenizer_stream g = {{0}, 0};
    assert_int_equal(lm_tokenizer_stream_push(gt, &g, 266, buf, sizeof buf), 1);
    assert_int_equal(buf[0], 'a');
    assert_int_equal(lm_tokenizer_stream_push(gt, &g, 0xa9, buf, sizeof buf), 2);
    assert_memory_equal(buf, "\xc3\xa9", 2);
    encode_ok(gt, text, len, &ids, &n);
    check_stream(gt, ids, n, text, len, 1);
    free(ids);
    lm_tokenizer_free(gt);
}

/* ---------------------------------------------------------------- documents */

static void check_docs(lm_tokenizer *t, const char *text, lm_docsep sep, const char *const *docs,
                       int ndocs) {
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0, nd = -1, bytes = -1;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_encode_documents(t, text, strlen(text), sep, &ids, &n, &cap, &nd,
                                                   &bytes, &err),
                     LM_OK);
    int64_t want_n = 0, want_bytes = 0;
    for (int d = 0; d < ndocs; d++) {
        want_bytes += (int64_t)strlen(docs[d]);
        want_n += (int64_t)strlen(docs[d]) + 1;
    }
    if (nd != ndocs || n != want_n)
        print_message("text \"%s\" mode %d: %lld docs %lld ids, want %d docs %lld ids\n", text,
                      (int)sep, (long long)nd, (long long)n, ndocs, (long long)want_n);
    assert_int_equal(nd, ndocs);
    assert_int_equal(bytes, want_bytes);
    assert_int_equal(n, want_n);
    int64_t k = 0;
    for (int d = 0; d < ndocs; d++) {
        for (const char *p = docs[d]; *p; p++)
            assert_int_equal(ids[k++], (uint8_t)*p);
        assert_int_equal(ids[k++], 256);
    }
    free(ids);
}

static void test_documents(void **state) {
    (void)state;
    lm_tokenizer *t;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_byte(&t, &err), LM_OK);
    check_docs(t, "ab\n\f\ncd\n", LM_DOCSEP_FORMFEED, (const char *[]){"ab\n", "cd\n"}, 2);
    check_docs(t, "\f\nab\n\f\n\f\ncd", LM_DOCSEP_FORMFEED, (const char *[]){"ab\n", "cd"}, 2);
    check_docs(t, "ab\n\f", LM_DOCSEP_FORMFEED, (const char *[]){"ab\n"}, 1);
    check_docs(t, "\f", LM_DOCSEP_FORMFEED, NULL, 0);
    check_docs(t, "", LM_DOCSEP_FORMFEED, NULL, 0);
    /* a form feed that is not alone on its line is text */
    check_docs(t, "ab\f\ncd\n\fx\n\f\r\n", LM_DOCSEP_FORMFEED,
               (const char *[]){"ab\f\ncd\n\fx\n\f\r\n"}, 1);
    check_docs(t, "ab\n\ncd\n\n\n\nef", LM_DOCSEP_BLANK, (const char *[]){"ab\n", "cd\n", "ef"}, 3);
    check_docs(t, "\nab\n \ncd\n", LM_DOCSEP_BLANK, (const char *[]){"ab\n \ncd\n"}, 1);
    check_docs(t, "ab\n\f\n\ncd", LM_DOCSEP_NONE, (const char *[]){"ab\n\f\n\ncd"}, 1);
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    assert_int_equal(
        lm_tokenizer_encode_documents(t, "x", 1, (lm_docsep)7, &ids, &n, &cap, NULL, NULL, &err),
        LM_ERR_INVALID);
    lm_tokenizer_free(t);
}

/* ---------------------------------------------------------------- the CLI */

static void assert_clean_failure(int rc, const char *out, int want_rc) {
    if (rc != want_rc || strstr(out, "Sanitizer") || strstr(out, "runtime error:"))
        print_message("exit status %d (want %d), output:\n%s\n", rc, want_rc, out);
    assert_int_equal(rc, want_rc);
    assert_null(strstr(out, "Sanitizer"));
    assert_null(strstr(out, "runtime error:"));
}

static void test_cli_tokenize(void **state) {
    (void)state;
    char out[8192];
    const char *in = tmp_path("in.txt"), *shard = tmp_path("out.bin");
    const char text[] = "Hi.\n\f\nSecond doc\xc3\xa9\n\f\n";
    write_file(in, text, sizeof text - 1);
    int rc =
        lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in '%s' --out '%s'", in, shard);
    if (rc)
        print_message("%s\n", out);
    assert_int_equal(rc, 0);
    lm_assert_says(out, "2 documents");
    lm_assert_says(out, "17 bytes");
    lm_assert_says(out, "19 tokens");
    lm_shard s;
    lm_error err = {0};
    assert_int_equal(lm_shard_open(&s, shard, &err), LM_OK);
    assert_int_equal(s.vocab, 257);
    assert_int_equal(s.width, 2);
    assert_int_equal(s.count, 19);
    assert_int_equal(lm_shard_validate(&s, &err), LM_OK);
    const char *docs[2] = {"Hi.\n", "Second doc\xc3\xa9\n"};
    uint64_t k = 0;
    for (int d = 0; d < 2; d++) {
        for (const char *p = docs[d]; *p; p++)
            assert_int_equal(lm_shard_get(&s, k++), (uint8_t)*p);
        assert_int_equal(lm_shard_get(&s, k++), 256);
    }
    lm_shard_close(&s);

    /* GPT-2 with the tiny vocabulary: " the" is one token */
    write_tiny_gpt2(g_tmp);
    write_file(in, "x the\n", 6);
    rc = lm_run_cli(out, sizeof out,
                    "tokenize --tokenizer gpt2 --gpt2-dir '%s' --in '%s' --out '%s' --doc-sep none",
                    g_tmp, in, shard);
    assert_int_equal(rc, 0);
    assert_int_equal(lm_shard_open(&s, shard, &err), LM_OK);
    assert_int_equal(s.vocab, TINY_EOT + 1);
    assert_int_equal(s.count, 4);
    assert_int_equal(lm_shard_get(&s, 0), 'x');
    assert_int_equal(lm_shard_get(&s, 1), 258);
    assert_int_equal(lm_shard_get(&s, 2), '\n');
    assert_int_equal(lm_shard_get(&s, 3), TINY_EOT);
    lm_shard_close(&s);

    /* bad input: exit 1, the message names the file, an existing OUT is untouched */
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in '%s/missing.txt' --out '%s'",
                    g_tmp, shard);
    assert_clean_failure(rc, out, 1);
    lm_assert_says(out, "missing.txt");
    write_file(in, "\f\n", 2);
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in '%s' --out '%s'", in, shard);
    assert_clean_failure(rc, out, 1);
    lm_assert_says(out, "no text");
    assert_int_equal(lm_shard_open(&s, shard, &err), LM_OK); /* still the GPT-2 shard */
    assert_int_equal(s.count, 4);
    lm_shard_close(&s);
    rc = lm_run_cli(out, sizeof out,
                    "tokenize --tokenizer gpt2 --gpt2-dir '%s/nodir' --in '%s' --out '%s'", g_tmp,
                    in, shard);
    assert_clean_failure(rc, out, 1);
    lm_assert_says(out, "nodir/vocab.json");
    write_file(tmp_path("merges.txt"), "#version: 0.2\nq zz\n", 19);
    rc = lm_run_cli(out, sizeof out,
                    "tokenize --tokenizer gpt2 --gpt2-dir '%s' --in '%s' --out '%s'", g_tmp, in,
                    shard);
    assert_clean_failure(rc, out, 1);
    lm_assert_says(out, "merges.txt:2");
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in '%s' --out '%s/nodir/x.bin'",
                    tmp_path("ok.txt"), g_tmp);
    assert_clean_failure(rc, out, 1); /* ok.txt does not exist either: names it */
    write_file(tmp_path("ok.txt"), "fine\n", 5);
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in '%s' --out '%s/nodir/x.bin'",
                    tmp_path("ok.txt"), g_tmp);
    assert_clean_failure(rc, out, 1);
    lm_assert_says(out, "nodir/x.bin");

    /* usage errors: exit 2 */
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in '%s'", in);
    assert_clean_failure(rc, out, 2);
    lm_assert_says(out, "--out");
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer wordpiece --in a --out b");
    assert_clean_failure(rc, out, 2);
    lm_assert_says(out, "wordpiece");
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in a --out b --doc-sep tab");
    assert_clean_failure(rc, out, 2);
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer byte --in a --out b --bogus");
    assert_clean_failure(rc, out, 2);
    lm_assert_says(out, "--bogus");
    rc = lm_run_cli(out, sizeof out, "tokenize --in");
    assert_clean_failure(rc, out, 2);
    rc = lm_run_cli(out, sizeof out, "tokenize --help");
    assert_int_equal(rc, 0);
    lm_assert_says(out, "--doc-sep");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_byte_roundtrip_random),
        cmocka_unit_test(test_gpt2_tiny_by_hand),
        cmocka_unit_test(test_gpt2_tiny_matches_reference),
        cmocka_unit_test(test_gpt2_tiny_roundtrip_random),
        cmocka_unit_test(test_gpt2_load_errors),
        cmocka_unit_test(test_stream_decode),
        cmocka_unit_test(test_documents),
        cmocka_unit_test(test_cli_tokenize),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
