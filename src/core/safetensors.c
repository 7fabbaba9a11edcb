/* safetensors read (validated before any tensor byte is touched) and atomic write.
 *
 * Format (huggingface/safetensors): u64 little-endian N, then N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {"key": "value", ...}}, then the data section; offsets are
 * relative to the start of the data section. */
#include "linmoe/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header larger than this is treated as corrupt (the reference implementation
 * uses the same 100 MB cap). */
#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)
/* JSON numbers are doubles: integers above 2^53 cannot be represented exactly. */
#define ST_MAX_JSON_INT 9007199254740992.0
/* __metadata__ key of the per-tensor checksums linmoe writes */
#define ST_CRC_KEY "linmoe.crc32c"

static char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = LM_MALLOC(n);
    memcpy(d, s, n);
    return d;
}

static uint64_t read_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* ---------------------------------------------------------------- reader */

void lm_st_free(lm_safetensors *st) {
    if (!st)
        return;
    for (int i = 0; i < st->n_entries; i++)
        free(st->entries[i].name);
    free(st->entries);
    for (int i = 0; i < st->n_meta; i++) {
        free(st->meta_keys[i]);
        free(st->meta_vals[i]);
    }
    free(st->meta_keys);
    free(st->meta_vals);
    free(st->buf);
    free(st->path);
    memset(st, 0, sizeof *st);
}

/* cJSON keeps numbers as doubles only: 2^53 + 1 reads as 2^53 and 2^64 - 1 prints as
 * 1.8446744073709552e+19. The header's text is at hand, so every number item gets its
 * own text attached as valuestring (malloc'd; cJSON_Delete frees the valuestring of
 * any item that is not a reference, and nothing reads it for numbers): the k-th number
 * token of the text is the k-th number item in document order. */
static void number_items(cJSON *j, cJSON ***v, size_t *n, size_t *cap) {
    for (; j; j = j->next) {
        if (cJSON_IsNumber(j)) {
            if (*n == *cap) {
                *cap = *cap ? *cap * 2 : 64;
                *v = realloc(*v, *cap * sizeof **v);
                LM_CHECK(*v != NULL);
            }
            (*v)[(*n)++] = j;
        }
        if (j->child)
            number_items(j->child, v, n, cap);
    }
}

static void attach_number_text(cJSON *root, const char *text, size_t len) {
    cJSON **items = NULL;
    size_t n = 0, cap = 0, k = 0;
    number_items(root, &items, &n, &cap);
    for (size_t i = 0; i < len && k < n;) {
        const char c = text[i];
        if (c == '"') { /* skip a string, escapes included */
            for (i++; i < len && text[i] != '"'; i++)
                if (text[i] == '\\')
                    i++;
            i++;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            size_t e = i;
            while (e < len && strchr("+-0123456789.eE", text[e]))
                e++;
            if (!items[k]->valuestring) {
                char *t = malloc(e - i + 1);
                LM_CHECK(t != NULL);
                memcpy(t, text + i, e - i);
                t[e - i] = '\0';
                items[k]->valuestring = t;
            }
            k++;
            i = e;
        } else {
            i++;
        }
    }
    free(items);
}

/* A JSON number that is a non-negative integer, exactly (its digits, up to 2^64 - 1). */
static int json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j))
        return 0;
    const char *t = j->valuestring;
    if (t) {
        if (!*t || strspn(t, "0123456789") != strlen(t) || (t[0] == '0' && t[1]))
            return 0;
        errno = 0;
        char *end = NULL;
        unsigned long long v = strtoull(t, &end, 10);
        if (errno == ERANGE || *end)
            return 0;
        *out = (uint64_t)v;
        return 1;
    }
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > ST_MAX_JSON_INT || d != (double)(uint64_t)d)
        return 0;
    *out = (uint64_t)d;
    return 1;
}

/* Printable description of a JSON value for error messages (numbers as written). */
static void desc_append(const cJSON *j, char *buf, size_t n, size_t *u) {
    if (*u + 1 >= n)
        return;
    if (cJSON_IsNumber(j) && j->valuestring) {
        *u += (size_t)snprintf(buf + *u, n - *u, "%s", j->valuestring);
    } else if (cJSON_IsArray(j) || cJSON_IsObject(j)) {
        const int obj = cJSON_IsObject(j);
        *u += (size_t)snprintf(buf + *u, n - *u, "%c", obj ? '{' : '[');
        for (const cJSON *c = j->child; c && *u + 1 < n; c = c->next) {
            if (c != j->child)
                *u += (size_t)snprintf(buf + *u, n - *u, ",");
            if (obj && *u + 1 < n)
                *u += (size_t)snprintf(buf + *u, n - *u, "\"%s\":", c->string ? c->string : "");
            desc_append(c, buf, n, u);
        }
        if (*u + 1 < n)
            *u += (size_t)snprintf(buf + *u, n - *u, "%c", obj ? '}' : ']');
    } else {
        char *s = cJSON_PrintUnformatted(j);
        *u += (size_t)snprintf(buf + *u, n - *u, "%s", s ? s : "(unprintable)");
        free(s);
    }
    if (*u >= n)
        *u = n - 1;
}

