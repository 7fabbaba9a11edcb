/* linmoe trainer: the training config, AdamW, the staged training loop (context
 * extension with per-stage seq_len / LR schedule / rope_theta / data mix), evals,
 * logs and checkpoints with bit-exact resume (issue 5 items 5, 6, 8, 9).
 * The derivations and a walk-through live in docs/training.md.
 *
 * ---------------------------------------------------------------- config format
 * One JSON object (parsed with cJSON). Every key below is optional unless marked
 * required; an unknown key or a bad value anywhere is an error naming the file, the
 * key path (e.g. "stages[1].seq_len") and the value.
 *
 * {
 *   "model": {...} | "path/to/config.json",   required: a model config.json object
 *                      (model_config.h) or the path of one; unknown model keys are
 *                      errors here. Its "seed" seeds the weight init.
 *   "tokenizer": "byte" | "gpt2",             default "byte"
 *   "tokenizer_dir": "data/gpt2",             gpt2 only (vocab.json + merges.txt)
 *   "data": {"train": PATH, "val": PATH},     both required: token shards or
 *                      manifests of shards (shard.h; `linmoe tokenize --out-dir DIR`
 *                      writes DIR/train.json and DIR/val.json, docs/data.md); paths
 *                      are relative to the working directory, a manifest's shard
 *                      paths to the manifest's directory
 *   "train": {
 *     "seed": 0,               data order, passkey rows (uint64)
 *     "batch_tokens": N  |  "batch_size": N   exactly one, required: tokens per
 *                      optimizer step (each stage: rows = batch_tokens / seq_len),
 *                      or rows per step (tokens = batch_size * seq_len)
 *     "micro_batches": 1,      gradient accumulation: each micro-batch holds
 *                      rows / micro_batches rows (must divide)
 *     "lr": 1e-3,              peak learning rate (> 0)
 *     "min_lr_ratio": 0.1,     final lr = ratio * peak, in [0, 1]
 *     "schedule": "cosine",    "cosine" | "wsd" (warmup-stable-decay, linear decay)
 *     "wsd_decay_frac": 0.2,   wsd: fraction of a stage's steps spent decaying, [0, 1]
 *     "weight_decay": 0.1,     decoupled (AdamW), only tensors with the params.h
 *                      decay flag (matrices, short convs)
 *     "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
 *     "grad_clip": 1.0,        global L2 norm clip (0 = off)
 *     "log_every": 10,         plain progress lines (not on a terminal), >= 1
 *     "eval_every": 0,         steps between evals (0: stage ends and the end only)
 *     "checkpoint_every": 0,   steps between checkpoints (0: the end only)
 *     "keep_last": 3,          checkpoints kept (0 = all)
 *     "max_bad_steps": 5,      stop after this many non-finite steps in a row (>= 1)
 *     "threads": 0,            OpenMP / OpenBLAS threads (0 = default; --threads wins)
 *     "expert_parallel": 1,    ranks per expert-parallel group (several processes,
 *                              `mpirun -np N`: N must be a multiple; the rest of N is
 *                              data parallel). Each MoE layer's routed experts are split
 *                              over the group's ranks for the training steps
 *                              (moe_ep.h), each rank holding only its own experts'
 *                              weights, gradients and AdamW state (params.h
 *                              lm_params_init_ep); docs/distributed.md
 *     "recompute": false       activation recompute (--device cuda): true (every layer)
 *                              or a list of 1-based layer numbers; the trainer prints the
 *                              activation memory with and without it (gpu_model.h)
 *   },
 *   "stages": [                required, >= 1, run in order
 *     {"name": "stage0",       [A-Za-z0-9_.-], <= 63 chars
 *      "seq_len": 256,         required, >= 2
 *      "tokens": 1000000,      required: token budget (steps = ceil(tokens / step tokens))
 *      "lr": null,             peak lr override (default: train.lr)
 *      "warmup_steps": 0,      linear warmup from lr/warmup at the stage's start
 *      "rope_theta": 0,        RoPE base for this stage (0 = the model's)
 *      "packing": true,        document packing (true) or random windows (loader.h)
 *      "passkey_fraction": 0,  rows replaced by passkey documents of seq_len tokens
 *      "long_doc_fraction": 0, rows from documents of >= seq_len tokens
 *      "repeat_fraction": 0,   rows of prose with a random span inserted 2-8 times
 *                              (the copy task that teaches in-context copying; loader.h)
 *      "passkey_length": 0}    passkey documents of this many tokens, several packed
 *                              to a row (a curriculum; 0 = seq_len; packing only)
 *   ],
 *   "eval": {
 *     "seq_len": 0,            bits-per-byte window (0 = the last stage's seq_len)
 *     "passkey_lengths": [],   passkey accuracy at these lengths (tokens)
 *     "passkey_samples": 200, "passkey_seed": 1234,
 *     "max_val_tokens": 0      score only the validation documents within the first
 *                      N tokens (whole documents; 0 = all)
 *   }
 * }
 *
 * LR per step (stage-local step i of n, warmup w, peak P, floor m = P*min_lr_ratio):
 *   i < w: P (i+1)/w;   cosine: m + (P-m)(1 + cos(pi (i-w)/max(1, n-w-1)))/2
 *   (P at the first step after warmup, m at the stage's last step);
 *   wsd: P until the last D = round(wsd_decay_frac * n) steps (after warmup), then
 *   linearly to m at the stage's last step.
 *
 * ---------------------------------------------------------------- run directory
 *   RUN/train_config.json        the training config text of the run
 *   RUN/log.jsonl                one object per step (docs/training.md lists keys)
 *   RUN/evals.jsonl              one object per eval
 *   RUN/stages.jsonl             one object per stage start
 *   RUN/ckpt/step-NNNNNNN/       model.safetensors + config.json (lm_params_save:
 *                                the model config with the stage's rope_theta) and
 *                                train_state.safetensors (AdamW m / v, counters,
 *                                loader state, router statistics, the training
 *                                config text in its metadata)
 *   RUN/ckpt/latest              the name of the newest complete checkpoint
 * A checkpoint is assembled in RUN/ckpt/.tmp-step-NNNNNNN (each file fsynced), then
 * renamed into place, then `latest` is replaced atomically; a failure at any point
 * leaves the previous checkpoint and `latest` intact.
 *
 * Determinism: the model is bitwise thread-count independent and every trainer
 * reduction has a fixed order, so a resumed run reproduces an uninterrupted one bit
 * for bit (losses, weights, optimizer state, logs other than timings).
 *
 * What this module does not do: multi-process training (the loader is rank-aware,
 * the router update takes an all-reduce, nothing here launches ranks), bf16 / CUDA.
 */
