/* safetensors tests: round trip of every dtype with metadata, 0-dim and zero-size
 * tensors; every malformed-input case named in safetensors.h yields LM_ERR_FORMAT
 * with a message naming the file, the tensor and the field; truncated and mutated
 * files never crash; the writer is atomic. */
#include "test_util.h"

#include "linmoe/safetensors.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------- helpers */

static char g_dir[64];

static void path_in_dir(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", g_dir, name);
}

static int setup_dir(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe-st-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown_dir(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* 8-byte little-endian `hlen`, then `hdr_len` header bytes, then `ndata` data bytes
 * (a counting pattern). Returns a malloc'd buffer and its size. */
static uint8_t *mk_raw(uint64_t hlen, const char *hdr, size_t hdr_len, size_t ndata, size_t *size) {
    *size = 8 + hdr_len + ndata;
    uint8_t *b = malloc(*size);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(b + 8, hdr, hdr_len);
    for (size_t i = 0; i < ndata; i++)
        b[8 + hdr_len + i] = (uint8_t)(i * 7 + 1);
    return b;
}

static uint8_t *mk(const char *json, size_t ndata, size_t *size) {
    return mk_raw(strlen(json), json, strlen(json), ndata, size);
}

static int write_file(const char *path, const void *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = n ? fwrite(b, 1, n, f) : 0;
    return (fclose(f) == 0 && w == n) ? 0 : -1;
}

static uint8_t *read_file(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

/* Whether the n bytes at b contain the string s. */
static int contains(const uint8_t *b, size_t n, const char *s) {
    size_t k = strlen(s);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(b + i, s, k) == 0)
            return 1;
    return 0;
}

static const char *bad_json(const char *what);

static int is_empty(const lm_safetensors *st) {
    return st->buf == NULL && st->entries == NULL && st->n_entries == 0 && st->n_meta == 0 &&
           st->path == NULL;
}

/* Parse `b`, expect LM_ERR_FORMAT, an empty result, and each needle in the message. */
static void expect_format_buf(const char *what, const uint8_t *b, size_t n,
                              const char *const *needles) {
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    lm_status s = lm_st_parse(b, n, "bad.safetensors", &st, &err);
    printf("%-34s -> %s: %s\n", what, lm_status_str(s), err.msg);
    if (s != LM_ERR_FORMAT)
        fail_msg("%s: status %d, want LM_ERR_FORMAT", what, (int)s);
    assert_int_equal(err.status, LM_ERR_FORMAT);
    assert_true(is_empty(&st));
    assert_non_null(strstr(err.msg, "bad.safetensors"));
    for (int i = 0; needles[i]; i++)
        if (!strstr(err.msg, needles[i]))
            fail_msg("%s: message lacks \"%s\": %s", what, needles[i], err.msg);
    lm_st_free(&st); /* safe on the empty result */
}

/* ---------------------------------------------------------------- round trip */

enum { NT = 10 };
typedef struct {
    const char *name;
    lm_dtype dt;
    int ndim;
    int64_t shape[3];
} tspec;

static const tspec specs[NT] = {
    {"f32", LM_F32, 2, {2, 3}},   {"f64", LM_F64, 1, {4}},
    {"bf16", LM_BF16, 2, {3, 2}}, {"f16", LM_F16, 1, {5}},
    {"i32", LM_I32, 2, {2, 2}},   {"i64", LM_I64, 1, {3}},
    {"u8", LM_U8, 1, {7}},        {"scalar", LM_F32, 0, {0}},
    {"empty", LM_I32, 2, {0, 3}}, {"model.layers.0.empty2", LM_F16, 3, {4, 0, 2}},
};

static int64_t spec_numel(const tspec *s) {
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++)
        n *= s->shape[i];
    return n;
}

/* Deterministic contents for spec k: values from a seeded normal, cast per dtype. */
static void *spec_data(int k, size_t *nbytes) {
    const tspec *s = &specs[k];
    int64_t n = spec_numel(s);
    size_t es = lm_dtype_size(s->dt);
    *nbytes = (size_t)n * es;
    uint8_t *b = malloc(*nbytes + 1);
    double *x = malloc(sizeof(double) * (size_t)(n + 1));
    lm_fill_normal(x, n, 100 + (uint64_t)k, 0.0, 3.0);
    for (int64_t i = 0; i < n; i++) {
        switch (s->dt) {
        case LM_F32: {
            float v = (float)x[i];
            memcpy(b + 4 * i, &v, 4);
            break;
        }
        case LM_F64:
            memcpy(b + 8 * i, &x[i], 8);
            break;
        case LM_BF16: {
            uint16_t h = lm_f32_to_bf16((float)x[i]);
            memcpy(b + 2 * i, &h, 2);
            break;
        }
        case LM_F16: {
            uint16_t h = lm_f32_to_f16((float)x[i]);
            memcpy(b + 2 * i, &h, 2);
            break;
        }
        case LM_I32: {
            int32_t v = (int32_t)(x[i] * 1000);
            memcpy(b + 4 * i, &v, 4);
            break;
        }
        case LM_I64: {
            int64_t v = (int64_t)(x[i] * 1e12) - ((int64_t)1 << 50);
            memcpy(b + 8 * i, &v, 8);
            break;
        }
        case LM_U8:
            b[i] = (uint8_t)(i * 37 + 200);
            break;
        default:
            fail();
        }
    }
    free(x);
    return b;
}

static const char *meta_note = "a \"quoted\" \\ value\nwith newline and unicode \xc3\xa9";

static void write_sample(const char *path) {
    lm_st_writer w;
    lm_error err = {LM_OK, ""};
    lm_st_writer_init(&w);
    for (int k = 0; k < NT; k++) {
        size_t nb;
        void *d = spec_data(k, &nb);
        assert_int_equal(lm_st_writer_add(&w, specs[k].name, specs[k].dt, specs[k].ndim,
                                          specs[k].shape, nb ? d : NULL, &err),
                         LM_OK);
        free(d);
    }
    assert_int_equal(lm_st_writer_meta(&w, "gate", "softplus", &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "lower_bound", "-5", &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "note", meta_note, &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "gate", "bounded", &err), LM_OK); /* last wins */
    assert_int_equal(w.n_meta, 3);
    lm_status s = lm_st_writer_save(&w, path, &err);
    if (s != LM_OK)
        fail_msg("save: %s", err.msg);
    lm_st_writer_free(&w);
}

static void test_roundtrip_all_dtypes(void **state) {
    (void)state;
    char path[128], tmp[160];
    path_in_dir(path, sizeof path, "rt.safetensors");
    write_sample(path);
    /* Atomic write: no temporary file left behind. */
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    assert_int_equal(access(tmp, F_OK), -1);

    /* Raw layout: header length is a multiple of 8, padded with spaces. */
    size_t n;
    uint8_t *raw = read_file(path, &n);
    assert_non_null(raw);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | raw[i];
    assert_int_equal(hlen % 8, 0);
    assert_true(8 + hlen <= n);
    assert_true(raw[8] == '{');
    size_t last = 8 + (size_t)hlen - 1;
    while (raw[last] == ' ')
        last--;
    assert_true(raw[last] == '}');
    assert_true(contains(raw + 8, (size_t)hlen, "\"__metadata__\""));
    free(raw);

    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    lm_status s = lm_st_read(path, &st, &err);
    if (s != LM_OK)
        fail_msg("read: %s", err.msg);
    assert_int_equal(st.n_entries, NT);
    assert_string_equal(st.path, path);
    for (int k = 0; k < NT; k++) {
        const lm_st_entry *e = lm_st_find(&st, specs[k].name);
        assert_non_null(e);
        assert_string_equal(e->name, specs[k].name);
        assert_int_equal(e->dtype, specs[k].dt);
        assert_int_equal(e->ndim, specs[k].ndim);
        for (int i = 0; i < e->ndim; i++)
            assert_int_equal(e->shape[i], specs[k].shape[i]);
        size_t nb;
        void *d = spec_data(k, &nb);
        assert_int_equal(e->end - e->begin, nb);
        if (nb)
            assert_memory_equal(e->data, d, nb);
        free(d);
    }
    assert_null(lm_st_find(&st, "missing"));
    assert_null(lm_st_find(&st, "__metadata__"));
    /* Metadata. */
    assert_int_equal(st.n_meta, 3);
    assert_string_equal(lm_st_meta(&st, "gate"), "bounded");
    assert_string_equal(lm_st_meta(&st, "lower_bound"), "-5");
    assert_string_equal(lm_st_meta(&st, "note"), meta_note);
    assert_null(lm_st_meta(&st, "scale"));

    /* Conversions. */
    float *f = NULL;
    double *g = NULL;
    int64_t *ii = NULL;
    size_t nb;
    uint16_t *hb = spec_data(2, &nb); /* bf16 */
    assert_int_equal(lm_st_to_f32(&st, "bf16", &f, &err), LM_OK);
    assert_int_equal(lm_st_to_f64(&st, "bf16", &g, &err), LM_OK);
    for (int i = 0; i < 6; i++) {
        assert_true(f[i] == lm_bf16_to_f32(hb[i]));
        assert_true(g[i] == (double)lm_bf16_to_f32(hb[i]));
    }
    free(hb);
    free(f);
    free(g);
    uint16_t *hh = spec_data(3, &nb); /* f16 */
    assert_int_equal(lm_st_to_f32(&st, "f16", &f, &err), LM_OK);
    for (int i = 0; i < 5; i++)
        assert_true(f[i] == lm_f16_to_f32(hh[i]));
    free(hh);
    free(f);
    double *xd = spec_data(1, &nb); /* f64 */
    assert_int_equal(lm_st_to_f64(&st, "f64", &g, &err), LM_OK);
    assert_int_equal(lm_st_to_f32(&st, "f64", &f, &err), LM_OK);
    for (int i = 0; i < 4; i++) {
        assert_true(g[i] == xd[i]);
        assert_true(f[i] == (float)xd[i]);
    }
    free(xd);
    free(f);
    free(g);
    float *xf = spec_data(0, &nb); /* f32 */
    assert_int_equal(lm_st_to_f32(&st, "f32", &f, &err), LM_OK);
    assert_memory_equal(f, xf, 6 * sizeof(float));
    free(xf);
    free(f);
    assert_int_equal(lm_st_to_f32(&st, "scalar", &f, &err), LM_OK);
    float *xs = spec_data(7, &nb);
    assert_int_equal(nb, 4);
    assert_true(f[0] == xs[0]);
    free(xs);
    free(f);
    int32_t *xi = spec_data(4, &nb);
    assert_int_equal(lm_st_to_i64(&st, "i32", &ii, &err), LM_OK);
    for (int i = 0; i < 4; i++)
        assert_int_equal(ii[i], xi[i]);
    free(xi);
    free(ii);
    int64_t *xl = spec_data(5, &nb);
    assert_int_equal(lm_st_to_i64(&st, "i64", &ii, &err), LM_OK);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ii[i], xl[i]);
    assert_true(xl[0] < 0 || xl[1] < 0 || xl[2] < 0);
    free(xl);
    free(ii);
    assert_int_equal(lm_st_to_i64(&st, "u8", &ii, &err), LM_OK);
    for (int i = 0; i < 7; i++)
        assert_int_equal(ii[i], (uint8_t)(i * 37 + 200));
    free(ii);
    assert_int_equal(lm_st_to_i64(&st, "empty", &ii, &err), LM_OK);
    assert_non_null(ii);
    free(ii);
    assert_int_equal(lm_st_to_f32(&st, "model.layers.0.empty2", &f, &err), LM_OK);
    free(f);
    /* Type and name errors. */
    f = (float *)&err;
    assert_int_equal(lm_st_to_f32(&st, "i32", &f, &err), LM_ERR_INVALID);
    assert_null(f);
    assert_non_null(strstr(err.msg, "'i32'"));
    assert_non_null(strstr(err.msg, path));
    assert_int_equal(lm_st_to_f64(&st, "u8", &g, &err), LM_ERR_INVALID);
    assert_int_equal(lm_st_to_i64(&st, "f32", &ii, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'f32'"));
    assert_int_equal(lm_st_to_f32(&st, "nope", &f, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'nope'"));
    lm_st_free(&st);
    assert_true(is_empty(&st));
    lm_st_free(&st);
}

static void test_writer(void **state) {
    (void)state;
    lm_st_writer w;
    lm_error err = {LM_OK, ""};
    float v[4] = {1, 2, 3, 4};
    int64_t sh[2] = {2, 2}, bad[2] = {2, -1}, nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    lm_st_writer_init(&w);
    assert_int_equal(lm_st_writer_add(&w, "a", LM_F32, 2, sh, v, &err), LM_OK);
    assert_int_equal(lm_st_writer_add(&w, "a", LM_F32, 2, sh, v, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'a'"));
    assert_int_equal(lm_st_writer_add(&w, "__metadata__", LM_F32, 2, sh, v, &err), LM_ERR_INVALID);
    assert_int_equal(lm_st_writer_add(&w, "b", LM_F32, 2, bad, v, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'b'"));
    assert_int_equal(lm_st_writer_add(&w, "c", LM_F32, 9, nine, v, &err), LM_ERR_INVALID);
    assert_int_equal(lm_st_writer_add(&w, "d", LM_F32, 2, sh, NULL, &err), LM_ERR_INVALID);
    assert_int_equal(lm_st_writer_add(&w, "", LM_F32, 2, sh, v, &err), LM_ERR_INVALID);
    assert_int_equal(lm_st_writer_add(&w, "e", (lm_dtype)42, 2, sh, v, &err), LM_ERR_INVALID);
    assert_int_equal(w.n, 1);
    /* Many tensors: the arrays grow. */
    for (int i = 0; i < 100; i++) {
        char name[16];
        snprintf(name, sizeof name, "t%03d", i);
        float x = (float)i;
        assert_int_equal(lm_st_writer_add(&w, name, LM_F32, 0, NULL, &x, &err), LM_OK);
    }
    char path[128];
    path_in_dir(path, sizeof path, "many.safetensors");
    assert_int_equal(lm_st_writer_save(&w, path, &err), LM_OK);
    /* The data copy is the writer's own: changing the source afterwards is harmless. */
    v[0] = 99;
    lm_safetensors st;
    assert_int_equal(lm_st_read(path, &st, &err), LM_OK);
    assert_int_equal(st.n_entries, 101);
    assert_int_equal(st.n_meta, 0);
    for (int i = 0; i < 100; i++) {
        char name[16];
        snprintf(name, sizeof name, "t%03d", i);
        const lm_st_entry *e = lm_st_find(&st, name);
        assert_non_null(e);
        float x;
        memcpy(&x, e->data, 4);
        assert_true(x == (float)i);
    }
    float *a = NULL;
    assert_int_equal(lm_st_to_f32(&st, "a", &a, &err), LM_OK);
    assert_true(a[0] == 1.0f && a[3] == 4.0f);
    free(a);
    lm_st_free(&st);

    /* Overwrite: the new content replaces the old one. */
    lm_st_writer w2;
    lm_st_writer_init(&w2);
    double dd = 2.5;
    assert_int_equal(lm_st_writer_add(&w2, "only", LM_F64, 0, NULL, &dd, &err), LM_OK);
    assert_int_equal(lm_st_writer_save(&w2, path, &err), LM_OK);
    assert_int_equal(lm_st_read(path, &st, &err), LM_OK);
    assert_int_equal(st.n_entries, 1);
    assert_non_null(lm_st_find(&st, "only"));
    lm_st_free(&st);

    /* Failures: a missing directory; a target that is a directory (rename fails and
     * the temporary file is removed). */
    char nodir[160], isdir[128], tmp[192];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.safetensors", g_dir);
    assert_int_equal(lm_st_writer_save(&w2, nodir, &err), LM_ERR_IO);
    assert_non_null(strstr(err.msg, nodir));
    path_in_dir(isdir, sizeof isdir, "adir");
    assert_int_equal(mkdir(isdir, 0755), 0);
    assert_int_equal(lm_st_writer_save(&w2, isdir, &err), LM_ERR_IO);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", isdir, (long)getpid());
    assert_int_equal(access(tmp, F_OK), -1);
    struct stat sb;
    assert_int_equal(stat(isdir, &sb), 0);
    assert_true(S_ISDIR(sb.st_mode));
    lm_st_writer_free(&w2);
    lm_st_writer_free(&w);
    lm_st_writer_free(&w); /* idempotent */

    /* An empty writer makes a valid file with no tensors. */
    lm_st_writer_init(&w);
    assert_int_equal(lm_st_writer_save(&w, path, &err), LM_OK);
    assert_int_equal(lm_st_read(path, &st, &err), LM_OK);
    assert_int_equal(st.n_entries, 0);
    lm_st_free(&st);
    lm_st_writer_free(&w);
}

/* A header written the way other writers may (no padding, unaligned data, keys in
 * any order, an empty tensor at a boundary). Holes, overlaps and trailing bytes are
 * refused (as by the reference implementation): see bad_cases. */
static void test_foreign_layout(void **state) {
    (void)state;
    const char *json = "{\"b\":{\"shape\":[2],\"dtype\":\"F32\",\"data_offsets\":[0,8]},"
                       "\"__metadata__\":{\"format\":\"pt\"},"
                       "\"a\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
                       "\"z\": {\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[8,8]}}";
    size_t n;
    uint8_t *b = mk(json, 16, &n);
    assert_true(strlen(json) % 8 != 0);
    float fv[2] = {1.25f, -3.5f};
    int64_t iv = -123456789012345;
    memcpy(b + 8 + strlen(json), fv, 8);
    memcpy(b + 8 + strlen(json) + 8, &iv, 8);
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    lm_status s = lm_st_parse(b, n, "foreign", &st, &err);
    free(b); /* the parser keeps its own copy */
    if (s != LM_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(st.n_entries, 3);
    assert_string_equal(lm_st_meta(&st, "format"), "pt");
    float *f;
    int64_t *i;
    assert_int_equal(lm_st_to_f32(&st, "b", &f, &err), LM_OK);
    assert_true(f[0] == 1.25f && f[1] == -3.5f);
    free(f);
    assert_int_equal(lm_st_to_i64(&st, "a", &i, &err), LM_OK);
    assert_int_equal(i[0], iv);
    free(i);
    assert_int_equal(lm_st_find(&st, "z")->ndim, 1);
    lm_st_free(&st);
}

/* ---------------------------------------------------------------- bad input */

typedef struct {
    const char *what;
    const char *json;
    size_t ndata;
    const char *needles[4];
} bad_case;

static const bad_case bad_cases[] = {
    {"not JSON", "{\"w\": {\"dtype\": \"F32\",", 0, {"not valid JSON", NULL}},
    {"empty header", "", 0, {"not valid JSON", NULL}},
    {"root not object", "[1,2]", 0, {"not an object", NULL}},
    {"trailing bytes", "{} x", 0, {"trailing", NULL}},
    {"entry not object", "{\"w\": 5}", 0, {"'w'", "not an object", NULL}},
    {"missing dtype",
     "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'dtype'", NULL}},
    {"missing shape",
     "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'shape'", NULL}},
    {"missing offsets",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}",
     4,
     {"'w'", "'data_offsets'", NULL}},
    {"unknown field",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"xtra\":1}}",
     4,
     {"'w'", "'xtra'", NULL}},
    {"repeated field",
     "{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'dtype'", "twice", NULL}},
    {"unknown dtype",
     "{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}",
     1,
     {"'w'", "'dtype'", "F8_E4M3", NULL}},
    {"lower-case dtype",
     "{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'dtype'", "f32", NULL}},
    {"dtype not string",
     "{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'dtype'", NULL}},
    {"shape not array",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":3,\"data_offsets\":[0,12]}}",
     12,
     {"'w'", "'shape'", NULL}},
    {"negative dim",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'shape'", "-1", NULL}},
    {"fractional dim",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'shape'", "1.5", NULL}},
    {"string dim",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}",
     8,
     {"'w'", "'shape'", NULL}},
    {"huge dim",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'shape'", NULL}},
    {"too many dims",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "'shape'", "9 dims", NULL}},
    {"offsets begin > end",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}",
     8,
     {"'w'", "'data_offsets'", "begin 8 > end 4", NULL}},
    {"offsets past data",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[100],\"data_offsets\":[0,400]}}",
     16,
     {"'w'", "'data_offsets'", "400", NULL}},
    {"offsets not a pair",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}",
     4,
     {"'w'", "'data_offsets'", NULL}},
    {"offsets triple",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}",
     8,
     {"'w'", "'data_offsets'", NULL}},
    {"negative offset",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}",
     4,
     {"'w'", "'data_offsets'", NULL}},
    {"offsets not array",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":\"0-4\"}}",
     4,
     {"'w'", "'data_offsets'", NULL}},
    {"size mismatch",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
     8,
     {"'w'", "12 bytes", "8 bytes", NULL}},
    {"size mismatch 0-dim",
     "{\"w\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "8 bytes", "4 bytes", NULL}},
    {"numel overflow",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
     "\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "overflow", NULL}},
    {"bytes overflow",
     "{\"w\":{\"dtype\":\"F64\",\"shape\":[9007199254740992,1024],\"data_offsets\":[0,8]}}",
     8,
     {"'w'", "overflow", NULL}},
    {"overlap",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     12,
     {"'a'", "'b'", "overlaps", NULL}},
    {"overlap contained",
     "{\"big\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
     "\"c\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[14,16]},"
     "\"small\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
     16,
     {"'big'", "overlaps", NULL}},
    {"integer above 2^53, exactly",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[9007199254740993],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "9007199254740993 x 4", "36028797018963972 bytes", NULL}},
    {"offset 2^64-1, exactly",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18446744073709551615]}}",
     4,
     {"'w'", "end 18446744073709551615", NULL}},
    {"offset 2^64, exactly",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18446744073709551616]}}",
     4,
     {"'w'", "[0,18446744073709551616]", "not a pair of non-negative integers", NULL}},
    {"metadata number, as written",
     "{\"__metadata__\":{\"a\":12345678901234567890},"
     "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'a'", "value 12345678901234567890 is not a string", NULL}},
    {"dim in exponent form",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]}}",
     4,
     {"'w'", "1e0", NULL}},
    {"gap between tensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
     12,
     {"'b'", "gap of 4 bytes", "'a'", NULL}},
    {"gap before the first",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
     8,
     {"'a'", "gap of 4 bytes", "start", NULL}},
    {"trailing data bytes",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     5,
     {"1 trailing bytes", "after the last tensor", NULL}},
    {"data without tensors", "{\"__metadata__\":{}}", 3, {"3 trailing bytes", NULL}},
    {"empty tensor inside another",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}",
     8,
     {"'z'", "overlaps", "'a'", NULL}},
    {"checksums not an object",
     "{\"__metadata__\":{\"linmoe.crc32c\":\"5\"},"
     "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"linmoe.crc32c", "not a JSON object", NULL}},
    {"checksum missing for a tensor",
     "{\"__metadata__\":{\"linmoe.crc32c\":\"{\\\"b\\\":\\\"00000000\\\"}\"},"
     "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'a'", "no valid checksum", NULL}},
    {"overlap identical",
     "{\"p\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"q\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4,
     {"'p'", "'q'", "overlaps", NULL}},
    {"duplicate name",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
     8,
     {"'w'", "twice", NULL}},
    {"metadata not object", "{\"__metadata__\":[1]}", 0, {"'__metadata__'", NULL}},
    {"metadata value number",
     "{\"__metadata__\":{\"gate\":5}}",
     0,
     {"'__metadata__'", "'gate'", "not a string", NULL}},
    {"metadata value object",
     "{\"__metadata__\":{\"cfg\":{\"a\":\"b\"}}}",
     0,
     {"'cfg'", "not a string", NULL}},
    {"metadata value null", "{\"__metadata__\":{\"scale\":null}}", 0, {"'scale'", NULL}},
    {"metadata duplicate key",
     "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}",
     0,
     {"'k'", "twice", NULL}},
    {"metadata twice",
     "{\"__metadata__\":{},\"__metadata__\":{}}",
     0,
     {"'__metadata__'", "twice", NULL}},
};

