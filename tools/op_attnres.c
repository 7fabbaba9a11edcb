/* The op runner for the AttnRes aggregation (DESIGN.md "The op runner"):
 * `linmoe op attnres --in IN --out OUT`. Reads the pseudo-query, the key-norm gain,
 * the sources residual_0 .. residual_{L-1} and optionally the upstream gradient
 * `do` from a safetensors file (attributes eps and scale in __metadata__), checks
 * every name and shape, runs lm_attnres_forward_ptrs (and _backward_ptrs with do),
 * writes o (and dquery, drms_weight, dresidual_i) atomically.
 *
 * No math here: names, shapes and attributes only; values are checked by
 * lm_attnres_validate and computed by src/ops/attnres.c.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "linmoe/attnres.h"
#include "linmoe/core.h"
#include "linmoe/safetensors.h"

int lm_cli_op_attnres(const char *prog, const char *in_path, const char *out_path);

static const char *const k_meta_keys[] = {"eps", "scale",
                                          "format" /* written by torch's safetensors; ignored */};

typedef struct {
    const char *prog;
    const char *in_path;
    lm_safetensors st;
    int L;
    int64_t N, D;
    const lm_st_entry *query, *rms_weight, *dout;
    const lm_st_entry **res; /* [L] */
    float *q, *g, *ones, *dof, *o, *dq, *dg;
    float **src, **dsrc; /* [L] each */
    lm_attnres_config c;
} op_ctx;

static void ctx_free(op_ctx *x) {
    for (int m = 0; m < x->L; m++) {
        if (x->src)
            free(x->src[m]);
        if (x->dsrc)
            free(x->dsrc[m]);
    }
    free(x->src);
    free(x->dsrc);
    free(x->res);
    free(x->q);
    free(x->g);
    free(x->ones);
    free(x->dof);
    free(x->o);
    free(x->dq);
    free(x->dg);
    lm_attnres_workspace_free(x->c.ws);
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


static int parse_float(const char *s, float *out) {
    char *end = NULL;
    errno = 0;
    double d = strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(d) || fabs(d) > 3.0e38)
        return -1;
    *out = (float)d;
    return 0;
}

static int is_float_dtype(lm_dtype dt) {
    return dt == LM_F32 || dt == LM_F64 || dt == LM_BF16 || dt == LM_F16;
}

static int read_metadata(op_ctx *x) {
    const char *s;
    if ((s = lm_st_meta(&x->st, "eps")) != NULL && parse_float(s, &x->c.eps) != 0)
        return fail(x, "__metadata__ 'eps' = '%s' is not a finite number (default 1e-6)", s);
    if ((s = lm_st_meta(&x->st, "scale")) != NULL && parse_float(s, &x->c.scale) != 0)
        return fail(x, "__metadata__ 'scale' = '%s' is not a finite number (default 1)", s);
    for (int i = 0; i < x->st.n_meta; i++) {
        int known = 0;
        for (size_t j = 0; j < sizeof(k_meta_keys) / sizeof(k_meta_keys[0]); j++)
            known |= strcmp(x->st.meta_keys[i], k_meta_keys[j]) == 0;
        if (!known)
            fprintf(stderr, "%s: warning: %s: __metadata__ key '%s' is not used by this op\n",
                    x->prog, x->in_path, x->st.meta_keys[i]);
    }
    return 0;
}

/* "residual_<i>" with i a canonical decimal (no sign, no leading zero but "0",
 * at most 9 digits): returns i; -1 when the name does not start with "residual_";
 * -2 when it does but the index is not canonical. */
static int residual_index(const char *name) {
    static const char pre[] = "residual_";
    if (strncmp(name, pre, sizeof(pre) - 1) != 0)
        return -1;
    const char *d = name + sizeof(pre) - 1;
    size_t n = strlen(d);
    if (n == 0 || n > 9 || (d[0] == '0' && n > 1))
        return -2;
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (d[i] < '0' || d[i] > '9')
            return -2;
        v = v * 10 + (d[i] - '0');
    }
    return v;
}

