/* linmoe ops: one API per op of the model, dispatching on the tensors' device
 * (DESIGN.md "Devices, memory and scale"). The model calls lm_op_<name>_<verb> whatever the
 * device; the call checks its arguments and runs the CPU implementation (fp32, the
 * reference: include/linmoe/layers.h, attention.h, attnres.h, kda.h) or the CUDA one (bf16
 * storage: cuda_layers.h, cuda_attention.h, cuda_attnres.h, kda_cuda.h, cuda_gemm.h). The
 * math of every op is that of the CPU header named with it; this file states only the
 * tensors, their dtypes per device, and what the dispatcher adds to the two
 * implementations so that they honour one contract.
 *
 * Every entry point takes `be` (the device and, for CUDA, the caller's context), the op's
 * tensors as lm_tensor views (include/linmoe/core.h; an absent optional tensor is NULL; a
 * view is const, outputs are written through its data) and the op's config, and checks,
 * in this order, before any work:
 *   1. be: not NULL, a known device type; on CUDA lm_backend_supports(be->device, op,
 *      config) (LM_ERR_UNSUPPORTED in a build without CUDA, or for a configuration the
 *      kernels do not run: nothing else is looked at), then a context whose device is
 *      be->device.index;
 *   2. every tensor given: data not NULL, device == be->device (type and CUDA ordinal),
 *      dtype (the table of each op), ndim and shape against the config (the message
 *      names the dims, e.g. "expected [N=4, D=64]"), row-major contiguous;
 *   3. then the implementation's own validation (cu_seqlens, eps, value ranges; on the
 *      CPU also the finiteness scan of the inputs).
 * Errors: LM_ERR_INVALID with a message "<op>: tensor <name> ..." naming the tensor and,
 * for a device mismatch, both devices ("is on cuda:0, the backend is cpu"); the
 * implementation's errors unchanged otherwise; LM_ERR_NOMEM when the CPU side's scratch
 * (below) cannot be allocated.
 *
 * Dtypes: on the CPU every float tensor is F32. On CUDA activations and the weights'
 * working copy are BF16; recurrent states, softmax / norm statistics, weight gradients
 * and the AttnRes pseudo-query and gain are F32. Token ids and labels are I32 on both.
 *
 * One contract for gradients (the model's, where gradients accumulate in place over
 * micro-batches; the caller zeroes them once per step):
 *   - WEIGHT gradients ACCUMULATE (+=): dweight of the norms and the short conv, the
 *     embedding's dweight, the LM head's dW, AttnRes's dquery / drms_weight. CUDA does
 *     this itself; on the CPU, where those ops overwrite, the dispatcher computes into a
 *     scratch buffer (malloc'd per call) and adds it (one fp32 addition per element).
 *   - ACTIVATION gradients (dx, dgate, dq, dk, dv, dh, dgu, dinitial_state) are
 *     OVERWRITTEN on both devices, except AttnRes's dsrc, which accumulate (the model's
 *     block-sum accumulators).
 * Asynchrony: CUDA calls are asynchronous on be->cuda's stream (include/linmoe/backend.h);
 * CPU calls return with the results written.
 *
 * What this module does not do: allocate tensors or move them between devices, the
 * GEMMs of the projections (lm_sgemm / lm_cuda_gemm), MoE, the KDA backward (CUDA keeps
 * a saved object: kda_cuda.h), the optimizer, decode steps.
 */
#ifndef LINMOE_OPS_H
#define LINMOE_OPS_H

#include <stdint.h>

#include "linmoe/attention.h"
#include "linmoe/attnres.h"
#include "linmoe/backend.h"
#include "linmoe/core.h"
#include "linmoe/kda.h"
#include "linmoe/layers.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ================================================================ embedding */

/* out[n,:] = weight[ids[n],:] (src/model/model.c's gather).
 *   ids     [N]     I32
 *   weight  [V, D]  cpu F32 | cuda BF16
 *   out     [N, D]  cpu F32 | cuda BF16, overwritten
 * Out-of-range ids: the CPU reads ids and returns LM_ERR_INVALID naming the token before
 * writing anything; CUDA cannot read them without a host sync and writes a zero row
 * (lm_cuda_embedding_forward; the data loader validates ids on the host). */
