/* test_backend_ops family "adamw": lm_cuda_adamw_grad_norm / lm_cuda_adamw_step
 * (include/linmoe/cuda_optim.h) against the CPU trainer's lm_adamw_grad_norm / lm_adamw_step
 * (src/train/adamw.c) and its clipping rule (src/train/train.c), on ~10^5 parameters in
 * segments like a params.h table: decayed and not, a count that is not a multiple of 4 or
 * of the tile, an offset that is not 16-byte aligned (the scalar path), and elements outside
 * every segment (buffers: must stay untouched). Two steps each with clipping active and
 * inactive; a non-finite gradient (the step is skipped, nothing moves, the flag is set);
 * and a bitwise re-run. fp32 outputs to 1e-6 (the kernel follows the CPU's rounding order;
 * only the fp64 norm's summation order differs). */
#include <stdlib.h>
#include <string.h>

#include "bo.h"
#include "linmoe/cuda_optim.h"
#include "train/train_internal.h"

#define NUMEL 100003

static const lm_cuda_adamw_segment SEGS[] = {
    {0, 40000, 1},     /* a matrix: 2 full tiles and a partial one */
    {40016, 1024, 0},  /* a norm weight; [40000, 40016) is a buffer */
    {41040, 37001, 1}, /* odd count */
    {78043, 21957, 0}, /* offset not a multiple of 4: scalar path; 3 buffer elements after */
};
#define NSEG ((int)(sizeof SEGS / sizeof SEGS[0]))

/* the CPU optimizer over the same segments (lm_adamw_init's block table, built here
 * without an lm_params) */
static void cpu_init(lm_adamw *a, float *m, float *v) {
    memset(a, 0, sizeof *a);
    int64_t nb = 0;
    for (int i = 0; i < NSEG; i++)
        nb += (SEGS[i].count + LM_ADAMW_BLOCK - 1) / LM_ADAMW_BLOCK;
    a->m = m, a->v = v, a->nblk = nb, a->blk1 = nb; /* one rank: lo = 0, every block */
    a->blk_off = LM_MALLOC(sizeof(int64_t) * (size_t)nb);
    a->blk_len = LM_MALLOC(sizeof(int64_t) * (size_t)nb);
    a->blk_decay = LM_MALLOC((size_t)nb);
    a->partial = LM_MALLOC(sizeof(double) * (size_t)nb);
    int64_t k = 0;
    for (int i = 0; i < NSEG; i++)
        for (int64_t o = 0; o < SEGS[i].count; o += LM_ADAMW_BLOCK, k++) {
            a->blk_off[k] = SEGS[i].offset + o;
            a->blk_len[k] = SEGS[i].count - o < LM_ADAMW_BLOCK ? SEGS[i].count - o : LM_ADAMW_BLOCK;
            a->blk_decay[k] = (uint8_t)SEGS[i].decay;
        }
}

static void cpu_free(lm_adamw *a) {
    free(a->blk_off);
    free(a->blk_len);
    free(a->blk_decay);
    free(a->partial);
}

static int check_same(bo_ctx *c, const char *shape, const char *tensor, const void *a,
                      const void *b, size_t bytes) {
    const unsigned char *x = a, *y = b;
    float diff = 0.0f, zero = 0.0f;
    for (size_t i = 0; i < bytes; i++)
        diff += x[i] != y[i];
    return bo_check(c, "adamw", "bits", shape, tensor, &diff, &zero, 1, 0.0);
}

typedef struct {
    lm_cuda_adamw_plan *plan;
    float *p, *g, *m, *v, *gn; /* gn: [0] norm, [1] skipped flag (int32) */
    void *pb;
} dev_state;

static lm_status gpu_step(bo_ctx *c, dev_state *d, const lm_cuda_adamw_hparams *hp, const float *g,
                          lm_error *e) {
    LM_TRY(lm_cuda_ctx_upload(c->cuda, d->g, g, sizeof(float) * NUMEL, e));
    LM_TRY(lm_cuda_adamw_grad_norm(c->cuda, d->plan, d->g, d->gn, (int32_t *)(d->gn + 1), e));
    return lm_cuda_adamw_step(c->cuda, d->plan, hp, d->p, d->g, d->m, d->v, d->pb, d->gn, e);
}

