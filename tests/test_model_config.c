/* Model config and parameter tests: configs/tiny.json and configs/bench-cpu.json
 * parse; JSON round trip; every bad-config case names its key and value; the
 * parameter table of bench-cpu.json against an independent hand sum; seeded init
 * (deterministic, per-kind values and ranges); checkpoint save -> load bit-exact;
 * load rejects a missing tensor, a wrong shape, a wrong dtype, an extra tensor and
 * a truncated file; a failed save leaves the existing checkpoint intact;
 * `linmoe info`. */
#include "test_util.h"

#include "linmoe/params.h"
#include "linmoe/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

static int setup_dir(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe-mc-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown_dir(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    b[n] = '\0';
    fclose(f);
    return b;
}

static void load_cfg(lm_model_config *c, const char *path) {
    lm_error err = {0};
    char warn[512];
    lm_status st = lm_model_config_load(c, path, warn, sizeof warn, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    assert_string_equal(warn, "");
}

/* ---------------------------------------------------------------- parsing */

static void test_parse_configs(void **state) {
    (void)state;
    lm_model_config c;
    load_cfg(&c, "configs/bench-cpu.json");
    assert_int_equal(c.vocab_size, 257);
    assert_int_equal(c.hidden_size, 256);
    assert_int_equal(c.num_hidden_layers, 8);
    assert_int_equal(lm_model_count_kind(&c, LM_LAYER_KDA), 6);
    assert_int_equal(c.kinds[3], LM_LAYER_ATTN);
    assert_int_equal(c.kinds[7], LM_LAYER_ATTN);
    assert_int_equal(c.kda_num_heads, 4);
    assert_int_equal(c.kda_head_dim, 64);
    assert_int_equal(c.num_attention_heads, 4);
    assert_int_equal(c.num_key_value_heads, 2);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.moe.router.num_experts, 16);
    assert_int_equal(c.moe.router.num_experts_per_tok, 2);
    assert_int_equal(c.moe.n_shared_experts, 1);
    assert_int_equal(c.moe.moe_intermediate_size, 256);
    assert_int_equal(c.first_k_dense_replace, 1);
    assert_int_equal(c.intermediate_size, 768);
    assert_int_equal(c.residual, LM_RES_BLOCK_ATTNRES);
    assert_int_equal(c.attnres_block_size, 4); /* 16 sublayers / 4 blocks */
    assert_int_equal(c.seq_len, 512);
    assert_int_equal(c.batch_size, 8);

    load_cfg(&c, "configs/tiny.json");
    assert_int_equal(c.num_hidden_layers, 5);
    /* every feature: both gates, rope and nope, a dense first layer, MoE with a
     * shared expert, Block AttnRes */
    assert_int_equal(c.kinds[0], LM_LAYER_KDA);
    assert_int_equal(c.gate[0], LM_GATE_BOUNDED);
    assert_int_equal(c.gate[1], LM_GATE_SOFTPLUS);
    assert_int_equal(c.kinds[2], LM_LAYER_ATTN);
    assert_int_equal(c.position[2], LM_POS_ROPE);
    assert_int_equal(c.position[4], LM_POS_NOPE);
    assert_int_equal(c.first_k_dense_replace, 1);
    assert_true(c.moe.n_shared_experts >= 1);
    assert_int_equal(c.residual, LM_RES_BLOCK_ATTNRES);
    assert_true(c.attnres_block_size < 2 * c.num_hidden_layers);
}

static void roundtrip_one(const char *path) {
    lm_model_config a, b;
    load_cfg(&a, path);
    char *s = lm_model_config_to_json(&a);
    assert_non_null(s);
    lm_error err = {0};
    char warn[512];
    assert_int_equal(lm_model_config_from_string(&b, s, "roundtrip", warn, sizeof warn, &err),
                     LM_OK);
    assert_string_equal(warn, "");
    assert_memory_equal(&a, &b, sizeof a);
    char *s2 = lm_model_config_to_json(&b);
    assert_string_equal(s, s2);
    free(s);
    free(s2);
}

static void test_roundtrip(void **state) {
    (void)state;
    roundtrip_one("configs/tiny.json");
    roundtrip_one("configs/bench-cpu.json");
    /* a non-default value of every float survives exactly */
    lm_model_config a, b;
    load_cfg(&a, "configs/tiny.json");
    a.lower_bound = -3.1f;
    a.rope_theta = 123457.7f;
    a.rms_norm_eps = 1.3e-5f;
    a.initializer_range = 0.0173f;
    a.moe.router.bias_update_rate = 3.3e-4f;
    a.seed = 987654321ULL;
    char *s = lm_model_config_to_json(&a);
    assert_int_equal(lm_model_config_from_string(&b, s, "rt2", NULL, 0, NULL), LM_OK);
    assert_memory_equal(&a, &b, sizeof a);
    free(s);
}

/* Apply `edit` to tiny.json's JSON, parse, and expect an error naming every
 * string of `want` (NULL-terminated). */
typedef void (*edit_fn)(cJSON *root);
static void expect_bad(edit_fn edit, const char *w1, const char *w2) {
    char *text = read_text("configs/tiny.json");
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    edit(root);
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    lm_model_config c;
    lm_error err = {0};
    lm_status st = lm_model_config_from_string(&c, s, "bad.json", NULL, 0, &err);
    free(s);
    if (st == LM_OK || !strstr(err.msg, w1) || (w2 && !strstr(err.msg, w2)))
        fprintf(stderr, "expected an error naming '%s' '%s', got %d: %s\n", w1, w2 ? w2 : "",
                (int)st, err.msg);
    assert_int_not_equal(st, LM_OK);
    assert_non_null(strstr(err.msg, w1));
    if (w2)
        assert_non_null(strstr(err.msg, w2));
    assert_non_null(strstr(err.msg, "bad.json"));
}

static cJSON *la(cJSON *r) { return cJSON_GetObjectItem(r, "linear_attn_config"); }
static void set_list(cJSON *o, const char *key, const int *v, int n) {
    cJSON_ReplaceItemInObject(o, key, cJSON_CreateIntArray(v, n));
}
static void e_no_vocab(cJSON *r) { cJSON_DeleteItemFromObject(r, "vocab_size"); }
static void e_both(cJSON *r) { set_list(la(r), "kda_layers", (int[]){1, 2, 3, 4}, 4); }
static void e_neither(cJSON *r) { set_list(la(r), "kda_layers", (int[]){1, 2}, 2); }
static void e_layer0(cJSON *r) { set_list(la(r), "kda_layers", (int[]){0, 1, 2, 4}, 4); }
static void e_layer_big(cJSON *r) { set_list(la(r), "full_attn_layers", (int[]){3, 6}, 2); }
static void e_kv(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "num_key_value_heads", cJSON_CreateNumber(3));
}
static void e_gate_len(cJSON *r) {
    cJSON_ReplaceItemInObject(la(r), "gate",
                              cJSON_CreateStringArray((const char *[]){"bounded", "softplus"}, 2));
}
static void e_gate_name(cJSON *r) {
    cJSON_ReplaceItemInObject(la(r), "gate", cJSON_CreateString("sigmoid"));
}
static void e_pos(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "position", cJSON_CreateString("alibi"));
}
static void e_pos_len(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "position", cJSON_CreateStringArray((const char *[]){"rope"}, 1));
}
static void e_topk(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "num_experts_per_tok", cJSON_CreateNumber(5));
}
static void e_balance(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "balance", cJSON_CreateString("magic"));
}
static void e_chunk(cJSON *r) {
    cJSON_ReplaceItemInObject(la(r), "chunk_size", cJSON_CreateNumber(48));
}
static void e_hidden_str(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "hidden_size", cJSON_CreateString("32"));
}
static void e_hidden_frac(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "hidden_size", cJSON_CreateNumber(32.5));
}
static void e_head_odd(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "head_dim", cJSON_CreateNumber(15));
}
static void e_dense(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "first_k_dense_replace", cJSON_CreateNumber(9));
}
static void e_residual(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "residual", cJSON_CreateString("highway"));
}
static void e_no_heads(cJSON *r) { cJSON_DeleteItemFromObject(la(r), "num_heads"); }
static void e_lower(cJSON *r) {
    cJSON_ReplaceItemInObject(la(r), "lower_bound", cJSON_CreateNumber(-7));
}
static void e_blk(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "attnres_block_size", cJSON_CreateNumber(0));
}
static void e_full_blk(cJSON *r) {
    cJSON_ReplaceItemInObject(r, "residual", cJSON_CreateString("full_attnres"));
}
static void e_no_topk(cJSON *r) { cJSON_DeleteItemFromObject(r, "num_experts_per_tok"); }
static void e_ngroup(cJSON *r) { cJSON_AddNumberToObject(r, "n_group", 3); }
static void e_no_la(cJSON *r) { cJSON_DeleteItemFromObject(r, "linear_attn_config"); }
/* a misspelt required key: the error names the missing key and the unknown one */
static void e_hiden(cJSON *r) {
    cJSON *v = cJSON_DetachItemFromObject(r, "hidden_size");
    cJSON_AddItemToObject(r, "hiden_size", v);
}
static void e_la_typo(cJSON *r) {
    cJSON *v = cJSON_DetachItemFromObject(la(r), "kda_layers");
    cJSON_AddItemToObject(la(r), "kda_layer", v);
}
static void e_eps(cJSON *r) { cJSON_ReplaceItemInObject(r, "rms_norm_eps", cJSON_CreateNumber(0)); }
static void e_inter(cJSON *r) { cJSON_DeleteItemFromObject(r, "intermediate_size"); }

