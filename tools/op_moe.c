/* The op runner for the MoE router and the whole MoE layer (DESIGN.md "The op
 * runner"): read tensors and attributes from a safetensors file, check every shape
 * against every other and every attribute, run the library on the CPU (and the
 * backward when upstream gradients are present), write the results atomically.
 *
 *   linmoe op moe_router   lm_router_forward (+ lm_router_backward with dtopk_weight)
 *   linmoe op moe          lm_moe_forward   (+ lm_moe_backward with do)
 *
 * Both ops are stateless: the selection bias is an input, balancing is off
 * (balance = none: no aux loss, no bias update), and `training` only switches
 * capacity dropping on. No math here: shapes, attributes and plumbing only.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "linmoe/core.h"
#include "linmoe/moe.h"
#include "linmoe/moe_router.h"
#include "linmoe/safetensors.h"

#include "cli.h"

/* Metadata keys both ops read (others are reported as unused). The size keys are
 * optional: the dims come from the tensor shapes, and a key that is present must
 * agree with them. */
static const char *const k_meta_keys[] = {
    "scoring_func",     "num_experts_per_tok",
    "norm_topk_prob",   "routed_scaling_factor",
    "n_group",          "topk_group",
    "training",         "capacity_factor",
    "drop_policy",      "num_experts",
    "hidden_size",      "moe_intermediate_size",
    "n_shared_experts", "format" /* written by torch's safetensors; ignored */};

typedef struct {
    const char *prog, *in_path;
    lm_safetensors st;
    lm_router_config rc;
    int training;
    int k_given; /* num_experts_per_tok was in the metadata */
    /* owned buffers, freed by ctx_free */
    float *f[32];
    int nf;
} op_ctx;

static void ctx_free(op_ctx *x) {
    for (int i = 0; i < x->nf; i++)
        free(x->f[i]);
    lm_st_free(&x->st);
}

static int fail(const op_ctx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(const op_ctx *x, const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s: %s\n", x->prog, x->in_path, msg);
    return 1;
}



static int parse_float(const char *s, float *out) {
    char *end = NULL;
    errno = 0;
    double d = strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(d) || fabs(d) > 3.0e38)
        return -1;
    *out = (float)d;
    return 0;
}

static int parse_int(const char *s, int *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE || v < INT_MIN || v > INT_MAX)
        return -1;
    *out = (int)v;
    return 0;
}

/* fp32 copy of a float tensor (owned by x). Returns NULL after printing. */
static float *load_f32(op_ctx *x, const char *name) {
    lm_error err = {LM_OK, ""};
    float *p = NULL;
    if (lm_st_to_f32(&x->st, name, &p, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg); /* names the file and tensor */
        return NULL;
    }
    LM_CHECK(x->nf < (int)(sizeof(x->f) / sizeof(x->f[0])));
    x->f[x->nf++] = p;
    return p;
}

static float *alloc_f32(op_ctx *x, int64_t n) {
    float *p = (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!p)
        return NULL;
    LM_CHECK(x->nf < (int)(sizeof(x->f) / sizeof(x->f[0])));
    x->f[x->nf++] = p;
    return p;
}

/* Tensor `name`: present (or, if required, an error), a float dtype, `ndim` dims. */
static int get_entry(op_ctx *x, const char *name, int required, int ndim, const char *dims,
                     const lm_st_entry **out) {
    const lm_st_entry *e = lm_st_find(&x->st, name);
    *out = e;
    if (!e)
        return required ? fail(x, "missing required tensor '%s' %s", name, dims) : 0;
    const lm_dtype dt = e->dtype;
    if (dt != LM_F32 && dt != LM_F64 && dt != LM_BF16 && dt != LM_F16)
        return fail(x, "tensor '%s' has dtype %s; expected F32, F64, BF16 or F16", name,
                    lm_dtype_name(dt));
    char s[160];
    lm_cli_fmt_shape(s, sizeof(s), e->ndim, e->shape);
    if (e->ndim != ndim)
        return fail(x, "tensor '%s' shape %s has %d dims; expected %d: %s", name, s, e->ndim, ndim,
                    dims);
    for (int i = 0; i < ndim; i++)
        if (e->shape[i] < 1 || e->shape[i] > INT_MAX)
            return fail(x, "tensor '%s' shape %s: dim %d = %lld must be in [1, %d]", name, s, i,
                        (long long)e->shape[i], INT_MAX);
    return 0;
}

