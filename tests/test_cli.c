/* The `linmoe` CLI from outside: `op kda|gdn` end to end (input written with the
 * safetensors writer, output read back and compared bit for bit with a direct
 * library call on the same fp32 values), and the bad-input matrix (every case exits
 * non-zero with a message naming the problem, never by a signal or a sanitizer
 * report, and leaves an existing OUT file untouched).
 *
 * Runs $LINMOE_BIN (set by CTest) through lm_run_cli. Inputs live in a fresh
 * mkdtemp directory under /tmp that the teardown removes.
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

#include "linmoe/core.h"
#include "linmoe/kda.h"
#include "linmoe/kda_cuda.h"
#include "linmoe/safetensors.h"

/* ---------------------------------------------------------------- temp dir */




/* "<dir>/<name>" in one of a few rotating static buffers. */

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

/* Case-insensitive substring test. */

/* No crash: a plain non-zero exit, no signal (lm_run_cli maps a signal to 128+sig,
 * and the shell does the same), no sanitizer report (ASan/UBSan exit with 1). */
static void assert_clean_failure(int rc, const char *out, int want_rc) {
    if (rc <= 0 || rc >= 128 || strstr(out, "Sanitizer") || strstr(out, "runtime error:") ||
        (want_rc && rc != want_rc))
        print_message("exit status %d (want %s), output:\n%s\n", rc,
                      want_rc == 2 ? "2" : "1..127", out);
    assert_true(rc > 0 && rc < 128);
    if (want_rc) assert_int_equal(rc, want_rc);
    assert_null(strstr(out, "Sanitizer"));
    assert_null(strstr(out, "runtime error:"));
}


/* ---------------------------------------------------------------- op inputs */

enum { T_Q, T_K, T_V, T_G, T_BETA, T_A_LOG, T_DT_BIAS, T_H0, T_DO, T_DHT, NT };
static const char *const k_tn[NT] = {"q",       "k",       "v",  "g",  "beta",
                                     "A_log",   "dt_bias", "initial_state", "do", "dht"};

typedef struct {
    lm_kda_kind kind;
    int B, T, H, HV, K, V;
    int n_cu;             /* 0: no cu_seqlens; else N+1 entries in cu[] */
    int64_t cu[8];
    lm_dtype cu_dtype;    /* I64 or I32 */
    lm_gate_mode gate;
    int has_lb;
    float lb;
    int has_scale;
    float scale;
    int chunk;            /* 0: default (not written) */
    int l2, bsig;
    int has_diag;
    lm_kda_diag diag;
    int has[NT];          /* optional tensors present (q..beta always) */
    lm_dtype dtype[NT];   /* storage dtype (LM_F32 == 0 by default) */
} op_spec;

typedef struct {
    float *t[NT];
} op_data;

static int spec_N(const op_spec *s) { return s->n_cu ? s->n_cu - 1 : s->B; }

static int spec_shape(const op_spec *s, int t, int64_t *shape) {
    const int64_t B = s->B, T = s->T, H = s->H, HV = s->HV, K = s->K, V = s->V, N = spec_N(s);
    switch (t) {
    case T_Q:
    case T_K: shape[0] = B, shape[1] = T, shape[2] = H, shape[3] = K; return 4;
    case T_V:
    case T_DO: shape[0] = B, shape[1] = T, shape[2] = HV, shape[3] = V; return 4;
    case T_G:
        shape[0] = B, shape[1] = T, shape[2] = HV, shape[3] = K;
        return s->kind == LM_KDA ? 4 : 3;
    case T_BETA: shape[0] = B, shape[1] = T, shape[2] = HV; return 3;
    case T_A_LOG: shape[0] = HV; return 1;
    case T_DT_BIAS: shape[0] = s->kind == LM_KDA ? HV * K : HV; return 1;
    default: shape[0] = N, shape[1] = HV, shape[2] = K, shape[3] = V; return 4;
    }
}

/* nd <= 4 (spec_shape); the bound is spelled out so that gcc's vectoriser on AVX-512
 * machines does not see a read past shape[3] (-Wmaybe-uninitialized). */
static int64_t numel_of(int nd, const int64_t shape[4]) {
    int64_t n = 1;
    for (int i = 0; i < nd && i < 4; i++) n *= shape[i];
    return n;
}

static int present(const op_spec *s, int t) { return t <= T_BETA || s->has[t]; }

/* Round to what the storage dtype holds, so the CLI's conversion back to fp32 is exact. */
static float storable(float x, lm_dtype dt) {
    switch (dt) {
    case LM_BF16: return lm_bf16_round(x);
    case LM_F16: return lm_f16_to_f32(lm_f32_to_f16(x));
    default: return x;
    }
}

/* Seeded, realistic values (never zeros only): normal q, k, v, do, dht; the gate's
 * raw input ~ N(0,1) for the in-op gates, a log-decay in (-3, 0) (clamped at the
 * lower bound when one is given) for gate none; beta raw or in (0.1, 0.9). */
