/* linmoe training data loader: turns a token shard (shard.h) into micro-batches of
 * input ids and next-token labels for lm_model_forward, in one of two modes, with
 * synthetic passkey rows and long-document rows mixed in; seeded, resumable from a
 * small state, and rank-aware.
 *
 * The shard may be a manifest's (lm_shard_open of a `linmoe tokenize --out-dir`
 * train.json / val.json): its shards are one stream in their listed order, so
 * everything below applies to the concatenation, and a document that a shard
 * boundary cut is one document again. Same stream, same batches: a manifest and a
 * single shard of the same tokens give identical rows (tests/test_tokenize_shards.c).
 *
 * Documents: the shard's tokens split at <|endoftext|> (EOT); t_0 .. t_{n-1} are a
 * document's tokens without its separator, empty documents are skipped. Rows have
 * S = seq_len tokens. Every row is one of three kinds, drawn per row (u uniform in
 * [0, 1) from the row's random draw):
 *   u < passkey_fraction                      passkey row: passkey.h documents
 *       (seed, index) of exactly Lp = passkey_length tokens (default S; filler from
 *       this shard), floor(S / Lp) of them, each its own piece: input ids, labels
 *       ids shifted by one then LM_MODEL_IGNORE (trained on the whole document);
 *       a remainder becomes a pad piece of EOTs with IGNORE labels. Short passkey
 *       documents early in training are a curriculum: the key sits a few dozen
 *       tokens back and the prose around it is a small part of the row.
 *   u < passkey_fraction + long_doc_fraction  long-document row: a document with
 *       n >= S, chosen uniformly among those, at a uniformly random start a.
 *   u < passkey_fraction + long_doc_fraction + repeat_fraction
 *                                             repeat row (the copy / induction task):
 *       a span X of m tokens (m uniform in [8, 24], at most (S-1)/2), each drawn
 *       independently from the shard's unigram distribution (the token at a
 *       uniformly random offset; an EOT gives the next non-EOT token), inserted R
 *       times (R uniform in [2, 8], at most (S-1)/m) into prose: ids = [EOT, P_0, X,
 *       P_1, X, ..., X, P_R], the P_r consecutive non-EOT shard tokens from a random
 *       offset, their lengths set by R sorted uniform cut points of the S-1-R*m
 *       prose positions; labels = ids[1..S) then LM_MODEL_IGNORE. Every copy of X
 *       after the first is predictable only by copying from context, anywhere in a
 *       row of prose, which is the induction mechanism passkey retrieval needs
 *       (Olsson et al. 2022, "In-context Learning and Induction Heads"); a small
 *       model does not acquire it from a few million tokens of prose alone. One
 *       piece (packing) or one row (windows).
 *   otherwise                                 stream row (below).
 *
 * Mode packing = 0 (random windows): a stream row is S+1 consecutive shard tokens w
 * at a uniformly random offset (crossing documents as GPT-2 style training does):
 * ids = w[0..S), labels = w[1..S]. A long-document row takes its S+1 tokens inside
 * u = t_0 .. t_{n-1}, EOT (a in [0, n-S]). Micro-batch: B = rows, T = S, no
 * cu_seqlens.
 *
 * Mode packing = 1 (document packing): documents are visited in a seeded random
 * order (a fresh permutation per epoch) and packed into rows as pieces; a piece is
 *   ids    = [EOT, t_a, .., t_{b-1}]           (b - a + 1 tokens)
 *   labels = [t_a, .., t_{b-1}, X]   X = EOT   when b == n (the document's own
 *                                              separator ends it),
 *                                    X = IGNORE when the piece was cut at the row's
 *                                              end (t_b starts the next piece, which
 *                                              predicts it from EOT).
 * This is the bits-per-byte protocol of eval.h (every window scored from a fresh
 * state after an EOT). A row is filled with pieces until full; a single leftover
 * position becomes a pad piece [EOT] with label IGNORE. A long-document row is one
 * piece [EOT, t_a .. t_{a+S-2}] (a in [0, n-S+1]). The micro-batch is B = 1 row of
 * T = rows*S tokens with cu_seqlens at every piece boundary (so nothing crosses a
 * document or row boundary: the model restarts state and RoPE positions per piece).
 *
 * Randomness: every draw is a pure function of (seed, global row index g), with
 * g = rows_done * world_size + rank (Philox, core.h), the passkey index
 * passkeys_done * world_size + rank, and the epoch permutation of (seed, epoch).
 * So the stream is reproduced exactly from lm_loader_state, and ranks draw
 * disjoint rows: in packing mode rank r takes the documents at positions
 * r, r + W, r + 2W, ... of each epoch's permutation (W = world_size).
 *
 * Stages: lm_loader_set_stage changes S, the mode and the fractions; the state (row
 * counter, document cursor) carries over, so a stage change continues the stream.
 *
 * Errors (LM_ERR_INVALID, naming the shard and the value): S < 2, fractions
 * outside [0, 1] or summing above 1, repeat_fraction > 0 with S < 10, a window mode shard shorter than S+1 tokens,
 * fewer documents than ranks, no document of >= S tokens when long_doc_fraction > 0,
 * a passkey document that cannot be made at length S (passkey.h), a state that does
 * not fit the shard.
 *
 * Memory: the loader holds the document index (two int64 per document) and one
 * epoch permutation; batches live in a caller-owned lm_loader_batch allocated once.
 * Passkey documents are made (and freed) per row.
 *
 * What this module does not do: tokenizing text, the model, multi-process launch
 * (the rank / world_size fields only partition the stream).
 */
