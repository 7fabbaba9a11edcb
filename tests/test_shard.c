/* Token shards (shard.h): write / read round trips for both widths (checked against
 * the documented byte layout, not only against the reader), and every corrupt-file
 * case failing with a message that names the file and the field: missing file,
 * truncated header, bad magic, unknown version, bad width, width too narrow for the
 * vocab, non-zero reserved field, count disagreeing with the size (truncated and
 * over-long), a token >= vocab (lm_shard_validate), and writes that must not happen
 * (a bad token, an unwritable path; the old file stays).
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

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    assert_int_equal(fread(b, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return b;
}

static void write_all(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void roundtrip(uint32_t vocab, uint64_t n, uint64_t seed) {
    int32_t *tok = malloc((n ? n : 1) * sizeof *tok);
    lm_rng r;
    lm_rng_init(&r, seed);
    for (uint64_t i = 0; i < n; i++) /* include the extremes 0 and vocab - 1 */
        tok[i] = i == 0 ? (int32_t)vocab - 1 : i == 1 ? 0 : (int32_t)(lm_rng_u32(&r) % vocab);
    const char *path = lm_cli_path("rt.bin");
    lm_error err = {0};
    assert_int_equal(lm_shard_write(path, vocab, tok, n, &err), LM_OK);

    /* the bytes on disk follow the documented layout */
    uint32_t width = vocab <= 65536 ? 2 : 4;
    size_t sz;
    uint8_t *b = read_all(path, &sz);
    assert_int_equal(sz, 32 + n * width);
    assert_memory_equal(b, "LMTOKENS", 8);
    assert_int_equal(b[8] | b[9] << 8, 1);
    assert_int_equal((uint32_t)b[12] | (uint32_t)b[13] << 8 | (uint32_t)b[14] << 16 |
                         (uint32_t)b[15] << 24,
                     vocab);
    assert_int_equal(b[16], width);
    assert_int_equal(b[20] | b[21] | b[22] | b[23], 0);
    uint64_t cnt = 0;
    for (int i = 7; i >= 0; i--)
        cnt = cnt << 8 | b[24 + i];
    assert_int_equal(cnt, n);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t v = 0;
        for (int k = (int)width - 1; k >= 0; k--)
            v = v << 8 | b[32 + i * width + (uint64_t)k];
        assert_int_equal(v, (uint32_t)tok[i]);
    }
    free(b);

    lm_shard s;
    assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
    assert_int_equal(s.vocab, vocab);
    assert_int_equal(s.width, width);
    assert_int_equal(s.count, n);
    assert_string_equal(s.path, path);
    for (uint64_t i = 0; i < n; i++)
        assert_int_equal(lm_shard_get(&s, i), tok[i]);
    assert_int_equal(lm_shard_validate(&s, &err), LM_OK);
    lm_shard_close(&s);
    assert_null(s.map);
    lm_shard_close(&s); /* closing twice is harmless */
    free(tok);
}

static void test_roundtrip(void **state) {
    (void)state;
    roundtrip(257, 1000, 1);
    roundtrip(50257, 12345, 2);
    roundtrip(65536, 100, 3); /* the largest width-2 vocab */
    roundtrip(65537, 100, 4); /* the smallest width-4 vocab */
    roundtrip(1u << 24, 70000, 5);
    roundtrip(257, 0, 6); /* empty shard */
    roundtrip(1, 3, 7);
}

/* Write a good shard, corrupt it with `edit`, expect `want` naming the file + `says`. */
static void expect_open_error(void (*edit)(uint8_t *b, size_t *n), lm_status want,
                              const char *says) {
    const char *path = lm_cli_path("bad.bin");
    int32_t tok[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 256};
    lm_error err = {0};
    assert_int_equal(lm_shard_write(path, 257, tok, 10, &err), LM_OK);
    size_t n;
    uint8_t *b = read_all(path, &n);
    edit(b, &n);
    write_all(path, b, n);
    free(b);
    lm_shard s;
    memset(&s, 0x5a, sizeof s); /* open must reset it */
    lm_status st = lm_shard_open(&s, path, &err);
    if (st != want)
        print_message("status %d, want %d: %s\n", st, want, err.msg);
    assert_int_equal(st, want);
    lm_assert_says(err.msg, path);
    lm_assert_says(err.msg, says);
    assert_null(s.map);
    assert_null(s.path);
    lm_shard_close(&s);
}