static void json_desc(const cJSON *j, char *buf, size_t n) {
    if (!j) {
        snprintf(buf, n, "(missing)");
        return;
    }
    size_t u = 0;
    buf[0] = '\0';
    desc_append(j, buf, n, &u);
    if (u + 1 >= n && n > 4)
        memcpy(buf + n - 4, "...", 4);
}

static int cmp_entry_name(const void *a, const void *b) {
    return strcmp(((const lm_st_entry *)a)->name, ((const lm_st_entry *)b)->name);
}

static int cmp_entry_range(const void *a, const void *b) {
    const lm_st_entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

static lm_status parse_metadata(lm_safetensors *st, const cJSON *meta, lm_error *err) {
    const char *f = st->path;
    if (!cJSON_IsObject(meta))
        return lm_errorf(err, LM_ERR_FORMAT, "%s: '__metadata__' is not an object of strings", f);
    int n = cJSON_GetArraySize(meta);
    st->meta_keys = LM_CALLOC((size_t)n, sizeof(char *));
    st->meta_vals = LM_CALLOC((size_t)n, sizeof(char *));
    for (const cJSON *m = meta->child; m; m = m->next) {
        const char *key = m->string ? m->string : "";
        if (!cJSON_IsString(m) || !m->valuestring) {
            char d[96];
            json_desc(m, d, sizeof d);
            return lm_errorf(err, LM_ERR_FORMAT,
                             "%s: '__metadata__' key '%s': value %s is not a string", f, key, d);
        }
        for (int i = 0; i < st->n_meta; i++)
            if (strcmp(st->meta_keys[i], key) == 0)
                return lm_errorf(err, LM_ERR_FORMAT, "%s: '__metadata__' key '%s' appears twice", f,
                                 key);
        st->meta_keys[st->n_meta] = xstrdup(key);
        st->meta_vals[st->n_meta] = xstrdup(m->valuestring);
        st->n_meta++;
    }
    return LM_OK;
}

/* Validates one tensor entry of the header into *e (name not yet set). */
static lm_status parse_entry(const char *f, const char *name, const cJSON *j, uint64_t data_size,
                             lm_st_entry *e, lm_error *err) {
    if (!cJSON_IsObject(j))
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': entry is not an object with dtype, shape, data_offsets",
                         f, name);
    const cJSON *jd = NULL, *js = NULL, *jo = NULL;
    for (const cJSON *c = j->child; c; c = c->next) {
        const cJSON **slot = NULL;
        if (c->string && strcmp(c->string, "dtype") == 0)
            slot = &jd;
        else if (c->string && strcmp(c->string, "shape") == 0)
            slot = &js;
        else if (c->string && strcmp(c->string, "data_offsets") == 0)
            slot = &jo;
        if (!slot)
            return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s': unknown field '%s'", f, name,
                             c->string ? c->string : "");
        if (*slot)
            return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s': field '%s' appears twice", f,
                             name, c->string);
        *slot = c;
    }
    char d[96];
    /* dtype */
    if (!jd)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s': missing field 'dtype'", f, name);
    if (!cJSON_IsString(jd) || !jd->valuestring || lm_dtype_from_name(jd->valuestring, &e->dtype)) {
        json_desc(jd, d, sizeof d);
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': field 'dtype': unknown dtype %s (supported: F32, F64, "
                         "BF16, F16, I32, I64, U8)",
                         f, name, d);
    }
    /* shape */
    if (!js)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s': missing field 'shape'", f, name);
    if (!cJSON_IsArray(js)) {
        json_desc(js, d, sizeof d);
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s': field 'shape': %s is not an array",
                         f, name, d);
    }
    int nd = cJSON_GetArraySize(js);
    if (nd > LM_MAX_DIMS)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': field 'shape': %d dims, more than the %d supported", f,
                         name, nd, LM_MAX_DIMS);
    e->ndim = nd;
    uint64_t numel = 1;
    int overflow = 0;
    int i = 0;
    for (const cJSON *c = js->child; c; c = c->next, i++) {
        uint64_t dim;
        if (!json_uint(c, &dim)) {
            json_desc(c, d, sizeof d);
            return lm_errorf(err, LM_ERR_FORMAT,
                             "%s: tensor '%s': field 'shape': dim %d = %s is not a non-negative "
                             "integer",
                             f, name, i, d);
        }
        e->shape[i] = (int64_t)dim;
        if (dim != 0 && numel > UINT64_MAX / dim)
            overflow = 1;
        else
            numel *= dim;
    }
    for (; i < LM_MAX_DIMS; i++)
        e->shape[i] = 0;
    /* data_offsets */
    if (!jo)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s': missing field 'data_offsets'", f,
                         name);
    uint64_t b = 0, en = 0;
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_uint(jo->child, &b) ||
        !json_uint(jo->child->next, &en)) {
        json_desc(jo, d, sizeof d);
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': field 'data_offsets': %s is not a pair of non-negative "
                         "integers",
                         f, name, d);
    }
    if (b > en)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': field 'data_offsets': begin %llu > end %llu", f, name,
                         (unsigned long long)b, (unsigned long long)en);
    if (en > data_size)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': field 'data_offsets': end %llu is past the data "
                         "section (%llu bytes)",
                         f, name, (unsigned long long)en, (unsigned long long)data_size);
    e->begin = b;
    e->end = en;
    /* shape x dtype == byte span */
    uint64_t esz = lm_dtype_size(e->dtype);
    if (overflow || numel > UINT64_MAX / esz)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': field 'shape': element count x %llu bytes overflows 64 "
                         "bits",
                         f, name, (unsigned long long)esz);
    if (numel * esz != en - b)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: tensor '%s': shape x dtype = %llu x %llu = %llu bytes but "
                         "data_offsets [%llu, %llu] span %llu bytes",
                         f, name, (unsigned long long)numel, (unsigned long long)esz,
                         (unsigned long long)(numel * esz), (unsigned long long)b,
                         (unsigned long long)en, (unsigned long long)(en - b));
    return LM_OK;
}

