/* test_backend_ops: every op of the model on the CPU (fp32, the reference) and on CUDA
 * (bf16 storage, fp32 accumulation) with the same random inputs, compared by relative RMS
 * error (ggml's test-backend-ops is the model; DESIGN.md "Quality bar").
 *
 * Each op family lives in one file of tests/backend_ops/ and defines
 *   int bo_family_<name>(bo_ctx *c);
 * which runs its cases and reports every compared tensor with bo_check (one table row
 * each). It returns the number of failed rows (or calls bo_fail for a setup error). */
#ifndef LINMOE_TEST_BO_H
#define LINMOE_TEST_BO_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"

/* fla's bf16 tolerances (DESIGN.md "Quality bar"; issue 21) */
#define BO_TOL_FWD 0.005
#define BO_TOL_GRAD 0.008
#define BO_TOL_GATE_GRAD 0.02

typedef struct {
    lm_cuda_ctx *cuda;
    lm_rng rng;
    int rows, failed;
    const char *family;
} bo_ctx;

/* rel RMS ||out - ref|| / ||ref|| in fp64 (also passes when max|out - ref| <= 1e-6); a
 * NaN / Inf in out gives +Inf. */
double bo_rel_rms(const float *out, const float *ref, int64_t n);
/* One table row: op, dtype, shape text, tensor name, error, tolerance; counts failures.
 * Returns 1 on failure, 0 on pass. */
int bo_check(bo_ctx *c, const char *op, const char *dtype, const char *shape, const char *tensor,
             const float *out, const float *ref, int64_t n, double tol);
/* A setup failure (a CUDA call failed): prints the message, counts one failed row. */
int bo_fail(bo_ctx *c, const char *op, const char *shape, const lm_error *e);

/* Host random fills (fp32). normal: mean 0, std s. uniform: [lo, hi). */
void bo_fill_normal(bo_ctx *c, float *x, int64_t n, float s);
void bo_fill_uniform(bo_ctx *c, float *x, int64_t n, float lo, float hi);
/* Round every element to bf16 in place (so the CPU reference sees the bf16 inputs the
 * GPU sees). */
void bo_round_bf16(float *x, int64_t n);

/* Device buffers through the test's context. bf16: fp32 host values rounded and
 * uploaded as bf16. Each returns NULL after recording the error in e. */
void *bo_upload_bf16(bo_ctx *c, const float *x, int64_t n, lm_error *e);
float *bo_upload_f32(bo_ctx *c, const float *x, int64_t n, lm_error *e);
void *bo_upload_bytes(bo_ctx *c, const void *x, size_t bytes, lm_error *e);
/* An output buffer poisoned with 0xFF bytes (NaN in bf16 and fp32), so an element the
 * op fails to write shows as NaN. */
void *bo_alloc_poisoned(bo_ctx *c, size_t bytes, lm_error *e);
/* Download n bf16 / fp32 values into fp32 host memory (synchronises). */
lm_status bo_download_bf16(bo_ctx *c, float *dst, const void *src, int64_t n, lm_error *e);
lm_status bo_download_f32(bo_ctx *c, float *dst, const float *src, int64_t n, lm_error *e);
void bo_free(bo_ctx *c, void *p);

#endif
