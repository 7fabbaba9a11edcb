/* The bf16 GEMM of the GPU backend through cuBLASLt (include/linmoe/cuda_gemm.h).
 *
 * Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T, so cuBLASLt's
 * "A" is our B and its "B" is our A; a row-major [r, c] array with row stride ld is the
 * column-major [c, r] array with leading dimension ld, which decides each layout's rows /
 * columns and transposes below. Descriptors, layouts and the heuristic's pick are cached in
 * the context's LM_SLOT_GEMM table keyed by everything the heuristic sees (pointer
 * alignments included: cuBLASLt assumes 256-byte alignment unless told otherwise; for a
 * strided batch the alignment is that of every batch's matrix, so the stride counts). */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "linmoe/cuda_gemm.h"
#include "ops/cuda/ctx.cuh"

namespace {

constexpr int CACHE_ENTRIES = 128;
constexpr int KEY_WORDS = 19;

struct GemmEntry {
    int64_t key[KEY_WORDS] = {};
    bool used = false;
    bool legacy = false; /* no cuBLASLt algorithm: cublasGemmEx */
    uint64_t last = 0;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo = {};
};

void entry_release(GemmEntry &e) {
    if (e.op)
        cublasLtMatmulDescDestroy(e.op);
    if (e.la)
        cublasLtMatrixLayoutDestroy(e.la);
    if (e.lb)
        cublasLtMatrixLayoutDestroy(e.lb);
    if (e.lc)
        cublasLtMatrixLayoutDestroy(e.lc);
    e = GemmEntry();
}

struct GemmCache {
    GemmEntry e[CACHE_ENTRIES];
    uint64_t tick = 0;
    ~GemmCache() {
        for (GemmEntry &x : e)
            entry_release(x);
    }
};

/* largest power of two dividing the address, capped at 256 (cuBLASLt's default) */
int64_t align_of(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    if (a == 0)
        return 256;
    const uintptr_t low = a & (~a + 1);
    return low >= 256 ? 256 : (int64_t)low;
}

/* the alignment every batch's matrix has: the base's, lowered by the batch stride's (in
 * bytes) when there is more than one batch */
int64_t align_batched(const void *p, int nb, int64_t stride, int64_t elem_bytes) {
    int64_t a = align_of(p);
    const uint64_t sb = (uint64_t)stride * (uint64_t)elem_bytes;
    if (nb > 1 && sb != 0) {
        const uint64_t low = sb & (~sb + 1);
        if ((int64_t)low < a)
            a = (int64_t)low;
    }
    return a;
}

cudaDataType_t cuda_type(lm_cuda_gemm_type t) {
    return t == LM_CUDA_GEMM_F32 ? CUDA_R_32F : CUDA_R_16BF;
}

const char *OP = "gemm cuda";

lm_status validate(const lm_cuda_gemm_desc *d, lm_error *err) {
    if (!d)
        return lm_errorf(err, LM_ERR_INVALID, "%s: NULL descriptor", OP);
    if (d->M < 0 || d->N < 0 || d->K < 0 || d->batch < 0)
        return lm_errorf(err, LM_ERR_INVALID, "%s: M = %d, N = %d, K = %d, batch = %d must be >= 0",
                         OP, d->M, d->N, d->K, d->batch);
    if ((d->trans_a != 0 && d->trans_a != 1) || (d->trans_b != 0 && d->trans_b != 1))
        return lm_errorf(err, LM_ERR_INVALID, "%s: trans_a = %d, trans_b = %d must be 0 or 1", OP,
                         d->trans_a, d->trans_b);
    if (d->c_type != LM_CUDA_GEMM_BF16 && d->c_type != LM_CUDA_GEMM_F32)
        return lm_errorf(err, LM_ERR_INVALID, "%s: c_type = %d is not LM_CUDA_GEMM_BF16 / _F32", OP,
                         (int)d->c_type);
    if (d->epilogue != LM_CUDA_GEMM_EPI_NONE && d->epilogue != LM_CUDA_GEMM_EPI_BIAS)
        return lm_errorf(err, LM_ERR_INVALID, "%s: epilogue = %d is not NONE / BIAS", OP,
                         (int)d->epilogue);
    const int64_t a_cols = d->trans_a ? d->M : d->K, b_cols = d->trans_b ? d->K : d->N;
    if (d->lda < (a_cols > 1 ? a_cols : 1))
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: lda = %lld is below %lld (trans_a = %d, M = %d, K = %d)", OP,
                         (long long)d->lda, (long long)a_cols, d->trans_a, d->M, d->K);
    if (d->ldb < (b_cols > 1 ? b_cols : 1))
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: ldb = %lld is below %lld (trans_b = %d, N = %d, K = %d)", OP,
                         (long long)d->ldb, (long long)b_cols, d->trans_b, d->N, d->K);
    if (d->ldc < (d->N > 1 ? d->N : 1))
        return lm_errorf(err, LM_ERR_INVALID, "%s: ldc = %lld is below N = %d", OP,
                         (long long)d->ldc, d->N);
    const int nb = d->batch > 1 ? d->batch : 1;
    if (d->M == 0 || d->N == 0 || d->batch == 0)
        return LM_OK;
    if (!d->C)
        return lm_errorf(err, LM_ERR_INVALID, "%s: output 'C' is NULL", OP);
    if (d->K > 0 && (!d->A || !d->B))
        return lm_errorf(err, LM_ERR_INVALID, "%s: input '%s' is NULL", OP, d->A ? "B" : "A");
    if (d->epilogue == LM_CUDA_GEMM_EPI_BIAS && (!d->bias || align_of(d->bias) < 16))
        return lm_errorf(err, LM_ERR_INVALID, "%s: bias %p must be a 16-byte aligned [N] vector",
                         OP, d->bias);
    if (nb > 1 && (d->stride_a < 0 || d->stride_b < 0 || d->stride_c < 0))
        return lm_errorf(err, LM_ERR_INVALID, "%s: negative batch stride (a %lld, b %lld, c %lld)",
                         OP, (long long)d->stride_a, (long long)d->stride_b,
                         (long long)d->stride_c);
    if (nb > 1 && d->stride_c < d->ldc * (int64_t)(d->M - 1) + d->N)
        return lm_errorf(err, LM_ERR_INVALID,
                         "%s: stride_c = %lld makes the batches of C overlap (M = %d, ldc = %lld)",
                         OP, (long long)d->stride_c, d->M, (long long)d->ldc);
    return LM_OK;
}

