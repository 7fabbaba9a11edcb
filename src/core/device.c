/* Devices (include/linmoe/backend.h): parsing and naming. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/backend.h"

lm_status lm_device_parse(const char *s, const char *what, lm_device *out, lm_error *err) {
    const char *w = what ? what : "device";
    if (!s || !out)
        return lm_errorf(err, LM_ERR_INVALID, "%s: missing device name", w);
    if (strcmp(s, "cpu") == 0) {
        *out = (lm_device){LM_DEVICE_CPU, 0};
        return LM_OK;
    }
    if (strcmp(s, "cuda") == 0) {
        *out = (lm_device){LM_DEVICE_CUDA, 0};
        return LM_OK;
    }
    if (strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9') {
        char *end = NULL;
        errno = 0;
        const long v = strtol(s + 5, &end, 10);
        if (errno == 0 && end && *end == '\0' && v >= 0 && v < 1024) {
            *out = (lm_device){LM_DEVICE_CUDA, (int)v};
            return LM_OK;
        }
    }
    return lm_errorf(err, LM_ERR_INVALID, "%s: '%s' is not a device (cpu, cuda or cuda:N)", w, s);
}

const char *lm_device_name(lm_device d, char *buf, size_t size) {
    if (d.type == LM_DEVICE_CUDA)
        snprintf(buf, size, "cuda:%d", d.index);
    else
        snprintf(buf, size, "cpu");
    return buf;
}
