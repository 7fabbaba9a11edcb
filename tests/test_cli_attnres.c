/* `linmoe op attnres` from outside: inputs written with the safetensors writer (F32,
 * F64 and BF16 storage), the CLI run through $LINMOE_BIN, every output read back
 * and compared bit for bit with a direct call of lm_attnres_forward_ptrs /
 * _backward_ptrs on the same fp32 values. Then the bad-input matrix: each case exits
 * 1 with a message naming the file and the tensor or attribute, never by a signal
 * or a sanitizer report, and leaves an existing OUT untouched.
 */
#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_util.h"
#include "test_util.h"

#include "linmoe/attnres.h"
#include "linmoe/core.h"
#include "linmoe/safetensors.h"

/* ---------------------------------------------------------------- temp dir */







/* No crash: a plain exit 1, no signal, no sanitizer report. */
static void assert_clean_failure(int rc, const char *out) {
    if (rc != 1 || strstr(out, "Sanitizer") || strstr(out, "runtime error:"))
        print_message("exit status %d (want 1), output:\n%s\n", rc, out);
    assert_int_equal(rc, 1);
    assert_null(strstr(out, "Sanitizer"));
    assert_null(strstr(out, "runtime error:"));
}

/* ---------------------------------------------------------------- inputs */

#define MAXL 16

typedef struct {
    int L, N, D;
    int has_g, has_do;
    lm_dtype dtype;  /* storage of every input */
    const char *eps; /* NULL: not written (default) */
    const char *scale;
} spec;

typedef struct {
    float *q, *g, *src[MAXL], *dout; /* the values as stored (rounded to the dtype) */
} data;

static float storable(double x, lm_dtype dt) {
    return dt == LM_BF16 ? lm_bf16_round((float)x) : (float)x;
}

static float *gen(int64_t n, uint64_t seed, double mean, double sd, lm_dtype dt) {
    double *x = malloc(sizeof(double) * (size_t)n);
    float *y = malloc(sizeof(float) * (size_t)n);
    assert_non_null(x);
    assert_non_null(y);
    lm_fill_normal(x, n, seed, mean, sd);
    for (int64_t i = 0; i < n; i++)
        y[i] = storable(x[i], dt);
    free(x);
    return y;
}

static void data_gen(const spec *s, data *D, uint64_t seed) {
    memset(D, 0, sizeof *D);
    const int64_t nd = (int64_t)s->N * s->D;
    D->q = gen(s->D, seed, 0.0, 1.5 / sqrt((double)s->D), s->dtype);
    D->g = gen(s->D, seed + 1, 1.0, 0.2, s->dtype);
    for (int m = 0; m < s->L; m++)
        D->src[m] =
            gen(nd, seed + 10 + (uint64_t)m, 0.1 * m, m == 0 ? 0.3 : 0.5 + 0.75 * m, s->dtype);
    D->dout = gen(nd, seed + 2, 0.0, 1.0, s->dtype);
}

static void data_free(const spec *s, data *D) {
    free(D->q), free(D->g), free(D->dout);
    for (int m = 0; m < s->L; m++)
        free(D->src[m]);
}


static void meta(lm_st_writer *w, const char *k, const char *v) {
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_writer_meta(w, k, v, &err), LM_OK);
}

/* Every tensor of the spec except `skip` (a tensor name). */
static void writer_fill(lm_st_writer *w, const spec *s, const data *D, const char *skip) {
    const int64_t vec[1] = {s->D}, mat[2] = {s->N, s->D};
#define SKIP(name) (skip && strcmp(skip, name) == 0)
    if (!SKIP("query"))
        lm_writer_add_as(w, "query", s->dtype, 1, vec, D->q);
    if (s->has_g && !SKIP("rms_weight"))
        lm_writer_add_as(w, "rms_weight", s->dtype, 1, vec, D->g);
    for (int m = 0; m < s->L; m++) {
        char nm[32];
        snprintf(nm, sizeof nm, "residual_%d", m);
        if (!SKIP(nm))
            lm_writer_add_as(w, nm, s->dtype, 2, mat, D->src[m]);
    }
    if (s->has_do && !SKIP("do"))
        lm_writer_add_as(w, "do", s->dtype, 2, mat, D->dout);
#undef SKIP
    if (s->eps)
        meta(w, "eps", s->eps);
    if (s->scale)
        meta(w, "scale", s->scale);
}