static void test_bad_configs(void **state) {
    (void)state;
    expect_bad(e_no_vocab, "missing required key", "vocab_size");
    expect_bad(e_both, "layer 3", "both");
    expect_bad(e_neither, "layer 4", "neither");
    expect_bad(e_layer0, "kda_layers", "entry 0");
    expect_bad(e_layer_big, "full_attn_layers", "entry 6");
    expect_bad(e_kv, "num_key_value_heads = 3", "num_attention_heads = 2");
    expect_bad(e_gate_len, "linear_attn_config.gate", "2 entries");
    expect_bad(e_gate_name, "linear_attn_config.gate", "sigmoid");
    expect_bad(e_pos, "position", "alibi");
    expect_bad(e_pos_len, "position", "1 entries");
    expect_bad(e_topk, "num_experts_per_tok = 5", NULL);
    expect_bad(e_balance, "balance", "magic");
    expect_bad(e_chunk, "chunk_size = 48", NULL);
    expect_bad(e_hidden_str, "hidden_size", "\"32\"");
    expect_bad(e_hidden_frac, "hidden_size", "32.5");
    expect_bad(e_head_odd, "head_dim = 15", "rope");
    expect_bad(e_dense, "first_k_dense_replace = 9", NULL);
    expect_bad(e_residual, "residual", "highway");
    expect_bad(e_no_heads, "linear_attn_config.num_heads = 0", NULL);
    expect_bad(e_lower, "lower_bound = -7", NULL);
    expect_bad(e_blk, "attnres_block_size = 0", NULL);
    expect_bad(e_full_blk, "attnres_block_size = 4", "full_attnres");
    expect_bad(e_no_topk, "missing required key", "num_experts_per_tok");
    expect_bad(e_ngroup, "n_group", "3");
    expect_bad(e_no_la, "missing required key", "linear_attn_config");
    expect_bad(e_hiden, "missing required key 'hidden_size'", "unknown keys: hiden_size");
    expect_bad(e_la_typo, "missing required key", "unknown keys: linear_attn_config.kda_layer");
    expect_bad(e_eps, "rms_norm_eps = 0", NULL);
    expect_bad(e_inter, "intermediate_size = 0", NULL);

    /* not JSON / not an object */
    lm_model_config c;
    lm_error err = {0};
    assert_int_equal(lm_model_config_from_string(&c, "{\"vocab_size\": ", "x.json", NULL, 0, &err),
                     LM_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "x.json"));
    assert_int_equal(lm_model_config_from_string(&c, "[1]", "y.json", NULL, 0, &err),
                     LM_ERR_FORMAT);
    assert_int_equal(lm_model_config_load(&c, "/nonexistent/config.json", NULL, 0, &err),
                     LM_ERR_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/config.json"));

    /* unknown keys: a warning listing them, not an error */
    char *text = read_text("configs/tiny.json");
    cJSON *root = cJSON_Parse(text);
    free(text);
    cJSON_AddNumberToObject(root, "hiden_size", 3);
    cJSON_AddNumberToObject(la(root), "num_head", 3);
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    char warn[512];
    assert_int_equal(lm_model_config_from_string(&c, s, "typo.json", warn, sizeof warn, &err),
                     LM_OK);
    free(s);
    assert_non_null(strstr(warn, "typo.json"));
    assert_non_null(strstr(warn, "hiden_size"));
    assert_non_null(strstr(warn, "linear_attn_config.num_head"));

    /* n_routed_experts is an alias of num_experts */
    assert_int_equal(
        lm_model_config_from_string(
            &c,
            "{\"vocab_size\":10,\"hidden_size\":8,\"num_hidden_layers\":2,"
            "\"linear_attn_config\":{\"kda_layers\":[1,2],\"num_heads\":2,\"head_dim\":4},"
            "\"n_routed_experts\":6,\"num_experts_per_tok\":2,\"moe_intermediate_size\":4}",
            "alias", NULL, 0, &err),
        LM_OK);
    assert_int_equal(c.moe.router.num_experts, 6);
    assert_int_equal(c.kinds[1], LM_LAYER_KDA);
}

