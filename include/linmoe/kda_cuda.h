/* linmoe KDA / GDN on NVIDIA GPUs (CUDA C, sm_90a): the chunked forward of the gated
 * delta rule with bf16 inputs and outputs, fp32 accumulation and an fp32 state.
 *
 * Same math, layouts and configuration as include/linmoe/kda.h (lm_kda_config is
 * reused): reference/kda.md §1.2-1.3 (recurrence, gates), §2.1 (WY / UT chunk form),
 * §3 (16-token sub-tiles); Kimi Linear tech report (arXiv 2510.26692) Eqs. 6-9.
 *
 * Layouts (row-major, innermost last, device memory):
 *   q, k            [B, T, H, K]     bf16
 *   v, o            [B, T, HV, V]    bf16
 *   g               KDA: [B, T, HV, K]   GDN: [B, T, HV]   bf16 (the gate input)
 *   beta            [B, T, HV]       bf16
 *   A_log           [HV]             fp32 (optional)
 *   dt_bias         KDA: [HV*K]  GDN: [HV]   fp32 (optional)
 *   initial_state, final_state   [N, HV, K, V]   fp32 (optional)
 *   cu_seqlens      host int64 [N+1] in the config, only with B == 1 (packed varlen)
 *
 * Algorithm (this version, v9; docs/perf-notes.md has its numbers):
 *   kernel 1, one CTA (8 warps) per (64-token chunk, value head): gate activation,
 *     per-channel cumulative log-decay G (fp32), in-kernel l2norm / sigmoid; Aqk and
 *     Akk on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulation)
 *     in three rounds, with exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) for a
 *     reference row r. Bounded gate (T1 of the design; reference/kda.md §3.3): the
 *     32-row halves referenced at their middle row, where every factor is within
 *     exp(16 |lower_bound|) <= e^80, so the diagonal tiles share the matmul path; then
 *     rows 32..63 against keys 0..31 with the reference at row 47 (a key factor that
 *     flushes to zero drops a product below 5e-6). Other gates (softplus, none): rounds
 *     by 16-row blocks referenced at the row before the block (factors <= 1), the
 *     diagonal tiles with the per-pair exponent in fp32 (the safe path). Then
 *     X = (I + Akk)^-1 in place by 16x16 blocks (diagonal blocks by substitution, three
 *     block-row stages), and w = X (beta k e^G), u = X (beta v) on the tensor cores (X
 *     as bf16 hi + lo); w, u, q e^G, k e^(G_last - G), Aqk go to a bf16 workspace,
 *     e^G_last to an fp32 one;
 *   kernel 2, one CTA (4 warps, 8 in two column groups at 64 or 32 columns) per
 *     (sequence, value head, slice of 64, 32 or 16
 *     columns of V, chosen so that there is about a CTA per SM): the inter-chunk
 *     recurrence over the chunks in order (the delta rule is column-separable in V),
 *     the state slice in fp32 accumulator registers, each chunk's workspace tiles
 *     double-buffered in shared memory with cp.async; v' = u - w S, o = (q e^G) S +
 *     Aqk v', S <- e^G_last S + (k e^(G_last - G))^T v' on the tensor cores (S and
 *     v' enter as bf16, as in fla), o written as bf16.
 *
 * Limits: K <= 128, V <= 128 (LM_ERR_UNSUPPORTED otherwise). chunk_size and diag
 * of the config are accepted; the kernels always use 64-token chunks, and diag SAFE
 * forces the safe diagonal path with the bounded gate too.
 *
 * Context (include/linmoe/backend.h): every lm_kda_cuda_* entry point takes the
 * lm_cuda_ctx it runs on as its first argument: the device (made current for the call),
 * the stream every kernel, memset, copy and event goes on, the options (kda.bv,
 * kda.wgmma, kda.pdl, kda.tma, kda.profile; lm_cuda_ctx_set_option) and the per-context
 * state (workspaces, chunk-table cache, tensor maps, shared-memory opt-ins). Nothing is
 * kept in the process: two contexts can be used from two threads at the same time (one
 * context by one thread at a time). Calls are asynchronous on the context's stream:
 * results are there for the next work on that stream, and for the host after
 * lm_cuda_ctx_sync / lm_cuda_ctx_download; bad configurations and launch failures are
 * reported by the call, a fault inside a kernel at the next synchronising call. Device
 * pointers must be memory of the context's device.
 *
 * Errors: LM_ERR_INVALID for a NULL context or a bad configuration (the same checks as
 * lm_kda_validate minus the finiteness scan of device data), LM_ERR_UNSUPPORTED
 * when linmoe was built without CUDA, LM_ERR_NOMEM when a device buffer does not fit,
 * LM_ERR_IO for a CUDA runtime error (message names the call and the CUDA error string).
 */
