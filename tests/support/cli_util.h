/* Helpers shared by the CLI tests (tests/test_cli*.c): a per-test-binary temporary
 * directory, paths inside it, case-insensitive output checks, and safetensors
 * writing in any float dtype. */
#ifndef LINMOE_TEST_CLI_UTIL_H
#define LINMOE_TEST_CLI_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "linmoe/safetensors.h"

/* cmocka group setup / teardown: create (mkdtemp under /tmp) and remove the
 * temporary directory, with every file in it. */
int lm_cli_setup_dir(void **state);
int lm_cli_teardown_dir(void **state);
/* The temporary directory itself. */
const char *lm_cli_dir(void);
/* "<dir>/<name>" in one of 8 rotating static buffers. */
const char *lm_cli_path(const char *name);
/* 1 when `needle` occurs in `hay`, ignoring ASCII case (an empty needle matches). */
int lm_contains_ci(const char *hay, const char *needle);
/* Assert that the captured output mentions `needle` (printing the output if not). */
void lm_assert_says(const char *out, const char *needle);
/* Add tensor `name` converted from fp32 to dtype F32, F64, BF16 or F16. */
void lm_writer_add_as(lm_st_writer *w, const char *name, lm_dtype dt, int nd, const int64_t *shape,
                      const float *x);
/* Save (asserting success) and free the writer. */
void lm_writer_save(lm_st_writer *w, const char *path);

#endif
