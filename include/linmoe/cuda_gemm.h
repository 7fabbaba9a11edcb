/* linmoe GEMM and the LM head fused with cross-entropy on NVIDIA GPUs (CUDA C, sm_90a).
 *
 * 1. lm_cuda_gemm / lm_cuda_gemm_ex: the one matrix multiply of the GPU backend,
 *        C[M,N] = alpha * op(A)[M,K] op(B)[K,N] + beta * C  (+ bias[N] on every row)
 *    row-major like lm_sgemm (include/linmoe/core.h, the CPU reference): op(X) = X or X^T,
 *    A and B bf16, C bf16 or fp32, fp32 accumulation (CUBLAS_COMPUTE_32F), through
 *    cuBLASLt on the context's stream and workspace. Row-major is the usual swap: C^T =
 *    op(B)^T op(A)^T in column-major. fp32 C with beta = 1 is how weight gradients
 *    accumulate in place (dW += dY^T X; DESIGN.md numerics). The matmul descriptor, the
 *    three layouts and the heuristic's algorithm are cached per (transposes, M, N, K, ld*,
 *    C type, epilogue, batch and strides, pointer alignments) in the context (LM_SLOT_GEMM,
 *    128 entries, least recently used replaced), so a steady-state call makes no heuristic
 *    query and no allocation. When cuBLASLt offers no algorithm for a shape (odd leading
 *    dimensions, unaligned pointers) the call falls back to cublasGemmEx on the same stream
 *    (then a bias is added by a separate kernel). Deterministic: cuBLASLt's algorithms give
 *    the same bits for the same shape, algorithm and device (no atomics are enabled).
 *
 * 2. lm_cuda_ce_forward_backward / lm_cuda_ce_forward: the LM head (untied or tied: W is
 *    the embedding then) and the token cross-entropy, the math of lm_cross_entropy_forward
 *    / _backward / _nll (include/linmoe/layers.h, src/ops/cross_entropy.c):
 *        logits[n,v] = h[n,:] . W[v,:],   lse[n] = log sum_v exp(logits[n,v])
 *        nll[n] = lse[n] - logits[n, label[n]]  (0 where label[n] == ignore_index)
 *        dlogits = scale * (softmax(logits) - onehot(label))   (0 on ignored rows)
 *        dh = dlogits W,   dW += dlogits^T h
 *    The [N, V] logits never exist: tokens go in chunks of Nc rows (chunk_rows, or the
 *    largest power of two whose logits fit LM_CUDA_CE_SCRATCH_BYTES, balanced over N).
 *    Per chunk: one GEMM for the logits (bf16 by default, as torch and fla; fp32 with
 *    logits_bf16 = 0), one row kernel (a CTA per row; by default the row is staged in
 *    shared memory so HBM sees one read and one write: max, sum exp, lse, nll, then
 *    the bf16 dlogits over the logits in place), the dh GEMM (split over the vocabulary
 *    into fp32 partials summed in a fixed order when the chunk is too short to fill the
 *    GPU, dh_split) and the dW GEMM (fp32, beta = 1). Every sum has a fixed order, so
 *    the results are bitwise reproducible. The backward does not recompute the logits
 *    (the CPU does: it has no room for them), so a training step costs 3 GEMMs of
 *    2 N D V FLOPs plus one read and one write of the bf16 [N, V] logits.
 *    bf16 logits: rounding perturbs each logit by at most 2^-9 of its magnitude, so a
 *    token's nll moves by at most 2^-8 max_v |logit| (lse and the target logit each by
 *    2^-9 of it), with random signs that average out in the loss; dlogits are rounded to
 *    bf16 in either mode, and the GEMMs accumulate in fp32.
 *
 * Layouts (device memory, row-major, innermost last; the caller owns every buffer):
 *   h       [N, D] bf16        final hidden states (after the final norm), row stride D
 *   W       [V, D] bf16        lm_head.weight (torch Linear layout), row stride D
 *   labels  [N] int32          target ids in [0, V) or ignore_index
 *   dh      [N, D] bf16        written (=)
 *   dW      [V, D] fp32        ACCUMULATED (+=): the caller zeroes it once per step
 *   nll     [N] fp32           per-token negative log-likelihood in nats (optional)
 *   loss_sum, count            device scalars [1], fp32 and int32, written (=): the sum of
 *                              nll over counted tokens and their number, so the caller
 *                              averages over micro-batches (loss = loss_sum / count);
 *                              pass different slots of one array per micro-batch and read
 *                              them all with one download per step.
 * A label outside [0, V) that is not ignore_index cannot be reported without a host
 * synchronisation: its row is counted, its nll is NaN (so loss_sum is NaN and the trainer's
 * non-finite check sees it) and its dlogits row is zero. Non-finite logits give NaN too.
 *
 * Errors (all functions): LM_ERR_INVALID for a bad argument (named with its value),
 * LM_ERR_UNSUPPORTED when linmoe was built without CUDA (src/ops/nocuda/gemm_stub.c) or
 * for row_kernel = LM_CUDA_CE_ROW_STAGED with a row too large for shared memory,
 * LM_ERR_NOMEM when scratch cannot grow, LM_ERR_IO for any other CUDA / cuBLAS error (the
 * message names the call and the status).
 *
 * What this module does not do: GEMMs with bf16 accumulation or fp8, grouped (per-expert)
 * GEMMs, z-loss or label smoothing (the CPU reference has neither), logit soft-capping.
 */
