/* Core module tests: errors, arena, tensor views, Philox RNG, bf16/f16 rounding,
 * timer, threads, the sgemm wrapper, and the shared test helpers themselves. */
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t f2u(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float u2f(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* ---------------------------------------------------------------- errors */

static void test_errors(void **state) {
    (void)state;
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_errorf(&err, LM_ERR_INVALID, "tensor '%s': field %s = %d", "q", "ndim", 7),
                     LM_ERR_INVALID);
    assert_int_equal(err.status, LM_ERR_INVALID);
    assert_string_equal(err.msg, "tensor 'q': field ndim = 7");
    /* A later failure replaces the message (an lm_error can be reused). */
    lm_errorf(&err, LM_ERR_IO, "%s", "second");
    assert_int_equal(err.status, LM_ERR_IO);
    assert_string_equal(err.msg, "second");
    /* NULL context: just the status. */
    assert_int_equal(lm_errorf(NULL, LM_ERR_FORMAT, "x"), LM_ERR_FORMAT);
    /* Overlong messages are truncated, never overflow. */
    char big[3000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    lm_errorf(&err, LM_ERR_INVALID, "%s", big);
    assert_int_equal(strlen(err.msg), sizeof err.msg - 1);
    for (int s = LM_OK; s <= LM_ERR_UNSUPPORTED; s++) {
        assert_non_null(lm_status_str((lm_status)s));
        assert_true(strlen(lm_status_str((lm_status)s)) > 0);
    }
    assert_string_equal(lm_status_str(LM_ERR_FORMAT), "malformed file");
}

/* ---------------------------------------------------------------- arena */

static void test_arena(void **state) {
    (void)state;
    lm_arena a;
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_arena_init(&a, 1000, &err), LM_OK);
    assert_int_equal(a.cap, 1000);
    uint8_t *p = lm_arena_alloc(&a, 100, &err);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    uint8_t *q = lm_arena_alloc(&a, 10, &err);
    assert_non_null(q);
    assert_int_equal((uintptr_t)q % 64, 0);
    assert_true(q >= p + 100);
    memset(p, 1, 100); /* the pieces are usable (ASan checks the bounds) */
    memset(q, 2, 10);
    /* Exhaustion: 128 + 10 used -> aligned start 192, 900 more does not fit. */
    void *r = lm_arena_alloc(&a, 900, &err);
    assert_null(r);
    assert_int_equal(err.status, LM_ERR_NOMEM);
    assert_non_null(strstr(err.msg, "900"));
    assert_non_null(strstr(err.msg, "1000"));
    size_t used = a.used;
    assert_int_equal(used, 138);
    /* A request of SIZE_MAX must not wrap around. */
    assert_null(lm_arena_alloc(&a, SIZE_MAX, &err));
    assert_int_equal(a.used, used);
    /* Exactly filling the arena works; one more byte does not. */
    lm_arena_reset(&a);
    assert_int_equal(a.used, 0);
    uint8_t *all = lm_arena_alloc(&a, 1000, &err);
    assert_ptr_equal(all, a.base);
    memset(all, 3, 1000);
    assert_null(lm_arena_alloc(&a, 1, &err));
    lm_arena_free(&a);
    assert_null(a.base);
    lm_arena_free(&a); /* idempotent */
    /* An uninitialised (freed) arena reports an error instead of crashing. */
    err.status = LM_OK;
    assert_null(lm_arena_alloc(&a, 8, &err));
    assert_int_equal(err.status, LM_ERR_INVALID);
}

/* ---------------------------------------------------------------- tensors */

static void test_tensor(void **state) {
    (void)state;
    static const struct {
        lm_dtype dt;
        const char *name;
        size_t size;
    } dts[] = {{LM_F32, "F32", 4}, {LM_F64, "F64", 8}, {LM_BF16, "BF16", 2}, {LM_F16, "F16", 2},
               {LM_I32, "I32", 4}, {LM_I64, "I64", 8}, {LM_U8, "U8", 1}};
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
        assert_int_equal(lm_dtype_size(dts[i].dt), dts[i].size);
        assert_string_equal(lm_dtype_name(dts[i].dt), dts[i].name);
        lm_dtype back = LM_DTYPE_COUNT;
        assert_int_equal(lm_dtype_from_name(dts[i].name, &back), 0);
        assert_int_equal(back, dts[i].dt);
    }
    lm_dtype d = LM_F32;
    assert_int_equal(lm_dtype_from_name("f32", &d), -1); /* case matters, as in safetensors */
    assert_int_equal(lm_dtype_from_name("BOOL", &d), -1);
    assert_int_equal(lm_dtype_from_name(NULL, &d), -1);

    /* [B,T,H,D] = [2,5,3,4] contiguous. */
    float buf[2 * 5 * 3 * 4];
    int64_t shape[4] = {2, 5, 3, 4};
    lm_tensor t = lm_tensor_make(buf, LM_F32, 4, shape);
    assert_int_equal(t.ndim, 4);
    assert_int_equal(t.stride[0], 60);
    assert_int_equal(t.stride[1], 12);
    assert_int_equal(t.stride[2], 4);
    assert_int_equal(t.stride[3], 1);
    assert_int_equal(lm_tensor_numel(&t), 120);
    assert_true(lm_tensor_is_contiguous(&t));
    int64_t idx[4] = {1, 2, 1, 3};
    assert_int_equal(lm_tensor_offset(&t, idx), 60 + 24 + 4 + 3);
    /* Every index maps to a distinct in-range offset. */
    int seen[120] = {0};
    for (int64_t b = 0; b < 2; b++)
        for (int64_t s = 0; s < 5; s++)
            for (int64_t h = 0; h < 3; h++)
                for (int64_t e = 0; e < 4; e++) {
                    int64_t ix[4] = {b, s, h, e};
                    int64_t o = lm_tensor_offset(&t, ix);
                    assert_true(o >= 0 && o < 120);
                    seen[o]++;
                }
    for (int i = 0; i < 120; i++)
        assert_int_equal(seen[i], 1);

    /* A strided view: swap T and H ([B,H,T,D] over [B,T,H,D] storage). */
    lm_tensor v = t;
    v.shape[1] = 3;
    v.shape[2] = 5;
    v.stride[1] = 4;
    v.stride[2] = 12;
    assert_false(lm_tensor_is_contiguous(&v));
    int64_t vi[4] = {1, 2, 4, 1}; /* b=1, h=2, t=4, d=1 */
    assert_int_equal(lm_tensor_offset(&v, vi), 60 + 2 * 4 + 4 * 12 + 1);
    int64_t ti[4] = {1, 4, 2, 1};
    assert_int_equal(lm_tensor_offset(&v, vi), lm_tensor_offset(&t, ti));
    /* A slice of one head: [B,T,1,D] with the parent's strides. */
    lm_tensor s1 = t;
    s1.shape[2] = 1;
    s1.data = buf + 2 * 4;
    assert_false(lm_tensor_is_contiguous(&s1)); /* T stride 12 != 4 */
    /* Unit dims may carry any stride. */
    int64_t sh1[3] = {1, 3, 4};
    lm_tensor u = lm_tensor_make(buf, LM_F32, 3, sh1);
    u.stride[0] = 999;
    assert_true(lm_tensor_is_contiguous(&u));

    /* 0-dim and zero-size tensors. */
    lm_tensor sc = lm_tensor_make(buf, LM_F64, 0, NULL);
    assert_int_equal(lm_tensor_numel(&sc), 1);
    assert_int_equal(lm_tensor_offset(&sc, NULL), 0);
    int64_t zs[2] = {0, 7};
    lm_tensor z = lm_tensor_make(NULL, LM_I32, 2, zs);
    assert_int_equal(lm_tensor_numel(&z), 0);
    assert_true(lm_tensor_is_contiguous(&z));
}

