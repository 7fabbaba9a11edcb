/* The op runner for KDA / GDN (DESIGN.md "The op runner"): read the op's tensors and
 * attributes from a safetensors file, check every shape against every other and
 * every attribute, run the library op on the CPU (and its backward when upstream
 * gradients are present), write the results atomically.
 *
 * No math here: shapes, attributes and plumbing only; values are checked by
 * lm_kda_validate and computed by the kernels in include/linmoe/kda.h.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli.h"
#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/kda.h"
#include "linmoe/kda_cuda.h"
#include "linmoe/safetensors.h"

/* Tensor names the op reads, in the order they are checked. */
enum { T_Q, T_K, T_V, T_G, T_BETA, T_A_LOG, T_DT_BIAS, T_H0, T_CU, T_DO, T_DHT, T_COUNT };
static const char *const k_names[T_COUNT] = {"q",       "k",             "v",          "g",
                                             "beta",    "A_log",         "dt_bias",    "initial_state",
                                             "cu_seqlens", "do",         "dht"};
static const int k_required[T_COUNT] = {1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0};

static const char *const k_meta_keys[] = {"gate",
                                          "lower_bound",
                                          "scale",
                                          "chunk_size",
                                          "use_qk_l2norm_in_kernel",
                                          "use_beta_sigmoid_in_kernel",
                                          "diag",
                                          "format" /* written by torch's safetensors; ignored */};

typedef struct {
    const char *prog;
    const char *in_path;
    int use_cuda;
    lm_safetensors st;
    const lm_st_entry *e[T_COUNT];
    float *f[T_COUNT]; /* fp32 copies of the float tensors */
    int64_t *cu;       /* cu_seqlens as int64 */
    lm_kda_config c;
    /* outputs */
    float *o, *ht, *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias, *zero_do;
} op_ctx;

static void ctx_free(op_ctx *x) {
    for (int i = 0; i < T_COUNT; i++) free(x->f[i]);
    free(x->cu);
    free(x->o);
    free(x->ht);
    free(x->dq);
    free(x->dk);
    free(x->dv);
    free(x->dg);
    free(x->dbeta);
    free(x->dh0);
    free(x->dA_log);
    free(x->ddt_bias);
    free(x->zero_do);
    lm_st_free(&x->st);
}

/* Print "<prog>: <IN>: <message>" and return the bad-input exit code. */
static int fail(const op_ctx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(const op_ctx *x, const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s: %s\n", x->prog, x->in_path, msg);
    return LM_EXIT_BAD_INPUT;
}


/* Checked product of dims (0 on overflow past INT64_MAX, with *ok cleared). */
static int64_t dims_product(int n, const int64_t *d, int *ok) {
    int64_t p = 1;
    for (int i = 0; i < n; i++)
        if (d[i] < 0 || __builtin_mul_overflow(p, d[i], &p)) {
            *ok = 0;
            return 0;
        }
    return p;
}

/* Check entry `t` has exactly the shape `want` (ndim `wn`), whose dims are named
 * `dim_names` and come from `from` (e.g. "q [1,64,2,64]"). */
static int check_shape(const op_ctx *x, int t, int wn, const int64_t *want, const char *const *dim_names,
                       const char *from) {
    const lm_st_entry *e = x->e[t];
    char have[160], exp[160], names[64] = "";
    lm_cli_fmt_shape(have, sizeof(have), e->ndim, e->shape);
    lm_cli_fmt_shape(exp, sizeof(exp), wn, want);
    for (int i = 0; i < wn; i++) {
        size_t u = strlen(names);
        snprintf(names + u, sizeof(names) - u, "%s%s", i ? "," : "", dim_names[i]);
    }
    if (e->ndim != wn)
        return fail(x, "tensor '%s' shape %s has %d dims; expected %d: [%s] = %s (from %s)",
                    k_names[t], have, e->ndim, wn, names, exp, from);
    for (int i = 0; i < wn; i++)
        if (e->shape[i] != want[i])
            return fail(x, "tensor '%s' shape %s does not match %s: dim %d (%s) is %lld, expected %lld",
                        k_names[t], have, from, i, dim_names[i], (long long)e->shape[i],
                        (long long)want[i]);
    return 0;
}

static int is_float_dtype(lm_dtype dt) {
    return dt == LM_F32 || dt == LM_F64 || dt == LM_BF16 || dt == LM_F16;
}

/* ---------------------------------------------------------------- metadata */


static int parse_float(const char *s, float *out) {
    char *end = NULL;
    errno = 0;
    double d = strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(d) || fabs(d) > 3.0e38) return -1;
    *out = (float)d;
    return 0;
}

