/* Trainer tests (include/linmoe/train.h) on synthetic text shards with the model of
 * configs/tiny-train.json, stages shortened to 15 + 25 steps:
 *  - 40 steps straight vs 20 steps + resume + 20 steps: bit-identical losses (every
 *    log field but the timings), weights, optimizer state, evals and stage logs;
 *  - an injected checkpoint write failure is a clear error, leaves the previous
 *    checkpoint and `latest` intact and loadable, and resuming from it (on 2 threads
 *    instead of 1) still reproduces the straight run bit for bit;
 *  - a truncated model.safetensors, a corrupt / truncated train_state.safetensors and
 *    a dangling `latest` fail with messages naming the file;
 *  - config errors name the key path and the value; missing / corrupt data names the
 *    file;
 *  - the NaN/Inf guard skips and counts a bad step, and stops after max_bad_steps in
 *    a row; a forward failing with LM_ERR_NONFINITE (weights that overflow fp32) is
 *    such a step, a non-finite config scalar is LM_ERR_INVALID;
 *  - `linmoe train` exit codes and output. */
#include "test_util.h"

#include "linmoe/params.h"
#include "linmoe/shard.h"
#include "linmoe/train.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char g_dir[64];
static char g_cfg[128]; /* the test's training config file */

/* ---------------------------------------------------------------- synthetic data */

static uint64_t g_rng = 88172645463325252ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

/* Documents of word salad with some structure (a word tends to follow its
 * predecessor's successor), separated by <|endoftext|> = 256. */
