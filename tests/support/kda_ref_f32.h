/* The reference recurrence of kda_ref.c compiled with float in place of double: a
 * plain fp32 token-by-token forward and backward (every value stored in fp32, the
 * library's math functions as in the fp64 reference). It is not an oracle: it is the
 * yardstick for the chunked kernels' rounding, i.e. how far a straightforward fp32
 * implementation of the same recurrence lands from the fp64 one on the same inputs.
 *
 * Same fields, layouts and semantics as kda_ref_io / kda_ref_run (kda_ref.h), fp32.
 */
#ifndef LINMOE_TEST_KDA_REF_F32_H
#define LINMOE_TEST_KDA_REF_F32_H

#include "linmoe/kda.h"

typedef struct {
    const float *q, *k, *v, *g, *beta, *A_log, *dt_bias, *h0;
    const float *do_, *dht;
    float *o, *ht;
    float *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias;
} kda_ref_io_f32;

void kda_ref_run_f32(const lm_kda_config *c, const kda_ref_io_f32 *io);

#endif