static int parse_int(const char *s, int *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE || v < INT_MIN || v > INT_MAX) return -1;
    *out = (int)v;
    return 0;
}

static int read_metadata(op_ctx *x) {
    const lm_safetensors *st = &x->st;
    lm_kda_config *c = &x->c;
    const char *s;
    if ((s = lm_st_meta(st, "gate")) != NULL) {
        if (strcmp(s, "none") == 0) c->gate = LM_GATE_NONE;
        else if (strcmp(s, "softplus") == 0) c->gate = LM_GATE_SOFTPLUS;
        else if (strcmp(s, "bounded") == 0) c->gate = LM_GATE_BOUNDED;
        else return fail(x, "__metadata__ 'gate' = '%s' is not one of none|softplus|bounded", s);
    }
    if ((s = lm_st_meta(st, "lower_bound")) != NULL) {
        if (parse_float(s, &c->lower_bound) != 0)
            return fail(x, "__metadata__ 'lower_bound' = '%s' is not a finite number", s);
        c->has_lower_bound = 1;
    }
    if ((s = lm_st_meta(st, "scale")) != NULL && parse_float(s, &c->scale) != 0)
        return fail(x, "__metadata__ 'scale' = '%s' is not a finite number", s);
    if ((s = lm_st_meta(st, "chunk_size")) != NULL && parse_int(s, &c->chunk_size) != 0)
        return fail(x, "__metadata__ 'chunk_size' = '%s' is not an integer (16, 32 or 64)", s);
    if ((s = lm_st_meta(st, "use_qk_l2norm_in_kernel")) != NULL &&
        lm_cli_parse_bool(s, &c->use_qk_l2norm_in_kernel) != 0)
        return fail(x, "__metadata__ 'use_qk_l2norm_in_kernel' = '%s' is not true or false", s);
    if ((s = lm_st_meta(st, "use_beta_sigmoid_in_kernel")) != NULL &&
        lm_cli_parse_bool(s, &c->use_beta_sigmoid_in_kernel) != 0)
        return fail(x, "__metadata__ 'use_beta_sigmoid_in_kernel' = '%s' is not true or false", s);
    if ((s = lm_st_meta(st, "diag")) != NULL) {
        if (strcmp(s, "auto") == 0) c->diag = LM_DIAG_AUTO;
        else if (strcmp(s, "shared") == 0) c->diag = LM_DIAG_SHARED;
        else if (strcmp(s, "safe") == 0) c->diag = LM_DIAG_SAFE;
        else return fail(x, "__metadata__ 'diag' = '%s' is not one of auto|shared|safe", s);
    }
    for (int i = 0; i < st->n_meta; i++) {
        int known = 0;
        for (size_t j = 0; j < sizeof(k_meta_keys) / sizeof(k_meta_keys[0]); j++)
            known |= strcmp(st->meta_keys[i], k_meta_keys[j]) == 0;
        if (!known)
            fprintf(stderr, "%s: warning: %s: __metadata__ key '%s' is not used by this op\n",
                    x->prog, x->in_path, st->meta_keys[i]);
    }
    return 0;
}

/* ---------------------------------------------------------------- shapes */

