/* Training checkpoints: RUN/ckpt/step-NNNNNNN = lm_params_save's model.safetensors +
 * config.json, plus train_state.safetensors (AdamW moments, counters, loader state,
 * router statistics, the training config text); assembled under a temporary name,
 * renamed into place, then RUN/ckpt/latest replaced atomically; pruned to the last
 * K. Layout and guarantees: include/linmoe/train.h, src/train/train_internal.h. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "linmoe/safetensors.h"
#include "train/train_internal.h"

#define PATHMAX 4096

/* Remove a directory holding only plain files (a checkpoint). */
static void rm_flat_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char path[PATHMAX + 300];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

/* Test hook (scripts/soak.sh): LINMOE_TEST_CKPT_PAUSE_US=N sleeps N microseconds at each
 * stage of a checkpoint write (model file written, train state written, directory renamed
 * into place), so that a SIGKILL at a random moment lands inside writes often. Unset: no
 * pause. */
static void test_pause(void) {
    const char *s = getenv("LINMOE_TEST_CKPT_PAUSE_US");
    const long us = s ? atol(s) : 0;
    if (us > 0) {
        struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
}

static int fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int r = fsync(fd);
    close(fd);
    return r;
}

/* "step-" followed by digits only; returns the step or -1. */
static int64_t ckpt_step_of(const char *name) {
    if (strncmp(name, "step-", 5) != 0 || !name[5])
        return -1;
    int64_t s = 0;
    for (const char *q = name + 5; *q; q++) {
        if (*q < '0' || *q > '9' || s > ((int64_t)1 << 55))
            return -1;
        s = s * 10 + (*q - '0');
    }
    return s;
}

void lm_train_ckpt_cleanup(const char *run_dir) {
    char ck[PATHMAX], path[PATHMAX + 300];
    snprintf(ck, sizeof ck, "%s/ckpt", run_dir);
    DIR *d = opendir(ck);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, ".tmp-step-", 10) != 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", ck, e->d_name);
        rm_flat_dir(path);
    }
    closedir(d);
}

lm_status lm_train_latest_checkpoint(const char *run_dir, char *dir, size_t size, lm_error *err) {
    char path[PATHMAX];
    snprintf(path, sizeof path, "%s/ckpt/latest", run_dir);
    FILE *f = fopen(path, "rb");
    if (!f)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot open: %s (no checkpoint in %s)", path,
                         strerror(errno), run_dir);
    char name[128] = "";
    size_t n = fread(name, 1, sizeof name - 1, f);
    fclose(f);
    name[n] = '\0';
    while (n > 0 && (name[n - 1] == '\n' || name[n - 1] == '\r'))
        name[--n] = '\0';
    if (ckpt_step_of(name) < 0)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: does not name a checkpoint (\"%.40s\")", path,
                         name);
    if ((size_t)snprintf(dir, size, "%s/ckpt/%s", run_dir, name) >= size)
        return lm_errorf(err, LM_ERR_INVALID, "%s: path too long", path);
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return lm_errorf(err, LM_ERR_IO, "%s names %s, which is not a directory", path, dir);
    return LM_OK;
}

/* Write `text` to `path` via a temporary name, fsync, rename, fsync the directory. */
static lm_status write_atomic(const char *path, const char *dirpath, const char *text,
                              lm_error *err) {
    char tmp[PATHMAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot create %s: %s", path, tmp, strerror(errno));
    const size_t n = strlen(text);
    ssize_t w = write(fd, text, n);
    if (w != (ssize_t)n || fsync(fd) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return lm_errorf(err, LM_ERR_IO, "%s: write of %s failed: %s", path, tmp, strerror(e));
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return lm_errorf(err, LM_ERR_IO, "%s: cannot rename %s into place: %s", path, tmp,
                         strerror(e));
    }
    fsync_path(dirpath);
    return LM_OK;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Keep the newest keep_last step-* directories (never removing `keep`). */
static void prune(const char *ck, int keep_last, int64_t keep) {
    if (keep_last <= 0)
        return;
    DIR *d = opendir(ck);
    if (!d)
        return;
    int64_t *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int64_t s = ckpt_step_of(e->d_name);
        if (s < 0)
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            steps = realloc(steps, cap * sizeof(int64_t));
            LM_CHECK(steps != NULL);
        }
        steps[n++] = s;
    }
    closedir(d);
    if (n > (size_t)keep_last) {
        qsort(steps, n, sizeof(int64_t), cmp_i64);
        char path[PATHMAX + 64];
        for (size_t i = 0; i + (size_t)keep_last < n; i++) {
            if (steps[i] == keep)
                continue;
            snprintf(path, sizeof path, "%s/step-%07lld", ck, (long long)steps[i]);
            rm_flat_dir(path);
        }
    }
    free(steps);
}