/* Dim `i` of tensor e must equal `want` (named `what`, coming from `from`). */
static int check_dim(op_ctx *x, const lm_st_entry *e, int i, int64_t want, const char *what,
                     const char *from) {
    if (e->shape[i] == want)
        return 0;
    char s[160];
    lm_cli_fmt_shape(s, sizeof(s), e->ndim, e->shape);
    return fail(x, "tensor '%s' shape %s: dim %d (%s) is %lld but %s gives %lld", e->name, s, i,
                what, (long long)e->shape[i], from, (long long)want);
}

/* A size key in the metadata, when present, must agree with the shapes. */
static int check_size_key(op_ctx *x, const char *key, int64_t have, const char *from) {
    const char *s = lm_st_meta(&x->st, key);
    int v;
    if (!s)
        return 0;
    if (parse_int(s, &v) != 0)
        return fail(x, "__metadata__ '%s' = '%s' is not an integer", key, s);
    if (v != have)
        return fail(x, "__metadata__ '%s' = %d disagrees with %s (%lld)", key, v, from,
                    (long long)have);
    return 0;
}

/* Router attributes, over lm_router_config_default(E, k). k comes from the
 * metadata, or from `k_shape` (> 0) when the metadata lacks it. */
static int read_router_meta(op_ctx *x, int E, int k_shape) {
    const lm_safetensors *st = &x->st;
    const char *s;
    int k = 0;
    x->k_given = 0;
    if ((s = lm_st_meta(st, "num_experts_per_tok")) != NULL) {
        if (parse_int(s, &k) != 0)
            return fail(x, "__metadata__ 'num_experts_per_tok' = '%s' is not an integer", s);
        x->k_given = 1;
    } else if (k_shape > 0) {
        k = k_shape;
    } else {
        return fail(x, "missing __metadata__ 'num_experts_per_tok' (k, the experts per token)");
    }
    lm_router_config *c = &x->rc;
    lm_router_config_default(c, E, k);
    c->balance = LM_BAL_NONE; /* stateless op */
    if ((s = lm_st_meta(st, "scoring_func")) != NULL) {
        int v = lm_score_func_from_name(s);
        if (v < 0)
            return fail(x, "__metadata__ 'scoring_func' = '%s' is not one of sigmoid|softmax", s);
        c->scoring_func = (lm_score_func)v;
    }
    if ((s = lm_st_meta(st, "norm_topk_prob")) != NULL && lm_cli_parse_bool(s, &c->norm_topk_prob) != 0)
        return fail(x, "__metadata__ 'norm_topk_prob' = '%s' is not true or false", s);
    if ((s = lm_st_meta(st, "routed_scaling_factor")) != NULL &&
        parse_float(s, &c->routed_scaling_factor) != 0)
        return fail(x, "__metadata__ 'routed_scaling_factor' = '%s' is not a finite number", s);
    if ((s = lm_st_meta(st, "n_group")) != NULL && parse_int(s, &c->n_group) != 0)
        return fail(x, "__metadata__ 'n_group' = '%s' is not an integer", s);
    if ((s = lm_st_meta(st, "topk_group")) != NULL && parse_int(s, &c->topk_group) != 0)
        return fail(x, "__metadata__ 'topk_group' = '%s' is not an integer", s);
    x->training = 0;
    if ((s = lm_st_meta(st, "training")) != NULL && lm_cli_parse_bool(s, &x->training) != 0)
        return fail(x, "__metadata__ 'training' = '%s' is not true or false", s);
    if ((s = lm_st_meta(st, "capacity_factor")) != NULL && parse_float(s, &c->capacity_factor) != 0)
        return fail(x, "__metadata__ 'capacity_factor' = '%s' is not a finite number", s);
    if ((s = lm_st_meta(st, "drop_policy")) != NULL) {
        int v = lm_drop_policy_from_name(s);
        if (v < 0)
            return fail(x, "__metadata__ 'drop_policy' = '%s' is not one of probs|position", s);
        c->drop_policy = (lm_drop_policy)v;
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

static void warn_unknown_tensors(const op_ctx *x, const char *const *names, int n) {
    for (int i = 0; i < x->st.n_entries; i++) {
        int known = 0;
        for (int t = 0; t < n; t++)
            known |= strcmp(x->st.entries[i].name, names[t]) == 0;
        if (!known)
            fprintf(stderr, "%s: warning: %s: tensor '%s' is not an input of this op; ignored\n",
                    x->prog, x->in_path, x->st.entries[i].name);
    }
}

static int add_out(const op_ctx *x, lm_st_writer *w, const char *name, lm_dtype dt, int n,
                   const int64_t *shape, const void *data) {
    lm_error err = {LM_OK, ""};
    if (lm_st_writer_add(w, name, dt, n, shape, data, &err) != LM_OK) {
        fprintf(stderr, "%s: output '%s': %s\n", x->prog, name, err.msg);
        return 1;
    }
    return 0;
}

static int save(const op_ctx *x, lm_st_writer *w, const char *op, const char *out_path, int rc) {
    lm_error err = {LM_OK, ""};
    if (!rc && lm_st_writer_meta(w, "op", op, &err) != LM_OK) {
        fprintf(stderr, "%s: %s: %s\n", x->prog, out_path, err.msg);
        rc = 1;
    }
    if (!rc && lm_st_writer_save(w, out_path, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg[0] ? err.msg : lm_status_str(err.status));
        rc = 1;
    }
    lm_st_writer_free(w);
    return rc;
}

/* Router state holding the bias tensor (or zeros). */
static int make_state(op_ctx *x, lm_router_state *st, int E, const char *bias_name) {
    lm_error err = {LM_OK, ""};
    if (lm_router_state_init(st, E, &err) != LM_OK)
        return fail(x, "%s", err.msg);
    if (lm_st_find(&x->st, bias_name)) {
        const float *b = load_f32(x, bias_name);
        if (!b)
            return 1;
        memcpy(st->e_score_correction_bias, b, sizeof(float) * (size_t)E);
    }
    return 0;
}

/* ---------------------------------------------------------------- moe_router */

static int run_router(op_ctx *x, const char *out_path) {
    static const char *const names[] = {"logits", "e_score_correction_bias", "dtopk_weight"};
    const lm_st_entry *lg, *bias, *dw;
    if (get_entry(x, "logits", 1, 2, "[T,E]", &lg))
        return 1;
    const int T = (int)lg->shape[0], E = (int)lg->shape[1];
    char from[200], ls[160];
    lm_cli_fmt_shape(ls, sizeof(ls), 2, lg->shape);
    snprintf(from, sizeof(from), "logits %s", ls);
    if (get_entry(x, "e_score_correction_bias", 0, 1, "[E]", &bias))
        return 1;
    if (bias && check_dim(x, bias, 0, E, "E", from))
        return 1;
    if (get_entry(x, "dtopk_weight", 0, 2, "[T,k]", &dw))
        return 1;
    if (dw && check_dim(x, dw, 0, T, "T", from))
        return 1;
    warn_unknown_tensors(x, names, 3);
    if (read_router_meta(x, E, dw ? (int)dw->shape[1] : 0))
        return 1;
    if (check_size_key(x, "num_experts", E, from))
        return 1;
    lm_error err = {LM_OK, ""};
    if (lm_router_config_validate(&x->rc, &err) != LM_OK)
        return fail(x, "%s", err.msg);
    const int k = x->rc.num_experts_per_tok;
    if (dw && dw->shape[1] != k)
        return fail(x,
                    "tensor 'dtopk_weight' shape [%lld,%lld]: dim 1 (k) is %lld but "
                    "__metadata__ 'num_experts_per_tok' = %d",
                    (long long)dw->shape[0], (long long)dw->shape[1], (long long)dw->shape[1], k);

    const float *logits = load_f32(x, "logits");
    const float *dtw = dw ? load_f32(x, "dtopk_weight") : NULL;
    if (!logits || (dw && !dtw))
        return 1;
    lm_router_state st;
    memset(&st, 0, sizeof(st));
    lm_route r;
    memset(&r, 0, sizeof(r));
    int rc = make_state(x, &st, E, "e_score_correction_bias");
    float *dlogits = NULL;
    if (!rc && lm_router_forward(&x->rc, &st, logits, T, NULL, 0, x->training, &r, &err) != LM_OK)
        rc = fail(x, "%s", err.msg);
    if (!rc && dtw) {
        dlogits = alloc_f32(x, (int64_t)T * E);
        if (!dlogits)
            rc = fail(x, "out of memory allocating dlogits [%d,%d]", T, E);
        else if (lm_router_backward(&x->rc, &r, dtw, dlogits, &err) != LM_OK)
            rc = fail(x, "%s", err.msg);
    }
    if (!rc) {
        lm_st_writer w;
        lm_st_writer_init(&w);
        const int64_t tk[2] = {T, k}, te[2] = {T, E};
        rc = add_out(x, &w, "topk_idx", LM_I64, 2, tk, r.topk_idx);
        if (!rc)
            rc = add_out(x, &w, "topk_weight", LM_F32, 2, tk, r.topk_weight);
        if (!rc && x->training)
            rc = add_out(x, &w, "keep", LM_U8, 2, tk, r.keep);
        if (!rc && dlogits)
            rc = add_out(x, &w, "dlogits", LM_F32, 2, te, dlogits);
        rc = save(x, &w, "moe_router", out_path, rc);
    }
    lm_route_free(&r);
    lm_router_state_free(&st);
    return rc;
}

/* ---------------------------------------------------------------- moe */

static int run_layer(op_ctx *x, const char *out_path) {
    static const char *const names[] = {"x",
                                        "gate.weight",
                                        "experts.gate_proj",
                                        "experts.up_proj",
                                        "experts.down_proj",
                                        "shared_experts.gate_proj",
                                        "shared_experts.up_proj",
                                        "shared_experts.down_proj",
                                        "e_score_correction_bias",
                                        "do"};
    const lm_st_entry *ex, *ew[LM_MOE_N_WEIGHTS], *bias, *edo;
    if (get_entry(x, "x", 1, 2, "[T,hidden_size]", &ex))
        return 1;
    static const char *const dims[LM_MOE_N_WEIGHTS] = {
        "[num_experts,hidden_size]",
        "[num_experts,moe_intermediate_size,hidden_size]",
        "[num_experts,moe_intermediate_size,hidden_size]",
        "[num_experts,hidden_size,moe_intermediate_size]",
        "[n_shared_experts*moe_intermediate_size,hidden_size]",
        "[n_shared_experts*moe_intermediate_size,hidden_size]",
        "[hidden_size,n_shared_experts*moe_intermediate_size]"};
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        const int shared = i >= LM_MOE_SHARED_GATE_PROJ, nd = shared || i == 0 ? 2 : 3;
        if (get_entry(x, lm_moe_weight_name((lm_moe_weight_id)i), !shared, nd, dims[i], &ew[i]))
            return 1;
    }
    const int T = (int)ex->shape[0], d = (int)ex->shape[1];
    const int E = (int)ew[LM_MOE_GATE_WEIGHT]->shape[0];
    const int f = (int)ew[LM_MOE_EXPERTS_GATE_PROJ]->shape[1];
    char xs[160], from[200];
    lm_cli_fmt_shape(xs, sizeof(xs), 2, ex->shape);
    snprintf(from, sizeof(from), "x %s", xs);
    if (check_dim(x, ew[LM_MOE_GATE_WEIGHT], 1, d, "hidden_size", from))
        return 1;
    /* shared experts: all three or none; width a multiple of f */
    const int ns_present =
        !!ew[LM_MOE_SHARED_GATE_PROJ] + !!ew[LM_MOE_SHARED_UP_PROJ] + !!ew[LM_MOE_SHARED_DOWN_PROJ];
    if (ns_present != 0 && ns_present != 3)
        return fail(x,
                    "shared experts need all of shared_experts.gate_proj, .up_proj and "
                    ".down_proj (got %d of 3)",
                    ns_present);
    int n_shared = 0;
    if (ns_present) {
        const int64_t fs = ew[LM_MOE_SHARED_GATE_PROJ]->shape[0];
        if (fs % f != 0)
            return fail(x,
                        "tensor 'shared_experts.gate_proj' dim 0 = %lld is not a multiple of "
                        "moe_intermediate_size = %d (from experts.gate_proj dim 1)",
                        (long long)fs, f);
        n_shared = (int)(fs / f);
    }
    if (get_entry(x, "e_score_correction_bias", 0, 1, "[num_experts]", &bias))
        return 1;
    if (get_entry(x, "do", 0, 2, "[T,hidden_size]", &edo))
        return 1;
    warn_unknown_tensors(x, names, 10);
    if (read_router_meta(x, E, 0))
        return 1;
    if (check_size_key(x, "num_experts", E, "gate.weight dim 0") ||
        check_size_key(x, "hidden_size", d, "x dim 1") ||
        check_size_key(x, "moe_intermediate_size", f, "experts.gate_proj dim 1") ||
        check_size_key(x, "n_shared_experts", n_shared,
                       "shared_experts.gate_proj dim 0 / moe_intermediate_size"))
        return 1;

    lm_moe_config c;
    lm_moe_config_default(&c, d, f, E, 1, n_shared);
    c.router = x->rc;
    lm_error err = {LM_OK, ""};
    if (lm_moe_config_validate(&c, &err) != LM_OK)
        return fail(x, "%s", err.msg);
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        if (!ew[i])
            continue;
        if (lm_moe_check_weight_shape(&c, (lm_moe_weight_id)i, ew[i]->ndim, ew[i]->shape, &err) !=
            LM_OK)
            return fail(x,
                        "%s (hidden_size from x, num_experts from gate.weight, "
                        "moe_intermediate_size from experts.gate_proj)",
                        err.msg);
    }
    if (bias && check_dim(x, bias, 0, E, "num_experts", "gate.weight dim 0"))
        return 1;
    if (edo && (check_dim(x, edo, 0, T, "T", from) || check_dim(x, edo, 1, d, "hidden_size", from)))
        return 1;
    const int k = c.router.num_experts_per_tok;
    if ((int64_t)T * k > INT32_MAX)
        return fail(x, "T * num_experts_per_tok = %lld is too large", (long long)T * k);

    lm_moe_weights W;
    memset(&W, 0, sizeof(W));
    const float *xin = load_f32(x, "x");
    if (!xin)
        return 1;
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
        if (ew[i] && !(W.p[i] = load_f32(x, lm_moe_weight_name((lm_moe_weight_id)i))))
            return 1;
    const float *dout = edo ? load_f32(x, "do") : NULL;
    if (edo && !dout)
        return 1;

    lm_router_state st;
    memset(&st, 0, sizeof(st));
    lm_moe_ctx *ctx = NULL;
    int rc = make_state(x, &st, E, "e_score_correction_bias");
    if (!rc && lm_moe_ctx_new(&ctx, &c, T, &err) != LM_OK)
        rc = fail(x, "%s", err.msg);
    const int64_t nx = (int64_t)T * d;
    float *out = rc ? NULL : alloc_f32(x, nx);
    if (!rc && !out)
        rc = fail(x, "out of memory allocating out [%d,%d]", T, d);
    if (!rc && lm_moe_forward(ctx, &W, &st, xin, T, NULL, 0, x->training, out, &err) != LM_OK)
        rc = fail(x, "%s", err.msg);
    float *dx = NULL;
    lm_moe_grads g;
    memset(&g, 0, sizeof(g));
    if (!rc && dout) {
        dx = alloc_f32(x, nx);
        int ok = dx != NULL;
        for (int i = 0; ok && i < LM_MOE_N_WEIGHTS; i++) {
            if (!ew[i])
                continue;
            int64_t n = 1;
            for (int q = 0; q < ew[i]->ndim; q++)
                n *= ew[i]->shape[q];
            ok = (g.p[i] = alloc_f32(x, n)) != NULL;
        }
        if (!ok)
            rc = fail(x, "out of memory allocating the gradients");
        else if (lm_moe_backward(ctx, &W, xin, dout, dx, &g, &err) != LM_OK)
            rc = fail(x, "%s", err.msg);
    }
    if (!rc) {
        const lm_route *r = lm_moe_ctx_route(ctx);
        lm_st_writer w;
        lm_st_writer_init(&w);
        const int64_t tk[2] = {T, k};
        rc = add_out(x, &w, "out", LM_F32, 2, ex->shape, out);
        if (!rc)
            rc = add_out(x, &w, "topk_idx", LM_I64, 2, tk, r->topk_idx);
        if (!rc)
            rc = add_out(x, &w, "topk_weight", LM_F32, 2, tk, r->topk_weight);
        if (!rc && x->training)
            rc = add_out(x, &w, "keep", LM_U8, 2, tk, r->keep);
        if (!rc && dout) {
            rc = add_out(x, &w, "dx", LM_F32, 2, ex->shape, dx);
            for (int i = 0; !rc && i < LM_MOE_N_WEIGHTS; i++) {
                if (!ew[i])
                    continue;
                char name[64];
                snprintf(name, sizeof(name), "d%s", lm_moe_weight_name((lm_moe_weight_id)i));
                rc = add_out(x, &w, name, LM_F32, ew[i]->ndim, ew[i]->shape, g.p[i]);
            }
        }
        rc = save(x, &w, "moe", out_path, rc);
    }
    lm_moe_ctx_free(ctx);
    lm_router_state_free(&st);
    return rc;
}

static int run_op(const char *prog, const char *in_path, const char *out_path, int layer) {
    op_ctx x;
    memset(&x, 0, sizeof(x));
    x.prog = prog;
    x.in_path = in_path;
    lm_error err = {LM_OK, ""};
    int rc;
    if (lm_st_read(in_path, &x.st, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg[0] ? err.msg : lm_status_str(err.status));
        rc = 1;
    } else {
        rc = layer ? run_layer(&x, out_path) : run_router(&x, out_path);
    }
    ctx_free(&x);
    return rc;
}

/* Entry points for tools/linmoe.c; return exit codes (0 ok, 1 bad input). */
int lm_cli_op_moe_router(const char *prog, const char *in_path, const char *out_path);
int lm_cli_op_moe(const char *prog, const char *in_path, const char *out_path);

int lm_cli_op_moe_router(const char *prog, const char *in_path, const char *out_path) {
    return run_op(prog, in_path, out_path, 0);
}

int lm_cli_op_moe(const char *prog, const char *in_path, const char *out_path) {
    return run_op(prog, in_path, out_path, 1);
}
