/* dev/: the launch shapes of the CUDA KDA decode step that lost their A/B test, a check of
 * each against the production step and the timing harness behind the table below. Not part of the CMake build (CMake globs only the .cu
 * files of src/ops/cuda). This file includes src/ops/cuda/kda_decode.cu, so the kernel
 * template, its parameter setup (dec_setup) and the production launch (dec_launch,
 * variant 0 here) are the library's own; only the other instances are made here.
 *
 * Build and run from the repository root, against a CUDA build of the tree in build/:
 *   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc \
 *     dev/kda_decode_variants.cu -Xlinker --start-group build/liblinmoe_cuda.a \
 *     build/liblinmoe.a -Xlinker --end-group -lcublas -lcublasLt -lcudnn -lopenblas \
 *     -lcjson -lpcre2-8 -lgomp -lm -o /tmp/kda_decode_variants
 *   /tmp/kda_decode_variants [--quick]
 * (the program defines lm_kda_cuda_decode_step / _flat itself, from the included file,
 * so the archive's kda_decode.o is not linked.)
 *
 * 1. Check: for three shapes (KDA softplus GVA K = V = 128; GDN bounded K = 64, V = 96,
 *    partial column slices; KDA gate none K = 256, 32 rows per thread), three steps of
 *    every variant from the same state and inputs against three steps of the production
 *    step: o within TOL_O and the state within TOL_STATE relative RMS error (only fp32
 *    summation order differs: the rows are split over a different number of threads).
 * 2. Timing at B = 64, H = HV = 32, K = V = 128 (KDA softplus gate with A_log and
 *    dt_bias, in-kernel l2norm and sigmoid; 268 MB of state traffic per step): two passes
 *    over the variants (their spread is the noise), then B = 1, 8, 16 (a prefix of the
 *    same buffers). A step's time is CUDA events (lm_cuda_timer) around `calls`
 *    back-to-back steps / calls, median of `repeat` such runs after 10 warm-up steps.
 *    The copy bandwidth is lm_cuda_measure_limits' (cudaMemcpy device-to-device, read +
 *    written) in the same process.
 * Exit status: 0 when every check passes, 1 on a failure, 77 without a CUDA device.
  *
 * Measured on the H200 (B = 64, H = HV = 32, K = V = 128, KDA softplus gate with
 * l2norm and sigmoid in the kernel; 268 MB of state traffic per step; cudaMemcpy
 * device-to-device 4210-4219 GB/s in the same binary; median of 200 steps):
 *   threads  cols/CTA  hints   us/step      of copy
 *   128      64        .cs     73.8, 73.8   0.86     (chosen: best or tied at B = 1, 16, 64)
 *   128      64        -       74.7, 74.7   0.85
 *   128      128       .cs     74.7, 73.5   0.85-0.87
 *   128      128       -       73.6-74.1    0.86
 *   256      128       .cs     74.9         0.85
 *   256      128       -       77.5-77.9    0.82
 *   256      64        .cs/-   74.8 / 77.1  0.85 / 0.83
 *   512      128       -       81.3-82.9    0.77-0.78
 *   128      32        -       82.8         0.77
 *   256      32        -       112          0.57
 * Copy-bandwidth floor for this traffic: 63.7 us. At B = 16 the chosen shape takes
 * 17.8 us; at B = 1 (32 CTAs) 6.4 us, latency-bound.
 */
#include "ops/cuda/kda_decode.cu"

#include <stdlib.h>

#include "linmoe/core.h"
#include "linmoe/cuda_bench.h"

