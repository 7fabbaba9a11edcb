/* Training data loader: random windows or document packing over a token shard (a
 * shard file or a manifest's concatenated shards: both are one lm_shard, see
 * shard.h), with passkey and long-document rows; seeded, resumable, rank-aware.
 * Contracts and the exact row layouts: include/linmoe/loader.h. */
#include <stdlib.h>
#include <string.h>

#include "linmoe/loader.h"
#include "linmoe/passkey.h"

struct lm_loader {
    const lm_shard *sh;
    lm_tokenizer *tok;
    int32_t eot;
    uint64_t seed;
    int rank, world;
    int64_t ndocs;
    int64_t *doc_start, *doc_len; /* [ndocs] */
    int64_t *perm;                /* [ndocs] permutation of the current epoch */
    uint64_t perm_epoch;
    int perm_valid;
    lm_loader_stage stage;
    int have_stage;
    int64_t *long_docs; /* [n_long] documents with >= stage S tokens */
    int64_t n_long;
    lm_loader_state st;
    lm_passkey_ws pk; /* grow-only scratch of the passkey rows (reused every batch) */
};

/* Domain-separated Philox keys (splitmix64 finaliser of seed and a tag). */
static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
static uint64_t key_of(uint64_t seed, uint64_t tag) { return mix64(mix64(seed) ^ tag); }
#define TAG_ROWS 0x726f7773ull    /* "rows" */
#define TAG_PERM 0x7065726dull    /* "perm" */
#define TAG_PASSKEY 0x706b6579ull /* "pkey" */
#define TAG_REPEAT 0x72657074ull  /* "rept" */
#define LM_REPEAT_MAX_SPAN 64

/* uniform integer in [0, n) from a 32-bit word (n < 2^32) */
static int64_t below32(uint32_t w, int64_t n) {
    return (int64_t)(((uint64_t)w * (uint64_t)n) >> 32);
}

static int32_t tok_at(const lm_loader *l, int64_t i) { return lm_shard_get(l->sh, (uint64_t)i); }

/* A counter-based stream of 32-bit draws: Philox blocks (key, base + k), k = 0, 1, ... */
typedef struct {
    uint64_t key, base, k;
    uint32_t w[4];
    int used;
} draw_stream;
static uint32_t ds_next(draw_stream *s) {
    if (s->used == 4) {
        lm_philox4x32(s->key, s->base + s->k++, s->w);
        s->used = 0;
    }
    return s->w[s->used++];
}
static uint64_t ds_next64(draw_stream *s) {
    const uint64_t hi = ds_next(s);
    return (hi << 32) | ds_next(s);
}
/* The token at a uniformly random offset r (mod count); an EOT gives the next non-EOT
 * token (a draw from the shard's unigram distribution without separators). */
static int32_t unigram_tok(const lm_loader *l, uint64_t r) {
    uint64_t o = r % l->sh->count;
    int32_t t = tok_at(l, (int64_t)o);
    for (uint64_t step = 1; t == l->eot && step < l->sh->count; step++)
        t = tok_at(l, (int64_t)((o + step) % l->sh->count));
    return t;
}
/* Token j of document d, with j == n giving its separator. */
static int32_t doc_tok(const lm_loader *l, int64_t d, int64_t j) {
    return j < l->doc_len[d] ? tok_at(l, l->doc_start[d] + j) : l->eot;
}

void lm_loader_free(lm_loader *l) {
    if (!l)
        return;
    free(l->doc_start);
    free(l->doc_len);
    free(l->perm);
    free(l->long_docs);
    lm_passkey_ws_free(&l->pk);
    free(l);
}

