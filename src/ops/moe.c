/* MoE layer: configuration and weight-shape checks, the context (one allocation
 * carved by a size table), and the forward / backward orchestration: router
 * matmul, routing, the counting-sort permutation by expert, the task lists the
 * CPU kernels (cpu/moe_experts.c) run in parallel, and the router backward between
 * the two backward phases. Math: include/linmoe/moe.h. */
#include "linmoe/moe.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#include "ops/cpu/moe_cpu.h"

void lm_moe_config_default(lm_moe_config *c, int hidden_size, int moe_intermediate_size,
                           int num_experts, int num_experts_per_tok, int n_shared_experts) {
    memset(c, 0, sizeof(*c));
    c->hidden_size = hidden_size;
    c->moe_intermediate_size = moe_intermediate_size;
    c->n_shared_experts = n_shared_experts;
    lm_router_config_default(&c->router, num_experts, num_experts_per_tok);
}

lm_status lm_moe_config_validate(const lm_moe_config *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "moe: config is required");
    if (c->hidden_size < 1)
        return lm_errorf(err, LM_ERR_INVALID, "moe: hidden_size = %d (must be >= 1)",
                         c->hidden_size);
    if (c->moe_intermediate_size < 1)
        return lm_errorf(err, LM_ERR_INVALID, "moe: moe_intermediate_size = %d (must be >= 1)",
                         c->moe_intermediate_size);
    if (c->n_shared_experts < 0)
        return lm_errorf(err, LM_ERR_INVALID, "moe: n_shared_experts = %d (must be >= 0)",
                         c->n_shared_experts);
    LM_TRY(lm_router_config_validate(&c->router, err));
    /* BLAS takes int dims and the permuted buffers index rows with int32 */
    const int64_t d = c->hidden_size, f = c->moe_intermediate_size;
    const int64_t fs2 = 2 * (int64_t)c->n_shared_experts * f;
    if (2 * f > INT_MAX || fs2 > INT_MAX || d > INT_MAX / 2)
        return lm_errorf(
            err, LM_ERR_INVALID,
            "moe: moe_intermediate_size = %lld with n_shared_experts = %d is too large "
            "(2 * n_shared_experts * moe_intermediate_size must fit in 32 bits)",
            (long long)f, c->n_shared_experts);
    return LM_OK;
}

static const char *const k_weight_names[LM_MOE_N_WEIGHTS] = {"gate.weight",
                                                             "experts.gate_proj",
                                                             "experts.up_proj",
                                                             "experts.down_proj",
                                                             "shared_experts.gate_proj",
                                                             "shared_experts.up_proj",
                                                             "shared_experts.down_proj"};

const char *lm_moe_weight_name(lm_moe_weight_id id) {
    return (int)id >= 0 && id < LM_MOE_N_WEIGHTS ? k_weight_names[id] : NULL;
}

/* Shape of weight `id` and, per dim, the config field it comes from. */
static int weight_shape(const lm_moe_config *c, lm_moe_weight_id id, int64_t shape[3],
                        const char *field[3]) {
    const int64_t E = c->router.num_experts, d = c->hidden_size, f = c->moe_intermediate_size;
    const int64_t fs = (int64_t)c->n_shared_experts * f;
    static const char *const nE = "num_experts", *const nd = "hidden_size",
                             *const nf = "moe_intermediate_size",
                             *const nfs = "n_shared_experts * moe_intermediate_size";
    const char *dummy[3];
    if (!field)
        field = dummy;
    switch (id) {
    case LM_MOE_GATE_WEIGHT:
        shape[0] = E, shape[1] = d, field[0] = nE, field[1] = nd;
        return 2;
    case LM_MOE_EXPERTS_GATE_PROJ:
    case LM_MOE_EXPERTS_UP_PROJ:
        shape[0] = E, shape[1] = f, shape[2] = d, field[0] = nE, field[1] = nf, field[2] = nd;
        return 3;
    case LM_MOE_EXPERTS_DOWN_PROJ:
        shape[0] = E, shape[1] = d, shape[2] = f, field[0] = nE, field[1] = nd, field[2] = nf;
        return 3;
    case LM_MOE_SHARED_GATE_PROJ:
    case LM_MOE_SHARED_UP_PROJ:
        if (fs == 0)
            return 0;
        shape[0] = fs, shape[1] = d, field[0] = nfs, field[1] = nd;
        return 2;
    case LM_MOE_SHARED_DOWN_PROJ:
        if (fs == 0)
            return 0;
        shape[0] = d, shape[1] = fs, field[0] = nd, field[1] = nfs;
        return 2;
    default:
        return -1;
    }
}