/* ---------------------------------------------------------------- rng */

static void test_philox_known_answers(void **state) {
    (void)state;
    /* Random123 kat_vectors (Salmon et al., SC'11): counter[4] key[2] -> out[4]. */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        lm_philox4x32_10(&kat[i][0], &kat[i][4], out);
        for (int j = 0; j < 4; j++)
            assert_int_equal(out[j], kat[i][6 + j]);
    }
    /* The 64-bit convenience form maps (key, counter) onto the low words. */
    uint32_t a[4], b[4];
    uint64_t key = 0x299f31d0a4093822ull, ctr = 0x85a308d3243f6a88ull;
    lm_philox4x32(key, ctr, a);
    uint32_t c4[4] = {0x243f6a88, 0x85a308d3, 0, 0}, k2[2] = {0xa4093822, 0x299f31d0};
    lm_philox4x32_10(c4, k2, b);
    assert_memory_equal(a, b, sizeof a);
    lm_philox4x32(0, 0, a);
    assert_int_equal(a[0], 0x6627e8d5);
}

static void test_rng_determinism(void **state) {
    (void)state;
    lm_rng r1, r2, r3;
    lm_rng_init(&r1, 42);
    lm_rng_init(&r2, 42);
    lm_rng_init(&r3, 43);
    int differ = 0;
    for (int i = 0; i < 1000; i++) {
        uint32_t x = lm_rng_u32(&r1), y = lm_rng_u32(&r2), z = lm_rng_u32(&r3);
        assert_int_equal(x, y);
        differ += x != z;
    }
    assert_true(differ > 990);
    /* The stream is the Philox blocks in order: word i = block i/4, word i%4. */
    lm_rng r;
    lm_rng_init(&r, 7);
    for (uint64_t blk = 0; blk < 5; blk++) {
        uint32_t w[4];
        lm_philox4x32(7, blk, w);
        for (int j = 0; j < 4; j++)
            assert_int_equal(lm_rng_u32(&r), w[j]);
    }
    /* Splittable: jumping the counter reproduces the same tail. */
    lm_rng a, b;
    lm_rng_init(&a, 99);
    for (int i = 0; i < 37; i++)
        (void)lm_rng_u32(&a);
    lm_rng_init(&b, 99);
    b.counter = 37;
    for (int i = 0; i < 100; i++)
        assert_int_equal(lm_rng_u32(&a), lm_rng_u32(&b));
    /* Same seed, same doubles. */
    double x1[64], x2[64];
    lm_fill_normal(x1, 64, 5, 0.0, 1.0);
    lm_fill_normal(x2, 64, 5, 0.0, 1.0);
    assert_memory_equal(x1, x2, sizeof x1);
}