static void write_text_shard(const char *path, int ndocs) {
    static const char *words[] = {"the",      "quick", "brown", "fox",   "jumps", "over",   "lazy",
                                  "dog",      "and",   "then",  "it",    "runs",  "away",   "from",
                                  "a",        "small", "red",   "house", "near",  "river",  "where",
                                  "children", "play",  "every", "day",   "in",    "summer", "sun",
                                  "while",    "birds", "sing"};
    const int nw = (int)(sizeof words / sizeof words[0]);
    int64_t cap = 1 << 20, n = 0;
    int32_t *t = malloc((size_t)cap * sizeof(int32_t));
    for (int d = 0; d < ndocs; d++) {
        const int len = 150 + (int)(rnd() % 1400);
        int w = (int)(rnd() % nw), start = (int)n;
        while (n - start < len) {
            const char *s = words[w];
            for (const char *q = s; *q; q++)
                t[n++] = (unsigned char)*q;
            if (rnd() % 9 == 0) {
                t[n++] = '.';
                t[n++] = '\n';
            } else {
                t[n++] = ' ';
            }
            w = rnd() % 4 == 0 ? (int)(rnd() % nw) : (w + 1) % nw;
        }
        t[n++] = 256;
    }
    lm_error err = {0};
    lm_status st = lm_shard_write(path, 257, t, (uint64_t)n, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    free(t);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    size_t got = fread(b, 1, (size_t)n, f);
    fclose(f);
    b[got] = '\0';
    if (len)
        *len = got;
    return b;
}

static void write_file(const char *path, const char *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe-train-XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    char path[256];
    snprintf(path, sizeof path, "%s/train.bin", g_dir);
    write_text_shard(path, 60);
    snprintf(path, sizeof path, "%s/val.bin", g_dir);
    write_text_shard(path, 12);
    /* configs/tiny-train.json (the tests run in the source dir) with our data,
     * 15 + 25 steps of 1024 tokens, checkpoints every 10 steps, small evals */
    char *text = read_file("configs/tiny-train.json", NULL);
    if (!text)
        return -1;
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j)
        return -1;
    cJSON *data = cJSON_GetObjectItem(j, "data");
    snprintf(path, sizeof path, "%s/train.bin", g_dir);
    cJSON_ReplaceItemInObject(data, "train", cJSON_CreateString(path));
    snprintf(path, sizeof path, "%s/val.bin", g_dir);
    cJSON_ReplaceItemInObject(data, "val", cJSON_CreateString(path));
    cJSON *tr = cJSON_GetObjectItem(j, "train");
    cJSON_ReplaceItemInObject(tr, "checkpoint_every", cJSON_CreateNumber(10));
    cJSON_ReplaceItemInObject(tr, "keep_last", cJSON_CreateNumber(3));
    /* one thread: tiny ops in many short parallel regions spin in libgomp on a busy
     * 2-core machine; the thread-count independence is checked by resuming on 2 */
    cJSON_ReplaceItemInObject(tr, "threads", cJSON_CreateNumber(1));
    cJSON *st = cJSON_GetObjectItem(j, "stages");
    cJSON_ReplaceItemInObject(cJSON_GetArrayItem(st, 0), "tokens", cJSON_CreateNumber(15 * 1024));
    cJSON_ReplaceItemInObject(cJSON_GetArrayItem(st, 1), "tokens", cJSON_CreateNumber(25 * 1024));
    cJSON *ev = cJSON_GetObjectItem(j, "eval");
    cJSON_ReplaceItemInObject(ev, "passkey_samples", cJSON_CreateNumber(4));
    cJSON_ReplaceItemInObject(ev, "max_val_tokens", cJSON_CreateNumber(3000));
    char *out = cJSON_Print(j);
    cJSON_Delete(j);
    snprintf(g_cfg, sizeof g_cfg, "%s/cfg.json", g_dir);
    write_file(g_cfg, out, strlen(out));
    free(out);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---------------------------------------------------------------- helpers */

static void load_cfg(lm_train_config *c) {
    lm_error err = {0};
    lm_status st = lm_train_config_load(c, g_cfg, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static lm_status train(const char *run, int resume, int64_t max_steps, int threads, int64_t fail_at,
                       lm_train_summary *s, lm_error *err) {
    lm_train_config c;
    load_cfg(&c);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, run);
    o.run_dir = dir;
    o.resume = resume;
    o.max_steps = max_steps;
    o.threads = threads;
    o.fail_checkpoint_at = fail_at;
    o.quiet = 1;
    /* resume without a config: the one saved in the checkpoint */
    lm_status st = lm_train_run(resume ? NULL : &c, &o, s, err);
    lm_train_config_free(&c);
    return st;
}

static void train_ok(const char *run, int resume, int64_t max_steps, int threads) {
    lm_error err = {0};
    lm_train_summary s;
    lm_status st = train(run, resume, max_steps, threads, 0, &s, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s: %s\n", run, err.msg);
    assert_int_equal(st, LM_OK);
}

static void path_of(char *buf, size_t n, const char *run, const char *rel) {
    snprintf(buf, n, "%s/%s/%s", g_dir, run, rel);
}

static void assert_same_file(const char *run_a, const char *run_b, const char *rel) {
    char pa[512], pb[512];
    path_of(pa, sizeof pa, run_a, rel);
    path_of(pb, sizeof pb, run_b, rel);
    size_t na = 0, nb = 0;
    char *a = read_file(pa, &na), *b = read_file(pb, &nb);
    if (!a || !b || na != nb || memcmp(a, b, na) != 0)
        fprintf(stderr, "files differ: %s vs %s\n", pa, pb);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    free(a);
    free(b);
}

/* log.jsonl without the timing fields, one line per entry; returns the count. */
static int log_lines(const char *run, char ***out) {
    char p[512];
    path_of(p, sizeof p, run, "log.jsonl");
    char *text = read_file(p, NULL);
    assert_non_null(text);
    int n = 0, cap = 64;
    char **v = malloc(sizeof(char *) * (size_t)cap);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        cJSON_DeleteItemFromObject(j, "tok_per_s");
        cJSON_DeleteItemFromObject(j, "mfu");
        if (n == cap)
            v = realloc(v, sizeof(char *) * (size_t)(cap *= 2));
        v[n++] = cJSON_PrintUnformatted(j);
        cJSON_Delete(j);
    }
    free(text);
    *out = v;
    return n;
}

static double log_loss(const char *line) {
    cJSON *j = cJSON_Parse(line);
    const cJSON *l = cJSON_GetObjectItem(j, "loss");
    double v = cJSON_IsNumber(l) ? l->valuedouble : -1;
    cJSON_Delete(j);
    return v;
}

static void free_lines(char **v, int n) {
    for (int i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

static int exists(const char *run, const char *rel) {
    char p[512];
    path_of(p, sizeof p, run, rel);
    struct stat sb;
    return stat(p, &sb) == 0;
}

/* ---------------------------------------------------------------- tests */

static void test_resume_bit_exact(void **state) {
    (void)state;
    train_ok("A", 0, 0, 0);
    train_ok("B", 0, 20, 0);
    assert_true(exists("B", "ckpt/step-0000020/train_state.safetensors"));
    assert_false(exists("B", "ckpt/step-0000030"));
    train_ok("B", 1, 0, 0);
    char **la, **lb;
    const int na = log_lines("A", &la), nb = log_lines("B", &lb);
    assert_int_equal(na, 40);
    assert_int_equal(nb, 40);
    for (int i = 0; i < na; i++) {
        if (strcmp(la[i], lb[i]) != 0)
            fprintf(stderr, "step %d:\n  %s\n  %s\n", i + 1, la[i], lb[i]);
        assert_string_equal(la[i], lb[i]);
    }
    /* it learned something */
    assert_true(log_loss(la[39]) < log_loss(la[0]) - 0.5);
    free_lines(la, na);
    free_lines(lb, nb);
    assert_same_file("A", "B", "ckpt/step-0000040/model.safetensors");
    assert_same_file("A", "B", "ckpt/step-0000040/config.json");
    assert_same_file("A", "B", "ckpt/step-0000040/train_state.safetensors");
    assert_same_file("A", "B", "evals.jsonl");
    assert_same_file("A", "B", "stages.jsonl");
    /* keep_last = 3 of the checkpoints at 10, 20, 30, 40 */
    assert_false(exists("A", "ckpt/step-0000010"));
    assert_true(exists("A", "ckpt/step-0000020"));
    char p[512];
    path_of(p, sizeof p, "A", "ckpt/latest");
    char *latest = read_file(p, NULL);
    assert_string_equal(latest, "step-0000040\n");
    free(latest);
    /* stage starts at 0 and 15; evals at both stage ends, passkey at 256 */
    path_of(p, sizeof p, "A", "stages.jsonl");
    char *stages = read_file(p, NULL);
    assert_non_null(strstr(stages, "\"stage\": 0, \"name\": \"short\", \"step\": 0,"));
    assert_non_null(strstr(stages, "\"stage\": 1, \"name\": \"long\", \"step\": 15,"));
    free(stages);
    path_of(p, sizeof p, "A", "evals.jsonl");
    char *evals = read_file(p, NULL);
    assert_non_null(strstr(evals, "{\"step\": 15,"));
    assert_non_null(strstr(evals, "{\"step\": 40,"));
    assert_non_null(strstr(evals, "\"passkey\": [{\"length\": 256, \"samples\": 4,"));
    free(evals);
    /* the checkpoint's model config carries the long stage's rope_theta */
    path_of(p, sizeof p, "A", "ckpt/step-0000040/config.json");
    char *mc = read_file(p, NULL);
    assert_non_null(strstr(mc, "40000"));
    free(mc);
}

static void test_checkpoint_failure(void **state) {
    (void)state;
    lm_error err = {0};
    lm_train_summary s;
    lm_status st = train("C", 0, 0, 0, 20, &s, &err);
    assert_int_equal(st, LM_ERR_IO);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "train_state.safetensors"));
    assert_non_null(strstr(err.msg, "injected"));
    assert_non_null(strstr(err.msg, "previous one is intact"));
    char p[512];
    path_of(p, sizeof p, "C", "ckpt/latest");
    char *latest = read_file(p, NULL);
    assert_string_equal(latest, "step-0000010\n");
    free(latest);
    assert_false(exists("C", "ckpt/step-0000020"));
    assert_false(exists("C", "ckpt/.tmp-step-0000020"));
    char dir[512];
    path_of(p, sizeof p, "C", "");
    assert_int_equal(lm_train_latest_checkpoint(p, dir, sizeof dir, &err), LM_OK);
    lm_params prm;
    assert_int_equal(lm_params_load(&prm, dir, &err), LM_OK);
    lm_params_free(&prm);
    /* resuming from it, on two threads, still gives the straight run's result */
    train_ok("C", 1, 0, 2);
    assert_same_file("A", "C", "ckpt/step-0000040/model.safetensors");
    assert_same_file("A", "C", "ckpt/step-0000040/train_state.safetensors");
}

static void expect_resume_error(const char *run, const char *needle) {
    lm_error err = {0};
    lm_train_summary s;
    lm_status st = train(run, 1, 0, 0, 0, &s, &err);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_int_not_equal(st, LM_OK);
    assert_non_null(strstr(err.msg, needle));
}

static void test_corrupt_checkpoint(void **state) {
    (void)state;
    train_ok("D", 0, 10, 0);
    char pm[512], ps[512];
    path_of(pm, sizeof pm, "D", "ckpt/step-0000010/model.safetensors");
    path_of(ps, sizeof ps, "D", "ckpt/step-0000010/train_state.safetensors");
    size_t nm = 0, ns = 0;
    char *model = read_file(pm, &nm), *ts = read_file(ps, &ns);
    /* truncated weights */
    write_file(pm, model, nm / 2);
    expect_resume_error("D", "model.safetensors");
    write_file(pm, model, nm);
    /* corrupt train state header */
    char *bad = malloc(ns);
    memcpy(bad, ts, ns);
    memcpy(bad + 8, "{\"adamw.m\":[1,2", 15);
    write_file(ps, bad, ns);
    expect_resume_error("D", "train_state.safetensors");
    /* truncated train state */
    write_file(ps, ts, ns - 100);
    expect_resume_error("D", "train_state.safetensors");
    write_file(ps, ts, ns);
    free(bad);
    /* `latest` naming nothing */
    char pl[512];
    path_of(pl, sizeof pl, "D", "ckpt/latest");
    write_file(pl, "step-0000099\n", 13);
    expect_resume_error("D", "latest");
    write_file(pl, "garbage\n", 8);
    expect_resume_error("D", "latest");
    write_file(pl, "step-0000010\n", 13);
    /* intact again: resumes */
    train_ok("D", 1, 12, 0);
    assert_true(exists("D", "ckpt/step-0000012"));
    free(model);
    free(ts);
    /* no --resume into a run that exists */
    lm_error err = {0};
    lm_train_summary s;
    assert_int_equal(train("D", 0, 0, 0, 0, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "--resume"));
    /* --resume where there is no run: said, and no directory made */
    expect_resume_error("nothing-here", "latest");
    assert_false(exists("nothing-here", ""));
}

/* Parse the test config with one change made by `edit`; expect an error with all
 * needles in the message. */
static void expect_cfg_error(void (*edit)(cJSON *), const char *n1, const char *n2) {
    char *text = read_file(g_cfg, NULL);
    cJSON *j = cJSON_Parse(text);
    free(text);
    edit(j);
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    lm_train_config c;
    lm_error err = {0};
    lm_status st = lm_train_config_parse(&c, s, "cfg.json", &err);
    free(s);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_int_not_equal(st, LM_OK);
    assert_non_null(strstr(err.msg, "cfg.json"));
    assert_non_null(strstr(err.msg, n1));
    if (n2)
        assert_non_null(strstr(err.msg, n2));
    lm_train_config_free(&c);
}

static cJSON *obj(cJSON *j, const char *k) { return cJSON_GetObjectItem(j, k); }
static cJSON *stage(cJSON *j, int i) { return cJSON_GetArrayItem(obj(j, "stages"), i); }
static void e_unknown_train(cJSON *j) { cJSON_AddNumberToObject(obj(j, "train"), "lrr", 1); }
static void e_unknown_top(cJSON *j) { cJSON_AddNumberToObject(j, "epochs", 1); }
static void e_unknown_model(cJSON *j) {
    cJSON_AddNumberToObject(obj(j, "model"), "hidden_sise", 1);
}
static void e_bad_model(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "model"), "hidden_size", cJSON_CreateNumber(-3));
}
static void e_lr(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "lr", cJSON_CreateNumber(-1));
}
static void e_sched(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "schedule", cJSON_CreateString("linear"));
}
static void e_seq(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 1), "seq_len", cJSON_CreateNumber(1));
}
static void e_pack(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 0), "packing", cJSON_CreateString("yes"));
}
static void e_stage_key(cJSON *j) { cJSON_AddNumberToObject(stage(j, 1), "rope", 5); }
static void e_frac(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 1), "passkey_fraction", cJSON_CreateNumber(0.9));
}
static void e_div(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "batch_tokens", cJSON_CreateNumber(1000));
}
static void e_micro(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "micro_batches", cJSON_CreateNumber(3));
}
static void e_both(cJSON *j) { cJSON_AddNumberToObject(obj(j, "train"), "batch_size", 4); }
static void e_nostages(cJSON *j) { cJSON_DeleteItemFromObject(j, "stages"); }
static void e_pk(cJSON *j) {
    cJSON *a = obj(obj(j, "eval"), "passkey_lengths");
    cJSON_AddItemToArray(a, cJSON_CreateString("x"));
}
static void e_tok(cJSON *j) {
    cJSON_ReplaceItemInObject(j, "tokenizer", cJSON_CreateString("bpe"));
}
static void e_name(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 1), "name", cJSON_CreateString("short"));
}
static void e_data(cJSON *j) { cJSON_DeleteItemFromObject(obj(j, "data"), "val"); }

