/* GPU benchmark helpers (include/linmoe/cuda_bench.h): the matmul and copy limits,
 * device-side random fills, non-finite counts and a CUDA-event timer. Default
 * stream, current device, synchronous. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "linmoe/cuda_bench.h"
#include "linmoe/kda_cuda.h"
#include "ops/cuda/ctx.cuh"

namespace {

lm_status cuda_fail(lm_error *err, cudaError_t e, const char *what) {
    return lm_errorf(err, e == cudaErrorMemoryAllocation ? LM_ERR_NOMEM : LM_ERR_IO,
                     "cuda bench: %s: %s", what, cudaGetErrorString(e));
}

lm_status no_device(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "cuda bench: no CUDA device (the driver reports none, or no driver)");
}

/* splitmix64 finaliser of (seed, i): a counter-based generator, one value per index. */
__device__ __forceinline__ uint64_t mix64(uint64_t seed, uint64_t i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + (i + 1) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* N(0,1) by Box-Muller from the two 32-bit halves (both uniforms in (0, 1)). */
__device__ __forceinline__ float normal_at(uint64_t seed, uint64_t i) {
    const uint64_t h = mix64(seed, i);
    const float u1 = ((float)(uint32_t)(h >> 32) + 0.5f) * 2.3283064365386963e-10f;
    const float u2 = ((float)(uint32_t)h + 0.5f) * 2.3283064365386963e-10f;
    return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void fill_normal_bf16_kernel(__nv_bfloat16 *x, int64_t n, uint64_t seed, float mean,
                                        float std) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16_rn(mean + std * normal_at(seed, (uint64_t)i));
}

__global__ void fill_normal_f32_kernel(float *x, int64_t n, uint64_t seed, float mean, float std) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = mean + std * normal_at(seed, (uint64_t)i);
}

template <typename T> __device__ __forceinline__ float as_float(T v);
template <> __device__ __forceinline__ float as_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float as_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T>
__global__ void count_nonfinite_kernel(const T *x, int64_t n, unsigned long long *count) {
    unsigned long long bad = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        bad += !isfinite(as_float(x[i]));
    if (bad)
        atomicAdd(count, bad);
}

unsigned grid_for(int64_t n) {
    int64_t b = (n + 255) / 256;
    if (b > 8192)
        b = 8192;
    return (unsigned)(b < 1 ? 1 : b);
}

template <typename T>
lm_status count_nonfinite(lm_cuda_ctx *ctx, const T *x, int64_t n, int64_t *count, lm_error *err) {
    if (!count || (n > 0 && !x) || n < 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "cuda bench: count_nonfinite: bad arguments (n = %lld)", (long long)n);
    *count = 0;
    if (n == 0)
        return LM_OK;
    unsigned long long *d = nullptr, h = 0;
    cudaError_t e = cudaMalloc(&d, sizeof(*d));
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaMalloc(counter)");
    e = cudaMemset(d, 0, sizeof(*d));
    if (e == cudaSuccess) {
        count_nonfinite_kernel<T><<<grid_for(n), 256, 0, ctx->stream>>>(x, n, d);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, ctx->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(ctx->stream);
    cudaFree(d);
    if (e != cudaSuccess)
        return cuda_fail(err, e, "count_nonfinite_kernel");
    *count = (int64_t)h;
    return LM_OK;
}

int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double median(double *a, int n) {
    qsort(a, (size_t)n, sizeof(double), cmp_double);
    return (n % 2) ? a[n / 2] : 0.5 * (a[n / 2 - 1] + a[n / 2]);
}

} // namespace

struct lm_cuda_timer {
    cudaEvent_t start, stop;
    cudaStream_t stream;
};

extern "C" int lm_cuda_built(void) { return 1; }

extern "C" lm_status lm_cuda_device_info(char *name, size_t size, int *sm_count, size_t *mem_bytes,
                                         lm_error *err) {
    if (lm_cuda_device_count() < 1)
        return no_device(err);
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaGetDevice");
    cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, dev);
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaGetDeviceProperties");
    if (name && size > 0) {
        strncpy(name, p.name, size - 1);
        name[size - 1] = '\0';
    }
    if (sm_count)
        *sm_count = p.multiProcessorCount;
    if (mem_bytes)
        *mem_bytes = p.totalGlobalMem;
    return LM_OK;
}

extern "C" lm_status lm_cuda_fill_normal_bf16(lm_cuda_ctx *ctx, void *dst, int64_t n, uint64_t seed,
                                              float mean, float std, lm_error *err) {
    if (n < 0 || (n > 0 && !dst))
        return lm_errorf(err, LM_ERR_INVALID,
                         "cuda bench: fill_normal_bf16: bad arguments (n = %lld)", (long long)n);
    if (n == 0)
        return LM_OK;
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    fill_normal_bf16_kernel<<<grid_for(n), 256, 0, ctx->stream>>>((__nv_bfloat16 *)dst, n, seed,
                                                                  mean, std);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? LM_OK : cuda_fail(err, e, "fill_normal_bf16_kernel");
}