static void data_gen(const op_spec *s, op_data *d, uint64_t seed) {
    for (int t = 0; t < NT; t++) {
        d->t[t] = NULL;
        if (!present(s, t)) continue;
        int64_t shape[4] = {0};
        int64_t n = numel_of(spec_shape(s, t, shape), shape);
        double *x = malloc((size_t)n * sizeof(double));
        assert_non_null(x);
        if (t == T_G && s->gate == LM_GATE_NONE) {
            lm_fill_uniform(x, n, seed + (uint64_t)t, -3.0, -0.01);
            if (s->has_lb)
                for (int64_t i = 0; i < n; i++) x[i] = x[i] < s->lb ? s->lb : x[i];
        } else if (t == T_BETA && !s->bsig) {
            lm_fill_uniform(x, n, seed + (uint64_t)t, 0.1, 0.9);
        } else {
            double sd = (t == T_A_LOG || t == T_DT_BIAS) ? 0.5 : (t == T_H0 ? 0.3 : 1.0);
            lm_fill_normal(x, n, seed + (uint64_t)t, 0.0, sd);
        }
        d->t[t] = malloc((size_t)n * sizeof(float));
        assert_non_null(d->t[t]);
        for (int64_t i = 0; i < n; i++) d->t[t][i] = storable((float)x[i], s->dtype[t]);
        free(x);
    }
}

static void data_free(op_data *d) {
    for (int t = 0; t < NT; t++) free(d->t[t]);
}

/* Add fp32 values `x` as dtype `dt` to the writer. */

static void writer_meta(lm_st_writer *w, const char *k, const char *v) {
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_writer_meta(w, k, v, &err), LM_OK);
}

static void writer_add_cu(lm_st_writer *w, const int64_t *cu, int n, lm_dtype dt) {
    lm_error err = {LM_OK, ""};
    int64_t shape[1] = {n};
    int32_t c32[8];
    for (int i = 0; i < n && i < 8; i++) c32[i] = (int32_t)cu[i];
    assert_int_equal(lm_st_writer_add(w, "cu_seqlens", dt, 1, shape, dt == LM_I32 ? (void *)c32 : (const void *)cu, &err),
                     LM_OK);
}

/* Every tensor and attribute of the spec except tensor `skip_t` and metadata key
 * `skip_meta` (either may be NULL), so a test can add its own broken variant. */
static void writer_fill(lm_st_writer *w, const op_spec *s, const op_data *d, const char *skip_t,
                        const char *skip_meta) {
    for (int t = 0; t < NT; t++) {
        if (!present(s, t) || (skip_t && strcmp(skip_t, k_tn[t]) == 0)) continue;
        int64_t shape[4] = {0};
        int nd = spec_shape(s, t, shape);
        lm_writer_add_as(w, k_tn[t], s->dtype[t], nd, shape, d->t[t]);
    }
    if (s->n_cu && !(skip_t && strcmp(skip_t, "cu_seqlens") == 0))
        writer_add_cu(w, s->cu, s->n_cu, s->cu_dtype == LM_I32 ? LM_I32 : LM_I64);
    char b[64];
#define META(key, ...)                                                    \
    do {                                                                  \
        if (!(skip_meta && strcmp(skip_meta, key) == 0)) {                \
            snprintf(b, sizeof b, __VA_ARGS__);                           \
            writer_meta(w, key, b);                                       \
        }                                                                 \
    } while (0)
    static const char *const gates[] = {"none", "softplus", "bounded"};
    static const char *const diags[] = {"auto", "shared", "safe"};
    META("gate", "%s", gates[s->gate]);
    if (s->has_lb) META("lower_bound", "%.9g", (double)s->lb);
    if (s->has_scale) META("scale", "%.9g", (double)s->scale);
    if (s->chunk) META("chunk_size", "%d", s->chunk);
    META("use_qk_l2norm_in_kernel", "%s", s->l2 ? "true" : "false");
    META("use_beta_sigmoid_in_kernel", "%s", s->bsig ? "True" : "False"); /* Python's str(bool) */
    if (s->has_diag) META("diag", "%s", diags[s->diag]);
#undef META
}


static void write_input(const char *path, const op_spec *s, const op_data *d) {
    lm_st_writer w;
    lm_st_writer_init(&w);
    writer_fill(&w, s, d, NULL, NULL);
    lm_writer_save(&w, path);
}

/* ---------------------------------------------------------------- direct call */

enum { O_O, O_HT, O_DQ, O_DK, O_DV, O_DG, O_DBETA, O_DH0, O_DA_LOG, O_DDT_BIAS, NO };
static const char *const k_on[NO] = {"o",  "final_state", "dq",   "dk",     "dv",
                                     "dg", "dbeta",       "dh0",  "dA_log", "ddt_bias"};
/* The input whose shape each output has. */
static const int k_oshape[NO] = {T_V, T_H0, T_Q, T_K, T_V, T_G, T_BETA, T_H0, T_A_LOG, T_DT_BIAS};

typedef struct {
    int want[NO];
    float *t[NO];
} op_result;

/* What `linmoe op` must compute for this spec: lm_kda_forward when there is no
 * upstream gradient, else lm_kda_chunk_forward + lm_kda_chunk_backward (with do = 0
 * when only dht is given). */
