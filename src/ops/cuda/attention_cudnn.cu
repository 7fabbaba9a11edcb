/* Causal attention forward and backward through cuDNN's fused flash-attention engines, built
 * with the cuDNN 9 backend (graph) C API (cudnn_graph.h; no C++ frontend). Used by
 * src/ops/cuda/attention.cu (which picks the batches, the document groups and the scratch);
 * contract in include/linmoe/cuda_attention.h.
 *
 * The operation graphs are the ones cudnn-frontend's composite SDPA nodes lower to for
 * cuDNN < 9.21 (scaled_dot_product_flash_attention.h: CompositeSDPANode and
 * CompositeSDPABackwardNode, with attn_score_modifiers.h padding_mask / causal_mask and
 * diagonal_band_mask.h's composite lowering); the fused engines recognise exactly these
 * patterns, so tensor shapes, strides and data types follow the frontend's. Notation: b
 * batch entries, hq / hk query / kv heads, s the sequence dimension, d the head dim; dense
 * tensors in linmoe's [b, s, h, d] layout described as [b, h, s, d] by strides.
 *
 * Forward:
 *   S    = matmul(Q, K^T)           fp32  [b, hq, s, s]   (hk heads broadcast over groups)
 *   S1   = S * scale                by-value fp32 scalar
 *   [padded] r, c = gen_index(S1, axis 2 / 3) int32; keep = r < seq_q && c < seq_kv;
 *            S1 = keep ? S1 : -inf
 *   r, c = gen_index(S1, axis 2 / 3) int32;  S2 = (r >= c) ? S1 : -inf   (causal, top left)
 *   m = max(S2) [b, hq, s, 1];  E = exp(S2 - m);  l = sum(E);  Stats = m + log(l)  (written)
 *   P    = E / l                    bf16
 *   O    = matmul(P, V)             bf16, written
 * Backward (dP = dO V^T, dS = P (dP - rowsum(dO O)), FlashAttention-2's algorithm 2):
 *   Dsum = rowsum(dO * O) * 1       fp32 [b, hq, s, 1], written to our scratch
 *   S    = matmul(Q, K^T) * scale;  [padded] the padding select;  S - Stats;  causal select;
 *   E    = exp(.)                   (= P: the stats are the forward's log-sum-exp)
 *   dV   = matmul(E^T, dO)          E^T a reshape of E in bf16; GQA: matmul into
 *                                   [b, hq, s, d] and a sum over each group of hq / hk heads
 *   dP   = matmul(dO, V^T)          fp32
 *   dS   = (dP - Dsum) * E * scale  fp32
 *   dK   = matmul(dS^T, Q)          dS^T a reshape in bf16; GQA reduced as dV
 *   dQ   = matmul(dS, K)            K a reshape of K^T;
 *          non-deterministic:  into an fp32 accumulator (our scratch, cuDNN adds into it with
 *                              atomics), then dQ = identity(accumulator);
 *          deterministic:      straight into dQ: the frontend's "dP workspace" form
 *                              (use_deterministic_algorithm on Hopper), where cuDNN keeps dS in
 *                              its workspace (about b * hq * s^2 * 2 bytes) and forms dQ by a
 *                              separate ordered GEMM; plan candidates whose engine carries the
 *                              NONDETERMINISTIC numerical note are tried last.
 * Packed documents ("ragged"): Q, K, V, O, dO, dQ, dK, dV and Stats carry ragged offset
 * tensors (int64 [b + 1], element offsets of each document's first token; dQ shares Q's, dO
 * O's, dK K's, dV V's), the padding mask above is on, every matmul gets its M / N / K
 * override from seq_q / seq_kv (int32 [b]), Stats is the packed [tokens, hq] layout (linmoe's
 * lse itself), and the scratch tensors follow the frontend with max_total_seq_len set: Dsum
 * packed like Stats, the dQ accumulator packed like dQ, and for GQA the per-query-head dK / dV
 * before the group sum packed [tokens, hq, d] bf16 with K's offsets (cuDNN scales those by
 * hq / hk itself).
 * Plans are built once per shape key and kept with their descriptors in the context's
 * attention state; a shape cuDNN refuses is remembered and refused at once. */
#include <cudnn.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "linmoe/cuda_attention.h"
#include "ops/cuda/attention_cudnn.cuh"
#include "ops/cuda/ctx.cuh"