extern "C" lm_status lm_cuda_fill_normal_f32(lm_cuda_ctx *ctx, float *dst, int64_t n, uint64_t seed,
                                             float mean, float std, lm_error *err) {
    if (n < 0 || (n > 0 && !dst))
        return lm_errorf(err, LM_ERR_INVALID,
                         "cuda bench: fill_normal_f32: bad arguments (n = %lld)", (long long)n);
    if (n == 0)
        return LM_OK;
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    fill_normal_f32_kernel<<<grid_for(n), 256, 0, ctx->stream>>>(dst, n, seed, mean, std);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? LM_OK : cuda_fail(err, e, "fill_normal_f32_kernel");
}

extern "C" lm_status lm_cuda_count_nonfinite_bf16(lm_cuda_ctx *ctx, const void *x, int64_t n,
                                                  int64_t *count, lm_error *err) {
    return count_nonfinite(ctx, (const __nv_bfloat16 *)x, n, count, err);
}

extern "C" lm_status lm_cuda_count_nonfinite_f32(lm_cuda_ctx *ctx, const float *x, int64_t n,
                                                 int64_t *count, lm_error *err) {
    return count_nonfinite(ctx, x, n, count, err);
}

extern "C" lm_status lm_cuda_timer_new(lm_cuda_ctx *ctx, lm_cuda_timer **t, lm_error *err) {
    if (!t)
        return lm_errorf(err, LM_ERR_INVALID, "cuda bench: timer_new: NULL timer pointer");
    *t = nullptr;
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    lm_cuda_timer *p = (lm_cuda_timer *)calloc(1, sizeof(*p));
    if (!p)
        return lm_errorf(err, LM_ERR_NOMEM, "cuda bench: timer_new: out of host memory");
    cudaError_t e = cudaEventCreate(&p->start);
    if (e != cudaSuccess) {
        free(p);
        return cuda_fail(err, e, "cudaEventCreate");
    }
    e = cudaEventCreate(&p->stop);
    if (e != cudaSuccess) {
        cudaEventDestroy(p->start);
        free(p);
        return cuda_fail(err, e, "cudaEventCreate");
    }
    p->stream = ctx->stream;
    *t = p;
    return LM_OK;
}

extern "C" lm_status lm_cuda_timer_start(lm_cuda_timer *t, lm_error *err) {
    if (!t)
        return lm_errorf(err, LM_ERR_INVALID, "cuda bench: timer_start: NULL timer");
    cudaError_t e = cudaEventRecord(t->start, t->stream);
    return e == cudaSuccess ? LM_OK : cuda_fail(err, e, "cudaEventRecord(start)");
}

extern "C" lm_status lm_cuda_timer_stop(lm_cuda_timer *t, double *ms, lm_error *err) {
    if (!t || !ms)
        return lm_errorf(err, LM_ERR_INVALID, "cuda bench: timer_stop: NULL timer or ms");
    float f = 0;
    cudaError_t e = cudaEventRecord(t->stop, t->stream);
    if (e == cudaSuccess)
        e = cudaEventSynchronize(t->stop);
    if (e == cudaSuccess)
        e = cudaEventElapsedTime(&f, t->start, t->stop);
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaEventRecord/Synchronize/ElapsedTime(stop)");
    *ms = (double)f;
    return LM_OK;
}

extern "C" void lm_cuda_timer_free(lm_cuda_timer *t) {
    if (!t)
        return;
    cudaEventDestroy(t->start);
    cudaEventDestroy(t->stop);
    free(t);
}

/* ------------------------------------------------------------------ the limits */

#define CKL(call, what)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            st = cuda_fail(err, e_, what);                                                         \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

#define CKB(call, what)                                                                            \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            st = lm_errorf(err, s_ == CUBLAS_STATUS_ALLOC_FAILED ? LM_ERR_NOMEM : LM_ERR_IO,       \
                           "cuda bench: %s: %s", what, cublasGetStatusString(s_));                 \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