/* ---------------------------------------------------------------- direct call */

#define MAX_OUT (MAXL + 4)
typedef struct {
    int n;
    char name[MAX_OUT][32];
    int nd[MAX_OUT];
    int64_t shape[MAX_OUT][2];
    float *p[MAX_OUT];
} result;

static void res_add(result *r, const char *name, int nd, const int64_t *shape, float *owned) {
    assert_true(r->n < MAX_OUT);
    int i = r->n++;
    snprintf(r->name[i], sizeof r->name[i], "%s", name);
    r->nd[i] = nd;
    for (int q = 0; q < nd; q++)
        r->shape[i][q] = shape[q];
    r->p[i] = owned;
}

static void res_free(result *r) {
    for (int i = 0; i < r->n; i++)
        free(r->p[i]);
}

static float *poisoned(int64_t n) {
    float *p = malloc(sizeof(float) * (size_t)n);
    assert_non_null(p);
    lm_poison_f32(p, n);
    return p;
}

static void direct_run(const spec *s, const data *D, result *R) {
    memset(R, 0, sizeof *R);
    lm_attnres_config c;
    lm_attnres_config_default(&c, s->L, s->N, s->D);
    if (s->eps)
        c.eps = (float)strtod(s->eps, NULL); /* as the CLI parses it */
    if (s->scale)
        c.scale = (float)strtod(s->scale, NULL);
    float *ones = malloc(sizeof(float) * (size_t)s->D);
    for (int j = 0; j < s->D; j++)
        ones[j] = 1.0f;
    const float *g = s->has_g ? D->g : ones;
    const float *src[MAXL];
    for (int m = 0; m < s->L; m++)
        src[m] = D->src[m];
    const int64_t nd = (int64_t)s->N * s->D;
    const int64_t vec[1] = {s->D}, mat[2] = {s->N, s->D};
    lm_error err = {LM_OK, ""};
    float *o = poisoned(nd);
    lm_status st = lm_attnres_forward_ptrs(&c, src, D->q, g, o, &err);
    if (st != LM_OK)
        print_message("forward: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
    res_add(R, "o", 2, mat, o);
    if (s->has_do) {
        float *dsrc[MAXL];
        for (int m = 0; m < s->L; m++)
            dsrc[m] = poisoned(nd);
        float *dq = poisoned(s->D), *dg = poisoned(s->D);
        st = lm_attnres_backward_ptrs(&c, src, D->q, g, D->dout, dsrc, dq, dg, &err);
        if (st != LM_OK)
            print_message("backward: %s\n", err.msg);
        assert_int_equal(st, LM_OK);
        res_add(R, "dquery", 1, vec, dq);
        if (s->has_g)
            res_add(R, "drms_weight", 1, vec, dg);
        else
            free(dg);
        for (int m = 0; m < s->L; m++) {
            char nm[32];
            snprintf(nm, sizeof nm, "dresidual_%d", m);
            res_add(R, nm, 2, mat, dsrc[m]);
        }
    }
    free(ones);
}

/* OUT holds exactly R's tensors: F32, same shapes, same bits, all finite. */
static void check_output(const char *path, const result *R) {
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    lm_status rs = lm_st_read(path, &st, &err);
    if (rs != LM_OK)
        print_message("read %s: %s\n", path, err.msg);
    assert_int_equal(rs, LM_OK);
    for (int i = 0; i < R->n; i++) {
        const lm_st_entry *e = lm_st_find(&st, R->name[i]);
        if (!e)
            print_message("missing output tensor '%s'\n", R->name[i]);
        assert_non_null(e);
        assert_int_equal(e->dtype, LM_F32);
        assert_int_equal(e->ndim, R->nd[i]);
        int64_t n = 1;
        for (int q = 0; q < R->nd[i]; q++) {
            assert_int_equal(e->shape[q], R->shape[i][q]);
            n *= e->shape[q];
        }
        if (memcmp(e->data, R->p[i], (size_t)n * sizeof(float)) != 0)
            print_message("%s: CLI != library\n", R->name[i]);
        assert_memory_equal(e->data, R->p[i], (size_t)n * sizeof(float));
        for (int64_t q = 0; q < n; q++)
            assert_true(isfinite(((const float *)e->data)[q]));
    }
    assert_int_equal(st.n_entries, R->n);
    const char *op = lm_st_meta(&st, "op");
    assert_non_null(op);
    assert_string_equal(op, "attnres");
    lm_st_free(&st);
}

static void run_and_compare(const spec *s, uint64_t seed, const char *tag, result *keep) {
    data D;
    data_gen(s, &D, seed);
    char in_name[64], out_name[64];
    snprintf(in_name, sizeof in_name, "%s_in.safetensors", tag);
    snprintf(out_name, sizeof out_name, "%s_out.safetensors", tag);
    const char *in = lm_cli_path(in_name), *out = lm_cli_path(out_name);
    lm_st_writer w;
    lm_st_writer_init(&w);
    writer_fill(&w, s, &D, NULL);
    lm_writer_save(&w, in);
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op attnres --in %s --out %s", in, out);
    if (rc != 0)
        print_message("linmoe op attnres failed (%d):\n%s\n", rc, msg);
    assert_int_equal(rc, 0);
    assert_null(strstr(msg, "warning"));
    result R;
    direct_run(s, &D, &R);
    check_output(out, &R);
    if (keep) {
        /* the caller checks properties of the values; give it the inputs too */
        *keep = R;
        res_add(keep, "src0", 2, keep->shape[0], D.src[0]);
        res_add(keep, "do", 2, keep->shape[0], D.dout);
        D.src[0] = NULL, D.dout = NULL;
    } else {
        res_free(&R);
    }
    data_free(s, &D);
}

/* ---------------------------------------------------------------- good runs */

static void test_forward_f32(void **state) {
    (void)state;
    spec s = {.L = 4, .N = 37, .D = 64, .has_g = 1, .dtype = LM_F32, .eps = "1e-5", .scale = "0.5"};
    run_and_compare(&s, 1, "fwd_f32", NULL);
}

static void test_backward_f64(void **state) {
    (void)state;
    spec s = {.L = 3, .N = 50, .D = 100, .has_g = 1, .has_do = 1, .dtype = LM_F64};
    run_and_compare(&s, 2, "bwd_f64", NULL);
}

/* 11 sources: the file's (sorted) names put residual_10 before residual_2; the op
 * orders them by index. */
static void test_backward_many_sources(void **state) {
    (void)state;
    spec s = {.L = 11, .N = 20, .D = 8, .has_g = 1, .has_do = 1, .dtype = LM_F32, .scale = "2"};
    run_and_compare(&s, 3, "many", NULL);
}

/* BF16 storage, no rms_weight (ones; no drms_weight written), one source: o is the
 * source and dresidual_0 is do. */
static void test_single_source_bf16(void **state) {
    (void)state;
    spec s = {.L = 1, .N = 9, .D = 5, .has_g = 0, .has_do = 1, .dtype = LM_BF16};
    result R;
    run_and_compare(&s, 4, "one", &R);
    /* R: o, dquery, dresidual_0, src0, do */
    assert_int_equal(R.n, 5);
    assert_memory_equal(R.p[0], R.p[3], sizeof(float) * 45);
    assert_memory_equal(R.p[2], R.p[4], sizeof(float) * 45);
    res_free(&R);
}


/* `linmoe op attnres` against fla's naive_attnres (promoted to fp64, autograd for the
 * gradients): tests/fixtures/attnres_naive.safetensors, written on the GPU machine by
 * scripts/reference/make_fixtures.sh (L 5, N 37, D 48, a random non-zero query, eps
 * 1e-6, scale 0.5). The fixture's inputs are copied into a new file (the expected.*
 * tensors are not op inputs); every output is compared with the fp32 tolerances
 * (forward 1e-5, gradients 1e-4 relative RMS). */
static void test_fla_naive_fixture(void **state) {
    (void)state;
    lm_error err = {0};
    lm_safetensors fx;
    lm_status st = lm_st_read("tests/fixtures/attnres_naive.safetensors", &fx, &err);
    if (st != LM_OK) print_message("%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    lm_st_writer w;
    lm_st_writer_init(&w);
    for (int i = 0; i < fx.n_entries; i++) {
        const lm_st_entry *e = &fx.entries[i];
        if (strncmp(e->name, "expected.", 9) == 0) continue;
        assert_int_equal(lm_st_writer_add(&w, e->name, e->dtype, e->ndim, e->shape, e->data,
                                          &err),
                         LM_OK);
    }
    const char *eps = lm_st_meta(&fx, "eps"), *scale = lm_st_meta(&fx, "scale");
    assert_non_null(eps);
    assert_non_null(scale);
    assert_int_equal(lm_st_writer_meta(&w, "eps", eps, &err), LM_OK);
    assert_int_equal(lm_st_writer_meta(&w, "scale", scale, &err), LM_OK);
    const char *in = lm_cli_path("fla_in.safetensors"), *out = lm_cli_path("fla_out.safetensors");
    lm_writer_save(&w, in);
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op attnres --in %s --out %s", in, out);
    if (rc != 0) print_message("linmoe op attnres failed (%d):\n%s\n", rc, msg);
    assert_int_equal(rc, 0);
    lm_safetensors got;
    assert_int_equal(lm_st_read(out, &got, &err), LM_OK);
    static const char *const names[] = {"o", "dquery", "drms_weight", "dresidual_0",
                                        "dresidual_1", "dresidual_2", "dresidual_3",
                                        "dresidual_4"};
    int ok = 1;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char en[64];
        snprintf(en, sizeof en, "expected.%s", names[i]);
        const lm_st_entry *ge = lm_st_find(&got, names[i]), *ee = lm_st_find(&fx, en);
        assert_non_null(ge);
        assert_non_null(ee);
        float *o = NULL;
        double *ref = NULL;
        assert_int_equal(lm_st_to_f32(&got, names[i], &o, &err), LM_OK);
        assert_int_equal(lm_st_to_f64(&fx, en, &ref, &err), LM_OK);
        int64_t n = 1;
        for (int j = 0; j < ee->ndim; j++) n *= ee->shape[j];
        char label[80];
        snprintf(label, sizeof label, "  vs fla naive_attnres: %s", names[i]);
        ok &= lm_check_f32(label, o, ref, n, i == 0 ? 1e-5 : 1e-4);
        free(o);
        free(ref);
    }
    assert_true(ok);
    lm_st_free(&got);
    lm_st_free(&fx);
}

static void test_help(void **state) {
    (void)state;
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op --help");
    assert_int_equal(rc, 0);
    lm_assert_says(msg, "op attnres");
    lm_assert_says(msg, "dresidual_i");
    rc = lm_run_cli(msg, sizeof msg, "op attnre --in a --out b");
    assert_int_equal(rc, 2);
    lm_assert_says(msg, "attnres");
}

/* ---------------------------------------------------------------- bad inputs */

/* Fails with exit 1, OUT untouched, no temporary file left. */
static void expect_op_failure(const char *in, char *msg, size_t msg_size) {
    static const char sentinel[] = "sentinel: a previous good output";
    const char *out = lm_cli_path("keep_out.safetensors");
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(sentinel, 1, sizeof sentinel, f), sizeof sentinel);
    assert_int_equal(fclose(f), 0);
    int rc = lm_run_cli(msg, msg_size, "op attnres --in %s --out %s", in, out);
    print_message("  exit %d: %s", rc, msg);
    assert_clean_failure(rc, msg);
    char back[sizeof sentinel + 8];
    f = fopen(out, "rb");
    assert_non_null(f);
    size_t got = fread(back, 1, sizeof back, f);
    fclose(f);
    assert_int_equal(got, sizeof sentinel);
    assert_memory_equal(back, sentinel, sizeof sentinel);
    DIR *d = opendir(lm_cli_dir());
    assert_non_null(d);
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        assert_null(strstr(de->d_name, ".tmp."));
    closedir(d);
}