int lm_moe_weight_shape(const lm_moe_config *c, lm_moe_weight_id id, int64_t shape[3]) {
    return weight_shape(c, id, shape, NULL);
}

static void fmt_shape(char *buf, size_t size, int ndim, const int64_t *shape) {
    size_t used = 0;
    int n = snprintf(buf, size, "[");
    if (n > 0)
        used = (size_t)n;
    for (int i = 0; i < ndim && used < size; i++) {
        n = snprintf(buf + used, size - used, "%s%lld", i ? "," : "", (long long)shape[i]);
        if (n < 0)
            break;
        used += (size_t)n;
    }
    if (used < size)
        snprintf(buf + used, size - used, "]");
}

lm_status lm_moe_check_weight_shape(const lm_moe_config *c, lm_moe_weight_id id, int ndim,
                                    const int64_t *shape, lm_error *err) {
    int64_t want[3];
    const char *field[3];
    const int wn = weight_shape(c, id, want, field);
    if (wn < 0)
        return lm_errorf(err, LM_ERR_INVALID, "moe: unknown weight id %d", (int)id);
    const char *name = k_weight_names[id];
    char have[160], exp[160];
    fmt_shape(have, sizeof(have), ndim, shape);
    if (wn == 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "moe: weight '%s' shape %s is given but n_shared_experts = 0", name, have);
    fmt_shape(exp, sizeof(exp), wn, want);
    if (ndim != wn)
        return lm_errorf(err, LM_ERR_INVALID,
                         "moe: weight '%s' shape %s has %d dims; expected %d: %s", name, have, ndim,
                         wn, exp);
    for (int i = 0; i < wn; i++)
        if (shape[i] != want[i])
            return lm_errorf(
                err, LM_ERR_INVALID,
                "moe: weight '%s' shape %s: dim %d is %lld but %s = %lld (expected %s)", name, have,
                i, (long long)shape[i], field[i], (long long)want[i], exp);
    return LM_OK;
}

/* ---------------------------------------------------------------- context */

static int max_tasks_for(int E, int T, int d, int fs) {
    const int rows = (T + MOE_ROW_BLOCK - 1) / MOE_ROW_BLOCK;
    const int dblk = (d + MOE_DIM_BLOCK - 1) / MOE_DIM_BLOCK;
    const int fblk = (fs + MOE_DIM_BLOCK - 1) / MOE_DIM_BLOCK;
    /* backward phase 1: experts + shared rows + d-blocks; phase 2: fs-blocks +
     * d-blocks + rows; forward: experts + rows */
    const int p1 = E + rows + dblk, p2 = fblk + dblk + rows;
    return p1 > p2 ? p1 : p2;
}

