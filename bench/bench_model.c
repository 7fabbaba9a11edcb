/* `linmoe bench model`: one full training step of a model config on the CPU, against
 * the machine's limit and against the PyTorch reference step.
 *
 * The step: lm_model_forward with next-token labels (training = 1, no logits
 * written: the cross-entropy is fused) + lm_model_backward (loss_scale 1, gradients
 * overwritten), at B x T = the config's batch_size x seq_len (configs/bench-cpu.json:
 * 8 x 512), random ids ~ U[0, V) (seeded), labels[b, t] = ids[b, t+1] and
 * LM_MODEL_IGNORE at the last position of each row, parameters from
 * lm_params_init_weights(config seed). One warmup step, then the median of 3 steps
 * (--quick: 2); the forward and the backward are timed separately too (their own
 * medians, printed as the per-phase split).
 *
 * FLOPs = lm_model_train_flops_per_token(cfg, T) * B*T (model.h: 6 x matmul
 * parameters touched per token + the KDA op + causal attention), so GFLOP/s is
 * "useful work per second". The limit is OpenBLAS sgemm 2048^3 on the same threads,
 * measured in the same run (bench.h lm_bench_sgemm_limit).
 *
 * The peer: unless --no-peer, the first of `python3`, `/usr/bin/python3` that can
 * `import torch` runs scripts/reference/bench_step.py --config CFG --threads N
 * --warmup 2 --iters 3 (--quick: 2) after linmoe's steps (one at a time: the two never
 * share the cores), with OMP_NUM_THREADS=N; the LAST stdout line is one JSON object
 * {"peer", "threads", "B", "T", "step_s_median", "step_s"}. ratio_to_peer = peer step
 * time / linmoe step time (> 1: linmoe is faster). When there is no torch, the script
 * is missing, fails, times out (30 min) or reports another shape or thread count, the
 * bench prints "peer: unavailable (reason)" and the ratio stays null: never an error.
 *
 * Paths: the default config (configs/bench-cpu.json) and the script are looked up in
 * the working directory and its ancestors, then beside the binary and its ancestors,
 * so the bench runs from the repository root and from a build directory inside it.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "linmoe/core.h"
#include "linmoe/model.h"
#include "linmoe/model_config.h"
#include "linmoe/params.h"

#define DEFAULT_CONFIG "configs/bench-cpu.json"
#define PEER_SCRIPT "scripts/reference/bench_step.py"
#define PEER_TIMEOUT_S 1800
#define PATH_CAP 4096

/* ---------------------------------------------------------------- locating files */

/* `rel` under `dir` or one of its ancestors: 0 and the path in out, or -1. */
static int find_up_from(const char *start, const char *rel, char *out, size_t size) {
    char dir[PATH_CAP];
    snprintf(dir, sizeof(dir), "%s", start);
    for (int depth = 0; depth < 64; depth++) {
        int n = snprintf(out, size, "%s/%s", strcmp(dir, "/") == 0 ? "" : dir, rel);
        if (n > 0 && (size_t)n < size && access(out, R_OK) == 0) return 0;
        char *slash = strrchr(dir, '/');
        if (!slash || strcmp(dir, "/") == 0) break;
        if (slash == dir) dir[1] = '\0';
        else *slash = '\0';
    }
    return -1;
}

/* `rel` from the working directory upward, then from the binary's directory upward. */
static int find_file(const char *rel, char *out, size_t size) {
    char dir[PATH_CAP];
    if (getcwd(dir, sizeof(dir)) && find_up_from(dir, rel, out, size) == 0) return 0;
    ssize_t n = readlink("/proc/self/exe", dir, sizeof(dir) - 1);
    if (n > 0) {
        dir[n] = '\0';
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir) {
            *slash = '\0';
            if (find_up_from(dir, rel, out, size) == 0) return 0;
        }
    }
    return -1;
}

/* ---------------------------------------------------------------- the step */

typedef struct {
    lm_model *m;
    lm_model_batch batch;
    const int32_t *ids, *labels;
    double loss;
    int64_t n_labels;
    double fwd_ms, bwd_ms; /* of the last call */
    lm_error err;
} step_ctx;