static lm_status add_state(lm_st_writer *w, const lm_params *p, const lm_adamw *a, lm_model *m,
                           const lm_train_counters *k, const lm_loader_state *ls,
                           const char *config_text, lm_error *err) {
    int64_t shp[2] = {p->numel, 0};
    LM_TRY(lm_st_writer_add(w, "adamw.m", LM_F32, 1, shp, a->m, err));
    LM_TRY(lm_st_writer_add(w, "adamw.v", LM_F32, 1, shp, a->v, err));
    int64_t cnt[LM_TRAIN_COUNTERS] = {k->step,      k->opt_step, k->tokens, k->bad_streak,
                                      k->bad_total, k->stage,    k->version};
    shp[0] = LM_TRAIN_COUNTERS;
    LM_TRY(lm_st_writer_add(w, "counters", LM_I64, 1, shp, cnt, err));
    int64_t lw[LM_LOADER_STATE_WORDS] = {(int64_t)ls->rows,    (int64_t)ls->passkeys,
                                         (int64_t)ls->epoch,   (int64_t)ls->doc_pos,
                                         (int64_t)ls->doc_off, (int64_t)ls->version};
    shp[0] = LM_LOADER_STATE_WORDS;
    LM_TRY(lm_st_writer_add(w, "loader.state", LM_I64, 1, shp, lw, err));
    for (int i = 0; i < p->cfg.num_hidden_layers; i++) {
        lm_router_state *rs = lm_model_router_state(m, i);
        if (!rs)
            continue;
        char name[96];
        shp[0] = rs->E;
        snprintf(name, sizeof name, "router.%d.prev_delta", i);
        LM_TRY(lm_st_writer_add(w, name, LM_F32, 1, shp, rs->prev_delta, err));
        int64_t hs[2] = {LM_ROUTER_HISTORY, rs->E};
        snprintf(name, sizeof name, "router.%d.history", i);
        LM_TRY(lm_st_writer_add(w, name, LM_F64, 2, hs, rs->history, err));
        int64_t hp[2] = {rs->hist_len, rs->hist_pos};
        shp[0] = 2;
        snprintf(name, sizeof name, "router.%d.history_pos", i);
        LM_TRY(lm_st_writer_add(w, name, LM_I64, 1, shp, hp, err));
    }
    char num[32];
    LM_TRY(lm_st_writer_meta(w, "format", "linmoe-train-state", err));
    snprintf(num, sizeof num, "%d", LM_TRAIN_STATE_VERSION);
    LM_TRY(lm_st_writer_meta(w, "version", num, err));
    snprintf(num, sizeof num, "%lld", (long long)k->step);
    LM_TRY(lm_st_writer_meta(w, "step", num, err));
    snprintf(num, sizeof num, "%lld", (long long)k->stage);
    LM_TRY(lm_st_writer_meta(w, "stage", num, err));
    snprintf(num, sizeof num, "%lld", (long long)k->tokens);
    LM_TRY(lm_st_writer_meta(w, "tokens", num, err));
    LM_TRY(lm_st_writer_meta(w, "train_config", config_text ? config_text : "", err));
    return LM_OK;
}

