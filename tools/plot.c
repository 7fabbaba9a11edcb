/* `linmoe plot RUN_DIR`: read a training run's logs (log.jsonl, evals.jsonl,
 * stages.jsonl), write gnuplot data files and scripts into RUN_DIR/plots/, run
 * gnuplot on them to draw PNGs, and write RUN_DIR/plots/summary.json (each plot, its
 * data files, the points of each series and the stage boundaries drawn).
 *
 * Plots:
 *   loss.png         training loss (nats/token) and validation bits/byte (right axis)
 *                    against tokens; stage boundaries as labelled dashed lines
 *   maxvio.png       maxvio_batch of each MoE layer against step (boundaries at steps),
 *                    as a trailing moving average over n / 50 records (raw values in
 *                    maxvio.dat)
 *   expert_load.png  heat map of expert load / uniform share (E * load fraction,
 *                    1 = balanced) over steps, one row per (layer, expert); at most
 *                    400 columns of equal step width, each the mean of its records
 *                    (an empty column repeats the one before)
 *   passkey.png      passkey accuracy against document length, one series per
 *                    selected eval (the first, the last of each stage; at most 10):
 *                    points at the measured lengths with 95 % Wilson intervals (from
 *                    each entry's "samples"), no lines between lengths
 * A plot without data (no "moe" records, no passkey evals) is skipped with a note in
 * summary.json ("skipped": why) and on stderr.
 *
 * Log records: lines that are not JSON objects are errors (file:line); records
 * without a numeric "step" (log: also "loss" may be null, e.g. a skipped step) are
 * left out. When a record's step is not larger than the one before (a resumed run
 * re-logging steps), the earlier records from that step on are dropped. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "linmoe/core.h"

#define PROG "linmoe plot"
#define MAX_MOE_LAYERS 512
#define MAX_EXPERTS 65536
#define HEAT_COLS 400
#define MAX_PK_SERIES 10
#define MAXVIO_WINDOW_DIV 50 /* maxvio.png: moving average over n / 50 records */

/* distinct line colours (matplotlib's tab10), one per series */
static const char *const k_colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                       "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

void lm_cli_plot_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe plot RUN_DIR\n"
            "\n"
            "Reads RUN_DIR/log.jsonl (per step: step, tokens, stage, loss, moe[{layer,\n"
            "maxvio_batch, load}]...), RUN_DIR/evals.jsonl (step, tokens, stage,\n"
            "bits_per_byte, passkey[{length, accuracy}]) and RUN_DIR/stages.jsonl (stage,\n"
            "name, step, tokens, seq_len per stage transition); writes data files and gnuplot\n"
            "scripts into RUN_DIR/plots/ and draws with gnuplot (pngcairo, else png):\n"
            "  loss.png         training loss and validation bits/byte against tokens, stage\n"
            "                   boundaries marked\n"
            "  maxvio.png       maxvio_batch per MoE layer against step (moving average)\n"
            "  expert_load.png  heat map of expert load over steps, one row per (layer, expert)\n"
            "  passkey.png      passkey accuracy by document length, 95 %% intervals\n"
            "and RUN_DIR/plots/summary.json (plots, data files, points per series, stage\n"
            "boundaries drawn). Needs gnuplot (scripts/install-deps.sh installs it).\n"
            "\n"
            "exit status: 0 success, 1 bad input or a gnuplot failure, 2 usage error\n");
}

/* ---------------------------------------------------------------- growable arrays */

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, PROG ": out of memory\n");
        exit(LM_EXIT_BAD_INPUT);
    }
    return q;
}

typedef struct {
    int layer, E;
    double *maxvio; /* [cap] */
    float *load;    /* [cap, E], E * fraction */
} moe_series;

typedef struct {
    int64_t n, cap;
    double *step, *tokens, *loss;
    int *stage;
    int nl;
    moe_series *ml; /* [nl] */
} log_data;

typedef struct {
    double step, tokens, bpb;
    int stage;
    int npk;
    double *pk_len, *pk_acc, *pk_n; /* [npk]; pk_n: samples (NaN when not logged) */
} eval_rec;

typedef struct {
    int64_t n, cap;
    eval_rec *r;
} eval_data;

typedef struct {
    int stage;
    char name[64];
    double step, tokens, seq_len;
} stage_rec;

typedef struct {
    int n, cap;
    stage_rec *r;
} stage_data;

static void log_grow(log_data *d) {
    if (d->n < d->cap)
        return;
    d->cap = d->cap ? d->cap * 2 : 256;
    d->step = xrealloc(d->step, (size_t)d->cap * sizeof(double));
    d->tokens = xrealloc(d->tokens, (size_t)d->cap * sizeof(double));
    d->loss = xrealloc(d->loss, (size_t)d->cap * sizeof(double));
    d->stage = xrealloc(d->stage, (size_t)d->cap * sizeof(int));
    for (int l = 0; l < d->nl; l++) {
        d->ml[l].maxvio = xrealloc(d->ml[l].maxvio, (size_t)d->cap * sizeof(double));
        d->ml[l].load = xrealloc(d->ml[l].load, (size_t)d->cap * d->ml[l].E * sizeof(float));
    }
}

static void log_free(log_data *d) {
    free(d->step);
    free(d->tokens);
    free(d->loss);
    free(d->stage);
    for (int l = 0; l < d->nl; l++) {
        free(d->ml[l].maxvio);
        free(d->ml[l].load);
    }
    free(d->ml);
}

