/* `linmoe bench serve`: the HTTP server (server.h) on a checkpoint, in this process on a
 * free loopback port, driven by N concurrent streaming clients (raw sockets, one thread
 * each) for each N of --concurrency: aggregate generated tokens/s, time to first token
 * and time per output token (p50 / p99 over the requests), and the prefix-cache speed-up
 * of a repeated long prompt (time to first token cold vs with a cache hit). Prints a
 * table, writes JSON records (CONVENTIONS.md "Benchmarks"). */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../tools/cli.h"
#include "bench.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/server.h"
#include "linmoe/tokenizer.h"

#define PROG "linmoe bench serve"

typedef struct {
    double ttft, tpot, total;
    int64_t tokens;
    int ok;
} req_result;

/* One streaming completion of prompt ids [n]: timings from the SSE events. */
static req_result stream_once(int port, const int32_t *ids, int n, int max_tokens) {
    req_result r = {0, 0, 0, 0, 0};
    size_t cap = (size_t)n * 8 + 256;
    char *body = malloc(cap);
    size_t bl = (size_t)snprintf(body, cap, "{\"prompt\":[");
    for (int i = 0; i < n; i++)
        bl += (size_t)snprintf(body + bl, cap - bl, i ? ",%d" : "%d", ids[i]);
    bl += (size_t)snprintf(
        body + bl, cap - bl,
        "],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}", max_tokens);
    char head[256];
    const int hl =
        snprintf(head, sizeof head,
                 "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                 "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                 bl);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const double t0 = lm_time_sec();
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0)
            close(fd);
        free(body);
        return r;
    }
    if (send(fd, head, (size_t)hl, MSG_NOSIGNAL) != hl ||
        send(fd, body, bl, MSG_NOSIGNAL) != (ssize_t)bl) {
        close(fd);
        free(body);
        return r;
    }
    free(body);
    /* raw bytes; SSE events are found by "data: " ... "\n\n" after de-chunking lazily:
     * the chunk-size lines sit between events (each event is one chunk of <= 4 KiB) */
    size_t bcap = 1 << 16, len = 0, scan = 0;
    char *buf = malloc(bcap);
    double t_first = 0, t_last = 0;
    int status = 0, done = 0;
    while (!done) {
        if (len + 8192 > bcap)
            buf = realloc(buf, bcap *= 2);
        const ssize_t g = recv(fd, buf + len, bcap - len - 1, 0);
        if (g <= 0)
            break;
        len += (size_t)g;
        buf[len] = '\0';
        const double now = lm_time_sec();
        if (!status)
            sscanf(buf, "HTTP/1.1 %d", &status);
        char *p;
        while ((p = strstr(buf + scan, "data: ")) != NULL) {
            char *e = strstr(p, "\n\n");
            if (!e)
                break;
            scan = (size_t)(e + 2 - buf);
            if (strncmp(p + 6, "[DONE]", 6) == 0) {
                done = 1;
                break;
            }
            char *u = strstr(p, "\"completion_tokens\":");
            if (u && u < e)
                r.tokens = strtoll(u + 20, NULL, 10);
            char *t = strstr(p, "\"text\":\"");
            if (t && t < e && t[8] != '"') { /* a non-empty text delta */
                if (!t_first)
                    t_first = now;
                t_last = now;
            }
        }
    }
    close(fd);
    free(buf);
    const double t_end = lm_time_sec();
    if (status != 200 || !done || !t_first)
        return r;
    r.ok = 1;
    r.ttft = t_first - t0;
    r.total = t_end - t0;
    r.tpot = r.tokens > 1 ? (t_last - t_first) / (double)(r.tokens - 1) : 0;
    return r;
}

typedef struct {
    int port, n_req, P, G, V;
    uint64_t seed;
    req_result *res;
} client_arg;

static void random_prompt(int32_t *ids, int n, int V, uint64_t seed) {
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)(lm_rng_u32(&r) % (uint32_t)(V - 1));
}

static void *client(void *arg) {
    client_arg *c = arg;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)c->P);
    for (int k = 0; k < c->n_req; k++) {
        random_prompt(ids, c->P, c->V, c->seed * 1000 + (uint64_t)k);
        c->res[k] = stream_once(c->port, ids, c->P, c->G);
    }
    free(ids);
    return NULL;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double q) {
    if (n == 0)
        return 0;
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    int i = (int)ceil(q * n) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *e;
        long v = strtol(s, &e, 10);
        if (e == s || v < 1 || v > 4096)
            return -1;
        out[n++] = (int)v;
        s = *e == ',' ? e + 1 : e;
        if (*e && *e != ',')
            return -1;
    }
    return n;
}

