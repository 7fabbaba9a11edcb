/* linmoe GPU benchmark helpers (src/ops/cuda/bench_cuda.cu): what a C benchmark
 * (bench/bench_kda_cuda.c, `linmoe bench kda --device cuda`) needs from the device
 * that is not an op: the machine's two limits measured in the same run, random
 * inputs generated on the device, a non-finite count, and a CUDA-event timer.
 *
 * The limits (CONVENTIONS.md "Benchmarks"):
 *   matmul rate  cuBLAS bf16 GEMM, n x n x n with n = 8192, fp32 accumulation
 *                (cublasGemmEx, CUBLAS_COMPUTE_32F, A, B, C bf16 column-major, no
 *                transposes, alpha 1, beta 0), 2 n^3 FLOP per call; median of
 *                `repeat` calls after 3 warm-up calls, each timed with CUDA events.
 *   copy bandwidth  cudaMemcpy device-to-device of 2 GiB; counted as 4 GiB of
 *                traffic (every byte read once and written once); median of
 *                `repeat` after one warm-up copy.
 * Units: TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s, ms = milliseconds.
 *
 * What this module does not do: the KDA ops (include/linmoe/kda_cuda.h), the table
 * or the JSON (bench/bench.h), multi-GPU, streams other than the default stream.
 * Everything runs on the given context's device and stream (include/linmoe/backend.h);
 * fills are asynchronous, counts, timer stops and the limits synchronise the stream.
 *
 * Errors: LM_ERR_UNSUPPORTED when linmoe was built without CUDA (the stub in
 * src/ops/nocuda/cuda_bench_stub.c) or no device is present; LM_ERR_NOMEM when a
 * device allocation fails; LM_ERR_IO for any other CUDA runtime or cuBLAS error
 * (the message names the call and the CUDA / cuBLAS status); LM_ERR_INVALID for a
 * bad argument (NULL pointer, negative count).
 */
#ifndef LINMOE_CUDA_BENCH_H
#define LINMOE_CUDA_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this linmoe has the CUDA kernels compiled in (0: the no-CUDA stubs).
 * Says nothing about a device being present (lm_cuda_device_count). */
int lm_cuda_built(void);

/* The current device: name (NUL-terminated, truncated to `size`), number of SMs,
 * global memory in bytes. Errors: LM_ERR_UNSUPPORTED (no CUDA / no device),
 * LM_ERR_IO. Any output pointer may be NULL. */
lm_status lm_cuda_device_info(char *name, size_t size, int *sm_count, size_t *mem_bytes,
                              lm_error *err);

typedef struct {
    int gemm_n;         /* 8192 */
    double gemm_ms;     /* median time of one GEMM */
    double bf16_tflops; /* 2 n^3 / gemm_ms, in 1e12 FLOP/s */
    size_t copy_bytes;  /* bytes copied per cudaMemcpy (2 GiB) */
    double copy_ms;     /* median time of one copy */
    double copy_gbs;    /* 2 * copy_bytes / copy_ms, in 1e9 bytes/s (read + written) */
} lm_cuda_limits;

/* Measure the two limits (see the top of this header); `repeat` >= 1 timed calls
 * each (the benchmark passes about 10, 3 with --quick). Allocates 384 MiB for the
 * GEMM and 4 GiB for the copy and frees them before returning. */
lm_status lm_cuda_measure_limits(lm_cuda_ctx *ctx, int repeat, lm_cuda_limits *lim, lm_error *err);

/* Fill n values of device memory with mean + std * z, z ~ N(0,1) from a counter-based
 * hash of (seed, index) (splitmix64, Box-Muller): the same seed gives the same values
 * on any device, and no generator state is kept. bf16: dst holds n uint16 bf16 values
 * (rounded to nearest even); f32: n floats. n == 0 is a no-op. */
lm_status lm_cuda_fill_normal_bf16(lm_cuda_ctx *ctx, void *dst, int64_t n, uint64_t seed,
                                   float mean, float std, lm_error *err);
lm_status lm_cuda_fill_normal_f32(lm_cuda_ctx *ctx, float *dst, int64_t n, uint64_t seed,
                                  float mean, float std, lm_error *err);

/* Count the NaN / Inf values among n device values (bf16 or fp32) into *count. */
lm_status lm_cuda_count_nonfinite_bf16(lm_cuda_ctx *ctx, const void *x, int64_t n, int64_t *count,
                                       lm_error *err);
lm_status lm_cuda_count_nonfinite_f32(lm_cuda_ctx *ctx, const float *x, int64_t n, int64_t *count,
                                      lm_error *err);

/* A pair of CUDA events on the context's stream: start records the first, stop
 * records the second, waits for it and returns the elapsed GPU time in ms (what
 * the stream did in between, host gaps between synchronous calls
 * included). Create with lm_cuda_timer_new, free with lm_cuda_timer_free (NULL is a
 * no-op). */
typedef struct lm_cuda_timer lm_cuda_timer;
lm_status lm_cuda_timer_new(lm_cuda_ctx *ctx, lm_cuda_timer **t, lm_error *err);
lm_status lm_cuda_timer_start(lm_cuda_timer *t, lm_error *err);
lm_status lm_cuda_timer_stop(lm_cuda_timer *t, double *ms, lm_error *err);
void lm_cuda_timer_free(lm_cuda_timer *t);

#ifdef __cplusplus
}
#endif
#endif
