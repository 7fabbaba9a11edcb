/* test_backend_ops family "cross_entropy": lm_cuda_ce_forward_backward / lm_cuda_ce_forward
 * (include/linmoe/cuda_gemm.h) against the CPU's lm_cross_entropy_forward / _nll / _backward
 * (include/linmoe/layers.h, src/ops/cross_entropy.c) on the same bf16-rounded h and W.
 * Every variant of the config: bf16 and fp32 logits, the STAGED and STREAM row kernels
 * (and AUTO falling back to STREAM when a row does not fit in shared memory), dh split
 * 1 / 2 / 4 / 8 (fp32 partials; D a multiple of 4 and not), one chunk and several (a short
 * last chunk, the automatic balanced chunking), V = 1000, odd V (row padding), V = 50304,
 * V = 131072, N = 1, ignored labels, every label ignored, the caller's gradient scale
 * (mean = 0), the eval forward, a bitwise re-run, STAGED and STREAM giving the same bits,
 * a bad label (NaN nll, zero gradient row) and the refusal of STAGED for a row too large.
 * dW starts from a non-zero value (the GPU accumulates: dW += ...); dh and nll start
 * poisoned.
 *
 * Tolerances (rel RMS): fp32 logits: loss and nll 1e-5 (fp32 rounding of sums over V).
 * bf16 logits: each logit is rounded by at most 2^-9 of its magnitude, so a token's nll
 * moves by about 2^-9 |x_target| / sqrt(3) RMS (the lse, a softmax-weighted mean of such
 * errors, moves less): at logits of std 1.5 that is ~2e-4 of an nll near log V, so 1e-3.
 * dh and dW: the bf16 dlogits (2^-9 relative) and, for dh, its bf16 output: ~2e-3 RMS,
 * checked at BO_TOL_GRAD (0.008) for both. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_gemm.h"
#include "linmoe/layers.h"

typedef struct {
    int N, D, V;
    int n_ignored;
    int chunk_rows;
    int f32;     /* fp32 logits (else bf16, the default) */
    int row;     /* lm_cuda_ce_row_kernel */
    int split;   /* dh_split */
    int mean;    /* 0: the caller's scale dloss */
    float dloss; /* gradient of the loss */
    int rerun;   /* also check a second run is bitwise identical */
    int xrow;    /* also run the other row kernel (STAGED <-> STREAM): the same bits */
} ce_case;

static double rms(const float *x, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return n > 0 ? sqrt(s / (double)n) : 0.0;
}

/* count of differing bytes as one row that passes only at 0 */
static int check_same(bo_ctx *c, const char *shape, const char *tensor, const void *a,
                      const void *b, size_t bytes) {
    const unsigned char *x = a, *y = b;
    float diff = 0.0f, zero = 0.0f;
    for (size_t i = 0; i < bytes; i++)
        diff += x[i] != y[i];
    return bo_check(c, "cross_entropy", "bits", shape, tensor, &diff, &zero, 1, 0.0);
}

/* device inputs and outputs of one case */
typedef struct {
    void *h, *W;
    int32_t *lab;
    float *dW, *nll, *sc; /* sc: loss_sum, count (int bits), 2 spare */
    void *dh;
} ce_dev;

/* host results of one GPU training call */
typedef struct {
    float *dh, *dW, *nll;
    float sc[4];
} ce_host;

static void host_free(ce_host *o) { free(o->dh), free(o->dW), free(o->nll); }

static void host_alloc(ce_host *o, int64_t nh, int64_t nw, int N) {
    memset(o, 0, sizeof *o);
    o->dh = LM_MALLOC(sizeof(float) * (size_t)(nh > 0 ? nh : 1));
    o->dW = LM_MALLOC(sizeof(float) * (size_t)nw);
    o->nll = LM_MALLOC(sizeof(float) * (size_t)(N > 0 ? N : 1));
}

