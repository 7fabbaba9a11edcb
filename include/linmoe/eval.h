/* linmoe evals: bits per byte under one pinned protocol, passkey retrieval accuracy,
 * MoE balance and AttnRes depth-weight summaries (issue 5 item 7), and the JSON
 * report behind `linmoe eval` (also usable by the trainer for evals.jsonl).
 *
 * Bits per byte (the pinned protocol): the validation shard's documents (split at
 * <|endoftext|>) are each cut into consecutive non-overlapping windows of seq_len
 * tokens (the last one shorter); window w_0 .. w_{n-1} is scored from a fresh state
 * with the input [<|endoftext|>, w_0, .., w_{n-2}] predicting w_0 .. w_{n-1}; the
 * separator itself is never predicted. bits_per_byte = (sum of -log2 p over every
 * predicted token) / (UTF-8 bytes of the documents, i.e. the decoded tokens' bytes).
 * Windows are batched (padding at the end of short windows is ignored).
 * Details: empty documents (two separators in a row) are skipped and not counted;
 * tokens after the last separator form a last document; the forward runs with
 * training = 0 (dropless MoE) and -log p comes from the model's fused cross-entropy
 * (the router aux losses, if any, are taken out again). Batches are [B, T] with T =
 * the longest window of the batch and B as many windows as the model accepts (found
 * by halving when lm_model_forward refuses B*T > max_tokens; at most 256 windows and
 * 2^20 tokens per batch).
 *
 * Passkey accuracy (passkey.h documents of `length` tokens, index 0..samples-1 of
 * stream `seed`): the model reads ids[0 .. answer_pos) (prefill, one sequence at a
 * time, chunks halved while the model refuses them), then decodes greedily (argmax,
 * ties to the lower id) with the cache; a sample is correct when the greedy
 * continuation reproduces the tokens ids[answer_pos .. digits_end) exactly (the 5
 * digits and what precedes them).
 *
 * Errors: those of the model, tokenizer and shard; LM_ERR_INVALID for seq_len < 2,
 * an empty shard, a vocabulary mismatch (shard vocab != tokenizer vocab, or a
 * tokenizer vocab larger than the model's vocab_size), a shard token outside the
 * vocab (names its index), samples < 1.
 *
 * What this module does not do: training-time metrics (the trainer's router
 * metrics), sampling (sample.h), file output.
 */
#ifndef LINMOE_EVAL_H
#define LINMOE_EVAL_H

#include "linmoe/core.h"
#include "linmoe/model.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

struct cJSON;

typedef struct {
    double bits_per_byte;
    double nll_nats; /* total */
    int64_t bytes, tokens, windows, documents;
} lm_eval_bpb_result;

/* m must have max_tokens >= seq_len (it batches as many windows as fit). */
lm_status lm_eval_bpb(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                      lm_eval_bpb_result *out, lm_error *err);

/* What the bits-per-byte pass saw besides the loss (lm_eval_bpb_stats; owned, free
 * with lm_eval_stats_free; zero-initialise before the call):
 *   expert_counts [n_layers, n_experts] int64: routed-expert selections (top-k
 *     picks) summed over every scored token (padding excluded) of every window; rows
 *     of dense layers stay 0. NULL when the model has no MoE layer.
 *   attnres_weights [n_sublayers, max_sources] fp64, n_sources [n_sublayers]: per
 *     sublayer l (l = 0 .. 2L-1, l = 2L the final aggregation) the AttnRes depth
 *     weights (lm_model_attnres_weights) averaged over all bpb batches, each batch
 *     weighted by its B*T positions (the padding of short windows included: the API
 *     averages over every position); n_sublayers = 0 with the standard residual. */
typedef struct {
    int n_layers, n_experts;
    int64_t *expert_counts;
    int n_sublayers, max_sources;
    int *n_sources;
    double *attnres_weights;
} lm_eval_stats;
void lm_eval_stats_free(lm_eval_stats *s);

/* lm_eval_bpb, also filling `stats` (may be NULL). */
lm_status lm_eval_bpb_stats(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                            lm_eval_bpb_result *out, lm_eval_stats *stats, lm_error *err);

typedef struct {
    int length, samples, correct;
    double accuracy; /* correct / samples */
    /* partial credit: answer tokens to reproduce (sum over samples of digits_end -
     * answer_pos) and those reproduced before each sample's first miss */
    int64_t answer_tokens, prefix_tokens;
} lm_eval_passkey_result;

lm_status lm_eval_passkey(lm_model *m, lm_tokenizer *tok, const lm_shard *filler, int length,
                          int samples, uint64_t seed, lm_eval_passkey_result *out, lm_error *err);

