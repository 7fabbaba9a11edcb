/* The shortened main job, end to end through the CLI on the real Brown corpus (issue 5:
 * "`.ci/run` runs a shortened main job (configs/tiny.json, a few steps of each stage,
 * resume, eval, generate, plot) end to end as a test"). The steps of
 * scripts/main-job.sh, made small, in a temporary directory:
 *  1. `linmoe tokenize --tokenizer byte` data/brown/{train,val}.txt into shards, and
 *     the first validation document alone (the one the trainer's evals score);
 *  2. a training config from configs/tiny-train.json (the model of configs/tiny.json)
 *     on those shards: 6 steps per stage (seq_len 64, then 256 with passkey
 *     documents), a checkpoint every 4 steps, evals on the first validation document
 *     with passkey at 128 and 256 tokens, 4 samples each;
 *  3. training, three ways: straight (A); `--max-steps 7` (mid-way, one step into the
 *     long stage) then `--resume` (B); `--max-steps 7`, `latest` pointed back at
 *     step 4 as if killed after step 7 was logged but before its checkpoint, then
 *     `--resume` (C). B and C must reproduce A: log.jsonl (the loss strings
 *     byte-identical; every field but the timings), evals.jsonl, stages.jsonl and the
 *     final checkpoint's files, byte for byte. The logs must show both stages (seq_len,
 *     passkey rows only in the long one) and the validation bits/byte going down;
 *  4. `linmoe eval` of B's final checkpoint on the first validation document: finite
 *     bits/byte equal to the trainer's last eval over the same bytes, passkey entries
 *     for both lengths, one MoE entry per MoE layer;
 *  5. `linmoe generate --prompt The --max-new 20 --seed 1 --threads 1`: prints the
 *     prompt and a continuation; the same seed gives the same bytes, another seed
 *     other bytes;
 *  6. `linmoe plot` of B: four PNGs; in plots/summary.json every plot drawn with
 *     non-empty series of the expected sizes, and the long stage's boundary marked
 *     (in summary.json and as an arrow + label in the gnuplot script) at the step and
 *     tokens of B/stages.jsonl.
 * Everything runs on one thread (--threads 1): on a busy 2-core machine OpenMP's spin
 * waits make two threads slower on this tiny model. Nothing depends on timing fields.
 * Fails (does not skip) without data/brown (run scripts/fetch-data.sh) or gnuplot
 * (run scripts/install-deps.sh): .ci/run provides both. */
#include "test_util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define STAGE_STEPS 6 /* steps per stage */
#define TOTAL_STEPS (2 * STAGE_STEPS)
#define CKPT_EVERY 4
#define STOP_AT 7   /* --max-steps: one step into the long stage, between checkpoints */
#define REWIND_TO 4 /* the checkpoint C's `latest` is pointed back at */
#define PK_SAMPLES 4
#define GEN_NEW 20

static const int g_pk_len[2] = {128, 256};

static char g_dir[64];
static int g_tokenized, g_trained;

/* ---------------------------------------------------------------- helpers */

static const char *path(const char *rel) {
    static char buf[8][512];
    static int next = 0;
    char *p = buf[next];
    next = (next + 1) % 8;
    snprintf(p, 512, "%s/%s", g_dir, rel);
    return p;
}