typedef void (*tweak_fn)(lm_st_writer *w, const spec *s, data *d);

/* The base case (L = 3, N = 6, D = 8, with do) with tensor `skip` left out, the
 * data tweaked before writing (`pre`), then `add` adding its own tensors. The
 * message must name the file and every needle. */
static void bad_case(const char *tag, spec s, const char *skip, tweak_fn pre, tweak_fn add,
                     const char *const *needles) {
    data D;
    data_gen(&s, &D, 99);
    if (pre)
        pre(NULL, &s, &D);
    lm_st_writer w;
    lm_st_writer_init(&w);
    writer_fill(&w, &s, &D, skip);
    if (add)
        add(&w, &s, &D);
    char name[64];
    snprintf(name, sizeof name, "%s.safetensors", tag);
    const char *in = lm_cli_path(name);
    lm_writer_save(&w, in);
    data_free(&s, &D);
    char msg[8192];
    expect_op_failure(in, msg, sizeof msg);
    lm_assert_says(msg, name);
    for (int i = 0; needles && needles[i]; i++)
        lm_assert_says(msg, needles[i]);
}

static spec base(void) {
    return (spec){.L = 3, .N = 6, .D = 8, .has_g = 1, .has_do = 1, .dtype = LM_F32};
}

static void add_res2_only(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t mat[2] = {6, 8};
    lm_writer_add_as(w, "residual_2", LM_F32, 2, mat, d->src[0]);
}