static void test_config_errors(void **state) {
    (void)state;
    expect_cfg_error(e_unknown_train, "unknown key 'train.lrr'", NULL);
    expect_cfg_error(e_unknown_top, "unknown key 'epochs'", NULL);
    expect_cfg_error(e_unknown_model, "unknown key 'model.hidden_sise'", NULL);
    expect_cfg_error(e_bad_model, "hidden_size", "-3");
    expect_cfg_error(e_lr, "'train.lr' = -1", NULL);
    expect_cfg_error(e_sched, "'train.schedule' = \"linear\"", NULL);
    expect_cfg_error(e_seq, "'stages[1].seq_len' = 1", NULL);
    expect_cfg_error(e_pack, "'stages[0].packing' = \"yes\"", NULL);
    expect_cfg_error(e_stage_key, "unknown key 'stages[1].rope'", NULL);
    expect_cfg_error(e_frac, "stages[1].passkey_fraction", "exceeds 1");
    expect_cfg_error(e_div, "stages[0].seq_len", "batch_tokens = 1000");
    expect_cfg_error(e_micro, "micro_batches = 3", NULL);
    expect_cfg_error(e_both, "batch_tokens", "batch_size");
    expect_cfg_error(e_nostages, "'stages'", NULL);
    expect_cfg_error(e_pk, "'eval.passkey_lengths[1]' = \"x\"", NULL);
    expect_cfg_error(e_tok, "'tokenizer' = \"bpe\"", NULL);
    expect_cfg_error(e_name, "'stages[1].name' = \"short\"", NULL);
    expect_cfg_error(e_data, "'data.val'", NULL);
    lm_train_config c;
    lm_error err = {0};
    assert_int_equal(lm_train_config_parse(&c, "{\"model\": {", "cfg.json", &err), LM_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "cfg.json: not valid JSON"));
    assert_int_equal(lm_train_config_load(&c, "/nonexistent/x.json", &err), LM_ERR_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/x.json"));
    /* derived quantities and the schedule */
    load_cfg(&c);
    assert_int_equal(c.n_stages, 2);
    assert_int_equal(c.stages[0].steps, 15);
    assert_int_equal(c.stages[1].steps, 25);
    assert_int_equal(c.stages[1].first_step, 15);
    assert_int_equal(c.stages[0].rows_per_micro, 8);
    assert_int_equal(c.stages[1].rows_per_micro, 2);
    assert_int_equal(c.eval_seq_len, 256);
    assert_int_equal(lm_train_stage_of(&c, 14), 0);
    assert_int_equal(lm_train_stage_of(&c, 15), 1);
    const double P0 = c.stages[0].lr, P1 = c.stages[1].lr;
    assert_true(fabs(lm_train_lr(&c, 0) - P0 / 2) < 1e-15); /* warmup 2 */
    assert_true(fabs(lm_train_lr(&c, 1) - P0) < 1e-15);
    assert_true(fabs(lm_train_lr(&c, 14) - P0 * c.min_lr_ratio) < 1e-15);
    assert_true(fabs(lm_train_lr(&c, 15) - P1) < 1e-15); /* re-warmup of 1 step */
    assert_true(fabs(lm_train_lr(&c, 39) - P1 * c.min_lr_ratio) < 1e-15);
    for (int64_t s = 2; s < 14; s++)
        assert_true(lm_train_lr(&c, s + 1) < lm_train_lr(&c, s));
    c.schedule = LM_SCHED_WSD;
    c.wsd_decay_frac = 0.2; /* stage 1: 25 steps, the last 5 decay */
    assert_true(fabs(lm_train_lr(&c, 15 + 19) - P1) < 1e-15);
    assert_true(lm_train_lr(&c, 15 + 20) < P1);
    assert_true(fabs(lm_train_lr(&c, 39) - P1 * c.min_lr_ratio) < 1e-15);
    lm_train_config_free(&c);

    /* missing and corrupt data name the file */
    char *text = read_file(g_cfg, NULL);
    cJSON *j = cJSON_Parse(text);
    free(text);
    char miss[256], corrupt[256];
    snprintf(miss, sizeof miss, "%s/missing.bin", g_dir);
    snprintf(corrupt, sizeof corrupt, "%s/corrupt.bin", g_dir);
    write_file(corrupt, "LMTOKENX\1\0\0\0", 12);
    for (int k = 0; k < 2; k++) {
        cJSON_ReplaceItemInObject(obj(j, "data"), "train", cJSON_CreateString(k ? corrupt : miss));
        char *s = cJSON_Print(j);
        assert_int_equal(lm_train_config_parse(&c, s, "cfg.json", &err), LM_OK);
        free(s);
        lm_train_options o;
        lm_train_options_default(&o);
        char dir[256];
        snprintf(dir, sizeof dir, "%s/E%d", g_dir, k);
        o.run_dir = dir;
        o.quiet = 1;
        assert_int_not_equal(lm_train_run(&c, &o, NULL, &err), LM_OK);
        fprintf(stderr, "expected error: %s\n", err.msg);
        assert_non_null(strstr(err.msg, k ? corrupt : miss));
        assert_non_null(strstr(err.msg, "data.train"));
        /* and leaves no empty run directory behind (issue 25) */
        struct stat sb;
        assert_int_not_equal(stat(dir, &sb), 0);
        lm_train_config_free(&c);
    }
    cJSON_Delete(j);
}