lm_status lm_loader_new(lm_loader **out, const lm_shard *shard, lm_tokenizer *tok, uint64_t seed,
                        int rank, int world_size, lm_error *err) {
    *out = NULL;
    if (!shard || !tok)
        return lm_errorf(err, LM_ERR_INVALID, "loader: NULL shard or tokenizer");
    const char *path = shard->path ? shard->path : "(shard)";
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return lm_errorf(err, LM_ERR_INVALID,
                         "loader: rank = %d, world_size = %d (want 0 <= rank < world_size)", rank,
                         world_size);
    if ((int64_t)shard->vocab != lm_tokenizer_vocab_size(tok))
        return lm_errorf(err, LM_ERR_INVALID, "loader: %s has vocab %u but the %s tokenizer has %d",
                         path, (unsigned)shard->vocab, lm_tokenizer_name(tok),
                         lm_tokenizer_vocab_size(tok));
    if (shard->count == 0)
        return lm_errorf(err, LM_ERR_INVALID, "loader: %s holds no tokens", path);
    lm_loader *l = LM_CALLOC(1, sizeof(*l));
    l->sh = shard;
    l->tok = tok;
    l->eot = lm_tokenizer_eot(tok);
    l->seed = seed;
    l->rank = rank;
    l->world = world_size;
    const int64_t count = (int64_t)shard->count;
    int64_t cap = 0;
    for (int pass = 0; pass < 2; pass++) {
        int64_t nd = 0, start = 0;
        for (int64_t i = 0; i <= count; i++) {
            if (i == count || tok_at(l, i) == l->eot) {
                if (i > start) {
                    if (pass) {
                        l->doc_start[nd] = start;
                        l->doc_len[nd] = i - start;
                    }
                    nd++;
                }
                start = i + 1;
            }
        }
        if (!pass) {
            cap = nd > 0 ? nd : 1;
            l->doc_start = LM_MALLOC((size_t)cap * sizeof(int64_t));
            l->doc_len = LM_MALLOC((size_t)cap * sizeof(int64_t));
        }
        l->ndocs = nd;
    }
    if (l->ndocs < world_size || l->ndocs >= ((int64_t)1 << 32)) {
        lm_status s = lm_errorf(
            err, LM_ERR_INVALID,
            "loader: %s holds %lld non-empty documents; need at least world_size = %d (and < 2^32)",
            path, (long long)l->ndocs, world_size);
        lm_loader_free(l);
        return s;
    }
    l->perm = LM_MALLOC((size_t)l->ndocs * sizeof(int64_t));
    l->long_docs = LM_MALLOC((size_t)l->ndocs * sizeof(int64_t));
    l->st.version = LM_LOADER_STATE_VERSION;
    *out = l;
    return LM_OK;
}

int64_t lm_loader_num_docs(const lm_loader *l) { return l->ndocs; }
int64_t lm_loader_num_docs_at_least(const lm_loader *l, int64_t n) {
    int64_t c = 0;
    for (int64_t d = 0; d < l->ndocs; d++)
        c += l->doc_len[d] >= n;
    return c;
}

/* Fisher-Yates with one Philox word per swap, keyed by (seed, epoch). */
static void make_perm(lm_loader *l, uint64_t epoch) {
    const int64_t n = l->ndocs;
    for (int64_t i = 0; i < n; i++)
        l->perm[i] = i;
    const uint64_t key = key_of(l->seed, TAG_PERM ^ (epoch << 32) ^ (epoch >> 32));
    for (int64_t i = n - 1; i > 0; i--) {
        uint32_t w[4];
        lm_philox4x32(key, (uint64_t)i, w);
        int64_t j = below32(w[0], i + 1);
        int64_t t = l->perm[i];
        l->perm[i] = l->perm[j];
        l->perm[j] = t;
    }
    l->perm_epoch = epoch;
    l->perm_valid = 1;
}