static char *slurp(const char *p, size_t *len) {
    FILE *f = fopen(p, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    assert_non_null(b);
    size_t got = fread(b, 1, (size_t)n, f);
    fclose(f);
    b[got] = '\0';
    if (len)
        *len = got;
    return b;
}

static char *must_slurp(const char *p, size_t *len) {
    char *b = slurp(p, len);
    if (!b)
        fail_msg("cannot read %s", p);
    return b;
}

static void spit(const char *p, const char *text, size_t n) {
    FILE *f = fopen(p, "wb");
    if (!f)
        fail_msg("cannot write %s", p);
    assert_int_equal(fwrite(text, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static long file_size(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 ? (long)sb.st_size : -1;
}

/* `$LINMOE_BIN args` with stdout and stderr to separate files (lm_run_cli merges
 * them; generate's sample and eval's JSON must be read alone). Returns the exit
 * status. */
static int run_split(const char *out_file, const char *err_file, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int run_split(const char *out_file, const char *err_file, const char *fmt, ...) {
    const char *bin = getenv("LINMOE_BIN");
    if (!bin || !*bin)
        fail_msg("LINMOE_BIN is not set (run the tests through ctest)");
    char args[2048], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    int na = vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    assert_true(na > 0 && (size_t)na < sizeof args);
    na = snprintf(cmd, sizeof cmd, "'%s' %s >'%s' 2>'%s'", bin, args, out_file, err_file);
    assert_true(na > 0 && (size_t)na < sizeof cmd);
    int st = system(cmd);
    if (st != -1 && WIFEXITED(st))
        return WEXITSTATUS(st);
    return -1;
}

/* Run the CLI, printing its output when the exit status is not `want`. */
static void cli_expect(int want, const char *what, const char *args) {
    static char out[1 << 16];
    int rc = lm_run_cli(out, sizeof out, "%s", args);
    if (rc != want)
        print_message("%s: exit %d (wanted %d): linmoe %s\n%s\n", what, rc, want, args, out);
    assert_int_equal(rc, want);
}

/* The non-empty lines of a file (a NULL-terminated array; the text is owned by
 * lines[0]'s buffer, freed by free_lines). */
typedef struct {
    char *buf;
    char **v;
    int n;
} lines_t;

static lines_t read_lines(const char *p) {
    lines_t l = {must_slurp(p, NULL), NULL, 0};
    int cap = 16;
    l.v = malloc(sizeof(char *) * (size_t)cap);
    for (char *s = strtok(l.buf, "\n"); s; s = strtok(NULL, "\n")) {
        if (l.n + 1 >= cap) {
            cap *= 2;
            l.v = realloc(l.v, sizeof(char *) * (size_t)cap);
        }
        l.v[l.n++] = s;
    }
    l.v[l.n] = NULL;
    return l;
}

static void free_lines(lines_t *l) {
    free(l->buf);
    free(l->v);
}

/* The raw text of the number after "key": in a JSON line (NULL when absent). */
static const char *raw_field(const char *line, const char *key, char *buf, size_t n) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p)
        return NULL;
    p += strlen(pat);
    while (*p == ' ' || *p == '\t')
        p++;
    size_t k = 0;
    while (p[k] && p[k] != ',' && p[k] != '}' && p[k] != ' ' && k + 1 < n) {
        buf[k] = p[k];
        k++;
    }
    buf[k] = '\0';
    return buf;
}

static int is_timing_key(const char *k) {
    return strstr(k, "per_s") || strstr(k, "second") || strstr(k, "time") || strcmp(k, "mfu") == 0;
}

/* Drop timing fields (at any depth) so the rest can be compared exactly. */
static void strip_timing(cJSON *j) {
    cJSON *c = j ? j->child : NULL;
    while (c) {
        cJSON *next = c->next;
        if (c->string && is_timing_key(c->string))
            cJSON_Delete(cJSON_DetachItemViaPointer(j, c));
        else if (cJSON_IsObject(c) || cJSON_IsArray(c))
            strip_timing(c);
        c = next;
    }
}

static char *normalized(const char *line, const char *where) {
    cJSON *j = cJSON_Parse(line);
    if (!j)
        fail_msg("%s: not JSON: %s", where, line);
    strip_timing(j);
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    return s;
}

/* run_b/rel must equal run_a/rel line by line, timings aside, and the raw text of
 * `raw_key` (when given) byte for byte. Returns the number of lines. */
static int assert_same_jsonl(const char *run_a, const char *run_b, const char *rel,
                             const char *raw_key) {
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", run_a, rel);
    snprintf(pb, sizeof pb, "%s/%s", run_b, rel);
    lines_t a = read_lines(pa), b = read_lines(pb);
    if (a.n != b.n)
        print_message("%s has %d lines, %s has %d\n", pa, a.n, pb, b.n);
    assert_int_equal(a.n, b.n);
    for (int i = 0; i < a.n; i++) {
        if (raw_key) {
            char ra[64], rb[64];
            const char *xa = raw_field(a.v[i], raw_key, ra, sizeof ra);
            const char *xb = raw_field(b.v[i], raw_key, rb, sizeof rb);
            if (!xa || !xb || strcmp(xa, xb) != 0)
                print_message("%s line %d: %s = %s vs %s\n", rel, i + 1, raw_key,
                              xa ? xa : "(none)", xb ? xb : "(none)");
            assert_non_null(xa);
            assert_non_null(xb);
            assert_string_equal(xa, xb);
        }
        char *na = normalized(a.v[i], pa), *nb = normalized(b.v[i], pb);
        if (strcmp(na, nb) != 0)
            print_message("%s line %d differs (timings aside):\n  %s\n  %s\n", rel, i + 1, na, nb);
        assert_string_equal(na, nb);
        free(na);
        free(nb);
    }
    const int n = a.n;
    free_lines(&a);
    free_lines(&b);
    return n;
}

static void assert_same_file(const char *pa, const char *pb) {
    size_t na, nb;
    char *a = must_slurp(pa, &na), *b = must_slurp(pb, &nb);
    if (na != nb || memcmp(a, b, na) != 0)
        print_message("%s and %s differ\n", pa, pb);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    free(a);
    free(b);
}

static double num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v)) {
        char *s = cJSON_PrintUnformatted(o);
        print_message("no number '%s' in %s\n", key, s ? s : "?");
        free(s);
    }
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

static cJSON *parse_file(const char *p) {
    char *t = must_slurp(p, NULL);
    cJSON *j = cJSON_Parse(t);
    if (!j)
        print_message("%s is not JSON:\n%s\n", p, t);
    free(t);
    assert_non_null(j);
    return j;
}

/* Replace obj[key] (which must exist: a renamed key in configs/tiny-train.json
 * should fail here, not silently run another config). */
static void set_item(cJSON *obj, const char *key, cJSON *v) {
    assert_non_null(obj);
    if (!cJSON_GetObjectItemCaseSensitive(obj, key))
        fail_msg("configs/tiny-train.json: no key '%s'", key);
    assert_true(cJSON_ReplaceItemInObjectCaseSensitive(obj, key, v));
}

static void set_num(cJSON *obj, const char *key, double v) {
    set_item(obj, key, cJSON_CreateNumber(v));
}

/* ---------------------------------------------------------------- setup */

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe_test_main_job_XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---------------------------------------------------------------- 1. tokenize */

static void test_tokenize(void **state) {
    (void)state;
    const char *txt[2] = {"data/brown/train.txt", "data/brown/val.txt"};
    for (int i = 0; i < 2; i++)
        if (access(txt[i], R_OK) != 0)
            fail_msg("%s is missing: run scripts/fetch-data.sh (it fetches the Brown corpus; "
                     ".ci/run does) from the repository root",
                     txt[i]);
    char args[1024];
    snprintf(args, sizeof args, "tokenize --tokenizer byte --in %s --out '%s' --quiet", txt[0],
             path("train.bin"));
    cli_expect(0, "tokenize train", args);
    snprintf(args, sizeof args, "tokenize --tokenizer byte --in %s --out '%s' --quiet", txt[1],
             path("val.bin"));
    cli_expect(0, "tokenize val", args);
    /* byte tokenizer: at least one token per byte */
    assert_true(file_size(path("train.bin")) > file_size(txt[0]));
    assert_true(file_size(path("val.bin")) > file_size(txt[1]));

    /* The first validation document alone (documents are separated by a line holding
     * only a form feed): with eval.max_val_tokens below its length, exactly what the
     * trainer's evals score. */
    size_t n;
    char *val = must_slurp(txt[1], &n);
    const char *sep = strstr(val, "\n\f\n");
    if (!sep)
        fail_msg("%s: no document separator (a line holding only \\f)", txt[1]);
    const size_t first = (size_t)(sep - val) + 1; /* with its last newline */
    assert_true(first > 2000);
    spit(path("val1.txt"), val, first);
    free(val);
    snprintf(args, sizeof args, "tokenize --tokenizer byte --in '%s' --out '%s' --quiet",
             path("val1.txt"), path("val1.bin"));
    cli_expect(0, "tokenize the first val document", args);
    g_tokenized = 1;
}

/* ---------------------------------------------------------------- 2, 3. train */

static void write_config(void) {
    cJSON *c = parse_file("configs/tiny-train.json");
    cJSON *data = cJSON_GetObjectItem(c, "data"), *tr = cJSON_GetObjectItem(c, "train");
    cJSON *ev = cJSON_GetObjectItem(c, "eval"), *stages = cJSON_GetObjectItem(c, "stages");
    set_item(data, "train", cJSON_CreateString(path("train.bin")));
    set_item(data, "val", cJSON_CreateString(path("val.bin")));
    const double bt = num(tr, "batch_tokens");
    set_num(tr, "checkpoint_every", CKPT_EVERY);
    set_num(tr, "keep_last", 2);
    set_num(tr, "eval_every", 0);
    set_num(tr, "threads", 1);
    assert_int_equal(cJSON_GetArraySize(stages), 2);
    for (int s = 0; s < 2; s++) {
        cJSON *st = cJSON_GetArrayItem(stages, s);
        set_num(st, "tokens", STAGE_STEPS * bt);
        set_num(st, "passkey_fraction", s == 0 ? 0.0 : 0.25);
    }
    set_num(ev, "seq_len", 0);
    set_num(ev, "max_val_tokens", 1000); /* the first document (whole documents) */
    set_num(ev, "passkey_samples", PK_SAMPLES);
    set_item(ev, "passkey_lengths", cJSON_CreateIntArray(g_pk_len, 2));
    char *text = cJSON_Print(c);
    spit(path("train_config.json"), text, strlen(text));
    free(text);
    cJSON_Delete(c);
}

static void train(const char *run, int resume, int max_steps) {
    char args[1024];
    int k = 0;
    if (resume)
        k = snprintf(args, sizeof args, "train --run-dir '%s' --resume", path(run));
    else
        k = snprintf(args, sizeof args, "train --config '%s' --run-dir '%s'",
                     path("train_config.json"), path(run));
    if (max_steps > 0)
        k += snprintf(args + k, sizeof args - (size_t)k, " --max-steps %d", max_steps);
    snprintf(args + k, sizeof args - (size_t)k, " --threads 1");
    cli_expect(0, run, args);
}

static void assert_latest(const char *run, int step) {
    char rel[128], want[32];
    snprintf(rel, sizeof rel, "%s/ckpt/latest", run);
    char *t = must_slurp(path(rel), NULL);
    snprintf(want, sizeof want, "step-%07d\n", step);
    assert_string_equal(t, want);
    free(t);
}

static void test_train_resume(void **state) {
    (void)state;
    if (!g_tokenized)
        fail_msg("needs the shards of test_tokenize");
    write_config();
    /* A: straight */
    train("runA", 0, 0);
    assert_latest("runA", TOTAL_STEPS);
    /* B: stopped mid-way, then resumed */
    train("runB", 0, STOP_AT);
    assert_latest("runB", STOP_AT);
    {
        lines_t l = read_lines(path("runB/log.jsonl"));
        assert_int_equal(l.n, STOP_AT);
        free_lines(&l);
    }
    train("runB", 1, 0);
    assert_latest("runB", TOTAL_STEPS);
    /* C: as if killed after logging step STOP_AT, between renaming its checkpoint
     * into place and updating `latest` (the stale step-STOP_AT directory stays; the
     * resumed run must drop the log lines after step REWIND_TO and redo them) */
    train("runC", 0, STOP_AT);
    char latest[32];
    int n = snprintf(latest, sizeof latest, "step-%07d\n", REWIND_TO);
    spit(path("runC/ckpt/latest"), latest, (size_t)n);
    train("runC", 1, 0);
    assert_latest("runC", TOTAL_STEPS);

    const char *runs[2] = {"runB", "runC"};
    for (int r = 0; r < 2; r++) {
        const char *a = path("runA"), *b = path(runs[r]);
        assert_int_equal(assert_same_jsonl(a, b, "log.jsonl", "loss"), TOTAL_STEPS);
        assert_int_equal(assert_same_jsonl(a, b, "evals.jsonl", "bits_per_byte"), 2);
        assert_int_equal(assert_same_jsonl(a, b, "stages.jsonl", NULL), 2);
        const char *files[3] = {"model.safetensors", "train_state.safetensors", "config.json"};
        for (int f = 0; f < 3; f++) {
            char rel[128];
            snprintf(rel, sizeof rel, "runA/ckpt/step-%07d/%s", TOTAL_STEPS, files[f]);
            char pa[512];
            snprintf(pa, sizeof pa, "%s", path(rel));
            snprintf(rel, sizeof rel, "%s/ckpt/step-%07d/%s", runs[r], TOTAL_STEPS, files[f]);
            assert_same_file(pa, path(rel));
        }
    }

    /* the log shows both stages: steps in order, seq_len per stage, passkey rows only
     * in the long stage, a finite loss every step */
    cJSON *cfg = parse_file("configs/tiny-train.json");
    const cJSON *st = cJSON_GetObjectItem(cfg, "stages");
    const int seq[2] = {(int)num(cJSON_GetArrayItem(st, 0), "seq_len"),
                        (int)num(cJSON_GetArrayItem(st, 1), "seq_len")};
    cJSON_Delete(cfg);
    lines_t l = read_lines(path("runB/log.jsonl"));
    int pk_rows[2] = {0, 0};
    for (int i = 0; i < l.n; i++) {
        cJSON *j = cJSON_Parse(l.v[i]);
        assert_non_null(j);
        const int s = i < STAGE_STEPS ? 0 : 1;
        assert_int_equal((int)num(j, "step"), i + 1);
        assert_int_equal((int)num(j, "stage"), s);
        assert_int_equal((int)num(j, "seq_len"), seq[s]);
        assert_int_equal((int)num(j, "skipped"), 0);
        const double loss = num(j, "loss");
        assert_true(isfinite(loss) && loss > 0 && loss < 7);
        pk_rows[s] += (int)num(j, "passkey_rows");
        assert_true(cJSON_GetArraySize(cJSON_GetObjectItem(j, "moe")) > 0);
        cJSON_Delete(j);
    }
    free_lines(&l);
    assert_int_equal(pk_rows[0], 0);
    assert_true(pk_rows[1] > 0);
    /* stages.jsonl: the long stage starts after STAGE_STEPS steps */
    l = read_lines(path("runB/stages.jsonl"));
    assert_int_equal(l.n, 2);
    cJSON *s1 = cJSON_Parse(l.v[1]);
    assert_non_null(s1);
    assert_int_equal((int)num(s1, "stage"), 1);
    assert_int_equal((int)num(s1, "step"), STAGE_STEPS);
    assert_int_equal((int)num(s1, "seq_len"), seq[1]);
    cJSON_Delete(s1);
    free_lines(&l);
    /* evals at both stage ends, passkey at both lengths, bits/byte below the uniform
     * log2(257) and going down */
    l = read_lines(path("runB/evals.jsonl"));
    assert_int_equal(l.n, 2);
    double bpb[2];
    for (int i = 0; i < 2; i++) {
        cJSON *e = cJSON_Parse(l.v[i]);
        assert_non_null(e);
        assert_int_equal((int)num(e, "step"), (i + 1) * STAGE_STEPS);
        assert_int_equal((int)num(e, "stage"), i);
        bpb[i] = num(e, "bits_per_byte");
        assert_true(isfinite(bpb[i]) && bpb[i] > 0 && bpb[i] < log2(257.0));
        const cJSON *pk = cJSON_GetObjectItem(e, "passkey");
        assert_int_equal(cJSON_GetArraySize(pk), 2);
        for (int k = 0; k < 2; k++) {
            const cJSON *p = cJSON_GetArrayItem(pk, k);
            assert_int_equal((int)num(p, "length"), g_pk_len[k]);
            assert_int_equal((int)num(p, "samples"), PK_SAMPLES);
        }
        cJSON_Delete(e);
    }
    free_lines(&l);
    assert_true(bpb[1] < bpb[0]);
    g_trained = 1;
}

/* ---------------------------------------------------------------- 4. eval */

static void final_ckpt(char *buf, size_t n) {
    snprintf(buf, n, "%s/ckpt/step-%07d", path("runB"), TOTAL_STEPS);
}

static void test_eval(void **state) {
    (void)state;
    if (!g_trained)
        fail_msg("needs the runs of test_train_resume");
    /* the trainer's last eval scored the same document with the same weights */
    lines_t l = read_lines(path("runB/evals.jsonl"));
    cJSON *last = cJSON_Parse(l.v[l.n - 1]);
    free_lines(&l);
    assert_non_null(last);
    const int seq_len = (int)num(last, "seq_len");
    char ck[512];
    final_ckpt(ck, sizeof ck);
    int rc = run_split(path("eval.out"), path("eval.err"),
                       "eval --ckpt '%s' --val '%s' --seq-len %d --passkey-lengths %d,%d "
                       "--passkey-samples %d --threads 1 --json '%s'",
                       ck, path("val1.bin"), seq_len, g_pk_len[0], g_pk_len[1], PK_SAMPLES,
                       path("eval.json"));
    if (rc != 0) {
        char *e = slurp(path("eval.err"), NULL);
        print_message("eval: exit %d\n%s\n", rc, e ? e : "");
        free(e);
    }
    assert_int_equal(rc, 0);
    /* stdout is the JSON object, the same as --json's */
    cJSON *j = parse_file(path("eval.out")), *jf = parse_file(path("eval.json"));
    assert_true(cJSON_Compare(j, jf, 1));
    cJSON_Delete(jf);
    const double bpb = num(j, "bits_per_byte");
    assert_true(isfinite(bpb) && bpb > 0 && bpb < log2(257.0));
    assert_true(fabs(bpb - num(last, "bits_per_byte")) <= 1e-6 * bpb);
    assert_int_equal((long)num(j, "bytes"), (long)num(last, "bytes"));
    assert_int_equal((long)num(j, "bytes"), file_size(path("val1.txt")));
    assert_int_equal((int)num(j, "seq_len"), (int)num(last, "seq_len"));
    assert_int_equal((int)num(j, "documents"), 1);
    cJSON_Delete(last);
    const cJSON *pk = cJSON_GetObjectItem(j, "passkey");
    assert_int_equal(cJSON_GetArraySize(pk), 2);
    for (int k = 0; k < 2; k++) {
        const cJSON *p = cJSON_GetArrayItem(pk, k);
        assert_int_equal((int)num(p, "length"), g_pk_len[k]);
        assert_int_equal((int)num(p, "samples"), PK_SAMPLES);
        const int correct = (int)num(p, "correct");
        assert_true(correct >= 0 && correct <= PK_SAMPLES);
        assert_true(fabs(num(p, "accuracy") - (double)correct / PK_SAMPLES) < 1e-12);
    }
    /* one MoE entry per MoE layer of the training log */
    l = read_lines(path("runB/log.jsonl"));
    cJSON *s = cJSON_Parse(l.v[0]);
    free_lines(&l);
    assert_non_null(s);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "moe")),
                     cJSON_GetArraySize(cJSON_GetObjectItem(s, "moe")));
    cJSON_Delete(s);
    cJSON_Delete(j);
}

