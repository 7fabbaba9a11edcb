/* Evals (include/linmoe/eval.h) on models built from configs/tiny.json:
 *  - bits per byte: the batched lm_eval_bpb against an independent per-window
 *    computation (each window alone through lm_model_forward with logits, then an
 *    fp64 log-softmax), on documents of every shape (shorter than, equal to and
 *    longer than seq_len, empty, and a last one without separator); counts of
 *    windows, documents, tokens and bytes; the result does not depend on the batch
 *    size (a model with max_tokens = seq_len forces one window per forward);
 *  - a uniform-logit model (zero LM head): bits/byte = log2(V) * tokens / bytes
 *    exactly, for the byte tokenizer and (with data/gpt2) GPT-2, whose byte count is
 *    the documents' UTF-8 length;
 *  - statistics: expert selections sum to k * tokens per MoE layer (0 for the dense
 *    one), AttnRes depth weights sum to 1 per sublayer;
 *  - passkey: a model whose logits implement a bigram map ("s" -> " " -> "1" ...)
 *    gets the answer's first tokens right; the counts of the cached greedy decode
 *    equal a replication by full forwards, and do not depend on the prefill chunking;
 *  - the JSON report's fields; bad input (seq_len, vocab mismatch, empty shard).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "cli_util.h"
#include "linmoe/eval.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/passkey.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"
#include "test_util.h"

#define SEQ 24
/* Tolerances:
 *  TOL_NLL 1e-5  batched eval vs windows run alone: same fp32 model, other GEMM
 *                shapes (row blocking), relative on the total nll
 *  TOL_LSE 1e-6  zero logits: the fused cross-entropy's fp32 log-sum-exp of V
 *                zeros vs ln V in fp64 (~ V * 2^-24 / V relative) */
#define TOL_NLL 1e-5
#define TOL_LSE 1e-6

