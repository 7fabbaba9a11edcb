/* One op API per op, dispatching on the tensors' device (include/linmoe/ops.h): argument
 * checks common to both devices, then the CPU reference op or the CUDA op, with the
 * CPU-side glue that makes both honour one contract (weight gradients accumulate). */
#include "linmoe/ops.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layers_internal.h" /* lm_layers_sigmoid: swiglu.c's formula */
#include "linmoe/cuda_attention.h"
#include "linmoe/cuda_attnres.h"
#include "linmoe/cuda_gemm.h"
#include "linmoe/cuda_layers.h"
#include "linmoe/kda_cuda.h"

/* ---------------------------------------------------------------- checks */

static int on_cuda(const lm_backend *be) { return be->device.type == LM_DEVICE_CUDA; }

/* The float dtype of activations and weights' working copy on the backend's device. */
static lm_dtype act_dt(const lm_backend *be) { return on_cuda(be) ? LM_BF16 : LM_F32; }

static void *dp(const lm_tensor *t) { return t ? t->data : NULL; }

static lm_status check_backend(const char *op, const lm_backend *be, lm_op id, const void *cfg,
                               lm_error *err) {
    if (!be)
        return lm_errorf(err, LM_ERR_INVALID, "%s: backend is NULL", op);
    if (be->device.type == LM_DEVICE_CPU)
        return LM_OK;
    if (be->device.type != LM_DEVICE_CUDA)
        return lm_errorf(err, LM_ERR_INVALID, "%s: unknown device type %d", op,
                         (int)be->device.type);
    LM_TRY(lm_backend_supports(be->device, id, cfg, err));
    if (!be->cuda)
        return lm_errorf(err, LM_ERR_INVALID, "%s: backend on cuda:%d has no CUDA context", op,
                         be->device.index);
    const int dev = lm_cuda_ctx_device(be->cuda);
    if (dev != be->device.index)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: backend device cuda:%d but its CUDA context is on cuda:%d", op,
                         be->device.index, dev);
    return LM_OK;
}

static int same_device(lm_device a, lm_device b) {
    if (a.type != b.type)
        return 0;
    return a.type == LM_DEVICE_CPU || a.index == b.index;
}

static void shape_text(char *buf, size_t size, int ndim, const int64_t *shape,
                       const char *const *dims) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, size - o, "[");
    for (int i = 0; i < ndim && o < size; i++) {
        if (dims)
            o += (size_t)snprintf(buf + o, size - o, "%s%s=%lld", i ? ", " : "", dims[i],
                                  (long long)shape[i]);
        else
            o += (size_t)snprintf(buf + o, size - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    }
    if (o < size)
        snprintf(buf + o, size - o, "]");
}

/* A tensor: present (unless optional), on the backend's device, of dtype dt, of the
 * expected shape (dim names for the message), contiguous. t == NULL: LM_OK when optional. */
static lm_status check_t(const char *op, const lm_backend *be, const lm_tensor *t, const char *name,
                         int required, lm_dtype dt, int ndim, const int64_t *shape,
                         const char *const *dims, lm_error *err) {
    if (!t) {
        if (required)
            return lm_errorf(err, LM_ERR_INVALID, "%s: tensor %s is missing (NULL)", op, name);
        return LM_OK;
    }
    if (!t->data)
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor %s has no data (NULL)", op, name);
    if (!same_device(t->device, be->device)) {
        char a[32], b[32];
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor %s is on %s, the backend is %s", op, name,
                         lm_device_name(t->device, a, sizeof a),
                         lm_device_name(be->device, b, sizeof b));
    }
    if (t->dtype != dt) {
        char b[32];
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor %s has dtype %s, expected %s on %s", op,
                         name, lm_dtype_name(t->dtype), lm_dtype_name(dt),
                         lm_device_name(be->device, b, sizeof b));
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = t->shape[i] == shape[i];
    if (!ok) {
        char got[256], want[256];
        shape_text(got, sizeof got, t->ndim < 0 || t->ndim > LM_MAX_DIMS ? 0 : t->ndim, t->shape,
                   NULL);
        shape_text(want, sizeof want, ndim, shape, dims);
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor %s has shape %s, expected %s", op, name,
                         got, want);
    }
    if (!lm_tensor_is_contiguous(t))
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor %s is not contiguous (row-major)", op,
                         name);
    return LM_OK;
}

/* Shorthands: S1..S4 build the expected shape and its dim names. */
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define DIMS(...) ((const char *const[]){__VA_ARGS__})
/* The tensor's own shape (a dim read from it); NULL when absent (check_t stops first). */
#define OWN(t) ((t) ? (t)->shape : NULL)
#define CHK(t, name, req, dt, nd, shp, dims)                                                       \
    LM_TRY(check_t(op, be, (t), (name), (req), (dt), (nd), shp, dims, err))

static lm_status nomem(const char *op, int64_t n, lm_error *err) {
    return lm_errorf(err, LM_ERR_NOMEM, "%s: cannot allocate %lld floats of scratch", op,
                     (long long)n);
}

static float *scratch_f32(int64_t n) { return (float *)malloc((size_t)(n > 0 ? n : 1) * 4); }

static void add_into(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        dst[i] += src[i];
}

/* ================================================================ embedding */