/* ---------------------------------------------------------------- 5. generate */

static char *generate(int seed, const char *tag, size_t *len) {
    char ck[512], out[64], err[64];
    final_ckpt(ck, sizeof ck);
    snprintf(out, sizeof out, "gen-%s.out", tag);
    snprintf(err, sizeof err, "gen-%s.err", tag);
    char po[512], pe[512];
    snprintf(po, sizeof po, "%s", path(out));
    snprintf(pe, sizeof pe, "%s", path(err));
    int rc =
        run_split(po, pe, "generate --ckpt '%s' --prompt The --max-new %d --seed %d --threads 1",
                  ck, GEN_NEW, seed);
    if (rc != 0) {
        char *e = slurp(pe, NULL);
        print_message("generate: exit %d\n%s\n", rc, e ? e : "");
        free(e);
    }
    assert_int_equal(rc, 0);
    char *text = must_slurp(po, len);
    /* the prompt, then 1..GEN_NEW bytes (byte tokenizer), maybe a final newline */
    if (*len <= 3 || *len > 3 + GEN_NEW + 1 || memcmp(text, "The", 3) != 0)
        print_message("generate printed %zu bytes: '%s'\n", *len, text);
    assert_memory_equal(text, "The", 3);
    assert_true(*len > 3 && *len <= 3 + GEN_NEW + 1);
    return text;
}

