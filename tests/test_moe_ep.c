/* The expert-parallel MoE layer (include/linmoe/moe_ep.h) on 2 and 4 ranks (this
 * program re-run under mpirun) against the single-process layer (moe.h) on the
 * concatenation of the ranks' tokens, which every rank computes itself: forward
 * outputs, dx, every weight gradient (the experts' of this rank; gate.weight and the
 * shared experts' summed over the ranks), the routing (selections, weights, the keep
 * flags: the same tokens dropped by capacity), the router state's demand / kept
 * counts and the bias after lm_router_update_bias, and the aux loss; cases: dropless
 * aux-free, capacity 1.0 with drops (probs and position policies), and the
 * sequence-wise aux loss; uneven token counts per rank, one rank with none.
 * Then the 2 x 2 grid on 4 ranks: EP inside each DP pair, each pair its own batch;
 * and the grid routed over the world (route = the 4 ranks): one process on the 4
 * ranks' tokens, the experts' gradients summed over the DP pair of each shard.
 *
 * Bars: outputs, dx, the experts' gradients, routing, counts and biases must be
 * bit-identical (every expert's segment holds the same rows in the same order and
 * runs the same GEMMs; the router runs on the same logits); gate.weight and the
 * shared experts' gradients are sums over tokens whose order changes (this rank's
 * tokens, then over ranks): relative RMS <= 1e-6 (fp32 reordering, u = 6e-8, of sums
 * over <= 200 tokens of well-conditioned terms: measured ~1e-7). When a bitwise
 * check fails the relative error is printed too. Exit 77 without MPI / mpirun. */
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/dist.h"
#include "linmoe/moe.h"
#include "linmoe/moe_ep.h"
#include "mpi_launch.h"

static lm_comm *g_world;

enum { D = 24, F = 12, E = 8, K = 2, NS = 1 };

static float urand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static double rel_rms(const float *a, const float *b, int64_t n) {
    double d2 = 0, r2 = 0;
    for (int64_t i = 0; i < n; i++) {
        assert_true(isfinite(a[i]) && isfinite(b[i]));
        d2 += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r2 += (double)b[i] * b[i];
    }
    return r2 > 0 ? sqrt(d2 / r2) : sqrt(d2);
}

static double g_worst[8]; /* out, dx, experts, replicated, topk_weight */
static int g_bitwise[8];

static void expect_close(int slot, const char *what, const float *a, const float *ref, int64_t n) {
    if (n <= 0)
        return;
    const double e = rel_rms(a, ref, n);
    if (e > 1e-6)
        fail_msg("rank %d: %s: rel RMS %.3g from one process > 1e-6", lm_comm_rank(g_world), what,
                 e);
    if (e > g_worst[slot])
        g_worst[slot] = e;
    if (memcmp(a, ref, sizeof(float) * (size_t)n) != 0)
        g_bitwise[slot] = 0;
}

typedef struct {
    lm_balance_mode bal;
    float capacity;
    lm_drop_policy drop;
    int seq_aux;
} ep_case;

/* One forward + backward of the layer over `ep`, routed over `route` (NULL: ep) with
 * `Tr[q]` tokens on rank q of route; `salt` varies the data between DP groups. dp:
 * the ranks of route holding this rank's experts (NULL: none other), over which the
 * experts' gradients are summed before the comparison. */
