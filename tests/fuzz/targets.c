/* The fuzz targets' entry functions (targets.h). Paths are relative to the repository
 * root (scripts/fuzz.sh and CTest run there); LINMOE_GPT2_DIR overrides data/gpt2. */
#include "targets.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include "linmoe/kda.h"
#include "linmoe/model.h"
#include "linmoe/model_config.h"
#include "linmoe/params.h"
#include "linmoe/safetensors.h"
#include "linmoe/server.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"
#include "linmoe/train.h"
#include "train/train_internal.h"

static int always(void) { return 1; }

/* a NUL-terminated copy */
static char *cstr(const uint8_t *d, size_t n) {
    char *s = malloc(n + 1);
    if (!s)
        abort();
    memcpy(s, d, n);
    s[n] = 0;
    return s;
}

/* ---------------------------------------------------------------- safetensors */

static int run_safetensors(const uint8_t *d, size_t n) {
    lm_safetensors st;
    lm_error err = {0};
    if (lm_st_parse(d, n, "fuzz", &st, &err) == LM_OK) {
        /* touch every tensor through the converters (they read the data section) */
        for (int i = 0; i < st.n_entries; i++) {
            float *f = NULL;
            if (lm_st_to_f32(&st, st.entries[i].name, &f, NULL) == LM_OK)
                free(f);
            int64_t *q = NULL;
            if (lm_st_to_i64(&st, st.entries[i].name, &q, NULL) == LM_OK)
                free(q);
        }
        for (int i = 0; i < st.n_meta; i++)
            if (lm_st_meta(&st, st.meta_keys[i]) == NULL)
                abort();
    }
    lm_st_free(&st);
    return 0;
}

/* ---------------------------------------------------------------- configs */

static int run_model_config(const uint8_t *d, size_t n) {
    char *s = cstr(d, n);
    lm_model_config c;
    char warn[512];
    lm_error err = {0};
    if (lm_model_config_from_string(&c, s, "fuzz", warn, sizeof warn, &err) == LM_OK) {
        if (lm_model_config_validate(&c, &err) != LM_OK)
            abort(); /* from_string promises a validated config */
        FILE *f = fopen("/dev/null", "w");
        if (f) {
            lm_model_config_print(&c, f);
            fclose(f);
        }
    }
    free(s);
    return 0;
}

static int run_train_config(const uint8_t *d, size_t n) {
    char *s = cstr(d, n);
    lm_train_config c;
    lm_error err = {0};
    if (lm_train_config_parse(&c, s, "fuzz", &err) == LM_OK) {
        for (int64_t step = 0; step < 4; step++) {
            (void)lm_train_stage_of(&c, step);
            (void)lm_train_lr(&c, step);
        }
    }
    lm_train_config_free(&c);
    free(s);
    return 0;
}

/* ---------------------------------------------------------------- shards */

/* lm_shard_open reads a path: the input goes to one temp file (a manifest's relative
 * shard paths then resolve next to it). */