static const char *bad_json(const char *what) {
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++)
        if (strcmp(bad_cases[i].what, what) == 0)
            return bad_cases[i].json;
    fail_msg("no bad case '%s'", what);
    return NULL;
}

static void test_bad_headers(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *c = &bad_cases[i];
        size_t n;
        uint8_t *b = mk(c->json, c->ndata, &n);
        expect_format_buf(c->what, b, n, c->needles);
        free(b);
    }
}

static void test_bad_lengths(void **state) {
    (void)state;
    size_t n;
    const char *ok = "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    /* Shorter than the length prefix (including empty). */
    static const uint8_t three[3] = {1, 2, 3};
    expect_format_buf("3-byte file", three, 3, (const char *const[]){"shorter", NULL});
    expect_format_buf("empty file", three, 0, (const char *const[]){"shorter", NULL});
    /* Header length past the end of the file. */
    uint8_t *b = mk_raw(1000, ok, strlen(ok), 4, &n);
    expect_format_buf("header length past EOF", b, n,
                      (const char *const[]){"header length 1000", "past the end", NULL});
    free(b);
    /* ... by exactly one byte. */
    b = mk_raw(strlen(ok) + 5, ok, strlen(ok), 4, &n);
    expect_format_buf("header length EOF+1", b, n, (const char *const[]){"past the end", NULL});
    free(b);
    /* Absurd header lengths. */
    b = mk_raw(UINT64_MAX, ok, strlen(ok), 4, &n);
    expect_format_buf("header length 2^64-1", b, n, (const char *const[]){"exceeds", NULL});
    free(b);
    b = mk_raw(100000001, ok, strlen(ok), 4, &n);
    expect_format_buf("header length 100MB+1", b, n, (const char *const[]){"exceeds", NULL});
    free(b);
    /* Header length shorter than the JSON: the JSON is cut. */
    b = mk_raw(strlen(ok) - 3, ok, strlen(ok), 4, &n);
    expect_format_buf("header length cuts JSON", b, n, (const char *const[]){"JSON", NULL});
    free(b);
    /* A NUL byte inside the header. */
    char withnul[64];
    memcpy(withnul, "{\"a\":1}\0   ", 11);
    b = mk_raw(11, withnul, 11, 0, &n);
    expect_format_buf("NUL in header", b, n, (const char *const[]){"NUL", NULL});
    free(b);
    /* Sanity: the unmodified header is accepted. */
    b = mk(ok, 4, &n);
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_parse(b, n, "ok", &st, &err), LM_OK);
    lm_st_free(&st);
    free(b);
    /* NULL buffer with a size is an argument error, not a crash. */
    assert_int_equal(lm_st_parse(NULL, 10, "null", &st, &err), LM_ERR_INVALID);
    assert_true(is_empty(&st));
}

