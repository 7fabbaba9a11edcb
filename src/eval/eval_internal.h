/* What the CPU and the GPU evals share (src/eval/eval.c, eval_gpu.c): the pinned
 * bits-per-byte protocol's walk over the validation documents (include/linmoe/eval.h)
 * and the greedy argmax. Not a public API. */
#ifndef LINMOE_EVAL_INTERNAL_H
#define LINMOE_EVAL_INTERNAL_H

#include <stdint.h>

#include "linmoe/eval.h"

typedef struct {
    uint64_t start; /* shard index of the window's first predicted token w_0 */
    int len;        /* tokens in the window */
} lm_eval_window;

/* The batch of windows w[0 .. nb) as [nb, T] ids / labels (T = the longest window):
 * row b reads [<|endoftext|>, w_0, .., w_{len-2}] and predicts w_0 .. w_{len-1}; the
 * rest of a short row is padding (ids eot, labels LM_MODEL_IGNORE). Returns T. ids and
 * labels hold nb * seq_len entries. */
int lm_eval_fill_windows(const lm_shard *val, int32_t eot, const lm_eval_window *w, int nb,
                         int32_t *ids, int32_t *labels);

/* Scores a batch of windows, adding to the caller's nll and token sums. */
typedef lm_status (*lm_eval_score_fn)(void *ctx, const lm_eval_window *w, int nb,
                                      lm_error *err);

/* The protocol's checks (seq_len >= 2, a non-empty shard, shard vocab == tokenizer
 * vocab <= model_vocab, tokens in range), the byte length of every token, and the walk:
 * every document cut into windows of seq_len tokens, handed to score in batches of at
 * most *rows windows (*rows is read before each window: score may lower it). Fills
 * out->documents, windows and bytes; the caller fills nll_nats, tokens, bits_per_byte. */
lm_status lm_eval_bpb_walk(const lm_tokenizer *tok, const lm_shard *val, int model_vocab,
                           int seq_len, int *rows, lm_eval_score_fn score, void *ctx,
                           lm_eval_bpb_result *out, lm_error *err);

/* Index of the largest value (ties to the lower index; NaN loses). */
int32_t lm_eval_argmax(const float *x, int n);

#endif