static lm_status cpu_check_ids(const char *op, const int32_t *ids, int64_t N, int64_t V,
                               lm_error *err) {
    for (int64_t n = 0; n < N; n++)
        if (ids[n] < 0 || ids[n] >= V)
            return lm_errorf(err, LM_ERR_INVALID, "%s: ids[%lld] = %d is outside [0, V=%lld)", op,
                             (long long)n, ids[n], (long long)V);
    return LM_OK;
}

lm_status lm_op_embedding_forward(const lm_backend *be, const lm_tensor *ids,
                                  const lm_tensor *weight, const lm_tensor *out, lm_error *err) {
    const char *op = "embedding forward";
    LM_TRY(check_backend(op, be, LM_OP_EMBEDDING, NULL, err));
    CHK(weight, "weight", 1, act_dt(be), 2, OWN(weight), DIMS("V", "D"));
    const int64_t V = weight->shape[0], D = weight->shape[1];
    CHK(ids, "ids", 1, LM_I32, 1, OWN(ids), DIMS("N"));
    const int64_t N = ids->shape[0];
    CHK(out, "out", 1, act_dt(be), 2, SHAPE(N, D), DIMS("N", "D"));
    if (on_cuda(be))
        return lm_cuda_embedding_forward(be->cuda, N, (int)V, (int)D, ids->data, weight->data,
                                         out->data, NULL, err);
    const int32_t *id = ids->data;
    LM_TRY(cpu_check_ids(op, id, N, V, err));
    const float *w = weight->data;
    float *o = out->data;
    for (int64_t n = 0; n < N; n++)
        memcpy(o + n * D, w + (int64_t)id[n] * D, (size_t)D * sizeof(float));
    return LM_OK;
}

lm_status lm_op_embedding_backward(const lm_backend *be, const lm_tensor *ids,
                                   const lm_tensor *dout, const lm_tensor *dweight, lm_error *err) {
    const char *op = "embedding backward";
    LM_TRY(check_backend(op, be, LM_OP_EMBEDDING, NULL, err));
    CHK(dweight, "dweight", 1, LM_F32, 2, OWN(dweight), DIMS("V", "D"));
    const int64_t V = dweight->shape[0], D = dweight->shape[1];
    CHK(ids, "ids", 1, LM_I32, 1, OWN(ids), DIMS("N"));
    const int64_t N = ids->shape[0];
    CHK(dout, "dout", 1, act_dt(be), 2, SHAPE(N, D), DIMS("N", "D"));
    if (on_cuda(be))
        return lm_cuda_embedding_backward(be->cuda, N, (int)V, (int)D, ids->data, dout->data,
                                          dweight->data, err);
    const int32_t *id = ids->data;
    LM_TRY(cpu_check_ids(op, id, N, V, err));
    const float *g = dout->data;
    float *dW = dweight->data;
    /* src/model/model.c's scatter: fixed token order per column (parallel over columns) */
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < D; j++)
        for (int64_t n = 0; n < N; n++)
            dW[(int64_t)id[n] * D + j] += g[n * D + j];
    return LM_OK;
}

/* ================================================================ RMSNorm */

/* The weight / rstd / output checks of a row norm over [N, D]. */
lm_status lm_op_rmsnorm_forward(const lm_backend *be, float eps, const lm_tensor *x,
                                const lm_tensor *residual, const lm_tensor *weight,
                                const lm_tensor *h, const lm_tensor *y, const lm_tensor *rstd,
                                lm_error *err) {
    const char *op = "rmsnorm forward";
    LM_TRY(check_backend(op, be, LM_OP_RMSNORM, NULL, err));
    const lm_dtype a = act_dt(be);
    CHK(x, "x", 1, a, 2, OWN(x), DIMS("N", "D"));
    const int64_t N = x->shape[0], D = x->shape[1];
    const char *const *nd = DIMS("N", "D");
    CHK(residual, "residual", 0, a, 2, SHAPE(N, D), nd);
    CHK(weight, "weight", 0, a, 1, SHAPE(D), DIMS("D"));
    CHK(h, "h", residual != NULL, a, 2, SHAPE(N, D), nd);
    CHK(y, "y", 1, a, 2, SHAPE(N, D), nd);
    CHK(rstd, "rstd", 0, LM_F32, 1, SHAPE(N), DIMS("N"));
    if (on_cuda(be))
        return lm_cuda_rmsnorm_forward(be->cuda, N, (int)D, eps, x->data, dp(residual), dp(weight),
                                       residual ? h->data : NULL, y->data, dp(rstd), err);
    const float *in = x->data;
    if (residual) {
        if (y->data == x->data || y->data == residual->data || y->data == h->data)
            return lm_errorf(err, LM_ERR_INVALID, "%s: tensor y aliases x, residual or h", op);
        const float *r = residual->data;
        float *hh = h->data;
        for (int64_t i = 0; i < N * D; i++)
            hh[i] = in[i] + r[i];
        in = hh;
    }
    return lm_rmsnorm_forward(N, (int)D, eps, in, dp(weight), y->data, dp(rstd), err);
}

