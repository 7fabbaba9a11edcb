/* `linmoe generate --ckpt DIR [--prompt TEXT | --prompt-file F] ...`: prefill the
 * prompt with the chunked kernels (one lm_model_infer call), then decode one token
 * at a time with the caches, sampling each token (sample.h), and stream the text
 * to stdout as complete UTF-8 characters. No math here. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/sample.h"
#include "linmoe/tokenizer.h"

#define PROG "linmoe generate"
#define MAX_PROMPT_BYTES ((long)64 << 20)

void lm_cli_generate_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe generate --ckpt DIR [--tokenizer byte|gpt2] [--gpt2-dir DIR]\n"
            "                       [--prompt TEXT | --prompt-file F] [--max-new N]\n"
            "                       [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
            "                       [--threads N]\n"
            "\n"
            "Samples a continuation of the prompt from the checkpoint DIR. The model reads\n"
            "<|endoftext|> followed by the prompt (a fresh document) in one prefill, then\n"
            "decodes one token at a time with its caches. The prompt and the continuation\n"
            "stream to stdout as they are produced; generation stops after --max-new tokens or\n"
            "at <|endoftext|> (not printed). A summary (tokens, tokens/s) goes to stderr.\n"
            "\n"
            "options:\n"
            "  --ckpt DIR             checkpoint directory, or a run directory (its newest\n"
            "                         checkpoint, RUN/ckpt/latest) (required)\n"
            "  --tokenizer byte|gpt2  default: byte for vocab_size 257, else gpt2\n"
            "  --gpt2-dir DIR         vocab.json + merges.txt (default data/gpt2)\n"
            "  --prompt TEXT          prompt text (default: empty)\n"
            "  --prompt-file F        read the prompt from file F instead\n"
            "  --max-new N            tokens to generate at most (default 200)\n"
            "  --temperature T        softmax temperature, 0 = greedy (default 0.8)\n"
            "  --top-k K              keep the K most likely tokens, 0 = off (default 0)\n"
            "  --top-p P              nucleus: keep the most likely tokens up to mass P, 1 = off\n"
            "                         (default 0.95)\n"
            "  --seed S               sampling seed (Philox; default 1)\n"
            "  --threads N            OpenMP threads (default: OpenMP's)\n"
            "\n"
            "exit status: 0 success, 1 bad input, 2 usage error\n");
}

static int flag_val(int argc, char **argv, int *i, const char *name, const char **val) {
    return lm_cli_flag_val(PROG, argc, argv, i, name, val);
}

static int parse_long(const char *flag, const char *s, long lo, long hi, long *out) {
    return lm_cli_parse_long(PROG, flag, s, lo, hi, out);
}

static int parse_double(const char *flag, const char *s, double lo, double hi, double *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || !(v >= lo && v <= hi)) {
        fprintf(stderr, PROG ": %s '%s' is not a number in [%g, %g]\n", flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* Whole file into a malloc'd buffer. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, PROG ": cannot open prompt file %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if ((long)n > MAX_PROMPT_BYTES) {
            fprintf(stderr, PROG ": prompt file %s is larger than %ld bytes\n", path,
                    MAX_PROMPT_BYTES);
            free(buf);
            fclose(f);
            return NULL;
        }
        if (n == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    if (!buf || ferror(f)) {
        fprintf(stderr, PROG ": cannot read prompt file %s\n", path);
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    *len = n;
    return buf;
}

static void emit(const char *buf, int n) {
    if (n > 0)
        fwrite(buf, 1, (size_t)n, stdout);
}

int lm_cli_generate(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_generate_usage(stdout);
            return LM_EXIT_OK;
        }
    const char *ckpt = NULL, *tok_name = NULL, *gpt2_dir = "data/gpt2", *prompt = NULL,
               *prompt_file = NULL;
    long max_new = 200, top_k = 0, seed = 1, threads = 0;
    double temperature = 0.8, top_p = 0.95;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r;
#define FLAG(name) ((r = flag_val(argc, argv, &i, name, &v)) != 0)
        if (FLAG("--ckpt")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            ckpt = v;
        } else if (FLAG("--tokenizer")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            if (strcmp(v, "byte") != 0 && strcmp(v, "gpt2") != 0) {
                fprintf(stderr, PROG ": --tokenizer '%s' (want byte or gpt2)\n", v);
                return LM_EXIT_USAGE;
            }
            tok_name = v;
        } else if (FLAG("--gpt2-dir")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            gpt2_dir = v;
        } else if (strcmp(argv[i], "--prompt") == 0 && i + 1 < argc) {
            prompt = argv[++i]; /* may be empty */
        } else if (FLAG("--prompt")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            prompt = v;
        } else if (FLAG("--prompt-file")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            prompt_file = v;
        } else if (FLAG("--max-new")) {
            if (r < 0 || parse_long("--max-new", v, 0, 1L << 24, &max_new))
                return LM_EXIT_USAGE;
        } else if (FLAG("--temperature")) {
            if (r < 0 || parse_double("--temperature", v, 0, 1e6, &temperature))
                return LM_EXIT_USAGE;
        } else if (FLAG("--top-k")) {
            if (r < 0 || parse_long("--top-k", v, 0, 1L << 30, &top_k))
                return LM_EXIT_USAGE;
        } else if (FLAG("--top-p")) {
            if (r < 0 || parse_double("--top-p", v, 1e-9, 1, &top_p))
                return LM_EXIT_USAGE;
        } else if (FLAG("--seed")) {
            if (r < 0 || parse_long("--seed", v, 0, 0x7fffffffL, &seed))
                return LM_EXIT_USAGE;
        } else if (FLAG("--threads")) {
            if (r < 0 || parse_long("--threads", v, 1, 4096, &threads))
                return LM_EXIT_USAGE;
        } else {
            fprintf(stderr, PROG ": unknown %s '%s' (see `linmoe generate --help`)\n",
                    argv[i][0] == '-' ? "option" : "argument", argv[i]);
            return LM_EXIT_USAGE;
        }
#undef FLAG
    }
    if (!ckpt) {
        fprintf(stderr, PROG ": --ckpt DIR is required (see `linmoe generate --help`)\n");
        return LM_EXIT_USAGE;
    }
    if (prompt && prompt_file) {
        fprintf(stderr, PROG ": give --prompt or --prompt-file, not both\n");
        return LM_EXIT_USAGE;
    }
    if (threads > 0)
        lm_set_num_threads((int)threads);
    lm_sampler_config sc = {(float)temperature, (int)top_k, (float)top_p};

    lm_error err = {0};
    lm_params p;
    char ckpt_buf[4096];
    char why[4200];
    if (lm_cli_resolve_ckpt_why(ckpt, ckpt_buf, sizeof ckpt_buf, why, sizeof why) != 0) {
        fprintf(stderr, PROG ": %s\n", why);
        return LM_EXIT_BAD_INPUT;
    }
    ckpt = ckpt_buf;
    if (lm_params_load(&p, ckpt, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    int rc = LM_EXIT_BAD_INPUT;
    lm_tokenizer *tok = NULL;
    lm_model *m = NULL;
    lm_model_cache *cache = NULL;
    lm_sampler *smp = NULL;
    char *text = NULL;
    size_t text_len = 0;
    int32_t *ids = NULL;
    float *logits = NULL;
    int64_t n = 0, cap = 0;
    if (prompt_file) {
        text = read_file(prompt_file, &text_len);
        if (!text)
            goto done;
    } else if (prompt) {
        text_len = strlen(prompt);
    }
    if (!tok_name)
        tok_name = p.cfg.vocab_size == 257 ? "byte" : "gpt2";
    if (lm_tokenizer_open(&tok, tok_name, gpt2_dir, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        goto done;
    }
    const int V = p.cfg.vocab_size;
    if (lm_tokenizer_vocab_size(tok) > V) {
        fprintf(stderr,
                PROG ": the %s tokenizer (vocab %d) does not fit checkpoint %s (vocab_size %d); "
                     "pick the tokenizer it was trained with (--tokenizer)\n",
                tok_name, lm_tokenizer_vocab_size(tok), ckpt, V);
        goto done;
    }
    const int32_t eot = lm_tokenizer_eot(tok);
    cap = 64;
    ids = malloc((size_t)cap * sizeof(int32_t));
    if (!ids) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    ids[n++] = eot;
    if (text_len > 0 &&
        lm_tokenizer_encode(tok, text ? text : prompt, text_len, &ids, &n, &cap, &err) != LM_OK) {
        fprintf(stderr, PROG ": prompt: %s\n", err.msg);
        goto done;
    }
    if (n > (1 << 30) - 1) {
        fprintf(stderr, PROG ": prompt of %lld tokens is too long\n", (long long)n);
        goto done;
    }
    logits = malloc((size_t)V * sizeof(float));
    if (!logits) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    if (lm_model_new(&m, &p, n, &err) != LM_OK ||
        lm_model_cache_new(&cache, m, 1, n + max_new, &err) != LM_OK ||
        lm_sampler_new(&smp, &sc, V, (uint64_t)seed, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        goto done;
    }
    /* echo the prompt, then stream the continuation */
    if (text_len > 0)
        fwrite(text ? text : prompt, 1, text_len, stdout);
    fflush(stdout);
    double t0 = lm_time_sec();
    if (lm_model_infer(m, cache, ids, (int)n, 1, logits, &err) != LM_OK) {
        fprintf(stderr, PROG ": prefill: %s\n", err.msg);
        goto done;
    }
    const double t_prefill = lm_time_sec() - t0;
    t0 = lm_time_sec();
    lm_tokenizer_stream ts = {{0}, 0};
    char buf[256];
    long produced = 0;
    int stopped_eot = 0;
    for (long k = 0; k < max_new; k++) {
        int32_t id = lm_sampler_sample(smp, logits);
        if (id == eot) {
            stopped_eot = 1;
            break;
        }
        produced++;
        if (id < lm_tokenizer_vocab_size(tok)) {
            emit(buf, lm_tokenizer_stream_push(tok, &ts, id, buf, sizeof buf));
            fflush(stdout);
        }
        if (k + 1 < max_new && lm_model_infer(m, cache, &id, 1, 1, logits, &err) != LM_OK) {
            fprintf(stderr, "\n" PROG ": decode step %ld: %s\n", k, err.msg);
            goto done;
        }
    }
    emit(buf, lm_tokenizer_stream_flush(&ts, buf, sizeof buf));
    fputc('\n', stdout);
    fflush(stdout);
    const double t_dec = lm_time_sec() - t0;
    fprintf(stderr,
            PROG ": prompt %lld tokens (prefill %.3f s), generated %ld tokens in %.3f s "
                 "(%.1f tokens/s)%s\n",
            (long long)n, t_prefill, produced, t_dec, t_dec > 0 ? produced / t_dec : 0.0,
            stopped_eot ? ", stopped at <|endoftext|>" : "");
    rc = LM_EXIT_OK;
done:
    lm_sampler_free(smp);
    lm_model_cache_free(cache);
    lm_model_free(m);
    lm_tokenizer_free(tok);
    free(logits);
    free(ids);
    free(text);
    lm_params_free(&p);
    return rc;
}
