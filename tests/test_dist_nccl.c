/* The NCCL communicator (include/linmoe/dist_nccl.h) on world size 1 (one process, the
 * self host communicator: the ncclUniqueId made by rank 0 and "broadcast" to itself):
 *  - test_world1: all-reduce (sum, max), reduce-scatter, all-gather (in place),
 *    all-to-all-v to itself, broadcast, on device buffers, values checked on the host;
 *    the statistics, marks and stream ordering;
 *  - test_train_world1: the GPU trainer's NCCL path (train.h options.dist_nccl: the
 *    gradient all-reduced in per-layer buckets on the communicator's stream, overlapped
 *    with the backward, the MoE accumulators all-reduced before the bias update) on
 *    configs/tiny-train.json (two stages, passkey rows, KDA + attention, Block AttnRes,
 *    aux-free MoE) against the plain GPU run: one rank's all-reduce is a copy, so every
 *    step's loss and grad norm and the checkpoint files must be bit-identical; and a
 *    plain run resumed through the NCCL path must give the same files too.
 * Exit 77 (skipped) without NCCL in the build or without a CUDA device. LM_TEST_FILTER
 * selects tests (cmocka's pattern). The multi-GPU paths are not tested (no machine with
 * several GPUs). */
#include "test_util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "linmoe/dist_nccl.h"
#include "linmoe/shard.h"
#include "linmoe/train.h"

#ifdef LM_HAVE_NCCL
#include <cuda_runtime.h>

