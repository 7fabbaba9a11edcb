/* test_backend_ops: every op of the hybrid MoE model on CUDA against the CPU fp32
 * reference, same random inputs, several shapes (odd sizes, T not a multiple of the chunk,
 * empty and length-1 documents in cu_seqlens); prints one table row per compared tensor:
 * op x dtype x shape x tensor x rel RMS error x tolerance (tests/backend_ops/bo.h).
 *
 * Without a CUDA device (or in a build without CUDA) it exits 77, which CTest reports as
 * skipped. An op family whose file is absent from this build is listed as "not built" and
 * counts as a failure: every family below must exist. */
#include <stdio.h>
#include <string.h>

#include "bo.h"
#include "linmoe/kda_cuda.h"

#define FAMILIES(X)                                                                                \
    X(embedding)                                                                                   \
    X(norm) X(swiglu) X(short_conv) X(gemm) X(attention) X(router) X(moe) X(attnres)               \
        X(cross_entropy) X(adamw) X(dispatch)

#define DECL(n) int bo_family_##n(bo_ctx *c) __attribute__((weak));
FAMILIES(DECL)
#undef DECL

typedef struct {
    const char *name;
    int (*fn)(bo_ctx *);
} family;

int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : NULL;
    if (lm_cuda_device_count() <= 0) {
        printf("test_backend_ops: no CUDA device (or built without CUDA): skipped\n");
        return 77;
    }
    bo_ctx c = {0};
    lm_error e = {0};
    if (lm_cuda_ctx_new(&c.cuda, 0, &e) != LM_OK) {
        printf("test_backend_ops: %s\n", e.msg);
        return 1;
    }
    lm_rng_init(&c.rng, 20261201);
    const family fams[] = {
#define ENTRY(n) {#n, bo_family_##n},
        FAMILIES(ENTRY)
#undef ENTRY
    };
    printf("| %-14s | %-5s | %-34s | %-10s | %9s | %6s | %s |\n", "op", "dtype", "shape", "tensor",
           "rel RMS", "tol", "result");
    printf("|----------------|-------|------------------------------------|------------|-----------"
           "|--------|------|\n");
    int missing = 0;
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) {
        if (only && strcmp(only, fams[i].name) != 0)
            continue;
        c.family = fams[i].name;
        if (!fams[i].fn) {
            printf("| %-14s | not built in this tree |\n", fams[i].name);
            missing++;
            continue;
        }
        fams[i].fn(&c);
    }
    lm_cuda_ctx_free(c.cuda);
    printf("test_backend_ops: %d rows, %d failed, %d families not built\n", c.rows, c.failed,
           missing);
    return (c.failed || missing) ? 1 : 0;
}