lm_status lm_op_rmsnorm_backward(const lm_backend *be, float eps, const lm_tensor *x,
                                 const lm_tensor *weight, const lm_tensor *rstd,
                                 const lm_tensor *dy, const lm_tensor *dresidual,
                                 const lm_tensor *dx, const lm_tensor *dweight, lm_error *err) {
    const char *op = "rmsnorm backward";
    LM_TRY(check_backend(op, be, LM_OP_RMSNORM, NULL, err));
    const lm_dtype a = act_dt(be);
    CHK(x, "x", 1, a, 2, OWN(x), DIMS("N", "D"));
    const int64_t N = x->shape[0], D = x->shape[1];
    const char *const *nd = DIMS("N", "D");
    CHK(weight, "weight", 0, a, 1, SHAPE(D), DIMS("D"));
    CHK(rstd, "rstd", 0, LM_F32, 1, SHAPE(N), DIMS("N"));
    CHK(dy, "dy", 1, a, 2, SHAPE(N, D), nd);
    CHK(dresidual, "dresidual", 0, a, 2, SHAPE(N, D), nd);
    CHK(dx, "dx", 0, a, 2, SHAPE(N, D), nd);
    CHK(dweight, "dweight", 0, LM_F32, 1, SHAPE(D), DIMS("D"));
    if (on_cuda(be))
        return lm_cuda_rmsnorm_backward(be->cuda, N, (int)D, eps, x->data, dp(weight), dp(rstd),
                                        dy->data, dp(dresidual), dp(dx), dp(dweight), err);
    float *dw = weight && dweight ? scratch_f32(D) : NULL;
    float *dxs = dx && dresidual ? scratch_f32(N * D) : NULL;
    lm_status st = LM_OK;
    if ((weight && dweight && !dw) || (dx && dresidual && !dxs))
        st = nomem(op, N * D + D, err);
    if (st == LM_OK)
        st = lm_rmsnorm_backward(N, (int)D, eps, x->data, dp(weight), dp(rstd), dy->data,
                                 dxs ? dxs : dp(dx), dw, err);
    if (st == LM_OK && dxs) {
        const float *r = dresidual->data;
        float *o = dx->data;
        for (int64_t i = 0; i < N * D; i++)
            o[i] = dxs[i] + r[i];
    }
    if (st == LM_OK && dw)
        add_into(dweight->data, dw, D);
    free(dw);
    free(dxs);
    return st;
}

/* ================================================================ gated RMSNorm */

lm_status lm_op_gated_rmsnorm_forward(const lm_backend *be, float eps, const lm_tensor *x,
                                      const lm_tensor *gate, const lm_tensor *weight,
                                      const lm_tensor *o, const lm_tensor *rstd, lm_error *err) {
    const char *op = "gated_rmsnorm forward";
    LM_TRY(check_backend(op, be, LM_OP_GATED_RMSNORM, NULL, err));
    const lm_dtype a = act_dt(be);
    const char *const *nhd = DIMS("N", "H", "Dh");
    CHK(x, "x", 1, a, 3, OWN(x), nhd);
    const int64_t N = x->shape[0], H = x->shape[1], Dh = x->shape[2];
    CHK(gate, "gate", 1, a, 3, SHAPE(N, H, Dh), nhd);
    CHK(weight, "weight", 0, a, 1, SHAPE(Dh), DIMS("Dh"));
    CHK(o, "o", 1, a, 3, SHAPE(N, H, Dh), nhd);
    CHK(rstd, "rstd", 0, LM_F32, 2, SHAPE(N, H), DIMS("N", "H"));
    if (on_cuda(be))
        return lm_cuda_gated_rmsnorm_forward(be->cuda, N, (int)H, (int)Dh, eps, x->data, gate->data,
                                             dp(weight), o->data, dp(rstd), err);
    return lm_gated_rmsnorm_forward(N, (int)H, (int)Dh, eps, x->data, gate->data, dp(weight),
                                    o->data, dp(rstd), err);
}

lm_status lm_op_gated_rmsnorm_backward(const lm_backend *be, float eps, const lm_tensor *x,
                                       const lm_tensor *gate, const lm_tensor *weight,
                                       const lm_tensor *rstd, const lm_tensor *do_,
                                       const lm_tensor *dx, const lm_tensor *dgate,
                                       const lm_tensor *dweight, lm_error *err) {
    const char *op = "gated_rmsnorm backward";
    LM_TRY(check_backend(op, be, LM_OP_GATED_RMSNORM, NULL, err));
    const lm_dtype a = act_dt(be);
    const char *const *nhd = DIMS("N", "H", "Dh");
    CHK(x, "x", 1, a, 3, OWN(x), nhd);
    const int64_t N = x->shape[0], H = x->shape[1], Dh = x->shape[2];
    CHK(gate, "gate", 1, a, 3, SHAPE(N, H, Dh), nhd);
    CHK(weight, "weight", 0, a, 1, SHAPE(Dh), DIMS("Dh"));
    CHK(rstd, "rstd", 0, LM_F32, 2, SHAPE(N, H), DIMS("N", "H"));
    CHK(do_, "do", 1, a, 3, SHAPE(N, H, Dh), nhd);
    CHK(dx, "dx", 0, a, 3, SHAPE(N, H, Dh), nhd);
    CHK(dgate, "dgate", 0, a, 3, SHAPE(N, H, Dh), nhd);
    CHK(dweight, "dweight", 0, LM_F32, 1, SHAPE(Dh), DIMS("Dh"));
    if (on_cuda(be))
        return lm_cuda_gated_rmsnorm_backward(be->cuda, N, (int)H, (int)Dh, eps, x->data,
                                              gate->data, dp(weight), dp(rstd), do_->data, dp(dx),
                                              dp(dgate), dp(dweight), err);
    float *dw = weight && dweight ? scratch_f32(Dh) : NULL;
    if (weight && dweight && !dw)
        return nomem(op, Dh, err);
    lm_status st =
        lm_gated_rmsnorm_backward(N, (int)H, (int)Dh, eps, x->data, gate->data, dp(weight),
                                  dp(rstd), do_->data, dp(dx), dp(dgate), dw, err);
    if (st == LM_OK && dw)
        add_into(dweight->data, dw, Dh);
    free(dw);
    return st;
}