#ifndef LINMOE_KDA_CUDA_H
#define LINMOE_KDA_CUDA_H

#include "linmoe/backend.h"
#include "linmoe/kda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const void *q, *k, *v, *g, *beta; /* bf16 device pointers */
    const float *A_log, *dt_bias;     /* fp32 device pointers or NULL */
    const float *initial_state;       /* fp32 device pointer or NULL (zeros) */
} lm_kda_cuda_inputs;

typedef struct {
    void *o;            /* bf16 [B,T,HV,V], required */
    float *final_state; /* fp32 [N,HV,K,V] or NULL */
} lm_kda_cuda_outputs;

/* Number of CUDA devices usable by linmoe (0 when built without CUDA, or when the
 * driver reports none). Never fails. */
int lm_cuda_device_count(void);

/* The chunked forward on ctx's device, asynchronous on ctx's stream (a synchronisation
 * per call would stall the caller's queue: it cost 30-90 us per call in
 * scripts/gpu/bench.sh, docs/perf-notes.md v9). Scratch is a device workspace of the
 * context, kept between calls and grown on demand (a growth synchronises the stream
 * first); calls on one stream are ordered, so one call's kernels finish before the next
 * one reuses it. The chunk tables go up through the context's pinned staging
 * (lm_cuda_ctx_upload), and only when they differ from the last ones at that place. At
 * about a sequence-head per SM (N * HV >= 120, V > 64) the recurrence runs on wgmma
 * (kda_inter_wg) and is launched programmatically dependent on the intra-chunk kernel: it
 * starts on a sequence-head once per-block flags in the workspace say that head's chunks
 * are written (the ordering with the rest of the stream is unchanged). Context options:
 * kda.wgmma = 0 selects the mma.sync recurrence instead, kda.pdl = 0 a plain launch
 * (docs/perf-notes.md v11); kda.bv = 16/32/64/128 forces the recurrences' V slice width
 * (0: chosen from N * HV); kda.profile = 1 prints per-kernel times on stderr (and
 * synchronises the stream per call). The mma.sync recurrences (here and in
 * lm_kda_cuda_backward's dh) load each chunk with the tensor copy engine through tensor
 * maps of the workspace; kda.tma = 0 selects cp.async, as does a driver that gives no
 * cuTensorMapEncodeTiled (docs/perf-notes.md v12). */
lm_status lm_kda_cuda_chunk_forward(lm_cuda_ctx *ctx, lm_kda_config *c,
                                    const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                    lm_error *err);

/* Stateless device memory helpers on the current device: plain cudaMalloc / cudaMemcpy
 * (synchronous, legacy default stream). linmoe code and tests use the context's
 * lm_cuda_ctx_alloc / _upload / _download / _free_mem instead (backend.h), which are
 * ordered on the context's stream and counted. Errors: LM_ERR_NOMEM (allocation),
 * LM_ERR_IO (copy), LM_ERR_UNSUPPORTED without CUDA. lm_cuda_free(NULL) is a no-op. */
lm_status lm_cuda_alloc(void **ptr, size_t bytes, lm_error *err);
void lm_cuda_free(void *ptr);
lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes, lm_error *err);
lm_status lm_cuda_download(void *dst, const void *src, size_t bytes, lm_error *err);

/* Flat entry point for FFI callers (Python ctypes in scripts/gpu/bench_kda.py, which
 * runs linmoe beside fla in one process on the same torch tensors, on a context made
 * with lm_cuda_ctx_new_on_stream on torch's current stream): the fields of
 * lm_kda_config as scalars, device pointers as in lm_kda_cuda_inputs/outputs
 * (A_log, dt_bias, h0, ht may be NULL), cu_seqlens a host pointer or NULL, gate an
 * lm_gate_mode, kind an lm_kda_kind, lower_bound 0 = none. Returns the status; on
 * error the message is copied to errbuf (errlen bytes, NUL-terminated). */