static void add_res2_wide(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t mat[2] = {6, 9};
    float *x = calloc(54, sizeof(float));
    memcpy(x, d->src[2], sizeof(float) * 48);
    lm_writer_add_as(w, "residual_2", LM_F32, 2, mat, x);
    free(x);
}

static void add_do_tall(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t mat[2] = {7, 8};
    float *x = calloc(56, sizeof(float));
    memcpy(x, d->dout, sizeof(float) * 48);
    lm_writer_add_as(w, "do", LM_F32, 2, mat, x);
    free(x);
}

static void add_g_short(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t vec[1] = {7};
    lm_writer_add_as(w, "rms_weight", LM_F32, 1, vec, d->g);
}

static void add_q_2d(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t sh[2] = {1, 8};
    lm_writer_add_as(w, "query", LM_F32, 2, sh, d->q);
}

static void add_res1_i32(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t mat[2] = {6, 8};
    lm_writer_add_as(w, "residual_1", LM_I32, 2, mat, d->src[1]);
}

static void add_res01(lm_st_writer *w, const spec *s, data *d) {
    (void)s;
    const int64_t mat[2] = {6, 8};
    lm_writer_add_as(w, "residual_01", LM_F32, 2, mat, d->src[1]);
}

static void nan_res1(lm_st_writer *w, const spec *s, data *d) {
    (void)w, (void)s;
    d->src[1][13] = NAN; /* row 1, column 5 */
}