/* C = beta * C (+ bias): the K = 0 case and the bias of the cublasGemmEx fallback */
template <typename T> __device__ __forceinline__ float ld_f(const T *p);
template <> __device__ __forceinline__ float ld_f<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float ld_f<__nv_bfloat16>(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}
template <typename T> __device__ __forceinline__ void st_f(T *p, float v);
template <> __device__ __forceinline__ void st_f<float>(float *p, float v) { *p = v; }
template <> __device__ __forceinline__ void st_f<__nv_bfloat16>(__nv_bfloat16 *p, float v) {
    *p = __float2bfloat16_rn(v);
}

template <typename T>
__global__ void scale_bias_kernel(T *C, int64_t M, int N, int64_t ldc, int64_t stride_c, int nb,
                                  float beta, const T *bias, int scale) {
    const int64_t per = M * N, total = per * nb;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t b = i / per, r = (i % per) / N;
        const int c = (int)(i % N);
        T *p = C + b * stride_c + r * ldc + c;
        float v = scale ? (beta == 0.0f ? 0.0f : beta * ld_f(p)) : ld_f(p);
        if (bias)
            v += ld_f(bias + c);
        st_f(p, v);
    }
}

lm_status launch_scale_bias(lm_cuda_ctx *ctx, const lm_cuda_gemm_desc *d, int scale,
                            lm_error *err) {
    const int nb = d->batch > 1 ? d->batch : 1;
    const int64_t total = (int64_t)d->M * d->N * nb;
    const int grid = lm_cuda_grid(ctx, total);
    const void *bias = d->epilogue == LM_CUDA_GEMM_EPI_BIAS ? d->bias : nullptr;
    if (d->c_type == LM_CUDA_GEMM_F32)
        scale_bias_kernel<float><<<grid, 256, 0, ctx->stream>>>((float *)d->C, d->M, d->N, d->ldc,
                                                                d->stride_c, nb, d->beta,
                                                                (const float *)bias, scale);
    else
        scale_bias_kernel<__nv_bfloat16>
            <<<grid, 256, 0, ctx->stream>>>((__nv_bfloat16 *)d->C, d->M, d->N, d->ldc, d->stride_c,
                                            nb, d->beta, (const __nv_bfloat16 *)bias, scale);
    LM_CK_LAUNCH("gemm scale_bias_kernel");
    return LM_OK;
}

