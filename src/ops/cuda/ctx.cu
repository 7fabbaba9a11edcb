/* The CUDA context (include/linmoe/backend.h): stream, cuBLAS / cuBLASLt handles and
 * workspace, grow-only scratch, pinned staging, options and per-op-family state. */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "ops/cuda/ctx.cuh"

namespace {
constexpr size_t LT_WS_BYTES = 32u << 20; /* cuBLASLt workspace (Hopper guidance: 32 MiB) */
constexpr size_t PINNED_MIN = 1u << 20;

typedef int lm_cuda_ctx::*OptionField;
struct OptionDef {
    const char *key;
    int lo, hi;
    OptionField field;
};
const OptionDef OPTIONS[] = {
    {"kda.bv", 0, 128, &lm_cuda_ctx::kda_bv},
    {"kda.wgmma", 0, 1, &lm_cuda_ctx::kda_wgmma},
    {"kda.pdl", 0, 1, &lm_cuda_ctx::kda_pdl},
    {"kda.tma", 0, 1, &lm_cuda_ctx::kda_tma},
    {"kda.profile", 0, 1, &lm_cuda_ctx::kda_profile},
    {"deterministic", 0, 1, &lm_cuda_ctx::deterministic},
    {"poison", 0, 7, &lm_cuda_ctx::poison},
    {"poison.index", -1, 1 << 30, &lm_cuda_ctx::poison_index},
};
const OptionDef *find_option(const char *key) {
    if (!key)
        return nullptr;
    for (const OptionDef &o : OPTIONS)
        if (strcmp(o.key, key) == 0)
            return &o;
    return nullptr;
}
} // namespace

lm_status lm_cuda_fail(lm_error *err, cudaError_t e, const char *what) {
    return lm_errorf(err, e == cudaErrorMemoryAllocation ? LM_ERR_NOMEM : LM_ERR_IO, "cuda: %s: %s",
                     what, cudaGetErrorString(e));
}

lm_status lm_cublas_fail(lm_error *err, cublasStatus_t s, const char *what) {
    return lm_errorf(err, s == CUBLAS_STATUS_ALLOC_FAILED ? LM_ERR_NOMEM : LM_ERR_IO,
                     "cublas: %s: %s", what, cublasGetStatusString(s));
}

lm_status lm_cuda_ctx_enter(lm_cuda_ctx *ctx, lm_error *err) {
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: no context (NULL lm_cuda_ctx)");
    int cur = -1;
    LM_CK(cudaGetDevice(&cur));
    if (cur != ctx->device)
        LM_CK(cudaSetDevice(ctx->device));
    return LM_OK;
}

static lm_status ctx_init(lm_cuda_ctx *c, int device, void *stream, bool own, lm_error *err) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        n = 0;
    }
    if (n == 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "cuda: no CUDA device (the driver reports none)");
    if (device < 0 || device >= n)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "cuda: device cuda:%d is not present (%d device%s)", device, n,
                         n == 1 ? "" : "s");
    c->device = device;
    c->kda_wgmma = c->kda_pdl = c->kda_tma = 1;
    c->deterministic = 1;
    c->poison_index = -1;
    LM_CK(cudaSetDevice(device));
    LM_CK(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, device));
    if (own) {
        LM_CK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
        c->own_stream = true;
    } else {
        c->stream = (cudaStream_t)stream;
    }
    LM_CK(cudaEventCreateWithFlags(&c->pinned_done, cudaEventDisableTiming));
    LM_CK_BLAS(cublasCreate(&c->blas));
    LM_CK_BLAS(cublasSetStream(c->blas, c->stream));
    LM_CK_BLAS(cublasLtCreate(&c->lt));
    LM_CK(cudaMalloc(&c->lt_ws, LT_WS_BYTES));
    c->n_alloc++;
    c->lt_ws_bytes = LT_WS_BYTES;
    LM_CK_BLAS(cublasSetWorkspace(c->blas, c->lt_ws, c->lt_ws_bytes));
    return LM_OK;
}