/* ================================================================ short convolution */

/* Sequences of the config before the op's own validation (N for the state shapes). */
static lm_status conv_seqs(const char *op, const int64_t *cu, int n_cu, int B, int64_t *N,
                           lm_error *err) {
    if (!cu) {
        *N = B;
        return LM_OK;
    }
    if (n_cu < 2)
        return lm_errorf(err, LM_ERR_INVALID, "%s: n_cu_seqlens = %d (at least 2 with cu_seqlens)",
                         op, n_cu);
    *N = n_cu - 1;
    return LM_OK;
}

static lm_status short_conv_check(const char *op, const lm_backend *be,
                                  const lm_short_conv_config *c, const lm_tensor *x,
                                  const lm_tensor *weight, const lm_tensor *initial_state,
                                  lm_error *err) {
    int64_t N = 0;
    LM_TRY(conv_seqs(op, c->cu_seqlens, c->n_cu_seqlens, c->B, &N, err));
    const lm_dtype a = act_dt(be);
    CHK(x, "x", 1, a, 3, SHAPE(c->B, c->T, c->C), DIMS("B", "T", "C"));
    CHK(weight, "weight", 1, a, 2, SHAPE(c->C, c->W), DIMS("C", "W"));
    CHK(initial_state, "initial_state", 0, LM_F32, 3, SHAPE(N, c->C, c->W - 1),
        DIMS("N", "C", "W-1"));
    return LM_OK;
}

lm_status lm_op_short_conv_forward(const lm_backend *be, lm_short_conv_config *c,
                                   const lm_tensor *x, const lm_tensor *weight,
                                   const lm_tensor *initial_state, const lm_tensor *y,
                                   const lm_tensor *final_state, lm_error *err) {
    const char *op = "short_conv forward";
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    LM_TRY(check_backend(op, be, LM_OP_SHORT_CONV, c, err));
    LM_TRY(short_conv_check(op, be, c, x, weight, initial_state, err));
    int64_t N = 0;
    LM_TRY(conv_seqs(op, c->cu_seqlens, c->n_cu_seqlens, c->B, &N, err));
    CHK(y, "y", 1, act_dt(be), 3, SHAPE(c->B, c->T, c->C), DIMS("B", "T", "C"));
    CHK(final_state, "final_state", 0, LM_F32, 3, SHAPE(N, c->C, c->W - 1), DIMS("N", "C", "W-1"));
    if (on_cuda(be))
        return lm_cuda_short_conv_forward(be->cuda, c, x->data, weight->data, dp(initial_state),
                                          y->data, dp(final_state), err);
    return lm_short_conv_forward(c, x->data, weight->data, dp(initial_state), y->data,
                                 dp(final_state), err);
}

lm_status lm_op_short_conv_backward(const lm_backend *be, lm_short_conv_config *c,
                                    const lm_tensor *x, const lm_tensor *weight,
                                    const lm_tensor *initial_state, const lm_tensor *dy,
                                    const lm_tensor *dx, const lm_tensor *dweight,
                                    const lm_tensor *dinitial_state, lm_error *err) {
    const char *op = "short_conv backward";
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    LM_TRY(check_backend(op, be, LM_OP_SHORT_CONV, c, err));
    LM_TRY(short_conv_check(op, be, c, x, weight, initial_state, err));
    int64_t N = 0;
    LM_TRY(conv_seqs(op, c->cu_seqlens, c->n_cu_seqlens, c->B, &N, err));
    const lm_dtype a = act_dt(be);
    CHK(dy, "dy", 1, a, 3, SHAPE(c->B, c->T, c->C), DIMS("B", "T", "C"));
    CHK(dx, "dx", 0, a, 3, SHAPE(c->B, c->T, c->C), DIMS("B", "T", "C"));
    CHK(dweight, "dweight", 0, LM_F32, 2, SHAPE(c->C, c->W), DIMS("C", "W"));
    CHK(dinitial_state, "dinitial_state", 0, LM_F32, 3, SHAPE(N, c->C, c->W - 1),
        DIMS("N", "C", "W-1"));
    if (on_cuda(be))
        return lm_cuda_short_conv_backward(be->cuda, c, x->data, weight->data, dp(initial_state),
                                           dy->data, dp(dx), dp(dweight), dp(dinitial_state), err);
    const int64_t nw = (int64_t)c->C * c->W;
    float *dw = dweight ? scratch_f32(nw) : NULL;
    if (dweight && !dw)
        return nomem(op, nw, err);
    lm_status st = lm_short_conv_backward(c, x->data, weight->data, dp(initial_state), dy->data,
                                          dp(dx), dw, dp(dinitial_state), err);
    if (st == LM_OK && dw)
        add_into(dweight->data, dw, nw);
    free(dw);
    return st;
}

/* ================================================================ SwiGLU */