int lm_bench_serve(int argc, char **argv) {
    const char *ckpt = NULL, *json_path = NULL, *conc = "1,4,16,64", *tok_name = NULL,
               *gpt2_dir = "data/gpt2";
    long P = 64, G = 128, R = 2, L = 1000, threads = 0, reps = 3;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf(
                "usage: linmoe bench serve --ckpt DIR [--concurrency 1,4,16,64] [--prompt-tokens "
                "64]\n"
                "                          [--gen-tokens 128] [--requests 2] [--long-prompt "
                "1000]\n"
                "                          [--threads N] [--json FILE]\n\n"
                "Starts `linmoe serve` on DIR (in this process, loopback, a free port) and, for\n"
                "each concurrency N, runs N streaming clients at once, each sending --requests\n"
                "greedy completions of --prompt-tokens random tokens generating --gen-tokens\n"
                "tokens (ignore_eos). Reports aggregate generated tokens/s (all tokens / wall\n"
                "time of the round), time to first token and time per output token (p50, p99),\n"
                "and the speed-up over 1 stream; then the time to first token of a repeated\n"
                "--long-prompt-token prompt, cold and with a prefix-cache hit (median of 3).\n");
            return LM_EXIT_OK;
        }
#define FLAG(name) ((r = lm_cli_flag_val(PROG, argc, argv, &i, name, &v)) != 0)
#define LONG(name, var, lo, hi)                                                                    \
    if (FLAG(name)) {                                                                              \
        if (r < 0 || lm_cli_parse_long(PROG, name, v, lo, hi, &var))                               \
            return LM_EXIT_USAGE;                                                                  \
        continue;                                                                                  \
    }
#define STR(name, var)                                                                             \
    if (FLAG(name)) {                                                                              \
        if (r < 0)                                                                                 \
            return LM_EXIT_USAGE;                                                                  \
        var = v;                                                                                   \
        continue;                                                                                  \
    }
        STR("--ckpt", ckpt);
        STR("--json", json_path);
        STR("--concurrency", conc);
        STR("--tokenizer", tok_name);
        STR("--gpt2-dir", gpt2_dir);
        LONG("--prompt-tokens", P, 1, 1 << 20);
        LONG("--gen-tokens", G, 2, 1 << 20);
        LONG("--requests", R, 1, 1000);
        LONG("--long-prompt", L, 65, 1 << 20);
        LONG("--threads", threads, 1, 4096);
        fprintf(stderr, PROG ": unknown option '%s' (see --help)\n", argv[i]);
        return LM_EXIT_USAGE;
