/* Trainer internals shared by the src/train sources: AdamW with a fixed-order gradient norm,
 * and the checkpoint / train-state files. Not a public API (include/linmoe/train.h). */
#ifndef LINMOE_TRAIN_INTERNAL_H
#define LINMOE_TRAIN_INTERNAL_H

#include "linmoe/loader.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/train.h"

/* ---------------------------------------------------------------- AdamW */

/* Optimizer state for the parameter buffer of `p`: first and second moments m, v
 * (fp32, one allocation, zero at start) of the elements [lo, hi) this rank updates,
 * and the block table of the trainable tensors (params.h buffer flag 0) used by the
 * gradient norm: blocks of at most LM_ADAMW_BLOCK elements, each summed sequentially
 * in fp64, the block sums added in table order, so the norm is bitwise the same for
 * any thread count (and, with the partial sums of every block all-reduced, for any
 * number of data-parallel ranks holding the same reduced gradient).
 *
 * Sharding (ZeRO-1, issue 24): lm_adamw_init_shard(a, p, r, W) gives rank r of W the
 * blocks [blk0, blk1) = [nblk*r/W, nblk*(r+1)/W) and the element range [lo, hi)
 * that covers them (rank 0 from element 0, the last to p->numel, so the ranges
 * partition the whole buffer, MoE bias buffers included: they are what the
 * parameter all-gather copies). m and v hold hi - lo elements each: m[o - lo] is
 * element o's moment. lm_adamw_init is the one-rank case (lo = 0, hi = numel). */
#define LM_ADAMW_BLOCK 16384
typedef struct {
    const lm_params *p;
    float *m, *v; /* [hi - lo] each */
    int64_t lo, hi;
    int64_t nblk;
    int64_t blk0, blk1; /* the blocks this shard updates */
    int64_t *blk_off, *blk_len;
    uint8_t *blk_decay;
    double *partial; /* [nblk] per-block sums of squares (lm_adamw_grad_partials) */
} lm_adamw;

void lm_adamw_init(lm_adamw *a, const lm_params *p);
void lm_adamw_init_shard(lm_adamw *a, const lm_params *p, int rank, int world);
void lm_adamw_free(lm_adamw *a);
/* The shard range of rank r of W (what lm_adamw_init_shard would choose), without
 * allocating: lo[r], hi[r]. For the trainer's reduce-scatter / all-gather counts. */
void lm_adamw_shard_range(const lm_adamw *a, int rank, int world, int64_t *lo, int64_t *hi);
/* a->partial[b] = the fp64 sum of squares of block b of the shard gradient gs
 * ([hi - lo], element o at gs[o - lo]) for the shard's blocks, 0 for the others. */
void lm_adamw_grad_partials(lm_adamw *a, const float *gs);
/* sqrt of the sum of a->partial in table order. */
double lm_adamw_norm_of_partials(const lm_adamw *a);
/* L2 norm of the trainable part of g ([p->numel], params layout; one rank), fp64. */
double lm_adamw_grad_norm(lm_adamw *a, const float *g);
/* One AdamW step (Loshchilov & Hutter 2019, decoupled weight decay; PyTorch's
 * torch.optim.AdamW update order) on every trainable tensor of the shard, with the
 * gradient gs ([hi - lo], element o at gs[o - lo]) multiplied by gscale (clipping)
 * first and t the 1-based step for the bias corrections; params is the whole buffer
 * [p->numel] (only [lo, hi) is written):
 *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   p = p (1 - lr wd [decay flag])  -  lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
 * Buffers (MoE selection bias) are never touched. */
void lm_adamw_step(lm_adamw *a, float *params, const float *gs, double gscale, double lr,
                   double wd, double b1, double b2, double eps, int64_t t);