#ifndef LINMOE_TRAIN_H
#define LINMOE_TRAIN_H

#include <signal.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/dist.h"
#include "linmoe/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_SCHED_COSINE = 0, LM_SCHED_WSD = 1 } lm_lr_schedule;

#define LM_TRAIN_NAME_MAX 64
#define LM_TRAIN_MAX_PASSKEY_LENGTHS 32

typedef struct {
    char name[LM_TRAIN_NAME_MAX];
    int seq_len;
    int64_t tokens; /* budget */
    double lr;      /* peak (train.lr unless overridden) */
    int warmup_steps;
    double rope_theta; /* effective (the model's when not given) */
    int packing;
    double passkey_fraction, long_doc_fraction, repeat_fraction;
    int passkey_length; /* 0 = seq_len */
    /* derived */
    int64_t step_tokens; /* tokens per optimizer step */
    int rows_per_step, rows_per_micro;
    int64_t steps;      /* ceil(tokens / step_tokens) */
    int64_t first_step; /* global step index of the stage's first step */
} lm_train_stage;

typedef struct {
    char *text;   /* the config text (owned) */
    char *source; /* file path or label (owned) */
    lm_model_config model;
    char tokenizer[16];
    char *tokenizer_dir;         /* owned, NULL = default */
    char *train_path, *val_path; /* owned */
    /* train */
    uint64_t seed;
    int64_t batch_tokens; /* 0 when batch_size is used */
    int batch_size;       /* 0 when batch_tokens is used */
    int micro_batches;
    double lr, min_lr_ratio, wsd_decay_frac;
    lm_lr_schedule schedule;
    double weight_decay, beta1, beta2, eps, grad_clip;
    int log_every;
    int64_t eval_every, checkpoint_every;
    int keep_last, max_bad_steps, threads;
    int expert_parallel;              /* >= 1 */
    uint8_t recompute[LM_MAX_LAYERS]; /* 1: activation recompute for layer i (0-based; cuda) */
    int n_recompute;
    /* stages */
    int n_stages;
    lm_train_stage *stages; /* owned */
    int64_t total_steps;
    /* eval */
    int eval_seq_len; /* effective (last stage's when 0 in the file) */
    int n_passkey_lengths;
    int passkey_lengths[LM_TRAIN_MAX_PASSKEY_LENGTHS];
    int passkey_samples;
    uint64_t passkey_seed;
    int64_t max_val_tokens;
} lm_train_config;

