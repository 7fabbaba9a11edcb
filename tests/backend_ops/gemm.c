/* test_backend_ops family "gemm": lm_cuda_gemm / lm_cuda_gemm_ex (include/linmoe/cuda_gemm.h)
 * against lm_sgemm (include/linmoe/core.h) on the same bf16-rounded inputs: odd sizes (not
 * multiples of any tile), all four transposes, padded leading dimensions, fp32 C with
 * beta = 1 accumulating onto a non-zero C (the weight-gradient form), the bias epilogue, a
 * strided batch, K = 0, and an unaligned operand (which cuBLASLt may refuse: the fallback
 * path). Outputs start poisoned (NaN) when beta = 0, so an unwritten element fails. */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_gemm.h"

typedef struct {
    int ta, tb, M, N, K;
    float alpha, beta;
    int f32;   /* C fp32 (else bf16) */
    int pad;   /* extra elements per row of A, B, C */
    int bias;  /* bias epilogue */
    int batch; /* 1 = single */
    int shift; /* A starts this many bf16 elements into its buffer (alignment) */
} gemm_case;

static int run_case(bo_ctx *c, const gemm_case *g) {
    lm_error e = {0};
    const int nb = g->batch > 1 ? g->batch : 1;
    const int64_t a_rows = g->ta ? g->K : g->M, a_cols = g->ta ? g->M : g->K;
    const int64_t b_rows = g->tb ? g->N : g->K, b_cols = g->tb ? g->K : g->N;
    const int64_t lda = (a_cols > 0 ? a_cols : 1) + g->pad,
                  ldb = (b_cols > 0 ? b_cols : 1) + g->pad, ldc = g->N + g->pad;
    const int64_t sa = a_rows * lda + 8, sb = b_rows * ldb + 8, sc = g->M * ldc + 8;
    const int64_t na = nb * sa + g->shift, nbb = nb * sb, nc = nb * sc;
    char shape[96];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d %c%c%s%s%s b=%g x%d", g->M, g->N, g->K,
             g->ta ? 'T' : 'N', g->tb ? 'T' : 'N', g->pad ? " pad" : "", g->bias ? " bias" : "",
             g->shift ? " unal" : "", (double)g->beta, nb);
    float *A = LM_MALLOC(sizeof(float) * (size_t)na), *B = LM_MALLOC(sizeof(float) * (size_t)nbb);
    float *C0 = LM_MALLOC(sizeof(float) * (size_t)nc), *ref = LM_MALLOC(sizeof(float) * (size_t)nc);
    float *out = LM_MALLOC(sizeof(float) * (size_t)nc),
          *bias = LM_MALLOC(sizeof(float) * (size_t)(g->N + 1));
    bo_fill_normal(c, A, na, 1.0f);
    bo_fill_normal(c, B, nbb, 1.0f);
    bo_fill_normal(c, C0, nc, 1.0f);
    bo_fill_normal(c, bias, g->N, 1.0f);
    bo_round_bf16(A, na);
    bo_round_bf16(B, nbb);
    if (!g->f32) {
        bo_round_bf16(C0, nc);
        bo_round_bf16(bias, g->N);
    }
    /* reference: lm_sgemm per batch (+ bias); K = 0: beta * C */
    for (int64_t i = 0; i < nc; i++)
        ref[i] = g->beta != 0.0f ? C0[i] : 0.0f;
    for (int b = 0; b < nb; b++) {
        float *Cb = ref + b * sc;
        if (g->K > 0)
            lm_sgemm(g->ta, g->tb, g->M, g->N, g->K, g->alpha, A + g->shift + b * sa, (int)lda,
                     B + b * sb, (int)ldb, g->beta, Cb, (int)ldc);
        else
            for (int64_t i = 0; i < (int64_t)g->M * ldc; i++)
                Cb[i] *= g->beta;
        if (g->bias)
            for (int r = 0; r < g->M; r++)
                for (int j = 0; j < g->N; j++)
                    Cb[r * ldc + j] += bias[j];
    }
    const size_t cb = g->f32 ? 4 : 2;
    void *dA = bo_upload_bf16(c, A, na, &e);
    void *dB = dA ? bo_upload_bf16(c, B, nbb, &e) : NULL;
    void *dC = NULL, *dbias = NULL;
    if (dB) {
        if (g->beta != 0.0f)
            dC = g->f32 ? (void *)bo_upload_f32(c, C0, nc, &e) : bo_upload_bf16(c, C0, nc, &e);
        else
            dC = bo_alloc_poisoned(c, (size_t)nc * cb, &e);
    }
    if (dC && g->bias)
        dbias =
            g->f32 ? (void *)bo_upload_f32(c, bias, g->N, &e) : bo_upload_bf16(c, bias, g->N, &e);
    int bad = 0;
    if (!dA || !dB || !dC || (g->bias && !dbias)) {
        bad = bo_fail(c, "gemm", shape, &e);
    } else {
        lm_cuda_gemm_desc d;
        memset(&d, 0, sizeof d);
        d.trans_a = g->ta, d.trans_b = g->tb, d.M = g->M, d.N = g->N, d.K = g->K;
        d.alpha = g->alpha, d.beta = g->beta;
        d.A = (const uint16_t *)dA + g->shift, d.lda = lda;
        d.B = dB, d.ldb = ldb, d.C = dC, d.ldc = ldc;
        d.c_type = g->f32 ? LM_CUDA_GEMM_F32 : LM_CUDA_GEMM_BF16;
        d.epilogue = g->bias ? LM_CUDA_GEMM_EPI_BIAS : LM_CUDA_GEMM_EPI_NONE;
        d.bias = dbias;
        d.batch = nb, d.stride_a = sa, d.stride_b = sb, d.stride_c = sc;
        lm_status st;
        if (nb == 1 && !g->bias && g->shift == 0)
            st = lm_cuda_gemm(c->cuda, g->ta, g->tb, g->M, g->N, g->K, g->alpha, dA, lda, dB, ldb,
                              g->beta, dC, ldc, d.c_type, &e);
        else
            st = lm_cuda_gemm_ex(c->cuda, &d, &e);
        if (st == LM_OK)
            st =
                g->f32 ? bo_download_f32(c, out, dC, nc, &e) : bo_download_bf16(c, out, dC, nc, &e);
        if (st != LM_OK) {
            bad = bo_fail(c, "gemm", shape, &e);
        } else {
            /* the [M, N] part of every batch, packed */
            const int64_t n = (int64_t)nb * g->M * g->N;
            float *po = LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
            float *pr = LM_MALLOC(sizeof(float) * (size_t)(n > 0 ? n : 1));
            int64_t k = 0;
            for (int b = 0; b < nb; b++)
                for (int r = 0; r < g->M; r++)
                    for (int j = 0; j < g->N; j++, k++) {
                        po[k] = out[b * sc + r * ldc + j];
                        pr[k] = ref[b * sc + r * ldc + j];
                    }
            /* bf16 C: one output rounding (2^-9 relative); fp32 C: exact bf16 products, fp32
             * sums in another order (the tensor cores' adder may truncate: K * 2^-24 at
             * worst, ~1e-6 typical); a wrong index or a lost beta costs O(1) */
            bad = bo_check(c, "gemm", g->f32 ? "f32" : "bf16", shape, "C", po, pr, n,
                           g->f32 ? 1e-4 : BO_TOL_FWD);
            free(po);
            free(pr);
        }
    }
    bo_free(c, dA);
    bo_free(c, dB);
    bo_free(c, dC);
    bo_free(c, dbias);
    free(A);
    free(B);
    free(C0);
    free(ref);
    free(out);
    free(bias);
    return bad;
}