/* The gradient-clipping coefficient of a step: grad_clip / (gnorm + 1e-6) when
 * grad_clip > 0 and gnorm > grad_clip, else 1 (torch.nn.utils.clip_grad_norm_'s
 * coefficient; torch also applies it, clamped to 1, for gnorm in (grad_clip - 1e-6,
 * grad_clip], where this returns 1: a relative difference below 2e-6 of the gradient). */
double lm_train_clip_scale(double gnorm, double grad_clip);

/* The update of a CPU training step once the gradients of all its micro-batches are in
 * lm_model_grads(m) and gnorm = lm_adamw_grad_norm of them: AdamW step t (1-based) with
 * the clipping coefficient, c's weight decay / betas / eps and this lr, then
 * lm_router_update_bias of every router layer of m on the step's demand. load
 * ([num_hidden_layers * E], may be NULL) gets each router layer's demand fractions,
 * met ([num_hidden_layers], may be NULL) the router metrics. Errors: those of
 * lm_router_update_bias. train.c's train_step calls it; tests/test_train_torch.c too. */
lm_status lm_train_update(const lm_train_config *c, lm_adamw *opt, lm_params *p, lm_model *m,
                          double gnorm, double lr, int64_t t, double *load, int E,
                          lm_router_metrics *met, lm_error *err);

/* ---------------------------------------------------------------- train state */

/* Counters checkpointed with the optimizer state (train_state.safetensors tensor
 * "counters", int64, in this order). */
typedef struct {
    int64_t step;       /* optimizer-loop steps done (skipped ones included) */
    int64_t opt_step;   /* AdamW steps applied (bias-correction t) */
    int64_t tokens;     /* tokens consumed */
    int64_t bad_streak; /* non-finite steps in a row */
    int64_t bad_total;  /* non-finite steps in total */
    int64_t stage;      /* stage whose settings are applied (its start logged) */
    int64_t version;    /* LM_TRAIN_STATE_VERSION */
} lm_train_counters;
#define LM_TRAIN_COUNTERS 7
#define LM_TRAIN_STATE_VERSION 1

/* Write RUN/ckpt/step-NNNNNNN (model.safetensors + config.json via lm_params_save,
 * train_state.safetensors) through RUN/ckpt/.tmp-step-NNNNNNN, rename it into
 * place, replace RUN/ckpt/latest, prune to keep_last. fail_inject: simulate a
 * write failure of train_state.safetensors (test hook). `dir_out` gets the
 * checkpoint path. `a` must hold the whole buffer's moments (lo = 0, hi = numel:
 * data-parallel ranks gather their shards first). */
lm_status lm_train_ckpt_save(const char *run_dir, const lm_params *p, const lm_adamw *a,
                             lm_model *m, const lm_train_counters *k, const lm_loader_state *ls,
                             const char *config_text, int keep_last, int fail_inject, char *dir_out,
                             size_t dir_size, lm_error *err);

/* Read train_state.safetensors of checkpoint `dir` into a (the moments of its shard
 * [lo, hi): a checkpoint is one logical file whatever the number of ranks that wrote
 * or read it), m's router states, k,
 * ls; every tensor is checked (name, dtype, shape) against the model of `p`.
 * Errors name the file and the tensor; the whole file is checked before anything is
 * copied, so on an error a, m, k and ls are left as they were. */
lm_status lm_train_state_load(const char *dir, const lm_params *p, lm_adamw *a, lm_model *m,
                              lm_train_counters *k, lm_loader_state *ls, lm_error *err);
/* The same from the `size` bytes of a train_state.safetensors in memory (`label`
 * names it in messages): the entry of the fuzz target tests/fuzz (train_state). */
lm_status lm_train_state_parse(const void *bytes, size_t size, const char *label,
                               const lm_params *p, lm_adamw *a, lm_model *m, lm_train_counters *k,
                               lm_loader_state *ls, lm_error *err);

/* Remove leftover RUN/ckpt/.tmp-* directories of an interrupted checkpoint. */
void lm_train_ckpt_cleanup(const char *run_dir);

#endif
