/* Helpers shared by the model's layers (src/model/). Not a public API. */
#ifndef LINMOE_MODEL_INTERNAL_H
#define LINMOE_MODEL_INTERNAL_H

#include "linmoe/core.h"

/* Output rows per task of lm_model_mm: fixed, so the summation order of every
 * element does not depend on the thread count. */
#define LM_MODEL_MM_BLK 64

/* C[M,N] = op(A) op(B) (+ C when accum), row-major, as single-threaded OpenBLAS
 * calls on fixed blocks of LM_MODEL_MM_BLK rows of C run in an OpenMP loop
 * (bitwise identical results for any thread count). */
void lm_model_mm(int tA, int tB, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, int accum, float *C, int ldc);

/* LM_ERR_INVALID naming `layer`, `what` (forward/backward) and the tensor when `p`
 * is NULL or holds a non-finite value (the first one's index and value). */
lm_status lm_model_check_finite(const char *layer, const char *what, const char *name,
                                const float *p, int64_t n, lm_error *err);

#endif