static char g_shard_path[256];
static int run_shard(const uint8_t *d, size_t n) {
    if (!g_shard_path[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(g_shard_path, sizeof g_shard_path, "%s/linmoe-fuzz-shard-XXXXXX",
                 tmp && *tmp ? tmp : "/tmp");
        int fd = mkstemp(g_shard_path);
        if (fd < 0)
            abort();
        close(fd);
    }
    FILE *f = fopen(g_shard_path, "wb");
    if (!f || fwrite(d, 1, n, f) != n || fclose(f) != 0)
        abort();
    lm_shard s;
    lm_error err = {0};
    if (lm_shard_open(&s, g_shard_path, &err) == LM_OK) {
        uint64_t sum = 0;
        for (uint64_t i = 0; i < s.count; i++)
            sum += (uint64_t)lm_shard_get(&s, i);
        (void)sum;
        (void)lm_shard_validate(&s, &err);
    }
    lm_shard_close(&s);
    return 0;
}

/* ---------------------------------------------------------------- tokenizers */

static lm_tokenizer *g_byte, *g_gpt2;
static int g_gpt2_tried;

static const char *gpt2_dir(void) {
    const char *e = getenv("LINMOE_GPT2_DIR");
    return e && *e ? e : "data/gpt2";
}
static lm_tokenizer *tok_byte(void) {
    if (!g_byte && lm_tokenizer_byte(&g_byte, NULL) != LM_OK)
        abort();
    return g_byte;
}
static lm_tokenizer *tok_gpt2(void) {
    if (!g_gpt2_tried) {
        g_gpt2_tried = 1;
        lm_error err = {0};
        if (lm_tokenizer_gpt2(&g_gpt2, gpt2_dir(), &err) != LM_OK)
            g_gpt2 = NULL;
    }
    return g_gpt2;
}
static int gpt2_available(void) { return tok_gpt2() != NULL; }

/* Encode the bytes (must decode to exactly them), then read them as little-endian int32
 * ids (any value): decode and the streaming decode must agree on the in-range ones, and
 * out-of-range ids must be refused. */
static int run_tokenizer(lm_tokenizer *t, const uint8_t *d, size_t n) {
    int32_t *ids = NULL;
    int64_t ni = 0, cap = 0;
    lm_error err = {0};
    if (lm_tokenizer_encode(t, (const char *)d, n, &ids, &ni, &cap, &err) == LM_OK) {
        const int V = lm_tokenizer_vocab_size(t);
        for (int64_t i = 0; i < ni; i++)
            if (ids[i] < 0 || ids[i] >= V)
                abort();
        char *out = NULL;
        size_t ol = 0;
        if (lm_tokenizer_decode(t, ids, ni, &out, &ol, &err) != LM_OK)
            abort();
        /* <|endoftext|> in the text is ordinary text to encode, so the round trip is exact */
        if (ol != n || memcmp(out, d, n) != 0)
            abort();
        free(out);
    }
    free(ids);
    /* arbitrary ids */
    const int64_t m = (int64_t)(n / 4);
    int32_t *x = malloc(sizeof(int32_t) * (size_t)(m + 1));
    int32_t *valid = malloc(sizeof(int32_t) * (size_t)(m + 1));
    if (!x || !valid)
        abort();
    const int V = lm_tokenizer_vocab_size(t);
    int64_t nv = 0;
    for (int64_t i = 0; i < m; i++) {
        uint32_t u;
        memcpy(&u, d + 4 * i, 4);
        /* mostly in range (the interesting case), some as they are */
        x[i] = (u & 0x80000000u) ? (int32_t)u : (int32_t)(u % (uint32_t)(V + 8));
    }
    char *dec = NULL;
    size_t dl = 0;
    (void)lm_tokenizer_decode(t, x, m, &dec, &dl, NULL);
    free(dec);
    /* streaming: the pushes plus the flush equal the decode of the accepted ids */
    lm_tokenizer_stream s;
    memset(&s, 0, sizeof s);
    size_t scap = 1024, sl = 0;
    char *sbuf = malloc(scap);
    char buf[LM_TOKENIZER_STREAM_BUF];
    if (!sbuf)
        abort();
    for (int64_t i = 0; i < m; i++) {
        const int r = lm_tokenizer_stream_push(t, &s, x[i], buf, sizeof buf);
        if (x[i] < 0 || x[i] >= V) {
            if (r != -1)
                abort();
            continue;
        }
        if (r < 0 || (size_t)r > sizeof buf)
            abort();
        valid[nv++] = x[i];
        if (sl + (size_t)r > scap) {
            scap = 2 * (sl + (size_t)r);
            sbuf = realloc(sbuf, scap);
            if (!sbuf)
                abort();
        }
        memcpy(sbuf + sl, buf, (size_t)r);
        sl += (size_t)r;
    }
    const int r = lm_tokenizer_stream_flush(&s, buf, sizeof buf);
    if (r < 0 || (size_t)r > sizeof buf)
        abort();
    if (sl + (size_t)r > scap) {
        sbuf = realloc(sbuf, sl + (size_t)r);
        if (!sbuf)
            abort();
    }
    memcpy(sbuf + sl, buf, (size_t)r);
    sl += (size_t)r;
    if (lm_tokenizer_decode(t, valid, nv, &dec, &dl, &err) != LM_OK)
        abort();
    if (dl != sl || memcmp(dec, sbuf, sl) != 0)
        abort();
    free(dec);
    free(sbuf);
    free(x);
    free(valid);
    return 0;
}
static int run_tok_byte(const uint8_t *d, size_t n) { return run_tokenizer(tok_byte(), d, n); }
static int run_tok_gpt2(const uint8_t *d, size_t n) {
    lm_tokenizer *t = tok_gpt2();
    return t ? run_tokenizer(t, d, n) : 0;
}

/* ---------------------------------------------------------------- train_state */

/* A micro model (one KDA and one attention layer, both MoE with 2 experts: a router
 * state each), so that a whole train_state is a few KB; the seeds were written for it
 * (fuzz_replay --write-seeds). */
static const char micro_json[] =
    "{\"vocab_size\": 16, \"hidden_size\": 8, \"num_hidden_layers\": 2,"
    " \"linear_attn_config\": {\"kda_layers\": [1], \"full_attn_layers\": [2],"
    " \"num_heads\": 1, \"head_dim\": 4, \"chunk_size\": 16},"
    " \"num_attention_heads\": 1, \"num_key_value_heads\": 1, \"head_dim\": 4,"
    " \"num_experts\": 2, \"num_experts_per_tok\": 1, \"moe_intermediate_size\": 4,"
    " \"first_k_dense_replace\": 0, \"intermediate_size\": 8}";
static lm_params g_p;
static lm_model *g_m;
static lm_adamw g_a;
static int g_model_ok = -1;
static int tiny_model(void) {
    if (g_model_ok < 0) {
        g_model_ok = 0;
        lm_model_config c;
        lm_error err = {0};
        char warn[256];
        if (lm_model_config_from_string(&c, micro_json, "micro", warn, sizeof warn, &err) ==
                LM_OK &&
            lm_params_init(&g_p, &c, &err) == LM_OK &&
            lm_model_new(&g_m, &g_p, 64, &err) == LM_OK) {
            lm_adamw_init(&g_a, &g_p);
            g_model_ok = 1;
        } else {
            fprintf(stderr, "fuzz train_state: %s\n", err.msg);
        }
    }
    return g_model_ok;
}
int lm_fuzz_write_train_state(const char *run_dir, char *dir, size_t size);
int lm_fuzz_write_train_state(const char *run_dir, char *dir, size_t size) {
    if (!tiny_model())
        return -1;
    lm_params_init_weights(&g_p, 5);
    for (int64_t i = 0; i < g_p.numel; i++)
        g_a.m[i] = 0.001f * (float)(i % 7), g_a.v[i] = 0.0001f * (float)(i % 5);
    lm_train_counters k = {3, 3, 96, 0, 0, 0, LM_TRAIN_STATE_VERSION};
    lm_loader_state ls;
    memset(&ls, 0, sizeof ls);
    ls.rows = 3;
    ls.version = 1;
    lm_error err = {0};
    if (lm_train_ckpt_save(run_dir, &g_p, &g_a, g_m, &k, &ls, "{}", 1, 0, dir, size, &err) !=
        LM_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    return 0;
}

static int run_train_state(const uint8_t *d, size_t n) {
    if (!tiny_model())
        return 0;
    lm_train_counters k;
    lm_loader_state ls;
    lm_error err = {0};
    (void)lm_train_state_parse(d, n, "fuzz", &g_p, &g_a, g_m, &k, &ls, &err);
    return 0;
}

/* ---------------------------------------------------------------- server requests */

/* First byte: bit 0 chat or completions, bit 1 the GPT-2 tokenizer (when present); the
 * rest is the body. Context 64 tokens, vocab of the tokenizer. */
static int run_server_request(const uint8_t *d, size_t n) {
    if (n < 1)
        return 0;
    lm_tokenizer *t = (d[0] & 2) && tok_gpt2() ? tok_gpt2() : tok_byte();
    const int st = lm_server_check_request(t, lm_tokenizer_vocab_size(t), 64, d[0] & 1,
                                           (const char *)d + 1, n - 1);
    if (st != 200 && st != 400 && st != 413 && st != 503)
        abort();
    return 0;
}

/* ---------------------------------------------------------------- op runner */

/* The op runner (`linmoe op ...`, tools/op_*.c): its metadata (keys, numbers, booleans,
 * names), tensor names, dtypes and shapes, then the op itself on what passed. Byte 0
 * picks the op (mod 6: kda, gdn, attention, attnres, moe_router, moe); the rest is the
 * --in safetensors file. The runner takes paths, so the bytes go to a temporary file;
 * its messages (every bad input has one) go to /dev/null unless LINMOE_FUZZ_VERBOSE is
 * set. Exit codes other than 0
 * (ran) and 1 (bad input, said) abort. */
int lm_cli_op_kda(const char *prog, lm_kda_kind kind, const char *in_path, const char *out_path,
                  int use_cuda);
int lm_cli_op_attention(const char *prog, const char *in_path, const char *out_path);
int lm_cli_op_attnres(const char *prog, const char *in_path, const char *out_path);
int lm_cli_op_moe_router(const char *prog, const char *in_path, const char *out_path);
int lm_cli_op_moe(const char *prog, const char *in_path, const char *out_path);

static char g_op_in[64], g_op_out[80];
static int g_devnull = -1;

static void op_files_remove(void) {
    unlink(g_op_in);
    unlink(g_op_out);
}

static int op_files(void) {
    if (g_op_in[0])
        return 1;
    snprintf(g_op_in, sizeof g_op_in, "/tmp/linmoe-fuzz-op-XXXXXX");
    const int fd = mkstemp(g_op_in);
    if (fd < 0) {
        g_op_in[0] = '\0';
        return 0;
    }
    close(fd);
    atexit(op_files_remove);
    snprintf(g_op_out, sizeof g_op_out, "%s.out", g_op_in);
    g_devnull = open("/dev/null", O_WRONLY);
    return g_devnull >= 0;
}

static int run_op_meta(const uint8_t *d, size_t n) {
    if (n < 1 || !op_files())
        return 0;
    FILE *f = fopen(g_op_in, "wb");
    if (!f)
        return 0;
    const size_t w = fwrite(d + 1, 1, n - 1, f);
    if (fclose(f) != 0 || w != n - 1)
        return 0;
    fflush(stderr);
    const int quiet = getenv("LINMOE_FUZZ_VERBOSE") == NULL; /* set: see the messages */
    const int saved = quiet ? dup(2) : -1;
    if (quiet)
        dup2(g_devnull, 2);
    int rc;
    switch (d[0] % 6) {
    case 0:
        rc = lm_cli_op_kda("fuzz op kda", LM_KDA, g_op_in, g_op_out, 0);
        break;
    case 1:
        rc = lm_cli_op_kda("fuzz op gdn", LM_GDN, g_op_in, g_op_out, 0);
        break;
    case 2:
        rc = lm_cli_op_attention("fuzz op attention", g_op_in, g_op_out);
        break;
    case 3:
        rc = lm_cli_op_attnres("fuzz op attnres", g_op_in, g_op_out);
        break;
    case 4:
        rc = lm_cli_op_moe_router("fuzz op moe_router", g_op_in, g_op_out);
        break;
    default:
        rc = lm_cli_op_moe("fuzz op moe", g_op_in, g_op_out);
        break;
    }
    fflush(stderr);
    if (quiet) {
        dup2(saved, 2);
        close(saved);
    } else {
        fprintf(stderr, "op_meta: op %d, exit code %d\n", d[0] % 6, rc);
    }
    unlink(g_op_out);
    if (rc != 0 && rc != 1)
        abort();
    return 0;
}

const lm_fuzz_target lm_fuzz_targets[] = {
    {"safetensors", run_safetensors, always},   {"model_config", run_model_config, always},
    {"train_config", run_train_config, always}, {"shard", run_shard, always},
    {"tok_byte", run_tok_byte, always},         {"tok_gpt2", run_tok_gpt2, gpt2_available},
    {"train_state", run_train_state, always},   {"server_request", run_server_request, always},
    {"op_meta", run_op_meta, always},
};
const int lm_fuzz_n_targets = (int)(sizeof lm_fuzz_targets / sizeof lm_fuzz_targets[0]);

const lm_fuzz_target *lm_fuzz_find(const char *name) {
    for (int i = 0; i < lm_fuzz_n_targets; i++)
        if (strcmp(lm_fuzz_targets[i].name, name) == 0)
            return &lm_fuzz_targets[i];
    return NULL;
}