/* ---------------------------------------------------------------- resume with a changed config */

/* The test config edited by `edit` (NULL: as is), parsed under the label "edited.json". */
static void load_edited(lm_train_config *c, void (*edit)(cJSON *)) {
    char *text = read_file(g_cfg, NULL);
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (edit)
        edit(j);
    char *t = cJSON_Print(j);
    cJSON_Delete(j);
    lm_error err = {0};
    lm_status st = lm_train_config_parse(c, t, "edited.json", &err);
    free(t);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

/* resume `run` with the edited config; max_steps 0 = to the end */
static lm_status resume_edited(const char *run, void (*edit)(cJSON *), int64_t max_steps,
                               lm_train_summary *s, lm_error *err) {
    lm_train_config c;
    load_edited(&c, edit);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, run);
    o.run_dir = dir;
    o.resume = 1;
    o.max_steps = max_steps;
    o.quiet = 1;
    lm_status st = lm_train_run(&c, &o, s, err);
    lm_train_config_free(&c);
    return st;
}

static void expect_resume_refused(const char *run, void (*edit)(cJSON *), const char *field,
                                  const char *was, const char *now) {
    lm_error err = {0};
    lm_train_summary s;
    lm_status st = resume_edited(run, edit, 0, &s, &err);
    fprintf(stderr, "resume refused: %s\n", err.msg);
    assert_int_equal(st, LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, field));
    char a[64], b[64];
    snprintf(a, sizeof a, "from %s to %s", was, now);
    snprintf(b, sizeof b, "%s", a);
    assert_non_null(strstr(err.msg, b));
}

