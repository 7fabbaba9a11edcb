/* MoE layer (include/linmoe/moe.h) against the fp64 reference (tests/support/moe_ref.c).
 *
 * Per case: the fp32 forward vs the fp64 reference with the same routing decisions
 * (relative RMS <= TOL_FWD_F32), and the fp32 backward vs central finite
 * differences of the fp64 reference loss sum(out * dout) + aux (relative RMS <=
 * TOL_BWD_F32) for x, gate.weight and every routed and shared expert weight. The
 * reference holds (topk_idx, keep) fixed; that it is the layer's true derivative
 * is asserted by re-running the fp32 layer at every +-h perturbation of x and
 * gate.weight (the only inputs that move the routing) and requiring the same
 * selection and kept set. FD step h = 1e-5 in fp64 (truncation O(h^2) ~ 1e-10,
 * rounding ~ 1e-16 * |L| / h ~ 1e-10 here).
 *
 * Grid: sigmoid and softmax, k = 1 and k > 1, normalised and not, scaling 2.5,
 * group-limited routing, capacity dropping in training (probs and position, with
 * partial and full drops) and dropless eval with a capacity factor set, the aux
 * loss, no shared experts, a dead expert (exactly zero gradients), a case large
 * enough for several row and column blocks (sampled FD). Plus: bitwise identical
 * results across thread counts, repeated backward, and the configuration / shape
 * / input errors.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_ref.h"
#include "test_util.h"

#include "linmoe/core.h"
#include "linmoe/moe.h"
#include "linmoe/moe_router.h"
#include "ops/cpu/moe_cpu.h" /* the benchmark's threading switch */

#define FD_H 1e-5

typedef struct {
    const char *name;
    int T, d, f, n_shared, E, k;
    lm_score_func score;
    int norm;
    float scale;
    int n_group, topk_group;
    int training;
    float cf;
    lm_drop_policy drop;
    lm_balance_mode bal;
    float aux_alpha;
    int dead;        /* 1: bias -100 on the last expert, which then never gets a token */
    int fd_samples;  /* 0: every element; else this many random elements per tensor */
    int expect_drop; /* 1: assert that capacity dropped something; -1: assert nothing dropped */
    uint64_t seed;
} moe_case;

/* ---------------------------------------------------------------- fixture */

typedef struct {
    const moe_case *mc;
    lm_moe_config c;
    int64_t n[LM_MOE_N_WEIGHTS]; /* numel of each weight (0: absent) */
    int64_t nx;
    float *x, *dout, *w[LM_MOE_N_WEIGHTS];
    double *x64, *dout64, *w64[LM_MOE_N_WEIGHTS];
    lm_router_state st;
    lm_moe_ctx *ctx;
    lm_moe_weights W;
    /* results */
    float *out, *dx, *g[LM_MOE_N_WEIGHTS];
    int64_t *idx;
    uint8_t *keep;
} fixture;

static void case_config(const moe_case *mc, lm_moe_config *c) {
    lm_moe_config_default(c, mc->d, mc->f, mc->E, mc->k, mc->n_shared);
    c->router.scoring_func = mc->score;
    c->router.norm_topk_prob = mc->norm;
    c->router.routed_scaling_factor = mc->scale;
    c->router.n_group = mc->n_group;
    c->router.topk_group = mc->topk_group;
    c->router.capacity_factor = mc->cf;
    c->router.drop_policy = mc->drop;
    c->router.balance = mc->bal;
    c->router.aux_loss_alpha = mc->aux_alpha;
}

static float *f32_of(double *src, int64_t n) {
    float *y = lm_to_f32(src, n);
    for (int64_t i = 0; i < n; i++)
        src[i] = (double)y[i]; /* the reference sees fp32 values */
    return y;
}