lm_status lm_moe_ctx_new(lm_moe_ctx **out, const lm_moe_config *c, int max_tokens, lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "moe: output context pointer is required");
    *out = NULL;
    LM_TRY(lm_moe_config_validate(c, err));
    if (max_tokens < 1)
        return lm_errorf(err, LM_ERR_INVALID, "moe: max_tokens = %d (must be >= 1)", max_tokens);
    const int64_t E = c->router.num_experts, k = c->router.num_experts_per_tok;
    const int64_t d = c->hidden_size, f = c->moe_intermediate_size;
    const int64_t fs = (int64_t)c->n_shared_experts * f;
    const int64_t T = max_tokens, Tk = T * k;
    if (Tk > INT32_MAX)
        return lm_errorf(err, LM_ERR_INVALID,
                         "moe: max_tokens * num_experts_per_tok = %lld exceeds 2^31 - 1",
                         (long long)Tk);

    /* the buffers below hold about (2d + 6f) floats per assignment and (2E + 6fs) per
     * token: refuse sizes whose byte count would not fit comfortably in 64 bits */
    if ((double)Tk * (double)(2 * d + 6 * f + 4) + (double)T * (double)(2 * E + 6 * fs) >
        (double)((int64_t)1 << 58))
        return lm_errorf(err, LM_ERR_INVALID, "moe: max_tokens = %d is too large for this layer",
                         max_tokens);
    lm_moe_ctx *x = (lm_moe_ctx *)calloc(1, sizeof(*x));
    if (!x)
        return lm_errorf(err, LM_ERR_NOMEM, "moe: out of memory allocating the context");
    x->c = *c;
    x->aux_scale = 1.0f;
    x->E = (int)E, x->k = (int)k, x->d = (int)d, x->f = (int)f, x->fs = (int)fs;
    x->max_T = max_tokens;
    x->max_tasks = max_tasks_for(x->E, max_tokens, x->d, x->fs);

    /* size table: every buffer 64-byte aligned inside one allocation */
    struct {
        void **p;
        size_t bytes;
    } tab[] = {
        {(void **)&x->seg_off, sizeof(int64_t) * (size_t)(E + 1)},
        {(void **)&x->cursor, sizeof(int64_t) * (size_t)E},
        {(void **)&x->perm_slot, sizeof(int32_t) * (size_t)Tk},
        {(void **)&x->row_of, sizeof(int32_t) * (size_t)Tk},
        {(void **)&x->tasks, sizeof(moe_task) * (size_t)x->max_tasks},
        {(void **)&x->logits, sizeof(float) * (size_t)(T * E)},
        {(void **)&x->dlogits, sizeof(float) * (size_t)(T * E)},
        {(void **)&x->dw, sizeof(float) * (size_t)Tk},
        {(void **)&x->xp, sizeof(float) * (size_t)(Tk * d)},
        {(void **)&x->H, sizeof(float) * (size_t)(Tk * 2 * f)},
        {(void **)&x->A, sizeof(float) * (size_t)(Tk * f)},
        {(void **)&x->Y, sizeof(float) * (size_t)(Tk * d)},
        {(void **)&x->G, sizeof(float) * (size_t)(Tk * f)},
        {(void **)&x->dH, sizeof(float) * (size_t)(Tk * 2 * f)},
        {(void **)&x->Hs, sizeof(float) * (size_t)(T * 2 * fs)},
        {(void **)&x->As, sizeof(float) * (size_t)(T * fs)},
        {(void **)&x->Gs, sizeof(float) * (size_t)(T * fs)},
        {(void **)&x->dHs, sizeof(float) * (size_t)(T * 2 * fs)},
    };
    const size_t n_tab = sizeof(tab) / sizeof(tab[0]);
    size_t total = 0;
    for (size_t i = 0; i < n_tab; i++)
        total += (tab[i].bytes + 63) / 64 * 64;
    x->mem = aligned_alloc(64, total > 0 ? total : 64);
    if (!x->mem) {
        free(x);
        return lm_errorf(err, LM_ERR_NOMEM, "moe: out of memory allocating %zu bytes for %d tokens",
                         total, max_tokens);
    }
    uint8_t *p = (uint8_t *)x->mem;
    for (size_t i = 0; i < n_tab; i++) {
        *tab[i].p = tab[i].bytes ? (void *)p : NULL;
        p += (tab[i].bytes + 63) / 64 * 64;
    }
    *out = x;
    return LM_OK;
}

void lm_moe_ctx_free(lm_moe_ctx *ctx) {
    if (!ctx)
        return;
    lm_route_free(&ctx->route);
    free(ctx->mem);
    free(ctx);
}

const lm_moe_config *lm_moe_ctx_config(const lm_moe_ctx *ctx) { return ctx ? &ctx->c : NULL; }

void lm_moe_ctx_set_aux_scale(lm_moe_ctx *ctx, float scale) {
    if (ctx && isfinite(scale))
        ctx->aux_scale = scale;
}

const lm_route *lm_moe_ctx_route(const lm_moe_ctx *ctx) {
    return ctx && ctx->T > 0 ? &ctx->route : NULL;
}

/* ---------------------------------------------------------------- forward */

static lm_status check_weights(const lm_moe_ctx *x, const lm_moe_weights *w, lm_error *err) {
    if (!w)
        return lm_errorf(err, LM_ERR_INVALID, "moe: weights are required");
    for (int i = 0; i < LM_MOE_N_WEIGHTS; i++) {
        const int shared = i >= LM_MOE_SHARED_GATE_PROJ;
        if (!w->p[i] && (!shared || x->fs > 0))
            return lm_errorf(err, LM_ERR_INVALID, "moe: weight '%s' is NULL%s", k_weight_names[i],
                             shared ? " (n_shared_experts > 0)" : "");
    }
    return LM_OK;
}

