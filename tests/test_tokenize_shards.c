/* `linmoe tokenize --out-dir` (tools/tokenize.c) and manifests (shard.h), end to end:
 *  - a directory tree (nested, a hidden file and directory, a symbolic link, a file
 *    outside --ext, an empty file, a document longer than a shard) tokenized with a
 *    small hand-made GPT-2 vocabulary into shards of 64 tokens with 1 and 4 threads:
 *    every output file byte-identical; the manifest's keys and counts; the train
 *    stream read through the manifest equals the concatenation of the files'
 *    encodings (each file encoded here on its own, in bytewise path order); shard
 *    boundaries at document ends except inside a document longer than a shard;
 *  - the held-out split by file: --val-files N holds exactly the N keys of smallest
 *    lm_shard_split_hash, --val-fraction F the keys whose hash falls below F; the val
 *    stream is the concatenation of those whole files, train and val are disjoint
 *    and cover every file;
 *  - the loader over a manifest gives the same batches as over one shard holding
 *    the concatenation (packing and windows);
 *  - JSONL (escapes, surrogate pairs, nested members, blank lines, an empty text)
 *    with the byte tokenizer, 1 vs 4 threads, split by record;
 *  - lm_shard_split_hash pinned to values of the Python reference in docs/data.md;
 *  - bad input: malformed manifests (each error names the file and the field), a bad
 *    JSONL record (names file:line), a missing input, bad flags.
 */
/* cmocka.h needs these first */
/* clang-format off */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
/* clang-format on */

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"
#include "test_util.h"

#include "linmoe/core.h"
#include "linmoe/loader.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#define SHARD_TOKENS 64

static char g_tmp[64];

static int setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/linmoe_test_tokshards_XXXXXX");
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

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        print_message("cannot open %s\n", path);
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    b[sz] = '\0';
    *n = (size_t)sz;
    return b;
}

static void run_ok(const char *what, char *out, size_t size, const char *args) {
    int rc = lm_run_cli(out, size, "%s", args);
    if (rc != 0)
        print_message("%s: exit %d:\n%s\n", what, rc, out);
    assert_int_equal(rc, 0);
}

static void run_fails(int want_rc, const char *says, const char *args) {
    char out[8192];
    int rc = lm_run_cli(out, sizeof out, "%s", args);
    if (rc != want_rc)
        print_message("exit %d (want %d) for %s:\n%s\n", rc, want_rc, args, out);
    assert_int_equal(rc, want_rc);
    assert_null(strstr(out, "Sanitizer"));
    assert_null(strstr(out, "runtime error:"));
    lm_assert_says(out, says);
}

/* ---------------------------------------------------------------- a tiny GPT-2 vocab */

/* GPT-2's bytes-to-unicode table (Radford et al. 2019 §2.2): printable Latin-1 bytes
 * stand for themselves, the others for 256, 257, ... in byte order. */
static int printable(int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; }
static uint32_t b2u(int b) {
    if (printable(b))
        return (uint32_t)b;
    uint32_t n = 256;
    for (int c = 0; c < b; c++)
        n += !printable(c);
    return n;
}

/* Bytes spelled in that alphabet as JSON string content. */
static size_t spell(char *o, const char *s) {
    size_t k = 0;
    for (; *s; s++) {
        uint32_t cp = b2u((uint8_t)*s);
        if (cp == '"' || cp == '\\')
            o[k++] = '\\';
        if (cp < 0x80) {
            o[k++] = (char)cp;
        } else {
            o[k++] = (char)(0xC0 | (cp >> 6));
            o[k++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    o[k] = '\0';
    return k;
}

/* 256 byte tokens (id = byte), these merges in rank order, then <|endoftext|>. */
static const char *const k_merges[][2] = {{"i", "n"}, {"t", "h"},  {"th", "e"}, {" ", "the"},
                                          {"e", "r"}, {" ", "in"}, {"o", "n"},  {"\t", "\t"}};
#define N_MERGES ((int)(sizeof k_merges / sizeof k_merges[0]))
#define TINY_VOCAB (256 + N_MERGES + 1)

static void write_tiny_gpt2(const char *dir) {
    char *json = malloc(1 << 15), *merges = malloc(1 << 12);
    size_t j = 0, m = 0;
    char a[32], b[32], c[64];
    j += (size_t)sprintf(json + j, "{");
    for (int x = 0; x < 256; x++) {
        char s[2] = {(char)x, 0};
        if (x == 0) { /* spell() stops at NUL: U+0100 is byte 0 */
            strcpy(a, "\xc4\x80");
        } else {
            spell(a, s);
        }
        j += (size_t)sprintf(json + j, "%s\"%s\": %d", x ? ", " : "", a, x);
    }
    m += (size_t)sprintf(merges + m, "#version: 0.2\n");
    for (int i = 0; i < N_MERGES; i++) {
        char cat[32];
        snprintf(cat, sizeof cat, "%s%s", k_merges[i][0], k_merges[i][1]);
        spell(c, cat);
        j += (size_t)sprintf(json + j, ", \"%s\": %d", c, 256 + i);
        spell(a, k_merges[i][0]);
        spell(b, k_merges[i][1]);
        m += (size_t)sprintf(merges + m, "%s %s\n", a, b);
    }
    j += (size_t)sprintf(json + j, ", \"<|endoftext|>\": %d}", TINY_VOCAB - 1);
    char p[512];
    snprintf(p, sizeof p, "%s/vocab.json", dir);
    write_file(p, json, j);
    snprintf(p, sizeof p, "%s/merges.txt", dir);
    write_file(p, merges, m);
    free(json);
    free(merges);
}

/* ---------------------------------------------------------------- the source tree */

static uint64_t g_rng = 0x1234567ull;
static uint32_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545F4914F6CDD1Dull) >> 32);
}

