#include "cli_util.h"

#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[64];

int lm_cli_setup_dir(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe_test_cli_XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return -1;
    }
    return 0;
}

int lm_cli_teardown_dir(void **state) {
    (void)state;
    DIR *d = opendir(g_dir);
    if (d) {
        struct dirent *de;
        char p[512];
        while ((de = readdir(d)) != NULL) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
            snprintf(p, sizeof p, "%s/%s", g_dir, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(g_dir);
    return 0;
}

const char *lm_cli_dir(void) { return g_dir; }

const char *lm_cli_path(const char *name) {
    static char buf[8][512];
    static int next = 0;
    char *p = buf[next];
    next = (next + 1) % 8;
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

int lm_contains_ci(const char *hay, const char *needle) {
    size_t n = strlen(needle);
    for (const char *h = hay; *h; h++) {
        size_t i = 0;
        while (i < n && h[i] && tolower((unsigned char)h[i]) == tolower((unsigned char)needle[i])) i++;
        if (i == n) return 1;
    }
    return n == 0;
}

void lm_assert_says(const char *out, const char *needle) {
    if (!lm_contains_ci(out, needle)) print_message("expected '%s' in the output:\n%s\n", needle, out);
    assert_true(lm_contains_ci(out, needle));
}

void lm_writer_add_as(lm_st_writer *w, const char *name, lm_dtype dt, int nd, const int64_t *shape,
                      const float *x) {
    lm_error err = {LM_OK, ""};
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    void *buf = malloc((size_t)(n > 0 ? n : 1) * 8);
    assert_non_null(buf);
    for (int64_t i = 0; i < n; i++) {
        switch (dt) {
        case LM_F64: ((double *)buf)[i] = x[i]; break;
        case LM_BF16: ((uint16_t *)buf)[i] = lm_f32_to_bf16(x[i]); break;
        case LM_F16: ((uint16_t *)buf)[i] = lm_f32_to_f16(x[i]); break;
        default: ((float *)buf)[i] = x[i]; break;
        }
    }
    lm_status st = lm_st_writer_add(w, name, dt, nd, shape, buf, &err);
    if (st != LM_OK) print_message("writer_add %s: %s\n", name, err.msg);
    assert_int_equal(st, LM_OK);
    free(buf);
}

void lm_writer_save(lm_st_writer *w, const char *path) {
    lm_error err = {LM_OK, ""};
    lm_status st = lm_st_writer_save(w, path, &err);
    if (st != LM_OK) print_message("save %s: %s\n", path, err.msg);
    assert_int_equal(st, LM_OK);
    lm_st_writer_free(w);
}