/* Validates st->buf[0..st->size) and fills the entries; st->path and st->buf set. */
/* ---------------------------------------------------------------- CRC32C */

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor
 * ~0: RFC 3720 B.4, the iSCSI / ext4 / Snappy checksum; check value 0xE3069283 for
 * "123456789"): the SSE4.2 crc32 instruction (the same polynomial) where the CPU has
 * it, else slicing-by-8 with the tables built on the stack per call (8 KiB, ~16k
 * operations: no global state, negligible next to a tensor). */
static void crc32c_table(uint32_t t[8][256]) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int k = 1; k < 8; k++)
            t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
}

static uint32_t crc32c_sw(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t t[8][256];
    crc32c_table(t);
    crc = ~crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* little-endian hosts only (safetensors.h) */
        w ^= crc;
        crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
              t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
              t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p,
                                                            size_t n) {
    uint64_t c = ~crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--)
        c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}
#endif

uint32_t lm_crc32c(uint32_t crc, const void *data, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("sse4.2"))
        return crc32c_hw(crc, data, n);
#endif
    return crc32c_sw(crc, data, n);
}

/* The checksums linmoe writes (lm_st_writer_save): metadata key ST_CRC_KEY holds a JSON
 * object text {"tensor name": "8 hex digits of its CRC-32C", ...}. Verified here, then
 * dropped from the metadata the caller sees (st->n_checksums counts the tensors). */
static lm_status verify_checksums(lm_safetensors *st, lm_error *err) {
    const char *f = st->path;
    int at = -1;
    for (int i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta_keys[i], ST_CRC_KEY) == 0)
            at = i;
    if (at < 0)
        return LM_OK;
    cJSON *m = cJSON_Parse(st->meta_vals[at]);
    lm_status s = LM_OK;
    if (!cJSON_IsObject(m)) {
        s = lm_errorf(err, LM_ERR_FORMAT,
                      "%s: '__metadata__' key '%s' is not a JSON object of tensor checksums", f,
                      ST_CRC_KEY);
        goto out;
    }
    for (int i = 0; i < st->n_entries && s == LM_OK; i++) {
        const lm_st_entry *e = &st->entries[i];
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, e->name);
        char *endp = NULL;
        unsigned long want = 0;
        if (cJSON_IsString(v) && v->valuestring && strlen(v->valuestring) == 8)
            want = strtoul(v->valuestring, &endp, 16);
        if (!endp || *endp) {
            s = lm_errorf(err, LM_ERR_FORMAT,
                          "%s: tensor '%s' has no valid checksum in '__metadata__.%s' (the file "
                          "was changed after linmoe wrote it)",
                          f, e->name, ST_CRC_KEY);
            break;
        }
        const uint32_t got = lm_crc32c(0, e->data, (size_t)(e->end - e->begin));
        if (got != (uint32_t)want)
            s = lm_errorf(err, LM_ERR_FORMAT,
                          "%s: tensor '%s': checksum mismatch (CRC-32C %08x stored, %08x of the "
                          "%llu bytes read at data offset %llu): the file is corrupt",
                          f, e->name, (unsigned)want, (unsigned)got,
                          (unsigned long long)(e->end - e->begin), (unsigned long long)e->begin);
    }
    if (s == LM_OK && cJSON_GetArraySize(m) != st->n_entries)
        s = lm_errorf(err, LM_ERR_FORMAT,
                      "%s: '__metadata__.%s' lists %d checksums for %d tensors (the file was "
                      "changed after linmoe wrote it)",
                      f, ST_CRC_KEY, cJSON_GetArraySize(m), st->n_entries);
    if (s == LM_OK) {
        st->n_checksums = st->n_entries;
        free(st->meta_keys[at]);
        free(st->meta_vals[at]);
        for (int i = at + 1; i < st->n_meta; i++) {
            st->meta_keys[i - 1] = st->meta_keys[i];
            st->meta_vals[i - 1] = st->meta_vals[i];
        }
        st->n_meta--;
    }