lm_status lm_op_swiglu_forward(const lm_backend *be, const lm_tensor *gu, const lm_tensor *h,
                               lm_error *err) {
    const char *op = "swiglu forward";
    LM_TRY(check_backend(op, be, LM_OP_SWIGLU, NULL, err));
    const lm_dtype a = act_dt(be);
    CHK(gu, "gu", 1, a, 2, OWN(gu), DIMS("N", "2F"));
    const int64_t N = gu->shape[0], F = gu->shape[1] / 2;
    if (gu->shape[1] % 2 != 0 || F < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor gu has %lld columns (2F, F >= 1)", op,
                         (long long)gu->shape[1]);
    CHK(h, "h", 1, a, 2, SHAPE(N, F), DIMS("N", "F"));
    if (on_cuda(be))
        return lm_cuda_swiglu_forward(be->cuda, N, (int)F, gu->data, h->data, err);
    const float *x = gu->data;
    float *o = h->data;
    for (int64_t n = 0; n < N; n++) {
        const float *g = x + n * 2 * F, *u = g + F;
        float *a_ = o + n * F;
        for (int64_t c = 0; c < F; c++)
            a_[c] = g[c] * lm_layers_sigmoid(g[c]) * u[c];
    }
    return LM_OK;
}

lm_status lm_op_swiglu_backward(const lm_backend *be, const lm_tensor *gu, const lm_tensor *dh,
                                const lm_tensor *dgu, const lm_tensor *h, lm_error *err) {
    const char *op = "swiglu backward";
    LM_TRY(check_backend(op, be, LM_OP_SWIGLU, NULL, err));
    const lm_dtype a = act_dt(be);
    CHK(gu, "gu", 1, a, 2, OWN(gu), DIMS("N", "2F"));
    const int64_t N = gu->shape[0], F = gu->shape[1] / 2;
    if (gu->shape[1] % 2 != 0 || F < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor gu has %lld columns (2F, F >= 1)", op,
                         (long long)gu->shape[1]);
    CHK(dh, "dh", 1, a, 2, SHAPE(N, F), DIMS("N", "F"));
    CHK(dgu, "dgu", 1, a, 2, SHAPE(N, 2 * F), DIMS("N", "2F"));
    CHK(h, "h", 0, a, 2, SHAPE(N, F), DIMS("N", "F"));
    if (on_cuda(be))
        return lm_cuda_swiglu_backward(be->cuda, N, (int)F, gu->data, dh->data, dgu->data, dp(h),
                                       err);
    if (dgu->data == dh->data)
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor dgu aliases dh", op);
    const float *x = gu->data, *d = dh->data;
    float *o = dgu->data, *hh = dp(h);
    for (int64_t n = 0; n < N; n++) {
        const float *g = x + n * 2 * F, *u = g + F, *dr = d + n * F;
        float *dg = o + n * 2 * F, *du = dg + F;
        for (int64_t c = 0; c < F; c++) {
            const float gg = g[c], uu = u[c], s = lm_layers_sigmoid(gg), da = dr[c];
            if (hh)
                hh[n * F + c] = gg * s * uu;
            du[c] = da * gg * s;
            dg[c] = da * uu * (s * (1.0f + gg * (1.0f - s)));
        }
    }
    return LM_OK;
}

/* ================================================================ attention */

static lm_status attn_check(const char *op, const lm_backend *be, const lm_attention_config *c,
                            const lm_tensor *q, const lm_tensor *k, const lm_tensor *v,
                            const lm_tensor *o, const lm_tensor *lse, int need_lse, lm_error *err) {
    const lm_dtype a = act_dt(be);
    const char *const *bthq = DIMS("B", "T", "Hq", "D"), *const *bthk = DIMS("B", "T", "Hkv", "D");
    CHK(q, "q", 1, a, 4, SHAPE(c->B, c->T, c->Hq, c->D), bthq);
    CHK(k, "k", 1, a, 4, SHAPE(c->B, c->T, c->Hkv, c->D), bthk);
    CHK(v, "v", 1, a, 4, SHAPE(c->B, c->T, c->Hkv, c->D), bthk);
    CHK(o, "o", 1, a, 4, SHAPE(c->B, c->T, c->Hq, c->D), bthq);
    CHK(lse, "lse", need_lse, LM_F32, 3, SHAPE(c->B, c->T, c->Hq), DIMS("B", "T", "Hq"));
    return LM_OK;
}

lm_status lm_op_attention_forward(const lm_backend *be, lm_attention_config *c, const lm_tensor *q,
                                  const lm_tensor *k, const lm_tensor *v, const lm_tensor *o,
                                  const lm_tensor *lse, lm_error *err) {
    const char *op = "attention forward";
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    LM_TRY(check_backend(op, be, LM_OP_ATTENTION, c, err));
    LM_TRY(attn_check(op, be, c, q, k, v, o, lse, 0, err));
    if (on_cuda(be))
        return lm_cuda_attention_forward(be->cuda, c, q->data, k->data, v->data, o->data, dp(lse),
                                         err);
    const lm_attention_inputs in = {q->data, k->data, v->data};
    return lm_attention_forward(c, &in, o->data, dp(lse), err);
}

