/* `linmoe bench ops --device cuda` (bench/bench_ops.c): each CUDA op of the model, forward
 * and forward+backward, at the GPU configs' shapes (hidden 1024 / 2048, B*T = 32768
 * tokens, MoE 64 experts top-6 of width 512), against its floor: FLOPs at the bf16 matmul
 * rate and bytes at the copy bandwidth, both measured in the same run
 * (lm_cuda_measure_limits). Peers (torch SDPA, grouped-GEMM MoE, fla's fused modules,
 * torch's fused AdamW) run in scripts/gpu/bench_ops.py, which loads the same library and
 * calls lm_bench_ops_run in its own process before timing the peer on the same shapes.
 *
 * Each op family lives in bench/bench_ops_<name>.c and defines
 *   int lm_bench_ops_<name>(lm_bench_ops_env *env);
 * which times its ops with lm_bench_ops_time and reports each with lm_bench_ops_row.
 * Returns 0, or 1 after printing why (a CUDA error). */
#ifndef LINMOE_BENCH_OPS_H
#define LINMOE_BENCH_OPS_H

#include <cjson/cJSON.h>

#include "linmoe/backend.h"
#include "linmoe/cuda_bench.h"

typedef struct {
    lm_cuda_ctx *ctx;
    lm_cuda_limits lim; /* measured at the start of the run */
    lm_cuda_timer *timer;
    int repeat, warmup;
    int quick;
    void *flush;        /* LM_BENCH_OPS_FLUSH_BYTES of device memory, zeroed before each
                           timed call (the L2 flush of the peers' timer) */
    cJSON *records; /* JSON array the rows are appended to */
    const char *family; /* the family being run (recorded with each row) */
} lm_bench_ops_env;

/* The timed body: enqueue the op on env->ctx's stream; return 0, non-zero on error. */
typedef int (*lm_bench_ops_fn)(void *arg);

/* GPU time the warm-up of every timed op runs for at least (triton's do_bench: 25 ms). */
#define LM_BENCH_OPS_WARMUP_MS 50.0

/* Bytes zeroed before each timed call: several times the H200's 50 MB L2. */
#define LM_BENCH_OPS_FLUSH_BYTES ((size_t)256 << 20)

/* Median ms over env->repeat calls of fn after a warm-up of at least env->warmup calls and
 * LM_BENCH_OPS_WARMUP_MS of GPU time, each timed with events
 * on the context's stream, by the method of the peers' timer (triton.testing.do_bench,
 * scripts/gpu/bench_ops.py): before each timed call env->flush is zeroed on the same
 * stream, outside the events, so the call starts with a cold L2 and with the stream busy
 * (its launch overlaps the flush, as launches overlap earlier kernels inside a training
 * step; a call timed on an idle stream would count the launch latency, a few us, which
 * is 5-10 % of the ~40 us norm kernels). Returns a negative value if fn failed. */
double lm_bench_ops_time(lm_bench_ops_env *env, lm_bench_ops_fn fn, void *arg);

/* One row: family/op, shape text, pass ("fwd", "fwd+bwd", "step"), the median ms, the
 * FLOPs and the fewest bytes the pass must move. Prints ms, TFLOP/s, GB/s, the floor
 * max(flops / matmul rate, bytes / copy bandwidth) and floor / ms (the fraction of the
 * limit reached), and appends a record {name, shape, pass, ms, tflops, gbs, floor_ms,
 * ratio_to_limit, tokens, tokens_per_s}. tokens may be 0 (not a per-token op). */
void lm_bench_ops_row(lm_bench_ops_env *env, const char *op, const char *shape, const char *pass,
                      double ms, double flops, double bytes, double tokens);

/* Entry for FFI callers (scripts/gpu/bench_ops.py): runs the families named in the
 * comma-separated `families` (NULL or "" = all) and writes the JSON document to
 * json_path (NULL = none). Returns the exit code. */
int lm_bench_ops_run(const char *families, const char *json_path, int quick);

#endif