static void test_rng_statistics(void **state) {
    (void)state;
    const int n = 100000;
    lm_rng r;
    lm_rng_init(&r, 12345);
    double s = 0, s2 = 0, s4 = 0;
    for (int i = 0; i < n; i++) {
        double z = lm_rng_normal(&r);
        assert_true(isfinite(z));
        s += z;
        s2 += z * z;
        s4 += z * z * z * z;
    }
    double mean = s / n, var = s2 / n - mean * mean, kurt = s4 / n;
    printf("normal: mean=%.5f var=%.5f E[z^4]=%.4f (n=%d)\n", mean, var, kurt, n);
    /* 5 standard errors: mean 1/sqrt(n) = 0.0032, variance sqrt(2/n) = 0.0045,
     * E[z^4] sqrt(96/n) = 0.031. */
    assert_true(fabs(mean) < 5 * 0.0032);
    assert_true(fabs(var - 1.0) < 5 * 0.0045);
    assert_true(fabs(kurt - 3.0) < 5 * 0.031);

    double u = 0, umin = 1, umax = 0;
    lm_rng_init(&r, 777);
    int bins[10] = {0};
    for (int i = 0; i < n; i++) {
        double x = lm_rng_uniform(&r);
        assert_true(x >= 0.0 && x < 1.0);
        u += x;
        umin = x < umin ? x : umin;
        umax = x > umax ? x : umax;
        bins[(int)(x * 10)]++;
    }
    printf("uniform: mean=%.5f min=%.2e max=%.6f\n", u / n, umin, umax);
    assert_true(fabs(u / n - 0.5) < 5 * 0.00092); /* sd of mean: sqrt(1/12/n) */
    /* Chi-square over 10 bins, 9 dof: 99.99th percentile is about 33.7. */
    double chi2 = 0;
    for (int i = 0; i < 10; i++)
        chi2 += (bins[i] - n / 10.0) * (bins[i] - n / 10.0) / (n / 10.0);
    printf("uniform: chi2(10 bins)=%.2f\n", chi2);
    assert_true(chi2 < 33.7);

    /* lm_fill_* honour mean/std and range. */
    double *x = malloc(sizeof(double) * (size_t)n);
    lm_fill_normal(x, n, 3, 2.0, 0.5);
    double m = 0;
    for (int i = 0; i < n; i++)
        m += x[i];
    assert_true(fabs(m / n - 2.0) < 5 * 0.5 / sqrt((double)n));
    lm_fill_uniform(x, n, 3, -3.0, -1.0);
    for (int i = 0; i < n; i++)
        assert_true(x[i] >= -3.0 && x[i] < -1.0);
    free(x);
}