static void direct_run(const op_spec *s, const op_data *d, op_result *r) {
    lm_kda_config c;
    lm_kda_config_default(&c, s->B, s->T, s->H, s->HV, s->K, s->V);
    c.kind = s->kind;
    c.gate = s->gate;
    c.has_lower_bound = s->has_lb;
    c.lower_bound = s->lb;
    if (s->has_scale) c.scale = s->scale;
    if (s->chunk) c.chunk_size = s->chunk;
    c.use_qk_l2norm_in_kernel = s->l2;
    c.use_beta_sigmoid_in_kernel = s->bsig;
    if (s->has_diag) c.diag = s->diag;
    int64_t cu[8];
    for (int i = 0; i < s->n_cu; i++) cu[i] = s->cu[i];
    c.cu_seqlens = s->n_cu ? cu : NULL;
    c.n_cu_seqlens = s->n_cu;
    lm_kda_inputs in = {d->t[T_Q], d->t[T_K], d->t[T_V], d->t[T_G], d->t[T_BETA],
                        d->t[T_A_LOG], d->t[T_DT_BIAS], d->t[T_H0]};
    lm_error err = {LM_OK, ""};
    lm_status st = lm_kda_validate(&c, &in, &err);
    if (st != LM_OK) print_message("validate: %s\n", err.msg);
    assert_int_equal(st, LM_OK);

    const int bwd = s->has[T_DO] || s->has[T_DHT];
    memset(r, 0, sizeof *r);
    r->want[O_O] = r->want[O_HT] = 1;
    if (bwd) {
        r->want[O_DQ] = r->want[O_DK] = r->want[O_DV] = r->want[O_DG] = r->want[O_DBETA] = 1;
        r->want[O_DH0] = s->has[T_H0];
        r->want[O_DA_LOG] = s->has[T_A_LOG];
        r->want[O_DDT_BIAS] = s->has[T_DT_BIAS];
    }
    for (int o = 0; o < NO; o++) {
        if (!r->want[o]) continue;
        int64_t shape[4] = {0};
        int64_t n = numel_of(spec_shape(s, k_oshape[o], shape), shape);
        r->t[o] = malloc((size_t)n * sizeof(float));
        assert_non_null(r->t[o]);
        lm_poison_f32(r->t[o], n);
    }
    lm_kda_outputs out = {r->t[O_O], r->t[O_HT]};
    if (!bwd) {
        st = lm_kda_forward(&c, &in, &out, &err);
    } else {
        int64_t shape[4] = {0};
        int64_t n = numel_of(spec_shape(s, T_DO, shape), shape);
        float *zero_do = s->has[T_DO] ? NULL : calloc((size_t)n, sizeof(float));
        lm_kda_grads gr = {s->has[T_DO] ? d->t[T_DO] : zero_do,
                           d->t[T_DHT],
                           r->t[O_DQ],
                           r->t[O_DK],
                           r->t[O_DV],
                           r->t[O_DG],
                           r->t[O_DBETA],
                           r->t[O_DH0],
                           r->t[O_DA_LOG],
                           r->t[O_DDT_BIAS]};
        st = lm_kda_chunk_forward(&c, &in, &out, &err);
        if (st == LM_OK) st = lm_kda_chunk_backward(&c, &in, &gr, &err);
        free(zero_do);
    }
    if (st != LM_OK) print_message("direct call: %s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void result_free(op_result *r) {
    for (int o = 0; o < NO; o++) free(r->t[o]);
}

/* Read OUT back: exactly the wanted tensors, F32, the right shapes, and the same
 * bits as the direct call. */
static void check_output(const char *path, const op_spec *s, const op_result *r) {
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    lm_status rs = lm_st_read(path, &st, &err);
    if (rs != LM_OK) print_message("read %s: %s\n", path, err.msg);
    assert_int_equal(rs, LM_OK);
    int n_want = 0;
    for (int o = 0; o < NO; o++) {
        const lm_st_entry *e = lm_st_find(&st, k_on[o]);
        if (!r->want[o]) {
            if (e) print_message("unexpected output tensor '%s'\n", k_on[o]);
            assert_null(e);
            continue;
        }
        n_want++;
        if (!e) print_message("missing output tensor '%s'\n", k_on[o]);
        assert_non_null(e);
        assert_int_equal(e->dtype, LM_F32);
        int64_t shape[4] = {0};
        int nd = spec_shape(s, k_oshape[o], shape);
        assert_int_equal(e->ndim, nd);
        for (int i = 0; i < nd; i++) assert_int_equal(e->shape[i], shape[i]);
        int64_t n = numel_of(nd, shape);
        const float *got = (const float *)e->data;
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
            if (memcmp(&got[i], &r->t[o][i], sizeof(float)) != 0) bad = i;
        if (bad >= 0)
            print_message("%s[%lld]: CLI %.9g != library %.9g\n", k_on[o], (long long)bad,
                          (double)got[bad], (double)r->t[o][bad]);
        assert_true(bad < 0);
        /* and the values are real numbers, not poison */
        for (int64_t i = 0; i < n; i++) assert_true(isfinite(got[i]));
    }
    assert_int_equal(st.n_entries, n_want);
    lm_st_free(&st);
}

/* Write the spec's input, run `linmoe op`, compare with the direct call. */
static void run_and_compare(const op_spec *s, uint64_t seed, const char *tag) {
    op_data d;
    data_gen(s, &d, seed);
    char in_name[64], out_name[64];
    snprintf(in_name, sizeof in_name, "%s_in.safetensors", tag);
    snprintf(out_name, sizeof out_name, "%s_out.safetensors", tag);
    const char *in = lm_cli_path(in_name), *out = lm_cli_path(out_name);
    write_input(in, s, &d);
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op %s --in %s --out %s", s->kind == LM_KDA ? "kda" : "gdn",
                        in, out);
    if (rc != 0) print_message("linmoe op failed (%d):\n%s\n", rc, msg);
    assert_int_equal(rc, 0);
    op_result r;
    direct_run(s, &d, &r);
    check_output(out, s, &r);
    result_free(&r);
    data_free(&d);
}