lm_status lm_op_embedding_forward(const lm_backend *be, const lm_tensor *ids,
                                  const lm_tensor *weight, const lm_tensor *out, lm_error *err);

/* dweight[ids[n],:] += dout[n,:], summed in token order for each row (both devices;
 * deterministic).
 *   ids [N] I32;  dout [N, D] cpu F32 | cuda BF16;  dweight [V, D] F32, ACCUMULATED.
 * Out-of-range ids: LM_ERR_INVALID on the CPU (nothing added), skipped on CUDA. */
lm_status lm_op_embedding_backward(const lm_backend *be, const lm_tensor *ids,
                                   const lm_tensor *dout, const lm_tensor *dweight, lm_error *err);

/* ================================================================ RMSNorm */

/* RMSNorm over the last dim (lm_rmsnorm_forward), optionally fused with the residual add
 * before it (lm_cuda_rmsnorm_forward): h = x + residual, y = h * rstd(h) * weight.
 *   x, residual  [N, D]  cpu F32 | cuda BF16; residual NULL: h = x
 *   weight       [D]     cpu F32 | cuda BF16, or NULL (= 1)
 *   h            [N, D]  output, required with residual (ignored without); may alias x
 *                        or residual. CPU: h = x + residual in fp32; CUDA: rounded to bf16
 *                        and the statistic taken from the stored h
 *   y            [N, D]  output; must not alias x, residual or h
 *   rstd         [N]     F32 output or NULL
 * eps > 0, finite (the config's rms_norm_eps). */
lm_status lm_op_rmsnorm_forward(const lm_backend *be, float eps, const lm_tensor *x,
                                const lm_tensor *residual, const lm_tensor *weight,
                                const lm_tensor *h, const lm_tensor *y, const lm_tensor *rstd,
                                lm_error *err);

/* Backward of sum(y * dy) (lm_rmsnorm_backward):
 *   x          [N, D]  the normalised input (h of the fused forward)
 *   weight     [D] or NULL;  rstd [N] F32 or NULL (recomputed)
 *   dy         [N, D]
 *   dresidual  [N, D] or NULL: added to dx (the residual stream's gradient); may alias dx
 *   dx         [N, D] output (overwritten: rmsnorm's dx + dresidual) or NULL
 *   dweight    [D] F32, ACCUMULATED, or NULL (ignored without weight)
 * x, weight, dy, dresidual, dx: cpu F32 | cuda BF16. CPU with dresidual: dx is computed
 * into scratch and dresidual added in fp32. */
lm_status lm_op_rmsnorm_backward(const lm_backend *be, float eps, const lm_tensor *x,
                                 const lm_tensor *weight, const lm_tensor *rstd,
                                 const lm_tensor *dy, const lm_tensor *dresidual,
                                 const lm_tensor *dx, const lm_tensor *dweight, lm_error *err);

/* ================================================================ gated RMSNorm */

/* Head-wise RMSNorm gated by sigmoid (lm_gated_rmsnorm_forward; reference/kda.md §7):
 *   x, gate, o  [N, H, Dh]  cpu F32 | cuda BF16 (o overwritten, must not alias x, gate)
 *   weight      [Dh]        cpu F32 | cuda BF16, or NULL (= 1)
 *   rstd        [N, H]      F32 output or NULL
 * eps: LM_GATED_RMSNORM_EPS in the Kimi Linear layer. */
lm_status lm_op_gated_rmsnorm_forward(const lm_backend *be, float eps, const lm_tensor *x,
                                      const lm_tensor *gate, const lm_tensor *weight,
                                      const lm_tensor *o, const lm_tensor *rstd, lm_error *err);

/* Backward of sum(o * do_) (lm_gated_rmsnorm_backward):
 *   x, gate, do_  [N, H, Dh];  weight [Dh] or NULL;  rstd [N, H] F32 or NULL
 *   dx, dgate     [N, H, Dh] outputs (overwritten) or NULL
 *   dweight       [Dh] F32, ACCUMULATED, or NULL
 * x, gate, weight, do_, dx, dgate: cpu F32 | cuda BF16. */
