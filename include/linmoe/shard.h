/* linmoe token shards: the on-disk format `linmoe tokenize` writes and the training
 * loader reads, and the manifest that joins many shards into one stream.
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
 * Manifest (a JSON object, written by `linmoe tokenize --out-dir`; docs/data.md has
 * an example): a list of shards read as ONE stream, the shards' tokens concatenated
 * in the listed order. The reader needs
 *   "format": "linmoe-shards", "version": 1,
 *   "vocab": V                 every shard's vocab,
 *   "tokens": N                the sum of the shards' counts,
 *   "shards": [{"path": P, "tokens": n}, ...]   P relative to the manifest's
 *                              directory (or absolute); n = that shard's count
 * and ignores every other key (the writer adds the split, the tokenizer, document /
 * byte counts and the source files of each shard). A shard may end inside a
 * document (tokenize cuts one only when a document alone exceeds the shard size),
 * so the shards of a manifest are meant to be read together, not one by one.
 *
 * Reading: lm_shard_open takes a shard file or a manifest (a file whose first
 * non-blank byte is '{'). A shard file is mapped read-only; a manifest's shards are
 * copied into one private read-only anonymous mapping (count * width bytes), so
 * lm_shard_get and every reader of lm_shard see the concatenation unchanged.
 * Offsets and counts are 64-bit.
 *
 * Errors name the file and the field: bad magic, unknown version, width not 2/4 (or
 * 2 with vocab > 65536), reserved not 0, count disagreeing with the size (truncated
 * file), a token >= vocab (found by lm_shard_validate, which scans the tokens); for a
 * manifest: not JSON, a missing / mistyped key, a wrong format or version, a shard
 * that is itself a manifest, a shard whose vocab or count differs from the entry,
 * counts that do not add up to "tokens".
 *
 * Writing checks every token against vocab first (LM_ERR_INVALID naming the index
 * and value; nothing is written), then writes PATH.tmp.PID, fsyncs it, renames it
 * over PATH and fsyncs the directory: PATH is either the old file or the whole new
 * one. Written by src/data/shard.c; `linmoe tokenize` (tools/tokenize.c) makes them.
 *
 * Held-out split by source (lm_shard_split_hash): `linmoe tokenize --val-fraction F`
 * puts a source (a file, or a JSONL record) in the validation split when
 * (h >> 11) * 2^-53 < F, h = lm_shard_split_hash(seed, key) of its key (its path),
 * so the split of a source depends only on the seed and its own name, not on the
 * other sources or the thread count; scripts/fetch-data.sh computes the same rule
 * (docs/data.md gives it in Python).
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
#define LM_MANIFEST_FORMAT "linmoe-shards"
#define LM_MANIFEST_VERSION 1

typedef struct {
    char *path; /* the shard file or the manifest */
    uint32_t vocab, width;
    uint64_t count;        /* tokens (of all shards, for a manifest) */
    const uint8_t *tokens; /* mapped token data: count * width bytes */
    void *map;             /* the mapping that lm_shard_close unmaps */
    size_t map_size;
    uint32_t parts; /* shard files behind it: 1, or a manifest's shard count */
} lm_shard;

/* Open a shard file (map it, check the header) or a manifest (open each shard, check
 * it against its entry, copy the tokens into one mapping; see the top comment). On
 * error `s` is left empty (safe to lm_shard_close). */
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

/* The split hash of a source key (`len` bytes, e.g. a path relative to its input
 * directory): FNV-1a 64 of the key bytes (offset basis 0xcbf29ce484222325, prime
 * 0x100000001b3; Fowler, Noll, Vo), then h = mix(fnv ^ mix(seed)) with mix the
 * splitmix64 finaliser (add 0x9E3779B97F4A7C15, then xor-shift-multiply by
 * 0xBF58476D1CE4E5B9 and 0x94D049BB133111EB, shifts 30, 27, 31; Steele et al. 2014).
 * A pure function of (seed, key bytes). */
uint64_t lm_shard_split_hash(uint64_t seed, const void *key, size_t len);
/* 1 when a source of split hash h belongs to a held-out fraction f of the sources:
 * (h >> 11) * 2^-53 < f (exact in double arithmetic). f <= 0 gives 0, f >= 1 gives 1. */
int lm_shard_split_is_val(uint64_t h, double f);

#ifdef __cplusplus
}
#endif
#endif