static int add_rows_tasks(moe_task *t, int n, int kind, int T, double cost_per_row) {
    for (int r = 0; r < T; r += MOE_ROW_BLOCK) {
        const int r1 = r + MOE_ROW_BLOCK < T ? r + MOE_ROW_BLOCK : T;
        t[n++] = (moe_task){kind, r, r1, cost_per_row * (r1 - r)};
    }
    return n;
}

static int add_dim_tasks(moe_task *t, int n, int kind, int D, double cost_per_unit) {
    for (int a = 0; a < D; a += MOE_DIM_BLOCK) {
        const int b = a + MOE_DIM_BLOCK < D ? a + MOE_DIM_BLOCK : D;
        t[n++] = (moe_task){kind, a, b, cost_per_unit * (b - a)};
    }
    return n;
}

/* Counting sort of the kept assignments by expert, stable in (token, j) order:
 * segments hold their tokens in increasing order. */
static void build_permutation(lm_moe_ctx *x) {
    const int E = x->E, k = x->k;
    const int64_t n = (int64_t)x->T * k;
    const int64_t *idx = x->route.topk_idx;
    const uint8_t *keep = x->route.keep;
    for (int e = 0; e <= E; e++)
        x->seg_off[e] = 0;
    for (int64_t s = 0; s < n; s++) {
        LM_CHECK(idx[s] >= 0 && idx[s] < E); /* router contract */
        if (keep[s])
            x->seg_off[idx[s] + 1]++;
    }
    for (int e = 0; e < E; e++) {
        x->seg_off[e + 1] += x->seg_off[e];
        x->cursor[e] = x->seg_off[e];
    }
    for (int64_t s = 0; s < n; s++) {
        if (!keep[s]) {
            x->row_of[s] = -1;
            continue;
        }
        const int64_t r = x->cursor[idx[s]]++;
        x->perm_slot[r] = (int32_t)s;
        x->row_of[s] = (int32_t)r;
    }
}

void lm_moe_set_inference(lm_moe_ctx *ctx, int on) {
    if (ctx)
        ctx->infer = on != 0;
}

lm_status lm_moe_forward(lm_moe_ctx *ctx, const lm_moe_weights *w, lm_router_state *st,
                         const float *x, int T, const int64_t *cu_seqlens, int n_cu, int training,
                         float *out, lm_error *err) {
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "moe: context is required");
    if (T < 1 || T > ctx->max_T)
        return lm_errorf(err, LM_ERR_INVALID, "moe: T = %d tokens is outside [1, max_tokens = %d]",
                         T, ctx->max_T);
    if (!x || !out)
        return lm_errorf(err, LM_ERR_INVALID, "moe: %s is NULL", !x ? "x" : "out");
    if (!st)
        return lm_errorf(err, LM_ERR_INVALID, "moe: router state is required");
    if (st->E != ctx->E)
        return lm_errorf(err, LM_ERR_INVALID, "moe: router state has E = %d but num_experts = %d",
                         st->E, ctx->E);
    LM_TRY(check_weights(ctx, w, err));
    const int d = ctx->d;
    for (int64_t i = 0; i < (int64_t)T * d; i++)
        if (!isfinite(x[i]))
            return lm_errorf(
                err, LM_ERR_NONFINITE,
                "moe: input 'x' has a non-finite value (%g) at token %lld, channel %lld",
                (double)x[i], (long long)(i / d), (long long)(i % d));
    ctx->T = 0; /* no valid forward until this one completes */

    moe_run run = {ctx, w, x, NULL, out, NULL, NULL, 0, ctx->infer};
    int n = add_rows_tasks(ctx->tasks, 0, MOE_T_LOGITS_ROWS, T, 2.0 * d * ctx->E);
    lm_moe_cpu_run_tasks(&run, ctx->tasks, n);
    LM_TRY(lm_router_forward(&ctx->c.router, st, ctx->logits, T, cu_seqlens, n_cu, training,
                             &ctx->route, err));
    LM_CHECK(ctx->route.T == T && ctx->route.k == ctx->k && ctx->route.E == ctx->E);
    ctx->T = T;
    ctx->training = training;
    build_permutation(ctx);

    n = 0;
    for (int e = 0; e < ctx->E; e++) {
        const double m = (double)(ctx->seg_off[e + 1] - ctx->seg_off[e]);
        if (m > 0)
            ctx->tasks[n++] = (moe_task){MOE_T_EXPERT, e, 0, 6.0 * m * d * ctx->f};
    }
    if (ctx->fs > 0)
        n = add_rows_tasks(ctx->tasks, n, MOE_T_SHARED_ROWS, T, 6.0 * d * ctx->fs);
    lm_moe_cpu_sort_tasks(ctx->tasks, n);
    lm_moe_cpu_run_tasks(&run, ctx->tasks, n);
    lm_moe_cpu_combine(&run);
    return LM_OK;
}

