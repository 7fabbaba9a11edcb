/* Serving engine tests (include/linmoe/serve.h) on configs/tiny.json with non-trivial
 * random weights:
 *  - slot reuse: 2,400 requests (prompts of 1-45 tokens, 1-8 generated tokens, greedy
 *    and seeded sampling, a stop token, random arrival in bursts, ~4 % cancelled) go
 *    through 4 pool rows (each row reused ~600 times); every request's tokens equal
 *    those of a run alone in a fresh B = 1 cache with the same seed (same prefill
 *    blocks, lm_model_infer, lm_sampler), and its logits are bit for bit the lone
 *    run's (the inference GEMMs are row-wise: ops/cpu/gemm_rowwise.h; check_alone also
 *    bounds them by 2e-5 relative RMS to report the size of a failure); again with the
 *    decode rows split over 3 threads;
 *  - prefix cache: requests sharing long prompt prefixes at 16-way concurrency give
 *    identical tokens and logits within 1e-5 with the cache on and off, hit the cache,
 *    and stay correct when a tiny budget forces evictions;
 *  - chunked prefill: a long prompt is prefilled block by block while the running
 *    sequences decode a token in every step;
 *  - limits: a full queue (LM_ERR_BUSY), a prompt longer than the context
 *    (LM_ERR_RANGE), bad tokens / max_tokens (LM_ERR_INVALID); cancelling waiting and
 *    running requests frees their rows at once.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "linmoe/model.h"
#include "linmoe/serve.h"
#include "model_util.h"
#include "test_util.h"

#ifndef LM_SOURCE_DIR
#define LM_SOURCE_DIR "."
#endif

enum { MAXGEN = 8, MAXP = 48, MAXLEN = 64, BLOCK = 16 };

static void load_tiny(lm_model_config *c) {
    lm_test_load_model_config(c, LM_SOURCE_DIR "/configs/tiny.json");
}

typedef struct {
    int32_t prompt[MAXP];
    int n_prompt, max_tokens;
    lm_sampler_config sc;
    uint64_t seed;
    int32_t stop;
    int stop_mod; /* > 0: the callback stops after a token divisible by it (a stop string) */
    /* results */
    int32_t tok[MAXGEN];
    float *logits; /* [MAXGEN, V] */
    int n_tok, done, cancel_after;
    int64_t n_cached, id;
    lm_finish_reason why;
} req;

typedef struct {
    int V;
    int events, ends;
    lm_engine *e;
} sink;

static int on_event(void *ctx, const lm_engine_event *ev) {
    sink *k = ctx;
    req *r = ev->user;
    if (ev->finish != LM_FINISH_NONE) {
        assert_false(r->done);
        r->done = 1;
        r->why = ev->finish;
        k->ends++;
        if (ev->finish == LM_FINISH_ERROR)
            fail_msg("request failed: %s", ev->error);
        return 0;
    }
    k->events++;
    assert_int_equal(ev->index, r->n_tok);
    assert_true(r->n_tok < MAXGEN);
    r->tok[r->n_tok] = ev->token;
    memcpy(r->logits + (size_t)r->n_tok * k->V, ev->logits, sizeof(float) * (size_t)k->V);
    r->n_tok++;
    r->n_cached = ev->n_cached;
    return r->stop_mod > 0 && ev->token % r->stop_mod == 0;
}

/* Tokens whose draw differed from the run alone on a near-tie (see check_alone). */
static int64_t g_flips, g_tokens;

/* The request run alone from a fresh B = 1 cache, prefilled in the engine's blocks,
 * teacher-forced with the engine's tokens. Per token: the logits agree within 2e-5
 * relative RMS; the engine's token is exactly what the request's sampler (same seed, same
 * stream position) draws from the engine's logits; and it equals the draw from the lone
 * run's logits, except on a near-tie that the two roundings order differently (counted
 * in g_flips; the callers bound their share). Returns the worst relative RMS. */