static void run_case(lm_comm *ep, lm_comm *route, lm_comm *dp, const ep_case *cs, const int *Tr,
                     uint64_t salt) {
    lm_error err;
    if (!route)
        route = ep;
    const int P = lm_comm_size(ep), p = lm_comm_rank(ep);
    const int R = lm_comm_size(route), rq = lm_comm_rank(route);
    int Tg = 0, off = 0;
    for (int q = 0; q < R; q++) {
        if (q < rq)
            off += Tr[q];
        Tg += Tr[q];
    }
    const int T = Tr[rq];
    lm_moe_config c;
    lm_moe_config_default(&c, D, F, E, K, NS);
    c.router.balance = cs->bal;
    c.router.capacity_factor = cs->capacity;
    c.router.drop_policy = cs->drop;
    c.router.aux_loss_seq = cs->seq_aux;
    c.router.aux_loss_alpha = 0.01f;
    /* weights and data, the same on every rank */
    const int64_t nw[LM_MOE_N_WEIGHTS] = {E * D,      E * F * D,  E * F * D, E * D * F,
                                          NS * F * D, NS * F * D, D * NS * F};
    float *W[LM_MOE_N_WEIGHTS], *dWref[LM_MOE_N_WEIGHTS], *dWep[LM_MOE_N_WEIGHTS];
    uint64_t seed = 12345 + salt;
    lm_moe_weights w, wl;
    lm_moe_grads gref, gep;
    const int El = E / P;
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        W[i] = malloc(sizeof(float) * (size_t)nw[i]);
        dWref[i] = malloc(sizeof(float) * (size_t)nw[i]);
        dWep[i] = malloc(sizeof(float) * (size_t)nw[i]);
        for (int64_t j = 0; j < nw[i]; j++)
            W[i][j] = urand(&seed) * (i == 0 ? 0.5f : 0.3f);
        w.p[i] = W[i];
        gref.p[i] = dWref[i];
        gep.p[i] = dWep[i];
        lm_poison_f32(dWep[i], nw[i]);
        /* this rank's experts: the slice of the [E, ...] tensors */
        const int expert = i >= LM_MOE_EXPERTS_GATE_PROJ && i <= LM_MOE_EXPERTS_DOWN_PROJ;
        wl.p[i] = expert ? W[i] + (int64_t)p * El * F * D : W[i];
    }
    float *x = malloc(sizeof(float) * (size_t)(Tg + 1) * D),
          *dout = malloc(sizeof(float) * (size_t)(Tg + 1) * D);
    for (int64_t i = 0; i < (int64_t)Tg * D; i++) {
        x[i] = urand(&seed);
        dout[i] = urand(&seed) * 0.1f;
    }
    /* sequences: each rank's tokens in pieces of 13 (the last shorter) */
    int64_t *cu = malloc(sizeof(int64_t) * (size_t)(Tg + 2 * R + 2)),
            *cul = malloc(sizeof(int64_t) * (size_t)(T + 2));
    int ncu = 0, ncul = 0;
    int base = 0;
    cu[ncu++] = 0;
    for (int q = 0; q < R; q++) {
        for (int t = 13; t < Tr[q]; t += 13)
            cu[ncu++] = base + t;
        if (Tr[q] > 0)
            cu[ncu++] = base + Tr[q];
        base += Tr[q];
    }
    cul[ncul++] = 0;
    for (int t = 13; t < T; t += 13)
        cul[ncul++] = t;
    if (T > 0)
        cul[ncul++] = T;
    /* router states with the same non-zero bias */
    lm_router_state sref, sep;
    assert_int_equal(lm_router_state_init(&sref, E, &err), LM_OK);
    assert_int_equal(lm_router_state_init(&sep, E, &err), LM_OK);
    for (int e = 0; e < E; e++)
        sref.e_score_correction_bias[e] = sep.e_score_correction_bias[e] = 0.05f * (float)(e % 3);
    /* one process */
    lm_moe_ctx *ref;
    assert_int_equal(lm_moe_ctx_new(&ref, &c, Tg, &err), LM_OK);
    float *oref = malloc(sizeof(float) * (size_t)Tg * D),
          *dxref = malloc(sizeof(float) * (size_t)Tg * D);
    assert_int_equal(lm_moe_forward(ref, &w, &sref, x, Tg, cu, ncu, 1, oref, &err), LM_OK);
    lm_moe_ctx_set_aux_scale(ref, 0.5f);
    assert_int_equal(lm_moe_backward(ref, &w, x, dout, dxref, &gref, &err), LM_OK);
    const lm_route *rr = lm_moe_ctx_route(ref);
    /* expert parallel */
    lm_moe_ep *l;
    assert_int_equal(lm_moe_ep_new(&l, &c, ep, route, T > 0 ? T : 1, &err), LM_OK);
    assert_int_equal(lm_moe_ep_first_expert(l), p * El);
    float *o = malloc(sizeof(float) * (size_t)(T + 1) * D),
          *dx = malloc(sizeof(float) * (size_t)(T + 1) * D);
    lm_poison_f32(o, (int64_t)T * D);
    lm_poison_f32(dx, (int64_t)T * D);
    lm_status st = lm_moe_ep_forward(l, &wl, &sep, x + (int64_t)off * D, T, T > 0 ? cul : NULL,
                                     ncul, 1, o, &err);
    if (st != LM_OK)
        fail_msg("%s", err.msg);
    lm_moe_ep_set_aux_scale(l, 0.5f);
    st = lm_moe_ep_backward(l, &wl, x + (int64_t)off * D, dout + (int64_t)off * D, dx, &gep, &err);
    if (st != LM_OK)
        fail_msg("%s", err.msg);
    /* routing and counts: identical */
    const lm_route *re = lm_moe_ep_route(l);
    assert_non_null(re);
    assert_int_equal(re->T, Tg);
    assert_int_equal(lm_moe_ep_token_offset(l), off);
    assert_memory_equal(re->topk_idx, rr->topk_idx, sizeof(int64_t) * (size_t)Tg * K);
    assert_memory_equal(re->keep, rr->keep, (size_t)Tg * K);
    expect_close(4, "topk_weight", re->topk_weight, rr->topk_weight, (int64_t)Tg * K);
    assert_int_equal(re->n_dropped_assign, rr->n_dropped_assign);
    assert_true(re->aux_loss == rr->aux_loss);
    if (cs->capacity > 0)
        assert_true(rr->n_dropped_assign > 0); /* the case tests drops */
    assert_memory_equal(sep.demand, sref.demand, sizeof(double) * E);
    assert_memory_equal(sep.kept, sref.kept, sizeof(double) * E);
    /* outputs and dx rows of this rank */
    expect_close(0, "out", o, oref + (int64_t)off * D, (int64_t)T * D);
    expect_close(1, "dx", dx, dxref + (int64_t)off * D, (int64_t)T * D);
    /* the experts' gradients: this rank's slice (the EP group's part: summed over the
     * groups when routed over several) */
    for (int i = LM_MOE_EXPERTS_GATE_PROJ; i <= LM_MOE_EXPERTS_DOWN_PROJ; i++) {
        if (dp)
            assert_int_equal(
                lm_comm_allreduce(dp, dWep[i], (int64_t)El * F * D, LM_F32, LM_DIST_SUM, &err),
                LM_OK);
        expect_close(2, lm_moe_weight_name((lm_moe_weight_id)i), dWep[i],
                     dWref[i] + (int64_t)p * El * F * D, (int64_t)El * F * D);
    }
    /* replicated weights: summed over the ranks */
    const int rep[] = {LM_MOE_GATE_WEIGHT, LM_MOE_SHARED_GATE_PROJ, LM_MOE_SHARED_UP_PROJ,
                       LM_MOE_SHARED_DOWN_PROJ};
    for (int r = 0; r < 4; r++) {
        const int i = rep[r];
        assert_int_equal(lm_comm_allreduce(route, dWep[i], nw[i], LM_F32, LM_DIST_SUM, &err),
                         LM_OK);
        expect_close(3, lm_moe_weight_name((lm_moe_weight_id)i), dWep[i], dWref[i], nw[i]);
    }
    /* the bias update: the state already holds the group's counts (no reduce) */
    lm_router_metrics ma, mb;
    assert_int_equal(lm_router_update_bias(&c.router, &sref, NULL, NULL, &ma, &err), LM_OK);
    assert_int_equal(lm_router_update_bias(&c.router, &sep, NULL, NULL, &mb, &err), LM_OK);
    assert_memory_equal(sep.e_score_correction_bias, sref.e_score_correction_bias,
                        sizeof(float) * E); /* sign rule on identical counts: bit-identical */
    assert_true(ma.maxvio_batch == mb.maxvio_batch);
    lm_moe_ep_free(l);
    lm_moe_ctx_free(ref);
    lm_router_state_free(&sref);
    lm_router_state_free(&sep);
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        free(W[i]);
        free(dWref[i]);
        free(dWep[i]);
    }
    free(x);
    free(dout);
    free(cu);
    free(cul);
    free(oref);
    free(dxref);
    free(o);
    free(dx);
}

