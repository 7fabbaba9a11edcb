/* `linmoe bench kda --device cuda`: the CUDA KDA entry points (include/linmoe/kda_cuda.h)
 * against the GPU's limits measured in the same run (include/linmoe/cuda_bench.h):
 * the cuBLAS bf16 GEMM rate (8192^3, fp32 accumulation) and the device-to-device
 * copy bandwidth (2 GiB cudaMemcpy, bytes read + written).
 *
 * Shapes (B, T, H = HV, K = V): (1,8192,64,128), (8,4096,16,128), (1,32768,16,128),
 * all 524,288 token-heads (docs/perf-notes.md "KDA forward on the GPU"). KDA with the
 * gate, q/k L2 normalisation and the beta sigmoid fused in the op (fla's flags), for
 * the BOUNDED gate (lower_bound -5) and the SOFTPLUS gate. Rows per shape and gate:
 *   fwd       inference forward        lm_kda_cuda_chunk_forward
 *   trainfwd  training forward         lm_kda_cuda_forward_train (+ saved_free)
 *   fwdbwd    training forward + backward with random do and dht (+ saved_free)
 * and one decode row: lm_kda_cuda_decode_step at B = 64, H = HV = 32, K = V = 128,
 * bounded gate, against the copy bandwidth (state traffic 2*B*HV*K*V*4 bytes per step).
 * An entry point that answers LM_ERR_UNSUPPORTED is printed as "not built" (null in
 * the JSON, "status": "not built") and the run goes on.
 *
 * Inputs, generated on the device with a counter-based hash (lm_cuda_fill_normal_*),
 * bf16: q, k, v, g (the raw gate input), beta (raw, before the sigmoid), do ~ N(0,1);
 * fp32: dht ~ N(0,1), A_log = log U(1,16) and dt_bias = softplus^-1(dt) with dt
 * log-uniform in [1e-3, 1e-1] (fla's initialisation, as bench/bench_kda.c), made on
 * the host (HV and HV*K values) and uploaded.
 *
 * Timing: CUDA events around `calls` back-to-back calls (enough calls for ~50 ms, 10
 * ms with --quick; the entry points are asynchronous on the context's stream, so the
 * calls queue back to back), the time of one call is elapsed / calls; median of 10
 * repeats (3 with --quick) after warm-up. Outputs are checked for NaN / Inf after each
 * row. Everything runs on one context (lm_cuda_ctx on cuda:0, its own stream); the
 * LINMOE_KDA_CUDA_BV / WGMMA / PDL / TMA / PROFILE environment variables set its kda.*
 * options (the library itself reads no environment).
 *
 * Counts (pinned; every shape here has K = V = 128 and 64-token chunks):
 *   FLOP per token-head: forward 137e3 (docs/perf-notes.md "KDA forward on the GPU":
 *   Aqk + Akk 16k, the inverse 1.4k, w and u 16k, the inter-chunk work 104k);
 *   backward 2 x forward = 274e3 (recompute not counted); fwd+bwd 411e3; decode step
 *   7*K*V (bench/bench_kda.c's recurrent count).
 *   Bytes (each tensor read or written once, the minimum traffic):
 *   forward  q, k, v, g read, o written: 5*B*T*H*128*2, beta B*T*H*2, final state
 *            B*H*K*V*4;
 *   backward q, k, v, g, do read, dq, dk, dv, dg written: 9*B*T*H*128*2, beta and
 *            dbeta 2*B*T*H*2, dht B*H*K*V*4 (fwd+bwd = forward + backward);
 *   decode   the state read and written: 2*B*HV*K*V*4 (q, k, v, g, o are < 2%).
 * ratio_to_limit = max(FLOP / matmul rate, bytes / copy bandwidth) / measured time.
 * ratio_to_peer is null: the peers (fla's chunk_kda, FlashKDA) are Python and are
 * measured beside linmoe in one process by scripts/gpu/bench_kda.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/cuda_bench.h"
#include "linmoe/kda_cuda.h"

enum { MODE_FWD = 0, MODE_TRAINFWD = 1, MODE_FWDBWD = 2, N_MODES = 3, MODE_DECODE = 3 };
enum { GATE_BOUNDED = 0, GATE_SOFTPLUS = 1, N_GATES = 2 };
static const char *const k_mode_names[N_MODES] = {"fwd", "trainfwd", "fwdbwd"};
static const char *const k_gate_names[N_GATES] = {"bounded", "softplus"};

#define FLOP_FWD_PER_TOKEN_HEAD 137e3 /* K = V = 128, docs/perf-notes.md */
#define FLOP_BWD_PER_TOKEN_HEAD (2 * FLOP_FWD_PER_TOKEN_HEAD)