namespace {

/* tensor UIDs of the variant pack; virtual tensors from U_VIRT up */
enum : int64_t {
    U_Q = 1,
    U_K,
    U_V,
    U_O,
    U_STATS,
    U_DO,
    U_DQ,
    U_DK,
    U_DV,
    U_DSUM,
    U_DQACC,
    U_DKFULL,
    U_DVFULL,
    U_SCALE,
    U_NEGINF,
    U_NEGINF_PAD,
    U_ONE,
    U_SEQ_Q,
    U_SEQ_KV,
    U_OFF_Q,
    U_OFF_K,
    U_OFF_V,
    U_OFF_O,
    U_OFF_S,
    U_VIRT = 100
};

struct Key {
    int bwd = 0, ragged = 0, det = 0, variant = 0;
    int b = 0, s = 0, Hq = 0, Hkv = 0, D = 0;
    bool operator==(const Key &o) const {
        return bwd == o.bwd && ragged == o.ragged && det == o.det && variant == o.variant &&
               b == o.b && s == o.s && Hq == o.Hq && Hkv == o.Hkv && D == o.D;
    }
};

struct Plan {
    Key key;
    bool ok = false;
    char why[512] = "";
    cudnnBackendDescriptor_t plan = nullptr;
    int64_t ws = 0;
    std::vector<cudnnBackendDescriptor_t> keep; /* every descriptor the plan was built from */
};

/* Descriptor builder: records every descriptor it creates (freed with the plan) and the
 * first failure (call and cuDNN's message). */
struct Builder {
    std::vector<cudnnBackendDescriptor_t> made;
    cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
    char what[512] = "";
    int64_t next_uid = U_VIRT;

    bool fail(cudnnStatus_t s, const char *call) {
        if (st == CUDNN_STATUS_SUCCESS && s != CUDNN_STATUS_SUCCESS) {
            st = s;
            char last[256] = "";
            cudnnGetLastErrorString(last, sizeof last);
            snprintf(what, sizeof what, "%s: %s%s%s", call, cudnnGetErrorString(s),
                     last[0] ? ": " : "", last);
        }
        return st != CUDNN_STATUS_SUCCESS;
    }
    cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t t) {
        cudnnBackendDescriptor_t d = nullptr;
        if (st != CUDNN_STATUS_SUCCESS)
            return nullptr;
        if (fail(cudnnBackendCreateDescriptor(t, &d), "cudnnBackendCreateDescriptor"))
            return nullptr;
        made.push_back(d);
        return d;
    }
    void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t a,
             cudnnBackendAttributeType_t t, int64_t n, const void *v, const char *name) {
        if (st != CUDNN_STATUS_SUCCESS)
            return;
        fail(cudnnBackendSetAttribute(d, a, t, n, v), name);
    }
    void fin(cudnnBackendDescriptor_t d, const char *name) {
        if (st != CUDNN_STATUS_SUCCESS)
            return;
        fail(cudnnBackendFinalize(d), name);
    }
    void release() {
        for (auto d : made)
            cudnnBackendDestroyDescriptor(d);
        made.clear();
    }

    /* 4-d tensor; uid < 0 takes the next virtual uid. ragged: the offset tensor or NULL */
    cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dt, const int64_t dim[4],
                                    const int64_t str[4], bool virt, bool by_value = false,
                                    cudnnBackendDescriptor_t ragged = nullptr) {
        if (uid < 0)
            uid = next_uid++;
        cudnnBackendDescriptor_t d = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
        const int64_t align = 16;
        set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
        set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, "tensor dims");
        set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, "tensor strides");
        set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
        set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
        if (virt) {
            const bool t = true;
            set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &t, "tensor virtual");
        }
        if (by_value) {
            const bool t = true;
            set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &t, "tensor by value");
        }
        if (ragged)
            set(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ragged,
                "tensor ragged offset");
        fin(d, "tensor finalize");
        return d;
    }
    /* a virtual tensor */
    cudnnBackendDescriptor_t virt(cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4]) {
        return tensor(-1, dt, dim, str, true);
    }

    /* y = op(x [, b [, t]]); compute type ct; axis for GEN_INDEX (else -1) */
    cudnnBackendDescriptor_t pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t ct,
                                       cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                                       cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                                       int64_t axis = -1) {
        cudnnBackendDescriptor_t pw = create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
        set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
        set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &ct, "pointwise prec");
        if (axis >= 0)
            set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
        fin(pw, "pointwise finalize");
        cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
        set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw,
            "pointwise op desc");
        set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x,
            "pointwise x");
        set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y,
            "pointwise y");
        if (b)
            set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b,
                "pointwise b");
        if (t)
            set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t,
                "pointwise t");
        const float one = 1.0f;
        set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, "alpha1");
        set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, "alpha2");
        fin(op, "pointwise op finalize");
        return op;
    }

    /* c = a b; optional GEMM M / N / K overrides (padded batches) */
    cudnnBackendDescriptor_t matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                    cudnnBackendDescriptor_t c,
                                    cudnnBackendDescriptor_t mo = nullptr,
                                    cudnnBackendDescriptor_t no = nullptr,
                                    cudnnBackendDescriptor_t ko = nullptr) {
        cudnnBackendDescriptor_t md = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
        const cudnnDataType_t ct = CUDNN_DATA_FLOAT;
        set(md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &ct, "matmul comp type");
        fin(md, "matmul desc finalize");
        cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
        set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a,
            "matmul a");
        set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b,
            "matmul b");
        set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c,
            "matmul c");
        set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md,
            "matmul desc");
        if (mo)
            set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1, &mo, "matmul m override");
        if (no)
            set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1, &no, "matmul n override");
        if (ko)
            set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1, &ko, "matmul k override");
        fin(op, "matmul op finalize");
        return op;
    }

    cudnnBackendDescriptor_t reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                                       cudnnBackendDescriptor_t y) {
        cudnnBackendDescriptor_t rd = create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
        const cudnnDataType_t ct = CUDNN_DATA_FLOAT;
        set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode,
            "reduction operator");
        set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &ct, "reduction prec");
        fin(rd, "reduction desc finalize");
        cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
        set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x,
            "reduction x");
        set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y,
            "reduction y");
        set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd,
            "reduction desc");
        fin(op, "reduction op finalize");
        return op;
    }

    cudnnBackendDescriptor_t reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
        cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
        set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x,
            "reshape x");
        set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y,
            "reshape y");
        fin(op, "reshape op finalize");
        return op;
    }
};