static const ep_case k_cases[] = {
    {LM_BAL_AUX_FREE, 0.0f, LM_DROP_PROBS, 0},
    {LM_BAL_AUX_FREE, 1.0f, LM_DROP_PROBS, 0},
    {LM_BAL_AUX_FREE, 1.0f, LM_DROP_POSITION, 0},
    {LM_BAL_AUX_LOSS, 0.0f, LM_DROP_PROBS, 1},
};

static void report(const char *what) {
    static const char *const names[5] = {"out", "dx", "expert grads", "replicated grads (summed)",
                                         "topk_weight"};
    if (lm_comm_rank(g_world) != 0)
        return;
    printf("%s, worst rel RMS vs one process:", what);
    for (int i = 0; i < 5; i++)
        printf(" %s %.3g%s;", names[i], g_worst[i], g_bitwise[i] ? " (bit-identical)" : "");
    printf(" selections, keep flags, counts, biases bit-identical\n");
}

static void reset_report(void) {
    for (int i = 0; i < 8; i++)
        g_worst[i] = 0, g_bitwise[i] = 1;
}

static void test_ep_world(void **state) {
    (void)state;
    reset_report();
    const int P = lm_comm_size(g_world);
    int Tr[8];
    for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++) {
        for (int q = 0; q < P; q++)
            Tr[q] = 40 + 23 * q;
        run_case(g_world, NULL, NULL, &k_cases[i], Tr, 0);
        Tr[P - 1] = 0; /* a rank without tokens */
        run_case(g_world, NULL, NULL, &k_cases[i], Tr, 1);
    }
    char what[64];
    snprintf(what, sizeof what, "EP %d ranks", P);
    report(what);
}

