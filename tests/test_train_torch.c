/* The optimizer and a 10-step training trajectory against PyTorch (issue 25, Build 3).
 * Fixtures: scripts/reference/make_train_fixtures.py (torch.optim.AdamW and
 * torch.nn.utils.clip_grad_norm_ in fp64, linmoe's LR schedule and router bias update
 * restated in Python; log in tests/fixtures/make_train_fixtures.log).
 *
 * test_adamw_vs_torch (adamw_torch.safetensors): five tensors and a buffer, 10 steps of
 *   given gradients (exact zeros, a zero step, clipped and unclipped steps, gradients at
 *   the size of eps), lr from lm_train_lr of the embedded train config (WSD). The given
 *   gradients go through lm_adamw_grad_norm, lm_train_clip_scale and lm_adamw_step.
 * test_trajectory_vs_torch (train_tiny_torch.safetensors): configs/tiny.json, 10 steps of
 *   2 micro-batches through lm_model_forward / lm_model_backward and lm_train_update (the
 *   update half of train.c's CPU train_step: clipping, AdamW, router bias update).
 *
 * Tolerances (relative RMS per tensor, ||out - ref|| / ||ref||):
 *  TOL_LR 1e-14      lm_train_lr vs the restated formula: the same double expression.
 *  TOL_NORM 1e-12    fp64 sums of the same fp32 squares in another order.
 *  TOL_ADAMW 1e-6    fp32 AdamW vs fp64 torch from the same fp32 start and gradients. Per
 *                    step the weight is rounded to fp32 (<= 2^-24 relative, RMS ~3.4e-8,
 *                    random over 10 steps: ~1.1e-7), the decay factor (float)(1 - lr wd)
 *                    is off by <= 3e-8 with the same sign at every step of equal lr
 *                    (<= 3e-7 over 10 steps), and the update's own fp32 round-off
 *                    (~1e-7 of an update <= lr ~ 1e-2 |p|) is below 1e-8 of |p|. Bound
 *                    ~4e-7; torch's own fp32 AdamW is at 1.3e-7 on this fixture (log).
 *                    m and v: rounded once per step, ~1e-7.
 *  TOL_TRAJ 1e-5     fp32 model vs fp64 reference, 10 steps: the fp32 gradients are within
 *                    ~1e-6 relative RMS of fp64 (test_model_parity), Adam's update
 *                    m / sqrt(v) moves by about the gradient's relative error times lr,
 *                    i.e. 1e-6 * 3e-3 per step against weights ~0.2; with the weights'
 *                    own rounding the trajectory stays at ~1e-6 (torch fp32: 7e-7, log).
 *                    The loss: the fp32 forward is within ~3e-7 (log) of fp64.
 *  TOL_GNORM_TRAJ    the pre-clip gradient norm of (b) at step 1 (both sides on the same
 *                    weights): TOL_BWD_F32 (1e-4), the bar of fp32 gradients
 *                    (test_model_parity). From step 2 on the gradients are taken at weights
 *                    that differ by ~1e-6 (TOL_TRAJ), and the norm amplifies that by the
 *                    loss's curvature: measured 2e-5 .. 1.6e-4 at step 9 (a clipped step)
 *                    depending on the KDA op's rounding, so those steps get TOL_GNORM_LATER
 *                    (1e-3), a sanity bar. The norm only sets the clip coefficient, to
 *                    which Adam is invariant but for eps; the weights are the check.
 * Elements whose Adam direction is decided by round-off (gradient at the noise floor):
 * the fixture marks them (noise_mask.<name>: where torch's fp32 trajectory leaves the fp64
 * one by more than 1 % of an Adam step); they are held to no bar but counted and reported.
 * The generator found none for this fixture, so every element is held to TOL_TRAJ; exact
 * zero gradients (embedding rows of absent tokens, layer 0's unused attn_res) give exact
 * zero updates on both sides. Routing must match exactly: the expert demand of every
 * step is compared as integers (the fixture's key gaps are >= 8e-5, fp32 noise ~1e-6). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "linmoe/model.h"
#include "linmoe/safetensors.h"
#include "linmoe/train.h"
#include "test_util.h"
#include "train/train_internal.h"

#define FIX_A "tests/fixtures/adamw_torch.safetensors"
#define FIX_B "tests/fixtures/train_tiny_torch.safetensors"
#define TOL_LR 1e-14
#define TOL_NORM 1e-12
#define TOL_ADAMW 1e-6
#define TOL_TRAJ 1e-5
#define TOL_GNORM_TRAJ TOL_BWD_F32
#define TOL_GNORM_LATER 1e-3

static void ok_or_die(lm_status s, const lm_error *err) {
    if (s != LM_OK)
        fprintf(stderr, "%s\n", err->msg);
    assert_int_equal(s, LM_OK);
}

static double *get_f64(const lm_safetensors *st, const char *name, int64_t n) {
    lm_error err = {0};
    const lm_st_entry *e = lm_st_find(st, name);
    if (!e)
        fprintf(stderr, "fixture: no tensor '%s'\n", name);
    assert_non_null(e);
    int64_t k = 1;
    for (int j = 0; j < e->ndim; j++)
        k *= e->shape[j];
    assert_int_equal(k, n);
    double *x = NULL;
    ok_or_die(lm_st_to_f64(st, name, &x, &err), &err);
    return x;
}

static void load_train_config(const lm_safetensors *st, const char *label, lm_train_config *c) {
    lm_error err = {0};
    const char *json = lm_st_meta(st, "train_config");
    assert_non_null(json);
    ok_or_die(lm_train_config_parse(c, json, label, &err), &err);
}

/* ---------------------------------------------------------------- (a) AdamW */