typedef struct {
    int B, T, H, D;
} kc_shape;

static const kc_shape k_shapes[] = {{1, 8192, 64, 128}, {8, 4096, 16, 128}, {1, 32768, 16, 128}};
#define N_SHAPES ((int)(sizeof(k_shapes) / sizeof(k_shapes[0])))
static const kc_shape k_decode = {64, 1, 32, 128};

/* ---------------------------------------------------------------- device buffers */

enum {
    BUF_Q,
    BUF_K,
    BUF_V,
    BUF_G,
    BUF_BETA,
    BUF_O,
    BUF_DO,
    BUF_DQ,
    BUF_DK,
    BUF_DV,
    BUF_DG,
    BUF_DBETA,
    BUF_ALOG,
    BUF_DTB,
    BUF_HT,
    BUF_DHT,
    BUF_DALOG,
    BUF_DDTB,
    N_BUFS
};

/* One device allocation per shape, carved by a size table (256-byte aligned views). */
typedef struct {
    void *base;
    void *p[N_BUFS];
    int64_t n[N_BUFS]; /* elements */
} kc_bufs;

static void bufs_free(lm_cuda_ctx *ctx, kc_bufs *b) {
    lm_cuda_ctx_free_mem(ctx, b->base);
    memset(b, 0, sizeof(*b));
}

/* Allocate and fill every buffer of shape s (K = V = D, H = HV). */
static lm_status bufs_init(lm_cuda_ctx *ctx, kc_bufs *b, const kc_shape *s, uint64_t seed,
                           lm_error *err) {
    memset(b, 0, sizeof(*b));
    const int64_t B = s->B, T = s->T, H = s->H, D = s->D;
    const int64_t big = B * T * H * D, bt = B * T * H, st = B * H * D * D;
    const int64_t n[N_BUFS] = {big, big, big, big, bt,    big, big, big, big,
                               big, big, bt,  H,   H * D, st,  st,  H,   H * D};
    /* bf16 up to BUF_DBETA, fp32 from BUF_ALOG on */
    size_t off[N_BUFS], total = 0;
    for (int i = 0; i < N_BUFS; i++) {
        const size_t esz = i >= BUF_ALOG ? 4 : 2;
        off[i] = total;
        total += ((size_t)n[i] * esz + 255) & ~(size_t)255;
        b->n[i] = n[i];
    }
    lm_status rc = lm_cuda_ctx_alloc(ctx, &b->base, total, err);
    if (rc != LM_OK)
        return rc;
    for (int i = 0; i < N_BUFS; i++)
        b->p[i] = (char *)b->base + off[i];

    /* N(0,1) inputs and upstream gradients on the device; outputs poisoned with 0 */
    static const int normal_bf16[] = {BUF_Q, BUF_K, BUF_V, BUF_G, BUF_BETA, BUF_DO};
    for (int j = 0; j < (int)(sizeof(normal_bf16) / sizeof(normal_bf16[0])); j++) {
        const int i = normal_bf16[j];
        if ((rc = lm_cuda_fill_normal_bf16(ctx, b->p[i], n[i], seed * 64 + (uint64_t)i, 0.0f, 1.0f,
                                           err)) != LM_OK)
            goto fail;
    }
    if ((rc = lm_cuda_fill_normal_f32(ctx, (float *)b->p[BUF_DHT], n[BUF_DHT], seed * 64 + BUF_DHT,
                                      0.0f, 1.0f, err)) != LM_OK)
        goto fail;
    /* A_log, dt_bias: few values, made here as in bench/bench_kda.c */
    float *h = (float *)malloc(sizeof(float) * (size_t)(H + H * D));
    if (!h) {
        rc = lm_errorf(err, LM_ERR_NOMEM, "bench kda cuda: out of host memory");
        goto fail;
    }
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int64_t i = 0; i < H; i++)
        h[i] = (float)log(1.0 + 15.0 * lm_rng_uniform(&r));
    for (int64_t i = 0; i < H * D; i++) {
        double dt = exp(log(1e-3) + (log(1e-1) - log(1e-3)) * lm_rng_uniform(&r));
        if (dt < 1e-4)
            dt = 1e-4;
        h[H + i] = (float)(dt + log(-expm1(-dt))); /* softplus^-1(dt) */
    }
    rc = lm_cuda_ctx_upload(ctx, b->p[BUF_ALOG], h, sizeof(float) * (size_t)H, err);
    if (rc == LM_OK)
        rc = lm_cuda_ctx_upload(ctx, b->p[BUF_DTB], h + H, sizeof(float) * (size_t)(H * D), err);
    free(h);
    if (rc != LM_OK)
        goto fail;
    return LM_OK;