static void evals_free(eval_data *d) {
    for (int64_t i = 0; i < d->n; i++) {
        free(d->r[i].pk_len);
        free(d->r[i].pk_acc);
        free(d->r[i].pk_n);
    }
    free(d->r);
}

/* ---------------------------------------------------------------- reading */

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, PROG ": cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0, got;
    char *b = xrealloc(NULL, cap + 1);
    while ((got = fread(b + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            cap *= 2;
            b = xrealloc(b, cap + 1);
        }
    }
    if (ferror(f)) {
        fprintf(stderr, PROG ": cannot read %s\n", path);
        fclose(f);
        free(b);
        return NULL;
    }
    fclose(f);
    b[n] = '\0';
    *len = n;
    return b;
}

/* Calls fn(obj, path, line_no, ctx) for every non-blank line; a line that is not a
 * JSON object is an error naming the file and line. Returns 0 or -1. */
typedef int (*line_fn)(const cJSON *o, const char *path, int line, void *ctx);

static int for_each_line(const char *path, line_fn fn, void *ctx) {
    size_t len = 0;
    char *b = read_all(path, &len);
    if (!b)
        return -1;
    int line = 0, rc = 0;
    for (char *p = b; rc == 0 && p < b + len;) {
        char *e = memchr(p, '\n', (size_t)(b + len - p));
        if (!e)
            e = b + len;
        line++;
        size_t n = (size_t)(e - p);
        int blank = 1;
        for (size_t i = 0; i < n; i++)
            if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r')
                blank = 0;
        if (!blank) {
            cJSON *o = cJSON_ParseWithLength(p, n);
            if (!o || !cJSON_IsObject(o)) {
                fprintf(stderr, PROG ": %s:%d: not a JSON object\n", path, line);
                rc = -1;
            } else {
                rc = fn(o, path, line, ctx);
            }
            cJSON_Delete(o);
        }
        p = e + 1;
    }
    free(b);
    return rc;
}

/* The number under `key`, or NAN when absent / null / not a number. */
static double num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static moe_series *moe_layer(log_data *d, int layer, int E, const char *path, int line) {
    for (int l = 0; l < d->nl; l++)
        if (d->ml[l].layer == layer) {
            if (d->ml[l].E != E) {
                fprintf(stderr, PROG ": %s:%d: moe layer %d has %d loads, earlier records %d\n",
                        path, line, layer, E, d->ml[l].E);
                return NULL;
            }
            return &d->ml[l];
        }
    if (d->nl >= MAX_MOE_LAYERS) {
        fprintf(stderr, PROG ": %s:%d: more than %d MoE layers\n", path, line, MAX_MOE_LAYERS);
        return NULL;
    }
    d->ml = xrealloc(d->ml, (size_t)(d->nl + 1) * sizeof(moe_series));
    moe_series *s = &d->ml[d->nl++];
    s->layer = layer;
    s->E = E;
    s->maxvio = xrealloc(NULL, (size_t)(d->cap ? d->cap : 1) * sizeof(double));
    s->load = xrealloc(NULL, (size_t)(d->cap ? d->cap : 1) * E * sizeof(float));
    for (int64_t i = 0; i < d->n; i++) { /* records before this layer appeared */
        s->maxvio[i] = NAN;
        for (int e = 0; e < E; e++)
            s->load[i * E + e] = NAN;
    }
    return s;
}

static int log_line(const cJSON *o, const char *path, int line, void *ctx) {
    log_data *d = ctx;
    const double step = num(o, "step");
    if (!isfinite(step))
        return 0;
    const double tokens = num(o, "tokens");
    if (!isfinite(tokens)) {
        fprintf(stderr, PROG ": %s:%d: record of step %g has no numeric \"tokens\"\n", path, line,
                step);
        return -1;
    }
    while (d->n > 0 && d->step[d->n - 1] >= step)
        d->n--; /* resumed: later records win */
    log_grow(d);
    const int64_t i = d->n;
    d->step[i] = step;
    d->tokens[i] = tokens;
    d->loss[i] = num(o, "loss");
    const double st = num(o, "stage");
    d->stage[i] = isfinite(st) ? (int)st : 0;
    for (int l = 0; l < d->nl; l++) {
        d->ml[l].maxvio[i] = NAN;
        for (int e = 0; e < d->ml[l].E; e++)
            d->ml[l].load[i * d->ml[l].E + e] = NAN;
    }
    d->n++;
    const cJSON *moe = cJSON_GetObjectItemCaseSensitive(o, "moe");
    if (!moe || cJSON_IsNull(moe))
        return 0;
    if (!cJSON_IsArray(moe)) {
        fprintf(stderr, PROG ": %s:%d: \"moe\" is not an array\n", path, line);
        return -1;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, moe) {
        const double layer = num(it, "layer");
        const cJSON *load = cJSON_GetObjectItemCaseSensitive(it, "load");
        if (!isfinite(layer) || layer < 0 || layer > 1e6) {
            fprintf(stderr, PROG ": %s:%d: a \"moe\" entry has no valid \"layer\"\n", path, line);
            return -1;
        }
        const int E = cJSON_IsArray(load) ? cJSON_GetArraySize(load) : 0;
        if (E < 1 || E > MAX_EXPERTS) {
            fprintf(stderr,
                    PROG ": %s:%d: moe layer %d: \"load\" must be an array of 1..%d numbers\n",
                    path, line, (int)layer, MAX_EXPERTS);
            return -1;
        }
        moe_series *s = moe_layer(d, (int)layer, E, path, line);
        if (!s)
            return -1;
        s->maxvio[i] = num(it, "maxvio_batch");
        int e = 0;
        const cJSON *x;
        cJSON_ArrayForEach(x, load) {
            s->load[i * E + e] = cJSON_IsNumber(x) ? (float)(x->valuedouble * E) : NAN;
            e++;
        }
    }
    return 0;
}