namespace {

/* One launch shape of the VEC = 4 path: threads per CTA, value columns per CTA,
 * streaming cache hints (ld.global.cs / st.global.cs) on the state. The scalar path
 * (V % 4 != 0 or a misaligned state) is the same for every variant. */
struct DecVariant {
    int nt, vs, stream;
};
const DecVariant DEC_VARIANTS[] = {
    {DEC_NT, DEC_VS, 1}, /* 0: production (dec_launch), 73.8 us at B=64, H=32, K=V=128 */
    {128, 128, 0},       {128, 64, 0}, {128, 128, 1}, {256, 128, 1},
    {256, 128, 0},       {256, 64, 1}, {512, 128, 0},
};
constexpr int NVAR = (int)(sizeof DEC_VARIANTS / sizeof DEC_VARIANTS[0]);

/* One step with launch shape `variant` (checked config) on ctx's stream. */
lm_status var_launch(lm_cuda_ctx *ctx, const lm_kda_config *c, const lm_kda_cuda_inputs *in,
                     float *state, void *o, int variant, lm_error *err) {
    const bool vec4 = c->V % 4 == 0 && ((uintptr_t)state & 15) == 0;
    if (variant == 0 || !vec4)
        return dec_launch(ctx, c, in, state, o, err);
    const DecVariant var = DEC_VARIANTS[variant];
    const int cols = var.vs < c->V ? var.vs : c->V;
    const int TX = (cols + 3) / 4;
    int nt = var.nt;
    /* a K too tall for DEC_RMAX rows per thread takes 256 threads (8 row groups at
     * least, so K <= DEC_KMAX always fits) */
    if (nt < 256 && (c->K + nt / TX - 1) / (nt / TX) > DEC_RMAX)
        nt = 256;
    DecLaunch L{};
    LM_TRY(dec_setup(c, in, state, o, 4, nt, cols, &L, err));
    cudaStream_t s = ctx->stream;
    if (nt == 128 && !var.stream)
        launch_full<128, 4, false>(L.full, L.R, L.grid, L.smem, s, L.p);
    else if (nt == 128)
        launch_full<128, 4, true>(L.full, L.R, L.grid, L.smem, s, L.p);
    else if (nt == 256 && !var.stream)
        launch_full<256, 4, false>(L.full, L.R, L.grid, L.smem, s, L.p);
    else if (nt == 256)
        launch_full<256, 4, true>(L.full, L.R, L.grid, L.smem, s, L.p);
    else if (nt == 512 && !var.stream)
        launch_full<512, 4, false>(L.full, L.R, L.grid, L.smem, s, L.p);
    else
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "variant %d: no instance for %d threads%s",
                         variant, nt, var.stream ? " with .cs hints" : "");
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return dec_cuda_err(err, e, "kda_decode launch (variant)");
    return LM_OK;
}

const double TOL_O = 1e-3;     /* bf16 rounding flips of o only */
const double TOL_STATE = 1e-5; /* fp32 summation order */

struct Shape {
    const char *name;
    lm_kda_kind kind;
    lm_gate_mode gate;
    float lb;
    int sig, B, H, HV, K, V;
};

/* Device buffers of one decode problem (inputs from lm_cuda_fill_normal_*). */
struct Problem {
    lm_cuda_ctx *ctx = nullptr;
    lm_kda_config c;
    lm_kda_cuda_inputs in = {};
    float *state = nullptr, *state0 = nullptr;
    void *o = nullptr;
    size_t ns = 0, no = 0; /* state floats, o bf16 elements */
    ~Problem() {
        void *bufs[] = {
            (void *)in.q,     (void *)in.k,       (void *)in.v,  (void *)in.g,   (void *)in.beta,
            (void *)in.A_log, (void *)in.dt_bias, (void *)state, (void *)state0, o};
        for (void *b : bufs)
            lm_cuda_ctx_free_mem(ctx, b);
    }
};

lm_status dev_buf(lm_cuda_ctx *ctx, const void **p, size_t bytes, lm_error *err) {
    void *d = nullptr;
    LM_TRY(lm_cuda_ctx_alloc(ctx, &d, bytes, err));
    *p = d;
    return LM_OK;
}

