/* Philox-4x32-10 counter-based RNG.
 *
 * Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11,
 * Sec. 5: a 4-word counter is mixed by 10 rounds; each round multiplies two words
 * by the constants M0, M1 into 64-bit products, and forms the new counter from
 * the high halves xored with the other two words and the round key, and the low
 * halves; the 2-word key is bumped by the Weyl constants W0, W1 between rounds. */
#include "linmoe/core.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

void lm_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t x0 = ctr[0], x1 = ctr[1], x2 = ctr[2], x3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)PHILOX_M0 * x0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * x2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        uint32_t n0 = hi1 ^ x1 ^ k0;
        uint32_t n2 = hi0 ^ x3 ^ k1;
        x0 = n0;
        x1 = lo1;
        x2 = n2;
        x3 = lo0;
    }
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
}

/* The 64-bit key fills both key words; the 64-bit counter fills the two low counter
 * words (the two high words are zero). */
void lm_philox4x32(uint64_t key, uint64_t counter, uint32_t out[4]) {
    uint32_t c[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u};
    uint32_t k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
    lm_philox4x32_10(c, k, out);
}

void lm_rng_init(lm_rng *r, uint64_t seed) {
    r->key = seed;
    r->counter = 0;
}

/* r->counter counts 32-bit words: word i is word (i mod 4) of block (i / 4). The
 * value of a stream position is a pure function of (seed, position). */
uint32_t lm_rng_u32(lm_rng *r) {
    uint32_t w[4];
    lm_philox4x32(r->key, r->counter >> 2, w);
    uint32_t v = w[r->counter & 3u];
    r->counter++;
    return v;
}

double lm_rng_uniform(lm_rng *r) {
    uint32_t a = lm_rng_u32(r) >> 5; /* 27 bits */
    uint32_t b = lm_rng_u32(r) >> 6; /* 26 bits */
    return ((double)a * 67108864.0 + (double)b) * (1.0 / 9007199254740992.0);
}

double lm_rng_normal(lm_rng *r) {
    const double two_pi = 6.283185307179586476925286766559;
    double u1 = 1.0 - lm_rng_uniform(r); /* (0, 1]: log is finite */
    double u2 = lm_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
}
