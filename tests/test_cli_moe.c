/* The `linmoe op moe_router` and `linmoe op moe` runners from outside: inputs written
 * with the safetensors writer (F32, BF16 and F64 storage), the CLI run through
 * $LINMOE_BIN, and every output read back and compared bit for bit with a direct
 * call of the library on the same fp32 values (lm_router_forward / _backward,
 * lm_moe_forward / _backward). Then the bad-input matrix: each case exits 1 with a
 * message naming the file and the field, never by a signal or a sanitizer report,
 * and leaves an existing OUT untouched.
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
#include "linmoe/moe.h"
#include "linmoe/moe_router.h"
#include "linmoe/safetensors.h"

/* ---------------------------------------------------------------- temp dir */







/* ---------------------------------------------------------------- inputs */

/* Tensor slots of both ops. */
enum {
    I_LOGITS,
    I_BIAS,
    I_DTW, /* moe_router */
    I_X,
    I_W0,
    I_DO = I_W0 + LM_MOE_N_WEIGHTS, /* moe: x, the weights, do */
    NI
};

typedef struct {
    int layer; /* 0: moe_router, 1: moe */
    int T, d, f, E, k, n_shared;
    const char *scoring; /* NULL: default (not written) */
    int norm;            /* -1: default */
    float scale;         /* 0: default */
    int n_group, topk_group;
    int training;
    float cf;
    const char *drop;
    int has_bias, has_grad; /* e_score_correction_bias; dtopk_weight / do */
    lm_dtype dtype;         /* storage of the float inputs */
    int no_k_meta;          /* 1: leave num_experts_per_tok out (the router op takes k from
                               dtopk_weight's shape) */
} spec;

typedef struct {
    int present[NI];
    int nd[NI];
    int64_t shape[NI][3];
    float *t[NI];
} data;

static const char *slot_name(int i) {
    switch (i) {
    case I_LOGITS:
        return "logits";
    case I_BIAS:
        return "e_score_correction_bias";
    case I_DTW:
        return "dtopk_weight";
    case I_X:
        return "x";
    case I_DO:
        return "do";
    default:
        return lm_moe_weight_name((lm_moe_weight_id)(i - I_W0));
    }
}

static float storable(float x, lm_dtype dt) { return dt == LM_BF16 ? lm_bf16_round(x) : x; }

static lm_moe_config spec_config(const spec *s) {
    lm_moe_config c;
    lm_moe_config_default(&c, s->d, s->f, s->E, s->k, s->n_shared);
    c.router.balance = LM_BAL_NONE; /* what the op runner uses */
    if (s->scoring)
        c.router.scoring_func = (lm_score_func)lm_score_func_from_name(s->scoring);
    if (s->norm >= 0)
        c.router.norm_topk_prob = s->norm;
    if (s->scale > 0)
        c.router.routed_scaling_factor = s->scale;
    if (s->n_group)
        c.router.n_group = s->n_group, c.router.topk_group = s->topk_group;
    c.router.capacity_factor = s->cf;
    if (s->drop)
        c.router.drop_policy = (lm_drop_policy)lm_drop_policy_from_name(s->drop);
    return c;
}

static void data_gen(const spec *s, data *D, uint64_t seed) {
    memset(D, 0, sizeof *D);
    if (!s->layer) {
        D->present[I_LOGITS] = 1, D->nd[I_LOGITS] = 2;
        D->shape[I_LOGITS][0] = s->T, D->shape[I_LOGITS][1] = s->E;
        D->present[I_BIAS] = s->has_bias, D->nd[I_BIAS] = 1, D->shape[I_BIAS][0] = s->E;
        D->present[I_DTW] = s->has_grad, D->nd[I_DTW] = 2;
        D->shape[I_DTW][0] = s->T, D->shape[I_DTW][1] = s->k;
    } else {
        lm_moe_config c = spec_config(s);
        D->present[I_X] = 1, D->nd[I_X] = 2, D->shape[I_X][0] = s->T, D->shape[I_X][1] = s->d;
        for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
            D->nd[I_W0 + i] = lm_moe_weight_shape(&c, (lm_moe_weight_id)i, D->shape[I_W0 + i]);
            D->present[I_W0 + i] = D->nd[I_W0 + i] > 0;
        }
        D->present[I_BIAS] = s->has_bias, D->nd[I_BIAS] = 1, D->shape[I_BIAS][0] = s->E;
        D->present[I_DO] = s->has_grad, D->nd[I_DO] = 2;
        D->shape[I_DO][0] = s->T, D->shape[I_DO][1] = s->d;
    }
    for (int i = 0; i < NI; i++) {
        if (!D->present[i])
            continue;
        int64_t n = 1;
        for (int q = 0; q < D->nd[i]; q++)
            n *= D->shape[i][q];
        double *x = malloc(sizeof(double) * (size_t)n);
        assert_non_null(x);
        const int64_t fan_in = D->shape[i][D->nd[i] - 1];
        const double sd = i == I_BIAS             ? 0.1
                          : i == I_LOGITS         ? 1.5
                          : i >= I_W0 && i < I_DO ? 1.0 / sqrt((double)fan_in)
                                                  : 1.0;
        lm_fill_normal(x, n, seed + (uint64_t)i, 0.0, sd);
        D->t[i] = malloc(sizeof(float) * (size_t)n);
        for (int64_t q = 0; q < n; q++)
            D->t[i][q] = storable((float)x[q], s->dtype);
        free(x);
    }
}