/* The two evals split over `world` data-parallel ranks (issue 24; rank `rank` runs
 * its part, the caller sums the parts over the ranks): bits per byte scores the
 * windows whose index in the walk's order is rank mod world, and fills nll_nats and
 * tokens with its part's sums, bytes / windows / documents with the whole shard's
 * (every rank walks all of it), bits_per_byte from its part (recompute it from the
 * summed nll); passkey runs the samples s with s mod world == rank: samples, correct,
 * answer_tokens, prefix_tokens are its part's, accuracy too (NaN with no sample).
 * rank 0 of 1 is lm_eval_bpb / lm_eval_passkey. Errors: theirs, and a bad rank. */
lm_status lm_eval_bpb_part(lm_model *m, const lm_tokenizer *tok, const lm_shard *val, int seq_len,
                           int rank, int world, lm_eval_bpb_result *out, lm_error *err);
lm_status lm_eval_passkey_part(lm_model *m, lm_tokenizer *tok, const lm_shard *filler, int length,
                               int samples, uint64_t seed, int rank, int world,
                               lm_eval_passkey_result *out, lm_error *err);

/* The same two evals with the GPU model (include/linmoe/gpu_model.h), for
 * `linmoe train --device cuda` (src/eval/eval_gpu.c):
 *   bits per byte: the pinned protocol above, batches of at most
 *     lm_gpu_model_max_tokens(m) tokens (and 256 windows), -log p per token from the
 *     fused cross-entropy (lm_gpu_model_eval's nll: the router aux losses never enter);
 *   passkey: one forward over ids[0 .. digits_end) per sample (teacher forcing); a
 *     sample is correct when the argmax (ties to the lower id) of the logits at every
 *     position answer_pos - 1 .. digits_end - 2 is the next token: the greedy decode of
 *     lm_eval_passkey reproduces the answer exactly when this holds, so the accuracy and
 *     the prefix count have the same meaning. length <= lm_gpu_model_max_tokens(m).
 * Errors: as above, plus the GPU model's. */
struct lm_gpu_model;
lm_status lm_eval_bpb_gpu(struct lm_gpu_model *m, const lm_tokenizer *tok, const lm_shard *val,
                          int seq_len, lm_eval_bpb_result *out, lm_error *err);
lm_status lm_eval_passkey_gpu(struct lm_gpu_model *m, lm_tokenizer *tok, const lm_shard *filler,
                              int length, int samples, uint64_t seed, lm_eval_passkey_result *out,
                              lm_error *err);

/* Balance of one MoE layer from its selection counts [E] (reference/moe.md §8.2,
 * as lm_router_metrics): maxvio = max_e c_e / mean - 1, min_load = min_e c_e / mean,
 * dead = experts with c_e = 0, load[e] = c_e / sum (may be NULL). No selections:
 * maxvio 0, min_load 0, dead = E, load 0. */
void lm_eval_balance(const int64_t *counts, int E, double *maxvio, double *min_load, int *dead,
                     double *load);

/* Everything `linmoe eval` reports, run in this order: bits per byte (with stats),
 * then passkey accuracy at each length. */
typedef struct {
    int seq_len;                /* bpb window length, >= 2 */
    const int *passkey_lengths; /* [n_passkey] (may be NULL with n_passkey = 0) */
    int n_passkey;
    int passkey_samples; /* >= 1 when n_passkey > 0 */
    uint64_t passkey_seed;
    const lm_shard *filler; /* passkey filler; NULL: the validation shard */
    /* optional progress report (the CLI's terminal line): called after every scored batch
     * of the bits-per-byte pass ("bits per byte", tokens scored, of about `total`: the
     * shard's tokens) and after every passkey sample ("passkey", samples done, of total,
     * `length` the document length); NULL: none */
    void (*progress)(void *ctx, const char *what, int length, int64_t done, int64_t total);
    void *progress_ctx;
} lm_eval_options;

/* Run the evals and add to the JSON object `obj` (cJSON *, not owned):
 *   "seq_len", "bits_per_byte", "nll_nats", "bytes", "tokens", "windows",
 *   "documents", "passkey": [{"length", "samples", "correct", "accuracy",
 *   "answer_tokens", "prefix_tokens"}...],
 *   "moe": [per MoE layer {"layer", "maxvio", "min_load", "dead", "load": [E]}]
 *     (lm_eval_balance of the bpb pass's selection counts; [] for a dense model),
 *   "attnres": [per sublayer {"sublayer", "weights": [...]}] (only with AttnRes).
 * Non-finite numbers become null. Errors: those of the evals; LM_ERR_NOMEM when the
 * JSON cannot be built. */
lm_status lm_eval_report(lm_model *m, lm_tokenizer *tok, const lm_shard *val,
                         const lm_eval_options *o, struct cJSON *obj, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
