/* The serving engine (serve.h): state pool, FCFS scheduler with continuous batching and
 * chunked prefill, and the prefix cache (a radix tree of token blocks holding full
 * per-layer state checkpoints, LRU-evicted). */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/serve.h"

/* ---------------------------------------------------------------- prefix cache */

typedef struct pc_node {
    struct pc_node *parent, *child, *sibling; /* children: a singly linked list */
    int32_t *tokens;                          /* [block] the edge's tokens */
    float *rec;                               /* [rec_n] recurrent part after the block */
    float *kv;                                /* [block * kv_per_pos] the block's K/V */
    int64_t depth;                            /* blocks from the root (root: 0) */
    uint64_t used;                            /* LRU tick */
    int pins;                                 /* prefilling sequences standing here */
    int nchild;
    int64_t slot; /* index in the node vector */
} pc_node;

typedef struct {
    pc_node root;
    pc_node **nodes; /* every non-root node */
    int64_t n, cap;
    int64_t bytes, budget, node_bytes;
    uint64_t tick;
    int64_t evictions;
} pc_tree;

static pc_node *pc_child(pc_node *p, const int32_t *tok, int block) {
    for (pc_node *c = p->child; c; c = c->sibling)
        if (memcmp(c->tokens, tok, sizeof(int32_t) * (size_t)block) == 0)
            return c;
    return NULL;
}

static void pc_unlink_free(pc_tree *t, pc_node *x) {
    pc_node **pp = &x->parent->child;
    while (*pp != x)
        pp = &(*pp)->sibling;
    *pp = x->sibling;
    x->parent->nchild--;
    t->nodes[x->slot] = t->nodes[--t->n];
    t->nodes[x->slot]->slot = x->slot;
    t->bytes -= t->node_bytes;
    free(x);
}

/* Evict the least recently used unpinned leaf. 0 when there is none. */
static int pc_evict_one(pc_tree *t) {
    pc_node *best = NULL;
    for (int64_t i = 0; i < t->n; i++) {
        pc_node *x = t->nodes[i];
        if (x->nchild == 0 && x->pins == 0 && (!best || x->used < best->used))
            best = x;
    }
    if (!best)
        return 0;
    pc_unlink_free(t, best);
    t->evictions++;
    return 1;
}

/* ---------------------------------------------------------------- engine */

enum { SEQ_WAITING = 0, SEQ_PREFILL, SEQ_DECODE };

typedef struct seq {
    int64_t id;
    void *user;
    int32_t *prompt;
    int64_t n_prompt, max_tokens, generated, prefilled, n_cached;
    lm_sampler_config sc;
    uint64_t seed;
    lm_sampler *smp;
    int32_t stop_token, pending;
    int row, state, cancelled, pc_off;
    pc_node *pc; /* prefix-cache node at the prefill position (pinned), &root at 0 */
    struct seq *next;
} seq;

struct lm_engine {
    lm_model *m;
    lm_engine_config c;
    lm_engine_callback cb;
    void *cb_ctx;
    int V;
    lm_model_cache *pool;
    seq **rows;   /* [max_seqs] */
    int n_decode; /* rows [0, n_decode) decode */
    seq *prefill; /* at row n_decode, or NULL */
    seq *wait_head, *wait_tail;
    int64_t n_wait, next_id;
    float *logits; /* [max_seqs, V] */
    int32_t *ids;  /* [max_seqs] */
    char *gone;    /* [max_seqs] rows finished in a decode step */
    int64_t rec_n, kv_pp;
    pc_tree pc;
    int pc_on;
    lm_engine_stats st;
    /* decode workers (decode_threads > 1): worker i runs rows [w_row[i], w_row[i+1])
     * through wm[i]; group 0 is the calling thread's, on e->m */
    int nw;
    lm_model **wm;   /* [nw], wm[0] = m, the others owned */
    pthread_t *wth;  /* [nw - 1] */
    int *w_row;      /* [nw + 1] */
    lm_status *w_st; /* [nw] */
    lm_error *w_err; /* [nw] */
    pthread_mutex_t wmu;
    pthread_cond_t wgo, wdone;
    uint64_t w_gen; /* a new step for the workers */
    int w_busy, w_quit;
};