/* ---------------------------------------------------------------- good runs */

/* KDA, bounded gate with A_log/dt_bias and the fused flags, GVA (HV = 2H), B = 2,
 * T not a multiple of the chunk, initial state; forward only (o, final_state). */
static void test_op_kda_forward(void **state) {
    (void)state;
    op_spec s = {.kind = LM_KDA, .B = 2, .T = 37, .H = 1, .HV = 2, .K = 16, .V = 8,
                 .gate = LM_GATE_BOUNDED, .has_lb = 1, .lb = -5.0f, .l2 = 1, .bsig = 1};
    s.has[T_A_LOG] = s.has[T_DT_BIAS] = s.has[T_H0] = 1;
    run_and_compare(&s, 101, "kda_fwd");
}

/* KDA, softplus gate, chunk 16, scale 0.3, h0, do and dht: every gradient. */
static void test_op_kda_backward(void **state) {
    (void)state;
    op_spec s = {.kind = LM_KDA, .B = 1, .T = 50, .H = 2, .HV = 2, .K = 8, .V = 12,
                 .gate = LM_GATE_SOFTPLUS, .has_scale = 1, .scale = 0.3f, .chunk = 16};
    s.has[T_A_LOG] = s.has[T_DT_BIAS] = s.has[T_H0] = s.has[T_DO] = s.has[T_DHT] = 1;
    run_and_compare(&s, 202, "kda_bwd");
}

/* KDA, only dht given: backward runs with do = 0. */
static void test_op_kda_dht_only(void **state) {
    (void)state;
    op_spec s = {.kind = LM_KDA, .B = 2, .T = 20, .H = 1, .HV = 1, .K = 8, .V = 8,
                 .gate = LM_GATE_BOUNDED, .has_lb = 1, .lb = -2.0f, .l2 = 1};
    s.has[T_H0] = s.has[T_DHT] = s.has[T_DT_BIAS] = 1;
    run_and_compare(&s, 303, "kda_dht");
}

/* GDN, packed varlen (I32 cu_seqlens with segments of length 0, 1, 15 and 24), gate
 * none, diag safe, do only (no h0, A_log, dt_bias: no dh0, dA_log, ddt_bias). */
static void test_op_gdn_varlen_backward(void **state) {
    (void)state;
    op_spec s = {.kind = LM_GDN, .B = 1, .T = 40, .H = 1, .HV = 2, .K = 8, .V = 8, .n_cu = 5,
                 .cu = {0, 0, 1, 16, 40}, .cu_dtype = LM_I32, .gate = LM_GATE_NONE,
                 .has_diag = 1, .diag = LM_DIAG_SAFE, .bsig = 1};
    s.has[T_DO] = 1;
    run_and_compare(&s, 404, "gdn_varlen");
}

/* GDN forward with F64 / BF16 / F16 inputs (converted to fp32 by the CLI), bounded
 * gate with dt_bias only, GVA, varlen I64 cu_seqlens with an initial state. */
static void test_op_gdn_forward_dtypes(void **state) {
    (void)state;
    op_spec s = {.kind = LM_GDN, .B = 1, .T = 30, .H = 2, .HV = 4, .K = 8, .V = 4, .n_cu = 3,
                 .cu = {0, 13, 30}, .cu_dtype = LM_I64, .gate = LM_GATE_BOUNDED, .has_lb = 1,
                 .lb = -3.0f, .l2 = 1};
    s.has[T_DT_BIAS] = s.has[T_H0] = 1;
    s.dtype[T_Q] = LM_F64;
    s.dtype[T_K] = LM_BF16;
    s.dtype[T_V] = LM_BF16;
    s.dtype[T_G] = LM_F16;
    s.dtype[T_BETA] = LM_F64;
    s.dtype[T_H0] = LM_BF16;
    run_and_compare(&s, 505, "gdn_dtypes");
}

/* GDN with everything: softplus gate, A_log, dt_bias, h0, do, dht, chunk 32. */
static void test_op_gdn_backward_all(void **state) {
    (void)state;
    op_spec s = {.kind = LM_GDN, .B = 2, .T = 45, .H = 1, .HV = 2, .K = 12, .V = 8,
                 .gate = LM_GATE_SOFTPLUS, .chunk = 32, .l2 = 1, .bsig = 1};
    s.has[T_A_LOG] = s.has[T_DT_BIAS] = s.has[T_H0] = s.has[T_DO] = s.has[T_DHT] = 1;
    run_and_compare(&s, 606, "gdn_bwd");
}

/* ---------------------------------------------------------------- bad inputs */

/* A small valid KDA case that the bad-input tests break one thing of. */
static op_spec base_spec(void) {
    op_spec s = {.kind = LM_KDA, .B = 1, .T = 24, .H = 2, .HV = 2, .K = 8, .V = 8,
                 .gate = LM_GATE_BOUNDED, .has_lb = 1, .lb = -5.0f, .l2 = 1, .bsig = 1};
    s.has[T_A_LOG] = s.has[T_DT_BIAS] = s.has[T_DO] = 1;
    return s;
}

