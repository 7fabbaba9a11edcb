/* AdamW and the fixed-order gradient norm (src/train/train_internal.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/train_internal.h"

void lm_adamw_init(lm_adamw *a, const lm_params *p) { lm_adamw_init_shard(a, p, 0, 1); }

void lm_adamw_shard_range(const lm_adamw *a, int rank, int world, int64_t *lo, int64_t *hi) {
    const int64_t b0 = a->nblk * rank / world, b1 = a->nblk * (rank + 1) / world;
    *lo = rank == 0 ? 0 : (b0 < a->nblk ? a->blk_off[b0] : a->p->numel);
    *hi = rank == world - 1 ? a->p->numel : (b1 < a->nblk ? a->blk_off[b1] : a->p->numel);
}

void lm_adamw_init_shard(lm_adamw *a, const lm_params *p, int rank, int world) {
    LM_CHECK(world >= 1 && rank >= 0 && rank < world);
    memset(a, 0, sizeof *a);
    a->p = p;
    int64_t nb = 0;
    for (int i = 0; i < p->n; i++)
        if (!p->t[i].buffer)
            nb += (p->t[i].numel + LM_ADAMW_BLOCK - 1) / LM_ADAMW_BLOCK;
    a->nblk = nb;
    a->blk_off = LM_MALLOC((size_t)(nb > 0 ? nb : 1) * sizeof(int64_t));
    a->blk_len = LM_MALLOC((size_t)(nb > 0 ? nb : 1) * sizeof(int64_t));
    a->blk_decay = LM_MALLOC((size_t)(nb > 0 ? nb : 1));
    a->partial = LM_MALLOC((size_t)(nb > 0 ? nb : 1) * sizeof(double));
    int64_t k = 0;
    for (int i = 0; i < p->n; i++) {
        const lm_param_info *t = &p->t[i];
        if (t->buffer)
            continue;
        for (int64_t o = 0; o < t->numel; o += LM_ADAMW_BLOCK) {
            a->blk_off[k] = t->offset + o;
            a->blk_len[k] = t->numel - o < LM_ADAMW_BLOCK ? t->numel - o : LM_ADAMW_BLOCK;
            a->blk_decay[k] = t->decay;
            k++;
        }
    }
    a->blk0 = nb * rank / world;
    a->blk1 = nb * (rank + 1) / world;
    lm_adamw_shard_range(a, rank, world, &a->lo, &a->hi);
    const int64_t n = a->hi - a->lo;
    a->m = LM_CALLOC((size_t)(n > 0 ? n : 1) * 2, sizeof(float));
    a->v = a->m + n;
}

void lm_adamw_free(lm_adamw *a) {
    if (!a)
        return;
    free(a->m);
    free(a->blk_off);
    free(a->blk_len);
    free(a->blk_decay);
    free(a->partial);
    memset(a, 0, sizeof *a);
}

void lm_adamw_grad_partials(lm_adamw *a, const float *gs) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < a->nblk; b++) {
        if (b < a->blk0 || b >= a->blk1) {
            a->partial[b] = 0;
            continue;
        }
        const float *x = gs + (a->blk_off[b] - a->lo);
        double s = 0;
        for (int64_t i = 0; i < a->blk_len[b]; i++)
            s += (double)x[i] * (double)x[i];
        a->partial[b] = s;
    }
}

double lm_adamw_norm_of_partials(const lm_adamw *a) {
    double s = 0;
    for (int64_t b = 0; b < a->nblk; b++)
        s += a->partial[b];
    return sqrt(s);
}

double lm_adamw_grad_norm(lm_adamw *a, const float *g) {
    LM_CHECK(a->lo == 0 && a->blk0 == 0 && a->blk1 == a->nblk); /* one rank */
    lm_adamw_grad_partials(a, g);
    return lm_adamw_norm_of_partials(a);
}

void lm_adamw_step(lm_adamw *a, float *params, const float *gsh, double gscale, double lr,
                   double wd, double b1, double b2, double eps, int64_t t) {
    const double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
    const float fb1 = (float)b1, fb2 = (float)b2, f1b1 = (float)(1.0 - b1),
                f1b2 = (float)(1.0 - b2);
    const float step = (float)(lr / bc1), isb2 = (float)(1.0 / sqrt(bc2)), feps = (float)eps;
    const float gs = (float)gscale, decay = (float)(1.0 - lr * wd);
#pragma omp parallel for schedule(static)
    for (int64_t b = a->blk0; b < a->blk1; b++) {
        const int64_t o = a->blk_off[b], n = a->blk_len[b];
        float *p = params + o, *m = a->m + (o - a->lo), *v = a->v + (o - a->lo);
        const float *gr = gsh + (o - a->lo);
        const float dk = a->blk_decay[b] ? decay : 1.0f;
        for (int64_t i = 0; i < n; i++) {
            const float gi = gr[i] * gs;
            m[i] = fb1 * m[i] + f1b1 * gi;
            v[i] = fb2 * v[i] + f1b2 * gi * gi;
            p[i] = p[i] * dk - step * m[i] / (sqrtf(v[i]) * isb2 + feps);
        }
    }
}