/* ---------------------------------------------------------------- parameter table */

static void test_param_table_bench(void **state) {
    (void)state;
    lm_model_config c;
    load_cfg(&c, "configs/bench-cpu.json");
    lm_params p;
    lm_error err = {0};
    assert_int_equal(lm_params_init(&p, &c, &err), LM_OK);
    int64_t total, active;
    lm_params_count(&p, &total, &active);

    /* Independent hand sum (d = 256, V = 257, KDA H*Dh = 4*64, W = 4; attention
     * 4 q / 2 kv heads x 64; dense I = 768; MoE E = 16, k = 2, f = 256, 1 shared). */
    const int64_t d = 256, V = 257;
    const int64_t kda = 3 * 256 * d         /* q k v */
                        + 3 * 256 * 4       /* convs */
                        + 64 * d + 256 * 64 /* f_a f_b */
                        + 4 + 256           /* A_log dt_bias */
                        + 4 * d             /* b_proj */
                        + 64 * d + 256 * 64 /* g_a g_b */
                        + 64                /* o_norm */
                        + d * 256;          /* o_proj */
    assert_int_equal(kda, 332100);
    const int64_t attn = 256 * d + 2 * (128 * d) + d * 256;
    assert_int_equal(attn, 196608);
    const int64_t dense = 3 * 768 * d;
    const int64_t routed = 3 * 16 * 256 * d, moe = 16 * d + routed + 3 * 256 * d;
    const int64_t attnres = 8 * 4 * d + 2 * d;
    const int64_t hand = V * d /* embed */ + 6 * kda + 2 * attn + 8 * 2 * d /* layer norms */ +
                         dense + 7 * moe + attnres + d /* final norm */ + V * d /* lm_head */;
    assert_int_equal(hand, 26545304);
    assert_int_equal(total, hand);
    const int64_t hand_active = hand - 7 * routed + 7 * routed * 2 / 16;
    assert_int_equal(hand_active, 7277720);
    assert_int_equal(active, hand_active);

    /* spot shapes and flags */
    const lm_param_info *e = lm_params_find(&p, "model.layers.1.mlp.experts.down_proj");
    assert_non_null(e);
    assert_int_equal(e->ndim, 3);
    assert_int_equal(e->shape[0], 16);
    assert_int_equal(e->shape[1], 256);
    assert_int_equal(e->shape[2], 256);
    assert_true(e->routed && e->decay && !e->buffer);
    e = lm_params_find(&p, "model.layers.3.self_attn.k_proj.weight");
    assert_non_null(e);
    assert_int_equal(e->shape[0], 128);
    e = lm_params_find(&p, "model.layers.2.mlp.gate.e_score_correction_bias");
    assert_true(e && e->buffer && !e->decay && e->numel == 16);
    e = lm_params_find(&p, "model.layers.0.self_attn.q_conv1d.weight");
    assert_true(e && e->shape[0] == 256 && e->shape[1] == 4);
    const char *nodecay[] = {"model.layers.0.self_attn.A_log",
                             "model.layers.0.self_attn.dt_bias",
                             "model.layers.0.self_attn.o_norm.weight",
                             "model.layers.5.attn_res.query",
                             "model.layers.5.mlp_res.norm.weight",
                             "model.attnres_final.query",
                             "model.norm.weight",
                             "model.layers.7.input_layernorm.weight"};
    for (size_t i = 0; i < sizeof nodecay / sizeof *nodecay; i++) {
        e = lm_params_find(&p, nodecay[i]);
        assert_non_null(e);
        assert_int_equal(e->decay, 0);
    }
    assert_null(lm_params_find(&p, "model.layers.0.mlp.gate.weight")); /* dense layer */
    assert_null(lm_params_find(&p, "model.layers.3.self_attn.A_log")); /* attention layer */
    assert_non_null(lm_params_find(&p, "lm_head.weight"));

    /* the table tiles the buffer: aligned, in order, no overlap, inside */
    int64_t sum = 0, buffers = 0;
    for (int i = 0; i < p.n; i++) {
        assert_int_equal(p.t[i].offset % 16, 0);
        if (i)
            assert_true(p.t[i].offset >= p.t[i - 1].offset + p.t[i - 1].numel);
        assert_true(p.t[i].offset + p.t[i].numel <= p.numel);
        sum += p.t[i].numel;
        if (p.t[i].buffer)
            buffers += p.t[i].numel;
        for (int j = 0; j < i; j++)
            assert_string_not_equal(p.t[i].name, p.t[j].name);
    }
    assert_int_equal(buffers, 7 * 16);
    assert_int_equal(sum, total + buffers);
    lm_params_free(&p);

    /* tied embeddings drop lm_head */
    c.tie_word_embeddings = 1;
    assert_int_equal(lm_params_init(&p, &c, &err), LM_OK);
    lm_params_count(&p, &total, NULL);
    assert_int_equal(total, hand - V * d);
    assert_null(lm_params_find(&p, "lm_head.weight"));
    lm_params_free(&p);
}