static int step_run(void *ctx) {
    step_ctx *s = (step_ctx *)ctx;
    const double t0 = lm_time_sec();
    if (lm_model_forward(s->m, &s->batch, s->ids, s->labels, 1, NULL, &s->loss, &s->n_labels,
                         &s->err) != LM_OK)
        return -1;
    const double t1 = lm_time_sec();
    if (lm_model_backward(s->m, 1.0f, 0, &s->err) != LM_OK) return -1;
    const double t2 = lm_time_sec();
    s->fwd_ms = (t1 - t0) * 1e3;
    s->bwd_ms = (t2 - t1) * 1e3;
    return 0;
}

static int64_t count_nonfinite(const float *x, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !isfinite(x[i]);
    return bad;
}

/* ---------------------------------------------------------------- the peer */

typedef struct {
    int ok;
    char why[512];  /* when !ok */
    char name[128]; /* "pytorch <ver>" */
    double step_s;  /* median */
} peer_result;

static int shell_safe(const char *s) { return strchr(s, '\'') == NULL; }

/* `path` made absolute against the working directory: 0, or -1 when it does not fit. */
static int absolute(const char *path, char *out, size_t size) {
    if (path[0] == '/') {
        int n = snprintf(out, size, "%s", path);
        return n > 0 && (size_t)n < size ? 0 : -1;
    }
    char cwd[PATH_CAP];
    if (!getcwd(cwd, sizeof(cwd))) return -1;
    int n = snprintf(out, size, "%s/%s", cwd, path);
    return n > 0 && (size_t)n < size ? 0 : -1;
}

/* The first Python that can import torch, or NULL. */
static const char *pick_python(void) {
    static const char *const cands[] = {"python3", "/usr/bin/python3"};
    for (size_t i = 0; i < sizeof(cands) / sizeof(cands[0]); i++) {
        char cmd[256];
        snprintf(cmd, sizeof(cmd), "%s -c 'import torch' >/dev/null 2>&1", cands[i]);
        int st = system(cmd);
        if (st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) return cands[i];
    }
    return NULL;
}

/* Last non-empty line of text (modified in place), or NULL. */
static char *last_line(char *text) {
    size_t n = strlen(text);
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' '))
        text[--n] = '\0';
    if (n == 0) return NULL;
    char *nl = strrchr(text, '\n');
    return nl ? nl + 1 : text;
}