/* dW := dW0, dh and nll poisoned, then the training call; results downloaded */
static lm_status gpu_train(bo_ctx *c, const lm_cuda_ce_config *g, const ce_dev *d, const float *dW0,
                           ce_host *o, lm_error *e) {
    const int64_t nh = g->N * g->D, nw = (int64_t)g->V * g->D;
    lm_status st = lm_cuda_ctx_upload(c->cuda, d->dW, dW0, sizeof(float) * (size_t)nw, e);
    if (st == LM_OK)
        st = lm_cuda_ctx_memset(c->cuda, d->dh, 0xFF, 2 * (size_t)(nh > 0 ? nh : 1), e);
    if (st == LM_OK)
        st =
            lm_cuda_ctx_memset(c->cuda, d->nll, 0xFF, sizeof(float) * (size_t)(g->N ? g->N : 1), e);
    if (st == LM_OK)
        st = lm_cuda_ctx_memset(c->cuda, d->sc, 0xFF, 4 * sizeof(float), e);
    lm_cuda_ce_outputs out = {d->sc, (int32_t *)(d->sc + 1), d->nll, d->dh, d->dW};
    if (st == LM_OK)
        st = lm_cuda_ce_forward_backward(c->cuda, g, d->h, d->W, d->lab, &out, e);
    if (st == LM_OK)
        st = bo_download_f32(c, o->sc, d->sc, 4, e);
    if (st == LM_OK && g->N > 0)
        st = bo_download_f32(c, o->nll, d->nll, g->N, e);
    if (st == LM_OK && nh > 0)
        st = bo_download_bf16(c, o->dh, d->dh, nh, e);
    if (st == LM_OK)
        st = bo_download_f32(c, o->dW, d->dW, nw, e);
    return st;
}

static void dev_free(bo_ctx *c, ce_dev *d) {
    bo_free(c, d->h);
    bo_free(c, d->W);
    bo_free(c, d->lab);
    bo_free(c, d->dW);
    bo_free(c, d->dh);
    bo_free(c, d->nll);
    bo_free(c, d->sc);
    memset(d, 0, sizeof *d);
}

static lm_status dev_alloc(bo_ctx *c, ce_dev *d, const float *h, const float *W, const int32_t *lab,
                           int N, int D, int V, lm_error *e) {
    const int64_t nh = (int64_t)N * D, nw = (int64_t)V * D;
    memset(d, 0, sizeof *d);
    d->h = bo_upload_bf16(c, h, nh > 0 ? nh : 1, e);
    d->W = d->h ? bo_upload_bf16(c, W, nw, e) : NULL;
    d->lab = d->W ? bo_upload_bytes(c, lab, sizeof(int32_t) * (size_t)(N > 0 ? N : 1), e) : NULL;
    d->dW = d->lab ? bo_alloc_poisoned(c, sizeof(float) * (size_t)nw, e) : NULL;
    d->dh = d->dW ? bo_alloc_poisoned(c, (size_t)(nh > 0 ? nh : 1) * 2, e) : NULL;
    d->nll = d->dh ? bo_alloc_poisoned(c, sizeof(float) * (size_t)(N > 0 ? N : 1), e) : NULL;
    d->sc = d->nll ? bo_alloc_poisoned(c, 4 * sizeof(float), e) : NULL;
    return d->sc ? LM_OK : LM_ERR_IO;
}

static void case_shape(const ce_case *k, char *shape, size_t n) {
    static const char *rows[] = {"", " stg", " str"};
    snprintf(shape, n, "N=%d D=%d V=%d ig=%d ch=%d%s%s s%d%s", k->N, k->D, k->V, k->n_ignored,
             k->chunk_rows, k->f32 ? " f32" : "", rows[k->row], k->split, k->mean ? "" : " sum");
}