constexpr cudnnDataType_t F32 = CUDNN_DATA_FLOAT, BF16 = CUDNN_DATA_BFLOAT16,
                          I32 = CUDNN_DATA_INT32, I64 = CUDNN_DATA_INT64, BOOL = CUDNN_DATA_BOOLEAN;

/* The shapes and tensors both graphs share. */
struct Common {
    int64_t b, hq, hk, s, d;
    int64_t dS[4], sS[4], dR[4], sR[4], d1[4], s1[4];
    cudnnBackendDescriptor_t seq_q = nullptr, seq_kv = nullptr; /* padded only */
    cudnnBackendDescriptor_t off_q = nullptr, off_k = nullptr, off_v = nullptr, off_o = nullptr,
                             off_s = nullptr; /* ragged only */

    Common(Builder &bd, const Key &k) {
        b = k.b, hq = k.Hq, hk = k.Hkv, s = k.s, d = k.D;
        const int64_t ds[4] = {b, hq, s, s}, ss[4] = {hq * s * s, s * s, s, 1};
        const int64_t dr[4] = {b, hq, s, 1}, sr[4] = {hq * s, s, 1, 1};
        for (int i = 0; i < 4; i++) {
            dS[i] = ds[i], sS[i] = ss[i], dR[i] = dr[i], sR[i] = sr[i];
            d1[i] = 1, s1[i] = 1;
        }
        if (k.ragged) {
            const int64_t dl[4] = {b, 1, 1, 1}, sl[4] = {1, 1, 1, 1};
            const int64_t dof[4] = {b + 1, 1, 1, 1};
            seq_q = bd.tensor(U_SEQ_Q, I32, dl, sl, false);
            seq_kv = bd.tensor(U_SEQ_KV, I32, dl, sl, false);
            off_q = bd.tensor(U_OFF_Q, I64, dof, sl, false);
            off_k = bd.tensor(U_OFF_K, I64, dof, sl, false);
            off_v = bd.tensor(U_OFF_V, I64, dof, sl, false);
            off_o = bd.tensor(U_OFF_O, I64, dof, sl, false);
            off_s = bd.tensor(U_OFF_S, I64, dof, sl, false);
        }
    }
    /* [b, h, s, d] in linmoe's [b, s, h, d] memory */
    void bshd(int64_t h, int64_t dim[4], int64_t str[4]) const {
        const int64_t dd[4] = {b, h, s, d}, st[4] = {s * h * d, d, h * d, 1};
        for (int i = 0; i < 4; i++)
            dim[i] = dd[i], str[i] = st[i];
    }
    /* X^T as [b, h, d, s] of the same memory */
    void bshd_t(int64_t h, int64_t dim[4], int64_t str[4]) const {
        const int64_t dd[4] = {b, h, d, s}, st[4] = {s * h * d, d, 1, h * d};
        for (int i = 0; i < 4; i++)
            dim[i] = dd[i], str[i] = st[i];
    }
    /* Stats-like [b, hq, s, 1]: dense BHS1, ragged packed [tokens, hq] */
    void stats(bool ragged, int64_t dim[4], int64_t str[4]) const {
        const int64_t dd[4] = {b, hq, s, 1}, sd[4] = {hq * s, s, 1, 1}, sp[4] = {s * hq, 1, hq, 1};
        for (int i = 0; i < 4; i++)
            dim[i] = dd[i], str[i] = ragged ? sp[i] : sd[i];
    }