static const char *const k_words[] = {"the",
                                      "in",
                                      "int",
                                      "then",
                                      "other",
                                      "on",
                                      "caf\xc3\xa9",
                                      "na\xc3\xafve",
                                      "\xe6\x97\xa5\xe6\x9c\xac",
                                      "return",
                                      "0x1f",
                                      "{",
                                      "}",
                                      "();",
                                      "\t\t",
                                      "\n",
                                      "  ",
                                      "/*",
                                      "*/",
                                      "\xf0\x9f\x98\x80"};
#define N_WORDS ((int)(sizeof k_words / sizeof k_words[0]))

/* Random text of about n bytes. */
static char *gen_text(size_t n, size_t *len) {
    char *s = malloc(n + 64);
    size_t k = 0;
    while (k < n) {
        const char *w = k_words[rnd() % N_WORDS];
        size_t l = strlen(w);
        memcpy(s + k, w, l);
        k += l;
        s[k++] = rnd() % 5 ? ' ' : '\n';
    }
    s[k] = '\0';
    *len = k;
    return s;
}

typedef struct {
    char key[64]; /* path under src/ */
    char *data;
    size_t n;
} tfile;

#define MAX_FILES 40
static tfile g_files[MAX_FILES]; /* the files --ext keeps, in bytewise key order */
static int g_nfiles;

static void add_file(const char *key, const char *data, size_t n) {
    char p[512];
    snprintf(p, sizeof p, "%s/src/%.200s", g_tmp, key);
    write_file(p, data, n);
}

static int cmp_tfile(const void *a, const void *b) {
    return strcmp(((const tfile *)a)->key, ((const tfile *)b)->key);
}

static void make_tree(void) {
    const char *dirs[] = {"src", "src/a", "src/a/b", "src/a/.git", "src/c", "src/gen"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++)
        assert_int_equal(mkdir(tmp_path(dirs[i]), 0755), 0);
    const char *keys[] = {"a.c",         "a/x.c", "a/y.txt",   "a/b/deep.c",
                          "a/b/deep2.h", "b.h",   "c/empty.c", "c/big.txt"};
    g_nfiles = 0;
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        tfile *f = &g_files[g_nfiles++];
        snprintf(f->key, sizeof f->key, "%s", keys[i]);
        if (strcmp(keys[i], "c/empty.c") == 0) {
            f->data = calloc(1, 1);
            f->n = 0;
        } else if (strcmp(keys[i], "a/y.txt") == 0) {
            f->data = strdup("first part\n\f\nsecond part\n"); /* one document with ff kept */
            f->n = strlen(f->data);
        } else {
            f->data = gen_text(strcmp(keys[i], "c/big.txt") == 0 ? 600 : 20 + rnd() % 120, &f->n);
        }
    }
    for (int i = 0; i < 20; i++) {
        tfile *f = &g_files[g_nfiles++];
        snprintf(f->key, sizeof f->key, "gen/f%02d.c", i);
        f->data = gen_text(10 + rnd() % 150, &f->n);
    }
    for (int i = 0; i < g_nfiles; i++)
        add_file(g_files[i].key, g_files[i].data, g_files[i].n);
    qsort(g_files, (size_t)g_nfiles, sizeof *g_files, cmp_tfile);
    /* skipped: outside --ext, hidden, in a hidden directory, a symbolic link */
    add_file("notes.md", "not taken\n", 10);
    add_file(".hidden.c", "not taken\n", 10);
    add_file("a/.git/config.c", "not taken\n", 10);
    char p[512];
    snprintf(p, sizeof p, "%s/src/a/link.c", g_tmp);
    assert_int_equal(symlink("x.c", p), 0);
}

/* ---------------------------------------------------------------- checks */

