/* Arenas: one aligned allocation carved into 64-byte aligned pieces. */
#include "linmoe/core.h"

#include <stdlib.h>
#include <string.h>

#define LM_ARENA_ALIGN ((size_t)64)

lm_status lm_arena_init(lm_arena *a, size_t cap_bytes, lm_error *err) {
    LM_CHECK(a != NULL);
    memset(a, 0, sizeof *a);
    if (cap_bytes > SIZE_MAX - LM_ARENA_ALIGN)
        return lm_errorf(err, LM_ERR_NOMEM, "arena: capacity %zu bytes is too large", cap_bytes);
    /* aligned_alloc wants a multiple of the alignment and a non-zero size. */
    size_t alloc = (cap_bytes + LM_ARENA_ALIGN - 1) / LM_ARENA_ALIGN * LM_ARENA_ALIGN;
    if (alloc == 0)
        alloc = LM_ARENA_ALIGN;
    a->base = aligned_alloc(LM_ARENA_ALIGN, alloc);
    if (!a->base)
        return lm_errorf(err, LM_ERR_NOMEM, "arena: cannot allocate %zu bytes", cap_bytes);
    a->cap = cap_bytes;
    a->used = 0;
    return LM_OK;
}

void *lm_arena_alloc(lm_arena *a, size_t bytes, lm_error *err) {
    LM_CHECK(a != NULL);
    if (!a->base) {
        lm_errorf(err, LM_ERR_INVALID, "arena: allocation of %zu bytes from an uninitialised arena",
                  bytes);
        return NULL;
    }
    /* base is 64-byte aligned, so aligning the offset aligns the pointer. */
    size_t start = (a->used + LM_ARENA_ALIGN - 1) / LM_ARENA_ALIGN * LM_ARENA_ALIGN;
    if (start > a->cap || bytes > a->cap - start) {
        lm_errorf(err, LM_ERR_NOMEM,
                  "arena: request of %zu bytes does not fit (used %zu of %zu bytes, %zu free)",
                  bytes, a->used, a->cap, start > a->cap ? (size_t)0 : a->cap - start);
        return NULL;
    }
    a->used = start + bytes;
    return a->base + start;
}

void lm_arena_reset(lm_arena *a) {
    LM_CHECK(a != NULL);
    a->used = 0;
}

void lm_arena_free(lm_arena *a) {
    if (!a)
        return;
    free(a->base);
    a->base = NULL;
    a->cap = 0;
    a->used = 0;
}