void make_key(const lm_cuda_gemm_desc *d, int64_t *k) {
    const int nb = d->batch > 1 ? d->batch : 1;
    int i = 0;
    k[i++] = d->trans_a;
    k[i++] = d->trans_b;
    k[i++] = d->M;
    k[i++] = d->N;
    k[i++] = d->K;
    k[i++] = d->lda;
    k[i++] = d->ldb;
    k[i++] = d->ldc;
    k[i++] = d->c_type;
    k[i++] = d->epilogue;
    k[i++] = nb;
    k[i++] = nb > 1 ? d->stride_a : 0;
    k[i++] = nb > 1 ? d->stride_b : 0;
    k[i++] = nb > 1 ? d->stride_c : 0;
    const int64_t ce = d->c_type == LM_CUDA_GEMM_F32 ? 4 : 2;
    k[i++] = align_batched(d->A, nb, d->stride_a, 2);
    k[i++] = align_batched(d->B, nb, d->stride_b, 2);
    k[i++] = align_batched(d->C, nb, d->stride_c, ce);
    k[i++] = d->epilogue == LM_CUDA_GEMM_EPI_BIAS ? align_of(d->bias) : 0;
    k[i++] = 0x6c6d; /* version of the key layout */
    LM_CHECK(i == KEY_WORDS);
}

lm_status layout_new(cublasLtMatrixLayout_t *l, cudaDataType_t t, int64_t rows, int64_t cols,
                     int64_t ld, int nb, int64_t stride, lm_error *err) {
    LM_CK_BLAS(cublasLtMatrixLayoutCreate(l, t, (uint64_t)rows, (uint64_t)cols, ld));
    if (nb > 1) {
        const int32_t n = nb;
        LM_CK_BLAS(
            cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n));
        LM_CK_BLAS(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &stride, sizeof stride));
    }
    return LM_OK;
}

/* Descriptors, layouts and the heuristic for a new key (e->key set). */
lm_status entry_build(lm_cuda_ctx *ctx, GemmEntry *e, const lm_cuda_gemm_desc *d, lm_error *err) {
    const int nb = d->batch > 1 ? d->batch : 1;
    const cudaDataType_t ct = cuda_type(d->c_type);
    LM_CK_BLAS(cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    /* cuBLASLt A = our B, cuBLASLt B = our A */
    const cublasOperation_t op_a = d->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = d->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LM_CK_BLAS(
        cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    LM_CK_BLAS(
        cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    if (d->epilogue == LM_CUDA_GEMM_EPI_BIAS) {
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bt = (int32_t)ct;
        LM_CK_BLAS(
            cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        LM_CK_BLAS(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                  sizeof bt));
        LM_CK_BLAS(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &d->bias, sizeof d->bias));
    }
    /* our B: stored [K, N] (col-major [N, K], no transpose) or [N, K] (col-major [K, N], T) */
    LM_TRY(layout_new(&e->la, CUDA_R_16BF, d->trans_b ? d->K : d->N, d->trans_b ? d->N : d->K,
                      d->ldb, nb, d->stride_b, err));
    /* our A: stored [M, K] (col-major [K, M], no transpose) or [K, M] (col-major [M, K], T) */
    LM_TRY(layout_new(&e->lb, CUDA_R_16BF, d->trans_a ? d->M : d->K, d->trans_a ? d->K : d->M,
                      d->lda, nb, d->stride_a, err));
    LM_TRY(layout_new(&e->lc, ct, d->N, d->M, d->ldc, nb, d->stride_c, err));

    cublasLtMatmulPreference_t pref = nullptr;
    LM_CK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx->lt_ws_bytes;
    /* cuBLASLt A = our B, cuBLASLt B = our A */
    const int64_t ce = d->c_type == LM_CUDA_GEMM_F32 ? 4 : 2;
    const uint32_t al_a = (uint32_t)align_batched(d->B, nb, d->stride_b, 2),
                   al_b = (uint32_t)align_batched(d->A, nb, d->stride_a, 2),
                   al_c = (uint32_t)align_batched(d->C, nb, d->stride_c, ce);
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                 &al_a, sizeof al_a);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                 &al_b, sizeof al_b);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                 &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                 &al_c, sizeof al_c);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cublasLtMatmulPreferenceDestroy(pref);
        return lm_cublas_fail(err, s, "cublasLtMatmulPreferenceSetAttribute");
    }
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int nres = 0;
    s = cublasLtMatmulAlgoGetHeuristic(ctx->lt, e->op, e->la, e->lb, e->lc, e->lc, pref, 1, &res,
                                       &nres);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s == CUBLAS_STATUS_SUCCESS && nres > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
        e->algo = res.algo;
        e->legacy = false;
    } else {
        /* NOT_SUPPORTED (no kernel for these alignments / leading dimensions) and the like:
         * cublasGemmEx handles any layout */
        e->legacy = true;
    }
    return LM_OK;
}

