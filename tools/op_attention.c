/* The op runner for causal grouped-query softmax attention (DESIGN.md "The op
 * runner"): `linmoe op attention --in IN --out OUT`. Reads q, k, v (and optionally
 * cu_seqlens and the upstream gradient do) and the attributes from a safetensors
 * file, checks every shape against every other and every attribute, runs
 * lm_attention_forward (and lm_attention_backward when do is present) on the CPU,
 * and writes o, lse (and dq, dk, dv) atomically as F32.
 *
 *   IN tensors     q [B,T,Hq,D]  k [B,T,Hkv,D]  v [B,T,Hkv,D]          (F32/F64/BF16/F16)
 *                  cu_seqlens [N+1] (I64 or I32, B == 1)  do [B,T,Hq,D]  optional
 *   IN metadata    scale (D^-0.5), causal = true|false (true; false is refused),
 *                  position = rope|nope (nope), rope_theta (10000; only with rope)
 *   OUT            o [B,T,Hq,D], lse [B,T,Hq]; with do: dq, dk, dv
 *
 * No math here: shapes, attributes and plumbing only; values are checked by
 * lm_attention_validate and computed by include/linmoe/attention.h.
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
#include "linmoe/attention.h"
#include "linmoe/core.h"
#include "linmoe/safetensors.h"

enum { T_Q, T_K, T_V, T_CU, T_DO, T_COUNT };
static const char *const k_names[T_COUNT] = {"q", "k", "v", "cu_seqlens", "do"};
static const char *const k_meta_keys[] = {"scale", "causal", "position", "rope_theta",
                                          "format" /* written by torch's safetensors; ignored */};

typedef struct {
    const char *prog, *in_path;
    lm_safetensors st;
    const lm_st_entry *e[T_COUNT];
    float *f[T_COUNT]; /* fp32 copies of the float tensors */
    int64_t *cu;
    float *o, *lse, *dq, *dk, *dv;
} op_ctx;

static void ctx_free(op_ctx *x) {
    for (int i = 0; i < T_COUNT; i++)
        free(x->f[i]);
    free(x->cu);
    free(x->o);
    free(x->lse);
    free(x->dq);
    free(x->dk);
    free(x->dv);
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



static int parse_double(const char *s, double *out) {
    char *end = NULL;
    errno = 0;
    double d = strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(d))
        return -1;
    *out = d;
    return 0;
}

/* ---------------------------------------------------------------- metadata */

