/* Loader tests (include/linmoe/loader.h) on a synthetic shard whose documents are
 * recognisable: document d starts with the token d (< 200) and continues with tokens
 * in [200, 256) from a hash of (d, position), so every packed piece can be located.
 *  - packing: pieces never cross documents, each piece is [EOT, t_a..t_{b-1}] with
 *    labels t_a..t_{b-1} then EOT (document end) or IGNORE (cut), cu_seqlens at
 *    every piece, the stream continues across rows, every document exactly once
 *    per epoch, a fresh order per epoch;
 *  - the stream does not depend on how many rows a call asks for;
 *  - resume from lm_loader_get_state reproduces the stream (across a stage change,
 *    with passkey and long-document rows);
 *  - rank partitioning (packing: disjoint documents covering the epoch; windows:
 *    rank r gets global rows r, r+W, ...);
 *  - random windows, passkey rows, long-document rows and their fractions;
 *  - bad stages / states / rank settings are errors naming the value. */
#include "test_util.h"

#include "linmoe/loader.h"
#include "linmoe/passkey.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NDOCS 60
#define EOT 256

static char g_dir[64];
static char g_shard[128];
static int64_t g_len[NDOCS];
static int32_t *g_tok; /* the shard's tokens */
static int64_t g_count;
static int64_t g_start[NDOCS];