#ifndef LINMOE_CUDA_GEMM_H
#define LINMOE_CUDA_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "linmoe/backend.h"
#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- GEMM */

/* Storage type of C (and of the bias). A and B are always bf16. */
typedef enum { LM_CUDA_GEMM_BF16 = 0, LM_CUDA_GEMM_F32 = 1 } lm_cuda_gemm_type;

typedef enum {
    LM_CUDA_GEMM_EPI_NONE = 0,
    LM_CUDA_GEMM_EPI_BIAS = 1 /* + bias[n] on every row of C (cuBLASLt CUBLASLT_EPILOGUE_BIAS) */
} lm_cuda_gemm_epilogue;

/* The full description of one (optionally strided-batched) GEMM, row-major:
 *   for b in [0, batch):  C_b[M,N] = alpha * op(A_b) op(B_b) + beta * C_b (+ bias)
 *   A_b = A + b * stride_a  stored [M, K] (trans_a = 0) or [K, M] (trans_a = 1), bf16,
 *         row stride lda >= K (resp. M)
 *   B_b = B + b * stride_b  stored [K, N] (trans_b = 0) or [N, K] (trans_b = 1), bf16,
 *         row stride ldb >= N (resp. K)
 *   C_b = C + b * stride_c  [M, N], c_type, row stride ldc >= N; read only when beta != 0
 *         (beta = 0: C may hold anything, NaN included)
 *   bias  [N] of c_type, 16-byte aligned, the same for every batch (epilogue BIAS only)
 * Strides are in elements. batch = 0 or 1 means a single GEMM (strides ignored). M, N or
 * batch = 0 is a no-op; K = 0 gives C = beta * C (+ bias). C must not overlap A or B. */
typedef struct {
    int trans_a, trans_b;
    int M, N, K;
    float alpha, beta;
    const void *A;
    int64_t lda;
    const void *B;
    int64_t ldb;
    void *C;
    int64_t ldc;
    lm_cuda_gemm_type c_type;
    lm_cuda_gemm_epilogue epilogue;
    const void *bias;
    int batch;
    int64_t stride_a, stride_b, stride_c;
} lm_cuda_gemm_desc;

/* lm_sgemm's argument order, single GEMM, no epilogue: the common case. */
lm_status lm_cuda_gemm(lm_cuda_ctx *ctx, int trans_a, int trans_b, int M, int N, int K, float alpha,
                       const void *A, int64_t lda, const void *B, int64_t ldb, float beta, void *C,
                       int64_t ldc, lm_cuda_gemm_type c_type, lm_error *err);
/* Any GEMM of lm_cuda_gemm_desc. */
lm_status lm_cuda_gemm_ex(lm_cuda_ctx *ctx, const lm_cuda_gemm_desc *d, lm_error *err);

/* ---------------------------------------------------------------- LM head + cross-entropy */

/* Default bound on the chunk's scratch (the logits; in the fp32 mode the fp32 logits plus
 * the bf16 dlogits): at V = 50304 with bf16 logits it gives Nc = 4096 (412 MB), so the dW
 * GEMM's K = Nc keeps it compute-bound (the fp32 dW is read and written once per chunk)
 * and the dh GEMM [Nc, D] has a full wave of output tiles. */
#define LM_CUDA_CE_SCRATCH_BYTES ((size_t)512 << 20)

