/* The tokenizer oracle (issue 5 item 3): linmoe's GPT-2 BPE against js-tiktoken 1.0.21
 * (encoding r50k_base, an independent implementation) run by node through
 * scripts/data/tiktoken_oracle.js. The ids must be identical for
 *  - the whole Brown validation split, as `linmoe tokenize --tokenizer gpt2` writes it
 *    (documents + <|endoftext|>, read back from the shard) and as one text;
 *  - a list of hard strings: whitespace runs, contractions, emoji, CJK, combining
 *    marks, control bytes, numbers, long repeats.
 * Plus, with the real vocabulary: decode(encode(x)) == x for those strings and for
 * random bytes (invalid UTF-8 included), and streaming decode of the validation split.
 *
 * Known, deliberate difference: JavaScript's \s lacks U+0085 and has U+FEFF, while the
 * reference GPT-2 tokenizers (Python `regex`, tiktoken's Rust) use Unicode White_Space
 * and so does linmoe (src/data/tokenizer.c). Strings with those two code points are
 * checked piece by piece instead: linmoe's ids must equal js-tiktoken's ids of the
 * White_Space pieces encoded one at a time.
 *
 * Needs data/ (scripts/fetch-data.sh) and node; without them the test FAILS and says
 * so - it never skips.
 */
/* cmocka.h needs these first */
/* clang-format off */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
/* clang-format on */

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_util.h"
#include "test_util.h"

#include "linmoe/core.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#define VAL "data/brown/val.txt"
#define NPM "data/npm"
#define ORACLE "scripts/data/tiktoken_oracle.js"

/* ---------------------------------------------------------------- the strings */

/* clang-format off */
/* Non-ASCII is written as \u / \U escapes (UTF-8 in the string, GCC's execution
 * charset); code points below U+00A0 as hex bytes. */
static const char *const k_hard[] = {
    /* whitespace runs */
    "a  b", "a   b", "   leading", "trailing   ", "\t\tTabs\t", "\n\n\nnewlines\n\n", " \n \n ",
    "\r\n\r\n", "a \t\n b", "    ", "x                                                  y",
    "a\u00a0b", "a\u00a0 b", "\u3000x", "\u2003em space", "a\u2028b", "1  2   3",
    "end with newline\n", " ", "\n", "a\n\n\n\n\n\nb", "\t \t \t x", "\v\v x",
    /* contractions (case-sensitive in GPT-2) */
    "don't", "I'm", "you're", "we've", "they'll", "he'd", "it's", "DON'T", "I'M", "'s'", "''",
    "'''t", "rock 'n' roll", "o'clock", "'ll've", "can't won't shan't", " 's", "x's's",
    /* emoji: plain, skin tone, ZWJ family, flag, variation selector */
    "\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200d\U0001F469\u200d\U0001F467",
    "\U0001F1FA\U0001F1F8", "a\U0001F600b", " \U0001F600\U0001F600", "\u2764\ufe0f",
    "I \u2764\ufe0f NY",
    /* CJK and other scripts */
    "\u4f60\u597d\uff0c\u4e16\u754c", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", "\u4e2d\u6587 English \u6df7\u5408",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    /* combining marks */
    "e\u0301", "n\u0303a", "Z\u0351\u0352\u0353a\u030a", "\u0915\u094d\u0937",
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd", " \u0301\u0301x", "caf\u00e9 cafe\u0301",
    /* control bytes (valid UTF-8: C0 controls, DEL, C1 controls; NUL is in k_repeats) */
    "\x01\x02\x03", "a\x01" "b", "\x1b[31mred\x1b[0m", "\x7f", "\xc2\x80\xc2\x9f", "\f\v",
    "tab\there", "bell\x07\x07", "\x1f \x1e",
    /* numbers */
    "3.14159", "1,000,000", "\uff12\uff10\uff12\uff14", "\u216b", "\u00bd cup", "0x7fffffff",
    " 42 is the answer",
    /* odds and ends */
    "<|endoftext|>", "Hello<|endoftext|>World", "https://example.com/a?b=c&d=e#f",
    "int main(void) { return 0; }", "\\", "\"quoted\"", "1/2'' pipe", "...!?;:", "$$$ %%% ^^^",
    "\ufffd", "\uffff", "\U0010ffff",
    NULL};

