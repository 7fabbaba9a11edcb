/* linmoe safetensors I/O: read a whole .safetensors file (8-byte little-endian
 * header length, JSON header, data), validating everything before any tensor
 * byte is touched; write one atomically (temp name, fsync, rename).
 *
 * Validation on read (each failure is LM_ERR_FORMAT with a message naming the
 * file, the tensor and the bad field/value): header length past end of file or
 * absurdly large; JSON that does not parse or is not an object; an entry that is
 * not {"dtype","shape","data_offsets"}; unknown dtype; negative or non-integer
 * shape dims; offsets not a pair of non-negative integers with begin <= end;
 * offsets past the data section; shape x dtype size != end - begin (with 64-bit
 * overflow checks); duplicate names; byte ranges that do not tile the data section
 * exactly (sorted by offsets each tensor begins where the previous one ends, the first
 * at 0, the last at the end of the file: gaps, overlaps and trailing bytes are refused,
 * as by the reference implementation's Metadata::validate).
 * `__metadata__` must be an object of string -> string.
 *
 * Checksums: every file lm_st_writer_save writes has `__metadata__["linmoe.crc32c"]`,
 * a JSON object text {"tensor name": "8 hex digits", ...} of each tensor's CRC-32C
 * (lm_crc32c). On read, when present, every tensor must have one and match (else
 * LM_ERR_FORMAT naming the tensor: the file is corrupt); the key is then removed from
 * the metadata the caller sees and n_checksums is set. lm_st_read says so on stderr
 * (one line) when a file with tensors has no checksums (files from other writers).
 *
 * Supported dtypes: F32, F64, BF16, F16, I32, I64, U8.
 * What this module does not do: memory mapping, lazy loading, endianness other
 * than little-endian hosts.
 */
#ifndef LINMOE_SAFETENSORS_H
#define LINMOE_SAFETENSORS_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    char *name;               /* owned */
    lm_dtype dtype;
    int ndim;                 /* 0..LM_MAX_DIMS */
    int64_t shape[LM_MAX_DIMS];
    uint64_t begin, end;      /* byte offsets into the data section */
    const void *data;         /* points into the file buffer (data section + begin) */
} lm_st_entry;

typedef struct {
    char *path;               /* owned copy, used in error messages */
    uint8_t *buf;             /* whole file */
    size_t size;
    lm_st_entry *entries;     /* sorted by name (lm_st_find is a binary search) */
    int n_entries;
    char **meta_keys, **meta_vals; /* __metadata__, owned */
    int n_meta;
    int n_checksums;          /* tensors verified by their stored CRC-32C (all, or 0) */
} lm_safetensors;

/* CRC-32C (Castagnoli; RFC 3720 B.4) of n bytes, continuing from `crc` (0 to start):
 * lm_crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t lm_crc32c(uint32_t crc, const void *data, size_t n);

/* Read and validate `path`. On error `out` is left empty (safe to lm_st_free). */
lm_status lm_st_read(const char *path, lm_safetensors *out, lm_error *err);
/* Same, from a memory buffer (copied); `label` names it in messages. */
lm_status lm_st_parse(const void *bytes, size_t size, const char *label, lm_safetensors *out,
                      lm_error *err);
void lm_st_free(lm_safetensors *st);

/* NULL when absent. */
const lm_st_entry *lm_st_find(const lm_safetensors *st, const char *name);
/* NULL when absent. */
const char *lm_st_meta(const lm_safetensors *st, const char *key);

/* Copy tensor `name`, converting from any float dtype (F32/F64/BF16/F16) to a
 * newly malloc'd contiguous fp32 / fp64 array (caller frees). Integer tensors are
 * rejected with LM_ERR_INVALID. Non-finite values are copied as they are. */
lm_status lm_st_to_f32(const lm_safetensors *st, const char *name, float **out, lm_error *err);
lm_status lm_st_to_f64(const lm_safetensors *st, const char *name, double **out, lm_error *err);
/* Integer tensor (I32/I64/U8) to a new int64 array. */
lm_status lm_st_to_i64(const lm_safetensors *st, const char *name, int64_t **out, lm_error *err);

/* ---------------------------------------------------------------- writer */

typedef struct {
    int n, cap;
    char **names;
    lm_dtype *dtypes;
    int *ndims;
    int64_t (*shapes)[LM_MAX_DIMS];
    void **datas;             /* owned copies */
    size_t *nbytes;
    int n_meta, cap_meta;
    char **meta_keys, **meta_vals;
} lm_st_writer;

void lm_st_writer_init(lm_st_writer *w);
/* Copies `data` (numel(shape) * dtype size bytes). */
lm_status lm_st_writer_add(lm_st_writer *w, const char *name, lm_dtype dt, int ndim,
                           const int64_t *shape, const void *data, lm_error *err);
lm_status lm_st_writer_meta(lm_st_writer *w, const char *key, const char *val, lm_error *err);
/* Writes to "<path>.tmp.<pid>", fsyncs, renames over `path`: an existing good
 * file is never left half-written. */
lm_status lm_st_writer_save(const lm_st_writer *w, const char *path, lm_error *err);
void lm_st_writer_free(lm_st_writer *w);

#ifdef __cplusplus
}
#endif
#endif