/* Every file of directory a equals the one of the same name in b, and vice versa. */
static int same_dirs(const char *a, const char *b) {
    int nfiles = 0;
    for (int pass = 0; pass < 2; pass++) {
        const char *x = pass ? b : a, *y = pass ? a : b;
        DIR *d = opendir(x);
        assert_non_null(d);
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.')
                continue;
            char px[600], py[600];
            snprintf(px, sizeof px, "%s/%s", x, de->d_name);
            snprintf(py, sizeof py, "%s/%s", y, de->d_name);
            size_t nx, ny;
            char *bx = read_all(px, &nx), *by = read_all(py, &ny);
            if (nx != ny || memcmp(bx, by, nx) != 0)
                print_message("%s and %s differ\n", px, py);
            assert_int_equal(nx, ny);
            assert_memory_equal(bx, by, nx);
            free(bx);
            free(by);
            nfiles += !pass;
        }
        closedir(d);
    }
    return nfiles;
}

static cJSON *load_json(const char *path) {
    size_t n;
    char *t = read_all(path, &n);
    cJSON *j = cJSON_Parse(t);
    free(t);
    assert_non_null(j);
    return j;
}

static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsNumber(v))
        print_message("key %s is not a number\n", k);
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

static const char *str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    assert_true(cJSON_IsString(v));
    return v->valuestring;
}

typedef struct {
    int32_t *v;
    int64_t n, cap;
} ids_t;

/* The stream of a split: each of its files encoded on its own, concatenated. Checks
 * the manifest's per-source entries on the way. Returns the documents. */
static int64_t expect_split(lm_tokenizer *tok, const cJSON *man, const int *in_split, ids_t *want,
                            int64_t *doc_len_max) {
    const cJSON *srcs = cJSON_GetObjectItemCaseSensitive(man, "sources");
    assert_true(cJSON_IsArray(srcs));
    int k = 0;
    int64_t docs_all = 0, bytes_all = 0;
    *doc_len_max = 0;
    lm_error err = {0};
    for (int i = 0; i < g_nfiles; i++) {
        if (!in_split[i])
            continue;
        const cJSON *e = cJSON_GetArrayItem(srcs, k++);
        assert_non_null(e);
        assert_string_equal(str(e, "path"), g_files[i].key);
        int64_t n0 = want->n, docs = 0, bytes = 0;
        assert_int_equal(lm_tokenizer_encode_documents(tok, g_files[i].data, g_files[i].n,
                                                       LM_DOCSEP_NONE, &want->v, &want->n,
                                                       &want->cap, &docs, &bytes, &err),
                         LM_OK);
        assert_int_equal((int64_t)num(e, "tokens"), want->n - n0);
        assert_int_equal((int64_t)num(e, "documents"), docs);
        assert_int_equal((int64_t)num(e, "bytes"), bytes);
        assert_int_equal(docs, g_files[i].n ? 1 : 0);
        if (want->n - n0 > *doc_len_max)
            *doc_len_max = want->n - n0;
        docs_all += docs;
        bytes_all += bytes;
    }
    assert_int_equal(cJSON_GetArraySize(srcs), k);
    assert_int_equal((int64_t)num(man, "documents"), docs_all);
    assert_int_equal((int64_t)num(man, "bytes"), bytes_all);
    assert_int_equal((int64_t)num(man, "tokens"), want->n);
    return docs_all;
}

/* The manifest's stream equals `want`; its shards hold <= SHARD_TOKENS tokens each and
 * end at a document end unless the document is longer than a shard. */
static void check_stream(const char *manifest, const cJSON *man, const ids_t *want, int32_t eot) {
    lm_shard s;
    lm_error err = {0};
    lm_status st = lm_shard_open(&s, manifest, &err);
    if (st != LM_OK)
        print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    assert_int_equal(lm_shard_validate(&s, &err), LM_OK);
    assert_int_equal(s.count, (uint64_t)want->n);
    for (int64_t i = 0; i < want->n; i++)
        if (lm_shard_get(&s, (uint64_t)i) != want->v[i]) {
            print_message("%s: token %lld is %d, want %d\n", manifest, (long long)i,
                          lm_shard_get(&s, (uint64_t)i), want->v[i]);
            fail();
        }
    const cJSON *shards = cJSON_GetObjectItemCaseSensitive(man, "shards");
    assert_int_equal((int)s.parts, cJSON_GetArraySize(shards));
    int64_t off = 0, docs = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, shards) {
        int64_t n = (int64_t)num(e, "tokens");
        assert_true(n >= 1 && n <= SHARD_TOKENS);
        int64_t d = 0;
        for (int64_t i = off; i < off + n; i++)
            d += want->v[i] == eot;
        assert_int_equal((int64_t)num(e, "documents"), d);
        docs += d;
        off += n;
        if (off < want->n && want->v[off - 1] != eot) {
            /* cut inside a document: only when that document is longer than a shard */
            int64_t a = off - 1, b = off;
            while (a > 0 && want->v[a - 1] != eot)
                a--;
            while (want->v[b] != eot)
                b++;
            assert_true(b + 1 - a > SHARD_TOKENS);
        }
    }
    assert_int_equal(off, want->n);
    assert_int_equal(docs, (int64_t)num(man, "documents"));
    lm_shard_close(&s);
}

