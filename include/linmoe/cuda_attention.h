/* linmoe attention on NVIDIA GPUs (CUDA C, sm_90a): causal grouped-query softmax attention
 * with bf16 storage, fp32 accumulation and fp32 softmax statistics; forward, backward,
 * RoPE inside the op, packed documents (cu_seqlens), the KV-cache writer and the decode
 * step. The GPU side of include/linmoe/attention.h: same math, configuration struct,
 * layouts (bf16 instead of fp32) and semantics.
 *
 * Math (include/linmoe/attention.h has it in full), per sequence n, query head h, kv head
 * g = h / (Hq / Hkv), query i and keys j <= i of the same document:
 *   s_ij = scale * (R(p_i) q_i) . (R(p_j) k_j),  lse_i = log sum_j exp(s_ij)  (nats),
 *   o_i = sum_j exp(s_ij - lse_i) v_j;
 * RoPE is the half-split (rotate_half, GPT-NeoX / Hugging Face Llama) rotation with
 * theta_f = p * rope_theta^(-2f/D), angles formed in fp64 and cos / sin rounded to fp32
 * (as lm_attn_rope_factors), p the position inside the document.
 *
 * Algorithm: FlashAttention-2 (Dao, arXiv 2307.08691). Forward: cuDNN's fused engine for
 * dense batches where it builds (lm_cuda_attention_set_impl below), else our own kernel
 * (Algorithm 1): one CTA (4 warps, 32 query rows each) per (128-query block, query
 * head), key / value blocks of 64 double-buffered in shared memory (cp.async), S = Q K^T
 * and O += P V on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators),
 * online softmax in base 2, the causal mask only on the blocks that cross the diagonal,
 * blocks above it skipped; heaviest query blocks first. Backward (Algorithm 2): Delta = rowsum(dO *
 * O) first; then one CTA (4 warps, 16 keys each) per (64-key block, kv head) that owns dK, dV of
 * its keys in registers and loops over the query heads of its group and the query blocks at and
 * below the diagonal, recomputing P from lse: dV += P^T dO, dS = P (dP - Delta),
 * dK += scale dS^T Q, and dQ += scale dS K into an fp32 accumulator in global memory.
 * The dQ additions into one query block happen in a fixed order (key block 0, 1, ...):
 * each CTA takes a ticket (an atomic counter) that fixes its place in that order and waits
 * on a per-(query head, query block) counter before adding; a CTA only ever waits on
 * tickets smaller than its own, which belong to running CTAs, so the wait always ends.
 * Results are bitwise reproducible (the context option "deterministic" = 0 switches to
 * float atomics instead, FlashAttention-2's own scheme, faster and not reproducible).
 * RoPE: q and k are rotated into bf16 copies before the kernels; dq and dk are rotated
 * back (R^T) in fp32 before their bf16 rounding. The decode step is split-K flash
 * decoding (Dao et al., "Flash-Decoding", 2023): the cache positions are split over CTAs
 * (one kv head and all query heads of its group per CTA, so every cache row is read
 * once), each writes an fp32 partial (max, sum, weighted values), a second kernel merges
 * them in a fixed order.
 *
 * Layouts (row-major, innermost last, device memory owned by the caller):
 *   q, o, do, dq      [B, T, Hq, D]   bf16
 *   k, v, dk, dv      [B, T, Hkv, D]  bf16
 *   lse               [B, T, Hq]      fp32, natural-log log-sum-exp of the scaled scores
 *   k_cache, v_cache  [B, Tmax, Hkv, D] bf16 (decode; k_cache holds rotated keys)
 *   cu_seqlens        HOST int64 [N+1] in the config (as lm_kda_cuda), only with B == 1;
 *                     empty and length-1 documents allowed. The op uploads what it needs
 *                     (document / block tables) itself and skips the upload when the
 *                     table is the same as in the previous call.
 * Every bf16 pointer must be 16-byte aligned (the kernels move 16-byte vectors), lse
 * 4-byte aligned.
 *
 * Limits: D = 64 or 128 (LM_ERR_UNSUPPORTED otherwise), causal only, B * T < 2^31.
 *
 * Execution: asynchronous on the context's stream (include/linmoe/backend.h); scratch
 * from the context's grow-only buffers (slots A, B, C), the per-context tables (document
 * blocks, the RoPE cos / sin table) in the context's attention slot. A call allocates
 * only when a buffer must grow. No host synchronisation except inside those growths.
 * The cuDNN path keeps a cuDNN handle and up to 32 plans per context (created on first
 * use; a plan build takes host time once per shape; cuDNN's own allocations at handle
 * creation are not counted by lm_cuda_ctx_alloc_count).
 *
 * Errors: LM_ERR_INVALID for a bad configuration or argument (the checks of
 * lm_attention_validate except the finiteness scan of device data), LM_ERR_UNSUPPORTED
 * for D not in {64, 128} or when linmoe was built without CUDA, LM_ERR_NOMEM / LM_ERR_IO
 * from CUDA (the message names the call).
 *
 * What this module does not do: non-causal or windowed masks, fp32 inputs, dropout,
 * attention bias, partial rotary dims, KV-cache allocation, paged caches.
 */
#ifndef LINMOE_CUDA_ATTENTION_H
#define LINMOE_CUDA_ATTENTION_H

