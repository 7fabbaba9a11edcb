/* `linmoe bench kda`: the KDA kernels on the CPU against the machine's limit.
 *
 * The limit is OpenBLAS sgemm 2048x2048x2048 on the same threads, measured in the
 * same run (median of >= 5 after one warmup; bench.h lm_bench_sgemm_limit). Then, at (B,T,H,D) = (1,4096,4,128)
 * and (4,2048,4,64) with H == HV and K == V == D, the recurrent forward, the chunked
 * forward and the chunked forward+backward, each for the bounded gate (lower_bound
 * -5, A_log = 0) and the softplus gate (A_log = log U(1,16)), both with dt_bias, the
 * gate, q/k L2 normalisation and the beta sigmoid fused in the op (fla's fused flags).
 *
 * FLOPs are pinned per token and head (reference/kda.md §6.1, C = chunk size):
 *   forward   6*dk*dv + C*(6*dk + 4*dv)
 *   backward  16*dk*dv + C*(12*dk + 10*dv) + 4*C^2     (recompute not counted)
 *   recurrent 7*dk*dv
 * so GFLOP/s of different paths are comparable as "useful work per second".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "linmoe/core.h"
#include "linmoe/kda.h"

enum { MODE_REC = 0, MODE_FWD = 1, MODE_FWDBWD = 2, N_MODES = 3 };
enum { GATE_BOUNDED = 0, GATE_SOFTPLUS = 1, N_GATES = 2 };
static const char *const k_mode_names[N_MODES] = {"recurrent", "chunk", "chunk"};
static const char *const k_mode_suffix[N_MODES] = {"fwd", "fwd", "fwdbwd"};
static const char *const k_gate_names[N_GATES] = {"bounded", "softplus"};

typedef struct {
    int B, T, H, D;
} kda_shape;

static const kda_shape k_shapes[] = {{1, 4096, 4, 128}, {4, 2048, 4, 64}};
#define N_SHAPES ((int)(sizeof(k_shapes) / sizeof(k_shapes[0])))

/* Every buffer of one shape; inputs shared by both gates except A_log. */
typedef struct {
    int64_t n_qk, n_v, n_g, n_beta, n_state;
    float *q, *k, *v, *x, *beta, *A_log_sp, *A_log_zero, *dt_bias, *do_;
    float *o, *ht, *dq, *dk, *dv, *dg, *dbeta, *dA_log, *ddt_bias;
} kda_bufs;

typedef struct {
    lm_kda_config c;
    lm_kda_inputs in;
    lm_kda_outputs out;
    lm_kda_grads gr;
    int mode;
    lm_error err;
} kda_case;

static void bufs_free(kda_bufs *b) {
    float **all[] = {&b->q,  &b->k,     &b->v,        &b->x,       &b->beta, &b->A_log_sp,
                     &b->A_log_zero, &b->dt_bias, &b->do_, &b->o, &b->ht, &b->dq,
                     &b->dk, &b->dv, &b->dg, &b->dbeta, &b->dA_log, &b->ddt_bias};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        free(*all[i]);
        *all[i] = NULL;
    }
}

static float *alloc_or_null(int64_t n) {
    return (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
}

static void fill_normal(float *x, int64_t n, lm_rng *r) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)lm_rng_normal(r);
}

/* Realistic inputs (fla's layer init, reference/kda.md §1.3): q, k, v, the raw gate
 * x, raw beta and do ~ N(0,1); A_log = log U(1,16) (softplus) or 0 (bounded);
 * dt_bias = softplus^-1(dt), dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4. */
