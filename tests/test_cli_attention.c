/* `linmoe op attention` from outside: inputs written with the safetensors writer (F32,
 * BF16 and F64 storage; cu_seqlens as I64 and I32), the CLI run through $LINMOE_BIN,
 * and every output read back and compared bit for bit with a direct call of
 * lm_attention_forward / lm_attention_backward on the same fp32 values. Then the
 * bad-input matrix: each case exits 1 with a message naming the file and the field,
 * never by a signal or a sanitizer report, and leaves an existing OUT untouched.
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

#include "linmoe/attention.h"
#include "linmoe/core.h"
#include "linmoe/safetensors.h"

/* ---------------------------------------------------------------- temp dir */







/* ---------------------------------------------------------------- inputs */

enum { I_Q, I_K, I_V, I_DO, NI };
static const char *const k_slot[NI] = {"q", "k", "v", "do"};

typedef struct {
    int B, T, Hq, Hkv, D;
    const int64_t *cu; /* NULL or [ncu] */
    int ncu;
    lm_dtype cu_dtype; /* I64 or I32 */
    int has_do;
    lm_dtype dtype;       /* storage of the float inputs */
    const char *position; /* NULL: not written (nope) */
    const char *theta;    /* NULL: not written */
    const char *scale;    /* NULL: not written */
    const char *causal;   /* NULL: not written */
} spec;

typedef struct {
    int64_t shape[NI][4];
    int64_t n[NI];
    float *t[NI];
} data;

static float storable(float x, lm_dtype dt) { return dt == LM_BF16 ? lm_bf16_round(x) : x; }

static void data_gen(const spec *s, data *D, uint64_t seed) {
    memset(D, 0, sizeof *D);
    for (int i = 0; i < NI; i++) {
        const int H = (i == I_K || i == I_V) ? s->Hkv : s->Hq;
        const int64_t sh[4] = {s->B, s->T, H, s->D};
        memcpy(D->shape[i], sh, sizeof sh);
        D->n[i] = (int64_t)s->B * s->T * H * s->D;
        double *x = malloc(sizeof(double) * (size_t)D->n[i]);
        assert_non_null(x);
        lm_fill_normal(x, D->n[i], seed + (uint64_t)i, 0.0, 1.0);
        D->t[i] = malloc(sizeof(float) * (size_t)D->n[i]);
        for (int64_t q = 0; q < D->n[i]; q++)
            D->t[i][q] = storable((float)x[q], s->dtype);
        free(x);
    }
}

static void data_free(data *D) {
    for (int i = 0; i < NI; i++)
        free(D->t[i]);
}


static void writer_add_cu(lm_st_writer *w, const int64_t *cu, int n, lm_dtype dt) {
    lm_error err = {LM_OK, ""};
    int32_t c32[64];
    assert_true(n <= 64);
    for (int i = 0; i < n; i++)
        c32[i] = (int32_t)cu[i];
    const int64_t shape[1] = {n};
    assert_int_equal(
        lm_st_writer_add(w, "cu_seqlens", dt, 1, shape, dt == LM_I32 ? (void *)c32 : cu, &err),
        LM_OK);
}

static void meta(lm_st_writer *w, const char *k, const char *v) {
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_writer_meta(w, k, v, &err), LM_OK);
}

/* Every tensor except `skip_t`, and the spec's attributes. */
static void writer_fill(lm_st_writer *w, const spec *s, const data *D, const char *skip_t) {
    for (int i = 0; i < NI; i++) {
        if (i == I_DO && !s->has_do)
            continue;
        if (skip_t && strcmp(skip_t, k_slot[i]) == 0)
            continue;
        lm_writer_add_as(w, k_slot[i], s->dtype, 4, D->shape[i], D->t[i]);
    }
    if (s->cu && !(skip_t && strcmp(skip_t, "cu_seqlens") == 0))
        writer_add_cu(w, s->cu, s->ncu, s->cu_dtype);
    if (s->position)
        meta(w, "position", s->position);
    if (s->theta)
        meta(w, "rope_theta", s->theta);
    if (s->scale)
        meta(w, "scale", s->scale);
    if (s->causal)
        meta(w, "causal", s->causal);
}


/* ---------------------------------------------------------------- direct call */

typedef struct {
    int n;
    const char *name[5];
    int nd[5];
    int64_t shape[5][4];
    float *p[5];
} result;

