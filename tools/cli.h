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

/* "[d0,d1,...]" into buf (truncated to size). */
void lm_cli_fmt_shape(char *buf, size_t size, int ndim, const int64_t *shape);
/* Metadata booleans: true|false (any case) or 1|0. Returns 0 and sets *out, or -1. */
int lm_cli_parse_bool(const char *s, int *out);

#endif