static void test_generate(void **state) {
    (void)state;
    if (!g_trained)
        fail_msg("needs the runs of test_train_resume");
    size_t n1, n2, n3;
    char *a = generate(1, "a", &n1), *b = generate(1, "b", &n2), *c = generate(2, "c", &n3);
    assert_int_equal(n1, n2);
    assert_memory_equal(a, b, n1);
    assert_false(n1 == n3 && memcmp(a, c, n1) == 0);
    free(a);
    free(b);
    free(c);
}

/* ---------------------------------------------------------------- 6. plot */

static const cJSON *find_plot(const cJSON *sum, const char *name) {
    const cJSON *p;
    cJSON_ArrayForEach(p, cJSON_GetObjectItem(sum, "plots")) {
        const cJSON *nm = cJSON_GetObjectItem(p, "name");
        if (cJSON_IsString(nm) && strcmp(nm->valuestring, name) == 0)
            return p;
    }
    fail_msg("plot %s not in summary.json", name);
    return NULL;
}

static int series_points(const cJSON *plot, int i) {
    return (int)num(cJSON_GetArrayItem(cJSON_GetObjectItem(plot, "series"), i), "points");
}

/* The plot's boundary of stage 1 is at `value` of `key`, and its gnuplot script draws
 * an arrow and a label there. */
