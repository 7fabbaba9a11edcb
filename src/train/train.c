/* The training loop: stages (seq_len, LR schedule, rope_theta, data mix), micro-batch
 * accumulation, clipping, AdamW, the once-per-step MoE bias update, the NaN/Inf
 * guard, evals, logs and checkpoints with bit-exact resume. Contracts, config and
 * run-directory layout: include/linmoe/train.h; walk-through: docs/training.md. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "linmoe/cuda_bench.h"
#include "linmoe/dist_nccl.h"
#include "linmoe/eval.h"
#include "linmoe/gpu_model.h"
#include "linmoe/loader.h"
#include "linmoe/passkey.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"
#include "train/train_internal.h"

#define PATHMAX 4096

void lm_train_options_default(lm_train_options *o) {
    memset(o, 0, sizeof *o);
    o->progress = -1;
}

typedef struct {
    const lm_train_config *c;
    const lm_train_options *o;
    char run[PATHMAX];
    lm_tokenizer *tok;
    lm_shard train, val, val_sub;
    int have_train, have_val;
    lm_params p;
    int have_p;
    lm_model *m;
    /* --device cuda: the steps and evals run on gm; p, opt's moments and m's router
     * states (m: the CPU model over p, planned for one token) are refreshed from the
     * device (host_sync) before a checkpoint reads them */
    lm_cuda_ctx *cuda;
    lm_gpu_model *gm;
    int64_t gpu_tokens; /* the GPU model's max_tokens and max_seqs */
    int gpu_seqs;
    int host_stale;
    lm_adamw opt;
    int have_opt;
    lm_loader *ld;
    lm_loader_batch b;
    int have_b;
    lm_train_counters k;
    FILE *flog, *feval, *fstage;
    int live; /* live progress line on stderr */
    int quiet;
    int line_open; /* a live line is on screen */
    double ref_flops;
    double *load;           /* [L * E] per-step demand fractions */
    lm_router_metrics *met; /* [L] */
    int E;
    double last_bpb, last_loss;
    char last_ckpt[PATHMAX + 64];
    /* data parallel (issue 24; docs/distributed.md): world ranks of comm, this one
     * `rank`; with world > 1 every rank draws the global micro-batch gb from the same
     * one-rank loader and trains on its share b; gshard is its reduce-scattered
     * gradient [opt.hi - opt.lo], shard[q] the element count of rank q's shard, and
     * rank 0 gathers the AdamW moments into full_mv [2 numel] for checkpoints */
    lm_comm *comm, *own_comm;
    lm_comm *dpc, *epc; /* with world_route: the grid's groups (dist.h; epc of one rank
                           without EP) */
    int world_route;    /* the MoE layers route the world's batch (route_world) */
    lm_comm *rcomm;     /* the router sums' reduction: comm, or NULL with world_route (every
                           rank's state holds the world's counts already) */
    int rank, world;
    lm_loader_batch gb;
    int have_gb;
    float *gshard;
    int64_t *shard;
    float *full_mv;
    /* expert sharding (train.expert_parallel = P > 1; docs/distributed.md): p holds
     * this rank's routed experts only (params.h lm_params_init_ep), its buffer the
     * replicated region [0, nrep) and the expert region [nrep, nrep + nexp); opt is the
     * replicated region's AdamW (ZeRO-1 over the world, as without EP), optx the expert
     * region's (ZeRO-1 over the DP group: the dp ranks that hold the same experts),
     * vrep / vexp the two regions as tables for lm_adamw (vexp's offsets from nrep);
     * gshardx [shardx[dp_rank]] the DP-reduced expert gradient shard, normbuf [opt.nblk
     * + ep optx.nblk] the world's per-block sums of squares of the clipping norm */
    int sharded, ep, dp, ep_rank, dp_rank;
    int64_t nrep, nexp;
    lm_params vrep, vexp;
    lm_adamw optx;
    int have_optx;
    int64_t *shardx;
    float *gshardx;
    double *normbuf;
    lm_params fullp; /* --resume of a sharded run: the checkpoint, until split */
    int have_fullp;
    int bias_layer; /* the layer whose router reduce is running (reduce_demand) */
    lm_status reduce_st;
    lm_error reduce_err;
    /* --device cuda over NCCL (several GPU ranks, or options.dist_nccl; docs/
     * distributed.md "GPU ranks"): nc's stream all-reduces the gradient in buckets of
     * whole layer ranges [pend_lo, pend_hi) of at least bucket_elems elements while the
     * backward goes on; n_buckets of the running step */
    lm_nccl_comm *nc;
    int64_t bucket_elems, pend_lo, pend_hi;
    int n_buckets;
} ctx;

/* ---------------------------------------------------------------- output helpers */

static void say(ctx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(ctx *x, const char *fmt, ...) {
    if (x->quiet)
        return;
    if (x->line_open) {
        fputs("\r\033[K", stderr);
        x->line_open = 0;
    }
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
}

static void jnum(FILE *f, double v, int prec) {
    if (isfinite(v))
        fprintf(f, "%.*g", prec, v);
    else
        fputs("null", f);
}

static void fmt_dur(char *buf, size_t n, double s) {
    if (!isfinite(s) || s < 0)
        s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, n, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else if (t >= 60)
        snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, n, "%lds", t);
}

/* Forward / backward errors that mean "the numbers blew up" (a bad step): the ops'
 * and the model's finiteness scans of tensor values report LM_ERR_NONFINITE; every
 * other status (bad input, a non-finite config scalar, I/O, memory) is fatal. */
static int numeric_error(lm_status st) { return st == LM_ERR_NONFINITE; }