#undef FLAG
#undef LONG
#undef STR
    }
    if (!ckpt) {
        fprintf(stderr, PROG ": --ckpt DIR is required\n");
        return LM_EXIT_USAGE;
    }
    int Ns[16];
    const int nN = parse_list(conc, Ns, 16);
    if (nN < 1) {
        fprintf(stderr, PROG ": --concurrency '%s' (want a list like 1,4,16,64)\n", conc);
        return LM_EXIT_USAGE;
    }
    if (threads > 0)
        lm_set_num_threads((int)threads);
    int maxN = 1;
    for (int i = 0; i < nN; i++)
        maxN = Ns[i] > maxN ? Ns[i] : maxN;
    lm_error err = {0};
    lm_params p;
    char ckpt_buf[4096], why[4200];
    if (lm_cli_resolve_ckpt_why(ckpt, ckpt_buf, sizeof ckpt_buf, why, sizeof why) != 0) {
        fprintf(stderr, PROG ": %s\n", why);
        return LM_EXIT_BAD_INPUT;
    }
    if (lm_params_load(&p, ckpt_buf, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    const int V = p.cfg.vocab_size;
    lm_tokenizer *tok = NULL;
    lm_model *m = NULL;
    lm_server *srv = NULL;
    int rc = LM_EXIT_BAD_INPUT;
    lm_server_config sc;
    lm_server_config_default(&sc);
    sc.port = 0;
    sc.engine.max_seqs = maxN;
    sc.engine.max_len = (L + 64 > P + G + 8 ? L + 64 : P + G + 8);
    sc.engine.max_queue = 4096;
    sc.max_connections = 4096;
    sc.max_body_bytes = (int64_t)(L > P ? L : P) * 12 + 4096;
    if (!tok_name)
        tok_name = V == 257 ? "byte" : "gpt2";
    if (lm_tokenizer_open(&tok, tok_name, gpt2_dir, &err) != LM_OK ||
        lm_model_new(&m, &p, lm_engine_model_tokens(&sc.engine), &err) != LM_OK ||
        lm_server_start(&srv, m, tok, &sc, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        goto done;
    }
    const int port = lm_server_port(srv);
    const lm_model_config *mc = &p.cfg;
    printf("bench serve: %s (d %d, %d layers, vocab %d), %d OpenMP threads, load %.2f; prompts %ld "
           "tokens, %ld generated (greedy, ignore_eos), %ld requests per client\n",
           ckpt_buf, mc->hidden_size, mc->num_hidden_layers, V, lm_get_num_threads(),
           lm_bench_loadavg1(), P, G, R);
    FILE *jf = json_path ? fopen(json_path, "w") : NULL;
    if (json_path && !jf) {
        fprintf(stderr, PROG ": cannot write %s: %s\n", json_path, strerror(errno));
        goto done;
    }
    if (jf)
        fprintf(jf, "[\n");
    /* warm-up */
    {
        int32_t ids[64];
        random_prompt(ids, 64, V, 99);
        stream_once(port, ids, 64, 8);
    }
    printf("%8s %12s %10s %10s %10s %10s %10s %8s\n", "streams", "tok/s", "vs 1", "TTFT p50",
           "TTFT p99", "TPOT p50", "TPOT p99", "failed");
    double base = 0;
    for (int ni = 0; ni < nN; ni++) {
        const int N = Ns[ni];
        client_arg *ca = calloc((size_t)N, sizeof(client_arg));
        pthread_t *th = calloc((size_t)N, sizeof(pthread_t));
        req_result *res = calloc((size_t)N * (size_t)R, sizeof(req_result));
        const double t0 = lm_time_sec();
        for (int c = 0; c < N; c++) {
            ca[c] = (client_arg){port,
                                 (int)R,
                                 (int)P,
                                 (int)G,
                                 V,
                                 (uint64_t)(ni * 10000 + c + 1),
                                 res + (size_t)c * R};
            pthread_create(&th[c], NULL, client, &ca[c]);
        }
        for (int c = 0; c < N; c++)
            pthread_join(th[c], NULL);
        const double wall = lm_time_sec() - t0;
        const int n = N * (int)R;
        double *tt = malloc(sizeof(double) * (size_t)n), *tp = malloc(sizeof(double) * (size_t)n);
        int k = 0, failed = 0;
        int64_t toks = 0;
        for (int i = 0; i < n; i++) {
            if (!res[i].ok) {
                failed++;
                continue;
            }
            toks += res[i].tokens;
            tt[k] = res[i].ttft;
            tp[k] = res[i].tpot;
            k++;
        }
        const double tps = toks / wall;
        if (N == 1 || base == 0)
            base = tps;
        const double t50 = pct(tt, k, 0.5), t99 = pct(tt, k, 0.99), p50 = pct(tp, k, 0.5),
                     p99 = pct(tp, k, 0.99);
        printf("%8d %12.0f %9.2fx %8.1fms %8.1fms %8.2fms %8.2fms %8d\n", N, tps, tps / base,
               t50 * 1e3, t99 * 1e3, p50 * 1e3, p99 * 1e3, failed);
        if (jf)
            fprintf(
                jf,
                "  {\"name\": \"serve_streams\", \"shape\": {\"streams\": %d, \"prompt_tokens\": "
                "%ld, \"gen_tokens\": %ld, \"requests\": %d}, \"ms\": %.3f, \"tokens_per_s\": "
                "%.1f, \"ratio_to_1_stream\": %.3f, \"ttft_p50_ms\": %.3f, \"ttft_p99_ms\": "
                "%.3f, \"tpot_p50_ms\": %.4f, \"tpot_p99_ms\": %.4f, \"failed\": %d},\n",
                N, P, G, n, wall * 1e3, tps, tps / base, t50 * 1e3, t99 * 1e3, p50 * 1e3, p99 * 1e3,
                failed);
        free(tt), free(tp), free(res), free(th), free(ca);
    }
    /* the prefix cache: a long prompt cold, then again */
    {
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)L);
        double cold[8], hit[8];
        int ok = 1;
        for (int k = 0; k < reps; k++) {
            random_prompt(ids, (int)L, V, 777 + (uint64_t)k);
            const req_result a = stream_once(port, ids, (int)L, 2);
            const req_result b = stream_once(port, ids, (int)L, 2);
            ok &= a.ok && b.ok;
            cold[k] = a.ttft;
            hit[k] = b.ttft;
        }
        free(ids);
        const double c50 = pct(cold, (int)reps, 0.5), h50 = pct(hit, (int)reps, 0.5);
        printf("prefix cache, a %ld-token prompt (blocks of %d): time to first token cold %.1f ms, "
               "cached %.1f ms: %.1fx faster%s\n",
               L, sc.engine.block_tokens, c50 * 1e3, h50 * 1e3, h50 > 0 ? c50 / h50 : 0,
               ok ? "" : " (a request failed)");
        if (jf)
            fprintf(jf,
                    "  {\"name\": \"serve_prefix_cache\", \"shape\": {\"prompt_tokens\": %ld, "
                    "\"block_tokens\": %d, \"reps\": %ld}, \"ms\": %.3f, \"ttft_cold_ms\": %.3f, "
                    "\"ttft_hit_ms\": %.3f, \"speedup\": %.2f}\n]\n",
                    L, sc.engine.block_tokens, reps, h50 * 1e3, c50 * 1e3, h50 * 1e3,
                    h50 > 0 ? c50 / h50 : 0);
    }
    if (jf)
        fclose(jf);
    rc = LM_EXIT_OK;
done:
    lm_server_stop(srv);
    lm_model_free(m);
    lm_tokenizer_free(tok);
    lm_params_free(&p);
    return rc;
}
