/* The communicator (include/linmoe/dist.h): the self backend in this process, then
 * the MPI backend on 2 and 4 ranks (this program re-run under mpirun): every
 * collective against values each rank can compute alone (rank-dependent inputs,
 * uneven counts including empty blocks), in-place forms, the dp x ep grid groups,
 * lm_comm_agree, and the per-kind statistics. Exit 77 (skipped) when the build has no
 * MPI or mpirun is missing; the self-backend cases have run by then. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "linmoe/dist.h"
#include "mpi_launch.h"

static lm_comm *g_world;

/* a value only (rank, i) determines */
static double val(int r, int64_t i) { return (double)((r + 1) * 1000 + (i * 7919) % 997) / 8.0; }

static void test_self(void **state) {
    (void)state;
    lm_comm *c = NULL;
    lm_error err;
    assert_int_equal(lm_comm_self_new(&c, &err), LM_OK);
    assert_int_equal(lm_comm_rank(c), 0);
    assert_int_equal(lm_comm_size(c), 1);
    assert_string_equal(lm_comm_backend(c), "self");
    float a[5] = {1, 2, 3, 4, 5}, b[5];
    assert_int_equal(lm_comm_allreduce(c, a, 5, LM_F32, LM_DIST_SUM, &err), LM_OK);
    assert_true(a[4] == 5.0f);
    int64_t n5 = 5;
    memset(b, 0xff, sizeof b);
    assert_int_equal(lm_comm_reduce_scatter(c, a, b, &n5, LM_F32, &err), LM_OK);
    assert_memory_equal(a, b, sizeof a);
    memset(b, 0xff, sizeof b);
    assert_int_equal(lm_comm_allgather(c, a, b, &n5, LM_F32, &err), LM_OK);
    assert_memory_equal(a, b, sizeof a);
    assert_int_equal(lm_comm_alltoallv(c, a, &n5, b, &n5, LM_F32, &err), LM_OK);
    int64_t n4 = 4;
    assert_int_equal(lm_comm_alltoallv(c, a, &n5, b, &n4, LM_F32, &err), LM_ERR_INVALID);
    assert_int_equal(lm_comm_allreduce(c, a, 5, LM_BF16, LM_DIST_SUM, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "BF16"));
    lm_comm *dp, *ep;
    assert_int_equal(lm_comm_split_grid(c, 2, &dp, &ep, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "expert_parallel = 2"));
    assert_int_equal(lm_comm_split_grid(c, 1, &dp, &ep, &err), LM_OK);
    assert_int_equal(lm_comm_size(dp) * lm_comm_size(ep), 1);
    lm_comm_free(dp);
    lm_comm_free(ep);
    assert_int_equal(lm_comm_agree(c, LM_ERR_IO, &err), LM_ERR_IO);
    lm_comm_stats st;
    lm_comm_get_stats(c, &st);
    assert_int_equal(st.calls[LM_COLL_ALLREDUCE], 2); /* the BF16 one was refused */
    assert_int_equal(st.bytes[LM_COLL_ALLREDUCE], 20 + 4);
    lm_comm_free(c);
}

/* ---------------------------------------------------------------- ranks */

static void test_allreduce(void **state) {
    (void)state;
    lm_error err;
    const int r = lm_comm_rank(g_world), W = lm_comm_size(g_world);
    enum { N = 1031 };
    double *d = malloc(sizeof(double) * N);
    float *f = malloc(sizeof(float) * N);
    int64_t *k = malloc(sizeof(int64_t) * N);
    for (int64_t i = 0; i < N; i++) {
        d[i] = val(r, i);
        f[i] = (float)val(r, i);
        k[i] = (int64_t)r * 1000000007LL + i;
    }
    assert_int_equal(lm_comm_allreduce(g_world, d, N, LM_F64, LM_DIST_SUM, &err), LM_OK);
    assert_int_equal(lm_comm_allreduce(g_world, f, N, LM_F32, LM_DIST_SUM, &err), LM_OK);
    assert_int_equal(lm_comm_allreduce(g_world, k, N, LM_I64, LM_DIST_MAX, &err), LM_OK);
    for (int64_t i = 0; i < N; i++) {
        double s = 0;
        for (int q = 0; q < W; q++)
            s += val(q, i);
        /* the values are multiples of 1/8 below 2^13: every partial sum is exact */
        assert_true(d[i] == s);
        assert_true(f[i] == (float)s);
        assert_true(k[i] == (int64_t)(W - 1) * 1000000007LL + i);
    }
    free(d);
    free(f);
    free(k);
}