/* Real files through lm_st_read: missing, malformed, truncated at every length. */
static void test_bad_files(void **state) {
    (void)state;
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    char path[128], bad[128];
    path_in_dir(path, sizeof path, "does-not-exist.safetensors");
    assert_int_equal(lm_st_read(path, &st, &err), LM_ERR_IO);
    assert_non_null(strstr(err.msg, path));
    assert_true(is_empty(&st));
    assert_int_equal(lm_st_read(g_dir, &st, &err), LM_ERR_IO); /* a directory */

    /* A malformed file on disk: the message names the path and tensor. */
    path_in_dir(bad, sizeof bad, "overlap.safetensors");
    size_t n;
    uint8_t *b = mk(bad_json("overlap"), 12, &n);
    assert_int_equal(write_file(bad, b, n), 0);
    free(b);
    assert_int_equal(lm_st_read(bad, &st, &err), LM_ERR_FORMAT);
    printf("file: %s\n", err.msg);
    assert_non_null(strstr(err.msg, bad));
    assert_non_null(strstr(err.msg, "'b'"));
    assert_true(is_empty(&st));

    /* A good file truncated at every length fails cleanly (the last tensor in the
     * data section is non-empty, so any cut loses bytes of it or of the header). */
    path_in_dir(path, sizeof path, "good.safetensors");
    lm_st_writer w;
    lm_st_writer_init(&w);
    float v[3] = {1, 2, 3};
    int64_t sh = 3;
    assert_int_equal(lm_st_writer_add(&w, "x", LM_F32, 1, &sh, v, &err), LM_OK);
    assert_int_equal(lm_st_writer_add(&w, "tail", LM_F32, 1, &sh, v, &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "k", "v", &err), LM_OK);
    assert_int_equal(lm_st_writer_save(&w, path, &err), LM_OK);
    lm_st_writer_free(&w);
    uint8_t *raw = read_file(path, &n);
    assert_non_null(raw);
    assert_int_equal(lm_st_read(path, &st, &err), LM_OK);
    lm_st_free(&st);
    path_in_dir(bad, sizeof bad, "truncated.safetensors");
    for (size_t cut = 0; cut < n; cut++) {
        assert_int_equal(write_file(bad, raw, cut), 0);
        err.status = LM_OK;
        lm_status s = lm_st_read(bad, &st, &err);
        if (s != LM_ERR_FORMAT)
            fail_msg("truncated to %zu of %zu bytes: status %d", cut, n, s);
        assert_true(is_empty(&st));
        assert_non_null(strstr(err.msg, bad));
        if (cut == n - 1) {
            printf("truncated by 1 byte: %s\n", err.msg);
            assert_non_null(strstr(err.msg, "'tail'"));
            assert_non_null(strstr(err.msg, "data_offsets"));
        }
    }
    free(raw);
}