lm_status lm_op_attention_backward(const lm_backend *be, lm_attention_config *c, const lm_tensor *q,
                                   const lm_tensor *k, const lm_tensor *v, const lm_tensor *o,
                                   const lm_tensor *lse, const lm_tensor *do_, const lm_tensor *dq,
                                   const lm_tensor *dk, const lm_tensor *dv, lm_error *err) {
    const char *op = "attention backward";
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    LM_TRY(check_backend(op, be, LM_OP_ATTENTION, c, err));
    LM_TRY(attn_check(op, be, c, q, k, v, o, lse, 1, err));
    const lm_dtype a = act_dt(be);
    const char *const *bthq = DIMS("B", "T", "Hq", "D"), *const *bthk = DIMS("B", "T", "Hkv", "D");
    CHK(do_, "do", 1, a, 4, SHAPE(c->B, c->T, c->Hq, c->D), bthq);
    CHK(dq, "dq", 1, a, 4, SHAPE(c->B, c->T, c->Hq, c->D), bthq);
    CHK(dk, "dk", 1, a, 4, SHAPE(c->B, c->T, c->Hkv, c->D), bthk);
    CHK(dv, "dv", 1, a, 4, SHAPE(c->B, c->T, c->Hkv, c->D), bthk);
    if (on_cuda(be))
        return lm_cuda_attention_backward(be->cuda, c, q->data, k->data, v->data, o->data,
                                          lse->data, do_->data, dq->data, dk->data, dv->data, err);
    const lm_attention_inputs in = {q->data, k->data, v->data};
    lm_attention_grads gr = {do_->data, dq->data, dk->data, dv->data};
    return lm_attention_backward(c, &in, o->data, lse->data, &gr, err);
}

/* ================================================================ KDA */

lm_status lm_op_kda_chunk_forward(const lm_backend *be, lm_kda_config *c,
                                  const lm_op_kda_inputs *in, const lm_tensor *o,
                                  const lm_tensor *final_state, lm_error *err) {
    const char *op = "kda chunk forward";
    if (!c || !in)
        return lm_errorf(err, LM_ERR_INVALID, "%s: %s is NULL", op, c ? "inputs" : "config");
    LM_TRY(check_backend(op, be, LM_OP_KDA, c, err));
    int64_t N = 0;
    LM_TRY(conv_seqs(op, c->cu_seqlens, c->n_cu_seqlens, c->B, &N, err));
    const lm_dtype a = act_dt(be);
    const int gdn = c->kind == LM_GDN;
    const char *const *bthk = DIMS("B", "T", "H", "K"), *const *bthv = DIMS("B", "T", "HV", "V");
    CHK(in->q, "q", 1, a, 4, SHAPE(c->B, c->T, c->H, c->K), bthk);
    CHK(in->k, "k", 1, a, 4, SHAPE(c->B, c->T, c->H, c->K), bthk);
    CHK(in->v, "v", 1, a, 4, SHAPE(c->B, c->T, c->HV, c->V), bthv);
    if (gdn)
        CHK(in->g, "g", 1, a, 3, SHAPE(c->B, c->T, c->HV), DIMS("B", "T", "HV"));
    else
        CHK(in->g, "g", 1, a, 4, SHAPE(c->B, c->T, c->HV, c->K), DIMS("B", "T", "HV", "K"));
    CHK(in->beta, "beta", 1, a, 3, SHAPE(c->B, c->T, c->HV), DIMS("B", "T", "HV"));
    CHK(in->A_log, "A_log", 0, LM_F32, 1, SHAPE(c->HV), DIMS("HV"));
    if (gdn)
        CHK(in->dt_bias, "dt_bias", 0, LM_F32, 1, SHAPE(c->HV), DIMS("HV"));
    else
        CHK(in->dt_bias, "dt_bias", 0, LM_F32, 1, SHAPE((int64_t)c->HV * c->K), DIMS("HV*K"));
    const char *const *nhkv = DIMS("N", "HV", "K", "V");
    CHK(in->initial_state, "initial_state", 0, LM_F32, 4, SHAPE(N, c->HV, c->K, c->V), nhkv);
    CHK(o, "o", 1, a, 4, SHAPE(c->B, c->T, c->HV, c->V), bthv);
    CHK(final_state, "final_state", 0, LM_F32, 4, SHAPE(N, c->HV, c->K, c->V), nhkv);
    if (on_cuda(be)) {
        const lm_kda_cuda_inputs ci = {in->q->data,     in->k->data,          in->v->data,
                                       in->g->data,     in->beta->data,       dp(in->A_log),
                                       dp(in->dt_bias), dp(in->initial_state)};
        lm_kda_cuda_outputs co = {o->data, dp(final_state)};
        return lm_kda_cuda_chunk_forward(be->cuda, c, &ci, &co, err);
    }
    const lm_kda_inputs ki = {in->q->data,     in->k->data,          in->v->data,
                              in->g->data,     in->beta->data,       dp(in->A_log),
                              dp(in->dt_bias), dp(in->initial_state)};
    lm_kda_outputs ko = {o->data, dp(final_state)};
    return lm_kda_chunk_forward(c, &ki, &ko, err);
}

/* ================================================================ AttnRes */

static lm_status attnres_check(const char *op, const lm_backend *be, const lm_attnres_config *c,
                               const lm_tensor *src, const lm_tensor *query,
                               const lm_tensor *rms_weight, const void **ptrs, lm_error *err) {
    if (c->L < 1 || c->N < 1 || c->D < 1)
        return lm_errorf(err, LM_ERR_INVALID, "%s: L = %d, N = %lld, D = %d (each >= 1)", op, c->L,
                         (long long)c->N, c->D);
    if (!src)
        return lm_errorf(err, LM_ERR_INVALID, "%s: tensor src is missing (NULL)", op);
    const lm_dtype a = act_dt(be);
    for (int m = 0; m < c->L; m++) {
        char name[32];
        snprintf(name, sizeof name, "src[%d]", m);
        CHK(&src[m], name, 1, a, 2, SHAPE(c->N, c->D), DIMS("N", "D"));
        ptrs[m] = src[m].data;
    }
    CHK(query, "query", 1, LM_F32, 1, SHAPE(c->D), DIMS("D"));
    CHK(rms_weight, "rms_weight", 1, LM_F32, 1, SHAPE(c->D), DIMS("D"));
    return LM_OK;
}

