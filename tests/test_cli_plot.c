/* `linmoe plot RUN_DIR` end to end on a synthetic run (two stages, two MoE layers of
 * 4 experts, evals with bits/byte and passkey results, a resumed stretch that
 * re-logs steps, one skipped step with a null loss):
 *  - exit 0, the four PNGs exist and are PNG files;
 *  - summary.json: every plot drawn, every series non-empty with the expected point
 *    counts (the resumed steps counted once, the null loss left out), the stage
 *    boundaries drawn with the values of stages.jsonl, and the gnuplot scripts mark
 *    them (an arrow and a label per boundary);
 *  - a dense run (no "moe") skips the two MoE plots and says so;
 *  - bad input: missing files named, a malformed line named by file:line, a missing
 *    run directory, usage errors.
 * Skipped (with a message) only when gnuplot is not installed.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "cli_util.h"
#include "test_util.h"

#define STEPS 120
#define SWITCH 80 /* first step of stage 1 */

static int have_gnuplot(void) { return system("command -v gnuplot >/dev/null 2>&1") == 0; }

static void rm_tree(const char *p) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
    assert_int_equal(system(cmd), 0);
}

/* tokens after step s: 512 per step in stage 0, 2048 per step in stage 1 */
static double tokens_at(int s) {
    return s < SWITCH ? s * 512.0 : (SWITCH - 1) * 512.0 + (s - SWITCH + 1) * 2048.0;
}

static void write_log_line(FILE *f, int s, int moe, int null_loss) {
    fprintf(f, "{\"step\": %d, \"tokens\": %.0f, \"stage\": %d, ", s, tokens_at(s), s >= SWITCH);
    if (null_loss)
        fprintf(f, "\"loss\": null, ");
    else
        fprintf(f, "\"loss\": %.6f, ", 5.5 * exp(-s / 40.0) + 1.2);
    fprintf(f, "\"lr\": 0.001, \"grad_norm\": 0.8, \"tok_per_s\": 4000");
    if (moe) {
        fprintf(f, ", \"moe\": [");
        for (int l = 0; l < 2; l++) {
            double w[4], sum = 0, mx = 0;
            for (int e = 0; e < 4; e++)
                sum += w[e] = 1 + 0.5 * sin(0.1 * s + e + 3 * l);
            for (int e = 0; e < 4; e++)
                mx = w[e] / sum > mx ? w[e] / sum : mx;
            fprintf(
                f, "%s{\"layer\": %d, \"maxvio_batch\": %.6f, \"load\": [%.6f, %.6f, %.6f, %.6f]}",
                l ? ", " : "", l + 1, mx * 4 - 1, w[0] / sum, w[1] / sum, w[2] / sum, w[3] / sum);
        }
        fprintf(f, "]");
    }
    fprintf(f, "}\n");
}

/* A run directory; returns the number of eval records. */
static int make_run(const char *dir, int moe) {
    rm_tree(dir);
    assert_int_equal(mkdir(dir, 0755), 0);
    char p[600];
    snprintf(p, sizeof p, "%s/log.jsonl", dir);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    for (int s = 1; s <= 70; s++)
        write_log_line(f, s, moe, s == 50);
    /* resumed from a checkpoint at step 60: steps 61.. logged again */
    for (int s = 61; s <= STEPS; s++)
        write_log_line(f, s, moe, 0);
    fclose(f);
    snprintf(p, sizeof p, "%s/evals.jsonl", dir);
    f = fopen(p, "w");
    assert_non_null(f);
    int n = 0;
    for (int s = 20; s <= STEPS; s += 20, n++)
        fprintf(f,
                "{\"step\": %d, \"tokens\": %.0f, \"stage\": %d, \"bits_per_byte\": %.4f, "
                "\"passkey\": [{\"length\": 256, \"samples\": 200, \"accuracy\": %.3f}, "
                "{\"length\": 1024, \"samples\": 200, \"accuracy\": %.3f}]}\n",
                s, tokens_at(s), s >= SWITCH, 3.5 - s / 100.0, s / 120.0, s >= SWITCH ? 0.9 : 0.1);
    fclose(f);
    snprintf(p, sizeof p, "%s/stages.jsonl", dir);
    f = fopen(p, "w");
    assert_non_null(f);
    fprintf(f,
            "{\"stage\": 0, \"name\": \"short\", \"step\": 0, \"tokens\": 0, \"seq_len\": 256}\n");
    fprintf(
        f,
        "{\"stage\": 1, \"name\": \"long\", \"step\": %d, \"tokens\": %.0f, \"seq_len\": 1024}\n",
        SWITCH, tokens_at(SWITCH));
    fclose(f);
    return n;
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    size_t got = fread(b, 1, (size_t)n, f);
    b[got] = '\0';
    fclose(f);
    return b;
}