/* Rows [w_row[i], w_row[i+1]) through worker i's model. */
static void decode_group(lm_engine *e, int i) {
    const int r0 = e->w_row[i], n = e->w_row[i + 1] - r0;
    e->w_st[i] = LM_OK;
    if (n <= 0)
        return;
    lm_model_cache *v = NULL;
    lm_status st = lm_model_cache_view(&v, e->pool, e->wm[i], r0, n, &e->w_err[i]);
    if (st == LM_OK)
        st = lm_model_infer(e->wm[i], v, e->ids + r0, 1, 1, e->logits + (size_t)r0 * e->V,
                            &e->w_err[i]);
    lm_model_cache_free(v);
    e->w_st[i] = st;
}

typedef struct {
    lm_engine *e;
    int i;
} worker_arg;

static void *decode_worker(void *arg) {
    worker_arg a = *(worker_arg *)arg;
    free(arg);
    lm_engine *e = a.e;
    omp_set_num_threads(1); /* a group's ops run on this thread only */
    uint64_t seen = 0;
    pthread_mutex_lock(&e->wmu);
    for (;;) {
        while (!e->w_quit && e->w_gen == seen)
            pthread_cond_wait(&e->wgo, &e->wmu);
        if (e->w_quit)
            break;
        seen = e->w_gen;
        pthread_mutex_unlock(&e->wmu);
        decode_group(e, a.i);
        pthread_mutex_lock(&e->wmu);
        if (--e->w_busy == 0)
            pthread_cond_signal(&e->wdone);
    }
    pthread_mutex_unlock(&e->wmu);
    return NULL;
}

/* Start the decode workers (e->nw - 1 threads, each with its own model). */
static lm_status workers_start(lm_engine *e, lm_error *err) {
    e->wm = LM_CALLOC((size_t)e->nw, sizeof(lm_model *));
    e->wth = LM_CALLOC((size_t)e->nw, sizeof(pthread_t));
    e->w_row = LM_CALLOC((size_t)e->nw + 1, sizeof(int));
    e->w_st = LM_CALLOC((size_t)e->nw, sizeof(lm_status));
    e->w_err = LM_CALLOC((size_t)e->nw, sizeof(lm_error));
    e->wm[0] = e->m;
    pthread_mutex_init(&e->wmu, NULL);
    pthread_cond_init(&e->wgo, NULL);
    pthread_cond_init(&e->wdone, NULL);
    const int started = e->nw;
    e->nw = 1; /* counts the workers running, for lm_engine_free on an error */
    for (int i = 1; i < started; i++) {
        LM_TRY(lm_model_new(&e->wm[i], (lm_params *)lm_model_params(e->m),
                            lm_model_max_tokens(e->m), err));
        worker_arg *a = malloc(sizeof(*a));
        LM_CHECK(a != NULL);
        *a = (worker_arg){e, i};
        if (pthread_create(&e->wth[i - 1], NULL, decode_worker, a) != 0) {
            free(a);
            lm_model_free(e->wm[i]);
            e->wm[i] = NULL;
            return lm_errorf(err, LM_ERR_NOMEM, "serve: cannot start decode thread %d", i);
        }
        e->nw = i + 1;
    }
    return LM_OK;
}

static void workers_stop(lm_engine *e) {
    if (!e->wm)
        return;
    pthread_mutex_lock(&e->wmu);
    e->w_quit = 1;
    pthread_cond_broadcast(&e->wgo);
    pthread_mutex_unlock(&e->wmu);
    for (int i = 1; i < e->nw; i++) {
        pthread_join(e->wth[i - 1], NULL);
        lm_model_free(e->wm[i]);
    }
    pthread_mutex_destroy(&e->wmu);
    pthread_cond_destroy(&e->wgo);
    pthread_cond_destroy(&e->wdone);
    free(e->wm), free(e->wth), free(e->w_row), free(e->w_st), free(e->w_err);
}

void lm_engine_config_default(lm_engine_config *c) {
    c->max_seqs = 16;
    c->max_len = 2048;
    c->max_batch_tokens = 256;
    c->block_tokens = 64;
    c->state_cache_bytes = (int64_t)256 << 20;
    c->max_queue = 256;
    c->decode_threads = 1;
}

int64_t lm_engine_model_tokens(const lm_engine_config *c) {
    return c->max_seqs > c->block_tokens ? c->max_seqs : c->block_tokens;
}

