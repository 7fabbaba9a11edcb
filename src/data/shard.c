/* linmoe token shards (shard.h): mapped read with header checks, atomic write,
 * manifests of many shards read as one stream, the held-out split hash.
 *
 * Every size read from the file is checked before use: the header must be complete,
 * and count * width + 32 must equal the file size exactly (compared as
 * count <= (size - 32) / width first, so a huge count cannot overflow). A manifest's
 * counts are checked against each shard's header and their sum against "tokens"
 * (with an overflow check) before anything is copied.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS (POSIX.1-2024; Linux and the BSDs have it) */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "linmoe/shard.h"

static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }

static void wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void wr64(uint8_t *p, uint64_t v) {
    wr32(p, (uint32_t)v);
    wr32(p + 4, (uint32_t)(v >> 32));
}

void lm_shard_close(lm_shard *s) {
    if (!s)
        return;
    if (s->map)
        munmap(s->map, s->map_size);
    free(s->path);
    memset(s, 0, sizeof *s);
}

static lm_status open_manifest(lm_shard *s, const char *path, int fd, uint64_t size, lm_error *err);

/* A shard file, or (allow_manifest) a manifest: one whose first non-blank byte is '{'. */
static lm_status open_any(lm_shard *s, const char *path, int allow_manifest, lm_error *err) {
    memset(s, 0, sizeof *s);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return lm_errorf(err, LM_ERR_IO, "cannot open shard %s: %s", path, strerror(errno));
    struct stat stt;
    if (fstat(fd, &stt) != 0) {
        int e = errno;
        close(fd);
        return lm_errorf(err, LM_ERR_IO, "cannot stat shard %s: %s", path, strerror(e));
    }
    if (!S_ISREG(stt.st_mode)) {
        close(fd);
        return lm_errorf(err, LM_ERR_IO, "shard %s: not a regular file", path);
    }
    uint64_t size = (uint64_t)stt.st_size;
    {
        uint8_t head[256];
        ssize_t got = pread(fd, head, sizeof head, 0);
        ssize_t i = 0;
        while (i < got && (head[i] == ' ' || head[i] == '\t' || head[i] == '\r' || head[i] == '\n'))
            i++;
        if (i < got && head[i] == '{') {
            if (!allow_manifest) {
                close(fd);
                return lm_errorf(err, LM_ERR_FORMAT,
                                 "%s is a manifest (JSON); a manifest's shards must be token "
                                 "shard files, not manifests",
                                 path);
            }
            lm_status st = open_manifest(s, path, fd, size, err);
            close(fd);
            return st;
        }
    }
    if (size < LM_SHARD_HEADER_BYTES) {
        close(fd);
        return lm_errorf(err, LM_ERR_FORMAT,
                         "shard %s: truncated header: the file has %llu bytes, the header needs %d",
                         path, (unsigned long long)size, LM_SHARD_HEADER_BYTES);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return lm_errorf(err, LM_ERR_IO, "cannot map shard %s (%llu bytes): %s", path,
                         (unsigned long long)size, strerror(map_errno));
    const uint8_t *h = map;
    lm_status st = LM_OK;
    uint32_t version = rd32(h + 8), vocab = rd32(h + 12), width = rd32(h + 16),
             reserved = rd32(h + 20);
    uint64_t count = rd64(h + 24);
    if (memcmp(h, LM_SHARD_MAGIC, 8) != 0) {
        char shown[33];
        for (int i = 0; i < 8; i++)
            snprintf(shown + 4 * i, 5, "\\x%02x", h[i]);
        st = lm_errorf(err, LM_ERR_FORMAT,
                       "shard %s: bad magic \"%s\" (want \"%s\"): not a token shard (nor a "
                       "manifest, which starts with '{')",
                       path, shown, LM_SHARD_MAGIC);
    } else if (version != LM_SHARD_VERSION) {
        st = lm_errorf(err, LM_ERR_FORMAT, "shard %s: unknown version %u (this build reads %d)",
                       path, version, LM_SHARD_VERSION);
    } else if (vocab == 0 || vocab > (uint32_t)INT32_MAX) {
        st = lm_errorf(err, LM_ERR_FORMAT, "shard %s: vocab %u is out of range [1, %d]", path,
                       vocab, INT32_MAX);
    } else if (width != 2 && width != 4) {
        st =
            lm_errorf(err, LM_ERR_FORMAT, "shard %s: token width %u (must be 2 or 4)", path, width);
    } else if (width == 2 && vocab > 65536) {
        st = lm_errorf(err, LM_ERR_FORMAT,
                       "shard %s: token width 2 cannot hold vocab %u (needs width 4)", path, vocab);
    } else if (reserved != 0) {
        st = lm_errorf(err, LM_ERR_FORMAT, "shard %s: reserved field is %u (must be 0)", path,
                       reserved);
    } else if (count > (size - LM_SHARD_HEADER_BYTES) / width ||
               count * width != size - LM_SHARD_HEADER_BYTES) {
        st = lm_errorf(err, LM_ERR_FORMAT,
                       "shard %s: count %llu tokens of width %u needs %llu bytes after the header, "
                       "the file has %llu (truncated or corrupt)",
                       path, (unsigned long long)count, width,
                       count > (size - LM_SHARD_HEADER_BYTES) / width
                           ? (unsigned long long)UINT64_MAX
                           : (unsigned long long)(count * width),
                       (unsigned long long)(size - LM_SHARD_HEADER_BYTES));
    }
    if (st != LM_OK) {
        munmap(map, (size_t)size);
        return st;
    }
    s->path = strdup(path);
    if (!s->path) {
        munmap(map, (size_t)size);
        return lm_errorf(err, LM_ERR_NOMEM, "shard %s: out of memory", path);
    }
    s->vocab = vocab;
    s->width = width;
    s->count = count;
    s->map = map;
    s->map_size = (size_t)size;
    s->tokens = h + LM_SHARD_HEADER_BYTES;
    s->parts = 1;
    return LM_OK;
}

lm_status lm_shard_open(lm_shard *s, const char *path, lm_error *err) {
    return open_any(s, path, 1, err);
}

/* ---------------------------------------------------------------- manifests */

/* A non-negative integer member `key` of `o` (exact in a double: < 2^53). */
static lm_status man_u64(const cJSON *o, const char *key, const char *path, const char *where,
                         uint64_t *out, lm_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v)
        return lm_errorf(err, LM_ERR_FORMAT, "manifest %s: %s has no key '%s'", path, where, key);
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || !(d >= 0) || d > 9007199254740992.0 || d != (double)(uint64_t)d)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "manifest %s: %s key '%s' is not a non-negative integer below 2^53", path,
                         where, key);
    *out = (uint64_t)d;
    return LM_OK;
}

