/* `linmoe tokenize`: text in, token shards out (tokenizer.h, shard.h). No tokenizer
 * logic here.
 *
 * Two forms:
 *   --in TEXT --out SHARD     one file, split into documents (--doc-sep), one shard;
 *   --out-dir DIR INPUT...    many files, directory trees or JSONL files, tokenized in
 *                             parallel, written as shards of at most --shard-tokens
 *                             tokens plus a manifest per split (shard.h), with an
 *                             optional held-out split by source.
 * Both encode every document and append <|endoftext|> after it (the shard format's
 * convention); empty documents are skipped.
 *
 * Determinism of the second form: the sources are put in a fixed order (inputs as
 * given, each directory's files sorted by path), every source is encoded on its own
 * (per-thread tokenizers; the GPT-2 piece cache changes speed, never ids), and the
 * encoded sources are appended to the shards in source order by one thread, so the
 * shards and manifests are byte-identical for any thread count.
 */
#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <dirent.h>

#include "cli.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#define PROG "linmoe tokenize"
#define DEFAULT_SHARD_TOKENS 100000000ull
/* A batch of sources is read and encoded together: at most this many input bytes
 * (at least one source) and sources. */
#define BATCH_BYTES ((uint64_t)64 << 20)
#define BATCH_UNITS 65536
#define JSON_MAX_DEPTH 256

void lm_cli_tokenize_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe tokenize --tokenizer byte|gpt2 --in TEXT --out SHARD\n"
            "          [--gpt2-dir DIR] [--doc-sep ff|blank|none] [--quiet]\n"
            "       linmoe tokenize --tokenizer byte|gpt2 --out-dir DIR [options] INPUT...\n"
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
            "                         feed \"\\f\" (default with --in; the format of\n"
            "                         data/brown/*.txt)\n"
            "  --doc-sep blank        documents are separated by an empty line\n"
            "  --doc-sep none         the whole file is one document (default with --out-dir)\n"
            "  --quiet                print nothing on success\n"
            "\n"
            "Empty documents are skipped. SHARD is written to a temporary name and renamed: an\n"
            "existing SHARD is left intact when the run fails.\n"
            "\n"
            "Many inputs (--out-dir): each INPUT is a file or a directory; a directory is walked\n"
            "recursively and its regular files are taken in bytewise order of their paths\n"
            "(names starting with '.' and symbolic links are skipped). Every file is a source;\n"
            "with --jsonl every non-blank line of every file is a source: a JSON object whose\n"
            "string member KEY is one document. Sources are encoded in parallel and written, in\n"
            "order, to DIR/train-NNNNN.bin (and DIR/val-NNNNN.bin) plus the manifests\n"
            "DIR/train.json (and DIR/val.json): the shards, their token and document counts,\n"
            "the sources of each shard, the tokenizer and the split. A training config, `eval\n"
            "--val` and the loader take a manifest wherever they take a shard. The output is\n"
            "the same for any thread count.\n"
            "\n"
            "  --out-dir DIR          where the shards and manifests go (created if missing;\n"
            "                         stale train-*/val-* shards of an earlier run are removed)\n"
            "  --ext E1,E2,..         only files found in directories whose names end with one\n"
            "                         of these (e.g. .c,.h,.rst,.txt); named files are always\n"
            "                         taken\n"
            "  --jsonl                the inputs are JSONL files (one document per record)\n"
            "  --text-key KEY         the JSONL member holding the text (default \"text\")\n"
            "  --shard-tokens N       at most N tokens per shard (default %llu); shards end at\n"
            "                         a document's end unless one document alone is longer\n"
            "  --val-fraction F       hold out the sources whose split hash is below F (0 <= F\n"
            "                         < 1; include/linmoe/shard.h lm_shard_split_hash)\n"
            "  --val-files N          hold out the N sources of smallest split hash\n"
            "  --split-seed S         seed of the split hash (default 0)\n"
            "  --threads N            OpenMP threads (default: OMP_NUM_THREADS or all cores)\n"
            "\n"
            "A source's key, which its split hash is taken of, is its path relative to the\n"
            "directory INPUT it was found in (the path as given for a named file), and\n"
            "KEY:LINE (1-based line number) for a JSONL record: the split depends on the seed\n"
            "and the names only. A held-out source's documents all go to the val split.\n"
            "\n"
            "exit status: 0 success, 1 bad input or I/O failure, 2 usage error\n",
            (unsigned long long)DEFAULT_SHARD_TOKENS);
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

/* The single-file form (--in TEXT --out SHARD). */
static int tokenize_one(const char *name, const char *dir, const char *in, const char *out,
                        lm_docsep sep, int quiet) {
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
        /* which separator split the text (issue 25: a plain text file silently became one
         * document) */
        printf("tokenize: documents split at %s (--doc-sep %s)%s\n",
               sep == LM_DOCSEP_FORMFEED ? "lines holding only a form feed"
               : sep == LM_DOCSEP_BLANK  ? "empty lines"
                                         : "nothing: the whole file is one document",
               sep == LM_DOCSEP_FORMFEED ? "ff" : sep == LM_DOCSEP_BLANK ? "blank" : "none",
               docs == 1 && sep != LM_DOCSEP_NONE
                   ? "; the file has no such separator, so it is one document (--doc-sep blank "
                     "splits at empty lines)"
                   : "");
    }
    free(ids);
    free(text);
    lm_tokenizer_free(tok);
    return rc;
}

/* ================================================================ many inputs */

typedef struct {
    char *path; /* to open */
    char *key;  /* the split key and the name in the manifest */
    uint64_t size;
    const char *map; /* JSONL: the mapped file (NULL when empty) */
} src_file;

/* One source: a file, or a JSONL record (bytes [off, off + len) of file `file`). */
typedef struct {
    int64_t file;
    int64_t line; /* JSONL: 1-based line number; 0 for a file */
    uint64_t off, len;
    uint8_t val;
} unit;

typedef struct {
    const char *tok_name, *tok_dir, *out_dir, *ext, *text_key;
    lm_docsep sep;
    const char *sep_name;
    int jsonl, quiet, threads;
    uint64_t shard_tokens, seed;
    int split; /* 0 none, 1 val_fraction, 2 val_files */
    double val_fraction;
    int64_t val_files;
    char **inputs;
    int n_inputs;
} mopts;

typedef struct {
    src_file *v;
    int64_t n, cap;
} file_list;