static void data_free(data *D) {
    for (int i = 0; i < NI; i++)
        free(D->t[i]);
}


static void meta(lm_st_writer *w, const char *k, const char *v) {
    lm_error err = {LM_OK, ""};
    assert_int_equal(lm_st_writer_meta(w, k, v, &err), LM_OK);
}

/* Every tensor except `skip_t`, every attribute except `skip_meta`. */
static void writer_fill(lm_st_writer *w, const spec *s, const data *D, const char *skip_t,
                        const char *skip_meta) {
    for (int i = 0; i < NI; i++)
        if (D->present[i] && !(skip_t && strcmp(skip_t, slot_name(i)) == 0))
            lm_writer_add_as(w, slot_name(i), s->dtype, D->nd[i], D->shape[i], D->t[i]);
    char b[64];
#define META(key, ...)                                                                             \
    do {                                                                                           \
        if (!(skip_meta && strcmp(skip_meta, key) == 0)) {                                         \
            snprintf(b, sizeof b, __VA_ARGS__);                                                    \
            meta(w, key, b);                                                                       \
        }                                                                                          \
    } while (0)
    if (!s->no_k_meta)
        META("num_experts_per_tok", "%d", s->k);
    if (s->scoring)
        META("scoring_func", "%s", s->scoring);
    if (s->norm >= 0)
        META("norm_topk_prob", "%s", s->norm ? "True" : "False");
    if (s->scale > 0)
        META("routed_scaling_factor", "%.9g", (double)s->scale);
    if (s->n_group) {
        META("n_group", "%d", s->n_group);
        META("topk_group", "%d", s->topk_group);
    }
    META("training", "%s", s->training ? "true" : "false");
    if (s->cf != 0)
        META("capacity_factor", "%.9g", (double)s->cf);
    if (s->drop)
        META("drop_policy", "%s", s->drop);
#undef META
}


/* ---------------------------------------------------------------- direct call */

#define MAX_OUT 16
typedef struct {
    int n;
    const char *name[MAX_OUT];
    char namebuf[MAX_OUT][64];
    lm_dtype dt[MAX_OUT];
    int nd[MAX_OUT];
    int64_t shape[MAX_OUT][3];
    void *p[MAX_OUT];
} result;

static void res_add(result *r, const char *name, lm_dtype dt, int nd, const int64_t *shape,
                    const void *src) {
    assert_true(r->n < MAX_OUT);
    int i = r->n++;
    snprintf(r->namebuf[i], sizeof r->namebuf[i], "%s", name);
    r->name[i] = r->namebuf[i];
    r->dt[i] = dt, r->nd[i] = nd;
    int64_t n = 1;
    for (int q = 0; q < nd; q++)
        n *= (r->shape[i][q] = shape[q]);
    size_t bytes = (size_t)n * lm_dtype_size(dt);
    r->p[i] = malloc(bytes ? bytes : 1);
    memcpy(r->p[i], src, bytes);
}

static void res_free(result *r) {
    for (int i = 0; i < r->n; i++)
        free(r->p[i]);
}