static double check_alone(lm_model *m, const req *r, int V) {
    lm_error err = {0};
    lm_model_cache *kc;
    assert_int_equal(lm_model_cache_new(&kc, m, 1, MAXLEN, &err), LM_OK);
    lm_sampler *sa, *sb;
    assert_int_equal(lm_sampler_new(&sa, &r->sc, V, r->seed, &err), LM_OK);
    assert_int_equal(lm_sampler_new(&sb, &r->sc, V, r->seed, &err), LM_OK);
    float *lg = malloc(sizeof(float) * (size_t)V);
    for (int p = 0; p < r->n_prompt;) {
        int chunk = BLOCK - p % BLOCK;
        if (chunk > r->n_prompt - p)
            chunk = r->n_prompt - p;
        assert_int_equal(lm_model_infer(m, kc, r->prompt + p, chunk, 1, lg, &err), LM_OK);
        p += chunk;
    }
    double worst = 0;
    int k = 0;
    for (; k < r->max_tokens; k++) {
        if (k == r->n_tok)
            break; /* cancelled (or stopped) here */
        const float *g = r->logits + (size_t)k * V;
        double *w64 = lm_to_f64(lg, V);
        const lm_cmp c = lm_compare_f32(g, w64, V, 2 * TOL_FWD_F32);
        free(w64);
        if (!c.pass)
            fail_msg("request %lld token %d: logits rel RMS %.3g", (long long)r->id, k, c.rel_rms);
        worst = c.rel_rms > worst ? c.rel_rms : worst;
        const int32_t t = lm_sampler_sample(sa, lg), tb = lm_sampler_sample(sb, g);
        if (tb != r->tok[k])
            fail_msg("request %lld: token %d is %d, its sampler draws %d from its logits",
                     (long long)r->id, k, r->tok[k], tb);
        g_tokens++;
        if (t != r->tok[k])
            g_flips++;
        const int32_t fed = r->tok[k];
        assert_true(fed != r->stop);
        if (r->stop_mod > 0 && fed % r->stop_mod == 0) { /* the callback's stop */
            assert_int_equal(r->n_tok, k + 1);
            assert_int_equal(r->why, LM_FINISH_STOP);
            k = -1;
            break;
        }
        assert_int_equal(lm_model_infer(m, kc, &fed, 1, 1, lg, &err), LM_OK);
    }
    /* the engine stopped where the run alone stops */
    if (k < 0) {
    } else if (r->why == LM_FINISH_STOP) {
        assert_true(k < r->max_tokens);
        assert_int_equal(lm_sampler_sample(sb, lg), r->stop);
    } else if (r->why == LM_FINISH_LENGTH) {
        assert_int_equal(r->n_tok, r->max_tokens);
    }
    free(lg);
    lm_sampler_free(sa);
    lm_sampler_free(sb);
    lm_model_cache_free(kc);
    return worst;
}

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

static void make_req(req *r, uint64_t *rs, int V, const int32_t *prefix, int n_prefix) {
    r->n_prompt = 1 + (int)(lcg(rs) % 45);
    for (int i = 0; i < r->n_prompt; i++)
        r->prompt[i] = i < n_prefix ? prefix[i] : (int32_t)(lcg(rs) % (uint64_t)V);
    r->max_tokens = 1 + (int)(lcg(rs) % MAXGEN);
    if (lcg(rs) % 2) {
        r->sc = (lm_sampler_config){0, 0, 1};
    } else {
        r->sc = (lm_sampler_config){0.9f, (int)(lcg(rs) % 3) * 20, lcg(rs) % 2 ? 0.9f : 1.0f};
    }
    r->seed = lcg(rs);
    r->stop = lcg(rs) % 4 == 0 ? (int32_t)(lcg(rs) % (uint64_t)V) : -1;
    r->stop_mod = lcg(rs) % 4 == 0 ? 5 : 0;
}

static lm_engine_request to_engine(req *r) {
    lm_engine_request q = {r->prompt, r->n_prompt, r->max_tokens, r->sc, r->seed, r->stop, r};
    return q;
}

typedef struct {
    lm_params p;
    lm_model *m;
    int V;
} fixture;