static char *dupstr(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static char *join2(const char *a, const char *sep, const char *b) {
    size_t na = strlen(a), ns = strlen(sep), nb = strlen(b);
    char *p = malloc(na + ns + nb + 1);
    if (p) {
        memcpy(p, a, na);
        memcpy(p + na, sep, ns);
        memcpy(p + na + ns, b, nb + 1);
    }
    return p;
}

static int push_file(file_list *l, char *path, char *key, uint64_t size) {
    if (!path || !key) {
        free(path);
        free(key);
        fprintf(stderr, "%s: out of memory listing the inputs\n", PROG);
        return 1;
    }
    if (l->n == l->cap) {
        int64_t nc = l->cap ? 2 * l->cap : 256;
        src_file *nv = realloc(l->v, (size_t)nc * sizeof *nv);
        if (!nv) {
            free(path);
            free(key);
            fprintf(stderr, "%s: out of memory listing the inputs\n", PROG);
            return 1;
        }
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = (src_file){path, key, size, NULL};
    return 0;
}

/* Whether `name` ends with one of the comma-separated suffixes of `ext` (NULL: all). */
static int ext_ok(const char *name, const char *ext) {
    if (!ext)
        return 1;
    size_t n = strlen(name);
    for (const char *e = ext; *e;) {
        const char *c = strchr(e, ',');
        size_t k = c ? (size_t)(c - e) : strlen(e);
        if (k && k <= n && memcmp(name + n - k, e, k) == 0)
            return 1;
        e += k + (c ? 1 : 0);
    }
    return 0;
}

/* Append the regular files under root/rel (rel "" = root itself), unsorted. */
static int walk(const char *root, const char *rel, const char *ext, file_list *out) {
    char *dpath = rel[0] ? join2(root, "/", rel) : dupstr(root);
    if (!dpath) {
        fprintf(stderr, "%s: out of memory listing the inputs\n", PROG);
        return 1;
    }
    DIR *d = opendir(dpath);
    if (!d) {
        fprintf(stderr, "%s: cannot read directory %s: %s\n", PROG, dpath, strerror(errno));
        free(dpath);
        return 1;
    }
    int rc = 0;
    struct dirent *de;
    while (!rc && (errno = 0, de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char *p = join2(dpath, "/", de->d_name);
        char *r = rel[0] ? join2(rel, "/", de->d_name) : dupstr(de->d_name);
        struct stat st;
        if (!p || !r) {
            fprintf(stderr, "%s: out of memory listing the inputs\n", PROG);
            rc = 1;
        } else if (lstat(p, &st) != 0) {
            fprintf(stderr, "%s: cannot stat %s: %s\n", PROG, p, strerror(errno));
            rc = 1;
        } else if (S_ISDIR(st.st_mode)) {
            rc = walk(root, r, ext, out);
        } else if (S_ISREG(st.st_mode) && ext_ok(de->d_name, ext)) {
            rc = push_file(out, p, r, (uint64_t)st.st_size);
            p = r = NULL; /* owned by the list */
        }
        free(p);
        free(r);
    }
    if (!rc && errno != 0) {
        fprintf(stderr, "%s: cannot read directory %s: %s\n", PROG, dpath, strerror(errno));
        rc = 1;
    }
    closedir(d);
    free(dpath);
    return rc;
}

static int cmp_key(const void *a, const void *b) {
    return strcmp(((const src_file *)a)->key, ((const src_file *)b)->key);
}

/* Every input, in order: a named file as given, a directory's files sorted by key. */
static int list_inputs(const mopts *o, file_list *out) {
    for (int i = 0; i < o->n_inputs; i++) {
        const char *in = o->inputs[i];
        struct stat st;
        if (stat(in, &st) != 0) {
            fprintf(stderr, "%s: cannot open input %s: %s\n", PROG, in, strerror(errno));
            return 1;
        }
        if (S_ISDIR(st.st_mode)) {
            int64_t first = out->n;
            size_t n = strlen(in);
            char *root = dupstr(in);
            if (!root) {
                fprintf(stderr, "%s: out of memory listing the inputs\n", PROG);
                return 1;
            }
            while (n > 1 && root[n - 1] == '/') /* "dir/" and "dir" give the same keys */
                root[--n] = '\0';
            int rc = walk(root, "", o->ext, out);
            free(root);
            if (rc)
                return 1;
            if (out->n > first)
                qsort(out->v + first, (size_t)(out->n - first), sizeof *out->v, cmp_key);
        } else if (S_ISREG(st.st_mode)) {
            if (push_file(out, dupstr(in), dupstr(in), (uint64_t)st.st_size))
                return 1;
        } else {
            fprintf(stderr, "%s: input %s is not a regular file or a directory\n", PROG, in);
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- JSONL records */

/* A JSON reader over one record [p, end): validates the whole value and decodes the
 * string member `key` of the top-level object (RFC 8259; \u escapes to UTF-8,
 * surrogate pairs joined; a lone surrogate, a raw control character, trailing bytes
 * or nesting beyond JSON_MAX_DEPTH are errors). Bytes >= 0x80 are taken as they are. */
typedef struct {
    const char *p, *end, *start;
    const char *why; /* the error */
    char *out;       /* the decoded text */
    size_t n, cap;
} jreader;

static int jfail(jreader *j, const char *why) {
    if (!j->why)
        j->why = why;
    return -1;
}

static void jws(jreader *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\r' || *j->p == '\n'))
        j->p++;
}

static int jput(jreader *j, const char *b, size_t k) {
    if (j->n + k > j->cap) {
        size_t nc = j->cap ? j->cap : 256;
        while (nc < j->n + k)
            nc *= 2;
        char *no = realloc(j->out, nc);
        if (!no)
            return jfail(j, "out of memory");
        j->out = no;
        j->cap = nc;
    }
    memcpy(j->out + j->n, b, k);
    j->n += k;
    return 0;
}

static int hex4(const char *p, uint32_t *v) {
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

/* A string at j->p ('"'); decoded into j->out from j->n on when keep, else skipped. */
static int jstring(jreader *j, int keep) {
    j->p++; /* the opening quote */
    while (1) {
        const char *s = j->p;
        while (j->p < j->end && *j->p != '"' && *j->p != '\\' && (unsigned char)*j->p >= 0x20)
            j->p++;
        if (keep && j->p > s && jput(j, s, (size_t)(j->p - s)))
            return -1;
        if (j->p >= j->end)
            return jfail(j, "unterminated string");
        char c = *j->p;
        if (c == '"') {
            j->p++;
            return 0;
        }
        if (c != '\\')
            return jfail(j, "raw control character in a string");
        if (j->end - j->p < 2)
            return jfail(j, "unterminated string");
        char e = j->p[1];
        j->p += 2;
        static const char esc[] = "\"\\/bfnrt", val[] = "\"\\/\b\f\n\r\t";
        const char *simple = e ? strchr(esc, e) : NULL;
        if (simple) {
            if (keep && jput(j, &val[simple - esc], 1))
                return -1;
            continue;
        }
        if (e != 'u')
            return jfail(j, "invalid escape in a string");
        uint32_t cp;
        if (j->end - j->p < 4 || hex4(j->p, &cp))
            return jfail(j, "invalid \\u escape");
        j->p += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t lo;
            if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || hex4(j->p + 2, &lo) ||
                lo < 0xDC00 || lo > 0xDFFF)
                return jfail(j, "lone UTF-16 surrogate in a \\u escape");
            j->p += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return jfail(j, "lone UTF-16 surrogate in a \\u escape");
        }
        char u[4];
        size_t k;
        if (cp < 0x80) {
            u[0] = (char)cp, k = 1;
        } else if (cp < 0x800) {
            u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F)), k = 2;
        } else if (cp < 0x10000) {
            u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
            u[2] = (char)(0x80 | (cp & 0x3F)), k = 3;
        } else {
            u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
            u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[3] = (char)(0x80 | (cp & 0x3F)), k = 4;
        }
        if (keep && jput(j, u, k))
            return -1;
    }
}

static int jdigits(jreader *j) {
    const char *s = j->p;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9')
        j->p++;
    return j->p > s ? 0 : jfail(j, "malformed number");
}

static int jvalue(jreader *j, int depth);

static int jnumber(jreader *j) {
    if (*j->p == '-')
        j->p++;
    if (j->p < j->end && *j->p == '0')
        j->p++;
    else if (jdigits(j))
        return -1;
    if (j->p < j->end && *j->p == '.') {
        j->p++;
        if (jdigits(j))
            return -1;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-'))
            j->p++;
        if (jdigits(j))
            return -1;
    }
    return 0;
}

static int jword(jreader *j, const char *w) {
    size_t k = strlen(w);
    if ((size_t)(j->end - j->p) < k || memcmp(j->p, w, k) != 0)
        return jfail(j, "invalid value");
    j->p += k;
    return 0;
}

/* Members of an object (j->p at '{'); with want_key, decodes that member (a string)
 * into j->out and sets *found (a second one is an error). */
static int jobject(jreader *j, int depth, const char *want_key, int *found) {
    j->p++;
    jws(j);
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        return 0;
    }
    size_t wk = want_key ? strlen(want_key) : 0;
    while (1) {
        jws(j);
        if (j->p >= j->end || *j->p != '"')
            return jfail(j, "expected a member name");
        size_t mark = j->n;
        if (jstring(j, want_key != NULL))
            return -1;
        int is_key = want_key && j->n - mark == wk && memcmp(j->out + mark, want_key, wk) == 0;
        j->n = mark;
        jws(j);
        if (j->p >= j->end || *j->p != ':')
            return jfail(j, "expected ':'");
        j->p++;
        jws(j);
        if (is_key) {
            if (*found)
                return jfail(j, "the text member appears twice");
            if (j->p >= j->end || *j->p != '"')
                return jfail(j, "the text member is not a string");
            if (jstring(j, 1))
                return -1;
            *found = 1;
        } else if (jvalue(j, depth + 1)) {
            return -1;
        }
        jws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        if (j->p < j->end && *j->p == '}') {
            j->p++;
            return 0;
        }
        return jfail(j, "expected ',' or '}'");
    }
}

static int jvalue(jreader *j, int depth) {
    if (depth > JSON_MAX_DEPTH)
        return jfail(j, "nesting too deep");
    jws(j);
    if (j->p >= j->end)
        return jfail(j, "missing value");
    char c = *j->p;
    if (c == '"')
        return jstring(j, 0);
    if (c == '{') {
        int found = 0;
        return jobject(j, depth, NULL, &found);
    }
    if (c == '[') {
        j->p++;
        jws(j);
        if (j->p < j->end && *j->p == ']') {
            j->p++;
            return 0;
        }
        while (1) {
            if (jvalue(j, depth + 1))
                return -1;
            jws(j);
            if (j->p < j->end && *j->p == ',') {
                j->p++;
                continue;
            }
            if (j->p < j->end && *j->p == ']') {
                j->p++;
                return 0;
            }
            return jfail(j, "expected ',' or ']'");
        }
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return jnumber(j);
    if (c == 't')
        return jword(j, "true");
    if (c == 'f')
        return jword(j, "false");
    if (c == 'n')
        return jword(j, "null");
    return jfail(j, "invalid value");
}

/* The text of one record: 0 with j->out[0..j->n), or -1 with j->why set. */
static int jsonl_text(jreader *j, const char *rec, size_t len, const char *key) {
    j->p = j->start = rec;
    j->end = rec + len;
    j->why = NULL;
    j->n = 0;
    jws(j);
    if (j->p >= j->end || *j->p != '{')
        return jfail(j, "not a JSON object");
    int found = 0;
    if (jobject(j, 1, key, &found))
        return -1;
    jws(j);
    if (j->p != j->end)
        return jfail(j, "trailing bytes after the object");
    if (!found)
        return jfail(j, "the text member is missing");
    return 0;
}

/* Map every JSONL file and list its non-blank lines as units. */
static int jsonl_units(file_list *fl, unit **units, int64_t *n_units) {
    int64_t n = 0, cap = 0;
    unit *u = NULL;
    for (int64_t f = 0; f < fl->n; f++) {
        src_file *s = &fl->v[f];
        if (s->size == 0)
            continue;
        int fd = open(s->path, O_RDONLY);
        if (fd < 0) {
            fprintf(stderr, "%s: cannot open input %s: %s\n", PROG, s->path, strerror(errno));
            free(u);
            return 1;
        }
        void *m = mmap(NULL, (size_t)s->size, PROT_READ, MAP_PRIVATE, fd, 0);
        int e = errno;
        close(fd);
        if (m == MAP_FAILED) {
            fprintf(stderr, "%s: cannot map input %s (%llu bytes): %s\n", PROG, s->path,
                    (unsigned long long)s->size, strerror(e));
            free(u);
            return 1;
        }
        s->map = m;
        uint64_t pos = 0;
        for (int64_t line = 1; pos < s->size; line++) {
            const char *nl = memchr(s->map + pos, '\n', (size_t)(s->size - pos));
            uint64_t e2 = nl ? (uint64_t)(nl - s->map) : s->size;
            int blank = 1;
            for (uint64_t i = pos; i < e2 && blank; i++)
                blank = s->map[i] == ' ' || s->map[i] == '\t' || s->map[i] == '\r';
            if (!blank) {
                if (n == cap) {
                    int64_t nc = cap ? 2 * cap : 1024;
                    unit *nu = realloc(u, (size_t)nc * sizeof *nu);
                    if (!nu) {
                        fprintf(stderr, "%s: out of memory listing the records of %s\n", PROG,
                                s->path);
                        free(u);
                        return 1;
                    }
                    u = nu;
                    cap = nc;
                }
                u[n++] = (unit){f, line, pos, e2 - pos, 0};
            }
            pos = e2 + 1;
        }
    }
    *units = u;
    *n_units = n;
    return 0;
}

/* ---------------------------------------------------------------- the split */

static uint64_t unit_hash(const mopts *o, const file_list *fl, const unit *u) {
    const char *key = fl->v[u->file].key;
    if (!o->jsonl)
        return lm_shard_split_hash(o->seed, key, strlen(key));
    size_t k = strlen(key);
    char small[512];
    char *buf = k + 24 <= sizeof small ? small : malloc(k + 24);
    LM_CHECK(buf != NULL);
    int m = snprintf(buf, k + 24, "%s:%lld", key, (long long)u->line);
    uint64_t h = lm_shard_split_hash(o->seed, buf, (size_t)m);
    if (buf != small)
        free(buf);
    return h;
}

typedef struct {
    uint64_t h;
    int64_t i;
} hash_idx;

static int cmp_hash(const void *a, const void *b) {
    const hash_idx *x = a, *y = b;
    if (x->h != y->h)
        return x->h < y->h ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Mark the held-out units; 0, or 1 after printing why. */
static int choose_split(const mopts *o, const file_list *fl, unit *u, int64_t n) {
    if (o->split == 0)
        return 0;
    if (o->split == 1) {
        for (int64_t i = 0; i < n; i++)
            u[i].val = (uint8_t)lm_shard_split_is_val(unit_hash(o, fl, &u[i]), o->val_fraction);
        return 0;
    }
    if (o->val_files >= n) {
        fprintf(stderr, "%s: --val-files %lld leaves no training source (there are %lld %s)\n",
                PROG, (long long)o->val_files, (long long)n, o->jsonl ? "records" : "files");
        return 1;
    }
    hash_idx *hv = malloc((size_t)(n ? n : 1) * sizeof *hv);
    if (!hv) {
        fprintf(stderr, "%s: out of memory choosing the split\n", PROG);
        return 1;
    }
    for (int64_t i = 0; i < n; i++)
        hv[i] = (hash_idx){unit_hash(o, fl, &u[i]), i};
    qsort(hv, (size_t)n, sizeof *hv, cmp_hash);
    for (int64_t i = 0; i < o->val_files; i++)
        u[hv[i].i].val = 1;
    free(hv);
    return 0;
}

/* ---------------------------------------------------------------- split writers */

typedef struct {
    char *path; /* relative to the manifest's directory */
    uint64_t tokens, documents;
    int64_t first_src, last_src; /* -1: none */
} shard_rec;

typedef struct {
    int64_t file;
    uint64_t records, documents, bytes, tokens;
    int64_t first_shard; /* -1: no tokens */
} src_rec;

typedef struct {
    const char *name; /* "train" | "val" */
    const char *dir;
    uint32_t vocab;
    uint64_t cap; /* --shard-tokens */
    int32_t *buf;
    uint64_t n, alloc;
    shard_rec cur;
    shard_rec *shards;
    int64_t n_shards, shards_cap;
    src_rec *srcs;
    int64_t n_srcs, srcs_cap;
    uint64_t tokens, documents, bytes, records;
} split_w;

static char *shard_name(const char *split, int64_t i) {
    char b[64];
    snprintf(b, sizeof b, "%s-%05lld.bin", split, (long long)i);
    return dupstr(b);
}

static int flush_shard(split_w *w) {
    if (w->n == 0)
        return 0;
    char *name = shard_name(w->name, w->n_shards);
    char *full = name ? join2(w->dir, "/", name) : NULL;
    lm_error err = {0};
    if (!full || lm_shard_write(full, w->vocab, w->buf, w->n, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", PROG, full ? err.msg : "out of memory");
        free(name);
        free(full);
        return 1;
    }
    free(full);
    if (w->n_shards == w->shards_cap) {
        int64_t nc = w->shards_cap ? 2 * w->shards_cap : 16;
        shard_rec *ns = realloc(w->shards, (size_t)nc * sizeof *ns);
        if (!ns) {
            free(name);
            fprintf(stderr, "%s: out of memory\n", PROG);
            return 1;
        }
        w->shards = ns;
        w->shards_cap = nc;
    }
    w->cur.path = name;
    w->cur.tokens = w->n;
    w->shards[w->n_shards++] = w->cur;
    w->cur = (shard_rec){NULL, 0, 0, -1, -1};
    w->n = 0;
    return 0;
}

/* Append k tokens of the current source to the open shard (k <= cap - n). */
static int put_tokens(split_w *w, const int32_t *t, uint64_t k) {
    if (w->n + k > w->alloc) {
        uint64_t na = w->alloc ? w->alloc : 4096;
        while (na < w->n + k)
            na *= 2;
        if (na > w->cap)
            na = w->cap;
        int32_t *nb = realloc(w->buf, (size_t)na * sizeof *nb);
        if (!nb) {
            fprintf(stderr, "%s: cannot allocate a shard buffer of %llu tokens\n", PROG,
                    (unsigned long long)na);
            return 1;
        }
        w->buf = nb;
        w->alloc = na;
    }
    memcpy(w->buf + w->n, t, (size_t)k * sizeof *t);
    w->n += k;
    src_rec *s = &w->srcs[w->n_srcs - 1];
    if (s->first_shard < 0)
        s->first_shard = w->n_shards;
    if (w->cur.first_src < 0)
        w->cur.first_src = w->n_srcs - 1;
    w->cur.last_src = w->n_srcs - 1;
    return 0;
}

/* One document (its tokens, the closing <|endoftext|> last) of the current source: a
 * shard that cannot take it whole is closed first; only a document longer than a
 * whole shard is cut. */
static int put_doc(split_w *w, const int32_t *t, uint64_t len) {
    if (w->n > 0 && w->n + len > w->cap && flush_shard(w))
        return 1;
    while (len > 0) {
        uint64_t k = len < w->cap - w->n ? len : w->cap - w->n;
        if (put_tokens(w, t, k))
            return 1;
        t += k;
        len -= k;
        if (len > 0 && flush_shard(w))
            return 1;
    }
    w->cur.documents++;
    return 0;
}

/* Start (or, for records of the same JSONL file, continue) the source record of file f. */
static int begin_source(split_w *w, int64_t f, int jsonl) {
    if (jsonl && w->n_srcs > 0 && w->srcs[w->n_srcs - 1].file == f)
        return 0;
    if (w->n_srcs == w->srcs_cap) {
        int64_t nc = w->srcs_cap ? 2 * w->srcs_cap : 256;
        src_rec *ns = realloc(w->srcs, (size_t)nc * sizeof *ns);
        if (!ns) {
            fprintf(stderr, "%s: out of memory\n", PROG);
            return 1;
        }
        w->srcs = ns;
        w->srcs_cap = nc;
    }
    w->srcs[w->n_srcs++] = (src_rec){f, 0, 0, 0, 0, -1};
    return 0;
}

/* The encoded output of one unit (documents separated by <|endoftext|>). */
typedef struct {
    int32_t *ids;
    int64_t n, cap, docs, bytes;
} unit_out;

static int add_unit(split_w *w, int64_t file, int jsonl, const unit_out *r, int32_t eot) {
    if (begin_source(w, file, jsonl))
        return 1;
    src_rec *s = &w->srcs[w->n_srcs - 1];
    s->records++;
    s->documents += (uint64_t)r->docs;
    s->bytes += (uint64_t)r->bytes;
    s->tokens += (uint64_t)r->n;
    w->records++;
    w->documents += (uint64_t)r->docs;
    w->bytes += (uint64_t)r->bytes;
    w->tokens += (uint64_t)r->n;
    int64_t a = 0;
    for (int64_t i = 0; i < r->n; i++)
        if (r->ids[i] == eot) {
            if (put_doc(w, r->ids + a, (uint64_t)(i + 1 - a)))
                return 1;
            a = i + 1;
        }
    LM_CHECK(a == r->n); /* every document ends with its <|endoftext|> */
    return 0;
}

static void split_free(split_w *w) {
    for (int64_t i = 0; i < w->n_shards; i++)
        free(w->shards[i].path);
    free(w->shards);
    free(w->srcs);
    free(w->buf);
}

/* ---------------------------------------------------------------- the manifest */

static int write_text_atomic(const char *path, const char *text) {
    size_t n = strlen(text);
    char *tmp = malloc(strlen(path) + 32);
    if (!tmp) {
        fprintf(stderr, "%s: out of memory\n", PROG);
        return 1;
    }
    sprintf(tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    int bad = !f || fwrite(text, 1, n, f) != n || fflush(f) != 0 || fsync(fileno(f)) != 0;
    int e = errno;
    if (f && fclose(f) != 0 && !bad)
        bad = 1, e = errno;
    if (!bad && rename(tmp, path) != 0)
        bad = 1, e = errno;
    if (bad) {
        fprintf(stderr, "%s: cannot write %s: %s\n", PROG, path, strerror(e));
        unlink(tmp);
    }
    free(tmp);
    return bad;
}

static cJSON *split_totals(const split_w *w, int jsonl) {
    cJSON *t = cJSON_CreateObject();
    cJSON_AddNumberToObject(t, jsonl ? "files" : "sources", (double)w->n_srcs);
    if (jsonl)
        cJSON_AddNumberToObject(t, "records", (double)w->records);
    cJSON_AddNumberToObject(t, "documents", (double)w->documents);
    cJSON_AddNumberToObject(t, "bytes", (double)w->bytes);
    cJSON_AddNumberToObject(t, "tokens", (double)w->tokens);
    cJSON_AddNumberToObject(t, "shards", (double)w->n_shards);
    return t;
}

static int write_manifest(const mopts *o, const file_list *fl, const lm_tokenizer *tok,
                          const split_w *w, const split_w *train, const split_w *val,
                          int64_t n_units) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "format", LM_MANIFEST_FORMAT);
    cJSON_AddNumberToObject(m, "version", LM_MANIFEST_VERSION);
    cJSON_AddStringToObject(m, "split", w->name);
    cJSON_AddStringToObject(m, "tokenizer", lm_tokenizer_name(tok));
    cJSON_AddNumberToObject(m, "vocab", lm_tokenizer_vocab_size(tok));
    cJSON_AddNumberToObject(m, "eot", lm_tokenizer_eot(tok));
    cJSON_AddNumberToObject(m, "tokens", (double)w->tokens);
    cJSON_AddNumberToObject(m, "documents", (double)w->documents);
    cJSON_AddNumberToObject(m, "bytes", (double)w->bytes);
    cJSON_AddNumberToObject(m, "shard_tokens", (double)o->shard_tokens);
    cJSON *in = cJSON_AddObjectToObject(m, "input");
    cJSON_AddStringToObject(in, "mode", o->jsonl ? "jsonl" : "files");
    cJSON *ins = cJSON_AddArrayToObject(in, "inputs");
    for (int i = 0; i < o->n_inputs; i++)
        cJSON_AddItemToArray(ins, cJSON_CreateString(o->inputs[i]));
    if (o->ext)
        cJSON_AddStringToObject(in, "ext", o->ext);
    else
        cJSON_AddNullToObject(in, "ext");
    if (o->jsonl)
        cJSON_AddStringToObject(in, "text_key", o->text_key);
    else
        cJSON_AddStringToObject(in, "doc_sep", o->sep_name);
    cJSON_AddNumberToObject(in, "files", (double)fl->n);
    cJSON_AddNumberToObject(in, "sources", (double)n_units);
    cJSON *ho = cJSON_AddObjectToObject(m, "held_out");
    cJSON_AddStringToObject(ho, "rule",
                            o->split == 0   ? "none"
                            : o->split == 1 ? "val_fraction"
                                            : "val_files");
    if (o->split == 1)
        cJSON_AddNumberToObject(ho, "val_fraction", o->val_fraction);
    if (o->split == 2)
        cJSON_AddNumberToObject(ho, "val_files", (double)o->val_files);
    cJSON_AddNumberToObject(ho, "seed", (double)o->seed);
    cJSON_AddStringToObject(ho, "unit", o->jsonl ? "record (KEY:LINE)" : "file (its path)");
    cJSON_AddStringToObject(ho, "hash", "lm_shard_split_hash (include/linmoe/shard.h)");
    cJSON_AddItemToObject(ho, "train", split_totals(train, o->jsonl));
    cJSON_AddStringToObject(ho, "train_manifest", "train.json");
    if (o->split) {
        cJSON_AddItemToObject(ho, "val", split_totals(val, o->jsonl));
        cJSON_AddStringToObject(ho, "val_manifest", "val.json");
    }
    cJSON *sh = cJSON_AddArrayToObject(m, "shards");
    for (int64_t i = 0; i < w->n_shards; i++) {
        const shard_rec *r = &w->shards[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "path", r->path);
        cJSON_AddNumberToObject(e, "tokens", (double)r->tokens);
        cJSON_AddNumberToObject(e, "documents", (double)r->documents);
        cJSON *se = cJSON_AddArrayToObject(e, "sources"); /* [first, last] in "sources" */
        cJSON_AddItemToArray(se, cJSON_CreateNumber((double)r->first_src));
        cJSON_AddItemToArray(se, cJSON_CreateNumber((double)r->last_src));
        cJSON_AddItemToArray(sh, e);
    }
    cJSON *ss = cJSON_AddArrayToObject(m, "sources");
    for (int64_t i = 0; i < w->n_srcs; i++) {
        const src_rec *r = &w->srcs[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "path", fl->v[r->file].key);
        if (o->jsonl)
            cJSON_AddNumberToObject(e, "records", (double)r->records);
        cJSON_AddNumberToObject(e, "documents", (double)r->documents);
        cJSON_AddNumberToObject(e, "bytes", (double)r->bytes);
        cJSON_AddNumberToObject(e, "tokens", (double)r->tokens);
        if (r->first_shard >= 0)
            cJSON_AddNumberToObject(e, "shard", (double)r->first_shard);
        else
            cJSON_AddNullToObject(e, "shard");
        cJSON_AddItemToArray(ss, e);
    }
    char *text = cJSON_Print(m);
    cJSON_Delete(m);
    char file[32];
    snprintf(file, sizeof file, "%s.json", w->name);
    char *path = join2(o->out_dir, "/", file);
    char *full = text && path ? join2(text, "", "\n") : NULL;
    int rc =
        full ? write_text_atomic(path, full) : (fprintf(stderr, "%s: out of memory\n", PROG), 1);
    free(full);
    free(text);
    free(path);
    return rc;
}

/* Remove split-NNNNN.bin for NNNNN >= from (an earlier run's leftovers); and the
 * split's manifest too when drop_manifest. */
static void remove_stale(const char *dir, const char *split, int64_t from, int drop_manifest) {
    for (int64_t i = from;; i++) {
        char *name = shard_name(split, i);
        char *p = name ? join2(dir, "/", name) : NULL;
        int gone = !p || unlink(p) != 0;
        free(name);
        free(p);
        if (gone)
            break;
    }
    if (drop_manifest) {
        char file[32];
        snprintf(file, sizeof file, "%s.json", split);
        char *p = join2(dir, "/", file);
        if (p)
            unlink(p);
        free(p);
    }
}

static int make_dirs(const char *dir) {
    char *p = dupstr(dir);
    if (!p)
        return 1;
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char c = *s;
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                fprintf(stderr, "%s: cannot create directory %s: %s\n", PROG, p, strerror(errno));
                free(p);
                return 1;
            }
            *s = c;
            if (!c)
                break;
        }
    }
    free(p);
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "%s: --out-dir %s is not a directory\n", PROG, dir);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- encoding */

/* Encode unit u into r with tokenizer t (one thread). 0, or -1 with err set. */
static int encode_unit(const mopts *o, const file_list *fl, const unit *u, lm_tokenizer *t,
                       jreader *j, unit_out *r, lm_error *err) {
    const src_file *s = &fl->v[u->file];
    memset(r, 0, sizeof *r);
    if (o->jsonl) {
        if (jsonl_text(j, s->map + u->off, (size_t)u->len, o->text_key)) {
            lm_errorf(err, LM_ERR_FORMAT,
                      "%s:%lld: %s (want one JSON object per line with a string member \"%s\")",
                      s->path, (long long)u->line, j->why, o->text_key);
            return -1;
        }
        if (lm_tokenizer_encode_documents(t, j->out ? j->out : "", j->n, LM_DOCSEP_NONE, &r->ids,
                                          &r->n, &r->cap, &r->docs, &r->bytes, err) != LM_OK)
            return -1;
        return 0;
    }
    FILE *f = fopen(s->path, "rb");
    if (!f) {
        lm_errorf(err, LM_ERR_IO, "cannot open input %s: %s", s->path, strerror(errno));
        return -1;
    }
    char *text = malloc(s->size ? (size_t)s->size : 1);
    size_t got = text ? fread(text, 1, (size_t)s->size, f) : 0;
    int more = text && fgetc(f) != EOF;
    int bad = !text || got != s->size || ferror(f) || more;
    fclose(f);
    if (bad) {
        free(text);
        lm_errorf(err, LM_ERR_IO, "cannot read input %s: %s (%zu of %llu bytes)", s->path,
                  !text ? "out of memory" : "it changed size while being read", got,
                  (unsigned long long)s->size);
        return -1;
    }
    lm_status st = lm_tokenizer_encode_documents(t, text, (size_t)s->size, o->sep, &r->ids, &r->n,
                                                 &r->cap, &r->docs, &r->bytes, err);
    free(text);
    if (st != LM_OK) {
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err->msg);
        lm_errorf(err, st, "%s: %s", s->path, msg);
        return -1;
    }
    return 0;
}