static void direct_run(const spec *s, const data *D, result *R) {
    memset(R, 0, sizeof *R);
    lm_moe_config c = spec_config(s);
    lm_error err = {LM_OK, ""};
    lm_router_state st;
    assert_int_equal(lm_router_state_init(&st, s->E, &err), LM_OK);
    if (s->has_bias)
        memcpy(st.e_score_correction_bias, D->t[I_BIAS], sizeof(float) * (size_t)s->E);
    const int64_t tk[2] = {s->T, s->k}, te[2] = {s->T, s->E};
    if (!s->layer) {
        lm_route r;
        memset(&r, 0, sizeof r);
        lm_status rs =
            lm_router_forward(&c.router, &st, D->t[I_LOGITS], s->T, NULL, 0, s->training, &r, &err);
        if (rs != LM_OK)
            print_message("router: %s\n", err.msg);
        assert_int_equal(rs, LM_OK);
        res_add(R, "topk_idx", LM_I64, 2, tk, r.topk_idx);
        res_add(R, "topk_weight", LM_F32, 2, tk, r.topk_weight);
        if (s->training)
            res_add(R, "keep", LM_U8, 2, tk, r.keep);
        if (s->has_grad) {
            float *dl = malloc(sizeof(float) * (size_t)(s->T * s->E));
            lm_poison_f32(dl, (int64_t)s->T * s->E);
            assert_int_equal(lm_router_backward(&c.router, &r, D->t[I_DTW], dl, &err), LM_OK);
            res_add(R, "dlogits", LM_F32, 2, te, dl);
            free(dl);
        }
        lm_route_free(&r);
    } else {
        lm_moe_ctx *ctx = NULL;
        assert_int_equal(lm_moe_ctx_new(&ctx, &c, s->T, &err), LM_OK);
        lm_moe_weights W;
        for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
            W.p[i] = D->t[I_W0 + i];
        const int64_t nx = (int64_t)s->T * s->d;
        float *out = malloc(sizeof(float) * (size_t)nx), *dx = malloc(sizeof(float) * (size_t)nx);
        lm_poison_f32(out, nx);
        lm_status rs =
            lm_moe_forward(ctx, &W, &st, D->t[I_X], s->T, NULL, 0, s->training, out, &err);
        if (rs != LM_OK)
            print_message("moe: %s\n", err.msg);
        assert_int_equal(rs, LM_OK);
        const lm_route *r = lm_moe_ctx_route(ctx);
        res_add(R, "out", LM_F32, 2, D->shape[I_X], out);
        res_add(R, "topk_idx", LM_I64, 2, tk, r->topk_idx);
        res_add(R, "topk_weight", LM_F32, 2, tk, r->topk_weight);
        if (s->training)
            res_add(R, "keep", LM_U8, 2, tk, r->keep);
        if (s->has_grad) {
            lm_moe_grads g;
            for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
                g.p[i] = NULL;
                if (!D->present[I_W0 + i])
                    continue;
                int64_t n = 1;
                for (int q = 0; q < D->nd[I_W0 + i]; q++)
                    n *= D->shape[I_W0 + i][q];
                g.p[i] = malloc(sizeof(float) * (size_t)n);
                lm_poison_f32(g.p[i], n);
            }
            lm_poison_f32(dx, nx);
            assert_int_equal(lm_moe_backward(ctx, &W, D->t[I_X], D->t[I_DO], dx, &g, &err), LM_OK);
            res_add(R, "dx", LM_F32, 2, D->shape[I_X], dx);
            for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
                if (!g.p[i])
                    continue;
                char name[64];
                snprintf(name, sizeof name, "d%s", lm_moe_weight_name((lm_moe_weight_id)i));
                res_add(R, name, LM_F32, D->nd[I_W0 + i], D->shape[I_W0 + i], g.p[i]);
                free(g.p[i]);
            }
        }
        free(out), free(dx);
        lm_moe_ctx_free(ctx);
    }
    lm_router_state_free(&st);
}

