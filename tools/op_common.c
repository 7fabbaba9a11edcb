/* Small helpers shared by the subcommands (tools/): metadata booleans, shapes,
 * checkpoint arguments, flag values. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "cli.h"
#include "linmoe/train.h"

void lm_cli_fmt_shape(char *buf, size_t size, int ndim, const int64_t *shape) {
    size_t used = 0;
    int n = snprintf(buf, size, "[");
    if (n > 0) used = (size_t)n;
    for (int i = 0; i < ndim && used < size; i++) {
        n = snprintf(buf + used, size - used, "%s%lld", i ? "," : "", (long long)shape[i]);
        if (n < 0) break;
        used += (size_t)n;
    }
    if (used < size) snprintf(buf + used, size - used, "]");
}

int lm_cli_parse_bool(const char *s, int *out) {
    if (strcasecmp(s, "true") == 0 || strcmp(s, "1") == 0) {
        *out = 1;
        return 0;
    }
    if (strcasecmp(s, "false") == 0 || strcmp(s, "0") == 0) {
        *out = 0;
        return 0;
    }
    return -1;
}

/* A checkpoint argument: a checkpoint directory (holds model.safetensors), a run
 * directory (RUN/ckpt/latest names the newest checkpoint), a run's ckpt/ directory,
 * or the `latest` file itself. Writes the checkpoint directory to out; on failure
 * out = arg and `why` (when non-NULL) says what is wrong with arg: it does not exist,
 * its `latest` is dangling or unreadable, or it is neither kind of directory. */
int lm_cli_resolve_ckpt_why(const char *arg, char *out, size_t size, char *why, size_t why_size) {
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/model.safetensors", arg);
    if (stat(path, &sb) == 0) {
        snprintf(out, size, "%s", arg);
        return 0;
    }
    lm_error err = {0};
    if (lm_train_latest_checkpoint(arg, out, size, &err) == LM_OK) return 0;
    char first[sizeof err.msg];
    snprintf(first, sizeof first, "%s", err.msg);
    snprintf(path, sizeof path, "%s/ckpt/latest", arg);
    const int has_latest = lstat(path, &sb) == 0;
    /* ARG is RUN/ckpt, or RUN/ckpt/latest */
    char run[4096];
    snprintf(run, sizeof run, "%s", arg);
    size_t n = strlen(run);
    while (n > 1 && run[n - 1] == '/') run[--n] = '\0';
    const char *tails[] = {"/ckpt/latest", "/ckpt"};
    for (int i = 0; i < 2; i++) {
        size_t t = strlen(tails[i]);
        if (n > t && strcmp(run + n - t, tails[i]) == 0) {
            run[n - t] = '\0';
            if (lm_train_latest_checkpoint(run, out, size, &err) == LM_OK) return 0;
            if (why && stat(arg, &sb) != 0 && stat(run, &sb) != 0) /* no RUN at all */
                snprintf(why, why_size, "%s: no such checkpoint or run directory", arg);
            else if (why)
                snprintf(why, why_size, "%s", err.msg);
            snprintf(out, size, "%s", arg);
            return -1;
        }
    }
    if (why) {
        if (stat(arg, &sb) != 0)
            snprintf(why, why_size, "%s: no such checkpoint or run directory", arg);
        else if (has_latest) /* a run directory whose latest is dangling or unreadable */
            snprintf(why, why_size, "%s", first);
        else if (!S_ISDIR(sb.st_mode))
            snprintf(why, why_size, "%s: not a checkpoint or run directory (a file)", arg);
        else
            snprintf(why, why_size,
                     "%s: not a checkpoint directory (no model.safetensors) nor a run directory "
                     "(no ckpt/latest)",
                     arg);
    }
    snprintf(out, size, "%s", arg);
    return -1;
}

int lm_cli_resolve_ckpt(const char *arg, char *out, size_t size) {
    return lm_cli_resolve_ckpt_why(arg, out, size, NULL, 0);
}

/* `--name VALUE` / `--name=VALUE` at argv[*i]: 1 matched (value in *val, *i advanced
 * past a separate value), 0 not this flag, -1 value missing (reported as
 * "PROG: option NAME needs a value"). */
int lm_cli_flag_val(const char *prog, int argc, char **argv, int *i, const char *name,
                    const char **val) {
    const char *a = argv[*i];
    const size_t n = strlen(name);
    if (strncmp(a, name, n) != 0)
        return 0;
    if (a[n] == '=' && a[n + 1]) {
        *val = a + n + 1;
        return 1;
    }
    if (a[n] == '\0' && *i + 1 < argc) {
        *val = argv[++*i];
        return 1;
    }
    if (a[n] != '\0' && a[n] != '=')
        return 0;
    fprintf(stderr, "%s: option %s needs a value\n", prog, name);
    return -1;
}

/* A decimal integer in [lo, hi]: 0 and *out set, or -1 with a message naming the flag. */
int lm_cli_parse_long(const char *prog, const char *flag, const char *s, long lo, long hi,
                      long *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi) {
        fprintf(stderr, "%s: %s '%s' is not an integer in [%ld, %ld]\n", prog, flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}
