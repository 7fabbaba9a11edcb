/* test_backend_ops family "embedding": lm_cuda_embedding_forward / _backward against a
 * plain loop of the CPU model's semantics (src/model/model.c: the gather in run_forward,
 * the token-order scatter-add "embedding rows" of the backward; the reference sums in
 * fp64). There is no stand-alone CPU embedding op.
 *
 * Cases: N = 1; ids drawn from a few rows so that runs of one id span many 16-token
 * chunks of the sorted order (the cross-chunk path); a heavy-tailed (Zipf-like) draw over
 * V = 50304; D = 1000 (vector path, 125 vectors) and D = 1001 (scalar path); out-of-range
 * ids (-1 and V), which must give zero rows, be counted in n_bad and add nothing. The
 * gradient accumulates into a random prefill of the whole table (rows no token hits
 * must stay as they were), and the backward runs twice into two copies of the prefill:
 * the results must be the same bits. The backward runs through the public entry point
 * (op "embedding") and each variant of src/ops/cuda/layers_variants.h ("embedding/v1");
 * V = 1 with N = 5000 gives one run over 313 chunks of 16 (the cross-chunk kernel probes
 * 256 chunk starts at a time), N = 70000 with V = 50304 needs 33-bit keys (the 64-bit
 * instance).
 *
 * Tolerances: out exact (a copy). dweight 1e-5 (fp32 sums of bf16 values against fp64;
 * ~1e-7 expected).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_layers.h"
#include "ops/cuda/layers_variants.h"

#define TOL_EXACT 1e-6
#define TOL_DW 1e-5

static float *hbuf(int64_t n) { return LM_CALLOC((size_t)(n > 0 ? n : 1), sizeof(float)); }

typedef struct {
    int64_t N;
    int V, D;
    int dist; /* 0 uniform, 1 few rows (V small), 2 Zipf-like */
    int bad;  /* out-of-range ids to plant */
} ecase;