static int eval_line(const cJSON *o, const char *path, int line, void *ctx) {
    eval_data *d = ctx;
    const double step = num(o, "step");
    if (!isfinite(step))
        return 0;
    while (d->n > 0 && d->r[d->n - 1].step >= step) {
        d->n--;
        free(d->r[d->n].pk_len);
        free(d->r[d->n].pk_acc);
        free(d->r[d->n].pk_n);
    }
    if (d->n == d->cap) {
        d->cap = d->cap ? d->cap * 2 : 64;
        d->r = xrealloc(d->r, (size_t)d->cap * sizeof(eval_rec));
    }
    eval_rec *r = &d->r[d->n++];
    memset(r, 0, sizeof(*r));
    r->step = step;
    r->tokens = num(o, "tokens");
    r->bpb = num(o, "bits_per_byte");
    const double st = num(o, "stage");
    r->stage = isfinite(st) ? (int)st : 0;
    const cJSON *pk = cJSON_GetObjectItemCaseSensitive(o, "passkey");
    if (!pk || cJSON_IsNull(pk))
        return 0;
    if (!cJSON_IsArray(pk)) {
        fprintf(stderr, PROG ": %s:%d: \"passkey\" is not an array\n", path, line);
        return -1;
    }
    const int n = cJSON_GetArraySize(pk);
    r->pk_len = xrealloc(NULL, (size_t)n * sizeof(double));
    r->pk_acc = xrealloc(NULL, (size_t)n * sizeof(double));
    r->pk_n = xrealloc(NULL, (size_t)n * sizeof(double));
    const cJSON *it;
    cJSON_ArrayForEach(it, pk) {
        const double len = num(it, "length"), acc = num(it, "accuracy");
        if (!isfinite(len) || !isfinite(acc)) {
            fprintf(stderr, PROG ": %s:%d: passkey entries need numeric length and accuracy\n",
                    path, line);
            return -1;
        }
        r->pk_len[r->npk] = len;
        r->pk_acc[r->npk] = acc;
        const double ns = num(it, "samples");
        r->pk_n[r->npk] = isfinite(ns) && ns >= 1 ? ns : NAN;
        r->npk++;
    }
    return 0;
}

static int stage_line(const cJSON *o, const char *path, int line, void *ctx) {
    stage_data *d = ctx;
    const double stage = num(o, "stage"), step = num(o, "step"), tokens = num(o, "tokens");
    if (!isfinite(stage) || !isfinite(step) || !isfinite(tokens)) {
        fprintf(stderr, PROG ": %s:%d: a stage record needs numeric stage, step and tokens\n", path,
                line);
        return -1;
    }
    while (d->n > 0 && d->r[d->n - 1].step >= step && d->r[d->n - 1].stage >= (int)stage)
        d->n--; /* a resumed run logging the same transition again */
    if (d->n == d->cap) {
        d->cap = d->cap ? d->cap * 2 : 16;
        d->r = xrealloc(d->r, (size_t)d->cap * sizeof(stage_rec));
    }
    stage_rec *r = &d->r[d->n++];
    r->stage = (int)stage;
    r->step = step;
    r->tokens = tokens;
    r->seq_len = num(o, "seq_len");
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(o, "name");
    if (cJSON_IsString(nm) && nm->valuestring)
        snprintf(r->name, sizeof r->name, "%s", nm->valuestring);
    else
        snprintf(r->name, sizeof r->name, "stage %d", r->stage);
    return 0;
}

/* ---------------------------------------------------------------- writing */

typedef struct {
    const char *dir; /* RUN_DIR/plots */
    const char *term;
    cJSON *plots;
    const stage_data *stages;
    int failed;
} ctx_t;

static FILE *open_out(const ctx_t *c, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", c->dir, name);
    FILE *f = fopen(path, "w");
    if (!f)
        fprintf(stderr, PROG ": cannot write %s: %s\n", path, strerror(errno));
    return f;
}

static int close_out(FILE *f, const ctx_t *c, const char *name) {
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    if (bad)
        fprintf(stderr, PROG ": write to %s/%s failed\n", c->dir, name);
    return bad ? -1 : 0;
}

/* A gnuplot string literal in single quotes (a quote is doubled). */
static void gp_str(FILE *f, const char *s) {
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'')
            fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

static void gp_header(FILE *f, const ctx_t *c, const char *png, const char *title) {
    fprintf(f, "set terminal %s size 1200,700 noenhanced\n", c->term);
    fprintf(f, "set output '%s'\n", png);
    fprintf(f, "set title ");
    gp_str(f, title);
    fprintf(f, "\nset grid\nset key outside right top\n");
}

/* Stage boundaries as dashed vertical lines at x = step or tokens, with labels;
 * records them in `arr`. */