lm_status find_entry(lm_cuda_ctx *ctx, const lm_cuda_gemm_desc *d, GemmEntry **out, lm_error *err) {
    GemmCache *cache = lm_cuda_ctx_get<GemmCache>(ctx, LM_SLOT_GEMM);
    int64_t key[KEY_WORDS];
    make_key(d, key);
    cache->tick++;
    GemmEntry *victim = nullptr; /* an unused entry, else the least recently used */
    for (GemmEntry &e : cache->e) {
        if (e.used && memcmp(e.key, key, sizeof key) == 0) {
            e.last = cache->tick;
            *out = &e;
            return LM_OK;
        }
        if (!victim || (victim->used && (!e.used || e.last < victim->last)))
            victim = &e;
    }
    entry_release(*victim);
    memcpy(victim->key, key, sizeof key);
    lm_status st = entry_build(ctx, victim, d, err);
    if (st != LM_OK) {
        entry_release(*victim);
        return st;
    }
    victim->used = true;
    victim->last = cache->tick;
    *out = victim;
    return LM_OK;
}

lm_status run_legacy(lm_cuda_ctx *ctx, const lm_cuda_gemm_desc *d, lm_error *err) {
    const int nb = d->batch > 1 ? d->batch : 1;
    const cublasOperation_t op_a = d->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = d->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cudaDataType_t ct = cuda_type(d->c_type);
    LM_CK_BLAS(cublasSetStream(ctx->blas, ctx->stream));
    if (d->lda > INT32_MAX || d->ldb > INT32_MAX || d->ldc > INT32_MAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s: no cuBLASLt algorithm for M = %d N = %d K = %d and a leading "
                         "dimension above 2^31 (lda %lld, ldb %lld, ldc %lld)",
                         OP, d->M, d->N, d->K, (long long)d->lda, (long long)d->ldb,
                         (long long)d->ldc);
    if (nb == 1)
        LM_CK_BLAS(cublasGemmEx(ctx->blas, op_a, op_b, d->N, d->M, d->K, &d->alpha, d->B,
                                CUDA_R_16BF, (int)d->ldb, d->A, CUDA_R_16BF, (int)d->lda, &d->beta,
                                d->C, ct, (int)d->ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
        LM_CK_BLAS(cublasGemmStridedBatchedEx(
            ctx->blas, op_a, op_b, d->N, d->M, d->K, &d->alpha, d->B, CUDA_R_16BF, (int)d->ldb,
            d->stride_b, d->A, CUDA_R_16BF, (int)d->lda, d->stride_a, &d->beta, d->C, ct,
            (int)d->ldc, d->stride_c, nb, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (d->epilogue == LM_CUDA_GEMM_EPI_BIAS)
        LM_TRY(launch_scale_bias(ctx, d, 0, err));
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_cuda_gemm_ex(lm_cuda_ctx *ctx, const lm_cuda_gemm_desc *d, lm_error *err) {
    LM_TRY(lm_cuda_ctx_enter(ctx, err));
    LM_TRY(validate(d, err));
    if (d->M == 0 || d->N == 0 || d->batch == 0)
        return LM_OK;
    if (d->K == 0) {
        if (d->beta == 1.0f && d->epilogue == LM_CUDA_GEMM_EPI_NONE)
            return LM_OK;
        return launch_scale_bias(ctx, d, 1, err);
    }
    GemmEntry *e = nullptr;
    LM_TRY(find_entry(ctx, d, &e, err));
    if (e->legacy)
        return run_legacy(ctx, d, err);
    if (d->epilogue == LM_CUDA_GEMM_EPI_BIAS)
        LM_CK_BLAS(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &d->bias, sizeof d->bias));
    LM_CK_BLAS(cublasLtMatmul(ctx->lt, e->op, &d->alpha, d->B, e->la, d->A, e->lb, &d->beta, d->C,
                              e->lc, d->C, e->lc, &e->algo, ctx->lt_ws, ctx->lt_ws_bytes,
                              ctx->stream));
    return LM_OK;
}

extern "C" lm_status lm_cuda_gemm(lm_cuda_ctx *ctx, int trans_a, int trans_b, int M, int N, int K,
                                  float alpha, const void *A, int64_t lda, const void *B,
                                  int64_t ldb, float beta, void *C, int64_t ldc,
                                  lm_cuda_gemm_type c_type, lm_error *err) {
    lm_cuda_gemm_desc d;
    memset(&d, 0, sizeof d);
    d.trans_a = trans_a, d.trans_b = trans_b;
    d.M = M, d.N = N, d.K = K;
    d.alpha = alpha, d.beta = beta;
    d.A = A, d.lda = lda, d.B = B, d.ldb = ldb, d.C = C, d.ldc = ldc;
    d.c_type = c_type;
    d.epilogue = LM_CUDA_GEMM_EPI_NONE;
    d.batch = 1;
    return lm_cuda_gemm_ex(ctx, &d, err);
}