static void inf_do(lm_st_writer *w, const spec *s, data *d) {
    (void)w, (void)s;
    d->dout[47] = -INFINITY;
}

static void test_missing_residual(void **state) {
    (void)state;
    /* residual_0 and residual_2 present, residual_1 missing */
    spec s = base();
    s.L = 1;
    const char *n1[] = {"residual_1", "residual_2", NULL};
    bad_case("gap", s, NULL, NULL, add_res2_only, n1);
    /* no sources at all */
    s = base();
    s.L = 0;
    const char *n2[] = {"residual_0", NULL};
    bad_case("nosrc", s, NULL, NULL, NULL, n2);
    /* residual_0 missing */
    s = base();
    const char *n3[] = {"missing tensor 'residual_0'", NULL};
    bad_case("no0", s, "residual_0", NULL, NULL, n3);
    /* query missing */
    const char *n4[] = {"query", NULL};
    bad_case("noq", base(), "query", NULL, NULL, n4);
    /* a non-canonical source name */
    const char *n5[] = {"residual_01", NULL};
    bad_case("badname", base(), NULL, NULL, add_res01, n5);
}

static void test_shape_mismatch(void **state) {
    (void)state;
    const char *n1[] = {"residual_2", "[6,9]", "[6,8]", NULL};
    bad_case("res2wide", base(), "residual_2", NULL, add_res2_wide, n1);
    const char *n2[] = {"'do'", "[7,8]", NULL};
    bad_case("dotall", base(), "do", NULL, add_do_tall, n2);
    const char *n3[] = {"rms_weight", "[7]", NULL};
    bad_case("gshort", base(), "rms_weight", NULL, add_g_short, n3);
    const char *n4[] = {"query", "[1,8]", NULL};
    bad_case("q2d", base(), "query", NULL, add_q_2d, n4);
    const char *n5[] = {"residual_1", "I32", NULL};
    bad_case("resi32", base(), "residual_1", NULL, add_res1_i32, n5);
}

