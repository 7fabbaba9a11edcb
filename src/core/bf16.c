/* fp32 <-> bf16 and fp32 <-> IEEE binary16, round to nearest, ties to even. */
#include "linmoe/core.h"

#include <math.h>
#include <string.h>

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t lm_f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and payload top, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* Adding 0x7fff plus the lowest kept bit rounds half to even; a carry out of the
     * mantissa bumps the exponent, and the largest finite values round to Inf. */
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    return (uint16_t)(u >> 16);
}

float lm_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

float lm_bf16_round(float x) { return lm_bf16_to_f32(lm_f32_to_bf16(x)); }

uint16_t lm_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    int exp = (int)((u >> 23) & 0xffu);
    uint32_t mant = u & 0x7fffffu;
    if (exp == 0xff) {
        if (mant)
            return (uint16_t)(sign | 0x7e00u | (mant >> 13)); /* quiet NaN */
        return (uint16_t)(sign | 0x7c00u);
    }
    int e = exp - 127 + 15; /* binary16 biased exponent */
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        /* Subnormal half (or zero): value in units of 2^-24 is m * 2^(e - 14). Below
         * 2^-25 everything rounds to zero; exactly 2^-25 is a tie that goes to 0. */
        if (e < -10)
            return sign;
        uint32_t m = mant | 0x800000u;
        int shift = 14 - e; /* 14..24 */
        uint32_t h = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u)))
            h++; /* may carry into the min normal */
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++; /* carry may give Inf: correct */
    return (uint16_t)(sign | h);
}

float lm_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;
    if (exp == 0) {
        float v = ldexpf((float)mant, -24); /* exact: mant < 2^10 */
        return sign ? -v : v;
    }
    if (exp == 31)
        return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}