static int run_case(bo_ctx *c, const ce_case *k) {
    lm_error e = {0};
    const int N = k->N, D = k->D, V = k->V;
    char shape[96];
    case_shape(k, shape, sizeof shape);
    const int64_t nh = (int64_t)N * D, nw = (int64_t)V * D;
    float *h = LM_MALLOC(sizeof(float) * (size_t)(nh > 0 ? nh : 1));
    float *W = LM_MALLOC(sizeof(float) * (size_t)nw);
    int32_t *lab = LM_MALLOC(sizeof(int32_t) * (size_t)(N > 0 ? N : 1));
    /* logits of std about 1.5, as a trained LM head gives */
    bo_fill_normal(c, h, nh, 1.0f);
    bo_fill_normal(c, W, nw, 1.5f / sqrtf((float)D));
    bo_round_bf16(h, nh);
    bo_round_bf16(W, nw);
    for (int i = 0; i < N; i++)
        lab[i] = (int32_t)(lm_rng_u32(&c->rng) % (uint32_t)V);
    if (N > 2) /* the first and the last token ids */
        lab[0] = 0, lab[N - 1] = V - 1;
    for (int j = 0; j < k->n_ignored && j < N; j++)
        lab[(j * 7 + 3) % N] = -1;

    /* CPU reference */
    lm_ce_config cc;
    lm_ce_config_default(&cc, N, D, V);
    double loss = 0;
    int64_t cnt = 0;
    float *nll_ref = LM_MALLOC(sizeof(float) * (size_t)(N > 0 ? N : 1));
    float *dh_ref = LM_MALLOC(sizeof(float) * (size_t)(nh > 0 ? nh : 1));
    float *dW_ref = LM_MALLOC(sizeof(float) * (size_t)nw);
    float *dW0 = LM_MALLOC(sizeof(float) * (size_t)nw);
    ce_host o, o2;
    host_alloc(&o, nh, nw, N);
    host_alloc(&o2, nh, nw, N);
    ce_dev d;
    memset(&d, 0, sizeof d);
    int bad = 0;
    lm_status st = lm_cross_entropy_forward(&cc, h, W, lab, &loss, &cnt, NULL, &e);
    if (st == LM_OK)
        st = lm_cross_entropy_nll(&cc, h, W, lab, nll_ref, NULL, &e);
    /* mean = 0: the GPU scales by dloss alone, the CPU by dloss / count */
    const float cpu_dloss = k->mean ? k->dloss : k->dloss * (float)(cnt > 0 ? cnt : 1);
    if (st == LM_OK)
        st = lm_cross_entropy_backward(&cc, h, W, lab, NULL, cpu_dloss, dh_ref, dW_ref, &e);
    if (st != LM_OK) {
        bad = bo_fail(c, "cross_entropy", shape, &e);
        goto done;
    }
    /* dW starts at values of the gradient's size: the += is checked, not masked */
    bo_fill_normal(c, dW0, nw, (float)(rms(dW_ref, nw) + 1e-6));

    lm_cuda_ce_config g;
    lm_cuda_ce_config_default(&g, N, D, V);
    g.chunk_rows = k->chunk_rows;
    g.logits_bf16 = !k->f32;
    g.row_kernel = k->row;
    g.dh_split = k->split;
    g.mean = k->mean;
    g.dloss = k->dloss;

    st = dev_alloc(c, &d, h, W, lab, N, D, V, &e);
    if (st == LM_OK)
        st = gpu_train(c, &g, &d, dW0, &o, &e);
    if (st != LM_OK) {
        bad = bo_fail(c, "cross_entropy", shape, &e);
        goto done;
    }
    {
        int32_t gcnt;
        memcpy(&gcnt, &o.sc[1], sizeof gcnt);
        const float lg = gcnt > 0 ? o.sc[0] / (float)gcnt : o.sc[0], lr = (float)loss;
        const float cg = (float)gcnt, cr = (float)cnt;
        const double tl = k->f32 ? 1e-5 : 1e-3;
        bad |= bo_check(c, "cross_entropy", "f32", shape, "count", &cg, &cr, 1, 0.0);
        bad |= bo_check(c, "cross_entropy", "f32", shape, "loss", &lg, &lr, 1, tl);
        bad |= bo_check(c, "cross_entropy", "f32", shape, "nll", o.nll, nll_ref, N, tl);
        bad |= bo_check(c, "cross_entropy", "bf16", shape, "dh", o.dh, dh_ref, nh, BO_TOL_GRAD);
        /* the += of this call alone, in a copy: (x - a) + a is not x in floating point, and
         * the bitwise checks below compare the downloaded bits */
        float *inc = LM_MALLOC(sizeof(float) * (size_t)nw);
        for (int64_t i = 0; i < nw; i++)
            inc[i] = o.dW[i] - dW0[i];
        bad |= bo_check(c, "cross_entropy", "f32", shape, "dW", inc, dW_ref, nw, BO_TOL_GRAD);
        free(inc);
    }
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0: the same call again; pass 1: the other row kernel. Every output bitwise
         * the same as the first call's (from the same dW0). */
        if (pass == 0 ? !k->rerun : !k->xrow)
            continue;
        lm_cuda_ce_config g2 = g;
        if (pass == 1)
            g2.row_kernel =
                k->row == LM_CUDA_CE_ROW_STREAM ? LM_CUDA_CE_ROW_STAGED : LM_CUDA_CE_ROW_STREAM;
        st = gpu_train(c, &g2, &d, dW0, &o2, &e);
        if (st != LM_OK) {
            bad |= bo_fail(c, "cross_entropy", shape, &e);
            continue;
        }
        const char *tags[2][4] = {{"rerun dh", "rerun dW", "rerun nll", "rerun loss"},
                                  {"xrow dh", "xrow dW", "xrow nll", "xrow loss"}};
        bad |= check_same(c, shape, tags[pass][0], o.dh, o2.dh, sizeof(float) * (size_t)nh);
        bad |= check_same(c, shape, tags[pass][1], o.dW, o2.dW, sizeof(float) * (size_t)nw);
        bad |= check_same(c, shape, tags[pass][2], o.nll, o2.nll, sizeof(float) * (size_t)N);
        bad |= check_same(c, shape, tags[pass][3], o.sc, o2.sc, 2 * sizeof(float));
    }
    {
        /* the eval forward: loss_sum and nll without gradients */
        lm_status s2 = lm_cuda_ctx_memset(c->cuda, d.nll, 0xFF, sizeof(float) * (size_t)N, &e);
        if (s2 == LM_OK)
            s2 = lm_cuda_ce_forward(c->cuda, &g, d.h, d.W, d.lab, d.sc, NULL, d.nll, &e);
        float sc3[4];
        if (s2 == LM_OK)
            s2 = bo_download_f32(c, sc3, d.sc, 4, &e);
        if (s2 == LM_OK)
            s2 = bo_download_f32(c, o2.nll, d.nll, N, &e);
        if (s2 != LM_OK) {
            bad |= bo_fail(c, "cross_entropy", shape, &e);
        } else {
            const float lf = (float)(loss * (double)cnt);
            const double tl = k->f32 ? 1e-5 : 1e-3;
            bad |= bo_check(c, "cross_entropy", "f32", shape, "eval sum", &sc3[0], &lf, 1, tl);
            /* the same row kernel as the training call: the same nll bits */
            bad |= check_same(c, shape, "eval nll", o.nll, o2.nll, sizeof(float) * (size_t)N);
        }
    }