lm_status lm_op_gated_rmsnorm_backward(const lm_backend *be, float eps, const lm_tensor *x,
                                       const lm_tensor *gate, const lm_tensor *weight,
                                       const lm_tensor *rstd, const lm_tensor *do_,
                                       const lm_tensor *dx, const lm_tensor *dgate,
                                       const lm_tensor *dweight, lm_error *err);

/* ================================================================ short convolution */

/* Depthwise causal conv + optional SiLU (lm_short_conv_forward; reference/kda.md §7). c:
 * B, T, C, W, activation, cu_seqlens (HOST int64 [N+1] on both devices, only with
 * B == 1); N = n_cu_seqlens - 1 with cu_seqlens, else B; sets c->N.
 *   x, y           [B, T, C]     cpu F32 | cuda BF16 (y must not alias x)
 *   weight         [C, W]        cpu F32 | cuda BF16
 *   initial_state  [N, C, W-1]   F32 or NULL (zeros)
 *   final_state    [N, C, W-1]   F32 output or NULL; may alias initial_state
 * CUDA: W <= LM_CUDA_SHORT_CONV_MAX_W (LM_ERR_UNSUPPORTED otherwise). */
lm_status lm_op_short_conv_forward(const lm_backend *be, lm_short_conv_config *c,
                                   const lm_tensor *x, const lm_tensor *weight,
                                   const lm_tensor *initial_state, const lm_tensor *y,
                                   const lm_tensor *final_state, lm_error *err);

/* Backward of sum(y * dy) (lm_short_conv_backward):
 *   x, dy           [B, T, C];  weight [C, W];  initial_state [N, C, W-1] F32 or NULL
 *   dx              [B, T, C] output (overwritten) or NULL
 *   dweight         [C, W] F32, ACCUMULATED, or NULL
 *   dinitial_state  [N, C, W-1] F32 output (overwritten) or NULL
 * x, dy, weight, dx: cpu F32 | cuda BF16. */
lm_status lm_op_short_conv_backward(const lm_backend *be, lm_short_conv_config *c,
                                    const lm_tensor *x, const lm_tensor *weight,
                                    const lm_tensor *initial_state, const lm_tensor *dy,
                                    const lm_tensor *dx, const lm_tensor *dweight,
                                    const lm_tensor *dinitial_state, lm_error *err);

/* ================================================================ SwiGLU */

/* The element-wise part of the SwiGLU FFN (Shazeer 2020, Eq. 6; lm_swiglu_forward's
 * `hidden` layout; the projections are GEMMs of the caller):
 *     h[n,f] = silu(g) * u = g * sigmoid(g) * u,  g = gu[n,f], u = gu[n,F+f]
 *   gu  [N, 2F]  cpu F32 | cuda BF16
 *   h   [N, F]   same dtype, overwritten (must not alias gu)
 * The CPU side is a loop here with src/ops/swiglu.c's formula (lm_layers_sigmoid). */
lm_status lm_op_swiglu_forward(const lm_backend *be, const lm_tensor *gu, const lm_tensor *h,
                               lm_error *err);

/* Backward, s = sigmoid(g): dg = dh * u * (s * (1 + g (1 - s))), du = dh * g * s.
 *   gu   [N, 2F];  dh [N, F]
 *   dgu  [N, 2F] output (overwritten): dg in columns 0..F-1, du in F..2F-1; may alias gu
 *   h    [N, F] output or NULL: silu(g) * u recomputed (the down projection's input)
 * All cpu F32 | cuda BF16. */
lm_status lm_op_swiglu_backward(const lm_backend *be, const lm_tensor *gu, const lm_tensor *dh,
                                const lm_tensor *dgu, const lm_tensor *h, lm_error *err);

/* ================================================================ attention */