/* OUT holds exactly R's tensors, with the same dtypes, shapes and bits. */
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
        assert_int_equal(e->dtype, R->dt[i]);
        assert_int_equal(e->ndim, R->nd[i]);
        int64_t n = 1;
        for (int q = 0; q < R->nd[i]; q++) {
            assert_int_equal(e->shape[q], R->shape[i][q]);
            n *= e->shape[q];
        }
        const size_t bytes = (size_t)n * lm_dtype_size(R->dt[i]);
        if (memcmp(e->data, R->p[i], bytes) != 0)
            print_message("%s: CLI != library\n", R->name[i]);
        assert_memory_equal(e->data, R->p[i], bytes);
        if (R->dt[i] == LM_F32)
            for (int64_t q = 0; q < n; q++)
                assert_true(isfinite(((const float *)e->data)[q]));
    }
    assert_int_equal(st.n_entries, R->n);
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
    writer_fill(&w, s, &D, NULL, NULL);
    lm_writer_save(&w, in);
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op %s --in %s --out %s", s->layer ? "moe" : "moe_router",
                        in, out);
    if (rc != 0)
        print_message("linmoe op failed (%d):\n%s\n", rc, msg);
    assert_int_equal(rc, 0);
    result R;
    direct_run(s, &D, &R);
    check_output(out, &R);
    res_free(&R);
    data_free(&D);
}

/* ---------------------------------------------------------------- good runs */

static void test_router_backward(void **state) {
    (void)state;
    spec s = {.T = 37,
              .E = 8,
              .k = 3,
              .scoring = "sigmoid",
              .norm = 1,
              .scale = 2.5f,
              .has_bias = 1,
              .has_grad = 1};
    run_and_compare(&s, 11, "router_bwd");
}

/* softmax, group-limited, BF16 storage, k = 2 taken from dtopk_weight's shape (no
 * num_experts_per_tok in the metadata) */
static void test_router_softmax_groups_bf16(void **state) {
    (void)state;
    spec s = {.T = 20,
              .E = 8,
              .k = 2,
              .scoring = "softmax",
              .norm = -1,
              .n_group = 4,
              .topk_group = 2,
              .has_grad = 1,
              .dtype = LM_BF16,
              .no_k_meta = 1};
    run_and_compare(&s, 22, "router_softmax");
}

/* training with capacity: keep is written; F64 storage; forward only */
static void test_router_capacity(void **state) {
    (void)state;
    spec s = {.T = 40,
              .E = 4,
              .k = 1,
              .norm = -1,
              .training = 1,
              .cf = 0.5f,
              .drop = "position",
              .has_bias = 1,
              .dtype = LM_F64};
    run_and_compare(&s, 33, "router_cap");
}

static void test_layer_backward(void **state) {
    (void)state;
    spec s = {.layer = 1,
              .T = 29,
              .d = 12,
              .f = 8,
              .E = 6,
              .k = 2,
              .n_shared = 2,
              .norm = 1,
              .scale = 1.5f,
              .has_bias = 1,
              .has_grad = 1};
    run_and_compare(&s, 44, "layer_bwd");
}

/* training with drops (probs), softmax, no shared experts, BF16 storage */
static void test_layer_training_drops(void **state) {
    (void)state;
    spec s = {.layer = 1,
              .T = 24,
              .d = 8,
              .f = 6,
              .E = 4,
              .k = 2,
              .scoring = "softmax",
              .norm = -1,
              .training = 1,
              .cf = 0.75f,
              .drop = "probs",
              .has_grad = 1,
              .dtype = LM_BF16};
    run_and_compare(&s, 55, "layer_drop");
}

static void test_layer_forward(void **state) {
    (void)state;
    spec s = {.layer = 1,
              .T = 17,
              .d = 8,
              .f = 4,
              .E = 5,
              .k = 3,
              .n_shared = 1,
              .norm = 0,
              .has_bias = 1};
    run_and_compare(&s, 66, "layer_fwd");
}

/* ---------------------------------------------------------------- bad inputs */

static void expect_op_failure(const char *op, const char *in, char *msg, size_t msg_size) {
    static const char sentinel[] = "sentinel: a previous good output";
    const char *out = lm_cli_path("keep_out.safetensors");
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(sentinel, 1, sizeof sentinel, f), sizeof sentinel);
    assert_int_equal(fclose(f), 0);
    int rc = lm_run_cli(msg, msg_size, "op %s --in %s --out %s", op, in, out);
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
    int64_t shape[3]; /* ... by one of this shape (normal values) */
    int nan_at;       /* > 0: poison element nan_at - 1 of `tensor` instead */
} tweak;