/* Random byte mutations of a valid file: every result is OK or LM_ERR_FORMAT, and
 * an accepted file's entries are all inside the buffer (run under ASan). */
static void test_mutations(void **state) {
    (void)state;
    lm_st_writer w;
    lm_error err = {LM_OK, ""};
    lm_st_writer_init(&w);
    double d[6] = {1, 2, 3, 4, 5, 6};
    int64_t sh[2] = {2, 3};
    assert_int_equal(lm_st_writer_add(&w, "a", LM_F64, 2, sh, d, &err), LM_OK);
    assert_int_equal(lm_st_writer_add(&w, "b", LM_F32, 1, sh, d, &err), LM_OK);
    assert_int_equal(lm_st_writer_add(&w, "c", LM_U8, 2, sh, d, &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "m", "x", &err), LM_OK);
    char path[128];
    path_in_dir(path, sizeof path, "mut.safetensors");
    assert_int_equal(lm_st_writer_save(&w, path, &err), LM_OK);
    lm_st_writer_free(&w);
    size_t n;
    uint8_t *raw = read_file(path, &n);
    uint8_t *m = malloc(n);
    lm_rng r;
    lm_rng_init(&r, 31337);
    static const char alphabet[] = "{}[],:\"0123456789-.eE \\abF";
    int n_ok = 0, n_bad = 0;
    for (int it = 0; it < 4000; it++) {
        memcpy(m, raw, n);
        int k = 1 + (int)(lm_rng_u32(&r) % 3);
        for (int j = 0; j < k; j++) {
            size_t pos = lm_rng_u32(&r) % n;
            uint32_t how = lm_rng_u32(&r) % 3;
            if (how == 0)
                m[pos] = (uint8_t)lm_rng_u32(&r);
            else if (how == 1 && pos >= 8)
                m[pos] = (uint8_t)alphabet[lm_rng_u32(&r) % (sizeof alphabet - 1)];
            else
                m[pos] ^= (uint8_t)(1u << (lm_rng_u32(&r) % 8));
        }
        size_t len = (it % 5 == 0) ? lm_rng_u32(&r) % (n + 1) : n;
        lm_safetensors st;
        err.status = LM_OK;
        lm_status s = lm_st_parse(m, len, "mutant", &st, &err);
        if (s == LM_OK) {
            n_ok++;
            uint64_t hl = 0;
            for (int i = 7; i >= 0; i--)
                hl = (hl << 8) | st.buf[i];
            size_t data0 = 8 + (size_t)hl;
            for (int i = 0; i < st.n_entries; i++) {
                const lm_st_entry *e = &st.entries[i];
                assert_true(e->begin <= e->end);
                assert_true(data0 + e->end <= st.size);
                assert_ptr_equal(e->data, st.buf + data0 + e->begin);
                if (e->dtype <= LM_F16) {
                    double *x;
                    assert_int_equal(lm_st_to_f64(&st, e->name, &x, &err), LM_OK);
                    free(x);
                }
            }
        } else {
            if (s != LM_ERR_FORMAT)
                fail_msg("mutation %d: status %d (%s)", it, s, err.msg);
            assert_true(is_empty(&st));
            assert_true(strlen(err.msg) > 0);
            n_bad++;
        }
        lm_st_free(&st);
    }
    printf("mutations: %d accepted, %d rejected\n", n_ok, n_bad);
    assert_true(n_bad > 1000);
    free(m);
    free(raw);
}