static void fixture_init(fixture *fx, const moe_case *mc) {
    memset(fx, 0, sizeof *fx);
    fx->mc = mc;
    case_config(mc, &fx->c);
    lm_error err = {LM_OK, ""};
    lm_status st = lm_moe_config_validate(&fx->c, &err);
    if (st != LM_OK)
        print_message("%s: %s\n", mc->name, err.msg);
    assert_int_equal(st, LM_OK);
    uint64_t seed = mc->seed;
    fx->nx = (int64_t)mc->T * mc->d;
    fx->x64 = malloc(sizeof(double) * (size_t)fx->nx);
    fx->dout64 = malloc(sizeof(double) * (size_t)fx->nx);
    lm_fill_normal(fx->x64, fx->nx, seed++, 0.0, 1.0);
    lm_fill_normal(fx->dout64, fx->nx, seed++, 0.0, 1.0);
    fx->x = f32_of(fx->x64, fx->nx);
    fx->dout = f32_of(fx->dout64, fx->nx);
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        int64_t shape[3];
        int nd = lm_moe_weight_shape(&fx->c, (lm_moe_weight_id)i, shape);
        assert_true(nd >= 0);
        if (nd == 0)
            continue;
        int64_t n = 1;
        for (int q = 0; q < nd; q++)
            n *= shape[q];
        fx->n[i] = n;
        fx->w64[i] = malloc(sizeof(double) * (size_t)n);
        /* torch Linear-like scale 1/sqrt(fan_in): logits and activations O(1) */
        lm_fill_normal(fx->w64[i], n, seed++, 0.0, 1.0 / sqrt((double)shape[nd - 1]));
        fx->w[i] = f32_of(fx->w64[i], n);
        fx->W.p[i] = fx->w[i];
        fx->g[i] = malloc(sizeof(float) * (size_t)n);
    }
    assert_int_equal(lm_router_state_init(&fx->st, mc->E, &err), LM_OK);
    double *b = malloc(sizeof(double) * (size_t)mc->E);
    lm_fill_normal(b, mc->E, seed++, 0.0, 0.1); /* a non-zero selection bias */
    for (int e = 0; e < mc->E; e++)
        fx->st.e_score_correction_bias[e] = (float)b[e];
    if (mc->dead)
        fx->st.e_score_correction_bias[mc->E - 1] = -100.0f;
    free(b);
    st = lm_moe_ctx_new(&fx->ctx, &fx->c, mc->T + 3, &err);
    if (st != LM_OK)
        print_message("%s: %s\n", mc->name, err.msg);
    assert_int_equal(st, LM_OK);
    fx->out = malloc(sizeof(float) * (size_t)fx->nx);
    fx->dx = malloc(sizeof(float) * (size_t)fx->nx);
    fx->idx = malloc(sizeof(int64_t) * (size_t)mc->T * mc->k);
    fx->keep = malloc((size_t)mc->T * mc->k);
}

static void fixture_free(fixture *fx) {
    free(fx->x), free(fx->dout), free(fx->x64), free(fx->dout64);
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
        free(fx->w[i]), free(fx->w64[i]), free(fx->g[i]);
    free(fx->out), free(fx->dx), free(fx->idx), free(fx->keep);
    lm_router_state_free(&fx->st);
    lm_moe_ctx_free(fx->ctx);
}

/* fp32 forward of the fixture's current fp32 values; copies the routing out. */
static void run_forward(fixture *fx) {
    lm_error err = {LM_OK, ""};
    lm_poison_f32(fx->out, fx->nx);
    lm_status st = lm_moe_forward(fx->ctx, &fx->W, &fx->st, fx->x, fx->mc->T, NULL, 0,
                                  fx->mc->training, fx->out, &err);
    if (st != LM_OK)
        print_message("%s: forward: %s\n", fx->mc->name, err.msg);
    assert_int_equal(st, LM_OK);
    const lm_route *r = lm_moe_ctx_route(fx->ctx);
    assert_non_null(r);
    const int64_t nk = (int64_t)fx->mc->T * fx->mc->k;
    memcpy(fx->idx, r->topk_idx, sizeof(int64_t) * (size_t)nk);
    memcpy(fx->keep, r->keep, (size_t)nk);
}