int lm_kda_cuda_forward_flat(lm_cuda_ctx *ctx, int B, int T, int H, int HV, int K, int V,
                             const int64_t *cu_seqlens, int n_cu_seqlens, int kind, int gate,
                             float lower_bound, float scale, int use_qk_l2norm_in_kernel,
                             int use_beta_sigmoid_in_kernel, const void *q, const void *k,
                             const void *v, const void *g, const void *beta, const float *A_log,
                             const float *dt_bias, const float *h0, void *o, float *ht,
                             char *errbuf, int errlen);

/* ------------------------------------------------------------------ decode step */
/* One recurrent step for a batch of sequences (serving), reference/kda.md §1.2, §1.3,
 * §6.3; per (sequence b, value head hv), with q/k head h = hv / (HV/H):
 *   q <- scale * l2norm?(q);  k <- l2norm?(k);  beta <- sigmoid?(beta)
 *   S <- Diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
 * Config: c->T == 1, c->B sequences, no cu_seqlens (LM_ERR_INVALID otherwise); kind,
 * gate (A_log / dt_bias optional), lower_bound, scale, use_qk_l2norm_in_kernel (eps
 * 1e-6 inside the sqrt) and use_beta_sigmoid_in_kernel as the chunked forward; sets
 * c->N = B. chunk_size, diag, ws and trusted_state are ignored.
 * Tensors (device memory, row-major, contiguous):
 *   in->q, in->k   [B,1,H,K]   bf16
 *   in->v          [B,1,HV,V]  bf16
 *   in->g          KDA: [B,1,HV,K]   GDN: [B,1,HV]   bf16 (the gate input)
 *   in->beta       [B,1,HV]    bf16
 *   in->A_log [HV], in->dt_bias (KDA [HV*K], GDN [HV])   fp32 or NULL
 *   state          [B,HV,K,V]  fp32, read and updated in place (in->initial_state
 *                  is ignored); any alignment (16-byte aligned with V % 4 == 0 takes
 *                  the vectorised path)
 *   o              [B,1,HV,V]  bf16 (every element written)
 * Limits: K <= 256, V <= 1024 (LM_ERR_UNSUPPORTED beyond).
 * Cost: the state is read once and written once (2*B*HV*K*V*4 bytes); one CTA of 128
 * threads per (b, hv, 64 value columns) keeps its state slice in registers. H200,
 * B = 64, H = HV = 32, K = V = 128: 73.8 us per step, 0.86 of the measured
 * device-to-device copy bandwidth (src/ops/cuda/kda_decode.cu has the numbers).
 * Asynchronous on ctx's stream (a decode step is tens of microseconds; a
 * synchronisation per layer would cost as much): bad configurations and launch
 * failures are reported here, a fault inside the kernel at the next synchronising
 * call (lm_cuda_ctx_sync, lm_cuda_ctx_download). No scratch, no host copy. Errors as the
 * chunked forward. */
lm_status lm_kda_cuda_decode_step(lm_cuda_ctx *ctx, lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                  float *state, void *o, lm_error *err);

/* FFI form of lm_kda_cuda_decode_step (same scalar conventions as
 * lm_kda_cuda_forward_flat: scale <= 0 means K^-0.5, lower_bound 0 = none; T is 1). */
int lm_kda_cuda_decode_flat(lm_cuda_ctx *ctx, int B, int H, int HV, int K, int V, int kind,
                            int gate, float lower_bound, float scale, int use_qk_l2norm_in_kernel,
                            int use_beta_sigmoid_in_kernel, const void *q, const void *k,
                            const void *v, const void *g, const void *beta, const float *A_log,
                            const float *dt_bias, float *state, void *o, char *errbuf, int errlen);