/* Run `op kda` on `in` writing to a pre-existing sentinel OUT; expect a clean
 * failure with exit 1, OUT untouched, no temporary file left; returns the output. */
static void expect_op_failure(const char *in, char *msg, size_t msg_size) {
    static const char sentinel[] = "sentinel: a previous good output";
    const char *out = lm_cli_path("keep_out.safetensors");
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(sentinel, 1, sizeof sentinel, f), sizeof sentinel);
    assert_int_equal(fclose(f), 0);

    int rc = lm_run_cli(msg, msg_size, "op kda --in %s --out %s", in, out);
    print_message("  exit %d: %s", rc, msg); /* the log shows every message */
    assert_clean_failure(rc, msg, 1);

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
    while ((de = readdir(d)) != NULL) {
        if (strstr(de->d_name, ".tmp.")) print_message("leftover temporary file %s\n", de->d_name);
        assert_null(strstr(de->d_name, ".tmp."));
    }
    closedir(d);
}

/* Build the base case with one tensor replaced (skip_t, then `add` adds its own),
 * one metadata key replaced (skip_meta + meta_k/meta_v), or values poisoned. */
typedef void (*tweak_fn)(lm_st_writer *w, const op_spec *s, const op_data *d);

static void bad_case(const char *tag, const op_spec *s, const char *skip_t, tweak_fn add,
                     const char *skip_meta, const char *meta_k, const char *meta_v, char *msg,
                     size_t msg_size) {
    op_data d;
    data_gen(s, &d, 777);
    lm_st_writer w;
    lm_st_writer_init(&w);
    writer_fill(&w, s, &d, skip_t, skip_meta);
    if (add) add(&w, s, &d);
    if (meta_k) writer_meta(&w, meta_k, meta_v);
    char name[64];
    snprintf(name, sizeof name, "%s.safetensors", tag);
    const char *in = lm_cli_path(name);
    lm_writer_save(&w, in);
    data_free(&d);
    expect_op_failure(in, msg, msg_size);
    lm_assert_says(msg, name); /* the message names the file */
}

static void add_k_half(lm_st_writer *w, const op_spec *s, const op_data *d) {
    int64_t shape[4] = {s->B, s->T, s->H, s->K / 2};
    lm_writer_add_as(w, "k", LM_F32, 4, shape, d->t[T_K]);
}