/* The loader over the manifest and over one shard of `want` give the same batches. */
static void check_loader(const char *manifest, const ids_t *want, lm_tokenizer *tok,
                         int64_t want_docs) {
    lm_error err = {0};
    const char *single = tmp_path("single.bin");
    assert_int_equal(lm_shard_write(single, (uint32_t)lm_tokenizer_vocab_size(tok), want->v,
                                    (uint64_t)want->n, &err),
                     LM_OK);
    lm_shard sa, sb;
    assert_int_equal(lm_shard_open(&sa, manifest, &err), LM_OK);
    assert_int_equal(lm_shard_open(&sb, single, &err), LM_OK);
    lm_loader *la, *lb;
    assert_int_equal(lm_loader_new(&la, &sa, tok, 5, 0, 1, &err), LM_OK);
    assert_int_equal(lm_loader_new(&lb, &sb, tok, 5, 0, 1, &err), LM_OK);
    assert_int_equal(lm_loader_num_docs(la), want_docs);
    assert_int_equal(lm_loader_num_docs(lb), want_docs);
    lm_loader_batch ba, bb;
    assert_int_equal(lm_loader_batch_init(&ba, 4, 32, &err), LM_OK);
    assert_int_equal(lm_loader_batch_init(&bb, 4, 32, &err), LM_OK);
    for (int packing = 1; packing >= 0; packing--) {
        lm_loader_stage stg = {32, packing, 0.0, 0.0, 0.25, 0};
        assert_int_equal(lm_loader_set_stage(la, &stg, &err), LM_OK);
        assert_int_equal(lm_loader_set_stage(lb, &stg, &err), LM_OK);
        for (int step = 0; step < 6; step++) {
            assert_int_equal(lm_loader_next(la, 4, &ba, &err), LM_OK);
            assert_int_equal(lm_loader_next(lb, 4, &bb, &err), LM_OK);
            int64_t n = (int64_t)ba.batch.B * ba.batch.T;
            assert_int_equal(n, (int64_t)bb.batch.B * bb.batch.T);
            assert_memory_equal(ba.ids, bb.ids, (size_t)n * sizeof(int32_t));
            assert_memory_equal(ba.labels, bb.labels, (size_t)n * sizeof(int32_t));
            assert_int_equal(ba.batch.n_cu_seqlens, bb.batch.n_cu_seqlens);
        }
    }
    lm_loader_batch_free(&ba);
    lm_loader_batch_free(&bb);
    lm_loader_free(la);
    lm_loader_free(lb);
    lm_shard_close(&sa);
    lm_shard_close(&sb);
}

static uint64_t key_hash(uint64_t seed, const char *key) {
    return lm_shard_split_hash(seed, key, strlen(key));
}

/* ---------------------------------------------------------------- tests */

static void test_split_hash_pinned(void **state) {
    (void)state;
    /* values of the Python reference (docs/data.md; scripts/fetch-data.sh uses it) */
    assert_true(key_hash(0, "") == 0x5b21f68ffa77f14cull);
    assert_true(key_hash(0, "kernel/fork.c") == 0xb9a57fd5bb218c91ull);
    assert_true(key_hash(7, "a/x.c") == 0x60e938e5f04c4f25ull);
    assert_true(key_hash(1234, "data.jsonl:17") == 0x9bc3be6025ca2593ull);
    /* (h >> 11) * 2^-53 < f */
    assert_false(lm_shard_split_is_val(0x5b21f68ffa77f14cull, 0.355));
    assert_true(lm_shard_split_is_val(0x5b21f68ffa77f14cull, 0.356));
    assert_false(lm_shard_split_is_val(0, 0.0));
    assert_true(lm_shard_split_is_val(UINT64_MAX, 1.0));
}