/* ------------------------------------------------------- training forward / backward */
/* The training forward and its backward (src/ops/cuda/kda_train.cu; the math is
 * docs/kda-math.md "Backward of one chunk", the kernel split follows reference/kda.md
 * §4.1; docs/perf-notes.md has the numbers).
 *
 * What a training forward keeps for its backward: device buffers it owns plus the
 * caller's input pointers (the caller keeps q, k, v, g, beta, A_log, dt_bias and
 * initial_state alive and unchanged until lm_kda_cuda_backward returns, as autograd
 * saves tensors). Per (64-token chunk, value head) block it saves, on top of the
 * forward's workspace: X = (I + beta P)^-1 (fp32 [64][64]), P (bf16 [64][64]), the row
 * factors of q, k and beta, the state at the chunk start (bf16 [128][128]) and v' (bf16
 * [64][128]) and Kg = nk k e^G (bf16 [64][128]): about 161 KB per block (1.3 GB at
 * B*T*H = 524288 token-heads). The cumulative log-decay G is recomputed by the backward
 * from the raw gate. A saved object belongs to the context of its forward (it remembers
 * it); lm_kda_cuda_saved_free keeps the largest freed buffer in that context for its next
 * training forward, so a loop of forward_train / backward / saved_free allocates only in
 * its first step. The backward uses a second scratch buffer of the context of about 129
 * KB per block (145 KB when V is not a multiple of 8 or do_ not 16-byte aligned) plus
 * 4*B*T*HV*K bytes, grown on demand; its partial gradients between kernels are bf16 (fp32
 * arithmetic). The parts of the fixed-order sums (Reproducibility below) add to it: KDA
 * 4*K bytes per block for ddt_bias and 4*ceil(K/32) for dA_log (plus 4*HV*K bytes per 256
 * chunks between the sums' passes when there are more than 256), GDN 4*ceil(K/32)*B*T*HV
 * bytes for the per-token dg parts and 8*HV bytes per 256 tokens for ddt_bias / dA_log.
 * Free every saved object before its context. */
typedef struct lm_kda_cuda_saved lm_kda_cuda_saved;

/* Upstream gradients in (bf16 do_ [B,T,HV,V], fp32 dht [N,HV,K,V] or NULL = zeros),
 * gradients out: dq, dk [B,T,H,K], dv [B,T,HV,V], dg (KDA [B,T,HV,K], GDN [B,T,HV]),
 * dbeta [B,T,HV] in bf16, with respect to the raw inputs (through the in-kernel l2norm,
 * scale, gate and sigmoid when enabled; GVA sums dq, dk over the value heads of a q/k
 * head); dh0 [N,HV,K,V], dA_log [HV], ddt_bias (KDA [HV*K], GDN [HV]) in fp32. Any
 * output may be NULL; dA_log / ddt_bias are zeros when the forward had no A_log /
 * dt_bias. Accuracy on the 28-case grid of tests/test_kda_cuda.c against the fp64
 * reference: dq <= 4.2e-3, dk <= 4.7e-3, dv <= 3.8e-3, dh0 <= 2.2e-3, dg <= 6.0e-3,
 * dbeta <= 8.4e-3, ddt_bias <= 4.0e-3 relative RMS error. Reproducibility: every output
 * (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias; KDA and GDN, dense and varlen) is the
 * same bits on every run of the same inputs on the same context options, device model and
 * build, whatever the context's "deterministic" option says (it is always so): no sum
 * uses float atomics. dbeta's row sums within a chunk are added in a fixed order in shared
 * memory; dA_log and ddt_bias are written per (chunk, 32-channel slice), and GDN's
 * per-token dg per slice, to the scratch, then summed in slice and chunk order by
 * reduction kernels whose grid and order depend on the shape alone (segments of 256 rows,
 * each summed by 8 interleaved lanes and then in lane order; the segments' sums likewise).
 * That costs one to three small launches per backward. */
typedef struct {
    const void *do_;
    const float *dht;
    void *dq, *dk, *dv, *dg, *dbeta;
    float *dh0, *dA_log, *ddt_bias;
} lm_kda_cuda_grads;

/* The forward of lm_kda_cuda_chunk_forward (same outputs) that also fills *saved
 * (allocated here, from ctx's spare buffer when it is large enough; free with
 * lm_kda_cuda_saved_free) for lm_kda_cuda_backward on the same context. Asynchronous on
 * ctx's stream, as lm_kda_cuda_chunk_forward. Errors as lm_kda_cuda_chunk_forward, plus
 * LM_ERR_NOMEM when the saved tensors do not fit; on any error *saved is NULL. */
lm_status lm_kda_cuda_forward_train(lm_cuda_ctx *ctx, lm_kda_config *c,
                                    const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                    lm_kda_cuda_saved **saved, lm_error *err);