/* Parse `json` (label names it in messages; model paths are read from the working
 * directory) / the file at `path`. On error `c` is left empty (safe to free). */
lm_status lm_train_config_parse(lm_train_config *c, const char *json, const char *label,
                                lm_error *err);
lm_status lm_train_config_load(lm_train_config *c, const char *path, lm_error *err);
void lm_train_config_free(lm_train_config *c);

/* Resuming a run at global step `step` (steps done) with the config `now` when it was
 * started (and last checkpointed) with `was`. Changes that would make the resumed run
 * another run are refused: LM_ERR_INVALID, the message names the field and both values
 * (tokenizer, data.train, train.seed, batch_tokens / batch_size, micro_batches, and for
 * every stage that has started: its name, seq_len, data mix, passkey_length,
 * rope_theta, the token budget of a completed stage, a budget below what the current
 * stage has already trained; a started stage dropped). Everything else is safe and
 * applied (learning rates and the schedule, optimizer scalars, warm-up, the current
 * stage's budget, stages not started yet, added stages, eval / checkpoint / log
 * cadence, evals, threads): one line per change ("train.lr: 0.003 -> 0.001") is written
 * into `log` (newline-separated, NUL-terminated; may be NULL). The model section is
 * compared by the trainer against the checkpoint itself. */
lm_status lm_train_config_resume_check(const lm_train_config *was, const lm_train_config *now,
                                       int64_t step, char *log, size_t log_size, lm_error *err);

/* Stage of global step `step` (0-based; steps past the end map to the last). */
int lm_train_stage_of(const lm_train_config *c, int64_t step);
/* Learning rate of global step `step` (formula above). */
double lm_train_lr(const lm_train_config *c, int64_t step);