static void test_tree(void **state) {
    (void)state;
    char out[16384], args[4096];
    make_tree();
    write_tiny_gpt2(g_tmp);
    lm_tokenizer *tok;
    lm_error err = {0};
    assert_int_equal(lm_tokenizer_gpt2(&tok, g_tmp, &err), LM_OK);
    const int32_t eot = lm_tokenizer_eot(tok);

    /* 1 and 4 threads: the same bytes */
    for (int t = 0; t < 2; t++) {
        snprintf(args, sizeof args,
                 "tokenize --tokenizer gpt2 --gpt2-dir '%s' --out-dir '%s/o%d' --shard-tokens %d "
                 "--val-files 4 --ext .c,.h,.txt --threads %d '%s/src'",
                 g_tmp, g_tmp, t ? 4 : 1, SHARD_TOKENS, t ? 4 : 1, g_tmp);
        run_ok("tokenize tree", out, sizeof out, args);
        lm_assert_says(out, "28 files");
    }
    int nout = same_dirs(tmp_path("o1"), tmp_path("o4"));
    assert_true(nout > 6); /* train.json, val.json and several shards */

    /* the split: the 4 keys of smallest hash */
    int is_val[MAX_FILES], is_train[MAX_FILES];
    for (int i = 0; i < g_nfiles; i++) {
        int below = 0;
        for (int k = 0; k < g_nfiles; k++)
            below += key_hash(0, g_files[k].key) < key_hash(0, g_files[i].key);
        is_val[i] = below < 4;
        is_train[i] = !is_val[i];
    }
    cJSON *mt = load_json(tmp_path("o1/train.json")), *mv = load_json(tmp_path("o1/val.json"));
    assert_string_equal(str(mt, "format"), "linmoe-shards");
    assert_int_equal((int)num(mt, "version"), 1);
    assert_string_equal(str(mt, "split"), "train");
    assert_string_equal(str(mv, "split"), "val");
    assert_string_equal(str(mt, "tokenizer"), "gpt2");
    assert_int_equal((int)num(mt, "vocab"), TINY_VOCAB);
    assert_int_equal((int)num(mt, "eot"), eot);
    assert_int_equal((int)num(mt, "shard_tokens"), SHARD_TOKENS);
    const cJSON *ho = cJSON_GetObjectItemCaseSensitive(mt, "held_out");
    assert_string_equal(str(ho, "rule"), "val_files");
    assert_int_equal((int)num(cJSON_GetObjectItemCaseSensitive(ho, "val"), "sources"), 4);
    assert_int_equal((int)num(cJSON_GetObjectItemCaseSensitive(ho, "train"), "sources"),
                     g_nfiles - 4);
    assert_true(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(mt, "shards")) > 2);

    ids_t wt = {0}, wv = {0};
    int64_t max_t, max_v;
    int64_t docs_t = expect_split(tok, mt, is_train, &wt, &max_t);
    int64_t docs_v = expect_split(tok, mv, is_val, &wv, &max_v);
    assert_true(max_t > SHARD_TOKENS || max_v > SHARD_TOKENS); /* c/big.txt is cut */
    check_stream(tmp_path("o1/train.json"), mt, &wt, eot);
    check_stream(tmp_path("o1/val.json"), mv, &wv, eot);
    check_loader(tmp_path("o1/train.json"), &wt, tok, docs_t);
    assert_true(docs_v >= 3);
    cJSON_Delete(mt);
    cJSON_Delete(mv);

    /* --val-fraction: the keys whose hash falls below F; a rerun into o1 drops the
     * shards the smaller run no longer writes */
    snprintf(args, sizeof args,
             "tokenize --tokenizer gpt2 --gpt2-dir '%s' --out-dir '%s/o1' --shard-tokens 100000 "
             "--val-fraction 0.3 --split-seed 7 --ext .c,.h,.txt --quiet '%s/src/'",
             g_tmp, g_tmp, g_tmp);
    run_ok("tokenize --val-fraction", out, sizeof out, args);
    assert_int_equal(access(tmp_path("o1/train-00001.bin"), F_OK), -1);
    int nv = 0;
    for (int i = 0; i < g_nfiles; i++) {
        is_val[i] = lm_shard_split_is_val(key_hash(7, g_files[i].key), 0.3);
        is_train[i] = !is_val[i];
        nv += is_val[i];
    }
    assert_true(nv > 0 && nv < g_nfiles);
    mt = load_json(tmp_path("o1/train.json"));
    mv = load_json(tmp_path("o1/val.json"));
    wt.n = wv.n = 0;
    docs_t = expect_split(tok, mt, is_train, &wt, &max_t);
    expect_split(tok, mv, is_val, &wv, &max_v);
    check_loader(tmp_path("o1/val.json"), &wv, tok, (int64_t)num(mv, "documents"));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(mt, "shards")), 1);
    cJSON_Delete(mt);
    cJSON_Delete(mv);

    /* no split: train.json only; a stale val.json and val shards are removed */
    snprintf(args, sizeof args,
             "tokenize --tokenizer gpt2 --gpt2-dir '%s' --out-dir '%s/o1' --quiet "
             "--ext .c,.h,.txt '%s/src'",
             g_tmp, g_tmp, g_tmp);
    run_ok("tokenize without a split", out, sizeof out, args);
    assert_int_equal(access(tmp_path("o1/val.json"), F_OK), -1);
    assert_int_equal(access(tmp_path("o1/val-00000.bin"), F_OK), -1);
    mt = load_json(tmp_path("o1/train.json"));
    assert_int_equal((int)num(mt, "documents"), g_nfiles - 1); /* all but the empty file */
    cJSON_Delete(mt);

    /* --doc-sep ff applies within each file: a/y.txt holds two documents */
    snprintf(args, sizeof args,
             "tokenize --tokenizer byte --out-dir '%s/o2' --doc-sep ff '%s/src/a/y.txt' "
             "'%s/src/a.c'",
             g_tmp, g_tmp, g_tmp);
    run_ok("tokenize --doc-sep ff", out, sizeof out, args);
    mt = load_json(tmp_path("o2/train.json"));
    const cJSON *s0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(mt, "sources"), 0);
    assert_int_equal((int)num(s0, "documents"), 2);
    assert_int_equal((int)num(s0, "bytes"), (int)strlen("first part\nsecond part\n"));
    cJSON_Delete(mt);

    free(wt.v);
    free(wv.v);
    lm_tokenizer_free(tok);
    for (int i = 0; i < g_nfiles; i++)
        free(g_files[i].data);
}

