/* linmoe CLI internals: the entry points that tools/linmoe.c dispatches to once the
 * flags are parsed. Not a public API (nothing outside tools/ and bench/ uses it).
 *
 * Exit codes shared by every subcommand:
 *   0  success
 *   1  bad input (a file, tensor, attribute or value is wrong) or an I/O failure
 *   2  usage error (unknown subcommand or flag, missing flag value)
 */
#ifndef LINMOE_TOOLS_CLI_H
#define LINMOE_TOOLS_CLI_H

#include "linmoe/kda.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/serve.h"
#include "linmoe/tokenizer.h"

#define LM_EXIT_OK 0
#define LM_EXIT_BAD_INPUT 1
#define LM_EXIT_USAGE 2

/* `linmoe op kda|gdn --in IN --out OUT` on the CPU (tools/op_kda.c). Reads IN,
 * validates it, runs the op (and its backward when IN holds `do` or `dht`), writes
 * OUT atomically. Messages go to stderr, prefixed with `prog`. Returns an exit code. */
/* use_cuda: run the forward on the GPU (include/linmoe/kda_cuda.h; inputs rounded to
 * bf16, o returned as the bf16 values in fp32); the backward stays on the CPU. */
int lm_cli_op_kda(const char *prog, lm_kda_kind kind, const char *in_path, const char *out_path,
                  int use_cuda);

/* A checkpoint argument (checkpoint dir, run dir, RUN/ckpt or RUN/ckpt/latest) to the
 * checkpoint directory in out (tools/op_common.c). 0 when resolved; -1: out = arg. */
int lm_cli_resolve_ckpt(const char *arg, char *out, size_t size);
/* The same; on failure (-1) `why` says what is wrong with arg ("ARG: no such checkpoint
 * or run directory", a dangling `latest`, neither kind of directory). */
int lm_cli_resolve_ckpt_why(const char *arg, char *out, size_t size, char *why, size_t why_size);

/* Flag parsing shared by the subcommands (tools/op_common.c): `--name VALUE` or
 * `--name=VALUE` at argv[*i] -> 1 (value in *val), 0 not this flag, -1 missing value
 * (reported with prog); a decimal integer in [lo, hi] -> 0, else -1 (reported). */
int lm_cli_flag_val(const char *prog, int argc, char **argv, int *i, const char *name,
                    const char **val);
int lm_cli_parse_long(const char *prog, const char *flag, const char *s, long lo, long hi,
                      long *out);

/* The options `linmoe serve` and `linmoe bench serve` share (tools/serve.c): the
 * checkpoint, its tokenizer and the model's threads, and what both do with them. */
typedef struct {
    const char *ckpt;      /* --ckpt: checkpoint or run directory (required) */
    const char *tokenizer; /* --tokenizer byte|gpt2; NULL: byte for vocab 257, else gpt2 */
    const char *gpt2_dir;  /* --gpt2-dir (data/gpt2) */
    long threads;          /* --threads: OpenMP threads of the model; 0 = OpenMP's default */
    long decode_threads;   /* --decode-threads: threads a decode step's rows split over (1) */
} lm_cli_serve_opts;
void lm_cli_serve_opts_default(lm_cli_serve_opts *o);
/* argv[*i] if it is one of the shared options: 1 (taken, with its value), -1 a usage
 * error (printed with prog), 0 not one of them. */
int lm_cli_serve_opt(const char *prog, int argc, char **argv, int *i, lm_cli_serve_opts *o);
/* The options' lines of a --help text. */
extern const char lm_cli_serve_opts_help[];

/* A loaded checkpoint ready to serve (lm_cli_serve_open). */
typedef struct {
    lm_params p;
    lm_tokenizer *tok;
    lm_model *m;
    const char *tok_name;
    char ckpt[4096]; /* the resolved checkpoint directory */
    int have_p;
} lm_cli_served;
/* Applies o's threads (lm_set_num_threads; ec->decode_threads), loads the checkpoint,
 * opens the tokenizer and makes the model for engine config ec (lm_engine_model_tokens).
 * Errors are printed with prog; returns LM_EXIT_OK, LM_EXIT_USAGE (no --ckpt) or
 * LM_EXIT_BAD_INPUT. lm_cli_serve_close frees what it made, also after an error. */
int lm_cli_serve_open(const char *prog, const lm_cli_serve_opts *o, lm_engine_config *ec,
                      lm_cli_served *s);
void lm_cli_serve_close(lm_cli_served *s);

/* "[d0,d1,...]" into buf (truncated to size). */
void lm_cli_fmt_shape(char *buf, size_t size, int ndim, const int64_t *shape);
/* Metadata booleans: true|false (any case) or 1|0. Returns 0 and sets *out, or -1. */
int lm_cli_parse_bool(const char *s, int *out);

#endif