    /* the padding select of the frontend's padding_mask (ragged only) */
    cudnnBackendDescriptor_t padding(Builder &bd, std::vector<cudnnBackendDescriptor_t> &ops,
                                     cudnnBackendDescriptor_t x) {
        auto tNeg = bd.tensor(U_NEGINF_PAD, F32, d1, s1, false, true);
        auto r = bd.virt(I32, dS, sS), c = bd.virt(I32, dS, sS);
        auto rm = bd.virt(BOOL, dS, sS), cm = bd.virt(BOOL, dS, sS), m = bd.virt(BOOL, dS, sS);
        auto y = bd.virt(F32, dS, sS);
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_GEN_INDEX, I32, x, nullptr, nullptr, r, 2));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_GEN_INDEX, I32, x, nullptr, nullptr, c, 3));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_CMP_LT, BOOL, r, seq_q, nullptr, rm));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_CMP_LT, BOOL, c, seq_kv, nullptr, cm));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_LOGICAL_AND, BOOL, rm, cm, nullptr, m));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_BINARY_SELECT, F32, x, tNeg, m, y));
        return y;
    }
    /* the causal (top-left diagonal, right bound 0) select of diagonal_band_mask.h */
    cudnnBackendDescriptor_t causal(Builder &bd, std::vector<cudnnBackendDescriptor_t> &ops,
                                    cudnnBackendDescriptor_t x) {
        auto tNeg = bd.tensor(U_NEGINF, F32, d1, s1, false, true);
        auto r = bd.virt(I32, dS, sS), c = bd.virt(I32, dS, sS), keep = bd.virt(BOOL, dS, sS);
        auto y = bd.virt(F32, dS, sS);
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_GEN_INDEX, F32, x, nullptr, nullptr, r, 2));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_GEN_INDEX, F32, x, nullptr, nullptr, c, 3));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_CMP_GE, BOOL, r, c, nullptr, keep));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_BINARY_SELECT, F32, x, tNeg, keep, y));
        return y;
    }
};

/* The forward graph of the file comment. */
void forward_graph(Builder &bd, const Key &k, std::vector<cudnnBackendDescriptor_t> &ops) {
    Common g(bd, k);
    const bool rg = k.ragged != 0;
    int64_t dq[4], sq[4], dk[4], sk[4], dv[4], sv[4], dst[4], sst[4];
    g.bshd(g.hq, dq, sq);
    g.bshd_t(g.hk, dk, sk);
    g.bshd(g.hk, dv, sv);
    g.stats(rg, dst, sst);
    auto tQ = bd.tensor(U_Q, BF16, dq, sq, false, false, g.off_q);
    auto tK = bd.tensor(U_K, BF16, dk, sk, false, false, g.off_k);
    auto tV = bd.tensor(U_V, BF16, dv, sv, false, false, g.off_v);
    auto tO = bd.tensor(U_O, BF16, dq, sq, false, false, g.off_o);
    auto tStats = bd.tensor(U_STATS, F32, dst, sst, false, false, g.off_s);
    auto tScale = bd.tensor(U_SCALE, F32, g.d1, g.s1, false, true);
    auto tS = bd.virt(F32, g.dS, g.sS), tS1 = bd.virt(F32, g.dS, g.sS);
    ops.push_back(bd.matmul(tQ, tK, tS, g.seq_q, g.seq_kv, nullptr));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F32, tS, tScale, nullptr, tS1));
    auto x = tS1;
    if (rg)
        x = g.padding(bd, ops, x);
    auto tS2 = g.causal(bd, ops, x);
    auto tM = bd.virt(F32, g.dR, g.sR), tSub = bd.virt(F32, g.dS, g.sS);
    auto tE = bd.virt(F32, g.dS, g.sS), tL = bd.virt(F32, g.dR, g.sR);
    auto tLog = bd.virt(F32, g.dR, g.sR), tP = bd.virt(BF16, g.dS, g.sS);
    ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_MAX, tS2, tM));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_SUB, F32, tS2, tM, nullptr, tSub));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_EXP, F32, tSub, nullptr, nullptr, tE));
    ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_ADD, tE, tL));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_LOG, F32, tL, nullptr, nullptr, tLog));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_ADD, F32, tM, tLog, nullptr, tStats));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_DIV, F32, tE, tL, nullptr, tP));
    ops.push_back(bd.matmul(tP, tV, tO, g.seq_q, nullptr, g.seq_kv));
}

/* The backward graph of the file comment. variant 0: the reshape of K^T back to K is fp32
 * (what the frontend's type inference gives a virtual reshape output), 1: bf16 (K's type, as
 * Transformer Engine's hand-built cuDNN 8.9 graph had it); the second is tried when the first
 * builds no plan. */