static void test_jsonl(void **state) {
    (void)state;
    char out[16384], args[4096];
    /* 40 records with their texts; blank lines in between; record 7's text is empty */
    enum { NREC = 40 };
    char *texts[NREC];
    int lines[NREC];
    size_t cap = 1 << 16, k = 0;
    char *file = malloc(cap);
    int line = 1;
    for (int r = 0; r < NREC; r++) {
        size_t n;
        char *t = r == 7 ? strdup("") : gen_text(5 + rnd() % 80, &n);
        if (r % 5 == 0 && r != 0) {
            char *t2 = malloc(strlen(t) + 32);
            sprintf(t2, "%s q\"b\\s\x01", t); /* escapes below */
            free(t);
            t = t2;
        }
        texts[r] = t;
        k += (size_t)sprintf(file + k,
                             "{\"id\": %d, \"meta\": {\"a\": [1, -2.5e3, null, true, "
                             "{\"text\": \"nested\"}]}, \"text\": \"",
                             r);
        for (const char *p = t; *p; p++) {
            unsigned char c = (unsigned char)*p;
            if (c == '"' || c == '\\')
                k += (size_t)sprintf(file + k, "\\%c", c);
            else if (c == '\n')
                k += (size_t)sprintf(file + k, "\\n");
            else if (c == '\t')
                k += (size_t)sprintf(file + k, "\\t");
            else if (c < 0x20)
                k += (size_t)sprintf(file + k, "\\u%04x", c);
            else if (c == 0xf0 && r % 2) { /* U+1F600 as a surrogate pair */
                k += (size_t)sprintf(file + k, "\\ud83d\\ude00");
                p += 3;
            } else
                file[k++] = (char)c;
        }
        k += (size_t)sprintf(file + k, "\"}\n");
        lines[r] = line++;
        if (r % 9 == 3) {
            k += (size_t)sprintf(file + k, "  \r\n\n");
            line += 2;
        }
    }
    const char *jpath = tmp_path("data.jsonl");
    write_file(jpath, file, k);
    free(file);
    for (int t = 0; t < 2; t++) {
        snprintf(args, sizeof args,
                 "tokenize --tokenizer byte --jsonl --out-dir '%s/j%d' --shard-tokens 50 "
                 "--val-files 5 --threads %d '%s'",
                 g_tmp, t, t ? 4 : 1, jpath);
        run_ok("tokenize jsonl", out, sizeof out, args);
    }
    same_dirs(tmp_path("j0"), tmp_path("j1"));
    int val[NREC];
    for (int r = 0; r < NREC; r++) {
        char key[600];
        snprintf(key, sizeof key, "%s:%d", jpath, lines[r]);
        uint64_t h = key_hash(0, key);
        int below = 0;
        for (int q = 0; q < NREC; q++) {
            char kq[600];
            snprintf(kq, sizeof kq, "%s:%d", jpath, lines[q]);
            below += key_hash(0, kq) < h;
        }
        val[r] = below < 5;
    }
    for (int split = 0; split < 2; split++) {
        ids_t want = {0};
        int64_t docs = 0;
        for (int r = 0; r < NREC; r++) {
            if (val[r] != split || !texts[r][0])
                continue;
            for (const char *p = texts[r]; *p; p++) {
                if (want.n + 2 > want.cap) {
                    want.cap = want.cap ? 2 * want.cap : 1024;
                    want.v = realloc(want.v, (size_t)want.cap * sizeof(int32_t));
                }
                want.v[want.n++] = (uint8_t)*p;
            }
            want.v[want.n++] = 256;
            docs++;
        }
        const char *mp = tmp_path(split ? "j0/val.json" : "j0/train.json");
        cJSON *m = load_json(mp);
        assert_int_equal((int64_t)num(m, "documents"), docs);
        const cJSON *src = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(m, "sources"), 0);
        assert_string_equal(str(src, "path"), jpath);
        assert_int_equal((int)num(src, "records"), split ? 5 : NREC - 5);
        lm_shard s;
        lm_error err = {0};
        assert_int_equal(lm_shard_open(&s, mp, &err), LM_OK);
        assert_int_equal(s.count, (uint64_t)want.n);
        for (int64_t i = 0; i < want.n; i++)
            assert_int_equal(lm_shard_get(&s, (uint64_t)i), want.v[i]);
        assert_true(split || s.parts > 2);
        lm_shard_close(&s);
        cJSON_Delete(m);
        free(want.v);
    }
    for (int r = 0; r < NREC; r++)
        free(texts[r]);

    /* a bad record names file:line; nothing replaces the old manifest */
    const char *bad1 = "{\"text\": \"ok\"}\n\n{\"text\": \"a\\q\"}\n";
    write_file(tmp_path("bad.jsonl"), bad1, strlen(bad1));
    snprintf(args, sizeof args, "tokenize --tokenizer byte --jsonl --out-dir '%s/j0' '%s'", g_tmp,
             tmp_path("bad.jsonl"));
    run_fails(1, "bad.jsonl:3: invalid escape", args);
    write_file(tmp_path("bad.jsonl"), "{\"txt\": \"ok\"}\n", strlen("{\"txt\": \"ok\"}\n"));
    run_fails(1, "bad.jsonl:1: the text member is missing", args);
    snprintf(args, sizeof args,
             "tokenize --tokenizer byte --jsonl --text-key txt --out-dir '%s/j2' '%s'", g_tmp,
             tmp_path("bad.jsonl"));
    run_ok("tokenize --text-key", out, sizeof out, args);
    lm_assert_says(out, "1 records");
}