/* ---------------------------------------------------------------- init */

/* Expert-sharded tables (params.h lm_params_init_ep): each of P ranks holds its E/P
 * experts with the single-rank initialisation's values, the routed tensors behind the
 * replicated ones; full -> shards -> full is the identity; the counts are the whole
 * model's; a size that does not divide E and saving a shard are errors. */
static void test_expert_shards(void **state) {
    (void)state;
    lm_model_config c;
    load_cfg(&c, "configs/tiny.json");
    const int E = c.moe.router.num_experts;
    lm_error err = {0};
    lm_params full, back;
    assert_int_equal(lm_params_init(&full, &c, &err), LM_OK);
    assert_int_equal(lm_params_init(&back, &c, &err), LM_OK);
    lm_params_init_weights(&full, 11);
    lm_poison_f32(back.data, back.numel);
    int64_t t1, a1;
    lm_params_count(&full, &t1, &a1);
    for (int P = 2; P <= E; P *= 2) {
        if (E % P)
            continue;
        for (int r = 0; r < P; r++) {
            lm_params sp;
            assert_int_equal(lm_params_init_ep(&sp, &c, r, P, &err), LM_OK);
            assert_true(sp.numel < full.numel);
            lm_poison_f32(sp.data, sp.numel);
            lm_params_init_weights(&sp, 11);
            int seen_routed = 0;
            for (int i = 0; i < sp.n; i++) {
                const lm_param_info *e = &sp.t[i], *f = lm_params_find(&full, e->name);
                assert_non_null(f);
                seen_routed |= e->routed;
                assert_true(!seen_routed || e->routed); /* routed tensors last */
                assert_true(!e->routed || e->offset >= sp.expert_off);
                assert_int_equal(e->numel * (e->routed ? P : 1), f->numel);
                const int64_t o = e->routed ? (int64_t)r * e->numel : 0;
                assert_memory_equal(sp.data + e->offset, full.data + f->offset + o,
                                    (size_t)e->numel * 4);
            }
            assert_true(seen_routed);
            int64_t t2, a2;
            lm_params_count(&sp, &t2, &a2);
            assert_int_equal(t1, t2);
            assert_int_equal(a1, a2);
            float *tmp = malloc((size_t)sp.numel * 4);
            lm_params_full_to_shard(&full, full.data, &sp, r, tmp);
            for (int i = 0; i < sp.n; i++) /* the tensors (the padding is nobody's) */
                assert_memory_equal(tmp + sp.t[i].offset, sp.data + sp.t[i].offset,
                                    (size_t)sp.t[i].numel * 4);
            lm_params_shard_to_full(&sp, sp.data, r, r == 0, &back, back.data);
            free(tmp);
            if (r == 0) {
                assert_int_equal(lm_params_save(&sp, "/tmp/linmoe_no_such_ckpt", &err),
                                 LM_ERR_INVALID);
                assert_non_null(strstr(err.msg, "EP rank 0 of"));
            }
            lm_params_free(&sp);
        }
        for (int i = 0; i < full.n; i++)
            assert_memory_equal(back.data + back.t[i].offset, full.data + full.t[i].offset,
                                (size_t)full.t[i].numel * 4);
    }
    lm_params bad;
    assert_int_equal(lm_params_init_ep(&bad, &c, 0, E + 1, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "num_experts"));
    lm_params_free(&bad);
    lm_params_free(&full);
    lm_params_free(&back);
}