/* The saved tensors in a buffer of the caller, for a memory plan that allocates them once
 * (a model with many KDA layers keeps one per layer: the context has a single spare).
 *
 * lm_kda_cuda_saved_bytes: device bytes the training forward of c saves for its batch (B,
 * T, HV, cu_seqlens; a function of the number of 64-token chunks, sequences and value
 * heads only); 0 for a batch shape the forward refuses (B, T, HV < 1, bad cu_seqlens) or a
 * linmoe built without CUDA. Not otherwise validated; c is not changed.
 * lm_kda_cuda_saved_bytes_max: an upper bound of lm_kda_cuda_saved_bytes over every batch
 * of at most max_tokens tokens (B*T) in at most max_seqs sequences (B, or the documents of
 * cu_seqlens, empty ones included) with HV value heads: a batch of L tokens in S sequences
 * has at most min(L, L/64 + min(S, L)) chunks. 0 for max_tokens, max_seqs or HV < 1 or
 * without CUDA.
 * lm_kda_cuda_forward_train_buf: lm_kda_cuda_forward_train (same outputs, same *saved for
 * lm_kda_cuda_backward) with the saved tensors carved from buf, device memory of ctx's
 * device, 256-byte aligned, of cap >= lm_kda_cuda_saved_bytes(c) bytes, instead of a
 * buffer of the op: the call allocates no device memory (host bookkeeping only). The
 * chunk tables are copied into buf on every call through the context's pinned staging
 * (lm_cuda_ctx_upload, grown on its first use), not cached: the op cannot know when the
 * caller's memory is freed and its address reused.
 * *saved borrows buf: the caller keeps it alive, and lets nothing else write it, until
 * lm_kda_cuda_saved_free(saved), which frees the bookkeeping only (buf stays the caller's
 * and never becomes the context's spare). Each call makes a new saved object: free the
 * previous one on the same buffer first (its tensors are overwritten). Errors as
 * lm_kda_cuda_forward_train, plus LM_ERR_INVALID for a NULL, unaligned or too small buf
 * (the message gives the bytes the batch needs); on any error *saved is NULL. */
size_t lm_kda_cuda_saved_bytes(const lm_kda_config *c);
size_t lm_kda_cuda_saved_bytes_max(int64_t max_tokens, int max_seqs, int HV);
lm_status lm_kda_cuda_forward_train_buf(lm_cuda_ctx *ctx, lm_kda_config *c,
                                        const lm_kda_cuda_inputs *in, lm_kda_cuda_outputs *out,
                                        void *buf, size_t cap, lm_kda_cuda_saved **saved,
                                        lm_error *err);

/* Backward of sum(o*do) + sum(final_state*dht) (reference/kda.md §4.1, docs/kda-math.md).
 * May be called more than once on the same saved state. ctx must be the context of the
 * forward that made `saved`. Asynchronous on ctx's stream, as lm_kda_cuda_chunk_forward
 * (every kernel on that one stream). Errors: LM_ERR_INVALID (NULL saved / grads / do_, or
 * another context than the forward's), LM_ERR_NOMEM (scratch), LM_ERR_IO (CUDA). */
lm_status lm_kda_cuda_backward(lm_cuda_ctx *ctx, lm_kda_cuda_saved *saved,
                               const lm_kda_cuda_grads *gr, lm_error *err);

/* Frees `saved` (NULL is a no-op); its device buffer becomes the context's spare for the
 * next training forward when it is the largest one freed, and is freed otherwise (after a
 * synchronisation of the stream). `ctx` is the context of the forward, or NULL for the one
 * `saved` remembers (another context is not used: the remembered one is). A saved object
 * of lm_kda_cuda_forward_train_buf: only its bookkeeping is freed (no synchronisation; the
 * buffer stays the caller's). */
void lm_kda_cuda_saved_free(lm_cuda_ctx *ctx, lm_kda_cuda_saved *saved);

/* Frees the KDA buffers of ctx (forward workspace, spare saved buffer, backward scratch,
 * chunk-table cache) after synchronising its stream; the next call allocates again.
 * Optional: lm_cuda_ctx_free frees them too. Saved objects still alive keep their own
 * buffers. NULL is a no-op. */
void lm_kda_cuda_release(lm_cuda_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif
