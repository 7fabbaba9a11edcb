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
 * Algorithm: FlashAttention-2 (Dao, arXiv 2307.08691). Forward and backward run through
 * cuDNN's fused flash-attention engines where cuDNN builds a plan (dense batches, and packed
 * documents as ragged tensors with per-document lengths; lm_cuda_attention_set_impl /
 * set_bwd_impl below, graphs in src/ops/cuda/attention_cudnn.cu), else through our own
 * kernels. Our forward (Algorithm 1): one CTA (4 warps, 32 query rows each) per (128-query block,
 * query head), key / value blocks of 64 double-buffered in shared memory (cp.async), S = Q K^T and
 * O += P V on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators), online
 * softmax in base 2, the causal mask only on the blocks that cross the diagonal, blocks above it
 * skipped; heaviest query blocks first. Backward (Algorithm 2): Delta = rowsum(dO * O) first; then
 * one CTA (4 warps, 16 keys each) per (64-key block, kv head) that owns dK, dV of its keys in
 * registers and loops over the query heads of its group and the query blocks at and below the
 * diagonal, recomputing P from lse: dV += P^T dO, dS = P (dP - Delta), dK += scale dS^T Q, and dQ
 * += scale dS K into an fp32 accumulator in global memory. The dQ additions into one query block
 * happen in a fixed order (key block 0, 1, ...): each CTA takes a ticket (an atomic counter) that
 * fixes its place in that order and waits on a per-(query head, query block) counter before adding;
 * a CTA only ever waits on tickets smaller than its own, which belong to running CTAs, so the wait
 * always ends. Results are bitwise reproducible (the context option "deterministic" = 0 switches to
 * float atomics instead, FlashAttention-2's own scheme, faster and not reproducible). cuDNN's
 * backward follows the same option: "deterministic" = 1 builds its deterministic algorithm
 * (dS kept in cuDNN's workspace, dQ by a separate ordered GEMM; engines noted
 * non-deterministic are tried last), 0 its dQ accumulation with float atomics.
 * RoPE: q and k are rotated into bf16 copies before the kernels; dq and dk are rotated
 * back (R^T) in fp32 before their bf16 rounding. The decode step is split-K flash
 * decoding (Dao et al., "Flash-Decoding", 2023): the cache positions are split over CTAs
 * (one kv head and all query heads of its group per CTA, so every cache row is read
 * once; the split count chosen to fill the resident CTA slots in whole waves), each CTA's
 * four warps stream their own 16-row tiles through a three-stage cp.async pipeline with an
 * online softmax each and merge in warp order; each split writes an fp32 partial (max,
 * sum, weighted values), a second kernel merges them in a fixed order.
 * Other head dims (the small test configurations) run the simple kernels (set_impl SIMPLE
 * below forces them at any D): plain fp32 loops, one warp per output row (the row's
 * vector in shared memory, one lane per key or query of each chunk of 32 forming its dot
 * products, the softmax statistics by warp shuffles, the weighted sums in key / query
 * order); forward with an online softmax; backward as Delta = rowsum(dO * O), one warp per
 * query row for dq (over its keys) and one per (key, kv head) for dk, dv (over the query
 * heads of the group and the queries of the document that see the key). P is never rounded
 * to bf16; every sum has a fixed order (no atomics, whatever "deterministic" says), so
 * results are bitwise reproducible. Correct, not fast: O(T^2 D) work per head with scalar
 * loads, for small D and short documents.
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
 * Limits: 1 <= D <= 256, D even with RoPE; D = 64 and 128 run the FlashAttention-2
 * kernels or cuDNN, other D the simple kernels; the KV-cache writer and the decode step
 * take D = 64 or 128 only (LM_ERR_UNSUPPORTED otherwise). Causal only, B * T < 2^31.
 * cuDNN's backward refuses T = 1 dense batches (one query and one key: our kernel runs).
 *
 * Execution: asynchronous on the context's stream (include/linmoe/backend.h); scratch
 * from the context's grow-only buffers (slots A, B, C; the simple kernels: A for the
 * rotated q, k, C for Delta, 4 B*T*Hq bytes), the per-context tables (document
 * blocks, the RoPE cos / sin table) in the context's attention slot. A call allocates
 * only when a buffer must grow. No host synchronisation except inside those growths.
 * The cuDNN path keeps a cuDNN handle and up to 48 plans per context (created on first
 * use; a plan build takes host time once per shape key, so packed documents use buckets:
 * the document count padded with empty entries to 1, 2, 3, 4, 6, 8, 12, ... and the longest
 * document to 64, 96, 128, 192, ...; cuDNN's own allocations at handle creation are not
 * counted by lm_cuda_ctx_alloc_count). Its workspace comes from the context's scratch B;
 * the deterministic backward needs about b * Hq * s^2 * 2 bytes for b sequences of s
 * tokens, so it runs in chunks of batch rows (dense) or groups of documents (packed) whose
 * estimate fits lm_cuda_attention_set_cudnn_workspace_limit (default 2 GiB; a single row or
 * document always runs). With RoPE, cuDNN's dq, dk (w.r.t. the rotated q, k, bf16) are
 * rotated back in place: one more bf16 rounding than our kernel's fp32 rotation.
 *
 * Errors: LM_ERR_INVALID for a bad configuration or argument (the checks of
 * lm_attention_validate except the finiteness scan of device data; odd D with RoPE),
 * LM_ERR_UNSUPPORTED for D > 256, for D not in {64, 128} in the decode step, the cache
 * writer or a forced cuDNN call, or when linmoe was built without CUDA, LM_ERR_NOMEM /
 * LM_ERR_IO from CUDA (the message names the call).
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
 * heads of its group. Gradients are w.r.t. the un-rotated q, k. Scratch (ours): 4 B*T*Hq*D
 * bytes of fp32 dq accumulator plus, with RoPE, the rotated q, k copies; cuDNN's: the
 * stats and rowsum(dO o) (8 B*T*Hq bytes), with "deterministic" = 0 the fp32 dq
 * accumulator, for packed GQA 4 T*Hq*D bytes of per-query-head dk, dv, and cuDNN's
 * workspace (see set_cudnn_workspace_limit); the simple kernels' (D not 64 / 128): Delta
 * (4 B*T*Hq bytes) plus, with RoPE, the rotated q, k copies. */
lm_status lm_cuda_attention_backward(lm_cuda_ctx *ctx, lm_attention_config *c, const void *q,
                                     const void *k, const void *v, const void *o, const float *lse,
                                     const void *do_, void *dq, void *dk, void *dv, lm_error *err);

/* The op's RoPE on its own: y = R(p) x (inverse = 0) or R(p)^T x (inverse = 1) for x, y
 * bf16 [B, T, H, D] (H any head count; y may equal x), p the position of each token
 * inside its document (t for B rows, t - cu_seqlens[n] for packed documents), math in
 * fp32, one bf16 rounding. Uses c's B, T, D, cu_seqlens and rope_theta (position is
 * ignored: this always rotates). Errors as the forward (D even and <= 256 here). */
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

/* Which implementation runs the forward (set_impl) / the backward (set_bwd_impl) on this
 * context:
 *   LM_CUDA_ATTN_AUTO   (default) cuDNN's fused flash-attention engine when cuDNN builds a
 *                       plan for the call (dense [B, T] batches, or packed documents as
 *                       ragged tensors; plans built once per shape key and cached in the
 *                       context, a refused key remembered), linmoe's own kernels otherwise
 *                       (a shape cuDNN refuses, or a failed allocation of its workspace);
 *   LM_CUDA_ATTN_OWN    always linmoe's FlashAttention-2 kernels (the simple ones at other D);
 *   LM_CUDA_ATTN_CUDNN  cuDNN only: a refusal is an LM_ERR_UNSUPPORTED error naming cuDNN's
 *                       reason (tests use this); D not in {64, 128} is refused the same way;
 *   LM_CUDA_ATTN_SIMPLE the simple kernels at any D (a second, independent GPU path; tests).
 * At D not in {64, 128}, AUTO and OWN run the simple kernels.
 * Forward and backward may differ (lse has one meaning: natural-log log-sum-exp of the
 * scaled scores, [B, T, Hq] fp32). The backward honours the context option
 * "deterministic" in ours and cuDNN's (see the top of this file); the simple kernels are
 * always deterministic. The cuDNN graphs:
 * src/ops/cuda/attention_cudnn.cu. Errors: LM_ERR_INVALID for an unknown value. */
enum {
    LM_CUDA_ATTN_AUTO = 0,
    LM_CUDA_ATTN_OWN = 1,
    LM_CUDA_ATTN_CUDNN = 2,
    LM_CUDA_ATTN_SIMPLE = 3
};
lm_status lm_cuda_attention_set_impl(lm_cuda_ctx *ctx, int impl, lm_error *err);
lm_status lm_cuda_attention_set_bwd_impl(lm_cuda_ctx *ctx, int impl, lm_error *err);
/* The implementation that ran the last forward / backward on ctx (LM_CUDA_ATTN_OWN,
 * LM_CUDA_ATTN_CUDNN or LM_CUDA_ATTN_SIMPLE; 0 before the first). */
int lm_cuda_attention_last_impl(lm_cuda_ctx *ctx);
int lm_cuda_attention_last_bwd_impl(lm_cuda_ctx *ctx);

/* The estimated cuDNN workspace (bytes) one call of the deterministic cuDNN backward may
 * use: larger problems run as several calls over chunks of batch rows (dense; the largest
 * divisor of B that fits) or groups of documents (packed, longest first); a call of one row
 * or one document always runs. Default 2 GiB; 0 makes every call one row / one document
 * (tests). Errors: LM_ERR_INVALID for bytes < 0. */
lm_status lm_cuda_attention_set_cudnn_workspace_limit(lm_cuda_ctx *ctx, int64_t bytes,
                                                      lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