lm_status lm_loader_set_stage(lm_loader *l, const lm_loader_stage *s, lm_error *err) {
    const char *path = l->sh->path ? l->sh->path : "(shard)";
    if (s->seq_len < 2)
        return lm_errorf(err, LM_ERR_INVALID, "loader: seq_len = %d (want >= 2)", s->seq_len);
    if (!(s->passkey_fraction >= 0 && s->passkey_fraction <= 1))
        return lm_errorf(err, LM_ERR_INVALID, "loader: passkey_fraction = %g (want [0, 1])",
                         s->passkey_fraction);
    if (!(s->long_doc_fraction >= 0 && s->long_doc_fraction <= 1))
        return lm_errorf(err, LM_ERR_INVALID, "loader: long_doc_fraction = %g (want [0, 1])",
                         s->long_doc_fraction);
    if (!(s->repeat_fraction >= 0 && s->repeat_fraction <= 1))
        return lm_errorf(err, LM_ERR_INVALID, "loader: repeat_fraction = %g (want [0, 1])",
                         s->repeat_fraction);
    if (s->passkey_fraction + s->long_doc_fraction + s->repeat_fraction > 1.0 + 1e-12)
        return lm_errorf(
            err, LM_ERR_INVALID,
            "loader: passkey_fraction + long_doc_fraction + repeat_fraction = %g exceeds 1",
            s->passkey_fraction + s->long_doc_fraction + s->repeat_fraction);
    if (s->repeat_fraction > 0 && s->seq_len < 10)
        return lm_errorf(err, LM_ERR_INVALID,
                         "loader: repeat_fraction = %g needs seq_len >= 10, got %d",
                         s->repeat_fraction, s->seq_len);
    if (!s->packing && (int64_t)l->sh->count < (int64_t)s->seq_len + 1)
        return lm_errorf(
            err, LM_ERR_INVALID,
            "loader: %s holds %llu tokens, fewer than seq_len + 1 = %d for random windows", path,
            (unsigned long long)l->sh->count, s->seq_len + 1);
    int64_t nl = 0;
    for (int64_t d = 0; d < l->ndocs; d++)
        if (l->doc_len[d] >= s->seq_len)
            l->long_docs[nl++] = d;
    if (s->long_doc_fraction > 0 && nl == 0)
        return lm_errorf(
            err, LM_ERR_INVALID,
            "loader: long_doc_fraction = %g but %s has no document of at least seq_len = %d tokens",
            s->long_doc_fraction, path, s->seq_len);
    if (s->passkey_length < 0 || s->passkey_length > s->seq_len ||
        (!s->packing && s->passkey_length > 0 && s->passkey_length != s->seq_len))
        return lm_errorf(err, LM_ERR_INVALID,
                         "loader: passkey_length = %d (want 0 = seq_len, or 1..seq_len = %d with "
                         "packing)",
                         s->passkey_length, s->seq_len);
    if (s->passkey_fraction > 0) {
        const int Lp = s->passkey_length > 0 ? s->passkey_length : s->seq_len;
        lm_passkey_doc doc;
        memset(&doc, 0, sizeof doc);
        /* into the loader's workspace: also sizes its buffers before the first batch */
        lm_status st = lm_passkey_make_into(l->tok, l->sh, Lp, key_of(l->seed, TAG_PASSKEY), 0,
                                            &l->pk, NULL, &doc, err);
        if (st == LM_OK && doc.n != Lp)
            st = lm_errorf(err, LM_ERR_INVALID, "loader: passkey document has %lld tokens, want %d",
                           (long long)doc.n, Lp);
        if (st != LM_OK)
            return st;
    }
    l->n_long = nl;
    l->stage = *s;
    l->have_stage = 1;
    return LM_OK;
}

void lm_loader_get_state(const lm_loader *l, lm_loader_state *st) { *st = l->st; }

lm_status lm_loader_set_state(lm_loader *l, const lm_loader_state *st, lm_error *err) {
    if (st->version != LM_LOADER_STATE_VERSION)
        return lm_errorf(err, LM_ERR_FORMAT, "loader state: version %llu (want %d)",
                         (unsigned long long)st->version, LM_LOADER_STATE_VERSION);
    const uint64_t W = (uint64_t)l->world, n = (uint64_t)l->ndocs;
    if (st->doc_pos > n || st->doc_pos * W + (uint64_t)l->rank > n + W)
        return lm_errorf(err, LM_ERR_FORMAT,
                         "loader state: doc_pos = %llu outside the shard's %llu documents",
                         (unsigned long long)st->doc_pos, (unsigned long long)n);
    const uint64_t idx = st->doc_pos * W + (uint64_t)l->rank;
    if (idx < n) {
        make_perm(l, st->epoch);
        const int64_t d = l->perm[idx];
        if (st->doc_off >= (uint64_t)l->doc_len[d])
            return lm_errorf(err, LM_ERR_FORMAT,
                             "loader state: doc_off = %llu outside document %lld of %lld tokens",
                             (unsigned long long)st->doc_off, (long long)d,
                             (long long)l->doc_len[d]);
    } else if (st->doc_off != 0) {
        return lm_errorf(err, LM_ERR_FORMAT, "loader state: doc_off = %llu past the epoch's end",
                         (unsigned long long)st->doc_off);
    }
    l->st = *st;
    return LM_OK;
}

