/* linmoe fuzz targets (issue 25 item 1): one entry per parser that reads input a user did
 * not write. Each takes arbitrary bytes, must return 0 and must never crash, hang, leak or
 * trip ASan / UBSan; a broken invariant (a round trip that does not round-trip) aborts.
 * Used by the libFuzzer drivers (fuzz_main.c, scripts/fuzz.sh, clang) and by the corpus
 * replay test (replay.c, the normal build, CTest fuzz_corpus_replay). Not thread-safe:
 * the targets keep one-time state (tokenizers, a tiny model) in statics. */
#ifndef LINMOE_FUZZ_TARGETS_H
#define LINMOE_FUZZ_TARGETS_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name; /* also the corpus directory tests/fuzz/corpus/<name> */
    int (*run)(const uint8_t *data, size_t size);
    int (*available)(void); /* 0: skip (e.g. data/gpt2 missing) */
} lm_fuzz_target;

extern const lm_fuzz_target lm_fuzz_targets[];
extern const int lm_fuzz_n_targets;
const lm_fuzz_target *lm_fuzz_find(const char *name);
#endif