lm_status problem_make(Problem &P, lm_cuda_ctx *ctx, const Shape &s, uint64_t seed, lm_error *err) {
    P.ctx = ctx;
    lm_kda_config_default(&P.c, s.B, 1, s.H, s.HV, s.K, s.V);
    P.c.kind = s.kind;
    P.c.gate = s.gate;
    P.c.has_lower_bound = s.lb != 0;
    P.c.lower_bound = s.lb;
    P.c.use_qk_l2norm_in_kernel = 1;
    P.c.use_beta_sigmoid_in_kernel = s.sig;
    const int64_t nq = (int64_t)s.B * s.H * s.K, nv = (int64_t)s.B * s.HV * s.V;
    const int64_t gk = s.kind == LM_GDN ? 1 : s.K, ng = (int64_t)s.B * s.HV * gk;
    const int64_t nb = (int64_t)s.B * s.HV;
    P.ns = (size_t)s.B * s.HV * s.K * s.V;
    P.no = (size_t)nv;
    LM_TRY(dev_buf(ctx, &P.in.q, 2 * (size_t)nq, err));
    LM_TRY(dev_buf(ctx, &P.in.k, 2 * (size_t)nq, err));
    LM_TRY(dev_buf(ctx, &P.in.v, 2 * (size_t)nv, err));
    LM_TRY(dev_buf(ctx, &P.in.g, 2 * (size_t)ng, err));
    LM_TRY(dev_buf(ctx, &P.in.beta, 2 * (size_t)nb, err));
    const void *a = nullptr, *b = nullptr;
    LM_TRY(dev_buf(ctx, &a, sizeof(float) * s.HV, err));
    LM_TRY(dev_buf(ctx, &b, sizeof(float) * (size_t)(s.HV * gk), err));
    P.in.A_log = (const float *)a;
    P.in.dt_bias = (const float *)b;
    LM_TRY(lm_cuda_ctx_alloc(ctx, (void **)&P.state, sizeof(float) * P.ns, err));
    LM_TRY(lm_cuda_ctx_alloc(ctx, (void **)&P.state0, sizeof(float) * P.ns, err));
    LM_TRY(lm_cuda_ctx_alloc(ctx, &P.o, 2 * P.no, err));
    LM_TRY(lm_cuda_fill_normal_bf16(ctx, (void *)P.in.q, nq, seed + 1, 0.0f, 1.0f, err));
    LM_TRY(lm_cuda_fill_normal_bf16(ctx, (void *)P.in.k, nq, seed + 2, 0.0f, 1.0f, err));
    LM_TRY(lm_cuda_fill_normal_bf16(ctx, (void *)P.in.v, nv, seed + 3, 0.0f, 1.0f, err));
    /* gate none takes the log-decay itself: keep it negative */
    const float gm = s.gate == LM_GATE_NONE ? -0.3f : 0.0f,
                gs = s.gate == LM_GATE_NONE ? 0.05f : 1.0f;
    LM_TRY(lm_cuda_fill_normal_bf16(ctx, (void *)P.in.g, ng, seed + 4, gm, gs, err));
    LM_TRY(lm_cuda_fill_normal_bf16(ctx, (void *)P.in.beta, nb, seed + 5, s.sig ? 0.0f : 0.5f,
                                    s.sig ? 1.0f : 0.1f, err));
    LM_TRY(lm_cuda_fill_normal_f32(ctx, (float *)P.in.A_log, s.HV, seed + 6, 1.0f, 0.5f, err));
    LM_TRY(
        lm_cuda_fill_normal_f32(ctx, (float *)P.in.dt_bias, s.HV * gk, seed + 7, 0.0f, 0.5f, err));
    LM_TRY(lm_cuda_fill_normal_f32(ctx, P.state0, (int64_t)P.ns, seed + 8, 0.0f, 0.2f, err));
    return LM_OK;
}

lm_status reset_state(Problem &P, lm_error *err) {
    LM_CK(cudaMemcpyAsync(P.state, P.state0, sizeof(float) * P.ns, cudaMemcpyDeviceToDevice,
                          P.ctx->stream));
    return LM_OK;
}