static void fixture_init(fixture *f, int64_t max_tokens) {
    lm_model_config cfg;
    load_tiny(&cfg);
    lm_error err = {0};
    assert_int_equal(lm_params_init(&f->p, &cfg, &err), LM_OK);
    lm_test_randomize_params(&f->p, 23);
    f->V = cfg.vocab_size;
    assert_int_equal(lm_model_new(&f->m, &f->p, max_tokens, &err), LM_OK);
}

static void fixture_free(fixture *f) {
    lm_model_free(f->m);
    lm_params_free(&f->p);
}

/* Slots reused thousands of times, every output against a fresh-state run. */
static void slot_reuse(int decode_threads) {
    enum { NREQ = 2400, ROWS = 4 };
    fixture f;
    fixture_init(&f, 64);
    lm_engine_config c;
    lm_engine_config_default(&c);
    c.max_seqs = ROWS;
    c.max_len = MAXLEN;
    c.max_batch_tokens = 24;
    c.block_tokens = BLOCK;
    c.state_cache_bytes = 0;
    c.max_queue = NREQ;
    c.decode_threads = decode_threads;
    sink k = {f.V, 0, 0, NULL};
    lm_error err = {0};
    lm_engine *e;
    assert_int_equal(lm_engine_new(&e, f.m, &c, on_event, &k, &err), LM_OK);
    k.e = e;
    req *rq = calloc(NREQ, sizeof(req));
    uint64_t rs = 7;
    for (int i = 0; i < NREQ; i++) {
        make_req(&rq[i], &rs, f.V, NULL, 0);
        rq[i].logits = malloc(sizeof(float) * MAXGEN * (size_t)f.V);
        rq[i].cancel_after = lcg(&rs) % 25 == 0 ? (int)(lcg(&rs) % 4) : -1;
    }
    int next = 0, steps = 0, cancelled = 0;
    while (next < NREQ || lm_engine_pending(e) > 0) {
        /* a burst of 0-3 arrivals */
        for (int b = (int)(lcg(&rs) % 4); b > 0 && next < NREQ; b--, next++) {
            lm_engine_request q = to_engine(&rq[next]);
            assert_int_equal(lm_engine_submit(e, &q, &rq[next].id, &err), LM_OK);
        }
        for (int i = 0; i < next; i++)
            if (!rq[i].done && rq[i].cancel_after >= 0 && rq[i].n_tok >= rq[i].cancel_after) {
                lm_engine_cancel(e, rq[i].id);
                rq[i].cancel_after = -1;
                cancelled++;
            }
        int did;
        assert_int_equal(lm_engine_step(e, &did, &err), LM_OK);
        steps++;
        assert_true(steps < 100 * NREQ);
    }
    lm_engine_stats st;
    lm_engine_get_stats(e, &st);
    assert_int_equal(st.running, 0);
    assert_int_equal(k.ends, NREQ);
    double worst = 0;
    int n_cancel = 0, n_stop = 0;
    for (int i = 0; i < NREQ; i++) {
        assert_true(rq[i].done);
        n_cancel += rq[i].why == LM_FINISH_CANCEL;
        n_stop += rq[i].why == LM_FINISH_STOP;
        const double w = check_alone(f.m, &rq[i], f.V);
        worst = w > worst ? w : worst;
        free(rq[i].logits);
    }
    printf("slot reuse, %d decode thread(s): %d requests through %d rows in %d steps (%lld "
           "decode tokens, %.2f rows per step), %d cancelled, %d stopped: logits worst rel RMS "
           "%.3g vs each run alone; %lld of %lld tokens drawn differently on a near-tie\n",
           decode_threads, NREQ, ROWS, steps, (long long)st.decode_tokens,
           (double)st.decode_tokens / steps, n_cancel, n_stop, worst, (long long)g_flips,
           (long long)g_tokens);
    /* the decode GEMMs are row-wise (src/ops/cpu/gemm_rowwise.h): a row's logits do not
     * depend on the batch, so nothing may differ */
    assert_true(worst == 0);
    assert_int_equal(g_flips, 0);
    assert_true(n_cancel > 20);
    assert_true(n_stop > 100);
    free(rq);
    lm_engine_free(e);
    fixture_free(&f);
}