static int read_metadata(op_ctx *x, lm_attention_config *c, int *has_scale) {
    const lm_safetensors *st = &x->st;
    const char *s;
    *has_scale = 0;
    if ((s = lm_st_meta(st, "scale")) != NULL) {
        double d;
        if (parse_double(s, &d) != 0 || fabs(d) > 3.0e38)
            return fail(x, "__metadata__ 'scale' = '%s' is not a finite number", s);
        c->scale = (float)d;
        *has_scale = 1;
    }
    if ((s = lm_st_meta(st, "causal")) != NULL) {
        if (lm_cli_parse_bool(s, &c->causal) != 0)
            return fail(x, "__metadata__ 'causal' = '%s' is not true or false", s);
        if (!c->causal)
            return fail(x, "__metadata__ 'causal' = '%s': only causal attention is implemented", s);
    }
    if ((s = lm_st_meta(st, "position")) != NULL) {
        if (strcmp(s, "rope") == 0)
            c->position = LM_POS_ROPE;
        else if (strcmp(s, "nope") == 0)
            c->position = LM_POS_NOPE;
        else
            return fail(x, "__metadata__ 'position' = '%s' is not one of rope|nope", s);
    }
    if ((s = lm_st_meta(st, "rope_theta")) != NULL) {
        if (parse_double(s, &c->rope_theta) != 0 || !(c->rope_theta > 0.0))
            return fail(x, "__metadata__ 'rope_theta' = '%s' is not a finite number > 0", s);
        if (c->position != LM_POS_ROPE)
            return fail(x,
                        "__metadata__ 'rope_theta' = '%s' is given but 'position' is nope "
                        "(set position = rope, or drop rope_theta)",
                        s);
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

/* Entry `t` has shape `want` (4 dims named `dn`), as derived from `from`. */
static int check_shape4(const op_ctx *x, int t, const int64_t *want, const char *const *dn,
                        const char *from) {
    const lm_st_entry *e = x->e[t];
    char have[160], exp[160];
    lm_cli_fmt_shape(have, sizeof(have), e->ndim, e->shape);
    lm_cli_fmt_shape(exp, sizeof(exp), 4, want);
    if (e->ndim != 4)
        return fail(x, "tensor '%s' shape %s has %d dims; expected 4: [%s,%s,%s,%s] = %s (from %s)",
                    k_names[t], have, e->ndim, dn[0], dn[1], dn[2], dn[3], exp, from);
    for (int i = 0; i < 4; i++)
        if (e->shape[i] != want[i])
            return fail(
                x, "tensor '%s' shape %s does not match %s: dim %d (%s) is %lld, expected %lld",
                k_names[t], have, from, i, dn[i], (long long)e->shape[i], (long long)want[i]);
    return 0;
}

static int check_shapes(op_ctx *x) {
    for (int t = 0; t < T_COUNT; t++) {
        x->e[t] = lm_st_find(&x->st, k_names[t]);
        if (!x->e[t] && t <= T_V)
            return fail(x, "missing required tensor '%s' (op attention needs q, k, v)", k_names[t]);
        if (!x->e[t])
            continue;
        const lm_dtype dt = x->e[t]->dtype;
        if (t == T_CU) {
            if (dt != LM_I64 && dt != LM_I32)
                return fail(x, "tensor 'cu_seqlens' has dtype %s; expected I64 or I32",
                            lm_dtype_name(dt));
        } else if (dt != LM_F32 && dt != LM_F64 && dt != LM_BF16 && dt != LM_F16) {
            return fail(x, "tensor '%s' has dtype %s; expected F32, F64, BF16 or F16", k_names[t],
                        lm_dtype_name(dt));
        }
    }
    for (int i = 0; i < x->st.n_entries; i++) {
        int known = 0;
        for (int t = 0; t < T_COUNT; t++)
            known |= strcmp(x->st.entries[i].name, k_names[t]) == 0;
        if (!known)
            fprintf(stderr, "%s: warning: %s: tensor '%s' is not an input of this op; ignored\n",
                    x->prog, x->in_path, x->st.entries[i].name);
    }
    static const char *const qn[] = {"B", "T", "Hq", "D"};
    static const char *const kn[] = {"B", "T", "Hkv", "D"};
    const lm_st_entry *q = x->e[T_Q], *k = x->e[T_K];
    char qs[160], ks[160], from[400];
    lm_cli_fmt_shape(qs, sizeof(qs), q->ndim, q->shape);
    if (q->ndim != 4)
        return fail(x, "tensor 'q' shape %s has %d dims; expected 4: [B,T,Hq,D]", qs, q->ndim);
    for (int i = 0; i < 4; i++) {
        if (q->shape[i] <= 0)
            return fail(x, "tensor 'q' shape %s: dim %d (%s) must be positive", qs, i, qn[i]);
        if (q->shape[i] > INT_MAX)
            return fail(x, "tensor 'q' shape %s: dim %d (%s) = %lld is too large (max %d)", qs, i,
                        qn[i], (long long)q->shape[i], INT_MAX);
    }
    const int64_t B = q->shape[0], T = q->shape[1], Hq = q->shape[2], D = q->shape[3];
    snprintf(from, sizeof(from), "q %s", qs);
    lm_cli_fmt_shape(ks, sizeof(ks), k->ndim, k->shape);
    if (k->ndim != 4)
        return fail(x, "tensor 'k' shape %s has %d dims; expected 4: [B,T,Hkv,D]", ks, k->ndim);
    const int64_t Hkv = k->shape[2];
    if (Hkv <= 0 || Hkv > INT_MAX)
        return fail(x, "tensor 'k' shape %s: dim 2 (Hkv) = %lld must be in [1, %d]", ks,
                    (long long)Hkv, INT_MAX);
    {
        const int64_t want[4] = {B, T, Hkv, D};
        if (check_shape4(x, T_K, want, kn, from))
            return LM_EXIT_BAD_INPUT;
    }
    if (Hq % Hkv != 0)
        return fail(x,
                    "tensor 'k' shape %s: dim 2 (Hkv) = %lld does not divide q's dim 2 (Hq) = %lld "
                    "(grouped-query attention needs Hq a multiple of Hkv)",
                    ks, (long long)Hkv, (long long)Hq);
    snprintf(from, sizeof(from), "q %s and k %s", qs, ks);
    {
        const int64_t want[4] = {B, T, Hkv, D};
        if (check_shape4(x, T_V, want, kn, from))
            return LM_EXIT_BAD_INPUT;
    }
    if (x->e[T_DO]) {
        const int64_t want[4] = {B, T, Hq, D};
        if (check_shape4(x, T_DO, want, qn, from))
            return LM_EXIT_BAD_INPUT;
    }
    if (x->e[T_CU]) {
        const lm_st_entry *cu = x->e[T_CU];
        char cs[160];
        lm_cli_fmt_shape(cs, sizeof(cs), cu->ndim, cu->shape);
        if (cu->ndim != 1)
            return fail(x, "tensor 'cu_seqlens' shape %s has %d dims; expected 1: [N+1]", cs,
                        cu->ndim);
        if (cu->shape[0] < 2)
            return fail(
                x, "tensor 'cu_seqlens' shape %s: needs at least 2 entries (N+1 with N >= 1)", cs);
        if (cu->shape[0] > INT_MAX)
            return fail(x, "tensor 'cu_seqlens' shape %s: too many entries (max %d)", cs, INT_MAX);
        if (B != 1)
            return fail(x,
                        "tensor 'cu_seqlens' is given but q %s has dim 0 (B) = %lld; packed "
                        "documents need B == 1",
                        qs, (long long)B);
    }
    return 0;
}

/* ---------------------------------------------------------------- run */

static float *alloc_out(const op_ctx *x, const char *what, int64_t n, int *rc) {
    float *p =
        n > 0 && (uint64_t)n <= SIZE_MAX / sizeof(float) ? calloc((size_t)n, sizeof(float)) : NULL;
    if (!p)
        *rc = fail(x, "out of memory allocating output '%s' (%lld floats)", what, (long long)n);
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

static int run(op_ctx *x, const char *out_path) {
    lm_error err = {LM_OK, ""};
    if (lm_st_read(x->in_path, &x->st, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", x->prog, err.msg[0] ? err.msg : lm_status_str(err.status));
        return LM_EXIT_BAD_INPUT;
    }
    /* attributes first (a bad attribute is reported before the shapes), over defaults
     * whose dims are filled in below */
    lm_attention_config m;
    lm_attention_config_default(&m, 1, 1, 1, 1, 1);
    int rc, has_scale;
    if ((rc = read_metadata(x, &m, &has_scale)) != 0)
        return rc;
    if ((rc = check_shapes(x)) != 0)
        return rc;
    const lm_st_entry *q = x->e[T_Q], *k = x->e[T_K];
    const int B = (int)q->shape[0], T = (int)q->shape[1], Hq = (int)q->shape[2],
              D = (int)q->shape[3];
    const int Hkv = (int)k->shape[2];
    lm_attention_config c;
    lm_attention_config_default(&c, B, T, Hq, Hkv, D);
    if (has_scale)
        c.scale = m.scale;
    c.causal = m.causal;
    c.position = m.position;
    c.rope_theta = m.rope_theta;

    for (int t = 0; t < T_COUNT; t++) {
        if (!x->e[t])
            continue;
        if (t == T_CU) {
            if (lm_st_to_i64(&x->st, "cu_seqlens", &x->cu, &err) != LM_OK) {
                fprintf(stderr, "%s: %s\n", x->prog, err.msg); /* names the file */
                return LM_EXIT_BAD_INPUT;
            }
            c.cu_seqlens = x->cu;
            c.n_cu_seqlens = (int)x->e[t]->shape[0];
        } else if (lm_st_to_f32(&x->st, k_names[t], &x->f[t], &err) != LM_OK) {
            fprintf(stderr, "%s: %s\n", x->prog, err.msg); /* names the file and tensor */
            return LM_EXIT_BAD_INPUT;
        }
    }
    lm_attention_inputs in = {x->f[T_Q], x->f[T_K], x->f[T_V]};
    if (lm_attention_validate(&c, &in, &err) != LM_OK)
        return fail(x, "%s", err.msg);

    const int64_t nq = (int64_t)B * T * Hq * D, nk = (int64_t)B * T * Hkv * D;
    const int64_t o_shape[4] = {B, T, Hq, D}, l_shape[3] = {B, T, Hq};
    const int backward = x->e[T_DO] != NULL;
    rc = 0;
    if (!(x->o = alloc_out(x, "o", nq, &rc)))
        return rc;
    if (!(x->lse = alloc_out(x, "lse", (int64_t)B * T * Hq, &rc)))
        return rc;
    if (lm_attention_forward(&c, &in, x->o, x->lse, &err) != LM_OK)
        return fail(x, "%s", err.msg);
    if (backward) {
        if (!(x->dq = alloc_out(x, "dq", nq, &rc)))
            return rc;
        if (!(x->dk = alloc_out(x, "dk", nk, &rc)))
            return rc;
        if (!(x->dv = alloc_out(x, "dv", nk, &rc)))
            return rc;
        lm_attention_grads gr = {x->f[T_DO], x->dq, x->dk, x->dv};
        if (lm_attention_backward(&c, &in, x->o, x->lse, &gr, &err) != LM_OK)
            return fail(x, "%s", err.msg);
    }

    lm_st_writer w;
    lm_st_writer_init(&w);
    rc = add_out(x, &w, "o", 4, o_shape, x->o);
    if (!rc)
        rc = add_out(x, &w, "lse", 3, l_shape, x->lse);
    if (!rc && backward) {
        rc = add_out(x, &w, "dq", 4, o_shape, x->dq);
        if (!rc)
            rc = add_out(x, &w, "dk", 4, k->shape, x->dk);
        if (!rc)
            rc = add_out(x, &w, "dv", 4, k->shape, x->dv);
    }
    if (!rc && lm_st_writer_meta(&w, "op", "attention", &err) != LM_OK) {
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

/* `linmoe op attention`: exit 0 on success, 1 on bad input or an I/O failure. */
int lm_cli_op_attention(const char *prog, const char *in_path, const char *out_path);
int lm_cli_op_attention(const char *prog, const char *in_path, const char *out_path) {
    op_ctx x;
    memset(&x, 0, sizeof(x));
    x.prog = prog;
    x.in_path = in_path;
    int rc = run(&x, out_path);
    ctx_free(&x);
    return rc;
}