double rel_rms(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        const double d = (double)a[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* `steps` steps of `variant` from state0; o (as floats) and the state to the host. */
lm_status run_steps(Problem &P, int variant, int steps, float *o, float *S, lm_error *err) {
    LM_TRY(reset_state(P, err));
    LM_TRY(lm_cuda_ctx_memset(P.ctx, P.o, 0xff, 2 * P.no, err)); /* NaN: all written */
    for (int t = 0; t < steps; t++)
        LM_TRY(var_launch(P.ctx, &P.c, &P.in, P.state, P.o, variant, err));
    uint16_t *h = (uint16_t *)malloc(2 * P.no);
    if (!h)
        return lm_errorf(err, LM_ERR_NOMEM, "host o");
    lm_status st = lm_cuda_ctx_download(P.ctx, h, P.o, 2 * P.no, err);
    for (size_t i = 0; st == LM_OK && i < P.no; i++)
        o[i] = lm_bf16_to_f32(h[i]);
    free(h);
    LM_TRY(st);
    return lm_cuda_ctx_download(P.ctx, S, P.state, sizeof(float) * P.ns, err);
}

/* Part 1; returns the number of failures (-1 on an error). */
int check_variants(lm_cuda_ctx *ctx) {
    static const Shape shapes[] = {
        {"kda softplus gva2 K128 V128", LM_KDA, LM_GATE_SOFTPLUS, 0, 1, 2, 2, 4, 128, 128},
        {"gdn bounded K64 V96", LM_GDN, LM_GATE_BOUNDED, -5, 1, 3, 2, 2, 64, 96},
        {"kda none K256 V128", LM_KDA, LM_GATE_NONE, 0, 0, 1, 2, 2, 256, 128},
    };
    int failed = 0;
    for (int si = 0; si < 3; si++) {
        const Shape &s = shapes[si];
        lm_error err = {};
        Problem P;
        float *o_ref = nullptr, *S_ref = nullptr, *o = nullptr, *S = nullptr;
        lm_status st = problem_make(P, ctx, s, 40 + si, &err);
        if (st == LM_OK) {
            o_ref = (float *)malloc(sizeof(float) * P.no);
            o = (float *)malloc(sizeof(float) * P.no);
            S_ref = (float *)malloc(sizeof(float) * P.ns);
            S = (float *)malloc(sizeof(float) * P.ns);
            if (!o_ref || !o || !S_ref || !S)
                st = lm_errorf(&err, LM_ERR_NOMEM, "host buffers");
        }
        if (st == LM_OK)
            st = dec_check(&P.c, &P.in, P.state, P.o, &err);
        if (st == LM_OK)
            st = run_steps(P, 0, 3, o_ref, S_ref, &err);
        for (int v = 1; st == LM_OK && v < NVAR; v++) {
            st = run_steps(P, v, 3, o, S, &err);
            if (st != LM_OK)
                break;
            const double eo = rel_rms(o, o_ref, P.no), es = rel_rms(S, S_ref, P.ns);
            const bool ok = eo <= TOL_O && es <= TOL_STATE;
            failed += !ok;
            printf("check %-28s variant %d (%3d threads, %3d cols, %s): o %.2e  state %.2e  %s\n",
                   s.name, v, DEC_VARIANTS[v].nt, DEC_VARIANTS[v].vs,
                   DEC_VARIANTS[v].stream ? ".cs" : "-  ", eo, es, ok ? "ok" : "FAILED");
        }
        free(o_ref), free(o), free(S_ref), free(S);
        if (st != LM_OK) {
            fprintf(stderr, "check %s: %s\n", s.name, err.msg);
            return -1;
        }
    }
    return failed;
}

int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median time of one step of `variant` in ms (see the top of the file). */
lm_status time_variant(Problem &P, const lm_kda_config &c, int variant, lm_cuda_timer *tm,
                       int repeat, int calls, double *ms, lm_error *err) {
    double t[64];
    if (repeat > 64)
        repeat = 64;
    for (int i = 0; i < 10; i++)
        LM_TRY(var_launch(P.ctx, &c, &P.in, P.state, P.o, variant, err));
    for (int r = 0; r < repeat; r++) {
        LM_TRY(lm_cuda_timer_start(tm, err));
        for (int i = 0; i < calls; i++)
            LM_TRY(var_launch(P.ctx, &c, &P.in, P.state, P.o, variant, err));
        double x = 0;
        LM_TRY(lm_cuda_timer_stop(tm, &x, err));
        t[r] = x / calls;
    }
    qsort(t, (size_t)repeat, sizeof(double), cmp_double);
    *ms = t[repeat / 2];
    return LM_OK;
}

/* Part 2. */
lm_status bench_variants(lm_cuda_ctx *ctx, int quick, lm_error *err) {
    const Shape s = {"bench", LM_KDA, LM_GATE_SOFTPLUS, 0, 1, 64, 32, 32, 128, 128};
    const int repeat = quick ? 5 : 21, calls = quick ? 5 : 20;
    lm_cuda_limits lim;
    LM_TRY(lm_cuda_measure_limits(ctx, quick ? 3 : 10, &lim, err));
    Problem P;
    LM_TRY(problem_make(P, ctx, s, 77, err));
    LM_TRY(dec_check(&P.c, &P.in, P.state, P.o, err));
    LM_TRY(reset_state(P, err));
    lm_cuda_timer *tm = nullptr;
    LM_TRY(lm_cuda_timer_new(ctx, &tm, err));
    const double bytes = 2.0 * (double)P.ns * sizeof(float);
    printf("decode B=%d H=HV=%d K=V=%d: state traffic %.1f MB per step; copy bandwidth "
           "(lm_cuda_measure_limits) %.0f GB/s, floor %.1f us\n",
           s.B, s.HV, s.K, bytes / 1e6, lim.copy_gbs, bytes / lim.copy_gbs * 1e-3);
    lm_status st = LM_OK;
    for (int pass = 0; pass < 2 && st == LM_OK; pass++)
        for (int v = 0; v < NVAR && st == LM_OK; v++) {
            double ms = 0;
            st = time_variant(P, P.c, v, tm, repeat, calls, &ms, err);
            const double gbs = bytes / (ms * 1e-3) / 1e9;
            if (st == LM_OK)
                printf("  pass %d variant %d (%3d threads, %3d cols, %s)%s: %8.2f us/step  "
                       "%6.0f GB/s  %.3f of copy\n",
                       pass, v, DEC_VARIANTS[v].nt, DEC_VARIANTS[v].vs,
                       DEC_VARIANTS[v].stream ? ".cs" : "-  ", v == 0 ? " (production)" : "",
                       ms * 1e3, gbs, gbs / lim.copy_gbs);
        }
    static const int small_b[] = {1, 8, 16};
    for (int bi = 0; bi < 3 && st == LM_OK; bi++) {
        lm_kda_config cb = P.c;
        cb.B = small_b[bi];
        const double bb = 2.0 * (double)cb.B * s.HV * s.K * s.V * sizeof(float);
        printf("  B=%d:", cb.B);
        for (int v = 0; v < NVAR && st == LM_OK; v++) {
            double ms = 0;
            st = time_variant(P, cb, v, tm, repeat, calls, &ms, err);
            if (st == LM_OK)
                printf("  %d: %.2f us %.2f", v, ms * 1e3, bb / (ms * 1e-3) / 1e9 / lim.copy_gbs);
        }
        printf("  (us/step, fraction of copy)\n");
    }
    int64_t bad = 0, bs = 0;
    if (st == LM_OK)
        st = lm_cuda_count_nonfinite_bf16(ctx, P.o, (int64_t)P.no, &bad, err);
    if (st == LM_OK)
        st = lm_cuda_count_nonfinite_f32(ctx, P.state, (int64_t)P.ns, &bs, err);
    lm_cuda_timer_free(tm);
    LM_TRY(st);
    if (bad + bs)
        return lm_errorf(err, LM_ERR_IO, "bench: %lld non-finite o and %lld state values",
                         (long long)bad, (long long)bs);
    return LM_OK;
}

} // namespace

int main(int argc, char **argv) {
    const int quick = argc > 1 && !strcmp(argv[1], "--quick");
    if (lm_cuda_device_count() < 1) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    lm_error err = {};
    lm_cuda_ctx *ctx = nullptr;
    if (lm_cuda_ctx_new(&ctx, 0, &err) != LM_OK) {
        fprintf(stderr, "kda_decode_variants: %s\n", err.msg);
        return 1;
    }
    const int failed = check_variants(ctx);
    int rc = failed != 0;
    if (failed > 0)
        printf("%d variant checks FAILED\n", failed);
    if (bench_variants(ctx, quick, &err) != LM_OK) {
        fprintf(stderr, "kda_decode_variants: bench: %s\n", err.msg);
        rc = 1;
    }
    lm_cuda_ctx_free(ctx);
    return rc;
}