/* Read a whole stream (NUL-terminated, malloc'd), or NULL when out of memory. */
static char *read_all(FILE *f) {
    size_t cap = 4096, len = 0;
    char *buf = (char *)malloc(cap);
    if (!buf) return NULL;
    size_t got;
    while ((got = fread(buf + len, 1, cap - 1 - len, f)) > 0) {
        len += got;
        if (cap - 1 - len == 0) {
            char *nb = (char *)realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    buf[len] = '\0';
    return buf;
}

/* Print the peer's stderr (its per-step lines), indented; keep its last line as a
 * reason in case of failure. */
static void relay_stderr(const char *path, char *last, size_t last_size) {
    last[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof(line), f)) {
        size_t n = strlen(line);
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
        if (n == 0) continue;
        printf("  peer| %s\n", line);
        /* the reason is cut to the caller's buffer on purpose (a line can be longer) */
        if (last_size > 0) {
            const size_t k = n < last_size - 1 ? n : last_size - 1;
            memcpy(last, line, k);
            last[k] = '\0';
        }
    }
    fclose(f);
}

static void run_peer(const char *cfg_path, int threads, int B, int T, int iters, peer_result *r) {
    memset(r, 0, sizeof(*r));
    char script[PATH_CAP], script_abs[PATH_CAP], cfg_abs[PATH_CAP];
    if (find_file(PEER_SCRIPT, script, sizeof(script)) != 0) {
        snprintf(r->why, sizeof(r->why), "%s not found above the working directory or the binary",
                 PEER_SCRIPT);
        return;
    }
    if (absolute(script, script_abs, sizeof(script_abs)) != 0 ||
        absolute(cfg_path, cfg_abs, sizeof(cfg_abs)) != 0) {
        snprintf(r->why, sizeof(r->why), "cannot make the paths of the script and the config absolute");
        return;
    }
    if (!shell_safe(script_abs) || !shell_safe(cfg_abs)) {
        snprintf(r->why, sizeof(r->why), "a path contains a single quote");
        return;
    }
    const char *py = pick_python();
    if (!py) {
        snprintf(r->why, sizeof(r->why), "no Python with torch (tried python3, /usr/bin/python3)");
        return;
    }
    char errpath[] = "/tmp/linmoe-bench-peer-XXXXXX";
    int fd = mkstemp(errpath);
    if (fd < 0) {
        snprintf(r->why, sizeof(r->why), "cannot create a temporary file for its stderr");
        return;
    }
    close(fd);
    const int have_timeout = access("/usr/bin/timeout", X_OK) == 0;
    char tprefix[64] = "";
    if (have_timeout) snprintf(tprefix, sizeof(tprefix), "/usr/bin/timeout %d ", PEER_TIMEOUT_S);
    char cmd[3 * PATH_CAP + 256];
    snprintf(cmd, sizeof(cmd),
             "OMP_NUM_THREADS=%d %s'%s' '%s' --config '%s' --threads %d --warmup 2 --iters %d "
             "2>'%s'",
             threads, tprefix, py, script_abs, cfg_abs, threads, iters, errpath);
    /* let OpenBLAS's and OpenMP's spinning workers go to sleep before the peer runs */
    struct timespec nap = {0, 300000000L};
    nanosleep(&nap, NULL);
    printf("peer: %s %s --config %s --threads %d --warmup 2 --iters %d\n", py, PEER_SCRIPT,
           cfg_abs, threads, iters);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    if (!p) {
        snprintf(r->why, sizeof(r->why), "popen failed");
        remove(errpath);
        return;
    }
    char *out = read_all(p);
    const int st = pclose(p);
    char errlast[400];
    relay_stderr(errpath, errlast, sizeof(errlast));
    remove(errpath);
    if (!out) {
        snprintf(r->why, sizeof(r->why), "out of memory reading its output");
        return;
    }
    const int code = (st != -1 && WIFEXITED(st)) ? WEXITSTATUS(st) : -1;
    if (code != 0) {
        if (code == 3)
            snprintf(r->why, sizeof(r->why), "%s cannot import torch: %s", py, errlast);
        else if (st != -1 && WIFSIGNALED(st))
            snprintf(r->why, sizeof(r->why), "%s killed by signal %d", PEER_SCRIPT, WTERMSIG(st));
        else if (code == 124 && have_timeout)
            snprintf(r->why, sizeof(r->why), "timed out after %d s", PEER_TIMEOUT_S);
        else
            snprintf(r->why, sizeof(r->why), "%s exited with status %d%s%s", PEER_SCRIPT, code,
                     errlast[0] ? ": " : "", errlast);
        free(out);
        return;
    }
    char *line = last_line(out);
    cJSON *j = line ? cJSON_Parse(line) : NULL;
    if (!j) {
        snprintf(r->why, sizeof(r->why), "its last stdout line is not a JSON object");
        free(out);
        return;
    }
    const cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "peer");
    const cJSON *jt = cJSON_GetObjectItemCaseSensitive(j, "threads");
    const cJSON *jb = cJSON_GetObjectItemCaseSensitive(j, "B");
    const cJSON *jT = cJSON_GetObjectItemCaseSensitive(j, "T");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(j, "step_s_median");
    if (!cJSON_IsNumber(js) || !(js->valuedouble > 0) || !isfinite(js->valuedouble)) {
        snprintf(r->why, sizeof(r->why), "its JSON has no positive step_s_median");
    } else if (cJSON_IsNumber(jt) && jt->valueint != threads) {
        snprintf(r->why, sizeof(r->why), "it ran on %d threads, not %d", jt->valueint, threads);
    } else if ((cJSON_IsNumber(jb) && jb->valueint != B) || (cJSON_IsNumber(jT) && jT->valueint != T)) {
        snprintf(r->why, sizeof(r->why), "it ran B x T = %d x %d, not %d x %d",
                 cJSON_IsNumber(jb) ? jb->valueint : -1, cJSON_IsNumber(jT) ? jT->valueint : -1, B,
                 T);
    } else {
        r->ok = 1;
        r->step_s = js->valuedouble;
        snprintf(r->name, sizeof(r->name), "%s",
                 cJSON_IsString(jp) && jp->valuestring ? jp->valuestring : "pytorch");
    }
    cJSON_Delete(j);
    free(out);
}