static void test_dp_x_ep(void **state) {
    (void)state;
    lm_error err;
    if (lm_comm_size(g_world) != 4)
        skip();
    lm_comm *dp, *ep;
    assert_int_equal(lm_comm_split_grid(g_world, 2, &dp, &ep, &err), LM_OK);
    int Tr[2] = {50, 31};
    reset_report();
    for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++)
        run_case(ep, NULL, NULL, &k_cases[i], Tr, 100 + (uint64_t)lm_comm_rank(dp));
    report("DP 2 x EP 2 (each pair its own batch)");
    /* routed over the world: capacity, aux loss and counts of the 4 ranks' batch */
    int Tw[4] = {50, 31, 0, 44};
    reset_report();
    for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++)
        run_case(ep, g_world, dp, &k_cases[i], Tw, 200);
    report("DP 2 x EP 2 routed over the world");
    lm_comm_free(dp);
    lm_comm_free(ep);
}

static void test_errors(void **state) {
    (void)state;
    lm_error err;
    lm_moe_config c;
    lm_moe_config_default(&c, D, F, 6, K, NS); /* 6 experts: not divisible by 4 */
    lm_moe_ep *l = NULL;
    const lm_status st = lm_moe_ep_new(&l, &c, g_world, NULL, 8, &err);
    if (lm_comm_size(g_world) == 4) {
        assert_int_equal(st, LM_ERR_INVALID);
        assert_non_null(strstr(err.msg, "not divisible by the expert-parallel size 4"));
    } else {
        assert_int_equal(st, LM_OK);
        lm_moe_ep_free(l);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "ranks") == 0) {
        lm_error err;
        if (lm_comm_world_new(&g_world, &err) != LM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        const struct CMUnitTest t[] = {
            cmocka_unit_test(test_ep_world),
            cmocka_unit_test(test_dp_x_ep),
            cmocka_unit_test(test_errors),
        };
        const int rc = cmocka_run_group_tests(t, NULL, NULL);
        lm_comm_free(g_world);
        return rc;
    }
    const char *why = lm_test_mpi_unavailable();
    if (why) {
        printf("SKIPPED: %s\n", why);
        return 77;
    }
    for (int np = 2; np <= 4; np += 2) {
        const int r = lm_test_mpirun_self(np, "ranks");
        printf("mpirun -np %d: exit %d\n", np, r);
        if (r != 0)
            return 1;
    }
    return 0;
}