#include "linmoe/attention.h"
#include "linmoe/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Forward. c: the CPU op's configuration (B, T, Hq, Hkv, D, cu_seqlens, scale, causal,
 * position, rope_theta; ws is ignored); sets c->N. q, k, v bf16 (layouts above); o bf16
 * [B,T,Hq,D] required, fully written; lse fp32 [B,T,Hq] may be NULL (inference), else
 * fully written and what lm_cuda_attention_backward needs. */
lm_status lm_cuda_attention_forward(lm_cuda_ctx *ctx, lm_attention_config *c, const void *q,
                                    const void *k, const void *v, void *o, float *lse,
                                    lm_error *err);

/* Backward of sum(o * do) given the forward's o and lse (nothing of size T^2 stored).
 * do_ bf16 [B,T,Hq,D]; dq bf16 [B,T,Hq,D], dk, dv bf16 [B,T,Hkv,D] overwritten (not
 * accumulated), every element written; dk, dv of a kv head sum over the Hq / Hkv query
 * heads of its group. Gradients are w.r.t. the un-rotated q, k. Scratch: 4 B*T*Hq*D
 * bytes of fp32 dq accumulator plus, with RoPE, the rotated q, k copies. */
lm_status lm_cuda_attention_backward(lm_cuda_ctx *ctx, lm_attention_config *c, const void *q,
                                     const void *k, const void *v, const void *o, const float *lse,
                                     const void *do_, void *dq, void *dk, void *dv, lm_error *err);

/* The op's RoPE on its own: y = R(p) x (inverse = 0) or R(p)^T x (inverse = 1) for x, y
 * bf16 [B, T, H, D] (H any head count; y may equal x), p the position of each token
 * inside its document (t for B rows, t - cu_seqlens[n] for packed documents), math in
 * fp32, one bf16 rounding. Uses c's B, T, D, cu_seqlens and rope_theta (position is
 * ignored: this always rotates). Errors as the forward (D even and <= 128 here). */
lm_status lm_cuda_attention_rope(lm_cuda_ctx *ctx, lm_attention_config *c, int H, const void *x,
                                 void *y, int inverse, lm_error *err);

/* Store c->T new tokens per batch row at cache positions pos .. pos+T-1 (semantics of
 * lm_attention_cache_write): k_cache[b, pos+t] = R(pos+t) k[b, t] (rotated with ROPE),
 * v_cache[b, pos+t] = v[b, t]. k, v bf16 [B,T,Hkv,D]; k_cache, v_cache bf16
 * [B,Tmax,Hkv,D], other positions untouched. Errors (LM_ERR_INVALID): the config checks,
 * cu_seqlens not NULL, pos < 0 or pos + T > Tmax. */
lm_status lm_cuda_attention_cache_write(lm_cuda_ctx *ctx, lm_attention_config *c, int64_t Tmax,
                                        int64_t pos, const void *k, const void *v, void *k_cache,
                                        void *v_cache, lm_error *err);

/* One decode step (semantics of lm_attention_decode): q bf16 [B,1,Hq,D] (c->T == 1) at
 * position pos of every row (rotated here with ROPE); the caches hold positions 0..pos as
 * written by lm_cuda_attention_cache_write. Writes o bf16 [B,1,Hq,D] and, when not NULL,
 * lse fp32 [B,1,Hq]. Reads each cache row once (all query heads of a group together);
 * fp32 softmax sums, split over CTAs and merged in a fixed order (deterministic).
 * Errors (LM_ERR_INVALID): the config checks, c->T != 1, 0 <= pos < Tmax violated,
 * cu_seqlens not NULL. */
lm_status lm_cuda_attention_decode(lm_cuda_ctx *ctx, lm_attention_config *c, int64_t Tmax,
                                   int64_t pos, const void *q, const void *k_cache,
                                   const void *v_cache, void *o, float *lse, lm_error *err);

/* ---------------------------------------------------------------- implementation choice */

/* Which implementation runs the forward on this context:
 *   LM_CUDA_ATTN_AUTO   (default) cuDNN's fused flash-attention engine for dense [B, T]
 *                       batches when cuDNN builds a plan for the shape (built once per
 *                       (B, T, Hq, Hkv, D) and cached in the context; a refused shape is
 *                       remembered), linmoe's own kernel otherwise (packed documents, or
 *                       a shape cuDNN refuses);
 *   LM_CUDA_ATTN_OWN    always linmoe's FlashAttention-2 kernel;
 *   LM_CUDA_ATTN_CUDNN  cuDNN only: a shape cuDNN refuses (or packed documents) is an
 *                       LM_ERR_UNSUPPORTED error naming cuDNN's reason (tests use this).
 * The backward is always linmoe's (deterministic; cuDNN's backward accumulates dQ with
 * float atomics). The cuDNN graph: src/ops/cuda/attention_cudnn.cu. Errors:
 * LM_ERR_INVALID for an unknown value. */
enum { LM_CUDA_ATTN_AUTO = 0, LM_CUDA_ATTN_OWN = 1, LM_CUDA_ATTN_CUDNN = 2 };
lm_status lm_cuda_attention_set_impl(lm_cuda_ctx *ctx, int impl, lm_error *err);
/* The implementation that ran the last forward on ctx (LM_CUDA_ATTN_OWN or
 * LM_CUDA_ATTN_CUDNN; 0 before the first). */
int lm_cuda_attention_last_impl(lm_cuda_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif
