/* test_backend_ops family "swiglu": lm_cuda_swiglu_forward / _backward (the
 * element-wise step of the SwiGLU FFN on the [N, 2F] layout of lm_swiglu_forward's
 * `hidden`) against a plain fp64 loop of the same math (src/ops/swiglu.c has no
 * stand-alone element-wise op: swiglu_rows and the dg / du loop of lm_swiglu_backward)
 * on the same bf16 inputs.
 *
 * Shapes: F = 2688 (the dense FFN at hidden 1024) and 512 (an expert), F = 1000 (a
 * multiple of 8 that is not of 16), F = 1001 (the scalar path), N = 1 and 37. One case
 * runs the backward in place (dgu over gu) and one recomputes h in the backward.
 * Inputs reach |g| ~ 8 so that both sigmoid tails are exercised.
 *
 * Tolerances: h BO_TOL_FWD, dg / du BO_TOL_GRAD (bf16 rounding of the outputs, ~2e-3).
 */
#include <math.h>
#include <stdlib.h>

#include "bo.h"
#include "linmoe/cuda_layers.h"

static float *hbuf(int64_t n) { return LM_CALLOC((size_t)(n > 0 ? n : 1), sizeof(float)); }

typedef struct {
    int64_t N;
    int F, inplace, recompute_h;
} scase;

static void swiglu_case(bo_ctx *c, const scase *k) {
    const int64_t N = k->N, F = k->F, nh = N * F, ng = 2 * nh;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld F=%d%s%s", (long long)N, k->F, k->inplace ? " inpl" : "",
             k->recompute_h ? " h" : "");
    float *gu = hbuf(ng), *dh = hbuf(nh), *h = hbuf(nh), *dgu = hbuf(ng);
    float *gh = hbuf(nh), *gdgu = hbuf(ng), *gh2 = hbuf(nh);
    bo_fill_normal(c, gu, ng, 2.0f);
    bo_fill_normal(c, dh, nh, 1.0f);
    bo_round_bf16(gu, ng);
    bo_round_bf16(dh, nh);
    for (int64_t r = 0; r < N; r++)
        for (int64_t f = 0; f < F; f++) {
            const double g = gu[r * 2 * F + f], u = gu[r * 2 * F + F + f], d = dh[r * F + f];
            const double s = 1.0 / (1.0 + exp(-g));
            h[r * F + f] = (float)(g * s * u);
            dgu[r * 2 * F + f] = (float)(d * u * s * (1.0 + g * (1.0 - s)));
            dgu[r * 2 * F + F + f] = (float)(d * g * s);
        }
    lm_error e = {0};
    void *dgud = bo_upload_bf16(c, gu, ng, &e);
    void *dhd = bo_upload_bf16(c, dh, nh, &e);
    void *dho = bo_alloc_poisoned(c, (size_t)nh * 2, &e);
    void *dh2 = k->recompute_h ? bo_alloc_poisoned(c, (size_t)nh * 2, &e) : NULL;
    void *ddgu = k->inplace ? dgud : bo_alloc_poisoned(c, (size_t)ng * 2, &e);
    if (!dgud || !dhd || !dho || (k->recompute_h && !dh2) || !ddgu) {
        bo_fail(c, "swiglu", shape, &e);
        goto out;
    }
    if (lm_cuda_swiglu_forward(c->cuda, N, k->F, dgud, dho, &e) != LM_OK ||
        lm_cuda_swiglu_backward(c->cuda, N, k->F, dgud, dhd, ddgu, dh2, &e) != LM_OK ||
        bo_download_bf16(c, gh, dho, nh, &e) != LM_OK ||
        bo_download_bf16(c, gdgu, ddgu, ng, &e) != LM_OK ||
        (k->recompute_h && bo_download_bf16(c, gh2, dh2, nh, &e) != LM_OK)) {
        bo_fail(c, "swiglu", shape, &e);
        goto out;
    }
    bo_check(c, "swiglu", "bf16", shape, "h", gh, h, nh, BO_TOL_FWD);
    if (k->recompute_h)
        bo_check(c, "swiglu", "bf16", shape, "h (bwd)", gh2, h, nh, BO_TOL_FWD);
    /* dg and du separately: they differ in scale */
    float *a = hbuf(nh), *b = hbuf(nh);
    for (int half = 0; half < 2; half++) {
        for (int64_t r = 0; r < N; r++)
            for (int64_t f = 0; f < F; f++) {
                a[r * F + f] = gdgu[r * 2 * F + half * F + f];
                b[r * F + f] = dgu[r * 2 * F + half * F + f];
            }
        bo_check(c, "swiglu", "bf16", shape, half ? "du" : "dg", a, b, nh, BO_TOL_GRAD);
    }
    free(a), free(b);
out:
    bo_free(c, dgud);
    bo_free(c, dhd);
    bo_free(c, dho);
    bo_free(c, dh2);
    if (!k->inplace)
        bo_free(c, ddgu);
    free(gu), free(dh), free(h), free(dgu), free(gh), free(gdgu), free(gh2);
}

int bo_family_swiglu(bo_ctx *c) {
    const int failed0 = c->failed;
    const scase sc[] = {
        {1, 512, 0, 0},   {37, 2688, 0, 1}, {37, 1000, 1, 0},
        {37, 1001, 0, 1}, {300, 512, 1, 1}, {5, 3, 0, 0},
    };
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++)
        swiglu_case(c, &sc[i]);
    return c->failed - failed0;
}