static void direct_run(const spec *s, const data *D, result *R) {
    memset(R, 0, sizeof *R);
    lm_attention_config c;
    lm_attention_config_default(&c, s->B, s->T, s->Hq, s->Hkv, s->D);
    c.cu_seqlens = s->cu;
    c.n_cu_seqlens = s->cu ? s->ncu : 0;
    if (s->position && strcmp(s->position, "rope") == 0)
        c.position = LM_POS_ROPE;
    if (s->theta)
        c.rope_theta = strtod(s->theta, NULL);
    if (s->scale)
        c.scale = (float)strtod(s->scale, NULL);
    lm_attention_inputs in = {D->t[I_Q], D->t[I_K], D->t[I_V]};
    const int64_t nq = D->n[I_Q], nk = D->n[I_K], nl = (int64_t)s->B * s->T * s->Hq;
    float *o = malloc(sizeof(float) * (size_t)nq), *lse = malloc(sizeof(float) * (size_t)nl);
    lm_error err = {0};
    lm_poison_f32(o, nq), lm_poison_f32(lse, nl);
    lm_status st = lm_attention_forward(&c, &in, o, lse, &err);
    if (st != LM_OK)
        print_message("forward: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
    R->name[0] = "o", R->nd[0] = 4, R->p[0] = o;
    memcpy(R->shape[0], D->shape[I_Q], sizeof(int64_t) * 4);
    R->name[1] = "lse", R->nd[1] = 3, R->p[1] = lse;
    memcpy(R->shape[1], D->shape[I_Q], sizeof(int64_t) * 3);
    R->n = 2;
    if (s->has_do) {
        float *dq = malloc(sizeof(float) * (size_t)nq), *dk = malloc(sizeof(float) * (size_t)nk),
              *dv = malloc(sizeof(float) * (size_t)nk);
        lm_poison_f32(dq, nq), lm_poison_f32(dk, nk), lm_poison_f32(dv, nk);
        lm_attention_grads gr = {D->t[I_DO], dq, dk, dv};
        assert_int_equal(lm_attention_backward(&c, &in, o, lse, &gr, &err), LM_OK);
        const char *nm[3] = {"dq", "dk", "dv"};
        float *ps[3] = {dq, dk, dv};
        const int src[3] = {I_Q, I_K, I_V};
        for (int i = 0; i < 3; i++) {
            R->name[2 + i] = nm[i], R->nd[2 + i] = 4, R->p[2 + i] = ps[i];
            memcpy(R->shape[2 + i], D->shape[src[i]], sizeof(int64_t) * 4);
        }
        R->n = 5;
    }
}

static void res_free(result *R) {
    for (int i = 0; i < R->n; i++)
        free(R->p[i]);
}

/* OUT holds exactly R's tensors, F32, with the same shapes and bits. */
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
        if (memcmp(e->data, R->p[i], sizeof(float) * (size_t)n) != 0)
            print_message("%s: CLI != library\n", R->name[i]);
        assert_memory_equal(e->data, R->p[i], sizeof(float) * (size_t)n);
        for (int64_t q = 0; q < n; q++)
            assert_true(isfinite(((const float *)e->data)[q]));
    }
    assert_int_equal(st.n_entries, R->n);
    const char *op = lm_st_meta(&st, "op");
    assert_non_null(op);
    assert_string_equal(op, "attention");
    lm_st_free(&st);
}

static void run_and_compare(const spec *s, uint64_t seed, const char *tag) {
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
    int rc = lm_run_cli(msg, sizeof msg, "op attention --in %s --out %s", in, out);
    if (rc != 0)
        print_message("linmoe op attention failed (%d):\n%s\n", rc, msg);
    assert_int_equal(rc, 0);
    result R;
    direct_run(s, &D, &R);
    check_output(out, &R);
    printf("%s: CLI output equals the library call bit for bit (%d tensors)\n", tag, R.n);
    res_free(&R);
    data_free(&D);
}

/* ---------------------------------------------------------------- good runs */

static const int64_t CU[] = {0, 0, 1, 16, 16, 79, 100}; /* 0,1,15,0,63,21 */

static void test_rope_varlen_backward(void **state) {
    (void)state;
    spec s = {.B = 1,
              .T = 100,
              .Hq = 4,
              .Hkv = 2,
              .D = 32,
              .cu = CU,
              .ncu = 7,
              .cu_dtype = LM_I64,
              .has_do = 1,
              .dtype = LM_F32,
              .position = "rope",
              .theta = "10000",
              .causal = "true"};
    run_and_compare(&s, 11, "rope_varlen_bwd");
}

/* cu_seqlens as I32, BF16 storage, theta 1e6, explicit scale */
static void test_rope_i32_bf16(void **state) {
    (void)state;
    spec s = {.B = 1,
              .T = 100,
              .Hq = 8,
              .Hkv = 1,
              .D = 64,
              .cu = CU,
              .ncu = 7,
              .cu_dtype = LM_I32,
              .has_do = 1,
              .dtype = LM_BF16,
              .position = "rope",
              .theta = "1e6",
              .scale = "0.2"};
    run_and_compare(&s, 22, "rope_i32_bf16");
}

