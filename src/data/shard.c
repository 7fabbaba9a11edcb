/* linmoe token shards (shard.h): mapped read with header checks, atomic write.
 *
 * Every size read from the file is checked before use: the header must be complete,
 * and count * width + 32 must equal the file size exactly (compared as
 * count <= (size - 32) / width first, so a huge count cannot overflow).
 */
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

lm_status lm_shard_open(lm_shard *s, const char *path, lm_error *err) {
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
                       "shard %s: bad magic \"%s\" (want \"%s\"): not a token shard", path, shown,
                       LM_SHARD_MAGIC);
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
    return LM_OK;
}

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