/* Find the sources: every residual_<i> for i = 0 .. L-1, none missing. */
static int find_sources(op_ctx *x) {
    int count = 0, maxi = -1;
    for (int i = 0; i < x->st.n_entries; i++) {
        const char *nm = x->st.entries[i].name;
        int k = residual_index(nm);
        if (k == -2)
            return fail(x,
                        "tensor '%s' is not a valid source name (residual_<i> with i = 0, 1, "
                        "2, ... written without leading zeros)",
                        nm);
        if (k < 0)
            continue;
        count++;
        if (k > maxi)
            maxi = k;
    }
    if (count == 0)
        return fail(x, "no source tensors: the op needs residual_0 .. residual_{L-1} (L >= 1)");
    /* count distinct indices (names are unique): all of 0..count-1 present <=> maxi == count-1 */
    x->res = calloc((size_t)count, sizeof(*x->res));
    if (!x->res)
        return fail(x, "out of memory");
    for (int i = 0; i < x->st.n_entries; i++) {
        int k = residual_index(x->st.entries[i].name);
        if (k >= 0 && k < count)
            x->res[k] = &x->st.entries[i];
    }
    for (int k = 0; k < count; k++)
        if (!x->res[k])
            return fail(x,
                        "missing tensor 'residual_%d' (residual_%d is present; the sources must be "
                        "residual_0 .. residual_{L-1} without gaps)",
                        k, maxi);
    LM_CHECK(maxi == count - 1);
    x->L = count;
    return 0;
}

/* Check entry e (named `name`) has shape `want` (ndim wn); `from` says where the
 * expected dims come from. */
static int check_shape(const op_ctx *x, const lm_st_entry *e, const char *name, int wn,
                       const int64_t *want, const char *dims, const char *from) {
    char have[160], exp[160];
    lm_cli_fmt_shape(have, sizeof(have), e->ndim, e->shape);
    lm_cli_fmt_shape(exp, sizeof(exp), wn, want);
    if (!is_float_dtype(e->dtype))
        return fail(x, "tensor '%s' has dtype %s; expected F32, F64, BF16 or F16", name,
                    lm_dtype_name(e->dtype));
    int same = e->ndim == wn;
    for (int i = 0; same && i < wn; i++)
        same = e->shape[i] == want[i];
    if (!same)
        return fail(x, "tensor '%s' shape %s does not match %s: expected %s = %s", name, have, from,
                    dims, exp);
    return 0;
}

static int check_shapes(op_ctx *x) {
    x->query = lm_st_find(&x->st, "query");
    x->rms_weight = lm_st_find(&x->st, "rms_weight");
    x->dout = lm_st_find(&x->st, "do");
    if (!x->query)
        return fail(x, "missing required tensor 'query' [D] (the pseudo-query)");
    int rc;
    if ((rc = find_sources(x)) != 0)
        return rc;
    for (int i = 0; i < x->st.n_entries; i++) {
        const char *nm = x->st.entries[i].name;
        if (strcmp(nm, "query") && strcmp(nm, "rms_weight") && strcmp(nm, "do") &&
            residual_index(nm) < 0)
            fprintf(stderr, "%s: warning: %s: tensor '%s' is not an input of this op; ignored\n",
                    x->prog, x->in_path, nm);
    }
    const lm_st_entry *q = x->query, *r0 = x->res[0];
    char qs[160], rs[160], from[400];
    lm_cli_fmt_shape(qs, sizeof(qs), q->ndim, q->shape);
    if (!is_float_dtype(q->dtype))
        return fail(x, "tensor 'query' has dtype %s; expected F32, F64, BF16 or F16",
                    lm_dtype_name(q->dtype));
    if (q->ndim != 1 || q->shape[0] < 1 || q->shape[0] > (1 << 24))
        return fail(x, "tensor 'query' shape %s: expected [D] with 1 <= D <= %d", qs, 1 << 24);
    x->D = q->shape[0];
    lm_cli_fmt_shape(rs, sizeof(rs), r0->ndim, r0->shape);
    if (!is_float_dtype(r0->dtype))
        return fail(x, "tensor 'residual_0' has dtype %s; expected F32, F64, BF16 or F16",
                    lm_dtype_name(r0->dtype));
    if (r0->ndim != 2 || r0->shape[0] < 1 || r0->shape[1] != x->D)
        return fail(x,
                    "tensor 'residual_0' shape %s does not match query %s: expected [N,D] with "
                    "N >= 1 and D = %lld",
                    rs, qs, (long long)x->D);
    x->N = r0->shape[0];
    snprintf(from, sizeof(from), "query %s and residual_0 %s", qs, rs);
    const int64_t vec[1] = {x->D}, mat[2] = {x->N, x->D};
    if (x->rms_weight && (rc = check_shape(x, x->rms_weight, "rms_weight", 1, vec, "[D]", from)))
        return rc;
    for (int m = 1; m < x->L; m++) {
        char nm[32];
        snprintf(nm, sizeof(nm), "residual_%d", m);
        if ((rc = check_shape(x, x->res[m], nm, 2, mat, "[N,D]", from)))
            return rc;
    }
    if (x->dout && (rc = check_shape(x, x->dout, "do", 2, mat, "[N,D]", from)))
        return rc;
    return 0;
}