lm_status lm_loader_batch_init(lm_loader_batch *b, int max_rows, int max_seq_len, lm_error *err) {
    memset(b, 0, sizeof *b);
    if (max_rows < 1 || max_seq_len < 2 || (int64_t)max_rows * max_seq_len > ((int64_t)1 << 30))
        return lm_errorf(err, LM_ERR_INVALID, "loader batch: %d rows x %d tokens", max_rows,
                         max_seq_len);
    b->cap_tokens = (int64_t)max_rows * max_seq_len;
    b->ids = LM_MALLOC((size_t)b->cap_tokens * sizeof(int32_t));
    b->labels = LM_MALLOC((size_t)b->cap_tokens * sizeof(int32_t));
    b->cu = LM_MALLOC((size_t)(b->cap_tokens + 1) * sizeof(int64_t));
    b->span = LM_MALLOC((size_t)LM_REPEAT_MAX_SPAN * sizeof(int32_t));
    return LM_OK;
}

lm_status lm_loader_batch_shard(const lm_loader_batch *full, int rank, int world,
                                lm_loader_batch *part, lm_error *err) {
    if (!full || !part || world < 1 || rank < 0 || rank >= world)
        return lm_errorf(err, LM_ERR_INVALID, "loader: batch share: rank %d of %d", rank, world);
    const int R = full->rows;
    if (R < 1 || R % world != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "loader: a micro-batch of %d rows cannot be split evenly over %d "
                         "data-parallel ranks (make train.batch_tokens / train.micro_batches / "
                         "seq_len a multiple of %d rows)",
                         R, world, world);
    const int pack = full->batch.cu_seqlens != NULL;
    const int64_t S = pack ? full->batch.T / R : full->batch.T;
    const int rows = R / world;
    const int64_t t0 = (int64_t)rank * rows * S, n = (int64_t)rows * S;
    if (n > part->cap_tokens)
        return lm_errorf(err, LM_ERR_INVALID, "loader: batch share of %lld tokens exceeds %lld",
                         (long long)n, (long long)part->cap_tokens);
    memcpy(part->ids, full->ids + t0, (size_t)n * sizeof(int32_t));
    memcpy(part->labels, full->labels + t0, (size_t)n * sizeof(int32_t));
    part->rows = rows;
    part->n_passkey = full->n_passkey;
    part->n_long = full->n_long;
    part->n_repeat = full->n_repeat;
    if (pack) {
        int i0 = 0;
        while (i0 < full->batch.n_cu_seqlens && full->batch.cu_seqlens[i0] < t0)
            i0++;
        int ncu = 0;
        LM_CHECK(i0 < full->batch.n_cu_seqlens && full->batch.cu_seqlens[i0] == t0);
        for (int i = i0; i < full->batch.n_cu_seqlens && full->batch.cu_seqlens[i] <= t0 + n; i++)
            part->cu[ncu++] = full->batch.cu_seqlens[i] - t0;
        LM_CHECK(part->cu[ncu - 1] == n); /* rows end at a piece boundary */
        part->batch.B = 1;
        part->batch.T = (int)n;
        part->batch.cu_seqlens = part->cu;
        part->batch.n_cu_seqlens = ncu;
    } else {
        part->batch.B = rows;
        part->batch.T = (int)S;
        part->batch.cu_seqlens = NULL;
        part->batch.n_cu_seqlens = 0;
    }
    int64_t nl = 0;
    for (int64_t i = 0; i < n; i++)
        nl += part->labels[i] != LM_MODEL_IGNORE;
    part->n_labels = nl;
    return LM_OK;
}

void lm_loader_batch_free(lm_loader_batch *b) {
    free(b->ids);
    free(b->labels);
    free(b->cu);
    free(b->span);
    memset(b, 0, sizeof *b);
}

/* The current packing document of this rank (rolling into the next epoch). */
static int64_t cur_doc(lm_loader *l) {
    const uint64_t W = (uint64_t)l->world;
    if (l->st.doc_pos * W + (uint64_t)l->rank >= (uint64_t)l->ndocs) {
        l->st.epoch++;
        l->st.doc_pos = 0;
        l->st.doc_off = 0;
    }
    if (!l->perm_valid || l->perm_epoch != l->st.epoch)
        make_perm(l, l->st.epoch);
    return l->perm[l->st.doc_pos * W + (uint64_t)l->rank];
}