static void test_bad_shape_k(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("bad_shape_k", &s, "k", add_k_half, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'k' shape [1,24,2,4] does not match q [1,24,2,8]");
    lm_assert_says(msg, "dim 3 (K) is 4, expected 8");
}

static void add_g_gdn_shape(lm_st_writer *w, const op_spec *s, const op_data *d) {
    int64_t shape[3] = {s->B, s->T, s->HV}; /* GDN's g given to the KDA op */
    lm_writer_add_as(w, "g", LM_F32, 3, shape, d->t[T_G]);
}

static void test_bad_shape_g(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("bad_shape_g", &s, "g", add_g_gdn_shape, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'g'");
    lm_assert_says(msg, "has 3 dims; expected 4");
}

static void add_do_short(lm_st_writer *w, const op_spec *s, const op_data *d) {
    int64_t shape[4] = {s->B, s->T - 1, s->HV, s->V};
    lm_writer_add_as(w, "do", LM_F32, 4, shape, d->t[T_DO]);
}

static void test_bad_shape_do(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("bad_shape_do", &s, "do", add_do_short, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'do' shape [1,23,2,8]");
    lm_assert_says(msg, "dim 1 (T) is 23, expected 24");
}

static void add_dt_bias_gdn(lm_st_writer *w, const op_spec *s, const op_data *d) {
    int64_t shape[1] = {s->HV}; /* GDN's dt_bias given to the KDA op */
    lm_writer_add_as(w, "dt_bias", LM_F32, 1, shape, d->t[T_DT_BIAS]);
}

static void test_bad_shape_dt_bias(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("bad_shape_dt_bias", &s, "dt_bias", add_dt_bias_gdn, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'dt_bias' shape [2]");
    lm_assert_says(msg, "(HV*K) is 2, expected 16");
}

static void add_h0_wrong_n(lm_st_writer *w, const op_spec *s, const op_data *d) {
    int64_t shape[4] = {2, s->HV, s->K, s->V}; /* N = 2 but B = 1 and no cu_seqlens */
    float *x = calloc((size_t)numel_of(4, shape), sizeof(float));
    assert_non_null(x);
    (void)d;
    lm_writer_add_as(w, "initial_state", LM_F32, 4, shape, x);
    free(x);
}

static void test_bad_shape_initial_state(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("bad_shape_h0", &s, NULL, add_h0_wrong_n, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'initial_state'");
    lm_assert_says(msg, "dim 0 (N) is 2, expected 1");
}

static void test_bad_gva(void **state) {
    (void)state;
    op_spec s = base_spec();
    s.HV = 3; /* not a multiple of H = 2 */
    char msg[8192];
    bad_case("bad_gva", &s, NULL, NULL, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "not a multiple of");
}

static void test_missing_q(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("missing_q", &s, "q", NULL, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "missing required tensor 'q'");
}

static void add_q_int(lm_st_writer *w, const op_spec *s, const op_data *d) {
    int64_t shape[4] = {s->B, s->T, s->H, s->K};
    int64_t n = numel_of(4, shape);
    int32_t *x = calloc((size_t)n, sizeof(int32_t));
    assert_non_null(x);
    (void)d;
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_writer_add(w, "q", LM_I32, 4, shape, x, &err), LM_OK);
    free(x);
}

static void test_bad_dtype_q(void **state) {
    (void)state;
    op_spec s = base_spec();
    char msg[8192];
    bad_case("int_q", &s, "q", add_q_int, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'q' has dtype I32");
}

/* Poison one element of tensor `t` (the input is written from the poisoned data). */
static void nonfinite_case(const char *tag, int t, int64_t at, float val, char *msg,
                           size_t msg_size) {
    op_spec s = base_spec();
    op_data d;
    data_gen(&s, &d, 888);
    d.t[t][at] = val;
    char name[64];
    snprintf(name, sizeof name, "%s.safetensors", tag);
    const char *in = lm_cli_path(name);
    write_input(in, &s, &d);
    data_free(&d);
    expect_op_failure(in, msg, msg_size);
    lm_assert_says(msg, name);
}

static void test_nan_input(void **state) {
    (void)state;
    char msg[8192];
    nonfinite_case("nan_v", T_V, 17, NAN, msg, sizeof msg);
    lm_assert_says(msg, "'v'");
    assert_true(lm_contains_ci(msg, "nan") || lm_contains_ci(msg, "finite"));
    nonfinite_case("nan_beta", T_BETA, 0, NAN, msg, sizeof msg);
    lm_assert_says(msg, "'beta'");
    assert_true(lm_contains_ci(msg, "nan") || lm_contains_ci(msg, "finite"));
}

static void test_inf_input(void **state) {
    (void)state;
    char msg[8192];
    nonfinite_case("inf_g", T_G, 5, INFINITY, msg, sizeof msg);
    lm_assert_says(msg, "'g'");
    assert_true(lm_contains_ci(msg, "inf") || lm_contains_ci(msg, "finite"));
    nonfinite_case("inf_q", T_Q, 0, -INFINITY, msg, sizeof msg);
    lm_assert_says(msg, "'q'");
    assert_true(lm_contains_ci(msg, "inf") || lm_contains_ci(msg, "finite"));
    nonfinite_case("inf_do", T_DO, 3, -INFINITY, msg, sizeof msg);
    lm_assert_says(msg, "'do'");
    assert_true(lm_contains_ci(msg, "inf") || lm_contains_ci(msg, "finite"));
}

static void cu_case(const char *tag, const int64_t *cu, int n, char *msg, size_t msg_size) {
    op_spec s = base_spec();
    s.n_cu = n;
    for (int i = 0; i < n; i++) s.cu[i] = cu[i];
    s.cu_dtype = LM_I64;
    s.has[T_H0] = 1;
    op_data d;
    data_gen(&s, &d, 999);
    char name[64];
    snprintf(name, sizeof name, "%s.safetensors", tag);
    const char *in = lm_cli_path(name);
    write_input(in, &s, &d);
    data_free(&d);
    expect_op_failure(in, msg, msg_size);
    lm_assert_says(msg, name);
    lm_assert_says(msg, "cu_seqlens");
}

static void test_bad_cu_seqlens(void **state) {
    (void)state;
    char msg[8192];
    const int64_t decreasing[4] = {0, 10, 5, 24};
    cu_case("cu_decreasing", decreasing, 4, msg, sizeof msg);
    const int64_t not_zero[3] = {2, 10, 24};
    cu_case("cu_not_zero", not_zero, 3, msg, sizeof msg);
    const int64_t not_T[3] = {0, 10, 23};
    cu_case("cu_not_T", not_T, 3, msg, sizeof msg);
    const int64_t past_T[3] = {0, 10, 30};
    cu_case("cu_past_T", past_T, 3, msg, sizeof msg);
}

static void test_bad_metadata(void **state) {
    (void)state;
    char msg[8192];
    op_spec s = base_spec();
    bad_case("bad_gate", &s, NULL, NULL, "gate", "gate", "sigmoidal", msg, sizeof msg);
    lm_assert_says(msg, "'gate' = 'sigmoidal'");
    bad_case("bad_lb_text", &s, NULL, NULL, "lower_bound", "lower_bound", "minus five", msg,
             sizeof msg);
    lm_assert_says(msg, "'lower_bound' = 'minus five'");
    bad_case("bad_chunk", &s, NULL, NULL, NULL, "chunk_size", "64x", msg, sizeof msg);
    lm_assert_says(msg, "'chunk_size' = '64x'");
    bad_case("bad_bool", &s, NULL, NULL, "use_qk_l2norm_in_kernel", "use_qk_l2norm_in_kernel",
             "yes please", msg, sizeof msg);
    lm_assert_says(msg, "'use_qk_l2norm_in_kernel' = 'yes please'");
    bad_case("bad_diag", &s, NULL, NULL, NULL, "diag", "fast", msg, sizeof msg);
    lm_assert_says(msg, "'diag' = 'fast'");
    bad_case("bad_scale", &s, NULL, NULL, NULL, "scale", "inf", msg, sizeof msg);
    lm_assert_says(msg, "'scale' = 'inf'");
    /* values that parse but the op rejects (lm_kda_validate) */
    bad_case("lb_out_of_range", &s, NULL, NULL, "lower_bound", "lower_bound", "-6", msg,
             sizeof msg);
    lm_assert_says(msg, "lower_bound");
    lm_assert_says(msg, "-6");
    bad_case("lb_positive", &s, NULL, NULL, "lower_bound", "lower_bound", "0.5", msg, sizeof msg);
    lm_assert_says(msg, "lower_bound");
    bad_case("chunk_48", &s, NULL, NULL, NULL, "chunk_size", "48", msg, sizeof msg);
    lm_assert_says(msg, "chunk_size");
    lm_assert_says(msg, "48");
}

static void test_gate_none_with_A_log(void **state) {
    (void)state;
    char msg[8192];
    op_spec s = base_spec();
    s.gate = LM_GATE_NONE; /* g is then a log-decay; the base data is raw N(0,1) */
    s.has_lb = 0;
    s.has[T_DT_BIAS] = 0;
    bad_case("none_with_A_log", &s, NULL, NULL, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "'A_log' is given but __metadata__ 'gate' is none");
}

/* ---------------------------------------------------------------- malformed files */

/* Write raw bytes: an 8-byte little-endian header length, the header text, then
 * `data_size` bytes of data. `hlen_override` != 0 replaces the stored length. */
static const char *write_raw(const char *name, const char *header, uint64_t hlen_override,
                             size_t data_size) {
    const char *p = lm_cli_path(name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    uint64_t hlen = hlen_override ? hlen_override : strlen(header);
    unsigned char le[8];
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)(hlen >> (8 * i));
    assert_int_equal(fwrite(le, 1, 8, f), 8);
    assert_int_equal(fwrite(header, 1, strlen(header), f), strlen(header));
    for (size_t i = 0; i < data_size; i++) assert_int_equal(fputc((int)(i & 0x3f), f), (int)(i & 0x3f));
    assert_int_equal(fclose(f), 0);
    return p;
}

static void raw_case(const char *name, const char *header, uint64_t hlen, size_t data_size,
                     const char *expect) {
    char msg[8192];
    const char *in = write_raw(name, header, hlen, data_size);
    expect_op_failure(in, msg, sizeof msg);
    lm_assert_says(msg, name);
    lm_assert_says(msg, expect);
}

static void test_malformed_files(void **state) {
    (void)state;
    /* header length past the end of the file */
    raw_case("hdr_past_eof.safetensors", "{\"q\":{\"dtype\":\"F32\",\"shape\":[1],", 1000, 0,
             "past the end");
    /* a header length so large it would overflow a naive size computation */
    raw_case("hdr_huge.safetensors", "{}", UINT64_MAX - 4, 0, "header length");
    /* overlapping byte ranges */
    raw_case("overlap.safetensors",
             "{\"q\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"k\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
             0, 12, "overlaps");
    /* offsets past the data section */
    raw_case("offset_range.safetensors",
             "{\"q\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 0, 8,
             "past the data section");
    /* offsets with begin > end */
    raw_case("offset_order.safetensors",
             "{\"q\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 0, 8, "begin");
    /* unknown dtype */
    raw_case("dtype_q7.safetensors",
             "{\"q\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", 0, 8,
             "unknown dtype");
    /* shape x dtype != byte span */
    raw_case("span.safetensors", "{\"q\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
             0, 8, "span");
    /* not JSON, and an empty file */
    raw_case("not_json.safetensors", "{\"q\": [1, 2", 0, 0, "JSON");
    {
        const char *p = lm_cli_path("short.safetensors");
        FILE *f = fopen(p, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite("\x10\0\0", 1, 3, f), 3);
        assert_int_equal(fclose(f), 0);
        char m[8192];
        expect_op_failure(p, m, sizeof m);
        lm_assert_says(m, "short.safetensors");
        lm_assert_says(m, "shorter than the 8-byte header length");
    }
    /* a missing input file */
    char msg[8192];
    expect_op_failure(lm_cli_path("does_not_exist.safetensors"), msg, sizeof msg);
    lm_assert_says(msg, "does_not_exist.safetensors");
}

/* ---------------------------------------------------------------- CLI surface */

static void test_device_cuda(void **state) {
    (void)state;
    op_spec s = base_spec();
    op_data d;
    data_gen(&s, &d, 111);
    const char *in = lm_cli_path("cuda_in.safetensors"), *out = lm_cli_path("cuda_out.safetensors");
    write_input(in, &s, &d);
    data_free(&d);
    char msg[8192];
    /* on a machine without a GPU (CI) the CUDA path fails cleanly; with one, it runs */
    int rc = lm_run_cli(msg, sizeof msg, "op kda --in %s --out %s --device cuda", in, out);
    if (lm_cuda_device_count() < 1) {
        assert_clean_failure(rc, msg, 0);
        lm_assert_says(msg, "--device cuda: ");
        assert_false(file_exists(out));
    } else {
        assert_int_equal(rc, 0);
    }
    rc = lm_run_cli(msg, sizeof msg, "op moe --in %s --out %s --device cuda", in, out);
    assert_clean_failure(rc, msg, 0);
    lm_assert_says(msg, "CUDA kernels exist for `op kda` / `op gdn` (forward) only so far");
    if (lm_cuda_device_count() < 1) { /* the C table needs a GPU; tests never time one */
        rc = lm_run_cli(msg, sizeof msg, "bench kda --device cuda");
        assert_clean_failure(rc, msg, 0);
        lm_assert_says(msg, "no CUDA GPU available");
        lm_assert_says(msg, "scripts/gpu/pack.sh");
    }
    rc = lm_run_cli(msg, sizeof msg, "bench moe --device cuda");
    assert_clean_failure(rc, msg, 0);
    lm_assert_says(msg, "`bench kda`, `bench model` and `bench ops` have CUDA paths");
    rc = lm_run_cli(msg, sizeof msg, "op kda --in %s --out %s --device tpu", in, out);
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "unknown device 'tpu'");
}

static void test_usage_errors(void **state) {
    (void)state;
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "frobnicate");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "unknown subcommand 'frobnicate'");
    rc = lm_run_cli(msg, sizeof msg, "--frobnicate");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "unknown option '--frobnicate'");
    rc = lm_run_cli(msg, sizeof msg, "%s", "");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "usage");
    rc = lm_run_cli(msg, sizeof msg, "op kda --in a --out b --bogus");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "unknown option '--bogus'");
    rc = lm_run_cli(msg, sizeof msg, "op attn --in a --out b");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "unknown op 'attn'");
    rc = lm_run_cli(msg, sizeof msg, "op kda --in a");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "missing --out");
    rc = lm_run_cli(msg, sizeof msg, "op kda --out b --in");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "--in needs a value");
    rc = lm_run_cli(msg, sizeof msg, "op");
    assert_clean_failure(rc, msg, 2);
    rc = lm_run_cli(msg, sizeof msg, "bench attn");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "unknown target 'attn'");
    rc = lm_run_cli(msg, sizeof msg, "bench kda --threads zero");
    assert_clean_failure(rc, msg, 2);
    lm_assert_says(msg, "--threads 'zero'");
    rc = lm_run_cli(msg, sizeof msg, "bench kda --fast");
    assert_clean_failure(rc, msg, 2);
    rc = lm_run_cli(msg, sizeof msg, "version extra");
    assert_clean_failure(rc, msg, 2);
}