static void load_tiny(lm_model_config *c) {
    lm_error err = {0};
    char warn[256];
    lm_status st = lm_model_config_load(c, "configs/tiny.json", warn, sizeof warn, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

/* Tiny model with weights far from uniform: initializer_range 0.3, AttnRes queries
 * N(0, 0.5) (not the zero init). */
static void make_params(lm_params *p, int vocab) {
    lm_model_config c;
    load_tiny(&c);
    c.vocab_size = vocab;
    c.initializer_range = 0.3f;
    lm_error err = {0};
    assert_int_equal(lm_params_init(p, &c, &err), LM_OK);
    lm_params_init_weights(p, 99);
    lm_rng r;
    lm_rng_init(&r, 7);
    for (int t = 0; t < p->n; t++)
        if (strstr(p->t[t].name, "res.query") || strstr(p->t[t].name, "attnres_final.query"))
            for (int64_t i = 0; i < p->t[t].numel; i++)
                p->data[p->t[t].offset + i] = (float)(0.5 * lm_rng_normal(&r));
}

/* Documents of lengths lens[] (random bytes), <|endoftext|> after each unless
 * `last_open`; a length 0 gives an empty document (two separators in a row). */
static int64_t write_docs(const char *path, const int *lens, int nd, int last_open, uint64_t seed) {
    int64_t n = 0;
    for (int d = 0; d < nd; d++)
        n += lens[d] + 1;
    int32_t *t = malloc((size_t)n * sizeof(int32_t));
    lm_rng r;
    lm_rng_init(&r, seed);
    int64_t k = 0;
    for (int d = 0; d < nd; d++) {
        for (int i = 0; i < lens[d]; i++)
            t[k++] = (int32_t)(lm_rng_u32(&r) % 256);
        if (!(last_open && d == nd - 1))
            t[k++] = 256;
    }
    lm_error err = {0};
    assert_int_equal(lm_shard_write(path, 257, t, (uint64_t)k, &err), LM_OK);
    free(t);
    return k;
}

static const int k_lens[] = {5, SEQ, 0, 2 * SEQ + 3, 1, 40, SEQ - 1, 0, 0, 77, 13};
#define N_LENS ((int)(sizeof k_lens / sizeof k_lens[0]))

/* -log p (nats) of every window, each alone through the model, fp64 log-softmax. */
static double direct_nll(lm_model *m, const lm_shard *s, int seq, int64_t *windows, int64_t *tokens,
                         int64_t *docs) {
    const int V = lm_model_params(m)->cfg.vocab_size;
    float *logits = malloc((size_t)seq * V * sizeof(float));
    int32_t ids[256];
    double nll = 0;
    *windows = *tokens = *docs = 0;
    uint64_t start = 0;
    for (uint64_t i = 0; i <= s->count; i++) {
        if (i < s->count && lm_shard_get(s, i) != 256)
            continue;
        if (i > start)
            ++*docs;
        for (uint64_t w0 = start; w0 < i; w0 += (uint64_t)seq) {
            const int len = (int)(i - w0 < (uint64_t)seq ? i - w0 : (uint64_t)seq);
            ids[0] = 256;
            for (int j = 1; j < len; j++)
                ids[j] = lm_shard_get(s, w0 + (uint64_t)j - 1);
            lm_model_batch b = {1, len, NULL, 0};
            lm_error err = {0};
            assert_int_equal(lm_model_forward(m, &b, ids, NULL, 0, logits, NULL, NULL, &err),
                             LM_OK);
            for (int j = 0; j < len; j++) {
                const float *z = logits + (int64_t)j * V;
                double mx = -INFINITY, se = 0;
                for (int v = 0; v < V; v++)
                    mx = z[v] > mx ? z[v] : mx;
                for (int v = 0; v < V; v++)
                    se += exp((double)z[v] - mx);
                nll += mx + log(se) - z[lm_shard_get(s, w0 + (uint64_t)j)];
            }
            ++*windows;
            *tokens += len;
        }
        start = i + 1;
    }
    free(logits);
    return nll;
}

static void test_bpb_protocol(void **state) {
    (void)state;
    lm_error err = {0};
    lm_params p;
    make_params(&p, 257);
    const char *path = lm_cli_path("val_bpb.bin");
    for (int open_last = 0; open_last < 2; open_last++) {
        write_docs(path, k_lens, N_LENS, open_last, 11);
        lm_shard s;
        assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
        lm_tokenizer *tok = NULL;
        assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
        lm_model *big = NULL, *one = NULL;
        assert_int_equal(lm_model_new(&big, &p, 8 * SEQ, &err), LM_OK);
        assert_int_equal(lm_model_new(&one, &p, SEQ, &err), LM_OK);
        lm_eval_bpb_result r, r1;
        assert_int_equal(lm_eval_bpb(big, tok, &s, SEQ, &r, &err), LM_OK);
        assert_int_equal(lm_eval_bpb(one, tok, &s, SEQ, &r1, &err), LM_OK);
        int64_t windows, tokens, docs;
        const double nll = direct_nll(big, &s, SEQ, &windows, &tokens, &docs);
        int64_t want_tokens = 0, want_windows = 0, want_docs = 0;
        for (int d = 0; d < N_LENS; d++) {
            want_tokens += k_lens[d];
            want_windows += (k_lens[d] + SEQ - 1) / SEQ;
            want_docs += k_lens[d] > 0;
        }
        assert_int_equal(tokens, want_tokens);
        assert_int_equal(r.tokens, want_tokens);
        assert_int_equal(r.bytes, want_tokens); /* byte tokenizer: one byte per token */
        assert_int_equal(r.windows, want_windows);
        assert_int_equal(r.documents, want_docs);
        assert_int_equal(windows, want_windows);
        assert_int_equal(docs, want_docs);
        print_message("bpb %.9f  nll %.9f  direct %.9f  one-window batches %.9f\n", r.bits_per_byte,
                      r.nll_nats, nll, r1.nll_nats);
        assert_true(fabs(r.nll_nats - nll) <= TOL_NLL * nll);
        assert_true(fabs(r1.nll_nats - nll) <= TOL_NLL * nll);
        assert_true(fabs(r.bits_per_byte - r.nll_nats / log(2.0) / (double)want_tokens) <=
                    1e-12 * r.bits_per_byte);
        assert_int_equal(r1.windows, r.windows);
        /* far from uniform (log2 257 = 8.006): the check above is not trivial */
        assert_true(fabs(r.bits_per_byte - log2(257.0)) > 0.1);
        lm_model_free(big);
        lm_model_free(one);
        lm_tokenizer_free(tok);
        lm_shard_close(&s);
    }
    lm_params_free(&p);
}

static void zero_head(lm_params *p) {
    const lm_param_info *h = lm_params_find(p, "lm_head.weight");
    assert_non_null(h);
    memset(p->data + h->offset, 0, (size_t)h->numel * sizeof(float));
}

static void test_bpb_uniform(void **state) {
    (void)state;
    lm_error err = {0};
    lm_params p;
    make_params(&p, 257);
    zero_head(&p);
    const char *path = lm_cli_path("val_uniform.bin");
    write_docs(path, k_lens, N_LENS, 0, 12);
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    lm_model *m = NULL;
    assert_int_equal(lm_model_new(&m, &p, 3 * SEQ, &err), LM_OK);
    lm_eval_bpb_result r;
    assert_int_equal(lm_eval_bpb(m, tok, &s, SEQ, &r, &err), LM_OK);
    const double want = log2(257.0) * (double)r.tokens / (double)r.bytes;
    print_message("uniform: bpb %.12f want %.12f\n", r.bits_per_byte, want);
    assert_true(fabs(r.bits_per_byte - want) <= TOL_LSE * want);
    assert_true(fabs(r.nll_nats - log(257.0) * (double)r.tokens) <= TOL_LSE * r.nll_nats);
    lm_model_free(m);
    lm_tokenizer_free(tok);
    lm_shard_close(&s);
    lm_params_free(&p);

    /* GPT-2: tokens != bytes; bytes must be the documents' UTF-8 length */
    if (access("data/gpt2/vocab.json", R_OK) != 0) {
        print_message("SKIP (gpt2 part): data/gpt2 absent (run scripts/fetch-data.sh)\n");
        return;
    }
    assert_int_equal(lm_tokenizer_gpt2(&tok, "data/gpt2", &err), LM_OK);
    static const char *const docs[] = {"Hello world, this is a test of the bits per byte protocol.",
                                       "Caf\xc3\xa9 na\xc3\xafve r\xc3\xa9sum\xc3\xa9 \xe2\x80\x94 "
                                       "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
                                       "and emoji \xf0\x9f\x98\x80 too.",
                                       "   spaces   and\ttabs\n\nand newlines  ", "Short."};
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0, bytes = 0;
    for (int d = 0; d < 4; d++) {
        assert_int_equal(lm_tokenizer_encode(tok, docs[d], strlen(docs[d]), &ids, &n, &cap, &err),
                         LM_OK);
        bytes += (int64_t)strlen(docs[d]);
        if (n == cap)
            ids = realloc(ids, (size_t)(cap = cap * 2 + 1) * sizeof(int32_t));
        ids[n++] = 50256;
    }
    const char *gp = lm_cli_path("val_gpt2.bin");
    assert_int_equal(lm_shard_write(gp, 50257, ids, (uint64_t)n, &err), LM_OK);
    free(ids);
    lm_params pg;
    make_params(&pg, 50257);
    zero_head(&pg);
    assert_int_equal(lm_shard_open(&s, gp, &err), LM_OK);
    assert_int_equal(lm_model_new(&m, &pg, 64, &err), LM_OK);
    assert_int_equal(lm_eval_bpb(m, tok, &s, 16, &r, &err), LM_OK);
    assert_int_equal(r.bytes, bytes);
    assert_int_equal(r.tokens, n - 4);
    assert_true(r.tokens < r.bytes);
    const double wg = log2(50257.0) * (double)r.tokens / (double)bytes;
    print_message("uniform gpt2: bpb %.12f want %.12f\n", r.bits_per_byte, wg);
    assert_true(fabs(r.bits_per_byte - wg) <= TOL_LSE * wg);
    lm_model_free(m);
    lm_shard_close(&s);
    lm_params_free(&pg);
    lm_tokenizer_free(tok);
}

static void test_bpb_stats(void **state) {
    (void)state;
    lm_error err = {0};
    lm_params p;
    make_params(&p, 257);
    const char *path = lm_cli_path("val_stats.bin");
    write_docs(path, k_lens, N_LENS, 0, 13);
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    lm_model *m = NULL;
    assert_int_equal(lm_model_new(&m, &p, 4 * SEQ, &err), LM_OK);
    lm_eval_bpb_result r;
    lm_eval_stats st = {0};
    assert_int_equal(lm_eval_bpb_stats(m, tok, &s, SEQ, &r, &st, &err), LM_OK);
    const lm_model_config *c = &p.cfg;
    assert_int_equal(st.n_layers, c->num_hidden_layers);
    assert_int_equal(st.n_experts, c->moe.router.num_experts);
    const int k = c->moe.router.num_experts_per_tok;
    int n_moe = 0;
    for (int i = 0; i < st.n_layers; i++) {
        int64_t sum = 0, nz = 0;
        for (int e = 0; e < st.n_experts; e++) {
            sum += st.expert_counts[i * st.n_experts + e];
            nz += st.expert_counts[i * st.n_experts + e] > 0;
        }
        if (lm_model_layer_is_moe(c, i)) {
            n_moe++;
            assert_int_equal(sum, (int64_t)k * r.tokens);
            assert_true(nz >= 2); /* random router: not all on one expert */
        } else {
            assert_int_equal(sum, 0);
        }
    }
    assert_int_equal(n_moe, 4);
    assert_int_equal(st.n_sublayers, 2 * c->num_hidden_layers + 1);
    for (int l = 0; l < st.n_sublayers; l++) {
        assert_true(st.n_sources[l] >= 1);
        double sw = 0;
        for (int j = 0; j < st.n_sources[l]; j++) {
            const double w = st.attnres_weights[l * st.max_sources + j];
            assert_true(w >= 0 && w <= 1);
            sw += w;
        }
        assert_true(fabs(sw - 1) < 1e-9);
    }
    /* block size 4 over 10 sublayers: the final aggregation sees the embedding, two
     * completed blocks and the running sum */
    assert_int_equal(st.n_sources[st.n_sublayers - 1], 4);
    /* balance helper */
    const int64_t cnt[4] = {10, 30, 0, 40};
    double mv, ml, load[4];
    int dead;
    lm_eval_balance(cnt, 4, &mv, &ml, &dead, load);
    assert_true(fabs(mv - (40.0 / 20.0 - 1)) < 1e-12);
    assert_true(fabs(ml - 0) < 1e-12);
    assert_int_equal(dead, 1);
    assert_true(fabs(load[1] - 0.375) < 1e-12);
    lm_eval_stats_free(&st);
    assert_null(st.expert_counts);
    lm_model_free(m);
    lm_tokenizer_free(tok);
    lm_shard_close(&s);
    lm_params_free(&p);
}

/* Bigram map: s -> ' ' -> '1' -> '2' ... '8' -> '9' -> '.', everything else to
 * itself; the LM head row of v is the sum of the embeddings of v's preimages and
 * the sublayer outputs are scaled down so the model mostly follows the map. */
static int next_of(int x) {
    if (x == 's')
        return ' ';
    if (x == ' ')
        return '1';
    if (x >= '1' && x <= '8')
        return x + 1;
    if (x == '9')
        return '.';
    return x;
}

static void make_bigram(lm_params *p) {
    make_params(p, 257);
    const int d = p->cfg.hidden_size;
    float *emb = lm_params_get(p, "model.embed_tokens.weight");
    float *head = lm_params_get(p, "lm_head.weight");
    assert_non_null(emb);
    assert_non_null(head);
    memset(head, 0, (size_t)257 * d * sizeof(float));
    for (int x = 0; x < 257; x++) {
        const int v = x == 256 ? 256 : next_of(x);
        for (int j = 0; j < d; j++)
            head[(int64_t)v * d + j] += emb[(int64_t)x * d + j];
    }
    for (int t = 0; t < p->n; t++)
        if (strstr(p->t[t].name, "o_proj") || strstr(p->t[t].name, "down_proj"))
            for (int64_t i = 0; i < p->t[t].numel; i++)
                p->data[p->t[t].offset + i] *= 0.05f;
}

static int32_t argmax_f(const float *x, int n) {
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

static void test_passkey_eval(void **state) {
    (void)state;
    lm_error err = {0};
    lm_params p;
    make_bigram(&p);
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    const int lens[] = {300, 500, 400, 350, 600};
    const char *path = lm_cli_path("filler.bin");
    write_docs(path, lens, 5, 0, 21);
    lm_shard f;
    assert_int_equal(lm_shard_open(&f, path, &err), LM_OK);
    const int L = 200, S = 24;
    lm_model *m = NULL, *small = NULL;
    assert_int_equal(lm_model_new(&m, &p, L, &err), LM_OK);
    assert_int_equal(lm_model_new(&small, &p, 48, &err), LM_OK); /* prefill in chunks */
    lm_eval_passkey_result r, r2;
    assert_int_equal(lm_eval_passkey(m, tok, &f, L, S, 1234, &r, &err), LM_OK);
    assert_int_equal(lm_eval_passkey(small, tok, &f, L, S, 1234, &r2, &err), LM_OK);
    /* replication with full forwards */
    int correct = 0;
    int64_t prefix = 0, answer = 0;
    float *logits = malloc((size_t)L * 257 * sizeof(float));
    for (int s = 0; s < S; s++) {
        lm_passkey_doc d;
        assert_int_equal(lm_passkey_make(tok, &f, L, 1234, (uint64_t)s, &d, &err), LM_OK);
        lm_model_batch b = {1, (int)d.digits_end, NULL, 0};
        assert_int_equal(lm_model_forward(m, &b, d.ids, NULL, 0, logits, NULL, NULL, &err), LM_OK);
        int ok = 1;
        for (int64_t q = d.answer_pos; q < d.digits_end; q++) {
            if (argmax_f(logits + (q - 1) * 257, 257) != d.ids[q]) {
                ok = 0;
                break;
            }
            prefix++;
        }
        correct += ok;
        answer += d.digits_end - d.answer_pos;
        lm_passkey_doc_free(&d);
    }
    free(logits);
    print_message("passkey: correct %d/%d, prefix %lld/%lld (direct %d, %lld)\n", r.correct,
                  r.samples, (long long)r.prefix_tokens, (long long)r.answer_tokens, correct,
                  (long long)prefix);
    assert_int_equal(r.length, L);
    assert_int_equal(r.samples, S);
    assert_int_equal(r.answer_tokens, answer);
    assert_int_equal(r.answer_tokens, 6 * S); /* " NNNNN" */
    assert_int_equal(r.correct, correct);
    assert_int_equal(r.prefix_tokens, prefix);
    assert_true(fabs(r.accuracy - (double)correct / S) < 1e-15);
    /* the map gets the space and usually the first digit's chain started */
    assert_true(r.prefix_tokens >= S);
    assert_int_equal(r2.correct, r.correct);
    assert_int_equal(r2.prefix_tokens, r.prefix_tokens);
    /* bad input */
    assert_int_equal(lm_eval_passkey(m, tok, &f, L, 0, 1, &r, &err), LM_ERR_INVALID);
    assert_int_equal(lm_eval_passkey(m, tok, &f, 50, 2, 1, &r, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "too short"));
    lm_model_free(m);
    lm_model_free(small);
    lm_shard_close(&f);
    lm_tokenizer_free(tok);
    lm_params_free(&p);
}

static void test_report_and_errors(void **state) {
    (void)state;
    lm_error err = {0};
    lm_params p;
    make_params(&p, 257);
    const char *path = lm_cli_path("val_report.bin");
    const int lens[] = {400, 300, 500};
    write_docs(path, lens, 3, 0, 31);
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, path, &err), LM_OK);
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    lm_model *m = NULL;
    assert_int_equal(lm_model_new(&m, &p, 256, &err), LM_OK);
    const int pl[2] = {128, 256};
    lm_eval_options o = {64, pl, 2, 3, 5, NULL, NULL, NULL};
    cJSON *obj = cJSON_CreateObject();
    assert_int_equal(lm_eval_report(m, tok, &s, &o, obj, &err), LM_OK);
    assert_int_equal((int)cJSON_GetObjectItem(obj, "seq_len")->valuedouble, 64);
    assert_true(cJSON_GetObjectItem(obj, "bits_per_byte")->valuedouble > 1);
    assert_int_equal((int)cJSON_GetObjectItem(obj, "tokens")->valuedouble, 1200);
    assert_int_equal((int)cJSON_GetObjectItem(obj, "documents")->valuedouble, 3);
    assert_int_equal((int)cJSON_GetObjectItem(obj, "windows")->valuedouble, 7 + 5 + 8);
    const cJSON *pk = cJSON_GetObjectItem(obj, "passkey");
    assert_int_equal(cJSON_GetArraySize(pk), 2);
    assert_int_equal((int)cJSON_GetObjectItem(cJSON_GetArrayItem(pk, 1), "length")->valuedouble,
                     256);
    assert_int_equal((int)cJSON_GetObjectItem(cJSON_GetArrayItem(pk, 1), "samples")->valuedouble,
                     3);
    const cJSON *moe = cJSON_GetObjectItem(obj, "moe");
    assert_int_equal(cJSON_GetArraySize(moe), 4);
    const cJSON *e;
    int layer = 2; /* 1-based, as in the config: layer 1 is dense (first_k_dense_replace) */
    cJSON_ArrayForEach(e, moe) {
        assert_int_equal((int)cJSON_GetObjectItem(e, "layer")->valuedouble, layer++);
        const cJSON *load = cJSON_GetObjectItem(e, "load");
        assert_int_equal(cJSON_GetArraySize(load), 4);
        double sl = 0, mx = 0;
        const cJSON *x;
        cJSON_ArrayForEach(x, load) {
            sl += x->valuedouble;
            mx = x->valuedouble > mx ? x->valuedouble : mx;
        }
        assert_true(fabs(sl - 1) < 1e-12);
        assert_true(fabs(cJSON_GetObjectItem(e, "maxvio")->valuedouble - (mx * 4 - 1)) < 1e-9);
    }
    const cJSON *ar = cJSON_GetObjectItem(obj, "attnres");
    assert_int_equal(cJSON_GetArraySize(ar), 11);
    cJSON_Delete(obj);

    /* errors */
    lm_eval_bpb_result r;
    assert_int_equal(lm_eval_bpb(m, tok, &s, 1, &r, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "seq_len"));
    assert_int_equal(lm_eval_bpb(m, tok, &s, 512, &r, &err), LM_ERR_INVALID); /* > max_tokens */
    assert_non_null(strstr(err.msg, "max_tokens"));
    lm_shard_close(&s);
    const int32_t t3[3] = {1, 2, 3};
    const char *pv = lm_cli_path("val_vocab.bin");
    assert_int_equal(lm_shard_write(pv, 50257, t3, 3, &err), LM_OK);
    assert_int_equal(lm_shard_open(&s, pv, &err), LM_OK);
    assert_int_equal(lm_eval_bpb(m, tok, &s, 64, &r, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "vocab"));
    lm_shard_close(&s);
    const int32_t seps[2] = {256, 256};
    const char *pe = lm_cli_path("val_seps.bin");
    assert_int_equal(lm_shard_write(pe, 257, seps, 2, &err), LM_OK);
    assert_int_equal(lm_shard_open(&s, pe, &err), LM_OK);
    assert_int_equal(lm_eval_bpb(m, tok, &s, 64, &r, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "no document"));
    lm_shard_close(&s);
    lm_model_free(m);
    lm_tokenizer_free(tok);
    lm_params_free(&p);
}

static void rm_tree(const char *p) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
    assert_int_equal(system(cmd), 0);
}