static int bufs_init(kda_bufs *b, const kda_shape *s, uint64_t seed) {
    memset(b, 0, sizeof(*b));
    const int64_t B = s->B, T = s->T, H = s->H, HV = s->H, K = s->D, V = s->D;
    b->n_qk = B * T * H * K;
    b->n_v = B * T * HV * V;
    b->n_g = B * T * HV * K;
    b->n_beta = B * T * HV;
    b->n_state = B * HV * K * V;
    b->q = alloc_or_null(b->n_qk);
    b->k = alloc_or_null(b->n_qk);
    b->v = alloc_or_null(b->n_v);
    b->x = alloc_or_null(b->n_g);
    b->beta = alloc_or_null(b->n_beta);
    b->A_log_sp = alloc_or_null(HV);
    b->A_log_zero = alloc_or_null(HV);
    b->dt_bias = alloc_or_null(HV * K);
    b->do_ = alloc_or_null(b->n_v);
    b->o = alloc_or_null(b->n_v);
    b->ht = alloc_or_null(b->n_state);
    b->dq = alloc_or_null(b->n_qk);
    b->dk = alloc_or_null(b->n_qk);
    b->dv = alloc_or_null(b->n_v);
    b->dg = alloc_or_null(b->n_g);
    b->dbeta = alloc_or_null(b->n_beta);
    b->dA_log = alloc_or_null(HV);
    b->ddt_bias = alloc_or_null(HV * K);
    if (!b->q || !b->k || !b->v || !b->x || !b->beta || !b->A_log_sp || !b->A_log_zero ||
        !b->dt_bias || !b->do_ || !b->o || !b->ht || !b->dq || !b->dk || !b->dv || !b->dg ||
        !b->dbeta || !b->dA_log || !b->ddt_bias) {
        bufs_free(b);
        return -1;
    }
    lm_rng r;
    lm_rng_init(&r, seed);
    fill_normal(b->q, b->n_qk, &r);
    fill_normal(b->k, b->n_qk, &r);
    fill_normal(b->v, b->n_v, &r);
    fill_normal(b->x, b->n_g, &r);
    fill_normal(b->beta, b->n_beta, &r);
    fill_normal(b->do_, b->n_v, &r);
    for (int64_t h = 0; h < HV; h++) {
        b->A_log_sp[h] = (float)log(1.0 + 15.0 * lm_rng_uniform(&r));
        b->A_log_zero[h] = 0.0f;
    }
    for (int64_t i = 0; i < HV * K; i++) {
        double dt = exp(log(1e-3) + (log(1e-1) - log(1e-3)) * lm_rng_uniform(&r));
        if (dt < 1e-4) dt = 1e-4;
        b->dt_bias[i] = (float)(dt + log(-expm1(-dt))); /* softplus^-1(dt) */
    }
    return 0;
}

static void case_init(kda_case *kc, kda_bufs *b, const kda_shape *s, int gate, int mode,
                      lm_kda_workspace *ws) {
    memset(kc, 0, sizeof(*kc));
    lm_kda_config_default(&kc->c, s->B, s->T, s->H, s->H, s->D, s->D);
    /* one workspace for all runs, as a training loop holds one: scratch is
     * allocated and paged in by the warmup, not inside the timed runs */
    kc->c.ws = ws;
    kc->c.kind = LM_KDA;
    kc->c.use_qk_l2norm_in_kernel = 1;
    kc->c.use_beta_sigmoid_in_kernel = 1;
    if (gate == GATE_BOUNDED) {
        kc->c.gate = LM_GATE_BOUNDED;
        kc->c.has_lower_bound = 1;
        kc->c.lower_bound = -5.0f;
    } else {
        kc->c.gate = LM_GATE_SOFTPLUS;
    }
    kc->in.q = b->q;
    kc->in.k = b->k;
    kc->in.v = b->v;
    kc->in.g = b->x;
    kc->in.beta = b->beta;
    kc->in.A_log = gate == GATE_BOUNDED ? b->A_log_zero : b->A_log_sp;
    kc->in.dt_bias = b->dt_bias;
    kc->in.initial_state = NULL;
    kc->out.o = b->o;
    kc->out.final_state = b->ht;
    kc->gr.do_ = b->do_;
    kc->gr.dht = NULL;
    kc->gr.dq = b->dq;
    kc->gr.dk = b->dk;
    kc->gr.dv = b->dv;
    kc->gr.dg = b->dg;
    kc->gr.dbeta = b->dbeta;
    kc->gr.dh0 = NULL;
    kc->gr.dA_log = b->dA_log;
    kc->gr.ddt_bias = b->ddt_bias;
    kc->mode = mode;
}

