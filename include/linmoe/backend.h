/* linmoe backends: devices, the CUDA context, and the memory plan.
 *
 * A device is `cpu` or `cuda:N`. Work on a CUDA device goes through an lm_cuda_ctx that
 * the caller owns: its stream, its cuBLAS / cuBLASLt handles and their workspace, its
 * per-op scratch buffers, caches (tensor maps, chunk tables), option flags and a pinned
 * host staging buffer. The library keeps no process-global mutable state: two contexts
 * (two threads, two GPUs, a trainer and a server) never share any of it, and every CUDA
 * entry point of linmoe takes the context it runs in (DESIGN.md "Devices, memory and
 * scale").
 *
 * Ordering: every op launched with a context is asynchronous on the context's stream.
 * Results are there for the next op on that stream, and for the host after
 * lm_cuda_ctx_sync or lm_cuda_ctx_download. A fault inside a kernel is reported by the
 * next synchronising call.
 *
 * What this module does not do: the math of any op (kda_cuda.h, cuda_ops.h), multi-GPU
 * communication (dist.h), or choosing a device for the caller.
 *
 * Errors: LM_ERR_INVALID for a bad argument (the message names it), LM_ERR_UNSUPPORTED
 * when linmoe was built without CUDA or the device is absent, LM_ERR_NOMEM when a device
 * or pinned allocation fails, LM_ERR_IO for any other CUDA runtime / library error (the
 * message names the call and the CUDA status string).
 */
#ifndef LINMOE_BACKEND_H
#define LINMOE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- devices */

/* lm_device_type and lm_device (a type and a CUDA ordinal) are defined in
 * include/linmoe/core.h, where lm_tensor carries one. */

/* Parses "cpu", "cuda" (= cuda:0) or "cuda:N" (N a non-negative decimal). `what` names
 * the source of the string for the error message (e.g. "--device"). Errors:
 * LM_ERR_INVALID naming `what` and the string. Does not check that the device exists. */
lm_status lm_device_parse(const char *s, const char *what, lm_device *out, lm_error *err);
/* "cpu" or "cuda:N" into buf (size bytes, NUL-terminated); returns buf. */
const char *lm_device_name(lm_device d, char *buf, size_t size);

/* ---------------------------------------------------------------- CUDA context */

typedef struct lm_cuda_ctx lm_cuda_ctx;

/* A new context on CUDA device `device` with a stream of its own (non-blocking with
 * respect to the legacy default stream). Errors: LM_ERR_UNSUPPORTED without CUDA or when
 * the ordinal is not present; LM_ERR_IO / LM_ERR_NOMEM from the runtime or cuBLAS. */
lm_status lm_cuda_ctx_new(lm_cuda_ctx **out, int device, lm_error *err);
/* The same on a stream the caller owns (a cudaStream_t passed as void *; NULL = the
 * legacy default stream), for FFI callers that order linmoe with their own work (PyTorch's
 * current stream). The context never destroys that stream. */
lm_status lm_cuda_ctx_new_on_stream(lm_cuda_ctx **out, int device, void *stream, lm_error *err);
/* Synchronises the stream, then frees everything the context owns. NULL is a no-op. */
void lm_cuda_ctx_free(lm_cuda_ctx *ctx);

int lm_cuda_ctx_device(const lm_cuda_ctx *ctx);
void *lm_cuda_ctx_stream(const lm_cuda_ctx *ctx); /* cudaStream_t */
/* Blocks until all work queued on the context's stream is done; reports any fault. */
lm_status lm_cuda_ctx_sync(lm_cuda_ctx *ctx, lm_error *err);

/* Device memory owned by the caller, allocated on the context's device. Every device
 * allocation linmoe makes through the context (here, scratch growth, library
 * workspaces) is counted, so a test can assert that a training step allocates nothing. */
lm_status lm_cuda_ctx_alloc(lm_cuda_ctx *ctx, void **ptr, size_t bytes, lm_error *err);
void lm_cuda_ctx_free_mem(lm_cuda_ctx *ctx, void *ptr);
/* Number of device (and pinned host) allocations made through this context so far. */
uint64_t lm_cuda_ctx_alloc_count(const lm_cuda_ctx *ctx);