/* NoPE, B = 2, F64 storage, forward only, defaults (no metadata) */
static void test_nope_forward_f64(void **state) {
    (void)state;
    spec s = {.B = 2, .T = 70, .Hq = 2, .Hkv = 2, .D = 100, .dtype = LM_F64};
    run_and_compare(&s, 33, "nope_fwd_f64");
}

static void test_nope_backward_explicit(void **state) {
    (void)state;
    spec s = {.B = 2,
              .T = 65,
              .Hq = 6,
              .Hkv = 3,
              .D = 16,
              .has_do = 1,
              .dtype = LM_F32,
              .position = "nope",
              .scale = "1"};
    run_and_compare(&s, 44, "nope_bwd");
}

/* ---------------------------------------------------------------- bad inputs */

static void expect_op_failure(const char *in, char *msg, size_t msg_size) {
    static const char sentinel[] = "sentinel: a previous good output";
    const char *out = lm_cli_path("keep_out.safetensors");
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(sentinel, 1, sizeof sentinel, f), sizeof sentinel);
    assert_int_equal(fclose(f), 0);
    int rc = lm_run_cli(msg, msg_size, "op attention --in %s --out %s", in, out);
    print_message("  exit %d: %s", rc, msg);
    if (rc != 1 || strstr(msg, "Sanitizer") || strstr(msg, "runtime error:"))
        print_message("want exit 1 without a sanitizer report\n");
    assert_int_equal(rc, 1);
    assert_null(strstr(msg, "Sanitizer"));
    assert_null(strstr(msg, "runtime error:"));
    char back[sizeof sentinel + 8];
    f = fopen(out, "rb");
    assert_non_null(f);
    size_t got = fread(back, 1, sizeof back, f);
    fclose(f);
    assert_int_equal(got, sizeof sentinel);
    assert_memory_equal(back, sentinel, sizeof sentinel);
}

typedef struct {
    const char *tensor; /* replace this tensor ... */
    int nd;
    int64_t shape[4]; /* ... by one of this shape (normal values) */
    int nan_at;       /* > 0: poison element nan_at - 1 of `tensor` instead */
} tweak;

static void bad_case(const char *tag, const spec *s, const tweak *tw, const char *meta_k,
                     const char *meta_v, char *msg, size_t msg_size) {
    data D;
    data_gen(s, &D, 777);
    lm_st_writer w;
    lm_st_writer_init(&w);
    if (tw && tw->nan_at > 0) {
        for (int i = 0; i < NI; i++)
            if (strcmp(k_slot[i], tw->tensor) == 0)
                D.t[i][tw->nan_at - 1] = NAN;
        writer_fill(&w, s, &D, NULL);
    } else {
        writer_fill(&w, s, &D, tw ? tw->tensor : NULL);
    }
    if (tw && tw->nd) {
        int64_t n = 1;
        for (int i = 0; i < tw->nd; i++)
            n *= tw->shape[i];
        double *x = malloc(sizeof(double) * (size_t)n);
        lm_fill_normal(x, n, 5, 0.0, 0.3);
        float *y = lm_to_f32(x, n);
        lm_writer_add_as(&w, tw->tensor, LM_F32, tw->nd, tw->shape, y);
        free(x), free(y);
    }
    if (meta_k)
        meta(&w, meta_k, meta_v);
    char name[64];
    snprintf(name, sizeof name, "%s.safetensors", tag);
    const char *in = lm_cli_path(name);
    lm_writer_save(&w, in);
    data_free(&D);
    expect_op_failure(in, msg, msg_size);
    lm_assert_says(msg, name);
}

static spec base_spec(void) {
    spec s = {.B = 1,
              .T = 20,
              .Hq = 4,
              .Hkv = 2,
              .D = 8,
              .has_do = 1,
              .dtype = LM_F32,
              .position = "rope",
              .theta = "10000"};
    return s;
}

