/* test_backend_ops family "dispatch": the dispatched op API (include/linmoe/ops.h) run on
 * the CPU (fp32, lm_backend cpu: the reference ops behind it) and on CUDA (bf16,
 * lm_backend {cuda, c->cuda}) with the same bf16-rounded inputs, through the same calls
 * and the same lm_tensor arguments except for dtype and device. Checks that the
 * dispatcher wires every argument of the CUDA entry point (a swapped or dropped pointer
 * fails) and that both devices honour one gradient contract: weight gradients (RMSNorm
 * dweight, AttnRes dquery / drms_weight) and AttnRes dsrc ACCUMULATE into a random
 * prefill on both.
 *
 * Ops: RMSNorm forward + backward (with rstd), SwiGLU forward + backward (h recomputed),
 * AttnRes forward + backward (L = 3, one dsrc not wanted). Shapes: D a multiple of 8 (the
 * vector paths) and not (the scalar paths), N odd.
 * Tolerances: forward BO_TOL_FWD; dx, dgu, dsrc BO_TOL_GRAD; rstd 1e-5 (fp32 sums);
 * dweight 1e-4 (fp32 vs fp64 sums of the same products, as family "norm"); dquery,
 * drms_weight BO_TOL_GATE_GRAD.
 */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/ops.h"

#define TOL_RSTD 1e-5
#define TOL_DW 1e-4

static float *hb(bo_ctx *c, int64_t n, float s) {
    float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    bo_fill_normal(c, x, n, s);
    bo_round_bf16(x, n);
    return x;
}