static void run_backward(fixture *fx) {
    lm_error err = {LM_OK, ""};
    lm_moe_grads g;
    lm_poison_f32(fx->dx, fx->nx);
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        g.p[i] = fx->n[i] ? fx->g[i] : NULL;
        if (g.p[i])
            lm_poison_f32(g.p[i], fx->n[i]);
    }
    lm_status st = lm_moe_backward(fx->ctx, &fx->W, fx->x, fx->dout, fx->dx, &g, &err);
    if (st != LM_OK)
        print_message("%s: backward: %s\n", fx->mc->name, err.msg);
    assert_int_equal(st, LM_OK);
}

static lm_moe_ref_params ref_params(const fixture *fx) {
    lm_moe_ref_params p;
    p.x = fx->x64;
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
        p.w[i] = fx->w64[i];
    return p;
}

/* The same selection and kept set as the fixture's saved routing? */
static int same_routing(const fixture *fx, const int64_t *idx, const uint8_t *keep) {
    const int64_t nk = (int64_t)fx->mc->T * fx->mc->k;
    return memcmp(idx, fx->idx, sizeof(int64_t) * (size_t)nk) == 0 &&
           memcmp(keep, fx->keep, (size_t)nk) == 0;
}

/* ---------------------------------------------------------------- the check */

/* FD of the fp64 reference for tensor `which` (-1: x), compared with `analytic`. */
static void fd_check(fixture *fx, int which, const float *analytic, const char *name) {
    const moe_case *mc = fx->mc;
    lm_moe_ref_cfg rc = lm_moe_ref_cfg_from(&fx->c, mc->T);
    lm_moe_ref_params p = ref_params(fx);
    double *v = which < 0 ? fx->x64 : fx->w64[which];
    float *v32 = which < 0 ? fx->x : fx->w[which];
    const int64_t n = which < 0 ? fx->nx : fx->n[which];
    const int moves_routing = which < 0 || which == LM_MOE_GATE_WEIGHT;
    int64_t m = mc->fd_samples > 0 && mc->fd_samples < n ? mc->fd_samples : n;
    double *fd = malloc(sizeof(double) * (size_t)m);
    float *an = malloc(sizeof(float) * (size_t)m);
    const int64_t nk = (int64_t)mc->T * mc->k;
    int64_t *idx2 = malloc(sizeof(int64_t) * (size_t)nk);
    uint8_t *keep2 = malloc((size_t)nk);
    lm_rng rng;
    lm_rng_init(&rng, mc->seed * 7919 + (uint64_t)(which + 2));
    float *out_save = malloc(sizeof(float) * (size_t)fx->nx);
    memcpy(out_save, fx->out, sizeof(float) * (size_t)fx->nx);
    for (int64_t s = 0; s < m; s++) {
        const int64_t i = m == n ? s : (int64_t)(lm_rng_uniform(&rng) * (double)n);
        const double v0 = v[i];
        const float v320 = v32[i];
        double L[2];
        for (int sgn = 0; sgn < 2; sgn++) {
            const double h = sgn ? -FD_H : FD_H;
            v[i] = v0 + h;
            L[sgn] = lm_moe_ref_loss(&rc, &p, fx->idx, fx->keep, fx->dout64);
            if (moves_routing) { /* the fp32 layer at the same point routes the same way */
                v32[i] = (float)(v0 + h);
                lm_error err = {LM_OK, ""};
                assert_int_equal(lm_moe_forward(fx->ctx, &fx->W, &fx->st, fx->x, mc->T, NULL, 0,
                                                mc->training, fx->out, &err),
                                 LM_OK);
                const lm_route *r = lm_moe_ctx_route(fx->ctx);
                memcpy(idx2, r->topk_idx, sizeof(int64_t) * (size_t)nk);
                memcpy(keep2, r->keep, (size_t)nk);
                if (!same_routing(fx, idx2, keep2))
                    print_message("%s: %s[%lld] %+g changes the routing\n", mc->name, name,
                                  (long long)i, h);
                assert_true(same_routing(fx, idx2, keep2));
                v32[i] = v320;
            }
        }
        v[i] = v0;
        fd[s] = (L[0] - L[1]) / (2.0 * FD_H);
        an[s] = analytic[i];
    }
    char label[160];
    snprintf(label, sizeof label, "%s d%s (%lld of %lld by FD)", mc->name, name, (long long)m,
             (long long)n);
    assert_true(lm_check_f32(label, an, fd, m, TOL_BWD_F32));
    if (moves_routing) { /* restore the context's saved forward for later checks */
        lm_error err = {LM_OK, ""};
        assert_int_equal(lm_moe_forward(fx->ctx, &fx->W, &fx->st, fx->x, mc->T, NULL, 0,
                                        mc->training, fx->out, &err),
                         LM_OK);
        assert_memory_equal(fx->out, out_save, sizeof(float) * (size_t)fx->nx);
    }
    free(out_save);
    free(fd), free(an), free(idx2), free(keep2);
}