static void check_png(const char *dir, const char *name) {
    char p[600];
    snprintf(p, sizeof p, "%s/plots/%s", dir, name);
    FILE *f = fopen(p, "rb");
    if (!f)
        print_message("missing %s\n", p);
    assert_non_null(f);
    unsigned char h[8] = {0};
    assert_int_equal(fread(h, 1, 8, f), 8);
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fclose(f);
    assert_memory_equal(h, "\x89PNG\r\n\x1a\n", 8);
    assert_true(size > 2000);
}

static const cJSON *find_plot(const cJSON *sum, const char *name) {
    const cJSON *p;
    cJSON_ArrayForEach(p, cJSON_GetObjectItem(sum, "plots")) {
        if (strcmp(cJSON_GetObjectItem(p, "name")->valuestring, name) == 0)
            return p;
    }
    fail_msg("plot %s not in summary.json", name);
    return NULL;
}

static double series_points(const cJSON *plot, int i) {
    return cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(plot, "series"), i), "points")
        ->valuedouble;
}

/* The script draws an arrow and a label at every boundary value. */
static void check_marked(const char *dir, const char *script, const cJSON *plot, const char *key) {
    char p[600];
    snprintf(p, sizeof p, "%s/plots/%s", dir, script);
    char *gp = slurp(p);
    assert_non_null(gp);
    const cJSON *b;
    int n = 0;
    cJSON_ArrayForEach(b, cJSON_GetObjectItem(plot, "stage_boundaries")) {
        char want[128];
        snprintf(want, sizeof want, "from first %.17g, graph 0",
                 cJSON_GetObjectItem(b, key)->valuedouble);
        if (!strstr(gp, want))
            print_message("%s lacks '%s':\n%s\n", script, want, gp);
        assert_non_null(strstr(gp, want));
        char label[128];
        snprintf(label, sizeof label, "'stage %d: %s'",
                 (int)cJSON_GetObjectItem(b, "stage")->valuedouble,
                 cJSON_GetObjectItem(b, "name")->valuestring);
        assert_non_null(strstr(gp, label));
        n++;
    }
    assert_int_equal(n, 2);
    free(gp);
}

/* passkey (issue 25): points with 95 % Wilson intervals at the measured lengths only, no
 * line through the lengths between them. The last series is step 120: 0.9 of 200 at
 * 1024 tokens, whose Wilson interval is [0.85059, 0.93433] (z = 1.96; Brown, Cai &
 * DasGupta 2001, eq. 4), 1.0 at 256 gives [0.98115, 1]. */
static void check_passkey_bars(const char *dir) {
    char p[600];
    snprintf(p, sizeof p, "%s/plots/passkey.gp", dir);
    char *gp = slurp(p);
    assert_non_null(gp);
    assert_null(strstr(gp, "lines"));
    assert_non_null(strstr(gp, "with yerrorbars"));
    assert_non_null(strstr(gp, "set xtics (256, 1024)\n"));
    free(gp);
    snprintf(p, sizeof p, "%s/plots/passkey.dat", dir);
    char *dat = slurp(p);
    assert_non_null(dat);
    char *last = strstr(dat, "# step 120 ");
    assert_non_null(last);
    double len[2], acc[2], lo[2], hi[2], n[2], x[2];
    char *row = strchr(last, '\n') + 1;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(sscanf(row, "%lf %lf %lf %lf %lf %lf", &len[k], &acc[k], &lo[k], &hi[k],
                                &n[k], &x[k]),
                         6);
        row = strchr(row, '\n') + 1;
        assert_true(n[k] == 200);
        assert_true(x[k] > len[k] && x[k] < len[k] * 1.1); /* the last series: shifted right */
    }
    assert_true(len[0] == 256 && acc[0] == 1.0);
    assert_true(fabs(lo[0] - 0.98115) < 1e-4 && fabs(hi[0] - 1.0) < 1e-6);
    assert_true(len[1] == 1024 && acc[1] == 0.9);
    assert_true(fabs(lo[1] - 0.85059) < 1e-4 && fabs(hi[1] - 0.93433) < 1e-4);
    free(dat);
}