static void test_adamw_vs_torch(void **state) {
    (void)state;
    lm_error err = {0};
    lm_safetensors st;
    ok_or_die(lm_st_read(FIX_A, &st, &err), &err);
    lm_train_config c;
    load_train_config(&st, FIX_A ":train_config", &c);
    const int steps = atoi(lm_st_meta(&st, "steps"));
    cJSON *list = cJSON_Parse(lm_st_meta(&st, "tensors"));
    assert_non_null(list);
    const char *bufname = lm_st_meta(&st, "buffer");
    assert_non_null(bufname);
    /* the decay flags of the fixture (what torch's param groups used) must be linmoe's */
    lm_params tiny;
    ok_or_die(lm_params_init(&tiny, &c.model, &err), &err);

    lm_params p;
    memset(&p, 0, sizeof p);
    p.n = cJSON_GetArraySize(list) + 1;
    p.t = calloc((size_t)p.n, sizeof *p.t);
    int64_t off = 0;
    for (int i = 0; i < p.n; i++) {
        lm_param_info *t = &p.t[i];
        const int is_buf = i == p.n - 1;
        cJSON *it = is_buf ? NULL : cJSON_GetArrayItem(list, i);
        snprintf(t->name, sizeof t->name, "%s",
                 is_buf ? bufname : cJSON_GetArrayItem(it, 0)->valuestring);
        const lm_st_entry *e = lm_st_find(&st, t->name);
        assert_non_null(e);
        t->ndim = e->ndim;
        t->numel = 1;
        for (int j = 0; j < e->ndim; j++) {
            t->shape[j] = e->shape[j];
            t->numel *= e->shape[j];
        }
        t->offset = off;
        off += (t->numel + 15) / 16 * 16;
        t->buffer = (uint8_t)is_buf;
        t->decay = is_buf ? 0 : (uint8_t)cJSON_GetArrayItem(it, 2)->valueint;
        const lm_param_info *ti = lm_params_find(&tiny, t->name);
        assert_non_null(ti);
        if (ti->decay != t->decay || ti->buffer != t->buffer)
            fprintf(stderr, "%s: fixture decay %d buffer %d, linmoe decay %d buffer %d\n", t->name,
                    t->decay, t->buffer, ti->decay, ti->buffer);
        assert_int_equal(ti->decay, t->decay);
        assert_int_equal(ti->buffer, t->buffer);
    }
    p.numel = off;
    p.data = calloc((size_t)off, sizeof(float));
    float *g = calloc((size_t)off, sizeof(float));
    for (int i = 0; i < p.n; i++) {
        double *w = get_f64(&st, p.t[i].name, p.t[i].numel);
        for (int64_t j = 0; j < p.t[i].numel; j++)
            p.data[p.t[i].offset + j] = (float)w[j];
        free(w);
    }
    const lm_param_info *bt = &p.t[p.n - 1];
    float *buf0 = malloc(sizeof(float) * (size_t)bt->numel);
    memcpy(buf0, p.data + bt->offset, sizeof(float) * (size_t)bt->numel);

    lm_adamw a;
    lm_adamw_init(&a, &p);
    double *lr_ref = get_f64(&st, "lr", steps), *gn_ref = get_f64(&st, "grad_norm", steps);
    double worst = 0;
    const char *worst_name = "";
    int worst_step = 0, n_clipped = 0, ok = 1;
    char name[LM_PARAM_NAME_MAX + 32];
    for (int s = 0; s < steps; s++) {
        const double lr = lm_train_lr(&c, s);
        const double lr_err = fabs(lr - lr_ref[s]) / lr_ref[s];
        if (lr_err > TOL_LR)
            fprintf(stderr, "step %d: lm_train_lr %.17g, torch side %.17g\n", s + 1, lr, lr_ref[s]);
        ok &= lr_err <= TOL_LR;
        for (int i = 0; i < p.n; i++) {
            snprintf(name, sizeof name, "step%d.grad.%s", s + 1, p.t[i].name);
            double *x = get_f64(&st, name, p.t[i].numel);
            for (int64_t j = 0; j < p.t[i].numel; j++)
                g[p.t[i].offset + j] = (float)x[j];
            free(x);
        }
        const double gn = lm_adamw_grad_norm(&a, g);
        const double gn_err = gn_ref[s] > 0 ? fabs(gn - gn_ref[s]) / gn_ref[s] : fabs(gn);
        if (gn_err > TOL_NORM)
            fprintf(stderr, "step %d: grad norm %.17g, torch %.17g\n", s + 1, gn, gn_ref[s]);
        ok &= gn_err <= TOL_NORM;
        const double scale = lm_train_clip_scale(gn, c.grad_clip);
        n_clipped += scale < 1.0;
        lm_adamw_step(&a, p.data, g, scale, lr, c.weight_decay, c.beta1, c.beta2, c.eps, s + 1);
        for (int i = 0; i < p.n - 1; i++) {
            snprintf(name, sizeof name, "step%d.%s", s + 1, p.t[i].name);
            double *ref = get_f64(&st, name, p.t[i].numel);
            lm_cmp r = lm_compare_f32(p.data + p.t[i].offset, ref, p.t[i].numel, TOL_ADAMW);
            if (!r.pass)
                lm_check_f32(name, p.data + p.t[i].offset, ref, p.t[i].numel, TOL_ADAMW);
            ok &= r.pass;
            if (r.rel_rms > worst) {
                worst = r.rel_rms;
                worst_name = p.t[i].name;
                worst_step = s + 1;
            }
            free(ref);
        }
    }
    printf("  AdamW vs torch.optim.AdamW (fp64), %d steps (%d clipped): worst weight rel RMS "
           "%.2e (%s, step %d; tol %.0e)\n",
           steps, n_clipped, worst, worst_name, worst_step, TOL_ADAMW);
    assert_int_equal(n_clipped, 3);
    double worst_mv = 0;
    for (int i = 0; i < p.n - 1; i++) {
        for (int which = 0; which < 2; which++) {
            snprintf(name, sizeof name, "%s.%s", which ? "exp_avg_sq" : "exp_avg", p.t[i].name);
            double *ref = get_f64(&st, name, p.t[i].numel);
            const float *mine = (which ? a.v : a.m) + p.t[i].offset;
            lm_cmp r = lm_compare_f32(mine, ref, p.t[i].numel, TOL_ADAMW);
            if (!r.pass)
                lm_check_f32(name, mine, ref, p.t[i].numel, TOL_ADAMW);
            ok &= r.pass;
            worst_mv = r.rel_rms > worst_mv ? r.rel_rms : worst_mv;
            free(ref);
        }
    }
    printf("  final m, v vs exp_avg, exp_avg_sq: worst rel RMS %.2e\n", worst_mv);
    /* the buffer (its gradient slot held 1e3: in the norm it would have clipped every step) */
    ok &= memcmp(buf0, p.data + bt->offset, sizeof(float) * (size_t)bt->numel) == 0;
    assert_true(ok);
    free(lr_ref);
    free(gn_ref);
    free(buf0);
    free(g);
    lm_adamw_free(&a);
    free(p.data);
    free(p.t);
    lm_params_free(&tiny);
    cJSON_Delete(list);
    lm_train_config_free(&c);
    lm_st_free(&st);
}