static void run_case(void **state) {
    const moe_case *mc = (const moe_case *)*state;
    fixture fx;
    fixture_init(&fx, mc);
    run_forward(&fx);

    /* routing sanity: in range, no duplicates, drops as the case expects */
    const int64_t nk = (int64_t)mc->T * mc->k;
    int64_t dropped = 0;
    for (int t = 0; t < mc->T; t++)
        for (int j = 0; j < mc->k; j++) {
            const int64_t e = fx.idx[(int64_t)t * mc->k + j];
            assert_true(e >= 0 && e < mc->E);
            for (int q = 0; q < j; q++)
                assert_true(fx.idx[(int64_t)t * mc->k + q] != e);
            if (mc->dead)
                assert_true(e != mc->E - 1);
        }
    for (int64_t a = 0; a < nk; a++)
        dropped += !fx.keep[a];
    if (mc->expect_drop > 0)
        assert_true(dropped > 0);
    if (mc->expect_drop < 0)
        assert_int_equal(dropped, 0);
    if (!mc->training)
        assert_int_equal(dropped, 0); /* eval is dropless */

    /* forward vs fp64 */
    lm_moe_ref_cfg rc = lm_moe_ref_cfg_from(&fx.c, mc->T);
    lm_moe_ref_params p = ref_params(&fx);
    double *ref = malloc(sizeof(double) * (size_t)fx.nx), aux = 0.0;
    lm_moe_ref_forward(&rc, &p, fx.idx, fx.keep, ref, &aux);
    char label[160];
    snprintf(label, sizeof label, "%s out", mc->name);
    assert_true(lm_check_f32(label, fx.out, ref, fx.nx, TOL_FWD_F32));
    if (mc->bal == LM_BAL_AUX_LOSS) {
        const double a32 = lm_moe_ctx_route(fx.ctx)->aux_loss;
        print_message("%s aux loss: layer %.9g reference %.9g\n", mc->name, a32, aux);
        assert_true(aux > 0.0 && fabs(a32 - aux) <= 1e-5 * fabs(aux));
    }
    free(ref);

    /* backward vs FD of the reference */
    run_backward(&fx);
    if (mc->dead) { /* the dead expert's gradients are exactly zero */
        const int e = mc->E - 1;
        const int64_t fd_ = (int64_t)mc->f * mc->d;
        for (int i = LM_MOE_EXPERTS_GATE_PROJ; i <= LM_MOE_EXPERTS_DOWN_PROJ; i++)
            for (int64_t q = 0; q < fd_; q++)
                assert_true(fx.g[i][(int64_t)e * fd_ + q] == 0.0f);
    }
    fd_check(&fx, -1, fx.dx, "x");
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
        if (fx.n[i])
            fd_check(&fx, i, fx.g[i], lm_moe_weight_name((lm_moe_weight_id)i));
    fixture_free(&fx);
}

/* ---------------------------------------------------------------- the grid */

