/* Passkey documents (include/linmoe/passkey.h), byte tokenizer and (when
 * data/gpt2 holds the BPE files from scripts/fetch-data.sh) GPT-2:
 *  - exact length, for several lengths;
 *  - determinism: (seed, index) gives the same document on every call and in any
 *    order; other indices / seeds give other keys and depths;
 *  - the key sentence sits at key_pos, the question right before the answer, the
 *    answer decodes to " NNNNN." with NNNNN the key, digits_pos / digits_end bound
 *    exactly the tokens that carry digits;
 *  - the filler is prose from the shard: no <|endoftext|>, and (byte tokenizer) the
 *    two filler stretches are one consecutive run of the separator-free shard;
 *  - the depth covers the filler (not always near one end) and the digits are
 *    5-digit numbers with varied leading digits;
 *  - errors: too short, empty / too small / wrong-vocab filler.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "cli_util.h"
#include "linmoe/passkey.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

static const char *const k_docs[] = {
    "The committee met on Tuesday to discuss the new budget. Several members spoke in favour "
    "of raising the allowance for roads, while others wanted more money for schools.",
    "It was a cold morning in the valley. The farmers went out early to check on their "
    "animals, and the children walked two miles to the little school by the river.",
    "Scientists reported that the new compound could be made cheaply in large amounts. "
    "Further tests will be needed before it can be used in medicine, they said.",
    "She opened the letter slowly. Inside was a photograph of the old house, with a note "
    "in her grandmother's careful hand: remember the garden in spring.",
};
#define N_DOCS (sizeof k_docs / sizeof k_docs[0])

/* Shard of the documents (repeated `reps` times), <|endoftext|> after each. */
static void write_filler(lm_tokenizer *tok, const char *path, int reps) {
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    lm_error err = {0};
    for (int r = 0; r < reps; r++)
        for (size_t d = 0; d < N_DOCS; d++) {
            assert_int_equal(
                lm_tokenizer_encode(tok, k_docs[d], strlen(k_docs[d]), &ids, &n, &cap, &err),
                LM_OK);
            const int32_t eot = lm_tokenizer_eot(tok);
            if (n == cap) {
                cap = cap * 2 + 1;
                ids = realloc(ids, (size_t)cap * sizeof(int32_t));
            }
            ids[n++] = eot;
        }
    assert_int_equal(
        lm_shard_write(path, (uint32_t)lm_tokenizer_vocab_size(tok), ids, (uint64_t)n, &err),
        LM_OK);
    free(ids);
}

static char *decode(lm_tokenizer *tok, const int32_t *ids, int64_t n) {
    char *s = NULL;
    size_t len = 0;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_decode(tok, ids, n, &s, &len, &err), LM_OK);
    return s;
}