int64_t lm_engine_pool_bytes(const lm_model *m, const lm_engine_config *c) {
    lm_model_cache *k = NULL;
    if (lm_model_cache_new(&k, m, 1, 1, NULL) != LM_OK)
        return -1;
    int64_t rec, kvpp;
    lm_model_cache_row_sizes(k, &rec, &kvpp);
    lm_model_cache_free(k);
    return (int64_t)c->max_seqs * (rec + kvpp * c->max_len) * (int64_t)sizeof(float);
}

static lm_status check_config(const lm_engine_config *c, lm_error *err) {
    if (c->max_seqs < 1 || c->max_seqs > 4096)
        return lm_errorf(err, LM_ERR_INVALID, "serve: max_seqs = %d (want 1 .. 4096)", c->max_seqs);
    if (c->max_len < 2 || c->max_len > ((int64_t)1 << 24))
        return lm_errorf(err, LM_ERR_INVALID, "serve: max_len = %lld (want 2 .. 2^24)",
                         (long long)c->max_len);
    if (c->max_batch_tokens < 1 || c->max_batch_tokens > (1 << 20))
        return lm_errorf(err, LM_ERR_INVALID, "serve: max_batch_tokens = %d (want 1 .. 2^20)",
                         c->max_batch_tokens);
    if (c->block_tokens < 1 || c->block_tokens > 4096)
        return lm_errorf(err, LM_ERR_INVALID, "serve: block_tokens = %d (want 1 .. 4096)",
                         c->block_tokens);
    if (c->state_cache_bytes < 0)
        return lm_errorf(err, LM_ERR_INVALID, "serve: state_cache_bytes = %lld (want >= 0)",
                         (long long)c->state_cache_bytes);
    if (c->max_queue < 0)
        return lm_errorf(err, LM_ERR_INVALID, "serve: max_queue = %d (want >= 0)", c->max_queue);
    if (c->decode_threads < 1 || c->decode_threads > 256)
        return lm_errorf(err, LM_ERR_INVALID, "serve: decode_threads = %d (want 1 .. 256)",
                         c->decode_threads);
    return LM_OK;
}

lm_status lm_engine_new(lm_engine **out, lm_model *m, const lm_engine_config *c,
                        lm_engine_callback cb, void *cb_ctx, lm_error *err) {
    *out = NULL;
    if (!m || !c || !cb)
        return lm_errorf(err, LM_ERR_INVALID, "serve: engine needs a model, a config, a callback");
    LM_TRY(check_config(c, err));
    if (lm_model_max_tokens(m) < lm_engine_model_tokens(c))
        return lm_errorf(err, LM_ERR_INVALID,
                         "serve: the model's max_tokens = %lld < %lld (max of max_seqs %d and "
                         "block_tokens %d)",
                         (long long)lm_model_max_tokens(m), (long long)lm_engine_model_tokens(c),
                         c->max_seqs, c->block_tokens);
    lm_engine *e = LM_CALLOC(1, sizeof(*e));
    e->m = m;
    e->c = *c;
    e->cb = cb;
    e->cb_ctx = cb_ctx;
    e->V = lm_model_params(m)->cfg.vocab_size;
    lm_status st = lm_model_cache_new(&e->pool, m, c->max_seqs, c->max_len, err);
    if (st != LM_OK) {
        free(e);
        return st;
    }
    lm_model_cache_row_sizes(e->pool, &e->rec_n, &e->kv_pp);
    e->rows = LM_CALLOC((size_t)c->max_seqs, sizeof(seq *));
    e->logits = malloc(sizeof(float) * (size_t)c->max_seqs * (size_t)e->V);
    e->ids = LM_CALLOC((size_t)c->max_seqs, sizeof(int32_t));
    e->gone = LM_CALLOC((size_t)c->max_seqs, 1);
    if (!e->logits) {
        lm_engine_free(e);
        return lm_errorf(err, LM_ERR_NOMEM, "serve: cannot allocate the logits of %d rows",
                         c->max_seqs);
    }
    e->nw = c->decode_threads;
    if (e->nw > 1 && (st = workers_start(e, err)) != LM_OK) {
        lm_engine_free(e);
        return st;
    }
    e->next_id = 1;
    e->pc_on = c->state_cache_bytes > 0;
    e->pc.budget = c->state_cache_bytes;
    e->pc.node_bytes = (int64_t)sizeof(pc_node) + (int64_t)sizeof(int32_t) * c->block_tokens +
                       (int64_t)sizeof(float) * (e->rec_n + e->kv_pp * c->block_tokens);
    *out = e;
    return LM_OK;
}