#define SIG LM_SCORE_SIGMOID
#define SMX LM_SCORE_SOFTMAX
/* clang-format off */
static const moe_case GRID[] = {
    {.name = "sigmoid_k2_eval", .T = 13, .d = 8, .f = 6, .n_shared = 2, .E = 5, .k = 2,
     .score = SIG, .norm = 1, .scale = 2.5f, .bal = LM_BAL_AUX_FREE, .seed = 11},
    {.name = "softmax_k1_eval", .T = 11, .d = 8, .f = 5, .n_shared = 1, .E = 4, .k = 1,
     .score = SMX, .norm = 1, .scale = 1.0f, .seed = 22},
    /* k = 1: the weight is the raw score (normalisation does not apply) */
    {.name = "sigmoid_k1_raw_score", .T = 9, .d = 6, .f = 4, .n_shared = 1, .E = 3, .k = 1,
     .score = SIG, .norm = 1, .scale = 1.0f, .seed = 33},
    {.name = "softmax_k3_nonorm", .T = 10, .d = 7, .f = 5, .n_shared = 1, .E = 6, .k = 3,
     .score = SMX, .norm = 0, .scale = 1.5f, .seed = 44},
    /* capacity in training: C = ceil(16*2/4*0.75) = 6 per expert */
    {.name = "sigmoid_k2_drop_probs", .T = 16, .d = 8, .f = 6, .n_shared = 1, .E = 4, .k = 2,
     .score = SIG, .norm = 1, .scale = 1.0f, .training = 1, .cf = 0.75f, .drop = LM_DROP_PROBS,
     .bal = LM_BAL_AUX_FREE, .expect_drop = 1, .seed = 55},
    /* C = ceil(14*2/4*0.5) = 4: some tokens lose both experts (no shared experts: out = 0) */
    {.name = "softmax_k2_drop_position", .T = 14, .d = 8, .f = 6, .n_shared = 0, .E = 4, .k = 2,
     .score = SMX, .norm = 1, .scale = 1.0f, .training = 1, .cf = 0.5f, .drop = LM_DROP_POSITION,
     .expect_drop = 1, .seed = 66},
    {.name = "sigmoid_k1_drop_probs", .T = 15, .d = 6, .f = 5, .n_shared = 1, .E = 3, .k = 1,
     .score = SIG, .norm = 1, .scale = 1.0f, .training = 1, .cf = 0.6f, .drop = LM_DROP_PROBS,
     .expect_drop = 1, .seed = 77},
    /* a capacity factor in eval changes nothing (same data as sigmoid_k2_drop_probs) */
    {.name = "sigmoid_k2_eval_cf", .T = 16, .d = 8, .f = 6, .n_shared = 1, .E = 4, .k = 2,
     .score = SIG, .norm = 1, .scale = 1.0f, .cf = 0.5f, .bal = LM_BAL_AUX_FREE, .expect_drop = -1,
     .seed = 55},
    /* group-limited: 3 groups of 2 experts, the best 2 groups */
    {.name = "sigmoid_k3_groups", .T = 12, .d = 8, .f = 4, .n_shared = 1, .E = 6, .k = 3,
     .score = SIG, .norm = 1, .scale = 2.5f, .n_group = 3, .topk_group = 2, .bal = LM_BAL_AUX_FREE,
     .seed = 88},
    /* the aux loss' gradient reaches the router weight and x */
    {.name = "sigmoid_k2_aux_loss", .T = 12, .d = 6, .f = 4, .n_shared = 1, .E = 4, .k = 2,
     .score = SIG, .norm = 1, .scale = 1.0f, .training = 1, .bal = LM_BAL_AUX_LOSS,
     .aux_alpha = 0.5f, .seed = 99},
    {.name = "softmax_k2_aux_loss_drop", .T = 12, .d = 6, .f = 4, .n_shared = 0, .E = 4, .k = 2,
     .score = SMX, .norm = 1, .scale = 1.0f, .training = 1, .cf = 0.75f, .drop = LM_DROP_PROBS,
     .bal = LM_BAL_AUX_LOSS, .aux_alpha = 0.5f, .expect_drop = 1, .seed = 111},
    /* a dead expert: exactly zero gradients */
    {.name = "sigmoid_k2_dead", .T = 10, .d = 6, .f = 4, .n_shared = 1, .E = 5, .k = 2,
     .score = SIG, .norm = 1, .scale = 1.0f, .training = 1, .bal = LM_BAL_AUX_FREE, .dead = 1,
     .seed = 122},
    {.name = "T1", .T = 1, .d = 6, .f = 4, .n_shared = 1, .E = 5, .k = 2, .score = SIG, .norm = 1,
     .scale = 1.0f, .bal = LM_BAL_AUX_FREE, .seed = 133},
    /* several row blocks (T > 256) and d / fs column blocks (> 64), sampled FD */
    {.name = "blocks_k2_drop", .T = 300, .d = 72, .f = 36, .n_shared = 2, .E = 5, .k = 2,
     .score = SIG, .norm = 1, .scale = 1.0f, .training = 1, .cf = 1.0f, .drop = LM_DROP_PROBS,
     .bal = LM_BAL_AUX_FREE, .fd_samples = 24, .expect_drop = 1, .seed = 144},
};
/* clang-format on */
#define N_GRID ((int)(sizeof(GRID) / sizeof(GRID[0])))