/* Host <-> device copies on the context's stream. upload: the host bytes are copied
 * into the context's pinned staging buffer (grown when too small) and sent with
 * cudaMemcpyAsync, so `src` may be reused as soon as this returns. download: waits for
 * the stream, then copies (synchronous; src's producers on the stream are complete). */
lm_status lm_cuda_ctx_upload(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                             lm_error *err);
lm_status lm_cuda_ctx_download(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                               lm_error *err);
/* Device-side memset on the stream. */
lm_status lm_cuda_ctx_memset(lm_cuda_ctx *ctx, void *dst, int value, size_t bytes, lm_error *err);
/* The device's free and total memory in bytes (cudaMemGetInfo), either may be NULL. */
lm_status lm_cuda_ctx_mem_info(lm_cuda_ctx *ctx, size_t *free_bytes, size_t *total_bytes,
                               lm_error *err);
/* Device-to-device copy of `bytes` on the context's stream (asynchronous; the regions
 * must not overlap). */
lm_status lm_cuda_ctx_copy(lm_cuda_ctx *ctx, void *dst, const void *src, size_t bytes,
                           lm_error *err);

/* Option values a caller (benchmarks, dev/ experiments) may set on a context; the library
 * itself reads no environment variables. Keys and meanings:
 *   "kda.bv"        0 = choose, else 16 / 32 / 64 / 128: the recurrences' V-slice width
 *   "kda.wgmma"     1 (default) = the wgmma forward recurrence where it applies, 0 = mma.sync
 *   "kda.pdl"       1 (default) = programmatic dependent launch of the forward recurrence
 *   "kda.tma"       1 (default) = tensor-copy loads in the recurrences, 0 = cp.async
 *   "kda.profile"   1 = per-kernel event timing printed to stderr (0 default)
 *   "deterministic" 1 (default) = deterministic reductions everywhere
 *   "poison"        fill memory with 0xFF bytes (NaN) when it is handed out, to expose reads
 *                   of memory not written first (0 default; slow): a mask of 1 = the
 *                   context's allocations (lm_cuda_ctx_alloc), 2 = the ops' scratch requests,
 *                   4 = the KDA ops' own workspaces; 7 = all
 *   "poison.index"  -1 (default) = every allocation of mask bit 1, else only the one with this
 *                   index (the context's allocations counted from 0), to find a culprit
 * Errors: LM_ERR_INVALID for an unknown key or a value out of its range. */
lm_status lm_cuda_ctx_set_option(lm_cuda_ctx *ctx, const char *key, int value, lm_error *err);
int lm_cuda_ctx_get_option(const lm_cuda_ctx *ctx, const char *key); /* -1: unknown key */

/* ---------------------------------------------------------------- backend */

/* What an op runs on: a device and, for CUDA, the context (owned by the caller). */
typedef struct {
    lm_device device;
    lm_cuda_ctx *cuda; /* NULL for the CPU */
} lm_backend;

/* Ops a caller may ask lm_backend_supports about before starting work. */
typedef enum {
    LM_OP_EMBEDDING = 0,
    LM_OP_RMSNORM,
    LM_OP_GATED_RMSNORM,
    LM_OP_SHORT_CONV,
    LM_OP_GEMM,
    LM_OP_ATTENTION,
    LM_OP_KDA,
    LM_OP_MOE,
    LM_OP_ATTNRES,
    LM_OP_CROSS_ENTROPY,
    LM_OP_SWIGLU,
    LM_OP_ADAMW,
    LM_OP_COUNT
} lm_op;

const char *lm_op_name(lm_op op);

/* Whether `dev` can run `op` with `config` (the op's config struct: lm_kda_config *,
 * lm_attention_config *, lm_moe_config *, lm_attnres_config *, lm_short_conv_config *,
 * or NULL where the op has none). LM_OK when it can; LM_ERR_UNSUPPORTED with a message
 * naming the op, the config key and its value otherwise (e.g. "attention on cuda: head_dim
 * 96 is not supported (64, 128 or 256)"). Never touches a device. */
lm_status lm_backend_supports(lm_device dev, lm_op op, const void *config, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