static int32_t doc_token(int d, int64_t j) {
    if (j == 0)
        return d;
    uint64_t h = (uint64_t)d * 1000003u + (uint64_t)j * 7919u;
    h ^= h >> 13;
    h *= 0x9E3779B97F4A7C15ull;
    return 200 + (int32_t)((h >> 40) % 56);
}

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe-loader-XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    snprintf(g_shard, sizeof g_shard, "%s/train.bin", g_dir);
    /* lengths 1..~700, several >= 256 (long documents), a few tiny ones */
    int64_t total = 0;
    for (int d = 0; d < NDOCS; d++) {
        g_len[d] = d % 7 == 0 ? 300 + 7 * d : 1 + (d * 37) % 150;
        total += g_len[d] + 1;
    }
    g_count = total;
    g_tok = malloc((size_t)total * sizeof(int32_t));
    int64_t k = 0;
    for (int d = 0; d < NDOCS; d++) {
        g_start[d] = k;
        for (int64_t j = 0; j < g_len[d]; j++)
            g_tok[k++] = doc_token(d, j);
        g_tok[k++] = EOT;
    }
    lm_error err = {0};
    if (lm_shard_write(g_shard, 257, g_tok, (uint64_t)total, &err) != LM_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    free(g_tok);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

typedef struct {
    lm_shard sh;
    lm_tokenizer *tok;
    lm_loader *ld;
    lm_loader_batch b;
} fixture;

static void fx_open(fixture *f, uint64_t seed, int rank, int world) {
    lm_error err = {0};
    memset(f, 0, sizeof *f);
    assert_int_equal(lm_shard_open(&f->sh, g_shard, &err), LM_OK);
    assert_int_equal(lm_tokenizer_byte(&f->tok, &err), LM_OK);
    lm_status st = lm_loader_new(&f->ld, &f->sh, f->tok, seed, rank, world, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    assert_int_equal(lm_loader_batch_init(&f->b, 8, 256, &err), LM_OK);
}

static void fx_stage(fixture *f, int S, int packing, double pf, double lf) {
    lm_error err = {0};
    lm_loader_stage s = {S, packing, pf, lf, 0, 0};
    lm_status st = lm_loader_set_stage(f->ld, &s, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void fx_next(fixture *f, int rows) {
    lm_error err = {0};
    memset(f->b.ids, 0x7f, (size_t)f->b.cap_tokens * sizeof(int32_t)); /* poison */
    memset(f->b.labels, 0x7f, (size_t)f->b.cap_tokens * sizeof(int32_t));
    lm_status st = lm_loader_next(f->ld, rows, &f->b, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void fx_close(fixture *f) {
    lm_loader_batch_free(&f->b);
    lm_loader_free(f->ld);
    lm_tokenizer_free(f->tok);
    lm_shard_close(&f->sh);
}

/* Follows the packed stream piece by piece, checking every invariant. */
typedef struct {
    int cur_doc;     /* document being continued, -1 at a document start */
    int64_t cur_off; /* its next offset */
    int seen[NDOCS]; /* starts per document in this epoch */
    int n_started;
    int order[4][NDOCS]; /* start order of the first epochs */
    int epoch;
    int per_epoch; /* documents per epoch for this rank */
} tracker;

static void tracker_init(tracker *t, int per_epoch) {
    memset(t, 0, sizeof *t);
    t->cur_doc = -1;
    t->per_epoch = per_epoch;
}

static void check_piece(tracker *t, const int32_t *ids, const int32_t *lab, int64_t len) {
    assert_true(len >= 1);
    assert_int_equal(ids[0], EOT);
    const int64_t k = len - 1;
    if (k == 0) { /* pad piece */
        assert_int_equal(lab[0], LM_MODEL_IGNORE);
        return;
    }
    int d;
    int64_t a;
    if (ids[1] < 200) { /* a document start */
        assert_int_equal(t->cur_doc, -1);
        d = ids[1];
        a = 0;
        if (t->n_started == t->per_epoch) { /* next epoch */
            memset(t->seen, 0, sizeof t->seen);
            t->n_started = 0;
            t->epoch++;
        }
        assert_int_equal(t->seen[d], 0);
        t->seen[d] = 1;
        if (t->epoch < 4)
            t->order[t->epoch][t->n_started] = d;
        t->n_started++;
    } else {
        assert_true(t->cur_doc >= 0);
        d = t->cur_doc;
        a = t->cur_off;
    }
    assert_true(a + k <= g_len[d]);
    for (int64_t j = 0; j < k; j++) {
        assert_int_equal(ids[1 + j], doc_token(d, a + j));
        assert_int_equal(lab[j], doc_token(d, a + j));
    }
    if (a + k == g_len[d]) {
        assert_int_equal(lab[k], EOT);
        t->cur_doc = -1;
    } else {
        assert_int_equal(lab[k], LM_MODEL_IGNORE);
        t->cur_doc = d;
        t->cur_off = a + k;
    }
}

/* Check a packed batch of stream rows; returns the number of pieces. */
static int check_packed(tracker *t, const lm_loader_batch *b, int S) {
    assert_int_equal(b->batch.B, 1);
    assert_int_equal(b->batch.T, b->rows * S);
    const int64_t *cu = b->batch.cu_seqlens;
    const int n = b->batch.n_cu_seqlens;
    assert_non_null(cu);
    assert_int_equal(cu[0], 0);
    assert_int_equal(cu[n - 1], (int64_t)b->rows * S);
    for (int i = 0; i + 1 < n; i++) {
        assert_true(cu[i] < cu[i + 1]);
        /* a piece never spans two rows */
        assert_int_equal(cu[i] / S, (cu[i + 1] - 1) / S);
        check_piece(t, b->ids + cu[i], b->labels + cu[i], cu[i + 1] - cu[i]);
    }
    return n - 1;
}

static void test_packing_stream(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 7, 0, 1);
    assert_int_equal(lm_loader_num_docs(f.ld), NDOCS);
    fx_stage(&f, 64, 1, 0, 0);
    tracker t;
    tracker_init(&t, NDOCS);
    int64_t total = 0;
    for (int64_t i = 0; i < g_count; i++)
        total += g_tok[i] != EOT;
    /* enough rows for three epochs */
    const int rows = (int)(3 * (total + 2 * NDOCS) / 63) + 4;
    int64_t labelled = 0;
    for (int r = 0; r < rows; r++) {
        fx_next(&f, 1);
        check_packed(&t, &f.b, 64);
        labelled += f.b.n_labels;
    }
    assert_true(t.epoch >= 2);
    /* each epoch visits the documents in a different order */
    assert_true(memcmp(t.order[0], t.order[1], sizeof t.order[0]) != 0);
    assert_true(labelled > rows * 32);
    fx_close(&f);
}

static void collect(fixture *f, int S, int total_rows, int per_call, int32_t *ids, int32_t *lab) {
    for (int r = 0; r < total_rows; r += per_call) {
        fx_next(f, per_call);
        memcpy(ids + (int64_t)r * S, f->b.ids, (size_t)per_call * S * sizeof(int32_t));
        memcpy(lab + (int64_t)r * S, f->b.labels, (size_t)per_call * S * sizeof(int32_t));
    }
}

static void test_rows_per_call(void **state) {
    (void)state;
    const int S = 128, R = 24;
    int32_t *i1 = malloc(sizeof(int32_t) * R * S), *l1 = malloc(sizeof(int32_t) * R * S);
    int32_t *i4 = malloc(sizeof(int32_t) * R * S), *l4 = malloc(sizeof(int32_t) * R * S);
    for (int packing = 0; packing < 2; packing++) {
        fixture f;
        fx_open(&f, 3, 0, 1);
        fx_stage(&f, S, packing, 0.2, 0.2);
        collect(&f, S, R, 1, i1, l1);
        fx_close(&f);
        fx_open(&f, 3, 0, 1);
        fx_stage(&f, S, packing, 0.2, 0.2);
        collect(&f, S, R, 4, i4, l4);
        if (packing) {
            int n = f.b.batch.n_cu_seqlens;
            assert_true(n >= 5); /* at least one piece per row */
        } else {
            assert_int_equal(f.b.batch.B, 4);
            assert_int_equal(f.b.batch.T, S);
            assert_null(f.b.batch.cu_seqlens);
        }
        fx_close(&f);
        assert_memory_equal(i1, i4, sizeof(int32_t) * R * S);
        assert_memory_equal(l1, l4, sizeof(int32_t) * R * S);
    }
    free(i1);
    free(l1);
    free(i4);
    free(l4);
}

static void test_resume(void **state) {
    (void)state;
    lm_error err = {0};
    const int S1 = 64, S2 = 256, R = 40;
    int32_t *ia = malloc(sizeof(int32_t) * R * S2), *la = malloc(sizeof(int32_t) * R * S2);
    int32_t *ib = malloc(sizeof(int32_t) * R * S2), *lb = malloc(sizeof(int32_t) * R * S2);
    for (int packing = 0; packing < 2; packing++) {
        fixture f;
        fx_open(&f, 11, 0, 1);
        fx_stage(&f, S1, packing, 0, 0);
        collect(&f, S1, 33, 1, ia, la); /* mid-document for packing */
        lm_loader_state st;
        lm_loader_get_state(f.ld, &st);
        assert_int_equal(st.rows, 33);
        collect(&f, S1, 10, 2, ia, la);
        fx_stage(&f, S2, packing, 0.25, 0.25); /* stage change continues the stream */
        collect(&f, S2, R, 1, ia, la);
        fx_close(&f);

        fx_open(&f, 11, 0, 1);
        fx_stage(&f, S1, packing, 0, 0);
        assert_int_equal(lm_loader_set_state(f.ld, &st, &err), LM_OK);
        collect(&f, S1, 10, 1, ib, lb);
        fx_stage(&f, S2, packing, 0.25, 0.25);
        collect(&f, S2, R, 1, ib, lb);
        lm_loader_state st2;
        lm_loader_get_state(f.ld, &st2);
        assert_int_equal(st2.rows, 33 + 10 + R);
        assert_true(st2.passkeys > 0);
        fx_close(&f);
        assert_memory_equal(ia, ib, sizeof(int32_t) * R * S2);
        assert_memory_equal(la, lb, sizeof(int32_t) * R * S2);
    }
    /* a state that does not fit the shard */
    fixture f;
    fx_open(&f, 11, 0, 1);
    fx_stage(&f, S1, 1, 0, 0);
    lm_loader_state bad;
    lm_loader_get_state(f.ld, &bad);
    bad.version = 99;
    assert_int_equal(lm_loader_set_state(f.ld, &bad, &err), LM_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "version"));
    lm_loader_get_state(f.ld, &bad);
    bad.doc_pos = NDOCS + 5;
    assert_int_equal(lm_loader_set_state(f.ld, &bad, &err), LM_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "doc_pos"));
    lm_loader_get_state(f.ld, &bad);
    bad.doc_off = 100000;
    assert_int_equal(lm_loader_set_state(f.ld, &bad, &err), LM_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "doc_off"));
    fx_close(&f);
    free(ia);
    free(la);
    free(ib);
    free(lb);
}

static void test_ranks(void **state) {
    (void)state;
    /* packing: within epoch 0 the ranks' documents are disjoint and cover all */
    const int W = 3;
    int owner[NDOCS];
    for (int d = 0; d < NDOCS; d++)
        owner[d] = -1;
    for (int r = 0; r < W; r++) {
        fixture f;
        fx_open(&f, 5, r, W);
        fx_stage(&f, 64, 1, 0, 0);
        tracker t;
        tracker_init(&t, NDOCS / W);
        for (int i = 0; i < 2000 && t.epoch == 0; i++) {
            fx_next(&f, 1);
            check_packed(&t, &f.b, 64);
        }
        assert_int_equal(t.epoch, 1);
        for (int i = 0; i < NDOCS / W; i++) {
            const int d = t.order[0][i];
            assert_int_equal(owner[d], -1);
            owner[d] = r;
        }
        fx_close(&f);
    }
    for (int d = 0; d < NDOCS; d++)
        assert_true(owner[d] >= 0);

    /* windows: rank r's row i is global row i*W + r */
    const int S = 32, R = 12;
    int32_t *g = malloc(sizeof(int32_t) * R * W * S), *gl = malloc(sizeof(int32_t) * R * W * S);
    int32_t *x = malloc(sizeof(int32_t) * R * S), *xl = malloc(sizeof(int32_t) * R * S);
    fixture f;
    fx_open(&f, 5, 0, 1);
    fx_stage(&f, S, 0, 0, 0.3);
    collect(&f, S, R * W, 1, g, gl);
    fx_close(&f);
    for (int r = 0; r < W; r++) {
        fx_open(&f, 5, r, W);
        fx_stage(&f, S, 0, 0, 0.3);
        collect(&f, S, R, 1, x, xl);
        fx_close(&f);
        for (int i = 0; i < R; i++) {
            assert_memory_equal(x + (int64_t)i * S, g + ((int64_t)i * W + r) * S,
                                sizeof(int32_t) * S);
            assert_memory_equal(xl + (int64_t)i * S, gl + ((int64_t)i * W + r) * S,
                                sizeof(int32_t) * S);
        }
    }
    free(g);
    free(gl);
    free(x);
    free(xl);
}

/* Offset of w[0..n) in the shard, or -1. */
static int64_t find_in_shard(const int32_t *w, int n) {
    for (int64_t o = 0; o + n <= g_count; o++)
        if (memcmp(g_tok + o, w, sizeof(int32_t) * (size_t)n) == 0)
            return o;
    return -1;
}

static int has_passkey_text(const int32_t *ids, int n) {
    static const char *key = "The pass key is ";
    const int kl = (int)strlen(key);
    int found = 0;
    for (int i = 0; i + kl <= n && !found; i++) {
        int ok = 1;
        for (int j = 0; j < kl && ok; j++)
            ok = ids[i + j] == (unsigned char)key[j];
        found = ok;
    }
    return found;
}

static void test_windows_and_mix(void **state) {
    (void)state;
    const int S = 128;
    int32_t w[S + 1];
    fixture f;
    fx_open(&f, 9, 0, 1);
    fx_stage(&f, S, 0, 0, 0);
    for (int r = 0; r < 30; r++) { /* windows: S+1 consecutive shard tokens */
        fx_next(&f, 1);
        memcpy(w, f.b.ids, sizeof(int32_t) * S);
        w[S] = f.b.labels[S - 1];
        for (int j = 0; j + 1 < S; j++)
            assert_int_equal(f.b.labels[j], f.b.ids[j + 1]);
        assert_true(find_in_shard(w, S + 1) >= 0);
        assert_int_equal(f.b.n_labels, S);
    }
    /* long-document rows inside one long document (window mode) */
    fx_stage(&f, 256, 0, 0, 1.0);
    for (int r = 0; r < 10; r++) {
        fx_next(&f, 1);
        assert_int_equal(f.b.n_long, 1);
        int32_t ww[257];
        memcpy(ww, f.b.ids, sizeof(int32_t) * 256);
        ww[256] = f.b.labels[255];
        int64_t o = find_in_shard(ww, 257);
        assert_true(o >= 0);
        int doc = 0;
        while (doc + 1 < NDOCS && g_start[doc + 1] <= o)
            doc++;
        assert_true(g_len[doc] >= 256);
        assert_true(o + 256 <= g_start[doc] + g_len[doc]); /* the last label is at most its EOT */
    }
    fx_close(&f);

    /* packing: long rows are one piece inside a long document; passkey rows whole */
    fx_open(&f, 9, 0, 1);
    fx_stage(&f, 256, 1, 0.3, 0.3);
    int npk = 0, nlong = 0;
    const int R = 300;
    for (int r = 0; r < R; r++) {
        fx_next(&f, 1);
        const lm_loader_batch *b = &f.b;
        if (b->n_passkey || b->n_long) {
            assert_int_equal(b->batch.n_cu_seqlens, 2);
            assert_int_equal(b->batch.cu_seqlens[1], 256);
        }
        if (b->n_passkey) {
            npk++;
            assert_true(has_passkey_text(b->ids, 256));
            for (int j = 0; j + 1 < 256; j++)
                assert_int_equal(b->labels[j], b->ids[j + 1]);
            assert_int_equal(b->labels[255], LM_MODEL_IGNORE);
        } else if (b->n_long) {
            nlong++;
            assert_int_equal(b->ids[0], EOT);
            int64_t o = find_in_shard(b->ids + 1, 255);
            assert_true(o >= 0);
            int doc = 0;
            while (doc + 1 < NDOCS && g_start[doc + 1] <= o)
                doc++;
            assert_true(g_len[doc] >= 256);
            const int64_t end = o + 255 - g_start[doc];
            assert_int_equal(b->labels[255], end == g_len[doc] ? EOT : LM_MODEL_IGNORE);
            for (int j = 0; j < 255; j++)
                assert_int_equal(b->labels[j], b->ids[j + 1]);
        } else {
            assert_false(has_passkey_text(b->ids, 256));
        }
    }
    /* fractions: binomial(300, 0.3) has s.d. ~8 */
    assert_true(npk > 60 && npk < 120);
    assert_true(nlong > 60 && nlong < 120);
    fx_close(&f);
}

/* Repeat rows: [EOT, P0, X, P1, X, ...] with X a span of 8..24 unigram-drawn tokens,
 * labels shifted by one, the last IGNORE; mixed at the configured fraction. */
static void test_repeat_rows(void **state) {
    (void)state;
    const int S = 128;
    for (int pack = 0; pack <= 1; pack++) {
        fixture f;
        fx_open(&f, 5, 0, 1);
        lm_error err = {0};
        lm_loader_stage st = {S, pack, 0, 0, 1.0, 0};
        assert_int_equal(lm_loader_set_stage(f.ld, &st, &err), LM_OK);
        for (int r = 0; r < 40; r++) {
            fx_next(&f, 1);
            const lm_loader_batch *b = &f.b;
            assert_int_equal(b->n_repeat, 1);
            assert_int_equal(b->n_passkey + b->n_long, 0);
            assert_int_equal(b->ids[0], EOT);
            for (int j = 0; j + 1 < S; j++)
                assert_int_equal(b->labels[j], b->ids[j + 1]);
            assert_int_equal(b->labels[S - 1], LM_MODEL_IGNORE);
            if (pack) {
                assert_int_equal(b->batch.n_cu_seqlens, 2);
                assert_int_equal(b->batch.cu_seqlens[1], S);
            }
            int found = 0; /* some 8 tokens occur twice, at least 8 apart */
            for (int x = 1; x + 8 <= S && !found; x++)
                for (int y = x + 8; y + 8 <= S && !found; y++)
                    found = memcmp(b->ids + x, b->ids + y, 8 * sizeof(int32_t)) == 0;
            assert_true(found);
            for (int j = 1; j < S; j++)
                assert_int_not_equal(b->ids[j], EOT);
        }
        fx_close(&f);
    }
    /* the mix: about 30 % repeat rows, 20 % passkey rows */
    fixture f;
    fx_open(&f, 6, 0, 1);
    lm_error err = {0};
    lm_loader_stage st = {256, 1, 0.2, 0, 0.3, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &st, &err), LM_OK);
    int nrep = 0, npk = 0;
    for (int r = 0; r < 400; r++) {
        fx_next(&f, 1);
        nrep += f.b.n_repeat;
        npk += f.b.n_passkey;
    }
    assert_true(nrep > 90 && nrep < 150);
    assert_true(npk > 50 && npk < 110);
    fx_close(&f);
}

/* Short passkey documents packed to a row: floor(S / Lp) pieces of Lp tokens, each a
 * whole passkey document, then a pad piece. */
static void test_short_passkeys(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 8, 0, 1);
    lm_error err = {0};
    lm_loader_stage st = {256, 1, 1.0, 0, 0, 125};
    lm_status rc = lm_loader_set_stage(f.ld, &st, &err);
    if (rc != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(rc, LM_OK);
    for (int r = 0; r < 5; r++) {
        fx_next(&f, 1);
        const lm_loader_batch *b = &f.b;
        assert_int_equal(b->n_passkey, 1);
        assert_int_equal(b->batch.n_cu_seqlens, 4); /* 0, 125, 250, 256 */
        for (int q = 0; q < 2; q++) {
            assert_int_equal(b->batch.cu_seqlens[q + 1], 125 * (q + 1));
            assert_true(has_passkey_text(b->ids + 125 * q, 125));
            for (int j = 0; j + 1 < 125; j++)
                assert_int_equal(b->labels[125 * q + j], b->ids[125 * q + j + 1]);
            assert_int_equal(b->labels[125 * q + 124], LM_MODEL_IGNORE);
        }
        for (int j = 250; j < 256; j++) {
            assert_int_equal(b->ids[j], EOT);
            assert_int_equal(b->labels[j], LM_MODEL_IGNORE);
        }
    }
    st.passkey_length = 300; /* longer than the row */
    assert_int_equal(lm_loader_set_stage(f.ld, &st, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "passkey_length = 300"));
    st.passkey_length = 125;
    st.packing = 0; /* several documents in a window row would see each other */
    assert_int_equal(lm_loader_set_stage(f.ld, &st, &err), LM_ERR_INVALID);
    fx_close(&f);
}

static void test_errors(void **state) {
    (void)state;
    lm_error err = {0};
    fixture f;
    fx_open(&f, 1, 0, 1);
    lm_loader_stage s = {1, 1, 0, 0, 0, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "seq_len = 1"));
    s = (lm_loader_stage){64, 1, 0.7, 0.5, 0, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "exceeds 1"));
    s = (lm_loader_stage){4096, 1, 0, 0.1, 0, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "seq_len = 4096"));
    assert_non_null(strstr(err.msg, g_shard));
    s = (lm_loader_stage){100000, 0, 0, 0, 0, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "random windows"));
    s = (lm_loader_stage){8, 1, 0.5, 0, 0, 0}; /* too short for a passkey document */
    assert_int_not_equal(lm_loader_set_stage(f.ld, &s, &err), LM_OK);
    s = (lm_loader_stage){64, 1, 0.4, 0.3, 0.4, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "repeat_fraction = 1.1 exceeds 1"));
    s = (lm_loader_stage){64, 1, 0, 0, -0.5, 0};
    assert_int_equal(lm_loader_set_stage(f.ld, &s, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "repeat_fraction = -0.5"));
    s = (lm_loader_stage){8, 1, 0, 0, 0.5, 0};
    assert_int_not_equal(lm_loader_set_stage(f.ld, &s, &err), LM_OK);
    /* no stage yet on a fresh loader */
    lm_loader *l2 = NULL;
    assert_int_equal(lm_loader_new(&l2, &f.sh, f.tok, 1, 0, 1, &err), LM_OK);
    assert_int_equal(lm_loader_next(l2, 1, &f.b, &err), LM_ERR_INVALID);
    lm_loader_free(l2);
    assert_int_equal(lm_loader_new(&l2, &f.sh, f.tok, 1, 2, 2, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "rank = 2"));
    assert_int_equal(lm_loader_new(&l2, &f.sh, f.tok, 1, 0, NDOCS + 1, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "world_size"));
    /* capacity */
    fx_stage(&f, 256, 1, 0, 0);
    assert_int_equal(lm_loader_next(f.ld, 9, &f.b, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "capacity"));
    fx_close(&f);
}

