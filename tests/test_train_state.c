/* The checkpoint train_state loader (src/train/checkpoint.c lm_train_state_load): a
 * file that is bad anywhere (the counters, or the last router layer's history
 * position, read after the AdamW moments and the loader state) is refused with the
 * file and tensor named, and leaves the trainer's state exactly as it was: moments,
 * counters, loader state and every router state (issue 25: the loader used to copy
 * each tensor as it went, so a bad file left the trainer half-updated). A good file
 * then loads every value. On configs/tiny.json (dense first layer, then MoE layers). */
#include "test_util.h"

#include "linmoe/model.h"
#include "linmoe/params.h"
#include "train/train_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    lm_params p;
    lm_model *m;
    lm_adamw a;
    lm_train_counters k;
    lm_loader_state ls;
} trainer;

static char g_dir[64];

static void trainer_new(trainer *t) {
    lm_model_config c;
    lm_error err = {0};
    assert_int_equal(lm_model_config_load(&c, "configs/tiny.json", NULL, 0, &err), LM_OK);
    assert_int_equal(lm_params_init(&t->p, &c, &err), LM_OK);
    lm_params_init_weights(&t->p, 3);
    assert_int_equal(lm_model_new(&t->m, &t->p, 64, &err), LM_OK);
    lm_adamw_init(&t->a, &t->p);
}

static void trainer_free(trainer *t) {
    lm_adamw_free(&t->a);
    lm_model_free(t->m);
    lm_params_free(&t->p);
}

/* Every piece of state the loader writes, set from `seed`. */
static void fill(trainer *t, int seed) {
    for (int64_t i = 0; i < t->p.numel; i++) {
        t->a.m[i] = 0.001f * (float)((i + seed) % 13) - 0.006f;
        t->a.v[i] = 0.0001f * (float)((i * 7 + seed) % 11);
    }
    lm_train_counters k = {10 + seed, 9 + seed, 1024 * (10 + seed), 0, 1, 1,
                           LM_TRAIN_STATE_VERSION};
    t->k = k;
    memset(&t->ls, 0, sizeof t->ls);
    t->ls.rows = 40 + (uint64_t)seed;
    t->ls.passkeys = 3;
    t->ls.epoch = 1;
    t->ls.doc_pos = 17 + (uint64_t)seed;
    t->ls.doc_off = 5;
    t->ls.version = 1;
    for (int l = 0; l < t->p.cfg.num_hidden_layers; l++) {
        lm_router_state *rs = lm_model_router_state(t->m, l);
        if (!rs)
            continue;
        for (int e = 0; e < rs->E; e++)
            rs->prev_delta[e] = 0.01f * (float)(e + seed + l);
        for (int i = 0; i < LM_ROUTER_HISTORY * rs->E; i++)
            rs->history[i] = 0.5 + 0.001 * (double)(i + seed);
        rs->hist_len = 2 + seed % 3;
        rs->hist_pos = 1 + seed % 2;
    }
}

static int last_router(const trainer *t) {
    int last = -1;
    for (int l = 0; l < t->p.cfg.num_hidden_layers; l++)
        if (lm_model_router_state(t->m, l))
            last = l;
    return last;
}

/* a equals b in every value the loader writes. */
static void assert_same_state(const trainer *a, const trainer *b) {
    assert_memory_equal(a->a.m, b->a.m, (size_t)a->p.numel * sizeof(float));
    assert_memory_equal(a->a.v, b->a.v, (size_t)a->p.numel * sizeof(float));
    assert_memory_equal(&a->k, &b->k, sizeof a->k);
    assert_memory_equal(&a->ls, &b->ls, sizeof a->ls);
    for (int l = 0; l < a->p.cfg.num_hidden_layers; l++) {
        lm_router_state *ra = lm_model_router_state(a->m, l), *rb = lm_model_router_state(b->m, l);
        if (!ra)
            continue;
        assert_memory_equal(ra->prev_delta, rb->prev_delta, (size_t)ra->E * sizeof(float));
        assert_memory_equal(ra->history, rb->history,
                            (size_t)LM_ROUTER_HISTORY * ra->E * sizeof(double));
        assert_int_equal(ra->hist_len, rb->hist_len);
        assert_int_equal(ra->hist_pos, rb->hist_pos);
    }
}

/* Save t's state as run `run`'s checkpoint; its directory into dir. */
static void save(trainer *t, const char *run, char *dir, size_t size) {
    char rd[128];
    snprintf(rd, sizeof rd, "%s/%s", g_dir, run);
    assert_int_equal(mkdir(rd, 0755), 0); /* the trainer makes the run directory */
    lm_error err = {0};
    lm_status st = lm_train_ckpt_save(rd, &t->p, &t->a, t->m, &t->k, &t->ls, "{}", 1, 0, dir,
                                      size, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void load(trainer *t, const char *dir, lm_status want, const char *needle) {
    lm_error err = {0};
    lm_status st = lm_train_state_load(dir, &t->p, &t->a, t->m, &t->k, &t->ls, &err);
    if (want != LM_OK)
        fprintf(stderr, "expected error: %s\n", err.msg);
    assert_int_equal(st, want);
    if (needle) {
        assert_non_null(strstr(err.msg, "train_state.safetensors"));
        assert_non_null(strstr(err.msg, needle));
    }
}

static void test_bad_file_leaves_state(void **state) {
    (void)state;
    trainer w, t, ref;
    trainer_new(&w);
    trainer_new(&t);
    trainer_new(&ref);
    const int last = last_router(&w);
    assert_true(last > 1); /* several router layers: the bad one is read last */
    char good[600], bad_hist[600], bad_cnt[600];
    fill(&w, 5);
    save(&w, "good", good, sizeof good);
    /* the last router layer's history position out of range: read after everything else */
    lm_model_router_state(w.m, last)->hist_pos = LM_ROUTER_HISTORY;
    save(&w, "bad-hist", bad_hist, sizeof bad_hist);
    lm_model_router_state(w.m, last)->hist_pos = 1;
    /* inconsistent counters (more optimizer steps than steps): read after the moments */
    w.k.opt_step = w.k.step + 1;
    save(&w, "bad-counters", bad_cnt, sizeof bad_cnt);

    /* the trainer's state before the load, and a copy to compare against */
    fill(&t, 1);
    fill(&ref, 1);
    char name[64];
    snprintf(name, sizeof name, "router.%d.history_pos", last);
    load(&t, bad_hist, LM_ERR_FORMAT, name);
    assert_same_state(&t, &ref);
    load(&t, bad_cnt, LM_ERR_FORMAT, "'counters'");
    assert_same_state(&t, &ref);
    /* the good file: every value as saved */
    load(&t, good, LM_OK, NULL);
    fill(&ref, 5);
    assert_same_state(&t, &ref);
    trainer_free(&w);
    trainer_free(&t);
    trainer_free(&ref);
}

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe-tstate-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_file_leaves_state),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
