/* fp64 token-by-token reference for the KDA / GDN op (the oracle of the tests).
 *
 * Implements reference/kda.md §1.2 (recurrence) and §1.3 (gates) literally, in
 * double precision, one (sequence, value head) at a time, and its exact backward
 * (back-propagation through the recurrence, with the state re-derived from
 * checkpoints every 64 tokens, never by inverting the decay).
 *
 * Same layouts, attributes and semantics as include/linmoe/kda.h (lm_kda_config is
 * reused; c->N must already be set, e.g. by lm_kda_validate or by the caller:
 * N = B, or n_cu_seqlens - 1). All tensors are contiguous fp64.
 */
#ifndef LINMOE_TEST_KDA_REF_H
#define LINMOE_TEST_KDA_REF_H

#include "linmoe/kda.h"

typedef struct {
    /* inputs (A_log, dt_bias, h0 may be NULL) */
    const double *q, *k, *v, *g, *beta, *A_log, *dt_bias, *h0;
    /* upstream gradients (NULL do_: forward only; NULL dht: zero) */
    const double *do_, *dht;
    /* outputs; any may be NULL when not wanted */
    double *o, *ht;
    double *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias;
} kda_ref_io;

/* Runs forward (and backward when io->do_ != NULL). The gradients are of
 * sum(o*do) + sum(ht*dht) with respect to the inputs as given. */
void kda_ref_run(const lm_kda_config *c, const kda_ref_io *io);

#endif
