/* Small helpers shared by the op runners (tools/op_*.c). */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "cli.h"

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