void backward_graph(Builder &bd, const Key &k, std::vector<cudnnBackendDescriptor_t> &ops) {
    Common g(bd, k);
    const bool rg = k.ragged != 0, gqa = k.Hq != k.Hkv;
    const int64_t b = g.b, hq = g.hq, hk = g.hk, s = g.s, d = g.d;
    int64_t dq[4], sq[4], dkT[4], skT[4], dk[4], sk[4], dst[4], sst[4];
    g.bshd(hq, dq, sq);
    g.bshd_t(hk, dkT, skT);
    g.bshd(hk, dk, sk);
    g.stats(rg, dst, sst);
    auto tQ = bd.tensor(U_Q, BF16, dq, sq, false, false, g.off_q);
    auto tKT = bd.tensor(U_K, BF16, dkT, skT, false, false, g.off_k);
    auto tVT = bd.tensor(U_V, BF16, dkT, skT, false, false, g.off_v);
    auto tO = bd.tensor(U_O, BF16, dq, sq, false, false, g.off_o);
    auto tdO = bd.tensor(U_DO, BF16, dq, sq, false, false, g.off_o);
    auto tStats = bd.tensor(U_STATS, F32, dst, sst, false, false, g.off_s);
    auto tdQ = bd.tensor(U_DQ, BF16, dq, sq, false, false, g.off_q);
    auto tdK = bd.tensor(U_DK, BF16, dk, sk, false, false, g.off_k);
    auto tdV = bd.tensor(U_DV, BF16, dk, sk, false, false, g.off_v);
    auto tScale = bd.tensor(U_SCALE, F32, g.d1, g.s1, false, true);
    auto tOne = bd.tensor(U_ONE, F32, g.d1, g.s1, false, true);

    /* Dsum = rowsum(dO * O) * 1 */
    const int64_t dm[4] = {b, hq, s, d}, sm[4] = {hq * s * d, s * d, hq * d, 1};
    auto tdOO = bd.virt(F32, dm, sm), tRed = bd.virt(F32, g.dR, g.sR);
    auto tDsum = bd.tensor(U_DSUM, F32, dst, sst, false, false, g.off_s);
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F32, tdO, tO, nullptr, tdOO));
    ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_ADD, tdOO, tRed));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F32, tRed, tOne, nullptr, tDsum));

    /* E = exp(mask(Q K^T * scale) - Stats) */
    auto tS = bd.virt(F32, g.dS, g.sS), tS1 = bd.virt(F32, g.dS, g.sS);
    ops.push_back(bd.matmul(tQ, tKT, tS, g.seq_q, g.seq_kv, nullptr));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F32, tS, tScale, nullptr, tS1));
    auto x = tS1;
    if (rg)
        x = g.padding(bd, ops, x);
    auto tSub = bd.virt(F32, g.dS, g.sS);
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_SUB, F32, x, tStats, nullptr, tSub));
    auto tMasked = g.causal(bd, ops, tSub);
    auto tE = bd.virt(F32, g.dS, g.sS);
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_EXP, F32, tMasked, nullptr, nullptr, tE));

    /* dV = E^T dO (GQA: per query head, then summed over each group) */
    const int64_t dSt[4] = {b, hq, s, s}, sSt[4] = {hq * s * s, s * s, 1, s};
    auto tPT = bd.virt(BF16, dSt, sSt);
    ops.push_back(bd.reshape(tE, tPT));
    int64_t dfull[4], sfull[4];
    {
        const int64_t df[4] = {b, hq, s, d};
        const int64_t sfv[4] = {hq * s * d, s * d, d, 1};  /* dense: virtual BHSD */
        const int64_t sfr[4] = {s * hq * d, d, hq * d, 1}; /* ragged: packed, K's offsets */
        for (int i = 0; i < 4; i++)
            dfull[i] = df[i], sfull[i] = rg ? sfr[i] : sfv[i];
    }
    if (!gqa) {
        ops.push_back(bd.matmul(tPT, tdO, tdV, g.seq_kv, nullptr, g.seq_q));
    } else {
        auto tdVf = rg ? bd.tensor(U_DVFULL, BF16, dfull, sfull, false, false, g.off_v)
                       : bd.virt(BF16, dfull, sfull);
        ops.push_back(bd.matmul(tPT, tdO, tdVf, g.seq_kv, nullptr, g.seq_q));
        ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_ADD, tdVf, tdV));
    }

    /* dS = (dO V^T - Dsum) * E * scale */
    auto tdP = bd.virt(F32, g.dS, g.sS), tdP1 = bd.virt(F32, g.dS, g.sS);
    auto tdP2 = bd.virt(F32, g.dS, g.sS), tdS = bd.virt(F32, g.dS, g.sS);
    ops.push_back(bd.matmul(tdO, tVT, tdP, g.seq_q, g.seq_kv, nullptr));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_SUB, F32, tdP, tDsum, nullptr, tdP1));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F32, tdP1, tE, nullptr, tdP2));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F32, tdP2, tScale, nullptr, tdS));

    /* dK = dS^T Q (GQA as dV) */
    auto tdST = bd.virt(BF16, dSt, sSt);
    ops.push_back(bd.reshape(tdS, tdST));
    if (!gqa) {
        ops.push_back(bd.matmul(tdST, tQ, tdK, g.seq_kv, nullptr, g.seq_q));
    } else {
        auto tdKf = rg ? bd.tensor(U_DKFULL, BF16, dfull, sfull, false, false, g.off_k)
                       : bd.virt(BF16, dfull, sfull);
        ops.push_back(bd.matmul(tdST, tQ, tdKf, g.seq_kv, nullptr, g.seq_q));
        ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_ADD, tdKf, tdK));
    }

    /* dQ = dS K */
    auto tK = bd.tensor(-1, k.variant == 0 ? F32 : BF16, dk, sk, true, false, g.off_k);
    ops.push_back(bd.reshape(tKT, tK));
    if (k.det) {
        ops.push_back(bd.matmul(tdS, tK, tdQ, g.seq_q, nullptr, g.seq_kv));
    } else {
        const int64_t sa[4] = {hq * s * d, s * d, d, 1};
        auto tAcc = rg ? bd.tensor(U_DQACC, F32, dq, sq, false, false, g.off_q)
                       : bd.tensor(U_DQACC, F32, dq, sa, false);
        ops.push_back(bd.matmul(tdS, tK, tAcc, g.seq_q, nullptr, g.seq_kv));
        ops.push_back(bd.pointwise(CUDNN_POINTWISE_IDENTITY, F32, tAcc, nullptr, nullptr, tdQ));
    }
}