int bo_family_gemm(bo_ctx *c) {
    const int before = c->failed;
    /* ta tb  M    N    K   alpha beta f32 pad bias batch shift */
    const gemm_case cases[] = {
        {0, 0, 37, 129, 70, 1.0f, 0.0f, 0, 0, 0, 1, 0},
        {0, 1, 37, 129, 70, 1.0f, 0.0f, 0, 0, 0, 1, 0},
        {1, 0, 37, 129, 70, 1.0f, 0.0f, 0, 0, 0, 1, 0},
        {1, 1, 37, 129, 70, 1.0f, 0.0f, 0, 0, 0, 1, 0},
        {0, 0, 37, 129, 70, 0.5f, 1.0f, 1, 0, 0, 1, 0},
        {0, 1, 37, 129, 70, 0.5f, 1.0f, 1, 0, 0, 1, 0},
        {1, 0, 37, 129, 70, 0.5f, 1.0f, 1, 0, 0, 1, 0},
        {1, 1, 37, 129, 70, 0.5f, 1.0f, 1, 0, 0, 1, 0},
        {1, 0, 129, 96, 333, 1.0f, 1.0f, 1, 8, 0, 1, 0},  /* dW += dY^T X, padded */
        {0, 1, 256, 384, 512, 1.0f, 0.0f, 0, 0, 0, 1, 0}, /* aligned: the cuBLASLt path */
        {0, 1, 64, 96, 128, 1.0f, 0.0f, 0, 8, 1, 1, 0},   /* bias, bf16 */
        {0, 0, 33, 40, 24, 1.0f, 1.0f, 1, 0, 1, 1, 0},    /* bias, fp32, beta 1 */
        {0, 1, 33, 40, 24, 1.0f, 0.0f, 1, 3, 0, 3, 0},    /* strided batch */
        {0, 0, 16, 24, 0, 1.0f, 0.5f, 1, 1, 0, 1, 0},     /* K = 0: C = beta C */
        {0, 0, 37, 64, 64, 1.0f, 0.0f, 0, 0, 0, 1, 1},    /* A 2-byte aligned */
        {0, 0, 1, 1, 1, 2.0f, 0.0f, 1, 0, 0, 1, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(c, &cases[i]);
    return c->failed - before;
}