done:
    dev_free(c, &d);
    host_free(&o);
    host_free(&o2);
    free(h), free(W), free(lab), free(nll_ref), free(dh_ref), free(dW_ref), free(dW0);
    return bad;
}

/* A label outside [0, V) that is not ignore_index: counted, nll NaN, loss_sum NaN, its
 * gradient row zero; the other rows finite (no CPU reference: it refuses such labels). */
static int run_bad_label(bo_ctx *c, int row) {
    lm_error e = {0};
    const int N = 8, D = 64, V = 1000;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d D=%d V=%d bad label%s", N, D, V,
             row == LM_CUDA_CE_ROW_STREAM ? " str" : " stg");
    float *h = LM_MALLOC(sizeof(float) * N * D), *W = LM_MALLOC(sizeof(float) * V * D);
    int32_t lab[8];
    bo_fill_normal(c, h, N * D, 1.0f);
    bo_fill_normal(c, W, (int64_t)V * D, 0.2f);
    for (int i = 0; i < N; i++)
        lab[i] = (int32_t)(lm_rng_u32(&c->rng) % (uint32_t)V);
    lab[2] = V + 5;
    lab[5] = -1;
    float *dW0 = LM_MALLOC(sizeof(float) * V * D);
    memset(dW0, 0, sizeof(float) * V * D);
    ce_host o;
    host_alloc(&o, N * D, (int64_t)V * D, N);
    ce_dev d;
    int bad = 0;
    lm_cuda_ce_config g;
    lm_cuda_ce_config_default(&g, N, D, V);
    g.row_kernel = row;
    lm_status st = dev_alloc(c, &d, h, W, lab, N, D, V, &e);
    if (st == LM_OK)
        st = gpu_train(c, &g, &d, dW0, &o, &e);
    if (st != LM_OK) {
        bad = bo_fail(c, "cross_entropy", shape, &e);
    } else {
        int32_t gcnt;
        memcpy(&gcnt, &o.sc[1], sizeof gcnt);
        /* errors counted: wrong count, a finite nll or loss where NaN is due, a non-zero
         * gradient on the bad or the ignored row, a non-finite value elsewhere */
        float wrong = (float)(gcnt != 7) + (float)!isnan(o.sc[0]) + (float)!isnan(o.nll[2]) +
                      (float)(o.nll[5] != 0.0f);
        for (int i = 0; i < N; i++) {
            if (i != 2 && !isfinite(o.nll[i]))
                wrong += 1;
            for (int j = 0; j < D; j++) {
                const float v = o.dh[i * D + j];
                wrong += (i == 2 || i == 5) ? (float)(v != 0.0f) : (float)!isfinite(v);
            }
        }
        const float zero = 0.0f;
        bad |= bo_check(c, "cross_entropy", "f32", shape, "bad label", &wrong, &zero, 1, 0.0);
    }
    dev_free(c, &d);
    host_free(&o);
    free(h), free(W), free(dW0);
    return bad;
}