/* Long repeats, built at run time: unit (unit_len bytes; 0 = strlen), count. */
static const struct {
    const char *unit;
    int unit_len, count;
} k_repeats[] = {
    {"a", 0, 1500}, {" ", 0, 1500}, {"ab", 0, 600}, {"\U0001F600", 0, 200}, {"-", 0, 1500},
    {"0", 0, 800}, {"=\n", 0, 300}, {"hello ", 0, 300}, {"\n", 0, 500}, {" \t", 0, 400},
    {"\u4e00", 0, 400}, {"'s", 0, 300}, {"", 1, 40}, {"a\0 ", 3, 40},
};
#define N_REPEATS ((int)(sizeof k_repeats / sizeof k_repeats[0]))

/* Strings where JavaScript's \s differs from White_Space, with linmoe's pieces. */
static const struct {
    const char *text;
    const char *pieces[6];
} k_divergent[] = {
    {"a \xc2\x85" "b", {"a", " ", "\xc2\x85", "b", NULL}},
    {"x\xc2\x85\xc2\x85 y", {"x", "\xc2\x85\xc2\x85", " y", NULL}},
    {"a \ufeffb", {"a", " \ufeff", "b", NULL}},
    {"\ufeffhello world", {"\ufeff", "hello", " world", NULL}},
};
/* clang-format on */
#define N_DIVERGENT ((int)(sizeof k_divergent / sizeof k_divergent[0]))

/* ---------------------------------------------------------------- helpers */

static char g_tmp[64];

static int setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/linmoe_test_oracle_XXXXXX");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static char *read_file(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    size_t got = fread(b, 1, (size_t)sz, f);
    fclose(f);
    b[got] = '\0';
    *n = got;
    return b;
}

/* Every prerequisite, or a failure that says what to run. */
static void require_data(void) {
    static const char *const need[] = {"data/gpt2/vocab.json",
                                       "data/gpt2/merges.txt",
                                       VAL,
                                       "data/brown/manifest.json",
                                       NPM "/node_modules/js-tiktoken/package.json",
                                       NPM "/node_modules/base64-js/package.json",
                                       ORACLE};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (access(need[i], R_OK) != 0)
            fail_msg("tokenizer oracle: %s is missing (cwd must be the repository root). Run "
                     "scripts/fetch-data.sh first (it needs node and npm: "
                     "scripts/install-deps.sh installs them).",
                     need[i]);
    if (system("node --version >/dev/null 2>&1") != 0)
        fail_msg("tokenizer oracle: node is not installed; run scripts/install-deps.sh, then "
                 "scripts/fetch-data.sh.");
}

typedef struct {
    int32_t *v;
    int64_t n;
} idvec;

/* Parse one line of space-separated ids. */
static idvec parse_line(const char **p) {
    idvec r = {NULL, 0};
    int64_t cap = 0;
    const char *s = *p;
    while (*s && *s != '\n') {
        char *end;
        long v = strtol(s, &end, 10);
        assert_true(end != s);
        if (r.n == cap) {
            cap = cap ? 2 * cap : 1024;
            r.v = realloc(r.v, (size_t)cap * sizeof *r.v);
        }
        r.v[r.n++] = (int32_t)v;
        s = end;
        while (*s == ' ')
            s++;
    }
    *p = *s ? s + 1 : s;
    return r;
}

static idvec lm_encode(lm_tokenizer *t, const char *s, size_t n) {
    idvec r = {NULL, 0};
    int64_t cap = 0;
    lm_error err = {0};
    lm_status st = lm_tokenizer_encode(t, s, n, &r.v, &r.n, &cap, &err);
    if (st != LM_OK)
        fail_msg("encode: %s", err.msg);
    return r;
}