static int starts_with(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

/* Checks that hold for any tokenizer. */
static void check_doc(lm_tokenizer *tok, const lm_passkey_doc *d, int64_t length) {
    assert_non_null(d->ids);
    assert_int_equal(d->n, length);
    assert_int_equal(strlen(d->key), 5);
    for (int i = 0; i < 5; i++)
        assert_true(d->key[i] >= '0' && d->key[i] <= '9');
    assert_true(d->key[0] != '0');
    const int32_t eot = lm_tokenizer_eot(tok);
    for (int64_t i = 0; i < d->n; i++) {
        assert_true(d->ids[i] >= 0 && d->ids[i] < lm_tokenizer_vocab_size(tok));
        assert_int_not_equal(d->ids[i], eot);
    }
    /* key sentence at key_pos */
    char sent[128];
    snprintf(sent, sizeof sent, " The pass key is %s. Remember it. %s is the pass key.", d->key,
             d->key);
    char *tail = decode(tok, d->ids + d->key_pos, d->n - d->key_pos);
    assert_true(starts_with(tail, sent));
    free(tail);
    /* answer = " NNNNN.", preceded by the question */
    char want[16];
    snprintf(want, sizeof want, " %s.", d->key);
    char *ans = decode(tok, d->ids + d->answer_pos, d->n - d->answer_pos);
    assert_string_equal(ans, want);
    free(ans);
    char *all = decode(tok, d->ids, d->answer_pos);
    const char *q = " What is the pass key? The pass key is";
    assert_true(strlen(all) >= strlen(q));
    assert_string_equal(all + strlen(all) - strlen(q), q);
    free(all);
    /* digits: exactly the tokens of the answer carrying a digit */
    assert_true(d->answer_pos <= d->digits_pos && d->digits_pos < d->digits_end &&
                d->digits_end <= d->n);
    for (int64_t i = d->answer_pos; i < d->n; i++) {
        char *t = decode(tok, d->ids + i, 1);
        int dig = strpbrk(t, "0123456789") != NULL;
        assert_int_equal(dig, i >= d->digits_pos && i < d->digits_end);
        free(t);
    }
    char *digits = decode(tok, d->ids + d->digits_pos, d->digits_end - d->digits_pos);
    assert_non_null(strstr(digits, d->key));
    free(digits);
    /* the key sentence lies inside the filler, before the question */
    assert_true(d->key_pos >= 0 && d->key_pos + (int64_t)strlen(sent) / 8 < d->answer_pos);
}

static void test_byte_docs(void **state) {
    (void)state;
    lm_error err = {0};
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    const char *path = lm_cli_path("filler_byte.bin");
    write_filler(tok, path, 10);
    lm_shard f;
    assert_int_equal(lm_shard_open(&f, path, &err), LM_OK);
    /* the separator-free stream, twice (for cyclic substring checks) */
    char *prose = malloc(2 * f.count + 1);
    size_t np = 0;
    for (uint64_t i = 0; i < f.count; i++)
        if (lm_shard_get(&f, i) != 256)
            prose[np++] = (char)lm_shard_get(&f, i);
    memcpy(prose + np, prose, np);
    prose[2 * np] = '\0';

    /* lm_passkey_make_into: one workspace for every document and length below */
    lm_passkey_ws ws;
    memset(&ws, 0, sizeof ws);
    int32_t *row = malloc(sizeof(int32_t) * 2500);
    const int64_t lengths[] = {120, 257, 1000, 2500};
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        const int64_t L = lengths[li];
        const int64_t ksent =
            (int64_t)strlen(" The pass key is 12345. Remember it. 12345 is the pass key.");
        const int64_t n_fill = L - ksent - 38 - 7;
        int64_t min_pos = L, max_pos = -1;
        int lead[10] = {0};
        for (uint64_t idx = 0; idx < 200; idx++) {
            lm_passkey_doc d;
            assert_int_equal(lm_passkey_make(tok, &f, L, 77, idx, &d, &err), LM_OK);
            check_doc(tok, &d, L);
            /* byte tokenizer: fixed layout */
            assert_int_equal(d.answer_pos, L - 7);
            assert_int_equal(d.digits_pos, L - 6);
            assert_int_equal(d.digits_end, L - 1);
            assert_true(d.key_pos <= n_fill);
            /* the filler (both stretches) is one consecutive run of the prose */
            char *fill = malloc((size_t)n_fill + 1);
            for (int64_t i = 0; i < d.key_pos; i++)
                fill[i] = (char)d.ids[i];
            for (int64_t i = d.key_pos; i < n_fill; i++)
                fill[i] = (char)d.ids[i + ksent];
            fill[n_fill] = '\0';
            if (n_fill <= (int64_t)np)
                assert_non_null(strstr(prose, fill));
            free(fill);
            if (d.key_pos < min_pos)
                min_pos = d.key_pos;
            if (d.key_pos > max_pos)
                max_pos = d.key_pos;
            lead[d.key[0] - '0']++;
            /* same (seed, index) -> same document */
            lm_passkey_doc e;
            assert_int_equal(lm_passkey_make(tok, &f, L, 77, idx, &e, &err), LM_OK);
            assert_int_equal(e.key_pos, d.key_pos);
            assert_string_equal(e.key, d.key);
            assert_memory_equal(e.ids, d.ids, (size_t)L * sizeof(int32_t));
            lm_passkey_doc_free(&e);
            assert_null(e.ids);
            /* the workspace version: the same document, into the caller's row or into
             * the workspace (alternating, so both buffers are reused across lengths) */
            int32_t *out = idx % 2 ? row : NULL;
            assert_int_equal(lm_passkey_make_into(tok, &f, L, 77, idx, &ws, out, &e, &err), LM_OK);
            assert_ptr_equal(e.ids, out ? out : ws.ids);
            assert_int_equal(e.n, d.n);
            assert_int_equal(e.key_pos, d.key_pos);
            assert_int_equal(e.answer_pos, d.answer_pos);
            assert_int_equal(e.digits_pos, d.digits_pos);
            assert_int_equal(e.digits_end, d.digits_end);
            assert_string_equal(e.key, d.key);
            assert_memory_equal(e.ids, d.ids, (size_t)L * sizeof(int32_t));
            lm_passkey_doc_free(&d);
        }
        /* depth spreads over the filler, leading digits vary */
        assert_true(min_pos < n_fill / 5);
        assert_true(max_pos > 4 * n_fill / 5);
        int used = 0;
        for (int i = 1; i <= 9; i++)
            used += lead[i] > 0;
        assert_int_equal(lead[0], 0);
        assert_true(used >= 8);
    }
    /* other seeds / indices differ */
    lm_passkey_doc a, b, c;
    assert_int_equal(lm_passkey_make(tok, &f, 500, 1, 5, &a, &err), LM_OK);
    assert_int_equal(lm_passkey_make(tok, &f, 500, 2, 5, &b, &err), LM_OK);
    assert_int_equal(lm_passkey_make(tok, &f, 500, 1, 6, &c, &err), LM_OK);
    assert_true(strcmp(a.key, b.key) != 0 || a.key_pos != b.key_pos);
    assert_true(strcmp(a.key, c.key) != 0 || a.key_pos != c.key_pos);
    assert_true(memcmp(a.ids, b.ids, 500 * sizeof(int32_t)) != 0);
    /* order independence: index 5 after making others */
    lm_passkey_doc a2;
    assert_int_equal(lm_passkey_make(tok, &f, 500, 1, 5, &a2, &err), LM_OK);
    assert_memory_equal(a.ids, a2.ids, 500 * sizeof(int32_t));
    lm_passkey_doc_free(&a);
    lm_passkey_doc_free(&a2);
    lm_passkey_doc_free(&b);
    lm_passkey_doc_free(&c);
    /* make_into errors like make and leaves the document empty */
    lm_passkey_doc z;
    assert_int_equal(lm_passkey_make_into(tok, &f, 119, 1, 0, &ws, row, &z, &err), LM_ERR_INVALID);
    assert_null(z.ids);
    assert_int_equal(z.n, 0);
    assert_int_equal(lm_passkey_make_into(tok, &f, 500, 1, 0, NULL, row, &z, &err), LM_ERR_INVALID);
    lm_passkey_ws_free(&ws);
    assert_null(ws.enc);
    free(row);
    free(prose);
    lm_shard_close(&f);
    lm_tokenizer_free(tok);
}