/* The row kernel (loss statistics and dlogits of one chunk). */
typedef enum {
    LM_CUDA_CE_ROW_AUTO = 0,   /* STAGED when the row fits in shared memory, else STREAM */
    LM_CUDA_CE_ROW_STAGED = 1, /* the row is copied once into shared memory (cp.async) and
                                  every pass reads it there: 16 ceil(V / 8) bytes (bf16
                                  logits) or 16 ceil(V / 4) (fp32) must fit the device's
                                  opt-in shared memory per block less 1 KB (H200: 231424
                                  bytes, V <= 115712 bf16, V <= 57856 fp32) */
    LM_CUDA_CE_ROW_STREAM = 2  /* the same passes (max, sum, gradient) each over the row in
                                  global memory, the later ones mostly from L2: any V */
} lm_cuda_ce_row_kernel;

typedef struct {
    int64_t N;        /* tokens, >= 0 */
    int D, V;         /* hidden size, vocabulary size, >= 1 */
    int ignore_index; /* label value skipped (-1, as the CPU); must lie outside [0, V) */
    /* gradient scale: dlogits = dloss * (softmax - onehot) / count when mean = 1 (the CPU's
     * lm_cross_entropy_backward; count is computed on the device from the labels, no host
     * sync), dloss * (softmax - onehot) when mean = 0 (the caller's scale, e.g. 1 / tokens
     * of the whole step across micro-batches). Must be finite. */
    float dloss;
    int mean;
    int chunk_rows;  /* tokens per chunk; 0 = from LM_CUDA_CE_SCRATCH_BYTES */
    int logits_bf16; /* 1 = bf16 logits (default: half the traffic, the loss from bf16-rounded
                        logits as in torch / fla), 0 = fp32 logits (the loss to fp32 rounding) */
    int row_kernel;  /* lm_cuda_ce_row_kernel; STAGED for a V that does not fit is refused */
    /* dh GEMM split over the vocabulary: 0 = auto (the fewest of 1, 2, 4, 8 giving at
     * least 128 output tiles of 128 x 256, halved until V allows it), 1 = none, 2..8 =
     * that many fp32 partial GEMMs in one strided batch, summed in index order into the
     * bf16 dh. A split S applies when V is a multiple of 8 S (16-byte aligned slices);
     * otherwise 1 is used. The result depends on S (rounding only), S only on the config. */
    int dh_split;
} lm_cuda_ce_config;

/* N, D, V as given; ignore_index -1, dloss 1, mean 1, chunk_rows 0, logits_bf16 1,
 * row_kernel AUTO, dh_split 0. */
static inline void lm_cuda_ce_config_default(lm_cuda_ce_config *c, int64_t N, int D, int V) {
    c->N = N, c->D = D, c->V = V;
    c->ignore_index = -1;
    c->dloss = 1.0f;
    c->mean = 1;
    c->chunk_rows = 0;
    c->logits_bf16 = 1;
    c->row_kernel = LM_CUDA_CE_ROW_AUTO;
    c->dh_split = 0;
}

/* Outputs (device pointers, see the layouts above). Any may be NULL: loss_sum / count /
 * nll are then not written; dh / dW NULL skip their GEMM (both NULL: the eval forward). */
typedef struct {
    float *loss_sum;
    int32_t *count;
    float *nll;
    void *dh;
    float *dW;
} lm_cuda_ce_outputs;

/* Bytes of context scratch one call takes for `c` (LM_SCRATCH_A: the chunk's logits and
 * dlogits, then the dh split's fp32 partials [S, Nc, D]; LM_SCRATCH_B: [N] per-token nll
 * when the caller gives none, plus 256 bytes), for a memory plan that wants to grow the
 * scratch before the first step. 0 for a bad config. */
size_t lm_cuda_ce_scratch_bytes(const lm_cuda_ce_config *c, int want_grad);

/* Training: loss (loss_sum, count, nll as requested), dh (=) and dW (+=) in one pass over
 * the chunks. The same config gives the same bits; another chunk_rows changes the order
 * in which dW sums the chunks, another dh_split the order of dh's sum (rounding only);
 * row_kernel never changes the bits. */
lm_status lm_cuda_ce_forward_backward(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, const void *h,
                                      const void *W, const int32_t *labels,
                                      const lm_cuda_ce_outputs *out, lm_error *err);

/* Evaluation: loss_sum, count and per-token nll (each may be NULL, not all three), no
 * gradient. The same as lm_cuda_ce_forward_backward with dh = dW = NULL. */
lm_status lm_cuda_ce_forward(lm_cuda_ctx *ctx, const lm_cuda_ce_config *c, const void *h,
                             const void *W, const int32_t *labels, float *loss_sum, int32_t *count,
                             float *nll, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