static void r_seed(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "seed", cJSON_CreateNumber(2));
}
static void r_batch(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "batch_tokens", cJSON_CreateNumber(2048));
}
static void r_micro(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "micro_batches", cJSON_CreateNumber(1));
}
static void r_seq0(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 0), "seq_len", cJSON_CreateNumber(128));
}
static void r_mix0(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 0), "long_doc_fraction", cJSON_CreateNumber(0.5));
}
static void r_rope1(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 1), "rope_theta", cJSON_CreateNumber(20000));
}
static void r_tok0(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 0), "tokens", cJSON_CreateNumber(16 * 1024));
}
static void r_one_stage(cJSON *j) { cJSON_DeleteItemFromArray(obj(j, "stages"), 1); }
static void r_tok1_short(cJSON *j) {
    cJSON_ReplaceItemInObject(stage(j, 1), "tokens", cJSON_CreateNumber(3 * 1024));
}
/* the safe ones: learning rate, eval cadence, the current stage's budget extended */
static void r_safe(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "train"), "lr", cJSON_CreateNumber(0.001));
    cJSON_ReplaceItemInObject(obj(j, "train"), "eval_every", cJSON_CreateNumber(7));
    cJSON_ReplaceItemInObject(stage(j, 1), "tokens", cJSON_CreateNumber(30 * 1024));
}

/* --resume with a changed config (issue 25): unsafe changes refused, naming the field and
 * both values; safe ones applied and listed; the run ends at exactly its new budget. */
static void test_resume_changed_config(void **state) {
    (void)state;
    /* the check itself: what is listed */
    lm_train_config a, b;
    load_edited(&a, NULL);
    load_edited(&b, r_safe);
    char log[2048];
    lm_error err = {0};
    assert_int_equal(lm_train_config_resume_check(&a, &b, 20, log, sizeof log, &err), LM_OK);
    fprintf(stderr, "safe changes at step 20:\n%s", log);
    assert_non_null(strstr(log, "train.lr: 0.003 -> 0.001\n"));
    assert_non_null(strstr(log, "train.eval_every: 0 -> 7\n"));
    assert_non_null(strstr(log, "stages[1] (long).tokens: 25600 -> 30720\n"));
    assert_non_null(strstr(log, "total: 40 -> 45 steps\n"));
    lm_train_config_free(&b);
    /* a stage not started yet may change (logged); once started it may not */
    load_edited(&b, r_rope1);
    assert_int_equal(lm_train_config_resume_check(&a, &b, 15, log, sizeof log, &err), LM_OK);
    assert_non_null(strstr(log, "stages[1]"));
    assert_int_equal(lm_train_config_resume_check(&a, &b, 16, log, sizeof log, &err),
                     LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "stages[1] (long).rope_theta changed from 40000 to 20000"));
    lm_train_config_free(&b);
    lm_train_config_free(&a);

    /* end to end: 20 steps (5 into the long stage), then resumes */
    train_ok("R", 0, 20, 0);
    expect_resume_refused("R", r_seed, "train.seed", "1", "2");
    expect_resume_refused("R", r_batch, "train.batch_tokens", "1024", "2048");
    expect_resume_refused("R", r_micro, "train.micro_batches", "2", "1");
    expect_resume_refused("R", r_seq0, "stages[0] (short).seq_len", "64", "128");
    expect_resume_refused("R", r_mix0, "stages[0] (short).long_doc_fraction", "0", "0.5");
    expect_resume_refused("R", r_rope1, "stages[1] (long).rope_theta", "40000", "20000");
    expect_resume_refused("R", r_tok0, "stages[0] (short).tokens", "15360", "16384");
    expect_resume_refused("R", r_one_stage, "number of stages", "2", "1");
    expect_resume_refused("R", r_tok1_short, "stages[1] (long).tokens", "25600", "3072");
    /* nothing was changed by the refusals: the run still resumes as it was, and with the
     * safe changes ends at exactly the new budget */
    lm_train_summary s;
    assert_int_equal(resume_edited("R", r_safe, 0, &s, &err), LM_OK);
    assert_int_equal(s.steps_done, 45);
    assert_int_equal(s.tokens, 15 * 1024 + 30 * 1024);
    char **lines;
    const int n = log_lines("R", &lines);
    assert_int_equal(n, 45);
    assert_non_null(strstr(lines[44], "\"tokens\":46080,"));
    free_lines(lines, n);
}

static void test_nan_guard(void **state) {
    (void)state;
    lm_train_config c;
    load_cfg(&c);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/F", g_dir);
    o.run_dir = dir;
    o.quiet = 1;
    o.max_steps = 5;
    o.nan_at = 3;
    o.nan_count = 1;
    lm_error err = {0};
    lm_train_summary s;
    assert_int_equal(lm_train_run(&c, &o, &s, &err), LM_OK);
    assert_int_equal(s.bad_steps, 1);
    assert_int_equal(s.steps_done, 5);
    char **lines;
    const int n = log_lines("F", &lines);
    assert_int_equal(n, 5);
    assert_non_null(strstr(lines[2], "\"grad_norm\":null"));
    assert_non_null(strstr(lines[2], "\"skipped\":1"));
    assert_non_null(strstr(lines[3], "\"skipped\":0"));
    /* the run's rates are over the 4 steps that were done */
    assert_true(isfinite(s.tokens_per_s) && s.tokens_per_s > 0);
    assert_true(s.mfu > 0 && s.mfu < 1);
    /* a skipped step changes nothing but the data position: step 4 of this run sees
     * the weights of step 2, so its loss differs from the straight run's step 4 */
    char **la;
    const int na = log_lines("A", &la);
    assert_true(log_loss(lines[1]) == log_loss(la[1]));
    assert_true(log_loss(lines[3]) != log_loss(la[3]));
    free_lines(la, na);
    free_lines(lines, n);
    /* max_bad_steps (5) in a row stops the run */
    snprintf(dir, sizeof dir, "%s/G", g_dir);
    o.max_steps = 0;
    o.nan_at = 2;
    o.nan_count = 1000;
    assert_int_equal(lm_train_run(&c, &o, &s, &err), LM_ERR_INVALID);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "5 non-finite steps in a row"));
    assert_non_null(strstr(err.msg, "max_bad_steps"));
    assert_non_null(strstr(err.msg, "at step 6"));
    lm_train_config_free(&c);
}

/* A train config from g_cfg with `edit` applied, parsed (its status returned). */
static lm_status edited_cfg(void (*edit)(cJSON *), lm_train_config *c, lm_error *err) {
    char *text = read_file(g_cfg, NULL);
    cJSON *j = cJSON_Parse(text);
    free(text);
    edit(j);
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    lm_status st = lm_train_config_parse(c, s, "cfg.json", err);
    free(s);
    return st;
}

/* weights of ~1e12: the first forward overflows fp32 (a NaN reaches a norm's input) */
static void e_huge_init(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "model"), "initializer_range", cJSON_CreateNumber(1e12));
}
/* an eps that is +Inf in fp32 (finite as a JSON double) */
static void e_eps_inf(cJSON *j) {
    cJSON_ReplaceItemInObject(obj(j, "model"), "rms_norm_eps", cJSON_CreateNumber(1e39));
}

/* The NCCL path (train.h dist_nccl) is for --device cuda only: on cpu it is bad input,
 * said before anything is loaded, and no run directory is left behind. */
static void test_dist_nccl_cpu(void **state) {
    (void)state;
    lm_train_config c;
    load_cfg(&c);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/NC", g_dir);
    o.run_dir = dir;
    o.quiet = 1;
    o.dist_nccl = 1;
    lm_error err = {0};
    assert_int_equal(lm_train_run(&c, &o, NULL, &err), LM_ERR_INVALID);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "--dist nccl needs --device cuda"));
    struct stat sb;
    assert_int_not_equal(stat(dir, &sb), 0);
    lm_train_config_free(&c);
}
/* The bad-step guard goes by status: a forward that fails with LM_ERR_NONFINITE (the
 * numbers blew up) is a skipped step, and max_bad_steps of them stop the run; a
 * non-finite configuration scalar is bad input (LM_ERR_INVALID), never a bad step. */
static void test_nonfinite_status(void **state) {
    (void)state;
    lm_train_config c;
    lm_error err = {0};
    assert_int_equal(edited_cfg(e_huge_init, &c, &err), LM_OK);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/N", g_dir);
    o.run_dir = dir;
    o.quiet = 1;
    lm_train_summary s;
    assert_int_equal(lm_train_run(&c, &o, &s, &err), LM_ERR_INVALID);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "5 non-finite steps in a row"));
    assert_non_null(strstr(err.msg, "at step 5"));
    /* the same with err = NULL, which train.h allows (issue 25: the model's and the
     * trainer's message wrapping read err->msg) */
    snprintf(dir, sizeof dir, "%s/N0", g_dir);
    o.quiet = 0; /* the step's message is said */
    o.progress = 0;
    assert_int_equal(lm_train_run(&c, &o, &s, NULL), LM_ERR_INVALID);
    o.quiet = 1;
    lm_train_config_free(&c);
    /* those steps returned early: no tokens/s or MFU for them (issue 25: they logged
     * rates of a step that did no work, MFU far above 100 %) */
    {
        char p[512];
        path_of(p, sizeof p, "N", "log.jsonl");
        char *text = read_file(p, NULL);
        assert_non_null(text);
        int nl = 0;
        for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n"), nl++) {
            assert_non_null(strstr(line, "\"skipped\": 1"));
            assert_non_null(strstr(line, "\"tok_per_s\": null, \"mfu\": null"));
        }
        assert_int_equal(nl, 5);
        free(text);
    }

    memset(&err, 0, sizeof err);
    assert_int_equal(edited_cfg(e_eps_inf, &c, &err), LM_ERR_INVALID);
    fprintf(stderr, "expected error: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "rms_norm_eps = inf"));
}

/* ---------------------------------------------------------------- interrupts */

/* `linmoe train --config CFG --run-dir g_dir/run` as a child process (its stdout and
 * stderr into g_dir/run.out); returns the pid. */
static pid_t spawn_train(const char *run, int threads) {
    const char *bin = getenv("LINMOE_BIN");
    assert_non_null(bin);
    char dir[256], outp[256], th[16];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, run);
    snprintf(outp, sizeof outp, "%s/%s.out", g_dir, run);
    snprintf(th, sizeof th, "%d", threads);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0)
            _exit(99);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(bin, bin, "train", "--config", g_cfg, "--run-dir", dir, "--threads", th,
              (char *)NULL);
        _exit(98);
    }
    return pid;
}

/* wait until g_dir/run/log.jsonl has at least n lines (or the child exited) */
static void wait_steps(const char *run, pid_t pid, int n) {
    char p[512];
    path_of(p, sizeof p, run, "log.jsonl");
    for (int tries = 0; tries < 6000; tries++) {
        size_t len = 0;
        char *t = read_file(p, &len);
        int lines = 0;
        for (size_t i = 0; t && i < len; i++)
            lines += t[i] == '\n';
        free(t);
        if (lines >= n)
            return;
        int status;
        assert_int_equal(waitpid(pid, &status, WNOHANG), 0); /* still running */
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    fail_msg("%s: no %d steps in 60 s", run, n);
}

/* Ctrl-C during training (issue 25): the step in progress finishes, a checkpoint is
 * written and said, the exit status is 130; --resume continues, and the run ends
 * bit-identical (logs, weights, optimizer state) to the straight run. A second SIGINT
 * kills the process at once. SIGTERM is treated as SIGINT (exit 143). */
static void test_interrupt_and_resume(void **state) {
    (void)state;
    if (!exists("A", "ckpt/step-0000040/model.safetensors"))
        train_ok("A", 0, 0, 0); /* the straight run (test_resume_bit_exact makes it) */
    pid_t pid = spawn_train("S", 1);
    wait_steps("S", pid, 3);
    assert_int_equal(kill(pid, SIGINT), 0);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    char p[512];
    snprintf(p, sizeof p, "%s/S.out", g_dir);
    char *out = read_file(p, NULL);
    assert_non_null(out);
    fprintf(stderr, "interrupted run's output:\n%s", out);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 130);
    assert_non_null(strstr(out, "interrupted: finishing the current step"));
    assert_non_null(strstr(out, "interrupted: stopped after step"));
    assert_non_null(strstr(out, "\"interrupted\": true"));
    const char *at = strstr(out, "stopped after step ");
    const int step = atoi(at + strlen("stopped after step "));
    assert_true(step >= 3 && step < 40);
    char rel[64];
    snprintf(rel, sizeof rel, "ckpt/step-%07d/train_state.safetensors", step);
    assert_true(exists("S", rel));
    free(out);
    /* resume (on 2 threads) to the end: the straight run, bit for bit */
    train_ok("S", 1, 0, 2);
    char **la, **ls;
    const int na = log_lines("A", &la), ns = log_lines("S", &ls);
    assert_int_equal(ns, 40);
    for (int i = 0; i < na && i < ns; i++)
        assert_string_equal(la[i], ls[i]);
    free_lines(la, na);
    free_lines(ls, ns);
    assert_same_file("A", "S", "ckpt/step-0000040/model.safetensors");
    assert_same_file("A", "S", "ckpt/step-0000040/train_state.safetensors");
    /* SIGTERM: the same, exit 143 */
    pid = spawn_train("T", 1);
    wait_steps("T", pid, 2);
    assert_int_equal(kill(pid, SIGTERM), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 143);
    /* two SIGINTs in a row: killed by the second */
    pid = spawn_train("U", 1);
    wait_steps("U", pid, 2);
    assert_int_equal(kill(pid, SIGINT), 0);
    nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL); /* the first handler ran */
    assert_int_equal(kill(pid, SIGINT), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT)) {
        /* the first one may have already stopped the run (its step ended within 20 ms) */
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 130);
        fprintf(stderr, "double SIGINT: the run had stopped after the first one\n");
    }
}