fail:
    bufs_free(ctx, b);
    return rc;
}

/* ---------------------------------------------------------------- one case */

typedef struct {
    lm_cuda_ctx *ctx;
    int mode;
    lm_kda_config c;
    lm_kda_cuda_inputs in;
    lm_kda_cuda_outputs out;
    lm_kda_cuda_grads gr;
} kc_case;

static void case_init(kc_case *kc, lm_cuda_ctx *ctx, const kc_bufs *b, const kc_shape *s, int gate,
                      int mode) {
    memset(kc, 0, sizeof(*kc));
    kc->ctx = ctx;
    kc->mode = mode;
    lm_kda_config_default(&kc->c, s->B, s->T, s->H, s->H, s->D, s->D);
    kc->c.kind = LM_KDA;
    kc->c.use_qk_l2norm_in_kernel = 1;
    kc->c.use_beta_sigmoid_in_kernel = 1;
    kc->c.trusted_state = 1;
    if (gate == GATE_BOUNDED) {
        kc->c.gate = LM_GATE_BOUNDED;
        kc->c.has_lower_bound = 1;
        kc->c.lower_bound = -5.0f;
    } else {
        kc->c.gate = LM_GATE_SOFTPLUS;
    }
    kc->in.q = b->p[BUF_Q];
    kc->in.k = b->p[BUF_K];
    kc->in.v = b->p[BUF_V];
    kc->in.g = b->p[BUF_G];
    kc->in.beta = b->p[BUF_BETA];
    kc->in.A_log = (const float *)b->p[BUF_ALOG];
    kc->in.dt_bias = (const float *)b->p[BUF_DTB];
    kc->in.initial_state = NULL;
    kc->out.o = b->p[BUF_O];
    /* decode: the state [B,HV,K,V] is updated in place (BUF_HT) */
    kc->out.final_state = (float *)b->p[BUF_HT];
    kc->gr.do_ = b->p[BUF_DO];
    kc->gr.dht = (const float *)b->p[BUF_DHT];
    kc->gr.dq = b->p[BUF_DQ];
    kc->gr.dk = b->p[BUF_DK];
    kc->gr.dv = b->p[BUF_DV];
    kc->gr.dg = b->p[BUF_DG];
    kc->gr.dbeta = b->p[BUF_DBETA];
    kc->gr.dh0 = NULL;
    kc->gr.dA_log = (float *)b->p[BUF_DALOG];
    kc->gr.ddt_bias = (float *)b->p[BUF_DDTB];
}