/* The manifest's directory joined with a relative shard path (absolute paths as-is). */
static char *man_join(const char *manifest, const char *rel) {
    size_t rn = strlen(rel);
    const char *slash = strrchr(manifest, '/');
    size_t dn = rel[0] == '/' || !slash ? 0 : (size_t)(slash - manifest) + 1;
    char *p = malloc(dn + rn + 1);
    if (!p)
        return NULL;
    memcpy(p, manifest, dn);
    memcpy(p + dn, rel, rn + 1);
    return p;
}

static lm_status open_manifest(lm_shard *s, const char *path, int fd, uint64_t size,
                               lm_error *err) {
    if (size > ((uint64_t)1 << 30))
        return lm_errorf(err, LM_ERR_FORMAT,
                         "manifest %s: %llu bytes (a manifest is JSON of at most 1 GiB)", path,
                         (unsigned long long)size);
    char *text = malloc((size_t)size + 1);
    if (!text)
        return lm_errorf(err, LM_ERR_NOMEM, "manifest %s: out of memory", path);
    size_t got = 0;
    while (got < size) {
        ssize_t r = pread(fd, text + got, (size_t)(size - got), (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            lm_status st = lm_errorf(err, LM_ERR_IO, "cannot read manifest %s: %s", path,
                                     r < 0 ? strerror(errno) : "short read");
            free(text);
            return st;
        }
        got += (size_t)r;
    }
    text[size] = '\0';
    cJSON *root = cJSON_ParseWithLength(text, (size_t)size);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at && at >= text && at <= text + size ? (long)(at - text) : -1;
        free(text);
        return lm_errorf(err, LM_ERR_FORMAT, "manifest %s: not valid JSON (near byte %ld)", path,
                         off);
    }
    free(text);
    lm_status st = LM_OK;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *shards = cJSON_GetObjectItemCaseSensitive(root, "shards");
    uint64_t version = 0, vocab = 0, total = 0, n_shards = 0;
    uint8_t *buf = NULL;
    size_t buf_size = 0;
    if (!cJSON_IsObject(root))
        st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: not a JSON object", path);
    else if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, LM_MANIFEST_FORMAT) != 0)
        st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: key 'format' is not \"%s\"", path,
                       LM_MANIFEST_FORMAT);
    else if ((st = man_u64(root, "version", path, "the top level", &version, err)) != LM_OK)
        ;
    else if (version != LM_MANIFEST_VERSION)
        st =
            lm_errorf(err, LM_ERR_FORMAT, "manifest %s: unknown version %llu (this build reads %d)",
                      path, (unsigned long long)version, LM_MANIFEST_VERSION);
    else if ((st = man_u64(root, "vocab", path, "the top level", &vocab, err)) != LM_OK)
        ;
    else if (vocab == 0 || vocab > (uint64_t)INT32_MAX)
        st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: vocab %llu is out of range [1, %d]", path,
                       (unsigned long long)vocab, INT32_MAX);
    else if ((st = man_u64(root, "tokens", path, "the top level", &total, err)) != LM_OK)
        ;
    else if (!cJSON_IsArray(shards))
        st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: key 'shards' is not an array", path);
    if (st != LM_OK) {
        cJSON_Delete(root);
        return st;
    }
    const uint32_t width = vocab <= 65536 ? 2 : 4;
    /* pass 1: every entry well-formed, counts add up */
    uint64_t sum = 0;
    char where[64];
    const cJSON *e;
    cJSON_ArrayForEach(e, shards) {
        snprintf(where, sizeof where, "shards[%llu]", (unsigned long long)n_shards);
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(e, "path");
        uint64_t n = 0;
        if (!cJSON_IsObject(e))
            st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: %s is not an object", path, where);
        else if (!cJSON_IsString(p) || !p->valuestring[0])
            st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: %s has no string key 'path'", path,
                           where);
        else if ((st = man_u64(e, "tokens", path, where, &n, err)) != LM_OK)
            ;
        else if (n > UINT64_MAX - sum)
            st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: the shards' tokens overflow", path);
        if (st != LM_OK)
            break;
        sum += n;
        n_shards++;
    }
    if (st == LM_OK && sum != total)
        st = lm_errorf(err, LM_ERR_FORMAT,
                       "manifest %s: 'tokens' is %llu but the shards' counts add up to %llu", path,
                       (unsigned long long)total, (unsigned long long)sum);
    if (st == LM_OK && n_shards > UINT32_MAX)
        st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: %llu shards (at most %u)", path,
                       (unsigned long long)n_shards, UINT32_MAX);
    if (st == LM_OK && total > (uint64_t)(SIZE_MAX / 2) / width)
        st = lm_errorf(err, LM_ERR_FORMAT, "manifest %s: %llu tokens do not fit in memory", path,
                       (unsigned long long)total);
    if (st == LM_OK) {
        buf_size = total ? (size_t)(total * width) : 1;
        void *m = mmap(NULL, buf_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            st = lm_errorf(err, LM_ERR_NOMEM,
                           "manifest %s: cannot map %zu bytes for %llu tokens: %s", path, buf_size,
                           (unsigned long long)total, strerror(errno));
        else
            buf = m;
    }
    /* pass 2: open each shard, check it against its entry, copy its tokens */
    uint64_t off = 0, k = 0;
    if (st == LM_OK) {
        cJSON_ArrayForEach(e, shards) {
            const char *rel = cJSON_GetObjectItemCaseSensitive(e, "path")->valuestring;
            uint64_t n = 0;
            (void)man_u64(e, "tokens", path, "", &n, err);
            char *sp = man_join(path, rel);
            if (!sp) {
                st = lm_errorf(err, LM_ERR_NOMEM, "manifest %s: out of memory", path);
                break;
            }
            lm_shard part;
            lm_error perr = {0};
            st = open_any(&part, sp, 0, &perr);
            if (st != LM_OK)
                lm_errorf(err, st, "manifest %s: shards[%llu]: %s", path, (unsigned long long)k,
                          perr.msg);
            else if (part.vocab != vocab)
                st = lm_errorf(err, LM_ERR_FORMAT,
                               "manifest %s: shards[%llu] (%s) has vocab %u, the manifest %llu",
                               path, (unsigned long long)k, sp, part.vocab,
                               (unsigned long long)vocab);
            else if (part.count != n)
                st = lm_errorf(err, LM_ERR_FORMAT,
                               "manifest %s: shards[%llu] (%s) holds %llu tokens, the manifest "
                               "says %llu",
                               path, (unsigned long long)k, sp, (unsigned long long)part.count,
                               (unsigned long long)n);
            else if (n)
                memcpy(buf + off * width, part.tokens, (size_t)(n * width));
            lm_shard_close(&part);
            free(sp);
            if (st != LM_OK)
                break;
            off += n;
            k++;
        }
    }
    cJSON_Delete(root);
    if (st == LM_OK && mprotect(buf, buf_size, PROT_READ) != 0)
        st = lm_errorf(err, LM_ERR_IO, "manifest %s: mprotect: %s", path, strerror(errno));
    if (st == LM_OK && !(s->path = strdup(path)))
        st = lm_errorf(err, LM_ERR_NOMEM, "manifest %s: out of memory", path);
    if (st != LM_OK) {
        if (buf)
            munmap(buf, buf_size);
        memset(s, 0, sizeof *s);
        return st;
    }
    s->vocab = (uint32_t)vocab;
    s->width = width;
    s->count = total;
    s->map = buf;
    s->map_size = buf_size;
    s->tokens = buf;
    s->parts = (uint32_t)n_shards;
    return LM_OK;
}

