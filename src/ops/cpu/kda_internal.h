/* Internals of the CPU KDA/GDN kernels shared by the chunked and recurrent paths
 * and exposed to tests (the bound demonstration in tests/test_kda_bound.c calls the
 * diagonal-tile builders directly, so the test exercises the kernel's own code).
 */
#ifndef LINMOE_OPS_CPU_KDA_INTERNAL_H
#define LINMOE_OPS_CPU_KDA_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linmoe/kda.h"

/* exp(x) in fp32, written so that loops over it vectorise (no branches, no
 * calls): Cody-Waite reduction by ln2 and a degree-6 polynomial on
 * [-ln2/2, ln2/2] (max rel. error ~2 ulp); returns +inf above 88.72 and 0 below
 * -87.33 (no subnormals), NaN for NaN. A NaN reaches it from finite inputs too (an
 * attention score of inf - inf when huge q/k overflow), so it is computed on 0 instead:
 * converting NaN to int is undefined behaviour. */
static inline float lm_fexp(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693145751953125f, ln2_lo = 1.42860682030941723e-6f;
    float xc = x == x ? x : 0.0f;
    xc = xc < -87.33f ? -87.33f : xc;
    xc = xc > 88.7f ? 88.7f : xc;
    float n = (xc * log2e + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = (xc - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    float y = p * s;
    y = x < -87.33f ? 0.0f : y;
    y = x > 88.72f ? INFINITY : y;
    y = x == x ? y : x;
    return y;
}

/* Diagonal tile of the intra-chunk products, shared-matmul form (reference/kda.md
 * §2.4, §3.1): for rows r and columns i of one L-token tile (i <= r),
 *   out[r*L + i] = sum_d (a[r,d] e^{G[r,d]-G[ref,d]}) (b[i,d] e^{G[ref,d]-G[i,d]})
 * computed as ONE L x L x K matmul of the two factor matrices. `ref` is the tile
 * row the factors are taken relative to (0 = tile start, L/2 = midpoint). With
 * round_bf16 the two factors are rounded to bf16 before the product (to show
 * which spans bf16 can hold). Entries i > r are set to 0. Rows have strides
 * lda/ldb/ldg (elements); G is the fp64 cumulative log-decay (exponents are
 * formed as fp32 differences of fp64 values). `scratch` holds 2*L*K floats. Overflowing factors give
 * Inf/NaN in `out`, as the hardware would. */
void lm_kda_diag_tile_shared(int L, int K, const float *a, int lda, const float *b, int ldb,
                             const double *G, int ldg, int ref, int round_bf16, float *out,
                             float *scratch);

/* The same tile by the safe per-pair path: exp of the difference G[r]-G[i] <= 0,
 * never overflows whatever the gate. */
void lm_kda_diag_tile_safe(int L, int K, const float *a, int lda, const float *b, int ldb,
                           const double *G, int ldg, float *out);

#endif