static void e_trunc_header(uint8_t *b, size_t *n) { (void)b, *n = 20; }
static void e_empty(uint8_t *b, size_t *n) { (void)b, *n = 0; }
static void e_trunc_tokens(uint8_t *b, size_t *n) { (void)b, *n -= 3; }
static void e_extra(uint8_t *b, size_t *n) { b[*n] = 0, *n += 1; }
static void e_magic(uint8_t *b, size_t *n) { (void)n, memcpy(b, "LMTOKENZ", 8); }
static void e_version(uint8_t *b, size_t *n) { (void)n, put32(b + 8, 2); }
static void e_width3(uint8_t *b, size_t *n) { (void)n, put32(b + 16, 3); }
static void e_width4(uint8_t *b, size_t *n) { (void)n, put32(b + 16, 4); } /* size then wrong */
static void e_narrow(uint8_t *b, size_t *n) { (void)n, put32(b + 12, 70000); }
static void e_vocab0(uint8_t *b, size_t *n) { (void)n, put32(b + 12, 0); }
static void e_reserved(uint8_t *b, size_t *n) { (void)n, put32(b + 20, 1); }
static void e_count_huge(uint8_t *b, size_t *n) { (void)n, memset(b + 24, 0xff, 8); }

static void test_open_errors(void **state) {
    (void)state;
    expect_open_error(e_trunc_header, LM_ERR_FORMAT, "truncated header");
    expect_open_error(e_empty, LM_ERR_FORMAT, "truncated header");
    expect_open_error(e_trunc_tokens, LM_ERR_FORMAT, "count 10");
    expect_open_error(e_extra, LM_ERR_FORMAT, "count 10");
    expect_open_error(e_magic, LM_ERR_FORMAT, "bad magic");
    expect_open_error(e_version, LM_ERR_FORMAT, "version 2");
    expect_open_error(e_width3, LM_ERR_FORMAT, "width 3");
    expect_open_error(e_width4, LM_ERR_FORMAT, "count 10 tokens of width 4");
    expect_open_error(e_narrow, LM_ERR_FORMAT, "width 2 cannot hold vocab 70000");
    expect_open_error(e_vocab0, LM_ERR_FORMAT, "vocab 0");
    expect_open_error(e_reserved, LM_ERR_FORMAT, "reserved");
    expect_open_error(e_count_huge, LM_ERR_FORMAT, "count 18446744073709551615");

    lm_shard s;
    lm_error err = {0};
    assert_int_equal(lm_shard_open(&s, lm_cli_path("missing.bin"), &err), LM_ERR_IO);
    lm_assert_says(err.msg, "missing.bin");
    assert_int_equal(lm_shard_open(&s, lm_cli_dir(), &err), LM_ERR_IO); /* a directory */
    lm_assert_says(err.msg, "not a regular file");
}

static void test_validate_and_write_errors(void **state) {
    (void)state;
    const char *path = lm_cli_path("v.bin");
    int32_t tok[5] = {1, 2, 3, 4, 5};
    lm_error err = {0};
    assert_int_equal(lm_shard_write(path, 257, tok, 5, &err), LM_OK);
    /* token 3 := 300 >= vocab 257: the header is fine, validate finds it */
    size_t n;
    uint8_t *b = read_all(path, &n);
    b[32 + 2 * 3] = 300 & 0xff;
    b[32 + 2 * 3 + 1] = 300 >> 8;
    write_all(path, b, n);
    free(b);
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
    assert_int_equal(lm_shard_validate(&s, &err), LM_ERR_FORMAT);
    lm_assert_says(err.msg, path);
    lm_assert_says(err.msg, "token 3 is 300");
    lm_assert_says(err.msg, "257");
    lm_shard_close(&s);

    /* writing a bad token fails and leaves the old file alone */
    int32_t bad[3] = {0, 257, 1};
    assert_int_equal(lm_shard_write(path, 257, bad, 3, &err), LM_ERR_INVALID);
    lm_assert_says(err.msg, "token 1 is 257");
    bad[1] = -1;
    assert_int_equal(lm_shard_write(path, 257, bad, 3, &err), LM_ERR_INVALID);
    lm_assert_says(err.msg, "token 1 is -1");
    assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
    assert_int_equal(s.count, 5);
    lm_shard_close(&s);
    assert_int_equal(lm_shard_write(path, 0, tok, 5, &err), LM_ERR_INVALID);
    lm_assert_says(err.msg, "vocab 0");

    /* an unwritable destination: I/O error naming it, no temp file left behind */
    char p[600];
    snprintf(p, sizeof p, "%s/nodir/x.bin", lm_cli_dir());
    assert_int_equal(lm_shard_write(p, 257, tok, 5, &err), LM_ERR_IO);
    lm_assert_says(err.msg, "nodir/x.bin");
    char tmpname[700];
    snprintf(tmpname, sizeof tmpname, "%s.tmp.%ld", path, (long)getpid());
    assert_int_not_equal(access(tmpname, F_OK), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_validate_and_write_errors),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