static void test_nonfinite(void **state) {
    (void)state;
    const char *n1[] = {"residual_1", "non-finite", "row 1, column 5", NULL};
    bad_case("nanres", base(), NULL, nan_res1, NULL, n1);
    const char *n2[] = {"'do'", "-inf", NULL};
    bad_case("infdo", base(), NULL, inf_do, NULL, n2);
}

static void test_bad_attributes(void **state) {
    (void)state;
    static const char *const eps_bad[] = {"0", "-1e-6", "abc", "nan", "1e39", ""};
    for (size_t i = 0; i < sizeof eps_bad / sizeof eps_bad[0]; i++) {
        spec s = base();
        s.eps = eps_bad[i];
        char tag[32];
        snprintf(tag, sizeof tag, "eps%zu", i);
        const char *n[] = {"eps", NULL};
        bad_case(tag, s, NULL, NULL, NULL, n);
    }
    spec s = base();
    s.scale = "inf";
    const char *n[] = {"scale", "inf", NULL};
    bad_case("scaleinf", s, NULL, NULL, NULL, n);
}

/* An attribute this op does not use is reported as a warning, not an error. */
static void test_unknown_metadata_warns(void **state) {
    (void)state;
    spec s = base();
    data D;
    data_gen(&s, &D, 5);
    lm_st_writer w;
    lm_st_writer_init(&w);
    writer_fill(&w, &s, &D, NULL);
    meta(&w, "temperature", "3");
    const char *in = lm_cli_path("warn_in.safetensors"), *out = lm_cli_path("warn_out.safetensors");
    lm_writer_save(&w, in);
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op attnres --in %s --out %s", in, out);
    assert_int_equal(rc, 0);
    lm_assert_says(msg, "warning");
    lm_assert_says(msg, "temperature");
    result R;
    direct_run(&s, &D, &R);
    check_output(out, &R);
    res_free(&R);
    data_free(&s, &D);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_f32),
        cmocka_unit_test(test_backward_f64),
        cmocka_unit_test(test_backward_many_sources),
        cmocka_unit_test(test_single_source_bf16),
        cmocka_unit_test(test_fla_naive_fixture),
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_missing_residual),
        cmocka_unit_test(test_shape_mismatch),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_bad_attributes),
        cmocka_unit_test(test_unknown_metadata_warns),
    };
    return cmocka_run_group_tests_name("cli_attnres", tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