/* The engine of cfg carries CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC (or cannot be asked). */
bool nondeterministic(cudnnBackendDescriptor_t cfg) {
    cudnnBackendDescriptor_t eng = nullptr;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng) != CUDNN_STATUS_SUCCESS)
        return true;
    int64_t n = 0;
    bool nd = true;
    if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &n, &eng) == CUDNN_STATUS_SUCCESS &&
        n == 1) {
        cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
        int64_t nn = 0;
        if (cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                     CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT,
                                     &nn, notes) == CUDNN_STATUS_SUCCESS) {
            nd = false;
            for (int64_t i = 0; i < nn && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; i++)
                if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC)
                    nd = true;
        }
    }
    cudnnBackendDestroyDescriptor(eng);
    return nd;
}

/* Builds p->key's graph and the first plan that finalizes (engine configs of heuristics
 * mode A, then FALLBACK, as the frontend's default policy). */
void build_plan(cudnnHandle_t h, Plan *p) {
    Builder bd;
    std::vector<cudnnBackendDescriptor_t> ops;
    if (p->key.bwd)
        backward_graph(bd, p->key, ops);
    else
        forward_graph(bd, p->key, ops);
    cudnnBackendDescriptor_t graph = bd.create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    bd.set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)ops.size(),
           ops.data(), "graph ops");
    bd.set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "graph handle");
    bd.fin(graph, "operation graph finalize");

    /* deterministic backward: first only engines without the NONDETERMINISTIC note; when
     * every candidate carries it, the candidates again in order (the graph form is what
     * selects cuDNN's deterministic algorithm on Hopper, as in the frontend, which does not
     * look at the notes) */
    const bool want_det = p->key.bwd && p->key.det;
    cudnnBackendDescriptor_t plan = nullptr;
    char tried[384] = "";
    int skipped = 0;
    const cudnnBackendHeurMode_t modes[4] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK,
                                             CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    for (int mi = 0; mi < (want_det ? 4 : 2) && bd.st == CUDNN_STATUS_SUCCESS && !plan; mi++) {
        if (mi == 2 && skipped == 0)
            break; /* nothing was skipped: the second round would repeat the first */
        const bool filter = want_det && mi < 2;
        cudnnBackendDescriptor_t heur = bd.create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
        if (!heur)
            break;
        cudnnStatus_t s = cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
        if (s == CUDNN_STATUS_SUCCESS)
            s = cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1,
                                         &modes[mi]);
        if (s == CUDNN_STATUS_SUCCESS)
            s = cudnnBackendFinalize(heur);
        int64_t count = 0, got = 0;
        if (s == CUDNN_STATUS_SUCCESS)
            s = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
        std::vector<cudnnBackendDescriptor_t> cfgs;
        for (int64_t i = 0; i < count && s == CUDNN_STATUS_SUCCESS; i++) {
            cudnnBackendDescriptor_t cfg = bd.create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
            if (!cfg)
                break;
            cfgs.push_back(cfg);
        }
        if (s == CUDNN_STATUS_SUCCESS && !cfgs.empty())
            s = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)cfgs.size(), &got,
                                         cfgs.data());
        cudnnStatus_t last_st = s;
        for (int64_t i = 0; i < got && s == CUDNN_STATUS_SUCCESS && !plan; i++) {
            if (filter && nondeterministic(cfgs[i])) {
                skipped++;
                continue;
            }
            cudnnBackendDescriptor_t pl = nullptr;
            cudnnStatus_t ps =
                cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &pl);
            if (ps == CUDNN_STATUS_SUCCESS)
                ps = cudnnBackendSetAttribute(pl, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                              CUDNN_TYPE_HANDLE, 1, &h);
            if (ps == CUDNN_STATUS_SUCCESS)
                ps = cudnnBackendSetAttribute(pl, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                              CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
            if (ps == CUDNN_STATUS_SUCCESS)
                ps = cudnnBackendFinalize(pl);
            if (ps == CUDNN_STATUS_SUCCESS) {
                plan = pl;
            } else {
                last_st = ps;
                if (pl)
                    cudnnBackendDestroyDescriptor(pl);
            }
        }
        if (!plan) {
            char last[160] = "";
            cudnnGetLastErrorString(last, sizeof last);
            const size_t n = strlen(tried);
            snprintf(tried + n, sizeof tried - n, "%s%s%s: %lld configs, %s %s", n ? "; " : "",
                     mi % 2 == 0 ? "heuristics A" : "fallback", filter ? " (deterministic)" : "",
                     (long long)got, cudnnGetErrorString(last_st), last);
        }
    }
    if (bd.st == CUDNN_STATUS_SUCCESS && !plan) {
        bd.fail(CUDNN_STATUS_NOT_SUPPORTED, "execution plan");
        snprintf(bd.what, sizeof bd.what, "no engine configuration finalizes (%s)", tried);
    }
    if (plan) {
        int64_t ws = 0, nws = 0;
        if (bd.fail(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                             CUDNN_TYPE_INT64, 1, &nws, &ws),
                    "plan workspace size")) {
            cudnnBackendDestroyDescriptor(plan);
            plan = nullptr;
        } else {
            p->ws = ws;
        }
    }
    if (bd.st != CUDNN_STATUS_SUCCESS) {
        snprintf(p->why, sizeof p->why, "%s", bd.what);
        bd.release();
        p->ok = false;
        return;
    }
    p->plan = plan;
    p->keep = bd.made;
    bd.made.clear();
    p->ok = true;
}