static void test_slot_reuse(void **state) {
    (void)state;
    slot_reuse(1);
}

/* The decode rows split over 3 threads (groups of 1-2 of the 4 rows, the split moving
 * as rows come and go): still every row bit for bit its run alone. */
static void test_slot_reuse_threads(void **state) {
    (void)state;
    slot_reuse(3);
}

/* Run `n` requests (16-way) through an engine with the given cache budget. */
static void run_all(fixture *f, req *rq, int n, int64_t cache_bytes, lm_engine_stats *st) {
    lm_engine_config c;
    lm_engine_config_default(&c);
    c.max_seqs = 16;
    c.max_len = MAXLEN;
    c.max_batch_tokens = 40;
    c.block_tokens = BLOCK;
    c.state_cache_bytes = cache_bytes;
    c.max_queue = n;
    sink k = {f->V, 0, 0, NULL};
    lm_error err = {0};
    lm_engine *e;
    assert_int_equal(lm_engine_new(&e, f->m, &c, on_event, &k, &err), LM_OK);
    for (int i = 0; i < n; i++) {
        rq[i].done = rq[i].n_tok = 0;
        lm_engine_request q = to_engine(&rq[i]);
        assert_int_equal(lm_engine_submit(e, &q, &rq[i].id, &err), LM_OK);
        /* arrivals spread over the first steps */
        if (i % 3 == 2)
            assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    }
    while (lm_engine_pending(e) > 0)
        assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    lm_engine_get_stats(e, st);
    assert_int_equal(k.ends, n);
    lm_engine_free(e);
}

static void test_prefix_cache(void **state) {
    (void)state;
    enum { NREQ = 300 };
    fixture f;
    fixture_init(&f, 64);
    req *off = calloc(NREQ, sizeof(req)), *on = calloc(NREQ, sizeof(req));
    uint64_t rs = 11;
    int32_t prefix[4][MAXP];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < MAXP; i++)
            prefix[j][i] = (int32_t)(lcg(&rs) % (uint64_t)f.V);
    for (int i = 0; i < NREQ; i++) {
        /* 4 families of shared prefixes of 0-45 tokens */
        make_req(&off[i], &rs, f.V, prefix[i % 4], (int)(lcg(&rs) % 46));
        off[i].stop = -1;
        off[i].logits = malloc(sizeof(float) * MAXGEN * (size_t)f.V);
        on[i] = off[i];
        on[i].logits = malloc(sizeof(float) * MAXGEN * (size_t)f.V);
    }
    lm_engine_stats s_off, s_on, s_tiny;
    run_all(&f, off, NREQ, 0, &s_off);
    run_all(&f, on, NREQ, (int64_t)64 << 20, &s_on);
    double worst = 0;
    for (int i = 0; i < NREQ; i++) {
        assert_int_equal(on[i].n_tok, off[i].n_tok);
        assert_memory_equal(on[i].tok, off[i].tok, sizeof(int32_t) * (size_t)off[i].n_tok);
        double *w64 = lm_to_f64(off[i].logits, (int64_t)off[i].n_tok * f.V);
        const lm_cmp c = lm_compare_f32(on[i].logits, w64, (int64_t)off[i].n_tok * f.V, 1e-5);
        free(w64);
        assert_true(c.pass);
        worst = c.rel_rms > worst ? c.rel_rms : worst;
        /* and each one against its run alone */
        check_alone(f.m, &on[i], f.V);
    }
    assert_int_equal(s_off.prefix_hits, 0);
    assert_true(s_on.prefix_hits > NREQ / 4);
    assert_true(s_on.prefix_hit_tokens > 0);
    /* a budget of 5 nodes: evictions, same outputs */
    lm_model_cache *k1;
    lm_error err = {0};
    assert_int_equal(lm_model_cache_new(&k1, f.m, 1, 1, &err), LM_OK);
    int64_t rec, kvpp;
    lm_model_cache_row_sizes(k1, &rec, &kvpp);
    lm_model_cache_free(k1);
    const int64_t node = (int64_t)sizeof(float) * (rec + kvpp * BLOCK) + 4 * BLOCK + 256;
    for (int i = 0; i < NREQ; i++)
        on[i].n_cached = 0;
    run_all(&f, on, NREQ, 5 * node, &s_tiny);
    for (int i = 0; i < NREQ; i++) {
        assert_int_equal(on[i].n_tok, off[i].n_tok);
        assert_memory_equal(on[i].tok, off[i].tok, sizeof(int32_t) * (size_t)off[i].n_tok);
    }
    assert_true(s_tiny.prefix_evictions > 0);
    assert_true(s_tiny.prefix_nodes <= 5);
    printf("prefix cache: %d requests, 16 rows: tokens identical with the cache on and off, "
           "logits worst rel RMS %.3g; hits %lld of %lld (%lld tokens restored), %lld nodes; "
           "5-node budget: %lld evictions, %lld hits, same tokens\n",
           NREQ, worst, (long long)s_on.prefix_hits, (long long)s_on.prefix_lookups,
           (long long)s_on.prefix_hit_tokens, (long long)s_on.prefix_nodes,
           (long long)s_tiny.prefix_evictions, (long long)s_tiny.prefix_hits);
    for (int i = 0; i < NREQ; i++)
        free(off[i].logits), free(on[i].logits);
    free(off);
    free(on);
    fixture_free(&f);
}