/* Print a short escaped excerpt of s. */
static void show(const char *what, const char *s, size_t n) {
    print_message("%s: \"", what);
    for (size_t i = 0; i < n && i < 120; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
            print_message("%c", c);
        else
            print_message("\\x%02x", c);
    }
    print_message("%s\" (%zu bytes)\n", n > 120 ? "..." : "", n);
}

/* Compare ids; on a mismatch show where, with both sides' neighbourhoods. */
static int same_ids(const char *what, const idvec *got, const idvec *want) {
    int64_t i = 0;
    while (i < got->n && i < want->n && got->v[i] == want->v[i])
        i++;
    if (i == got->n && i == want->n)
        return 1;
    print_message("%s: ids differ at %lld (linmoe %lld ids, js-tiktoken %lld ids)\n  linmoe:", what,
                  (long long)i, (long long)got->n, (long long)want->n);
    for (int64_t k = i < 3 ? 0 : i - 3; k < got->n && k < i + 5; k++)
        print_message(" %d", got->v[k]);
    print_message("\n  js-tiktoken:");
    for (int64_t k = i < 3 ? 0 : i - 3; k < want->n && k < i + 5; k++)
        print_message(" %d", want->v[k]);
    print_message("\n");
    return 0;
}

/* 1 when s[0..n) is complete, valid UTF-8 (no surrogates, overlongs, > U+10FFFF). */
static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
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

/* decode(encode(s)) == s; and streaming decode gives s back in chunks that are each
 * complete UTF-8 when s is valid UTF-8 (GPT-2 splits most non-ASCII characters
 * across tokens, so this exercises the hold-back). */
static void check_roundtrip(lm_tokenizer *t, const char *s, size_t n, int valid) {
    idvec ids = lm_encode(t, s, n);
    char *back;
    size_t blen;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_decode(t, ids.v, ids.n, &back, &blen, &err), LM_OK);
    if (blen != n || memcmp(back, s, n) != 0)
        show("round trip failed for", s, n);
    assert_int_equal(blen, n);
    assert_memory_equal(back, s, n);
    lm_tokenizer_stream ss = {{0}, 0};
    char buf[LM_TOKENIZER_STREAM_BUF];
    size_t at = 0;
    for (int64_t i = 0; i < ids.n; i++) {
        int k = lm_tokenizer_stream_push(t, &ss, ids.v[i], buf, sizeof buf);
        assert_true(k >= 0 && at + (size_t)k <= n);
        if (valid && !valid_utf8((const unsigned char *)buf, (size_t)k))
            show("stream chunk is not complete UTF-8 for", s, n);
        if (valid)
            assert_true(valid_utf8((const unsigned char *)buf, (size_t)k));
        assert_memory_equal(buf, s + at, (size_t)k);
        at += (size_t)k;
    }
    int k = lm_tokenizer_stream_flush(&ss, buf, sizeof buf);
    assert_true(k >= 0);
    if (valid)
        assert_int_equal(k, 0);
    assert_memory_equal(buf, s + at, (size_t)k);
    assert_int_equal(at + (size_t)k, n);
    free(back);
    free(ids.v);
}

/* ---------------------------------------------------------------- the test */