/* One piece [EOT, t_a .. t_{a+k-1}] of document d at row position p: labels
 * t_a .. t_{a+k-1}, then EOT when the piece ends the document, else IGNORE. */
static void put_piece(const lm_loader *l, int32_t *ids, int32_t *lab, int64_t d, int64_t a,
                      int64_t k) {
    ids[0] = l->eot;
    for (int64_t j = 0; j < k; j++) {
        const int32_t t = doc_tok(l, d, a + j);
        ids[1 + j] = t;
        lab[j] = t;
    }
    lab[k] = a + k == l->doc_len[d] ? l->eot : LM_MODEL_IGNORE;
}

lm_status lm_loader_next(lm_loader *l, int rows, lm_loader_batch *b, lm_error *err) {
    if (!l->have_stage)
        return lm_errorf(err, LM_ERR_INVALID, "loader: no stage set");
    const int S = l->stage.seq_len;
    if (rows < 1 || (int64_t)rows * S > b->cap_tokens)
        return lm_errorf(err, LM_ERR_INVALID,
                         "loader: %d rows x %d tokens exceed the batch capacity of %lld", rows, S,
                         (long long)b->cap_tokens);
    const int pack = l->stage.packing;
    const uint64_t key = key_of(l->seed, TAG_ROWS);
    int64_t ncu = 0;
    if (pack)
        b->cu[ncu++] = 0;
    b->rows = rows;
    b->n_passkey = b->n_long = b->n_repeat = 0;
    for (int r = 0; r < rows; r++) {
        int32_t *ids = b->ids + (int64_t)r * S, *lab = b->labels + (int64_t)r * S;
        const int64_t base = (int64_t)r * S;
        const uint64_t g = l->st.rows * (uint64_t)l->world + (uint64_t)l->rank;
        uint32_t w[4];
        lm_philox4x32(key, g, w);
        const double u = w[0] * (1.0 / 4294967296.0);
        const uint64_t r64 = ((uint64_t)w[2] << 32) | w[3];
        if (u < l->stage.passkey_fraction) {
            const int Lp = l->stage.passkey_length > 0 ? l->stage.passkey_length : S;
            const int nd = S / Lp;
            for (int q = 0; q < nd; q++) {
                lm_passkey_doc doc;
                memset(&doc, 0, sizeof doc);
                const uint64_t idx = l->st.passkeys * (uint64_t)l->world + (uint64_t)l->rank;
                int32_t *di = ids + (int64_t)q * Lp, *dl = lab + (int64_t)q * Lp;
                /* straight into the row; the workspace makes this allocation-free */
                LM_TRY(lm_passkey_make_into(l->tok, l->sh, Lp, key_of(l->seed, TAG_PASSKEY), idx,
                                            &l->pk, di, &doc, err));
                if (doc.n != Lp)
                    return lm_errorf(err, LM_ERR_INVALID,
                                     "loader: passkey document has %lld tokens, want %d",
                                     (long long)doc.n, Lp);
                memcpy(dl, di + 1, (size_t)(Lp - 1) * sizeof(int32_t));
                dl[Lp - 1] = LM_MODEL_IGNORE;
                l->st.passkeys++;
                if (pack)
                    b->cu[ncu++] = base + (int64_t)(q + 1) * Lp;
            }
            for (int j = nd * Lp; j < S; j++) { /* pad piece */
                ids[j] = l->eot;
                lab[j] = LM_MODEL_IGNORE;
            }
            if (pack && nd * Lp < S)
                b->cu[ncu++] = base + S;
            b->n_passkey++;
        } else if (u < l->stage.passkey_fraction + l->stage.long_doc_fraction) {
            const int64_t d = l->long_docs[below32(w[1], l->n_long)];
            const int64_t n = l->doc_len[d];
            if (pack) {
                const int64_t a = (int64_t)(r64 % (uint64_t)(n - S + 2)); /* [0, n-S+1] */
                put_piece(l, ids, lab, d, a, S - 1);
                b->cu[ncu++] = base + S;
            } else {
                const int64_t a = (int64_t)(r64 % (uint64_t)(n - S + 1)); /* [0, n-S] */
                for (int j = 0; j < S; j++) {
                    ids[j] = doc_tok(l, d, a + j);
                    lab[j] = doc_tok(l, d, a + j + 1);
                }
            }
            b->n_long++;
        } else if (u < l->stage.passkey_fraction + l->stage.long_doc_fraction +
                           l->stage.repeat_fraction) {
            draw_stream ds = {key_of(l->seed, TAG_REPEAT), g * 4096u, 0, {0}, 4};
            const int64_t n_in = S - 1;                /* positions 1 .. S-1 after the EOT */
            int64_t m = 8 + below32(ds_next(&ds), 17); /* span: 8 .. 24 tokens */
            int R = 2 + (int)below32(ds_next(&ds), 7); /* copies: 2 .. 8 */
            if (2 * m > n_in)
                m = n_in / 2;
            if ((int64_t)R * m > n_in)
                R = (int)(n_in / m);
            int32_t *span = b->span;
            for (int64_t i = 0; i < m; i++) /* unigram draws */
                span[i] = unigram_tok(l, ds_next64(&ds));
            int64_t cut[9]; /* R sorted cut points in [0, gap_total] */
            const int64_t gap_total = n_in - (int64_t)R * m;
            for (int r = 0; r < R; r++) {
                int64_t c = below32(ds_next(&ds), gap_total + 1), q = r;
                while (q > 0 && cut[q - 1] > c) {
                    cut[q] = cut[q - 1];
                    q--;
                }
                cut[q] = c;
            }
            uint64_t po = ds_next64(&ds) % l->sh->count; /* prose walk */
            int64_t pos = 1, prev = 0;
            ids[0] = l->eot;
            for (int r = 0; r <= R; r++) {
                const int64_t gap = (r < R ? cut[r] : gap_total) - prev;
                for (int64_t j = 0; j < gap; j++) {
                    int32_t t = tok_at(l, (int64_t)po);
                    po = (po + 1) % l->sh->count;
                    for (uint64_t guard = 0; t == l->eot && guard < l->sh->count; guard++) {
                        t = tok_at(l, (int64_t)po);
                        po = (po + 1) % l->sh->count;
                    }
                    ids[pos++] = t;
                }
                if (r < R)
                    for (int64_t j = 0; j < m; j++)
                        ids[pos++] = span[j];
                prev = r < R ? cut[r] : gap_total;
            }
            for (int j = 1; j < S; j++)
                lab[j - 1] = ids[j];
            lab[S - 1] = LM_MODEL_IGNORE;
            if (pack)
                b->cu[ncu++] = base + S;
            b->n_repeat++;
        } else if (!pack) {
            const uint64_t o = r64 % (l->sh->count - (uint64_t)S); /* [0, count-S-1] */
            for (int j = 0; j < S; j++) {
                ids[j] = tok_at(l, (int64_t)o + j);
                lab[j] = tok_at(l, (int64_t)o + j + 1);
            }
        } else {
            int pos = 0;
            while (pos < S) {
                if (S - pos == 1) {
                    ids[pos] = l->eot;
                    lab[pos] = LM_MODEL_IGNORE;
                    pos++;
                    b->cu[ncu++] = base + pos;
                    break;
                }
                const int64_t d = cur_doc(l);
                const int64_t n = l->doc_len[d], o = (int64_t)l->st.doc_off;
                int64_t k = n - o;
                if (k > S - pos - 1)
                    k = S - pos - 1;
                put_piece(l, ids + pos, lab + pos, d, o, k);
                l->st.doc_off += (uint64_t)k;
                if ((int64_t)l->st.doc_off == n) {
                    l->st.doc_pos++;
                    l->st.doc_off = 0;
                }
                pos += (int)k + 1;
                b->cu[ncu++] = base + pos;
            }
        }
        l->st.rows++;
    }
    if (pack) {
        b->batch.B = 1;
        b->batch.T = rows * S;
        b->batch.cu_seqlens = b->cu;
        b->batch.n_cu_seqlens = (int)ncu;
    } else {
        b->batch.B = rows;
        b->batch.T = S;
        b->batch.cu_seqlens = NULL;
        b->batch.n_cu_seqlens = 0;
    }
    int64_t nl = 0;
    for (int64_t i = 0; i < (int64_t)rows * S; i++)
        nl += b->labels[i] != LM_MODEL_IGNORE;
    b->n_labels = nl;
    return LM_OK;
}