/* ---------------------------------------------------------------- backward */

lm_status lm_moe_backward(lm_moe_ctx *ctx, const lm_moe_weights *w, const float *x,
                          const float *dout, float *dx, lm_moe_grads *g, lm_error *err) {
    if (!ctx)
        return lm_errorf(err, LM_ERR_INVALID, "moe: context is required");
    if (ctx->T == 0)
        return lm_errorf(err, LM_ERR_INVALID, "moe: backward called before forward");
    if (!x || !dout)
        return lm_errorf(err, LM_ERR_INVALID, "moe: %s is NULL", !x ? "x" : "dout");
    LM_TRY(check_weights(ctx, w, err));
    lm_moe_grads none;
    memset(&none, 0, sizeof(none));
    if (!g)
        g = &none;
    const int T = ctx->T, d = ctx->d, f = ctx->f, fs = ctx->fs, E = ctx->E;
    moe_run run = {ctx, w, x, dout, NULL, dx, g, 1, 0};
    memset(ctx->dw, 0, sizeof(float) * (size_t)T * ctx->k); /* dropped assignments: 0 */

    /* phase 1: routed experts (dw, expert grads, routed dx rows), shared rows (dx
     * base), d shared down_proj */
    int n = 0;
    for (int e = 0; e < E; e++) {
        const double m = (double)(ctx->seg_off[e + 1] - ctx->seg_off[e]);
        ctx->tasks[n++] = (moe_task){MOE_T_EXPERT, e, 0, 12.0 * m * d * f};
    }
    if (fs > 0) {
        n = add_rows_tasks(ctx->tasks, n, MOE_T_SHARED_ROWS, T, (dx ? 6.0 : 2.0) * d * fs);
        if (g->p[LM_MOE_SHARED_DOWN_PROJ])
            n = add_dim_tasks(ctx->tasks, n, MOE_T_SHARED_DDOWN, d, 2.0 * T * fs);
    }
    lm_moe_cpu_sort_tasks(ctx->tasks, n);
    lm_moe_cpu_run_tasks(&run, ctx->tasks, n);

    lm_router_config rc = ctx->c.router;
    rc.aux_loss_alpha *= ctx->aux_scale; /* the aux gradient is linear in alpha */
    LM_TRY(lm_router_backward(&rc, &ctx->route, ctx->dw, ctx->dlogits, err));

    /* phase 2: d gate.weight, d shared gate/up, dx rows */
    n = 0;
    if (g->p[LM_MOE_GATE_WEIGHT])
        n = add_dim_tasks(ctx->tasks, n, MOE_T_ROUTER_DW, d, 2.0 * T * E);
    if (fs > 0 && (g->p[LM_MOE_SHARED_GATE_PROJ] || g->p[LM_MOE_SHARED_UP_PROJ]))
        n = add_dim_tasks(ctx->tasks, n, MOE_T_SHARED_DGATEUP, fs, 4.0 * T * d);
    if (dx)
        n = add_rows_tasks(ctx->tasks, n, MOE_T_DX_ROWS, T, 2.0 * d * (E + ctx->k));
    lm_moe_cpu_sort_tasks(ctx->tasks, n);
    lm_moe_cpu_run_tasks(&run, ctx->tasks, n);
    return LM_OK;
}

/* ---------------------------------------------------------------- FLOPs */

double lm_moe_forward_flops(const lm_moe_config *c, int64_t T, int64_t assignments) {
    const double d = c->hidden_size, f = c->moe_intermediate_size;
    const double fs = (double)c->n_shared_experts * f;
    return 2.0 * T * d * c->router.num_experts + 6.0 * d * f * (double)assignments +
           6.0 * (double)T * d * fs;
}

double lm_moe_backward_flops(const lm_moe_config *c, int64_t T, int64_t assignments) {
    const double d = c->hidden_size, f = c->moe_intermediate_size;
    const double fs = (double)c->n_shared_experts * f;
    return 4.0 * T * d * c->router.num_experts + 12.0 * d * f * (double)assignments +
           12.0 * (double)T * d * fs;
}
