/* Status codes, error messages with context, and aborting allocators. */
#include "linmoe/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* The message is (re)written by the call that detects the failure; callers that only
 * propagate a status (LM_TRY) leave it alone, so the innermost, most specific message
 * survives. An lm_error may be reused across calls: a new failure overwrites it. */
lm_status lm_errorf(lm_error *err, lm_status st, const char *fmt, ...) {
    if (!err)
        return st;
    err->status = st;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        err->msg[0] = '\0';
    return st;
}

const char *lm_status_str(lm_status st) {
    switch (st) {
    case LM_OK:
        return "ok";
    case LM_ERR_INVALID:
        return "invalid argument";
    case LM_ERR_IO:
        return "I/O error";
    case LM_ERR_FORMAT:
        return "malformed file";
    case LM_ERR_NOMEM:
        return "out of memory";
    case LM_ERR_UNSUPPORTED:
        return "unsupported";
    case LM_ERR_NONFINITE:
        return "non-finite value";
    case LM_ERR_RANGE:
        return "beyond a limit";
    case LM_ERR_BUSY:
        return "busy";
    }
    return "unknown status";
}

void *lm_xmalloc(size_t n, const char *file, int line) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "%s:%d: out of memory allocating %zu bytes\n", file, line, n);
        abort();
    }
    return p;
}

void *lm_xcalloc(size_t n, size_t sz, const char *file, int line) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) {
        fprintf(stderr, "%s:%d: out of memory allocating %zu x %zu bytes\n", file, line, n, sz);
        abort();
    }
    return p;
}