static void test_limits(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 64);
    lm_engine_config c;
    lm_engine_config_default(&c);
    c.max_seqs = 2;
    c.max_len = MAXLEN;
    c.block_tokens = BLOCK;
    c.max_queue = 3;
    sink k = {f.V, 0, 0, NULL};
    lm_error err = {0};
    lm_engine *e;
    assert_int_equal(lm_engine_new(&e, f.m, &c, on_event, &k, &err), LM_OK);
    req r[6];
    memset(r, 0, sizeof r);
    uint64_t rs = 3;
    for (int i = 0; i < 6; i++) {
        make_req(&r[i], &rs, f.V, NULL, 0);
        r[i].max_tokens = MAXGEN;
        r[i].stop = -1;
        r[i].logits = malloc(sizeof(float) * MAXGEN * (size_t)f.V);
    }
    /* bad requests */
    lm_engine_request q = to_engine(&r[0]);
    q.n_prompt = 0;
    assert_int_equal(lm_engine_submit(e, &q, NULL, &err), LM_ERR_INVALID);
    q = to_engine(&r[0]);
    q.max_tokens = -1;
    assert_int_equal(lm_engine_submit(e, &q, NULL, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_tokens"));
    int32_t bad[2] = {1, 100000};
    q.prompt = bad;
    q.n_prompt = 2;
    q.max_tokens = 1;
    assert_int_equal(lm_engine_submit(e, &q, NULL, &err), LM_ERR_INVALID);
    q = to_engine(&r[0]);
    q.max_tokens = MAXLEN;
    assert_int_equal(lm_engine_submit(e, &q, NULL, &err), LM_ERR_RANGE);
    q.sampler.top_p = 2;
    q.max_tokens = 1;
    assert_int_equal(lm_engine_submit(e, &q, NULL, &err), LM_ERR_INVALID);
    /* the queue holds 3 */
    for (int i = 0; i < 3; i++) {
        q = to_engine(&r[i]);
        assert_int_equal(lm_engine_submit(e, &q, &r[i].id, &err), LM_OK);
    }
    q = to_engine(&r[3]);
    assert_int_equal(lm_engine_submit(e, &q, NULL, &err), LM_ERR_BUSY);
    /* run until two are decoding, then cancel one running and the waiting one */
    while (lm_engine_pending(e) == 3) {
        lm_engine_stats st;
        lm_engine_get_stats(e, &st);
        if (st.decoding == 2)
            break;
        assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    }
    lm_engine_stats st;
    lm_engine_get_stats(e, &st);
    assert_int_equal(st.decoding, 2);
    assert_int_equal(st.waiting, 1);
    lm_engine_cancel(e, r[0].id);
    lm_engine_cancel(e, r[2].id);
    assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    assert_true(r[0].done && r[0].why == LM_FINISH_CANCEL);
    assert_true(r[2].done && r[2].why == LM_FINISH_CANCEL);
    lm_engine_get_stats(e, &st);
    assert_int_equal(st.waiting, 0);
    assert_true(st.decoding <= 1);
    while (lm_engine_pending(e) > 0)
        assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    assert_true(r[1].done && r[1].why == LM_FINISH_LENGTH);
    check_alone(f.m, &r[1], f.V);
    check_alone(f.m, &r[0], f.V);
    /* max_tokens 0: finished without a token */
    q = to_engine(&r[4]);
    q.max_tokens = 0;
    assert_int_equal(lm_engine_submit(e, &q, &r[4].id, &err), LM_OK);
    assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    assert_true(r[4].done && r[4].why == LM_FINISH_LENGTH && r[4].n_tok == 0);
    for (int i = 0; i < 6; i++)
        free(r[i].logits);
    lm_engine_free(e);
    /* a config error names the field */
    c.block_tokens = 0;
    assert_int_equal(lm_engine_new(&e, f.m, &c, on_event, &k, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block_tokens"));
    c.block_tokens = BLOCK;
    c.decode_threads = 0;
    assert_int_equal(lm_engine_new(&e, f.m, &c, on_event, &k, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "decode_threads = 0"));
    fixture_free(&f);
}

/* Chunked prefill: while a 45-token prompt is prefilled in blocks of 16 within a budget of
 * 20 tokens per step, the two decoding sequences get one token in every step (the prefill
 * never stalls them), and the prompt takes ceil(45 / 16) = 3 steps. */
static void test_chunked_prefill(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 64);
    lm_engine_config c;
    lm_engine_config_default(&c);
    c.max_seqs = 3;
    c.max_len = MAXLEN;
    c.block_tokens = BLOCK;
    c.max_batch_tokens = 20;
    c.state_cache_bytes = 0;
    sink k = {f.V, 0, 0, NULL};
    lm_error err = {0};
    lm_engine *e;
    assert_int_equal(lm_engine_new(&e, f.m, &c, on_event, &k, &err), LM_OK);
    req r[3];
    memset(r, 0, sizeof r);
    uint64_t rs = 9;
    for (int i = 0; i < 3; i++) {
        make_req(&r[i], &rs, f.V, NULL, 0);
        r[i].stop = -1;
        r[i].stop_mod = 0;
        r[i].max_tokens = MAXGEN;
        r[i].n_prompt = i < 2 ? 3 : 45;
        r[i].logits = malloc(sizeof(float) * MAXGEN * (size_t)f.V);
    }
    for (int i = 0; i < 2; i++) {
        lm_engine_request q = to_engine(&r[i]);
        assert_int_equal(lm_engine_submit(e, &q, &r[i].id, &err), LM_OK);
        assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    }
    lm_engine_request q = to_engine(&r[2]);
    assert_int_equal(lm_engine_submit(e, &q, &r[2].id, &err), LM_OK);
    int steps = 0;
    while (r[2].n_tok == 0) {
        const int a = r[0].n_tok, b = r[1].n_tok;
        assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
        steps++;
        assert_int_equal(r[0].n_tok, a + 1);
        assert_int_equal(r[1].n_tok, b + 1);
    }
    assert_int_equal(steps, 3);
    while (lm_engine_pending(e) > 0)
        assert_int_equal(lm_engine_step(e, NULL, &err), LM_OK);
    for (int i = 0; i < 3; i++) {
        check_alone(f.m, &r[i], f.V);
        free(r[i].logits);
    }
    lm_engine_free(e);
    fixture_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_prefill),    cmocka_unit_test(test_limits),
        cmocka_unit_test(test_prefix_cache),       cmocka_unit_test(test_slot_reuse),
        cmocka_unit_test(test_slot_reuse_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