/* The live progress line (a terminal) still prints checkpoints, evals and stage changes
 * as lines, as docs/training.md says (issue 25: checkpoint lines were only printed
 * without a terminal), and the start says how the MFU reference rate was measured. */
static void test_live_lines(void **state) {
    (void)state;
    lm_train_config c;
    load_cfg(&c);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256], log[300];
    snprintf(dir, sizeof dir, "%s/live", g_dir);
    snprintf(log, sizeof log, "%s/live.err", g_dir);
    o.run_dir = dir;
    o.max_steps = 2;
    o.progress = 1; /* the live line, as on a terminal */
    fflush(stderr);
    const int saved = dup(2), fd = open(log, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    close(fd);
    lm_train_summary s;
    lm_error err = {0};
    lm_status st = lm_train_run(&c, &o, &s, &err);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    lm_train_config_free(&c);
    char *out = read_file(log, NULL);
    assert_non_null(out);
    fprintf(stderr, "live run's output:\n%s\n", out);
    assert_int_equal(st, LM_OK);
    assert_non_null(strstr(out, "\r\033[Kstep 1/2")); /* it was the live line */
    /* the MFU reference says how it was measured (issue 25: one short call swung 2x) */
    assert_non_null(strstr(out, "mfu reference: "));
    assert_non_null(strstr(out, "best of 7 calls after a 0.1 s warm-up"));
    assert_non_null(strstr(s.ref_desc, "sgemm fp32 768^3 on "));
    assert_true(s.ref_flops > 0);
    /* its own line, after the live line is cleared (not only the "done:" line's) */
    assert_non_null(strstr(out, "\033[Kcheckpoint "));
    free(out);
    /* layers are numbered from 1 in the log, as in the config (issue 25): layer 1 is
     * dense (first_k_dense_replace = 1), so the first MoE entry is layer 2 */
    snprintf(log, sizeof log, "%s/log.jsonl", dir);
    out = read_file(log, NULL);
    assert_non_null(out);
    assert_non_null(strstr(out, "\"moe\": [{\"layer\": 2, "));
    free(out);
}

static void test_cli(void **state) {
    (void)state;
    char out[8192];
    assert_int_equal(
        lm_run_cli(out, sizeof out, "train --config %s --run-dir %s/H --max-steps 2", g_cfg, g_dir),
        0);
    assert_non_null(strstr(out, "\"steps\": 2"));
    assert_non_null(strstr(out, "step-0000002"));
    assert_int_equal(
        lm_run_cli(out, sizeof out, "train --run-dir %s/H --resume --max-steps 3", g_dir), 0);
    assert_non_null(strstr(out, "\"steps\": 3"));
    assert_non_null(strstr(out, "resumed from"));
    assert_int_equal(lm_run_cli(out, sizeof out, "train --config %s --run-dir %s/H", g_cfg, g_dir),
                     1);
    assert_non_null(strstr(out, "--resume"));
    assert_int_equal(lm_run_cli(out, sizeof out,
                                "train --config %s --run-dir %s/I --max-steps 12 "
                                "--fail-checkpoint-at 10",
                                g_cfg, g_dir),
                     1);
    assert_non_null(strstr(out, "injected"));
    assert_int_equal(
        lm_run_cli(out, sizeof out, "train --config %s/none.json --run-dir %s/J", g_dir, g_dir), 1);
    assert_non_null(strstr(out, "none.json"));
    assert_int_equal(lm_run_cli(out, sizeof out, "train --config %s", g_cfg), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "train --run-dir %s/K", g_dir), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "train --bogus"), 2);
    assert_int_equal(
        lm_run_cli(out, sizeof out, "train --config %s --run-dir %s/K --max-steps x", g_cfg, g_dir),
        2);
    assert_int_equal(lm_run_cli(out, sizeof out, "train --help"), 0);
    assert_non_null(strstr(out, "--fail-checkpoint-at"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_bit_exact),
        cmocka_unit_test(test_checkpoint_failure),
        cmocka_unit_test(test_corrupt_checkpoint),
        cmocka_unit_test(test_config_errors),
        cmocka_unit_test(test_resume_changed_config),
        cmocka_unit_test(test_nan_guard),
        cmocka_unit_test(test_nonfinite_status),
        cmocka_unit_test(test_dist_nccl_cpu),
        cmocka_unit_test(test_interrupt_and_resume),
        cmocka_unit_test(test_live_lines),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