static void test_oracle(void **state) {
    (void)state;
    require_data();
    double t0 = lm_time_sec();

    /* inputs: every text in its own file */
    int n_hard = 0;
    while (k_hard[n_hard])
        n_hard++;
    int n_div_pieces = 0;
    for (int d = 0; d < N_DIVERGENT; d++)
        for (int k = 0; k_divergent[d].pieces[k]; k++)
            n_div_pieces++;
    int n_items = 2 + n_hard + N_REPEATS + n_div_pieces;
    char **texts = calloc((size_t)n_items, sizeof *texts);
    size_t *lens = calloc((size_t)n_items, sizeof *lens);
    size_t cmd_cap = 65536, cl = 0;
    char *cmd = malloc(cmd_cap);
    char out_path[256];
    snprintf(out_path, sizeof out_path, "%s/oracle.txt", g_tmp);
    cl += (size_t)snprintf(cmd + cl, cmd_cap - cl, "node %s %s %s docs:%s text:%s", ORACLE, NPM,
                           out_path, VAL, VAL);
    for (int i = 2; i < n_items; i++) {
        int h = i - 2;
        if (h < n_hard) {
            texts[i] = strdup(k_hard[h]);
            lens[i] = strlen(k_hard[h]);
        } else if (h < n_hard + N_REPEATS) {
            int r = h - n_hard;
            size_t ul =
                k_repeats[r].unit_len ? (size_t)k_repeats[r].unit_len : strlen(k_repeats[r].unit);
            lens[i] = ul * (size_t)k_repeats[r].count;
            texts[i] = malloc(lens[i] + 1);
            for (int c = 0; c < k_repeats[r].count; c++)
                memcpy(texts[i] + (size_t)c * ul, k_repeats[r].unit, ul);
            texts[i][lens[i]] = '\0';
        } else {
            int p = h - n_hard - N_REPEATS;
            for (int d = 0; d < N_DIVERGENT; d++)
                for (int k = 0; k_divergent[d].pieces[k]; k++)
                    if (p-- == 0) {
                        texts[i] = strdup(k_divergent[d].pieces[k]);
                        lens[i] = strlen(texts[i]);
                    }
        }
        char path[256];
        snprintf(path, sizeof path, "%s/t%03d.txt", g_tmp, i);
        write_file(path, texts[i], lens[i]);
        cl += (size_t)snprintf(cmd + cl, cmd_cap - cl, " text:%s", path);
        assert_true(cl < cmd_cap - 512);
    }
    cl += (size_t)snprintf(cmd + cl, cmd_cap - cl, " 2>&1");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char msg[4096];
    size_t ml = fread(msg, 1, sizeof msg - 1, p);
    msg[ml] = '\0';
    int rc = pclose(p);
    if (rc != 0)
        fail_msg("tokenizer oracle: `%s` failed (status %d): %s\nRun scripts/fetch-data.sh.", cmd,
                 rc, msg);
    free(cmd);
    double t_node = lm_time_sec() - t0;
    size_t olen;
    char *oracle = read_file(out_path, &olen);
    assert_non_null(oracle);
    const char *cur = oracle;

    lm_tokenizer *t;
    lm_error err = {0};
    lm_status st = lm_tokenizer_gpt2(&t, "data/gpt2", &err);
    if (st != LM_OK)
        fail_msg("%s (run scripts/fetch-data.sh)", err.msg);
    int64_t compared = 0;
    int ok = 1;

    /* 1. the validation split through `linmoe tokenize`, read back from the shard */
    char shard[256], out[4096];
    snprintf(shard, sizeof shard, "%s/val.bin", g_tmp);
    rc = lm_run_cli(out, sizeof out, "tokenize --tokenizer gpt2 --in %s --out '%s'", VAL, shard);
    if (rc != 0)
        fail_msg("linmoe tokenize failed (%d): %s", rc, out);
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, shard, &err), LM_OK);
    assert_int_equal(lm_shard_validate(&s, &err), LM_OK);
    assert_int_equal(s.vocab, 50257);
    idvec from_shard = {malloc(s.count * sizeof(int32_t)), (int64_t)s.count};
    int64_t eots = 0;
    for (uint64_t i = 0; i < s.count; i++) {
        from_shard.v[i] = lm_shard_get(&s, i);
        eots += from_shard.v[i] == 50256;
    }
    lm_shard_close(&s);
    idvec js = parse_line(&cur);
    ok &= same_ids("Brown val (documents, via linmoe tokenize)", &from_shard, &js);
    compared += js.n;
    /* the manifest agrees: 50 documents */
    size_t mlen;
    char *mtext = read_file("data/brown/manifest.json", &mlen);
    cJSON *man = cJSON_Parse(mtext);
    assert_non_null(man);
    cJSON *vd = cJSON_GetObjectItem(cJSON_GetObjectItem(man, "val"), "documents");
    assert_non_null(vd);
    assert_int_equal(eots, vd->valueint);
    cJSON_Delete(man);
    free(mtext);

    /* 2. the validation split as one text (form feeds included) */
    size_t vlen;
    char *val = read_file(VAL, &vlen);
    assert_non_null(val);
    idvec mine = lm_encode(t, val, vlen);
    free(js.v);
    js = parse_line(&cur);
    ok &= same_ids("Brown val (one text)", &mine, &js);
    compared += js.n;
    /* streaming decode of it: complete characters only, concatenating to the text */
    {
        lm_tokenizer_stream ss = {{0}, 0};
        char buf[LM_TOKENIZER_STREAM_BUF];
        size_t at = 0;
        int stream_ok = 1;
        for (int64_t i = 0; i < mine.n && stream_ok; i++) {
            int k = lm_tokenizer_stream_push(t, &ss, mine.v[i], buf, sizeof buf);
            stream_ok = k >= 0 && at + (size_t)k <= vlen && memcmp(val + at, buf, (size_t)k) == 0;
            at += (size_t)(k > 0 ? k : 0);
        }
        assert_true(stream_ok);
        assert_int_equal(lm_tokenizer_stream_flush(&ss, buf, sizeof buf), 0);
        assert_int_equal(at, vlen);
    }
    free(mine.v);
    free(js.v);

    /* 3. hard strings and long repeats */
    for (int i = 2; i < 2 + n_hard + N_REPEATS; i++) {
        mine = lm_encode(t, texts[i], lens[i]);
        js = parse_line(&cur);
        if (!same_ids(i - 2 < n_hard ? "hard string" : "long repeat", &mine, &js)) {
            show("  text", texts[i], lens[i]);
            ok = 0;
        }
        compared += js.n;
        free(mine.v);
        free(js.v);
        check_roundtrip(t, texts[i], lens[i], 1);
    }

    /* 4. the known \s divergence: linmoe == js-tiktoken piece by piece */
    for (int d = 0; d < N_DIVERGENT; d++) {
        const char *txt = k_divergent[d].text;
        idvec want = {NULL, 0};
        for (int k = 0; k_divergent[d].pieces[k]; k++) {
            js = parse_line(&cur);
            want.v = realloc(want.v, (size_t)(want.n + js.n + 1) * sizeof *want.v);
            memcpy(want.v + want.n, js.v, (size_t)js.n * sizeof *js.v);
            want.n += js.n;
            free(js.v);
        }
        mine = lm_encode(t, txt, strlen(txt));
        if (!same_ids("White_Space piece split", &mine, &want)) {
            show("  text", txt, strlen(txt));
            ok = 0;
        }
        compared += want.n;
        free(mine.v);
        free(want.v);
        check_roundtrip(t, txt, strlen(txt), 1);
    }

    /* 5. round trips of arbitrary bytes with the real vocabulary */
    lm_rng r;
    lm_rng_init(&r, 2024);
    for (int trial = 0; trial < 50; trial++) {
        char b[3000];
        size_t n = lm_rng_u32(&r) % sizeof b;
        for (size_t i = 0; i < n; i++) {
            uint32_t u = lm_rng_u32(&r);
            /* half the trials: mostly ASCII with some high bytes, so BPE merges happen */
            b[i] = (char)(trial % 2 ? u : (u % 8 ? 32 + u % 95 : u));
        }
        check_roundtrip(t, b, n, 0);
    }

    print_message("tokenizer oracle: %lld ids compared with js-tiktoken r50k_base (%d hard "
                  "strings, %d long repeats, %d White_Space splits, Brown val twice); node %.2f s, "
                  "total %.2f s\n",
                  (long long)compared, n_hard, N_REPEATS, N_DIVERGENT, t_node, lm_time_sec() - t0);
    assert_true(ok);
    assert_true(compared > 250000);

    free(from_shard.v);
    free(val);
    free(oracle);
    for (int i = 0; i < n_items; i++)
        free(texts[i]);
    free(texts);
    free(lens);
    lm_tokenizer_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_oracle),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