/* The JSON object printed by `linmoe eval --json OUT`. */
static cJSON *read_json(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *b = calloc(1, 1 << 20);
    size_t n = fread(b, 1, (1 << 20) - 1, f);
    fclose(f);
    b[n] = '\0';
    cJSON *o = cJSON_Parse(b);
    free(b);
    assert_non_null(o);
    return o;
}

/* `linmoe eval` and `linmoe generate` on a saved checkpoint: the CLI's numbers equal
 * the library's, greedy generation equals a greedy continuation computed with full
 * forwards, sampling is deterministic per seed, bad input fails cleanly. */
static void test_cli_eval_generate(void **state) {
    (void)state;
    lm_error err = {0};
    lm_params p;
    make_bigram(&p);
    const char *ck = lm_cli_path("ckpt");
    rm_tree(ck);
    assert_int_equal(lm_params_save(&p, ck, &err), LM_OK);
    const int lens[] = {300, 500, 400, 350, 600};
    const char *val = lm_cli_path("cli_val.bin");
    write_docs(val, lens, 5, 0, 41);
    const char *js = lm_cli_path("eval.json");
    char out[32768];
    int rc = lm_run_cli(out, sizeof out,
                        "eval --ckpt '%s' --val '%s' --seq-len 64 --passkey-lengths 200 "
                        "--passkey-samples 6 --passkey-seed 9 --threads 1 --json '%s'",
                        ck, val, js);
    if (rc != 0)
        print_message("%s\n", out);
    assert_int_equal(rc, 0);
    cJSON *o = read_json(js);
    /* the library on the same inputs */
    lm_shard s;
    assert_int_equal(lm_shard_open(&s, val, &err), LM_OK);
    lm_tokenizer *tok = NULL;
    assert_int_equal(lm_tokenizer_byte(&tok, &err), LM_OK);
    lm_model *m = NULL;
    assert_int_equal(lm_model_new(&m, &p, 256, &err), LM_OK);
    lm_eval_bpb_result r;
    assert_int_equal(lm_eval_bpb(m, tok, &s, 64, &r, &err), LM_OK);
    lm_eval_passkey_result pk;
    assert_int_equal(lm_eval_passkey(m, tok, &s, 200, 6, 9, &pk, &err), LM_OK);
    assert_string_equal(cJSON_GetObjectItem(o, "tokenizer")->valuestring, "byte");
    assert_string_equal(cJSON_GetObjectItem(o, "checkpoint")->valuestring, ck);
    const double bpb = cJSON_GetObjectItem(o, "bits_per_byte")->valuedouble;
    print_message("cli bpb %.9f  library %.9f\n", bpb, r.bits_per_byte);
    assert_true(fabs(bpb - r.bits_per_byte) <= TOL_NLL * r.bits_per_byte);
    assert_int_equal((int64_t)cJSON_GetObjectItem(o, "bytes")->valuedouble, r.bytes);
    assert_int_equal((int64_t)cJSON_GetObjectItem(o, "windows")->valuedouble, r.windows);
    const cJSON *pj = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "passkey"), 0);
    assert_int_equal((int)cJSON_GetObjectItem(pj, "correct")->valuedouble, pk.correct);
    assert_int_equal((int64_t)cJSON_GetObjectItem(pj, "prefix_tokens")->valuedouble,
                     pk.prefix_tokens);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(o, "moe")), 4);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(o, "attnres")), 11);
    /* issue 25: a summary in words. Not on a terminal (here): the JSON on stdout as
     * before, the summary on stderr */
    {
        char args[2048];
        const char *bin = getenv("LINMOE_BIN");
        snprintf(args, sizeof args,
                 "'%s' eval --ckpt '%s' --val '%s' --seq-len 64 --passkey-lengths 200 "
                 "--passkey-samples 6 --passkey-seed 9 --threads 1",
                 bin, ck, val);
        char cmd[2200];
        snprintf(cmd, sizeof cmd, "%s 2>/dev/null", args);
        FILE *pp = popen(cmd, "r");
        assert_non_null(pp);
        size_t got = fread(out, 1, sizeof out - 1, pp);
        out[got] = '\0';
        assert_int_equal(pclose(pp), 0);
        cJSON *j = cJSON_Parse(out); /* stdout alone is the JSON object */
        assert_non_null(j);
        cJSON_Delete(j);
        snprintf(cmd, sizeof cmd, "%s 2>&1 >/dev/null", args);
        pp = popen(cmd, "r");
        assert_non_null(pp);
        got = fread(out, 1, sizeof out - 1, pp);
        out[got] = '\0';
        assert_int_equal(pclose(pp), 0);
        char want[128];
        snprintf(want, sizeof want, "bits per byte %.4f over %lld bytes", bpb, (long long)r.bytes);
        lm_assert_says(out, want);
        char want2[128];
        snprintf(want2, sizeof want2, "passkey at 200: %.3f (%d/6)", (double)pk.correct / 6,
                 pk.correct);
        lm_assert_says(out, want2);
        /* on a terminal (script(1) gives the command a pty): progress, then the summary
         * on stdout and no JSON */
        if (system("command -v script >/dev/null 2>&1") == 0) {
            snprintf(cmd, sizeof cmd, "script -qec \"%s\" /dev/null", args);
            pp = popen(cmd, "r");
            assert_non_null(pp);
            got = fread(out, 1, sizeof out - 1, pp);
            out[got] = '\0';
            assert_int_equal(pclose(pp), 0);
            print_message("on a terminal:\n%s\n", out);
            lm_assert_says(out, "bits per byte: ");
            lm_assert_says(out, "% of");
            lm_assert_says(out, "passkey 200: 6 of 6 samples");
            lm_assert_says(out, want);
            lm_assert_says(out, want2);
            lm_assert_says(out, "--json FILE");
            assert_null(strstr(out, "\"bits_per_byte\""));
        }
    }
    cJSON_Delete(o);
    lm_shard_close(&s);

    /* greedy generation vs full forwards */
    const char *prompt = "The pass key is";
    const int max_new = 24;
    int32_t ids[64];
    int n = 0;
    ids[n++] = 256;
    for (const char *c = prompt; *c; c++)
        ids[n++] = (unsigned char)*c;
    char want[256];
    snprintf(want, sizeof want, "%s", prompt);
    size_t wl = strlen(want);
    float *logits = malloc((size_t)64 * 257 * sizeof(float));
    for (int k = 0; k < max_new; k++) {
        lm_model_batch b = {1, n, NULL, 0};
        assert_int_equal(lm_model_forward(m, &b, ids, NULL, 0, logits, NULL, NULL, &err), LM_OK);
        const int32_t t = argmax_f(logits + (int64_t)(n - 1) * 257, 257);
        if (t == 256)
            break;
        ids[n++] = t;
        want[wl++] = (char)t;
    }
    want[wl] = '\0';
    free(logits);
    rc = lm_run_cli(out, sizeof out,
                    "generate --ckpt '%s' --prompt '%s' --max-new %d "
                    "--temperature 0 --threads 1",
                    ck, prompt, max_new);
    if (rc != 0 || strncmp(out, want, wl) != 0)
        print_message("want '%s'\ngot:\n%s\n", want, out);
    assert_int_equal(rc, 0);
    assert_memory_equal(out, want, wl);
    assert_int_equal(out[wl], '\n'); /* the text ends with a newline (issue 25) */
    /* not degenerate: the bigram map's non-trivial steps show up (e.g. "6789.") */
    int steps = 0;
    for (size_t i = strlen(prompt); i + 1 < wl; i++)
        steps += want[i + 1] != want[i] && next_of((unsigned char)want[i]) == want[i + 1];
    print_message("greedy: '%s' (%d map steps)\n", want, steps);
    assert_true(steps >= 3);
    /* sampling: same seed, same text */
    char out2[32768];
    rc = lm_run_cli(out, sizeof out,
                    "generate --ckpt '%s' --prompt 'is' --max-new 30 "
                    "--temperature 1.5 --top-k 50 --top-p 0.9 --seed 7 2>/dev/null",
                    ck);
    assert_int_equal(rc, 0);
    rc = lm_run_cli(out2, sizeof out2,
                    "generate --ckpt '%s' --prompt 'is' --max-new 30 "
                    "--temperature 1.5 --top-k 50 --top-p 0.9 --seed 7 2>/dev/null",
                    ck);
    assert_int_equal(rc, 0);
    /* compare up to the timing line on stderr */
    char *t1 = strstr(out, "linmoe generate:"), *t2 = strstr(out2, "linmoe generate:");
    if (t1)
        *t1 = '\0';
    if (t2)
        *t2 = '\0';
    assert_string_equal(out, out2);
    /* bad input */
    rc = lm_run_cli(out, sizeof out, "generate --ckpt '%s/nope'", lm_cli_dir());
    assert_int_equal(rc, 1);
    lm_assert_says(out, "nope: no such checkpoint or run directory");
    /* issue 25: a missing directory, an empty one and a run whose `latest` dangles say so
     * (they said "DIR/config.json: cannot open"), for every command that takes a checkpoint
     * (serve and bench serve said so until this test covered them) */
    {
        char run[600], cmd[1400];
        snprintf(run, sizeof run, "%s/dangling", lm_cli_dir());
        snprintf(cmd, sizeof cmd, "mkdir -p '%s/ckpt' && echo step-0000099 > '%s/ckpt/latest'", run,
                 run);
        assert_int_equal(system(cmd), 0);
        static const char *const cmds[] = {"info %s", "eval --ckpt %s --val x.bin",
                                           "generate --ckpt %s --prompt a",
                                           "export --ckpt %s --format fla --out x",
                                           "serve --ckpt %s --port 0",
                                           "bench serve --ckpt %s"};
        for (int i = 0; i < 6; i++) {
            char arg[700];
            snprintf(arg, sizeof arg, "'%s/nope'", lm_cli_dir());
            rc = lm_run_cli(out, sizeof out, cmds[i], arg);
            assert_int_equal(rc, 1);
            lm_assert_says(out, "nope: no such checkpoint or run directory");
            snprintf(arg, sizeof arg, "'%s/nope/ckpt'", lm_cli_dir()); /* RUN/ckpt of no RUN */
            rc = lm_run_cli(out, sizeof out, cmds[i], arg);
            assert_int_equal(rc, 1);
            lm_assert_says(out, "nope/ckpt: no such checkpoint or run directory");
            snprintf(arg, sizeof arg, "'%s'", run);
            rc = lm_run_cli(out, sizeof out, cmds[i], arg);
            assert_int_equal(rc, 1);
            lm_assert_says(out, "ckpt/latest names");
            lm_assert_says(out, "step-0000099, which is not a directory");
            assert_null(strstr(out, "config.json"));
            snprintf(arg, sizeof arg, "'%s/ckpt'", run);
            rc = lm_run_cli(out, sizeof out, cmds[i], arg);
            assert_int_equal(rc, 1);
            lm_assert_says(out, "which is not a directory");
            snprintf(arg, sizeof arg, "'%s'", lm_cli_dir()); /* a directory, neither kind */
            rc = lm_run_cli(out, sizeof out, cmds[i], arg);
            assert_int_equal(rc, 1);
            lm_assert_says(out, "not a checkpoint directory (no model.safetensors)");
        }
    }
    rc = lm_run_cli(out, sizeof out, "generate --ckpt '%s' --top-p 1.5", ck);
    assert_int_equal(rc, 2);
    rc = lm_run_cli(out, sizeof out, "generate --ckpt '%s' --prompt a --prompt-file b", ck);
    assert_int_equal(rc, 2);
    rc = lm_run_cli(out, sizeof out, "generate --ckpt '%s' --prompt-file '%s/none.txt'", ck,
                    lm_cli_dir());
    assert_int_equal(rc, 1);
    lm_assert_says(out, "none.txt");
    rc = lm_run_cli(out, sizeof out, "eval --ckpt '%s' --val '%s/missing.bin'", ck, lm_cli_dir());
    assert_int_equal(rc, 1);
    lm_assert_says(out, "missing.bin");
    rc = lm_run_cli(out, sizeof out, "eval --ckpt '%s' --val '%s' --tokenizer gpt2 --gpt2-dir '%s'",
                    ck, val, lm_cli_dir());
    assert_int_equal(rc, 1);
    rc = lm_run_cli(out, sizeof out, "eval --val '%s'", val);
    assert_int_equal(rc, 2);
    rc = lm_run_cli(out, sizeof out, "eval --ckpt '%s' --val '%s' --passkey-lengths 12,x", ck, val);
    assert_int_equal(rc, 2);
    /* a truncated checkpoint: the message names the file */
    char st[600];
    snprintf(st, sizeof st, "%s/model.safetensors", ck);
    assert_int_equal(truncate(st, 100), 0);
    rc = lm_run_cli(out, sizeof out, "eval --ckpt '%s' --val '%s'", ck, val);
    assert_int_equal(rc, 1);
    lm_assert_says(out, "model.safetensors");
    assert_null(strstr(out, "Sanitizer"));
    rc = lm_run_cli(out, sizeof out, "generate --ckpt '%s'", ck);
    assert_int_equal(rc, 1);
    lm_assert_says(out, "model.safetensors");
    lm_model_free(m);
    lm_tokenizer_free(tok);
    lm_params_free(&p);
    rm_tree(ck);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bpb_protocol),      cmocka_unit_test(test_bpb_uniform),
        cmocka_unit_test(test_bpb_stats),         cmocka_unit_test(test_passkey_eval),
        cmocka_unit_test(test_report_and_errors), cmocka_unit_test(test_cli_eval_generate),
    };
    return cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
}