/* A hand-written manifest in the temporary directory. */
static void write_manifest(const char *name, const char *body) {
    write_file(tmp_path(name), body, strlen(body));
}

static void expect_manifest_error(const char *name, lm_status want, const char *says) {
    lm_shard s;
    memset(&s, 0x5a, sizeof s);
    lm_error err = {0};
    lm_status st = lm_shard_open(&s, tmp_path(name), &err);
    if (st != want || !lm_contains_ci(err.msg, says))
        print_message("status %d (want %d): %s\n", st, want, err.msg);
    assert_int_equal(st, want);
    lm_assert_says(err.msg, name);
    lm_assert_says(err.msg, says);
    assert_null(s.map);
    assert_null(s.path);
    lm_shard_close(&s);
}

static void test_manifest_errors(void **state) {
    (void)state;
    lm_error err = {0};
    int32_t a[5] = {1, 2, 256, 3, 256}, b[3] = {4, 5, 256};
    assert_int_equal(lm_shard_write(tmp_path("m-a.bin"), 257, a, 5, &err), LM_OK);
    assert_int_equal(lm_shard_write(tmp_path("m-b.bin"), 257, b, 3, &err), LM_OK);
    assert_int_equal(lm_shard_write(tmp_path("m-c.bin"), 300, b, 3, &err), LM_OK);
    /* good, with an absolute path and leading blanks */
    char body[2048];
    snprintf(body, sizeof body,
             " \n{\"format\": \"linmoe-shards\", \"version\": 1, \"vocab\": 257, \"tokens\": 8, "
             "\"extra\": [1], \"shards\": [{\"path\": \"m-a.bin\", \"tokens\": 5}, {\"path\": "
             "\"%s\", \"tokens\": 3}]}",
             tmp_path("m-b.bin"));
    write_manifest("good.json", body);
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, tmp_path("good.json"), &err), LM_OK);
    assert_int_equal(s.count, 8);
    assert_int_equal(s.parts, 2);
    assert_int_equal(s.vocab, 257);
    assert_int_equal(s.width, 2);
    int32_t want[8] = {1, 2, 256, 3, 256, 4, 5, 256};
    for (int i = 0; i < 8; i++)
        assert_int_equal(lm_shard_get(&s, (uint64_t)i), want[i]);
    lm_shard_close(&s);
    /* empty: no shards, no tokens */
    write_manifest("empty.json", "{\"format\": \"linmoe-shards\", \"version\": 1, \"vocab\": "
                                 "257, \"tokens\": 0, \"shards\": []}");
    assert_int_equal(lm_shard_open(&s, tmp_path("empty.json"), &err), LM_OK);
    assert_int_equal(s.count, 0);
    lm_shard_close(&s);

