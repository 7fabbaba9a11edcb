/* `linmoe bench ops` family "adamw" (bench/bench_ops.h): the global gradient norm and the
 * fused AdamW update (include/linmoe/cuda_optim.h) over 400 M fp32 parameters in 10
 * segments of 40 M (decayed and not, alternating), with clipping active. Bytes: the norm
 * reads g (4 B / parameter); the update reads p, g, m, v and writes p, m, v and the bf16
 * copy (30 B); the step row is both (34 B). Peer: torch.optim.AdamW(fused=True) after
 * torch.nn.utils.clip_grad_norm_(foreach=True) (scripts/gpu/ops_peers/adamw.py). */
#include <stdio.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_optim.h"

#define NSEG 10
#define SEG_N 40000000LL

typedef struct {
    lm_cuda_ctx *ctx;
    lm_cuda_adamw_plan *plan;
    lm_cuda_adamw_hparams hp;
    float *p, *g, *m, *v, *gn;
    void *pb;
    int what; /* 0 norm + step, 1 norm, 2 step */
} adamw_arg;

static int adamw_fn(void *q) {
    adamw_arg *a = q;
    lm_error e = {0};
    lm_status st = LM_OK;
    if (a->what != 2)
        st = lm_cuda_adamw_grad_norm(a->ctx, a->plan, a->g, a->gn, (int32_t *)(a->gn + 1), &e);
    if (st == LM_OK && a->what != 1)
        st = lm_cuda_adamw_step(a->ctx, a->plan, &a->hp, a->p, a->g, a->m, a->v, a->pb, a->gn, &e);
    if (st != LM_OK) {
        fprintf(stderr, "bench adamw: %s\n", e.msg);
        return 1;
    }
    return 0;
}

int lm_bench_ops_adamw(lm_bench_ops_env *env) {
    lm_error e = {0};
    const int64_t n = NSEG * SEG_N;
    lm_cuda_adamw_segment seg[NSEG];
    for (int i = 0; i < NSEG; i++) {
        seg[i].offset = i * SEG_N;
        seg[i].count = SEG_N;
        seg[i].decay = (i % 2) == 0;
    }
    adamw_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = env->ctx;
    /* the step stays at t = 1 (bias corrections do not change the cost) */
    a.hp = (lm_cuda_adamw_hparams){1e-3, 0.1, 0.9, 0.95, 1e-8, 1.0, 1};
    int rc = 1;
    const size_t fb = (size_t)n * sizeof(float);
    if (lm_cuda_adamw_plan_new(env->ctx, seg, NSEG, n, &a.plan, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.p, fb, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.g, fb, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.m, fb, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.v, fb, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.pb, (size_t)n * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.gn, 16, &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, a.p, n, 21, 0.0f, 0.02f, &e) != LM_OK ||
        lm_cuda_fill_normal_f32(env->ctx, a.g, n, 22, 0.0f, 1e-4f, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, a.m, 0, fb, &e) != LM_OK ||
        lm_cuda_ctx_memset(env->ctx, a.v, 0, fb, &e) != LM_OK) {
        fprintf(stderr, "bench adamw: %s\n", e.msg);
        goto done;
    }
    const char *shape = "params=400M segs=10";
    static const char *const names[3] = {"adamw", "adamw_norm", "adamw_update"};
    static const double bytes_per[3] = {34.0, 4.0, 30.0};
    for (int w = 0; w < 3; w++) {
        a.what = w;
        const double ms = lm_bench_ops_time(env, adamw_fn, &a);
        if (ms < 0)
            goto done;
        lm_bench_ops_row(env, names[w], shape, "step", ms, 0.0, bytes_per[w] * (double)n, 0);
    }
    rc = 0;
done:
    lm_cuda_ctx_free_mem(env->ctx, a.p);
    lm_cuda_ctx_free_mem(env->ctx, a.g);
    lm_cuda_ctx_free_mem(env->ctx, a.m);
    lm_cuda_ctx_free_mem(env->ctx, a.v);
    lm_cuda_ctx_free_mem(env->ctx, a.pb);
    lm_cuda_ctx_free_mem(env->ctx, a.gn);
    lm_cuda_adamw_plan_free(a.plan);
    return rc;
}