/* STAGED for a row larger than the shared memory is refused with LM_ERR_UNSUPPORTED
 * (checked before any scratch or launch) */
static int run_refusal(bo_ctx *c) {
    lm_error e = {0};
    lm_cuda_ce_config g;
    lm_cuda_ce_config_default(&g, 4, 64, 1 << 20);
    g.row_kernel = LM_CUDA_CE_ROW_STAGED;
    float loss_dummy = 0;
    /* pointers are never dereferenced: the refusal comes first (h, W, labels non-NULL) */
    lm_status st =
        lm_cuda_ce_forward(c->cuda, &g, &loss_dummy, &loss_dummy, (const int32_t *)&loss_dummy,
                           (float *)&loss_dummy, NULL, NULL, &e);
    const float got = (float)(st != LM_ERR_UNSUPPORTED), zero = 0.0f;
    return bo_check(c, "cross_entropy", "-", "V=2^20 staged", "refused", &got, &zero, 1, 0.0);
}

int bo_family_cross_entropy(bo_ctx *c) {
    const int before = c->failed;
    enum { A = LM_CUDA_CE_ROW_AUTO, G = LM_CUDA_CE_ROW_STAGED, T = LM_CUDA_CE_ROW_STREAM };
    /*  N    D     V     ign chunk f32 row split mean dloss rerun xrow */
    const ce_case cases[] = {
        {1, 64, 1000, 0, 0, 0, A, 0, 1, 1.0f, 0, 0},
        {37, 64, 1000, 5, 0, 0, A, 0, 1, 1.0f, 0, 1},
        {37, 256, 1000, 4, 16, 1, G, 1, 1, 1.0f, 1, 1}, /* fp32 logits, chunks 16, 16, 5 */
        {37, 256, 1001, 3, 8, 1, T, 0, 1, 1.0f, 0, 0},  /* odd V: padded rows */
        {37, 64, 1001, 5, 16, 0, G, 1, 1, 1.0f, 1, 1},  /* bf16 in place, odd V */
        {37, 64, 50304, 3, 0, 1, A, 0, 1, 1.0f, 0, 1},  /* fp32 staged rows of 201 KB */
        {9, 256, 50304, 2, 4, 0, A, 0, 1, 1.0f, 0, 0},
        {64, 128, 50304, 3, 0, 0, G, 8, 1, 1.0f, 1, 1},  /* dh split 8 (6288 columns each) */
        {37, 64, 1008, 2, 16, 0, A, 2, 1, 1.0f, 1, 0},   /* split 2, 3 chunks */
        {21, 62, 1024, 2, 8, 0, T, 4, 1, 1.0f, 0, 1},    /* split 4, D % 4 != 0 */
        {37, 64, 1001, 2, 0, 0, A, 4, 1, 1.0f, 0, 0},    /* split 4 refused by V: 1 */
        {4200, 32, 50304, 7, 0, 0, A, 0, 1, 1.0f, 0, 0}, /* auto: 2 chunks, auto split */
        {6, 64, 131072, 1, 0, 0, A, 0, 1, 1.0f, 0, 0},   /* bf16 row of 256 KB: STREAM */
        {5, 32, 60000, 1, 0, 1, A, 0, 1, 1.0f, 0, 0},    /* fp32 row of 240 KB: STREAM */
        {37, 64, 1000, 5, 0, 0, A, 0, 0, 0.01f, 0, 0},   /* the caller's scale */
        {37, 64, 1000, 5, 0, 1, T, 0, 0, 0.01f, 0, 0},
        {5, 64, 1000, 5, 0, 0, A, 0, 1, 1.0f, 0, 1}, /* every label ignored */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(c, &cases[i]);
    run_bad_label(c, LM_CUDA_CE_ROW_STAGED);
    run_bad_label(c, LM_CUDA_CE_ROW_STREAM);
    run_refusal(c);
    return c->failed - before;
}