/* ---------------------------------------------------------------- determinism */

/* The same results, bit for bit, on 1, 2 and 3 threads (and on a repeated backward). */
static void test_threads(void **state) {
    (void)state;
    const moe_case *mc = &GRID[N_GRID - 1];
    fixture fx;
    fixture_init(&fx, mc);
    float *ref[LM_MOE_N_WEIGHTS + 2] = {0};
    const int counts[] = {1, 2, 3};
    for (int ti = 0; ti < 3; ti++) {
        lm_set_num_threads(counts[ti]);
        run_forward(&fx);
        run_backward(&fx);
        float *res[LM_MOE_N_WEIGHTS + 2];
        int64_t len[LM_MOE_N_WEIGHTS + 2];
        res[0] = fx.out, len[0] = fx.nx;
        res[1] = fx.dx, len[1] = fx.nx;
        for (int i = 0; i < LM_MOE_N_WEIGHTS; i++)
            res[i + 2] = fx.g[i], len[i + 2] = fx.n[i];
        for (int i = 0; i < LM_MOE_N_WEIGHTS + 2; i++) {
            if (!len[i])
                continue;
            if (ti == 0) {
                ref[i] = malloc(sizeof(float) * (size_t)len[i]);
                memcpy(ref[i], res[i], sizeof(float) * (size_t)len[i]);
            } else {
                if (memcmp(ref[i], res[i], sizeof(float) * (size_t)len[i]) != 0)
                    print_message("output %d differs between 1 and %d threads\n", i, counts[ti]);
                assert_memory_equal(ref[i], res[i], sizeof(float) * (size_t)len[i]);
            }
        }
        if (ti == 2) { /* a second backward of the same forward gives the same bits */
            run_backward(&fx);
            for (int i = 1; i < LM_MOE_N_WEIGHTS + 2; i++)
                if (len[i])
                    assert_memory_equal(ref[i], res[i], sizeof(float) * (size_t)len[i]);
        }
    }
    /* the benchmark's alternative threading (each GEMM on OpenBLAS's threads, tasks in
     * sequence) computes the same thing up to OpenBLAS's own partitioning */
    lm_set_num_threads(2);
    lm_blas_set_threads(2);
    lm_moe_cpu_set_threaded_blas(1);
    run_forward(&fx);
    run_backward(&fx);
    lm_moe_cpu_set_threaded_blas(0);
    lm_blas_set_threads(0);
    {
        double *r64 = lm_to_f64(ref[0], fx.nx);
        assert_true(lm_check_f32("threaded BLAS out", fx.out, r64, fx.nx, 1e-6));
        free(r64);
        r64 = lm_to_f64(ref[1], fx.nx);
        assert_true(lm_check_f32("threaded BLAS dx", fx.dx, r64, fx.nx, 1e-6));
        free(r64);
        for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
            r64 = lm_to_f64(ref[i + 2], fx.n[i]);
            assert_true(
                lm_check_f32(lm_moe_weight_name((lm_moe_weight_id)i), fx.g[i], r64, fx.n[i], 1e-6));
            free(r64);
        }
    }
    lm_set_num_threads(0);
    for (int i = 0; i < LM_MOE_N_WEIGHTS + 2; i++)
        free(ref[i]);
    fixture_free(&fx);
}