static float *hz(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

static lm_tensor t2(void *p, lm_dtype dt, int64_t a, int64_t b, lm_device d) {
    return lm_tensor_make_on(p, dt, 2, (const int64_t[]){a, b}, d);
}
static lm_tensor t1(void *p, lm_dtype dt, int64_t a, lm_device d) {
    return lm_tensor_make_on(p, dt, 1, (const int64_t[]){a}, d);
}

static const lm_device CPUD = {LM_DEVICE_CPU, 0};

static lm_backend gpu_backend(bo_ctx *c) {
    const lm_backend be = {{LM_DEVICE_CUDA, lm_cuda_ctx_device(c->cuda)}, c->cuda};
    return be;
}

/* ---------------------------------------------------------------- RMSNorm */

static void rmsnorm_case(bo_ctx *c, int64_t N, int64_t D) {
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld D=%lld", (long long)N, (long long)D);
    const char *op = "op_rmsnorm";
    const float eps = 1e-6f;
    const lm_backend cpu = {CPUD, NULL}, gpu = gpu_backend(c);
    const lm_device gd = gpu.device;
    const int64_t n = N * D;
    float *x = hb(c, n, 1), *w = hb(c, D, 1), *dy = hb(c, n, 1), *pre = hb(c, D, 1);
    float *y = hz(n), *rs = hz(N), *dx = hz(n), *dw = malloc((size_t)D * sizeof(float));
    float *gy = hz(n), *grs = hz(N), *gdx = hz(n), *gdw = hz(D);
    memcpy(dw, pre, (size_t)D * sizeof(float));
    lm_error e = {0};
    /* CPU reference through the dispatcher */
    lm_tensor cx = t2(x, LM_F32, N, D, CPUD), cw = t1(w, LM_F32, D, CPUD),
              cy = t2(y, LM_F32, N, D, CPUD), cr = t1(rs, LM_F32, N, CPUD),
              cdy = t2(dy, LM_F32, N, D, CPUD), cdx = t2(dx, LM_F32, N, D, CPUD),
              cdw = t1(dw, LM_F32, D, CPUD);
    if (lm_op_rmsnorm_forward(&cpu, eps, &cx, NULL, &cw, NULL, &cy, &cr, &e) != LM_OK ||
        lm_op_rmsnorm_backward(&cpu, eps, &cx, &cw, &cr, &cdy, NULL, &cdx, &cdw, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out_host;
    }
    void *dxp = bo_upload_bf16(c, x, n, &e), *dwp = bo_upload_bf16(c, w, D, &e),
         *ddy = bo_upload_bf16(c, dy, n, &e);
    void *dyo = bo_alloc_poisoned(c, (size_t)n * 2, &e),
         *drs = bo_alloc_poisoned(c, (size_t)N * 4, &e),
         *ddx = bo_alloc_poisoned(c, (size_t)n * 2, &e);
    float *ddw = bo_upload_f32(c, pre, D, &e);
    if (!dxp || !dwp || !ddy || !dyo || !drs || !ddx || !ddw) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    lm_tensor gx = t2(dxp, LM_BF16, N, D, gd), gw = t1(dwp, LM_BF16, D, gd),
              gyt = t2(dyo, LM_BF16, N, D, gd), gr = t1(drs, LM_F32, N, gd),
              gdy = t2(ddy, LM_BF16, N, D, gd), gdxt = t2(ddx, LM_BF16, N, D, gd),
              gdwt = t1(ddw, LM_F32, D, gd);
    if (lm_op_rmsnorm_forward(&gpu, eps, &gx, NULL, &gw, NULL, &gyt, &gr, &e) != LM_OK ||
        lm_op_rmsnorm_backward(&gpu, eps, &gx, &gw, &gr, &gdy, NULL, &gdxt, &gdwt, &e) != LM_OK ||
        bo_download_bf16(c, gy, dyo, n, &e) != LM_OK ||
        bo_download_f32(c, grs, drs, N, &e) != LM_OK ||
        bo_download_bf16(c, gdx, ddx, n, &e) != LM_OK ||
        bo_download_f32(c, gdw, ddw, D, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    bo_check(c, op, "bf16", shape, "y", gy, y, n, BO_TOL_FWD);
    bo_check(c, op, "f32", shape, "rstd", grs, rs, N, TOL_RSTD);
    bo_check(c, op, "bf16", shape, "dx", gdx, dx, n, BO_TOL_GRAD);
    bo_check(c, op, "f32", shape, "dweight (+=)", gdw, dw, D, TOL_DW);
out:
    bo_free(c, dxp), bo_free(c, dwp), bo_free(c, ddy), bo_free(c, dyo), bo_free(c, drs);
    bo_free(c, ddx), bo_free(c, ddw);
out_host:
    free(x), free(w), free(dy), free(pre), free(y), free(rs), free(dx), free(dw);
    free(gy), free(grs), free(gdx), free(gdw);
}

/* ---------------------------------------------------------------- SwiGLU */

static void swiglu_case(bo_ctx *c, int64_t N, int64_t F) {
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld F=%lld", (long long)N, (long long)F);
    const char *op = "op_swiglu";
    const lm_backend cpu = {CPUD, NULL}, gpu = gpu_backend(c);
    const lm_device gd = gpu.device;
    const int64_t ng = N * 2 * F, nh = N * F;
    float *gu = hb(c, ng, 1.5f), *dh = hb(c, nh, 1), *h = hz(nh), *dgu = hz(ng), *h2 = hz(nh);
    float *gh = hz(nh), *gdgu = hz(ng), *gh2 = hz(nh);
    lm_error e = {0};
    lm_tensor cgu = t2(gu, LM_F32, N, 2 * F, CPUD), ch = t2(h, LM_F32, N, F, CPUD),
              cdh = t2(dh, LM_F32, N, F, CPUD), cdgu = t2(dgu, LM_F32, N, 2 * F, CPUD),
              ch2 = t2(h2, LM_F32, N, F, CPUD);
    if (lm_op_swiglu_forward(&cpu, &cgu, &ch, &e) != LM_OK ||
        lm_op_swiglu_backward(&cpu, &cgu, &cdh, &cdgu, &ch2, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out_host;
    }
    void *dgup = bo_upload_bf16(c, gu, ng, &e), *ddh = bo_upload_bf16(c, dh, nh, &e);
    void *dho = bo_alloc_poisoned(c, (size_t)nh * 2, &e),
         *ddgu = bo_alloc_poisoned(c, (size_t)ng * 2, &e),
         *dh2 = bo_alloc_poisoned(c, (size_t)nh * 2, &e);
    if (!dgup || !ddh || !dho || !ddgu || !dh2) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    lm_tensor ggu = t2(dgup, LM_BF16, N, 2 * F, gd), gh_t = t2(dho, LM_BF16, N, F, gd),
              gdh = t2(ddh, LM_BF16, N, F, gd), gdgu_t = t2(ddgu, LM_BF16, N, 2 * F, gd),
              gh2_t = t2(dh2, LM_BF16, N, F, gd);
    if (lm_op_swiglu_forward(&gpu, &ggu, &gh_t, &e) != LM_OK ||
        lm_op_swiglu_backward(&gpu, &ggu, &gdh, &gdgu_t, &gh2_t, &e) != LM_OK ||
        bo_download_bf16(c, gh, dho, nh, &e) != LM_OK ||
        bo_download_bf16(c, gdgu, ddgu, ng, &e) != LM_OK ||
        bo_download_bf16(c, gh2, dh2, nh, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    bo_check(c, op, "bf16", shape, "h", gh, h, nh, BO_TOL_FWD);
    bo_check(c, op, "bf16", shape, "h (bwd)", gh2, h2, nh, BO_TOL_FWD);
    bo_check(c, op, "bf16", shape, "dgu", gdgu, dgu, ng, BO_TOL_GRAD);
out:
    bo_free(c, dgup), bo_free(c, ddh), bo_free(c, dho), bo_free(c, ddgu), bo_free(c, dh2);
out_host:
    free(gu), free(dh), free(h), free(dgu), free(h2), free(gh), free(gdgu), free(gh2);
}

/* ---------------------------------------------------------------- AttnRes */

enum { AR_L = 3 };

static void attnres_case(bo_ctx *c, int64_t N, int D) {
    char shape[64];
    snprintf(shape, sizeof shape, "L=%d N=%lld D=%d", AR_L, (long long)N, D);
    const char *op = "op_attnres";
    const lm_backend cpu = {CPUD, NULL}, gpu = gpu_backend(c);
    const lm_device gd = gpu.device;
    const int64_t n = N * D;
    lm_attnres_config ac;
    lm_attnres_config_default(&ac, AR_L, N, D);
    float *src[AR_L], *dsrc[AR_L], *gdsrc[AR_L];
    void *dsrcp[AR_L] = {0}, *ddsrc[AR_L] = {0};
    lm_tensor cs[AR_L], cds[AR_L], gs[AR_L], gds[AR_L];
    float *q = hb(c, D, 0.5f), *gw = hb(c, D, 1), *dO = hb(c, n, 1), *o = hz(n), *go = hz(n);
    float *dq = hb(c, D, 1), *dg = hb(c, D, 1), *pq = malloc((size_t)D * 4),
          *pg = malloc((size_t)D * 4), *gdq = hz(D), *gdg = hz(D);
    memcpy(pq, dq, (size_t)D * 4);
    memcpy(pg, dg, (size_t)D * 4);
    void *dqp = NULL, *dgp = NULL, *ddo = NULL, *dop = NULL, *ddq = NULL, *ddg = NULL;
    lm_error e = {0};
    for (int m = 0; m < AR_L; m++) {
        src[m] = hb(c, n, 1.0f + 0.5f * (float)m);
        dsrc[m] = hb(c, n, 1); /* the prefill the gradient adds to */
        gdsrc[m] = hz(n);
        cs[m] = t2(src[m], LM_F32, N, D, CPUD);
        cds[m] = t2(dsrc[m], LM_F32, N, D, CPUD);
    }
    cds[1].data = NULL; /* not wanted */
    /* upload the prefills before the CPU reference adds into them */
    int ok = 1;
    for (int m = 0; m < AR_L; m++) {
        dsrcp[m] = bo_upload_bf16(c, src[m], n, &e);
        ddsrc[m] = m == 1 ? NULL : bo_upload_bf16(c, dsrc[m], n, &e);
        ok = ok && dsrcp[m] && (m == 1 || ddsrc[m]);
        gs[m] = t2(dsrcp[m], LM_BF16, N, D, gd);
        gds[m] = t2(ddsrc[m], LM_BF16, N, D, gd);
    }
    dqp = bo_upload_f32(c, q, D, &e), dgp = bo_upload_f32(c, gw, D, &e);
    ddo = bo_upload_bf16(c, dO, n, &e), dop = bo_alloc_poisoned(c, (size_t)n * 2, &e);
    ddq = bo_upload_f32(c, dq, D, &e), ddg = bo_upload_f32(c, dg, D, &e);
    if (!ok || !dqp || !dgp || !ddo || !dop || !ddq || !ddg) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    lm_tensor cq = t1(q, LM_F32, D, CPUD), cg = t1(gw, LM_F32, D, CPUD),
              cdo = t2(dO, LM_F32, N, D, CPUD), co = t2(o, LM_F32, N, D, CPUD),
              cdq = t1(dq, LM_F32, D, CPUD), cdg = t1(dg, LM_F32, D, CPUD);
    if (lm_op_attnres_forward(&cpu, &ac, cs, &cq, &cg, &co, &e) != LM_OK ||
        lm_op_attnres_backward(&cpu, &ac, cs, &cq, &cg, &cdo, cds, &cdq, &cdg, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    lm_tensor gq = t1(dqp, LM_F32, D, gd), gg = t1(dgp, LM_F32, D, gd),
              gdo = t2(ddo, LM_BF16, N, D, gd), got = t2(dop, LM_BF16, N, D, gd),
              gdq_t = t1(ddq, LM_F32, D, gd), gdg_t = t1(ddg, LM_F32, D, gd);
    if (lm_op_attnres_forward(&gpu, &ac, gs, &gq, &gg, &got, &e) != LM_OK ||
        lm_op_attnres_backward(&gpu, &ac, gs, &gq, &gg, &gdo, gds, &gdq_t, &gdg_t, &e) != LM_OK ||
        bo_download_bf16(c, go, dop, n, &e) != LM_OK ||
        bo_download_f32(c, gdq, ddq, D, &e) != LM_OK ||
        bo_download_f32(c, gdg, ddg, D, &e) != LM_OK) {
        bo_fail(c, op, shape, &e);
        goto out;
    }
    for (int m = 0; m < AR_L; m++)
        if (ddsrc[m] && bo_download_bf16(c, gdsrc[m], ddsrc[m], n, &e) != LM_OK) {
            bo_fail(c, op, shape, &e);
            goto out;
        }
    bo_check(c, op, "bf16", shape, "o", go, o, n, BO_TOL_FWD);
    bo_check(c, op, "bf16", shape, "dsrc[0] (+=)", gdsrc[0], dsrc[0], n, BO_TOL_GRAD);
    bo_check(c, op, "bf16", shape, "dsrc[2] (+=)", gdsrc[2], dsrc[2], n, BO_TOL_GRAD);
    /* the gradient part alone (prefill removed) is what the tolerance is about */
    for (int64_t i = 0; i < D; i++)
        gdq[i] -= pq[i], dq[i] -= pq[i], gdg[i] -= pg[i], dg[i] -= pg[i];
    bo_check(c, op, "f32", shape, "dquery (+=)", gdq, dq, D, BO_TOL_GATE_GRAD);
    bo_check(c, op, "f32", shape, "drms_weight (+=)", gdg, dg, D, BO_TOL_GATE_GRAD);
out:
    for (int m = 0; m < AR_L; m++) {
        bo_free(c, dsrcp[m]), bo_free(c, ddsrc[m]);
        free(src[m]), free(dsrc[m]), free(gdsrc[m]);
    }
    bo_free(c, dqp), bo_free(c, dgp), bo_free(c, ddo), bo_free(c, dop), bo_free(c, ddq);
    bo_free(c, ddg);
    free(q), free(gw), free(dO), free(o), free(go), free(dq), free(dg), free(pq), free(pg);
    free(gdq), free(gdg);
}

int bo_family_dispatch(bo_ctx *c) {
    const int failed0 = c->failed;
    rmsnorm_case(c, 37, 1024);
    rmsnorm_case(c, 301, 1000);
    swiglu_case(c, 37, 2048);
    swiglu_case(c, 5, 3);
    attnres_case(c, 37, 1024);
    attnres_case(c, 129, 100);
    return c->failed - failed0;
}