lm_status lm_train_ckpt_save(const char *run_dir, const lm_params *p, const lm_adamw *a,
                             lm_model *m, const lm_train_counters *k, const lm_loader_state *ls,
                             const char *config_text, int keep_last, int fail_inject, char *dir_out,
                             size_t dir_size, lm_error *err) {
    char ck[PATHMAX], tmp[PATHMAX + 64], fin[PATHMAX + 64], old[PATHMAX + 96], path[PATHMAX + 128];
    snprintf(ck, sizeof ck, "%s/ckpt", run_dir);
    if (mkdir(ck, 0755) != 0 && errno != EEXIST)
        return lm_errorf(err, LM_ERR_IO, "checkpoint: cannot create %s: %s", ck, strerror(errno));
    snprintf(tmp, sizeof tmp, "%s/.tmp-step-%07lld", ck, (long long)k->step);
    snprintf(fin, sizeof fin, "%s/step-%07lld", ck, (long long)k->step);
    snprintf(old, sizeof old, "%s/.old-step-%07lld.%ld", ck, (long long)k->step, (long)getpid());
    if (dir_out)
        snprintf(dir_out, dir_size, "%s", fin);
    rm_flat_dir(tmp);
    lm_st_writer w;
    lm_st_writer_init(&w);
    /* a failed model file (disk full) takes the error path below too: the message says
     * the previous checkpoint is intact (tests/scripts/full_disk.sh) */
    lm_status st = lm_params_save(p, tmp, err);
    if (st == LM_OK) {
        test_pause();
        st = add_state(&w, p, a, m, k, ls, config_text, err);
    }
    snprintf(path, sizeof path, "%s/train_state.safetensors", tmp);
    if (st == LM_OK && fail_inject) {
        /* test hook: a write that dies half-way (a partial temporary file, no rename) */
        char part[PATHMAX + 160];
        snprintf(part, sizeof part, "%s.tmp.%ld", path, (long)getpid());
        FILE *f = fopen(part, "wb");
        if (f) {
            fputs("{\"truncated", f);
            fclose(f);
        }
        st = lm_errorf(err, LM_ERR_IO,
                       "%s: write failed: injected failure (--fail-checkpoint-at %lld)", path,
                       (long long)k->step);
    }
    if (st == LM_OK)
        st = lm_st_writer_save(&w, path, err);
    lm_st_writer_free(&w);
    if (st == LM_OK)
        test_pause();
    if (st == LM_OK && fsync_path(tmp) != 0)
        st = lm_errorf(err, LM_ERR_IO, "checkpoint: fsync of %s failed: %s", tmp, strerror(errno));
    struct stat sb;
    const int had = st == LM_OK && stat(fin, &sb) == 0;
    if (had && rename(fin, old) != 0)
        st = lm_errorf(err, LM_ERR_IO, "checkpoint: cannot move the old %s aside: %s", fin,
                       strerror(errno));
    if (st == LM_OK && rename(tmp, fin) != 0) {
        st = lm_errorf(err, LM_ERR_IO, "checkpoint: cannot rename %s to %s: %s", tmp, fin,
                       strerror(errno));
        if (had)
            rename(old, fin);
    }
    if (st != LM_OK) {
        char buf[sizeof err->msg];
        snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
        rm_flat_dir(tmp);
        return lm_errorf(err, st,
                         "checkpoint at step %lld not written (the previous one is intact): %s",
                         (long long)k->step, buf);
    }
    fsync_path(ck);
    test_pause();
    char latest[PATHMAX + 16], name[64];
    snprintf(latest, sizeof latest, "%s/latest", ck);
    snprintf(name, sizeof name, "step-%07lld\n", (long long)k->step);
    st = write_atomic(latest, ck, name, err);
    if (had)
        rm_flat_dir(old);
    if (st != LM_OK)
        return st;
    prune(ck, keep_last, k->step);
    return LM_OK;
}

/* ---------------------------------------------------------------- load */

static lm_status want(const lm_safetensors *st, const char *file, const char *name, lm_dtype dt,
                      int ndim, const int64_t *shape, const void **data, lm_error *err) {
    const lm_st_entry *e = lm_st_find(st, name);
    if (!e)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: missing tensor '%s'", file, name);
    if (e->dtype != dt)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s' has dtype %s, expected %s", file,
                         name, lm_dtype_name(e->dtype), lm_dtype_name(dt));
    int ok = e->ndim == ndim;
    for (int j = 0; ok && j < ndim; j++)
        ok = e->shape[j] == shape[j];
    if (!ok)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s' has the wrong shape for this model",
                         file, name);
    *data = e->data;
    return LM_OK;
}

lm_status lm_train_checkpoint_config(const char *ckpt_dir, char **text, lm_error *err) {
    *text = NULL;
    char path[PATHMAX + 64];
    snprintf(path, sizeof path, "%s/train_state.safetensors", ckpt_dir);
    lm_safetensors st;
    LM_TRY(lm_st_read(path, &st, err));
    const char *t = lm_st_meta(&st, "train_config");
    if (!t || !*t) {
        lm_st_free(&st);
        return lm_errorf(err, LM_ERR_FORMAT, "%s: no 'train_config' in the metadata", path);
    }
    size_t n = strlen(t) + 1;
    *text = LM_MALLOC(n);
    memcpy(*text, t, n);
    lm_st_free(&st);
    return LM_OK;
}

/* Check every tensor and value of the file (commit = 0), or copy them into a, k, ls and
 * m's router states (commit = 1, only after a pass with commit = 0 succeeded): a bad file
 * leaves the trainer as it was, not half-updated. */
