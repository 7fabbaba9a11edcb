/* The CUDA context's layout, for linmoe's CUDA sources only (include/linmoe/backend.h is
 * the public side). Each op family keeps its per-context state in one slot of `ops`
 * (created on first use, freed with the context), so no CUDA source needs a static. */
#ifndef LINMOE_CUDA_CTX_CUH
#define LINMOE_CUDA_CTX_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "linmoe/backend.h"

/* Per-context state slots, one per op family. */
enum lm_cuda_slot {
    LM_SLOT_KDA_FWD = 0,
    LM_SLOT_KDA_TRAIN,
    LM_SLOT_KDA_DECODE,
    LM_SLOT_ATTENTION,
    LM_SLOT_MOE,
    LM_SLOT_ATTNRES,
    LM_SLOT_CE,
    LM_SLOT_GEMM,
    LM_SLOT_NORM,
    LM_SLOT_OPTIM,
    LM_SLOT_BENCH,
    LM_SLOT_COUNT
};

/* Scratch buffers (grow-only, ordered by the stream): one per use that must not alias
 * another within a call sequence. */
enum lm_cuda_scratch {
    LM_SCRATCH_A = 0,
    LM_SCRATCH_B,
    LM_SCRATCH_C,
    LM_SCRATCH_D,
    LM_SCRATCH_COUNT
};

struct lm_cuda_op_state {
    void *p;
    void (*destroy)(void *p); /* called by lm_cuda_ctx_free (stream synchronised first) */
};

struct lm_cuda_ctx {
    int device;
    cudaStream_t stream;
    bool own_stream;
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *lt_ws; /* cuBLASLt workspace */
    size_t lt_ws_bytes;
    void *scratch[LM_SCRATCH_COUNT];
    size_t scratch_cap[LM_SCRATCH_COUNT];
    unsigned char *pinned; /* staging for host -> device copies */
    size_t pinned_cap, pinned_used;
    cudaEvent_t pinned_done; /* recorded after the last staged copy */
    bool pinned_pending;
    int sm_count;
    /* options (backend.h lm_cuda_ctx_set_option) */
    int kda_bv, kda_wgmma, kda_pdl, kda_tma, kda_profile, deterministic, poison, poison_index;
    int n_ctx_alloc; /* lm_cuda_ctx_alloc calls so far (poison.index) */
    /* kernels opted in to large dynamic shared memory on this context's device */
    const void *opted[64];
    int n_opted;
    lm_cuda_op_state ops[LM_SLOT_COUNT];
    uint64_t n_alloc;
};

/* Error helpers shared by the CUDA sources: LM_ERR_NOMEM for an allocation failure,
 * LM_ERR_IO otherwise; the message names `what` (the call) and the CUDA string. */
lm_status lm_cuda_fail(lm_error *err, cudaError_t e, const char *what);
lm_status lm_cublas_fail(lm_error *err, cublasStatus_t s, const char *what);

#define LM_CK(call)                                                                                \
    do {                                                                                           \
        cudaError_t lm_e_ = (call);                                                                \
        if (lm_e_ != cudaSuccess)                                                                  \
            return lm_cuda_fail(err, lm_e_, #call);                                                \
    } while (0)
#define LM_CK_BLAS(call)                                                                           \
    do {                                                                                           \
        cublasStatus_t lm_s_ = (call);                                                             \
        if (lm_s_ != CUBLAS_STATUS_SUCCESS)                                                        \
            return lm_cublas_fail(err, lm_s_, #call);                                              \
    } while (0)
/* after a kernel launch */
#define LM_CK_LAUNCH(what)                                                                         \
    do {                                                                                           \
        cudaError_t lm_e_ = cudaGetLastError();                                                    \
        if (lm_e_ != cudaSuccess)                                                                  \
            return lm_cuda_fail(err, lm_e_, what);                                                 \
    } while (0)

/* Makes the context's device current for the calling thread (every entry point calls it
 * first: two contexts on two devices may be used from one thread). */
lm_status lm_cuda_ctx_enter(lm_cuda_ctx *ctx, lm_error *err);

/* Scratch slot `slot` of at least `bytes`, grown (after a stream synchronisation, and
 * counted) when smaller; the contents are undefined. */
lm_status lm_cuda_ctx_scratch(lm_cuda_ctx *ctx, int slot, size_t bytes, void **ptr, lm_error *err);

/* With the context option "poison" set: fills [ptr, ptr + bytes) with 0xFF bytes (NaN in
 * fp32 and bf16) on the context's stream, so that a read of memory nobody wrote shows as NaN
 * instead of reading what an earlier owner of the memory left there. */
lm_status lm_cuda_ctx_poison(lm_cuda_ctx *ctx, int kind, void *ptr, size_t bytes, lm_error *err);
enum { LM_POISON_ALLOC = 1, LM_POISON_SCRATCH = 2, LM_POISON_KDA = 4 };

/* True the first time `kernel` is seen by this context (then recorded): the caller sets
 * its shared-memory attribute. */
bool lm_cuda_ctx_first_use(lm_cuda_ctx *ctx, const void *kernel);

/* The op family's per-context state, NULL until set. */
inline void *lm_cuda_ctx_state(lm_cuda_ctx *ctx, lm_cuda_slot s) { return ctx->ops[s].p; }
inline void lm_cuda_ctx_set_state(lm_cuda_ctx *ctx, lm_cuda_slot s, void *p,
                                  void (*destroy)(void *)) {
    ctx->ops[s].p = p;
    ctx->ops[s].destroy = destroy;
}

/* Typed per-context state: T is default-constructed on first use and deleted with the
 * context. */
template <typename T> T *lm_cuda_ctx_get(lm_cuda_ctx *ctx, lm_cuda_slot s) {
    T *p = (T *)ctx->ops[s].p;
    if (!p) {
        p = new T();
        lm_cuda_ctx_set_state(ctx, s, p, [](void *q) { delete (T *)q; });
    }
    return p;
}

/* Grid size that fills the device for a grid-stride loop of n items, 256 threads. */
inline int lm_cuda_grid(const lm_cuda_ctx *ctx, int64_t n, int threads = 256) {
    int64_t b = (n + threads - 1) / threads;
    const int64_t cap = (int64_t)ctx->sm_count * 8;
    if (b > cap)
        b = cap;
    return b < 1 ? 1 : (int)b;
}

#endif