static lm_status case_call(kc_case *kc, lm_error *err) {
    lm_cuda_ctx *ctx = kc->ctx;
    lm_kda_cuda_saved *saved = NULL;
    lm_status st;
    switch (kc->mode) {
    case MODE_FWD:
        return lm_kda_cuda_chunk_forward(ctx, &kc->c, &kc->in, &kc->out, err);
    case MODE_DECODE:
        return lm_kda_cuda_decode_step(ctx, &kc->c, &kc->in, kc->out.final_state, kc->out.o, err);
    case MODE_TRAINFWD:
        st = lm_kda_cuda_forward_train(ctx, &kc->c, &kc->in, &kc->out, &saved, err);
        break;
    default:
        st = lm_kda_cuda_forward_train(ctx, &kc->c, &kc->in, &kc->out, &saved, err);
        if (st == LM_OK)
            st = lm_kda_cuda_backward(ctx, saved, &kc->gr, err);
        break;
    }
    if (saved)
        lm_kda_cuda_saved_free(ctx, saved);
    return st;
}

typedef struct {
    double median_ms, min_ms;
    int calls, repeat;
} kc_timing;

/* Warm up (the first call also sizes `calls` for ~target_ms per repeat), then
 * `repeat` timed repeats of `calls` calls each. Returns the first error (an
 * LM_ERR_UNSUPPORTED from the first call means the entry point is not built). */
static lm_status time_case(kc_case *kc, int warmup, int repeat, double target_ms, lm_cuda_timer *tm,
                           kc_timing *t, lm_error *err) {
    t->median_ms = t->min_ms = NAN;
    t->calls = t->repeat = 0;
    double first = 0;
    lm_status st = lm_cuda_timer_start(tm, err);
    if (st == LM_OK)
        st = case_call(kc, err);
    if (st == LM_OK)
        st = lm_cuda_timer_stop(tm, &first, err);
    for (int i = 1; i < warmup && st == LM_OK; i++)
        st = case_call(kc, err);
    if (st != LM_OK)
        return st;
    int calls = first > 0 ? (int)ceil(target_ms / first) : 1000;
    calls = calls < 1 ? 1 : (calls > 1000 ? 1000 : calls);
    double *ms = (double *)malloc(sizeof(double) * (size_t)repeat);
    if (!ms)
        return lm_errorf(err, LM_ERR_NOMEM, "bench kda cuda: out of host memory");
    for (int r = 0; r < repeat && st == LM_OK; r++) {
        double x = 0;
        st = lm_cuda_timer_start(tm, err);
        for (int i = 0; i < calls && st == LM_OK; i++)
            st = case_call(kc, err);
        if (st == LM_OK)
            st = lm_cuda_timer_stop(tm, &x, err);
        ms[r] = x / calls;
    }
    if (st == LM_OK) {
        t->calls = calls;
        t->repeat = repeat;
        t->median_ms = lm_bench_median(ms, repeat); /* sorts */
        t->min_ms = ms[0];
    }
    free(ms);
    return st;
}

/* NaN / Inf among the outputs the mode writes (0 when all finite). */
static lm_status count_bad(const kc_case *kc, const kc_bufs *b, int64_t *bad, lm_error *err) {
    int list[8], n = 0;
    list[n++] = BUF_O;
    list[n++] = BUF_HT;
    if (kc->mode == MODE_FWDBWD) {
        list[n++] = BUF_DQ;
        list[n++] = BUF_DK;
        list[n++] = BUF_DV;
        list[n++] = BUF_DG;
        list[n++] = BUF_DBETA;
    }
    *bad = 0;
    for (int j = 0; j < n; j++) {
        const int i = list[j];
        int64_t c = 0;
        lm_status st =
            (i == BUF_HT)
                ? lm_cuda_count_nonfinite_f32(kc->ctx, (const float *)b->p[i], b->n[i], &c, err)
                : lm_cuda_count_nonfinite_bf16(kc->ctx, b->p[i], b->n[i], &c, err);
        if (st != LM_OK)
            return st;
        *bad += c;
    }
    return LM_OK;
}

