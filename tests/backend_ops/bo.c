/* Shared helpers of test_backend_ops (bo.h). */
#include "bo.h"

#include <stdlib.h>
#include <string.h>

double bo_rel_rms(const float *out, const float *ref, int64_t n) {
    double num = 0, den = 0, maxd = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(out[i]))
            return INFINITY;
        const double d = (double)out[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
        if (fabs(d) > maxd)
            maxd = fabs(d);
    }
    if (maxd <= 1e-6)
        return 0.0;
    return den > 0 ? sqrt(num / den) : INFINITY;
}

int bo_check(bo_ctx *c, const char *op, const char *dtype, const char *shape, const char *tensor,
             const float *out, const float *ref, int64_t n, double tol) {
    const double e = bo_rel_rms(out, ref, n);
    const int bad = !(e <= tol);
    printf("| %-14s | %-5s | %-34s | %-10s | %9.2e | %6.0e | %s |\n", op, dtype, shape, tensor, e,
           tol, bad ? "FAIL" : "ok");
    fflush(stdout);
    c->rows++;
    c->failed += bad;
    return bad;
}

int bo_fail(bo_ctx *c, const char *op, const char *shape, const lm_error *e) {
    printf("| %-14s | %-5s | %-34s | %-10s | %9s | %6s | FAIL: %s |\n", op, "-", shape, "-", "-",
           "-", e ? e->msg : "(no message)");
    fflush(stdout);
    c->rows++;
    c->failed++;
    return 1;
}

void bo_fill_normal(bo_ctx *c, float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(s * lm_rng_normal(&c->rng));
}

void bo_fill_uniform(bo_ctx *c, float *x, int64_t n, float lo, float hi) {
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(lo + (hi - lo) * lm_rng_uniform(&c->rng));
}

void bo_round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = lm_bf16_round(x[i]);
}

void *bo_upload_bytes(bo_ctx *c, const void *x, size_t bytes, lm_error *e) {
    void *d = NULL;
    if (lm_cuda_ctx_alloc(c->cuda, &d, bytes, e) != LM_OK)
        return NULL;
    if (lm_cuda_ctx_upload(c->cuda, d, x, bytes, e) != LM_OK) {
        lm_cuda_ctx_free_mem(c->cuda, d);
        return NULL;
    }
    return d;
}

void *bo_upload_bf16(bo_ctx *c, const float *x, int64_t n, lm_error *e) {
    uint16_t *h = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof *h);
    for (int64_t i = 0; i < n; i++)
        h[i] = lm_f32_to_bf16(x[i]);
    void *d = bo_upload_bytes(c, h, (size_t)n * sizeof *h, e);
    free(h);
    return d;
}

float *bo_upload_f32(bo_ctx *c, const float *x, int64_t n, lm_error *e) {
    return bo_upload_bytes(c, x, (size_t)n * sizeof(float), e);
}

void *bo_alloc_poisoned(bo_ctx *c, size_t bytes, lm_error *e) {
    void *d = NULL;
    if (lm_cuda_ctx_alloc(c->cuda, &d, bytes, e) != LM_OK)
        return NULL;
    if (lm_cuda_ctx_memset(c->cuda, d, 0xFF, bytes, e) != LM_OK) {
        lm_cuda_ctx_free_mem(c->cuda, d);
        return NULL;
    }
    return d;
}

lm_status bo_download_bf16(bo_ctx *c, float *dst, const void *src, int64_t n, lm_error *e) {
    uint16_t *h = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof *h);
    lm_status st = lm_cuda_ctx_download(c->cuda, h, src, (size_t)n * sizeof *h, e);
    if (st == LM_OK)
        for (int64_t i = 0; i < n; i++)
            dst[i] = lm_bf16_to_f32(h[i]);
    free(h);
    return st;
}

lm_status bo_download_f32(bo_ctx *c, float *dst, const float *src, int64_t n, lm_error *e) {
    return lm_cuda_ctx_download(c->cuda, dst, src, (size_t)n * sizeof(float), e);
}

void bo_free(bo_ctx *c, void *p) { lm_cuda_ctx_free_mem(c->cuda, p); }
