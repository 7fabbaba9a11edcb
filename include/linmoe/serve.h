/* linmoe serving engine (issue 23): one scheduler doing continuous batching over a pool
 * of per-sequence states, chunked prefill, and a prefix cache of full per-layer state
 * checkpoints; and the OpenAI-compatible HTTP front end built on it (lm_server_*).
 *
 * State pool. One lm_model_cache of max_seqs rows (model.h): per row the KDA recurrent
 * state [H, Dh, Dh] fp32 and the short-conv states of every KDA layer, and the attention
 * layers' KV cache [max_len, Hkv, D] fp32. The pool is sized by max_seqs and max_len
 * alone (lm_engine_pool_bytes), not by a block allocator shared with the KV cache, so
 * neither caps the other. Running rows are packed at the front: rows [0, n_decode)
 * decode together in one batched step (one GEMM per weight over all of them, the KDA
 * recurrent step over their states, attention decode over each row's own KV cache);
 * row n_decode holds the sequence being prefilled. A finishing row is refilled with the
 * last running row (lm_model_cache_copy_row) and a new sequence's row is reset before
 * use, so nothing of a previous sequence survives in a reused slot
 * (tests/test_serve.c reuses slots thousands of times against fresh-state runs).
 *
 * Scheduling (lm_engine_step, FCFS): cancelled sequences are retired; waiting requests
 * are admitted while a row is free (one prefill at a time); the prefilling sequence
 * advances by whole blocks of block_tokens tokens (the last one partial), at least one
 * block per step and more while the step's token budget (max_batch_tokens minus the
 * decoding rows) allows, so a long prompt never stalls the running decodes for more than
 * about max_batch_tokens tokens of work; then every decoding row takes one token. Block
 * boundaries sit at fixed positions (multiples of block_tokens), whatever the load and
 * whether the prefix cache is on, so a sequence's prefill is the same computation in
 * every case.
 *
 * Prefix cache: a radix tree whose edges are blocks of block_tokens prompt tokens
 * (default 64); the node of a block holds that block's keys and values for every
 * attention layer and the full recurrent state (KDA state and conv states of every KDA
 * layer) after the block, fp32. A new request walks the tree along its prompt, restores
 * the longest cached prefix (always leaving at least one prompt token to compute, which
 * gives the first logits) and prefills only the rest; the blocks it computes are added.
 * Nodes are evicted least recently used first, leaves only (a node's keys are needed by
 * its descendants), never a node a prefilling sequence stands on, to keep the tree
 * within state_cache_bytes. With the cache on or off the computation after a restore is
 * the one that produced the cached state, so outputs are identical.
 *
 * Sampling: each request has its own lm_sampler seeded with its seed (sample.h), and its
 * first token is drawn from the prompt's last logits; `linmoe generate` runs this engine
 * with one row, so a served completion equals generate's with the same seed.
 *
 * Threads: an lm_engine is not thread-safe; one thread calls everything (the HTTP
 * server's scheduler thread). Callbacks run in that thread, inside lm_engine_step. With
 * decode_threads = W > 1 a decode step splits its rows into W contiguous groups, one per
 * thread (the calling one and W - 1 the engine starts, each with its own lm_model over
 * the same parameters), and runs every op of a group on one OpenMP thread: a small
 * model's ops are too short to share out, but the rows are independent, and each row's
 * result is the one it gets alone whatever the grouping (model.h: inference is
 * batch-independent), so outputs do not depend on W. A prefill runs on the calling
 * thread with its OpenMP threads.
 *
 * What this module does not do: the GPU (the scheduler will drive the GPU model with the
 * same calls), paged KV memory, speculative decoding, caching generated tokens.
 */
#ifndef LINMOE_SERVE_H
#define LINMOE_SERVE_H

#include "linmoe/core.h"
#include "linmoe/model.h"
#include "linmoe/sample.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int max_seqs;              /* rows of the state pool (sequences running at once), >= 1 */
    int64_t max_len;           /* tokens per sequence, prompt + generated, >= 2 */
    int max_batch_tokens;      /* token budget of one step (decode rows + prefill), >= 1 */
    int block_tokens;          /* prefill block and prefix-cache granularity, >= 1 */
    int64_t state_cache_bytes; /* prefix cache budget in bytes; 0 = no prefix cache */
    int max_queue;             /* waiting requests (not yet running) at most, >= 0 */
    int decode_threads;        /* threads a decode step's rows are split over, 1 .. 256 */
} lm_engine_config;

/* max_seqs 16, max_len 2048, max_batch_tokens 256, block_tokens 64, 256 MiB, queue 256,
 * 1 decode thread. */
void lm_engine_config_default(lm_engine_config *c);

