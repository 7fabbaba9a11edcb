/* Dtypes and non-owning strided tensor views. */
#include "linmoe/core.h"

#include <string.h>
#include <stdint.h>

static const struct {
    const char *name;
    size_t size;
} dtype_info[LM_DTYPE_COUNT] = {
    [LM_F32] = {"F32", 4}, [LM_F64] = {"F64", 8}, [LM_BF16] = {"BF16", 2}, [LM_F16] = {"F16", 2},
    [LM_I32] = {"I32", 4}, [LM_I64] = {"I64", 8}, [LM_U8] = {"U8", 1},
};

size_t lm_dtype_size(lm_dtype dt) {
    LM_CHECK((int)dt >= 0 && dt < LM_DTYPE_COUNT);
    return dtype_info[dt].size;
}

const char *lm_dtype_name(lm_dtype dt) {
    if ((int)dt < 0 || dt >= LM_DTYPE_COUNT)
        return "?";
    return dtype_info[dt].name;
}

int lm_dtype_from_name(const char *name, lm_dtype *out) {
    if (!name)
        return -1;
    for (int i = 0; i < LM_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_info[i].name) == 0) {
            if (out)
                *out = (lm_dtype)i;
            return 0;
        }
    }
    return -1;
}

lm_tensor lm_tensor_make(void *data, lm_dtype dt, int ndim, const int64_t *shape) {
    LM_CHECK(ndim >= 0 && ndim <= LM_MAX_DIMS);
    LM_CHECK(ndim == 0 || shape != NULL);
    lm_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.ndim = ndim;
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        LM_CHECK(shape[i] >= 0);
        t.shape[i] = shape[i];
        t.stride[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
    t.device = (lm_device){LM_DEVICE_CPU, 0};
    return t;
}

lm_tensor lm_tensor_make_on(void *data, lm_dtype dt, int ndim, const int64_t *shape,
                            lm_device device) {
    lm_tensor t = lm_tensor_make(data, dt, ndim, shape);
    t.device = device;
    return t;
}

int64_t lm_tensor_numel(const lm_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

/* Row-major contiguous; dims of extent 1 may carry any stride (they are never
 * stepped over), and an empty tensor is trivially contiguous. */
int lm_tensor_is_contiguous(const lm_tensor *t) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] == 0)
            return 1;
        if (t->shape[i] != 1 && t->stride[i] != expect)
            return 0;
        expect *= t->shape[i];
    }
    return 1;
}

int64_t lm_tensor_offset(const lm_tensor *t, const int64_t *idx) {
    int64_t off = 0;
    for (int i = 0; i < t->ndim; i++)
        off += idx[i] * t->stride[i];
    return off;
}

/* 1 when any of the n floats at x has an all-ones exponent (NaN or Inf) */
static int block_has_nonfinite(const float *x, int64_t n) {
    uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
}

int64_t lm_f32_first_nonfinite(const float *x, int64_t n) {
    if (!x || n <= 0)
        return -1;
    enum { BLK = 8192 };
    /* serial: an OpenMP region here would allocate inside the training step (test_mem_plan)
     * and the scan is bound by memory bandwidth anyway */
    const int64_t nb = (n + BLK - 1) / BLK;
    int64_t first_blk = INT64_MAX;
    for (int64_t b = 0; b < nb && first_blk == INT64_MAX; b++) {
        const int64_t i0 = b * BLK, len = n - i0 < BLK ? n - i0 : BLK;
        if (block_has_nonfinite(x + i0, len))
            first_blk = b;
    }
    if (first_blk == INT64_MAX)
        return -1;
    for (int64_t i = first_blk * BLK; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        if ((u & 0x7f800000u) == 0x7f800000u)
            return i;
    }
    return -1;
}