static int check_shapes(op_ctx *x, int64_t *N_out) {
    const int kda = x->c.kind == LM_KDA;
    for (int t = 0; t < T_COUNT; t++) {
        x->e[t] = lm_st_find(&x->st, k_names[t]);
        if (!x->e[t] && k_required[t])
            return fail(x, "missing required tensor '%s' (op %s needs q, k, v, g, beta)", k_names[t],
                        kda ? "kda" : "gdn");
        if (!x->e[t]) continue;
        lm_dtype dt = x->e[t]->dtype;
        if (t == T_CU) {
            if (dt != LM_I64 && dt != LM_I32)
                return fail(x, "tensor 'cu_seqlens' has dtype %s; expected I64 or I32",
                            lm_dtype_name(dt));
        } else if (!is_float_dtype(dt)) {
            return fail(x, "tensor '%s' has dtype %s; expected F32, F64 or BF16", k_names[t],
                        lm_dtype_name(dt));
        }
    }
    for (int i = 0; i < x->st.n_entries; i++) {
        int known = 0;
        for (int t = 0; t < T_COUNT; t++) known |= strcmp(x->st.entries[i].name, k_names[t]) == 0;
        if (!known)
            fprintf(stderr, "%s: warning: %s: tensor '%s' is not an input of this op; ignored\n",
                    x->prog, x->in_path, x->st.entries[i].name);
    }

    static const char *const qn[] = {"B", "T", "H", "K"};
    static const char *const vn[] = {"B", "T", "HV", "V"};
    static const char *const gn[] = {"B", "T", "HV", "K"};
    static const char *const sn[] = {"N", "HV", "K", "V"};
    static const char *const hvn[] = {"HV"};
    static const char *const hvkn[] = {"HV*K"};
    const lm_st_entry *q = x->e[T_Q], *v = x->e[T_V];
    char qs[160], vs[160], from[400];
    lm_cli_fmt_shape(qs, sizeof(qs), q->ndim, q->shape);
    if (q->ndim != 4)
        return fail(x, "tensor 'q' shape %s has %d dims; expected 4: [B,T,H,K]", qs, q->ndim);
    for (int i = 0; i < 4; i++) {
        if (q->shape[i] <= 0)
            return fail(x, "tensor 'q' shape %s: dim %d (%s) must be positive", qs, i, qn[i]);
        if (q->shape[i] > INT_MAX)
            return fail(x, "tensor 'q' shape %s: dim %d (%s) = %lld is too large (max %d)", qs, i,
                        qn[i], (long long)q->shape[i], INT_MAX);
    }
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    snprintf(from, sizeof(from), "q %s", qs);
    if (check_shape(x, T_K, 4, q->shape, qn, from)) return LM_EXIT_BAD_INPUT;

    lm_cli_fmt_shape(vs, sizeof(vs), v->ndim, v->shape);
    if (v->ndim != 4)
        return fail(x, "tensor 'v' shape %s has %d dims; expected 4: [B,T,HV,V]", vs, v->ndim);
    {
        int64_t want[4] = {B, T, v->shape[2], v->shape[3]};
        if (check_shape(x, T_V, 4, want, vn, from)) return LM_EXIT_BAD_INPUT;
    }
    const int64_t HV = v->shape[2], V = v->shape[3];
    if (HV <= 0 || V <= 0)
        return fail(x, "tensor 'v' shape %s: dims 2 (HV) and 3 (V) must be positive", vs);
    if (HV > INT_MAX || V > INT_MAX)
        return fail(x, "tensor 'v' shape %s: dims 2 (HV) and 3 (V) must be at most %d", vs, INT_MAX);
    if (HV % H != 0)
        return fail(x, "tensor 'v' shape %s: dim 2 (HV) = %lld is not a multiple of q's dim 2 (H) = %lld",
                    vs, (long long)HV, (long long)H);
    snprintf(from, sizeof(from), "q %s and v %s", qs, vs);

    if (kda) {
        int64_t want[4] = {B, T, HV, K};
        if (check_shape(x, T_G, 4, want, gn, from)) return LM_EXIT_BAD_INPUT;
    } else {
        int64_t want[3] = {B, T, HV};
        if (check_shape(x, T_G, 3, want, gn, from)) return LM_EXIT_BAD_INPUT;
    }
    {
        int64_t want[3] = {B, T, HV};
        if (check_shape(x, T_BETA, 3, want, vn, from)) return LM_EXIT_BAD_INPUT;
    }
    if (x->e[T_A_LOG]) {
        int64_t want[1] = {HV};
        if (check_shape(x, T_A_LOG, 1, want, hvn, from)) return LM_EXIT_BAD_INPUT;
    }
    if (x->e[T_DT_BIAS]) {
        int64_t want[1] = {kda ? HV * K : HV};
        if (check_shape(x, T_DT_BIAS, 1, want, kda ? hvkn : hvn, from)) return LM_EXIT_BAD_INPUT;
    }
    if ((x->e[T_A_LOG] || x->e[T_DT_BIAS]) && x->c.gate == LM_GATE_NONE)
        return fail(x, "tensor '%s' is given but __metadata__ 'gate' is none (A_log and dt_bias are "
                       "used only by the softplus and bounded gates)",
                    x->e[T_A_LOG] ? "A_log" : "dt_bias");

    int64_t N = B;
    if (x->e[T_CU]) {
        const lm_st_entry *cu = x->e[T_CU];
        char cs[160];
        lm_cli_fmt_shape(cs, sizeof(cs), cu->ndim, cu->shape);
        if (cu->ndim != 1)
            return fail(x, "tensor 'cu_seqlens' shape %s has %d dims; expected 1: [N+1]", cs, cu->ndim);
        if (cu->shape[0] < 2)
            return fail(x, "tensor 'cu_seqlens' shape %s: needs at least 2 entries (N+1 with N >= 1)",
                        cs);
        if (cu->shape[0] - 1 > INT_MAX)
            return fail(x, "tensor 'cu_seqlens' shape %s: too many sequences (max %d)", cs, INT_MAX);
        if (B != 1)
            return fail(x, "tensor 'cu_seqlens' is given but q %s has dim 0 (B) = %lld; packed varlen "
                           "needs B == 1",
                        qs, (long long)B);
        N = cu->shape[0] - 1;
    }
    {
        int64_t want[4] = {N, HV, K, V};
        char sfrom[600];
        snprintf(sfrom, sizeof(sfrom), "%s (N = %lld from %s)", from, (long long)N,
                 x->e[T_CU] ? "cu_seqlens" : "B");
        if (x->e[T_H0] && check_shape(x, T_H0, 4, want, sn, sfrom)) return LM_EXIT_BAD_INPUT;
        if (x->e[T_DHT] && check_shape(x, T_DHT, 4, want, sn, sfrom)) return LM_EXIT_BAD_INPUT;
    }
    if (x->e[T_DO]) {
        int64_t want[4] = {B, T, HV, V};
        if (check_shape(x, T_DO, 4, want, vn, from)) return LM_EXIT_BAD_INPUT;
    }
    *N_out = N;
    return 0;
}