static void seq_free(seq *s) {
    if (!s)
        return;
    lm_sampler_free(s->smp);
    free(s->prompt);
    free(s);
}

static void pc_unpin(seq *s) {
    if (s->pc)
        s->pc->pins--;
    s->pc = NULL;
}

void lm_engine_free(lm_engine *e) {
    if (!e)
        return;
    for (seq *s = e->wait_head; s;) {
        seq *n = s->next;
        seq_free(s);
        s = n;
    }
    for (int i = 0; i < e->c.max_seqs; i++)
        seq_free(e->rows[i]);
    workers_stop(e);
    for (int64_t i = 0; i < e->pc.n; i++)
        free(e->pc.nodes[i]);
    free(e->pc.nodes);
    lm_model_cache_free(e->pool);
    free(e->rows);
    free(e->logits);
    free(e->ids);
    free(e->gone);
    free(e);
}

lm_status lm_engine_submit(lm_engine *e, const lm_engine_request *r, int64_t *id, lm_error *err) {
    if (id)
        *id = 0;
    if (!e || !r)
        return lm_errorf(err, LM_ERR_INVALID, "serve: NULL engine or request");
    if (r->n_prompt < 1 || !r->prompt)
        return lm_errorf(err, LM_ERR_INVALID, "serve: prompt: %lld tokens (want >= 1)",
                         (long long)r->n_prompt);
    for (int64_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->V)
            return lm_errorf(err, LM_ERR_INVALID,
                             "serve: prompt token %lld = %d is outside the vocabulary [0, %d)",
                             (long long)i, r->prompt[i], e->V);
    if (r->max_tokens < 0)
        return lm_errorf(err, LM_ERR_INVALID, "serve: max_tokens = %lld (want >= 0)",
                         (long long)r->max_tokens);
    LM_TRY(lm_sampler_config_validate(&r->sampler, err));
    if (r->n_prompt + r->max_tokens > e->c.max_len)
        return lm_errorf(err, LM_ERR_RANGE,
                         "serve: prompt of %lld tokens + max_tokens %lld > the context of %lld "
                         "tokens",
                         (long long)r->n_prompt, (long long)r->max_tokens, (long long)e->c.max_len);
    if (e->n_wait >= e->c.max_queue)
        return lm_errorf(err, LM_ERR_BUSY, "serve: the queue is full (%lld requests wait)",
                         (long long)e->n_wait);
    seq *s = LM_CALLOC(1, sizeof(*s));
    s->prompt = malloc(sizeof(int32_t) * (size_t)r->n_prompt);
    if (!s->prompt) {
        free(s);
        return lm_errorf(err, LM_ERR_NOMEM, "serve: cannot copy a prompt of %lld tokens",
                         (long long)r->n_prompt);
    }
    memcpy(s->prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
    s->id = e->next_id++;
    s->user = r->user;
    s->n_prompt = r->n_prompt;
    s->max_tokens = r->max_tokens;
    s->sc = r->sampler;
    s->seed = r->seed;
    s->stop_token = r->stop_token;
    s->row = -1;
    s->state = SEQ_WAITING;
    if (e->wait_tail)
        e->wait_tail->next = s;
    else
        e->wait_head = s;
    e->wait_tail = s;
    e->n_wait++;
    if (id)
        *id = s->id;
    return LM_OK;
}

void lm_engine_cancel(lm_engine *e, int64_t id) {
    if (!e)
        return;
    for (seq *s = e->wait_head; s; s = s->next)
        if (s->id == id)
            s->cancelled = 1;
    for (int i = 0; i < e->c.max_seqs; i++)
        if (e->rows[i] && e->rows[i]->id == id)
            e->rows[i]->cancelled = 1;
}

void lm_engine_cancel_all(lm_engine *e) {
    if (!e)
        return;
    for (seq *s = e->wait_head; s; s = s->next)
        s->cancelled = 1;
    for (int i = 0; i < e->c.max_seqs; i++)
        if (e->rows[i])
            e->rows[i]->cancelled = 1;
}

int64_t lm_engine_pending(const lm_engine *e) {
    return e->n_wait + e->n_decode + (e->prefill != NULL);
}

void lm_engine_get_stats(const lm_engine *e, lm_engine_stats *s) {
    *s = e->st;
    s->waiting = e->n_wait;
    s->decoding = e->n_decode;
    s->running = e->n_decode + (e->prefill != NULL);
    s->prefix_nodes = e->pc.n;
    s->prefix_bytes = e->pc.bytes;
    s->prefix_evictions = e->pc.evictions;
}

void lm_engine_clear_prefix_cache(lm_engine *e) {
    while (pc_evict_one(&e->pc)) {
    }
    e->pc.evictions = 0;
}

/* The end event of s; the caller frees its row. */
static void finish(lm_engine *e, seq *s, lm_finish_reason why, const char *msg) {
    lm_engine_event ev = {s->id, s->user, -1, NULL, s->generated, s->n_cached, why, msg};
    e->cb(e->cb_ctx, &ev);
    pc_unpin(s);
    seq_free(s);
}

/* Draw s's next token from logits and deliver it. 1: s goes on (s->pending set), 0: s
 * finished (end event delivered, s freed). */
static int draw(lm_engine *e, seq *s, const float *logits) {
    const int32_t tok = lm_sampler_sample(s->smp, logits);
    if (tok == s->stop_token) {
        finish(e, s, LM_FINISH_STOP, NULL);
        return 0;
    }
    lm_engine_event ev = {s->id,       s->user,        tok, logits, s->generated,
                          s->n_cached, LM_FINISH_NONE, NULL};
    s->generated++;
    if (e->cb(e->cb_ctx, &ev)) {
        finish(e, s, LM_FINISH_STOP, NULL);
        return 0;
    }
    if (s->generated >= s->max_tokens) {
        finish(e, s, LM_FINISH_LENGTH, NULL);
        return 0;
    }
    s->pending = tok;
    return 1;
}

/* Decode row i leaves: the last decode row moves into it, the prefilling row (if any)
 * into the last decode row. */
static void remove_decode_row(lm_engine *e, int i) {
    const int last = e->n_decode - 1;
    if (i != last) {
        LM_CHECK(lm_model_cache_copy_row(e->pool, i, last, NULL) == LM_OK);
        e->rows[i] = e->rows[last];
        e->rows[i]->row = i;
    }
    e->rows[last] = NULL;
    if (e->prefill) {
        LM_CHECK(lm_model_cache_copy_row(e->pool, last, e->n_decode, NULL) == LM_OK);
        e->rows[last] = e->prefill;
        e->rows[e->n_decode] = NULL;
        e->prefill->row = last;
    }
    e->n_decode--;
}

/* Restore the longest cached prefix of s's prompt into its row (leaving at least one
 * token to compute). */
static void restore_prefix(lm_engine *e, seq *s) {
    const int blk = e->c.block_tokens;
    pc_node *x = &e->pc.root;
    const int64_t max_blocks = (s->n_prompt - 1) / blk;
    int64_t k = 0;
    e->st.prefix_lookups++;
    while (k < max_blocks) {
        pc_node *c = pc_child(x, s->prompt + k * blk, blk);
        if (!c)
            break;
        x = c;
        x->used = ++e->pc.tick;
        k++;
    }
    /* the path's keys and values, root first (walk up once into a list), then the
     * recurrent state of the deepest node */
    if (k > 0) {
        pc_node **path = LM_CALLOC((size_t)k, sizeof(pc_node *));
        pc_node *n = x;
        for (int64_t j = k - 1; j >= 0; j--, n = n->parent)
            path[j] = n;
        for (int64_t j = 0; j < k; j++)
            LM_CHECK(lm_model_cache_load_row(e->pool, s->row, j * blk, (j + 1) * blk,
                                             j == k - 1 ? path[j]->rec : NULL, path[j]->kv,
                                             NULL) == LM_OK);
        free(path);
    }
    s->prefilled = k * blk;
    s->n_cached = s->prefilled;
    if (k > 0) {
        e->st.prefix_hits++;
        e->st.prefix_hit_tokens += s->prefilled;
    }
    s->pc = x;
    x->pins++;
}

/* After s's prefill reached a block boundary: the child node of that block, made from
 * the row's state when missing (evicting LRU leaves to fit the budget). */
static void prefix_advance(lm_engine *e, seq *s) {
    const int blk = e->c.block_tokens;
    pc_tree *t = &e->pc;
    if (!s->pc || s->pc_off)
        return;
    const int64_t d = s->pc->depth;
    if ((d + 1) * blk != s->prefilled) {
        s->pc_off = 1;
        return;
    }
    const int32_t *tok = s->prompt + d * blk;
    pc_node *c = pc_child(s->pc, tok, blk);
    if (!c) {
        while (t->bytes + t->node_bytes > t->budget)
            if (!pc_evict_one(t))
                break;
        if (t->bytes + t->node_bytes > t->budget) {
            s->pc_off = 1;
            return;
        }
        c = calloc(1, (size_t)t->node_bytes);
        if (!c) {
            s->pc_off = 1;
            return;
        }
        c->rec = (float *)(c + 1);
        c->kv = c->rec + e->rec_n;
        c->tokens = (int32_t *)(c->kv + e->kv_pp * blk);
        memcpy(c->tokens, tok, sizeof(int32_t) * (size_t)blk);
        LM_CHECK(lm_model_cache_save_row(e->pool, s->row, d * blk, (d + 1) * blk, c->rec, c->kv,
                                         NULL) == LM_OK);
        c->depth = d + 1;
        c->parent = s->pc;
        c->sibling = s->pc->child;
        s->pc->child = c;
        s->pc->nchild++;
        if (t->n == t->cap) {
            t->cap = t->cap ? 2 * t->cap : 64;
            pc_node **nv = realloc(t->nodes, sizeof(pc_node *) * (size_t)t->cap);
            LM_CHECK(nv != NULL);
            t->nodes = nv;
        }
        c->slot = t->n;
        t->nodes[t->n++] = c;
        t->bytes += t->node_bytes;
    }
    c->used = ++t->tick;
    s->pc->pins--;
    s->pc = c;
    c->pins++;
}

/* Take the head of the queue into row n_decode. 1 when a sequence started prefilling. */
static int admit(lm_engine *e, lm_error *err) {
    while (!e->prefill && e->wait_head && e->n_decode < e->c.max_seqs) {
        seq *s = e->wait_head;
        e->wait_head = s->next;
        if (!e->wait_head)
            e->wait_tail = NULL;
        e->n_wait--;
        s->next = NULL;
        if (s->cancelled) {
            finish(e, s, LM_FINISH_CANCEL, NULL);
            continue;
        }
        if (s->max_tokens == 0) {
            finish(e, s, LM_FINISH_LENGTH, NULL);
            continue;
        }
        if (lm_sampler_new(&s->smp, &s->sc, e->V, s->seed, err) != LM_OK) {
            finish(e, s, LM_FINISH_ERROR, err ? err->msg : "sampler");
            continue;
        }
        s->row = e->n_decode;
        s->state = SEQ_PREFILL;
        e->rows[s->row] = s;
        lm_model_cache_reset_row(e->pool, s->row);
        if (e->pc_on)
            restore_prefix(e, s);
        e->prefill = s;
        return 1;
    }
    return 0;
}

/* Advance the prefilling sequence by whole blocks within the step's budget. */
static void prefill_step(lm_engine *e, lm_error *err) {
    seq *s = e->prefill;
    const int blk = e->c.block_tokens;
    int64_t budget = e->c.max_batch_tokens - e->n_decode;
    lm_model_cache *v = NULL;
    if (lm_model_cache_view(&v, e->pool, e->m, s->row, 1, err) != LM_OK)
        goto fail;
    int first = 1;
    while (s->prefilled < s->n_prompt) {
        int64_t chunk = blk - s->prefilled % blk;
        if (chunk > s->n_prompt - s->prefilled)
            chunk = s->n_prompt - s->prefilled;
        if (!first && chunk > budget)
            break;
        first = 0;
        if (lm_model_infer(e->m, v, s->prompt + s->prefilled, (int)chunk, 1, e->logits, err) !=
            LM_OK)
            goto fail;
        s->prefilled += chunk;
        budget -= chunk;
        e->st.prefill_tokens += chunk;
        if (e->pc_on && s->prefilled % blk == 0)
            prefix_advance(e, s);
    }
    lm_model_cache_free(v);
    if (s->prefilled < s->n_prompt)
        return;
    /* the prompt is in: the first token, then the sequence joins the decode rows */
    pc_unpin(s);
    e->prefill = NULL;
    const int row = s->row;
    if (draw(e, s, e->logits)) {
        s->state = SEQ_DECODE;
        e->n_decode++;
    } else {
        e->rows[row] = NULL;
    }
    return;
fail:
    lm_model_cache_free(v);
    e->prefill = NULL;
    e->rows[s->row] = NULL;
    finish(e, s, LM_FINISH_ERROR, err ? err->msg : "prefill failed");
}

static void decode_step(lm_engine *e, lm_error *err) {
    const int n = e->n_decode;
    for (int i = 0; i < n; i++)
        e->ids[i] = e->rows[i]->pending;
    lm_status st = LM_OK;
    const int g = e->nw < n ? e->nw : n; /* groups with rows */
    if (g <= 1) {
        lm_model_cache *v = NULL;
        st = lm_model_cache_view(&v, e->pool, e->m, 0, n, err);
        if (st == LM_OK)
            st = lm_model_infer(e->m, v, e->ids, 1, 1, e->logits, err);
        lm_model_cache_free(v);
    } else {
        for (int i = 0; i <= e->nw; i++)
            e->w_row[i] = i < g ? (int)((int64_t)n * i / g) : n;
        pthread_mutex_lock(&e->wmu);
        e->w_busy = e->nw - 1;
        e->w_gen++;
        pthread_cond_broadcast(&e->wgo);
        pthread_mutex_unlock(&e->wmu);
        const int omp0 = omp_get_max_threads();
        omp_set_num_threads(1);
        decode_group(e, 0);
        omp_set_num_threads(omp0);
        pthread_mutex_lock(&e->wmu);
        while (e->w_busy > 0)
            pthread_cond_wait(&e->wdone, &e->wmu);
        pthread_mutex_unlock(&e->wmu);
        for (int i = 0; i < g && st == LM_OK; i++)
            if (e->w_st[i] != LM_OK) {
                st = e->w_st[i];
                if (err)
                    *err = e->w_err[i];
            }
    }
    e->st.last_batch = n;
    if (st != LM_OK) {
        for (int i = n - 1; i >= 0; i--) {
            seq *s = e->rows[i];
            remove_decode_row(e, i);
            finish(e, s, LM_FINISH_ERROR, err ? err->msg : "decode failed");
        }
        return;
    }
    e->st.decode_tokens += n;
    /* draw every row's token; the rows that finished leave afterwards (high to low, so
     * a moved row is one already handled) */
    char *gone = e->gone;
    memset(gone, 0, (size_t)n);
    for (int i = 0; i < n; i++) {
        seq *s = e->rows[i];
        if (!draw(e, s, e->logits + (size_t)i * e->V)) {
            e->rows[i] = NULL;
            gone[i] = 1;
        }
    }
    for (int i = n - 1; i >= 0; i--)
        if (gone[i])
            remove_decode_row(e, i);
}

lm_status lm_engine_step(lm_engine *e, int *did_work, lm_error *err) {
    int work = 0;
    /* cancelled sequences leave first */
    for (int i = e->n_decode - 1; i >= 0; i--)
        if (e->rows[i]->cancelled) {
            seq *s = e->rows[i];
            remove_decode_row(e, i);
            finish(e, s, LM_FINISH_CANCEL, NULL);
            work = 1;
        }
    if (e->prefill && e->prefill->cancelled) {
        seq *s = e->prefill;
        e->rows[s->row] = NULL;
        e->prefill = NULL;
        finish(e, s, LM_FINISH_CANCEL, NULL);
        work = 1;
    }
    for (seq **pp = &e->wait_head, *prev = NULL; *pp;) {
        seq *s = *pp;
        if (!s->cancelled) {
            prev = s;
            pp = &s->next;
            continue;
        }
        *pp = s->next;
        if (e->wait_tail == s)
            e->wait_tail = prev;
        e->n_wait--;
        finish(e, s, LM_FINISH_CANCEL, NULL);
        work = 1;
    }
    work |= admit(e, err);
    if (e->prefill) {
        prefill_step(e, err);
        work = 1;
    }
    if (e->n_decode > 0) {
        decode_step(e, err);
        work = 1;
    }
    if (work)
        e->st.steps++;
    if (did_work)
        *did_work = work;
    return LM_OK;
}