static int case_run(void *ctx) {
    kda_case *kc = (kda_case *)ctx;
    lm_status st;
    switch (kc->mode) {
    case MODE_REC: st = lm_kda_recurrent_forward(&kc->c, &kc->in, &kc->out, &kc->err); break;
    case MODE_FWD: st = lm_kda_chunk_forward(&kc->c, &kc->in, &kc->out, &kc->err); break;
    default:
        st = lm_kda_chunk_forward(&kc->c, &kc->in, &kc->out, &kc->err);
        if (st == LM_OK) st = lm_kda_chunk_backward(&kc->c, &kc->in, &kc->gr, &kc->err);
        break;
    }
    return st == LM_OK ? 0 : -1;
}

static int64_t count_nonfinite(const float *x, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !isfinite(x[i]);
    return bad;
}

/* FLOPs per token per head (reference/kda.md §6.1). */
static double flops_per_token_head(int mode, double dk, double dv, double C) {
    const double fwd = 6 * dk * dv + C * (6 * dk + 4 * dv);
    const double bwd = 16 * dk * dv + C * (12 * dk + 10 * dv) + 4 * C * C;
    switch (mode) {
    case MODE_REC: return 7 * dk * dv;
    case MODE_FWD: return fwd;
    default: return fwd + bwd;
    }
}

/* ---------------------------------------------------------------- main */