/* ---------------------------------------------------------------- table and JSON */

static void table_header(void) {
    printf("%-30s %-18s %9s %13s %8s %8s %7s\n", "name", "shape", "ms", "tokens/s", "TFLOP/s",
           "GB/s", "limit");
    printf("%-30s %-18s %9s %13s %8s %8s %7s\n", "----", "-----", "--", "--------", "-------",
           "----", "-----");
}

static void table_row(const lm_bench_record *r, double gbs, const char *status) {
    char shp[64];
    lm_bench_fmt_shape(shp, sizeof(shp), r->ndim, r->shape);
    if (status) {
        printf("%-30s %-18s %9s\n", r->name, shp, status);
    } else {
        char tps[32], tf[32], gb[32];
        if (isnan(r->tokens_per_s))
            snprintf(tps, sizeof(tps), "-");
        else
            snprintf(tps, sizeof(tps), "%.4g", r->tokens_per_s);
        if (isnan(r->gflops))
            snprintf(tf, sizeof(tf), "-");
        else
            snprintf(tf, sizeof(tf), "%.2f", r->gflops / 1e3);
        if (isnan(gbs))
            snprintf(gb, sizeof(gb), "-");
        else
            snprintf(gb, sizeof(gb), "%.0f", gbs);
        printf("%-30s %-18s %9.4f %13s %8s %8s %7.3f\n", r->name, shp, r->ms, tps, tf, gb,
               r->ratio_to_limit);
    }
    fflush(stdout);
}

/* Record r (plus "gb_per_s" and "status") into the JSON and the table. */
static int emit(lm_bench_json *js, const lm_bench_record *r, double gbs, const char *status) {
    table_row(r, gbs, status);
    if (!js->root)
        return 0;
    if (lm_bench_json_add(js, r) != 0)
        return -1;
    cJSON *o = cJSON_GetArrayItem(js->records, cJSON_GetArraySize(js->records) - 1);
    if (!o || !lm_bench_json_number_or_null_(o, "gb_per_s", gbs) ||
        !cJSON_AddStringToObject(o, "status", status ? status : "ok"))
        return -1;
    return 0;
}

typedef struct {
    double tflops, gbs; /* the limits */
    int warmup, repeat;
    double target_ms;
    lm_cuda_timer *tm;
    lm_bench_json *js;
} kc_run;

/* Time one case and emit its row. Returns 0, or 1 after printing a failure. */
static int run_row(kc_run *R, kc_case *kc, const kc_bufs *b, const char *name, int ndim,
                   const int64_t *shape, double tokens, double flop, double bytes, double *ms_out) {
    lm_error err = {0};
    lm_bench_record rec;
    lm_bench_record_init(&rec, name, ndim, shape);
    *ms_out = NAN;
    kc_timing t;
    lm_status st = time_case(kc, R->warmup, R->repeat, R->target_ms, R->tm, &t, &err);
    if (st == LM_ERR_UNSUPPORTED)
        return emit(R->js, &rec, NAN, "not built") ? 1 : 0;
    if (st != LM_OK) {
        fprintf(stderr, "linmoe bench kda --device cuda: %s: %s\n", name, err.msg);
        emit(R->js, &rec, NAN, "failed");
        return 1;
    }
    int64_t bad = 0;
    if ((st = count_bad(kc, b, &bad, &err)) != LM_OK || bad) {
        if (st != LM_OK)
            fprintf(stderr, "linmoe bench kda --device cuda: %s: %s\n", name, err.msg);
        else
            fprintf(stderr,
                    "linmoe bench kda --device cuda: %s: %lld non-finite output values (o, "
                    "final state%s; the run took %.4f ms per call)\n",
                    name, (long long)bad, kc->mode == MODE_FWDBWD ? ", gradients" : "",
                    t.median_ms);
        emit(R->js, &rec, NAN, "failed");
        return 1;
    }
    const double s = t.median_ms * 1e-3;
    const double floor_s = fmax(flop / (R->tflops * 1e12), bytes / (R->gbs * 1e9));
    rec.ms = t.median_ms;
    rec.tokens_per_s = tokens / s;
    rec.gflops = flop / s / 1e9;
    rec.ratio_to_limit = floor_s / s;
    *ms_out = t.median_ms;
    return emit(R->js, &rec, bytes / s / 1e9, NULL) ? 1 : 0;
}

