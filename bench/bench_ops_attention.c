/* `linmoe bench ops` family "attention" (bench/bench_ops.h): the CUDA attention op
 * (include/linmoe/cuda_attention.h), causal, NoPE (the peer has no RoPE), bf16, D = 128, at
 * the GPU configs' 32768 tokens per step:
 *   "B=8 T=4096 H=8/8 D=128", "B=8 T=4096 H=16/4 D=128", "B=4 T=8192 H=8/8 D=128",
 *   "B=4 T=8192 H=16/4 D=128", "varlen8 T=32768 H=16/4 D=128", "varlen8 T=32768 H=8/8 D=128"
 * (varlen8: B = 1 with cu_seqlens of 8 documents of 8192, 2048, 6144, 1024, 4096, 3072,
 * 5120 and 3072 tokens), passes "fwd" (forward with lse, as in training) and "fwd+bwd";
 * and the decode step "attention_decode" "B=32 L=8192 H=16/4 D=128" pass "step" (one
 * token per row against a full 8192-position cache). Three implementations per shape:
 *   "attention"         the default (AUTO: cuDNN's fused engines where they build, the
 *                       deterministic backward: context option "deterministic" = 1);
 *   "attention_own"     linmoe's own kernels (set_impl / set_bwd_impl OWN), deterministic;
 *   "attention_nondet"  the default with "deterministic" = 0 (cuDNN's atomic dQ), fwd+bwd
 *                       only (its forward is the default's).
 * Each row's stderr note says which implementation ran (lm_cuda_attention_last_impl).
 * FLOPs: causal forward 2 * 2 * Hq * D * sum over sequences of len^2 / 2, backward 2.5x the
 * forward (fwd+bwd 3.5x); decode 4 * B * Hq * L * D.
 * Bytes (each tensor once): forward q, k, v read, o, lse written; backward q, k, v, o, do,
 * lse read, dq, dk, dv written; decode the two caches read (B * L * Hkv * D * 2 each).
 * Peer: torch SDPA (is_causal, enable_gqa) and torch's varlen attention, in
 * scripts/gpu/ops_peers/attention.py. --quick runs the first, the fifth and the decode. */
#include <stdio.h>
#include <string.h>

#include "bench_ops.h"
#include "linmoe/cuda_attention.h"

typedef struct {
    lm_cuda_ctx *ctx;
    lm_attention_config cfg;
    void *q, *k, *v, *o, *dO, *dq, *dk, *dv;
    float *lse;
    int bwd;
} attn_arg;

static int attn_fn(void *p) {
    attn_arg *a = p;
    lm_error e = {0};
    if (lm_cuda_attention_forward(a->ctx, &a->cfg, a->q, a->k, a->v, a->o, a->lse, &e) != LM_OK ||
        (a->bwd && lm_cuda_attention_backward(a->ctx, &a->cfg, a->q, a->k, a->v, a->o, a->lse,
                                              a->dO, a->dq, a->dk, a->dv, &e) != LM_OK)) {
        fprintf(stderr, "bench attention: %s\n", e.msg);
        return 1;
    }
    return 0;
}

typedef struct {
    int B, T, Hq, Hkv, D, varlen;
} attn_shape;

static const int64_t k_varlen8[] = {0, 8192, 10240, 16384, 17408, 21504, 24576, 29696, 32768};

static int bench_one(lm_bench_ops_env *env, const attn_shape *s) {
    lm_error e = {0};
    const int64_t BT = (int64_t)s->B * s->T, nq = BT * s->Hq * s->D, nk = BT * s->Hkv * s->D;
    attn_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = env->ctx;
    lm_attention_config_default(&a.cfg, s->B, s->T, s->Hq, s->Hkv, s->D);
    if (s->varlen) {
        a.cfg.cu_seqlens = k_varlen8;
        a.cfg.n_cu_seqlens = 9;
    }
    int rc = 1;
    void **bufs[] = {&a.q, &a.o, &a.dO, &a.dq, &a.k, &a.v, &a.dk, &a.dv};
    for (int i = 0; i < 8; i++)
        if (lm_cuda_ctx_alloc(env->ctx, bufs[i], (size_t)(i < 4 ? nq : nk) * 2, &e) != LM_OK)
            goto fail;
    if (lm_cuda_ctx_alloc(env->ctx, (void **)&a.lse, (size_t)(BT * s->Hq) * 4, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.q, nq, 11, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.k, nk, 12, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.v, nk, 13, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.dO, nq, 14, 0.0f, 1.0f, &e) != LM_OK)
        goto fail;
    double sq = 0.0; /* sum over sequences of len^2 */
    if (s->varlen)
        for (int i = 0; i < 8; i++)
            sq += (double)(k_varlen8[i + 1] - k_varlen8[i]) *
                  (double)(k_varlen8[i + 1] - k_varlen8[i]);
    else
        sq = (double)s->B * s->T * (double)s->T;
    const double fwd_flops = 2.0 * 2.0 * s->Hq * s->D * sq / 2.0;
    const double qb = (double)nq * 2, kb = (double)nk * 2, lb = (double)BT * s->Hq * 4;
    const double fwd_bytes = 2 * qb + 2 * kb + lb, bwd_bytes = 3 * qb + 4 * kb + lb + 2 * qb;
    char shape[96];
    if (s->varlen)
        snprintf(shape, sizeof shape, "varlen8 T=%d H=%d/%d D=%d", s->T, s->Hq, s->Hkv, s->D);
    else
        snprintf(shape, sizeof shape, "B=%d T=%d H=%d/%d D=%d", s->B, s->T, s->Hq, s->Hkv, s->D);
    static const struct {
        const char *name;
        int impl, det, fwd;
    } impls[3] = {{"attention", LM_CUDA_ATTN_AUTO, 1, 1},
                  {"attention_own", LM_CUDA_ATTN_OWN, 1, 1},
                  {"attention_nondet", LM_CUDA_ATTN_AUTO, 0, 0}};
    static const char *impl_name[4] = {"-", "own", "cudnn", "simple"};
    for (int m = 0; m < 3; m++) {
        if (lm_cuda_attention_set_impl(env->ctx, impls[m].impl, &e) != LM_OK ||
            lm_cuda_attention_set_bwd_impl(env->ctx, impls[m].impl, &e) != LM_OK ||
            lm_cuda_ctx_set_option(env->ctx, "deterministic", impls[m].det, &e) != LM_OK)
            goto fail;
        for (int bwd = impls[m].fwd ? 0 : 1; bwd < 2; bwd++) {
            a.bwd = bwd;
            const double ms = lm_bench_ops_time(env, attn_fn, &a);
            if (ms < 0)
                goto fail;
            const int fi = lm_cuda_attention_last_impl(env->ctx);
            const int bi = lm_cuda_attention_last_bwd_impl(env->ctx);
            fprintf(stderr, "bench %s %s %s: forward %s%s%s\n", impls[m].name, shape,
                    bwd ? "fwd+bwd" : "fwd", impl_name[fi >= 0 && fi < 4 ? fi : 0],
                    bwd ? ", backward " : "", bwd ? impl_name[bi >= 0 && bi < 4 ? bi : 0] : "");
            lm_bench_ops_row(env, impls[m].name, shape, bwd ? "fwd+bwd" : "fwd", ms,
                             bwd ? 3.5 * fwd_flops : fwd_flops,
                             bwd ? fwd_bytes + bwd_bytes : fwd_bytes, (double)BT);
        }
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "bench attention: %s\n", e.msg);
done:
    lm_cuda_attention_set_impl(env->ctx, LM_CUDA_ATTN_AUTO, NULL);
    lm_cuda_attention_set_bwd_impl(env->ctx, LM_CUDA_ATTN_AUTO, NULL);
    lm_cuda_ctx_set_option(env->ctx, "deterministic", 1, NULL);
    for (int i = 0; i < 8; i++)
        lm_cuda_ctx_free_mem(env->ctx, *bufs[i]);
    lm_cuda_ctx_free_mem(env->ctx, a.lse);
    return rc;
}