static void bad_case(const char *tag, const spec *s, const tweak *tw, const char *skip_meta,
                     const char *meta_k, const char *meta_v, char *msg, size_t msg_size) {
    data D;
    data_gen(s, &D, 777);
    lm_st_writer w;
    lm_st_writer_init(&w);
    if (tw && tw->nan_at > 0) {
        for (int i = 0; i < NI; i++)
            if (D.present[i] && strcmp(slot_name(i), tw->tensor) == 0)
                D.t[i][tw->nan_at - 1] = NAN;
        writer_fill(&w, s, &D, NULL, skip_meta);
    } else {
        writer_fill(&w, s, &D, tw ? tw->tensor : NULL, skip_meta);
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
    expect_op_failure(s->layer ? "moe" : "moe_router", in, msg, msg_size);
    lm_assert_says(msg, name);
}

static spec layer_spec(void) {
    spec s = {.layer = 1,
              .T = 10,
              .d = 8,
              .f = 6,
              .E = 4,
              .k = 2,
              .n_shared = 1,
              .norm = -1,
              .has_grad = 1};
    return s;
}

static spec router_spec(void) {
    spec s = {.T = 10, .E = 4, .k = 2, .norm = -1, .has_bias = 1, .has_grad = 1};
    return s;
}

static void test_bad_shapes(void **state) {
    (void)state;
    char msg[8192];
    spec s = layer_spec();
    tweak down = {"experts.down_proj", 3, {4, 8, 7}, 0};
    bad_case("bad_down", &s, &down, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "experts.down_proj");
    lm_assert_says(msg, "moe_intermediate_size = 6");
    tweak gate = {"gate.weight", 2, {4, 9}, 0};
    bad_case("bad_gate", &s, &gate, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'gate.weight' shape [4,9]: dim 1 (hidden_size) is 9 but x [10,8]");
    tweak up = {"experts.up_proj", 3, {5, 6, 8}, 0};
    bad_case("bad_up_E", &s, &up, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "experts.up_proj");
    lm_assert_says(msg, "num_experts = 4");
    tweak sh = {"shared_experts.down_proj", 2, {8, 12}, 0};
    bad_case("bad_shared", &s, &sh, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "shared_experts.down_proj");
    tweak sh_gate = {"shared_experts.gate_proj", 2, {9, 8}, 0};
    bad_case("bad_shared_width", &s, &sh_gate, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "not a multiple of moe_intermediate_size = 6");
    tweak do_ = {"do", 2, {9, 8}, 0};
    bad_case("bad_do", &s, &do_, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'do' shape [9,8]: dim 0 (T)");
    tweak x3 = {"x", 3, {1, 10, 8}, 0};
    bad_case("bad_x_rank", &s, &x3, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'x' shape [1,10,8] has 3 dims; expected 2");
    /* partial shared experts */
    tweak no_up = {"shared_experts.up_proj", 0, {0}, 0};
    bad_case("bad_shared_partial", &s, &no_up, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "shared experts need all of");
    /* router op */
    spec r = router_spec();
    tweak dtw = {"dtopk_weight", 2, {11, 2}, 0};
    bad_case("bad_dtw", &r, &dtw, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "tensor 'dtopk_weight' shape [11,2]: dim 0 (T) is 11 but logits [10,4]");
    tweak dtw_k = {"dtopk_weight", 2, {10, 3}, 0};
    bad_case("bad_dtw_k", &r, &dtw_k, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "num_experts_per_tok' = 2");
    tweak bias = {"e_score_correction_bias", 1, {5}, 0};
    bad_case("bad_bias", &r, &bias, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "e_score_correction_bias");
}

static void test_bad_attributes(void **state) {
    (void)state;
    char msg[8192];
    spec s = layer_spec(), r = router_spec();
    bad_case("bad_scoring", &s, NULL, "scoring_func", "scoring_func", "relu", msg, sizeof msg);
    lm_assert_says(msg, "'scoring_func' = 'relu' is not one of sigmoid|softmax");
    bad_case("bad_scoring_router", &r, NULL, "scoring_func", "scoring_func", "tanh", msg,
             sizeof msg);
    lm_assert_says(msg, "scoring_func");
    bad_case("bad_k", &s, NULL, "num_experts_per_tok", "num_experts_per_tok", "5", msg, sizeof msg);
    lm_assert_says(msg, "num_experts_per_tok = 5");
    bad_case("bad_k_router", &r, NULL, "num_experts_per_tok", "num_experts_per_tok", "9", msg,
             sizeof msg);
    lm_assert_says(msg, "num_experts_per_tok");
    bad_case("bad_cf", &s, NULL, NULL, "capacity_factor", "-0.5", msg, sizeof msg);
    lm_assert_says(msg, "capacity_factor = -0.5");
    bad_case("bad_cf_router", &r, NULL, NULL, "capacity_factor", "-2", msg, sizeof msg);
    lm_assert_says(msg, "capacity_factor");
    bad_case("bad_drop", &s, NULL, NULL, "drop_policy", "random", msg, sizeof msg);
    lm_assert_says(msg, "'drop_policy' = 'random'");
    bad_case("bad_training", &s, NULL, "training", "training", "maybe", msg, sizeof msg);
    lm_assert_says(msg, "'training' = 'maybe'");
    bad_case("no_k", &s, NULL, "num_experts_per_tok", NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "missing __metadata__ 'num_experts_per_tok'");
    bad_case("bad_hidden", &s, NULL, NULL, "hidden_size", "16", msg, sizeof msg);
    lm_assert_says(msg, "'hidden_size' = 16 disagrees with x dim 1 (8)");
    bad_case("bad_group", &s, NULL, NULL, "n_group", "3", msg, sizeof msg);
    lm_assert_says(msg, "n_group = 3");
    tweak nan = {"x", 0, {0}, 7};
    bad_case("bad_nan", &s, &nan, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "non-finite");
    tweak nanl = {"logits", 0, {0}, 5};
    bad_case("bad_nan_logits", &r, &nanl, NULL, NULL, NULL, msg, sizeof msg);
    lm_assert_says(msg, "not finite");
}

/* An unknown metadata key runs, with the warning the other op runners give (issue 25
 * reported moe_router ignoring 'min_capacity' silently; both MoE runners already warned
 * at this commit: this keeps them consistent). */
static void test_unknown_meta_warns(void **state) {
    (void)state;
    for (int layer = 0; layer < 2; layer++) {
        spec s = layer ? layer_spec() : router_spec();
        data D;
        data_gen(&s, &D, 778);
        lm_st_writer w;
        lm_st_writer_init(&w);
        writer_fill(&w, &s, &D, NULL, NULL);
        meta(&w, "min_capacity", "4");
        const char *in = lm_cli_path(layer ? "unk_layer.safetensors" : "unk_router.safetensors");
        const char *out = lm_cli_path("unk_out.safetensors");
        lm_writer_save(&w, in);
        data_free(&D);
        char msg[8192];
        int rc = lm_run_cli(msg, sizeof msg, "op %s --in %s --out %s", layer ? "moe" : "moe_router",
                            in, out);
        print_message("%s", msg);
        assert_int_equal(rc, 0);
        lm_assert_says(msg, "warning");
        lm_assert_says(msg, "__metadata__ key 'min_capacity' is not used by this op");
    }
}

/* help texts and usage errors of the new names */
static void test_help_and_usage(void **state) {
    (void)state;
    char msg[8192];
    int rc = lm_run_cli(msg, sizeof msg, "op moe --help");
    assert_int_equal(rc, 0);
    lm_assert_says(msg, "op moe_router");
    lm_assert_says(msg, "experts.down_proj [E,d,f]");
    rc = lm_run_cli(msg, sizeof msg, "bench moe --help");
    assert_int_equal(rc, 0);
    lm_assert_says(msg, "bench kda|moe");
    rc = lm_run_cli(msg, sizeof msg, "op moe --in a.safetensors");
    assert_int_equal(rc, 2);
    lm_assert_says(msg, "missing --out");
    rc = lm_run_cli(msg, sizeof msg, "bench moe --threads 0");
    assert_int_equal(rc, 2);
    lm_assert_says(msg, "--threads '0'");
    rc = lm_run_cli(msg, sizeof msg, "op moe --in %s --out %s", lm_cli_path("does_not_exist.safetensors"),
                    lm_cli_path("o.safetensors"));
    assert_int_equal(rc, 1);
    lm_assert_says(msg, "does_not_exist.safetensors");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router_backward),
        cmocka_unit_test(test_router_softmax_groups_bf16),
        cmocka_unit_test(test_router_capacity),
        cmocka_unit_test(test_layer_backward),
        cmocka_unit_test(test_layer_training_drops),
        cmocka_unit_test(test_layer_forward),
        cmocka_unit_test(test_bad_shapes),
        cmocka_unit_test(test_bad_attributes),
        cmocka_unit_test(test_unknown_meta_warns),
        cmocka_unit_test(test_help_and_usage),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