static lm_status gpu_upload_state(bo_ctx *c, dev_state *d, const float *p, const float *m,
                                  const float *v, lm_error *e) {
    LM_TRY(lm_cuda_ctx_upload(c->cuda, d->p, p, sizeof(float) * NUMEL, e));
    LM_TRY(lm_cuda_ctx_upload(c->cuda, d->m, m, sizeof(float) * NUMEL, e));
    LM_TRY(lm_cuda_ctx_upload(c->cuda, d->v, v, sizeof(float) * NUMEL, e));
    return lm_cuda_ctx_memset(c->cuda, d->pb, 0xFF, 2 * NUMEL, e);
}

static lm_status gpu_download(bo_ctx *c, dev_state *d, float *p, float *m, float *v, uint16_t *pb,
                              float *gn, lm_error *e) {
    LM_TRY(bo_download_f32(c, p, d->p, NUMEL, e));
    LM_TRY(bo_download_f32(c, m, d->m, NUMEL, e));
    LM_TRY(bo_download_f32(c, v, d->v, NUMEL, e));
    LM_TRY(lm_cuda_ctx_download(c->cuda, pb, d->pb, 2 * NUMEL, e));
    return bo_download_f32(c, gn, d->gn, 2, e);
}

/* two steps from the same start on CPU and GPU; grad_clip as given */
static int run_clip_case(bo_ctx *c, dev_state *d, double grad_clip, const char *shape) {
    lm_error e = {0};
    const size_t fb = sizeof(float) * NUMEL;
    float *p = LM_MALLOC(fb), *m = LM_MALLOC(fb), *v = LM_MALLOC(fb), *g = LM_MALLOC(fb);
    float *op = LM_MALLOC(fb), *om = LM_MALLOC(fb), *ov = LM_MALLOC(fb), *ob = LM_MALLOC(fb);
    float *rb = LM_MALLOC(fb);
    uint16_t *pb = LM_MALLOC(2 * NUMEL);
    bo_fill_normal(c, p, NUMEL, 0.02f);
    bo_fill_normal(c, m, NUMEL, 1e-3f);
    bo_fill_uniform(c, v, NUMEL, 0.0f, 1e-5f);
    lm_cuda_adamw_hparams hp = {3e-3, 0.1, 0.9, 0.95, 1e-8, grad_clip, 0};
    lm_status st = gpu_upload_state(c, d, p, m, v, &e);
    lm_adamw a;
    cpu_init(&a, m, v);
    double norm_ref = 0;
    float gn[2] = {0, 0};
    int bad = 0;
    for (int t = 1; t <= 2 && st == LM_OK; t++) {
        bo_fill_normal(c, g, NUMEL, 0.01f * (float)t); /* norm ~ 3 t */
        hp.step = t;
        st = gpu_step(c, d, &hp, g, &e);
        norm_ref = lm_adamw_grad_norm(&a, g);
        double scale = 1.0;
        if (grad_clip > 0 && norm_ref > grad_clip)
            scale = grad_clip / (norm_ref + 1e-6);
        lm_adamw_step(&a, p, g, scale, hp.lr, hp.weight_decay, hp.beta1, hp.beta2, hp.eps, t);
    }
    if (st == LM_OK)
        st = gpu_download(c, d, op, om, ov, pb, gn, &e);
    if (st != LM_OK) {
        bad = bo_fail(c, "adamw", shape, &e);
    } else {
        const float nr = (float)norm_ref;
        int32_t skipped;
        memcpy(&skipped, &gn[1], sizeof skipped);
        const float sk = (float)skipped, zero = 0.0f;
        bad |= bo_check(c, "adamw", "f32", shape, "grad norm", &gn[0], &nr, 1, 1e-6);
        bad |= bo_check(c, "adamw", "i32", shape, "skipped", &sk, &zero, 1, 0.0);
        bad |= bo_check(c, "adamw", "f32", shape, "p", op, p, NUMEL, 1e-6);
        bad |= bo_check(c, "adamw", "f32", shape, "m", om, m, NUMEL, 1e-6);
        bad |= bo_check(c, "adamw", "f32", shape, "v", ov, v, NUMEL, 1e-6);
        /* the bf16 copy at the segments' elements (the rest stays poisoned) */
        int64_t k = 0;
        for (int s = 0; s < NSEG; s++)
            for (int64_t i = SEGS[s].offset; i < SEGS[s].offset + SEGS[s].count; i++, k++) {
                ob[k] = lm_bf16_to_f32(pb[i]);
                rb[k] = lm_bf16_round(p[i]);
            }
        bad |= bo_check(c, "adamw", "bf16", shape, "p bf16", ob, rb, k, 1e-4);
        /* buffers (outside every segment) untouched: the CPU did not move them either */
        int moved = 0;
        for (int64_t i = 40000; i < 40016; i++)
            moved += pb[i] != 0xFFFF;
        for (int64_t i = 78043 + 21957; i < NUMEL; i++)
            moved += pb[i] != 0xFFFF;
        const float mv = (float)moved;
        bad |= bo_check(c, "adamw", "bf16", shape, "buffers", &mv, &zero, 1, 0.0);
    }
    cpu_free(&a);
    free(p), free(m), free(v), free(g), free(op), free(om), free(ov), free(ob), free(rb), free(pb);
    return bad;
}