/* ---------------------------------------------------------------- run */

static float *alloc_f32(const op_ctx *x, const char *what, int n, const int64_t *shape, int *rc) {
    int ok = 1;
    int64_t numel = dims_product(n, shape, &ok);
    uint64_t bytes = 0;
    if (ok && __builtin_mul_overflow((uint64_t)numel, (uint64_t)sizeof(float), &bytes)) ok = 0;
    if (ok && bytes > (uint64_t)SIZE_MAX) ok = 0;
    float *p = ok ? (float *)calloc(numel > 0 ? (size_t)numel : 1, sizeof(float)) : NULL;
    if (!p) {
        char s[160];
        lm_cli_fmt_shape(s, sizeof(s), n, shape);
        if (ok)
            *rc = fail(x, "out of memory allocating output '%s' %s (%llu bytes)", what, s,
                       (unsigned long long)bytes);
        else
            *rc = fail(x, "output '%s' %s is too large (size overflows 64 bits)", what, s);
    }
    return p;
}

static int add_out(const op_ctx *x, lm_st_writer *w, const char *name, int n, const int64_t *shape,
                   const float *data) {
    lm_error err = {LM_OK, ""};
    if (lm_st_writer_add(w, name, LM_F32, n, shape, data, &err) != LM_OK) {
        fprintf(stderr, "%s: output '%s': %s\n", x->prog, name, err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    return 0;
}

/* The forward on the GPU (a context on cuda:0, made and freed here): inputs rounded to
 * bf16 and uploaded, o (bf16) and the fp32 final state copied back into x->o / x->ht as
 * fp32. */
static int run_cuda(op_ctx *x, const lm_kda_inputs *in, int64_t nq, int64_t nv, int64_t ng,
                    int64_t nb, int64_t ns) {
    lm_error err = {LM_OK, ""};
    lm_cuda_ctx *ctx = NULL;
    if (lm_cuda_ctx_new(&ctx, 0, &err) != LM_OK)
        return fail(x, "--device cuda: %s", err.msg);
    const int HV = x->c.HV, GK = x->c.kind == LM_GDN ? 1 : x->c.K;
    const float *src[5] = {in->q, in->k, in->v, in->g, in->beta};
    const int64_t cnt[5] = {nq, nq, nv, ng, nb};
    void *dev[5] = {0}, *d_o = NULL;
    float *d_A = NULL, *d_bias = NULL, *d_h0 = NULL, *d_ht = NULL;
    uint16_t *h = NULL;
    int rc = 0;
    for (int t = 0; t < 5 && !rc; t++) {
        h = (uint16_t *)malloc((size_t)(cnt[t] > 0 ? cnt[t] : 1) * sizeof(uint16_t));
        if (!h) {
            rc = fail(x, "out of memory converting inputs to bf16");
            break;
        }
        for (int64_t i = 0; i < cnt[t]; i++)
            h[i] = lm_f32_to_bf16(src[t][i]);
        if (lm_cuda_ctx_alloc(ctx, &dev[t], (size_t)cnt[t] * 2, &err) != LM_OK ||
            lm_cuda_ctx_upload(ctx, dev[t], h, (size_t)cnt[t] * 2, &err) != LM_OK)
            rc = fail(x, "%s", err.msg);
        free(h);
        h = NULL;
    }
    if (!rc && in->A_log &&
        (lm_cuda_ctx_alloc(ctx, (void **)&d_A, sizeof(float) * HV, &err) != LM_OK ||
         lm_cuda_ctx_upload(ctx, d_A, in->A_log, sizeof(float) * HV, &err) != LM_OK))
        rc = fail(x, "%s", err.msg);
    if (!rc && in->dt_bias &&
        (lm_cuda_ctx_alloc(ctx, (void **)&d_bias, sizeof(float) * HV * GK, &err) != LM_OK ||
         lm_cuda_ctx_upload(ctx, d_bias, in->dt_bias, sizeof(float) * HV * GK, &err) != LM_OK))
        rc = fail(x, "%s", err.msg);
    if (!rc && in->initial_state &&
        (lm_cuda_ctx_alloc(ctx, (void **)&d_h0, sizeof(float) * ns, &err) != LM_OK ||
         lm_cuda_ctx_upload(ctx, d_h0, in->initial_state, sizeof(float) * ns, &err) != LM_OK))
        rc = fail(x, "%s", err.msg);
    if (!rc && (lm_cuda_ctx_alloc(ctx, &d_o, (size_t)nv * 2, &err) != LM_OK ||
                lm_cuda_ctx_alloc(ctx, (void **)&d_ht, sizeof(float) * ns, &err) != LM_OK))
        rc = fail(x, "%s", err.msg);
    if (!rc) {
        lm_kda_cuda_inputs ci = {dev[0], dev[1], dev[2], dev[3], dev[4], d_A, d_bias, d_h0};
        lm_kda_cuda_outputs co = {d_o, d_ht};
        if (lm_kda_cuda_chunk_forward(ctx, &x->c, &ci, &co, &err) != LM_OK)
            rc = fail(x, "%s", err.msg);
    }
    if (!rc) {
        h = (uint16_t *)malloc((size_t)(nv > 0 ? nv : 1) * sizeof(uint16_t));
        if (!h)
            rc = fail(x, "out of memory reading o back");
        else if (lm_cuda_ctx_download(ctx, h, d_o, (size_t)nv * 2, &err) != LM_OK ||
                 lm_cuda_ctx_download(ctx, x->ht, d_ht, sizeof(float) * ns, &err) != LM_OK)
            rc = fail(x, "%s", err.msg);
        else
            for (int64_t i = 0; i < nv; i++)
                x->o[i] = lm_bf16_to_f32(h[i]);
        free(h);
    }
    for (int t = 0; t < 5; t++)
        lm_cuda_ctx_free_mem(ctx, dev[t]);
    lm_cuda_ctx_free_mem(ctx, d_A);
    lm_cuda_ctx_free_mem(ctx, d_bias);
    lm_cuda_ctx_free_mem(ctx, d_h0);
    lm_cuda_ctx_free_mem(ctx, d_o);
    lm_cuda_ctx_free_mem(ctx, d_ht);
    lm_cuda_ctx_free(ctx);
    return rc;
}

static int run(op_ctx *x, const char *out_path) {
    lm_error err = {LM_OK, ""};
    if (lm_st_read(x->in_path, &x->st, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg[0] ? err.msg : lm_status_str(err.status));
        return LM_EXIT_BAD_INPUT;
    }
    int rc;
    int64_t N = 0;
    /* The metadata is parsed into x->c before the dims are known (so a bad attribute
     * is reported first); the defaults that depend on the dims are filled below. */
    lm_kda_kind kind = x->c.kind;
    if ((rc = read_metadata(x)) != 0) return rc;
    if ((rc = check_shapes(x, &N)) != 0) return rc;

    const lm_st_entry *q = x->e[T_Q], *v = x->e[T_V];
    const int B = (int)q->shape[0], T = (int)q->shape[1], H = (int)q->shape[2], K = (int)q->shape[3];
    const int HV = (int)v->shape[2], V = (int)v->shape[3];
    {
        /* re-apply the metadata over fresh defaults that know the dims (scale = K^-0.5) */
        lm_kda_config m = x->c;
        lm_kda_config_default(&x->c, B, T, H, HV, K, V);
        x->c.kind = kind;
        x->c.gate = m.gate;
        x->c.has_lower_bound = m.has_lower_bound;
        x->c.lower_bound = m.lower_bound;
        if (lm_st_meta(&x->st, "scale")) x->c.scale = m.scale;
        if (lm_st_meta(&x->st, "chunk_size")) x->c.chunk_size = m.chunk_size;
        x->c.use_qk_l2norm_in_kernel = m.use_qk_l2norm_in_kernel;
        x->c.use_beta_sigmoid_in_kernel = m.use_beta_sigmoid_in_kernel;
        x->c.diag = m.diag;
    }

    for (int t = 0; t < T_COUNT; t++) {
        if (!x->e[t]) continue;
        if (t == T_CU) {
            if (lm_st_to_i64(&x->st, "cu_seqlens", &x->cu, &err) != LM_OK) {
                fprintf(stderr, "%s: %s\n", x->prog, err.msg); /* names the file */
                return LM_EXIT_BAD_INPUT;
            }
            x->c.cu_seqlens = x->cu;
            x->c.n_cu_seqlens = (int)x->e[t]->shape[0];
        } else if (lm_st_to_f32(&x->st, k_names[t], &x->f[t], &err) != LM_OK) {
            fprintf(stderr, "%s: %s\n", x->prog, err.msg); /* names the file and tensor */
            return LM_EXIT_BAD_INPUT;
        }
    }

    lm_kda_inputs in = {x->f[T_Q], x->f[T_K], x->f[T_V], x->f[T_G], x->f[T_BETA],
                        x->f[T_A_LOG], x->f[T_DT_BIAS], x->f[T_H0]};
    if (lm_kda_validate(&x->c, &in, &err) != LM_OK) return fail(x, "%s", err.msg);
    LM_CHECK((int64_t)x->c.N == N); /* validate derives N the same way the shapes did */

    const int64_t o_shape[4] = {B, T, HV, V};
    const int64_t s_shape[4] = {N, HV, K, V};
    rc = 0;
    if (!(x->o = alloc_f32(x, "o", 4, o_shape, &rc))) return rc;
    if (!(x->ht = alloc_f32(x, "final_state", 4, s_shape, &rc))) return rc;
    lm_kda_outputs out = {x->o, x->ht};
    const int backward = x->e[T_DO] != NULL || x->e[T_DHT] != NULL;

    if (x->use_cuda) {
        if (backward)
            return fail(x, "--device cuda: the CUDA backward is not built yet (forward only; "
                           "drop 'do' / 'dht' or run on the CPU)");
        if (lm_cuda_device_count() < 1)
            return fail(x, "--device cuda: %s",
#ifdef LM_HAVE_CUDA
                        "no CUDA device found"
#else
                        "this linmoe was built without CUDA (no nvcc found by CMake)"
#endif
            );
        const int64_t GK = x->c.kind == LM_GDN ? 1 : K;
        const int64_t nq = (int64_t)B * T * H * K, nv = (int64_t)B * T * HV * V,
                      ng = (int64_t)B * T * HV * GK, nb = (int64_t)B * T * HV,
                      ns = N * HV * (int64_t)K * V;
        if ((rc = run_cuda(x, &in, nq, nv, ng, nb, ns)) != 0) return rc;
    } else if (!backward) {
        if (lm_kda_forward(&x->c, &in, &out, &err) != LM_OK) return fail(x, "%s", err.msg);
    } else {
        const lm_st_entry *const *e = x->e;
        if (!e[T_DO] && !(x->zero_do = alloc_f32(x, "do (zeros)", 4, o_shape, &rc))) return rc;
        if (!(x->dq = alloc_f32(x, "dq", 4, q->shape, &rc))) return rc;
        if (!(x->dk = alloc_f32(x, "dk", 4, q->shape, &rc))) return rc;
        if (!(x->dv = alloc_f32(x, "dv", 4, v->shape, &rc))) return rc;
        if (!(x->dg = alloc_f32(x, "dg", e[T_G]->ndim, e[T_G]->shape, &rc))) return rc;
        if (!(x->dbeta = alloc_f32(x, "dbeta", 3, e[T_BETA]->shape, &rc))) return rc;
        if (e[T_H0] && !(x->dh0 = alloc_f32(x, "dh0", 4, s_shape, &rc))) return rc;
        if (e[T_A_LOG] && !(x->dA_log = alloc_f32(x, "dA_log", 1, e[T_A_LOG]->shape, &rc)))
            return rc;
        if (e[T_DT_BIAS] && !(x->ddt_bias = alloc_f32(x, "ddt_bias", 1, e[T_DT_BIAS]->shape, &rc)))
            return rc;
        lm_kda_grads gr = {e[T_DO] ? x->f[T_DO] : x->zero_do,
                           x->f[T_DHT],
                           x->dq,
                           x->dk,
                           x->dv,
                           x->dg,
                           x->dbeta,
                           x->dh0,
                           x->dA_log,
                           x->ddt_bias};
        if (lm_kda_chunk_forward(&x->c, &in, &out, &err) != LM_OK) return fail(x, "%s", err.msg);
        if (lm_kda_chunk_backward(&x->c, &in, &gr, &err) != LM_OK) return fail(x, "%s", err.msg);
    }

    lm_st_writer w;
    lm_st_writer_init(&w);
    const lm_st_entry *const *e = x->e;
    rc = add_out(x, &w, "o", 4, o_shape, x->o);
    if (!rc) rc = add_out(x, &w, "final_state", 4, s_shape, x->ht);
    if (!rc && backward) {
        rc = add_out(x, &w, "dq", 4, q->shape, x->dq);
        if (!rc) rc = add_out(x, &w, "dk", 4, q->shape, x->dk);
        if (!rc) rc = add_out(x, &w, "dv", 4, v->shape, x->dv);
        if (!rc) rc = add_out(x, &w, "dg", e[T_G]->ndim, e[T_G]->shape, x->dg);
        if (!rc) rc = add_out(x, &w, "dbeta", 3, e[T_BETA]->shape, x->dbeta);
        if (!rc && x->dh0) rc = add_out(x, &w, "dh0", 4, s_shape, x->dh0);
        if (!rc && x->dA_log) rc = add_out(x, &w, "dA_log", 1, e[T_A_LOG]->shape, x->dA_log);
        if (!rc && x->ddt_bias)
            rc = add_out(x, &w, "ddt_bias", 1, e[T_DT_BIAS]->shape, x->ddt_bias);
    }
    if (!rc && lm_st_writer_meta(&w, "op", kind == LM_KDA ? "kda" : "gdn", &err) != LM_OK) {
        fprintf(stderr, "%s: %s: %s\n", x->prog, out_path, err.msg);
        rc = LM_EXIT_BAD_INPUT;
    }
    if (!rc && lm_st_writer_save(&w, out_path, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg[0] ? err.msg : lm_status_str(err.status));
        rc = LM_EXIT_BAD_INPUT;
    }
    lm_st_writer_free(&w);
    return rc;
}

int lm_cli_op_kda(const char *prog, lm_kda_kind kind, const char *in_path, const char *out_path,
                  int use_cuda) {
    op_ctx x;
    memset(&x, 0, sizeof(x));
    x.prog = prog;
    x.use_cuda = use_cuda;
    x.in_path = in_path;
    lm_kda_config_default(&x.c, 1, 1, 1, 1, 1, 1);
    x.c.kind = kind;
    int rc = run(&x, out_path);
    ctx_free(&x);
    return rc;
}