/* ---------------------------------------------------------------- checksums */

/* lm_st_read of `path` with stderr captured into `errbuf` */
static lm_status read_capturing_stderr(const char *path, lm_safetensors *st, lm_error *err,
                                       char *errbuf, size_t n) {
    char cap[128];
    path_in_dir(cap, sizeof cap, "stderr.txt");
    fflush(stderr);
    int saved = dup(2);
    FILE *f = fopen(cap, "w");
    assert_non_null(f);
    dup2(fileno(f), 2);
    lm_status s = lm_st_read(path, st, err);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    fclose(f);
    size_t len;
    uint8_t *t = read_file(cap, &len);
    snprintf(errbuf, n, "%.*s", (int)len, t ? (const char *)t : "");
    free(t);
    return s;
}

/* CRC-32C against RFC 3720 B.4's vectors; every file the writer makes carries a
 * checksum per tensor; a flipped byte anywhere in a tensor is a clear error naming the
 * tensor; a file without checksums loads with one line on stderr saying so. */
static void test_checksums(void **state) {
    (void)state;
    uint8_t z[32], ff[32], inc[32];
    for (int i = 0; i < 32; i++)
        z[i] = 0, ff[i] = 0xff, inc[i] = (uint8_t)i;
    assert_int_equal(lm_crc32c(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(lm_crc32c(0, z, 32), 0x8A9136AAu);
    assert_int_equal(lm_crc32c(0, ff, 32), 0x62A8AB43u);
    assert_int_equal(lm_crc32c(0, inc, 32), 0x46DD794Eu);
    assert_int_equal(lm_crc32c(lm_crc32c(0, inc, 13), inc + 13, 19), 0x46DD794Eu);
    /* a file with two tensors */
    lm_st_writer w;
    lm_error err = {LM_OK, ""};
    float v[6] = {1, 2, 3, 4, 5, 6};
    int64_t sh[1] = {6}, sh2[1] = {3};
    lm_st_writer_init(&w);
    assert_int_equal(lm_st_writer_add(&w, "w", LM_F32, 1, sh, v, &err), LM_OK);
    assert_int_equal(lm_st_writer_add(&w, "u", LM_I64, 1, sh2, (int64_t[]){7, 8, 9}, &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "format", "pt", &err), LM_OK);
    char path[128];
    path_in_dir(path, sizeof path, "crc.safetensors");
    assert_int_equal(lm_st_writer_save(&w, path, &err), LM_OK);
    lm_st_writer_free(&w);
    lm_safetensors st;
    char errs[1024];
    assert_int_equal(read_capturing_stderr(path, &st, &err, errs, sizeof errs), LM_OK);
    assert_int_equal(st.n_checksums, 2);
    assert_null(lm_st_meta(&st, "linmoe.crc32c")); /* checked, then not the caller's */
    assert_string_equal(lm_st_meta(&st, "format"), "pt");
    assert_string_equal(errs, "");
    lm_st_free(&st);
    /* flip each byte of the data section in turn: every flip is caught, naming the tensor */
    size_t n;
    uint8_t *raw = read_file(path, &n);
    assert_non_null(raw);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | raw[i];
    const size_t data0 = 8 + (size_t)hlen;
    assert_int_equal(n - data0, 24 + 24);
    int caught = 0;
    for (size_t at = data0; at < n; at++) {
        raw[at] ^= 0x10;
        lm_status s = lm_st_parse(raw, n, "flipped.safetensors", &st, &err);
        raw[at] ^= 0x10;
        const char *tensor = at - data0 < 24 ? "'w'" : "'u'";
        if (at == data0)
            printf("flipped byte -> %s\n", err.msg);
        if (s == LM_ERR_FORMAT && strstr(err.msg, "flipped.safetensors") &&
            strstr(err.msg, tensor) && strstr(err.msg, "checksum mismatch"))
            caught++;
        lm_st_free(&st);
    }
    assert_int_equal(caught, (int)(n - data0));
    free(raw);
    /* a file without checksums (another writer): loads, and says so on stderr */
    const char *json = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    uint8_t *b = mk(json, 4, &n);
    path_in_dir(path, sizeof path, "foreign.safetensors");
    assert_int_equal(write_file(path, b, n), 0);
    free(b);
    assert_int_equal(read_capturing_stderr(path, &st, &err, errs, sizeof errs), LM_OK);
    printf("no checksums -> stderr: %s", errs);
    assert_int_equal(st.n_checksums, 0);
    assert_non_null(strstr(errs, "foreign.safetensors"));
    assert_non_null(strstr(errs, "no tensor checksums"));
    assert_non_null(strchr(errs, '\n'));
    assert_true(strchr(errs, '\n') == errs + strlen(errs) - 1); /* one line */
    lm_st_free(&st);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_all_dtypes),
        cmocka_unit_test(test_writer),
        cmocka_unit_test(test_foreign_layout),
        cmocka_unit_test(test_bad_headers),
        cmocka_unit_test(test_bad_lengths),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_checksums),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