typedef struct {
    const int32_t *prompt; /* [n_prompt] token ids (copied at submit) */
    int64_t n_prompt;      /* >= 1 */
    int64_t max_tokens;    /* tokens to generate at most, >= 0 */
    lm_sampler_config sampler;
    uint64_t seed;      /* the sampler's Philox seed */
    int32_t stop_token; /* generation ends when this token is drawn (not emitted); -1: none */
    void *user;         /* handed back in every event of this request */
} lm_engine_request;

typedef enum {
    LM_FINISH_NONE = 0, /* a token event: the sequence goes on */
    LM_FINISH_STOP,     /* stop_token drawn, or the callback asked to stop */
    LM_FINISH_LENGTH,   /* max_tokens generated (or max_len reached) */
    LM_FINISH_CANCEL,   /* lm_engine_cancel */
    LM_FINISH_ERROR     /* the model failed (err names it); the sequence is dropped */
} lm_finish_reason;

typedef struct {
    int64_t id;          /* the request's id (lm_engine_submit) */
    void *user;          /* the request's user pointer */
    int32_t token;       /* the drawn token (finish == NONE), else -1 */
    const float *logits; /* [V] fp32 logits the token was drawn from (token events) */
    int64_t index;       /* 0-based index of the token among the generated ones */
    int64_t n_cached;    /* prompt tokens restored from the prefix cache */
    lm_finish_reason finish;
    const char *error; /* finish == ERROR: the message */
} lm_engine_event;

/* Called for every generated token (finish NONE) and once at the end (finish != NONE,
 * token -1). Returning nonzero from a token event ends the sequence with
 * LM_FINISH_STOP (a stop string matched); the end event's return value is ignored. The
 * event and its logits are valid during the call only. */
typedef int (*lm_engine_callback)(void *ctx, const lm_engine_event *ev);

typedef struct {
    int64_t waiting, running, decoding; /* now */
    int64_t last_batch;                 /* rows in the last decode step */
    int64_t steps, decode_tokens, prefill_tokens;
    int64_t prefix_lookups, prefix_hits, prefix_hit_tokens; /* per admitted request */
    int64_t prefix_nodes, prefix_bytes, prefix_evictions;
} lm_engine_stats;

typedef struct lm_engine lm_engine;

/* An engine over the model `m` (borrowed; its max_tokens must be >= max(max_seqs,
 * max_batch_tokens, block_tokens): lm_engine_model_tokens). cb(cb_ctx, ev) receives
 * the events. Allocates the state pool (LM_ERR_NOMEM naming its bytes). Errors:
 * LM_ERR_INVALID naming the field and value of a bad config. */
lm_status lm_engine_new(lm_engine **out, lm_model *m, const lm_engine_config *c,
                        lm_engine_callback cb, void *cb_ctx, lm_error *err);
void lm_engine_free(lm_engine *e);
/* Tokens one model call of this config needs at most. */
int64_t lm_engine_model_tokens(const lm_engine_config *c);
/* Bytes of the state pool of this config for model m. */
int64_t lm_engine_pool_bytes(const lm_model *m, const lm_engine_config *c);

/* Queue a request; *id gets its id (> 0). Errors: LM_ERR_INVALID naming the field
 * (n_prompt < 1 or an id outside [0, V), max_tokens < 0, a bad sampler config),
 * LM_ERR_RANGE when n_prompt + max_tokens > max_len ("prompt too long": the message
 * names both), LM_ERR_BUSY when max_queue requests wait already. Nothing is queued on
 * error. */
lm_status lm_engine_submit(lm_engine *e, const lm_engine_request *r, int64_t *id, lm_error *err);
/* Cancel request id (waiting or running): its row is freed at the next step, which
 * delivers its end event (LM_FINISH_CANCEL). Unknown or finished ids: no effect. */
void lm_engine_cancel(lm_engine *e, int64_t id);
/* Cancel every waiting and running request (a server shutting down). */
void lm_engine_cancel_all(lm_engine *e);
/* One scheduler iteration (see above). *did_work (may be NULL) = 0 when there was
 * nothing to do. Errors from the model end the affected sequences with LM_FINISH_ERROR
 * and are not returned; the return value is LM_OK unless the engine itself is unusable. */
lm_status lm_engine_step(lm_engine *e, int *did_work, lm_error *err);
/* Requests waiting or running. */
int64_t lm_engine_pending(const lm_engine *e);
void lm_engine_get_stats(const lm_engine *e, lm_engine_stats *s);
/* Drop every prefix-cache node (tests, benchmarks). */
void lm_engine_clear_prefix_cache(lm_engine *e);

#ifdef __cplusplus
}
#endif
#endif