/* ---------------------------------------------------------------- bf16 */

/* Reference bf16 rounding for finite x: choose between the two bf16 neighbours by
 * exact comparison in double, ties to the even mantissa. */
static uint16_t bf16_ref(float x) {
    uint32_t u = f2u(x);
    uint16_t lo = (uint16_t)(u >> 16);
    if ((u & 0xffffu) == 0)
        return lo;
    uint16_t hi = (uint16_t)(lo + 1); /* next magnitude up (same sign) */
    double dx = fabs((double)x);
    double dlo = fabs((double)u2f((uint32_t)lo << 16));
    double dhi = (hi & 0x7f80u) == 0x7f80u ? ldexp(1.0, 128) /* Inf: 2^128 for rounding */
                                           : fabs((double)u2f((uint32_t)hi << 16));
    double elo = dx - dlo, ehi = dhi - dx;
    if (elo < ehi)
        return lo;
    if (ehi < elo)
        return hi;
    return (lo & 1u) ? hi : lo;
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(lm_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(lm_f32_to_bf16(-2.0f), 0xc000);
    assert_int_equal(lm_f32_to_bf16(0.0f), 0x0000);
    assert_int_equal(lm_f32_to_bf16(-0.0f), 0x8000);
    /* Ties go to even. 1 + 2^-8 sits halfway between 0x3f80 (even) and 0x3f81. */
    assert_int_equal(lm_f32_to_bf16(u2f(0x3f808000u)), 0x3f80);
    assert_int_equal(lm_f32_to_bf16(u2f(0x3f818000u)), 0x3f82); /* 0x3f81 odd -> up */
    assert_int_equal(lm_f32_to_bf16(u2f(0xbf808000u)), 0xbf80);
    assert_int_equal(lm_f32_to_bf16(u2f(0xbf818000u)), 0xbf82);
    assert_int_equal(lm_f32_to_bf16(u2f(0x3f808001u)), 0x3f81); /* just above the tie */
    assert_int_equal(lm_f32_to_bf16(u2f(0x3f807fffu)), 0x3f80); /* just below */
    /* Carry into the exponent: largest mantissa rounds up to the next power of 2. */
    assert_int_equal(lm_f32_to_bf16(u2f(0x3fffffffu)), 0x4000);
    /* Subnormals round the same way. */
    assert_int_equal(lm_f32_to_bf16(u2f(0x00008000u)), 0x0000);
    assert_int_equal(lm_f32_to_bf16(u2f(0x00018000u)), 0x0002);
    /* Inf stays Inf; overflow rounds to Inf. */
    assert_int_equal(lm_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(lm_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(lm_f32_to_bf16(FLT_MAX), 0x7f80);
    assert_int_equal(lm_f32_to_bf16(-FLT_MAX), 0xff80);
    assert_int_equal(lm_f32_to_bf16(u2f(0x7f7f8000u)), 0x7f80); /* tie, odd -> Inf */
    assert_int_equal(lm_f32_to_bf16(u2f(0x7f7f7fffu)), 0x7f7f); /* stays finite */
    assert_true(isinf(lm_bf16_round(3.4e38f)));
    /* NaN stays NaN (quiet), whatever its payload: a signalling NaN whose payload
     * lives only in the low bits must not turn into Inf. */
    uint16_t hn = lm_f32_to_bf16(u2f(0x7f800001u));
    assert_true(isnan(lm_bf16_to_f32(hn)));
    assert_int_equal(hn & 0x0040, 0x0040);
    assert_true(isnan(lm_bf16_to_f32(lm_f32_to_bf16(NAN))));
    uint16_t nn = lm_f32_to_bf16(u2f(0xffc00000u));
    assert_true(isnan(lm_bf16_to_f32(nn)));
    assert_int_equal(nn & 0x8000, 0x8000);
    assert_true(isnan(lm_bf16_round(NAN)));
    /* Every bf16 value converts to fp32 and back exactly. */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = lm_bf16_to_f32((uint16_t)h);
        if (isnan(f))
            continue;
        assert_int_equal(lm_f32_to_bf16(f), h);
    }
    /* Random fp32 bit patterns against the exact reference. */
    lm_rng r;
    lm_rng_init(&r, 2024);
    for (int i = 0; i < 200000; i++) {
        uint32_t u = lm_rng_u32(&r);
        if (i % 4 == 0)
            u = (u & 0xffff0000u) | 0x8000u; /* force ties */
        float x = u2f(u);
        if (isnan(x))
            continue;
        uint16_t got = lm_f32_to_bf16(x), want = bf16_ref(x);
        if (got != want)
            fail_msg("bf16(0x%08x) = 0x%04x, want 0x%04x", u, got, want);
        assert_true(lm_bf16_round(x) == lm_bf16_to_f32(want) ||
                    (isinf(lm_bf16_round(x)) && isinf(lm_bf16_to_f32(want))));
    }
}

/* ---------------------------------------------------------------- f16 */

/* Reference: nearest binary16 to x (finite, |x| may exceed the range) by binary
 * search over the sorted positive finite halves, ties to even; beyond the largest
 * finite half + half an ulp (65520) the result is Inf. */
static uint16_t f16_ref(float x) {
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs((double)x);
    if (a >= 65520.0)
        return (uint16_t)(sign | 0x7c00);
    int lo = 0, hi = 0x7bff; /* positive finite halves are ordered by bits */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if ((double)lm_f16_to_f32((uint16_t)mid) <= a)
            lo = mid;
        else
            hi = mid;
    }
    double vlo = lm_f16_to_f32((uint16_t)lo), vhi = lm_f16_to_f32((uint16_t)hi);
    if (a >= vhi)
        return (uint16_t)(sign | hi);
    double elo = a - vlo, ehi = vhi - a;
    int pick = elo < ehi ? lo : ehi < elo ? hi : ((lo & 1) ? hi : lo);
    return (uint16_t)(sign | pick);
}

static void test_f16(void **state) {
    (void)state;
    assert_int_equal(lm_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(lm_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(lm_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(lm_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(lm_f32_to_f16(65520.0f), 0x7c00); /* tie with an odd neighbour -> Inf */
    assert_int_equal(lm_f32_to_f16(1e10f), 0x7c00);
    assert_int_equal(lm_f32_to_f16(-1e10f), 0xfc00);
    assert_int_equal(lm_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00); /* tie -> even */
    assert_int_equal(lm_f32_to_f16(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02);
    /* Subnormals: unit 2^-24. */
    assert_int_equal(lm_f32_to_f16(ldexpf(1.0f, -24)), 0x0001);
    assert_int_equal(lm_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);    /* tie -> 0 */
    assert_int_equal(lm_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);    /* above tie */
    assert_int_equal(lm_f32_to_f16(ldexpf(3.0f, -25)), 0x0002);    /* 1.5 units -> 2 */
    assert_int_equal(lm_f32_to_f16(ldexpf(1.0f, -14)), 0x0400);    /* min normal */
    assert_int_equal(lm_f32_to_f16(ldexpf(1023.5f, -24)), 0x0400); /* carries up */
    assert_int_equal(lm_f32_to_f16(ldexpf(1.0f, -30)), 0x0000);
    assert_int_equal(lm_f32_to_f16(-ldexpf(1.0f, -30)), 0x8000);
    assert_true(lm_f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    assert_true(lm_f16_to_f32(0x03ff) == ldexpf(1023.0f, -24));
    assert_true(lm_f16_to_f32(0x8000) == 0.0f && signbit(lm_f16_to_f32(0x8000)));
    assert_int_equal(lm_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(lm_f32_to_f16(-INFINITY), 0xfc00);
    assert_true(isinf(lm_f16_to_f32(0x7c00)));
    assert_true(isnan(lm_f16_to_f32(lm_f32_to_f16(NAN))));
    assert_true(isnan(lm_f16_to_f32(lm_f32_to_f16(u2f(0x7f800001u))))); /* low payload */
    /* Every half round-trips through fp32 (NaNs stay NaN). */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = lm_f16_to_f32((uint16_t)h);
        uint16_t back = lm_f32_to_f16(f);
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) {
            assert_true(isnan(f));
            assert_true(isnan(lm_f16_to_f32(back)));
        } else if (back != h) {
            fail_msg("f16 0x%04x -> %g -> 0x%04x", h, (double)f, back);
        }
    }
    /* Random fp32 values over the whole half range and beyond, incl. ties. */
    lm_rng r;
    lm_rng_init(&r, 99);
    for (int i = 0; i < 100000; i++) {
        uint32_t u = lm_rng_u32(&r);
        /* exponents 2^-30 .. 2^17 */
        uint32_t e = 97 + lm_rng_u32(&r) % 48;
        u = (u & 0x807fffffu) | (e << 23);
        if (i % 4 == 0)
            u = (u & 0xffffe000u) | 0x1000u; /* normal-range ties */
        float x = u2f(u);
        uint16_t got = lm_f32_to_f16(x), want = f16_ref(x);
        if (got != want)
            fail_msg("f16(0x%08x=%g) = 0x%04x, want 0x%04x", u, (double)x, got, want);
    }
}

/* ---------------------------------------------------------------- timer, threads */

static void test_timer_threads(void **state) {
    (void)state;
    double t0 = lm_time_sec();
    volatile double acc = 0;
    for (int i = 0; i < 100000; i++)
        acc += i;
    double t1 = lm_time_sec();
    assert_true(t0 > 0.0);
    assert_true(t1 >= t0);

    int def = lm_get_num_threads();
    assert_true(def >= 1);
    lm_set_num_threads(1);
    assert_int_equal(lm_get_num_threads(), 1);
    lm_set_num_threads(3);
    assert_int_equal(lm_get_num_threads(), 3);
    lm_set_num_threads(0);
    assert_int_equal(lm_get_num_threads(), def);

    int bdef = lm_blas_get_threads();
    assert_true(bdef >= 1);
    lm_blas_set_threads(1);
    assert_int_equal(lm_blas_get_threads(), 1);
    lm_blas_set_threads(0);
    assert_int_equal(lm_blas_get_threads(), bdef);
}

/* ---------------------------------------------------------------- sgemm */

/* Element (i, j) of op(X) for a row-major X with row stride ld. */
static double at(const float *X, int ld, int trans, int i, int j) {
    return trans ? X[(size_t)j * ld + i] : X[(size_t)i * ld + j];
}

static void check_sgemm(int ta, int tb, int M, int N, int K, int pad) {
    const float alpha = 1.5f, beta = -0.5f;
    int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb;
    size_t nc = (size_t)M * ldc;
    double *tmp = malloc(sizeof(double) * (na + nb + nc + 1));
    lm_fill_normal(tmp, (int64_t)(na + nb + nc), 1000 + 4 * ta + 2 * tb, 0.0, 1.0);
    float *A = lm_to_f32(tmp, (int64_t)na);
    float *B = lm_to_f32(tmp + na, (int64_t)nb);
    float *C = lm_to_f32(tmp + na + nb, (int64_t)nc);
    double *ref = malloc(sizeof(double) * ((size_t)M * N + 1));
    float *got = malloc(sizeof(float) * ((size_t)M * N + 1));
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int p = 0; p < K; p++)
                s += at(A, lda, ta, i, p) * at(B, ldb, tb, p, j);
            ref[(size_t)i * N + j] = alpha * s + beta * (double)C[(size_t)i * ldc + j];
        }
    /* Padding columns of C must be left untouched. */
    float sentinel = 12345.0f;
    for (int i = 0; i < M; i++)
        for (int j = N; j < ldc; j++)
            C[(size_t)i * ldc + j] = sentinel;
    lm_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++)
            got[(size_t)i * N + j] = C[(size_t)i * ldc + j];
        for (int j = N; j < ldc; j++)
            assert_true(C[(size_t)i * ldc + j] == sentinel);
    }
    char name[96];
    snprintf(name, sizeof name, "sgemm ta=%d tb=%d M=%d N=%d K=%d pad=%d", ta, tb, M, N, K, pad);
    assert_true(lm_check_f32(name, got, ref, (int64_t)M * N, TOL_FWD_F32));
    free(tmp);
    free(A);
    free(B);
    free(C);
    free(ref);
    free(got);
}

static void test_sgemm(void **state) {
    (void)state;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            check_sgemm(ta, tb, 37, 29, 53, 0);
            check_sgemm(ta, tb, 16, 128, 16, 3);
            check_sgemm(ta, tb, 1, 1, 1, 0);
            check_sgemm(ta, tb, 64, 64, 128, 5);
        }
    /* Empty problems are no-ops. */
    float c = 7.0f;
    lm_sgemm(0, 0, 0, 1, 1, 1.0f, NULL, 1, NULL, 1, 0.0f, &c, 1);
    lm_sgemm(0, 0, 1, 0, 1, 1.0f, NULL, 1, NULL, 1, 0.0f, &c, 1);
    assert_true(c == 7.0f);
    /* K = 0: C = beta * C. */
    lm_sgemm(0, 0, 1, 1, 0, 1.0f, &c, 1, &c, 1, 0.5f, &c, 1);
    assert_true(c == 3.5f);
    /* Single-threaded BLAS gives the same answer (inside-parallel-region use). */
    lm_blas_set_threads(1);
    check_sgemm(1, 0, 70, 50, 90, 1);
    lm_blas_set_threads(0);
}

/* ---------------------------------------------------------------- test helpers */

static void test_compare_helpers(void **state) {
    (void)state;
    double ref[4] = {1.0, -2.0, 3.0, 0.5};
    float same[4] = {1.0f, -2.0f, 3.0f, 0.5f};
    lm_cmp c = lm_compare_f32(same, ref, 4, 1e-5);
    assert_true(c.pass);
    assert_true(c.rel_rms == 0.0 && c.max_abs == 0.0 && c.n_nonfinite == 0);
    /* A 1% error in one element fails a 1e-5 tolerance and passes 1e-2. */
    float off[4] = {1.0f, -2.0f, 3.03f, 0.5f};
    c = lm_compare_f32(off, ref, 4, 1e-5);
    assert_false(c.pass);
    assert_true(fabs(c.rel_rms - 0.03 / sqrt(1 + 4 + 9 + 0.25)) < 1e-6);
    assert_true(lm_compare_f32(off, ref, 4, 1e-2).pass);
    /* NaN / Inf in out or ref fail whatever the tolerance. */
    float withnan[4] = {1.0f, NAN, 3.0f, 0.5f};
    c = lm_compare_f32(withnan, ref, 4, 1e30);
    assert_false(c.pass);
    assert_int_equal(c.n_nonfinite, 1);
    double refinf[4] = {1.0, -2.0, INFINITY, 0.5};
    assert_false(lm_compare_f64(ref, refinf, 4, 1e30).pass);
    /* All-zero reference: tiny absolute errors pass, larger ones fail (rel = inf). */
    double zero[3] = {0, 0, 0};
    double tiny[3] = {1e-7, -5e-7, 0};
    double big[3] = {1e-3, 0, 0};
    assert_true(lm_compare_f64(tiny, zero, 3, 1e-5).pass);
    c = lm_compare_f64(big, zero, 3, 1e-5);
    assert_false(c.pass);
    assert_true(isinf(c.rel_rms));
    /* No absolute floor for a reference with a non-zero value: an output 500x a tiny
     * reference fails (it passed through the floor before, issue 25); a close one passes. */
    double small[2] = {1e-9, 0}, smallo[2] = {5e-7, 0}, smallc[2] = {1.000001e-9, 0};
    assert_false(lm_compare_f64(smallo, small, 2, 1e-5).pass);
    assert_true(lm_compare_f64(smallc, small, 2, 1e-5).pass);
    /* Empty arrays pass. */
    assert_true(lm_compare_f64(NULL, NULL, 0, 1e-5).pass);
    /* The reporting wrappers agree with the compares. */
    assert_true(lm_check_f32("helper self-check (expected PASS)", same, ref, 4, 1e-5));
    assert_false(lm_check_f32("helper self-check (expected FAIL)", off, ref, 4, 1e-5));
    assert_false(lm_check_f64("helper self-check (expected FAIL, NaN)", refinf, ref, 4, 1.0));
    /* Poison writes NaN everywhere. */
    float p[5] = {0};
    lm_poison_f32(p, 5);
    for (int i = 0; i < 5; i++)
        assert_true(isnan(p[i]));
    /* fp64 <-> fp32 copies. */
    double d[3] = {1.0, 1.0 / 3.0, -1e10};
    float *f = lm_to_f32(d, 3);
    double *g = lm_to_f64(f, 3);
    for (int i = 0; i < 3; i++) {
        assert_true(f[i] == (float)d[i]);
        assert_true(g[i] == (double)f[i]);
    }
    free(f);
    free(g);
}

static void test_run_cli(void **state) {
    (void)state;
    /* Exercise the runner with the shell standing in for the CLI. */
    const char *old = getenv("LINMOE_BIN");
    char *saved = old ? strdup(old) : NULL;
    assert_int_equal(setenv("LINMOE_BIN", "/bin/sh", 1), 0);
    char out[256];
    int rc = lm_run_cli(out, sizeof out, "-c 'echo to-stdout; echo to-stderr >&2; exit %d'", 3);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "to-stdout"));
    assert_non_null(strstr(out, "to-stderr"));
    assert_int_equal(lm_run_cli(NULL, 0, "-c 'exit 0'"), 0);
    /* Output longer than the buffer is truncated and NUL-terminated. */
    char small[8];
    assert_int_equal(lm_run_cli(small, sizeof small, "-c 'echo 0123456789abcdef'"), 0);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_string_equal(small, "0123456");
    unsetenv("LINMOE_BIN");
    assert_int_equal(lm_run_cli(out, sizeof out, "--help"), -1);
    if (saved) {
        setenv("LINMOE_BIN", saved, 1);
        free(saved);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_arena),
        cmocka_unit_test(test_tensor),
        cmocka_unit_test(test_philox_known_answers),
        cmocka_unit_test(test_rng_determinism),
        cmocka_unit_test(test_rng_statistics),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_timer_threads),
        cmocka_unit_test(test_sgemm),
        cmocka_unit_test(test_compare_helpers),
        cmocka_unit_test(test_run_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