/* ---------------------------------------------------------------- split hash */

static uint64_t split_mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

uint64_t lm_shard_split_hash(uint64_t seed, const void *key, size_t len) {
    const uint8_t *p = key;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return split_mix(h ^ split_mix(seed));
}

int lm_shard_split_is_val(uint64_t h, double f) { return (double)(h >> 11) * 0x1p-53 < f; }

lm_status lm_shard_validate(const lm_shard *s, lm_error *err) {
    for (uint64_t i = 0; i < s->count; i++) {
        int32_t v = lm_shard_get(s, i);
        if (v < 0 || (uint32_t)v >= s->vocab)
            return lm_errorf(err, LM_ERR_FORMAT,
                             "shard %s: token %llu is %lld, outside the vocab [0, %u)",
                             s->path ? s->path : "(unnamed)", (unsigned long long)i,
                             (long long)(uint32_t)v, s->vocab);
    }
    return LM_OK;
}

/* write(2) all of buf, retrying short writes and EINTR. */
static int write_all(int fd, const uint8_t *buf, size_t n) {
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

lm_status lm_shard_write(const char *path, uint32_t vocab, const int32_t *tokens, uint64_t n,
                         lm_error *err) {
    if (vocab == 0 || vocab > (uint32_t)INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID, "shard %s: vocab %u is out of range [1, %d]", path,
                         vocab, INT32_MAX);
    if (n && !tokens)
        return lm_errorf(err, LM_ERR_INVALID, "shard %s: tokens is NULL with count %llu", path,
                         (unsigned long long)n);
    for (uint64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= vocab)
            return lm_errorf(
                err, LM_ERR_INVALID,
                "shard %s: token %llu is %d, outside the vocab [0, %u); nothing written", path,
                (unsigned long long)i, tokens[i], vocab);
    uint32_t width = vocab <= 65536 ? 2 : 4;
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 32);
    if (!tmp)
        return lm_errorf(err, LM_ERR_NOMEM, "shard %s: out of memory", path);
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        lm_status st = lm_errorf(err, LM_ERR_IO, "cannot create %s (for shard %s): %s", tmp, path,
                                 strerror(errno));
        free(tmp);
        return st;
    }
    uint8_t hdr[LM_SHARD_HEADER_BYTES] = {0};
    memcpy(hdr, LM_SHARD_MAGIC, 8);
    wr32(hdr + 8, LM_SHARD_VERSION);
    wr32(hdr + 12, vocab);
    wr32(hdr + 16, width);
    wr32(hdr + 20, 0);
    wr64(hdr + 24, n);
    enum { CHUNK = 1 << 16 };
    uint8_t *buf = malloc((size_t)CHUNK * width);
    if (!buf) {
        close(fd);
        unlink(tmp);
        free(tmp);
        return lm_errorf(err, LM_ERR_NOMEM, "shard %s: out of memory", path);
    }
    int bad = write_all(fd, hdr, sizeof hdr) != 0;
    for (uint64_t i = 0; i < n && !bad; i += CHUNK) {
        uint64_t k = n - i < CHUNK ? n - i : CHUNK;
        for (uint64_t j = 0; j < k; j++) {
            uint32_t v = (uint32_t)tokens[i + j];
            if (width == 2) {
                buf[2 * j] = (uint8_t)v;
                buf[2 * j + 1] = (uint8_t)(v >> 8);
            } else {
                wr32(buf + 4 * j, v);
            }
        }
        bad = write_all(fd, buf, (size_t)k * width) != 0;
    }
    int e = errno;
    if (!bad && fsync(fd) != 0)
        bad = 1, e = errno;
    if (close(fd) != 0 && !bad)
        bad = 1, e = errno;
    free(buf);
    if (bad) {
        unlink(tmp);
        free(tmp);
        return lm_errorf(err, LM_ERR_IO, "cannot write shard %s: %s", path, strerror(e));
    }
    if (rename(tmp, path) != 0) {
        e = errno;
        unlink(tmp);
        free(tmp);
        return lm_errorf(err, LM_ERR_IO, "cannot rename %s.tmp.* to %s: %s", path, path,
                         strerror(e));
    }
    free(tmp);
    /* make the rename durable: fsync the directory (best effort) */
    char *dir = strdup(path);
    if (dir) {
        char *slash = strrchr(dir, '/');
        const char *d = slash ? (slash == dir ? "/" : (*slash = '\0', dir)) : ".";
        int dfd = open(d, O_RDONLY);
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
        free(dir);
    }
    return LM_OK;
}