/* a NaN gradient: skipped flag, and p, m, v, the bf16 copy exactly as before */
static int run_skip_case(bo_ctx *c, dev_state *d) {
    lm_error e = {0};
    const char *shape = "n=100003 NaN grad";
    const size_t fb = sizeof(float) * NUMEL;
    float *p = LM_MALLOC(fb), *m = LM_MALLOC(fb), *v = LM_MALLOC(fb), *g = LM_MALLOC(fb);
    float *op = LM_MALLOC(fb), *om = LM_MALLOC(fb), *ov = LM_MALLOC(fb);
    uint16_t *pb = LM_MALLOC(2 * NUMEL);
    bo_fill_normal(c, p, NUMEL, 0.02f);
    bo_fill_normal(c, m, NUMEL, 1e-3f);
    bo_fill_uniform(c, v, NUMEL, 0.0f, 1e-5f);
    bo_fill_normal(c, g, NUMEL, 0.01f);
    g[41040 + 777] = NAN;
    lm_cuda_adamw_hparams hp = {3e-3, 0.1, 0.9, 0.95, 1e-8, 1.0, 5};
    float gn[2] = {0, 0};
    lm_status st = gpu_upload_state(c, d, p, m, v, &e);
    if (st == LM_OK)
        st = gpu_step(c, d, &hp, g, &e);
    if (st == LM_OK)
        st = gpu_download(c, d, op, om, ov, pb, gn, &e);
    int bad = 0;
    if (st != LM_OK) {
        bad = bo_fail(c, "adamw", shape, &e);
    } else {
        int32_t skipped;
        memcpy(&skipped, &gn[1], sizeof skipped);
        const float sk = (float)skipped, one = 1.0f, fin = (float)(!isfinite(gn[0]));
        bad |= bo_check(c, "adamw", "i32", shape, "skipped", &sk, &one, 1, 0.0);
        bad |= bo_check(c, "adamw", "f32", shape, "norm NaN", &fin, &one, 1, 0.0);
        bad |= check_same(c, shape, "p kept", op, p, fb);
        bad |= check_same(c, shape, "m kept", om, m, fb);
        bad |= check_same(c, shape, "v kept", ov, v, fb);
        int moved = 0;
        for (int64_t i = 0; i < NUMEL; i++)
            moved += pb[i] != 0xFFFF;
        const float mv = (float)moved, zero = 0.0f;
        bad |= bo_check(c, "adamw", "bf16", shape, "bf16 kept", &mv, &zero, 1, 0.0);
    }
    free(p), free(m), free(v), free(g), free(op), free(om), free(ov), free(pb);
    return bad;
}