out:
    cJSON_Delete(m);
    return s;
}

static lm_status parse_owned(lm_safetensors *st, lm_error *err) {
    const char *f = st->path;
    if (st->size < 8)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: file is %zu bytes, shorter than the 8-byte header length", f,
                         st->size);
    uint64_t hlen = read_le64(st->buf);
    if (hlen > ST_MAX_HEADER)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: header length %llu exceeds the %llu-byte limit (corrupt file?)", f,
                         (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
    if (hlen > (uint64_t)st->size - 8)
        return lm_errorf(
            err, LM_ERR_FORMAT,
            "%s: header length %llu is past the end of the file (8 + %llu > %zu bytes)", f,
            (unsigned long long)hlen, (unsigned long long)hlen, st->size);
    uint64_t data_size = (uint64_t)st->size - 8 - hlen;
    const uint8_t *data = st->buf + 8 + hlen;

    /* NUL-terminated copy: the JSON parser never reads past it. */
    char *hdr = LM_MALLOC((size_t)hlen + 1);
    memcpy(hdr, st->buf + 8, (size_t)hlen);
    hdr[hlen] = '\0';
    if (memchr(hdr, '\0', (size_t)hlen)) {
        size_t at = strlen(hdr);
        free(hdr);
        return lm_errorf(err, LM_ERR_FORMAT, "%s: header contains a NUL byte at file offset %zu", f,
                         at + 8);
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
        size_t at = end && end >= hdr && end <= hdr + hlen ? (size_t)(end - hdr) : 0;
        free(hdr);
        return lm_errorf(err, LM_ERR_FORMAT,
                         "%s: header is not valid JSON (error near header byte %zu of %llu)", f, at,
                         (unsigned long long)hlen);
    }
    /* Only whitespace (the writer's space padding) may follow the JSON value. */
    for (const char *p = end; p && p < hdr + hlen; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            size_t at = (size_t)(p - hdr);
            cJSON_Delete(root);
            free(hdr);
            return lm_errorf(
                err, LM_ERR_FORMAT,
                "%s: header has trailing bytes after the JSON object (header byte %zu)", f, at);
        }
    }
    attach_number_text(root, hdr, (size_t)hlen);
    free(hdr);
    lm_status s = LM_OK;
    if (!cJSON_IsObject(root)) {
        s = lm_errorf(err, LM_ERR_FORMAT, "%s: header JSON is not an object", f);
        goto done;
    }
    int n = cJSON_GetArraySize(root);
    st->entries = LM_CALLOC((size_t)n, sizeof(lm_st_entry));
    int seen_meta = 0;
    for (const cJSON *c = root->child; c; c = c->next) {
        const char *name = c->string ? c->string : "";
        if (strcmp(name, "__metadata__") == 0) {
            if (seen_meta) {
                s = lm_errorf(err, LM_ERR_FORMAT, "%s: '__metadata__' appears twice", f);
                goto done;
            }
            seen_meta = 1;
            if ((s = parse_metadata(st, c, err)) != LM_OK)
                goto done;
            continue;
        }
        lm_st_entry *e = &st->entries[st->n_entries];
        if ((s = parse_entry(f, name, c, data_size, e, err)) != LM_OK)
            goto done;
        e->name = xstrdup(name);
        e->data = data + e->begin;
        st->n_entries++;
    }
    /* Duplicate names (JSON allows repeated keys; the format does not). */
    qsort(st->entries, (size_t)st->n_entries, sizeof(lm_st_entry), cmp_entry_name);
    for (int i = 1; i < st->n_entries; i++) {
        if (strcmp(st->entries[i - 1].name, st->entries[i].name) == 0) {
            s = lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", f,
                          st->entries[i].name);
            goto done;
        }
    }
    /* The tensors must tile the data section exactly, as the reference implementation
     * requires (safetensors' Metadata::validate): sorted by offsets, each begins where
     * the previous one ended (the first at 0; an empty tensor at the current end), and
     * the last ends at the end of the file. A gap, an overlap or trailing bytes are
     * bytes no tensor accounts for (or two tensors sharing bytes): a corrupt file. */
    if (st->n_entries > 0 || data_size > 0) {
        lm_st_entry *byr =
            LM_MALLOC((size_t)(st->n_entries ? st->n_entries : 1) * sizeof(lm_st_entry));
        memcpy(byr, st->entries, (size_t)st->n_entries * sizeof(lm_st_entry));
        qsort(byr, (size_t)st->n_entries, sizeof(lm_st_entry), cmp_entry_range);
        uint64_t at = 0;
        const lm_st_entry *prev = NULL;
        for (int i = 0; i < st->n_entries && s == LM_OK; i++) {
            const lm_st_entry *e = &byr[i];
            if (e->begin < at)
                s = lm_errorf(err, LM_ERR_FORMAT,
                              "%s: tensor '%s': field 'data_offsets' [%llu, %llu] overlaps tensor "
                              "'%s' [%llu, %llu]",
                              f, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                              prev->name, (unsigned long long)prev->begin,
                              (unsigned long long)prev->end);
            else if (e->begin > at)
                s = lm_errorf(err, LM_ERR_FORMAT,
                              "%s: tensor '%s': field 'data_offsets' [%llu, %llu] leaves a gap of "
                              "%llu bytes after %s%s%s (the tensors must tile the data section)",
                              f, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                              (unsigned long long)(e->begin - at), prev ? "tensor '" : "",
                              prev ? prev->name : "the start of the data section", prev ? "'" : "");
            at = e->end;
            prev = e;
        }
        if (s == LM_OK && at != data_size)
            s = lm_errorf(err, LM_ERR_FORMAT,
                          "%s: %llu trailing bytes after the last tensor (the data section has "
                          "%llu bytes, the tensors end at %llu)",
                          f, (unsigned long long)(data_size - at), (unsigned long long)data_size,
                          (unsigned long long)at);
        free(byr);
        if (s != LM_OK)
            goto done;
    }
    s = verify_checksums(st, err);