static void test_init(void **state) {
    (void)state;
    lm_model_config c;
    load_cfg(&c, "configs/tiny.json");
    lm_params a, b;
    lm_error err = {0};
    assert_int_equal(lm_params_init(&a, &c, &err), LM_OK);
    assert_int_equal(lm_params_init(&b, &c, &err), LM_OK);
    lm_poison_f32(a.data, a.numel);
    lm_params_init_weights(&a, 7);
    lm_params_init_weights(&b, 7);
    for (int i = 0; i < a.n; i++) /* every element written, same per seed */
        assert_memory_equal(a.data + a.t[i].offset, b.data + b.t[i].offset,
                            (size_t)a.t[i].numel * 4);
    lm_params_init_weights(&b, 8);
    const float *w7 = lm_params_get(&a, "model.layers.1.mlp.experts.up_proj");
    const float *w8 = lm_params_get(&b, "model.layers.1.mlp.experts.up_proj");
    assert_memory_not_equal(w7, w8, 64);

    for (int i = 0; i < a.n; i++) {
        const lm_param_info *e = &a.t[i];
        const float *x = a.data + e->offset;
        double s = 0, s2 = 0, mn = INFINITY, mx = -INFINITY;
        for (int64_t j = 0; j < e->numel; j++) {
            assert_true(isfinite(x[j]));
            s += x[j];
            s2 += (double)x[j] * x[j];
            mn = fmin(mn, x[j]);
            mx = fmax(mx, x[j]);
        }
        const double n = (double)e->numel;
        switch (e->init) {
        case LM_INIT_NORMAL:
            if (e->numel >= 4096) { /* std within 5% of initializer_range, mean ~0 */
                const double sd = sqrt(s2 / n);
                assert_true(fabs(sd - 0.02) < 0.001);
                assert_true(fabs(s / n) < 5 * 0.02 / sqrt(n));
            }
            break;
        case LM_INIT_ONES:
            assert_true(mn == 1.0 && mx == 1.0);
            break;
        case LM_INIT_ZEROS:
            assert_true(mn == 0.0 && mx == 0.0);
            break;
        case LM_INIT_CONV:
            assert_true(mn >= -0.5 && mx <= 0.5 && mx - mn > 0.5);
            break;
        case LM_INIT_A_LOG:
            if (e->gate == LM_GATE_SOFTPLUS)
                assert_true(mn >= 0.0 && mx <= log(16.0) + 1e-6 && mx > mn);
            else
                assert_true(mn == 0.0 && mx == 0.0);
            break;
        case LM_INIT_DT_BIAS:
            for (int64_t j = 0; j < e->numel; j++) { /* softplus(dt_bias) = dt in [1e-3, 1e-1] */
                const double dt = log1p(exp(x[j]));
                assert_true(dt >= 1e-3 * 0.999 && dt <= 1e-1 * 1.001);
            }
            break;
        }
    }
    /* tiny has a softplus layer (1) and a bounded one (0) */
    assert_int_equal(lm_params_find(&a, "model.layers.1.self_attn.A_log")->gate, LM_GATE_SOFTPLUS);
    assert_true(lm_params_get(&a, "model.layers.1.self_attn.A_log")[0] > 0.0f);
    assert_true(lm_params_get(&a, "model.layers.0.self_attn.A_log")[0] == 0.0f);
    lm_params_free(&a);
    lm_params_free(&b);
}