/* Causal GQA softmax attention (lm_attention_forward; FlashAttention-2). c: the CPU
 * config (B, T, Hq, Hkv, D, cu_seqlens HOST int64, scale, position, rope_theta, ws used on
 * the CPU only); sets c->N.
 *   q, o  [B, T, Hq, D];  k, v [B, T, Hkv, D]   cpu F32 | cuda BF16 (o overwritten)
 *   lse   [B, T, Hq]  F32 output (nats) or NULL (inference)
 * CUDA: D = 64 or 128 (LM_ERR_UNSUPPORTED otherwise), 16-byte aligned pointers. */
lm_status lm_op_attention_forward(const lm_backend *be, lm_attention_config *c, const lm_tensor *q,
                                  const lm_tensor *k, const lm_tensor *v, const lm_tensor *o,
                                  const lm_tensor *lse, lm_error *err);

/* Backward of sum(o * do_) given the forward's o and lse (required):
 *   q, o, do_, dq [B, T, Hq, D];  k, v, dk, dv [B, T, Hkv, D];  lse [B, T, Hq] F32
 * dq, dk, dv required, overwritten on both devices. Float tensors cpu F32 | cuda BF16. */
lm_status lm_op_attention_backward(const lm_backend *be, lm_attention_config *c, const lm_tensor *q,
                                   const lm_tensor *k, const lm_tensor *v, const lm_tensor *o,
                                   const lm_tensor *lse, const lm_tensor *do_, const lm_tensor *dq,
                                   const lm_tensor *dk, const lm_tensor *dv, lm_error *err);

/* ================================================================ KDA */

/* Inputs of the KDA / GDN chunk forward (lm_kda_inputs as tensors; NULL = absent). */
typedef struct {
    const lm_tensor *q, *k;         /* [B, T, H, K]    cpu F32 | cuda BF16 */
    const lm_tensor *v;             /* [B, T, HV, V]   cpu F32 | cuda BF16 */
    const lm_tensor *g;             /* KDA [B, T, HV, K], GDN [B, T, HV]: cpu F32 | cuda BF16 */
    const lm_tensor *beta;          /* [B, T, HV]      cpu F32 | cuda BF16 */
    const lm_tensor *A_log;         /* [HV] F32 or NULL */
    const lm_tensor *dt_bias;       /* KDA [HV*K], GDN [HV]: F32 or NULL */
    const lm_tensor *initial_state; /* [N, HV, K, V] F32 or NULL (zeros) */
} lm_op_kda_inputs;

/* The chunked (WY / UT) forward of the gated delta rule (lm_kda_chunk_forward /
 * lm_kda_cuda_chunk_forward; reference/kda.md §1-3). c: lm_kda_config (cu_seqlens HOST
 * int64, only with B == 1; N = n_cu_seqlens - 1 or B; ws used on the CPU only); sets c->N.
 *   o            [B, T, HV, V]   cpu F32 | cuda BF16, overwritten
 *   final_state  [N, HV, K, V]   F32 output or NULL
 * CUDA: K, V <= 128 (LM_ERR_UNSUPPORTED otherwise); the kernels always use 64-token
 * chunks (the CPU honours c->chunk_size: rounding differences only). */
lm_status lm_op_kda_chunk_forward(const lm_backend *be, lm_kda_config *c,
                                  const lm_op_kda_inputs *in, const lm_tensor *o,
                                  const lm_tensor *final_state, lm_error *err);

/* ================================================================ AttnRes */

/* One Attention Residuals aggregation (lm_attnres_forward_ptrs; reference/attnres_ctx.md
 * §4.2): c: L, N, D, eps, scale (trusted_inputs, ws: CPU only).
 *   src         an array of L tensors [N, D] (cpu F32 | cuda BF16; the sources need not
 *               be stacked)
 *   query       [D] F32 (the pseudo-query, on both devices)
 *   rms_weight  [D] F32 (the key RMSNorm gain, on both devices)
 *   o           [N, D] cpu F32 | cuda BF16, overwritten
 * CUDA: L <= LM_CUDA_ATTNRES_MAX_SOURCES, D <= 8192. */
lm_status lm_op_attnres_forward(const lm_backend *be, const lm_attnres_config *c,
                                const lm_tensor *src, const lm_tensor *query,
                                const lm_tensor *rms_weight, const lm_tensor *o, lm_error *err);