static void gp_stages(FILE *f, const ctx_t *c, int by_tokens, cJSON *arr) {
    for (int i = 0; i < c->stages->n; i++) {
        const stage_rec *s = &c->stages->r[i];
        const double x = by_tokens ? s->tokens : s->step;
        fprintf(f,
                "set arrow %d from first %.17g, graph 0 to first %.17g, graph 1 nohead dt 2 "
                "lw 1.5 lc rgb 'gray30' front\n",
                i + 1, x, x);
        char label[160];
        snprintf(label, sizeof label, "stage %d: %s", s->stage, s->name);
        fprintf(f, "set label %d ", i + 1);
        gp_str(f, label);
        fprintf(f, " at first %.17g, graph 0.03 rotate by 90 left offset character 1,0 front\n", x);
        cJSON *b = cJSON_CreateObject();
        cJSON_AddNumberToObject(b, "stage", s->stage);
        cJSON_AddStringToObject(b, "name", s->name);
        cJSON_AddNumberToObject(b, by_tokens ? "tokens" : "step", x);
        cJSON_AddItemToArray(arr, b);
    }
}

static cJSON *plot_entry(ctx_t *c, const char *name, const char *x) {
    cJSON *p = cJSON_CreateObject();
    char buf[64];
    cJSON_AddStringToObject(p, "name", name);
    snprintf(buf, sizeof buf, "%s.png", name);
    cJSON_AddStringToObject(p, "png", buf);
    snprintf(buf, sizeof buf, "%s.gp", name);
    cJSON_AddStringToObject(p, "script", buf);
    cJSON_AddStringToObject(p, "x", x);
    cJSON_AddArrayToObject(p, "data");
    cJSON_AddArrayToObject(p, "series");
    cJSON_AddArrayToObject(p, "stage_boundaries");
    cJSON_AddItemToArray(c->plots, p);
    return p;
}

static void add_series(cJSON *p, const char *title, const char *file, int64_t points) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "title", title);
    cJSON_AddStringToObject(s, "file", file);
    cJSON_AddNumberToObject(s, "points", (double)points);
    cJSON_AddItemToArray(cJSON_GetObjectItem(p, "series"), s);
}

static void add_data(cJSON *p, const char *file) {
    cJSON_AddItemToArray(cJSON_GetObjectItem(p, "data"), cJSON_CreateString(file));
}

static void skip_plot(cJSON *p, const char *why) {
    cJSON_AddStringToObject(p, "skipped", why);
    fprintf(stderr, PROG ": %s skipped: %s\n", cJSON_GetObjectItem(p, "png")->valuestring, why);
}

static void fmt_num(FILE *f, double v) {
    if (isfinite(v))
        fprintf(f, " %.9g", v);
    else
        fprintf(f, " NaN");
}

static int write_loss(ctx_t *c, const log_data *lg, const eval_data *ev) {
    cJSON *p = plot_entry(c, "loss", "tokens");
    FILE *f = open_out(c, "loss.dat");
    if (!f)
        return -1;
    int64_t nl = 0, nb = 0;
    fprintf(f, "# tokens step loss_nats stage\n");
    for (int64_t i = 0; i < lg->n; i++) {
        fprintf(f, "%.17g %.17g", lg->tokens[i], lg->step[i]);
        fmt_num(f, lg->loss[i]);
        fprintf(f, " %d\n", lg->stage[i]);
        nl += isfinite(lg->loss[i]);
    }
    if (close_out(f, c, "loss.dat"))
        return -1;
    if (!(f = open_out(c, "bpb.dat")))
        return -1;
    fprintf(f, "# tokens step bits_per_byte stage\n");
    for (int64_t i = 0; i < ev->n; i++) {
        if (!isfinite(ev->r[i].bpb))
            continue;
        fprintf(f, "%.17g %.17g %.9g %d\n", isfinite(ev->r[i].tokens) ? ev->r[i].tokens : 0,
                ev->r[i].step, ev->r[i].bpb, ev->r[i].stage);
        nb++;
    }
    if (close_out(f, c, "bpb.dat"))
        return -1;
    add_data(p, "loss.dat");
    add_data(p, "bpb.dat");
    add_series(p, "train loss (nats/token)", "loss.dat", nl);
    add_series(p, "validation bits/byte", "bpb.dat", nb);
    if (nl == 0) {
        fprintf(stderr, PROG ": %s/../log.jsonl has no step record with a numeric loss\n", c->dir);
        return -1;
    }
    if (!(f = open_out(c, "loss.gp")))
        return -1;
    gp_header(f, c, "loss.png", "Training loss and validation bits per byte");
    fprintf(f, "set xlabel 'tokens'\nset format x '%%.1s%%c'\n"
               "set ylabel 'train loss (nats/token)'\nset ytics nomirror\n");
    if (nb)
        fprintf(f, "set y2label 'validation bits/byte'\nset y2tics\n");
    gp_stages(f, c, 1, cJSON_GetObjectItem(p, "stage_boundaries"));
    fprintf(f, "plot 'loss.dat' using 1:3 with lines lw 1.2 lc rgb '#1f77b4' title "
               "'train loss (nats/token)'");
    if (nb)
        fprintf(f, ", \\\n     'bpb.dat' using 1:3 axes x1y2 with linespoints pt 7 ps 1 lw 2 "
                   "lc rgb '#d62728' title 'validation bits/byte'");
    fprintf(f, "\n");
    return close_out(f, c, "loss.gp");
}