static lm_status ctx_new(lm_cuda_ctx **out, int device, void *stream, bool own, lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: lm_cuda_ctx_new: NULL output pointer");
    *out = nullptr;
    lm_cuda_ctx *c = (lm_cuda_ctx *)calloc(1, sizeof *c);
    if (!c)
        return lm_errorf(err, LM_ERR_NOMEM, "cuda: out of host memory for a context");
    lm_status st = ctx_init(c, device, stream, own, err);
    if (st != LM_OK) {
        lm_cuda_ctx_free(c);
        return st;
    }
    *out = c;
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_new(lm_cuda_ctx **out, int device, lm_error *err) {
    return ctx_new(out, device, nullptr, true, err);
}

extern "C" lm_status lm_cuda_ctx_new_on_stream(lm_cuda_ctx **out, int device, void *stream,
                                               lm_error *err) {
    return ctx_new(out, device, stream, false, err);
}

extern "C" void lm_cuda_ctx_free(lm_cuda_ctx *c) {
    if (!c)
        return;
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != c->device)
        cudaSetDevice(c->device);
    if (c->stream || !c->own_stream)
        cudaStreamSynchronize(c->stream);
    for (lm_cuda_op_state &s : c->ops)
        if (s.p && s.destroy)
            s.destroy(s.p);
    for (void *p : c->scratch)
        if (p)
            cudaFree(p);
    if (c->lt_ws)
        cudaFree(c->lt_ws);
    if (c->pinned)
        cudaFreeHost(c->pinned);
    if (c->pinned_done)
        cudaEventDestroy(c->pinned_done);
    if (c->lt)
        cublasLtDestroy(c->lt);
    if (c->blas)
        cublasDestroy(c->blas);
    if (c->own_stream && c->stream)
        cudaStreamDestroy(c->stream);
    cudaGetLastError();
    if (cur >= 0 && cur != c->device)
        cudaSetDevice(cur);
    free(c);
}

extern "C" int lm_cuda_ctx_device(const lm_cuda_ctx *ctx) { return ctx ? ctx->device : -1; }
extern "C" void *lm_cuda_ctx_stream(const lm_cuda_ctx *ctx) {
    return ctx ? (void *)ctx->stream : nullptr;
}