#define HEAD "{\"format\": \"linmoe-shards\", \"version\": 1, \"vocab\": 257, "
    write_manifest("m1.json", HEAD "\"tokens\": 9, \"shards\": [{\"path\": \"m-a.bin\", "
                                   "\"tokens\": 5}, {\"path\": \"m-b.bin\", \"tokens\": 4}]}");
    expect_manifest_error("m1.json", LM_ERR_FORMAT, "holds 3 tokens, the manifest says 4");
    write_manifest("m2.json", HEAD "\"tokens\": 6, \"shards\": [{\"path\": \"m-a.bin\", "
                                   "\"tokens\": 5}]}");
    expect_manifest_error("m2.json", LM_ERR_FORMAT, "add up to 5");
    write_manifest("m3.json", HEAD "\"tokens\": 5, \"shards\": [{\"path\": \"nope.bin\", "
                                   "\"tokens\": 5}]}");
    expect_manifest_error("m3.json", LM_ERR_IO, "nope.bin");
    write_manifest("m4.json", HEAD "\"tokens\": 0, \"shards\": [{\"path\": \"empty.json\", "
                                   "\"tokens\": 0}]}");
    expect_manifest_error("m4.json", LM_ERR_FORMAT, "is a manifest");
    write_manifest("m5.json", HEAD "\"tokens\": 3, \"shards\": [{\"path\": \"m-c.bin\", "
                                   "\"tokens\": 3}]}");
    expect_manifest_error("m5.json", LM_ERR_FORMAT, "has vocab 300");
    write_manifest("m6.json", "{\"format\": \"lm\", \"version\": 1}");
    expect_manifest_error("m6.json", LM_ERR_FORMAT, "format");
    write_manifest("m7.json", "{\"format\": \"linmoe-shards\", \"version\": 2}");
    expect_manifest_error("m7.json", LM_ERR_FORMAT, "unknown version 2");
    write_manifest("m8.json", HEAD "\"tokens\": 5, \"shards\": [{\"path\": \"m-a.bin\", ");
    expect_manifest_error("m8.json", LM_ERR_FORMAT, "not valid JSON");
    write_manifest("m9.json", HEAD "\"tokens\": 5, \"shards\": [{\"path\": \"m-a.bin\", "
                                   "\"tokens\": -5}]}");
    expect_manifest_error("m9.json", LM_ERR_FORMAT, "shards[0] key 'tokens'");
    write_manifest("m10.json", HEAD "\"shards\": []}");
    expect_manifest_error("m10.json", LM_ERR_FORMAT, "no key 'tokens'");
#undef HEAD
}

static void test_cli_errors(void **state) {
    (void)state;
    char args[2048];
    snprintf(args, sizeof args, "tokenize --tokenizer byte --out-dir '%s/e' '%s/missing'", g_tmp,
             g_tmp);
    run_fails(1, "missing", args);
    snprintf(args, sizeof args, "tokenize --tokenizer byte --out-dir '%s/e' --in x '%s'", g_tmp,
             g_tmp);
    run_fails(2, "cannot be combined", args);
    snprintf(args, sizeof args, "tokenize --tokenizer byte --out-dir '%s/e'", g_tmp);
    run_fails(2, "missing INPUT", args);
    snprintf(args, sizeof args,
             "tokenize --tokenizer byte --out-dir '%s/e' --val-fraction 1.5 '%s/src'", g_tmp,
             g_tmp);
    run_fails(2, "--val-fraction '1.5'", args);
    snprintf(args, sizeof args,
             "tokenize --tokenizer byte --out-dir '%s/e' --val-files 2 '%s/src/a.c' '%s/src/b.h'",
             g_tmp, g_tmp, g_tmp);
    run_fails(1, "leaves no training source", args);
    snprintf(args, sizeof args, "tokenize --tokenizer byte --out-dir '%s/e' --ext .zz '%s/src'",
             g_tmp, g_tmp);
    run_fails(1, "no file ending in .zz", args);
    snprintf(args, sizeof args,
             "tokenize --tokenizer byte --out-dir '%s/e' --shard-tokens 0 '%s/src'", g_tmp, g_tmp);
    run_fails(2, "--shard-tokens '0'", args);
}

/* `--in TEXT --out SHARD` says which separator split the text and how many documents
 * came out, and says so plainly when a file without that separator became one document
 * (issue 25: a plain text file silently became one document). */
static void test_single_doc_sep(void **state) {
    (void)state;
    char txt[256], shard[256], args[2048], out[8192];
    snprintf(txt, sizeof txt, "%s/plain.txt", g_tmp);
    snprintf(shard, sizeof shard, "%s/plain.bin", g_tmp);
    FILE *f = fopen(txt, "w");
    assert_non_null(f);
    fputs("First paragraph.\n\nSecond paragraph.\n\nThird.\n", f);
    fclose(f);
    snprintf(args, sizeof args, "tokenize --tokenizer byte --in '%s' --out '%s'", txt, shard);
    assert_int_equal(lm_run_cli(out, sizeof out, "%s", args), 0);
    print_message("%s", out);
    lm_assert_says(out, "1 documents");
    lm_assert_says(out, "--doc-sep ff");
    lm_assert_says(out, "so it is one document (--doc-sep blank splits at empty lines)");
    snprintf(args, sizeof args, "tokenize --tokenizer byte --in '%s' --out '%s' --doc-sep blank",
             txt, shard);
    assert_int_equal(lm_run_cli(out, sizeof out, "%s", args), 0);
    print_message("%s", out);
    lm_assert_says(out, "3 documents");
    lm_assert_says(out, "documents split at empty lines (--doc-sep blank)");
    assert_null(strstr(out, "one document"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_hash_pinned),
        cmocka_unit_test(test_tree),
        cmocka_unit_test(test_jsonl),
        cmocka_unit_test(test_manifest_errors),
        cmocka_unit_test(test_cli_errors),
        cmocka_unit_test(test_single_doc_sep),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