#ifndef LINMOE_LOADER_H
#define LINMOE_LOADER_H

#include "linmoe/core.h"
#include "linmoe/model.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int seq_len;              /* S >= 2 */
    int packing;              /* 1 document packing, 0 random windows */
    double passkey_fraction;  /* of rows, in [0, 1] */
    double long_doc_fraction; /* of rows, in [0, 1] */
    double repeat_fraction;   /* of rows, in [0, 1]; the three fractions sum to <= 1 */
    int passkey_length;       /* passkey documents of this many tokens, packed S / length
                                 to a row (then a pad piece); 0 = seq_len. Packing only. */
} lm_loader_stage;

/* Everything needed to continue the stream (checkpointed as LM_LOADER_STATE_WORDS
 * uint64 words in this order). */
typedef struct {
    uint64_t rows;     /* rows produced by this rank */
    uint64_t passkeys; /* passkey documents made by this rank */
    uint64_t epoch;    /* packing: current pass over the documents */
    uint64_t doc_pos;  /* packing: this rank's position j in the epoch (document r + j*W) */
    uint64_t doc_off;  /* packing: tokens of that document already emitted */
    uint64_t version;  /* LM_LOADER_STATE_VERSION */
} lm_loader_state;
#define LM_LOADER_STATE_WORDS 6
#define LM_LOADER_STATE_VERSION 1

typedef struct lm_loader lm_loader;

/* A loader over `shard` (borrowed; must stay open; a shard file or a manifest,
 * shard.h) with tokenizer `tok` (borrowed:
 * its EOT id separates documents; passkey documents are encoded with it).
 * 0 <= rank < world_size. The stage must be set before lm_loader_next. Errors:
 * LM_ERR_INVALID (bad rank / world_size, an empty shard, fewer documents than
 * ranks, shard vocab != tokenizer vocab), LM_ERR_NOMEM. */
lm_status lm_loader_new(lm_loader **out, const lm_shard *shard, lm_tokenizer *tok, uint64_t seed,
                        int rank, int world_size, lm_error *err);
void lm_loader_free(lm_loader *l);

/* Switch to a stage (see the top comment). Checks that passkey documents of length
 * S can be made when passkey_fraction > 0 (makes document 0). */
lm_status lm_loader_set_stage(lm_loader *l, const lm_loader_stage *s, lm_error *err);

void lm_loader_get_state(const lm_loader *l, lm_loader_state *st);
/* Restore a state from lm_loader_get_state (any stage may be set first or after).
 * Errors: unknown version, a document position / offset outside the shard. */
lm_status lm_loader_set_state(lm_loader *l, const lm_loader_state *st, lm_error *err);

/* Micro-batch buffers for up to max_rows rows of up to max_seq_len tokens. */
typedef struct {
    lm_model_batch batch; /* B, T (and cu_seqlens -> cu in packing mode) */
    int32_t *ids;         /* [B*T] */
    int32_t *labels;      /* [B*T]: token ids or LM_MODEL_IGNORE */
    int64_t *cu;          /* [max_rows*max_seq_len + 1] piece offsets (packing) */
    int32_t *span;        /* scratch for a repeat row's span */
    int64_t cap_tokens;
    int rows, n_passkey, n_long, n_repeat; /* composition of the last batch */
    int64_t n_labels;            /* labelled positions of the last batch */
} lm_loader_batch;

lm_status lm_loader_batch_init(lm_loader_batch *b, int max_rows, int max_seq_len, lm_error *err);
void lm_loader_batch_free(lm_loader_batch *b);

/* Fill b with the next `rows` rows (rows * S <= the batch's capacity). */
lm_status lm_loader_next(lm_loader *l, int rows, lm_loader_batch *b, lm_error *err);

/* This rank's share of a global micro-batch (data parallel, issue 24): rows
 * [rank*R/W, (rank+1)*R/W) of the R rows of `full` (a batch lm_loader_next filled), in
 * the same form (windows: B = R/W rows of S; packing: B = 1, T = R/W*S with
 * cu_seqlens rebased to the first row: pieces never cross a row, so the share's
 * documents are exactly the global batch's). Every rank runs the same one-rank
 * loader (rank 0 of world 1) and takes its share, so the global batch, and with it
 * the loss trajectory and the loader state a checkpoint holds, do not depend on the
 * number of ranks. part's capacity must hold R/W rows; n_passkey / n_long / n_repeat
 * are the global batch's, n_labels the share's. Errors: LM_ERR_INVALID when W does
 * not divide R (names both), bad rank / world, too small a part. */
lm_status lm_loader_batch_shard(const lm_loader_batch *full, int rank, int world,
                                lm_loader_batch *part, lm_error *err);

/* Number of documents (non-empty) in the shard, and of those with >= n tokens. */
int64_t lm_loader_num_docs(const lm_loader *l);
int64_t lm_loader_num_docs_at_least(const lm_loader *l, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