static lm_status load_body(const lm_safetensors *st, const char *path, const lm_params *p,
                           lm_adamw *a, lm_model *m, lm_train_counters *k, lm_loader_state *ls,
                           int commit, lm_error *err) {
    const char *fmt = lm_st_meta(st, "format");
    if (!fmt || strcmp(fmt, "linmoe-train-state") != 0)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: metadata 'format' is not linmoe-train-state",
                         path);
    const void *d;
    int64_t shp[2] = {p->numel, 0};
    /* the moments of a's shard [lo, hi) (the whole buffer on one rank) */
    const size_t shard = (size_t)(a->hi - a->lo) * sizeof(float);
    LM_TRY(want(st, path, "adamw.m", LM_F32, 1, shp, &d, err));
    if (commit)
        memcpy(a->m, (const float *)d + a->lo, shard);
    LM_TRY(want(st, path, "adamw.v", LM_F32, 1, shp, &d, err));
    if (commit)
        memcpy(a->v, (const float *)d + a->lo, shard);
    shp[0] = LM_TRAIN_COUNTERS;
    LM_TRY(want(st, path, "counters", LM_I64, 1, shp, &d, err));
    int64_t c[LM_TRAIN_COUNTERS];
    memcpy(c, d, sizeof c);
    lm_train_counters kt;
    kt.step = c[0];
    kt.opt_step = c[1];
    kt.tokens = c[2];
    kt.bad_streak = c[3];
    kt.bad_total = c[4];
    kt.stage = c[5];
    kt.version = c[6];
    if (kt.version != LM_TRAIN_STATE_VERSION)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: counters version %lld (want %d)", path,
                         (long long)kt.version, LM_TRAIN_STATE_VERSION);
    if (kt.step < 0 || kt.opt_step < 0 || kt.opt_step > kt.step || kt.tokens < 0 ||
        kt.bad_streak < 0 || kt.bad_total < kt.bad_streak || kt.stage < -1)
        return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor 'counters' holds inconsistent values",
                         path);
    if (commit)
        *k = kt;
    shp[0] = LM_LOADER_STATE_WORDS;
    LM_TRY(want(st, path, "loader.state", LM_I64, 1, shp, &d, err));
    int64_t lw[LM_LOADER_STATE_WORDS];
    memcpy(lw, d, sizeof lw);
    if (commit) {
        ls->rows = (uint64_t)lw[0];
        ls->passkeys = (uint64_t)lw[1];
        ls->epoch = (uint64_t)lw[2];
        ls->doc_pos = (uint64_t)lw[3];
        ls->doc_off = (uint64_t)lw[4];
        ls->version = (uint64_t)lw[5];
    }
    for (int i = 0; i < p->cfg.num_hidden_layers; i++) {
        lm_router_state *rs = lm_model_router_state(m, i);
        if (!rs)
            continue;
        char name[96];
        shp[0] = rs->E;
        snprintf(name, sizeof name, "router.%d.prev_delta", i);
        LM_TRY(want(st, path, name, LM_F32, 1, shp, &d, err));
        if (commit)
            memcpy(rs->prev_delta, d, (size_t)rs->E * sizeof(float));
        int64_t hs[2] = {LM_ROUTER_HISTORY, rs->E};
        snprintf(name, sizeof name, "router.%d.history", i);
        LM_TRY(want(st, path, name, LM_F64, 2, hs, &d, err));
        if (commit)
            memcpy(rs->history, d, (size_t)LM_ROUTER_HISTORY * rs->E * sizeof(double));
        shp[0] = 2;
        snprintf(name, sizeof name, "router.%d.history_pos", i);
        LM_TRY(want(st, path, name, LM_I64, 1, shp, &d, err));
        int64_t hp[2];
        memcpy(hp, d, sizeof hp);
        if (hp[0] < 0 || hp[0] > LM_ROUTER_HISTORY || hp[1] < 0 || hp[1] >= LM_ROUTER_HISTORY)
            return lm_errorf(err, LM_ERR_FORMAT, "%s: tensor '%s' = [%lld, %lld] out of range",
                             path, name, (long long)hp[0], (long long)hp[1]);
        if (commit) {
            rs->hist_len = (int)hp[0];
            rs->hist_pos = (int)hp[1];
        }
    }
    return LM_OK;
}

/* Validate the whole file, then commit it. */
static lm_status load_checked(const lm_safetensors *st, const char *path, const lm_params *p,
                              lm_adamw *a, lm_model *m, lm_train_counters *k,
                              lm_loader_state *ls, lm_error *err) {
    LM_TRY(load_body(st, path, p, a, m, k, ls, 0, err));
    return load_body(st, path, p, a, m, k, ls, 1, err);
}

lm_status lm_train_state_load(const char *dir, const lm_params *p, lm_adamw *a, lm_model *m,
                              lm_train_counters *k, lm_loader_state *ls, lm_error *err) {
    char path[PATHMAX + 64];
    snprintf(path, sizeof path, "%s/train_state.safetensors", dir);
    lm_safetensors st;
    LM_TRY(lm_st_read(path, &st, err));
    lm_status s = load_checked(&st, path, p, a, m, k, ls, err);
    lm_st_free(&st);
    return s;
}

lm_status lm_train_state_parse(const void *bytes, size_t size, const char *label,
                               const lm_params *p, lm_adamw *a, lm_model *m, lm_train_counters *k,
                               lm_loader_state *ls, lm_error *err) {
    lm_safetensors st;
    LM_TRY(lm_st_parse(bytes, size, label, &st, err));
    lm_status s = load_checked(&st, label, p, a, m, k, ls, err);
    lm_st_free(&st);
    return s;
}
