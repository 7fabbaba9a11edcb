/* `linmoe serve --ckpt DIR [...]`: the OpenAI-compatible HTTP server (server.h) on a
 * checkpoint, until SIGINT / SIGTERM. Thin: flags, loading, then the library. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/server.h"
#include "linmoe/tokenizer.h"

#define PROG "linmoe serve"

void lm_cli_serve_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe serve --ckpt RUN_OR_CKPT [--host 127.0.0.1] [--port 8080]\n"
            "                    [--device cpu|cuda] [--threads N] [--decode-threads N]\n"
            "                    [--max-seqs N]"
            " [--max-batch-tokens N] [--max-len N] [--state-cache-mb M]\n"
            "                    [--block N] [--max-queue N] [--api-key KEY] [--model-name NAME]\n"
            "                    [--tokenizer byte|gpt2] [--gpt2-dir DIR] [--max-body-kb K]\n"
            "\n"
            "Serves the checkpoint over HTTP with OpenAI's API: POST /v1/completions,\n"
            "POST /v1/chat/completions (\"stream\": true for server-sent events), GET /v1/models,\n"
            "GET /health, GET /metrics (Prometheus), and a chat page at GET /. One scheduler\n"
            "batches all running sequences into each decode step (continuous batching), prefills\n"
            "long prompts in blocks between decode steps, and keeps a prefix cache of full\n"
            "per-layer states every --block tokens (docs/serving.md). Stops on SIGINT / SIGTERM.\n"
            "\n"
            "options:\n"
            "%s"
            "  --host ADDR            IPv4 address to bind (default 127.0.0.1: loopback only;\n"
            "                         0.0.0.0 exposes the server to the network)\n"
            "  --port P               TCP port (default 8080; 0 = any free port, printed)\n"
            "  --device cpu|cuda      cpu (default). cuda is refused: there is no GPU inference\n"
            "                         path yet (the GPU model trains only)\n"
            "  --max-seqs N           sequences running at once: rows of the state pool (16)\n"
            "  --max-batch-tokens N   token budget of one scheduler step, decode rows plus\n"
            "                         prefill blocks (256)\n"
            "  --max-len N            context per sequence, prompt + completion (2048)\n"
            "  --state-cache-mb M     prefix-cache budget in MiB, 0 = off (256)\n"
            "  --block N              prefill block and prefix-cache granularity in tokens (64)\n"
            "  --max-queue N          requests waiting for a row before 429 (256)\n"
            "  --api-key KEY          require 'Authorization: Bearer KEY' (also from the\n"
            "                         LINMOE_API_KEY environment variable)\n"
            "  --model-name NAME      the model id in responses (default: linmoe)\n"
            "  --max-body-kb K        largest request body (1024)\n"
            "\n"
            "exit status: 0 stopped by a signal, 1 bad input (checkpoint, address in use),\n"
            "2 usage error\n",
            lm_cli_serve_opts_help);
}

const char lm_cli_serve_opts_help[] =
    "  --ckpt DIR             checkpoint or run directory (required)\n"
    "  --tokenizer byte|gpt2  default: byte for vocab_size 257, else gpt2\n"
    "  --gpt2-dir DIR         vocab.json + merges.txt (default data/gpt2)\n"
    "  --threads N            OpenMP threads of the model (default: OpenMP's)\n"
    "  --decode-threads N     threads a decode step's rows are split over, each running\n"
    "                         its rows' ops on one OpenMP thread (default 1; 2 on two\n"
    "                         cores with --threads 1: docs/serving.md)\n";

void lm_cli_serve_opts_default(lm_cli_serve_opts *o) {
    memset(o, 0, sizeof(*o));
    o->gpt2_dir = "data/gpt2";
    o->decode_threads = 1;
}

int lm_cli_serve_opt(const char *prog, int argc, char **argv, int *i, lm_cli_serve_opts *o) {
    const char *v = NULL;
    const char *str_name[] = {"--ckpt", "--tokenizer", "--gpt2-dir"};
    const char **str_var[] = {&o->ckpt, &o->tokenizer, &o->gpt2_dir};
    for (int k = 0; k < 3; k++) {
        const int r = lm_cli_flag_val(prog, argc, argv, i, str_name[k], &v);
        if (r == 0)
            continue;
        if (r < 0)
            return -1;
        if (k == 1 && strcmp(v, "byte") != 0 && strcmp(v, "gpt2") != 0) {
            fprintf(stderr, "%s: --tokenizer '%s' (want byte or gpt2)\n", prog, v);
            return -1;
        }
        *str_var[k] = v;
        return 1;
    }
    const char *long_name[] = {"--threads", "--decode-threads"};
    long *long_var[] = {&o->threads, &o->decode_threads};
    const long hi[] = {4096, 256};
    for (int k = 0; k < 2; k++) {
        const int r = lm_cli_flag_val(prog, argc, argv, i, long_name[k], &v);
        if (r == 0)
            continue;
        if (r < 0 || lm_cli_parse_long(prog, long_name[k], v, 1, hi[k], long_var[k]))
            return -1;
        return 1;
    }
    return 0;
}

int lm_cli_serve_open(const char *prog, const lm_cli_serve_opts *o, lm_engine_config *ec,
                      lm_cli_served *s) {
    memset(s, 0, sizeof(*s));
    if (!o->ckpt) {
        fprintf(stderr, "%s: --ckpt DIR is required (see --help)\n", prog);
        return LM_EXIT_USAGE;
    }
    if (o->threads > 0)
        lm_set_num_threads((int)o->threads);
    ec->decode_threads = (int)o->decode_threads;
    lm_error err = {0};
    char why[4200];
    if (lm_cli_resolve_ckpt_why(o->ckpt, s->ckpt, sizeof s->ckpt, why, sizeof why) != 0) {
        fprintf(stderr, "%s: %s\n", prog, why);
        return LM_EXIT_BAD_INPUT;
    }
    if (lm_params_load(&s->p, s->ckpt, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    s->have_p = 1;
    s->tok_name = o->tokenizer ? o->tokenizer : s->p.cfg.vocab_size == 257 ? "byte" : "gpt2";
    if (lm_tokenizer_open(&s->tok, s->tok_name, o->gpt2_dir, &err) != LM_OK ||
        lm_model_new(&s->m, &s->p, lm_engine_model_tokens(ec), &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    return LM_EXIT_OK;
}

void lm_cli_serve_close(lm_cli_served *s) {
    lm_model_free(s->m);
    lm_tokenizer_free(s->tok);
    if (s->have_p)
        lm_params_free(&s->p);
    memset(s, 0, sizeof(*s));
}

int lm_cli_serve(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_serve_usage(stdout);
            return LM_EXIT_OK;
        }
    lm_server_config sc;
    lm_server_config_default(&sc);
    lm_cli_serve_opts so;
    lm_cli_serve_opts_default(&so);
    const char *device = "cpu";
    const char *key = getenv("LINMOE_API_KEY");
    long port = 8080, max_seqs = 16, mbt = 256, max_len = 2048, cache_mb = 256, block = 64,
         max_queue = 256, body_kb = 1024;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r = lm_cli_serve_opt(PROG, argc, argv, &i, &so);
        if (r < 0)
            return LM_EXIT_USAGE;
        if (r > 0)
            continue;
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
        STR("--host", sc.host);
        STR("--device", device);
        STR("--api-key", key);
        STR("--model-name", sc.model_name);
        LONG("--port", port, 0, 65535);
        LONG("--max-seqs", max_seqs, 1, 4096);
        LONG("--max-batch-tokens", mbt, 1, 1 << 20);
        LONG("--max-len", max_len, 2, 1 << 24);
        LONG("--state-cache-mb", cache_mb, 0, 1 << 20);
        LONG("--block", block, 1, 4096);
        LONG("--max-queue", max_queue, 0, 1 << 20);
        LONG("--max-body-kb", body_kb, 1, 1 << 20);
        fprintf(stderr, PROG ": unknown %s '%s' (see `linmoe serve --help`)\n",
                argv[i][0] == '-' ? "option" : "argument", argv[i]);
        return LM_EXIT_USAGE;
#undef FLAG
#undef LONG
#undef STR
    }
    if (!so.ckpt) {
        fprintf(stderr, PROG ": --ckpt DIR is required (see `linmoe serve --help`)\n");
        return LM_EXIT_USAGE;
    }
    if (strcmp(device, "cpu") != 0) {
        if (strncmp(device, "cuda", 4) == 0) {
            fprintf(stderr,
                    PROG ": --device %s: there is no GPU inference path yet (the CUDA model "
                         "trains and evaluates only); serve on the CPU with --device cpu\n",
                    device);
            return LM_EXIT_BAD_INPUT;
        }
        fprintf(stderr, PROG ": --device '%s' (want cpu or cuda)\n", device);
        return LM_EXIT_USAGE;
    }
    sc.port = (int)port;
    sc.api_key = key;
    sc.max_body_bytes = (int64_t)body_kb << 10;
    sc.engine.max_seqs = (int)max_seqs;
    sc.engine.max_batch_tokens = (int)mbt;
    sc.engine.max_len = max_len;
    sc.engine.state_cache_bytes = (int64_t)cache_mb << 20;
    sc.engine.block_tokens = (int)block;
    sc.engine.max_queue = (int)max_queue;

    /* signals: blocked here (every thread inherits the mask), taken by sigwait below */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    lm_error err = {0};
    lm_server *srv = NULL;
    lm_cli_served sv;
    int rc = lm_cli_serve_open(PROG, &so, &sc.engine, &sv);
    if (rc != LM_EXIT_OK)
        goto done;
    rc = LM_EXIT_BAD_INPUT;
    lm_model *m = sv.m;
    const int64_t pool = lm_engine_pool_bytes(m, &sc.engine);
    if (lm_server_start(&srv, m, sv.tok, &sc, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        goto done;
    }
    fprintf(stderr,
            PROG ": %s (%s tokenizer) on http://%s:%d/  (state pool %d rows x %ld tokens, %.1f "
                 "MiB; prefix cache %ld MiB every %ld tokens%s)\n",
            sv.ckpt, sv.tok_name, sc.host, lm_server_port(srv), sc.engine.max_seqs, max_len,
            (double)pool / (1 << 20), cache_mb, block, key && key[0] ? "; API key required" : "");
    printf("listening on http://%s:%d/\n", sc.host, lm_server_port(srv));
    fflush(stdout);
    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, PROG ": signal %d, stopping\n", sig);
    lm_server_stop(srv);
    rc = LM_EXIT_OK;
done:
    lm_cli_serve_close(&sv);
    return rc;
}