/* ---------------------------------------------------------------- main */

int lm_bench_model(const lm_bench_opts *opts) {
    const int threads = opts->threads > 0 ? opts->threads : 1;
    const int warmup = 1, repeat_sgemm = 5, repeat = opts->quick ? 2 : 3;
    lm_set_num_threads(threads);
    lm_blas_set_threads(threads);

    /* config first: a bad path fails before anything is measured */
    char cfg_path[PATH_CAP];
    if (opts->config_path) {
        snprintf(cfg_path, sizeof(cfg_path), "%s", opts->config_path);
    } else if (find_file(DEFAULT_CONFIG, cfg_path, sizeof(cfg_path)) != 0) {
        fprintf(stderr,
                "linmoe bench model: %s not found in the working directory, the binary's "
                "directory or their parents; pass --config FILE\n",
                DEFAULT_CONFIG);
        return 1;
    }
    lm_model_config cfg;
    lm_error err;
    memset(&err, 0, sizeof(err));
    char warn[512] = "";
    if (lm_model_config_load(&cfg, cfg_path, warn, sizeof(warn), &err) != LM_OK) {
        fprintf(stderr, "linmoe bench model: %s\n", err.msg);
        return 1;
    }
    if (warn[0]) fprintf(stderr, "linmoe bench model: %s\n", warn);
    const int B = cfg.batch_size, T = cfg.seq_len;
    if (B < 1 || T < 1) {
        fprintf(stderr,
                "linmoe bench model: %s: batch_size and seq_len must be given (>= 1) for the "
                "bench (got %d and %d)\n",
                cfg_path, B, T);
        return 1;
    }
    if (opts->json_path && lm_bench_json_check_path(opts->json_path) != 0) return 1;

    lm_params p;
    memset(&p, 0, sizeof(p));
    if (lm_params_init(&p, &cfg, &err) != LM_OK) {
        fprintf(stderr, "linmoe bench model: %s\n", err.msg);
        lm_params_free(&p);
        return 1;
    }
    lm_params_init_weights(&p, cfg.seed);
    const int64_t N = (int64_t)B * T;
    lm_model *m = NULL;
    if (lm_model_new(&m, &p, N, &err) != LM_OK) {
        fprintf(stderr, "linmoe bench model: %s\n", err.msg);
        lm_params_free(&p);
        return 1;
    }
    int32_t *ids = (int32_t *)malloc((size_t)N * sizeof(int32_t));
    int32_t *labels = (int32_t *)malloc((size_t)N * sizeof(int32_t));
    lm_bench_json js = {NULL, NULL};
    int rc = 0;
    if (!ids || !labels || (opts->json_path && lm_bench_json_init(&js, "model", threads) != 0)) {
        fprintf(stderr, "linmoe bench model: out of memory\n");
        rc = 1;
        goto done;
    }
    lm_rng r;
    lm_rng_init(&r, cfg.seed + 4000);
    for (int64_t i = 0; i < N; i++) ids[i] = (int32_t)(lm_rng_u32(&r) % (uint32_t)cfg.vocab_size);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            labels[(int64_t)b * T + t] = t + 1 < T ? ids[(int64_t)b * T + t + 1] : LM_MODEL_IGNORE;

    int64_t n_total = 0, n_active = 0;
    lm_params_count(&p, &n_total, &n_active);
    const double flop_tok = lm_model_train_flops_per_token(&cfg, T);
    const double flop = flop_tok * (double)N;
    const double load0 = lm_bench_loadavg1();
    printf("linmoe bench model: %s, B x T = %d x %d, %lld parameters (%lld active per token), "
           "%.2f MFLOP/token, %.1f GFLOP/step\n",
           cfg_path, B, T, (long long)n_total, (long long)n_active, flop_tok / 1e6, flop / 1e9);
    printf("threads=%d, warmup=%d, repeat=%d (sgemm %d)%s%s, load average %.2f\n", threads, warmup,
           repeat, repeat_sgemm, opts->quick ? ", quick" : "", opts->no_peer ? ", no peer" : "",
           load0);
    lm_bench_table_header(stdout);

    lm_bench_record rec;
    const double limit = lm_bench_sgemm_limit(threads, repeat_sgemm, &rec);
    if (limit <= 0 || !isfinite(limit)) {
        fprintf(stderr, "linmoe bench model: the sgemm limit could not be measured (out of memory)\n");
        rc = 1;
        goto done;
    }
    lm_bench_table_row(stdout, &rec);
    if (js.root && lm_bench_json_add(&js, &rec) != 0) rc = 1;

    /* the step: warmup, then `repeat` timed steps with the phases recorded */
    step_ctx s;
    memset(&s, 0, sizeof(s));
    s.m = m;
    s.batch.B = B;
    s.batch.T = T;
    s.ids = ids;
    s.labels = labels;
    lm_set_num_threads(threads);
    lm_blas_set_threads(threads);
    double fwd[16], bwd[16], tot[16];
    int nrep = 0;
    if (step_run(&s) != 0) {
        fprintf(stderr, "linmoe bench model: warmup step: %s\n", s.err.msg);
        rc = 1;
        goto done;
    }
    const double loss0 = s.loss;
    struct rusage ru0, ru1;
    const int have_ru = getrusage(RUSAGE_SELF, &ru0) == 0;
    for (int i = 0; i < repeat && i < 16; i++) {
        const double t0 = lm_time_sec();
        if (step_run(&s) != 0) {
            fprintf(stderr, "linmoe bench model: step %d: %s\n", i + 1, s.err.msg);
            rc = 1;
            goto done;
        }
        tot[nrep] = (lm_time_sec() - t0) * 1e3;
        fwd[nrep] = s.fwd_ms;
        bwd[nrep] = s.bwd_ms;
        nrep++;
    }
    const int have_ru1 = have_ru && getrusage(RUSAGE_SELF, &ru1) == 0;
    const int64_t bad = count_nonfinite(lm_model_grads(m), p.numel);
    if (!isfinite(s.loss) || bad) {
        fprintf(stderr, "linmoe bench model: non-finite loss (%g) or %lld non-finite gradients\n",
                s.loss, (long long)bad);
        rc = 1;
        goto done;
    }
    double sorted[3][16];
    memcpy(sorted[0], tot, sizeof(double) * (size_t)nrep);
    memcpy(sorted[1], fwd, sizeof(double) * (size_t)nrep);
    memcpy(sorted[2], bwd, sizeof(double) * (size_t)nrep);
    const double step_ms = lm_bench_median(sorted[0], nrep);
    const double fwd_ms = lm_bench_median(sorted[1], nrep), bwd_ms = lm_bench_median(sorted[2], nrep);

    const int64_t shape[2] = {B, T};
    lm_bench_record_init(&rec, "model_train_step", 2, shape);
    rec.ms = step_ms;
    rec.tokens_per_s = (double)N / (step_ms * 1e-3);
    rec.gflops = flop / (step_ms * 1e-3) / 1e9;
    rec.ratio_to_limit = rec.gflops / limit;
    lm_bench_record fr, br;
    lm_bench_record_init(&fr, "model_train_step_forward", 2, shape);
    lm_bench_record_init(&br, "model_train_step_backward", 2, shape);
    fr.ms = fwd_ms;
    br.ms = bwd_ms;
    fr.tokens_per_s = (double)N / (fwd_ms * 1e-3);
    br.tokens_per_s = (double)N / (bwd_ms * 1e-3);
    /* FLOP split by the usual 1 : 2 forward : backward convention of the 6 x params
     * count (nominal: the KDA op's and attention's own split differs slightly) */
    fr.gflops = flop / 3.0 / (fwd_ms * 1e-3) / 1e9;
    br.gflops = flop * 2.0 / 3.0 / (bwd_ms * 1e-3) / 1e9;
    fr.ratio_to_limit = fr.gflops / limit;
    br.ratio_to_limit = br.gflops / limit;
    lm_bench_table_row(stdout, &rec);
    lm_bench_table_row(stdout, &fr);
    lm_bench_table_row(stdout, &br);
    printf("steps (ms):");
    for (int i = 0; i < nrep; i++) printf(" %.1f (fwd %.1f + bwd %.1f)", tot[i], fwd[i], bwd[i]);
    printf("\nforward %.1f%% / backward %.1f%% of the step; loss %.4f (warmup %.4f, ln V = "
           "%.4f), %lld labelled tokens\n",
           100.0 * fwd_ms / (fwd_ms + bwd_ms), 100.0 * bwd_ms / (fwd_ms + bwd_ms), s.loss, loss0,
           log((double)cfg.vocab_size), (long long)s.n_labels);
    if (have_ru1 && nrep > 0)
        printf("per timed step: %.0f minor page faults, %.2f s system time (allocation inside the "
               "step shows here)\n",
               (double)(ru1.ru_minflt - ru0.ru_minflt) / nrep,
               ((double)(ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) +
                1e-6 * (double)(ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec)) /
                   nrep);
    fflush(stdout);

    peer_result peer;
    if (opts->no_peer) {
        memset(&peer, 0, sizeof(peer));
        snprintf(peer.why, sizeof(peer.why), "--no-peer");
    } else {
        run_peer(cfg_path, threads, B, T, repeat, &peer);
    }
    lm_bench_record pr;
    if (peer.ok) {
        rec.ratio_to_peer = peer.step_s * 1e3 / step_ms;
        lm_bench_record_init(&pr, "peer_train_step", 2, shape);
        pr.ms = peer.step_s * 1e3;
        pr.tokens_per_s = (double)N / peer.step_s;
        pr.gflops = flop / peer.step_s / 1e9;
        pr.ratio_to_limit = pr.gflops / limit;
        pr.ratio_to_peer = 1.0;
        lm_bench_table_row(stdout, &pr);
        printf("ratio_to_peer = %.3f (%s step %.1f ms / linmoe step %.1f ms; > 1: linmoe is "
               "faster)\n",
               rec.ratio_to_peer, peer.name, peer.step_s * 1e3, step_ms);
    } else {
        printf("peer: unavailable (%s)\n", peer.why);
    }
    const double load1 = lm_bench_loadavg1();
    printf("shape = [B, T]; load average at the end %.2f\n", load1);

    if (js.root && rc == 0) {
        int ok = lm_bench_json_add(&js, &rec) == 0 && lm_bench_json_add(&js, &fr) == 0 &&
                 lm_bench_json_add(&js, &br) == 0 && (!peer.ok || lm_bench_json_add(&js, &pr) == 0);
        ok = ok && cJSON_AddStringToObject(js.root, "config", cfg_path) != NULL &&
             lm_bench_json_number_or_null_(js.root, "flops_per_token", flop_tok) &&
             lm_bench_json_number_or_null_(js.root, "loss", s.loss) &&
             (peer.ok ? cJSON_AddStringToObject(js.root, "peer", peer.name) != NULL
                      : cJSON_AddNullToObject(js.root, "peer") != NULL) &&
             (peer.ok || cJSON_AddStringToObject(js.root, "peer_unavailable", peer.why) != NULL) &&
             lm_bench_json_number_or_null_(js.root, "loadavg_start", load0) &&
             lm_bench_json_number_or_null_(js.root, "loadavg_end", load1);
        if (!ok) rc = 1;
        else if (lm_bench_json_save(&js, opts->json_path) != 0) rc = 1;
        else printf("wrote %s\n", opts->json_path);
    }
done:
    lm_bench_json_free(&js);
    free(ids);
    free(labels);
    lm_model_free(m);
    lm_params_free(&p);
    return rc;
}