typedef struct {
    lm_cuda_ctx *ctx;
    lm_attention_config cfg;
    int64_t Tmax, pos;
    void *q, *kc, *vc, *o;
    float *lse;
} decode_arg;

static int decode_fn(void *p) {
    decode_arg *a = p;
    lm_error e = {0};
    if (lm_cuda_attention_decode(a->ctx, &a->cfg, a->Tmax, a->pos, a->q, a->kc, a->vc, a->o, a->lse,
                                 &e) != LM_OK) {
        fprintf(stderr, "bench attention decode: %s\n", e.msg);
        return 1;
    }
    return 0;
}

static int bench_decode(lm_bench_ops_env *env) {
    const int B = 32, L = 8192, Hq = 16, Hkv = 4, D = 128;
    lm_error e = {0};
    decode_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = env->ctx;
    lm_attention_config_default(&a.cfg, B, 1, Hq, Hkv, D);
    a.Tmax = L;
    a.pos = L - 1;
    const int64_t nc = (int64_t)B * L * Hkv * D, nq = (int64_t)B * Hq * D;
    int rc = 1;
    if (lm_cuda_ctx_alloc(env->ctx, &a.q, (size_t)nq * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.o, (size_t)nq * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.kc, (size_t)nc * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, &a.vc, (size_t)nc * 2, &e) != LM_OK ||
        lm_cuda_ctx_alloc(env->ctx, (void **)&a.lse, (size_t)B * Hq * 4, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.q, nq, 21, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.kc, nc, 22, 0.0f, 1.0f, &e) != LM_OK ||
        lm_cuda_fill_normal_bf16(env->ctx, a.vc, nc, 23, 0.0f, 1.0f, &e) != LM_OK) {
        fprintf(stderr, "bench attention decode: %s\n", e.msg);
        goto done;
    }
    const double ms = lm_bench_ops_time(env, decode_fn, &a);
    if (ms < 0)
        goto done;
    char shape[96];
    snprintf(shape, sizeof shape, "B=%d L=%d H=%d/%d D=%d", B, L, Hq, Hkv, D);
    lm_bench_ops_row(env, "attention_decode", shape, "step", ms, 4.0 * B * Hq * (double)L * D,
                     2.0 * (double)nc * 2, (double)B);
    rc = 0;
done:
    lm_cuda_ctx_free_mem(env->ctx, a.q);
    lm_cuda_ctx_free_mem(env->ctx, a.o);
    lm_cuda_ctx_free_mem(env->ctx, a.kc);
    lm_cuda_ctx_free_mem(env->ctx, a.vc);
    lm_cuda_ctx_free_mem(env->ctx, a.lse);
    return rc;
}

int lm_bench_ops_attention(lm_bench_ops_env *env) {
    const attn_shape shapes[] = {
        {8, 4096, 8, 8, 128, 0},  {8, 4096, 16, 4, 128, 0},  {4, 8192, 8, 8, 128, 0},
        {4, 8192, 16, 4, 128, 0}, {1, 32768, 16, 4, 128, 1}, {1, 32768, 8, 8, 128, 1},
    };
    int rc = 0;
    for (int i = 0; i < (int)(sizeof shapes / sizeof shapes[0]); i++)
        if (!env->quick || i == 0 || i == 4)
            rc |= bench_one(env, &shapes[i]);
    rc |= bench_decode(env);
    return rc;
}