extern "C" lm_status lm_cuda_ctx_sync(lm_cuda_ctx *ctx, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_CK(cudaStreamSynchronize(ctx->stream));
    LM_CK(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_alloc(lm_cuda_ctx *ctx, void **ptr, size_t bytes, lm_error *err) {
    if (!ptr)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: lm_cuda_ctx_alloc: NULL output pointer");
    *ptr = nullptr;
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *ptr = nullptr;
        cudaGetLastError();
        return lm_errorf(err, LM_ERR_NOMEM, "cuda: cudaMalloc(%zu bytes) on cuda:%d: %s", bytes,
                         ctx->device, cudaGetErrorString(e));
    }
    ctx->n_alloc++;
    const int idx = ctx->n_ctx_alloc++;
    if (ctx->poison_index >= 0 && idx != ctx->poison_index)
        return LM_OK;
    if (ctx->poison_index >= 0 && (ctx->poison & LM_POISON_ALLOC)) /* say which one it is */
        fprintf(stderr, "cuda: poisoned allocation %d: %zu bytes\n", idx, bytes);
    return lm_cuda_ctx_poison(ctx, LM_POISON_ALLOC, *ptr, bytes, err);
}

lm_status lm_cuda_ctx_poison(lm_cuda_ctx *ctx, int kind, void *ptr, size_t bytes, lm_error *err) {
    if ((ctx->poison & kind) && ptr && bytes)
        LM_CK(cudaMemsetAsync(ptr, 0xFF, bytes, ctx->stream));
    return LM_OK;
}

extern "C" void lm_cuda_ctx_free_mem(lm_cuda_ctx *ctx, void *ptr) {
    if (!ptr)
        return;
    if (ctx && lm_cuda_ctx_enter(ctx, nullptr) == LM_OK)
        cudaStreamSynchronize(ctx->stream);
    cudaFree(ptr);
}

extern "C" uint64_t lm_cuda_ctx_alloc_count(const lm_cuda_ctx *ctx) {
    return ctx ? ctx->n_alloc : 0;
}

lm_status lm_cuda_ctx_scratch(lm_cuda_ctx *ctx, int slot, size_t bytes, void **ptr, lm_error *err) {
    LM_CHECK(slot >= 0 && slot < LM_SCRATCH_COUNT);
    if (ctx->scratch_cap[slot] < bytes) {
        LM_CK(cudaStreamSynchronize(ctx->stream)); /* earlier work may still read the old one */
        if (ctx->scratch[slot])
            cudaFree(ctx->scratch[slot]);
        ctx->scratch[slot] = nullptr;
        ctx->scratch_cap[slot] = 0;
        const size_t cap = bytes + bytes / 8 + 256; /* a little headroom against regrowth */
        cudaError_t e = cudaMalloc(&ctx->scratch[slot], cap);
        if (e != cudaSuccess) {
            ctx->scratch[slot] = nullptr;
            cudaGetLastError();
            return lm_errorf(err, LM_ERR_NOMEM, "cuda: scratch of %zu bytes on cuda:%d: %s", cap,
                             ctx->device, cudaGetErrorString(e));
        }
        ctx->n_alloc++;
        ctx->scratch_cap[slot] = cap;
    }
    *ptr = ctx->scratch[slot];
    return lm_cuda_ctx_poison(ctx, LM_POISON_SCRATCH, *ptr, bytes, err); /* contents undefined */
}

bool lm_cuda_ctx_first_use(lm_cuda_ctx *ctx, const void *kernel) {
    for (int i = 0; i < ctx->n_opted; i++)
        if (ctx->opted[i] == kernel)
            return false;
    if (ctx->n_opted < (int)(sizeof ctx->opted / sizeof ctx->opted[0]))
        ctx->opted[ctx->n_opted++] = kernel;
    return true; /* a full table only costs a repeated attribute call */
}

extern "C" lm_status lm_cuda_ctx_upload(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                                        lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (bytes == 0)
        return LM_OK;
    if (!dst || !src)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: upload of %zu bytes with a NULL pointer",
                         bytes);
    if (ctx->pinned_used + bytes > ctx->pinned_cap) {
        /* every earlier staged copy is done once the last one is */
        if (ctx->pinned_pending)
            LM_CK(cudaEventSynchronize(ctx->pinned_done));
        ctx->pinned_pending = false;
        ctx->pinned_used = 0;
        if (bytes > ctx->pinned_cap) {
            if (ctx->pinned)
                cudaFreeHost(ctx->pinned);
            ctx->pinned = nullptr;
            ctx->pinned_cap = 0;
            size_t cap = PINNED_MIN;
            while (cap < bytes)
                cap *= 2;
            cudaError_t e = cudaMallocHost((void **)&ctx->pinned, cap);
            if (e != cudaSuccess) {
                ctx->pinned = nullptr;
                cudaGetLastError();
                return lm_errorf(err, LM_ERR_NOMEM, "cuda: pinned staging of %zu bytes: %s", cap,
                                 cudaGetErrorString(e));
            }
            ctx->n_alloc++;
            ctx->pinned_cap = cap;
        }
    }
    unsigned char *stage = ctx->pinned + ctx->pinned_used;
    memcpy(stage, src, bytes);
    LM_CK(cudaMemcpyAsync(dst, stage, bytes, cudaMemcpyHostToDevice, ctx->stream));
    LM_CK(cudaEventRecord(ctx->pinned_done, ctx->stream));
    ctx->pinned_pending = true;
    ctx->pinned_used += (bytes + 255) & ~(size_t)255;
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_download(lm_cuda_ctx *ctx, void *dst, const void *src,
                                          size_t bytes, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (bytes == 0)
        return LM_OK;
    if (!dst || !src)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: download of %zu bytes with a NULL pointer",
                         bytes);
    LM_CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx->stream));
    LM_CK(cudaStreamSynchronize(ctx->stream));
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_memset(lm_cuda_ctx *ctx, void *dst, int value, size_t bytes,
                                        lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (bytes)
        LM_CK(cudaMemsetAsync(dst, value, bytes, ctx->stream));
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_mem_info(lm_cuda_ctx *ctx, size_t *free_bytes,
                                          size_t *total_bytes, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    size_t f = 0, t = 0;
    LM_CK(cudaMemGetInfo(&f, &t));
    if (free_bytes)
        *free_bytes = f;
    if (total_bytes)
        *total_bytes = t;
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_copy(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                                      lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    if (bytes)
        LM_CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx->stream));
    return LM_OK;
}

extern "C" lm_status lm_cuda_ctx_set_option(lm_cuda_ctx *ctx, const char *key, int value,
                                            lm_error *err) {
    const OptionDef *o = find_option(key);
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: set_option on a NULL context");
    if (!o)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: unknown context option '%s'",
                         key ? key : "(null)");
    bool ok = value >= o->lo && value <= o->hi;
    if (strcmp(o->key, "kda.bv") == 0)
        ok = value == 0 || value == 16 || value == 32 || value == 64 || value == 128;
    if (!ok)
        return lm_errorf(err, LM_ERR_INVALID, "cuda: context option '%s': value %d out of range",
                         key, value);
    ctx->*(o->field) = value;
    return LM_OK;
}

extern "C" int lm_cuda_ctx_get_option(const lm_cuda_ctx *ctx, const char *key) {
    const OptionDef *o = find_option(key);
    return (ctx && o) ? ctx->*(o->field) : -1;
}
