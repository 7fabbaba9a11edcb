/* Test helpers shared by every test: the comparison used everywhere, random inputs,
 * poisoning, and running the CLI.
 *
 * Comparison (DESIGN.md "Quality bar", reference/kda.md §5): fails on any NaN/Inf in
 * `out` or `ref`; for an all-zero `ref` passes when max|out| <= 1e-6; otherwise passes
 * when the relative RMS error ||out - ref|| / ||ref|| <= tol (no absolute floor: it
 * would pass any output for a tiny reference).
 */
#ifndef LINMOE_TEST_UTIL_H
#define LINMOE_TEST_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "linmoe/core.h"

/* Tolerances (one table, with why):
 *  TOL_FWD_F32  1e-5  fp32 chunked forward vs fp64 recurrence (DESIGN.md)
 *  TOL_BWD_F32  1e-4  fp32 gradients vs fp64 (DESIGN.md)
 *  TOL_FD       1e-6  fp64 analytic gradient vs central finite differences (h = 1e-5:
 *                     truncation O(h^2) ~ 1e-10, rounding ~ 1e-16/1e-5 = 1e-11)
 *  TOL_BF16_O   0.005 bf16 o / final_state (fla's floor)  */
#define TOL_FWD_F32 1e-5
#define TOL_BWD_F32 1e-4
#define TOL_FD 1e-6
#define TOL_BF16_O 0.005

typedef struct {
    double rel_rms;   /* ||out-ref|| / ||ref|| (inf if ref is all zero and out is not) */
    double max_abs;   /* max |out - ref| */
    int64_t n_nonfinite; /* NaN/Inf count in out or ref */
    int pass;
} lm_cmp;

lm_cmp lm_compare_f32(const float *out, const double *ref, int64_t n, double tol);
lm_cmp lm_compare_f64(const double *out, const double *ref, int64_t n, double tol);
/* Compare and report: prints "name: rel_rms=... max_abs=... tol=... PASS|FAIL" and
 * returns pass. Use as assert_true(lm_check_f32(...)). */
int lm_check_f32(const char *name, const float *out, const double *ref, int64_t n, double tol);
int lm_check_f64(const char *name, const double *out, const double *ref, int64_t n, double tol);

/* Sampled central finite differences of an fp32 function: for up to `samples`
 * entries of t (all of them when n <= samples, else seeded random ones), compare
 * grad[i] with (loss(t_i + step) - loss(t_i - step)) / (the step actually applied
 * after rounding to fp32), restoring t; returns lm_check_f32 of the sample at tol.
 * `loss` evaluates the fp64-accumulated loss of the whole forward for `ctx`. */
int lm_fd_check_sampled(const char *name, float *t, const float *grad, int64_t n, int samples,
                        double step, uint64_t seed, double (*loss)(void *ctx), void *ctx, double tol);

/* Random fills (seeded, counter-based). */
void lm_fill_normal(double *x, int64_t n, uint64_t seed, double mean, double std);
void lm_fill_uniform(double *x, int64_t n, uint64_t seed, double lo, double hi);
/* fp64 -> fp32 copy (newly malloc'd) and back. */
float *lm_to_f32(const double *x, int64_t n);
double *lm_to_f64(const float *x, int64_t n);
/* Poison a buffer with NaN so unwritten elements are caught by the compare. */
void lm_poison_f32(float *x, int64_t n);

/* Run `$LINMOE_BIN args...` (the CLI built alongside the tests) through the shell,
 * stdout/stderr captured into `out` (may be NULL). Returns the exit status. */
int lm_run_cli(char *out, size_t out_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