done:
    cJSON_Delete(root);
    return s;
}

/* Takes ownership of buf and path; on failure frees everything and leaves *out empty. */
static lm_status parse_take(uint8_t *buf, size_t size, char *path, lm_safetensors *out,
                            lm_error *err) {
    lm_safetensors st;
    memset(&st, 0, sizeof st);
    st.buf = buf;
    st.size = size;
    st.path = path;
    lm_status s = parse_owned(&st, err);
    if (s != LM_OK) {
        lm_st_free(&st);
        return s;
    }
    *out = st;
    return LM_OK;
}

lm_status lm_st_parse(const void *bytes, size_t size, const char *label, lm_safetensors *out,
                      lm_error *err) {
    LM_CHECK(out != NULL);
    memset(out, 0, sizeof *out);
    const char *lab = label ? label : "(buffer)";
    if (!bytes && size > 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: NULL buffer of %zu bytes", lab, size);
    uint8_t *buf = LM_MALLOC(size);
    if (size)
        memcpy(buf, bytes, size);
    return parse_take(buf, size, xstrdup(lab), out, err);
}

lm_status lm_st_read(const char *path, lm_safetensors *out, lm_error *err) {
    LM_CHECK(out != NULL);
    memset(out, 0, sizeof *out);
    if (!path)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors: NULL path");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot open for reading: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return lm_errorf(err, LM_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return lm_errorf(err, LM_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 0 || (uint64_t)sb.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return lm_errorf(err, LM_ERR_IO, "%s: file size %lld is not addressable", path,
                         (long long)sb.st_size);
    }
    size_t size = (size_t)sb.st_size;
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) {
        close(fd);
        return lm_errorf(err, LM_ERR_NOMEM, "%s: cannot allocate %zu bytes to read the file", path,
                         size);
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = errno;
            free(buf);
            close(fd);
            if (r == 0)
                return lm_errorf(err, LM_ERR_IO, "%s: file shrank while reading (%zu of %zu bytes)",
                                 path, got, size);
            return lm_errorf(err, LM_ERR_IO, "%s: read failed: %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    LM_TRY(parse_take(buf, size, xstrdup(path), out, err));
    if (out->n_entries > 0 && out->n_checksums == 0)
        fprintf(stderr,
                "linmoe: note: %s has no tensor checksums (not written by linmoe): loaded "
                "without verifying its bytes\n",
                path);
    return LM_OK;
}

const lm_st_entry *lm_st_find(const lm_safetensors *st, const char *name) {
    if (!st || !name || st->n_entries == 0)
        return NULL;
    /* Entries are kept sorted by name (parse sorts them to find duplicates). */
    lm_st_entry key;
    memset(&key, 0, sizeof key);
    key.name = (char *)name;
    return bsearch(&key, st->entries, (size_t)st->n_entries, sizeof(lm_st_entry), cmp_entry_name);
}

const char *lm_st_meta(const lm_safetensors *st, const char *key) {
    if (!st || !key)
        return NULL;
    for (int i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta_keys[i], key) == 0)
            return st->meta_vals[i];
    return NULL;
}