static int write_maxvio(ctx_t *c, const log_data *lg) {
    cJSON *p = plot_entry(c, "maxvio", "step");
    if (lg->nl == 0) {
        skip_plot(p, "log.jsonl has no \"moe\" records");
        return 0;
    }
    FILE *f = open_out(c, "maxvio.dat");
    if (!f)
        return -1;
    /* maxvio_batch jumps from batch to batch (one batch's content): the plot draws each
     * layer's trailing moving average over W records (the mean of the finite values
     * among records i-W+1..i), so the layers' trends can be told apart; the raw values
     * stay in the data file. */
    const int64_t W = lg->n / MAXVIO_WINDOW_DIV > 1 ? lg->n / MAXVIO_WINDOW_DIV : 1;
    fprintf(f, "# step, then maxvio_batch of each MoE layer, then its moving average over %lld "
               "records:\n# step",
            (long long)W);
    for (int l = 0; l < lg->nl; l++)
        fprintf(f, " maxvio_batch_layer%d", lg->ml[l].layer);
    for (int l = 0; l < lg->nl; l++)
        fprintf(f, " mean%lld_layer%d", (long long)W, lg->ml[l].layer);
    fprintf(f, "\n");
    const size_t nl = lg->nl > 0 ? (size_t)lg->nl : 1;
    int64_t *pts = calloc(nl, sizeof(int64_t));
    double *wsum = calloc(nl, sizeof(double));
    int64_t *wcnt = calloc(nl, sizeof(int64_t));
    if (!pts || !wsum || !wcnt) {
        fprintf(stderr, PROG ": out of memory\n");
        exit(LM_EXIT_BAD_INPUT);
    }
    for (int64_t i = 0; i < lg->n; i++) {
        fprintf(f, "%.17g", lg->step[i]);
        for (int l = 0; l < lg->nl; l++) {
            const double v = lg->ml[l].maxvio[i];
            fmt_num(f, v);
            pts[l] += isfinite(v);
            if (isfinite(v)) {
                wsum[l] += v;
                wcnt[l]++;
            }
            if (i >= W && isfinite(lg->ml[l].maxvio[i - W])) {
                wsum[l] -= lg->ml[l].maxvio[i - W];
                wcnt[l]--;
            }
        }
        for (int l = 0; l < lg->nl; l++)
            fmt_num(f, wcnt[l] > 0 ? wsum[l] / (double)wcnt[l] : NAN);
        fprintf(f, "\n");
    }
    free(wsum);
    free(wcnt);
    if (close_out(f, c, "maxvio.dat")) {
        free(pts);
        return -1;
    }
    add_data(p, "maxvio.dat");
    int64_t total = 0;
    for (int l = 0; l < lg->nl; l++) {
        char t[64];
        snprintf(t, sizeof t, "layer %d", lg->ml[l].layer);
        add_series(p, t, "maxvio.dat", pts[l]);
        total += pts[l];
    }
    if (total == 0) {
        free(pts);
        skip_plot(p, "no moe record has a numeric maxvio_batch");
        return 0;
    }
    if (!(f = open_out(c, "maxvio.gp"))) {
        free(pts);
        return -1;
    }
    char title[160];
    snprintf(title, sizeof title,
             "MoE balance: maxvio_batch per layer, trailing mean over %lld logged steps",
             (long long)W);
    gp_header(f, c, "maxvio.png", title);
    fprintf(f, "set xlabel 'step'\nset ylabel 'maxvio_batch (max load / mean load - 1)'\n"
               "set yrange [0:*]\n");
    gp_stages(f, c, 0, cJSON_GetObjectItem(p, "stage_boundaries"));
    fprintf(f, "plot ");
    int first = 1;
    for (int l = 0; l < lg->nl; l++) {
        if (!pts[l])
            continue;
        fprintf(f, "%s'maxvio.dat' using 1:%d with lines lw 2.5 lc rgb '%s' title 'layer %d'",
                first ? "" : ", \\\n     ", 2 + lg->nl + l,
                k_colors[l % (int)(sizeof k_colors / sizeof k_colors[0])], lg->ml[l].layer);
        first = 0;
    }
    fprintf(f, "\n");
    free(pts);
    return close_out(f, c, "maxvio.gp");
}