/* ---------------------------------------------------------------- errors */

static void expect_error(lm_status st, const lm_error *err, const char *needle) {
    if (st == LM_OK || !strstr(err->msg, needle))
        print_message("status %d, message '%s', expected to mention '%s'\n", (int)st, err->msg,
                      needle);
    assert_int_not_equal(st, LM_OK);
    assert_non_null(strstr(err->msg, needle));
}

static void test_bad_config(void **state) {
    (void)state;
    lm_moe_config c;
    lm_error err;
    lm_moe_ctx *ctx = NULL;
#define BAD(stmt, needle)                                                                          \
    do {                                                                                           \
        lm_moe_config_default(&c, 8, 6, 4, 2, 1);                                                  \
        stmt;                                                                                      \
        err = (lm_error){LM_OK, ""};                                                               \
        expect_error(lm_moe_config_validate(&c, &err), &err, needle);                              \
        err = (lm_error){LM_OK, ""};                                                               \
        expect_error(lm_moe_ctx_new(&ctx, &c, 16, &err), &err, needle);                            \
        assert_null(ctx);                                                                          \
    } while (0)
    BAD(c.router.num_experts_per_tok = 5, "num_experts_per_tok");
    BAD(c.router.num_experts_per_tok = 0, "num_experts_per_tok");
    BAD(c.router.capacity_factor = -1.0f, "capacity_factor");
    BAD(c.router.scoring_func = (lm_score_func)7, "scoring_func");
    BAD(c.router.drop_policy = (lm_drop_policy)9, "drop_policy");
    BAD(c.hidden_size = 0, "hidden_size");
    BAD(c.moe_intermediate_size = -3, "moe_intermediate_size");
    BAD(c.n_shared_experts = -1, "n_shared_experts");
    BAD(c.router.num_experts = 0, "num_experts");
#undef BAD
    lm_moe_config_default(&c, 8, 6, 4, 2, 1);
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_ctx_new(&ctx, &c, 0, &err), &err, "max_tokens");

    /* weight shapes against the config: the message names the weight and the field */
    const int64_t down_bad[3] = {4, 8, 7}, gate_bad[2] = {5, 8}, up_rank[2] = {4, 6};
    const int64_t down_ok[3] = {4, 8, 6}, sh_ok[2] = {6, 8};
    err = (lm_error){LM_OK, ""};
    assert_int_equal(lm_moe_check_weight_shape(&c, LM_MOE_EXPERTS_DOWN_PROJ, 3, down_ok, &err),
                     LM_OK);
    assert_int_equal(lm_moe_check_weight_shape(&c, LM_MOE_SHARED_GATE_PROJ, 2, sh_ok, &err), LM_OK);
    expect_error(lm_moe_check_weight_shape(&c, LM_MOE_EXPERTS_DOWN_PROJ, 3, down_bad, &err), &err,
                 "moe_intermediate_size");
    assert_non_null(strstr(err.msg, "experts.down_proj"));
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_check_weight_shape(&c, LM_MOE_GATE_WEIGHT, 2, gate_bad, &err), &err,
                 "num_experts");
    assert_non_null(strstr(err.msg, "gate.weight"));
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_check_weight_shape(&c, LM_MOE_EXPERTS_UP_PROJ, 2, up_rank, &err), &err,
                 "experts.up_proj");
    c.n_shared_experts = 0;
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_check_weight_shape(&c, LM_MOE_SHARED_UP_PROJ, 2, sh_ok, &err), &err,
                 "n_shared_experts");
}