static int64_t entry_numel(const lm_st_entry *e) {
    int64_t n = 1;
    for (int i = 0; i < e->ndim; i++)
        n *= e->shape[i];
    return n;
}

/* Element i of a float-typed entry as double (unaligned-safe). */
static double float_at(const lm_st_entry *e, int64_t i) {
    const uint8_t *p = (const uint8_t *)e->data;
    switch (e->dtype) {
    case LM_F32: {
        float v;
        memcpy(&v, p + 4 * i, 4);
        return v;
    }
    case LM_F64: {
        double v;
        memcpy(&v, p + 8 * i, 8);
        return v;
    }
    case LM_BF16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return lm_bf16_to_f32(h);
    }
    case LM_F16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return lm_f16_to_f32(h);
    }
    default:
        LM_CHECK(0 && "not a float dtype");
        return 0.0;
    }
}

static lm_status find_float(const lm_safetensors *st, const char *name, const lm_st_entry **e,
                            lm_error *err) {
    const char *f = st && st->path ? st->path : "(safetensors)";
    *e = lm_st_find(st, name);
    if (!*e)
        return lm_errorf(err, LM_ERR_INVALID, "%s: no tensor named '%s'", f, name ? name : "");
    lm_dtype dt = (*e)->dtype;
    if (dt != LM_F32 && dt != LM_F64 && dt != LM_BF16 && dt != LM_F16)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: tensor '%s': dtype %s is not a float type (F32, F64, BF16, F16)", f,
                         name, lm_dtype_name(dt));
    return LM_OK;
}

lm_status lm_st_to_f32(const lm_safetensors *st, const char *name, float **out, lm_error *err) {
    LM_CHECK(out != NULL);
    *out = NULL;
    const lm_st_entry *e;
    LM_TRY(find_float(st, name, &e, err));
    int64_t n = entry_numel(e);
    float *y = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (e->dtype == LM_F32) {
        if (n > 0)
            memcpy(y, e->data, (size_t)n * sizeof(float));
    } else {
        for (int64_t i = 0; i < n; i++)
            y[i] = (float)float_at(e, i);
    }
    *out = y;
    return LM_OK;
}

lm_status lm_st_to_f64(const lm_safetensors *st, const char *name, double **out, lm_error *err) {
    LM_CHECK(out != NULL);
    *out = NULL;
    const lm_st_entry *e;
    LM_TRY(find_float(st, name, &e, err));
    int64_t n = entry_numel(e);
    double *y = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++)
        y[i] = float_at(e, i);
    *out = y;
    return LM_OK;
}

lm_status lm_st_to_i64(const lm_safetensors *st, const char *name, int64_t **out, lm_error *err) {
    LM_CHECK(out != NULL);
    *out = NULL;
    const char *f = st && st->path ? st->path : "(safetensors)";
    const lm_st_entry *e = lm_st_find(st, name);
    if (!e)
        return lm_errorf(err, LM_ERR_INVALID, "%s: no tensor named '%s'", f, name ? name : "");
    if (e->dtype != LM_I32 && e->dtype != LM_I64 && e->dtype != LM_U8)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: tensor '%s': dtype %s is not an integer type (I32, I64, U8)", f, name,
                         lm_dtype_name(e->dtype));
    int64_t n = entry_numel(e);
    int64_t *y = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    const uint8_t *p = (const uint8_t *)e->data;
    for (int64_t i = 0; i < n; i++) {
        if (e->dtype == LM_I64) {
            memcpy(&y[i], p + 8 * i, 8);
        } else if (e->dtype == LM_I32) {
            int32_t v;
            memcpy(&v, p + 4 * i, 4);
            y[i] = v;
        } else {
            y[i] = p[i];
        }
    }
    *out = y;
    return LM_OK;
}

/* ---------------------------------------------------------------- writer */

void lm_st_writer_init(lm_st_writer *w) {
    LM_CHECK(w != NULL);
    memset(w, 0, sizeof *w);
}

void lm_st_writer_free(lm_st_writer *w) {
    if (!w)
        return;
    for (int i = 0; i < w->n; i++) {
        free(w->names[i]);
        free(w->datas[i]);
    }
    free(w->names);
    free(w->dtypes);
    free(w->ndims);
    free(w->shapes);
    free(w->datas);
    free(w->nbytes);
    for (int i = 0; i < w->n_meta; i++) {
        free(w->meta_keys[i]);
        free(w->meta_vals[i]);
    }
    free(w->meta_keys);
    free(w->meta_vals);
    memset(w, 0, sizeof *w);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "%s:%d: out of memory reallocating %zu bytes\n", __FILE__, __LINE__, n);
        abort();
    }
    return q;
}

