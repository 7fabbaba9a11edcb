/* Test helpers: see test_util.h for the comparison rule and tolerances. */
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Absolute floor for all-zero references (empty segments, masked gradients), where a
 * relative error is undefined: the output then passes when within it. DESIGN.md
 * "Quality bar". A reference with any non-zero value is held to the relative error
 * alone: a floor for every reference passed any output for tiny ones (a reference of
 * 1e-9 everywhere and an output of 5e-7 everywhere, 500x off; issue 25). */
#define LM_CMP_ABS_FLOOR 1e-6

/* Shared core of both compares: exactly one of o32 / o64 is the output. */
static lm_cmp compare_core(const float *o32, const double *o64, const double *ref, int64_t n,
                           double tol) {
    lm_cmp c = {0.0, 0.0, 0, 0};
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double o = o32 ? (double)o32[i] : o64[i];
        double r = ref[i];
        if (!isfinite(o) || !isfinite(r)) {
            c.n_nonfinite++;
            continue;
        }
        double d = o - r;
        if (fabs(d) > c.max_abs)
            c.max_abs = fabs(d);
        num += d * d;
        den += r * r;
    }
    if (c.n_nonfinite > 0) {
        c.rel_rms = NAN;
        c.max_abs = INFINITY;
        c.pass = 0;
        return c;
    }
    if (den > 0.0)
        c.rel_rms = sqrt(num) / sqrt(den);
    else
        c.rel_rms = num > 0.0 ? INFINITY : 0.0;
    c.pass = den == 0.0 ? c.max_abs <= LM_CMP_ABS_FLOOR : c.rel_rms <= tol;
    return c;
}

lm_cmp lm_compare_f32(const float *out, const double *ref, int64_t n, double tol) {
    return compare_core(out, NULL, ref, n, tol);
}

lm_cmp lm_compare_f64(const double *out, const double *ref, int64_t n, double tol) {
    return compare_core(NULL, out, ref, n, tol);
}

static int report(const char *name, lm_cmp c, int64_t n, double tol) {
    if (c.n_nonfinite > 0)
        printf("%s: n=%lld nonfinite=%lld tol=%.3g FAIL\n", name, (long long)n,
               (long long)c.n_nonfinite, tol);
    else
        printf("%s: n=%lld rel_rms=%.3e max_abs=%.3e tol=%.3g %s\n", name, (long long)n, c.rel_rms,
               c.max_abs, tol, c.pass ? "PASS" : "FAIL");
    fflush(stdout);
    return c.pass;
}

int lm_check_f32(const char *name, const float *out, const double *ref, int64_t n, double tol) {
    return report(name, lm_compare_f32(out, ref, n, tol), n, tol);
}

int lm_check_f64(const char *name, const double *out, const double *ref, int64_t n, double tol) {
    return report(name, lm_compare_f64(out, ref, n, tol), n, tol);
}

void lm_fill_normal(double *x, int64_t n, uint64_t seed, double mean, double std) {
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int64_t i = 0; i < n; i++)
        x[i] = mean + std * lm_rng_normal(&r);
}

void lm_fill_uniform(double *x, int64_t n, uint64_t seed, double lo, double hi) {
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int64_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * lm_rng_uniform(&r);
}

float *lm_to_f32(const double *x, int64_t n) {
    float *y = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        y[i] = (float)x[i];
    return y;
}

double *lm_to_f64(const float *x, int64_t n) {
    double *y = LM_MALLOC((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++)
        y[i] = (double)x[i];
    return y;
}

void lm_poison_f32(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = NAN;
}

int lm_run_cli(char *out, size_t out_size, const char *fmt, ...) {
    const char *bin = getenv("LINMOE_BIN");
    if (out && out_size)
        out[0] = '\0';
    if (!bin || !*bin) {
        fprintf(stderr, "lm_run_cli: LINMOE_BIN is not set (run the tests through ctest)\n");
        return -1;
    }
    if (strchr(bin, '\'')) {
        fprintf(stderr, "lm_run_cli: LINMOE_BIN contains a single quote: %s\n", bin);
        return -1;
    }
    char args[4096];
    va_list ap;
    va_start(ap, fmt);
    int na = vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    if (na < 0 || (size_t)na >= sizeof args) {
        fprintf(stderr, "lm_run_cli: arguments too long (%d bytes)\n", na);
        return -1;
    }
    size_t cl = strlen(bin) + strlen(args) + 16;
    char *cmd = LM_MALLOC(cl);
    snprintf(cmd, cl, "'%s' %s 2>&1", bin, args);
    FILE *p = popen(cmd, "r");
    free(cmd);
    if (!p) {
        fprintf(stderr, "lm_run_cli: popen failed\n");
        return -1;
    }
    size_t used = 0;
    char chunk[4096];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, p)) > 0) {
        if (out && out_size > 1 && used < out_size - 1) {
            size_t room = out_size - 1 - used;
            size_t c = got < room ? got : room;
            memcpy(out + used, chunk, c);
            used += c;
            out[used] = '\0';
        }
    }
    int st = pclose(p);
    if (st == -1)
        return -1;
    if (WIFEXITED(st))
        return WEXITSTATUS(st);
    if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
    return -1;
}

int lm_fd_check_sampled(const char *name, float *t, const float *grad, int64_t n, int samples,
                        double step, uint64_t seed, double (*loss)(void *ctx), void *ctx, double tol) {
    const int m = n < samples ? (int)n : samples;
    float *an = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    double *fd = malloc(sizeof(double) * (size_t)(m > 0 ? m : 1));
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int s = 0; s < m; s++) {
        const int64_t i = n <= samples ? s : (int64_t)(lm_rng_uniform(&r) * (double)n);
        const float w0 = t[i];
        const float wp = (float)(w0 + step), wm = (float)(w0 - step);
        t[i] = wp;
        const double lp = loss(ctx);
        t[i] = wm;
        const double lmn = loss(ctx);
        t[i] = w0;
        fd[s] = (lp - lmn) / ((double)wp - (double)wm);
        an[s] = grad[i];
    }
    char label[128];
    snprintf(label, sizeof label, "  FD %s", name);
    const int ok = lm_check_f32(label, an, fd, m, tol);
    free(an);
    free(fd);
    return ok;
}