static lm_status measure_gemm(lm_cuda_ctx *ctx, int repeat, lm_cuda_limits *lim, lm_error *err) {
    const int n = 8192;
    const size_t nn = (size_t)n * n;
    const float alpha = 1.0f, beta = 0.0f;
    lm_status st = LM_OK;
    void *A = nullptr, *B = nullptr, *C = nullptr;
    cublasHandle_t h = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    double *ms = (double *)malloc(sizeof(double) * (size_t)repeat);
    if (!ms)
        return lm_errorf(err, LM_ERR_NOMEM, "cuda bench: out of host memory");
    CKL(cudaMalloc(&A, nn * 2), "cudaMalloc(GEMM A, 128 MiB)");
    CKL(cudaMalloc(&B, nn * 2), "cudaMalloc(GEMM B, 128 MiB)");
    CKL(cudaMalloc(&C, nn * 2), "cudaMalloc(GEMM C, 128 MiB)");
    /* random normal operands: the GEMM's power draw, hence its clock, depends on the data */
    if ((st = lm_cuda_fill_normal_bf16(ctx, A, (int64_t)nn, 101, 0.0f, 1.0f, err)) != LM_OK ||
        (st = lm_cuda_fill_normal_bf16(ctx, B, (int64_t)nn, 102, 0.0f, 1.0f, err)) != LM_OK)
        goto done;
    CKB(cublasCreate(&h), "cublasCreate");
    CKB(cublasSetStream(h, ctx->stream), "cublasSetStream");
    CKL(cudaEventCreate(&e0), "cudaEventCreate");
    CKL(cudaEventCreate(&e1), "cudaEventCreate");
    for (int i = 0; i < 3 + repeat; i++) {
        CKL(cudaEventRecord(e0, ctx->stream), "cudaEventRecord");
        CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, A, CUDA_R_16BF, n, B,
                         CUDA_R_16BF, n, &beta, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx(bf16 8192^3, fp32 accumulation)");
        CKL(cudaEventRecord(e1, ctx->stream), "cudaEventRecord");
        CKL(cudaEventSynchronize(e1), "cudaEventSynchronize(GEMM)");
        float f = 0;
        CKL(cudaEventElapsedTime(&f, e0, e1), "cudaEventElapsedTime");
        if (i >= 3)
            ms[i - 3] = f;
    }
    lim->gemm_n = n;
    lim->gemm_ms = median(ms, repeat);
    lim->bf16_tflops = 2.0 * n * (double)n * n / (lim->gemm_ms * 1e-3) / 1e12;
done:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    if (h)
        cublasDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    free(ms);
    return st;
}

static lm_status measure_copy(lm_cuda_ctx *ctx, int repeat, lm_cuda_limits *lim, lm_error *err) {
    const size_t bytes = (size_t)2 << 30;
    lm_status st = LM_OK;
    void *src = nullptr, *dst = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    double *ms = (double *)malloc(sizeof(double) * (size_t)repeat);
    if (!ms)
        return lm_errorf(err, LM_ERR_NOMEM, "cuda bench: out of host memory");
    CKL(cudaMalloc(&src, bytes), "cudaMalloc(copy source, 2 GiB)");
    CKL(cudaMalloc(&dst, bytes), "cudaMalloc(copy destination, 2 GiB)");
    CKL(cudaMemset(src, 1, bytes), "cudaMemset(copy source)");
    CKL(cudaMemset(dst, 0, bytes), "cudaMemset(copy destination)");
    CKL(cudaEventCreate(&e0), "cudaEventCreate");
    CKL(cudaEventCreate(&e1), "cudaEventCreate");
    for (int i = 0; i < 1 + repeat; i++) {
        CKL(cudaEventRecord(e0, ctx->stream), "cudaEventRecord");
        CKL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx->stream),
            "cudaMemcpy(2 GiB, D2D)");
        CKL(cudaEventRecord(e1, ctx->stream), "cudaEventRecord");
        CKL(cudaEventSynchronize(e1), "cudaEventSynchronize(copy)");
        float f = 0;
        CKL(cudaEventElapsedTime(&f, e0, e1), "cudaEventElapsedTime");
        if (i >= 1)
            ms[i - 1] = f;
    }
    lim->copy_bytes = bytes;
    lim->copy_ms = median(ms, repeat);
    lim->copy_gbs = 2.0 * (double)bytes / (lim->copy_ms * 1e-3) / 1e9;
done:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(src);
    cudaFree(dst);
    free(ms);
    return st;
}

extern "C" lm_status lm_cuda_measure_limits(lm_cuda_ctx *ctx, int repeat, lm_cuda_limits *lim,
                                            lm_error *err) {
    if (!lim || repeat < 1)
        return lm_errorf(
            err, LM_ERR_INVALID,
            "cuda bench: measure_limits: lim must be non-NULL and repeat >= 1 (got %d)", repeat);
    memset(lim, 0, sizeof(*lim));
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    lm_status st = measure_gemm(ctx, repeat, lim, err);
    if (st == LM_OK)
        st = measure_copy(ctx, repeat, lim, err);
    return st;
}