void plan_free(Plan *p) {
    if (p->plan)
        cudnnBackendDestroyDescriptor(p->plan);
    for (auto d : p->keep)
        cudnnBackendDestroyDescriptor(d);
    delete p;
}

constexpr size_t MAX_PLANS = 48; /* shapes kept; the oldest goes first beyond that */

} // namespace

struct lm_attn_cudnn {
    cudnnHandle_t h = nullptr;
    std::vector<Plan *> plans;
    ~lm_attn_cudnn() {
        for (Plan *p : plans)
            plan_free(p);
        if (h)
            cudnnDestroy(h);
    }
};

void lm_attn_cudnn_destroy(lm_attn_cudnn *s) { delete s; }

namespace {

lm_status get_state(lm_cuda_ctx *ctx, lm_attn_cudnn **state, lm_error *err) {
    if (!*state) {
        lm_attn_cudnn *s = new lm_attn_cudnn();
        cudnnStatus_t cs = cudnnCreate(&s->h);
        if (cs != CUDNN_STATUS_SUCCESS) {
            delete s;
            return lm_errorf(err, LM_ERR_UNSUPPORTED, "attention cudnn: cudnnCreate: %s",
                             cudnnGetErrorString(cs));
        }
        *state = s;
    }
    cudnnStatus_t cs = cudnnSetStream((*state)->h, ctx->stream);
    if (cs != CUDNN_STATUS_SUCCESS)
        return lm_errorf(err, LM_ERR_IO, "attention cudnn: cudnnSetStream: %s",
                         cudnnGetErrorString(cs));
    return LM_OK;
}

/* The cached plan of key (built on first use); NULL after an error in err. */
Plan *get_plan(lm_cuda_ctx *ctx, lm_attn_cudnn *s, const Key &key, lm_error *err) {
    for (Plan *x : s->plans)
        if (x->key == key)
            return x;
    if (s->plans.size() >= MAX_PLANS) {
        /* queued work may still run the oldest plan's kernels */
        cudaError_t e = cudaStreamSynchronize(ctx->stream);
        if (e != cudaSuccess) {
            lm_cuda_fail(err, e, "cudaStreamSynchronize");
            return nullptr;
        }
        plan_free(s->plans.front());
        s->plans.erase(s->plans.begin());
    }
    Plan *p = new Plan();
    p->key = key;
    build_plan(s->h, p);
    s->plans.push_back(p);
    return p;
}

const char *key_text(const Key &k, char *buf, size_t n) {
    snprintf(buf, n, "%s %s%s b=%d s=%d H=%d/%d D=%d", k.bwd ? "backward" : "forward",
             k.ragged ? "packed" : "dense", k.bwd ? (k.det ? " deterministic" : " atomic") : "",
             k.b, k.s, k.Hq, k.Hkv, k.D);
    return buf;
}

lm_status execute(lm_cuda_ctx *ctx, lm_attn_cudnn *s, const Plan *p,
                  const std::vector<int64_t> &uids, const std::vector<void *> &ptrs,
                  lm_error *err) {
    void *ws = nullptr;
    if (p->ws > 0)
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_B, (size_t)p->ws, &ws, err));
    cudnnBackendDescriptor_t vp = nullptr;
    cudnnStatus_t cs = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                      (int64_t)uids.size(), uids.data());
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                      CUDNN_TYPE_VOID_PTR, (int64_t)ptrs.size(), ptrs.data());
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                                      &ws);
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendFinalize(vp);
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendExecute(s->h, p->plan, vp);
    if (vp)
        cudnnBackendDestroyDescriptor(vp);
    if (cs != CUDNN_STATUS_SUCCESS) {
        char last[256] = "", kt[128];
        cudnnGetLastErrorString(last, sizeof last);
        return lm_errorf(err, LM_ERR_IO, "attention cudnn: execute %s: %s %s",
                         key_text(p->key, kt, sizeof kt), cudnnGetErrorString(cs), last);
    }
    return LM_OK;
}

