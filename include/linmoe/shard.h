/* linmoe token shards: the on-disk format `linmoe tokenize` writes and the training
 * loader reads.
 *
 * File layout (little-endian):
 *   offset 0   magic     8 bytes "LMTOKENS"
 *          8   version   uint32 (1)
 *         12   vocab     uint32 (vocab size of the tokenizer)
 *         16   width     uint32 (bytes per token: 2 when vocab <= 65536, else 4)
 *         20   reserved  uint32 (0)
 *         24   count     uint64 (number of tokens)
 *         32   tokens    count * width bytes (uint16 or uint32)
 * Documents are separated by the tokenizer's <|endoftext|> id (one after every
 * document, the last included). The header's count must match the file size exactly.
 *
 * Reading maps the whole file (read-only). Offsets and counts are 64-bit.
 *
 * Errors name the file and the field: bad magic, unknown version, width not 2/4 (or
 * 2 with vocab > 65536), reserved not 0, count disagreeing with the size (truncated
 * file), a token >= vocab (found by lm_shard_validate, which scans the tokens).
 *
 * Writing checks every token against vocab first (LM_ERR_INVALID naming the index
 * and value; nothing is written), then writes PATH.tmp.PID, fsyncs it, renames it
 * over PATH and fsyncs the directory: PATH is either the old file or the whole new
 * one. Written by src/data/shard.c; `linmoe tokenize` (tools/tokenize.c) makes them.
 */
#ifndef LINMOE_SHARD_H
#define LINMOE_SHARD_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_SHARD_MAGIC "LMTOKENS"
#define LM_SHARD_VERSION 1
#define LM_SHARD_HEADER_BYTES 32

typedef struct {
    char *path;
    uint32_t vocab, width;
    uint64_t count;
    const uint8_t *tokens; /* mapped token data */
    void *map;
    size_t map_size;
} lm_shard;

/* Map and check the header. On error `s` is left empty (safe to lm_shard_close). */
lm_status lm_shard_open(lm_shard *s, const char *path, lm_error *err);
void lm_shard_close(lm_shard *s);
/* Token i (0 <= i < count). */
static inline int32_t lm_shard_get(const lm_shard *s, uint64_t i) {
    if (s->width == 2) {
        const uint8_t *p = s->tokens + 2 * i;
        return (int32_t)(p[0] | (p[1] << 8));
    }
    const uint8_t *p = s->tokens + 4 * i;
    return (int32_t)((uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                     ((uint32_t)p[3] << 24));
}
/* Every token < vocab (error names the index and value). */
lm_status lm_shard_validate(const lm_shard *s, lm_error *err);

/* Write `n` tokens atomically (temp name, fsync, rename). */
lm_status lm_shard_write(const char *path, uint32_t vocab, const int32_t *tokens, uint64_t n,
                         lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