/* ---------------------------------------------------------------- (b) trajectory */

static void test_trajectory_vs_torch(void **state) {
    (void)state;
    lm_error err = {0};
    lm_safetensors st;
    ok_or_die(lm_st_read(FIX_B, &st, &err), &err);
    lm_train_config c;
    load_train_config(&st, FIX_B ":train_config", &c);
    const int steps = atoi(lm_st_meta(&st, "steps"));
    const int M = c.micro_batches;
    lm_params p;
    ok_or_die(lm_params_init(&p, &c.model, &err), &err);
    for (int t = 0; t < p.n; t++) {
        double *w = get_f64(&st, p.t[t].name, p.t[t].numel);
        for (int64_t j = 0; j < p.t[t].numel; j++)
            p.data[p.t[t].offset + j] = (float)w[j];
        free(w);
    }
    /* torch's decay group = linmoe's decay flags */
    cJSON *dec = cJSON_Parse(lm_st_meta(&st, "decay"));
    assert_non_null(dec);
    int n_dec = 0;
    for (int t = 0; t < p.n; t++) {
        int in = 0;
        for (int j = 0; j < cJSON_GetArraySize(dec); j++)
            in |= strcmp(cJSON_GetArrayItem(dec, j)->valuestring, p.t[t].name) == 0;
        if (in != p.t[t].decay)
            fprintf(stderr, "%s: decay %d in linmoe, %d in the torch fixture\n", p.t[t].name,
                    p.t[t].decay, in);
        assert_int_equal(in, p.t[t].decay);
        n_dec += in;
    }
    assert_int_equal(n_dec, cJSON_GetArraySize(dec));
    cJSON_Delete(dec);

    char name[LM_PARAM_NAME_MAX + 32];
    snprintf(name, sizeof name, "step1.micro0.input_ids");
    const lm_st_entry *ie = lm_st_find(&st, name);
    assert_non_null(ie);
    const int B = (int)ie->shape[0], T = (int)ie->shape[1], N = B * T;
    lm_model *m;
    ok_or_die(lm_model_new(&m, &p, N, &err), &err);
    lm_adamw a;
    lm_adamw_init(&a, &p);
    const int L = p.cfg.num_hidden_layers, E = p.cfg.moe.router.num_experts;
    int n_moe = 0;
    for (int i = 0; i < L; i++)
        n_moe += lm_model_router_state(m, i) != NULL;
    double *loss_ref = get_f64(&st, "loss", steps), *lr_ref = get_f64(&st, "lr", steps),
           *gn_ref = get_f64(&st, "grad_norm", steps);
    int64_t *dem_ref = NULL;
    ok_or_die(lm_st_to_i64(&st, "demand", &dem_ref, &err), &err);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)N), *lab = malloc(sizeof(int32_t) * (size_t)N);
    int ok = 1, n_clipped = 0;
    double lr_max = 0;
    for (int s = 0; s < steps; s++)
        lr_max = lr_ref[s] > lr_max ? lr_ref[s] : lr_max;
    double worst_loss = 0, worst_gn = 0, worst_w = 0, worst_noise = 0, worst_elem = 0;
    int64_t n_noise = 0;
    const char *worst_name = "";
    int worst_step = 0;
    for (int s = 0; s < steps; s++) {
        const double lr = lm_train_lr(&c, s);
        ok &= fabs(lr - lr_ref[s]) <= TOL_LR * lr_ref[s];
        double loss_sum = 0;
        for (int mi = 0; mi < M; mi++) {
            int64_t *x;
            snprintf(name, sizeof name, "step%d.micro%d.input_ids", s + 1, mi);
            ok_or_die(lm_st_to_i64(&st, name, &x, &err), &err);
            for (int i = 0; i < N; i++)
                ids[i] = (int32_t)x[i];
            free(x);
            snprintf(name, sizeof name, "step%d.micro%d.labels", s + 1, mi);
            ok_or_die(lm_st_to_i64(&st, name, &x, &err), &err);
            for (int i = 0; i < N; i++)
                lab[i] = (int32_t)x[i];
            free(x);
            lm_model_batch b = {B, T, NULL, 0};
            double loss = 0;
            int64_t nl = 0;
            ok_or_die(lm_model_forward(m, &b, ids, lab, 1, NULL, &loss, &nl, &err), &err);
            ok_or_die(lm_model_backward(m, 1.0f / (float)M, mi > 0, &err), &err);
            loss_sum += loss;
        }
        const double loss = loss_sum / M, le = fabs(loss - loss_ref[s]) / fabs(loss_ref[s]);
        worst_loss = le > worst_loss ? le : worst_loss;
        if (le > TOL_TRAJ)
            fprintf(stderr, "step %d: loss %.9f, torch %.9f\n", s + 1, loss, loss_ref[s]);
        ok &= le <= TOL_TRAJ;
        /* the routing of both micro-batches: expert demand, exactly */
        for (int i = 0, j = 0; i < L; i++) {
            lm_router_state *rs = lm_model_router_state(m, i);
            if (!rs)
                continue;
            for (int e = 0; e < E; e++) {
                const int64_t want = dem_ref[((int64_t)s * n_moe + j) * E + e];
                if ((int64_t)rs->demand[e] != want) {
                    fprintf(stderr, "step %d layer %d expert %d: demand %.0f, torch %lld\n", s + 1,
                            i, e, rs->demand[e], (long long)want);
                    ok = 0;
                }
            }
            j++;
        }
        const double gn = lm_adamw_grad_norm(&a, lm_model_grads(m));
        const double ge = fabs(gn - gn_ref[s]) / gn_ref[s];
        worst_gn = ge > worst_gn ? ge : worst_gn;
        const double tol_gn = s == 0 ? TOL_GNORM_TRAJ : TOL_GNORM_LATER;
        if (ge > tol_gn)
            fprintf(stderr, "step %d: grad norm %.9g, torch %.9g\n", s + 1, gn, gn_ref[s]);
        ok &= ge <= tol_gn;
        n_clipped += lm_train_clip_scale(gn, c.grad_clip) < 1.0;
        ok_or_die(lm_train_update(&c, &a, &p, m, gn, lr, s + 1, NULL, E, NULL, &err), &err);
        for (int t = 0; t < p.n; t++) {
            const lm_param_info *pt = &p.t[t];
            snprintf(name, sizeof name, "step%d.%s", s + 1, pt->name);
            double *ref = get_f64(&st, name, pt->numel);
            const float *w = p.data + pt->offset;
            snprintf(name, sizeof name, "noise_mask.%s", pt->name);
            int64_t *mask = NULL;
            if (lm_st_find(&st, name))
                ok_or_die(lm_st_to_i64(&st, name, &mask, &err), &err);
            double num = 0, den = 0;
            for (int64_t j = 0; j < pt->numel; j++) {
                const double d = (double)w[j] - ref[j];
                den += ref[j] * ref[j];
                if (!isfinite(d))
                    num = INFINITY;
                if (mask && mask[j]) {
                    n_noise += s == steps - 1;
                    const double rd = fabs(d) / lr;
                    worst_noise = rd > worst_noise ? rd : worst_noise;
                } else {
                    num += d * d;
                    worst_elem = fabs(d) / lr_max > worst_elem ? fabs(d) / lr_max : worst_elem;
                }
            }
            const double e = den > 0 ? sqrt(num / den) : sqrt(num);
            if (e > TOL_TRAJ) {
                fprintf(stderr, "step %d %s: rel RMS %.3e > %.0e\n", s + 1, pt->name, e, TOL_TRAJ);
                ok = 0;
            }
            if (!(e <= worst_w)) {
                worst_w = e;
                worst_name = pt->name;
                worst_step = s + 1;
            }
            free(mask);
            free(ref);
        }
    }
    printf("  %d steps x %d micro-batches [B=%d, T=%d], %d clipped: loss worst rel err %.2e, "
           "grad norm %.2e, expert demand %s\n",
           steps, M, B, T, n_clipped, worst_loss, worst_gn, ok ? "equal" : "checked");
    printf("  weights (all %d tensors, buffers included) after every step: worst rel RMS %.2e "
           "(%s, step %d; tol %.0e)\n",
           p.n, worst_w, worst_name, worst_step, TOL_TRAJ);
    printf("  largest element error %.2e x peak lr; noise-decided elements (fixture mask): %lld, "
           "worst |error| %.2e x lr\n",
           worst_elem, (long long)n_noise, worst_noise);
    assert_true(n_clipped > 0 && n_clipped < steps);
    assert_true(ok);
    free(ids);
    free(lab);
    free(loss_ref);
    free(lr_ref);
    free(gn_ref);
    free(dem_ref);
    lm_adamw_free(&a);
    lm_model_free(m);
    lm_params_free(&p);
    lm_train_config_free(&c);
    lm_st_free(&st);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw_vs_torch),
        cmocka_unit_test(test_trajectory_vs_torch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