static void test_help_and_version(void **state) {
    (void)state;
    char msg[8192];
    static const char *const cmds[] = {"--help", "help", "help op", "help bench", "op --help",
                                       "op kda --help", "bench --help", "bench kda --help",
                                       "version --help"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        int rc = lm_run_cli(msg, sizeof msg, "%s", cmds[i]);
        if (rc != 0) print_message("`linmoe %s` exited %d:\n%s\n", cmds[i], rc, msg);
        assert_int_equal(rc, 0);
        lm_assert_says(msg, "usage:");
    }
    int rc = lm_run_cli(msg, sizeof msg, "op --help");
    lm_assert_says(msg, "--device");
    lm_assert_says(msg, "lower_bound");
    rc = lm_run_cli(msg, sizeof msg, "bench --help");
    lm_assert_says(msg, "--threads");
    lm_assert_says(msg, "--json");
    rc = lm_run_cli(msg, sizeof msg, "version");
    assert_int_equal(rc, 0);
    lm_assert_says(msg, "linmoe ");
}

/* A successful run replaces an existing OUT (atomically) and leaves no temporary. */
static void test_overwrite_on_success(void **state) {
    (void)state;
    op_spec s = base_spec();
    s.has[T_DO] = 0;
    op_data d;
    data_gen(&s, &d, 121);
    const char *in = lm_cli_path("ow_in.safetensors"), *out = lm_cli_path("ow_out.safetensors");
    write_input(in, &s, &d);
    data_free(&d);
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    fputs("old", f);
    fclose(f);
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op kda --in %s --out %s", in, out);
    if (rc != 0) print_message("%s\n", msg);
    assert_int_equal(rc, 0);
    lm_safetensors st;
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_read(out, &st, &err), LM_OK);
    assert_non_null(lm_st_find(&st, "o"));
    lm_st_free(&st);
    /* IN == OUT also works: IN is read whole before OUT is written */
    rc = lm_run_cli(msg, sizeof msg, "op kda --in %s --out %s", in, in);
    if (rc != 0) print_message("%s\n", msg);
    assert_int_equal(rc, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_op_kda_forward),
        cmocka_unit_test(test_op_kda_backward),
        cmocka_unit_test(test_op_kda_dht_only),
        cmocka_unit_test(test_op_gdn_varlen_backward),
        cmocka_unit_test(test_op_gdn_forward_dtypes),
        cmocka_unit_test(test_op_gdn_backward_all),
        cmocka_unit_test(test_bad_shape_k),
        cmocka_unit_test(test_bad_shape_g),
        cmocka_unit_test(test_bad_shape_do),
        cmocka_unit_test(test_bad_shape_dt_bias),
        cmocka_unit_test(test_bad_shape_initial_state),
        cmocka_unit_test(test_bad_gva),
        cmocka_unit_test(test_missing_q),
        cmocka_unit_test(test_bad_dtype_q),
        cmocka_unit_test(test_nan_input),
        cmocka_unit_test(test_inf_input),
        cmocka_unit_test(test_bad_cu_seqlens),
        cmocka_unit_test(test_bad_metadata),
        cmocka_unit_test(test_gate_none_with_A_log),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_device_cuda),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_help_and_version),
        cmocka_unit_test(test_overwrite_on_success),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