/* maxvio (issue 25): each layer's moving average over W = 120 / 50 = 2 records is drawn
 * (the columns after the raw ones), and each value is the mean of the raw values of its
 * record and the one before. */
static void check_maxvio_smoothed(const char *dir) {
    char p[600];
    snprintf(p, sizeof p, "%s/plots/maxvio.gp", dir);
    char *gp = slurp(p);
    assert_non_null(gp);
    assert_non_null(strstr(gp, "trailing mean over 2 logged steps"));
    assert_non_null(strstr(gp, "using 1:4 with lines"));
    assert_non_null(strstr(gp, "using 1:5 with lines"));
    assert_null(strstr(gp, "using 1:2 "));
    free(gp);
    snprintf(p, sizeof p, "%s/plots/maxvio.dat", dir);
    char *dat = slurp(p);
    assert_non_null(dat);
    double prev[2] = {NAN, NAN};
    int rows = 0;
    for (char *line = strtok(dat, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#')
            continue;
        double step, v[2], m[2];
        assert_int_equal(sscanf(line, "%lf %lf %lf %lf %lf", &step, &v[0], &v[1], &m[0], &m[1]), 5);
        for (int l = 0; l < 2; l++) {
            const double want = rows == 0 ? v[l] : (v[l] + prev[l]) / 2;
            assert_true(fabs(m[l] - want) < 1e-6);
            prev[l] = v[l];
        }
        rows++;
    }
    assert_int_equal(rows, STEPS);
    free(dat);
}

static void test_plot_run(void **state) {
    (void)state;
    if (!have_gnuplot()) {
        print_message("SKIP: gnuplot is not installed (scripts/install-deps.sh installs it)\n");
        skip();
    }
    const char *dir = lm_cli_path("run");
    const int n_evals = make_run(dir, 1);
    char out[16384];
    int rc = lm_run_cli(out, sizeof out, "plot '%s'", dir);
    if (rc != 0)
        print_message("%s\n", out);
    assert_int_equal(rc, 0);
    check_png(dir, "loss.png");
    check_png(dir, "maxvio.png");
    check_png(dir, "expert_load.png");
    check_png(dir, "passkey.png");
    char p[600];
    snprintf(p, sizeof p, "%s/plots/summary.json", dir);
    char *text = slurp(p);
    assert_non_null(text);
    cJSON *sum = cJSON_Parse(text);
    free(text);
    assert_non_null(sum);
    assert_int_equal((int)cJSON_GetObjectItem(sum, "log_records")->valuedouble, STEPS);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(sum, "plots")), 4);
    const cJSON *pl;
    cJSON_ArrayForEach(pl, cJSON_GetObjectItem(sum, "plots")) {
        assert_null(cJSON_GetObjectItem(pl, "skipped"));
        const cJSON *s;
        int ns = 0;
        cJSON_ArrayForEach(s, cJSON_GetObjectItem(pl, "series")) {
            assert_true(cJSON_GetObjectItem(s, "points")->valuedouble > 0);
            ns++;
        }
        assert_true(ns > 0);
        assert_true(cJSON_GetArraySize(cJSON_GetObjectItem(pl, "data")) > 0);
    }
    const cJSON *loss = find_plot(sum, "loss");
    assert_int_equal((int)series_points(loss, 0), STEPS - 1); /* step 50's loss is null */
    assert_int_equal((int)series_points(loss, 1), n_evals);
    const cJSON *b1 = cJSON_GetArrayItem(cJSON_GetObjectItem(loss, "stage_boundaries"), 1);
    assert_int_equal((int)cJSON_GetObjectItem(b1, "stage")->valuedouble, 1);
    assert_true(cJSON_GetObjectItem(b1, "tokens")->valuedouble == tokens_at(SWITCH));
    check_marked(dir, "loss.gp", loss, "tokens");
    const cJSON *mv = find_plot(sum, "maxvio");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(mv, "series")), 2);
    assert_int_equal((int)series_points(mv, 0), STEPS);
    assert_int_equal((int)series_points(mv, 1), STEPS);
    check_marked(dir, "maxvio.gp", mv, "step");
    const cJSON *hm = find_plot(sum, "expert_load");
    assert_int_equal((int)series_points(hm, 0), STEPS * 8);
    check_marked(dir, "expert_load.gp", hm, "step");
    /* passkey: the first eval, the last of stage 0, the last of stage 1 */
    const cJSON *pk = find_plot(sum, "passkey");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(pk, "series")), 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal((int)series_points(pk, i), 2);
    check_passkey_bars(dir);
    check_maxvio_smoothed(dir);
    /* the loss data file: one row per step, steps increasing */
    snprintf(p, sizeof p, "%s/plots/loss.dat", dir);
    char *dat = slurp(p);
    assert_non_null(dat);
    int rows = 0;
    double last = 0;
    for (char *line = strtok(dat, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#')
            continue;
        double tok, step;
        assert_int_equal(sscanf(line, "%lf %lf", &tok, &step), 2);
        assert_true(step > last);
        last = step;
        rows++;
    }
    free(dat);
    assert_int_equal(rows, STEPS);
    cJSON_Delete(sum);

    /* dense run: the MoE plots are skipped and say why */
    const char *dense = lm_cli_path("run_dense");
    make_run(dense, 0);
    rc = lm_run_cli(out, sizeof out, "plot '%s'", dense);
    assert_int_equal(rc, 0);
    lm_assert_says(out, "skipped");
    snprintf(p, sizeof p, "%s/plots/summary.json", dense);
    text = slurp(p);
    sum = cJSON_Parse(text);
    free(text);
    assert_non_null(sum);
    assert_non_null(cJSON_GetObjectItem(find_plot(sum, "maxvio"), "skipped"));
    assert_non_null(cJSON_GetObjectItem(find_plot(sum, "expert_load"), "skipped"));
    assert_null(cJSON_GetObjectItem(find_plot(sum, "loss"), "skipped"));
    cJSON_Delete(sum);
    check_png(dense, "loss.png");
    rm_tree(dir);
    rm_tree(dense);
}