lm_status lm_st_writer_add(lm_st_writer *w, const char *name, lm_dtype dt, int ndim,
                           const int64_t *shape, const void *data, lm_error *err) {
    LM_CHECK(w != NULL);
    if (!name || !*name)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: empty tensor name");
    if (strcmp(name, "__metadata__") == 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "safetensors writer: '__metadata__' is reserved, not a tensor name");
    if ((int)dt < 0 || dt >= LM_DTYPE_COUNT)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: tensor '%s': bad dtype %d", name,
                         (int)dt);
    if (ndim < 0 || ndim > LM_MAX_DIMS)
        return lm_errorf(err, LM_ERR_INVALID,
                         "safetensors writer: tensor '%s': ndim %d outside 0..%d", name, ndim,
                         LM_MAX_DIMS);
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->names[i], name) == 0)
            return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: tensor '%s' added twice",
                             name);
    uint64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return lm_errorf(err, LM_ERR_INVALID,
                             "safetensors writer: tensor '%s': shape[%d] = %lld is negative", name,
                             i, (long long)shape[i]);
        uint64_t d = (uint64_t)shape[i];
        if (d != 0 && numel > UINT64_MAX / d)
            return lm_errorf(err, LM_ERR_INVALID,
                             "safetensors writer: tensor '%s': element count overflows", name);
        numel *= d;
    }
    uint64_t esz = lm_dtype_size(dt);
    if (numel > (uint64_t)SIZE_MAX / esz)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: tensor '%s': size overflows",
                         name);
    size_t nb = (size_t)(numel * esz);
    if (nb > 0 && !data)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: tensor '%s': NULL data", name);
    void *copy = malloc(nb ? nb : 1);
    if (!copy)
        return lm_errorf(err, LM_ERR_NOMEM,
                         "safetensors writer: tensor '%s': cannot allocate %zu bytes", name, nb);
    if (nb)
        memcpy(copy, data, nb);
    if (w->n == w->cap) {
        int cap = w->cap ? 2 * w->cap : 16;
        w->names = xrealloc(w->names, (size_t)cap * sizeof *w->names);
        w->dtypes = xrealloc(w->dtypes, (size_t)cap * sizeof *w->dtypes);
        w->ndims = xrealloc(w->ndims, (size_t)cap * sizeof *w->ndims);
        w->shapes = xrealloc(w->shapes, (size_t)cap * sizeof *w->shapes);
        w->datas = xrealloc(w->datas, (size_t)cap * sizeof *w->datas);
        w->nbytes = xrealloc(w->nbytes, (size_t)cap * sizeof *w->nbytes);
        w->cap = cap;
    }
    int k = w->n++;
    w->names[k] = xstrdup(name);
    w->dtypes[k] = dt;
    w->ndims[k] = ndim;
    for (int i = 0; i < LM_MAX_DIMS; i++)
        w->shapes[k][i] = i < ndim ? shape[i] : 0;
    w->datas[k] = copy;
    w->nbytes[k] = nb;
    return LM_OK;
}

lm_status lm_st_writer_meta(lm_st_writer *w, const char *key, const char *val, lm_error *err) {
    LM_CHECK(w != NULL);
    if (!key || !val)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: NULL metadata key or value");
    for (int i = 0; i < w->n_meta; i++) {
        if (strcmp(w->meta_keys[i], key) == 0) { /* last value wins */
            free(w->meta_vals[i]);
            w->meta_vals[i] = xstrdup(val);
            return LM_OK;
        }
    }
    if (w->n_meta == w->cap_meta) {
        int cap = w->cap_meta ? 2 * w->cap_meta : 8;
        w->meta_keys = xrealloc(w->meta_keys, (size_t)cap * sizeof *w->meta_keys);
        w->meta_vals = xrealloc(w->meta_vals, (size_t)cap * sizeof *w->meta_vals);
        w->cap_meta = cap;
    }
    w->meta_keys[w->n_meta] = xstrdup(key);
    w->meta_vals[w->n_meta] = xstrdup(val);
    w->n_meta++;
    return LM_OK;
}

static cJSON *raw_u64(uint64_t v) {
    char s[32];
    snprintf(s, sizeof s, "%llu", (unsigned long long)v);
    return cJSON_CreateRaw(s);
}

/* The JSON header (unpadded), malloc'd. Integers are written as exact decimal text
 * (cJSON numbers are doubles). */