/* the same step twice from the same state: bitwise the same results */
static int run_rerun_case(bo_ctx *c, dev_state *d) {
    lm_error e = {0};
    const char *shape = "n=100003 rerun clip";
    const size_t fb = sizeof(float) * NUMEL;
    float *p = LM_MALLOC(fb), *m = LM_MALLOC(fb), *v = LM_MALLOC(fb), *g = LM_MALLOC(fb);
    float *o[2][3];
    uint16_t *pb[2];
    float gn[2][2];
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++)
            o[r][j] = LM_MALLOC(fb);
        pb[r] = LM_MALLOC(2 * NUMEL);
    }
    bo_fill_normal(c, p, NUMEL, 0.02f);
    bo_fill_normal(c, m, NUMEL, 1e-3f);
    bo_fill_uniform(c, v, NUMEL, 0.0f, 1e-5f);
    bo_fill_normal(c, g, NUMEL, 0.01f);
    lm_cuda_adamw_hparams hp = {3e-3, 0.1, 0.9, 0.95, 1e-8, 1.0, 7};
    lm_status st = LM_OK;
    for (int r = 0; r < 2 && st == LM_OK; r++) {
        st = gpu_upload_state(c, d, p, m, v, &e);
        if (st == LM_OK)
            st = gpu_step(c, d, &hp, g, &e);
        if (st == LM_OK)
            st = gpu_download(c, d, o[r][0], o[r][1], o[r][2], pb[r], gn[r], &e);
    }
    int bad = 0;
    if (st != LM_OK) {
        bad = bo_fail(c, "adamw", shape, &e);
    } else {
        bad |= check_same(c, shape, "grad norm", gn[0], gn[1], sizeof gn[0]);
        bad |= check_same(c, shape, "p", o[0][0], o[1][0], fb);
        bad |= check_same(c, shape, "m", o[0][1], o[1][1], fb);
        bad |= check_same(c, shape, "v", o[0][2], o[1][2], fb);
        bad |= check_same(c, shape, "p bf16", pb[0], pb[1], 2 * NUMEL);
    }
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++)
            free(o[r][j]);
        free(pb[r]);
    }
    free(p), free(m), free(v), free(g);
    return bad;
}

int bo_family_adamw(bo_ctx *c) {
    const int before = c->failed;
    lm_error e = {0};
    dev_state d;
    memset(&d, 0, sizeof d);
    const size_t fb = sizeof(float) * NUMEL;
    lm_status st = lm_cuda_adamw_plan_new(c->cuda, SEGS, NSEG, NUMEL, &d.plan, &e);
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(c->cuda, (void **)&d.p, fb, &e);
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(c->cuda, (void **)&d.g, fb, &e);
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(c->cuda, (void **)&d.m, fb, &e);
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(c->cuda, (void **)&d.v, fb, &e);
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(c->cuda, &d.pb, 2 * NUMEL, &e);
    if (st == LM_OK)
        st = lm_cuda_ctx_alloc(c->cuda, (void **)&d.gn, 2 * sizeof(float), &e);
    if (st != LM_OK) {
        bo_fail(c, "adamw", "n=100003", &e);
    } else {
        run_clip_case(c, &d, 0.0, "n=100003 clip off");
        run_clip_case(c, &d, 1e9, "n=100003 clip 1e9");
        run_clip_case(c, &d, 1.0, "n=100003 clip 1.0"); /* norm ~ 3, 6: active */
        run_skip_case(c, &d);
        run_rerun_case(c, &d);
    }
    bo_free(c, d.p);
    bo_free(c, d.g);
    bo_free(c, d.m);
    bo_free(c, d.v);
    bo_free(c, d.pb);
    bo_free(c, d.gn);
    lm_cuda_adamw_plan_free(d.plan);
    return c->failed - before;
}