static void test_world1(void **state) {
    (void)state;
    lm_error err;
    lm_comm *host;
    assert_int_equal(lm_comm_self_new(&host, &err), LM_OK);
    lm_nccl_comm *c = NULL;
    const lm_status st = lm_nccl_comm_new(&c, host, 0, &err);
    if (st != LM_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(lm_nccl_comm_size(c), 1);
    enum { N = 1000 };
    float h[N], back[N];
    for (int i = 0; i < N; i++)
        h[i] = (float)(i % 97) * 0.25f - 3.0f;
    float *d = NULL, *d2 = NULL;
    assert_int_equal(cudaMalloc((void **)&d, sizeof h), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&d2, sizeof h), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(lm_nccl_allreduce(c, d, N, LM_F32, LM_DIST_SUM, &err), LM_OK);
    assert_int_equal(lm_nccl_allreduce(c, d, N, LM_F32, LM_DIST_MAX, &err), LM_OK);
    assert_int_equal(lm_nccl_reduce_scatter(c, d, d2, N, LM_F32, &err), LM_OK);
    assert_int_equal(lm_nccl_allgather(c, d2, d2, N, LM_F32, &err), LM_OK);
    assert_int_equal(lm_nccl_broadcast(c, d2, N, LM_F32, 0, &err), LM_OK);
    const int64_t cnt = N;
    assert_int_equal(cudaMemset(d, 0, sizeof h), cudaSuccess);
    assert_int_equal(lm_nccl_sync(c, &err), LM_OK); /* the memset is on the default stream */
    assert_int_equal(lm_nccl_alltoallv(c, d2, &cnt, d, &cnt, LM_F32, &err), LM_OK);
    assert_int_equal(lm_nccl_sync(c, &err), LM_OK);
    assert_int_equal(cudaMemcpy(back, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_memory_equal(back, h, sizeof h); /* one rank: every collective is the identity */
    assert_int_equal(lm_nccl_allreduce(c, d, N, (lm_dtype)LM_DTYPE_COUNT, LM_DIST_SUM, &err),
                     LM_ERR_INVALID);
    /* statistics: the six collectives above, counted and timed per kind */
    lm_comm_stats cs;
    assert_int_equal(lm_nccl_get_stats(c, &cs, &err), LM_OK);
    assert_int_equal(cs.calls[LM_COLL_ALLREDUCE], 2);
    assert_int_equal(cs.bytes[LM_COLL_ALLREDUCE], 2 * (int64_t)sizeof h);
    assert_int_equal(cs.calls[LM_COLL_REDUCE_SCATTER], 1);
    assert_int_equal(cs.calls[LM_COLL_ALLGATHER], 1);
    assert_int_equal(cs.calls[LM_COLL_BROADCAST], 1);
    assert_int_equal(cs.calls[LM_COLL_ALLTOALLV], 1);
    assert_int_equal(cs.bytes[LM_COLL_ALLTOALLV], (int64_t)sizeof h);
    for (int k = 0; k < LM_COLL_N; k++)
        assert_true(cs.seconds[k] >= 0);
    lm_nccl_reset_stats(c);
    assert_int_equal(lm_nccl_get_stats(c, &cs, &err), LM_OK);
    assert_int_equal(cs.calls[LM_COLL_ALLREDUCE], 0);
    /* ordering with another stream: a value written there, all-reduced here after
     * wait_for, read back there after join (no host synchronisation in between) */
    cudaStream_t s2;
    assert_int_equal(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMemsetAsync(d, 0, sizeof h, s2), cudaSuccess);
    assert_int_equal(cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, s2), cudaSuccess);
    assert_int_equal(lm_nccl_mark(c, 0, s2, &err), LM_OK);
    assert_int_equal(lm_nccl_wait_for(c, s2, &err), LM_OK);
    assert_int_equal(lm_nccl_allreduce(c, d, N, LM_F32, LM_DIST_SUM, &err), LM_OK);
    assert_int_equal(lm_nccl_mark(c, 1, NULL, &err), LM_OK);
    assert_int_equal(lm_nccl_join(c, s2, &err), LM_OK);
    memset(back, 0, sizeof back);
    assert_int_equal(cudaMemcpyAsync(back, d, sizeof h, cudaMemcpyDeviceToHost, s2), cudaSuccess);
    assert_int_equal(cudaStreamSynchronize(s2), cudaSuccess);
    assert_memory_equal(back, h, sizeof h);
    double ms = -1;
    assert_int_equal(lm_nccl_mark_ms(c, 0, 1, &ms, &err), LM_OK);
    assert_true(ms >= 0);
    assert_int_equal(lm_nccl_mark_ms(c, 0, 2, &ms, &err), LM_ERR_INVALID); /* never recorded */
    assert_int_equal(lm_nccl_mark(c, LM_NCCL_MARKS, NULL, &err), LM_ERR_INVALID);
    cudaStreamDestroy(s2);
    cudaFree(d);
    cudaFree(d2);
    lm_nccl_comm_free(c);
    lm_comm_free(host);
}

/* ---------------------------------------------------------------- the trainer */

static char g_dir[64];
static char g_cfg[128];
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

/* ndocs documents of byte tokens drawn from a small word list (the model learns
 * something), each ended by <|endoftext|> = 256 */
static void write_shard(const char *path, int ndocs) {
    static const char *const words[] = {"one",   "two",  "three", "four", "five",  "six",  "seven",
                                        "eight", "nine", "ten",   "red",  "green", "blue", "and"};
    const int nw = (int)(sizeof words / sizeof words[0]);
    int64_t n = 0, cap = (int64_t)ndocs * 1700;
    int32_t *t = malloc(sizeof(int32_t) * (size_t)cap);
    assert_non_null(t);
    for (int d = 0; d < ndocs; d++) {
        const int64_t len = 200 + rnd() % 1400, start = n;
        int w = (int)(rnd() % nw);
        while (n - start < len) {
            for (const char *q = words[w]; *q; q++)
                t[n++] = (unsigned char)*q;
            t[n++] = rnd() % 8 == 0 ? '\n' : ' ';
            w = rnd() % 3 == 0 ? (int)(rnd() % nw) : (w + 1) % nw;
        }
        t[n++] = 256;
    }
    lm_error err = {0};
    const lm_status st = lm_shard_write(path, 257, t, (uint64_t)n, &err);
    if (st != LM_OK)
        fail_msg("%s", err.msg);
    free(t);
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    const size_t got = fread(b, 1, (size_t)n, f);
    fclose(f);
    b[got] = '\0';
    if (len)
        *len = got;
    return b;
}

/* configs/tiny-train.json with the test's data, 6 + 4 steps, a checkpoint every 5,
 * small evals (one at the end of each stage) */
static int train_setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/linmoe-nccl-XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    char tr[128], va[128];
    snprintf(tr, sizeof tr, "%s/train.bin", g_dir);
    snprintf(va, sizeof va, "%s/val.bin", g_dir);
    write_shard(tr, 60);
    write_shard(va, 10);
    char *text = slurp("configs/tiny-train.json", NULL);
    if (!text)
        return -1;
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j)
        return -1;
    cJSON *data = cJSON_GetObjectItem(j, "data");
    cJSON_ReplaceItemInObject(data, "train", cJSON_CreateString(tr));
    cJSON_ReplaceItemInObject(data, "val", cJSON_CreateString(va));
    cJSON *t = cJSON_GetObjectItem(j, "train");
    cJSON_ReplaceItemInObject(t, "checkpoint_every", cJSON_CreateNumber(5));
    cJSON_ReplaceItemInObject(t, "keep_last", cJSON_CreateNumber(3));
    cJSON *st = cJSON_GetObjectItem(j, "stages");
    cJSON_ReplaceItemInObject(cJSON_GetArrayItem(st, 0), "tokens", cJSON_CreateNumber(6 * 1024));
    cJSON_ReplaceItemInObject(cJSON_GetArrayItem(st, 1), "tokens", cJSON_CreateNumber(4 * 1024));
    cJSON *ev = cJSON_GetObjectItem(j, "eval");
    cJSON_ReplaceItemInObject(ev, "passkey_samples", cJSON_CreateNumber(2));
    cJSON_ReplaceItemInObject(ev, "max_val_tokens", cJSON_CreateNumber(2000));
    char *out = cJSON_Print(j);
    cJSON_Delete(j);
    snprintf(g_cfg, sizeof g_cfg, "%s/cfg.json", g_dir);
    FILE *f = fopen(g_cfg, "wb");
    if (!f)
        return -1;
    fputs(out, f);
    fclose(f);
    free(out);
    return 0;
}

static int train_teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* One lm_train_run on cuda:0 into g_dir/run (nccl: options.dist_nccl with bucket_bytes). */
static void train_gpu(const char *run, int nccl, int64_t bucket_bytes, int resume,
                      int64_t max_steps) {
    lm_error err = {0};
    lm_train_config c;
    memset(&c, 0, sizeof c);
    if (!resume && lm_train_config_load(&c, g_cfg, &err) != LM_OK)
        fail_msg("%s", err.msg);
    lm_train_options o;
    lm_train_options_default(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, run);
    o.run_dir = dir;
    o.resume = resume;
    o.max_steps = max_steps;
    o.quiet = 1;
    o.device.type = LM_DEVICE_CUDA;
    o.device.index = 0;
    o.dist_nccl = nccl;
    o.bucket_bytes = bucket_bytes;
    lm_train_summary s;
    const lm_status st = lm_train_run(resume ? NULL : &c, &o, &s, &err);
    if (!resume)
        lm_train_config_free(&c);
    if (st != LM_OK)
        fail_msg("%s: %s", run, err.msg);
}

/* The "loss" and "grad_norm" of every line of run/log.jsonl (printed with 17 and 9
 * digits: equal text is equal values), and the NCCL fields of the first line that has
 * them. */
typedef struct {
    int n;
    double loss[32], gnorm[32];
    int has_nccl, buckets;
    double allreduce_calls, allreduce_bytes, reduce_ms, overlapped_ms, exposed_ms;
} run_log;

static void read_log(const char *run, run_log *r) {
    memset(r, 0, sizeof *r);
    char path[256];
    snprintf(path, sizeof path, "%s/%s/log.jsonl", g_dir, run);
    char *text = slurp(path, NULL);
    assert_non_null(text);
    for (char *line = text, *nl; *line && r->n < 32; line = nl + 1) {
        nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        r->loss[r->n] = cJSON_GetObjectItem(j, "loss")->valuedouble;
        r->gnorm[r->n] = cJSON_GetObjectItem(j, "grad_norm")->valuedouble;
        const cJSON *nc = cJSON_GetObjectItem(j, "nccl");
        if (nc && !r->has_nccl) {
            r->has_nccl = 1;
            const cJSON *ar = cJSON_GetObjectItem(nc, "allreduce");
            assert_non_null(ar);
            r->allreduce_calls = cJSON_GetObjectItem(ar, "calls")->valuedouble;
            r->allreduce_bytes = cJSON_GetObjectItem(ar, "bytes")->valuedouble;
            const cJSON *ov = cJSON_GetObjectItem(j, "overlap");
            assert_non_null(ov);
            r->buckets = cJSON_GetObjectItem(ov, "buckets")->valueint;
            r->reduce_ms = cJSON_GetObjectItem(ov, "reduce_ms")->valuedouble;
            r->overlapped_ms = cJSON_GetObjectItem(ov, "overlapped_ms")->valuedouble;
            r->exposed_ms = cJSON_GetObjectItem(ov, "exposed_ms")->valuedouble;
        }
        r->n++;
        cJSON_Delete(j);
        if (!nl)
            break;
    }
    free(text);
}