/* ---------------------------------------------------------------- main */

/* LINMOE_KDA_CUDA_* from the environment onto ctx's options (what the library read from
 * the environment before it had contexts; docs/perf-notes.md uses them) */
static lm_status options_from_env(lm_cuda_ctx *ctx, lm_error *err) {
    static const char *const env[5] = {"LINMOE_KDA_CUDA_BV", "LINMOE_KDA_CUDA_WGMMA",
                                       "LINMOE_KDA_CUDA_PDL", "LINMOE_KDA_CUDA_TMA",
                                       "LINMOE_KDA_CUDA_PROFILE"};
    static const char *const key[5] = {"kda.bv", "kda.wgmma", "kda.pdl", "kda.tma", "kda.profile"};
    for (int i = 0; i < 5; i++) {
        const char *e = getenv(env[i]);
        if (!e)
            continue;
        /* BV: 16 / 32 / 64 / 128 (anything else: chosen); PROFILE: set = on; others "0" = off */
        int v = i == 0 ? atoi(e) : i == 4 ? 1 : e[0] != '0';
        if (i == 0 && v != 16 && v != 32 && v != 64 && v != 128)
            v = 0;
        LM_TRY(lm_cuda_ctx_set_option(ctx, key[i], v, err));
    }
    return LM_OK;
}

int lm_bench_kda_cuda(const lm_bench_opts *opts) {
    const char *me = "linmoe bench kda --device cuda";
    if (lm_cuda_device_count() < 1) {
        fprintf(stderr,
                "%s: no CUDA GPU available (%s); the GPU benchmark runs on the GPU machine: "
                "scripts/gpu/pack.sh here, then scripts/gpu/bench-c.sh there\n",
                me,
                lm_cuda_built() ? "the CUDA driver reports no device"
                                : "this linmoe was built without CUDA");
        return 1;
    }
    lm_error err = {0};
    char dev[256] = "";
    int sms = 0;
    size_t mem = 0;
    if (lm_cuda_device_info(dev, sizeof(dev), &sms, &mem, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", me, err.msg);
        return 1;
    }
    lm_bench_json js = {NULL, NULL};
    if (opts->json_path && lm_bench_json_check_path(opts->json_path) != 0)
        return 1;
    if (opts->json_path && lm_bench_json_init(&js, "kda_cuda", opts->threads) != 0) {
        fprintf(stderr, "%s: out of memory\n", me);
        return 1;
    }
    kc_run R = {0, 0, 2, opts->quick ? 3 : 10, opts->quick ? 10.0 : 50.0, NULL, &js};
    printf("%s: %s, %d SMs, %.1f GiB; warmup=%d, repeat=%d (median), ~%.0f ms of calls per "
           "repeat%s\n",
           me, dev, sms, (double)mem / (1 << 30), R.warmup, R.repeat, R.target_ms,
           opts->quick ? ", quick" : "");

    int rc = 0;
    lm_cuda_limits lim;
    lm_cuda_ctx *ctx = NULL;
    if (lm_cuda_ctx_new(&ctx, 0, &err) != LM_OK || options_from_env(ctx, &err) != LM_OK ||
        lm_cuda_measure_limits(ctx, R.repeat, &lim, &err) != LM_OK ||
        lm_cuda_timer_new(ctx, &R.tm, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", me, err.msg);
        lm_cuda_ctx_free(ctx);
        lm_bench_json_free(&js);
        return 1;
    }
    R.tflops = lim.bf16_tflops;
    R.gbs = lim.copy_gbs;
    printf("limits: cuBLAS bf16 GEMM %dx%dx%d (fp32 accumulation) %.1f TFLOP/s; "
           "device copy %.2f GiB %.0f GB/s (read + written)\n\n",
           lim.gemm_n, lim.gemm_n, lim.gemm_n, lim.bf16_tflops, (double)lim.copy_bytes / (1 << 30),
           lim.copy_gbs);
    table_header();
    {
        lm_bench_record rec;
        const int64_t gshape[3] = {lim.gemm_n, lim.gemm_n, lim.gemm_n};
        lm_bench_record_init(&rec, "cublas_bf16_gemm", 3, gshape);
        rec.ms = lim.gemm_ms;
        rec.gflops = lim.bf16_tflops * 1e3;
        rec.ratio_to_limit = 1.0;
        if (emit(&js, &rec, NAN, NULL))
            rc = 1;
        const int64_t cshape[1] = {(int64_t)lim.copy_bytes};
        lm_bench_record_init(&rec, "memcpy_d2d", 1, cshape);
        rec.ms = lim.copy_ms;
        rec.ratio_to_limit = 1.0;
        if (emit(&js, &rec, lim.copy_gbs, NULL))
            rc = 1;
    }

    /* ms[shape][gate][mode] for the ratios */
    double ms[N_SHAPES][N_GATES][N_MODES];
    for (int si = 0; si < N_SHAPES; si++)
        for (int gi = 0; gi < N_GATES; gi++)
            for (int m = 0; m < N_MODES; m++)
                ms[si][gi][m] = NAN;

    for (int si = 0; si < N_SHAPES; si++) {
        const kc_shape *s = &k_shapes[si];
        kc_bufs b;
        if (bufs_init(ctx, &b, s, 1000 + (uint64_t)si, &err) != LM_OK) {
            fprintf(stderr, "%s: inputs for [%d,%d,%d,%d]: %s\n", me, s->B, s->T, s->H, s->D,
                    err.msg);
            rc = 1;
            break;
        }
        const int64_t shape[4] = {s->B, s->T, s->H, s->D};
        const double tokens = (double)s->B * s->T, th = tokens * s->H;
        const double state_b = (double)s->B * s->H * s->D * s->D * 4;
        const double fwd_bytes = 5 * th * s->D * 2 + th * 2 + state_b;
        const double bwd_bytes = 9 * th * s->D * 2 + 2 * th * 2 + state_b;
        for (int gi = 0; gi < N_GATES; gi++) {
            for (int m = 0; m < N_MODES; m++) {
                kc_case kc;
                case_init(&kc, ctx, &b, s, gi, m);
                char name[96];
                snprintf(name, sizeof(name), "kda_cuda_%s_%s", k_mode_names[m], k_gate_names[gi]);
                const double flop =
                    th * (m == MODE_FWDBWD ? FLOP_FWD_PER_TOKEN_HEAD + FLOP_BWD_PER_TOKEN_HEAD
                                           : FLOP_FWD_PER_TOKEN_HEAD);
                const double bytes = m == MODE_FWDBWD ? fwd_bytes + bwd_bytes : fwd_bytes;
                rc |= run_row(&R, &kc, &b, name, 4, shape, tokens, flop, bytes, &ms[si][gi][m]);
            }
        }
        bufs_free(ctx, &b);
    }

    /* decode step */
    {
        const kc_shape *s = &k_decode;
        kc_bufs b;
        if (bufs_init(ctx, &b, s, 2000, &err) != LM_OK) {
            fprintf(stderr, "%s: decode inputs: %s\n", me, err.msg);
            rc = 1;
        } else {
            double dms;
            kc_case kc;
            case_init(&kc, ctx, &b, s, GATE_BOUNDED, MODE_DECODE);
            /* a state of the size a prefill leaves behind, not zeros */
            lm_status st = lm_cuda_fill_normal_f32(ctx, (float *)b.p[BUF_HT], b.n[BUF_HT], 2001,
                                                   0.0f, 0.1f, &err);
            if (st != LM_OK) {
                fprintf(stderr, "%s: decode state: %s\n", me, err.msg);
                rc = 1;
            } else {
                const int64_t shape[4] = {s->B, s->T, s->H, s->D};
                const double th = (double)s->B * s->H;
                const double flop = th * 7.0 * s->D * s->D;
                const double bytes = 2.0 * s->B * s->H * s->D * s->D * 4;
                rc |= run_row(&R, &kc, &b, "kda_cuda_decode_bounded", 4, shape, (double)s->B, flop,
                              bytes, &dms);
            }
            bufs_free(ctx, &b);
        }
    }

    cJSON *ratios = js.root ? cJSON_AddArrayToObject(js.root, "ratios") : NULL;
    printf("\nbounded/softplus speed ratio (softplus ms / bounded ms; > 1: bounded faster)\n");
    for (int si = 0; si < N_SHAPES; si++) {
        const kc_shape *s = &k_shapes[si];
        double r[N_MODES];
        char txt[N_MODES][32];
        for (int m = 0; m < N_MODES; m++) {
            r[m] = ms[si][GATE_SOFTPLUS][m] / ms[si][GATE_BOUNDED][m];
            if (isnan(r[m]))
                snprintf(txt[m], sizeof(txt[m]), "-");
            else
                snprintf(txt[m], sizeof(txt[m]), "%.3f", r[m]);
        }
        printf("[%d,%d,%d,%d]  fwd %s  trainfwd %s  fwdbwd %s\n", s->B, s->T, s->H, s->D, txt[0],
               txt[1], txt[2]);
        if (ratios) {
            cJSON *o = cJSON_CreateObject();
            cJSON *sh = cJSON_CreateIntArray((const int[]){s->B, s->T, s->H, s->D}, 4);
            int ok = o && sh;
            if (ok)
                cJSON_AddItemToObject(o, "shape", sh);
            else
                cJSON_Delete(sh);
            ok = ok && lm_bench_json_number_or_null_(o, "bounded_over_softplus_fwd", r[0]) &&
                 lm_bench_json_number_or_null_(o, "bounded_over_softplus_trainfwd", r[1]) &&
                 lm_bench_json_number_or_null_(o, "bounded_over_softplus_fwdbwd", r[2]);
            if (!ok || !cJSON_AddItemToArray(ratios, o)) {
                cJSON_Delete(o);
                rc = 1;
            }
        }
    }
    printf("\nratio_to_peer: null here; the peers (fla chunk_kda, FlashKDA) are Python and are "
           "measured beside linmoe in one process by scripts/gpu/bench_kda.py "
           "(scripts/gpu/bench.sh)\n");
    if (js.root) {
        cJSON *l = cJSON_AddObjectToObject(js.root, "limits");
        int ok = cJSON_AddStringToObject(js.root, "device", dev) && l &&
                 cJSON_AddNumberToObject(l, "bf16_gemm_tflops", lim.bf16_tflops) &&
                 cJSON_AddNumberToObject(l, "copy_gb_per_s", lim.copy_gbs) &&
                 cJSON_AddStringToObject(js.root, "peer",
                                         "scripts/gpu/bench_kda.py (same process as fla)");
        if (!ok)
            rc = 1;
        if (lm_bench_json_save(&js, opts->json_path) != 0)
            rc = 1;
        else
            printf("wrote %s\n", opts->json_path);
    }
    lm_bench_json_free(&js);
    lm_cuda_timer_free(R.tm);
    lm_kda_cuda_release(ctx);
    lm_cuda_ctx_free(ctx);
    return rc;
}