static void test_reduce_scatter_allgather(void **state) {
    (void)state;
    lm_error err;
    const int r = lm_comm_rank(g_world), W = lm_comm_size(g_world);
    int64_t counts[8], tot = 0, off[9];
    for (int q = 0; q < W; q++) {
        counts[q] = q == 1 ? 0 : 37 * q + 5; /* uneven, one empty block */
        off[q] = tot;
        tot += counts[q];
    }
    off[W] = tot;
    double *send = malloc(sizeof(double) * (size_t)tot), *recv = malloc(sizeof(double) * 200);
    for (int64_t i = 0; i < tot; i++)
        send[i] = val(r, i);
    for (int i = 0; i < 200; i++)
        recv[i] = -12345.0;
    assert_int_equal(lm_comm_reduce_scatter(g_world, send, recv, counts, LM_F64, &err), LM_OK);
    for (int64_t i = 0; i < counts[r]; i++) {
        double s = 0;
        for (int q = 0; q < W; q++)
            s += val(q, off[r] + i);
        assert_true(recv[i] == s);
    }
    assert_true(recv[counts[r]] == -12345.0); /* nothing written past the block */
    /* all-gather in place: rank r's block holds its marker values */
    double *all = malloc(sizeof(double) * (size_t)tot);
    for (int64_t i = 0; i < tot; i++)
        all[i] = -1;
    for (int64_t i = 0; i < counts[r]; i++)
        all[off[r] + i] = val(r, i) + 0.5;
    assert_int_equal(lm_comm_allgather(g_world, all + off[r], all, counts, LM_F64, &err), LM_OK);
    for (int q = 0; q < W; q++)
        for (int64_t i = 0; i < counts[q]; i++)
            assert_true(all[off[q] + i] == val(q, i) + 0.5);
    /* out of place, and gather to the last rank */
    double mine[200];
    for (int64_t i = 0; i < counts[r]; i++)
        mine[i] = val(r, i) * 2;
    memset(all, 0, sizeof(double) * (size_t)tot);
    assert_int_equal(lm_comm_allgather(g_world, mine, all, counts, LM_F64, &err), LM_OK);
    for (int q = 0; q < W; q++)
        for (int64_t i = 0; i < counts[q]; i++)
            assert_true(all[off[q] + i] == val(q, i) * 2);
    memset(all, 0, sizeof(double) * (size_t)tot);
    assert_int_equal(lm_comm_gather(g_world, mine, all, counts, LM_F64, W - 1, &err), LM_OK);
    if (r == W - 1)
        for (int q = 0; q < W; q++)
            for (int64_t i = 0; i < counts[q]; i++)
                assert_true(all[off[q] + i] == val(q, i) * 2);
    free(send);
    free(recv);
    free(all);
}

static void test_alltoallv(void **state) {
    (void)state;
    lm_error err;
    const int r = lm_comm_rank(g_world), W = lm_comm_size(g_world);
    /* rank r sends (r + 2q) % 5 values to q (some zero); counts exchanged first */
    int64_t sc[8], rc[8], ones[8];
    int64_t ns = 0;
    for (int q = 0; q < W; q++) {
        sc[q] = (r + 2 * q) % 5;
        ns += sc[q];
        ones[q] = 1;
    }
    assert_int_equal(lm_comm_alltoallv(g_world, sc, ones, rc, ones, LM_I64, &err), LM_OK);
    int64_t nr = 0;
    for (int q = 0; q < W; q++) {
        assert_int_equal(rc[q], (q + 2 * r) % 5);
        nr += rc[q];
    }
    float *s = malloc(sizeof(float) * (size_t)(ns + 1)),
          *v = malloc(sizeof(float) * (size_t)(nr + 1));
    int64_t o = 0;
    for (int q = 0; q < W; q++)
        for (int64_t i = 0; i < sc[q]; i++)
            s[o++] = (float)(r * 100 + q * 10 + i); /* (source, dest, index) */
    assert_int_equal(lm_comm_alltoallv(g_world, s, sc, v, rc, LM_F32, &err), LM_OK);
    o = 0;
    for (int q = 0; q < W; q++)
        for (int64_t i = 0; i < rc[q]; i++)
            assert_true(v[o++] == (float)(q * 100 + r * 10 + i));
    free(s);
    free(v);
}