lm_status lm_op_attnres_forward(const lm_backend *be, const lm_attnres_config *c,
                                const lm_tensor *src, const lm_tensor *query,
                                const lm_tensor *rms_weight, const lm_tensor *o, lm_error *err) {
    const char *op = "attnres forward";
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    LM_TRY(check_backend(op, be, LM_OP_ATTNRES, c, err));
    const void **ptrs = malloc(sizeof(void *) * (size_t)(c->L > 0 ? c->L : 1));
    if (!ptrs)
        return nomem(op, c->L, err);
    lm_status st = attnres_check(op, be, c, src, query, rms_weight, ptrs, err);
    if (st == LM_OK)
        st = check_t(op, be, o, "o", 1, act_dt(be), 2, SHAPE(c->N, c->D), DIMS("N", "D"), err);
    if (st == LM_OK) {
        if (on_cuda(be))
            st = lm_cuda_attnres_forward_ptrs(be->cuda, c, ptrs, query->data, rms_weight->data,
                                              o->data, NULL, err);
        else
            st = lm_attnres_forward_ptrs(c, (const float *const *)ptrs, query->data,
                                         rms_weight->data, o->data, err);
    }
    free(ptrs);
    return st;
}

lm_status lm_op_attnres_backward(const lm_backend *be, const lm_attnres_config *c,
                                 const lm_tensor *src, const lm_tensor *query,
                                 const lm_tensor *rms_weight, const lm_tensor *do_,
                                 const lm_tensor *dsrc, const lm_tensor *dquery,
                                 const lm_tensor *drms_weight, lm_error *err) {
    const char *op = "attnres backward";
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    LM_TRY(check_backend(op, be, LM_OP_ATTNRES, c, err));
    const size_t L = (size_t)(c->L > 0 ? c->L : 1);
    const void **ptrs = malloc(sizeof(void *) * L);
    void **dptrs = malloc(sizeof(void *) * L);
    lm_status st = ptrs && dptrs ? LM_OK : nomem(op, c->L, err);
    if (st == LM_OK)
        st = attnres_check(op, be, c, src, query, rms_weight, ptrs, err);
    if (st == LM_OK)
        st = check_t(op, be, do_, "do", 1, act_dt(be), 2, SHAPE(c->N, c->D), DIMS("N", "D"), err);
    /* dsrc dtype: F32 on the CPU; on CUDA that of the first entry given (BF16 or F32) */
    lm_dtype ddt = LM_F32;
    int any = 0;
    for (int m = 0; st == LM_OK && m < c->L; m++) {
        dptrs[m] = dsrc ? dsrc[m].data : NULL;
        if (!dptrs[m])
            continue;
        if (on_cuda(be) && !any)
            ddt = dsrc[m].dtype == LM_F32 ? LM_F32 : LM_BF16;
        any = 1;
        char name[32];
        snprintf(name, sizeof name, "dsrc[%d]", m);
        st = check_t(op, be, &dsrc[m], name, 1, ddt, 2, SHAPE(c->N, c->D), DIMS("N", "D"), err);
    }
    if (st == LM_OK)
        st = check_t(op, be, dquery, "dquery", 0, LM_F32, 1, SHAPE(c->D), DIMS("D"), err);
    if (st == LM_OK)
        st = check_t(op, be, drms_weight, "drms_weight", 0, LM_F32, 1, SHAPE(c->D), DIMS("D"), err);
    if (st == LM_OK) {
        lm_attnres_config cc = *c;
        cc.accumulate = 1; /* one contract: every gradient accumulates */
        if (on_cuda(be))
            st = lm_cuda_attnres_backward_ptrs(be->cuda, &cc, ptrs, query->data, rms_weight->data,
                                               do_->data, dsrc ? dptrs : NULL, ddt, dp(dquery),
                                               dp(drms_weight), err);
        else
            st = lm_attnres_backward_ptrs(
                &cc, (const float *const *)ptrs, query->data, rms_weight->data, do_->data,
                dsrc ? (float *const *)dptrs : NULL, dp(dquery), dp(drms_weight), err);
    }
    free(ptrs);
    free(dptrs);
    return st;
}

/* ================================================================ cross-entropy */

void lm_op_ce_config_default(lm_op_ce_config *c) {
    c->ignore_index = -1;
    c->dloss = 1.0f;
    c->mean = 1;
    c->chunk_size = 0;
    c->chunk_rows = 0;
    c->logits_bf16 = 1;
}

static lm_status ce_check(const char *op, const lm_backend *be, const lm_op_ce_config *c,
                          const lm_tensor *h, const lm_tensor *W, const lm_tensor *labels,
                          const lm_tensor *loss_sum, const lm_tensor *count, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "%s: config is NULL", op);
    const lm_dtype a = act_dt(be);
    CHK(h, "h", 1, a, 2, OWN(h), DIMS("N", "D"));
    const int64_t N = h->shape[0], D = h->shape[1];
    CHK(W, "W", 1, a, 2, SHAPE(W ? W->shape[0] : 0, D), DIMS("V", "D"));
    CHK(labels, "labels", 1, LM_I32, 1, SHAPE(N), DIMS("N"));
    CHK(loss_sum, "loss_sum", 0, LM_F32, 1, SHAPE(1), DIMS("1"));
    CHK(count, "count", 0, LM_I32, 1, SHAPE(1), DIMS("1"));
    return LM_OK;
}

