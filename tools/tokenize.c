/* `linmoe tokenize`: text in, token shard out (tokenizer.h, shard.h). Reads the whole
 * input, splits it into documents, encodes each one and appends <|endoftext|> after
 * it, writes the shard atomically and prints the counts. No tokenizer logic here. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

void lm_cli_tokenize_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe tokenize --tokenizer byte|gpt2 --in TEXT --out SHARD\n"
            "          [--gpt2-dir DIR] [--doc-sep ff|blank|none] [--quiet]\n"
            "\n"
            "Encodes the documents of TEXT and writes them to SHARD (the token shard format of\n"
            "include/linmoe/shard.h), <|endoftext|> after every document. Then prints one line:\n"
            "documents, bytes, tokens, bytes per token.\n"
            "\n"
            "  --tokenizer byte|gpt2  byte: 256 bytes + <|endoftext|> (vocab 257);\n"
            "                         gpt2: GPT-2 byte-level BPE (vocab 50257)\n"
            "  --gpt2-dir DIR         vocab.json + merges.txt (default data/gpt2, written by\n"
            "                         scripts/fetch-data.sh)\n"
            "  --doc-sep ff           documents are separated by a line holding only a form\n"
            "                         feed \"\\f\" (default; the format of data/brown/*.txt)\n"
            "  --doc-sep blank        documents are separated by an empty line\n"
            "  --doc-sep none         the whole file is one document\n"
            "  --quiet                print nothing on success\n"
            "\n"
            "Empty documents are skipped. SHARD is written to a temporary name and renamed: an\n"
            "existing SHARD is left intact when the run fails.\n"
            "\n"
            "exit status: 0 success, 1 bad input or I/O failure, 2 usage error\n");
}

/* Read a whole file; returns 0, or 1 after printing why. */
static int slurp(const char *path, char **out, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "linmoe tokenize: cannot open input %s: %s\n", path, strerror(errno));
        return 1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "linmoe tokenize: input %s is not a regular file\n", path);
        fclose(f);
        return 1;
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n ? n : 1);
    if (!buf) {
        fprintf(stderr, "linmoe tokenize: cannot allocate %zu bytes for %s\n", n, path);
        fclose(f);
        return 1;
    }
    size_t got = fread(buf, 1, n, f);
    if (got != n || ferror(f)) {
        fprintf(stderr, "linmoe tokenize: cannot read input %s: short read (%zu of %zu bytes)\n",
                path, got, n);
        free(buf);
        fclose(f);
        return 1;
    }
    fclose(f);
    *out = buf;
    *len = n;
    return 0;
}

int lm_cli_tokenize(int argc, char **argv) {
    /* argv[0] == "tokenize" */
    const char *name = NULL, *dir = NULL, *in = NULL, *out = NULL, *sep_s = "ff";
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_tokenize_usage(stdout);
            return LM_EXIT_OK;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = strcmp(a, "--tokenizer") == 0  ? &name
                           : strcmp(a, "--gpt2-dir") == 0 ? &dir
                           : strcmp(a, "--in") == 0       ? &in
                           : strcmp(a, "--out") == 0      ? &out
                           : strcmp(a, "--doc-sep") == 0  ? &sep_s
                                                          : NULL;
        if (dst) {
            if (i + 1 >= argc) {
                fprintf(stderr, "linmoe tokenize: option %s needs a value\n", a);
                return LM_EXIT_USAGE;
            }
            *dst = argv[++i];
        } else if (strcmp(a, "--quiet") == 0) {
            quiet = 1;
        } else {
            fprintf(stderr,
                    "linmoe tokenize: unknown argument '%s' (see `linmoe tokenize --help`)\n", a);
            return LM_EXIT_USAGE;
        }
    }
    if (!name || !in || !out) {
        fprintf(stderr, "linmoe tokenize: missing %s (see `linmoe tokenize --help`)\n",
                !name ? "--tokenizer byte|gpt2"
                : !in ? "--in TEXT"
                      : "--out SHARD");
        return LM_EXIT_USAGE;
    }
    if (strcmp(name, "byte") != 0 && strcmp(name, "gpt2") != 0) {
        fprintf(stderr, "linmoe tokenize: --tokenizer '%s' is not one of byte, gpt2\n", name);
        return LM_EXIT_USAGE;
    }
    lm_docsep sep;
    if (strcmp(sep_s, "ff") == 0)
        sep = LM_DOCSEP_FORMFEED;
    else if (strcmp(sep_s, "blank") == 0)
        sep = LM_DOCSEP_BLANK;
    else if (strcmp(sep_s, "none") == 0)
        sep = LM_DOCSEP_NONE;
    else {
        fprintf(stderr, "linmoe tokenize: --doc-sep '%s' is not one of ff, blank, none\n", sep_s);
        return LM_EXIT_USAGE;
    }

    double t0 = lm_time_sec();
    lm_error err = {0};
    lm_tokenizer *tok = NULL;
    if (lm_tokenizer_open(&tok, name, dir, &err) != LM_OK) {
        fprintf(stderr, "linmoe tokenize: %s\n", err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    char *text = NULL;
    size_t len = 0;
    if (slurp(in, &text, &len) != 0) {
        lm_tokenizer_free(tok);
        return LM_EXIT_BAD_INPUT;
    }
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0, docs = 0, bytes = 0;
    int rc = LM_EXIT_OK;
    if (lm_tokenizer_encode_documents(tok, text, len, sep, &ids, &n, &cap, &docs, &bytes, &err) !=
        LM_OK) {
        fprintf(stderr, "linmoe tokenize: %s: %s\n", in, err.msg);
        rc = LM_EXIT_BAD_INPUT;
    } else if (docs == 0) {
        fprintf(stderr, "linmoe tokenize: input %s holds no text (%zu bytes, no documents)\n", in,
                len);
        rc = LM_EXIT_BAD_INPUT;
    } else if (lm_shard_write(out, (uint32_t)lm_tokenizer_vocab_size(tok), ids, (uint64_t)n,
                              &err) != LM_OK) {
        fprintf(stderr, "linmoe tokenize: %s\n", err.msg);
        rc = LM_EXIT_BAD_INPUT;
    } else if (!quiet) {
        int64_t text_tokens = n - docs; /* without the separators */
        printf("tokenize: %s: %lld documents, %lld bytes -> %lld tokens (%lld + %lld "
               "<|endoftext|>), %.3f bytes/token, tokenizer %s (vocab %d) -> %s (%.2f s)\n",
               in, (long long)docs, (long long)bytes, (long long)n, (long long)text_tokens,
               (long long)docs, text_tokens ? (double)bytes / (double)text_tokens : 0.0,
               lm_tokenizer_name(tok), lm_tokenizer_vocab_size(tok), out, lm_time_sec() - t0);
    }
    free(ids);
    free(text);
    lm_tokenizer_free(tok);
    return rc;
}