static float *alloc_f32(const op_ctx *x, const char *what, int64_t n, int *rc) {
    float *p = (n > 0 && (uint64_t)n <= SIZE_MAX / sizeof(float))
                   ? malloc((size_t)n * sizeof(float))
                   : NULL;
    if (!p)
        *rc = fail(x, "out of memory allocating '%s' (%lld floats)", what, (long long)n);
    return p;
}

static int load(const op_ctx *x, const char *name, float **out) {
    lm_error err = {LM_OK, ""};
    if (lm_st_to_f32(&x->st, name, out, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg); /* names the file and tensor */
        return LM_EXIT_BAD_INPUT;
    }
    return 0;
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

static int run(op_ctx *x, const char *out_path) {
    lm_error err = {LM_OK, ""};
    if (lm_st_read(x->in_path, &x->st, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg[0] ? err.msg : lm_status_str(err.status));
        return LM_EXIT_BAD_INPUT;
    }
    int rc;
    if ((rc = read_metadata(x)) != 0)
        return rc;
    if ((rc = check_shapes(x)) != 0)
        return rc;
    x->c.L = x->L, x->c.N = x->N, x->c.D = (int)x->D;

    const int64_t nd = x->N * x->D;
    if (!(x->src = calloc((size_t)x->L, sizeof(float *))))
        return fail(x, "out of memory");
    if ((rc = load(x, "query", &x->q)))
        return rc;
    if (x->rms_weight) {
        if ((rc = load(x, "rms_weight", &x->g)))
            return rc;
    } else {
        if (!(x->ones = alloc_f32(x, "rms_weight (ones)", x->D, &rc)))
            return rc;
        for (int64_t j = 0; j < x->D; j++)
            x->ones[j] = 1.0f;
    }
    for (int m = 0; m < x->L; m++) {
        char nm[32];
        snprintf(nm, sizeof(nm), "residual_%d", m);
        if ((rc = load(x, nm, &x->src[m])))
            return rc;
    }
    if (x->dout && (rc = load(x, "do", &x->dof)))
        return rc;
    const float *g = x->rms_weight ? x->g : x->ones;
    const float *const *src = (const float *const *)x->src;
    if (lm_attnres_validate(&x->c, src, x->q, g, x->dof, &err) != LM_OK)
        return fail(x, "%s", err.msg);

    x->c.ws = lm_attnres_workspace_new();
    if (!(x->o = alloc_f32(x, "o", nd, &rc)))
        return rc;
    if (lm_attnres_forward_ptrs(&x->c, src, x->q, g, x->o, &err) != LM_OK)
        return fail(x, "%s", err.msg);
    if (x->dout) {
        if (!(x->dsrc = calloc((size_t)x->L, sizeof(float *))))
            return fail(x, "out of memory");
        for (int m = 0; m < x->L; m++)
            if (!(x->dsrc[m] = alloc_f32(x, "dresidual", nd, &rc)))
                return rc;
        if (!(x->dq = alloc_f32(x, "dquery", x->D, &rc)))
            return rc;
        if (x->rms_weight && !(x->dg = alloc_f32(x, "drms_weight", x->D, &rc)))
            return rc;
        if (lm_attnres_backward_ptrs(&x->c, src, x->q, g, x->dof, x->dsrc, x->dq, x->dg, &err) !=
            LM_OK)
            return fail(x, "%s", err.msg);
    }

    lm_st_writer w;
    lm_st_writer_init(&w);
    const int64_t vec[1] = {x->D}, mat[2] = {x->N, x->D};
    rc = add_out(x, &w, "o", 2, mat, x->o);
    if (!rc && x->dout) {
        rc = add_out(x, &w, "dquery", 1, vec, x->dq);
        if (!rc && x->dg)
            rc = add_out(x, &w, "drms_weight", 1, vec, x->dg);
        for (int m = 0; !rc && m < x->L; m++) {
            char nm[32];
            snprintf(nm, sizeof(nm), "dresidual_%d", m);
            rc = add_out(x, &w, nm, 2, mat, x->dsrc[m]);
        }
    }
    if (!rc && lm_st_writer_meta(&w, "op", "attnres", &err) != LM_OK) {
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

int lm_cli_op_attnres(const char *prog, const char *in_path, const char *out_path) {
    op_ctx x;
    memset(&x, 0, sizeof(x));
    x.prog = prog;
    x.in_path = in_path;
    lm_attnres_config_default(&x.c, 1, 1, 1);
    int rc = run(&x, out_path);
    ctx_free(&x);
    return rc;
}
