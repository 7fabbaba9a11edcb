/* The causal attention forward through cuDNN's fused flash-attention engine, built with the
 * cuDNN 9 backend (graph) C API (cudnn_graph.h; no C++ frontend). Used by
 * src/ops/cuda/attention.cu for dense [B, T] batches; contract in
 * include/linmoe/cuda_attention.h.
 *
 * The operation graph is the one cudnn-frontend's composite SDPA node lowers to for
 * cuDNN < 9.21 (its scaled_dot_product_flash_attention.h, softmax.h and
 * diagonal_band_mask.h; the fused engine recognises this pattern):
 *   S     = matmul(Q, K^T)                    fp32   [B, Hq, T, T]   (Hkv heads broadcast)
 *   S1    = S * scale                         by-value fp32 scalar
 *   r, c  = gen_index(S1, axis 2 / 3)         int32
 *   keep  = r >= c                            bool   (causal, top-left diagonal)
 *   S2    = keep ? S1 : -inf                  binary_select
 *   m     = reduce_max(S2) [B, Hq, T, 1];  E = exp(S2 - m);  l = reduce_add(E)
 *   Stats = m + log(l)                        fp32, written   [B, Hq, T, 1]
 *   P     = E / l                             bf16
 *   O     = matmul(P, V)                      bf16, written
 * Q, K, V, O are described with linmoe's [B, T, H, D] strides (K transposed by its
 * strides), Stats in [B, Hq, T] order (attention.cu transposes it to lse [B, T, Hq]).
 * Plans are built once per (B, T, Hq, Hkv, D) and kept with their descriptors in the
 * context's attention state; a shape cuDNN refuses is remembered and refused at once. */
#include <cudnn.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "linmoe/cuda_attention.h"
#include "ops/cuda/ctx.cuh"

struct lm_attn_cudnn;
void lm_attn_cudnn_destroy(lm_attn_cudnn *s);
lm_status lm_attn_cudnn_forward(lm_cuda_ctx *ctx, lm_attn_cudnn **state, int B, int T, int Hq,
                                int Hkv, int D, float scale, const void *q, const void *k,
                                const void *v, void *o, float *stats, lm_error *err);

namespace {

enum : int64_t { U_Q = 1, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEGINF, U_VIRT = 100 };

struct Plan {
    int B = 0, T = 0, Hq = 0, Hkv = 0, D = 0;
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

    cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dt, const int64_t dim[4],
                                    const int64_t str[4], bool virt, bool by_value = false) {
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
        fin(d, "tensor finalize");
        return d;
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

    cudnnBackendDescriptor_t matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                    cudnnBackendDescriptor_t c) {
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
};

/* Builds the graph of the file comment for p's shape and the first plan that finalizes. */
void build_plan(cudnnHandle_t h, Plan *p) {
    Builder bd;
    const int64_t B = p->B, T = p->T, Hq = p->Hq, Hkv = p->Hkv, D = p->D;
    int64_t uid = U_VIRT;
    const int64_t dq[4] = {B, Hq, T, D}, sq[4] = {T * Hq * D, D, Hq * D, 1};
    const int64_t dk[4] = {B, Hkv, D, T}, sk[4] = {T * Hkv * D, D, 1, Hkv * D};
    const int64_t dv[4] = {B, Hkv, T, D}, sv[4] = {T * Hkv * D, D, Hkv * D, 1};
    const int64_t ds[4] = {B, Hq, T, T}, ss[4] = {Hq * T * T, T * T, T, 1};
    const int64_t dr[4] = {B, Hq, T, 1}, sr[4] = {Hq * T, T, 1, 1};
    const int64_t d1[4] = {1, 1, 1, 1}, s1[4] = {1, 1, 1, 1};
    const cudnnDataType_t F = CUDNN_DATA_FLOAT, H = CUDNN_DATA_BFLOAT16, I = CUDNN_DATA_INT32,
                          BO = CUDNN_DATA_BOOLEAN;
    auto tQ = bd.tensor(U_Q, H, dq, sq, false);
    auto tK = bd.tensor(U_K, H, dk, sk, false);
    auto tV = bd.tensor(U_V, H, dv, sv, false);
    auto tO = bd.tensor(U_O, H, dq, sq, false);
    auto tStats = bd.tensor(U_STATS, F, dr, sr, false);
    auto tScale = bd.tensor(U_SCALE, F, d1, s1, false, true);
    auto tNeg = bd.tensor(U_NEGINF, F, d1, s1, false, true);
    auto tS = bd.tensor(uid++, F, ds, ss, true);
    auto tS1 = bd.tensor(uid++, F, ds, ss, true);
    auto tRow = bd.tensor(uid++, I, ds, ss, true);
    auto tCol = bd.tensor(uid++, I, ds, ss, true);
    auto tKeep = bd.tensor(uid++, BO, ds, ss, true);
    auto tS2 = bd.tensor(uid++, F, ds, ss, true);
    auto tM = bd.tensor(uid++, F, dr, sr, true);
    auto tSub = bd.tensor(uid++, F, ds, ss, true);
    auto tE = bd.tensor(uid++, F, ds, ss, true);
    auto tL = bd.tensor(uid++, F, dr, sr, true);
    auto tLog = bd.tensor(uid++, F, dr, sr, true);
    auto tP = bd.tensor(uid++, H, ds, ss, true);
    std::vector<cudnnBackendDescriptor_t> ops;
    ops.push_back(bd.matmul(tQ, tK, tS));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_MUL, F, tS, tScale, nullptr, tS1));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_GEN_INDEX, F, tS1, nullptr, nullptr, tRow, 2));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_GEN_INDEX, F, tS1, nullptr, nullptr, tCol, 3));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_CMP_GE, BO, tRow, tCol, nullptr, tKeep));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_BINARY_SELECT, F, tS1, tNeg, tKeep, tS2));
    ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_MAX, tS2, tM));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_SUB, F, tS2, tM, nullptr, tSub));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_EXP, F, tSub, nullptr, nullptr, tE));
    ops.push_back(bd.reduction(CUDNN_REDUCE_TENSOR_ADD, tE, tL));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_LOG, F, tL, nullptr, nullptr, tLog));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_ADD, F, tM, tLog, nullptr, tStats));
    ops.push_back(bd.pointwise(CUDNN_POINTWISE_DIV, F, tE, tL, nullptr, tP));
    ops.push_back(bd.matmul(tP, tV, tO));

    cudnnBackendDescriptor_t graph = bd.create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    bd.set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)ops.size(),
           ops.data(), "graph ops");
    bd.set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "graph handle");
    bd.fin(graph, "operation graph finalize");

    /* engine configs of heuristics mode A, then FALLBACK (as the frontend's default
     * policy); the first configuration whose plan finalizes wins */
    cudnnBackendDescriptor_t plan = nullptr;
    char tried[384] = "";
    const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    for (int mi = 0; mi < 2 && bd.st == CUDNN_STATUS_SUCCESS && !plan; mi++) {
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
            snprintf(tried + n, sizeof tried - n, "%s%s: %lld configs, %s %s", n ? "; " : "",
                     mi == 0 ? "heuristics A" : "fallback", (long long)got,
                     cudnnGetErrorString(last_st), last);
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

constexpr size_t MAX_PLANS = 32; /* shapes kept; the oldest goes first beyond that */

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

/* stats: fp32 [B, Hq, T]. LM_ERR_UNSUPPORTED when cuDNN builds no plan for the shape. */
lm_status lm_attn_cudnn_forward(lm_cuda_ctx *ctx, lm_attn_cudnn **state, int B, int T, int Hq,
                                int Hkv, int D, float scale, const void *q, const void *k,
                                const void *v, void *o, float *stats, lm_error *err) {
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
    lm_attn_cudnn *s = *state;
    cudnnStatus_t cs = cudnnSetStream(s->h, ctx->stream);
    if (cs != CUDNN_STATUS_SUCCESS)
        return lm_errorf(err, LM_ERR_IO, "attention cudnn: cudnnSetStream: %s",
                         cudnnGetErrorString(cs));
    Plan *p = nullptr;
    for (Plan *x : s->plans)
        if (x->B == B && x->T == T && x->Hq == Hq && x->Hkv == Hkv && x->D == D)
            p = x;
    if (!p) {
        if (s->plans.size() >= MAX_PLANS) {
            /* queued work may still run the oldest plan's kernels */
            LM_CK(cudaStreamSynchronize(ctx->stream));
            plan_free(s->plans.front());
            s->plans.erase(s->plans.begin());
        }
        p = new Plan();
        p->B = B, p->T = T, p->Hq = Hq, p->Hkv = Hkv, p->D = D;
        build_plan(s->h, p);
        s->plans.push_back(p);
    }
    if (!p->ok)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention cudnn: no fused-attention plan for B=%d T=%d H=%d/%d D=%d: %s",
                         B, T, Hq, Hkv, D, p->why);
    void *ws = nullptr;
    if (p->ws > 0)
        LM_TRY(lm_cuda_ctx_scratch(ctx, LM_SCRATCH_B, (size_t)p->ws, &ws, err));
    float neg_inf = -INFINITY, sc = scale;
    int64_t uids[7] = {U_Q, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEGINF};
    void *ptrs[7] = {(void *)q, (void *)k, (void *)v, o, stats, &sc, &neg_inf};
    cudnnBackendDescriptor_t vp = nullptr;
    cs = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 7,
                                      uids);
    if (cs == CUDNN_STATUS_SUCCESS)
        cs = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                      CUDNN_TYPE_VOID_PTR, 7, ptrs);
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
        char last[256] = "";
        cudnnGetLastErrorString(last, sizeof last);
        return lm_errorf(err, LM_ERR_IO, "attention cudnn: execute B=%d T=%d H=%d/%d D=%d: %s %s",
                         B, T, Hq, Hkv, D, cudnnGetErrorString(cs), last);
    }
    return LM_OK;
}