/* ---------------------------------------------------------------- checkpoints */

static void make_params(lm_params *p, uint64_t seed) {
    lm_model_config c;
    load_cfg(&c, "configs/tiny.json");
    lm_error err = {0};
    assert_int_equal(lm_params_init(p, &c, &err), LM_OK);
    lm_params_init_weights(p, seed);
    /* a non-zero buffer, so it is seen to travel */
    float *b = lm_params_get(p, "model.layers.2.mlp.gate.e_score_correction_bias");
    for (int e = 0; e < 4; e++)
        b[e] = 0.25f * (float)e - 0.3f;
}

static void assert_same(const lm_params *a, const lm_params *b) {
    assert_memory_equal(&a->cfg, &b->cfg, sizeof a->cfg);
    assert_int_equal(a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        assert_string_equal(a->t[i].name, b->t[i].name);
        assert_memory_equal(a->data + a->t[i].offset, b->data + b->t[i].offset,
                            (size_t)a->t[i].numel * 4);
    }
}

/* Write a copy of p's checkpoint into dir with tensor `drop` left out, tensor
 * `reshape` given a wrong shape, or `f64` stored as F64, or an extra tensor. */
static void write_variant(const lm_params *p, const char *dir, const char *drop,
                          const char *reshape, const char *f64, int extra) {
    mkdir(dir, 0755);
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(lm_model_config_save(&p->cfg, path, NULL), LM_OK);
    lm_st_writer w;
    lm_st_writer_init(&w);
    for (int i = 0; i < p->n; i++) {
        const lm_param_info *e = &p->t[i];
        if (drop && strcmp(e->name, drop) == 0)
            continue;
        int64_t sh[3] = {e->shape[0], e->shape[1], e->shape[2]};
        int nd = e->ndim;
        if (reshape && strcmp(e->name, reshape) == 0) {
            sh[0] = e->shape[1];
            sh[1] = e->shape[0];
            if (nd == 1) {
                sh[0] = 1;
                sh[1] = e->shape[0];
                nd = 2;
            }
        }
        if (f64 && strcmp(e->name, f64) == 0) {
            double *x = malloc((size_t)e->numel * 8);
            for (int64_t j = 0; j < e->numel; j++)
                x[j] = p->data[e->offset + j];
            assert_int_equal(lm_st_writer_add(&w, e->name, LM_F64, nd, sh, x, NULL), LM_OK);
            free(x);
        } else {
            assert_int_equal(
                lm_st_writer_add(&w, e->name, LM_F32, nd, sh, p->data + e->offset, NULL), LM_OK);
        }
    }
    if (extra) {
        const int64_t one = 1;
        const float v = 1.0f;
        assert_int_equal(lm_st_writer_add(&w, "model.layers.9.extra", LM_F32, 1, &one, &v, NULL),
                         LM_OK);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(lm_st_writer_save(&w, path, NULL), LM_OK);
    lm_st_writer_free(&w);
}

static void expect_load_fail(const char *dir, const char *w1, const char *w2) {
    lm_params q;
    lm_error err = {0};
    lm_status st = lm_params_load(&q, dir, &err);
    if (st == LM_OK || !strstr(err.msg, w1) || (w2 && !strstr(err.msg, w2)))
        fprintf(stderr, "expected a load error naming '%s' '%s', got %d: %s\n", w1, w2 ? w2 : "",
                (int)st, err.msg);
    assert_int_not_equal(st, LM_OK);
    assert_non_null(strstr(err.msg, w1));
    if (w2)
        assert_non_null(strstr(err.msg, w2));
    assert_null(q.data);
}

static void test_checkpoint(void **state) {
    (void)state;
    lm_params p, q;
    make_params(&p, 42);
    lm_error err = {0};
    char dir[128], v[160];
    snprintf(dir, sizeof dir, "%s/ckpt", g_dir);
    assert_int_equal(lm_params_save(&p, dir, &err), LM_OK);
    assert_int_equal(lm_params_load(&q, dir, &err), LM_OK);
    assert_same(&p, &q);
    lm_params_free(&q);

    /* overwrite with new weights: the new ones are there, no temp dirs left */
    lm_params p2;
    make_params(&p2, 43);
    assert_int_equal(lm_params_save(&p2, dir, &err), LM_OK);
    assert_int_equal(lm_params_load(&q, dir, &err), LM_OK);
    assert_same(&p2, &q);
    lm_params_free(&q);
    snprintf(v, sizeof v, "%s.tmp.%ld", dir, (long)getpid());
    struct stat sb;
    assert_int_not_equal(stat(v, &sb), 0);
    snprintf(v, sizeof v, "%s.old.%ld", dir, (long)getpid());
    assert_int_not_equal(stat(v, &sb), 0);

    /* a failing save (its temp dir is blocked) leaves the good checkpoint intact */
    snprintf(v, sizeof v, "%s.tmp.%ld", dir, (long)getpid());
    assert_int_equal(mkdir(v, 0755), 0);
    char blocker[200];
    snprintf(blocker, sizeof blocker, "%s/blocker", v);
    FILE *f = fopen(blocker, "w");
    fputs("x", f);
    fclose(f);
    assert_int_not_equal(lm_params_save(&p, dir, &err), LM_OK);
    assert_non_null(strstr(err.msg, dir));
    assert_int_equal(lm_params_load(&q, dir, &err), LM_OK);
    assert_same(&p2, &q);
    lm_params_free(&q);
    unlink(blocker);
    rmdir(v);

    /* load rejections name the file and the tensor */
    snprintf(v, sizeof v, "%s/missing", g_dir);
    write_variant(&p, v, "model.layers.3.self_attn.dt_bias", NULL, NULL, 0);
    expect_load_fail(v, "missing tensor", "model.layers.3.self_attn.dt_bias");
    snprintf(v, sizeof v, "%s/shape", g_dir);
    write_variant(&p, v, NULL, "model.layers.2.self_attn.k_proj.weight", NULL, 0);
    expect_load_fail(v, "model.layers.2.self_attn.k_proj.weight", "shape [32,16]");
    snprintf(v, sizeof v, "%s/dtype", g_dir);
    write_variant(&p, v, NULL, NULL, "model.norm.weight", 0);
    expect_load_fail(v, "model.norm.weight", "F64");
    snprintf(v, sizeof v, "%s/extra", g_dir);
    write_variant(&p, v, NULL, NULL, NULL, 1);
    expect_load_fail(v, "unexpected tensor", "model.layers.9.extra");

    /* a truncated / corrupted model.safetensors */
    snprintf(v, sizeof v, "%s/trunc", g_dir);
    write_variant(&p, v, NULL, NULL, NULL, 0);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", v);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(truncate(path, sb.st_size - 100), 0);
    expect_load_fail(v, path, NULL);
    f = fopen(path, "r+b"); /* garbage header length */
    fputs("\xff\xff\xff\xff\xff\xff\xff\x7f", f);
    fclose(f);
    expect_load_fail(v, path, NULL);

    /* config.json that disagrees with the weights (hidden_size) names the tensor */
    snprintf(v, sizeof v, "%s/cfgdiff", g_dir);
    write_variant(&p, v, NULL, NULL, NULL, 0);
    lm_model_config c2 = p.cfg;
    c2.moe.moe_intermediate_size = 8;
    snprintf(path, sizeof path, "%s/config.json", v);
    assert_int_equal(lm_model_config_save(&c2, path, NULL), LM_OK);
    expect_load_fail(v, "model.layers.1.mlp.experts.gate_proj", "shape");
    snprintf(v, sizeof v, "%s/nodir", g_dir);
    expect_load_fail(v, "config.json", NULL);

    lm_params_free(&p);
    lm_params_free(&p2);
}

/* ---------------------------------------------------------------- CLI */

static void test_cli_info(void **state) {
    (void)state;
    static char out[1 << 16];
    assert_int_equal(lm_run_cli(out, sizeof out, "info --config configs/bench-cpu.json"), 0);
    assert_non_null(strstr(out, "total 26545304"));
    assert_non_null(strstr(out, "active per token 7277720"));
    assert_non_null(strstr(out, "model.layers.7.mlp.experts.down_proj"));
    assert_non_null(strstr(out, "[16, 256, 256]"));
    /* layers numbered from 1, as in the config's kda_layers [1, 2, 3, 5, 6, 7] (issue 25) */
    assert_non_null(strstr(out, "layers (numbered from 1, as in linear_attn_config): 1:kda-"));
    assert_non_null(strstr(out, " 4:attn-rope/moe 5:kda-"));
    assert_non_null(strstr(out, " 8:attn-rope/moe\n"));
    lm_params p;
    make_params(&p, 5);
    char dir[128];
    snprintf(dir, sizeof dir, "%s/cli", g_dir);
    assert_int_equal(lm_params_save(&p, dir, NULL), LM_OK);
    lm_params_free(&p);
    assert_int_equal(lm_run_cli(out, sizeof out, "info %s", dir), 0);
    assert_non_null(strstr(out, "total 80950"));
    assert_non_null(strstr(out, "model.layers.4.mlp_res.norm.weight"));
    assert_int_equal(lm_run_cli(out, sizeof out, "info %s/none", g_dir), 1);
    assert_non_null(strstr(out, "none: no such checkpoint or run directory"));
    assert_int_equal(lm_run_cli(out, sizeof out, "info"), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "info --bogus"), 2);
    assert_int_equal(lm_run_cli(out, sizeof out, "info --help"), 0);
    assert_int_equal(lm_run_cli(out, sizeof out, "help info"), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_configs), cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_bad_configs),   cmocka_unit_test(test_param_table_bench),
        cmocka_unit_test(test_init),          cmocka_unit_test(test_checkpoint),
        cmocka_unit_test(test_expert_shards), cmocka_unit_test(test_cli_info),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
