/* libFuzzer driver of one target (scripts/fuzz.sh builds it with clang
 * -fsanitize=fuzzer,address,undefined -DLM_FUZZ_TARGET=\"name\"). */
#include <stdlib.h>

#include "targets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const lm_fuzz_target *t;
    if (!t && !(t = lm_fuzz_find(LM_FUZZ_TARGET)))
        abort();
    return t->run(data, size);
}