static void test_bad_shapes(void **state) {
    (void)state;
    char msg[8192];
    spec s = base_spec();
    tweak kT = {"k", 4, {1, 21, 2, 8}, 0};
    bad_case("bad_k_T", &s, &kT, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'k' shape [1,21,2,8] does not match q [1,20,4,8]: dim 1 (T) is 21");
    tweak vD = {"v", 4, {1, 20, 2, 9}, 0};
    bad_case("bad_v_D", &s, &vD, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'v' shape [1,20,2,9]");
    lm_assert_says(msg, "dim 3 (D) is 9, expected 8");
    tweak vH = {"v", 4, {1, 20, 4, 8}, 0};
    bad_case("bad_v_H", &s, &vH, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "dim 2 (Hkv) is 4, expected 2");
    tweak kH = {"k", 4, {1, 20, 3, 8}, 0};
    bad_case("bad_gqa", &s, &kH, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "dim 2 (Hkv) = 3 does not divide q's dim 2 (Hq) = 4");
    tweak dO = {"do", 4, {1, 20, 2, 8}, 0};
    bad_case("bad_do", &s, &dO, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'do' shape [1,20,2,8]");
    lm_assert_says(msg, "dim 2 (Hq) is 2, expected 4");
    tweak q3 = {"q", 3, {20, 4, 8}, 0};
    bad_case("bad_q_rank", &s, &q3, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'q' shape [20,4,8] has 3 dims; expected 4");
    tweak nov = {"v", 0, {0}, 0};
    bad_case("no_v", &s, &nov, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "missing required tensor 'v'");
    spec so = s; /* q, k, v, do all with an odd head dim, RoPE on */
    so.D = 7;
    bad_case("bad_odd_rope", &so, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "even head dim; D = 7");
    /* cu_seqlens: B = 2, bad values, float dtype */
    static const int64_t cu20[] = {0, 20};
    spec sb = s;
    sb.B = 2, sb.cu = cu20, sb.ncu = 2, sb.cu_dtype = LM_I64;
    bad_case("bad_cu_B", &sb, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "cu_seqlens' is given but q [2,20,4,8] has dim 0 (B) = 2");
    static const int64_t cu_bad[] = {0, 12, 19};
    spec sc = s;
    sc.cu = cu_bad, sc.ncu = 3, sc.cu_dtype = LM_I32;
    bad_case("bad_cu_end", &sc, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "cu_seqlens ends at 19, not at T = 20");
    tweak cuf = {"cu_seqlens", 1, {3}, 0};
    bad_case("bad_cu_dtype", &s, &cuf, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'cu_seqlens' has dtype F32; expected I64 or I32");
}

static void test_bad_attributes(void **state) {
    (void)state;
    char msg[8192];
    spec s = base_spec();
    spec sp = s;
    sp.position = NULL, sp.theta = NULL;
    bad_case("bad_position", &sp, NULL, "position", "alibi", msg, sizeof msg);
    lm_assert_says(msg, "'position' = 'alibi' is not one of rope|nope");
    bad_case("bad_causal", &s, NULL, "causal", "false", msg, sizeof msg);
    lm_assert_says(msg, "'causal' = 'false': only causal attention is implemented");
    bad_case("bad_causal_word", &s, NULL, "causal", "maybe", msg, sizeof msg);
    lm_assert_says(msg, "'causal' = 'maybe' is not true or false");
    spec st = s;
    st.theta = NULL;
    bad_case("bad_theta", &st, NULL, "rope_theta", "-1", msg, sizeof msg);
    lm_assert_says(msg, "'rope_theta' = '-1' is not a finite number > 0");
    spec sn = s;
    sn.position = "nope", sn.theta = NULL;
    bad_case("theta_nope", &sn, NULL, "rope_theta", "10000", msg, sizeof msg);
    lm_assert_says(msg, "'rope_theta' = '10000' is given but 'position' is nope");
    bad_case("bad_scale", &s, NULL, "scale", "nan", msg, sizeof msg);
    lm_assert_says(msg, "'scale' = 'nan' is not a finite number");
    tweak nq = {"q", 0, {0}, 77};
    bad_case("bad_nan_q", &s, &nq, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "input 'q' has a non-finite value (nan) at element 76");
    tweak nv = {"v", 0, {0}, 5};
    bad_case("bad_nan_v", &s, &nv, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "input 'v' has a non-finite value");
    tweak nd = {"do", 0, {0}, 9};
    bad_case("bad_nan_do", &s, &nd, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "input 'do' has a non-finite value");
}

/* help texts and usage errors */
static void test_help_and_usage(void **state) {
    (void)state;
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op attention --help");
    assert_int_equal(rc, 0);
    lm_assert_says(msg, "op attention");
    lm_assert_says(msg, "rope_theta");
    rc = lm_run_cli(msg, sizeof msg, "op attention --in a.safetensors");
    assert_int_equal(rc, 2);
    lm_assert_says(msg, "missing --out");
    rc = lm_run_cli(msg, sizeof msg, "op attentio --in a --out b");
    assert_int_equal(rc, 2);
    lm_assert_says(msg, "attention");
    rc = lm_run_cli(msg, sizeof msg, "op attention --in %s --out %s",
                    lm_cli_path("does_not_exist.safetensors"), lm_cli_path("o.safetensors"));
    assert_int_equal(rc, 1);
    lm_assert_says(msg, "does_not_exist.safetensors");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_varlen_backward), cmocka_unit_test(test_rope_i32_bf16),
        cmocka_unit_test(test_nope_forward_f64),     cmocka_unit_test(test_nope_backward_explicit),
        cmocka_unit_test(test_bad_shapes),           cmocka_unit_test(test_bad_attributes),
        cmocka_unit_test(test_help_and_usage),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