static char *build_header(const lm_st_writer *w) {
    cJSON *root = cJSON_CreateObject();
    LM_CHECK(root != NULL);
    /* every file linmoe writes carries a CRC-32C of each tensor (verified on read) */
    cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
    LM_CHECK(m != NULL);
    for (int i = 0; i < w->n_meta; i++)
        if (strcmp(w->meta_keys[i], ST_CRC_KEY) != 0)
            LM_CHECK(cJSON_AddStringToObject(m, w->meta_keys[i], w->meta_vals[i]) != NULL);
    if (w->n > 0) {
        cJSON *crc = cJSON_CreateObject();
        LM_CHECK(crc != NULL);
        for (int k = 0; k < w->n; k++) {
            char hex[16];
            snprintf(hex, sizeof hex, "%08x", (unsigned)lm_crc32c(0, w->datas[k], w->nbytes[k]));
            LM_CHECK(cJSON_AddStringToObject(crc, w->names[k], hex) != NULL);
        }
        char *text = cJSON_PrintUnformatted(crc);
        LM_CHECK(text != NULL);
        cJSON_Delete(crc);
        LM_CHECK(cJSON_AddStringToObject(m, ST_CRC_KEY, text) != NULL);
        free(text);
    }
    uint64_t off = 0;
    for (int k = 0; k < w->n; k++) {
        cJSON *e = cJSON_AddObjectToObject(root, w->names[k]);
        LM_CHECK(e != NULL);
        LM_CHECK(cJSON_AddStringToObject(e, "dtype", lm_dtype_name(w->dtypes[k])) != NULL);
        cJSON *sh = cJSON_AddArrayToObject(e, "shape");
        LM_CHECK(sh != NULL);
        for (int i = 0; i < w->ndims[k]; i++)
            cJSON_AddItemToArray(sh, raw_u64((uint64_t)w->shapes[k][i]));
        cJSON *of = cJSON_AddArrayToObject(e, "data_offsets");
        LM_CHECK(of != NULL);
        cJSON_AddItemToArray(of, raw_u64(off));
        cJSON_AddItemToArray(of, raw_u64(off + w->nbytes[k]));
        off += w->nbytes[k];
    }
    char *s = cJSON_PrintUnformatted(root);
    LM_CHECK(s != NULL);
    cJSON_Delete(root);
    return s;
}

static int write_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t r = write(fd, b, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

lm_status lm_st_writer_save(const lm_st_writer *w, const char *path, lm_error *err) {
    LM_CHECK(w != NULL);
    if (!path || !*path)
        return lm_errorf(err, LM_ERR_INVALID, "safetensors writer: empty path");
    char *json = build_header(w);
    size_t jl = strlen(json);
    /* Pad with spaces so the data section starts 8-byte aligned. */
    size_t hlen = (jl + 7) / 8 * 8;
    char *hdr = LM_MALLOC(8 + hlen);
    uint64_t h64 = hlen;
    for (int i = 0; i < 8; i++)
        hdr[i] = (char)(uint8_t)(h64 >> (8 * i));
    memcpy(hdr + 8, json, jl);
    memset(hdr + 8 + jl, ' ', hlen - jl);
    free(json);

    size_t tl = strlen(path) + 32;
    char *tmp = LM_MALLOC(tl);
    snprintf(tmp, tl, "%s.tmp.%ld", path, (long)getpid());
    lm_status s = LM_OK;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        s = lm_errorf(err, LM_ERR_IO, "%s: cannot create temporary file %s: %s", path, tmp,
                      strerror(errno));
        goto out;
    }
    int bad = write_all(fd, hdr, 8 + hlen);
    for (int k = 0; k < w->n && !bad; k++)
        if (w->nbytes[k])
            bad = write_all(fd, w->datas[k], w->nbytes[k]);
    if (bad) {
        s = lm_errorf(err, LM_ERR_IO, "%s: write to %s failed: %s", path, tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto out;
    }
    if (fsync(fd) != 0) {
        s = lm_errorf(err, LM_ERR_IO, "%s: fsync of %s failed: %s", path, tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto out;
    }
    if (close(fd) != 0) {
        s = lm_errorf(err, LM_ERR_IO, "%s: close of %s failed: %s", path, tmp, strerror(errno));
        unlink(tmp);
        goto out;
    }
    if (rename(tmp, path) != 0) {
        s = lm_errorf(err, LM_ERR_IO, "%s: rename from %s failed: %s", path, tmp, strerror(errno));
        unlink(tmp);
        goto out;
    }
    /* Make the rename itself durable (best effort: some filesystems refuse). */
    {
        size_t pl = strlen(path);
        char *dir = LM_MALLOC(pl + 2);
        memcpy(dir, path, pl + 1);
        char *slash = strrchr(dir, '/');
        if (!slash)
            strcpy(dir, ".");
        else if (slash == dir)
            dir[1] = '\0';
        else
            *slash = '\0';
        int dfd = open(dir, O_RDONLY | O_CLOEXEC);
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
        free(dir);
    }
out:
    free(tmp);
    free(hdr);
    return s;
}