static int write_heat(ctx_t *c, const log_data *lg) {
    cJSON *p = plot_entry(c, "expert_load", "step");
    if (lg->nl == 0 || lg->n == 0) {
        skip_plot(p, "log.jsonl has no \"moe\" records");
        return 0;
    }
    int R = 0;
    for (int l = 0; l < lg->nl; l++)
        R += lg->ml[l].E;
    const int rows = R < 2 ? 2 : R; /* gnuplot images need 2 x 2 */
    /* columns of equal step width over [s0, s1] */
    const double s0 = lg->step[0], s1 = lg->step[lg->n - 1];
    int nb = lg->n < HEAT_COLS ? (int)lg->n : HEAT_COLS;
    if (nb < 2)
        nb = 2;
    double w = (s1 - s0 + 1) / nb;
    if (!(w > 0))
        w = 1;
    double *sum = calloc((size_t)nb * R, sizeof(double));
    int *cnt = calloc((size_t)nb * R, sizeof(int));
    int64_t points = 0;
    for (int64_t i = 0; i < lg->n; i++) {
        int b = (int)floor((lg->step[i] - s0) / w);
        b = b < 0 ? 0 : b >= nb ? nb - 1 : b;
        int r = 0;
        for (int l = 0; l < lg->nl; l++)
            for (int e = 0; e < lg->ml[l].E; e++, r++) {
                const float v = lg->ml[l].load[i * lg->ml[l].E + e];
                if (isfinite(v)) {
                    sum[(int64_t)b * R + r] += v;
                    cnt[(int64_t)b * R + r]++;
                    points++;
                }
            }
    }
    add_data(p, "expert_load.dat");
    add_series(p, "expert load / uniform share", "expert_load.dat", points);
    if (points == 0) {
        free(sum);
        free(cnt);
        skip_plot(p, "no moe record has numeric loads");
        return 0;
    }
    FILE *f = open_out(c, "expert_load.dat");
    if (!f) {
        free(sum);
        free(cnt);
        return -1;
    }
    fprintf(f,
            "# step row load_times_E  (rows: layer-major, expert-minor; %d columns of %.9g "
            "steps)\n",
            nb, w);
    for (int r = 0; r < R; r++) { /* forward-fill empty columns */
        double last = NAN;
        for (int b = 0; b < nb; b++) {
            double *v = &sum[(int64_t)b * R + r];
            if (cnt[(int64_t)b * R + r]) {
                *v /= cnt[(int64_t)b * R + r];
                last = *v;
            } else {
                *v = last;
            }
        }
    }
    for (int b = 0; b < nb; b++) {
        const double x = s0 + (b + 0.5) * w;
        for (int r = 0; r < rows; r++) {
            fprintf(f, "%.17g %d", x, r);
            fmt_num(f, sum[(int64_t)b * R + (r < R ? r : R - 1)]);
            fprintf(f, "\n");
        }
        fprintf(f, "\n");
    }
    free(sum);
    free(cnt);
    if (close_out(f, c, "expert_load.dat"))
        return -1;
    if (!(f = open_out(c, "expert_load.gp")))
        return -1;
    gp_header(f, c, "expert_load.png",
              "Expert load over training (E x load fraction; 1 = uniform)");
    fprintf(f,
            "unset grid\nset xlabel 'step'\nset ylabel 'MoE layer / expert'\n"
            "set cblabel 'load / uniform share (clipped at 2)'\nset cbrange [0:2]\n"
            "set palette defined (0 '#053061', 0.5 '#4393c3', 1 '#f7f7f7', 1.5 '#d6604d', "
            "2 '#67001f')\n"
            "set xrange [%.17g:%.17g]\nset yrange [-0.5:%.1f]\n",
            s0, s0 + nb * w, rows - 0.5);
    fprintf(f, "set ytics (");
    int r = 0;
    for (int l = 0; l < lg->nl; l++) {
        fprintf(f, "%s'layer %d' %.1f", l ? ", " : "", lg->ml[l].layer,
                r + (lg->ml[l].E - 1) / 2.0);
        r += lg->ml[l].E;
    }
    fprintf(f, ")\n");
    r = 0;
    int arrow = 1000;
    for (int l = 0; l + 1 < lg->nl; l++) {
        r += lg->ml[l].E;
        fprintf(f,
                "set arrow %d from graph 0, first %.1f to graph 1, first %.1f nohead lw 2 lc "
                "rgb 'white' front\n",
                arrow++, r - 0.5, r - 0.5);
    }
    gp_stages(f, c, 0, cJSON_GetObjectItem(p, "stage_boundaries"));
    fprintf(f, "plot 'expert_load.dat' using 1:2:3 with image notitle\n");
    return close_out(f, c, "expert_load.gp");
}

/* The Wilson score interval at 95 % (z = 1.959964) of a proportion acc of n samples
 * (Wilson 1927; Brown, Cai & DasGupta 2001 recommend it over the normal interval, which
 * collapses at 0 and 1): [lo, hi]. n not finite: [acc, acc] (no sample count logged). */