static void emb_case(bo_ctx *c, const ecase *k) {
    const int64_t N = k->N, V = k->V, D = k->D, nW = V * D, nO = N * D;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%lld V=%d D=%d%s", (long long)N, k->V, k->D,
             k->bad ? " bad" : "");
    int32_t *ids = LM_MALLOC(sizeof(int32_t) * (size_t)N);
    for (int64_t n = 0; n < N; n++) {
        const double u = lm_rng_uniform(&c->rng);
        int64_t id = k->dist == 2 ? (int64_t)floor(pow((double)V, u)) - 1 : (int64_t)(u * V);
        if (id < 0)
            id = 0;
        if (id >= V)
            id = V - 1;
        ids[n] = (int32_t)id;
    }
    for (int i = 0; i < k->bad && i < N; i++)
        ids[(i * 7919) % N] = i % 2 ? -1 : k->V;
    int expect_bad = 0;
    for (int64_t n = 0; n < N; n++)
        expect_bad += ids[n] < 0 || ids[n] >= k->V;
    float *W = hbuf(nW), *dout = hbuf(nO), *dW0 = hbuf(nW), *out = hbuf(nO), *gout = hbuf(nO);
    float *gdW = hbuf(nW), *gdW2 = hbuf(nW), *dWref = hbuf(nW);
    double *acc = LM_MALLOC(sizeof(double) * (size_t)nW);
    bo_fill_normal(c, W, nW, 1.0f);
    bo_fill_normal(c, dout, nO, 1.0f);
    bo_fill_normal(c, dW0, nW, 0.1f);
    bo_round_bf16(W, nW);
    bo_round_bf16(dout, nO);
    for (int64_t i = 0; i < nW; i++)
        acc[i] = dW0[i];
    for (int64_t n = 0; n < N; n++) {
        const int32_t id = ids[n];
        const int ok = id >= 0 && id < k->V;
        for (int64_t d = 0; d < D; d++) {
            out[n * D + d] = ok ? W[id * D + d] : 0.0f;
            if (ok)
                acc[id * D + d] += dout[n * D + d];
        }
    }
    for (int64_t i = 0; i < nW; i++)
        dWref[i] = (float)acc[i];
    lm_error e = {0};
    const int32_t zero = 0;
    int32_t gbad = -1;
    int32_t *dids = bo_upload_bytes(c, ids, sizeof(int32_t) * (size_t)N, &e);
    void *dWd = bo_upload_bf16(c, W, nW, &e);
    void *doutd = bo_upload_bf16(c, dout, nO, &e);
    float *dW0d = bo_upload_f32(c, dW0, nW, &e);
    float *dW0d2 = bo_upload_f32(c, dW0, nW, &e);
    int32_t *dbad = bo_upload_bytes(c, &zero, sizeof zero, &e);
    void *outd = bo_alloc_poisoned(c, (size_t)nO * 2, &e);
    if (!dids || !dWd || !doutd || !dW0d || !dW0d2 || !dbad || !outd) {
        bo_fail(c, "embedding", shape, &e);
        goto out;
    }
    if (lm_cuda_embedding_forward(c->cuda, N, k->V, k->D, dids, dWd, outd, dbad, &e) != LM_OK ||
        bo_download_bf16(c, gout, outd, nO, &e) != LM_OK ||
        lm_cuda_ctx_download(c->cuda, &gbad, dbad, sizeof gbad, &e) != LM_OK) {
        bo_fail(c, "embedding", shape, &e);
        goto out;
    }
    bo_check(c, "embedding", "bf16", shape, "out", gout, out, nO, TOL_EXACT);
    /* the bad-id count and (below) the bitwise rerun, each as a one-element row that is 0
     * when right */
    const float z = 0.0f;
    const float badd = (float)(gbad - expect_bad);
    bo_check(c, "embedding", "i32", shape, "n_bad", &badd, &z, 1, 0.0);
    for (int v = 0; v <= LM_LAYERS_EMB_BWD_VARIANTS; v++) {
        char op[32] = "embedding";
        if (v)
            snprintf(op, sizeof op, "embedding/v%d", v);
        if (lm_cuda_ctx_upload(c->cuda, dW0d, dW0, sizeof(float) * (size_t)nW, &e) != LM_OK ||
            lm_cuda_ctx_upload(c->cuda, dW0d2, dW0, sizeof(float) * (size_t)nW, &e) != LM_OK ||
            lm_cuda_embedding_backward_v(c->cuda, v, N, k->V, k->D, dids, doutd, dW0d, &e) !=
                LM_OK ||
            lm_cuda_embedding_backward_v(c->cuda, v, N, k->V, k->D, dids, doutd, dW0d2, &e) !=
                LM_OK ||
            bo_download_f32(c, gdW, dW0d, nW, &e) != LM_OK ||
            bo_download_f32(c, gdW2, dW0d2, nW, &e) != LM_OK) {
            bo_fail(c, op, shape, &e);
            continue;
        }
        bo_check(c, op, "f32", shape, "dweight", gdW, dWref, nW, TOL_DW);
        const float rerun = memcmp(gdW, gdW2, sizeof(float) * (size_t)nW) == 0 ? 0.0f : 1.0f;
        bo_check(c, op, "f32", shape, "dw rerun", &rerun, &z, 1, 0.0);
    }
out:
    bo_free(c, dids);
    bo_free(c, dWd);
    bo_free(c, doutd);
    bo_free(c, dW0d);
    bo_free(c, dW0d2);
    bo_free(c, dbad);
    bo_free(c, outd);
    free(ids), free(W), free(dout), free(dW0), free(out), free(gout), free(gdW), free(gdW2);
    free(dWref), free(acc);
}

int bo_family_embedding(bo_ctx *c) {
    const int failed0 = c->failed;
    /* N, V, D, dist, bad */
    const ecase ec[] = {
        {1, 10, 8, 0, 0},        {37, 50, 1000, 0, 0},    {300, 7, 2048, 1, 0}, {1000, 3, 64, 1, 0},
        {2000, 50304, 64, 2, 0}, {333, 40, 1001, 0, 0},   {257, 20, 136, 1, 5}, {64, 2, 16, 1, 0},
        {5000, 1, 1024, 0, 0},   {70000, 50304, 8, 2, 3},
    };
    for (size_t i = 0; i < sizeof ec / sizeof ec[0]; i++)
        emb_case(c, &ec[i]);
    return c->failed - failed0;
}