static void test_errors(void **state) {
    (void)state;
    lm_error err = {0};
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    const char *path = lm_cli_path("filler_small.bin");
    write_filler(tok, path, 1);
    lm_shard f;
    assert_int_equal(lm_shard_open(&f, path, &err), LM_OK);
    lm_passkey_doc d;
    /* 59 + 38 + 7 = 104 fixed tokens: 119 leaves 15 filler tokens, 120 leaves 16 */
    assert_int_equal(lm_passkey_make(tok, &f, 119, 1, 0, &d, &err), LM_ERR_INVALID);
    assert_null(d.ids);
    assert_non_null(strstr(err.msg, "too short"));
    assert_int_equal(lm_passkey_make(tok, &f, 120, 1, 0, &d, &err), LM_OK);
    check_doc(tok, &d, 120);
    lm_passkey_doc_free(&d);
    /* more filler than the shard holds */
    err.msg[0] = '\0';
    assert_int_equal(lm_passkey_make(tok, &f, (int64_t)f.count + 200, 1, 0, &d, &err),
                     LM_ERR_INVALID);
    assert_null(d.ids);
    assert_non_null(strstr(err.msg, path));
    lm_shard_close(&f);
    /* wrong vocab */
    const int32_t toks[4] = {1, 2, 3, 4};
    const char *p2 = lm_cli_path("filler_vocab.bin");
    assert_int_equal(lm_shard_write(p2, 50257, toks, 4, &err), LM_OK);
    assert_int_equal(lm_shard_open(&f, p2, &err), LM_OK);
    assert_int_equal(lm_passkey_make(tok, &f, 500, 1, 0, &d, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "vocab"));
    lm_shard_close(&f);
    /* only separators */
    const int32_t seps[3] = {256, 256, 256};
    const char *p3 = lm_cli_path("filler_seps.bin");
    assert_int_equal(lm_shard_write(p3, 257, seps, 3, &err), LM_OK);
    assert_int_equal(lm_shard_open(&f, p3, &err), LM_OK);
    assert_int_equal(lm_passkey_make(tok, &f, 500, 1, 0, &d, &err), LM_ERR_INVALID);
    lm_shard_close(&f);
    lm_tokenizer_free(tok);
}

static void test_gpt2_docs(void **state) {
    (void)state;
    if (access("data/gpt2/vocab.json", R_OK) != 0 || access("data/gpt2/merges.txt", R_OK) != 0) {
        print_message(
            "SKIP: data/gpt2/{vocab.json,merges.txt} absent (run scripts/fetch-data.sh)\n");
        skip();
    }
    lm_error err = {0};
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_gpt2(&tok, "data/gpt2", &err), LM_OK);
    const char *path = lm_cli_path("filler_gpt2.bin");
    write_filler(tok, path, 20);
    lm_shard f;
    assert_int_equal(lm_shard_open(&f, path, &err), LM_OK);
    int multi = 0;
    for (uint64_t idx = 0; idx < 100; idx++) {
        lm_passkey_doc d;
        const int64_t L = idx % 2 ? 256 : 1024;
        assert_int_equal(lm_passkey_make(tok, &f, L, 1234, idx, &d, &err), LM_OK);
        check_doc(tok, &d, L);
        multi += d.digits_end - d.digits_pos > 1;
        lm_passkey_doc_free(&d);
    }
    /* GPT-2 splits most 5-digit numbers into several tokens */
    assert_true(multi > 50);
    lm_shard_close(&f);
    lm_tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_byte_docs),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_gpt2_docs),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