static lm_status mkdir_p(const char *path, lm_error *err) {
    char buf[PATHMAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return lm_errorf(err, LM_ERR_INVALID, "run dir: path too long");
    for (char *q = buf + 1; *q; q++) {
        if (*q != '/')
            continue;
        *q = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return lm_errorf(err, LM_ERR_IO, "%s: cannot create: %s", buf, strerror(errno));
        *q = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot create: %s", buf, strerror(errno));
    return LM_OK;
}

static lm_status write_text_atomic(const char *path, const char *text, lm_error *err) {
    char tmp[PATHMAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    size_t n = strlen(text);
    int ok = fwrite(text, 1, n, f) == n;
    ok = fflush(f) == 0 && ok;
    ok = fsync(fileno(f)) == 0 && ok;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return lm_errorf(err, LM_ERR_IO, "%s: write failed: %s", path, strerror(e));
    }
    return LM_OK;
}

/* Keep the lines of a JSONL log whose integer `key` is <= limit (resume: drop what
 * an interrupted run wrote after its checkpoint; unparsable half-written lines go). */
static lm_status filter_jsonl(const char *path, const char *key, int64_t limit, lm_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return LM_OK;
    char *out = NULL;
    size_t no = 0, cap = 0;
    char *line = NULL;
    size_t lcap = 0;
    ssize_t len;
    while ((len = getline(&line, &lcap, f)) > 0) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *v = j ? cJSON_GetObjectItemCaseSensitive(j, key) : NULL;
        int keep =
            v && cJSON_IsNumber(v) && v->valuedouble <= (double)limit && line[len - 1] == '\n';
        cJSON_Delete(j);
        if (!keep)
            continue;
        if (no + (size_t)len + 1 > cap) {
            cap = (no + (size_t)len + 1) * 2;
            out = realloc(out, cap);
            LM_CHECK(out != NULL);
        }
        memcpy(out + no, line, (size_t)len);
        no += (size_t)len;
    }
    free(line);
    fclose(f);
    if (!out) {
        out = LM_MALLOC(1);
    }
    out[no] = '\0';
    lm_status st = write_text_atomic(path, out, err);
    free(out);
    return st;
}

static lm_status open_log(ctx *x, const char *name, int append, FILE **f, lm_error *err) {
    char path[PATHMAX + 64];
    snprintf(path, sizeof path, "%s/%s", x->run, name);
    *f = fopen(path, append ? "ab" : "wb");
    if (!*f)
        return lm_errorf(err, LM_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
    return LM_OK;
}

/* ---------------------------------------------------------------- reference rate */

/* The sgemm FLOP/s of this machine on the training threads: the denominator of the
 * logged "mfu". One timed call of a few ms is at the mercy of clock ramp-up, sleeping
 * OpenBLAS threads and other processes (one 512^3 call after one warm-up call gave
 * 143 and 296 GFLOP/s on the same machine), so the calls are repeated for
 * LM_SGEMM_WARMUP_S first and the rate is the best of LM_SGEMM_RUNS timed calls after
 * that: contention only ever slows a call down. `desc` gets what was measured. */
#define LM_SGEMM_N 768
#define LM_SGEMM_RUNS 7
#define LM_SGEMM_WARMUP_S 0.1
static double measure_sgemm(char *desc, size_t desc_size) {
    const int n = LM_SGEMM_N;
    float *A = LM_MALLOC((size_t)n * n * sizeof(float) * 3);
    float *B = A + (size_t)n * n, *C = B + (size_t)n * n;
    for (size_t i = 0; i < (size_t)n * n; i++) {
        A[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
        B[i] = (float)((i * 40503u) % 1000) * 1e-3f - 0.5f;
    }
    const double w0 = lm_time_sec();
    int warm = 0;
    while (warm < 2 || lm_time_sec() - w0 < LM_SGEMM_WARMUP_S) {
        lm_sgemm(0, 0, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
        warm++;
    }
    double best = 1e30;
    for (int r = 0; r < LM_SGEMM_RUNS; r++) {
        double t0 = lm_time_sec();
        lm_sgemm(0, 0, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
        double t = lm_time_sec() - t0;
        if (t < best)
            best = t;
    }
    free(A);
    const int th = lm_get_num_threads();
    snprintf(desc, desc_size,
             "sgemm fp32 %d^3 on %d thread%s, best of %d calls after a %.1f s warm-up", n, th,
             th == 1 ? "" : "s", LM_SGEMM_RUNS, LM_SGEMM_WARMUP_S);
    return 2.0 * n * (double)n * n / best;
}

/* ---------------------------------------------------------------- stages, evals */

static lm_status apply_stage(ctx *x, int s, lm_error *err) {
    const lm_train_stage *st = &x->c->stages[s];
    lm_loader_stage ls = {st->seq_len,           st->packing,         st->passkey_fraction,
                          st->long_doc_fraction, st->repeat_fraction, st->passkey_length};
    lm_status r = lm_loader_set_stage(x->ld, &ls, err);
    if (r != LM_OK) {
        char buf[sizeof err->msg];
        snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
        return lm_errorf(err, r, "%s: stage '%s' (stages[%d]): %s", x->c->source, st->name, s, buf);
    }
    if (x->gm)
        LM_TRY(lm_gpu_model_set_rope_theta(x->gm, st->rope_theta, err));
    return lm_model_set_rope_theta(x->m, st->rope_theta, err);
}

/* --device cuda: the host copies (parameters, AdamW moments, router states) from the
 * device, when a step has run since the last refresh. */
static lm_status host_sync(ctx *x, lm_error *err) {
    if (!x->gm || !x->host_stale)
        return LM_OK;
    LM_TRY(lm_gpu_model_download(x->gm, &x->p, err));
    LM_TRY(lm_gpu_model_get_moments(x->gm, x->opt.m, x->opt.v, err));
    for (int i = 0; i < x->p.cfg.num_hidden_layers; i++) {
        lm_router_state *rs = lm_model_router_state(x->m, i);
        if (rs)
            LM_TRY(lm_gpu_model_get_router(x->gm, i, rs, err));
    }
    x->host_stale = 0;
    return LM_OK;
}

static void log_stage(ctx *x, int s) {
    const lm_train_stage *st = &x->c->stages[s];
    if (!x->fstage)
        return; /* ranks other than 0 */
    fprintf(x->fstage,
            "{\"stage\": %d, \"name\": \"%s\", \"step\": %lld, \"tokens\": %lld, \"seq_len\": %d, "
            "\"steps\": %lld, \"rope_theta\": ",
            s, st->name, (long long)x->k.step, (long long)x->k.tokens, st->seq_len,
            (long long)st->steps);
    jnum(x->fstage, st->rope_theta, 9);
    fprintf(x->fstage, ", \"packing\": %s, \"passkey_fraction\": ", st->packing ? "true" : "false");
    jnum(x->fstage, st->passkey_fraction, 9);
    fputs(", \"long_doc_fraction\": ", x->fstage);
    jnum(x->fstage, st->long_doc_fraction, 9);
    fputs(", \"repeat_fraction\": ", x->fstage);
    jnum(x->fstage, st->repeat_fraction, 9);
    fprintf(x->fstage, ", \"passkey_length\": %d", st->passkey_length);
    fputs("}\n", x->fstage);
    fflush(x->fstage);
    say(x,
        "stage %d '%s' from step %lld: seq_len %d, %lld steps of %lld tokens, lr %.3g, "
        "rope_theta %g, %s, passkey %.3g, long docs %.3g, repeats %.3g",
        s, st->name, (long long)x->k.step, st->seq_len, (long long)st->steps,
        (long long)st->step_tokens, st->lr, st->rope_theta, st->packing ? "packed" : "windows",
        st->passkey_fraction, st->long_doc_fraction, st->repeat_fraction);
}

static lm_status full_params(ctx *x, int root, lm_params *fp, int *have, lm_error *err);

/* The evals of model em (x->m, or with sharded experts the whole model assembled for
 * the evals). */
static lm_status run_eval_on(ctx *x, lm_model *em, lm_error *err) {
    const lm_train_config *c = x->c;
    double t0 = lm_time_sec();
    lm_eval_bpb_result r;
    memset(&r, 0, sizeof r);
    lm_eval_passkey_result pk[LM_TRAIN_MAX_PASSKEY_LENGTHS];
    if (x->gm) {
        /* on the device, with the current weights (eval_gpu.c: the same protocols) */
        LM_TRY(lm_eval_bpb_gpu(x->gm, x->tok, &x->val_sub, c->eval_seq_len, &r, err));
        for (int i = 0; i < c->n_passkey_lengths; i++)
            LM_TRY(lm_eval_passkey_gpu(x->gm, x->tok, &x->val, c->passkey_lengths[i],
                                       c->passkey_samples, c->passkey_seed, &pk[i], err));
        /* GPU ranks: each ran the whole evals on its replica (the same weights, the
         * same results; not split over the ranks); rank 0 logs */
        if (x->rank != 0)
            return LM_OK;
    } else if (x->world == 1) {
        LM_TRY(lm_eval_bpb(x->m, x->tok, &x->val_sub, c->eval_seq_len, &r, err));
        for (int i = 0; i < c->n_passkey_lengths; i++)
            LM_TRY(lm_eval_passkey(x->m, x->tok, &x->val, c->passkey_lengths[i], c->passkey_samples,
                                   c->passkey_seed, &pk[i], err));
    } else {
        /* split over the ranks (every rank holds the whole model), parts summed */
        double sum[2 + 4 * LM_TRAIN_MAX_PASSKEY_LENGTHS];
        lm_status st =
            lm_eval_bpb_part(em, x->tok, &x->val_sub, c->eval_seq_len, x->rank, x->world, &r, err);
        sum[0] = r.nll_nats;
        sum[1] = (double)r.tokens;
        for (int i = 0; i < c->n_passkey_lengths && st == LM_OK; i++) {
            st =
                lm_eval_passkey_part(em, x->tok, &x->val, c->passkey_lengths[i], c->passkey_samples,
                                     c->passkey_seed, x->rank, x->world, &pk[i], err);
            double *q = sum + 2 + 4 * i;
            q[0] = pk[i].samples, q[1] = pk[i].correct;
            q[2] = (double)pk[i].answer_tokens, q[3] = (double)pk[i].prefix_tokens;
        }
        LM_TRY(lm_comm_agree(x->comm, st, err));
        LM_TRY(lm_comm_allreduce(x->comm, sum, 2 + 4 * c->n_passkey_lengths, LM_F64, LM_DIST_SUM,
                                 err));
        r.nll_nats = sum[0];
        r.tokens = (int64_t)sum[1];
        r.bits_per_byte = r.bytes > 0 ? r.nll_nats / log(2.0) / (double)r.bytes : NAN;
        for (int i = 0; i < c->n_passkey_lengths; i++) {
            const double *q = sum + 2 + 4 * i;
            pk[i].samples = (int)q[0];
            pk[i].correct = (int)q[1];
            pk[i].answer_tokens = (int64_t)q[2];
            pk[i].prefix_tokens = (int64_t)q[3];
            pk[i].accuracy = pk[i].samples > 0 ? (double)pk[i].correct / pk[i].samples : NAN;
        }
        if (x->rank != 0)
            return LM_OK; /* rank 0 logs */
    }
    const int s = (int)x->k.stage;
    FILE *f = x->feval;
    fprintf(f,
            "{\"step\": %lld, \"tokens\": %lld, \"stage\": %d, \"stage_name\": \"%s\", "
            "\"seq_len\": %d, \"bits_per_byte\": ",
            (long long)x->k.step, (long long)x->k.tokens, s, c->stages[s].name, c->eval_seq_len);
    jnum(f, r.bits_per_byte, 9);
    fputs(", \"nll_nats\": ", f);
    jnum(f, r.nll_nats, 12);
    fprintf(f, ", \"bytes\": %lld, \"eval_tokens\": %lld, \"passkey\": [", (long long)r.bytes,
            (long long)r.tokens);
    for (int i = 0; i < c->n_passkey_lengths; i++) {
        fprintf(f, "%s{\"length\": %d, \"samples\": %d, \"correct\": %d, \"accuracy\": ",
                i ? ", " : "", pk[i].length, pk[i].samples, pk[i].correct);
        jnum(f, pk[i].accuracy, 9);
        fputc('}', f);
    }
    fputs("]}\n", f);
    fflush(f);
    x->last_bpb = r.bits_per_byte;
    char buf[512];
    size_t n = (size_t)snprintf(buf, sizeof buf, "eval at step %lld (stage '%s'): %.4f bits/byte",
                                (long long)x->k.step, c->stages[s].name, r.bits_per_byte);
    for (int i = 0; i < c->n_passkey_lengths && n < sizeof buf; i++)
        n += (size_t)snprintf(buf + n, sizeof buf - n, ", passkey@%d %.3f", pk[i].length,
                              pk[i].accuracy);
    if (n < sizeof buf)
        snprintf(buf + n, sizeof buf - n, " (%.1f s)", lm_time_sec() - t0);
    say(x, "%s", buf);
    return LM_OK;
}

/* With sharded experts no rank holds a whole MoE layer: the evals (which decode with
 * the inference cache, outside the EP layer) run on a model assembled from the EP
 * group's experts, planned for the evals' longest sequence and freed after them. */
static lm_status run_eval(ctx *x, lm_error *err) {
    if (!x->sharded)
        return run_eval_on(x, x->m, err);
    const lm_train_config *c = x->c;
    int64_t tokens = c->eval_seq_len;
    for (int i = 0; i < c->n_passkey_lengths; i++)
        if (c->passkey_lengths[i] > tokens)
            tokens = c->passkey_lengths[i];
    lm_params fp;
    int have_fp = 0;
    lm_model *em = NULL;
    lm_status st = full_params(x, -1, &fp, &have_fp, err);
    if (st == LM_OK)
        st = lm_model_new(&em, &fp, tokens, err);
    st = lm_comm_agree(x->comm, st, err);
    if (st == LM_OK)
        st = run_eval_on(x, em, err);
    lm_model_free(em);
    if (have_fp)
        lm_params_free(&fp);
    return st;
}

/* ---------------------------------------------------------------- one step */

static void reset_router_accumulators(lm_router_state *st) {
    memset(st->demand, 0, sizeof(double) * (size_t)st->E);
    memset(st->kept, 0, sizeof(double) * (size_t)st->E);
    memset(st->qb_accum, 0, sizeof(double) * (size_t)st->E);
    st->qb_count = 0;
    st->tokens = st->dropped_assign = st->dropped_tokens = 0;
    st->aux_loss_sum = 0.0;
    st->n_micro = 0;
}

typedef struct {
    double loss, gnorm, lr, seconds;
    int skipped;
    int n_passkey, n_long, n_repeat;
    lm_comm_stats comm; /* the step's collectives (world > 1) */
    /* the NCCL path: the step's device collectives, and the gradient reduction's span
     * (first bucket's start to last bucket's end), the part of it before the backward's
     * end and the part after (GPU clocks, CUDA events) */
    lm_comm_stats nccl;
    int n_buckets;
    double red_ms, red_overlap_ms, red_exposed_ms;
} step_result;

/* lm_router_update_bias's reduce hook: the step's router sums (demand [E] first)
 * summed over the data-parallel ranks, so every rank updates the same bias from the
 * global load and the logged load is the global one. */
static void reduce_demand(double *buf, int n, void *arg) {
    ctx *x = arg;
    if (x->reduce_st == LM_OK && x->rcomm)
        x->reduce_st = lm_comm_allreduce(x->rcomm, buf, n, LM_F64, LM_DIST_SUM, &x->reduce_err);
    double tot = 0;
    for (int e = 0; e < x->E; e++)
        tot += buf[e];
    for (int e = 0; e < x->E; e++)
        x->load[(size_t)x->bias_layer * x->E + e] = tot > 0 ? buf[e] / tot : 0;
}

double lm_train_clip_scale(double gnorm, double grad_clip) {
    return grad_clip > 0 && gnorm > grad_clip ? grad_clip / (gnorm + 1e-6) : 1.0;
}

lm_status lm_train_update(const lm_train_config *c, lm_adamw *opt, lm_params *p, lm_model *m,
                          double gnorm, double lr, int64_t t, double *load, int E,
                          lm_router_metrics *met, lm_error *err) {
    lm_adamw_step(opt, p->data, lm_model_grads(m), lm_train_clip_scale(gnorm, c->grad_clip), lr,
                  c->weight_decay, c->beta1, c->beta2, c->eps, t);
    for (int i = 0; i < p->cfg.num_hidden_layers; i++) {
        lm_router_state *rs = lm_model_router_state(m, i);
        if (!rs)
            continue;
        if (load) {
            double tot = 0;
            for (int e = 0; e < rs->E; e++)
                tot += rs->demand[e];
            for (int e = 0; e < rs->E; e++)
                load[(size_t)i * E + e] = tot > 0 ? rs->demand[e] / tot : 0;
        }
        LM_TRY(
            lm_router_update_bias(&p->cfg.moe.router, rs, NULL, NULL, met ? &met[i] : NULL, err));
    }
    return LM_OK;
}

static lm_status train_step(ctx *x, int s, step_result *res, lm_error *err) {
    const lm_train_config *c = x->c;
    const lm_train_stage *st = &c->stages[s];
    lm_model *m = x->m;
    const int M = c->micro_batches;
    const double t0 = lm_time_sec();
    double loss_sum = 0;
    int bad = 0;
    res->n_passkey = res->n_long = res->n_repeat = 0;
    res->lr = lm_train_lr(c, x->k.step);
    lm_comm_reset_stats(x->comm);
    const int W = x->world;
    for (int mi = 0; mi < M; mi++) {
        LM_TRY(lm_loader_next(x->ld, st->rows_per_micro, W > 1 ? &x->gb : &x->b, err));
        if (W > 1)
            LM_TRY(lm_loader_batch_shard(&x->gb, x->rank, W, &x->b, err));
        res->n_passkey += x->b.n_passkey;
        res->n_long += x->b.n_long;
        res->n_repeat += x->b.n_repeat;
        /* the micro-batch's loss is the mean over its labelled tokens on all ranks:
         * rank r's mean weighs n_r / N (exactly 1 on one rank) */
        int64_t N = x->b.n_labels;
        if (W > 1)
            LM_TRY(lm_comm_allreduce(x->comm, &N, 1, LM_I64, LM_DIST_SUM, err));
        const double share = N > 0 ? (double)x->b.n_labels / (double)N : 0.0;
        if (bad)
            continue; /* keep consuming the data of the step */
        double loss = 0;
        int64_t nl = 0;
        lm_status r =
            lm_model_forward(m, &x->b.batch, x->b.ids, x->b.labels, 1, NULL, &loss, &nl, err);
        /* the routed batch's aux loss is whole on every rank: its gradient takes the
         * micro-batch's factor, the CE's this rank's share of it */
        if (x->world_route)
            lm_model_set_ep_aux_scale(m, 1.0f / (float)M);
        if (r == LM_OK)
            r = lm_model_backward(m, (float)(share / M), mi > 0, err);
        if (r != LM_OK) {
            if (!numeric_error(r))
                return r;
            say(x, "step %lld: %s", (long long)x->k.step + 1, err->msg);
            bad = 1;
            continue;
        }
        if (!isfinite(loss) && x->b.n_labels > 0)
            bad = 1;
        if (x->b.n_labels > 0)
            loss_sum += loss * share;
    }
    if (W > 1) {
        /* the step's loss and its bad flag over the ranks: all skip, or none */
        double agg[2] = {loss_sum, (double)bad};
        LM_TRY(lm_comm_allreduce(x->comm, agg, 2, LM_F64, LM_DIST_SUM, err));
        loss_sum = agg[0];
        bad = agg[1] > 0;
    }
    res->loss = bad ? NAN : loss_sum / M;
    float *g = lm_model_grads(m);
    const int64_t nan_at = x->o->nan_at, nan_n = x->o->nan_count > 0 ? x->o->nan_count : 1;
    if (!bad && nan_at > 0 && x->k.step + 1 >= nan_at && x->k.step + 1 < nan_at + nan_n)
        g[x->opt.blk_off[0]] = NAN; /* test hook */
    /* ZeRO-1: each rank gets the sum over ranks of its shard of the gradient; the
     * norm's per-block sums are all-reduced (each block lives on one rank: adding the
     * others' zeros is exact) and added in table order, the same on every rank */
    float *gs = g;
    res->gnorm = NAN;
    if (!bad && W > 1) {
        LM_TRY(lm_comm_reduce_scatter(x->comm, g, x->gshard, x->shard, LM_F32, err));
        gs = x->gshard;
        /* sharded experts: a rank's expert region holds its own experts' gradients,
         * summed over the replicas of that shard only */
        if (x->sharded)
            LM_TRY(lm_comm_reduce_scatter(x->dpc, g + x->nrep, x->gshardx, x->shardx, LM_F32, err));
    }
    if (!bad && x->sharded) {
        /* the norm over every expert of every EP rank: slot [nr + e nx + b] is block b
         * of EP rank e's expert region, which one rank of the world owns (the others
         * add exact zeros); summed in slot order, the same bits on every rank */
        const int64_t nr = x->opt.nblk, nx = x->optx.nblk, ns = nr + (int64_t)x->ep * nx;
        lm_adamw_grad_partials(&x->opt, gs);
        lm_adamw_grad_partials(&x->optx, x->gshardx);
        memset(x->normbuf, 0, sizeof(double) * (size_t)ns);
        memcpy(x->normbuf, x->opt.partial, sizeof(double) * (size_t)nr);
        memcpy(x->normbuf + nr + (int64_t)x->ep_rank * nx, x->optx.partial,
               sizeof(double) * (size_t)nx);
        LM_TRY(lm_comm_allreduce(x->comm, x->normbuf, ns, LM_F64, LM_DIST_SUM, err));
        double sq = 0;
        for (int64_t b = 0; b < ns; b++)
            sq += x->normbuf[b];
        res->gnorm = sqrt(sq);
    } else if (!bad) {
        lm_adamw_grad_partials(&x->opt, gs);
        if (W > 1)
            LM_TRY(
                lm_comm_allreduce(x->comm, x->opt.partial, x->opt.nblk, LM_F64, LM_DIST_SUM, err));
        res->gnorm = lm_adamw_norm_of_partials(&x->opt);
    }
    if (!isfinite(res->gnorm))
        bad = 1;
    const int L = x->p.cfg.num_hidden_layers;
    if (bad) {
        for (int i = 0; i < L; i++) {
            lm_router_state *rs = lm_model_router_state(m, i);
            if (rs)
                reset_router_accumulators(rs);
        }
        x->k.bad_streak++;
        x->k.bad_total++;
    } else {
        x->k.opt_step++;
        if (W == 1) {
            /* one process: the update tests/test_train_torch.c checks against PyTorch */
            LM_TRY(lm_train_update(c, &x->opt, &x->p, m, res->gnorm, res->lr, x->k.opt_step,
                                   x->load, x->E, x->met, err));
        } else {
            const double cs = lm_train_clip_scale(res->gnorm, c->grad_clip);
            lm_adamw_step(&x->opt, x->p.data, gs, cs, res->lr, c->weight_decay, c->beta1, c->beta2,
                          c->eps, x->k.opt_step);
            /* every rank's updated shard to every rank (in place) */
            LM_TRY(lm_comm_allgather(x->comm, x->p.data + x->opt.lo, x->p.data, x->shard, LM_F32,
                                     err));
            if (x->sharded) {
                /* the expert region: within the DP group of this shard */
                float *px = x->p.data + x->nrep;
                lm_adamw_step(&x->optx, px, x->gshardx, cs, res->lr, c->weight_decay, c->beta1,
                              c->beta2, c->eps, x->k.opt_step);
                LM_TRY(lm_comm_allgather(x->dpc, px + x->optx.lo, px, x->shardx, LM_F32, err));
            }
            for (int i = 0; i < L; i++) {
                lm_router_state *rs = lm_model_router_state(m, i);
                if (!rs)
                    continue;
                x->bias_layer = i;
                x->reduce_st = LM_OK;
                LM_TRY(lm_router_update_bias(&x->p.cfg.moe.router, rs, reduce_demand, x, &x->met[i],
                                             err));
                if (x->reduce_st != LM_OK) {
                    if (err)
                        *err = x->reduce_err;
                    return x->reduce_st;
                }
            }
        }
        x->k.bad_streak = 0;
    }
    res->skipped = bad;
    x->k.tokens += st->step_tokens;
    x->k.step++;
    res->seconds = lm_time_sec() - t0;
    lm_comm_get_stats(x->comm, &res->comm);
    return LM_OK;
}

/* ---------------------------------------------------------------- GPU data parallel */

/* The NCCL path's timing marks (dist_nccl.h lm_nccl_mark): the first bucket's start and
 * the last one's end on the communicator's stream, the backward's end on the model's. */
enum { MARK_RED_START = 0, MARK_RED_END = 1, MARK_BWD_END = 2 };

/* All-reduce the pending range [pend_lo, pend_hi) of the gradient g on the NCCL stream,
 * after the work the model's stream has enqueued so far (that range's backward). */
static lm_status dp_flush(ctx *x, float *g, lm_error *err) {
    const int64_t lo = x->pend_lo, n = x->pend_hi - x->pend_lo;
    x->pend_hi = x->pend_lo;
    if (n <= 0)
        return LM_OK;
    void *cs = lm_cuda_ctx_stream(x->cuda);
    LM_TRY(lm_nccl_wait_for(x->nc, cs, err));
    /* recorded at every bucket: the last record (after the embedding backward, the
     * step's last op) is the backward's end */
    LM_TRY(lm_nccl_mark(x->nc, MARK_BWD_END, cs, err));
    if (x->n_buckets == 0)
        LM_TRY(lm_nccl_mark(x->nc, MARK_RED_START, NULL, err));
    LM_TRY(lm_nccl_allreduce(x->nc, g + lo, n, LM_F32, LM_DIST_SUM, err));
    LM_TRY(lm_nccl_mark(x->nc, MARK_RED_END, NULL, err));
    x->n_buckets++;
    return LM_OK;
}

/* gpu_model.h grads_ready: [lo, hi) joins the pending range (the calls come in
 * decreasing order, each hi the previous lo), which goes out once it holds
 * bucket_elems elements, and at the last call (lo = 0). */
static lm_status dp_grads_ready(void *arg, float *g, int64_t lo, int64_t hi, lm_error *err) {
    ctx *x = arg;
    if (x->pend_hi == x->pend_lo)
        x->pend_hi = hi;
    else if (hi != x->pend_lo)
        return lm_errorf(err, LM_ERR_INVALID,
                         "train: gradient range [%lld, %lld) does not end where the pending "
                         "bucket [%lld, %lld) starts",
                         (long long)lo, (long long)hi, (long long)x->pend_lo,
                         (long long)x->pend_hi);
    x->pend_lo = lo;
    if (x->pend_hi - x->pend_lo >= x->bucket_elems || lo == 0)
        return dp_flush(x, g, err);
    return LM_OK;
}

/* gpu_model.h router_sums: the MoE layers' step accumulators summed over the ranks
 * before the bias update (the CPU path's reduce_demand), between the model's stream's
 * work so far and what it enqueues next. */
static lm_status dp_router_sums(void *arg, double *const *acc, int n, int count, lm_error *err) {
    ctx *x = arg;
    void *cs = lm_cuda_ctx_stream(x->cuda);
    LM_TRY(lm_nccl_wait_for(x->nc, cs, err));
    for (int j = 0; j < count; j++)
        LM_TRY(lm_nccl_allreduce(x->nc, acc[j], n, LM_F64, LM_DIST_SUM, err));
    return lm_nccl_join(x->nc, cs, err);
}

/* The step's NCCL statistics and the reduction's overlap with the backward, read after
 * the step's synchronisations (the events are complete: no wait). */
static lm_status dp_step_stats(ctx *x, step_result *res, lm_error *err) {
    LM_TRY(lm_nccl_get_stats(x->nc, &res->nccl, err));
    res->n_buckets = x->n_buckets;
    if (x->n_buckets > 0) {
        double end = 0, bwd = 0;
        LM_TRY(lm_nccl_mark_ms(x->nc, MARK_RED_START, MARK_RED_END, &end, err));
        LM_TRY(lm_nccl_mark_ms(x->nc, MARK_RED_START, MARK_BWD_END, &bwd, err));
        res->red_ms = end;
        res->red_overlap_ms = bwd < 0 ? 0 : bwd < end ? bwd : end;
        res->red_exposed_ms = end - bwd > 0 ? end - bwd : 0;
    }
    return LM_OK;
}

/* train_step on the device: the micro-batches, the grad norm, one read of the step's
 * losses and norm (the host's only wait before the update), then AdamW and the bias
 * updates, or the skip. A non-finite loss or norm is a skipped step, as on the CPU. */
static lm_status train_step_gpu(ctx *x, int s, step_result *res, lm_error *err) {
    const lm_train_config *c = x->c;
    const lm_train_stage *st = &c->stages[s];
    const int M = c->micro_batches;
    const double t0 = lm_time_sec();
    if (M > LM_GPU_MODEL_MAX_MICRO)
        return lm_errorf(err, LM_ERR_INVALID, "%s: train.micro_batches = %d > %d on cuda",
                         c->source, M, LM_GPU_MODEL_MAX_MICRO);
    res->n_passkey = res->n_long = res->n_repeat = 0;
    res->lr = lm_train_lr(c, x->k.step);
    /* the NCCL path (x->nc): this rank's share of each global micro-batch, its CE mean
     * weighted n_r / N as on the CPU ranks; the last micro-batch's backward all-reduces
     * the gradient in buckets (dp_grads_ready) */
    const int W = x->world, dp = x->nc != NULL;
    double share[LM_GPU_MODEL_MAX_MICRO];
    if (dp) {
        lm_comm_reset_stats(x->comm);
        lm_nccl_reset_stats(x->nc);
        x->n_buckets = 0;
        x->pend_lo = x->pend_hi = 0;
    }
    for (int mi = 0; mi < M; mi++) {
        LM_TRY(lm_loader_next(x->ld, st->rows_per_micro, W > 1 ? &x->gb : &x->b, err));
        if (W > 1)
            LM_TRY(lm_loader_batch_shard(&x->gb, x->rank, W, &x->b, err));
        res->n_passkey += x->b.n_passkey;
        res->n_long += x->b.n_long;
        res->n_repeat += x->b.n_repeat;
        float scale = 1.0f / (float)M;
        share[mi] = 1.0;
        if (dp) {
            /* exactly 1 on one rank: the scale is the plain path's 1 / M */
            int64_t N = x->b.n_labels;
            LM_TRY(lm_comm_allreduce(x->comm, &N, 1, LM_I64, LM_DIST_SUM, err));
            share[mi] = N > 0 ? (double)x->b.n_labels / (double)N : 0.0;
            scale = (float)share[mi] / (float)M;
        }
        LM_TRY(lm_gpu_model_micro_step_ex(x->gm, &x->b.batch, x->b.ids, x->b.labels, scale, mi > 0,
                                          mi, dp && mi == M - 1, err));
    }
    /* the model's stream waits for the reduced gradient (no host wait) */
    if (dp)
        LM_TRY(lm_nccl_join(x->nc, lm_cuda_ctx_stream(x->cuda), err));
    const int64_t nan_at = x->o->nan_at, nan_n = x->o->nan_count > 0 ? x->o->nan_count : 1;
    if (nan_at > 0 && x->k.step + 1 >= nan_at && x->k.step + 1 < nan_at + nan_n)
        LM_TRY(lm_gpu_model_poke_grad(x->gm, x->opt.blk_off[0], NAN, err)); /* test hook */
    LM_TRY(lm_gpu_model_grad_norm(x->gm, err));
    double losses[LM_GPU_MODEL_MAX_MICRO], gnorm = NAN;
    LM_TRY(lm_gpu_model_read_step(x->gm, M, losses, NULL, &gnorm, err));
    double loss_sum = 0;
    for (int mi = 0; mi < M; mi++)
        loss_sum += dp ? losses[mi] * share[mi] : losses[mi];
    int any_bad = 0;
    if (dp) {
        /* the step's loss over the ranks, and whether any rank saw a non-finite norm
         * (the norms are equal: the same reduced gradient on every rank, unless a test
         * hook poked one rank's): all skip, or none */
        double agg[2] = {loss_sum, isfinite(gnorm) ? 0.0 : 1.0};
        LM_TRY(lm_comm_allreduce(x->comm, agg, 2, LM_F64, LM_DIST_SUM, err));
        loss_sum = agg[0];
        any_bad = agg[1] > 0;
    }
    res->loss = loss_sum / M;
    res->gnorm = gnorm;
    const int bad = !isfinite(res->loss) || !isfinite(res->gnorm) || any_bad;
    const int L = x->p.cfg.num_hidden_layers;
    if (bad) {
        LM_TRY(lm_gpu_model_skip_step(x->gm, err));
        x->k.bad_streak++;
        x->k.bad_total++;
    } else {
        x->k.opt_step++;
        LM_TRY(lm_gpu_model_optim_step(x->gm, res->lr, c->weight_decay, c->beta1, c->beta2, c->eps,
                                       c->grad_clip, x->k.opt_step, x->met, x->load, err));
        for (int i = 0; i < L; i++) {
            if (!lm_model_router_state(x->m, i))
                continue;
            double tot = 0;
            double *ld = x->load + (size_t)i * x->E;
            for (int e = 0; e < x->E; e++)
                tot += ld[e];
            for (int e = 0; e < x->E; e++)
                ld[e] = tot > 0 ? ld[e] / tot : 0;
        }
        x->k.bad_streak = 0;
    }
    if (dp) {
        LM_TRY(dp_step_stats(x, res, err));
        lm_comm_get_stats(x->comm, &res->comm);
    }
    x->host_stale = 1;
    res->skipped = bad;
    x->k.tokens += st->step_tokens;
    x->k.step++;
    res->seconds = lm_time_sec() - t0;
    return LM_OK;
}

/* {"kind": {"calls": n, "bytes": b, "ms": t}, ...} of the kinds called. */
static void log_comm(FILE *f, const lm_comm_stats *st) {
    fputc('{', f);
    int first = 1;
    for (int k = 0; k < LM_COLL_N; k++) {
        if (!st->calls[k])
            continue;
        fprintf(f, "%s\"%s\": {\"calls\": %lld, \"bytes\": %lld, \"ms\": ", first ? "" : ", ",
                lm_coll_name((lm_coll_kind)k), (long long)st->calls[k], (long long)st->bytes[k]);
        jnum(f, st->seconds[k] * 1e3, 4);
        fputc('}', f);
        first = 0;
    }
    fputc('}', f);
}

static void log_step(ctx *x, int s, const step_result *r, double tok_s, double mfu) {
    const lm_train_config *c = x->c;
    FILE *f = x->flog;
    if (!f)
        return; /* ranks other than 0 */
    fprintf(f, "{\"step\": %lld, \"tokens\": %lld, \"stage\": %d, \"seq_len\": %d, \"loss\": ",
            (long long)x->k.step, (long long)x->k.tokens, s, c->stages[s].seq_len);
    jnum(f, r->loss, 17);
    fputs(", \"lr\": ", f);
    jnum(f, r->lr, 9);
    fputs(", \"grad_norm\": ", f);
    jnum(f, r->gnorm, 9);
    fputs(", \"tok_per_s\": ", f);
    jnum(f, tok_s, 6);
    fputs(", \"mfu\": ", f);
    jnum(f, mfu, 6);
    fprintf(f, ", \"skipped\": %d, \"bad_total\": %lld, \"passkey_rows\": %d, \"long_rows\": %d, ",
            r->skipped, (long long)x->k.bad_total, r->n_passkey, r->n_long);
    if (x->world > 1 || x->nc) {
        /* this rank's (rank 0's) collectives of the step: calls, bytes sent, ms */
        fprintf(f, "\"ranks\": %d, \"comm\": ", x->world);
        log_comm(f, &r->comm);
        if (x->nc) {
            /* the device collectives (NCCL, GPU time), and the gradient reduction against
             * the backward: its span from the first bucket's start to the last one's
             * end, the part of it before the backward's end (overlapped) and after
             * (exposed) */
            fputs(", \"nccl\": ", f);
            log_comm(f, &r->nccl);
            fprintf(f, ", \"overlap\": {\"buckets\": %d, \"reduce_ms\": ", r->n_buckets);
            jnum(f, r->red_ms, 4);
            fputs(", \"overlapped_ms\": ", f);
            jnum(f, r->red_overlap_ms, 4);
            fputs(", \"exposed_ms\": ", f);
            jnum(f, r->red_exposed_ms, 4);
            fputc('}', f);
        }
        fputs(", ", f);
    }
    fputs("\"moe\": ", f);
    if (r->skipped) {
        fputs("null}\n", f);
        fflush(f);
        return;
    }
    fputc('[', f);
    int first = 1;
    for (int i = 0; i < x->p.cfg.num_hidden_layers; i++) {
        lm_router_state *rs = lm_model_router_state(x->m, i);
        if (!rs)
            continue;
        const lm_router_metrics *mt = &x->met[i];
        fprintf(f, "%s{\"layer\": %d, \"maxvio_batch\": ", first ? "" : ", ", i + 1);
        jnum(f, mt->maxvio_batch, 6);
        fputs(", \"maxvio_global\": ", f);
        jnum(f, mt->maxvio_global, 6);
        fputs(", \"dropped_frac\": ", f);
        jnum(f, mt->dropped_assign_frac, 6);
        fputs(", \"bias_mean\": ", f);
        jnum(f, mt->bias_mean, 6);
        fputs(", \"bias_std\": ", f);
        jnum(f, mt->bias_std, 6);
        fputs(", \"bias_min\": ", f);
        jnum(f, mt->bias_min, 6);
        fputs(", \"bias_max\": ", f);
        jnum(f, mt->bias_max, 6);
        fprintf(f, ", \"n_dead\": %d, \"tokens\": %lld, \"load\": [", mt->n_dead,
                (long long)mt->tokens);
        for (int e = 0; e < rs->E; e++) {
            if (e)
                fputs(", ", f);
            jnum(f, x->load[(size_t)i * x->E + e], 5);
        }
        fputs("]}", f);
        first = 0;
    }
    fputs("]}\n", f);
    fflush(f);
}

/* ---------------------------------------------------------------- setup / teardown */

static void ctx_free(ctx *x) {
    if (x->flog)
        fclose(x->flog);
    if (x->feval)
        fclose(x->feval);
    if (x->fstage)
        fclose(x->fstage);
    if (x->have_b)
        lm_loader_batch_free(&x->b);
    if (x->have_gb)
        lm_loader_batch_free(&x->gb);
    free(x->gshard);
    free(x->shard);
    free(x->full_mv);
    free(x->shardx);
    free(x->gshardx);
    free(x->normbuf);
    free(x->vexp.t);
    if (x->have_optx)
        lm_adamw_free(&x->optx);
    if (x->have_fullp)
        lm_params_free(&x->fullp);
    lm_comm_free(x->dpc);
    lm_comm_free(x->epc);
    lm_comm_free(x->own_comm);
    lm_loader_free(x->ld);
    if (x->have_opt)
        lm_adamw_free(&x->opt);
    lm_gpu_model_free(x->gm);
    lm_nccl_comm_free(x->nc);
    lm_cuda_ctx_free(x->cuda);
    lm_model_free(x->m);
    if (x->have_p)
        lm_params_free(&x->p);
    if (x->have_train)
        lm_shard_close(&x->train);
    if (x->have_val)
        lm_shard_close(&x->val);
    lm_tokenizer_free(x->tok);
    free(x->load);
    free(x->met);
}

static lm_status open_shard(ctx *x, lm_shard *s, const char *path, const char *key, lm_error *err) {
    lm_status r = lm_shard_open(s, path, err);
    if (r == LM_OK)
        r = lm_shard_validate(s, err);
    if (r != LM_OK) {
        char buf[sizeof err->msg];
        snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
        return lm_errorf(err, r, "%s: %s (%s): %s", x->c->source, key, path, buf);
    }
    if ((int)s->vocab != lm_tokenizer_vocab_size(x->tok))
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: %s (%s) was written with vocab %u, but the %s tokenizer has %d",
                         x->c->source, key, path, (unsigned)s->vocab, lm_tokenizer_name(x->tok),
                         lm_tokenizer_vocab_size(x->tok));
    return LM_OK;
}

/* The validation documents within the first max_val_tokens tokens (whole documents). */
static void make_val_sub(ctx *x) {
    x->val_sub = x->val;
    x->val_sub.map = NULL;
    const int64_t lim = x->c->max_val_tokens;
    if (lim <= 0 || (uint64_t)lim >= x->val.count)
        return;
    const int32_t eot = lm_tokenizer_eot(x->tok);
    int64_t cut = -1;
    for (int64_t i = lim - 1; i >= 0 && cut < 0; i--)
        if (lm_shard_get(&x->val, (uint64_t)i) == eot)
            cut = i + 1;
    for (int64_t i = lim; cut < 0 && (uint64_t)i < x->val.count; i++)
        if (lm_shard_get(&x->val, (uint64_t)i) == eot)
            cut = i + 1;
    if (cut > 0)
        x->val_sub.count = (uint64_t)cut;
}

/* Model sections equal up to rope_theta (a stage setting) and the bench-only keys. */
static int same_model(const lm_model_config *a, const lm_model_config *b) {
    lm_model_config x = *a, y = *b;
    x.rope_theta = y.rope_theta = 10000.0f;
    x.seq_len = y.seq_len = x.batch_size = y.batch_size = 0;
    char *s = lm_model_config_to_json(&x), *t = lm_model_config_to_json(&y);
    int eq = s && t && strcmp(s, t) == 0;
    free(s);
    free(t);
    return eq;
}

/* --resume with a config: the one the run was started with (saved in the checkpoint) and
 * the new one must describe the same run up to this step (lm_train_config_resume_check);
 * safe changes are said, and the steps done must account for exactly the tokens the
 * checkpoint counted under the new config (the budget stays exact). */
static lm_status check_resume(ctx *x, const lm_train_config *c, const char *ckdir, lm_error *err) {
    char *text = NULL;
    LM_TRY(lm_train_checkpoint_config(ckdir, &text, err));
    lm_train_config was;
    memset(&was, 0, sizeof was);
    char label[PATHMAX + 128];
    snprintf(label, sizeof label, "%s/train_state.safetensors (train_config)", ckdir);
    lm_status st = lm_train_config_parse(&was, text, label, err);
    free(text);
    char log[4096];
    if (st == LM_OK)
        st = lm_train_config_resume_check(&was, c, x->k.step, log, sizeof log, err);
    lm_train_config_free(&was);
    LM_TRY(st);
    for (char *line = log, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        if (!nl)
            break;
        *nl = '\0';
        say(x, "resume: %s (changed in %s, applied)", line, c->source);
    }
    int64_t tokens = 0;
    for (int64_t i = 0; i < x->k.step; i++)
        tokens += c->stages[lm_train_stage_of(c, i)].step_tokens;
    if (tokens != x->k.tokens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s/train_state.safetensors: %lld tokens after %lld steps, but %s gives "
                         "%lld for those steps",
                         ckdir, (long long)x->k.tokens, (long long)x->k.step, c->source,
                         (long long)tokens);
    return LM_OK;
}

static lm_status setup(ctx *x, const lm_train_config *c, lm_error *err) {
    const lm_train_options *o = x->o;
    int threads = o->threads > 0 ? o->threads : c->threads;
    if (threads <= 0 && lm_comm_local_size(x->comm) > 1) {
        /* ranks on one host share its cores */
        const long n = sysconf(_SC_NPROCESSORS_ONLN) / lm_comm_local_size(x->comm);
        threads = n > 1 ? (int)n : 1;
    }
    if (threads > 0) {
        lm_set_num_threads(threads);
        lm_blas_set_threads(threads);
    }
    LM_TRY(lm_tokenizer_open(&x->tok, c->tokenizer, c->tokenizer_dir, err));
    if (c->model.vocab_size < lm_tokenizer_vocab_size(x->tok))
        return lm_errorf(err, LM_ERR_INVALID, "%s: model.vocab_size = %d < the tokenizer's %d",
                         c->source, c->model.vocab_size, lm_tokenizer_vocab_size(x->tok));
    LM_TRY(open_shard(x, &x->train, c->train_path, "data.train", err));
    x->have_train = 1;
    LM_TRY(open_shard(x, &x->val, c->val_path, "data.val", err));
    x->have_val = 1;
    make_val_sub(x);
    return LM_OK;
}

/* ---------------------------------------------------------------- the run */

/* The run directory's files (rank 0): leftovers of an interrupted checkpoint removed,
 * train_config.json, the logs (on resume: cut back to the checkpoint's step). */
static lm_status open_run_files(ctx *x, lm_error *err) {
    const lm_train_options *o = x->o;
    lm_train_ckpt_cleanup(x->run);
    char path[PATHMAX + 64];
    snprintf(path, sizeof path, "%s/train_config.json", x->run);
    LM_TRY(write_text_atomic(path, x->c->text, err));
    if (o->resume) {
        snprintf(path, sizeof path, "%s/log.jsonl", x->run);
        LM_TRY(filter_jsonl(path, "step", x->k.step, err));
        snprintf(path, sizeof path, "%s/evals.jsonl", x->run);
        LM_TRY(filter_jsonl(path, "step", x->k.step, err));
        snprintf(path, sizeof path, "%s/stages.jsonl", x->run);
        LM_TRY(filter_jsonl(path, "stage", x->k.stage, err));
    }
    LM_TRY(open_log(x, "log.jsonl", o->resume, &x->flog, err));
    LM_TRY(open_log(x, "evals.jsonl", o->resume, &x->feval, err));
    LM_TRY(open_log(x, "stages.jsonl", o->resume, &x->fstage, err));
    return LM_OK;
}

/* FNV-1a over the bytes of n floats (the replicas' agreement check). */
static uint64_t hash_floats(const float *v, int64_t n) {
    const unsigned char *b = (const unsigned char *)v;
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n * (int64_t)sizeof(float); i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Sharded experts: a buffer of this rank's layout (params, or a moment assembled by
 * gather_moment) in the single-rank layout. rep: the replicated region [nrep] (x->p's
 * offsets); exps [ep][nexp]: every EP rank's expert region. */
static void to_full(const ctx *x, const float *rep, const float *exps, const lm_params *fp,
                    float *dst) {
    for (int e = 0; e < x->ep; e++) {
        /* lm_params_shard_to_full reads src + offset: a buffer of x->p's layout */
        float *one = LM_MALLOC(sizeof(float) * (size_t)(x->p.numel > 0 ? x->p.numel : 1));
        memcpy(one, rep, sizeof(float) * (size_t)x->nrep);
        memcpy(one + x->nrep, exps + (int64_t)e * x->nexp, sizeof(float) * (size_t)x->nexp);
        lm_params_shard_to_full(&x->p, one, e, e == 0, fp, dst);
        free(one);
    }
}

/* The whole model in the single-rank layout, assembled from the EP ranks' experts:
 * root < 0, on every rank (all-gather over its EP group: every replica of a shard
 * holds the same experts); root 0, on world rank 0 only (fp untouched elsewhere;
 * *have says whether fp was initialised). Collective. */
static lm_status full_params(ctx *x, int root, lm_params *fp, int *have, lm_error *err) {
    *have = 0;
    const int recv = root < 0 || x->rank == 0;
    float *exps = recv ? LM_MALLOC(sizeof(float) * (size_t)(x->ep * x->nexp + 1)) : NULL;
    lm_status st;
    if (root < 0) {
        int64_t *cnt = LM_MALLOC(sizeof(int64_t) * (size_t)x->ep);
        for (int e = 0; e < x->ep; e++)
            cnt[e] = x->nexp;
        st = lm_comm_allgather(x->epc, x->p.data + x->nrep, exps, cnt, LM_F32, err);
        free(cnt);
    } else {
        /* the EP group of DP replica 0 (world ranks 0 .. ep-1) sends its experts */
        int64_t *cnt = LM_MALLOC(sizeof(int64_t) * (size_t)x->world);
        for (int q = 0; q < x->world; q++)
            cnt[q] = q < x->ep ? x->nexp : 0;
        st = lm_comm_gather(x->comm, x->p.data + x->nrep, exps, cnt, LM_F32, 0, err);
        free(cnt);
    }
    if (st == LM_OK && recv) {
        st = lm_params_init(fp, &x->p.cfg, err);
        if (st == LM_OK) {
            *have = 1;
            to_full(x, x->p.data, exps, fp, fp->data);
        }
    }
    free(exps);
    return st;
}

/* One AdamW moment of a sharded run on world rank 0, in x->p's layout per EP rank:
 * rep [nrep] (the world's ZeRO shards of the replicated region) and exps [ep][nexp]
 * (each DP group's shards of its expert region). mx: the same moment of optx. */
static lm_status gather_moment(ctx *x, const float *mr, const float *mx, float *rep, float *exps,
                               lm_error *err) {
    LM_TRY(lm_comm_gather(x->comm, mr, rep, x->shard, LM_F32, 0, err));
    int64_t *cnt = LM_MALLOC(sizeof(int64_t) * (size_t)x->world);
    int64_t tot = 0;
    for (int q = 0; q < x->world; q++)
        tot += cnt[q] = x->shardx[q / x->ep];
    float *buf = x->rank == 0 ? LM_MALLOC(sizeof(float) * (size_t)(tot + 1)) : NULL;
    lm_status st = lm_comm_gather(x->comm, mx, buf, cnt, LM_F32, 0, err);
    if (st == LM_OK && x->rank == 0) {
        /* world rank q = (dp d, ep e) sent elements [lo_d, lo_d + shardx[d]) of EP rank
         * e's expert region */
        int64_t at = 0;
        for (int q = 0; q < x->world; q++) {
            const int d = q / x->ep, e = q % x->ep;
            int64_t lo = 0;
            for (int j = 0; j < d; j++)
                lo += x->shardx[j];
            memcpy(exps + (int64_t)e * x->nexp + lo, buf + at, sizeof(float) * (size_t)cnt[q]);
            at += cnt[q];
        }
    }
    free(buf);
    free(cnt);
    return st;
}

/* save_checkpoint of a run with sharded experts: the replicas of each region must
 * agree (the replicated region over the world, the expert region over each DP
 * group), then world rank 0 assembles the single-rank layout (parameters from EP
 * group 0, both moments from every rank's shards) and writes it as one process
 * would; the assembled copies live only for the write. */
static lm_status save_checkpoint_sharded(ctx *x, const lm_loader_state *ls, int fail,
                                         lm_error *err) {
    const lm_train_config *c = x->c;
    int64_t *h = LM_MALLOC(sizeof(int64_t) * 2 * (size_t)x->world);
    int64_t *twos = LM_MALLOC(sizeof(int64_t) * (size_t)x->world);
    for (int q = 0; q < x->world; q++)
        twos[q] = 2;
    h[2 * x->rank] = (int64_t)hash_floats(x->p.data, x->nrep);
    h[2 * x->rank + 1] = (int64_t)hash_floats(x->p.data + x->nrep, x->nexp);
    lm_status st = lm_comm_allgather(x->comm, h + 2 * x->rank, h, twos, LM_I64, err);
    for (int q = 1; st == LM_OK && q < x->world; q++) {
        const int q0 = q % x->ep; /* the rank of DP replica 0 with q's experts */
        if (h[2 * q] != h[0] || h[2 * q + 1] != h[2 * q0 + 1])
            st = lm_errorf(err, LM_ERR_INVALID,
                           "train: at step %lld rank %d holds different %s than rank %d "
                           "(hash %016llx vs %016llx): the data-parallel replicas diverged",
                           (long long)x->k.step, q, h[2 * q] != h[0] ? "parameters" : "experts",
                           h[2 * q] != h[0] ? 0 : q0,
                           (unsigned long long)(h[2 * q] != h[0] ? h[2 * q] : h[2 * q + 1]),
                           (unsigned long long)(h[2 * q] != h[0] ? h[0] : h[2 * q0 + 1]));
    }
    free(twos);
    free(h);
    LM_TRY(st);
    lm_params fp;
    int have_fp = 0;
    LM_TRY(full_params(x, 0, &fp, &have_fp, err));
    const int r0 = x->rank == 0;
    float *rep = r0 ? LM_MALLOC(sizeof(float) * (size_t)(x->nrep + 1)) : NULL;
    float *exps = r0 ? LM_MALLOC(sizeof(float) * (size_t)(x->ep * x->nexp + 1)) : NULL;
    lm_adamw full;
    memset(&full, 0, sizeof full);
    if (r0)
        lm_adamw_init(&full, &fp);
    st = gather_moment(x, x->opt.m, x->optx.m, rep, exps, err);
    if (st == LM_OK && r0)
        to_full(x, rep, exps, &fp, full.m);
    if (st == LM_OK)
        st = gather_moment(x, x->opt.v, x->optx.v, rep, exps, err);
    if (st == LM_OK && r0) {
        to_full(x, rep, exps, &fp, full.v);
        st = lm_train_ckpt_save(x->run, &fp, &full, x->m, &x->k, ls, c->text, c->keep_last, fail,
                                x->last_ckpt, sizeof x->last_ckpt, err);
    }
    free(rep);
    free(exps);
    if (r0)
        lm_adamw_free(&full);
    if (have_fp)
        lm_params_free(&fp);
    return lm_comm_agree(x->comm, st, err);
}

static lm_status check_replicas(ctx *x, lm_error *err);

/* A checkpoint of a data-parallel run: the replicas must hold bitwise the same
 * parameters (MoE biases included: each rank updates them from the all-reduced
 * load), checked by a hash per rank; rank 0 gathers the AdamW shards and writes the
 * one logical checkpoint; every rank learns whether it worked. */
static lm_status save_checkpoint(ctx *x, const lm_loader_state *ls, lm_error *err) {
    const lm_train_options *o = x->o;
    const lm_train_config *c = x->c;
    const int fail = o->fail_checkpoint_at > 0 && o->fail_checkpoint_at == x->k.step;
    if (x->world == 1)
        return lm_train_ckpt_save(x->run, &x->p, &x->opt, x->m, &x->k, ls, c->text, c->keep_last,
                                  fail, x->last_ckpt, sizeof x->last_ckpt, err);
    if (x->sharded)
        return save_checkpoint_sharded(x, ls, fail, err);
    LM_TRY(check_replicas(x, err));
    if (x->gm) {
        /* GPU ranks: every rank holds the whole AdamW state (no ZeRO on the device);
         * rank 0 writes its own copy, as one process */
        lm_status st = LM_OK;
        if (x->rank == 0)
            st = lm_train_ckpt_save(x->run, &x->p, &x->opt, x->m, &x->k, ls, c->text, c->keep_last,
                                    fail, x->last_ckpt, sizeof x->last_ckpt, err);
        return lm_comm_agree(x->comm, st, err);
    }
    LM_TRY(lm_comm_gather(x->comm, x->opt.m, x->full_mv, x->shard, LM_F32, 0, err));
    LM_TRY(lm_comm_gather(x->comm, x->opt.v, x->rank == 0 ? x->full_mv + x->p.numel : NULL,
                          x->shard, LM_F32, 0, err));
    lm_status st = LM_OK;
    if (x->rank == 0) {
        lm_adamw full = x->opt;
        full.m = x->full_mv;
        full.v = x->full_mv + x->p.numel;
        full.lo = 0;
        full.hi = x->p.numel;
        st = lm_train_ckpt_save(x->run, &x->p, &full, x->m, &x->k, ls, c->text, c->keep_last, fail,
                                x->last_ckpt, sizeof x->last_ckpt, err);
    }
    return lm_comm_agree(x->comm, st, err);
}

/* The data-parallel replicas must hold bitwise the same parameters (MoE biases
 * included: each rank updates them from the all-reduced load): a hash per rank,
 * all-gathered. */
static lm_status check_replicas(ctx *x, lm_error *err) {
    int64_t *h = LM_MALLOC(sizeof(int64_t) * (size_t)x->world), ones_buf[64];
    int64_t *ones = x->world <= 64 ? ones_buf : LM_MALLOC(sizeof(int64_t) * (size_t)x->world);
    for (int q = 0; q < x->world; q++)
        ones[q] = 1;
    h[x->rank] = (int64_t)hash_floats(x->p.data, x->p.numel);
    lm_status st = lm_comm_allgather(x->comm, h + x->rank, h, ones, LM_I64, err);
    for (int q = 1; st == LM_OK && q < x->world; q++)
        if (h[q] != h[0])
            st = lm_errorf(err, LM_ERR_INVALID,
                           "train: at step %lld rank %d holds different parameters than rank 0 "
                           "(hash %016llx vs %016llx): the data-parallel replicas diverged",
                           (long long)x->k.step, q, (unsigned long long)h[q],
                           (unsigned long long)h[0]);
    if (ones != ones_buf)
        free(ones);
    free(h);
    return st;
}

/* Whether the MoE layers route the world's micro-batch (moe_ep.h's routing
 * communicator = the world; every rank runs the router on every rank's logits):
 * with EP (the layer is collective anyway), and in data-parallel runs whose routing
 * depends on the batch beyond one token: capacity (per expert over the batch), the
 * aux loss (its counts and means are the batch's) and quantile balancing (a dual
 * solve per micro-batch). Then the tokens dropped, the aux loss and its gradient, and
 * the router states are those of one process on the global micro-batch. Dropless
 * aux-free / none routing is per token: each rank routes its own share (no collective
 * inside the forward) and the counts are summed at the bias update. */
static int route_world(const ctx *x, const lm_train_config *c) {
    if (x->world == 1 || x->o->device.type == LM_DEVICE_CUDA)
        return 0;
    int moe = 0;
    for (int i = 0; i < c->model.num_hidden_layers; i++)
        moe |= lm_model_layer_is_moe(&c->model, i);
    const lm_router_config *r = &c->model.moe.router;
    return moe && (x->ep > 1 || r->capacity_factor > 0 || r->balance == LM_BAL_AUX_LOSS ||
                   r->balance == LM_BAL_QUANTILE);
}

/* What the GPU ranks do not run (several ranks; one rank over NCCL is the plain run):
 * expert parallelism, and routing that depends on the whole micro-batch (capacity, the
 * aux loss, quantile balancing), which the CPU ranks route over the world
 * (route_world) and the GPU MoE layer cannot yet: each GPU rank routes its own share,
 * which is one process's result only for per-token (dropless aux-free / none) routing. */
static lm_status gpu_dp_check(const ctx *x, const lm_train_config *c, lm_error *err) {
    if (x->world == 1)
        return LM_OK;
    if (c->expert_parallel > 1)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s: train.expert_parallel = %d with --device cuda: expert parallelism "
                         "runs on CPU ranks only (GPU ranks are data-parallel)",
                         c->source, c->expert_parallel);
    int moe = 0;
    for (int i = 0; i < c->model.num_hidden_layers; i++)
        moe |= lm_model_layer_is_moe(&c->model, i);
    const lm_router_config *r = &c->model.moe.router;
    if (moe && r->capacity_factor > 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s: model capacity_factor = %g with --device cuda on %d ranks: capacity "
                         "is per expert over the whole micro-batch, which GPU ranks do not route "
                         "together yet (use 0, dropless, or CPU ranks)",
                         c->source, (double)r->capacity_factor, x->world);
    if (moe && (r->balance == LM_BAL_AUX_LOSS || r->balance == LM_BAL_QUANTILE))
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s: model balance = %s with --device cuda on %d ranks: it depends on the "
                         "whole micro-batch, which GPU ranks do not route together yet (use "
                         "aux_free or none, or CPU ranks)",
                         c->source, r->balance == LM_BAL_AUX_LOSS ? "aux_loss" : "quantile",
                         x->world);
    return LM_OK;
}

static lm_status run(ctx *x, const lm_train_config *c, lm_train_summary *out, lm_error *err) {
    const lm_train_options *o = x->o;
    char ckdir[PATHMAX + 64] = "";
    if (o->comm) {
        x->comm = o->comm;
    } else {
        LM_TRY(lm_comm_self_new(&x->own_comm, err));
        x->comm = x->own_comm;
    }
    x->rank = lm_comm_rank(x->comm);
    x->world = lm_comm_size(x->comm);
    if (x->rank != 0)
        x->quiet = 1, x->live = 0; /* rank 0 speaks for the job */
    if (x->world % c->expert_parallel != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: train.expert_parallel = %d needs a number of ranks that is a "
                         "multiple of it (this job has %d; launch with mpirun -np N)",
                         c->source, c->expert_parallel, x->world);
    if (o->dist_nccl && o->device.type != LM_DEVICE_CUDA)
        return lm_errorf(err, LM_ERR_INVALID,
                         "train: --dist nccl needs --device cuda (CPU ranks use MPI)");
    if (o->device.type == LM_DEVICE_CUDA)
        LM_TRY(gpu_dp_check(x, c, err));
    if (o->resume) {
        LM_TRY(lm_train_latest_checkpoint(x->run, ckdir, sizeof ckdir, err));
    } else {
        char lp[PATHMAX + 32];
        snprintf(lp, sizeof lp, "%s/ckpt/latest", x->run);
        if (access(lp, F_OK) == 0)
            return lm_errorf(err, LM_ERR_INVALID,
                             "%s already holds a run (%s exists): pass --resume to continue it, or "
                             "choose a new run directory",
                             x->run, lp);
    }
    LM_TRY(setup(x, c, err));
    x->ep = c->expert_parallel;
    x->dp = x->world / x->ep;
    x->ep_rank = x->rank % x->ep; /* dist.h lm_comm_split_grid's layout */
    x->dp_rank = x->rank / x->ep;
    x->sharded = x->ep > 1;
    /* parameters (with EP: this rank's experts only) */
    if (o->resume && x->sharded) {
        LM_TRY(lm_params_load(&x->fullp, ckdir, err));
        x->have_fullp = 1;
        if (!same_model(&x->fullp.cfg, &c->model))
            return lm_errorf(
                err, LM_ERR_INVALID,
                "%s/config.json: the checkpoint's model differs from the model section "
                "of %s",
                ckdir, c->source);
        LM_TRY(lm_params_init_ep(&x->p, &x->fullp.cfg, x->ep_rank, x->ep, err));
        x->have_p = 1;
        lm_params_full_to_shard(&x->fullp, x->fullp.data, &x->p, x->ep_rank, x->p.data);
    } else if (o->resume) {
        LM_TRY(lm_params_load(&x->p, ckdir, err));
        x->have_p = 1;
        if (!same_model(&x->p.cfg, &c->model))
            return lm_errorf(
                err, LM_ERR_INVALID,
                "%s/config.json: the checkpoint's model differs from the model section "
                "of %s",
                ckdir, c->source);
    } else {
        LM_TRY(lm_params_init_ep(&x->p, &c->model, x->ep_rank, x->ep, err));
        x->have_p = 1;
        lm_params_init_weights(&x->p, c->model.seed);
    }
    /* max_micro: the tokens of a global micro-batch; the model plans for this rank's
     * share (rows / world of every micro-batch: the world must divide them) */
    int64_t max_tokens = c->eval_seq_len, max_micro = 2, max_share = 2;
    for (int s = 0; s < c->n_stages; s++) {
        const int64_t t = (int64_t)c->stages[s].rows_per_micro * c->stages[s].seq_len;
        if (c->stages[s].rows_per_micro % x->world != 0)
            return lm_errorf(
                err, LM_ERR_INVALID,
                "%s: stage '%s' (stages[%d]): a micro-batch of %d rows of %d tokens "
                "cannot be split evenly over %d data-parallel ranks (train.batch_tokens "
                "/ train.micro_batches / seq_len must be a multiple of %d rows)",
                c->source, c->stages[s].name, s, c->stages[s].rows_per_micro, c->stages[s].seq_len,
                x->world, x->world);
        if (t > max_micro)
            max_micro = t;
        if (t / x->world > max_share)
            max_share = t / x->world;
    }
    if (max_share > max_tokens)
        max_tokens = max_share;
    for (int i = 0; i < c->n_passkey_lengths; i++)
        if (c->passkey_lengths[i] > max_tokens)
            max_tokens = c->passkey_lengths[i];
    const int on_gpu = o->device.type == LM_DEVICE_CUDA;
    const int gpu_dp = on_gpu && (x->world > 1 || o->dist_nccl);
    if (on_gpu) {
        /* the steps and the evals run on the device; the CPU model only holds the router
         * states a checkpoint reads (its activations are planned for one token) */
        int64_t eval_tokens = c->eval_seq_len;
        for (int i = 0; i < c->n_passkey_lengths; i++)
            if (c->passkey_lengths[i] > eval_tokens)
                eval_tokens = c->passkey_lengths[i];
        int max_seqs = 1;
        for (int s = 0; s < c->n_stages; s++) {
            /* a packed micro-batch holds at most one document per 2 tokens (every document
             * has its end-of-text token), plus one row boundary per row */
            const int64_t docs = (int64_t)c->stages[s].rows_per_micro * c->stages[s].seq_len / 2 +
                                 c->stages[s].rows_per_micro;
            if (docs > max_seqs)
                max_seqs = docs > (1 << 20) ? (1 << 20) : (int)docs;
        }
        LM_TRY(lm_gpu_model_supports(&x->p.cfg, err));
        /* several ranks: one GPU each, the rank's index on its host after device.index */
        const int dev = o->device.index + (x->world > 1 ? lm_comm_local_rank(x->comm) : 0);
        LM_TRY(lm_cuda_ctx_new(&x->cuda, dev, err));
        const lm_gpu_model_opts go = {c->n_recompute ? c->recompute : NULL};
        /* the model trains on this rank's share (the whole micro-batch on one rank) */
        x->gpu_tokens = max_share > eval_tokens ? max_share : eval_tokens;
        x->gpu_seqs = max_seqs;
        LM_TRY(lm_gpu_model_new_opts(&x->gm, x->cuda, &x->p, x->gpu_tokens, max_seqs, &go, err));
        max_tokens = 1;
        if (gpu_dp) {
            /* collective over the host communicator (the NCCL id goes over it) */
            LM_TRY(lm_nccl_comm_new(&x->nc, x->comm, dev, err));
            x->bucket_elems = (o->bucket_bytes > 0 ? o->bucket_bytes : (int64_t)25 << 20) / 4;
            if (x->bucket_elems < 1)
                x->bucket_elems = 1;
            const lm_gpu_model_dp hooks = {dp_grads_ready, dp_router_sums, x};
            LM_TRY(lm_gpu_model_set_dp(x->gm, &hooks, err));
        }
    }
    LM_TRY(lm_model_new(&x->m, &x->p, max_tokens, err));
    x->rcomm = x->comm;
    x->world_route = route_world(x, c);
    if (x->world_route) {
        LM_TRY(lm_comm_split_grid(x->comm, x->ep, &x->dpc, &x->epc, err));
        LM_TRY(lm_model_set_expert_parallel(x->m, x->epc, x->comm, err));
        x->rcomm = NULL;
    }
    x->nrep = x->p.expert_off;
    x->nexp = x->p.numel - x->p.expert_off;
    if (x->sharded) {
        /* the two regions as tables of their own (offsets from the region's start) */
        int nr = 0;
        while (nr < x->p.n && !x->p.t[nr].routed)
            nr++;
        x->vrep = x->p;
        x->vrep.n = nr;
        x->vrep.numel = x->nrep;
        x->vexp = x->p;
        x->vexp.n = x->p.n - nr;
        x->vexp.t = LM_MALLOC(sizeof(lm_param_info) * (size_t)(x->vexp.n + 1));
        for (int i = 0; i < x->vexp.n; i++) {
            x->vexp.t[i] = x->p.t[nr + i];
            x->vexp.t[i].offset -= x->nrep;
        }
        x->vexp.data = x->p.data + x->nrep;
        x->vexp.numel = x->nexp;
        lm_adamw_init_shard(&x->opt, &x->vrep, x->rank, x->world);
        lm_adamw_init_shard(&x->optx, &x->vexp, x->dp_rank, x->dp);
        x->have_optx = 1;
        x->shardx = LM_MALLOC(sizeof(int64_t) * (size_t)x->dp);
        for (int q = 0; q < x->dp; q++) {
            int64_t lo, hi;
            lm_adamw_shard_range(&x->optx, q, x->dp, &lo, &hi);
            x->shardx[q] = hi - lo;
        }
        x->gshardx = LM_MALLOC(sizeof(float) * (size_t)(x->shardx[x->dp_rank] + 1));
        x->normbuf =
            LM_MALLOC(sizeof(double) * (size_t)(x->opt.nblk + (int64_t)x->ep * x->optx.nblk + 1));
    } else if (x->gm) {
        /* GPU ranks: the whole AdamW state on every rank (the host copy of the device's,
         * for checkpoints) */
        lm_adamw_init_shard(&x->opt, &x->p, 0, 1);
    } else {
        lm_adamw_init_shard(&x->opt, &x->p, x->rank, x->world);
    }
    x->have_opt = 1;
    if (x->world > 1) {
        if (!x->gm) {
            x->shard = LM_MALLOC(sizeof(int64_t) * (size_t)x->world);
            for (int q = 0; q < x->world; q++) {
                int64_t lo, hi;
                lm_adamw_shard_range(&x->opt, q, x->world, &lo, &hi);
                x->shard[q] = hi - lo;
            }
            x->gshard = LM_MALLOC(sizeof(float) * (size_t)(x->shard[x->rank] + 1));
            if (x->rank == 0 && !x->sharded)
                x->full_mv = LM_MALLOC(sizeof(float) * 2 * (size_t)x->p.numel);
        }
        LM_TRY(lm_loader_batch_init(&x->gb, 1, (int)max_micro, err));
        x->have_gb = 1;
    }
    /* every rank: the one-rank stream (global batches), then its share */
    LM_TRY(lm_loader_new(&x->ld, &x->train, x->tok, c->seed, 0, 1, err));
    LM_TRY(lm_loader_batch_init(&x->b, 1, (int)max_micro, err));
    x->have_b = 1;
    const int L = x->p.cfg.num_hidden_layers;
    x->E = x->p.cfg.moe.router.num_experts > 0 ? x->p.cfg.moe.router.num_experts : 1;
    x->load = LM_CALLOC((size_t)L * x->E, sizeof(double));
    x->met = LM_CALLOC((size_t)L, sizeof(lm_router_metrics));
    /* every stage's data mix and every eval length must work before hours of training */
    for (int s = 0; s < c->n_stages; s++)
        LM_TRY(apply_stage(x, s, err));
    for (int i = 0; i < c->n_passkey_lengths; i++) {
        lm_passkey_doc d;
        memset(&d, 0, sizeof d);
        lm_status r =
            lm_passkey_make(x->tok, &x->val, c->passkey_lengths[i], c->passkey_seed, 0, &d, err);
        lm_passkey_doc_free(&d);
        if (r != LM_OK) {
            char buf[sizeof err->msg];
            snprintf(buf, sizeof buf, "%s", err ? err->msg : "");
            return lm_errorf(err, r, "%s: eval.passkey_lengths[%d] = %d: %s", c->source, i,
                             c->passkey_lengths[i], buf);
        }
    }
    /* state */
    memset(&x->k, 0, sizeof x->k);
    x->k.version = LM_TRAIN_STATE_VERSION;
    x->k.stage = -1;
    lm_loader_state ls;
    lm_loader_get_state(x->ld, &ls);
    if (o->resume && x->sharded) {
        /* the single-rank moments, then this rank's pieces of them */
        lm_adamw fa;
        lm_adamw_init(&fa, &x->fullp);
        lm_status st = lm_train_state_load(ckdir, &x->fullp, &fa, x->m, &x->k, &ls, err);
        if (st == LM_OK) {
            float *t = LM_MALLOC(sizeof(float) * (size_t)(x->p.numel + 1));
            const float *src[2] = {fa.m, fa.v};
            float *rdst[2] = {x->opt.m, x->opt.v}, *xdst[2] = {x->optx.m, x->optx.v};
            for (int j = 0; j < 2; j++) {
                lm_params_full_to_shard(&x->fullp, src[j], &x->p, x->ep_rank, t);
                memcpy(rdst[j], t + x->opt.lo, sizeof(float) * (size_t)(x->opt.hi - x->opt.lo));
                memcpy(xdst[j], t + x->nrep + x->optx.lo,
                       sizeof(float) * (size_t)(x->optx.hi - x->optx.lo));
            }
            free(t);
        }
        lm_adamw_free(&fa);
        lm_params_free(&x->fullp);
        x->have_fullp = 0;
        LM_TRY(st);
    } else if (o->resume) {
        LM_TRY(lm_train_state_load(ckdir, &x->p, &x->opt, x->m, &x->k, &ls, err));
    }
    if (o->resume) {
        LM_TRY(check_resume(x, c, ckdir, err));
        if (x->k.stage >= c->n_stages)
            return lm_errorf(err, LM_ERR_INVALID, "%s: stage %lld but %s has %d stages", ckdir,
                             (long long)x->k.stage, c->source, c->n_stages);
        LM_TRY(lm_loader_set_state(x->ld, &ls, err));
        snprintf(x->last_ckpt, sizeof x->last_ckpt, "%s", ckdir);
        if (x->gm) {
            LM_TRY(lm_gpu_model_upload(x->gm, &x->p, err));
            LM_TRY(lm_gpu_model_set_moments(x->gm, x->opt.m, x->opt.v, err));
            for (int i = 0; i < L; i++) {
                lm_router_state *rs = lm_model_router_state(x->m, i);
                if (rs)
                    LM_TRY(lm_gpu_model_set_router(x->gm, i, rs, err));
            }
        }
    }
    if (x->k.stage >= 0)
        LM_TRY(apply_stage(x, (int)x->k.stage, err));
    /* rank 0 alone writes the run directory; every rank leaves here together when
     * any failed so far */
    lm_status ost = x->rank == 0 ? open_run_files(x, err) : LM_OK;
    LM_TRY(lm_comm_agree(x->comm, ost, err));

    int64_t stop = c->total_steps;
    if (o->max_steps > 0 && o->max_steps < stop)
        stop = o->max_steps;
    int64_t tp, ta;
    lm_params_count(&x->p, &tp, &ta);
    say(x,
        "%s: %s training %s (%.2fM parameters, %.2fM active), %d stages, %lld steps, "
        "%d threads%s",
        x->run, o->resume ? "resuming" : "starting", c->source, tp / 1e6, ta / 1e6, c->n_stages,
        (long long)c->total_steps, lm_get_num_threads(), o->resume ? "" : "");
    {
        /* the model's memory classes (model.h lm_model_mem_plan: planned for
         * max_tokens tokens in one sequence, allocated once at lm_model_new) */
        char plan[512];
        lm_mem_plan_format(x->gm ? lm_gpu_model_mem_plan(x->gm) : lm_model_plan(x->m), plan,
                           sizeof plan);
        say(x, "%s%s", x->gm ? "cuda " : "", plan);
        if (x->sharded) {
            /* rank 0's routed-expert memory (every rank's is the same up to a block of
             * the ZeRO split); "replicated": what each rank held when every rank kept all
             * experts (parameters and gradients whole, AdamW state split over the world) */
            const double mib = 1.0 / (1 << 20), px = (double)x->nexp * 4,
                         ox = (double)(x->optx.hi - x->optx.lo) * 8, pa = px * x->ep,
                         oa = pa * 2 / x->world;
            say(x,
                "expert parallel %d x data parallel %d: per rank, routed experts %d of %d per "
                "MoE layer: parameters %.3f MiB + gradients %.3f MiB + AdamW state %.3f MiB = "
                "%.3f MiB (replicated experts: %.3f + %.3f + %.3f = %.3f MiB)",
                x->ep, x->dp, x->E / x->ep, x->E, px * mib, px * mib, ox * mib, (2 * px + ox) * mib,
                pa * mib, pa * mib, oa * mib, (2 * pa + oa) * mib);
        }
        if (c->n_recompute) {
            lm_mem_plan full;
            if (!x->gm) {
                say(x,
                    "train.recompute: %d layers listed, not used on the CPU (its activations "
                    "are planned per sequence already)",
                    c->n_recompute);
            } else if (lm_gpu_model_plan(&x->p.cfg, x->gpu_tokens, x->gpu_seqs, &full, err) ==
                       LM_OK) {
                const double with = (double)lm_gpu_model_mem_plan(x->gm)->bytes[LM_MEM_ACTS];
                const double without = (double)full.bytes[LM_MEM_ACTS];
                say(x,
                    "activation recompute on %d of %d layers: activations %.2f MiB (%.2f MiB "
                    "without recompute: %.2f MiB saved, %.1f %%)",
                    c->n_recompute, x->p.cfg.num_hidden_layers, with / (1 << 20),
                    without / (1 << 20), (without - with) / (1 << 20),
                    without > 0 ? 100.0 * (without - with) / without : 0.0);
            }
        }
    }
    if (o->resume)
        say(x, "resumed from %s at step %lld", ckdir, (long long)x->k.step);
    if (x->gm) {
        /* MFU against the bf16 matmul rate measured now on the device */
        lm_cuda_limits lim;
        LM_TRY(lm_cuda_measure_limits(x->cuda, 3, &lim, err));
        x->ref_flops = lim.bf16_tflops * 1e12;
        snprintf(out->ref_desc, sizeof out->ref_desc,
                 "bf16 matmul on the device, median of 3 calls (lm_cuda_measure_limits)");
    } else {
        x->ref_flops = measure_sgemm(out->ref_desc, sizeof out->ref_desc);
    }
    say(x, "mfu reference: %.1f GFLOP/s, %s", x->ref_flops / 1e9, out->ref_desc);
    const int64_t start_step = x->k.step;
    double t_train = 0, flops_sum = 0;
    int64_t tok_run = 0, n_timed = 0; /* over the steps that were not skipped */
    if (x->k.step >= stop)
        say(x, "nothing to do: step %lld already reached", (long long)x->k.step);
    while (x->k.step < stop) {
        const int s = lm_train_stage_of(c, x->k.step);
        if (s != x->k.stage) {
            LM_TRY(apply_stage(x, s, err));
            x->k.stage = s;
            log_stage(x, s);
        }
        const lm_train_stage *st = &c->stages[s];
        step_result r;
        memset(&r, 0, sizeof r);
        LM_TRY(x->gm ? train_step_gpu(x, s, &r, err) : train_step(x, s, &r, err));
        if (o->diverge_at > 0 && o->diverge_at == x->k.step && x->rank == 1)
            for (int i = 0; i < x->p.cfg.num_hidden_layers; i++) {
                lm_router_state *rs = lm_model_router_state(x->m, i);
                if (rs) { /* test hook: one replica's bias off by 1e-3 */
                    rs->e_score_correction_bias[0] += 1e-3f;
                    break;
                }
            }
        /* a skipped step did not do the step's work (a failing forward returns early):
         * no rate for it (null in the log), and it stays out of the run's rates */
        const double fpt = lm_model_train_flops_per_token(&x->p.cfg, st->seq_len);
        const double tok_s = r.skipped ? NAN : (double)st->step_tokens / r.seconds;
        const double mfu = r.skipped ? NAN : fpt * tok_s / x->ref_flops;
        if (!r.skipped) {
            t_train += r.seconds;
            tok_run += st->step_tokens;
            flops_sum += fpt * (double)st->step_tokens;
            n_timed++;
        }
        log_step(x, s, &r, tok_s, mfu);
        x->last_loss = r.loss;
        if (r.skipped && x->k.bad_streak >= c->max_bad_steps)
            return lm_errorf(
                err, LM_ERR_INVALID,
                "training diverged: %lld non-finite steps in a row (train.max_bad_steps "
                "= %d) at step %lld; the last checkpoint is %s",
                (long long)x->k.bad_streak, c->max_bad_steps, (long long)x->k.step,
                x->last_ckpt[0] ? x->last_ckpt : "(none)");
        if (r.skipped)
            say(x, "step %lld skipped: non-finite loss or gradient (%lld in a row)",
                (long long)x->k.step, (long long)x->k.bad_streak);
        if (!x->quiet) {
            const double avg = n_timed > 0 ? t_train / (double)n_timed : NAN;
            char eta[32];
            fmt_dur(eta, sizeof eta, avg * (double)(stop - x->k.step));
            if (x->live) {
                fprintf(
                    stderr,
                    "\r\033[Kstep %lld/%lld | stage %d %s (%d) | loss %.4f | %.0f tok/s | ETA %s",
                    (long long)x->k.step, (long long)stop, s, st->name, st->seq_len, r.loss,
                    t_train > 0 ? tok_run / t_train : 0.0, eta);
                fflush(stderr);
                x->line_open = 1;
            } else if (r.skipped) {
                /* said above; no loss, norm or rate to show */
            } else if (x->k.step % c->log_every == 0 || x->k.step == start_step + 1 ||
                       x->k.step == stop) {
                say(x,
                    "step %lld/%lld stage %s seq %d loss %.4f lr %.3e gnorm %.3f %.0f tok/s mfu "
                    "%.1f%% ETA %s",
                    (long long)x->k.step, (long long)stop, st->name, st->seq_len, r.loss, r.lr,
                    r.gnorm, tok_s, 100 * mfu, eta);
            }
        }
        const int stage_end = x->k.step == st->first_step + st->steps;
        if (stage_end || (c->eval_every > 0 && x->k.step % c->eval_every == 0))
            LM_TRY(run_eval(x, err)); /* every rank: the evals are split over them */
        int32_t interrupt = o->stop && *o->stop && x->k.step < stop;
        if (x->world > 1) /* a signal reaches the ranks at different steps: stop together */
            LM_TRY(lm_comm_allreduce(x->comm, &interrupt, 1, LM_I32, LM_DIST_MAX, err));
        if ((c->checkpoint_every > 0 && x->k.step % c->checkpoint_every == 0) ||
            x->k.step == stop || interrupt) {
            lm_loader_get_state(x->ld, &ls);
            LM_TRY(host_sync(x, err));
            LM_TRY(save_checkpoint(x, &ls, err));
            say(x, "checkpoint %s", x->last_ckpt); /* a line in both modes (docs/training.md) */
        }
        if (interrupt) {
            say(x,
                "interrupted: stopped after step %lld of %lld; checkpoint %s written (continue "
                "with --resume)",
                (long long)x->k.step, (long long)stop, x->last_ckpt);
            out->interrupted = 1;
            break;
        }
    }
    if (x->line_open)
        say(x, "%s", "");
    out->steps_done = x->k.step;
    out->steps_run = x->k.step - start_step;
    out->tokens = x->k.tokens;
    out->bad_steps = x->k.bad_total;
    out->train_seconds = t_train;
    out->tokens_per_s = t_train > 0 ? (double)tok_run / t_train : 0;
    out->mfu = t_train > 0 ? flops_sum / t_train / x->ref_flops : 0;
    out->ref_flops = x->ref_flops;
    out->bits_per_byte = x->last_bpb;
    out->last_loss = x->last_loss;
    snprintf(out->checkpoint, sizeof out->checkpoint, "%.4000s", x->last_ckpt);
    if (out->steps_run > 0)
        say(x,
            "done: step %lld, %lld tokens, %.1f s training, %.0f tok/s, mfu %.2f%% (of the %s "
            "rate measured at start, %.1f GFLOP/s), checkpoint %s",
            (long long)out->steps_done, (long long)out->tokens, t_train, out->tokens_per_s,
            100 * out->mfu, x->gm ? "bf16 matmul" : "sgemm", x->ref_flops / 1e9, out->checkpoint);
    return LM_OK;
}

lm_status lm_train_run(const lm_train_config *cin, const lm_train_options *o, lm_train_summary *out,
                       lm_error *err) {
    lm_train_summary dummy;
    lm_error local = {0};
    if (!err) /* the steps say numeric errors' messages: keep one even when the caller does not */
        err = &local;
    if (!out)
        out = &dummy;
    memset(out, 0, sizeof *out);
    out->bits_per_byte = NAN;
    out->last_loss = NAN;
    if (!o || !o->run_dir || !o->run_dir[0])
        return lm_errorf(err, LM_ERR_INVALID, "train: no run directory");
    ctx x;
    memset(&x, 0, sizeof x);
    x.o = o;
    x.last_bpb = NAN;
    x.quiet = o->quiet;
    x.live = !o->quiet && (o->progress == 1 || (o->progress < 0 && isatty(fileno(stderr))));
    if (snprintf(x.run, sizeof x.run, "%s", o->run_dir) >= (int)sizeof x.run)
        return lm_errorf(err, LM_ERR_INVALID, "train: run directory path too long");
    /* a run directory this call creates is removed again when the run fails before
     * writing anything into it (a bad data path, a missing checkpoint): no empty run
     * directories left behind (rmdir only removes an empty one) */
    struct stat run_sb;
    const int run_existed = stat(x.run, &run_sb) == 0;
    lm_status st = mkdir_p(x.run, err);
    if (st != LM_OK)
        return st;
    lm_train_config saved;
    memset(&saved, 0, sizeof saved);
    const lm_train_config *c = cin;
    if (!c) {
        if (!o->resume) {
            st = lm_errorf(err, LM_ERR_INVALID, "train: no training config (and no --resume)");
            goto out;
        }
        char dir[PATHMAX + 64];
        char *text = NULL;
        st = lm_train_latest_checkpoint(x.run, dir, sizeof dir, err);
        if (st == LM_OK)
            st = lm_train_checkpoint_config(dir, &text, err);
        char label[PATHMAX + 128];
        snprintf(label, sizeof label, "%s/train_state.safetensors (train_config)", dir);
        if (st == LM_OK)
            st = lm_train_config_parse(&saved, text, label, err);
        free(text);
        if (st != LM_OK)
            goto out;
        c = &saved;
    }
    x.c = c;
    x.last_loss = NAN;
    st = run(&x, c, out, err);
    if (x.line_open)
        fputc('\n', stderr);
    ctx_free(&x);
out:
    lm_train_config_free(&saved);
    if (st != LM_OK && !run_existed)
        (void)rmdir(x.run);
    return st;
}