typedef struct {
    const char *run_dir;        /* required */
    int resume;                 /* continue from RUN/ckpt/latest */
    int64_t max_steps;          /* stop once this many steps (global) are done; 0 = all */
    int threads;                /* > 0 overrides train.threads */
    int64_t fail_checkpoint_at; /* test hook: the checkpoint at this step fails while
                                   writing train_state.safetensors (0 = off) */
    int64_t nan_at, nan_count;  /* test hook: steps nan_at .. nan_at + nan_count - 1 (as
                                   logged, 1-based) get a NaN gradient (0 = off) */
    int64_t diverge_at;         /* test hook (data parallel): after step diverge_at, rank 1
                                   moves its first MoE selection bias by 1e-3, which the
                                   next checkpoint's replica check must catch (0 = off) */
    int progress;               /* -1 auto (live line when stderr is a terminal), 0 plain, 1 live */
    int quiet;                  /* 1: no human-readable output at all */
    volatile sig_atomic_t *stop; /* NULL, or a flag a signal handler sets (the CLI's SIGINT /
                                   SIGTERM): once it is non-zero the run finishes the step
                                   in progress, writes a checkpoint (unless that step just
                                   wrote one), says so and returns LM_OK with
                                   summary.interrupted = 1; --resume continues from it */
    lm_device device;           /* cpu (default, zero) or cuda:N: where the steps run
                                   (include/linmoe/gpu_model.h) and so do the evals
                                   (eval.h lm_eval_*_gpu); checkpoints go through the
                                   host copy of the parameters */
    lm_comm *comm;              /* the ranks of a data-parallel run (borrowed; NULL: one
                                   process). Every rank calls lm_train_run with the
                                   same config and options; each takes its share of
                                   every global micro-batch (loader.h
                                   lm_loader_batch_shard), the gradients are
                                   reduce-scattered, each rank updates its AdamW shard
                                   (ZeRO-1) and the parameters are all-gathered; the
                                   MoE load counts are all-reduced before the bias
                                   update. Rank 0 alone writes the run directory
                                   (logs, evals, checkpoints: one logical checkpoint,
                                   resumable on any number of ranks) and prints.
                                   With --device cuda (one GPU per rank: device
                                   index + the rank's index on its host) the
                                   gradients are all-reduced over NCCL, overlapped
                                   with the backward, and every rank runs the whole
                                   AdamW (no ZeRO); dropless aux-free / none routing
                                   and expert_parallel 1 only (else
                                   LM_ERR_UNSUPPORTED). docs/distributed.md. */
    int dist_nccl;              /* --device cuda: 1 = train through the NCCL path even on
                                   one rank (the same bucketed, overlapped gradient
                                   all-reduce as N GPU ranks; one rank's all-reduce is a
                                   copy, so the run is the plain GPU run's, bit for bit);
                                   0 = NCCL when there are several ranks. With cpu:
                                   LM_ERR_INVALID. */
    int64_t bucket_bytes;       /* the NCCL path's gradient buckets: contiguous layer
                                   ranges of the gradient buffer of at least this many
                                   bytes are all-reduced as one (0: 25 MiB; 1: every
                                   layer its own bucket) */
} lm_train_options;

void lm_train_options_default(lm_train_options *o);

typedef struct {
    int64_t steps_done;    /* global step at the end */
    int64_t steps_run;     /* steps run by this call */
    int64_t tokens;        /* tokens seen (global) */
    int64_t bad_steps;     /* skipped steps in total */
    double last_loss;      /* loss of the last step (nats) */
    double train_seconds;  /* wall time in training steps (this call) */
    double tokens_per_s;   /* over this call's steps */
    double mfu;            /* achieved / reference FLOP/s over this call's steps */
    double ref_flops;      /* reference rate: sgemm FLOP/s measured at start (best of several
                              calls after a warm-up, on the training threads) */
    char ref_desc[160];    /* how ref_flops was measured (kernel, size, threads, calls) */
    double bits_per_byte;  /* of the last eval (NaN if none) */
    char checkpoint[4096]; /* the last checkpoint written or resumed from ("" if none) */
    int interrupted;       /* 1: stopped early by options.stop (checkpoint written) */
} lm_train_summary;

/* Run (or, with o->resume, continue) training as configured. Without resume, a
 * RUN that already holds a checkpoint is an error. With resume and c == NULL the
 * config is the one saved in the checkpoint; with both, the model sections must
 * agree (the rest of c is used as given). Errors: LM_ERR_IO / FORMAT naming the
 * file (shards, checkpoint files, logs), LM_ERR_INVALID (config / data mismatch,
 * training diverged: max_bad_steps non-finite steps in a row), the model's. */
lm_status lm_train_run(const lm_train_config *c, const lm_train_options *o, lm_train_summary *out,
                       lm_error *err);

/* The newest complete checkpoint directory of a run: RUN/ckpt/<latest>. Errors:
 * no / unreadable / malformed `latest`, a directory that does not exist. */
lm_status lm_train_latest_checkpoint(const char *run_dir, char *dir, size_t size, lm_error *err);

/* The training config text stored in a checkpoint's train_state.safetensors
 * (malloc'd, caller frees). */
lm_status lm_train_checkpoint_config(const char *ckpt_dir, char **text, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