static void wilson95(double acc, double n, double *lo, double *hi) {
    if (!isfinite(n) || n < 1) {
        *lo = *hi = acc;
        return;
    }
    const double z = 1.959964, z2 = z * z;
    const double den = 1 + z2 / n, mid = (acc + z2 / (2 * n)) / den;
    const double half = z * sqrt(acc * (1 - acc) / n + z2 / (4 * n * n)) / den;
    *lo = fmax(0.0, mid - half);
    *hi = fmin(1.0, mid + half);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int write_passkey(ctx_t *c, const eval_data *ev) {
    cJSON *p = plot_entry(c, "passkey", "length");
    /* candidates: evals with passkey results; the first, the last of each stage */
    int64_t *sel = calloc((size_t)(ev->n + 1), sizeof(int64_t));
    int ns = 0;
    int64_t first = -1;
    for (int64_t i = 0; i < ev->n; i++) {
        if (ev->r[i].npk == 0)
            continue;
        if (first < 0) {
            first = i;
            sel[ns++] = i;
        }
        int64_t j = i + 1;
        while (j < ev->n && ev->r[j].npk == 0)
            j++;
        const int last_of_stage = j >= ev->n || ev->r[j].stage != ev->r[i].stage;
        if (last_of_stage && i != first)
            sel[ns++] = i;
    }
    if (ns > MAX_PK_SERIES) { /* keep the first and the last MAX-1 */
        memmove(sel + 1, sel + ns - (MAX_PK_SERIES - 1), (MAX_PK_SERIES - 1) * sizeof(int64_t));
        ns = MAX_PK_SERIES;
    }
    if (ns == 0) {
        free(sel);
        skip_plot(p, "evals.jsonl has no passkey results");
        return 0;
    }
    FILE *f = open_out(c, "passkey.dat");
    if (!f) {
        free(sel);
        return -1;
    }
    add_data(p, "passkey.dat");
    /* Points with 95 % intervals at the measured lengths only: no line joins two lengths
     * (nothing was measured between them), and the series of one length sit side by
     * side (x_plot: the length times 2^(0.04 (s - (ns-1)/2)) on the log axis) so their
     * bars do not hide each other. */
    fprintf(f, "# blocks (gnuplot index): one per eval; columns: length accuracy lo95 hi95 "
               "samples x_plot\n"
               "# lo95 / hi95: the Wilson score interval of accuracy = correct / samples at "
               "95 %% (z = 1.96); equal to accuracy when the eval did not log samples\n");
    double lens[64];
    int nlen = 0;
    for (int s = 0; s < ns; s++) {
        const eval_rec *r = &ev->r[sel[s]];
        fprintf(f, "%s# step %.17g stage %d\n", s ? "\n\n" : "", r->step, r->stage);
        const double shift = exp2(0.04 * (s - (ns - 1) / 2.0));
        for (int k = 0; k < r->npk; k++) {
            double lo, hi;
            wilson95(r->pk_acc[k], r->pk_n[k], &lo, &hi);
            fprintf(f, "%.17g %.9g %.9g %.9g %.17g %.9g\n", r->pk_len[k], r->pk_acc[k], lo, hi,
                    r->pk_n[k], r->pk_len[k] * shift);
            int seen = 0;
            for (int j = 0; j < nlen; j++)
                seen |= lens[j] == r->pk_len[k];
            if (!seen && nlen < 64)
                lens[nlen++] = r->pk_len[k];
        }
        char t[96];
        snprintf(t, sizeof t, "step %.0f (stage %d)", r->step, r->stage);
        add_series(p, t, "passkey.dat", r->npk);
    }
    if (close_out(f, c, "passkey.dat")) {
        free(sel);
        return -1;
    }
    if (!(f = open_out(c, "passkey.gp"))) {
        free(sel);
        return -1;
    }
    qsort(lens, (size_t)nlen, sizeof lens[0], cmp_double);
    gp_header(f, c, "passkey.png",
              "Passkey retrieval accuracy by document length (95 % Wilson intervals)");
    fprintf(f, "set xlabel 'document length (tokens)'\nset ylabel 'accuracy'\n"
               "set yrange [0:1.05]\nset logscale x 2\nset offsets graph 0.08, graph 0.08, 0, 0\n"
               "set xtics (");
    for (int j = 0; j < nlen; j++)
        fprintf(f, "%s%.17g", j ? ", " : "", lens[j]);
    fprintf(f, ")\n");
    fprintf(f, "plot ");
    for (int s = 0; s < ns; s++) {
        const eval_rec *r = &ev->r[sel[s]];
        fprintf(f,
                "%s'passkey.dat' index %d using 6:2:3:4 with yerrorbars pt 7 ps 1.3 lw 1.5 "
                "title 'step %.0f (stage %d)'",
                s ? ", \\\n     " : "", s, r->step, r->stage);
    }
    fprintf(f, "\n");
    free(sel);
    return close_out(f, c, "passkey.gp");
}

/* ---------------------------------------------------------------- gnuplot */

/* Single-quoted for /bin/sh. */
static void sh_quote(char *out, size_t size, const char *s) {
    size_t n = 0;
    if (n + 1 < size)
        out[n++] = '\'';
    for (; *s && n + 5 < size; s++) {
        if (*s == '\'') {
            memcpy(out + n, "'\\''", 4);
            n += 4;
        } else {
            out[n++] = *s;
        }
    }
    if (n + 1 < size)
        out[n++] = '\'';
    out[n] = '\0';
}

/* Run a shell command, capturing its output; returns the exit status (-1: not run). */
static int run_cmd(const char *cmd, char *out, size_t out_size) {
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = 0, got;
    char buf[1024];
    if (out_size)
        out[0] = '\0';
    while ((got = fread(buf, 1, sizeof buf, p)) > 0)
        if (out_size && n + 1 < out_size) {
            size_t k = got < out_size - 1 - n ? got : out_size - 1 - n;
            memcpy(out + n, buf, k);
            n += k;
            out[n] = '\0';
        }
    int st = pclose(p);
    return st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int run_gnuplot(const ctx_t *c, const char *name) {
    char qdir[8192], cmd[8400], out[4096];
    sh_quote(qdir, sizeof qdir, c->dir);
    snprintf(cmd, sizeof cmd, "cd %s && gnuplot %s.gp 2>&1", qdir, name);
    int rc = run_cmd(cmd, out, sizeof out);
    char png[4096];
    snprintf(png, sizeof png, "%s/%s.png", c->dir, name);
    struct stat st;
    if (rc != 0 || stat(png, &st) != 0 || st.st_size == 0) {
        fprintf(stderr, PROG ": gnuplot failed on %s/%s.gp (exit %d):\n%s\n", c->dir, name, rc,
                out);
        return -1;
    }
    if (out[0])
        fprintf(stderr, PROG ": gnuplot said about %s.gp:\n%s", name, out);
    return 0;
}

int lm_cli_plot(int argc, char **argv) {
    const char *run = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_plot_usage(stdout);
            return LM_EXIT_OK;
        }
    }
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, PROG ": unknown option '%s' (see `linmoe plot --help`)\n", argv[i]);
            return LM_EXIT_USAGE;
        }
        if (run) {
            fprintf(stderr, PROG ": unexpected argument '%s' (see `linmoe plot --help`)\n",
                    argv[i]);
            return LM_EXIT_USAGE;
        }
        run = argv[i];
    }
    if (!run) {
        fprintf(stderr, PROG ": RUN_DIR is required (see `linmoe plot --help`)\n");
        return LM_EXIT_USAGE;
    }
    if (strlen(run) > 2000) {
        fprintf(stderr, PROG ": RUN_DIR path is too long\n");
        return LM_EXIT_USAGE;
    }
    struct stat st;
    if (stat(run, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, PROG ": run directory %s does not exist\n", run);
        return LM_EXIT_BAD_INPUT;
    }
    char path_log[2100], path_ev[2100], path_st[2100], dir[2100];
    snprintf(path_log, sizeof path_log, "%s/log.jsonl", run);
    snprintf(path_ev, sizeof path_ev, "%s/evals.jsonl", run);
    snprintf(path_st, sizeof path_st, "%s/stages.jsonl", run);
    snprintf(dir, sizeof dir, "%s/plots", run);
    const char *need[3] = {path_log, path_ev, path_st};
    int missing = 0;
    for (int i = 0; i < 3; i++)
        if (access(need[i], R_OK) != 0) {
            fprintf(stderr, PROG ": missing %s (%s)\n", need[i], strerror(errno));
            missing = 1;
        }
    if (missing)
        return LM_EXIT_BAD_INPUT;
    char tmp[256];
    if (run_cmd("command -v gnuplot 2>&1", tmp, sizeof tmp) != 0) {
        fprintf(stderr, PROG ": gnuplot is not installed (not on PATH); install it with "
                             "scripts/install-deps.sh\n");
        return LM_EXIT_BAD_INPUT;
    }
    const char *term =
        run_cmd("gnuplot -e 'set terminal pngcairo' 2>&1", tmp, sizeof tmp) == 0 && !tmp[0]
            ? "pngcairo"
            : "png";

    log_data lg = {0};
    eval_data ev = {0};
    stage_data sg = {0};
    int rc = LM_EXIT_BAD_INPUT;
    cJSON *sum = NULL;
    if (for_each_line(path_log, log_line, &lg) || for_each_line(path_ev, eval_line, &ev) ||
        for_each_line(path_st, stage_line, &sg))
        goto done;
    if (lg.n == 0) {
        fprintf(stderr, PROG ": %s holds no step records\n", path_log);
        goto done;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, PROG ": cannot create %s: %s\n", dir, strerror(errno));
        goto done;
    }
    sum = cJSON_CreateObject();
    cJSON_AddStringToObject(sum, "run_dir", run);
    cJSON_AddStringToObject(sum, "terminal", term);
    cJSON_AddNumberToObject(sum, "log_records", (double)lg.n);
    cJSON_AddNumberToObject(sum, "eval_records", (double)ev.n);
    cJSON *sb = cJSON_AddArrayToObject(sum, "stage_boundaries");
    for (int i = 0; i < sg.n; i++) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddNumberToObject(b, "stage", sg.r[i].stage);
        cJSON_AddStringToObject(b, "name", sg.r[i].name);
        cJSON_AddNumberToObject(b, "step", sg.r[i].step);
        cJSON_AddNumberToObject(b, "tokens", sg.r[i].tokens);
        if (isfinite(sg.r[i].seq_len))
            cJSON_AddNumberToObject(b, "seq_len", sg.r[i].seq_len);
        cJSON_AddItemToArray(sb, b);
    }
    ctx_t c = {dir, term, cJSON_AddArrayToObject(sum, "plots"), &sg, 0};
    if (write_loss(&c, &lg, &ev) || write_maxvio(&c, &lg) || write_heat(&c, &lg) ||
        write_passkey(&c, &ev))
        goto done;
    const cJSON *pl;
    cJSON_ArrayForEach(pl, c.plots) {
        if (cJSON_GetObjectItem(pl, "skipped"))
            continue;
        if (run_gnuplot(&c, cJSON_GetObjectItem(pl, "name")->valuestring))
            goto done;
    }
    char *text = cJSON_Print(sum);
    FILE *f = text ? open_out(&c, "summary.json") : NULL;
    if (!f) {
        free(text);
        goto done;
    }
    fputs(text, f);
    fputc('\n', f);
    free(text);
    if (close_out(f, &c, "summary.json"))
        goto done;
    cJSON_ArrayForEach(pl, c.plots) {
        if (cJSON_GetObjectItem(pl, "skipped"))
            continue;
        printf("%s/%s\n", dir, cJSON_GetObjectItem(pl, "png")->valuestring);
    }
    printf("%s/summary.json\n", dir);
    rc = LM_EXIT_OK;
done:
    cJSON_Delete(sum);
    log_free(&lg);
    evals_free(&ev);
    free(sg.r);
    return rc;
}