static int tokenize_many(const mopts *o) {
    double t0 = lm_time_sec();
    if (o->threads > 0)
        lm_set_num_threads(o->threads);
    const int nt = lm_get_num_threads() > 0 ? lm_get_num_threads() : 1;
    int rc = LM_EXIT_BAD_INPUT;
    file_list fl = {0};
    unit *units = NULL;
    int64_t n_units = 0;
    lm_tokenizer **toks = calloc((size_t)nt, sizeof *toks);
    lm_error *terr = calloc((size_t)nt, sizeof *terr);
    jreader *jr = calloc((size_t)nt, sizeof *jr);
    unit_out *outs = NULL;
    split_w sw[2];
    memset(sw, 0, sizeof sw);
    if (!toks || !terr || !jr) {
        fprintf(stderr, "%s: out of memory\n", PROG);
        goto done;
    }
    if (list_inputs(o, &fl))
        goto done;
    if (fl.n == 0) {
        fprintf(stderr, "%s: the inputs hold no file%s%s\n", PROG, o->ext ? " ending in " : "",
                o->ext ? o->ext : "");
        goto done;
    }
    if (o->jsonl) {
        if (jsonl_units(&fl, &units, &n_units))
            goto done;
    } else {
        units = malloc((size_t)fl.n * sizeof *units);
        if (!units) {
            fprintf(stderr, "%s: out of memory\n", PROG);
            goto done;
        }
        for (int64_t i = 0; i < fl.n; i++)
            units[i] = (unit){i, 0, 0, fl.v[i].size, 0};
        n_units = fl.n;
    }
    if (choose_split(o, &fl, units, n_units))
        goto done;
    /* one tokenizer per thread (the GPT-2 piece cache is per tokenizer) */
    int open_bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : open_bad)
    {
        int id = omp_get_thread_num();
        if (lm_tokenizer_open(&toks[id], o->tok_name, o->tok_dir, &terr[id]) != LM_OK)
            open_bad = 1;
    }
    if (open_bad) {
        for (int i = 0; i < nt; i++)
            if (!toks[i]) {
                fprintf(stderr, "%s: %s\n", PROG, terr[i].msg);
                break;
            }
        goto done;
    }
    const int32_t eot = lm_tokenizer_eot(toks[0]);
    if (make_dirs(o->out_dir))
        goto done;
    for (int s = 0; s < 2; s++) {
        sw[s].name = s ? "val" : "train";
        sw[s].dir = o->out_dir;
        sw[s].vocab = (uint32_t)lm_tokenizer_vocab_size(toks[0]);
        sw[s].cap = o->shard_tokens;
        sw[s].cur = (shard_rec){NULL, 0, 0, -1, -1};
    }
    outs = calloc(BATCH_UNITS, sizeof *outs);
    if (!outs) {
        fprintf(stderr, "%s: out of memory\n", PROG);
        goto done;
    }
    uint64_t in_bytes = 0;
    for (int64_t b0 = 0; b0 < n_units;) {
        int64_t b1 = b0;
        uint64_t bytes = 0;
        while (b1 < n_units && b1 - b0 < BATCH_UNITS && (b1 == b0 || bytes < BATCH_BYTES))
            bytes += units[b1++].len;
        in_bytes += bytes;
        /* the first failing unit of the batch (in unit order) is the one reported */
        int64_t fail_at = -1;
        lm_error fail_err = {0};
#pragma omp parallel num_threads(nt)
        {
            const int id = omp_get_thread_num();
            int64_t my_fail = -1;
            lm_error my_err = {0};
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = b0; i < b1; i++) {
                if (my_fail >= 0)
                    continue;
                if (encode_unit(o, &fl, &units[i], toks[id], &jr[id], &outs[i - b0], &my_err))
                    my_fail = i;
            }
#pragma omp critical(lm_tokenize_fail)
            if (my_fail >= 0 && (fail_at < 0 || my_fail < fail_at)) {
                fail_at = my_fail;
                fail_err = my_err;
            }
        }
        int bad = 0;
        if (fail_at >= 0) {
            fprintf(stderr, "%s: %s\n", PROG, fail_err.msg);
            bad = 1;
        }
        for (int64_t i = b0; i < b1; i++) {
            if (!bad && add_unit(&sw[units[i].val], units[i].file, o->jsonl, &outs[i - b0], eot))
                bad = 1;
            free(outs[i - b0].ids);
            outs[i - b0].ids = NULL;
        }
        if (bad)
            goto done;
        b0 = b1;
    }
    for (int s = 0; s < 2; s++)
        if (flush_shard(&sw[s]))
            goto done;
    if (sw[0].documents == 0) {
        fprintf(stderr, "%s: the %s split holds no text (%lld sources%s, no documents)\n", PROG,
                "training", (long long)(n_units - (int64_t)sw[1].records),
                o->split ? " after the held-out split" : "");
        goto done;
    }
    if (o->split && sw[1].documents == 0) {
        fprintf(stderr,
                "%s: the held-out split holds no documents (%lld of %lld sources chosen); raise "
                "--val-fraction or use --val-files N\n",
                PROG, (long long)sw[1].records, (long long)n_units);
        goto done;
    }
    for (int s = 0; s < (o->split ? 2 : 1); s++)
        if (write_manifest(o, &fl, toks[0], &sw[s], &sw[0], &sw[1], n_units))
            goto done;
    remove_stale(o->out_dir, "train", sw[0].n_shards, 0);
    remove_stale(o->out_dir, "val", sw[1].n_shards, !o->split);
    if (!o->quiet) {
        printf("tokenize: %lld files, %lld sources, %llu bytes read, tokenizer %s (vocab %d), %d "
               "threads (%.2f s)\n",
               (long long)fl.n, (long long)n_units, (unsigned long long)in_bytes,
               lm_tokenizer_name(toks[0]), lm_tokenizer_vocab_size(toks[0]), nt,
               lm_time_sec() - t0);
        for (int s = 0; s < (o->split ? 2 : 1); s++) {
            const split_w *w = &sw[s];
            uint64_t text_tokens = w->tokens - w->documents;
            printf("  %-5s %llu %s, %llu documents, %llu bytes -> %llu tokens (%llu + %llu "
                   "<|endoftext|>), %.3f bytes/token, %lld shards -> %s/%s.json\n",
                   w->name, (unsigned long long)w->records, o->jsonl ? "records" : "files",
                   (unsigned long long)w->documents, (unsigned long long)w->bytes,
                   (unsigned long long)w->tokens, (unsigned long long)text_tokens,
                   (unsigned long long)w->documents,
                   text_tokens ? (double)w->bytes / (double)text_tokens : 0.0,
                   (long long)w->n_shards, o->out_dir, w->name);
        }
    }
    rc = LM_EXIT_OK;