static void test_plot_bad_input(void **state) {
    (void)state;
    if (!have_gnuplot()) {
        print_message("SKIP: gnuplot is not installed (scripts/install-deps.sh installs it)\n");
        skip();
    }
    char out[8192], p[600];
    const char *dir = lm_cli_path("run_bad");
    /* missing evals.jsonl and stages.jsonl: both named */
    make_run(dir, 1);
    snprintf(p, sizeof p, "%s/evals.jsonl", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/stages.jsonl", dir);
    unlink(p);
    int rc = lm_run_cli(out, sizeof out, "plot '%s'", dir);
    assert_int_equal(rc, 1);
    lm_assert_says(out, "evals.jsonl");
    lm_assert_says(out, "stages.jsonl");
    /* a malformed line */
    make_run(dir, 1);
    snprintf(p, sizeof p, "%s/log.jsonl", dir);
    FILE *f = fopen(p, "a");
    fprintf(f, "{\"step\": 200, \"tokens\": \n");
    fclose(f);
    rc = lm_run_cli(out, sizeof out, "plot '%s'", dir);
    assert_int_equal(rc, 1);
    char want[64];
    snprintf(want, sizeof want, "log.jsonl:%d", 70 + (STEPS - 60) + 1);
    lm_assert_says(out, want);
    /* a log with no step records */
    snprintf(p, sizeof p, "%s/log.jsonl", dir);
    f = fopen(p, "w");
    fprintf(f, "{\"event\": \"start\"}\n");
    fclose(f);
    rc = lm_run_cli(out, sizeof out, "plot '%s'", dir);
    assert_int_equal(rc, 1);
    lm_assert_says(out, "no step records");
    rm_tree(dir);
    rc = lm_run_cli(out, sizeof out, "plot '%s'", dir);
    assert_int_equal(rc, 1);
    lm_assert_says(out, "does not exist");
    rc = lm_run_cli(out, sizeof out, "plot");
    assert_int_equal(rc, 2);
    rc = lm_run_cli(out, sizeof out, "plot a b");
    assert_int_equal(rc, 2);
    rc = lm_run_cli(out, sizeof out, "plot --bogus x");
    assert_int_equal(rc, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plot_run),
        cmocka_unit_test(test_plot_bad_input),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