static void assert_same_file(const char *a, const char *b, const char *rel) {
    char pa[256], pb[256];
    snprintf(pa, sizeof pa, "%s/%s/%s", g_dir, a, rel);
    snprintf(pb, sizeof pb, "%s/%s/%s", g_dir, b, rel);
    size_t na = 0, nb = 0;
    char *x = slurp(pa, &na), *y = slurp(pb, &nb);
    if (!x || !y)
        fail_msg("missing %s or %s", pa, pb);
    if (na != nb || memcmp(x, y, na) != 0)
        fail_msg("%s and %s differ (%zu vs %zu bytes)", pa, pb, na, nb);
    free(x);
    free(y);
}

static void test_train_world1(void **state) {
    (void)state;
    train_gpu("plain", 0, 0, 0, 0);
    train_gpu("nccl", 1, 1, 0, 0); /* bucket_bytes 1: every layer its own bucket */
    train_gpu("resumed", 0, 0, 0, 5);
    train_gpu("resumed", 1, 0, 1, 0); /* the default buckets: one for this small model */
    run_log p, n, r;
    read_log("plain", &p);
    read_log("nccl", &n);
    read_log("resumed", &r);
    assert_int_equal(p.n, 10);
    assert_int_equal(n.n, 10);
    assert_int_equal(r.n, 10);
    for (int i = 0; i < p.n; i++) {
        if (memcmp(&p.loss[i], &n.loss[i], sizeof(double)) ||
            memcmp(&p.gnorm[i], &n.gnorm[i], sizeof(double)) ||
            memcmp(&p.loss[i], &r.loss[i], sizeof(double)) ||
            memcmp(&p.gnorm[i], &r.gnorm[i], sizeof(double)))
            fail_msg("step %d: loss %.17g / %.17g / %.17g, grad norm %.9g / %.9g / %.9g (plain / "
                     "nccl / resumed through nccl)",
                     i + 1, p.loss[i], n.loss[i], r.loss[i], p.gnorm[i], n.gnorm[i], r.gnorm[i]);
        assert_true(isfinite(p.loss[i]));
    }
    /* the NCCL fields: tail + 5 layers + embedding buckets, plus one all-reduce of the
     * step accumulators per MoE layer (4); the plain run has none */
    assert_false(p.has_nccl);
    assert_true(n.has_nccl);
    printf("nccl path, step 1: %d buckets, %.0f all-reduces of %.0f bytes, reduction %.4f ms "
           "(%.4f ms before the backward's end, %.4f ms after)\n",
           n.buckets, n.allreduce_calls, n.allreduce_bytes, n.reduce_ms, n.overlapped_ms,
           n.exposed_ms);
    assert_int_equal(n.buckets, 7);
    assert_true(n.allreduce_calls == 7 + 4);
    assert_true(n.reduce_ms >= 0 && n.overlapped_ms >= 0 && n.exposed_ms >= 0);
    assert_true(n.overlapped_ms + n.exposed_ms <= n.reduce_ms * (1 + 1e-6) + 1e-6);
    assert_true(r.has_nccl);
    assert_int_equal(r.buckets, 1); /* the resumed part's first line (step 6) */
    /* the weights, moments, router states and loader state of both checkpoints */
    static const char *const files[5] = {
        "ckpt/step-0000005/model.safetensors", "ckpt/step-0000005/train_state.safetensors",
        "ckpt/step-0000010/model.safetensors", "ckpt/step-0000010/train_state.safetensors",
        "evals.jsonl"};
    for (int k = 0; k < 5; k++) {
        assert_same_file("plain", "nccl", files[k]);
        assert_same_file("plain", "resumed", files[k]);
    }
}
#endif

int main(void) {
#ifndef LM_HAVE_NCCL
    lm_error err;
    lm_nccl_comm *c = NULL;
    if (lm_nccl_comm_new(&c, NULL, 0, &err) != LM_ERR_UNSUPPORTED || lm_dist_have_nccl() != 0)
        return 1;
    printf("SKIPPED: this build has no NCCL (CUDA + NCCL at configure time)\n");
    return 77;
#else
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    const struct CMUnitTest t[] = {
        cmocka_unit_test(test_world1),
        cmocka_unit_test_setup_teardown(test_train_world1, train_setup, train_teardown),
    };
    const char *filter = getenv("LM_TEST_FILTER");
    if (filter && *filter)
        cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(t, NULL, NULL);
#endif
}