/* Backward of sum(o * do_) (reference/attnres_ctx.md §4.3; statistics recomputed):
 *   do_          [N, D] cpu F32 | cuda BF16
 *   dsrc         an array of L tensors [N, D], or NULL (none wanted); an entry whose
 *                data is NULL is not wanted. cpu F32 | cuda BF16 or F32 (every entry
 *                given the same dtype). ACCUMULATED (the model's accumulators)
 *   dquery, drms_weight  [D] F32, ACCUMULATED, or NULL
 * c->accumulate is ignored (always 1 here: one contract). */
lm_status lm_op_attnres_backward(const lm_backend *be, const lm_attnres_config *c,
                                 const lm_tensor *src, const lm_tensor *query,
                                 const lm_tensor *rms_weight, const lm_tensor *do_,
                                 const lm_tensor *dsrc, const lm_tensor *dquery,
                                 const lm_tensor *drms_weight, lm_error *err);

/* ================================================================ cross-entropy */

/* The LM head fused with the token cross-entropy (lm_cross_entropy_forward / _backward,
 * lm_cuda_ce_forward_backward): logits = h W^T never materialised, nll[n] = lse[n] -
 * logits[n, label[n]] in nats, 0 on ignored rows. N, D, V come from the tensors. */
typedef struct {
    int ignore_index; /* -1; must lie outside [0, V) */
    float dloss;      /* backward: gradient of the loss, finite (1) */
    int mean;         /* 1: dlogits = dloss (softmax - onehot) / count (the mean loss, the
                         CPU op's convention); 0: dloss (softmax - onehot) (the caller's
                         scale, e.g. 1 / tokens of the step; CPU: passes dloss * count to
                         lm_cross_entropy_backward, equal up to rounding) */
    int chunk_size;   /* CPU: vocabulary rows per chunk (0: LM_CE_CHUNK_DEFAULT) */
    int chunk_rows;   /* CUDA: tokens per chunk (0: from LM_CUDA_CE_SCRATCH_BYTES) */
    int logits_bf16;  /* CUDA: 1 bf16 logits (default), 0 fp32 logits */
} lm_op_ce_config;

/* ignore_index -1, dloss 1, mean 1, chunk_size 0, chunk_rows 0, logits_bf16 1. */
void lm_op_ce_config_default(lm_op_ce_config *c);

/* Evaluation (no gradient):
 *   h       [N, D]  cpu F32 | cuda BF16 (final hidden states, after the final norm)
 *   W       [V, D]  cpu F32 | cuda BF16 (lm_head.weight, or the tied embedding)
 *   labels  [N]     I32, in [0, V) or ignore_index
 *   loss_sum [1] F32, count [1] I32, nll [N] F32: outputs (written) or NULL; on the device
 *           of the backend (CUDA: device scalars, read back by the caller; the CPU's
 *           loss_sum is (float)(mean loss * count) of lm_cross_entropy_forward)
 * A label outside [0, V) that is not ignore_index: LM_ERR_INVALID on the CPU, a NaN nll
 * on CUDA (no host sync). */
lm_status lm_op_cross_entropy_forward(const lm_backend *be, const lm_op_ce_config *c,
                                      const lm_tensor *h, const lm_tensor *W,
                                      const lm_tensor *labels, const lm_tensor *loss_sum,
                                      const lm_tensor *count, const lm_tensor *nll, lm_error *err);

/* Training: the loss (loss_sum, count as in the forward, each optional) and
 *   dh  [N, D] cpu F32 | cuda BF16, overwritten, or NULL
 *   dW  [V, D] F32, ACCUMULATED (a tied head adds to the embedding's gradient), or NULL
 * CPU: lm_cross_entropy_forward (saving lse) then lm_cross_entropy_backward into scratch
 * added to dW. */
lm_status lm_op_cross_entropy_backward(const lm_backend *be, const lm_op_ce_config *c,
                                       const lm_tensor *h, const lm_tensor *W,
                                       const lm_tensor *labels, const lm_tensor *loss_sum,
                                       const lm_tensor *count, const lm_tensor *dh,
                                       const lm_tensor *dW, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
