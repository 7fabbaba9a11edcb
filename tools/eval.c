/* `linmoe eval --ckpt DIR --val SHARD ...`: load a checkpoint, run the evals of
 * eval.h (bits per byte under the pinned protocol, passkey accuracy, MoE balance,
 * AttnRes depth weights) and print one JSON object. No math here. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "linmoe/eval.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#define PROG "linmoe eval"
#define MAX_PASSKEY_LENGTHS 32
/* batch budget of the bits-per-byte pass: windows of seq_len fill up to this many
 * tokens per forward (at least one window) */
#define EVAL_BATCH_TOKENS 4096

void lm_cli_eval_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe eval --ckpt DIR --val SHARD [--tokenizer byte|gpt2] [--gpt2-dir DIR]\n"
            "                   [--seq-len N] [--passkey-lengths L1,L2,..|none]\n"
            "                   [--passkey-samples N] [--passkey-seed S] [--filler SHARD]\n"
            "                   [--threads N] [--json OUT]\n"
            "\n"
            "Evaluates the checkpoint DIR (config.json + model.safetensors): a summary line\n"
            "(bits per byte, passkey accuracy) on stderr, and one JSON object to stdout (and\n"
            "to OUT with --json); when stdout is a terminal it gets the summary instead of\n"
            "the JSON. On a terminal stderr shows the progress. The JSON holds:\n"
            "  bits_per_byte  total -log2 p of every token of the validation shard's documents,\n"
            "                 each cut into consecutive windows of --seq-len tokens scored from a\n"
            "                 fresh state after <|endoftext|>, over the documents' UTF-8 bytes\n"
            "                 (also nll_nats, bytes, tokens, windows, documents)\n"
            "  passkey        greedy retrieval of a 5-digit key hidden in filler prose, per\n"
            "                 length: samples, correct, accuracy\n"
            "  moe            per MoE layer: maxvio, min_load, dead experts and the load per\n"
            "                 expert, from the expert selections of the bits-per-byte pass\n"
            "  attnres        per sublayer: the AttnRes depth weights averaged over that pass\n"
            "                 (only for AttnRes models)\n"
            "\n"
            "options:\n"
            "  --ckpt DIR             checkpoint directory, or a run directory (its newest\n"
            "                         checkpoint, RUN/ckpt/latest) (required)\n"
            "  --val SHARD            validation token shard from `linmoe tokenize` (required)\n"
            "  --tokenizer byte|gpt2  default: byte for vocab_size 257, else gpt2\n"
            "  --gpt2-dir DIR         vocab.json + merges.txt (default data/gpt2)\n"
            "  --seq-len N            eval window in tokens (default: the checkpoint config's\n"
            "                         seq_len, else 1024)\n"
            "  --passkey-lengths L    comma-separated document lengths in tokens (default\n"
            "                         256,1024; `none` skips the passkey eval)\n"
            "  --passkey-samples N    documents per length (default 200)\n"
            "  --passkey-seed S       passkey stream seed (default 1234)\n"
            "  --filler SHARD         passkey filler prose (default: the --val shard)\n"
            "  --threads N            OpenMP threads (default: OpenMP's)\n"
            "  --json OUT             also write the JSON object to OUT\n"
            "\n"
            "exit status: 0 success, 1 bad input, 2 usage error\n");
}

/* The live progress line on a terminal (stderr), at most every 0.2 s. */
typedef struct {
    double t0, last;
    int open;
} progress_line;

static void on_progress(void *ctx, const char *what, int length, int64_t done, int64_t total) {
    progress_line *p = ctx;
    const double now = lm_time_sec();
    if (now - p->last < 0.2 && done < total)
        return;
    p->last = now;
    if (length > 0)
        fprintf(stderr, "\r\033[K" PROG ": %s %d: %lld of %lld samples (%.0f s)", what, length,
                (long long)done, (long long)total, now - p->t0);
    else
        fprintf(stderr, "\r\033[K" PROG ": %s: %.0f %% of %lld tokens (%.0f s)", what,
                total > 0 ? 100.0 * (double)done / (double)total : 0.0, (long long)total,
                now - p->t0);
    fflush(stderr);
    p->open = 1;
}