done:
    for (int s = 0; s < 2; s++)
        split_free(&sw[s]);
    free(outs);
    for (int i = 0; toks && i < nt; i++)
        lm_tokenizer_free(toks[i]);
    for (int i = 0; jr && i < nt; i++)
        free(jr[i].out);
    free(toks);
    free(terr);
    free(jr);
    free(units);
    for (int64_t i = 0; i < fl.n; i++) {
        if (fl.v[i].map)
            munmap((void *)fl.v[i].map, (size_t)fl.v[i].size);
        free(fl.v[i].path);
        free(fl.v[i].key);
    }
    free(fl.v);
    return rc;
}

/* ---------------------------------------------------------------- flags */

static int parse_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (s[0] == '-' || end == s || *end != '\0' || errno != 0 || v < lo || v > hi) {
        fprintf(stderr, "%s: %s '%s' is not an integer in [%llu, %llu]\n", PROG, flag, s,
                (unsigned long long)lo, (unsigned long long)hi);
        return -1;
    }
    *out = v;
    return 0;
}

int lm_cli_tokenize(int argc, char **argv) {
    /* argv[0] == "tokenize" */
    const char *name = NULL, *dir = NULL, *in = NULL, *out = NULL, *sep_s = NULL;
    const char *out_dir = NULL, *ext = NULL, *text_key = NULL, *shard_s = NULL, *vf_s = NULL,
               *vn_s = NULL, *seed_s = NULL, *threads_s = NULL;
    int quiet = 0, jsonl = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_tokenize_usage(stdout);
            return LM_EXIT_OK;
        }
    }
    char **inputs = calloc((size_t)argc, sizeof *inputs);
    if (!inputs) {
        fprintf(stderr, "%s: out of memory\n", PROG);
        return LM_EXIT_BAD_INPUT;
    }
    int n_inputs = 0, only_inputs = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (only_inputs || a[0] != '-' || strcmp(a, "-") == 0) {
            inputs[n_inputs++] = argv[i];
            continue;
        }
        const char **dst = strcmp(a, "--tokenizer") == 0      ? &name
                           : strcmp(a, "--gpt2-dir") == 0     ? &dir
                           : strcmp(a, "--in") == 0           ? &in
                           : strcmp(a, "--out") == 0          ? &out
                           : strcmp(a, "--doc-sep") == 0      ? &sep_s
                           : strcmp(a, "--out-dir") == 0      ? &out_dir
                           : strcmp(a, "--ext") == 0          ? &ext
                           : strcmp(a, "--text-key") == 0     ? &text_key
                           : strcmp(a, "--shard-tokens") == 0 ? &shard_s
                           : strcmp(a, "--val-fraction") == 0 ? &vf_s
                           : strcmp(a, "--val-files") == 0    ? &vn_s
                           : strcmp(a, "--split-seed") == 0   ? &seed_s
                           : strcmp(a, "--threads") == 0      ? &threads_s
                                                              : NULL;
        if (dst) {
            if (i + 1 >= argc) {
                fprintf(stderr, "linmoe tokenize: option %s needs a value\n", a);
                free(inputs);
                return LM_EXIT_USAGE;
            }
            *dst = argv[++i];
        } else if (strcmp(a, "--quiet") == 0) {
            quiet = 1;
        } else if (strcmp(a, "--jsonl") == 0) {
            jsonl = 1;
        } else if (strcmp(a, "--") == 0) {
            only_inputs = 1;
        } else {
            fprintf(stderr,
                    "linmoe tokenize: unknown argument '%s' (see `linmoe tokenize --help`)\n", a);
            free(inputs);
            return LM_EXIT_USAGE;
        }
    }
    int rc = LM_EXIT_USAGE;
    const int many = out_dir != NULL || n_inputs > 0;
    if (many && (in || out)) {
        fprintf(stderr,
                "%s: %s cannot be combined with %s (one file: --in TEXT --out SHARD; "
                "many: --out-dir DIR INPUT...)\n",
                PROG, in ? "--in" : "--out", out_dir ? "--out-dir" : "input paths");
        goto out;
    }
    if (!many && (ext || text_key || shard_s || vf_s || vn_s || seed_s || threads_s || jsonl)) {
        fprintf(stderr,
                "%s: --ext, --jsonl, --text-key, --shard-tokens, --val-*, --split-seed "
                "and --threads go with --out-dir DIR INPUT...\n",
                PROG);
        goto out;
    }
    if (!name || (!many && (!in || !out)) || (many && (!out_dir || n_inputs == 0))) {
        fprintf(stderr, "linmoe tokenize: missing %s (see `linmoe tokenize --help`)\n",
                !name  ? "--tokenizer byte|gpt2"
                : many ? (!out_dir ? "--out-dir DIR" : "INPUT (files or directories)")
                : !in  ? "--in TEXT"
                       : "--out SHARD");
        goto out;
    }
    if (strcmp(name, "byte") != 0 && strcmp(name, "gpt2") != 0) {
        fprintf(stderr, "linmoe tokenize: --tokenizer '%s' is not one of byte, gpt2\n", name);
        goto out;
    }
    if (!sep_s)
        sep_s = many ? "none" : "ff";
    lm_docsep sep;
    if (strcmp(sep_s, "ff") == 0)
        sep = LM_DOCSEP_FORMFEED;
    else if (strcmp(sep_s, "blank") == 0)
        sep = LM_DOCSEP_BLANK;
    else if (strcmp(sep_s, "none") == 0)
        sep = LM_DOCSEP_NONE;
    else {
        fprintf(stderr, "linmoe tokenize: --doc-sep '%s' is not one of ff, blank, none\n", sep_s);
        goto out;
    }
    if (!many) {
        free(inputs);
        return tokenize_one(name, dir, in, out, sep, quiet);
    }
    mopts o = {0};
    o.tok_name = name;
    o.tok_dir = dir;
    o.out_dir = out_dir;
    o.ext = ext && ext[0] ? ext : NULL;
    o.text_key = text_key ? text_key : "text";
    o.sep = sep;
    o.sep_name = sep_s;
    o.jsonl = jsonl;
    o.quiet = quiet;
    o.inputs = inputs;
    o.n_inputs = n_inputs;
    o.shard_tokens = DEFAULT_SHARD_TOKENS;
    if (jsonl && (text_key == NULL ? 0 : text_key[0] == '\0')) {
        fprintf(stderr, "%s: --text-key must not be empty\n", PROG);
        goto out;
    }
    if (!jsonl && text_key) {
        fprintf(stderr, "%s: --text-key goes with --jsonl\n", PROG);
        goto out;
    }
    if (jsonl && strcmp(sep_s, "none") != 0) {
        fprintf(stderr, "%s: --doc-sep does not apply to --jsonl (a record is one document)\n",
                PROG);
        goto out;
    }
    uint64_t v;
    if (shard_s) {
        if (parse_u64("--shard-tokens", shard_s, 1, (uint64_t)1 << 40, &v))
            goto out;
        o.shard_tokens = v;
    }
    if (seed_s) {
        if (parse_u64("--split-seed", seed_s, 0, (uint64_t)1 << 53, &v)) /* exact in JSON */
            goto out;
        o.seed = v;
    }
    if (threads_s) {
        if (parse_u64("--threads", threads_s, 0, 4096, &v))
            goto out;
        o.threads = (int)v;
    }
    if (vf_s && vn_s) {
        fprintf(stderr, "%s: give --val-fraction or --val-files, not both\n", PROG);
        goto out;
    }
    if (vf_s) {
        char *end = NULL;
        errno = 0;
        double f = strtod(vf_s, &end);
        if (end == vf_s || *end != '\0' || errno != 0 || !(f >= 0.0 && f < 1.0)) {
            fprintf(stderr, "%s: --val-fraction '%s' is not a number in [0, 1)\n", PROG, vf_s);
            goto out;
        }
        o.val_fraction = f;
        o.split = f > 0.0 ? 1 : 0;
    }
    if (vn_s) {
        if (parse_u64("--val-files", vn_s, 0, (uint64_t)INT64_MAX, &v))
            goto out;
        o.val_files = (int64_t)v;
        o.split = v > 0 ? 2 : 0;
    }
    rc = tokenize_many(&o);
out:
    free(inputs);
    return rc;
}