/* lm_loader_batch_shard: the ranks' shares of a global micro-batch put back together
 * are the batch (ids, labels, piece boundaries), each share alone is well formed, and
 * a world that does not divide the rows is an error naming both. */
static void test_batch_shard(void **state) {
    (void)state;
    lm_error err = {0};
    for (int pack = 0; pack <= 1; pack++) {
        fixture f;
        fx_open(&f, 7, 0, 1);
        fx_stage(&f, 32, pack, 0, pack ? 0.3 : 0);
        fx_next(&f, 6);
        const int64_t T = 6 * 32;
        for (int W = 1; W <= 3; W++) {
            lm_loader_batch part;
            assert_int_equal(lm_loader_batch_init(&part, 1, 256, &err), LM_OK);
            int64_t off = 0, labels = 0;
            int cu_seen = 0;
            for (int r = 0; r < W; r++) {
                memset(part.ids, 0x7f, (size_t)part.cap_tokens * sizeof(int32_t)); /* poison */
                assert_int_equal(lm_loader_batch_shard(&f.b, r, W, &part, &err), LM_OK);
                const int64_t n = (int64_t)part.batch.B * part.batch.T;
                assert_int_equal(n, T / W);
                assert_memory_equal(part.ids, f.b.ids + off, (size_t)n * sizeof(int32_t));
                assert_memory_equal(part.labels, f.b.labels + off, (size_t)n * sizeof(int32_t));
                if (pack) {
                    assert_int_equal(part.batch.B, 1);
                    assert_int_equal(part.cu[0], 0);
                    assert_int_equal(part.cu[part.batch.n_cu_seqlens - 1], n);
                    for (int i = 0; i < part.batch.n_cu_seqlens; i++)
                        assert_int_equal(part.cu[i] + off, f.b.cu[cu_seen + i]);
                    cu_seen += part.batch.n_cu_seqlens - 1; /* the shared boundary */
                } else {
                    assert_int_equal(part.batch.B, 6 / W);
                    assert_null(part.batch.cu_seqlens);
                }
                assert_int_equal(part.n_passkey, f.b.n_passkey);
                labels += part.n_labels;
                off += n;
            }
            assert_int_equal(labels, f.b.n_labels);
            if (pack)
                assert_int_equal(cu_seen + 1, f.b.batch.n_cu_seqlens);
            lm_loader_batch_free(&part);
        }
        lm_loader_batch part;
        assert_int_equal(lm_loader_batch_init(&part, 1, 256, &err), LM_OK);
        assert_int_equal(lm_loader_batch_shard(&f.b, 0, 4, &part, &err), LM_ERR_INVALID);
        assert_non_null(strstr(err.msg, "6 rows cannot be split evenly over 4"));
        lm_loader_batch_free(&part);
        fx_close(&f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_packing_stream),  cmocka_unit_test(test_rows_per_call),
        cmocka_unit_test(test_resume),          cmocka_unit_test(test_ranks),
        cmocka_unit_test(test_windows_and_mix), cmocka_unit_test(test_repeat_rows),
        cmocka_unit_test(test_short_passkeys),  cmocka_unit_test(test_batch_shard),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