/* The report in words (issue 25: only JSON came out): bits per byte and passkey. */
static void print_summary(FILE *f, const cJSON *root, const char *ckpt, double seconds) {
    const cJSON *bpb = cJSON_GetObjectItem(root, "bits_per_byte");
    const cJSON *bytes = cJSON_GetObjectItem(root, "bytes");
    const cJSON *docs = cJSON_GetObjectItem(root, "documents");
    const cJSON *seq = cJSON_GetObjectItem(root, "seq_len");
    fprintf(f, "%s: bits per byte %.4f over %.0f bytes (%.0f documents, windows of %.0f tokens)",
            ckpt, cJSON_IsNumber(bpb) ? bpb->valuedouble : NAN,
            cJSON_IsNumber(bytes) ? bytes->valuedouble : 0.0,
            cJSON_IsNumber(docs) ? docs->valuedouble : 0.0,
            cJSON_IsNumber(seq) ? seq->valuedouble : 0.0);
    const cJSON *pk = cJSON_GetObjectItem(root, "passkey"), *e;
    int first = 1;
    cJSON_ArrayForEach(e, pk) {
        const cJSON *len = cJSON_GetObjectItem(e, "length"),
                    *acc = cJSON_GetObjectItem(e, "accuracy");
        const cJSON *cor = cJSON_GetObjectItem(e, "correct"),
                    *n = cJSON_GetObjectItem(e, "samples");
        fprintf(f, "%s %.0f: %.3f (%.0f/%.0f)", first ? "; passkey at" : ",",
                cJSON_IsNumber(len) ? len->valuedouble : 0.0,
                cJSON_IsNumber(acc) ? acc->valuedouble : NAN,
                cJSON_IsNumber(cor) ? cor->valuedouble : 0.0,
                cJSON_IsNumber(n) ? n->valuedouble : 0.0);
        first = 0;
    }
    fprintf(f, " (%.1f s)\n", seconds);
}

static int flag_val(int argc, char **argv, int *i, const char *name, const char **val) {
    return lm_cli_flag_val(PROG, argc, argv, i, name, val);
}

static int parse_long(const char *flag, const char *s, long lo, long hi, long *out) {
    return lm_cli_parse_long(PROG, flag, s, lo, hi, out);
}

static int parse_lengths(const char *s, int *out, int *n) {
    *n = 0;
    if (strcmp(s, "none") == 0)
        return 0;
    const char *p = s;
    while (*p) {
        char *end = NULL;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno != 0 || v < 2 || v > (1L << 24) || (*end != ',' && *end != '\0') ||
            *n >= MAX_PASSKEY_LENGTHS) {
            fprintf(stderr,
                    PROG ": --passkey-lengths '%s' is not a list of at most %d integers in "
                         "[2, %ld] separated by commas (or `none`)\n",
                    s, MAX_PASSKEY_LENGTHS, 1L << 24);
            return -1;
        }
        out[(*n)++] = (int)v;
        p = *end == ',' ? end + 1 : end;
        if (*end == ',' && !*p) {
            fprintf(stderr, PROG ": --passkey-lengths '%s' ends with a comma\n", s);
            return -1;
        }
    }
    return 0;
}

static int write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, PROG ": cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    ok = (fclose(f) == 0) && ok;
    if (!ok) {
        fprintf(stderr, PROG ": write to %s failed\n", path);
        return -1;
    }
    return 0;
}

int lm_cli_eval(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_eval_usage(stdout);
            return LM_EXIT_OK;
        }
    const char *ckpt = NULL, *val_path = NULL, *tok_name = NULL, *gpt2_dir = "data/gpt2",
               *filler_path = NULL, *json_out = NULL;
    long seq_len = 0, samples = 200, seed = 1234, threads = 0;
    int lengths[MAX_PASSKEY_LENGTHS] = {256, 1024}, n_lengths = 2;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r;
#define FLAG(name) ((r = flag_val(argc, argv, &i, name, &v)) != 0)
        if (FLAG("--ckpt")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            ckpt = v;
        } else if (FLAG("--val")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            val_path = v;
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
        } else if (FLAG("--seq-len")) {
            if (r < 0 || parse_long("--seq-len", v, 2, 1L << 24, &seq_len))
                return LM_EXIT_USAGE;
        } else if (FLAG("--passkey-lengths")) {
            if (r < 0 || parse_lengths(v, lengths, &n_lengths))
                return LM_EXIT_USAGE;
        } else if (FLAG("--passkey-samples")) {
            if (r < 0 || parse_long("--passkey-samples", v, 1, 1L << 24, &samples))
                return LM_EXIT_USAGE;
        } else if (FLAG("--passkey-seed")) {
            if (r < 0 || parse_long("--passkey-seed", v, 0, 0x7fffffffL, &seed))
                return LM_EXIT_USAGE;
        } else if (FLAG("--filler")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            filler_path = v;
        } else if (FLAG("--threads")) {
            if (r < 0 || parse_long("--threads", v, 1, 4096, &threads))
                return LM_EXIT_USAGE;
        } else if (FLAG("--json")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            json_out = v;
        } else {
            fprintf(stderr, PROG ": unknown %s '%s' (see `linmoe eval --help`)\n",
                    argv[i][0] == '-' ? "option" : "argument", argv[i]);
            return LM_EXIT_USAGE;
        }
#undef FLAG
    }
    if (!ckpt || !val_path) {
        fprintf(stderr,
                PROG ": --ckpt DIR and --val SHARD are required (see `linmoe eval --help`)\n");
        return LM_EXIT_USAGE;
    }
    if (threads > 0)
        lm_set_num_threads((int)threads);

    lm_error err = {0};
    lm_params p;
    lm_tokenizer *tok = NULL;
    lm_shard val = {0}, filler = {0};
    lm_model *m = NULL;
    cJSON *root = NULL;
    int rc = LM_EXIT_BAD_INPUT;
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
    if (!tok_name)
        tok_name = p.cfg.vocab_size == 257 ? "byte" : "gpt2";
    if (seq_len == 0)
        seq_len = p.cfg.seq_len > 1 ? p.cfg.seq_len : 1024;
    if (lm_tokenizer_open(&tok, tok_name, gpt2_dir, &err) != LM_OK ||
        lm_shard_open(&val, val_path, &err) != LM_OK ||
        (filler_path && lm_shard_open(&filler, filler_path, &err) != LM_OK)) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        goto done;
    }
    if (lm_tokenizer_vocab_size(tok) > p.cfg.vocab_size) {
        fprintf(stderr,
                PROG ": the %s tokenizer (vocab %d) does not fit checkpoint %s (vocab_size %d); "
                     "pick the tokenizer it was trained with (--tokenizer)\n",
                tok_name, lm_tokenizer_vocab_size(tok), ckpt, p.cfg.vocab_size);
        goto done;
    }
    int64_t max_tokens = EVAL_BATCH_TOKENS / seq_len * seq_len;
    if (max_tokens < seq_len)
        max_tokens = seq_len;
    if (lm_model_new(&m, &p, max_tokens, &err) != LM_OK) {
        fprintf(stderr, PROG ": %s: %s\n", ckpt, err.msg);
        goto done;
    }
    root = cJSON_CreateObject();
    if (!root || !cJSON_AddStringToObject(root, "checkpoint", ckpt) ||
        !cJSON_AddStringToObject(root, "tokenizer", tok_name)) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    lm_eval_options o = {(int)seq_len,   lengths,
                         n_lengths,      (int)samples,
                         (uint64_t)seed, filler_path ? &filler : NULL,
                         NULL,           NULL};
    progress_line pl = {lm_time_sec(), 0.0, 0};
    if (isatty(2)) { /* progress on a terminal */
        o.progress = on_progress;
        o.progress_ctx = &pl;
    }
    lm_status est = lm_eval_report(m, tok, &val, &o, root, &err);
    if (pl.open)
        fprintf(stderr, "\r\033[K");
    if (est != LM_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        goto done;
    }
    char *text = cJSON_Print(root);
    if (!text) {
        fprintf(stderr, PROG ": out of memory printing the JSON\n");
        goto done;
    }
    /* the JSON goes to stdout for programs (a pipe or file) and to --json OUT; on a
     * terminal stdout gets the summary in words instead, which stderr always has */
    const int tty_out = isatty(1);
    if (tty_out) {
        print_summary(stdout, root, ckpt, lm_time_sec() - pl.t0);
        if (!json_out)
            printf("(the full report as JSON: --json FILE, or redirect stdout)\n");
    } else {
        printf("%s\n", text);
        print_summary(stderr, root, ckpt, lm_time_sec() - pl.t0);
    }
    fflush(stdout);
    rc = json_out && write_file(json_out, text) != 0 ? LM_EXIT_BAD_INPUT : LM_EXIT_OK;
    free(text);
done:
    cJSON_Delete(root);
    lm_model_free(m);
    lm_shard_close(&filler);
    lm_shard_close(&val);
    lm_tokenizer_free(tok);
    lm_params_free(&p);
    return rc;
}