static void test_bad_inputs(void **state) {
    (void)state;
    const moe_case *mc = &GRID[0];
    fixture fx;
    fixture_init(&fx, mc);
    lm_error err = {LM_OK, ""};
    /* backward before any forward */
    expect_error(lm_moe_backward(fx.ctx, &fx.W, fx.x, fx.dout, fx.dx, NULL, &err), &err,
                 "before forward");
    /* T outside [1, max_tokens] */
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_forward(fx.ctx, &fx.W, &fx.st, fx.x, mc->T + 4, NULL, 0, 0, fx.out, &err),
                 &err, "max_tokens");
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_forward(fx.ctx, &fx.W, &fx.st, fx.x, 0, NULL, 0, 0, fx.out, &err), &err,
                 "T = 0");
    /* a NaN in x names the token and channel; a data error: LM_ERR_NONFINITE */
    const float x0 = fx.x[2 * mc->d + 3];
    fx.x[2 * mc->d + 3] = NAN;
    err = (lm_error){LM_OK, ""};
    lm_status nst = lm_moe_forward(fx.ctx, &fx.W, &fx.st, fx.x, mc->T, NULL, 0, 0, fx.out, &err);
    expect_error(nst, &err, "token 2, channel 3");
    assert_int_equal(nst, LM_ERR_NONFINITE);
    fx.x[2 * mc->d + 3] = x0;
    /* a missing shared weight */
    const float *sg = fx.W.p[LM_MOE_SHARED_UP_PROJ];
    fx.W.p[LM_MOE_SHARED_UP_PROJ] = NULL;
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_forward(fx.ctx, &fx.W, &fx.st, fx.x, mc->T, NULL, 0, 0, fx.out, &err), &err,
                 "shared_experts.up_proj");
    fx.W.p[LM_MOE_SHARED_UP_PROJ] = sg;
    /* a router state of the wrong size */
    lm_router_state st2;
    assert_int_equal(lm_router_state_init(&st2, mc->E + 1, &err), LM_OK);
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_forward(fx.ctx, &fx.W, &st2, fx.x, mc->T, NULL, 0, 0, fx.out, &err), &err,
                 "num_experts");
    lm_router_state_free(&st2);
    /* a failed forward leaves no forward to differentiate */
    err = (lm_error){LM_OK, ""};
    expect_error(lm_moe_backward(fx.ctx, &fx.W, fx.x, fx.dout, fx.dx, NULL, &err), &err,
                 "before forward");
    /* and the context still works */
    run_forward(&fx);
    run_backward(&fx);
    fixture_free(&fx);
}

/* FLOP counts of reference/moe.md §6.4 */
static void test_flops(void **state) {
    (void)state;
    lm_moe_config c;
    lm_moe_config_default(&c, 512, 256, 64, 8, 1);
    const double T = 4096, d = 512, f = 256, E = 64, k = 8;
    assert_true(lm_moe_forward_flops(&c, 4096, 4096 * 8) ==
                2 * T * d * E + 6 * T * k * d * f + 6 * T * d * f);
    assert_true(lm_moe_backward_flops(&c, 4096, 4096 * 8) ==
                4 * T * d * E + 12 * T * k * d * f + 12 * T * d * f);
}

int main(void) {
    struct CMUnitTest tests[N_GRID + 8];
    int n = 0;
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_bad_config);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_bad_inputs);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_flops);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_threads);
    for (int i = 0; i < N_GRID; i++) {
        tests[n] = (struct CMUnitTest)cmocka_unit_test_prestate(run_case, (void *)&GRID[i]);
        tests[n].name = GRID[i].name;
        n++;
    }
    return _cmocka_run_group_tests("moe", tests, (size_t)n, NULL, NULL);
}