static void check_boundary(const char *run, const cJSON *plot, const char *key, double value,
                           const char *stage_name) {
    const cJSON *b, *found = NULL;
    cJSON_ArrayForEach(b, cJSON_GetObjectItem(plot, "stage_boundaries")) {
        if ((int)num(b, "stage") == 1)
            found = b;
    }
    if (!found)
        fail_msg("plot %s: no boundary for stage 1",
                 cJSON_GetObjectItem(plot, "name")->valuestring);
    assert_true(num(found, key) == value);
    char p[600], want[128];
    snprintf(p, sizeof p, "%s/plots/%s", run, cJSON_GetObjectItem(plot, "script")->valuestring);
    char *gp = must_slurp(p, NULL);
    snprintf(want, sizeof want, "from first %.17g, graph 0", value);
    if (!strstr(gp, want))
        print_message("%s lacks '%s':\n%s\n", p, want, gp);
    assert_non_null(strstr(gp, want));
    snprintf(want, sizeof want, "'stage 1: %s'", stage_name);
    if (!strstr(gp, want))
        print_message("%s lacks '%s':\n%s\n", p, want, gp);
    assert_non_null(strstr(gp, want));
    free(gp);
}

static void check_png(const char *run, const cJSON *plot) {
    char p[600];
    snprintf(p, sizeof p, "%s/plots/%s", run, cJSON_GetObjectItem(plot, "png")->valuestring);
    FILE *f = fopen(p, "rb");
    if (!f)
        fail_msg("missing %s", p);
    unsigned char h[8] = {0};
    assert_int_equal(fread(h, 1, 8, f), 8);
    fclose(f);
    assert_memory_equal(h, "\x89PNG\r\n\x1a\n", 8);
    assert_true(file_size(p) > 1000);
}