static void test_broadcast_grid_agree(void **state) {
    (void)state;
    lm_error err;
    const int r = lm_comm_rank(g_world), W = lm_comm_size(g_world);
    int32_t b[3] = {r, r * 2, r * 3};
    assert_int_equal(lm_comm_broadcast(g_world, b, 3, LM_I32, W - 1, &err), LM_OK);
    assert_true(b[0] == W - 1 && b[2] == 3 * (W - 1));
    lm_comm *dp, *ep;
    assert_int_equal(lm_comm_split_grid(g_world, 3, &dp, &ep, &err),
                     W % 3 ? LM_ERR_INVALID : LM_OK);
    assert_int_equal(lm_comm_split_grid(g_world, 2, &dp, &ep, &err), LM_OK);
    assert_int_equal(lm_comm_size(ep), 2);
    assert_int_equal(lm_comm_size(dp), W / 2);
    assert_int_equal(lm_comm_rank(ep), r % 2);
    assert_int_equal(lm_comm_rank(dp), r / 2);
    /* sums inside each group cover exactly its members */
    int64_t x[2] = {r, 1};
    assert_int_equal(lm_comm_allreduce(ep, x, 2, LM_I64, LM_DIST_SUM, &err), LM_OK);
    assert_int_equal(x[0], (r / 2 * 2) + (r / 2 * 2 + 1));
    assert_int_equal(x[1], 2);
    int64_t y = r;
    assert_int_equal(lm_comm_allreduce(dp, &y, 1, LM_I64, LM_DIST_SUM, &err), LM_OK);
    int64_t want = 0;
    for (int q = r % 2; q < W; q += 2)
        want += q;
    assert_int_equal(y, want);
    lm_comm_free(dp);
    lm_comm_free(ep);
    /* one rank fails: everyone learns it */
    const lm_status s = lm_comm_agree(g_world, r == 1 ? LM_ERR_FORMAT : LM_OK, &err);
    assert_int_equal(s, LM_ERR_FORMAT);
    if (r != 1)
        assert_non_null(strstr(err.msg, "another rank failed"));
    assert_int_equal(lm_comm_agree(g_world, LM_OK, &err), LM_OK);
    assert_int_equal(lm_comm_barrier(g_world, &err), LM_OK);
    lm_comm_stats st;
    lm_comm_get_stats(g_world, &st);
    assert_true(st.calls[LM_COLL_BARRIER] >= 1 && st.calls[LM_COLL_ALLREDUCE] >= 2);
    assert_true(st.bytes[LM_COLL_BROADCAST] == (r == W - 1 ? 12 : 0));
}

/* Under mpirun: rank 1 stops answering (sleeps) while rank 0 waits in a barrier with
 * a 2 s collective timeout; rank 0's watchdog must end the job. */
static int hang_main(void) {
    lm_error err;
    if (lm_comm_world_new(&g_world, &err) != LM_OK ||
        lm_comm_set_timeout(g_world, 2.0, &err) != LM_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    if (lm_comm_rank(g_world) == 1)
        sleep(20);
    lm_comm_barrier(g_world, &err);
    lm_comm_free(g_world);
    return 0; /* not reached on rank 0: the watchdog exits with 124 */
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "hang") == 0)
        return hang_main();
    if (argc > 1 && strcmp(argv[1], "ranks") == 0) {
        lm_error err;
        if (lm_comm_world_new(&g_world, &err) != LM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        if (lm_comm_size(g_world) != lm_test_ranks()) {
            fprintf(stderr, "world size %d, launched with %d\n", lm_comm_size(g_world),
                    lm_test_ranks());
            return 1;
        }
        const struct CMUnitTest t[] = {
            cmocka_unit_test(test_allreduce),
            cmocka_unit_test(test_reduce_scatter_allgather),
            cmocka_unit_test(test_alltoallv),
            cmocka_unit_test(test_broadcast_grid_agree),
        };
        const int rc = cmocka_run_group_tests(t, NULL, NULL);
        lm_comm_free(g_world);
        return rc;
    }
    const struct CMUnitTest t[] = {cmocka_unit_test(test_self)};
    int rc = cmocka_run_group_tests(t, NULL, NULL);
    if (rc)
        return rc;
    const char *why = lm_test_mpi_unavailable();
    if (why) {
        printf("SKIPPED: multi-rank cases: %s\n", why);
        return 77;
    }
    for (int np = 2; np <= 4; np += 2) {
        const int r = lm_test_mpirun_self(np, "ranks");
        printf("mpirun -np %d: exit %d\n", np, r);
        if (r != 0)
            return 1;
    }
    /* the collective timeout: a rank that stops answering ends the job in ~2 s, not 20 */
    char log[64] = "/tmp/linmoe_test_dist_XXXXXX";
    const int fd = mkstemp(log);
    if (fd < 0)
        return 1;
    close(fd);
    char arg[128];
    snprintf(arg, sizeof arg, "hang >'%s' 2>&1", log);
    const double t0 = lm_time_sec();
    const int r = lm_test_mpirun_self(2, arg);
    const double dt = lm_time_sec() - t0;
    FILE *f = fopen(log, "rb");
    char out[8192] = "";
    if (f) {
        out[fread(out, 1, sizeof out - 1, f)] = '\0';
        fclose(f);
    }
    unlink(log);
    printf("hung rank: mpirun exit %d after %.1f s\n", r, dt);
    if (r == 0 || dt > 15 || !strstr(out, "rank 0 of 2: a barrier did not complete within 2 s")) {
        printf("%s\n", out);
        return 1;
    }
    return 0;
}