static void cpu_ce_config(const lm_op_ce_config *c, int64_t N, int D, int V, lm_ce_config *cc) {
    lm_ce_config_default(cc, N, D, V);
    cc->ignore_index = c->ignore_index;
    if (c->chunk_size > 0)
        cc->chunk_size = c->chunk_size;
}

static void cuda_ce_config(const lm_op_ce_config *c, int64_t N, int D, int V,
                           lm_cuda_ce_config *cc) {
    lm_cuda_ce_config_default(cc, N, D, V);
    cc->ignore_index = c->ignore_index;
    cc->dloss = c->dloss;
    cc->mean = c->mean;
    cc->chunk_rows = c->chunk_rows;
    cc->logits_bf16 = c->logits_bf16;
}

lm_status lm_op_cross_entropy_forward(const lm_backend *be, const lm_op_ce_config *c,
                                      const lm_tensor *h, const lm_tensor *W,
                                      const lm_tensor *labels, const lm_tensor *loss_sum,
                                      const lm_tensor *count, const lm_tensor *nll, lm_error *err) {
    const char *op = "cross_entropy forward";
    LM_TRY(check_backend(op, be, LM_OP_CROSS_ENTROPY, NULL, err));
    LM_TRY(ce_check(op, be, c, h, W, labels, loss_sum, count, err));
    const int64_t N = h->shape[0];
    const int D = (int)h->shape[1], V = (int)W->shape[0];
    CHK(nll, "nll", 0, LM_F32, 1, SHAPE(N), DIMS("N"));
    if (on_cuda(be)) {
        lm_cuda_ce_config cc;
        cuda_ce_config(c, N, D, V, &cc);
        return lm_cuda_ce_forward(be->cuda, &cc, h->data, W->data, labels->data, dp(loss_sum),
                                  dp(count), dp(nll), err);
    }
    lm_ce_config cc;
    cpu_ce_config(c, N, D, V, &cc);
    if (loss_sum || count) {
        double loss = 0;
        int64_t cnt = 0;
        LM_TRY(
            lm_cross_entropy_forward(&cc, h->data, W->data, labels->data, &loss, &cnt, NULL, err));
        if (loss_sum)
            *(float *)loss_sum->data = (float)(loss * (double)cnt);
        if (count)
            *(int32_t *)count->data = (int32_t)cnt;
    }
    if (nll)
        LM_TRY(lm_cross_entropy_nll(&cc, h->data, W->data, labels->data, nll->data, NULL, err));
    return LM_OK;
}

lm_status lm_op_cross_entropy_backward(const lm_backend *be, const lm_op_ce_config *c,
                                       const lm_tensor *h, const lm_tensor *W,
                                       const lm_tensor *labels, const lm_tensor *loss_sum,
                                       const lm_tensor *count, const lm_tensor *dh,
                                       const lm_tensor *dW, lm_error *err) {
    const char *op = "cross_entropy backward";
    LM_TRY(check_backend(op, be, LM_OP_CROSS_ENTROPY, NULL, err));
    LM_TRY(ce_check(op, be, c, h, W, labels, loss_sum, count, err));
    const int64_t N = h->shape[0];
    const int D = (int)h->shape[1], V = (int)W->shape[0];
    CHK(dh, "dh", 0, act_dt(be), 2, SHAPE(N, D), DIMS("N", "D"));
    CHK(dW, "dW", 0, LM_F32, 2, SHAPE(V, D), DIMS("V", "D"));
    if (on_cuda(be)) {
        lm_cuda_ce_config cc;
        cuda_ce_config(c, N, D, V, &cc);
        const lm_cuda_ce_outputs out = {dp(loss_sum), dp(count), NULL, dp(dh), dp(dW)};
        return lm_cuda_ce_forward_backward(be->cuda, &cc, h->data, W->data, labels->data, &out,
                                           err);
    }
    lm_ce_config cc;
    cpu_ce_config(c, N, D, V, &cc);
    const int64_t nw = (int64_t)V * D;
    float *lse = scratch_f32(N);
    float *dws = dW ? scratch_f32(nw) : NULL;
    lm_status st = lse && (!dW || dws) ? LM_OK : nomem(op, N + nw, err);
    double loss = 0;
    int64_t cnt = 0;
    if (st == LM_OK)
        st = lm_cross_entropy_forward(&cc, h->data, W->data, labels->data, &loss, &cnt, lse, err);
    if (st == LM_OK && (dh || dW)) {
        const float dl = c->mean ? c->dloss : c->dloss * (float)cnt;
        st = lm_cross_entropy_backward(&cc, h->data, W->data, labels->data, lse, dl, dp(dh), dws,
                                       err);
    }
    if (st == LM_OK) {
        if (dws)
            add_into(dW->data, dws, nw);
        if (loss_sum)
            *(float *)loss_sum->data = (float)(loss * (double)cnt);
        if (count)
            *(int32_t *)count->data = (int32_t)cnt;
    }
    free(lse);
    free(dws);
    return st;
}