/* Finds (or builds) the plan: LM_ERR_UNSUPPORTED naming cuDNN's reason when no plan
 * builds. variants: how many graph variants to try (the backward has two). */
lm_status find_plan(lm_cuda_ctx *ctx, lm_attn_cudnn *s, Key key, int variants, const Plan **out,
                    lm_error *err) {
    Plan *p = nullptr;
    for (int v = 0; v < variants; v++) {
        key.variant = v;
        p = get_plan(ctx, s, key, err);
        if (!p)
            return err ? err->status : LM_ERR_IO;
        if (p->ok)
            break;
    }
    if (!p->ok) {
        char kt[128];
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cudnn: no fused-attention plan for %s: %s",
                         key_text(key, kt, sizeof kt), p->why);
    }
    *out = p;
    return LM_OK;
}

void push_ragged(const lm_attn_cudnn_io *io, std::vector<int64_t> &u, std::vector<void *> &p) {
    if (!io->ragged)
        return;
    const int64_t uu[7] = {U_SEQ_Q, U_SEQ_KV, U_OFF_Q, U_OFF_K, U_OFF_V, U_OFF_O, U_OFF_S};
    void *pp[7] = {(void *)io->seq_len, (void *)io->seq_len, (void *)io->off_q, (void *)io->off_k,
                   (void *)io->off_k,   (void *)io->off_q,   (void *)io->off_s};
    for (int i = 0; i < 7; i++)
        u.push_back(uu[i]), p.push_back(pp[i]);
}

Key make_key(const lm_attn_cudnn_io *io, int bwd) {
    Key k;
    k.bwd = bwd;
    k.ragged = io->ragged ? 1 : 0;
    k.det = bwd && io->det ? 1 : 0;
    k.b = io->b, k.s = io->s, k.Hq = io->Hq, k.Hkv = io->Hkv, k.D = io->D;
    return k;
}

} // namespace

/* Dense stats fp32 [b, Hq, s]; packed: Stats is linmoe's lse [tokens, Hq] with offsets.
 * LM_ERR_UNSUPPORTED when cuDNN builds no plan for the shape. */
lm_status lm_attn_cudnn_forward(lm_cuda_ctx *ctx, lm_attn_cudnn **state, const lm_attn_cudnn_io *io,
                                lm_error *err) {
    LM_TRY(get_state(ctx, state, err));
    lm_attn_cudnn *s = *state;
    const Plan *p = nullptr;
    LM_TRY(find_plan(ctx, s, make_key(io, 0), 1, &p, err));
    float neg_inf = -INFINITY, sc = io->scale;
    std::vector<int64_t> u = {U_Q, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEGINF};
    std::vector<void *> ptr = {(void *)io->q, (void *)io->k, (void *)io->v, io->o_out,
                               io->stats,     &sc,           &neg_inf};
    if (io->ragged)
        u.push_back(U_NEGINF_PAD), ptr.push_back(&neg_inf);
    push_ragged(io, u, ptr);
    return execute(ctx, s, p, u, ptr, err);
}

/* The backward of the file comment; dsum (and dq_acc when not deterministic, dk_full /
 * dv_full for packed GQA) are the caller's scratch; cuDNN zeroes the dQ accumulator itself
 * from 9.6 on, the caller clears it anyway. */
lm_status lm_attn_cudnn_backward(lm_cuda_ctx *ctx, lm_attn_cudnn **state,
                                 const lm_attn_cudnn_io *io, lm_error *err) {
    LM_TRY(get_state(ctx, state, err));
    lm_attn_cudnn *s = *state;
    const Plan *p = nullptr;
    LM_TRY(find_plan(ctx, s, make_key(io, 1), 2, &p, err));
    float neg_inf = -INFINITY, sc = io->scale, one = 1.0f;
    std::vector<int64_t> u = {U_Q,  U_K,  U_V,    U_O,     U_DO,  U_STATS, U_DQ,
                              U_DK, U_DV, U_DSUM, U_SCALE, U_ONE, U_NEGINF};
    std::vector<void *> ptr = {(void *)io->q,  (void *)io->k, (void *)io->v, (void *)io->o,
                               (void *)io->dO, io->stats,     io->dq,        io->dk,
                               io->dv,         io->dsum,      &sc,           &one,
                               &neg_inf};
    if (io->ragged)
        u.push_back(U_NEGINF_PAD), ptr.push_back(&neg_inf);
    if (!io->det)
        u.push_back(U_DQACC), ptr.push_back(io->dq_acc);
    if (io->ragged && io->Hq != io->Hkv) {
        u.push_back(U_DKFULL), ptr.push_back(io->dk_full);
        u.push_back(U_DVFULL), ptr.push_back(io->dv_full);
    }
    push_ragged(io, u, ptr);
    return execute(ctx, s, p, u, ptr, err);
}