int lm_bench_kda(const lm_bench_opts *opts) {
    const int threads = opts->threads > 0 ? opts->threads : 1;
    const int warmup = 1;
    const int repeat_sgemm = 5;
    const int repeat = opts->quick ? 2 : 5;
    lm_set_num_threads(threads);
    lm_blas_set_threads(threads);

    lm_bench_json js = {NULL, NULL};
    if (opts->json_path && lm_bench_json_check_path(opts->json_path) != 0) return 1;
    if (opts->json_path && lm_bench_json_init(&js, "kda", threads) != 0) {
        fprintf(stderr, "linmoe bench kda: out of memory\n");
        return 1;
    }
    int rc = 0;
    printf("linmoe bench kda: threads=%d, warmup=%d, repeat=%d (sgemm %d)%s\n", threads, warmup,
           repeat, repeat_sgemm, opts->quick ? ", quick" : "");
    lm_bench_table_header(stdout);

    lm_bench_record rec;
    /* (bench.h; it naps 0.3 s afterwards so that OpenBLAS's spinning worker threads
     * do not compete with the OpenMP threads timed next) */
    const double limit = lm_bench_sgemm_limit(threads, repeat_sgemm, &rec);
    if (limit <= 0 || !isfinite(limit)) {
        fprintf(stderr, "linmoe bench kda: the sgemm limit could not be measured (out of memory)\n");
        lm_bench_json_free(&js);
        return 1;
    }
    lm_kda_workspace *ws = lm_kda_workspace_new();
    lm_bench_table_row(stdout, &rec);
    if (js.root && lm_bench_json_add(&js, &rec) != 0) rc = 1;

    /* ms[shape][gate][mode] for the ratios */
    double ms[N_SHAPES][N_GATES][N_MODES];
    for (int si = 0; si < N_SHAPES; si++)
        for (int gi = 0; gi < N_GATES; gi++)
            for (int m = 0; m < N_MODES; m++) ms[si][gi][m] = NAN;

    for (int si = 0; si < N_SHAPES && rc == 0; si++) {
        const kda_shape *s = &k_shapes[si];
        kda_bufs b;
        if (bufs_init(&b, s, 1000 + (uint64_t)si) != 0) {
            fprintf(stderr, "linmoe bench kda: out of memory allocating inputs for [%d,%d,%d,%d]\n",
                    s->B, s->T, s->H, s->D);
            rc = 1;
            break;
        }
        const int64_t shape[4] = {s->B, s->T, s->H, s->D};
        for (int gi = 0; gi < N_GATES && rc == 0; gi++) {
            for (int m = 0; m < N_MODES && rc == 0; m++) {
                kda_case kc;
                case_init(&kc, &b, s, gi, m, ws);
                /* keep BLAS on the requested threads even if a kernel changed it */
                lm_set_num_threads(threads);
                lm_blas_set_threads(threads);
                lm_bench_timing t = lm_bench_time(case_run, &kc, warmup, repeat);
                char name[96];
                snprintf(name, sizeof(name), "kda_%s_%s_%s", k_mode_names[m], k_gate_names[gi],
                         k_mode_suffix[m]);
                if (t.failed) {
                    fprintf(stderr, "linmoe bench kda: %s: %s\n", name, kc.err.msg);
                    rc = 1;
                    break;
                }
                int64_t bad = count_nonfinite(b.o, b.n_v) + count_nonfinite(b.ht, b.n_state);
                if (m == MODE_FWDBWD)
                    bad += count_nonfinite(b.dq, b.n_qk) + count_nonfinite(b.dk, b.n_qk) +
                           count_nonfinite(b.dv, b.n_v) + count_nonfinite(b.dg, b.n_g) +
                           count_nonfinite(b.dbeta, b.n_beta);
                if (bad) {
                    fprintf(stderr, "linmoe bench kda: %s: %lld non-finite output values\n", name,
                            (long long)bad);
                    rc = 1;
                    break;
                }
                const double tokens = (double)s->B * s->T;
                const double flop = tokens * s->H *
                                    flops_per_token_head(m, s->D, s->D, kc.c.chunk_size);
                lm_bench_record_init(&rec, name, 4, shape);
                rec.ms = t.median_ms;
                rec.tokens_per_s = tokens / (t.median_ms * 1e-3);
                rec.gflops = flop / (t.median_ms * 1e-3) / 1e9;
                rec.ratio_to_limit = rec.gflops / limit;
                ms[si][gi][m] = t.median_ms;
                lm_bench_table_row(stdout, &rec);
                if (js.root && lm_bench_json_add(&js, &rec) != 0) rc = 1;
            }
        }
        bufs_free(&b);
    }

    if (rc == 0) {
        cJSON *ratios = js.root ? cJSON_AddArrayToObject(js.root, "ratios") : NULL;
        printf("\nspeed ratios (> 1: the first is faster)\n");
        for (int si = 0; si < N_SHAPES; si++) {
            const kda_shape *s = &k_shapes[si];
            const double bs_fwd = ms[si][GATE_SOFTPLUS][MODE_FWD] / ms[si][GATE_BOUNDED][MODE_FWD];
            const double bs_fb =
                ms[si][GATE_SOFTPLUS][MODE_FWDBWD] / ms[si][GATE_BOUNDED][MODE_FWDBWD];
            const double cr_b = ms[si][GATE_BOUNDED][MODE_REC] / ms[si][GATE_BOUNDED][MODE_FWD];
            const double cr_s = ms[si][GATE_SOFTPLUS][MODE_REC] / ms[si][GATE_SOFTPLUS][MODE_FWD];
            printf("[%d,%d,%d,%d]  bounded/softplus speed ratio: fwd %.3f  fwdbwd %.3f\n", s->B,
                   s->T, s->H, s->D, bs_fwd, bs_fb);
            printf("[%d,%d,%d,%d]  chunk/recurrent forward ratio: bounded %.3f  softplus %.3f\n",
                   s->B, s->T, s->H, s->D, cr_b, cr_s);
            if (ratios) {
                cJSON *o = cJSON_CreateObject();
                cJSON *sh = cJSON_CreateIntArray((const int[]){s->B, s->T, s->H, s->D}, 4);
                int ok = o && sh;
                if (ok) cJSON_AddItemToObject(o, "shape", sh);
                else cJSON_Delete(sh);
                ok = ok && lm_bench_json_number_or_null_(o, "bounded_over_softplus_fwd", bs_fwd) &&
                     lm_bench_json_number_or_null_(o, "bounded_over_softplus_fwdbwd", bs_fb) &&
                     lm_bench_json_number_or_null_(o, "chunk_over_recurrent_fwd_bounded", cr_b) &&
                     lm_bench_json_number_or_null_(o, "chunk_over_recurrent_fwd_softplus", cr_s);
                if (!ok || !cJSON_AddItemToArray(ratios, o)) {
                    cJSON_Delete(o);
                    rc = 1;
                }
            }
        }
    }
    if (rc == 0 && js.root) {
        if (lm_bench_json_save(&js, opts->json_path) != 0) rc = 1;
        else printf("wrote %s\n", opts->json_path);
    }
    lm_bench_json_free(&js);
    lm_kda_workspace_free(ws);
    return rc;
}