static void test_plot(void **state) {
    (void)state;
    if (!g_trained)
        fail_msg("needs the runs of test_train_resume");
    if (system("command -v gnuplot >/dev/null 2>&1") != 0)
        fail_msg("gnuplot is not installed: run scripts/install-deps.sh");
    const char *run = path("runB");
    char args[600];
    snprintf(args, sizeof args, "plot '%s'", run);
    cli_expect(0, "plot", args);

    /* the stage-1 transition as the trainer logged it */
    lines_t l = read_lines(path("runB/stages.jsonl"));
    assert_int_equal(l.n, 2);
    cJSON *s1 = cJSON_Parse(l.v[1]);
    free_lines(&l);
    assert_non_null(s1);
    const double b_step = num(s1, "step"), b_tokens = num(s1, "tokens");
    assert_true(b_step == STAGE_STEPS && b_tokens > 0);
    char s1_name[64];
    snprintf(s1_name, sizeof s1_name, "%s", cJSON_GetObjectItem(s1, "name")->valuestring);
    cJSON_Delete(s1);
    /* MoE layers and experts, from the log */
    l = read_lines(path("runB/log.jsonl"));
    cJSON *rec = cJSON_Parse(l.v[0]);
    free_lines(&l);
    assert_non_null(rec);
    const cJSON *moe = cJSON_GetObjectItem(rec, "moe");
    const int n_moe = cJSON_GetArraySize(moe);
    const int n_exp = cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetArrayItem(moe, 0), "load"));
    cJSON_Delete(rec);
    assert_true(n_moe > 0 && n_exp > 0);

    char p[600];
    snprintf(p, sizeof p, "%s/plots/summary.json", run);
    cJSON *sum = parse_file(p);
    assert_int_equal((int)num(sum, "log_records"), TOTAL_STEPS);
    assert_int_equal((int)num(sum, "eval_records"), 2);
    const cJSON *pl;
    int n_plots = 0;
    cJSON_ArrayForEach(pl, cJSON_GetObjectItem(sum, "plots")) {
        const char *name = cJSON_GetObjectItem(pl, "name")->valuestring;
        if (cJSON_GetObjectItem(pl, "skipped"))
            fail_msg("plot %s skipped in a MoE run with evals", name);
        const cJSON *s;
        int ns = 0;
        cJSON_ArrayForEach(s, cJSON_GetObjectItem(pl, "series")) {
            if (num(s, "points") <= 0)
                fail_msg("plot %s: series '%s' is empty", name,
                         cJSON_GetObjectItem(s, "title")->valuestring);
            ns++;
        }
        assert_true(ns > 0);
        assert_true(cJSON_GetArraySize(cJSON_GetObjectItem(pl, "data")) > 0);
        check_png(run, pl);
        n_plots++;
    }
    assert_int_equal(n_plots, 4);
    const cJSON *loss = find_plot(sum, "loss");
    assert_int_equal(series_points(loss, 0), TOTAL_STEPS);
    assert_int_equal(series_points(loss, 1), 2);
    check_boundary(run, loss, "tokens", b_tokens, s1_name);
    const cJSON *mv = find_plot(sum, "maxvio");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(mv, "series")), n_moe);
    for (int i = 0; i < n_moe; i++)
        assert_int_equal(series_points(mv, i), TOTAL_STEPS);
    check_boundary(run, mv, "step", b_step, s1_name);
    const cJSON *hm = find_plot(sum, "expert_load");
    assert_int_equal(series_points(hm, 0), TOTAL_STEPS * n_moe * n_exp);
    check_boundary(run, hm, "step", b_step, s1_name);
    const cJSON *pk = find_plot(sum, "passkey");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(pk, "series")), 2);
    for (int i = 0; i < 2; i++)
        assert_int_equal(series_points(pk, i), 2);
    cJSON_Delete(sum);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenize), cmocka_unit_test(test_train_resume),
        cmocka_unit_test(test_eval),     cmocka_unit_test(test_generate),
        cmocka_unit_test(test_plot),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
